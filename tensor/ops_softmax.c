/* Softmax and log-softmax along one axis, and the causal softmax of
 * attention: front ends and backward.
 *
 * The input is made contiguous and seen as (O, K, I), K the axis; the
 * kernels (tensor/cpu/softmax.c) subtract each row's maximum, so large
 * logits do not overflow. Backward uses only the output:
 * softmax dx = y (g - sum_K g y), log-softmax dx = g - exp(y) sum_K g.
 *
 * nb_softmax_causal fuses attention's scale, causal mask and softmax into
 * one kernel over the kept half of the scores (row i keeps keys j <= i),
 * forward and backward, on both devices (tensor/cpu/softmax.c,
 * tensor/cuda/softmax_causal.cu); it records one node.
 *
 * nb__causal_attention is all of causal self-attention between the qkv
 * and output projections as one op, on backends that have it (the CPU:
 * tensor/cpu/attention.h); the attention layer (nn/attention.c) composes
 * the ops above where it returns NULL. */
#include <limits.h>
#include <math.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

static void softmax_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *y = n->out;
    g = nb__contig(ctx, g);
    nb_tensor *dx = nb__empty(ctx, y->dtype, y->ndim, y->shape);
    nb__backend_at(y)->softmax_backward(dx, y, g, n->i[0], n->i[1], n->i[2], n->i[3] != 0);
    nb__accum_grad(ctx, n->in[0], dx);
}

static nb_tensor *softmax_impl(nb_ctx *ctx, const char *op, nb_tensor *x, int axis,
                               bool take_log) {
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    int d = nb_normalize_dim(op, axis, x->ndim);
    int64_t outer = nb__numel_shape(d, x->shape), k = x->shape[d];
    int64_t inner = nb__numel_shape(x->ndim - d - 1, x->shape + d + 1);
    nb_tensor *xc = nb__contig(ctx, x);
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb__backend_at(x)->softmax(y, xc, outer, k, inner, take_log);
    nb_node *n = nb__record(ctx, op, softmax_backward, y, 1, &x);
    nb__node_reads(n, NB__READS_OUT);
    if (n) {
        n->i[0] = outer;
        n->i[1] = k;
        n->i[2] = inner;
        n->i[3] = take_log;
    }
    return y;
}

nb_tensor *nb_softmax(nb_ctx *ctx, nb_tensor *x, int axis) {
    return softmax_impl(ctx, "nb_softmax", x, axis, false);
}

nb_tensor *nb_log_softmax(nb_ctx *ctx, nb_tensor *x, int axis) {
    return softmax_impl(ctx, "nb_log_softmax", x, axis, true);
}

static void softmax_causal_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *y = n->out;
    g = nb__contig(ctx, g);
    nb_tensor *dx = nb__empty(ctx, y->dtype, y->ndim, y->shape);
    nb__backend_at(y)->softmax_causal_backward(dx, y, g, n->i[0], n->i[1], n->i[2], n->f[0]);
    nb__accum_grad(ctx, n->in[0], dx);
}

nb_tensor *nb_softmax_causal(nb_ctx *ctx, nb_tensor *x, double scale) {
    const char *op = "nb_softmax_causal";
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    NB_CHECK(x->ndim >= 2, "%s: input %s needs at least 2 dims (.., T, S)", op, nb_shape_str(x));
    NB_CHECK(isfinite(scale) && scale != 0, "%s: scale %g must be finite and nonzero", op, scale);
    int64_t t = x->shape[x->ndim - 2], s = x->shape[x->ndim - 1];
    int64_t b = nb__numel_shape(x->ndim - 2, x->shape);
    nb_tensor *xc = nb__contig(ctx, x);
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb__backend_at(x)->softmax_causal(y, xc, b, t, s, scale);
    nb_node *n = nb__record(ctx, op, softmax_causal_backward, y, 1, &x);
    nb__node_reads(n, NB__READS_OUT);
    if (n) {
        n->i[0] = b;
        n->i[1] = t;
        n->i[2] = s;
        n->f[0] = scale;
    }
    return y;
}

/* Runs with grad mode off (Note [Tape]). Note [Attention contract] in
 * tensor/backend.h: the backend writes every element of dqkv, which
 * becomes qkv's gradient as it is (nb__accum_grad adopts it when qkv has
 * none yet, which is the attention layer's case). */
static void causal_attention_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    nb_tensor *qkv = node->saved[0], *lse = node->saved[1]; /* contiguous */
    nb_tensor *gy = nb__contig(ctx, g);
    nb_tensor *dqkv = nb__empty(ctx, qkv->dtype, 3, qkv->shape);
    nb__backend_at(qkv)->causal_attention_backward(ctx, dqkv, qkv, node->out, lse, gy,
                                                   (int)node->i[0], node->f[0]);
    nb__accum_grad(ctx, node->in[0], dqkv);
}

nb_tensor *nb__causal_attention(nb_ctx *ctx, nb_tensor *qkv, int h, double scale) {
    const char *op = "CausalSelfAttention";
    nb__check_ctx(op, ctx, qkv);
    NB_CHECK(qkv->ndim == 3 && h > 0 && qkv->shape[2] % (3 * (int64_t)h) == 0,
             "%s: qkv %s must be (N, T, 3C) with C a multiple of the %d heads", op,
             nb_shape_str(qkv), h);
    nb__check_compute_float(op, ctx, qkv);
    const nb__backend *be = nb__backend_at(qkv);
    int64_t n = qkv->shape[0], t = qkv->shape[1], c = qkv->shape[2] / 3;
    if (!be->causal_attention || !(be->causal_attention_dtypes & (1u << qkv->dtype)) ||
        3 * c > INT_MAX || t > INT_MAX ||
        (be->causal_attention_takes && !be->causal_attention_takes(qkv, h)))
        return NULL;
    nb_tensor *qc = nb__contig(ctx, qkv);
    nb_tensor *y = nb__empty(ctx, qkv->dtype, NB_SHAPE(n, t, c));
    nb_tensor *lse = nb__empty(ctx, NB_F32, NB_SHAPE(n, h, t));
    be->causal_attention(ctx, y, lse, qc, h, scale);
    nb_node *node = nb__record(ctx, op, causal_attention_backward, y, 1, &qkv);
    nb__node_reads(node, NB__READS_OUT);
    if (node) {
        node->saved[0] = qc;
        node->saved[1] = lse;
        nb__mem_internal(node, qc);
        nb__mem_internal(node, lse);
        node->i[0] = h;
        node->f[0] = scale;
    }
    return y;
}
