/* Tensors: contexts, creation, dtypes, views, random streams, printing. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tensor/backend.h"  /* nb__cpu_alloc_cap */
#include "tensor/internal.h" /* NB__ASAN */
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

/* Note [Arena growth]: a doubled block that cannot be had is halved down to
 * the request; only a request that cannot be had itself is out of memory. */
START_TEST(test_ctx_growth_within_what_is_left) {
    const size_t mib = 1 << 20;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), mib);
    nb__cpu_alloc_cap = 3 * mib; /* the "device" has no block over 3 MiB */
    nb_tensor *a = nb_full(ctx, NB_F32, NB_SHAPE(200 * 1024), 1);  /* 0.8 MiB: first block */
    nb_tensor *b = nb_full(ctx, NB_F32, NB_SHAPE(384 * 1024), 2);  /* 1.5 MiB: a 2 MiB block */
    ck_assert_uint_eq(nb_ctx_reserved(ctx), 3 * mib);
    /* 2.5 MiB: the doubled block (4 MiB) is refused, 2 MiB is too small */
    nb_tensor *c = nb_full(ctx, NB_F32, NB_SHAPE(640 * 1024), 3);
    ck_assert_uint_eq(nb_ctx_reserved(ctx), 3 * mib + 640 * 1024 * 4);
    ck_assert_float_eq(nb_get(a, (int64_t[]){200 * 1024 - 1}), 1);
    ck_assert_float_eq(nb_get(b, (int64_t[]){0}), 2);
    ck_assert_float_eq(nb_get(c, (int64_t[]){640 * 1024 - 1}), 3);
    /* a small request after it: the doubled block (5 MiB) is refused,
     * halving reaches 2.5 MiB */
    nb_tensor *d = nb_full(ctx, NB_F32, NB_SHAPE(1024), 4);
    ck_assert_float_eq(nb_get(d, (int64_t[]){1023}), 4);
    ck_assert_uint_eq(nb_ctx_reserved(ctx), 3 * mib + 2 * 640 * 1024 * 4);
    /* a request larger than anything the device has is an error naming it */
    NBT_EXPECT_ABORT(nb_zeros(ctx, NB_F32, NB_SHAPE(1024 * 1024)),
                     "nb_ctx: out of memory allocating 4194304 bytes of tensor data");
    NBT_EXPECT_ABORT(nb_zeros(ctx, NB_F32, NB_SHAPE(1024 * 1024)),
                     "gradient accumulation (train_gpt --batch-size N --grad-accum K)");
    nb__cpu_alloc_cap = 0;
    nb_ctx_free(ctx);
}
END_TEST

NBT_CPU_TEST(test_creation) {
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
}

/* Note [Creation sizes] in tensor/tensor.c: a shape whose element count or
 * byte size overflows is refused, naming the function and the shape, before
 * anything is allocated or written. */
NBT_CPU_TEST(test_creation_size_overflow) {
    int64_t half = INT64_MAX / 2;
    NBT_EXPECT_ABORT(nb_zeros(ctx, NB_F32, NB_SHAPE(half, 4)),
                     "nb_zeros: shape (4611686018427387903, 4) has more than INT64_MAX elements");
    NBT_EXPECT_ABORT(nb_full(ctx, NB_F64, NB_SHAPE(4, 4, half), 1),
                     "nb_full: shape (4, 4, 4611686018427387903) has more than INT64_MAX elements");
    /* the count fits in int64 but its bytes do not */
    NBT_EXPECT_ABORT(nb_empty(ctx, NB_F64, NB_SHAPE(INT64_MAX / 4)),
                     "nb_empty: shape (2305843009213693951,) of f64 needs more than PTRDIFF_MAX");
    NBT_EXPECT_ABORT(nb_rand_normal(ctx, NB_F32, NB_SHAPE(1 << 30, 1 << 30, 4), 0, 1, NULL),
                     "nb_rand_normal: shape (1073741824, 1073741824, 4) of f32 needs more");
    NBT_EXPECT_ABORT(nb_from_host(ctx, NB_I64, NB_SHAPE(3, half), NULL), "nb_from_host: shape (3,");
    NBT_EXPECT_ABORT(nb_arange(ctx, NB_F32, 0, 1e30, 1), "nb_arange: start=0 stop=1e+30 step=1");
    /* views: (2^61 + 1) * 8 wraps to 8, which must not pass for 8 elements */
    nb_tensor *eight = nb_zeros(ctx, NB_F32, NB_SHAPE(8));
    NBT_EXPECT_ABORT(nb_reshape(ctx, eight, NB_SHAPE((1LL << 61) + 1, 8)),
                     "nb_reshape: shape (2305843009213693953, 8) has more than INT64_MAX elements");
    NBT_EXPECT_ABORT(nb_reshape(ctx, eight, NB_SHAPE(-1, (1LL << 61) + 1, 8)),
                     "nb_reshape: shape (-1, 2305843009213693953, 8) has more than INT64_MAX");
    NBT_EXPECT_ABORT(nb_expand(ctx, nb_reshape(ctx, eight, NB_SHAPE(1, 8)), NB_SHAPE((1LL << 61) + 1, 8)),
                     "nb_expand: shape (2305843009213693953, 8) has more than INT64_MAX elements");
    /* a zero anywhere makes an empty tensor, however large the other sizes */
    ck_assert_int_eq(nb_numel(nb_zeros(ctx, NB_F32, NB_SHAPE(INT64_MAX, 0, 8, INT64_MAX))), 0);
}

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

NBT_CPU_TEST(test_casts) {
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
}

NBT_CPU_TEST(test_views_share_storage) {
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
}

NBT_CPU_TEST(test_view_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_reshape(ctx, x, NB_SHAPE(4, 2)), "cannot reshape (2, 3)");
    NBT_EXPECT_ABORT(nb_narrow(ctx, x, 1, 2, 2), "out of bounds");
    NBT_EXPECT_ABORT(nb_transpose(ctx, x, 0, 2), "dimension 2 out of range");
    NBT_EXPECT_ABORT(nb_expand(ctx, x, NB_SHAPE(2, 4)), "cannot expand (2, 3) to (2, 4)");
    NBT_EXPECT_ABORT(nb_get(x, (int64_t[]){0, 3}), "index 3 out of range");
    NBT_EXPECT_ABORT(nb_zeros(ctx, NB_F32, NB_SHAPE(1, 1, 1, 1, 1, 1, 1)), "at most 6");
}

NBT_CPU_TEST(test_random_streams) {
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
}

/* Element i of a normal request from counter `offset`, computed here from
 * nb_philox4x32 and Box-Muller as Note [Random streams] defines it, in
 * double: the library's fill is not consulted. */
static double normal_ref(uint64_t seed, uint64_t offset, int64_t i) {
    uint32_t r[4];
    nb_philox4x32(seed, offset + (uint64_t)(i / 2), r);
    double u1 = ((double)r[0] + 1.0) / 4294967296.0, u2 = (double)r[1] / 4294967296.0;
    double rad = sqrt(-2.0 * log(u1)), theta = 2.0 * 3.14159265358979323846 * u2;
    return i % 2 ? rad * sin(theta) : rad * cos(theta);
}

static void assert_normal_stream(const nb_tensor *t, uint64_t seed, uint64_t offset) {
    for (int64_t i = 0; i < nb_numel(t); i++) {
        double got = nb_get(t, (int64_t[]){i}), want = normal_ref(seed, offset, i);
        ck_assert_msg(fabs(got - want) < 1e-12, "normal element %lld from counter %llu: %.17g, "
                      "expected %.17g", (long long)i, (unsigned long long)offset, got, want);
    }
}

/* nb_rand_normal advances the offset by ceil(n/2) counters: after an even
 * n the next request continues the same stream (n then m values are one
 * request of n + m); after an odd n the last counter's sine is left unused
 * and the next request starts at the following counter. */
NBT_CPU_TEST(test_random_normal_advance) {
    const uint64_t seed = 1234, start = 5;
    nb_rng rng = {seed, start};
    nb_tensor *a = nb_rand_normal(ctx, NB_F64, NB_SHAPE(6), 0, 1, &rng);
    ck_assert_uint_eq(rng.offset, start + 3);
    nb_tensor *b = nb_rand_normal(ctx, NB_F64, NB_SHAPE(5), 0, 1, &rng);
    ck_assert_uint_eq(rng.offset, start + 3 + 3); /* ceil(5 / 2) */
    nb_tensor *c = nb_rand_normal(ctx, NB_F64, NB_SHAPE(4), 0, 1, &rng);
    ck_assert_uint_eq(rng.offset, start + 3 + 3 + 2);
    assert_normal_stream(a, seed, start);
    assert_normal_stream(b, seed, start + 3);
    assert_normal_stream(c, seed, start + 6);
    /* 6 then 5 values are one request of 11 */
    nb_rng one = {seed, start};
    nb_tensor *ab = nb_rand_normal(ctx, NB_F64, NB_SHAPE(11), 0, 1, &one);
    ck_assert_uint_eq(one.offset, start + 6);
    for (int64_t i = 0; i < 11; i++)
        ck_assert_double_eq(nb_get(ab, (int64_t[]){i}),
                            i < 6 ? nb_get(a, (int64_t[]){i}) : nb_get(b, (int64_t[]){i - 6}));
    /* after the odd request the next one starts with the following
     * counter's cosine (element 12 of one long request), not with the
     * unused sine (element 11) */
    nb_rng longer = {seed, start};
    nb_tensor *l = nb_rand_normal(ctx, NB_F64, NB_SHAPE(14), 0, 1, &longer);
    ck_assert(nb_get(c, (int64_t[]){0}) != nb_get(l, (int64_t[]){11}));
    ck_assert_double_eq(nb_get(c, (int64_t[]){0}), nb_get(l, (int64_t[]){12}));
    /* mean and std scale the same stream */
    nb_rng scaled = {seed, start};
    nb_tensor *s = nb_rand_normal(ctx, NB_F64, NB_SHAPE(6), 2.0, 3.0, &scaled);
    for (int64_t i = 0; i < 6; i++)
        ck_assert_double_eq_tol(nb_get(s, (int64_t[]){i}), 2.0 + 3.0 * normal_ref(seed, start, i),
                                1e-12);
}

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

NBT_CPU_TEST(test_print) {
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
}

/* The device-facing API on a machine (or build) without a GPU: the
 * queries agree with each other, a CUDA context is refused with a message
 * naming the device, a CPU context computes products in bf16 but not f16
 * (tests/test_cpu_bf16.c tests the products), and nb_to on the same device
 * is the identity. */
START_TEST(test_devices_without_gpu) {
    ck_assert(nb_cuda_available() == (nb_cuda_device_count() > 0));
    if (nb_cuda_device_count() == 0) {
        NBT_EXPECT_ABORT(nb_ctx_new(nb_cuda(0), 0), "nb_ctx_new: device cuda:0");
    }
    NBT_EXPECT_ABORT(nb_ctx_new(nb_cuda(nb_cuda_device_count()), 0), "cuda:");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    ck_assert_int_eq(nb_ctx_compute_dtype(ctx), NB_F32);
    nb_ctx_set_compute_dtype(ctx, NB_BF16);
    ck_assert_int_eq(nb_ctx_compute_dtype(ctx), NB_BF16);
    NBT_EXPECT_ABORT(nb_ctx_set_compute_dtype(ctx, NB_F16),
                     "nb_ctx_set_compute_dtype: f16 compute is not supported on cpu (its products "
                     "take bf16 only");
    ck_assert_int_eq(nb_ctx_compute_dtype(ctx), NB_BF16);
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

/* ---- stale tensors: Note [Stale tensors] in tensor/context.c ---- */
#define STALE "was made before a reset of its context"

/* The case: a tensor of 3 elements kept across nb_ctx_reset while
 * the next step makes one of 100 in the same memory; every read and write
 * of the kept one aborts, naming the function, the tensor and its shape. */
START_TEST(test_stale_reads_and_writes) {
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0), *pers = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_from_host(step, NB_F32, NB_SHAPE(3), (float[]){1, 2, 3});
    nb_set_name(x, "kept");
    nb_tensor *loss = nb_scalar(step, NB_F64, 4);
    nb_tensor *m = nb_zeros(step, NB_F32, NB_SHAPE(2, 3));
    nb_ctx_reset(step);
    nb_tensor *y = nb_full(step, NB_F32, NB_SHAPE(100), 7);
    nb_tensor *p3 = nb_ones(pers, NB_F32, NB_SHAPE(3));
    float buf[3];
    double dbuf[3];
    NBT_EXPECT_ABORT(nb_get(x, (int64_t[]){0}), "nb_get: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_item(loss), "nb_item: tensor f64 () " STALE);
    NBT_EXPECT_ABORT(nb_to_host(x, buf), "nb_to_host: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_to_host_f64(x, dbuf), "nb_to_host_f64: tensor 'kept' f32 (3,) " STALE);
    ck_assert_msg(strstr(nbt_abort_msg, "the step before the last nb_ctx_reset") &&
                      strstr(nbt_abort_msg, "nb_item, nb_to_host"),
                  "message lacks the explanation: %s", nbt_abort_msg);
    NBT_EXPECT_ABORT(nb_set(x, (int64_t[]){1}, 5), "nb_set: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_fill_(x, 0), "nb_fill_: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_copy_(p3, x), "nb_copy_: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_copy_(x, p3), "nb_copy_: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_axpy_(p3, 2, x), "nb_axpy_: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_axpy_(x, 2, p3), "nb_axpy_: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_scale_(x, 2), "nb_scale_: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_zeros_like(pers, x), "nb_zeros_like: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_empty_like(pers, x), "nb_empty_like: tensor 'kept' f32 (3,) " STALE);
    NBT_EXPECT_ABORT(nb_set_name(x, "again"), "nb_set_name: tensor 'kept' f32 (3,) " STALE);
    FILE *sink = fopen("/dev/null", "w");
    ck_assert_ptr_nonnull(sink);
    NBT_EXPECT_ABORT(nb_tensor_fprint(sink, x), "nb_tensor_fprint: tensor 'kept' f32 (3,) " STALE);
    fclose(sink);
    NBT_EXPECT_ABORT(nb_set_requires_grad(m, true), "nb_set_requires_grad: tensor f32 (2, 3) " STALE);
    /* views: the tensor itself and views made after the reset from it */
    NBT_EXPECT_ABORT(nb_reshape(step, m, NB_SHAPE(3, 2)), "nb_reshape: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_flatten(step, m, 0, 1), "nb_flatten: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_narrow(step, m, 1, 0, 2), "nb_narrow: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_slice(step, m, 1, 0, 3, 2), "nb_slice: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_select(step, m, 0, 1), "nb_select: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_transpose(step, m, 0, 1), "nb_transpose: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_permute(step, m, (int[]){1, 0}), "nb_permute: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_expand(step, m, NB_SHAPE(4, 2, 3)), "nb_expand: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_unsqueeze(step, m, 0), "nb_unsqueeze: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_squeeze(step, m, 0), "nb_squeeze: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_contiguous(step, m), "nb_contiguous: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_clone(step, m), "nb_clone: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_cast(step, m, NB_F64), "nb_cast: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_to(step, m), "nb_to: tensor f32 (2, 3) " STALE);
    NBT_EXPECT_ABORT(nb_detach(step, m), "nb_detach: tensor f32 (2, 3) " STALE);
    /* what the new step made is untouched by all of this */
    ck_assert_double_eq(nb_get(y, (int64_t[]){99}), 7);
    ck_assert_int_eq(nb_numel(y), 100);
    /* a context that is not reset keeps its tensors live */
    ck_assert_double_eq(nb_get(p3, (int64_t[]){2}), 1);
    nb_ctx_free(step);
    nb_ctx_free(pers);
}
END_TEST

/* Every op front end, with a tensor kept from the previous step in each
 * tensor argument in turn. The kept tensors' storage is not handed out
 * again (the ops write into another context), so under the sanitizer build
 * a kernel that read it before the check would be reported. */
enum { K_M23, K_M33, K_V3, K_C2, K_R2, K_X4, K_W4, K_T2, K_E53, K_I2, K_TT, N_KINDS };

static nb_tensor *make_kind(nb_ctx *ctx, int kind, uint64_t seed) {
    switch (kind) {
    case K_M23: return nbt_randn(ctx, NB_F32, NB_SHAPE(2, 3), seed);
    case K_M33: return nbt_randn(ctx, NB_F32, NB_SHAPE(3, 3), seed);
    case K_V3: return nbt_randn(ctx, NB_F32, NB_SHAPE(3), seed);
    case K_C2: return nb_ones(ctx, NB_F32, NB_SHAPE(2));
    case K_R2: return nb_ones(ctx, NB_F32, NB_SHAPE(2)); /* running statistics */
    case K_X4: return nbt_randn(ctx, NB_F32, NB_SHAPE(1, 2, 4, 4), seed);
    case K_W4: return nbt_randn(ctx, NB_F32, NB_SHAPE(3, 2, 3, 3), seed);
    case K_T2: return nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){0, 2});
    case K_E53: return nbt_randn(ctx, NB_F32, NB_SHAPE(5, 3), seed);
    case K_I2: return nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){1, 4});
    default: return nbt_randn(ctx, NB_F32, NB_SHAPE(2, 3, 3), seed);
    }
}

typedef nb_tensor *(*stale_case_fn)(nb_ctx *c, nb_tensor *const *t);
typedef struct stale_case {
    const char *op; /* the name the message must start with */
    stale_case_fn fn;
    int n;
    int kinds[5];
} stale_case;

static nb_rng stale_rng;
#define CASE1(name, expr) static nb_tensor *sc_##name(nb_ctx *c, nb_tensor *const *t) { return expr; }
CASE1(add, nb_add(c, t[0], t[1]))
CASE1(sub, nb_sub(c, t[0], t[1]))
CASE1(mul, nb_mul(c, t[0], t[1]))
CASE1(div, nb_div(c, t[0], t[1]))
CASE1(add_scalar, nb_add_scalar(c, t[0], 1))
CASE1(sub_scalar, nb_sub_scalar(c, t[0], 1))
CASE1(mul_scalar, nb_mul_scalar(c, t[0], 2))
CASE1(div_scalar, nb_div_scalar(c, t[0], 2))
CASE1(neg, nb_neg(c, t[0]))
CASE1(pow, nb_pow(c, t[0], 2))
CASE1(exp, nb_exp(c, t[0]))
CASE1(log, nb_log(c, t[0]))
CASE1(sqrt, nb_sqrt(c, t[0]))
CASE1(rsqrt, nb_rsqrt(c, t[0]))
CASE1(abs, nb_abs(c, t[0]))
CASE1(tanh, nb_tanh(c, t[0]))
CASE1(sigmoid, nb_sigmoid(c, t[0]))
CASE1(relu, nb_relu(c, t[0]))
CASE1(gelu, nb_gelu(c, t[0], NB_GELU_TANH))
CASE1(where, nb_where(c, t[0], t[1], t[2]))
CASE1(masked_fill, nb_masked_fill(c, t[0], t[1], 0))
CASE1(matmul, nb_matmul(c, t[0], t[1]))
CASE1(matmul_t, nb_matmul_t(c, t[0], t[1], false, true))
CASE1(sum, nb_sum(c, t[0], 1, (int[]){1}, false))
CASE1(mean, nb_mean(c, t[0], 1, (int[]){0}, true))
CASE1(max, nb_max(c, t[0], 1, (int[]){1}, false))
CASE1(var, nb_var(c, t[0], 1, (int[]){1}, 1, false))
CASE1(sum_all, nb_sum_all(c, t[0]))
CASE1(mean_all, nb_mean_all(c, t[0]))
CASE1(softmax, nb_softmax(c, t[0], -1))
CASE1(log_softmax, nb_log_softmax(c, t[0], -1))
CASE1(softmax_causal, nb_softmax_causal(c, t[0], 0.5))
CASE1(cross_entropy, nb_cross_entropy(c, t[0], t[1], NULL))
CASE1(mse_loss, nb_mse_loss(c, t[0], t[1]))
CASE1(bce_with_logits, nb_bce_with_logits(c, t[0], t[1]))
CASE1(embedding, nb_embedding(c, t[0], t[1]))
CASE1(layer_norm, nb_layer_norm(c, t[0], 1, t[1], t[2], 1e-5))
CASE1(batch_norm, nb_batch_norm(c, t[0], t[1], t[2], t[3], t[4], true, 0.1, 1e-5))
CASE1(conv2d, nb_conv2d(c, t[0], t[1], t[2], &(nb_conv2d_opts){{1, 1}, {1, 1}, {1, 1}, 1}))
CASE1(max_pool2d, nb_max_pool2d(c, t[0], &(nb_pool2d_opts){{2, 2}, {0, 0}, {0, 0}}))
CASE1(avg_pool2d, nb_avg_pool2d(c, t[0], &(nb_pool2d_opts){{2, 2}, {0, 0}, {0, 0}}))
CASE1(dropout, nb_dropout(c, t[0], 0.5, true, &stale_rng))
CASE1(dropout_eval, nb_dropout(c, t[0], 0.5, false, &stale_rng))
CASE1(concat, nb_concat(c, 2, t, 0))
CASE1(stack, nb_stack(c, 2, t, 0))
static nb_tensor *sc_split(nb_ctx *c, nb_tensor *const *t) {
    nb_tensor *out[2];
    nb_split(c, t[0], 2, (int64_t[]){1, 2}, 1, out);
    return out[1];
}

static const stale_case stale_cases[] = {
    {"nb_add", sc_add, 2, {K_M23, K_M23}},
    {"nb_sub", sc_sub, 2, {K_M23, K_M23}},
    {"nb_mul", sc_mul, 2, {K_M23, K_M23}},
    {"nb_div", sc_div, 2, {K_M23, K_M23}},
    {"nb_add_scalar", sc_add_scalar, 1, {K_M23}},
    {"nb_sub_scalar", sc_sub_scalar, 1, {K_M23}},
    {"nb_mul_scalar", sc_mul_scalar, 1, {K_M23}},
    {"nb_div_scalar", sc_div_scalar, 1, {K_M23}},
    {"nb_neg", sc_neg, 1, {K_M23}},
    {"nb_pow", sc_pow, 1, {K_M23}},
    {"nb_exp", sc_exp, 1, {K_M23}},
    {"nb_log", sc_log, 1, {K_M23}},
    {"nb_sqrt", sc_sqrt, 1, {K_M23}},
    {"nb_rsqrt", sc_rsqrt, 1, {K_M23}},
    {"nb_abs", sc_abs, 1, {K_M23}},
    {"nb_tanh", sc_tanh, 1, {K_M23}},
    {"nb_sigmoid", sc_sigmoid, 1, {K_M23}},
    {"nb_relu", sc_relu, 1, {K_M23}},
    {"nb_gelu", sc_gelu, 1, {K_M23}},
    {"nb_where", sc_where, 3, {K_M23, K_M23, K_M23}},
    {"nb_masked_fill", sc_masked_fill, 2, {K_M23, K_M23}},
    {"nb_matmul", sc_matmul, 2, {K_M23, K_M33}},
    {"nb_matmul_t", sc_matmul_t, 2, {K_M23, K_M33}},
    {"nb_sum", sc_sum, 1, {K_M23}},
    {"nb_mean", sc_mean, 1, {K_M23}},
    {"nb_max", sc_max, 1, {K_M23}},
    {"nb_var", sc_var, 1, {K_M23}},
    {"nb_sum", sc_sum_all, 1, {K_M23}},
    {"nb_mean", sc_mean_all, 1, {K_M23}},
    {"nb_softmax", sc_softmax, 1, {K_M23}},
    {"nb_log_softmax", sc_log_softmax, 1, {K_M23}},
    {"nb_softmax_causal", sc_softmax_causal, 1, {K_TT}},
    {"nb_cross_entropy", sc_cross_entropy, 2, {K_M23, K_T2}},
    {"nb_mse_loss", sc_mse_loss, 2, {K_M23, K_M23}},
    {"nb_bce_with_logits", sc_bce_with_logits, 2, {K_M23, K_M23}},
    {"nb_embedding", sc_embedding, 2, {K_E53, K_I2}},
    {"nb_layer_norm", sc_layer_norm, 3, {K_M23, K_V3, K_V3}},
    {"nb_batch_norm", sc_batch_norm, 5, {K_X4, K_C2, K_C2, K_R2, K_R2}},
    {"nb_conv2d", sc_conv2d, 3, {K_X4, K_W4, K_V3}},
    {"nb_max_pool2d", sc_max_pool2d, 1, {K_X4}},
    {"nb_avg_pool2d", sc_avg_pool2d, 1, {K_X4}},
    {"nb_dropout", sc_dropout, 1, {K_M23}},
    {"nb_dropout", sc_dropout_eval, 1, {K_M23}},
    {"nb_concat", sc_concat, 2, {K_M23, K_M23}},
    {"nb_stack", sc_stack, 2, {K_M23, K_M23}},
    {"nb_split", sc_split, 1, {K_M23}},
};

static void expect_stale(const stale_case *sc, int pos, nb_ctx *out, nb_tensor *const *in) {
    char want[128];
    snprintf(want, sizeof want, "%s: tensor ", sc->op);
    NBT_EXPECT_ABORT(sc->fn(out, in), STALE);
    ck_assert_msg(strncmp(nbt_abort_msg, want, strlen(want)) == 0,
                  "%s, stale input %d: message \"%s\" does not start with \"%s\"", sc->op, pos,
                  nbt_abort_msg, want);
}

static void stale_sweep(bool grad_mode) {
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0), *pers = nb_ctx_new(nb_cpu(), 0);
    nb_ctx *out = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *stale[N_KINDS], *live[N_KINDS];
    for (int k = 0; k < N_KINDS; k++) {
        stale[k] = make_kind(step, k, 100 + (uint64_t)k);
        live[k] = make_kind(pers, k, 200 + (uint64_t)k);
        if (k != K_R2 && nb_dtype_is_float(live[k]->dtype)) nb_set_requires_grad(live[k], grad_mode);
    }
    nb_ctx_reset(step);
    bool prev = nb_set_grad_enabled(grad_mode);
    stale_rng = nb_rng_make(5);
    for (size_t c = 0; c < sizeof stale_cases / sizeof stale_cases[0]; c++) {
        const stale_case *sc = &stale_cases[c];
        nb_tensor *in[5];
        for (int i = 0; i < sc->n; i++) in[i] = live[sc->kinds[i]];
        ck_assert_ptr_nonnull(sc->fn(out, in)); /* the case itself is valid */
        for (int pos = 0; pos < sc->n; pos++) {
            for (int i = 0; i < sc->n; i++) in[i] = i == pos ? stale[sc->kinds[i]] : live[sc->kinds[i]];
            expect_stale(sc, pos, out, in);
        }
        nb_ctx_reset(out);
    }
    nb_set_grad_enabled(prev);
    nb_ctx_free(out);
    nb_ctx_free(pers);
    nb_ctx_free(step);
}

START_TEST(test_stale_inputs_every_op) {
    stale_sweep(true);
    stale_sweep(false);
}
END_TEST

/* Two resets ago: the struct's memory may hold the current step's tensors
 * in the default build (Note [Stale tensors]); under the sanitizer build
 * it was released, and the check says so. */
START_TEST(test_stale_older_than_one_step) {
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_full(step, NB_F32, NB_SHAPE(3), 1);
    nb_ctx_reset(step);
    nb_tensor *y = nb_full(step, NB_F32, NB_SHAPE(3), 2);
    nb_ctx_reset(step);
    NBT_EXPECT_ABORT(nb_item(nb_sum_all(step, y)), "nb_sum: tensor f32 (3,) " STALE);
    /* a generation that matches nothing: the contents are not trusted */
    nb_tensor fake = *y;
    nb__tensor_priv fake_priv = *y->priv; /* a copy shares y's: its own, older */
    fake.priv = &fake_priv;
    fake_priv.gen -= 1; /* older than the previous step, not older than the context */
    NBT_EXPECT_ABORT(nb_get(&fake, (int64_t[]){0}),
                     "nb_get: a tensor made before a reset of its context was used (more than one "
                     "reset ago: its name and shape are gone)");
#ifdef NB__ASAN
    NBT_EXPECT_ABORT(nb_get(x, (int64_t[]){0}),
                     "nb_get: a tensor made before a reset of its context was used (its memory "
                     "was released");
    /* data: an allocation's bytes are addressable, the padding after them and
     * everything a reset rewound are not */
    nb_tensor *d = nb_zeros(step, NB_F32, NB_SHAPE(3));
    ck_assert(!__asan_address_is_poisoned((char *)d->data + 11));
    ck_assert(__asan_address_is_poisoned((char *)d->data + 12));
    nb_ctx_reset(step);
    ck_assert(__asan_address_is_poisoned(d->data));
#else
    (void)x;
#endif
    nb_ctx_free(step);
}
END_TEST

/* Note [Freed contexts]: a tensor of a freed context is named as such,
 * before and after another context takes the freed one's place, and a
 * context freed twice is refused. */
START_TEST(test_freed_context_tensor) {
    nb_ctx *gone = nb_ctx_new(nb_cpu(), 0), *live = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_full(gone, NB_F32, NB_SHAPE(3), 1);
    nb_set_name(w, "w");
    nb_tensor *v = nb_full(live, NB_F32, NB_SHAPE(3), 2);
    nb_ctx_free(gone);
#ifdef NB__ASAN
    NBT_EXPECT_ABORT(nb_add(live, v, w), "nb_add: a tensor made before a reset of its context was used (its "
                     "memory was released by an nb_ctx_reset or nb_ctx_free");
    (void)v;
#else
    NBT_EXPECT_ABORT(nb_add(live, v, w), "nb_add: tensor 'w' f32 (3,) belongs to a context that was freed "
                     "(nb_ctx_free)");
    NBT_EXPECT_ABORT(nb_item(nb_sum_all(live, w)), "belongs to a context that was freed");
    NBT_EXPECT_ABORT(nb_ctx_free(gone), "nb_ctx_free: the context was already freed");
    nb_ctx *next = nb_ctx_new(nb_cpu(), 0); /* may take the freed one's place */
    NBT_EXPECT_ABORT(nb_to_host(w, (float[3]){0}), "nb_to_host: ");
    ck_assert_msg(strstr(nbt_abort_msg, "context that was freed (nb_ctx_free)") != NULL, "%s", nbt_abort_msg);
    nb_tensor *u = nb_full(next, NB_F32, NB_SHAPE(3), 4);
    ck_assert_float_eq(nb_item(nb_sum_all(next, u)), 12);
    nb_ctx_free(next);
#endif
    nb_ctx_free(live);
}
END_TEST

/* A NULL tensor (made by a call whose failure was ignored) is named, never
 * dereferenced. */
NBT_CPU_TEST(test_null_tensor) {
    nb_tensor *x = nb_ones(ctx, NB_F32, NB_SHAPE(2));
    NBT_EXPECT_ABORT(nb_add(ctx, x, NULL), "nb_add: a tensor argument is NULL");
    NBT_EXPECT_ABORT(nb_relu(ctx, NULL), "nb_relu: a tensor argument is NULL");
    NBT_EXPECT_ABORT(nb_item(NULL), "nb_item: a tensor argument is NULL");
    NBT_EXPECT_ABORT(nb_backward(NULL), "nb_backward: a tensor argument is NULL");
}

int main(void) {
    const TTest *tests[] = {test_ctx_reset_and_peak, test_ctx_growth_within_what_is_left, test_creation,
                             test_creation_size_overflow, test_half_conversions, test_casts,
                             test_views_share_storage, test_view_errors, test_random_streams,
                             test_random_normal_advance,
                             test_philox_known_answer, test_print, test_devices_without_gpu,
                             test_stale_reads_and_writes, test_stale_inputs_every_op,
                             test_stale_older_than_one_step, test_freed_context_tensor, test_null_tensor,
                             NULL};
    return nbt_run(nbt_suite("tensor", "core", 0, tests));
}
