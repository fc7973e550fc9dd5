/* Recomputation: a module's forward that keeps only its input and runs
 * again during backward (nb_module_set_recompute).
 *
 * Note [Recomputation]
 * Giving memory back (Note [Memory given back] in tensor/memory.c) brings
 * a step's peak down to what backward needs; recomputation trades compute
 * for that too. A module marked for it runs its forward with the tape off,
 * so every activation inside it is given back when the forward returns,
 * and records one node whose inputs are the module's input x and its
 * parameters. When backward reaches that node, its backward function:
 *  1. makes a stand-in for x: x's storage under a node that is never on the
 *     tape, so the inner walk stops there and sums x's gradient exactly as
 *     the walk without recomputation sums it (adopted first contribution,
 *     then fresh sums: Note [Adopted gradients]), never as a leaf's;
 *  2. puts back the generators the first forward drew from (dropout) to
 *     their states then, and the module's buffers (BatchNorm's running
 *     statistics, which a forward in training mode updates) to theirs
 *     after it, runs the forward again with the tape on, then restores both;
 *  3. walks that small graph (nb__backward_inner): its parameters get their
 *     contributions in the order the ordinary walk would give them, and
 *     their use counts and gradient-ready hooks stay the outer walk's,
 *     which counts the node's parameter inputs and fires the hooks after it;
 *  4. hands the stand-in's gradient to x.
 * So gradients and parameters are bitwise those without recomputation
 * (tests/test_memory.c), at the cost of one more forward of the module.
 * The recomputed activations are the library's and go as the inner walk
 * passes them. A module whose forward reads tensors other than its input
 * and its own parameters (a closure over a mask, a parameter shared with a
 * module outside it) cannot be recomputed this way: its gradient would not
 * reach them.
 *
 * A sharding layer (Note [FSDP] in distributed/fsdp.c) recomputes its
 * units with nb__module_forward_recompute_ops: its before/after calls
 * gather the unit's parameters around each run and reduce-scatter their
 * gradients after the inner walk, and the node's inputs are the unit's
 * parameter shards in place of the parameters, whose values exist only
 * while gathered. */
#include <string.h>

#include "nn/internal.h"

typedef struct recompute {
    nb_module *m;
    nb__recompute_ops ops; /* zeros: none */
    nb__rng_log rngs;
    int n_buffers;
    nb_tensor **buffers;
} recompute;

static void recompute_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    recompute *r = n->extra;
    nb_tensor *x = n->in[0];
    nb_tensor *stand = nb__view(ctx, x, x->ndim, x->shape, x->strides, x->data);
    nb_node *origin = nb__ctx_meta(ctx, sizeof *origin);
    origin->op = "a recomputed module's input";
    origin->out = stand;
    origin->ctx = ctx;
    stand->node = origin;
    stand->requires_grad = true;

    nb_rng now[NB__RNG_LOG];
    for (int i = 0; i < r->rngs.n; i++) {
        now[i] = *r->rngs.rng[i];
        *r->rngs.rng[i] = r->rngs.before[i];
    }
    nb_tensor **kept = nb__ctx_meta(ctx, sizeof *kept * (size_t)(r->n_buffers ? r->n_buffers : 1));
    for (int i = 0; i < r->n_buffers; i++) {
        kept[i] = nb__empty(ctx, r->buffers[i]->dtype, r->buffers[i]->ndim, r->buffers[i]->shape);
        nb__run_copy(kept[i], r->buffers[i]);
    }
    if (r->ops.before) r->ops.before(r->ops.user, true);
    bool prev = nb_set_grad_enabled(true);
    nb__scope_enter(ctx);
    nb_tensor *y = r->m->type->forward(r->m, ctx, stand);
    nb__scope_exit(ctx, y);
    nb_set_grad_enabled(prev);
    for (int i = 0; i < r->rngs.n; i++) {
        NB_CHECK(r->rngs.rng[i]->seed == r->rngs.before[i].seed &&
                     r->rngs.rng[i]->offset == r->rngs.after[i].offset,
                 "nb_module_set_recompute: the %s drew different random numbers when run again "
                 "during backward; its forward must be a function of its input, parameters and "
                 "generators", nb_module_type_name(r->m));
        *r->rngs.rng[i] = now[i];
    }
    for (int i = 0; i < r->n_buffers; i++) nb__run_copy(r->buffers[i], kept[i]);
    NB_CHECK(y->node && nb_same_shape(y, n->out) && y->dtype == n->out->dtype,
             "nb_module_set_recompute: the %s's forward gave %s %s during backward, %s %s the "
             "first time", nb_module_type_name(r->m), nb_dtype_name(y->dtype), nb_shape_str(y),
             nb_dtype_name(n->out->dtype), nb_shape_str(n->out));
    nb__backward_inner(y, g);
    if (r->ops.after) r->ops.after(r->ops.user, true);
    if (stand->grad) {
        nb__accum_grad(ctx, x, stand->grad);
        nb__drop_grad(stand);
    }
}

nb_tensor *nb__module_forward_recompute(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    return nb__module_forward_recompute_ops(m, ctx, x, NULL);
}

nb_tensor *nb__module_forward_recompute_ops(nb_module *m, nb_ctx *ctx, nb_tensor *x,
                                            const nb__recompute_ops *ops) {
    recompute *r = nb__ctx_meta(ctx, sizeof *r);
    r->m = m;
    if (ops) r->ops = *ops;
    int nb = nb_module_named_buffers(m, NULL, 0), np = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *list = nb__ctx_meta(ctx, sizeof *list * (size_t)(nb + np + 1));
    nb_module_named_buffers(m, list, nb);
    r->buffers = nb__ctx_meta(ctx, sizeof *r->buffers * (size_t)(nb + 1));
    for (int i = 0; i < nb; i++)
        if (nb_dtype_is_float(list[i].tensor->dtype) || list[i].tensor->dtype == NB_I64)
            r->buffers[r->n_buffers++] = list[i].tensor;

    if (r->ops.before) r->ops.before(r->ops.user, false);
    nb__rng_log_open(&r->rngs);
    bool prev = nb_set_grad_enabled(false);
    nb__scope_enter(ctx);
    nb_tensor *y = m->type->forward(m, ctx, x);
    nb__scope_exit(ctx, y);
    nb_set_grad_enabled(prev);
    nb__rng_log_close();
    if (r->ops.after) r->ops.after(r->ops.user, false);
    NB_CHECK((y->base ? y->base : y) != (x->base ? x->base : x),
             "nb_module_set_recompute: the %s returns its input or a view of it; there is "
             "nothing to recompute", nb_module_type_name(m));

    nb_module_named_parameters(m, list, np);
    int nl = ops ? ops->n_leaves : 0;
    nb_tensor **in = nb__ctx_meta(ctx, sizeof *in * (size_t)(np + nl + 1));
    int k = 0;
    in[k++] = x;
    if (ops)
        for (int i = 0; i < nl; i++) in[k++] = ops->leaves[i];
    else
        for (int i = 0; i < np; i++)
            if (list[i].tensor->requires_grad) in[k++] = list[i].tensor;
    nb_node *n = nb__record(ctx, "nb_module_forward (recomputed)", recompute_backward, y, k, in);
    if (n) n->extra = r;
    return y;
}

void nb_module_set_recompute(nb_module *m, bool on) {
    NB_CHECK(m, "nb_module_set_recompute: module is NULL");
    NB_CHECK(m->type->forward, "nb_module_set_recompute: a %s has no single-input forward",
             m->type->name);
    m->recompute = on;
}
