/* Checkpoints in the safetensors format.
 *
 * A file is: an 8-byte little-endian unsigned header length N; N bytes of
 * UTF-8 JSON, an object mapping each tensor name to
 * {"dtype": "F32"|"F64"|"BF16"|"F16"|"I32"|"I64", "shape": [...],
 * "data_offsets": [begin, end]} plus an optional "__metadata__" object of
 * string values; then the data section, each tensor's elements row-major
 * little-endian in [begin, end) of it, tensors back to back. docs/checkpoints.md
 * has the layout and the metadata keys nabla writes.
 *
 * Saving is atomic: the file is written under a temporary name in the same
 * directory, flushed, fsynced and renamed over `path`, then the directory
 * is fsynced; a failed or interrupted save leaves the previous file as it
 * was. Loading refuses, with an nb_status and a message naming the file
 * and the problem, anything that is not a well-formed file (truncation,
 * header lengths past the end of the file or above 100 MB, malformed JSON,
 * unknown dtypes, offsets that do not match the shapes, overlap, or leave
 * gaps), and never reads outside the file. */
#ifndef NABLA_CHECKPOINT_H
#define NABLA_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/error.h"
#include "nabla/optim.h"
#include "nabla/random.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest header accepted when reading (the limit of the reference
 * implementation). */
#define NB_CHECKPOINT_MAX_HEADER 100000000u

/* A metadata entry: UTF-8 strings. */
typedef struct nb_kv {
    const char *key;
    const char *value;
} nb_kv;

/* ---- whole files ---- */
/* Writes the tensors (any strides, any device) and metadata to `path` atomically,
 * making the folders missing above it first (mkdir -p, mode 0777 less the
 * umask). Names must be unique, valid UTF-8, and not "__metadata__";
 * metadata keys unique. Returns NB_ERR_IO with the file and the failing call. */
NB_API nb_status nb_checkpoint_save(const char *path, const nb_named_tensor *tensors, int n,
                             const nb_kv *meta, int n_meta);
/* Makes the folder `dir` and the ones missing above it, as a save would, and
 * checks that this process can write in it: for a program to refuse a
 * checkpoint folder at its start rather than at its first save. NB_ERR_IO
 * naming the folder and the reason. */
NB_API nb_status nb_checkpoint_make_dir(const char *dir);
/* Strict load into existing tensors: every name must be in the file with
 * the same shape and dtype, and the file must hold nothing else; otherwise
 * NB_ERR_MISMATCH with a message listing the missing keys, the unexpected
 * keys and the shape or dtype mismatches (nothing is written then). */
NB_API nb_status nb_checkpoint_load(const char *path, const nb_named_tensor *tensors, int n);

/* ---- reading ---- */
typedef struct nb_checkpoint nb_checkpoint;

typedef struct nb_checkpoint_entry {
    const char *name;
    nb_dtype dtype;
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    uint64_t offset; /* of the first byte, from the start of the file */
    uint64_t nbytes;
} nb_checkpoint_entry;

/* Opens and validates a file (header and layout; the data is read on
 * demand). *out is NULL on failure. */
NB_API nb_status nb_checkpoint_open(const char *path, nb_checkpoint **out);
NB_API void nb_checkpoint_close(nb_checkpoint *ck); /* NULL is fine */
NB_API const char *nb_checkpoint_path(const nb_checkpoint *ck);
/* Entries in file order. */
NB_API int nb_checkpoint_count(const nb_checkpoint *ck);
NB_API const nb_checkpoint_entry *nb_checkpoint_entry_at(const nb_checkpoint *ck, int i);
NB_API const nb_checkpoint_entry *nb_checkpoint_find(const nb_checkpoint *ck, const char *name);
/* Metadata in file order; nb_checkpoint_meta gives NULL for a missing key. */
NB_API int nb_checkpoint_meta_count(const nb_checkpoint *ck);
NB_API nb_kv nb_checkpoint_meta_at(const nb_checkpoint *ck, int i);
NB_API const char *nb_checkpoint_meta(const nb_checkpoint *ck, const char *key);
/* Reads one tensor into dst (same shape, any strides; converted when the
 * dtypes differ). NB_ERR_NOT_FOUND, NB_ERR_MISMATCH or NB_ERR_IO. */
NB_API nb_status nb_checkpoint_read(nb_checkpoint *ck, const char *name, nb_tensor *dst);
/* nb_checkpoint_load on an open file. */
NB_API nb_status nb_checkpoint_read_strict(nb_checkpoint *ck, const nb_named_tensor *tensors,
                                           int n);
/* Reads of ck accept NaN and infinite values (refused by default: every
 * read then fails with NB_ERR_FORMAT naming the tensor and the element). */
NB_API void nb_checkpoint_set_allow_nonfinite(nb_checkpoint *ck, bool allow);

/* ---- training checkpoints ----
 * Model tensors under their own names, the optimizer's state under
 * "optim." (nb_optim_state), and these facts as metadata. */
typedef struct nb_train_state {
    int64_t step;          /* optimizer steps taken */
    int64_t epoch;
    int64_t data_position; /* batches of the current epoch already consumed */
    nb_rng rng;            /* a generator to restore, e.g. dropout's */
} nb_train_state;

/* opt may be NULL; extra metadata keys must not collide with nabla's
 * (format, nabla_version, step, epoch, data_position, rng_seed,
 * rng_offset, optimizer). */
NB_API nb_status nb_checkpoint_save_training(const char *path, const nb_named_tensor *model,
                                      int n_model, nb_optim *opt, const nb_train_state *state,
                                      const nb_kv *extra, int n_extra);
/* Strict load of model and optimizer (the optimizer's kind must match the
 * file's), then state is filled in from the metadata. With opt NULL the
 * file's "optim." tensors are ignored. A NaN or infinite value in a tensor,
 * or a negative Adam second moment (exp_avg_sq), is refused with
 * NB_ERR_FORMAT naming the tensor and the element. On failure the tensors'
 * contents are unspecified unless the message says nothing was read. */
NB_API nb_status nb_checkpoint_load_training(const char *path, const nb_named_tensor *model,
                                      int n_model, nb_optim *opt, nb_train_state *state);

typedef struct nb_checkpoint_load_options {
    bool allow_nonfinite; /* load NaN and infinite values (refused by default) */
} nb_checkpoint_load_options;

/* nb_checkpoint_load_training with options (NULL: the defaults, all zero). */
NB_API nb_status nb_checkpoint_load_training_ex(const char *path, const nb_named_tensor *model,
                                         int n_model, nb_optim *opt, nb_train_state *state,
                                         const nb_checkpoint_load_options *opts);

#ifdef __cplusplus
}
#endif
#endif
