/* Tensors: contexts, creation, dtypes, views, random streams, printing. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "testutil.h"

START_TEST(test_ctx_reset_and_peak) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 4096);
    ck_assert_uint_eq(nb_ctx_used(ctx), 0);
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(10, 10)); /* 400 bytes -> 448 aligned */
    ck_assert_ptr_nonnull(a);
    ck_assert_uint_ge(nb_ctx_used(ctx), 400);
    /* grow past the first block */
    nb_zeros(ctx, NB_F64, NB_SHAPE(1000));
    size_t used = nb_ctx_used(ctx);
    ck_assert_uint_ge(used, 8400);
    ck_assert_uint_ge(nb_ctx_reserved(ctx), used);
    nb_ctx_reset(ctx);
    ck_assert_uint_eq(nb_ctx_used(ctx), 0);
    ck_assert_uint_eq(nb_ctx_peak(ctx), used);
    /* after coalescing, the same work fits in one block: reserved unchanged */
    size_t reserved = nb_ctx_reserved(ctx);
    nb_zeros(ctx, NB_F32, NB_SHAPE(10, 10));
    nb_zeros(ctx, NB_F64, NB_SHAPE(1000));
    ck_assert_uint_eq(nb_ctx_reserved(ctx), reserved);
    nb_ctx_reset(ctx);
    ck_assert_uint_eq(nb_ctx_reserved(ctx), reserved);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_creation) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *z = nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3));
    nb_tensor *o = nb_ones(ctx, NB_I32, NB_SHAPE(4));
    nb_tensor *f = nb_full(ctx, NB_F32, NB_SHAPE(2, 2), 2.5);
    ck_assert_int_eq(z->ndim, 2);
    ck_assert_int_eq(nb_numel(z), 6);
    ck_assert(nb_is_contiguous(z));
    ck_assert_int_eq(z->strides[0], 3);
    double e0[6] = {0}, e1[4] = {1, 1, 1, 1}, e2[4] = {2.5, 2.5, 2.5, 2.5};
    nbt_assert_close(z, e0, 0, 0);
    nbt_assert_close(o, e1, 0, 0);
    nbt_assert_close(f, e2, 0, 0);
    nb_tensor *r = nb_arange(ctx, NB_I64, 2, 11, 3);
    double er[3] = {2, 5, 8};
    ck_assert_int_eq(nb_numel(r), 3);
    nbt_assert_close(r, er, 0, 0);
    nb_tensor *rn = nb_arange(ctx, NB_F64, 1, 0, -0.25);
    double ern[4] = {1, 0.75, 0.5, 0.25};
    nbt_assert_close(rn, ern, 0, 0);
    float host[6] = {1, 2, 3, 4, 5, 6};
    nb_tensor *h = nb_from_host(ctx, NB_F32, NB_SHAPE(3, 2), host);
    ck_assert_double_eq(nb_get(h, (int64_t[]){2, 1}), 6);
    float back[6];
    nb_to_host(h, back);
    for (int i = 0; i < 6; i++) ck_assert_float_eq(back[i], host[i]);
    nb_tensor *s = nb_scalar(ctx, NB_F64, 7);
    ck_assert_int_eq(s->ndim, 0);
    ck_assert_double_eq(nb_item(s), 7);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_half_conversions) {
    /* closed forms: exactly representable values round-trip, halfway cases round to even */
    float exact[] = {0.0f, 1.0f, -2.0f, 0.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f};
    for (unsigned i = 0; i < sizeof exact / sizeof exact[0]; i++)
        ck_assert_float_eq(nb_f16_to_f32(nb_f32_to_f16(exact[i])), exact[i]);
    ck_assert_uint_eq(nb_f32_to_f16(1.0f), 0x3c00);
    ck_assert_uint_eq(nb_f32_to_f16(65520.0f), 0x7c00); /* overflow -> inf */
    ck_assert_uint_eq(nb_f32_to_f16(1.0f + 1.0f / 2048), 0x3c00); /* tie -> even */
    ck_assert_uint_eq(nb_f32_to_f16(1.0f + 3.0f / 2048), 0x3c02);
    ck_assert(isnan(nb_f16_to_f32(nb_f32_to_f16(NAN))));
    ck_assert_uint_eq(nb_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(nb_f32_to_bf16(1.0f + 1.0f / 256), 0x3f80); /* tie -> even */
    ck_assert_uint_eq(nb_f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
    ck_assert_float_eq(nb_bf16_to_f32(nb_f32_to_bf16(-3.5f)), -3.5f);
    ck_assert(isnan(nb_bf16_to_f32(nb_f32_to_bf16(NAN))));
    /* every f16 bit pattern (not NaN) survives f16 -> f32 -> f16 */
    for (uint32_t h = 0; h < 65536; h++) {
        float v = nb_f16_to_f32((uint16_t)h);
        if (isnan(v)) continue;
        ck_assert_uint_eq(nb_f32_to_f16(v), h);
    }
}
END_TEST

START_TEST(test_casts) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(4), (double[]){1.5, -2.25, 3.0, 1e-3});
    nb_tensor *b = nb_cast(ctx, x, NB_BF16);
    nb_tensor *h = nb_cast(ctx, x, NB_F16);
    nb_tensor *i = nb_cast(ctx, x, NB_I32);
    ck_assert_int_eq(b->dtype, NB_BF16);
    double eb[4] = {1.5, -2.25, 3.0, nb_bf16_to_f32(nb_f32_to_bf16(1e-3f))};
    nbt_assert_close(b, eb, 0, 0);
    double eh[4] = {1.5, -2.25, 3.0, nb_f16_to_f32(nb_f32_to_f16(1e-3f))};
    nbt_assert_close(h, eh, 0, 0);
    double ei[4] = {1, -2, 3, 0};
    nbt_assert_close(i, ei, 0, 0);
    NBT_EXPECT_ABORT(nb_add(ctx, b, b), "storage type");
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_views_share_storage) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_arange(ctx, NB_F64, 0, 24, 1);
    nb_tensor *m = nb_reshape(ctx, x, NB_SHAPE(2, 3, 4));
    ck_assert_ptr_eq(m->data, x->data);
    nb_tensor *t = nb_transpose(ctx, m, 0, 2); /* (4, 3, 2) */
    ck_assert_int_eq(t->shape[0], 4);
    ck_assert(!nb_is_contiguous(t));
    ck_assert_double_eq(nb_get(t, (int64_t[]){3, 1, 1}), 1 * 12 + 1 * 4 + 3);
    nb_tensor *n = nb_narrow(ctx, m, 2, 1, 2); /* (2, 3, 2) */
    ck_assert_double_eq(nb_get(n, (int64_t[]){1, 2, 0}), 12 + 8 + 1);
    nb_tensor *sl = nb_slice(ctx, x, 0, 1, 24, 5); /* 1, 6, 11, 16, 21 */
    double es[5] = {1, 6, 11, 16, 21};
    nbt_assert_close(sl, es, 0, 0);
    nb_tensor *sel = nb_select(ctx, m, 1, -1); /* (2, 4): m[:, 2, :] */
    double esel[8] = {8, 9, 10, 11, 20, 21, 22, 23};
    nbt_assert_close(sel, esel, 0, 0);
    nb_tensor *p = nb_permute(ctx, m, (int[]){1, 2, 0}); /* (3, 4, 2) */
    ck_assert_double_eq(nb_get(p, (int64_t[]){2, 3, 1}), 12 + 8 + 3);
    nb_tensor *e = nb_expand(ctx, nb_reshape(ctx, nb_arange(ctx, NB_F64, 0, 3, 1), NB_SHAPE(3, 1)),
                             NB_SHAPE(2, 3, 4));
    ck_assert_int_eq(e->strides[0], 0);
    ck_assert_double_eq(nb_get(e, (int64_t[]){1, 2, 3}), 2);
    /* writes through a view are seen by the base */
    nb_set(t, (int64_t[]){0, 0, 1}, -5);
    ck_assert_double_eq(nb_get(x, (int64_t[]){12}), -5);
    /* reshape of a transposed view copies; values follow row-major order of the view */
    nb_tensor *tr = nb_transpose(ctx, nb_reshape(ctx, nb_arange(ctx, NB_F64, 0, 6, 1), NB_SHAPE(2, 3)), 0, 1);
    nb_tensor *flat = nb_reshape(ctx, tr, NB_SHAPE(-1));
    double ef[6] = {0, 3, 1, 4, 2, 5};
    nbt_assert_close(flat, ef, 0, 0);
    /* reshape of a narrowed view that is still viewable shares storage */
    nb_tensor *rows = nb_narrow(ctx, m, 0, 1, 1);
    nb_tensor *r2 = nb_reshape(ctx, rows, NB_SHAPE(12));
    ck_assert_ptr_eq(r2->data, rows->data);
    nb_tensor *u = nb_unsqueeze(ctx, sel, 0);
    ck_assert_int_eq(u->ndim, 3);
    ck_assert_int_eq(nb_squeeze(ctx, u, 0)->ndim, 2);
    nb_tensor *fl = nb_flatten(ctx, m, 1, 2);
    ck_assert_int_eq(fl->shape[1], 12);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_view_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_reshape(ctx, x, NB_SHAPE(4, 2)), "cannot reshape (2, 3)");
    NBT_EXPECT_ABORT(nb_narrow(ctx, x, 1, 2, 2), "out of bounds");
    NBT_EXPECT_ABORT(nb_transpose(ctx, x, 0, 2), "dimension 2 out of range");
    NBT_EXPECT_ABORT(nb_expand(ctx, x, NB_SHAPE(2, 4)), "cannot expand (2, 3) to (2, 4)");
    NBT_EXPECT_ABORT(nb_get(x, (int64_t[]){0, 3}), "index 3 out of range");
    NBT_EXPECT_ABORT(nb_zeros(ctx, NB_F32, NB_SHAPE(1, 1, 1, 1, 1, 1, 1)), "at most 6");
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_random_streams) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(42);
    nb_tensor *u = nb_rand_uniform(ctx, NB_F64, NB_SHAPE(10), -1, 1, &rng);
    ck_assert_uint_eq(rng.offset, 3); /* ceil(10 / 4) */
    uint32_t r[4];
    for (int i = 0; i < 10; i++) {
        nb_philox4x32(42, (uint64_t)(i / 4), r);
        double expect = -1 + 2 * (double)nb_u32_to_unit(r[i % 4]);
        ck_assert_double_eq_tol(nb_get(u, (int64_t[]){i}), expect, 1e-15);
    }
    /* the same generator state gives the same numbers; another seed does not */
    nb_rng a = nb_rng_make(7), b = nb_rng_make(7), c = nb_rng_make(8);
    nb_tensor *ta = nb_rand_normal(ctx, NB_F32, NB_SHAPE(5), 0, 1, &a);
    nb_tensor *tb = nb_rand_normal(ctx, NB_F32, NB_SHAPE(5), 0, 1, &b);
    nb_tensor *tc = nb_rand_normal(ctx, NB_F32, NB_SHAPE(5), 0, 1, &c);
    nbt_assert_tensors_close(ta, tb, 0, 0);
    ck_assert(nb_get(ta, (int64_t[]){0}) != nb_get(tc, (int64_t[]){0}));
    /* moments of a large normal sample */
    nb_tensor *big = nb_rand_normal(ctx, NB_F64, NB_SHAPE(200000), 2.0, 3.0, &rng);
    double mean = nb_item(nb_mean_all(ctx, big));
    double var = nb_item(nb_var(ctx, big, 0, NULL, 1, false));
    ck_assert_double_eq_tol(mean, 2.0, 0.03);
    ck_assert_double_eq_tol(var, 9.0, 0.15);
    nb_tensor *ub = nb_rand_uniform(ctx, NB_F64, NB_SHAPE(200000), 0, 1, &rng);
    ck_assert_double_eq_tol(nb_item(nb_mean_all(ctx, ub)), 0.5, 0.005);
    ck_assert_double_eq_tol(nb_item(nb_max(ctx, ub, 0, NULL, false)), 1.0, 1e-3);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_philox_known_answer) {
    /* Published Philox-4x32-10 known-answer vector (Random123 kat_vectors):
     * counter = 0, key = 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8. */
    uint32_t r[4];
    nb_philox4x32(0, 0, r);
    ck_assert_uint_eq(r[0], 0x6627e8d5u);
    ck_assert_uint_eq(r[1], 0xe169c58du);
    ck_assert_uint_eq(r[2], 0xbc57ac4cu);
    ck_assert_uint_eq(r[3], 0x9b00dbd8u);
}
END_TEST

START_TEST(test_print) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(2, 2), (float[]){1, -2.5f, 3, 4});
    nb_tensor_fprint(f, x);
    fflush(f);
    ck_assert_str_eq(buf, "tensor([[ 1.0000, -2.5000],\n        [ 3.0000,  4.0000]], dtype=f32, shape=(2, 2))\n");
    fclose(f);
    free(buf);
    f = open_memstream(&buf, &len);
    nb_tensor_fprint(f, nb_arange(ctx, NB_I64, 0, 2000, 1));
    fflush(f);
    ck_assert_str_eq(buf, "tensor([   0,    1,    2, ..., 1997, 1998, 1999], dtype=i64, shape=(2000,))\n");
    fclose(f);
    free(buf);
    nb_ctx_free(ctx);
}
END_TEST

/* The device-facing API on a machine (or build) without a GPU: the
 * queries agree with each other, a CUDA context is refused with a message
 * naming the device, the compute dtype is CUDA-only, and nb_to on the
 * same device is the identity. */
START_TEST(test_devices_without_gpu) {
    ck_assert(nb_cuda_available() == (nb_cuda_device_count() > 0));
    if (nb_cuda_device_count() == 0) {
        NBT_EXPECT_ABORT(nb_ctx_new(nb_cuda(0), 0), "nb_ctx_new: device cuda:0");
    }
    NBT_EXPECT_ABORT(nb_ctx_new(nb_cuda(nb_cuda_device_count()), 0), "cuda:");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    ck_assert_int_eq(nb_ctx_compute_dtype(ctx), NB_F32);
    NBT_EXPECT_ABORT(nb_ctx_set_compute_dtype(ctx, NB_BF16), "needs a CUDA context");
    NBT_EXPECT_ABORT(nb_ctx_set_compute_dtype(ctx, NB_I32), "not a compute dtype");
    nb_ctx_set_compute_dtype(ctx, NB_F32);
    nb_tensor *x = nb_arange(ctx, NB_F32, 0, 6, 1);
    ck_assert_ptr_eq(nb_to(ctx, x), x);
    nb_cuda_set_allow_tf32(true);
    ck_assert(nb_cuda_allow_tf32() == (NABLA_HAVE_CUDA != 0));
    nb_cuda_set_allow_tf32(false);
    ck_assert(!nb_cuda_allow_tf32());
    NBT_EXPECT_ABORT(nb_cuda_synchronize(nb_cpu()), "nb_cuda_synchronize");
    nb_ctx_free(ctx);
}
END_TEST

int main(void) {
    Suite *s = suite_create("tensor");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_ctx_reset_and_peak);
    tcase_add_test(tc, test_creation);
    tcase_add_test(tc, test_half_conversions);
    tcase_add_test(tc, test_casts);
    tcase_add_test(tc, test_views_share_storage);
    tcase_add_test(tc, test_view_errors);
    tcase_add_test(tc, test_random_streams);
    tcase_add_test(tc, test_philox_known_answer);
    tcase_add_test(tc, test_print);
    tcase_add_test(tc, test_devices_without_gpu);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
