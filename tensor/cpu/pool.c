/* The CPU backend's 2-D pooling kernels (tensor/backend.h; semantics in
 * tensor/ops_pool.c): x, out, dx, gout contiguous f32 or f64. */
#include <math.h>
#include <string.h>

#include "tensor/cpu/cpu.h"
#include "tensor/cpu/simd.h"

typedef nb__pool2d_geom pool_geom;

/* 2x2 / stride 2 max windows, 8 outputs at a time without branches when
 * the CPU has AVX2 (f32): the same comparisons in the same order as the
 * scalar loop (v > best, or v NaN and best not), so the same values and
 * indices. On random data the scalar loop's compares mispredict about half
 * the time: the pool was ~10% of the CNN's step. Two shapes of input:
 *  - max_row_vec: outputs [0, k) of one output row over input rows r0, r1
 *    (k a multiple of 8, for OW >= 8);
 *  - max_pairs_vec: whole planes of width 8 or 4 (H = 2 OH, W = 2 OW),
 *    whose row pairs follow each other in memory: 2 or 4 pairs give 8
 *    outputs; returns how many pairs (from the first) it did.
 * Both are 0 without AVX2 / FMA and for f64; arg is the offset in the
 * plane. */
#if NB_HAVE_AVX2_FMA_KERNELS
#include <immintrin.h>

/* the even (odd) elements of lo then hi */
NB_AVX2_FMA static inline __m256 even_odd(__m256 lo, __m256 hi, bool odd) {
    __m256 t = odd ? _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1))
                   : _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* The window maxima of 8 windows from their rows' elements (row 0: lo0
 * then hi0, row 1: lo1 then hi1, two per window); q: which of the four
 * (0 top left, 1 top right, 2 bottom left, 3 bottom right). */
NB_AVX2_FMA static inline __m256 select4(__m256 lo0, __m256 hi0, __m256 lo1, __m256 hi1, int32_t *q8) {
    __m256 cand[3] = {even_odd(lo0, hi0, true), even_odd(lo1, hi1, false), even_odd(lo1, hi1, true)};
    __m256 best = even_odd(lo0, hi0, false);
    __m256i q = _mm256_setzero_si256();
    for (int c = 0; c < 3; c++) {
        __m256 v = cand[c];
        __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                                   _mm256_andnot_ps(_mm256_cmp_ps(best, best, _CMP_UNORD_Q),
                                                    _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        best = _mm256_blendv_ps(best, v, take);
        q = _mm256_blendv_epi8(q, _mm256_set1_epi32(c + 1), _mm256_castps_si256(take));
    }
    _mm256_storeu_si256((__m256i *)q8, q);
    return best;
}

NB_AVX2_FMA static int64_t max_row_avx2(const float *r0, const float *r1, int64_t ow_n, float *out,
                                    int64_t *arg, int64_t base, int64_t W) {
    int64_t ow = 0;
    for (; ow + 8 <= ow_n; ow += 8) {
        int32_t q[8];
        __m256 best = select4(_mm256_loadu_ps(r0 + 2 * ow), _mm256_loadu_ps(r0 + 2 * ow + 8),
                              _mm256_loadu_ps(r1 + 2 * ow), _mm256_loadu_ps(r1 + 2 * ow + 8), q);
        _mm256_storeu_ps(out + ow, best);
        for (int l = 0; l < 8; l++) arg[ow + l] = base + 2 * (ow + l) + (q[l] & 1) + (q[l] >> 1) * W;
    }
    return ow;
}

NB_AVX2_FMA static inline __m256 load_halves(const float *lo, const float *hi) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}

NB_AVX2_FMA static int64_t max_pairs_avx2(const float *x, float *out, int64_t *arg, int64_t pairs,
                                      int64_t W, int64_t OH) {
    int64_t per = 16 / W, k = 0, OW = W / 2; /* row pairs per 8 outputs */
    for (; k + per <= pairs; k += per) {
        const float *p = x + k * 2 * W;
        int32_t q[8];
        __m256 best = W == 8 ? select4(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 16),
                                       _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 24), q)
                             : select4(load_halves(p, p + 8), load_halves(p + 16, p + 24),
                                       load_halves(p + 4, p + 12), load_halves(p + 20, p + 28), q);
        _mm256_storeu_ps(out + k * OW, best);
        for (int l = 0; l < 8; l++) {
            int64_t oh = (k + l / OW) % OH, ow = l % OW;
            arg[k * OW + l] = 2 * oh * W + 2 * ow + (q[l] & 1) + (q[l] >> 1) * W;
        }
    }
    return k;
}

static int64_t max_row_vec_f32(const float *r0, const float *r1, int64_t ow_n, float *out,
                               int64_t *arg, int64_t base, int64_t W) {
    return ow_n >= 8 && nb__cpu_avx2_fma() ? max_row_avx2(r0, r1, ow_n, out, arg, base, W) : 0;
}

static int64_t max_pairs_vec_f32(const float *x, float *out, int64_t *arg, int64_t pairs,
                                 int64_t W, int64_t OH) {
    return (W == 8 || W == 4) && nb__cpu_avx2_fma() ? max_pairs_avx2(x, out, arg, pairs, W, OH) : 0;
}
#else
#define max_row_vec_f32(r0, r1, ow_n, out, arg, base, W) ((int64_t)0)
#define max_pairs_vec_f32(x, out, arg, pairs, W, OH) ((int64_t)0)
#endif
/* f64 keeps the scalar loop */
#define max_row_vec_f64(r0, r1, ow_n, out, arg, base, W) ((int64_t)0)
#define max_pairs_vec_f64(x, out, arg, pairs, W, OH) ((int64_t)0)

#define DEFINE_POOL(T, S)                                                                     \
    /* 2x2 windows, stride 2, no padding: the same comparisons in the same      \
     * order as the general loop below, without its bounds (a fifth of the        \
     * time on the bundled CNN's pools) */                                         \
    static void max_fwd_2x2_##S(const pool_geom *g, T *out, int64_t *arg, const T *x) {       \
        int64_t W = g->w, OH = g->oh, OW = g->ow, pairs = g->planes * OH, k0 = 0;             \
        if (g->h == 2 * OH && W == 2 * OW) /* row pairs back to back */                       \
            k0 = max_pairs_vec_##S(x, out, arg, pairs, W, OH);                                \
        for (int64_t k = k0; k < pairs; k++) { /* output row oh of plane pl */                \
            int64_t pl = k / OH, oh = k % OH;                                                 \
            const T *xp = x + pl * g->h * W;                                                  \
            T *op = out + k * OW;                                                             \
            int64_t *ap = arg + k * OW;                                                       \
            for (int64_t ow = max_row_vec_##S(xp + 2 * oh * W, xp + (2 * oh + 1) * W, OW, op, ap, \
                                              2 * oh * W, W);                                 \
                 ow < OW; ow++) {                                                             \
                int64_t c[4] = {2 * oh * W + 2 * ow, 2 * oh * W + 2 * ow + 1,                  \
                                (2 * oh + 1) * W + 2 * ow, (2 * oh + 1) * W + 2 * ow + 1};     \
                T best = xp[c[0]];                                                            \
                int64_t bi = c[0];                                                            \
                for (int q = 1; q < 4; q++) {                                                 \
                    T v = xp[c[q]];                                                           \
                    if (v > best || (isnan(v) && !isnan(best))) {                             \
                        best = v;                                                             \
                        bi = c[q];                                                            \
                    }                                                                         \
                }                                                                             \
                op[ow] = best;                                                                \
                ap[ow] = bi;                                                                  \
            }                                                                                 \
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
