/* Adam/AdamW and SGD on CUDA: one fused launch over many parameters; and
 * gradient clipping's scaling by a norm on the device, one launch too.
 *
 * The per-tensor descriptors (pointers, size, the step's scalars) travel
 * by value as the kernel's parameter, up to MAX_TENSORS per launch (about
 * 24 KiB: CUDA 12.1+ allows 32 KiB of parameters; CUDA 13, which this
 * project builds with, needs a driver far newer than that). More
 * parameters take one launch per MAX_TENSORS. Each tensor is cut into
 * blocks of ELEMS elements; block b finds its tensor by binary search in
 * the launch's cumulative block counts.
 *
 * The per-step scalars are computed on the host in double exactly as
 * tensor/cpu/optim.c does (pow and sqrt included), then rounded
 * to the parameter's dtype; the element updates use the same operations
 * in the same order with the _rn intrinsics, which nvcc never contracts
 * into FMAs (the CPU build has none either). So f32 and f64 results are
 * the CPU's, bit for bit, as long as the CPU compiler does not contract
 * (no -march with FMA, or -ffp-contract=off).
 *
 * Letters: n elements of a parameter. */
#include <math.h>
#include <stdlib.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/launches.h"
#include "tensor/cuda/types.cuh"

enum { MAX_TENSORS = 192, THREADS = 256, ELEMS = 4 * THREADS };

enum { F_FIRST = 1, F_NESTEROV = 2, F_DECAY = 4, F_SHRINK = 8 };

typedef struct optim_desc {
    void *p, *g, *a, *b; /* Adam: a = exp_avg, b = exp_avg_sq; SGD: a = momentum buffer or NULL */
    void *c;             /* Adam: max_exp_avg_sq (AMSGrad) or NULL */
    void *h;             /* the parameter's 16-bit shadow (f32 parameters), or NULL */
    int64_t n;
    double s[8]; /* the step's scalars, in double; see the launchers */
    int flags;
    int hdt; /* the shadow's dtype (NB_BF16 or NB_F16) */
} optim_desc;

typedef struct optim_batch {
    int count;
    int pad;
    int64_t block_start[MAX_TENSORS + 1]; /* cumulative block counts */
    optim_desc d[MAX_TENSORS];
} optim_batch;
static_assert(sizeof(optim_batch) <= 32764, "optim_batch exceeds CUDA's 32 KiB kernel parameters");

/* ------------------------------------------------------------------ helpers */
static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
static __device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
static __device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
static __device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
static __device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
static __device__ __forceinline__ float div_(float a, float b) { return __fdiv_rn(a, b); }
static __device__ __forceinline__ double div_(double a, double b) { return __ddiv_rn(a, b); }
static __device__ __forceinline__ float sqrt_(float a) { return __fsqrt_rn(a); }
static __device__ __forceinline__ double sqrt_(double a) { return __dsqrt_rn(a); }

/* nb__update_extras' clip (tensor/backend.h): false when the update is
 * skipped (a norm that is not finite); else *coef is what the gradients
 * are multiplied by (1: not clipped), formed as clip_scale_kernel forms it. */
static __device__ __forceinline__ bool clip_coef(const double *norm, double max_norm, double *coef) {
    *coef = 1.0;
    if (!norm) return true;
    double v = *norm, c = div_(max_norm, add(v, 1e-6));
    if (!isfinite(v)) return false;
    if (c < 1.0) *coef = c;
    return true;
}

/* Gradient element gi as the update reads it: (gi * coef) rounded, as
 * clip_scale_kernel writes it. */
template <typename T> static __device__ __forceinline__ T clipped(T gi, double coef) {
    return coef < 1.0 ? (T)mul((double)gi, coef) : gi;
}

/* Note [Parameter shadows] (tensor/shadow.c): the updated f32 element,
 * rounded to nearest into the shadow; f64 parameters have none. */
static __device__ __forceinline__ void shadow_put(const optim_desc &d, int64_t i, float v) {
    if (!d.h) return;
    if (d.hdt == NB_BF16) ((bf16 *)d.h)[i] = __float2bfloat16_rn(v);
    else ((f16 *)d.h)[i] = __float2half_rn(v);
}
static __device__ __forceinline__ void shadow_put(const optim_desc &, int64_t, double) {}

/* A launch over `count` tensors gives tensor t the blocks from
 * block_start[t] on, ELEMS elements each. This block's tensor (the last t
 * with block_start[t] <= blockIdx.x) and, in [*start, *end), the elements
 * of its n_of(t) it takes. */
template <typename N>
static __device__ __forceinline__ int block_part(const int64_t *block_start, int count, N n_of,
                                                 int64_t *start, int64_t *end) {
    const int64_t b = blockIdx.x;
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (block_start[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    const int64_t n = n_of(lo);
    *start = (b - block_start[lo]) * ELEMS;
    *end = *start + ELEMS < n ? *start + ELEMS : n;
    return lo;
}

/* The descriptor of this block's tensor and its elements [*start, *end). */
static __device__ __forceinline__ const optim_desc &block_desc(const optim_batch &batch,
                                                               int64_t *start, int64_t *end) {
    auto n_of = [&](int t) { return batch.d[t].n; };
    return batch.d[block_part(batch.block_start, batch.count, n_of, start, end)];
}

/* ------------------------------------------------------------------ kernels */
/* tensor/cpu/optim.c's Adam loop; s = {l2, shrink, w, beta2, c2, neg_step, bc2_sqrt, eps};
 * AMSGrad when d.c is set (its maximum propagates NaN, as the CPU's does) */
template <typename T>
static __global__ void adam_kernel(const optim_batch batch, const double *clip, double max_norm) {
    double coef;
    if (!clip_coef(clip, max_norm, &coef)) return;
    int64_t start, end;
    const optim_desc &d = block_desc(batch, &start, &end);
    T *p = (T *)d.p, *m = (T *)d.a, *v = (T *)d.b, *vmax = (T *)d.c;
    const T *g = (const T *)d.g;
    const T l2 = (T)d.s[0], shrink = (T)d.s[1], w = (T)d.s[2], w1 = sub((T)1, w);
    const bool lerp_lo = (double)w < 0.5, shrink_on = (d.flags & F_SHRINK) != 0;
    const T beta2 = (T)d.s[3], c2 = (T)d.s[4], neg_step = (T)d.s[5], bc2_sqrt = (T)d.s[6];
    const T eps = (T)d.s[7];
    for (int64_t i = start + threadIdx.x; i < end; i += THREADS) {
        T pi = p[i], gi = clipped(g[i], coef), mo = m[i];
        if (l2 != (T)0) gi = add(gi, mul(l2, pi));
        if (shrink_on) pi = mul(pi, shrink);
        T mi = lerp_lo ? add(mo, mul(w, sub(gi, mo))) : sub(gi, mul(sub(gi, mo), w1));
        T vi = add(mul(v[i], beta2), mul(mul(c2, gi), gi));
        T si = vi;
        if (vmax) {
            T prev = vmax[i];
            si = vi > prev || vi != vi ? vi : prev;
            vmax[i] = si;
        }
        T denom = add(div_(sqrt_(si), bc2_sqrt), eps);
        T pn = add(pi, mul(neg_step, div_(mi, denom)));
        p[i] = pn;
        shadow_put(d, i, pn);
        m[i] = mi;
        v[i] = vi;
    }
}

/* tensor/cpu/optim.c's SGD loop; s = {lr, wd, momentum, 1 - dampening} */
template <typename T>
static __global__ void sgd_kernel(const optim_batch batch, const double *clip, double max_norm) {
    double coef;
    if (!clip_coef(clip, max_norm, &coef)) return;
    int64_t start, end;
    const optim_desc &d = block_desc(batch, &start, &end);
    T *p = (T *)d.p, *buf = (T *)d.a;
    const T *g = (const T *)d.g;
    const T lr = (T)d.s[0], wd = (T)d.s[1], mom = (T)d.s[2], keep = (T)d.s[3], neg_lr = -lr;
    const bool first = (d.flags & F_FIRST) != 0, nesterov = (d.flags & F_NESTEROV) != 0;
    const bool decay = (d.flags & F_DECAY) != 0;
    for (int64_t i = start + threadIdx.x; i < end; i += THREADS) {
        T pi = p[i];
        T gi = clipped(g[i], coef);
        T di = decay ? add(gi, mul(wd, pi)) : gi;
        if (buf) {
            T b = first ? di : add(mul(buf[i], mom), mul(keep, di));
            buf[i] = b;
            di = nesterov ? add(di, mul(mom, b)) : b;
        }
        T pn = add(pi, mul(neg_lr, di));
        p[i] = pn;
        shadow_put(d, i, pn);
    }
}

/* Gradient clipping's scaling (nb__backend_clip_scale_fn): f32 tensors,
 * the coefficient formed here from the norm on the device, in double as
 * optim/clip.c forms it on the host, each element (float)(x * coef) as
 * tensor/cpu/optim.c's scale: the CPU's bits. CLIP_BATCH tensors per
 * launch, ELEMS elements per block. */
enum { CLIP_BATCH = 128 };
static_assert((int)CLIP_BATCH == (int)NB__CUDA_CLIP_TENSORS_PER_LAUNCH &&
                  (int)MAX_TENSORS == (int)NB__CUDA_OPTIM_TENSORS_PER_LAUNCH,
              "tensor/cuda/launches.h counts this file's launches");
typedef struct clip_batch {
    int count;
    int pad;
    int64_t block_start[CLIP_BATCH + 1];
    float *p[CLIP_BATCH];
    int64_t n[CLIP_BATCH];
} clip_batch;
static_assert(sizeof(clip_batch) <= 4096, "clip_batch: keep the launch's parameters small");

static __global__ void clip_scale_kernel(const clip_batch b, const double *norm, double max_norm) {
    double v = *norm, coef = div_(max_norm, add(v, 1e-6));
    if (!isfinite(v) || !(coef < 1.0)) return;
    int64_t i0, end;
    float *x = b.p[block_part(b.block_start, b.count, [&](int t) { return b.n[t]; }, &i0, &end)];
    for (int64_t i = i0 + threadIdx.x; i < end; i += THREADS)
        x[i] = (float)mul((double)x[i], coef); /* round to nearest, as the CPU */
}

/* ---------------------------------------------------------------- launchers */
/* Launches kernel over descriptors [0, n) in batches of MAX_TENSORS. */
template <typename T>
static void launch_batches(const char *op, cudaStream_t s, bool adam, const optim_desc *desc,
                           int n, const nb__update_extras *x) {
    const double *clip = x && x->clip_norm ? (const double *)x->clip_norm->data : nullptr;
    double max_norm = x ? x->max_norm : 0;
    optim_batch batch;
    for (int first = 0; first < n; first += MAX_TENSORS) {
        int count = n - first < MAX_TENSORS ? n - first : MAX_TENSORS;
        batch.count = 0;
        batch.pad = 0;
        int64_t blocks = 0;
        for (int k = 0; k < count; k++) {
            const optim_desc *d = &desc[first + k];
            if (d->n == 0) continue;
            batch.d[batch.count] = *d;
            batch.block_start[batch.count] = blocks;
            blocks += (d->n + ELEMS - 1) / ELEMS;
            batch.count++;
        }
        batch.block_start[batch.count] = blocks;
        if (blocks == 0) continue;
        NB_CHECK(blocks <= INT32_MAX, "%s: %lld blocks in one launch; too many elements", op,
                 (long long)blocks);
        if (adam) adam_kernel<T><<<(unsigned)blocks, THREADS, 0, s>>>(batch, clip, max_norm);
        else sgd_kernel<T><<<(unsigned)blocks, THREADS, 0, s>>>(batch, clip, max_norm);
        NB_CUDA_CHECK_LAUNCH(op);
    }
}

static void check_params(const char *op, int n, nb_tensor *const *p, nb_tensor *const *g) {
    for (int i = 0; i < n; i++) {
        NB_CHECK(p[i]->dtype == p[0]->dtype && nb_device_eq(p[i]->device, p[0]->device),
                 "%s: parameters %d (%s, %s) and 0 (%s, %s) differ in dtype or device", op, i,
                 nb_dtype_name(p[i]->dtype), nb_device_name(p[i]->device),
                 nb_dtype_name(p[0]->dtype), nb_device_name(p[0]->device));
        NB_CHECK(g[i]->dtype == p[i]->dtype && nb_numel(g[i]) == nb_numel(p[i]),
                 "%s: gradient %d is %s %s, its parameter %s %s", op, i,
                 nb_dtype_name(g[i]->dtype), nb_shape_str(g[i]), nb_dtype_name(p[i]->dtype),
                 nb_shape_str(p[i]));
    }
    NB_CHECK(p[0]->dtype == NB_F32 || p[0]->dtype == NB_F64,
             "%s: parameters are %s; the CUDA optimizers update f32 or f64", op,
             nb_dtype_name(p[0]->dtype));
}

/* The extras (tensor/backend.h) on p's device: the norm 0-d f64, each
 * shadow a contiguous 16-bit tensor of an f32 parameter's size. */
static void check_extras(const char *op, int n, nb_tensor *const *p, const nb__update_extras *x) {
    if (!x) return;
    const nb_tensor *c = x->clip_norm;
    NB_CHECK(!c || (c->dtype == NB_F64 && c->ndim == 0 && nb_device_eq(c->device, p[0]->device)),
             "%s: the clip norm must be a 0-d f64 tensor on %s, got %s %s on %s", op,
             nb_device_name(p[0]->device), c ? nb_dtype_name(c->dtype) : "", c ? nb_shape_str(c) : "",
             c ? nb_device_name(c->device) : "");
    for (int i = 0; x->shadow && i < n; i++) {
        const nb_tensor *h = x->shadow[i];
        NB_CHECK(!h || ((h->dtype == NB_BF16 || h->dtype == NB_F16) && p[i]->dtype == NB_F32 &&
                        nb_is_contiguous(h) && nb_numel(h) == nb_numel(p[i]) &&
                        nb_device_eq(h->device, p[i]->device)),
                 "%s: the shadow of parameter %d (%s %s) is %s %s", op, i,
                 nb_dtype_name(p[i]->dtype), nb_shape_str(p[i]), nb_dtype_name(h->dtype),
                 nb_shape_str(h));
    }
}

static void put_shadow(optim_desc *d, int i, const nb__update_extras *x) {
    const nb_tensor *h = x && x->shadow ? x->shadow[i] : NULL;
    d->h = h ? h->data : NULL;
    d->hdt = h ? (int)h->dtype : 0;
}

/* ------------------------------------------------------------- entry points */
/* One multi-tensor update: the parameters and gradients checked, one
 * descriptor per parameter (its pointers and size here; its state and
 * scalars from fill(i, d), the descriptor zeroed before), launched in
 * batches (adam: Adam's kernel, else SGD's). */
template <typename Fill>
static void update(const char *op, bool adam, int n, nb_tensor *const *p, nb_tensor *const *g,
                   const nb__update_extras *x, Fill fill) {
    if (n <= 0) return;
    cudaStream_t s = nb__cuda_enter(op, p[0]->device.index);
    check_params(op, n, p, g);
    check_extras(op, n, p, x);
    optim_desc *desc = (optim_desc *)calloc((size_t)n, sizeof *desc);
    NB_CHECK(desc, "%s: out of memory for %d descriptors", op, n);
    for (int i = 0; i < n; i++) {
        optim_desc *d = &desc[i];
        d->p = p[i]->data;
        d->g = g[i]->data;
        d->n = nb_numel(p[i]);
        put_shadow(d, i, x);
        fill(i, d);
    }
    if (p[0]->dtype == NB_F32) launch_batches<float>(op, s, adam, desc, n, x);
    else launch_batches<double>(op, s, adam, desc, n, x);
    free(desc);
}

void nb__cuda_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m,
                   nb_tensor *const *v, nb_tensor *const *vmax, const int64_t *steps,
                   const double *const *hp, bool decoupled, const nb__update_extras *x) {
    const char *op = decoupled ? "nb_optim_step (adamw)" : "nb_optim_step (adam)";
    update(op, true, n, p, g, x, [&](int i, optim_desc *d) {
        const double *h = hp[i];
        double lr = h[NB__HP_LR], wd = h[NB__HP_WEIGHT_DECAY];
        double b1 = h[NB__HP_BETA1], b2 = h[NB__HP_BETA2];
        double bc1 = 1.0 - pow(b1, (double)steps[i]), bc2 = 1.0 - pow(b2, (double)steps[i]);
        d->a = m[i]->data;
        d->b = v[i]->data;
        d->c = vmax && vmax[i] ? vmax[i]->data : NULL;
        d->s[0] = decoupled ? 0.0 : wd;
        d->s[1] = 1.0 - lr * wd;
        d->s[2] = 1.0 - b1;
        d->s[3] = b2;
        d->s[4] = 1.0 - b2;
        d->s[5] = -(lr / bc1);
        d->s[6] = sqrt(bc2);
        d->s[7] = h[NB__HP_EPS];
        d->flags = decoupled && wd != 0 ? F_SHRINK : 0;
    });
}

void nb__cuda_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf,
                  const int64_t *steps, const double *const *hp, const nb__update_extras *x) {
    update("nb_optim_step (sgd)", false, n, p, g, x, [&](int i, optim_desc *d) {
        const double *h = hp[i];
        d->a = buf && buf[i] ? buf[i]->data : NULL;
        d->s[0] = h[NB__HP_LR];
        d->s[1] = h[NB__HP_WEIGHT_DECAY];
        d->s[2] = h[NB__HP_MOMENTUM];
        d->s[3] = 1.0 - h[NB__HP_DAMPENING];
        d->flags = (steps[i] == 1 ? F_FIRST : 0) | (h[NB__HP_NESTEROV] != 0 ? F_NESTEROV : 0) |
                   (h[NB__HP_WEIGHT_DECAY] != 0 ? F_DECAY : 0);
    });
}

void nb__cuda_clip_scale(int n, nb_tensor *const *ts, const nb_tensor *norm, double max_norm) {
    const char *op = "nb_clip_grad_norm";
    int dev = norm->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    NB_CHECK(norm->dtype == NB_F64 && norm->ndim == 0,
             "%s: the norm must be a 0-d f64 tensor, got %s %s", op, nb_dtype_name(norm->dtype),
             nb_shape_str(norm));
    clip_batch b;
    for (int first = 0; first < n; first += CLIP_BATCH) {
        int count = n - first < CLIP_BATCH ? n - first : CLIP_BATCH;
        int64_t blocks = 0;
        b.count = 0;
        b.pad = 0;
        for (int k = 0; k < count; k++) {
            const nb_tensor *t = ts[first + k];
            NB_CHECK(t->dtype == NB_F32 && nb_is_contiguous(t) && nb_device_eq(t->device, norm->device),
                     "%s: gradient %d must be a contiguous f32 tensor on %s, got %s %s on %s", op,
                     first + k, nb_device_name(norm->device), nb_dtype_name(t->dtype),
                     nb_shape_str(t), nb_device_name(t->device));
            int64_t m = nb_numel(t);
            if (m == 0) continue;
            b.p[b.count] = (float *)t->data;
            b.n[b.count] = m;
            b.block_start[b.count] = blocks;
            blocks += (m + ELEMS - 1) / ELEMS;
            b.count++;
        }
        b.block_start[b.count] = blocks;
        if (blocks == 0) continue;
        NB_CHECK(blocks <= INT32_MAX, "%s: %lld blocks in one launch; too many elements", op,
                 (long long)blocks);
        clip_scale_kernel<<<(unsigned)blocks, THREADS, 0, s>>>(b, (const double *)norm->data,
                                                               max_norm);
        NB_CUDA_CHECK_LAUNCH(op);
    }
}
