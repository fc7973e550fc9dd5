/* libFuzzer target for the character-level text reader
 * (data/dataset_text.c).
 *
 * The first byte chooses seq_len (1-16), the stride (0-3) and the
 * vocabulary (compact or bytes); the rest is the file. Every window of an
 * accepted file is read (at most 512): x and y must be the file's bytes at
 * the window's place, through the vocabulary's table, shifted by one, and
 * every id below the vocabulary size. */
/* smoke-instrument: data/dataset_text.c */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/internal.h"

/* The directory of the file each input is written to: memory (/dev/shm)
 * where there is one, since on a disk the write is the slowest part. */
static const char *scratch_dir(void) { return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp"; }

static char path[64];

static void remove_scratch(void) { unlink(path); }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (!path[0]) {
        snprintf(path, sizeof path, "%s/nb_fuzz_text_%d.txt", scratch_dir(), (int)getpid());
        atexit(remove_scratch);
    }
    uint8_t f = data[0];
    int64_t seq_len = 1 + (f & 15), stride = (f >> 4) & 3;
    nb_text_vocab mode = f & 64 ? NB_TEXT_BYTES : NB_TEXT_COMPACT;
    data++;
    size--;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) abort();
    if (size && write(fd, data, size) != (ssize_t)size) abort();
    close(fd);
    nb_dataset *ds = (nb_dataset *)&fd;
    if (nb_dataset_open_text(&ds, path, seq_len, stride, mode) != NB_OK) {
        if (ds || !nb_last_error()[0]) abort();
        return 0;
    }
    uint8_t bytes[256];
    int v = nb_dataset_text_vocab(ds, bytes);
    if (v < 1 || v > 256 || (mode == NB_TEXT_BYTES && v != 256)) abort();
    int64_t n = nb_dataset_len(ds), x[16], y[16], step = stride ? stride : seq_len;
    if (n <= 0) abort();
    for (int64_t i = 0; i < n && i < 512; i++) {
        if (nb_dataset_get(ds, i, x, y) != NB_OK) abort();
        for (int64_t k = 0; k < seq_len; k++) {
            if (x[k] < 0 || x[k] >= v || y[k] < 0 || y[k] >= v) abort();
            size_t at = (size_t)(i * step + k);
            if (at + 1 >= size || bytes[x[k]] != data[at] || bytes[y[k]] != data[at + 1]) abort();
        }
    }
    nb_dataset_free(ds);
    return 0;
}
