/* The CPU backend's embedding (tensor/backend.h; the op is
 * tensor/ops_embedding.c): a gather of rows, with the indices checked on
 * the host first, and a scatter-add in row-major index order, so repeated
 * indices accumulate deterministically. */
#include <string.h>

#include "tensor/cpu/cpu.h"

static int64_t index_at(const nb_tensor *idx, int64_t p) {
    return idx->dtype == NB_I32 ? ((const int32_t *)idx->data)[p] : ((const int64_t *)idx->data)[p];
}

/* out (P, C) contiguous = w[idx[p]] for each position; w any strides */
static void gather_rows(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np) {
    int64_t c = w->shape[1], sv = w->strides[0], sc = w->strides[1];
    size_t es = nb_dtype_size(w->dtype);
    char *dst = out->data;
    const char *src = w->data;
    for (int64_t p = 0; p < np; p++, dst += c * (int64_t)es) {
        const char *row = src + index_at(idx, p) * sv * (int64_t)es;
        if (sc == 1 || c <= 1) {
            memcpy(dst, row, (size_t)c * es);
        } else if (w->dtype == NB_F32) {
            for (int64_t j = 0; j < c; j++) ((float *)dst)[j] = ((const float *)row)[j * sc];
        } else {
            for (int64_t j = 0; j < c; j++) ((double *)dst)[j] = ((const double *)row)[j * sc];
        }
    }
}

/* gw (V, C) contiguous += g (P, C) contiguous, row p into row idx[p] */
static void scatter_add_rows(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx, int64_t np) {
    int64_t c = gw->shape[1];
    for (int64_t p = 0; p < np; p++) {
        int64_t r = index_at(idx, p);
        if (gw->dtype == NB_F32) {
            float *dst = (float *)gw->data + r * c;
            const float *src = (const float *)g->data + p * c;
            for (int64_t j = 0; j < c; j++) dst[j] += src[j];
        } else {
            double *dst = (double *)gw->data + r * c;
            const double *src = (const double *)g->data + p * c;
            for (int64_t j = 0; j < c; j++) dst[j] += src[j];
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
    gather_rows(out, w, idx, np);
}

void nb__cpu_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                int64_t np) {
    memset(gw->data, 0, (size_t)nb_numel(gw) * nb_dtype_size(gw->dtype));
    scatter_add_rows(gw, g, idx, np);
}
