/* Layer norm and batch norm: values against naive double references (with
 * and without affine parameters, several shapes, f32 and f64, training and
 * eval), the running-statistics update against its closed form (unbiased
 * variance), gradchecks for x, weight and bias (non-contiguous x too), and
 * error messages. */
#include <math.h>

#include "testutil.h"

#define MAXN 512

/* ---- layer norm ---- */
static void check_layer_norm(nb_ctx *ctx, nb_tensor *x, int norm_ndim, nb_tensor *w, nb_tensor *b,
                             double eps) {
    static double xv[MAXN], wv[MAXN], bv[MAXN], e[MAXN];
    int64_t n = nb_numel(x);
    ck_assert(n <= MAXN);
    int64_t d = 1;
    for (int k = x->ndim - norm_ndim; k < x->ndim; k++) d *= x->shape[k];
    nb_to_host_f64(x, xv);
    if (w) nb_to_host_f64(w, wv);
    if (b) nb_to_host_f64(b, bv);
    nbt_ref_layer_norm(e, xv, w ? wv : NULL, b ? bv : NULL, n / d, d, eps);
    nb_tensor *y = nb_layer_norm(ctx, x, norm_ndim, w, b, eps);
    ck_assert(y->dtype == x->dtype && nb_same_shape(y, x));
    bool f32 = x->dtype == NB_F32;
    nbt_assert_close(y, e, f32 ? 1e-5 : 1e-13, f32 ? 1e-5 : 1e-12);
}

START_TEST(test_layer_norm_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    NBT_FOR_F64_F32(dti, dt) {
        /* an offset mean tests the two-pass variance */
        nb_tensor *x = nb_add_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(4, 6), 1), 5.0);
        nb_tensor *w = nbt_randn(ctx, dt, NB_SHAPE(6), 2), *b = nbt_randn(ctx, dt, NB_SHAPE(6), 3);
        check_layer_norm(ctx, x, 1, NULL, NULL, 1e-5);
        check_layer_norm(ctx, x, 1, w, b, 1e-5);
        check_layer_norm(ctx, x, 1, w, NULL, 0.1);
        check_layer_norm(ctx, x, 1, NULL, b, 1e-5);
        check_layer_norm(ctx, x, 2, NULL, NULL, 1e-5);
        nb_tensor *x3 = nbt_randn(ctx, dt, NB_SHAPE(2, 3, 4), 4);
        nb_tensor *w2 = nbt_randn(ctx, dt, NB_SHAPE(3, 4), 5), *b2 = nbt_randn(ctx, dt, NB_SHAPE(3, 4), 6);
        check_layer_norm(ctx, x3, 2, w2, b2, 1e-5);
        check_layer_norm(ctx, x3, 2, NULL, NULL, 1e-5);
        check_layer_norm(ctx, x3, 1, nb_select(ctx, w2, 0, 1), nb_select(ctx, b2, 0, 2), 1e-5);
        /* non-contiguous input and weight */
        nb_tensor *xt = nb_transpose(ctx, x3, 0, 2); /* (4, 3, 2) */
        nb_tensor *wt = nb_slice(ctx, nbt_randn(ctx, dt, NB_SHAPE(4), 7), 0, 0, 4, 2);
        check_layer_norm(ctx, xt, 1, wt, NULL, 1e-5);
        check_layer_norm(ctx, xt, 2, nb_transpose(ctx, nbt_randn(ctx, dt, NB_SHAPE(2, 3), 8), 0, 1),
                         NULL, 1e-5);
    }
    nb_ctx_free(ctx);
}
END_TEST

typedef struct ln_case {
    int norm_ndim;
    bool has_w, has_b, transpose;
} ln_case;

/* inputs: x, w, b (w, b ignored unless has_w / has_b) */
static nb_tensor *ln_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const ln_case *c = user;
    nb_tensor *x = c->transpose ? nb_transpose(ctx, in[0], 0, in[0]->ndim - 1) : in[0];
    return nb_layer_norm(ctx, x, c->norm_ndim, c->has_w ? in[1] : NULL, c->has_b ? in[2] : NULL,
                         1e-5);
}

START_TEST(test_layer_norm_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    ln_case cases[] = {{1, true, true, false},  {1, false, false, false}, {1, true, false, true},
                       {2, true, true, false},  {2, false, true, true},   {1, true, true, true}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const ln_case *c = &cases[k];
        int64_t shape[3] = {2, 3, 4};
        nb_tensor *x = c->transpose ? nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3, 2), 20 + k)
                                    : nbt_randn_leaf(ctx, NB_F64, 3, shape, 20 + k);
        int64_t *ns = shape + 3 - c->norm_ndim;
        nb_tensor *in[3] = {x, nbt_randn_leaf(ctx, NB_F64, c->norm_ndim, ns, 30 + k),
                            nbt_randn_leaf(ctx, NB_F64, c->norm_ndim, ns, 40 + k)};
        NBT_GRADCHECK(ln_fn, (void *)c, 3, in);
    }
    /* x needs no grad: weight and bias alone */
    nb_tensor *in[3] = {nbt_randn(ctx, NB_F64, NB_SHAPE(3, 5), 50),
                        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(5), 51),
                        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(5), 52)};
    ln_case c = {1, true, true, false};
    NBT_GRADCHECK(ln_fn, &c, 3, in);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_layer_norm_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 4));
    nb_tensor *w = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_layer_norm(ctx, x, 1, w, NULL, 1e-5),
                     "nb_layer_norm: weight has shape (3,) but the normalised dims of input (2, 3, 4) "
                     "are (4,)");
    nb_tensor *b = nb_zeros(ctx, NB_F32, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_layer_norm(ctx, x, 2, NULL, b, 1e-5),
                     "bias has shape (4,) but the normalised dims of input (2, 3, 4) are (3, 4)");
    nb_tensor *wd = nb_zeros(ctx, NB_F64, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_layer_norm(ctx, x, 1, wd, NULL, 1e-5), "nb_layer_norm: weight is f64");
    NBT_EXPECT_ABORT(nb_layer_norm(ctx, x, 0, NULL, NULL, 1e-5), "nb_layer_norm: norm_ndim 0");
    NBT_EXPECT_ABORT(nb_layer_norm(ctx, x, 4, NULL, NULL, 1e-5), "nb_layer_norm: norm_ndim 4");
    nb_tensor *xi = nb_zeros(ctx, NB_I32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_layer_norm(ctx, xi, 1, NULL, NULL, 1e-5), "nb_layer_norm: dtype i32");
    nb_ctx_free(ctx);
}
END_TEST

/* ---- batch norm ---- */
/* x (N, C, S) row-major: per-channel mean and biased variance */
static void ref_bn_stats(double *mean, double *var, const double *x, int64_t n, int64_t c, int64_t s) {
    for (int64_t ch = 0; ch < c; ch++) {
        double mu = 0, v = 0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < s; k++) mu += x[(i * c + ch) * s + k];
        mu /= (double)(n * s);
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < s; k++) {
                double t = x[(i * c + ch) * s + k] - mu;
                v += t * t;
            }
        mean[ch] = mu;
        var[ch] = v / (double)(n * s);
    }
}

static void ref_bn_apply(double *y, const double *x, const double *mean, const double *var,
                         const double *w, const double *b, int64_t n, int64_t c, int64_t s,
                         double eps) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t ch = 0; ch < c; ch++)
            for (int64_t k = 0; k < s; k++) {
                int64_t q = (i * c + ch) * s + k;
                y[q] = (x[q] - mean[ch]) / sqrt(var[ch] + eps) * (w ? w[ch] : 1.0) + (b ? b[ch] : 0.0);
            }
}

START_TEST(test_batch_norm_train_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    static const int64_t shapes[][4] = {{6, 3, 0, 0}, {2, 3, 4, 5}, {3, 2, 5, 0}};
    static const int ndims[] = {2, 4, 3};
    for (int si = 0; si < 3; si++) {
        NBT_FOR_F64_F32(dti, dt) {
            const int64_t *shape = shapes[si];
            int64_t n = shape[0], c = shape[1], s = 1;
            for (int k = 2; k < ndims[si]; k++) s *= shape[k];
            nb_tensor *x = nb_add_scalar(ctx, nbt_randn(ctx, dt, ndims[si], shape, 70 + si), 3.0);
            nb_tensor *w = nbt_randn(ctx, dt, 1, &c, 71), *b = nbt_randn(ctx, dt, 1, &c, 72);
            /* running stats as f64 for the f32 input too (any float dtype is accepted) */
            nb_tensor *rm = nbt_randn(ctx, NB_F64, 1, &c, 73);
            nb_tensor *rv = nb_add_scalar(ctx, nb_abs(ctx, nbt_randn(ctx, NB_F64, 1, &c, 74)), 0.5);
            double xv[MAXN], wv[8], bv[8], rm0[8], rv0[8], mean[8], var[8], e[MAXN];
            nb_to_host_f64(x, xv);
            nb_to_host_f64(w, wv);
            nb_to_host_f64(b, bv);
            nb_to_host_f64(rm, rm0);
            nb_to_host_f64(rv, rv0);
            ref_bn_stats(mean, var, xv, n, c, s);
            double eps = 1e-5, mom = 0.1;
            nb_tensor *y = nb_batch_norm(ctx, x, w, b, rm, rv, true, mom, eps);
            ref_bn_apply(e, xv, mean, var, wv, bv, n, c, s, eps);
            bool f32 = dt == NB_F32;
            nbt_assert_close(y, e, f32 ? 1e-5 : 1e-13, f32 ? 1e-5 : 1e-12);
            /* running = (1 - momentum) running + momentum stat, unbiased variance */
            double erm[8], erv[8], m = (double)(n * s);
            for (int64_t k = 0; k < c; k++) {
                erm[k] = (1 - mom) * rm0[k] + mom * mean[k];
                erv[k] = (1 - mom) * rv0[k] + mom * var[k] * m / (m - 1);
            }
            nbt_assert_close(rm, erm, f32 ? 1e-6 : 1e-14, f32 ? 1e-6 : 1e-13);
            nbt_assert_close(rv, erv, f32 ? 1e-6 : 1e-14, f32 ? 1e-6 : 1e-13);
            /* no affine, no running stats */
            ref_bn_apply(e, xv, mean, var, NULL, NULL, n, c, s, eps);
            nbt_assert_close(nb_batch_norm(ctx, x, NULL, NULL, NULL, NULL, true, mom, eps), e,
                             f32 ? 1e-5 : 1e-13, f32 ? 1e-5 : 1e-12);
        }
    }
    nb_ctx_free(ctx);
}
END_TEST

/* The running stats as f32, strided; momentum 1 copies the batch stats. */
START_TEST(test_batch_norm_running_update_f32) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(4, 2), (float[]){1, 0, 2, 0, 3, 1, 6, 1});
    nb_tensor *buf = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 2));
    nb_tensor *rm = nb_select(ctx, buf, 1, 0), *rv = nb_select(ctx, buf, 1, 1); /* (2), stride 2 */
    nb_fill_(rv, 1.0);
    nb_batch_norm(ctx, x, NULL, NULL, rm, rv, true, 1.0, 1e-5);
    /* channel 0: mean 3, unbiased var 14/3; channel 1: mean 0.5, unbiased var 1/3 */
    double em[2] = {3.0, 0.5}, ev[2] = {14.0 / 3, 1.0 / 3};
    nbt_assert_close(rm, em, 1e-6, 1e-6);
    nbt_assert_close(rv, ev, 1e-6, 1e-6);
    /* momentum 0 leaves them alone */
    nb_batch_norm(ctx, nb_mul_scalar(ctx, x, 7.0), NULL, NULL, rm, rv, true, 0.0, 1e-5);
    nbt_assert_close(rm, em, 1e-6, 1e-6);
    nbt_assert_close(rv, ev, 1e-6, 1e-6);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_batch_norm_eval_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    NBT_FOR_F64_F32(dti, dt) {
        int64_t c = 3;
        nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 3, 2, 2), 80);
        nb_tensor *w = nbt_randn(ctx, dt, 1, &c, 81), *b = nbt_randn(ctx, dt, 1, &c, 82);
        nb_tensor *rm = nbt_randn(ctx, dt, 1, &c, 83);
        nb_tensor *rv = nb_add_scalar(ctx, nb_abs(ctx, nbt_randn(ctx, dt, 1, &c, 84)), 0.5);
        double xv[24], wv[3], bv[3], rmv[3], rvv[3], e[24];
        nb_to_host_f64(x, xv);
        nb_to_host_f64(w, wv);
        nb_to_host_f64(b, bv);
        nb_to_host_f64(rm, rmv);
        nb_to_host_f64(rv, rvv);
        ref_bn_apply(e, xv, rmv, rvv, wv, bv, 2, 3, 4, 1e-3);
        bool f32 = dt == NB_F32;
        nb_tensor *y = nb_batch_norm(ctx, x, w, b, rm, rv, false, 0.1, 1e-3);
        nbt_assert_close(y, e, f32 ? 1e-5 : 1e-13, f32 ? 1e-5 : 1e-12);
        /* eval leaves the running stats unchanged */
        nbt_assert_close(rm, rmv, 0, 0);
        nbt_assert_close(rv, rvv, 0, 0);
        /* 2-D, non-contiguous input */
        nb_tensor *xt = nb_transpose(ctx, nbt_randn(ctx, dt, NB_SHAPE(3, 5), 85), 0, 1); /* (5, 3) */
        double xtv[15], et[15];
        nb_to_host_f64(xt, xtv);
        ref_bn_apply(et, xtv, rmv, rvv, NULL, bv, 5, 3, 1, 1e-5);
        nbt_assert_close(nb_batch_norm(ctx, xt, NULL, b, rm, rv, false, 0.1, 1e-5), et,
                         f32 ? 1e-5 : 1e-13, f32 ? 1e-5 : 1e-12);
    }
    nb_ctx_free(ctx);
}
END_TEST

typedef struct bn_case {
    bool training, affine, transpose;
    nb_tensor *rm, *rv;
} bn_case;

/* inputs: x, w, b */
static nb_tensor *bn_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const bn_case *c = user;
    nb_tensor *x = c->transpose ? nb_transpose(ctx, in[0], 0, 1) : in[0];
    return nb_batch_norm(ctx, x, c->affine ? in[1] : NULL, c->affine ? in[2] : NULL, c->rm, c->rv,
                         c->training, 0.1, 1e-5);
}

START_TEST(test_batch_norm_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int64_t c = 3;
    nb_tensor *rm = nbt_randn(ctx, NB_F64, 1, &c, 90);
    nb_tensor *rv = nb_add_scalar(ctx, nb_abs(ctx, nbt_randn(ctx, NB_F64, 1, &c, 91)), 0.5);
    bn_case cases[] = {
        {true, true, false, NULL, NULL}, {true, false, false, NULL, NULL},
        {true, true, true, rm, rv},      {false, true, false, rm, rv},
        {false, false, true, rm, rv},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        nb_tensor *in[3] = {NULL, nbt_randn_leaf(ctx, NB_F64, 1, &c, 92 + k),
                            nbt_randn_leaf(ctx, NB_F64, 1, &c, 93 + k)};
        /* 2-D (N, C) and 4-D (N, C, H, W); the transposed case swaps N and C of a leaf */
        in[0] = cases[k].transpose ? nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 94 + k)
                                   : nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3), 94 + k);
        NBT_GRADCHECK(bn_fn, &cases[k], 3, in);
        nb_tensor *in4[3] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3, 2, 3), 95 + k), in[1], in[2]};
        if (cases[k].transpose) in4[0] = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2, 2, 3), 95 + k);
        NBT_GRADCHECK(bn_fn, &cases[k], 3, in4);
    }
    /* running stats get no gradient */
    ck_assert(rm->grad == NULL && rv->grad == NULL && !rm->requires_grad);
    nb_ctx_free(ctx);
}
END_TEST

/* The f32 backward kernels agree with the f64 ones (x, weight, bias). */
START_TEST(test_f32_backward) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int64_t c = 3;
    nb_tensor *rm = nb_zeros(ctx, NB_F64, 1, &c), *rv = nb_ones(ctx, NB_F64, 1, &c);
    for (int k = 0; k < 3; k++) {
        nb_tensor *x64, *x32, *w64, *w32, *b64, *b32;
        nbt_twin_leaves(ctx, NB_SHAPE(4, 3, 2, 3), 500 + k, &x64, &x32);
        nbt_twin_leaves(ctx, 1, &c, 510 + k, &w64, &w32);
        nbt_twin_leaves(ctx, 1, &c, 520 + k, &b64, &b32);
        nb_tensor *y64, *y32;
        if (k == 0) {
            nb_tensor *w2 = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 530);
            nb_tensor *w2f = nb_cast(ctx, nb_detach(ctx, w2), NB_F32);
            nb_set_requires_grad(w2f, true);
            y64 = nb_layer_norm(ctx, x64, 2, w2, NULL, 1e-5);
            y32 = nb_layer_norm(ctx, x32, 2, w2f, NULL, 1e-5);
            nb_backward(nbt_weighted_sum(ctx, y64));
            nb_backward(nbt_weighted_sum(ctx, y32));
            nbt_assert_tensors_close(w2f->grad, w2->grad, 1e-5, 1e-4);
        } else {
            y64 = nb_batch_norm(ctx, x64, w64, b64, rm, rv, k == 1, 0.1, 1e-5);
            y32 = nb_batch_norm(ctx, x32, w32, b32, rm, rv, k == 1, 0.1, 1e-5);
            nb_backward(nbt_weighted_sum(ctx, y64));
            nb_backward(nbt_weighted_sum(ctx, y32));
            nbt_assert_tensors_close(w32->grad, w64->grad, 1e-5, 1e-4);
            nbt_assert_tensors_close(b32->grad, b64->grad, 1e-5, 1e-4);
        }
        nbt_assert_tensors_close(x32->grad, x64->grad, 1e-5, 1e-4);
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_batch_norm_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(8, 3, 5, 5));
    nb_tensor *c3 = nb_ones(ctx, NB_F32, NB_SHAPE(3)), *c4 = nb_ones(ctx, NB_F32, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, c4, NULL, NULL, NULL, true, 0.1, 1e-5),
                     "nb_batch_norm: weight has shape (4,) but the input (8, 3, 5, 5) has 3 channels");
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, c3, c4, NULL, NULL, true, 0.1, 1e-5),
                     "nb_batch_norm: bias has shape (4,) but the input (8, 3, 5, 5) has 3 channels");
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, c3, c3, c4, c3, true, 0.1, 1e-5),
                     "nb_batch_norm: running_mean has shape (4,) but the input (8, 3, 5, 5) has 3 "
                     "channels");
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, c3, c3, c3, c4, false, 0.1, 1e-5),
                     "nb_batch_norm: running_var has shape (4,)");
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, c3, c3, NULL, NULL, false, 0.1, 1e-5),
                     "nb_batch_norm: eval mode (training = false) needs running_mean and running_var");
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, NULL, NULL, c3, NULL, true, 0.1, 1e-5),
                     "running_mean and running_var must both be given");
    nb_tensor *c3d = nb_ones(ctx, NB_F64, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, c3d, NULL, NULL, NULL, true, 0.1, 1e-5),
                     "nb_batch_norm: weight is f64 but the input is f32");
    nb_tensor *x1 = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x1, NULL, NULL, NULL, NULL, true, 0.1, 1e-5),
                     "nb_batch_norm: input must be (N, C, ..), got shape (3,)");
    nb_tensor *xone = nb_zeros(ctx, NB_F32, NB_SHAPE(1, 3));
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, xone, NULL, NULL, NULL, NULL, true, 0.1, 1e-5),
                     "training needs more than one value per channel, got input (1, 3)");
    NBT_EXPECT_ABORT(nb_batch_norm(ctx, x, NULL, NULL, NULL, NULL, true, 1.5, 1e-5),
                     "momentum must be in [0, 1]");
    nb_ctx_free(ctx);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_layer_norm_values, test_layer_norm_gradcheck, test_layer_norm_errors,
                             test_batch_norm_train_values, test_batch_norm_running_update_f32,
                             test_batch_norm_eval_values, test_batch_norm_gradcheck, test_f32_backward,
                             test_batch_norm_errors, NULL};
    return nbt_suite("norm", "core", 0, tests);
}

int main(void) { return nbt_run(suite()); }
