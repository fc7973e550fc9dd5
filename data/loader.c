/* The dataloader: a batch order per epoch, worker threads that assemble
 * batches into a ring of slots, and the caller's thread that takes them in
 * order and copies them into its context.
 *
 * Note [Loader pipeline]
 * The epoch's index list is computed on the caller's thread (from the
 * sampler at the loader's epoch) and checked against the dataset length
 * there. Batch k may be claimed by any worker once every batch before
 * k - Q has been taken (Q = number of slots); it is assembled in slot
 * k % Q, which that rule guarantees is free. The caller waits for slot
 * `consumed % Q` to hold batch `consumed`, so batches come out in batch
 * order whatever the number of workers or their timing, and each batch's
 * bytes are those of the same gets in the same order: identical output
 * for 0, 1 or N workers. A seek (or the start of a new epoch) bumps a
 * generation number, stops new claims, waits for the workers in flight
 * (`busy`) to finish, frees every slot, and only then swaps the index
 * list, since workers read it without the lock. Results of an older
 * generation are dropped. The loader itself is driven by one thread.
 *
 * Note [Loader to CUDA]
 * With a device whose memory is not host memory (CUDA; the backend's
 * device_memory, tensor/backend.h) each slot also has a device buffer
 * (in a context the loader owns) and two events. The worker that filled the slot's host
 * buffer (pinned with pin_memory, else pageable) copies it to the device
 * buffer with an asynchronous copy on the device's copy stream, after the
 * slot's `consumed` event (the last reader of the device buffer), and
 * records `copied`; so the copy of batch k overlaps the compute of the
 * batches before it. nb_loader_next makes the compute stream wait for
 * `copied`, copies the device buffer into the caller's tensors on the
 * compute stream (device to device, so the caller's arena is only ever
 * touched in compute-stream order), and records `consumed`. A worker
 * waits on the host for `copied` before it refills the host buffer, so no
 * copy ever reads a buffer being rewritten. Without workers the caller's
 * thread does the same with one slot. The CPU path is unchanged. Each
 * worker makes the loader's device current for itself before its first
 * CUDA call (the current device is per thread). Every device call goes
 * through the device's backend table.
 *
 * Note [Batches of a resumed epoch]
 * An epoch resumed part way at another world size
 * (nb_sampler_distributed_resume, Note [Resuming at another world size]
 * in data/sampler.c) deals each rank only the indices after the resume
 * point. The loader still numbers its batches from the start of the
 * epoch: the batches before the resume point, base = floor(s / B) with s
 * the indices per rank the sampler counts as taken (floor(taken / R),
 * nb__sampler_skipped) and B the batch size, count as taken, so the first
 * batch after the resume is batch `base` (its nb_batch.index), the
 * position starts at (epoch, base) and nb_loader_len is base plus the
 * batches left. That is the index the epoch would have reached at this
 * world size after `taken` samples, rounded down when taken is not a
 * multiple of B R: a saved position then means the same thing before and
 * after a resume (the exact point is the sample count,
 * nb_sampler_distributed_taken(s, (batch - base) B)). A seek to a batch
 * below base starts at the resume point, since those samples are no
 * longer dealt. Internally `consumed` counts from the resume point and
 * every public number adds base; base is 0 in every other epoch. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "tensor/backend.h"
#include "tensor/internal.h"
#include "util/handle.h"

typedef enum slot_state { SLOT_FREE, SLOT_FILLING, SLOT_READY } slot_state;

typedef struct slot {
    slot_state state;
    int64_t batch, size;
    char *inputs, *targets;
    nb_status status;
    int64_t failed_index;
    char message[1024];
    /* staged to device memory (Note [Loader to CUDA]) */
    void *d_inputs, *d_targets;
    nb__event copied, consumed;
} slot;

struct nb_loader {
    nb__handle handle; /* first: Note [Freed handles] in util/handle.h */
    nb_dataset *ds;
    nb_sampler *sampler;
    bool own_sampler;
    int64_t batch_size;
    bool drop_last;
    nb_field in, tgt;
    size_t in_bytes, tgt_bytes;
    nb_device device;
    const nb__backend *be; /* the device's */
    bool staged, pinned;   /* staged: device memory (Note [Loader to CUDA]) */
    nb_ctx *dctx;       /* the slots' device buffers */
    slot stage;         /* CUDA without workers: the caller's one slot */

    /* position and the epoch's order */
    int64_t epoch, consumed, n_batches; /* consumed and n_batches count from base */
    int64_t base; /* batches taken before a resume: Note [Batches of a resumed epoch] */
    int64_t *list, list_len;
    bool list_valid;
    uint64_t sampler_version; /* the list's: nb__sampler_version */

    /* workers (n_workers == 0: none, no slots) */
    int n_workers, n_threads, n_slots;
    pthread_t *threads;
    slot *slots;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, ready_cv, idle_cv;
    int64_t next_claim;
    int busy;
    uint64_t gen;
    bool active, stop, sync_ready;
};

static void slot_release(nb_loader *l, slot *s);

static int64_t batch_len(const nb_loader *l, int64_t k) {
    int64_t size = l->list_len - k * l->batch_size;
    return size < l->batch_size ? size : l->batch_size;
}

/* The gets of one batch into contiguous buffers; on failure the dataset
 * index and the get's message. */
static nb_status fill_batch(const nb_loader *l, const int64_t *idx, int64_t size, char *inputs,
                            char *targets, int64_t *failed, char *msg, size_t msg_size) {
    nb_set_error(NB_OK, "%s", "");
    for (int64_t i = 0; i < size; i++) {
        nb_status st = nb__dataset_get(l->ds, idx[i], inputs + (size_t)i * l->in_bytes,
                                       targets + (size_t)i * l->tgt_bytes);
        if (st != NB_OK) {
            *failed = idx[i];
            const char *m = nb_last_error();
            snprintf(msg, msg_size, "%s", m[0] ? m : nb_status_str(st));
            return st;
        }
    }
    return NB_OK;
}

/* The slot's host buffers -> its device buffers, on the copy stream. */
static void stage_to_device(const nb_loader *l, slot *s, int64_t size) {
    int dev = l->device.index;
    const nb__backend *be = l->be;
    be->use("nb_loader", dev);
    nb__stream cs = be->copy_stream(dev);
    be->stream_wait(cs, s->consumed);
    if (size > 0) {
        be->memcpy_h2d_async(dev, s->d_inputs, s->inputs, (size_t)size * l->in_bytes, cs);
        be->memcpy_h2d_async(dev, s->d_targets, s->targets, (size_t)size * l->tgt_bytes, cs);
    }
    be->event_record(s->copied, cs);
}

static bool claimable(const nb_loader *l) {
    return l->active && l->next_claim < l->n_batches && l->next_claim < l->consumed + l->n_slots;
}

static void *worker_main(void *arg) {
    nb_loader *l = arg;
    /* The current CUDA device is per thread and a new thread's is device
     * 0: a CUDA call made before this (the event wait below) would create a
     * context on GPU 0 in every rank's process. */
    if (l->staged) l->be->use("nb_loader (worker)", l->device.index);
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && !claimable(l)) pthread_cond_wait(&l->work_cv, &l->mu);
        if (l->stop) break;
        int64_t k = l->next_claim++;
        slot *s = &l->slots[k % l->n_slots];
        s->state = SLOT_FILLING;
        s->batch = k;
        s->size = batch_len(l, k);
        uint64_t gen = l->gen;
        l->busy++;
        const int64_t *idx = l->list + k * l->batch_size;
        pthread_mutex_unlock(&l->mu);

        int64_t failed = -1;
        if (l->staged) l->be->event_wait(s->copied);
        nb_status st = fill_batch(l, idx, s->size, s->inputs, s->targets, &failed, s->message,
                                  sizeof s->message);
        if (l->staged && st == NB_OK) stage_to_device(l, s, s->size);

        pthread_mutex_lock(&l->mu);
        l->busy--;
        if (gen == l->gen) {
            s->status = st;
            s->failed_index = failed;
            s->state = SLOT_READY;
            pthread_cond_signal(&l->ready_cv); /* only the caller waits there */
        }
        if (l->busy == 0) pthread_cond_broadcast(&l->idle_cv);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* The index list of `epoch`, checked against the dataset (caller's thread,
 * no lock held: a check may abort). */
static int64_t *epoch_list(const nb_dataset *ds, nb_sampler *sampler, int64_t epoch,
                           int64_t *len) {
    nb_sampler_set_epoch(sampler, epoch);
    int64_t n = nb_sampler_len(sampler), ds_len = nb_dataset_len(ds);
    int64_t *list = malloc(sizeof *list * (size_t)(n ? n : 1));
    NB_CHECK(list, "nb_loader: out of memory for an epoch of %lld indices", (long long)n);
    nb_sampler_indices(sampler, list);
    for (int64_t i = 0; i < n; i++)
        if (list[i] < 0 || list[i] >= ds_len) {
            int64_t bad = list[i];
            free(list);
            NB_ABORT("nb_loader: the sampler gave index %lld (position %lld of epoch %lld) for "
                     "a %s dataset of %lld samples", (long long)bad, (long long)i,
                     (long long)epoch, nb_dataset_name(ds), (long long)ds_len);
        }
    *len = n;
    return list;
}

/* An epoch's order: its index list, its batches and the batches taken
 * before a resume (Note [Batches of a resumed epoch]). */
typedef struct epoch_order {
    int64_t *list, len, n_batches, base;
} epoch_order;

/* The order of `epoch` (which sets the sampler's epoch to it). */
static epoch_order make_order(const nb_loader *l, int64_t epoch) {
    epoch_order o;
    o.list = epoch_list(l->ds, l->sampler, epoch, &o.len);
    o.n_batches = nb_batch_count(o.len, l->batch_size, l->drop_last);
    o.base = nb__sampler_skipped(l->sampler) / l->batch_size;
    return o;
}

static void set_list(nb_loader *l, epoch_order o) {
    l->list = o.list;
    l->list_len = o.len;
    l->n_batches = o.n_batches;
    l->base = o.base;
    l->list_valid = true;
}

/* Whether the loader's list is not that of `epoch` as the sampler deals it
 * now. */
static bool list_stale(const nb_loader *l, int64_t epoch) {
    return !l->list_valid || epoch != l->epoch || nb__sampler_version(l->sampler) != l->sampler_version;
}

/* Moves to (epoch, batch), batch counted from the epoch's start, with the
 * order `fresh` (NULL: the current list stays valid): Note [Loader
 * pipeline]. */
static void restart_with(nb_loader *l, int64_t epoch, int64_t batch, const epoch_order *fresh) {
    l->sampler_version = nb__sampler_version(l->sampler);
    int64_t *old = NULL;
    if (l->n_threads) {
        pthread_mutex_lock(&l->mu);
        l->gen++;
        l->active = false;
        while (l->busy > 0) pthread_cond_wait(&l->idle_cv, &l->mu);
        for (int i = 0; i < l->n_slots; i++) l->slots[i].state = SLOT_FREE;
    }
    if (fresh) {
        old = l->list;
        set_list(l, *fresh);
    }
    l->epoch = epoch;
    int64_t k = batch > l->base ? batch - l->base : 0; /* below base: the resume point */
    l->consumed = l->next_claim = k < l->n_batches ? k : l->n_batches;
    if (l->n_threads) {
        l->active = true;
        pthread_cond_broadcast(&l->work_cv);
        pthread_mutex_unlock(&l->mu);
    }
    free(old);
}

static void restart(nb_loader *l, int64_t epoch, int64_t batch) {
    if (!list_stale(l, epoch)) {
        restart_with(l, epoch, batch, NULL);
        return;
    }
    epoch_order fresh = make_order(l, epoch);
    restart_with(l, epoch, batch, &fresh);
}

static void stop_workers(nb_loader *l) {
    if (!l->n_threads) return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_broadcast(&l->work_cv);
    pthread_mutex_unlock(&l->mu);
    for (int i = 0; i < l->n_threads; i++) pthread_join(l->threads[i], NULL);
    l->n_threads = 0;
}

void nb_loader_free(nb_loader *l) {
    if (!l) return;
    NB__CHECK_HANDLE("nb_loader_free", l, "loader"); /* freed twice: Note [Freed handles] */
    stop_workers(l);
    if (l->sync_ready) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->work_cv);
        pthread_cond_destroy(&l->ready_cv);
        pthread_cond_destroy(&l->idle_cv);
    }
    if (l->slots)
        for (int i = 0; i < l->n_slots; i++) slot_release(l, &l->slots[i]);
    slot_release(l, &l->stage);
    nb_ctx_free(l->dctx);
    free(l->slots);
    free(l->threads);
    free(l->list);
    if (l->own_sampler) nb_sampler_free(l->sampler);
    nb_dataset_free(l->ds);
    nb__handle_retire(l);
}

static void *alloc_buffer(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded ? rounded : 64);
}

/* A slot's buffers (and, for CUDA, its device buffers and events). */
static nb_status slot_init(nb_loader *l, slot *s) {
    size_t in = (size_t)l->batch_size * l->in_bytes, tgt = (size_t)l->batch_size * l->tgt_bytes;
    if (l->pinned) {
        s->inputs = l->be->host_alloc(in ? in : 64);
        s->targets = l->be->host_alloc(tgt ? tgt : 64);
    } else {
        s->inputs = alloc_buffer(in);
        s->targets = alloc_buffer(tgt);
    }
    if (!s->inputs || !s->targets)
        return nb_set_error(NB_ERR_NOMEM, "nb_loader_new: out of %smemory for batch buffers of "
                            "%lld samples", l->pinned ? "pinned " : "", (long long)l->batch_size);
    if (l->staged) {
        s->d_inputs = nb_ctx_alloc(l->dctx, in, 0);
        s->d_targets = nb_ctx_alloc(l->dctx, tgt, 0);
        s->copied = l->be->event_new(l->device.index);
        s->consumed = l->be->event_new(l->device.index);
    }
    return NB_OK;
}

static void slot_release(nb_loader *l, slot *s) {
    /* no copy may still read the host buffers or the device buffers */
    if (s->copied) l->be->event_wait(s->copied);
    if (s->consumed) l->be->event_wait(s->consumed);
    if (l->pinned) {
        if (s->inputs) l->be->host_free(s->inputs);
        if (s->targets) l->be->host_free(s->targets);
    } else {
        free(s->inputs);
        free(s->targets);
    }
    if (s->copied) l->be->event_free(s->copied);
    if (s->consumed) l->be->event_free(s->consumed);
    memset(s, 0, sizeof *s);
}

static nb_status start_workers(nb_loader *l, int prefetch) {
    l->n_slots = prefetch > 0 ? prefetch : 2 * l->n_workers;
    l->slots = calloc((size_t)l->n_slots, sizeof *l->slots);
    l->threads = calloc((size_t)l->n_workers, sizeof *l->threads);
    if (!l->slots || !l->threads)
        return nb_set_error(NB_ERR_NOMEM, "nb_loader_new: out of memory for %d workers",
                            l->n_workers);
    for (int i = 0; i < l->n_slots; i++) {
        nb_status st = slot_init(l, &l->slots[i]);
        if (st != NB_OK) return st;
    }
    if (pthread_mutex_init(&l->mu, NULL) || pthread_cond_init(&l->work_cv, NULL) ||
        pthread_cond_init(&l->ready_cv, NULL) || pthread_cond_init(&l->idle_cv, NULL))
        return nb_set_error(NB_ERR_INTERNAL, "nb_loader_new: cannot initialise a mutex or "
                            "condition variable");
    l->sync_ready = true;
    for (int i = 0; i < l->n_workers; i++) {
        int rc = pthread_create(&l->threads[i], NULL, worker_main, l);
        if (rc != 0)
            return nb_set_error(NB_ERR_INTERNAL, "nb_loader_new: cannot start worker %d of %d: "
                                "%s", i, l->n_workers, strerror(rc));
        l->n_threads++;
    }
    return NB_OK;
}

nb_status nb_loader_new(nb_loader **out, nb_dataset *ds, const nb_loader_options *opts) {
    NB__CHECK_HANDLE("nb_loader_new", ds, "dataset");
    *out = NULL;
    NB_CHECK(ds && opts, "nb_loader_new: dataset and options are required");
    NB_CHECK(opts->batch_size > 0, "nb_loader_new: batch_size %lld must be > 0",
             (long long)opts->batch_size);
    NB_CHECK(opts->num_workers >= 0, "nb_loader_new: num_workers %d must be >= 0",
             opts->num_workers);
    NB_CHECK(opts->prefetch_batches >= 0, "nb_loader_new: prefetch_batches %d must be >= 0",
             opts->prefetch_batches);
    NB_CHECK(!(opts->sampler && opts->shuffle), "nb_loader_new: shuffle is for the loader's own "
             "sampler; with a sampler given, make that sampler shuffle");
    nb_status dst = nb__device_available("nb_loader_new", opts->device);
    if (dst != NB_OK) return dst;
    /* The first epoch's order is checked before anything is allocated. */
    nb_sampler *sampler = opts->sampler;
    if (!sampler) {
        int64_t n = nb_dataset_len(ds);
        sampler = opts->shuffle ? nb_sampler_random(n, opts->seed) : nb_sampler_sequential(n);
    }
    int64_t epoch = nb_sampler_epoch(sampler), len;
    int64_t *list = epoch_list(ds, sampler, epoch, &len);
    nb_loader *l = calloc(1, sizeof *l);
    if (l) nb__handle_init(&l->handle, "nb_loader_free");
    if (!l) {
        free(list);
        if (!opts->sampler) nb_sampler_free(sampler);
        return nb_set_error(NB_ERR_NOMEM, "nb_loader_new: out of memory");
    }
    l->sampler = sampler;
    l->own_sampler = !opts->sampler;
    l->epoch = epoch;
    l->ds = nb_dataset_retain(ds);
    l->batch_size = opts->batch_size;
    l->drop_last = opts->drop_last;
    l->in = nb_dataset_input(ds);
    l->tgt = nb_dataset_target(ds);
    l->in_bytes = nb_field_bytes(&l->in);
    l->tgt_bytes = nb_field_bytes(&l->tgt);
    l->device = opts->device;
    l->be = nb__backend_of(opts->device);
    l->staged = l->be->device_memory;
    l->pinned = l->staged && opts->pin_memory;
    l->n_workers = opts->num_workers;
    set_list(l, (epoch_order){list, len, nb_batch_count(len, opts->batch_size, opts->drop_last),
                              nb__sampler_skipped(sampler) / opts->batch_size});
    l->sampler_version = nb__sampler_version(sampler);
    if (l->staged) {
        int n_slots = l->n_workers > 0 ? (opts->prefetch_batches > 0 ? opts->prefetch_batches
                                                                     : 2 * l->n_workers)
                                       : 1;
        l->dctx = nb_ctx_new(l->device, (size_t)n_slots * (size_t)l->batch_size *
                                            (l->in_bytes + l->tgt_bytes) + 4096 * (size_t)n_slots);
        if (l->n_workers == 0) {
            nb_status st = slot_init(l, &l->stage);
            if (st != NB_OK) {
                nb_loader_free(l);
                return st;
            }
        }
    }
    if (l->n_workers > 0) {
        nb_status st = start_workers(l, opts->prefetch_batches);
        if (st != NB_OK) {
            nb_loader_free(l);
            return st;
        }
    }
    restart(l, epoch, 0);
    *out = l;
    return NB_OK;
}

NB__HANDLE_GETTER(int64_t, nb_loader_len, const nb_loader, l, "loader", l->base + l->n_batches)

void nb_loader_position(const nb_loader *l, int64_t *epoch, int64_t *batch) {
    NB__CHECK_HANDLE("nb_loader_position", l, "loader");
    if (epoch) *epoch = l->epoch;
    if (batch) *batch = l->base + l->consumed;
}

nb_status nb_loader_seek(nb_loader *l, int64_t epoch, int64_t batch) {
    NB__CHECK_HANDLE("nb_loader_seek", l, "loader");
    if (epoch < 0)
        return nb_set_error(NB_ERR_INVALID, "nb_loader_seek: epoch %lld is negative", (long long)epoch);
    /* the bounds are those of the epoch sought, as the sampler deals it now */
    epoch_order fresh = {0}, *target = NULL;
    int64_t end = l->base + l->n_batches;
    if (list_stale(l, epoch)) {
        fresh = make_order(l, epoch);
        target = &fresh;
        end = fresh.base + fresh.n_batches;
    }
    if (batch < 0 || batch > end) {
        if (target) {
            free(fresh.list);
            nb_sampler_set_epoch(l->sampler, l->epoch); /* make_order moved it */
        }
        return nb_set_error(NB_ERR_INVALID, "nb_loader_seek: batch %lld is not in [0, %lld] (batches per "
                            "epoch)", (long long)batch, (long long)end);
    }
    if (!target && (batch > l->base ? batch - l->base : 0) == l->consumed) return NB_OK;
    restart_with(l, epoch, batch, target);
    return NB_OK;
}

void nb_loader_set_epoch(nb_loader *l, int64_t epoch) {
    NB__CHECK_HANDLE("nb_loader_set_epoch", l, "loader");
    if (epoch != l->epoch) restart(l, epoch, 0);
}

static nb_status batch_error(const nb_loader *l, nb_status st, int64_t failed, const char *msg) {
    return nb_set_error(st, "nb_loader_next: sample %lld (batch %lld of epoch %lld, %s dataset): "
                        "%s", (long long)failed, (long long)(l->base + l->consumed), (long long)l->epoch,
                        nb_dataset_name(l->ds), msg);
}

/* The slot's device buffers -> the batch's tensors, on the compute stream
 * after the slot's copy (Note [Loader to CUDA]). */
static void take_from_device(const nb_loader *l, slot *s, nb_batch *b, int64_t size) {
    int dev = l->device.index;
    const nb__backend *be = l->be;
    be->use("nb_loader_next", dev);
    nb__stream compute = be->compute_stream(dev);
    be->stream_wait(compute, s->copied);
    if (size > 0) {
        be->memcpy_d2d(dev, b->inputs->data, s->d_inputs, (size_t)size * l->in_bytes);
        be->memcpy_d2d(dev, b->targets->data, s->d_targets, (size_t)size * l->tgt_bytes);
    }
    be->event_record(s->consumed, compute);
}

/* The batch's tensors and index copy in ctx. */
static void make_batch(const nb_loader *l, nb_ctx *ctx, int64_t size, nb_batch *b) {
    int64_t shape[NB_MAX_DIMS];
    shape[0] = size;
    for (int d = 0; d < l->in.ndim; d++) shape[1 + d] = l->in.shape[d];
    b->inputs = nb_empty(ctx, l->in.dtype, 1 + l->in.ndim, shape);
    for (int d = 0; d < l->tgt.ndim; d++) shape[1 + d] = l->tgt.shape[d];
    b->targets = nb_empty(ctx, l->tgt.dtype, 1 + l->tgt.ndim, shape);
    b->indices = l->staged ? nb__ctx_meta(ctx, sizeof(int64_t) * (size_t)size)
                         : nb_ctx_alloc(ctx, sizeof(int64_t) * (size_t)size, 0);
    memcpy(b->indices, l->list + l->consumed * l->batch_size, sizeof(int64_t) * (size_t)size);
    b->size = size;
    b->epoch = l->epoch;
    b->index = l->base + l->consumed;
}

nb_status nb_loader_next(nb_loader *l, nb_ctx *ctx, nb_batch *batch) {
    NB__CHECK_HANDLE("nb_loader_next", l, "loader");
    NB_CHECK(nb_device_eq(nb_ctx_device(ctx), l->device), "nb_loader_next: context on %s, "
             "the loader makes batches on %s", nb_device_name(nb_ctx_device(ctx)),
             nb_device_name(l->device));
    memset(batch, 0, sizeof *batch);
    if (l->consumed >= l->n_batches) {
        batch->epoch = l->epoch;
        batch->index = l->base + l->consumed;
        restart(l, l->epoch + 1, 0);
        return NB_OK;
    }
    int64_t k = l->consumed, size = batch_len(l, k);
    if (l->staged && l->n_threads == 0) {
        slot *s = &l->stage;
        char msg[1024];
        int64_t failed = -1;
        l->be->event_wait(s->copied);
        nb_status st = fill_batch(l, l->list + k * l->batch_size, size, s->inputs, s->targets,
                                  &failed, msg, sizeof msg);
        if (st != NB_OK) return batch_error(l, st, failed, msg);
        stage_to_device(l, s, size);
        make_batch(l, ctx, size, batch);
        take_from_device(l, s, batch, size);
        l->consumed++;
        return NB_OK;
    }
    if (l->n_threads == 0) {
        char msg[1024];
        int64_t failed = -1;
        nb_batch b;
        make_batch(l, ctx, size, &b);
        nb_status st = fill_batch(l, l->list + k * l->batch_size, size, b.inputs->data,
                                  b.targets->data, &failed, msg, sizeof msg);
        if (st != NB_OK) return batch_error(l, st, failed, msg);
        *batch = b;
        l->consumed++;
        return NB_OK;
    }
    slot *s = &l->slots[k % l->n_slots];
    pthread_mutex_lock(&l->mu);
    while (!(s->state == SLOT_READY && s->batch == k)) pthread_cond_wait(&l->ready_cv, &l->mu);
    pthread_mutex_unlock(&l->mu);
    if (s->status != NB_OK) return batch_error(l, s->status, s->failed_index, s->message);
    make_batch(l, ctx, size, batch);
    if (l->staged) {
        take_from_device(l, s, batch, size);
    } else {
        memcpy(batch->inputs->data, s->inputs, (size_t)size * l->in_bytes);
        memcpy(batch->targets->data, s->targets, (size_t)size * l->tgt_bytes);
    }
    pthread_mutex_lock(&l->mu);
    s->state = SLOT_FREE;
    l->consumed++;
    pthread_cond_signal(&l->work_cv); /* one more batch may be claimed: one worker */
    pthread_mutex_unlock(&l->mu);
    return NB_OK;
}
