/* The DDP reducer: buckets of gradients, gradient-ready hooks that launch
 * their all-reduce while backward runs, the end-of-backward wait and the
 * one-time bucket rebuild. The partition itself is ddp_buckets.c; the
 * checks at construction ddp_verify.c; the overlap measurements
 * ddp_stats.c.
 *
 * Note [Buckets]
 * Parameters that require grad are numbered in registration order
 * (nb_module_named_parameters). Buckets are filled in REVERSE order, since
 * backward makes the last layers' gradients ready first: the first bucket
 * closes past first_bucket_bytes (small, so communication starts early),
 * the others past bucket_cap_bytes; a bucket holds one dtype. Each bucket
 * is one flat tensor in the wrapper's context and each parameter's ->grad
 * is a view of its slice (nb_set_grad), so autograd accumulates straight
 * into communication memory: nothing is copied in or out.
 *
 * Every rank must issue the same collectives in the same order, so buckets
 * are launched strictly by index: a bucket whose parameters are all ready
 * waits for the buckets before it. After the first synchronised backward,
 * the assignment is rebuilt once from the order in which gradients became
 * ready on rank 0 (broadcast, so every rank agrees): parameters that are
 * ready together then share a bucket even when the registration order
 * differs from the execution order.
 *
 * Note [Unused parameters]
 * With find_unused_parameters, nb_ddp_backward first walks the tape from
 * the loss; parameters the walk does not reach are marked ready before
 * backward starts (their bucket slice is reduced as it is, zeros after
 * zero_grad). Without it, a parameter that never became ready is an error
 * naming it, but the remaining buckets are still launched so that the
 * other ranks' collectives complete instead of hanging.
 *
 * Note [DDP on CUDA]
 * The bucket flats are made in a context of the process group's device
 * (which every parameter is on), so on CUDA the gradients' views, the
 * all-reduce (NB_REDUCE_AVG: NCCL averages) and the bf16 hook's casts
 * (nb_copy_) all stay on the device; the host never reads gradient memory.
 * Bookkeeping tensors (the rebuilt order) live in a CPU context and cross
 * to the device only to be broadcast. Bucket times are host times: launch
 * is when the host issued the all-reduce, finish when the host observed
 * its completion event (nb_work_times), so on CUDA a bucket's finish can
 * be later than the collective really ended on the device.
 *
 * A world of one needs no buckets; NABLA_DDP_FORCE_BUCKETS=1 builds them
 * anyway (tests of the bucket machinery on one GPU: NCCL allows one rank
 * per GPU).
 *
 * Note [Per-bucket step]
 * With an optimizer attached (nb_ddp_set_optimizer), the end-of-backward
 * loop that waits for bucket b, widens and averages it, then hands b's
 * parameters to the optimizer (nb__optim_step_params) before waiting for
 * bucket b + 1: the update of b runs while the later buckets' all-reduces
 * are still in flight. The update of each parameter is elementwise and
 * reads only that parameter's gradient and state, so stepping bucket by
 * bucket gives the same bits as one nb_optim_step after the last bucket;
 * the optimizer-wide step count is added once per backward and the
 * learning rates are those set before it. The decision to step is taken
 * before the first wait: a backward that failed, or one where a parameter
 * got no gradient without find_unused_parameters, steps nothing (as a
 * user would not step after the error). A bucket whose all-reduce fails
 * stops the stepping: the buckets before it were updated, it and the
 * later ones were not, and the error says the group is broken anyway.
 * Global-norm clipping needs every gradient before the first update, the
 * grad scaler's found-inf check too, and join replays steps on ranks that
 * do not train: those combinations abort (nb__optim_check_not_bucket_stepped,
 * nb_ddp_join_begin). A no_sync backward reduces nothing and steps
 * nothing; the synchronising backward after it steps on the accumulated
 * sums. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distributed/ddp_buckets.h"
#include "distributed/ddp_internal.h"
#include "distributed/internal.h"
#include "optim/internal.h"
#include "tensor/internal.h"
#include "util/handle.h"

#define DEFAULT_FIRST_BUCKET (1u << 20)
#define DEFAULT_BUCKET_CAP (25u << 20)

double nb__ddp_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void *nb__ddp_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    NB_CHECK(p, "nb_ddp: out of memory (%zu x %zu bytes)", n, size);
    return p;
}

/* ---- tensor -> parameter index ---- */

static unsigned hash_ptr(const void *p) {
    uint64_t v = (uint64_t)(uintptr_t)p;
    v ^= v >> 33;
    v *= 0xff51afd7ed558ccdull;
    v ^= v >> 33;
    return (unsigned)v;
}

static void build_index(nb_ddp *d) {
    int cap = 16;
    while (cap < 2 * d->n) cap *= 2;
    d->slot = nb__ddp_calloc((size_t)cap, sizeof(int));
    d->slot_mask = cap - 1;
    for (int k = 0; k < cap; k++) d->slot[k] = -1;
    for (int i = 0; i < d->n; i++) {
        unsigned h = hash_ptr(d->p[i].tensor) & (unsigned)d->slot_mask;
        while (d->slot[h] >= 0) h = (h + 1) & (unsigned)d->slot_mask;
        d->slot[h] = i;
    }
}

static int param_index(const nb_ddp *d, const nb_tensor *t) {
    unsigned h = hash_ptr(t) & (unsigned)d->slot_mask;
    for (; d->slot[h] >= 0; h = (h + 1) & (unsigned)d->slot_mask)
        if (d->p[d->slot[h]].tensor == t) return d->slot[h];
    return -1;
}

/* ---- bucket assignment (Note [Buckets]) ---- */

/* Fresh buckets in a fresh context from parameter order `order`; the
 * gradients' current values move into the new memory. */
static void assign_buckets(nb_ddp *d, const int *order) {
    size_t first = d->o.first_bucket_bytes ? d->o.first_bucket_bytes : DEFAULT_FIRST_BUCKET;
    size_t cap = d->o.bucket_cap_bytes ? d->o.bucket_cap_bytes : DEFAULT_BUCKET_CAP;
    nb_ctx *old = d->ctx;
    d->ctx = nb_ctx_new(nb_pg_device(d->pg), 0);
    d->buckets = nb__ctx_meta(d->ctx, sizeof(bucket) * (size_t)(d->n ? d->n : 1));
    int *members = nb__ctx_meta(d->ctx, sizeof(int) * (size_t)(d->n ? d->n : 1));
    int64_t *numel = nb__ddp_calloc((size_t)d->n, sizeof *numel);
    nb_dtype *dtype = nb__ddp_calloc((size_t)d->n, sizeof *dtype);
    int *starts = nb__ddp_calloc((size_t)d->n + 1, sizeof *starts);
    for (int i = 0; i < d->n; i++) {
        numel[i] = nb_numel(d->p[i].tensor);
        dtype[i] = d->p[i].tensor->dtype;
    }
    int nb = nb__ddp_partition(d->n, order, numel, dtype, first, cap, starts);
    for (int bi = 0; bi < nb; bi++) {
        int start = starts[bi], end = starts[bi + 1];
        bucket *b = &d->buckets[bi];
        b->dtype = dtype[order[start]];
        b->n = end - start;
        b->params = members + start;
        b->offsets = nb__ctx_meta(d->ctx, sizeof(int64_t) * (size_t)b->n);
        for (int k = 0; k < b->n; k++) {
            int i = order[start + k];
            members[start + k] = i;
            b->offsets[k] = b->numel;
            b->numel += numel[i];
            d->bucket_of[i] = bi;
        }
    }
    free(numel);
    free(dtype);
    free(starts);
    d->n_buckets = nb;
    for (int bi = 0; bi < nb; bi++) {
        bucket *b = &d->buckets[bi];
        if (d->zopt) { /* Note [ZeRO-1] in ddp_zero.c */
            b->chunk = (b->numel + d->world - 1) / d->world;
            int64_t padded = b->chunk * d->world;
            b->flat = nb_zeros(d->ctx, b->dtype, 1, &padded);
            b->shard = nb_zeros(d->ctx, b->dtype, 1, &b->chunk);
        } else {
            b->flat = nb_zeros(d->ctx, b->dtype, 1, &b->numel);
        }
        if (d->o.comm_hook == NB_DDP_HOOK_BF16 && b->dtype != NB_BF16)
            b->wire = nb_empty(d->ctx, NB_BF16, 1, &b->numel);
        size_t esz = nb_dtype_size(b->dtype);
        for (int k = 0; k < b->n; k++) {
            nb_tensor *t = d->p[b->params[k]].tensor;
            int64_t st[NB_MAX_DIMS];
            nb__contig_strides(t->ndim, t->shape, st);
            nb_tensor *view = nb__view(d->ctx, b->flat, t->ndim, t->shape, st,
                                       (char *)b->flat->data + b->offsets[k] * (int64_t)esz);
            if (t->grad) nb_copy_(view, t->grad);
            nb_set_grad(t, view);
        }
    }
    free(d->times);
    d->times = nb__ddp_calloc((size_t)nb, sizeof(nb_ddp_bucket_time));
    nb_ctx_free(old);
}

void nb__ddp_reassign_buckets(nb_ddp *d) {
    int *order = nb__ddp_calloc((size_t)d->n, sizeof(int));
    int k = 0;
    for (int b = 0; b < d->n_buckets; b++)
        for (int j = 0; j < d->buckets[b].n; j++) order[k++] = d->buckets[b].params[j];
    assign_buckets(d, order);
    free(order);
}

/* ---- launching ---- */

static void launch(nb_ddp *d, bucket *b) {
    b->t_launch = nb__ddp_now();
    if (d->zopt) {
        nb__ddp_zero_launch(d, b);
        return;
    }
    nb_reduce_op op = nb__ddp_join_reduce_op(d); /* Note [Join] in ddp_join.c */
    if (b->wire) {
        nb_copy_(b->wire, b->flat);
        b->work = nb_pg_all_reduce(d->pg, b->wire, op);
    } else {
        b->work = nb_pg_all_reduce(d->pg, b->flat, op);
    }
}

static void launch_ready(nb_ddp *d) {
    while (d->next_launch < d->n_buckets && d->buckets[d->next_launch].pending == 0)
        launch(d, &d->buckets[d->next_launch++]);
}

static void mark_ready(nb_ddp *d, int i) {
    if (d->ready[i]) return;
    d->ready[i] = true;
    if (d->join_on && !d->join_shadow) nb__ddp_join_record_param(d, i);
    if (!d->synced_once) d->ready_order[d->n_ready] = i;
    d->n_ready++;
    d->buckets[d->bucket_of[i]].pending--;
    launch_ready(d);
}

void nb__ddp_mark_ready(nb_ddp *d, int i) { mark_ready(d, i); }

void nb__ddp_reset_ready(nb_ddp *d) {
    d->n_ready = 0;
    d->next_launch = 0;
    memset(d->ready, 0, sizeof(bool) * (size_t)d->n);
    for (int b = 0; b < d->n_buckets; b++) {
        d->buckets[b].pending = d->buckets[b].n;
        d->buckets[b].work = NULL;
    }
}

static void grad_ready_hook(nb_tensor *leaf, void *user) {
    hook_ref *r = user;
    if (r->ddp->in_backward) mark_ready(r->ddp, r->index);
}

/* ---- construction ---- */

static void free_arrays(nb_ddp *d) {
    free(d->p);
    free(d->own_grad);
    free(d->refs);
    free(d->bucket_of);
    free(d->ready);
    free(d->ready_order);
    free(d->slot);
    free(d->times);
    free(d->stat_times);
    free(d->events);
    free(d->opt_index);
    free(d->step_idx);
    free(d->pieces);
    for (int i = 0; i < d->n_trace; i++) free(d->trace[i].b);
    nb__ddp_overlap_forget(d);
}

nb_status nb_ddp_new(nb_ddp **out, nb_module *model, nb_pg *pg, const nb_ddp_options *opts) {
    NB_CHECK(out && model && pg, "nb_ddp_new: NULL argument");
    *out = NULL;
    nb_ddp *d = nb__ddp_calloc(1, sizeof *d);
    d->model = model;
    d->pg = pg;
    d->o = opts ? *opts : NB_DDP_DEFAULTS;
    d->rank = nb_pg_rank(pg);
    d->world = nb_pg_size(pg);
    int total = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *all = nb__ddp_calloc((size_t)total, sizeof *all);
    nb_module_named_parameters(model, all, total);
    d->p = nb__ddp_calloc((size_t)total, sizeof *d->p);
    for (int i = 0; i < total; i++)
        if (all[i].tensor->requires_grad) d->p[d->n++] = all[i];
    free(all);
    for (int i = 0; i < d->n; i++) {
        nb_tensor *t = d->p[i].tensor;
        NB_CHECK(nb_device_eq(t->device, nb_pg_device(pg)),
                 "nb_ddp_new: parameter %s is on %s but the process group works on %s", d->p[i].name,
                 nb_device_name(t->device), nb_device_name(nb_pg_device(pg)));
        NB_CHECK(nb_is_contiguous(t), "nb_ddp_new: parameter %s is not contiguous", d->p[i].name);
    }
    nb_status st = d->world > 1 ? nb__ddp_verify_params(d) : NB_OK;
    if (st == NB_OK && d->world > 1) st = nb__ddp_broadcast_tensors(d, false, 0);
    if (st != NB_OK) {
        free_arrays(d);
        free(d);
        return st;
    }
    const char *force = getenv("NABLA_DDP_FORCE_BUCKETS");
    d->bucketed = d->world > 1 || (force && strcmp(force, "1") == 0);
    if (d->bucketed) { /* Note [Buckets]; world size 1 needs none of it */
        d->own_grad = nb__ddp_calloc((size_t)d->n, sizeof(nb_tensor *));
        d->refs = nb__ddp_calloc((size_t)d->n, sizeof(hook_ref));
        d->bucket_of = nb__ddp_calloc((size_t)d->n, sizeof(int));
        d->ready = nb__ddp_calloc((size_t)d->n, sizeof(bool));
        d->ready_order = nb__ddp_calloc((size_t)d->n, sizeof(int));
        int *order = nb__ddp_calloc((size_t)d->n, sizeof(int));
        nb__ddp_initial_order(d->n, order);
        for (int i = 0; i < d->n; i++) {
            d->own_grad[i] = d->p[i].tensor->grad;
            d->refs[i] = (hook_ref){d, i};
            nb_add_grad_hook(d->p[i].tensor, grad_ready_hook, &d->refs[i]);
        }
        assign_buckets(d, order);
        free(order);
        build_index(d);
    }
    *out = d;
    return NB_OK;
}

void nb_ddp_free(nb_ddp *d) {
    if (!d) return;
    if (d->opt) d->opt->stepped_by = NULL;
    nb__ddp_zero_forget(d);
    nb__ddp_join_forget(d);
    for (int b = 0; b < d->n_buckets; b++)
        if (d->buckets[b].work) { /* left by a failed step */
            nb_work_finish(d->buckets[b].work);
            d->buckets[b].work = NULL;
        }
    if (d->bucketed) {
        for (int i = 0; i < d->n; i++) {
            nb_tensor *t = d->p[i].tensor;
            nb_remove_grad_hook(t, grad_ready_hook, &d->refs[i]);
            nb_tensor *own = d->own_grad[i];
            if (!own) own = nb_zeros(t->ctx, t->dtype, t->ndim, t->shape);
            nb_copy_(own, t->grad);
            nb_set_grad(t, own);
        }
    }
    nb_ctx_free(d->ctx);
    free_arrays(d);
    free(d);
}

nb_module *nb_ddp_module(nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_module", d, "DDP handle");
    return d->model;
}

/* A combination the wrapper refuses is a status, as in nb_ddp_set_zero: a
 * program may fall back to a plain step. Called inside a backward, it aborts. */
nb_status nb_ddp_set_optimizer(nb_ddp *d, nb_optim *opt) {
    NB__CHECK_HANDLE("nb_ddp_set_optimizer", d, "DDP handle");
    NB_CHECK(!d->in_backward, "nb_ddp_set_optimizer: rank %d: called inside a backward", d->rank);
    if (opt && d->join_on)
        return nb_set_error(NB_ERR_INVALID, "nb_ddp_set_optimizer: rank %d: the wrapper is in join mode "
                            "(nb_ddp_join_begin); per-bucket optimizer steps cannot be combined with join",
                            d->rank);
    if (opt && d->zopt)
        return nb_set_error(NB_ERR_INVALID, "nb_ddp_set_optimizer: rank %d: ZeRO-1 is on (nb_ddp_set_zero); "
                            "per-bucket optimizer steps cannot be combined with it", d->rank);
    if (opt && opt->sharded_by)
        return nb_set_error(NB_ERR_INVALID, "nb_ddp_set_optimizer: rank %d: this optimizer's state is sharded "
                            "by ZeRO-1 (nb_ddp_set_zero); per-bucket optimizer steps cannot be combined with it",
                            d->rank);
    if (opt && opt != d->opt && opt->stepped_by)
        return nb_set_error(NB_ERR_INVALID, "nb_ddp_set_optimizer: rank %d: this optimizer is already stepped "
                            "per bucket by another DDP wrapper", d->rank);
    if (opt && opt != d->opt) {
        int *index = nb__ddp_calloc((size_t)(d->n ? d->n : 1), sizeof(int));
        for (int i = 0; i < d->n; i++) index[i] = nb__optim_param_index(opt, d->p[i].tensor);
        int found = 0;
        for (int i = 0; i < d->n; i++) found += index[i] >= 0;
        if (found != nb_optim_param_count(opt)) {
            const char *name = "?";
            for (int j = 0; j < nb_optim_param_count(opt) && name[0] == '?'; j++) {
                bool in = false;
                for (int i = 0; i < d->n && !in; i++) in = index[i] == j;
                if (!in) name = opt->params[j].name;
            }
            free(index);
            return nb_set_error(NB_ERR_INVALID, "nb_ddp_set_optimizer: rank %d: optimizer parameter \"%s\" is "
                                "not a parameter (that requires grad) of the wrapped model; a per-bucket step "
                                "updates only the wrapper's parameters, so it would never be stepped",
                                d->rank, name);
        }
        free(d->opt_index);
        free(d->step_idx);
        d->opt_index = index;
        d->step_idx = nb__ddp_calloc((size_t)(d->n ? d->n : 1), sizeof(int));
    }
    if (d->opt && d->opt != opt) d->opt->stepped_by = NULL;
    d->opt = opt;
    if (opt) opt->stepped_by = "a DDP wrapper";
    return NB_OK;
}

nb_optim *nb_ddp_optimizer(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_optimizer", d, "DDP handle");
    return d->opt;
}

/* Steps the optimizer's parameters among params[0..n) (Note [Per-bucket step]). */
static void step_params(nb_ddp *d, const int *params, int n) {
    int k = 0;
    for (int j = 0; j < n; j++)
        if (d->opt_index[params[j]] >= 0) d->step_idx[k++] = d->opt_index[params[j]];
    if (k) nb__optim_step_params(d->opt, d->step_idx, k);
}
void nb_ddp_set_no_sync(nb_ddp *d, bool no_sync) {
    NB__CHECK_HANDLE("nb_ddp_set_no_sync", d, "DDP handle");
    d->no_sync = no_sync;
}
bool nb_ddp_buckets_rebuilt(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_buckets_rebuilt", d, "DDP handle");
    return d->rebuilt;
}
int nb_ddp_num_buckets(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_num_buckets", d, "DDP handle");
    return d->n_buckets;
}

int nb_ddp_bucket_params(const nb_ddp *d, int b, int *out, int cap) {
    NB__CHECK_HANDLE("nb_ddp_bucket_params", d, "DDP handle");
    NB_CHECK(b >= 0 && b < d->n_buckets, "nb_ddp_bucket_params: bucket %d of %d", b, d->n_buckets);
    for (int k = 0; k < d->buckets[b].n && k < cap; k++) out[k] = d->buckets[b].params[k];
    return d->buckets[b].n;
}

nb_status nb_ddp_pre_forward(nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_pre_forward", d, "DDP handle");
    d->fwd_start = nb__ddp_now();
    if (d->world == 1) return NB_OK;
    int root = 0;
    if (d->join_on) { /* Note [Join] in ddp_join.c */
        nb_status st = nb__ddp_join_count(d);
        if (st != NB_OK) return st;
        root = d->join_root;
    }
    if (!d->o.broadcast_buffers) return NB_OK;
    return nb__ddp_broadcast_tensors(d, true, root);
}

nb_status nb_ddp_forward(nb_ddp *d, nb_ctx *ctx, nb_tensor *x, nb_tensor **out) {
    NB__CHECK_HANDLE("nb_ddp_forward", d, "DDP handle");
    NB_CHECK(d && out, "nb_ddp_forward: NULL argument");
    *out = NULL;
    nb_status st = nb_ddp_pre_forward(d);
    if (st != NB_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_ddp_forward: %s failed: %s",
                            d->join_on ? "the step's count or buffer broadcast" : "broadcasting the buffers", why);
    }
    nb__dist_failure_clear();
    nb_tensor *y = nb_module_forward(d->model, ctx, x);
    st = nb__dist_failure_take(); /* Note [Failures inside a forward] in sync_batch_norm.c */
    if (st != NB_OK) {
        char why[2304];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_ddp_forward: the model's forward failed: %s", why);
    }
    *out = y;
    return NB_OK;
}

/* ---- backward ---- */

typedef struct reach {
    const nb_ddp *d;
    bool *seen;
} reach;

static void note_leaf(nb_tensor *leaf, void *user) {
    reach *r = user;
    int i = param_index(r->d, leaf);
    if (i >= 0) r->seen[i] = true;
}

/* Rank 0's ready order, broadcast, becomes every rank's bucket order;
 * parameters that were never ready go last, in reverse registration order. */
nb_status nb__ddp_rebuild_buckets(nb_ddp *d) {
    nb_ctx *tmp = nb_ctx_new(nb_cpu(), 0);
    int64_t n = d->n;
    nb_tensor *ord = nb_empty(tmp, NB_I64, 1, &n);
    int64_t *o = ord->data;
    int *mine = nb__ddp_calloc((size_t)d->n, sizeof(int));
    nb__ddp_rebuild_order(d->n, d->ready_order, d->n_ready, mine);
    for (int i = 0; i < d->n; i++) o[i] = mine[i];
    free(mine);
    nb_status st = NB_OK;
    nb_device dev = nb_pg_device(d->pg);
    int root = d->join_on ? d->join_root : 0; /* rank 0 may have joined (Note [Join]) */
    if (dev.type == NB_DEVICE_CPU) {
        st = nb_work_finish(nb_pg_broadcast(d->pg, ord, root));
    } else { /* through the device, back to the host */
        nb_ctx *dctx = nb_ctx_new(dev, 0);
        nb_tensor *dord = nb_from_host(dctx, NB_I64, 1, &n, o);
        st = nb_work_finish(nb_pg_broadcast(d->pg, dord, root));
        if (st == NB_OK) nb_to_host(dord, o);
        nb_ctx_free(dctx);
    }
    if (st == NB_OK) {
        int *order = nb__ddp_calloc((size_t)d->n, sizeof(int));
        for (int i = 0; i < d->n; i++) order[i] = (int)o[i];
        assign_buckets(d, order);
        free(order);
    }
    nb_ctx_free(tmp);
    d->rebuilt = true;
    return st;
}

/* A collective inside backward that failed (Note [Failures inside a
 * forward] in sync_batch_norm.c), as nb_ddp_backward's status. */
static nb_status backward_failure(void) {
    nb_status st = nb__dist_failure_take();
    if (st == NB_OK) return NB_OK;
    char why[2304];
    snprintf(why, sizeof why, "%s", nb_last_error());
    return nb_set_error(st, "nb_ddp_backward: the backward failed: %s", why);
}

nb_status nb_ddp_backward(nb_ddp *d, nb_tensor *loss) {
    NB__CHECK_HANDLE("nb_ddp_backward", d, "DDP handle");
    nb__dist_failure_clear();
    if (d->join_on && d->world > 1) { /* Note [Join] in ddp_join.c */
        NB_CHECK(d->join_counted,
                 "nb_ddp_backward: rank %d: after nb_ddp_join_begin, every step must start with "
                 "nb_ddp_forward or nb_ddp_pre_forward (the ranks count who still trains there)",
                 d->rank);
        NB_CHECK(d->join_sync == !d->no_sync,
                 "nb_ddp_backward: rank %d: no_sync changed between the step's forward and its "
                 "backward; after nb_ddp_join_begin set it before nb_ddp_forward", d->rank);
        d->join_counted = false;
    }
    if (!d->bucketed || d->no_sync) {
        nb_backward(loss);
        nb_status st = backward_failure();
        if (st == NB_OK && d->zopt && !d->no_sync) d->zero_fresh = true;
        if (st == NB_OK && d->opt && !d->no_sync) { /* a world of one: the whole step at once */
            int *all = nb__ddp_calloc((size_t)(d->n ? d->n : 1), sizeof(int));
            for (int i = 0; i < d->n; i++) all[i] = i;
            nb__optim_count_step(d->opt);
            step_params(d, all, d->n);
            free(all);
        }
        return st;
    }
    nb__ddp_reset_ready(d);
    d->in_backward = true;
    if (d->o.find_unused_parameters) { /* Note [Unused parameters] */
        bool *seen = nb__ddp_calloc((size_t)d->n, 1);
        reach r = {d, seen};
        nb__graph_leaves(loss, note_leaf, &r);
        for (int i = 0; i < d->n; i++)
            if (!seen[i]) mark_ready(d, i);
        free(seen);
    }
    d->bw_start = nb__ddp_now();
    nb_backward(loss);
    d->bw_end = nb__ddp_now();
    d->in_backward = false;
    char bw_why[2560] = "";
    nb_status bw_st = backward_failure();
    if (bw_st != NB_OK) snprintf(bw_why, sizeof bw_why, "%s", nb_last_error());
    /* parameters that got no gradient */
    int missing = -1, n_missing = 0;
    for (int i = 0; i < d->n; i++)
        if (!d->ready[i]) {
            if (missing < 0) missing = i;
            n_missing++;
            mark_ready(d, i); /* still reduce, so the other ranks are not left waiting */
        }
    bool stepping = d->opt && bw_st == NB_OK && (n_missing == 0 || d->o.find_unused_parameters);
    if (stepping) nb__optim_count_step(d->opt);
    nb_status st = NB_OK;
    for (int b = 0; b < d->n_buckets; b++) {
        bucket *bk = &d->buckets[b];
        nb_status s = nb_work_wait(bk->work);
        if (s != NB_OK && st == NB_OK) st = s;
        double issued = 0, started = 0, finished = 0;
        nb_work_times(bk->work, &issued, &started, &finished);
        d->times[b] = (nb_ddp_bucket_time){bk->t_launch, started, finished,
                                           (size_t)bk->numel * nb_dtype_size(bk->wire ? NB_BF16 : bk->dtype)};
        nb_work_free(bk->work);
        bk->work = NULL;
        if (s == NB_OK && bk->wire) nb_copy_(bk->flat, bk->wire);
        double div = nb__ddp_join_divisor(d);
        if (s == NB_OK && div > 0) nb_scale_(bk->flat, 1.0 / div);
        if (stepping && st == NB_OK) step_params(d, bk->params, bk->n); /* Note [Per-bucket step] */
    }
    double done = nb__ddp_now();
    if (bw_st != NB_OK) return nb_set_error(bw_st, "%s", bw_why); /* it came first */
    if (st != NB_OK) return st;
    nb__ddp_record_stats(d, done);
    if (d->zopt) d->zero_fresh = true;
    if (!d->synced_once) {
        d->synced_once = true;
        if (n_missing == 0 || d->o.find_unused_parameters) {
            if (d->zopt) d->zero_rebuild = true; /* after the step (Note [ZeRO-1] in ddp_zero.c) */
            else st = nb__ddp_rebuild_buckets(d);
        }
    }
    if (st != NB_OK) return st;
    if (n_missing && !d->o.find_unused_parameters)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_ddp_backward: parameter %s (and %d more) received no gradient in this "
                            "backward; if parts of the model are skipped in some steps, construct the "
                            "wrapper with find_unused_parameters = true, otherwise make every "
                            "parameter contribute to the loss",
                            d->p[missing].name, n_missing - 1);
    return NB_OK;
}
