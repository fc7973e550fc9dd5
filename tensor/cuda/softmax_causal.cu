/* CUDA causal softmax of attention scores x (B, T, S) and its backward:
 * the functions of nb__cpu_softmax_causal(_backward) in
 * tensor/cpu/softmax.c (contracts in tensor/cuda/cuda.h).
 *
 * Row i of each (T, S) matrix keeps l = min(i + 1, S) entries (key j is
 * kept when j <= i, counted from the left whatever T and S are, as on the
 * CPU): y = softmax(scale x[:l]), then zeros; x[j >= l] is never read.
 * One group of threads per row: a warp (eight rows to a block) when
 * S <= 1024, the row then held in registers (Note [Rows in registers],
 * rows.cuh), else a block of 512. Each thread keeps an online (max, sum of
 * exp(v - max)) of v = scale x over its kept elements, so one pass finds
 * both (a negative scale needs nothing special: the max is taken after
 * scaling); the group merges them in a fixed order. Backward:
 * dx = scale y (g - sum_{j<l} g y) on the kept entries, 0 elsewhere.
 * 16-bit types compute in f32, f64 in f64. Rows are never empty (j = 0 is
 * always kept), so the sums are never zero unless the row's scaled scores
 * are all -inf, which gives NaN as on the CPU. */
#include "tensor/cuda/rows.cuh"

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

// the same, rows of S <= 32 * N in registers (Note [Rows in registers])
template <class T, int N>
static __global__ void causal_reg_kernel(T *y, const T *x, int64_t rows, int64_t t, int s,
                                         double scale) {
    typedef math_t<T> C;
    const C sc = (C)scale;
    const int lane = threadIdx.x;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *xr = x + row * s;
        T *yr = y + row * s;
        int l = (int)kept(row, t, s);
        C v[N];
        load_row(v, xr, lane, l, (C)-INFINITY);
#pragma unroll
        for (int i = 0; i < N; i++)
            if (lane + 32 * i < l) v[i] *= sc;
        C m = row_max(v, lane, l);
        C sum = 0;
#pragma unroll
        for (int i = 0; i < N; i++)
            if (lane + 32 * i < l) {
                v[i] = m_exp(v[i] - m);
                sum += v[i];
            }
        C inv = (C)1 / group_allreduce(sum, (C *)nullptr);
#pragma unroll
        for (int i = 0; i < N; i++) {
            int j = lane + 32 * i;
            if (j < s) yr[j] = store_as<T>(j < l ? v[i] * inv : (C)0);
        }
    }
}

void nb__cuda_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s,
                             double scale) {
    const char *op = "nb_softmax_causal";
    cudaStream_t st = nb__cuda_enter(op, y->device.index);
    if (b == 0 || t == 0 || s == 0) return;
    NB_CHECK(x->dtype == y->dtype, "%s: dtypes differ: y %s, x %s", op, nb_dtype_name(y->dtype),
             nb_dtype_name(x->dtype));
    by_float_dtype(op, x->dtype, [&](auto tg) {
        typedef typename decltype(tg)::type T;
        dim3 grid, block;
        row_config(b * t, s, &grid, &block);
        bool reg = reg_rows(s, [&](auto n) {
            causal_reg_kernel<T, decltype(n)::value><<<grid, block, 0, st>>>(
                (T *)y->data, (const T *)x->data, b * t, t, (int)s, scale);
        });
        if (!reg)
            causal_kernel<T><<<grid, block, 0, st>>>((T *)y->data, (const T *)x->data, b * t, t,
                                                     s, scale);
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

// the same, rows of S <= 32 * N with y and g in registers
template <class T, int N>
static __global__ void causal_backward_reg_kernel(T *dx, const T *y, const T *g, int64_t rows,
                                                  int64_t t, int s, double scale) {
    typedef math_t<T> C;
    const C sc = (C)scale;
    const int lane = threadIdx.x;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; row < rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const T *yr = y + row * s, *gr = g + row * s;
        T *dr = dx + row * s;
        int l = (int)kept(row, t, s);
        C yv[N], gv[N];
        load_row(yv, yr, lane, l, (C)0);
        load_row(gv, gr, lane, l, (C)0);
        C r = 0;
#pragma unroll
        for (int i = 0; i < N; i++)
            if (lane + 32 * i < l) r += gv[i] * yv[i];
        r = group_allreduce(r, (C *)nullptr);
#pragma unroll
        for (int i = 0; i < N; i++) {
            int j = lane + 32 * i;
            if (j < s) dr[j] = store_as<T>(j < l ? sc * yv[i] * (gv[i] - r) : (C)0);
        }
    }
}

void nb__cuda_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                      int64_t b, int64_t t, int64_t s, double scale) {
    const char *op = "nb_softmax_causal backward";
    cudaStream_t st = nb__cuda_enter(op, dx->device.index);
    if (b == 0 || t == 0 || s == 0) return;
    NB_CHECK(g->dtype == y->dtype && dx->dtype == y->dtype, "%s: dtypes differ: dx %s, y %s, g %s",
             op, nb_dtype_name(dx->dtype), nb_dtype_name(y->dtype), nb_dtype_name(g->dtype));
    by_float_dtype(op, y->dtype, [&](auto tg) {
        typedef typename decltype(tg)::type T;
        dim3 grid, block;
        row_config(b * t, s, &grid, &block);
        bool reg = reg_rows(s, [&](auto n) {
            causal_backward_reg_kernel<T, decltype(n)::value><<<grid, block, 0, st>>>(
                (T *)dx->data, (const T *)y->data, (const T *)g->data, b * t, t, (int)s, scale);
        });
        if (!reg)
            causal_backward_kernel<T><<<grid, block, 0, st>>>(
                (T *)dx->data, (const T *)y->data, (const T *)g->data, b * t, t, s, scale);
        NB_CUDA_CHECK_LAUNCH(op);
    });
}
