/* The CUDA backend's per-channel statistics for SyncBatchNorm
 * (tensor/backend.h; the op and its all-reduces are in
 * distributed/sync_batch_norm.c; the CPU twin is tensor/cpu/channel.c).
 *
 * Letters: x is (N, C, S) contiguous; M is the global count per channel.
 * Per-channel sums use one block per channel (a grid-stride loop over
 * channels), each thread summing a strided share of the channel's N S
 * elements in f64, then a fixed-shape tree: the result does not depend on
 * timing (no atomics), so a step is reproducible. Everything is computed
 * in f64, the dtype of the statistics, as the CPU version does; 16-bit
 * inputs are widened on load and rounded once on store. */
#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

#define THREADS 256

/* Sum of v over the block (every thread gets it); `sh` holds 32 doubles. */
static __device__ double block_sum(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); /* sh may still be read from the previous call */
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    int nwarps = (blockDim.x + 31) >> 5;
    v = threadIdx.x < nwarps ? sh[threadIdx.x] : 0.0;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// stats (3 C) = [count | sum | sum of squares]
template <typename T>
static __global__ void stats_kernel(double *stats, const T *x, int64_t n, int64_t c, int64_t s) {
    __shared__ double sh[32];
    const int64_t per = n * s;
    for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
        double sum = 0, sq = 0;
        for (int64_t i = threadIdx.x; i < per; i += blockDim.x) {
            int64_t ni = i / s, k = i - ni * s;
            double v = (double)to_math(x[(ni * c + ch) * s + k]);
            sum += v;
            sq += v * v;
        }
        sum = block_sum(sum, sh);
        sq = block_sum(sq, sh);
        if (threadIdx.x == 0) {
            stats[ch] = (double)per;
            stats[c + ch] = sum;
            stats[2 * c + ch] = sq;
        }
    }
}

// A global count of at most one value per channel is the CPU's abort: here a
// deferred fault (Note [Deferred device checks]), recorded by channel 0.
static __global__ void finalize_kernel(double *mean, double *invstd, const double *stats,
                                       void *rm, int rm_dt, int64_t rm_stride, void *rv,
                                       int rv_dt, int64_t rv_stride, double momentum, double eps,
                                       int64_t c, nb__cuda_fault *fault) {
    for (int64_t ch = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; ch < c;
         ch += (int64_t)gridDim.x * blockDim.x) {
        double m = stats[ch];
        if (ch == 0 && m <= 1 &&
            atomicCAS(&fault->code, 0, (int)NB__FAULT_SYNC_BATCH_NORM_COUNT) == 0) {
            fault->value = (long long)m;
            fault->position = 0;
            fault->limit = 1;
            __threadfence_system();
        }
        double mu = stats[c + ch] / m;
        double var = stats[2 * c + ch] / m - mu * mu;
        if (var < 0) var = 0;
        mean[ch] = mu;
        invstd[ch] = 1.0 / sqrt(var + eps);
        if (rm) {
            double unbiased = m > 1 ? var * m / (m - 1) : nan("");
            int64_t im = ch * rm_stride, iv = ch * rv_stride;
            store_f64(rm, im, rm_dt, (1 - momentum) * load_f64(rm, im, rm_dt) + momentum * mu);
            store_f64(rv, iv, rv_dt, (1 - momentum) * load_f64(rv, iv, rv_dt) + momentum * unbiased);
        }
    }
}

template <typename T>
static __global__ void apply_kernel(T *y, const T *x, const double *mean, const double *invstd,
                                    const void *w, int w_dt, const void *b, int b_dt,
                                    int64_t total, int64_t c, int64_t s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t ch = (i / s) % c;
        double wv = w ? load_f64(w, ch, w_dt) : 1.0, bv = b ? load_f64(b, ch, b_dt) : 0.0;
        y[i] = store_as<T>(((double)to_math(x[i]) - mean[ch]) * invstd[ch] * wv + bv);
    }
}

// sums (2 C) = [sum dy | sum dy xhat]
template <typename T>
static __global__ void backward_sums_kernel(double *sums, const T *dy, const T *x,
                                            const double *mean, const double *invstd, int64_t n,
                                            int64_t c, int64_t s) {
    __shared__ double sh[32];
    const int64_t per = n * s;
    for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
        double mu = mean[ch], is = invstd[ch], sd = 0, sdx = 0;
        for (int64_t i = threadIdx.x; i < per; i += blockDim.x) {
            int64_t ni = i / s, k = i - ni * s, at = (ni * c + ch) * s + k;
            double d = (double)to_math(dy[at]);
            sd += d;
            sdx += d * ((double)to_math(x[at]) - mu) * is;
        }
        sd = block_sum(sd, sh);
        sdx = block_sum(sdx, sh);
        if (threadIdx.x == 0) {
            sums[ch] = sd;
            sums[c + ch] = sdx;
        }
    }
}

template <typename T>
static __global__ void backward_dx_kernel(T *dx, const T *dy, const T *x, const double *mean,
                                          const double *invstd, const void *w, int w_dt,
                                          const double *sums, const double *stats, int64_t total,
                                          int64_t c, int64_t s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t ch = (i / s) % c;
        double m = stats[ch], is = invstd[ch];
        double scale = (w ? load_f64(w, ch, w_dt) : 1.0) * is;
        double xhat = ((double)to_math(x[i]) - mean[ch]) * is;
        dx[i] = store_as<T>(scale * ((double)to_math(dy[i]) - sums[ch] / m - xhat * sums[c + ch] / m));
    }
}

static unsigned blocks_for(int64_t work, int64_t per_block) {
    int64_t b = (work + per_block - 1) / per_block;
    if (b < 1) b = 1;
    return (unsigned)(b < MAX_BLOCKS ? b : MAX_BLOCKS);
}

/* CALL with T the storage type of the float dtype dt (types.cuh). */
#define DISPATCH(op, dt, CALL)                                                                   \
    by_float_dtype(op, dt, [&](auto t_) { typedef typename decltype(t_)::type T; CALL; })

void nb__cuda_channel_stats(nb_tensor *stats, const nb_tensor *x, int64_t n, int64_t c, int64_t s) {
    const char *op = "nb_sync_batch_norm";
    cudaStream_t st = nb__cuda_enter(op, x->device.index);
    if (c == 0) return;
    if (n * s == 0) {
        NB_CUDA_CHECK(op, cudaMemsetAsync(stats->data, 0, 3 * (size_t)c * sizeof(double), st));
        return;
    }
    unsigned grid = blocks_for(c, 1);
    DISPATCH(op, x->dtype,
             (stats_kernel<T><<<grid, THREADS, 0, st>>>((double *)stats->data,
                                                        (const T *)x->data, n, c, s)));
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_channel_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                               nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                               double eps, int64_t c, const nb_tensor *input) {
    (void)input; /* the count is checked on the device: no shape in the message */
    const char *op = "nb_sync_batch_norm";
    cudaStream_t st = nb__cuda_enter(op, stats->device.index);
    if (c == 0) return;
    void *rm = running_mean ? running_mean->data : NULL;
    void *rv = running_var ? running_var->data : NULL;
    finalize_kernel<<<blocks_for(c, THREADS), THREADS, 0, st>>>(
        (double *)mean->data, (double *)invstd->data, (const double *)stats->data, rm,
        running_mean ? (int)running_mean->dtype : 0, running_mean ? running_mean->strides[0] : 0,
        rv, running_var ? (int)running_var->dtype : 0, running_var ? running_var->strides[0] : 0,
        momentum, eps, c, nb__cuda_fault_slot(stats->device.index));
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_channel_normalize(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                                const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                                int64_t n, int64_t c, int64_t s){
    const char *op = "nb_sync_batch_norm";
    cudaStream_t st = nb__cuda_enter(op, x->device.index);
    int64_t total = n * c * s;
    if (total == 0) return;
    const void *wp = w ? w->data : NULL, *bp = b ? b->data : NULL;
    int wdt = w ? (int)w->dtype : 0, bdt = b ? (int)b->dtype : 0;
    DISPATCH(op, x->dtype,
             (apply_kernel<T><<<blocks_for(total, THREADS), THREADS, 0, st>>>(
                 (T *)y->data, (const T *)x->data, (const double *)mean->data,
                 (const double *)invstd->data, wp, wdt, bp, bdt, total, c, s)));
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_channel_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                    const nb_tensor *mean, const nb_tensor *invstd, int64_t n,
                                    int64_t c, int64_t s){
    const char *op = "nb_sync_batch_norm (backward)";
    cudaStream_t st = nb__cuda_enter(op, x->device.index);
    if (c == 0) return;
    if (n * s == 0) {
        NB_CUDA_CHECK(op, cudaMemsetAsync(sums->data, 0, 2 * (size_t)c * sizeof(double), st));
        return;
    }
    unsigned grid = blocks_for(c, 1);
    DISPATCH(op, x->dtype,
             (backward_sums_kernel<T><<<grid, THREADS, 0, st>>>(
                 (double *)sums->data, (const T *)dy->data, (const T *)x->data,
                 (const double *)mean->data, (const double *)invstd->data, n, c, s)));
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_channel_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                                  const nb_tensor *mean, const nb_tensor *invstd, const nb_tensor *w,
                                  const nb_tensor *sums, const nb_tensor *stats, int64_t n, int64_t c,
                                  int64_t s){
    const char *op = "nb_sync_batch_norm (backward)";
    cudaStream_t st = nb__cuda_enter(op, x->device.index);
    int64_t total = n * c * s;
    if (total == 0) return;
    const void *wp = w ? w->data : NULL;
    int wdt = w ? (int)w->dtype : 0;
    DISPATCH(op, x->dtype,
             (backward_dx_kernel<T><<<blocks_for(total, THREADS), THREADS, 0, st>>>(
                 (T *)dx->data, (const T *)dy->data, (const T *)x->data,
                 (const double *)mean->data, (const double *)invstd->data, wp, wdt,
                 (const double *)sums->data, (const double *)stats->data, total, c, s)));
    NB_CUDA_CHECK_LAUNCH(op);
}
