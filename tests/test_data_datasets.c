/* Datasets: in-memory tensors, CSV (shipped tables and every malformed
 * case), token shards in llm.c's format (written here byte by byte as an
 * independent reference) and their malformed cases, character-level text,
 * subsets, the seeded split and standardisation (against naive double
 * loops over the raw file). Every recoverable error is checked for its
 * status and for a message naming the file and the line/column or byte
 * offset. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/internal.h" /* nb__csv_parse */
#include "testutil.h"

#define SHIPPED(name) NABLA_SOURCE_DIR "/examples/datasets/" name

static char tmpdir[256];

static void make_tmpdir(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/nabla_test_data_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void remove_tmpdir(void) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    ck_assert_int_eq(system(cmd), 0);
}

/* tmpdir/name with `len` bytes of `text` (len < 0: strlen). */
static const char *write_file(const char *name, const char *text, long len) {
    static char path[8][300];
    static int next;
    char *p = path[next++ % 8];
    snprintf(p, 300, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    size_t n = len < 0 ? strlen(text) : (size_t)len;
    ck_assert_uint_eq(fwrite(text, 1, n, f), n);
    fclose(f);
    return p;
}

/* An open of `what` that returned st and ds failed as expected: with
 * `status`, no dataset, and a message containing sub1 (and sub2 unless NULL). */
static void expect_open_failed(const char *what, nb_status st, const nb_dataset *ds, nb_status status,
                               const char *sub1, const char *sub2) {
    ck_assert_msg(st == status, "%s: status %s, expected %s (message: %s)", what,
                  nb_status_str(st), nb_status_str(status), nb_last_error());
    ck_assert_ptr_null(ds);
    ck_assert_msg(strstr(nb_last_error(), sub1), "message \"%s\" lacks \"%s\"", nb_last_error(), sub1);
    if (sub2)
        ck_assert_msg(strstr(nb_last_error(), sub2), "message \"%s\" lacks \"%s\"", nb_last_error(),
                      sub2);
}

/* Opens a CSV that must fail with `status` and a message containing each
 * of the given substrings. */
static void expect_csv_error(const char *path, const nb_csv_options *o, nb_status status,
                             const char *sub1, const char *sub2) {
    nb_dataset *ds = (nb_dataset *)1;
    nb_status st = nb_dataset_open_csv(&ds, path, o);
    expect_open_failed(path, st, ds, status, sub1, sub2);
}

/* A file written with the default options that nb_dataset_open_csv refuses with
 * NB_ERR_FORMAT, its message holding want (with %s the file's path) and sub2. */
typedef struct csv_case {
    const char *name, *text, *want, *sub2;
} csv_case;

static void expect_csv_cases(const csv_case *cases, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char want[1024];
        const char *p = write_file(cases[i].name, cases[i].text, -1);
        snprintf(want, sizeof want, cases[i].want, p);
        expect_csv_error(p, NULL, NB_ERR_FORMAT, want, cases[i].sub2);
    }
}

static void expect_tokens_error_vocab(const char *pattern, int64_t T, int64_t vocab,
                                      nb_status status, const char *sub1, const char *sub2) {
    nb_dataset *ds = (nb_dataset *)1;
    nb_status st = nb_dataset_open_tokens(&ds, pattern, T, 0, vocab);
    expect_open_failed(pattern, st, ds, status, sub1, sub2);
}

static void expect_tokens_error(const char *pattern, int64_t T, nb_status status,
                                const char *sub1, const char *sub2) {
    expect_tokens_error_vocab(pattern, T, 0, status, sub1, sub2);
}

/* ---- in memory ---- */

START_TEST(test_from_tensors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_arange(ctx, NB_F32, 0, 24, 1);
    x = nb_reshape(ctx, x, NB_SHAPE(4, 3, 2));
    nb_tensor *xt = nb_transpose(ctx, x, 1, 2); /* (4, 2, 3), not contiguous */
    nb_tensor *y = nb_from_host(ctx, NB_I64, NB_SHAPE(4), (int64_t[]){3, 1, 4, 1});
    nb_dataset *ds = nb_dataset_from_tensors(xt, y);
    nb_ctx_free(ctx); /* the dataset holds copies */
    ck_assert_int_eq(nb_dataset_len(ds), 4);
    nb_field in = nb_dataset_input(ds), tgt = nb_dataset_target(ds);
    ck_assert_int_eq(in.ndim, 2);
    ck_assert_int_eq(in.shape[0], 2);
    ck_assert_int_eq(in.shape[1], 3);
    ck_assert_int_eq(in.dtype, NB_F32);
    ck_assert_int_eq(tgt.ndim, 0);
    ck_assert_uint_eq(nb_field_bytes(&in), 24);
    float s[6];
    int64_t label;
    ck_assert_int_eq(nb_dataset_get(ds, 2, s, &label), NB_OK);
    ck_assert_int_eq(label, 4);
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++) ck_assert_float_eq(s[a * 3 + b], (float)(12 + b * 2 + a));
    NBT_EXPECT_ABORT(nb_dataset_get(ds, 4, s, &label),
                     "nb_dataset_get: index 4 out of range for tensors dataset of 4 samples");
    nb_dataset_free(ds);

    nb_ctx *c2 = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nb_zeros(c2, NB_F32, NB_SHAPE(5, 2));
    nb_tensor *b = nb_zeros(c2, NB_I64, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_dataset_from_tensors(a, b), "inputs (5, 2) and targets (4,) have "
                     "different sample counts");
    nb_ctx_free(c2);
}
END_TEST

/* ---- CSV ---- */

/* The shipped table against values read from the file by hand. */
START_TEST(test_csv_breast_cancer) {
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, SHIPPED("breast_cancer.csv"), NULL), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 569);
    nb_field in = nb_dataset_input(ds), tgt = nb_dataset_target(ds);
    ck_assert_int_eq(in.ndim, 1);
    ck_assert_int_eq(in.shape[0], 30);
    ck_assert_int_eq(tgt.dtype, NB_I64);
    ck_assert_int_eq(tgt.ndim, 0);
    float x[30];
    int64_t y, counts[2] = {0, 0};
    ck_assert_int_eq(nb_dataset_get(ds, 0, x, &y), NB_OK);
    ck_assert_float_eq(x[0], 17.99f);
    ck_assert_float_eq(x[3], 1001.0f);
    ck_assert_float_eq(x[29], 0.1189f);
    ck_assert_int_eq(y, 0);
    for (int64_t i = 0; i < 569; i++) {
        ck_assert_int_eq(nb_dataset_get(ds, i, x, &y), NB_OK);
        ck_assert(y == 0 || y == 1);
        counts[y]++;
    }
    ck_assert_int_eq(counts[0], 212); /* malignant */
    ck_assert_int_eq(counts[1], 357); /* benign */
    ck_assert_str_eq(nb_dataset_name(ds), "csv");
    nb_dataset_free(ds);

    /* the label by name, from the middle: it leaves the features */
    nb_csv_options o = nb_csv_defaults();
    o.label = "mean area";
    o.label_dtype = NB_F64;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, SHIPPED("breast_cancer.csv"), &o), NB_OK);
    double area;
    ck_assert_int_eq(nb_dataset_get(ds, 1, x, &area), NB_OK);
    ck_assert_double_eq(area, 1326.0);
    ck_assert_float_eq(x[2], 132.9f); /* mean perimeter */
    ck_assert_float_eq(x[3], 0.08474f); /* mean smoothness moved up */
    ck_assert_float_eq(x[29], 0.0f);    /* target is now a feature: row 1 is malignant */
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_csv_digits) {
    nb_dataset *ds;
    nb_csv_options o = nb_csv_defaults();
    o.label = "target";
    ck_assert_int_eq(nb_dataset_open_csv(&ds, SHIPPED("digits.csv"), &o), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 1797);
    ck_assert_int_eq(nb_dataset_input(ds).shape[0], 64);
    float x[64];
    int64_t y, counts[10] = {0};
    for (int64_t i = 0; i < 1797; i++) {
        ck_assert_int_eq(nb_dataset_get(ds, i, x, &y), NB_OK);
        ck_assert(y >= 0 && y <= 9);
        counts[y]++;
        for (int k = 0; k < 64; k++) ck_assert(x[k] >= 0 && x[k] <= 16 && x[k] == floorf(x[k]));
    }
    for (int d = 0; d < 10; d++) ck_assert_int_ge(counts[d], 170);
    nb_dataset_get(ds, 0, x, &y); /* first line: 0,0,5,13,9,1,0,0,... label 0 */
    ck_assert_float_eq(x[2], 5);
    ck_assert_float_eq(x[3], 13);
    ck_assert_int_eq(y, 0);
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_csv_formats) {
    make_tmpdir();
    nb_dataset *ds;
    /* quotes, spaces, CRLF, blank lines, a label in the first column, i32 labels */
    const char *p = write_file("ok.csv", "\"label\", a ,b\r\n\r\n 2 , 1.5,-3e2\r\n  \r\n0,4,  5\r\n",
                               -1);
    nb_csv_options o = nb_csv_defaults();
    o.label = "label";
    o.label_dtype = NB_I32;
    o.input_dtype = NB_F64;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, p, &o), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 2);
    double x[2];
    int32_t y;
    nb_dataset_get(ds, 0, x, &y);
    ck_assert_double_eq(x[0], 1.5);
    ck_assert_double_eq(x[1], -300);
    ck_assert_int_eq(y, 2);
    nb_dataset_get(ds, 1, x, &y);
    ck_assert_double_eq(x[1], 5);
    ck_assert_int_eq(y, 0);
    nb_dataset_free(ds);

    /* scikit-learn's own layout: a "569,30,malignant,benign" line, no header */
    p = write_file("sk.csv", "3,2,no,yes\n1.0,2.0,0\n3.0,4.0,1\n5.5,6.5,1", -1);
    o = nb_csv_defaults();
    o.skip_lines = 1;
    o.no_header = true;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, p, &o), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 3);
    float xf[2];
    int64_t yl;
    nb_dataset_get(ds, 2, xf, &yl);
    ck_assert_float_eq(xf[0], 5.5f);
    ck_assert_float_eq(xf[1], 6.5f);
    ck_assert_int_eq(yl, 1);
    nb_dataset_free(ds);

    /* another delimiter, label by index from the start */
    p = write_file("semi.csv", "y;f\n7;0.25\n", -1);
    o = nb_csv_defaults();
    o.delimiter = ';';
    o.label_index = 0;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, p, &o), NB_OK);
    nb_dataset_get(ds, 0, xf, &yl);
    ck_assert_float_eq(xf[0], 0.25f);
    ck_assert_int_eq(yl, 7);
    nb_dataset_free(ds);
    remove_tmpdir();
}
END_TEST

/* A field longer than INT_MAX bytes is quoted to its first 40 bytes: with
 * an int length it went negative and "%.*s" printed up to the next NUL.
 * The file's bytes are parsed from memory (nb__csv_parse, what
 * nb_dataset_open_csv does after reading the file): 2^31 + 100 bytes from
 * calloc, of which only the first and last pages are written; the
 * untouched middle reads as zero pages, so the test needs no 2 GiB of
 * memory or disk. The field is 100 'Q's then NUL bytes up to the end of
 * the line: unbounded, the message would quote all 100. */
START_TEST(test_csv_field_beyond_int_max) {
    const char *head = "x,y\n";
    size_t q = 100, field = (size_t)INT_MAX + 1 + q, size = strlen(head) + field + strlen(",0\n");
    char *buf = calloc(size + 1, 1);
    ck_assert_ptr_nonnull(buf);
    memcpy(buf, head, strlen(head));
    memset(buf + strlen(head), 'Q', q);
    memcpy(buf + strlen(head) + field, ",0\n", 3);
    nb_dataset *ds = (nb_dataset *)1;
    nb_csv_options o = nb_csv_defaults();
    ck_assert_int_eq(nb__csv_parse(&ds, "big.csv", buf, size, &o), NB_ERR_FORMAT); /* takes buf */
    ck_assert_ptr_null(ds);
    char want[200];
    snprintf(want, sizeof want, "big.csv:2:1: field 1 (\"x\"): \"%.40s\" is not a number",
             "QQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQ");
    ck_assert_msg(strstr(nb_last_error(), want) != NULL, "expected \"%s\" in:\n%.300s", want, nb_last_error());
}
END_TEST

START_TEST(test_csv_errors) {
    make_tmpdir();
    char want[1024];
    static const csv_case cases[] = {
        /* ragged rows: too few and too many fields */
        {"ragged.csv", "a,b,c\n1,2,3\n4,5\n", "%s:3:4: ragged row: 2 fields, but the header has 3", NULL},
        {"ragged2.csv", "a,b\n1,2\n3,4\n5,6,7\n", "%s:4:5: ragged row: 3 fields", NULL},
        /* a non-numeric cell: line 3, byte column 5, field 2 named "b" */
        {"text.csv", "a,b,c\n1,2,3\n4, abc,6\n", "%s:3:3: field 2 (\"b\"): \"abc\" is not a number", NULL},
        {"partial.csv", "a,b\n1.5x,2\n", "%s:2:1: field 1 (\"a\"): \"1.5x\" is not a number", NULL},
        {"emptycell.csv", "a,b\n,2\n", "%s:2:1: field 1 (\"a\") is empty", NULL},
        /* an empty file, blank lines only, a header without rows */
        {"empty.csv", "", "%s: empty file", NULL},
        {"blank.csv", "\n  \n", "%s:2: no header after 0 skipped line(s)", NULL},
        {"header.csv", "a,b\n", "%s:1: no data rows after the header", NULL},
        /* a class label that is not an integer */
        {"frac.csv", "x,y\n1,0\n2,0.5\n", "%s:3:3: field 2 (\"y\"): label 0.5 is not an integer", NULL},
        /* a long bad field is quoted to 40 bytes */
        {"long.csv", "x,y\n1,0\nabcdefghijabcdefghijabcdefghijabcdefghijXYZ,0\n",
         "%s:3:1: field 1 (\"x\"): \"abcdefghijabcdefghijabcdefghijabcdefghij\" is not a number", NULL},
        /* one column only */
        {"one.csv", "x\n1\n", "%s:1: 1 column", "delimiter"},
    };
    expect_csv_cases(cases, sizeof cases / sizeof cases[0]);
    /* a missing label column, by name and by index */
    const char *p = write_file("nolabel.csv", "a,b,c\n1,2,3\n", -1);
    nb_csv_options o = nb_csv_defaults();
    o.label = "target";
    snprintf(want, sizeof want, "%s:1: no column named \"target\" in the header", p);
    expect_csv_error(p, &o, NB_ERR_NOT_FOUND, want, "3 columns: \"a\", \"b\", \"c\"");
    o = nb_csv_defaults();
    o.label_index = 3;
    snprintf(want, sizeof want, "%s:1: label column index 3 is out of range: the table has 3 "
             "columns", p);
    expect_csv_error(p, &o, NB_ERR_NOT_FOUND, want, NULL);
    o.label_index = -4;
    expect_csv_error(p, &o, NB_ERR_NOT_FOUND, "label column index -4", NULL);
    /* a class label beyond max_classes (default NB_CSV_MAX_CLASSES = 2^20),
     * named where it is instead of sizing an output layer by it */
    p = write_file("huge.csv", "x,y\n1,0\n2,1048575\n3, 1000000000\n", -1);
    snprintf(want, sizeof want, "%s:4:3: field 2 (\"y\"): label 1000000000 is not below "
             "max_classes 1048576 (a wrong label column?", p);
    expect_csv_error(p, NULL, NB_ERR_FORMAT, want, NULL);
    o = nb_csv_defaults();
    o.max_classes = 1000000001;
    nb_dataset *big;
    ck_assert_int_eq(nb_dataset_open_csv(&big, p, &o), NB_OK);
    nb_dataset_free(big);
    o.max_classes = 1048575;
    snprintf(want, sizeof want, "%s:3:3: field 2 (\"y\"): label 1048575 is not below "
             "max_classes 1048575", p);
    expect_csv_error(p, &o, NB_ERR_FORMAT, want, NULL);
    o.max_classes = -1;
    NBT_EXPECT_ABORT(nb_dataset_open_csv(&big, p, &o), "nb_dataset_open_csv: max_classes -1 < 0");
    /* a float label column has no class bound */
    o = nb_csv_defaults();
    o.label_dtype = NB_F32;
    ck_assert_int_eq(nb_dataset_open_csv(&big, p, &o), NB_OK);
    nb_dataset_free(big);
    /* no header: names are absent from messages, the first row sets the width */
    p = write_file("nohdr.csv", "1,2\n3\n", -1);
    o = nb_csv_defaults();
    o.no_header = true;
    snprintf(want, sizeof want, "%s:2:2: ragged row: 1 fields, but the first row has 2", p);
    expect_csv_error(p, &o, NB_ERR_FORMAT, want, NULL);
    o.label = "y";
    expect_csv_error(p, &o, NB_ERR_INVALID, "given by name, but the options say the file has "
                     "no header", NULL);
    /* a file that is not there */
    snprintf(want, sizeof want, "%s/missing.csv", tmpdir);
    expect_csv_error(want, NULL, NB_ERR_IO, "cannot open", "missing.csv\": No such file");
    o = nb_csv_defaults();
    o.input_dtype = NB_I32;
    NBT_EXPECT_ABORT(nb_dataset_open_csv(&(nb_dataset *){NULL}, want, &o),
                     "nb_dataset_open_csv: input_dtype i32; use f32 or f64");
    remove_tmpdir();
}
END_TEST

/* Values that would only fail later, inside an op: non-finite cells and
 * class labels that are negative or not integers. */
START_TEST(test_csv_bad_values) {
    make_tmpdir();
    char want[1024];
    static const csv_case cases[] = {
        {"nan.csv", "a,b,y\n1,2,0\n3, nan,1\n", "%s:3:3: field 2 (\"b\"): \"nan\" is not a finite number",
         "allow_nonfinite"},
        {"inf.csv", "a,b,y\n-inf,2,0\n", "%s:2:1: field 1 (\"a\"): \"-inf\" is not a finite number", NULL},
        {"huge.csv", "a,b,y\n1,2,0\n1,2,1\n5,1e400,0\n", "%s:4:3: field 2 (\"b\"): \"1e400\" is not a finite number",
         NULL},
    };
    expect_csv_cases(cases, sizeof cases / sizeof cases[0]);
    /* finite as a double, infinite as an f32 */
    const char *p = write_file("f32.csv", "a,y\n1e39,0\n", -1);
    snprintf(want, sizeof want, "%s:2:1: field 1 (\"a\"): 1e39 is beyond the range of f32", p);
    expect_csv_error(p, NULL, NB_ERR_FORMAT, want, NULL);
    nb_csv_options o = nb_csv_defaults();
    o.input_dtype = NB_F64;
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, p, &o), NB_OK);
    double xd;
    int64_t y;
    nb_dataset_get(ds, 0, &xd, &y);
    ck_assert_double_eq(xd, 1e39);
    nb_dataset_free(ds);
    /* a regression target (float label) is checked too, with no header */
    p = write_file("label.csv", "1,2\n3,NaN\n", -1);
    o = nb_csv_defaults();
    o.no_header = true;
    o.label_dtype = NB_F32;
    snprintf(want, sizeof want, "%s:2:3: field 2: \"NaN\" is not a finite number", p);
    expect_csv_error(p, &o, NB_ERR_FORMAT, want, NULL);
    /* allowed on request: the values load as they are */
    p = write_file("allowed.csv", "a,b,y\n1,2,0\n3, nan,1\ninf,-inf,0\n", -1);
    o = nb_csv_defaults();
    o.allow_nonfinite = true;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, p, &o), NB_OK);
    float x[2];
    nb_dataset_get(ds, 1, x, &y);
    ck_assert(isnan(x[1]));
    ck_assert_int_eq(y, 1);
    nb_dataset_get(ds, 2, x, &y);
    ck_assert(isinf(x[0]) && x[0] > 0);
    ck_assert(isinf(x[1]) && x[1] < 0);
    nb_dataset_free(ds);
    /* class labels: negative, not integral, non-finite */
    p = write_file("neg.csv", "x,y\n1,0\n2, -1\n", -1);
    snprintf(want, sizeof want, "%s:3:3: field 2 (\"y\"): label -1 is negative", p);
    expect_csv_error(p, NULL, NB_ERR_FORMAT, want, NULL);
    o = nb_csv_defaults();
    o.label_dtype = NB_I32;
    expect_csv_error(p, &o, NB_ERR_FORMAT, want, "label_dtype i32");
    o.label_dtype = NB_F64; /* a regression target may be negative */
    ck_assert_int_eq(nb_dataset_open_csv(&ds, p, &o), NB_OK);
    double yd;
    nb_dataset_get(ds, 1, x, &yd);
    ck_assert_double_eq(yd, -1.0);
    nb_dataset_free(ds);
    p = write_file("half.csv", "x,y\n1,0\n2,1\n3,2.5\n", -1);
    snprintf(want, sizeof want, "%s:4:3: field 2 (\"y\"): label 2.5 is not an integer", p);
    expect_csv_error(p, NULL, NB_ERR_FORMAT, want, NULL);
    p = write_file("labelnan.csv", "x,y\n1,0\n2,nan\n", -1);
    snprintf(want, sizeof want, "%s:3:3: field 2 (\"y\"): \"nan\" is not a finite number", p);
    expect_csv_error(p, NULL, NB_ERR_FORMAT, want, NULL);
    o = nb_csv_defaults();
    o.allow_nonfinite = true; /* still no class */
    snprintf(want, sizeof want, "%s:3:3: field 2 (\"y\"): label nan is not an integer", p);
    expect_csv_error(p, &o, NB_ERR_FORMAT, want, NULL);
    remove_tmpdir();
}
END_TEST

/* sample_shape: the digits rows as (1, 8, 8) images, same values in the
 * same order as the flat rows; a shape that does not hold the features. */
START_TEST(test_csv_sample_shape) {
    nb_csv_options o = nb_csv_defaults();
    o.sample_ndim = 3;
    o.sample_shape[0] = 1;
    o.sample_shape[1] = 8;
    o.sample_shape[2] = 8;
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, SHIPPED("digits.csv"), &o), NB_OK);
    nb_field in = nb_dataset_input(ds);
    ck_assert_int_eq(in.ndim, 3);
    ck_assert_int_eq(in.shape[0], 1);
    ck_assert_int_eq(in.shape[1], 8);
    ck_assert_int_eq(in.shape[2], 8);
    ck_assert_uint_eq(nb_field_bytes(&in), 64 * sizeof(float));
    float img[1][8][8];
    int64_t y;
    ck_assert_int_eq(nb_dataset_get(ds, 0, img, &y), NB_OK);
    /* the file's first row: 0,0,5,13,9,1,0,0, 0,0,13,15,10,15,5,0, ... */
    static const float row0[16] = {0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0};
    for (int k = 0; k < 16; k++) ck_assert_float_eq(img[0][k / 8][k % 8], row0[k]);
    ck_assert_int_eq(y, 0);
    /* through the loader: batches of (B, 1, 8, 8) */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_loader_options lo = {.batch_size = 4};
    nb_loader *dl;
    ck_assert_int_eq(nb_loader_new(&dl, ds, &lo), NB_OK);
    nb_batch b;
    ck_assert_int_eq(nb_loader_next(dl, ctx, &b), NB_OK);
    nb_tensor *x = b.inputs;
    ck_assert_int_eq(x->ndim, 4);
    ck_assert_int_eq(x->shape[0], 4);
    ck_assert_int_eq(x->shape[1], 1);
    ck_assert_int_eq(x->shape[2], 8);
    ck_assert_int_eq(x->shape[3], 8);
    ck_assert_float_eq(nb_get(x, (int64_t[]){0, 0, 1, 3}), 15); /* row 0, feature 11 */
    nb_loader_free(dl);
    nb_ctx_free(ctx);
    nb_dataset_free(ds);

    char want[1024];
    o.sample_shape[2] = 7;
    snprintf(want, sizeof want, "%s:1: sample_shape (1, 8, 7) holds 56 values, but the table has "
             "64 feature columns (65 columns less the label, column 65 (\"target\"))",
             SHIPPED("digits.csv"));
    expect_csv_error(SHIPPED("digits.csv"), &o, NB_ERR_FORMAT, want, NULL);
    o.sample_ndim = 1;
    o.sample_shape[0] = 65;
    expect_csv_error(SHIPPED("digits.csv"), &o, NB_ERR_FORMAT, "sample_shape (65,) holds 65 values",
                     NULL);
    o.sample_ndim = 2;
    o.sample_shape[1] = 0;
    NBT_EXPECT_ABORT(nb_dataset_open_csv(&ds, SHIPPED("digits.csv"), &o),
                     "nb_dataset_open_csv: sample_shape[1] = 0 must be > 0");
    o.sample_ndim = NB_MAX_DIMS;
    NBT_EXPECT_ABORT(nb_dataset_open_csv(&ds, SHIPPED("digits.csv"), &o),
                     "nb_dataset_open_csv: sample_ndim 6; use 0 (flat) to 5");
}
END_TEST

/* ---- token shards ---- */

/* A shard written the way llm.c's tools write one: an int32 header array
 * and the uint16 tokens with fwrite (little-endian host). */
static const char *write_shard_raw(const char *name, int32_t magic, int32_t version,
                                   int32_t count, const uint16_t *tokens, int64_t n_written) {
    static char path[300];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "wb");
    int32_t header[256] = {0};
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    fwrite(header, sizeof header, 1, f);
    if (n_written) fwrite(tokens, sizeof *tokens, (size_t)n_written, f);
    fclose(f);
    return path;
}

START_TEST(test_tokens) {
    make_tmpdir();
    uint16_t tok[100];
    for (int i = 0; i < 100; i++) tok[i] = (uint16_t)(i * 601 % 65536);
    const char *p = write_shard_raw("a.bin", 20240520, 1, 100, tok, 100);
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, p, 8, 0, 0), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 12); /* windows of 9 tokens every 8: starts 0..88 */
    nb_field f = nb_dataset_input(ds);
    ck_assert_int_eq(f.dtype, NB_I64);
    ck_assert_int_eq(f.shape[0], 8);
    int64_t x[8], y[8];
    for (int64_t i = 0; i < 12; i++) {
        ck_assert_int_eq(nb_dataset_get(ds, i, x, y), NB_OK);
        for (int k = 0; k < 8; k++) {
            ck_assert_int_eq(x[k], tok[i * 8 + k]);
            ck_assert_int_eq(y[k], tok[i * 8 + k + 1]);
        }
    }
    nb_dataset_free(ds);
    /* overlapping windows */
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, p, 10, 3, 0), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 30); /* starts 0, 3, ..., 87 (87 + 10 < 100) */
    int64_t x10[10], y10[10];
    nb_dataset_get(ds, 29, x10, y10);
    ck_assert_int_eq(x10[0], tok[87]);
    ck_assert_int_eq(y10[9], tok[97]);
    nb_dataset_free(ds);

    /* our writer gives the same bytes as the raw writer */
    char ours[300];
    snprintf(ours, sizeof ours, "%s/ours.bin", tmpdir);
    ck_assert_int_eq(nb_tokens_write(ours, tok, 100), NB_OK);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", ours, p);
    ck_assert_int_eq(system(cmd), 0);

    /* several shards by glob, in sorted order; windows stay in their file */
    snprintf(ours, sizeof ours, "%s/s_01.bin", tmpdir);
    ck_assert_int_eq(nb_tokens_write(ours, tok + 50, 20), NB_OK); /* 2 windows of T=8 */
    snprintf(ours, sizeof ours, "%s/s_00.bin", tmpdir);
    ck_assert_int_eq(nb_tokens_write(ours, tok, 30), NB_OK); /* 3 windows */
    snprintf(ours, sizeof ours, "%s/s_02.bin", tmpdir);
    ck_assert_int_eq(nb_tokens_write(ours, tok, 5), NB_OK); /* none */
    snprintf(ours, sizeof ours, "%s/s_*.bin", tmpdir);
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, ours, 8, 0, 0), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 5);
    nb_dataset_get(ds, 2, x, y);
    ck_assert_int_eq(x[0], tok[16]);
    nb_dataset_get(ds, 3, x, y);
    ck_assert_int_eq(x[0], tok[50]);
    ck_assert_int_eq(y[7], tok[58]);
    nb_dataset_get(ds, 4, x, y);
    ck_assert_int_eq(x[0], tok[58]);
    nb_dataset_free(ds);
    remove_tmpdir();
}
END_TEST

START_TEST(test_tokens_errors) {
    make_tmpdir();
    uint16_t tok[64] = {0};
    char want[1024];
    const char *p = write_shard_raw("magic.bin", 20240521, 1, 64, tok, 64);
    snprintf(want, sizeof want, "%s: byte offset 0: magic number 20240521, expected 20240520", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    p = write_shard_raw("version.bin", 20240520, 2, 64, tok, 64);
    snprintf(want, sizeof want, "%s: byte offset 4: version 2; only version 1", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    p = write_shard_raw("short.bin", 20240520, 1, 64, tok, 40);
    snprintf(want, sizeof want, "%s: truncated body: the header announces 64 tokens (data up to "
             "byte offset 1152), the file ends at byte offset 1104 (40 tokens)", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    p = write_shard_raw("long.bin", 20240520, 1, 30, tok, 31);
    snprintf(want, sizeof want, "%s: byte offset 1084: 2 bytes follow the 30 tokens", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    p = write_shard_raw("negative.bin", 20240520, 1, -5, tok, 0);
    snprintf(want, sizeof want, "%s: byte offset 8: token count -5 is negative", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    p = write_file("header.bin", "\x28\x2c\x35\x01", 4); /* just the magic */
    snprintf(want, sizeof want, "%s: truncated header: the file ends at byte offset 4", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    p = write_shard_raw("few.bin", 20240520, 1, 8, tok, 8);
    snprintf(want, sizeof want, "%s: 8 tokens in 1 file(s), no file has the seq_len + 1 = 9", p);
    expect_tokens_error(p, 8, NB_ERR_FORMAT, want, NULL);
    snprintf(want, sizeof want, "%s/none_*.bin", tmpdir);
    expect_tokens_error(want, 8, NB_ERR_NOT_FOUND, "no token shard matches", "none_*.bin");
    snprintf(want, sizeof want, "%s/absent.bin", tmpdir);
    expect_tokens_error(want, 8, NB_ERR_IO, "cannot open", "absent.bin\": No such file");
    /* one bad shard among good ones is named */
    write_shard_raw("g_0.bin", 20240520, 1, 64, tok, 64);
    p = write_shard_raw("g_1.bin", 20240520, 1, 64, tok, 10);
    snprintf(want, sizeof want, "%s/g_*.bin", tmpdir);
    char name[1024];
    snprintf(name, sizeof name, "%s/g_1.bin: truncated body", tmpdir);
    expect_tokens_error(want, 8, NB_ERR_FORMAT, name, NULL);
    NBT_EXPECT_ABORT(nb_dataset_open_tokens(&(nb_dataset *){NULL}, want, 0, 0, 0),
                     "nb_dataset_open_tokens: seq_len 0 must be > 0");
    NBT_EXPECT_ABORT(nb_dataset_open_tokens(&(nb_dataset *){NULL}, want, 8, 0, -1),
                     "nb_dataset_open_tokens: vocab_size -1 must be >= 0");
    remove_tmpdir();
}
END_TEST

/* Token ids at or beyond the vocabulary are named with file and byte
 * offset at open; ids below it, and the unchecked open, load. */
START_TEST(test_tokens_vocab) {
    make_tmpdir();
    uint16_t tok[10000];
    for (int i = 0; i < 10000; i++) tok[i] = (uint16_t)(i % 50);
    const char *p = write_shard_raw("fine.bin", 20240520, 1, 10000, tok, 10000);
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, p, 8, 0, 50), NB_OK);
    nb_dataset_free(ds);
    /* one id of 50 in the second block of the second file: token 5000 of
     * g_1.bin, at byte offset 1024 + 2 * 5000 = 11024 */
    write_shard_raw("g_0.bin", 20240520, 1, 10000, tok, 10000);
    tok[5000] = 50;
    write_shard_raw("g_1.bin", 20240520, 1, 10000, tok, 10000);
    char pattern[400], want[1024];
    snprintf(pattern, sizeof pattern, "%s/g_*.bin", tmpdir);
    snprintf(want, sizeof want, "%s/g_1.bin: byte offset 11024: token id 50 (token 5000 of the "
             "file) is not below the vocabulary size 50", tmpdir);
    expect_tokens_error_vocab(pattern, 8, 50, NB_ERR_FORMAT, want, NULL);
    /* a larger vocabulary admits it; 0 does not check */
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, pattern, 8, 0, 51), NB_OK);
    nb_dataset_free(ds);
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, pattern, 8, 0, 0), NB_OK);
    nb_dataset_free(ds);
    /* the last token of a file, and the largest id a shard can hold */
    tok[5000] = 0;
    tok[9999] = 65535;
    p = write_shard_raw("last.bin", 20240520, 1, 10000, tok, 10000);
    snprintf(want, sizeof want, "%s: byte offset 21022: token id 65535 (token 9999 of the file) "
             "is not below the vocabulary size 50257", p);
    expect_tokens_error_vocab(p, 8, 50257, NB_ERR_FORMAT, want, NULL);
    remove_tmpdir();
}
END_TEST

/* Note [Shards change under a run]: a shard truncated after the open gives
 * an error naming the file and byte offset from get and from the loader's
 * workers, never SIGBUS; windows before the cut still read. */
START_TEST(test_tokens_shrunk_after_open) {
    make_tmpdir();
    uint16_t tok[4096];
    for (int i = 0; i < 4096; i++) tok[i] = (uint16_t)(i * 7 % 1000);
    const char *p = write_shard_raw("shrink.bin", 20240520, 1, 4096, tok, 4096);
    char path[300];
    snprintf(path, sizeof path, "%s", p);
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_tokens(&ds, path, 16, 0, 1000), NB_OK);
    ck_assert_int_eq(nb_dataset_len(ds), 255); /* (4096 - 17) / 16 + 1 */
    /* cut to the header and 512 tokens: windows 0..30 end at token 496 */
    ck_assert_int_eq(truncate(path, 1024 + 2 * 512), 0);
    int64_t x[16], y[16];
    ck_assert_int_eq(nb_dataset_get(ds, 30, x, y), NB_OK);
    ck_assert_int_eq(x[0], tok[480]);
    ck_assert_int_eq(y[15], tok[496]);
    /* window 31 needs tokens 496..512, the last one at byte 2048, where the file ends */
    char want[1024];
    snprintf(want, sizeof want, "%s: byte offset 2048: the file ends there (it is 2048 bytes "
             "now); it changed after it was opened (4096 tokens then)", path);
    ck_assert_int_eq(nb_dataset_get(ds, 31, x, y), NB_ERR_IO);
    ck_assert_msg(strstr(nb_last_error(), want), "got: %s", nb_last_error());
    snprintf(want, sizeof want, "%s: byte offset 9152: the file ends there", path);
    ck_assert_int_eq(nb_dataset_get(ds, 254, x, y), NB_ERR_IO);
    ck_assert_msg(strstr(nb_last_error(), want), "got: %s", nb_last_error());
    /* through the loader's worker threads */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_loader_options lo = {.batch_size = 8, .num_workers = 2};
    nb_loader *dl;
    ck_assert_int_eq(nb_loader_new(&dl, ds, &lo), NB_OK);
    nb_batch b;
    nb_status st = NB_OK;
    for (int k = 0; k < 8 && st == NB_OK; k++) st = nb_loader_next(dl, ctx, &b);
    ck_assert_int_eq(st, NB_ERR_IO);
    ck_assert_msg(strstr(nb_last_error(), "shrink.bin: byte offset"), "got: %s", nb_last_error());
    nb_loader_free(dl);
    nb_ctx_free(ctx);
    /* rewritten in place with an id beyond the vocabulary: named at get */
    FILE *f = fopen(path, "r+b");
    fseek(f, 1024 + 2 * 20, SEEK_SET);
    uint16_t big = 1000;
    fwrite(&big, 2, 1, f);
    fclose(f);
    snprintf(want, sizeof want, "%s: byte offset 1064: token id 1000 is not below the vocabulary "
             "size 1000 (the file changed after it was opened)", path);
    ck_assert_int_eq(nb_dataset_get(ds, 1, x, y), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), want), "got: %s", nb_last_error());
    nb_dataset_free(ds);
    remove_tmpdir();
}
END_TEST

/* Note [NULL handles] in util/handle.h: a handle left NULL by a failed
 * open whose status was ignored makes the next call abort, naming the
 * function and the failure, never dereference it. */
START_TEST(test_null_handles) {
    make_tmpdir();
    char path[400];
    snprintf(path, sizeof path, "%s/absent.csv", tmpdir);
    nb_dataset *ds = (nb_dataset *)1;
    (void)nb_dataset_open_csv(&ds, path, NULL); /* status ignored */
    ck_assert_ptr_null(ds);
    NBT_EXPECT_ABORT(nb_dataset_len(ds), "nb_dataset_len: the dataset is NULL: the call that "
                     "should have made it most likely failed and its nb_status was not checked "
                     "(last error on this thread: cannot open");
    NBT_EXPECT_ABORT(nb_dataset_input(ds), "nb_dataset_input: the dataset is NULL");
    NBT_EXPECT_ABORT(nb_dataset_get(ds, 0, NULL, NULL), "nb_dataset_get: the dataset is NULL");
    NBT_EXPECT_ABORT(nb_dataset_text_vocab(ds, NULL), "nb_dataset_text_vocab: the dataset is NULL");
    NBT_EXPECT_ABORT(nb_dataset_subset(ds, NULL, 0), "nb_dataset_subset: the dataset is NULL");
    NBT_EXPECT_ABORT(nb_dataset_standardize(ds, NULL, NULL), "nb_dataset_standardize: the dataset");
    nb_loader *l = NULL;
    nb_loader_options lo = {.batch_size = 4};
    NBT_EXPECT_ABORT(nb_loader_new(&l, ds, &lo), "nb_loader_new: the dataset is NULL");
    nb_batch b;
    NBT_EXPECT_ABORT(nb_loader_next(l, NULL, &b), "nb_loader_next: the loader is NULL");
    NBT_EXPECT_ABORT(nb_loader_len(l), "nb_loader_len: the loader is NULL");
    NBT_EXPECT_ABORT((void)!nb_loader_seek(l, 0, 0), "nb_loader_seek: the loader is NULL");
    NBT_EXPECT_ABORT(nb_sampler_len(NULL), "nb_sampler_len: the sampler is NULL");
    NBT_EXPECT_ABORT(nb_batch_sampler_new(NULL, 4, false), "nb_batch_sampler_new: the sampler is NULL");
    NBT_EXPECT_ABORT(nb_batch_sampler_get(NULL, 0, NULL), "nb_batch_sampler_get: the batch sampler");
    /* the free functions accept NULL */
    nb_dataset_free(ds);
    nb_loader_free(l);
    nb_sampler_free(NULL);
    nb_batch_sampler_free(NULL);
    remove_tmpdir();
}
END_TEST

/* ---- text ---- */

START_TEST(test_text) {
    nb_dataset *ds;
    const char *path = SHIPPED("austen.txt");
    ck_assert_int_eq(nb_dataset_open_text(&ds, path, 64, 0, NB_TEXT_COMPACT), NB_OK);
    uint8_t bytes[256];
    int v = nb_dataset_text_vocab(ds, bytes);
    ck_assert_int_eq(v, 79);
    ck_assert_int_eq(bytes[0], '\n');
    ck_assert_int_eq(bytes[1], ' ');
    ck_assert_int_eq(bytes[78], 'z');
    ck_assert_int_eq(nb_dataset_len(ds), (1358460 - 65) / 64 + 1);
    /* decoding sample 0 gives the file's first bytes */
    FILE *f = fopen(path, "rb");
    char head[200];
    ck_assert_uint_eq(fread(head, 1, sizeof head, f), sizeof head);
    fclose(f);
    int64_t x[64], y[64];
    for (int64_t i = 0; i < 2; i++) {
        ck_assert_int_eq(nb_dataset_get(ds, i, x, y), NB_OK);
        for (int k = 0; k < 64; k++) {
            ck_assert_int_lt(x[k], v);
            ck_assert_int_eq(bytes[x[k]], (uint8_t)head[i * 64 + k]);
            ck_assert_int_eq(bytes[y[k]], (uint8_t)head[i * 64 + k + 1]);
        }
    }
    nb_dataset_free(ds);

    make_tmpdir();
    const char *p = write_file("t.txt", "hello, world\n", -1);
    ck_assert_int_eq(nb_dataset_open_text(&ds, p, 4, 1, NB_TEXT_BYTES), NB_OK);
    ck_assert_int_eq(nb_dataset_text_vocab(ds, NULL), 256);
    ck_assert_int_eq(nb_dataset_len(ds), 9); /* 13 bytes, windows of 5 at every byte */
    int64_t a[4], b[4];
    nb_dataset_get(ds, 7, a, b);
    ck_assert_int_eq(a[0], 'w');
    ck_assert_int_eq(b[3], 'd');
    nb_dataset_free(ds);
    ck_assert_int_eq(nb_dataset_open_text(&ds, p, 4, 0, NB_TEXT_COMPACT), NB_OK);
    ck_assert_int_eq(nb_dataset_text_vocab(ds, bytes), 10); /* \n space , d e h l o r w */
    nb_dataset_free(ds);
    char want[1024];
    snprintf(want, sizeof want, "%s: 13 bytes; one window of seq_len 13 needs 14", p);
    nb_dataset *none = (nb_dataset *)1;
    ck_assert_int_eq(nb_dataset_open_text(&none, p, 13, 0, NB_TEXT_COMPACT), NB_ERR_FORMAT);
    ck_assert_ptr_null(none);
    ck_assert_str_eq(nb_last_error(), want);
    snprintf(want, sizeof want, "%s/nope.txt", tmpdir);
    ck_assert_int_eq(nb_dataset_open_text(&none, want, 13, 0, NB_TEXT_COMPACT), NB_ERR_IO);
    ck_assert_ptr_nonnull(strstr(nb_last_error(), "nope.txt"));
    remove_tmpdir();

    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 1));
    nb_dataset *tds = nb_dataset_from_tensors(t, t);
    NBT_EXPECT_ABORT(nb_dataset_text_vocab(tds, NULL), "a tensors dataset; this needs one from "
                     "nb_dataset_open_text");
    nb_dataset_free(tds);
    nb_ctx_free(ctx);
}
END_TEST

/* ---- split and standardisation ---- */

START_TEST(test_split) {
    nb_dataset *ds, *train, *test;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, SHIPPED("breast_cancer.csv"), NULL), NB_OK);
    nb_dataset_split(ds, 0.2, 1234, &train, &test);
    ck_assert_int_eq(nb_dataset_len(test), 114); /* round(113.8) */
    ck_assert_int_eq(nb_dataset_len(train), 455);
    /* every base row lands in exactly one side; identify rows by their
     * first two features, which are unique in this table */
    float x[30], bx[30];
    int64_t y, by;
    int *hits = calloc(569, sizeof *hits);
    nb_dataset *sides[2] = {train, test};
    for (int s = 0; s < 2; s++) {
        int64_t prev = -1;
        for (int64_t i = 0; i < nb_dataset_len(sides[s]); i++) {
            nb_dataset_get(sides[s], i, x, &y);
            int64_t found = -1;
            for (int64_t j = 0; j < 569 && found < 0; j++) {
                nb_dataset_get(ds, j, bx, &by);
                if (memcmp(x, bx, sizeof x) == 0 && y == by) found = j;
            }
            ck_assert_int_ge(found, 0);
            ck_assert_int_gt(found, prev); /* base order kept */
            prev = found;
            hits[found]++;
        }
    }
    for (int j = 0; j < 569; j++) ck_assert_int_eq(hits[j], 1);
    free(hits);
    nb_dataset *tr15, *te15; /* 0.15 * 569 = 85.35: rounded to the nearest count */
    nb_dataset_split(ds, 0.15, 1, &tr15, &te15);
    ck_assert_int_eq(nb_dataset_len(te15), 85);
    ck_assert_int_eq(nb_dataset_len(tr15), 484);
    nb_dataset_free(tr15);
    nb_dataset_free(te15);
    /* the same seed gives the same split, another seed another */
    nb_dataset *train2, *test2, *train3, *test3;
    nb_dataset_split(ds, 0.2, 1234, &train2, &test2);
    nb_dataset_split(ds, 0.2, 99, &train3, &test3);
    bool same2 = true, same3 = true;
    for (int64_t i = 0; i < 114; i++) {
        nb_dataset_get(test, i, x, &y);
        nb_dataset_get(test2, i, bx, &by);
        same2 &= memcmp(x, bx, sizeof x) == 0;
        nb_dataset_get(test3, i, bx, &by);
        same3 &= memcmp(x, bx, sizeof x) == 0;
    }
    ck_assert(same2);
    ck_assert(!same3);
    /* subsets keep their base alive */
    nb_dataset_free(ds);
    ck_assert_int_eq(nb_dataset_get(train, 454, x, &y), NB_OK);
    nb_dataset_free(train);
    nb_dataset_free(test);
    nb_dataset_free(train2);
    nb_dataset_free(test2);
    nb_dataset_free(train3);
    nb_dataset_free(test3);
    NBT_EXPECT_ABORT(nb_dataset_split(NULL, 1.5, 0, &train, &test),
                     "nb_dataset_split: test_fraction 1.5 is not in [0, 1]");
}
END_TEST

/* Reads breast_cancer.csv's features with sscanf, as doubles. */
static double *read_table(void) {
    FILE *f = fopen(SHIPPED("breast_cancer.csv"), "r");
    ck_assert_ptr_nonnull(f);
    double *v = malloc(sizeof *v * 569 * 30);
    char line[4096];
    ck_assert_ptr_nonnull(fgets(line, sizeof line, f)); /* header */
    for (int r = 0; r < 569; r++) {
        ck_assert_ptr_nonnull(fgets(line, sizeof line, f));
        char *p = line;
        for (int c = 0; c < 30; c++) {
            int used;
            ck_assert_int_eq(sscanf(p, "%lf,%n", &v[r * 30 + c], &used), 1);
            p += used;
        }
    }
    fclose(f);
    return v;
}

START_TEST(test_standardize) {
    nb_dataset *ds, *train, *test;
    nb_csv_options o = nb_csv_defaults();
    o.input_dtype = NB_F64;
    ck_assert_int_eq(nb_dataset_open_csv(&ds, SHIPPED("breast_cancer.csv"), &o), NB_OK);
    nb_dataset_split(ds, 0.25, 7, &train, &test);
    double mean[30], sd[30];
    ck_assert_int_eq(nb_dataset_fit_standardizer(train, mean, sd), NB_OK);
    /* reference: which rows are in train, then naive mean and deviation */
    double *table = read_table();
    int64_t n = nb_dataset_len(train);
    double x[30];
    int64_t y;
    double ref_mean[30] = {0}, ref_var[30] = {0};
    double *rows = malloc(sizeof *rows * (size_t)n * 30);
    for (int64_t i = 0; i < n; i++) {
        nb_dataset_get(train, i, &rows[i * 30], &y);
        for (int c = 0; c < 30; c++) ref_mean[c] += rows[i * 30 + c];
    }
    for (int c = 0; c < 30; c++) ref_mean[c] /= (double)n;
    for (int64_t i = 0; i < n; i++)
        for (int c = 0; c < 30; c++) ref_var[c] += pow(rows[i * 30 + c] - ref_mean[c], 2);
    for (int c = 0; c < 30; c++) {
        ck_assert_double_eq_tol(mean[c], ref_mean[c], 1e-12 * fabs(ref_mean[c]) + 1e-15);
        ck_assert_double_eq_tol(sd[c], sqrt(ref_var[c] / (double)n), 1e-9 * sd[c]);
    }
    /* the rows the loader read are the file's rows (first train row is some file row) */
    bool found = false;
    for (int r = 0; r < 569 && !found; r++) found = memcmp(&table[r * 30], rows, sizeof x) == 0;
    ck_assert(found);
    /* standardised train has mean 0, deviation 1; test uses train's statistics */
    nb_dataset *strain = nb_dataset_standardize(train, mean, sd);
    nb_dataset *stest = nb_dataset_standardize(test, mean, sd);
    double m2[30], s2[30];
    ck_assert_int_eq(nb_dataset_fit_standardizer(strain, m2, s2), NB_OK);
    for (int c = 0; c < 30; c++) {
        ck_assert_double_eq_tol(m2[c], 0, 1e-12);
        ck_assert_double_eq_tol(s2[c], 1, 1e-12);
    }
    double raw[30], st[30];
    nb_dataset_get(test, 5, raw, &y);
    nb_dataset_get(stest, 5, st, &y);
    for (int c = 0; c < 30; c++) ck_assert_double_eq_tol(st[c], (raw[c] - mean[c]) / sd[c], 1e-12);
    /* a constant feature: deviation reported as 1 */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *cx = nb_from_host(ctx, NB_F32, NB_SHAPE(3, 2), (float[]){1, 5, 2, 5, 3, 5});
    nb_tensor *cy = nb_zeros(ctx, NB_I64, NB_SHAPE(3));
    nb_dataset *cds = nb_dataset_from_tensors(cx, cy);
    double cm[2], cs[2];
    ck_assert_int_eq(nb_dataset_fit_standardizer(cds, cm, cs), NB_OK);
    ck_assert_double_eq_tol(cm[0], 2, 1e-15);
    ck_assert_double_eq_tol(cs[0], sqrt(2.0 / 3), 1e-15);
    ck_assert_double_eq(cs[1], 1);
    nb_dataset *std_c = nb_dataset_standardize(cds, cm, cs);
    float fx[2];
    nb_dataset_get(std_c, 2, fx, &y);
    ck_assert_float_eq_tol(fx[0], (float)(1 / sqrt(2.0 / 3)), 1e-6f);
    ck_assert_float_eq(fx[1], 0);
    NBT_EXPECT_ABORT(nb_dataset_standardize(cds, cm, (double[]){1, 0}),
                     "element 1: mean 5, std 0; std must be finite and > 0");
    nb_tensor *ix = nb_zeros(ctx, NB_I64, NB_SHAPE(3, 2));
    nb_dataset *ids = nb_dataset_from_tensors(ix, cy);
    NBT_EXPECT_ABORT(nb_dataset_fit_standardizer(ids, cm, cs), "tensors dataset has i64 inputs");
    nb_dataset_free(ids);
    nb_dataset_free(std_c);
    nb_dataset_free(cds);
    nb_ctx_free(ctx);
    free(rows);
    free(table);
    nb_dataset_free(strain);
    nb_dataset_free(stest);
    nb_dataset_free(train);
    nb_dataset_free(test);
    nb_dataset_free(ds);
}
END_TEST

/* ---- the documentation's example ---- */

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    char *buf = malloc(1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* docs/data.md quotes the dataset part of examples/custom_dataset.c
 * verbatim; the example is compiled, so the quote must stay in step. */
START_TEST(test_docs_quote_the_compiled_example) {
    char *doc = slurp(NABLA_SOURCE_DIR "/docs/data.md");
    char *ex = slurp(NABLA_SOURCE_DIR "/examples/custom_dataset.c");
    char *start = strstr(ex, "typedef struct line_data"), *end = strstr(ex, "int main(void)");
    ck_assert(start && end && end > start);
    while (end > start && (end[-1] == '\n' || end[-1] == ' ')) end--;
    *end = 0;
    ck_assert_msg(strstr(doc, start) != NULL, "docs/data.md no longer quotes the dataset code of "
                  "examples/custom_dataset.c verbatim");
    free(doc);
    free(ex);
}
END_TEST

int main(void) {
    Suite *s = suite_create("data_datasets");
    nbt_suite_add(s, "datasets", 0, (const TTest *[]){test_from_tensors, test_csv_breast_cancer,
                  test_csv_digits, test_csv_formats, test_csv_errors, test_csv_bad_values,
                  test_csv_sample_shape, test_tokens, test_tokens_errors, test_tokens_vocab,
                  test_tokens_shrunk_after_open, test_null_handles, test_text, test_split, test_standardize,
                  test_docs_quote_the_compiled_example, NULL});
    /* scans 2 GiB of zero pages (under a second on an idle machine) */
    nbt_suite_add(s, "big", 60, (const TTest *[]){test_csv_field_beyond_int_max, NULL});
    return nbt_run(s);
}
