/* Linear: y = x weight^T + bias, the weight stored (out, in) as PyTorch
 * stores it so that state dicts carry over; the product is one nb_matmul_t
 * with trans_b, so no transposed copy is made. Letters: (..) leading dims. */
#include <math.h>

#include "nn/internal.h"

typedef struct linear {
    int64_t in, out;
    nb_tensor *weight; /* (out, in) */
    nb_tensor *bias;   /* (out) or NULL */
} linear;

static void linear_describe(nb_module *m, char *buf, size_t size) {
    const linear *l = m->self;
    snprintf(buf, size, "in_features=%lld, out_features=%lld, bias=%s", (long long)l->in,
             (long long)l->out, l->bias ? "true" : "false");
}

static nb_tensor *linear_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

static const nb_module_type linear_type = {"Linear", sizeof(linear), linear_forward,
                                           linear_describe};

static void check_input(const linear *l, const nb_tensor *x) {
    NB_CHECK(x->ndim >= 1 && x->shape[x->ndim - 1] == l->in,
             "Linear: input %s has %lld features in its last dim, the layer takes %lld",
             nb_shape_str(x), x->ndim ? (long long)x->shape[x->ndim - 1] : 0LL, (long long)l->in);
    nb__nn_check_input_dtype("Linear", x, l->weight->dtype);
}

/* x (.., in) -> (.., out) */
static nb_tensor *linear_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const linear *l = m->self;
    check_input(l, x);
    bool vec = x->ndim == 1;
    if (vec) x = nb_unsqueeze(ctx, x, 0);
    nb_tensor *y = nb__linear(ctx, x, l->weight, l->bias);
    return vec ? nb_squeeze(ctx, y, 0) : y;
}

/* r + x (.., in) -> (.., out), the add in the GEMM */
static nb_tensor *linear_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r) {
    const linear *l = m->self;
    check_input(l, x);
    if (x->ndim == 1) return nb_add(ctx, r, linear_forward(m, ctx, x));
    return nb__linear_residual(ctx, x, l->weight, l->bias, r);
}

nb_tensor *nb__linear_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r) {
    nb_module_self(m, &linear_type);
    return nb__module_forward_residual(m, ctx, x, r, linear_forward_residual);
}

nb_module *nb_linear_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_features, int64_t out_features,
                         bool bias, nb_rng *rng) {
    nb__nn_check_dtype("nb_linear_new", dtype);
    NB_CHECK(in_features > 0 && out_features > 0,
             "nb_linear_new: in_features %lld and out_features %lld must be positive",
             (long long)in_features, (long long)out_features);
    nb_module *m = nb_module_new(ctx, &linear_type);
    linear *l = m->self;
    l->in = in_features;
    l->out = out_features;
    /* kaiming_uniform(a = sqrt(5)): bound = sqrt(6 / ((1 + a^2) fan_in)) = 1 / sqrt(fan_in) */
    double bound = 1.0 / sqrt((double)in_features);
    l->weight = nb_module_add_param(
        m, "weight",
        nb_rand_uniform(ctx, dtype, NB_SHAPE(out_features, in_features), -bound, bound, rng));
    if (bias)
        l->bias = nb_module_add_param(
            m, "bias", nb_rand_uniform(ctx, dtype, NB_SHAPE(out_features), -bound, bound, rng));
    return m;
}
