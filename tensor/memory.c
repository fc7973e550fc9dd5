/* What a step gives back before its context's reset: a record per
 * storage, the frames (module forwards, backward functions) whose
 * tensors are the library's, and the references the tape holds.
 *
 * Note [Memory given back]
 * A step context is an arena reset once per step (Note [Stale tensors] in
 * tensor/context.c); within the step it also takes memory back (Note [Free
 * ranges]), so that the peak is what backward still needs plus one
 * layer's working set, not the sum of everything the step made. In C there
 * are no reference counts a user holds, so the library gives back only
 * what it knows the user has no pointer to. The rule:
 *
 *  1. What the user's code made is the user's. A tensor made outside any
 *     module's forward (the input batch, the loss, a metric, any tensor of
 *     a program that calls the ops itself) and the tensor a module's
 *     forward returns to the user's code (the logits) live until
 *     nb_ctx_reset, as always.
 *  2. What the library made for itself is the library's: a tensor made
 *     inside nb_module_forward (or the bundled models' forwards) other than
 *     the one the outermost forward returns; what an op made and saved for
 *     its backward (a contiguous copy, a mask, mean and rstd); and what a
 *     backward function made (gradients, temporaries).
 *  3. The library's memory is given back as soon as nothing needs it:
 *     a forward temporary that no recorded op uses, when the forward that
 *     made it returns; what the tape uses (a node's inputs, output and
 *     saved tensors), after the last node using it has run its backward
 *     (never with retain_graph); a non-leaf's gradient once its node has
 *     run and no other tensor adopted it (Note [Adopted gradients]); a
 *     backward function's other allocations when it returns.
 *  4. nb_keep(t) makes t the user's (call it before nb_backward on a
 *     tensor a module made that you want to read afterwards);
 *     nb_ctx_set_give_back(ctx, false) turns the whole mechanism off for a
 *     context (every tensor lives until the reset, the behaviour before).
 *
 * Reading a tensor that was given back is reported like a stale one, by
 * nb__check_live (every op's checks, nb_item, nb_to_host, ...): the
 * message names the tensor, the op that made it and how to keep it. Under
 * AddressSanitizer the memory given back is poisoned too, so a raw read
 * through a kept data pointer is reported. Giving back changes where
 * tensors live, never what is computed: results are bitwise those with
 * the mechanism off (tests/test_memory.c checks training steps).
 *
 * Mechanics. nb__empty gives each storage a record (struct nb__mem, in the
 * metadata arena; views share their base's). A thread-local stack of
 * frames says who is making tensors: a scope (a module forward) or a
 * window (a backward function's call); a new storage in the context of
 * the innermost frame joins its list and is the library's. References:
 * a node holds one on each of its inputs, its output and its saved tensors
 * from the moment a scope that saw it being recorded closes or a backward
 * that needs it starts (nb__node_acquire, once per node), and drops them
 * after its backward ran (nb__node_release, once); a non-leaf holds one on
 * its gradient's storage (nb__set_grad). A record whose count falls to
 * zero outside any frame is given back if it is the library's. */
#include <stdlib.h>
#include <string.h>

#include "tensor/internal.h"

#define MAX_FRAMES 256

typedef struct frame {
    nb_ctx *ctx;
    bool window;   /* a backward function's call (else a module's forward) */
    nb_node *mark; /* the tape's head when a scope opened */
    nb__mem *list; /* storages made in it, newest first */
} frame;

static _Thread_local frame frames[MAX_FRAMES];
static _Thread_local int n_frames;

/* Note [Peak report]
 * nb_ctx_watch_peak(ctx) keeps the records of ctx's live storages (the
 * ones nb__empty made while ctx gives back) on a list, from the moment a
 * record is made until its storage is given back or the context reset;
 * whenever the context's live total equals its peak after an allocation
 * (nb_ctx_alloc, then again once nb__empty's record exists), it copies
 * each one's label (the op of the node that made it, else "backward" or
 * "forward"), dtype, shape and bytes, so that the last copy is the peak's
 * last moment. The bytes live then that no record holds are the kernels'
 * scratch (nb_ctx_alloc without a tensor) and the arena's rounding. A copy
 * costs O(live tensors), once per allocation that raises the peak; nothing
 * happens for a context not watched. */
typedef struct peak_row {
    const char *op;
    nb_dtype dtype;
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    size_t bytes;
    int count;
} peak_row;

static struct {
    nb_ctx *ctx;
    nb__mem *live;
    peak_row *rows;
    int n, cap;
    size_t used;
} watch;

static void live_unlink(nb__mem *m) {
    if (!watch.ctx || m->t->ctx != watch.ctx) return;
    if (m->live_prev) m->live_prev->live_next = m->live_next;
    else if (watch.live == m) watch.live = m->live_next;
    if (m->live_next) m->live_next->live_prev = m->live_prev;
    m->live_prev = m->live_next = NULL;
}

void nb_ctx_watch_peak(nb_ctx *ctx, bool on) {
    if (!on) {
        if (watch.ctx == ctx) watch.ctx = NULL, watch.live = NULL;
        return;
    }
    watch.ctx = ctx, watch.live = NULL, watch.n = 0, watch.used = 0;
}

void nb__peak_check(nb_ctx *ctx) {
    if (ctx != watch.ctx || nb_ctx_used(ctx) != nb_ctx_peak(ctx)) return;
    int n = 0;
    for (nb__mem *m = watch.live; m; m = m->live_next) n++;
    if (n > watch.cap) {
        int cap = n > 2 * watch.cap ? n : 2 * watch.cap;
        peak_row *r = realloc(watch.rows, (size_t)cap * sizeof *r);
        NB_CHECK(r, "nb_ctx_watch_peak: out of memory for %d rows", cap);
        watch.rows = r, watch.cap = cap;
    }
    watch.n = 0;
    for (nb__mem *m = watch.live; m; m = m->live_next) {
        const nb_tensor *t = m->t;
        peak_row *r = &watch.rows[watch.n++];
        r->op = t->node ? t->node->op : m->in_backward ? "backward" : "forward";
        r->dtype = t->dtype, r->ndim = t->ndim, r->bytes = m->bytes, r->count = 1;
        memcpy(r->shape, t->shape, sizeof r->shape);
    }
    watch.used = nb_ctx_used(ctx);
}

static int row_key(const void *a, const void *b) {
    const peak_row *x = a, *y = b;
    int c = strcmp(x->op, y->op);
    if (c) return c;
    if (x->dtype != y->dtype) return x->dtype < y->dtype ? -1 : 1;
    if (x->ndim != y->ndim) return x->ndim < y->ndim ? -1 : 1;
    return memcmp(x->shape, y->shape, (size_t)x->ndim * sizeof x->shape[0]);
}

static int row_bytes(const void *a, const void *b) {
    const peak_row *x = a, *y = b;
    return x->bytes != y->bytes ? (x->bytes < y->bytes ? 1 : -1) : row_key(a, b);
}

void nb_ctx_print_peak(const nb_ctx *ctx, FILE *f, int max_rows) {
    if (ctx != watch.ctx || !watch.n) {
        fprintf(f, "peak report: nothing noted (nb_ctx_watch_peak(ctx, true) before the step, "
                   "on a context that gives back)\n");
        return;
    }
    peak_row *g = malloc((size_t)watch.n * sizeof *g);
    NB_CHECK(g, "nb_ctx_print_peak: out of memory for %d rows", watch.n);
    memcpy(g, watch.rows, (size_t)watch.n * sizeof *g);
    qsort(g, (size_t)watch.n, sizeof *g, row_key);
    int k = 0;
    size_t held = 0;
    for (int i = 0; i < watch.n; i++) {
        held += g[i].bytes;
        if (k && !row_key(&g[k - 1], &g[i])) g[k - 1].bytes += g[i].bytes, g[k - 1].count++;
        else g[k++] = g[i];
    }
    qsort(g, (size_t)k, sizeof *g, row_bytes);
    fprintf(f, "peak report (%s): %.3f GiB live at the peak: %d tensors %.3f GiB, other "
               "(kernels' scratch, rounding) %.3f GiB\n",
            nb_device_name(nb_ctx_device(ctx)), watch.used / 1073741824.0, watch.n,
            held / 1073741824.0, ((double)watch.used - (double)held) / 1073741824.0);
    fprintf(f, "  %12s %6s  %-5s %-22s %s\n", "MiB", "count", "dtype", "shape", "made by");
    for (int i = 0; i < k && (max_rows <= 0 || i < max_rows); i++) {
        nb_tensor shape = {.ndim = g[i].ndim};
        memcpy(shape.shape, g[i].shape, sizeof shape.shape);
        fprintf(f, "  %12.2f %6d  %-5s %-22s %s\n", g[i].bytes / 1048576.0, g[i].count,
                nb_dtype_name(g[i].dtype), nb_shape_str(&shape), g[i].op);
    }
    if (max_rows > 0 && k > max_rows) fprintf(f, "  ... %d more groups\n", k - max_rows);
    free(g);
}

static void give_back(nb__mem *m) {
    live_unlink(m);
    m->given_back = true;
    nb__ctx_give_back(m->t->ctx, m->data, m->bytes);
}

static void push(frame *f, nb__mem *m) {
    m->next = f->list;
    f->list = m;
    m->scoped = true;
}

void nb__mem_new(nb_ctx *ctx, nb_tensor *t, size_t bytes) {
    if (!nb__ctx_gives_back(ctx)) return;
    nb__mem *m = nb__ctx_meta(ctx, sizeof *m);
    m->t = t;
    m->data = t->data;
    m->bytes = bytes;
    t->priv->mem = m;
    frame *f = n_frames ? &frames[n_frames - 1] : NULL;
    if (f && f->ctx == ctx) {
        m->library = true;
        m->in_backward = f->window;
        push(f, m);
    }
    if (ctx == watch.ctx) {
        m->live_next = watch.live;
        if (watch.live) watch.live->live_prev = m;
        watch.live = m;
        nb__peak_check(ctx);
    }
}

static void mem_hold(nb__mem *m) {
    if (m) m->refs++;
}

static void mem_drop(nb__mem *m) {
    if (!m) return;
    NB_CHECK(m->refs > 0, "nb_backward: internal error: a reference dropped twice on a %s tensor",
             nb_shape_str(m->t));
    if (--m->refs == 0 && m->library && !m->scoped && !m->given_back) give_back(m);
}

void nb__keep(nb_tensor *t) {
    if (t->priv->mem) t->priv->mem->library = false;
}

void nb__give_back_now(nb_tensor *t) {
    nb__mem *m = t->priv->mem;
    if (m && !m->given_back) give_back(m); /* a frame that closes later keeps it: not the library's */
}

void nb__mem_renew(nb_tensor *t, void *data) {
    nb__mem *m = t->priv->mem;
    if (!m) return;
    m->data = data;
    m->given_back = false;
}

void nb__mem_internal(nb_node *n, nb_tensor *t) {
    nb__mem *m = t ? t->priv->mem : NULL;
    if (!m || m->library) return;
    if (n->out && n->out->priv->mem == m) return;
    for (int i = 0; i < n->n_in; i++)
        if (n->in[i] && n->in[i]->priv->mem == m) return;
    m->library = true; /* made by the op for its backward: no user has it */
}

static void node_refs(nb_node *n, void (*fn)(nb__mem *)) {
    if (n->reads & NB__READS_OUT) fn(n->out->priv->mem);
    for (int i = 0; i < n->n_in; i++) /* Note [Inputs recomputed in backward] */
        if (n->in[i] && nb__node_reads_in(n, i)) fn(n->in[i]->priv->mem);
    for (int k = 0; k < NB_NODE_SAVED; k++)
        if (n->saved[k]) fn(n->saved[k]->priv->mem);
}

void nb__node_acquire(nb_node *n) {
    if (n->refs != NB__REFS_NONE) return;
    n->refs = NB__REFS_HELD;
    node_refs(n, mem_hold);
}

void nb__node_release(nb_node *n) {
    if (n->refs != NB__REFS_HELD) return;
    n->refs = NB__REFS_DROPPED;
    node_refs(n, mem_drop);
}

static _Thread_local const nb__mem *counting;
static _Thread_local int counted;
static void count_ref(nb__mem *m) { counted += m && m == counting; }

nb_tensor *nb__reuse_for_grad(nb_ctx *ctx, nb_node *n, nb_tensor *t) {
    nb__mem *m = t->priv->mem;
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    if (!m || !m->library || m->scoped || m->given_back || n->refs != NB__REFS_HELD ||
        m->t->ctx != ctx || !nb_is_contiguous(t) || t->data != m->data || bytes != m->bytes)
        return NULL;
    counting = m, counted = 0;
    node_refs(n, count_ref);
    counting = NULL;
    if (m->refs != counted) return NULL; /* some other node still reads it */
    nb_tensor *g = nb__view(ctx, t, t->ndim, t->shape, t->strides, t->data);
    g->base = NULL;
    g->priv->mem = NULL;
    g->requires_grad = false;
    g->node = NULL;
    live_unlink(m);
    nb__mem_new(ctx, g, bytes); /* the storage's new record: the gradient's */
    m->given_back = true;       /* t is refused from now on; its range goes with g's */
    return g;
}

bool nb__overwritable(nb_ctx *ctx, const nb_tensor *t) {
    nb__mem *m = t->priv->mem;
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    if (!m || !m->library || !m->scoped || m->given_back || m->t->ctx != ctx ||
        !nb_is_contiguous(t) || t->data != m->data || bytes != m->bytes)
        return false;
    counting = m, counted = 0;
    for (nb_node *n = nb__ctx_tape(ctx); n; n = n->prev) node_refs(n, count_ref);
    counting = NULL;
    return counted == 0;
}

void nb__set_grad(nb_tensor *t, nb_tensor *g) {
    nb__mem *old = t->priv->grad_held && t->grad ? t->grad->priv->mem : NULL;
    t->grad = g;
    t->priv->grad_held = g && g->priv->mem;
    if (t->priv->grad_held) mem_hold(g->priv->mem);
    mem_drop(old);
}

bool nb__grad_sole_holder(const nb_tensor *t) {
    const nb__mem *m = t->priv->grad_held && t->grad ? t->grad->priv->mem : NULL;
    return m && m->library && !m->given_back && m->refs == 1;
}

void nb__drop_grad(nb_tensor *t) {
    if (!t->priv->grad_held) return;
    t->priv->grad_held = false;
    mem_drop(t->grad->priv->mem);
}

static void open_frame(nb_ctx *ctx, bool window) {
    NB_CHECK(n_frames < MAX_FRAMES, "nb_module_forward: modules nested more than %d deep",
             MAX_FRAMES);
    frames[n_frames++] = (frame){ctx, window, nb__ctx_tape(ctx), NULL};
}

/* The frame's survivors move to the frame below, or leave frames. */
static void close_frame(frame *f, bool (*survives)(const nb__mem *m, const nb__mem *ret),
                        const nb__mem *ret) {
    frame *parent = n_frames > 1 ? &frames[n_frames - 2] : NULL;
    for (nb__mem *m = f->list, *next; m; m = next) {
        next = m->next;
        m->next = NULL;
        m->scoped = false;
        if (m->given_back) continue; /* given back early (nb__give_back_now) */
        if (!survives(m, ret)) give_back(m);
        /* Under a window (a recomputed forward inside a backward function:
         * Note [Recomputation]) only what nothing references waits for the
         * window's end; the rest goes as the inner walk drops it. */
        else if (parent && parent->ctx == f->ctx && (!parent->window || m->refs == 0)) push(parent, m);
        else if (m == ret && !f->window) m->library = false; /* rule 1: the user's now */
    }
    n_frames--;
}

static bool scope_survivor(const nb__mem *m, const nb__mem *ret) {
    return m == ret || m->refs > 0 || !m->library;
}

void nb__scope_enter(nb_ctx *ctx) { open_frame(ctx, false); }

void nb__scope_exit(nb_ctx *ctx, nb_tensor *ret) {
    NB_CHECK(n_frames > 0 && !frames[n_frames - 1].window && frames[n_frames - 1].ctx == ctx,
             "nb_module_forward: internal error: unbalanced forward scopes");
    frame *f = &frames[n_frames - 1];
    for (nb_node *n = nb__ctx_tape(ctx); n && n != f->mark; n = n->prev) nb__node_acquire(n);
    close_frame(f, scope_survivor, ret ? ret->priv->mem : NULL);
}

void nb__window_open(nb_ctx *ctx) { open_frame(ctx, true); }

static bool window_survivor(const nb__mem *m, const nb__mem *ret) {
    (void)ret;
    return m->refs > 0 || !m->library;
}

void nb__window_close(void) {
    NB_CHECK(n_frames > 0 && frames[n_frames - 1].window,
             "nb_backward: internal error: unbalanced backward windows");
    close_frame(&frames[n_frames - 1], window_survivor, NULL);
}

/* A forward or backward left by a longjmp (an abort handler that returns
 * to the caller, as the test suites install) leaves its frame behind; the
 * context's reset or free forgets it, so that the next step's tensors do
 * not join a list nothing will close. */
void nb__frames_forget(const nb_ctx *ctx) {
    if (ctx == watch.ctx) watch.live = NULL; /* a reset: the records go with the step */
    int k = 0;
    for (int i = 0; i < n_frames; i++)
        if (frames[i].ctx != ctx) frames[k++] = frames[i];
    n_frames = k;
}
