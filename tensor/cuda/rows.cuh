/* Row-wise softmax machinery shared by softmax.cu and softmax_causal.cu
 * (.cu files only): an online (max, sum of exp(x - max)) that one pass over
 * a row fills, its merge, and the all-reduce over the group of threads that
 * owns a row (a warp, or a whole block for long rows), in a fixed order so
 * that results are deterministic. */
#ifndef NABLA_TENSOR_CUDA_ROWS_CUH
#define NABLA_TENSOR_CUDA_ROWS_CUH

#include <math.h>

#include "tensor/cuda/types.cuh"

#define ROW_THREADS 256 /* a block of eight warps, one row each */
#define ROW_BLOCK 512   /* threads per row when a row is longer than 1024 */

static __device__ __forceinline__ float m_exp(float x) { return expf(x); }
static __device__ __forceinline__ double m_exp(double x) { return exp(x); }

/* ------------------------------------------------------------ online max and sum */
/* m = max of the elements seen, s = sum of exp(x - m); (-inf, 0) is empty. */
template <class C> struct ms {
    C m, s;
};

/* A -inf element adds nothing; a NaN makes s NaN, as on the CPU. So does
 * a +inf element: the CPU adds exp(inf - inf) = NaN for it, and x - x is
 * that NaN here (0 for any finite x). */
template <class C> static __device__ __forceinline__ void ms_add(ms<C> &a, C x) {
    if (x > a.m) {
        a.s = a.s * m_exp(a.m - x) + ((C)1 + (x - x));
        a.m = x;
    } else if (x != (C)-INFINITY) {
        a.s += m_exp(x - a.m);
    }
}

static __device__ __forceinline__ float combine(float a, float b) { return a + b; }
static __device__ __forceinline__ double combine(double a, double b) { return a + b; }
template <class C> static __device__ __forceinline__ ms<C> combine(ms<C> a, ms<C> b) {
    if (b.m > a.m) {
        ms<C> t = a;
        a = b;
        b = t;
    }
    if (b.s != (C)0) a.s += b.s * m_exp(b.m - a.m);
    return a;
}

/* Every (kept) element -inf: the CPU computes exp(-inf - (-inf)) = NaN. */
template <class C> static __device__ __forceinline__ ms<C> ms_done(ms<C> a) {
    if (a.m == (C)-INFINITY) a.s = (C)NAN;
    return a;
}

static __device__ __forceinline__ float shfl_down(float v, int o) {
    return __shfl_down_sync(FULL_MASK, v, o);
}
static __device__ __forceinline__ double shfl_down(double v, int o) {
    return __shfl_down_sync(FULL_MASK, v, o);
}
template <class C> static __device__ __forceinline__ ms<C> shfl_down(ms<C> v, int o) {
    return ms<C>{shfl_down(v.m, o), shfl_down(v.s, o)};
}
static __device__ __forceinline__ float shfl_0(float v) { return __shfl_sync(FULL_MASK, v, 0); }
static __device__ __forceinline__ double shfl_0(double v) { return __shfl_sync(FULL_MASK, v, 0); }
template <class C> static __device__ __forceinline__ ms<C> shfl_0(ms<C> v) {
    return ms<C>{shfl_0(v.m), shfl_0(v.s)};
}

/* The merge of v over the blockDim.x threads of the row group (threadIdx.y
 * picks the group), returned to every thread of it. A group wider than a
 * warp is the whole block (blockDim.y = 1) and uses sm (>= 32 entries);
 * every thread of the block must then call it. */
template <class V> static __device__ V group_allreduce(V v, V *sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = combine(v, shfl_down(v, o));
    if (blockDim.x == 32) return shfl_0(v);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) sm[w] = v;
    __syncthreads();
    v = sm[0];
    for (int q = 1; q < nw; q++) v = combine(v, sm[q]);
    __syncthreads();
    return v;
}

/* Launch shape for one group per row of k elements: a warp (eight rows to
 * a block of 256) when k <= 1024, else a block of ROW_BLOCK threads. */
static void row_config(int64_t rows, int64_t k, dim3 *grid, dim3 *block) {
    int64_t per_block = k <= 1024 ? ROW_THREADS / 32 : 1;
    *block = k <= 1024 ? dim3(32, ROW_THREADS / 32) : dim3(ROW_BLOCK, 1);
    int64_t b = (rows + per_block - 1) / per_block;
    *grid = dim3((unsigned)(b > MAX_BLOCKS ? MAX_BLOCKS : b < 1 ? 1 : b));
}

/* Note [Rows in registers]
 * A row of up to 1024 elements is one warp's: 32 lanes x N values, N the
 * power of two that covers it. The loads are unrolled (N in flight per
 * lane) and the later passes (the output, or dx) read the registers
 * instead of global memory again. With the row at hand, softmax takes the
 * plain two passes, max (row_max: exact, so every lane's is the same) then
 * the sum of exp(v - max) (one exp per element, no branch), instead of the
 * loop kernels' online merge (an exp and a branch per element, and one
 * per merge); the special values come out as the CPU's (+inf or NaN in a
 * row: NaN row; a row all -inf: NaN; -inf entries: 0), the last bits of
 * ordinary rows may differ from the loop kernels'.
 * On the H100 the loop kernel ran softmax (98304, 1024) f32 at 49% of
 * our copy bandwidth, reading x twice; the register kernel with the
 * online merge at 74%, and at the same element rate in bf16 (40% of bf16's
 * copy): bound by the per-element merge, which the two passes remove (not
 * yet measured on a GPU). Used by softmax.cu (the last axis)
 * and softmax_causal.cu; rows longer than 1024 keep the loop kernels.
 * reg_rows(k, f) calls f(std::integral_constant<int, N>) with the N that
 * covers k and returns true, or returns false when k > 1024. */
/* v[i] = src[lane + 32 i] (in the math type) for the first n entries of a
 * warp's row, `fill` past them: the loads of Note [Rows in registers]. */
template <class T, class C, int N>
static __device__ __forceinline__ void load_row(C (&v)[N], const T *src, int lane, int n, C fill) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        int j = lane + 32 * i;
        v[i] = j < n ? to_math(src[j]) : fill;
    }
}

/* The largest of the first k of a warp's row v[N] (lane + 32 i), the same
 * in every lane (exact); NaNs are left out (they reach the sum) and a row
 * with nothing else gives -inf. */
template <class C, int N> static __device__ __forceinline__ C row_max(const C (&v)[N], int lane, int k) {
    C m = (C)-INFINITY;
#pragma unroll
    for (int i = 0; i < N; i++)
        if (lane + 32 * i < k && v[i] > m) m = v[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        C u = __shfl_xor_sync(FULL_MASK, m, o);
        m = u > m ? u : m;
    }
    return m;
}

template <int N, class F> static void by_lanes(F f) { f(std::integral_constant<int, N>{}); }
template <class F> static bool reg_rows(int64_t k, F f) {
    if (k <= 32) by_lanes<1>(f);
    else if (k <= 64) by_lanes<2>(f);
    else if (k <= 128) by_lanes<4>(f);
    else if (k <= 256) by_lanes<8>(f);
    else if (k <= 512) by_lanes<16>(f);
    else if (k <= 1024) by_lanes<32>(f);
    else return false;
    return true;
}

#endif
