/* The store client: one blocking connection per nb_store, over TCP or,
 * on one node, the store's Unix-domain socket (Note [Store on one node]
 * in store_unix.c).
 *
 * Every call sends one frame and reads one reply (SET_QUIET reads none).
 * The server answers a GET or WAIT by its own deadline, so the client's
 * read deadline is that timeout plus the liveness limit (Note [Liveness
 * and progress] in heartbeat.c): a store that has not answered by then is
 * stopped or frozen (rank 0 serves it), or its host is unreachable. Such
 * a connection is given up (a late reply would answer the wrong request);
 * once the connection is lost every later call fails at once with the
 * same story. The greeting proves the run's secret when there is one, and
 * checks the store's proof in turn (Note [Store authentication] in
 * store_server.c). */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "distributed/internal.h"

struct nb_store {
    int fd;
    char host[256];
    int port;
    char path[128];   /* the Unix-domain socket; "" over TCP */
    char where[300];  /* "host:port" or the socket's path, for messages */
    double timeout_s;
    double reply_s;  /* the margin: how long a live store may take to answer */
    bool lost;
    char lost_why[512];
    char run_id[128];
    uint8_t secret[NB__STORE_SECRET_MAX];
    size_t secret_len; /* 0: none */
    nb__buf out;
    uint8_t *reply;
    size_t reply_cap, reply_len;
};

static void check_key(const char *fn, const char *key) {
    NB_CHECK(key != NULL, "%s: key is NULL", fn);
    size_t n = strlen(key);
    NB_CHECK(n > 0 && n <= NB_STORE_MAX_KEY, "%s: key length %zu is outside [1, %d]", fn, n,
             NB_STORE_MAX_KEY);
}

static void check_value(const char *fn, const void *value, size_t len) {
    NB_CHECK(value != NULL || len == 0, "%s: value is NULL with length %zu", fn, len);
    NB_CHECK(len <= NB_STORE_MAX_VALUE, "%s: value of %zu bytes exceeds NB_STORE_MAX_VALUE (%u)", fn,
             len, NB_STORE_MAX_VALUE);
}

static nb_status lost(nb_store *s, const char *fn, const char *what) {
    s->lost = true;
    snprintf(s->lost_why, sizeof s->lost_why, "lost the connection to the store at %s (%s); the "
             "process that serves it (rank 0) has probably exited", s->where, what);
    return nb_set_error(NB_ERR_CLOSED, "%s: %s", fn, s->lost_why);
}

/* No reply within the liveness limit: the connection is given up. */
static nb_status silent(nb_store *s, const char *fn) {
    s->lost = true;
    snprintf(s->lost_why, sizeof s->lost_why,
             "no reply from the store at %s within %.1f s (NABLA_LIVENESS_TIMEOUT): rank 0, "
             "which serves it, is stopped (SIGSTOP, a debugger) or frozen, or its host is unreachable",
             s->where, s->reply_s);
    return nb_set_error(NB_ERR_TIMEOUT, "%s: %s", fn, s->lost_why);
}

/* Waits until fd is ready for `events` or the deadline passes. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - nb__now();
        if (left <= 0) return 0;
        struct pollfd p = {fd, events, 0};
        int ms = left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
        int rc = poll(&p, 1, ms);
        if (rc > 0) return 1;
        if (rc < 0 && errno != EINTR) return -1;
    }
}

static nb_status send_all(nb_store *s, const char *fn, const uint8_t *p, size_t n, double deadline) {
    while (n > 0) {
        ssize_t put = send(s->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (put > 0) {
            p += put;
            n -= (size_t)put;
            continue;
        }
        if (put < 0 && errno == EINTR) continue;
        if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = wait_fd(s->fd, POLLOUT, deadline);
            if (rc == 0) return silent(s, fn);
            if (rc > 0) continue;
        }
        return lost(s, fn, strerror(errno));
    }
    return NB_OK;
}

static nb_status recv_all(nb_store *s, const char *fn, uint8_t *p, size_t n, double deadline) {
    while (n > 0) {
        ssize_t got = recv(s->fd, p, n, MSG_DONTWAIT);
        if (got > 0) {
            p += got;
            n -= (size_t)got;
            continue;
        }
        if (got == 0) return lost(s, fn, "closed by the server");
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_fd(s->fd, POLLIN, deadline);
            if (rc == 0) return silent(s, fn);
            if (rc > 0) continue;
        }
        return lost(s, fn, strerror(errno));
    }
    return NB_OK;
}

/* Sends s->out (one frame); unless `quiet`, reads the reply into
 * s->reply and returns its status byte through *status. */
static nb_status roundtrip(nb_store *s, const char *fn, double wait_s, bool quiet, int *status) {
    if (s->lost) return nb_set_error(NB_ERR_CLOSED, "%s: earlier, %s", fn, s->lost_why);
    double deadline = nb__now() + wait_s + s->reply_s;
    nb_status st = send_all(s, fn, s->out.p, s->out.n, deadline);
    s->out.n = 0;
    if (st != NB_OK || quiet) return st;
    uint8_t hdr[4];
    st = recv_all(s, fn, hdr, 4, deadline);
    if (st != NB_OK) return st;
    uint32_t len = nb__store_frame_len(hdr);
    if (len == 0 || len > NB_STORE_MAX_MESSAGE) return lost(s, fn, "malformed reply");
    if (len > s->reply_cap) {
        uint8_t *p = realloc(s->reply, len);
        NB_CHECK(p != NULL, "%s: out of memory for a reply of %u bytes", fn, len);
        s->reply = p;
        s->reply_cap = len;
    }
    st = recv_all(s, fn, s->reply, len, deadline);
    if (st != NB_OK) return st;
    s->reply_len = len;
    *status = s->reply[0];
    return NB_OK;
}

static nb__reader reply_reader(const nb_store *s) {
    nb__reader r = {s->reply, s->reply_len, 1, false};
    return r;
}

/* The failure a reply status stands for, with its text. */
static nb_status reply_error(nb_store *s, const char *fn, const char *key, int status) {
    nb__reader r = reply_reader(s);
    nb__bytes text = status == NB__R_NOT_FOUND ? (nb__bytes){NULL, 0} : nb__rd_bytes(&r);
    int tn = (int)text.n;
    const char *tp = text.p ? (const char *)text.p : "";
    switch (status) {
    case NB__R_ABORTED:
        return nb_set_error(NB_ERR_CLOSED, "%s: the run was aborted: %.*s", fn, tn, tp);
    case NB__R_TIMEOUT:
        return nb_set_error(NB_ERR_TIMEOUT, "%s: timed out waiting for keys (%.*s)", fn, tn, tp);
    case NB__R_NOT_FOUND:
        return nb_set_error(NB_ERR_NOT_FOUND, "%s: key '%s' is not in the store", fn, key ? key : "");
    case NB__R_ERROR:
        return nb_set_error(NB_ERR_INVALID, "%s: the store refused: %.*s", fn, tn, tp);
    default:
        return lost(s, fn, "unexpected reply");
    }
}

/* The store's answer to the greeting was not what a store of this run
 * says; `what` tells how. */
static nb_status refused_auth(nb_store *s, const char *what) {
    return nb_set_error(NB_ERR_MISMATCH, "nb_store_connect: the store at %s %s", s->where, what);
}

static nb_status hello(nb_store *s, int rank) {
    uint8_t cnonce[NB__STORE_NONCE_LEN];
    nb__store_random(cnonce, sizeof cnonce);
    size_t f = nb__buf_frame_begin(&s->out);
    nb__buf_u8(&s->out, NB__OP_HELLO);
    nb__buf_u32(&s->out, NB__STORE_MAGIC);
    nb__buf_bytes(&s->out, s->run_id, strlen(s->run_id));
    nb__buf_i64(&s->out, rank);
    nb__buf_bytes(&s->out, cnonce, sizeof cnonce);
    nb__buf_frame_end(&s->out, f);
    int status;
    nb_status st = roundtrip(s, "nb_store_connect", 0, false, &status);
    uint8_t snonce[NB__STORE_NONCE_LEN];
    if (st == NB_OK && status == NB__R_CHALLENGE) {
        if (!s->secret_len)
            return refused_auth(s, "asks for the run's secret, and this process has none: give "
                                   "every process the same NABLA_STORE_SECRET_FILE (or "
                                   "NABLA_STORE_SECRET) as rank 0");
        nb__reader r = reply_reader(s);
        nb__bytes n = nb__rd_bytes(&r);
        if (r.bad || n.n != NB__STORE_NONCE_LEN) return lost(s, "nb_store_connect", "malformed challenge");
        memcpy(snonce, n.p, sizeof snonce);
        uint8_t mac[NB__STORE_MAC_LEN];
        nb__store_mac(s->secret, s->secret_len, "nabla store client", cnonce, snonce, s->run_id, rank, mac);
        f = nb__buf_frame_begin(&s->out);
        nb__buf_u8(&s->out, NB__OP_AUTH);
        nb__buf_bytes(&s->out, mac, sizeof mac);
        nb__buf_frame_end(&s->out, f);
        nb__store_wipe(mac, sizeof mac);
        st = roundtrip(s, "nb_store_connect", 0, false, &status);
        if (st == NB_OK && status == NB__R_OK) {
            nb__store_mac(s->secret, s->secret_len, "nabla store server", cnonce, snonce, s->run_id,
                          rank, mac);
            nb__reader rr = reply_reader(s);
            nb__bytes theirs = nb__rd_bytes(&rr);
            bool ok = !rr.bad && theirs.n == NB__STORE_MAC_LEN && nb__store_mac_equal(mac, theirs.p);
            nb__store_wipe(mac, sizeof mac);
            if (!ok)
                return refused_auth(s, "did not prove that it knows the run's secret: is another "
                                       "program answering on MASTER_PORT?");
            return NB_OK;
        }
    } else if (st == NB_OK && status == NB__R_OK && s->secret_len) {
        return refused_auth(s, "admitted this process without asking for the run's secret, which "
                               "this process has: rank 0 runs without it (is "
                               "NABLA_STORE_SECRET_FILE set on every node?), or another program "
                               "answers on MASTER_PORT");
    }
    if (st == NB_ERR_TIMEOUT)
        return nb_set_error(st,
                            "nb_store_connect: the store at %s accepted the connection but did not "
                            "answer its greeting within %.1f s (NABLA_LIVENESS_TIMEOUT): rank 0, which "
                            "serves it, is stopped or overloaded (its stderr says how many connections "
                            "that never proved they belong to the run it closed, and from where), or "
                            "another program holds MASTER_PORT",
                            s->where, s->reply_s);
    if (st != NB_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", nb_last_error());
        return nb_set_error(st,
                            "%s; a program accepts connections at %s but does not answer as "
                            "nabla's store: is MASTER_PORT taken by another program, or did rank 0 "
                            "exit?",
                            why, s->where);
    }
    if (status == NB__R_OK) return NB_OK;
    nb__reader r = reply_reader(s);
    nb__bytes text = nb__rd_bytes(&r);
    nb_status refused = text.n >= strlen(NB__STORE_DROPPED) &&
                                memcmp(text.p, NB__STORE_DROPPED, strlen(NB__STORE_DROPPED)) == 0
                            ? NB_ERR_NETWORK /* evicted: connect_once's caller tries again */
                            : NB_ERR_MISMATCH;
    return nb_set_error(refused, "nb_store_connect: the store at %s refused rank %d: %.*s", s->where,
                        rank, (int)text.n, text.p ? (const char *)text.p : "");
}

/* One connection attempt to any address of host:port; -1 and errno set. */
static int try_connect(struct addrinfo *res, double deadline) {
    int err = ECONNREFUSED;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            if (wait_fd(fd, POLLOUT, deadline) > 0) {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                rc = soerr ? -1 : 0;
                errno = soerr;
            } else {
                errno = ETIMEDOUT;
            }
        }
        if (rc == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            return fd;
        }
        err = errno;
        close(fd);
    }
    errno = err;
    return -1;
}

static void store_free(nb_store *s) {
    close(s->fd);
    nb__buf_free(&s->out);
    free(s->reply);
    nb__store_wipe(s->secret, sizeof s->secret);
    free(s);
}

/* One attempt at the store's Unix-domain socket or at any address of host:port. */
static int connect_once(const char *path, struct addrinfo *res, double deadline) {
    if (!path) return try_connect(res, deadline);
    return nb__store_unix_connect(path, deadline - nb__now());
}

nb_status nb__store_connect(nb_store **out, const char *host, int port, const nb__store_config *cfg,
                            int rank, double timeout_s) {
    *out = NULL;
    const char *run_id = cfg ? cfg->run_id : NULL;
    const char *path = cfg && cfg->unix_path && *cfg->unix_path ? cfg->unix_path : NULL;
    NB_CHECK(!cfg || !cfg->secret_len || cfg->secret_len <= NB__STORE_SECRET_MAX,
             "nb_store_connect: a secret of %zu bytes is over %d", cfg ? cfg->secret_len : 0,
             NB__STORE_SECRET_MAX);
    NB_CHECK(path || (host != NULL && *host), "nb_store_connect: host is empty");
    NB_CHECK(path || (port > 0 && port <= 65535), "nb_store_connect: port %d out of range [1, 65535]", port);
    NB_CHECK(!path || strlen(path) < sizeof ((nb_store *)0)->path, "nb_store_connect: socket path %s too long",
             path ? path : "");
    NB_CHECK(timeout_s > 0, "nb_store_connect: timeout %g s must be positive", timeout_s);
    NB_CHECK(rank >= -1, "nb_store_connect: rank %d must be >= -1", rank);
    if (!run_id) run_id = "default";
    NB_CHECK(strlen(run_id) <= 127, "nb_store_connect: run id longer than 127 bytes");
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    char where[300];
    if (path) snprintf(where, sizeof where, "%s", path);
    else snprintf(where, sizeof where, "%s:%d", host, port);
    double deadline = nb__now() + timeout_s;
    int rc, tries = 0, evicted = 0;
    char evicted_why[1024] = "";
    /* DNS may not know the master yet when a cluster starts. */
    while (!path && (rc = getaddrinfo(host, port_s, &hints, &res)) != 0) {
        if (rc != EAI_AGAIN || nb__now() > deadline)
            return nb_set_error(NB_ERR_NETWORK, "nb_store_connect: cannot resolve '%s': %s", host,
                                gai_strerror(rc));
        nb__sleep(0.1);
    }
    int fd = -1;
    double pause = 0.01;
again:
    while ((fd = connect_once(path, res, deadline)) < 0) {
        int err = errno;
        tries++;
        if (path && err == EPERM) {
            if (res) freeaddrinfo(res);
            return nb_set_error(NB_ERR_MISMATCH,
                                "nb_store_connect: the socket %s is served by a process of another "
                                "user (SO_PEERCRED), not by this run's rank 0: refused", path);
        }
        if (nb__now() + pause > deadline) {
            if (res) freeaddrinfo(res);
            return nb_set_error(NB_ERR_TIMEOUT,
                                "nb_store_connect: could not reach the store at %s within %.1f s "
                                "(%d attempts, last: %s); is rank 0 running (it serves the store: "
                                "did it fail, for instance because another program holds "
                                "MASTER_PORT?), and are MASTER_ADDR and MASTER_PORT right?%s",
                                where, timeout_s, tries, strerror(err),
                                path ? " On one node the store is this Unix-domain socket (Note "
                                       "[Store on one node]); ranks that do not share /tmp (or "
                                       "NABLA_STORE_DIR), as in separate containers, need "
                                       "NABLA_STORE_TRANSPORT=tcp on every rank" : "");
        }
        nb__sleep(pause);
        pause = pause * 2 > 0.25 ? 0.25 : pause * 2;
    }
    nb_store *s = calloc(1, sizeof *s);
    NB_CHECK(s != NULL, "nb_store_connect: out of memory");
    s->fd = fd;
    snprintf(s->host, sizeof s->host, "%s", host ? host : "");
    s->port = port;
    snprintf(s->path, sizeof s->path, "%s", path ? path : "");
    snprintf(s->where, sizeof s->where, "%s", where);
    s->timeout_s = timeout_s;
    s->reply_s = nb__liveness_s();
    snprintf(s->run_id, sizeof s->run_id, "%s", run_id);
    if (cfg && cfg->secret && cfg->secret_len) {
        memcpy(s->secret, cfg->secret, cfg->secret_len);
        s->secret_len = cfg->secret_len;
    }
    nb_status st = hello(s, rank);
    if (st == NB_ERR_NETWORK && nb__now() + pause < deadline) {
        /* Note [Admission under a flood] in store_server.c: dropped to make room; again */
        snprintf(evicted_why, sizeof evicted_why, "%s", nb_last_error());
        evicted++;
        store_free(s);
        nb__sleep(pause);
        pause = pause * 2 > 0.25 ? 0.25 : pause * 2;
        goto again;
    }
    if (res) freeaddrinfo(res);
    if (st != NB_OK) {
        store_free(s);
        if (st == NB_ERR_NETWORK) {
            snprintf(evicted_why, sizeof evicted_why, "%s", nb_last_error());
            return nb_set_error(NB_ERR_TIMEOUT, "%s (%d time%s within %.1f s: the store is flooded with "
                                "connections that do not belong to the run; its stderr names their "
                                "sources)", evicted_why, evicted + 1, evicted ? "s" : "", timeout_s);
        }
        return st;
    }
    *out = s;
    return NB_OK;
}

nb_status nb_store_connect(nb_store **out, const char *host, int port, const char *run_id,
                           int rank, double timeout_s) {
    nb__store_config cfg = {.run_id = run_id};
    return nb__store_connect(out, host, port, &cfg, rank, timeout_s);
}

nb_status nb__store_connect_like(nb_store **out, const nb_store *like, int rank, double timeout_s) {
    nb__store_config cfg = {.run_id = like->run_id, .secret = like->secret, .secret_len = like->secret_len,
                            .unix_path = like->path[0] ? like->path : NULL};
    return nb__store_connect(out, like->host, like->port, &cfg, rank, timeout_s);
}

void nb_store_close(nb_store *s) {
    if (!s) return;
    if (!s->lost) {
        size_t f = nb__buf_frame_begin(&s->out);
        nb__buf_u8(&s->out, NB__OP_BYE);
        nb__buf_frame_end(&s->out, f);
        int status;
        /* A goodbye that fails has nothing left to report to. */
        char keep[1024];
        snprintf(keep, sizeof keep, "%s", nb_last_error());
        double limit = s->reply_s;
        s->reply_s = limit < 5.0 ? limit : 5.0;
        if (roundtrip(s, "nb_store_close", 0, false, &status) != NB_OK)
            nb_set_error(NB_OK, "%s", keep);
    }
    store_free(s);
}

/* Begins a request frame with op and key; returns the frame's start for send_request. */
static size_t key_request(nb_store *s, int op, const char *key) {
    size_t f = nb__buf_frame_begin(&s->out);
    nb__buf_u8(&s->out, (uint8_t)op);
    nb__buf_bytes(&s->out, key, strlen(key));
    return f;
}

/* Begins a request frame with op and n checked keys; returns the frame's start. */
static size_t keys_request(nb_store *s, const char *fn, int op, const char *const *keys, int n) {
    size_t f = nb__buf_frame_begin(&s->out);
    nb__buf_u8(&s->out, (uint8_t)op);
    nb__buf_u32(&s->out, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        check_key(fn, keys[i]);
        nb__buf_bytes(&s->out, keys[i], strlen(keys[i]));
    }
    return f;
}

/* Ends the frame begun at f, sends it and reads the reply's status (waiting up to wait_s
 * beyond the store's timeout). */
static nb_status send_request(nb_store *s, const char *fn, size_t f, double wait_s, bool quiet, int *status) {
    nb__buf_frame_end(&s->out, f);
    return roundtrip(s, fn, wait_s, quiet, status);
}

/* The bytes of a reply whose status must be NB__R_VALUE; any other status is
 * the error reply_error names. */
static nb_status reply_value(nb_store *s, const char *fn, const char *key, int status, nb__bytes *v) {
    if (status != NB__R_VALUE) return reply_error(s, fn, key, status);
    nb__reader r = reply_reader(s);
    *v = nb__rd_bytes(&r);
    return r.bad ? lost(s, fn, "malformed reply") : NB_OK;
}

/* The integer of a reply whose status must be NB__R_INT. */
static nb_status reply_int(nb_store *s, const char *fn, const char *key, int status, int64_t *v) {
    if (status != NB__R_INT) return reply_error(s, fn, key, status);
    nb__reader r = reply_reader(s);
    *v = nb__rd_i64(&r);
    return r.bad ? lost(s, fn, "malformed reply") : NB_OK;
}

static nb_status set_common(nb_store *s, const char *fn, const char *key, const void *value,
                            size_t len, bool quiet) {
    NB_CHECK(s != NULL, "%s: store is NULL", fn);
    check_key(fn, key);
    check_value(fn, value, len);
    size_t f = key_request(s, quiet ? NB__OP_SET_QUIET : NB__OP_SET, key);
    nb__buf_bytes(&s->out, value, len);
    int status = NB__R_OK;
    nb_status st = send_request(s, fn, f, 0, quiet, &status);
    if (st != NB_OK) return st;
    return status == NB__R_OK ? NB_OK : reply_error(s, fn, key, status);
}

nb_status nb_store_set(nb_store *s, const char *key, const void *value, size_t len) {
    return set_common(s, "nb_store_set", key, value, len, false);
}

nb_status nb__store_set_quiet(nb_store *s, const char *key, const void *value, size_t len) {
    return set_common(s, "nb_store_set", key, value, len, true);
}

static double effective_timeout(const nb_store *s, double timeout_s) {
    return timeout_s < 0 ? s->timeout_s : timeout_s;
}

static int64_t to_ms(double seconds) {
    if (seconds <= 0) return 0;
    double ms = seconds * 1000.0;
    return ms > 1e15 ? (int64_t)1e15 : (int64_t)ms + (ms > (double)(int64_t)ms ? 1 : 0);
}

/* Copies bytes into a fresh NUL-terminated buffer. */
static void *dup_bytes(nb__bytes b) {
    char *p = malloc((size_t)b.n + 1);
    NB_CHECK(p != NULL, "nb_store: out of memory for a value of %u bytes", b.n);
    if (b.n) memcpy(p, b.p, b.n);
    p[b.n] = 0;
    return p;
}

nb_status nb_store_get(nb_store *s, const char *key, double timeout_s, void **value, size_t *len) {
    const char *fn = "nb_store_get";
    NB_CHECK(s != NULL && value != NULL, "%s: store or value pointer is NULL", fn);
    check_key(fn, key);
    *value = NULL;
    if (len) *len = 0;
    double t = effective_timeout(s, timeout_s);
    size_t f = key_request(s, NB__OP_GET, key);
    nb__buf_i64(&s->out, to_ms(t));
    int status;
    nb_status st = send_request(s, fn, f, t, false, &status);
    if (st != NB_OK) return st;
    if (status == NB__R_TIMEOUT)
        return nb_set_error(NB_ERR_TIMEOUT, "%s: key '%s' did not appear within %.1f s", fn, key, t);
    nb__bytes v = {0};
    if ((st = reply_value(s, fn, key, status, &v)) != NB_OK) return st;
    *value = dup_bytes(v);
    if (len) *len = v.n;
    return NB_OK;
}

nb_status nb_store_wait(nb_store *s, const char *const *keys, int n, double timeout_s) {
    const char *fn = "nb_store_wait";
    NB_CHECK(s != NULL && keys != NULL, "%s: store or keys is NULL", fn);
    NB_CHECK(n >= 1 && n <= NB_STORE_MAX_KEYS, "%s: %d keys is outside [1, %d]", fn, n,
             NB_STORE_MAX_KEYS);
    double t = effective_timeout(s, timeout_s);
    size_t f = keys_request(s, fn, NB__OP_WAIT, keys, n);
    nb__buf_i64(&s->out, to_ms(t));
    if (s->out.n > NB_STORE_MAX_MESSAGE) {
        s->out.n = 0;
        NB_ABORT("%s: %d keys do not fit in one message", fn, n);
    }
    int status;
    nb_status st = send_request(s, fn, f, t, false, &status);
    if (st != NB_OK) return st;
    if (status == NB__R_TIMEOUT) {
        nb__reader r = reply_reader(s);
        nb__bytes text = nb__rd_bytes(&r);
        return nb_set_error(NB_ERR_TIMEOUT, "%s: timed out after %.1f s (%.*s)", fn, t, (int)text.n,
                            text.p ? (const char *)text.p : "");
    }
    return status == NB__R_OK ? NB_OK : reply_error(s, fn, NULL, status);
}

nb_status nb_store_add(nb_store *s, const char *key, int64_t delta, int64_t *result) {
    const char *fn = "nb_store_add";
    NB_CHECK(s != NULL, "%s: store is NULL", fn);
    check_key(fn, key);
    size_t f = key_request(s, NB__OP_ADD, key);
    nb__buf_i64(&s->out, delta);
    int status;
    int64_t v = 0;
    nb_status st = send_request(s, fn, f, 0, false, &status);
    if (st == NB_OK) st = reply_int(s, fn, key, status, &v);
    if (st == NB_OK && result) *result = v;
    return st;
}

nb_status nb_store_compare_set(nb_store *s, const char *key, const void *expected,
                               size_t expected_len, const void *desired, size_t desired_len,
                               void **current, size_t *current_len) {
    const char *fn = "nb_store_compare_set";
    NB_CHECK(s != NULL, "%s: store is NULL", fn);
    check_key(fn, key);
    if (expected) check_value(fn, expected, expected_len);
    check_value(fn, desired, desired_len);
    if (current) *current = NULL;
    if (current_len) *current_len = 0;
    size_t f = key_request(s, NB__OP_CAS, key);
    nb__buf_u8(&s->out, expected != NULL);
    nb__buf_bytes(&s->out, expected, expected ? expected_len : 0);
    nb__buf_bytes(&s->out, desired, desired_len);
    int status;
    nb_status st = send_request(s, fn, f, 0, false, &status);
    if (st != NB_OK) return st;
    if (status == NB__R_NOT_FOUND) return NB_OK; /* absent afterwards: *current stays NULL */
    nb__bytes v = {0};
    if ((st = reply_value(s, fn, key, status, &v)) != NB_OK) return st;
    if (current) *current = dup_bytes(v);
    if (current_len) *current_len = v.n;
    return NB_OK;
}

nb_status nb_store_delete(nb_store *s, const char *key, bool *existed) {
    const char *fn = "nb_store_delete";
    NB_CHECK(s != NULL, "%s: store is NULL", fn);
    check_key(fn, key);
    size_t f = key_request(s, NB__OP_DELETE, key);
    int status;
    int64_t v = 0;
    nb_status st = send_request(s, fn, f, 0, false, &status);
    if (st == NB_OK) st = reply_int(s, fn, key, status, &v);
    if (st == NB_OK && existed) *existed = v != 0;
    return st;
}

nb_status nb__store_mget(nb_store *s, const char *const *keys, int n, char **values) {
    const char *fn = "nb_store_mget";
    size_t f = keys_request(s, fn, NB__OP_MGET, keys, n);
    for (int i = 0; i < n; i++) values[i] = NULL;
    int status;
    nb_status st = send_request(s, fn, f, 0, false, &status);
    if (st != NB_OK) return st;
    if (status != NB__R_VALUES) return reply_error(s, fn, NULL, status);
    nb__reader r = reply_reader(s);
    uint32_t m = nb__rd_u32(&r);
    if (r.bad || m != (uint32_t)n) return lost(s, fn, "malformed reply");
    for (int i = 0; i < n; i++) {
        bool present = nb__rd_u8(&r) != 0;
        nb__bytes v = nb__rd_bytes(&r);
        if (r.bad) return lost(s, fn, "malformed reply");
        if (present) values[i] = dup_bytes(v);
    }
    return NB_OK;
}

const char *nb__store_host(const nb_store *s) { return s->host; }
const char *nb__store_path(const nb_store *s) { return s->path; }
void nb__store_set_timeout(nb_store *s, double timeout_s) { s->timeout_s = timeout_s; }
int nb__store_port(const nb_store *s) { return s->port; }
