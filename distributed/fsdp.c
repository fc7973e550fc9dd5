/* ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded over the
 * ranks (nabla/fsdp.h).
 *
 * Note [FSDP]
 * Units. The module tree is cut into units (nb_fsdp_options: the children
 * of list containers, or size-based auto-wrap); the parameters in no unit
 * are the root unit. A unit's parameters, in registration order, each at an
 * offset rounded up to 16 elements (64-byte aligned, as the flat gradients
 * are), make one flat vector of numel elements, padded to chunk * R (chunk
 * = ceil(numel / R)); rank r keeps elements [r * chunk, (r + 1) * chunk) in
 * its shard, a persistent tensor, and the shard's gradient beside it. The
 * part of a parameter that lies in the rank's chunk is a piece, the same
 * piece as ZeRO-1's (optim/sharded.h) with `data` a view of the shard: the
 * sharded optimizer (Note [Sharded optimizer]) steps the shard in place, and
 * a sharded checkpoint saves pieces whatever the stage.
 *
 * Parameters. After the shards are filled, each parameter's own memory is
 * given back to its context and the parameter gets a storage record of its
 * own marked sharded and given back, so that every op's liveness check
 * refuses it by name outside its unit (tensor/context.c). Gathering a unit
 * is one all-gather of the shards into a flat tensor of the step context
 * (kept: the library does not give it back by itself); its parameters then
 * point into it and their record is live. Releasing gives the flat back
 * (nb__give_back_now) and marks them sharded again. bf16 gathers cast the
 * shard to bf16 first and widen the gathered flat, so the parameters keep
 * their dtype and the ops their arithmetic.
 *
 * Forward and backward. A unit's forward runs through nb_module_forward's
 * unit hook (nn/internal.h): with grad mode off it is gather, forward,
 * release; with grad on it is a recomputed forward (Note [Recomputation]
 * in nn/recompute.c, nb__module_forward_recompute_ops) whose node takes the
 * unit's shard as its input in place of the parameters: before the forward
 * the unit is gathered (waiting for its prefetch) and the next unit's
 * gather launched; after it the unit is released. In backward the node's
 * function gathers the unit again (the one before it is prefetched), gives
 * each parameter a zeroed gradient view of a flat of the unit's layout,
 * runs the forward again and walks it, then launches the reduce-scatter
 * (average) of that flat into a chunk, sets ->grad back to NULL and
 * releases the parameters; the chunk is added into the shard's gradient
 * when the next unit's reduce-scatter is launched or the backward ends, and
 * the flat is given back then. Running the forward again is what makes
 * gathering again safe: tensors the first forward made from a parameter
 * (views, casts) pointed into the first gathered flat, which is gone; the
 * recomputed ones point into the second. The root unit is gathered by
 * nb_fsdp_forward and kept, its gradients go to a flat set up by
 * nb_fsdp_backward before the walk and reduce-scattered after it.
 *
 * Kept. With keep_gathered (FSDP's reshard_after_forward off) a unit stays
 * gathered from its forward to the end of its backward, and is neither
 * gathered nor run again: its forward is the ordinary one (tape on) between
 * two identity nodes whose inputs include the shard, so that the walk
 * meets them in tape order, the output's first (zeroed gradient views for
 * the parameters) and the input's last (the reduce-scatter and the
 * release). The step context then holds every unit gathered at the end of
 * the forward, as DDP holds its parameters; communication is 2/3 of the
 * default's and there is no second forward.
 *
 * Collective order. Every rank issues the same collectives in the same
 * order: gathers in forward order (a prefetch launches unit i + 1's during
 * unit i), in backward the reverse order, a unit's reduce-scatter after its
 * walk. Prefetches in flight are drained at the end of nb_fsdp_forward and
 * nb_fsdp_backward, so nothing is in flight across a reset of the step
 * context.
 *
 * Memory. Between steps a rank holds 1/R of the parameters, gradients and
 * optimizer state (nb_fsdp_state_bytes). Within a step the step context
 * holds the root unit, at most two units gathered (the current and the
 * prefetched one) and, as recomputation has it, each unit's input instead of
 * its activations; the peak is the recomputed one's plus those. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distributed/internal.h"
#include "nabla/fsdp.h"
#include "nn/internal.h"
#include "optim/sharded.h"
#include "tensor/backend.h"
#include "tensor/internal.h"
#include "util/handle.h"

enum { ALIGN_ELEMS = 16 };

typedef struct unit unit;

typedef struct param_info {
    nb_tensor *t;
    char *name;     /* malloc'd */
    int unit;
    int64_t offset; /* in the unit's flat */
    nb__mem rec;    /* its storage record while sharded (Note [FSDP]) */
    nb_tensor *whole; /* memory of its own context after nb_fsdp_gather_full, or NULL */
} param_info;

struct unit {
    nb_fsdp *f;
    int index;         /* in f->units; n_units: the root */
    nb_module *m;      /* NULL: the root */
    int *params;       /* indices into f->p (malloc'd) */
    int np;
    int64_t numel, chunk;
    nb_tensor *shard, *shard_grad; /* chunk elements, in f->ctx */
    nb_ctx *sctx;      /* the step context of what follows, and its generation */
    uint32_t sgen;
    nb_tensor *full;   /* gathered flat (chunk * R), or NULL */
    nb_tensor *wire;   /* bf16 gathered flat, until widened */
    nb_tensor *send;   /* bf16 cast of the shard, while its gather runs */
    nb_work *ag;       /* the gather in flight, or NULL (then full is ready if set) */
    bool gathered;     /* parameters point into full */
    nb_tensor *gflat;  /* the unit's gradients (chunk * R), during and after its walk */
    nb_tensor *rs_out; /* chunk: the reduce-scatter's result */
    nb_work *rs;
    bool rs_pending;   /* rs_out to be added into shard_grad */
    nb__unit_hook hook;
    nb__recompute_ops ops;
    nb_tensor *leaf;   /* the shard as the recompute node's input */
};

struct nb_fsdp {
    uint32_t magic;
    nb_pg *pg;
    int rank, world;
    nb_module *model;
    nb_fsdp_options o;
    nb_ctx *ctx;       /* shards and their gradients */
    nb_dtype dtype;
    int n;
    param_info *p;
    int n_units;
    unit *units;       /* n_units + 1: the root last */
    nb_optim *opt;
    nb__optim_shard *sh;
    int n_pieces;
    int *piece_unit;   /* per piece of sh: its unit, and its first element in the unit's chunk (malloc'd) */
    int64_t *piece_at;
    bool whole;        /* every parameter whole (nb_fsdp_gather_full) */
    nb_status status;  /* the first failure inside a forward or backward */
    char error[512];
    nb_fsdp_stats stats;
};

#define FSDP_MAGIC 0x46534450u

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    NB_CHECK(p, "nb_fsdp: out of memory (%zu x %zu bytes)", n, size);
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static nb_tensor *flat_view(nb_ctx *ctx, nb_tensor *t, int64_t start, int64_t len) {
    int64_t st = 1;
    return nb__view(ctx, t, 1, &len, &st, (char *)t->data + start * (int64_t)nb_dtype_size(t->dtype));
}

static bool live(const unit *u, const nb_tensor *t) {
    return t && u->sctx && nb__ctx_gen(u->sctx) == u->sgen && !(t->priv->mem && t->priv->mem->given_back);
}

/* ---- failures: kept until the forward or backward returns them ---- */

static void fail(nb_fsdp *f, nb_status st) {
    if (st == NB_OK || f->status != NB_OK) return;
    f->status = st;
    snprintf(f->error, sizeof f->error, "%s", nb_last_error());
}

/* Waits for w (NULL: nothing) and counts it. */
static void finish_work(nb_fsdp *f, nb_work *w) {
    if (!w) return;
    double t0 = now_s();
    nb_status st = nb_work_wait(w);
    double t1 = now_s(), issued, started, finished;
    nb_work_times(w, &issued, &started, &finished);
    f->stats.exposed_s += t1 - t0;
    if (finished > 0) f->stats.comm_s += finished - (started > 0 ? started : issued);
    nb_work_free(w);
    fail(f, st);
}

/* ---- parameters: pointed into a gathered flat, or sharded ---- */

static void param_release(param_info *pi) {
    pi->t->data = NULL;
    pi->rec.given_back = true;
    pi->t->priv->mem = &pi->rec;
}

/* The parameter's values at `data`. */
static void param_at(param_info *pi, void *data) {
    pi->t->data = data;
    pi->rec.data = data;
    pi->rec.given_back = false;
    pi->t->priv->mem = &pi->rec;
}

/* Gives back the parameters' memory from nb_fsdp_gather_full. */
static void drop_whole(nb_fsdp *f) {
    f->whole = false;
    for (int i = 0; i < f->n; i++) {
        param_info *pi = &f->p[i];
        if (!pi->whole) continue;
        nb__ctx_give_back(pi->t->ctx, pi->whole->data, (size_t)nb_numel(pi->t) * nb_dtype_size(f->dtype));
        pi->whole = NULL;
        param_release(pi);
    }
}

/* ---- gathering a unit ---- */

static nb_tensor *kept(nb_ctx *ctx, nb_dtype dt, int64_t n) {
    nb_tensor *t = nb__empty(ctx, dt, 1, &n);
    nb__keep(t);
    return t;
}

static void give(const unit *u, nb_tensor *t) {
    if (live(u, t)) nb__give_back_now(t);
}

/* Launches u's gather into ctx (nothing when it is gathered or on its way). */
static void gather_launch(unit *u, nb_ctx *ctx) {
    nb_fsdp *f = u->f;
    if (u->full && live(u, u->full)) return;
    u->full = u->wire = u->send = NULL;
    u->ag = NULL;
    u->gathered = false;
    u->sctx = ctx;
    u->sgen = nb__ctx_gen(ctx);
    if (u->np == 0) return;
    int64_t padded = u->chunk * f->world;
    bool half = f->o.bf16_gather && nb_ctx_compute_dtype(ctx) == NB_BF16 && f->dtype != NB_BF16;
    nb_dtype wd = half ? NB_BF16 : f->dtype;
    nb_tensor *dst = kept(ctx, wd, padded);
    nb_tensor *src = u->shard;
    if (half) {
        src = u->send = kept(ctx, NB_BF16, u->chunk);
        nb__run_copy(src, u->shard);
        u->wire = dst;
    }
    u->full = dst; /* with bf16: replaced by the widened flat when it arrives */
    if (f->status != NB_OK) return;
    if (f->world == 1) {
        nb__run_copy(dst, src);
    } else {
        u->ag = nb_pg_all_gather(f->pg, dst, src);
        f->stats.all_gathers++;
        f->stats.bytes += (size_t)u->chunk * nb_dtype_size(wd);
    }
}

/* Waits for u's gather and points its parameters into it. */
static void gather_wait(unit *u, nb_ctx *ctx) {
    nb_fsdp *f = u->f;
    gather_launch(u, ctx);
    if (u->gathered || u->np == 0) {
        u->gathered = true;
        return;
    }
    finish_work(f, u->ag);
    u->ag = NULL;
    if (u->wire) {
        nb_tensor *wide = kept(ctx, f->dtype, u->chunk * f->world);
        nb__run_copy(wide, u->wire);
        give(u, u->wire);
        give(u, u->send);
        u->wire = u->send = NULL;
        u->full = wide;
    }
    for (int i = 0; i < u->np; i++) {
        param_info *pi = &f->p[u->params[i]];
        param_at(pi, (char *)u->full->data + pi->offset * (int64_t)nb_dtype_size(f->dtype));
    }
    u->gathered = true;
}

/* Drops u's gathered flat (waiting for a gather still in flight). */
static void gather_release(unit *u) {
    nb_fsdp *f = u->f;
    if (u->ag) {
        finish_work(f, u->ag);
        u->ag = NULL;
    }
    for (int i = 0; i < u->np; i++) param_release(&f->p[u->params[i]]);
    give(u, u->full);
    give(u, u->wire);
    give(u, u->send);
    u->full = u->wire = u->send = NULL;
    u->gathered = false;
}

/* ---- gradients ---- */

/* Zeroed gradients in u's layout: each parameter's ->grad a view of it. */
static void grads_begin(unit *u, nb_ctx *ctx) {
    nb_fsdp *f = u->f;
    u->gflat = kept(ctx, f->dtype, u->chunk * f->world);
    nb_fill_(u->gflat, 0.0);
    for (int i = 0; i < u->np; i++) {
        param_info *pi = &f->p[u->params[i]];
        int64_t st[NB_MAX_DIMS];
        nb__contig_strides(pi->t->ndim, pi->t->shape, st);
        pi->t->grad = nb__view(ctx, u->gflat, pi->t->ndim, pi->t->shape, st,
                               (char *)u->gflat->data + pi->offset * (int64_t)nb_dtype_size(f->dtype));
    }
}

/* Adds a finished reduce-scatter into the shard's gradient. */
static void rs_finish(unit *u) {
    nb_fsdp *f = u->f;
    if (!u->rs_pending) return;
    finish_work(f, u->rs);
    u->rs = NULL;
    if (f->status == NB_OK) nb__run_binary(NB_B_ADD, u->shard_grad, u->shard_grad, u->rs_out);
    give(u, u->rs_out);
    give(u, u->gflat);
    u->rs_out = u->gflat = NULL;
    u->rs_pending = false;
}

/* Launches the reduce-scatter (average) of u's gradients. */
static void grads_end(unit *u, nb_ctx *ctx) {
    nb_fsdp *f = u->f;
    for (int i = 0; i < u->np; i++) f->p[u->params[i]].t->grad = NULL;
    u->rs_out = kept(ctx, f->dtype, u->chunk);
    u->rs_pending = true;
    if (f->status != NB_OK) return;
    if (f->world == 1) {
        nb__run_copy(u->rs_out, u->gflat);
    } else {
        u->rs = nb_pg_reduce_scatter(f->pg, u->rs_out, u->gflat, NB_REDUCE_AVG);
        f->stats.reduce_scatters++;
        f->stats.bytes += (size_t)(u->chunk * f->world) * nb_dtype_size(f->dtype);
    }
}

static void drain(nb_fsdp *f) {
    for (int i = 0; i <= f->n_units; i++) {
        unit *u = &f->units[i];
        rs_finish(u);
        if (u->ag) {
            finish_work(f, u->ag);
            u->ag = NULL;
        }
        if (i < f->n_units && !u->gathered && u->full) gather_release(u);
    }
}

/* ---- the unit hook ---- */

static void unit_before(void *user, bool backward) {
    unit *u = user;
    nb_fsdp *f = u->f;
    nb_ctx *ctx = u->sctx;
    if (backward) {
        gather_launch(u, ctx);
        if (f->o.prefetch && u->index > 0) gather_launch(&f->units[u->index - 1], ctx);
        gather_wait(u, ctx);
        grads_begin(u, ctx);
    } else {
        gather_wait(u, ctx);
        if (f->o.prefetch && u->index + 1 < f->n_units) gather_launch(&f->units[u->index + 1], ctx);
    }
}

static void unit_after(void *user, bool backward) {
    unit *u = user;
    nb_fsdp *f = u->f;
    if (backward) {
        for (int i = u->index + 1; i < f->n_units; i++) rs_finish(&f->units[i]);
        grads_end(u, u->sctx);
    }
    gather_release(u);
}

/* keep_gathered (Note [FSDP], "Kept"): the node after a unit's forward
 * (the first of its backward) gives its parameters zeroed gradients ... */
static void kept_output_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    unit *u = n->extra;
    grads_begin(u, u->sctx);
    nb__accum_grad(ctx, n->in[0], g);
}

/* ... and the node before it (the last) reduce-scatters them and releases
 * the unit. */
static void kept_input_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    unit_after(n->extra, true);
    nb__accum_grad(ctx, n->in[0], g);
}

/* x's storage under a node of its own whose inputs are x and the unit's shard. */
static nb_tensor *identity(nb_ctx *ctx, unit *u, nb_tensor *x, const char *op, nb_backward_fn bw) {
    nb_tensor *v = nb__view(ctx, x, x->ndim, x->shape, x->strides, x->data);
    nb_node *n = nb__record(ctx, op, bw, v, 2, (nb_tensor *[]){x, u->leaf});
    if (n) {
        n->extra = u;
        nb__node_reads(n, 0); /* passes the gradient on, reads no data */
    }
    return v;
}

static nb_tensor *unit_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x, void *user) {
    unit *u = user;
    if (u->f->whole) return nb__module_forward_own(m, ctx, x); /* nb_fsdp_gather_full's */
    if (!u->sctx || nb__ctx_gen(u->sctx) != u->sgen || u->sctx != ctx) {
        u->sctx = ctx; /* a new step: what the old pointers named went with the reset */
        u->sgen = nb__ctx_gen(ctx);
        u->full = u->wire = u->send = u->gflat = u->rs_out = NULL;
        u->gathered = false;
    }
    if (!nb_grad_enabled()) {
        unit_before(u, false);
        nb_tensor *y = nb__module_forward_own(m, ctx, x);
        gather_release(u);
        return y;
    }
    if (!u->f->o.keep_gathered) return nb__module_forward_recompute_ops(m, ctx, x, &u->ops);
    unit_before(u, false);
    nb_tensor *y = nb__module_forward_own(m, ctx, identity(ctx, u, x, "a sharded unit's input", kept_input_backward));
    return identity(ctx, u, y, "a sharded unit's output", kept_output_backward);
}

/* ---- construction ---- */

static bool is_list(const nb_module *m) {
    const char *t = nb_module_type_name(m);
    return strcmp(t, "ModuleList") == 0 || strcmp(t, "Sequential") == 0;
}

static int param_index(const nb_fsdp *f, const nb_tensor *t) {
    for (int i = 0; i < f->n; i++)
        if (f->p[i].t == t) return i;
    return -1;
}

/* Parameters under m (of the wrapper's) in no unit yet. */
static int64_t free_numel(nb_fsdp *f, nb_module *m) {
    int np = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *l = xcalloc((size_t)np, sizeof *l);
    nb_module_named_parameters(m, l, np);
    int64_t s = 0;
    for (int i = 0; i < np; i++) {
        int k = param_index(f, l[i].tensor);
        if (k >= 0 && f->p[k].unit < 0) s += nb_numel(l[i].tensor);
    }
    free(l);
    return s;
}

static nb_status make_unit(nb_fsdp *f, nb_module *m) {
    int np = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *l = xcalloc((size_t)np, sizeof *l);
    nb_module_named_parameters(m, l, np);
    int ui = f->n_units++;
    f->units = realloc(f->units, sizeof *f->units * (size_t)(f->n_units + 1));
    NB_CHECK(f->units, "nb_fsdp_new: out of memory");
    unit *u = &f->units[ui];
    memset(u, 0, sizeof *u);
    u->m = m;
    u->params = xcalloc((size_t)np, sizeof(int));
    for (int i = 0; i < np; i++) {
        int k = param_index(f, l[i].tensor);
        if (k < 0) continue;
        if (f->p[k].unit >= 0 && f->p[k].unit != ui) {
            free(l);
            return nb_set_error(NB_ERR_UNSUPPORTED, "nb_fsdp_new: parameter \"%s\" is shared by two units "
                                "(the %s's and an earlier one's); put the modules sharing it in one unit",
                                f->p[k].name, nb_module_type_name(m));
        }
        if (f->p[k].unit == ui) continue;
        f->p[k].unit = ui;
        u->params[u->np++] = k;
    }
    free(l);
    return NB_OK;
}

static nb_status wrap(nb_fsdp *f, nb_module *m, bool root) {
    int nc = nb_module_num_children(m);
    if (f->o.min_unit_params <= 0) {
        for (int i = 0; i < nc; i++) {
            nb_module *c = nb_module_child_at(m, i);
            nb_status st = is_list(m) && c->type->forward && free_numel(f, c) > 0 ? make_unit(f, c) : wrap(f, c, false);
            if (st != NB_OK) return st;
        }
        return NB_OK;
    }
    for (int i = 0; i < nc; i++) {
        nb_status st = wrap(f, nb_module_child_at(m, i), false);
        if (st != NB_OK) return st;
    }
    if (!root && m->type->forward && free_numel(f, m) >= f->o.min_unit_params) return make_unit(f, m);
    return NB_OK;
}

/* The part of u's parameter pi in this rank's chunk of u: len elements
 * from pi's element start, at element at of the chunk (len 0: none). */
typedef struct part {
    int64_t at, start, len;
} part;

static part rank_part(const nb_fsdp *f, const unit *u, const param_info *pi) {
    int64_t lo = (int64_t)f->rank * u->chunk, hi = lo + u->chunk;
    int64_t a = pi->offset > lo ? pi->offset : lo, e = pi->offset + nb_numel(pi->t);
    if (e > hi) e = hi;
    return a < e ? (part){a - lo, a - pi->offset, e - a} : (part){0, 0, 0};
}

static void layout(nb_fsdp *f, unit *u) {
    int64_t off = 0;
    for (int i = 0; i < u->np; i++) {
        param_info *pi = &f->p[u->params[i]];
        pi->offset = off;
        off += (nb_numel(pi->t) + ALIGN_ELEMS - 1) / ALIGN_ELEMS * ALIGN_ELEMS;
    }
    u->numel = off;
    u->chunk = (off + f->world - 1) / f->world;
    u->shard = nb_zeros(f->ctx, f->dtype, 1, &u->chunk);
    u->shard_grad = nb_zeros(f->ctx, f->dtype, 1, &u->chunk);
    u->shard->requires_grad = true;
    u->shard->grad = u->shard_grad;
    u->leaf = u->shard;
    for (int i = 0; i < u->np; i++) {
        param_info *pi = &f->p[u->params[i]];
        part q = rank_part(f, u, pi);
        if (!q.len) continue;
        nb_copy_(flat_view(f->ctx, u->shard, q.at, q.len), flat_view(f->ctx, pi->t, q.start, q.len));
        f->n_pieces++;
    }
    u->f = f;
    u->hook = (nb__unit_hook){unit_forward, u};
    u->ops = (nb__recompute_ops){unit_before, unit_after, u, 1, &u->leaf};
}

/* Every rank has as many parameters and elements as rank 0. */
static nb_status verify(nb_fsdp *f) {
    if (f->world == 1) return NB_OK;
    int64_t total = 0;
    for (int i = 0; i < f->n; i++) total += nb_numel(f->p[i].t);
    int64_t mine[4] = {f->n, total, -(int64_t)f->n, -total};
    nb_ctx *sc = nb__optim_scratch(nb_pg_device(f->pg));
    nb_tensor *v = nb_from_host(sc, NB_I64, NB_SHAPE(4), mine);
    nb_status st = nb_work_finish(nb_pg_all_reduce(f->pg, v, NB_REDUCE_MAX));
    if (st != NB_OK) return st;
    int64_t got[4];
    nb_to_host(v, got);
    if (got[0] != -got[2] || got[1] != -got[3])
        return nb_set_error(NB_ERR_MISMATCH, "nb_fsdp_new: rank %d: the ranks' models differ: between %lld "
                            "and %lld parameters requiring grad, %lld to %lld elements (this rank: %d, %lld)",
                            f->rank, (long long)-got[2], (long long)got[0], (long long)-got[3],
                            (long long)got[1], f->n, (long long)total);
    return NB_OK;
}

/* Rank 0's parameters (with_params) and buffers to every rank. */
static nb_status broadcast_all(nb_fsdp *f, bool with_params) {
    if (f->world == 1) return NB_OK;
    int np = with_params ? nb_module_named_parameters(f->model, NULL, 0) : 0;
    int nbuf = nb_module_named_buffers(f->model, NULL, 0);
    nb_named_tensor *l = xcalloc((size_t)(np + nbuf), sizeof *l);
    nb_module_named_parameters(f->model, l, np);
    nb_module_named_buffers(f->model, l + np, nbuf);
    nb_status st = NB_OK;
    for (int i = 0; i < np + nbuf && st == NB_OK; i++) st = nb_work_finish(nb_pg_broadcast(f->pg, l[i].tensor, 0));
    free(l);
    return st;
}

nb_status nb_fsdp_new(nb_fsdp **out, nb_module *model, nb_pg *pg, const nb_fsdp_options *opts) {
    NB_CHECK(out && model, "nb_fsdp_new: NULL argument");
    *out = NULL;
    nb_fsdp *f = xcalloc(1, sizeof *f);
    f->magic = FSDP_MAGIC;
    f->pg = pg;
    f->rank = pg ? nb_pg_rank(pg) : 0;
    f->world = pg ? nb_pg_size(pg) : 1;
    f->model = model;
    f->o = opts ? *opts : NB_FSDP_DEFAULTS;
    int np = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *l = xcalloc((size_t)np, sizeof *l);
    nb_module_named_parameters(model, l, np);
    f->p = xcalloc((size_t)np, sizeof *f->p);
    nb_status st = NB_OK;
    for (int i = 0; i < np; i++) {
        nb_tensor *t = l[i].tensor;
        if (!t->requires_grad || param_index(f, t) >= 0) continue;
        if (f->n == 0) f->dtype = t->dtype;
        if (st == NB_OK && (t->dtype != f->dtype || !nb_dtype_is_float(t->dtype) || !nb_is_contiguous(t) || t->base))
            st = nb_set_error(NB_ERR_UNSUPPORTED, "nb_fsdp_new: parameter \"%s\" is %s %s%s; the wrapper needs "
                              "contiguous parameters of their own memory, all of one float dtype (the first is %s)",
                              l[i].name, nb_dtype_name(t->dtype), nb_shape_str(t),
                              t->base ? ", a view" : !nb_is_contiguous(t) ? ", not contiguous" : "",
                              nb_dtype_name(f->dtype));
        param_info *pi = &f->p[f->n++];
        pi->t = t;
        pi->name = strdup(l[i].name);
        pi->unit = -1;
    }
    free(l);
    if (st == NB_OK) st = verify(f);
    if (st == NB_OK) st = broadcast_all(f, true);
    if (st == NB_OK) st = wrap(f, model, true);
    if (st != NB_OK) {
        for (int i = 0; i < f->n_units; i++) free(f->units[i].params);
        free(f->units);
        for (int i = 0; i < f->n; i++) free(f->p[i].name);
        free(f->p);
        free(f);
        return st;
    }
    /* the root unit: the parameters in no unit */
    f->units = realloc(f->units, sizeof *f->units * (size_t)(f->n_units + 1));
    NB_CHECK(f->units, "nb_fsdp_new: out of memory");
    unit *root = &f->units[f->n_units];
    memset(root, 0, sizeof *root);
    root->params = xcalloc((size_t)f->n, sizeof(int));
    for (int i = 0; i < f->n; i++)
        if (f->p[i].unit < 0) {
            f->p[i].unit = f->n_units;
            root->params[root->np++] = i;
        }
    f->ctx = nb_ctx_new(pg ? nb_pg_device(pg) : f->n ? f->p[0].t->device : nb_cpu(), 0);
    for (int i = 0; i <= f->n_units; i++) {
        f->units[i].index = i;
        layout(f, &f->units[i]);
    }
    for (int i = 0; i < f->n; i++) { /* Note [FSDP]: the parameters' own memory goes */
        param_info *pi = &f->p[i];
        nb__ctx_give_back(pi->t->ctx, pi->t->data, (size_t)nb_numel(pi->t) * nb_dtype_size(f->dtype));
        pi->rec.t = pi->t;
        pi->rec.bytes = (size_t)nb_numel(pi->t) * nb_dtype_size(f->dtype);
        pi->rec.sharded = true;
        param_release(pi);
    }
    for (int i = 0; i < f->n_units; i++) nb__module_set_unit(f->units[i].m, &f->units[i].hook);
    *out = f;
    return NB_OK;
}

void nb_fsdp_free(nb_fsdp *f) {
    if (!f) return;
    NB__CHECK_HANDLE("nb_fsdp_free", f, "FSDP handle");
    for (int i = 0; i < f->n_units; i++) nb__module_set_unit(f->units[i].m, NULL);
    for (int i = 0; i < f->n; i++) {
        param_info *pi = &f->p[i];
        if (pi->whole) { /* the parameter keeps that memory */
            pi->t->data = pi->whole->data;
            pi->t->priv->mem = pi->whole->priv->mem;
        }
    }
    if (f->opt) {
        nb__optim_shard_free(f->sh);
        nb__optim_give_back(f->opt);
    }
    free(f->piece_unit);
    free(f->piece_at);
    for (int i = 0; i <= f->n_units; i++) free(f->units[i].params);
    free(f->units);
    for (int i = 0; i < f->n; i++) free(f->p[i].name);
    free(f->p);
    nb_ctx_free(f->ctx);
    f->magic = 0;
    free(f);
}

NB__HANDLE_GETTER(nb_module *, nb_fsdp_module, nb_fsdp, f, "FSDP handle", f->model)

NB__HANDLE_GETTER(int, nb_fsdp_num_units, const nb_fsdp, f, "FSDP handle", f->n_units)

static nb_status take_status(nb_fsdp *f) {
    nb_status st = f->status;
    if (st != NB_OK) nb_set_error(st, "%s", f->error);
    return st;
}

nb_status nb_fsdp_forward(nb_fsdp *f, nb_ctx *ctx, nb_tensor *x, nb_tensor **out) {
    NB__CHECK_HANDLE("nb_fsdp_forward", f, "FSDP handle");
    NB_CHECK(ctx && x && out, "nb_fsdp_forward: NULL argument");
    *out = NULL;
    if (f->status != NB_OK) return take_status(f);
    drop_whole(f);
    unit *root = &f->units[f->n_units];
    if (root->sctx && (root->sctx != ctx || nb__ctx_gen(root->sctx) != root->sgen)) root->full = NULL;
    if (root->gathered) gather_release(root); /* an evaluation's, with no backward after it */
    for (int i = 0; i < f->n_units; i++) { /* what the units named went with the reset */
        unit *u = &f->units[i];
        u->sctx = ctx;
        u->sgen = nb__ctx_gen(ctx);
        u->full = u->wire = u->send = u->gflat = u->rs_out = NULL;
        u->gathered = false;
    }
    gather_launch(root, ctx);
    if (f->o.prefetch && f->n_units) gather_launch(&f->units[0], ctx);
    gather_wait(root, ctx);
    nb_tensor *y = nb_module_forward(f->model, ctx, x);
    drain(f);
    if (f->status != NB_OK) return take_status(f);
    *out = y;
    return NB_OK;
}

nb_status nb_fsdp_backward(nb_fsdp *f, nb_tensor *loss) {
    NB__CHECK_HANDLE("nb_fsdp_backward", f, "FSDP handle");
    NB_CHECK(loss, "nb_fsdp_backward: loss is NULL");
    unit *root = &f->units[f->n_units];
    nb_ctx *ctx = loss->ctx;
    NB_CHECK(root->np == 0 || root->gathered,
             "nb_fsdp_backward: rank %d: no nb_fsdp_forward made this loss's graph in this step", f->rank);
    for (int i = 0; i < f->n_units; i++) f->units[i].sctx = f->units[i].sctx ? f->units[i].sctx : ctx;
    if (root->np) {
        root->sctx = ctx;
        grads_begin(root, ctx);
    }
    nb_backward(loss);
    for (int i = 0; i < f->n_units; i++) rs_finish(&f->units[i]);
    if (root->np) {
        grads_end(root, ctx);
        rs_finish(root);
        gather_release(root);
    }
    drain(f);
    return take_status(f);
}

/* ---- the optimizer ---- */

/* The rank's pieces (Note [FSDP]), unit by unit, into pc (f->n_pieces of
 * them; views in ctx); each one's unit and first element in the unit's
 * chunk into unit_of and at when they are not NULL. Returns the count. */
static int rank_pieces(nb_fsdp *f, nb_ctx *ctx, nb__optim_piece *pc, int *unit_of, int64_t *at) {
    int k = 0;
    for (int ui = 0; ui <= f->n_units; ui++) {
        unit *u = &f->units[ui];
        for (int i = 0; i < u->np; i++) {
            param_info *pi = &f->p[u->params[i]];
            part q = rank_part(f, u, pi);
            if (!q.len) continue;
            NB_CHECK(k < f->n_pieces, "nb_fsdp: rank %d: more pieces than the %d counted", f->rank, f->n_pieces);
            if (unit_of) unit_of[k] = ui, at[k] = q.at;
            pc[k++] = (nb__optim_piece){pi->t, q.start, q.len, flat_view(ctx, u->shard_grad, q.at, q.len),
                                        pi->name, flat_view(ctx, u->shard, q.at, q.len)};
        }
    }
    return k;
}

nb_status nb_fsdp_set_optimizer(nb_fsdp *f, nb_optim *opt) {
    NB__CHECK_HANDLE("nb_fsdp_set_optimizer", f, "FSDP handle");
    NB_CHECK(opt, "nb_fsdp_set_optimizer: optimizer is NULL");
    if (f->opt)
        return nb_set_error(NB_ERR_INVALID, "nb_fsdp_set_optimizer: rank %d: an optimizer is attached already",
                            f->rank);
    for (int i = 0; i < nb_optim_param_count(opt); i++)
        if (param_index(f, nb__optim_param_tensor(opt, i)) < 0)
            return nb_set_error(NB_ERR_INVALID, "nb_fsdp_set_optimizer: rank %d: parameter \"%s\" of the "
                                "optimizer is not one of the wrapper's", f->rank, nb__optim_param_name(opt, i));
    nb_status st = nb__optim_take(opt, NB__OPTIM_SHARDED, "nb_fsdp_set_optimizer", f->rank);
    if (st != NB_OK) return st;
    nb__optim_piece *pc = xcalloc((size_t)f->n_pieces, sizeof *pc);
    f->piece_unit = xcalloc((size_t)f->n_pieces, sizeof *f->piece_unit);
    f->piece_at = xcalloc((size_t)f->n_pieces, sizeof *f->piece_at);
    int k = rank_pieces(f, f->ctx, pc, f->piece_unit, f->piece_at);
    f->sh = nb__optim_shard_new(opt, f->ctx, k, pc);
    free(pc);
    f->opt = opt;
    return NB_OK;
}

nb_status nb_fsdp_step(nb_fsdp *f) {
    NB__CHECK_HANDLE("nb_fsdp_step", f, "FSDP handle");
    NB_CHECK(f->opt, "nb_fsdp_step: rank %d: no optimizer attached (nb_fsdp_set_optimizer)", f->rank);
    nb__optim_shard_begin_step(f->sh);
    nb__optim_shard_step(f->sh, 0, f->n_pieces);
    for (int i = 0; i <= f->n_units; i++) nb_fill_(f->units[i].shard_grad, 0.0);
    return NB_OK;
}

nb_status nb_fsdp_clip_grad_norm(nb_fsdp *f, double max_norm, double norm_type, double *norm) {
    NB__CHECK_HANDLE("nb_fsdp_clip_grad_norm", f, "FSDP handle");
    NB_CHECK(norm, "nb_fsdp_clip_grad_norm: NULL norm");
    NB_CHECK(norm_type == 2.0 || (isinf(norm_type) && norm_type > 0),
             "nb_fsdp_clip_grad_norm: norm_type = %g; supported are 2 and INFINITY", norm_type);
    NB_CHECK(max_norm >= 0 && !isnan(max_norm), "nb_fsdp_clip_grad_norm: max_norm = %g must be >= 0", max_norm);
    *norm = NAN;
    nb_device dev = f->ctx ? nb_ctx_device(f->ctx) : nb_cpu();
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)(f->n_units + 1));
    int k = 0;
    for (int i = 0; i <= f->n_units; i++)
        if (f->units[i].chunk > 0) gl[k++] = f->units[i].shard_grad; /* padding: zeros */
    return nb__shard_clip_grad_norm(f->world > 1 ? f->pg : NULL, sc, k, gl, max_norm, norm_type,
                                    norm);
}

/* As ZeRO-1's consolidation (Note [ZeRO-1] in ddp_zero.c), per unit: each
 * moment's pieces placed in the unit's chunk layout, all-gathered, and
 * copied out of the unit's flat into the optimizer's moments. */
nb_status nb_fsdp_consolidate_optimizer(nb_fsdp *f, int root) {
    NB__CHECK_HANDLE("nb_fsdp_consolidate_optimizer", f, "FSDP handle");
    NB_CHECK(f->opt, "nb_fsdp_consolidate_optimizer: rank %d: no optimizer attached (nb_fsdp_set_optimizer)",
             f->rank);
    NB_CHECK(root >= -1 && root < f->world, "nb_fsdp_consolidate_optimizer: rank %d: root %d outside [-1, %d)",
             f->rank, root, f->world);
    if (f->status != NB_OK) return take_status(f);
    nb_optim *opt = f->opt;
    bool receive = root < 0 || root == f->rank;
    if (receive) nb__optim_alloc_state(opt);
    int K = nb__optim_moment_count(opt); /* the same on every rank */
    nb_ctx *sc = nb_ctx_new(nb_ctx_device(f->ctx), 0);
    for (int ui = 0; ui <= f->n_units && f->status == NB_OK; ui++) {
        unit *u = &f->units[ui];
        if (u->np == 0) continue;
        nb_tensor *send = nb_empty(sc, f->dtype, NB_SHAPE(u->chunk));
        nb_tensor *out = nb_empty(sc, f->dtype, NB_SHAPE(u->chunk * f->world));
        for (int k = 0; k < K && f->status == NB_OK; k++) {
            nb_fill_(send, 0);
            for (int j = 0; j < f->n_pieces; j++) {
                nb_tensor *m = f->piece_unit[j] == ui ? nb__optim_shard_moment(f->sh, j, k) : NULL;
                if (m) nb_copy_(flat_view(sc, send, f->piece_at[j], nb_numel(m)), m);
            }
            if (f->world == 1) nb_copy_(out, send);
            else finish_work(f, nb_pg_all_gather(f->pg, out, send));
            if (!receive || f->status != NB_OK) continue;
            for (int i = 0; i < u->np; i++) {
                param_info *pi = &f->p[u->params[i]];
                int oi = nb__optim_param_index(opt, pi->t);
                nb_tensor *m = oi < 0 ? NULL : nb__optim_moment(opt, oi, k);
                if (m) nb_copy_(m, nb__view(sc, out, m->ndim, m->shape, m->strides,
                                            (char *)out->data + pi->offset * (int64_t)nb_dtype_size(f->dtype)));
            }
        }
    }
    nb_ctx_free(sc);
    return take_status(f);
}

static bool is_param(void *user, const nb_tensor *t) { return param_index(user, t) >= 0; }

/* Every parameter is in a unit (the root unit holds the rest): each rank
 * gives the parameters' elements of its chunks, read from its shards, and
 * the optimizer's moments of them (Note [Sharded checkpoint] in
 * checkpoint/sharded.c). */
nb_status nb_fsdp_checkpoint_pieces(nb_fsdp *f, const nb_named_tensor *model, int n_model, nb_ctx *ctx,
                                    nb_checkpoint_piece **pieces, int *n) {
    NB__CHECK_HANDLE("nb_fsdp_checkpoint_pieces", f, "FSDP handle");
    NB_CHECK(f->opt, "nb_fsdp_checkpoint_pieces: rank %d: no optimizer attached (nb_fsdp_set_optimizer)", f->rank);
    NB_CHECK(n_model >= 0 && (n_model == 0 || model) && ctx && pieces && n,
             "nb_fsdp_checkpoint_pieces: bad arguments");
    if (f->status != NB_OK) return take_status(f);
    nb__optim_piece *pc = xcalloc((size_t)f->n_pieces + 1, sizeof *pc);
    int k = rank_pieces(f, ctx, pc, NULL, NULL); /* in nb_fsdp_set_optimizer's order */
    nb__optim_checkpoint_pieces(f->opt, f->sh, pc, k, f->rank == 0, is_param, f, model, n_model, pieces, n);
    free(pc);
    return NB_OK;
}

nb_status nb_fsdp_gather_full(nb_fsdp *f) {
    NB__CHECK_HANDLE("nb_fsdp_gather_full", f, "FSDP handle");
    if (f->status != NB_OK) return take_status(f);
    drop_whole(f);
    nb_ctx *sc = nb_ctx_new(nb_ctx_device(f->ctx), 0);
    for (int ui = 0; ui <= f->n_units && f->status == NB_OK; ui++) {
        unit *u = &f->units[ui];
        if (u->np == 0) continue;
        nb_tensor *flat = nb_empty(sc, f->dtype, NB_SHAPE(u->chunk * f->world));
        if (f->world == 1) nb_copy_(flat, u->shard);
        else finish_work(f, nb_pg_all_gather(f->pg, flat, u->shard));
        for (int i = 0; i < u->np && f->status == NB_OK; i++) {
            param_info *pi = &f->p[u->params[i]];
            pi->whole = nb__empty(pi->t->ctx, f->dtype, pi->t->ndim, pi->t->shape);
            nb__run_copy(pi->whole, nb__view(sc, flat, pi->t->ndim, pi->t->shape, pi->whole->strides,
                                             (char *)flat->data + pi->offset * (int64_t)nb_dtype_size(f->dtype)));
            param_at(pi, pi->whole->data);
        }
    }
    nb_ctx_free(sc);
    f->whole = f->status == NB_OK;
    if (f->status == NB_OK) fail(f, broadcast_all(f, false));
    return take_status(f);
}

size_t nb_fsdp_state_bytes(const nb_fsdp *f, const nb_optim *opt) {
    NB__CHECK_HANDLE("nb_fsdp_state_bytes", f, "FSDP handle");
    size_t b = 0;
    for (int i = 0; i <= f->n_units; i++) b += 2 * (size_t)f->units[i].chunk * nb_dtype_size(f->dtype);
    return b + (opt ? nb_optim_state_bytes(opt) : 0);
}

nb_fsdp_stats nb_fsdp_take_stats(nb_fsdp *f) {
    NB__CHECK_HANDLE("nb_fsdp_take_stats", f, "FSDP handle");
    nb_fsdp_stats s = f->stats;
    s.hidden_fraction = s.comm_s > 0 ? 1.0 - s.exposed_s / s.comm_s : 1.0;
    if (s.hidden_fraction < 0) s.hidden_fraction = 0;
    memset(&f->stats, 0, sizeof f->stats);
    return s;
}
