/* How a GEMM library reads a matrix in place: the last two dims of a
 * tensor as a row-major matrix with a leading dimension, or as the
 * transpose of one (column-major); and how the batch dims line up. Shared
 * by the CPU GEMM (BLAS, tensor/cpu/matmul.c) and the CUDA one (cuBLASLt,
 * tensor/cuda/matmul.cu); each adds its own limits on the leading
 * dimension. */
#ifndef NABLA_TENSOR_GEMM_LAYOUT_H
#define NABLA_TENSOR_GEMM_LAYOUT_H

#include <stdbool.h>
#include <stdint.h>

#include "tensor/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb__gemm_layout {
    bool col_major; /* stored as the transpose of a row-major matrix */
    int64_t ld;     /* elements between rows (columns when col_major) */
} nb__gemm_layout;

/* True when the last two dims (r, c) of t (ndim >= 2) are a matrix a GEMM
 * reads in place: unit stride in one dim and a leading dimension of at
 * least the other's size in the other (any, where that dim has size 1;
 * empty matrices are row-major). Fills l. */
static inline bool nb__gemm_layout_of(const nb_tensor *t, nb__gemm_layout *l) {
    int nd = t->ndim;
    int64_t r = t->shape[nd - 2], c = t->shape[nd - 1];
    int64_t rs = t->strides[nd - 2], cs = t->strides[nd - 1];
    int64_t min_row = c > 1 ? c : 1, min_col = r > 1 ? r : 1;
    if (r == 0 || c == 0) {
        l->col_major = false;
        l->ld = min_row;
    } else if ((c == 1 || cs == 1) && (r == 1 || rs >= min_row)) {
        l->col_major = false;
        l->ld = r == 1 ? min_row : rs;
    } else if ((r == 1 || rs == 1) && (c == 1 || cs >= min_col)) {
        l->col_major = true;
        l->ld = c == 1 ? min_col : cs;
    } else {
        return false;
    }
    return true;
}

/* Strides (elements) of t's batch dims aligned to the output's nbd batch
 * dims; missing and size-1 dims get 0. */
static inline void nb__gemm_batch_strides(const nb_tensor *t, int nbd, int64_t *st) {
    for (int i = 0; i < nbd; i++) {
        int d = t->ndim - 2 - nbd + i;
        st[i] = (d < 0 || t->shape[d] == 1) ? 0 : t->strides[d];
    }
}

/* True when b (strides sb) is shared by every batch element and a's batch
 * dims (strides sa) continue its m rows of row_stride: the batch folds
 * into the rows of one product. */
static inline bool nb__gemm_can_fold(int nbd, const int64_t *shape, const int64_t *sa,
                                     const int64_t *sb, int64_t row_stride, int64_t m) {
    int64_t expect = row_stride * m;
    for (int i = nbd - 1; i >= 0; i--) {
        if (shape[i] == 1) continue;
        if (sb[i] != 0 || sa[i] != expect) return false;
        expect *= shape[i];
    }
    return true;
}

/* Dims [lo, hi) of `shape` with strides st flatten to one stride (*s):
 * st[i] = *s * (product of the sizes after i), size-1 dims ignored. */
static inline bool nb__gemm_flat_stride(const int64_t *shape, const int64_t *st, int lo, int hi,
                                        int64_t *s) {
    int64_t cnt = 1, s0 = 0;
    bool have = false;
    for (int i = hi - 1; i >= lo; i--) {
        if (shape[i] == 1) continue;
        if (!have) {
            s0 = st[i];
            have = true;
        } else if (st[i] != s0 * cnt) {
            return false;
        }
        cnt *= shape[i];
    }
    *s = s0;
    return true;
}

#ifdef __cplusplus
}
#endif
#endif
