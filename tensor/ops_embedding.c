/* nb_embedding: rows of a (V, C) table gathered by i32/i64 indices of any
 * shape, and its backward, which scatter-adds the output gradient into a
 * zero (V, C) gradient in row-major index order, so repeated indices
 * accumulate deterministically. The CPU kernels are small and live here;
 * on CUDA, indices are range-checked by the kernel (Note [Deferred device
 * checks] in tensor/cuda/cuda.h) rather than here, which would need a
 * host read.
 *
 * Letters: V rows (vocabulary), C columns, P index positions. */
#include <string.h>

#include "tensor/cuda/cuda.h"
#include "tensor/internal.h"

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

static void embedding_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *w = n->in[0], *idx = n->saved[0];
    nb_tensor *cg = nb__contig(ctx, g);
    if (cg->dtype != w->dtype) {
        nb_tensor *cast = nb__empty(ctx, w->dtype, cg->ndim, cg->shape);
        nb__run_copy(cast, cg);
        cg = cast;
    }
    if (nb__is_cuda(w)) {
        nb_tensor *gw = nb__empty(ctx, w->dtype, 2, w->shape);
        nb__cuda_embedding_backward(gw, cg, idx, nb_numel(idx));
        nb__accum_grad(ctx, w, gw);
        return;
    }
    nb_tensor *gw = nb_zeros(ctx, w->dtype, 2, w->shape);
    scatter_add_rows(gw, cg, idx, nb_numel(idx));
    nb__accum_grad(ctx, w, gw);
}

nb_tensor *nb_embedding(nb_ctx *ctx, nb_tensor *weight, nb_tensor *indices) {
    const char *name = "nb_embedding";
    nb__check_ctx(name, ctx, weight);
    nb__check_ctx(name, ctx, indices);
    NB_CHECK(weight->ndim == 2, "%s: weight must be 2-D (V, C), got %s", name, nb_shape_str(weight));
    nb__check_float(name, weight);
    nb__check_index_dtype(name, indices);
    NB_CHECK(indices->ndim < NB_MAX_DIMS,
             "%s: indices %s have %d dims; the output would need %d, at most %d", name,
             nb_shape_str(indices), indices->ndim, indices->ndim + 1, NB_MAX_DIMS);

    nb_tensor *idx = nb__contig(ctx, indices);
    int64_t np = nb_numel(idx), v = weight->shape[0];
    for (int64_t p = 0; !nb__is_cuda(idx) && p < np; p++) {
        int64_t r = index_at(idx, p);
        NB_CHECK(r >= 0 && r < v, "%s: index %lld at position %lld is out of range for %lld rows",
                 name, (long long)r, (long long)p, (long long)v);
    }

    int64_t shape[NB_MAX_DIMS];
    memcpy(shape, indices->shape, sizeof(int64_t) * (size_t)indices->ndim);
    shape[indices->ndim] = weight->shape[1];
    nb_tensor *out = nb__empty(ctx, weight->dtype, indices->ndim + 1, shape);
    if (nb__is_cuda(weight)) nb__cuda_embedding(out, weight, idx, np);
    else gather_rows(out, weight, idx, np);

    nb_node *n = nb__record(ctx, name, embedding_backward, out, 1, &weight);
    if (n) n->saved[0] = idx;
    return out;
}
