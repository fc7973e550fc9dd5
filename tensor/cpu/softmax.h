/* CPU kernels of the softmax family: softmax, log-softmax and the fused
 * cross-entropy (tensor/ops_softmax.c, tensor/ops_loss.c).
 *
 * All tensors are contiguous f32 or f64 of one dtype. A softmax input is
 * seen as (O, K, I): O the dims before the axis, K the axis, I the dims
 * after it. Cross-entropy takes logits (N, C) and targets (N) of i32/i64
 * that the front end has checked to be in [0, C) or the ignore index. */
#ifndef NABLA_TENSOR_CPU_SOFTMAX_H
#define NABLA_TENSOR_CPU_SOFTMAX_H

#include <stdbool.h>
#include <stdint.h>

#include "tensor/backend.h" /* nb__backend_*_fn */

/* y = softmax(x) or log_softmax(x) along K. */
nb__backend_softmax_fn nb__cpu_softmax;
/* dx from the output y and its gradient g:
 * softmax: dx = y (g - sum_K g y); log-softmax: dx = g - exp(y) sum_K g. */
nb__backend_softmax_backward_fn nb__cpu_softmax_backward;

/* Causal softmax over the last dim of x seen as (B, T, S): row i of each
 * (T, S) matrix is softmax(scale x[i, :i+1]) followed by zeros, never
 * reading x[i, j > i]. Backward: dx = scale y (g - sum_j g y) on the kept
 * positions, 0 on the masked ones. */
nb__backend_softmax_causal_fn nb__cpu_softmax_causal;
nb__backend_softmax_causal_backward_fn nb__cpu_softmax_causal_backward;

/* The same on raw rows (b (T, S) matrices of dtype dt, f32 or f64), for
 * kernels that run them on their own buffers; dx may be g and y may be x.
 * lse, when not NULL, gets each of the b T rows' log-sum-exp of its kept
 * scaled entries, in f32. */
void nb__cpu_causal_rows(nb_dtype dt, void *y, float *lse, const void *x, int64_t b, int64_t t,
                         int64_t s, double scale);
void nb__cpu_causal_rows_backward(nb_dtype dt, void *dx, const void *y, const void *g, int64_t b,
                                  int64_t t, int64_t s, double scale);

/* Class index of row i of targets (i32 or i64). */
int64_t nb__cpu_target_at(const nb_tensor *targets, int64_t i);

/* Writes lse (N) = log sum_c exp(logits[i, c]) for every row (lse may be
 * NULL) and returns the sum over rows whose target is not ignore_index of
 * (1 - eps) (lse - x[t]) + eps (lse - mean_c x[c]). With dlogits (the
 * fused classifier; it may be logits) it also writes what
 * nb__cpu_cross_entropy_backward_rows writes for `scale`, bitwise. */
double nb__cpu_cross_entropy_rows(nb_tensor *lse, nb_tensor *dlogits, const nb_tensor *logits,
                                  const nb_tensor *targets, int64_t ignore_index, double eps,
                                  double scale);
/* dlogits[i, c] = scale (exp(x[i, c] - lse[i]) - eps / C - (1 - eps) [c = t_i])
 * for rows not ignored, 0 for ignored rows. lse NULL: logits hold the
 * fused forward's gradient and dlogits = scale logits. dlogits may be
 * logits. */
void nb__cpu_cross_entropy_backward_rows(nb_tensor *dlogits, const nb_tensor *logits,
                                         const nb_tensor *lse, const nb_tensor *targets,
                                         int64_t ignore_index, double eps, double scale);

#endif
