/* PowerSGD (nb_ddp_set_powersgd): a communication hook that sends a rank-r
 * approximation of each gradient matrix instead of the matrix, with error
 * feedback and warm start, after a number of steps of plain all-reduce
 * (Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient Compression
 * for Distributed Optimization"; the semantics of PyTorch's powerSGD_hook).
 *
 * Note [PowerSGD]
 * Per bucket, once `start_iter` synchronised steps have run plain:
 * - g = the bucket's gradients, plus the bucket's error from the last step
 *   (error feedback; zeros the first time); cp = a copy of g.
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
 * - M = P Q^T; error = cp - g, the whole bucket (for the uncompressed
 *   values too: the local value minus the average, as PyTorch's hook);
 *   Q is kept for the next step with warm start.
 * Bytes on the wire per bucket: (uncompressed + sum n k + sum m k)
 * elements, against the bucket's numel. The first all-reduce is waited for
 * inside the launch hook (the second runs while backward goes on): a
 * PowerSGD bucket hides less than a plain one. State is per bucket and
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
    double *g, *cp, *p, *err, *q; /* err: NULL until the first compressed step; q: NULL until a Q is kept */
    nb_tensor *wire1, *wire2;     /* uncompressed + Ps; Qs (the bucket's dtype), in the buckets' context */
    bool compressed;              /* the launch in flight is PowerSGD's (else a plain all-reduce) */
} pbucket;

typedef struct psgd_state {
    nb_ddp_powersgd_options o;
    int64_t iter; /* synchronised steps begun (a last bucket launched) */
    nb_rng rng;
    nb_ctx *host; /* for nb_rand_normal, reset after each use */
    int nb;
    pbucket *b;
} psgd_state;

static void buckets_free(psgd_state *s) {
    for (int i = 0; i < s->nb; i++) {
        pbucket *b = &s->b[i];
        free(b->mats), free(b->unc_off), free(b->unc_len);
        free(b->g), free(b->cp), free(b->p), free(b->err), free(b->q);
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
        b->cp = nb__ddp_calloc((size_t)b->numel, sizeof(double));
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

static nb_work *psgd_launch(nb_ddp *d, void *self, int bi, nb_reduce_op op, size_t *bytes) {
    psgd_state *s = self;
    bucket *bk = &d->buckets[bi];
    pbucket *b = &s->b[bi];
    size_t es = nb_dtype_size(bk->dtype);
    bool plain = s->iter < s->o.start_iter;
    if (bi == d->n_buckets - 1) s->iter++;
    b->compressed = !plain;
    if (plain) {
        *bytes = (size_t)bk->numel * es;
        return nb_pg_all_reduce(d->pg, bk->flat, op);
    }
    get(b->g, bk->flat, 0, b->numel);
    if (s->o.error_feedback) {
        if (!b->err) b->err = nb__ddp_calloc((size_t)b->numel, sizeof(double));
        for (int64_t i = 0; i < b->numel; i++) b->g[i] += b->err[i];
        memcpy(b->cp, b->g, (size_t)b->numel * sizeof(double));
    }
    bool fresh = !(s->o.warm_start && b->q);
    if (!b->q) b->q = nb__ddp_calloc((size_t)(b->q_total ? b->q_total : 1), sizeof(double));
    for (int j = 0; j < b->n_mat; j++) {
        const mat *x = &b->mats[j];
        double *q = b->q + x->q_off, *p = b->p + x->p_off;
        const double *M = b->g + x->off;
        if (fresh) {
            nb_tensor *r = nb_rand_normal(s->host, NB_F64, NB_SHAPE(x->m, x->k), 0, 1, &s->rng);
            memcpy(q, r->data, (size_t)(x->m * x->k) * sizeof(double));
            nb_ctx_reset(s->host);
        }
        orthogonalize(q, x->m, x->k);
        for (int64_t i = 0; i < x->n; i++) /* P = M Q */
            for (int c = 0; c < x->k; c++) {
                double acc = 0;
                for (int64_t l = 0; l < x->m; l++) acc += M[i * x->m + l] * q[l * x->k + c];
                p[i * x->k + c] = acc;
            }
    }
    int64_t at = 0;
    for (int u = 0; u < b->n_unc; u++) put(b->wire1, at, b->g + b->unc_off[u], b->unc_len[u]), at += b->unc_len[u];
    put(b->wire1, at, b->p, b->p_total);
    *bytes = (size_t)(b->unc_total + b->p_total + b->q_total) * es;
    if (!b->n_mat) return nb_pg_all_reduce(d->pg, b->wire1, op); /* nothing to compress: one collective */
    if (nb_work_finish(nb_pg_all_reduce(d->pg, b->wire1, op)) != NB_OK)
        return nb_pg_all_reduce(d->pg, b->wire2, op); /* a failed group fails it with the same message */
    get(b->p, b->wire1, b->unc_total, b->p_total);
    for (int j = 0; j < b->n_mat; j++) {
        const mat *x = &b->mats[j];
        double *q = b->q + x->q_off, *p = b->p + x->p_off;
        const double *M = b->g + x->off;
        orthogonalize(p, x->n, x->k);
        for (int64_t l = 0; l < x->m; l++) /* Q = M^T P */
            for (int c = 0; c < x->k; c++) {
                double acc = 0;
                for (int64_t i = 0; i < x->n; i++) acc += M[i * x->m + l] * p[i * x->k + c];
                q[l * x->k + c] = acc;
            }
    }
    put(b->wire2, 0, b->q, b->q_total);
    return nb_pg_all_reduce(d->pg, b->wire2, op);
}

static void psgd_finish(nb_ddp *d, void *self, int bi) {
    psgd_state *s = self;
    pbucket *b = &s->b[bi];
    if (!b->compressed) return;
    bucket *bk = &d->buckets[bi];
    int64_t at = 0;
    for (int u = 0; u < b->n_unc; u++) get(b->g + b->unc_off[u], b->wire1, at, b->unc_len[u]), at += b->unc_len[u];
    if (b->wire2) get(b->q, b->wire2, 0, b->q_total);
    for (int j = 0; j < b->n_mat; j++) { /* M = P Q^T */
        const mat *x = &b->mats[j];
        const double *q = b->q + x->q_off, *p = b->p + x->p_off;
        double *M = b->g + x->off;
        for (int64_t i = 0; i < x->n; i++)
            for (int64_t l = 0; l < x->m; l++) {
                double acc = 0;
                for (int c = 0; c < x->k; c++) acc += p[i * x->k + c] * q[l * x->k + c];
                M[i * x->m + l] = acc;
            }
    }
    put(bk->flat, 0, b->g, b->numel);
    if (s->o.error_feedback)
        for (int64_t i = 0; i < b->numel; i++) b->err[i] = b->cp[i] - b->g[i];
    if (!s->o.warm_start) {
        free(b->q);
        b->q = NULL;
    }
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
