/* Batch norm on CUDA (cuda.h, "batch norm"), with the semantics of
 * tensor/cpu/norm.c and tensor/ops_norm.c. x is seen as (N, C, S);
 * statistics per channel over N and S, M = N * S of them.
 *
 * Our own kernels, not cuDNN's: cuDNN 9 deprecates its batch-norm API, it
 * would keep f64 statistics for f64 input (cuda.h saves f32) and needs
 * contiguous running statistics of the parameter dtype. The statistics are
 * computed as on the CPU, in f64 with two passes (mean, then the mean of
 * squared deviations), by blocks that each reduce a fixed slice of one
 * channel, then one thread per channel that sums the slices in order:
 * deterministic, and accurate when |mean| >> std. The same per-channel
 * step updates the running statistics (any stride, f32 or f64) and folds
 * weight and bias into a scale and shift for the elementwise pass.
 *
 * Backward: sg = sum g and sgh = sum g (x - mean) invstd per channel (same
 * slices), then dx = w invstd (g - sg/M - xhat sgh/M) in training and
 * w invstd g in eval (mean and invstd constants), as on the CPU. */
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

#define OP "nb_batch_norm"
#define THREADS 256

template <typename T> struct acc_of { typedef float type; };
template <> struct acc_of<double> { typedef double type; };

static __device__ __forceinline__ float to_acc(float x) { return x; }
static __device__ __forceinline__ double to_acc(double x) { return x; }
static __device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
static __device__ __forceinline__ void put(float *p, float v) { *p = v; }
static __device__ __forceinline__ void put(double *p, double v) { *p = v; }
static __device__ __forceinline__ void put(__nv_bfloat16 *p, float v) { *p = __float2bfloat16(v); }
static __device__ __forceinline__ void put(__half *p, float v) { *p = __float2half(v); }

/* Element i (stride st) of a vector of dtype dt (any float dtype), as double. */
static __device__ __forceinline__ double load_vec(const void *p, int dt, int64_t i, int64_t st) {
    switch (dt) {
    case NB_F64: return ((const double *)p)[i * st];
    case NB_BF16: return (double)__bfloat162float(((const __nv_bfloat16 *)p)[i * st]);
    case NB_F16: return (double)__half2float(((const __half *)p)[i * st]);
    default: return (double)((const float *)p)[i * st];
    }
}
static __device__ __forceinline__ void store_vec(void *p, int dt, int64_t i, int64_t st, double v) {
    switch (dt) {
    case NB_F64: ((double *)p)[i * st] = v; break;
    case NB_BF16: ((__nv_bfloat16 *)p)[i * st] = __float2bfloat16((float)v); break;
    case NB_F16: ((__half *)p)[i * st] = __float2half((float)v); break;
    default: ((float *)p)[i * st] = (float)v; break;
    }
}

/* Per-channel coefficients of the elementwise passes. */
typedef struct coef {
    double mean, invstd, k1, mg, mgh; /* backward: dx = k1 (g - mg - xhat mgh) */
} coef;

/* ------------------------------------------------------------- kernels */
/* Block-wide sums of a and b (THREADS threads); the result is in a[0], b[0]. */
static __device__ void block_sum2(double *sa, double *sb, double a, double b) {
    sa[threadIdx.x] = a;
    sb[threadIdx.x] = b;
    __syncthreads();
    for (int w = THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) {
            sa[threadIdx.x] += sa[threadIdx.x + w];
            sb[threadIdx.x] += sb[threadIdx.x + w];
        }
        __syncthreads();
    }
}

/* part (C, splits): block (ch, sp) sums, over its slice [lo, hi) of the
 * channel's M values, x (mean NULL) or (x - mean[ch])^2. */
template <typename T>
static __global__ void stats_partial_kernel(double *part, const T *x, const double *mean, int64_t n,
                                            int64_t c, int64_t s, int64_t chunk) {
    __shared__ double sa[THREADS], sb[THREADS];
    int64_t ch = blockIdx.x, sp = blockIdx.y, m = n * s;
    int64_t lo = sp * chunk, hi = lo + chunk < m ? lo + chunk : m;
    double mu = mean ? mean[ch] : 0, acc = 0;
    for (int64_t j = lo + threadIdx.x; j < hi; j += THREADS) {
        double v = (double)to_acc(x[((j / s) * c + ch) * s + j % s]);
        acc += mean ? (v - mu) * (v - mu) : v;
    }
    block_sum2(sa, sb, acc, 0);
    if (threadIdx.x == 0) part[ch * gridDim.y + sp] = sa[0];
}

/* part_g, part_gh (C, splits): sums of g and g (x - mean) over the slice. */
template <typename T>
static __global__ void grad_partial_kernel(double *part_g, double *part_gh, const T *g, const T *x,
                                           const float *mean, int64_t n, int64_t c, int64_t s,
                                           int64_t chunk) {
    __shared__ double sa[THREADS], sb[THREADS];
    int64_t ch = blockIdx.x, sp = blockIdx.y, m = n * s;
    int64_t lo = sp * chunk, hi = lo + chunk < m ? lo + chunk : m;
    double mu = mean[ch], ag = 0, agh = 0;
    for (int64_t j = lo + threadIdx.x; j < hi; j += THREADS) {
        int64_t e = ((j / s) * c + ch) * s + j % s;
        double gv = (double)to_acc(g[e]);
        ag += gv;
        agh += gv * ((double)to_acc(x[e]) - mu);
    }
    block_sum2(sa, sb, ag, agh);
    if (threadIdx.x == 0) {
        part_g[ch * gridDim.y + sp] = sa[0];
        part_gh[ch * gridDim.y + sp] = sb[0];
    }
}

static __device__ __forceinline__ double sum_parts(const double *part, int64_t ch, int64_t splits) {
    double t = 0;
    for (int64_t i = 0; i < splits; i++) t += part[ch * splits + i];
    return t;
}

static __global__ void mean_kernel(double *mean, const double *part, int64_t c, int64_t splits,
                                   double cnt) {
    for (int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; ch < c;
         ch += (int64_t)gridDim.x * blockDim.x)
        mean[ch] = sum_parts(part, ch, splits) / cnt;
}

typedef struct bn_params {
    int64_t c;
    const void *w, *b; /* (C) of dtype wdt, or NULL */
    int wdt;
    void *rmean, *rvar; /* running statistics or NULL */
    int rmdt, rvdt;
    int64_t rmst, rvst;
    float *save_mean, *save_invstd;
    double momentum, eps;
} bn_params;

/* Per channel, training: var from part, saves, running update, scale and
 * shift (sc[ch], sh[ch]). Eval (part NULL): from the running statistics. */
static __global__ void channel_kernel(double *sc, double *sh, const double *mean,
                                      const double *part, int64_t splits, double cnt,
                                      bn_params p) {
    for (int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; ch < p.c;
         ch += (int64_t)gridDim.x * blockDim.x) {
        double mu, invstd;
        if (part) {
            mu = mean[ch];
            double var = sum_parts(part, ch, splits) / cnt;
            if (p.rmean) {
                double rm = load_vec(p.rmean, p.rmdt, ch, p.rmst);
                double rv = load_vec(p.rvar, p.rvdt, ch, p.rvst);
                store_vec(p.rmean, p.rmdt, ch, p.rmst, (1 - p.momentum) * rm + p.momentum * mu);
                store_vec(p.rvar, p.rvdt, ch, p.rvst,
                          (1 - p.momentum) * rv + p.momentum * var * (cnt / (cnt - 1)));
            }
            invstd = 1.0 / sqrt(var + p.eps);
        } else {
            mu = load_vec(p.rmean, p.rmdt, ch, p.rmst);
            invstd = 1.0 / sqrt(load_vec(p.rvar, p.rvdt, ch, p.rvst) + p.eps);
        }
        p.save_mean[ch] = (float)mu;
        p.save_invstd[ch] = (float)invstd;
        double s = invstd * (p.w ? load_vec(p.w, p.wdt, ch, 1) : 1.0);
        sc[ch] = s;
        sh[ch] = (p.b ? load_vec(p.b, p.wdt, ch, 1) : 0.0) - mu * s;
    }
}

/* y = x sc[ch] + sh[ch] over (N, C, S) */
template <typename T>
static __global__ void apply_kernel(T *y, const T *x, const double *sc, const double *sh,
                                    int64_t total, int64_t c, int64_t s) {
    typedef typename acc_of<T>::type A;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t ch = (i / s) % c;
        put(&y[i], to_acc(x[i]) * (A)sc[ch] + (A)sh[ch]);
    }
}

/* Per channel, backward: dw, db (NULL or of dtype wdt) and dx's coefficients. */
static __global__ void grad_channel_kernel(coef *cf, void *dw, void *db, int wdt,
                                           const double *part_g, const double *part_gh,
                                           int64_t splits, const float *mean, const float *invstd,
                                           const void *w, bool training, int64_t c, double cnt) {
    for (int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; ch < c;
         ch += (int64_t)gridDim.x * blockDim.x) {
        double r = invstd[ch], sg = sum_parts(part_g, ch, splits);
        double sgh = sum_parts(part_gh, ch, splits) * r;
        if (dw) store_vec(dw, wdt, ch, 1, sgh);
        if (db) store_vec(db, wdt, ch, 1, sg);
        coef k;
        k.mean = mean[ch];
        k.invstd = r;
        k.k1 = (w ? load_vec(w, wdt, ch, 1) : 1.0) * r;
        k.mg = training ? sg / cnt : 0;
        k.mgh = training ? sgh / cnt : 0;
        cf[ch] = k;
    }
}

/* dx = k1 (g - mg - (x - mean) invstd mgh) over (N, C, S) */
template <typename T>
static __global__ void dx_kernel(T *dx, const T *g, const T *x, const coef *cf, int64_t total,
                                 int64_t c, int64_t s) {
    typedef typename acc_of<T>::type A;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        coef k = cf[(i / s) % c];
        A h = (to_acc(x[i]) - (A)k.mean) * (A)k.invstd;
        put(&dx[i], (A)k.k1 * (to_acc(g[i]) - (A)k.mg - h * (A)k.mgh));
    }
}

/* ----------------------------------------------------------- launchers */
static unsigned blocks_for(int64_t total) {
    int64_t b = (total + THREADS - 1) / THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65536 ? 65536 : b);
}

/* Slices per channel: enough blocks to fill the device, slices of at
 * least 4096 values; fixed by the shape, so results are reproducible. */
static int64_t splits_for(int64_t c, int64_t m, int64_t *chunk) {
    int64_t by_size = (m + 4095) / 4096, want = (1024 + c - 1) / c;
    int64_t sp = by_size < want ? by_size : want;
    if (sp < 1) sp = 1;
    if (sp > 65535) sp = 65535;
    *chunk = (m + sp - 1) / sp;
    return (m + *chunk - 1) / *chunk;
}

template <typename T>
static void stats_launch(cudaStream_t st, double *part, const void *x, const double *mean,
                         int64_t n, int64_t c, int64_t s, int64_t splits, int64_t chunk) {
    dim3 grid((unsigned)c, (unsigned)splits);
    stats_partial_kernel<T><<<grid, THREADS, 0, st>>>(part, (const T *)x, mean, n, c, s, chunk);
    NB_CUDA_CHECK_LAUNCH(OP);
}

template <typename T>
static void apply_launch(cudaStream_t st, void *y, const void *x, const double *sc,
                         const double *sh, int64_t total, int64_t c, int64_t s) {
    apply_kernel<T><<<blocks_for(total), THREADS, 0, st>>>((T *)y, (const T *)x, sc, sh, total, c,
                                                           s);
    NB_CUDA_CHECK_LAUNCH(OP);
}

template <typename T>
static void grad_partial_launch(cudaStream_t st, double *pg, double *pgh, const void *g,
                                const void *x, const float *mean, int64_t n, int64_t c, int64_t s,
                                int64_t splits, int64_t chunk) {
    dim3 grid((unsigned)c, (unsigned)splits);
    grad_partial_kernel<T><<<grid, THREADS, 0, st>>>(pg, pgh, (const T *)g, (const T *)x, mean, n,
                                                     c, s, chunk);
    NB_CUDA_CHECK_LAUNCH(OP);
}

template <typename T>
static void dx_launch(cudaStream_t st, void *dx, const void *g, const void *x, const coef *cf,
                      int64_t total, int64_t c, int64_t s) {
    dx_kernel<T><<<blocks_for(total), THREADS, 0, st>>>((T *)dx, (const T *)g, (const T *)x, cf,
                                                        total, c, s);
    NB_CUDA_CHECK_LAUNCH(OP);
}

#define DISPATCH(dt, launch, ...)                                                              \
    switch (dt) {                                                                              \
    case NB_F32: launch<float>(__VA_ARGS__); break;                                            \
    case NB_F64: launch<double>(__VA_ARGS__); break;                                           \
    case NB_BF16: launch<__nv_bfloat16>(__VA_ARGS__); break;                                   \
    case NB_F16: launch<__half>(__VA_ARGS__); break;                                           \
    default: NB_ABORT("%s: unsupported dtype %s", OP, nb_dtype_name(dt));                      \
    }

static void check_float(const char *what, const nb_tensor *t) {
    if (t && t->dtype != NB_F32 && t->dtype != NB_F64 && t->dtype != NB_BF16 && t->dtype != NB_F16)
        NB_ABORT("%s: %s must be a float tensor, got %s", OP, what, nb_dtype_name(t->dtype));
}

/* --------------------------------------------------------- entry points */
extern "C" void nb__cuda_batch_norm(nb_tensor *y, nb_tensor *save_mean, nb_tensor *save_invstd,
                                    const nb_tensor *x, const nb_tensor *weight,
                                    const nb_tensor *bias, nb_tensor *running_mean,
                                    nb_tensor *running_var, bool training, double momentum,
                                    double eps, int64_t n, int64_t c, int64_t s) {
    int dev = y->device.index;
    nb__cuda_use(OP, dev);
    if (c == 0) return;
    check_float("weight", weight);
    check_float("bias", bias);
    check_float("running_mean", running_mean);
    check_float("running_var", running_var);
    if (weight && bias && weight->dtype != bias->dtype)
        NB_ABORT("%s: weight (%s) and bias (%s) differ in dtype", OP, nb_dtype_name(weight->dtype),
                 nb_dtype_name(bias->dtype));
    if (save_mean->dtype != NB_F32 || save_invstd->dtype != NB_F32)
        NB_ABORT("%s: the saved statistics must be f32", OP);
    cudaStream_t st = nb__cuda_compute_stream(dev);
    int64_t m = n * s, total = m * c;

    bn_params p;
    p.c = c;
    p.w = weight ? weight->data : NULL;
    p.b = bias ? bias->data : NULL;
    p.wdt = weight ? weight->dtype : bias ? bias->dtype : NB_F32;
    p.rmean = running_mean ? running_mean->data : NULL;
    p.rvar = running_var ? running_var->data : NULL;
    p.rmdt = running_mean ? running_mean->dtype : NB_F32;
    p.rvdt = running_var ? running_var->dtype : NB_F32;
    p.rmst = running_mean ? running_mean->strides[0] : 0;
    p.rvst = running_var ? running_var->strides[0] : 0;
    p.save_mean = (float *)save_mean->data;
    p.save_invstd = (float *)save_invstd->data;
    p.momentum = momentum;
    p.eps = eps;

    double *sc = (double *)nb_ctx_alloc(y->ctx, sizeof(double) * (size_t)(2 * c), 0);
    double *sh = sc + c;
    if (training) {
        if (m == 0) NB_ABORT("%s: training needs values in every channel", OP);
        if (!running_mean != !running_var)
            NB_ABORT("%s: running_mean and running_var must both be given or both be NULL", OP);
        int64_t chunk, splits = splits_for(c, m, &chunk);
        double *part = (double *)nb_ctx_alloc(y->ctx, sizeof(double) * (size_t)(c * splits + c), 0);
        double *mean = part + c * splits;
        DISPATCH(x->dtype, stats_launch, st, part, x->data, (const double *)NULL, n, c, s, splits,
                 chunk);
        mean_kernel<<<blocks_for(c), THREADS, 0, st>>>(mean, part, c, splits, (double)m);
        NB_CUDA_CHECK_LAUNCH(OP);
        DISPATCH(x->dtype, stats_launch, st, part, x->data, (const double *)mean, n, c, s, splits,
                 chunk);
        channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(sc, sh, mean, part, splits, (double)m, p);
    } else {
        if (!running_mean || !running_var)
            NB_ABORT("%s: eval mode needs running_mean and running_var", OP);
        channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(sc, sh, NULL, NULL, 0, (double)m, p);
    }
    NB_CUDA_CHECK_LAUNCH(OP);
    if (total > 0) DISPATCH(x->dtype, apply_launch, st, y->data, x->data, sc, sh, total, c, s);
}

extern "C" void nb__cuda_batch_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                             const nb_tensor *g, const nb_tensor *x,
                                             const nb_tensor *mean, const nb_tensor *invstd,
                                             const nb_tensor *weight, bool training, int64_t n,
                                             int64_t c, int64_t s) {
    int dev = g->device.index;
    nb__cuda_use(OP, dev);
    nb_tensor *out = dx ? dx : dw ? dw : db;
    if (!out || c == 0) return;
    check_float("weight", weight);
    check_float("dw", dw);
    check_float("db", db);
    if (mean->dtype != NB_F32 || invstd->dtype != NB_F32)
        NB_ABORT("%s: the saved statistics must be f32", OP);
    int wdt = weight ? weight->dtype : dw ? dw->dtype : db ? db->dtype : NB_F32;
    if ((dw && dw->dtype != wdt) || (db && db->dtype != wdt))
        NB_ABORT("%s: dw, db and weight differ in dtype", OP);
    cudaStream_t st = nb__cuda_compute_stream(dev);
    int64_t m = n * s, total = m * c;
    int64_t chunk = 1, splits = 1;
    if (m > 0) splits = splits_for(c, m, &chunk);
    double *part = (double *)nb_ctx_alloc(out->ctx, sizeof(double) * (size_t)(2 * c * splits), 0);
    coef *cf = (coef *)nb_ctx_alloc(out->ctx, sizeof(coef) * (size_t)c, 0);
    if (m > 0) {
        DISPATCH(x->dtype, grad_partial_launch, st, part, part + c * splits, g->data, x->data,
                 (const float *)mean->data, n, c, s, splits, chunk);
    } else {
        NB_CUDA_CHECK(OP, cudaMemsetAsync(part, 0, sizeof(double) * (size_t)(2 * c * splits), st));
    }
    grad_channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(
        cf, dw ? dw->data : NULL, db ? db->data : NULL, wdt, part, part + c * splits, splits,
        (const float *)mean->data, (const float *)invstd->data, weight ? weight->data : NULL,
        training, c, (double)m);
    NB_CUDA_CHECK_LAUNCH(OP);
    if (dx && total > 0)
        DISPATCH(x->dtype, dx_launch, st, dx->data, g->data, x->data, (const coef *)cf, total, c, s);
}
