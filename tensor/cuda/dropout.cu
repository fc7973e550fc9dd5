/* Dropout and the uniform and normal random fills on CUDA: the same
 * functions of (seed, offset, element index) as the CPU (Note [Random
 * streams] in tensor/random.c), so masks and fills are bit-identical to
 * the CPU's for f32 and f64.
 *
 * One thread computes one Philox block: 4 elements for uniform and
 * dropout, 2 for normal (Box-Muller pairs). Those elements are adjacent,
 * so when the pointers allow it (aligned to the group's size) the thread
 * loads and stores them as one vector (16 bytes for f32 uniform and
 * dropout): element by element, a warp's store instruction would touch
 * 32 elements spread over 4x as many bytes, each sector four times.
 * Arithmetic that the CPU does
 * in double is done in double here with the rounding intrinsics
 * (__dmul_rn, __dadd_rn), which nvcc never contracts into an FMA; the CPU
 * build has no FMA contraction either (no -march). Box-Muller uses CUDA's
 * log, sin and cos, whose results can differ from glibc's in the last bit
 * of the double; after rounding to f32 that changes a value with a
 * probability of about 2^-28 per element, and never for the uniform fill
 * or dropout (no transcendental functions there). bf16 and f16 round
 * through f32 as nb__store does (double -> float -> 16 bits, each to
 * nearest even).
 *
 * Letters: n elements. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

/* ------------------------------------------------------------------ helpers */
/* nb_philox4x32 of tensor/random.c. */
static __device__ __forceinline__ uint4 philox4x32(uint64_t seed, uint64_t counter) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; round++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0;
        uint32_t n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
}

static __device__ __forceinline__ uint32_t lane(uint4 r, int k) {
    return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w;
}

/* Fills round a double to T through f32, as nb__store does: store_as. */

/* nb_u32_to_unit */
static __device__ __forceinline__ float u32_to_unit(uint32_t x) {
    return (float)(x >> 8) * (1.0f / 16777216.0f);
}

/* G adjacent elements of T, moved as one vector access. */
template <typename T, int G> struct alignas(G * sizeof(T)) group {
    T v[G];
};

/* True when every non-NULL pointer is aligned for group<T, G>. */
template <typename T, int G> static bool group_aligned(const void *a, const void *b,
                                                        const void *c) {
    uintptr_t bits = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c;
    return (bits & (G * sizeof(T) - 1)) == 0;
}

/* ------------------------------------------------------------------ kernels */
/* One thread per Philox block of 4 elements; vec: whole blocks move as group<T, 4>. */
template <typename T>
static __global__ void dropout_kernel(T *__restrict__ out, T *__restrict__ mask,
                                      const T *__restrict__ x, int64_t n, double p,
                                      math_t<T> scale, uint64_t seed,
                                      uint64_t offset, bool vec) {
    typedef math_t<T> A;
    typedef group<T, 4> G;
    int64_t blocks = (n + 3) / 4;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < blocks;
         c += (int64_t)gridDim.x * blockDim.x) {
        uint4 r = philox4x32(seed, offset + (uint64_t)c);
        if (vec && 4 * c + 4 <= n) {
            G xv = ((const G *)x)[c], ov, mv;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                A m = (double)u32_to_unit(lane(r, k)) >= p ? scale : (A)0;
                ov.v[k] = store_as<T>(to_math(xv.v[k]) * m);
                mv.v[k] = store_as<T>(m);
            }
            ((G *)out)[c] = ov;
            if (mask) ((G *)mask)[c] = mv;
            continue;
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int64_t i = 4 * c + k;
            if (i >= n) break;
            A m = (double)u32_to_unit(lane(r, k)) >= p ? scale : (A)0;
            out[i] = store_as<T>(to_math(x[i]) * m);
            if (mask) mask[i] = store_as<T>(m);
        }
    }
}

template <typename T>
static __global__ void uniform_kernel(T *__restrict__ t, int64_t n, double low, double range,
                                      uint64_t seed, uint64_t offset, bool vec) {
    typedef group<T, 4> G;
    int64_t blocks = (n + 3) / 4;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < blocks;
         c += (int64_t)gridDim.x * blockDim.x) {
        uint4 r = philox4x32(seed, offset + (uint64_t)c);
        G tv;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            double u = (double)u32_to_unit(lane(r, k));
            tv.v[k] = store_as<T>(__dadd_rn(low, __dmul_rn(range, u)));
        }
        if (vec && 4 * c + 4 <= n) {
            ((G *)t)[c] = tv;
            continue;
        }
        for (int k = 0; k < 4 && 4 * c + k < n; k++) t[4 * c + k] = tv.v[k];
    }
}

/* One thread per Philox block of 2 elements (lanes 0 and 1); vec: pairs move as group<T, 2>. */
template <typename T>
static __global__ void normal_kernel(T *__restrict__ t, int64_t n, double mean, double std,
                                     uint64_t seed, uint64_t offset, bool vec) {
    typedef group<T, 2> G;
    int64_t blocks = (n + 1) / 2;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < blocks;
         c += (int64_t)gridDim.x * blockDim.x) {
        uint4 r = philox4x32(seed, offset + (uint64_t)c);
        double u1 = __dmul_rn(__dadd_rn((double)r.x, 1.0), 1.0 / 4294967296.0);
        double u2 = __dmul_rn((double)r.y, 1.0 / 4294967296.0);
        double radius = sqrt(__dmul_rn(-2.0, log(u1)));
        double theta = __dmul_rn(6.283185307179586, u2);
        int64_t i = 2 * c;
        T z0 = store_as<T>(__dadd_rn(mean, __dmul_rn(std, __dmul_rn(radius, cos(theta)))));
        if (vec && i + 2 <= n) {
            G pv;
            pv.v[0] = z0;
            pv.v[1] = store_as<T>(__dadd_rn(mean, __dmul_rn(std, __dmul_rn(radius, sin(theta)))));
            ((G *)t)[c] = pv;
            continue;
        }
        t[i] = z0;
        if (i + 1 < n)
            t[i + 1] =
                store_as<T>(__dadd_rn(mean, __dmul_rn(std, __dmul_rn(radius, sin(theta)))));
    }
}

/* ---------------------------------------------------------------- launchers */
static const int THREADS = 256;

static unsigned grid_for(int64_t work) {
    int64_t b = (work + THREADS - 1) / THREADS;
    return (unsigned)(b < 65536 ? b : 65536);
}

template <typename T>
static void launch_dropout(cudaStream_t s, void *out, void *mask, const void *x, int64_t n,
                           double p, uint64_t seed, uint64_t offset) {
    typedef math_t<T> A;
    A scale = p < 1 ? (A)(1.0 / (1.0 - p)) : (A)0;
    bool vec = group_aligned<T, 4>(out, mask, x);
    dropout_kernel<T><<<grid_for((n + 3) / 4), THREADS, 0, s>>>(
        (T *)out, (T *)mask, (const T *)x, n, p, scale, seed, offset, vec);
}

template <typename T>
static void launch_uniform(cudaStream_t s, void *t, int64_t n, double low, double high,
                           uint64_t seed, uint64_t offset) {
    uniform_kernel<T><<<grid_for((n + 3) / 4), THREADS, 0, s>>>(
        (T *)t, n, low, high - low, seed, offset, group_aligned<T, 4>(t, NULL, NULL));
}

template <typename T>
static void launch_normal(cudaStream_t s, void *t, int64_t n, double mean, double std,
                          uint64_t seed, uint64_t offset) {
    normal_kernel<T><<<grid_for((n + 1) / 2), THREADS, 0, s>>>(
        (T *)t, n, mean, std, seed, offset, group_aligned<T, 2>(t, NULL, NULL));
}

/* ------------------------------------------------------------- entry points */
void nb__cuda_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p,
                      uint64_t seed, uint64_t offset) {
    const char *op = "nb_dropout";
    int dev = x->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    int64_t n = nb_numel(x);
    if (n == 0) return;
    void *m = mask ? mask->data : NULL;
    BY_FLOAT_DTYPE(op, x->dtype, launch_dropout, s, out->data, m, x->data, n, p, seed, offset);
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_rand_uniform(nb_tensor *t, double low, double high, uint64_t seed,
                           uint64_t offset) {
    const char *op = "nb_rand_uniform";
    int dev = t->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    int64_t n = nb_numel(t);
    if (n == 0) return;
    BY_FLOAT_DTYPE(op, t->dtype, launch_uniform, s, t->data, n, low, high, seed, offset);
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_rand_normal(nb_tensor *t, double mean, double std, uint64_t seed,
                          uint64_t offset) {
    const char *op = "nb_rand_normal";
    int dev = t->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    int64_t n = nb_numel(t);
    if (n == 0) return;
    BY_FLOAT_DTYPE(op, t->dtype, launch_normal, s, t->data, n, mean, std, seed, offset);
    NB_CUDA_CHECK_LAUNCH(op);
}
