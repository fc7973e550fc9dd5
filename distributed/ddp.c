/* The DDP reducer: buckets of gradients, gradient-ready hooks that launch
 * their collective while backward runs, the end-of-backward wait and the
 * one-time bucket rebuild, and the hook points through which the features
 * attach (Note [DDP hook points]). The partition itself is
 * ddp_buckets.c; the checks at construction ddp_verify.c; the
 * construction with the features the options ask for ddp_wrapper.c.
 *
 * Note [Buckets]
 * Parameters that require grad are numbered in registration order
 * (nb_module_named_parameters). Buckets are filled in REVERSE order, since
 * backward makes the last layers' gradients ready first: the first bucket
 * closes past first_bucket_bytes (small, so communication starts early),
 * the others past bucket_cap_bytes (by default a sixteenth of the
 * gradients' bytes, within 256 KiB-25 MiB: Note [Default bucket cap] in
 * ddp_buckets.c); a bucket holds one dtype. Each bucket
 * is one flat tensor, in a context of its own (so that ZeRO-2 can give it
 * back between steps), and each parameter's ->grad is a view of its slice
 * (nb_set_grad), so autograd accumulates straight into communication
 * memory: nothing is copied in or out.
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
 * zero_grad; after nb_optim_zero_grad_to_none the slice of a gradient
 * still NULL is zeroed then, as the collective reads every slice).
 * Without it, a parameter that never became ready is an error naming it,
 * but the remaining buckets are still launched so that the other ranks'
 * collectives complete instead of hanging.
 *
 * A gradient set to none that gets nothing on ANY rank must stay NULL, as
 * PyTorch's reducer leaves a globally unused parameter's grad untouched
 * (None stays None): otherwise the averaged zeros it gets would make the
 * optimizer step it (AdamW's weight decay, the moments' decay). So each
 * rank records which parameters were marked ready with a NULL gradient
 * (none_unused: set to none, and nothing came this backward, neither in
 * it nor in an earlier no_sync backward), and once every bucket is
 * launched, after the walk's and backward's readies and the missing
 * ones, issues one more collective: the sum over the ranks of an i32 map,
 * 1 where the rank holds a gradient (computed, accumulated, or the zeros
 * nb_optim_zero_grad left) and 0 where it does not (PyTorch's
 * local_used_map, all-reduced only with find_unused_parameters). Every
 * rank issues it at the same place in its sequence: after the last
 * bucket's launch, before any bucket's wait (a joined rank shadows it
 * with zeros, Note [Join] in ddp_join.c). The end-of-backward loop waits
 * for it only at the first bucket holding a none_unused parameter, so a
 * step without one keeps its overlap (the per-bucket step still steps
 * bucket by bucket), and then gives each none_unused parameter whose sum
 * is 0 its NULL gradient back (nb__grad_set_none: the bucket view stays
 * its home, whose zeros nothing reads, since the next backward's first
 * contribution writes it and an unused parameter's slice is zeroed again
 * before its collective) before the bucket's grads_final, so a feature
 * stepping there sees the NULL too. A parameter with a gradient on some
 * rank gets the average as before (rank r's gradient / world where only
 * r used it). A parameter that never had a gradient is none from the
 * wrapper on (make_grads), so this holds from the first step, with
 * nb_optim_zero_grad too (which zeroes gradients and leaves NULL ones
 * NULL, as PyTorch's zero_grad(set_to_none=False) does): a parameter no
 * rank ever uses is never stepped, as in one process without DDP. With
 * nb_optim_zero_grad and gradients that exist, the map is all ones and
 * nothing changes but the collective.
 *
 * Note [DDP on CUDA]
 * The bucket flats are made in a context of the process group's device
 * (which every parameter is on), so on CUDA the gradients' views, the
 * all-reduce (NB_REDUCE_AVG: NCCL averages) and the bf16 hook's casts
 * (nb_copy_, ddp_wire.c) all stay on the device; the host never reads gradient memory.
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
 * Note [DDP hook points]
 * The reducer owns the parameters, the buckets, the gradient-ready hooks,
 * the launch order and the wait; each feature owns its state in its own
 * file and attaches a table of hooks (nb__ddp_hooks in ddp_reducer.h) into
 * its slot: the statistics and trace (ddp_stats.c) and the overlap record
 * (ddp_overlap.c) at construction when bucketed, the bf16 wire format
 * (ddp_wire.c) with comm_hook NB_DDP_HOOK_BF16 (all three by
 * ddp_wrapper.c), join from nb_ddp_join_begin to the end of nb_ddp_join,
 * ZeRO-1 from nb_ddp_set_zero, the per-bucket step from
 * nb_ddp_set_optimizer. Dependencies point one way: features call the
 * reducer's API (ddp_reducer.h) and read its fields; the reducer calls no
 * feature by name and has no branch for one, as c10d's Reducer meets its
 * communication hook, Timer and Logger. A step through the hook points:
 *   nb_ddp_pre_forward   before_forward (join's count), then the buffer
 *                        broadcast from d->root
 *   nb_ddp_backward      backward_begin (join's checks); on_ready per
 *                        parameter (join's record); per bucket, in index
 *                        order, the communication hook's launch (ZeRO-1's
 *                        reduce-scatter, the bf16 all-reduce) or the
 *                        default all-reduce with d->op; after backward
 *                        sync_begin, then per bucket the wait, the hook's
 *                        finish (bf16 widened back), the division by
 *                        d->divisor (join) and grads_final (the per-bucket
 *                        step); then sync_end (statistics, trace, overlap
 *                        record, ZeRO-1's fresh gradients) and the one-time
 *                        rebuild unless take_rebuild claims it (ZeRO-1
 *                        rebuilds after its step)
 *   new buckets          flat_numel (ZeRO-1's padding), buckets_made
 *   nb_ddp_free          free
 * Without buckets (a world of one) nb_ddp_backward is nb_backward followed
 * by sync_begin, grads_final over every parameter and sync_end. Features
 * that cannot be combined are pairs in one table (Note [Feature conflicts]
 * in ddp_reducer.h), checked by nb__ddp_check_conflicts when a feature is
 * switched on; the reducer refuses a second communication hook. Slots are called in
 * their enum order at each point.
 *
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distributed/ddp_buckets.h"
#include "distributed/ddp_reducer.h"
#include "distributed/internal.h"
#include "tensor/internal.h"
#include "util/handle.h"

/* Calls hook point `point` of every attached table that has it, in slot order. */
#define EACH_HOOK(d, point, ...)                                  \
    for (int f_ = 0; f_ < NB__DDP_FEATURES; f_++)                 \
        if ((d)->feat[f_].h && (d)->feat[f_].h->point)            \
            (d)->feat[f_].h->point((d), (d)->feat[f_].self, __VA_ARGS__)

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

/* ---- the default communication hook ---- */

static nb_work *allreduce_launch(nb_ddp *d, void *self, int b, nb_reduce_op op, size_t *bytes) {
    (void)self;
    bucket *bk = &d->buckets[b];
    *bytes = (size_t)bk->numel * nb_dtype_size(bk->dtype);
    return nb_pg_all_reduce(d->pg, bk->flat, op);
}

static const nb__ddp_hooks allreduce_hook = {.name = "all-reduce", .collective = "all-reduce",
                                             .launch = allreduce_launch};

/* ---- features ---- */

void nb__ddp_attach(nb_ddp *d, nb__ddp_feature f, const nb__ddp_hooks *h, void *self) {
    NB_CHECK(f >= 0 && f < NB__DDP_FEATURES && h, "nb__ddp_attach: slot %d", (int)f);
    NB_CHECK(!d->feat[f].h, "nb_ddp: rank %d: %s is attached already", d->rank, h->name);
    if (h->launch) {
        NB_CHECK(d->comm == &allreduce_hook, "nb_ddp: rank %d: %s and %s both replace the bucket collective",
                 d->rank, d->comm->name, h->name);
        NB_CHECK(!d->in_backward, "nb_ddp: rank %d: %s attached inside a backward", d->rank, h->name);
        d->comm = h;
        d->comm_self = self;
    }
    d->feat[f].h = h;
    d->feat[f].self = self;
}

void nb__ddp_detach(nb_ddp *d, nb__ddp_feature f) {
    if (!d->feat[f].h) return;
    if (d->comm == d->feat[f].h) {
        d->comm = &allreduce_hook;
        d->comm_self = NULL;
    }
    d->feat[f].h = NULL;
    d->feat[f].self = NULL;
}

nb_status nb__ddp_check_conflicts(const nb_ddp *d, nb__ddp_feature f, const char *who) {
    static const char *const what[] = {
#define FEATURE_WHAT(slot, text) text,
        NB__DDP_FEATURE_LIST(FEATURE_WHAT)
#undef FEATURE_WHAT
    };
    static const struct {
        nb__ddp_feature a, b;
        const char *why;
    } pairs[] = {
#define CONFLICT_PAIR(a, b, why) {a, b, why},
        NB__DDP_CONFLICT_LIST(CONFLICT_PAIR)
#undef CONFLICT_PAIR
    };
    _Static_assert(sizeof what / sizeof *what == NB__DDP_FEATURES, "one description per feature");
    for (size_t k = 0; k < sizeof pairs / sizeof *pairs; k++) {
        nb__ddp_feature other = pairs[k].a == f ? pairs[k].b : pairs[k].b == f ? pairs[k].a : f;
        if (other != f && d->feat[other].h)
            return nb_set_error(NB_ERR_INVALID, "%s: rank %d: %s cannot be combined with %s, which is on: %s",
                                who, d->rank, what[f], what[other], pairs[k].why);
    }
    return NB_OK;
}

void *nb__ddp_state(const nb_ddp *d, nb__ddp_feature f) { return d->feat[f].h ? d->feat[f].self : NULL; }

const char *nb__ddp_collective(const nb_ddp *d) { return d->comm->collective; }

void nb__ddp_set_reduction(nb_ddp *d, nb_reduce_op op, double divisor, int root) {
    d->op = op;
    d->divisor = divisor;
    d->root = root;
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

/* b's flat (padded as the communication hook asks) in a context of its
 * own, with each parameter's ->grad a view of its slice holding the
 * gradient's current value. A parameter without a gradient (NULL: none
 * yet, set to none, or given back, Note [Gradients set to none] in
 * autograd/backward.c) stays without one, the view its new home: neither
 * the wrapper nor the bucket rebuild at the end of the first backward may
 * give a parameter that no rank used (Note [Unused parameters]) zeros to
 * step on, which a process without DDP never has. */
static void make_grads(nb_ddp *d, bucket *b) {
    int64_t len = d->comm->flat_numel ? d->comm->flat_numel(d, d->comm_self, b->numel) : b->numel;
    b->gctx = nb_ctx_new(nb_pg_device(d->pg), 0);
    b->flat = nb_zeros(b->gctx, b->dtype, 1, &len);
    size_t esz = nb_dtype_size(b->dtype);
    for (int k = 0; k < b->n; k++) {
        nb_tensor *t = d->p[b->params[k]].tensor;
        int64_t st[NB_MAX_DIMS];
        nb__contig_strides(t->ndim, t->shape, st);
        nb_tensor *view = nb__view(b->gctx, b->flat, t->ndim, t->shape, st,
                                   (char *)b->flat->data + b->offsets[k] * (int64_t)esz);
        bool none = !t->grad;
        if (t->grad) nb_copy_(view, t->grad);
        nb_set_grad(t, view);
        if (none) nb__grad_set_none(t);
    }
}

void nb__ddp_drop_bucket_grads(nb_ddp *d, int bi) {
    bucket *b = &d->buckets[bi];
    if (!b->gctx) return;
    for (int k = 0; k < b->n; k++) nb_set_grad(d->p[b->params[k]].tensor, NULL);
    nb_ctx_free(b->gctx);
    b->gctx = NULL;
    b->flat = NULL;
}

void nb__ddp_make_bucket_grads(nb_ddp *d, int bi) {
    if (!d->buckets[bi].gctx) make_grads(d, &d->buckets[bi]);
}

/* Fresh buckets in a fresh context from parameter order `order`; the
 * gradients' current values move into the new memory. */
static void assign_buckets(nb_ddp *d, const int *order) {
    size_t first = d->o.first_bucket_bytes ? d->o.first_bucket_bytes : nb__ddp_default_first();
    size_t cap = d->o.bucket_cap_bytes, grad_bytes = 0;
    for (int i = 0; !cap && i < d->n; i++)
        grad_bytes += (size_t)nb_numel(d->p[i].tensor) * nb_dtype_size(d->p[i].tensor->dtype);
    if (!cap) cap = nb__ddp_default_cap(grad_bytes); /* Note [Default bucket cap] in ddp_buckets.c */
    nb_ctx *old = d->ctx;
    bucket *old_buckets = d->buckets;
    int old_n = d->n_buckets;
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
    for (int bi = 0; bi < nb; bi++) make_grads(d, &d->buckets[bi]);
    for (int bi = 0; bi < old_n; bi++) nb_ctx_free(old_buckets[bi].gctx); /* after the copies */
    free(d->times);
    d->times = nb__ddp_calloc((size_t)nb, sizeof(nb_ddp_bucket_time));
    for (int f = 0; f < NB__DDP_FEATURES; f++)
        if (d->feat[f].h && d->feat[f].h->buckets_made) d->feat[f].h->buckets_made(d, d->feat[f].self);
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

static void launch_ready(nb_ddp *d) {
    while (d->next_launch < d->n_buckets && d->buckets[d->next_launch].pending == 0) {
        bucket *b = &d->buckets[d->next_launch];
        b->t_launch = nb__ddp_now();
        b->work = d->comm->launch(d, d->comm_self, d->next_launch++, d->op, &b->bytes);
    }
}

void nb__ddp_mark_ready(nb_ddp *d, int i) {
    if (d->ready[i]) return;
    d->ready[i] = true;
    /* set to none and unused so far (Note [Gradients set to none] in
     * autograd/backward.c): the bucket's collective reads its slice; it
     * goes back to NULL if no rank used it (Note [Unused parameters]) */
    d->none_unused[i] = d->p[i].tensor->grad == NULL;
    nb__grad_zero_fill_none(d->p[i].tensor);
    EACH_HOOK(d, on_ready, i);
    if (!d->synced_once) d->ready_order[d->n_ready] = i;
    d->n_ready++;
    d->buckets[d->bucket_of[i]].pending--;
    launch_ready(d);
}

void nb__ddp_reset_ready(nb_ddp *d) {
    d->n_ready = 0;
    d->next_launch = 0;
    memset(d->ready, 0, sizeof(bool) * (size_t)d->n);
    memset(d->none_unused, 0, sizeof(bool) * (size_t)d->n);
    d->used_st = NB_OK;
    for (int b = 0; b < d->n_buckets; b++) {
        d->buckets[b].pending = d->buckets[b].n;
        d->buckets[b].work = NULL;
    }
}

/* Waits for bucket b's collective and lets the communication hook complete
 * it (Note [Two-stage communication hooks]); the first failure. */
static nb_status finish_bucket(nb_ddp *d, int b, bool keep, double *started, double *finished) {
    bucket *bk = &d->buckets[b];
    nb_status st = NB_OK;
    *started = *finished = 0;
    if (bk->work) {
        st = nb_work_wait(bk->work);
        double issued = 0;
        nb_work_times(bk->work, &issued, started, finished);
        nb_work_free(bk->work);
        bk->work = NULL;
    }
    if (d->comm->finish && b < d->next_launch) {
        nb_status s = d->comm->finish(d, d->comm_self, b, keep && st == NB_OK, started, finished);
        if (st == NB_OK) st = s;
    }
    return st;
}

/* ---- the map of used parameters (Note [Unused parameters]) ---- */

void nb__ddp_used_launch(nb_ddp *d, bool trained) {
    NB_CHECK(!d->used_work, "nb_ddp: rank %d: the map of used parameters is launched twice in one backward",
             d->rank);
    d->used_st = NB_OK;
    if (d->n == 0) return; /* the same on every rank (ddp_verify.c) */
    if (d->used_ctx)
        nb_ctx_reset(d->used_ctx);
    else
        d->used_ctx = nb_ctx_new(nb_pg_device(d->pg), 0);
    for (int i = 0; i < d->n; i++) d->used_host[i] = trained && !d->none_unused[i];
    int64_t n = d->n;
    d->used_map = nb_from_host(d->used_ctx, NB_I32, 1, &n, d->used_host);
    d->used_work = nb_pg_all_reduce(d->pg, d->used_map, NB_REDUCE_SUM);
}

nb_status nb__ddp_used_wait(nb_ddp *d) {
    if (!d->used_work) return d->used_st;
    d->used_st = nb_work_finish(d->used_work);
    d->used_work = NULL;
    if (d->used_st == NB_OK) nb_to_host(d->used_map, d->used_host);
    return d->used_st;
}

/* Bucket bk's parameters that were set to none and got a gradient on no
 * rank: NULL again (Note [Unused parameters]); waits for the map only
 * when the bucket holds a parameter without a gradient here. */
static nb_status unused_back_to_none(nb_ddp *d, const bucket *bk) {
    bool any = false;
    for (int k = 0; k < bk->n && !any; k++) any = d->none_unused[bk->params[k]];
    if (!any) return NB_OK;
    nb_status st = nb__ddp_used_wait(d);
    if (st != NB_OK) return st;
    for (int k = 0; k < bk->n; k++) {
        int i = bk->params[k];
        if (d->none_unused[i] && d->used_host[i] == 0) nb__grad_set_none(d->p[i].tensor);
    }
    return NB_OK;
}

nb_status nb__ddp_finish_buckets(nb_ddp *d) {
    nb_status st = NB_OK;
    for (int b = 0; b < d->n_buckets; b++) {
        double started, finished;
        nb_status s = finish_bucket(d, b, false, &started, &finished);
        if (st == NB_OK) st = s;
    }
    return st;
}

static void grad_ready_hook(nb_tensor *leaf, void *user) {
    (void)leaf;
    hook_ref *r = user;
    if (r->ddp->in_backward) nb__ddp_mark_ready(r->ddp, r->index);
}

/* ---- construction ---- */

static void free_arrays(nb_ddp *d) {
    free(d->p);
    free(d->own_grad);
    free(d->refs);
    free(d->bucket_of);
    free(d->ready);
    free(d->none_unused);
    free(d->used_host);
    free(d->ready_order);
    free(d->all);
    free(d->slot);
    free(d->times);
}

nb_status nb__ddp_reducer_new(nb_ddp **out, nb_module *model, nb_pg *pg, const nb_ddp_options *opts) {
    *out = NULL;
    nb_ddp *d = nb__ddp_calloc(1, sizeof *d);
    nb__handle_init(&d->handle, "nb_ddp_free"); /* Note [Freed handles] */
    d->model = model;
    d->pg = pg;
    d->o = opts ? *opts : NB_DDP_DEFAULTS;
    d->rank = nb_pg_rank(pg);
    d->world = nb_pg_size(pg);
    d->comm = &allreduce_hook;
    nb__ddp_set_reduction(d, NB_REDUCE_AVG, 0, 0);
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
    d->all = nb__ddp_calloc((size_t)d->n, sizeof(int));
    for (int i = 0; i < d->n; i++) d->all[i] = i;
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
        d->none_unused = nb__ddp_calloc((size_t)d->n, sizeof(bool));
        d->used_host = nb__ddp_calloc((size_t)d->n, sizeof(int32_t));
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

void nb__ddp_reducer_free(nb_ddp *d) {
    for (int f = 0; f < NB__DDP_FEATURES; f++) {
        const nb__ddp_hooks *h = d->feat[f].h;
        void *self = d->feat[f].self;
        nb__ddp_detach(d, (nb__ddp_feature)f);
        if (h && h->free) h->free(d, self);
    }
    for (int b = 0; b < d->n_buckets; b++)
        if (d->buckets[b].work) { /* left by a failed step */
            nb_work_finish(d->buckets[b].work);
            d->buckets[b].work = NULL;
        }
    if (d->used_work) nb_work_finish(d->used_work); /* left by a failed step */
    nb_ctx_free(d->used_ctx);
    if (d->bucketed) {
        for (int i = 0; i < d->n; i++) {
            nb_tensor *t = d->p[i].tensor;
            nb_remove_grad_hook(t, grad_ready_hook, &d->refs[i]);
            /* the memory it had before the wrapper, unless given back since
             * (Note [Gradient segments] in autograd/backward.c: a segment
             * none of whose slots holds a gradient is given back by
             * nb_optim_zero_grad_to_none) */
            nb_tensor *own = nb__is_live(d->own_grad[i]) ? d->own_grad[i] : NULL;
            bool none = !t->grad && t->priv->grad_home; /* none, not given back */
            if (t->grad) { /* the gradient's value back in memory of its own */
                if (!own) own = nb_zeros(t->ctx, t->dtype, t->ndim, t->shape);
                nb_copy_(own, t->grad);
            } else if (own && !none) { /* given back by ZeRO-2: consumed */
                nb_fill_(own, 0);
            }
            nb_set_grad(t, own);
            if (none) nb__grad_set_none(t); /* still none, its own memory the home */
        }
    }
    for (int b = 0; b < d->n_buckets; b++) nb_ctx_free(d->buckets[b].gctx);
    nb_ctx_free(d->ctx);
    free_arrays(d);
    nb__handle_retire(d);
}

NB__HANDLE_GETTER(nb_module *, nb_ddp_module, nb_ddp, d, "DDP handle", d->model)

void nb_ddp_set_no_sync(nb_ddp *d, bool no_sync) {
    NB__CHECK_HANDLE("nb_ddp_set_no_sync", d, "DDP handle");
    d->no_sync = no_sync;
}
NB__HANDLE_GETTER(bool, nb_ddp_buckets_rebuilt, const nb_ddp, d, "DDP handle", d->rebuilt)
NB__HANDLE_GETTER(int, nb_ddp_num_buckets, const nb_ddp, d, "DDP handle", d->n_buckets)

int nb_ddp_bucket_params(const nb_ddp *d, int b, int *out, int cap) {
    NB__CHECK_HANDLE("nb_ddp_bucket_params", d, "DDP handle");
    NB_CHECK(b >= 0 && b < d->n_buckets, "nb_ddp_bucket_params: bucket %d of %d", b, d->n_buckets);
    for (int k = 0; k < d->buckets[b].n && k < cap; k++) out[k] = d->buckets[b].params[k];
    return d->buckets[b].n;
}

/* ---- forward ---- */

/* The step's collectives before forward; *what names the one that failed. */
static nb_status pre_forward(nb_ddp *d, const char **what) {
    d->fwd_start = nb__ddp_now();
    *what = "broadcasting the buffers";
    if (d->world == 1) return NB_OK;
    for (int f = 0; f < NB__DDP_FEATURES; f++) {
        const nb__ddp_hooks *h = d->feat[f].h;
        if (!h || !h->before_forward) continue;
        nb_status st = h->before_forward(d, d->feat[f].self);
        if (st != NB_OK) {
            *what = h->before_forward_what ? h->before_forward_what : h->name;
            return st;
        }
    }
    if (!d->o.broadcast_buffers) return NB_OK;
    return nb__ddp_broadcast_tensors(d, true, d->root);
}

nb_status nb_ddp_pre_forward(nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_pre_forward", d, "DDP handle");
    const char *what;
    return pre_forward(d, &what);
}

nb_status nb_ddp_forward(nb_ddp *d, nb_ctx *ctx, nb_tensor *x, nb_tensor **out) {
    NB__CHECK_HANDLE("nb_ddp_forward", d, "DDP handle");
    NB_CHECK(d && out, "nb_ddp_forward: NULL argument");
    *out = NULL;
    const char *what;
    nb_status st = pre_forward(d, &what);
    if (st != NB_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_ddp_forward: %s failed: %s", what, why);
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

/* Rank root's ready order, broadcast, becomes every rank's bucket order;
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
    if (dev.type == NB_DEVICE_CPU) {
        st = nb_work_finish(nb_pg_broadcast(d->pg, ord, d->root));
    } else { /* through the device, back to the host */
        nb_ctx *dctx = nb_ctx_new(dev, 0);
        nb_tensor *dord = nb_from_host(dctx, NB_I64, 1, &n, o);
        st = nb_work_finish(nb_pg_broadcast(d->pg, dord, d->root));
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

nb_status nb__ddp_synced(nb_ddp *d, bool rebuild) {
    if (d->synced_once) return NB_OK;
    d->synced_once = true;
    if (!rebuild) return NB_OK;
    for (int f = 0; f < NB__DDP_FEATURES; f++) {
        const nb__ddp_hooks *h = d->feat[f].h;
        if (h && h->take_rebuild && h->take_rebuild(d, d->feat[f].self)) return NB_OK;
    }
    return nb__ddp_rebuild_buckets(d);
}

void nb__ddp_step_timeline(const nb_ddp *d, double done, trace_step *t) {
    t->fwd_start = d->fwd_start;
    t->bw_start = d->bw_start;
    t->bw_end = d->bw_end;
    t->done = done;
    t->n = d->n_buckets;
    t->b = nb__ddp_calloc((size_t)d->n_buckets, sizeof *t->b);
    memcpy(t->b, d->times, sizeof *t->b * (size_t)d->n_buckets);
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
    for (int f = 0; f < NB__DDP_FEATURES; f++)
        if (d->feat[f].h && d->feat[f].h->backward_begin) d->feat[f].h->backward_begin(d, d->feat[f].self);
    if (!d->bucketed || d->no_sync) {
        nb_backward(loss);
        nb_status st = backward_failure();
        if (st == NB_OK && !d->no_sync) { /* a world of one: every gradient final at once */
            EACH_HOOK(d, sync_begin, true);
            EACH_HOOK(d, grads_final, d->all, d->n);
            EACH_HOOK(d, sync_end, nb__ddp_now());
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
            if (!seen[i]) nb__ddp_mark_ready(d, i);
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
            nb__ddp_mark_ready(d, i); /* still reduce, so the other ranks are not left waiting */
        }
    /* every bucket launched: the map of used parameters, Note [Unused parameters] */
    if (d->o.find_unused_parameters) nb__ddp_used_launch(d, true);
    bool usable = bw_st == NB_OK && (n_missing == 0 || d->o.find_unused_parameters);
    EACH_HOOK(d, sync_begin, usable);
    nb_status st = NB_OK;
    for (int b = 0; b < d->n_buckets; b++) {
        bucket *bk = &d->buckets[b];
        double started, finished;
        nb_status s = finish_bucket(d, b, true, &started, &finished);
        if (s != NB_OK && st == NB_OK) st = s;
        d->times[b] = (nb_ddp_bucket_time){bk->t_launch, started, finished, bk->bytes};
        if (s == NB_OK && d->divisor > 0) nb_scale_(bk->flat, 1.0 / d->divisor);
        if (s == NB_OK && d->o.find_unused_parameters) {
            s = unused_back_to_none(d, bk);
            if (s != NB_OK && st == NB_OK) st = s;
        }
        if (st == NB_OK) EACH_HOOK(d, grads_final, bk->params, bk->n);
    }
    if (d->o.find_unused_parameters) {
        nb_status s = nb__ddp_used_wait(d);
        if (s != NB_OK && st == NB_OK) st = s;
    }
    double done = nb__ddp_now();
    if (bw_st != NB_OK) return nb_set_error(bw_st, "%s", bw_why); /* it came first */
    if (st != NB_OK) return st;
    EACH_HOOK(d, sync_end, done);
    st = nb__ddp_synced(d, n_missing == 0 || d->o.find_unused_parameters);
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
