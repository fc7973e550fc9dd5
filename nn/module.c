/* The module tree: creation, registration of children, parameters and
 * buffers, training mode, single-input forward, moving between devices.
 * Iteration over names is in nn/state.c, printing in nn/print.c.
 *
 * Note [Modules]
 * A module is an opaque handle plus a vtable (nb_module_type: name, size of
 * its own state, forward, describe) and a zeroed state block that the
 * module's functions reach with nb_module_self(m, &type), a checked
 * downcast. We chose this over a public header struct that user structs
 * embed: the tree's bookkeeping (lists, caches, mode) stays private and can
 * change, a wrong downcast is caught with a message instead of corrupting
 * memory, and a new module kind is two declarations (a struct, a static
 * type) with no casts. Layers whose forward takes one tensor put it in the
 * vtable, so containers (Sequential) and user code call any of them through
 * nb_module_forward; the others (losses, a user's block with a mask) expose
 * a function of their own.
 *
 * Everything lives in the context given at construction: the module
 * struct, its state, the registration arrays (grown by doubling; the old
 * array is left to the arena) and copies of the names. There is no
 * nb_module_free: freeing the context frees the model.
 *
 * Parameters and buffers are registered as tensor pointers, and the tensor
 * structs are never replaced: nb_module_to moves storage under the same
 * struct, so a layer's own `weight` field, an optimizer's list and a DDP
 * bucket all keep pointing at the live parameter. */
#include <stdlib.h>
#include <string.h>

#include "nn/internal.h"

static void *arena_copy(nb_ctx *ctx, const void *src, size_t bytes) {
    void *p = nb__ctx_meta(ctx, bytes ? bytes : 1);
    if (bytes) memcpy(p, src, bytes);
    return p;
}

static void slots_push(nb_ctx *ctx, nb__slots *s, const char *name, void *ptr) {
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 4;
        nb__slot *v = nb__ctx_meta(ctx, (size_t)cap * sizeof *v);
        if (s->n) memcpy(v, s->v, (size_t)s->n * sizeof *v);
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n].name = arena_copy(ctx, name, strlen(name) + 1);
    s->v[s->n].ptr = ptr;
    s->n++;
}

void *nb__slots_find(const nb__slots *s, const char *name, size_t len) {
    for (int i = 0; i < s->n; i++)
        if (strlen(s->v[i].name) == len && memcmp(s->v[i].name, name, len) == 0) return s->v[i].ptr;
    return NULL;
}

nb_module *nb_module_new(nb_ctx *ctx, const nb_module_type *type) {
    NB_CHECK(ctx, "nb_module_new: ctx is NULL");
    NB_CHECK(type && type->name, "nb_module_new: the module type needs a name");
    nb_module *m = nb__ctx_meta(ctx, sizeof *m);
    memset(m, 0, sizeof *m);
    m->type = type;
    m->ctx = ctx;
    m->training = true;
    m->cache_key = -1;
    if (type->self_size) {
        m->self = nb__ctx_meta(ctx, type->self_size);
        memset(m->self, 0, type->self_size);
    }
    return m;
}

void *nb_module_self(nb_module *m, const nb_module_type *type) {
    NB_CHECK(m, "nb_module_self: module is NULL (expected a %s)", type->name);
    NB_CHECK(m->type == type, "nb_module_self: the module is a %s, not a %s", m->type->name,
             type->name);
    return m->self;
}

bool nb_module_is(const nb_module *m, const nb_module_type *type) { return m && m->type == type; }
const char *nb_module_type_name(const nb_module *m) { return m->type->name; }
nb_ctx *nb_module_ctx(const nb_module *m) { return m->ctx; }

/* A new name must be valid and free in m. */
static void check_name(const char *fn, const nb_module *m, const char *name) {
    NB_CHECK(name && name[0], "%s: empty name in a %s", fn, m->type->name);
    NB_CHECK(!strchr(name, '.'), "%s: name \"%s\" contains '.' (dots separate levels of the tree)",
             fn, name);
    size_t len = strlen(name);
    const char *kind = nb__slots_find(&m->params, name, len)    ? "parameter"
                       : nb__slots_find(&m->buffers, name, len) ? "buffer"
                       : nb__slots_find(&m->children, name, len) ? "child module"
                                                                  : NULL;
    NB_CHECK(!kind, "%s: the %s already has a %s named \"%s\"", fn, m->type->name, kind, name);
}

static bool contains(const nb_module *root, const nb_module *m) {
    if (root == m) return true;
    for (int i = 0; i < root->children.n; i++)
        if (contains(root->children.v[i].ptr, m)) return true;
    return false;
}

nb_module *nb_module_add(nb_module *m, const char *name, nb_module *child) {
    NB_CHECK(child, "nb_module_add: child \"%s\" of the %s is NULL", name ? name : "",
             m->type->name);
    check_name("nb_module_add", m, name);
    NB_CHECK(!contains(child, m),
             "nb_module_add: adding the %s as \"%s\" of the %s would make a cycle",
             child->type->name, name, m->type->name);
    slots_push(m->ctx, &m->children, name, child);
    return child;
}

nb_module *nb_module_append(nb_module *m, nb_module *child) {
    char name[16];
    snprintf(name, sizeof name, "%d", m->children.n);
    return nb_module_add(m, name, child);
}

nb_tensor *nb_module_add_param(nb_module *m, const char *name, nb_tensor *t) {
    NB_CHECK(t, "nb_module_add_param: tensor \"%s\" of the %s is NULL", name ? name : "",
             m->type->name);
    check_name("nb_module_add_param", m, name);
    NB_CHECK(nb_dtype_is_float(t->dtype), "nb_module_add_param: \"%s\" has dtype %s; parameters "
             "need a float dtype", name, nb_dtype_name(t->dtype));
    NB_CHECK(!t->node, "nb_module_add_param: \"%s\" %s was made by an op; a parameter must be a "
             "leaf (make it with grad mode off, or nb_detach it)", name, nb_shape_str(t));
    nb_set_requires_grad(t, true);
    if (!t->name) nb_set_name(t, name);
    slots_push(m->ctx, &m->params, name, t);
    return t;
}

nb_tensor *nb_module_add_buffer(nb_module *m, const char *name, nb_tensor *t) {
    NB_CHECK(t, "nb_module_add_buffer: tensor \"%s\" of the %s is NULL", name ? name : "",
             m->type->name);
    check_name("nb_module_add_buffer", m, name);
    NB_CHECK(!t->requires_grad, "nb_module_add_buffer: \"%s\" %s requires grad; buffers are not "
             "trained (register it with nb_module_add_param)", name, nb_shape_str(t));
    if (!t->name) nb_set_name(t, name);
    slots_push(m->ctx, &m->buffers, name, t);
    return t;
}

/* Note [Module paths in errors]
 * A shape or dtype error inside a model names the module by its path, as
 * its parameters are named: "blocks.0.proj (Linear): input (8, 64, 256) has
 * 256 features in its last dim, the layer takes 128". A module does not
 * know its parents (one module may sit in several places of a tree), but
 * the forward calls do: nb_module_forward, the one door to every vtable
 * forward, pushes a frame naming its module on the thread's abort chain
 * (tensor/error.c) for as long as the forward runs. When something aborts,
 * the innermost frame walks the chain from the outermost forward down and
 * finds each module under the one before it (a direct child, or deeper when
 * a forward called a grandchild through a function of its own; the first
 * such path in registration order). A module not found under the previous
 * one starts the path again. The message is then prefixed with "path
 * (Type): ", and a message that already begins with "Type: " (the layers
 * say "Linear: ...") has that part replaced; errors of the module called
 * directly (an empty path) are left as they are. Only the failing path pays:
 * a forward costs two pointer writes. */
typedef struct module_frame {
    nb__abort_frame base; /* first: the chain holds &frame.base */
    nb_module *m;
} module_frame;

/* Path of `target` below `m`, appended to buf[at..]; false if not found. */
static bool find_path(const nb_module *m, const nb_module *target, char *buf, size_t size,
                      size_t at, int depth) {
    if (depth > 64) return false;
    for (int i = 0; i < m->children.n; i++) {
        const nb_module *c = m->children.v[i].ptr;
        int k = snprintf(buf + at, size - at, "%s%s", at ? "." : "", m->children.v[i].name);
        if (k < 0 || (size_t)k >= size - at) return false;
        if (c == target || find_path(c, target, buf, size, at + (size_t)k, depth + 1)) return true;
    }
    buf[at] = 0;
    return false;
}

static void module_annotate(const nb__abort_frame *f, const char *msg, char *out, size_t size) {
    const nb_module *chain[256];
    int n = 0;
    for (const nb__abort_frame *g = f; g && n < 256; g = g->up)
        if (g->annotate == module_annotate) chain[n++] = ((const module_frame *)g)->m;
    char path[NB__NAME_MAX] = "";
    size_t len = 0;
    for (int i = n - 2; i >= 0; i--) { /* chain[n - 1] is the outermost forward */
        if (chain[i] == chain[i + 1]) continue;
        if (find_path(chain[i + 1], chain[i], path, sizeof path, len, 0))
            len = strlen(path);
        else
            path[len = 0] = 0;
    }
    const char *type = chain[0]->type->name;
    size_t tl = strlen(type);
    if (!len)
        snprintf(out, size, "%s", msg);
    else if (strncmp(msg, type, tl) == 0 && msg[tl] == ':' && msg[tl + 1] == ' ')
        snprintf(out, size, "%s (%s): %s", path, type, msg + tl + 2);
    else
        snprintf(out, size, "%s (%s): %s", path, type, msg);
}

nb_tensor *nb_module_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    NB_CHECK(m, "nb_module_forward: module is NULL");
    NB_CHECK(m->type->forward, "nb_module_forward: a %s has no single-input forward; call its "
             "own forward function", m->type->name);
    NB_CHECK(x, "nb_module_forward: input to the %s is NULL", m->type->name);
    module_frame frame = {{NULL, module_annotate}, m};
    nb__abort_frame_push(&frame.base);
    nb_tensor *y = m->unit ? m->unit->forward(m, ctx, x, m->unit->user) : nb__module_forward_own(m, ctx, x);
    nb__abort_frame_pop(&frame.base);
    return y;
}

/* Note [Fused module forwards] in nn/internal.h */
bool nb__module_forward_plain(const nb_module *m) {
    return !m->unit && !(m->recompute && nb_grad_enabled());
}

nb_tensor *nb__module_forward_fused(nb_module *m, nb_ctx *ctx, nb__fused_forward_fn fn, void *arg) {
    NB_CHECK(nb__module_forward_plain(m), "nb__module_forward_fused: the %s's forward is run by a "
             "sharding unit or recomputed; call nb_module_forward", m->type->name);
    module_frame frame = {{NULL, module_annotate}, m};
    nb__abort_frame_push(&frame.base);
    nb__scope_enter(ctx);
    nb_tensor *y = fn(m, ctx, arg);
    nb__scope_exit(ctx, y);
    nb__abort_frame_pop(&frame.base);
    return y;
}

typedef struct residual_call {
    nb__residual_forward_fn fwd;
    nb_tensor *x, *r;
} residual_call;

static nb_tensor *residual_run(nb_module *m, nb_ctx *ctx, void *arg) {
    residual_call *c = arg;
    return c->fwd(m, ctx, c->x, c->r);
}

nb_tensor *nb__module_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r,
                                       nb__residual_forward_fn fwd) {
    NB_CHECK(m && x && r, "nb_module_forward: a residual branch's module, input or residual is NULL");
    if (!nb__module_forward_plain(m)) return nb_add(ctx, r, nb_module_forward(m, ctx, x));
    return nb__module_forward_fused(m, ctx, residual_run, &(residual_call){fwd, x, r});
}

nb_tensor *nb__module_forward_own(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    if (m->recompute && nb_grad_enabled()) return nb__module_forward_recompute(m, ctx, x);
    nb__scope_enter(ctx); /* Note [Memory given back] in tensor/memory.c */
    nb_tensor *y = m->type->forward(m, ctx, x);
    nb__scope_exit(ctx, y);
    return y;
}

void nb__module_set_unit(nb_module *m, const nb__unit_hook *hook) { m->unit = hook; }

void nb_module_train(nb_module *m, bool training) {
    m->training = training;
    for (int i = 0; i < m->children.n; i++) nb_module_train(m->children.v[i].ptr, training);
}

void nb_module_eval(nb_module *m) { nb_module_train(m, false); }
bool nb_module_is_training(const nb_module *m) { return m->training; }

int nb_module_num_children(const nb_module *m) { return m->children.n; }

nb_module *nb_module_child_at(const nb_module *m, int i) {
    NB_CHECK(i >= 0 && i < m->children.n, "nb_module_child_at: index %d out of range for a %s "
             "with %d children", i, m->type->name, m->children.n);
    return m->children.v[i].ptr;
}

const char *nb_module_child_name_at(const nb_module *m, int i) {
    NB_CHECK(i >= 0 && i < m->children.n, "nb_module_child_name_at: index %d out of range for a "
             "%s with %d children", i, m->type->name, m->children.n);
    return m->children.v[i].name;
}

nb_module *nb_module_child(nb_module *m, const char *path) {
    while (m && *path) {
        const char *dot = strchr(path, '.');
        size_t len = dot ? (size_t)(dot - path) : strlen(path);
        m = nb__slots_find(&m->children, path, len);
        path += len + (dot ? 1 : 0);
        if (dot && !*path) return NULL; /* trailing dot */
    }
    return m;
}

nb_tensor *nb_module_find(nb_module *m, const char *name) {
    const char *last = strrchr(name, '.');
    if (last) {
        size_t plen = (size_t)(last - name);
        char path[NB__NAME_MAX];
        if (plen == 0 || plen >= sizeof path) return NULL;
        memcpy(path, name, plen);
        path[plen] = 0;
        m = nb_module_child(m, path);
        if (!m) return NULL;
        name = last + 1;
    }
    size_t len = strlen(name);
    nb_tensor *t = nb__slots_find(&m->params, name, len);
    return t ? t : nb__slots_find(&m->buffers, name, len);
}

void nb_module_zero_grad(nb_module *m) {
    int n;
    const nb_named_tensor *p = nb__module_cached(m, NB__LIST_PARAMS, &n);
    for (int i = 0; i < n; i++) nb_zero_grad(p[i].tensor);
}

/* t's storage moves into ctx: new contiguous storage on ctx's device, the
 * values copied (through the host between devices), the struct kept. */
static void move_tensor(nb_tensor *t, nb_ctx *ctx) {
    nb_device dev = nb_ctx_device(ctx);
    nb_tensor *fresh;
    if (nb_device_eq(t->device, dev)) {
        fresh = nb_empty(ctx, t->dtype, t->ndim, t->shape);
        nb_copy_(fresh, t);
    } else {
        size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
        void *buf = malloc(bytes ? bytes : 1);
        NB_CHECK(buf, "nb_module_to: out of memory for a %zu-byte host copy of \"%s\" %s", bytes,
                 t->name ? t->name : "", nb_shape_str(t));
        nb_to_host(t, buf);
        fresh = nb_from_host(ctx, t->dtype, t->ndim, t->shape, buf);
        free(buf);
    }
    nb__values_written(NULL); /* Note [Parameter shadows] in tensor/shadow.c */
    t->device = dev;
    t->data = fresh->data;
    memcpy(t->strides, fresh->strides, sizeof t->strides);
    t->base = NULL;
    t->ctx = ctx;
    t->grad = NULL;
    t->priv->grad_home = NULL; /* Note [Gradients set to none]: the old memory is not t's */
}

nb_status nb_module_to(nb_module *m, nb_ctx *ctx) {
    NB_CHECK(m && ctx, "nb_module_to: module and context must not be NULL");
    int n;
    const nb_named_tensor *s = nb__module_cached(m, NB__LIST_STATE, &n); /* each tensor once */
    for (int i = 0; i < n; i++) {
        nb_tensor *t = s[i].tensor;
        NB_CHECK(!t->node, "nb_module_to: \"%s\" %s was made by an op; parameters and buffers "
                 "must be leaves", s[i].name, nb_shape_str(t));
        if (t->ctx != ctx) move_tensor(t, ctx);
    }
    return NB_OK;
}

void nb__nn_check_dtype(const char *fn, nb_dtype dtype) {
    NB_CHECK(dtype == NB_F32 || dtype == NB_F64,
             "%s: dtype %s; layers compute in f32 or f64 (f64 for gradient checks)", fn,
             (unsigned)dtype < NB_DTYPE_COUNT ? nb_dtype_name(dtype) : "(invalid)");
}

/* A half input may meet f32 parameters: the activations of a compute
 * dtype and their master weights (Note [Compute dtype] in tensor/context.c;
 * the ops refuse it outside such a context). */
void nb__nn_check_input_dtype(const char *layer, const nb_tensor *x, nb_dtype dtype) {
    bool half = x->dtype == NB_BF16 || x->dtype == NB_F16;
    NB_CHECK(x->dtype == dtype || (half && dtype == NB_F32), "%s: input %s is %s but the layer's parameters are %s", layer,
             nb_shape_str(x), nb_dtype_name(x->dtype), nb_dtype_name(dtype));
}
