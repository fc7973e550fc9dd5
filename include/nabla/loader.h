/* The dataloader: batches of a dataset, in a sampler's order, collated into
 * contiguous tensors, fetched by worker threads ahead of use.
 *
 * Each call to nb_loader_next returns the next batch as two new tensors in
 * the caller's context, inputs (b, input shape...) and targets (b, target
 * shape...), b = batch_size except perhaps the last batch of an epoch.
 * They live as long as that context (until its reset), like any tensor.
 *
 * Order: batch k of epoch e holds the samples the batch sampler puts there,
 * whatever the number of workers; with workers, batches are assembled in
 * loader-owned buffers (a bounded queue of prefetch_batches) and copied
 * into the context when the caller takes them.
 *
 * Position: (epoch, batch) = the epoch being read and how many of its
 * batches the caller has taken. Saving it and calling nb_loader_seek with
 * it in a new process gives exactly the batches the first process would
 * have seen next. When an epoch's batches are exhausted, nb_loader_next
 * reports the end once and the position moves to (epoch + 1, 0).
 * Batches are numbered from the start of the epoch, also in an epoch
 * resumed part way at another world size (nb_sampler_distributed_resume):
 * there the batches before the resume point count as taken, so the first
 * batch the loader gives is batch base = floor(taken / (R B)) (R the
 * sampler's world size, B the batch size), nb_batch.index and the
 * position go on from there, and a seek below base starts at the resume
 * point. The position then means what it means in an epoch never
 * interrupted, rounded down to a whole batch when `taken` is not a
 * multiple of R B; the exact point in such an epoch is the sample count,
 * nb_sampler_distributed_taken(sampler, (batch - base) * B). Note [Batches
 * of a resumed epoch] in data/loader.c.
 *
 * Errors: a failing get in a worker reaches the caller of nb_loader_next
 * as that status, with a message naming the sample index. The loader does
 * not move past a failed batch; nb_loader_seek can skip it.
 *
 * Devices: the batch tensors are made on the context's device, which must
 * be the loader's `device`. For a CUDA device, batches are collated on the
 * host (in pinned memory with pin_memory, else pageable), copied
 * asynchronously on the device's copy stream into a ring of device
 * buffers owned by the loader (the workers start the copy as soon as a
 * batch is collated), and copied into the caller's context on the compute
 * stream, which first waits for that copy: nb_loader_next does not block
 * on the transfer, and the batch is ready for every op queued after it.
 * Note [Loader to CUDA] in data/loader.c has the ordering. */
#ifndef NABLA_LOADER_H
#define NABLA_LOADER_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/context.h"
#include "nabla/dataset.h"
#include "nabla/error.h"
#include "nabla/sampler.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_loader nb_loader;

typedef struct nb_loader_options {
    int64_t batch_size;   /* > 0 */
    bool drop_last;       /* drop the epoch's last batch when it is short */
    nb_sampler *sampler;  /* borrowed; NULL: sequential, or random when shuffle */
    bool shuffle;         /* only without a sampler */
    uint64_t seed;        /* for shuffle */
    int num_workers;      /* 0: batches are made by the caller's thread */
    int prefetch_batches; /* queue capacity with workers; 0: 2 per worker */
    nb_device device;     /* where batches go; zero-initialised: the CPU */
    bool pin_memory;      /* page-locked staging buffers for CUDA targets; no effect on the CPU */
} nb_loader_options;

typedef struct nb_batch {
    nb_tensor *inputs;  /* (b, ...); NULL at the end of an epoch */
    nb_tensor *targets; /* (b, ...) */
    int64_t size;       /* b; 0 at the end of an epoch */
    int64_t epoch;      /* position of this batch */
    int64_t index;
    int64_t *indices;   /* the b dataset indices, in the same context */
} nb_batch;

/* `ds` is retained; a given sampler is borrowed (it must outlive the
 * loader, and the loader sets its epoch). The position starts at
 * (nb_sampler_epoch(sampler) or 0, 0). Errors: a device that is not there
 * (a CUDA device in a build without CUDA, or not visible:
 * NB_ERR_UNSUPPORTED), threads or memory that cannot be had
 * (NB_ERR_INTERNAL, NB_ERR_NOMEM). */
NB_API nb_status nb_loader_new(nb_loader **out, nb_dataset *ds, const nb_loader_options *opts);
/* Stops and joins every worker, whatever state they are in. NULL is fine. */
NB_API void nb_loader_free(nb_loader *l);

/* The next batch into `ctx`, or the end of the epoch (batch->inputs NULL,
 * NB_OK). On error, the status of the failing get and a message
 * "nb_loader_next: sample I (batch K of epoch E): ..." */
NB_API nb_status nb_loader_next(nb_loader *l, nb_ctx *ctx, nb_batch *batch);

/* Batches in the current epoch: the same every epoch, except one resumed part way
 * (nb_sampler_distributed_resume), whose length is base (the batches before
 * the resume point, see Position above) plus the batches left: the position
 * at which it ends. */
NB_API int64_t nb_loader_len(const nb_loader *l);
NB_API void nb_loader_position(const nb_loader *l, int64_t *epoch, int64_t *batch);
/* Continues from (epoch, batch), epoch >= 0 and 0 <= batch <= that epoch's len
 * (a batch below a resumed epoch's base: its resume point); work
 * prefetched for another position is dropped. Seeking to the current
 * position keeps it. A position outside those bounds (one read from a
 * checkpoint of another dataset or batch size, say) is NB_ERR_INVALID with
 * the bounds in nb_last_error(), and the loader stays where it was. */
NB_API NB_MUST_CHECK nb_status nb_loader_seek(nb_loader *l, int64_t epoch, int64_t batch);
/* Starts epoch `epoch` at its first batch, unless the position is already
 * in that epoch (so that a resumed run's epoch loop may call it). */
NB_API void nb_loader_set_epoch(nb_loader *l, int64_t epoch);

#ifdef __cplusplus
}
#endif
#endif
