/* CPU kernels for layer norm and batch norm (see norm.h).
 *
 * Statistics are computed in double with two passes (mean, then the mean
 * of squared deviations), which stays accurate when |mean| >> std.
 *
 * Backward, with xhat = (x - mean) rstd, dxhat = g w and means over the
 * normalised group of m elements:
 *   dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
 *   dw = sum over the other dims of g xhat,   db = sum of g.
 * Batch norm in eval mode uses fixed statistics: dx = g w invstd. */
#include <math.h>
#include <stdlib.h>

#include "tensor/cpu/bf16.h"
#include "tensor/cpu/norm.h"
#include "tensor/cpu/simd.h"
#include "tensor/cpu/threads.h"
#include "tensor/internal.h"

/* ---- layer norm ----
 * The row sums run in LANES double accumulators that are combined at the
 * end (a fixed order, whatever the vector width), so that the compiler can
 * vectorise them; a plain running sum cannot be reordered. */
#define LANES 8

#define DEFINE_LAYER_NORM(T)                                                                \
    NB_CPU_CLONES static void layer_norm_##T(T *y, double *mean, double *rstd, const T *x,     \
                                             const T *w, const T *b, int64_t i0, int64_t i1, \
                                             int64_t d, double eps) {                       \
        for (int64_t i = i0; i < i1; i++) {                                                 \
            const T *xr = x + i * d;                                                        \
            T *yr = y + i * d;                                                              \
            double ls[LANES] = {0}, lv[LANES] = {0}, s = 0, v = 0;                          \
            int64_t j = 0;                                                                  \
            for (; j + LANES <= d; j += LANES)                                              \
                for (int c = 0; c < LANES; c++) ls[c] += (double)xr[j + c];                 \
            for (; j < d; j++) s += xr[j];                                                  \
            for (int c = 0; c < LANES; c++) s += ls[c];                                     \
            double mu = s / (double)d;                                                      \
            for (j = 0; j + LANES <= d; j += LANES)                                         \
                for (int c = 0; c < LANES; c++) {                                           \
                    double t = (double)xr[j + c] - mu;                                      \
                    lv[c] += t * t;                                                         \
                }                                                                           \
            for (; j < d; j++) {                                                            \
                double t = (double)xr[j] - mu;                                              \
                v += t * t;                                                                 \
            }                                                                               \
            for (int c = 0; c < LANES; c++) v += lv[c];                                     \
            double r = 1.0 / sqrt(v / (double)d + eps);                                     \
            mean[i] = mu;                                                                   \
            rstd[i] = r;                                                                    \
            T tm = (T)mu, tr = (T)r;                                                        \
            for (j = 0; j < d; j++) {                                                       \
                T h = (xr[j] - tm) * tr;                                                    \
                if (w) h *= w[j];                                                           \
                if (b) h += b[j];                                                           \
                yr[j] = h;                                                                  \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    NB_CPU_CLONES static void layer_norm_backward_##T(T *dx, double *ws, const T *g,          \
                                                      const T *x, const double *mean,       \
                                                      const double *rstd, const T *w,       \
                                                      int64_t i0, int64_t i1, int64_t d,    \
                                                      bool want_wb, bool add_dx) {          \
        for (int64_t i = i0; i < i1; i++) {                                                 \
            const T *xr = x + i * d, *gr = g + i * d;                                       \
            double mu = mean[i], r = rstd[i], sa = 0, sb = 0;                               \
            double la[LANES] = {0}, lb[LANES] = {0};                                        \
            int64_t j = 0;                                                                  \
            for (; j + LANES <= d; j += LANES)                                              \
                for (int c = 0; c < LANES; c++) {                                           \
                    double h = ((double)xr[j + c] - mu) * r;                                \
                    double dh = (double)gr[j + c] * (w ? (double)w[j + c] : 1.0);           \
                    la[c] += dh;                                                            \
                    lb[c] += dh * h;                                                        \
                }                                                                           \
            for (; j < d; j++) {                                                            \
                double h = ((double)xr[j] - mu) * r;                                        \
                double dh = (double)gr[j] * (w ? (double)w[j] : 1.0);                       \
                sa += dh;                                                                   \
                sb += dh * h;                                                               \
            }                                                                               \
            for (int c = 0; c < LANES; c++) {                                               \
                sa += la[c];                                                                \
                sb += lb[c];                                                                \
            }                                                                               \
            if (want_wb)                                                                    \
                for (j = 0; j < d; j++) {                                                   \
                    double h = ((double)xr[j] - mu) * r;                                    \
                    ws[j] += (double)gr[j] * h;                                             \
                    ws[d + j] += (double)gr[j];                                             \
                }                                                                           \
            if (!dx) continue;                                                              \
            sa /= (double)d;                                                                \
            sb /= (double)d;                                                                \
            T *dr = dx + i * d;                                                             \
            for (j = 0; j < d; j++) {                                                       \
                double h = ((double)xr[j] - mu) * r;                                        \
                double dh = (double)gr[j] * (w ? (double)w[j] : 1.0);                       \
                T v = (T)(r * (dh - sa - h * sb));                                          \
                dr[j] = add_dx ? dr[j] + v : v; /* rounded, then added: as a separate add */ \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_LAYER_NORM(float)
DEFINE_LAYER_NORM(double)

/* Note [bf16 layer norm in row groups]
 * With bf16 x, y, g and dx (f32 weight and bias, f64 statistics) the f32
 * kernels above run on groups of rows widened into stack buffers of
 * HALF_BUF floats, and the group's f32 results are rounded into y or dx
 * (or, for an added dx, rounded and then added in f32 and rounded again,
 * as the separate add it replaces). Each row is the f32 kernel's row on
 * the same values, and the weight and bias gradients' partial sums take
 * the rows in the same order, so the bits are those of whole-tensor f32
 * twins (Note [bf16 activations on the CPU] in tensor/cpu/bf16.c), without
 * allocating them or passing over them. A row longer than the buffer goes
 * alone through buffers of one row on the heap. */
#define HALF_BUF 2048

/* n buffers of HALF_BUF floats on the stack (stack) or, for a row longer
 * than that, of d floats on the heap (*heap, to free); the rows a group */
static int64_t half_buffers(float *stack, float **heap, float **buf, int n, int64_t d) {
    *heap = NULL;
    if (d <= HALF_BUF) {
        for (int k = 0; k < n; k++) buf[k] = stack + k * HALF_BUF;
        return HALF_BUF / d;
    }
    *heap = malloc((size_t)(n * d) * sizeof(float));
    NB_CHECK(*heap, "nb_layer_norm: out of memory for rows of %lld bf16 values widened",
             (long long)d);
    for (int k = 0; k < n; k++) buf[k] = *heap + k * d;
    return 1;
}

static void layer_norm_half(uint16_t *y, double *mean, double *rstd, const uint16_t *x,
                            const float *w, const float *b, int64_t i0, int64_t i1, int64_t d,
                            double eps) {
    float stack[2 * HALF_BUF], *heap, *buf[2];
    int64_t rows = half_buffers(stack, &heap, buf, 2, d);
    float *bx = buf[0], *by = buf[1];
    for (int64_t i = i0; i < i1; i += rows) {
        int64_t r = i1 - i < rows ? i1 - i : rows;
        nb__f32_from_bf16_n(bx, x + i * d, r * d);
        layer_norm_float(by, mean + i, rstd + i, bx, w, b, 0, r, d, eps);
        nb__bf16_from_f32_n(y + i * d, by, r * d);
    }
    free(heap);
}

static void layer_norm_backward_half(uint16_t *dx, double *ws, const uint16_t *g,
                                     const uint16_t *x, const double *mean, const double *rstd,
                                     const float *w, int64_t i0, int64_t i1, int64_t d,
                                     bool want_wb, bool add_dx) {
    float stack[3 * HALF_BUF], *heap, *buf[3];
    int64_t rows = half_buffers(stack, &heap, buf, 3, d);
    float *bg = buf[0], *bx = buf[1], *bd = buf[2];
    for (int64_t i = i0; i < i1; i += rows) {
        int64_t r = i1 - i < rows ? i1 - i : rows, n = r * d;
        nb__f32_from_bf16_n(bg, g + i * d, n);
        nb__f32_from_bf16_n(bx, x + i * d, n);
        layer_norm_backward_float(dx ? bd : NULL, ws, bg, bx, mean + i, rstd + i, w, 0, r, d,
                                  want_wb, false);
        if (!dx) continue;
        if (add_dx) nb__bf16_add_rounded_n(dx + i * d, bd, n);
        else nb__bf16_from_f32_n(dx + i * d, bd, n);
    }
    free(heap);
}

static bool f32_or_null(const nb_tensor *t) {
    return !t || (t->dtype == NB_F32 && nb_is_contiguous(t));
}

static bool bf16_or_null(const nb_tensor *t) {
    return !t || (t->dtype == NB_BF16 && nb_is_contiguous(t));
}

bool nb__cpu_layer_norm_half_ok(const nb_tensor *out, const nb_tensor *x, const nb_tensor *g,
                                const nb_tensor *w, const nb_tensor *b, int64_t d) {
    return x->dtype == NB_BF16 && bf16_or_null(x) && bf16_or_null(out) && bf16_or_null(g) &&
           f32_or_null(w) && f32_or_null(b) && d > 0;
}

static const void *data_or_null(const nb_tensor *t) { return t ? t->data : NULL; }

/* out[k] = v rounded to out's dtype, or (add) out[k] + that, added in the
 * dtype's arithmetic (f32 for bf16 and f16, as the separate add it
 * replaces) and rounded again. */
static void put_sum(nb_tensor *out, int64_t k, double v, bool add) {
    char *p = (char *)out->data + k * (int64_t)nb_dtype_size(out->dtype);
    if (add) {
        double old = nb__load(p, out->dtype);
        nb__store(p, out->dtype, v);
        double c = nb__load(p, out->dtype); /* the contribution, rounded */
        v = out->dtype == NB_F64 ? old + c : (double)((float)old + (float)c);
    }
    nb__store(p, out->dtype, v);
}

/* Layer norm on the pool: rows in pieces. In backward, dw and db are sums
 * over the rows: each piece of rows (a size fixed by m and d) sums into
 * its own partial, in the same pass as its dx, and the partials are added
 * in piece order, so any thread count gives the same bits (Note
 * [Deterministic parallel kernels] in tensor/cpu/threads.h). */
typedef struct ln_job {
    void *y;
    double *mean, *rstd, *partial;
    const void *x, *w, *b, *g;
    const double *cmean, *crstd;
    int64_t m, d, rows;
    double eps;
    bool f32, half, want_wb, add_dx;
} ln_job;

static void ln_range(void *varg, int64_t lo, int64_t hi) {
    const ln_job *j = varg;
    if (j->half)
        layer_norm_half(j->y, j->mean, j->rstd, j->x, j->w, j->b, lo, hi, j->d, j->eps);
    else if (j->f32)
        layer_norm_float(j->y, j->mean, j->rstd, j->x, j->w, j->b, lo, hi, j->d, j->eps);
    else
        layer_norm_double(j->y, j->mean, j->rstd, j->x, j->w, j->b, lo, hi, j->d, j->eps);
}

void nb__cpu_layer_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x,
                        const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d, double eps) {
    if (nb__cpu_is_bf16(x) && !nb__cpu_layer_norm_half_ok(y, x, NULL, w, b, d)) {
        nb__cpu_layer_norm_bf16(y, mean, rstd, x, w, b, m, d, eps);
        return;
    }
    ln_job j = {.y = y->data, .mean = mean->data, .rstd = rstd->data, .x = x->data,
                .w = data_or_null(w), .b = data_or_null(b), .m = m, .d = d, .eps = eps,
                .f32 = x->dtype == NB_F32, .half = x->dtype == NB_BF16};
    nb__parallel_range(m, nb__grain(3 * d), ln_range, &j);
}

static void ln_backward_piece(void *varg, int64_t c, int tid) {
    (void)tid;
    const ln_job *j = varg;
    int64_t lo = c * j->rows, hi = lo + j->rows < j->m ? lo + j->rows : j->m;
    double *ws = j->want_wb ? j->partial + c * 2 * j->d : NULL;
    for (int64_t k = 0; ws && k < 2 * j->d; k++) ws[k] = 0;
    if (j->half)
        layer_norm_backward_half(j->y, ws, j->g, j->x, j->cmean, j->crstd, j->w, lo, hi, j->d,
                                 j->want_wb, j->add_dx);
    else if (j->f32)
        layer_norm_backward_float(j->y, ws, j->g, j->x, j->cmean, j->crstd, j->w, lo, hi, j->d,
                                  j->want_wb, j->add_dx);
    else
        layer_norm_backward_double(j->y, ws, j->g, j->x, j->cmean, j->crstd, j->w, lo, hi, j->d,
                                   j->want_wb, j->add_dx);
}

void nb__cpu_layer_norm_backward_ws(nb_tensor *dx, nb_tensor *dw, nb_tensor *db, double *ws,
                                    const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                    const nb_tensor *rstd, const nb_tensor *w, int64_t m,
                                    int64_t d, unsigned add) {
    bool want_wb = dw || db;
    /* pieces of rows: at least the pool's grain, at most 16 of them */
    int64_t rows = nb__grain(3 * d), cap = (m + 15) / 16;
    rows = rows > cap ? rows : cap;
    int64_t pieces = nb__chunk_count(m, rows);
    ln_job j = {.y = dx ? dx->data : NULL, .x = x->data, .w = data_or_null(w), .g = g->data,
                .cmean = mean->data, .crstd = rstd->data, .m = m, .d = d, .rows = rows,
                .f32 = x->dtype == NB_F32, .half = x->dtype == NB_BF16, .want_wb = want_wb,
                .add_dx = dx && (add & NB__LN_ADD_DX)};
    j.partial = want_wb && pieces > 1 ? malloc((size_t)(pieces * 2 * d) * sizeof(double)) : ws;
    NB_CHECK(!want_wb || j.partial, "nb_layer_norm backward: out of memory for %lld partial sums "
             "of %lld", (long long)pieces, (long long)(2 * d));
    if (m > 0) nb__parallel_for(pieces, ln_backward_piece, &j);
    if (want_wb && pieces > 1) {
        for (int64_t k = 0; k < 2 * d; k++) {
            double acc = 0;
            for (int64_t c = 0; c < pieces; c++) acc += j.partial[c * 2 * d + k];
            ws[k] = acc;
        }
        free(j.partial);
    }
    if (want_wb && m == 0)
        for (int64_t k = 0; k < 2 * d; k++) ws[k] = 0;
    for (int64_t k = 0; k < d; k++) {
        if (dw) put_sum(dw, k, ws[k], add & NB__LN_ADD_DW);
        if (db) put_sum(db, k, ws[d + k], add & NB__LN_ADD_DB);
    }
}

/* ---- batch norm ---- */
/* Batch norm's per-channel sums run in NB_LANES double lanes (simd.h; a
 * single running sum is one dependent add per element). */
#define DEFINE_BATCH_NORM(T)                                                                \
    static void batch_norm_stats_##T(double *mean, double *var, const T *x, int64_t n,         \
                                     int64_t c, int64_t s) {                                \
        double cnt = (double)(n * s);                                                       \
        for (int64_t ch = 0; ch < c; ch++) {                                                \
            double a[NB_LANES] = {0}, v[NB_LANES] = {0};                                    \
            for (int64_t i = 0; i < n; i++) {                                               \
                const T *p = x + (i * c + ch) * s;                                          \
                int64_t k = 0;                                                              \
                for (; k + NB_LANES <= s; k += NB_LANES)                                    \
                    for (int l = 0; l < NB_LANES; l++) a[l] += p[k + l];                    \
                for (; k < s; k++) a[k % NB_LANES] += p[k];                                 \
            }                                                                               \
            double mu = nb__lanes_sum(a) / cnt;                                                 \
            for (int64_t i = 0; i < n; i++) {                                               \
                const T *p = x + (i * c + ch) * s;                                          \
                int64_t k = 0;                                                              \
                for (; k + NB_LANES <= s; k += NB_LANES)                                    \
                    for (int l = 0; l < NB_LANES; l++) {                                    \
                        double t = (double)p[k + l] - mu;                                   \
                        v[l] += t * t;                                                      \
                    }                                                                       \
                for (; k < s; k++) {                                                        \
                    double t = (double)p[k] - mu;                                           \
                    v[k % NB_LANES] += t * t;                                               \
                }                                                                           \
            }                                                                               \
            mean[ch] = mu;                                                                  \
            var[ch] = nb__lanes_sum(v) / cnt;                                                   \
        }                                                                                   \
    }                                                                                       \
    static void batch_norm_##T(T *y, const T *x, const double *mean, const double *invstd,     \
                               const T *w, const T *b, int64_t n, int64_t c, int64_t s) {   \
        for (int64_t ch = 0; ch < c; ch++) {                                                \
            double sc = invstd[ch] * (w ? (double)w[ch] : 1.0);                             \
            double sh = (b ? (double)b[ch] : 0.0) - mean[ch] * sc;                          \
            T tsc = (T)sc, tsh = (T)sh;                                                     \
            for (int64_t i = 0; i < n; i++) {                                               \
                const T *p = x + (i * c + ch) * s;                                          \
                T *q = y + (i * c + ch) * s;                                                \
                for (int64_t k = 0; k < s; k++) q[k] = p[k] * tsc + tsh;                    \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    static void batch_norm_backward_##T(T *dx, T *dw, T *db, const T *g, const T *x,           \
                                        const double *mean, const double *invstd,           \
                                        const T *w, bool training, int64_t n, int64_t c,    \
                                        int64_t s) {                                        \
        double cnt = (double)(n * s);                                                       \
        for (int64_t ch = 0; ch < c; ch++) {                                                \
            double mu = mean[ch], r = invstd[ch], ag[NB_LANES] = {0}, agh[NB_LANES] = {0};  \
            double wc = w ? (double)w[ch] : 1.0;                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                const T *p = x + (i * c + ch) * s, *q = g + (i * c + ch) * s;               \
                int64_t k = 0;                                                              \
                for (; k + NB_LANES <= s; k += NB_LANES)                                    \
                    for (int l = 0; l < NB_LANES; l++) {                                    \
                        ag[l] += q[k + l];                                                  \
                        agh[l] += (double)q[k + l] * ((double)p[k + l] - mu);               \
                    }                                                                       \
                for (; k < s; k++) {                                                        \
                    ag[k % NB_LANES] += q[k];                                               \
                    agh[k % NB_LANES] += (double)q[k] * ((double)p[k] - mu);                \
                }                                                                           \
            }                                                                               \
            double sg = nb__lanes_sum(ag), sgh = nb__lanes_sum(agh) * r;                            \
            if (dw) dw[ch] = (T)sgh;                                                        \
            if (db) db[ch] = (T)sg;                                                         \
            if (!dx) continue;                                                              \
            double k1 = wc * r, mg = training ? sg / cnt : 0, mgh = training ? sgh / cnt : 0; \
            for (int64_t i = 0; i < n; i++) {                                               \
                const T *p = x + (i * c + ch) * s, *q = g + (i * c + ch) * s;               \
                T *o = dx + (i * c + ch) * s;                                               \
                for (int64_t k = 0; k < s; k++) {                                           \
                    double h = ((double)p[k] - mu) * r;                                     \
                    o[k] = (T)(k1 * ((double)q[k] - mg - h * mgh));                         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_BATCH_NORM(float)
DEFINE_BATCH_NORM(double)

void nb__cpu_batch_norm_stats(nb_tensor *mean, nb_tensor *var, const nb_tensor *x, int64_t n,
                              int64_t c, int64_t s) {
    if (x->dtype == NB_F32)
        batch_norm_stats_float(mean->data, var->data, x->data, n, c, s);
    else
        batch_norm_stats_double(mean->data, var->data, x->data, n, c, s);
}

void nb__cpu_batch_norm_apply(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                              const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                              int64_t n, int64_t c, int64_t s) {
    if (x->dtype == NB_F32)
        batch_norm_float(y->data, x->data, mean->data, invstd->data, data_or_null(w),
                         data_or_null(b), n, c, s);
    else
        batch_norm_double(y->data, x->data, mean->data, invstd->data, data_or_null(w),
                          data_or_null(b), n, c, s);
}

void nb__cpu_batch_norm_backward_invstd(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                        const nb_tensor *g, const nb_tensor *x,
                                        const nb_tensor *mean, const nb_tensor *invstd,
                                        const nb_tensor *w, bool training, int64_t n, int64_t c,
                                        int64_t s) {
    if (x->dtype == NB_F32)
        batch_norm_backward_float(dx ? dx->data : NULL, dw ? dw->data : NULL,
                                  db ? db->data : NULL, g->data, x->data, mean->data,
                                  invstd->data, data_or_null(w), training, n, c, s);
    else
        batch_norm_backward_double(dx ? dx->data : NULL, dw ? dw->data : NULL,
                                   db ? db->data : NULL, g->data, x->data, mean->data,
                                   invstd->data, data_or_null(w), training, n, c, s);
}

/* element i of a 1-d tensor of any strides */
static void *elem(const nb_tensor *t, int64_t i) {
    return (char *)t->data + i * t->strides[0] * (int64_t)nb_dtype_size(t->dtype);
}

void nb__cpu_batch_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *invstd, const nb_tensor *x,
                        const nb_tensor *w, const nb_tensor *b, nb_tensor *running_mean,
                        nb_tensor *running_var, bool training, double momentum, double eps,
                        int64_t n, int64_t c, int64_t s) {
    double *mu = mean->data, *is = invstd->data;
    if (training) {
        nb__cpu_batch_norm_stats(mean, invstd, x, n, c, s); /* invstd holds the variance */
        double unbias = (double)(n * s) / (double)(n * s - 1);
        for (int64_t k = 0; k < c; k++) {
            if (running_mean) {
                void *pm = elem(running_mean, k);
                void *pv = elem(running_var, k);
                double rm = nb__load(pm, running_mean->dtype), rv = nb__load(pv, running_var->dtype);
                nb__store(pm, running_mean->dtype, (1 - momentum) * rm + momentum * mu[k]);
                nb__store(pv, running_var->dtype, (1 - momentum) * rv + momentum * is[k] * unbias);
            }
            is[k] = 1.0 / sqrt(is[k] + eps);
        }
    } else {
        for (int64_t k = 0; k < c; k++) {
            mu[k] = nb__load(elem(running_mean, k), running_mean->dtype);
            double rv = nb__load(elem(running_var, k), running_var->dtype);
            is[k] = 1.0 / sqrt(rv + eps);
        }
    }
    nb__cpu_batch_norm_apply(y, x, mean, invstd, w, b, n, c, s);
}
