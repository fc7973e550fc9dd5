/* The CPU backend's embedding (tensor/backend.h; the op is
 * tensor/ops_embedding.c): a gather of rows, with the indices checked on
 * the host first, and a scatter-add in row-major index order, so repeated
 * indices accumulate deterministically; on the thread pool, the scatter is
 * cut by columns (each still in index order) and the gather by positions. */
#include <string.h>

#include "tensor/cpu/cpu.h"
#include "tensor/cpu/threads.h"

static int64_t index_at(const nb_tensor *idx, int64_t p) {
    return idx->dtype == NB_I32 ? ((const int32_t *)idx->data)[p] : ((const int64_t *)idx->data)[p];
}

typedef struct emb_job {
    nb_tensor *out;
    const nb_tensor *w, *idx, *g;
    int64_t np;
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

/* gw (V, C) contiguous += g (P, C) contiguous, row p into row idx[p], for
 * columns [c0, c1), positions in order */
static void scatter_add_cols(void *varg, int64_t c0, int64_t c1) {
    const emb_job *j = varg;
    nb_tensor *gw = j->out;
    int64_t c = gw->shape[1], np = j->np;
    for (int64_t p = 0; p < np; p++) {
        int64_t r = index_at(j->idx, p);
        if (gw->dtype == NB_F32) {
            float *dst = (float *)gw->data + r * c;
            const float *src = (const float *)j->g->data + p * c;
            for (int64_t k = c0; k < c1; k++) dst[k] += src[k];
        } else {
            double *dst = (double *)gw->data + r * c;
            const double *src = (const double *)j->g->data + p * c;
            for (int64_t k = c0; k < c1; k++) dst[k] += src[k];
        }
    }
}

void nb__cpu_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np) {
    int64_t v = w->shape[0];
    for (int64_t p = 0; p < np; p++) {
        int64_t r = index_at(idx, p);
        NB_CHECK(r >= 0 && r < v, "nb_embedding: index %lld at position %lld is out of range for "
                 "%lld rows", (long long)r, (long long)p, (long long)v);
    }
    emb_job j = {.out = out, .w = w, .idx = idx};
    nb__parallel_range(np, nb__grain(w->shape[1]), gather_rows, &j);
}

void nb__cpu_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                int64_t np) {
    memset(gw->data, 0, (size_t)nb_numel(gw) * nb_dtype_size(gw->dtype));
    emb_job j = {.out = gw, .g = g, .idx = idx, .np = np};
    int64_t c = gw->shape[1];
    /* pieces of at least 64 columns (whole cache lines of a row) */
    int64_t grain = np * c >= 2 * NB__PARALLEL_GRAIN ? 64 : c;
    nb__parallel_range(c, grain, scatter_add_cols, &j);
}
