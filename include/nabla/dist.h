/* Distribution: the launch environment, the TCP key-value store, and
 * process groups with asynchronous collectives over Gloo (CPU tensors) or
 * NCCL (CUDA tensors). docs/distributed.md is the user's guide; Note
 * [Hang diagnostics] in distributed/pg.c says how a stuck collective is
 * turned into an error that names the ranks.
 *
 * Two tiers of errors, as everywhere: wrong arguments (a non-contiguous
 * tensor, a root out of range, a shape that does not match the group size)
 * abort through nb_abort; what other processes or the network do (a rank
 * that never arrives, a dead peer, a store that is gone) comes back as an
 * nb_status with the story in nb_last_error(). */
#ifndef NABLA_DIST_H
#define NABLA_DIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/dtype.h"
#include "nabla/error.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ environment */

/* Where this process sits in the run. Read from the environment by
 * nb_dist_env_read: torchrun's names (RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) first, then OpenMPI's
 * OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}, then Slurm's
 * SLURM_{PROCID,NTASKS,LOCALID} (and SLURM_TASKS_PER_NODE, SLURM_NODEID);
 * MPI and Slurm launches take MASTER_ADDR and MASTER_PORT from the
 * environment too. With none of them set the process is a world of one. */
typedef struct nb_dist_env {
    int rank, world_size;
    int local_rank, local_world_size;
    char master_addr[256];
    int master_port;     /* 0 only for a world of one */
    /* Where rank 0 serves nabla's store: $NABLA_STORE_PORT, else
     * MASTER_PORT + 1 under torchrun (whose own store holds MASTER_PORT,
     * TORCHELASTIC_USE_AGENT_STORE=True), else MASTER_PORT. */
    int store_port;
    char run_id[128];    /* NABLA_RUN_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID[.SLURM_STEP_ID], or "default" */
    const char *source;  /* "torchrun", "OpenMPI", "Slurm" or "none" */
} nb_dist_env;

/* Fills `env`; a missing, malformed or inconsistent variable is
 * NB_ERR_INVALID with a message naming it. */
NB_API nb_status nb_dist_env_read(nb_dist_env *env);

/* The device a process of `env` computes on: with the CUDA backend and a
 * visible GPU, cuda:LOCAL_RANK, made the current device (call it before
 * anything touches a GPU; nb_pg_init does); otherwise the CPU. */
NB_API nb_status nb_dist_select_device(const nb_dist_env *env, bool want_gpu, nb_device *device);

/* ------------------------------------------------------------------ store */

/* A small TCP key-value store served by rank 0; see Note [Store protocol]
 * in distributed/store_proto.c. Values are bytes. A client is one
 * connection and is not thread-safe: give each thread its own. */
typedef struct nb_store nb_store;
typedef struct nb_store_server nb_store_server;

#define NB_STORE_MAX_KEY 4096              /* bytes in a key */
#define NB_STORE_MAX_VALUE (16u << 20)     /* bytes in a value */
#define NB_STORE_MAX_KEYS 1024             /* keys in one wait */
/* Every message fits in this; a longer one closes its connection. */
#define NB_STORE_MAX_MESSAGE (NB_STORE_MAX_VALUE + 2 * NB_STORE_MAX_KEY + 64)

/* Serves the store of run `run_id` on `host` and `port` (0: a free port;
 * see nb_store_server_port) from a background thread. This store has no
 * secret, so `host` must be a loopback address unless
 * NABLA_STORE_TRUSTED_NETWORK=1 ("0.0.0.0" or NULL: every interface);
 * otherwise NB_ERR_INVALID (docs/distributed.md, "Security"). nb_pg_init
 * serves the run's store with its secret. */
NB_API nb_status nb_store_server_start(nb_store_server **out, const char *host, int port,
                                const char *run_id);
NB_API int nb_store_server_port(const nb_store_server *server);
NB_API void nb_store_server_stop(nb_store_server *server); /* NULL is fine */

/* Connects to the store at host:port, retrying until `timeout_s`, which is
 * also the default timeout of the blocking calls. `run_id` must be the
 * server's: a process left over from another run is refused
 * (NB_ERR_MISMATCH). With `rank` >= 0 the connection speaks for that rank:
 * one per rank, and if it drops without nb_store_close (the process died)
 * the server marks the run aborted, and every wait, on every rank, fails
 * at once with NB_ERR_CLOSED naming the rank. -1: an anonymous client. */
NB_API nb_status nb_store_connect(nb_store **out, const char *host, int port, const char *run_id,
                           int rank, double timeout_s);
/* Says goodbye and closes; NULL is fine. */
NB_API void nb_store_close(nb_store *store);

NB_API nb_status nb_store_set(nb_store *store, const char *key, const void *value, size_t len);
/* Waits until `key` exists, at most `timeout_s` (< 0: the connection's
 * default; 0: no wait, NB_ERR_NOT_FOUND if absent; else NB_ERR_TIMEOUT).
 * *value is malloc'd (NUL-terminated for convenience; free() it). */
NB_API nb_status nb_store_get(nb_store *store, const char *key, double timeout_s, void **value,
                       size_t *len);
/* Waits until all `n` keys exist; NB_ERR_TIMEOUT names the missing ones. */
NB_API nb_status nb_store_wait(nb_store *store, const char *const *keys, int n, double timeout_s);
/* Adds `delta` to the integer at `key` (absent: 0) and returns the sum. */
NB_API nb_status nb_store_add(nb_store *store, const char *key, int64_t delta, int64_t *result);
/* Sets `key` to `desired` if it holds `expected` (NULL `expected`: if it is
 * absent). *current (malloc'd, may be NULL if not wanted) receives what the
 * key holds afterwards: `desired` when the swap happened. */
NB_API nb_status nb_store_compare_set(nb_store *store, const char *key, const void *expected,
                               size_t expected_len, const void *desired, size_t desired_len,
                               void **current, size_t *current_len);
/* Removes `key`; *existed (may be NULL) says whether it was there. */
NB_API nb_status nb_store_delete(nb_store *store, const char *key, bool *existed);

/* ---------------------------------------------------------- process groups */

typedef struct nb_pg nb_pg;
typedef struct nb_work nb_work;

typedef enum nb_pg_backend {
    NB_PG_AUTO = 0, /* NCCL when built with CUDA and a GPU is visible, else Gloo */
    NB_PG_GLOO,     /* CPU tensors */
    NB_PG_NCCL      /* CUDA tensors */
} nb_pg_backend;

typedef enum nb_reduce_op {
    NB_REDUCE_SUM = 0,
    NB_REDUCE_AVG, /* floating dtypes only */
    NB_REDUCE_MIN,
    NB_REDUCE_MAX
} nb_reduce_op;

typedef struct nb_pg_options {
    nb_pg_backend backend;
    /* A collective that has not completed this long after it started fails
     * with a diagnosis. 0: $NABLA_PG_TIMEOUT (seconds) or 1800. */
    double timeout_s;
} nb_pg_options;

/* The world group of the run described by the environment (or by `env`):
 * picks the device from the local rank, starts the store on rank 0,
 * connects every rank, and sets up the backend. `opts` may be NULL. */
NB_API nb_status nb_pg_init(nb_pg **out, const nb_pg_options *opts);
NB_API nb_status nb_pg_init_env(nb_pg **out, const nb_dist_env *env, const nb_pg_options *opts);

/* A subgroup of `pg` made of the `n` (distinct) ranks of `ranks`, in that
 * order: ranks[i] has rank i in the new group. Every rank of `pg` calls it
 * with the same list; members get the group, the others get NULL. */
NB_API nb_status nb_pg_new_group(nb_pg *pg, const int *ranks, int n, nb_pg **out);

/* Waits for this group's outstanding collectives, stops its worker and
 * frees it; subgroups must be freed before their parent. Freeing the world
 * group shuts the run down: rank 0 keeps the store up until every rank has
 * freed its world group. The status says whether that went cleanly (after
 * a failure it repeats the failure); the group is freed either way. */
NB_API nb_status nb_pg_free(nb_pg *pg);
/* NB_OK while the group works; once one of its collectives has failed (a
 * peer died or froze, a timeout, a desync), that failure's status, with
 * its message (naming the peer) in nb_last_error(). Every later collective
 * fails with the same. For code that cannot return a status where the
 * failure happened: SyncBatchNorm outside DDP (docs/ddp.md). */
NB_API nb_status nb_pg_status(nb_pg *pg);

NB_API int nb_pg_rank(const nb_pg *pg);
NB_API int nb_pg_size(const nb_pg *pg);
NB_API int nb_pg_global_rank(const nb_pg *pg, int group_rank); /* world rank of a member */
NB_API nb_pg_backend nb_pg_backend_of(const nb_pg *pg);
NB_API const char *nb_pg_backend_name(nb_pg_backend backend); /* "gloo", "nccl", "auto" */
NB_API nb_device nb_pg_device(const nb_pg *pg);
NB_API const nb_dist_env *nb_pg_env(const nb_pg *pg);
/* The store connection of the calling (main) thread, for the program's own
 * keys; keys starting with "nb/" are nabla's. */
NB_API nb_store *nb_pg_store(nb_pg *pg);

/* Collectives. Every rank of the group issues the same collectives in the
 * same order. Tensors are contiguous, on the group's device, of dtype f32,
 * f64, bf16, f16, i32 or i64, and stay alive and untouched until the work
 * is done; any element count, zero included. Each call returns at once
 * with a work handle (never NULL); failures show in nb_work_wait. Gloo runs
 * the group's collectives one after another on a background thread, in
 * issue order; NCCL enqueues them on the group's communication stream. */

/* In place: t = op over ranks of t. bf16 and f16 travel as 16-bit values
 * and each reduction step computes in f32 (docs/distributed.md). */
NB_API nb_work *nb_pg_all_reduce(nb_pg *pg, nb_tensor *t, nb_reduce_op op);
/* In place: every rank gets `root`'s t. */
NB_API nb_work *nb_pg_broadcast(nb_pg *pg, nb_tensor *t, int root);
/* out (size * numel(in) elements) = the ranks' `in`, concatenated in rank order. */
NB_API nb_work *nb_pg_all_gather(nb_pg *pg, nb_tensor *out, const nb_tensor *in);
/* out (numel(in) / size elements) = rank r's slice of op over ranks of `in`. */
NB_API nb_work *nb_pg_reduce_scatter(nb_pg *pg, nb_tensor *out, const nb_tensor *in,
                                     nb_reduce_op op);
NB_API nb_work *nb_pg_barrier(nb_pg *pg);

/* Takes a decision together: *any (may be NULL) says whether some rank
 * passed true, *all whether every rank did. For "skip this step: its loss
 * is not finite on some rank". Blocking. */
NB_API nb_status nb_pg_agree(nb_pg *pg, bool flag, bool *any, bool *all);

/* Blocks until the work is done; NB_OK, or the failure (NB_ERR_TIMEOUT,
 * NB_ERR_MISMATCH, NB_ERR_CLOSED, NB_ERR_NETWORK) with the diagnosis in
 * nb_last_error(). After a failure the group is unusable: every later
 * collective fails with the same message. With NCCL it also makes the CUDA
 * compute stream wait for the collective (no device-wide sync), so every
 * op issued afterwards reads its result. */
NB_API nb_status nb_work_wait(nb_work *work);
/* Non-blocking: *done says whether the work finished; the status is its
 * result if it did (NB_OK while it runs). Also runs the hang checks. */
NB_API nb_status nb_work_test(nb_work *work, bool *done);
/* Releases the handle; an unfinished collective still completes. NULL is fine. */
NB_API void nb_work_free(nb_work *work);
/* nb_work_wait, then nb_work_free. */
NB_API nb_status nb_work_finish(nb_work *work);
/* When the collective was issued, began running (became the oldest work of
 * its group) and finished (0 while unfinished), on CLOCK_MONOTONIC in
 * seconds. For NCCL these are host-side times. Any pointer may be NULL. */
NB_API void nb_work_times(const nb_work *work, double *issued, double *started, double *finished);
/* The collective's sequence number in its group (1, 2, ...). */
NB_API uint64_t nb_work_seq(const nb_work *work);

#ifdef __cplusplus
}
#endif
#endif
