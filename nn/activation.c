/* Activation layers without parameters: ReLU, GELU (exact or tanh
 * approximation) and Tanh. */
#include "nn/internal.h"

static nb_tensor *relu_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) { return nb_relu(ctx, x); }
static nb_tensor *tanh_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) { return nb_tanh(ctx, x); }

typedef struct gelu {
    nb_gelu_approx approx;
} gelu;

static nb_tensor *gelu_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    return nb_gelu(ctx, x, ((const gelu *)m->self)->approx);
}

static void gelu_describe(nb_module *m, char *buf, size_t size) {
    snprintf(buf, size, "approximate=%s",
             ((const gelu *)m->self)->approx == NB_GELU_TANH ? "tanh" : "none");
}

static const nb_module_type relu_type = {"ReLU", 0, relu_forward, NULL};
static const nb_module_type tanh_type = {"Tanh", 0, tanh_forward, NULL};
static const nb_module_type gelu_type = {"GELU", sizeof(gelu), gelu_forward, gelu_describe};

nb_module *nb_relu_new(nb_ctx *ctx) { return nb_module_new(ctx, &relu_type); }
nb_module *nb_tanh_new(nb_ctx *ctx) { return nb_module_new(ctx, &tanh_type); }

nb_module *nb_gelu_new(nb_ctx *ctx, nb_gelu_approx approx) {
    NB_CHECK(approx == NB_GELU_EXACT || approx == NB_GELU_TANH,
             "nb_gelu_new: approx %d is neither NB_GELU_EXACT nor NB_GELU_TANH", (int)approx);
    nb_module *m = nb_module_new(ctx, &gelu_type);
    ((gelu *)m->self)->approx = approx;
    return m;
}
