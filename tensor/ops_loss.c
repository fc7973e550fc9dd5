/* Losses, each reduced to a 0-d mean: cross-entropy (fused log-softmax and
 * negative log-likelihood, CPU kernel in tensor/cpu/softmax.c), mean squared
 * error and binary cross-entropy on logits (tensor/cpu/loss.c and
 * nb__cuda_pair_loss, behind the backend table).
 *
 * Cross-entropy follows PyTorch: targets equal to ignore_index count for
 * nothing, neither in the sum nor in the divisor, so a batch whose targets
 * are all ignored has the mean 0/0 = NaN (and zero gradient). With label
 * smoothing eps the target distribution is (1 - eps) one-hot + eps / C.
 *
 * Kernels behind the backend table. On CUDA nothing here reads device
 * memory: the count of targets and the loss stay on the device, targets
 * out of range are reported at the next synchronisation (Note [Deferred
 * device checks] in tensor/cuda/cuda.h), and the backward functions scale
 * by the 0-d output gradient as a tensor rather than through nb_item. On
 * the CPU, targets are checked at once and the count is kept in f64. */
#include <math.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

/* ---- cross-entropy ----
 * When the logits are the library's and read by nothing after this node
 * (nb_gpt_forward_loss's), their gradient is written over them, element by
 * element from the same index (each kernel reads x[j] before it writes
 * dx[j], in the same thread on CUDA; dev/cuda_emu's drv_softmax runs the
 * CUDA kernel so aliased): the (N, C) gradient costs no memory, on every
 * device. Note [Memory given back].
 *
 * Note [Fused classifier]
 * The backward's formula needs nothing the forward does not have: once a
 * row's log-sum-exp is known, its gradient for g = 1 is
 * (softmax - (1 - eps) onehot(t) - eps / C) / count, 0 on ignored rows.
 * So when the logits may be written over (nb__cross_entropy_fused:
 * nb_gpt_forward_loss's logits, which are the library's, which no node
 * recorded before reads, and which nothing after the loss reads), grad
 * mode is on and the logits require grad, the forward writes that
 * gradient over the logits in the pass that computes the loss (CUDA: a
 * count kernel first, then the rows kernel reading each row twice, the
 * second time from L2, then the total; three launches) and keeps no lse.
 * The backward then takes the logits' storage for the gradient and
 * launches nothing when g is the root's seed of ones (nb_backward(loss)
 * on this loss: autograd/backward.c marks that seed, seed_one), else one
 * elementwise pass dlogits = g dlogits in place, correct for any g (a
 * scaled loss, a sum of losses, gradient scaling). One read and one write
 * of the (N, C) logits per step instead of two reads and a write: 0.82 GB
 * less for GPT-2 at batch 8 in bf16. With g = 1 the gradient is bitwise
 * the unfused one on the CPU (the same row function writes it: tensor/
 * cpu/softmax.c). Consequences: after such a forward the logits' storage
 * holds the gradient, so anything that read the library's logits after
 * the loss would see dlogits (nothing does: nb_gpt_forward_loss returns
 * only the loss); a forward whose backward never runs wrote the gradient
 * for nothing (correct, one write wasted); in eval (grad mode off) the
 * logits are never written. A second backward through the graph
 * (retain_graph) finds the logits given back, as it did before. */
static void cross_entropy_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *logits = n->saved[0], *targets = n->saved[1], *lse = n->saved[2];
    nb_tensor *dx = nb__reuse_for_grad(ctx, n, logits);
    if (!lse && dx && g->priv->seed_one) { /* fused, g = 1: the forward wrote it */
        nb__accum_grad(ctx, n->in[0], dx);
        return;
    }
    if (!dx) dx = nb__empty(ctx, logits->dtype, logits->ndim, logits->shape);
    nb__backend_at(logits)->cross_entropy_backward(dx, logits, lse, targets, nb__contig(ctx, g),
                                                   n->saved[3], n->i[0], n->f[1]);
    nb__accum_grad(ctx, n->in[0], dx);
}

static nb_tensor *cross_entropy(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets,
                                 const nb_cross_entropy_opts *opts, bool may_overwrite) {
    const char *op = "nb_cross_entropy";
    nb_cross_entropy_opts o = opts ? *opts : NB_CROSS_ENTROPY_DEFAULTS;
    nb__check_ctx(op, ctx, logits);
    nb__check_ctx(op, ctx, targets);
    nb__check_compute_float(op, ctx, logits);
    NB_CHECK(targets->dtype == NB_I32 || targets->dtype == NB_I64,
             "%s: targets must be i32 or i64 class indices, got %s of shape %s", op,
             nb_dtype_name(targets->dtype), nb_shape_str(targets));
    NB_CHECK(logits->ndim == 2, "%s: logits must be (N, C), got shape %s", op, nb_shape_str(logits));
    NB_CHECK(targets->ndim == 1 && targets->shape[0] == logits->shape[0],
             "%s: targets must be (N) for logits (N, C), got targets %s for logits %s", op,
             nb_shape_str(targets), nb_shape_str(logits));
    NB_CHECK(o.label_smoothing >= 0 && o.label_smoothing <= 1,
             "%s: label_smoothing must be in [0, 1], got %g", op, o.label_smoothing);
    nb_tensor *tc = nb__contig(ctx, targets), *xc = nb__contig(ctx, logits), *lse, *cnt;
    /* a loss is f32 under a compute dtype (Note [Compute dtype] in tensor/context.c) */
    bool half = logits->dtype == NB_BF16 || logits->dtype == NB_F16;
    nb_tensor *out = nb__empty(ctx, half ? NB_F32 : logits->dtype, 0, NULL);
    bool fused = may_overwrite && nb__needs_grad(1, &logits) && nb__overwritable(ctx, xc);
    nb__backend_at(logits)->cross_entropy(ctx, out, &lse, &cnt, fused ? xc : NULL, xc, tc,
                                          o.ignore_index, o.label_smoothing);
    nb_node *node = nb__record(ctx, op, cross_entropy_backward, out, 1, &logits);
    if (node) {
        node->saved[0] = xc;
        node->saved[1] = tc;
        node->saved[2] = lse;
        node->saved[3] = cnt;
        nb__mem_internal(node, xc);
        if (tc != targets) nb__mem_internal(node, tc); /* targets is no input */
        nb__mem_internal(node, lse);
        nb__mem_internal(node, cnt);
        node->f[1] = o.label_smoothing;
        node->i[0] = o.ignore_index;
    }
    return out;
}

nb_tensor *nb_cross_entropy(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets,
                            const nb_cross_entropy_opts *opts) {
    return cross_entropy(ctx, logits, targets, opts, false);
}

nb_tensor *nb__cross_entropy_fused(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets,
                                   const nb_cross_entropy_opts *opts) {
    return cross_entropy(ctx, logits, targets, opts, true);
}

/* ---- elementwise losses: shared checks and reduction ---- */
static void check_pair(const char *op, nb_ctx *ctx, const nb_tensor *a, const nb_tensor *b,
                       const char *aname, const char *bname) {
    nb__check_ctx(op, ctx, a);
    nb__check_ctx(op, ctx, b);
    nb__check_float(op, a);
    NB_CHECK(nb_same_shape(a, b), "%s: %s %s and %s %s must have the same shape", op, aname,
             nb_shape_str(a), bname, nb_shape_str(b));
    nb__check_same_dtype(op, a, b);
}

typedef enum pair_loss { LOSS_MSE, LOSS_BCE } pair_loss;

static nb_tensor *pair_loss_forward(nb_ctx *ctx, pair_loss kind, nb_tensor *a, nb_tensor *b) {
    nb_tensor *ac = nb__contig(ctx, a), *bc = nb__contig(ctx, b);
    nb_tensor *out = nb__empty(ctx, a->dtype, 0, NULL);
    nb__backend_at(a)->pair_loss(out, kind == LOSS_MSE ? 0 : 1, ac, bc);
    return out;
}

/* ---- mean squared error ---- */
static void mse_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *pred = n->in[0], *target = n->in[1];
    double scale = 2.0 / (double)nb_numel(pred);
    nb_tensor *d = nb__unary(ctx, NB_U_MUL_S, nb__binary(ctx, NB_B_SUB, pred, target), scale);
    d = nb__binary(ctx, NB_B_MUL, d, g); /* g is 0-d: broadcast, no host read */
    nb__accum_grad(ctx, pred, d);
    if (target->requires_grad) nb__accum_grad(ctx, target, nb__unary(ctx, NB_U_NEG, d, 0));
}

nb_tensor *nb_mse_loss(nb_ctx *ctx, nb_tensor *pred, nb_tensor *target) {
    check_pair("nb_mse_loss", ctx, pred, target, "pred", "target");
    nb_tensor *out = pair_loss_forward(ctx, LOSS_MSE, pred, target);
    nb_tensor *in[2] = {pred, target};
    nb__record(ctx, "nb_mse_loss", mse_backward, out, 2, in);
    return out;
}

/* ---- binary cross-entropy on logits ----
 * max(x, 0) - x y + log1p(exp(-|x|)) equals -[y log s(x) + (1 - y) log(1 - s(x))]
 * without overflow; its derivative in x is s(x) - y. */
static void bce_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0], *y = n->saved[0];
    double scale = 1.0 / (double)nb_numel(x);
    nb_tensor *d = nb__binary(ctx, NB_B_SUB, nb__unary(ctx, NB_U_SIGMOID, x, 0), y);
    d = nb__binary(ctx, NB_B_MUL, nb__unary(ctx, NB_U_MUL_S, d, scale), g);
    nb__accum_grad(ctx, x, d);
}

nb_tensor *nb_bce_with_logits(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets) {
    check_pair("nb_bce_with_logits", ctx, logits, targets, "logits", "targets");
    nb_tensor *out = pair_loss_forward(ctx, LOSS_BCE, logits, targets);
    nb_node *n = nb__record(ctx, "nb_bce_with_logits", bce_backward, out, 1, &logits);
    if (n) n->saved[0] = targets;
    return out;
}
