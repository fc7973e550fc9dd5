/* nb_embedding: rows of a (V, C) table gathered by i32/i64 indices of any
 * shape, and its backward, which scatter-adds the output gradient into a
 * zero (V, C) gradient in row-major index order, so repeated indices
 * accumulate deterministically. Kernels behind the backend table
 * (tensor/cpu/embedding.c, tensor/cuda/embedding.cu); indices are
 * range-checked by them: on the CPU at once, on CUDA by the kernel (Note
 * [Deferred device checks] in tensor/cuda/cuda.h), as a check here would
 * need a host read.
 *
 * Letters: V rows (vocabulary), C columns, P index positions. */
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

static void embedding_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *w = n->in[0], *idx = n->saved[0];
    nb_tensor *cg = nb__contig(ctx, g);
    if (cg->dtype != w->dtype) {
        nb_tensor *cast = nb__empty(ctx, w->dtype, cg->ndim, cg->shape);
        nb__run_copy(cast, cg);
        cg = cast;
    }
    nb_tensor *gw = nb__empty(ctx, w->dtype, 2, w->shape);
    nb__backend_at(w)->embedding_backward(gw, cg, idx, nb_numel(idx));
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
    int64_t np = nb_numel(idx);

    int64_t shape[NB_MAX_DIMS];
    memcpy(shape, indices->shape, sizeof(int64_t) * (size_t)indices->ndim);
    shape[indices->ndim] = weight->shape[1];
    nb_tensor *out = nb__empty(ctx, weight->dtype, indices->ndim + 1, shape);
    nb__backend_at(weight)->embedding(out, weight, idx, np);

    nb_node *n = nb__record(ctx, name, embedding_backward, out, 1, &weight);
    if (n) n->saved[0] = idx;
    return out;
}
