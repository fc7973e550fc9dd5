/* CPU kernels for softmax, log-softmax and cross-entropy (see softmax.h).
 *
 * Every row subtracts its maximum before exponentiating, so no exp
 * overflows. Sums are accumulated in double for both dtypes; f32 rows in
 * lanes with a vectorisable exp (row_expsum_float). When the
 * axis is not the last dim (I > 1), columns are processed in tiles of
 * TILE so that the inner loops run over contiguous memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/bf16.h"
#include "tensor/cpu/simd.h"
#include "tensor/cpu/softmax.h"
#include "tensor/cpu/threads.h"
#include "tensor/internal.h"

#define TILE 64

/* ---- one contiguous row: its max and sum of exp(x - max) ----
 * f32: in NB_LANES lanes (simd.h), the max in f32 and the sum in double;
 * nb__exp_f32 instead of a libm call; exponents below -87 give 0 (weights
 * under 1e-38 of the largest; exactly 0 for -inf, as expf). The values
 * are scale * x (1 for softmax, the causal softmax's scale). f64: the
 * plain sequential loops (gradchecks' reference). NaN: ignored by the
 * max, kept by the sum, in both. */
/* The lanes as one GCC vector: GCC left the array form scalar (a compare
 * and a move per element), the vector select is one instruction a step. */
typedef float lanes_f32 __attribute__((vector_size(NB_LANES * sizeof(float))));
typedef int32_t lanes_i32 __attribute__((vector_size(NB_LANES * sizeof(int32_t))));

NB_CPU_CLONES static float row_max_float(const float *x, int64_t k, float scale) {
    _Static_assert(NB_LANES == 8, "row_max_float's initial lanes are written for 8");
    lanes_f32 m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                   -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t j = 0;
    for (; j + NB_LANES <= k; j += NB_LANES) {
        lanes_f32 v;
        memcpy(&v, x + j, sizeof v);
        v *= scale;
        lanes_i32 gt = v > m; /* all ones where v > m: never for a NaN v */
        m = (lanes_f32)((gt & (lanes_i32)v) | (~gt & (lanes_i32)m));
    }
    float mx = -INFINITY;
    for (; j < k; j++) mx = scale * x[j] > mx ? scale * x[j] : mx;
    for (int c = 0; c < NB_LANES; c++) mx = m[c] > mx ? m[c] : mx;
    return mx;
}

static inline float exp_or_zero(float d) { return d < -87.0f ? 0.0f : nb__exp_f32(d); }

/* sum of exp(scale * x - mx), each also stored in y unless y is NULL.
 * No AVX-512 clone: it took 1700-1735 samples against the AVX2 clone's
 * 1272-1283 in a GPT L6 bf16 step's profile (bench_ddp --model gpt6 --bf16
 * --steps 40, 1 thread, perf record, ~28K samples each; 2-core AVX-512
 * Xeon, 2026-12-02), the attention's causal rows of 1 to 128. */
NB_CPU_CLONES_AVX2 static double row_expsum_float(float *y, const float *x, int64_t k, float scale,
                                             float mx) {
    double a[NB_LANES] = {0};
    int64_t j = 0;
    if (y) {
        for (; j + NB_LANES <= k; j += NB_LANES)
            for (int c = 0; c < NB_LANES; c++)
                a[c] += y[j + c] = exp_or_zero(scale * x[j + c] - mx);
        for (; j < k; j++) a[j % NB_LANES] += y[j] = exp_or_zero(scale * x[j] - mx);
    } else {
        for (; j + NB_LANES <= k; j += NB_LANES)
            for (int c = 0; c < NB_LANES; c++) a[c] += exp_or_zero(scale * x[j + c] - mx);
        for (; j < k; j++) a[j % NB_LANES] += exp_or_zero(scale * x[j] - mx);
    }
    return nb__lanes_sum(a);
}

static double row_max_double(const double *x, int64_t k, double scale) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < k; j++) mx = scale * x[j] > mx ? scale * x[j] : mx;
    return mx;
}

static double row_expsum_double(double *y, const double *x, int64_t k, double scale, double mx) {
    double s = 0;
    for (int64_t j = 0; j < k; j++) {
        double e = exp(scale * x[j] - mx);
        if (y) y[j] = e;
        s += e;
    }
    return s;
}

/* ---- softmax forward ---- */
#define DEFINE_SOFTMAX(T, EXP)                                                              \
    NB_CPU_CLONES static void softmax_row_##T(T *y, const T *x, int64_t k, bool take_log) {       \
        T mx = row_max_##T(x, k, 1);                                                           \
        if (take_log) {                                                                          \
            T lse = (T)((double)mx + log(row_expsum_##T(NULL, x, k, 1, mx)));                  \
            for (int64_t j = 0; j < k; j++) y[j] = x[j] - lse;                              \
        } else {                                                                            \
            T inv = (T)(1.0 / row_expsum_##T(y, x, k, 1, mx));                                 \
            for (int64_t j = 0; j < k; j++) y[j] *= inv;                                    \
        }                                                                                   \
    }                                                                                       \
    /* columns [0, w) of a (K, I) block, w <= TILE */                                       \
    static void softmax_tile_##T(T *y, const T *x, int64_t k, int64_t inner, int64_t w,       \
                                 bool take_log) {                                                \
        T mx[TILE];                                                                         \
        double s[TILE];                                                                     \
        for (int64_t c = 0; c < w; c++) {                                                   \
            mx[c] = -INFINITY;                                                              \
            s[c] = 0;                                                                       \
        }                                                                                   \
        for (int64_t j = 0; j < k; j++)                                                     \
            for (int64_t c = 0; c < w; c++) {                                               \
                T v = x[j * inner + c];                                                     \
                mx[c] = v > mx[c] ? v : mx[c];                                              \
            }                                                                               \
        for (int64_t j = 0; j < k; j++)                                                     \
            for (int64_t c = 0; c < w; c++) {                                               \
                T e = EXP(x[j * inner + c] - mx[c]);                                        \
                s[c] += e;                                                                  \
                if (!take_log) y[j * inner + c] = e;                                             \
            }                                                                               \
        if (take_log) {                                                                          \
            for (int64_t c = 0; c < w; c++) mx[c] = (T)((double)mx[c] + log(s[c]));         \
            for (int64_t j = 0; j < k; j++)                                                 \
                for (int64_t c = 0; c < w; c++) y[j * inner + c] = x[j * inner + c] - mx[c];  \
        } else {                                                                            \
            for (int64_t c = 0; c < w; c++) mx[c] = (T)(1.0 / s[c]);                        \
            for (int64_t j = 0; j < k; j++)                                                 \
                for (int64_t c = 0; c < w; c++) y[j * inner + c] *= mx[c];                  \
        }                                                                                   \
    }                                                                                       \
    static void softmax_##T(T *y, const T *x, int64_t o0, int64_t o1, int64_t k, int64_t inner, \
                            bool take_log) {                                                     \
        for (int64_t o = o0; o < o1; o++) {                                                 \
            const T *xb = x + o * k * inner;                                                \
            T *yb = y + o * k * inner;                                                      \
            if (inner == 1) {                                                               \
                softmax_row_##T(yb, xb, k, take_log);                                            \
                continue;                                                                   \
            }                                                                               \
            for (int64_t c0 = 0; c0 < inner; c0 += TILE) {                                  \
                int64_t w = inner - c0 < TILE ? inner - c0 : TILE;                          \
                softmax_tile_##T(yb + c0, xb + c0, k, inner, w, take_log);                       \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_SOFTMAX(float, expf)
DEFINE_SOFTMAX(double, exp)

/* Parallel jobs over independent rows: blocks of `outer`, or rows of the
 * causal and cross-entropy kernels. */
typedef struct rows_job {
    nb_dtype dt;
    void *y;
    const void *x, *g;
    int64_t k, inner, t, s;
    double scale;
    bool take_log;
    float *lse; /* causal rows: each row's log-sum-exp, or NULL */
} rows_job;

/* Note [bf16 softmax in blocks]
 * bf16 x, y (and g, dx): each (K, I) block of the axis is widened into an
 * f32 buffer, the f32 kernel runs on it in place, and the block is
 * rounded once into the output: the bits of the f32 op on f32 twins of
 * the bf16 values (Note [bf16 activations on the CPU] in
 * tensor/cpu/bf16.c), with buffers of one block (two in backward) instead
 * of twins of every tensor. The causal softmax does the same a row at a
 * time. */
static float *block_buffer(int64_t floats) {
    float *b = malloc((size_t)floats * sizeof(float));
    NB_CHECK(b, "nb_softmax: out of memory for a block of %lld floats", (long long)floats);
    return b;
}

static void softmax_range(void *varg, int64_t lo, int64_t hi) {
    const rows_job *j = varg;
    if (j->dt == NB_F32) {
        softmax_float(j->y, j->x, lo, hi, j->k, j->inner, j->take_log);
    } else if (j->dt == NB_F64) {
        softmax_double(j->y, j->x, lo, hi, j->k, j->inner, j->take_log);
    } else {
        int64_t len = j->k * j->inner;
        float *b = block_buffer(len);
        for (int64_t o = lo; o < hi; o++) {
            nb__f32_from_bf16_n(b, (const uint16_t *)j->x + o * len, len);
            softmax_float(b, b, 0, 1, j->k, j->inner, j->take_log);
            nb__bf16_from_f32_n((uint16_t *)j->y + o * len, b, len);
        }
        free(b);
    }
}

static bool all_bf16_contiguous(int n, const nb_tensor *const *t) {
    for (int i = 0; i < n; i++)
        if (t[i]->dtype != NB_BF16 || !nb_is_contiguous(t[i])) return false;
    return true;
}

void nb__cpu_softmax(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k, int64_t inner,
                     bool take_log) {
    if (nb__cpu_is_bf16(x) && !all_bf16_contiguous(2, (const nb_tensor *[]){x, y})) {
        nb__cpu_softmax_bf16(y, x, outer, k, inner, take_log);
        return;
    }
    rows_job j = {.dt = x->dtype, .y = y->data, .x = x->data, .k = k, .inner = inner,
                  .take_log = take_log};
    nb__parallel_range(outer, nb__grain(k * inner), softmax_range, &j);
}

/* ---- softmax backward ----
 * Per (o, column): r = sum_K g y (softmax) or sum_K g (log-softmax). */
#define DEFINE_SOFTMAX_BACKWARD(T, EXP)                                                     \
    static void softmax_backward_##T(T *dx, const T *y, const T *g, int64_t o0, int64_t o1,    \
                                     int64_t k, int64_t inner, bool take_log) {                  \
        double r[TILE];                                                                     \
        for (int64_t o = o0; o < o1; o++) {                                                 \
            const T *yb = y + o * k * inner, *gb = g + o * k * inner;                       \
            T *db = dx + o * k * inner;                                                     \
            for (int64_t c0 = 0; c0 < inner; c0 += TILE) {                                  \
                int64_t w = inner - c0 < TILE ? inner - c0 : TILE;                          \
                for (int64_t c = 0; c < w; c++) r[c] = 0;                                   \
                for (int64_t j = 0; j < k; j++)                                             \
                    for (int64_t c = 0; c < w; c++) {                                       \
                        int64_t q = j * inner + c0 + c;                                     \
                        r[c] += take_log ? (double)gb[q] : (double)gb[q] * yb[q];                \
                    }                                                                       \
                for (int64_t j = 0; j < k; j++)                                             \
                    for (int64_t c = 0; c < w; c++) {                                       \
                        int64_t q = j * inner + c0 + c;                                     \
                        db[q] = take_log ? gb[q] - EXP(yb[q]) * (T)r[c]                          \
                                    : yb[q] * (gb[q] - (T)r[c]);                            \
                    }                                                                       \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_SOFTMAX_BACKWARD(float, exp_or_zero)
DEFINE_SOFTMAX_BACKWARD(double, exp)

static void softmax_backward_range(void *varg, int64_t lo, int64_t hi) {
    const rows_job *j = varg;
    if (j->dt == NB_F32) {
        softmax_backward_float(j->y, j->x, j->g, lo, hi, j->k, j->inner, j->take_log);
    } else if (j->dt == NB_F64) {
        softmax_backward_double(j->y, j->x, j->g, lo, hi, j->k, j->inner, j->take_log);
    } else { /* Note [bf16 softmax in blocks]; dx written over g's buffer */
        int64_t len = j->k * j->inner;
        float *by = block_buffer(2 * len), *bg = by + len;
        for (int64_t o = lo; o < hi; o++) {
            nb__f32_from_bf16_n(by, (const uint16_t *)j->x + o * len, len);
            nb__f32_from_bf16_n(bg, (const uint16_t *)j->g + o * len, len);
            softmax_backward_float(bg, by, bg, 0, 1, j->k, j->inner, j->take_log);
            nb__bf16_from_f32_n((uint16_t *)j->y + o * len, bg, len);
        }
        free(by);
    }
}

/* (rows_job: y is dx, x is y) */
void nb__cpu_softmax_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                              int64_t outer, int64_t k, int64_t inner, bool take_log) {
    if (nb__cpu_is_bf16(y) && !all_bf16_contiguous(3, (const nb_tensor *[]){dx, y, g})) {
        nb__cpu_softmax_backward_bf16(dx, y, g, outer, k, inner, take_log);
        return;
    }
    rows_job j = {.dt = y->dtype, .y = dx->data, .x = y->data, .g = g->data, .k = k,
                  .inner = inner, .take_log = take_log};
    nb__parallel_range(outer, nb__grain(k * inner), softmax_backward_range, &j);
}

/* ---- causal softmax ----
 * Row i keeps l = min(i + 1, S) entries. The f32 rows are softmax's
 * (row_max_float, row_expsum_float) of scale * x; the f64 rows are the
 * plain reference (gradchecks). */
/* Returns the row's log-sum-exp. */
NB_CPU_CLONES static double causal_row_float(float *y, const float *x, int64_t s, int64_t l,
                                             float scale) {
    float mx = row_max_float(x, l, scale);
    double sum = row_expsum_float(y, x, l, scale, mx);
    float inv = (float)(1.0 / sum);
    int64_t j = 0;
    for (; j < l; j++) y[j] *= inv;
    for (; j < s; j++) y[j] = 0;
    return (double)mx + log(sum);
}

NB_CPU_CLONES static void causal_row_backward_float(float *dx, const float *y, const float *g, int64_t s,
                                      int64_t l, float scale) {
    float acc[NB_LANES] = {0};
    int64_t j = 0;
    for (; j + NB_LANES <= l; j += NB_LANES)
        for (int c = 0; c < NB_LANES; c++) acc[c] += g[j + c] * y[j + c];
    double dot = 0;
    for (; j < l; j++) dot += (double)g[j] * y[j];
    for (int c = 0; c < NB_LANES; c++) dot += acc[c];
    float r = (float)dot;
    for (j = 0; j < l; j++) dx[j] = scale * y[j] * (g[j] - r);
    for (; j < s; j++) dx[j] = 0;
}

static double causal_row_double(double *y, const double *x, int64_t s, int64_t l, double scale) {
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < l; j++) mx = scale * x[j] > mx ? scale * x[j] : mx;
    for (int64_t j = 0; j < l; j++) sum += y[j] = exp(scale * x[j] - mx);
    for (int64_t j = 0; j < l; j++) y[j] /= sum;
    for (int64_t j = l; j < s; j++) y[j] = 0;
    return mx + log(sum);
}

static void causal_row_backward_double(double *dx, const double *y, const double *g, int64_t s,
                                       int64_t l, double scale) {
    double dot = 0;
    for (int64_t j = 0; j < l; j++) dot += g[j] * y[j];
    for (int64_t j = 0; j < l; j++) dx[j] = scale * y[j] * (g[j] - dot);
    for (int64_t j = l; j < s; j++) dx[j] = 0;
}

static void causal_range(void *varg, int64_t lo, int64_t hi) {
    const rows_job *j = varg;
    int64_t t = j->t, s = j->s;
    /* bf16: each row widened, its f32 row run in place and rounded (Note
     * [bf16 softmax in blocks]) */
    float *b = j->dt == NB_BF16 ? block_buffer(s) : NULL;
    for (int64_t r = lo; r < hi; r++) {
        int64_t i = r % t, l = i + 1 < s ? i + 1 : s;
        double lse;
        if (b) {
            nb__f32_from_bf16_n(b, (const uint16_t *)j->x + r * s, s);
            lse = causal_row_float(b, b, s, l, (float)j->scale);
            nb__bf16_from_f32_n((uint16_t *)j->y + r * s, b, s);
        } else if (j->dt == NB_F32)
            lse = causal_row_float((float *)j->y + r * s, (const float *)j->x + r * s, s, l,
                                   (float)j->scale);
        else
            lse = causal_row_double((double *)j->y + r * s, (const double *)j->x + r * s, s, l,
                                    j->scale);
        if (j->lse) j->lse[r] = (float)lse;
    }
    free(b);
}

static void causal_backward_range(void *varg, int64_t lo, int64_t hi) {
    const rows_job *j = varg; /* y is dx, x is y */
    int64_t t = j->t, s = j->s;
    float *by = j->dt == NB_BF16 ? block_buffer(2 * s) : NULL, *bg = by ? by + s : NULL;
    for (int64_t r = lo; r < hi; r++) {
        int64_t i = r % t, l = i + 1 < s ? i + 1 : s;
        if (by) { /* dx written over g's buffer */
            nb__f32_from_bf16_n(by, (const uint16_t *)j->x + r * s, s);
            nb__f32_from_bf16_n(bg, (const uint16_t *)j->g + r * s, s);
            causal_row_backward_float(bg, by, bg, s, l, (float)j->scale);
            nb__bf16_from_f32_n((uint16_t *)j->y + r * s, bg, s);
        } else if (j->dt == NB_F32)
            causal_row_backward_float((float *)j->y + r * s, (const float *)j->x + r * s,
                                      (const float *)j->g + r * s, s, l, (float)j->scale);
        else
            causal_row_backward_double((double *)j->y + r * s, (const double *)j->x + r * s,
                                       (const double *)j->g + r * s, s, l, j->scale);
    }
    free(by);
}

/* Row i of each (T, S) block keeps min(i + 1, S) entries; half of S on
 * average is the work of a row. */
void nb__cpu_causal_rows(nb_dtype dt, void *y, float *lse, const void *x, int64_t b, int64_t t,
                         int64_t s, double scale) {
    rows_job j = {.dt = dt, .y = y, .x = x, .t = t, .s = s, .scale = scale, .lse = lse};
    nb__parallel_range(b * t, nb__grain(s / 2 + 1), causal_range, &j);
}

void nb__cpu_causal_rows_backward(nb_dtype dt, void *dx, const void *y, const void *g, int64_t b,
                                  int64_t t, int64_t s, double scale) {
    rows_job j = {.dt = dt, .y = dx, .x = y, .g = g, .t = t, .s = s, .scale = scale};
    nb__parallel_range(b * t, nb__grain(s / 2 + 1), causal_backward_range, &j);
}

void nb__cpu_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s,
                            double scale) {
    if (nb__cpu_is_bf16(x) && !all_bf16_contiguous(2, (const nb_tensor *[]){x, y})) {
        nb__cpu_softmax_causal_bf16(y, x, b, t, s, scale);
        return;
    }
    nb__cpu_causal_rows(x->dtype, y->data, NULL, x->data, b, t, s, scale);
}

void nb__cpu_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                     int64_t b, int64_t t, int64_t s, double scale) {
    if (nb__cpu_is_bf16(y) && !all_bf16_contiguous(3, (const nb_tensor *[]){dx, y, g})) {
        nb__cpu_softmax_causal_backward_bf16(dx, y, g, b, t, s, scale);
        return;
    }
    nb__cpu_causal_rows_backward(y->dtype, dx->data, y->data, g->data, b, t, s, scale);
}

/* ---- cross-entropy ---- */
int64_t nb__cpu_target_at(const nb_tensor *targets, int64_t i) {
    if (targets->dtype == NB_I32) return ((const int32_t *)targets->data)[i];
    return ((const int64_t *)targets->data)[i];
}

/* Row i's gradient for the scale g / count, from its lse li (in T, as
 * the backward reads it); the fused forward and the backward both write
 * it so, so that their results are bitwise one (Note [Fused classifier]
 * in tensor/ops_loss.c). drow may be row: each element is read before it
 * is written, and row[t] is not read. */
#define DEFINE_CROSS_ENTROPY(T, EXP)                                                        \
    static void ce_grad_row_##T(T *drow, const T *row, T li, int64_t t, int64_t c,           \
                                int64_t ignore, T sc, T off, T on) {                        \
        if (t == ignore) {                                                                  \
            for (int64_t j = 0; j < c; j++) drow[j] = 0;                                    \
            return;                                                                         \
        }                                                                                   \
        for (int64_t j = 0; j < c; j++) drow[j] = sc * EXP(row[j] - li) - off;              \
        drow[t] -= on;                                                                      \
    }                                                                                       \
    /* rows [i0, i1): x, lse and dx point at row i0's; dx, when not NULL, gets the         \
     * gradient for the scale `scale` (fused) */                                            \
    static double cross_entropy_##T(T *lse, T *dx, const T *x, const nb_tensor *targets,    \
                                    int64_t i0, int64_t i1, int64_t c, int64_t ignore,      \
                                    double eps, double scale) {                             \
        T off = (T)(scale * eps / (double)c), on = (T)(scale * (1 - eps)), sc = (T)scale;    \
        double total = 0;                                                                   \
        for (int64_t i = i0; i < i1; i++) {                                                 \
            const T *row = x + (i - i0) * c;                                                \
            T mx = row_max_##T(row, c, 1);                                                     \
            double l = (double)mx + log(row_expsum_##T(NULL, row, c, 1, mx)), sx = 0;          \
            if (eps != 0)                                                                   \
                for (int64_t j = 0; j < c; j++) sx += row[j];                               \
            if (lse) lse[i - i0] = (T)l;                                                    \
            int64_t t = nb__cpu_target_at(targets, i);                                      \
            if (t != ignore) {                                                              \
                double nll = l - (double)row[t];                                            \
                total += eps == 0 ? nll : (1 - eps) * nll + eps * (l - sx / (double)c);     \
            }                                                                               \
            if (dx) ce_grad_row_##T(dx + (i - i0) * c, row, (T)l, t, c, ignore, sc, off, on); \
        }                                                                                   \
        return total;                                                                       \
    }                                                                                       \
    /* rows [i0, i1), dx, x and lse pointing at row i0's; lse NULL: x holds the fused        \
     * forward's gradient, dx = scale x */                                                  \
    static void cross_entropy_backward_##T(T *dx, const T *x, const T *lse,                   \
                                           const nb_tensor *targets, int64_t i0, int64_t i1, \
                                           int64_t c, int64_t ignore, double eps,           \
                                           double scale) {                                  \
        T off = (T)(scale * eps / (double)c), on = (T)(scale * (1 - eps)), sc = (T)scale;    \
        if (!lse) {                                                                         \
            for (int64_t e = 0; e < (i1 - i0) * c; e++) dx[e] = sc * x[e];                  \
            return;                                                                         \
        }                                                                                   \
        for (int64_t i = i0; i < i1; i++)                                                   \
            ce_grad_row_##T(dx + (i - i0) * c, x + (i - i0) * c, lse[i - i0],                    \
                            nb__cpu_target_at(targets, i), c, ignore, sc, off, on);         \
    }

DEFINE_CROSS_ENTROPY(float, exp_or_zero)
DEFINE_CROSS_ENTROPY(double, exp)

/* Rows in pieces of a size fixed by C; the loss is the sum of the pieces'
 * sums in piece order (Note [Deterministic parallel kernels] in
 * tensor/cpu/threads.h).
 *
 * Note [bf16 cross-entropy in pieces]
 * bf16 logits (and dlogits), with an f32 log-sum-exp: each piece's rows
 * are widened into an f32 buffer of the thread running it, the f32 kernel
 * runs on them (its gradient written over them, as it may be over the
 * logits), and the gradient's rows are rounded once into dlogits. Each row
 * is the f32 kernel's row on the same values and the pieces are the f32
 * op's, so the loss, the log-sum-exp and the gradient are the bits of the
 * f32 op on f32 twins of the bf16 values, rounded at the output (Note
 * [bf16 activations on the CPU] in tensor/cpu/bf16.c), without twins:
 * a GPT-2 vocabulary's logits at batch 8 x 1024 would take two of 1.6 GB
 * each, beside 0.8 GB of bf16 logits; the buffers hold a piece each
 * (16384 floats, or one row when longer). */
typedef struct ce_job {
    void *lse, *dx;
    const nb_tensor *logits, *targets;
    int64_t n, c, grain, ignore;
    double eps, scale, *partial;
    float *buf; /* bf16: grain * c floats per thread */
} ce_job;

static bool ce_half(const nb_tensor *logits) { return logits->dtype == NB_BF16; }

static void ce_chunk(void *varg, int64_t piece, int tid) {
    const ce_job *j = varg;
    int64_t i0 = piece * j->grain, i1 = i0 + j->grain < j->n ? i0 + j->grain : j->n, c = j->c;
    float *lse = j->lse ? (float *)j->lse + i0 : NULL;
    if (ce_half(j->logits)) {
        float *b = j->buf + (size_t)tid * (size_t)(j->grain * c);
        nb__f32_from_bf16_n(b, (const uint16_t *)j->logits->data + i0 * c, (i1 - i0) * c);
        j->partial[piece] = cross_entropy_float(lse, j->dx ? b : NULL, b, j->targets, i0, i1, c,
                                                j->ignore, j->eps, j->scale);
        if (j->dx) nb__bf16_from_f32_n((uint16_t *)j->dx + i0 * c, b, (i1 - i0) * c);
    } else if (j->logits->dtype == NB_F32) {
        j->partial[piece] = cross_entropy_float(
            lse, j->dx ? (float *)j->dx + i0 * c : NULL, (const float *)j->logits->data + i0 * c,
            j->targets, i0, i1, c, j->ignore, j->eps, j->scale);
    } else {
        j->partial[piece] = cross_entropy_double(
            j->lse ? (double *)j->lse + i0 : NULL, j->dx ? (double *)j->dx + i0 * c : NULL,
            (const double *)j->logits->data + i0 * c, j->targets, i0, i1, c, j->ignore, j->eps,
            j->scale);
    }
}

/* the per-thread buffers of bf16 pieces (NULL otherwise) */
static float *ce_buffers(const nb_tensor *logits, int64_t pieces, int64_t grain, int64_t c) {
    if (!ce_half(logits)) return NULL;
    size_t floats = (size_t)nb__parallel_threads(pieces) * (size_t)(grain * c);
    float *b = malloc(floats * sizeof(float));
    NB_CHECK(b, "nb_cross_entropy: out of memory for %zu bytes of row buffers (bf16 logits %s)",
             floats * sizeof(float), nb_shape_str(logits));
    return b;
}

double nb__cpu_cross_entropy_rows(nb_tensor *lse, nb_tensor *dlogits, const nb_tensor *logits,
                                  const nb_tensor *targets, int64_t ignore_index, double eps,
                                  double scale) {
    int64_t n = logits->shape[0], c = logits->shape[1], grain = nb__grain(c);
    int64_t pieces = nb__chunk_count(n, grain);
    double one, *partial = pieces == 1 ? &one : malloc((size_t)pieces * sizeof *partial);
    NB_CHECK(partial, "nb_cross_entropy: out of memory for %lld partial sums", (long long)pieces);
    ce_job j = {.lse = lse ? lse->data : NULL, .dx = dlogits ? dlogits->data : NULL,
                .logits = logits, .targets = targets, .n = n, .c = c, .grain = grain,
                .ignore = ignore_index, .eps = eps, .scale = scale, .partial = partial,
                .buf = ce_buffers(logits, pieces, grain, c)};
    nb__parallel_for(pieces, ce_chunk, &j);
    free(j.buf);
    double total = 0;
    for (int64_t p = 0; p < pieces; p++) total += partial[p];
    if (partial != &one) free(partial);
    return total;
}

static void ce_backward_chunk(void *varg, int64_t piece, int tid) {
    const ce_job *j = varg;
    int64_t i0 = piece * j->grain, i1 = i0 + j->grain < j->n ? i0 + j->grain : j->n, c = j->c;
    if (ce_half(j->logits)) {
        float *b = j->buf + (size_t)tid * (size_t)(j->grain * c);
        nb__f32_from_bf16_n(b, (const uint16_t *)j->logits->data + i0 * c, (i1 - i0) * c);
        cross_entropy_backward_float(b, b, j->lse ? (const float *)j->lse + i0 : NULL, j->targets,
                                     i0, i1, c, j->ignore, j->eps, j->scale);
        nb__bf16_from_f32_n((uint16_t *)j->dx + i0 * c, b, (i1 - i0) * c);
    } else if (j->logits->dtype == NB_F32) {
        cross_entropy_backward_float((float *)j->dx + i0 * c,
                                     (const float *)j->logits->data + i0 * c,
                                     j->lse ? (const float *)j->lse + i0 : NULL, j->targets, i0,
                                     i1, c, j->ignore, j->eps, j->scale);
    } else {
        cross_entropy_backward_double((double *)j->dx + i0 * c,
                                      (const double *)j->logits->data + i0 * c,
                                      j->lse ? (const double *)j->lse + i0 : NULL, j->targets,
                                      i0, i1, c, j->ignore, j->eps, j->scale);
    }
}

void nb__cpu_cross_entropy_backward_rows(nb_tensor *dlogits, const nb_tensor *logits,
                                         const nb_tensor *lse, const nb_tensor *targets,
                                         int64_t ignore_index, double eps, double scale) {
    int64_t n = logits->shape[0], c = logits->shape[1], grain = nb__grain(c);
    int64_t pieces = nb__chunk_count(n, grain);
    ce_job j = {.lse = lse ? lse->data : NULL, .dx = dlogits->data, .logits = logits,
                .targets = targets, .n = n, .c = c, .grain = grain, .ignore = ignore_index,
                .eps = eps, .scale = scale, .buf = ce_buffers(logits, pieces, grain, c)};
    nb__parallel_for(pieces, ce_backward_chunk, &j);
    free(j.buf);
}
