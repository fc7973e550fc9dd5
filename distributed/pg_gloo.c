/* The Gloo backend of process groups (CPU tensors): how a collective's
 * bytes move (Gloo's algorithms, or one message for a small one), the
 * connection of the group's mesh, the small exchange the check layer
 * sends headers with, and the backend table entries pg.c calls
 * (nb__pg_gloo_ops). pg.c runs the group's collectives on its worker
 * thread, one after another in issue order (Gloo calls block). The
 * transport itself is the C++ shim, gloo_shim.cpp: two contexts per
 * group, one for Gloo's algorithms and one of blocking connections for
 * the exchanges (Note [Blocking exchanges] there): the headers, the
 * small collectives, the all-reduce of two ranks and the ring all-reduce
 * of more (Note [Ring on blocking connections]), that is everything a
 * DDP step sends. */
#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "distributed/pg.h"

/* pg->impl */
typedef struct gloo_impl {
    nb__gloo *g;          /* Gloo's algorithms */
    nb__gloo *x;          /* blocking connections: nb__gloo_exchange */
    nb__gloo_dev *dev;    /* the world group's: every group's connections use it */
    unsigned char *other; /* the other rank's data in an all-reduce of two ranks */
    size_t other_n;
} gloo_impl;

static gloo_impl *impl(const nb_pg *pg) { return pg->impl; }

nb__gloo *nb__pg_gloo(const nb_pg *pg) { return impl(pg)->g; }

/* Note [Small collectives in one message]
 * Under load the latency of one message is that of a small collective
 * itself (benchmarks/RESULTS.md: 2-8 ms per small all-reduce on a busy
 * 2-core machine), and Gloo's own algorithms take a ring of 2 (R - 1)
 * steps. So a collective whose data fit in P bytes, P = min(32768, 65536
 * / (R - 1)) rounded down to 8, sends them in one message from each rank
 * to each other, all in flight at once:
 *   all-reduce and all-gather: the rank's elements; broadcast: the root's
 *   (nothing from the others); reduce-scatter: the rank's whole input (R
 *   chunks);
 * and every rank computes the result from what it received: the
 * reduction in rank order (0, 1, ..., R - 1, the same on every rank, so
 * every rank gets the same bits), the root's elements, or the
 * concatenation. Each rank receives into P bytes per rank whatever the
 * collective (P depends on R only) and sends only its data, so ranks
 * that disagree on a count cannot send a message longer than the buffer
 * it is read into (Note [Blocking exchanges] in gloo_shim.cpp). The
 * choice depends on the size alone: the collective checks (pg_check.c)
 * do not choose the arithmetic, so NABLA_DIST_CHECK=auto, full and off
 * compute the same bits (test_dist_collectives
 * test_checks_do_not_choose_the_arithmetic). P was 4096 (R = 2) while
 * every message had P bytes; at 32768 the bundled MLP's gradients (16.5
 * KB) travel with their header.
 *
 * Under the check layer (pg_check.c) the data travel in the layer's own
 * exchange (gloo_xpost): each of its messages is a frame, the header and
 * then a small collective's message as above (nothing for any other),
 * received into head + P bytes per rank. A checked small collective so
 * costs one exchange, as an unchecked one does, and a checked large one
 * exchanges a frame and then its data. Every frame of a group is received
 * into one size whatever the collective, so ranks that disagree on it (a
 * count of 10 against 20, or 8 within P against 20000 beyond it, or a
 * kind) still exchange frames, compare headers and fail with the mismatch
 * message; what arrived is dropped unread with the work. When the
 * headers agree, every rank decided alike that the collective is small
 * (the decision depends on what the headers hold), and `run` computes
 * from the frames with finish_from_messages, the arithmetic of its own
 * exchange. The exchange runs when the collective runs (gloo_xtest), in
 * issue order on every rank, which the blocking connections need; xpost
 * only prepares the frame, so the layer's early posting of queued
 * collectives' headers sends nothing early here.
 *
 * Note [All-reduce of two ranks]
 * With two ranks, Gloo's ring sends each rank's data once in two halves
 * (reduce-scatter, then all-gather), in several rounds of messages
 * through its event loop. The same bytes go in one blocking exchange
 * (pieces of 256 KiB, Note [Blocking exchanges]) and both ranks compute
 * x0 op x1, rank 0 into its own buffer and rank 1 into the copy of rank
 * 0's data, which it then copies back: the same bits on both ranks and as
 * the ring computed them (addition commutes; min and max are taken in the
 * same order everywhere). More ranks take a ring (Note [Ring on blocking
 * connections] in gloo_shim.cpp), which sends 2 (R - 1) / R of the data
 * where a direct exchange would send R - 1 times it. */
static size_t small_bytes(int R) {
    size_t p = 65536 / (size_t)(R > 1 ? R - 1 : 1);
    return (p > 32768 ? 32768 : p) & ~(size_t)7;
}

/* The bytes of c's data this rank sends. */
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

/* The result of c on this rank from every rank's message (rank r's at
 * pay + r * stride). */
static void finish_from_messages(nb_pg *pg, const nb__coll *c, const unsigned char *pay, size_t stride) {
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

static bool is_small(const nb_pg *pg, const nb__coll *c) {
    return pg->size > 1 && c->kind != NB__BARRIER && c->count > 0 && data_bytes(c, pg->size) <= small_bytes(pg->size);
}

/* Note [Small collectives in one message]: where this rank's message of
 * c's data is, and its size (0: a broadcast's other ranks). */
static const void *small_msg(const nb_pg *pg, const nb__coll *c, size_t *sent) {
    bool none = c->kind == NB__BROADCAST && c->root != pg->rank;
    *sent = none ? 0 : data_bytes(c, pg->size);
    return c->kind == NB__ALL_REDUCE || c->kind == NB__BROADCAST ? c->out : c->in;
}

/* The check layer's exchange in frames (gloo_xpost), run by gloo_xtest;
 * when its collective is small, it becomes that work's impl once
 * everything has arrived. */
typedef struct frames {
    nb_work *w;             /* the collective whose data the frames hold; NULL: none */
    unsigned char *me;      /* this rank's frame: the header, then w's data */
    unsigned char *buf;     /* every rank's frame, rank r's at r * stride */
    void *all;              /* the caller's: every rank's n bytes */
    size_t n, head, stride; /* head: n rounded up to 8, where the data start */
} frames;

static void frames_free(frames *f) {
    if (!f) return;
    free(f->me);
    free(f->buf);
    free(f);
}

static void gloo_work_free(nb_work *w) {
    frames_free(w->impl);
    w->impl = NULL;
}

/* Sends this rank's message, waits for every rank's and writes the
 * result; or, when they came in the check layer's frames, writes it from
 * those. */
static nb_status run_small(nb_pg *pg, nb_work *w) {
    const nb__coll *c = &w->coll;
    const frames *f = w->impl;
    nb_status st = NB_OK;
    if (f) {
        finish_from_messages(pg, c, f->buf + f->head, f->stride);
        pg->stats.small_framed++;
    } else {
        size_t P = small_bytes(pg->size), sent;
        const void *mine = small_msg(pg, c, &sent);
        unsigned char *all = malloc((size_t)pg->size * P);
        NB_CHECK(all, "nb_pg: out of memory for a small collective (%d x %zu bytes)", pg->size, P);
        st = nb__gloo_exchange(impl(pg)->x, mine, sent, all, P, true, false);
        if (st == NB_OK) finish_from_messages(pg, c, all, P);
        free(all);
    }
    if (st == NB_OK) pg->stats.small++;
    return st;
}

/* Note [All-reduce of two ranks]. */
static bool is_pair_all_reduce(const nb_pg *pg, const nb__coll *c) {
    return pg->size == 2 && c->kind == NB__ALL_REDUCE && c->count > 0;
}

static nb_status run_pair_all_reduce(nb_pg *pg, const nb__coll *c) {
    gloo_impl *g = impl(pg);
    size_t n = (size_t)c->count, b = n * nb_dtype_size(c->dtype);
    if (g->other_n < 2 * b) { /* kept for the group's life: a DDP step reduces the
                                 same buckets each time */
        free(g->other);
        g->other = malloc(2 * b);
        NB_CHECK(g->other, "nb_pg: out of memory for an all-reduce of %zu bytes", b);
        g->other_n = 2 * b;
    }
    nb_status st = nb__gloo_exchange(g->x, c->out, b, g->other, b, false, true);
    if (st != NB_OK) return st;
    if (pg->rank == 0) {
        nb__reduce_into(c->dtype, c->op, c->out, g->other + b, n);
    } else {
        nb__reduce_into(c->dtype, c->op, g->other, c->out, n);
        memcpy(c->out, g->other, b);
    }
    pg->stats.pair++;
    return NB_OK;
}

/* Note [Ring on blocking connections] in gloo_shim.cpp. */
static nb_status run_ring_all_reduce(nb_pg *pg, const nb__coll *c) {
    nb_status st = nb__gloo_ring_all_reduce(impl(pg)->x, c);
    if (st == NB_OK) pg->stats.ring++;
    return st;
}

/* Moves w's data (on the group's worker). */
static nb_status gloo_run(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained) {
    const nb__coll *c = &w->coll;
    *explained = false;
    if (c->kind != NB__BARRIER && c->count == 0) return NB_OK;
    nb_status st = is_small(pg, c)             ? run_small(pg, w)
                   : is_pair_all_reduce(pg, c) ? run_pair_all_reduce(pg, c)
                   : c->kind == NB__ALL_REDUCE ? run_ring_all_reduce(pg, c)
                                               : nb__gloo_run(impl(pg)->g, c);
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
    pg->impl = calloc(1, sizeof(gloo_impl));
    NB_CHECK(pg->impl != NULL, "nb_pg_init: out of memory");
    if (root == pg) {
        char host[256];
        local_address(root->env.master_addr, host, sizeof host);
        const char *iface = getenv("NABLA_SOCKET_IFNAME");
        st = nb__gloo_dev_new(&impl(root)->dev, host, iface ? iface : "");
        if (st != NB_OK) return st;
    }
    /* The set-up (the others' addresses, the connections to them) is
     * bounded by the join limit, not the progress timeout: every member has
     * arrived already (nb__join, or the list check of nb_pg_new_group). */
    double connect_s = root->join_s < pg->timeout_s ? root->join_s : pg->timeout_s;
    st = nb__gloo_connect(&impl(pg)->g, impl(root)->dev, root->store_main, prefix, pg->rank, pg->size, pg->timeout_s,
                          connect_s, false);
    if (st == NB_OK) { /* Note [Blocking exchanges] in gloo_shim.cpp */
        char xprefix[96];
        snprintf(xprefix, sizeof xprefix, "%sx/", prefix);
        st = nb__gloo_connect(&impl(pg)->x, impl(root)->dev, root->store_main, xprefix, pg->rank, pg->size,
                              pg->timeout_s, connect_s, true);
    }
    if (st != NB_OK) {
        char why[NB__MSG_LEN], host[256];
        snprintf(why, sizeof why, "%s", nb_last_error());
        local_address(root->env.master_addr, host, sizeof host);
        const char *iface = getenv("NABLA_SOCKET_IFNAME");
        bool named = iface && *iface;
        return nb_set_error(st,
                            "%s (within %g s, %s; this rank listens on %s%s%s: "
                            "every node must reach the "
                            "others' addresses on ports the kernel picks; "
                            "NABLA_SOCKET_IFNAME chooses the "
                            "interface)",
                            why, connect_s, connect_s < pg->timeout_s ? "NABLA_JOIN_TIMEOUT" : "NABLA_PG_TIMEOUT",
                            named ? "interface " : "", named ? iface : host, named ? " (NABLA_SOCKET_IFNAME)" : "");
    }
    return NB_OK;
}

/* `stuck`: the worker still uses the Gloo context (Note [Stuck worker] in
 * pg.c). */
static void gloo_free(nb_pg *pg, bool stuck) {
    gloo_impl *g = impl(pg);
    if (!g) return;
    if (g->g && !stuck) nb__gloo_free(g->g);
    if (g->x && !stuck) nb__gloo_free(g->x);
    if (g->dev) nb__gloo_dev_free(g->dev); /* the world group's, freed after every group's context */
    if (!stuck) {
        free(g->other);
        free(g);
        pg->impl = NULL;
    }
}

static nb_status gloo_agree(nb_pg *pg, int32_t *votes) {
    nb__coll c = {NB__ALL_REDUCE, NB_REDUCE_SUM, NB_I32, 1, 0, votes, NULL, 0};
    return nb_work_finish(nb__pg_issue(pg, &c));
}

/* The check layer's exchange carries (and reads) the data of a small
 * collective. */
static bool gloo_xcarries(const nb_pg *pg, const nb_work *w) { return is_small(pg, &w->coll); }

/* The check layer's exchange (pg.h): one frame per rank, `mine` and then
 * room for a small collective's data, which w's fill when it is small
 * (Note [Small collectives in one message]). Prepared here, exchanged by
 * gloo_xtest. */
static nb_status gloo_xpost(nb_pg *pg, nb_work *w, const void *mine, void *all, size_t n, void **x) {
    int R = pg->size;
    frames *f = calloc(1, sizeof *f);
    NB_CHECK(f != NULL, "nb_pg: out of memory for %d collective headers", R);
    f->all = all;
    f->n = n;
    f->head = (n + 7) & ~(size_t)7;
    f->stride = f->head + small_bytes(R);
    f->me = calloc(1, f->head);
    f->buf = malloc((size_t)R * f->stride);
    NB_CHECK(f->me && f->buf, "nb_pg: out of memory for %d collective headers (%zu bytes each)", R, f->stride);
    memcpy(f->me, mine, n);
    if (gloo_xcarries(pg, w)) f->w = w;
    *x = f;
    return NB_OK;
}

/* Exchanges the frames (on the group's worker, as the collective runs);
 * the data of a small collective stay with its work, for `run`. */
static int gloo_xtest(nb_pg *pg, void *x) {
    frames *f = x;
    size_t sent = f->head;
    nb_status st = NB_OK;
    if (f->w) { /* the header and the data side by side in this rank's frame */
        size_t d;
        const void *data = small_msg(pg, &f->w->coll, &d);
        unsigned char *me = realloc(f->me, f->head + d);
        NB_CHECK(me, "nb_pg: out of memory for a collective's frame (%zu bytes)", f->head + d);
        f->me = me;
        memcpy(me + f->head, data, d);
        sent += d;
    }
    st = nb__gloo_exchange(impl(pg)->x, f->me, sent, f->buf, f->stride, true, false);
    if (st != NB_OK) {
        frames_free(f);
        return (int)st;
    }
    for (int r = 0; r < pg->size; r++)
        memcpy((unsigned char *)f->all + (size_t)r * f->n, f->buf + (size_t)r * f->stride, f->n);
    if (f->w && !f->w->impl) f->w->impl = f;
    else frames_free(f);
    return 1;
}

static void gloo_xdrop(void *x) { frames_free(x); }

const nb__pg_ops nb__pg_gloo_ops = {
    .name = "gloo",
    .start = gloo_start,
    .run = gloo_run,
    .launch = NULL,
    .progress = NULL,
    .wait_slice = NULL,
    .order = NULL,
    .abort = NULL,
    .free = gloo_free,
    .work_free = gloo_work_free,
    .agree = gloo_agree,
    .xpost = gloo_xpost,
    .xcarries = gloo_xcarries,
    .xtest = gloo_xtest,
    .xdrop = gloo_xdrop,
};
