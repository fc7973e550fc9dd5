/* 2-D convolution on CUDA (cuda.h, "convolution") through cuDNN's
 * convolution API: NCHW, cross-correlation, the geometry of
 * tensor/cpu/conv.h. Letters as there; P = OH * OW.
 *
 * One plan per (device, geometry, dtype, TF32): the descriptors and, made
 * on first use of each direction, the algorithm and its workspace size,
 * chosen with cudnnGet*Algorithm_v7 (heuristics only: the Find functions
 * benchmark and synchronise the device). Among the algorithms that work,
 * the first deterministic one whose workspace stays under WS_LIMIT is
 * taken, else the first that works.
 *
 * Math types: bf16/f16 (f32 accumulation) CUDNN_TENSOR_OP_MATH; f32
 * CUDNN_DEFAULT_MATH when TF32 is allowed (it permits TF32 tensor cores;
 * ALLOW_CONVERSION would also allow down-conversion to f16) and
 * CUDNN_FMA_MATH otherwise (also forced on the algorithm chosen, as the
 * heuristic may report another math type for it); f64
 * CUDNN_DEFAULT_MATH. The bias add and the bias gradient are our own
 * kernels (the gradient is a per-channel block reduction in f64:
 * deterministic). Every output is written with beta = 0. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

#define OP "nb_conv2d"
#define WS_LIMIT ((size_t)1 << 30)

/* ------------------------------------------------------------- kernels */
static __device__ __forceinline__ float to_acc(float x) { return x; }
static __device__ __forceinline__ double to_acc(double x) { return x; }
static __device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
static __device__ __forceinline__ void put(float *p, double v) { *p = (float)v; }
static __device__ __forceinline__ void put(double *p, double v) { *p = v; }
static __device__ __forceinline__ void put(__nv_bfloat16 *p, double v) {
    *p = __float2bfloat16((float)v);
}
static __device__ __forceinline__ void put(__half *p, double v) { *p = __float2half((float)v); }

/* out (N, O, P) += b[o] */
template <typename T>
static __global__ void bias_add_kernel(T *out, const T *b, int64_t total, int64_t o, int64_t p) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        auto v = to_acc(out[i]) + to_acc(b[(i / p) % o]);
        put(&out[i], (double)v);
    }
}

#define DB_THREADS 256
/* db[o] = sum over n, p of gout (N, O, P); one block per channel. */
template <typename T>
static __global__ void bias_grad_kernel(T *db, const T *gout, int64_t n, int64_t o, int64_t p) {
    __shared__ double part[DB_THREADS];
    int64_t ch = blockIdx.x, np = n * p;
    double s = 0;
    for (int64_t i = threadIdx.x; i < np; i += DB_THREADS) {
        int64_t in = i / p, ip = i % p;
        s += (double)to_acc(gout[(in * o + ch) * p + ip]);
    }
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = DB_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) put(&db[ch], part[0]);
}

/* ----------------------------------------------------------- launchers */
template <typename T>
static void bias_add_launch(cudaStream_t st, void *out, const void *b, int64_t total, int64_t o,
                            int64_t p) {
    int64_t blocks = (total + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    bias_add_kernel<T><<<(unsigned)blocks, 256, 0, st>>>((T *)out, (const T *)b, total, o, p);
    NB_CUDA_CHECK_LAUNCH(OP);
}

template <typename T>
static void bias_grad_launch(cudaStream_t st, void *db, const void *gout, int64_t n, int64_t o,
                             int64_t p) {
    bias_grad_kernel<T><<<(unsigned)o, DB_THREADS, 0, st>>>((T *)db, (const T *)gout, n, o, p);
    NB_CUDA_CHECK_LAUNCH(OP);
}

static void bias_add(cudaStream_t st, nb_dtype dt, void *out, const void *b, int64_t total,
                     int64_t o, int64_t p) {
    switch (dt) {
    case NB_F32: bias_add_launch<float>(st, out, b, total, o, p); break;
    case NB_F64: bias_add_launch<double>(st, out, b, total, o, p); break;
    case NB_BF16: bias_add_launch<__nv_bfloat16>(st, out, b, total, o, p); break;
    case NB_F16: bias_add_launch<__half>(st, out, b, total, o, p); break;
    default: NB_ABORT("%s: unsupported dtype %s", OP, nb_dtype_name(dt));
    }
}

static void bias_grad(cudaStream_t st, nb_dtype dt, void *db, const void *gout, int64_t n,
                      int64_t o, int64_t p) {
    switch (dt) {
    case NB_F32: bias_grad_launch<float>(st, db, gout, n, o, p); break;
    case NB_F64: bias_grad_launch<double>(st, db, gout, n, o, p); break;
    case NB_BF16: bias_grad_launch<__nv_bfloat16>(st, db, gout, n, o, p); break;
    case NB_F16: bias_grad_launch<__half>(st, db, gout, n, o, p); break;
    default: NB_ABORT("%s: unsupported dtype %s", OP, nb_dtype_name(dt));
    }
}

/* ---------------------------------------------------------- plan cache */
typedef struct conv_key {
    nb__conv2d_geom g;
    int64_t device, dtype, tf32;
} conv_key;

typedef struct conv_plan {
    bool used;
    conv_key key;
    cudnnTensorDescriptor_t xd, yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    bool have_fwd, have_bwd_data, have_bwd_filter;
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bwd_data;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter;
    cudnnMathType_t fwd_math, bwd_data_math, bwd_filter_math;
    size_t fwd_ws, bwd_data_ws, bwd_filter_ws;
} conv_plan;

#define PLAN_SLOTS 128
#define PLAN_PROBE 8
static conv_plan plans[PLAN_SLOTS];
static pthread_mutex_t plans_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t key_hash(const conv_key *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void plan_free(conv_plan *p) {
    if (!p->used) return;
    cudnnDestroyTensorDescriptor(p->xd);
    cudnnDestroyTensorDescriptor(p->yd);
    cudnnDestroyFilterDescriptor(p->wd);
    cudnnDestroyConvolutionDescriptor(p->cd);
    p->used = false;
}

static cudnnDataType_t cudnn_type(nb_dtype dt) {
    switch (dt) {
    case NB_F32: return CUDNN_DATA_FLOAT;
    case NB_F64: return CUDNN_DATA_DOUBLE;
    case NB_BF16: return CUDNN_DATA_BFLOAT16;
    case NB_F16: return CUDNN_DATA_HALF;
    default: NB_ABORT("%s: unsupported dtype %s", OP, nb_dtype_name(dt));
    }
    return CUDNN_DATA_FLOAT;
}

/* The math type the descriptor starts with (see the top comment). */
static cudnnMathType_t base_math(const conv_key *k) {
    nb_dtype dt = (nb_dtype)k->dtype;
    if (dt == NB_BF16 || dt == NB_F16) return CUDNN_TENSOR_OP_MATH;
    if (dt == NB_F32 && !k->tf32) return CUDNN_FMA_MATH;
    return CUDNN_DEFAULT_MATH;
}

static int dim(int64_t v) {
    if (v > INT32_MAX) NB_ABORT("%s: size %lld is beyond what cuDNN takes", OP, (long long)v);
    return (int)v;
}

static void plan_make(conv_plan *p, const conv_key *k) {
    const nb__conv2d_geom *g = &k->g;
    cudnnDataType_t t = cudnn_type((nb_dtype)k->dtype);
    cudnnDataType_t acc = k->dtype == NB_F64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    NB_CUDNN_CHECK(OP, cudnnCreateTensorDescriptor(&p->xd));
    NB_CUDNN_CHECK(OP, cudnnCreateTensorDescriptor(&p->yd));
    NB_CUDNN_CHECK(OP, cudnnCreateFilterDescriptor(&p->wd));
    NB_CUDNN_CHECK(OP, cudnnCreateConvolutionDescriptor(&p->cd));
    NB_CUDNN_CHECK(OP, cudnnSetTensor4dDescriptor(p->xd, CUDNN_TENSOR_NCHW, t, dim(g->n), dim(g->c),
                                                  dim(g->h), dim(g->w)));
    NB_CUDNN_CHECK(OP, cudnnSetTensor4dDescriptor(p->yd, CUDNN_TENSOR_NCHW, t, dim(g->n), dim(g->o),
                                                  dim(g->oh), dim(g->ow)));
    NB_CUDNN_CHECK(OP, cudnnSetFilter4dDescriptor(p->wd, t, CUDNN_TENSOR_NCHW, dim(g->o), dim(g->c),
                                                  dim(g->kh), dim(g->kw)));
    NB_CUDNN_CHECK(OP, cudnnSetConvolution2dDescriptor(p->cd, dim(g->ph), dim(g->pw), dim(g->sh),
                                                       dim(g->sw), dim(g->dh), dim(g->dw),
                                                       CUDNN_CROSS_CORRELATION, acc));
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, base_math(k)));
    int on, oc, ohh, oww;
    NB_CUDNN_CHECK(OP, cudnnGetConvolution2dForwardOutputDim(p->cd, p->xd, p->wd, &on, &oc, &ohh,
                                                             &oww));
    if (on != g->n || oc != g->o || ohh != g->oh || oww != g->ow)
        NB_ABORT("%s: cuDNN's output size (%d, %d, %d, %d) differs from (%lld, %lld, %lld, %lld)",
                 OP, on, oc, ohh, oww, (long long)g->n, (long long)g->o, (long long)g->oh,
                 (long long)g->ow);
    p->have_fwd = p->have_bwd_data = p->have_bwd_filter = false;
    p->key = *k;
    p->used = true;
}

/* Called with plans_lock held. */
static conv_plan *plan_get(const conv_key *k) {
    uint64_t h = key_hash(k);
    for (int i = 0; i < PLAN_PROBE; i++) {
        conv_plan *p = &plans[(h + (uint64_t)i) % PLAN_SLOTS];
        if (p->used && memcmp(&p->key, k, sizeof *k) == 0) return p;
    }
    conv_plan *slot = NULL;
    for (int i = 0; i < PLAN_PROBE && !slot; i++) {
        conv_plan *p = &plans[(h + (uint64_t)i) % PLAN_SLOTS];
        if (!p->used) slot = p;
    }
    if (!slot) {
        slot = &plans[h % PLAN_SLOTS];
        plan_free(slot);
    }
    plan_make(slot, k);
    return slot;
}

/* Index of the algorithm to take among cnt heuristic results (or -1). */
template <typename Perf>
static int pick(const Perf *r, int cnt) {
    int any = -1;
    for (int i = 0; i < cnt; i++) {
        if (r[i].status != CUDNN_STATUS_SUCCESS || r[i].memory > WS_LIMIT) continue;
        if (r[i].determinism == CUDNN_DETERMINISTIC) return i;
        if (any < 0) any = i;
    }
    if (any >= 0) return any;
    for (int i = 0; i < cnt; i++)
        if (r[i].status == CUDNN_STATUS_SUCCESS) return i;
    return -1;
}

static bool fma_only(const conv_plan *p) { return base_math(&p->key) == CUDNN_FMA_MATH; }

static cudnnMathType_t run_math(const conv_plan *p, cudnnMathType_t chosen) {
    return fma_only(p) ? CUDNN_FMA_MATH : chosen;
}

#define MAX_ALGOS 16

static void choose_fwd(conv_plan *p, cudnnHandle_t h) {
    cudnnConvolutionFwdAlgoPerf_t r[MAX_ALGOS];
    int cnt = 0;
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, base_math(&p->key)));
    NB_CUDNN_CHECK(OP, cudnnGetConvolutionForwardAlgorithm_v7(h, p->xd, p->wd, p->cd, p->yd,
                                                              MAX_ALGOS, &cnt, r));
    int i = pick(r, cnt);
    if (i < 0) NB_ABORT("%s: cuDNN has no forward algorithm for this convolution", OP);
    p->fwd = r[i].algo;
    p->fwd_math = run_math(p, r[i].mathType);
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, p->fwd_math));
    NB_CUDNN_CHECK(OP, cudnnGetConvolutionForwardWorkspaceSize(h, p->xd, p->wd, p->cd, p->yd,
                                                               p->fwd, &p->fwd_ws));
    p->have_fwd = true;
}

static void choose_bwd_data(conv_plan *p, cudnnHandle_t h) {
    cudnnConvolutionBwdDataAlgoPerf_t r[MAX_ALGOS];
    int cnt = 0;
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, base_math(&p->key)));
    NB_CUDNN_CHECK(OP, cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p->wd, p->yd, p->cd, p->xd,
                                                                   MAX_ALGOS, &cnt, r));
    int i = pick(r, cnt);
    if (i < 0) NB_ABORT("%s: cuDNN has no backward-data algorithm for this convolution", OP);
    p->bwd_data = r[i].algo;
    p->bwd_data_math = run_math(p, r[i].mathType);
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, p->bwd_data_math));
    NB_CUDNN_CHECK(OP, cudnnGetConvolutionBackwardDataWorkspaceSize(h, p->wd, p->yd, p->cd, p->xd,
                                                                    p->bwd_data, &p->bwd_data_ws));
    p->have_bwd_data = true;
}

static void choose_bwd_filter(conv_plan *p, cudnnHandle_t h) {
    cudnnConvolutionBwdFilterAlgoPerf_t r[MAX_ALGOS];
    int cnt = 0;
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, base_math(&p->key)));
    NB_CUDNN_CHECK(OP, cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p->xd, p->yd, p->cd, p->wd,
                                                                     MAX_ALGOS, &cnt, r));
    int i = pick(r, cnt);
    if (i < 0) NB_ABORT("%s: cuDNN has no backward-filter algorithm for this convolution", OP);
    p->bwd_filter = r[i].algo;
    p->bwd_filter_math = run_math(p, r[i].mathType);
    NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, p->bwd_filter_math));
    NB_CUDNN_CHECK(OP, cudnnGetConvolutionBackwardFilterWorkspaceSize(
                           h, p->xd, p->yd, p->cd, p->wd, p->bwd_filter, &p->bwd_filter_ws));
    p->have_bwd_filter = true;
}

static conv_key make_key(int device, nb_dtype dt, const nb__conv2d_geom *g) {
    conv_key k;
    memset(&k, 0, sizeof k);
    k.g = *g;
    k.device = device;
    k.dtype = dt;
    k.tf32 = dt == NB_F32 && nb__cuda_tf32();
    return k;
}

/* ---------------------------------------------------------- entry points */
extern "C" void nb__cuda_conv2d_forward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g,
                                        void *out, const void *x, const void *w, const void *b) {
    int dev = nb_ctx_device(ctx).index;
    nb__cuda_use(OP, dev);
    int64_t total = g->n * g->o * g->oh * g->ow;
    if (total == 0) return;
    cudaStream_t st = nb__cuda_compute_stream(dev);
    if (g->c * g->kh * g->kw == 0) {
        NB_CUDA_CHECK(OP, cudaMemsetAsync(out, 0, (size_t)total * nb_dtype_size(dt), st));
    } else {
        cudnnHandle_t h = (cudnnHandle_t)nb__cuda_cudnn(dev);
        conv_key k = make_key(dev, dt, g);
        float one_f = 1.0f, zero_f = 0.0f;
        double one_d = 1.0, zero_d = 0.0;
        const void *one = dt == NB_F64 ? (const void *)&one_d : (const void *)&one_f;
        const void *zero = dt == NB_F64 ? (const void *)&zero_d : (const void *)&zero_f;
        pthread_mutex_lock(&plans_lock);
        conv_plan *p = plan_get(&k);
        if (!p->have_fwd) choose_fwd(p, h);
        void *ws = p->fwd_ws ? nb_ctx_alloc(ctx, p->fwd_ws, 0) : NULL;
        NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, p->fwd_math));
        NB_CUDNN_CHECK(OP, cudnnConvolutionForward(h, one, p->xd, x, p->wd, w, p->cd, p->fwd, ws,
                                                   p->fwd_ws, zero, p->yd, out));
        pthread_mutex_unlock(&plans_lock);
    }
    if (b) bias_add(st, dt, out, b, total, g->o, g->oh * g->ow);
}

extern "C" void nb__cuda_conv2d_backward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g,
                                         void *dx, void *dw, void *db, const void *gout,
                                         const void *x, const void *w) {
    int dev = nb_ctx_device(ctx).index;
    nb__cuda_use(OP, dev);
    cudaStream_t st = nb__cuda_compute_stream(dev);
    size_t es = nb_dtype_size(dt);
    int64_t nx = g->n * g->c * g->h * g->w, nw = g->o * g->c * g->kh * g->kw;
    int64_t ny = g->n * g->o * g->oh * g->ow;
    if (ny == 0 || g->c * g->kh * g->kw == 0) {
        /* Nothing flows: every requested gradient is zero. */
        if (dx && nx) NB_CUDA_CHECK(OP, cudaMemsetAsync(dx, 0, (size_t)nx * es, st));
        if (dw && nw) NB_CUDA_CHECK(OP, cudaMemsetAsync(dw, 0, (size_t)nw * es, st));
        if (db && g->o) {
            if (ny == 0) NB_CUDA_CHECK(OP, cudaMemsetAsync(db, 0, (size_t)g->o * es, st));
            else bias_grad(st, dt, db, gout, g->n, g->o, g->oh * g->ow);
        }
        return;
    }
    if (dx || dw) {
        cudnnHandle_t h = (cudnnHandle_t)nb__cuda_cudnn(dev);
        conv_key k = make_key(dev, dt, g);
        float one_f = 1.0f, zero_f = 0.0f;
        double one_d = 1.0, zero_d = 0.0;
        const void *one = dt == NB_F64 ? (const void *)&one_d : (const void *)&one_f;
        const void *zero = dt == NB_F64 ? (const void *)&zero_d : (const void *)&zero_f;
        pthread_mutex_lock(&plans_lock);
        conv_plan *p = plan_get(&k);
        if (dx) {
            if (!p->have_bwd_data) choose_bwd_data(p, h);
            void *ws = p->bwd_data_ws ? nb_ctx_alloc(ctx, p->bwd_data_ws, 0) : NULL;
            NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, p->bwd_data_math));
            NB_CUDNN_CHECK(OP, cudnnConvolutionBackwardData(h, one, p->wd, w, p->yd, gout, p->cd,
                                                            p->bwd_data, ws, p->bwd_data_ws, zero,
                                                            p->xd, dx));
        }
        if (dw) {
            if (!p->have_bwd_filter) choose_bwd_filter(p, h);
            void *ws = p->bwd_filter_ws ? nb_ctx_alloc(ctx, p->bwd_filter_ws, 0) : NULL;
            NB_CUDNN_CHECK(OP, cudnnSetConvolutionMathType(p->cd, p->bwd_filter_math));
            NB_CUDNN_CHECK(OP, cudnnConvolutionBackwardFilter(h, one, p->xd, x, p->yd, gout, p->cd,
                                                              p->bwd_filter, ws, p->bwd_filter_ws,
                                                              zero, p->wd, dw));
        }
        pthread_mutex_unlock(&plans_lock);
    }
    if (db) bias_grad(st, dt, db, gout, g->n, g->o, g->oh * g->ow);
}
