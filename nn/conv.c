/* Conv2d over nb_conv2d, with PyTorch's default initialisation (weight and
 * bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in / groups * kh * kw).
 * Unbatched (C, H, W) inputs are not supported. */
#include <math.h>

#include "nn/internal.h"

typedef struct conv {
    int64_t in, out;
    int kh, kw;
    nb_conv2d_opts opts;
    nb_tensor *weight; /* (out, in / groups, kh, kw) */
    nb_tensor *bias;   /* (out) or NULL */
} conv;

static void conv_describe(nb_module *m, char *buf, size_t size) {
    const conv *c = m->self;
    const nb_conv2d_opts *o = &c->opts;
    char groups[32] = ""; /* shown only when not 1, as PyTorch does */
    if (o->groups != 1) snprintf(groups, sizeof groups, ", groups=%d", o->groups);
    snprintf(buf, size,
             "%lld, %lld, kernel_size=(%d, %d), stride=(%d, %d), padding=(%d, %d), "
             "dilation=(%d, %d)%s, bias=%s",
             (long long)c->in, (long long)c->out, c->kh, c->kw, o->stride[0], o->stride[1],
             o->padding[0], o->padding[1], o->dilation[0], o->dilation[1], groups,
             c->bias ? "true" : "false");
}

static nb_tensor *conv_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

static const nb_module_type conv_type = {"Conv2d", sizeof(conv), conv_forward, conv_describe};

/* x (N, in, H, W) -> (N, out, OH, OW) */
static nb_tensor *conv_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const conv *c = m->self;
    NB_CHECK(x->ndim == 4 && x->shape[1] == c->in,
             "Conv2d: input %s must be (N, %lld, H, W)", nb_shape_str(x), (long long)c->in);
    nb__nn_check_input_dtype("Conv2d", x, c->weight->dtype);
    return nb_conv2d(ctx, x, c->weight, c->bias, &c->opts);
}

nb_module *nb_conv2d_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_channels, int64_t out_channels,
                         int kernel_h, int kernel_w, const nb_conv2d_opts *opts, bool bias,
                         nb_rng *rng) {
    const char *fn = "nb_conv2d_new";
    nb__nn_check_dtype(fn, dtype);
    NB_CHECK(in_channels > 0 && out_channels > 0,
             "%s: in_channels %lld and out_channels %lld must be positive", fn,
             (long long)in_channels, (long long)out_channels);
    NB_CHECK(kernel_h > 0 && kernel_w > 0, "%s: kernel size (%d, %d) must be positive", fn,
             kernel_h, kernel_w);
    nb_conv2d_opts o = opts ? *opts : NB_CONV2D_DEFAULTS;
    NB_CHECK(o.stride[0] > 0 && o.stride[1] > 0, "%s: stride (%d, %d) must be positive", fn,
             o.stride[0], o.stride[1]);
    NB_CHECK(o.dilation[0] > 0 && o.dilation[1] > 0, "%s: dilation (%d, %d) must be positive", fn,
             o.dilation[0], o.dilation[1]);
    NB_CHECK(o.padding[0] >= 0 && o.padding[1] >= 0, "%s: padding (%d, %d) must be non-negative",
             fn, o.padding[0], o.padding[1]);
    NB_CHECK(o.groups >= 0, "%s: groups %d must be positive", fn, o.groups);
    if (o.groups == 0) o.groups = 1;
    NB_CHECK(in_channels % o.groups == 0 && out_channels % o.groups == 0,
             "%s: in_channels %lld and out_channels %lld must both be divisible by groups %d", fn,
             (long long)in_channels, (long long)out_channels, o.groups);
    int64_t in_per_group = in_channels / o.groups;
    nb_module *m = nb_module_new(ctx, &conv_type);
    conv *c = m->self;
    c->in = in_channels;
    c->out = out_channels;
    c->kh = kernel_h;
    c->kw = kernel_w;
    c->opts = o;
    double bound = 1.0 / sqrt((double)(in_per_group * kernel_h * kernel_w));
    c->weight = nb_module_add_param(
        m, "weight",
        nb_rand_uniform(ctx, dtype, NB_SHAPE(out_channels, in_per_group, kernel_h, kernel_w),
                        -bound, bound, rng));
    if (bias)
        c->bias = nb_module_add_param(
            m, "bias", nb_rand_uniform(ctx, dtype, NB_SHAPE(out_channels), -bound, bound, rng));
    return m;
}
