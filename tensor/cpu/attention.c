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
 * run on the model's thread) and set back after. Each thread of the
 * backward has its own T x T scratch. */
#include <cblas.h>
#include <stdlib.h>

#include "tensor/cpu/attention.h"
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

typedef struct heads_job {
    nb_tensor *y, *dqkv;
    const nb_tensor *qkv, *p, *gy;
    int h;
    double scale;
    char *scratch0, *scratch_more; /* thread 0's, then one per other thread */
} heads_job;

static void forward_pair(void *varg, int64_t pair, int tid) {
    (void)tid;
    const heads_job *j = varg;
    dims s = get_dims(j->qkv, j->h);
    int64_t w = 3 * s.c, tt = s.t * s.t, b = pair / j->h;
    int hh = (int)(pair % j->h);
    const char *q = at(j->qkv->data, &s, w, b, hh * s.d);
    const char *k = q + s.c * (int64_t)s.es, *v = q + 2 * s.c * (int64_t)s.es;
    char *ph = (char *)j->p->data + pair * tt * (int64_t)s.es;
    gemm(j->qkv->dtype, NB_TRI_LOWER, false, true, s.t, s.t, s.d, q, w, k, w, ph, s.t);
    nb__cpu_causal_rows(j->qkv->dtype, ph, ph, 1, s.t, s.t, j->scale);
    gemm(j->qkv->dtype, NB_TRI_K_UPTO_ROW, false, false, s.t, s.d, s.t, ph, s.t, v, w,
         at(j->y->data, &s, s.c, b, hh * s.d), s.c);
}

static void backward_pair(void *varg, int64_t pair, int tid) {
    const heads_job *j = varg;
    dims s = get_dims(j->qkv, j->h);
    int64_t w = 3 * s.c, tt = s.t * s.t, cb = s.c * (int64_t)s.es, b = pair / j->h;
    int hh = (int)(pair % j->h);
    nb_dtype dt = j->qkv->dtype;
    void *ds = tid == 0 ? j->scratch0 : j->scratch_more + (tid - 1) * tt * (int64_t)s.es;
    const char *q = at(j->qkv->data, &s, w, b, hh * s.d), *k = q + cb, *v = q + 2 * cb;
    char *dq = at(j->dqkv->data, &s, w, b, hh * s.d), *dk = dq + cb, *dv = dq + 2 * cb;
    const char *g = at(j->gy->data, &s, s.c, b, hh * s.d);
    const char *ph = (const char *)j->p->data + pair * tt * (int64_t)s.es;
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

static void run_pairs(int64_t pairs, int64_t per, nb__task_fn fn, heads_job *j) {
    /* only when the products go through OpenBLAS (f64, or no AVX2 kernel) */
    bool via_blas = j->qkv->dtype != NB_F32 || !nb__sgemm_kernel_on();
    int blas = via_blas ? openblas_get_num_threads() : 1;
    if (blas != 1) openblas_set_num_threads(1);
    group_job gj = {fn, j, pairs, per};
    nb__parallel_for(nb__chunk_count(pairs, per), run_group, &gj);
    if (blas != 1) openblas_set_num_threads(blas);
}

void nb__cpu_causal_attention(nb_tensor *y, nb_tensor *p, const nb_tensor *qkv, int h,
                              double scale) {
    heads_job j = {.y = y, .qkv = qkv, .p = p, .h = h, .scale = scale};
    run_pairs(qkv->shape[0] * h, pairs_per_chunk(qkv, h), forward_pair, &j);
}

void nb__cpu_causal_attention_backward(nb_tensor *dqkv, nb_tensor *scratch, const nb_tensor *qkv,
                                       const nb_tensor *p, const nb_tensor *gy, int h,
                                       double scale) {
    dims s = get_dims(qkv, h);
    int64_t pairs = s.n * h, per = pairs_per_chunk(qkv, h);
    int threads = nb__parallel_threads(nb__chunk_count(pairs, per));
    heads_job j = {.dqkv = dqkv, .qkv = qkv, .p = p, .gy = gy, .h = h, .scale = scale,
                   .scratch0 = scratch->data};
    if (threads > 1) {
        j.scratch_more = malloc((size_t)(threads - 1) * (size_t)(s.t * s.t) * s.es);
        NB_CHECK(j.scratch_more, "nb causal attention backward: out of memory for %d scratch "
                 "blocks of %lld x %lld", threads - 1, (long long)s.t, (long long)s.t);
    }
    run_pairs(pairs, per, backward_pair, &j);
    free(j.scratch_more);
}
