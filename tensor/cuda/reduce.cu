/* CUDA row reductions: sum/mean, max with its index (and max's backward), argmax,
 * variance with the mean, the elementwise losses (mse, bce on logits) and
 * the sum of squares of many tensors; the functions of tensor/ops_reduce.c,
 * tensor/ops_loss.c and optim/clip.c.
 *
 * Note [Row reduction shapes]
 * Rows are contiguous (O, I), reduced along I. One reduction (a "reducer":
 * identity, item(row, j), an associative combine, a warp shuffle) runs
 * under one of four layouts chosen from O and I only:
 *   I <= 8               one thread per row;
 *   I <= 1024            one warp per row;
 *   O >= 256 or I <= 64K one block per row;
 *   otherwise            two stages: each row is cut into S chunks, one
 *                        block per chunk writes a partial into scratch from
 *                        the output's context, then one warp per row
 *                        combines its S partials in order.
 * The layout and the order of every combine depend only on (O, I), so the
 * results are deterministic (no atomics). Sums (sum, mean, var, the
 * losses, sums of squares) accumulate in f64 whatever the dtype, as the CPU
 * does: on the GPUs we build for (sm_80, sm_90) f64 adds cost nothing next
 * to the memory traffic, and a long f32 row then keeps the CPU's accuracy
 * under cancellation. Max compares in the dtype (exact). */
#include <math.h>

#include "tensor/cuda/launches.h"
#include "tensor/cuda/types.cuh"

#define THREADS 256

static __device__ __forceinline__ float shfl_down(float v, int o) {
    return __shfl_down_sync(FULL_MASK, v, o);
}
static __device__ __forceinline__ double shfl_down(double v, int o) {
    return __shfl_down_sync(FULL_MASK, v, o);
}
static __device__ __forceinline__ int64_t shfl_down(int64_t v, int o) {
    return (int64_t)__shfl_down_sync(FULL_MASK, (long long)v, o);
}

/* ------------------------------------------------------------ reduction layouts */
template <class R> static __device__ typename R::A warp_reduce(typename R::A a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = R::combine(a, R::shfl(a, o));
    return a;
}

/* The block's result, valid in thread 0; every thread must call it. */
template <class R>
static __device__ typename R::A block_reduce(const R &r, typename R::A a, typename R::A *sm) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_reduce<R>(a);
    if (lane == 0) sm[w] = a;
    __syncthreads();
    if (w == 0) {
        a = lane < nw ? sm[lane] : r.identity();
        a = warp_reduce<R>(a);
    }
    __syncthreads();
    return a;
}

template <class R, class F>
static __global__ void rows_thread_kernel(R r, F f, int64_t outer, int64_t inner) {
    for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < outer;
         row += (int64_t)gridDim.x * blockDim.x) {
        typename R::A a = r.identity();
        for (int64_t j = 0; j < inner; j++) a = R::combine(a, r.item(row, j));
        f(row, a);
    }
}

template <class R, class F>
static __global__ void rows_warp_kernel(R r, F f, int64_t outer, int64_t inner) {
    int lane = threadIdx.x & 31;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t row = warp; row < outer; row += nwarps) {
        typename R::A a = r.identity();
        for (int64_t j = lane; j < inner; j += 32) a = R::combine(a, r.item(row, j));
        a = warp_reduce<R>(a);
        if (lane == 0) f(row, a);
    }
}

template <class R, class F>
static __global__ void rows_block_kernel(R r, F f, int64_t outer, int64_t inner) {
    __shared__ typename R::A sm[32];
    for (int64_t row = blockIdx.x; row < outer; row += gridDim.x) {
        typename R::A a = r.identity();
        for (int64_t j = threadIdx.x; j < inner; j += blockDim.x) a = R::combine(a, r.item(row, j));
        a = block_reduce(r, a, sm);
        if (threadIdx.x == 0) f(row, a);
    }
}

/* Stage one of the split layout: part (O, S) = reductions of the chunks
 * [s * chunk, (s + 1) * chunk) of each row. */
template <class R>
static __global__ void rows_split_kernel(R r, typename R::A *part, int64_t outer, int64_t inner,
                                         int64_t splits, int64_t chunk) {
    __shared__ typename R::A sm[32];
    for (int64_t b = blockIdx.x; b < outer * splits; b += gridDim.x) {
        int64_t row = b / splits, lo = (b % splits) * chunk;
        int64_t hi = lo + chunk < inner ? lo + chunk : inner;
        typename R::A a = r.identity();
        for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) a = R::combine(a, r.item(row, j));
        a = block_reduce(r, a, sm);
        if (threadIdx.x == 0) part[b] = a;
    }
}

/* Stage two: the partials (O, S) as rows. */
template <class R> struct partial_r {
    typedef typename R::A A;
    R r;
    const A *part;
    int64_t splits;
    __device__ A identity() const { return r.identity(); }
    __device__ A item(int64_t row, int64_t j) const { return part[row * splits + j]; }
    static __device__ A combine(A a, A b) { return R::combine(a, b); }
    static __device__ A shfl(A a, int o) { return R::shfl(a, o); }
};

static int grid_for(int64_t units, int64_t per_block) {
    int64_t b = (units + per_block - 1) / per_block;
    return (int)(b < 1 ? 1 : b > MAX_BLOCKS ? MAX_BLOCKS : b);
}

/* f(row, reduction of row) for every row, in the layout of Note [Row
 * reduction shapes]; scratch for the split layout from ctx. */
template <class R, class F>
static void run_rows(const char *op, cudaStream_t s, nb_ctx *ctx, const R &r, const F &f,
                     int64_t outer, int64_t inner) {
    if (outer == 0) return;
    if (inner <= 8) {
        rows_thread_kernel<<<grid_for(outer, THREADS), THREADS, 0, s>>>(r, f, outer, inner);
    } else if (inner <= 1024) {
        rows_warp_kernel<<<grid_for(outer, THREADS / 32), THREADS, 0, s>>>(r, f, outer, inner);
    } else if (outer >= 256 || inner <= 65536) {
        rows_block_kernel<<<grid_for(outer, 1), THREADS, 0, s>>>(r, f, outer, inner);
    } else {
        int64_t splits = (1024 + outer - 1) / outer, most = (inner + 8191) / 8192;
        splits = splits < most ? splits : most;
        splits = splits < 2 ? 2 : splits;
        int64_t chunk = (inner + splits - 1) / splits;
        splits = (inner + chunk - 1) / chunk;
        typedef typename R::A A;
        A *part = (A *)nb_ctx_alloc(ctx, (size_t)(outer * splits) * sizeof(A), 0);
        rows_split_kernel<<<grid_for(outer * splits, 1), THREADS, 0, s>>>(r, part, outer, inner,
                                                                          splits, chunk);
        NB_CUDA_CHECK_LAUNCH(op);
        partial_r<R> pr{r, part, splits};
        rows_warp_kernel<<<grid_for(outer, THREADS / 32), THREADS, 0, s>>>(pr, f, outer, splits);
        NB_CUDA_CHECK_LAUNCH(op);
        nb__ctx_scratch_done(ctx, part, (size_t)(outer * splits) * sizeof(A));
    }
    NB_CUDA_CHECK_LAUNCH(op);
}

/* ------------------------------------------------------------ reducers */
template <class A> struct add_combine {
    static __device__ A combine(A a, A b) { return a + b; }
    static __device__ A shfl(A a, int o) { return shfl_down(a, o); }
};

/* sum of the row's elements */
template <class T> struct sum_r : add_combine<double> {
    typedef double A;
    const T *x;
    int64_t inner;
    __device__ A identity() const { return 0.0; }
    __device__ A item(int64_t row, int64_t j) const { return (double)to_math(x[row * inner + j]); }
};

/* sum of (x - mu[row])^2 */
template <class T> struct sqdev_r : add_combine<double> {
    typedef double A;
    const T *x;
    const double *mu;
    int64_t inner;
    __device__ A identity() const { return 0.0; }
    __device__ A item(int64_t row, int64_t j) const {
        double d = (double)to_math(x[row * inner + j]) - mu[row];
        return d * d;
    }
};

/* Note [Max with NaN]: the CPU keeps the first NaN if the row has one,
 * else the first maximum. As a combine: NaN beats a number, a larger
 * number beats a smaller, and a tie (two NaN, equal numbers) goes to the
 * smaller index; that is associative and commutative, so any tree gives
 * the CPU's answer. */
template <class C> struct arg_acc {
    C v;
    int64_t i;
};

template <class T> struct max_r {
    typedef arg_acc<math_t<T>> A;
    const T *x;
    int64_t inner;
    __device__ A identity() const { return A{(math_t<T>)-INFINITY, INT64_MAX}; }
    __device__ A item(int64_t row, int64_t j) const { return A{to_math(x[row * inner + j]), j}; }
    static __device__ A combine(A a, A b) {
        bool an = isnan(a.v), bn = isnan(b.v);
        if (an != bn) return an ? a : b;
        if (!an && a.v != b.v) return a.v > b.v ? a : b;
        return a.i <= b.i ? a : b;
    }
    static __device__ A shfl(A a, int o) { return A{shfl_down(a.v, o), shfl_down(a.i, o)}; }
};

/* ------------------------------------------------------------ finishers */
template <class T> struct sum_fin {
    T *out;
    double scale;
    __device__ void operator()(int64_t row, double a) const {
        out[row] = store_as<T>(a * scale);
    }
};

template <class T> struct max_fin {
    T *out;
    int64_t *arg;
    __device__ void operator()(int64_t row, arg_acc<math_t<T>> a) const {
        out[row] = store_as<T>(a.v);
        arg[row] = a.i;
    }
};

struct mean_fin {
    double *mu;
    int64_t inner;
    __device__ void operator()(int64_t row, double a) const { mu[row] = a / (double)inner; }
};

template <class T> struct var_fin {
    T *out, *mean;
    const double *mu;
    double denom;
    __device__ void operator()(int64_t row, double a) const {
        out[row] = store_as<T>(denom > 0 ? a / denom : (double)NAN);
        mean[row] = store_as<T>(mu[row]);
    }
};

/* ------------------------------------------------------------ sum, max, var */
void nb__cuda_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner,
                       double scale) {
    const char *op = "nb_sum";
    cudaStream_t s = nb__cuda_enter(op, out->device.index);
    by_float_dtype(op, rows->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        sum_r<T> r;
        r.x = (const T *)rows->data;
        r.inner = inner;
        run_rows(op, s, out->ctx, r, sum_fin<T>{(T *)out->data, scale}, outer, inner);
    });
}

void nb__cuda_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                       int64_t inner) {
    const char *op = "nb_max";
    cudaStream_t s = nb__cuda_enter(op, out->device.index);
    if (outer == 0) return;
    NB_CHECK(inner > 0, "%s: cannot reduce an empty dimension", op);
    by_float_dtype(op, rows->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        max_r<T> r{(const T *)rows->data, inner};
        run_rows(op, s, out->ctx, r, max_fin<T>{(T *)out->data, (int64_t *)arg->data}, outer,
                 inner);
    });
}

/* Shape and strides of g, whose elements in row-major order are the O outputs. */
typedef struct gview {
    int nd;
    int64_t size[NB_MAX_DIMS], st[NB_MAX_DIMS];
} gview;

// gp: (O, I) contiguous; g: O elements, any strides
template <class T>
static __global__ void max_backward_kernel(T *gp, const int64_t *arg, const T *g, gview gv,
                                           int64_t outer, int64_t inner) {
    int64_t n = outer * inner;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        int64_t o = e / inner;
        if (e - o * inner != arg[o]) {
            gp[e] = store_as<T>(0.0f);
            continue;
        }
        int64_t off = 0, r = o;
        for (int d = gv.nd - 1; d >= 0; d--) {
            off += (r % gv.size[d]) * gv.st[d];
            r /= gv.size[d];
        }
        gp[e] = g[off];
    }
}

void nb__cuda_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g,
                                int64_t outer, int64_t inner) {
    const char *op = "nb_max backward";
    cudaStream_t s = nb__cuda_enter(op, gp->device.index);
    if (outer == 0 || inner == 0) return;
    NB_CHECK(g->dtype == gp->dtype && nb_numel(g) == outer,
             "%s: g must be %s with %lld elements, got %s of shape %s", op,
             nb_dtype_name(gp->dtype), (long long)outer, nb_dtype_name(g->dtype),
             nb_shape_str(g));
    gview gv;
    gv.nd = g->ndim;
    for (int d = 0; d < g->ndim; d++) {
        gv.size[d] = g->shape[d];
        gv.st[d] = g->strides[d];
    }
    by_float_dtype(op, gp->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        max_backward_kernel<T><<<grid_for(outer * inner, THREADS), THREADS, 0, s>>>(
            (T *)gp->data, (const int64_t *)arg->data, (const T *)g->data, gv, outer, inner);
        NB_CUDA_CHECK_LAUNCH(op);
    });
}

void nb__cuda_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                       int64_t inner, double denom) {
    const char *op = "nb_var";
    cudaStream_t s = nb__cuda_enter(op, out->device.index);
    if (outer == 0) return;
    by_float_dtype(op, rows->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        double *mu = (double *)nb_ctx_alloc(out->ctx, (size_t)outer * sizeof(double), 0);
        sum_r<T> r1;
        r1.x = (const T *)rows->data;
        r1.inner = inner;
        run_rows(op, s, out->ctx, r1, mean_fin{mu, inner}, outer, inner);
        sqdev_r<T> r2;
        r2.x = (const T *)rows->data;
        r2.mu = mu;
        r2.inner = inner;
        run_rows(op, s, out->ctx, r2, var_fin<T>{(T *)out->data, (T *)mean->data, mu, denom},
                 outer, inner);
    });
}

/* ------------------------------------------------------------ losses */
static __device__ __forceinline__ float m_log1p_exp(float x) { return log1pf(expf(x)); }
static __device__ __forceinline__ double m_log1p_exp(double x) { return log1p(exp(x)); }

/* One row of n elements: the loss term of element j, summed in f64. */
template <class T> struct pair_r : add_combine<double> {
    typedef double A;
    const T *a, *b;
    int kind;
    __device__ A identity() const { return 0.0; }
    __device__ A item(int64_t row, int64_t j) const {
        if (kind == 0) {
            double d = (double)to_math(a[j]) - (double)to_math(b[j]);
            return d * d;
        }
        math_t<T> x = to_math(a[j]), y = to_math(b[j]);
        math_t<T> ax = x < 0 ? -x : x;
        return (double)((x > 0 ? x : (math_t<T>)0) - x * y + m_log1p_exp(-ax));
    }
};

template <class T> struct mean_out_fin {
    T *out;
    int64_t n;
    __device__ void operator()(int64_t row, double a) const {
        out[0] = store_as<T>(a / (double)n);
    }
};

void nb__cuda_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b) {
    const char *op = kind == 0 ? "nb_mse_loss" : "nb_bce_with_logits";
    cudaStream_t s = nb__cuda_enter(op, out->device.index);
    int64_t n = nb_numel(a);
    by_float_dtype(op, a->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        pair_r<T> r;
        r.a = (const T *)a->data;
        r.b = (const T *)b->data;
        r.kind = kind;
        run_rows(op, s, out->ctx, r, mean_out_fin<T>{(T *)out->data, n}, 1, n);
    });
}

/* ------------------------------------------------------------ sum of squares */
/* SQ_BATCH tensors per sumsq_partial_kernel launch: GPT-2's 148 gradients
 * in one (the partials do not depend on the batching: the same sum). */
#define SQ_BATCH 192
#define SQ_MAX_BLOCKS_PER_TENSOR 256
static_assert(SQ_BATCH == (int)NB__CUDA_SUMSQ_TENSORS_PER_LAUNCH,
              "tensor/cuda/launches.h counts sumsq_partial_kernel's launches");

/* Up to SQ_BATCH tensors; tensor k owns blocks [first[k], first[k + 1]). */
typedef struct sq_batch {
    int n;
    int dtype[SQ_BATCH];
    const void *p[SQ_BATCH];
    int64_t numel[SQ_BATCH];
    int64_t first[SQ_BATCH + 1];
} sq_batch;

struct dsum_r : add_combine<double> {
    typedef double A;
    __device__ A identity() const { return 0.0; }
};

static __global__ void sumsq_partial_kernel(sq_batch b, double *part) {
    __shared__ double sm[32];
    int k = 0, hi = b.n - 1; /* the last k with first[k] <= blockIdx.x */
    while (k < hi) {
        int mid = (k + hi + 1) / 2;
        if (b.first[mid] <= (int64_t)blockIdx.x) k = mid;
        else hi = mid - 1;
    }
    int64_t nblk = b.first[k + 1] - b.first[k], bi = (int64_t)blockIdx.x - b.first[k];
    double a = 0;
    for (int64_t j = bi * blockDim.x + threadIdx.x; j < b.numel[k]; j += nblk * blockDim.x) {
        double v = load_f64(b.p[k], j, b.dtype[k]);
        a += v * v;
    }
    a = block_reduce(dsum_r{}, a, sm);
    if (threadIdx.x == 0) part[blockIdx.x] = a;
}

/* One block: out (0-d, f32 or f64) = sum of part[0, n) in a fixed order. */
static __global__ void sumsq_final_kernel(void *out, int out_dt, const double *part, int64_t n) {
    __shared__ double sm[32];
    double a = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) a += part[j];
    a = block_reduce(dsum_r{}, a, sm);
    if (threadIdx.x == 0) {
        if (out_dt == NB_F64) *(double *)out = a;
        else *(float *)out = (float)a;
    }
}

void nb__cuda_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts) {
    const char *op = "nb_clip_grad_norm";
    cudaStream_t s = nb__cuda_enter(op, out->device.index);
    NB_CHECK(out->dtype == NB_F32 || out->dtype == NB_F64,
             "%s: the sum of squares goes to f32 or f64, not %s", op, nb_dtype_name(out->dtype));
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        int64_t m = nb_numel(ts[i]), nb = (m + THREADS * 16 - 1) / (THREADS * 16);
        total += nb < SQ_MAX_BLOCKS_PER_TENSOR ? nb : SQ_MAX_BLOCKS_PER_TENSOR;
    }
    double *part = total ? (double *)nb_ctx_alloc(out->ctx, (size_t)total * sizeof(double), 0)
                         : nullptr;
    int64_t base = 0;
    for (int i0 = 0; i0 < n; i0 += SQ_BATCH) {
        sq_batch b;
        b.n = n - i0 < SQ_BATCH ? n - i0 : SQ_BATCH;
        b.first[0] = 0;
        for (int k = 0; k < b.n; k++) {
            const nb_tensor *t = ts[i0 + k];
            NB_CHECK(nb_dtype_is_float(t->dtype) && nb_is_contiguous(t) &&
                         nb_device_eq(t->device, out->device),
                     "%s: tensor %d must be a contiguous float tensor on %s, got %s %s on %s", op,
                     i0 + k, nb_device_name(out->device), nb_dtype_name(t->dtype),
                     nb_shape_str(t), nb_device_name(t->device));
            int64_t m = nb_numel(t), nb = (m + THREADS * 16 - 1) / (THREADS * 16);
            b.dtype[k] = (int)t->dtype;
            b.p[k] = t->data;
            b.numel[k] = m;
            b.first[k + 1] = b.first[k] + (nb < SQ_MAX_BLOCKS_PER_TENSOR ? nb : SQ_MAX_BLOCKS_PER_TENSOR);
        }
        int64_t blocks = b.first[b.n];
        if (blocks > 0) {
            sumsq_partial_kernel<<<(unsigned)blocks, THREADS, 0, s>>>(b, part + base);
            NB_CUDA_CHECK_LAUNCH(op);
        }
        base += blocks;
    }
    sumsq_final_kernel<<<1, 1024, 0, s>>>(out->data, (int)out->dtype, part, total);
    NB_CUDA_CHECK_LAUNCH(op);
}

/* ------------------------------------------------------------ argmax */
template <class T> struct argmax_fin {
    int64_t *arg;
    __device__ void operator()(int64_t row, arg_acc<math_t<T>> a) const { arg[row] = a.i; }
};

void nb__cuda_argmax_rows(nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner) {
    const char *op = "nb_argmax";
    cudaStream_t s = nb__cuda_enter(op, arg->device.index);
    if (outer == 0) return;
    NB_CHECK(inner > 0, "%s: cannot reduce an empty dimension", op);
    by_float_dtype(op, rows->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        max_r<T> r{(const T *)rows->data, inner};
        run_rows(op, s, arg->ctx, r, argmax_fin<T>{(int64_t *)arg->data}, outer, inner);
    });
}
