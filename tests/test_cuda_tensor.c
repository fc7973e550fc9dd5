/* CUDA tensors: contexts on the device (arena growth and reset), creation
 * and reading in every dtype, strided copies between devices, nb_to with
 * its gradient, fills, in-place updates, poisoning, the compute dtype,
 * printing, and staged uploads from a reused host buffer. The reference values are host arrays; skipped without a
 * GPU. */
#include <math.h>
#include <stdlib.h>

#include "cuda_parity.h"
#include "tensor/cuda/cuda.h"

static const nb_dtype all_dtypes[] = {NB_F32, NB_F64, NB_BF16, NB_F16, NB_I32, NB_I64};

START_TEST(test_roundtrip_every_dtype) {
    nb_ctx *host = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nb_cuda(0), 0);
    double v[37];
    for (int i = 0; i < 37; i++) v[i] = (i % 11) - 5 + (i % 2) * 0.5;
    for (int k = 0; k < 6; k++) {
        nb_dtype dt = all_dtypes[k];
        nb_tensor *h = nb_cast(host, nb_from_host(host, NB_F64, NB_SHAPE(37), v), dt);
        nb_tensor *d = nb_to(dev, h);
        ck_assert(nb_device_eq(d->device, nb_cuda(0)));
        ck_assert_int_eq(d->dtype, dt);
        double *got = nbt_values(d), *want = nbt_values(h);
        for (int i = 0; i < 37; i++) ck_assert_double_eq(got[i], want[i]);
        free(got);
        free(want);
        /* raw bytes in the dtype */
        char raw[37 * 8];
        nb_to_host(d, raw);
        ck_assert_int_eq(memcmp(raw, h->data, 37 * nb_dtype_size(dt)), 0);
    }
    nb_ctx_free(dev);
    nb_ctx_free(host);
}
END_TEST

START_TEST(test_strided_copies_between_devices) {
    nb_ctx *host = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *h = nb_arange(host, NB_F32, 0, 24, 1);
    h = nb_reshape(host, h, NB_SHAPE(2, 3, 4));
    nb_tensor *d = nb_to(dev, h);
    /* a non-contiguous device view read back */
    nb_tensor *dv = nb_transpose(dev, d, 0, 2); /* (4, 3, 2) */
    nb_tensor *hv = nb_transpose(host, h, 0, 2);
    double *a = nbt_values(dv), *b = nbt_values(hv);
    for (int i = 0; i < 24; i++) ck_assert_double_eq(a[i], b[i]);
    free(a);
    free(b);
    /* host -> strided device destination, with a cast */
    nb_tensor *dst = nb_zeros(dev, NB_F64, NB_SHAPE(4, 3, 2));
    nb_copy_(dst, hv);
    a = nbt_values(dst);
    for (int64_t i = 0, k = 0; i < 4; i++)
        for (int64_t j = 0; j < 3; j++)
            for (int64_t l = 0; l < 2; l++, k++) ck_assert_double_eq(a[k], (double)(l * 12 + j * 4 + i));
    free(a);
    nb_tensor *dst_t = nb_transpose(dev, nb_zeros(dev, NB_F32, NB_SHAPE(2, 3, 4)), 0, 2);
    nb_copy_(dst_t, hv);
    a = nbt_values(dst_t->base);
    for (int i = 0; i < 24; i++) ck_assert_double_eq(a[i], (double)i);
    free(a);
    /* device -> strided host destination */
    nb_tensor *hdst = nb_transpose(host, nb_zeros(host, NB_F64, NB_SHAPE(2, 3, 4)), 0, 2);
    nb_copy_(hdst, dv);
    a = nbt_values(hdst->base);
    for (int i = 0; i < 24; i++) ck_assert_double_eq(a[i], (double)i);
    free(a);
    nb_ctx_free(dev);
    nb_ctx_free(host);
}
END_TEST

START_TEST(test_elements_fills_arange) {
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *t = nb_full(dev, NB_F32, NB_SHAPE(3, 5), 2.5);
    nb_set(t, (int64_t[]){1, 4}, -7);
    ck_assert_double_eq(nb_get(t, (int64_t[]){1, 4}), -7);
    ck_assert_double_eq(nb_get(t, (int64_t[]){2, 0}), 2.5);
    NBT_EXPECT_ABORT(nb_get(t, (int64_t[]){3, 0}), "out of range");
    ck_assert_double_eq(nb_item(nb_scalar(dev, NB_BF16, 3.0)), 3.0);
    nb_tensor *z = nb_zeros(dev, NB_I64, NB_SHAPE(1000));
    nb_tensor *r = nb_arange(dev, NB_I64, 0, 1000, 1);
    double *a = nbt_values(r), *zv = nbt_values(z);
    for (int i = 0; i < 1000; i++) {
        ck_assert_double_eq(a[i], i);
        ck_assert_double_eq(zv[i], 0);
    }
    free(a);
    free(zv);
    nb_tensor *y = nb_full(dev, NB_F32, NB_SHAPE(4, 6), 1.0);
    nb_tensor *x = nb_arange(dev, NB_F32, 0, 24, 1);
    nb_axpy_(y, 0.5, nb_reshape(dev, x, NB_SHAPE(4, 6)));
    nb_scale_(y, 2.0);
    a = nbt_values(y);
    for (int i = 0; i < 24; i++) ck_assert_double_eq(a[i], 2.0 * (1.0 + 0.5 * i));
    free(a);
    /* a fill through a strided view leaves the rest alone */
    nb_tensor *col = nb_select(dev, y, 1, 2);
    nb_fill_(col, -1);
    a = nbt_values(y);
    for (int i = 0; i < 24; i++) ck_assert_double_eq(a[i], i % 6 == 2 ? -1.0 : 2.0 * (1.0 + 0.5 * i));
    free(a);
    nb_ctx_free(dev);
}
END_TEST

START_TEST(test_arena_growth_and_reset) {
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 4096);
    for (int i = 0; i < 8; i++) nb_full(dev, NB_F32, NB_SHAPE(100000), i);
    size_t reserved = nb_ctx_reserved(dev), peak = nb_ctx_peak(dev);
    ck_assert_uint_ge(peak, 8 * 400000u);
    nb_ctx_reset(dev);
    ck_assert_uint_eq(nb_ctx_used(dev), 0);
    ck_assert_uint_ge(nb_ctx_reserved(dev), reserved);
    /* the steady state: the same step again fits in the one block */
    for (int i = 0; i < 8; i++) nb_full(dev, NB_F32, NB_SHAPE(100000), i);
    ck_assert_uint_eq(nb_ctx_reserved(dev), reserved);
    nb_tensor *t = nb_full(dev, NB_F32, NB_SHAPE(7), 4);
    ck_assert_double_eq(nb_item(nb_sum_all(dev, t)), 28);
    nb_ctx_free(dev);
}
END_TEST

START_TEST(test_poison) {
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    nb__cuda_set_poison(true);
    nb_tensor *f = nb_empty(dev, NB_F32, NB_SHAPE(5));
    nb_tensor *i = nb_empty(dev, NB_I32, NB_SHAPE(5));
    nb__cuda_set_poison(false);
    double *a = nbt_values(f), *b = nbt_values(i);
    for (int k = 0; k < 5; k++) {
        ck_assert(isnan(a[k]));
        ck_assert_double_eq(b[k], -1);
    }
    free(a);
    free(b);
    nb_ctx_free(dev);
}
END_TEST

START_TEST(test_to_carries_gradients_back) {
    nb_ctx *host = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *x = nb_arange(host, NB_F32, 1, 7, 1);
    nb_set_requires_grad(x, true);
    nb_tensor *xd = nb_to(dev, x);
    nb_tensor *loss = nb_sum_all(dev, nb_mul(dev, xd, xd));
    ck_assert_double_eq(nb_item(loss), 91);
    nb_backward(loss);
    ck_assert_ptr_nonnull(x->grad);
    ck_assert(nb_device_eq(x->grad->device, nb_cpu()));
    for (int i = 0; i < 6; i++) ck_assert_double_eq(nb_get(x->grad, (int64_t[]){i}), 2.0 * (i + 1));
    /* and the other way: a CUDA leaf used on the CPU */
    nb_tensor *w = nb_to(dev, nb_arange(host, NB_F32, 0, 4, 1));
    nb_set_requires_grad(w, true);
    nb_backward(nb_sum_all(host, nb_mul_scalar(host, nb_to(host, w), 3.0)));
    ck_assert(nb_device_eq(w->grad->device, nb_cuda(0)));
    double *g = nbt_values(w->grad);
    for (int i = 0; i < 4; i++) ck_assert_double_eq(g[i], 3.0);
    free(g);
    nb_ctx_free(dev);
    nb_ctx_free(host);
}
END_TEST

START_TEST(test_print_device_tensor) {
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *x = nb_from_host(dev, NB_F32, NB_SHAPE(2), (float[]){1.0f, -2.5f});
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_tensor_fprint(f, x);
    fclose(f);
    ck_assert_str_eq(buf, "tensor([ 1.0000, -2.5000], dtype=f32, shape=(2,), device=cuda:0)\n");
    free(buf);
    nb_ctx_free(dev);
}
END_TEST

/* Compute dtype bf16: matmul from f32 operands gives f32 close to the
 * f32 product, and gradients reach the f32 leaves in f32. */
START_TEST(test_compute_dtype_bf16) {
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_ctx_set_compute_dtype(dev, NB_BF16);
    ck_assert_int_eq(nb_ctx_compute_dtype(dev), NB_BF16);
    nb_tensor *a = nb_rand_uniform(dev, NB_F32, NB_SHAPE(16, 32), -1, 1, NULL);
    nb_tensor *b = nb_rand_uniform(dev, NB_F32, NB_SHAPE(32, 8), -1, 1, NULL);
    nb_set_requires_grad(a, true);
    nb_set_requires_grad(b, true);
    nb_tensor *c = nb_matmul(dev, a, b);
    ck_assert_int_eq(c->dtype, NB_F32);
    nb_backward(nb_sum_all(dev, c));
    ck_assert_int_eq(a->grad->dtype, NB_F32);
    ck_assert_int_eq(b->grad->dtype, NB_F32);
    /* reference in f64 on the host */
    double *av = nbt_values(a), *bv = nbt_values(b), *cv = nbt_values(c);
    double worst = 0, scale = 0;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 8; j++) {
            double s = 0;
            for (int k = 0; k < 32; k++) s += av[i * 32 + k] * bv[k * 8 + j];
            worst = fmax(worst, fabs(s - cv[i * 8 + j]));
            scale = fmax(scale, fabs(s));
        }
    ck_assert_msg(worst / scale < NBT_TOL_BF16, "bf16 matmul error %g", worst / scale);
    free(av);
    free(bv);
    free(cv);
    nb_ctx_free(dev);
}
END_TEST

/* Note [Staged uploads]: many small uploads in a row (more than the ring's
 * 16 segments, so segments are reused while earlier copies may still be
 * queued behind slow work), each from the same host buffer rewritten right
 * after the call, plus uploads larger than a segment; every tensor must
 * hold what the buffer held when it was uploaded. */
START_TEST(test_staged_uploads_reuse_source) {
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    enum { K = 50, N = 1000, BIG = 300000 };
    nb_tensor *busy = nb_zeros(dev, NB_F32, NB_SHAPE(1 << 24));
    float *buf = malloc(sizeof(float) * BIG);
    ck_assert_ptr_nonnull(buf);
    nb_tensor *t[K];
    for (int k = 0; k < K; k++) {
        if (k % 8 == 0) nb_fill_(busy, (double)k); /* keep the compute stream busy */
        int64_t n = k % 10 == 9 ? BIG : N;
        for (int64_t i = 0; i < n; i++) buf[i] = (float)(k * 7 + i % 13);
        t[k] = nb_from_host(dev, NB_F32, 1, &n, buf);
        for (int64_t i = 0; i < n; i++) buf[i] = -1.0f; /* the source may be reused at once */
    }
    for (int k = 0; k < K; k++) {
        double *v = nbt_values(t[k]);
        for (int64_t i = 0; i < nb_numel(t[k]); i++)
            ck_assert_msg(v[i] == (double)(k * 7 + i % 13), "upload %d element %lld: %g", k,
                          (long long)i, v[i]);
        free(v);
    }
    free(buf);
    nb_ctx_free(dev);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    Suite *s = suite_create("cuda_tensor");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_roundtrip_every_dtype);
    tcase_add_test(tc, test_strided_copies_between_devices);
    tcase_add_test(tc, test_elements_fills_arange);
    tcase_add_test(tc, test_arena_growth_and_reset);
    tcase_add_test(tc, test_poison);
    tcase_add_test(tc, test_to_carries_gradients_back);
    tcase_add_test(tc, test_print_device_tensor);
    tcase_add_test(tc, test_compute_dtype_bf16);
    tcase_add_test(tc, test_staged_uploads_reuse_source);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
