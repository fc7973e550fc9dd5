/* BatchNorm1d/2d as modules: training mode against batch statistics, the
 * running statistics and num_batches_tracked over several steps against
 * their recurrences (exponential and cumulative), evaluation mode against
 * the running statistics, the affine and track_running_stats switches,
 * mode changes through a parent, gradchecks in both modes, and errors. */
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

#define MAXC 8

/* x (N, C, S) row-major: per-channel mean and biased variance */
static void batch_stats(const nb_tensor *x, double *mean, double *var) {
    int64_t n = x->shape[0], c = x->shape[1], s = nb_numel(x) / (n * c);
    double *v = malloc(sizeof(double) * (size_t)nb_numel(x));
    nb_to_host_f64(x, v);
    for (int64_t ch = 0; ch < c; ch++) {
        double mu = 0, q = 0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < s; k++) mu += v[(i * c + ch) * s + k] / (double)(n * s);
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < s; k++) q += pow(v[(i * c + ch) * s + k] - mu, 2) / (double)(n * s);
        mean[ch] = mu;
        var[ch] = q;
    }
    free(v);
}

/* (x - mean) / sqrt(var + eps) * w + b per channel; w, b NULL for none */
static void check_normalized(const nb_tensor *y, const nb_tensor *x, const double *mean,
                             const double *var, const nb_tensor *w, const nb_tensor *b, double eps,
                             double tol) {
    int64_t n = x->shape[0], c = x->shape[1], s = nb_numel(x) / (n * c), total = nb_numel(x);
    double *xv = malloc(sizeof(double) * (size_t)total), *e = malloc(sizeof(double) * (size_t)total);
    double wv[MAXC], bv[MAXC];
    nb_to_host_f64(x, xv);
    if (w) nb_to_host_f64(w, wv);
    if (b) nb_to_host_f64(b, bv);
    for (int64_t i = 0; i < n; i++)
        for (int64_t ch = 0; ch < c; ch++)
            for (int64_t k = 0; k < s; k++) {
                int64_t q = (i * c + ch) * s + k;
                e[q] = (xv[q] - mean[ch]) / sqrt(var[ch] + eps) * (w ? wv[ch] : 1) + (b ? bv[ch] : 0);
            }
    nbt_assert_close(y, e, tol, tol);
    free(xv);
    free(e);
}

static void randomize(nb_tensor *t, uint64_t seed) {
    nb_rng rng = nb_rng_make(seed);
    nb_init_normal_(t, 0.0, 1.0, &rng);
}

NBT_CPU_TEST(test_train_then_eval) {
    NBT_FOR_F64_F32(k, dt) {
        double tol = k ? 2e-5 : 1e-12, eps = 1e-3, mom = 0.25;
        nb_batch_norm_opts o = {eps, mom, true, true};
        nb_module *bn = nb_batch_norm2d_new(ctx, dt, 3, &o);
        nb_tensor *w = nb_module_find(bn, "weight"), *b = nb_module_find(bn, "bias");
        nb_tensor *rm = nb_module_find(bn, "running_mean"), *rv = nb_module_find(bn, "running_var");
        nb_tensor *nbt = nb_module_find(bn, "num_batches_tracked");
        randomize(w, 1);
        randomize(b, 2);
        double erm[3] = {0, 0, 0}, erv[3] = {1, 1, 1};
        for (int step = 0; step < 3; step++) {
            nb_tensor *x = nb_add_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(4, 3, 2, 3), 10 + step), step);
            double mean[3], var[3];
            batch_stats(x, mean, var);
            check_normalized(nb_module_forward(bn, ctx, x), x, mean, var, w, b, eps, tol);
            for (int c = 0; c < 3; c++) {
                erm[c] = (1 - mom) * erm[c] + mom * mean[c];
                erv[c] = (1 - mom) * erv[c] + mom * var[c] * 24 / 23; /* unbiased */
            }
            nbt_assert_close(rm, erm, tol, tol);
            nbt_assert_close(rv, erv, tol, tol);
            ck_assert(nb_item(nbt) == step + 1);
        }
        /* evaluation: running statistics, nothing updated */
        double rm0[3], rv0[3];
        nb_to_host_f64(rm, rm0);
        nb_to_host_f64(rv, rv0);
        nb_module_eval(bn);
        nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 3, 2, 2), 20);
        check_normalized(nb_module_forward(bn, ctx, x), x, erm, erv, w, b, eps, tol);
        nbt_assert_close(rm, rm0, 0, 0);
        nbt_assert_close(rv, rv0, 0, 0);
        ck_assert(nb_item(nbt) == 3);
        /* a batch of one is fine in evaluation mode */
        nb_tensor *x1 = nbt_randn(ctx, dt, NB_SHAPE(1, 3, 1, 1), 21);
        check_normalized(nb_module_forward(bn, ctx, x1), x1, erm, erv, w, b, eps, tol);
    }
}

/* momentum NB_BATCH_NORM_CUMULATIVE: the running statistics are the plain
 * averages of the batch statistics seen so far */
NBT_CPU_TEST(test_cumulative_average) {
    nb_batch_norm_opts o = {1e-5, NB_BATCH_NORM_CUMULATIVE, false, true};
    nb_module *bn = nb_batch_norm1d_new(ctx, NB_F64, 2, &o);
    double sum_m[2] = {0, 0}, sum_v[2] = {0, 0};
    for (int step = 1; step <= 4; step++) {
        nb_tensor *x = nb_mul_scalar(ctx, nbt_randn(ctx, NB_F64, NB_SHAPE(5, 2), 30 + step), step);
        double mean[2], var[2];
        batch_stats(x, mean, var);
        nb_module_forward(bn, ctx, x);
        double em[2], ev[2];
        for (int c = 0; c < 2; c++) {
            sum_m[c] += mean[c];
            sum_v[c] += var[c] * 5 / 4;
            em[c] = sum_m[c] / step;
            ev[c] = sum_v[c] / step;
        }
        nbt_assert_close(nb_module_find(bn, "running_mean"), em, 1e-13, 1e-13);
        nbt_assert_close(nb_module_find(bn, "running_var"), ev, 1e-13, 1e-13);
    }
    ck_assert(nb_item(nb_module_find(bn, "num_batches_tracked")) == 4);
    /* evaluation with a cumulative layer reads the statistics and changes nothing */
    nb_module_eval(bn);
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 2), 40);
    double em[2] = {sum_m[0] / 4, sum_m[1] / 4}, ev[2] = {sum_v[0] / 4, sum_v[1] / 4};
    check_normalized(nb_module_forward(bn, ctx, x), x, em, ev, NULL, NULL, 1e-5, 1e-12);
    ck_assert(nb_item(nb_module_find(bn, "num_batches_tracked")) == 4);
}

/* momentum 0 freezes the statistics but still counts batches */
NBT_CPU_TEST(test_momentum_zero) {
    nb_batch_norm_opts o = {1e-5, 0.0, true, true};
    nb_module *bn = nb_batch_norm1d_new(ctx, NB_F32, 3, &o);
    nb_module_forward(bn, ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(4, 3, 5), 50));
    nbt_assert_close(nb_module_find(bn, "running_mean"), (double[]){0, 0, 0}, 0, 0);
    nbt_assert_close(nb_module_find(bn, "running_var"), (double[]){1, 1, 1}, 0, 0);
    ck_assert(nb_item(nb_module_find(bn, "num_batches_tracked")) == 1);
}

/* Without running statistics: no buffers, and batch statistics in both modes. */
NBT_CPU_TEST(test_no_tracking_no_affine) {
    nb_batch_norm_opts o = {1e-5, 0.1, true, false};
    nb_module *bn = nb_batch_norm1d_new(ctx, NB_F64, 3, &o);
    ck_assert_int_eq(nb_module_named_buffers(bn, NULL, 0), 0);
    ck_assert_int_eq(nb_module_named_parameters(bn, NULL, 0), 2);
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(6, 3), 60);
    double mean[3], var[3];
    batch_stats(x, mean, var);
    nb_tensor *w = nb_module_find(bn, "weight"), *b = nb_module_find(bn, "bias");
    randomize(w, 61);
    randomize(b, 62);
    check_normalized(nb_module_forward(bn, ctx, x), x, mean, var, w, b, 1e-5, 1e-12);
    nb_module_eval(bn);
    check_normalized(nb_module_forward(bn, ctx, x), x, mean, var, w, b, 1e-5, 1e-12);

    nb_batch_norm_opts plain = {1e-5, 0.1, false, true};
    nb_module *bn2 = nb_batch_norm1d_new(ctx, NB_F64, 3, &plain);
    ck_assert_int_eq(nb_module_named_parameters(bn2, NULL, 0), 0);
    ck_assert_int_eq(nb_module_named_buffers(bn2, NULL, 0), 3);
    nb_tensor *x3 = nbt_randn(ctx, NB_F64, NB_SHAPE(2, 3, 4), 63); /* (N, C, L) */
    batch_stats(x3, mean, var);
    check_normalized(nb_module_forward(bn2, ctx, x3), x3, mean, var, NULL, NULL, 1e-5, 1e-12);
}

/* The mode set on a parent reaches the layer. */
NBT_CPU_TEST(test_mode_through_parent) {
    nb_module *bn = nb_batch_norm2d_new(ctx, NB_F64, 2, NULL);
    nb_module *seq = nb_sequential_new(ctx, 2, (nb_module *[]){bn, nb_relu_new(ctx)});
    nb_tensor *x = nb_add_scalar(ctx, nbt_randn(ctx, NB_F64, NB_SHAPE(3, 2, 2, 2), 70), 4.0);
    nb_module_forward(seq, ctx, x);
    double rm[2], rv[2];
    nb_to_host_f64(nb_module_find(seq, "0.running_mean"), rm);
    nb_to_host_f64(nb_module_find(seq, "0.running_var"), rv);
    nb_module_eval(seq);
    nb_tensor *y = nb_module_forward(nb_module_child(seq, "0"), ctx, x);
    check_normalized(y, x, rm, rv, NULL, NULL, 1e-5, 1e-12);
    nbt_assert_close(nb_module_find(seq, "0.running_mean"), rm, 0, 0);
}

typedef struct mod_case {
    nb_module *m;
} mod_case;

static nb_tensor *mod_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_module_forward(((mod_case *)user)->m, ctx, in[0]);
}

NBT_CPU_TEST(test_gradcheck) {
    for (int mode = 0; mode < 2; mode++) {
        nb_module *bn = nb_batch_norm2d_new(ctx, NB_F64, 2, NULL);
        nb_tensor *w = nb_module_find(bn, "weight"), *b = nb_module_find(bn, "bias");
        randomize(w, 80);
        randomize(b, 81);
        nb_copy_(nb_module_find(bn, "running_var"), nb_full(ctx, NB_F64, NB_SHAPE(2), 1.7));
        nb_module_train(bn, mode == 0);
        mod_case c = {bn};
        nb_tensor *in[3] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2, 2, 2), 82), w, b};
        NBT_GRADCHECK(mod_fn, &c, 3, in);
        ck_assert(!nb_module_find(bn, "running_mean")->requires_grad);
    }
    nb_module *bn1 = nb_batch_norm1d_new(ctx, NB_F64, 3, NULL);
    mod_case c = {bn1};
    nb_tensor *in[3] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3), 83), nb_module_find(bn1, "weight"),
                        nb_module_find(bn1, "bias")};
    NBT_GRADCHECK(mod_fn, &c, 3, in);
}

/* Planes of 25 elements: three full blocks of the kernels' 8 summing lanes
 * and a tail (the other tests' planes are shorter than a block): forward
 * against the statistics in double, in f64 and f32, and gradients (train
 * and eval) by finite differences. */
NBT_CPU_TEST(test_long_planes) {
    NBT_FOR_F64_F32(k, dt) {
        double tol = k ? 2e-5 : 1e-12;
        nb_module *bn = nb_batch_norm2d_new(ctx, dt, 2, NULL);
        nb_tensor *w = nb_module_find(bn, "weight"), *b = nb_module_find(bn, "bias");
        randomize(w, 90);
        randomize(b, 91);
        nb_tensor *x = nb_add_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(3, 2, 5, 5), 92), 3.0);
        double mean[2], var[2];
        batch_stats(x, mean, var);
        check_normalized(nb_module_forward(bn, ctx, x), x, mean, var, w, b, 1e-5, tol);
    }
    for (int mode = 0; mode < 2; mode++) {
        nb_module *bn = nb_batch_norm2d_new(ctx, NB_F64, 2, NULL);
        nb_tensor *w = nb_module_find(bn, "weight"), *b = nb_module_find(bn, "bias");
        randomize(w, 93);
        randomize(b, 94);
        nb_module_train(bn, mode == 0);
        mod_case c = {bn};
        nb_tensor *in[3] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2, 5, 5), 95), w, b};
        NBT_GRADCHECK(mod_fn, &c, 3, in);
    }
}

NBT_CPU_TEST(test_errors) {
    nb_module *bn2 = nb_batch_norm2d_new(ctx, NB_F32, 3, NULL);
    NBT_EXPECT_ABORT(nb_module_forward(bn2, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 4, 3, 3))),
                     "BatchNorm2d: input (2, 4, 3, 3) must be (N, 3, H, W)");
    NBT_EXPECT_ABORT(nb_module_forward(bn2, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 3))),
                     "BatchNorm2d: input (2, 3, 3) must be (N, 3, H, W)");
    NBT_EXPECT_ABORT(nb_module_forward(bn2, ctx, nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3, 3, 3))),
                     "BatchNorm2d: input (2, 3, 3, 3) is f64 but the layer's parameters are f32");
    nb_module *bn1 = nb_batch_norm1d_new(ctx, NB_F32, 3, NULL);
    NBT_EXPECT_ABORT(nb_module_forward(bn1, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 3, 3))),
                     "BatchNorm1d: input (2, 3, 3, 3) must be (N, 3) or (N, 3, L)");
    NBT_EXPECT_ABORT(nb_module_forward(bn1, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(1, 3))),
                     "training needs more than one value per channel, got input (1, 3)");
}

NBT_MAIN("nn_batch_norm", "core", 0,
         test_train_then_eval, test_long_planes, test_cumulative_average, test_momentum_zero,
         test_no_tracking_no_affine, test_mode_through_parent, test_gradcheck, test_errors)
