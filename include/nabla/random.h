/* Counter-based random numbers (Philox-4x32-10).
 *
 * A generator is a (seed, offset) pair. Element i of a random tensor is a
 * pure function of (seed, offset, i), so results do not depend on thread
 * count or device; the offset then advances past what was used. See
 * Note [Random streams] in tensor/random.c for the exact mapping. */
#ifndef NABLA_RANDOM_H
#define NABLA_RANDOM_H

#include <stdint.h>

#include "nabla/api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_rng {
    uint64_t seed;
    uint64_t offset; /* in Philox counters (4 x 32 bits each) */
} nb_rng;

static inline nb_rng nb_rng_make(uint64_t seed) { nb_rng r = {seed, 0}; return r; }

/* The process-wide default generator, used when an API is passed NULL. */
NB_API nb_rng *nb_rng_default(void);
NB_API void nb_manual_seed(uint64_t seed);

/* One Philox-4x32-10 block: four 32-bit outputs for (seed, counter). */
NB_API void nb_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* Uniform in [0, 1) from a 32-bit integer: (x >> 8) * 2^-24. */
static inline float nb_u32_to_unit(uint32_t x) { return (float)(x >> 8) * (1.0f / 16777216.0f); }

#ifdef __cplusplus
}
#endif
#endif
