/* Random token windows for benchmarking the training programs without a
 * dataset on disk (train_gpt --synthetic): window i holds T + 1 tokens,
 * each a pure function of (seed, i, position) through Philox, uniform over
 * the vocabulary; the input is the first T, the target the last T (the
 * next token), as in a token-shard dataset. There is nothing to learn: the
 * loss stays near ln V. */
#ifndef NABLA_EXAMPLES_SYNTHETIC_H
#define NABLA_EXAMPLES_SYNTHETIC_H

#include <stdint.h>

#include <nabla/nabla.h>

/* `windows` windows of seq_len tokens in [0, vocab). */
nb_dataset *synthetic_tokens_new(int64_t windows, int64_t seq_len, int64_t vocab, uint64_t seed);

#endif
