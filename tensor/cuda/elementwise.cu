/* CUDA elementwise engine: unary, binary, where, copy/cast (fills
 * included) and axpy over any strides with broadcasting, computing the
 * functions of tensor/cpu/elementwise.c: unary and binary ops through the
 * tables and formulas of tensor/op_table.h (Note [Op tables]).
 *
 * The host collapses dims as the CPU iterator does (size-1 dims dropped,
 * dims contiguous for every operand merged; shape and element strides then
 * travel by value in the launch). When one dim remains and every operand's
 * stride is 0 or 1 (contiguous, or a broadcast scalar), a flat kernel runs;
 * otherwise a strided kernel unravels each linear index over the collapsed
 * shape, in 32-bit arithmetic when the element count allows.
 *
 * Note [Vectorised contiguous path]
 * Unary, binary and axpy over operands that are all contiguous (stride 1,
 * no broadcast) and whose pointers are 16-byte aligned load and store 16
 * bytes per thread (4 f32, 8 bf16/f16, 2 f64) instead of one element: a
 * warp's scalar 2-byte loads fill only 64 bytes per instruction, and
 * fewer, wider requests keep more bytes in flight per thread. The last
 * n mod W elements go through the scalar functor. Views at an offset (a
 * row slice of a matrix) are element-aligned only and take the flat path.
 *
 * 16-bit types compute in f32, f64 in f64. Casts go through f32 between
 * f32, bf16 and f16 and through f64 otherwise: that is what nb__load and
 * nb__store do on the CPU (f32 -> f64 -> f32 is exact), so the results are
 * the CPU's, i64 -> i32 included (a plain truncating cast on both). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "tensor/cuda/types.cuh"

#define THREADS 256

template <class T>
constexpr bool is_f32_like = std::is_same_v<T, float> || std::is_same_v<T, bf16> ||
                             std::is_same_v<T, f16>;

template <class D, class S> static __device__ __forceinline__ D convert(S v) {
    if constexpr (std::is_same_v<D, S>) return v;
    else if constexpr (std::is_same_v<S, int64_t> && std::is_same_v<D, int32_t>) return (int32_t)v;
    else if constexpr (is_f32_like<D> && is_f32_like<S>) return store_as<D>(to_math(v));
    else return store_as<D>((double)to_math(v));
}

/* Calls fn(tag<T>{}) for the storage type T of dt (integers when INTS). */
template <bool INTS, class Fn> static void by_dtype(const char *op, nb_dtype dt, Fn fn) {
    if constexpr (INTS) {
        if (dt == NB_I32) { fn(tag<int32_t>{}); return; }
        if (dt == NB_I64) { fn(tag<int64_t>{}); return; }
    }
    by_float_dtype(op, dt, fn);
}

/* ------------------------------------------------------------ geometry */
/* Collapsed iteration shape and element strides of N operands (0: out). */
template <int N> struct geom {
    int nd;
    int64_t size[NB_MAX_DIMS];
    int64_t st[N][NB_MAX_DIMS];
};

/* Strides of t seen with `ndim` dims (right-aligned; size-1 dims and
 * missing leading dims broadcast with stride 0). */
static void bcast_strides(const nb_tensor *t, int ndim, int64_t *st) {
    int shift = t->ndim - ndim;
    for (int d = 0; d < ndim; d++) {
        int td = d + shift;
        st[d] = (td < 0 || t->shape[td] == 1) ? 0 : t->strides[td];
    }
}

/* Fills g from out and its inputs as the CPU iterator does; returns the
 * element count. */
template <int N>
static int64_t make_geom(geom<N> *g, const nb_tensor *out, const nb_tensor *const *in) {
    int64_t st[N][NB_MAX_DIMS];
    int64_t n = 1;
    for (int d = 0; d < out->ndim; d++) {
        st[0][d] = out->strides[d];
        n *= out->shape[d];
    }
    for (int k = 1; k < N; k++) bcast_strides(in[k - 1], out->ndim, st[k]);
    int nd = 0;
    for (int d = 0; d < out->ndim; d++) {
        if (out->shape[d] == 1) continue;
        g->size[nd] = out->shape[d];
        for (int k = 0; k < N; k++) g->st[k][nd] = st[k][d];
        nd++;
    }
    if (nd == 0) {
        g->nd = 1;
        g->size[0] = 1;
        for (int k = 0; k < N; k++) g->st[k][0] = 0;
        return n;
    }
    int m = 0;
    for (int d = 1; d < nd; d++) {
        bool ok = true;
        for (int k = 0; k < N; k++)
            if (g->st[k][m] != g->st[k][d] * g->size[d]) ok = false;
        if (ok) {
            g->size[m] *= g->size[d];
        } else {
            m++;
            g->size[m] = g->size[d];
        }
        for (int k = 0; k < N; k++) g->st[k][m] = g->st[k][d];
    }
    g->nd = m + 1;
    return n;
}

template <int N> struct flat_st {
    bool unit[N]; /* stride 1 (true) or 0 */
};

template <int N> static bool is_flat(const geom<N> *g, flat_st<N> *fs) {
    if (g->nd != 1) return false;
    for (int k = 0; k < N; k++) {
        if (g->st[k][0] != 0 && g->st[k][0] != 1) return false;
        fs->unit[k] = g->st[k][0] == 1;
    }
    return fs->unit[0] || g->size[0] == 1;
}

/* ------------------------------------------------------------ kernels */
/* F: __device__ void operator()(const int64_t *off) const, off[k] the
 * element offset of operand k. */
template <int N, class F>
static __global__ void flat_kernel(F f, int64_t n, flat_st<N> fs) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t off[N];
#pragma unroll
        for (int k = 0; k < N; k++) off[k] = fs.unit[k] ? i : 0;
        f(off);
    }
}

/* I: uint32_t when n <= INT32_MAX (then i + the grid's size never wraps), else int64_t. */
template <int N, class I, class F>
static __global__ void strided_kernel(F f, I n, geom<N> g) {
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        int64_t off[N];
#pragma unroll
        for (int k = 0; k < N; k++) off[k] = 0;
        I r = i;
        for (int d = g.nd - 1; d > 0; d--) {
            I sz = (I)g.size[d];
            I q = r / sz;
            int64_t idx = (int64_t)(r - q * sz);
            r = q;
#pragma unroll
            for (int k = 0; k < N; k++) off[k] += idx * g.st[k][d];
        }
#pragma unroll
        for (int k = 0; k < N; k++) off[k] += (int64_t)r * g.st[k][0];
        f(off);
    }
}

/* 16 bytes of T: the unit of the vectorised path. */
template <class T> struct alignas(16) pack {
    static constexpr int W = 16 / sizeof(T);
    T v[W];
};

/* Note [Vectorised contiguous path]. F: also __device__ void vec(int64_t
 * i) const, which does elements [i W, (i + 1) W); every operand unit-stride. */
template <int N, class F> static __global__ void vec_kernel(F f, int64_t n) {
    const int64_t w = F::W, nv = n / w;
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    for (int64_t i = t; i < nv; i += (int64_t)gridDim.x * blockDim.x) f.vec(i);
    if (t < n - nv * w) {
        int64_t off[N];
#pragma unroll
        for (int k = 0; k < N; k++) off[k] = nv * w + t;
        f(off);
    }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* True when the operands (pointers p[0..N)) qualify for vec_kernel. */
template <int N> static bool can_vec(const geom<N> &g, const void *const *p) {
    flat_st<N> fs;
    if (!is_flat(&g, &fs)) return false;
    for (int k = 0; k < N; k++)
        if (!fs.unit[k] || !aligned16(p[k])) return false;
    return true;
}

/* Launches vec_kernel when can_vec, else the engine's kernels. */
template <int N, class F>
static void launch_vec(const char *op, cudaStream_t s, F f, int64_t n, const geom<N> &g,
                       const void *const *p);

template <int N, class F>
static void launch(const char *op, cudaStream_t s, F f, int64_t n, const geom<N> &g) {
    if (n == 0) return;
    int blocks = (int)((n + THREADS - 1) / THREADS < MAX_BLOCKS ? (n + THREADS - 1) / THREADS
                                                                 : MAX_BLOCKS);
    flat_st<N> fs;
    if (is_flat(&g, &fs))
        flat_kernel<N><<<blocks, THREADS, 0, s>>>(f, n, fs);
    else if (n <= INT32_MAX)
        strided_kernel<N, uint32_t><<<blocks, THREADS, 0, s>>>(f, (uint32_t)n, g);
    else
        strided_kernel<N, int64_t><<<blocks, THREADS, 0, s>>>(f, n, g);
    NB_CUDA_CHECK_LAUNCH(op);
}

template <int N, class F>
static void launch_vec(const char *op, cudaStream_t s, F f, int64_t n, const geom<N> &g,
                       const void *const *p) {
    if (n == 0) return;
    if (!can_vec<N>(g, p)) {
        launch<N>(op, s, f, n, g);
        return;
    }
    int64_t units = n / F::W > 0 ? n / F::W : 1; /* >= the n mod W tail's threads */
    int64_t b = (units + THREADS - 1) / THREADS;
    vec_kernel<N><<<(unsigned)(b < MAX_BLOCKS ? b : MAX_BLOCKS), THREADS, 0, s>>>(f, n);
    NB_CUDA_CHECK_LAUNCH(op);
}

/* ------------------------------------------------------------ unary */
/* One case per table row, calling the formula of tensor/op_table.h for the
 * compute type (Note [Op tables]); FORMULA(f) names it. */
#define UNARY_CASE(E, f, name) case NB_U_##E: return FORMULA(f)(x, s);
#define UNARY_MATH(T)                                                                         \
    static __device__ __forceinline__ T unary_math(int op, T x, T s) {                        \
        switch (op) { NB_UNARY_OPS(UNARY_CASE) default: return x; }                           \
    }
#define FORMULA(f) nb__f_##f##_f32
UNARY_MATH(float)
#undef FORMULA
#define FORMULA(f) nb__f_##f##_f64
UNARY_MATH(double)
#undef FORMULA

template <class T> struct unary_f {
    static constexpr int W = pack<T>::W;
    T *o;
    const T *a;
    int op;
    math_t<T> s;
    __device__ void operator()(const int64_t *off) const {
        o[off[0]] = store_as<T>(unary_math(op, to_math(a[off[1]]), s));
    }
    __device__ void vec(int64_t i) const {
        pack<T> x = ((const pack<T> *)a)[i], r;
#pragma unroll
        for (int k = 0; k < W; k++) r.v[k] = store_as<T>(unary_math(op, to_math(x.v[k]), s));
        ((pack<T> *)o)[i] = r;
    }
};

void nb__cuda_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s) {
    const char *name = nb__unary_name(op);
    cudaStream_t st = nb__cuda_enter(name, out->device.index);
    geom<2> g;
    int64_t n = make_geom<2>(&g, out, &a);
    if (n == 0) return;
    NB_CHECK(a->dtype == out->dtype, "%s: dtypes differ: out %s, input %s", name,
             nb_dtype_name(out->dtype), nb_dtype_name(a->dtype));
    by_dtype<false>(name, out->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        unary_f<T> f{(T *)out->data, (const T *)a->data, (int)op, (math_t<T>)s};
        const void *p[2] = {out->data, a->data};
        launch_vec<2>(name, st, f, n, g, p);
    });
}

/* ------------------------------------------------------------ binary */
/* As unary_math. */
#define BINARY_CASE(E, f, name) case NB_B_##E: return FORMULA(f)(x, y);
#define BINARY_MATH(T)                                                                        \
    static __device__ __forceinline__ T binary_math(int op, T x, T y) {                       \
        switch (op) { NB_BINARY_OPS(BINARY_CASE) default: return x; }                         \
    }
#define FORMULA(f) nb__f_##f##_f32
BINARY_MATH(float)
#undef FORMULA
#define FORMULA(f) nb__f_##f##_f64
BINARY_MATH(double)
#undef FORMULA
#define FORMULA(f) nb__f_##f##_i32
BINARY_MATH(int32_t)
#undef FORMULA
#define FORMULA(f) nb__f_##f##_i64
BINARY_MATH(int64_t)
#undef FORMULA

template <class T> struct binary_f {
    static constexpr int W = pack<T>::W;
    T *o;
    const T *a, *b;
    int op;
    __device__ void operator()(const int64_t *off) const {
        o[off[0]] = store_as<T>(binary_math(op, to_math(a[off[1]]), to_math(b[off[2]])));
    }
    __device__ void vec(int64_t i) const {
        pack<T> x = ((const pack<T> *)a)[i], y = ((const pack<T> *)b)[i], r;
#pragma unroll
        for (int k = 0; k < W; k++) r.v[k] = store_as<T>(binary_math(op, to_math(x.v[k]), to_math(y.v[k])));
        ((pack<T> *)o)[i] = r;
    }
};

void nb__cuda_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b) {
    const char *name = nb__binary_name(op);
    cudaStream_t st = nb__cuda_enter(name, out->device.index);
    const nb_tensor *in[2] = {a, b};
    geom<3> g;
    int64_t n = make_geom<3>(&g, out, in);
    if (n == 0) return;
    NB_CHECK(a->dtype == out->dtype && b->dtype == out->dtype,
             "%s: dtypes differ: out %s, inputs %s and %s", name, nb_dtype_name(out->dtype),
             nb_dtype_name(a->dtype), nb_dtype_name(b->dtype));
    by_dtype<true>(name, out->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        binary_f<T> f{(T *)out->data, (const T *)a->data, (const T *)b->data, (int)op};
        const void *p[3] = {out->data, a->data, b->data};
        launch_vec<3>(name, st, f, n, g, p);
    });
}

/* ------------------------------------------------------------ where */
/* cond != 0 for any dtype (bf16/f16: -0 is zero, NaN is not). */
static __device__ __forceinline__ bool nonzero(const void *p, int64_t i, int dt) {
    switch (dt) {
    case NB_F32: return ((const float *)p)[i] != 0;
    case NB_F64: return ((const double *)p)[i] != 0;
    case NB_BF16:
    case NB_F16: return (((const uint16_t *)p)[i] & 0x7fffu) != 0;
    case NB_I32: return ((const int32_t *)p)[i] != 0;
    default: return ((const int64_t *)p)[i] != 0;
    }
}

template <class U> struct where_f {
    U *o;
    const void *c;
    const U *a, *b;
    int cdt;
    __device__ void operator()(const int64_t *off) const {
        o[off[0]] = nonzero(c, off[1], cdt) ? a[off[2]] : b[off[3]];
    }
};

void nb__cuda_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a,
                    const nb_tensor *b) {
    const char *name = "nb_where";
    cudaStream_t st = nb__cuda_enter(name, out->device.index);
    const nb_tensor *in[3] = {cond, a, b};
    geom<4> g;
    int64_t n = make_geom<4>(&g, out, in);
    if (n == 0) return;
    NB_CHECK(a->dtype == out->dtype && b->dtype == out->dtype,
             "%s: dtypes differ: out %s, inputs %s and %s", name, nb_dtype_name(out->dtype),
             nb_dtype_name(a->dtype), nb_dtype_name(b->dtype));
    by_dtype_bits(out->dtype, [&](auto t) {
        typedef typename decltype(t)::type U;
        where_f<U> f{(U *)out->data, cond->data, (const U *)a->data, (const U *)b->data,
                     (int)cond->dtype};
        launch<4>(name, st, f, n, g);
    });
}

/* ------------------------------------------------------------ copy and fill */
template <class D, class S> struct copy_f {
    D *o;
    const S *a;
    __device__ void operator()(const int64_t *off) const { o[off[0]] = convert<D>(a[off[1]]); }
};

template <class U> struct fill_f {
    U *o;
    U v;
    __device__ void operator()(const int64_t *off) const { o[off[0]] = v; }
};

/* *dst (8 bytes, dd) = the value at src (sd), converted as nb__cpu_copy does. */
static void host_convert(uint64_t *dst, nb_dtype dd, const void *src, nb_dtype sd) {
    *dst = 0;
    if (dd == sd) {
        memcpy(dst, src, nb_dtype_size(dd));
        return;
    }
    if (sd == NB_I64 && dd == NB_I32) { /* not through a double, which would round */
        int64_t v;
        memcpy(&v, src, 8);
        int32_t r = (int32_t)v;
        memcpy(dst, &r, 4);
        return;
    }
    nb__store(dst, dd, nb__load(src, sd));
}

/* dst = one host value: src is a CPU tensor of one element. */
static void fill_from_host(const char *name, cudaStream_t st, nb_tensor *dst,
                           const nb_tensor *src) {
    NB_CHECK(nb_numel(src) == 1,
             "%s: a CPU source for a CUDA destination must hold one value, got shape %s", name,
             nb_shape_str(src));
    uint64_t bits;
    host_convert(&bits, dst->dtype, src->data, src->dtype);
    geom<1> g;
    int64_t n = make_geom<1>(&g, dst, nullptr);
    by_dtype_bits(dst->dtype, [&](auto t) {
        typedef typename decltype(t)::type U;
        U v;
        memcpy(&v, &bits, sizeof v);
        launch<1>(name, st, fill_f<U>{(U *)dst->data, v}, n, g);
    });
}

void nb__cuda_copy(nb_tensor *dst, const nb_tensor *src) {
    const char *name = "nb_copy_";
    cudaStream_t st = nb__cuda_enter(name, dst->device.index);
    if (nb_numel(dst) == 0) return;
    if (src->device.type == NB_DEVICE_CPU) {
        fill_from_host(name, st, dst, src);
        return;
    }
    geom<2> g;
    int64_t n = make_geom<2>(&g, dst, &src);
    if (dst->dtype == src->dtype && g.nd == 1 && g.st[0][0] == 1 && g.st[1][0] == 1) {
        NB_CUDA_CHECK(name, cudaMemcpyAsync(dst->data, src->data,
                                            (size_t)n * nb_dtype_size(dst->dtype),
                                            cudaMemcpyDeviceToDevice, st));
        return;
    }
    by_dtype<true>(name, dst->dtype, [&](auto td) {
        typedef typename decltype(td)::type D;
        by_dtype<true>(name, src->dtype, [&](auto ts) {
            typedef typename decltype(ts)::type S;
            launch<2>(name, st, copy_f<D, S>{(D *)dst->data, (const S *)src->data}, n, g);
        });
    });
}

/* ------------------------------------------------------------ axpy */
template <class T> struct axpy_f {
    static constexpr int W = pack<T>::W;
    T *y;
    const T *x;
    math_t<T> alpha;
    __device__ void operator()(const int64_t *off) const {
        y[off[0]] = store_as<T>(to_math(y[off[0]]) + alpha * to_math(x[off[1]]));
    }
    __device__ void vec(int64_t i) const {
        pack<T> u = ((const pack<T> *)y)[i], v = ((const pack<T> *)x)[i];
#pragma unroll
        for (int k = 0; k < W; k++) u.v[k] = store_as<T>(to_math(u.v[k]) + alpha * to_math(v.v[k]));
        ((pack<T> *)y)[i] = u;
    }
};

void nb__cuda_axpy(nb_tensor *y, double alpha, const nb_tensor *x) {
    const char *name = "nb_axpy_";
    cudaStream_t st = nb__cuda_enter(name, y->device.index);
    geom<2> g;
    int64_t n = make_geom<2>(&g, y, &x);
    if (n == 0) return;
    NB_CHECK(x->dtype == y->dtype, "%s: dtypes differ: y %s, x %s", name,
             nb_dtype_name(y->dtype), nb_dtype_name(x->dtype));
    by_dtype<false>(name, y->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        axpy_f<T> f{(T *)y->data, (const T *)x->data, (math_t<T>)alpha};
        const void *p[2] = {y->data, x->data};
        launch_vec<2>(name, st, f, n, g, p);
    });
}
