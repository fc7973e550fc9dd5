/* Random token windows (see synthetic.h). */
#include "synthetic.h"

#include <stdlib.h>

typedef struct synthetic {
    int64_t windows, seq_len, vocab;
    uint64_t seed;
} synthetic;

static int64_t synthetic_len(void *self) { return ((synthetic *)self)->windows; }

/* Token j (0 <= j <= T) of window i: lane j % 4 of Philox counter
 * i * ceil((T + 1) / 4) + j / 4. */
static nb_status synthetic_get(void *self, int64_t index, void *input, void *target) {
    const synthetic *s = self;
    int64_t *in = input, *tg = target, per_window = (s->seq_len + 4) / 4;
    uint32_t r[4];
    for (int64_t j = 0; j <= s->seq_len; j++) {
        if (j % 4 == 0) nb_philox4x32(s->seed, (uint64_t)(index * per_window + j / 4), r);
        int64_t tok = (int64_t)(r[j % 4] % (uint32_t)s->vocab);
        if (j < s->seq_len) in[j] = tok;
        if (j > 0) tg[j - 1] = tok;
    }
    return NB_OK;
}

static const nb_dataset_vtable synthetic_vt = {"synthetic tokens", synthetic_len, synthetic_get, free};

nb_dataset *synthetic_tokens_new(int64_t windows, int64_t seq_len, int64_t vocab, uint64_t seed) {
    NB_CHECK(windows > 0 && seq_len > 0 && vocab > 1 && vocab <= UINT32_MAX,
             "synthetic_tokens_new: need windows, seq_len > 0 and 1 < vocab < 2^32");
    synthetic *s = malloc(sizeof *s);
    NB_CHECK(s, "synthetic_tokens_new: out of memory");
    *s = (synthetic){windows, seq_len, vocab, seed};
    nb_field f = nb_field_of(NB_I64, NB_SHAPE(seq_len));
    return nb_dataset_new(&synthetic_vt, s, f, f);
}
