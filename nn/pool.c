/* Pooling layers: MaxPool2d and AvgPool2d over the ops of the same names,
 * and global average pooling (PyTorch's AdaptiveAvgPool2d(1)) as a mean
 * over H and W that keeps them as size-1 dims. */
#include "nn/internal.h"

typedef struct pool {
    nb_pool2d_opts opts;
} pool;

static void pool_describe(nb_module *m, char *buf, size_t size) {
    const nb_pool2d_opts *o = &((const pool *)m->self)->opts;
    snprintf(buf, size, "kernel_size=(%d, %d), stride=(%d, %d), padding=(%d, %d)", o->kernel[0],
             o->kernel[1], o->stride[0] ? o->stride[0] : o->kernel[0],
             o->stride[1] ? o->stride[1] : o->kernel[1], o->padding[0], o->padding[1]);
}

static nb_tensor *max_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    return nb_max_pool2d(ctx, x, &((const pool *)m->self)->opts);
}

static nb_tensor *avg_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    return nb_avg_pool2d(ctx, x, &((const pool *)m->self)->opts);
}

/* x (N, C, H, W) -> (N, C, 1, 1) */
static nb_tensor *global_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    NB_CHECK(x->ndim == 4, "GlobalAvgPool2d: input must be 4-D (N, C, H, W), got shape %s",
             nb_shape_str(x));
    return nb_mean(ctx, x, 2, (int[]){2, 3}, true);
}

static const nb_module_type max_type = {"MaxPool2d", sizeof(pool), max_forward, pool_describe};
static const nb_module_type avg_type = {"AvgPool2d", sizeof(pool), avg_forward, pool_describe};
static const nb_module_type global_type = {"GlobalAvgPool2d", 0, global_forward, NULL};

static nb_module *pool_new(nb_ctx *ctx, const nb_module_type *type, const char *fn,
                           const nb_pool2d_opts *opts) {
    NB_CHECK(opts, "%s: opts is NULL (the kernel size is required)", fn);
    NB_CHECK(opts->kernel[0] > 0 && opts->kernel[1] > 0,
             "%s: kernel size must be positive, got (%d, %d)", fn, opts->kernel[0],
             opts->kernel[1]);
    nb_module *m = nb_module_new(ctx, type);
    ((pool *)m->self)->opts = *opts;
    return m;
}

nb_module *nb_max_pool2d_new(nb_ctx *ctx, const nb_pool2d_opts *opts) {
    return pool_new(ctx, &max_type, "nb_max_pool2d_new", opts);
}

nb_module *nb_avg_pool2d_new(nb_ctx *ctx, const nb_pool2d_opts *opts) {
    return pool_new(ctx, &avg_type, "nb_avg_pool2d_new", opts);
}

nb_module *nb_global_avg_pool2d_new(nb_ctx *ctx) { return nb_module_new(ctx, &global_type); }
