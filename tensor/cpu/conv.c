/* CPU 2-D convolution: im2col + GEMM (OpenBLAS), image by image, so the
 * column buffer holds one image's (K, P) columns. Backward: the input
 * gradient is W^T @ grad scattered back by col2im (overlapping windows
 * add up); the weight gradient sums grad @ cols^T over the images. A 1x1
 * kernel with unit stride and no padding uses the image as its columns.
 * Letters as in tensor/cpu/conv.h. */
#include <cblas.h>
#include <string.h>

#include "tensor/cpu/conv.h"

static int is_pointwise(const nb__conv2d_geom *g) {
    return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

int64_t nb__conv2d_cols_numel(const nb__conv2d_geom *g) {
    return is_pointwise(g) ? 0 : g->c * g->kh * g->kw * g->oh * g->ow;
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
    /* cols (K, P) from one image x (C, H, W) */                                              \
    static void im2col_##S(const nb__conv2d_geom *g, const T *x, T *cols) {                   \
        int64_t P = g->oh * g->ow;                                                            \
        for (int64_t c = 0; c < g->c; c++)                                                    \
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
    /* x (C, H, W) += the columns scattered back to their input positions */                  \
    static void col2im_##S(const nb__conv2d_geom *g, const T *cols, T *x) {                   \
        int64_t P = g->oh * g->ow;                                                            \
        for (int64_t c = 0; c < g->c; c++)                                                    \
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
    static void forward_##S(const nb__conv2d_geom *g, T *out, const T *x, const T *w,         \
                            const T *b, T *cols) {                                            \
        int K = (int)(g->c * g->kh * g->kw), P = (int)(g->oh * g->ow), O = (int)g->o;         \
        for (int64_t n = 0; n < g->n; n++) {                                                  \
            const T *xn = x + n * g->c * g->h * g->w;                                         \
            T *on = out + n * g->o * P;                                                       \
            const T *cn = xn;                                                                 \
            if (!is_pointwise(g)) {                                                           \
                im2col_##S(g, xn, cols);                                                      \
                cn = cols;                                                                    \
            }                                                                                 \
            if (b)                                                                            \
                for (int64_t o = 0; o < g->o; o++)                                            \
                    for (int64_t p = 0; p < P; p++) on[o * P + p] = b[o];                     \
            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, O, P, K, 1, w, K, cn, P,          \
                 b ? 1 : 0, on, P);                                                           \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    static void backward_##S(const nb__conv2d_geom *g, T *dx, T *dw, T *db, const T *gout,    \
                             const T *x, const T *w, T *cols) {                               \
        int K = (int)(g->c * g->kh * g->kw), P = (int)(g->oh * g->ow), O = (int)g->o;         \
        int64_t xsz = g->c * g->h * g->w;                                                     \
        if (dw) memset(dw, 0, sizeof(T) * (size_t)O * (size_t)K);                             \
        if (db) memset(db, 0, sizeof(T) * (size_t)O);                                         \
        for (int64_t n = 0; n < g->n; n++) {                                                  \
            const T *gn = gout + n * g->o * P;                                                \
            if (db)                                                                           \
                for (int64_t o = 0; o < g->o; o++) {                                          \
                    T s = 0;                                                                  \
                    for (int64_t p = 0; p < P; p++) s += gn[o * P + p];                       \
                    db[o] += s;                                                               \
                }                                                                             \
            if (dw) {                                                                         \
                const T *cn = x + n * xsz;                                                    \
                if (!is_pointwise(g)) {                                                       \
                    im2col_##S(g, cn, cols);                                                  \
                    cn = cols;                                                                \
                }                                                                             \
                GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, O, K, P, 1, gn, P, cn, P, 1,    \
                     dw, K);                                                                  \
            }                                                                                 \
            if (dx) {                                                                         \
                T *dxn = dx + n * xsz;                                                        \
                if (is_pointwise(g)) {                                                        \
                    GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, O, 1, w, K, gn, P, 0, \
                         dxn, P);                                                             \
                } else {                                                                      \
                    GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, O, 1, w, K, gn, P, 0, \
                         cols, P);                                                            \
                    memset(dxn, 0, sizeof(T) * (size_t)xsz);                                  \
                    col2im_##S(g, cols, dxn);                                                 \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_CONV(float, f32, cblas_sgemm)
DEFINE_CONV(double, f64, cblas_dgemm)

void nb__cpu_conv2d_forward(nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                            const void *w, const void *b, void *cols) {
    if (dt == NB_F32) forward_f32(g, out, x, w, b, cols);
    else forward_f64(g, out, x, w, b, cols);
}

void nb__cpu_conv2d_backward(nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw, void *db,
                             const void *gout, const void *x, const void *w, void *cols) {
    if (dt == NB_F32) backward_f32(g, dx, dw, db, gout, x, w, cols);
    else backward_f64(g, dx, dw, db, gout, x, w, cols);
}
