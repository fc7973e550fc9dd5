/* 2-D convolution on CUDA (cuda.h, "convolution") through cuDNN's
 * convolution API: NCHW, cross-correlation, the geometry of
 * tensor/cpu/conv.h. Letters as there; P = OH * OW. Channel groups are
 * cuDNN's group count on the convolution descriptor, with the filter
 * descriptor (O, C/G, KH, KW): one call covers every group.
 *
 * One plan per (device, geometry, dtype, TF32): the descriptors and, made
 * on first use of each direction, the algorithm and its workspace size,
 * chosen with cudnnGet*Algorithm_v7 (heuristics only: the Find functions
 * benchmark and synchronise the device). Among the algorithms that work,
 * the first deterministic one whose workspace stays under the device's
 * limit (nb__cuda_cudnn_workspace_limit: a sixteenth of its memory, at
 * least 1 GiB) is taken, else the first under the limit, else the first
 * that works. The workspace is the device's one cuDNN workspace, shared by
 * every call (Note [cuDNN workspace] in runtime.cu), so a large one costs
 * its size once, not once per call: hence a limit that scales with the
 * device rather than a fixed one.
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
#include <stdio.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

#define OP "nb_conv2d"

/* ------------------------------------------------------------- kernels */

/* out (N, O, P) += b[o] */
template <typename T>
static __global__ void bias_add_kernel(T *out, const T *b, int64_t total, int64_t o, int64_t p) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        auto v = to_math(out[i]) + to_math(b[(i / p) % o]);
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
        s += (double)to_math(gout[(in * o + ch) * p + ip]);
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
    BY_FLOAT_DTYPE(OP, dt, bias_add_launch, st, out, b, total, o, p);
}

static void bias_grad(cudaStream_t st, nb_dtype dt, void *db, const void *gout, int64_t n,
                      int64_t o, int64_t p) {
    BY_FLOAT_DTYPE(OP, dt, bias_grad_launch, st, db, gout, n, o, p);
}

/* ---------------------------------------------------------- plan cache */
typedef struct conv_key {
    nb__conv2d_geom g;
    int64_t device, dtype, tf32;
} conv_key;

typedef enum direction { FWD, BWD_DATA, BWD_FILTER } direction;

/* The algorithm chosen for one direction: cuDNN's enum of that direction
 * (cudnnConvolutionFwdAlgo_t, ...BwdDataAlgo_t, ...BwdFilterAlgo_t) as an
 * int, the math it runs with and its workspace. */
typedef struct conv_choice {
    bool have;
    int algo;
    cudnnMathType_t math;
    size_t ws;
} conv_choice;

typedef struct conv_plan {
    bool used;
    conv_key key;
    cudnnTensorDescriptor_t xd, yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    conv_choice c[3]; /* by direction */
} conv_plan;

#define PLAN_SLOTS 128
#define PLAN_PROBE 8
static conv_plan plans[PLAN_SLOTS];
static pthread_mutex_t plans_lock = PTHREAD_MUTEX_INITIALIZER;
static int locked_dev = -1; /* whose cuDNN lock goes with plans_lock; under it */

/* Note [Convolution locks]
 * A call holds two locks from its first use of cuDNN until its last
 * cuDNN call is enqueued: the device's cuDNN lock (runtime.cu), taken
 * first, which serialises the handle and guards the workspace until the
 * call using it is enqueued (Note [cuDNN workspace]), and plans_lock,
 * which guards the plan table (shared by every device) and the plan's
 * descriptors, whose math type is set before each call. The order is
 * always cuDNN lock, then plans_lock, and one device at a time, so two
 * threads cannot deadlock. The cached pointer to a plan is only used
 * under plans_lock: another thread may evict it once released.
 *
 * Note [Aborts under the plan lock] (tensor/cuda/matmul.cu) holds here
 * too: every check made with the locks held releases both before aborting
 * (DNN_CHECK, unlock_all), the geometry and dtype are validated before
 * they are taken (make_key), the handle is made before (nb__cuda_cudnn_lock
 * may abort only before it locks), and the workspace reports a failure to
 * grow instead of aborting (prepare releases the locks, then aborts). */
static cudnnHandle_t lock_all(int dev) {
    cudnnHandle_t h = (cudnnHandle_t)nb__cuda_cudnn_lock(dev);
    pthread_mutex_lock(&plans_lock);
    locked_dev = dev;
    return h;
}

static void unlock_all(void) {
    int dev = locked_dev;
    locked_dev = -1;
    pthread_mutex_unlock(&plans_lock);
    nb__cuda_cudnn_unlock(dev);
}

static cudnnStatus_t unlock_on_failure(cudnnStatus_t s) {
    if (s != CUDNN_STATUS_SUCCESS) unlock_all();
    return s;
}
#define DNN_CHECK(call) NB_CUDNN_CHECK(OP, unlock_on_failure(call))

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

static cudnnDataType_t cudnn_type(nb_dtype dt) { return nb__cudnn_dtype(OP, dt); }

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

/* The convolution of k in words, for error messages. */
typedef struct geom_text {
    char s[256];
} geom_text;

static geom_text geom_str(const conv_key *k) {
    const nb__conv2d_geom *g = &k->g;
    geom_text t;
    snprintf(t.s, sizeof t.s,
             "%s input (%lld, %lld, %lld, %lld), weight (%lld, %lld, %lld, %lld), stride (%lld, "
             "%lld), padding (%lld, %lld), dilation (%lld, %lld), groups %lld",
             nb_dtype_name((nb_dtype)k->dtype), (long long)g->n, (long long)g->c, (long long)g->h,
             (long long)g->w, (long long)g->o, (long long)(g->c / g->groups), (long long)g->kh,
             (long long)g->kw, (long long)g->sh, (long long)g->sw, (long long)g->ph,
             (long long)g->pw, (long long)g->dh, (long long)g->dw, (long long)g->groups);
    return t;
}

static void plan_make(conv_plan *p, const conv_key *k) {
    const nb__conv2d_geom *g = &k->g;
    cudnnDataType_t t = cudnn_type((nb_dtype)k->dtype);
    cudnnDataType_t acc = k->dtype == NB_F64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    DNN_CHECK(cudnnCreateTensorDescriptor(&p->xd));
    DNN_CHECK(cudnnCreateTensorDescriptor(&p->yd));
    DNN_CHECK(cudnnCreateFilterDescriptor(&p->wd));
    DNN_CHECK(cudnnCreateConvolutionDescriptor(&p->cd));
    DNN_CHECK(cudnnSetTensor4dDescriptor(p->xd, CUDNN_TENSOR_NCHW, t, dim(g->n), dim(g->c),
                                         dim(g->h), dim(g->w)));
    DNN_CHECK(cudnnSetTensor4dDescriptor(p->yd, CUDNN_TENSOR_NCHW, t, dim(g->n), dim(g->o),
                                         dim(g->oh), dim(g->ow)));
    DNN_CHECK(cudnnSetFilter4dDescriptor(p->wd, t, CUDNN_TENSOR_NCHW, dim(g->o),
                                         dim(g->c / g->groups), dim(g->kh), dim(g->kw)));
    DNN_CHECK(cudnnSetConvolution2dDescriptor(p->cd, dim(g->ph), dim(g->pw), dim(g->sh),
                                              dim(g->sw), dim(g->dh), dim(g->dw),
                                              CUDNN_CROSS_CORRELATION, acc));
    DNN_CHECK(cudnnSetConvolutionGroupCount(p->cd, dim(g->groups)));
    DNN_CHECK(cudnnSetConvolutionMathType(p->cd, base_math(k)));
    int on, oc, ohh, oww;
    DNN_CHECK(cudnnGetConvolution2dForwardOutputDim(p->cd, p->xd, p->wd, &on, &oc, &ohh,
                                                    &oww));
    if (on != g->n || oc != g->o || ohh != g->oh || oww != g->ow) {
        unlock_all();
        NB_ABORT("%s: cuDNN's output size (%d, %d, %d, %d) differs from (%lld, %lld, %lld, %lld)",
                 OP, on, oc, ohh, oww, (long long)g->n, (long long)g->o, (long long)g->oh,
                 (long long)g->ow);
    }
    for (int d = FWD; d <= BWD_FILTER; d++) p->c[d].have = false;
    p->key = *k;
    p->used = true;
}

/* Called with the locks held. */
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

/* A result we may run: it works, and it does not convert our data down to
 * f16 (CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION: f16's range and precision
 * for f32 or bf16 data; the descriptor never asks for it, so this only
 * guards against a heuristic that offers it anyway). */
template <typename Perf>
static bool usable(const Perf *r) {
    return r->status == CUDNN_STATUS_SUCCESS &&
           r->mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

/* Index of the algorithm to take among cnt heuristic results (or -1). */
template <typename Perf>
static int pick(const Perf *r, int cnt, size_t limit) {
    int any = -1;
    for (int i = 0; i < cnt; i++) {
        if (!usable(&r[i]) || r[i].memory > limit) continue;
        if (r[i].determinism == CUDNN_DETERMINISTIC) return i;
        if (any < 0) any = i;
    }
    if (any >= 0) return any;
    for (int i = 0; i < cnt; i++)
        if (usable(&r[i])) return i;
    return -1;
}

static bool fma_only(const conv_plan *p) { return base_math(&p->key) == CUDNN_FMA_MATH; }

static cudnnMathType_t run_math(const conv_plan *p, cudnnMathType_t chosen) {
    return fma_only(p) ? CUDNN_FMA_MATH : chosen;
}

#define MAX_ALGOS 16

static const char *direction_name(direction d) {
    return d == FWD ? "forward" : d == BWD_DATA ? "backward-data" : "backward-filter";
}

/* Chooses direction d's algorithm from cuDNN's heuristic results (pick),
 * for the plan's base math, and sizes its workspace. What differs between
 * the directions is cuDNN's query for the results (algos(r, &cnt), r an
 * array of MAX_ALGOS of its Perf type) and for an algorithm's workspace
 * (ws(algo, &bytes)). */
template <typename Perf, typename Algos, typename Ws>
static void choose(conv_plan *p, direction d, size_t limit, Algos algos, Ws ws) {
    Perf r[MAX_ALGOS];
    int cnt = 0;
    DNN_CHECK(cudnnSetConvolutionMathType(p->cd, base_math(&p->key)));
    DNN_CHECK(algos(r, &cnt));
    int i = pick(r, cnt, limit);
    if (i < 0) {
        unlock_all();
        NB_ABORT("%s: cuDNN has no %s algorithm for %s", OP, direction_name(d),
                 geom_str(&p->key).s);
    }
    conv_choice *c = &p->c[d];
    c->algo = (int)r[i].algo;
    c->math = run_math(p, r[i].mathType);
    DNN_CHECK(cudnnSetConvolutionMathType(p->cd, c->math));
    DNN_CHECK(ws(r[i].algo, &c->ws));
    c->have = true;
}

/* Validates what plan_make would otherwise abort on under the lock. */
static conv_key make_key(int device, nb_dtype dt, const nb__conv2d_geom *g) {
    conv_key k;
    memset(&k, 0, sizeof k);
    k.g = *g;
    k.device = device;
    k.dtype = dt;
    k.tf32 = dt == NB_F32 && nb__cuda_tf32();
    (void)cudnn_type(dt);
    if (g->groups < 1 || g->c % g->groups != 0 || g->o % g->groups != 0)
        NB_ABORT("%s: groups %lld do not divide the %lld input and %lld output channels", OP,
                 (long long)g->groups, (long long)g->c, (long long)g->o);
    const int64_t sizes[] = {g->n, g->c, g->h, g->w, g->o, g->kh, g->kw, g->oh, g->ow,
                             g->sh, g->sw, g->ph, g->pw, g->dh, g->dw, g->groups};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) (void)dim(sizes[i]);
    return k;
}

/* Chooses direction d's algorithm with cuDNN's queries of that direction:
 * its heuristic (Find) and its workspace (Ws), named by their middles
 * (ForwardAlgorithm_v7, ForwardWorkspaceSize), which take the
 * descriptors in the order a, b, the convolution, o. */
#define CHOOSE(Perf, Find, Ws, a, b, o)                                                       \
    choose<Perf>(                                                                             \
        p, d, limit,                                                                          \
        [&](Perf *r, int *cnt) {                                                              \
            return cudnnGetConvolution##Find(h, p->a, p->b, p->cd, p->o, MAX_ALGOS, cnt, r);  \
        },                                                                                    \
        [&](decltype(Perf::algo) al, size_t *bytes) {                                         \
            return cudnnGetConvolution##Ws(h, p->a, p->b, p->cd, p->o, al, bytes);            \
        })

/* The plan of k with the algorithm of direction d chosen. Called with the
 * locks held. */
static conv_plan *plan_for(const conv_key *k, cudnnHandle_t h, size_t limit, direction d) {
    conv_plan *p = plan_get(k);
    if (p->c[d].have) return p;
    if (d == FWD)
        CHOOSE(cudnnConvolutionFwdAlgoPerf_t, ForwardAlgorithm_v7, ForwardWorkspaceSize, xd, wd,
               yd);
    else if (d == BWD_DATA)
        CHOOSE(cudnnConvolutionBwdDataAlgoPerf_t, BackwardDataAlgorithm_v7,
               BackwardDataWorkspaceSize, wd, yd, xd);
    else
        CHOOSE(cudnnConvolutionBwdFilterAlgoPerf_t, BackwardFilterAlgorithm_v7,
               BackwardFilterWorkspaceSize, xd, yd, wd);
    return p;
}
#undef CHOOSE

/* The plan of direction d, its descriptor set to the math of d's
 * algorithm, and, in *ws, the device's workspace grown to what that
 * algorithm needs. Called with the locks held (lock_all); they stay held
 * until the call that uses *ws is enqueued. */
static conv_plan *prepare(const conv_key *k, cudnnHandle_t h, size_t limit, direction d,
                          void **ws) {
    conv_plan *p = plan_for(k, h, limit, d);
    size_t bytes = p->c[d].ws;
    if (nb__cuda_cudnn_workspace((int)k->device, bytes, ws) != NB_OK) {
        unlock_all();
        NB_ABORT("%s: the %s workspace of %zu bytes for %s cannot be had: %s", OP,
                 direction_name(d), bytes, geom_str(k).s, nb_last_error());
    }
    DNN_CHECK(cudnnSetConvolutionMathType(p->cd, p->c[d].math));
    return p;
}

/* ---------------------------------------------------------- entry points */
/* cuDNN's alpha (1) or beta (0) in the type its calls read for dt. */
static const void *scalar(nb_dtype dt, int v) {
    static const float f[2] = {0.0f, 1.0f};
    static const double d[2] = {0.0, 1.0};
    return dt == NB_F64 ? (const void *)&d[v] : (const void *)&f[v];
}

extern "C" void nb__cuda_conv2d(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g,
                                void *out, const void *x, const void *w, const void *b) {
    int dev = nb_ctx_device(ctx).index;
    cudaStream_t st = nb__cuda_enter(OP, dev);
    int64_t total = g->n * g->o * g->oh * g->ow;
    if (total == 0) return;
    if (g->c * g->kh * g->kw == 0) {
        NB_CUDA_CHECK(OP, cudaMemsetAsync(out, 0, (size_t)total * nb_dtype_size(dt), st));
    } else {
        conv_key k = make_key(dev, dt, g);
        size_t limit = nb__cuda_cudnn_workspace_limit(dev);
        const void *one = scalar(dt, 1), *zero = scalar(dt, 0);
        void *ws;
        cudnnHandle_t h = lock_all(dev);
        conv_plan *p = prepare(&k, h, limit, FWD, &ws);
        const conv_choice *c = &p->c[FWD];
        DNN_CHECK(cudnnConvolutionForward(h, one, p->xd, x, p->wd, w, p->cd,
                                          (cudnnConvolutionFwdAlgo_t)c->algo, ws, c->ws, zero,
                                          p->yd, out));
        unlock_all();
    }
    if (b) bias_add(st, dt, out, b, total, g->o, g->oh * g->ow);
}

extern "C" void nb__cuda_conv2d_backward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g,
                                         void *dx, void *dw, void *db, const void *gout,
                                         const void *x, const void *w) {
    int dev = nb_ctx_device(ctx).index;
    cudaStream_t st = nb__cuda_enter(OP, dev);
    size_t es = nb_dtype_size(dt);
    int64_t nx = g->n * g->c * g->h * g->w, nw = g->o * (g->c / g->groups) * g->kh * g->kw;
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
        conv_key k = make_key(dev, dt, g);
        size_t limit = nb__cuda_cudnn_workspace_limit(dev);
        const void *one = scalar(dt, 1), *zero = scalar(dt, 0);
        void *ws;
        cudnnHandle_t h = lock_all(dev);
        if (dx) {
            conv_plan *p = prepare(&k, h, limit, BWD_DATA, &ws);
            const conv_choice *c = &p->c[BWD_DATA];
            DNN_CHECK(cudnnConvolutionBackwardData(h, one, p->wd, w, p->yd, gout, p->cd,
                                                   (cudnnConvolutionBwdDataAlgo_t)c->algo, ws,
                                                   c->ws, zero, p->xd, dx));
        }
        if (dw) {
            /* may grow the workspace: the old buffer's free is queued after
             * the backward-data call above (Note [cuDNN workspace]) */
            conv_plan *p = prepare(&k, h, limit, BWD_FILTER, &ws);
            const conv_choice *c = &p->c[BWD_FILTER];
            DNN_CHECK(cudnnConvolutionBackwardFilter(h, one, p->xd, x, p->yd, gout, p->cd,
                                                     (cudnnConvolutionBwdFilterAlgo_t)c->algo, ws,
                                                     c->ws, zero, p->wd, dw));
        }
        unlock_all();
    }
    if (db) bias_grad(st, dt, db, gout, g->n, g->o, g->oh * g->ow);
}

extern "C" void nb__cuda_conv2d_workspace_sizes(int device, nb_dtype dt, const nb__conv2d_geom *g,
                                                size_t *bytes) {
    nb__cuda_use(OP, device);
    conv_key k = make_key(device, dt, g);
    size_t limit = nb__cuda_cudnn_workspace_limit(device);
    cudnnHandle_t h = lock_all(device);
    for (int i = FWD; i <= BWD_FILTER; i++) {
        direction d = (direction)i;
        bytes[i] = plan_for(&k, h, limit, d)->c[d].ws;
    }
    unlock_all();
}
