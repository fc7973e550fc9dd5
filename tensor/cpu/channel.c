/* The CPU backend's per-channel statistics for SyncBatchNorm
 * (tensor/backend.h; the op is distributed/sync_batch_norm.c). x, y, dy,
 * dx are contiguous (N, C, S), f32 or f64; everything is computed in f64,
 * the statistics' dtype, summing each channel over n then s. */
#include <math.h>

#include "tensor/cpu/cpu.h"

/* element i of a contiguous f32 or f64 tensor */
static inline double load(const nb_tensor *t, int64_t i) {
    return t->dtype == NB_F32 ? (double)((const float *)t->data)[i] : ((const double *)t->data)[i];
}

static inline void store(nb_tensor *t, int64_t i, double v) {
    if (t->dtype == NB_F32) ((float *)t->data)[i] = (float)v;
    else ((double *)t->data)[i] = v;
}

/* element c of a per-channel vector of any dtype and stride */
static double at(const nb_tensor *t, int64_t c) {
    size_t es = nb_dtype_size(t->dtype);
    return nb__load((const char *)t->data + (size_t)(c * t->strides[0]) * es, t->dtype);
}

static void set_at(nb_tensor *t, int64_t c, double v) {
    size_t es = nb_dtype_size(t->dtype);
    nb__store((char *)t->data + (size_t)(c * t->strides[0]) * es, t->dtype, v);
}

void nb__cpu_channel_stats(nb_tensor *stats, const nb_tensor *x, int64_t N, int64_t C, int64_t S) {
    double *cnt = stats->data, *sum = cnt + C, *sq = sum + C;
    for (int64_t c = 0; c < C; c++) {
        cnt[c] = (double)(N * S);
        sum[c] = sq[c] = 0;
    }
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++) {
                double v = load(x, i);
                sum[c] += v;
                sq[c] += v * v;
            }
}

void nb__cpu_channel_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                              nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                              double eps, int64_t C, const nb_tensor *input) {
    const double *cnt = stats->data, *sum = cnt + C, *sq = sum + C;
    double M = C > 0 ? cnt[0] : 2;
    NB_CHECK(M > 1, "nb_sync_batch_norm: the global batch has %g value(s) per channel; training "
             "needs more than one (input %s on this rank)", M, nb_shape_str(input));
    double *mu = mean->data, *is = invstd->data;
    for (int64_t c = 0; c < C; c++) {
        mu[c] = sum[c] / M;
        double var = sq[c] / M - mu[c] * mu[c];
        if (var < 0) var = 0;
        is[c] = 1.0 / sqrt(var + eps);
        if (running_mean) {
            set_at(running_mean, c, (1 - momentum) * at(running_mean, c) + momentum * mu[c]);
            set_at(running_var, c,
                   (1 - momentum) * at(running_var, c) + momentum * var * M / (M - 1));
        }
    }
}

void nb__cpu_channel_normalize(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                               const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                               int64_t N, int64_t C, int64_t S) {
    const double *mu = mean->data, *is = invstd->data;
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++) {
            double wc = w ? at(w, c) : 1.0, bc = b ? at(b, c) : 0.0;
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++)
                store(y, i, (load(x, i) - mu[c]) * is[c] * wc + bc);
        }
}

void nb__cpu_channel_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                   const nb_tensor *mean, const nb_tensor *invstd, int64_t N,
                                   int64_t C, int64_t S) {
    double *sd = sums->data, *sdx = sd + C;
    const double *mu = mean->data, *is = invstd->data;
    for (int64_t c = 0; c < C; c++) sd[c] = sdx[c] = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++) {
                double d = load(dy, i);
                sd[c] += d;
                sdx[c] += d * (load(x, i) - mu[c]) * is[c];
            }
}

void nb__cpu_channel_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                                 const nb_tensor *mean, const nb_tensor *invstd,
                                 const nb_tensor *w, const nb_tensor *sums,
                                 const nb_tensor *stats, int64_t N, int64_t C, int64_t S) {
    const double *sd = sums->data, *sdx = sd + C, *cnt = stats->data;
    const double *mu = mean->data, *is = invstd->data;
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++) {
            double scale = (w ? at(w, c) : 1.0) * is[c];
            double a = sd[c] / cnt[c], bb = sdx[c] / cnt[c];
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++) {
                double xhat = (load(x, i) - mu[c]) * is[c];
                store(dx, i, scale * (load(dy, i) - a - xhat * bb));
            }
        }
}
