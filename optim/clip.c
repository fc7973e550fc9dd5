/* Global gradient-norm clipping.
 *
 * The norm is accumulated in double over every gradient as one vector.
 * Sums of squares of f32 values cannot overflow a double, but those of
 * large f64 values can: when the 2-norm comes out infinite while every
 * element is finite, it is computed again scaled by the largest magnitude.
 * A non-finite norm leaves the gradients untouched (see nabla/optim.h). */
#include <math.h>
#include <stdlib.h>

#include "optim/internal.h"

typedef struct norm_acc {
    double sumsq;  /* of unscaled values */
    double maxabs;
    bool nan;
} norm_acc;

/* Calls fn(values, n, user) on the gradient's elements as doubles: the
 * contiguous f64 memory itself, or converted copies in chunks. */
typedef void (*chunk_fn)(const double *x, int64_t n, void *user);

static void visit(const nb_tensor *g, chunk_fn fn, void *user) {
    int64_t n = nb_numel(g);
    if (g->dtype == NB_F64 && nb_is_contiguous(g)) {
        fn(g->data, n, user);
        return;
    }
    if (g->dtype == NB_F32 && nb_is_contiguous(g)) {
        enum { CHUNK = 4096 };
        double buf[CHUNK];
        const float *x = g->data;
        for (int64_t i = 0; i < n; i += CHUNK) {
            int64_t m = n - i < CHUNK ? n - i : CHUNK;
            for (int64_t j = 0; j < m; j++) buf[j] = x[i + j];
            fn(buf, m, user);
        }
        return;
    }
    double *all = malloc(sizeof(double) * (size_t)(n ? n : 1));
    NB_CHECK(all, "nb_clip_grad_norm: out of memory copying a gradient of %lld elements",
             (long long)n);
    nb_to_host_f64(g, all);
    fn(all, n, user);
    free(all);
}

static void acc_l2(const double *x, int64_t n, void *user) {
    norm_acc *a = user;
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    a->sumsq += s;
}

static void acc_max(const double *x, int64_t n, void *user) {
    norm_acc *a = user;
    for (int64_t i = 0; i < n; i++) {
        double v = fabs(x[i]);
        if (v > a->maxabs) a->maxabs = v;
        if (isnan(v)) a->nan = true;
    }
}

typedef struct scaled_acc {
    double scale, sumsq;
} scaled_acc;

static void acc_scaled(const double *x, int64_t n, void *user) {
    scaled_acc *a = user;
    for (int64_t i = 0; i < n; i++) {
        double v = x[i] / a->scale;
        a->sumsq += v * v;
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
    norm_acc a = {0, 0, false};
    double norm;
    if (norm_type == 2.0) {
        for (int i = 0; i < n; i++)
            if (params[i].tensor->grad) visit(params[i].tensor->grad, acc_l2, &a);
        norm = sqrt(a.sumsq);
        if (isinf(norm)) {
            for (int i = 0; i < n; i++)
                if (params[i].tensor->grad) visit(params[i].tensor->grad, acc_max, &a);
            if (a.nan) norm = NAN;
            else if (isfinite(a.maxabs)) {
                scaled_acc s = {a.maxabs, 0};
                for (int i = 0; i < n; i++)
                    if (params[i].tensor->grad) visit(params[i].tensor->grad, acc_scaled, &s);
                norm = a.maxabs * sqrt(s.sumsq); /* may still be inf: a true overflow */
            }
        }
    } else {
        for (int i = 0; i < n; i++)
            if (params[i].tensor->grad) visit(params[i].tensor->grad, acc_max, &a);
        norm = a.nan ? NAN : a.maxabs;
    }
    if (!isfinite(norm)) return norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
        for (int i = 0; i < n; i++)
            if (params[i].tensor->grad) nb_scale_(params[i].tensor->grad, coef);
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
