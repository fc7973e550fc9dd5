/* Vector width for the CPU kernels: the clone attribute of the hottest
 * loops, and a vectorisable f32 exp (elementwise GELU, causal softmax).
 *
 * Note [Vector width]
 * The library is built for baseline x86-64 (SSE2), since the machines it
 * runs on differ, so -march=native is not an option. Functions marked
 * NB_CPU_CLONES are compiled three times, for AVX-512F, for AVX2 and for
 * the baseline, and the loader picks one for the CPU at hand (GCC function
 * multiversioning, an ifunc). The build uses -std=c11, so floating-point
 * contraction is off and GCC does not reassociate, so every clone computes
 * the same values; only the width differs. The AVX-512 clone made GELU's
 * pass and its gradient's 1.6x as fast as the AVX2 one on the 2-core
 * AVX-512 Xeon of 2026-12-02 (128k f32 in L2, 0.97 -> 0.60 and 1.18 ->
 * 0.74 ns an element, best of 300, one thread). Other compilers and
 * targets get the baseline function alone. */
#ifndef NABLA_TENSOR_CPU_SIMD_H
#define NABLA_TENSOR_CPU_SIMD_H

#include <stdbool.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define NB_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
/* without the AVX-512F clone, for a loop whose AVX-512 clone measured
 * slower than its AVX2 one (each use says what was measured) */
#define NB_CPU_CLONES_AVX2 __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef NB_CPU_CLONES
#define NB_CPU_CLONES
#define NB_CPU_CLONES_AVX2
#endif

/* Whether this CPU runs the hand-vectorised AVX2 + FMA kernels (functions
 * marked NB_AVX2_FMA, called only when this says yes): the causal products
 * (sgemm.c) and the 2x2 max pool (pool.c). GCC's CPU model is filled in
 * by a constructor before any kernel runs. */
#if defined(__x86_64__) && defined(__GNUC__)
#define NB_HAVE_AVX2_FMA_KERNELS 1
#define NB_AVX2_FMA __attribute__((target("avx2,fma")))
static inline bool nb__cpu_avx2_fma(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
/* and the AVX-512F kernels (marked NB_AVX512F; the causal products' wider
 * tile), called only when nb__cpu_avx512f() says yes */
#define NB_AVX512F __attribute__((target("avx512f,avx2,fma")))
static inline bool nb__cpu_avx512f(void) {
    return nb__cpu_avx2_fma() && __builtin_cpu_supports("avx512f");
}
#else
#define NB_HAVE_AVX2_FMA_KERNELS 0
static inline bool nb__cpu_avx2_fma(void) { return false; }
static inline bool nb__cpu_avx512f(void) { return false; }
#endif

/* exp(x) for f32 without a libm call, so that loops using it vectorise:
 * x = n ln2 + r with n = round(x / ln2) (the 1.5 * 2^23 trick rounds to
 * nearest), ln2 split in two parts for an exact r, exp(r) from the degree-6
 * polynomial of the Cephes expf (relative error ~1e-7 on |r| <= ln2/2), and
 * 2^n built in the exponent bits. Inputs are clamped to where 2^n is a
 * normal float, so the result saturates instead of overflowing; NaN stays
 * NaN. */
static inline float nb__exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    /* a NaN x passes the clamps and makes e NaN, which the result keeps;
     * its n must not reach the integer conversion (undefined for NaN) */
    float nn = n == n ? n : 0.0f;
    union {
        uint32_t i;
        float f;
    } scale = {(uint32_t)((int32_t)nn + 127) << 23};
    return e * scale.f;
}

/* Sums and maxima of a row in NB_LANES independent lanes (element j to
 * lane j mod NB_LANES) vectorise without reassociation, which GCC never
 * does on its own; the lanes are then combined in this fixed order, so
 * the result depends only on the row's length. */
#define NB_LANES 8

static inline double nb__lanes_sum(const double *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#endif
