/* CPU kernel of nb_matmul: batched, broadcast GEMM through OpenBLAS cblas
 * on strided operands, without copies when BLAS can read them as they are.
 *
 * Letters: L batch dims, M and N output rows and columns, K inner size. */
#ifndef NABLA_TENSOR_CPU_MATMUL_H
#define NABLA_TENSOR_CPU_MATMUL_H

#include <stdbool.h>

#include "tensor/backend.h" /* nb__backend_*_fn */

/* True when BLAS can read the last two dims of t in place: unit stride in
 * one of them and a leading dimension that fits an int in the other. */
nb__backend_gemm_readable_fn nb__cpu_gemm_readable;

/* out (L, M, N), contiguous = op(a) (La, M, K) @ op(b) (Lb, K, N), where
 * La and Lb broadcast to L and op() swaps the last two dims when the flag
 * is set. a and b are readable (above) and have out's dtype, f32 or f64,
 * or are both bf16 with out f32 (products of bf16 values summed in f32);
 * M, N and K fit an int. K = 0 gives zeros. With accumulate, the product
 * is added to what out holds (BLAS beta = 1) instead. */
void nb__cpu_gemm(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                  bool trans_b, bool accumulate);

#endif
