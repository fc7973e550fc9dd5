/* The store server: one background thread, one poll() loop over the
 * listening socket and every connection (Note [Store protocol] in
 * store_proto.c has the messages). What a connection's bytes do is kept
 * apart from the sockets (feed, handle), so that the fuzzer can drive
 * several connections without them (nb__store_core_*).
 *
 * A GET or WAIT whose keys are missing parks its connection (later
 * frames from it wait in its input buffer) until a write provides the
 * keys, its deadline passes, or the run is aborted. A connection that
 * said HELLO with a rank is that rank's: when it drops without BYE, the
 * rank's process is gone, so the server records why under
 * NB__STORE_ABORT_KEY and answers every parked and future wait on a
 * missing key with ABORTED. That is what makes the other ranks fail within
 * a poll interval instead of at their timeout.
 *
 * Note [Store authentication]
 * The store is the run's control plane: whoever may write to it can stop
 * the run or feed the ranks wrong addresses. So a connection is admitted
 * only once it has shown that it belongs to the run:
 *   - HELLO names the run id and the rank, with a fresh client nonce. A
 *     wrong run id is refused with a message that repeats the client's id,
 *     never the store's. The server keeps the last few such refusals (id,
 *     claimed rank, peer address) for rank 0's join, which names them in
 *     its own process (nb__store_server_refusals).
 *   - A store with a secret answers CHALLENGE with a fresh server nonce;
 *     the client answers AUTH with HMAC-SHA256(secret, "nabla store
 *     client", both nonces, run id, rank), which the server compares in
 *     constant time; the OK carries the server's own proof ("nabla store
 *     server", same fields), which the client checks, so that a program
 *     squatting on MASTER_PORT cannot pose as the store. The secret itself
 *     never travels.
 *   - Then the rank must lie in [0, world size) and be held by no live
 *     connection. Only then is the connection a rank's, whose departure
 *     aborts the run: a refused or unauthenticated peer hanging up changes
 *     nothing.
 * Before admission a connection may send frames of at most
 * NB__STORE_PREAUTH_MAX_FRAME bytes (a HELLO is under 200) and must be
 * admitted within NB__STORE_AUTH_TIMEOUT_S of its accept. After admission
 * the limits are the table's (NB_STORE_MAX_VALUE per value,
 * NB__STORE_MAX_BYTES in all).
 *
 * Note [Stale greetings]
 * A rank that gives up on the store (its deadline passed while the store
 * was busy) closes its connection with its HELLO still unread in the
 * store's socket. Read later, that HELLO would admit a rank whose process
 * is gone, and the end of file that follows would abort the run with a
 * false story ("rank 1 disconnected ... without saying goodbye"), or hold
 * the rank's place against its next attempt. So a connection not yet
 * admitted whose peer has hung up (POLLRDHUP: the end of file is queued)
 * is closed without reading what it sent.
 *
 * Note [Admission under a flood]
 * Idle connections opened faster than the deadline closes them (500 held,
 * 20 new a second) must not keep the run's ranks out. The store once held
 * at most 64 unproven connections and left the others in the kernel's
 * backlog: a rank's connection queued behind hundreds of strangers' and
 * was not read before its own deadline. Now every pending connection is
 * accepted at once, so a rank's HELLO is read in the round it arrives, and
 * the memory and descriptors strangers can take are bounded by eviction
 * instead of by the backlog: at most NB__STORE_SOURCE_QUOTA unproven
 * connections per source address and NB__STORE_MAX_PENDING in all; past
 * either, the oldest unproven one (of that source, then of all) is told
 * why and closed. A rank proves itself within a round trip of connecting,
 * so it is the newest, never the oldest; and a stranger on another host
 * cannot push a rank out, since the quota is per source. A rank whose
 * connection is evicted anyway (a flood from its own host) connects again
 * until its own deadline and, if it fails, names what the store said.
 * Every NB__STORE_SUMMARY_S at most, the store says on stderr how many
 * connections it refused, dropped or closed unproven since the last line,
 * and from which sources; rank 0's join names them when a rank never
 * comes (nb__store_server_unproven).
 *
 * Without a secret, HELLO alone admits, and the store must listen on a
 * Unix-domain socket whose peers the kernel names (a world on one node:
 * Note [Store on one node] in store_unix.c; connections of another user
 * are refused before a byte is read) or on loopback (NABLA_STORE_TRANSPORT
 * =tcp), unless the user declares the network trusted
 * (NABLA_STORE_TRUSTED_NETWORK=1). docs/distributed.md
 * ("Security") says what this protects and what it does not: nothing is
 * encrypted, and the backends' own traffic is not authenticated. */
#define _GNU_SOURCE /* POLLRDHUP: Note [Stale greetings] */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "distributed/internal.h"

typedef enum { C_HELLO = 0, C_CHALLENGED, C_READY } conn_state;

struct nb__store_conn {
    int fd;                   /* -1: driven through nb__store_core_* */
    nb__buf in, out;
    size_t out_off;
    conn_state state;
    bool bye, closing;        /* closing: drop once `out` is flushed */
    int rank;                 /* -1: anonymous, or not admitted (yet) */
    int64_t hello_rank;       /* what HELLO asked for, admitted after AUTH */
    uint8_t client_nonce[NB__STORE_NONCE_LEN], server_nonce[NB__STORE_NONCE_LEN];
    double auth_deadline;     /* admitted by then, or closed */
    char peer[48];            /* the source's numeric address ("" for core connections) */
    bool waiting;
    uint8_t *wait_body;       /* the parked request's frame body... */
    nb__store_req *wait_req;  /* ...parsed, pointing into it */
    double deadline;
    struct nb__store_conn *next;
};
typedef struct nb__store_conn conn;

#define RECV_CHUNK 65536
/* A connection past its authentication deadline whose refusal cannot be
 * flushed (its peer does not read) is dropped this much later anyway. */
#define AUTH_GRACE_S 1.0

/* Note [Store on one node]: the socket file is touched this often. */
#define TOUCH_S 3600.0

struct nb_store_server {
    int listen_fd, port;
    bool local;            /* a Unix-domain socket: peers are checked by uid */
    char where[128];       /* "port N" or the socket's path, for messages */
    char path[112];        /* its file, removed at stop while it is still ours */
    dev_t path_dev;
    ino_t path_ino;
    double touch_at;
    int wake[2];
    bool threaded;
    pthread_t thread;
    char run_id[128];
    uint8_t secret[NB__STORE_SECRET_MAX];
    size_t secret_len;
    int world_size;
    double auth_timeout_s;
    int max_pending, source_quota;
    double accept_pause_until; /* out of descriptors: accept again then */
    nb__kv *kv;
    conn *conns;
    bool aborted;
    char abort_reason[512];
    atomic_bool stop;
    pthread_mutex_t refusals_mu; /* guards the three below: the join reads them */
    nb__store_refusal refusals[NB__STORE_REFUSALS_KEPT];
    uint64_t refused;      /* HELLOs refused for their run id, ever */
    uint64_t beyond;       /* ranks refused as beyond the world, ever */
    atomic_ullong fp_writes; /* sets of keys under NB__STORE_FP_PREFIX, ever */
    uint8_t *rbuf;         /* RECV_CHUNK bytes */
    /* Note [Admission under a flood]: unproven connections refused, dropped
     * or closed, by source, since the last summary line (and ever) */
    struct { char peer[48]; uint64_t n; } lost[NB__STORE_SUMMARY_SOURCES];
    int n_lost_sources;
    uint64_t lost_now, lost_other, lost_ever, unproven_peak;
    double summary_at, summary_from;
    bool *rank_seen; /* [world_size]: a connection was admitted as that rank */
    nb__store_req scratch; /* parse target for requests that do not wait */
};

static void set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

static void conn_free(conn *c) {
    if (c->fd >= 0) close(c->fd);
    nb__buf_free(&c->in);
    nb__buf_free(&c->out);
    free(c->wait_body);
    free(c->wait_req);
    free(c);
}

static int pending_count(const nb_store_server *s) {
    int n = 0;
    for (const conn *c = s->conns; c; c = c->next) n += c->state != C_READY && !c->closing;
    return n;
}

/* Note [Admission under a flood]: one more unproven connection of c's
 * source closed (refused, dropped, or past its deadline). */
static void count_lost(nb_store_server *s, const conn *c) {
    if (c->fd < 0) return;
    pthread_mutex_lock(&s->refusals_mu);
    s->lost_now++;
    s->lost_ever++;
    int i = 0;
    while (i < s->n_lost_sources && strcmp(s->lost[i].peer, c->peer) != 0) i++;
    if (i == s->n_lost_sources && i < NB__STORE_SUMMARY_SOURCES) {
        snprintf(s->lost[i].peer, sizeof s->lost[i].peer, "%s", c->peer);
        s->lost[i].n = 0;
        s->n_lost_sources++;
    }
    if (i < s->n_lost_sources) s->lost[i].n++;
    else s->lost_other++;
    pthread_mutex_unlock(&s->refusals_mu);
}

/* "127.0.0.1 (480), 10.0.0.2 (3)" of what count_lost gathered (under refusals_mu). */
static void lost_sources(const nb_store_server *s, char *out, size_t len) {
    out[0] = '\0';
    for (int i = 0; i < s->n_lost_sources; i++) {
        size_t u = strlen(out);
        snprintf(out + u, len - u, "%s%s (%llu)", i ? ", " : "", s->lost[i].peer,
                 (unsigned long long)s->lost[i].n);
    }
    if (s->lost_other) {
        size_t u = strlen(out);
        snprintf(out + u, len - u, ", other sources (%llu)", (unsigned long long)s->lost_other);
    }
}

/* The line on stderr, at most every NB__STORE_SUMMARY_S. */
static void summarize(nb_store_server *s, double now) {
    if (now < s->summary_at) return;
    pthread_mutex_lock(&s->refusals_mu);
    if (s->lost_now) {
        char from[600];
        lost_sources(s, from, sizeof from);
        fprintf(stderr,
                "nabla: the store at %s closed %llu connection%s in %.1f s that did not prove they "
                "belong to the run (refused, idle past %.1f s, or dropped to make room; up to %llu held "
                "at once), from %s; the run's ranks are still admitted first (a port scan? a flood?)\n",
                s->where, (unsigned long long)s->lost_now, s->lost_now == 1 ? "" : "s",
                now - s->summary_from, s->auth_timeout_s,
                (unsigned long long)s->unproven_peak, from);
        s->lost_now = 0;
        s->lost_other = 0;
        s->n_lost_sources = 0;
    }
    s->summary_at = now + NB__STORE_SUMMARY_S;
    s->summary_from = now;
    pthread_mutex_unlock(&s->refusals_mu);
}

int nb__store_server_ranks_seen(nb_store_server *s, bool *seen, int n) {
    if (!s->rank_seen) return 0;
    pthread_mutex_lock(&s->refusals_mu);
    int m = n < s->world_size ? n : s->world_size;
    for (int r = 0; r < m; r++) seen[r] = s->rank_seen[r];
    pthread_mutex_unlock(&s->refusals_mu);
    return m;
}

int nb__store_server_unproven(nb_store_server *s, char *out, size_t len) {
    pthread_mutex_lock(&s->refusals_mu);
    uint64_t ever = s->lost_ever;
    char from[600];
    lost_sources(s, from, sizeof from);
    if (ever)
        snprintf(out, len, "%llu connection%s that never proved they belong to the run (up to %llu "
                 "at once%s%s)", (unsigned long long)ever, ever == 1 ? "" : "s",
                 (unsigned long long)s->unproven_peak, from[0] ? "; lately from " : "", from);
    else if (len) out[0] = '\0';
    pthread_mutex_unlock(&s->refusals_mu);
    return ever > 0;
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

/* A connection that never was a rank's closes: counted for the summary. */
static void reject_unproven(nb_store_server *s, conn *c, const char *msg) {
    if (!c->closing) count_lost(s, c);
    reject(c, msg);
}

/* The last step of Note [Store authentication]: the rank's checks. */
static bool admit(nb_store_server *s, conn *c, int64_t rank) {
    char msg[512];
    if (rank >= 0 && s->world_size > 0 && rank >= s->world_size) {
        snprintf(msg, sizeof msg, "rank %lld is not a rank of this run, whose ranks are 0 to %d (WORLD_SIZE=%d)",
                 (long long)rank, s->world_size - 1, s->world_size);
        reject_unproven(s, c, msg);
        pthread_mutex_lock(&s->refusals_mu);
        s->beyond++;
        pthread_mutex_unlock(&s->refusals_mu);
        return true;
    }
    if (rank >= 0) {
        for (conn *o = s->conns; o; o = o->next) {
            if (o != c && o->rank == (int)rank && !o->bye) {
                snprintf(msg, sizeof msg,
                         "rank %d is already connected to this store (two processes with the "
                         "same rank?)",
                         (int)rank);
                reject_unproven(s, c, msg);
                return true;
            }
        }
    }
    c->rank = (int)rank;
    c->state = C_READY;
    if (rank >= 0 && s->rank_seen) {
        pthread_mutex_lock(&s->refusals_mu);
        s->rank_seen[rank] = true;
        pthread_mutex_unlock(&s->refusals_mu);
    }
    size_t f = nb__buf_frame_begin(&c->out);
    nb__buf_u8(&c->out, NB__R_OK);
    if (s->secret_len) {
        uint8_t mac[NB__STORE_MAC_LEN];
        nb__store_mac(s->secret, s->secret_len, "nabla store server", c->client_nonce,
                      c->server_nonce, s->run_id, rank, mac);
        nb__buf_bytes(&c->out, mac, sizeof mac);
    }
    nb__buf_frame_end(&c->out, f);
    return true;
}

/* Keeps a refused HELLO's run id, rank and peer for the join. */
static void note_refusal(nb_store_server *s, const conn *c, const nb__store_req *req) {
    nb__store_refusal r = {.rank = req->num, .peer = "?"};
    size_t n = req->run_id.n < sizeof r.run_id - 1 ? req->run_id.n : sizeof r.run_id - 1;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = ((const uint8_t *)req->run_id.p)[i];
        r.run_id[i] = b >= 0x20 && b < 0x7f ? (char)b : '?';
    }
    r.run_id[n] = '\0';
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char host[64], port[16];
    if (s->local) snprintf(r.peer, sizeof r.peer, "%s", c->peer);
    else if (c->fd >= 0 && getpeername(c->fd, (struct sockaddr *)&ss, &sl) == 0 &&
        getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0)
        snprintf(r.peer, sizeof r.peer, "%s:%s", host, port);
    pthread_mutex_lock(&s->refusals_mu);
    s->refusals[s->refused % NB__STORE_REFUSALS_KEPT] = r;
    s->refused++;
    pthread_mutex_unlock(&s->refusals_mu);
}

uint64_t nb__store_server_fp_writes(nb_store_server *s) { return atomic_load(&s->fp_writes); }

uint64_t nb__store_server_beyond(nb_store_server *s) {
    pthread_mutex_lock(&s->refusals_mu);
    uint64_t n = s->beyond;
    pthread_mutex_unlock(&s->refusals_mu);
    return n;
}

int nb__store_server_refusals(nb_store_server *s, uint64_t *seen, nb__store_refusal *out, int max) {
    int k = 0;
    pthread_mutex_lock(&s->refusals_mu);
    if (s->refused > NB__STORE_REFUSALS_KEPT && *seen < s->refused - NB__STORE_REFUSALS_KEPT)
        *seen = s->refused - NB__STORE_REFUSALS_KEPT;
    for (; *seen < s->refused && k < max; (*seen)++) out[k++] = s->refusals[*seen % NB__STORE_REFUSALS_KEPT];
    pthread_mutex_unlock(&s->refusals_mu);
    return k;
}

static bool on_hello(nb_store_server *s, conn *c, const nb__store_req *req) {
    if (req->run_id.n != strlen(s->run_id) || memcmp(req->run_id.p, s->run_id, req->run_id.n) != 0) {
        note_refusal(s, c, req);
        /* The client's own id only: the store's would let anyone in. */
        char msg[512];
        snprintf(msg, sizeof msg,
                 "the process is of run '%.*s' but this store serves another run (a process left "
                 "over from an earlier run, or MASTER_ADDR and MASTER_PORT of another run?)",
                 (int)req->run_id.n, (const char *)req->run_id.p);
        reject_unproven(s, c, msg);
        return true;
    }
    memcpy(c->client_nonce, req->nonce.p, NB__STORE_NONCE_LEN);
    if (!s->secret_len) return admit(s, c, req->num);
    c->hello_rank = req->num;
    nb__store_random(c->server_nonce, NB__STORE_NONCE_LEN);
    size_t f = nb__buf_frame_begin(&c->out);
    nb__buf_u8(&c->out, NB__R_CHALLENGE);
    nb__buf_bytes(&c->out, c->server_nonce, NB__STORE_NONCE_LEN);
    nb__buf_frame_end(&c->out, f);
    c->state = C_CHALLENGED;
    return true;
}

static bool on_auth(nb_store_server *s, conn *c, const nb__store_req *req) {
    uint8_t want[NB__STORE_MAC_LEN];
    nb__store_mac(s->secret, s->secret_len, "nabla store client", c->client_nonce, c->server_nonce,
                  s->run_id, c->hello_rank, want);
    bool ok = nb__store_mac_equal(want, req->mac.p);
    nb__store_wipe(want, sizeof want);
    if (!ok) {
        reject_unproven(s, c, "the process did not prove that it knows this run's secret (is "
                  "NABLA_STORE_SECRET_FILE or NABLA_STORE_SECRET the same on every node? a process "
                  "of another run?)");
        return true;
    }
    return admit(s, c, c->hello_rank);
}

/* Handles one complete frame body; false means the connection must close
 * at once (malformed message, or one out of turn). */
static bool handle(nb_store_server *s, conn *c, const uint8_t *body, uint32_t len, double now) {
    nb__store_req *req = &s->scratch;
    char why[256];
    if (nb__store_parse_request(body, len, req, why, sizeof why) != NB_OK) return false;
    if (c->state == C_HELLO) return req->op == NB__OP_HELLO && on_hello(s, c, req);
    if (c->state == C_CHALLENGED) return req->op == NB__OP_AUTH && on_auth(s, c, req);
    if (req->op == NB__OP_HELLO || req->op == NB__OP_AUTH) return false;
    if (req->op == NB__OP_BYE) {
        c->bye = true;
        nb__store_reply_text(&c->out, NB__R_OK, NULL);
        return true;
    }
    size_t before = c->out.n;
    if ((req->op == NB__OP_SET || req->op == NB__OP_SET_QUIET) && req->key.n >= strlen(NB__STORE_FP_PREFIX) &&
        memcmp(req->key.p, NB__STORE_FP_PREFIX, strlen(NB__STORE_FP_PREFIX)) == 0)
        atomic_fetch_add(&s->fp_writes, 1);
    if (nb__kv_apply(s->kv, req, &c->out)) {
        /* A quiet set the table refused has no reply to carry its error:
         * the client reads it at its next call, and the connection ends. */
        if (req->op == NB__OP_SET_QUIET && c->out.n > before) c->closing = true;
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

/* Handles the complete frames in c->in. False: close. */
static bool ingest(nb_store_server *s, conn *c, double now) {
    size_t off = 0;
    while (!c->waiting && !c->closing && c->in.n - off >= 4) {
        uint32_t len = nb__store_frame_len(c->in.p + off);
        uint32_t max = c->state == C_READY ? NB_STORE_MAX_MESSAGE : NB__STORE_PREAUTH_MAX_FRAME;
        if (len > max) return false;
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

/* Takes bytes received on c. Before admission at most one small frame is
 * buffered; a parked connection may buffer one more message. False: close. */
static bool feed(nb_store_server *s, conn *c, const uint8_t *p, size_t n, double now) {
    while (n > 0) {
        if (c->closing) return true; /* what follows a refusal is not read */
        size_t take = n;
        if (c->state != C_READY) {
            size_t cap = NB__STORE_PREAUTH_MAX_FRAME + 4;
            if (c->in.n >= cap) return false;
            if (take > cap - c->in.n) take = cap - c->in.n;
        } else if (c->waiting && c->in.n + take > (size_t)NB_STORE_MAX_MESSAGE + 4 + RECV_CHUNK) {
            return false;
        }
        if (c->in.cap - c->in.n < take) {
            size_t cap = c->in.cap ? c->in.cap * 2 : 1024;
            if (cap < c->in.n + take) cap = c->in.n + take;
            uint8_t *q = realloc(c->in.p, cap);
            NB_CHECK(q != NULL, "nb_store: out of memory buffering %zu bytes", cap);
            c->in.p = q;
            c->in.cap = cap;
        }
        memcpy(c->in.p + c->in.n, p, take);
        c->in.n += take;
        p += take;
        n -= take;
        if (!ingest(s, c, now)) return false;
    }
    return true;
}

/* Reads what is available. False: close. */
static bool on_readable(nb_store_server *s, conn *c, double now) {
    while (!c->closing) {
        ssize_t got = recv(c->fd, s->rbuf, RECV_CHUNK, 0);
        if (got == 0) return false;
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return false;
        }
        if (!feed(s, c, s->rbuf, (size_t)got, now)) return false;
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
    if (c->state != C_READY && !c->closing) count_lost(s, c); /* hung up unproven, or malformed */
    /* c->rank is set only once admitted (Note [Store authentication]). */
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

static conn *add_conn(nb_store_server *s, int fd, double now) {
    conn *c = calloc(1, sizeof *c);
    NB_CHECK(c != NULL, "nb_store: out of memory accepting a connection");
    c->fd = fd;
    c->rank = -1;
    c->auth_deadline = now + s->auth_timeout_s;
    c->next = s->conns;
    s->conns = c;
    return c;
}

/* Pending connections past their deadline are told so and closed. */
static void auth_deadlines(nb_store_server *s, double now) {
    for (conn *c = s->conns; c; c = c->next) {
        if (c->state == C_READY || c->closing || now < c->auth_deadline) continue;
        char msg[160];
        snprintf(msg, sizeof msg, "not admitted within %.1f s of connecting (HELLO and the secret's "
                 "proof must come at once)", s->auth_timeout_s);
        reject_unproven(s, c, msg);
    }
}

/* The oldest live unproven connection (of `peer`, or of any source when
 * NULL) other than `keep`, and how many there are; new ones are at the
 * head of the list, so the oldest is the last met. */
static conn *oldest_unproven(nb_store_server *s, const char *peer, const conn *keep, int *count) {
    conn *old = NULL;
    *count = 0;
    for (conn *c = s->conns; c; c = c->next) {
        if (c->state == C_READY || c->closing || (peer && strcmp(c->peer, peer) != 0)) continue;
        (*count)++;
        if (c != keep) old = c;
    }
    return old;
}

/* Note [Admission under a flood]: makes room for c within the quotas. */
static void evict_for(nb_store_server *s, conn *c) {
    char msg[320];
    for (int pass = 0; pass < 2; pass++) {
        int count, cap = pass == 0 ? s->source_quota : s->max_pending;
        conn *old = oldest_unproven(s, pass == 0 ? c->peer : NULL, c, &count);
        if (count > (int)s->unproven_peak) s->unproven_peak = (uint64_t)count;
        while (old && count > cap) {
            snprintf(msg, sizeof msg,
                     NB__STORE_DROPPED ": the store holds %d connections that have not proved they "
                     "belong to the run%s%s, and this was the oldest (a flood of connections?)",
                     count, pass == 0 ? " from " : "", pass == 0 ? c->peer : "");
            reject_unproven(s, old, msg);
            old = oldest_unproven(s, pass == 0 ? c->peer : NULL, c, &count);
        }
    }
}

/* Accepts every connection pending (Note [Admission under a flood]). */
static void accept_all(nb_store_server *s, double now) {
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept(s->listen_fd, (struct sockaddr *)&ss, &sl);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            /* out of descriptors: make room and leave the rest for the next round */
            if ((errno == EMFILE || errno == ENFILE) && s->conns) {
                int count;
                conn *old = oldest_unproven(s, NULL, NULL, &count);
                if (old) reject_unproven(s, old, NB__STORE_DROPPED ": the store is out of descriptors");
                s->accept_pause_until = now + 0.05;
            }
            return;
        }
        set_nonblocking(fd);
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        conn *c = add_conn(s, fd, now);
        if (s->local) {
            /* Note [Store on one node]: the source is the peer's uid, and
             * another user's connection is refused before a byte is read */
            unsigned uid = 0;
            int pid = 0;
            bool known = nb__store_peer_uid(fd, &uid, &pid);
            snprintf(c->peer, sizeof c->peer, known ? "uid %u" : "uid ?", uid);
            if (!known || uid != (unsigned)geteuid()) {
                char msg[200];
                snprintf(msg, sizeof msg, "this store admits only processes of its own user (uid %u); "
                         "this process runs as %s (pid %d)", (unsigned)geteuid(), c->peer, pid);
                reject_unproven(s, c, msg);
                continue;
            }
        } else {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            char port[16];
            if (getnameinfo((struct sockaddr *)&ss, sl, c->peer, sizeof c->peer, port, sizeof port,
                            NI_NUMERICHOST | NI_NUMERICSERV) != 0)
                snprintf(c->peer, sizeof c->peer, "?");
        }
        evict_for(s, c);
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
        double now = nb__now(), next = now + 3600;
        /* Note [Admission under a flood]: every pending connection is accepted */
        bool room = now >= s->accept_pause_until;
        if (!room) next = s->accept_pause_until;
        if (s->lost_now && s->summary_at < next) next = s->summary_at;
        if (s->local && s->touch_at < next) next = s->touch_at;
        fds[0] = (struct pollfd){s->listen_fd, (short)(room ? POLLIN : 0), 0};
        fds[1] = (struct pollfd){s->wake[0], POLLIN, 0};
        size_t i = 2;
        for (conn *c = s->conns; c; c = c->next, i++) {
            who[i] = c;
            short ev = (short)((c->closing ? 0 : POLLIN) | (c->out.n > c->out_off ? POLLOUT : 0) |
                               (c->state != C_READY ? POLLRDHUP : 0));
            fds[i] = (struct pollfd){c->fd, ev, 0};
            if (c->waiting && c->deadline < next) next = c->deadline;
            if (c->state != C_READY) {
                double d = c->closing ? c->auth_deadline + AUTH_GRACE_S : c->auth_deadline;
                if (d < next) next = d;
            }
        }
        int ms = (int)((next - now) * 1000.0) + 1;
        if (poll(fds, n, ms < 0 ? 0 : ms) < 0 && errno != EINTR) break;
        now = nb__now();
        if (fds[0].revents & POLLIN) accept_all(s, now);
        for (i = 2; i < n; i++) {
            conn *c = who[i];
            bool ok = true;
            /* Note [Stale greetings]: a peer that hung up before it was admitted is not */
            if (c->state != C_READY && (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) ok = false;
            else if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) ok = on_readable(s, c, now);
            if (ok && c->out.n > c->out_off) ok = on_writable(c);
            if (!ok) drop(s, c);
        }
        resolve_waits(s, now);
        auth_deadlines(s, now);
        summarize(s, now);
        if (s->local && now >= s->touch_at) {
            utimensat(AT_FDCWD, s->path, NULL, AT_SYMLINK_NOFOLLOW); /* Note [Store on one node] */
            s->touch_at = now + TOUCH_S;
        }
        /* Replies produced for other connections while handling this round. */
        for (conn *c = s->conns, *next_c; c; c = next_c) {
            next_c = c->next;
            bool late = c->state != C_READY && now >= c->auth_deadline + AUTH_GRACE_S;
            if (late || ((c->out.n > c->out_off || c->closing) && !on_writable(c))) drop(s, c);
        }
    }
    free(fds);
    free(who);
    return NULL;
}

/* A server without socket or thread, configured from cfg. */
static nb_store_server *server_new(const nb__store_config *cfg) {
    nb_store_server *s = calloc(1, sizeof *s);
    NB_CHECK(s != NULL, "nb_store_server_start: out of memory");
    const char *run_id = cfg && cfg->run_id ? cfg->run_id : "default";
    NB_CHECK(strlen(run_id) <= 127, "nb_store_server_start: run id longer than 127 bytes");
    snprintf(s->run_id, sizeof s->run_id, "%s", run_id);
    if (cfg && cfg->secret && cfg->secret_len) {
        NB_CHECK(cfg->secret_len <= NB__STORE_SECRET_MAX,
                 "nb_store_server_start: a secret of %zu bytes is over %d", cfg->secret_len,
                 NB__STORE_SECRET_MAX);
        memcpy(s->secret, cfg->secret, cfg->secret_len);
        s->secret_len = cfg->secret_len;
    }
    s->world_size = cfg ? cfg->world_size : 0;
    if (s->world_size > 0) {
        s->rank_seen = calloc((size_t)s->world_size, sizeof *s->rank_seen);
        NB_CHECK(s->rank_seen != NULL, "nb_store_server_start: out of memory");
    }
    s->auth_timeout_s = cfg && cfg->auth_timeout_s > 0 ? cfg->auth_timeout_s : NB__STORE_AUTH_TIMEOUT_S;
    s->max_pending = cfg && cfg->max_pending > 0 ? cfg->max_pending : NB__STORE_MAX_PENDING;
    s->source_quota = NB__STORE_SOURCE_QUOTA < s->max_pending ? NB__STORE_SOURCE_QUOTA : s->max_pending;
    s->kv = nb__kv_new(cfg ? cfg->max_bytes : 0);
    s->listen_fd = -1;
    s->wake[0] = s->wake[1] = -1;
    atomic_init(&s->stop, false);
    s->summary_from = nb__now();
    pthread_mutex_init(&s->refusals_mu, NULL);
    return s;
}

static void server_free(nb_store_server *s) {
    while (s->conns) {
        conn *c = s->conns;
        s->conns = c->next;
        conn_free(c);
    }
    if (s->listen_fd >= 0) close(s->listen_fd);
    struct stat st;
    if (s->local && s->path[0] && stat(s->path, &st) == 0 && st.st_dev == s->path_dev &&
        st.st_ino == s->path_ino)
        unlink(s->path); /* Note [Store on one node]: our file, not a later run's */
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    nb__kv_free(s->kv);
    free(s->rbuf);
    free(s->rank_seen);
    nb__store_wipe(s->secret, sizeof s->secret);
    pthread_mutex_destroy(&s->refusals_mu);
    free(s);
}

static bool is_loopback(const struct sockaddr_storage *ss) {
    if (ss->ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)ss)->sin_addr.s_addr) >> 24) == 127;
    if (ss->ss_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)ss)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return true;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return false;
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

static const char *describe(const struct sockaddr_storage *ss, char *buf, size_t len) {
    const void *a = ss->ss_family == AF_INET6 ? (const void *)&((const struct sockaddr_in6 *)ss)->sin6_addr
                                              : (const void *)&((const struct sockaddr_in *)ss)->sin_addr;
    if (!inet_ntop(ss->ss_family, a, buf, (socklen_t)len)) snprintf(buf, len, "?");
    return buf;
}

nb_status nb__store_server_start(nb_store_server **out, const char *host, int port, int listen_fd,
                                 const nb__store_config *cfg) {
    *out = NULL;
    int fd = listen_fd;
    const char *path = cfg && cfg->unix_path && *cfg->unix_path ? cfg->unix_path : NULL;
    if (fd >= 0) {
        int listening = 0;
        socklen_t sl = sizeof listening;
        if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &sl) != 0 || !listening)
            return nb_set_error(NB_ERR_INVALID,
                                "nb_store_server_start: NABLA_STORE_FD=%d is not a listening socket",
                                fd);
        fcntl(fd, F_SETFD, FD_CLOEXEC);
    } else if (path) {
        int err = 0;
        fd = nb__store_unix_listen(path, &err);
        if (fd < 0 && err == EADDRINUSE)
            return nb_set_error(NB_ERR_NETWORK,
                                "nb_store_server_start: a store of this user already serves %s: "
                                "another run on the same port (MASTER_PORT %d)? pick a free one "
                                "(nbrun --master-port 0 does)", path, port);
        if (fd < 0)
            return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: cannot listen on %s: %s", path,
                                strerror(err));
    } else {
        NB_CHECK(port >= 0 && port <= 65535, "nb_store_server_start: port %d out of range", port);
        const char *h = host && *host ? host : NULL;
        int gai = 0, err = 0;
        fd = nb__tcp_listen(h, port, &gai, &err);
        if (fd < 0 && gai)
            return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: cannot resolve %s: %s", h,
                                gai_strerror(gai));
        if (fd < 0 && err == EADDRINUSE)
            return nb_set_error(NB_ERR_NETWORK,
                                "nb_store_server_start: cannot listen on %s:%d: %s; another program "
                                "holds the port (MASTER_PORT): pick a free one (nbrun --master-port "
                                "0 does)",
                                h ? h : "0.0.0.0", port, strerror(err));
        if (fd < 0)
            return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: cannot listen on %s:%d: %s",
                                h ? h : "0.0.0.0", port, strerror(err));
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    memset(&ss, 0, sizeof ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        int err = errno;
        close(fd);
        return nb_set_error(NB_ERR_NETWORK, "nb_store_server_start: getsockname: %s", strerror(err));
    }
    bool local = ss.ss_family == AF_UNIX;
    if (listen_fd >= 0 && path &&
        (!local || strncmp(((const struct sockaddr_un *)&ss)->sun_path, path,
                           sizeof ((const struct sockaddr_un *)&ss)->sun_path) != 0)) {
        close(fd);
        return nb_set_error(NB_ERR_INVALID,
                            "nb_store_server_start: NABLA_STORE_FD=%d is not the Unix-domain socket %s "
                            "through which the ranks of a world on one node reach the store (Note "
                            "[Store on one node]); a launcher that hands over a TCP socket needs "
                            "NABLA_STORE_TRANSPORT=tcp on every rank", fd, path);
    }
    int bound = local ? port
                      : ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                       : ((struct sockaddr_in *)&ss)->sin_port);
    bool secret = cfg && cfg->secret && cfg->secret_len;
    if (!local && !secret && !is_loopback(&ss) && !nb__store_trusted_network()) {
        char addr[INET6_ADDRSTRLEN];
        describe(&ss, addr, sizeof addr);
        close(fd);
        return nb_set_error(NB_ERR_INVALID,
                            "nb_store_server_start: the store would listen on %s:%d, beyond this "
                            "host, without a secret: anyone who can reach the port could join the "
                            "run, change its keys or stop it. Give every process the run's secret "
                            "(NABLA_STORE_SECRET_FILE, a file only you can read, the same on every "
                            "node), or set NABLA_STORE_TRUSTED_NETWORK=1 if only trusted machines "
                            "can reach this network (docs/distributed.md, \"Security\")",
                            addr, bound);
    }
    if (!local && !secret && !is_loopback(&ss)) {
        char addr[INET6_ADDRSTRLEN];
        fprintf(stderr,
                "nabla: the store listens on %s:%d without a secret (NABLA_STORE_TRUSTED_NETWORK=1): any "
                "host that can reach this port can join the run, read its keys or stop it; to refuse "
                "them, give every process the same secret (NABLA_STORE_SECRET_FILE, a file only you can "
                "read; nbrun cannot draw one for several nodes, having no private way to hand it to the "
                "other nodes; docs/distributed.md, \"Security\")\n",
                describe(&ss, addr, sizeof addr), bound);
    }
    nb_store_server *s = server_new(cfg);
    s->listen_fd = fd;
    s->port = bound;
    s->local = local;
    if (local) {
        const struct sockaddr_un *u = (const struct sockaddr_un *)&ss;
        snprintf(s->path, sizeof s->path, "%.*s", (int)sizeof u->sun_path, u->sun_path);
        struct stat st;
        if (s->path[0] && stat(s->path, &st) == 0) {
            s->path_dev = st.st_dev;
            s->path_ino = st.st_ino;
        }
        snprintf(s->where, sizeof s->where, "%s", s->path[0] ? s->path : "(a Unix-domain socket)");
        s->touch_at = nb__now() + TOUCH_S;
    } else {
        snprintf(s->where, sizeof s->where, "port %d", bound);
    }
    set_nonblocking(fd);
    s->rbuf = malloc(RECV_CHUNK);
    NB_CHECK(s->rbuf != NULL, "nb_store_server_start: out of memory");
    if (pipe(s->wake) != 0) {
        int err = errno;
        s->wake[0] = s->wake[1] = -1;
        server_free(s);
        return nb_set_error(NB_ERR_IO, "nb_store_server_start: pipe: %s", strerror(err));
    }
    if (pthread_create(&s->thread, NULL, serve, s) != 0) {
        server_free(s);
        return nb_set_error(NB_ERR_INTERNAL, "nb_store_server_start: cannot start the server thread");
    }
    s->threaded = true;
    *out = s;
    return NB_OK;
}

nb_status nb_store_server_start(nb_store_server **out, const char *host, int port,
                                const char *run_id) {
    nb__store_config cfg = {.run_id = run_id};
    return nb__store_server_start(out, host, port, -1, &cfg);
}

int nb_store_server_port(const nb_store_server *server) { return server->port; }

void nb_store_server_stop(nb_store_server *s) {
    if (!s) return;
    if (s->threaded) {
        atomic_store(&s->stop, true);
        ssize_t w = write(s->wake[1], "x", 1);
        (void)w;
        pthread_join(s->thread, NULL);
    }
    server_free(s);
}

/* ---- the server without sockets (the fuzzer's) ---- */

nb_status nb__store_core_new(nb_store_server **out, const nb__store_config *cfg) {
    *out = server_new(cfg);
    return NB_OK;
}

void nb__store_core_free(nb_store_server *s) {
    if (s) server_free(s);
}

nb__store_conn *nb__store_core_accept(nb_store_server *s, double now) {
    if (pending_count(s) >= s->max_pending) return NULL;
    return add_conn(s, -1, now);
}

bool nb__store_core_input(nb_store_server *s, nb__store_conn *c, const uint8_t *p, size_t n,
                          double now) {
    return feed(s, c, p, n, now);
}

nb__buf *nb__store_core_output(nb__store_conn *c) { return &c->out; }
void nb__store_core_drop(nb_store_server *s, nb__store_conn *c) { drop(s, c); }

void nb__store_core_tick(nb_store_server *s, double now) {
    resolve_waits(s, now);
    auth_deadlines(s, now);
}

bool nb__store_core_closing(const nb__store_conn *c) { return c->closing; }
bool nb__store_core_authenticated(const nb__store_conn *c) { return c->state == C_READY; }
int nb__store_core_rank(const nb__store_conn *c) { return c->rank; }
bool nb__store_core_said_bye(const nb__store_conn *c) { return c->bye; }
int nb__store_core_pending(const nb_store_server *s) { return pending_count(s); }
size_t nb__store_core_in_buffered(const nb__store_conn *c) { return c->in.n; }
const char *nb__store_core_abort_reason(const nb_store_server *s) {
    return s->aborted ? s->abort_reason : NULL;
}
const nb__kv *nb__store_core_kv(const nb_store_server *s) { return s->kv; }
