/* Datasets: a fixed number of samples, each an (input, target) pair of
 * fixed shapes, fetched by index into caller memory.
 *
 * A dataset is an opaque handle over a small vtable, so that a program can
 * define its own (docs/data.md walks through one). Built in: in-memory
 * tensors, CSV tables, token shards in llm.c's format, the bytes of a text
 * file, index subsets and a seeded train/test split, and standardisation
 * fitted on one dataset and applied to others.
 *
 * Sharing: nb_dataset_get may be called from several threads at once (the
 * dataloader's workers do), so a `get` function must not modify shared
 * state without its own locking, and must give the same bytes for the same
 * index every time (the loader's order and its resume rely on it).
 * Creating and freeing datasets is single-threaded.
 *
 * Ownership: datasets are reference counted. A dataset made from another
 * (subset, split, standardize) holds a reference to it, so the caller may
 * free its own handle at any time; nb_dataset_free drops one reference. */
#ifndef NABLA_DATASET_H
#define NABLA_DATASET_H

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

/* dtype and shape of one sample's input or target; a batch of b samples
 * has shape (b, shape...), hence at most NB_MAX_DIMS - 1 dims here. */
typedef struct nb_field {
    nb_dtype dtype;
    int ndim; /* 0: a scalar */
    int64_t shape[NB_MAX_DIMS - 1];
} nb_field;

/* nb_field_of(NB_F32, NB_SHAPE(30)); nb_field_of(NB_I64, 0, NULL) for a scalar. */
NB_API nb_field nb_field_of(nb_dtype dtype, int ndim, const int64_t *shape);
NB_API int64_t nb_field_numel(const nb_field *f);
NB_API size_t nb_field_bytes(const nb_field *f);

typedef struct nb_dataset nb_dataset;

/* What a dataset implements. `self` is the pointer given to nb_dataset_new. */
typedef struct nb_dataset_vtable {
    const char *name; /* "csv", "my_dataset": for messages */
    int64_t (*len)(void *self);
    /* Writes sample `index` (0 <= index < len, checked by the caller) into
     * `input` and `target`, nb_field_bytes() of each, suitably aligned for
     * the dtype. On failure returns a status after nb_set_error(). */
    nb_status (*get)(void *self, int64_t index, void *input, void *target);
    void (*free)(void *self); /* may be NULL */
} nb_dataset_vtable;

/* Wraps `self`; the dataset frees it with vt->free when the last reference
 * goes. `vt` must outlive the dataset (a static const table). */
NB_API nb_dataset *nb_dataset_new(const nb_dataset_vtable *vt, void *self, nb_field input,
                           nb_field target);
NB_API nb_dataset *nb_dataset_retain(nb_dataset *ds); /* returns ds */
NB_API void nb_dataset_free(nb_dataset *ds);          /* drops one reference; NULL is fine */

NB_API int64_t nb_dataset_len(const nb_dataset *ds);
NB_API nb_field nb_dataset_input(const nb_dataset *ds);
NB_API nb_field nb_dataset_target(const nb_dataset *ds);
NB_API const char *nb_dataset_name(const nb_dataset *ds);
/* Sample `index` into caller memory (an index out of range aborts). */
NB_API nb_status nb_dataset_get(const nb_dataset *ds, int64_t index, void *input, void *target);

/* ---- in memory ---- */
/* inputs (N, ...) and targets (N, ...) of any dtypes, copied: the tensors
 * and their context may go away afterwards. Sample i is row i of each. */
NB_API nb_dataset *nb_dataset_from_tensors(const nb_tensor *inputs, const nb_tensor *targets);

/* ---- CSV ---- */
#define NB_CSV_MAX_CLASSES (1 << 20)

typedef struct nb_csv_options {
    const char *label;     /* label column by header name; NULL: label_index */
    int label_index;       /* 0-based; negative counts from the end (-1: last) */
    nb_dtype label_dtype;  /* NB_I64 or NB_I32 (class indices), NB_F32 or NB_F64 */
    nb_dtype input_dtype;  /* NB_F32 or NB_F64 */
    int skip_lines;        /* lines skipped before the header (or the first row) */
    bool no_header;        /* no header line: columns are known by index only */
    char delimiter;
    bool allow_nonfinite;  /* accept nan and inf cells (refused by default) */
    /* Integer labels must be below it; 0: NB_CSV_MAX_CLASSES. A label of
     * 1e9 is refused naming its file:line:column, not turned into an
     * output layer of a billion rows. */
    int64_t max_classes;
    /* The shape of one sample's input, whose element count must be F, the
     * number of feature columns (e.g. 3, {1, 8, 8} for 8x8 images with one
     * channel); 0: flat, (F). Features fill it in file order, row-major. */
    int sample_ndim;
    int64_t sample_shape[NB_MAX_DIMS - 1];
} nb_csv_options;

/* label_index -1, label_dtype NB_I64, input_dtype NB_F32, delimiter ',',
 * non-finite values refused, flat samples. */
NB_API nb_csv_options nb_csv_defaults(void);

/* A table of numbers: every column but the label is an input feature, in
 * file order (input shape (F), or sample_shape), the label is the target
 * (a scalar). Blank lines are skipped; "\r\n" line ends are accepted;
 * cells are numbers as strtod reads them, surrounded by optional spaces.
 * opts NULL: defaults. Errors (the message names the file, line and
 * column): the file cannot be read (NB_ERR_IO); it is empty or has no data
 * rows, a row has the wrong number of fields, a cell is not a number, a
 * cell is nan or infinite or overflows the dtype (unless allow_nonfinite),
 * a class label (integer label_dtype) is not an integer, is negative or is
 * not below max_classes,
 * sample_shape does not hold F values (NB_ERR_FORMAT); the label column
 * does not exist (NB_ERR_NOT_FOUND). */
NB_API nb_status nb_dataset_open_csv(nb_dataset **out, const char *path,
                                     const nb_csv_options *opts);

/* ---- token sequences ----
 * Sample i of a windowed token stream is the pair x = tok[s .. s+T),
 * y = tok[s+1 .. s+T+1) with s = i * stride: a next-token-prediction
 * example. Both are i64 of shape (T). */

/* llm.c's shard format: a header of 256 little-endian int32 (magic
 * 20240520, version 1, token count n), then n little-endian uint16 tokens.
 * `pattern` is a file name or a glob ("train_*.bin"); matching files are
 * taken in sorted order, and windows never cross a file boundary.
 * stride 0 means T (windows that do not overlap). vocab_size > 0: every
 * token of every file is checked to be below it when the files are opened
 * (the model's embedding has that many rows); 0: not checked. Errors: no
 * file matches (NB_ERR_NOT_FOUND); a file cannot be read (NB_ERR_IO); a
 * wrong magic or version, a truncated header or body, a token id >=
 * vocab_size, or fewer than T + 1 tokens in all (NB_ERR_FORMAT), the
 * message naming the file and byte offset. The files stay open and each
 * window is read when it is fetched: a file truncated after the open makes
 * that fetch fail with NB_ERR_IO naming the file and offset. */
NB_API nb_status nb_dataset_open_tokens(nb_dataset **out, const char *pattern, int64_t seq_len,
                                 int64_t stride, int64_t vocab_size);

/* Writes `tokens` as one shard in that format (for tests, benchmarks and
 * programs that tokenize). */
NB_API nb_status nb_tokens_write(const char *path, const uint16_t *tokens, int64_t n);

/* Character-level text: each byte of the file is one token. */
typedef enum nb_text_vocab {
    NB_TEXT_COMPACT = 0, /* ids 0..V-1 for the V distinct bytes present, in byte order */
    NB_TEXT_BYTES = 1    /* id = byte value, V = 256 */
} nb_text_vocab;

/* The whole file is read into memory. Errors: cannot read (NB_ERR_IO);
 * fewer than T + 1 bytes (NB_ERR_FORMAT). */
NB_API nb_status nb_dataset_open_text(nb_dataset **out, const char *path, int64_t seq_len,
                               int64_t stride, nb_text_vocab vocab);
/* Vocabulary size V of a text dataset; fills bytes[id] = the byte of
 * token id for id < V (bytes may be NULL). Aborts for other datasets. */
NB_API int nb_dataset_text_vocab(const nb_dataset *ds, uint8_t bytes[256]);

/* ---- subsets, splits, standardisation ---- */
/* Sample i is base sample indices[i] (copied; each in range). */
NB_API nb_dataset *nb_dataset_subset(nb_dataset *base, const int64_t *indices, int64_t n);

/* Partitions `ds` with a permutation seeded by `seed`: round(test_fraction
 * * N) samples go to *test, the rest to *train, each subset keeping the
 * base order. test_fraction in [0, 1]. */
NB_API void nb_dataset_split(nb_dataset *ds, double test_fraction, uint64_t seed,
                             nb_dataset **train,
                      nb_dataset **test);

/* Per-element mean and standard deviation (population, divisor N) of the
 * inputs over all samples of `ds`, into arrays of nb_field_numel(input)
 * doubles; a zero deviation is reported as 1 so that it divides safely.
 * Fit it on the training split only. Fails only when a get fails. */
NB_API nb_status nb_dataset_fit_standardizer(const nb_dataset *ds, double *mean, double *std);

/* A dataset whose inputs are (x - mean) / std elementwise (float inputs;
 * arrays copied); targets unchanged. */
NB_API nb_dataset *nb_dataset_standardize(nb_dataset *base, const double *mean, const double *std);

#ifdef __cplusplus
}
#endif
#endif
