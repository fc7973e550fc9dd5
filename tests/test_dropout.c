/* Tests of nb_dropout: the mask against an independent recomputation of
 * Note [Random streams] from nb_philox4x32, the offset bookkeeping, the
 * kept fraction on many elements, eval mode, gradients (mask / (1 - p)),
 * p = 1 and bad arguments. */
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

/* Expected scaled mask for n elements: kept when the uniform of element i
 * (lane i % 4 of the block at counter offset + i / 4, top 24 bits) >= p. */
static double *expected_mask(uint64_t seed, uint64_t offset, int64_t n, double p) {
    double *m = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        uint32_t r[4];
        nb_philox4x32(seed, offset + (uint64_t)(i / 4), r);
        double u = (double)(r[i % 4] >> 8) / 16777216.0;
        m[i] = u >= p ? 1.0 / (1.0 - p) : 0.0;
    }
    return m;
}

NBT_CPU_TEST(test_mask_matches_philox) {
    const int64_t n = 1003; /* not a multiple of 4 */
    const double p = 0.3;
    nb_dtype dts[2] = {NB_F64, NB_F32};
    for (int k = 0; k < 2; k++) {
        nb_rng rng = {42, 5};
        nb_tensor *x = nb_ones(ctx, dts[k], NB_SHAPE(17, 59));
        nb_tensor *y = nb_dropout(ctx, x, p, true, &rng);
        ck_assert_int_eq(y->dtype, dts[k]);
        ck_assert(nb_same_shape(x, y));
        double *m = expected_mask(42, 5, n, p);
        nbt_assert_close(y, m, 0, dts[k] == NB_F32 ? 1e-6 : 1e-15);
        ck_assert_uint_eq(rng.seed, 42);
        ck_assert_uint_eq(rng.offset, 5 + (n + 3) / 4);
        free(m);
    }
}

NBT_CPU_TEST(test_non_contiguous_rowmajor) {
    /* element i is the row-major index of x, whatever x's strides */
    nb_tensor *base = nbt_randn(ctx, NB_F64, NB_SHAPE(6, 5), 3);
    nb_tensor *x = nb_transpose(ctx, base, 0, 1); /* (5, 6) */
    ck_assert(!nb_is_contiguous(x));
    nb_rng rng = nb_rng_make(9);
    nb_tensor *y = nb_dropout(ctx, x, 0.5, true, &rng);
    double xh[30];
    nb_to_host_f64(x, xh);
    double *m = expected_mask(9, 0, 30, 0.5);
    for (int i = 0; i < 30; i++)
        m[i] *= xh[i];
    nbt_assert_close(y, m, 1e-15, 0);
    free(m);
}

NBT_CPU_TEST(test_fraction_kept) {
    const int64_t n = 100000;
    double ps[3] = {0.1, 0.5, 0.8};
    for (int k = 0; k < 3; k++) {
        nb_rng rng = nb_rng_make(1234 + (uint64_t)k);
        nb_tensor *y =
            nb_dropout(ctx, nb_ones(ctx, NB_F32, NB_SHAPE(100, 1000)), ps[k], true, &rng);
        double *v = malloc(sizeof(double) * (size_t)n);
        nb_to_host_f64(y, v);
        int64_t kept = 0;
        double scale = 1.0 / (1.0 - ps[k]);
        for (int64_t i = 0; i < n; i++) {
            if (v[i] != 0) {
                kept++;
                ck_assert_msg(fabs(v[i] - scale) < 1e-6 * scale, "kept value %g, expected %g", v[i],
                              scale);
            }
        }
        double frac = (double)kept / (double)n;
        /* binomial std is at most 0.0016 here; 0.01 is over 6 sigma */
        ck_assert_msg(fabs(frac - (1 - ps[k])) < 0.01, "p = %g: kept %g", ps[k], frac);
        free(v);
    }
}

NBT_CPU_TEST(test_streams) {
    nb_tensor *x = nb_ones(ctx, NB_F64, NB_SHAPE(64));
    nb_rng a = nb_rng_make(77), b = nb_rng_make(77);
    nb_tensor *ya1 = nb_dropout(ctx, x, 0.5, true, &a);
    nb_tensor *yb1 = nb_dropout(ctx, x, 0.5, true, &b);
    nbt_assert_tensors_close(ya1, yb1, 0, 0); /* same seed and offset: same mask */
    ck_assert_uint_eq(a.offset, 16);
    nb_tensor *ya2 = nb_dropout(ctx, x, 0.5, true, &a);
    ck_assert_uint_eq(a.offset, 32);
    double v1[64], v2[64];
    nb_to_host_f64(ya1, v1);
    nb_to_host_f64(ya2, v2);
    int differ = 0;
    for (int i = 0; i < 64; i++)
        differ += v1[i] != v2[i];
    ck_assert_msg(differ > 0, "the second call reused the first mask");
    nb_rng c = {77, 16}; /* resuming at the advanced offset reproduces the second call */
    nbt_assert_tensors_close(nb_dropout(ctx, x, 0.5, true, &c), ya2, 0, 0);

    /* NULL: the default generator, which then advances */
    nb_manual_seed(77);
    nb_tensor *yd = nb_dropout(ctx, x, 0.5, true, NULL);
    nbt_assert_tensors_close(yd, ya1, 0, 0);
    ck_assert_uint_eq(nb_rng_default()->offset, 16);
}

NBT_CPU_TEST(test_identity_cases) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(3, 4), 1);
    nb_rng rng = nb_rng_make(5);
    ck_assert_ptr_eq(nb_dropout(ctx, x, 0.5, false, &rng), x);
    ck_assert_ptr_eq(nb_dropout(ctx, x, 0.0, true, &rng), x);
    ck_assert_ptr_eq(nb_dropout(ctx, x, 1.0, false, &rng), x);
    ck_assert_uint_eq(rng.offset, 0);
}

NBT_CPU_TEST(test_gradient_is_mask) {
    nb_dtype dts[2] = {NB_F64, NB_F32};
    for (int k = 0; k < 2; k++) {
        nb_tensor *x = nbt_randn_leaf(ctx, dts[k], NB_SHAPE(7, 9), 11);
        nb_rng rng = nb_rng_make(31);
        nb_tensor *y = nb_dropout(ctx, x, 0.4, true, &rng);
        ck_assert(y->requires_grad);
        nb_backward(nb_sum_all(ctx, y));
        double *m = expected_mask(31, 0, 63, 0.4);
        nbt_assert_close(x->grad, m, 0, 1e-6);
        free(m);
    }
}

static nb_tensor *dropout_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_rng rng = *(const nb_rng *)user; /* the same mask at every evaluation */
    return nb_dropout(ctx, in[0], 0.35, true, &rng);
}

static nb_tensor *dropout_t_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_rng rng = *(const nb_rng *)user;
    return nb_dropout(ctx, nb_transpose(ctx, in[0], 0, 2), 0.35, true, &rng);
}

NBT_CPU_TEST(test_gradcheck) {
    nb_rng rng = {3, 100};
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 5, 2), 2);
    NBT_GRADCHECK(dropout_fn, &rng, 1, &x);
    NBT_GRADCHECK(dropout_t_fn, &rng, 1, &x);
}

NBT_CPU_TEST(test_p_one) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(5, 3), 4);
    nb_rng rng = nb_rng_make(8);
    nb_tensor *y = nb_dropout(ctx, x, 1.0, true, &rng);
    double zeros[15] = {0};
    nbt_assert_close(y, zeros, 0, 0);
    ck_assert_uint_eq(rng.offset, 4);
    nb_backward(nb_sum_all(ctx, y));
    nbt_assert_close(x->grad, zeros, 0, 0);
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *x = nb_ones(ctx, NB_F32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_dropout(ctx, x, -0.1, true, NULL),
                     "nb_dropout: p must be in [0, 1], got -0.1");
    NBT_EXPECT_ABORT(nb_dropout(ctx, x, 1.5, true, NULL),
                     "nb_dropout: p must be in [0, 1], got 1.5");
    NBT_EXPECT_ABORT(nb_dropout(ctx, x, 1.5, false, NULL), "p must be in [0, 1]");
    NBT_EXPECT_ABORT(nb_dropout(ctx, x, NAN, true, NULL), "p must be in [0, 1]");
    NBT_EXPECT_ABORT(nb_dropout(ctx, nb_ones(ctx, NB_I32, NB_SHAPE(4)), 0.5, true, NULL),
                     "nb_dropout: dtype i32 is not supported");
}

NBT_MAIN("dropout", "dropout", 0,
         test_mask_matches_philox, test_non_contiguous_rowmajor, test_fraction_kept, test_streams,
         test_identity_cases, test_gradient_is_mask, test_gradcheck, test_p_one, test_errors)
