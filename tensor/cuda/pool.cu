/* 2-D max and average pooling on CUDA (cuda.h, "pooling"), with the
 * semantics of tensor/ops_pool.c: windows skip padded positions, max keeps
 * the first maximum (NaN counts as the maximum) and its index ih * W + iw,
 * average divides by the kernel area (count_include_pad).
 *
 * Letters: PL planes (N * C), H/W input size, OH/OW output size.
 *
 * Forward: one thread per output. Backward gathers instead of scattering:
 * one thread per input element sums, in increasing output order (the CPU's
 * order), the outputs whose window covers it; no atomics, so the result is
 * deterministic (max pooling's, for f32 and f64, bitwise the CPU's). */
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

typedef nb__pool2d_geom pool_geom;

/* ------------------------------------------------------------- kernels */

#define GRID_STRIDE(i, total)                                                                  \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (total);             \
         i += (int64_t)gridDim.x * blockDim.x)

/* out, arg (PL, OH, OW) from x (PL, H, W) */
template <typename T>
static __global__ void max_fwd_kernel(T *out, int64_t *arg, const T *x, pool_geom g) {
    int64_t total = g.planes * g.oh * g.ow;
    GRID_STRIDE(o, total) {
        int64_t ow = o % g.ow, oh = (o / g.ow) % g.oh, pl = o / (g.ow * g.oh);
        const T *xp = x + pl * g.h * g.w;
        int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw, best_i = -1;
        math_t<T> best = 0;
        for (int64_t ih = h0 < 0 ? 0 : h0; ih < h0 + g.kh && ih < g.h; ih++)
            for (int64_t iw = w0 < 0 ? 0 : w0; iw < w0 + g.kw && iw < g.w; iw++) {
                auto v = to_math(xp[ih * g.w + iw]);
                if (best_i < 0 || v > best || (isnan(v) && !isnan(best))) {
                    best = v;
                    best_i = ih * g.w + iw;
                }
            }
        put(&out[o], best);
        arg[o] = best_i;
    }
}

/* First and last output index (inclusive) along one dim whose window
 * [o s - p, o s - p + k) covers input position i; lo > hi when none. */
static __device__ __forceinline__ void covering(int64_t i, int64_t k, int64_t s, int64_t p,
                                                int64_t n_out, int64_t *lo, int64_t *hi) {
    int64_t a = i + p - k + 1;
    *lo = a <= 0 ? 0 : (a + s - 1) / s;
    int64_t b = (i + p) / s;
    *hi = b < n_out - 1 ? b : n_out - 1;
}

/* dx (PL, H, W) = the sum of gout over the outputs whose arg is this element */
template <typename T>
static __global__ void max_bwd_kernel(T *dx, const int64_t *arg, const T *gout, pool_geom g) {
    int64_t total = g.planes * g.h * g.w;
    GRID_STRIDE(i, total) {
        int64_t iw = i % g.w, ih = (i / g.w) % g.h, pl = i / (g.w * g.h);
        int64_t oh0, oh1, ow0, ow1, self = ih * g.w + iw;
        covering(ih, g.kh, g.sh, g.ph, g.oh, &oh0, &oh1);
        covering(iw, g.kw, g.sw, g.pw, g.ow, &ow0, &ow1);
        math_t<T> s = 0;
        const int64_t *ap = arg + pl * g.oh * g.ow;
        const T *gp = gout + pl * g.oh * g.ow;
        for (int64_t oh = oh0; oh <= oh1; oh++)
            for (int64_t ow = ow0; ow <= ow1; ow++)
                if (ap[oh * g.ow + ow] == self) s += to_math(gp[oh * g.ow + ow]);
        put(&dx[i], s);
    }
}

template <typename T>
static __global__ void avg_fwd_kernel(T *out, const T *x, pool_geom g) {
    int64_t total = g.planes * g.oh * g.ow;
    GRID_STRIDE(o, total) {
        int64_t ow = o % g.ow, oh = (o / g.ow) % g.oh, pl = o / (g.ow * g.oh);
        const T *xp = x + pl * g.h * g.w;
        int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
        typedef math_t<T> A;
        A s = 0, inv = (A)1 / (A)(g.kh * g.kw);
        for (int64_t ih = h0 < 0 ? 0 : h0; ih < h0 + g.kh && ih < g.h; ih++)
            for (int64_t iw = w0 < 0 ? 0 : w0; iw < w0 + g.kw && iw < g.w; iw++)
                s += to_math(xp[ih * g.w + iw]);
        put(&out[o], s * inv);
    }
}

template <typename T>
static __global__ void avg_bwd_kernel(T *dx, const T *gout, pool_geom g) {
    int64_t total = g.planes * g.h * g.w;
    GRID_STRIDE(i, total) {
        int64_t iw = i % g.w, ih = (i / g.w) % g.h, pl = i / (g.w * g.h);
        int64_t oh0, oh1, ow0, ow1;
        covering(ih, g.kh, g.sh, g.ph, g.oh, &oh0, &oh1);
        covering(iw, g.kw, g.sw, g.pw, g.ow, &ow0, &ow1);
        typedef math_t<T> A;
        A s = 0, inv = (A)1 / (A)(g.kh * g.kw);
        const T *gp = gout + pl * g.oh * g.ow;
        for (int64_t oh = oh0; oh <= oh1; oh++)
            for (int64_t ow = ow0; ow <= ow1; ow++) s += to_math(gp[oh * g.ow + ow]) * inv;
        put(&dx[i], s);
    }
}

/* ----------------------------------------------------------- launchers */
static unsigned blocks_for(int64_t total) {
    int64_t b = (total + 255) / 256;
    return (unsigned)(b > 65536 ? 65536 : b);
}

template <typename T>
static void max_fwd_launch(cudaStream_t st, void *out, int64_t *arg, const void *x,
                           const pool_geom *g, int64_t total) {
    max_fwd_kernel<T><<<blocks_for(total), 256, 0, st>>>((T *)out, arg, (const T *)x, *g);
    NB_CUDA_CHECK_LAUNCH("nb_max_pool2d");
}
template <typename T>
static void max_bwd_launch(cudaStream_t st, void *dx, const int64_t *arg, const void *gout,
                           const pool_geom *g, int64_t total) {
    max_bwd_kernel<T><<<blocks_for(total), 256, 0, st>>>((T *)dx, arg, (const T *)gout, *g);
    NB_CUDA_CHECK_LAUNCH("nb_max_pool2d");
}
template <typename T>
static void avg_fwd_launch(cudaStream_t st, void *out, const void *x, const pool_geom *g,
                           int64_t total) {
    avg_fwd_kernel<T><<<blocks_for(total), 256, 0, st>>>((T *)out, (const T *)x, *g);
    NB_CUDA_CHECK_LAUNCH("nb_avg_pool2d");
}
template <typename T>
static void avg_bwd_launch(cudaStream_t st, void *dx, const void *gout, const pool_geom *g,
                           int64_t total) {
    avg_bwd_kernel<T><<<blocks_for(total), 256, 0, st>>>((T *)dx, (const T *)gout, *g);
    NB_CUDA_CHECK_LAUNCH("nb_avg_pool2d");
}

/* --------------------------------------------------------- entry points */
extern "C" void nb__cuda_max_pool2d(nb_tensor *out, nb_tensor *arg, const nb_tensor *x,
                                    const nb__pool2d_geom *g) {
    const char *op = "nb_max_pool2d";
    int dev = out->device.index;
    cudaStream_t st = nb__cuda_enter(op, dev);
    int64_t total = g->planes * g->oh * g->ow;
    if (total == 0) return;
    BY_FLOAT_DTYPE(op, x->dtype, max_fwd_launch, st, out->data, (int64_t *)arg->data, x->data, g,
                   total);
}

extern "C" void nb__cuda_max_pool2d_backward(nb_tensor *dx, const nb_tensor *arg,
                                             const nb_tensor *gout, const nb__pool2d_geom *g) {
    const char *op = "nb_max_pool2d";
    int dev = dx->device.index;
    cudaStream_t st = nb__cuda_enter(op, dev);
    int64_t total = g->planes * g->h * g->w;
    if (total == 0) return;
    BY_FLOAT_DTYPE(op, dx->dtype, max_bwd_launch, st, dx->data, (const int64_t *)arg->data,
                   gout->data, g, total);
}

extern "C" void nb__cuda_avg_pool2d(nb_tensor *out, const nb_tensor *x, const nb__pool2d_geom *g) {
    const char *op = "nb_avg_pool2d";
    int dev = out->device.index;
    cudaStream_t st = nb__cuda_enter(op, dev);
    int64_t total = g->planes * g->oh * g->ow;
    if (total == 0) return;
    BY_FLOAT_DTYPE(op, x->dtype, avg_fwd_launch, st, out->data, x->data, g, total);
}

extern "C" void nb__cuda_avg_pool2d_backward(nb_tensor *dx, const nb_tensor *gout,
                                             const nb__pool2d_geom *g) {
    const char *op = "nb_avg_pool2d";
    int dev = dx->device.index;
    cudaStream_t st = nb__cuda_enter(op, dev);
    int64_t total = g->planes * g->h * g->w;
    if (total == 0) return;
    BY_FLOAT_DTYPE(op, dx->dtype, avg_bwd_launch, st, dx->data, gout->data, g, total);
}
