/* Flatten: nb_flatten(x, start_dim, end_dim) as a layer (PyTorch's
 * defaults are start_dim 1, end_dim -1: keep the batch dim). */
#include "nn/internal.h"

typedef struct flatten {
    int start, end;
} flatten;

static void flatten_describe(nb_module *m, char *buf, size_t size) {
    const flatten *f = m->self;
    snprintf(buf, size, "start_dim=%d, end_dim=%d", f->start, f->end);
}

static nb_tensor *flatten_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const flatten *f = m->self;
    return nb_flatten(ctx, x, f->start, f->end);
}

static const nb_module_type flatten_type = {"Flatten", sizeof(flatten), flatten_forward,
                                            flatten_describe};

nb_module *nb_flatten_new(nb_ctx *ctx, int start_dim, int end_dim) {
    nb_module *m = nb_module_new(ctx, &flatten_type);
    flatten *f = m->self;
    f->start = start_dim;
    f->end = end_dim;
    return m;
}
