/* BatchNorm1d and BatchNorm2d over nb_batch_norm, with PyTorch's buffers
 * and modes.
 *
 * Training mode (with running statistics tracked) counts the batch in
 * num_batches_tracked and updates running_mean and running_var (unbiased)
 * with `momentum`, or with 1 / num_batches_tracked for a cumulative average;
 * evaluation mode normalises with the running statistics. A layer that does
 * not track them uses the batch's statistics in both modes. */
#include "nn/internal.h"
#include "tensor/backend.h"

typedef struct batch_norm {
    int64_t c;
    int spatial; /* 1 for BatchNorm1d, 2 for BatchNorm2d */
    nb_dtype dtype;
    nb_batch_norm_opts o;
    nb_tensor *weight, *bias;          /* (C) or NULL */
    nb_tensor *running_mean, *running_var; /* (C) or NULL */
    nb_tensor *num_batches_tracked;    /* i64, 0-d, or NULL */
    nb__batch_norm_fn impl;            /* NULL: nb_batch_norm; set by conversion to SyncBatchNorm */
    void *impl_user;
} batch_norm;

static void bn_describe(nb_module *m, char *buf, size_t size) {
    const batch_norm *b = m->self;
    char mom[32];
    if (b->o.momentum == NB_BATCH_NORM_CUMULATIVE) snprintf(mom, sizeof mom, "cumulative");
    else snprintf(mom, sizeof mom, "%g", b->o.momentum);
    snprintf(buf, size, "%lld, eps=%g, momentum=%s, affine=%s, track_running_stats=%s",
             (long long)b->c, b->o.eps, mom, b->o.affine ? "true" : "false",
             b->o.track_running_stats ? "true" : "false");
}

static nb_tensor *bn_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

static const nb_module_type bn1d_type = {"BatchNorm1d", sizeof(batch_norm), bn_forward,
                                         bn_describe};
static const nb_module_type bn2d_type = {"BatchNorm2d", sizeof(batch_norm), bn_forward,
                                         bn_describe};
static const nb_module_type sync_bn_type = {"SyncBatchNorm", sizeof(batch_norm), bn_forward,
                                            bn_describe};

/* 1d: x (N, C) or (N, C, L); 2d: x (N, C, H, W) */
static nb_tensor *bn_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    batch_norm *b = m->self;
    const char *name = m->type->name;
    if (b->spatial == 0)
        NB_CHECK(x->ndim >= 2 && x->shape[1] == b->c, "%s: input %s must be (N, %lld, ...)", name,
                 nb_shape_str(x), (long long)b->c);
    else if (b->spatial == 1)
        NB_CHECK((x->ndim == 2 || x->ndim == 3) && x->shape[1] == b->c,
                 "%s: input %s must be (N, %lld) or (N, %lld, L)", name, nb_shape_str(x),
                 (long long)b->c, (long long)b->c);
    else
        NB_CHECK(x->ndim == 4 && x->shape[1] == b->c, "%s: input %s must be (N, %lld, H, W)", name,
                 nb_shape_str(x), (long long)b->c);
    nb__nn_check_input_dtype(name, x, b->dtype);
    bool track = b->o.track_running_stats;
    double momentum = b->o.momentum;
    if (m->training && track) {
        nb_tensor *n = b->num_batches_tracked;
        if (momentum == NB_BATCH_NORM_CUMULATIVE || !nb__backend_at(n)->device_memory) {
            nb_fill_(n, nb_item(n) + 1);
            if (momentum == NB_BATCH_NORM_CUMULATIVE) momentum = 1.0 / nb_item(n);
        } else { /* in device memory, count on the device: no host read per layer and step */
            nb_tensor *one = nb_full(ctx, n->dtype, 0, NULL, 1);
            nb__run_binary(NB_B_ADD, n, n, one);
        }
    }
    if (momentum < 0) momentum = 0; /* cumulative, in a mode that updates nothing */
    bool use_batch = m->training || !track;
    if (b->impl)
        return b->impl(ctx, b->impl_user, x, b->weight, b->bias, track ? b->running_mean : NULL,
                       track ? b->running_var : NULL, use_batch, momentum, b->o.eps);
    return nb_batch_norm(ctx, x, b->weight, b->bias, track ? b->running_mean : NULL,
                         track ? b->running_var : NULL, use_batch, momentum, b->o.eps);
}

static nb_module *bn_new(const nb_module_type *type, const char *fn, int spatial, nb_ctx *ctx,
                         nb_dtype dtype, int64_t c, const nb_batch_norm_opts *opts) {
    nb__nn_check_dtype(fn, dtype);
    NB_CHECK(c > 0, "%s: num_features %lld must be positive", fn, (long long)c);
    nb_batch_norm_opts o = opts ? *opts : NB_BATCH_NORM_DEFAULTS;
    NB_CHECK(o.eps >= 0, "%s: eps %g is negative", fn, o.eps);
    NB_CHECK((o.momentum >= 0 && o.momentum <= 1) || o.momentum == NB_BATCH_NORM_CUMULATIVE,
             "%s: momentum %g must be in [0, 1] or NB_BATCH_NORM_CUMULATIVE", fn, o.momentum);
    nb_module *m = nb_module_new(ctx, type);
    batch_norm *b = m->self;
    b->c = c;
    b->spatial = spatial;
    b->dtype = dtype;
    b->o = o;
    if (o.affine) {
        b->weight = nb_module_add_param(m, "weight", nb_ones(ctx, dtype, 1, &c));
        b->bias = nb_module_add_param(m, "bias", nb_zeros(ctx, dtype, 1, &c));
    }
    if (o.track_running_stats) {
        b->running_mean = nb_module_add_buffer(m, "running_mean", nb_zeros(ctx, dtype, 1, &c));
        b->running_var = nb_module_add_buffer(m, "running_var", nb_ones(ctx, dtype, 1, &c));
        b->num_batches_tracked =
            nb_module_add_buffer(m, "num_batches_tracked", nb_zeros(ctx, NB_I64, 0, NULL));
    }
    return m;
}

nb_module *nb_batch_norm1d_new(nb_ctx *ctx, nb_dtype dtype, int64_t num_features,
                               const nb_batch_norm_opts *opts) {
    return bn_new(&bn1d_type, "nb_batch_norm1d_new", 1, ctx, dtype, num_features, opts);
}

nb_module *nb_batch_norm2d_new(nb_ctx *ctx, nb_dtype dtype, int64_t num_features,
                               const nb_batch_norm_opts *opts) {
    return bn_new(&bn2d_type, "nb_batch_norm2d_new", 2, ctx, dtype, num_features, opts);
}

bool nb__batch_norm_convert(nb_module *m, nb__batch_norm_fn impl, void *user) {
    if (m->type != &bn1d_type && m->type != &bn2d_type) return false;
    batch_norm *b = m->self;
    b->impl = impl;
    b->impl_user = user;
    b->spatial = 0; /* SyncBatchNorm takes (N, C, ...) of any rank, like PyTorch's */
    m->type = &sync_bn_type;
    return true;
}
