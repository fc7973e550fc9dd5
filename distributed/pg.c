/* Process groups: set-up from the environment, the collectives' front
 * ends (argument checks, sequence numbers), the per-group queue, waits
 * with the watchdog of Note [Hang diagnostics] (pg_diag.c) and of Note
 * [Liveness and progress] (heartbeat.c), and shut-down.
 *
 * What moves the collectives' bytes is the group's backend, reached
 * through its table (nb__pg_ops in pg.h), and the collective checks are a
 * layer around that table (pg_check.c), present only when
 * NABLA_DIST_CHECK is not off. Gloo calls block, so this file runs each
 * group's collectives on one background thread, strictly in issue order
 * (every rank must see the same order), calling the table's `run`; NCCL
 * calls are asynchronous already, so its `launch` enqueues them on the
 * group's stream from the issuing thread, and a wait orders the compute
 * stream after the collective, then polls its completion event. Either
 * way the group keeps its unfinished works in issue order, and only the
 * oldest is watched: a later one cannot finish before it. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "distributed/pg.h"
#include "tensor/cuda_plugin.h" /* the nccl backend: Note [CUDA plugin] */

#define SLICE_S 0.05         /* how often a waiting thread wakes to watch */
#define POLL_AFTER_S 0.5     /* a collective this old gets abort polls... */
#define DESYNC_AFTER_S 1.0   /* ...and, this old, fingerprint comparisons */
#define POLL_EVERY_S 0.5
#define STUCK_WAIT_S 2.0     /* Note [Stuck worker] */

/* ---------------------------------------------------------------- basics */

const char *nb_pg_backend_name(nb_pg_backend backend) {
    switch (backend) {
    case NB_PG_AUTO: return "auto";
    case NB_PG_GLOO: return "gloo";
    case NB_PG_NCCL: return "nccl";
    }
    return "?";
}

int nb_pg_rank(const nb_pg *pg) {
    NB__CHECK_HANDLE("nb_pg_rank", pg, "process group");
    return pg->rank;
}
int nb_pg_size(const nb_pg *pg) {
    NB__CHECK_HANDLE("nb_pg_size", pg, "process group");
    return pg->size;
}
nb_pg_backend nb_pg_backend_of(const nb_pg *pg) { return pg->backend; }
nb_device nb_pg_device(const nb_pg *pg) { return pg->device; }
const nb_dist_env *nb_pg_env(const nb_pg *pg) { return &pg->root->env; }
nb_store *nb_pg_store(nb_pg *pg) { return pg->root->store_main; }

int nb_pg_global_rank(const nb_pg *pg, int group_rank) {
    NB_CHECK(pg != NULL, "nb_pg_global_rank: process group is NULL");
    NB_CHECK(group_rank >= 0 && group_rank < pg->size,
             "nb_pg_global_rank: rank %d is outside the group of %d", group_rank, pg->size);
    return pg->global[group_rank];
}

void nb_work_times(const nb_work *work, double *issued, double *started, double *finished) {
    NB_CHECK(work, "nb_work_times: NULL work");
    pthread_mutex_lock(&work->pg->mu);
    if (issued) *issued = work->t_issue;
    if (started) *started = work->t_start;
    if (finished) *finished = work->state == NB__W_DONE ? work->t_end : 0;
    pthread_mutex_unlock(&work->pg->mu);
}

uint64_t nb_work_seq(const nb_work *w) { return w->coll.seq; }

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    NB_CHECK(p != NULL, "nb_pg: out of memory");
    memcpy(p, s, n);
    return p;
}

/* ------------------------------------------------------------ work queue */

void nb__work_put(nb_work *w) {
    if (__atomic_sub_fetch(&w->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        free(w->msg);
        if (w->ops && w->ops->work_free) w->ops->work_free(w); /* the layer's, then the backend's */
        free(w);
    }
}

void nb__pg_finish_locked(nb_pg *pg, nb_work *w, nb_status st, const char *msg) {
    w->state = NB__W_DONE;
    w->t_end = nb__now();
    w->status = st;
    if (st != NB_OK && !w->msg) w->msg = dup_str(msg);
    nb_work **pp = &pg->q_head;
    while (*pp && *pp != w) pp = &(*pp)->next;
    if (*pp) {
        *pp = w->next;
        if (pg->q_tail == w) {
            pg->q_tail = NULL;
            for (nb_work *x = pg->q_head; x; x = x->next) pg->q_tail = x;
        }
        w->next = NULL;
        if (pg->q_head) {
            double now = nb__now();
            if (pg->q_head->t_start < now) pg->q_head->t_start = now;
        }
        pthread_cond_broadcast(&pg->cond);
        nb__work_put(w); /* the group's reference */
    }
}

void nb__pg_fail(nb_pg *pg, nb_work *w, nb_status st, const char *what) {
    pthread_mutex_lock(&pg->mu);
    bool already = pg->broken != NB_OK;
    pthread_mutex_unlock(&pg->mu);
    if (already) return;
    char msg[NB__MSG_LEN];
    nb__diag_explain(pg, w, what, msg, sizeof msg);
    nb__pg_break(pg, st, msg);
}

void nb__pg_break(nb_pg *pg, nb_status st, const char *msg) {
    pthread_mutex_lock(&pg->mu);
    bool first = pg->broken == NB_OK;
    if (first) {
        pg->broken = st;
        snprintf(pg->broken_msg, sizeof pg->broken_msg, "%s", msg);
    }
    pthread_cond_broadcast(&pg->cond);
    pthread_mutex_unlock(&pg->mu);
    if (first && pg->ops->abort) pg->ops->abort(pg);
}

/* ---------------------------------------------------------------- watchdog */

/* Note [Liveness and progress] in heartbeat.c: a collective that waits on
 * live ranks is named once, on stderr, and goes on waiting. */
static void stall_warning(nb_pg *pg, nb_work *h, double age) {
    h->warned = true;
    char what[128], msg[NB__MSG_LEN];
    snprintf(what, sizeof what, "has waited %.0f s", age);
    nb__diag_explain(pg, h, what, msg, sizeof msg);
    fprintf(stderr,
            "nabla: warning: %s; every rank is alive (heartbeats flow), so they are busy (a long "
            "evaluation or checkpoint) or stuck in their own code; the collective fails after "
            "NABLA_PG_TIMEOUT=%g s\n",
            msg, pg->timeout_s);
}

/* Times out, or fails early (abort, desync, a silent rank), the group's
 * oldest work. */
static void watchdog(nb_pg *pg) {
    if (pthread_mutex_trylock(&pg->watch_mu) != 0) return;
    double now = nb__now();
    pthread_mutex_lock(&pg->mu);
    nb_work *h = pg->broken == NB_OK ? pg->q_head : NULL;
    if (h) __atomic_add_fetch(&h->refs, 1, __ATOMIC_ACQ_REL);
    double age = h ? now - h->t_start : 0;
    bool due = now >= pg->next_poll;
    pthread_mutex_unlock(&pg->mu);
    if (h) {
        char what[NB__MSG_LEN];
        if (age > pg->timeout_s) {
            snprintf(what, sizeof what, "did not complete within %.1f s", pg->timeout_s);
            nb__pg_fail(pg, h, NB_ERR_TIMEOUT, what);
        } else if (age > POLL_AFTER_S && due) {
            pg->next_poll = now + POLL_EVERY_S;
            nb__diag_publish(pg); /* a wait that runs long: Note [Hang diagnostics] */
            nb_status st = nb__diag_check(pg, h, age > DESYNC_AFTER_S, what, sizeof what);
            if (st == NB_OK) st = nb__hb_check(pg, what, sizeof what);
            if (st != NB_OK) nb__pg_fail(pg, h, st, what);
            else if (pg->root->stall_s > 0 && age > pg->root->stall_s && !h->warned) stall_warning(pg, h, age);
        }
        nb__work_put(h);
    }
    pthread_mutex_unlock(&pg->watch_mu);
}

/* One round of waiting: the backend's slice of sleep (and progress), then
 * the watchdog. With pg->mu held on entry and exit. */
static void wait_one_slice(nb_pg *pg) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)(SLICE_S * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&pg->cond, &pg->mu, &ts);
}

static void wait_round(nb_pg *pg, double *pause) {
    if (pg->ops->wait_slice) pg->ops->wait_slice(pg, pause);
    else wait_one_slice(pg); /* the worker signals pg->cond when a work finishes */
    pthread_mutex_unlock(&pg->mu);
    watchdog(pg);
    pthread_mutex_lock(&pg->mu);
}

bool nb__pg_wait_step(nb_pg *pg, double *pause) {
    pthread_mutex_lock(&pg->mu);
    bool broken = pg->broken != NB_OK;
    pthread_mutex_unlock(&pg->mu);
    if (broken) return false;
    nb__sleep(*pause);
    *pause = *pause * 2 > 1e-3 ? 1e-3 : *pause * 2;
    if (pg->ops->progress) pg->ops->progress(pg);
    watchdog(pg);
    return true;
}

/* ------------------------------------------------------------ work handles */

static nb_status work_result(nb_work *w, bool *done) {
    nb_pg *pg = w->pg;
    *done = true;
    if (w->state == NB__W_DONE) {
        if (w->status != NB_OK) return nb_set_error(w->status, "%s", w->msg ? w->msg : "");
        return NB_OK;
    }
    if (pg->broken != NB_OK) return nb_set_error(pg->broken, "%s", pg->broken_msg);
    *done = false;
    return NB_OK;
}

nb_status nb_pg_status(nb_pg *pg) {
    NB_CHECK(pg != NULL, "nb_pg_status: process group is NULL");
    nb__handle_check_live("nb_pg_status", pg, "process group");
    pthread_mutex_lock(&pg->mu);
    nb_status st = pg->broken;
    char msg[NB__MSG_LEN];
    snprintf(msg, sizeof msg, "%s", pg->broken_msg);
    pthread_mutex_unlock(&pg->mu);
    return st == NB_OK ? NB_OK : nb_set_error(st, "%s", msg);
}

/* Note [Failures inside a forward] (sync_batch_norm.c): the calling
 * thread's first failure since the last clear. */
static _Thread_local struct {
    bool pending;
    nb_status st;
    char msg[NB__MSG_LEN + 512]; /* the group's message and what failed */
} op_failure;

void nb__dist_failure_clear(void) { op_failure.pending = false; }

void nb__dist_failure_note(nb_status st, const char *msg) {
    if (op_failure.pending) return;
    op_failure.pending = true;
    op_failure.st = st;
    snprintf(op_failure.msg, sizeof op_failure.msg, "%s", msg);
}

nb_status nb__dist_failure_take(void) {
    if (!op_failure.pending) return NB_OK;
    op_failure.pending = false;
    return nb_set_error(op_failure.st, "%s", op_failure.msg);
}

/* Note [Host waits on NCCL]: a wait on an NCCL work orders the compute
 * stream after it and then also waits on the host (polling), although
 * the stream order alone would make later kernels see the result. The
 * host wait stays because (1) the watchdog (timeouts, desync and abort
 * checks, Note [Hang diagnostics]) runs only in waiting threads, so with
 * stream-only waits a dead or stuck peer would leave the host blocked in
 * the next cudaStreamSynchronize forever, without a message; (2) a
 * barrier must hold the host; (3) DDP's bucket times are host times read
 * right after the wait. Making it stream-only needs a per-group monitor
 * thread (device set, progress and watchdog, aborting the communicator
 * under a lock shared with launches), barrier waits kept on the host, and
 * bucket times from timing events; until then the cost is one host
 * stall per DDP step and per SyncBatchNorm collective. */
nb_status nb_work_wait(nb_work *w) {
    NB_CHECK(w != NULL, "nb_work_wait: work is NULL");
    nb_pg *pg = w->pg;
    double pause = 2e-5;
    bool done;
    if (pg->ops->order) {
        nb_status st = pg->ops->order(w);
        if (st != NB_OK) return st;
    }
    if (pg->ops->progress) pg->ops->progress(pg);
    pthread_mutex_lock(&pg->mu);
    nb_status st = work_result(w, &done);
    while (!done) {
        wait_round(pg, &pause);
        st = work_result(w, &done);
    }
    pthread_mutex_unlock(&pg->mu);
    return st;
}

nb_status nb_work_test(nb_work *w, bool *done) {
    NB_CHECK(w != NULL && done != NULL, "nb_work_test: NULL argument");
    nb_pg *pg = w->pg;
    if (pg->ops->progress) pg->ops->progress(pg);
    watchdog(pg);
    pthread_mutex_lock(&pg->mu);
    nb_status st = work_result(w, done);
    pthread_mutex_unlock(&pg->mu);
    return st;
}

void nb_work_free(nb_work *w) {
    if (w) nb__work_put(w);
}

nb_status nb_work_finish(nb_work *w) {
    nb_status st = nb_work_wait(w);
    nb_work_free(w);
    return st;
}

/* ------------------------------------------------------------------ issue */

/* Runs a backend's works whose calls block, one after another in issue
 * order (every rank must run the same order), on the group's worker. */
static void *worker_main(void *arg) {
    nb_pg *pg = arg;
    char what[NB__MSG_LEN];
    pthread_mutex_lock(&pg->mu);
    for (;;) {
        nb_work *w = pg->q_head;
        while (w && w->state != NB__W_QUEUED) w = w->next;
        if (!w) {
            if (pg->stopping) break;
            pthread_cond_wait(&pg->cond, &pg->mu);
            continue;
        }
        w->state = NB__W_RUNNING;
        nb_status st = pg->broken;
        pthread_mutex_unlock(&pg->mu);
        if (st == NB_OK) {
            bool explained = false;
            nb__diag_record(pg, w);
            st = pg->ops->run(pg, w, what, sizeof what, &explained);
            if (st != NB_OK && explained) nb__pg_break(pg, st, what);
            else if (st != NB_OK) nb__pg_fail(pg, w, st, what);
        }
        pthread_mutex_lock(&pg->mu);
        if (st != NB_OK) st = pg->broken;
        nb__pg_finish_locked(pg, w, st, pg->broken_msg);
    }
    pg->worker_done = true;
    pthread_cond_broadcast(&pg->cond);
    pthread_mutex_unlock(&pg->mu);
    return NULL;
}

/* Note [Stuck worker]: after a failure, the worker may be blocked inside a
 * collective whose peer is stopped rather than dead (its sockets stay
 * open), until the transport's own timeout, the progress timeout (30
 * minutes by default). nb_pg_free of a broken group waits a moment for the
 * worker and then detaches it, leaving the group's struct and the
 * backend's state allocated for it, so that a program that reports a
 * failure and cleans up is not held for the timeout. The process is
 * expected to exit soon. */
static bool worker_stuck(nb_pg *pg) {
    pthread_mutex_lock(&pg->mu);
    double deadline = nb__now() + STUCK_WAIT_S;
    while (pg->broken != NB_OK && !pg->worker_done && nb__now() < deadline) wait_one_slice(pg);
    bool stuck = pg->broken != NB_OK && !pg->worker_done;
    pthread_mutex_unlock(&pg->mu);
    if (stuck) pthread_detach(pg->worker);
    return stuck;
}

/* With pg->stopping set: joins the worker, or detaches it when stuck;
 * true if it is stuck. */
static bool stop_worker(nb_pg *pg) {
    if (!pg->worker_started) return false;
    bool stuck = worker_stuck(pg);
    if (!stuck) pthread_join(pg->worker, NULL);
    pg->worker_started = false;
    return stuck;
}

nb_work *nb__pg_issue(nb_pg *pg, const nb__coll *c) {
    nb_work *w = calloc(1, sizeof *w);
    NB_CHECK(w != NULL, "nb_pg: out of memory for a work handle");
    w->pg = pg;
    w->ops = pg->ops;
    w->base = pg->base;
    w->coll = *c;
    w->refs = 2;
    pthread_mutex_lock(&pg->mu);
    w->coll.seq = ++pg->seq;
    nb__coll_fingerprint(&w->coll, w->fingerprint, sizeof w->fingerprint);
    w->t_issue = w->t_start = nb__now();
    if (pg->broken != NB_OK) {
        w->state = NB__W_DONE;
        w->status = pg->broken;
        w->msg = dup_str(pg->broken_msg);
        w->refs = 1;
        pthread_mutex_unlock(&pg->mu);
        return w;
    }
    if (pg->q_tail) pg->q_tail->next = w;
    else pg->q_head = w;
    pg->q_tail = w;
    if (pg->ops->run) {
        pthread_cond_broadcast(&pg->cond); /* the worker takes it */
        pthread_mutex_unlock(&pg->mu);
        return w;
    }
    pthread_mutex_unlock(&pg->mu);
    nb__diag_record(pg, w);
    pg->ops->launch(pg, w);
    return w;
}

static bool dtype_ok(nb_dtype d) {
    return d == NB_F32 || d == NB_F64 || d == NB_BF16 || d == NB_F16 || d == NB_I32 || d == NB_I64;
}

static void check_tensor(const char *fn, const nb_pg *pg, const nb_tensor *t, const char *what) {
    NB_CHECK(pg != NULL, "%s: process group is NULL (is this rank a member of the subgroup?)", fn);
    nb__handle_check_live(fn, pg, "process group");
    NB_CHECK(t != NULL, "%s: %s is NULL", fn, what);
    NB_CHECK(nb_is_contiguous(t), "%s: %s must be contiguous (shape %s)", fn, what, nb_shape_str(t));
    NB_CHECK(nb_device_eq(t->device, pg->device),
             "%s: %s is on %s but the group's %s backend works on %s tensors", fn, what,
             nb_device_name(t->device), nb_pg_backend_name(pg->backend), nb_device_name(pg->device));
    NB_CHECK(dtype_ok(t->dtype), "%s: dtype %s of %s is not supported by collectives", fn,
             nb_dtype_name(t->dtype), what);
}

static void check_op(const char *fn, nb_reduce_op op, nb_dtype dtype) {
    NB_CHECK(op >= NB_REDUCE_SUM && op <= NB_REDUCE_MAX, "%s: unknown reduction %d", fn, (int)op);
    NB_CHECK(op != NB_REDUCE_AVG || nb_dtype_is_float(dtype),
             "%s: avg needs a floating dtype, got %s (sum, then divide as you see fit)", fn,
             nb_dtype_name(dtype));
}

nb_work *nb_pg_all_reduce(nb_pg *pg, nb_tensor *t, nb_reduce_op op) {
    const char *fn = "nb_pg_all_reduce";
    check_tensor(fn, pg, t, "tensor");
    check_op(fn, op, t->dtype);
    nb__values_written(t); /* Note [Parameter shadows] in tensor/shadow.c */
    nb__coll c = {NB__ALL_REDUCE, op, t->dtype, nb_numel(t), 0, t->data, NULL, 0};
    return nb__pg_issue(pg, &c);
}

nb_work *nb_pg_broadcast(nb_pg *pg, nb_tensor *t, int root) {
    const char *fn = "nb_pg_broadcast";
    check_tensor(fn, pg, t, "tensor");
    NB_CHECK(root >= 0 && root < pg->size, "%s: root %d is outside the group of %d ranks", fn, root,
             pg->size);
    nb__values_written(NULL); /* whatever it writes: Note [Parameter shadows] */
    nb__coll c = {NB__BROADCAST, NB_REDUCE_SUM, t->dtype, nb_numel(t), root, t->data, NULL, 0};
    return nb__pg_issue(pg, &c);
}

nb_work *nb_pg_all_gather(nb_pg *pg, nb_tensor *out, const nb_tensor *in) {
    const char *fn = "nb_pg_all_gather";
    check_tensor(fn, pg, out, "out");
    check_tensor(fn, pg, in, "in");
    NB_CHECK(out->dtype == in->dtype, "%s: out is %s but in is %s", fn, nb_dtype_name(out->dtype),
             nb_dtype_name(in->dtype));
    NB_CHECK(nb_numel(out) == (int64_t)pg->size * nb_numel(in),
             "%s: out %s has %" PRId64 " elements but %d ranks x in %s make %" PRId64, fn,
             nb_shape_str(out), nb_numel(out), pg->size, nb_shape_str(in),
             (int64_t)pg->size * nb_numel(in));
    nb__values_written(NULL); /* whatever it writes: Note [Parameter shadows] */
    nb__coll c = {NB__ALL_GATHER, NB_REDUCE_SUM, in->dtype, nb_numel(in), 0, out->data, in->data, 0};
    return nb__pg_issue(pg, &c);
}

nb_work *nb_pg_reduce_scatter(nb_pg *pg, nb_tensor *out, const nb_tensor *in, nb_reduce_op op) {
    const char *fn = "nb_pg_reduce_scatter";
    check_tensor(fn, pg, out, "out");
    check_tensor(fn, pg, in, "in");
    NB_CHECK(out->dtype == in->dtype, "%s: out is %s but in is %s", fn, nb_dtype_name(out->dtype),
             nb_dtype_name(in->dtype));
    check_op(fn, op, in->dtype);
    NB_CHECK(nb_numel(in) == (int64_t)pg->size * nb_numel(out),
             "%s: in %s has %" PRId64 " elements but %d ranks x out %s make %" PRId64, fn,
             nb_shape_str(in), nb_numel(in), pg->size, nb_shape_str(out),
             (int64_t)pg->size * nb_numel(out));
    nb__values_written(out); /* Note [Parameter shadows] in tensor/shadow.c */
    nb__coll c = {NB__REDUCE_SCATTER, op, in->dtype, nb_numel(out), 0, out->data, in->data, 0};
    return nb__pg_issue(pg, &c);
}

nb_work *nb_pg_barrier(nb_pg *pg) {
    NB_CHECK(pg != NULL, "nb_pg_barrier: process group is NULL (is this rank a member of the subgroup?)");
    nb__handle_check_live("nb_pg_barrier", pg, "process group");
    nb__coll c = {NB__BARRIER, NB_REDUCE_SUM, NB_I32, 0, 0, NULL, NULL, 0};
    return nb__pg_issue(pg, &c);
}

nb_status nb_pg_agree(nb_pg *pg, bool flag, bool *any, bool *all) {
    NB_CHECK(pg != NULL, "nb_pg_agree: process group is NULL (is this rank a member of the subgroup?)");
    int32_t votes = flag ? 1 : 0;
    nb_status st = pg->ops->agree(pg, &votes);
    if (st != NB_OK) return st;
    if (any) *any = votes > 0;
    if (all) *all = votes == pg->size;
    return NB_OK;
}

/* ---------------------------------------------------------------- set-up */

bool nb__pg_is_loopback(const char *addr) {
    return strncmp(addr, "127.", 4) == 0 || strcmp(addr, "localhost") == 0 || strcmp(addr, "::1") == 0;
}

/* Note [SIGPIPE]: Gloo writes to its sockets with write(2), which raises
 * SIGPIPE once a peer has died, and SIGPIPE's default action would kill
 * this process before the failure could be reported. Rather than change
 * the process's disposition, the threads that run Gloo code block it:
 * Gloo's event-loop thread (it inherits the mask of the thread that makes
 * the device), each group's worker (likewise), and the caller while it
 * connects or frees; a SIGPIPE raised on the caller meanwhile is discarded
 * before its mask is restored, and the write fails with EPIPE instead. */
static void sigpipe_block(sigset_t *old) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &s, old);
}

static void sigpipe_restore(const sigset_t *old) {
    if (!sigismember(old, SIGPIPE)) {
        sigset_t s, pending;
        sigemptyset(&s);
        sigaddset(&s, SIGPIPE);
        struct timespec zero = {0, 0};
        while (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) && sigtimedwait(&s, NULL, &zero) > 0) {
        }
    }
    pthread_sigmask(SIG_SETMASK, old, NULL);
}

/* The NCCL process group's table, which the CUDA backend carries (Note
 * [CUDA plugin] in tensor/cuda_plugin.h); NULL when it is not there. */
static const nb__pg_ops *nccl_ops(void) {
    const nb__cuda_plugin *p = nb__cuda_plugin_get();
    return p ? p->nccl : NULL;
}

const nb__pg_ops *nb__pg_ops_of(nb_pg_backend backend) {
    /* Every backend table has `run` or `launch`, and the exchange. */
    if (backend != NB_PG_NCCL) return &nb__pg_gloo_ops;
    const nb__pg_ops *ops = nccl_ops(); /* loaded by resolve_options */
    NB_CHECK(ops, "nb_pg_init: no nccl backend: %s", nb__cuda_plugin_error());
    return ops;
}

nb_status nb__pg_start_backend(nb_pg *pg, const char *prefix) {
    sigset_t old;
    sigpipe_block(&old);
    nb_status st = pg->ops->start(pg, prefix);
    if (st == NB_OK && pg->ops->run) {
        if (pthread_create(&pg->worker, NULL, worker_main, pg) != 0)
            st = nb_set_error(NB_ERR_INTERNAL, "nb_pg_init: cannot start the group's worker thread");
        else pg->worker_started = true;
    }
    sigpipe_restore(&old);
    return st;
}

/* Fresh group struct with its locks; the caller fills in the rest. */
nb_pg *nb__pg_alloc(nb_pg *root, nb_pg *parent, int rank, int size) {
    nb_pg *pg = calloc(1, sizeof *pg);
    NB_CHECK(pg != NULL, "nb_pg: out of memory");
    nb__handle_init(&pg->handle, "nb_pg_free");
    pg->global = calloc((size_t)size, sizeof *pg->global);
    NB_CHECK(pg->global != NULL, "nb_pg: out of memory");
    pg->root = root ? root : pg;
    pg->parent = parent;
    pg->rank = rank;
    pg->size = size;
    pthread_mutex_init(&pg->mu, NULL);
    pthread_cond_init(&pg->cond, NULL);
    pthread_mutex_init(&pg->watch_mu, NULL);
    pthread_mutex_init(&pg->monitor_mu, NULL);
    return pg;
}

static nb_status resolve_options(const nb_pg_options *opts, nb_pg_backend *backend, double *timeout) {
    nb_pg_options d = {NB_PG_AUTO, 0};
    if (!opts) opts = &d;
    NB_CHECK(opts->backend >= NB_PG_AUTO && opts->backend <= NB_PG_NCCL,
             "nb_pg_init: unknown backend %d", (int)opts->backend);
    NB_CHECK(opts->timeout_s >= 0, "nb_pg_init: timeout %g s must be >= 0", opts->timeout_s);
    *timeout = opts->timeout_s;
    if (*timeout == 0) {
        *timeout = 1800;
        const char *v = getenv("NABLA_PG_TIMEOUT");
        if (v && *v) {
            char *end;
            double t = strtod(v, &end);
            if (end == v || *end != 0 || !(t > 0))
                return nb_set_error(NB_ERR_INVALID,
                                    "nb_pg_init: NABLA_PG_TIMEOUT='%s' is not a positive number of seconds", v);
            *timeout = t;
        }
    }
    *backend = opts->backend;
    if (*backend == NB_PG_AUTO) *backend = nb__cuda_device_count() > 0 ? NB_PG_NCCL : NB_PG_GLOO;
    if (*backend == NB_PG_GLOO && !NABLA_HAVE_GLOO)
        return nb_set_error(NB_ERR_UNSUPPORTED,
                            "nb_pg_init: the gloo backend is not in this build (install libgloo-dev "
                            "and g++, and reconfigure)");
    if (*backend == NB_PG_NCCL && !nccl_ops())
        return nb_set_error(NB_ERR_UNSUPPORTED,
                            "nb_pg_init: the nccl backend is not available: %s%s",
                            nb__cuda_plugin_error(),
                            NABLA_HAVE_CUDA ? "" : " (configure with CUDA, cuDNN and NCCL present)");
    return NB_OK;
}

/* Note [Store access]: who may use the store (Note [Store authentication]
 * in store_server.c) and where it listens. A world on one node
 * (LOCAL_WORLD_SIZE == WORLD_SIZE) serves and reaches its store on a
 * Unix-domain socket named after the store's port in a folder of the
 * user's (Note [Store on one node] in store_unix.c), whatever MASTER_ADDR
 * says, so that neither another host nor another user can connect; the
 * secret is then optional (nbrun always gives one; torchrun, mpirun and
 * srun need none). NABLA_STORE_TRANSPORT=tcp keeps it on TCP loopback.
 * Over several nodes the store listens on every interface, and every rank
 * refuses to start without the run's secret unless
 * NABLA_STORE_TRUSTED_NETWORK=1. */
static nb_status store_access(const nb_dist_env *e, nb__store_secret *secret, const char **host,
                              char *unix_path, size_t path_len) {
    nb_status st = nb__store_secret_from_env(secret);
    if (st != NB_OK) {
        char why[NB__MSG_LEN];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_pg_init: %s", why);
    }
    bool one_node = e->local_world_size == e->world_size, use_unix = false;
    *host = !one_node || nb__pg_is_loopback(e->master_addr) ? e->master_addr : "127.0.0.1";
    unix_path[0] = '\0';
    st = nb__store_transport_unix(one_node, &use_unix);
    if (st == NB_OK && use_unix) st = nb__store_unix_path(e->store_port, unix_path, path_len);
    if (st != NB_OK) {
        char why[NB__MSG_LEN];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_pg_init: %s", why);
    }
    if (!one_node && !secret->len && !nb__store_trusted_network())
        return nb_set_error(NB_ERR_INVALID,
                            "nb_pg_init: a run over several nodes (WORLD_SIZE=%d, LOCAL_WORLD_SIZE=%d) "
                            "needs the run's secret, so that only its processes can use the store "
                            "rank 0 serves on port %d: set NABLA_STORE_SECRET_FILE to a file only you "
                            "can read, holding the same secret on every node (or NABLA_STORE_SECRET), "
                            "or NABLA_STORE_TRUSTED_NETWORK=1 if only trusted machines can reach "
                            "%s (docs/distributed.md, \"Security\")",
                            e->world_size, e->local_world_size, e->store_port, e->master_addr);
    return NB_OK;
}

static nb_status start_store(nb_pg *pg, const nb__store_config *cfg, const char *host, int *port) {
    const nb_dist_env *e = &pg->env;
    *port = e->store_port;
    if (e->rank != 0) return NB_OK;
    const char *fd_s = getenv("NABLA_STORE_FD");
    nb_status st;
    if (fd_s && *fd_s) {
        char *end;
        long fd = strtol(fd_s, &end, 10);
        if (end == fd_s || *end != 0 || fd < 0)
            return nb_set_error(NB_ERR_INVALID, "nb_pg_init: NABLA_STORE_FD='%s' is not a descriptor", fd_s);
        st = nb__store_server_start(&pg->server, NULL, 0, (int)fd, cfg);
        unsetenv("NABLA_STORE_FD"); /* it is ours now; children must not see it */
    } else if (cfg->unix_path) {
        return nb__store_server_start(&pg->server, NULL, e->store_port, -1, cfg);
    } else {
        const char *bind = nb__pg_is_loopback(host) ? host : "0.0.0.0";
        st = nb__store_server_start(&pg->server, bind, e->store_port, -1, cfg);
    }
    if (st != NB_OK) return st;
    if (!cfg->unix_path) *port = nb_store_server_port(pg->server);
    return NB_OK;
}

/* `stuck`: the worker is still blocked in the transport (Note [Stuck worker]);
 * what it touches (the group struct, its locks, the Gloo context) is
 * left allocated. */
static void free_group(nb_pg *pg, bool stuck) {
    sigset_t old;
    sigpipe_block(&old);
    if (pg->ops) pg->ops->free(pg, stuck);
    if (pg->root == pg) {
        nb__hb_stop(pg);
        nb_store_close(pg->store_monitor);
        nb_store_close(pg->store_main);
        nb_store_server_stop(pg->server);
    }
    sigpipe_restore(&old);
    if (stuck) return;
    pthread_mutex_destroy(&pg->mu);
    pthread_cond_destroy(&pg->cond);
    pthread_mutex_destroy(&pg->watch_mu);
    pthread_mutex_destroy(&pg->monitor_mu);
    free(pg->global);
    nb__handle_retire(pg); /* Note [Freed handles] */
}

nb_status nb_pg_init_env(nb_pg **out, const nb_dist_env *env, const nb_pg_options *opts) {
    NB_CHECK(out != NULL && env != NULL, "nb_pg_init: NULL argument");
    *out = NULL;
    nb__launcher_lifeline();
    nb_pg_backend backend = NB_PG_GLOO;
    double timeout = 0;
    nb_status st = resolve_options(opts, &backend, &timeout);
    if (st != NB_OK) return st;
    nb_pg *pg = nb__pg_alloc(NULL, NULL, env->rank, env->world_size);
    snprintf(pg->name, sizeof pg->name, "world");
    for (int r = 0; r < pg->size; r++) pg->global[r] = r;
    pg->env = *env;
    pg->backend = backend;
    pg->base = pg->ops = nb__pg_ops_of(backend);
    pg->timeout_s = timeout;
    st = nb__liveness_options(&pg->liveness_s, &pg->join_s, &pg->stall_s);
    if (st == NB_OK) st = nb__dist_check_option(&pg->check);
    if (st == NB_OK && pg->check != NB__CHECK_OFF) pg->ops = nb__pg_checked(pg->base);
    if (st == NB_OK) st = nb_dist_select_device(env, backend == NB_PG_NCCL, &pg->device);
    int port = 0;
    const char *host = env->master_addr;
    nb__store_secret secret;
    memset(&secret, 0, sizeof secret);
    char unix_path[128] = "";
    if (st == NB_OK) st = store_access(env, &secret, &host, unix_path, sizeof unix_path);
    nb__store_config cfg = {.run_id = env->run_id, .secret = secret.bytes, .secret_len = secret.len,
                            .world_size = env->world_size, .unix_path = unix_path[0] ? unix_path : NULL};
    pg->store_secret = secret.len > 0;
    if (st == NB_OK) st = start_store(pg, &cfg, host, &port);
    double join = pg->join_s;
    if (st == NB_OK) st = nb__store_connect(&pg->store_main, host, port, &cfg, env->rank, join);
    if (st == NB_ERR_MISMATCH) {
        /* refused (Note [Joining]): what this process has, beside what the store said */
        char why[NB__MSG_LEN];
        snprintf(why, sizeof why, "%s", nb_last_error());
        st = nb_set_error(st, "%s; this process has WORLD_SIZE=%d", why, env->world_size);
    }
    nb__store_wipe(&secret, sizeof secret);
    if (st == NB_OK) st = nb__store_connect_like(&pg->store_monitor, pg->store_main, -1, join);
    if (st == NB_OK) {
        nb__store_set_timeout(pg->store_main, timeout);
        nb__store_set_timeout(pg->store_monitor, timeout);
        st = nb__hb_start(pg);
    }
    if (st == NB_OK) st = nb__join(pg);
    if (st == NB_OK) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "nb/%s/world/", nb_pg_backend_name(backend));
        st = nb__pg_start_backend(pg, prefix);
    }
    if (st != NB_OK) {
        char msg[NB__MSG_LEN];
        snprintf(msg, sizeof msg, "%s", nb_last_error());
        pthread_mutex_lock(&pg->mu);
        pg->stopping = true;
        pthread_cond_broadcast(&pg->cond);
        pthread_mutex_unlock(&pg->mu);
        stop_worker(pg);
        free_group(pg, false);
        return nb_set_error(st, "%s", msg);
    }
    *out = pg;
    return NB_OK;
}

nb_status nb_pg_init(nb_pg **out, const nb_pg_options *opts) {
    NB_CHECK(out != NULL, "nb_pg_init: out is NULL");
    *out = NULL;
    nb_dist_env env;
    nb_status st = nb_dist_env_read(&env);
    if (st != NB_OK) return st;
    return nb_pg_init_env(out, &env, opts);
}

/* ---------------------------------------------------------------- shut-down */

/* Every rank counts itself out; the last one sets nb/exit/done, which
 * rank 0 waits for before it stops serving the store. */
static nb_status exit_handshake(nb_pg *pg) {
    int64_t n = 0;
    nb_status st = nb_store_add(pg->store_main, "nb/exit", 1, &n);
    if (st == NB_OK && n == pg->size) st = nb_store_set(pg->store_main, "nb/exit/done", "1", 1);
    if (st == NB_OK && pg->rank == 0) {
        void *v = NULL;
        st = nb_store_get(pg->store_main, "nb/exit/done", pg->timeout_s, &v, NULL);
        free(v);
    }
    if (st != NB_OK) {
        char why[NB__MSG_LEN];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st, "nb_pg_free: the run did not shut down cleanly: %s", why);
    }
    return NB_OK;
}

nb_status nb_pg_free(nb_pg *pg) {
    if (!pg) return NB_OK;
    NB__CHECK_HANDLE("nb_pg_free", pg, "process group"); /* freed twice: Note [Freed handles] */
    NB_CHECK(pg->n_children == 0, "nb_pg_free: group '%s' still has %d subgroup%s; free them first",
             pg->name, pg->n_children, pg->n_children == 1 ? "" : "s");
    double pause = 2e-5;
    pthread_mutex_lock(&pg->mu);
    while (pg->q_head && pg->broken == NB_OK) wait_round(pg, &pause);
    pg->stopping = true;
    pthread_cond_broadcast(&pg->cond);
    pthread_mutex_unlock(&pg->mu);
    bool stuck = stop_worker(pg);
    pthread_mutex_lock(&pg->mu);
    while (pg->q_head && !stuck) nb__pg_finish_locked(pg, pg->q_head, pg->broken, pg->broken_msg);
    nb_status st = pg->broken;
    char msg[NB__MSG_LEN];
    snprintf(msg, sizeof msg, "%s", pg->broken_msg);
    pthread_mutex_unlock(&pg->mu);
    if (pg->parent) pg->parent->n_children--;
    if (pg->root == pg && st == NB_OK) {
        st = exit_handshake(pg);
        snprintf(msg, sizeof msg, "%s", nb_last_error());
    }
    free_group(pg, stuck);
    if (st != NB_OK) return nb_set_error(st, "%s", msg);
    return NB_OK;
}
