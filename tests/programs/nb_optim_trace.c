/* nb_optim_trace: runs nabla's optimizers and gradient clipping on fixed
 * inputs and prints every input and result as JSON on stdout, so that
 * tests/test_optim_vs_torch.py can replay the same runs with torch.optim
 * and torch.nn.utils.clip_grad_norm_ and compare.
 *
 * Each optimizer run has three parameters: a matrix "w" (3, 4) and a
 * vector "b" (4), in the two groups nb_optim_split_decay makes (weight
 * decay only on "w"), and a vector "frozen" (2) that never gets a gradient
 * and must not move. Gradients change every step (b's shrink in the
 * amsgrad runs). Values are printed with
 * 17 significant digits (exact for f64 and f32). Usage: nb_optim_trace */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <nabla/nabla.h>

#include "driver.h"

#define STEPS 5

static void print_values(const nb_tensor *t) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof(double) * (size_t)n);
    nb_to_host_f64(t, v);
    printf("[");
    for (int64_t i = 0; i < n; i++) printf(i ? ", %.17g" : "%.17g", v[i]);
    printf("]");
    free(v);
}

static void fill(nb_tensor *t, double phase) {
    int64_t n = nb_numel(t);
    for (int64_t i = 0; i < n; i++) {
        int64_t idx[2] = {t->ndim == 2 ? i / t->shape[1] : i, t->ndim == 2 ? i % t->shape[1] : 0};
        nb_set(t, idx, sin(1.3 * (double)i + phase) * (1.0 + 0.5 * (double)(i % 3)));
    }
}

typedef struct run_cfg {
    const char *label;
    nb_optim_kind kind;
    nb_optim_hparams h;
} run_cfg;

static void run(const run_cfg *cfg, nb_dtype dtype, int index) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_zeros(ctx, dtype, NB_SHAPE(3, 4));
    nb_tensor *b = nb_zeros(ctx, dtype, NB_SHAPE(4));
    nb_tensor *frozen = nb_zeros(ctx, dtype, NB_SHAPE(2));
    fill(w, 0.1 * index);
    fill(b, 0.2 + 0.1 * index);
    fill(frozen, 0.3);
    nb_tensor *ps[3] = {w, b, frozen};
    for (int i = 0; i < 3; i++) nb_set_requires_grad(ps[i], true);
    nb_set_grad(w, nb_zeros_like(ctx, w));
    nb_set_grad(b, nb_zeros_like(ctx, b));
    nb_named_tensor named[] = {{"w", w}, {"b", b}, {"frozen", frozen}};
    nb_named_tensor scratch[3];
    nb_param_group groups[2];
    nb_optim_split_decay(named, 3, &cfg->h, scratch, groups);
    nb_optim *opt = nb_optim_new_groups(cfg->kind, 2, groups);

    const nb_optim_hparams *h = &cfg->h;
    printf("%s{\"label\": \"%s\", \"kind\": \"%s\", \"dtype\": \"%s\", \"lr\": %.17g, "
           "\"weight_decay\": %.17g, \"momentum\": %.17g, \"dampening\": %.17g, \"nesterov\": %s, "
           "\"beta1\": %.17g, \"beta2\": %.17g, \"eps\": %.17g, \"amsgrad\": %s,\n   \"init\": [",
           index ? ",\n  " : "  ", cfg->label, nb_optim_kind_name(cfg->kind),
           dtype == NB_F32 ? "float32" : "float64", h->lr, h->weight_decay, h->momentum,
           h->dampening, h->nesterov ? "true" : "false", h->beta1, h->beta2, h->eps,
           h->amsgrad ? "true" : "false");
    for (int i = 0; i < 3; i++) {
        printf(i ? ", " : "");
        print_values(ps[i]);
    }
    printf("],\n   \"steps\": [");
    for (int s = 0; s < STEPS; s++) {
        fill(w->grad, 1.7 * s + 0.05 * index);
        fill(b->grad, 2.3 * s + 0.4);
        /* gradients of changing size; shrinking for AMSGrad, so that its maximum matters */
        nb_scale_(b->grad, h->amsgrad ? pow(0.3, s) : 0.1 * (s + 1));
        nb_optim_step(opt);
        printf("%s{\"grads\": [", s ? ",\n     " : "\n     ");
        print_values(w->grad);
        printf(", ");
        print_values(b->grad);
        printf("], \"after\": [");
        for (int i = 0; i < 3; i++) {
            printf(i ? ", " : "");
            print_values(ps[i]);
        }
        printf("]}");
    }
    printf("]}");
    nb_optim_free(opt);
    nb_ctx_free(ctx);
}

static void clip_run(double norm_type, double max_norm, int index) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(5, 3));
    nb_tensor *b = nb_zeros(ctx, NB_F64, NB_SHAPE(7));
    nb_set_requires_grad(a, true);
    nb_set_requires_grad(b, true);
    nb_set_grad(a, nb_zeros_like(ctx, a));
    nb_set_grad(b, nb_zeros_like(ctx, b));
    fill(a->grad, 0.5);
    fill(b->grad, 1.5);
    printf("%s{\"norm_type\": %s, \"max_norm\": %.17g, \"before\": [", index ? ",\n  " : "  ",
           isinf(norm_type) ? "\"inf\"" : "2.0", max_norm);
    print_values(a->grad);
    printf(", ");
    print_values(b->grad);
    nb_named_tensor named[] = {{"a", a}, {"b", b}};
    double norm = nb_clip_grad_norm(named, 2, max_norm, norm_type);
    printf("], \"norm\": %.17g, \"after\": [", norm);
    print_values(a->grad);
    printf(", ");
    print_values(b->grad);
    printf("]}");
    nb_ctx_free(ctx);
}

int main(int argc, char **argv) {
    driver_args(argc, argv, 0, "  (prints JSON on stdout)");
    nb_optim_hparams sgd = NB_SGD_DEFAULTS, adam = NB_ADAM_DEFAULTS, adamw = NB_ADAMW_DEFAULTS;
    run_cfg cfgs[10];
    int n = 0;
    sgd.lr = 0.1;
    cfgs[n++] = (run_cfg){"sgd", NB_OPTIM_SGD, sgd};
    sgd.momentum = 0.9, sgd.dampening = 0.2, sgd.weight_decay = 0.01;
    cfgs[n++] = (run_cfg){"sgd momentum dampening decay", NB_OPTIM_SGD, sgd};
    sgd.dampening = 0, sgd.nesterov = true;
    cfgs[n++] = (run_cfg){"sgd nesterov decay", NB_OPTIM_SGD, sgd};
    adam.lr = 0.01, adam.weight_decay = 0.1;
    cfgs[n++] = (run_cfg){"adam L2", NB_OPTIM_ADAM, adam};
    adam.beta1 = 0.3, adam.beta2 = 0.9, adam.eps = 1e-4, adam.weight_decay = 0;
    cfgs[n++] = (run_cfg){"adam small betas", NB_OPTIM_ADAM, adam};
    adamw.lr = 0.01, adamw.weight_decay = 0.1;
    cfgs[n++] = (run_cfg){"adamw", NB_OPTIM_ADAMW, adamw};
    adamw.beta1 = 0.5, adamw.eps = 1e-3;
    cfgs[n++] = (run_cfg){"adamw beta1 0.5", NB_OPTIM_ADAMW, adamw};
    adam = NB_ADAM_DEFAULTS;
    adam.lr = 0.01, adam.weight_decay = 0.1, adam.beta2 = 0.9, adam.amsgrad = true;
    cfgs[n++] = (run_cfg){"adam amsgrad L2", NB_OPTIM_ADAM, adam};
    adamw = NB_ADAMW_DEFAULTS;
    adamw.lr = 0.01, adamw.weight_decay = 0.1, adamw.beta2 = 0.9, adamw.amsgrad = true;
    cfgs[n++] = (run_cfg){"adamw amsgrad", NB_OPTIM_ADAMW, adamw};
    printf("{\"runs\": [\n");
    int k = 0;
    for (int i = 0; i < n; i++) {
        run(&cfgs[i], NB_F64, k++);
        run(&cfgs[i], NB_F32, k++);
    }
    printf("],\n \"clips\": [\n");
    clip_run(2.0, 0.5, 0);
    clip_run(INFINITY, 0.5, 1);
    clip_run(2.0, 100.0, 2);
    printf("]}\n");
    return 0;
}
