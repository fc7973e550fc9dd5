/* Token shards in llm.c's format, memory-mapped, as (x, y) windows.
 *
 * A shard is a header of 256 little-endian int32 (magic 20240520, version
 * 1, token count n; the rest unused) and then n little-endian uint16
 * tokens. Each file is checked whole when it is opened (magic, version,
 * exact size), so a get never fails. Windows never cross files: sample i
 * is found by binary search over the per-file window counts. The tokens
 * are read in place, which assumes a little-endian host (checked). Given a
 * vocabulary size, every token is compared with it at open (one pass over
 * the mapped file, a maximum per block, then the first offender's place),
 * so that an id the model's embedding cannot look up is named with its
 * file and byte offset instead of aborting a training step. */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/internal.h"

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define HEADER_INTS 256
#define HEADER_BYTES (HEADER_INTS * 4)

typedef struct shard {
    void *map;
    size_t map_bytes;
    const uint16_t *tokens;
    int64_t n_tokens;
} shard;

typedef struct tokens_ds {
    int64_t seq_len, stride;
    int n_shards;
    shard *shards;
    int64_t *first; /* first[s] = index of shard s's first window; first[n_shards] = total */
} tokens_ds;

static int64_t tokens_len(void *self) {
    tokens_ds *t = self;
    return t->first[t->n_shards];
}

static nb_status tokens_get(void *self, int64_t i, void *input, void *target) {
    tokens_ds *t = self;
    int lo = 0, hi = t->n_shards - 1;
    while (lo < hi) { /* last shard whose first window <= i */
        int mid = (lo + hi + 1) / 2;
        if (t->first[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    const uint16_t *tok = t->shards[lo].tokens + (i - t->first[lo]) * t->stride;
    int64_t *x = input, *y = target;
    for (int64_t k = 0; k < t->seq_len; k++) {
        x[k] = tok[k];
        y[k] = tok[k + 1];
    }
    return NB_OK;
}

static void tokens_free(void *self) {
    tokens_ds *t = self;
    if (!t) return;
    for (int s = 0; s < t->n_shards; s++)
        if (t->shards[s].map) munmap(t->shards[s].map, t->shards[s].map_bytes);
    free(t->shards);
    free(t->first);
    free(t);
}

static const nb_dataset_vtable tokens_vt = {"tokens", tokens_len, tokens_get, tokens_free};

static int32_t le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

static bool little_endian(void) {
    uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static nb_status open_shard(const char *path, shard *sh) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return nb_set_error(NB_ERR_IO, "cannot open \"%s\": %s", path, strerror(errno));
    struct stat stt;
    if (fstat(fd, &stt) != 0) {
        int err = errno;
        close(fd);
        return nb_set_error(NB_ERR_IO, "cannot stat \"%s\": %s", path, strerror(err));
    }
    int64_t size = (int64_t)stt.st_size;
    if (size < HEADER_BYTES) {
        close(fd);
        return nb_set_error(NB_ERR_FORMAT, "%s: truncated header: the file ends at byte offset "
                            "%lld, a token shard header is %d bytes", path, (long long)size,
                            HEADER_BYTES);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (map == MAP_FAILED)
        return nb_set_error(NB_ERR_IO, "cannot map \"%s\" (%lld bytes): %s", path,
                            (long long)size, strerror(err));
    sh->map = map;
    sh->map_bytes = (size_t)size;
    const unsigned char *h = map;
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
    sh->tokens = (const uint16_t *)(h + HEADER_BYTES);
    sh->n_tokens = count;
    return NB_OK;
}

static nb_status check_vocab(const char *path, const shard *sh, int64_t vocab_size) {
    if (vocab_size <= 0 || vocab_size > UINT16_MAX) return NB_OK;
    const uint16_t *tok = sh->tokens;
    const int64_t block = 4096;
    for (int64_t b = 0; b < sh->n_tokens; b += block) {
        int64_t e = b + block < sh->n_tokens ? b + block : sh->n_tokens;
        uint16_t mx = 0;
        for (int64_t i = b; i < e; i++) mx = tok[i] > mx ? tok[i] : mx;
        if (mx < vocab_size) continue;
        int64_t i = b;
        while (tok[i] < vocab_size) i++;
        return nb_set_error(NB_ERR_FORMAT, "%s: byte offset %lld: token id %u (token %lld of the "
                            "file) is not below the vocabulary size %lld", path,
                            (long long)(HEADER_BYTES + 2 * i), (unsigned)tok[i], (long long)i,
                            (long long)vocab_size);
    }
    return NB_OK;
}

nb_status nb_dataset_open_tokens(nb_dataset **out, const char *pattern, int64_t seq_len,
                                 int64_t stride, int64_t vocab_size) {
    *out = NULL;
    NB_CHECK(seq_len > 0, "nb_dataset_open_tokens: seq_len %lld must be > 0", (long long)seq_len);
    NB_CHECK(stride >= 0, "nb_dataset_open_tokens: stride %lld must be >= 0 (0: seq_len)",
             (long long)stride);
    NB_CHECK(vocab_size >= 0, "nb_dataset_open_tokens: vocab_size %lld must be >= 0 (0: not "
             "checked)", (long long)vocab_size);
    if (!little_endian())
        return nb_set_error(NB_ERR_UNSUPPORTED, "nb_dataset_open_tokens: token shards are read "
                            "in place, which needs a little-endian host");
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
    t->seq_len = seq_len;
    t->stride = stride ? stride : seq_len;
    t->n_shards = n_files;
    int64_t total_tokens = 0;
    for (int s = 0; s < n_files; s++) {
        const char *path = globbed ? g.gl_pathv[s] : pattern;
        if ((st = open_shard(path, &t->shards[s]))) goto done;
        if ((st = check_vocab(path, &t->shards[s], vocab_size))) goto done;
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
