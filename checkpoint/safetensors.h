/* The safetensors header: parsing and validation, shared by the reader,
 * the fuzz targets and the tests; and the writer's fault hook for tests.
 * Not installed. */
#ifndef NABLA_CHECKPOINT_SAFETENSORS_H
#define NABLA_CHECKPOINT_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/json.h"
#include "nabla/checkpoint.h"

typedef struct nb__st_header {
    nb_json_doc *doc;             /* owns every string below */
    nb_checkpoint_entry *entries; /* in data order */
    int n;
    int *by_name;                 /* entry indices sorted by name */
    nb_kv *meta;
    int n_meta;
} nb__st_header;

/* Parses the JSON header json[0, len) of a file whose data section starts
 * at byte data_start and holds data_bytes bytes, and checks it: known
 * dtypes, shapes that match their offsets, tensors back to back from 0 to
 * data_bytes, unique names, string metadata. Messages start with `where`
 * (the file name). On failure *out is zeroed. */
nb_status nb__st_parse_header(const char *json, size_t len, uint64_t data_start,
                              uint64_t data_bytes, const char *where, nb__st_header *out);
void nb__st_header_free(nb__st_header *h);
/* Fills h->by_name (allocated, h->n entries) from h->entries; a name
 * that appears twice is NB_ERR_FORMAT naming it, after `where`. */
nb_status nb__st_sort_names(nb__st_header *h, const char *where);
/* Index of the entry named `name`, or -1. */
int nb__st_find(const nb__st_header *h, const char *name);

/* nb_checkpoint_read_strict, except that file entries whose names start
 * with ignore_prefix (when not NULL) are neither loaded nor unexpected. */
nb_status nb__checkpoint_read_strict(nb_checkpoint *ck, const nb_named_tensor *tensors, int n,
                                     const char *ignore_prefix);

/* The strict check of nb__checkpoint_read_strict alone, against the
 * entries of h (a file's, or a sharded checkpoint's, named `path`):
 * NB_ERR_MISMATCH listing what is missing, unexpected or of another shape
 * or dtype; NB_OK when the tensors can be read. */
nb_status nb__checkpoint_match(const char *path, const nb__st_header *h, const nb_named_tensor *tensors,
                               int n, const char *ignore_prefix);

/* Reads elements [first, first + count) of the entry named `name` (in the
 * file's dtype, row-major) into host memory buf, with the value checks of
 * a whole read (Note [Values checked at load]). The elements are
 * [whole_first, whole_first + count) of `whole` (a sharded checkpoint's
 * tensor, for messages and the second-moment check; NULL: the entry). */
nb_status nb__checkpoint_read_elements(nb_checkpoint *ck, const char *name, int64_t first, int64_t count,
                                       void *buf, const nb_checkpoint_entry *whole, int64_t whole_first);

/* Copies host memory buf, dst's elements row-major in `dtype`, into dst
 * (any strides and device; converted). */
void nb__checkpoint_copy_in(nb_tensor *dst, nb_dtype dtype, void *buf);

/* nb__checkpoint_read_strict on a sharded checkpoint (sharded.c), with
 * the reads' checks set first. */
nb_status nb__checkpoint_sharded_read_strict(nb_checkpoint_sharded *s, const nb_named_tensor *tensors, int n,
                                             const char *ignore_prefix, bool allow_nonfinite, bool second_moments);

/* Makes the reads of ck require Adam's second moments ("optim.state.*
 * exp_avg_sq") to be >= 0 (Note [Values checked at load] in reader.c). */
void nb__checkpoint_set_second_moments(nb_checkpoint *ck, bool on);

/* Aborts (naming `who`) on a NULL name or tensor, or two equal names,
 * after freeing free_on_abort (the caller's allocation, or NULL), so that
 * a test that recovers from the abort leaks nothing. */
void nb__checkpoint_check_targets(const char *who, const nb_named_tensor *tensors, int n,
                                  void *free_on_abort);

/* The folder part of path, malloc'ed ("." when there is none; NULL when
 * out of memory). */
char *nb__st_dir_of(const char *path);

/* "F32", "BF16", ...: the format's dtype names. */
const char *nb__st_dtype_name(nb_dtype dtype);
/* The dtype so named, or -1. */
int nb__st_dtype_parse(const char *name);

/* `name`, shortened and with control characters replaced, for messages. */
const char *nb__st_quote(const char *name, char *buf, size_t n);

/* Test hook: while set, the writer calls fn before each write with the
 * file offset and size of the write; a true return makes that write fail
 * as an I/O error would (EIO). Per thread. */
typedef bool (*nb__st_fault_fn)(uint64_t offset, size_t bytes, void *user);
void nb__st_set_fault(nb__st_fault_fn fn, void *user);

#endif
