/* The tape walk, gradient accumulation and gradient-ready hooks.
 *
 * Note [Tape]
 * An op records one node (tensor/internal.h) in the context of its
 * output; nodes are linked newest first, which is a topological order:
 * every input of a node was made before it. nb_backward(loss) walks from
 * loss's node towards older nodes twice:
 *  1. mark: a node is needed when its output is the loss or an input of a
 *     needed node; for each leaf, count the needed (node, input) uses (and
 *     for each other input too, in its bw_pending: a backward function may
 *     ask whether it is a tensor's only consumer, Note [GEMM epilogues in
 *     backward] in tensor/ops_matmul.c);
 *  2. run: for each needed node whose output received a gradient, call its
 *     backward function, then decrement the use count of its leaf inputs.
 *     A leaf whose count reaches zero has its final gradient: its
 *     gradient-ready hooks run right then, before older nodes run.
 * Counting in pass 1 rather than during forward means a parameter that was
 * also used outside the loss's graph (a metric, say) still gets its hooks.
 * All nodes of the graph must be in one context's tape; a graph that spans
 * contexts is rejected with a message naming the op. Pass 1 also checks
 * that every input and saved tensor of the graph is live (Note [Stale
 * tensors] in tensor/context.c): a leaf from a context reset since the
 * forward pass is reported, not read.
 *
 * Note [Walked graphs]
 * A backward marks the nodes it went through as walked, and a backward
 * from a tensor whose node is marked (the same loss again, or a tensor
 * inside a walked graph) aborts: it would add the same gradients into the
 * leaves a second time, which is almost always a bug (a loss kept and
 * backpropagated again, a backward called in two places). With
 * retain_graph the nodes stay unmarked, so the next backward walks them
 * again and the leaves accumulate a second time, as in PyTorch. Unlike
 * PyTorch, a new loss whose graph merely shares walked nodes (two losses
 * over one trunk, sum(f(h)) after sum(h)) is allowed: PyTorch refuses it
 * when a shared node's saved tensors were freed by the first backward, but
 * here nothing is freed before the context's reset, so the second walk is
 * exact and adds the new loss's gradient, which is what was asked for.
 *
 * Note [Adopted gradients]
 * A non-leaf's first gradient is adopted as is, without a copy, when it is
 * contiguous: it is whatever the backward function handed over, which may
 * also be handed elsewhere (add_backward gives the same g to both inputs,
 * pass-through backwards give their own output's gradient, narrow views of
 * one gradient go to concat's inputs). So an adopted gradient is never
 * written: the next contribution makes a fresh sum (copy-on-write), which
 * costs what the old copy-then-add-in-place did, and only a gradient made
 * here for t alone (grad_owned) is added into in place. Backward functions
 * must not write a tensor after handing it to nb__accum_grad. Leaves keep
 * their own gradient tensor in their context and always add into it.
 *
 * Note [Wide gradients]
 * Under a bf16 or f16 compute dtype the products cast their f32 operands
 * (recorded casts) and return f32; so their backward hands f32 gradients
 * to those casts' narrow outputs. Rounding such a gradient to bf16 there,
 * only for the cast's backward to widen it again for the f32 original,
 * cost two passes and two tensors the size of the operand (for attention
 * probabilities, (B, H, T, T) each, per layer) and lost precision. Instead,
 * a contribution in the dtype of the cast's input, wider than its output,
 * goes straight to that input (nb__accum_grad on it), unrounded; the cast
 * node then has no gradient of its own unless some other consumer gave it
 * one in the narrow dtype, which reaches the input through the cast's
 * backward as before. Order is unchanged: the input's node still runs
 * after the cast's, whose turn still counts down a leaf's pending uses
 * (the gradient-ready hooks fire then).
 *
 * Note [Gradients added in place]
 * A leaf's gradient, once it exists, is only ever added into, so a kernel
 * that can accumulate (a CPU GEMM with beta = 1) may write its contribution
 * into it directly instead of making a tensor that nb__accum_grad then adds:
 * one pass and one temporary less, and no zeroing of the temporary by BLAS.
 * nb__leaf_grad_target hands out that tensor under the same conditions
 * nb__accum_grad would add into it, and marks the contribution seen for the
 * gradient-ready hooks exactly as nb__accum_grad does. The sum is rounded
 * differently (the GEMM adds its partial sums to the old gradient instead
 * of forming the product first), deterministically. Under a bf16 or f16
 * compute dtype the product of the weight's cast comes out in f32 and
 * would go to the f32 weight (Note [Wide gradients]): the GEMM adds it
 * into that weight's gradient the same way.
 * A non-leaf's gradient may be added into as well, once it is the
 * tensor's alone (nb__grad_add_target): made for it (grad_owned, as
 * nb__accum_grad adds into), or adopted (Note [Adopted gradients]) and
 * now held by nothing else. The second is read from the storage's
 * reference count (Note [Memory given back] in tensor/memory.c), which
 * counts every tensor whose gradient the storage is, until that tensor's
 * node has run, and every node of the tape reading it: a count of one,
 * this tensor's own hold, means no backward still to run reads it, e.g.
 * the residual add's g, handed to both of its inputs, once the other
 * input's node has run. Without the
 * records (a context that does not give back) nothing is proven and the
 * contribution is added by nb__accum_grad. Layer norm does this for x
 * (Note [Layer norm's gradients added in place] in tensor/ops_norm.c).
 *
 * Note [Flat gradients]
 * The gradients of an optimizer's parameters live in one contiguous buffer
 * per context and dtype: nb_optim_new reserves a slot for each parameter
 * that has no gradient yet (nb__grad_flat_reserve), in reverse order of its
 * list (the order in which backward makes them, and DDP fills its buckets),
 * each slot starting at a multiple of 64 bytes as the arena's allocations
 * do. The buffer is made in the parameters' context at the first gradient
 * any of them receives, and a parameter's first gradient is its slot (a
 * view) instead of a tensor of its own: the same values, the same rules (no
 * gradient until the first backward, as PyTorch's None; nb_set_grad, as
 * DDP's bucket views, replaces it and the slot stays unused). So
 * nb_optim_zero_grad clears every gradient with one memset over the buffer
 * when each slot holds its parameter's gradient and the optimizer has all
 * of the buffer's parameters.
 *
 * Note [Gradients set to none]
 * nb_optim_zero_grad_to_none (PyTorch's zero_grad(set_to_none=True))
 * makes each parameter's gradient NULL but keeps its memory as the leaf's
 * grad_home: its flat slot, a DDP bucket's view (nb_set_grad), or a tensor
 * of its own. The next backward's first contribution to the leaf goes
 * there and is WRITTEN, not added: nb__leaf_grad_fresh hands the memory
 * out, attached as the gradient, to a kernel that writes every element
 * (a weight's gradient GEMM with beta = 0, a bias's sums by the GEMM's
 * BGRAD epilogue, layer norm's dw and db, an embedding table's rows with
 * the rows no index hits written 0), and nb__accum_grad copies a first
 * contribution into it as it copies one into a new slot. So neither the
 * zeroing pass over the buffer nor the read of zeros by the first writer
 * is left. A leaf with a flat slot and no gradient yet (the first
 * backward) is handed its slot the same way. Whatever reads gradients
 * reads only ->grad, and a leaf that got no contribution keeps NULL: the
 * optimizer skips it (no update, no weight decay; PyTorch skips a None
 * gradient too), the clip's norm and the grad scaler leave it out. A
 * reader of memory rather than of ->grad must make the NULL gradients
 * zeros first (nb__grad_zero_fill_none): DDP's bucket collective reads
 * every slice of a bucket, so the reducer does that for each parameter it
 * marks ready without a gradient (an unused one), which is the old call's
 * zero gradient there, and makes it NULL again after the all-reduce when
 * no rank gave it a gradient (Note [Unused parameters] in
 * distributed/ddp.c). nb_set_grad forgets the home (the memory is no
 * longer the leaf's to write).
 *
 * Note [Gradient segments]
 * The buffer is cut into segments of at most NB__GRAD_SEGMENT_BYTES (a slot
 * larger than that is a segment of its own), each a buffer of the above
 * kind made at the first gradient one of its slots receives. Backward makes
 * gradients in the order of the slots, so a step's gradient memory grows
 * as backward goes, while its activations are given back, instead of all
 * of it being there at the first gradient: in a GPT the first is the tied
 * token table's, in the LM head's backward, where the step peaks. A
 * segment whose every slot has lost its gradient
 * (nb_optim_zero_grad_to_none) is given back whole, nb__grad_flat_release,
 * and made again at the next first gradient in it: the buffer's tensor,
 * its record and each slot's view are made once and point at the new
 * memory then (so a program that kept a gradient from before sees the new
 * one, never memory given to another tensor), and the parameters'
 * context's metadata does not grow step after step. */
enum { NB__GRAD_SEGMENT_BYTES = 32 << 20 };
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

struct nb_hook {
    nb_grad_hook_fn fn;
    void *user;
    nb_hook *next;
};

static _Thread_local bool grad_disabled;
static _Thread_local uint64_t bw_counter;

bool nb_grad_enabled(void) { return !grad_disabled; }

bool nb_set_grad_enabled(bool enabled) {
    bool prev = !grad_disabled;
    grad_disabled = !enabled;
    return prev;
}

bool nb__needs_grad(int n, nb_tensor *const *inputs) {
    if (grad_disabled) return false;
    for (int i = 0; i < n; i++)
        if (inputs[i] && inputs[i]->requires_grad) return true;
    return false;
}

/* Checks every input's liveness (Note [Stale tensors] in tensor/context.c),
 * grad mode or not, for the ops whose front end checks only some. */
nb_node *nb__record(nb_ctx *ctx, const char *op, nb_backward_fn backward, nb_tensor *out, int n,
                    nb_tensor *const *inputs) {
    bool needed = false;
    for (int i = 0; i < n; i++) {
        const nb_tensor *x = inputs[i];
        if (!x) continue;
        nb__check_live(op, x);
        needed |= x->requires_grad;
    }
    if (!needed || grad_disabled) return NULL;
    nb_node *node = nb__ctx_meta(ctx, sizeof *node);
    node->op = op;
    node->backward = backward;
    node->out = out;
    node->n_in = n;
    node->reads = NB__READS_IN;
    node->in = nb__ctx_meta(ctx, sizeof(nb_tensor *) * (size_t)(n > 0 ? n : 1));
    memcpy(node->in, inputs, sizeof(nb_tensor *) * (size_t)n);
    out->node = node;
    out->requires_grad = true;
    nb__ctx_push_node(ctx, node);
    return node;
}

/* bf16/f16 on a device without math in them (Note [Mixed precision on
 * the CPU] in tensor/context.c): their sums are formed in f32. */
static bool storage_half(const nb_tensor *t) {
    return (t->dtype == NB_BF16 || t->dtype == NB_F16) && !nb__backend_at(t)->half_compute;
}

static nb_tensor *as_f32(nb_ctx *ctx, nb_tensor *t) {
    if (t->dtype == NB_F32) return t;
    nb_tensor *c = nb__empty(ctx, NB_F32, t->ndim, t->shape);
    nb__run_copy(c, t);
    return c;
}

/* dst (t's dtype, a half one) = a + g, added in f32 and rounded once. */
static void add_half(nb_ctx *ctx, nb_tensor *dst, nb_tensor *a, nb_tensor *g) {
    nb_tensor *sum = nb__empty(ctx, NB_F32, a->ndim, a->shape);
    nb__run_binary(NB_B_ADD, sum, as_f32(ctx, a), as_f32(ctx, g));
    nb__run_copy(dst, sum);
}

/* Note [Wide gradients]: t is a cast's output, narrower than its input,
 * and g comes in the input's dtype: the input to hand g to, else NULL. */
static nb_tensor *wide_target(const nb_tensor *t, const nb_tensor *g) {
    const nb_node *n = t->node;
    if (!n || n->backward != nb__cast_backward || g->dtype == t->dtype) return NULL;
    nb_tensor *x = n->in[0];
    if (x->dtype != g->dtype || nb_dtype_size(x->dtype) <= nb_dtype_size(t->dtype)) return NULL;
    return x;
}

/* ---- Note [Flat gradients] ---- */
enum { SLOT_ALIGN = 64 }; /* bytes, as the arena's (tensor/context.c) */
enum { MAX_FLATS = 16 };  /* (context, dtype) pairs in one reservation */

void nb__grad_flat_reserve(nb_tensor *const *ts, int n) {
    nb__grad_flat *flats[MAX_FLATS];
    int nf = 0;
    for (int i = n - 1; i >= 0; i--) {
        nb_tensor *t = ts[i];
        if (!t || !t->requires_grad || t->node || t->grad || t->priv->grad_slot || t->priv->grad_home ||
            nb_numel(t) == 0)
            continue;
        int k = 0;
        while (k < nf && !(flats[k]->ctx == t->ctx && flats[k]->dtype == t->dtype)) k++;
        if (k == nf && nf == MAX_FLATS) continue; /* gradients of their own, as without a reservation */
        int64_t align = SLOT_ALIGN / (int64_t)nb_dtype_size(t->dtype);
        int64_t at = k < nf ? (flats[k]->numel + align - 1) / align * align : 0;
        /* Note [Gradient segments]: a new segment when this slot would take
         * the open one past the limit */
        if (k == nf || (flats[k]->n_slots > 0 &&
                        (at + nb_numel(t)) * (int64_t)nb_dtype_size(t->dtype) > NB__GRAD_SEGMENT_BYTES)) {
            nb__grad_flat *f = nb__ctx_meta(t->ctx, sizeof *f);
            *f = (nb__grad_flat){.ctx = t->ctx, .dtype = t->dtype};
            flats[k] = f;
            if (k == nf) nf++;
            at = 0;
        }
        nb__grad_flat *f = flats[k];
        nb__grad_slot *s = nb__ctx_meta(t->ctx, sizeof *s);
        *s = (nb__grad_slot){.flat = f, .offset = at, .next = f->slots};
        f->slots = s;
        f->numel = at + nb_numel(t);
        f->n_slots++;
        t->priv->grad_slot = s;
    }
}

static void *slot_data(const nb__grad_flat *f, const nb__grad_slot *s) {
    return (char *)f->buf->data + s->offset * (int64_t)nb_dtype_size(f->dtype);
}

/* Note [Gradient segments]: f's memory again, where its tensor, record and
 * the slots' views made before now point. */
static void flat_renew(nb__grad_flat *f) {
    size_t bytes = (size_t)f->numel * nb_dtype_size(f->dtype);
    void *data = nb_ctx_alloc(f->ctx, bytes, 0);
    f->buf->data = data;
    nb__mem_renew(f->buf, data);
    for (nb__grad_slot *s = f->slots; s; s = s->next)
        if (s->view) s->view->data = slot_data(f, s);
    f->released = false;
}

void nb__grad_flat_release(nb__grad_flat *f) {
    if (!f->buf || f->released || !f->buf->priv->mem) return; /* no record: not known to be free */
    nb__give_back_now(f->buf);
    f->released = true;
}

/* t's slot, the buffer made at the first gradient of any of its parameters */
static nb_tensor *slot_grad(nb_tensor *t) {
    nb__grad_slot *s = t->priv->grad_slot;
    nb__grad_flat *f = s->flat;
    if (!f->buf) {
        f->buf = nb__empty(f->ctx, f->dtype, 1, &f->numel);
        nb__keep(f->buf);
    } else if (f->released) {
        flat_renew(f);
    }
    if (!s->view) {
        int64_t st[NB_MAX_DIMS];
        nb__contig_strides(t->ndim, t->shape, st);
        s->view = nb__view(f->ctx, f->buf, t->ndim, t->shape, st, slot_data(f, s));
    }
    return s->view;
}

/* Note [Gradients set to none]: where leaf t's first gradient goes, made
 * its gradient: its home, else its slot, else a tensor of its own. */
static nb_tensor *home_of(nb_tensor *t) {
    nb_tensor *h = t->priv->grad_home;
    const nb__grad_slot *s = t->priv->grad_slot;
    if (h && s && h == s->view) return slot_grad(t); /* its segment made again if given back */
    return h;
}

static nb_tensor *first_grad(nb_tensor *t) {
    nb_tensor *g = home_of(t);
    if (!g) g = t->priv->grad_slot ? slot_grad(t) : nb__empty(t->ctx, t->dtype, t->ndim, t->shape);
    nb__keep(g); /* a leaf's gradient is never given back */
    return g;
}

void nb__grad_set_none(nb_tensor *t) {
    nb_tensor *g = t->grad;
    if (!g) return; /* none already: the home, if any, stays */
    bool writable = !t->node && g->dtype == t->dtype && nb_is_contiguous(g) && nb_same_shape(g, t) &&
                    nb_device_eq(g->device, t->device);
    t->priv->grad_home = writable ? g : NULL;
    t->grad = NULL;
}

void nb__grad_zero_fill_none(nb_tensor *t) {
    if (t->grad || !t->priv->grad_home) return;
    nb_tensor *h = home_of(t);
    size_t bytes = (size_t)nb_numel(h) * nb_dtype_size(h->dtype);
    if (bytes) nb__backend_at(h)->memset(h->device.index, h->data, 0, bytes);
    t->grad = h;
}

nb__grad_flat *nb__grad_in_flat(const nb_tensor *t) {
    const nb__grad_slot *s = t->priv->grad_slot;
    if (!s || !s->flat->buf || s->flat->released || !t->grad || !nb_is_contiguous(t->grad)) return NULL;
    const char *at = (const char *)s->flat->buf->data + s->offset * (int64_t)nb_dtype_size(s->flat->dtype);
    return t->grad->data == at && t->grad->dtype == s->flat->dtype ? s->flat : NULL;
}

void nb__accum_grad(nb_ctx *ctx, nb_tensor *t, nb_tensor *g) {
    if (!t->requires_grad) return;
    nb_tensor *wide = wide_target(t, g);
    if (wide) {
        nb__accum_grad(ctx, wide, nb__sum_to(ctx, g, t->ndim, t->shape));
        return;
    }
    if (storage_half(g) && !nb_same_shape(g, t))
        g = nb__sum_to_f32(ctx, g, t->ndim, t->shape); /* summed in f32 */
    else
        g = nb__sum_to(ctx, g, t->ndim, t->shape);
    if (storage_half(t) && t->grad) { /* a second contribution */
        if (t->node == NULL || t->priv->grad_owned) {
            add_half(ctx, t->grad, t->grad, g);
        } else { /* Note [Adopted gradients] */
            nb_tensor *sum = nb__empty(ctx, t->dtype, t->ndim, t->shape);
            add_half(ctx, sum, t->grad, g);
            nb__set_grad(t, sum);
            t->priv->grad_owned = true;
        }
        if (t->node == NULL) t->priv->bw_seen = true;
        return;
    }
    if (g->dtype != t->dtype) {
        nb_tensor *c = nb__empty(ctx, t->dtype, g->ndim, g->shape);
        nb__run_copy(c, g);
        g = c;
    }
    if (t->node == NULL) {
        if (!t->grad) { /* the first gradient: a copy, not zeros plus an add */
            t->grad = first_grad(t);
            nb__run_copy(t->grad, g);
        } else {
            nb__run_binary(NB_B_ADD, t->grad, t->grad, g);
        }
        t->priv->bw_seen = true;
        return;
    }
    /* Note [Adopted gradients] */
    if (!t->grad) {
        if (nb_is_contiguous(g) && nb_device_eq(g->device, t->device)) {
            nb__set_grad(t, g);
            t->priv->grad_owned = false;
        } else {
            nb__set_grad(t, nb__empty(ctx, t->dtype, t->ndim, t->shape));
            nb__run_copy(t->grad, g);
            t->priv->grad_owned = true;
        }
    } else if (t->priv->grad_owned) {
        nb__run_binary(NB_B_ADD, t->grad, t->grad, g);
    } else {
        nb_tensor *sum = nb__empty(ctx, t->dtype, t->ndim, t->shape);
        nb__run_binary(NB_B_ADD, sum, t->grad, g);
        nb__set_grad(t, sum);
        t->priv->grad_owned = true;
    }
}

/* t, or the wider leaf t is a cast of (Note [Wide gradients]), whose
 * gradient takes a contribution of dtype dt as it is; else NULL */
static nb_tensor *grad_owner(nb_tensor *t, nb_dtype dt) {
    if (t->dtype != dt) { /* Note [Wide gradients]: a cast's input takes dt as it is */
        const nb_node *n = t->node;
        if (!n || n->backward != nb__cast_backward || n->in[0]->dtype != dt ||
            nb_dtype_size(dt) <= nb_dtype_size(t->dtype))
            return NULL;
        t = n->in[0];
    }
    return t;
}

nb_tensor *nb__leaf_grad_fresh(nb_tensor *t, nb_dtype dt) {
    t = grad_owner(t, dt);
    if (!t || !t->requires_grad || t->node || t->grad || t->dtype != dt ||
        !(t->priv->grad_home || t->priv->grad_slot))
        return NULL;
    t->grad = first_grad(t);
    t->priv->bw_seen = true;
    return t->grad;
}

nb_tensor *nb__leaf_grad_target(nb_tensor *t, nb_dtype dt) {
    t = grad_owner(t, dt);
    if (!t) return NULL;
    nb_tensor *g = t->grad;
    if (!t->requires_grad || t->node || !g || g->dtype != t->dtype || !nb_is_contiguous(g) ||
        !nb_device_eq(g->device, t->device) || !nb_same_shape(g, t))
        return NULL;
    t->priv->bw_seen = true;
    return g;
}

nb_tensor *nb__grad_add_target(nb_tensor *t, nb_dtype dt) {
    if (!t->node) return nb__leaf_grad_target(t, dt);
    nb_tensor *g = t->grad;
    if (!t->requires_grad || !g || t->dtype != dt || g->dtype != dt || !nb_is_contiguous(g) ||
        !nb_device_eq(g->device, t->device) || !nb_same_shape(g, t))
        return NULL;
    if (!t->priv->grad_owned) { /* Note [Adopted gradients]: adopted, maybe shared */
        if (!nb__grad_sole_holder(t)) return NULL;
        t->priv->grad_owned = true;
    }
    return g;
}

nb_tensor *nb__grad_to_update(nb_ctx *ctx, nb_tensor *t) {
    if (!t->grad) {
        nb__set_grad(t, nb_zeros(ctx, t->dtype, t->ndim, t->shape));
    } else if (!t->priv->grad_owned) { /* Note [Adopted gradients]: copy before writing */
        nb_tensor *own = nb__empty(ctx, t->dtype, t->ndim, t->shape);
        nb__run_copy(own, t->grad);
        nb__set_grad(t, own);
    }
    t->priv->grad_owned = true;
    return t->grad;
}

static void fire_hooks(nb_tensor *leaf) {
    for (nb_hook *h = leaf->priv->hooks; h; h = h->next) h->fn(leaf, h->user);
}

static void leaf_used(nb_tensor *x, uint64_t id) {
    if (x->priv->bw_id != id) {
        x->priv->bw_id = id;
        x->priv->bw_pending = 0;
        x->priv->bw_seen = false;
    }
    x->priv->bw_pending++;
}

/* A tensor whose data the backward does not read may have been given back
 * (Note [Memory given back]); it must still be of this step. */
static void check_graph_tensor(const nb_tensor *x, bool read) {
    if (!x) return;
    if (read) nb__check_live("nb_backward", x);
    else if (NB__RELEASED(x) || (x->ctx && x->priv->gen != nb__ctx_gen(x->ctx)))
        nb__stale_abort("nb_backward", x);
}

static void walk(nb_tensor *out, nb_tensor *grad_out, bool retain_graph, bool inner);

void nb_backward_ex(nb_tensor *out, const nb_backward_options *opts) {
    nb_backward_options o = opts ? *opts : NB_BACKWARD_DEFAULTS;
    nb__check_live("nb_backward", out);
    nb_tensor seed = {0};
    nb__tensor_priv seed_priv = {0}; /* Note [Tensor bookkeeping] */
    seed.priv = &seed_priv;
    double one = 1.0;
    if (!o.grad) {
        NB_CHECK(nb_numel(out) == 1,
                 "nb_backward: the loss must have one element, got shape %s (use nb_backward_with to "
                 "pass a gradient)", nb_shape_str(out));
        NB_CHECK(nb_dtype_is_float(out->dtype),
                 "nb_backward: the loss must be a float tensor (f32, f64, bf16 or f16), got %s",
                 nb_dtype_name(out->dtype));
        seed.dtype = NB_F64;
        seed.device = nb_cpu();
        seed.ndim = out->ndim;
        memcpy(seed.shape, out->shape, sizeof seed.shape);
        seed.data = &one; /* all strides 0: every index reads the one value */
        seed_priv.seed_one = true;
        o.grad = &seed;
    }
    nb_tensor *grad_out = o.grad;
    nb__check_live("nb_backward", grad_out);
    NB_CHECK(out->requires_grad,
             "nb_backward: tensor of shape %s does not require grad (no input of the ops that made "
             "it requires grad, or it was made with grad mode off)", nb_shape_str(out));
    NB_CHECK(nb_same_shape(out, grad_out), "nb_backward: gradient of shape %s for a tensor of shape %s",
             nb_shape_str(grad_out), nb_shape_str(out));
    if (out->node == NULL) { /* a leaf: its gradient is the seed */
        uint64_t id = ++bw_counter;
        bool prev = nb_set_grad_enabled(false);
        leaf_used(out, id);
        nb__accum_grad(out->ctx, out, grad_out);
        fire_hooks(out);
        nb_set_grad_enabled(prev);
        return;
    }
    walk(out, grad_out, o.retain_graph, false);
}

/* Passes 1 and 2 of Note [Tape] from out (a non-leaf) seeded with grad_out.
 * An inner walk (Note [Recomputation] in nn/recompute.c) runs inside a
 * backward function: leaves get their gradients but keep the outer walk's
 * use counts, and their hooks wait for it. */
static void walk(nb_tensor *out, nb_tensor *grad_out, bool retain_graph, bool inner) {
    uint64_t id = ++bw_counter;
    nb_node *start = out->node;
    nb_ctx *ctx = start->ctx;
    NB_CHECK(!start->walked, /* Note [Walked graphs] */
             "nb_backward: the graph of this loss was already walked by a backward (the loss, "
             "made by %s, was reached by an earlier nb_backward); pass retain_graph to walk it "
             "again: nb_backward_ex(loss, &(nb_backward_options){.retain_graph = true}) on every "
             "backward of it but the last", start->op);
    start->bw_id = id;
    for (nb_node *n = start; n; n = n->prev) { /* pass 1 (Note [Tape]) */
        if (n->bw_id != id) continue;
        nb__set_grad(n->out, NULL);
        for (int k = 0; k < NB_NODE_SAVED; k++) check_graph_tensor(n->saved[k], true);
        if (n->reads & NB__READS_OUT) check_graph_tensor(n->out, true);
        for (int i = 0; i < n->n_in; i++) {
            nb_tensor *x = n->in[i];
            check_graph_tensor(x, nb__node_reads_in(n, i));
            if (!x || !x->requires_grad) continue;
            if (x->node) {
                NB_CHECK(x->node->ctx == ctx,
                         "nb_backward: the graph uses a tensor made by %s in another context; "
                         "build the whole forward pass in one context", x->node->op);
                x->node->bw_id = id;
                leaf_used(x, id); /* its uses, never counted down */
            } else if (!inner) {
                leaf_used(x, id);
            }
        }
    }
    /* Note [Memory given back] in tensor/memory.c: the nodes' references
     * are counted before any is dropped. */
    for (nb_node *n = start; n; n = n->prev)
        if (n->bw_id == id) nb__node_acquire(n);
    bool prev = nb_set_grad_enabled(false);
    nb__set_grad(out, nb__empty(ctx, out->dtype, out->ndim, out->shape));
    nb__run_copy(out->grad, grad_out);
    out->grad->priv->seed_one = grad_out->priv && grad_out->priv->seed_one;
    out->priv->grad_owned = true;
    for (nb_node *n = start; n; n = n->prev) { /* pass 2 */
        if (n->bw_id != id) continue;
        if (n->out->grad) {
            nb__window_open(ctx);
            n->backward(ctx, n, n->out->grad);
            nb__window_close();
        }
        for (int i = 0; i < n->n_in && !inner; i++) {
            nb_tensor *x = n->in[i];
            if (!x || !x->requires_grad || x->node) continue;
            if (--x->priv->bw_pending == 0 && x->priv->bw_seen) fire_hooks(x);
        }
        n->bw_id = 0;
        n->walked = !retain_graph;
        /* Note [Memory given back]: the library's gradients always go (as
         * PyTorch's non-leaf ones do), what the tape saved unless retained */
        if (n->out->priv->mem && n->out->priv->mem->library) nb__drop_grad(n->out);
        if (!retain_graph) nb__node_release(n);
    }
    nb_set_grad_enabled(prev);
    if (!inner) nb__ctx_note_backward(ctx);
}

void nb__backward_inner(nb_tensor *out, nb_tensor *grad_out) {
    NB_CHECK(out->node, "nb_backward: internal error: an inner backward from a leaf");
    walk(out, grad_out, false, true);
}

void nb_backward_with(nb_tensor *out, nb_tensor *grad_out) {
    NB_CHECK(grad_out, "nb_backward_with: NULL gradient (use nb_backward for a one-element loss)");
    nb_backward_ex(out, &(nb_backward_options){.grad = grad_out});
}

void nb_backward(nb_tensor *loss) { nb_backward_ex(loss, NULL); }

void nb_add_grad_hook(nb_tensor *leaf, nb_grad_hook_fn fn, void *user) {
    nb__check_live("nb_add_grad_hook", leaf);
    NB_CHECK(fn, "nb_add_grad_hook: NULL hook");
    NB_CHECK(leaf->node == NULL, "nb_add_grad_hook: tensor %s is not a leaf (made by %s)",
             nb_shape_str(leaf), leaf->node ? leaf->node->op : "");
    nb_hook *h = nb__ctx_meta(leaf->ctx, sizeof *h);
    h->fn = fn;
    h->user = user;
    nb_hook **p = &leaf->priv->hooks;
    while (*p) p = &(*p)->next;
    *p = h;
}

bool nb_remove_grad_hook(nb_tensor *leaf, nb_grad_hook_fn fn, void *user) {
    for (nb_hook **p = &leaf->priv->hooks; *p; p = &(*p)->next)
        if ((*p)->fn == fn && (*p)->user == user) {
            *p = (*p)->next; /* the record stays in the context's arena */
            return true;
        }
    return false;
}

void nb__graph_leaves(nb_tensor *root, void (*fn)(nb_tensor *leaf, void *user), void *user) {
    if (!root->requires_grad) return;
    if (!root->node) {
        fn(root, user);
        return;
    }
    uint64_t id = ++bw_counter;
    nb_node *start = root->node;
    start->bw_id = id;
    for (nb_node *n = start; n; n = n->prev) {
        if (n->bw_id != id) continue;
        for (int i = 0; i < n->n_in; i++) {
            nb_tensor *x = n->in[i];
            if (!x || !x->requires_grad) continue;
            if (x->node) {
                if (x->node->ctx == start->ctx) x->node->bw_id = id;
            } else {
                fn(x, user);
            }
        }
    }
    for (nb_node *n = start; n; n = n->prev)
        if (n->bw_id == id) n->bw_id = 0;
}

void nb_zero_grad(nb_tensor *t) {
    nb__check_live("nb_zero_grad", t);
    if (t->grad) nb_fill_(t->grad, 0.0);
}

void nb_set_grad(nb_tensor *t, nb_tensor *grad) {
    nb__check_live("nb_set_grad", t);
    if (grad) nb__check_live("nb_set_grad", grad);
    NB_CHECK(grad == NULL || (nb_same_shape(t, grad) && t->dtype == grad->dtype),
             "nb_set_grad: gradient %s %s does not match tensor %s %s",
             grad ? nb_dtype_name(grad->dtype) : "", grad ? nb_shape_str(grad) : "",
             nb_dtype_name(t->dtype), nb_shape_str(t));
    if (t->node) nb__set_grad(t, grad);
    else t->grad = grad;
    t->priv->grad_owned = false;
    t->priv->grad_home = NULL; /* Note [Gradients set to none] */
}
