/* Batch norm on CUDA (cuda.h, "batch norm"), with the semantics of
 * tensor/cpu/norm.c and tensor/ops_norm.c. x is seen as (N, C, S);
 * statistics per channel over N and S, M = N * S of them. Two
 * implementations: cuDNN's and our own kernels (Note [Batch norm: cuDNN or
 * our kernels] says which runs when).
 *
 * Our kernels compute the statistics as on the CPU, in f64 with two passes
 * (mean, then the mean of squared deviations), by blocks that each reduce a
 * fixed slice of one channel, then one thread per channel that sums the
 * slices in order: deterministic, and accurate when |mean| >> std. The same
 * per-channel step updates the running statistics (any stride, f32 or f64)
 * and folds weight and bias into a scale and shift for the elementwise
 * pass. Backward: sg = sum g and sgh = sum g (x - mean) invstd per channel
 * (same slices), then dx = w invstd (g - sg/M - xhat sgh/M) in training and
 * w invstd g in eval (mean and invstd constants), as on the CPU.
 *
 * Note [Batch norm: cuDNN or our kernels]
 * Training forward, eval forward and training backward go through cuDNN's
 * batch-norm functions (cudnnBatchNormalizationForwardTraining,
 * ...ForwardInference, cudnnBatchNormalizationBackward; SPATIAL mode, x as
 * an NCHW tensor (N, C, S, 1)) whenever they can give our contract:
 * - cuDNN keeps its per-channel tensors (scale, bias, running and saved
 *   statistics) in the "parameter dtype": f64 for f64 x, f32 otherwise. The
 *   saved statistics are allocated so (cuda.h); weight and bias of another
 *   dtype (the front end passes x's, so bf16/f16) are converted into f32
 *   scratch, and NULL ones become ones and zeros; dw, db of another dtype,
 *   or NULL, are computed into scratch first (dx NULL too: cuDNN always
 *   writes dx).
 * - Running statistics are updated by cuDNN in place, so they must be
 *   contiguous and of the parameter dtype; otherwise (a strided view, f64
 *   buffers for f32 x, ...) the whole forward runs on our kernels. cuDNN's
 *   factor multiplies the new statistic, as our momentum does, and its
 *   running variance is the unbiased (sample) one, as ours
 *   (test_batch_norm_running_stats compares both paths with the CPU); its
 *   saved "inverse variance" is 1/sqrt(biased var + eps), our invstd.
 * - Sizes: N, C, S >= 1 and N C S within int (cuDNN's descriptors); N at
 *   most 880801 in training and 65535 in eval (larger batches have been
 *   reported to fail with CUDNN_STATUS_NOT_SUPPORTED); eps >=
 *   CUDNN_BN_MIN_EPSILON; bf16 on compute capability 8.0 or newer only.
 * - Eval forward through cuDNN still writes save_mean and save_invstd
 *   (mean and 1/sqrt(running var + eps)) with our per-channel kernel, for
 *   the eval backward, which is always ours: cuDNN's backward
 *   differentiates through batch statistics that eval does not use.
 * Forward and backward choose independently; both paths save the same
 * quantities, so either backward works after either forward. cuDNN's
 * kernels are the library's tuned ones; ours cover every case above, with
 * f64 two-pass statistics. cuDNN 9 marks this API deprecated (warnings only
 * with CUDNN_WARN_DEPRECATED defined) but still ships and supports it.
 * nb__cuda_batch_norm_set_cudnn(false), or NABLA_CUDA_BN=own in the
 * environment, turns cuDNN off, so that the tests run every case through
 * both paths. */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

#define OP "nb_batch_norm"
#define THREADS 256
/* Batch sizes beyond which cuDNN's spatial kernels are not used (Note). */
#define CUDNN_MAX_N_TRAIN 880801
#define CUDNN_MAX_N_EVAL 65535

/* Element i (stride st) of a vector of dtype dt (any float dtype), as double. */
static __device__ __forceinline__ double load_vec(const void *p, int dt, int64_t i, int64_t st) {
    return load_f64(p, i * st, dt);
}
static __device__ __forceinline__ void store_vec(void *p, int dt, int64_t i, int64_t st, double v) {
    store_f64(p, i * st, dt, v);
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
        double v = (double)to_math(x[((j / s) * c + ch) * s + j % s]);
        acc += mean ? (v - mu) * (v - mu) : v;
    }
    block_sum2(sa, sb, acc, 0);
    if (threadIdx.x == 0) part[ch * gridDim.y + sp] = sa[0];
}

/* part_g, part_gh (C, splits): sums of g and g (x - mean) over the slice;
 * mean of dtype sdt. */
template <typename T>
static __global__ void grad_partial_kernel(double *part_g, double *part_gh, const T *g, const T *x,
                                           const void *mean, int sdt, int64_t n, int64_t c,
                                           int64_t s, int64_t chunk) {
    __shared__ double sa[THREADS], sb[THREADS];
    int64_t ch = blockIdx.x, sp = blockIdx.y, m = n * s;
    int64_t lo = sp * chunk, hi = lo + chunk < m ? lo + chunk : m;
    double mu = load_vec(mean, sdt, ch, 1), ag = 0, agh = 0;
    for (int64_t j = lo + threadIdx.x; j < hi; j += THREADS) {
        int64_t e = ((j / s) * c + ch) * s + j % s;
        double gv = (double)to_math(g[e]);
        ag += gv;
        agh += gv * ((double)to_math(x[e]) - mu);
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
    void *save_mean, *save_invstd; /* (C) of dtype sdt */
    int sdt;
    double momentum, eps;
} bn_params;

/* Per channel, training: var from part, saves, running update, scale and
 * shift (sc[ch], sh[ch]). Eval (part NULL): from the running statistics.
 * sc NULL: the saves only. */
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
        store_vec(p.save_mean, p.sdt, ch, 1, mu);
        store_vec(p.save_invstd, p.sdt, ch, 1, invstd);
        if (!sc) continue;
        double s = invstd * (p.w ? load_vec(p.w, p.wdt, ch, 1) : 1.0);
        sc[ch] = s;
        sh[ch] = (p.b ? load_vec(p.b, p.wdt, ch, 1) : 0.0) - mu * s;
    }
}

/* y = x sc[ch] + sh[ch] over (N, C, S) */
template <typename T>
static __global__ void apply_kernel(T *y, const T *x, const double *sc, const double *sh,
                                    int64_t total, int64_t c, int64_t s) {
    typedef math_t<T> A;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t ch = (i / s) % c;
        put(&y[i], to_math(x[i]) * (A)sc[ch] + (A)sh[ch]);
    }
}

/* Per channel, backward: dw, db (NULL or of dtype wdt) and dx's
 * coefficients; mean, invstd of dtype sdt. */
static __global__ void grad_channel_kernel(coef *cf, void *dw, void *db, int wdt,
                                           const double *part_g, const double *part_gh,
                                           int64_t splits, const void *mean, const void *invstd,
                                           int sdt, const void *w, bool training, int64_t c,
                                           double cnt) {
    for (int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; ch < c;
         ch += (int64_t)gridDim.x * blockDim.x) {
        double r = load_vec(invstd, sdt, ch, 1), sg = sum_parts(part_g, ch, splits);
        double sgh = sum_parts(part_gh, ch, splits) * r;
        if (dw) store_vec(dw, wdt, ch, 1, sgh);
        if (db) store_vec(db, wdt, ch, 1, sg);
        coef k;
        k.mean = load_vec(mean, sdt, ch, 1);
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
    typedef math_t<T> A;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        coef k = cf[(i / s) % c];
        A h = (to_math(x[i]) - (A)k.mean) * (A)k.invstd;
        put(&dx[i], (A)k.k1 * (to_math(g[i]) - (A)k.mg - h * (A)k.mgh));
    }
}

/* dst (C, dtype ddt) = src (C, dtype sdt), or `fill` everywhere when src
 * is NULL: cuDNN's per-channel tensors from ours and back. */
static __global__ void vec_convert_kernel(void *dst, int ddt, const void *src, int sdt, int64_t c,
                                          double fill) {
    for (int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; ch < c;
         ch += (int64_t)gridDim.x * blockDim.x)
        store_vec(dst, ddt, ch, 1, src ? load_vec(src, sdt, ch, 1) : fill);
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
                                const void *x, const void *mean, int sdt, int64_t n, int64_t c,
                                int64_t s, int64_t splits, int64_t chunk) {
    dim3 grid((unsigned)c, (unsigned)splits);
    grad_partial_kernel<T><<<grid, THREADS, 0, st>>>(pg, pgh, (const T *)g, (const T *)x, mean,
                                                     sdt, n, c, s, chunk);
    NB_CUDA_CHECK_LAUNCH(OP);
}

template <typename T>
static void dx_launch(cudaStream_t st, void *dx, const void *g, const void *x, const coef *cf,
                      int64_t total, int64_t c, int64_t s) {
    dx_kernel<T><<<blocks_for(total), THREADS, 0, st>>>((T *)dx, (const T *)g, (const T *)x, cf,
                                                        total, c, s);
    NB_CUDA_CHECK_LAUNCH(OP);
}

static void vec_convert(cudaStream_t st, void *dst, nb_dtype ddt, const void *src, nb_dtype sdt,
                        int64_t c, double fill) {
    vec_convert_kernel<<<blocks_for(c), THREADS, 0, st>>>(dst, ddt, src, sdt, c, fill);
    NB_CUDA_CHECK_LAUNCH(OP);
}

static void check_float(const char *what, const nb_tensor *t) {
    if (t && t->dtype != NB_F32 && t->dtype != NB_F64 && t->dtype != NB_BF16 && t->dtype != NB_F16)
        NB_ABORT("%s: %s must be a float tensor, got %s", OP, what, nb_dtype_name(t->dtype));
}

/* The dtype of the saved statistics, and of cuDNN's per-channel tensors. */
static nb_dtype stat_dtype(nb_dtype x) { return x == NB_F64 ? NB_F64 : NB_F32; }

static void check_saved(const nb_tensor *x, const nb_tensor *mean, const nb_tensor *invstd) {
    nb_dtype sdt = stat_dtype(x->dtype);
    if (mean->dtype != sdt || invstd->dtype != sdt)
        NB_ABORT("%s: the saved statistics must be %s for %s input, got %s and %s", OP,
                 nb_dtype_name(sdt), nb_dtype_name(x->dtype), nb_dtype_name(mean->dtype),
                 nb_dtype_name(invstd->dtype));
}

/* ------------------------------------------------------- path selection */
static int cudnn_setting = -1; /* -1: not read yet; 0: our kernels only; 1: cuDNN where it can */
static int64_t cudnn_fwd_calls, cudnn_bwd_calls;

static bool cudnn_on(void) {
    int v = __atomic_load_n(&cudnn_setting, __ATOMIC_RELAXED);
    if (v >= 0) return v != 0;
    const char *e = getenv("NABLA_CUDA_BN");
    if (!e || !*e || strcmp(e, "cudnn") == 0) v = 1;
    else if (strcmp(e, "own") == 0) v = 0;
    else NB_ABORT("%s: NABLA_CUDA_BN must be \"cudnn\" or \"own\", got \"%s\"", OP, e);
    int unset = -1; /* a concurrent setter wins */
    __atomic_compare_exchange_n(&cudnn_setting, &unset, v, false, __ATOMIC_RELAXED,
                                __ATOMIC_RELAXED);
    return __atomic_load_n(&cudnn_setting, __ATOMIC_RELAXED) != 0;
}

/* Compute capability major version of a device, queried once. */
static int cc_major(int dev) {
    static int cache[64]; /* 0: not queried yet */
    int v = dev >= 0 && dev < 64 ? __atomic_load_n(&cache[dev], __ATOMIC_RELAXED) : 0;
    if (v > 0) return v;
    NB_CUDA_CHECK(OP, cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev));
    if (dev >= 0 && dev < 64) __atomic_store_n(&cache[dev], v, __ATOMIC_RELAXED);
    return v;
}

static bool strided_or_other(const nb_tensor *t, nb_dtype pdt, int64_t c) {
    return t && (t->dtype != pdt || (c > 1 && t->strides[0] != 1));
}

/* Note [Batch norm: cuDNN or our kernels]: true when cuDNN can do this
 * call. Backward asks with no running statistics and training true. */
static bool use_cudnn(int dev, nb_dtype xdt, const nb_tensor *rm, const nb_tensor *rv,
                      bool training, double eps, int64_t n, int64_t c, int64_t s) {
    if (!cudnn_on()) return false;
    if (xdt != NB_F32 && xdt != NB_F64 && xdt != NB_F16 && xdt != NB_BF16) return false;
    if (xdt == NB_BF16 && cc_major(dev) < 8) return false;
    if (!(eps >= CUDNN_BN_MIN_EPSILON)) return false;
    if (n < 1 || c < 1 || s < 1 || n > (training ? CUDNN_MAX_N_TRAIN : CUDNN_MAX_N_EVAL) ||
        c > INT_MAX || s > INT_MAX || c * s > INT_MAX / n)
        return false;
    nb_dtype pdt = stat_dtype(xdt);
    return !strided_or_other(rm, pdt, c) && !strided_or_other(rv, pdt, c);
}

/* ------------------------------------------------------------- cuDNN path */
static cudnnDataType_t cudnn_type(nb_dtype dt) { return nb__cudnn_dtype(OP, dt); }

/* x as (N, C, S, 1) and the per-channel tensors as (1, C, 1, 1) of the
 * parameter dtype, set explicitly as the batch-norm functions document it
 * (double for double x, else float, bf16 included) rather than derived.
 * alpha = 1 and beta = 0 of the scaling type cuDNN reads for x's dtype
 * (double for f64, else float); with beta = 0 cuDNN does not read the
 * outputs (they may hold anything, NaN poison included). */
typedef struct dnn_call {
    cudnnHandle_t h;
    cudnnTensorDescriptor_t xd, pd;
    float one_f, zero_f;
    double one_d, zero_d;
    const void *one, *zero;
} dnn_call;

/* The device's cuDNN lock (Note [cuDNN workspace] in runtime.cu) is held
 * from dnn_begin to dnn_end: one thread at a time may use a cuDNN handle.
 * Every check made under it releases it before aborting (DNN_CHECK), as in
 * conv.cu (Note [Aborts under the plan lock]); nothing else that can abort
 * runs under it. */
static int dnn_locked_dev = -1; /* guarded by that lock */

static cudnnStatus_t dnn_unlock_on_failure(cudnnStatus_t st) {
    if (st != CUDNN_STATUS_SUCCESS) {
        int dev = dnn_locked_dev;
        dnn_locked_dev = -1;
        nb__cuda_cudnn_unlock(dev);
    }
    return st;
}
#define DNN_CHECK(call) NB_CUDNN_CHECK(OP, dnn_unlock_on_failure(call))

static void dnn_begin(dnn_call *d, int dev, nb_dtype xdt, int64_t n, int64_t c, int64_t s) {
    d->h = (cudnnHandle_t)nb__cuda_cudnn_lock(dev);
    dnn_locked_dev = dev;
    d->one_f = 1.0f;
    d->zero_f = 0.0f;
    d->one_d = 1.0;
    d->zero_d = 0.0;
    d->one = xdt == NB_F64 ? (const void *)&d->one_d : (const void *)&d->one_f;
    d->zero = xdt == NB_F64 ? (const void *)&d->zero_d : (const void *)&d->zero_f;
    DNN_CHECK(cudnnCreateTensorDescriptor(&d->xd));
    DNN_CHECK(cudnnCreateTensorDescriptor(&d->pd));
    DNN_CHECK(cudnnSetTensor4dDescriptor(d->xd, CUDNN_TENSOR_NCHW, cudnn_type(xdt), (int)n,
                                         (int)c, (int)s, 1));
    DNN_CHECK(cudnnSetTensor4dDescriptor(d->pd, CUDNN_TENSOR_NCHW, cudnn_type(stat_dtype(xdt)),
                                         1, (int)c, 1, 1));
}

static void dnn_end(dnn_call *d) {
    DNN_CHECK(cudnnDestroyTensorDescriptor(d->pd));
    DNN_CHECK(cudnnDestroyTensorDescriptor(d->xd));
    int dev = dnn_locked_dev;
    dnn_locked_dev = -1;
    nb__cuda_cudnn_unlock(dev);
}

/* t's data when it is of dtype pdt (contiguous, as the front end passes
 * weight and bias), else a converted copy (C) in ctx; t NULL: `fill`. */
static const void *param_for_cudnn(nb_ctx *ctx, cudaStream_t st, const nb_tensor *t, nb_dtype pdt,
                                   int64_t c, double fill) {
    if (t && t->dtype == pdt) return t->data;
    void *p = nb_ctx_alloc(ctx, nb_dtype_size(pdt) * (size_t)c, 0);
    vec_convert(st, p, pdt, t ? t->data : NULL, t ? t->dtype : pdt, c, fill);
    return p;
}

static void cudnn_forward(int dev, cudaStream_t st, nb_tensor *y, nb_tensor *save_mean,
                          nb_tensor *save_invstd, const nb_tensor *x, const nb_tensor *weight,
                          const nb_tensor *bias, nb_tensor *rm, nb_tensor *rv, bool training,
                          double momentum, double eps, int64_t n, int64_t c, int64_t s) {
    nb_dtype pdt = stat_dtype(x->dtype);
    const void *scale = param_for_cudnn(y->ctx, st, weight, pdt, c, 1.0);
    const void *shift = param_for_cudnn(y->ctx, st, bias, pdt, c, 0.0);
    dnn_call d;
    dnn_begin(&d, dev, x->dtype, n, c, s);
    if (training) {
        DNN_CHECK(cudnnBatchNormalizationForwardTraining(
            d.h, CUDNN_BATCHNORM_SPATIAL, d.one, d.zero, d.xd, x->data, d.xd,
            y->data, d.pd, scale, shift, momentum, rm ? rm->data : NULL,
            rv ? rv->data : NULL, eps, save_mean->data, save_invstd->data));
    } else {
        DNN_CHECK(cudnnBatchNormalizationForwardInference(
            d.h, CUDNN_BATCHNORM_SPATIAL, d.one, d.zero, d.xd, x->data, d.xd,
            y->data, d.pd, scale, shift, rm->data, rv->data, eps));
    }
    dnn_end(&d); /* before our launch below, which may abort */
    if (!training) {
        /* the saves, for the eval backward */
        bn_params p;
        memset(&p, 0, sizeof p);
        p.c = c;
        p.rmean = rm->data;
        p.rvar = rv->data;
        p.rmdt = rm->dtype;
        p.rvdt = rv->dtype;
        p.rmst = rm->strides[0];
        p.rvst = rv->strides[0];
        p.save_mean = save_mean->data;
        p.save_invstd = save_invstd->data;
        p.sdt = save_mean->dtype;
        p.eps = eps;
        channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(NULL, NULL, NULL, NULL, 0, 0, p);
        NB_CUDA_CHECK_LAUNCH(OP);
    }
    __atomic_fetch_add(&cudnn_fwd_calls, 1, __ATOMIC_RELAXED);
}

/* Training backward; dx, dw, db of another dtype than cuDNN's, or NULL,
 * go through scratch in ctx. */
static void cudnn_backward(int dev, cudaStream_t st, nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw,
                           nb_tensor *db, const nb_tensor *g, const nb_tensor *x,
                           const nb_tensor *mean, const nb_tensor *invstd,
                           const nb_tensor *weight, double eps, int64_t n, int64_t c, int64_t s) {
    nb_dtype pdt = stat_dtype(x->dtype);
    size_t pbytes = nb_dtype_size(pdt) * (size_t)c;
    const void *scale = param_for_cudnn(ctx, st, weight, pdt, c, 1.0);
    void *dxp = dx ? dx->data : nb_ctx_alloc(ctx, nb_dtype_size(x->dtype) * (size_t)(n * c * s), 0);
    void *dwp = dw && dw->dtype == pdt ? dw->data : nb_ctx_alloc(ctx, pbytes, 0);
    void *dbp = db && db->dtype == pdt ? db->data : nb_ctx_alloc(ctx, pbytes, 0);
    dnn_call d;
    dnn_begin(&d, dev, x->dtype, n, c, s);
    DNN_CHECK(cudnnBatchNormalizationBackward(
        d.h, CUDNN_BATCHNORM_SPATIAL, d.one, d.zero, d.one, d.zero, d.xd, x->data, d.xd, g->data,
        d.xd, dxp, d.pd, scale, dwp, dbp, eps, mean->data, invstd->data));
    dnn_end(&d);
    if (dw && dwp != dw->data) vec_convert(st, dw->data, dw->dtype, dwp, pdt, c, 0);
    if (db && dbp != db->data) vec_convert(st, db->data, db->dtype, dbp, pdt, c, 0);
    /* scratch the kernels above were the last to use (on the compute stream) */
    if (!(db && db->dtype == pdt)) nb__ctx_scratch_done(ctx, dbp, pbytes);
    if (!(dw && dw->dtype == pdt)) nb__ctx_scratch_done(ctx, dwp, pbytes);
    if (!dx) nb__ctx_scratch_done(ctx, dxp, nb_dtype_size(x->dtype) * (size_t)(n * c * s));
    __atomic_fetch_add(&cudnn_bwd_calls, 1, __ATOMIC_RELAXED);
}

/* --------------------------------------------------------- entry points */
extern "C" bool nb__cuda_batch_norm_cudnn_ok(const nb_tensor *x, const nb_tensor *running_mean,
                                             const nb_tensor *running_var, bool training,
                                             double eps) {
    if (x->device.type != NB_DEVICE_CUDA || x->ndim < 2)
        NB_ABORT("%s: nb__cuda_batch_norm_cudnn_ok needs x (N, C, ...) on a CUDA device", OP);
    int64_t s = 1;
    for (int d = 2; d < x->ndim; d++) s *= x->shape[d];
    return use_cudnn(x->device.index, x->dtype, running_mean, running_var, training, eps,
                     x->shape[0], x->shape[1], s);
}

extern "C" bool nb__cuda_batch_norm_set_cudnn(bool on) {
    bool prev = cudnn_on();
    __atomic_store_n(&cudnn_setting, on ? 1 : 0, __ATOMIC_RELAXED);
    return prev;
}

extern "C" void nb__cuda_batch_norm_cudnn_calls(int64_t *forward, int64_t *backward) {
    if (forward) *forward = __atomic_load_n(&cudnn_fwd_calls, __ATOMIC_RELAXED);
    if (backward) *backward = __atomic_load_n(&cudnn_bwd_calls, __ATOMIC_RELAXED);
}

extern "C" void nb__cuda_batch_norm(nb_tensor *y, nb_tensor *save_mean, nb_tensor *save_invstd,
                                    const nb_tensor *x, const nb_tensor *weight,
                                    const nb_tensor *bias, nb_tensor *running_mean,
                                    nb_tensor *running_var, bool training, double momentum,
                                    double eps, int64_t n, int64_t c, int64_t s) {
    int dev = y->device.index;
    cudaStream_t st = nb__cuda_enter(OP, dev);
    if (c == 0) return;
    check_float("weight", weight);
    check_float("bias", bias);
    check_float("running_mean", running_mean);
    check_float("running_var", running_var);
    if (weight && bias && weight->dtype != bias->dtype)
        NB_ABORT("%s: weight (%s) and bias (%s) differ in dtype", OP, nb_dtype_name(weight->dtype),
                 nb_dtype_name(bias->dtype));
    check_saved(x, save_mean, save_invstd);
    if (training) {
        if (n * s == 0) NB_ABORT("%s: training needs values in every channel", OP);
        if (!running_mean != !running_var)
            NB_ABORT("%s: running_mean and running_var must both be given or both be NULL", OP);
    } else if (!running_mean || !running_var) {
        NB_ABORT("%s: eval mode needs running_mean and running_var", OP);
    }
    if (use_cudnn(dev, x->dtype, running_mean, running_var, training, eps, n, c, s)) {
        cudnn_forward(dev, st, y, save_mean, save_invstd, x, weight, bias, running_mean,
                      running_var, training, momentum, eps, n, c, s);
        return;
    }
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
    p.save_mean = save_mean->data;
    p.save_invstd = save_invstd->data;
    p.sdt = save_mean->dtype;
    p.momentum = momentum;
    p.eps = eps;

    double *sc = (double *)nb_ctx_alloc(y->ctx, sizeof(double) * (size_t)(2 * c), 0);
    double *sh = sc + c;
    if (training) {
        int64_t chunk, splits = splits_for(c, m, &chunk);
        double *part = (double *)nb_ctx_alloc(y->ctx, sizeof(double) * (size_t)(c * splits + c), 0);
        double *mean = part + c * splits;
        BY_FLOAT_DTYPE(OP, x->dtype, stats_launch, st, part, x->data, (const double *)NULL, n, c,
                       s, splits, chunk);
        mean_kernel<<<blocks_for(c), THREADS, 0, st>>>(mean, part, c, splits, (double)m);
        NB_CUDA_CHECK_LAUNCH(OP);
        BY_FLOAT_DTYPE(OP, x->dtype, stats_launch, st, part, x->data, (const double *)mean, n, c,
                       s, splits, chunk);
        channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(sc, sh, mean, part, splits, (double)m, p);
    } else {
        channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(sc, sh, NULL, NULL, 0, (double)m, p);
    }
    NB_CUDA_CHECK_LAUNCH(OP);
    if (total > 0)
        BY_FLOAT_DTYPE(OP, x->dtype, apply_launch, st, y->data, x->data, sc, sh, total, c, s);
}

extern "C" void nb__cuda_batch_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                             const nb_tensor *g, const nb_tensor *x,
                                             const nb_tensor *mean, const nb_tensor *invstd,
                                             const nb_tensor *weight, bool training, double eps,
                                             int64_t n, int64_t c, int64_t s) {
    int dev = g->device.index;
    cudaStream_t st = nb__cuda_enter(OP, dev);
    nb_tensor *out = dx ? dx : dw ? dw : db;
    if (!out || c == 0) return;
    check_float("weight", weight);
    check_float("dw", dw);
    check_float("db", db);
    check_saved(x, mean, invstd);
    if (g->dtype != x->dtype)
        NB_ABORT("%s: the gradient (%s) and the input (%s) differ in dtype", OP,
                 nb_dtype_name(g->dtype), nb_dtype_name(x->dtype));
    int wdt = weight ? weight->dtype : dw ? dw->dtype : db ? db->dtype : NB_F32;
    if ((dw && dw->dtype != wdt) || (db && db->dtype != wdt))
        NB_ABORT("%s: dw, db and weight differ in dtype", OP);
    if (training && use_cudnn(dev, x->dtype, NULL, NULL, true, eps, n, c, s)) {
        cudnn_backward(dev, st, out->ctx, dx, dw, db, g, x, mean, invstd, weight, eps, n, c, s);
        return;
    }
    int64_t m = n * s, total = m * c;
    int64_t chunk = 1, splits = 1;
    if (m > 0) splits = splits_for(c, m, &chunk);
    double *part = (double *)nb_ctx_alloc(out->ctx, sizeof(double) * (size_t)(2 * c * splits), 0);
    coef *cf = (coef *)nb_ctx_alloc(out->ctx, sizeof(coef) * (size_t)c, 0);
    if (m > 0) {
        BY_FLOAT_DTYPE(OP, x->dtype, grad_partial_launch, st, part, part + c * splits, g->data,
                       x->data, mean->data, mean->dtype, n, c, s, splits, chunk);
    } else {
        NB_CUDA_CHECK(OP, cudaMemsetAsync(part, 0, sizeof(double) * (size_t)(2 * c * splits), st));
    }
    grad_channel_kernel<<<blocks_for(c), THREADS, 0, st>>>(
        cf, dw ? dw->data : NULL, db ? db->data : NULL, wdt, part, part + c * splits, splits,
        mean->data, invstd->data, mean->dtype, weight ? weight->data : NULL, training, c,
        (double)m);
    NB_CUDA_CHECK_LAUNCH(OP);
    if (dx && total > 0)
        BY_FLOAT_DTYPE(OP, x->dtype, dx_launch, st, dx->data, g->data, x->data, (const coef *)cf,
                       total, c, s);
}
