/* CPU kernels of fused causal self-attention (tensor/cpu/attention.h).
 *
 * Each head is a handful of small GEMMs that read q, k and v in place
 * inside qkv's rows (leading dimension 3C) and write y and dqkv in place
 * too (leading dimensions C and 3C), so that the split, the head
 * transposes and their copies of the composed form (and, in backward, the
 * zeroed gradient buffer the three slices add into) disappear. A head's
 * scores are used right after they are made, while they are in cache. The
 * products are the ones the composed form makes, one cblas call per head,
 * and the softmax rows are nb__cpu_softmax_causal's. */
#include <cblas.h>

#include "tensor/cpu/attention.h"
#include "tensor/cpu/softmax.h"
#include "tensor/internal.h"

/* c (m, n), ldc = op(a) (m, k) @ op(b) (k, n), row-major, beta = 0 */
static void gemm(nb_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void *a,
                 int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc) {
    enum CBLAS_TRANSPOSE fa = ta ? CblasTrans : CblasNoTrans, fb = tb ? CblasTrans : CblasNoTrans;
    if (dt == NB_F32)
        cblas_sgemm(CblasRowMajor, fa, fb, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb,
                    0.0f, c, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, fa, fb, (int)m, (int)n, (int)k, 1.0, a, (int)lda, b, (int)ldb,
                    0.0, c, (int)ldc);
}

typedef struct dims {
    int64_t n, t, c, d;
    size_t es;
} dims;

static dims get_dims(const nb_tensor *qkv, int h) {
    dims s = {qkv->shape[0], qkv->shape[1], qkv->shape[2] / 3, qkv->shape[2] / 3 / h,
              nb_dtype_size(qkv->dtype)};
    return s;
}

/* address of element (b, 0, col) of a (N, T, w) tensor */
static char *at(const void *base, const dims *s, int64_t w, int64_t b, int64_t col) {
    return (char *)base + (b * s->t * w + col) * (int64_t)s->es;
}

void nb__cpu_causal_attention(nb_tensor *y, nb_tensor *p, const nb_tensor *qkv, int h,
                              double scale) {
    dims s = get_dims(qkv, h);
    int64_t w = 3 * s.c, tt = s.t * s.t;
    for (int64_t b = 0; b < s.n; b++)
        for (int hh = 0; hh < h; hh++) {
            const char *q = at(qkv->data, &s, w, b, hh * s.d);
            const char *k = q + s.c * (int64_t)s.es, *v = q + 2 * s.c * (int64_t)s.es;
            char *ph = (char *)p->data + (b * h + hh) * tt * (int64_t)s.es;
            gemm(qkv->dtype, false, true, s.t, s.t, s.d, q, w, k, w, ph, s.t);
            nb__cpu_causal_rows(qkv->dtype, ph, ph, 1, s.t, s.t, scale);
            gemm(qkv->dtype, false, false, s.t, s.d, s.t, ph, s.t, v, w,
                 at(y->data, &s, s.c, b, hh * s.d), s.c);
        }
}

void nb__cpu_causal_attention_backward(nb_tensor *dqkv, nb_tensor *scratch, const nb_tensor *qkv,
                                       const nb_tensor *p, const nb_tensor *gy, int h,
                                       double scale) {
    dims s = get_dims(qkv, h);
    int64_t w = 3 * s.c, tt = s.t * s.t, cb = s.c * (int64_t)s.es;
    nb_dtype dt = qkv->dtype;
    void *ds = scratch->data;
    for (int64_t b = 0; b < s.n; b++)
        for (int hh = 0; hh < h; hh++) {
            const char *q = at(qkv->data, &s, w, b, hh * s.d), *k = q + cb, *v = q + 2 * cb;
            char *dq = at(dqkv->data, &s, w, b, hh * s.d), *dk = dq + cb, *dv = dq + 2 * cb;
            const char *g = at(gy->data, &s, s.c, b, hh * s.d);
            const char *ph = (const char *)p->data + (b * h + hh) * tt * (int64_t)s.es;
            gemm(dt, false, true, s.t, s.t, s.d, g, s.c, v, w, ds, s.t); /* dp */
            nb__cpu_causal_rows_backward(dt, ds, ph, ds, 1, s.t, s.t, scale);
            gemm(dt, false, false, s.t, s.d, s.t, ds, s.t, k, w, dq, w);
            gemm(dt, true, false, s.t, s.d, s.t, ds, s.t, q, w, dk, w);
            gemm(dt, true, false, s.t, s.d, s.t, ph, s.t, g, s.c, dv, w);
        }
}
