/* CSV tables of numbers: every column but the label is an input feature.
 *
 * The file is read whole and parsed once into two arrays (features in the
 * input dtype, labels in the label dtype); fetching a sample is a copy.
 * Fields are split at the delimiter, trimmed of spaces and tabs, and may be
 * wrapped in double quotes (without delimiters inside). Error messages use
 * the compiler convention "path:line:column: ...", line and column 1-based,
 * the column counted in bytes from the start of the line.
 *
 * Values are checked at load so that bad data is named where it is, not
 * found steps later inside an op: a nan or infinite cell (or one beyond
 * the dtype's range, which would become infinite) is refused unless the
 * options allow it, and a class label must be an integer in
 * [0, max_classes). */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "tensor/internal.h"

/* rows in memory (data/internal.h): the features as inputs, the labels as targets */
static const nb_dataset_vtable csv_vt = {"csv", nb__rows_len, nb__rows_get, nb__rows_free};

nb_csv_options nb_csv_defaults(void) {
    nb_csv_options o;
    memset(&o, 0, sizeof o);
    o.label_index = -1;
    o.label_dtype = NB_I64;
    o.input_dtype = NB_F32;
    o.delimiter = ',';
    return o;
}

/* One field of a line: [start, end) after trimming and unquoting, and the
 * byte column where it starts. */
typedef struct field {
    char *start, *end;
    int64_t column;
} field;

typedef struct parser {
    const char *path;
    char delim;
    char *p, *end; /* unread part of the file */
    char *line_start;
    int64_t line;  /* number of the line last returned */
    field *fields;
    int n_fields, cap_fields;
} parser;

/* How many bytes of a field a message quotes: at most 40. Lengths are
 * size_t: a field can exceed INT_MAX bytes, and an int length would go
 * negative and make "%.*s" print the rest of the file. */
static int shown_len(const field *f) {
    size_t len = (size_t)(f->end - f->start);
    return len > 40 ? 40 : (int)len;
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

/* Next line into [*ls, *le) without its "\n" or "\r\n"; false at the end. */
static bool next_line(parser *ps, char **ls, char **le) {
    if (ps->p >= ps->end) return false;
    char *s = ps->p, *nl = memchr(s, '\n', (size_t)(ps->end - s));
    char *e = nl ? nl : ps->end;
    ps->p = nl ? nl + 1 : ps->end;
    if (e > s && e[-1] == '\r') e--;
    *ls = s;
    *le = e;
    ps->line++;
    return true;
}

static bool is_blank(const char *s, const char *e) {
    for (; s < e; s++)
        if (!is_space(*s)) return false;
    return true;
}

static nb_status split_line(parser *ps, char *s, char *e) {
    char *line_start = ps->line_start = s;
    ps->n_fields = 0;
    for (;;) {
        char *fe = memchr(s, ps->delim, (size_t)(e - s));
        if (!fe) fe = e;
        if (ps->n_fields == ps->cap_fields) {
            if (ps->cap_fields > INT_MAX / 2)
                return nb_set_error(NB_ERR_FORMAT, "%s:%lld: more than %d fields on one line",
                                    ps->path, (long long)ps->line, ps->cap_fields);
            int cap = ps->cap_fields ? 2 * ps->cap_fields : 64;
            field *f = realloc(ps->fields, sizeof *f * (size_t)cap);
            if (!f) return nb_set_error(NB_ERR_NOMEM, "%s:%lld: out of memory", ps->path,
                                        (long long)ps->line);
            ps->fields = f;
            ps->cap_fields = cap;
        }
        field *f = &ps->fields[ps->n_fields++];
        f->column = s - line_start + 1;
        char *a = s, *b = fe;
        while (a < b && is_space(*a)) a++;
        while (b > a && is_space(b[-1])) b--;
        if (b - a >= 2 && *a == '"' && b[-1] == '"') {
            a++;
            b--;
        }
        f->start = a;
        f->end = b;
        if (fe == e) break;
        s = fe + 1;
    }
    return NB_OK;
}

typedef struct table {
    int n_cols, label_col;
    char **names; /* n_cols header names, or NULL without a header */
} table;

/* ` ("name")` for messages, or "" without a header. */
static const char *col_name(const table *t, int col, char *buf, size_t n) {
    if (!t->names) return "";
    snprintf(buf, n, " (\"%s\")", t->names[col]);
    return buf;
}

static nb_status find_label(const parser *ps, table *t, const nb_csv_options *o,
                            int64_t header_line) {
    if (o->label) {
        if (!t->names)
            return nb_set_error(NB_ERR_INVALID, "%s: label column \"%s\" given by name, but the "
                                "options say the file has no header", ps->path, o->label);
        for (int c = 0; c < t->n_cols; c++)
            if (strcmp(t->names[c], o->label) == 0) {
                t->label_col = c;
                return NB_OK;
            }
        char list[600];
        size_t k = 0;
        list[0] = 0;
        for (int c = 0; c < t->n_cols && k < sizeof list - 1; c++)
            k += (size_t)snprintf(list + k, sizeof list - k, "%s\"%s\"", c ? ", " : "",
                                  t->names[c]);
        return nb_set_error(NB_ERR_NOT_FOUND, "%s:%lld: no column named \"%s\" in the header "
                            "(%d columns: %s)", ps->path, (long long)header_line, o->label,
                            t->n_cols, list);
    }
    int c = o->label_index < 0 ? t->n_cols + o->label_index : o->label_index;
    if (c < 0 || c >= t->n_cols)
        return nb_set_error(NB_ERR_NOT_FOUND, "%s:%lld: label column index %d is out of range: "
                            "the table has %d columns", ps->path, (long long)header_line,
                            o->label_index, t->n_cols);
    t->label_col = c;
    return NB_OK;
}

static nb_status parse_number(const parser *ps, const table *t, const field *f, int col,
                              double *out) {
    char name[300];
    if (f->start == f->end)
        return nb_set_error(NB_ERR_FORMAT, "%s:%lld:%lld: field %d%s is empty", ps->path,
                            (long long)ps->line, (long long)f->column, col + 1,
                            col_name(t, col, name, sizeof name));
    char saved = *f->end;
    *f->end = 0; /* the buffer has a spare byte after the file's end */
    char *stop;
    double v = strtod(f->start, &stop);
    *f->end = saved;
    if (stop != f->end)
        return nb_set_error(NB_ERR_FORMAT, "%s:%lld:%lld: field %d%s: \"%.*s\" is not a number",
                            ps->path, (long long)ps->line, (long long)f->column, col + 1,
                            col_name(t, col, name, sizeof name), shown_len(f), f->start);
    *out = v;
    return NB_OK;
}

/* A value that is, or would be stored as, nan or infinite. */
static nb_status check_finite(const parser *ps, const table *t, const field *f, int col,
                              nb_dtype dtype, double v) {
    char name[300];
    int len = shown_len(f);
    if (!isfinite(v))
        return nb_set_error(NB_ERR_FORMAT, "%s:%lld:%lld: field %d%s: \"%.*s\" is not a finite "
                            "number (set allow_nonfinite in the CSV options to accept nan and "
                            "inf)", ps->path, (long long)ps->line, (long long)f->column, col + 1,
                            col_name(t, col, name, sizeof name), len, f->start);
    if (dtype == NB_F32 && fabs(v) > FLT_MAX)
        return nb_set_error(NB_ERR_FORMAT, "%s:%lld:%lld: field %d%s: %.*s is beyond the range "
                            "of f32 (it would be stored as inf; use f64)", ps->path,
                            (long long)ps->line, (long long)f->column, col + 1,
                            col_name(t, col, name, sizeof name), len, f->start);
    return NB_OK;
}

/* A class label must be an integer in [0, max_classes): a label of 1e9 is
 * far more likely a wrong column than a billion classes, and a program
 * sizing its output layer by the largest label would otherwise allocate
 * for it before anything named the row. */
static nb_status check_label(const parser *ps, const table *t, const field *f,
                             const nb_csv_options *o, double v) {
    nb_dtype dtype = o->label_dtype;
    if (nb_dtype_is_float(dtype)) return NB_OK;
    double lim = dtype == NB_I32 ? 2147483647.0 : 9.2e18;
    int64_t max = o->max_classes > 0 ? o->max_classes : NB_CSV_MAX_CLASSES;
    char why[200];
    why[0] = 0;
    if (v != floor(v) || fabs(v) > lim) snprintf(why, sizeof why, "is not an integer");
    else if (v < 0) snprintf(why, sizeof why, "is negative (class labels are 0, 1, ...)");
    else if (v >= (double)max)
        snprintf(why, sizeof why, "is not below max_classes %lld (a wrong label column? raise "
                 "max_classes in the CSV options if there are that many classes)", (long long)max);
    if (!why[0]) return NB_OK;
    char name[300];
    return nb_set_error(NB_ERR_FORMAT, "%s:%lld:%lld: field %d%s: label %.*s %s (label_dtype %s)",
                        ps->path, (long long)ps->line, (long long)f->column, t->label_col + 1,
                        col_name(t, t->label_col, name, sizeof name), shown_len(f), f->start, why,
                        nb_dtype_name(dtype));
}

static void check_options(const nb_csv_options *o) {
    NB_CHECK(o->input_dtype == NB_F32 || o->input_dtype == NB_F64,
             "nb_dataset_open_csv: input_dtype %s; use f32 or f64",
             nb_dtype_name(o->input_dtype));
    NB_CHECK(o->label_dtype == NB_F32 || o->label_dtype == NB_F64 || o->label_dtype == NB_I32 ||
             o->label_dtype == NB_I64, "nb_dataset_open_csv: label_dtype %s; use i64, i32, f32 "
             "or f64", nb_dtype_name(o->label_dtype));
    NB_CHECK(o->skip_lines >= 0, "nb_dataset_open_csv: skip_lines %d < 0", o->skip_lines);
    NB_CHECK(o->max_classes >= 0, "nb_dataset_open_csv: max_classes %lld < 0 (0: %d)",
             (long long)o->max_classes, NB_CSV_MAX_CLASSES);
    NB_CHECK(o->delimiter && o->delimiter != '"' && o->delimiter != '\n',
             "nb_dataset_open_csv: delimiter %d cannot separate fields", o->delimiter);
    NB_CHECK(o->sample_ndim >= 0 && o->sample_ndim <= NB_MAX_DIMS - 1, "nb_dataset_open_csv: "
             "sample_ndim %d; use 0 (flat) to %d", o->sample_ndim, NB_MAX_DIMS - 1);
    for (int d = 0; d < o->sample_ndim; d++)
        NB_CHECK(o->sample_shape[d] > 0, "nb_dataset_open_csv: sample_shape[%d] = %lld must be "
                 "> 0", d, (long long)o->sample_shape[d]);
}

/* The input field: (F), or sample_shape when it holds F values. */
static nb_status input_field(const parser *ps, const table *t, const nb_csv_options *o,
                             int64_t header_line, nb_field *out) {
    int64_t n_feat = t->n_cols - 1;
    if (o->sample_ndim == 0) {
        *out = nb_field_of(o->input_dtype, NB_SHAPE(n_feat));
        return NB_OK;
    }
    int64_t numel = 1;
    char shape[200];
    size_t k = 0;
    for (int d = 0; d < o->sample_ndim; d++) {
        numel *= o->sample_shape[d];
        k += (size_t)snprintf(shape + k, sizeof shape - k, d ? ", %lld" : "(%lld",
                              (long long)o->sample_shape[d]);
    }
    snprintf(shape + k, sizeof shape - k, o->sample_ndim == 1 ? ",)" : ")");
    if (numel != n_feat) {
        char name[300];
        return nb_set_error(NB_ERR_FORMAT, "%s:%lld: sample_shape %s holds %lld values, but the "
                            "table has %lld feature columns (%d columns less the label, column "
                            "%d%s)", ps->path, (long long)header_line, shape, (long long)numel,
                            (long long)n_feat, t->n_cols, t->label_col + 1,
                            col_name(t, t->label_col, name, sizeof name));
    }
    *out = nb_field_of(o->input_dtype, o->sample_ndim, o->sample_shape);
    return NB_OK;
}

/* Parses the data rows into c; when `have_first`, the line last split is
 * the first row (a file without a header). */
static nb_status parse_rows(parser *ps, table *t, const nb_csv_options *o, nb__rows *c,
                            bool have_first, int64_t max_rows) {
    int n_feat = t->n_cols - 1;
    size_t fsz = nb_dtype_size(o->input_dtype), lsz = nb_dtype_size(o->label_dtype);
    c->inputs = malloc((size_t)max_rows * (size_t)n_feat * fsz + 1);
    c->targets = malloc((size_t)max_rows * lsz + 1);
    if (!c->inputs || !c->targets)
        return nb_set_error(NB_ERR_NOMEM, "%s: out of memory for %lld rows", ps->path,
                            (long long)max_rows);
    char *s, *e;
    bool pending = have_first;
    for (;;) {
        if (!pending) {
            if (!next_line(ps, &s, &e)) break;
            if (is_blank(s, e)) continue;
            nb_status st = split_line(ps, s, e);
            if (st) return st;
        } else {
            pending = false;
        }
        if (ps->n_fields != t->n_cols) {
            bool few = ps->n_fields < t->n_cols;
            int64_t col = few ? ps->fields[ps->n_fields - 1].end - ps->line_start + 1
                              : ps->fields[t->n_cols].column;
            return nb_set_error(NB_ERR_FORMAT, "%s:%lld:%lld: ragged row: %d fields, but the %s "
                                "has %d", ps->path, (long long)ps->line, (long long)col,
                                ps->n_fields, t->names ? "header" : "first row", t->n_cols);
        }
        char *frow = c->inputs + (size_t)c->n * (size_t)n_feat * fsz;
        int k = 0;
        for (int col = 0; col < t->n_cols; col++) {
            double v = 0;
            nb_status st = parse_number(ps, t, &ps->fields[col], col, &v);
            if (st) return st;
            nb_dtype dt = col == t->label_col ? o->label_dtype : o->input_dtype;
            if (!o->allow_nonfinite && (st = check_finite(ps, t, &ps->fields[col], col, dt, v)))
                return st;
            if (col == t->label_col) {
                st = check_label(ps, t, &ps->fields[col], o, v);
                if (st) return st;
                nb__store(c->targets + (size_t)c->n * lsz, o->label_dtype, v);
            } else {
                nb__store(frow + (size_t)k++ * fsz, o->input_dtype, v);
            }
        }
        c->n++;
    }
    return NB_OK;
}

nb_status nb_dataset_open_csv(nb_dataset **out, const char *path, const nb_csv_options *opts) {
    *out = NULL;
    nb_csv_options o = opts ? *opts : nb_csv_defaults();
    check_options(&o);
    char *buf;
    size_t size;
    nb_status st = nb__read_file(path, &buf, &size);
    if (st) return st;
    return nb__csv_parse(out, path, buf, size, &o);
}

nb_status nb__csv_parse(nb_dataset **out, const char *path, char *buf, size_t size,
                        const nb_csv_options *opts) {
    *out = NULL;
    nb_csv_options o = *opts;
    check_options(&o);
    nb_status st = NB_OK;
    parser ps = {path, o.delimiter, buf, buf + size, buf, 0, NULL, 0, 0};
    table t = {0, 0, NULL};
    nb__rows *c = calloc(1, sizeof *c);
    if (!c) {
        st = nb_set_error(NB_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    int64_t max_rows = 1;
    for (size_t i = 0; i < size; i++) max_rows += buf[i] == '\n';

    char *s, *e;
    for (int i = 0; i < o.skip_lines; i++)
        if (!next_line(&ps, &s, &e)) break;
    bool found = false;
    while (next_line(&ps, &s, &e))
        if (!is_blank(s, e)) {
            found = true;
            break;
        }
    if (!found) {
        st = size == 0 ? nb_set_error(NB_ERR_FORMAT, "%s: empty file (no header, no rows)", path)
                       : nb_set_error(NB_ERR_FORMAT, "%s:%lld: no %s after %d skipped line(s) "
                                      "(only blank lines)", path, (long long)ps.line,
                                      o.no_header ? "rows" : "header", o.skip_lines);
        goto done;
    }
    int64_t first_line = ps.line;
    if ((st = split_line(&ps, s, e))) goto done;
    t.n_cols = ps.n_fields;
    if (t.n_cols < 2) {
        st = nb_set_error(NB_ERR_FORMAT, "%s:%lld: %d column: a table needs a label column and "
                          "at least one feature (is the delimiter '%c'?)", path,
                          (long long)first_line, t.n_cols, o.delimiter);
        goto done;
    }
    if (!o.no_header) {
        t.names = calloc((size_t)t.n_cols, sizeof *t.names);
        if (!t.names) {
            st = nb_set_error(NB_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
        for (int col = 0; col < t.n_cols; col++) {
            field *f = &ps.fields[col];
            size_t len = (size_t)(f->end - f->start);
            t.names[col] = malloc(len + 1);
            if (!t.names[col]) {
                st = nb_set_error(NB_ERR_NOMEM, "%s: out of memory", path);
                goto done;
            }
            memcpy(t.names[col], f->start, len);
            t.names[col][len] = 0;
        }
    }
    if ((st = find_label(&ps, &t, &o, first_line))) goto done;
    nb_field in;
    if ((st = input_field(&ps, &t, &o, first_line, &in))) goto done;
    if ((st = parse_rows(&ps, &t, &o, c, o.no_header, max_rows))) goto done;
    if (c->n == 0) {
        st = nb_set_error(NB_ERR_FORMAT, "%s:%lld: no data rows after the header", path,
                          (long long)first_line);
        goto done;
    }
    nb_field lab = nb_field_of(o.label_dtype, 0, NULL);
    c->in_bytes = nb_field_bytes(&in);
    c->tgt_bytes = nb_field_bytes(&lab);
    *out = nb_dataset_new(&csv_vt, c, in, lab);
    c = NULL;
done:
    nb__rows_free(c);
    if (t.names)
        for (int col = 0; col < t.n_cols; col++) free(t.names[col]);
    free(t.names);
    free(ps.fields);
    free(buf);
    return st;
}
