/* libFuzzer target for the CSV reader (data/dataset_csv.c).
 *
 * The first two bytes choose the options (header or none, label column and
 * dtype, input dtype, delimiter, skipped lines, non-finite cells, a class
 * bound, a sample shape); the rest is the file, parsed from memory by
 * nb__csv_parse as nb_dataset_open_csv parses a file's bytes. A refused
 * file must leave no dataset and a message that starts with the file's
 * name; an accepted one must give every sample, each label an integer in
 * [0, max_classes) when the label dtype is an integer one, and only finite
 * values unless non-finite cells were allowed. */
/* smoke-instrument: data/dataset_csv.c */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"

static double value(nb_dtype dtype, const void *p, int64_t i) {
    switch (dtype) {
    case NB_F32: return ((const float *)p)[i];
    case NB_F64: return ((const double *)p)[i];
    case NB_I32: return ((const int32_t *)p)[i];
    case NB_I64: return (double)((const int64_t *)p)[i];
    default: abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    static const nb_dtype labels[] = {NB_I64, NB_I32, NB_F32, NB_F64};
    uint8_t f = data[0], g = data[1];
    nb_csv_options o = nb_csv_defaults();
    o.no_header = f & 1;
    o.allow_nonfinite = (f & 2) != 0;
    o.label_dtype = labels[(f >> 2) & 3];
    o.input_dtype = f & 16 ? NB_F64 : NB_F32;
    o.delimiter = f & 32 ? ';' : ',';
    o.label_index = (int)(g & 7) - 4; /* -4 .. 3 */
    o.skip_lines = (g >> 3) & 3;
    o.max_classes = g & 32 ? 16 : 0;
    if (g & 64) {
        o.sample_ndim = 2;
        o.sample_shape[0] = 2;
        o.sample_shape[1] = 2;
    }
    data += 2;
    size -= 2;
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    buf[size] = 0;
    nb_dataset *ds = (nb_dataset *)&o;
    nb_status st = nb__csv_parse(&ds, "fuzz.csv", buf, size, &o); /* takes buf */
    if (st != NB_OK) {
        if (ds || strncmp(nb_last_error(), "fuzz.csv", 8) != 0) abort();
        return 0;
    }
    int64_t n = nb_dataset_len(ds);
    nb_field in = nb_dataset_input(ds), tg = nb_dataset_target(ds);
    if (n <= 0 || tg.dtype != o.label_dtype || in.dtype != o.input_dtype) abort();
    int64_t n_in = nb_field_numel(&in);
    void *x = malloc(nb_field_bytes(&in)), *y = malloc(nb_field_bytes(&tg));
    if (!x || !y) abort();
    int64_t max = o.max_classes ? o.max_classes : NB_CSV_MAX_CLASSES;
    for (int64_t i = 0; i < n; i++) {
        if (nb_dataset_get(ds, i, x, y) != NB_OK) abort();
        double label = value(tg.dtype, y, 0);
        if (!nb_dtype_is_float(tg.dtype) && (label < 0 || label >= (double)max)) abort();
        if (!o.allow_nonfinite) {
            if (!isfinite(label)) abort();
            for (int64_t k = 0; k < n_in; k++)
                if (!isfinite(value(in.dtype, x, k))) abort();
        }
    }
    free(x);
    free(y);
    nb_dataset_free(ds);
    return 0;
}
