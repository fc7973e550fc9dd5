/* PowerSGD (nb_ddp_set_powersgd): a communication hook that sends a rank-r
 * approximation of each gradient matrix instead of the matrix, with error
 * feedback and warm start, after a number of steps of plain all-reduce
 * (Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient Compression
 * for Distributed Optimization"; the semantics of PyTorch's powerSGD_hook).
 *
 * Note [PowerSGD]
 * Per bucket, once `start_iter` synchronised steps have run plain:
 * - g = the bucket's gradients, plus the bucket's error from the last step
 *   (error feedback; zeros the first time), kept until the step's end.
 * - Each parameter is viewed as an n x m matrix M (n = its first
 *   dimension). With k = min(n, m, rank) it is compressed when
 *   (n + m) k * min_compression_rate < n m; the others (vectors among them)
 *   are all-reduced as they are.
 * - Q (m x k): the last step's Q (warm start), else standard normal values
 *   from an nb_rng seeded with `seed` (nb_rand_normal, f64, shape (m, k),
 *   matrix by matrix in bucket order; the generator goes on across steps),
 *   then orthogonalised (Gram-Schmidt, columns normalised in order).
 * - P = M Q; one all-reduce carries the uncompressed values and every P;
 *   each P is orthogonalised; Q = M^T P; a second all-reduce carries the
 *   Qs (the reducer's op, normally the average, is used for both: the
 *   orthogonalisation does not see a scale, so this is PyTorch's sum for
 *   P and average for Q).
 * - M = P Q^T; error = g - M, the whole bucket (for the uncompressed
 *   values too: the local value minus the average, as PyTorch's hook);
 *   Q is kept for the next step with warm start.
 * Bytes on the wire per bucket: (uncompressed + sum n k + sum m k)
 * elements, against the bucket's numel. The hook has two stages (Note
 * [Two-stage communication hooks] in ddp_reducer.h): bucket b's launch
 * computes its Ps and starts their all-reduce without waiting for it;
 * bucket b+1's launch (a point fixed by the bucket order, the same on
 * every rank) waits for it, computes b's Qs and starts theirs; finish
 * does the same for the last bucket and waits for the Qs. So the Ps and
 * Qs travel while backward goes on, and backward waits only where a
 * bucket's Ps have not arrived by the time the next bucket is complete.
 * State is per bucket and starts afresh when the buckets are remade (the
 * one-time rebuild after the first synchronised step among them).
 *
 * Note [PowerSGD's arithmetic]
 * Arithmetic is in the gradients' dtype (CPU gradients of f32 or f64 only,
 * refused otherwise), as PyTorch's hook computes in the gradients' dtype:
 * the products through the backend's GEMM (what nb_matmul_t runs) on
 * views of the bucket, writing into the wire
 * buffers and the flat in place (P = M Q and Q = M^T P are one pass over
 * M each, M = P Q^T one write of it), the sums and copies through the
 * backend's elementwise engine (g = flat + error and g -= M one pass
 * each). They were once loops over an f64 copy of the bucket: at
 * 12.7 million f32 gradients (bench_ddp's GPT at width 512) those made
 * backward about 250 ms longer on 2 ranks, much of the 400 ms that the
 * compression saves on the wire at 1 Gbit/s (benchmarks/RESULTS.md). The
 * Gram-Schmidt of each P and Q ((n + m) k elements) runs on an f64 copy,
 * so that norms and dot products are summed in f64 whatever the dtype.
 * With error feedback the bucket holds two buffers of its size and dtype,
 * the error and g (= flat + error); at the end g -= M makes g the next
 * error in place and the two swap (the old error's memory is the next
 * g). Without error feedback M is the flat itself. The kept Q (warm
 * start) is the Q all-reduce's own buffer, which holds the average once
 * the step is done. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_reducer.h"
#include "nabla/random.h"
#include "tensor/backend.h"
#include "tensor/internal.h"
#include "util/handle.h"

typedef struct mat {
    int64_t off, n, m; /* in the bucket's flat: M is flat[off .. off + n m), row-major */
    int k;
    int64_t p_off, q_off; /* P at wire1[unc_total + p_off], (n, k); Q at wire2[q_off], (m, k) */
} mat;

typedef struct pbucket {
    int n_mat, n_unc;
    mat *mats;
    int64_t *unc_off, *unc_len; /* the uncompressed parameters' elements */
    int64_t numel, unc_total, p_total, q_total;
    nb_tensor *g, *err;       /* (numel), the bucket's dtype, with error feedback only: g = flat + err */
    nb_tensor *wire1, *wire2; /* uncompressed + Ps; Qs (kept between steps: warm start); in the buckets' context */
    double *gs;               /* Gram-Schmidt's f64 copy: the longest n or m, times k */
    bool have_q;              /* wire2 holds the last step's averaged Q */
    bool compressed;          /* the launch in flight is PowerSGD's (else a plain all-reduce) */
    enum { IDLE, P_STAGE, Q_STAGE } stage; /* of a compressed bucket in flight: which all-reduce was started last */
    nb_work *wp, *wq;                      /* the all-reduces of wire1 and wire2 */
    nb_status st;                          /* wp's, once waited for */
} pbucket;

typedef struct psgd_state {
    nb_ddp_powersgd_options o;
    int64_t iter; /* synchronised steps begun (a last bucket launched) */
    nb_rng rng;
    nb_reduce_op op; /* the reducer's, for the Q stage started in finish */
    nb_ctx *host;    /* scratch: views, products and nb_rand_normal's draws, reset after each matrix */
    int nb;
    pbucket *b;
} psgd_state;

static void buckets_free(psgd_state *s) {
    for (int i = 0; i < s->nb; i++) {
        pbucket *b = &s->b[i];
        if (b->wp) nb_work_finish(b->wp); /* left by a failed step */
        if (b->wq) nb_work_finish(b->wq);
        free(b->mats), free(b->unc_off), free(b->unc_len), free(b->gs);
    }
    free(s->b);
    s->b = NULL;
    s->nb = 0;
}

static void psgd_buckets_made(nb_ddp *d, void *self) {
    psgd_state *s = self;
    buckets_free(s);
    s->nb = d->n_buckets;
    s->b = nb__ddp_calloc((size_t)(s->nb ? s->nb : 1), sizeof *s->b);
    for (int bi = 0; bi < s->nb; bi++) {
        const bucket *bk = &d->buckets[bi];
        pbucket *b = &s->b[bi];
        b->numel = bk->numel;
        b->mats = nb__ddp_calloc((size_t)bk->n, sizeof *b->mats);
        b->unc_off = nb__ddp_calloc((size_t)bk->n, sizeof *b->unc_off);
        b->unc_len = nb__ddp_calloc((size_t)bk->n, sizeof *b->unc_len);
        int64_t longest = 1;
        for (int j = 0; j < bk->n; j++) {
            const nb_tensor *t = d->p[bk->params[j]].tensor;
            int64_t numel = nb_numel(t), n = t->ndim > 0 ? t->shape[0] : 1, m = n > 0 ? numel / n : 0;
            int64_t k = s->o.rank;
            if (k > n) k = n;
            if (k > m) k = m;
            if (t->ndim > 1 && k > 0 && (double)(n + m) * (double)k * s->o.min_compression_rate < (double)n * (double)m) {
                b->mats[b->n_mat++] = (mat){bk->offsets[j], n, m, (int)k, b->p_total, b->q_total};
                b->p_total += n * k, b->q_total += m * k;
                if ((n > m ? n : m) * k > longest) longest = (n > m ? n : m) * k;
            } else {
                b->unc_off[b->n_unc] = bk->offsets[j], b->unc_len[b->n_unc++] = numel;
                b->unc_total += numel;
            }
        }
        b->gs = nb__ddp_calloc((size_t)longest, sizeof(double));
        int64_t n1 = b->unc_total + b->p_total, n2 = b->q_total;
        b->wire1 = nb_empty(d->ctx, bk->dtype, 1, &n1);
        if (n2) b->wire2 = nb_empty(d->ctx, bk->dtype, 1, &n2);
        if (s->o.error_feedback) {
            b->g = nb_empty(d->ctx, bk->dtype, 1, &b->numel);
            b->err = nb_zeros(d->ctx, bk->dtype, 1, &b->numel);
        }
    }
}

/* Elements [at, at + rows cols) of the contiguous 1-D t as a (rows, cols)
 * view in ctx; cols 0: a 1-D view of rows elements. */
static nb_tensor *view(nb_ctx *ctx, nb_tensor *t, int64_t at, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols}, st[2] = {cols, 1};
    char *p = (char *)t->data + at * (int64_t)nb_dtype_size(t->dtype);
    return cols ? nb__view(ctx, t, 2, shape, st, p) : nb__view(ctx, t, 1, shape, st + 1, p);
}

/* Gram-Schmidt on the k columns of the (rows, k) row-major matrix at
 * element `at` of the f32 or f64 host tensor t, in f64 (a: rows k doubles
 * of scratch). A zero column stays zero. */
static void orthogonalize(nb_tensor *t, int64_t at, int64_t rows, int k, double *a) {
    bool f64 = t->dtype == NB_F64;
    double *pd = (double *)t->data + at;
    float *pf = (float *)t->data + at;
    for (int64_t i = 0; i < rows * k; i++) a[i] = f64 ? pd[i] : pf[i];
    for (int c = 0; c < k; c++) {
        double nrm = 0;
        for (int64_t i = 0; i < rows; i++) nrm += a[i * k + c] * a[i * k + c];
        nrm = sqrt(nrm);
        if (nrm > 0)
            for (int64_t i = 0; i < rows; i++) a[i * k + c] /= nrm;
        for (int c2 = c + 1; c2 < k; c2++) {
            double dot = 0;
            for (int64_t i = 0; i < rows; i++) dot += a[i * k + c] * a[i * k + c2];
            for (int64_t i = 0; i < rows; i++) a[i * k + c2] -= dot * a[i * k + c];
        }
    }
    for (int64_t i = 0; i < rows * k; i++) {
        if (f64) pd[i] = a[i];
        else pf[i] = (float)a[i];
    }
}

/* Elements [at, at + rows cols) of out (a contiguous 1-D tensor) =
 * op(a) @ op(b), (rows, cols), through the backend's GEMM (the one
 * nb_matmul_t runs) without a copy; returns that view. */
static nb_tensor *product(nb_ctx *x, nb_tensor *out, int64_t at, int64_t rows, int64_t cols, const nb_tensor *a,
                          bool trans_a, const nb_tensor *b, bool trans_b) {
    nb_tensor *o = view(x, out, at, rows, cols);
    nb__backend_at(o)->matmul(o, a, b, trans_a, trans_b, NULL);
    return o;
}

/* The (cols, rows) transpose of the (rows, cols) row-major matrix at
 * element `at` of the contiguous 1-D t, as a view in ctx. */
static nb_tensor *transposed(nb_ctx *ctx, nb_tensor *t, int64_t at, int64_t rows, int64_t cols) {
    int64_t shape[2] = {cols, rows}, st[2] = {1, cols};
    return nb__view(ctx, t, 2, shape, st, (char *)t->data + at * (int64_t)nb_dtype_size(t->dtype));
}

/* A new contiguous 1-D tensor of n elements in ctx. */
static nb_tensor *scratch(nb_ctx *ctx, nb_dtype dtype, int64_t n) { return nb__empty(ctx, dtype, 1, &n); }

/* g[at, at + rows cols) -= v (the error feedback's g - M). */
static void subtract(nb_ctx *x, nb_tensor *g, int64_t at, int64_t rows, int64_t cols, const nb_tensor *v) {
    nb_tensor *gv = view(x, g, at, rows, cols);
    nb__run_binary(NB_B_SUB, gv, gv, v);
}

/* The tensor the matrices M are read from: g with error feedback, else the flat. */
static nb_tensor *source(const nb_ddp *d, const psgd_state *s, int bi) {
    return s->o.error_feedback ? s->b[bi].g : d->buckets[bi].flat;
}

/* P = M Q for each matrix of bucket bi, into its wire: the first stage. */
static void make_p(const nb_ddp *d, psgd_state *s, int bi) {
    pbucket *b = &s->b[bi];
    nb_tensor *g = source(d, s, bi);
    bool fresh = !(s->o.warm_start && b->have_q);
    nb_ctx *x = s->host;
    for (int j = 0; j < b->n_mat; j++) {
        const mat *mt = &b->mats[j];
        nb_tensor *q = view(x, b->wire2, mt->q_off, mt->m, mt->k);
        if (fresh) nb__run_copy(q, nb_rand_normal(x, NB_F64, NB_SHAPE(mt->m, mt->k), 0, 1, &s->rng));
        orthogonalize(b->wire2, mt->q_off, mt->m, mt->k, b->gs);
        product(x, b->wire1, b->unc_total + mt->p_off, mt->n, mt->k, view(x, g, mt->off, mt->n, mt->m), false, q,
                false);
        nb_ctx_reset(x);
    }
}

/* The second stage of bucket bi: waits for the all-reduce of the
 * uncompressed values and the Ps, orthogonalises each P, Q = M^T P, and
 * starts the all-reduce of the Qs. The product is made as Q^T = P^T M,
 * (k, m), then transposed into the wire (m k elements): a GEMM that reads
 * M without transposing it, 1.6 times faster than M^T P (0.24 against
 * 0.39 ns a gradient, 12 f32 matrices of 2048 x 512 at rank 4, one
 * thread, on the 2-core machine of benchmarks/RESULTS.md); finish's
 * P Q^T likewise reads a copy of Q^T (0.25 against 0.38 ns). */
static void start_q(nb_ddp *d, psgd_state *s, int bi, nb_reduce_op op) {
    pbucket *b = &s->b[bi];
    b->st = nb_work_wait(b->wp);
    b->stage = Q_STAGE;
    if (!b->n_mat) return; /* nothing compressed: one collective */
    if (b->st == NB_OK) {
        nb_tensor *g = source(d, s, bi);
        nb_ctx *x = s->host;
        for (int j = 0; j < b->n_mat; j++) {
            const mat *mt = &b->mats[j];
            orthogonalize(b->wire1, b->unc_total + mt->p_off, mt->n, mt->k, b->gs);
            nb_tensor *qt = scratch(x, b->wire2->dtype, mt->k * mt->m);
            product(x, qt, 0, mt->k, mt->m, view(x, b->wire1, b->unc_total + mt->p_off, mt->n, mt->k), true,
                    view(x, g, mt->off, mt->n, mt->m), false);
            nb__run_copy(view(x, b->wire2, mt->q_off, mt->m, mt->k), transposed(x, qt, 0, mt->k, mt->m));
            nb_ctx_reset(x);
        }
    }
    b->wq = nb_pg_all_reduce(d->pg, b->wire2, op); /* after a failure too: a failed group fails it at once */
}

/* Note [PowerSGD]'s two stages (Note [Two-stage communication hooks] in
 * ddp_reducer.h): bucket b's launch starts bucket b-1's Q stage, then
 * computes b's Ps and starts their all-reduce; finish starts the last
 * bucket's Q stage and waits for the Qs. */
static nb_work *psgd_launch(nb_ddp *d, void *self, int bi, nb_reduce_op op, size_t *bytes) {
    psgd_state *s = self;
    bucket *bk = &d->buckets[bi];
    pbucket *b = &s->b[bi];
    size_t es = nb_dtype_size(bk->dtype);
    bool plain = s->iter < s->o.start_iter;
    if (bi == d->n_buckets - 1) s->iter++;
    b->compressed = !plain;
    b->st = NB_OK;
    b->stage = plain ? IDLE : P_STAGE;
    if (plain) {
        *bytes = (size_t)bk->numel * es;
        return nb_pg_all_reduce(d->pg, bk->flat, op);
    }
    s->op = op;
    if (bi > 0 && s->b[bi - 1].stage == P_STAGE && s->b[bi - 1].n_mat) start_q(d, s, bi - 1, op);
    if (s->o.error_feedback) nb__run_binary(NB_B_ADD, b->g, bk->flat, b->err);
    nb_tensor *g = source(d, s, bi);
    int64_t at = 0;
    for (int u = 0; u < b->n_unc; u++) {
        nb__run_copy(view(s->host, b->wire1, at, b->unc_len[u], 0), view(s->host, g, b->unc_off[u], b->unc_len[u], 0));
        at += b->unc_len[u];
    }
    nb_ctx_reset(s->host);
    make_p(d, s, bi);
    *bytes = (size_t)(b->unc_total + b->p_total + b->q_total) * es;
    b->wp = nb_pg_all_reduce(d->pg, b->wire1, op);
    return NULL;
}


static nb_status psgd_finish(nb_ddp *d, void *self, int bi, bool keep, double *started, double *finished) {
    psgd_state *s = self;
    pbucket *b = &s->b[bi];
    if (b->stage == IDLE) return NB_OK; /* a plain all-reduce, waited for by the reducer */
    if (b->stage == P_STAGE) start_q(d, s, bi, s->op);
    nb_status st = b->st;
    double issued, end = 0;
    nb_work_times(b->wp, &issued, started, finished);
    if (b->wq) {
        nb_status sq = nb_work_wait(b->wq);
        if (st == NB_OK) st = sq;
        nb_work_times(b->wq, &issued, NULL, &end);
        if (end > *finished) *finished = end;
    }
    nb_work_free(b->wp), nb_work_free(b->wq);
    b->wp = b->wq = NULL;
    b->stage = IDLE;
    if (!keep || st != NB_OK) return st;
    bucket *bk = &d->buckets[bi];
    nb_tensor *g = s->o.error_feedback ? b->g : NULL;
    nb_ctx *x = s->host;
    int64_t at = 0;
    for (int u = 0; u < b->n_unc; u++) { /* the averages as they came */
        nb_tensor *v = view(x, b->wire1, at, b->unc_len[u], 0), *f = view(x, bk->flat, b->unc_off[u], b->unc_len[u], 0);
        nb__run_copy(f, v);
        if (g) subtract(x, g, b->unc_off[u], b->unc_len[u], 0, f);
        at += b->unc_len[u];
    }
    nb_ctx_reset(x);
    for (int j = 0; j < b->n_mat; j++) { /* M = P Q^T, straight into the flat, from a copy of Q^T (as in start_q) */
        const mat *mt = &b->mats[j];
        nb_tensor *qt = view(x, scratch(x, b->wire2->dtype, mt->k * mt->m), 0, mt->k, mt->m);
        nb__run_copy(qt, transposed(x, b->wire2, mt->q_off, mt->m, mt->k));
        nb_tensor *f = product(x, bk->flat, mt->off, mt->n, mt->m,
                               view(x, b->wire1, b->unc_total + mt->p_off, mt->n, mt->k), false, qt, false);
        if (g) subtract(x, g, mt->off, mt->n, mt->m, f);
        nb_ctx_reset(x);
    }
    if (g) { /* g - M is the next error; the old error's memory is the next g */
        b->g = b->err;
        b->err = g;
    }
    b->have_q = s->o.warm_start;
    return NB_OK;
}

static void psgd_free(nb_ddp *d, void *self) {
    (void)d;
    psgd_state *s = self;
    buckets_free(s);
    nb_ctx_free(s->host);
    free(s);
}

static const nb__ddp_hooks psgd_hooks = {
    .name = "the PowerSGD communication hook",
    .collective = "all-reduce",
    .launch = psgd_launch,
    .finish = psgd_finish,
    .buckets_made = psgd_buckets_made,
    .free = psgd_free,
};

nb_status nb_ddp_set_powersgd(nb_ddp *d, const nb_ddp_powersgd_options *o) {
    NB__CHECK_HANDLE("nb_ddp_set_powersgd", d, "DDP handle");
    NB_CHECK(!d->in_backward, "nb_ddp_set_powersgd: rank %d: called inside a backward", d->rank);
    psgd_state *cur = nb__ddp_state(d, NB__DDP_POWERSGD);
    if (cur) {
        nb__ddp_detach(d, NB__DDP_POWERSGD);
        psgd_free(d, cur);
    }
    if (!o) return NB_OK;
    if (o->rank < 1 || o->start_iter < 0 || !(o->min_compression_rate >= 0))
        return nb_set_error(NB_ERR_INVALID,
                            "nb_ddp_set_powersgd: rank %d: rank %d, start_iter %d, min_compression_rate %g: "
                            "the rank must be >= 1, the others >= 0",
                            d->rank, o->rank, o->start_iter, o->min_compression_rate);
    nb_status st = nb__ddp_check_conflicts(d, NB__DDP_POWERSGD, "nb_ddp_set_powersgd");
    if (st != NB_OK) return st; /* Note [Feature conflicts] */
    for (int i = 0; i < d->n; i++) {
        const nb_tensor *t = d->p[i].tensor;
        if (t->device.type != NB_DEVICE_CPU || (t->dtype != NB_F32 && t->dtype != NB_F64))
            return nb_set_error(NB_ERR_UNSUPPORTED,
                                "nb_ddp_set_powersgd: rank %d: parameter \"%s\" is %s on %s; PowerSGD takes CPU "
                                "gradients of f32 or f64 only (Note [PowerSGD])",
                                d->rank, d->p[i].name, nb_dtype_name(t->dtype), nb_device_name(t->device));
    }
    psgd_state *s = nb__ddp_calloc(1, sizeof *s);
    s->o = *o;
    s->rng = nb_rng_make(o->seed);
    s->host = nb_ctx_new(nb_cpu(), 0);
    nb__ddp_attach(d, NB__DDP_POWERSGD, &psgd_hooks, s);
    psgd_buckets_made(d, s); /* the buckets made before it */
    return NB_OK;
}
