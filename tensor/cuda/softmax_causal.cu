/* CUDA causal softmax of attention scores x (B, T, S) and its backward:
 * the functions of nb__cpu_softmax_causal(_backward) in
 * tensor/cpu/softmax.c (contracts in tensor/cuda/cuda.h).
 *
 * Row i of each (T, S) matrix keeps l = min(i + 1, S) entries (key j is
 * kept when j <= i, counted from the left whatever T and S are, as on the
 * CPU): y = softmax(scale x[:l]), then zeros; x[j >= l] is never read.
 * One group of threads per row: a warp (eight rows to a block) when
 * S <= 1024, else a block of 512. Each thread keeps an online (max, sum of
 * exp(v - max)) of v = scale x over its kept elements, so one pass finds
 * both (a negative scale needs nothing special: the max is taken after
 * scaling); the group merges them in a fixed order. Backward:
 * dx = scale y (g - sum_{j<l} g y) on the kept entries, 0 elsewhere.
 * 16-bit types compute in f32, f64 in f64. Rows are never empty (j = 0 is
 * always kept), so the sums are never zero unless the row's scaled scores
 * are all -inf, which gives NaN as on the CPU. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

typedef __nv_bfloat16 bf16;
typedef __half f16;

#define FULL_MASK 0xffffffffu
#define THREADS 256
#define ROW_BLOCK 512  /* threads per row when S > 1024 */
#define MAX_BLOCKS 65535

/* ------------------------------------------------------------ element types */
template <class T> struct math_of { typedef T type; };
template <> struct math_of<bf16> { typedef float type; };
template <> struct math_of<f16> { typedef float type; };
template <class T> using math_t = typename math_of<T>::type;

template <class T> struct tag { typedef T type; };

template <class T> static __device__ __forceinline__ T to_math(T v) { return v; }
static __device__ __forceinline__ float to_math(bf16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ float to_math(f16 v) { return __half2float(v); }

template <class T, class M> static __device__ __forceinline__ T store_as(M v) {
    if constexpr (std::is_same_v<T, bf16>) return __float2bfloat16_rn((float)v);
    else if constexpr (std::is_same_v<T, f16>) return __float2half_rn((float)v);
    else return (T)v;
}

template <class Fn> static void by_float_dtype(const char *op, nb_dtype dt, Fn fn) {
    switch (dt) {
    case NB_F32: fn(tag<float>{}); return;
    case NB_F64: fn(tag<double>{}); return;
    case NB_BF16: fn(tag<bf16>{}); return;
    case NB_F16: fn(tag<f16>{}); return;
    default: break;
    }
    NB_ABORT("%s: dtype %s has no CUDA kernel", op, nb_dtype_name(dt));
}

static __device__ __forceinline__ float m_exp(float x) { return expf(x); }
static __device__ __forceinline__ double m_exp(double x) { return exp(x); }

/* ------------------------------------------------------------ online max and sum */
/* m = max of the elements seen, s = sum of exp(x - m); (-inf, 0) is empty. */
template <class C> struct ms {
    C m, s;
};

/* A -inf element adds nothing; a NaN makes s NaN, as on the CPU. */
template <class C> static __device__ __forceinline__ void ms_add(ms<C> &a, C x) {
    if (x > a.m) {
        a.s = a.s * m_exp(a.m - x) + (C)1;
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

/* Every kept element -inf: the CPU computes exp(-inf - (-inf)) = NaN. */
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

/* Launch shape for one group per row of s elements. */
static void row_config(int64_t rows, int64_t s, dim3 *grid, dim3 *block) {
    int64_t per_block = s <= 1024 ? THREADS / 32 : 1;
    *block = s <= 1024 ? dim3(32, THREADS / 32) : dim3(ROW_BLOCK, 1);
    int64_t b = (rows + per_block - 1) / per_block;
    *grid = dim3((unsigned)(b > MAX_BLOCKS ? MAX_BLOCKS : b < 1 ? 1 : b));
}

/* Kept entries of row `row` of the (B T) rows: j < min(i + 1, S), i = row mod T. */
static __device__ __forceinline__ int64_t kept(int64_t row, int64_t t, int64_t s) {
    int64_t i = row % t;
    return i + 1 < s ? i + 1 : s;
}

/* ------------------------------------------------------------ forward */
// x, y: (B T) rows of S
template <class T>
static __global__ void causal_kernel(T *y, const T *x, int64_t rows, int64_t t, int64_t s,
                                     double scale) {
    typedef math_t<T> C;
    __shared__ ms<C> sm[32];
    const C sc = (C)scale;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *xr = x + row * s;
        T *yr = y + row * s;
        int64_t l = kept(row, t, s);
        ms<C> st{(C)-INFINITY, (C)0};
        for (int64_t j = threadIdx.x; j < l; j += blockDim.x) ms_add(st, sc * to_math(xr[j]));
        st = ms_done(group_allreduce(st, sm));
        C inv = (C)1 / st.s;
        for (int64_t j = threadIdx.x; j < s; j += blockDim.x)
            yr[j] = store_as<T>(j < l ? m_exp(sc * to_math(xr[j]) - st.m) * inv : (C)0);
    }
}

void nb__cuda_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s,
                             double scale) {
    const char *op = "nb_softmax_causal";
    nb__cuda_use(op, y->device.index);
    cudaStream_t st = (cudaStream_t)nb__cuda_compute_stream(y->device.index);
    if (b == 0 || t == 0 || s == 0) return;
    NB_CHECK(x->dtype == y->dtype, "%s: dtypes differ: y %s, x %s", op, nb_dtype_name(y->dtype),
             nb_dtype_name(x->dtype));
    by_float_dtype(op, x->dtype, [&](auto tg) {
        typedef typename decltype(tg)::type T;
        dim3 grid, block;
        row_config(b * t, s, &grid, &block);
        causal_kernel<T><<<grid, block, 0, st>>>((T *)y->data, (const T *)x->data, b * t, t, s,
                                                 scale);
        NB_CUDA_CHECK_LAUNCH(op);
    });
}

/* ------------------------------------------------------------ backward */
// y, g, dx: (B T) rows of S
template <class T>
static __global__ void causal_backward_kernel(T *dx, const T *y, const T *g, int64_t rows,
                                              int64_t t, int64_t s, double scale) {
    typedef math_t<T> C;
    __shared__ C sm[32];
    const C sc = (C)scale;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *yr = y + row * s, *gr = g + row * s;
        T *dr = dx + row * s;
        int64_t l = kept(row, t, s);
        C r = 0;
        for (int64_t j = threadIdx.x; j < l; j += blockDim.x) r += to_math(gr[j]) * to_math(yr[j]);
        r = group_allreduce(r, sm);
        for (int64_t j = threadIdx.x; j < s; j += blockDim.x)
            dr[j] = store_as<T>(j < l ? sc * to_math(yr[j]) * (to_math(gr[j]) - r) : (C)0);
    }
}

void nb__cuda_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                      int64_t b, int64_t t, int64_t s, double scale) {
    const char *op = "nb_softmax_causal backward";
    nb__cuda_use(op, dx->device.index);
    cudaStream_t st = (cudaStream_t)nb__cuda_compute_stream(dx->device.index);
    if (b == 0 || t == 0 || s == 0) return;
    NB_CHECK(g->dtype == y->dtype && dx->dtype == y->dtype, "%s: dtypes differ: dx %s, y %s, g %s",
             op, nb_dtype_name(dx->dtype), nb_dtype_name(y->dtype), nb_dtype_name(g->dtype));
    by_float_dtype(op, y->dtype, [&](auto tg) {
        typedef typename decltype(tg)::type T;
        dim3 grid, block;
        row_config(b * t, s, &grid, &block);
        causal_backward_kernel<T><<<grid, block, 0, st>>>(
            (T *)dx->data, (const T *)y->data, (const T *)g->data, b * t, t, s, scale);
        NB_CUDA_CHECK_LAUNCH(op);
    });
}
