/* Parameter shadows: a 16-bit copy of an f32 parameter that the
 * optimizer's update writes as it writes the parameter, read by the
 * products of a context whose compute dtype is that 16-bit type instead of
 * a cast kernel at every use.
 *
 * Note [Parameter shadows]
 * Under a bf16 compute dtype each product casts its f32 operands (Note
 * [Compute dtype] in tensor/context.c): for GPT-2 small 97 cast kernels a
 * step, reading 4 and writing 2 bytes per parameter, and 0.25 GB of casts
 * kept for the backward. The cast of a parameter depends only on its
 * values, which change in two ways: the optimizer's update, which reads
 * and writes every parameter anyway and so writes the rounding of the new
 * value into the shadow too (2 bytes per element more, tensor/backend.h's
 * nb__update_extras), and the program's own writes (loading a checkpoint,
 * nb_copy_, a broadcast from rank 0).
 *   - Which parameters: those of an optimizer (they have a slot, Note
 *     [Flat gradients] in autograd/backward.c) that a product casts to
 *     bf16 or f16. The first cast makes the shadow, in the parameter's
 *     context (kept until that context is freed), and casts into it, so a
 *     step context never holds a copy of the weights: the 2 bytes per
 *     element the shadows take in the parameters' context are the ones
 *     the casts took in the step's until its backward.
 *   - Validity: one process-wide count of writes to parameter values
 *     (`epoch`). The library's entry points that write values outside an
 *     update bump it (nb__values_written): nb_fill_, nb_copy_, nb_axpy_,
 *     nb_scale_, nb_set and the all-reduce and reduce-scatter collectives
 *     when the tensor written is a parameter or a view of one; broadcasts,
 *     all-gathers, the checkpoint reader and a module's move whatever they
 *     write. An update stamps the shadows it writes with the epoch. A
 *     product reads a shadow only when its stamp is the current epoch, its
 *     parameter still has the storage it was made from, on the same device,
 *     in the dtype wanted; otherwise it casts into the shadow again first
 *     (one kernel, as before). Before an update writes a shadow that is
 *     not valid, the shadow is refreshed the same way, so an update that
 *     writes nothing (a skipped step, Note [Clipping inside the step] in
 *     optim/clip.c) still leaves it right. A stale shadow is never read.
 *   - What a program must not do: write a parameter's memory behind the
 *     library's back (through ->data, or a tensor made over the same
 *     memory without being a view of it) between an update and a product,
 *     as it must not for any tensor a pending op reads.
 *   - The product sees the shadow as nb_cast's output (a view of the
 *     shadow with the cast's node), so gradients reach the f32 parameter
 *     exactly as through the cast (Note [Wide gradients] in
 *     autograd/backward.c), and the values are the cast's: the update and
 *     the cast round the same f32 value to nearest. Results are the same
 *     bit for bit as without shadows. One difference: a graph whose
 *     backward runs after its parameters were written (an update with
 *     retain_graph, or nb_copy_ between a forward and its backward) sees
 *     the new values where a cast kept the old ones (PyTorch refuses such a
 *     backward: a tensor it saved was modified in place). */
#include "tensor/backend.h"
#include "tensor/internal.h"

static uint64_t epoch = 1;

static bool is_param(const nb_tensor *t) {
    if (t->base) t = t->base;
    return t->requires_grad && !t->node;
}

void nb__values_written(const nb_tensor *t) {
    if (!t || is_param(t)) __atomic_add_fetch(&epoch, 1, __ATOMIC_RELAXED);
}

static bool half(nb_dtype dt) { return dt == NB_BF16 || dt == NB_F16; }

void nb__shadow_stamp(nb_tensor *p);

static bool valid(const nb__grad_slot *s, const nb_tensor *p, nb_dtype dt) {
    return s->shadow && s->shadow->dtype == dt && s->shadow_of == p->data &&
           s->shadow_epoch == __atomic_load_n(&epoch, __ATOMIC_RELAXED) &&
           nb_device_eq(s->shadow->device, p->device) && nb_same_shape(s->shadow, p);
}

/* The slot of an f32 parameter that may have a shadow, or NULL; not one
 * sharded over the ranks (ZeRO-3, distributed/fsdp.c: a whole shadow
 * would undo the sharding's saving, and its values come and go). */
static nb__grad_slot *slot_of(const nb_tensor *p) {
    return p->dtype == NB_F32 && p->priv->grad_slot && !p->node && p->requires_grad &&
                   nb_is_contiguous(p) && !(p->priv->mem && p->priv->mem->sharded)
               ? p->priv->grad_slot
               : NULL;
}

/* p's shadow in dtype dt made valid: made at the first call (in p's
 * context, kept), cast again when stale; NULL when p has one of another
 * dtype (a second compute dtype: that one casts at each use). */
static nb_tensor *refresh(nb__grad_slot *s, nb_tensor *p, nb_dtype dt) {
    if (valid(s, p, dt)) return s->shadow;
    if (s->shadow && (s->shadow->dtype != dt || !nb_device_eq(s->shadow->device, p->device) ||
                      !nb_same_shape(s->shadow, p)))
        return NULL;
    if (!s->shadow) {
        s->shadow = nb__empty(p->ctx, dt, p->ndim, p->shape);
        nb__keep(s->shadow);
    }
    nb__run_copy(s->shadow, p); /* the cast, into the shadow */
    nb__shadow_stamp(p);
    return s->shadow;
}

nb_tensor *nb__cast_param(nb_ctx *ctx, nb_tensor *x, nb_dtype cd) {
    nb__grad_slot *s = half(cd) ? slot_of(x) : NULL;
    nb_tensor *h = s && nb_device_eq(nb_ctx_device(ctx), x->device) ? refresh(s, x, cd) : NULL;
    if (!h) return nb_cast(ctx, x, cd);
    nb__check_ctx("nb_cast", ctx, x);
    nb_tensor *out = nb__view(ctx, h, x->ndim, x->shape, h->strides, h->data);
    nb__node_reads(nb__record(ctx, "nb_cast", nb__cast_backward, out, 1, &x), 0);
    return out;
}

nb_tensor *nb__shadow_for_update(nb_tensor *p) {
    nb__grad_slot *s = slot_of(p);
    return s && s->shadow ? refresh(s, p, s->shadow->dtype) : NULL;
}

void nb__shadow_stamp(nb_tensor *p) {
    nb__grad_slot *s = slot_of(p);
    if (!s || !s->shadow) return;
    s->shadow_epoch = __atomic_load_n(&epoch, __ATOMIC_RELAXED);
    s->shadow_of = p->data;
}
