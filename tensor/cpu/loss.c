/* The CPU backend's elementwise losses (tensor/backend.h; the ops are in
 * tensor/ops_loss.c): the mean over elements of (a - b)^2 (kind 0) or of
 * max(a, 0) - a b + log1p(exp(-|a|)) (kind 1), summed in double; a and b
 * contiguous f32 or f64 of one shape. */
#include <math.h>

#include "tensor/cpu/cpu.h"

typedef enum pair_loss { LOSS_MSE, LOSS_BCE } pair_loss;

/* sum over elements of the loss term, in double; a and b contiguous */
#define DEFINE_PAIR_SUM(T, LOG1P, EXP, FABS)                                                \
    static double pair_sum_##T(pair_loss kind, const T *a, const T *b, int64_t n) {          \
        double s = 0;                                                                       \
        if (kind == LOSS_MSE) {                                                             \
            for (int64_t i = 0; i < n; i++) {                                               \
                double d = (double)a[i] - (double)b[i];                                     \
                s += d * d;                                                                 \
            }                                                                               \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                T x = a[i];                                                                 \
                s += (double)((x > 0 ? x : (T)0) - x * b[i] + LOG1P(EXP(-FABS(x))));         \
            }                                                                               \
        }                                                                                   \
        return s;                                                                           \
    }

DEFINE_PAIR_SUM(float, log1pf, expf, fabsf)
DEFINE_PAIR_SUM(double, log1p, exp, fabs)

void nb__cpu_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b) {
    int64_t n = nb_numel(a);
    double s = a->dtype == NB_F32 ? pair_sum_float((pair_loss)kind, a->data, b->data, n)
                                  : pair_sum_double((pair_loss)kind, a->data, b->data, n);
    nb__store(out->data, out->dtype, s / (double)n);
}
