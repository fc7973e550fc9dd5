/* CPU 2-D convolution: im2col + GEMM (OpenBLAS), image by image and group
 * by group, so the column buffer holds one group's (K, P) columns of one
 * image. Backward: the input gradient is W_g^T @ grad scattered back by
 * col2im (overlapping windows add up); the weight gradient sums grad @
 * cols^T over the images. A 1x1 kernel with unit stride and no padding
 * uses the image as its columns. With one input channel per group
 * (depthwise, and its channel multipliers) each GEMM would be (OG, KH*KW)
 * @ (KH*KW, P) with OG often 1: a direct loop over the kernel taps, each a
 * contiguous run of the output row when the stride is 1, costs the same
 * arithmetic without the column copies or one BLAS call per channel.
 * Letters as in tensor/cpu/conv.h.
 *
 * bf16 (mixed precision): the operands are converted to f32 (exact), the
 * f32 path runs, and its results are rounded to bf16 once: exactly the f32
 * convolution of the bf16-rounded values, the portable fallback where no
 * bf16 kernel takes them (Note [Mixed precision on the CPU] in
 * tensor/context.c). The column buffer is then f32
 * (nb__conv2d_cols_bytes). */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/conv.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/internal.h"

static int is_pointwise(const nb__conv2d_geom *g) {
    return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

static int is_direct(const nb__conv2d_geom *g) { return g->groups > 1 && g->c == g->groups; }

int64_t nb__conv2d_cols_numel(const nb__conv2d_geom *g) {
    if (is_pointwise(g) || is_direct(g)) return 0;
    return g->c / g->groups * g->kh * g->kw * g->oh * g->ow;
}

size_t nb__conv2d_cols_bytes(nb_dtype dt, const nb__conv2d_geom *g) {
    return (size_t)nb__conv2d_cols_numel(g) * nb_dtype_size(dt == NB_BF16 ? NB_F32 : dt);
}

/* Output columns [lo, hi) whose input column ow*sw + off lies in [0, W). */
static void valid_range(const nb__conv2d_geom *g, int64_t off, int64_t *lo, int64_t *hi) {
    int64_t l = off >= 0 ? 0 : (-off + g->sw - 1) / g->sw;
    int64_t h = g->w - off <= 0 ? 0 : (g->w - off + g->sw - 1) / g->sw;
    if (h > g->ow) h = g->ow;
    if (l > h) l = h;
    *lo = l;
    *hi = h;
}

#define DEFINE_CONV(T, S, GEMM)                                                               \
    /* cols (nc*KH*KW, P) from nc channels x (nc, H, W) of one image */                       \
    static void im2col_##S(const nb__conv2d_geom *g, int64_t nc, const T *x, T *cols) {       \
        int64_t P = g->oh * g->ow;                                                            \
        for (int64_t c = 0; c < nc; c++)                                                      \
            for (int64_t ki = 0; ki < g->kh; ki++)                                            \
                for (int64_t kj = 0; kj < g->kw; kj++) {                                      \
                    T *row = cols + ((c * g->kh + ki) * g->kw + kj) * P;                      \
                    const T *xc = x + c * g->h * g->w;                                        \
                    int64_t off = kj * g->dw - g->pw, lo, hi;                                 \
                    valid_range(g, off, &lo, &hi);                                            \
                    for (int64_t oh = 0; oh < g->oh; oh++) {                                  \
                        T *r = row + oh * g->ow;                                              \
                        int64_t ih = oh * g->sh - g->ph + ki * g->dh;                         \
                        if (ih < 0 || ih >= g->h) {                                           \
                            for (int64_t ow = 0; ow < g->ow; ow++) r[ow] = 0;                 \
                            continue;                                                         \
                        }                                                                     \
                        const T *xr = xc + ih * g->w;                                         \
                        for (int64_t ow = 0; ow < lo; ow++) r[ow] = 0;                        \
                        for (int64_t ow = lo; ow < hi; ow++) r[ow] = xr[ow * g->sw + off];    \
                        for (int64_t ow = hi; ow < g->ow; ow++) r[ow] = 0;                    \
                    }                                                                         \
                }                                                                             \
    }                                                                                         \
                                                                                              \
    /* x (nc, H, W) += the columns scattered back to their input positions */                 \
    static void col2im_##S(const nb__conv2d_geom *g, int64_t nc, const T *cols, T *x) {       \
        int64_t P = g->oh * g->ow;                                                            \
        for (int64_t c = 0; c < nc; c++)                                                      \
            for (int64_t ki = 0; ki < g->kh; ki++)                                            \
                for (int64_t kj = 0; kj < g->kw; kj++) {                                      \
                    const T *row = cols + ((c * g->kh + ki) * g->kw + kj) * P;                \
                    T *xc = x + c * g->h * g->w;                                              \
                    int64_t off = kj * g->dw - g->pw, lo, hi;                                 \
                    valid_range(g, off, &lo, &hi);                                            \
                    for (int64_t oh = 0; oh < g->oh; oh++) {                                  \
                        int64_t ih = oh * g->sh - g->ph + ki * g->dh;                         \
                        if (ih < 0 || ih >= g->h) continue;                                   \
                        const T *r = row + oh * g->ow;                                        \
                        T *xr = xc + ih * g->w;                                               \
                        for (int64_t ow = lo; ow < hi; ow++) xr[ow * g->sw + off] += r[ow];   \
                    }                                                                         \
                }                                                                             \
    }                                                                                         \
                                                                                              \
    /* One input channel per group: out plane (OH, OW) += w (KH, KW) * x plane (H, W),    \
     * output row by output row (it stays in cache across the taps); unit stride is      \
     * its own loop so that the compiler vectorises it. */                                \
    static void direct_plane_##S(const nb__conv2d_geom *g, T *restrict out,                   \
                                 const T *restrict x, const T *restrict w) {                  \
        for (int64_t oh = 0; oh < g->oh; oh++) {                                              \
            T *restrict r = out + oh * g->ow;                                                 \
            for (int64_t ki = 0; ki < g->kh; ki++) {                                          \
                int64_t ih = oh * g->sh - g->ph + ki * g->dh;                                 \
                if (ih < 0 || ih >= g->h) continue;                                           \
                for (int64_t kj = 0; kj < g->kw; kj++) {                                      \
                    T wv = w[ki * g->kw + kj];                                                \
                    int64_t off = kj * g->dw - g->pw, lo, hi;                                 \
                    valid_range(g, off, &lo, &hi);                                            \
                    const T *restrict xr = x + ih * g->w;                                     \
                    if (g->sw == 1)                                                           \
                        for (int64_t ow = lo; ow < hi; ow++) r[ow] += wv * xr[ow + off];      \
                    else                                                                      \
                        for (int64_t ow = lo; ow < hi; ow++)                                  \
                            r[ow] += wv * xr[ow * g->sw + off];                               \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    /* dx plane (H, W) += w (KH, KW) scattered by the grad plane (OH, OW); dw (KH, KW)        \
     * += grad plane correlated with the x plane. Either may be NULL. */                      \
    static void direct_plane_backward_##S(const nb__conv2d_geom *g, T *restrict dx,           \
                                          T *restrict dw, const T *restrict gp,               \
                                          const T *restrict x, const T *restrict w) {         \
        for (int64_t oh = 0; oh < g->oh; oh++) {                                              \
            const T *restrict r = gp + oh * g->ow;                                            \
            for (int64_t ki = 0; ki < g->kh; ki++) {                                          \
                int64_t ih = oh * g->sh - g->ph + ki * g->dh;                                 \
                if (ih < 0 || ih >= g->h) continue;                                           \
                for (int64_t kj = 0; kj < g->kw; kj++) {                                      \
                    int64_t off = kj * g->dw - g->pw, lo, hi;                                 \
                    valid_range(g, off, &lo, &hi);                                            \
                    int64_t sw = g->sw;                                                       \
                    if (dx) {                                                                 \
                        T wv = w[ki * g->kw + kj];                                            \
                        T *restrict dr = dx + ih * g->w;                                      \
                        if (sw == 1)                                                          \
                            for (int64_t ow = lo; ow < hi; ow++) dr[ow + off] += wv * r[ow];  \
                        else                                                                  \
                            for (int64_t ow = lo; ow < hi; ow++)                              \
                                dr[ow * sw + off] += wv * r[ow];                              \
                    }                                                                         \
                    if (dw) {                                                                 \
                        const T *restrict xr = x + ih * g->w;                                 \
                        /* eight partial sums: a vectorisable reduction */                    \
                        T a[8] = {0};                                                         \
                        int64_t ow = lo;                                                      \
                        if (sw == 1)                                                          \
                            for (; ow + 8 <= hi; ow += 8)                                     \
                                for (int l = 0; l < 8; l++) a[l] += r[ow + l] * xr[ow + l + off]; \
                        for (; ow < hi; ow++) a[0] += r[ow] * xr[ow * sw + off];              \
                        dw[ki * g->kw + kj] +=                                                \
                            ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    static void forward_##S(const nb__conv2d_geom *g, T *out, const T *x, const T *w,         \
                            const T *b, T *cols) {                                            \
        int64_t G = g->groups, CG = g->c / G, OG = g->o / G, HW = g->h * g->w;                \
        int K = (int)(CG * g->kh * g->kw), P = (int)(g->oh * g->ow);                          \
        for (int64_t n = 0; n < g->n; n++) {                                                  \
            const T *xn = x + n * g->c * HW;                                                  \
            T *on = out + n * g->o * P;                                                       \
            if (b)                                                                            \
                for (int64_t o = 0; o < g->o; o++)                                            \
                    for (int64_t p = 0; p < P; p++) on[o * P + p] = b[o];                     \
            if (is_direct(g)) {                                                               \
                if (!b) memset(on, 0, sizeof(T) * (size_t)(g->o * P));                        \
                for (int64_t o = 0; o < g->o; o++)                                            \
                    direct_plane_##S(g, on + o * P, xn + (o / OG) * HW, w + o * K);           \
                continue;                                                                     \
            }                                                                                 \
            for (int64_t gi = 0; gi < G; gi++) {                                              \
                const T *cn = xn + gi * CG * HW;                                              \
                if (!is_pointwise(g)) {                                                       \
                    im2col_##S(g, CG, cn, cols);                                              \
                    cn = cols;                                                                \
                }                                                                             \
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)OG, P, K, 1,             \
                     w + gi * OG * K, K, cn, P, b ? 1 : 0, on + gi * OG * P, P);              \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    static void backward_##S(const nb__conv2d_geom *g, T *dx, T *dw, T *db, const T *gout,    \
                             const T *x, const T *w, T *cols) {                               \
        int64_t G = g->groups, CG = g->c / G, OG = g->o / G, HW = g->h * g->w;                \
        int K = (int)(CG * g->kh * g->kw), P = (int)(g->oh * g->ow);                          \
        int64_t xsz = g->c * HW;                                                              \
        if (dw) memset(dw, 0, sizeof(T) * (size_t)(g->o * K));                                \
        if (db) memset(db, 0, sizeof(T) * (size_t)g->o);                                      \
        for (int64_t n = 0; n < g->n; n++) {                                                  \
            const T *gn = gout + n * g->o * P, *xn = x + n * xsz;                             \
            T *dxn = dx ? dx + n * xsz : NULL;                                                \
            if (db)                                                                           \
                for (int64_t o = 0; o < g->o; o++) {                                          \
                    T s = 0;                                                                  \
                    for (int64_t p = 0; p < P; p++) s += gn[o * P + p];                       \
                    db[o] += s;                                                               \
                }                                                                             \
            if (dxn && !(is_pointwise(g) && !is_direct(g)))                                   \
                memset(dxn, 0, sizeof(T) * (size_t)xsz);                                      \
            if (is_direct(g)) {                                                               \
                if (dx || dw)                                                                 \
                    for (int64_t o = 0; o < g->o; o++)                                        \
                        direct_plane_backward_##S(g, dxn ? dxn + (o / OG) * HW : NULL,        \
                                                  dw ? dw + o * K : NULL, gn + o * P,         \
                                                  xn + (o / OG) * HW, w + o * K);             \
                continue;                                                                     \
            }                                                                                 \
            for (int64_t gi = 0; gi < G; gi++) {                                              \
                const T *gg = gn + gi * OG * P, *wg = w + gi * OG * K;                        \
                if (dw) {                                                                     \
                    const T *cn = xn + gi * CG * HW;                                          \
                    if (!is_pointwise(g)) {                                                   \
                        im2col_##S(g, CG, cn, cols);                                          \
                        cn = cols;                                                            \
                    }                                                                         \
                    GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)OG, K, P, 1, gg, P,    \
                         cn, P, 1, dw + gi * OG * K, K);                                      \
                }                                                                             \
                if (dx) {                                                                     \
                    T *dxg = dxn + gi * CG * HW;                                              \
                    if (is_pointwise(g)) {                                                    \
                        GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, (int)OG, 1, wg,   \
                             K, gg, P, 0, dxg, P);                                            \
                    } else {                                                                  \
                        GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, (int)OG, 1, wg,   \
                             K, gg, P, 0, cols, P);                                           \
                        col2im_##S(g, CG, cols, dxg);                                         \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_CONV(float, f32, cblas_sgemm)
DEFINE_CONV(double, f64, cblas_dgemm)

/* ---- bf16 through f32 ---- */
static float *f32_buf(int64_t n) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    NB_CHECK(p, "nb_conv2d: out of memory for a bf16 convolution's f32 buffer (%lld bytes)",
             (long long)(n * (int64_t)sizeof(float)));
    return p;
}

static float *bf16_to_f32(const void *src, int64_t n) {
    if (!src) return NULL;
    float *p = f32_buf(n);
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) p[i] = nb_bf16_to_f32(s[i]);
    return p;
}

static void f32_to_bf16(void *dst, float *src, int64_t n) {
    if (!dst) return;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = nb_f32_to_bf16(src[i]);
    free(src);
}

static int64_t x_numel(const nb__conv2d_geom *g) { return g->n * g->c * g->h * g->w; }
static int64_t w_numel(const nb__conv2d_geom *g) { return g->o * (g->c / g->groups) * g->kh * g->kw; }
static int64_t out_numel(const nb__conv2d_geom *g) { return g->n * g->o * g->oh * g->ow; }

static void forward_bf16(const nb__conv2d_geom *g, void *out, const void *x, const void *w,
                         const void *b, float *cols) {
    float *fx = bf16_to_f32(x, x_numel(g)), *fw = bf16_to_f32(w, w_numel(g));
    float *fb = bf16_to_f32(b, g->o), *fo = f32_buf(out_numel(g));
    forward_f32(g, fo, fx, fw, fb, cols);
    f32_to_bf16(out, fo, out_numel(g));
    free(fx);
    free(fw);
    free(fb);
}

static void backward_bf16(const nb__conv2d_geom *g, void *dx, void *dw, void *db,
                          const void *gout, const void *x, const void *w, float *cols) {
    float *fg = bf16_to_f32(gout, out_numel(g));
    float *fx = bf16_to_f32(x, x_numel(g)), *fw = bf16_to_f32(w, w_numel(g));
    float *fdx = dx ? f32_buf(x_numel(g)) : NULL, *fdw = dw ? f32_buf(w_numel(g)) : NULL;
    float *fdb = db ? f32_buf(g->o) : NULL;
    backward_f32(g, fdx, fdw, fdb, fg, fx, fw, cols);
    f32_to_bf16(dx, fdx, x_numel(g));
    f32_to_bf16(dw, fdw, w_numel(g));
    f32_to_bf16(db, fdb, g->o);
    free(fg);
    free(fx);
    free(fw);
}

void nb__cpu_conv2d_forward(nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                            const void *w, const void *b, void *cols) {
    if (nb__dnnl_conv2d_forward(dt, g, out, x, w, b)) return;
    if (dt == NB_BF16) forward_bf16(g, out, x, w, b, cols);
    else if (dt == NB_F32) forward_f32(g, out, x, w, b, cols);
    else forward_f64(g, out, x, w, b, cols);
}

void nb__cpu_conv2d_backward(nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw, void *db,
                             const void *gout, const void *x, const void *w, void *cols) {
    if (nb__dnnl_conv2d_backward(dt, g, dx, dw, db, gout, x, w)) return;
    if (dt == NB_BF16) backward_bf16(g, dx, dw, db, gout, x, w, cols);
    else if (dt == NB_F32) backward_f32(g, dx, dw, db, gout, x, w, cols);
    else backward_f64(g, dx, dw, db, gout, x, w, cols);
}
