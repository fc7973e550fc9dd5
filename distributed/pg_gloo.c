/* The Gloo backend of process groups (CPU tensors): the group's worker
 * thread that runs its collectives one after another in issue order
 * (Gloo calls block), the connection of the group's mesh, and the
 * backend table entries pg.c calls (nb__pg_gloo_ops). The transport
 * itself is the C++ shim, gloo_shim.cpp. */
#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "distributed/pg.h"

#define SLICE_S 0.05      /* how often a waiting thread wakes to watch */
#define STUCK_WAIT_S 2.0  /* Note [Stuck worker] */

/* Note [Collective headers]
 * Before any of its data moves, a collective's header (kind, reduction,
 * dtype, count, root: nb__coll_header, 48 bytes) goes from every rank of
 * the group to every other, one message per pair, all in flight at once:
 * one network latency, no store round trip, no data. Every rank then holds
 * the same headers and reaches the same verdict. If they are all equal,
 * the data collective runs; if not, every rank fails with
 * NB_ERR_MISMATCH, naming the ranks and what each issued, and no data has
 * moved. Without this, Gloo met a count that differs between ranks with
 * an exception on its own event-loop thread, which ends the process
 * (Note [No exception crosses the shim] in gloo_shim.cpp), or, for a
 * broadcast whose root sends fewer elements than the others expect,
 * reported success and left the tail of their buffers stale.
 *
 * The exchange is also the barrier (when it returns, every rank has
 * arrived), and collectives of no elements exchange headers too: a rank
 * that all-reduces 0 elements while another all-reduces 10 is a mismatch.
 * What it cannot see is a rank that never arrives: the fingerprints in
 * the store (Note [Hang diagnostics] in pg_diag.c) still name it. It
 * costs one message latency per collective, except for small ones, whose
 * data travel in the same message (Note [Small collectives ride on the
 * header]); benchmarks/RESULTS.md has the figures.
 * NABLA_DIST_CHECK=off skips it; NCCL groups compare the same headers
 * with the same code, on fewer collectives (Note [Collective headers on
 * NCCL] in pg.c). */
/* Note [Small collectives ride on the header]
 * The header exchange is one message from each rank to each other, and
 * under load its latency is that of a small collective itself (measured
 * in benchmarks/RESULTS.md: 2-8 ms more per small all-reduce on a busy
 * 2-core machine, about doubling it). So the message carries more than
 * the header: a payload of P bytes, P = min(4096, 16384 / (R - 1)) rounded
 * down to 8 (so that a rank sends at most 16 KB more per collective in
 * any world), which is the collective's own data when it fits:
 *   all-reduce and all-gather: the rank's elements; broadcast: the root's;
 *   reduce-scatter: the rank's whole input (R chunks);
 * and zeros otherwise. Every message has the same size whatever the
 * collective (P depends on R only), so a mismatch cannot make Gloo's
 * event loop meet a message of another size (Note [No exception crosses
 * the shim] in gloo_shim.cpp). When the headers agree and the data fit,
 * every rank computes the result from the payloads it received: the
 * reduction in rank order (0, 1, ..., R - 1, the same on every rank, so
 * every rank gets the same bits), the root's elements, or the
 * concatenation; no Gloo collective runs. A small collective then costs
 * one message latency in all, less than Gloo's own algorithms took
 * before there was a header (a ring of 2 (R - 1) steps). Each message
 * also carries a flag (8 bytes after the header: the payload holds the
 * data); the data are used only when every rank's flag is set, which
 * every rank sees alike.
 * A larger collective pays one latency more, unless it was issued while
 * the previous one was running: when a collective's data start to move,
 * the worker posts the header exchange of the next queued collective of
 * the group (without its data, which the running one may still be
 * writing; flag clear), and that collective waits for it instead of
 * starting one. A run of collectives issued back to back (DDP's buckets,
 * the benchmark) so pays the header's latency about once; one issued
 * after waiting for the last still pays it. */
static size_t payload_bytes(int R) {
    size_t p = 16384 / (size_t)(R > 1 ? R - 1 : 1);
    return (p > 4096 ? 4096 : p) & ~(size_t)7;
}

/* The bytes of c's data this rank sends for the payload. */
static size_t data_bytes(const nb__coll *c, int R) {
    size_t n = (size_t)c->count * nb_dtype_size(c->dtype);
    switch (c->kind) {
    case NB__ALL_REDUCE:
    case NB__BROADCAST:
    case NB__ALL_GATHER: return n;
    case NB__REDUCE_SCATTER: return n * (size_t)R;
    case NB__BARRIER: return 0;
    }
    return n;
}

/* The result of c on this rank from every rank's payload (rank r's at
 * pay + r * stride). */
static void finish_from_payloads(nb_pg *pg, const nb__coll *c, const unsigned char *pay, size_t stride) {
    size_t n = (size_t)c->count, b = n * nb_dtype_size(c->dtype);
    int R = pg->size;
    switch (c->kind) {
    case NB__ALL_REDUCE:
        memcpy(c->out, pay, b);
        for (int r = 1; r < R; r++) nb__reduce_into(c->dtype, c->op, c->out, pay + (size_t)r * stride, n);
        break;
    case NB__BROADCAST:
        memcpy(c->out, pay + (size_t)c->root * stride, b);
        break;
    case NB__ALL_GATHER:
        for (int r = 0; r < R; r++) memcpy((unsigned char *)c->out + (size_t)r * b, pay + (size_t)r * stride, b);
        break;
    case NB__REDUCE_SCATTER: {
        size_t mine = (size_t)pg->rank * b;
        memcpy(c->out, pay + mine, b);
        for (int r = 1; r < R; r++)
            nb__reduce_into(c->dtype, c->op, c->out, pay + (size_t)r * stride + mine, n);
        break;
    }
    case NB__BARRIER: break;
    }
}

#define HB (NB__COLL_HEADER_WORDS * sizeof(int64_t))
#define FLAG_BYTES 8 /* after the header: 1 when the payload holds the data */

/* One rank's message: its header, the flag, the payload (Note [Small
 * collectives ride on the header]). */
static size_t stride_of(int R) { return HB + FLAG_BYTES + payload_bytes(R); }

/* Starts w's exchange: its header, and its data when `with_data` and they
 * fit. *all: the R messages' buffer (malloc'd). */
static nb_status post_exchange(nb_pg *pg, const nb_work *w, bool with_data, nb__gloo_xchg **x,
                               unsigned char **all) {
    const nb__coll *c = &w->coll;
    int R = pg->size;
    size_t stride = stride_of(R), data = data_bytes(c, R);
    unsigned char *mine = calloc(1, stride);
    *all = malloc((size_t)R * stride);
    NB_CHECK(mine && *all, "nb_pg: out of memory for %d collective headers", R);
    nb__coll_header(c, (int64_t *)mine);
    if (with_data && c->count > 0 && data <= payload_bytes(R)) {
        mine[HB] = 1;
        if (c->kind != NB__BROADCAST || c->root == pg->rank)
            memcpy(mine + HB + FLAG_BYTES, c->kind == NB__ALL_REDUCE || c->kind == NB__BROADCAST ? c->out : c->in,
                   data);
    }
    nb_status st = nb__gloo_exchange_post(pg->gloo, mine, *all, stride, c->seq, x);
    free(mine);
    return st;
}

/* Note [Collective headers], [Small collectives ride on the header]:
 * exchanges headers (and payloads), or finishes the exchange posted
 * earlier; *done when the collective completed from the payloads. */
static nb_status check_headers(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained, bool *done) {
    const nb__coll *c = &w->coll;
    int R = pg->size;
    size_t stride = stride_of(R);
    nb__gloo_xchg *x = w->posted;
    unsigned char *all = w->posted_all;
    if (x) pg->headers_early++;
    w->posted = NULL;
    w->posted_all = NULL;
    nb_status st = x ? NB_OK : post_exchange(pg, w, true, &x, &all);
    if (st == NB_OK) st = nb__gloo_exchange_wait(pg->gloo, x);
    if (st != NB_OK) {
        snprintf(what, len, "failed in the transport (%s)", nb_last_error());
        free(all); /* the exchange is gone: the transport no longer writes it */
        return st;
    }
    int64_t *heads = malloc((size_t)R * HB);
    NB_CHECK(heads != NULL, "nb_pg: out of memory for %d collective headers", R);
    bool payloads = true;
    for (int r = 0; r < R; r++) {
        memcpy((unsigned char *)heads + (size_t)r * HB, all + (size_t)r * stride, HB);
        payloads = payloads && all[(size_t)r * stride + HB] == 1;
    }
    st = nb__diag_headers(pg, w, heads, what, len);
    *explained = st != NB_OK;
    /* the headers agree and every rank sees every flag: the same decision everywhere */
    if (st == NB_OK && payloads) {
        finish_from_payloads(pg, c, all + HB + FLAG_BYTES, stride);
        pg->from_header++;
        *done = true;
    }
    free(heads);
    free(all);
    return st;
}

/* While w's data move, the next queued collective's header can travel:
 * posted now (without its data, which w may still be writing), waited
 * for when it runs, so a run of collectives issued back to back pays the
 * header's latency once. */
static void post_next(nb_pg *pg, const nb_work *w) {
    pthread_mutex_lock(&pg->mu);
    nb_work *n = w->next;
    bool go = n && n->state == NB__W_QUEUED && !n->posted && pg->broken == NB_OK &&
              nb__coll_header_wanted(pg->root->check, true, &n->coll);
    if (go) __atomic_add_fetch(&n->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&pg->mu);
    if (!go) return;
    nb__gloo_xchg *x = NULL;
    unsigned char *all = NULL;
    /* a failure here shows again when n runs its own exchange */
    if (post_exchange(pg, n, false, &x, &all) == NB_OK) {
        n->posted = x;
        n->posted_all = all;
    } else {
        free(all);
    }
    nb__work_put(n);
}

/* Runs w; on failure `what` says what happened, or, with *explained set,
 * is the whole message. */
static nb_status run_gloo(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained) {
    const nb__coll *c = &w->coll;
    *explained = false;
    nb__diag_record(pg, w);
    bool check = pg->size > 1 && nb__coll_header_wanted(pg->root->check, true, c), done = false;
    nb_status st = check ? check_headers(pg, w, what, len, explained, &done) : NB_OK;
    if (st != NB_OK) return st;
    if (c->kind == NB__BARRIER || c->count == 0) return NB_OK;
    if (!done) {
        if (pg->size > 1) post_next(pg, w);
        st = nb__gloo_run(pg->gloo, c);
    }
    if (st == NB_OK) {
        if (c->op == NB_REDUCE_AVG && (c->kind == NB__ALL_REDUCE || c->kind == NB__REDUCE_SCATTER))
            nb__scale_down(c->dtype, c->out, (size_t)c->count, (double)pg->size);
        return NB_OK;
    }
    if (st == NB_ERR_TIMEOUT)
        snprintf(what, len, "did not complete within %.1f s (the transport timed out: %s)", pg->timeout_s,
                 nb_last_error());
    else
        snprintf(what, len, "failed in the transport (%s)", nb_last_error());
    return st;
}

static void *gloo_worker(void *arg) {
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
            bool explained;
            st = run_gloo(pg, w, what, sizeof what, &explained);
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

/* An address of this host that reaches `master` (the source address the
 * kernel would pick); what the Gloo device listens on. */
static void local_address(const char *master, char *out, size_t len) {
    snprintf(out, len, "127.0.0.1");
    if (nb__pg_is_loopback(master)) return;
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    if (getaddrinfo(master, "9", &hints, &res) != 0) return;
    int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
            const void *a = ss.ss_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)&ss)->sin6_addr
                                                     : (const void *)&((struct sockaddr_in *)&ss)->sin_addr;
            inet_ntop(ss.ss_family, a, out, (socklen_t)len);
        }
    }
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
}

static nb_status gloo_start(nb_pg *pg, const char *prefix) {
    nb_pg *root = pg->root;
    nb_status st;
    if (!root->gloo_dev) {
        char host[256];
        local_address(root->env.master_addr, host, sizeof host);
        const char *iface = getenv("NABLA_SOCKET_IFNAME");
        st = nb__gloo_dev_new(&root->gloo_dev, host, iface ? iface : "");
        if (st != NB_OK) return st;
    }
    /* The set-up (the others' addresses, the connections to them) is
     * bounded by the join limit, not the progress timeout: every member has
     * arrived already (nb__join, or the list check of nb_pg_new_group). */
    double connect_s = root->join_s < pg->timeout_s ? root->join_s : pg->timeout_s;
    st = nb__gloo_connect(&pg->gloo, root->gloo_dev, root->store_main, prefix, pg->rank, pg->size,
                          pg->timeout_s, connect_s);
    if (st != NB_OK) {
        char why[NB__MSG_LEN], host[256];
        snprintf(why, sizeof why, "%s", nb_last_error());
        local_address(root->env.master_addr, host, sizeof host);
        const char *iface = getenv("NABLA_SOCKET_IFNAME");
        bool named = iface && *iface;
        return nb_set_error(st, "%s (within %g s, %s; this rank listens on %s%s%s: every node must reach the "
                                "others' addresses on ports the kernel picks; NABLA_SOCKET_IFNAME chooses the "
                                "interface)",
                            why, connect_s, connect_s < pg->timeout_s ? "NABLA_JOIN_TIMEOUT" : "NABLA_PG_TIMEOUT",
                            named ? "interface " : "", named ? iface : host, named ? " (NABLA_SOCKET_IFNAME)" : "");
    }
    if (pthread_create(&pg->worker, NULL, gloo_worker, pg) != 0)
        return nb_set_error(NB_ERR_INTERNAL, "nb_pg_init: cannot start the group's worker thread");
    pg->worker_started = true;
    return NB_OK;
}

/* The worker takes it from the queue. */
static void gloo_submit(nb_pg *pg, nb_work *w) {
    (void)w;
    pthread_mutex_lock(&pg->mu);
    pthread_cond_broadcast(&pg->cond);
    pthread_mutex_unlock(&pg->mu);
}

/* The worker signals pg->cond when a work finishes. */
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

static void gloo_wait_slice(nb_pg *pg, double *pause) {
    (void)pause;
    wait_one_slice(pg);
}

/* Note [Stuck worker]: after a failure, the Gloo worker may be blocked
 * inside a collective whose peer is stopped rather than dead (its sockets
 * stay open), until Gloo's own timeout, the progress timeout (30 minutes
 * by default). nb_pg_free of a broken group waits a moment for the worker
 * and then detaches it, leaving the group's struct and Gloo context
 * allocated for it, so that a program that reports a failure and cleans
 * up is not held for the timeout. The process is expected to exit soon. */
static bool worker_stuck(nb_pg *pg) {
    pthread_mutex_lock(&pg->mu);
    double deadline = nb__now() + STUCK_WAIT_S;
    while (pg->broken != NB_OK && !pg->worker_done && nb__now() < deadline) wait_one_slice(pg);
    bool stuck = pg->broken != NB_OK && !pg->worker_done;
    pthread_mutex_unlock(&pg->mu);
    if (stuck) pthread_detach(pg->worker);
    return stuck;
}

/* With pg->stopping set: joins the worker, or detaches it when stuck. */
static bool gloo_stop(nb_pg *pg) {
    if (!pg->worker_started) return false;
    bool stuck = worker_stuck(pg);
    if (!stuck) pthread_join(pg->worker, NULL);
    pg->worker_started = false;
    return stuck;
}

static void gloo_free(nb_pg *pg, bool stuck) {
    if (pg->gloo && !stuck) nb__gloo_free(pg->gloo);
}

static nb_status gloo_agree(nb_pg *pg, int32_t *votes) {
    nb__coll c = {NB__ALL_REDUCE, NB_REDUCE_SUM, NB_I32, 1, 0, votes, NULL, 0};
    return nb_work_finish(nb__pg_issue(pg, &c));
}

/* A work that never ran (its group broke) may hold a posted exchange. */
static void gloo_work_free(nb_work *w) {
    if (w->posted) nb__gloo_exchange_free(w->posted);
    free(w->posted_all);
}

const nb__pg_ops nb__pg_gloo_ops = {
    .name = "gloo",
    .start = gloo_start,
    .submit = gloo_submit,
    .progress = NULL,
    .wait_slice = gloo_wait_slice,
    .order = NULL,
    .abort = NULL,
    .stop = gloo_stop,
    .free = gloo_free,
    .work_free = gloo_work_free,
    .agree = gloo_agree,
};
