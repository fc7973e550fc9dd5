/* CPU kernels for softmax, log-softmax and cross-entropy (see softmax.h).
 *
 * Every row subtracts its maximum before exponentiating, so no exp
 * overflows. Sums are accumulated in double for both dtypes. When the
 * axis is not the last dim (I > 1), columns are processed in tiles of
 * TILE so that the inner loops run over contiguous memory. */
#include <math.h>

#include "tensor/cpu/simd.h"
#include "tensor/cpu/softmax.h"
#include "tensor/internal.h"

#define TILE 64

/* ---- softmax forward ---- */
#define DEFINE_SOFTMAX(T, EXP)                                                              \
    static void softmax_row_##T(T *y, const T *x, int64_t k, bool take_log) {                     \
        T mx = -INFINITY;                                                                   \
        for (int64_t j = 0; j < k; j++) mx = x[j] > mx ? x[j] : mx;                         \
        double s = 0;                                                                       \
        if (take_log) {                                                                          \
            for (int64_t j = 0; j < k; j++) s += EXP(x[j] - mx);                             \
            T lse = (T)((double)mx + log(s));                                              \
            for (int64_t j = 0; j < k; j++) y[j] = x[j] - lse;                              \
        } else {                                                                            \
            for (int64_t j = 0; j < k; j++) {                                               \
                y[j] = EXP(x[j] - mx);                                                      \
                s += y[j];                                                                  \
            }                                                                               \
            T inv = (T)(1.0 / s);                                                           \
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
    static void softmax_##T(T *y, const T *x, int64_t outer, int64_t k, int64_t inner,        \
                            bool take_log) {                                                     \
        for (int64_t o = 0; o < outer; o++) {                                               \
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

void nb__cpu_softmax(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k, int64_t inner,
                     bool take_log) {
    if (x->dtype == NB_F32)
        softmax_float(y->data, x->data, outer, k, inner, take_log);
    else
        softmax_double(y->data, x->data, outer, k, inner, take_log);
}

/* ---- softmax backward ----
 * Per (o, column): r = sum_K g y (softmax) or sum_K g (log-softmax). */
#define DEFINE_SOFTMAX_BACKWARD(T, EXP)                                                     \
    static void softmax_backward_##T(T *dx, const T *y, const T *g, int64_t outer, int64_t k,  \
                                     int64_t inner, bool take_log) {                             \
        double r[TILE];                                                                     \
        for (int64_t o = 0; o < outer; o++) {                                               \
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

DEFINE_SOFTMAX_BACKWARD(float, expf)
DEFINE_SOFTMAX_BACKWARD(double, exp)

void nb__cpu_softmax_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                              int64_t outer, int64_t k, int64_t inner, bool take_log) {
    if (y->dtype == NB_F32)
        softmax_backward_float(dx->data, y->data, g->data, outer, k, inner, take_log);
    else
        softmax_backward_double(dx->data, y->data, g->data, outer, k, inner, take_log);
}

/* ---- causal softmax ----
 * Row i keeps l = min(i + 1, S) entries. The f32 rows run their max and
 * sums in LANES independent lanes, so that GCC vectorises them without
 * reassociating (the lanes are combined at the end), and use nb__exp_f32;
 * exponents below -87 (weights under 1e-38 of the largest) give 0. The
 * f64 rows are the plain reference (gradchecks). */
#define LANES 8

NB_CPU_CLONES static void causal_row_float(float *y, const float *x, int64_t s, int64_t l, float scale) {
    float m[LANES], acc[LANES];
    for (int c = 0; c < LANES; c++) m[c] = -INFINITY, acc[c] = 0;
    int64_t j = 0;
    for (; j + LANES <= l; j += LANES)
        for (int c = 0; c < LANES; c++) {
            float v = scale * x[j + c];
            m[c] = v > m[c] ? v : m[c];
        }
    float mx = -INFINITY;
    for (; j < l; j++) mx = scale * x[j] > mx ? scale * x[j] : mx;
    for (int c = 0; c < LANES; c++) mx = m[c] > mx ? m[c] : mx;
    for (j = 0; j + LANES <= l; j += LANES)
        for (int c = 0; c < LANES; c++) {
            float d = scale * x[j + c] - mx;
            float e = d < -87.0f ? 0.0f : nb__exp_f32(d);
            y[j + c] = e;
            acc[c] += e;
        }
    double sum = 0;
    for (; j < l; j++) {
        float d = scale * x[j] - mx;
        y[j] = d < -87.0f ? 0.0f : nb__exp_f32(d);
        sum += y[j];
    }
    for (int c = 0; c < LANES; c++) sum += acc[c];
    float inv = (float)(1.0 / sum);
    for (j = 0; j < l; j++) y[j] *= inv;
    for (; j < s; j++) y[j] = 0;
}

NB_CPU_CLONES static void causal_row_backward_float(float *dx, const float *y, const float *g, int64_t s,
                                      int64_t l, float scale) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= l; j += LANES)
        for (int c = 0; c < LANES; c++) acc[c] += g[j + c] * y[j + c];
    double dot = 0;
    for (; j < l; j++) dot += (double)g[j] * y[j];
    for (int c = 0; c < LANES; c++) dot += acc[c];
    float r = (float)dot;
    for (j = 0; j < l; j++) dx[j] = scale * y[j] * (g[j] - r);
    for (; j < s; j++) dx[j] = 0;
}

static void causal_row_double(double *y, const double *x, int64_t s, int64_t l, double scale) {
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < l; j++) mx = scale * x[j] > mx ? scale * x[j] : mx;
    for (int64_t j = 0; j < l; j++) sum += y[j] = exp(scale * x[j] - mx);
    for (int64_t j = 0; j < l; j++) y[j] /= sum;
    for (int64_t j = l; j < s; j++) y[j] = 0;
}

static void causal_row_backward_double(double *dx, const double *y, const double *g, int64_t s,
                                       int64_t l, double scale) {
    double dot = 0;
    for (int64_t j = 0; j < l; j++) dot += g[j] * y[j];
    for (int64_t j = 0; j < l; j++) dx[j] = scale * y[j] * (g[j] - dot);
    for (int64_t j = l; j < s; j++) dx[j] = 0;
}

void nb__cpu_causal_rows(nb_dtype dt, void *y, const void *x, int64_t b, int64_t t, int64_t s,
                         double scale) {
    for (int64_t r = 0; r < b * t; r++) {
        int64_t i = r % t, l = i + 1 < s ? i + 1 : s;
        if (dt == NB_F32)
            causal_row_float((float *)y + r * s, (const float *)x + r * s, s, l, (float)scale);
        else
            causal_row_double((double *)y + r * s, (const double *)x + r * s, s, l, scale);
    }
}

void nb__cpu_causal_rows_backward(nb_dtype dt, void *dx, const void *y, const void *g, int64_t b,
                                  int64_t t, int64_t s, double scale) {
    for (int64_t r = 0; r < b * t; r++) {
        int64_t i = r % t, l = i + 1 < s ? i + 1 : s;
        if (dt == NB_F32)
            causal_row_backward_float((float *)dx + r * s, (const float *)y + r * s,
                                      (const float *)g + r * s, s, l, (float)scale);
        else
            causal_row_backward_double((double *)dx + r * s, (const double *)y + r * s,
                                       (const double *)g + r * s, s, l, scale);
    }
}

void nb__cpu_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s,
                            double scale) {
    nb__cpu_causal_rows(x->dtype, y->data, x->data, b, t, s, scale);
}

void nb__cpu_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                     int64_t b, int64_t t, int64_t s, double scale) {
    nb__cpu_causal_rows_backward(y->dtype, dx->data, y->data, g->data, b, t, s, scale);
}

/* ---- cross-entropy ---- */
int64_t nb__cpu_target_at(const nb_tensor *targets, int64_t i) {
    if (targets->dtype == NB_I32) return ((const int32_t *)targets->data)[i];
    return ((const int64_t *)targets->data)[i];
}

#define DEFINE_CROSS_ENTROPY(T, EXP)                                                        \
    static double cross_entropy_##T(T *lse, const T *x, const nb_tensor *targets, int64_t n,  \
                                    int64_t c, int64_t ignore, double eps) {                \
        double total = 0;                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                   \
            const T *row = x + i * c;                                                       \
            T mx = -INFINITY;                                                               \
            for (int64_t j = 0; j < c; j++) mx = row[j] > mx ? row[j] : mx;                 \
            double s = 0, sx = 0;                                                           \
            for (int64_t j = 0; j < c; j++) {                                               \
                s += EXP(row[j] - mx);                                                      \
                sx += row[j];                                                               \
            }                                                                               \
            double l = (double)mx + log(s);                                                 \
            lse[i] = (T)l;                                                                  \
            int64_t t = nb__cpu_target_at(targets, i);                                      \
            if (t == ignore) continue;                                                      \
            double nll = l - (double)row[t];                                                \
            total += eps == 0 ? nll : (1 - eps) * nll + eps * (l - sx / (double)c);         \
        }                                                                                   \
        return total;                                                                       \
    }                                                                                       \
    static void cross_entropy_backward_##T(T *dx, const T *x, const T *lse,                   \
                                           const nb_tensor *targets, int64_t n, int64_t c,   \
                                           int64_t ignore, double eps, double scale) {      \
        T off = (T)(scale * eps / (double)c), on = (T)(scale * (1 - eps)), sc = (T)scale;    \
        for (int64_t i = 0; i < n; i++) {                                                   \
            const T *row = x + i * c;                                                       \
            T *drow = dx + i * c;                                                           \
            int64_t t = nb__cpu_target_at(targets, i);                                      \
            if (t == ignore) {                                                              \
                for (int64_t j = 0; j < c; j++) drow[j] = 0;                                \
                continue;                                                                   \
            }                                                                               \
            for (int64_t j = 0; j < c; j++) drow[j] = sc * EXP(row[j] - lse[i]) - off;      \
            drow[t] -= on;                                                                  \
        }                                                                                   \
    }

DEFINE_CROSS_ENTROPY(float, expf)
DEFINE_CROSS_ENTROPY(double, exp)

double nb__cpu_cross_entropy(nb_tensor *lse, const nb_tensor *logits, const nb_tensor *targets,
                             int64_t ignore_index, double eps) {
    int64_t n = logits->shape[0], c = logits->shape[1];
    if (logits->dtype == NB_F32)
        return cross_entropy_float(lse->data, logits->data, targets, n, c, ignore_index, eps);
    return cross_entropy_double(lse->data, logits->data, targets, n, c, ignore_index, eps);
}

void nb__cpu_cross_entropy_backward(nb_tensor *dlogits, const nb_tensor *logits,
                                    const nb_tensor *lse, const nb_tensor *targets,
                                    int64_t ignore_index, double eps, double scale) {
    int64_t n = logits->shape[0], c = logits->shape[1];
    if (logits->dtype == NB_F32)
        cross_entropy_backward_float(dlogits->data, logits->data, lse->data, targets, n, c,
                                     ignore_index, eps, scale);
    else
        cross_entropy_backward_double(dlogits->data, logits->data, lse->data, targets, n, c,
                                      ignore_index, eps, scale);
}
