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
 * file's), then state is filled in from the metadata. `path` may be the
 * index of a sharded checkpoint of any world size (below): each tensor is
 * then read whole from the shards that hold it. With opt NULL the
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

/* ---- sharded checkpoints (docs/checkpoints.md, "Sharded checkpoints") ----
 * Each rank writes its pieces of the state to a shard file of its own;
 * then rank 0 writes one index, which names every tensor's shape and dtype
 * and which shard holds which element range, with the metadata of the
 * checkpoint. The index is what makes the checkpoint exist: written
 * atomically after every shard is durable, it replaces the previous one
 * in one step. It is a safetensors file without tensors, so
 * nb_checkpoint_open and nb_checkpoint_meta read its metadata as any
 * checkpoint's, and nb_checkpoint_load_training loads it (reading each
 * tensor from the shards that hold it) at any world size. Note [Sharded
 * checkpoint] in checkpoint/sharded.c. */

/* A piece of a tensor: elements [start, start + numel(data)) of the
 * tensor `name` of shape shape[0..ndim), in row-major order. data has
 * the whole tensor's dtype, any shape and strides. `order` is the
 * tensor's place among the checkpoint's tensors: the pieces of all ranks
 * together cover each tensor exactly once, and tensors of the same name
 * agree on order, shape and dtype. */
typedef struct nb_checkpoint_piece {
    const char *name;
    int order;
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    int64_t start;
    nb_tensor *data;
} nb_checkpoint_piece;

/* The shard file of `rank` (of `world`) for the index `index_path`:
 * DIR/<save_id>.shards/rank<r>-of-<R>.safetensors, DIR the index's
 * folder; written atomically (nb_checkpoint_save). save_id names this save
 * (letters, digits, '.', '-', '_'; another for each save, so that a save
 * never writes over a file a standing index names); every rank passes the
 * same. NB_ERR_IO as nb_checkpoint_save. */
NB_API nb_status nb_checkpoint_save_shard(const char *index_path, const char *save_id, int rank, int world,
                                          const nb_checkpoint_piece *pieces, int n);
/* Rank 0, once every rank's nb_checkpoint_save_shard has returned NB_OK
 * (the caller's barrier): opens the world shards of save_id, checks that
 * their pieces cover every tensor exactly once, and writes the index at
 * index_path atomically with meta (then the keys "shard_dir" and
 * "shard_index"). NB_ERR_FORMAT or NB_ERR_NOT_FOUND naming the shard file
 * at fault; the previous file at index_path is then untouched. */
NB_API nb_status nb_checkpoint_save_index(const char *index_path, const char *save_id, int world,
                                          const nb_kv *meta, int n_meta);
/* nb_checkpoint_save_index with the metadata nb_checkpoint_save_training
 * writes (state, the kind of opt or none, extra). */
NB_API nb_status nb_checkpoint_save_training_index(const char *index_path, const char *save_id, int world,
                                                   nb_optim *opt, const nb_train_state *state,
                                                   const nb_kv *extra, int n_extra);
/* Whether the open file ck is the index of a sharded checkpoint. */
NB_API bool nb_checkpoint_is_sharded(const nb_checkpoint *ck);

typedef struct nb_checkpoint_sharded nb_checkpoint_sharded;
/* Opens an index and every shard it names, checking each shard against
 * the index (its save, its size, the pieces it must hold): a missing,
 * truncated or foreign shard is NB_ERR_NOT_FOUND or NB_ERR_FORMAT naming
 * that file. *out is NULL on failure. */
NB_API nb_status nb_checkpoint_sharded_open(const char *path, nb_checkpoint_sharded **out);
NB_API void nb_checkpoint_sharded_close(nb_checkpoint_sharded *s); /* NULL is fine */
       /* The index, for its metadata (owned by s). */
       NB_API nb_checkpoint *nb_checkpoint_sharded_index(nb_checkpoint_sharded *s);
/* Tensors in checkpoint order; offset and nbytes are 0 and the size. */
NB_API int nb_checkpoint_sharded_count(const nb_checkpoint_sharded *s);
NB_API const nb_checkpoint_entry *nb_checkpoint_sharded_entry_at(const nb_checkpoint_sharded *s, int i);
NB_API int nb_checkpoint_sharded_shards(const nb_checkpoint_sharded *s);
/* Reads elements [start, start + numel(dst)) of tensor `name` (row-major)
 * into dst (any shape and strides; converted when the dtypes differ),
 * from whichever shards hold them: what a rank reads of the pieces it
 * owns at another world size. NaN and infinity are refused as in
 * nb_checkpoint_read, naming the shard file and the element. */
NB_API nb_status nb_checkpoint_sharded_read_range(nb_checkpoint_sharded *s, const char *name, int64_t start,
                                                  nb_tensor *dst);
/* The whole tensor (dst of its shape). */
NB_API nb_status nb_checkpoint_sharded_read(nb_checkpoint_sharded *s, const char *name, nb_tensor *dst);
NB_API void nb_checkpoint_sharded_set_allow_nonfinite(nb_checkpoint_sharded *s, bool allow);
/* Writes the ordinary single-file checkpoint of the sharded one at
 * index_path to out_path (atomically): the tensors in checkpoint order
 * and the index's metadata but "shard_dir" and "shard_index", so that a
 * training checkpoint saved sharded becomes, byte for byte, the file
 * nb_checkpoint_save_training writes from the same state. Holds the whole
 * state in memory once. */
NB_API nb_status nb_checkpoint_consolidate(const char *index_path, const char *out_path);

/* A program's --resume auto (Note [Resume auto] in checkpoint/latest.c):
 * the newest checkpoint in `dir` whose metadata has "program" = program
 * and a "step" count and whose every tensor reads (NaN and infinity
 * refused): the largest step, then the latest modified, among the regular
 * files *.safetensors. Each newer or damaged file passed over is said on
 * stderr ("<program>: --resume auto passes over <file>: <fault>"). *found
 * false: nothing to resume (no folder, or no checkpoint), *step -1. When
 * *.safetensors files are there and none can be resumed from,
 * NB_ERR_FORMAT naming each file and its fault, unless fresh_ok
 * (--resume auto-or-fresh: *found false). NB_ERR_IO when dir exists but
 * cannot be read. Every rank of a run must choose the same file: compare
 * *step over the ranks. */
NB_API nb_status nb_checkpoint_find_latest(const char *dir, const char *program, bool fresh_ok, char *path,
                                           size_t cap, bool *found, int64_t *step);
/* Before rank 0 saves DIR/ckpt.safetensors again: keeps the file it is
 * about to replace, when it is a valid checkpoint of `program` with a
 * "step", as DIR/ckpt.step<N>.safetensors (a hard link), and removes the
 * oldest of those beyond keep - 1, so that the folder holds the newest
 * `keep` and nb_checkpoint_find_latest has an older one to fall back to
 * when the newest is damaged (Note [Kept checkpoints] in
 * checkpoint/latest.c). keep < 2 keeps none. NB_ERR_IO naming the file or
 * folder when a link or the folder's listing fails. */
NB_API nb_status nb_checkpoint_keep(const char *dir, const char *program, int keep);

#ifdef __cplusplus
}
#endif
#endif
