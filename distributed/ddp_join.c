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
 * state is not synchronised: joined ranks keep theirs as it was. */
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_internal.h"
#include "distributed/internal.h"
#include "util/handle.h"

/* The wrapper in join mode whose step runs on this thread. */
static _Thread_local nb_ddp *recorder;

static void record(nb_ddp *d, join_event e) {
    if (d->n_events == d->cap_events) {
        int cap = d->cap_events ? 2 * d->cap_events : 64;
        join_event *ev = realloc(d->events, sizeof *ev * (size_t)cap);
        NB_CHECK(ev, "nb_ddp: out of memory (%d join events)", cap);
        d->events = ev;
        d->cap_events = cap;
    }
    d->events[d->n_events++] = e;
}

void nb__ddp_join_note(nb_pg *pg, const nb_tensor *t) {
    nb_ddp *d = recorder;
    if (d && d->join_on && !d->join_shadow && d->pg == pg)
        record(d, (join_event){-1, t->dtype, nb_numel(t)});
}

void nb__ddp_join_record_param(nb_ddp *d, int i) { record(d, (join_event){i, NB_F32, 0}); }

nb_reduce_op nb__ddp_join_reduce_op(const nb_ddp *d) { return d->join_on ? NB_REDUCE_SUM : NB_REDUCE_AVG; }

double nb__ddp_join_divisor(const nb_ddp *d) {
    if (!d->join_on) return 0;
    return d->join_div_initial ? (double)d->world : (double)d->join_active;
}

void nb__ddp_join_forget(nb_ddp *d) {
    if (recorder == d) recorder = NULL;
}

void nb_ddp_join_begin(nb_ddp *d, const nb_ddp_join_options *opts) {
    NB__CHECK_HANDLE("nb_ddp_join_begin", d, "DDP handle");
    NB_CHECK(!d->join_counted, "nb_ddp_join_begin: rank %d: called between a step's forward and its backward",
             d->rank);
    NB_CHECK(!d->opt, "nb_ddp_join_begin: rank %d: the wrapper steps an optimizer per bucket "
             "(nb_ddp_set_optimizer); join mode cannot be combined with it (a joined rank replays "
             "steps without training); detach it with nb_ddp_set_optimizer(ddp, NULL) and call "
             "nb_optim_step after nb_ddp_backward", d->rank);
    NB_CHECK(!d->zopt, "nb_ddp_join_begin: rank %d: ZeRO-1 is on (nb_ddp_set_zero); join mode "
             "cannot be combined with it (a joined rank would have to step its shard on the "
             "others' gradients); detach it with nb_ddp_set_zero(ddp, NULL)", d->rank);
    nb_ddp_join_options o = opts ? *opts : NB_DDP_JOIN_DEFAULTS;
    d->join_on = true;
    d->join_div_initial = o.divide_by_initial_world_size;
    d->join_active = d->world;
    d->join_root = 0;
    d->join_sync = true;
    d->n_events = 0;
}

/* The step's count all-reduce (Note [Join]); `training`: this rank takes
 * part in the step. */
static nb_status count(nb_ddp *d, bool training) {
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
    d->join_active = active;
    if (active > 0) d->join_root = root;
    d->join_sync = sync > 0;
    if (sync != 0 && sync != active)
        return nb_set_error(NB_ERR_MISMATCH,
                            "nb_ddp: rank %d: of the %d ranks still training, %d reduce gradients in this "
                            "step and %d are in no_sync; every rank must make the same nb_ddp_set_no_sync "
                            "choice before the step's forward",
                            d->rank, active, sync, active - sync);
    return NB_OK;
}

nb_status nb__ddp_join_count(nb_ddp *d) {
    NB_CHECK(!d->join_counted,
             "nb_ddp_pre_forward: rank %d: called twice in one step in join mode (each step runs one "
             "forward through the wrapper, then nb_ddp_backward)",
             d->rank);
    nb_status st = count(d, true);
    if (st != NB_OK) return st;
    d->join_counted = true;
    d->n_events = 0;
    recorder = d;
    return NB_OK;
}

/* One step of the ranks still training, answered with zeros (Note [Join]). */
static nb_status shadow_step(nb_ddp *d) {
    nb_status st = NB_OK;
    if (d->o.broadcast_buffers) st = nb__ddp_broadcast_tensors(d, true, d->join_root);
    if (st != NB_OK) return st;
    bool buckets = d->bucketed && d->join_sync;
    if (buckets) {
        for (int b = 0; b < d->n_buckets; b++) nb_fill_(d->buckets[b].flat, 0);
        nb__ddp_reset_ready(d);
    }
    d->join_shadow = true;
    nb_ctx *c = nb_ctx_new(nb_pg_device(d->pg), 0);
    nb_work **w = nb__ddp_calloc((size_t)d->n_events + 1, sizeof *w);
    int nw = 0;
    for (int k = 0; k < d->n_events; k++) {
        join_event e = d->events[k];
        if (e.param < 0) {
            nb_tensor *z = nb_zeros(c, e.dtype, 1, &e.numel);
            w[nw++] = nb_pg_all_reduce(d->pg, z, NB_REDUCE_SUM);
        } else if (buckets) {
            nb__ddp_mark_ready(d, e.param);
        }
    }
    if (buckets) /* no record, or parameters the record lacks: in bucket order */
        for (int i = d->n - 1; i >= 0; i--) nb__ddp_mark_ready(d, i);
    for (int k = 0; k < nw; k++) {
        nb_status s = nb_work_finish(w[k]);
        if (st == NB_OK) st = s;
    }
    free(w);
    nb_ctx_free(c);
    if (buckets) {
        for (int b = 0; b < d->n_buckets; b++) {
            bucket *bk = &d->buckets[b];
            nb_status s = nb_work_finish(bk->work);
            bk->work = NULL;
            if (st == NB_OK) st = s;
            nb_fill_(bk->flat, 0); /* a joined rank's gradients are zero */
        }
    }
    d->join_shadow = false;
    if (st == NB_OK && buckets && !d->synced_once) {
        d->synced_once = true;
        st = nb__ddp_rebuild_buckets(d);
    }
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
    NB_CHECK(d->join_on,
             "nb_ddp_join: rank %d: join mode is off; every rank calls nb_ddp_join_begin before its "
             "training loop",
             d->rank);
    NB_CHECK(!d->join_counted,
             "nb_ddp_join: rank %d: called between a step's forward and its backward; finish the step first",
             d->rank);
    if (d->world > 1 && d->n_events == 0 && has_sync_batch_norm(d->model)) {
        d->join_on = false;
        nb__ddp_join_forget(d);
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
            st = count(d, false);
            if (st != NB_OK || d->join_active == 0) break;
            st = shadow_step(d);
            if (st != NB_OK) break;
            steps++;
        }
        if (st == NB_OK) st = nb__ddp_broadcast_tensors(d, false, d->join_root);
    }
    d->join_on = false;
    d->n_events = 0;
    nb__ddp_join_forget(d);
    if (st != NB_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_ddp_join: rank %d, after shadowing %d steps of the others: %s", d->rank,
                            steps, why);
    }
    return NB_OK;
}
