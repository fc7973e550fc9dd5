/* CPU 2-D convolution: im2col + GEMM (OpenBLAS; oneDNN's GEMM in f32 where
 * OpenBLAS runs a generic core, Note [oneDNN dispatch]), group by group and a few
 * images per GEMM (Note [Images per GEMM]), so the column buffer holds one
 * group's (K, P) columns of those images side by side. Backward: the input gradient is W_g^T @ grad scattered back by
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
 * bf16 kernel takes them (Note [Compute dtype] in
 * tensor/context.c). The column buffer is then f32
 * (nb__conv2d_cols_bytes). */
#include <cblas.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/bf16.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/internal.h"

static int is_pointwise(const nb__conv2d_geom *g) {
    return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

static int is_direct(const nb__conv2d_geom *g) { return g->groups > 1 && g->c == g->groups; }

/* Note [Images per GEMM]
 * One GEMM per image is (OG, K) @ (K, P): on the small images of the
 * bundled CNN (P = 64, 16, 4 with K = 9 to 288) a few thousand
 * multiply-adds, where OpenBLAS's fixed cost per call and its packing
 * dominate (8-20 GFLOP/s). So m images go through one GEMM, their columns
 * side by side in a (K, m*P) buffer, the product (OG, m*P) copied out to
 * the (N, O, OH, OW) output; backward gathers one group's gradient into
 * (OG, m*P) the same way for the weight gradient (one GEMM with beta = 1
 * per m images) and the column gradient (then scattered back image by
 * image). m is as many images as keep the columns and the product within
 * COLS_ELEMS elements (L2-sized), at least one: large images keep one GEMM
 * each, which is already large. The sums are ordered by the images and
 * the chunking, both fixed by the shape. */
enum { COLS_ELEMS = 1 << 18 };

static int64_t images_per_gemm(const nb__conv2d_geom *g) {
    int64_t per = (g->c / g->groups * g->kh * g->kw + g->o / g->groups) * g->oh * g->ow;
    int64_t m = per > 0 ? COLS_ELEMS / per : g->n;
    return m < 1 ? 1 : m > g->n ? g->n : m;
}

int64_t nb__conv2d_cols_numel(const nb__conv2d_geom *g) {
    if (is_pointwise(g) || is_direct(g)) return 0;
    return images_per_gemm(g) * (g->c / g->groups * g->kh * g->kw + g->o / g->groups) * g->oh *
           g->ow;
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

/* Small planes (the bundled CNN's 8x8, 4x4, 2x2): rows of a few elements,
 * where the row-by-row copy below, with its valid range per row, is all
 * loop overhead. Such a channel's plane is first copied into the middle of
 * a zero-bordered one, (H + 2 PH) x (W + 2 PW), on the stack: every tap
 * then lands inside it (that is how OH and OW are defined), the padding
 * reads the border's zeros, and a column row is OH plain copies of OW
 * elements (fixed-size copies for the usual widths), with no test. The
 * planes of as many channels as fit in PAD_BUF elements are made before
 * any of their taps is read: a copy that read a plane's row right after
 * it was written, across two of those stores, waited for them (store
 * forwarding fails), which cost more than the test it saved. col2im
 * adds into a zeroed bordered plane the same way and then its middle into
 * x. (A gather through a table of tap offsets with a test for the padding
 * ran at ~2 ns an element, mispredicting at the padding: im2col was ~20%
 * of the CNN's step.) */
enum { PAD_PLANE_MAX = 2048, PAD_BUF = 8192 };

static int64_t padded_w(const nb__conv2d_geom *g) { return g->w + 2 * g->pw; }
static int64_t padded_plane(const nb__conv2d_geom *g) { return (g->h + 2 * g->ph) * padded_w(g); }
static bool use_bordered(const nb__conv2d_geom *g) { return padded_plane(g) <= PAD_PLANE_MAX; }

/* The f32 GEMMs: oneDNN's where Note [oneDNN dispatch] sends them (OpenBLAS
 * on a generic core), else OpenBLAS's. */
static void sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,
                  float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                  int ldc) {
    if (order != CblasRowMajor ||
        !nb__dnnl_conv_gemm(ta == CblasTrans, tb == CblasTrans, m, n, k, alpha, a, lda, b, ldb, beta,
                            c, ldc))
        cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

#define DEFINE_CONV(T, S, GEMM)                                                               \
    /* d[0, n) = s[0, n): the usual small widths as fixed-size copies (a move or two) */      \
    static inline void copy_row_##S(T *restrict d, const T *restrict s, int64_t n) {          \
        switch (n) {                                                                          \
        case 2: memcpy(d, s, 2 * sizeof(T)); return;                                          \
        case 4: memcpy(d, s, 4 * sizeof(T)); return;                                          \
        case 8: memcpy(d, s, 8 * sizeof(T)); return;                                          \
        case 16: memcpy(d, s, 16 * sizeof(T)); return;                                        \
        default: for (int64_t i = 0; i < n; i++) d[i] = s[i];                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    /* cols (nc*KH*KW, P), rows ld apart, from nc channels x (nc, H, W) of one image;        \
     * bordered: use_bordered(g) */                                                           \
    static void im2col_##S(const nb__conv2d_geom *g, int64_t nc, const T *x, T *cols,         \
                           int64_t ld, bool bordered) {                                       \
        if (bordered) { /* channels in groups: all their planes, then their taps */          \
            const int64_t wp = padded_w(g), pp = padded_plane(g), OW = g->ow, OH = g->oh;     \
            const int64_t H = g->h, W = g->w, sh = g->sh, sw = g->sw, dh = g->dh, dw = g->dw; \
            const int64_t KH = g->kh, KW = g->kw, per = PAD_BUF / pp < nc ? PAD_BUF / pp : nc; \
            T pad[PAD_BUF];                                                                   \
            memset(pad, 0, sizeof(T) * (size_t)(per * pp));                                  \
            for (int64_t c0 = 0; c0 < nc; c0 += per) {                                        \
                int64_t cn = nc - c0 < per ? nc - c0 : per;                                   \
                for (int64_t c = 0; c < cn; c++) { /* the borders stay zero */                \
                    T *inner = pad + c * pp + g->ph * wp + g->pw;                             \
                    const T *xc = x + (c0 + c) * H * W;                                       \
                    for (int64_t ih = 0; ih < H; ih++) copy_row_##S(inner + ih * wp, xc + ih * W, W); \
                }                                                                             \
                for (int64_t c = 0; c < cn; c++)                                              \
                    for (int64_t ki = 0; ki < KH; ki++)                                       \
                        for (int64_t kj = 0; kj < KW; kj++) {                                 \
                            T *row = cols + (((c0 + c) * KH + ki) * KW + kj) * ld;            \
                            const T *src = pad + c * pp + ki * dh * wp + kj * dw;             \
                            for (int64_t oh = 0; oh < OH; oh++, src += sh * wp, row += OW) {  \
                                if (sw == 1)                                                  \
                                    copy_row_##S(row, src, OW);                               \
                                else                                                          \
                                    for (int64_t ow = 0; ow < OW; ow++) row[ow] = src[ow * sw]; \
                            }                                                                 \
                        }                                                                     \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
        for (int64_t c = 0; c < nc; c++)                                                      \
            for (int64_t ki = 0; ki < g->kh; ki++)                                            \
                for (int64_t kj = 0; kj < g->kw; kj++) {                                      \
                    T *row = cols + ((c * g->kh + ki) * g->kw + kj) * ld;                     \
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
    static void col2im_##S(const nb__conv2d_geom *g, int64_t nc, const T *cols, int64_t ld,   \
                           bool bordered, T *x) {                                             \
        if (bordered) {                                                                       \
            int64_t wp = padded_w(g), OW = g->ow, sw = g->sw;                                 \
            T pad[PAD_PLANE_MAX];                                                             \
            const T *inner = pad + g->ph * wp + g->pw;                                        \
            for (int64_t c = 0; c < nc; c++) {                                                \
                memset(pad, 0, sizeof(T) * (size_t)padded_plane(g));                          \
                for (int64_t ki = 0; ki < g->kh; ki++) /* taps in order, as the others */     \
                    for (int64_t kj = 0; kj < g->kw; kj++) {                                  \
                        const T *row = cols + ((c * g->kh + ki) * g->kw + kj) * ld;           \
                        for (int64_t oh = 0; oh < g->oh; oh++) {                              \
                            T *dst = pad + (oh * g->sh + ki * g->dh) * wp + kj * g->dw;       \
                            const T *r = row + oh * OW;                                       \
                            for (int64_t ow = 0; ow < OW; ow++) dst[ow * sw] += r[ow];        \
                        }                                                                     \
                    }                                                                         \
                T *xc = x + c * g->h * g->w;                                                  \
                for (int64_t ih = 0; ih < g->h; ih++)                                         \
                    for (int64_t iw = 0; iw < g->w; iw++)                                     \
                        xc[ih * g->w + iw] += inner[ih * wp + iw];                            \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
        for (int64_t c = 0; c < nc; c++)                                                      \
            for (int64_t ki = 0; ki < g->kh; ki++)                                            \
                for (int64_t kj = 0; kj < g->kw; kj++) {                                      \
                    const T *row = cols + ((c * g->kh + ki) * g->kw + kj) * ld;               \
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
    /* Images [n0, n0 + m) of group gi through the columns: cols (K, m*P)     \
     * holds image j's columns at column j*P (row stride L = m*P), so that     \
     * one GEMM covers m images (Note [Images per GEMM]). */                   \
    static void forward_##S(const nb__conv2d_geom *g, T *out, const T *x, const T *w,         \
                            const T *b, T *cols) {                                            \
        int64_t G = g->groups, CG = g->c / G, OG = g->o / G, HW = g->h * g->w;                \
        int K = (int)(CG * g->kh * g->kw), P = (int)(g->oh * g->ow);                          \
        if (!is_pointwise(g) && !is_direct(g)) {                                              \
            int64_t nb = images_per_gemm(g);                                                  \
            T *tmp = cols + (int64_t)K * nb * P; /* (OG, m*P) */                              \
            bool bordered = use_bordered(g);                                                  \
            for (int64_t n0 = 0; n0 < g->n; n0 += nb) {                                       \
                int64_t m = g->n - n0 < nb ? g->n - n0 : nb;                                  \
                int L = (int)(m * P);                                                         \
                for (int64_t gi = 0; gi < G; gi++) {                                          \
                    for (int64_t j = 0; j < m; j++)                                           \
                        im2col_##S(g, CG, x + (n0 + j) * g->c * HW + gi * CG * HW, cols + j * P, L, \
                                   bordered);                                                 \
                    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)OG, L, K, 1,         \
                         w + gi * OG * K, K, cols, L, 0, tmp, L);                             \
                    for (int64_t j = 0; j < m; j++)                                           \
                        for (int64_t o = 0; o < OG; o++) {                                    \
                            T *dst = out + (n0 + j) * g->o * P + (gi * OG + o) * P;           \
                            const T *src = tmp + o * L + j * P;                               \
                            T bo = b ? b[gi * OG + o] : 0;                                    \
                            for (int64_t p = 0; p < P; p++) dst[p] = src[p] + bo;             \
                        }                                                                     \
                }                                                                             \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
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
            for (int64_t gi = 0; gi < G; gi++) /* pointwise: the image is its columns */      \
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)OG, P, K, 1,             \
                     w + gi * OG * K, K, xn + gi * CG * HW, P, b ? 1 : 0, on + gi * OG * P, P); \
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
            if (is_direct(g)) {                                                               \
                if (dxn) memset(dxn, 0, sizeof(T) * (size_t)xsz);                             \
                if (dx || dw)                                                                 \
                    for (int64_t o = 0; o < g->o; o++)                                        \
                        direct_plane_backward_##S(g, dxn ? dxn + (o / OG) * HW : NULL,        \
                                                  dw ? dw + o * K : NULL, gn + o * P,         \
                                                  xn + (o / OG) * HW, w + o * K);             \
            } else if (is_pointwise(g)) {                                                     \
                for (int64_t gi = 0; gi < G; gi++) {                                          \
                    const T *gg = gn + gi * OG * P, *wg = w + gi * OG * K;                    \
                    if (dw)                                                                   \
                        GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)OG, K, P, 1, gg, P, \
                             xn + gi * CG * HW, P, 1, dw + gi * OG * K, K);                   \
                    if (dx)                                                                   \
                        GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, (int)OG, 1, wg,   \
                             K, gg, P, 0, dxn + gi * CG * HW, P);                             \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        if (is_direct(g) || is_pointwise(g) || !(dx || dw)) return;                           \
        int64_t nb = images_per_gemm(g);                                                      \
        T *gt = cols + (int64_t)K * nb * P; /* one group's gout, (OG, m*P) */                 \
        bool bordered = use_bordered(g);                                                      \
        if (dx) memset(dx, 0, sizeof(T) * (size_t)(g->n * xsz));                              \
        for (int64_t n0 = 0; n0 < g->n; n0 += nb) {                                           \
            int64_t m = g->n - n0 < nb ? g->n - n0 : nb;                                      \
            int L = (int)(m * P);                                                             \
            for (int64_t gi = 0; gi < G; gi++) {                                              \
                for (int64_t j = 0; j < m; j++)                                               \
                    for (int64_t o = 0; o < OG; o++)                                          \
                        memcpy(gt + o * L + j * P, gout + (n0 + j) * g->o * P + (gi * OG + o) * P, \
                               sizeof(T) * (size_t)P);                                        \
                if (dw) {                                                                     \
                    for (int64_t j = 0; j < m; j++)                                           \
                        im2col_##S(g, CG, x + (n0 + j) * xsz + gi * CG * HW, cols + j * P, L, bordered); \
                    GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)OG, K, L, 1, gt, L,    \
                         cols, L, 1, dw + gi * OG * K, K);                                    \
                }                                                                             \
                if (dx) {                                                                     \
                    GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, K, L, (int)OG, 1,           \
                         w + gi * OG * K, K, gt, L, 0, cols, L);                              \
                    for (int64_t j = 0; j < m; j++)                                           \
                        col2im_##S(g, CG, cols + j * P, L, bordered, dx + (n0 + j) * xsz + gi * CG * HW); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_CONV(float, f32, sgemm)
DEFINE_CONV(double, f64, cblas_dgemm)

/* ---- bf16 through f32 ---- */
/* zeroed: the compiler cannot see the f32 kernels write every element */
static float *f32_buf(int64_t n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    NB_CHECK(p, "nb_conv2d: out of memory for a bf16 convolution's f32 buffer (%lld bytes)",
             (long long)(n * (int64_t)sizeof(float)));
    return p;
}

static float *bf16_to_f32(const void *src, int64_t n) {
    if (!src) return NULL;
    float *p = f32_buf(n);
    nb__f32_from_bf16_n(p, src, n);
    return p;
}

static void f32_to_bf16(void *dst, float *src, int64_t n) {
    if (!dst) return;
    nb__bf16_from_f32_n(dst, src, n);
    free(src);
}

static int64_t x_numel(const nb__conv2d_geom *g) { return g->n * g->c * g->h * g->w; }
static int64_t w_numel(const nb__conv2d_geom *g) { return g->o * (g->c / g->groups) * g->kh * g->kw; }
static int64_t out_numel(const nb__conv2d_geom *g) { return g->n * g->o * g->oh * g->ow; }

static void forward_bf16(const nb__conv2d_geom *g, void *out, const void *x, const void *w,
                         const void *b, float *cols) {
    float *fx = bf16_to_f32(x, x_numel(g)), *fw = bf16_to_f32(w, w_numel(g));
    float *fb = bf16_to_f32(b, g->o), *fo = f32_buf(out_numel(g));
    if (!nb__dnnl_conv2d_forward(NB_F32, g, fo, fx, fw, fb)) forward_f32(g, fo, fx, fw, fb, cols);
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
    if (!nb__dnnl_conv2d_backward(NB_F32, g, fdx, fdw, fdb, fg, fx, fw))
        backward_f32(g, fdx, fdw, fdb, fg, fx, fw, cols);
    f32_to_bf16(dx, fdx, x_numel(g));
    f32_to_bf16(dw, fdw, w_numel(g));
    f32_to_bf16(db, fdb, g->o);
    free(fg);
    free(fx);
    free(fw);
}

void nb__cpu_conv2d_forward_cols(nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                                 const void *w, const void *b, void *cols) {
    if (nb__dnnl_conv2d_forward(dt, g, out, x, w, b)) return;
    if (dt == NB_BF16) forward_bf16(g, out, x, w, b, cols);
    else if (dt == NB_F32) forward_f32(g, out, x, w, b, cols);
    else forward_f64(g, out, x, w, b, cols);
}

void nb__cpu_conv2d_backward_cols(nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw,
                                  void *db, const void *gout, const void *x, const void *w,
                                  void *cols) {
    if (nb__dnnl_conv2d_backward(dt, g, dx, dw, db, gout, x, w)) return;
    if (dt == NB_BF16) backward_bf16(g, dx, dw, db, gout, x, w, cols);
    else if (dt == NB_F32) backward_f32(g, dx, dw, db, gout, x, w, cols);
    else backward_f64(g, dx, dw, db, gout, x, w, cols);
}
