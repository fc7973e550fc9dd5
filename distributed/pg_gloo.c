/* The Gloo backend of process groups (CPU tensors): how a collective's
 * bytes move (Gloo's algorithms, or one message for a small one), the
 * connection of the group's mesh, the small exchange the check layer
 * sends headers with, and the backend table entries pg.c calls
 * (nb__pg_gloo_ops). pg.c runs the group's collectives on its worker
 * thread, one after another in issue order (Gloo calls block). The
 * transport itself is the C++ shim, gloo_shim.cpp. */
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
    nb__gloo *g;
    nb__gloo_dev *dev; /* the world group's: every group's connections use it */
} gloo_impl;

static gloo_impl *impl(const nb_pg *pg) { return pg->impl; }

nb__gloo *nb__pg_gloo(const nb_pg *pg) { return impl(pg)->g; }

/* Note [Small collectives in one message]
 * Under load the latency of one message is that of a small collective
 * itself (benchmarks/RESULTS.md: 2-8 ms per small all-reduce on a busy
 * 2-core machine), and Gloo's own algorithms take a ring of 2 (R - 1)
 * steps. So a collective whose data fit in P bytes, P = min(4096, 16384 /
 * (R - 1)) rounded down to 8 (at most 16 KB more per rank and collective
 * in any world), sends them in one message from each rank to each other,
 * all in flight at once:
 *   all-reduce and all-gather: the rank's elements; broadcast: the root's
 *   (zeros from the others); reduce-scatter: the rank's whole input (R
 *   chunks);
 * and every rank computes the result from what it received: the
 * reduction in rank order (0, 1, ..., R - 1, the same on every rank, so
 * every rank gets the same bits), the root's elements, or the
 * concatenation. Every message has P bytes whatever the collective (P
 * depends on R only), so ranks that disagree on a count cannot make Gloo's
 * event loop meet a message of another size (Note [No exception crosses
 * the shim] in gloo_shim.cpp). The choice depends on the size alone: the
 * collective checks (pg_check.c) do not choose the arithmetic, so
 * NABLA_DIST_CHECK=auto, full and off compute the same bits
 * (test_dist_collectives test_checks_do_not_choose_the_arithmetic).
 *
 * Under the check layer (pg_check.c) the data travel in the layer's own
 * exchange (gloo_xpost): each of its messages is a frame, the header and
 * then P bytes, which hold a small collective's message as above and
 * zeros for any other. A checked small collective so costs one exchange,
 * as an unchecked one does, and a checked large one exchanges a frame
 * and then runs Gloo's algorithm. Every frame of a group has one size
 * whatever the collective, so ranks that disagree on it (a count of 10
 * against 20, or 8 within P against 2000 beyond it, or a kind) still
 * exchange frames, compare headers and fail with the mismatch message;
 * what arrived is dropped unread with the work. When the headers agree,
 * every rank decided alike that the collective is small (the decision
 * depends on what the headers hold), and `run` computes from the frames
 * with finish_from_messages, the arithmetic of its own exchange. A small
 * collective's frame reads its inputs when posted (gloo_xcarries), so the
 * layer posts it while earlier collectives run only when none of them
 * writes those inputs. */
static size_t small_bytes(int R) {
    size_t p = 16384 / (size_t)(R > 1 ? R - 1 : 1);
    return (p > 4096 ? 4096 : p) & ~(size_t)7;
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

/* Note [Small collectives in one message]: this rank's message of c's
 * data into `p` (P bytes, zeroed). */
static void small_fill(const nb_pg *pg, const nb__coll *c, unsigned char *p) {
    if (c->kind != NB__BROADCAST || c->root == pg->rank)
        memcpy(p, c->kind == NB__ALL_REDUCE || c->kind == NB__BROADCAST ? c->out : c->in, data_bytes(c, pg->size));
}

/* The check layer's exchange in frames (gloo_xpost); when its collective
 * is small, it becomes that work's impl once everything has arrived. */
typedef struct frames {
    nb__gloo_xchg *x;   /* in flight; NULL once over */
    nb_work *w;         /* the collective whose data the frames hold; NULL: none */
    unsigned char *buf; /* every rank's frame, rank r's at r * stride */
    void *all;          /* the caller's: every rank's n bytes */
    size_t n, head, stride; /* head: n rounded up to 8, where the data start */
} frames;

static void frames_free(frames *f) {
    if (!f) return;
    if (f->x) nb__gloo_exchange_free(f->x);
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
        int R = pg->size;
        size_t P = small_bytes(R);
        unsigned char *mine = calloc(1, P), *all = malloc((size_t)R * P);
        NB_CHECK(mine && all, "nb_pg: out of memory for a small collective (%d x %zu bytes)", R, P);
        small_fill(pg, c, mine);
        nb__gloo_xchg *x = NULL;
        st = nb__gloo_exchange_post(impl(pg)->g, mine, all, P, c->seq, 1, &x);
        free(mine);
        if (st == NB_OK) st = nb__gloo_exchange_wait(impl(pg)->g, x);
        if (st == NB_OK) finish_from_messages(pg, c, all, P);
        free(all); /* Gloo drops what arrives for a buffer that is gone */
    }
    if (st == NB_OK) pg->stats.small++;
    return st;
}

/* Moves w's data (on the group's worker). */
static nb_status gloo_run(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained) {
    const nb__coll *c = &w->coll;
    *explained = false;
    if (c->kind != NB__BARRIER && c->count == 0) return NB_OK;
    nb_status st = is_small(pg, c) ? run_small(pg, w) : nb__gloo_run(impl(pg)->g, c);
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
    st = nb__gloo_connect(&impl(pg)->g, impl(root)->dev, root->store_main, prefix, pg->rank, pg->size,
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
    return NB_OK;
}

/* `stuck`: the worker still uses the Gloo context (Note [Stuck worker] in pg.c). */
static void gloo_free(nb_pg *pg, bool stuck) {
    gloo_impl *g = impl(pg);
    if (!g) return;
    if (g->g && !stuck) nb__gloo_free(g->g);
    if (g->dev) nb__gloo_dev_free(g->dev); /* the world group's, freed after every group's context */
    if (!stuck) {
        free(g);
        pg->impl = NULL;
    }
}

static nb_status gloo_agree(nb_pg *pg, int32_t *votes) {
    nb__coll c = {NB__ALL_REDUCE, NB_REDUCE_SUM, NB_I32, 1, 0, votes, NULL, 0};
    return nb_work_finish(nb__pg_issue(pg, &c));
}

/* The check layer's exchange carries (and reads) the data of a small collective. */
static bool gloo_xcarries(const nb_pg *pg, const nb_work *w) { return is_small(pg, &w->coll); }

/* The check layer's exchange (pg.h), on its own lane: one frame per
 * rank, `mine` and then room for a small collective's data, which w's
 * fill when it is small (Note [Small collectives in one message]). */
static nb_status gloo_xpost(nb_pg *pg, nb_work *w, const void *mine, void *all, size_t n, void **x) {
    int R = pg->size;
    frames *f = calloc(1, sizeof *f);
    NB_CHECK(f != NULL, "nb_pg: out of memory for %d collective headers", R);
    f->all = all;
    f->n = n;
    f->head = (n + 7) & ~(size_t)7;
    f->stride = f->head + small_bytes(R);
    unsigned char *me = calloc(1, f->stride);
    f->buf = malloc((size_t)R * f->stride);
    NB_CHECK(me && f->buf, "nb_pg: out of memory for %d collective headers (%zu bytes each)", R, f->stride);
    memcpy(me, mine, n);
    if (gloo_xcarries(pg, w)) {
        small_fill(pg, &w->coll, me + f->head);
        f->w = w;
    }
    nb_status st = nb__gloo_exchange_post(impl(pg)->g, me, f->buf, f->stride, w->coll.seq, 0, &f->x);
    free(me);
    if (st != NB_OK) {
        frames_free(f);
        f = NULL;
    }
    *x = f;
    return st;
}

/* Blocks until the exchange is over (pg.c's worker runs it); the data of
 * a small collective stay with its work, for `run`. */
static int gloo_xtest(nb_pg *pg, void *x) {
    frames *f = x;
    nb_status st = nb__gloo_exchange_wait(impl(pg)->g, f->x);
    f->x = NULL;
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
