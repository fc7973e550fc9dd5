/* Token shards in llm.c's format, read with pread, as (x, y) windows.
 *
 * A shard is a header of 256 little-endian int32 (magic 20240520, version
 * 1, token count n; the rest unused) and then n little-endian uint16
 * tokens. Each file is checked whole when it is opened (magic, version,
 * exact size). Windows never cross files: sample i is found by binary
 * search over the per-file window counts. Given a vocabulary size, every
 * token is compared with it at open (a maximum per block, then the first
 * offender's place), so that an id the model's embedding cannot look up is
 * named with its file and byte offset instead of aborting a training step;
 * get compares again, as the file may have changed since.
 *
 * Note [Shards change under a run]: a shard is a file another process can
 * truncate or rewrite while a run reads it (a data pipeline writing in
 * place, a copy interrupted and restarted). Each file stays open and a
 * window is read with one pread of its seq_len + 1 tokens, so a file that
 * shrank gives a short read, and get returns NB_ERR_IO naming the file, the
 * byte offset and the size the file has now. We do not map the files: a
 * read past the end of a shrunk mapping is SIGBUS, which a library cannot
 * turn into an error (a process-wide signal handler, on whichever loader
 * thread touched the page), and checking the size before reading a mapping
 * leaves the gap between check and read. A pread per window costs one
 * system call per sample, small next to a model step over that window (the
 * page cache serves it): about 8 us for 1024 tokens, measured. */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/internal.h"

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define HEADER_INTS 256
#define HEADER_BYTES (HEADER_INTS * 4)

typedef struct shard {
    int fd;
    char *path;
    int64_t n_tokens;
} shard;

typedef struct tokens_ds {
    int64_t seq_len, stride, vocab_size;
    int n_shards;
    shard *shards;
    int64_t *first; /* first[s] = index of shard s's first window; first[n_shards] = total */
} tokens_ds;

static int64_t tokens_len(void *self) {
    tokens_ds *t = self;
    return t->first[t->n_shards];
}

/* Reads `bytes` at `offset` of an open shard; a short read is the file
 * having shrunk (Note [Shards change under a run]). */
static nb_status read_at(const shard *sh, void *buf, size_t bytes, int64_t offset) {
    size_t done = 0;
    while (done < bytes) {
        ssize_t r = pread(sh->fd, (char *)buf + done, bytes - done, (off_t)(offset + (int64_t)done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            return nb_set_error(NB_ERR_IO, "%s: byte offset %lld: read failed: %s", sh->path,
                                (long long)(offset + (int64_t)done), strerror(errno));
        if (r == 0) {
            struct stat stt;
            long long now = fstat(sh->fd, &stt) == 0 ? (long long)stt.st_size : -1;
            return nb_set_error(NB_ERR_IO, "%s: byte offset %lld: the file ends there (it is "
                                "%lld bytes now); it changed after it was opened (%lld tokens "
                                "then): was it truncated or rewritten while the run read it?",
                                sh->path, (long long)(offset + (int64_t)done), now,
                                (long long)sh->n_tokens);
        }
        done += (size_t)r;
    }
    return NB_OK;
}

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }

static nb_status tokens_get(void *self, int64_t i, void *input, void *target) {
    tokens_ds *t = self;
    int lo = 0, hi = t->n_shards - 1;
    while (lo < hi) { /* last shard whose first window <= i */
        int mid = (lo + hi + 1) / 2;
        if (t->first[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    const shard *sh = &t->shards[lo];
    int64_t first = (i - t->first[lo]) * t->stride, n = t->seq_len + 1;
    int64_t offset = HEADER_BYTES + 2 * first;
    /* y's memory (8 T bytes) holds the 2 (T + 1) raw bytes first; x is
     * decoded from them, then y in place, back to front, so that no byte
     * is overwritten before it is read */
    int64_t *x = input, *y = target;
    const unsigned char *raw = target;
    nb_status st = read_at(sh, target, (size_t)(2 * n), offset);
    if (st != NB_OK) return st;
    int64_t bad = -1;
    for (int64_t k = 0; k < n - 1; k++) {
        x[k] = le16(raw + 2 * k);
        if (t->vocab_size > 0 && x[k] >= t->vocab_size && bad < 0) bad = k;
    }
    uint16_t tail = le16(raw + 2 * (n - 1));
    if (t->vocab_size > 0 && tail >= t->vocab_size && bad < 0) bad = n - 1;
    if (bad >= 0)
        return nb_set_error(NB_ERR_FORMAT, "%s: byte offset %lld: token id %u is not below the "
                            "vocabulary size %lld (the file changed after it was opened)",
                            sh->path, (long long)(offset + 2 * bad),
                            (unsigned)le16(raw + 2 * bad), (long long)t->vocab_size);
    for (int64_t k = n - 2; k >= 0; k--) y[k] = le16(raw + 2 * (k + 1));
    return NB_OK;
}

static void tokens_free(void *self) {
    tokens_ds *t = self;
    if (!t) return;
    for (int s = 0; s < t->n_shards; s++) {
        if (t->shards[s].fd >= 0) close(t->shards[s].fd);
        free(t->shards[s].path);
    }
    free(t->shards);
    free(t->first);
    free(t);
}

static const nb_dataset_vtable tokens_vt = {"tokens", tokens_len, tokens_get, tokens_free};

static int32_t le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

/* Opens and checks one shard; sh->fd and sh->path are set as soon as they
 * exist, so that tokens_free releases them whatever fails next. */
static nb_status open_shard(const char *path, shard *sh) {
    sh->path = malloc(strlen(path) + 1);
    if (!sh->path) return nb_set_error(NB_ERR_NOMEM, "nb_dataset_open_tokens: out of memory");
    strcpy(sh->path, path);
    sh->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (sh->fd < 0) return nb_set_error(NB_ERR_IO, "cannot open \"%s\": %s", path, strerror(errno));
    struct stat stt;
    if (fstat(sh->fd, &stt) != 0)
        return nb_set_error(NB_ERR_IO, "cannot stat \"%s\": %s", path, strerror(errno));
    int64_t size = (int64_t)stt.st_size;
    if (size < HEADER_BYTES)
        return nb_set_error(NB_ERR_FORMAT, "%s: truncated header: the file ends at byte offset "
                            "%lld, a token shard header is %d bytes", path, (long long)size,
                            HEADER_BYTES);
    unsigned char h[12];
    nb_status st = read_at(sh, h, sizeof h, 0);
    if (st != NB_OK) return st;
    int32_t magic = le32(h), version = le32(h + 4), count = le32(h + 8);
    if (magic != SHARD_MAGIC)
        return nb_set_error(NB_ERR_FORMAT, "%s: byte offset 0: magic number %d, expected %d "
                            "(not a token shard in llm.c's format)", path, magic, SHARD_MAGIC);
    if (version != SHARD_VERSION)
        return nb_set_error(NB_ERR_FORMAT, "%s: byte offset 4: version %d; only version %d "
                            "(uint16 tokens) is supported", path, version, SHARD_VERSION);
    if (count < 0)
        return nb_set_error(NB_ERR_FORMAT, "%s: byte offset 8: token count %d is negative",
                            path, count);
    int64_t want = HEADER_BYTES + 2 * (int64_t)count;
    if (size < want)
        return nb_set_error(NB_ERR_FORMAT, "%s: truncated body: the header announces %d tokens "
                            "(data up to byte offset %lld), the file ends at byte offset %lld "
                            "(%lld tokens)", path, count, (long long)want, (long long)size,
                            (long long)((size - HEADER_BYTES) / 2));
    if (size > want)
        return nb_set_error(NB_ERR_FORMAT, "%s: byte offset %lld: %lld bytes follow the %d tokens "
                            "the header announces", path, (long long)want,
                            (long long)(size - want), count);
    sh->n_tokens = count;
    return NB_OK;
}

static nb_status check_vocab(const shard *sh, int64_t vocab_size) {
    if (vocab_size <= 0 || vocab_size > UINT16_MAX) return NB_OK;
    enum { BLOCK = 32768 };
    unsigned char *buf = malloc(2 * BLOCK);
    if (!buf) return nb_set_error(NB_ERR_NOMEM, "nb_dataset_open_tokens: out of memory");
    nb_status st = NB_OK;
    for (int64_t b = 0; b < sh->n_tokens && st == NB_OK; b += BLOCK) {
        int64_t m = sh->n_tokens - b < BLOCK ? sh->n_tokens - b : BLOCK;
        if ((st = read_at(sh, buf, (size_t)(2 * m), HEADER_BYTES + 2 * b))) break;
        uint16_t mx = 0;
        for (int64_t i = 0; i < m; i++) {
            uint16_t v = le16(buf + 2 * i);
            mx = v > mx ? v : mx;
        }
        if (mx < vocab_size) continue;
        int64_t i = 0;
        while (le16(buf + 2 * i) < vocab_size) i++;
        st = nb_set_error(NB_ERR_FORMAT, "%s: byte offset %lld: token id %u (token %lld of the "
                          "file) is not below the vocabulary size %lld", sh->path,
                          (long long)(HEADER_BYTES + 2 * (b + i)), (unsigned)le16(buf + 2 * i),
                          (long long)(b + i), (long long)vocab_size);
    }
    free(buf);
    return st;
}

nb_status nb_dataset_open_tokens(nb_dataset **out, const char *pattern, int64_t seq_len,
                                 int64_t stride, int64_t vocab_size) {
    *out = NULL;
    NB_CHECK(seq_len > 0, "nb_dataset_open_tokens: seq_len %lld must be > 0", (long long)seq_len);
    NB_CHECK(stride >= 0, "nb_dataset_open_tokens: stride %lld must be >= 0 (0: seq_len)",
             (long long)stride);
    NB_CHECK(vocab_size >= 0, "nb_dataset_open_tokens: vocab_size %lld must be >= 0 (0: not "
             "checked)", (long long)vocab_size);
    glob_t g;
    memset(&g, 0, sizeof g);
    bool globbed = strpbrk(pattern, "*?[") != NULL;
    int n_files = 1;
    if (globbed) {
        int rc = glob(pattern, 0, NULL, &g);
        if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
            globfree(&g);
            return nb_set_error(NB_ERR_NOT_FOUND, "no token shard matches \"%s\"", pattern);
        }
        if (rc != 0) {
            globfree(&g);
            return nb_set_error(NB_ERR_IO, "cannot list the files matching \"%s\"", pattern);
        }
        n_files = (int)g.gl_pathc;
    }
    nb_status st = NB_OK;
    tokens_ds *t = calloc(1, sizeof *t);
    if (t) {
        t->shards = calloc((size_t)n_files, sizeof *t->shards);
        t->first = calloc((size_t)n_files + 1, sizeof *t->first);
    }
    if (!t || !t->shards || !t->first) {
        st = nb_set_error(NB_ERR_NOMEM, "nb_dataset_open_tokens: out of memory");
        goto done;
    }
    for (int s = 0; s < n_files; s++) t->shards[s].fd = -1;
    t->vocab_size = vocab_size;
    t->seq_len = seq_len;
    t->stride = stride ? stride : seq_len;
    t->n_shards = n_files;
    int64_t total_tokens = 0;
    for (int s = 0; s < n_files; s++) {
        const char *path = globbed ? g.gl_pathv[s] : pattern;
        if ((st = open_shard(path, &t->shards[s]))) goto done;
        if ((st = check_vocab(&t->shards[s], vocab_size))) goto done;
        total_tokens += t->shards[s].n_tokens;
        t->first[s + 1] = t->first[s] +
                          nb__window_count(t->shards[s].n_tokens, seq_len, t->stride);
    }
    if (t->first[n_files] == 0) {
        st = nb_set_error(NB_ERR_FORMAT, "%s: %lld tokens in %d file(s), no file has the "
                          "seq_len + 1 = %lld that one window needs", pattern,
                          (long long)total_tokens, n_files, (long long)(seq_len + 1));
        goto done;
    }
    nb_field f = nb_field_of(NB_I64, NB_SHAPE(seq_len));
    *out = nb_dataset_new(&tokens_vt, t, f, f);
    t = NULL;
done:
    tokens_free(t);
    if (globbed) globfree(&g);
    return st;
}

nb_status nb_tokens_write(const char *path, const uint16_t *tokens, int64_t n) {
    NB_CHECK(n >= 0 && n <= INT32_MAX, "nb_tokens_write: %lld tokens; a shard holds 0 to %d",
             (long long)n, INT32_MAX);
    FILE *f = fopen(path, "wb");
    if (!f) return nb_set_error(NB_ERR_IO, "cannot create \"%s\": %s", path, strerror(errno));
    unsigned char header[HEADER_BYTES];
    memset(header, 0, sizeof header);
    int32_t fields[3] = {SHARD_MAGIC, SHARD_VERSION, (int32_t)n};
    for (int k = 0; k < 3; k++)
        for (int b = 0; b < 4; b++) header[4 * k + b] = (unsigned char)((uint32_t)fields[k] >> (8 * b));
    bool ok = fwrite(header, 1, sizeof header, f) == sizeof header;
    unsigned char chunk[8192];
    for (int64_t i = 0; ok && i < n;) {
        int64_t m = n - i < 4096 ? n - i : 4096;
        for (int64_t k = 0; k < m; k++) {
            chunk[2 * k] = (unsigned char)(tokens[i + k] & 0xff);
            chunk[2 * k + 1] = (unsigned char)(tokens[i + k] >> 8);
        }
        ok = fwrite(chunk, 1, (size_t)(2 * m), f) == (size_t)(2 * m);
        i += m;
    }
    int err = ok ? 0 : errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    if (!ok) return nb_set_error(NB_ERR_IO, "writing \"%s\": %s", path, strerror(err));
    return NB_OK;
}
