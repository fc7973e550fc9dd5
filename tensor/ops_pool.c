/* 2-D max and average pooling over x (N, C, H, W) -> (N, C, OH, OW):
 * front ends and backward; kernels behind the backend table
 * (tensor/cpu/pool.c, tensor/cuda/pool.cu).
 *
 * OH = floor((H + 2p - k) / s) + 1 (floor mode). Padding is at most half
 * the kernel, as in PyTorch, so every window holds at least one real
 * element. Max pooling skips padded positions and saves, per output, the
 * index (ih * W + iw) of the first maximum, where backward sends the
 * gradient. Average pooling divides by the kernel area, padded zeros
 * included (count_include_pad=True). */
#include "tensor/backend.h"
#include "tensor/internal.h"

typedef nb__pool2d_geom pool_geom;

/* Checks x and opts, fills the geometry, returns x made contiguous. */
static nb_tensor *pool_setup(nb_ctx *ctx, const char *op, nb_tensor *x, const nb_pool2d_opts *opts,
                             pool_geom *g) {
    NB_CHECK(opts, "%s: opts is NULL (the kernel size is required)", op);
    nb__check_ctx(op, ctx, x);
    nb__check_float(op, x);
    NB_CHECK(x->ndim == 4, "%s: input must be 4-D (N, C, H, W), got shape %s", op, nb_shape_str(x));
    const int *k = opts->kernel, *p = opts->padding;
    int s[2] = {opts->stride[0] ? opts->stride[0] : k[0], opts->stride[1] ? opts->stride[1] : k[1]};
    NB_CHECK(k[0] > 0 && k[1] > 0, "%s: kernel size must be positive, got (%d, %d)", op, k[0],
             k[1]);
    NB_CHECK(s[0] > 0 && s[1] > 0,
             "%s: stride must be positive (or 0 for the kernel size), got (%d, %d)", op,
             opts->stride[0], opts->stride[1]);
    NB_CHECK(p[0] >= 0 && p[1] >= 0 && p[0] <= k[0] / 2 && p[1] <= k[1] / 2,
             "%s: padding (%d, %d) must be non-negative and at most half the kernel (%d, %d)", op,
             p[0], p[1], k[0], k[1]);
    g->planes = x->shape[0] * x->shape[1];
    g->h = x->shape[2];
    g->w = x->shape[3];
    g->kh = k[0];
    g->kw = k[1];
    g->sh = s[0];
    g->sw = s[1];
    g->ph = p[0];
    g->pw = p[1];
    int64_t eh = g->h + 2 * g->ph - g->kh, ew = g->w + 2 * g->pw - g->kw;
    g->oh = eh < 0 ? 0 : eh / g->sh + 1;
    g->ow = ew < 0 ? 0 : ew / g->sw + 1;
    NB_CHECK(g->oh > 0 && g->ow > 0,
             "%s: output size is not positive for input %s with kernel (%d, %d), stride (%d, %d), "
             "padding (%d, %d)",
             op, nb_shape_str(x), k[0], k[1], s[0], s[1], p[0], p[1]);
    return nb__contig(ctx, x);
}

/* node->i[0]: max pooling, whose backward sends g to the saved argmax
 * (node->saved[0]); else average pooling, which spreads it over each
 * window. */
static void pool_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const pool_geom *geom = node->extra;
    nb_tensor *x = node->in[0];
    g = nb__contig(ctx, g);
    nb_tensor *dx = nb__empty(ctx, x->dtype, 4, x->shape);
    const nb__backend *be = nb__backend_at(x);
    if (node->i[0]) be->max_pool2d_backward(dx, node->saved[0], g, geom);
    else be->avg_pool2d_backward(dx, g, geom);
    nb__accum_grad(ctx, x, dx);
}

static nb_tensor *pool(nb_ctx *ctx, const char *op, bool max, nb_tensor *x,
                       const nb_pool2d_opts *opts) {
    pool_geom *g = nb__ctx_meta(ctx, sizeof *g);
    nb_tensor *xc = pool_setup(ctx, op, x, opts, g);
    int64_t shape[4] = {x->shape[0], x->shape[1], g->oh, g->ow};
    nb_tensor *out = nb__empty(ctx, x->dtype, 4, shape);
    nb_tensor *arg = max ? nb__empty(ctx, NB_I64, 4, shape) : NULL;
    if (max) nb__backend_at(x)->max_pool2d(out, arg, xc, g);
    else nb__backend_at(x)->avg_pool2d(out, xc, g);
    nb_node *node = nb__record(ctx, op, pool_backward, out, 1, &x);
    if (node) {
        node->i[0] = max;
        node->extra = g;
        if (max) {
            node->saved[0] = arg;
            nb__mem_internal(node, arg);
        }
    }
    return out;
}

nb_tensor *nb_max_pool2d(nb_ctx *ctx, nb_tensor *x, const nb_pool2d_opts *opts) {
    return pool(ctx, "nb_max_pool2d", true, x, opts);
}

nb_tensor *nb_avg_pool2d(nb_ctx *ctx, nb_tensor *x, const nb_pool2d_opts *opts) {
    return pool(ctx, "nb_avg_pool2d", false, x, opts);
}
