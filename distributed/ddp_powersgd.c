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
 * The products run over M row by row (one pass over M for each). State is per bucket and
 * starts afresh when the buckets are remade (the one-time rebuild after
 * the first synchronised step among them). Arithmetic is in f64 on the
 * host: CPU gradients of f32 or f64 only, refused otherwise. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_reducer.h"
#include "nabla/random.h"
#include "util/handle.h"

typedef struct mat {
    int64_t off, n, m; /* in the bucket's flat: M is flat[off .. off + n m), row-major */
    int k;
    int64_t p_off, q_off; /* in the packed Ps and Qs */
} mat;

typedef struct pbucket {
    int n_mat, n_unc;
    mat *mats;
    int64_t *unc_off, *unc_len; /* the uncompressed parameters' elements */
    int64_t numel, unc_total, p_total, q_total;
    double *g, *p, *err, *q;      /* err: NULL until the first compressed step; q: NULL until a Q is kept */
    double *row;                  /* scratch: the longest matrix row or uncompressed run */
    nb_tensor *wire1, *wire2;     /* uncompressed + Ps; Qs (the bucket's dtype), in the buckets' context */
    bool compressed;              /* the launch in flight is PowerSGD's (else a plain all-reduce) */
    enum { IDLE, P_STAGE, Q_STAGE } stage; /* of a compressed bucket in flight: which all-reduce was started last */
    nb_work *wp, *wq;             /* the all-reduces of wire1 and wire2 */
    nb_status st;                 /* wp's, once waited for */
} pbucket;

typedef struct psgd_state {
    nb_ddp_powersgd_options o;
    int64_t iter; /* synchronised steps begun (a last bucket launched) */
    nb_rng rng;
    nb_reduce_op op; /* the reducer's, for the Q stage started in finish */
    nb_ctx *host; /* for nb_rand_normal, reset after each use */
    int nb;
    pbucket *b;
} psgd_state;

static void buckets_free(psgd_state *s) {
    for (int i = 0; i < s->nb; i++) {
        pbucket *b = &s->b[i];
        if (b->wp) nb_work_finish(b->wp); /* left by a failed step */
        if (b->wq) nb_work_finish(b->wq);
        free(b->mats), free(b->unc_off), free(b->unc_len);
        free(b->g), free(b->row), free(b->p), free(b->err), free(b->q);
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
        for (int j = 0; j < bk->n; j++) {
            const nb_tensor *t = d->p[bk->params[j]].tensor;
            int64_t numel = nb_numel(t), n = t->ndim > 0 ? t->shape[0] : 1, m = n > 0 ? numel / n : 0;
            int64_t k = s->o.rank;
            if (k > n) k = n;
            if (k > m) k = m;
            if (t->ndim > 1 && k > 0 && (double)(n + m) * (double)k * s->o.min_compression_rate < (double)n * (double)m) {
                b->mats[b->n_mat++] = (mat){bk->offsets[j], n, m, (int)k, b->p_total, b->q_total};
                b->p_total += n * k, b->q_total += m * k;
            } else {
                b->unc_off[b->n_unc] = bk->offsets[j], b->unc_len[b->n_unc++] = numel;
                b->unc_total += numel;
            }
        }
        b->g = nb__ddp_calloc((size_t)b->numel, sizeof(double));
        int64_t longest = 1;
        for (int j = 0; j < b->n_mat; j++) longest = b->mats[j].m > longest ? b->mats[j].m : longest;
        for (int u = 0; u < b->n_unc; u++) longest = b->unc_len[u] > longest ? b->unc_len[u] : longest;
        b->row = nb__ddp_calloc((size_t)longest, sizeof(double));
        b->p = nb__ddp_calloc((size_t)(b->p_total ? b->p_total : 1), sizeof(double));
        int64_t n1 = b->unc_total + b->p_total, n2 = b->q_total;
        b->wire1 = nb_empty(d->ctx, bk->dtype, 1, &n1);
        if (n2) b->wire2 = nb_empty(d->ctx, bk->dtype, 1, &n2);
    }
}

/* f32 or f64 host data to and from doubles */
static void get(double *dst, const nb_tensor *t, int64_t at, int64_t n) {
    if (t->dtype == NB_F64) memcpy(dst, (const double *)t->data + at, (size_t)n * sizeof(double));
    else
        for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)t->data)[at + i];
}
static void put(nb_tensor *t, int64_t at, const double *src, int64_t n) {
    if (t->dtype == NB_F64) memcpy((double *)t->data + at, src, (size_t)n * sizeof(double));
    else
        for (int64_t i = 0; i < n; i++) ((float *)t->data)[at + i] = (float)src[i];
}

/* Elements [at, at + n) of the bucket's result are v: into the flat, and
 * err = g - v there (err NULL: no error feedback). */
static void settle(nb_tensor *flat, int64_t at, const double *v, const double *g, double *err, int64_t n) {
    put(flat, at, v, n);
    if (err)
        for (int64_t i = 0; i < n; i++) err[at + i] = g[at + i] - v[i];
}

/* Gram-Schmidt on the k columns of the (rows, k) row-major matrix a. A
 * zero column stays zero. */
static void orthogonalize(double *a, int64_t rows, int k) {
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
}

/* The products, row by row of the (n, m) row-major M (one pass over M
 * each), P (n, k) and Q (m, k) row-major; the loops are written out for
 * the common ranks so that the compiler keeps a row of P in registers. */
#define RANK_CASES(k, LOOP)                                                                       \
    switch (k) {                                                                                  \
    case 1: LOOP(1); break;                                                                       \
    case 2: LOOP(2); break;                                                                       \
    case 4: LOOP(4); break;                                                                       \
    case 8: LOOP(8); break;                                                                       \
    default: LOOP(k); break;                                                                      \
    }

/* p = M q */
static void mul_mq(double *restrict p, const double *restrict M, const double *restrict q, int64_t n, int64_t m,
                   int k) {
#define MQ(K)                                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                             \
        double acc[K];                                                                            \
        for (int c = 0; c < (K); c++) acc[c] = 0;                                                 \
        for (int64_t l = 0; l < m; l++)                                                           \
            for (int c = 0; c < (K); c++) acc[c] += M[i * m + l] * q[l * (K) + c];                \
        for (int c = 0; c < (K); c++) p[i * (K) + c] = acc[c];                                    \
    }
    RANK_CASES(k, MQ)
#undef MQ
}

/* q = M^T p */
static void mul_mtp(double *restrict q, const double *restrict M, const double *restrict p, int64_t n, int64_t m,
                    int k) {
    memset(q, 0, (size_t)(m * k) * sizeof(double));
#define MTP(K)                                                                                    \
    for (int64_t i = 0; i < n; i++)                                                               \
        for (int64_t l = 0; l < m; l++)                                                           \
            for (int c = 0; c < (K); c++) q[l * (K) + c] += M[i * m + l] * p[i * (K) + c];
    RANK_CASES(k, MTP)
#undef MTP
}

/* row = row i of p q^T */
static void mul_pqt_row(double *restrict row, const double *restrict p, const double *restrict q, int64_t i,
                        int64_t m, int k) {
#define PQT(K)                                                                                    \
    for (int64_t l = 0; l < m; l++) {                                                             \
        double acc = 0;                                                                           \
        for (int c = 0; c < (K); c++) acc += p[i * (K) + c] * q[l * (K) + c];                     \
        row[l] = acc;                                                                             \
    }
    RANK_CASES(k, PQT)
#undef PQT
}

/* P = M Q for each matrix of bucket b, into its wire: the first stage. */
static void make_p(psgd_state *s, pbucket *b) {
    bool fresh = !(s->o.warm_start && b->q);
    if (!b->q) b->q = nb__ddp_calloc((size_t)(b->q_total ? b->q_total : 1), sizeof(double));
    for (int j = 0; j < b->n_mat; j++) {
        const mat *x = &b->mats[j];
        double *q = b->q + x->q_off;
        if (fresh) {
            nb_tensor *r = nb_rand_normal(s->host, NB_F64, NB_SHAPE(x->m, x->k), 0, 1, &s->rng);
            memcpy(q, r->data, (size_t)(x->m * x->k) * sizeof(double));
            nb_ctx_reset(s->host);
        }
        orthogonalize(q, x->m, x->k);
        mul_mq(b->p + x->p_off, b->g + x->off, q, x->n, x->m, x->k);
    }
}

/* The second stage of bucket b: waits for the all-reduce of the
 * uncompressed values and the Ps, orthogonalises each P, Q = M^T P, and
 * starts the all-reduce of the Qs. */
static void start_q(nb_ddp *d, psgd_state *s, int bi, nb_reduce_op op) {
    pbucket *b = &s->b[bi];
    b->st = nb_work_wait(b->wp);
    b->stage = Q_STAGE;
    if (!b->n_mat) return; /* nothing compressed: one collective */
    if (b->st == NB_OK) {
        get(b->p, b->wire1, b->unc_total, b->p_total);
        for (int j = 0; j < b->n_mat; j++) {
            const mat *x = &b->mats[j];
            orthogonalize(b->p + x->p_off, x->n, x->k);
            mul_mtp(b->q + x->q_off, b->g + x->off, b->p + x->p_off, x->n, x->m, x->k);
        }
        put(b->wire2, 0, b->q, b->q_total);
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
    get(b->g, bk->flat, 0, b->numel);
    if (s->o.error_feedback) {
        if (!b->err) b->err = nb__ddp_calloc((size_t)b->numel, sizeof(double));
        for (int64_t i = 0; i < b->numel; i++) b->g[i] += b->err[i];
    }
    make_p(s, b);
    int64_t at = 0;
    for (int u = 0; u < b->n_unc; u++) put(b->wire1, at, b->g + b->unc_off[u], b->unc_len[u]), at += b->unc_len[u];
    put(b->wire1, at, b->p, b->p_total);
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
    double *err = s->o.error_feedback ? b->err : NULL;
    int64_t at = 0;
    for (int u = 0; u < b->n_unc; u++) { /* the averages as they came */
        get(b->row, b->wire1, at, b->unc_len[u]);
        settle(bk->flat, b->unc_off[u], b->row, b->g, err, b->unc_len[u]);
        at += b->unc_len[u];
    }
    if (b->wire2) get(b->q, b->wire2, 0, b->q_total);
    for (int j = 0; j < b->n_mat; j++) { /* M = P Q^T, row by row */
        const mat *x = &b->mats[j];
        for (int64_t i = 0; i < x->n; i++) {
            mul_pqt_row(b->row, b->p + x->p_off, b->q + x->q_off, i, x->m, x->k);
            settle(bk->flat, x->off + i * x->m, b->row, b->g, err, x->m);
        }
    }
    if (!s->o.warm_start) {
        free(b->q);
        b->q = NULL;
    }
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
