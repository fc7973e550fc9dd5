/* Internal interface of distributed/: the store's wire format and
 * table, the description of one collective, and the backends' entry
 * points. Not installed. Also compiled as C++ by the Gloo shim and by the
 * fuzzer, so it holds declarations only. */
#ifndef NABLA_DISTRIBUTED_INTERNAL_H
#define NABLA_DISTRIBUTED_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/dist.h"
#include "tensor/cuda/cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

double nb__now(void); /* monotonic seconds */
/* A listening TCP socket on host:port (host NULL: every IPv4 address; port
 * 0: a free one), close-on-exec, SO_REUSEADDR. -1 on failure, with the
 * getaddrinfo code in *gai_err or the errno in *sys_err. */
int nb__tcp_listen(const char *host, int port, int *gai_err, int *sys_err);
/* cpu_bind.c (Note [CPU binding]): a CPU this process may run on, with
 * the package and core it belongs to. */
typedef struct nb__cpu_slot {
    int cpu, package, core;
} nb__cpu_slot;
/* The CPUs local rank `local_rank` of `nlocal` gets out of the n in
 * `slots` (any order), written to `out` (room for n) in ascending order of
 * (package, core, CPU); their count, 0 for bad arguments. */
int nb__cpu_share(const nb__cpu_slot *slots, int n, int nlocal, int local_rank, int *out);
/* The CPUs of this process's affinity mask, at most `max`, with their
 * package and core from sysfs (each its own core when unknown); their count. */
int nb__cpu_usable(nb__cpu_slot *slots, int max);
NB_PLUGIN_API void nb__sleep(double seconds);
/* env.c: NABLA_LIVENESS_TIMEOUT or its default: how long a live peer or
 * store may stay silent (Note [Liveness and progress] in heartbeat.c). */
double nb__liveness_s(void);
/* env.c: the three limits of that Note (NABLA_LIVENESS_TIMEOUT,
 * NABLA_JOIN_TIMEOUT, NABLA_STALL_WARNING), or NB_ERR_INVALID naming a
 * variable that is not a number of seconds. */
nb_status nb__liveness_options(double *liveness, double *join, double *stall);
/* Which collectives exchange headers before their data (Note [Which
 * collectives are checked] in pg_check.c), from NABLA_DIST_CHECK: auto (unset), full or
 * off; another value is NB_ERR_INVALID naming it. */
typedef enum { NB__CHECK_AUTO = 0, NB__CHECK_FULL, NB__CHECK_OFF } nb__dist_check;
nb_status nb__dist_check_option(nb__dist_check *out);
/* The GPU index of a process from its local rank and the number of GPUs it
 * sees (Note [One GPU per process] in env.c); cvd only names the variable in
 * the error. */
nb_status nb__dist_pick_gpu(int local_rank, int visible, const char *cvd, int *index);

/* Marks the group broken with `msg` (the first failure wins; later
 * collectives fail with it) and wakes its waiters (pg.c). */
void nb__pg_break(nb_pg *pg, nb_status st, const char *msg);
/* Note [Failures inside a forward] (sync_batch_norm.c): a collective that
 * failed where no status can be returned is noted for the calling thread;
 * nb_ddp_forward / nb_ddp_backward clear the note before running the
 * module and take it after (NB_OK, or the status with the message set in
 * nb_last_error()). The first note since the clear is kept. */
void nb__dist_failure_clear(void);
void nb__dist_failure_note(nb_status st, const char *msg);
nb_status nb__dist_failure_take(void);

/* A SyncBatchNorm all-reduce of t (sum) on pg is about to be issued: the
 * DDP wrapper in join mode on this thread records it, so that ranks that
 * have joined can issue a matching one (Note [Join] in ddp_join.c). */
void nb__ddp_join_note(nb_pg *pg, const nb_tensor *t);
/* ddp_zero.c: the norm of a gradient each rank holds slices of (ZeRO's
 * shards of the buckets, FSDP's of the units): this rank's slices
 * gl[0..k) in sc, norm_type 2 or inf, all-reduced on pg (NULL: the slices
 * are the whole gradient); each slice scaled as nb_clip_grad_norm scales.
 * The norm in *norm (NaN when any element is). */
nb_status nb__shard_clip_grad_norm(nb_pg *pg, nb_ctx *sc, int k, nb_tensor **gl, double max_norm,
                                   double norm_type, double *norm);

/* ------------------------------------------------ store wire format */

enum nb__store_op {
    NB__OP_HELLO = 1,
    NB__OP_SET,
    NB__OP_SET_QUIET, /* like SET, no reply */
    NB__OP_GET,
    NB__OP_WAIT,
    NB__OP_ADD,
    NB__OP_CAS,
    NB__OP_DELETE,
    NB__OP_MGET,      /* several keys, never waits */
    NB__OP_BYE,
    NB__OP_AUTH       /* bytes mac: the answer to a CHALLENGE */
};

enum nb__store_reply {
    NB__R_OK = 0,
    NB__R_VALUE,      /* bytes */
    NB__R_INT,        /* i64 */
    NB__R_VALUES,     /* u32 n, then n x (u8 present, bytes) */
    NB__R_NOT_FOUND,
    NB__R_TIMEOUT,    /* bytes: which keys were missing */
    NB__R_ABORTED,    /* bytes: why the run was aborted */
    NB__R_ERROR,      /* bytes: message */
    NB__R_CHALLENGE   /* bytes: the server's nonce (HELLO to a store with a secret) */
};

#define NB__STORE_MAGIC 0x3253424eu /* "NBS2" little-endian */
/* Note [Store authentication] in store_server.c. */
#define NB__STORE_NONCE_LEN 32
#define NB__STORE_MAC_LEN 32               /* HMAC-SHA256 */
#define NB__STORE_SECRET_MIN 16
#define NB__STORE_SECRET_MAX 1024
#define NB__STORE_PREAUTH_MAX_FRAME 512    /* bytes in a frame before authentication */
#define NB__STORE_AUTH_TIMEOUT_S 3.0       /* from accept to authenticated */
/* Note [Admission under a flood] in store_server.c */
#define NB__STORE_MAX_PENDING 256          /* connections accepted, not yet authenticated */
#define NB__STORE_SOURCE_QUOTA 64          /* of them from one source address */
#define NB__STORE_SUMMARY_S 10.0           /* the closed-unproven line on stderr, at most this often */
#define NB__STORE_SUMMARY_SOURCES 8        /* sources it names */
#define NB__STORE_DROPPED "dropped to make room" /* how an evicted connection's refusal begins */
#define NB__STORE_MAX_BYTES ((size_t)1 << 30) /* keys and values the table holds */
/* The key the server sets when a rank's connection drops. */
#define NB__STORE_ABORT_KEY "nb/abort"

typedef struct nb__bytes {
    const uint8_t *p;
    uint32_t n;
} nb__bytes;

/* A parsed request; byte fields point into the frame. */
typedef struct nb__store_req {
    int op;
    nb__bytes key, value, expected, run_id;
    bool has_expected;
    int64_t num;        /* ADD: delta; GET/WAIT: timeout in ms; HELLO: rank */
    uint32_t magic;     /* HELLO */
    nb__bytes nonce;    /* HELLO: the client's nonce */
    nb__bytes mac;      /* AUTH */
    uint32_t nkeys;     /* WAIT, MGET */
    nb__bytes keys[NB_STORE_MAX_KEYS];
} nb__store_req;

/* A growable byte buffer for building messages. */
typedef struct nb__buf {
    uint8_t *p;
    size_t n, cap;
} nb__buf;

void nb__buf_free(nb__buf *b);
void nb__buf_u8(nb__buf *b, uint8_t v);
void nb__buf_u32(nb__buf *b, uint32_t v);
void nb__buf_i64(nb__buf *b, int64_t v);
void nb__buf_bytes(nb__buf *b, const void *p, size_t n);
/* Starts a frame (reserves its length; returns where it starts) / fills
 * in its length. */
size_t nb__buf_frame_begin(nb__buf *b);
void nb__buf_frame_end(nb__buf *b, size_t start);

/* Length of the frame body announced by the 4 bytes at `p`. */
uint32_t nb__store_frame_len(const uint8_t *p);
/* Parses one frame body. NB_ERR_FORMAT with a reason in `why` (>= 128
 * bytes) for anything malformed: unknown op, truncated or oversized
 * field, trailing bytes, too many keys. */
nb_status nb__store_parse_request(const uint8_t *body, size_t len, nb__store_req *req, char *why,
                                  size_t why_len);

/* A reader over a reply body (client side). */
typedef struct nb__reader {
    const uint8_t *p;
    size_t n, off;
    bool bad;
} nb__reader;
uint8_t nb__rd_u8(nb__reader *r);
uint32_t nb__rd_u32(nb__reader *r);
int64_t nb__rd_i64(nb__reader *r);
nb__bytes nb__rd_bytes(nb__reader *r);

/* ------------------------------------------------ store table */

/* The key-value table and the execution of requests that never wait;
 * store_kv.c. Shared by the server and the fuzzer. */
typedef struct nb__kv nb__kv;
/* `max_bytes` bounds the keys and values held (0: NB__STORE_MAX_BYTES); a
 * write that would pass it is refused with an error naming the key. */
nb__kv *nb__kv_new(size_t max_bytes);
void nb__kv_free(nb__kv *kv);
/* NULL when absent. */
const nb__bytes *nb__kv_find(const nb__kv *kv, const uint8_t *key, uint32_t klen);
void nb__kv_set(nb__kv *kv, const uint8_t *key, uint32_t klen, const uint8_t *val, uint32_t vlen);
bool nb__kv_delete(nb__kv *kv, const uint8_t *key, uint32_t klen);
size_t nb__kv_bytes(const nb__kv *kv); /* keys and values held */
/* Executes SET, ADD, CAS, DELETE, MGET, and GET/WAIT when their keys are
 * present, appending the reply frame to `out`. Returns false when the
 * request must wait (GET/WAIT with a key missing; nothing appended). */
bool nb__kv_apply(nb__kv *kv, const nb__store_req *req, nb__buf *out);
/* Appends a reply frame with a status and an optional text. */
void nb__store_reply_text(nb__buf *out, int status, const char *text);

/* Client extras: a SET without a reply (fingerprints, off the critical
 * path); a non-blocking get of several keys (values[i] malloc'd or NULL);
 * where the connection goes. */
nb_status nb__store_set_quiet(nb_store *s, const char *key, const void *value, size_t len);
nb_status nb__store_mget(nb_store *s, const char *const *keys, int n, char **values);
const char *nb__store_host(const nb_store *s);
/* The Unix-domain socket a store client talks to; "" over TCP. */
const char *nb__store_path(const nb_store *s);
/* Changes the default timeout of the connection's blocking calls. */
void nb__store_set_timeout(nb_store *s, double timeout_s);
int nb__store_port(const nb_store *s);

/* ------------------------------------------------ store access (store_auth.c) */

/* The run's secret and where it came from (Note [Store authentication]). */
typedef struct nb__store_secret {
    uint8_t bytes[NB__STORE_SECRET_MAX];
    size_t len;       /* 0: none */
    char source[300]; /* "NABLA_STORE_SECRET_FILE=/path", for messages */
} nb__store_secret;

/* Reads the secret from NABLA_STORE_SECRET_FD (nbrun's descriptor, read
 * once: the variable is then removed and the descriptor closed, the value
 * kept for later calls), else NABLA_STORE_SECRET_FILE (a file no other
 * user may read), else NABLA_STORE_SECRET. None set: NB_OK with len 0. */
nb_status nb__store_secret_from_env(nb__store_secret *out);
/* NABLA_STORE_TRUSTED_NETWORK=1: a store without a secret may listen
 * beyond loopback. */
bool nb__store_trusted_network(void);
/* HMAC-SHA256 under `secret` of: label, both nonces, the run id and rank. */
void nb__store_mac(const uint8_t *secret, size_t secret_len, const char *label,
                   const uint8_t *client_nonce, const uint8_t *server_nonce, const char *run_id,
                   int64_t rank, uint8_t out[NB__STORE_MAC_LEN]);
bool nb__store_mac_equal(const uint8_t *a, const uint8_t *b); /* constant time */
void nb__store_random(uint8_t *p, size_t n);
/* Wipes secret bytes (not optimized away). */
void nb__store_wipe(void *p, size_t n);

/* Note [Store on one node] (store_unix.c). The transport a world uses:
 * Unix-domain on one node unless NABLA_STORE_TRANSPORT=tcp. */
nb_status nb__store_transport_unix(bool one_node, bool *use_unix);
/* <NABLA_STORE_DIR or /tmp/nabla-<uid>>/store-<port>.sock, the folder made
 * (0700) when missing and refused unless it is this user's, closed to others. */
nb_status nb__store_unix_path(int port, char *path, size_t len);
/* Listens on path, removing a stale socket file; -1 with *sys_err set
 * (EADDRINUSE: a live store of this user serves there). */
int nb__store_unix_listen(const char *path, int *sys_err);
/* Connects to path within timeout_s; -1 with errno set (EPERM: the socket is
 * not served by this user). */
int nb__store_unix_connect(const char *path, double timeout_s);
/* The kernel's word on who is at the other end of a Unix-domain socket. */
bool nb__store_peer_uid(int fd, unsigned *uid, int *pid);

/* Who may use a store, and its limits. */
typedef struct nb__store_config {
    const char *run_id;       /* NULL: "default" */
    const uint8_t *secret;    /* NULL or secret_len 0: none */
    size_t secret_len;
    int world_size;           /* server: HELLO ranks in [0, world_size); 0: any rank */
    const char *unix_path;    /* non-NULL: the store's Unix-domain socket (Note [Store on one
                               * node] in store_unix.c), instead of host:port */
    /* Server limits; 0: the NB__STORE_* defaults. */
    double auth_timeout_s;
    int max_pending;
    size_t max_bytes;
} nb__store_config;

/* Serves on host:port, on cfg->unix_path, or on listen_fd when it is >= 0
 * (nbrun passes one, NABLA_STORE_FD; TCP or Unix-domain). Without a secret
 * a TCP socket must be on loopback unless NABLA_STORE_TRUSTED_NETWORK=1. */
nb_status nb__store_server_start(nb_store_server **out, const char *host, int port, int listen_fd,
                                 const nb__store_config *cfg);
nb_status nb__store_connect(nb_store **out, const char *host, int port, const nb__store_config *cfg,
                            int rank, double timeout_s);
/* Another connection to the store `like` talks to, with its run id and secret. */
nb_status nb__store_connect_like(nb_store **out, const nb_store *like, int rank, double timeout_s);

/* A HELLO the server refused because it named another run id: the id
 * (cut to NB__STORE_REFUSED_ID_LEN - 1 bytes, bytes outside printable
 * ASCII as '?'), the rank it claimed and the peer's address ("?" when
 * unknown). Rank 0's join names them (Note [Joining] in heartbeat.c). */
#define NB__STORE_REFUSED_ID_LEN 48
#define NB__STORE_REFUSALS_KEPT 8
typedef struct nb__store_refusal {
    int64_t rank;
    char run_id[NB__STORE_REFUSED_ID_LEN];
    char peer[80];
} nb__store_refusal;
/* Copies the refusals numbered *seen and on (the server keeps the last
 * NB__STORE_REFUSALS_KEPT; older ones are skipped), at most max, and
 * advances *seen past them; returns how many. Thread-safe. */
int nb__store_server_refusals(nb_store_server *s, uint64_t *seen, nb__store_refusal *out, int max);
/* How many connections the server refused, ever, for a rank beyond its
 * world (told the world's ranks). Thread-safe. */
uint64_t nb__store_server_beyond(nb_store_server *s);
/* How many sets of a key under NB__STORE_FP_PREFIX (the flight recorder's
 * publications, Note [Hang diagnostics] in pg_diag.c) the server has
 * handled, ever. Thread-safe. */
#define NB__STORE_FP_PREFIX "nb/fp/"
uint64_t nb__store_server_fp_writes(nb_store_server *s);
/* "N connections that never proved they belong to the run (up to M at
 * once; lately from 127.0.0.1 (480))" into out, and 1; 0 and "" when
 * there were none. Thread-safe. */
int nb__store_server_unproven(nb_store_server *s, char *out, size_t len);
/* seen[r] for r below n and the world size: a connection was ever admitted
 * as rank r. Returns how many it filled (0 without a world size). */
int nb__store_server_ranks_seen(nb_store_server *s, bool *seen, int n);

/* The server without sockets or thread, for the fuzzer: connections are
 * handles fed with bytes; what the server answers piles up in their output
 * buffer. `now` is the caller's clock (seconds). */
typedef struct nb__store_conn nb__store_conn;
nb_status nb__store_core_new(nb_store_server **out, const nb__store_config *cfg);
void nb__store_core_free(nb_store_server *s);
/* NULL when NB__STORE_MAX_PENDING connections are already pending. */
nb__store_conn *nb__store_core_accept(nb_store_server *s, double now);
/* Feeds received bytes; false: the server closes the connection (drop it). */
bool nb__store_core_input(nb_store_server *s, nb__store_conn *c, const uint8_t *p, size_t n,
                          double now);
nb__buf *nb__store_core_output(nb__store_conn *c);
/* The peer hung up or the server closed it: the connection is freed. */
void nb__store_core_drop(nb_store_server *s, nb__store_conn *c);
/* Deadlines: parked waits that expired are answered, pending connections
 * past the authentication deadline are marked closing. */
void nb__store_core_tick(nb_store_server *s, double now);
bool nb__store_core_closing(const nb__store_conn *c); /* to be dropped once flushed */
bool nb__store_core_authenticated(const nb__store_conn *c);
int nb__store_core_rank(const nb__store_conn *c);     /* -1: anonymous or not admitted */
bool nb__store_core_said_bye(const nb__store_conn *c);
int nb__store_core_pending(const nb_store_server *s);
size_t nb__store_core_in_buffered(const nb__store_conn *c);
const char *nb__store_core_abort_reason(const nb_store_server *s); /* NULL: not aborted */
const nb__kv *nb__store_core_kv(const nb_store_server *s);

/* ------------------------------------------------ collectives */

typedef enum nb__coll_kind {
    NB__ALL_REDUCE = 0,
    NB__BROADCAST,
    NB__ALL_GATHER,
    NB__REDUCE_SCATTER,
    NB__BARRIER
} nb__coll_kind;

/* One collective as issued. `count` is elements per rank: the tensor's
 * for all-reduce and broadcast, the input's for all-gather, the output's
 * for reduce-scatter. */
typedef struct nb__coll {
    nb__coll_kind kind;
    nb_reduce_op op;
    nb_dtype dtype;
    int64_t count;
    int root;
    void *out;
    const void *in;   /* all-gather, reduce-scatter */
    uint64_t seq;
} nb__coll;

const char *nb__coll_name(nb__coll_kind kind);   /* "all_reduce" */
const char *nb__reduce_name(nb_reduce_op op);    /* "sum" */
/* "all_reduce(sum, f32, count=1000)": the fingerprint ranks compare. */
void nb__coll_fingerprint(const nb__coll *c, char *buf, size_t len);

/* The header ranks exchange before a collective's data (Note [Collective
 * headers] in pg_check.c): kind, reduction, dtype, count, root, with the
 * fields that do not apply to the kind zeroed, so that two headers are
 * equal exactly when the collectives match. nb__coll_from_header refuses
 * a header that nabla did not write (false). */
#define NB__COLL_HEADER_WORDS 6
void nb__coll_header(const nb__coll *c, int64_t h[NB__COLL_HEADER_WORDS]);
/* Does collective c (c->seq numbered) exchange headers first? Under
 * NB__CHECK_AUTO: always where the backend's exchange costs one message
 * (`cheap`: Gloo); else (NCCL, where it stalls the host) every broadcast
 * and the first NB__CHECK_FIRST collectives of the group. Depends on
 * nothing that a mismatch could make differ between ranks except the
 * kind (Note [Which collectives are checked] in pg_check.c). */
#define NB__CHECK_FIRST 16
bool nb__coll_header_wanted(nb__dist_check mode, bool cheap, const nb__coll *c);
bool nb__coll_from_header(const int64_t h[NB__COLL_HEADER_WORDS], nb__coll *c);

/* Elementwise reduction of n elements: acc = acc op x; 16-bit floats
 * through f32. Used by the Gloo shim (as its reduce function) and for
 * local work. */
void nb__reduce_into(nb_dtype dtype, nb_reduce_op op, void *acc, const void *x, size_t n);
/* Divides n elements by `d` (the avg of an all-reduce). */
void nb__scale_down(nb_dtype dtype, void *x, size_t n, double d);

/* ------------------------------------------------ Gloo shim (gloo_shim.cpp) */

typedef struct nb__gloo_dev nb__gloo_dev;
typedef struct nb__gloo nb__gloo;

/* A TCP device on `hostname` (an address of this host the others can
 * reach) or, when `iface` is non-empty, on that interface. */
nb_status nb__gloo_dev_new(nb__gloo_dev **out, const char *hostname, const char *iface);
void nb__gloo_dev_free(nb__gloo_dev *dev);
/* Connects the full mesh of `size` ranks through `store` under `prefix`.
 * timeout_s bounds each collective; connect_s the set-up: the wait for
 * the others' addresses in the store (every rank has joined already, so
 * one that does not publish its address failed) and the TCP connections
 * to them (an unreachable address: a wrong interface, a firewall).
 * `blocking`: a context whose connections the calling thread reads and
 * writes itself, for nb__gloo_exchange only (Note [Blocking exchanges]
 * in gloo_shim.cpp); its set-up is bounded by timeout_s, as every read
 * on it is. */
nb_status nb__gloo_connect(nb__gloo **out, nb__gloo_dev *dev, nb_store *store, const char *prefix,
                           int rank, int size, double timeout_s, double connect_s, bool blocking);
void nb__gloo_free(nb__gloo *g);
/* Runs one collective to completion (blocking); the error names what the
 * transport said. */
nb_status nb__gloo_run(nb__gloo *g, const nb__coll *c);
/* On a blocking context: this rank's `sent` bytes at `mine` to every
 * other rank, and every other rank's into `all` (size x n bytes, rank r's
 * at r x n; a rank may send fewer than n bytes, never more); `own`: also
 * copies mine into this rank's place. Returns once everything has arrived
 * and left. Messages over 256 KiB go in pieces, whose number every rank
 * derives from its own `sent`: exchanges whose sizes differ between
 * ranks must stay within one piece (Note [Blocking exchanges]); `sized`
 * first compares every rank's `sent` and fails on all ranks when they
 * differ. */
nb_status nb__gloo_exchange(nb__gloo *g, const void *mine, size_t sent, void *all, size_t n, bool own,
                            bool sized);
/* On a blocking context: the all-reduce c as a ring (Note [Ring on
 * blocking connections] in gloo_shim.cpp), for three ranks and more. */
nb_status nb__gloo_ring_all_reduce(nb__gloo *g, const nb__coll *c);

/* ------------------------------------------------ NCCL (pg_nccl.c) */

typedef struct nb__nccl nb__nccl;
typedef struct nb__nccl_work nb__nccl_work;
/* Also allocates 16 bytes of device memory for nb_pg_agree (*agree_buf,
 * freed with the communicator). */
nb_status nb__nccl_init(nb__nccl **out, nb_store *store, const char *prefix, int rank, int size,
                        int device, void **agree_buf);
void nb__nccl_free(nb__nccl *n);
/* Enqueues on the communication stream after the compute stream's work
 * (Note [NCCL streams] in pg_nccl.c). */
nb_status nb__nccl_launch(nb__nccl *n, const nb__coll *c, nb__nccl_work **work);
/* 1 done, 0 running, or a failure status. */
int nb__nccl_query(nb__nccl *n, nb__nccl_work *work);
/* Makes the compute stream wait for the work's completion, so that later
 * kernels see its result (never blocks the host). */
nb_status nb__nccl_work_order(nb__nccl_work *work);
void nb__nccl_work_free(nb__nccl_work *work);
/* The check layer's exchange (xpost/xtest in distributed/pg.h) of at
 * most NB__COLL_HEADER_WORDS words per rank, on the communication stream
 * after the group's earlier collectives and before the next: `start`
 * enqueues it for this rank's `n` bytes `mine`; then 1 when `all` holds
 * every rank's, 0 not yet, or a failure status. One at a time. */
int nb__nccl_exchange(nb__nccl *n, const void *mine, void *all, size_t bytes, bool start);
/* Aborts the communicator (kills its kernels) after a failure. */
void nb__nccl_abort(nb__nccl *n);

#ifdef __cplusplus
}
#endif
#endif
