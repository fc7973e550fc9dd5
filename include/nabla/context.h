/* Contexts: every tensor lives in one, and is never freed on its own.
 *
 * A context is an arena: a few large blocks with a bump pointer. A
 * persistent context holds parameters, gradients, buffers and optimizer
 * state; a per-step context holds activations, the autograd tape and
 * non-leaf gradients and is reset once per step. nb_ctx_reset() is O(1)
 * when the context fits in one block; when it grew past its first block it
 * coalesces into one block of the peak size, so the next step allocates
 * nothing. */
#ifndef NABLA_CONTEXT_H
#define NABLA_CONTEXT_H

#include <stddef.h>

#include "nabla/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_ctx nb_ctx;

/* A context whose tensors live on `device`. `initial_bytes` = 0 picks a
 * default (1 MiB); the arena grows on demand either way. */
nb_ctx *nb_ctx_new(nb_device device, size_t initial_bytes);
void nb_ctx_free(nb_ctx *ctx); /* NULL is fine */

/* Forgets every tensor and tape node made in the context. */
void nb_ctx_reset(nb_ctx *ctx);

nb_device nb_ctx_device(const nb_ctx *ctx);
size_t nb_ctx_used(const nb_ctx *ctx);     /* bytes handed out since reset */
size_t nb_ctx_peak(const nb_ctx *ctx);     /* largest nb_ctx_used() seen */
size_t nb_ctx_reserved(const nb_ctx *ctx); /* bytes held from the system */

/* Raw memory from the context's arena, aligned to 64 bytes, zero-filled
 * when `zero` is set. Never NULL: running out of memory is reported through
 * nb_abort with the context's usage. */
void *nb_ctx_alloc(nb_ctx *ctx, size_t bytes, int zero);

#ifdef __cplusplus
}
#endif
#endif
