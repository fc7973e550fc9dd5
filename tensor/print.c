/* nb_tensor_fprint: a PyTorch-like rendering for debugging. Dimensions longer than
 * 2 * EDGE + 1 show their first and last EDGE entries around "..." once the
 * tensor has more than SUMMARIZE elements. Floats use fixed notation with
 * 4 decimals unless their magnitudes call for scientific notation. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

#define EDGE 3
#define SUMMARIZE 1000

typedef struct pstate {
    FILE *f;
    const nb_tensor *t;
    bool summarize, sci, is_float;
    int width;
} pstate;

static double value_at(const nb_tensor *t, const int64_t *idx) {
    int64_t off = 0;
    for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
    return nb__load((const char *)t->data + off * (int64_t)nb_dtype_size(t->dtype), t->dtype);
}

static int format(char *buf, size_t n, const pstate *s, double v) {
    if (!s->is_float) return snprintf(buf, n, "%.0f", v);
    if (isnan(v)) return snprintf(buf, n, "nan");
    if (isinf(v)) return snprintf(buf, n, v > 0 ? "inf" : "-inf");
    return snprintf(buf, n, s->sci ? "%.4e" : "%.4f", v);
}

static bool shown(const pstate *s, int d, int64_t i) {
    int64_t n = s->t->shape[d];
    return !s->summarize || n <= 2 * EDGE + 1 || i < EDGE || i >= n - EDGE;
}

/* visits shown elements to find the formatting */
static void scan(pstate *s, int d, int64_t *idx, double *maxabs, double *minabs, bool *nonint) {
    const nb_tensor *t = s->t;
    if (d == t->ndim) {
        double v = value_at(t, idx), a = fabs(v);
        if (isfinite(v)) {
            if (a > *maxabs) *maxabs = a;
            if (a > 0 && a < *minabs) *minabs = a;
            if (v != floor(v)) *nonint = true;
        }
        char buf[64];
        int w = format(buf, sizeof buf, s, v);
        if (w > s->width) s->width = w;
        return;
    }
    for (int64_t i = 0; i < t->shape[d]; i++) {
        if (!shown(s, d, i)) continue;
        idx[d] = i;
        scan(s, d + 1, idx, maxabs, minabs, nonint);
    }
}

static void emit(pstate *s, int d, int64_t *idx, int indent) {
    const nb_tensor *t = s->t;
    if (d == t->ndim) {
        char buf[64];
        format(buf, sizeof buf, s, value_at(t, idx));
        fprintf(s->f, "%*s", s->width, buf);
        return;
    }
    fputc('[', s->f);
    int64_t n = t->shape[d];
    bool skipped = false;
    for (int64_t i = 0; i < n; i++) {
        if (!shown(s, d, i)) {
            if (!skipped) {
                skipped = true;
                if (d == t->ndim - 1) fprintf(s->f, "..., ");
                else fprintf(s->f, "...,\n%*s", indent + 1, "");
            }
            continue;
        }
        idx[d] = i;
        emit(s, d + 1, idx, indent + 1);
        if (i + 1 < n) {
            if (d == t->ndim - 1) fprintf(s->f, ", ");
            else {
                fputc(',', s->f);
                for (int k = d; k < t->ndim - 1; k++) fputc('\n', s->f);
                fprintf(s->f, "%*s", indent + 1, "");
            }
        }
    }
    fputc(']', s->f);
}

void nb_tensor_fprint(FILE *f, const nb_tensor *t) {
    nb__check_live("nb_tensor_fprint", t);
    const nb_tensor *orig = t;
    nb_tensor host;
    void *buf = NULL;
    if (nb__backend_at(t)->meta) nb__meta_no_values("nb_tensor_fprint", t);
    if (nb__backend_at(t)->device_memory) { /* a contiguous host copy of the values */
        buf = malloc((size_t)nb_numel(t) * nb_dtype_size(t->dtype) + 1);
        NB_CHECK(buf, "nb_tensor_fprint: out of host memory for %s", nb_shape_str(t));
        nb_to_host(t, buf);
        host = *t;
        host.device = nb_cpu();
        host.data = buf;
        nb__contig_strides(host.ndim, host.shape, host.strides);
        t = &host;
    }
    pstate s = {f, t, nb_numel(t) > SUMMARIZE, false, nb_dtype_is_float(t->dtype), 1};
    int64_t idx[NB_MAX_DIMS] = {0};
    const char *prefix = "tensor(";
    fputs(prefix, f);
    if (nb_numel(t) == 0) {
        fputs("[]", f);
    } else {
        double maxabs = 0, minabs = INFINITY;
        bool nonint = false;
        scan(&s, 0, idx, &maxabs, &minabs, &nonint);
        if (s.is_float && (maxabs >= 1e8 || (nonint && minabs < 1e-4) || (maxabs / minabs > 1e6 && nonint)))
            s.sci = true;
        s.width = 1;
        scan(&s, 0, idx, &maxabs, &minabs, &nonint);
        emit(&s, 0, idx, (int)strlen(prefix));
    }
    fprintf(f, ", dtype=%s, shape=%s", nb_dtype_name(t->dtype), nb_shape_str(t));
    if (orig->device.type != NB_DEVICE_CPU) fprintf(f, ", device=%s", nb_device_name(orig->device));
    if (t->name) fprintf(f, ", name=\"%s\"", t->name);
    if (t->requires_grad) fprintf(f, t->node ? ", grad_fn=%s" : ", requires_grad=true", t->node ? t->node->op : "");
    fputs(")\n", f);
    free(buf);
}

void nb_tensor_print(const nb_tensor *t) { nb_tensor_fprint(stdout, t); }
