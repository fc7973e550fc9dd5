/* Global gradient-norm clipping.
 *
 * The norm is accumulated in double over every gradient as one vector,
 * with eight partial sums in a fixed order (so the result is the same on
 * every run, and the loop is not one long chain of dependent additions).
 * Sums of squares of f32 values cannot overflow a double, but those of
 * large f64 values can: when the 2-norm comes out infinite while every
 * element is finite, it is computed again scaled by the largest magnitude.
 * A non-finite norm leaves the gradients untouched (see nabla/optim.h).
 * Gradients that are not contiguous are read through a double copy.
 *
 * On CUDA the 2-norm is one nb__cuda_sum_squares launch over all the
 * gradients (f64 accumulation) and one host read; the infinity norm is the
 * max of per-gradient maxima of |g| (op front ends, NaN counts as the
 * maximum) and one host read; scaling uses nb_scale_. Temporaries go into
 * a per-thread, per-device scratch context, reset at each use. */
#include <math.h>
#include <stdlib.h>

#include "optim/internal.h"
#include "tensor/cuda/cuda.h"

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

/* ---- CUDA ---- */
enum { MAX_SCRATCH_DEVICES = 64 };

nb_ctx *nb__optim_scratch(nb_device device) {
    static _Thread_local nb_ctx *scratch[MAX_SCRATCH_DEVICES];
    NB_CHECK(device.type == NB_DEVICE_CUDA && device.index >= 0 &&
                 device.index < MAX_SCRATCH_DEVICES,
             "nb__optim_scratch: device %s", nb_device_name(device));
    nb_ctx **c = &scratch[device.index];
    if (!*c) *c = nb_ctx_new(device, 1 << 16);
    else nb_ctx_reset(*c);
    return *c;
}

double nb__cuda_grads_sumsq(nb_ctx *sc, int k, nb_tensor *const *grads) {
    if (k == 0) return 0.0;
    nb_tensor *out = nb__empty(sc, NB_F64, 0, NULL);
    nb__cuda_sum_squares(out, k, grads);
    return nb_item(out);
}

/* max |g| over all grads (NaN when any is NaN), one host read */
static double cuda_maxabs(nb_ctx *sc, int k, nb_tensor *const *grads) {
    nb_tensor **m = nb__ctx_meta(sc, sizeof *m * (size_t)(k > 0 ? k : 1));
    int nm = 0;
    for (int i = 0; i < k; i++) {
        if (nb_numel(grads[i]) == 0) continue;
        nb_tensor *mi = nb_max(sc, nb_abs(sc, grads[i]), 0, NULL, false);
        m[nm] = nb__empty(sc, NB_F64, 0, NULL);
        nb_copy_(m[nm], mi);
        nm++;
    }
    if (nm == 0) return 0.0;
    return nb_item(nb_max(sc, nb_stack(sc, nm, m, 0), 0, NULL, false));
}

static double cuda_norm(nb_device dev, const nb_named_tensor *params, int n, bool l2) {
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)(n > 0 ? n : 1));
    int k = 0;
    for (int i = 0; i < n; i++)
        if (params[i].tensor->grad) gl[k++] = nb__contig(sc, params[i].tensor->grad);
    if (!l2) return cuda_maxabs(sc, k, gl);
    double norm = sqrt(nb__cuda_grads_sumsq(sc, k, gl));
    if (!isinf(norm)) return norm;
    double maxabs = cuda_maxabs(sc, k, gl);
    if (isnan(maxabs)) return NAN;
    if (!isfinite(maxabs) || maxabs == 0) return norm;
    for (int i = 0; i < k; i++) gl[i] = nb__unary(sc, NB_U_MUL_S, gl[i], 1.0 / maxabs);
    return maxabs * sqrt(nb__cuda_grads_sumsq(sc, k, gl)); /* may still be inf */
}

double nb_clip_grad_norm(const nb_named_tensor *params, int n, double max_norm,
                         double norm_type) {
    NB_CHECK(n >= 0 && (n == 0 || params), "nb_clip_grad_norm: bad parameter list (n = %d)", n);
    NB_CHECK(norm_type == 2.0 || (isinf(norm_type) && norm_type > 0),
             "nb_clip_grad_norm: norm_type = %g; supported are 2 and INFINITY", norm_type);
    NB_CHECK(max_norm >= 0 && !isnan(max_norm),
             "nb_clip_grad_norm: max_norm = %g must be >= 0", max_norm);
    nb_device dev = nb_cpu();
    bool first = true;
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = params[i].tensor;
        NB_CHECK(t, "nb_clip_grad_norm: parameter %d is NULL", i);
        if (t->grad) {
            nb__check_float("nb_clip_grad_norm", t->grad);
            NB_CHECK(first || nb_device_eq(dev, t->grad->device),
                     "nb_clip_grad_norm: gradients on %s and %s; all must be on one device",
                     nb_device_name(dev), nb_device_name(t->grad->device));
            dev = t->grad->device;
            first = false;
        }
    }
    norm_acc a = {0, 1.0, 0, false};
    double norm;
    if (dev.type == NB_DEVICE_CUDA) {
        norm = cuda_norm(dev, params, n, norm_type == 2.0);
    } else if (norm_type == 2.0) {
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
