/* The CPU backend's 2-D pooling kernels (tensor/backend.h; semantics in
 * tensor/ops_pool.c): x, out, dx, gout contiguous f32 or f64. */
#include <math.h>
#include <string.h>

#include "tensor/cpu/cpu.h"

typedef nb__pool2d_geom pool_geom;

#define DEFINE_POOL(T, S)                                                                     \
    /* 2x2 windows, stride 2, no padding: the same comparisons in the same      \
     * order as the general loop below, without its bounds (a fifth of the        \
     * time on the bundled CNN's pools) */                                         \
    static void max_fwd_2x2_##S(const pool_geom *g, T *out, int64_t *arg, const T *x) {       \
        int64_t W = g->w;                                                                     \
        for (int64_t pl = 0; pl < g->planes; pl++) {                                          \
            const T *xp = x + pl * g->h * W;                                                  \
            T *op = out + pl * g->oh * g->ow;                                                 \
            int64_t *ap = arg + pl * g->oh * g->ow;                                           \
            for (int64_t oh = 0; oh < g->oh; oh++)                                            \
                for (int64_t ow = 0; ow < g->ow; ow++) {                                      \
                    int64_t c[4] = {2 * oh * W + 2 * ow, 2 * oh * W + 2 * ow + 1,              \
                                    (2 * oh + 1) * W + 2 * ow, (2 * oh + 1) * W + 2 * ow + 1}; \
                    T best = xp[c[0]];                                                        \
                    int64_t bi = c[0];                                                        \
                    for (int q = 1; q < 4; q++) {                                             \
                        T v = xp[c[q]];                                                       \
                        if (v > best || (isnan(v) && !isnan(best))) {                         \
                            best = v;                                                         \
                            bi = c[q];                                                        \
                        }                                                                     \
                    }                                                                         \
                    op[oh * g->ow + ow] = best;                                               \
                    ap[oh * g->ow + ow] = bi;                                                 \
                }                                                                             \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    static void max_fwd_##S(const pool_geom *g, T *out, int64_t *arg, const T *x) {           \
        if (g->kh == 2 && g->kw == 2 && g->sh == 2 && g->sw == 2 && g->ph == 0 && g->pw == 0 &&  \
            2 * g->oh <= g->h && 2 * g->ow <= g->w) {                                         \
            max_fwd_2x2_##S(g, out, arg, x);                                                  \
            return;                                                                           \
        }                                                                                     \
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

void nb__cpu_max_pool2d(nb_tensor *out, nb_tensor *arg, const nb_tensor *x, const nb__pool2d_geom *g) {
    if (x->dtype == NB_F32) max_fwd_f32(g, out->data, arg->data, x->data);
    else max_fwd_f64(g, out->data, arg->data, x->data);
}

void nb__cpu_max_pool2d_backward(nb_tensor *dx, const nb_tensor *arg, const nb_tensor *gout,
                                 const nb__pool2d_geom *g) {
    if (dx->dtype == NB_F32) max_bwd_f32(g, dx->data, arg->data, gout->data);
    else max_bwd_f64(g, dx->data, arg->data, gout->data);
}

void nb__cpu_avg_pool2d(nb_tensor *out, const nb_tensor *x, const nb__pool2d_geom *g) {
    if (x->dtype == NB_F32) avg_fwd_f32(g, out->data, x->data);
    else avg_fwd_f64(g, out->data, x->data);
}

void nb__cpu_avg_pool2d_backward(nb_tensor *dx, const nb_tensor *gout, const nb__pool2d_geom *g) {
    if (dx->dtype == NB_F32) avg_bwd_f32(g, dx->data, gout->data);
    else avg_bwd_f64(g, dx->data, gout->data);
}
