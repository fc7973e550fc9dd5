/* The bucket partition of DDP (Note [Buckets] in ddp.c) as pure functions
 * of sizes and orders, so that it is tested on its own
 * (tests/test_dist_buckets.c). Not installed. */
#ifndef NABLA_DISTRIBUTED_DDP_BUCKETS_H
#define NABLA_DISTRIBUTED_DDP_BUCKETS_H

#include <stddef.h>
#include <stdint.h>

#include "nabla/dtype.h"

/* Splits the n parameters listed in `order` (indices into numel and
 * dtype) into buckets of consecutive entries: a bucket holds one dtype and
 * closes once it holds at least first_bytes (the first bucket) or
 * cap_bytes (the others), the parameter that crosses the limit included.
 * Writes where each bucket starts in `order` to starts[0..nb) and n to
 * starts[nb] (room for n + 1 entries); returns nb (0 when n is 0). */
int nb__ddp_partition(int n, const int *order, const int64_t *numel, const nb_dtype *dtype,
                      size_t first_bytes, size_t cap_bytes, int *starts);

/* The default size of the first bucket, 1 MiB (PyTorch's), and, for a
 * model whose gradients take grad_bytes, the default cap of the other
 * buckets (Note [Default bucket cap] in ddp_buckets.c): grad_bytes / 16,
 * at least 256 KiB and at most 25 MiB (PyTorch's cap). */
size_t nb__ddp_default_first(void);
size_t nb__ddp_default_cap(size_t grad_bytes);

/* The first order: reverse registration (backward makes the last layers'
 * gradients ready first). */
void nb__ddp_initial_order(int n, int *order);

/* The rebuilt order: the n_ready distinct indices of `ready` in the order
 * they became ready, then the parameters never ready, in reverse
 * registration order. */
void nb__ddp_rebuild_order(int n, const int *ready, int n_ready, int *order);

#endif
