/* libFuzzer target for the token-shard reader (data/dataset_tokens.c).
 *
 * The first byte chooses seq_len (1-8), the stride (0-3), whether token
 * ids are checked against a vocabulary (the second byte + 1), whether the
 * target writes a valid magic and version itself (so that inputs reach the
 * count and token checks; the next two bytes are then the count), and
 * whether the file is cut after the open (to a length from the input), as
 * a shard truncated under a run is. The rest is the file. Every window of
 * an accepted shard is read (at most 512): a get returns NB_OK, or, only
 * when the file was cut, NB_ERR_IO (or NB_ERR_FORMAT for an id beyond the
 * vocabulary); x and y must be the same stream shifted by one, and every id
 * below the vocabulary when one is given. */
/* smoke-instrument: data/dataset_tokens.c */
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

static const char *scratch(void) {
    static char path[64];
    if (!path[0]) snprintf(path, sizeof path, "%s/nb_fuzz_tokens_%d.bin", scratch_dir(), (int)getpid());
    return path;
}

static void remove_scratch(void) { unlink(scratch()); }

static void put32(unsigned char *p, uint32_t v) {
    for (int b = 0; b < 4; b++) p[b] = (unsigned char)(v >> (8 * b));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 4) return 0;
    static int registered;
    if (!registered) {
        registered = 1;
        atexit(remove_scratch);
    }
    uint8_t f = data[0];
    int64_t seq_len = 1 + (f & 7), stride = (f >> 3) & 3;
    int64_t vocab = f & 32 ? (int64_t)data[1] + 1 : 0;
    bool header = f & 64, cut = f & 128;
    size_t cut_at = (size_t)data[2] * 8 + 1024;
    uint32_t count = (uint32_t)data[3] | (uint32_t)data[1] << 8;
    data += 4;
    size -= 4;
    int fd = open(scratch(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) abort();
    if (header) {
        unsigned char h[1024];
        memset(h, 0, sizeof h);
        put32(h, 20240520);
        put32(h + 4, 1);
        put32(h + 8, count);
        if (write(fd, h, sizeof h) != (ssize_t)sizeof h) abort();
    }
    if (size && write(fd, data, size) != (ssize_t)size) abort();
    close(fd);
    nb_dataset *ds = (nb_dataset *)&fd;
    nb_status st = nb_dataset_open_tokens(&ds, scratch(), seq_len, stride, vocab);
    if (st != NB_OK) {
        if (ds || !nb_last_error()[0]) abort();
        return 0;
    }
    if (cut && truncate(scratch(), (off_t)cut_at) != 0) abort();
    int64_t n = nb_dataset_len(ds), x[8], y[8];
    if (n <= 0) abort();
    for (int64_t i = 0; i < n && i < 512; i++) {
        st = nb_dataset_get(ds, i, x, y);
        if (st != NB_OK) {
            if (!cut || (st != NB_ERR_IO && st != NB_ERR_FORMAT)) abort();
            continue;
        }
        for (int64_t k = 0; k < seq_len; k++) {
            if (x[k] < 0 || x[k] > 65535 || y[k] < 0 || y[k] > 65535) abort();
            if (vocab && (x[k] >= vocab || y[k] >= vocab)) abort();
            if (k + 1 < seq_len && y[k] != x[k + 1]) abort();
        }
    }
    nb_dataset_free(ds);
    return 0;
}
