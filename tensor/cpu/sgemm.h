/* f32 GEMM with causal structure for the fused attention's per-head
 * products (tensor/cpu/sgemm.c, used by tensor/cpu/attention.c).
 *
 * Note [Causal products]
 * Half of every T x T product of causal attention is known in advance:
 * the scores q k^T and dp = gy v^T are only read on and below the
 * diagonal, and p and ds are exactly zero above it, so in p v, ds k,
 * ds^T q and p^T gy row i sums over k <= i (or k >= i for the transposed
 * ones) only. OpenBLAS computes the whole products. This GEMM skips the
 * register tiles above the diagonal and cuts each row panel's k range,
 * about half of the multiply-adds at T = 128 (~0.56 of them with the
 * tiles that straddle the diagonal). It is also quicker than OpenBLAS on
 * these small shapes, whose fixed cost dominates there: one thread, no
 * dispatch, operands packed straight into thread-local panels.
 *
 * The kernel: A packed in panels of 6 rows, B in panels of 16 columns, K
 * in blocks of 256, and a 6 x 16 register tile of FMAs (AVX2 and FMA; an
 * 8 x 16 tile of 16-wide FMAs with AVX-512F;
 * elsewhere cblas_sgemm computes the full product, whose extra terms are
 * the exact zeros above). Each element of C is one chain of fused
 * multiply-adds, k in order, so the result depends only on the operands:
 * not on threads, nor on where the tiles fall. Skipped terms are products
 * with exact zeros, so C's values are those of the full product up to the
 * sign of a zero, and a non-finite entry beyond the diagonal of v or gy
 * no longer makes NaNs in rows that never see it. */
#ifndef NABLA_TENSOR_CPU_SGEMM_H
#define NABLA_TENSOR_CPU_SGEMM_H

#include <stdbool.h>
#include <stdint.h>

typedef enum nb__tri {
    NB_TRI_FULL,       /* all of c */
    NB_TRI_LOWER,      /* c[i][j] for j <= i; entries above may be left unwritten */
    NB_TRI_K_UPTO_ROW, /* op(a)[i][p] = 0 for p > i: row i sums p <= i only */
    NB_TRI_K_FROM_ROW, /* op(a)[i][p] = 0 for p < i: row i sums p >= i only */
} nb__tri;

/* c (m x n, row stride ldc) = op(a) op(b), as cblas_sgemm row-major with
 * alpha 1 and beta 0 (c is not read): op(a) is m x k, a[i * lda + p] or,
 * when ta, a[p * lda + i]; op(b) is k x n, b[p * ldb + j] or, when tb,
 * b[j * ldb + p]. Single-threaded: the caller runs heads in parallel. */
void nb__sgemm_causal(nb__tri tri, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                      int64_t ldc);

/* Whether this CPU runs the tile kernel (AVX2 and FMA), unless
 * NABLA_CAUSAL_GEMM=0 in the environment (read on first use; any value but
 * 0 or 1 aborts naming it) or nb__sgemm_set_enabled(0) holds it to
 * cblas_sgemm (set_enabled: 1 or 0, -1 back to the environment, read again
 * at the next use; returns the previous setting). For tests and
 * benchmarks. */
bool nb__sgemm_kernel_on(void);
int nb__sgemm_set_enabled(int on);

/* The tile's vector width in bits: 512 (an 8 x 16 tile) where the CPU has
 * AVX-512F, else 256 (6 x 16); nb__sgemm_set_width(256) holds an AVX-512
 * CPU to the AVX2 tile, 0 back to the widest (512 on a CPU without
 * AVX-512F aborts). Returns the previous width. The values are the same
 * either way (Note [Causal products]); for tests and benchmarks.
 * nb__sgemm_width: the width in use; nb__sgemm_tile_rows: its tile's rows. */
int nb__sgemm_set_width(int bits);
int nb__sgemm_width(void);
int nb__sgemm_tile_rows(void);

#endif
