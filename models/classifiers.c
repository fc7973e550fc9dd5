/* The bundled classifiers: an MLP for tabular data (a plain Sequential, so
 * its names are PyTorch's for nn.Sequential) and a small CNN of
 * conv-BatchNorm-ReLU blocks with global average pooling and a linear head.
 *
 * Letters: N batch, F features, K classes, C channels, H/W height and width.
 *
 * The CNN's convolutions have no bias: the BatchNorm that follows removes
 * any per-channel constant, so a bias would only be a parameter that gets
 * a zero gradient. Its BatchNorms are stock BatchNorm2d modules, which is
 * what lets nb_convert_sync_batchnorm find and convert them. */
#include "nabla/models.h"

nb_module *nb_mlp_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_features, int n_hidden,
                      const int64_t *hidden, int64_t n_classes, nb_rng *rng) {
    NB_CHECK(in_features > 0 && n_classes > 0 && n_hidden >= 0 && (hidden || n_hidden == 0),
             "nb_mlp_new: need in_features (%lld) > 0, n_classes (%lld) > 0 and n_hidden (%d) "
             ">= 0 widths", (long long)in_features, (long long)n_classes, n_hidden);
    nb_module *m = nb_sequential_new(ctx, 0, NULL);
    int64_t width = in_features;
    for (int i = 0; i < n_hidden; i++) {
        NB_CHECK(hidden[i] > 0, "nb_mlp_new: hidden[%d] = %lld must be positive", i,
                 (long long)hidden[i]);
        nb_module_append(m, nb_linear_new(ctx, dtype, width, hidden[i], true, rng));
        nb_module_append(m, nb_relu_new(ctx));
        width = hidden[i];
    }
    nb_module_append(m, nb_linear_new(ctx, dtype, width, n_classes, true, rng));
    return m;
}

/* conv 3x3 (no bias) -> BatchNorm2d -> ReLU: (N, C, H, W) -> (N, C', H, W) */
typedef struct conv_block {
    nb_module *conv, *bn, *relu;
} conv_block;

static nb_tensor *conv_block_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
static const nb_module_type conv_block_type = {"ConvBlock", sizeof(conv_block),
                                               conv_block_forward, NULL};

static nb_tensor *conv_block_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    conv_block *b = nb_module_self(m, &conv_block_type);
    x = nb_module_forward(b->conv, ctx, x);
    return nb_module_forward(b->relu, ctx, nb_module_forward(b->bn, ctx, x));
}

typedef struct cnn {
    int64_t in_channels;
    nb_module *blocks, *pool, *gap, *flatten, *head;
} cnn;

static nb_tensor *cnn_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

static void cnn_describe(nb_module *m, char *buf, size_t size);

static const nb_module_type cnn_type = {"ConvNet", sizeof(cnn), cnn_forward, cnn_describe};

static void cnn_describe(nb_module *m, char *buf, size_t size) {
    const cnn *c = nb_module_self(m, &cnn_type);
    snprintf(buf, size, "in_channels=%lld", (long long)c->in_channels);
}

/* x (N, C, H, W) -> logits (N, K) */
static nb_tensor *cnn_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    cnn *c = nb_module_self(m, &cnn_type);
    NB_CHECK(x->ndim == 4 && x->shape[1] == c->in_channels,
             "ConvNet: input %s must be (N, %lld, H, W)", nb_shape_str(x),
             (long long)c->in_channels);
    int n = nb_module_num_children(c->blocks);
    for (int i = 0; i < n; i++) {
        x = nb_module_forward(nb_module_child_at(c->blocks, i), ctx, x);
        if (i + 1 < n && x->shape[2] >= 2 && x->shape[3] >= 2)
            x = nb_module_forward(c->pool, ctx, x);
    }
    x = nb_module_forward(c->flatten, ctx, nb_module_forward(c->gap, ctx, x)); /* (N, C) */
    return nb_module_forward(c->head, ctx, x);
}

nb_module *nb_cnn_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_channels, int n_blocks,
                      const int64_t *channels, int64_t n_classes, nb_rng *rng) {
    NB_CHECK(in_channels > 0 && n_blocks > 0 && channels && n_classes > 0,
             "nb_cnn_new: need in_channels (%lld) > 0, n_blocks (%d) > 0 channel counts and "
             "n_classes (%lld) > 0", (long long)in_channels, n_blocks, (long long)n_classes);
    nb_module *m = nb_module_new(ctx, &cnn_type);
    cnn *c = nb_module_self(m, &cnn_type);
    c->in_channels = in_channels;
    c->blocks = nb_module_add(m, "blocks", nb_module_list_new(ctx));
    nb_conv2d_opts same = {{1, 1}, {1, 1}, {1, 1}, 1};
    int64_t width = in_channels;
    for (int i = 0; i < n_blocks; i++) {
        NB_CHECK(channels[i] > 0, "nb_cnn_new: channels[%d] = %lld must be positive", i,
                 (long long)channels[i]);
        nb_module *bm = nb_module_new(ctx, &conv_block_type);
        conv_block *b = nb_module_self(bm, &conv_block_type);
        b->conv = nb_module_add(bm, "conv",
                                nb_conv2d_new(ctx, dtype, width, channels[i], 3, 3, &same, false, rng));
        b->bn = nb_module_add(bm, "bn", nb_batch_norm2d_new(ctx, dtype, channels[i], NULL));
        b->relu = nb_module_add(bm, "relu", nb_relu_new(ctx));
        nb_module_append(c->blocks, bm);
        width = channels[i];
    }
    nb_pool2d_opts two = {{2, 2}, {2, 2}, {0, 0}};
    c->pool = nb_module_add(m, "pool", nb_max_pool2d_new(ctx, &two));
    c->gap = nb_module_add(m, "gap", nb_global_avg_pool2d_new(ctx));
    c->flatten = nb_module_add(m, "flatten", nb_flatten_new(ctx, 1, -1));
    c->head = nb_module_add(m, "head", nb_linear_new(ctx, dtype, width, n_classes, true, rng));
    return m;
}
