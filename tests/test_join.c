/* Tests of nb_concat, nb_stack and nb_split: values against index
 * arithmetic on several axes (negative ones included), non-contiguous
 * inputs, split pieces being views, gradient checks through all three and
 * the error messages. */
#include <stdlib.h>

#include "testutil.h"

/* Tensor (a, b, c) with element (i, j, k) = base + 100 i + 10 j + k. */
static nb_tensor *coded(nb_ctx *ctx, nb_dtype dt, int64_t a, int64_t b, int64_t c, double base) {
    double *v = malloc(sizeof(double) * (size_t)(a * b * c));
    for (int64_t i = 0; i < a; i++)
        for (int64_t j = 0; j < b; j++)
            for (int64_t k = 0; k < c; k++)
                v[(i * b + j) * c + k] = base + 100.0 * i + 10.0 * j + k;
    nb_tensor *t64 = nb_from_host(ctx, NB_F64, NB_SHAPE(a, b, c), v);
    free(v);
    return dt == NB_F64 ? t64 : nb_cast(ctx, t64, dt);
}

static double coded_at(double base, int64_t i, int64_t j, int64_t k) {
    return base + 100.0 * i + 10.0 * j + k;
}

static void check_shape3(const nb_tensor *t, int64_t a, int64_t b, int64_t c) {
    ck_assert_int_eq(t->ndim, 3);
    ck_assert_int_eq(t->shape[0], a);
    ck_assert_int_eq(t->shape[1], b);
    ck_assert_int_eq(t->shape[2], c);
}

NBT_CPU_TEST(test_concat_values) {
    const double bases[3] = {0, 1000, 2000};
    const int64_t sz[3] = {2, 1, 3};
    nb_dtype dts[3] = {NB_F64, NB_F32, NB_I64};
    for (int di = 0; di < 3; di++) {
        for (int ax = -3; ax < 3; ax++) {
            int a = ax < 0 ? ax + 3 : ax;
            nb_tensor *xs[3];
            int64_t dims[3] = {2, 3, 4};
            for (int k = 0; k < 3; k++) {
                int64_t s[3] = {dims[0], dims[1], dims[2]};
                s[a] = sz[k];
                xs[k] = coded(ctx, dts[di], s[0], s[1], s[2], bases[k]);
            }
            nb_tensor *y = nb_concat(ctx, 3, xs, ax);
            ck_assert_int_eq(y->dtype, dts[di]);
            int64_t out[3] = {dims[0], dims[1], dims[2]};
            out[a] = 6;
            check_shape3(y, out[0], out[1], out[2]);
            double *expect = malloc(sizeof(double) * 6 * 12);
            for (int64_t i = 0; i < out[0]; i++)
                for (int64_t j = 0; j < out[1]; j++)
                    for (int64_t k = 0; k < out[2]; k++) {
                        int64_t idx[3] = {i, j, k}, pos = idx[a];
                        int which = pos < 2 ? 0 : pos < 3 ? 1 : 2;
                        idx[a] = pos - (which == 0 ? 0 : which == 1 ? 2 : 3);
                        expect[(i * out[1] + j) * out[2] + k] =
                            coded_at(bases[which], idx[0], idx[1], idx[2]);
                    }
            nbt_assert_close(y, expect, 0, 0);
            free(expect);
        }
    }
}

NBT_CPU_TEST(test_concat_non_contiguous) {
    nb_tensor *a = coded(ctx, NB_F64, 2, 3, 4, 0);
    nb_tensor *bt = coded(ctx, NB_F64, 2, 4, 5, 1000);
    nb_tensor *b = nb_slice(ctx, nb_transpose(ctx, bt, 1, 2), 1, 1, 5, 2); /* (2, 2, 4), strided */
    ck_assert(!nb_is_contiguous(b));
    nb_tensor *y = nb_concat(ctx, 2, (nb_tensor *[]){a, b}, 1);
    check_shape3(y, 2, 5, 4);
    double expect[40];
    for (int64_t i = 0; i < 2; i++)
        for (int64_t j = 0; j < 5; j++)
            for (int64_t k = 0; k < 4; k++)
                expect[(i * 5 + j) * 4 + k] =
                    j < 3 ? coded_at(0, i, j, k) : coded_at(1000, i, k, 1 + 2 * (j - 3));
    nbt_assert_close(y, expect, 0, 0);
}

NBT_CPU_TEST(test_stack_values) {
    nb_tensor *xs[3];
    for (int k = 0; k < 3; k++)
        xs[k] = nb_reshape(ctx, coded(ctx, NB_F64, 1, 2, 3, 1000.0 * k), 2, (int64_t[]){2, 3});
    int axes[6] = {0, 1, 2, -1, -2, -3};
    for (int t = 0; t < 6; t++) {
        int a = axes[t] < 0 ? axes[t] + 3 : axes[t];
        nb_tensor *y = nb_stack(ctx, 3, xs, axes[t]);
        int64_t out[3]; /* (2, 3) with the new dim of size 3 inserted at a */
        for (int d = 0, q = 0; d < 3; d++)
            out[d] = d == a ? 3 : (q++ == 0 ? 2 : 3);
        check_shape3(y, out[0], out[1], out[2]);
        double expect[18];
        for (int64_t i = 0; i < out[0]; i++)
            for (int64_t j = 0; j < out[1]; j++)
                for (int64_t k = 0; k < out[2]; k++) {
                    int64_t idx[3] = {i, j, k}, rest[2];
                    for (int d = 0, q = 0; d < 3; d++)
                        if (d != a) rest[q++] = idx[d];
                    expect[(i * out[1] + j) * out[2] + k] =
                        coded_at(1000.0 * (double)idx[a], 0, rest[0], rest[1]);
                }
        nbt_assert_close(y, expect, 0, 0);
    }
}

NBT_CPU_TEST(test_split_values) {
    nb_tensor *x = coded(ctx, NB_F64, 2, 6, 4, 0);
    const int64_t sizes[3] = {1, 3, 2};
    int axes[2] = {1, -2};
    for (int t = 0; t < 2; t++) {
        nb_tensor *out[3];
        nb_split(ctx, x, 3, sizes, axes[t], out);
        int64_t off = 0;
        for (int p = 0; p < 3; p++) {
            check_shape3(out[p], 2, sizes[p], 4);
            ck_assert_ptr_eq(out[p]->base, x); /* a view */
            double expect[24];
            for (int64_t i = 0; i < 2; i++)
                for (int64_t j = 0; j < sizes[p]; j++)
                    for (int64_t k = 0; k < 4; k++)
                        expect[(i * sizes[p] + j) * 4 + k] = coded_at(0, i, j + off, k);
            nbt_assert_close(out[p], expect, 0, 0);
            off += sizes[p];
        }
    }
    /* last axis, a zero-size piece; concat undoes split */
    nb_tensor *pieces[3];
    nb_split(ctx, x, 3, (int64_t[]){3, 0, 1}, -1, pieces);
    check_shape3(pieces[1], 2, 6, 0);
    nbt_assert_tensors_close(nb_concat(ctx, 3, pieces, 2), x, 0, 0);
}

/* ---- gradients ---- */
static nb_tensor *concat_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    int axis = *(const int *)user;
    nb_tensor *b = nb_transpose(ctx, in[1], 0, 2); /* non-contiguous operand */
    return nb_concat(ctx, 3, (nb_tensor *[]){in[0], b, in[2]}, axis);
}

NBT_CPU_TEST(test_gradcheck_concat) {
    int axis = -2;
    nb_tensor *in[3] = {
        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2, 4), 1),
        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3, 3), 2), /* transposed to (3, 3, 4) */
        nbt_randn(ctx, NB_F64, NB_SHAPE(3, 1, 4), 3),      /* no grad */
    };
    NBT_GRADCHECK(concat_fn, &axis, 3, in);
    /* the same tensor twice: both slabs' gradients add up */
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 4);
    nb_tensor *y = nb_concat(ctx, 2, (nb_tensor *[]){x, x}, 0);
    nb_backward(nb_sum_all(ctx, y));
    double twos[6] = {2, 2, 2, 2, 2, 2};
    nbt_assert_close(x->grad, twos, 0, 0);
}

static nb_tensor *stack_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_stack(ctx, 2, in, *(const int *)user);
}

NBT_CPU_TEST(test_gradcheck_stack) {
    nb_tensor *in[2] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2), 5),
                        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2), 6)};
    for (int axis = -3; axis < 3; axis++)
        NBT_GRADCHECK(stack_fn, &axis, 2, in);
}

/* x split in four: the last piece followed by the product of the two
 * equal-size pieces; the second piece is unused */
static nb_tensor *split_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *p[4];
    nb_split(ctx, in[0], 4, (const int64_t[]){2, 1, 2, 3}, *(const int *)user, p);
    nb_tensor *prod = nb_mul(ctx, p[0], p[2]);
    return nb_concat(ctx, 2, (nb_tensor *[]){p[3], prod}, *(const int *)user);
}

NBT_CPU_TEST(test_gradcheck_split) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(8, 3), 7);
    int axis = 0;
    NBT_GRADCHECK(split_fn, &axis, 1, &x);
    nb_tensor *xt = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(8, 3), 8);
    nb_tensor *x2 = nb_transpose(ctx, xt, 0, 1); /* (3, 8), split along its last axis */
    nb_tensor *pieces[4];
    nb_split(ctx, x2, 4, (const int64_t[]){2, 1, 2, 3}, -1, pieces);
    nb_backward(nb_sum_all(ctx, nb_mul_scalar(ctx, pieces[2], 3.0)));
    double expect[24] = {0};
    for (int r = 3; r < 5; r++)
        for (int c = 0; c < 3; c++)
            expect[r * 3 + c] = 3.0;
    nbt_assert_close(xt->grad, expect, 0, 0);
}

/* ---- errors ---- */
NBT_CPU_TEST(test_errors) {
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 4));
    nb_tensor *b = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 5, 4));
    nb_tensor *c = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 1, 4));
    NBT_EXPECT_ABORT(nb_concat(ctx, 3, (nb_tensor *[]){a, b, c}, 1),
                     "nb_concat: input 2 has shape (3, 1, 4) but input 0 has shape (2, 3, 4)");
    NBT_EXPECT_ABORT(nb_concat(ctx, 2, (nb_tensor *[]){a, b}, 0),
                     "nb_concat: input 1 has shape (2, 5, 4) but input 0 has shape (2, 3, 4); "
                     "shapes must match except along dimension 0");
    NBT_EXPECT_ABORT(
        nb_concat(ctx, 2, (nb_tensor *[]){a, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3))}, 0),
        "nb_concat: input 1 has shape (2, 3) but input 0 has shape (2, 3, 4)");
    NBT_EXPECT_ABORT(
        nb_concat(ctx, 2, (nb_tensor *[]){a, nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3, 4))}, 0),
        "nb_concat: input 1 has dtype f64 (2, 3, 4) but input 0 has f32 (2, 3, 4)");
    NBT_EXPECT_ABORT(nb_concat(ctx, 2, (nb_tensor *[]){a, b}, 3),
                     "nb_concat: dimension 3 out of range");
    NBT_EXPECT_ABORT(nb_concat(ctx, 0, (nb_tensor *[]){a}, 0),
                     "nb_concat: needs at least one input");
    NBT_EXPECT_ABORT(nb_concat(ctx, 1, (nb_tensor *[]){nb_scalar(ctx, NB_F32, 1)}, 0),
                     "nb_concat: input 0 must have at least one dimension");
    NBT_EXPECT_ABORT(nb_stack(ctx, 2, (nb_tensor *[]){a, b}, 0),
                     "nb_stack: input 1 has shape (2, 5, 4) but input 0 has shape (2, 3, 4)");
    NBT_EXPECT_ABORT(nb_stack(ctx, 2, (nb_tensor *[]){a, a}, 4),
                     "nb_stack: dimension 4 out of range");
    nb_tensor *out[2];
    NBT_EXPECT_ABORT(nb_split(ctx, a, 2, (const int64_t[]){1, 1}, 1, out),
                     "nb_split: sizes add up to 2 but dimension 1 of (2, 3, 4) has size 3");
    NBT_EXPECT_ABORT(nb_split(ctx, a, 2, (const int64_t[]){4, -1}, 1, out),
                     "nb_split: size 1 is negative");
    NBT_EXPECT_ABORT(nb_split(ctx, a, 2, (const int64_t[]){1, 2}, -4, out),
                     "nb_split: dimension -4 out of range");
}

NBT_MAIN("join", "join", 0,
         test_concat_values, test_concat_non_contiguous, test_stack_values, test_split_values, test_gradcheck_concat,
         test_gradcheck_stack, test_gradcheck_split, test_errors)
