/* Philox-4x32-10 and the process-wide default generator.
 *
 * Note [Random streams]
 * A generator (seed, offset) maps element i of an n-element request to:
 *   uniform: lane i % 4 of philox(seed, offset + i / 4), as nb_u32_to_unit;
 *   normal:  Box-Muller on lanes 0,1 of philox(seed, offset + i / 2):
 *            u1 = (x0 + 1) * 2^-32 (never 0), u2 = x1 * 2^-32,
 *            r = sqrt(-2 ln u1); element i even -> r cos(2 pi u2), odd -> r sin(2 pi u2);
 *   dropout: element i kept when its uniform (as above), compared as a double,
 *            is >= p (a CUDA kernel must compare in double too).
 * Afterwards the offset advances by ceil(n/4) (uniform, dropout) or
 * ceil(n/2) (normal). CUDA kernels compute the same function. */
#include "nabla/random.h"
#include "tensor/internal.h"

static nb_rng default_rng = {0x6e61626c61ull, 0}; /* "nabla" */

nb_rng *nb_rng_default(void) { return &default_rng; }

void nb_manual_seed(uint64_t seed) {
    default_rng.seed = seed;
    default_rng.offset = 0;
}

void nb_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* Note [Recomputation] in nn/recompute.c */
static _Thread_local nb__rng_log *open_log;

void nb__rng_log_open(nb__rng_log *log) {
    log->n = 0;
    open_log = log;
}

void nb__rng_log_close(void) {
    for (int i = 0; i < open_log->n; i++) open_log->after[i] = *open_log->rng[i];
    open_log = NULL;
}

void nb__rng_used(nb_rng *rng) {
    nb__rng_log *log = open_log;
    if (!log) return;
    for (int i = 0; i < log->n; i++)
        if (log->rng[i] == rng) return;
    NB_CHECK(log->n < NB__RNG_LOG, "nb_module_set_recompute: a recomputed forward draws from more "
             "than %d generators", NB__RNG_LOG);
    log->rng[log->n] = rng;
    log->before[log->n++] = *rng;
}
