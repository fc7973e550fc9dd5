/* CPU GEMM for nb_matmul (tensor/cpu/matmul.h), through OpenBLAS cblas.
 *
 * A matrix (R, C) with strides (rs, cs) is handed to BLAS as row-major with
 * ld = rs when cs = 1, or, when rs = 1, as the transpose of a row-major
 * (C, R) with ld = cs; the second case flips the operand's transpose flag,
 * so transposed views cost no copy. When b is one matrix shared by the
 * whole batch and a's batch and row dims collapse into one run of rows, the
 * batch is folded into M and the product is a single GEMM (the linear-layer
 * case, where one large call is much faster than many small ones). */
#include <cblas.h>
#include <limits.h>
#include <string.h>

#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/matmul.h"
#include "tensor/internal.h"

typedef struct layout {
    bool col_major; /* stored as the transpose of a row-major matrix */
    int64_t ld;
} layout;

static bool get_layout(const nb_tensor *t, layout *l) {
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
    return l->ld <= INT_MAX;
}

bool nb__cpu_gemm_readable(const nb_tensor *t) {
    layout l;
    return t->ndim >= 2 && get_layout(t, &l);
}

static void gemm(nb_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void *a,
                 int64_t lda, const void *b, int64_t ldb, double beta, void *c, int64_t ldc) {
    enum CBLAS_TRANSPOSE fa = ta ? CblasTrans : CblasNoTrans, fb = tb ? CblasTrans : CblasNoTrans;
    if (dt == NB_F32)
        cblas_sgemm(CblasRowMajor, fa, fb, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb,
                    (float)beta, c, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, fa, fb, (int)m, (int)n, (int)k, 1.0, a, (int)lda, b, (int)ldb,
                    beta, c, (int)ldc);
}

/* Strides (elements) of t's batch dims aligned to the output's nbd batch
 * dims; missing and size-1 dims get 0. */
static void batch_strides(const nb_tensor *t, int nbd, int64_t *st) {
    for (int i = 0; i < nbd; i++) {
        int d = t->ndim - 2 - nbd + i;
        st[i] = (d < 0 || t->shape[d] == 1) ? 0 : t->strides[d];
    }
}

/* b shared by every batch element, and a's batch dims continue its rows */
static bool can_fold(int nbd, const int64_t *shape, const int64_t *sa, const int64_t *sb,
                     int64_t row_stride, int64_t m) {
    int64_t expect = row_stride * m;
    for (int i = nbd - 1; i >= 0; i--) {
        if (shape[i] == 1) continue;
        if (sb[i] != 0 || sa[i] != expect) return false;
        expect *= shape[i];
    }
    return true;
}

void nb__cpu_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                    bool trans_b, bool accumulate) {
    if (nb__dnnl_matmul(out, a, b, trans_a, trans_b, NULL, false, accumulate)) return;
    if (a->dtype == NB_BF16) { /* no bf16 GEMM in OpenBLAS */
        nb__dnnl_matmul_bf16_fallback(out, a, b, trans_a, trans_b, accumulate);
        return;
    }
    int nbd = out->ndim - 2;
    int64_t m = out->shape[nbd], n = out->shape[nbd + 1];
    int64_t k = a->shape[a->ndim - (trans_a ? 2 : 1)];
    int64_t batch = nb__numel_shape(nbd, out->shape);
    size_t es = nb_dtype_size(out->dtype);
    if (batch == 0 || m == 0 || n == 0) return;
    if (k == 0) {
        if (!accumulate) memset(out->data, 0, (size_t)(batch * m * n) * es);
        return;
    }
    double beta = accumulate ? 1.0 : 0.0;
    layout la, lb;
    NB_CHECK(get_layout(a, &la) && get_layout(b, &lb),
             "nb__cpu_matmul: operands %s and %s are not readable by BLAS in place", nb_shape_str(a),
             nb_shape_str(b));
    bool fa = trans_a != la.col_major, fb = trans_b != lb.col_major;
    int64_t sa[NB_MAX_DIMS], sb[NB_MAX_DIMS];
    batch_strides(a, nbd, sa);
    batch_strides(b, nbd, sb);

    if (batch > 1 && !fa && batch * m <= INT_MAX && can_fold(nbd, out->shape, sa, sb, la.ld, m)) {
        gemm(out->dtype, false, fb, batch * m, n, k, a->data, la.ld, b->data, lb.ld, beta, out->data,
             n);
        return;
    }
    int64_t idx[NB_MAX_DIMS] = {0};
    for (int64_t j = 0; j < batch; j++) {
        int64_t oa = 0, ob = 0;
        for (int i = 0; i < nbd; i++) {
            oa += idx[i] * sa[i];
            ob += idx[i] * sb[i];
        }
        gemm(out->dtype, fa, fb, m, n, k, (const char *)a->data + oa * (int64_t)es, la.ld,
             (const char *)b->data + ob * (int64_t)es, lb.ld, beta,
             (char *)out->data + j * m * n * (int64_t)es, n);
        for (int i = nbd - 1; i >= 0 && ++idx[i] == out->shape[i]; i--) idx[i] = 0;
    }
}
