/* The NCCL backend (CUDA tensors), and the few CUDA runtime calls the
 * distributed code needs. Plain C against nccl.h and cuda_runtime.h.
 *
 * Note [NCCL streams]
 * Each group has a communicator and its own non-blocking communication
 * stream. A collective is ordered after the work already queued on the
 * CUDA backend's compute stream (nb__cuda_compute_stream) by the group's
 * `ready` event, recorded there and waited for by the communication stream
 * (the compute stream waits for nothing; no device-wide sync); it is then
 * enqueued on the communication stream and followed by a completion event.
 * Completion events come from a small process-wide pool per device (they
 * outlive neither the pool nor their work handle, and a work handle may be
 * freed after its group), so steady-state collectives create no events.
 * Waiting for a work (nb_work_wait) first makes the compute stream wait
 * for the completion event, so kernels queued afterwards see the result
 * whatever the host does, then polls the event from the host only to
 * notice completion, timeouts and NCCL's asynchronous errors
 * (nb__nccl_query). The unique id travels through the store. After a
 * failure (timeout, dead peer) the communicator is aborted, which stops
 * its kernels.
 *
 * The end of the file is the backend table entries pg.c calls
 * (nb__pg_nccl_ops), written against the functions above. Compiled into
 * the CUDA plugin only, which hands the table to pg.c (Note [CUDA plugin]
 * in tensor/cuda_plugin.h). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/pg.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include "tensor/cuda/cuda.h"

#define POOL_KEEP 32 /* free completion events kept per device */
#define POOL_DEVICES 64

struct nb__nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t ready; /* compute stream -> communication stream, reused */
    int device;
    void *agree_buf;
    bool aborted;
    int size;
    void *hdr_dev;     /* this rank's header, then every rank's (all-gathered) */
    int64_t *hdr_host; /* pinned: the same */
    cudaEvent_t hdr_done;
};

#define HDR_BYTES (NB__COLL_HEADER_WORDS * sizeof(int64_t))

struct nb__nccl_work {
    int device;
    cudaEvent_t done;
};

/* Every CUDA and NCCL call goes through these two. */
#define CUDA_TRY(call)                                                                            \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess)                                                                    \
            return nb_set_error(NB_ERR_INTERNAL, "%s failed: %s (%s:%d)", #call,                  \
                                cudaGetErrorString(e_), __FILE__, __LINE__);                      \
    } while (0)
#define NCCL_TRY(call)                                                                            \
    do {                                                                                          \
        ncclResult_t r_ = (call);                                                                 \
        if (r_ != ncclSuccess)                                                                    \
            return nb_set_error(NB_ERR_NETWORK, "%s failed: %s (%s)", #call, ncclGetErrorString(r_), \
                                ncclGetLastError(NULL));                                          \
    } while (0)

/* ---- the completion-event pool (Note [NCCL streams]) ---- */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static cudaEvent_t pool[POOL_DEVICES][POOL_KEEP];
static int pool_n[POOL_DEVICES];

/* A completion event of `device` (the current device). */
static nb_status event_get(int device, cudaEvent_t *e) {
    *e = NULL;
    if (device >= 0 && device < POOL_DEVICES) {
        pthread_mutex_lock(&pool_mu);
        if (pool_n[device] > 0) *e = pool[device][--pool_n[device]];
        pthread_mutex_unlock(&pool_mu);
        if (*e) return NB_OK;
    }
    CUDA_TRY(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    return NB_OK;
}

static void event_put(int device, cudaEvent_t e) {
    if (!e) return;
    if (device >= 0 && device < POOL_DEVICES) {
        pthread_mutex_lock(&pool_mu);
        bool kept = pool_n[device] < POOL_KEEP;
        if (kept) pool[device][pool_n[device]++] = e;
        pthread_mutex_unlock(&pool_mu);
        if (kept) return;
    }
    cudaEventDestroy(e);
}

static ncclDataType_t nccl_dtype(nb_dtype d) {
    switch (d) {
    case NB_F32: return ncclFloat32;
    case NB_F64: return ncclFloat64;
    case NB_BF16: return ncclBfloat16;
    case NB_F16: return ncclFloat16;
    case NB_I32: return ncclInt32;
    case NB_I64: return ncclInt64;
    default: break;
    }
    NB_ABORT("nb_pg (nccl): dtype %s has no NCCL type", nb_dtype_name(d));
}

static ncclRedOp_t nccl_op(nb_reduce_op op) {
    switch (op) {
    case NB_REDUCE_SUM: return ncclSum;
    case NB_REDUCE_AVG: return ncclAvg;
    case NB_REDUCE_MIN: return ncclMin;
    case NB_REDUCE_MAX: return ncclMax;
    }
    return ncclSum;
}

static nb_status init_comm(nb__nccl *n, nb_store *store, const char *prefix, int rank, int size) {
    char key[160];
    snprintf(key, sizeof key, "%suid", prefix);
    ncclUniqueId id;
    if (rank == 0) {
        NCCL_TRY(ncclGetUniqueId(&id));
        nb_status st = nb_store_set(store, key, &id, sizeof id);
        if (st != NB_OK) return st;
    } else {
        void *v = NULL;
        size_t len = 0;
        nb_status st = nb_store_get(store, key, -1, &v, &len);
        if (st != NB_OK) return st;
        if (len != sizeof id) {
            free(v);
            return nb_set_error(NB_ERR_MISMATCH,
                                "nb_pg_init: NCCL unique id under '%s' has %zu bytes, expected %zu "
                                "(ranks built against different NCCL versions?)",
                                key, len, sizeof id);
        }
        memcpy(&id, v, sizeof id);
        free(v);
    }
    NCCL_TRY(ncclCommInitRank(&n->comm, size, id, rank));
    return NB_OK;
}

nb_status nb__nccl_init(nb__nccl **out, nb_store *store, const char *prefix, int rank, int size,
                        int device, void **agree_buf) {
    *out = NULL;
    nb__nccl *n = calloc(1, sizeof *n);
    NB_CHECK(n != NULL, "nb_pg_init: out of memory");
    n->device = device;
    nb_status st = nb__cuda_set_device(device);
    if (st == NB_OK && cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking) != cudaSuccess)
        st = nb_set_error(NB_ERR_INTERNAL, "nb_pg_init: cannot create the communication stream: %s",
                          cudaGetErrorString(cudaGetLastError()));
    if (st == NB_OK && cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming) != cudaSuccess)
        st = nb_set_error(NB_ERR_INTERNAL, "nb_pg_init: cannot create an event: %s",
                          cudaGetErrorString(cudaGetLastError()));
    if (st == NB_OK && !(n->agree_buf = nb__cuda_malloc(device, 16)))
        st = nb_set_error(NB_ERR_NOMEM, "nb_pg_init: cannot allocate 16 bytes of device memory");
    n->size = size;
    if (st == NB_OK && (cudaMalloc(&n->hdr_dev, HDR_BYTES * (size_t)(size + 1)) != cudaSuccess ||
                        cudaMallocHost((void **)&n->hdr_host, HDR_BYTES * (size_t)(size + 1)) != cudaSuccess ||
                        cudaEventCreateWithFlags(&n->hdr_done, cudaEventDisableTiming) != cudaSuccess))
        st = nb_set_error(NB_ERR_NOMEM, "nb_pg_init: cannot allocate the collective headers' buffers (%zu bytes): %s",
                          HDR_BYTES * (size_t)(size + 1), cudaGetErrorString(cudaGetLastError()));
    if (st == NB_OK) st = init_comm(n, store, prefix, rank, size);
    if (st != NB_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", nb_last_error());
        if (n->agree_buf) nb__cuda_free(device, n->agree_buf);
        if (n->hdr_dev) cudaFree(n->hdr_dev);
        if (n->hdr_host) cudaFreeHost(n->hdr_host);
        if (n->hdr_done) cudaEventDestroy(n->hdr_done);
        if (n->ready) cudaEventDestroy(n->ready);
        if (n->stream) cudaStreamDestroy(n->stream);
        free(n);
        return nb_set_error(st, "nb_pg_init (nccl, rank %d of %d, cuda:%d): %s", rank, size, device, msg);
    }
    *agree_buf = n->agree_buf;
    *out = n;
    return NB_OK;
}

void nb__nccl_free(nb__nccl *n) {
    if (!n) return;
    cudaSetDevice(n->device);
    if (n->aborted) {
        /* ncclCommAbort already released the communicator */
    } else {
        cudaStreamSynchronize(n->stream);
        ncclCommDestroy(n->comm);
    }
    nb__cuda_free(n->device, n->agree_buf);
    cudaFree(n->hdr_dev);
    cudaFreeHost(n->hdr_host);
    cudaEventDestroy(n->hdr_done);
    cudaEventDestroy(n->ready);
    cudaStreamDestroy(n->stream);
    free(n);
}

void nb__nccl_abort(nb__nccl *n) {
    if (n->aborted) return;
    n->aborted = true;
    ncclCommAbort(n->comm);
}

static nb_status enqueue(nb__nccl *n, const nb__coll *c) {
    int size;
    NCCL_TRY(ncclCommCount(n->comm, &size));
    size_t count = (size_t)c->count;
    ncclDataType_t dt = nccl_dtype(c->dtype);
    switch (c->kind) {
    case NB__ALL_REDUCE:
        NCCL_TRY(ncclAllReduce(c->out, c->out, count, dt, nccl_op(c->op), n->comm, n->stream));
        break;
    case NB__BROADCAST:
        NCCL_TRY(ncclBroadcast(c->out, c->out, count, dt, c->root, n->comm, n->stream));
        break;
    case NB__ALL_GATHER:
        NCCL_TRY(ncclAllGather(c->in, c->out, count, dt, n->comm, n->stream));
        break;
    case NB__REDUCE_SCATTER:
        NCCL_TRY(ncclReduceScatter(c->in, c->out, count, dt, nccl_op(c->op), n->comm, n->stream));
        break;
    case NB__BARRIER:
        /* NCCL has no barrier: an all-reduce of one element stands in. */
        NCCL_TRY(ncclAllReduce(n->agree_buf, (char *)n->agree_buf + 8, 1, ncclInt32, ncclSum, n->comm,
                               n->stream));
        break;
    }
    (void)size;
    return NB_OK;
}

nb_status nb__nccl_launch(nb__nccl *n, const nb__coll *c, nb__nccl_work **work) {
    *work = NULL;
    CUDA_TRY(cudaSetDevice(n->device));
    cudaStream_t compute = (cudaStream_t)nb__cuda_compute_stream(n->device);
    CUDA_TRY(cudaEventRecord(n->ready, compute));
    CUDA_TRY(cudaStreamWaitEvent(n->stream, n->ready, 0));
    nb_status st = enqueue(n, c);
    if (st != NB_OK) return st;
    nb__nccl_work *w = calloc(1, sizeof *w);
    NB_CHECK(w != NULL, "nb_pg (nccl): out of memory");
    w->device = n->device;
    st = event_get(n->device, &w->done);
    if (st == NB_OK && cudaEventRecord(w->done, n->stream) != cudaSuccess)
        st = nb_set_error(NB_ERR_INTERNAL, "nb_pg (nccl): cannot record the completion event: %s",
                          cudaGetErrorString(cudaGetLastError()));
    if (st != NB_OK) {
        nb__nccl_work_free(w);
        return st;
    }
    *work = w;
    return NB_OK;
}

/* Work not done yet: 0, or the status of an error NCCL met on its own
 * (a peer gone, a network failure) while it ran. */
static int async_error(nb__nccl *n) {
    ncclResult_t async;
    if (ncclCommGetAsyncError(n->comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress)
        return nb_set_error(NB_ERR_NETWORK, "NCCL: %s (%s)", ncclGetErrorString(async),
                            ncclGetLastError(n->comm));
    return 0;
}

int nb__nccl_exchange(nb__nccl *n, const void *mine, void *all, size_t bytes, bool start) {
    if (bytes > HDR_BYTES)
        return nb_set_error(NB_ERR_INTERNAL, "nb_pg (nccl): an exchange of %zu bytes per rank (at most %zu)", bytes,
                            (size_t)HDR_BYTES);
    if (start) {
        /* no wait for the compute stream: the bytes are the host's */
        CUDA_TRY(cudaSetDevice(n->device));
        memcpy(n->hdr_host, mine, bytes);
        CUDA_TRY(cudaMemcpyAsync(n->hdr_dev, n->hdr_host, bytes, cudaMemcpyHostToDevice, n->stream));
        NCCL_TRY(ncclAllGather(n->hdr_dev, (char *)n->hdr_dev + HDR_BYTES, bytes, ncclInt8, n->comm, n->stream));
        CUDA_TRY(cudaMemcpyAsync(n->hdr_host + NB__COLL_HEADER_WORDS, (char *)n->hdr_dev + HDR_BYTES,
                                 bytes * (size_t)n->size, cudaMemcpyDeviceToHost, n->stream));
        CUDA_TRY(cudaEventRecord(n->hdr_done, n->stream));
        return 0;
    }
    cudaError_t e = cudaEventQuery(n->hdr_done);
    if (e == cudaErrorNotReady) return async_error(n);
    if (e != cudaSuccess) return nb_set_error(NB_ERR_INTERNAL, "CUDA: %s", cudaGetErrorString(e));
    memcpy(all, n->hdr_host + NB__COLL_HEADER_WORDS, bytes * (size_t)n->size);
    return 1;
}

int nb__nccl_query(nb__nccl *n, nb__nccl_work *w) {
    cudaError_t e = cudaEventQuery(w->done);
    if (e == cudaSuccess) return 1;
    if (e != cudaErrorNotReady)
        return nb_set_error(NB_ERR_INTERNAL, "CUDA: %s", cudaGetErrorString(e));
    return async_error(n);
}

nb_status nb__nccl_work_order(nb__nccl_work *w) {
    CUDA_TRY(cudaSetDevice(w->device));
    CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)nb__cuda_compute_stream(w->device), w->done, 0));
    return NB_OK;
}

void nb__nccl_work_free(nb__nccl_work *w) {
    if (!w) return;
    event_put(w->device, w->done);
    free(w);
}



/* ------------------------------------------------ the backend table */

/* Longest sleep between two polls of an NCCL completion event: a wait
 * notices completion at most this late (DDP waits once per step,
 * SyncBatchNorm once per layer and pass). */
#define NCCL_POLL_MAX_S 1e-4

/* Finishes the works whose events have fired, oldest first. */
static void nccl_progress(nb_pg *pg) {
    pthread_mutex_lock(&pg->mu);
    while (pg->q_head && pg->broken == NB_OK) {
        nb_work *w = pg->q_head;
        if (w->state == NB__W_QUEUED) break; /* still being launched */
        int r = w->impl ? nb__nccl_query(pg->impl, w->impl) : 1;
        if (r == 0) break;
        if (r == 1) {
            nb__pg_finish_locked(pg, w, NB_OK, "");
            continue;
        }
        __atomic_add_fetch(&w->refs, 1, __ATOMIC_ACQ_REL);
        char what[NB__MSG_LEN];
        snprintf(what, sizeof what, "failed in the transport (%s)", nb_last_error());
        pthread_mutex_unlock(&pg->mu);
        nb__pg_fail(pg, w, (nb_status)r, what);
        nb__work_put(w);
        pthread_mutex_lock(&pg->mu);
    }
    pthread_mutex_unlock(&pg->mu);
}

static nb_status nccl_start(nb_pg *pg, const char *prefix) {
    nb_pg *root = pg->root;
    nb__nccl *n = NULL;
    void *agree_buf = NULL;
    nb_status st = nb__nccl_init(&n, root->store_main, prefix, pg->rank, pg->size, pg->device.index, &agree_buf);
    pg->impl = n;
    return st;
}

/* Launched from the issuing thread. The work stays QUEUED until it has its
 * completion event, so that nccl_progress (possibly on another thread)
 * does not take it for finished. */
static void nccl_launch(nb_pg *pg, nb_work *w) {
    nb_status st = NB_OK;
    nb__nccl_work *nw = NULL;
    if (w->coll.count > 0 || w->coll.kind == NB__BARRIER) st = nb__nccl_launch(pg->impl, &w->coll, &nw);
    pthread_mutex_lock(&pg->mu);
    w->impl = nw;
    w->state = NB__W_RUNNING;
    pthread_mutex_unlock(&pg->mu);
    if (st != NB_OK) {
        char what[NB__MSG_LEN];
        snprintf(what, sizeof what, "could not be launched (%s)", nb_last_error());
        nb__pg_fail(pg, w, st, what);
        pthread_mutex_lock(&pg->mu);
        nb__pg_finish_locked(pg, w, pg->broken, pg->broken_msg);
        pthread_mutex_unlock(&pg->mu);
    }
}

static void nccl_wait_slice(nb_pg *pg, double *pause) {
    pthread_mutex_unlock(&pg->mu);
    nb__sleep(*pause);
    *pause = *pause * 2 > NCCL_POLL_MAX_S ? NCCL_POLL_MAX_S : *pause * 2;
    nccl_progress(pg);
    pthread_mutex_lock(&pg->mu);
}

/* Note [NCCL streams]: the compute stream waits for the collective. */
static nb_status nccl_order(nb_work *w) {
    return w->impl ? nb__nccl_work_order(w->impl) : NB_OK;
}

static void nccl_abort(nb_pg *pg) {
    if (pg->impl) nb__nccl_abort(pg->impl);
}

static void nccl_free(nb_pg *pg, bool stuck) {
    (void)stuck;
    if (pg->impl) nb__nccl_free(pg->impl);
    pg->impl = NULL;
}

static void nccl_work_free(nb_work *w) {
    if (w->impl) nb__nccl_work_free(w->impl);
}

/* The vote goes through the group's 16 bytes of device memory. */
static nb_status nccl_agree(nb_pg *pg, int32_t *votes) {
    nb__nccl *n = pg->impl;
    nb__cuda_memcpy_h2d(pg->device.index, n->agree_buf, votes, sizeof *votes);
    nb__coll c = {NB__ALL_REDUCE, NB_REDUCE_SUM, NB_I32, 1, 0, n->agree_buf, NULL, 0};
    nb_status st = nb_work_finish(nb__pg_issue(pg, &c));
    if (st == NB_OK) nb__cuda_memcpy_d2h(pg->device.index, votes, n->agree_buf, sizeof *votes);
    return st;
}

/* The check layer's exchange (pg.h): one at a time, on the group's
 * stream; the issuing thread polls it. */
typedef struct nccl_xchg {
    void *all;
    size_t n;
} nccl_xchg;

static nb_status nccl_xpost(nb_pg *pg, nb_work *w, const void *mine, void *all, size_t n, void **x) {
    (void)w; /* the stream orders them; the data move apart */
    *x = NULL;
    int r = nb__nccl_exchange(pg->impl, mine, all, n, true);
    if (r < 0) return (nb_status)r;
    nccl_xchg *e = malloc(sizeof *e);
    NB_CHECK(e != NULL, "nb_pg (nccl): out of memory");
    e->all = all;
    e->n = n;
    *x = e;
    return NB_OK;
}

static int nccl_xtest(nb_pg *pg, void *x) {
    nccl_xchg *e = x;
    int r = nb__nccl_exchange(pg->impl, NULL, e->all, e->n, false);
    if (r != 0) free(e);
    return r;
}

static void nccl_xdrop(void *x) { free(x); }

const nb__pg_ops nb__pg_nccl_ops = {
    .name = "nccl",
    .start = nccl_start,
    .run = NULL,
    .launch = nccl_launch,
    .progress = nccl_progress,
    .wait_slice = nccl_wait_slice,
    .order = nccl_order,
    .abort = nccl_abort,
    .free = nccl_free,
    .work_free = nccl_work_free,
    .agree = nccl_agree,
    .xpost = nccl_xpost,
    .xtest = nccl_xtest,
    .xdrop = nccl_xdrop,
};
