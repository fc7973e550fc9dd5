/* CPU GEMM for nb_matmul (tensor/cpu/matmul.h), through OpenBLAS cblas.
 *
 * A matrix (R, C) with strides (rs, cs) is handed to BLAS as row-major with
 * ld = rs when cs = 1, or, when rs = 1, as the transpose of a row-major
 * (C, R) with ld = cs; the second case flips the operand's transpose flag,
 * so transposed views cost no copy. When b is one matrix shared by the
 * whole batch and a's batch and row dims collapse into one run of rows, the
 * batch is folded into M and the product is a single GEMM (the linear-layer
 * case, where one large call is much faster than many small ones).
 *
 * bf16 operands (mixed precision, f32 output): each operand is converted to
 * an f32 twin with the same layout (exact) and the f32 path runs on the
 * twins, so the result is exactly sgemm on the bf16-rounded values: the
 * portable fallback where no bf16 GEMM takes them (Note [Mixed precision
 * on the CPU] in tensor/context.c). */
#include <cblas.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/cpu.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/matmul.h"
#include "tensor/gemm_layout.h"
#include "tensor/internal.h"

typedef nb__gemm_layout layout;

/* In place, with a leading dimension that fits BLAS's int. */
static bool get_layout(const nb_tensor *t, layout *l) {
    return nb__gemm_layout_of(t, l) && l->ld <= INT_MAX;
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

static void swap_last2(nb_tensor *t) {
    int64_t s = t->shape[t->ndim - 2], st = t->strides[t->ndim - 2];
    t->shape[t->ndim - 2] = t->shape[t->ndim - 1];
    t->strides[t->ndim - 2] = t->strides[t->ndim - 1];
    t->shape[t->ndim - 1] = s;
    t->strides[t->ndim - 1] = st;
}

/* f (f32, malloc'd data to free) = t (bf16, readable, no empty dim),
 * dense in t's layout: row- or column-major matrices, batch dims dense
 * outside them except the broadcast (stride 0) ones, which stay so. */
static void f32_twin(nb_tensor *f, const nb_tensor *t) {
    int nd = t->ndim;
    int64_t r = t->shape[nd - 2], c = t->shape[nd - 1];
    bool col_major = c > 1 && t->strides[nd - 1] != 1;
    *f = *t;
    f->dtype = NB_F32;
    f->base = NULL;
    f->strides[nd - 2] = col_major ? 1 : c;
    f->strides[nd - 1] = col_major ? r : 1;
    int64_t size = r * c;
    for (int d = nd - 3; d >= 0; d--) {
        bool bcast = t->strides[d] == 0 && t->shape[d] > 1;
        f->strides[d] = bcast ? 0 : size;
        if (!bcast) size *= t->shape[d];
    }
    f->data = malloc((size_t)size * sizeof(float));
    NB_CHECK(f->data, "nb_matmul: out of memory converting a bf16 operand %s to f32 (%lld bytes)",
             nb_shape_str(t), (long long)(size * (int64_t)sizeof(float)));
    nb_tensor src = *t, dst = *f; /* copied along the unit-stride dim */
    if (col_major) {
        swap_last2(&src);
        swap_last2(&dst);
    }
    nb__cpu_copy(&dst, &src);
}

static void matmul_bf16(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                        bool trans_b, bool accumulate) {
    NB_CHECK(out->dtype == NB_F32 && b->dtype == NB_BF16,
             "nb__cpu_gemm: bf16 operands %s and %s (%s) need an f32 output, got %s",
             nb_shape_str(a), nb_shape_str(b), nb_dtype_name(b->dtype), nb_dtype_name(out->dtype));
    nb_tensor fa, fb;
    f32_twin(&fa, a);
    f32_twin(&fb, b);
    nb__cpu_gemm(out, &fa, &fb, trans_a, trans_b, accumulate);
    free(fa.data);
    free(fb.data);
}

void nb__cpu_gemm(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                  bool trans_b, bool accumulate) {
    if (nb__dnnl_matmul(out, a, b, trans_a, trans_b, NULL, false, accumulate)) return;
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
    if (a->dtype == NB_BF16) {
        matmul_bf16(out, a, b, trans_a, trans_b, accumulate);
        return;
    }
    double beta = accumulate ? 1.0 : 0.0;
    layout la, lb;
    NB_CHECK(get_layout(a, &la) && get_layout(b, &lb),
             "nb__cpu_gemm: operands %s and %s are not readable by BLAS in place", nb_shape_str(a),
             nb_shape_str(b));
    bool fa = trans_a != la.col_major, fb = trans_b != lb.col_major;
    int64_t sa[NB_MAX_DIMS], sb[NB_MAX_DIMS];
    nb__gemm_batch_strides(a, nbd, sa);
    nb__gemm_batch_strides(b, nbd, sb);

    if (batch > 1 && !fa && batch * m <= INT_MAX &&
        nb__gemm_can_fold(nbd, out->shape, sa, sb, la.ld, m)) {
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
