/* Layer norm and batch norm: front ends (checks, running statistics) and
 * backward; fused kernels in tensor/cpu/norm.c.
 *
 * Both normalise with the biased variance, as PyTorch does. Batch norm in
 * training mode also updates the running statistics in place, outside
 * autograd: running = (1 - momentum) running + momentum stat, where the
 * variance stat is the unbiased one (n / (n - 1) times the biased). The
 * statistics used by forward are saved (f64 on the CPU and for f64 input
 * on CUDA, else f32) so that backward does not depend on later changes to
 * the running buffers. The whole batch norm, running statistics
 * included, is one call into the backend (tensor/backend.h; on CUDA cuDNN
 * where it can, else our kernels: Note [Batch norm: cuDNN or our kernels]
 * in tensor/cuda/batch_norm.cu, with no host reads). */
#include <math.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

static nb_tensor *contig_or_null(nb_ctx *ctx, nb_tensor *t) { return t ? nb__contig(ctx, t) : NULL; }

static bool wants_grad(const nb_tensor *t) { return t && t->requires_grad; }

/* ---- layer norm ----
 * Note [Layer norm's gradients added in place]
 * Layer norm's backward adds its contributions straight into the
 * gradients they belong to when autograd says that is safe (Note
 * [Gradients added in place] in autograd/backward.c): the weight's and
 * the bias's into the leaves' existing gradients, in the kernel that sums
 * the rows' partials; x's into the gradient x already holds when that
 * tensor is x's alone (a leaf's, or one no backward still to run reads:
 * nb__grad_add_target). In a transformer x is the residual stream, whose
 * gradient the residual add handed over before this node runs, so the
 * add that would follow (a pass over three (B, T, C) tensors and a launch
 * on CUDA) is folded into the write of dx. Otherwise (the first gradient,
 * a gradient still shared) the contribution is written to a tensor of its
 * own and nb__accum_grad adds it, as before. The bits are those of the
 * separate add: the kernel rounds its contribution to the gradient's
 * dtype, then adds it in that dtype's arithmetic (f32 for bf16 and f16)
 * and rounds again (tensor/backend.h). A leaf with no gradient but its
 * memory reserved (Note [Gradients set to none] in autograd/backward.c)
 * has its contribution written there: no add, no tensor of its own. */

/* t's gradient to add a (shape of t, dtype dt) contribution into, else
 * t's fresh gradient or a new tensor to write it to; *add gets bit when
 * it is the first, *done when the second (nothing to hand over after). */
static nb_tensor *ln_grad_out(nb_ctx *ctx, nb_tensor *t, nb_dtype dt, unsigned bit, unsigned *add,
                              unsigned *done) {
    if (!wants_grad(t)) return NULL;
    nb_tensor *fresh = nb__leaf_grad_fresh(t, dt);
    if (fresh) {
        *done |= bit;
        return fresh;
    }
    nb_tensor *into = nb__grad_add_target(t, dt);
    if (into) {
        *add |= bit;
        return into;
    }
    return nb__empty(ctx, dt, t->ndim, t->shape);
}

static void layer_norm_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    nb_tensor *xc = n->saved[0], *mean = n->saved[1], *rstd = n->saved[2], *wc = n->saved[3];
    int64_t m = n->i[0], d = n->i[1];
    g = nb__contig(ctx, g);
    unsigned add = 0, done = 0;
    nb_tensor *dx = ln_grad_out(ctx, x, x->dtype, NB__LN_ADD_DX, &add, &done);
    nb_tensor *dw = ln_grad_out(ctx, w, w ? w->dtype : NB_F32, NB__LN_ADD_DW, &add, &done);
    nb_tensor *db = ln_grad_out(ctx, b, b ? b->dtype : NB_F32, NB__LN_ADD_DB, &add, &done);
    nb__backend_at(xc)->layer_norm_backward(ctx, dx, dw, db, g, xc, mean, rstd, wc, m, d, add);
    add |= done;
    if (dx && !(add & NB__LN_ADD_DX)) nb__accum_grad(ctx, x, dx);
    if (dw && !(add & NB__LN_ADD_DW)) nb__accum_grad(ctx, w, dw);
    if (db && !(add & NB__LN_ADD_DB)) nb__accum_grad(ctx, b, db);
}

/* p: x's dtype, or f32 for a half x (the master weights: Note [Compute
 * dtype] in tensor/context.c) */
static void check_layer_norm_param(const char *name, const nb_tensor *p, const nb_tensor *x,
                                   int norm_ndim, nb_ctx *ctx) {
    if (!p) return;
    nb__check_ctx("nb_layer_norm", ctx, p);
    const int64_t *dims = x->shape + x->ndim - norm_ndim;
    bool ok = p->ndim == norm_ndim;
    for (int k = 0; ok && k < norm_ndim; k++) ok = p->shape[k] == dims[k];
    NB_CHECK(ok, "nb_layer_norm: %s has shape %s but the normalised dims of input %s are %s", name,
             nb_shape_str(p), nb_shape_str(x), nb__shape_str_n(norm_ndim, dims));
    bool half = x->dtype == NB_BF16 || x->dtype == NB_F16;
    NB_CHECK(p->dtype == x->dtype || (half && p->dtype == NB_F32),
             "nb_layer_norm: %s is %s but the input is %s", name, nb_dtype_name(p->dtype),
             nb_dtype_name(x->dtype));
}

nb_tensor *nb_layer_norm(nb_ctx *ctx, nb_tensor *x, int norm_ndim, nb_tensor *weight,
                         nb_tensor *bias, double eps) {
    const char *op = "nb_layer_norm";
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    NB_CHECK(norm_ndim >= 1 && norm_ndim <= x->ndim,
             "%s: norm_ndim %d out of range for input %s (need 1..%d)", op, norm_ndim,
             nb_shape_str(x), x->ndim);
    NB_CHECK(eps >= 0, "%s: eps must be >= 0, got %g", op, eps);
    check_layer_norm_param("weight", weight, x, norm_ndim, ctx);
    check_layer_norm_param("bias", bias, x, norm_ndim, ctx);
    int lead = x->ndim - norm_ndim;
    int64_t m = nb__numel_shape(lead, x->shape);
    int64_t d = nb__numel_shape(norm_ndim, x->shape + lead);
    nb_tensor *xc = nb__contig(ctx, x), *wc = contig_or_null(ctx, weight);
    nb_tensor *bc = contig_or_null(ctx, bias);
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    const nb__backend *be = nb__backend_at(x);
    nb_dtype st = be->f32_norm_stats && x->dtype != NB_F64 ? NB_F32 : NB_F64;
    nb_tensor *mean = nb__empty(ctx, st, 1, &m), *rstd = nb__empty(ctx, st, 1, &m);
    be->layer_norm(y, mean, rstd, xc, wc, bc, m, d, eps);
    nb_tensor *in[3] = {x, weight, bias};
    nb_node *n = nb__record(ctx, op, layer_norm_backward, y, 3, in);
    if (n) {
        n->saved[0] = xc;
        n->saved[1] = mean;
        n->saved[2] = rstd;
        n->saved[3] = wc;
        for (int k = 0; k < 4; k++) nb__mem_internal(n, n->saved[k]);
        n->i[0] = m;
        n->i[1] = d;
    }
    return y;
}

/* ---- batch norm ---- */
static void batch_norm_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    nb_tensor *xc = n->saved[0], *mean = n->saved[1], *invstd = n->saved[2], *wc = n->saved[3];
    g = nb__contig(ctx, g);
    nb_tensor *dx = wants_grad(x) ? nb__empty(ctx, x->dtype, x->ndim, x->shape) : NULL;
    nb_tensor *dw = wants_grad(w) ? nb__empty(ctx, w->dtype, w->ndim, w->shape) : NULL;
    nb_tensor *db = wants_grad(b) ? nb__empty(ctx, b->dtype, b->ndim, b->shape) : NULL;
    nb__backend_at(xc)->batch_norm_backward(dx, dw, db, g, xc, mean, invstd, wc, n->i[3] != 0,
                                            n->f[0], n->i[0], n->i[1], n->i[2]);
    if (dx) nb__accum_grad(ctx, x, dx);
    if (dw) nb__accum_grad(ctx, w, dw);
    if (db) nb__accum_grad(ctx, b, db);
}

/* weight/bias: x's dtype; running stats: any of f32/f64. All (C). */
static void check_channel_param(nb_ctx *ctx, const char *name, const nb_tensor *p,
                                const nb_tensor *x, bool same_dtype) {
    if (!p) return;
    nb__check_ctx("nb_batch_norm", ctx, p);
    NB_CHECK(p->ndim == 1 && p->shape[0] == x->shape[1],
             "nb_batch_norm: %s has shape %s but the input %s has %lld channels", name,
             nb_shape_str(p), nb_shape_str(x), (long long)x->shape[1]);
    if (same_dtype)
        NB_CHECK(p->dtype == x->dtype, "nb_batch_norm: %s is %s but the input is %s", name,
                 nb_dtype_name(p->dtype), nb_dtype_name(x->dtype));
    else
        NB_CHECK(p->dtype == NB_F32 || p->dtype == NB_F64,
                 "nb_batch_norm: %s must be f32 or f64, got %s", name, nb_dtype_name(p->dtype));
}

nb_tensor *nb_batch_norm(nb_ctx *ctx, nb_tensor *x, nb_tensor *weight, nb_tensor *bias,
                         nb_tensor *running_mean, nb_tensor *running_var, bool training,
                         double momentum, double eps) {
    const char *op = "nb_batch_norm";
    nb__check_ctx(op, ctx, x);
    nb__check_float(op, x);
    NB_CHECK(x->ndim >= 2, "%s: input must be (N, C, ..), got shape %s", op, nb_shape_str(x));
    check_channel_param(ctx, "weight", weight, x, true);
    check_channel_param(ctx, "bias", bias, x, true);
    check_channel_param(ctx, "running_mean", running_mean, x, false);
    check_channel_param(ctx, "running_var", running_var, x, false);
    NB_CHECK((running_mean == NULL) == (running_var == NULL),
             "%s: running_mean and running_var must both be given or both be NULL", op);
    NB_CHECK(training || running_mean,
             "%s: eval mode (training = false) needs running_mean and running_var; input %s", op,
             nb_shape_str(x));
    NB_CHECK(eps >= 0, "%s: eps must be >= 0, got %g", op, eps);
    NB_CHECK(momentum >= 0 && momentum <= 1, "%s: momentum must be in [0, 1], got %g", op, momentum);
    int64_t n = x->shape[0], c = x->shape[1], s = nb__numel_shape(x->ndim - 2, x->shape + 2);
    NB_CHECK(!training || n * s > 1,
             "%s: training needs more than one value per channel, got input %s", op, nb_shape_str(x));

    nb_tensor *xc = nb__contig(ctx, x), *wc = contig_or_null(ctx, weight);
    nb_tensor *bc = contig_or_null(ctx, bias);
    const nb__backend *be = nb__backend_at(x);
    nb_dtype st = be->f32_norm_stats && x->dtype != NB_F64 ? NB_F32 : NB_F64;
    nb_tensor *mean = nb__empty(ctx, st, 1, &c), *invstd = nb__empty(ctx, st, 1, &c);
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    be->batch_norm(y, mean, invstd, xc, wc, bc, running_mean, running_var, training, momentum, eps,
                   n, c, s);
    nb_tensor *in[3] = {x, weight, bias};
    nb_node *node = nb__record(ctx, op, batch_norm_backward, y, 3, in);
    if (node) {
        node->saved[0] = xc;
        node->saved[1] = mean;
        node->saved[2] = invstd;
        node->saved[3] = wc;
        for (int k = 0; k < 4; k++) nb__mem_internal(node, node->saved[k]);
        node->i[0] = n;
        node->i[1] = c;
        node->i[2] = s;
        node->i[3] = training;
        node->f[0] = eps;
    }
    return y;
}
