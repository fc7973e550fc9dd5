/* CPU kernels for layer norm and batch norm (tensor/ops_norm.c).
 *
 * Tensors are contiguous; x, y, g, dx, weights and biases share one dtype
 * (f32 or f64), or layer norm's x, y, g, dx are bf16 beside f32 weights;
 * the saved statistics (mean, rstd/invstd) are f64.
 * Layer norm sees x as (M, D): M rows normalised over D elements.
 * Batch norm sees x as (N, C, S): statistics per channel over N and S. */
#ifndef NABLA_TENSOR_CPU_NORM_H
#define NABLA_TENSOR_CPU_NORM_H

#include <stdbool.h>
#include <stdint.h>

#include "tensor/backend.h" /* nb__backend_*_fn */

/* y = (x - mean) rstd w + b per row, with the biased variance; writes
 * mean and rstd (M). w, b (D) or NULL. */
nb__backend_layer_norm_fn nb__cpu_layer_norm;
/* Any of dx (M, D), dw (D), db (D) may be NULL; each written, or added
 * into where add (NB__LN_ADD_*) says so (tensor/backend.h: the rounding
 * of a separate add). ws: 2 D doubles of scratch. */
void nb__cpu_layer_norm_backward_ws(nb_tensor *dx, nb_tensor *dw, nb_tensor *db, double *ws,
                                    const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                    const nb_tensor *rstd, const nb_tensor *w, int64_t m,
                                    int64_t d, unsigned add);

/* Whether layer norm on bf16 x runs without f32 twins (Note [bf16 layer
 * norm in row groups] in tensor/cpu/norm.c): x, out (y or dx) and g bf16
 * and contiguous (out and g may be NULL), w and b f32 or NULL, D small
 * enough. Then the two entries above take bf16 x, y, g and dx. */
bool nb__cpu_layer_norm_half_ok(const nb_tensor *out, const nb_tensor *x, const nb_tensor *g,
                                const nb_tensor *w, const nb_tensor *b, int64_t d);

/* Per-channel mean and biased variance (C) of x. */
void nb__cpu_batch_norm_stats(nb_tensor *mean, nb_tensor *var, const nb_tensor *x, int64_t n,
                              int64_t c, int64_t s);
/* y = (x - mean[c]) invstd[c] w[c] + b[c]; w, b (C) or NULL. */
void nb__cpu_batch_norm_apply(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                              const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                              int64_t n, int64_t c, int64_t s);
/* The whole batch norm (the backend's batch_norm, tensor/backend.h):
 * training: the batch's statistics, the running ones (C, f32/f64, any
 * stride, or NULL) updated with momentum and the unbiased variance; eval:
 * the running ones. mean, invstd (C, f64) receive what y used. */
nb__backend_batch_norm_fn nb__cpu_batch_norm;
/* Any of dx, dw (C), db (C) may be NULL. training: mean and invstd are the
 * batch's, so dx goes through them; otherwise they are constants. */
void nb__cpu_batch_norm_backward_invstd(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                        const nb_tensor *g, const nb_tensor *x,
                                        const nb_tensor *mean, const nb_tensor *invstd,
                                        const nb_tensor *w, bool training, int64_t n, int64_t c,
                                        int64_t s);

#endif
