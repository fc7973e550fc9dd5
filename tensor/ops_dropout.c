/* nb_dropout; kernels behind the backend table (tensor/cpu/dropout.c,
 * tensor/cuda/dropout.cu). The mask follows Note [Random streams]
 * in tensor/random.c: element i (row-major in x) is kept when lane i % 4 of
 * philox(seed, offset + i / 4), as nb_u32_to_unit, is >= p (compared in
 * double); the offset then advances by ceil(n / 4). The scaled mask
 * (1 / (1 - p) where kept, 0 elsewhere) is saved for backward. */
#include "tensor/backend.h"
#include "tensor/internal.h"

static void dropout_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    nb__accum_grad(ctx, node->in[0], nb__binary(ctx, NB_B_MUL, g, node->saved[0]));
}

nb_tensor *nb_dropout(nb_ctx *ctx, nb_tensor *x, double p, bool training, nb_rng *rng) {
    NB_CHECK(p >= 0 && p <= 1, "nb_dropout: p must be in [0, 1], got %g (input %s)", p,
             nb_shape_str(x));
    nb__check_ctx("nb_dropout", ctx, x);
    nb__check_compute_float("nb_dropout", ctx, x);
    if (!training || p == 0) return x;
    if (!rng) rng = nb_rng_default();
    int64_t n = nb_numel(x);
    nb_tensor *xc = nb__contig(ctx, x);
    nb_tensor *out = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb_tensor *mask = nb__needs_grad(1, &x) ? nb__empty(ctx, x->dtype, x->ndim, x->shape) : NULL;
    nb__rng_used(rng); /* Note [Recomputation] in nn/recompute.c */
    nb__backend_at(x)->dropout(out, mask, xc, p, rng->seed, rng->offset);
    rng->offset += (uint64_t)(n + 3) / 4;
    nb_node *node = nb__record(ctx, "nb_dropout", dropout_backward, out, 1, &x);
    if (node) {
        node->saved[0] = mask;
        nb__mem_internal(node, mask);
    }
    return out;
}
