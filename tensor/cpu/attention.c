/* CPU kernels of fused causal self-attention (tensor/cpu/attention.h).
 *
 * Each head is a handful of small GEMMs that read q, k and v in place
 * inside qkv's rows (leading dimension 3C) and write y and dqkv in place
 * too (leading dimensions C and 3C), so that the split, the head
 * transposes and their copies of the composed form (and, in backward, the
 * zeroed gradient buffer the three slices add into) disappear. A head's
 * scores are used right after they are made, while they are in cache. The
 * products are the ones the composed form makes, in f32 without the terms
 * the causal mask makes zero (Note [Causal products] in
 * tensor/cpu/sgemm.h), and the softmax rows are nb__cpu_softmax_causal's.
 *
 * Note [Heads on the thread pool]: the (batch, head) pairs are independent
 * and run on nabla's thread pool, each pair's GEMMs on one thread. These
 * GEMMs are small (T x T x D): OpenBLAS (Debian's pthread build) runs
 * such a product on its own threads and gets slower (issue 15 measured
 * 85 -> 35 GFLOP/s on two cores; `bench_ops --kernels` compares one caller
 * on 1 and 2 BLAS threads with two callers on 1), and its threaded calls
 * from several threads at once are serialised by a lock. So when the
 * products go through OpenBLAS (f64, or no AVX2 kernel for f32), it is set
 * to one thread for the duration of the kernel (openblas_set_num_threads
 * is process-wide; nothing else calls BLAS while a kernel runs, as kernels
 * run on the model's thread) and set back after. Each thread has its own
 * T x T scratch (two in backward), from the step's context.
 *
 * Note [Attention without stored probabilities]: the forward keeps no
 * probabilities. They would be N H T T elements per block, against about
 * 16 N T C for everything else a block keeps for its backward: at GPT-2
 * small's shape (H = 12, T = 1024, C = 768) as much again. The backward makes
 * each head's probabilities again in its scratch, with the same products
 * and the same softmax rows as the forward, so they are the same bits and
 * the gradients are what they were when the probabilities were kept; it
 * costs one more T x T x D product (half of it, causal) and a softmax per
 * head, about a sixth more attention work in a step. This is the shape of
 * a fused ("flash") attention on a GPU, which keeps only each row's
 * log-sum-exp; on the CPU a head's whole T x T block fits in cache, so
 * the rows are simply made again, and the forward's y and log-sum-exp
 * that the contract hands the backward (Note [Attention contract] in
 * tensor/backend.h) go unread. The forward writes the log-sum-exp from
 * its softmax rows' own maximum and sum, at no extra cost. */
#include <cblas.h>

#include "tensor/cpu/attention.h"
#include "tensor/cpu/bf16.h"
#include "tensor/cpu/sgemm.h"
#include "tensor/cpu/softmax.h"
#include "tensor/cpu/threads.h"
#include "tensor/internal.h"

/* c (m, n), ldc = op(a) (m, k) @ op(b) (k, n), row-major, beta = 0; f32
 * through nb__sgemm_causal with the product's causal structure `tri`
 * (Note [Causal products] in tensor/cpu/sgemm.h), f64 (gradchecks) whole
 * through OpenBLAS. */
static void gemm(nb_dtype dt, nb__tri tri, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                 const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc) {
    if (dt == NB_F32)
        nb__sgemm_causal(tri, ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
    else
        cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    (int)m, (int)n, (int)k, 1.0, a, (int)lda, b, (int)ldb, 0.0, c, (int)ldc);
}

typedef struct dims {
    int64_t n, t, c, d;
    size_t es;
} dims;

static dims get_dims(const nb_tensor *qkv, int h) {
    dims s = {qkv->shape[0], qkv->shape[1], qkv->shape[2] / 3, qkv->shape[2] / 3 / h,
              nb_dtype_size(qkv->dtype)};
    return s;
}

/* address of element (b, 0, col) of a (N, T, w) tensor */
static char *at(const void *base, const dims *s, int64_t w, int64_t b, int64_t col) {
    return (char *)base + (b * s->t * w + col) * (int64_t)s->es;
}

/* Note [bf16 attention without twins]
 * On bf16 qkv (Note [bf16 activations on the CPU] in tensor/cpu/bf16.c) a
 * pair widens its head's q, k and v (and, in backward, gy) into f32
 * blocks of its thread's scratch, (T, D) each with leading dimension D,
 * runs the f32 products and rows on them, and rounds its (T, D) results
 * into y (dqkv) once. The f32 GEMMs' values do not depend on the leading
 * dimensions (Note [Causal products] in tensor/cpu/sgemm.h: one chain of
 * multiply-adds per element, k in order), so this is the f32 kernel on
 * the widened tensors, rounded at its outputs, bit for bit, without the
 * whole-tensor f32 copies of qkv, gy, y and dqkv; the head's operands stay
 * in cache from widening to use. STAGED blocks of (T, D) per thread:
 * q, k, v, y forward; q, k, v, gy, dq, dk, dv backward. */
static int staged(nb_dtype dt, int blocks) { return dt == NB_BF16 ? (blocks == 1 ? 4 : 7) : 0; }

/* what a pair computes in: f32 for bf16 qkv */
static nb_dtype work_dtype(nb_dtype dt) { return dt == NB_BF16 ? NB_F32 : dt; }

typedef struct heads_job {
    nb_tensor *y, *dqkv, *lse;
    const nb_tensor *qkv, *gy;
    int h;
    double scale;
    char *scratch; /* per thread: `blocks` T x T blocks, then the staged (T, D) blocks */
    int blocks;
} heads_job;

static size_t thread_scratch(const dims *s, nb_dtype dt, int blocks) {
    size_t ws = nb_dtype_size(work_dtype(dt));
    return ((size_t)blocks * (size_t)(s->t * s->t) + (size_t)staged(dt, blocks) * (size_t)(s->t * s->d)) * ws;
}

static char *scratch_of(const heads_job *j, const dims *s, int tid, int block) {
    nb_dtype dt = j->qkv->dtype;
    return j->scratch + (size_t)tid * thread_scratch(s, dt, j->blocks) +
           (size_t)block * (size_t)(s->t * s->t) * nb_dtype_size(work_dtype(dt));
}

/* staged (T, D) block i of thread tid (bf16 qkv) */
static float *staged_of(const heads_job *j, const dims *s, int tid, int i) {
    return (float *)scratch_of(j, s, tid, j->blocks) + i * s->t * s->d;
}

/* f32 (T, D), leading dimension D = bf16 rows of a head (leading dimension ld) */
static void widen_head(float *dst, const char *src, const dims *s, int64_t ld) {
    for (int64_t r = 0; r < s->t; r++)
        nb__f32_from_bf16_n(dst + r * s->d, (const uint16_t *)src + r * ld, s->d);
}

static void narrow_head(char *dst, const float *src, const dims *s, int64_t ld) {
    for (int64_t r = 0; r < s->t; r++)
        nb__bf16_from_f32_n((uint16_t *)dst + r * ld, src + r * s->d, s->d);
}

/* p (T, T) = head hh of batch b's causal softmax of scale q k^T, and the
 * rows' log-sum-exp in lse (T) unless NULL: the same products and rows in
 * forward and backward, so the same bits. q and k have leading dimension
 * ld, in dtype dt. */
static void probabilities(const heads_job *j, const dims *s, nb_dtype dt, const char *q,
                          const char *k, int64_t ld, char *p, float *lse) {
    gemm(dt, NB_TRI_LOWER, false, true, s->t, s->t, s->d, q, ld, k, ld, p, s->t);
    nb__cpu_causal_rows(dt, p, lse, p, 1, s->t, s->t, j->scale);
}

static void forward_pair_bf16(const heads_job *j, const dims *s, int64_t pair, int tid) {
    int64_t w = 3 * s->c, b = pair / j->h, d = s->d;
    int hh = (int)(pair % j->h);
    const char *q = at(j->qkv->data, s, w, b, hh * d);
    int64_t cb = s->c * (int64_t)s->es;
    float *q32 = staged_of(j, s, tid, 0), *k32 = staged_of(j, s, tid, 1);
    float *v32 = staged_of(j, s, tid, 2), *y32 = staged_of(j, s, tid, 3);
    widen_head(q32, q, s, w);
    widen_head(k32, q + cb, s, w);
    widen_head(v32, q + 2 * cb, s, w);
    char *ph = scratch_of(j, s, tid, 0);
    probabilities(j, s, NB_F32, (const char *)q32, (const char *)k32, d, ph,
                  (float *)j->lse->data + pair * s->t);
    gemm(NB_F32, NB_TRI_K_UPTO_ROW, false, false, s->t, d, s->t, ph, s->t, v32, d, y32, d);
    narrow_head(at(j->y->data, s, s->c, b, hh * d), y32, s, s->c);
}

static void backward_pair_bf16(const heads_job *j, const dims *s, int64_t pair, int tid) {
    int64_t w = 3 * s->c, b = pair / j->h, d = s->d, cb = s->c * (int64_t)s->es;
    int hh = (int)(pair % j->h);
    char *ph = scratch_of(j, s, tid, 0), *ds = scratch_of(j, s, tid, 1);
    float *q32 = staged_of(j, s, tid, 0), *k32 = staged_of(j, s, tid, 1);
    float *v32 = staged_of(j, s, tid, 2), *g32 = staged_of(j, s, tid, 3);
    float *dq32 = staged_of(j, s, tid, 4), *dk32 = staged_of(j, s, tid, 5);
    float *dv32 = staged_of(j, s, tid, 6);
    const char *q = at(j->qkv->data, s, w, b, hh * d);
    char *dq = at(j->dqkv->data, s, w, b, hh * d);
    widen_head(q32, q, s, w);
    widen_head(k32, q + cb, s, w);
    widen_head(v32, q + 2 * cb, s, w);
    widen_head(g32, at(j->gy->data, s, s->c, b, hh * d), s, s->c);
    probabilities(j, s, NB_F32, (const char *)q32, (const char *)k32, d, ph, NULL);
    gemm(NB_F32, NB_TRI_LOWER, false, true, s->t, s->t, d, g32, d, v32, d, ds, s->t); /* dp */
    nb__cpu_causal_rows_backward(NB_F32, ds, ph, ds, 1, s->t, s->t, j->scale);
    gemm(NB_F32, NB_TRI_K_UPTO_ROW, false, false, s->t, d, s->t, ds, s->t, k32, d, dq32, d);
    gemm(NB_F32, NB_TRI_K_FROM_ROW, true, false, s->t, d, s->t, ds, s->t, q32, d, dk32, d);
    gemm(NB_F32, NB_TRI_K_FROM_ROW, true, false, s->t, d, s->t, ph, s->t, g32, d, dv32, d);
    narrow_head(dq, dq32, s, w);
    narrow_head(dq + cb, dk32, s, w);
    narrow_head(dq + 2 * cb, dv32, s, w);
}

static void forward_pair(void *varg, int64_t pair, int tid) {
    const heads_job *j = varg;
    dims s = get_dims(j->qkv, j->h);
    if (j->qkv->dtype == NB_BF16) {
        forward_pair_bf16(j, &s, pair, tid);
        return;
    }
    int64_t w = 3 * s.c, b = pair / j->h;
    int hh = (int)(pair % j->h);
    const char *q = at(j->qkv->data, &s, w, b, hh * s.d);
    const char *k = q + s.c * (int64_t)s.es, *v = q + 2 * s.c * (int64_t)s.es;
    char *ph = scratch_of(j, &s, tid, 0);
    probabilities(j, &s, j->qkv->dtype, q, k, w, ph, (float *)j->lse->data + pair * s.t);
    gemm(j->qkv->dtype, NB_TRI_K_UPTO_ROW, false, false, s.t, s.d, s.t, ph, s.t, v, w,
         at(j->y->data, &s, s.c, b, hh * s.d), s.c);
}

static void backward_pair(void *varg, int64_t pair, int tid) {
    const heads_job *j = varg;
    dims s = get_dims(j->qkv, j->h);
    if (j->qkv->dtype == NB_BF16) {
        backward_pair_bf16(j, &s, pair, tid);
        return;
    }
    int64_t w = 3 * s.c, cb = s.c * (int64_t)s.es, b = pair / j->h;
    int hh = (int)(pair % j->h);
    nb_dtype dt = j->qkv->dtype;
    char *ph = scratch_of(j, &s, tid, 0), *ds = scratch_of(j, &s, tid, 1);
    const char *q = at(j->qkv->data, &s, w, b, hh * s.d), *k = q + cb, *v = q + 2 * cb;
    char *dq = at(j->dqkv->data, &s, w, b, hh * s.d), *dk = dq + cb, *dv = dq + 2 * cb;
    const char *g = at(j->gy->data, &s, s.c, b, hh * s.d);
    probabilities(j, &s, dt, q, k, w, ph, NULL);
    gemm(dt, NB_TRI_LOWER, false, true, s.t, s.t, s.d, g, s.c, v, w, ds, s.t); /* dp */
    nb__cpu_causal_rows_backward(dt, ds, ph, ds, 1, s.t, s.t, j->scale);
    gemm(dt, NB_TRI_K_UPTO_ROW, false, false, s.t, s.d, s.t, ds, s.t, k, w, dq, w);
    gemm(dt, NB_TRI_K_FROM_ROW, true, false, s.t, s.d, s.t, ds, s.t, q, w, dk, w);
    gemm(dt, NB_TRI_K_FROM_ROW, true, false, s.t, s.d, s.t, ph, s.t, g, s.c, dv, w);
}

/* Note [Heads on the thread pool]. Pairs of fewer than ~2^18 multiply-adds
 * (T = 64, D = 64) go in groups, so that a chunk is worth waking a thread
 * for. */
typedef struct group_job {
    nb__task_fn fn;
    heads_job *j;
    int64_t pairs, per;
} group_job;

static void run_group(void *varg, int64_t c, int tid) {
    const group_job *gj = varg;
    for (int64_t q = c * gj->per; q < (c + 1) * gj->per && q < gj->pairs; q++) gj->fn(gj->j, q, tid);
}

static int64_t pairs_per_chunk(const nb_tensor *qkv, int h) {
    dims s = get_dims(qkv, h);
    int64_t work = s.t * s.t * (s.d > 0 ? s.d : 1);
    return work >= ((int64_t)1 << 18) ? 1 : ((int64_t)1 << 18) / work;
}

size_t nb__cpu_attention_scratch_bytes(const nb_tensor *qkv, int h, int blocks) {
    dims s = get_dims(qkv, h);
    int64_t pairs = s.n * h, per = pairs_per_chunk(qkv, h);
    int threads = nb__parallel_threads(nb__chunk_count(pairs, per));
    return (size_t)threads * thread_scratch(&s, qkv->dtype, blocks);
}

/* Whether bf16 attention runs without twins (Note [bf16 attention without
 * twins]): out (y or dqkv), qkv and gy (when not NULL) all bf16 and
 * contiguous, as the front end makes them; anything else takes the twins. */
bool nb__cpu_attention_bf16_direct(const nb_tensor *out, const nb_tensor *qkv,
                                   const nb_tensor *gy) {
    return out->dtype == NB_BF16 && qkv->dtype == NB_BF16 && (!gy || gy->dtype == NB_BF16) &&
           nb_is_contiguous(out) && nb_is_contiguous(qkv) && (!gy || nb_is_contiguous(gy));
}

/* Runs fn over every (batch, head) pair with `blocks` T x T blocks of
 * scratch per thread, taken from ctx and given back at the end. */
static void run_pairs(nb_ctx *ctx, nb__task_fn fn, heads_job *j, int blocks) {
    dims s = get_dims(j->qkv, j->h);
    int64_t pairs = s.n * j->h, per = pairs_per_chunk(j->qkv, j->h);
    size_t bytes = nb__cpu_attention_scratch_bytes(j->qkv, j->h, blocks);
    j->blocks = blocks;
    j->scratch = bytes ? nb_ctx_alloc(ctx, bytes, 0) : NULL;
    /* only when the products go through OpenBLAS (f64, or no AVX2 kernel) */
    bool via_blas = j->qkv->dtype == NB_F64 || !nb__sgemm_kernel_on();
    int blas = via_blas ? openblas_get_num_threads() : 1;
    if (blas != 1) openblas_set_num_threads(1);
    group_job gj = {fn, j, pairs, per};
    nb__parallel_for(nb__chunk_count(pairs, per), run_group, &gj);
    if (blas != 1) openblas_set_num_threads(blas);
    if (bytes) nb__ctx_scratch_done(ctx, j->scratch, bytes);
}

void nb__cpu_causal_attention(nb_ctx *ctx, nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv,
                              int h, double scale) {
    if (nb__cpu_is_bf16(qkv) && !nb__cpu_attention_bf16_direct(y, qkv, NULL)) {
        nb__cpu_causal_attention_bf16(ctx, y, lse, qkv, h, scale);
        return;
    }
    heads_job j = {.y = y, .lse = lse, .qkv = qkv, .h = h, .scale = scale};
    run_pairs(ctx, forward_pair, &j, 1);
}

/* y and lse are not read: the probabilities are made whole again
 * (Note [Attention without stored probabilities]). */
void nb__cpu_causal_attention_backward(nb_ctx *ctx, nb_tensor *dqkv, const nb_tensor *qkv,
                                       const nb_tensor *y, const nb_tensor *lse,
                                       const nb_tensor *gy, int h, double scale) {
    if (nb__cpu_is_bf16(qkv) && !nb__cpu_attention_bf16_direct(dqkv, qkv, gy)) {
        nb__cpu_causal_attention_backward_bf16(ctx, dqkv, qkv, y, lse, gy, h, scale);
        return;
    }
    (void)y, (void)lse;
    heads_job j = {.dqkv = dqkv, .qkv = qkv, .gy = gy, .h = h, .scale = scale};
    run_pairs(ctx, backward_pair, &j, 2);
}
