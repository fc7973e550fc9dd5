/* SyncBatchNorm: batch norm over the global batch of a process group, and
 * the conversion of a module tree's BatchNorms.
 *
 * Note [SyncBatchNorm]
 * One implementation for every device, from the backend's per-channel
 * steps (tensor/backend.h: tensor/cpu/channel.c, tensor/cuda/channel.cu)
 * and the group's all-reduce. Forward all-reduces, per channel, (count,
 * sum, sum of squares) in f64: O(C) bytes whatever the world size, and
 * right when ranks hold different batch sizes. Backward all-reduces
 * (sum dy, sum dy * xhat) and gives
 *   dx = w * invstd * (dy - sum dy / M - xhat * sum(dy * xhat) / M)
 * with M the global count; this is the gradient of the sum of the ranks'
 * losses, so after DDP averages the other gradients every rank holds the
 * gradient of the global objective. The weight and bias gradients are the
 * local sums (DDP reduces them).
 *
 * Note [Failures inside a forward]
 * A peer that dies or freezes while the others are in a SyncBatchNorm
 * makes its all-reduce fail: an ordinary run-time failure, which must
 * reach the program as a status naming the peer, not as an abort. But a
 * module's forward returns a tensor and a backward function returns
 * nothing, so the failure goes three ways instead:
 *   - the group is broken with it (nb__pg_break; usually the group's own
 *     wait did so already): every later collective on it fails at once
 *     with the same message, and nb_pg_status(pg) returns it;
 *   - it is noted for the calling thread (nb__dist_failure_note), and
 *     nb_ddp_forward / nb_ddp_backward, which run the module's forward and
 *     the backward, return it after them, as if the collective were
 *     theirs;
 *   - what the failed all-reduce should have made is NaN: the output (or
 *     the input's gradient) is all NaN, never a plausible number, and the
 *     running statistics are left as they were.
 * The rest of the forward runs on (each later SyncBatchNorm fails at once
 * on the broken group), so nothing waits for the collective timeout.
 *
 * The statistics live in the op's context, on the input's device; the host
 * reads none of them on a device with its own memory: the global count
 * stays there (saved for backward), and the "more than one value per
 * channel" check is the CPU's abort or, on CUDA, a deferred device fault
 * (Note [Deferred device checks] in tensor/cuda/cuda.h) reported at the
 * next synchronisation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"
#include "nabla/ddp.h"
#include "nn/internal.h"
#include "tensor/backend.h"
#include "tensor/internal.h"

/* False after a failure, handled as Note [Failures inside a forward] says. */
static bool all_reduce_sum(nb_pg *pg, nb_tensor *t, const char *what) {
    nb__ddp_join_note(pg, t);
    nb_status st = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM));
    if (st == NB_OK) return true;
    char why[2048], msg[2304];
    snprintf(why, sizeof why, "%s", nb_last_error());
    snprintf(msg, sizeof msg, "nb_sync_batch_norm: all-reduce of the %s failed: %s", what, why);
    nb__pg_break(pg, st, why);
    nb__dist_failure_note(st, msg);
    nb_set_error(st, "%s", msg);
    return false;
}

typedef struct sbn_saved {
    nb_pg *pg;
    int64_t n, c, s;
} sbn_saved;

/* (C) of dtype dt = sums[off, off + C) (f64, on the device), for the
 * weight and bias gradients. */
static nb_tensor *channel_slice(nb_ctx *ctx, nb_tensor *sums, int64_t off, int64_t C, nb_dtype dt) {
    int64_t one = 1;
    nb_tensor *v = nb__view(ctx, sums, 1, &C, &one, (double *)sums->data + off);
    nb_tensor *out = nb__empty(ctx, dt, 1, &C);
    nb_copy_(out, v);
    return out;
}

static void sbn_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const sbn_saved *sv = node->extra;
    nb_tensor *x = node->saved[0], *mean = node->saved[1], *invstd = node->saved[2];
    nb_tensor *stats = node->saved[3];
    nb_tensor *w = node->in[1], *b = node->in[2], *xin = node->in[0];
    const nb__backend *be = nb__backend_at(x);
    nb_tensor *dy = nb__contig(ctx, g);
    int64_t N = sv->n, C = sv->c, S = sv->s, two_c = 2 * C;
    nb_tensor *sums = nb__empty(ctx, NB_F64, 1, &two_c); /* [sum dy | sum dy*xhat] */
    be->channel_backward_sums(sums, dy, x, mean, invstd, N, C, S);
    if (b && b->requires_grad) nb__accum_grad(ctx, b, channel_slice(ctx, sums, 0, C, b->dtype));
    if (w && w->requires_grad) nb__accum_grad(ctx, w, channel_slice(ctx, sums, C, C, w->dtype));
    if (xin->requires_grad) {
        bool ok = all_reduce_sum(sv->pg, sums, "gradient sums");
        nb_tensor *wc = w ? nb__contig(ctx, w) : NULL;
        nb_tensor *dx = nb__empty(ctx, xin->dtype, xin->ndim, xin->shape);
        if (ok) be->channel_backward_dx(dx, dy, x, mean, invstd, wc, sums, stats, N, C, S);
        else nb_fill_(dx, NAN);
        nb__accum_grad(ctx, xin, dx);
    }
}

nb_tensor *nb_sync_batch_norm(nb_ctx *ctx, nb_pg *pg, nb_tensor *x, nb_tensor *weight, nb_tensor *bias,
                              nb_tensor *running_mean, nb_tensor *running_var, bool training,
                              double momentum, double eps) {
    const char *op = "nb_sync_batch_norm";
    if (!training)
        return nb_batch_norm(ctx, x, weight, bias, running_mean, running_var, false, momentum, eps);
    nb__check_ctx(op, ctx, x);
    nb__check_float(op, x);
    NB_CHECK(nb_device_eq(x->device, nb_pg_device(pg)),
             "%s: input is on %s but the group's %s backend works on %s tensors", op,
             nb_device_name(x->device), nb_pg_backend_name(nb_pg_backend_of(pg)),
             nb_device_name(nb_pg_device(pg)));
    NB_CHECK(x->ndim >= 2, "%s: input %s must be (N, C, ...)", op, nb_shape_str(x));
    NB_CHECK((running_mean == NULL) == (running_var == NULL),
             "%s: give both running statistics or neither", op);
    int64_t N = x->shape[0], C = x->shape[1], S = nb_numel(x) / (N * C > 0 ? N * C : 1);
    const nb_tensor *per_c[4] = {weight, bias, running_mean, running_var};
    const char *names[4] = {"weight", "bias", "running_mean", "running_var"};
    for (int k = 0; k < 4; k++)
        NB_CHECK(!per_c[k] || (per_c[k]->ndim == 1 && per_c[k]->shape[0] == C),
                 "%s: %s %s does not match the input's %lld channels (input %s)", op, names[k],
                 nb_shape_str(per_c[k]), (long long)C, nb_shape_str(x));
    for (int k = 0; k < 4; k++)
        if (per_c[k]) nb__check_ctx(op, ctx, per_c[k]);
    for (int k = 2; k < 4; k++)
        NB_CHECK(!per_c[k] || per_c[k]->dtype == NB_F32 || per_c[k]->dtype == NB_F64,
                 "%s: %s must be f32 or f64, got %s", op, names[k], nb_dtype_name(per_c[k]->dtype));
    const nb__backend *be = nb__backend_at(x);
    nb_tensor *xc = nb__contig(ctx, x);
    int64_t three_c = 3 * C;
    nb_tensor *stats = nb__empty(ctx, NB_F64, 1, &three_c); /* [count | sum | sum of squares] */
    be->channel_stats(stats, xc, N, C, S);
    bool ok = all_reduce_sum(pg, stats, "batch statistics");
    nb_tensor *mean = nb__empty(ctx, NB_F64, 1, &C), *invstd = nb__empty(ctx, NB_F64, 1, &C);
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    if (ok) {
        be->channel_finalize(mean, invstd, stats, running_mean, running_var, momentum, eps, C, x);
        nb_tensor *wc = weight ? nb__contig(ctx, weight) : NULL;
        nb_tensor *bc = bias ? nb__contig(ctx, bias) : NULL;
        be->channel_normalize(y, xc, mean, invstd, wc, bc, N, C, S);
    } else { /* Note [Failures inside a forward] */
        nb_fill_(mean, NAN);
        nb_fill_(invstd, NAN);
        nb_fill_(y, NAN);
    }
    nb_tensor *in[3] = {x, weight, bias};
    nb_node *node = nb__record(ctx, op, sbn_backward, y, 3, in);
    if (node) {
        sbn_saved *sv = nb__ctx_meta(ctx, sizeof *sv);
        *sv = (sbn_saved){pg, N, C, S};
        node->extra = sv;
        node->saved[0] = xc;
        node->saved[1] = mean;
        node->saved[2] = invstd;
        node->saved[3] = stats;
        for (int k = 0; k < 4; k++) nb__mem_internal(node, node->saved[k]);
    }
    return y;
}

static nb_tensor *sync_impl(nb_ctx *ctx, void *user, nb_tensor *x, nb_tensor *weight, nb_tensor *bias,
                            nb_tensor *running_mean, nb_tensor *running_var, bool training,
                            double momentum, double eps) {
    return nb_sync_batch_norm(ctx, user, x, weight, bias, running_mean, running_var, training,
                              momentum, eps);
}

int nb_convert_sync_batchnorm(nb_module *model, nb_pg *pg) {
    NB_CHECK(model && pg, "nb_convert_sync_batchnorm: NULL argument");
    int n = nb__batch_norm_convert(model, sync_impl, pg) ? 1 : 0;
    for (int i = 0; i < nb_module_num_children(model); i++)
        n += nb_convert_sync_batchnorm(nb_module_child_at(model, i), pg);
    return n;
}
