/* The CPU backend's multi-tensor updates (tensor/backend.h): Adam/AdamW
 * and SGD steps over a list of parameters, and the sums over a list of
 * gradients that clipping and loss scaling need. Each tensor is
 * contiguous f32 or f64 and is computed in its own dtype.
 *
 * Adam and AdamW: one pass over each parameter reading p, g, m, v (and
 * vmax) and writing p, m, v (and vmax). The order of operations is PyTorch's single-tensor
 * Adam; the per-step scalars are computed in double, then rounded to the
 * dtype:
 *   Adam:  g = g + wd * p                    (L2 penalty)
 *   AdamW: p = p * (1 - lr * wd)             (decoupled decay)
 *   m = lerp(m, g, 1 - beta1)
 *   v = beta2 * v + (1 - beta2) * g * g
 *   AMSGrad: vmax = max(vmax, v); s = vmax     otherwise: s = v
 *   p = p - lr / (1 - beta1^t) * m / (sqrt(s) / sqrt(1 - beta2^t) + eps)
 * lerp(a, b, w) is a + w (b - a) for w < 0.5 and b - (b - a)(1 - w)
 * otherwise, the form that is exact at both ends. AMSGrad's maximum is
 * over the raw second moments, the bias correction of the current step
 * applied after it, and a NaN in either operand gives NaN (PyTorch's
 * torch.maximum, as its Adam and AdamW with amsgrad=True do).
 *
 * SGD with momentum, dampening, Nesterov momentum and L2 weight decay, in
 * the order of operations PyTorch's single-tensor SGD uses:
 *   d = g + wd * p
 *   buf = d                                  (first update of p)
 *   buf = momentum * buf + (1 - dampening) * d  (later updates)
 *   d = nesterov ? d + momentum * buf : buf   (when momentum != 0)
 *   p = p - lr * d
 *
 * Sums of squares are accumulated in double with eight partial sums in a
 * fixed order per tensor (the same result on every run, and not one long
 * chain of dependent additions), tensor after tensor. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h" /* NB__HP_* */
#include "tensor/cpu/bf16.h"
#include "tensor/cpu/cpu.h"
#include "tensor/cpu/threads.h"

/* One pass; AMS a constant, so that the loop keeps no branch on it (GCC
 * unswitches only so many loop-invariant conditions, and a loop with one
 * left does not vectorize). */
#define ADAM_LOOP(T, SQRT, AMS)                                                            \
    for (int64_t i = 0; i < n; i++) {                                                      \
        T pi = p[i], gi = g[i];                                                            \
        if (l2 != 0) gi = gi + l2 * pi;                                                    \
        if (shrink_on) pi = pi * shrink;                                                   \
        T mi = lerp_lo ? m[i] + w * (gi - m[i]) : gi - (gi - m[i]) * w1;                   \
        T vi = v[i] * beta2 + c2 * gi * gi;                                                \
        T si = vi;                                                                         \
        if (AMS) {                                                                         \
            T prev = vmax[i];                                                              \
            si = (vi > prev) | (vi != vi) ? vi : prev;                                     \
            vmax[i] = si;                                                                  \
        }                                                                                  \
        T denom = SQRT(si) / bc2_sqrt + eps;                                               \
        p[i] = pi + neg_step * (mi / denom);                                               \
        m[i] = mi;                                                                         \
        v[i] = vi;                                                                         \
    }

#define ADAM_KERNEL(T, SQRT, NAME)                                                         \
    static void NAME(T *restrict p, const T *restrict g, T *restrict m, T *restrict v,    \
                     T *restrict vmax, int64_t n, const double *hp, int64_t step,         \
                     bool decoupled) {                                                     \
        double lr = hp[NB__HP_LR], wd = hp[NB__HP_WEIGHT_DECAY];                           \
        double b1 = hp[NB__HP_BETA1], b2 = hp[NB__HP_BETA2];                               \
        double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);      \
        const T l2 = decoupled ? (T)0 : (T)wd;                                             \
        const T shrink = (T)(1.0 - lr * wd);                                               \
        const bool shrink_on = decoupled && wd != 0;                                       \
        const T w = (T)(1.0 - b1), w1 = (T)1 - w;                                          \
        const bool lerp_lo = (double)w < 0.5;                                              \
        const T beta2 = (T)b2, c2 = (T)(1.0 - b2);                                         \
        const T neg_step = (T)(-(lr / bc1)), bc2_sqrt = (T)sqrt(bc2);                      \
        const T eps = (T)hp[NB__HP_EPS];                                                   \
        if (vmax) ADAM_LOOP(T, SQRT, 1)                                                    \
        else ADAM_LOOP(T, SQRT, 0)                                                         \
    }

ADAM_KERNEL(float, sqrtf, adam_f32)
ADAM_KERNEL(double, sqrt, adam_f64)

/* The multi-tensor loops run on the thread pool in pieces of PIECE
 * elements of one tensor (Note [Deterministic parallel kernels] in
 * tensor/cpu/threads.h): updates are elementwise, and a tensor's sum of
 * squares is its pieces' sums added in order (one piece, as before, for a
 * tensor of PIECE elements or fewer). */
#define PIECE 32768

typedef struct piece {
    int t;
    int64_t lo, hi;
} piece;

typedef struct multi_job {
    nb_tensor *const *p, *const *g, *const *m, *const *v, *const *vmax, *const *buf;
    const int64_t *steps;
    const double *const *hp;
    bool decoupled;
    double coef;
    /* nb__update_extras: gradients read times gcoef when gscale; shadows */
    bool gscale;
    double gcoef;
    nb_tensor *const *shadow;
    piece *pieces;
    double *partial;
    bool *flag;
    void (*fn)(const struct multi_job *j, const piece *pc, int64_t c);
    /* used instead of malloc when there are few pieces */
    piece few_pieces[32];
    double few_partial[32];
    bool few_flag[32];
} multi_job;

static void *at(const nb_tensor *t, int64_t i) {
    return t ? (char *)t->data + i * (int64_t)nb_dtype_size(t->dtype) : NULL;
}

static void multi_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const multi_job *j = varg;
    j->fn(j, &j->pieces[c], c);
}

/* Cuts the n tensors into pieces and runs j->fn over them (on the pool
 * when they hold 2 PIECE elements or more); returns the pieces, their
 * count in *np, for the caller's combine (finish_pieces frees them). */
static piece *run_pieces(int n, nb_tensor *const *ts, multi_job *j, int64_t *np, bool keep) {
    int64_t total = 0, elems = 0;
    for (int i = 0; i < n; i++) {
        total += nb__chunk_count(nb_numel(ts[i]), PIECE);
        elems += nb_numel(ts[i]);
    }
    if (total <= 32) {
        j->pieces = j->few_pieces;
        j->partial = j->few_partial;
        j->flag = j->few_flag;
        memset(j->few_flag, 0, sizeof j->few_flag);
    } else {
        j->pieces = malloc((size_t)total * sizeof *j->pieces);
        j->partial = keep ? malloc((size_t)total * sizeof *j->partial) : NULL;
        j->flag = keep ? calloc((size_t)total, sizeof *j->flag) : NULL;
        NB_CHECK(j->pieces && (!keep || (j->partial && j->flag)),
                 "optimizer kernels: out of memory for %lld pieces", (long long)total);
    }
    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = nb_numel(ts[i]), lo = 0;
        do {
            j->pieces[k++] = (piece){i, lo, lo + PIECE < numel ? lo + PIECE : numel};
            lo += PIECE;
        } while (lo < numel);
    }
    if (elems < 2 * PIECE)
        for (int64_t c = 0; c < k; c++) j->fn(j, &j->pieces[c], c);
    else
        nb__parallel_for(k, multi_chunk, j);
    *np = k;
    return j->pieces;
}

static void finish_pieces(multi_job *j) {
    if (j->pieces == j->few_pieces) return;
    free(j->pieces);
    free(j->partial);
    free(j->flag);
}

/* The piece [lo, lo + k) of gradient i as the update reads it: in place,
 * or clipped (each element (g * coef) rounded, as scale_piece writes it)
 * into *own, which the caller frees. */
static const void *grad_piece(const multi_job *j, int i, int64_t lo, int64_t k, void **own) {
    *own = NULL;
    if (!j->gscale) return at(j->g[i], lo);
    const nb_tensor *g = j->g[i];
    *own = malloc((size_t)(k > 0 ? k : 1) * nb_dtype_size(g->dtype));
    NB_CHECK(*own, "optimizer kernels: out of memory for a clipped gradient piece");
    if (g->dtype == NB_F32) {
        const float *x = at(g, lo);
        float *y = *own;
        for (int64_t e = 0; e < k; e++) y[e] = (float)((double)x[e] * j->gcoef);
    } else {
        const double *x = at(g, lo);
        double *y = *own;
        for (int64_t e = 0; e < k; e++) y[e] = x[e] * j->gcoef;
    }
    return *own;
}

/* Note [Parameter shadows] in tensor/shadow.c: the updated piece, rounded. */
static void shadow_piece(const multi_job *j, int i, int64_t lo, int64_t k) {
    nb_tensor *s = j->shadow ? j->shadow[i] : NULL;
    if (!s) return;
    const float *x = at(j->p[i], lo);
    uint16_t *y = at(s, lo);
    if (s->dtype == NB_BF16) nb__bf16_from_f32_n(y, x, k);
    else
        for (int64_t e = 0; e < k; e++) y[e] = nb_f32_to_f16(x[e]);
}

static void adam_piece(const multi_job *j, const piece *pc, int64_t c) {
    (void)c;
    int i = pc->t;
    int64_t lo = pc->lo, k = pc->hi - pc->lo;
    void *vm = j->vmax && j->vmax[i] ? at(j->vmax[i], lo) : NULL, *own;
    const void *g = grad_piece(j, i, lo, k, &own);
    if (j->p[i]->dtype == NB_F32)
        adam_f32(at(j->p[i], lo), g, at(j->m[i], lo), at(j->v[i], lo), vm, k, j->hp[i],
                 j->steps[i], j->decoupled);
    else
        adam_f64(at(j->p[i], lo), g, at(j->m[i], lo), at(j->v[i], lo), vm, k, j->hp[i],
                 j->steps[i], j->decoupled);
    free(own);
    shadow_piece(j, i, lo, k);
}

/* The extras' clip: false when the update is skipped (a norm that is not
 * finite); else whether and by what the gradients are scaled. The norm
 * is host memory here. */
static bool take_extras(multi_job *j, const nb__update_extras *x) {
    j->shadow = x ? x->shadow : NULL;
    if (!x || !x->clip_norm) return true;
    double v = *(const double *)x->clip_norm->data, coef = x->max_norm / (v + 1e-6);
    if (!isfinite(v)) return false;
    j->gscale = coef < 1.0;
    j->gcoef = coef;
    return true;
}

void nb__cpu_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m,
                  nb_tensor *const *v, nb_tensor *const *vmax, const int64_t *steps,
                  const double *const *hp, bool decoupled, const nb__update_extras *x) {
    multi_job j = {.p = p, .g = g, .m = m, .v = v, .vmax = vmax, .steps = steps, .hp = hp,
                   .decoupled = decoupled, .fn = adam_piece};
    if (!take_extras(&j, x)) return;
    int64_t np;
    run_pieces(n, p, &j, &np, false);
    finish_pieces(&j);
}

#define SGD_KERNEL(T, NAME)                                                                \
    static void NAME(T *restrict p, const T *restrict g, T *restrict buf, int64_t n,      \
                     bool first, const double *hp) {                                       \
        const T lr = (T)hp[NB__HP_LR], wd = (T)hp[NB__HP_WEIGHT_DECAY];                    \
        const T mom = (T)hp[NB__HP_MOMENTUM], keep = (T)(1.0 - hp[NB__HP_DAMPENING]);      \
        const bool nesterov = hp[NB__HP_NESTEROV] != 0, decay = hp[NB__HP_WEIGHT_DECAY] != 0; \
        if (!buf) {                                                                        \
            for (int64_t i = 0; i < n; i++) {                                              \
                T d = decay ? g[i] + wd * p[i] : g[i];                                     \
                p[i] = p[i] + -lr * d;                                                     \
            }                                                                              \
            return;                                                                        \
        }                                                                                  \
        for (int64_t i = 0; i < n; i++) {                                                  \
            T d = decay ? g[i] + wd * p[i] : g[i];                                         \
            T b = first ? d : buf[i] * mom + keep * d;                                     \
            buf[i] = b;                                                                    \
            d = nesterov ? d + mom * b : b;                                                \
            p[i] = p[i] + -lr * d;                                                         \
        }                                                                                  \
    }

SGD_KERNEL(float, sgd_f32)
SGD_KERNEL(double, sgd_f64)

static void sgd_piece(const multi_job *j, const piece *pc, int64_t c) {
    (void)c;
    int i = pc->t;
    int64_t lo = pc->lo, k = pc->hi - pc->lo;
    void *b = j->buf[i] ? at(j->buf[i], lo) : NULL;
    void *own;
    const void *g = grad_piece(j, i, lo, k, &own);
    if (j->p[i]->dtype == NB_F32)
        sgd_f32(at(j->p[i], lo), g, b, k, j->steps[i] == 1, j->hp[i]);
    else
        sgd_f64(at(j->p[i], lo), g, b, k, j->steps[i] == 1, j->hp[i]);
    free(own);
    shadow_piece(j, i, lo, k);
}

void nb__cpu_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf,
                 const int64_t *steps, const double *const *hp, const nb__update_extras *x) {
    multi_job j = {.p = p, .g = g, .buf = buf, .steps = steps, .hp = hp, .fn = sgd_piece};
    if (!take_extras(&j, x)) return;
    int64_t np;
    run_pieces(n, p, &j, &np, false);
    finish_pieces(&j);
}

#define LANES 8

#define SUMSQ(T, NAME)                                                                      \
    static double NAME(const T *x, int64_t n) {                                             \
        double acc[LANES] = {0};                                                            \
        int64_t i = 0;                                                                      \
        for (; i + LANES <= n; i += LANES)                                                  \
            for (int k = 0; k < LANES; k++) {                                               \
                double v = (double)x[i + k];                                                \
                acc[k] += v * v;                                                            \
            }                                                                               \
        for (; i < n; i++) {                                                                \
            double v = (double)x[i];                                                        \
            acc[0] += v * v;                                                                \
        }                                                                                   \
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
    }

#define MAXABS(T, NAME)                                                                     \
    static double NAME(const T *x, int64_t n, bool *nan) {                                  \
        double m = 0;                                                                       \
        bool any_nan = false;                                                               \
        for (int64_t i = 0; i < n; i++) {                                                   \
            double v = fabs((double)x[i]);                                                  \
            m = v > m ? v : m;                                                              \
            any_nan |= v != v;                                                              \
        }                                                                                   \
        *nan |= any_nan;                                                                    \
        return m;                                                                           \
    }

SUMSQ(float, sumsq_f32)
SUMSQ(double, sumsq_f64)
MAXABS(float, maxabs_f32)
MAXABS(double, maxabs_f64)

static void sumsq_piece(const multi_job *j, const piece *pc, int64_t c) {
    const nb_tensor *t = j->p[pc->t];
    int64_t k = pc->hi - pc->lo;
    j->partial[c] = t->dtype == NB_F32 ? sumsq_f32(at(t, pc->lo), k) : sumsq_f64(at(t, pc->lo), k);
}

void nb__cpu_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts) {
    multi_job j = {.p = ts, .fn = sumsq_piece};
    int64_t np;
    piece *pcs = run_pieces(n, ts, &j, &np, true);
    double s = 0;
    for (int64_t c = 0; c < np;) { /* per tensor: its pieces in order, then the tensors in order */
        double st = 0;
        int t = pcs[c].t;
        for (; c < np && pcs[c].t == t; c++) st += j.partial[c];
        s += st;
    }
    finish_pieces(&j);
    *(double *)out->data = s;
}

static void maxabs_piece(const multi_job *j, const piece *pc, int64_t c) {
    const nb_tensor *t = j->p[pc->t];
    int64_t k = pc->hi - pc->lo;
    j->partial[c] = t->dtype == NB_F32 ? maxabs_f32(at(t, pc->lo), k, &j->flag[c])
                                       : maxabs_f64(at(t, pc->lo), k, &j->flag[c]);
}

void nb__cpu_max_abs(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts) {
    (void)ctx;
    multi_job j = {.p = ts, .fn = maxabs_piece};
    int64_t np;
    run_pieces(n, ts, &j, &np, true);
    double m = 0;
    bool nan = false;
    for (int64_t c = 0; c < np; c++) {
        if (j.partial[c] > m) m = j.partial[c];
        nan |= j.flag[c];
    }
    finish_pieces(&j);
    *(double *)out->data = nan ? NAN : m;
}

static void scale_piece(const multi_job *j, const piece *pc, int64_t c) {
    (void)c;
    const nb_tensor *t = j->p[pc->t];
    if (t->dtype == NB_F32) {
        float *x = t->data;
        for (int64_t i = pc->lo; i < pc->hi; i++) x[i] = (float)((double)x[i] * j->coef);
    } else {
        double *x = t->data;
        for (int64_t i = pc->lo; i < pc->hi; i++) x[i] *= j->coef;
    }
}

void nb__cpu_scale(int n, nb_tensor *const *ts, double coef) {
    multi_job j = {.p = ts, .coef = coef, .fn = scale_piece};
    int64_t np;
    run_pieces(n, ts, &j, &np, false);
    finish_pieces(&j);
}

/* the norm is host memory here: read it, and scale as nb_clip_grad_norm did */
void nb__cpu_clip_scale(int n, nb_tensor *const *ts, const nb_tensor *norm, double max_norm) {
    double v = *(const double *)norm->data, coef = max_norm / (v + 1e-6);
    if (isfinite(v) && coef < 1.0) nb__cpu_scale(n, ts, coef);
}

/* flag[c] = the piece holds a NaN or an infinity */
static void finite_piece(const multi_job *j, const piece *pc, int64_t c) {
    const nb_tensor *g = j->p[pc->t];
    bool ok = true;
    if (g->dtype == NB_F32) {
        const float *x = g->data;
        for (int64_t i = pc->lo; i < pc->hi; i++) ok &= isfinite(x[i]) != 0;
    } else if (g->dtype == NB_F64) {
        const double *x = g->data;
        for (int64_t i = pc->lo; i < pc->hi; i++) ok &= isfinite(x[i]) != 0;
    } else {
        size_t es = nb_dtype_size(g->dtype);
        for (int64_t i = pc->lo; i < pc->hi; i++)
            ok &= isfinite(nb__load((const char *)g->data + (size_t)i * es, g->dtype)) != 0;
    }
    j->flag[c] = !ok;
}

bool nb__cpu_all_finite(nb_ctx *ctx, int n, nb_tensor *const *ts) {
    (void)ctx;
    multi_job j = {.p = ts, .fn = finite_piece};
    int64_t np;
    run_pieces(n, ts, &j, &np, true);
    bool ok = true;
    for (int64_t c = 0; c < np; c++) ok &= !j.flag[c];
    finish_pieces(&j);
    return ok;
}
