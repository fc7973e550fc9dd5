/* Internal interface shared by the files of data/. Not installed. */
#ifndef NABLA_DATA_INTERNAL_H
#define NABLA_DATA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "nabla/dataset.h"
#include "nabla/loader.h"
#include "nabla/sampler.h"

/* A uniformly random permutation of 0..n-1, a pure function of (n, seed):
 * Note [Permutations] in data/randperm.c. */
void nb__randperm(int64_t *out, int64_t n, uint64_t seed);

/* Changes whenever the sampler's order of some epoch changes after it was
 * made (nb_sampler_distributed_resume): the loader then recomputes its list. */
uint64_t nb__sampler_version(const nb_sampler *s);

/* Indices per rank of the sampler's current epoch that count as taken
 * before a resume (nb_sampler_distributed_resume): floor(taken / R) for
 * the resumed epoch of a distributed sampler, 0 otherwise. The loader
 * counts its batches of that epoch from there: Note [Batches of a resumed
 * epoch] in data/loader.c. */
int64_t nb__sampler_skipped(const nb_sampler *s);

/* The whole file into a malloc'ed buffer (one extra byte, set to 0, after
 * the end). NB_ERR_IO naming the path on failure. */
nb_status nb__read_file(const char *path, char **data, size_t *size);

/* nb_dataset_open_csv on the file's bytes buf[0, size), which must be
 * malloc'ed with a spare byte after them (nb__read_file's buffer); takes
 * buf and frees it. `path` names the file in messages. The fuzz target
 * fuzz/fuzz_csv.c calls it. */
nb_status nb__csv_parse(nb_dataset **out, const char *path, char *buf, size_t size,
                        const nb_csv_options *opts);

/* A dataset's rows held in memory (nb_dataset_from_tensors, CSV tables):
 * sample i is bytes [i * in_bytes, (i + 1) * in_bytes) of inputs and
 * likewise of targets, both malloc'ed; nb__rows_len, _get and _free are
 * the functions of a vtable over it (data/dataset_tensor.c). */
typedef struct nb__rows {
    int64_t n;
    size_t in_bytes, tgt_bytes; /* per sample */
    char *inputs, *targets;
} nb__rows;
int64_t nb__rows_len(void *self);
nb_status nb__rows_get(void *self, int64_t i, void *input, void *target);
void nb__rows_free(void *self); /* NULL is fine */

/* ds's `self` when it was made with vtable `vt`, else NULL. */
void *nb__dataset_self(const nb_dataset *ds, const nb_dataset_vtable *vt);

/* Sample `index` without the range check (the loader checks every index
 * of an epoch once, on the caller's thread). */
nb_status nb__dataset_get(const nb_dataset *ds, int64_t index, void *input, void *target);

/* Aborts naming `op` unless `f` is a valid field. */
void nb__check_field(const char *op, const char *which, const nb_field *f);

/* Windows of seq_len + 1 tokens starting every `stride` tokens in a stream
 * of n tokens (each window gives x = its first T, y = its last T). */
static inline int64_t nb__window_count(int64_t n, int64_t seq_len, int64_t stride) {
    return n >= seq_len + 1 ? (n - seq_len - 1) / stride + 1 : 0;
}

#endif
