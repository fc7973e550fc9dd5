/* Containers: Sequential (children "0", "1", ... applied in order) and
 * ModuleList (the same children, no forward). */
#include "nn/internal.h"

static nb_tensor *sequential_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    for (int i = 0; i < m->children.n; i++) x = nb_module_forward(m->children.v[i].ptr, ctx, x);
    return x;
}

static const nb_module_type sequential_type = {"Sequential", 0, sequential_forward, NULL};
static const nb_module_type list_type = {"ModuleList", 0, NULL, NULL};

nb_module *nb_sequential_new(nb_ctx *ctx, int n, nb_module *const *children) {
    NB_CHECK(n >= 0 && (n == 0 || children), "nb_sequential_new: %d children from a NULL array", n);
    nb_module *m = nb_module_new(ctx, &sequential_type);
    for (int i = 0; i < n; i++) nb_module_append(m, children[i]);
    return m;
}

nb_module *nb_module_list_new(nb_ctx *ctx) { return nb_module_new(ctx, &list_type); }
