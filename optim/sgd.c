/* SGD with momentum, dampening, Nesterov momentum and L2 weight decay,
 * one pass over each parameter, in the parameter's dtype, in the order of
 * operations PyTorch's single-tensor SGD uses:
 *   d = g + wd * p
 *   buf = d                                  (first update of p)
 *   buf = momentum * buf + (1 - dampening) * d  (later updates)
 *   d = nesterov ? d + momentum * buf : buf   (when momentum != 0)
 *   p = p - lr * d */
#include "optim/internal.h"

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

void nb__sgd_update(nb_tensor *p, const nb_tensor *g, nb_tensor *buf, int64_t step,
                    const double *hp) {
    int64_t n = nb_numel(p);
    if (p->dtype == NB_F32)
        sgd_f32(p->data, g->data, buf ? buf->data : NULL, n, step == 1, hp);
    else
        sgd_f64(p->data, g->data, buf ? buf->data : NULL, n, step == 1, hp);
}
