/* CUDA softmax family: softmax and log-softmax over (O, K, I) and their
 * backward, and the fused cross-entropy over logits (N, C) with its
 * backward; the functions of tensor/cpu/softmax.c (contracts in
 * tensor/cuda/cuda.h).
 *
 * I = 1 (the axis is last): a group of threads per row, a warp (eight rows
 * to a block) when K <= 1024, the row then held in registers (Note [Rows in
 * registers], rows.cuh), else a block of 512. Each thread keeps an
 * online (max, sum of exp(x - max)) over its elements; the group merges
 * them in a fixed order, so one pass over x finds both. I > 1: a block of
 * 32 x 8 threads per tile of 32 adjacent columns of one o (coalesced
 * reads), the eight rows of threads splitting K and merging through shared
 * memory.
 *
 * Cross-entropy: one group per row writes lse, the row's loss (f64) and
 * whether it counts into scratch; one block then sums them in a fixed
 * order (deterministic, no atomics) into loss and count. Fused (Note
 * [Fused classifier] in tensor/ops_loss.c): one block counts the targets
 * first, and each row's group, after its merge, reads its row a second
 * time (from L2: a row of GPT-2's 50304 bf16 logits is 100 KB) to write
 * the gradient over it; no lse. A target outside
 * [0, C) that is not ignore_index raises NB__FAULT_CROSS_ENTROPY_TARGET
 * (Note [Deferred device checks] in cuda.h) and its row counts for nothing.
 * 16-bit types compute in f32, f64 in f64. */
#include "tensor/cuda/rows.cuh"

#define THREADS ROW_THREADS

static __device__ __forceinline__ int64_t load_target(const void *p, int64_t i, int dt) {
    return dt == NB_I32 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

static __device__ __forceinline__ float m_log(float x) { return logf(x); }
static __device__ __forceinline__ double m_log(double x) { return log(x); }

/* Cross-entropy's row state: online max and sum, the sum of x, and
 * x[t] (from the one thread that read it, 0 from the others: the fused
 * kernel writes over x, so nothing reads x[t] after the merge). */
template <class C> struct ce_st {
    ms<C> e;
    C sx, xt;
};
template <class C> static __device__ __forceinline__ ce_st<C> combine(ce_st<C> a, ce_st<C> b) {
    return ce_st<C>{combine(a.e, b.e), a.sx + b.sx, a.xt + b.xt};
}
template <class C> static __device__ __forceinline__ ce_st<C> shfl_down(ce_st<C> v, int o) {
    return ce_st<C>{shfl_down(v.e, o), shfl_down(v.sx, o), shfl_down(v.xt, o)};
}
template <class C> static __device__ __forceinline__ ce_st<C> shfl_0(ce_st<C> v) {
    return ce_st<C>{shfl_0(v.e), shfl_0(v.sx), shfl_0(v.xt)};
}

static unsigned grid_for(int64_t units, int64_t per_block) {
    int64_t b = (units + per_block - 1) / per_block;
    return (unsigned)(b < 1 ? 1 : b > MAX_BLOCKS ? MAX_BLOCKS : b);
}

/* ------------------------------------------------------------ softmax forward */
// x, y: (O * K) rows of K (I = 1)
template <class T>
static __global__ void softmax_rows_kernel(T *y, const T *x, int64_t rows, int64_t k,
                                           bool take_log) {
    typedef math_t<T> C;
    __shared__ ms<C> sm[32];
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *xr = x + row * k;
        T *yr = y + row * k;
        ms<C> st{(C)-INFINITY, (C)0};
        for (int64_t j = threadIdx.x; j < k; j += blockDim.x) ms_add(st, to_math(xr[j]));
        st = ms_done(group_allreduce(st, sm));
        if (take_log) {
            C lse = st.m + m_log(st.s);
            for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
                yr[j] = store_as<T>(to_math(xr[j]) - lse);
        } else {
            C inv = (C)1 / st.s;
            for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
                yr[j] = store_as<T>(m_exp(to_math(xr[j]) - st.m) * inv);
        }
    }
}

// x, y: (O * K) rows of K <= 32 * N (I = 1), a warp per row: the row is
// held in registers (N per lane), so x is read once (Note [Rows in registers])
template <class T, int N>
static __global__ void softmax_rows_reg_kernel(T *y, const T *x, int64_t rows, int k,
                                               bool take_log) {
    typedef math_t<T> C;
    const int lane = threadIdx.x;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *xr = x + row * k;
        T *yr = y + row * k;
        C v[N];
        load_row(v, xr, lane, k, (C)-INFINITY);
        C m = row_max(v, lane, k);
        C sum = 0;
#pragma unroll
        for (int i = 0; i < N; i++)
            if (lane + 32 * i < k) {
                C e = m_exp(v[i] - m);
                sum += e;
                if (!take_log) v[i] = e;
            }
        sum = group_allreduce(sum, (C *)nullptr);
        if (take_log) {
            C lse = m + m_log(sum);
#pragma unroll
            for (int i = 0; i < N; i++)
                if (lane + 32 * i < k) yr[lane + 32 * i] = store_as<T>(v[i] - lse);
        } else {
            C inv = (C)1 / sum;
#pragma unroll
            for (int i = 0; i < N; i++)
                if (lane + 32 * i < k) yr[lane + 32 * i] = store_as<T>(v[i] * inv);
        }
    }
}

// x, y: (O, K, I), I > 1; block (32, 8) per tile of 32 columns of one o
template <class T>
static __global__ void softmax_cols_kernel(T *y, const T *x, int64_t outer, int64_t k,
                                           int64_t inner, bool take_log) {
    typedef math_t<T> C;
    __shared__ ms<C> sm[8][32];
    int64_t tiles = (inner + 31) / 32;
    for (int64_t t = blockIdx.x; t < outer * tiles; t += gridDim.x) {
        int64_t o = t / tiles, i = (t - o * tiles) * 32 + threadIdx.x;
        bool ok = i < inner;
        const T *xc = x + o * k * inner + i;
        T *yc = y + o * k * inner + i;
        ms<C> st{(C)-INFINITY, (C)0};
        if (ok)
            for (int64_t j = threadIdx.y; j < k; j += blockDim.y) ms_add(st, to_math(xc[j * inner]));
        sm[threadIdx.y][threadIdx.x] = st;
        __syncthreads();
        st = sm[0][threadIdx.x];
        for (unsigned q = 1; q < blockDim.y; q++) st = combine(st, sm[q][threadIdx.x]);
        __syncthreads();
        st = ms_done(st);
        if (!ok) continue;
        if (take_log) {
            C lse = st.m + m_log(st.s);
            for (int64_t j = threadIdx.y; j < k; j += blockDim.y)
                yc[j * inner] = store_as<T>(to_math(xc[j * inner]) - lse);
        } else {
            C inv = (C)1 / st.s;
            for (int64_t j = threadIdx.y; j < k; j += blockDim.y)
                yc[j * inner] = store_as<T>(m_exp(to_math(xc[j * inner]) - st.m) * inv);
        }
    }
}

void nb__cuda_softmax(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k, int64_t inner,
                      bool take_log) {
    const char *op = take_log ? "nb_log_softmax" : "nb_softmax";
    cudaStream_t s = nb__cuda_enter(op, y->device.index);
    if (outer == 0 || k == 0 || inner == 0) return;
    by_float_dtype(op, x->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        if (inner == 1) {
            dim3 grid, block;
            row_config(outer, k, &grid, &block);
            bool reg = reg_rows(k, [&](auto n) {
                softmax_rows_reg_kernel<T, decltype(n)::value><<<grid, block, 0, s>>>(
                    (T *)y->data, (const T *)x->data, outer, (int)k, take_log);
            });
            if (!reg)
                softmax_rows_kernel<T><<<grid, block, 0, s>>>((T *)y->data, (const T *)x->data,
                                                              outer, k, take_log);
        } else {
            softmax_cols_kernel<T><<<grid_for(outer * ((inner + 31) / 32), 1), dim3(32, 8), 0, s>>>(
                (T *)y->data, (const T *)x->data, outer, k, inner, take_log);
        }
        NB_CUDA_CHECK_LAUNCH(op);
    });
}

/* ------------------------------------------------------------ softmax backward */
/* softmax: dx = y (g - sum_K g y); log-softmax: dx = g - exp(y) sum_K g. */
template <class C> static __device__ __forceinline__ C bw_term(C g, C y, bool take_log) {
    return take_log ? g : g * y;
}
template <class C> static __device__ __forceinline__ C bw_out(C g, C y, C r, bool take_log) {
    return take_log ? g - m_exp(y) * r : y * (g - r);
}

template <class T>
static __global__ void softmax_backward_rows_kernel(T *dx, const T *y, const T *g, int64_t rows,
                                                    int64_t k, bool take_log) {
    typedef math_t<T> C;
    __shared__ C sm[32];
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *yr = y + row * k, *gr = g + row * k;
        T *dr = dx + row * k;
        C r = 0;
        for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
            r += bw_term(to_math(gr[j]), to_math(yr[j]), take_log);
        r = group_allreduce(r, sm);
        for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
            dr[j] = store_as<T>(bw_out(to_math(gr[j]), to_math(yr[j]), r, take_log));
    }
}

// rows of K <= 32 * N, a warp per row, y and g held in registers
template <class T, int N>
static __global__ void softmax_backward_rows_reg_kernel(T *dx, const T *y, const T *g,
                                                        int64_t rows, int k, bool take_log) {
    typedef math_t<T> C;
    const int lane = threadIdx.x;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *yr = y + row * k, *gr = g + row * k;
        T *dr = dx + row * k;
        C yv[N], gv[N];
        load_row(yv, yr, lane, k, (C)0);
        load_row(gv, gr, lane, k, (C)0);
        C r = 0;
#pragma unroll
        for (int i = 0; i < N; i++)
            if (lane + 32 * i < k) r += bw_term(gv[i], yv[i], take_log);
        r = group_allreduce(r, (C *)nullptr);
#pragma unroll
        for (int i = 0; i < N; i++)
            if (lane + 32 * i < k) dr[lane + 32 * i] = store_as<T>(bw_out(gv[i], yv[i], r, take_log));
    }
}

template <class T>
static __global__ void softmax_backward_cols_kernel(T *dx, const T *y, const T *g, int64_t outer,
                                                    int64_t k, int64_t inner, bool take_log) {
    typedef math_t<T> C;
    __shared__ C sm[8][32];
    int64_t tiles = (inner + 31) / 32;
    for (int64_t t = blockIdx.x; t < outer * tiles; t += gridDim.x) {
        int64_t o = t / tiles, i = (t - o * tiles) * 32 + threadIdx.x;
        bool ok = i < inner;
        int64_t base = o * k * inner + i;
        C r = 0;
        if (ok)
            for (int64_t j = threadIdx.y; j < k; j += blockDim.y)
                r += bw_term(to_math(g[base + j * inner]), to_math(y[base + j * inner]), take_log);
        sm[threadIdx.y][threadIdx.x] = r;
        __syncthreads();
        r = sm[0][threadIdx.x];
        for (unsigned q = 1; q < blockDim.y; q++) r += sm[q][threadIdx.x];
        __syncthreads();
        if (!ok) continue;
        for (int64_t j = threadIdx.y; j < k; j += blockDim.y) {
            int64_t e = base + j * inner;
            dx[e] = store_as<T>(bw_out(to_math(g[e]), to_math(y[e]), r, take_log));
        }
    }
}

void nb__cuda_softmax_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                               int64_t outer, int64_t k, int64_t inner, bool take_log) {
    const char *op = take_log ? "nb_log_softmax backward" : "nb_softmax backward";
    cudaStream_t s = nb__cuda_enter(op, dx->device.index);
    if (outer == 0 || k == 0 || inner == 0) return;
    NB_CHECK(g->dtype == y->dtype && dx->dtype == y->dtype, "%s: dtypes differ: dx %s, y %s, g %s",
             op, nb_dtype_name(dx->dtype), nb_dtype_name(y->dtype), nb_dtype_name(g->dtype));
    by_float_dtype(op, y->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        if (inner == 1) {
            dim3 grid, block;
            row_config(outer, k, &grid, &block);
            bool reg = reg_rows(k, [&](auto n) {
                softmax_backward_rows_reg_kernel<T, decltype(n)::value><<<grid, block, 0, s>>>(
                    (T *)dx->data, (const T *)y->data, (const T *)g->data, outer, (int)k,
                    take_log);
            });
            if (!reg)
                softmax_backward_rows_kernel<T><<<grid, block, 0, s>>>(
                    (T *)dx->data, (const T *)y->data, (const T *)g->data, outer, k, take_log);
        } else {
            softmax_backward_cols_kernel<T>
                <<<grid_for(outer * ((inner + 31) / 32), 1), dim3(32, 8), 0, s>>>(
                    (T *)dx->data, (const T *)y->data, (const T *)g->data, outer, k, inner,
                    take_log);
        }
        NB_CUDA_CHECK_LAUNCH(op);
    });
}

/* ------------------------------------------------------------ cross-entropy */
static __device__ void raise_target_fault(nb__cuda_fault *slot, int64_t t, int64_t pos,
                                          int64_t classes) {
    if (atomicCAS(&slot->code, NB__FAULT_NONE, NB__FAULT_CROSS_ENTROPY_TARGET) == NB__FAULT_NONE) {
        slot->value = (long long)t;
        slot->position = (long long)pos;
        slot->limit = (long long)classes;
        __threadfence_system();
    }
}

/* Whether row i's target counts (not ignored, in range). */
static __device__ __forceinline__ bool target_counts(int64_t t, int64_t ignore, int64_t c) {
    return t != ignore && t >= 0 && t < c;
}

/* Row `row`'s gradient for the scale 1 / count (the backward's for g = 1,
 * same arithmetic as cross_entropy_backward_kernel), written by the
 * group's threads over dx (which may be x: each thread reads x[j] then
 * writes dx[j]). */
template <class T>
static __device__ void ce_grad_row(T *dxr, const T *xr, math_t<T> l, int64_t t, bool counts,
                                   double cnt, int64_t c, double eps) {
    typedef math_t<T> C;
    double scale = cnt > 0 ? 1.0 / cnt : 0.0;
    C sc = (C)scale, off = (C)(scale * eps / (double)c), on = (C)(scale * (1 - eps));
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
        if (cnt <= 0 || !counts) {
            dxr[j] = store_as<T>((C)0);
            continue;
        }
        C v = sc * m_exp(to_math(xr[j]) - l) - off;
        if (j == t) v -= on;
        dxr[j] = store_as<T>(v);
    }
}

// x, dx: (N, C); lse: (N) or null; row_loss, counted: (N) scratch; dx null
// (unfused) or the fused gradient, count then already written
template <class T>
static __global__ void cross_entropy_rows_kernel(math_t<T> *lse, double *row_loss, int *counted,
                                                 T *dx, const float *count, const T *x,
                                                 const void *tg, int tdt, int64_t tstride,
                                                 int64_t n, int64_t c, int64_t ignore, double eps,
                                                 nb__cuda_fault *slot) {
    typedef math_t<T> C;
    __shared__ ce_st<C> sm[32];
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < n;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *xr = x + row * c;
        int64_t t = load_target(tg, row * tstride, tdt);
        ce_st<C> st{{(C)-INFINITY, (C)0}, (C)0, (C)0};
        for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
            C v = to_math(xr[j]);
            ms_add(st.e, v);
            st.sx += v;
            if (j == t) st.xt = v;
        }
        st = group_allreduce(st, sm);
        st.e = ms_done(st.e);
        C l = st.e.m + m_log(st.e.s);
        bool counts = target_counts(t, ignore, c);
        if (dx) ce_grad_row(dx + row * c, xr, l, t, counts, (double)*count, c, eps);
        if (threadIdx.x != 0) continue;
        if (lse) lse[row] = l;
        double loss = 0;
        int cnt = 0;
        if (t != ignore) {
            if (!counts) {
                raise_target_fault(slot, t, row, c);
            } else {
                double nll = (double)l - (double)st.xt;
                loss = eps == 0 ? nll
                                : (1 - eps) * nll + eps * ((double)l - (double)st.sx / (double)c);
                cnt = 1;
            }
        }
        row_loss[row] = loss;
        counted[row] = cnt;
    }
}

/* One block of 1024: count = the targets that count (the fused kernel
 * scales by it before any row's loss is known). */
static __global__ void cross_entropy_count_kernel(float *count, const void *tg, int tdt,
                                                  int64_t tstride, int64_t n, int64_t c,
                                                  int64_t ignore) {
    __shared__ double sm[32];
    double k = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        k += target_counts(load_target(tg, i * tstride, tdt), ignore, c);
    k = group_allreduce(k, sm);
    if (threadIdx.x == 0) *count = (float)k;
}

/* One block of 1024: loss = sum of row_loss / count, count = rows counted. */
template <class T>
static __global__ void cross_entropy_total_kernel(T *loss, float *count, const double *row_loss,
                                                  const int *counted, int64_t n) {
    __shared__ double sm[32];
    __shared__ double smc[32];
    double a = 0, k = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        a += row_loss[i];
        k += counted[i];
    }
    a = group_allreduce(a, sm);
    k = group_allreduce(k, smc);
    if (threadIdx.x == 0) {
        *loss = store_as<T>(a / k);
        *count = (float)k;
    }
}

void nb__cuda_cross_entropy_rows(nb_tensor *loss, nb_tensor *lse, nb_tensor *count,
                                 nb_tensor *dlogits, const nb_tensor *logits,
                                 const nb_tensor *targets, int64_t ignore_index, double eps) {
    const char *op = "nb_cross_entropy";
    cudaStream_t s = nb__cuda_enter(op, loss->device.index);
    int64_t n = logits->shape[0], c = logits->shape[1];
    NB_CHECK(logits->ndim == 2 && nb_is_contiguous(logits) && targets->ndim == 1 &&
                 targets->shape[0] == n &&
                 (targets->dtype == NB_I32 || targets->dtype == NB_I64) &&
                 count->dtype == NB_F32 && (lse || dlogits) &&
                 (!dlogits || (dlogits->dtype == logits->dtype && nb_is_contiguous(dlogits) &&
                               nb_same_shape(dlogits, logits))) &&
                 (loss->dtype == logits->dtype ||
                  (loss->dtype == NB_F32 && nb_dtype_size(logits->dtype) == 2)),
             "%s: expects contiguous logits (N, C), i32/i64 targets (N), an f32 count, a loss "
             "of the logits' dtype (f32 for bf16/f16), and an lse or contiguous dlogits like the "
             "logits; got logits %s %s, targets %s %s, count %s, loss %s, lse %s, dlogits %s",
             op, nb_dtype_name(logits->dtype), nb_shape_str(logits),
             nb_dtype_name(targets->dtype), nb_shape_str(targets), nb_dtype_name(count->dtype),
             nb_dtype_name(loss->dtype), lse ? "given" : "none",
             dlogits ? nb_shape_str(dlogits) : "none");
    nb__cuda_fault *slot = nb__cuda_fault_slot(logits->device.index);
    by_float_dtype(op, logits->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        double *row_loss = nullptr;
        int *counted = nullptr;
        if (n > 0) {
            row_loss = (double *)nb_ctx_alloc(loss->ctx, (size_t)n * sizeof(double), 0);
            counted = (int *)nb_ctx_alloc(loss->ctx, (size_t)n * sizeof(int), 0);
        }
        if (n > 0 && c > 0) {
            if (dlogits) {
                cross_entropy_count_kernel<<<1, 1024, 0, s>>>((float *)count->data, targets->data,
                                                             (int)targets->dtype,
                                                             targets->strides[0], n, c,
                                                             ignore_index);
                NB_CUDA_CHECK_LAUNCH(op);
            }
            dim3 grid, block;
            row_config(n, c, &grid, &block);
            cross_entropy_rows_kernel<T><<<grid, block, 0, s>>>(
                lse ? (math_t<T> *)lse->data : nullptr, row_loss, counted,
                dlogits ? (T *)dlogits->data : nullptr, (const float *)count->data,
                (const T *)logits->data, targets->data, (int)targets->dtype, targets->strides[0],
                n, c, ignore_index, eps, slot);
            NB_CUDA_CHECK_LAUNCH(op);
        } else if (n > 0) {
            /* no classes: every target is out of range unless ignored; the
             * front end rejects C = 0, so this is not reached in practice */
            NB_ABORT("%s: logits %s have no classes", op, nb_shape_str(logits));
        }
        /* the loss of bf16/f16 logits is f32 (Note [Compute dtype] in tensor/context.c) */
        if (loss->dtype == logits->dtype)
            cross_entropy_total_kernel<T><<<1, 1024, 0, s>>>((T *)loss->data,
                                                             (float *)count->data, row_loss,
                                                             counted, n);
        else
            cross_entropy_total_kernel<float><<<1, 1024, 0, s>>>((float *)loss->data,
                                                                 (float *)count->data, row_loss,
                                                                 counted, n);
        NB_CUDA_CHECK_LAUNCH(op);
    });
}

// x, dx: (N, C) flat; I: uint32_t when N C <= INT32_MAX, else int64_t
template <class T, class I>
static __global__ void cross_entropy_backward_kernel(T *dx, const T *x, const math_t<T> *lse,
                                                     const void *tg, int tdt, int64_t tstride,
                                                     const void *g, int gdt, const float *count,
                                                     I total, I c, int64_t ignore, double eps) {
    typedef math_t<T> C;
    double cnt = *count;
    double scale = cnt > 0 ? load_f64(g, 0, gdt) / cnt : 0.0;
    C sc = (C)scale, off = (C)(scale * eps / (double)c), on = (C)(scale * (1 - eps));
    for (I e = blockIdx.x * (I)blockDim.x + threadIdx.x; e < total; e += (I)gridDim.x * blockDim.x) {
        I row = e / c, j = e - row * c;
        int64_t t = load_target(tg, (int64_t)row * tstride, tdt);
        if (cnt <= 0 || t == ignore || t < 0 || t >= (int64_t)c) {
            dx[e] = store_as<T>((C)0);
            continue;
        }
        C v = sc * m_exp(to_math(x[e]) - lse[row]) - off;
        if ((int64_t)j == t) v -= on;
        dx[e] = store_as<T>(v);
    }
}

// x, dx: (N C) flat, x the fused forward's gradient for g = 1: dx = g x
template <class T, class I>
static __global__ void cross_entropy_scale_kernel(T *dx, const T *x, const void *g, int gdt,
                                                  I total) {
    typedef math_t<T> C;
    C gv = (C)load_f64(g, 0, gdt);
    for (I e = blockIdx.x * (I)blockDim.x + threadIdx.x; e < total; e += (I)gridDim.x * blockDim.x)
        dx[e] = store_as<T>(gv * to_math(x[e]));
}

void nb__cuda_cross_entropy_backward(nb_tensor *dlogits, const nb_tensor *logits,
                                     const nb_tensor *lse, const nb_tensor *targets,
                                     const nb_tensor *g, const nb_tensor *count,
                                     int64_t ignore_index, double eps) {
    const char *op = "nb_cross_entropy backward";
    cudaStream_t s = nb__cuda_enter(op, dlogits->device.index);
    int64_t n = logits->shape[0], c = logits->shape[1], total = n * c;
    if (total == 0) return;
    NB_CHECK(nb_dtype_is_float(g->dtype) && count->dtype == NB_F32 &&
                 dlogits->dtype == logits->dtype,
             "%s: expects a float g, an f32 count and dlogits of the logits' dtype; got g %s, "
             "count %s, dlogits %s, logits %s",
             op, nb_dtype_name(g->dtype), nb_dtype_name(count->dtype),
             nb_dtype_name(dlogits->dtype), nb_dtype_name(logits->dtype));
    by_float_dtype(op, logits->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        unsigned grid = grid_for(total, THREADS);
        if (!lse && total <= INT32_MAX)
            cross_entropy_scale_kernel<T, uint32_t><<<grid, THREADS, 0, s>>>(
                (T *)dlogits->data, (const T *)logits->data, g->data, (int)g->dtype,
                (uint32_t)total);
        else if (!lse)
            cross_entropy_scale_kernel<T, int64_t><<<grid, THREADS, 0, s>>>(
                (T *)dlogits->data, (const T *)logits->data, g->data, (int)g->dtype, total);
        else if (total <= INT32_MAX)
            cross_entropy_backward_kernel<T, uint32_t><<<grid, THREADS, 0, s>>>(
                (T *)dlogits->data, (const T *)logits->data, (const math_t<T> *)lse->data,
                targets->data, (int)targets->dtype, targets->strides[0], g->data, (int)g->dtype,
                (const float *)count->data, (uint32_t)total, (uint32_t)c, ignore_index, eps);
        else
            cross_entropy_backward_kernel<T, int64_t><<<grid, THREADS, 0, s>>>(
                (T *)dlogits->data, (const T *)logits->data, (const math_t<T> *)lse->data,
                targets->data, (int)targets->dtype, targets->strides[0], g->data, (int)g->dtype,
                (const float *)count->data, total, c, ignore_index, eps);
        NB_CUDA_CHECK_LAUNCH(op);
    });
}
