/* Adam and AdamW, one pass over each parameter reading p, g, m, v and
 * writing p, m, v, in the parameter's dtype. The order of operations is
 * PyTorch's single-tensor Adam; the per-step scalars are computed in
 * double, then rounded to the dtype:
 *   Adam:  g = g + wd * p                    (L2 penalty)
 *   AdamW: p = p * (1 - lr * wd)             (decoupled decay)
 *   m = lerp(m, g, 1 - beta1)
 *   v = beta2 * v + (1 - beta2) * g * g
 *   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * lerp(a, b, w) is a + w (b - a) for w < 0.5 and b - (b - a)(1 - w)
 * otherwise, the form that is exact at both ends. */
#include <math.h>

#include "optim/internal.h"

#define ADAM_KERNEL(T, SQRT, NAME)                                                         \
    static void NAME(T *restrict p, const T *restrict g, T *restrict m, T *restrict v,    \
                     int64_t n, const double *hp, int64_t step, bool decoupled) {          \
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
        for (int64_t i = 0; i < n; i++) {                                                  \
            T pi = p[i], gi = g[i];                                                        \
            if (l2 != 0) gi = gi + l2 * pi;                                                \
            if (shrink_on) pi = pi * shrink;                                               \
            T mi = lerp_lo ? m[i] + w * (gi - m[i]) : gi - (gi - m[i]) * w1;               \
            T vi = v[i] * beta2 + c2 * gi * gi;                                            \
            T denom = SQRT(vi) / bc2_sqrt + eps;                                           \
            p[i] = pi + neg_step * (mi / denom);                                           \
            m[i] = mi;                                                                     \
            v[i] = vi;                                                                     \
        }                                                                                  \
    }

ADAM_KERNEL(float, sqrtf, adam_f32)
ADAM_KERNEL(double, sqrt, adam_f64)

void nb__adam_update(nb_tensor *p, const nb_tensor *g, nb_tensor *m, nb_tensor *v, int64_t step,
                     const double *hp, bool decoupled) {
    int64_t n = nb_numel(p);
    if (p->dtype == NB_F32)
        adam_f32(p->data, g->data, m->data, v->data, n, hp, step, decoupled);
    else
        adam_f64(p->data, g->data, m->data, v->data, n, hp, step, decoupled);
}
