/* Character-level text: the bytes of a file as tokens, in (x, y) windows.
 *
 * Two vocabularies. NB_TEXT_BYTES: token = byte value, V = 256, the same
 * for every file. NB_TEXT_COMPACT (the default): the V distinct bytes that
 * occur get ids 0..V-1 in increasing byte order, so the embedding and the
 * output layer hold only V rows (79 for the shipped Austen text); the map
 * is a pure function of the file, and nb_dataset_text_vocab gives it back
 * for decoding. The file is read whole and remapped once. */
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "util/handle.h"

typedef struct text_ds {
    int64_t seq_len, stride, n_windows;
    uint8_t *tokens;
    int vocab;
    uint8_t bytes[256]; /* id -> byte */
} text_ds;

static int64_t text_len(void *self) { return ((text_ds *)self)->n_windows; }

static nb_status text_get(void *self, int64_t i, void *input, void *target) {
    text_ds *t = self;
    const uint8_t *tok = t->tokens + i * t->stride;
    int64_t *x = input, *y = target;
    for (int64_t k = 0; k < t->seq_len; k++) {
        x[k] = tok[k];
        y[k] = tok[k + 1];
    }
    return NB_OK;
}

static void text_free(void *self) {
    text_ds *t = self;
    free(t->tokens);
    free(t);
}

static const nb_dataset_vtable text_vt = {"text", text_len, text_get, text_free};

nb_status nb_dataset_open_text(nb_dataset **out, const char *path, int64_t seq_len,
                               int64_t stride, nb_text_vocab vocab) {
    *out = NULL;
    NB_CHECK(seq_len > 0, "nb_dataset_open_text: seq_len %lld must be > 0", (long long)seq_len);
    NB_CHECK(stride >= 0, "nb_dataset_open_text: stride %lld must be >= 0 (0: seq_len)",
             (long long)stride);
    NB_CHECK(vocab == NB_TEXT_COMPACT || vocab == NB_TEXT_BYTES,
             "nb_dataset_open_text: vocab %d is not an nb_text_vocab", (int)vocab);
    char *buf;
    size_t size;
    nb_status st = nb__read_file(path, &buf, &size);
    if (st) return st;
    if ((int64_t)size < seq_len + 1) {
        free(buf);
        return nb_set_error(NB_ERR_FORMAT, "%s: %zu bytes; one window of seq_len %lld needs "
                            "%lld", path, size, (long long)seq_len, (long long)(seq_len + 1));
    }
    text_ds *t = calloc(1, sizeof *t);
    if (!t) {
        free(buf);
        return nb_set_error(NB_ERR_NOMEM, "%s: out of memory", path);
    }
    t->tokens = (uint8_t *)buf;
    t->seq_len = seq_len;
    t->stride = stride ? stride : seq_len;
    t->n_windows = nb__window_count((int64_t)size, seq_len, t->stride);
    if (vocab == NB_TEXT_BYTES) {
        t->vocab = 256;
        for (int b = 0; b < 256; b++) t->bytes[b] = (uint8_t)b;
    } else {
        bool present[256] = {false};
        for (size_t i = 0; i < size; i++) present[t->tokens[i]] = true;
        uint8_t id[256];
        for (int b = 0; b < 256; b++)
            if (present[b]) {
                id[b] = (uint8_t)t->vocab;
                t->bytes[t->vocab++] = (uint8_t)b;
            }
        for (size_t i = 0; i < size; i++) t->tokens[i] = id[t->tokens[i]];
    }
    nb_field f = nb_field_of(NB_I64, NB_SHAPE(seq_len));
    *out = nb_dataset_new(&text_vt, t, f, f);
    return NB_OK;
}

int nb_dataset_text_vocab(const nb_dataset *ds, uint8_t bytes[256]) {
    NB__CHECK_HANDLE("nb_dataset_text_vocab", ds, "dataset");
    text_ds *t = nb__dataset_self(ds, &text_vt);
    NB_CHECK(t, "nb_dataset_text_vocab: a %s dataset; this needs one from nb_dataset_open_text",
             nb_dataset_name(ds));
    if (bytes) memcpy(bytes, t->bytes, (size_t)t->vocab);
    return t->vocab;
}
