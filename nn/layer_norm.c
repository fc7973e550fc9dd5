/* LayerNorm over nb_layer_norm: normalises over the trailing
 * `normalized_shape` dims, with an optional elementwise weight (ones) and
 * bias (zeros), as PyTorch's LayerNorm(elementwise_affine, bias). */
#include <string.h>

#include "nn/internal.h"

typedef struct layer_norm {
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    nb_layer_norm_opts o;
    nb_dtype dtype;
    nb_tensor *weight, *bias; /* normalized_shape, or NULL */
} layer_norm;

static void ln_describe(nb_module *m, char *buf, size_t size) {
    const layer_norm *l = m->self;
    snprintf(buf, size, "%s, eps=%g, elementwise_affine=%s, bias=%s",
             nb__shape_str_n(l->ndim, l->shape), l->o.eps, l->weight ? "true" : "false",
             l->bias ? "true" : "false");
}

static nb_tensor *ln_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

static const nb_module_type ln_type = {"LayerNorm", sizeof(layer_norm), ln_forward, ln_describe};

/* x (.., normalized_shape) -> same */
static nb_tensor *ln_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const layer_norm *l = m->self;
    bool ok = x->ndim >= l->ndim;
    for (int d = 0; ok && d < l->ndim; d++) ok = x->shape[x->ndim - l->ndim + d] == l->shape[d];
    NB_CHECK(ok, "LayerNorm: input %s does not end in the normalized shape %s", nb_shape_str(x),
             nb__shape_str_n(l->ndim, l->shape));
    nb__nn_check_input_dtype("LayerNorm", x, l->dtype);
    return nb_layer_norm(ctx, x, l->ndim, l->weight, l->bias, l->o.eps);
}

nb_module *nb_layer_norm_new(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                             const nb_layer_norm_opts *opts) {
    const char *fn = "nb_layer_norm_new";
    nb__nn_check_dtype(fn, dtype);
    NB_CHECK(ndim >= 1 && ndim <= NB_MAX_DIMS && shape,
             "%s: normalized shape needs 1 to %d dims, got %d", fn, NB_MAX_DIMS, ndim);
    for (int d = 0; d < ndim; d++)
        NB_CHECK(shape[d] > 0, "%s: normalized shape %s has a non-positive size", fn,
                 nb__shape_str_n(ndim, shape));
    nb_layer_norm_opts o = opts ? *opts : NB_LAYER_NORM_DEFAULTS;
    NB_CHECK(o.eps >= 0, "%s: eps %g is negative", fn, o.eps);
    nb_module *m = nb_module_new(ctx, &ln_type);
    layer_norm *l = m->self;
    l->ndim = ndim;
    memcpy(l->shape, shape, (size_t)ndim * sizeof *shape);
    l->o = o;
    l->dtype = dtype;
    if (o.elementwise_affine) {
        l->weight = nb_module_add_param(m, "weight", nb_ones(ctx, dtype, ndim, shape));
        if (o.bias) l->bias = nb_module_add_param(m, "bias", nb_zeros(ctx, dtype, ndim, shape));
    }
    return m;
}
