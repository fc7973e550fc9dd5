/* Tests of nb_max_pool2d and nb_avg_pool2d: forward against naive loops in
 * double (padding, stride != kernel, floor mode), f32 against f64,
 * gradient checks (max pool on tie-free inputs), the first-argmax rule on
 * ties, non-contiguous inputs and the error messages. */
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

typedef struct pcase {
    int64_t n, c, h, w;
    nb_pool2d_opts opts;
} pcase;

#define POPTS(k0, k1, s0, s1, p0, p1) ((nb_pool2d_opts){{k0, k1}, {s0, s1}, {p0, p1}})

static const pcase cases[] = {
    {2, 3, 7, 6, POPTS(3, 2, 2, 1, 1, 1)},
    {1, 2, 6, 6, POPTS(2, 2, 0, 0, 0, 0)}, /* stride 0: the kernel */
    {2, 2, 5, 7, POPTS(3, 3, 1, 2, 1, 0)},
    {1, 3, 8, 7, POPTS(3, 3, 3, 3, 0, 0)}, /* floor mode drops the last row and column */
    {2, 1, 6, 5, POPTS(4, 2, 1, 3, 2, 1)},
    {1, 2, 3, 4, POPTS(1, 1, 2, 1, 0, 0)},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* Reference pooling in double; max skips padding, avg divides by kh * kw. */
static double *ref_pool(const pcase *pc, const double *x, bool is_max, int64_t *oh_out,
                        int64_t *ow_out) {
    const nb_pool2d_opts *o = &pc->opts;
    int kh = o->kernel[0], kw = o->kernel[1];
    int sh = o->stride[0] ? o->stride[0] : kh, sw = o->stride[1] ? o->stride[1] : kw;
    int ph = o->padding[0], pw = o->padding[1];
    int64_t OH = (pc->h + 2 * ph - kh) / sh + 1, OW = (pc->w + 2 * pw - kw) / sw + 1;
    double *out = malloc(sizeof(double) * (size_t)(pc->n * pc->c * OH * OW));
    for (int64_t pl = 0; pl < pc->n * pc->c; pl++)
        for (int64_t oh = 0; oh < OH; oh++)
            for (int64_t ow = 0; ow < OW; ow++) {
                double acc = is_max ? -INFINITY : 0.0;
                for (int i = 0; i < kh; i++)
                    for (int j = 0; j < kw; j++) {
                        int64_t ih = oh * sh - ph + i, iw = ow * sw - pw + j;
                        if (ih < 0 || ih >= pc->h || iw < 0 || iw >= pc->w) continue;
                        double v = x[(pl * pc->h + ih) * pc->w + iw];
                        if (is_max)
                            acc = v > acc ? v : acc;
                        else
                            acc += v;
                    }
                out[(pl * OH + oh) * OW + ow] = is_max ? acc : acc / (kh * kw);
            }
    *oh_out = OH;
    *ow_out = OW;
    return out;
}

/* Distinct values (no ties, gaps of 2/n >> the gradcheck's eps) in a
 * scrambled order, with negatives so that padding must not count as 0. */
static nb_tensor *distinct(nb_ctx *ctx, int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    double *v = malloc(sizeof(double) * (size_t)n);
    ck_assert(n < 7919); /* 7919 is prime, so i -> 7919 i mod n permutes */
    for (int64_t i = 0; i < n; i++)
        v[i] = (double)((i * 7919) % n) / (double)n * 2.0 - 1.5;
    nb_tensor *t = nb_from_host(ctx, NB_F64, ndim, shape, v);
    free(v);
    return t;
}

static void check_forward(const pcase *pc, bool is_max, nb_dtype dt, double tol) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn(ctx, NB_F64, 4, (int64_t[]){pc->n, pc->c, pc->h, pc->w}, 5);
    x = nb_add_scalar(ctx, x, -3.0); /* mostly negative: a max that counted padding would give 0 */
    double *xh = malloc(sizeof(double) * (size_t)nb_numel(x));
    nb_to_host_f64(x, xh);
    int64_t OH, OW;
    double *ref = ref_pool(pc, xh, is_max, &OH, &OW);
    nb_tensor *xd = nb_cast(ctx, x, dt);
    nb_tensor *y = is_max ? nb_max_pool2d(ctx, xd, &pc->opts) : nb_avg_pool2d(ctx, xd, &pc->opts);
    ck_assert_int_eq(y->dtype, dt);
    ck_assert_int_eq(y->ndim, 4);
    ck_assert_int_eq(y->shape[0], pc->n);
    ck_assert_int_eq(y->shape[1], pc->c);
    ck_assert_int_eq(y->shape[2], OH);
    ck_assert_int_eq(y->shape[3], OW);
    nbt_assert_close(y, ref, tol, tol);
    free(ref);
    free(xh);
    nb_ctx_free(ctx);
}

START_TEST(test_forward) {
    for (int k = 0; k < NCASES; k++) {
        check_forward(&cases[k], true, NB_F64, 0);
        check_forward(&cases[k], false, NB_F64, 1e-12);
        check_forward(&cases[k], true, NB_F32, 1e-6);
        check_forward(&cases[k], false, NB_F32, 1e-5);
    }
}
END_TEST

NBT_CPU_TEST(test_avg_counts_padding) {
    /* ones (1, 1, 2, 2), kernel 3, padding 1, stride 1: every window holds
     * the 4 ones and 5 padded zeros */
    nb_tensor *x = nb_ones(ctx, NB_F64, NB_SHAPE(1, 1, 2, 2));
    nb_pool2d_opts o = POPTS(3, 3, 1, 1, 1, 1);
    double expect[4] = {4.0 / 9, 4.0 / 9, 4.0 / 9, 4.0 / 9};
    nbt_assert_close(nb_avg_pool2d(ctx, x, &o), expect, 1e-15, 0);
    nb_tensor *neg = nb_full(ctx, NB_F64, NB_SHAPE(1, 1, 2, 2), -2.0);
    double expect_max[4] = {-2, -2, -2, -2};
    nbt_assert_close(nb_max_pool2d(ctx, neg, &o), expect_max, 0, 0);
}

/* ---- gradients ---- */
typedef struct pool_grad_case {
    nb_pool2d_opts opts;
    bool is_max;
    bool transpose; /* inputs[0] is (N, C, W, H) */
} pool_grad_case;

static nb_tensor *pool_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const pool_grad_case *pg = user;
    nb_tensor *x = pg->transpose ? nb_transpose(ctx, in[0], 2, 3) : in[0];
    return pg->is_max ? nb_max_pool2d(ctx, x, &pg->opts) : nb_avg_pool2d(ctx, x, &pg->opts);
}

NBT_CPU_TEST(test_gradcheck) {
    for (int k = 0; k < NCASES; k++) {
        const pcase *pc = &cases[k];
        int64_t shape[4] = {pc->n, pc->c, pc->h, pc->w};
        for (int m = 0; m < 2; m++) {
            pool_grad_case pg = {pc->opts, m == 0, false};
            nb_tensor *x = distinct(ctx, 4, shape);
            nb_set_requires_grad(x, true);
            NBT_GRADCHECK(pool_fn, &pg, 1, &x);
        }
    }
}

NBT_CPU_TEST(test_non_contiguous) {
    nb_tensor *xt = distinct(ctx, 4, (int64_t[]){2, 2, 5, 6}); /* (N, C, W, H) */
    nb_set_requires_grad(xt, true);
    nb_tensor *x = nb_transpose(ctx, xt, 2, 3);
    ck_assert(!nb_is_contiguous(x));
    pcase pc = {2, 2, 6, 5, POPTS(3, 2, 2, 1, 1, 1)};
    double *xh = malloc(sizeof(double) * (size_t)nb_numel(x));
    nb_to_host_f64(x, xh);
    for (int m = 0; m < 2; m++) {
        int64_t OH, OW;
        double *ref = ref_pool(&pc, xh, m == 0, &OH, &OW);
        nb_tensor *y = m == 0 ? nb_max_pool2d(ctx, x, &pc.opts) : nb_avg_pool2d(ctx, x, &pc.opts);
        nbt_assert_close(y, ref, 1e-12, 1e-12);
        free(ref);
        pool_grad_case pg = {pc.opts, m == 0, true};
        NBT_GRADCHECK(pool_fn, &pg, 1, &xt);
    }
    free(xh);
}

NBT_CPU_TEST(test_max_ties_first) {
    /* equal values: the gradient goes to the first maximum of each window;
     * windows of stride 1 overlap, so shared maxima accumulate */
    nb_tensor *x = nb_ones(ctx, NB_F64, NB_SHAPE(1, 1, 2, 2));
    nb_set_requires_grad(x, true);
    nb_pool2d_opts o = POPTS(2, 2, 0, 0, 0, 0);
    nb_backward(nb_sum_all(ctx, nb_max_pool2d(ctx, x, &o)));
    double expect[4] = {1, 0, 0, 0};
    nbt_assert_close(x->grad, expect, 0, 0);

    double v[9] = {1, 5, 2, 5, 5, 0, 3, 4, 5};
    nb_tensor *y = nb_from_host(ctx, NB_F64, NB_SHAPE(1, 1, 3, 3), v);
    nb_set_requires_grad(y, true);
    nb_pool2d_opts o2 = POPTS(2, 2, 1, 1, 0, 0);
    nb_tensor *out = nb_max_pool2d(ctx, y, &o2);
    double expect_out[4] = {5, 5, 5, 5};
    nbt_assert_close(out, expect_out, 0, 0);
    nb_backward(nb_sum_all(ctx, out));
    /* windows: top-left -> (0,1); top-right -> (0,1); bottom-left -> (1,0); bottom-right -> (1,1)
     */
    double expect_g[9] = {0, 2, 0, 1, 1, 0, 0, 0, 0};
    nbt_assert_close(y->grad, expect_g, 0, 0);
}

/* NaN: a window with a NaN gives NaN, and its gradient goes to the first
 * NaN; among numbers to the first maximum (2x2 windows of stride 2, the
 * common case with its own loop, in f32 and f64; and a 3x3 window of
 * stride 1 through the general loop). */
NBT_CPU_TEST(test_max_nan) {
    double v[20] = {1, NAN, 2, 3, 7, 4, 5, NAN, NAN, 7, 0, 0, 1, 1, 7, 0, 9, 1, 1, 7};
    NBT_FOR_F64_F32(k, dt) {
        nb_tensor *x = nb_cast(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(1, 1, 4, 5), v), dt);
        nb_set_requires_grad(x, true);
        nb_pool2d_opts o = POPTS(2, 2, 2, 2, 0, 0); /* the fifth column is dropped */
        nb_tensor *y = nb_max_pool2d(ctx, x, &o);
        double got[4], g[20];
        nb_to_host_f64(y, got);
        ck_assert(isnan(got[0]) && isnan(got[1]));
        ck_assert(got[2] == 9 && got[3] == 1);
        nb_backward(nb_sum_all(ctx, y));
        nb_to_host_f64(x->grad, g);
        double expect[20] = {0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0};
        for (int i = 0; i < 20; i++)
            ck_assert_msg(g[i] == expect[i], "%s: grad[%d] = %g", nb_dtype_name(dt), i, g[i]);
    }
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(1, 1, 4, 5), v);
    nb_set_requires_grad(x, true);
    nb_pool2d_opts o3 = POPTS(3, 3, 1, 1, 0, 0);
    nb_tensor *y = nb_max_pool2d(ctx, x, &o3); /* (2, 3) */
    double got[6], g[20];
    nb_to_host_f64(y, got);
    for (int i = 0; i < 6; i++) ck_assert_msg(isnan(got[i]), "3x3 window %d: %g", i, got[i]);
    nb_backward(nb_sum_all(ctx, y));
    nb_to_host_f64(x->grad, g);
    /* first NaN of each window in row-major order: (0,1) for the two windows
     * of row 0 that contain it, (1,2) for the other four */
    double expect[20] = {0, 2, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 20; i++) ck_assert_msg(g[i] == expect[i], "3x3: grad[%d] = %g", i, g[i]);
}

/* 2x2 windows of stride 2 through the vectorised paths: rows long enough
 * for 8 outputs at a time (OW = 18: two blocks and a scalar tail; an odd
 * last column dropped), and whole planes of width 8 and 4 whose row pairs
 * are taken 2 and 4 at a time (pair counts that leave a scalar remainder,
 * and OH = 3 so that a block spans two planes); values from three levels
 * so that most windows tie, and NaNs: against a naive loop (first maximum,
 * first NaN), values and where the gradient goes, in f32 and f64. */
static void check_max_2x2(int64_t planes, int64_t H, int64_t W, uint32_t seed) {
    int64_t OH = H / 2, OW = W / 2, n = planes * H * W, no = planes * OH * OW;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    double *v = malloc(sizeof(double) * (size_t)n), *eg = calloc((size_t)n, sizeof(double));
    double *g = malloc(sizeof(double) * (size_t)n), *e = malloc(sizeof(double) * (size_t)no);
    double *got = malloc(sizeof(double) * (size_t)no);
    uint32_t r = seed;
    for (int64_t i = 0; i < n; i++) {
        r = r * 1103515245u + 12345u;
        v[i] = (double)((r >> 16) % 3) - 1.0;
    }
    for (int64_t i = 3; i < n; i += 29) v[i] = NAN;
    for (int64_t pl = 0; pl < planes; pl++)
        for (int64_t oh = 0; oh < OH; oh++)
            for (int64_t ow = 0; ow < OW; ow++) {
                int64_t bi = -1;
                for (int dh = 0; dh < 2; dh++)
                    for (int dw = 0; dw < 2; dw++) {
                        int64_t i = pl * H * W + (2 * oh + dh) * W + 2 * ow + dw;
                        if (bi < 0 || (isnan(v[i]) && !isnan(v[bi])) || (!isnan(v[bi]) && v[i] > v[bi])) bi = i;
                    }
                e[(pl * OH + oh) * OW + ow] = v[bi];
                eg[bi] += 1;
            }
    NBT_FOR_F64_F32(k, dt) {
        nb_tensor *x = nb_cast(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(1, planes, H, W), v), dt);
        nb_set_requires_grad(x, true);
        nb_pool2d_opts o = POPTS(2, 2, 2, 2, 0, 0);
        nb_tensor *y = nb_max_pool2d(ctx, x, &o);
        ck_assert(y->shape[2] == OH && y->shape[3] == OW);
        nb_to_host_f64(y, got);
        for (int64_t i = 0; i < no; i++)
            ck_assert_msg(isnan(e[i]) ? isnan(got[i]) : got[i] == e[i],
                          "%s %lldx%lld: out[%lld] = %g, expected %g", nb_dtype_name(dt), (long long)H,
                          (long long)W, (long long)i, got[i], e[i]);
        nb_backward(nb_sum_all(ctx, y));
        nb_to_host_f64(x->grad, g);
        for (int64_t i = 0; i < n; i++)
            ck_assert_msg(g[i] == eg[i], "%s %lldx%lld: grad[%lld] = %g, expected %g", nb_dtype_name(dt),
                          (long long)H, (long long)W, (long long)i, g[i], eg[i]);
    }
    free(v), free(eg), free(g), free(e), free(got);
    nb_ctx_free(ctx);
}

START_TEST(test_max_2x2_vector_paths) {
    check_max_2x2(2, 6, 37, 1); /* rows: 8 + 8 + tail */
    check_max_2x2(3, 6, 8, 2);  /* 9 row pairs of width 8: 4 blocks of 2, one left */
    check_max_2x2(3, 6, 4, 3);  /* 9 row pairs of width 4: 2 blocks of 4, one left */
    check_max_2x2(4, 8, 8, 4);  /* the CNN's first pool */
    check_max_2x2(5, 4, 4, 5);  /* its second */
}
END_TEST

/* ---- errors ---- */
/* An empty input with padding still has windows (of padding only): max
 * gives 0 there and backward writes nothing (index -1 is skipped). */
NBT_CPU_TEST(test_empty_input_with_padding) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(1, 1, 0, 2));
    nb_set_requires_grad(x, true);
    nb_pool2d_opts o = {{2, 2}, {0, 0}, {1, 1}};
    nb_tensor *y = nb_max_pool2d(ctx, x, &o);
    ck_assert_int_eq(y->shape[2], 1);
    ck_assert_int_eq(y->shape[3], 2);
    for (int64_t j = 0; j < 2; j++) ck_assert_double_eq(nb_get(y, (int64_t[]){0, 0, 0, j}), 0);
    nb_backward(nb_sum_all(ctx, y));
    ck_assert_ptr_nonnull(x->grad);
    ck_assert_int_eq(nb_numel(x->grad), 0);
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 8, 8));
    nb_pool2d_opts big_pad = POPTS(3, 3, 1, 1, 2, 1);
    NBT_EXPECT_ABORT(
        nb_max_pool2d(ctx, x, &big_pad),
        "nb_max_pool2d: padding (2, 1) must be non-negative and at most half the kernel (3, 3)");
    NBT_EXPECT_ABORT(nb_avg_pool2d(ctx, x, &big_pad), "nb_avg_pool2d: padding (2, 1)");
    nb_pool2d_opts neg_pad = POPTS(3, 3, 1, 1, -1, 0);
    NBT_EXPECT_ABORT(nb_avg_pool2d(ctx, x, &neg_pad), "must be non-negative");
    nb_pool2d_opts ok = POPTS(2, 2, 0, 0, 0, 0);
    NBT_EXPECT_ABORT(nb_max_pool2d(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(3, 8, 8)), &ok),
                     "nb_max_pool2d: input must be 4-D (N, C, H, W), got shape (3, 8, 8)");
    nb_pool2d_opts huge = POPTS(9, 2, 0, 0, 0, 0);
    NBT_EXPECT_ABORT(nb_avg_pool2d(ctx, x, &huge), "nb_avg_pool2d: output size is not positive");
    nb_pool2d_opts k0 = POPTS(0, 2, 0, 0, 0, 0);
    NBT_EXPECT_ABORT(nb_max_pool2d(ctx, x, &k0),
                     "nb_max_pool2d: kernel size must be positive, got (0, 2)");
    nb_pool2d_opts sneg = POPTS(2, 2, -1, 1, 0, 0);
    NBT_EXPECT_ABORT(nb_max_pool2d(ctx, x, &sneg), "nb_max_pool2d: stride must be positive");
    NBT_EXPECT_ABORT(nb_max_pool2d(ctx, x, NULL), "nb_max_pool2d: opts is NULL");
    NBT_EXPECT_ABORT(nb_avg_pool2d(ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(1, 1, 4, 4)), &ok),
                     "nb_avg_pool2d: dtype i64 is not supported");
}

NBT_MAIN("pool", "pool2d", 0,
         test_forward, test_avg_counts_padding, test_gradcheck, test_non_contiguous, test_max_ties_first,
         test_max_nan, test_max_2x2_vector_paths, test_errors, test_empty_input_with_padding)
