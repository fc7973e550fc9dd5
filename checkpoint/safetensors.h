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
/* Index of the entry named `name`, or -1. */
int nb__st_find(const nb__st_header *h, const char *name);

/* nb_checkpoint_read_strict, except that file entries whose names start
 * with ignore_prefix (when not NULL) are neither loaded nor unexpected. */
nb_status nb__checkpoint_read_strict(nb_checkpoint *ck, const nb_named_tensor *tensors, int n,
                                     const char *ignore_prefix);

/* Makes the reads of ck require Adam's second moments ("optim.state.*
 * exp_avg_sq") to be >= 0 (Note [Values checked at load] in reader.c). */
void nb__checkpoint_set_second_moments(nb_checkpoint *ck, bool on);

/* Aborts (naming `who`) on a NULL name or tensor, or two equal names,
 * after freeing free_on_abort (the caller's allocation, or NULL), so that
 * a test that recovers from the abort leaks nothing. */
void nb__checkpoint_check_targets(const char *who, const nb_named_tensor *tensors, int n,
                                  void *free_on_abort);

/* "F32", "BF16", ...: the format's dtype names. */
const char *nb__st_dtype_name(nb_dtype dtype);

/* `name`, shortened and with control characters replaced, for messages. */
const char *nb__st_quote(const char *name, char *buf, size_t n);

/* Test hook: while set, the writer calls fn before each write with the
 * file offset and size of the write; a true return makes that write fail
 * as an I/O error would (EIO). Per thread. */
typedef bool (*nb__st_fault_fn)(uint64_t offset, size_t bytes, void *user);
void nb__st_set_fault(nb__st_fault_fn fn, void *user);

#endif
