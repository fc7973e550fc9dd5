/* Standardisation: per-element mean and deviation of a dataset's inputs
 * (fitted in double, two passes), and a dataset that applies
 * (x - mean) / std to another's inputs as they are fetched. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "tensor/internal.h"
#include "util/handle.h"

static void check_float_input(const char *op, const nb_dataset *ds) {
    nb_field in = nb_dataset_input(ds);
    NB_CHECK(in.dtype == NB_F32 || in.dtype == NB_F64, "%s: %s dataset has %s inputs; "
             "standardisation needs f32 or f64", op, nb_dataset_name(ds), nb_dtype_name(in.dtype));
}

nb_status nb_dataset_fit_standardizer(const nb_dataset *ds, double *mean, double *std) {
    NB__CHECK_HANDLE("nb_dataset_fit_standardizer", ds, "dataset");
    check_float_input("nb_dataset_fit_standardizer", ds);
    nb_field in = nb_dataset_input(ds), tgt = nb_dataset_target(ds);
    int64_t n = nb_dataset_len(ds), f = nb_field_numel(&in);
    NB_CHECK(n > 0, "nb_dataset_fit_standardizer: the %s dataset is empty", nb_dataset_name(ds));
    size_t esz = nb_dtype_size(in.dtype);
    char *x = malloc(nb_field_bytes(&in)), *y = malloc(nb_field_bytes(&tgt) + 1);
    double *acc = calloc((size_t)f, sizeof *acc);
    NB_CHECK(x && y && acc, "nb_dataset_fit_standardizer: out of memory");
    nb_status st = NB_OK;
    for (int pass = 0; pass < 2 && !st; pass++) {
        memset(acc, 0, sizeof *acc * (size_t)f);
        for (int64_t i = 0; i < n && !st; i++) {
            st = nb__dataset_get(ds, i, x, y);
            for (int64_t k = 0; k < f && !st; k++) {
                double v = nb__load(x + (size_t)k * esz, in.dtype);
                if (pass == 0) acc[k] += v;
                else acc[k] += (v - mean[k]) * (v - mean[k]);
            }
        }
        for (int64_t k = 0; k < f && !st; k++) {
            if (pass == 0) mean[k] = acc[k] / (double)n;
            else {
                double s = sqrt(acc[k] / (double)n);
                std[k] = s > 0 ? s : 1.0;
            }
        }
    }
    free(x);
    free(y);
    free(acc);
    return st;
}

typedef struct standard_ds {
    nb_dataset *base;
    nb_dtype dtype;
    int64_t numel;
    double *mean, *std;
} standard_ds;

static int64_t standard_len(void *self) { return nb_dataset_len(((standard_ds *)self)->base); }

static nb_status standard_get(void *self, int64_t i, void *input, void *target) {
    standard_ds *s = self;
    nb_status st = nb__dataset_get(s->base, i, input, target);
    if (st) return st;
    if (s->dtype == NB_F32) {
        float *x = input;
        for (int64_t k = 0; k < s->numel; k++)
            x[k] = (float)(((double)x[k] - s->mean[k]) / s->std[k]);
    } else {
        double *x = input;
        for (int64_t k = 0; k < s->numel; k++) x[k] = (x[k] - s->mean[k]) / s->std[k];
    }
    return NB_OK;
}

static void standard_free(void *self) {
    standard_ds *s = self;
    nb_dataset_free(s->base);
    free(s->mean);
    free(s->std);
    free(s);
}

static const nb_dataset_vtable standard_vt = {"standardized", standard_len, standard_get,
                                              standard_free};

nb_dataset *nb_dataset_standardize(nb_dataset *base, const double *mean, const double *std) {
    NB__CHECK_HANDLE("nb_dataset_standardize", base, "dataset");
    check_float_input("nb_dataset_standardize", base);
    nb_field in = nb_dataset_input(base);
    int64_t f = nb_field_numel(&in);
    for (int64_t k = 0; k < f; k++)
        NB_CHECK(std[k] > 0 && isfinite(std[k]) && isfinite(mean[k]),
                 "nb_dataset_standardize: element %lld: mean %g, std %g; std must be finite "
                 "and > 0", (long long)k, mean[k], std[k]);
    standard_ds *s = calloc(1, sizeof *s);
    double *m = malloc(sizeof *m * (size_t)f), *sd = malloc(sizeof *sd * (size_t)f);
    NB_CHECK(s && m && sd, "nb_dataset_standardize: out of memory");
    for (int64_t k = 0; k < f; k++) {
        m[k] = mean[k];
        sd[k] = std[k];
    }
    s->base = nb_dataset_retain(base);
    s->dtype = in.dtype;
    s->numel = f;
    s->mean = m;
    s->std = sd;
    return nb_dataset_new(&standard_vt, s, in, nb_dataset_target(base));
}
