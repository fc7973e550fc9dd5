/* Uneven inputs: the DDP join mode, in which ranks that run out of batches
 * early keep answering the collectives of the ranks still training.
 *
 * Note [Join]
 * Between nb_ddp_join_begin and the end of nb_ddp_join, every training
 * step starts (nb_ddp_pre_forward, called by nb_ddp_forward) with one
 * all-reduce (sum, f64) of a vector of world + 1 entries: entry r is 1 when
 * rank r trains in this step, the last entry counts the training ranks
 * that reduce gradients in it (not in no_sync). A rank out of batches calls
 * nb_ddp_join, which loops: it adds zeros to that same all-reduce, and
 * while some rank still trains it shadows that rank's step, issuing the
 * same collectives in the same order with zero contributions:
 *   - the buffer broadcast (broadcast_buffers), whose root is the lowest
 *     rank still training (rank 0 may have joined: its buffers are stale);
 *   - each SyncBatchNorm all-reduce, with zeros of the same dtype and
 *     length: count, sum and sum of squares 0 for the statistics, so the
 *     batch statistics are those of the training ranks' samples alone,
 *     and 0 for the backward sums;
 *   - each gradient bucket (when the step reduces gradients), all zeros;
 *   - with find_unused_parameters, after the last bucket, the map of used
 *     parameters, all zeros (Note [Unused parameters] in ddp.c): a
 *     joined rank holds no gradient, so a parameter no training rank
 *     used keeps its NULL there;
 *   - the one-time bucket rebuild, when the training ranks do it (their
 *     first synchronised backward), with the order from the root above.
 * The order of SyncBatchNorm all-reduces and bucket launches within a step
 * depends on when gradients become ready, so each training step records
 * it (the ready parameters and the SyncBatchNorm all-reduces, in order)
 * and the joined rank replays its own last step through the same bucket
 * logic (nb__ddp_mark_ready), with the current bucket layout. A rank that
 * joins before its first step has no record: it launches the buckets in
 * index order, which is right unless the model has SyncBatchNorm layers.
 * Only SyncBatchNorm layers on the wrapper's own group are recorded. A
 * training rank decides the bucket rebuild after its backward (no rebuild
 * when a parameter got no gradient without find_unused_parameters, an
 * error anyway); a joined rank assumes it happens.
 *
 * Gradients: in join mode buckets are all-reduced with a sum and then
 * divided by the world size (divide_by_initial_world_size, the default:
 * every sample weighs the same as in a full step) or by the number of
 * ranks that trained in the step (each step then is the average over the
 * ranks that took part: a smaller world). With every rank training both
 * equal the plain average.
 *
 * When the count is zero every rank has joined; all ranks then receive
 * the whole state (parameters and buffers) from the lowest rank of the
 * last step in which anyone trained, so the models agree again. Optimizer
 * state is not synchronised: joined ranks keep theirs as it was.
 *
 * Join is a feature of the reducer (Note [DDP hook points] in ddp.c),
 * attached from nb_ddp_join_begin to the end of nb_ddp_join: its count
 * runs before each step's forward (before_forward), its checks at the
 * start of backward (backward_begin), its record as parameters become
 * ready (on_ready); the sum and the divisor are the reducer's reduction
 * (nb__ddp_set_reduction), and the replay goes through the reducer's own
 * bucket logic (nb__ddp_mark_ready). */
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_reducer.h"
#include "distributed/internal.h"
#include "util/handle.h"

/* One collective-relevant event of a training step, recorded so that a
 * joined rank can replay the step. */
typedef struct join_event {
    int param;      /* >= 0: parameter `param` became ready; -1: a SyncBatchNorm all-reduce */
    nb_dtype dtype; /* of the SyncBatchNorm all-reduce */
    int64_t numel;
} join_event;

typedef struct join_state {
    bool div_initial; /* divide by the world size, not by the ranks still training */
    bool counted;     /* this step's count was all-reduced (pre-forward) */
    bool sync;        /* this step reduces gradients (some training rank is not in no_sync) */
    bool shadow;      /* replaying a step on a joined rank */
    int active;       /* ranks training in this step */
    int root;         /* lowest of them: buffers and the bucket order come from it */
    join_event *events; /* this rank's last training step (malloc'd) */
    int n_events, cap_events;
} join_state;

/* The wrapper in join mode whose step runs on this thread. */
static _Thread_local nb_ddp *recorder;

static join_state *join_of(const nb_ddp *d) { return nb__ddp_state(d, NB__DDP_JOIN); }

static void record(join_state *j, join_event e) {
    if (j->n_events == j->cap_events) {
        int cap = j->cap_events ? 2 * j->cap_events : 64;
        join_event *ev = realloc(j->events, sizeof *ev * (size_t)cap);
        NB_CHECK(ev, "nb_ddp: out of memory (%d join events)", cap);
        j->events = ev;
        j->cap_events = cap;
    }
    j->events[j->n_events++] = e;
}

void nb__ddp_join_note(nb_pg *pg, const nb_tensor *t) {
    nb_ddp *d = recorder;
    join_state *j = d ? join_of(d) : NULL;
    if (j && !j->shadow && d->pg == pg) record(j, (join_event){-1, t->dtype, nb_numel(t)});
}

/* The reducer's reduction for the step: a sum, divided as the options say. */
static void set_reduction(nb_ddp *d, const join_state *j) {
    nb__ddp_set_reduction(d, NB_REDUCE_SUM, j->div_initial ? (double)d->world : (double)j->active, j->root);
}

/* ---- hook points ---- */

static nb_status join_count(nb_ddp *d, void *self);

static void join_backward_begin(nb_ddp *d, void *self) {
    join_state *j = self;
    if (d->world == 1) return;
    NB_CHECK(j->counted,
             "nb_ddp_backward: rank %d: after nb_ddp_join_begin, every step must start with "
             "nb_ddp_forward or nb_ddp_pre_forward (the ranks count who still trains there)",
             d->rank);
    NB_CHECK(j->sync == !d->no_sync,
             "nb_ddp_backward: rank %d: no_sync changed between the step's forward and its "
             "backward; after nb_ddp_join_begin set it before nb_ddp_forward", d->rank);
    j->counted = false;
}

static void join_on_ready(nb_ddp *d, void *self, int i) {
    (void)d;
    join_state *j = self;
    if (!j->shadow) record(j, (join_event){i, NB_F32, 0});
}

/* Leaves join mode: the plain reduction back, the state freed. */
static void join_end(nb_ddp *d, join_state *j) {
    if (recorder == d) recorder = NULL;
    nb__ddp_detach(d, NB__DDP_JOIN);
    nb__ddp_set_reduction(d, NB_REDUCE_AVG, 0, 0);
    free(j->events);
    free(j);
}

static void join_free(nb_ddp *d, void *self) { join_end(d, self); }

static const nb__ddp_hooks join_hooks = {
    .name = "join",
    .before_forward = join_count,
    .before_forward_what = "the step's count",
    .backward_begin = join_backward_begin,
    .on_ready = join_on_ready,
    .free = join_free,
};

nb_status nb_ddp_join_begin(nb_ddp *d, const nb_ddp_join_options *opts) {
    NB__CHECK_HANDLE("nb_ddp_join_begin", d, "DDP handle");
    join_state *j = join_of(d);
    NB_CHECK(!(j && j->counted), "nb_ddp_join_begin: rank %d: called between a step's forward and its backward",
             d->rank);
    if (!j) {
        nb_status st = nb__ddp_check_conflicts(d, NB__DDP_JOIN, "nb_ddp_join_begin"); /* Note [Feature conflicts] */
        if (st != NB_OK) return st;
    }
    nb_ddp_join_options o = opts ? *opts : NB_DDP_JOIN_DEFAULTS;
    if (!j) {
        j = nb__ddp_calloc(1, sizeof *j);
        nb__ddp_attach(d, NB__DDP_JOIN, &join_hooks, j);
    }
    j->div_initial = o.divide_by_initial_world_size;
    j->active = d->world;
    j->root = 0;
    j->sync = true;
    j->n_events = 0;
    set_reduction(d, j);
    return NB_OK;
}

/* The step's count all-reduce (Note [Join]); `training`: this rank takes
 * part in the step. */
static nb_status count(nb_ddp *d, join_state *j, bool training) {
    int W = d->world;
    double *v = nb__ddp_calloc((size_t)W + 1, sizeof *v);
    if (training) {
        v[d->rank] = 1;
        v[W] = d->no_sync ? 0 : 1;
    }
    int64_t n = W + 1;
    nb_ctx *c = nb_ctx_new(nb_pg_device(d->pg), 0);
    nb_tensor *t = nb_from_host(c, NB_F64, 1, &n, v);
    nb_status st = nb_work_finish(nb_pg_all_reduce(d->pg, t, NB_REDUCE_SUM));
    if (st == NB_OK) nb_to_host(t, v);
    nb_ctx_free(c);
    if (st != NB_OK) {
        free(v);
        char why[2048];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_ddp: rank %d: counting the ranks still training failed: %s", d->rank, why);
    }
    int active = 0, root = -1;
    for (int r = 0; r < W; r++)
        if (v[r] > 0.5) {
            active++;
            if (root < 0) root = r;
        }
    int sync = (int)(v[W] + 0.5);
    free(v);
    j->active = active;
    if (active > 0) j->root = root;
    j->sync = sync > 0;
    set_reduction(d, j);
    if (sync != 0 && sync != active)
        return nb_set_error(NB_ERR_MISMATCH,
                            "nb_ddp: rank %d: of the %d ranks still training, %d reduce gradients in this "
                            "step and %d are in no_sync; every rank must make the same nb_ddp_set_no_sync "
                            "choice before the step's forward",
                            d->rank, active, sync, active - sync);
    return NB_OK;
}

static nb_status join_count(nb_ddp *d, void *self) {
    join_state *j = self;
    NB_CHECK(!j->counted,
             "nb_ddp_pre_forward: rank %d: called twice in one step in join mode (each step runs one "
             "forward through the wrapper, then nb_ddp_backward)",
             d->rank);
    nb_status st = count(d, j, true);
    if (st != NB_OK) return st;
    j->counted = true;
    j->n_events = 0;
    recorder = d;
    return NB_OK;
}

/* One step of the ranks still training, answered with zeros (Note [Join]). */
static nb_status shadow_step(nb_ddp *d, join_state *j) {
    nb_status st = NB_OK;
    if (d->o.broadcast_buffers) st = nb__ddp_broadcast_tensors(d, true, j->root);
    if (st != NB_OK) return st;
    bool buckets = d->bucketed && j->sync;
    if (buckets) {
        for (int b = 0; b < d->n_buckets; b++) nb_fill_(d->buckets[b].flat, 0);
        nb__ddp_reset_ready(d);
    }
    j->shadow = true;
    nb_ctx *c = nb_ctx_new(nb_pg_device(d->pg), 0);
    nb_work **w = nb__ddp_calloc((size_t)j->n_events + 1, sizeof *w);
    int nw = 0;
    for (int k = 0; k < j->n_events; k++) {
        join_event e = j->events[k];
        if (e.param < 0) {
            nb_tensor *z = nb_zeros(c, e.dtype, 1, &e.numel);
            w[nw++] = nb_pg_all_reduce(d->pg, z, NB_REDUCE_SUM);
        } else if (buckets) {
            nb__ddp_mark_ready(d, e.param);
        }
    }
    if (buckets) /* no record, or parameters the record lacks: in bucket order */
        for (int i = d->n - 1; i >= 0; i--) nb__ddp_mark_ready(d, i);
    bool used_map = buckets && d->o.find_unused_parameters;
    if (used_map) nb__ddp_used_launch(d, false); /* this rank used nothing */
    for (int k = 0; k < nw; k++) {
        nb_status s = nb_work_finish(w[k]);
        if (st == NB_OK) st = s;
    }
    free(w);
    nb_ctx_free(c);
    if (buckets) {
        nb_status s = nb__ddp_finish_buckets(d);
        if (st == NB_OK) st = s;
        s = used_map ? nb__ddp_used_wait(d) : NB_OK;
        if (st == NB_OK) st = s;
        for (int b = 0; b < d->n_buckets; b++)
            nb_fill_(d->buckets[b].flat, 0); /* a joined rank's gradients are zero */
    }
    j->shadow = false;
    if (st == NB_OK && buckets) st = nb__ddp_synced(d, true);
    return st;
}

static bool has_sync_batch_norm(const nb_module *m) {
    if (strcmp(nb_module_type_name(m), "SyncBatchNorm") == 0) return true;
    for (int i = 0; i < nb_module_num_children(m); i++)
        if (has_sync_batch_norm(nb_module_child_at(m, i))) return true;
    return false;
}

nb_status nb_ddp_join(nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_join", d, "DDP handle");
    join_state *j = join_of(d);
    NB_CHECK(j,
             "nb_ddp_join: rank %d: join mode is off; every rank calls nb_ddp_join_begin before its "
             "training loop",
             d->rank);
    NB_CHECK(!j->counted,
             "nb_ddp_join: rank %d: called between a step's forward and its backward; finish the step first",
             d->rank);
    if (d->world > 1 && j->n_events == 0 && has_sync_batch_norm(d->model)) {
        join_end(d, j);
        return nb_set_error(NB_ERR_INVALID,
                            "nb_ddp_join: rank %d joined without a synchronised training step, and the "
                            "model has SyncBatchNorm layers, whose all-reduces it cannot replay without "
                            "one; give every rank at least one batch (the other ranks will time out)",
                            d->rank);
    }
    nb_status st = NB_OK;
    int steps = 0;
    if (d->world > 1) {
        for (;;) {
            st = count(d, j, false);
            if (st != NB_OK || j->active == 0) break;
            st = shadow_step(d, j);
            if (st != NB_OK) break;
            steps++;
        }
        if (st == NB_OK) st = nb__ddp_broadcast_tensors(d, false, j->root);
    }
    join_end(d, j);
    if (st != NB_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_ddp_join: rank %d, after shadowing %d steps of the others: %s", d->rank,
                            steps, why);
    }
    return NB_OK;
}
