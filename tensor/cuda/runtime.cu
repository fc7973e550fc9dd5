/* The CUDA runtime layer: devices, per-device streams and library handles,
 * device and pinned memory, copies, deferred fault reporting. (The
 * public nb_cuda_* functions, the poisoning and TF32 switches are
 * libnabla's: tensor/cuda_plugin.c.)
 *
 * Per-device state is made on first use and lives until the process ends
 * (streams and handles are cheap to keep; destroying them at exit races
 * with the driver's own teardown). Every op enqueues on its device's
 * compute stream, a non-blocking stream, so nothing in the training path
 * waits for the legacy default stream; the host waits only where it reads
 * device memory. See Note [Deferred device checks] in tensor/cuda/cuda.h. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "nabla/cuda.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

#define NB_MAX_CUDA_DEVICES 64
#define GEMM_WORKSPACE_BYTES (32u << 20)
#define STAGE_SEGMENTS 16
#define STAGE_SEGMENT_BYTES (256u << 10)

/* Note [Staged uploads]: a small host-to-device copy (a causal mask made
 * by nb_arange, a scalar from nb_set) should not stall the host until the
 * device has drained its queue. It is copied into one segment of a ring
 * of pinned host memory and sent from there asynchronously; the segment's
 * event says when it may be reused (16 uploads later, long done in
 * practice). Larger copies wait for their completion instead. */
typedef struct stage_ring {
    char *buf;
    cudaEvent_t ev[STAGE_SEGMENTS];
    bool used[STAGE_SEGMENTS];
    int next;
} stage_ring;

typedef struct dev_state {
    bool ready;
    cudaStream_t compute, copy;
    cublasLtHandle_t lt;
    cudnnHandle_t dnn;
    void *gemm_ws;
    size_t total_mem;
    bool pools; /* the stream-ordered allocator (cudaMallocAsync) works here */
    /* Note [cuDNN workspace]: the handle's lock, the buffer, its size, how
     * many buffers were allocated. */
    pthread_mutex_t dnn_lock;
    void *dnn_ws;
    size_t dnn_ws_bytes;
    int64_t dnn_ws_buffers;
    nb__cuda_fault *fault_host, *fault_dev; /* mapped pinned memory */
    stage_ring stage;
} dev_state;

static dev_state devs[NB_MAX_CUDA_DEVICES];
static pthread_mutex_t devs_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- devices ---- */
int nb__cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver or no device: clear the sticky error */
        return 0;
    }
    return n;
}

nb_status nb__cuda_set_device(int device) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return nb_set_error(NB_ERR_INTERNAL, "cudaSetDevice(%d) failed: %s", device,
                            cudaGetErrorString(e));
    return NB_OK;
}

static void check_fault(int device);

static dev_state *state(const char *op, int device) {
    NB_CHECK(device >= 0 && device < NB_MAX_CUDA_DEVICES, "%s: CUDA device %d is out of range",
             op, device);
    dev_state *d = &devs[device];
    if (__atomic_load_n(&d->ready, __ATOMIC_ACQUIRE)) return d;
    pthread_mutex_lock(&devs_lock);
    if (!d->ready) {
        int n = nb__cuda_device_count();
        if (device >= n) {
            pthread_mutex_unlock(&devs_lock);
            nb_abort(__FILE__, __LINE__, "%s: CUDA device %d does not exist (%d visible)", op,
                     device, n);
        }
        NB_CUDA_CHECK(op, cudaSetDevice(device));
        NB_CUDA_CHECK(op, cudaStreamCreateWithFlags(&d->compute, cudaStreamNonBlocking));
        NB_CUDA_CHECK(op, cudaStreamCreateWithFlags(&d->copy, cudaStreamNonBlocking));
        NB_CUDA_CHECK(op, cudaHostAlloc((void **)&d->fault_host, sizeof(nb__cuda_fault),
                                        cudaHostAllocMapped));
        memset(d->fault_host, 0, sizeof *d->fault_host);
        NB_CUDA_CHECK(op, cudaHostGetDevicePointer((void **)&d->fault_dev, d->fault_host, 0));
        size_t free_b = 0;
        NB_CUDA_CHECK(op, cudaMemGetInfo(&free_b, &d->total_mem));
        int pools = 0;
        NB_CUDA_CHECK(op, cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
        d->pools = pools != 0;
        pthread_mutex_init(&d->dnn_lock, NULL);
        __atomic_store_n(&d->ready, true, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&devs_lock);
    return d;
}

void nb__cuda_use(const char *op, int device) {
    state(op, device);
    NB_CUDA_CHECK(op, cudaSetDevice(device));
}

/* ---- memory ---- */
void *nb__cuda_malloc(int device, size_t bytes) {
    nb__cuda_use("nb_ctx (device memory)", device);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        nb_set_error(NB_ERR_NOMEM, "cudaMalloc of %zu bytes on cuda:%d failed: %s (%zu of %zu "
                     "bytes free)", bytes, device, cudaGetErrorString(e), free_b, total_b);
        return NULL;
    }
    return p;
}

void nb__cuda_free(int device, void *p) {
    if (!p) return;
    cudaSetDevice(device);
    /* The arena frees only at reset/free, after the host has stopped
     * enqueuing work that uses the block; cudaFree waits for the device. */
    cudaFree(p);
}

void *nb__cuda_host_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

void nb__cuda_host_free(void *p) {
    if (p) cudaFreeHost(p);
}

/* ---- streams and events ---- */
nb__stream nb__cuda_compute_stream(int device) { return state("nb_cuda", device)->compute; }
nb__stream nb__cuda_copy_stream(int device) { return state("nb_cuda", device)->copy; }

nb__event nb__cuda_event_new(int device) {
    nb__cuda_use("nb_cuda (event)", device);
    cudaEvent_t e;
    NB_CUDA_CHECK("nb_cuda (event)", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
}

void nb__cuda_event_free(nb__event e) {
    if (e) cudaEventDestroy(e);
}

void nb__cuda_event_record(nb__event e, nb__stream s) {
    NB_CUDA_CHECK("nb_cuda (event)", cudaEventRecord(e, s));
}

void nb__cuda_stream_wait(nb__stream s, nb__event e) {
    NB_CUDA_CHECK("nb_cuda (event)", cudaStreamWaitEvent(s, e, 0));
}

void nb__cuda_event_wait(nb__event e) {
    NB_CUDA_CHECK("nb_cuda (waiting for an event)", cudaEventSynchronize(e));
}

void nb__cuda_sync(int device) {
    dev_state *d = state("nb_cuda_synchronize", device);
    NB_CUDA_CHECK("nb_cuda_synchronize", cudaSetDevice(device));
    NB_CUDA_CHECK("nb_cuda_synchronize", cudaStreamSynchronize(d->compute));
    if (nb__cuda_profile_on()) nb__cuda_profile_resolve(device);
    check_fault(device);
}

/* ---- copies ---- */
/* Sends a small upload through the ring; false when it is too large or
 * the ring cannot be had (then the caller copies synchronously). */
static pthread_mutex_t stage_lock = PTHREAD_MUTEX_INITIALIZER;

static bool staged_upload_locked(dev_state *d, void *dst, const void *src, size_t bytes);

static bool staged_upload(dev_state *d, void *dst, const void *src, size_t bytes) {
    if (bytes > STAGE_SEGMENT_BYTES) return false;
    pthread_mutex_lock(&stage_lock); /* uploads may come from several host threads */
    bool ok = staged_upload_locked(d, dst, src, bytes);
    pthread_mutex_unlock(&stage_lock);
    return ok;
}

static bool staged_upload_locked(dev_state *d, void *dst, const void *src, size_t bytes) {
    stage_ring *r = &d->stage;
    if (!r->buf) {
        if (cudaHostAlloc((void **)&r->buf, (size_t)STAGE_SEGMENTS * STAGE_SEGMENT_BYTES,
                          cudaHostAllocPortable) != cudaSuccess) {
            cudaGetLastError();
            r->buf = NULL;
            return false;
        }
        for (int i = 0; i < STAGE_SEGMENTS; i++)
            NB_CUDA_CHECK("nb_from_host",
                          cudaEventCreateWithFlags(&r->ev[i], cudaEventDisableTiming));
    }
    int k = r->next;
    r->next = (k + 1) % STAGE_SEGMENTS;
    if (r->used[k]) NB_CUDA_CHECK("nb_from_host", cudaEventSynchronize(r->ev[k]));
    char *seg = r->buf + (size_t)k * STAGE_SEGMENT_BYTES;
    memcpy(seg, src, bytes);
    NB_CUDA_CHECK("nb_from_host",
                  cudaMemcpyAsync(dst, seg, bytes, cudaMemcpyHostToDevice, d->compute));
    NB_CUDA_CHECK("nb_from_host", cudaEventRecord(r->ev[k], d->compute));
    r->used[k] = true;
    return true;
}

void nb__cuda_memcpy_h2d(int device, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    dev_state *d = state("nb_from_host", device);
    NB_CUDA_CHECK("nb_from_host", cudaSetDevice(device));
    if (staged_upload(d, dst, src, bytes)) return;
    NB_CUDA_CHECK("nb_from_host",
                  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, d->compute));
    /* the source may be pageable memory the caller reuses at once */
    NB_CUDA_CHECK("nb_from_host", cudaStreamSynchronize(d->compute));
}

void nb__cuda_memcpy_d2h(int device, void *dst, const void *src, size_t bytes) {
    dev_state *d = state("nb_to_host", device);
    NB_CUDA_CHECK("nb_to_host", cudaSetDevice(device));
    if (bytes)
        NB_CUDA_CHECK("nb_to_host",
                      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d->compute));
    NB_CUDA_CHECK("nb_to_host", cudaStreamSynchronize(d->compute));
    check_fault(device);
}

void nb__cuda_memcpy_d2d(int device, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    dev_state *d = state("nb_copy_", device);
    NB_CUDA_CHECK("nb_copy_", cudaSetDevice(device));
    NB_CUDA_CHECK("nb_copy_",
                  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, d->compute));
}

void nb__cuda_memset(int device, void *dst, int byte, size_t bytes) {
    if (!bytes) return;
    dev_state *d = state("nb_zeros", device);
    NB_CUDA_CHECK("nb_zeros", cudaSetDevice(device));
    NB_CUDA_CHECK("nb_zeros", cudaMemsetAsync(dst, byte, bytes, d->compute));
}

void nb__cuda_memcpy_h2d_async(int device, void *dst, const void *src, size_t bytes,
                               nb__stream s) {
    if (!bytes) return;
    state("nb_loader (copy)", device);
    NB_CUDA_CHECK("nb_loader (copy)", cudaSetDevice(device));
    NB_CUDA_CHECK("nb_loader (copy)",
                  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
}

/* ---- library handles ---- */
/* Made once per device under devs_lock: two host threads making the same
 * handle at once would otherwise both create one (and a reader could see
 * the pointer before the handle is set up). */
void *nb__cuda_cublaslt(int device) {
    dev_state *d = state("nb_matmul", device);
    cublasLtHandle_t h = __atomic_load_n(&d->lt, __ATOMIC_ACQUIRE);
    if (h) return h;
    pthread_mutex_lock(&devs_lock);
    if (!d->lt) {
        NB_CUDA_CHECK("nb_matmul", cudaSetDevice(device));
        NB_CUBLAS_CHECK("nb_matmul", cublasLtCreate(&h));
        __atomic_store_n(&d->lt, h, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&devs_lock);
    return d->lt;
}

void *nb__cuda_gemm_workspace(int device, size_t *bytes) {
    dev_state *d = state("nb_matmul", device);
    *bytes = GEMM_WORKSPACE_BYTES;
    void *ws = __atomic_load_n(&d->gemm_ws, __ATOMIC_ACQUIRE);
    if (ws) return ws;
    pthread_mutex_lock(&devs_lock);
    if (!d->gemm_ws) {
        NB_CUDA_CHECK("nb_matmul", cudaSetDevice(device));
        NB_CUDA_CHECK("nb_matmul", cudaMalloc(&ws, GEMM_WORKSPACE_BYTES));
        __atomic_store_n(&d->gemm_ws, ws, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&devs_lock);
    return d->gemm_ws;
}

void *nb__cuda_cudnn(int device) {
    dev_state *d = state("nb_conv2d", device);
    cudnnHandle_t h = __atomic_load_n(&d->dnn, __ATOMIC_ACQUIRE);
    if (h) return h;
    pthread_mutex_lock(&devs_lock);
    if (!d->dnn) {
        NB_CUDA_CHECK("nb_conv2d", cudaSetDevice(device));
        NB_CUDNN_CHECK("nb_conv2d", cudnnCreate(&h));
        NB_CUDNN_CHECK("nb_conv2d", cudnnSetStream(h, d->compute));
        __atomic_store_n(&d->dnn, h, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&devs_lock);
    return d->dnn;
}

/* Note [cuDNN workspace]
 * cuDNN's convolutions take scratch memory, the workspace, of a size that
 * depends on the algorithm (from nothing to a GiB or more). Every cuDNN
 * call of a device runs on its compute stream, one after another, so all
 * of them can share one buffer: a call cannot start before the previous
 * user of the buffer has finished with it. The runtime keeps one buffer
 * per device, as large as the largest workspace asked for so far, and
 * never shrinks it (a network asks for the same sizes every step, so after
 * the first step nothing is allocated). Taking the workspace from the
 * step's context instead would hold one workspace per call until the
 * reset: several GB for a deep CNN, forward and backward.
 *
 * Growing. When a call asks for more than the buffer holds, kernels queued
 * before may still be using the old buffer, so it must not be freed at
 * once. Where the device has the stream-ordered allocator (the usual
 * case; cudaDevAttrMemoryPoolsSupported says), the new
 * buffer is taken with cudaMallocAsync on the compute stream and the old
 * one given back with cudaFreeAsync on the same stream: the free takes
 * effect when the stream reaches it, after every call already queued, and
 * the host waits for nothing. The old block returns to the device's
 * default pool, which hands it back to the driver at the next
 * synchronisation (release threshold 0, the default), so the arenas'
 * cudaMalloc can use it again. Without pools, the host waits for the
 * compute stream (cudaStreamSynchronize, not a device-wide sync) and frees
 * the old buffer with cudaFree. Either way the new buffer is allocated
 * first: when that fails, the old one stays and nothing changes. Growth
 * happens a few times during the first step and, as later steps ask for
 * the same sizes, not after.
 *
 * Lock. The buffer is handed out and used under the device's cuDNN lock
 * (nb__cuda_cudnn_lock), held until the call using it is enqueued:
 * otherwise another host thread could grow the buffer, and enqueue the
 * old one's free, between our taking the pointer and enqueuing our call,
 * which would then run on freed memory. The same lock serialises the use
 * of the cuDNN handle, which cuDNN allows on one host thread at a time.
 * The runtime never aborts while it is held: nb__cuda_cudnn_workspace
 * reports a failure, and the caller releases its locks before aborting. */
void *nb__cuda_cudnn_lock(int device) {
    cudnnHandle_t h = (cudnnHandle_t)nb__cuda_cudnn(device); /* may abort: before the lock */
    pthread_mutex_lock(&devs[device].dnn_lock);
    return h;
}

void nb__cuda_cudnn_unlock(int device) { pthread_mutex_unlock(&devs[device].dnn_lock); }

static nb_status ws_error(int device, const char *what, size_t bytes, cudaError_t e) {
    cudaGetLastError(); /* not sticky: clear it for the next check */
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return nb_set_error(e == cudaErrorMemoryAllocation ? NB_ERR_NOMEM : NB_ERR_INTERNAL,
                        "%s (cuDNN workspace of %zu bytes on cuda:%d) failed: %s (%zu of %zu "
                        "bytes free)",
                        what, bytes, device, cudaGetErrorString(e), free_b, total_b);
}

nb_status nb__cuda_cudnn_workspace(int device, size_t bytes, void **ws) {
    dev_state *d = &devs[device];
    if (bytes <= d->dnn_ws_bytes) {
        *ws = d->dnn_ws;
        return NB_OK;
    }
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return ws_error(device, "cudaSetDevice", bytes, e);
    void *p = NULL;
    if (d->pools) {
        e = cudaMallocAsync(&p, bytes, d->compute);
        if (e != cudaSuccess) return ws_error(device, "cudaMallocAsync", bytes, e);
        if (d->dnn_ws) {
            e = cudaFreeAsync(d->dnn_ws, d->compute);
            if (e != cudaSuccess) {
                nb_status st = ws_error(device, "cudaFreeAsync of the previous buffer", bytes, e);
                cudaFreeAsync(p, d->compute);
                return st;
            }
        }
    } else {
        e = cudaMalloc(&p, bytes);
        if (e != cudaSuccess) return ws_error(device, "cudaMalloc", bytes, e);
        if (d->dnn_ws) {
            e = cudaStreamSynchronize(d->compute);
            if (e == cudaSuccess) e = cudaFree(d->dnn_ws);
            if (e != cudaSuccess) {
                nb_status st = ws_error(device, "freeing the previous buffer", bytes, e);
                cudaFree(p);
                return st;
            }
        }
    }
    d->dnn_ws = p;
    d->dnn_ws_bytes = bytes;
    d->dnn_ws_buffers++;
    *ws = p;
    return NB_OK;
}

size_t nb__cuda_cudnn_workspace_limit(int device) {
    size_t t = state("nb_conv2d", device)->total_mem / 16, floor = (size_t)1 << 30;
    return t > floor ? t : floor;
}

size_t nb__cuda_cudnn_workspace_size(int device, int64_t *buffers) {
    dev_state *d = state("nb_cuda (cuDNN workspace)", device);
    pthread_mutex_lock(&d->dnn_lock);
    size_t bytes = d->dnn_ws_bytes;
    if (buffers) *buffers = d->dnn_ws_buffers;
    pthread_mutex_unlock(&d->dnn_lock);
    return bytes;
}

/* ---- deferred faults ---- */
nb__cuda_fault *nb__cuda_fault_slot(int device) { return state("nb_cuda", device)->fault_dev; }

static void check_fault(int device) {
    volatile nb__cuda_fault *f = devs[device].fault_host;
    if (!f || f->code == NB__FAULT_NONE) return;
    long long v = f->value, pos = f->position, lim = f->limit;
    int code = f->code;
    f->code = NB__FAULT_NONE; /* reported once; a handler that recovers can go on */
    switch (code) {
    case NB__FAULT_EMBEDDING_INDEX:
        nb_abort(__FILE__, __LINE__,
                 "nb_embedding (cuda:%d): index %lld at position %lld is out of range for %lld "
                 "rows (found on the device; reported at the next synchronisation)",
                 device, v, pos, lim);
    case NB__FAULT_CROSS_ENTROPY_TARGET:
        nb_abort(__FILE__, __LINE__,
                 "nb_cross_entropy (cuda:%d): target %lld at position %lld is out of range for "
                 "%lld classes (valid: 0..%lld, or ignore_index; found on the device; reported "
                 "at the next synchronisation)",
                 device, v, pos, lim, lim - 1);
    case NB__FAULT_SYNC_BATCH_NORM_COUNT:
        nb_abort(__FILE__, __LINE__,
                 "nb_sync_batch_norm (cuda:%d): the global batch has %lld value(s) per channel; "
                 "training needs more than one (found on the device; reported at the next "
                 "synchronisation)",
                 device, v);
    default:
        nb_abort(__FILE__, __LINE__, "cuda:%d: device fault %d (value %lld, position %lld)", device,
                 code, v, pos);
    }
}
