/* CPU kernels of fused causal self-attention (nn/attention.c), per head
 * straight on the packed projection, without head copies.
 *
 * Letters: N batch, T sequence, H heads, D per head, C = H D. qkv (N, T, 3C)
 * holds q, k and v side by side in each row; head h of q is its columns
 * [h D, h D + D), of k the same plus C, of v plus 2C. All tensors are
 * contiguous f32 or f64 of one dtype, or bf16 with an f32 lse (computed in
 * f32: Note [bf16 attention without twins] in tensor/cpu/attention.c);
 * T, D and 3C fit an int. */
#ifndef NABLA_TENSOR_CPU_ATTENTION_H
#define NABLA_TENSOR_CPU_ATTENTION_H

#include "tensor/backend.h" /* nb__backend_*_fn */

/* For each (n, h): p (T, T) = causal softmax of scale q k^T
 * (nb__cpu_softmax_causal's rows), in scratch, lse[n, h] (T) its rows'
 * log-sum-exp, and y[n, :, h D : h D + D] = p v, so y (N, T, C) comes out
 * in the layout the output projection reads. */
nb__backend_causal_attention_fn nb__cpu_causal_attention;

/* dqkv (N, T, 3C), every element written, from qkv and gy (N, T, C), the
 * gradient of y (y and lse are not read). Per head: p made again (Note [Attention without stored
 * probabilities] in tensor/cpu/attention.c), dp = gy v^T, ds = scale p
 * (dp - sum_j dp p) on the kept entries, dq = ds k, dk = ds^T q,
 * dv = p^T gy. */
nb__backend_causal_attention_backward_fn nb__cpu_causal_attention_backward;

/* The scratch each of them takes from its context: `blocks` (T, T) blocks
 * per thread (1 forward, 2 backward); the meta device's meta:cpu takes the
 * same. */
size_t nb__cpu_attention_scratch_bytes(const nb_tensor *qkv, int h, int blocks);

/* Whether bf16 qkv runs without f32 twins: y or dqkv (out), qkv and gy
 * (NULL in forward) bf16 and contiguous. */
bool nb__cpu_attention_bf16_direct(const nb_tensor *out, const nb_tensor *qkv,
                                   const nb_tensor *gy);

#endif
