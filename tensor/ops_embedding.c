/* nb_embedding: rows of a (V, C) table gathered by i32/i64 indices of any
 * shape, and nb__embedding_pos, the GPT's input: token rows plus position
 * rows in one pass, rounded once to the compute dtype. Their backwards add
 * each row's sum of the output gradient's rows (in increasing position, so
 * repeated indices accumulate deterministically) straight into the weight's
 * gradient when it has one to add into (Note [Embedding gradients in
 * place]). Kernels behind the backend table (tensor/cpu/embedding.c,
 * tensor/cuda/embedding.cu); indices are range-checked by them: on the CPU
 * at once, on CUDA by the kernel (Note [Deferred device checks] in
 * tensor/cuda/cuda.h), as a check here would need a host read.
 *
 * Note [Embedding gradients in place]
 * A table's gradient is mostly rows no index hits, so making it as a
 * tensor of its own (V, C) and adding that into the leaf's gradient moves
 * the whole table three times more (for GPT-2's token table tied to the
 * output head, whose weight-gradient GEMM already wrote the leaf's
 * gradient: 464 MB in f32 per step), for a few thousand rows of content.
 * So when the leaf has a gradient to add into (nb__leaf_grad_target: Note
 * [Gradients added in place] in autograd/backward.c), the kernel adds each
 * hit row's sum into it and leaves the other rows alone. The sum of a row
 * is formed from 0 first and then added, which is the value the separate
 * tensor plus the add gave, bit for bit. A leaf with no gradient but
 * memory reserved for it (a flat slot, or its gradient's memory before it
 * was set to none: Note [Gradients set to none] in autograd/backward.c)
 * has the whole table written there, the rows no index hits 0, repeated
 * indices summed first as always; any other first gradient still goes
 * through a tensor of its own. The output gradient is read in its
 * own dtype (bf16 under a bf16 compute dtype, summed in f32), not widened
 * by a copy first.
 *
 * Letters: V rows (vocabulary), C columns, P index positions (N sequences
 * of T for the GPT's input). */
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

/* g (P, C) of w's dtype or 16-bit for an f32 w: the kernels read it so */
static bool readable(const nb_tensor *w, const nb_tensor *g) {
    return g->dtype == w->dtype ||
           (w->dtype == NB_F32 && (g->dtype == NB_BF16 || g->dtype == NB_F16));
}

/* g, or a copy of it in w's dtype where the kernels do not read g's */
static nb_tensor *as_readable(nb_ctx *ctx, const nb_tensor *w, nb_tensor *g) {
    if (readable(w, g)) return g;
    nb_tensor *cast = nb__empty(ctx, w->dtype, g->ndim, g->shape);
    nb__run_copy(cast, g);
    return cast;
}

/* w's gradient += the gradient g through the gather of idx (the token
 * table's part): in place, or through a tensor of its own (Note [Embedding
 * gradients in place]). */
static void table_backward(nb_ctx *ctx, nb_tensor *w, nb_tensor *g, nb_tensor *idx) {
    if (!w->requires_grad) return;
    g = as_readable(ctx, w, g);
    nb_tensor *fresh = nb__leaf_grad_fresh(w, w->dtype);
    nb_tensor *target = fresh ? fresh : nb__leaf_grad_target(w, w->dtype);
    if (target) {
        nb__backend_at(w)->embedding_backward(target, g, idx, nb_numel(idx), !fresh);
        return;
    }
    nb_tensor *gw = nb__empty(ctx, w->dtype, 2, w->shape);
    nb__backend_at(w)->embedding_backward(gw, g, idx, nb_numel(idx), false);
    nb__accum_grad(ctx, w, gw);
}

static void embedding_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    table_backward(ctx, n->in[0], nb__contig(ctx, g), n->saved[0]);
}

static void check_table(const char *name, nb_ctx *ctx, const nb_tensor *w, const char *what) {
    nb__check_ctx(name, ctx, w);
    NB_CHECK(w->ndim == 2, "%s: %s must be 2-D (V, C), got %s", name, what, nb_shape_str(w));
    nb__check_float(name, w);
}

nb_tensor *nb_embedding(nb_ctx *ctx, nb_tensor *weight, nb_tensor *indices) {
    const char *name = "nb_embedding";
    check_table(name, ctx, weight, "weight");
    nb__check_ctx(name, ctx, indices);
    nb__check_index_dtype(name, indices);
    NB_CHECK(indices->ndim < NB_MAX_DIMS,
             "%s: indices %s have %d dims; the output would need %d, at most %d", name,
             nb_shape_str(indices), indices->ndim, indices->ndim + 1, NB_MAX_DIMS);

    nb_tensor *idx = nb__contig(ctx, indices);
    int64_t np = nb_numel(idx);

    int64_t shape[NB_MAX_DIMS];
    memcpy(shape, indices->shape, sizeof(int64_t) * (size_t)indices->ndim);
    shape[indices->ndim] = weight->shape[1];
    nb_tensor *out = nb__empty(ctx, weight->dtype, indices->ndim + 1, shape);
    nb__backend_at(weight)->embedding(out, weight, idx, np);

    nb_node *n = nb__record(ctx, name, embedding_backward, out, 1, &weight);
    if (n) n->saved[0] = idx;
    return out;
}

/* wpe's part: the sum over the batch per position, in place or through a
 * tensor of its own */
static void embedding_pos_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *wte = n->in[0], *wpe = n->in[1], *idx = n->saved[0];
    g = nb__contig(ctx, g);
    table_backward(ctx, wte, g, idx);
    if (!wpe->requires_grad) return;
    g = as_readable(ctx, wpe, g);
    nb_tensor *fresh = nb__leaf_grad_fresh(wpe, wpe->dtype);
    nb_tensor *target = fresh ? fresh : nb__leaf_grad_target(wpe, wpe->dtype);
    if (target) {
        nb__backend_at(wpe)->embedding_pos_backward(target, g, !fresh);
        return;
    }
    nb_tensor *gw = nb__empty(ctx, wpe->dtype, 2, wpe->shape);
    nb__backend_at(wpe)->embedding_pos_backward(gw, g, false);
    nb__accum_grad(ctx, wpe, gw);
}

nb_tensor *nb__embedding_pos(nb_ctx *ctx, nb_tensor *wte, nb_tensor *wpe, nb_tensor *idx,
                             nb_dtype dtype) {
    const char *name = "nb_embedding (token + position)";
    check_table(name, ctx, wte, "token table");
    check_table(name, ctx, wpe, "position table");
    nb__check_same_dtype(name, wte, wpe);
    nb__check_ctx(name, ctx, idx);
    nb__check_index_dtype(name, idx);
    NB_CHECK(idx->ndim == 2, "%s: indices must be (N, T), got %s", name, nb_shape_str(idx));
    NB_CHECK(idx->shape[1] <= wpe->shape[0],
             "%s: %lld positions, the position table %s has %lld rows", name,
             (long long)idx->shape[1], nb_shape_str(wpe), (long long)wpe->shape[0]);
    NB_CHECK(wte->shape[1] == wpe->shape[1], "%s: token table %s and position table %s differ "
             "in width", name, nb_shape_str(wte), nb_shape_str(wpe));
    NB_CHECK(dtype == wte->dtype || (wte->dtype == NB_F32 && (dtype == NB_BF16 || dtype == NB_F16)),
             "%s: output dtype %s for %s tables: the tables' dtype, or 16-bit for f32 ones", name,
             nb_dtype_name(dtype), nb_dtype_name(wte->dtype));

    nb_tensor *ci = nb__contig(ctx, idx);
    nb_tensor *out = nb__empty(ctx, dtype, NB_SHAPE(idx->shape[0], idx->shape[1], wte->shape[1]));
    nb__backend_at(wte)->embedding_pos(out, wte, wpe, ci);

    nb_tensor *in[2] = {wte, wpe};
    nb_node *n = nb__record(ctx, name, embedding_pos_backward, out, 2, in);
    if (n) n->saved[0] = ci;
    return out;
}
