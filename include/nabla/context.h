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

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "nabla/api.h"
#include "nabla/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_ctx nb_ctx;

/* A context whose tensors live on `device`. `initial_bytes` = 0 picks a
 * default (1 MiB); the arena grows on demand either way. */
NB_API nb_ctx *nb_ctx_new(nb_device device, size_t initial_bytes);
NB_API void nb_ctx_free(nb_ctx *ctx); /* NULL is fine */

/* Forgets every tensor and tape node made in the context. */
NB_API void nb_ctx_reset(nb_ctx *ctx);

NB_API nb_device nb_ctx_device(const nb_ctx *ctx);
NB_API size_t nb_ctx_used(const nb_ctx *ctx);     /* bytes handed out and not given back */
NB_API size_t nb_ctx_peak(const nb_ctx *ctx);     /* largest nb_ctx_used() seen */
NB_API size_t nb_ctx_reserved(const nb_ctx *ctx); /* bytes held from the system */
/* Largest extent of the context's blocks ever touched: the peak plus the
 * holes that memory given back left between live tensors. */
NB_API size_t nb_ctx_extent(const nb_ctx *ctx);

/* A device's totals over all of its contexts (PyTorch's
 * torch.cuda.memory_allocated / max_memory_allocated): the bytes handed out
 * and not given back by every context on `device` together, and the
 * largest such total since the program started or since
 * nb_device_reset_peak (which sets it to the total now). A step's
 * activations and a model's gradients and optimizer state live in
 * different contexts and may peak at different moments: this is the peak
 * of their sum, not the sum of their peaks. Any device, the meta devices
 * included (meta:cuda counts apart from cuda:0). */
NB_API size_t nb_device_allocated(nb_device device);
NB_API size_t nb_device_max_allocated(nb_device device);
NB_API void nb_device_reset_peak(nb_device device);

/* Peak report ("what is live at the peak, and does it fit"): from
 * nb_ctx_watch_peak(ctx, true) on, each time ctx's live total reaches its
 * peak the library notes every live tensor it made through ctx (while ctx
 * gives back, the default) with the op whose node made it ("backward" for
 * one a backward function made), dtype, shape and bytes; nb_ctx_print_peak
 * writes the last such moment to f, grouped by op, dtype and shape, largest
 * first (at most max_rows lines, 0: all), with the bytes no tensor holds
 * (kernels' scratch). One context at a time; it slows allocation while on;
 * works on every device, the meta device included. Note [Peak report] in
 * tensor/memory.c. */
NB_API void nb_ctx_watch_peak(nb_ctx *ctx, bool on);
NB_API void nb_ctx_print_peak(const nb_ctx *ctx, FILE *f, int max_rows);

/* Whether the library gives back, within a step, the memory of tensors it
 * made for itself once nothing needs them (default on): module-internal
 * activations after the backward that used them, non-leaf gradients,
 * backward temporaries. Off, every tensor lives until nb_ctx_reset.
 * Results are the same either way; only the peak memory differs. Note
 * [Memory given back] in tensor/memory.c; nb_keep in nabla/tensor.h. */
NB_API void nb_ctx_set_give_back(nb_ctx *ctx, int on);

/* The dtype that nb_matmul and nb_conv2d compute in for f32 inputs made
 * in this context: NB_F32 (default), NB_BF16 (CPU and CUDA) or NB_F16
 * (CUDA only; refused on the CPU). Inputs are cast (recorded by autograd),
 * products accumulate in f32 and write the compute dtype, the activations
 * between ops stay in it (f32 arithmetic inside each op) and a loss is
 * f32: mixed precision with f32 parameters and master weights. What each
 * op returns: docs/cuda.md, "What each op returns under a compute dtype". */
NB_API void nb_ctx_set_compute_dtype(nb_ctx *ctx, nb_dtype dtype);
NB_API nb_dtype nb_ctx_compute_dtype(const nb_ctx *ctx);

/* Raw memory from the context's arena (device memory for a CUDA context),
 * aligned to 64 bytes, zero-filled when `zero` is set. Never NULL: running out of memory is reported through
 * nb_abort with the context's usage. */
NB_API void *nb_ctx_alloc(nb_ctx *ctx, size_t bytes, int zero);

#ifdef __cplusplus
}
#endif
#endif
