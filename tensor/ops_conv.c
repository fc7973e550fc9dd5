/* nb_conv2d: checks, output geometry and backward; the CPU kernels
 * (im2col + GEMM per channel group, a direct loop for depthwise) are in
 * tensor/cpu/conv.c.
 *
 * Output size per spatial dim: floor((H + 2p - d(k - 1) - 1) / s) + 1. The
 * backward recomputes the columns from the saved input instead of keeping
 * them, so memory stays at one image's columns. On CUDA the kernels are
 * cuDNN's. In a context whose compute dtype is bf16/f16 (bf16 only on the
 * CPU), f32 operands are cast to it, the convolution runs in it (products
 * of its values accumulated in f32, the result rounded to it), and the
 * result is cast back to f32, all recorded (Note [Mixed precision on the
 * CPU] in tensor/context.c). */
#include <limits.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

static void conv2d_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const nb__conv2d_geom *geom = node->extra;
    nb_tensor *x = node->in[0], *w = node->in[1], *b = node->in[2];
    nb_tensor *xc = node->saved[0], *wc = node->saved[1];
    nb_dtype dt = xc->dtype;
    g = nb__contig(ctx, g);
    nb_tensor *dx = x->requires_grad ? nb__empty(ctx, dt, 4, x->shape) : NULL;
    nb_tensor *dw = w->requires_grad ? nb__empty(ctx, dt, 4, w->shape) : NULL;
    nb_tensor *db = b && b->requires_grad ? nb__empty(ctx, dt, 1, b->shape) : NULL;
    nb__backend_at(xc)->conv2d_backward(ctx, dt, geom, dx ? dx->data : NULL,
                                        dw ? dw->data : NULL, db ? db->data : NULL, g->data,
                                        xc->data, wc->data);
    if (dx) nb__accum_grad(ctx, x, dx);
    if (dw) nb__accum_grad(ctx, w, dw);
    if (db) nb__accum_grad(ctx, b, db);
}

nb_tensor *nb_conv2d(nb_ctx *ctx, nb_tensor *x, nb_tensor *weight, nb_tensor *bias,
                     const nb_conv2d_opts *opts) {
    const char *op = "nb_conv2d";
    nb_conv2d_opts o = opts ? *opts : NB_CONV2D_DEFAULTS;
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    if (cd != NB_F32 && x->dtype == NB_F32 && weight->dtype == NB_F32) {
        nb__check_ctx(op, ctx, x);
        nb__check_ctx(op, ctx, weight);
        nb_tensor *y = nb_conv2d(ctx, nb_cast(ctx, x, cd), nb_cast(ctx, weight, cd),
                                 bias && bias->dtype == NB_F32 ? nb_cast(ctx, bias, cd) : bias, &o);
        return nb_cast(ctx, y, NB_F32);
    }
    nb__check_ctx(op, ctx, x);
    nb__check_ctx(op, ctx, weight);
    nb__check_compute_float(op, ctx, x);
    nb__check_same_dtype(op, x, weight);
    NB_CHECK(x->ndim == 4, "nb_conv2d: input must be 4-D (N, C, H, W), got shape %s",
             nb_shape_str(x));
    NB_CHECK(weight->ndim == 4, "nb_conv2d: weight must be 4-D (O, C/groups, KH, KW), got shape %s",
             nb_shape_str(weight));
    NB_CHECK(weight->shape[0] > 0 && weight->shape[1] > 0 && weight->shape[2] > 0 &&
                 weight->shape[3] > 0,
             "nb_conv2d: weight %s has an empty dimension", nb_shape_str(weight));
    NB_CHECK(o.groups >= 0, "nb_conv2d: groups must be positive, got %d", o.groups);
    int64_t groups = o.groups > 0 ? o.groups : 1;
    if (groups == 1) {
        NB_CHECK(x->shape[1] == weight->shape[1],
                 "nb_conv2d: input has %lld channels but weight %s expects %lld",
                 (long long)x->shape[1], nb_shape_str(weight), (long long)weight->shape[1]);
    } else {
        NB_CHECK(x->shape[1] % groups == 0,
                 "nb_conv2d: input %s has %lld channels, not divisible by groups %lld",
                 nb_shape_str(x), (long long)x->shape[1], (long long)groups);
        NB_CHECK(weight->shape[0] % groups == 0,
                 "nb_conv2d: weight %s has %lld output channels, not divisible by groups %lld",
                 nb_shape_str(weight), (long long)weight->shape[0], (long long)groups);
        NB_CHECK(x->shape[1] / groups == weight->shape[1],
                 "nb_conv2d: input %s with groups %lld has %lld channels per group but weight "
                 "%s expects %lld (weight must be (O, C/groups, KH, KW))",
                 nb_shape_str(x), (long long)groups, (long long)(x->shape[1] / groups),
                 nb_shape_str(weight), (long long)weight->shape[1]);
    }
    if (bias) {
        nb__check_ctx(op, ctx, bias);
        nb__check_same_dtype(op, x, bias);
        NB_CHECK(bias->ndim == 1 && bias->shape[0] == weight->shape[0],
                 "nb_conv2d: bias %s does not match weight %s (need (%lld,))", nb_shape_str(bias),
                 nb_shape_str(weight), (long long)weight->shape[0]);
    }
    NB_CHECK(o.stride[0] > 0 && o.stride[1] > 0, "nb_conv2d: stride must be positive, got (%d, %d)",
             o.stride[0], o.stride[1]);
    NB_CHECK(o.dilation[0] > 0 && o.dilation[1] > 0,
             "nb_conv2d: dilation must be positive, got (%d, %d)", o.dilation[0], o.dilation[1]);
    NB_CHECK(o.padding[0] >= 0 && o.padding[1] >= 0,
             "nb_conv2d: padding must be non-negative, got (%d, %d)", o.padding[0], o.padding[1]);

    nb__conv2d_geom *g = nb__ctx_meta(ctx, sizeof *g);
    g->n = x->shape[0];
    g->c = x->shape[1];
    g->h = x->shape[2];
    g->w = x->shape[3];
    g->o = weight->shape[0];
    g->kh = weight->shape[2];
    g->kw = weight->shape[3];
    g->sh = o.stride[0];
    g->sw = o.stride[1];
    g->ph = o.padding[0];
    g->pw = o.padding[1];
    g->dh = o.dilation[0];
    g->dw = o.dilation[1];
    g->groups = groups;
    int64_t eh = g->h + 2 * g->ph - g->dh * (g->kh - 1) - 1; /* numerator of the output size */
    int64_t ew = g->w + 2 * g->pw - g->dw * (g->kw - 1) - 1;
    g->oh = eh < 0 ? 0 : eh / g->sh + 1;
    g->ow = ew < 0 ? 0 : ew / g->sw + 1;
    NB_CHECK(g->oh > 0 && g->ow > 0,
             "nb_conv2d: output size is not positive for input %s and weight %s with stride (%d, "
             "%d), padding (%d, %d), dilation (%d, %d)",
             nb_shape_str(x), nb_shape_str(weight), o.stride[0], o.stride[1], o.padding[0],
             o.padding[1], o.dilation[0], o.dilation[1]);
    int64_t K = g->c / groups * g->kh * g->kw, P = g->oh * g->ow;
    NB_CHECK(K <= INT_MAX && P <= INT_MAX && g->o <= INT_MAX && K * P <= INT64_MAX / 8,
             "nb_conv2d: input %s with weight %s is too large for the BLAS interface",
             nb_shape_str(x), nb_shape_str(weight));

    nb_tensor *xc = nb__contig(ctx, x), *wc = nb__contig(ctx, weight);
    nb_tensor *bc = bias ? nb__contig(ctx, bias) : NULL;
    nb_tensor *out = nb__empty(ctx, x->dtype, 4, (int64_t[]){g->n, g->o, g->oh, g->ow});
    nb__backend_at(x)->conv2d(ctx, x->dtype, g, out->data, xc->data, wc->data,
                              bc ? bc->data : NULL);

    nb_tensor *in[3] = {x, weight, bias};
    nb_node *node = nb__record(ctx, op, conv2d_backward, out, 3, in);
    if (node) {
        node->saved[0] = xc;
        node->saved[1] = wc;
        nb__mem_internal(node, xc);
        nb__mem_internal(node, wc);
        node->extra = g;
    }
    return out;
}
