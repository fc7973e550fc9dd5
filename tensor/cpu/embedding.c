/* The CPU backend's embedding (tensor/backend.h; the op is
 * tensor/ops_embedding.c): a gather of rows, with the indices checked on
 * the host first, and its backward: the positions grouped by row (a
 * stable counting sort, so each row's keep increasing order), each row's
 * sum formed from 0 and then stored or added into the gradient, so repeated
 * indices accumulate deterministically and an accumulating backward adds
 * the same value a separate gradient would; on the thread pool, the
 * backward is cut by columns and the gathers by positions. The GPT's input
 * (token plus position rows) adds in f32 (f64 for f64) and rounds once,
 * the values of an f32 add followed by a cast.
 *
 * Letters: V rows, C columns, P index positions (N sequences of T). */
#include <stdlib.h>
#include <string.h>

#include "nabla/dtype.h"

#include "tensor/cpu/cpu.h"
#include "tensor/cpu/threads.h"

static int64_t index_at(const nb_tensor *idx, int64_t p) {
    return idx->dtype == NB_I32 ? ((const int32_t *)idx->data)[p] : ((const int64_t *)idx->data)[p];
}

static void check_indices(const nb_tensor *idx, int64_t np, int64_t v) {
    for (int64_t p = 0; p < np; p++) {
        int64_t r = index_at(idx, p);
        NB_CHECK(r >= 0 && r < v, "nb_embedding: index %lld at position %lld is out of range for "
                 "%lld rows", (long long)r, (long long)p, (long long)v);
    }
}

/* Element i of a float tensor's data, exactly, and v stored rounded to
 * dt (v an f32 value for the 16-bit types). */
static double ld(const void *p, nb_dtype dt, int64_t i) {
    switch (dt) {
    case NB_F32: return ((const float *)p)[i];
    case NB_F64: return ((const double *)p)[i];
    case NB_BF16: return nb_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return nb_f16_to_f32(((const uint16_t *)p)[i]);
    }
}

static void st(void *p, nb_dtype dt, int64_t i, double v) {
    switch (dt) {
    case NB_F32: ((float *)p)[i] = (float)v; break;
    case NB_F64: ((double *)p)[i] = v; break;
    case NB_BF16: ((uint16_t *)p)[i] = nb_f32_to_bf16((float)v); break;
    default: ((uint16_t *)p)[i] = nb_f32_to_f16((float)v); break;
    }
}

/* a + b in f32, or in f64 when wide */
static double add_in(bool wide, double a, double b) { return wide ? a + b : (double)((float)a + (float)b); }

typedef struct emb_job {
    nb_tensor *out;
    const nb_tensor *w, *w2, *idx, *g;
    int64_t np, t;
    const int64_t *start, *order; /* per row, its run in order (counting sort) */
    bool accumulate;
} emb_job;

/* out (P, C) contiguous = w[idx[p]] for positions [p0, p1); w any strides */
static void gather_rows(void *varg, int64_t p0, int64_t p1) {
    const emb_job *j = varg;
    const nb_tensor *w = j->w;
    int64_t c = w->shape[1], sv = w->strides[0], sc = w->strides[1];
    size_t es = nb_dtype_size(w->dtype);
    char *dst = (char *)j->out->data + p0 * c * (int64_t)es;
    const char *src = w->data;
    for (int64_t p = p0; p < p1; p++, dst += c * (int64_t)es) {
        const char *row = src + index_at(j->idx, p) * sv * (int64_t)es;
        if (sc == 1 || c <= 1) {
            memcpy(dst, row, (size_t)c * es);
        } else if (w->dtype == NB_F32) {
            for (int64_t k = 0; k < c; k++) ((float *)dst)[k] = ((const float *)row)[k * sc];
        } else {
            for (int64_t k = 0; k < c; k++) ((double *)dst)[k] = ((const double *)row)[k * sc];
        }
    }
}

void nb__cpu_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np) {
    int64_t v = w->shape[0];
    check_indices(idx, np, v);
    emb_job j = {.out = out, .w = w, .idx = idx};
    nb__parallel_range(np, nb__grain(w->shape[1]), gather_rows, &j);
}

/* gw (V, C) contiguous, columns [c0, c1): each hit row's sum of its
 * positions' rows of g, formed from 0 in increasing position, stored or
 * added */
static void scatter_cols(void *varg, int64_t c0, int64_t c1) {
    const emb_job *j = varg;
    nb_tensor *gw = j->out;
    int64_t v = gw->shape[0], c = gw->shape[1], n = c1 - c0;
    bool wide = gw->dtype == NB_F64;
    double *acc = malloc(sizeof *acc * (size_t)n);
    NB_CHECK(acc, "nb_embedding (backward): no memory for %lld sums", (long long)n);
    for (int64_t r = 0; r < v; r++) {
        int64_t a = j->start[r], b = j->start[r + 1];
        if (a == b) continue;
        for (int64_t k = 0; k < n; k++) acc[k] = 0;
        for (int64_t q = a; q < b; q++) {
            int64_t row = j->order[q] * c;
            for (int64_t k = 0; k < n; k++)
                acc[k] = add_in(wide, acc[k], ld(j->g->data, j->g->dtype, row + c0 + k));
        }
        for (int64_t k = 0; k < n; k++) {
            int64_t e = r * c + c0 + k;
            st(gw->data, gw->dtype, e,
               j->accumulate ? add_in(wide, ld(gw->data, gw->dtype, e), acc[k]) : acc[k]);
        }
    }
    free(acc);
}

void nb__cpu_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                int64_t np, bool accumulate) {
    int64_t v = gw->shape[0], c = gw->shape[1];
    /* positions grouped by row, increasing within each; out of range ones
     * (reported by the forward) left out */
    int64_t *start = calloc((size_t)v + 2, sizeof *start), *order = malloc(sizeof *order * (size_t)(np + 1));
    NB_CHECK(start && order, "nb_embedding (backward): no memory to sort %lld positions", (long long)np);
    for (int64_t p = 0; p < np; p++) {
        int64_t r = index_at(idx, p);
        if (r >= 0 && r < v) start[r + 2]++;
    }
    for (int64_t r = 0; r < v; r++) start[r + 2] += start[r + 1];
    for (int64_t p = 0; p < np; p++) {
        int64_t r = index_at(idx, p);
        if (r >= 0 && r < v) order[start[r + 1]++] = p;
    }
    if (!accumulate) memset(gw->data, 0, (size_t)nb_numel(gw) * nb_dtype_size(gw->dtype));
    emb_job j = {.out = gw, .g = g, .idx = idx, .np = np, .start = start, .order = order,
                 .accumulate = accumulate};
    /* pieces of at least 64 columns (whole cache lines of a row) */
    int64_t grain = (np + v) * c >= 2 * NB__PARALLEL_GRAIN ? 64 : c;
    nb__parallel_range(c, grain, scatter_cols, &j);
    free(order);
    free(start);
}

/* out (N, T, C) contiguous, positions [p0, p1) = wte[idx[p]] + wpe[p % T] */
static void gather_pos_rows(void *varg, int64_t p0, int64_t p1) {
    const emb_job *j = varg;
    const nb_tensor *te = j->w, *pe = j->w2;
    nb_tensor *out = j->out;
    int64_t c = te->shape[1];
    bool wide = te->dtype == NB_F64;
    for (int64_t p = p0; p < p1; p++) {
        int64_t r = index_at(j->idx, p), t = p % j->t;
        for (int64_t k = 0; k < c; k++) {
            double a = ld(te->data, te->dtype, r * te->strides[0] + k * te->strides[1]);
            double b = ld(pe->data, pe->dtype, t * pe->strides[0] + k * pe->strides[1]);
            st(out->data, out->dtype, p * c + k, add_in(wide, a, b));
        }
    }
}

void nb__cpu_embedding_pos(nb_tensor *out, const nb_tensor *wte, const nb_tensor *wpe,
                           const nb_tensor *idx) {
    int64_t v = wte->shape[0], np = nb_numel(idx);
    check_indices(idx, np, v);
    emb_job j = {.out = out, .w = wte, .w2 = wpe, .idx = idx, .t = idx->shape[1]};
    nb__parallel_range(np, nb__grain(wte->shape[1]), gather_pos_rows, &j);
}

/* gpos (P, C) contiguous, columns [c0, c1): row t < T the sum over n of
 * g's (n, t) rows from 0, stored or added; rows >= T 0 unless accumulating */
static void pos_sum_cols(void *varg, int64_t c0, int64_t c1) {
    const emb_job *j = varg;
    nb_tensor *gp = j->out;
    const nb_tensor *g = j->g;
    int64_t n = g->shape[0], t = g->shape[1], c = gp->shape[1];
    bool wide = gp->dtype == NB_F64;
    for (int64_t r = 0; r < gp->shape[0]; r++) {
        for (int64_t k = c0; k < c1; k++) {
            int64_t e = r * c + k;
            if (r >= t) {
                if (!j->accumulate) st(gp->data, gp->dtype, e, 0);
                continue;
            }
            double acc = 0;
            for (int64_t i = 0; i < n; i++) acc = add_in(wide, acc, ld(g->data, g->dtype, (i * t + r) * c + k));
            st(gp->data, gp->dtype, e, j->accumulate ? add_in(wide, ld(gp->data, gp->dtype, e), acc) : acc);
        }
    }
}

void nb__cpu_embedding_pos_backward(nb_tensor *gpos, const nb_tensor *g, bool accumulate) {
    emb_job j = {.out = gpos, .g = g, .accumulate = accumulate};
    int64_t c = gpos->shape[1];
    int64_t grain = nb_numel(g) >= 2 * NB__PARALLEL_GRAIN ? 64 : c;
    nb__parallel_range(c, grain, pos_sum_cols, &j);
}
