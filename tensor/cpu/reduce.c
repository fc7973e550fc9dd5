/* The CPU row reductions behind nb_sum/nb_mean, nb_max, nb_var and
 * nb_argmax (tensor/ops_reduce.c lays the input out as contiguous rows):
 * each row of `inner` consecutive elements is reduced in order, f32 rows
 * accumulating in double. Contracts: the matching members of nb__backend
 * (tensor/backend.h). */
#include <math.h>
#include <string.h>

#include "tensor/cpu/cpu.h"

#define ROW_LOOP(T, ...)                                                          \
    do {                                                                          \
        const T *src = rows->data;                                                \
        for (int64_t o = 0; o < outer; o++) {                                     \
            const T *r = src + o * inner;                                         \
            __VA_ARGS__                                                           \
        }                                                                         \
    } while (0)

void nb__cpu_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner,
                      double scale) {
#define SUM_BODY(T)                                                               \
    do {                                                                          \
        T *dst = out->data;                                                       \
        ROW_LOOP(T, {                                                             \
            double acc = 0;                                                       \
            for (int64_t i = 0; i < inner; i++) acc += r[i];                      \
            dst[o] = (T)(acc * scale);                                            \
        });                                                                       \
    } while (0)
    if (out->dtype == NB_F32) SUM_BODY(float);
    else SUM_BODY(double);
#undef SUM_BODY
}

/* Note [Max with NaN] in tensor/cuda/reduce.cu: NaN counts as the maximum. */
void nb__cpu_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                      int64_t inner) {
    int64_t *a = arg->data;
#define MAX_BODY(T)                                                               \
    do {                                                                          \
        T *dst = out->data;                                                       \
        ROW_LOOP(T, {                                                             \
            int64_t best = 0;                                                     \
            for (int64_t i = 1; i < inner; i++)                                   \
                if (r[i] > r[best] || (isnan(r[i]) && !isnan(r[best]))) best = i; \
            a[o] = best;                                                          \
            dst[o] = r[best];                                                     \
        });                                                                       \
    } while (0)
    if (out->dtype == NB_F32) MAX_BODY(float);
    else MAX_BODY(double);
#undef MAX_BODY
}

void nb__cpu_argmax_rows(nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner) {
    int64_t *a = arg->data;
#define ARGMAX_BODY(T)                                                            \
    ROW_LOOP(T, {                                                                 \
        int64_t best = 0;                                                         \
        for (int64_t i = 1; i < inner && !isnan(r[best]); i++)                    \
            if (r[i] > r[best] || isnan(r[i])) best = i;                          \
        a[o] = best;                                                              \
    })
    if (rows->dtype == NB_F32) ARGMAX_BODY(float);
    else ARGMAX_BODY(double);
#undef ARGMAX_BODY
}

void nb__cpu_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g,
                               int64_t outer, int64_t inner) {
    const int64_t *a = arg->data;
    size_t gsz = nb_dtype_size(g->dtype), psz = nb_dtype_size(gp->dtype);
    if (outer * inner > 0) memset(gp->data, 0, (size_t)(outer * inner) * psz);
    for (int64_t o = 0; o < outer; o++) {
        double v = nb__load((const char *)g->data + o * (int64_t)gsz, g->dtype);
        nb__store((char *)gp->data + (o * inner + a[o]) * (int64_t)psz, gp->dtype, v);
    }
}

void nb__cpu_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                      int64_t inner, double denom) {
#define VAR_BODY(T)                                                               \
    do {                                                                          \
        T *dst = out->data, *m = mean->data;                                      \
        ROW_LOOP(T, {                                                             \
            double s = 0, ss = 0;                                                 \
            for (int64_t i = 0; i < inner; i++) s += r[i];                        \
            double mu = s / (double)inner;                                        \
            for (int64_t i = 0; i < inner; i++) ss += (r[i] - mu) * (r[i] - mu);  \
            m[o] = (T)mu;                                                         \
            dst[o] = (T)(denom > 0 ? ss / denom : NAN);                           \
        });                                                                       \
    } while (0)
    if (out->dtype == NB_F32) VAR_BODY(float);
    else VAR_BODY(double);
#undef VAR_BODY
}
