/* custom_module: the example of docs/modules.md, "Writing your own module".
 *
 * A residual MLP block, y = x + gain * fc2(gelu(fc1(ln(x)))), written as a
 * module of its own, used inside a Sequential and trained for a few steps
 * of plain SGD on a synthetic three-class problem. Exits 0 when the loss
 * went down. */
#include <stdio.h>

#include <nabla/nabla.h>

/* 1. The module's own state: its children and its parameters. */
typedef struct residual_mlp {
    nb_module *ln, *fc1, *fc2;
    nb_tensor *gain; /* (C) */
} residual_mlp;

static nb_tensor *residual_mlp_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

/* 2. Its type: a name, the size of its state, its forward. */
static const nb_module_type residual_mlp_type = {
    .name = "ResidualMLP",
    .self_size = sizeof(residual_mlp),
    .forward = residual_mlp_forward,
};

/* 3. The forward: x (N, C) -> (N, C), activations in the step context. */
static nb_tensor *residual_mlp_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    residual_mlp *self = nb_module_self(m, &residual_mlp_type);
    nb_tensor *h = nb_module_forward(self->ln, ctx, x);
    h = nb_gelu(ctx, nb_module_forward(self->fc1, ctx, h), NB_GELU_TANH);
    h = nb_module_forward(self->fc2, ctx, h);
    return nb_add(ctx, x, nb_mul(ctx, h, self->gain));
}

/* 4. The constructor: the module, then its children and parameters, all in
 * the persistent context. */
static nb_module *residual_mlp_new(nb_ctx *ctx, nb_dtype dtype, int64_t c, int64_t hidden,
                                   nb_rng *rng) {
    nb_module *m = nb_module_new(ctx, &residual_mlp_type);
    residual_mlp *self = nb_module_self(m, &residual_mlp_type);
    self->ln = nb_module_add(m, "ln", nb_layer_norm_new(ctx, dtype, NB_SHAPE(c), NULL));
    self->fc1 = nb_module_add(m, "fc1", nb_linear_new(ctx, dtype, c, hidden, true, rng));
    self->fc2 = nb_module_add(m, "fc2", nb_linear_new(ctx, dtype, hidden, c, true, rng));
    self->gain = nb_module_add_param(m, "gain", nb_full(ctx, dtype, NB_SHAPE(c), 0.1));
    return m;
}

#define N 64
#define STEPS 60
#define LR 0.2

int main(void) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0); /* the model, its gradients, the data */
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);   /* activations and tape, reset every step */
    nb_rng rng = nb_rng_make(42);

    nb_module *model = nb_sequential_new(
        params, 3,
        (nb_module *[]){nb_linear_new(params, NB_F32, 4, 16, true, &rng),
                        residual_mlp_new(params, NB_F32, 16, 64, &rng),
                        nb_linear_new(params, NB_F32, 16, 3, true, &rng)});
    nb_module *loss_fn = nb_cross_entropy_loss_new(params, NULL);
    nb_module_print(model);

    nb_named_tensor p[16];
    int n = nb_module_named_parameters(model, p, 16);
    for (int i = 0; i < n && i < 16; i++) printf("  %-14s %s\n", p[i].name, nb_shape_str(p[i].tensor));
    printf("%lld parameters\n", (long long)nb_module_num_params(model));

    /* the label of a point is the index of its largest of the first three features */
    nb_tensor *x = nb_rand_normal(params, NB_F32, NB_SHAPE(N, 4), 0.0, 1.0, &rng);
    float xs[N * 4];
    int64_t ys[N];
    nb_to_host(x, xs);
    for (int i = 0; i < N; i++) {
        ys[i] = 0;
        for (int k = 1; k < 3; k++)
            if (xs[i * 4 + k] > xs[i * 4 + ys[i]]) ys[i] = k;
    }
    nb_tensor *y = nb_from_host(params, NB_I64, NB_SHAPE(N), ys);

    double first = 0, last = 0;
    for (int it = 0; it < STEPS; it++) {
        nb_ctx_reset(step);
        nb_tensor *loss = nb_loss_forward(loss_fn, step, nb_module_forward(model, step, x), y);
        nb_backward(loss);
        for (int i = 0; i < n; i++) nb_axpy_(p[i].tensor, -LR, p[i].tensor->grad);
        nb_module_zero_grad(model);
        last = nb_item(loss);
        if (it == 0) first = last;
        if (it % 20 == 0 || it == STEPS - 1) printf("step %2d  loss %.4f\n", it, last);
    }
    nb_ctx_free(step);
    nb_ctx_free(params);
    return last < first ? 0 : 1;
}
