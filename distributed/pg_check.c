/* The collective checks, a layer around any process-group backend (the
 * idea of c10d's ProcessGroupWrapper): before a collective's data move,
 * every rank's header goes to every other and each rank compares them,
 * through the backend's small exchange (xpost/xtest in pg.h). With
 * NABLA_DIST_CHECK=off the layer is absent: pg.c calls the backend's
 * table directly, and what the backend computes does not depend on it.
 * The backend may send a collective's data in the same message as its
 * header when its own algorithm would move them in one message anyway
 * (Gloo's small collectives), so that a checked one costs one exchange;
 * the layer never looks at them.
 *
 * Note [Collective headers]
 * Before any of its data moves, a collective's header (kind, reduction,
 * dtype, count, root: nb__coll_header, 48 bytes) goes from every rank of
 * the group to every other, one message per pair, all in flight at once:
 * one network latency, no store round trip. Every rank then holds
 * the same headers and reaches the same verdict. If they are all equal,
 * the data collective runs; if not, every rank fails with
 * NB_ERR_MISMATCH, naming the ranks and what each issued
 * (nb__diag_mismatch in pg_diag.c), and no buffer has changed (a small
 * collective's data may have travelled with the header, Note [Small
 * collectives in one message] in pg_gloo.c; what arrived is not used:
 * every message of the exchange has one size, so ranks that disagree on
 * a count, within the small limit or across it, still meet). Without this,
 * Gloo met a count that differs between ranks with an exception on its
 * own event-loop thread, which ends the process (Note [No exception
 * crosses the shim] in gloo_shim.cpp), or, for a broadcast whose root
 * sends fewer elements than the others expect, reported success and left
 * the tail of their buffers stale; NCCL hangs or reads past the smaller
 * buffer.
 *
 * The exchange is also the barrier (when it returns, every rank has
 * arrived), and collectives of no elements exchange headers too: a rank
 * that all-reduces 0 elements while another all-reduces 10 is a mismatch.
 * What it cannot see is a rank that never arrives: the watchdog and the
 * flight recorder name it (Note [Hang diagnostics] in pg_diag.c).
 *
 * On a backend whose collectives run on the group's worker (Gloo), the
 * check costs one message latency, and less for a run of collectives
 * issued back to back: when a collective's data start to move, the layer
 * posts the header exchanges of the collectives queued behind it, and each
 * waits for its own instead of starting one, so the run pays the header's
 * latency about once (pg->stats.headers_early counts them), and a run of
 * small ones, whose data travel with their headers, about one latency in
 * all (DDP's buffer broadcasts); not from the first small one that reads
 * what the running collective or one queued before it writes (its data are
 * not there yet).
 *
 * Note [Which collectives are checked]
 * A backend that launches from the issuing thread (NCCL) can check only by
 * stalling that thread: the headers go through the communicator, on the
 * group's stream (an all-gather of 48 bytes per rank, copied back to
 * pinned host memory), and the host must see them before it enqueues the
 * data. The stream runs the exchange after the group's earlier
 * collectives, which wait for the compute stream, so the stall is not one
 * network latency but the drain of everything queued before it: on DDP's
 * buckets it would take away the host's lead over the GPU at every
 * bucket. So, under NABLA_DIST_CHECK=auto (the default), such a group
 * checks:
 *   - every broadcast: a mismatched broadcast is the one that can finish
 *     "successfully" with stale data, and broadcasts are rare (DDP's
 *     parameters and buffers at construction, a checkpoint's state);
 *   - its first NB__CHECK_FIRST (16) collectives: the set-up (DDP's
 *     verification of shapes across ranks, parameter broadcast) and the
 *     first steps, where a model or batch that differs between ranks
 *     shows up; later, a collective that differs (a branch taken on one
 *     rank only) hangs and is named by the flight recorder (Note [Hang
 *     diagnostics], about a second) or the timeout.
 * A backend with a worker (Gloo) checks every collective under auto.
 * NABLA_DIST_CHECK=full checks every collective on every backend
 * (debugging; on NCCL the stall at each); off removes the layer (a
 * mismatch is then the transport's error, or stale data after a
 * broadcast). Whether to check must be the same decision on every rank,
 * or one rank's header exchange would meet another's data: it depends
 * only on the sequence number, the option (the same on every rank, as the
 * launcher sets it), the backend and the kind, which differs only when
 * the ranks already disagree on the collective, where the backend's
 * behaviour is undefined with or without the check. The issuing thread's
 * wait polls the exchange and runs the watchdog, as nb_work_wait does, so
 * a rank that never arrives is named at the timeout and a dead one at
 * once. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/pg.h"

#define HB (NB__COLL_HEADER_WORDS * sizeof(int64_t))

/* A header exchange in flight: the backend's handle and every rank's
 * headers' buffer. */
typedef struct posted {
    void *x;
    int64_t *all;
} posted;

static bool wanted(const nb_pg *pg, const nb__coll *c) {
    return pg->size > 1 && nb__coll_header_wanted(pg->root->check, pg->base->run != NULL, c);
}

static nb_status post(nb_pg *pg, nb_work *w, posted **out) {
    posted *p = calloc(1, sizeof *p);
    NB_CHECK(p != NULL, "nb_pg: out of memory for %d collective headers", pg->size);
    p->all = malloc((size_t)pg->size * HB);
    NB_CHECK(p->all != NULL, "nb_pg: out of memory for %d collective headers", pg->size);
    int64_t mine[NB__COLL_HEADER_WORDS];
    nb__coll_header(&w->coll, mine);
    nb_status st = pg->base->xpost(pg, w, mine, p->all, HB, &p->x);
    if (st != NB_OK) {
        free(p->all);
        free(p);
        return st;
    }
    *out = p;
    return NB_OK;
}

/* `x_done`: the backend's exchange is over (xtest returned non-zero). */
static void release(const nb__pg_ops *base, posted *p, bool x_done) {
    if (!p) return;
    if (!x_done) base->xdrop(p->x);
    free(p->all);
    free(p);
}

/* Exchanges w's header with every member's (or finishes the exchange
 * posted early) and compares them. On failure `what` says what happened,
 * or, with *explained, is the whole message. */
static nb_status gate(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained) {
    *explained = false;
    if (!wanted(pg, &w->coll)) return NB_OK;
    posted *p = w->check;
    w->check = NULL;
    if (p) pg->stats.headers_early++;
    nb_status st = p ? NB_OK : post(pg, w, &p);
    int r = st == NB_OK ? pg->base->xtest(pg, p->x) : (int)st;
    double pause = 2e-5;
    while (r == 0) {
        if (!nb__pg_wait_step(pg, &pause)) {
            release(pg->base, p, false);
            pthread_mutex_lock(&pg->mu);
            st = pg->broken;
            snprintf(what, len, "%s", pg->broken_msg);
            pthread_mutex_unlock(&pg->mu);
            *explained = true;
            return st;
        }
        r = pg->base->xtest(pg, p->x);
    }
    if (r < 0) {
        snprintf(what, len, "failed in the transport (%s)", nb_last_error());
        release(pg->base, p, true);
        return (nb_status)r;
    }
    st = nb__diag_headers(pg, w, p->all, what, len);
    *explained = st != NB_OK;
    release(pg->base, p, true);
    return st;
}

/* The bytes c reads and those it writes, as [lo, hi). */
typedef struct span {
    uintptr_t lo, hi;
} span;

static span span_of(const void *p, size_t n) { return (span){(uintptr_t)p, (uintptr_t)p + n}; }

static span reads(const nb__coll *c, int R) {
    size_t b = (size_t)c->count * nb_dtype_size(c->dtype);
    switch (c->kind) {
    case NB__ALL_REDUCE:
    case NB__BROADCAST: return span_of(c->out, b);
    case NB__ALL_GATHER: return span_of(c->in, b);
    case NB__REDUCE_SCATTER: return span_of(c->in, b * (size_t)R);
    case NB__BARRIER: break;
    }
    return span_of(NULL, 0);
}

static span writes(const nb__coll *c, int R) {
    size_t b = (size_t)c->count * nb_dtype_size(c->dtype);
    switch (c->kind) {
    case NB__ALL_REDUCE:
    case NB__BROADCAST:
    case NB__REDUCE_SCATTER: return span_of(c->out, b);
    case NB__ALL_GATHER: return span_of(c->out, b * (size_t)R);
    case NB__BARRIER: break;
    }
    return span_of(NULL, 0);
}

/* While w's data move, the headers of the collectives queued behind it
 * can travel: posted now (up to EARLY_MAX of them), each waited for when
 * it runs. Not from the first one whose data the backend sends with its
 * header (xcarries in pg.h) that reads what w or one queued before it
 * writes (the same tensor all-reduced twice in a row): they are not there
 * yet. */
#define EARLY_MAX 32

static bool disjoint(span a, span b) { return a.hi <= b.lo || b.hi <= a.lo; }

static void post_queued(nb_pg *pg, const nb_work *w) {
    nb_work *go[EARLY_MAX];
    int k = 0;
    pthread_mutex_lock(&pg->mu);
    for (nb_work *n = w->next; n && k < EARLY_MAX && pg->broken == NB_OK; n = n->next) {
        if (n->state != NB__W_QUEUED || !wanted(pg, &n->coll)) break;
        if (pg->base->xcarries && pg->base->xcarries(pg, n)) {
            span r = reads(&n->coll, pg->size);
            bool clear = disjoint(r, writes(&w->coll, pg->size));
            for (int i = 0; i < k && clear; i++) clear = disjoint(r, writes(&go[i]->coll, pg->size));
            if (!clear) break;
        }
        __atomic_add_fetch(&n->refs, 1, __ATOMIC_ACQ_REL);
        go[k++] = n;
    }
    pthread_mutex_unlock(&pg->mu);
    for (int i = 0; i < k; i++) {
        posted *p = NULL;
        /* a failure here shows again when the collective runs its own exchange */
        if (!go[i]->check && post(pg, go[i], &p) == NB_OK) go[i]->check = p;
        nb__work_put(go[i]);
    }
}

static nb_status check_run(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained) {
    nb_status st = gate(pg, w, what, len, explained);
    if (st != NB_OK) return st;
    if (w->coll.count > 0 && w->coll.kind != NB__BARRIER) post_queued(pg, w);
    return pg->base->run(pg, w, what, len, explained);
}

static void check_launch(nb_pg *pg, nb_work *w) {
    char what[NB__MSG_LEN];
    bool explained;
    nb_status st = gate(pg, w, what, sizeof what, &explained);
    if (st == NB_OK) {
        pg->base->launch(pg, w);
        return;
    }
    if (explained) nb__pg_break(pg, st, what);
    else nb__pg_fail(pg, w, st, what);
    pthread_mutex_lock(&pg->mu);
    nb__pg_finish_locked(pg, w, pg->broken, pg->broken_msg);
    pthread_mutex_unlock(&pg->mu);
}

/* A work that never ran (its group broke) may hold an exchange posted early. */
static void check_work_free(nb_work *w) {
    release(w->base, w->check, false);
    w->check = NULL;
    if (w->base->work_free) w->base->work_free(w);
}

/* One table per backend, made at its first use, kept for the process
 * (a work handle may outlive its group). */
const nb__pg_ops *nb__pg_checked(const nb__pg_ops *base) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static struct {
        const nb__pg_ops *base;
        nb__pg_ops layer;
    } made[4];
    static int n_made;
    pthread_mutex_lock(&mu);
    const nb__pg_ops *out = NULL;
    for (int i = 0; i < n_made && !out; i++)
        if (made[i].base == base) out = &made[i].layer;
    if (!out) {
        NB_CHECK(n_made < 4, "nb_pg: more than 4 process-group backends");
        nb__pg_ops *t = &made[n_made].layer;
        made[n_made++].base = base;
        *t = *base;
        if (base->run) t->run = check_run;
        if (base->launch) t->launch = check_launch;
        t->work_free = check_work_free;
        out = t;
    }
    pthread_mutex_unlock(&mu);
    return out;
}
