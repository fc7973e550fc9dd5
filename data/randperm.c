/* Seeded permutations for samplers and splits.
 *
 * Note [Permutations]
 * A permutation of 0..n-1 for a seed is a Fisher-Yates shuffle driven by
 * one Philox-4x32-10 stream: block c = philox(seed, c) gives two 64-bit
 * draws, (lane1 << 32 | lane0) then (lane3 << 32 | lane2). For i = n-1
 * down to 1, j is uniform in [0, i] by rejection (a draw below
 * 2^64 mod (i + 1) is discarded, so there is no modulo bias), then out[i]
 * and out[j] are swapped. The result depends on (n, seed) only: not on the
 * machine, the thread count or earlier calls. Samplers use seed + epoch, as
 * PyTorch's DistributedSampler seeds its generator; the numbers differ
 * from PyTorch's, the semantics do not. */
#include "data/internal.h"

#include "nabla/random.h"

typedef struct stream {
    uint64_t seed, counter;
    uint32_t block[4];
    int used; /* 64-bit draws taken from block: 0, 1 or 2 */
} stream;

static uint64_t next_u64(stream *s) {
    if (s->used == 2) {
        nb_philox4x32(s->seed, s->counter++, s->block);
        s->used = 0;
    }
    int k = 2 * s->used++;
    return (uint64_t)s->block[k + 1] << 32 | s->block[k];
}

static uint64_t uniform_below(stream *s, uint64_t bound) {
    uint64_t reject_below = (0 - bound) % bound; /* 2^64 mod bound */
    for (;;) {
        uint64_t r = next_u64(s);
        if (r >= reject_below) return r % bound;
    }
}

void nb__randperm(int64_t *out, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) out[i] = i;
    stream s = {seed, 0, {0, 0, 0, 0}, 2};
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)uniform_below(&s, (uint64_t)i + 1);
        int64_t t = out[i];
        out[i] = out[j];
        out[j] = t;
    }
}
