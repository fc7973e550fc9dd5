/* Global gradient-norm clipping.
 *
 * The norm is accumulated in double over every gradient as one vector,
 * with eight partial sums in a fixed order (so the result is the same on
 * every run, and the loop is not one long chain of dependent additions).
 * Sums of squares of f32 values cannot overflow a double, but those of
 * large f64 values can: when the 2-norm comes out infinite while every
 * element is finite, it is computed again scaled by the largest magnitude.
 * A non-finite norm leaves the gradients untouched (see nabla/optim.h).
 * Gradients that are not contiguous are read through a double copy. */
#include <math.h>
#include <stdlib.h>

#include "optim/internal.h"

typedef struct norm_acc {
    double sumsq; /* of values times `inv_scale` */
    double inv_scale;
    double maxabs;
    bool nan;
} norm_acc;

#define LANES 8

#define SUMSQ(T, NAME)                                                                      \
    static double NAME(const T *x, int64_t n, double inv_scale) {                               \
        double acc[LANES] = {0};                                                            \
        int64_t i = 0;                                                                      \
        for (; i + LANES <= n; i += LANES)                                                  \
            for (int k = 0; k < LANES; k++) {                                               \
                double v = (double)x[i + k] * inv_scale;                                    \
                acc[k] += v * v;                                                            \
            }                                                                               \
        for (; i < n; i++) {                                                                \
            double v = (double)x[i] * inv_scale;                                            \
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

static bool direct(const nb_tensor *g) {
    return nb_is_contiguous(g) && g->device.type == NB_DEVICE_CPU;
}

/* Adds g's contribution to a (squares when l2, else the max). */
static void accumulate(const nb_tensor *g, bool l2, norm_acc *a) {
    int64_t n = nb_numel(g);
    const void *x = g->data;
    double *copy = NULL;
    nb_dtype dtype = g->dtype;
    if (!direct(g)) {
        copy = malloc(sizeof(double) * (size_t)(n ? n : 1));
        NB_CHECK(copy, "nb_clip_grad_norm: out of memory copying a gradient of %lld elements",
                 (long long)n);
        nb_to_host_f64(g, copy);
        x = copy;
        dtype = NB_F64;
    }
    if (l2) {
        a->sumsq += dtype == NB_F32 ? sumsq_f32(x, n, a->inv_scale)
                                    : sumsq_f64(x, n, a->inv_scale);
    } else {
        double m = dtype == NB_F32 ? maxabs_f32(x, n, &a->nan) : maxabs_f64(x, n, &a->nan);
        if (m > a->maxabs) a->maxabs = m;
    }
    free(copy);
}

static void scale_grad(nb_tensor *g, double coef) {
    if (!direct(g)) {
        nb_scale_(g, coef);
        return;
    }
    int64_t n = nb_numel(g);
    if (g->dtype == NB_F32) {
        float *x = g->data;
        for (int64_t i = 0; i < n; i++) x[i] = (float)((double)x[i] * coef);
    } else {
        double *x = g->data;
        for (int64_t i = 0; i < n; i++) x[i] *= coef;
    }
}

double nb_clip_grad_norm(const nb_named_tensor *params, int n, double max_norm,
                         double norm_type) {
    NB_CHECK(n >= 0 && (n == 0 || params), "nb_clip_grad_norm: bad parameter list (n = %d)", n);
    NB_CHECK(norm_type == 2.0 || (isinf(norm_type) && norm_type > 0),
             "nb_clip_grad_norm: norm_type = %g; supported are 2 and INFINITY", norm_type);
    NB_CHECK(max_norm >= 0 && !isnan(max_norm),
             "nb_clip_grad_norm: max_norm = %g must be >= 0", max_norm);
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = params[i].tensor;
        NB_CHECK(t, "nb_clip_grad_norm: parameter %d is NULL", i);
        if (t->grad) {
            nb__check_float("nb_clip_grad_norm", t->grad);
            nb__check_cpu("nb_clip_grad_norm", t->grad);
        }
    }
    norm_acc a = {0, 1.0, 0, false};
    double norm;
    if (norm_type == 2.0) {
        for (int i = 0; i < n; i++)
            if (params[i].tensor->grad) accumulate(params[i].tensor->grad, true, &a);
        norm = sqrt(a.sumsq);
        if (isinf(norm)) {
            for (int i = 0; i < n; i++)
                if (params[i].tensor->grad) accumulate(params[i].tensor->grad, false, &a);
            if (a.nan) {
                norm = NAN;
            } else if (isfinite(a.maxabs)) {
                a.sumsq = 0;
                a.inv_scale = 1.0 / a.maxabs;
                for (int i = 0; i < n; i++)
                    if (params[i].tensor->grad) accumulate(params[i].tensor->grad, true, &a);
                norm = a.maxabs * sqrt(a.sumsq); /* may still be inf: a true overflow */
            }
        }
    } else {
        for (int i = 0; i < n; i++)
            if (params[i].tensor->grad) accumulate(params[i].tensor->grad, false, &a);
        norm = a.nan ? NAN : a.maxabs;
    }
    if (!isfinite(norm)) return norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
        for (int i = 0; i < n; i++)
            if (params[i].tensor->grad) scale_grad(params[i].tensor->grad, coef);
    return norm;
}

double nb_optim_clip_grad_norm(nb_optim *opt, double max_norm, double norm_type) {
    NB_CHECK(opt, "nb_optim_clip_grad_norm: NULL optimizer");
    nb_named_tensor *list = malloc(sizeof *list * (size_t)opt->n_params);
    NB_CHECK(list, "nb_optim_clip_grad_norm: out of memory");
    for (int i = 0; i < opt->n_params; i++) {
        list[i].name = opt->params[i].name;
        list[i].tensor = opt->params[i].param;
    }
    double norm = nb_clip_grad_norm(list, opt->n_params, max_norm, norm_type);
    free(list);
    return norm;
}
