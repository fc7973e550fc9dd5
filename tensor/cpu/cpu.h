/* The CPU backend's kernels: one per row of NB__BACKEND_KERNELS
 * (tensor/backend.h), each declared here through its entry's function
 * type, whose contract is written there, and defined in its family's file:
 * the elementwise engine (tensor/cpu/elementwise.c), row reductions
 * (reduce.c), GEMM (matmul.c), softmax and cross-entropy (softmax.c),
 * normalisation (norm.c), convolution (conv.c), pooling (pool.c), random
 * fills and axpy (fill.c), dropout, embedding and the elementwise losses
 * (dropout.c, embedding.c, loss.c), multi-tensor updates (optim.c),
 * per-channel statistics (channel.c). Where a kernel's own signature is
 * narrower than the entry's (it takes scratch memory, or returns a value),
 * the entry is an adapter in tensor/cpu/backend.c and the kernel keeps its
 * prototype in its family's header. */
#ifndef NABLA_TENSOR_CPU_CPU_H
#define NABLA_TENSOR_CPU_CPU_H

#include "tensor/backend.h"

#define NB__CPU_DECLARE(e) nb__backend_##e##_fn nb__cpu_##e;
NB__BACKEND_KERNELS(NB__CPU_DECLARE)
#undef NB__CPU_DECLARE

/* dx = g * GELU_tanh'(x), all three contiguous f32 of one shape: the
 * gradient of nb_gelu(NB_GELU_TANH) in one pass (tensor/cpu/elementwise.c;
 * the gelu_tanh_backward entry uses it where it applies). */
nb__backend_gelu_tanh_backward_fn nb__cpu_gelu_tanh_backward_f32;

#endif
