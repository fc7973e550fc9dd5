/* Dotted names: the flattened (name, tensor) lists of a module tree for
 * its parameters, its buffers and its whole state, and parameter counts.
 *
 * The lists are built once and cached in the module they were asked of,
 * names relative to it. Registration only ever adds, so the number of
 * registrations in the subtree (counted with a cheap walk at each call)
 * changes exactly when the lists may have; a stale cache is rebuilt and
 * the old one left to the context's arena. Tied tensors are kept under
 * their first name (compared by tensor pointer). */
#include <string.h>

#include "nn/internal.h"

static int64_t subtree_key(const nb_module *m) {
    int64_t k = m->params.n + m->buffers.n + m->children.n;
    for (int i = 0; i < m->children.n; i++) k += subtree_key(m->children.v[i].ptr);
    return k;
}

typedef struct builder {
    nb_ctx *ctx;
    nb_named_tensor *lists[NB__LIST_COUNT];
    int n[NB__LIST_COUNT], cap;
    char name[NB__NAME_MAX];
} builder;

static int64_t subtree_entries(const nb_module *m) {
    int64_t k = m->params.n + m->buffers.n;
    for (int i = 0; i < m->children.n; i++) k += subtree_entries(m->children.v[i].ptr);
    return k;
}

static bool listed(const nb_named_tensor *list, int n, const nb_tensor *t) {
    for (int i = 0; i < n; i++)
        if (list[i].tensor == t) return true;
    return false;
}

static void add(builder *b, nb__list which, size_t prefix_len, const nb__slot *s) {
    nb_tensor *t = s->ptr;
    if (listed(b->lists[which], b->n[which], t)) return;
    size_t len = strlen(s->name);
    NB_CHECK(prefix_len + len < sizeof b->name, "nb_module: the name %.*s%s is longer than %d bytes",
             (int)prefix_len, b->name, s->name, NB__NAME_MAX - 1);
    memcpy(b->name + prefix_len, s->name, len + 1);
    char *copy = nb__ctx_meta(b->ctx, prefix_len + len + 1);
    memcpy(copy, b->name, prefix_len + len + 1);
    b->lists[which][b->n[which]++] = (nb_named_tensor){copy, t};
}

/* b->name holds the prefix ("blocks.0.") of m, prefix_len bytes. */
static void visit(builder *b, const nb_module *m, size_t prefix_len) {
    for (int i = 0; i < m->params.n; i++) {
        add(b, NB__LIST_PARAMS, prefix_len, &m->params.v[i]);
        add(b, NB__LIST_STATE, prefix_len, &m->params.v[i]);
    }
    for (int i = 0; i < m->buffers.n; i++) {
        add(b, NB__LIST_BUFFERS, prefix_len, &m->buffers.v[i]);
        add(b, NB__LIST_STATE, prefix_len, &m->buffers.v[i]);
    }
    for (int i = 0; i < m->children.n; i++) {
        const nb__slot *c = &m->children.v[i];
        size_t len = strlen(c->name);
        NB_CHECK(prefix_len + len + 1 < sizeof b->name,
                 "nb_module: the name %.*s%s. is longer than %d bytes", (int)prefix_len, b->name,
                 c->name, NB__NAME_MAX - 1);
        memcpy(b->name + prefix_len, c->name, len);
        b->name[prefix_len + len] = '.';
        visit(b, c->ptr, prefix_len + len + 1);
    }
}

const nb_named_tensor *nb__module_cached(nb_module *m, nb__list which, int *n) {
    int64_t key = subtree_key(m);
    if (key != m->cache_key) {
        int64_t cap = subtree_entries(m);
        NB_CHECK(cap < (1 << 30), "nb_module: %lld parameters and buffers are too many",
                 (long long)cap);
        builder b = {.ctx = m->ctx};
        for (int k = 0; k < NB__LIST_COUNT; k++)
            b.lists[k] = nb__ctx_meta(m->ctx, (size_t)(cap ? cap : 1) * sizeof(nb_named_tensor));
        visit(&b, m, 0);
        for (int k = 0; k < NB__LIST_COUNT; k++) {
            m->cache[k] = b.lists[k];
            m->cache_n[k] = b.n[k];
        }
        m->cache_key = key;
    }
    *n = m->cache_n[which];
    return m->cache[which];
}

static int copy_out(nb_module *m, nb__list which, nb_named_tensor *out, int cap, const char *fn) {
    NB_CHECK(m, "%s: module is NULL", fn);
    NB_CHECK(cap >= 0 && (out || cap == 0), "%s: out is NULL with cap %d", fn, cap);
    int n;
    const nb_named_tensor *list = nb__module_cached(m, which, &n);
    if (cap > 0 && n > 0) memcpy(out, list, (size_t)(n < cap ? n : cap) * sizeof *out);
    return n;
}

int nb_module_named_parameters(nb_module *m, nb_named_tensor *out, int cap) {
    return copy_out(m, NB__LIST_PARAMS, out, cap, "nb_module_named_parameters");
}

int nb_module_named_buffers(nb_module *m, nb_named_tensor *out, int cap) {
    return copy_out(m, NB__LIST_BUFFERS, out, cap, "nb_module_named_buffers");
}

int nb_module_state(nb_module *m, nb_named_tensor *out, int cap) {
    return copy_out(m, NB__LIST_STATE, out, cap, "nb_module_state");
}

int64_t nb_module_num_params(nb_module *m) {
    int n;
    const nb_named_tensor *p = nb__module_cached(m, NB__LIST_PARAMS, &n);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += nb_numel(p[i].tensor);
    return total;
}
