/* Layer norm forward and backward on CUDA (tensor/cpu/norm.c computes the
 * same function; Note there for the backward formulas).
 *
 * Forward and the dx part of backward: one warp per row, two passes for
 * the statistics (mean, then the mean of squared deviations, biased) as on
 * the CPU, rstd = 1 / sqrt(var + eps). Math in f32 for f32/bf16/f16 and in
 * f64 for f64. mean and rstd are written in their tensors' dtype: f32, or
 * f64 when x is f64 and the front end asks for f64 statistics (the f32
 * ones would cost f64 backward its precision).
 *
 * dw and db are column sums over the M rows, made deterministic without
 * atomics: the rows are cut into a fixed number of chunks; a block of
 * (32 columns x 8 row lanes) sums its chunk of rows for 32 columns, row
 * lanes combined in a fixed order, into a scratch array (chunks, D); a
 * second kernel adds the chunks of each column in increasing order. The
 * partition depends only on M, so results are bitwise reproducible.
 *
 * Letters: M rows, D elements per row. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

/* ------------------------------------------------------------------ helpers */
template <typename T> struct acc_type { typedef float type; };
template <> struct acc_type<double> { typedef double type; };

static __device__ __forceinline__ float to_acc(float x) { return x; }
static __device__ __forceinline__ double to_acc(double x) { return x; }
static __device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }

template <typename T>
static __device__ __forceinline__ T from_acc(typename acc_type<T>::type x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_acc<__half>(float x) {
    return __float2half_rn(x);
}

template <typename A> static __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static const int WARPS = 4;          /* rows per block, forward and dx */
static const int COL_TILE = 32;      /* dw/db: columns per block */
static const int ROW_LANES = 8;      /* dw/db: threads along the rows */
static const int MAX_CHUNKS = 512;   /* dw/db: row chunks (grid.y) */

/* ------------------------------------------------------------------ kernels */
// y, x (M, D); w, b (D) or NULL; mean, rstd (M)
template <typename T, typename S>
static __global__ void layer_norm_kernel(T *__restrict__ y, S *__restrict__ mean,
                                         S *__restrict__ rstd, const T *__restrict__ x,
                                         const T *__restrict__ w, const T *__restrict__ b,
                                         int64_t m, int64_t d, double eps) {
    typedef typename acc_type<T>::type A;
    int lane = threadIdx.x & 31;
    for (int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); row < m;
         row += (int64_t)gridDim.x * WARPS) {
        const T *xr = x + row * d;
        T *yr = y + row * d;
        A s = 0;
        for (int64_t j = lane; j < d; j += 32) s += to_acc(xr[j]);
        A mu = warp_sum(s) / (A)d;
        A v = 0;
        for (int64_t j = lane; j < d; j += 32) {
            A t = to_acc(xr[j]) - mu;
            v += t * t;
        }
        A r = (A)1 / sqrt(warp_sum(v) / (A)d + (A)eps);
        if (lane == 0) {
            mean[row] = (S)mu;
            rstd[row] = (S)r;
        }
        for (int64_t j = lane; j < d; j += 32) {
            A h = (to_acc(xr[j]) - mu) * r;
            if (w) h *= to_acc(w[j]);
            if (b) h += to_acc(b[j]);
            yr[j] = from_acc<T>(h);
        }
    }
}

// dx, g, x (M, D); w (D) or NULL
template <typename T, typename S>
static __global__ void layer_norm_dx_kernel(T *__restrict__ dx, const T *__restrict__ g,
                                            const T *__restrict__ x, const S *__restrict__ mean,
                                            const S *__restrict__ rstd, const T *__restrict__ w,
                                            int64_t m, int64_t d) {
    typedef typename acc_type<T>::type A;
    int lane = threadIdx.x & 31;
    for (int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); row < m;
         row += (int64_t)gridDim.x * WARPS) {
        const T *xr = x + row * d, *gr = g + row * d;
        T *dr = dx + row * d;
        A mu = (A)mean[row], r = (A)rstd[row], sa = 0, sb = 0;
        for (int64_t j = lane; j < d; j += 32) {
            A h = (to_acc(xr[j]) - mu) * r;
            A dh = to_acc(gr[j]) * (w ? to_acc(w[j]) : (A)1);
            sa += dh;
            sb += dh * h;
        }
        sa = warp_sum(sa) / (A)d;
        sb = warp_sum(sb) / (A)d;
        for (int64_t j = lane; j < d; j += 32) {
            A h = (to_acc(xr[j]) - mu) * r;
            A dh = to_acc(gr[j]) * (w ? to_acc(w[j]) : (A)1);
            dr[j] = from_acc<T>(r * (dh - sa - h * sb));
        }
    }
}

// pw, pb (chunks, D) = per chunk of rows: sum g xhat, sum g
// block (COL_TILE, ROW_LANES), grid (ceil(D / COL_TILE), chunks)
template <typename T, typename S>
static __global__ void layer_norm_dwdb_partial_kernel(
    typename acc_type<T>::type *__restrict__ pw, typename acc_type<T>::type *__restrict__ pb,
    const T *__restrict__ g, const T *__restrict__ x, const S *__restrict__ mean,
    const S *__restrict__ rstd, int64_t m, int64_t d, int64_t rows_per_chunk) {
    typedef typename acc_type<T>::type A;
    __shared__ A sw[ROW_LANES][COL_TILE + 1], sb[ROW_LANES][COL_TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * COL_TILE + tx;
    int64_t start = (int64_t)blockIdx.y * rows_per_chunk;
    int64_t end = start + rows_per_chunk < m ? start + rows_per_chunk : m;
    A aw = 0, ab = 0;
    if (col < d)
        for (int64_t row = start + ty; row < end; row += ROW_LANES) {
            A gv = to_acc(g[row * d + col]);
            A h = (to_acc(x[row * d + col]) - (A)mean[row]) * (A)rstd[row];
            aw += gv * h;
            ab += gv;
        }
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && col < d) {
        A tw = 0, tb = 0;
#pragma unroll
        for (int k = 0; k < ROW_LANES; k++) {
            tw += sw[k][tx];
            tb += sb[k][tx];
        }
        pw[blockIdx.y * d + col] = tw;
        pb[blockIdx.y * d + col] = tb;
    }
}

// dw, db (D) or NULL = sums of pw, pb (chunks, D) over the chunks, in order
template <typename T>
static __global__ void layer_norm_dwdb_final_kernel(
    T *__restrict__ dw, T *__restrict__ db, const typename acc_type<T>::type *__restrict__ pw,
    const typename acc_type<T>::type *__restrict__ pb, int64_t chunks, int64_t d) {
    typedef typename acc_type<T>::type A;
    for (int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; col < d;
         col += (int64_t)gridDim.x * blockDim.x) {
        A tw = 0, tb = 0;
        for (int64_t c = 0; c < chunks; c++) {
            tw += pw[c * d + col];
            tb += pb[c * d + col];
        }
        if (dw) dw[col] = from_acc<T>(tw);
        if (db) db[col] = from_acc<T>(tb);
    }
}

/* ---------------------------------------------------------------- launchers */
static unsigned row_grid(int64_t m) {
    int64_t b = (m + WARPS - 1) / WARPS;
    return (unsigned)(b < 65536 ? b : 65536);
}

static const void *data_or_null(const nb_tensor *t) { return t ? t->data : NULL; }

template <typename T, typename S>
static void launch_forward(cudaStream_t s, nb_tensor *y, nb_tensor *mean, nb_tensor *rstd,
                           const nb_tensor *x, const nb_tensor *w, const nb_tensor *b, int64_t m,
                           int64_t d, double eps) {
    layer_norm_kernel<T, S><<<row_grid(m), WARPS * 32, 0, s>>>(
        (T *)y->data, (S *)mean->data, (S *)rstd->data, (const T *)x->data,
        (const T *)data_or_null(w), (const T *)data_or_null(b), m, d, eps);
}

template <typename T, typename S>
static void launch_backward(cudaStream_t s, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                            const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                            const nb_tensor *rstd, const nb_tensor *w, int64_t m, int64_t d,
                            const char *op) {
    typedef typename acc_type<T>::type A;
    const S *mu = (const S *)mean->data, *r = (const S *)rstd->data;
    if (dx && m > 0) {
        layer_norm_dx_kernel<T, S><<<row_grid(m), WARPS * 32, 0, s>>>(
            (T *)dx->data, (const T *)g->data, (const T *)x->data, mu, r,
            (const T *)data_or_null(w), m, d);
        NB_CUDA_CHECK_LAUNCH(op);
    }
    if (!dw && !db) return;
    int64_t rows_per_chunk = (m + MAX_CHUNKS - 1) / MAX_CHUNKS;
    if (rows_per_chunk < 4 * ROW_LANES) rows_per_chunk = 4 * ROW_LANES;
    int64_t chunks = m > 0 ? (m + rows_per_chunk - 1) / rows_per_chunk : 1;
    nb_ctx *ctx = (dw ? dw : db)->ctx;
    A *pw = (A *)nb_ctx_alloc(ctx, 2 * (size_t)chunks * (size_t)d * sizeof(A), 0);
    A *pb = pw + chunks * d;
    if (m > 0) {
        dim3 grid((unsigned)((d + COL_TILE - 1) / COL_TILE), (unsigned)chunks);
        dim3 block(COL_TILE, ROW_LANES);
        layer_norm_dwdb_partial_kernel<T, S><<<grid, block, 0, s>>>(
            pw, pb, (const T *)g->data, (const T *)x->data, mu, r, m, d, rows_per_chunk);
        NB_CUDA_CHECK_LAUNCH(op);
    } else {
        NB_CUDA_CHECK(op, cudaMemsetAsync(pw, 0, 2 * (size_t)d * sizeof(A), s));
    }
    int64_t fb = (d + 255) / 256;
    layer_norm_dwdb_final_kernel<T><<<(unsigned)(fb < 65536 ? fb : 65536), 256, 0, s>>>(
        dw ? (T *)dw->data : NULL, db ? (T *)db->data : NULL, pw, pb, chunks, d);
    NB_CUDA_CHECK_LAUNCH(op);
}

/* ------------------------------------------------------------- entry points */
void nb__cuda_layer_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x,
                         const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d,
                         double eps) {
    const char *op = "nb_layer_norm";
    int dev = x->device.index;
    nb__cuda_use(op, dev);
    if (m == 0) return;
    cudaStream_t s = nb__cuda_compute_stream(dev);
    bool f64_stats = mean->dtype == NB_F64;
    NB_CHECK(mean->dtype == rstd->dtype &&
                 (mean->dtype == NB_F32 || (f64_stats && x->dtype == NB_F64)),
             "%s: statistics must be f32 (or f64 for f64 input), got %s for %s input", op,
             nb_dtype_name(mean->dtype), nb_dtype_name(x->dtype));
    switch (x->dtype) {
    case NB_F32: launch_forward<float, float>(s, y, mean, rstd, x, w, b, m, d, eps); break;
    case NB_F64:
        if (f64_stats) launch_forward<double, double>(s, y, mean, rstd, x, w, b, m, d, eps);
        else launch_forward<double, float>(s, y, mean, rstd, x, w, b, m, d, eps);
        break;
    case NB_BF16:
        launch_forward<__nv_bfloat16, float>(s, y, mean, rstd, x, w, b, m, d, eps);
        break;
    case NB_F16: launch_forward<__half, float>(s, y, mean, rstd, x, w, b, m, d, eps); break;
    default: NB_ABORT("%s: dtype %s is not a float type", op, nb_dtype_name(x->dtype));
    }
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_layer_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                  const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                  const nb_tensor *rstd, const nb_tensor *w, int64_t m,
                                  int64_t d) {
    const char *op = "nb_layer_norm (backward)";
    int dev = x->device.index;
    nb__cuda_use(op, dev);
    if (d == 0 || (!dx && !dw && !db)) return;
    cudaStream_t s = nb__cuda_compute_stream(dev);
    bool f64_stats = mean->dtype == NB_F64;
    switch (x->dtype) {
    case NB_F32:
        launch_backward<float, float>(s, dx, dw, db, g, x, mean, rstd, w, m, d, op);
        break;
    case NB_F64:
        if (f64_stats)
            launch_backward<double, double>(s, dx, dw, db, g, x, mean, rstd, w, m, d, op);
        else
            launch_backward<double, float>(s, dx, dw, db, g, x, mean, rstd, w, m, d, op);
        break;
    case NB_BF16:
        launch_backward<__nv_bfloat16, float>(s, dx, dw, db, g, x, mean, rstd, w, m, d, op);
        break;
    case NB_F16:
        launch_backward<__half, float>(s, dx, dw, db, g, x, mean, rstd, w, m, d, op);
        break;
    default: NB_ABORT("%s: dtype %s is not a float type", op, nb_dtype_name(x->dtype));
    }
}
