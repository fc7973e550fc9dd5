/* The store server: one background thread, one poll() loop over the
 * listening socket and every connection (Note [Store protocol] in
 * store_proto.c has the messages).
 *
 * A GET or WAIT whose keys are missing parks its connection (later
 * frames from it wait in its input buffer) until a write provides the
 * keys, its deadline passes, or the run is aborted. A connection that
 * said HELLO with a rank is that rank's: when it drops without BYE, the
 * rank's process is gone, so the server records why under
 * NB__STORE_ABORT_KEY and answers every parked and future wait on a
 * missing key with ABORTED. That is what makes the other ranks fail within
 * a poll interval instead of at their timeout. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "distributed/internal.h"

typedef struct conn {
    int fd;
    nb__buf in, out;
    size_t out_off;
    bool hello, bye, closing; /* closing: drop once `out` is flushed */
    int rank;                 /* -1: anonymous */
    bool waiting;
    uint8_t *wait_body;       /* the parked request's frame body... */
    nb__store_req *wait_req;  /* ...parsed, pointing into it */
    double deadline;
    struct conn *next;
} conn;

struct nb_store_server {
    int listen_fd, port;
    int wake[2];
    pthread_t thread;
    char run_id[128];
    nb__kv *kv;
    conn *conns;
    bool aborted;
    char abort_reason[512];
    atomic_bool stop;
    nb__store_req scratch; /* parse target for requests that do not wait */
};

static void set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

static void conn_free(conn *c) {
    close(c->fd);
    nb__buf_free(&c->in);
    nb__buf_free(&c->out);
    free(c->wait_body);
    free(c->wait_req);
    free(c);
}

static void abort_run(nb_store_server *s, const char *why) {
    if (s->aborted) return;
    s->aborted = true;
    snprintf(s->abort_reason, sizeof s->abort_reason, "%s", why);
    nb__kv_set(s->kv, (const uint8_t *)NB__STORE_ABORT_KEY, (uint32_t)strlen(NB__STORE_ABORT_KEY),
               (const uint8_t *)s->abort_reason, (uint32_t)strlen(s->abort_reason));
}

static void unpark(conn *c) {
    c->waiting = false;
    free(c->wait_body);
    free(c->wait_req);
    c->wait_body = NULL;
    c->wait_req = NULL;
}

/* Answers every parked request that can now be answered: its keys came,
 * its deadline passed, or the run was aborted. */
static void resolve_waits(nb_store_server *s, double now) {
    for (conn *c = s->conns; c; c = c->next) {
        if (!c->waiting) continue;
        if (nb__kv_apply(s->kv, c->wait_req, &c->out)) {
            unpark(c);
        } else if (s->aborted) {
            nb__store_reply_text(&c->out, NB__R_ABORTED, s->abort_reason);
            unpark(c);
        } else if (now >= c->deadline) {
            nb__store_req *r = c->wait_req;
            if (r->op == NB__OP_GET) {
                char msg[NB_STORE_MAX_KEY + 64];
                snprintf(msg, sizeof msg, "missing: %.*s", (int)r->key.n, (const char *)r->key.p);
                nb__store_reply_text(&c->out, NB__R_TIMEOUT, msg);
            } else {
                r->num = 0; /* a WAIT told not to wait answers TIMEOUT with the missing keys */
                nb__kv_apply(s->kv, r, &c->out);
            }
            unpark(c);
        }
    }
}

static void reject(conn *c, const char *msg) {
    nb__store_reply_text(&c->out, NB__R_ERROR, msg);
    c->closing = true;
}

/* Handles one complete frame body; false means the connection must close
 * at once (malformed message). */
static bool handle(nb_store_server *s, conn *c, const uint8_t *body, uint32_t len, double now) {
    nb__store_req *req = &s->scratch;
    char why[256];
    if (nb__store_parse_request(body, len, req, why, sizeof why) != NB_OK) return false;
    if (!c->hello) {
        if (req->op != NB__OP_HELLO) return false;
        c->hello = true;
        char msg[512];
        if (req->run_id.n != strlen(s->run_id) || memcmp(req->run_id.p, s->run_id, req->run_id.n) != 0) {
            snprintf(msg, sizeof msg,
                     "this store serves run '%s' but the process is of run '%.*s' (a process left "
                     "over from an earlier run?)",
                     s->run_id, (int)req->run_id.n, (const char *)req->run_id.p);
            reject(c, msg);
            return true;
        }
        if (req->num >= 0) {
            for (conn *o = s->conns; o; o = o->next) {
                if (o != c && o->rank == (int)req->num && !o->bye) {
                    snprintf(msg, sizeof msg,
                             "rank %d is already connected to this store (two processes with the "
                             "same rank?)",
                             (int)req->num);
                    reject(c, msg);
                    return true;
                }
            }
            c->rank = (int)req->num;
        }
        nb__store_reply_text(&c->out, NB__R_OK, NULL);
        return true;
    }
    if (req->op == NB__OP_HELLO) return false;
    if (req->op == NB__OP_BYE) {
        c->bye = true;
        nb__store_reply_text(&c->out, NB__R_OK, NULL);
        return true;
    }
    if (nb__kv_apply(s->kv, req, &c->out)) {
        if (req->op == NB__OP_SET || req->op == NB__OP_SET_QUIET || req->op == NB__OP_ADD ||
            req->op == NB__OP_CAS)
            resolve_waits(s, now);
        return true;
    }
    if (s->aborted) {
        nb__store_reply_text(&c->out, NB__R_ABORTED, s->abort_reason);
        return true;
    }
    /* Park: keep a copy of the body for the parsed request to point into. */
    c->wait_body = malloc(len);
    c->wait_req = malloc(sizeof *c->wait_req);
    NB_CHECK(c->wait_body && c->wait_req, "nb_store: out of memory parking a request");
    memcpy(c->wait_body, body, len);
    nb__store_parse_request(c->wait_body, len, c->wait_req, why, sizeof why);
    c->waiting = true;
    c->deadline = now + (double)req->num / 1000.0;
    return true;
}

/* Reads what is available; handles complete frames. False: close. */
static bool on_readable(nb_store_server *s, conn *c, double now) {
    for (;;) {
        if (c->in.cap - c->in.n < 65536) {
            size_t cap = c->in.cap ? c->in.cap * 2 : 65536;
            if (cap < c->in.n + 65536) cap = c->in.n + 65536;
            uint8_t *p = realloc(c->in.p, cap);
            NB_CHECK(p != NULL, "nb_store: out of memory");
            c->in.p = p;
            c->in.cap = cap;
        }
        ssize_t got = recv(c->fd, c->in.p + c->in.n, c->in.cap - c->in.n, 0);
        if (got == 0) return false;
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return false;
        }
        c->in.n += (size_t)got;
        if (c->in.n > (size_t)NB_STORE_MAX_MESSAGE + 4 + 65536 && c->waiting) return false;
    }
    size_t off = 0;
    while (!c->waiting && !c->closing && c->in.n - off >= 4) {
        uint32_t len = nb__store_frame_len(c->in.p + off);
        if (len > NB_STORE_MAX_MESSAGE) return false;
        if (c->in.n - off - 4 < len) break;
        if (!handle(s, c, c->in.p + off + 4, len, now)) return false;
        off += 4 + (size_t)len;
    }
    if (off) {
        memmove(c->in.p, c->in.p + off, c->in.n - off);
        c->in.n -= off;
    }
    return true;
}

/* Writes what the socket takes. False: close. */
static bool on_writable(conn *c) {
    while (c->out_off < c->out.n) {
        ssize_t put = send(c->fd, c->out.p + c->out_off, c->out.n - c->out_off, MSG_NOSIGNAL);
        if (put < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
            return false;
        }
        c->out_off += (size_t)put;
    }
    c->out.n = c->out_off = 0;
    return !c->closing;
}

static void drop(nb_store_server *s, conn *c) {
    if (c->rank >= 0 && !c->bye && !atomic_load(&s->stop)) {
        char why[256];
        snprintf(why, sizeof why,
                 "rank %d disconnected from the store without saying goodbye: its process exited "
                 "or was killed",
                 c->rank);
        abort_run(s, why);
    }
    for (conn **pp = &s->conns; *pp; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    }
    conn_free(c);
}

static void accept_all(nb_store_server *s) {
    for (;;) {
        int fd = accept(s->listen_fd, NULL, NULL);
        if (fd < 0) return;
        set_nonblocking(fd);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        conn *c = calloc(1, sizeof *c);
        NB_CHECK(c != NULL, "nb_store: out of memory accepting a connection");
        c->fd = fd;
        c->rank = -1;
        c->next = s->conns;
        s->conns = c;
    }
}

static void *serve(void *arg) {
    nb_store_server *s = arg;
    struct pollfd *fds = NULL;
    conn **who = NULL;
    size_t cap = 0;
    while (!atomic_load(&s->stop)) {
        size_t n = 2;
        for (conn *c = s->conns; c; c = c->next) n++;
        if (n > cap) {
            cap = n * 2;
            fds = realloc(fds, cap * sizeof *fds);
            who = realloc(who, cap * sizeof *who);
            NB_CHECK(fds && who, "nb_store: out of memory");
        }
        fds[0] = (struct pollfd){s->listen_fd, POLLIN, 0};
        fds[1] = (struct pollfd){s->wake[0], POLLIN, 0};
        double now = nb__now(), next = now + 3600;
        size_t i = 2;
        for (conn *c = s->conns; c; c = c->next, i++) {
            who[i] = c;
            fds[i] = (struct pollfd){c->fd, (short)(POLLIN | (c->out.n > c->out_off ? POLLOUT : 0)), 0};
            if (c->waiting && c->deadline < next) next = c->deadline;
        }
        int ms = (int)((next - now) * 1000.0) + 1;
        if (poll(fds, n, ms < 0 ? 0 : ms) < 0 && errno != EINTR) break;
        now = nb__now();
        if (fds[0].revents & POLLIN) accept_all(s);
        for (i = 2; i < n; i++) {
            conn *c = who[i];
            bool ok = true;
            if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) ok = on_readable(s, c, now);
            if (ok && c->out.n > c->out_off) ok = on_writable(c);
            if (!ok) drop(s, c);
        }
        resolve_waits(s, now);
        /* Replies produced for other connections while handling this round. */
        for (conn *c = s->conns, *next_c; c; c = next_c) {
            next_c = c->next;
            if ((c->out.n > c->out_off || c->closing) && !on_writable(c)) drop(s, c);
        }
    }
    free(fds);
    free(who);
    return NULL;
}

static nb_status start_thread(nb_store_server *s) {
    if (pipe(s->wake) != 0) return nb_set_error(NB_ERR_IO, "nb_store_server_start: pipe: %s", strerror(errno));
    set_nonblocking(s->listen_fd);
    s->kv = nb__kv_new();
    atomic_init(&s->stop, false);
    if (pthread_create(&s->thread, NULL, serve, s) != 0) {
        nb__kv_free(s->kv);
        close(s->wake[0]);
        close(s->wake[1]);
        return nb_set_error(NB_ERR_INTERNAL, "nb_store_server_start: cannot start the server thread");
    }
    return NB_OK;
}

static nb_status finish_start(nb_store_server **out, nb_store_server *s, const char *run_id) {
    snprintf(s->run_id, sizeof s->run_id, "%s", run_id ? run_id : "default");
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(s->listen_fd, (struct sockaddr *)&ss, &sl) != 0) {
        close(s->listen_fd);
        free(s);
        return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: getsockname: %s", strerror(errno));
    }
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    nb_status st = start_thread(s);
    if (st != NB_OK) {
        close(s->listen_fd);
        free(s);
        return st;
    }
    *out = s;
    return NB_OK;
}

int nb__tcp_listen(const char *host, int port, int *gai_err, int *sys_err) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = host ? AF_UNSPEC : AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    *gai_err = getaddrinfo(host, port_s, &hints, &res);
    *sys_err = 0;
    if (*gai_err != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            *sys_err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
            *sys_err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    return fd;
}

nb_status nb_store_server_start(nb_store_server **out, const char *host, int port,
                                const char *run_id) {
    *out = NULL;
    NB_CHECK(port >= 0 && port <= 65535, "nb_store_server_start: port %d out of range", port);
    const char *h = host && *host ? host : NULL;
    int gai = 0, err = 0;
    int fd = nb__tcp_listen(h, port, &gai, &err);
    if (fd < 0 && gai)
        return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: cannot resolve %s: %s", h,
                            gai_strerror(gai));
    if (fd < 0 && err == EADDRINUSE)
        return nb_set_error(NB_ERR_NETWORK,
                            "nb_store_server_start: cannot listen on %s:%d: %s; another program holds "
                            "the port (MASTER_PORT): pick a free one (nbrun --master-port 0 does)",
                            h ? h : "0.0.0.0", port, strerror(err));
    if (fd < 0)
        return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: cannot listen on %s:%d: %s",
                            h ? h : "0.0.0.0", port, strerror(err));
    nb_store_server *s = calloc(1, sizeof *s);
    NB_CHECK(s != NULL, "nb_store_server_start: out of memory");
    s->listen_fd = fd;
    return finish_start(out, s, run_id);
}

nb_status nb__store_server_adopt(nb_store_server **out, int listen_fd, const char *run_id) {
    *out = NULL;
    int listening = 0;
    socklen_t sl = sizeof listening;
    if (getsockopt(listen_fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &sl) != 0 || !listening)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_store_server_start: NABLA_STORE_FD=%d is not a listening socket",
                            listen_fd);
    fcntl(listen_fd, F_SETFD, FD_CLOEXEC);
    nb_store_server *s = calloc(1, sizeof *s);
    NB_CHECK(s != NULL, "nb_store_server_start: out of memory");
    s->listen_fd = listen_fd;
    return finish_start(out, s, run_id);
}

int nb_store_server_port(const nb_store_server *server) { return server->port; }

void nb_store_server_stop(nb_store_server *s) {
    if (!s) return;
    atomic_store(&s->stop, true);
    ssize_t w = write(s->wake[1], "x", 1);
    (void)w;
    pthread_join(s->thread, NULL);
    while (s->conns) {
        conn *c = s->conns;
        s->conns = c->next;
        conn_free(c);
    }
    close(s->listen_fd);
    close(s->wake[0]);
    close(s->wake[1]);
    nb__kv_free(s->kv);
    free(s);
}
