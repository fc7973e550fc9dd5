/* Samplers: which dataset indices an epoch visits, in which order.
 *
 * A sampler's order is a pure function of its settings and its epoch, so a
 * run that resumes at (epoch, batch) sees the same indices as one that
 * never stopped. Shuffling samplers draw one permutation from a Philox
 * stream seeded with seed + epoch (Note [Permutations] in data/randperm.c).
 *
 * The distributed sampler follows PyTorch's DistributedSampler: every rank
 * computes the same permutation of N indices; without drop_last the list is
 * padded to total = ceil(N / R) * R by repeating it from its start (as many
 * times as needed), with drop_last it is cut to total = floor(N / R) * R;
 * rank r then takes list[r], list[r + R], ... (total / R indices).
 *
 * Exact evaluation uses nb_sampler_shard instead: no padding and no drop,
 * rank r takes r, r + R, ... of 0..N-1, so shard sizes differ by at most one
 * and each sample is counted once; reduce metrics with nb_metric_sums. */
#ifndef NABLA_SAMPLER_H
#define NABLA_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_sampler nb_sampler;

/* For user-defined samplers. */
typedef struct nb_sampler_vtable {
    const char *name;
    int64_t (*len)(void *self); /* indices per epoch, the same every epoch */
    /* Writes the epoch's len() indices; a pure function of (self, epoch). */
    void (*indices)(void *self, int64_t epoch, int64_t *out);
    void (*free)(void *self); /* may be NULL */
} nb_sampler_vtable;

NB_API nb_sampler *nb_sampler_new(const nb_sampler_vtable *vt, void *self);
NB_API void nb_sampler_free(nb_sampler *s); /* NULL is fine */

/* 0, 1, ..., n-1 every epoch. */
NB_API nb_sampler *nb_sampler_sequential(int64_t n);
/* A permutation of 0..n-1 (without replacement), new for each epoch. */
NB_API nb_sampler *nb_sampler_random(int64_t n, uint64_t seed);

typedef struct nb_distributed_options {
    int world_size; /* R >= 1 */
    int rank;       /* 0 <= rank < R */
    bool shuffle;
    uint64_t seed;  /* the same on every rank */
    bool drop_last;
} nb_distributed_options;
NB_API nb_sampler *nb_sampler_distributed(int64_t n, const nb_distributed_options *opts);
/* The position in an epoch as one number, whatever the world size: the
 * global count of positions of the epoch's list already taken (k per rank
 * is kR). nb_sampler_distributed_taken(s, k) is that count once every rank
 * has taken k indices of the current epoch; nb_sampler_distributed_resume(s,
 * epoch, taken) makes `epoch` deal only the positions from `taken` on, to
 * the sampler's own world size: rank r takes taken + r, taken + r + R, ...,
 * floor(m / R) of them with drop_last and ceil(m / R) without (m = n -
 * taken samples left; padding wraps to the list's start), so that an epoch
 * begun at one world size ends at another with no sample taken twice and
 * none skipped but a tail of fewer than R with drop_last (Note [Resuming at
 * another world size] in data/sampler.c). Other epochs are unchanged; a
 * loader using the sampler notices at its next seek. Both abort on a
 * sampler that is not distributed. */
NB_API void nb_sampler_distributed_resume(nb_sampler *s, int64_t epoch, int64_t taken);
NB_API int64_t nb_sampler_distributed_taken(const nb_sampler *s, int64_t per_rank);

/* Exact evaluation: rank's share of 0..n-1, unpadded (see above). */
NB_API nb_sampler *nb_sampler_shard(int64_t n, int world_size, int rank);

NB_API int64_t nb_sampler_len(const nb_sampler *s);
NB_API void nb_sampler_set_epoch(nb_sampler *s, int64_t epoch);
NB_API int64_t nb_sampler_epoch(const nb_sampler *s);
/* The current epoch's nb_sampler_len() indices. */
NB_API void nb_sampler_indices(const nb_sampler *s, int64_t *out);

/* ---- batches ---- */
typedef struct nb_batch_sampler nb_batch_sampler;

/* Groups `sampler`'s indices (borrowed) into batches of `batch_size`; the
 * last, smaller batch is dropped when drop_last. */
NB_API nb_batch_sampler *nb_batch_sampler_new(nb_sampler *sampler, int64_t batch_size,
                                              bool drop_last);
NB_API void nb_batch_sampler_free(nb_batch_sampler *bs);
/* Batches per epoch: floor(len / B) with drop_last, else ceil(len / B). */
NB_API int64_t nb_batch_sampler_len(const nb_batch_sampler *bs);
/* Number of batches of `batch_size` that `n` indices make. */
NB_API int64_t nb_batch_count(int64_t n, int64_t batch_size, bool drop_last);
/* Sets the sampler's epoch. */
NB_API void nb_batch_sampler_set_epoch(nb_batch_sampler *bs, int64_t epoch);
/* Batch k (0 <= k < len) of the sampler's current epoch into out[0..B);
 * returns its size. */
NB_API int64_t nb_batch_sampler_get(nb_batch_sampler *bs, int64_t k, int64_t *out);

/* ---- exact metric reduction ----
 * Sums and a sample count, all doubles so that the whole struct reduces as
 * one f64 sum over ranks: all-reduce nb_metric_sums_data(m) (length
 * nb_metric_sums_size(m)) with SUM, or merge structs in one process. The
 * count is exact up to 2^53 samples. */
#define NB_METRIC_MAX 8
typedef struct nb_metric_sums {
    int n;                          /* metrics in use */
    double v[1 + NB_METRIC_MAX];    /* v[0] = count, v[1 + k] = sum of metric k */
} nb_metric_sums;

NB_API void nb_metric_sums_init(nb_metric_sums *m, int n_metrics);
/* Adds a batch: `sums[k]` summed over its `count` samples. */
NB_API void nb_metric_sums_add(nb_metric_sums *m, const double *sums, int64_t count);
NB_API void nb_metric_sums_merge(nb_metric_sums *dst, const nb_metric_sums *src);
NB_API double *nb_metric_sums_data(nb_metric_sums *m);
NB_API int nb_metric_sums_size(const nb_metric_sums *m); /* 1 + n */
NB_API double nb_metric_sums_count(const nb_metric_sums *m);
NB_API double nb_metric_sums_mean(const nb_metric_sums *m, int k); /* sum_k / count (NaN if 0) */

#ifdef __cplusplus
}
#endif
#endif
