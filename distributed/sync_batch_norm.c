/* SyncBatchNorm: batch norm over the global batch of a process group, and
 * the conversion of a module tree's BatchNorms.
 *
 * Forward all-reduces, per channel, (count, sum, sum of squares) in f64:
 * O(C) bytes whatever the world size, and right when ranks hold different
 * batch sizes. Backward all-reduces (sum dy, sum dy * xhat) and gives
 *   dx = w * invstd * (dy - sum dy / M - xhat * sum(dy * xhat) / M)
 * with M the global count; this is the gradient of the sum of the ranks'
 * losses, so after DDP averages the other gradients every rank holds the
 * gradient of the global objective. The weight and bias gradients are the
 * local sums (DDP reduces them). A communication failure inside a
 * forward or backward aborts with the process group's diagnosis.
 *
 * On CUDA the same steps run as kernels (sync_batch_norm.cu) on tensors in
 * the op's context, all-reduced through the NCCL group, and the host reads
 * nothing: the global count stays on the device (saved for backward), so
 * the "more than one value per channel" check is a deferred device fault
 * (Note [Deferred device checks] in tensor/cuda/cuda.h): the abort comes
 * at the next synchronisation, with the same message. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/sync_batch_norm_cuda.h"
#include "nabla/ddp.h"
#include "nn/internal.h"
#include "tensor/internal.h"

#if !NABLA_HAVE_CUDA
#define NO_CUDA(fn) NB_ABORT("%s: nabla was built without CUDA", fn)
void nb__cuda_sbn_stats(nb_tensor *stats, const nb_tensor *x, int64_t n, int64_t c, int64_t s) {
    (void)stats, (void)x, (void)n, (void)c, (void)s;
    NO_CUDA("nb__cuda_sbn_stats");
}
void nb__cuda_sbn_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                           nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                           double eps, int64_t c) {
    (void)mean, (void)invstd, (void)stats, (void)running_mean, (void)running_var;
    (void)momentum, (void)eps, (void)c;
    NO_CUDA("nb__cuda_sbn_finalize");
}
void nb__cuda_sbn_apply(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                        const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                        int64_t n, int64_t c, int64_t s) {
    (void)y, (void)x, (void)mean, (void)invstd, (void)w, (void)b, (void)n, (void)c, (void)s;
    NO_CUDA("nb__cuda_sbn_apply");
}
void nb__cuda_sbn_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                const nb_tensor *mean, const nb_tensor *invstd, int64_t n,
                                int64_t c, int64_t s) {
    (void)sums, (void)dy, (void)x, (void)mean, (void)invstd, (void)n, (void)c, (void)s;
    NO_CUDA("nb__cuda_sbn_backward_sums");
}
void nb__cuda_sbn_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                              const nb_tensor *mean, const nb_tensor *invstd, const nb_tensor *w,
                              const nb_tensor *sums, const nb_tensor *stats, int64_t n, int64_t c,
                              int64_t s) {
    (void)dx, (void)dy, (void)x, (void)mean, (void)invstd, (void)w, (void)sums, (void)stats;
    (void)n, (void)c, (void)s;
    NO_CUDA("nb__cuda_sbn_backward_dx");
}
#endif

/* element (n, c, s) of a contiguous (N, C, S) tensor */
#define AT(T, t, i) (((T *)(t)->data)[i])

static double load(const nb_tensor *t, int64_t i) {
    return t->dtype == NB_F32 ? (double)AT(float, t, i) : AT(double, t, i);
}

static void store(nb_tensor *t, int64_t i, double v) {
    if (t->dtype == NB_F32) AT(float, t, i) = (float)v;
    else AT(double, t, i) = v;
}

static void all_reduce_sum(nb_pg *pg, nb_tensor *t, const char *what) {
    nb_status st = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM));
    NB_CHECK(st == NB_OK, "nb_sync_batch_norm: all-reduce of the %s failed: %s", what, nb_last_error());
}

typedef struct sbn_saved {
    nb_pg *pg;
    int64_t n, c, s;
    double count; /* global */
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

static void sbn_backward_cuda(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const sbn_saved *sv = node->extra;
    nb_tensor *x = node->saved[0], *mean = node->saved[1], *invstd = node->saved[2];
    nb_tensor *stats = node->saved[3];
    nb_tensor *w = node->in[1], *b = node->in[2], *xin = node->in[0];
    nb_tensor *dy = nb__contig(ctx, g);
    int64_t N = sv->n, C = sv->c, S = sv->s, two_c = 2 * C;
    nb_tensor *sums = nb__empty(ctx, NB_F64, 1, &two_c); /* [sum dy | sum dy*xhat] */
    nb__cuda_sbn_backward_sums(sums, dy, x, mean, invstd, N, C, S);
    if (b && b->requires_grad) nb__accum_grad(ctx, b, channel_slice(ctx, sums, 0, C, b->dtype));
    if (w && w->requires_grad) nb__accum_grad(ctx, w, channel_slice(ctx, sums, C, C, w->dtype));
    if (xin->requires_grad) {
        all_reduce_sum(sv->pg, sums, "gradient sums");
        nb_tensor *wc = w ? nb__contig(ctx, w) : NULL;
        nb_tensor *dx = nb__empty(ctx, xin->dtype, xin->ndim, xin->shape);
        nb__cuda_sbn_backward_dx(dx, dy, x, mean, invstd, wc, sums, stats, N, C, S);
        nb__accum_grad(ctx, xin, dx);
    }
}

static void sbn_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    const sbn_saved *sv = node->extra;
    if (node->saved[0]->device.type == NB_DEVICE_CUDA) {
        sbn_backward_cuda(ctx, node, g);
        return;
    }
    nb_tensor *x = node->saved[0], *mean = node->saved[1], *invstd = node->saved[2];
    nb_tensor *w = node->in[1], *b = node->in[2];
    nb_tensor *dy = nb__contig(ctx, g);
    int64_t N = sv->n, C = sv->c, S = sv->s;
    nb_ctx *tmp = nb_ctx_new(nb_cpu(), 0);
    int64_t two_c = 2 * C;
    nb_tensor *sums = nb_zeros(tmp, NB_F64, 1, &two_c); /* [sum dy | sum dy*xhat] */
    double *sd = sums->data, *sdx = sd + C;
    const double *mu = mean->data, *is = invstd->data;
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++) {
                double d = load(dy, i);
                sd[c] += d;
                sdx[c] += d * (load(x, i) - mu[c]) * is[c];
            }
    if (b && b->requires_grad) {
        nb_tensor *gb = nb__empty(ctx, b->dtype, 1, &C);
        for (int64_t c = 0; c < C; c++) store(gb, c, sd[c]);
        nb__accum_grad(ctx, b, gb);
    }
    if (w && w->requires_grad) {
        nb_tensor *gw = nb__empty(ctx, w->dtype, 1, &C);
        for (int64_t c = 0; c < C; c++) store(gw, c, sdx[c]);
        nb__accum_grad(ctx, w, gw);
    }
    nb_tensor *xin = node->in[0];
    if (xin->requires_grad) {
        all_reduce_sum(sv->pg, sums, "gradient sums");
        nb_tensor *wc = w ? nb__contig(ctx, w) : NULL;
        nb_tensor *dx = nb__empty(ctx, xin->dtype, xin->ndim, xin->shape);
        for (int64_t n = 0; n < N; n++)
            for (int64_t c = 0; c < C; c++) {
                double scale = (wc ? load(wc, c) : 1.0) * is[c];
                double a = sd[c] / sv->count, bb = sdx[c] / sv->count;
                for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++) {
                    double xhat = (load(x, i) - mu[c]) * is[c];
                    store(dx, i, scale * (load(dy, i) - a - xhat * bb));
                }
            }
        nb__accum_grad(ctx, xin, dx);
    }
    nb_ctx_free(tmp);
}

static nb_tensor *sbn_forward_cuda(nb_ctx *ctx, nb_pg *pg, nb_tensor *x, nb_tensor *xc,
                                   nb_tensor *weight, nb_tensor *bias, nb_tensor *running_mean,
                                   nb_tensor *running_var, double momentum, double eps, int64_t N,
                                   int64_t C, int64_t S) {
    int64_t three_c = 3 * C;
    nb_tensor *stats = nb__empty(ctx, NB_F64, 1, &three_c); /* [count | sum | sum of squares] */
    nb__cuda_sbn_stats(stats, xc, N, C, S);
    all_reduce_sum(pg, stats, "batch statistics");
    nb_tensor *mean = nb__empty(ctx, NB_F64, 1, &C), *invstd = nb__empty(ctx, NB_F64, 1, &C);
    nb__cuda_sbn_finalize(mean, invstd, stats, running_mean, running_var, momentum, eps, C);
    nb_tensor *wc = weight ? nb__contig(ctx, weight) : NULL;
    nb_tensor *bc = bias ? nb__contig(ctx, bias) : NULL;
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb__cuda_sbn_apply(y, xc, mean, invstd, wc, bc, N, C, S);
    nb_tensor *in[3] = {x, weight, bias};
    nb_node *node = nb__record(ctx, "nb_sync_batch_norm", sbn_backward, y, 3, in);
    if (node) {
        sbn_saved *sv = nb__ctx_meta(ctx, sizeof *sv);
        *sv = (sbn_saved){pg, N, C, S, 0};
        node->extra = sv;
        node->saved[0] = xc;
        node->saved[1] = mean;
        node->saved[2] = invstd;
        node->saved[3] = stats;
    }
    return y;
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
    for (int k = 2; k < 4 && x->device.type == NB_DEVICE_CUDA; k++)
        NB_CHECK(!per_c[k] || per_c[k]->dtype == NB_F32 || per_c[k]->dtype == NB_F64,
                 "%s: %s must be f32 or f64, got %s", op, names[k], nb_dtype_name(per_c[k]->dtype));
    nb_tensor *xc = nb__contig(ctx, x);
    if (x->device.type == NB_DEVICE_CUDA)
        return sbn_forward_cuda(ctx, pg, x, xc, weight, bias, running_mean, running_var, momentum,
                                eps, N, C, S);
    nb_ctx *tmp = nb_ctx_new(nb_cpu(), 0);
    int64_t three_c = 3 * C;
    nb_tensor *stats = nb_zeros(tmp, NB_F64, 1, &three_c); /* [count | sum | sum of squares] */
    double *cnt = stats->data, *sum = cnt + C, *sq = sum + C;
    for (int64_t c = 0; c < C; c++) cnt[c] = (double)(N * S);
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++) {
                double v = load(xc, i);
                sum[c] += v;
                sq[c] += v * v;
            }
    all_reduce_sum(pg, stats, "batch statistics");
    double M = cnt[0];
    NB_CHECK(M > 1, "%s: the global batch has %g value(s) per channel; training needs more than one "
             "(input %s on this rank)", op, M, nb_shape_str(x));
    nb_tensor *mean = nb__empty(ctx, NB_F64, 1, &C), *invstd = nb__empty(ctx, NB_F64, 1, &C);
    double *mu = mean->data, *is = invstd->data;
    for (int64_t c = 0; c < C; c++) {
        mu[c] = sum[c] / M;
        double var = sq[c] / M - mu[c] * mu[c];
        if (var < 0) var = 0;
        is[c] = 1.0 / sqrt(var + eps);
        if (running_mean) {
            double rm = nb_get(running_mean, &c), rv = nb_get(running_var, &c);
            nb_set(running_mean, &c, (1 - momentum) * rm + momentum * mu[c]);
            nb_set(running_var, &c, (1 - momentum) * rv + momentum * var * M / (M - 1));
        }
    }
    nb_ctx_free(tmp);
    nb_tensor *y = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++) {
            double w = weight ? nb_get(weight, &c) : 1.0, b = bias ? nb_get(bias, &c) : 0.0;
            for (int64_t k = 0, i = (n * C + c) * S; k < S; k++, i++)
                store(y, i, (load(xc, i) - mu[c]) * is[c] * w + b);
        }
    nb_tensor *in[3] = {x, weight, bias};
    nb_node *node = nb__record(ctx, op, sbn_backward, y, 3, in);
    if (node) {
        sbn_saved *sv = nb__ctx_meta(ctx, sizeof *sv);
        *sv = (sbn_saved){pg, N, C, S, M};
        node->extra = sv;
        node->saved[0] = xc;
        node->saved[1] = mean;
        node->saved[2] = invstd;
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
