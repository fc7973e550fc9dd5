/* Joining and splitting: nb_concat copies each input into its slab of a
 * fresh output (backward hands each input its narrow of the gradient);
 * nb_stack unsqueezes each input and concatenates; nb_split returns
 * nb_narrow views, so autograd goes through nb_narrow. */
#include "tensor/internal.h"

static void concat_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    int axis = (int)node->i[0];
    int64_t off = 0;
    for (int k = 0; k < node->n_in; k++) {
        nb_tensor *x = node->in[k];
        if (x->requires_grad) nb__accum_grad(ctx, x, nb_narrow(ctx, g, axis, off, x->shape[axis]));
        off += x->shape[axis];
    }
}

nb_tensor *nb_concat(nb_ctx *ctx, int n, nb_tensor *const *xs, int axis) {
    NB_CHECK(n >= 1 && xs, "nb_concat: needs at least one input, got %d", n);
    nb_tensor *x0 = xs[0];
    NB_CHECK(x0 && x0->ndim >= 1,
             "nb_concat: input 0 must have at least one dimension, got shape %s",
             x0 ? nb_shape_str(x0) : "NULL");
    int ax = nb_normalize_dim("nb_concat", axis, x0->ndim);
    int64_t total = 0;
    for (int k = 0; k < n; k++) {
        nb_tensor *x = xs[k];
        NB_CHECK(x, "nb_concat: input %d is NULL", k);
        nb__check_ctx("nb_concat", ctx, x);
        NB_CHECK(x->dtype == x0->dtype, "nb_concat: input %d has dtype %s %s but input 0 has %s %s",
                 k, nb_dtype_name(x->dtype), nb_shape_str(x), nb_dtype_name(x0->dtype),
                 nb_shape_str(x0));
        bool ok = x->ndim == x0->ndim;
        for (int d = 0; ok && d < x->ndim; d++)
            ok = d == ax || x->shape[d] == x0->shape[d];
        NB_CHECK(ok,
                 "nb_concat: input %d has shape %s but input 0 has shape %s; shapes must match "
                 "except along dimension %d",
                 k, nb_shape_str(x), nb_shape_str(x0), ax);
        total += x->shape[ax];
    }
    int64_t shape[NB_MAX_DIMS];
    for (int d = 0; d < x0->ndim; d++)
        shape[d] = x0->shape[d];
    shape[ax] = total;
    nb_tensor *out = nb__empty(ctx, x0->dtype, x0->ndim, shape);
    int64_t off = 0;
    size_t esz = nb_dtype_size(x0->dtype);
    for (int k = 0; k < n; k++) {
        shape[ax] = xs[k]->shape[ax];
        char *data = (char *)out->data + (size_t)(off * out->strides[ax]) * esz;
        nb_tensor *slab = nb__view(ctx, out, out->ndim, shape, out->strides, data);
        nb__run_copy(slab, xs[k]);
        off += shape[ax];
    }
    nb_node *node = nb__record(ctx, "nb_concat", concat_backward, out, n, xs);
    nb__node_reads(node, 0);
    if (node) node->i[0] = ax;
    return out;
}

nb_tensor *nb_stack(nb_ctx *ctx, int n, nb_tensor *const *xs, int axis) {
    NB_CHECK(n >= 1 && xs, "nb_stack: needs at least one input, got %d", n);
    NB_CHECK(xs[0], "nb_stack: input 0 is NULL");
    NB_CHECK(xs[0]->ndim < NB_MAX_DIMS, "nb_stack: inputs of shape %s already have %d dims",
             nb_shape_str(xs[0]), NB_MAX_DIMS);
    int ax = nb_normalize_dim("nb_stack", axis, xs[0]->ndim + 1);
    nb_tensor **us = nb__ctx_meta(ctx, sizeof *us * (size_t)n);
    for (int k = 0; k < n; k++) {
        NB_CHECK(xs[k], "nb_stack: input %d is NULL", k);
        nb__check_live("nb_stack", xs[k]);
        NB_CHECK(nb_same_shape(xs[k], xs[0]),
                 "nb_stack: input %d has shape %s but input 0 has shape %s; all must match", k,
                 nb_shape_str(xs[k]), nb_shape_str(xs[0]));
        us[k] = nb_unsqueeze(ctx, xs[k], ax);
    }
    return nb_concat(ctx, n, us, ax);
}

void nb_split(nb_ctx *ctx, nb_tensor *x, int n, const int64_t *sizes, int axis, nb_tensor **out) {
    NB_CHECK(n >= 1 && sizes && out, "nb_split: needs at least one piece, got %d", n);
    nb__check_live("nb_split", x);
    NB_CHECK(x->ndim >= 1, "nb_split: cannot split a 0-d tensor");
    int ax = nb_normalize_dim("nb_split", axis, x->ndim);
    int64_t total = 0;
    for (int k = 0; k < n; k++) {
        NB_CHECK(sizes[k] >= 0, "nb_split: size %d is negative (%lld)", k, (long long)sizes[k]);
        total += sizes[k];
    }
    NB_CHECK(total == x->shape[ax],
             "nb_split: sizes add up to %lld but dimension %d of %s has size %lld",
             (long long)total, ax, nb_shape_str(x), (long long)x->shape[ax]);
    int64_t off = 0;
    for (int k = 0; k < n; k++) {
        out[k] = nb_narrow(ctx, x, ax, off, sizes[k]);
        off += sizes[k];
    }
}
