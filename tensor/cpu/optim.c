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

#include "optim/internal.h"
#include "tensor/cpu/cpu.h"

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

void nb__cpu_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m,
                  nb_tensor *const *v, nb_tensor *const *vmax, const int64_t *steps,
                  const double *const *hp, bool decoupled) {
    for (int i = 0; i < n; i++) {
        int64_t k = nb_numel(p[i]);
        void *vm = vmax && vmax[i] ? vmax[i]->data : NULL;
        if (p[i]->dtype == NB_F32)
            adam_f32(p[i]->data, g[i]->data, m[i]->data, v[i]->data, vm, k, hp[i], steps[i],
                     decoupled);
        else
            adam_f64(p[i]->data, g[i]->data, m[i]->data, v[i]->data, vm, k, hp[i], steps[i],
                     decoupled);
    }
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

void nb__cpu_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf,
                 const int64_t *steps, const double *const *hp) {
    for (int i = 0; i < n; i++) {
        int64_t k = nb_numel(p[i]);
        void *b = buf[i] ? buf[i]->data : NULL;
        if (p[i]->dtype == NB_F32) sgd_f32(p[i]->data, g[i]->data, b, k, steps[i] == 1, hp[i]);
        else sgd_f64(p[i]->data, g[i]->data, b, k, steps[i] == 1, hp[i]);
    }
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

void nb__cpu_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts) {
    double s = 0;
    for (int i = 0; i < n; i++)
        s += ts[i]->dtype == NB_F32 ? sumsq_f32(ts[i]->data, nb_numel(ts[i]))
                                    : sumsq_f64(ts[i]->data, nb_numel(ts[i]));
    *(double *)out->data = s;
}

void nb__cpu_max_abs(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts) {
    (void)ctx;
    double m = 0;
    bool nan = false;
    for (int i = 0; i < n; i++) {
        double mi = ts[i]->dtype == NB_F32 ? maxabs_f32(ts[i]->data, nb_numel(ts[i]), &nan)
                                           : maxabs_f64(ts[i]->data, nb_numel(ts[i]), &nan);
        if (mi > m) m = mi;
    }
    *(double *)out->data = nan ? NAN : m;
}

void nb__cpu_scale(int n, nb_tensor *const *ts, double coef) {
    for (int i = 0; i < n; i++) {
        int64_t k = nb_numel(ts[i]);
        if (ts[i]->dtype == NB_F32) {
            float *x = ts[i]->data;
            for (int64_t j = 0; j < k; j++) x[j] = (float)((double)x[j] * coef);
        } else {
            double *x = ts[i]->data;
            for (int64_t j = 0; j < k; j++) x[j] *= coef;
        }
    }
}

bool nb__cpu_all_finite(nb_ctx *ctx, int n, nb_tensor *const *ts) {
    (void)ctx;
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        const nb_tensor *g = ts[i];
        int64_t k = nb_numel(g);
        if (g->dtype == NB_F32) {
            const float *x = g->data;
            for (int64_t j = 0; j < k; j++) ok &= isfinite(x[j]) != 0;
        } else if (g->dtype == NB_F64) {
            const double *x = g->data;
            for (int64_t j = 0; j < k; j++) ok &= isfinite(x[j]) != 0;
        } else {
            size_t es = nb_dtype_size(g->dtype);
            for (int64_t j = 0; j < k; j++)
                ok &= isfinite(nb__load((const char *)g->data + (size_t)j * es, g->dtype)) != 0;
        }
    }
    return ok;
}
