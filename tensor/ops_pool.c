/* 2-D max and average pooling over x (N, C, H, W) -> (N, C, OH, OW), with
 * their CPU kernels (small loops, so they live here).
 *
 * OH = floor((H + 2p - k) / s) + 1 (floor mode). Padding is at most half
 * the kernel, as in PyTorch, so every window holds at least one real
 * element. Max pooling skips padded positions and saves, per output, the
 * index (ih * W + iw) of the first maximum, where backward sends the
 * gradient. Average pooling divides by the kernel area, padded zeros
 * included (count_include_pad=True). */
#include <math.h>
#include <string.h>

#include "tensor/cuda/cuda.h"
#include "tensor/internal.h"

typedef nb__pool2d_geom pool_geom;

#define DEFINE_POOL(T, S)                                                                     \
    static void max_fwd_##S(const pool_geom *g, T *out, int64_t *arg, const T *x) {           \
        for (int64_t pl = 0; pl < g->planes; pl++) {                                          \
            const T *xp = x + pl * g->h * g->w;                                               \
            for (int64_t oh = 0; oh < g->oh; oh++)                                            \
                for (int64_t ow = 0; ow < g->ow; ow++) {                                      \
                    int64_t h0 = oh * g->sh - g->ph, w0 = ow * g->sw - g->pw, best_i = -1;    \
                    T best = 0;                                                               \
                    for (int64_t ih = h0 < 0 ? 0 : h0; ih < h0 + g->kh && ih < g->h; ih++)    \
                        for (int64_t iw = w0 < 0 ? 0 : w0; iw < w0 + g->kw && iw < g->w;      \
                             iw++) {                                                          \
                            T v = xp[ih * g->w + iw];                                         \
                            if (best_i < 0 || v > best || (isnan(v) && !isnan(best))) {       \
                                best = v;                                                     \
                                best_i = ih * g->w + iw;                                      \
                            }                                                                 \
                        }                                                                     \
                    int64_t o = (pl * g->oh + oh) * g->ow + ow;                               \
                    out[o] = best;                                                            \
                    arg[o] = best_i;                                                          \
                }                                                                             \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    static void max_bwd_##S(const pool_geom *g, T *dx, const int64_t *arg, const T *gout) {   \
        memset(dx, 0, sizeof(T) * (size_t)(g->planes * g->h * g->w));                         \
        int64_t per = g->oh * g->ow;                                                          \
        for (int64_t pl = 0; pl < g->planes; pl++)                                            \
            for (int64_t k = 0; k < per; k++)                                                 \
                if (arg[pl * per + k] >= 0) /* -1: a window of padding only */                  \
                    dx[pl * g->h * g->w + arg[pl * per + k]] += gout[pl * per + k];           \
    }                                                                                         \
                                                                                              \
    static void avg_fwd_##S(const pool_geom *g, T *out, const T *x) {                         \
        T inv = (T)1 / (T)(g->kh * g->kw);                                                    \
        for (int64_t pl = 0; pl < g->planes; pl++) {                                          \
            const T *xp = x + pl * g->h * g->w;                                               \
            for (int64_t oh = 0; oh < g->oh; oh++)                                            \
                for (int64_t ow = 0; ow < g->ow; ow++) {                                      \
                    int64_t h0 = oh * g->sh - g->ph, w0 = ow * g->sw - g->pw;                 \
                    T s = 0;                                                                  \
                    for (int64_t ih = h0 < 0 ? 0 : h0; ih < h0 + g->kh && ih < g->h; ih++)    \
                        for (int64_t iw = w0 < 0 ? 0 : w0; iw < w0 + g->kw && iw < g->w;      \
                             iw++)                                                            \
                            s += xp[ih * g->w + iw];                                          \
                    out[(pl * g->oh + oh) * g->ow + ow] = s * inv;                            \
                }                                                                             \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    static void avg_bwd_##S(const pool_geom *g, T *dx, const T *gout) {                       \
        T inv = (T)1 / (T)(g->kh * g->kw);                                                    \
        memset(dx, 0, sizeof(T) * (size_t)(g->planes * g->h * g->w));                         \
        for (int64_t pl = 0; pl < g->planes; pl++) {                                          \
            T *dp = dx + pl * g->h * g->w;                                                    \
            for (int64_t oh = 0; oh < g->oh; oh++)                                            \
                for (int64_t ow = 0; ow < g->ow; ow++) {                                      \
                    int64_t h0 = oh * g->sh - g->ph, w0 = ow * g->sw - g->pw;                 \
                    T v = gout[(pl * g->oh + oh) * g->ow + ow] * inv;                         \
                    for (int64_t ih = h0 < 0 ? 0 : h0; ih < h0 + g->kh && ih < g->h; ih++)    \
                        for (int64_t iw = w0 < 0 ? 0 : w0; iw < w0 + g->kw && iw < g->w;      \
                             iw++)                                                            \
                            dp[ih * g->w + iw] += v;                                          \
                }                                                                             \
        }                                                                                     \
    }

DEFINE_POOL(float, f32)
DEFINE_POOL(double, f64)

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

static void max_pool_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const pool_geom *geom = node->extra;
    nb_tensor *x = node->in[0];
    g = nb__contig(ctx, g);
    nb_tensor *dx = nb__empty(ctx, x->dtype, 4, x->shape);
    const int64_t *arg = node->saved[0]->data;
    if (nb__is_cuda(x)) nb__cuda_max_pool2d_backward(dx, node->saved[0], g, geom);
    else if (x->dtype == NB_F32) max_bwd_f32(geom, dx->data, arg, g->data);
    else max_bwd_f64(geom, dx->data, arg, g->data);
    nb__accum_grad(ctx, x, dx);
}

nb_tensor *nb_max_pool2d(nb_ctx *ctx, nb_tensor *x, const nb_pool2d_opts *opts) {
    pool_geom *g = nb__ctx_meta(ctx, sizeof *g);
    nb_tensor *xc = pool_setup(ctx, "nb_max_pool2d", x, opts, g);
    int64_t shape[4] = {x->shape[0], x->shape[1], g->oh, g->ow};
    nb_tensor *out = nb__empty(ctx, x->dtype, 4, shape);
    nb_tensor *arg = nb__empty(ctx, NB_I64, 4, shape);
    if (nb__is_cuda(x)) nb__cuda_max_pool2d(out, arg, xc, g);
    else if (x->dtype == NB_F32) max_fwd_f32(g, out->data, arg->data, xc->data);
    else max_fwd_f64(g, out->data, arg->data, xc->data);
    nb_node *node = nb__record(ctx, "nb_max_pool2d", max_pool_backward, out, 1, &x);
    if (node) {
        node->saved[0] = arg;
        node->extra = g;
    }
    return out;
}

static void avg_pool_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const pool_geom *geom = node->extra;
    nb_tensor *x = node->in[0];
    g = nb__contig(ctx, g);
    nb_tensor *dx = nb__empty(ctx, x->dtype, 4, x->shape);
    if (nb__is_cuda(x)) nb__cuda_avg_pool2d_backward(dx, g, geom);
    else if (x->dtype == NB_F32) avg_bwd_f32(geom, dx->data, g->data);
    else avg_bwd_f64(geom, dx->data, g->data);
    nb__accum_grad(ctx, x, dx);
}

nb_tensor *nb_avg_pool2d(nb_ctx *ctx, nb_tensor *x, const nb_pool2d_opts *opts) {
    pool_geom *g = nb__ctx_meta(ctx, sizeof *g);
    nb_tensor *xc = pool_setup(ctx, "nb_avg_pool2d", x, opts, g);
    int64_t shape[4] = {x->shape[0], x->shape[1], g->oh, g->ow};
    nb_tensor *out = nb__empty(ctx, x->dtype, 4, shape);
    if (nb__is_cuda(x)) nb__cuda_avg_pool2d(out, xc, g);
    else if (x->dtype == NB_F32) avg_fwd_f32(g, out->data, xc->data);
    else avg_fwd_f64(g, out->data, xc->data);
    nb_node *node = nb__record(ctx, "nb_avg_pool2d", avg_pool_backward, out, 1, &x);
    if (node) node->extra = g;
    return out;
}
