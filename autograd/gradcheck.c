/* Gradient check: analytic gradients of L = sum(f(inputs) * R) against
 * float64 central differences, element by element. R is a fixed random
 * tensor so that every output element contributes with its own weight. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tensor/internal.h"

typedef struct gc_state {
    nb_gradcheck_fn fn;
    void *user;
    int n;
    nb_tensor *const *inputs;
    nb_tensor *weights; /* R, f64, output shape */
} gc_state;

/* L with grad mode off, in a scratch context */
static double eval_loss(gc_state *s, nb_ctx *scratch) {
    nb_ctx_reset(scratch);
    bool prev = nb_set_grad_enabled(false);
    nb_tensor *out = s->fn(scratch, s->inputs, s->user);
    int64_t n = nb_numel(out);
    double acc = 0, *vals = nb_ctx_alloc(scratch, (size_t)(n > 0 ? n : 1) * sizeof(double), 0);
    nb_to_host_f64(out, vals);
    const double *w = s->weights->data;
    for (int64_t i = 0; i < n; i++) acc += vals[i] * w[i];
    nb_set_grad_enabled(prev);
    return acc;
}

static double *element(nb_tensor *t, int64_t flat) {
    int64_t off = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (flat % t->shape[d]) * t->strides[d];
        flat /= t->shape[d];
    }
    return (double *)t->data + off;
}

nb_gradcheck_result nb_gradcheck(nb_gradcheck_fn fn, void *user, int n_inputs, nb_tensor *const *inputs,
                                 double eps, double atol, double rtol) {
    if (eps <= 0) eps = 1e-6;
    if (atol <= 0) atol = 1e-5;
    if (rtol <= 0) rtol = 1e-4;
    nb_gradcheck_result r = {.ok = true, .worst_input = -1, .worst_index = -1};
    for (int i = 0; i < n_inputs; i++)
        NB_CHECK(!inputs[i]->requires_grad || inputs[i]->dtype == NB_F64,
                 "nb_gradcheck: input %d (%s) requires grad but is %s; gradcheck needs f64", i,
                 nb_shape_str(inputs[i]), nb_dtype_name(inputs[i]->dtype));
    for (int i = 0; i < n_inputs; i++)
        NB_CHECK(inputs[i]->node == NULL,
                 "nb_gradcheck: input %d (%s) was made by %s; pass leaves and apply views inside fn",
                 i, nb_shape_str(inputs[i]), inputs[i]->node ? inputs[i]->node->op : "");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *scratch = nb_ctx_new(nb_cpu(), 0);
    for (int i = 0; i < n_inputs; i++)
        if (inputs[i]->requires_grad) nb_zero_grad(inputs[i]);

    bool prev = nb_set_grad_enabled(true);
    nb_tensor *out = fn(ctx, inputs, user);
    NB_CHECK(out->requires_grad, "nb_gradcheck: the function's output does not require grad");
    nb_rng rng = nb_rng_make(12345);
    nb_tensor *w = nb_rand_uniform(ctx, NB_F64, out->ndim, out->shape, 0.5, 1.5, &rng);
    nb_tensor *wc = nb_cast(ctx, w, out->dtype);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, out, wc)));
    nb_set_grad_enabled(prev);

    gc_state s = {fn, user, n_inputs, inputs, w};
    double worst_excess = -INFINITY;
    for (int i = 0; i < n_inputs; i++) {
        nb_tensor *x = inputs[i];
        if (!x->requires_grad) continue;
        int64_t n = nb_numel(x);
        for (int64_t k = 0; k < n; k++) {
            double *p = element(x, k), saved = *p;
            *p = saved + eps;
            double lp = eval_loss(&s, scratch);
            *p = saved - eps;
            double lm = eval_loss(&s, scratch);
            *p = saved;
            double num = (lp - lm) / (2 * eps);
            double ana = x->grad ? *element(x->grad, k) : 0.0;
            double err = fabs(ana - num), tol = atol + rtol * fabs(num);
            if (!(err <= tol)) r.ok = false;
            double excess = isnan(err) ? INFINITY : err - tol;
            if (excess > worst_excess || r.worst_input < 0) {
                worst_excess = excess;
                r.max_abs_err = err;
                r.worst_input = i;
                r.worst_index = k;
                r.analytic = ana;
                r.numeric = num;
            }
        }
    }
    snprintf(r.message, sizeof r.message,
             "gradcheck %s: worst element %lld of input %d: analytic %.10g, numeric %.10g, |diff| %.3g",
             r.ok ? "passed" : "FAILED", (long long)r.worst_index, r.worst_input, r.analytic, r.numeric,
             r.max_abs_err);
    nb_ctx_free(scratch);
    nb_ctx_free(ctx);
    return r;
}
