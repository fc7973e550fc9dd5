/* libFuzzer target for the safetensors header checks (checkpoint/header.c).
 *
 * The input is a whole file held in memory: the same length and size
 * checks as nb_checkpoint_open, then nb__st_parse_header. An accepted
 * header must describe tensors that lie inside the input, back to back,
 * and every name must be found again by nb__st_find; each tensor's bytes
 * are touched so that ASan would see a read past the input. */
/* smoke-instrument: checkpoint/header.c */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 8) return 0;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | data[i];
    if (n > NB_CHECKPOINT_MAX_HEADER || n > size - 8) return 0;
    nb__st_header h;
    if (nb__st_parse_header((const char *)data + 8, (size_t)n, 8 + n, size - 8 - n, "fuzz", &h) !=
        NB_OK) {
        if (h.doc || h.entries || h.n) abort(); /* a refused header leaves nothing behind */
        return 0;
    }
    uint64_t expect = 8 + n;
    volatile uint8_t sink = 0;
    for (int i = 0; i < h.n; i++) {
        const nb_checkpoint_entry *e = &h.entries[i];
        if (e->offset != expect || e->offset + e->nbytes > size) abort();
        expect += e->nbytes;
        for (uint64_t b = 0; b < e->nbytes; b++) sink ^= data[e->offset + b];
        if (nb__st_find(&h, e->name) != i) abort();
        if (e->ndim < 0 || e->ndim > NB_MAX_DIMS) abort();
    }
    if (expect != size) abort();
    for (int i = 0; i < h.n_meta; i++)
        if (!h.meta[i].key || !h.meta[i].value) abort();
    (void)sink;
    nb__st_header_free(&h);
    return 0;
}
