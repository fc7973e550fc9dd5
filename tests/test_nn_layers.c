/* The layers through the module interface: each forward against a naive
 * double-precision loop (f64 and f32; contiguous and strided inputs), each
 * backward by gradcheck over the input and every parameter, Dropout's mask
 * against the Philox stream it is specified by, Sequential against the
 * layers applied by hand, the loss modules against closed forms, and the
 * layers' own error messages. BatchNorm and attention have suites of their
 * own (test_nn_batch_norm.c, test_nn_attention.c). */
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

static double *host(const nb_tensor *t) {
    double *v = malloc(sizeof(double) * (size_t)(nb_numel(t) ? nb_numel(t) : 1));
    nb_to_host_f64(t, v);
    return v;
}

static double tol_for(nb_dtype dt) { return dt == NB_F32 ? 2e-5 : 1e-12; }

typedef struct mod_case {
    nb_module *m;
} mod_case;

static nb_tensor *mod_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_module_forward(((mod_case *)user)->m, ctx, in[0]);
}

/* gradcheck over x (when it requires grad) and every parameter of m */
static void gradcheck_module(nb_module *m, nb_tensor *x) {
    nb_named_tensor p[16];
    int n = nb_module_named_parameters(m, p, 16);
    ck_assert(n < 16);
    nb_tensor *in[17] = {x};
    for (int i = 0; i < n; i++) in[1 + i] = p[i].tensor;
    mod_case c = {m};
    NBT_GRADCHECK(mod_fn, &c, n + 1, in);
}

/* Replaces every parameter's values with N(0, 1) draws (seeded), so that
 * ones/zeros initialisations do not hide a wrong formula. */
static void randomize_params(nb_module *m, uint64_t seed) {
    nb_named_tensor p[16];
    int n = nb_module_named_parameters(m, p, 16);
    nb_rng rng = nb_rng_make(seed);
    for (int i = 0; i < n; i++) nb_init_normal_(p[i].tensor, 0.0, 1.0, &rng);
}

/* ---- Linear ---- */
static void check_linear(nb_ctx *ctx, nb_dtype dt, bool bias, nb_tensor *x) {
    int64_t in = x->shape[x->ndim - 1], out = 4;
    nb_module *m = nb_linear_new(ctx, dt, in, out, bias, NULL);
    nb_tensor *w = nb_module_find(m, "weight"), *b = nb_module_find(m, "bias");
    ck_assert(w->shape[0] == out && w->shape[1] == in);
    ck_assert(bias ? b != NULL : b == NULL);
    nb_tensor *y = nb_module_forward(m, ctx, x);
    int64_t rows = nb_numel(x) / in;
    ck_assert_int_eq(y->ndim, x->ndim);
    for (int d = 0; d < x->ndim - 1; d++) ck_assert_int_eq(y->shape[d], x->shape[d]);
    ck_assert_int_eq(y->shape[y->ndim - 1], out);
    double *xv = host(x), *wv = host(w), *bv = bias ? host(b) : NULL;
    double *e = malloc(sizeof(double) * (size_t)(rows * out));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out; o++) {
            double s = bias ? bv[o] : 0;
            for (int64_t i = 0; i < in; i++) s += xv[r * in + i] * wv[o * in + i];
            e[r * out + o] = s;
        }
    nbt_assert_close(y, e, tol_for(dt), tol_for(dt));
    free(xv);
    free(wv);
    free(bv);
    free(e);
}

NBT_CPU_TEST(test_linear_values) {
    NBT_FOR_F64_F32(k, dt) {
        check_linear(ctx, dt, true, nbt_randn(ctx, dt, NB_SHAPE(3, 5), 1));
        check_linear(ctx, dt, false, nbt_randn(ctx, dt, NB_SHAPE(3, 5), 2));
        check_linear(ctx, dt, true, nbt_randn(ctx, dt, NB_SHAPE(2, 3, 5), 3));  /* (N, T, C) */
        check_linear(ctx, dt, true, nbt_randn(ctx, dt, NB_SHAPE(5), 4));        /* a vector */
        check_linear(ctx, dt, true, nb_transpose(ctx, nbt_randn(ctx, dt, NB_SHAPE(5, 3), 5), 0, 1));
        check_linear(ctx, dt, false,
                     nb_transpose(ctx, nbt_randn(ctx, dt, NB_SHAPE(5, 2, 3), 6), 0, 2)); /* (3, 2, 5) */
    }
}

/* Linear's fused CPU product (the bias written first, the GEMM adding to
 * it) against matmul_t + add, values and every gradient, f32 and f64, with
 * a contiguous and a transposed input. */
NBT_CPU_TEST(test_linear_matches_composed) {
    nb_rng rng = nb_rng_make(21);
    for (int k = 0; k < 4; k++) {
        nb_dtype dt = k & 1 ? NB_F32 : NB_F64;
        nb_module *m = nb_linear_new(ctx, dt, 6, 5, true, &rng);
        nb_tensor *w = nb_module_find(m, "weight"), *b = nb_module_find(m, "bias");
        nb_tensor *x = nbt_randn_leaf(ctx, dt, NB_SHAPE(2, 6, 3), (uint64_t)(30 + k));
        nb_tensor *xin = k & 2 ? nb_transpose(ctx, x, 1, 2) /* (2, 3, 6) strided */
                               : nb_reshape(ctx, x, NB_SHAPE(2, 3, 6));
        nb_tensor *y = nb_module_forward(m, ctx, xin);
        nb_backward(nbt_weighted_sum(ctx, y));
        nb_tensor *gx = nb_clone(ctx, x->grad), *gw = nb_clone(ctx, w->grad), *gb = nb_clone(ctx, b->grad);
        nb_zero_grad(x);
        nb_zero_grad(w);
        nb_zero_grad(b);
        nb_tensor *c = nb_add(ctx, nb_matmul_t(ctx, xin, w, false, true), b);
        nb_backward(nbt_weighted_sum(ctx, c));
        double tol = dt == NB_F32 ? 1e-5 : 1e-13;
        nbt_assert_tensors_close(y, c, tol, tol);
        nbt_assert_tensors_close(gx, x->grad, tol, tol);
        nbt_assert_tensors_close(gw, w->grad, tol, tol);
        nbt_assert_tensors_close(gb, b->grad, tol, tol);
    }
}

NBT_CPU_TEST(test_linear_gradcheck) {
    nb_rng rng = nb_rng_make(10);
    gradcheck_module(nb_linear_new(ctx, NB_F64, 3, 4, true, &rng),
                     nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 2, 3), 11));
    gradcheck_module(nb_linear_new(ctx, NB_F64, 3, 2, false, &rng),
                     nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 12));
    /* the input need not require grad */
    gradcheck_module(nb_linear_new(ctx, NB_F64, 3, 2, true, &rng),
                     nbt_randn(ctx, NB_F64, NB_SHAPE(4, 3), 13));
}

/* ---- Conv2d ---- */
/* x (N, C, H, W), w (O, C/G, KH, KW), G = p->groups (0: 1) */
static void ref_conv(double *y, const double *x, const double *w, const double *b, int64_t n,
                     int64_t c, int64_t h, int64_t wd, int64_t o, int kh, int kw,
                     const nb_conv2d_opts *p, int64_t oh, int64_t ow) {
    int64_t G = p->groups > 0 ? p->groups : 1, cg = c / G, og = o / G;
    for (int64_t i = 0; i < n; i++)
        for (int64_t oc = 0; oc < o; oc++)
            for (int64_t r = 0; r < oh; r++)
                for (int64_t q = 0; q < ow; q++) {
                    double s = b ? b[oc] : 0;
                    for (int64_t icg = 0; icg < cg; icg++)
                        for (int u = 0; u < kh; u++)
                            for (int v = 0; v < kw; v++) {
                                int64_t yy = r * p->stride[0] - p->padding[0] + u * p->dilation[0];
                                int64_t xx = q * p->stride[1] - p->padding[1] + v * p->dilation[1];
                                if (yy < 0 || yy >= h || xx < 0 || xx >= wd) continue;
                                int64_t ic = oc / og * cg + icg;
                                s += x[((i * c + ic) * h + yy) * wd + xx] *
                                     w[((oc * cg + icg) * kh + u) * kw + v];
                            }
                    y[((i * o + oc) * oh + r) * ow + q] = s;
                }
}

NBT_CPU_TEST(test_conv2d_values) {
    nb_conv2d_opts opts[] = {NB_CONV2D_DEFAULTS, {{2, 1}, {1, 0}, {1, 2}, 1}, {{1, 2}, {2, 1}, {2, 1}, 1}};
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 3; j++) {
            nb_dtype dt = k ? NB_F32 : NB_F64;
            const nb_conv2d_opts *p = &opts[j];
            bool bias = j != 1;
            nb_module *m = nb_conv2d_new(ctx, dt, 3, 4, 3, 2, j ? p : NULL, bias, NULL);
            nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 3, 7, 6), 20 + j);
            if (j == 2) x = nb_permute(ctx, nbt_randn(ctx, dt, NB_SHAPE(3, 2, 6, 7), 30), (int[]){1, 0, 3, 2});
            nb_tensor *y = nb_module_forward(m, ctx, x);
            int64_t oh = (7 + 2 * p->padding[0] - p->dilation[0] * 2 - 1) / p->stride[0] + 1;
            int64_t ow = (6 + 2 * p->padding[1] - p->dilation[1] * 1 - 1) / p->stride[1] + 1;
            ck_assert(y->ndim == 4 && y->shape[0] == 2 && y->shape[1] == 4 && y->shape[2] == oh &&
                      y->shape[3] == ow);
            double *xv = host(x), *wv = host(nb_module_find(m, "weight"));
            double *bv = bias ? host(nb_module_find(m, "bias")) : NULL;
            double *e = malloc(sizeof(double) * (size_t)nb_numel(y));
            ref_conv(e, xv, wv, bv, 2, 3, 7, 6, 4, 3, 2, p, oh, ow);
            nbt_assert_close(y, e, tol_for(dt), tol_for(dt));
            free(xv);
            free(wv);
            free(bv);
            free(e);
        }
}

NBT_CPU_TEST(test_conv2d_gradcheck) {
    nb_conv2d_opts p = {{2, 1}, {1, 1}, {1, 1}, 1};
    gradcheck_module(nb_conv2d_new(ctx, NB_F64, 2, 3, 3, 2, &p, true, NULL),
                     nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 2, 4, 3), 40));
    gradcheck_module(nb_conv2d_new(ctx, NB_F64, 1, 2, 2, 2, NULL, false, NULL),
                     nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(1, 1, 3, 3), 41));
}

NBT_CPU_TEST(test_conv2d_groups) {
    nb_rng rng = nb_rng_make(50);
    /* 4 groups of 2 input channels: weight (12, 2, 3, 3), fan_in 2 * 9 */
    nb_conv2d_opts g4 = {{1, 1}, {1, 1}, {1, 1}, 4};
    nb_module *m = nb_conv2d_new(ctx, NB_F32, 8, 12, 3, 3, &g4, true, &rng);
    nb_named_tensor p[4];
    ck_assert_int_eq(nb_module_state(m, p, 4), 2);
    ck_assert_str_eq(p[0].name, "weight");
    ck_assert_str_eq(p[1].name, "bias");
    nb_tensor *w = p[0].tensor, *b = p[1].tensor;
    ck_assert(w->ndim == 4 && w->shape[0] == 12 && w->shape[1] == 2 && w->shape[2] == 3 &&
              w->shape[3] == 3);
    ck_assert(b->ndim == 1 && b->shape[0] == 12);
    ck_assert_int_eq(nb_init_fan_in(w), 18);
    /* U(-1/sqrt(18), 1/sqrt(18)): 216 draws reach past 0.2, beyond the
     * bound 1/sqrt(72) = 0.118 of a fan_in that ignores the groups */
    double bound = 1.0 / sqrt(18.0), wmax = 0;
    double *wv = host(w), *bv = host(b);
    for (int64_t i = 0; i < nb_numel(w); i++) {
        ck_assert_msg(fabs(wv[i]) <= bound, "weight %g beyond %g", wv[i], bound);
        if (fabs(wv[i]) > wmax) wmax = fabs(wv[i]);
    }
    ck_assert_msg(wmax > 0.2, "weight never reaches past 0.2: max %g", wmax);
    for (int64_t i = 0; i < 12; i++) ck_assert(fabs(bv[i]) <= bound);
    free(wv);
    free(bv);
    FILE *f = tmpfile();
    ck_assert(f != NULL);
    nb_module_fprint(f, m);
    char desc[256] = "";
    rewind(f);
    ck_assert(fgets(desc, sizeof desc, f) != NULL);
    fclose(f);
    ck_assert_str_eq(desc, "Conv2d(8, 12, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), "
                           "dilation=(1, 1), groups=4, bias=true)\n");

    /* values: grouped and depthwise (with a channel multiplier), f64 */
    const int64_t shapes[][3] = {{4, 6, 2}, {3, 6, 3}, {3, 3, 3}};
    for (int k = 0; k < 3; k++) {
        const int64_t *cs = shapes[k];
        nb_conv2d_opts o = {{2, 1}, {1, 0}, {1, 2}, (int)cs[2]};
        nb_module *mg = nb_conv2d_new(ctx, NB_F64, cs[0], cs[1], 3, 2, &o, k != 1, &rng);
        ck_assert_int_eq(nb_module_find(mg, "weight")->shape[1], cs[0] / cs[2]);
        nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(2, cs[0], 7, 6), 60 + (uint64_t)k);
        nb_tensor *y = nb_module_forward(mg, ctx, x);
        int64_t oh = (7 + 2 - 2 - 1) / 2 + 1, ow = (6 - 2 - 1) / 1 + 1;
        ck_assert(y->shape[1] == cs[1] && y->shape[2] == oh && y->shape[3] == ow);
        double *xv = host(x), *wk = host(nb_module_find(mg, "weight"));
        double *bk = k != 1 ? host(nb_module_find(mg, "bias")) : NULL;
        double *e = malloc(sizeof(double) * (size_t)nb_numel(y));
        ref_conv(e, xv, wk, bk, 2, cs[0], 7, 6, cs[1], 3, 2, &o, oh, ow);
        nbt_assert_close(y, e, 1e-12, 1e-12);
        free(xv);
        free(wk);
        free(bk);
        free(e);
        gradcheck_module(mg, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(1, cs[0], 4, 3), 70));
    }

    nb_conv2d_opts g5 = {{1, 1}, {0, 0}, {1, 1}, 5};
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 10, 12, 3, 3, &g5, true, NULL),
                     "nb_conv2d_new: in_channels 10 and out_channels 12 must both be divisible "
                     "by groups 5");
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 12, 10, 3, 3, &g5, true, NULL),
                     "nb_conv2d_new: in_channels 12 and out_channels 10 must both be divisible "
                     "by groups 5");
    nb_conv2d_opts gneg = {{1, 1}, {0, 0}, {1, 1}, -1};
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 4, 4, 3, 3, &gneg, true, NULL),
                     "nb_conv2d_new: groups -1 must be positive");
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(1, 2, 5, 5))),
                     "Conv2d: input (1, 2, 5, 5) must be (N, 8, H, W)");
}

/* ---- Embedding ---- */
NBT_CPU_TEST(test_embedding) {
    NBT_FOR_F64_F32(k, dt) {
        nb_module *m = nb_embedding_new(ctx, dt, 7, 3, NULL);
        int64_t idx[6] = {6, 0, 2, 2, 5, 0};
        nb_tensor *ix = k ? nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), idx)
                          : nb_cast(ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), idx), NB_I32);
        nb_tensor *y = nb_module_forward(m, ctx, ix);
        ck_assert(y->ndim == 3 && y->shape[0] == 2 && y->shape[1] == 3 && y->shape[2] == 3);
        double *wv = host(nb_module_find(m, "weight")), e[18];
        for (int i = 0; i < 6; i++)
            for (int j = 0; j < 3; j++) e[i * 3 + j] = wv[idx[i] * 3 + j];
        nbt_assert_close(y, e, 0, 0);
        free(wv);
    }
    /* repeated indices accumulate in the table's gradient */
    nb_module *m = nb_embedding_new(ctx, NB_F64, 5, 2, NULL);
    gradcheck_module(m, nb_from_host(ctx, NB_I64, NB_SHAPE(4), (int64_t[]){1, 3, 1, 1}));
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){1, 5})),
                     "nb_embedding: index 5 at position 1 is out of range for 5 rows");
}

/* ---- LayerNorm ---- */
NBT_CPU_TEST(test_layer_norm) {
    nb_layer_norm_opts variants[] = {NB_LAYER_NORM_DEFAULTS, {1e-3, true, false}, {1e-5, false, true}};
    for (int k = 0; k < 2; k++)
        for (int v = 0; v < 3; v++) {
            nb_dtype dt = k ? NB_F32 : NB_F64;
            nb_module *m = nb_layer_norm_new(ctx, dt, NB_SHAPE(3, 4), &variants[v]);
            ck_assert_int_eq(nb_module_named_parameters(m, NULL, 0), 2 - v);
            randomize_params(m, 50 + v);
            nb_tensor *w = nb_module_find(m, "weight"), *b = nb_module_find(m, "bias");
            nb_tensor *x = nb_add_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(2, 5, 3, 4), 51), 3.0);
            if (v == 1) x = nb_transpose(ctx, nbt_randn(ctx, dt, NB_SHAPE(5, 2, 3, 4), 52), 0, 1);
            double *xv = host(x), *wv = w ? host(w) : NULL, *bv = b ? host(b) : NULL, e[120];
            nbt_ref_layer_norm(e, xv, wv, bv, 10, 12, variants[v].eps);
            nbt_assert_close(nb_module_forward(m, ctx, x), e, tol_for(dt), tol_for(dt));
            free(xv);
            free(wv);
            free(bv);
        }
    nb_module *m = nb_layer_norm_new(ctx, NB_F64, NB_SHAPE(4), NULL);
    randomize_params(m, 53);
    gradcheck_module(m, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 54));
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_zeros(ctx, NB_F64, NB_SHAPE(4, 3))),
                     "LayerNorm: input (4, 3) does not end in the normalized shape (4,)");
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 4))),
                     "LayerNorm: input (2, 4) is f32 but the layer's parameters are f64");
}

/* ---- Dropout ---- */
NBT_CPU_TEST(test_dropout) {
    nb_rng rng = nb_rng_make(77);
    rng.offset = 5;
    double p = 0.3;
    nb_module *m = nb_dropout_new(ctx, p, &rng);
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(7, 9), 60);
    double *xv = host(x), e[63];
    bool keep[63];
    /* Note [Random streams]: element i is kept when lane i % 4 of
     * philox(seed, offset + i / 4), as a unit float, is >= p */
    for (int i = 0; i < 63; i++) {
        uint32_t r[4];
        nb_philox4x32(77, 5 + (uint64_t)i / 4, r);
        keep[i] = (double)nb_u32_to_unit(r[i % 4]) >= p;
        e[i] = keep[i] ? xv[i] / (1 - p) : 0.0;
    }
    nb_tensor *y = nb_module_forward(m, ctx, x);
    nbt_assert_close(y, e, 1e-15, 1e-15);
    ck_assert_int_eq(rng.offset, 5 + 16); /* ceil(63 / 4) */
    /* the next call draws a new mask */
    nb_tensor *y2 = nb_module_forward(m, ctx, x);
    double *a = host(y), *b = host(y2);
    int differ = 0;
    for (int i = 0; i < 63; i++) differ += (a[i] == 0) != (b[i] == 0);
    ck_assert(differ > 0);
    /* evaluation mode: the identity, no randomness used */
    nb_module_eval(m);
    ck_assert_ptr_eq(nb_module_forward(m, ctx, x), x);
    ck_assert_int_eq(rng.offset, 5 + 32);
    /* gradient: the same mask scales the incoming gradient */
    nb_module_train(m, true);
    nb_tensor *xl = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(7, 9), 60);
    rng.offset = 5;
    nb_backward(nb_sum_all(ctx, nb_module_forward(m, ctx, xl)));
    for (int i = 0; i < 63; i++) e[i] = keep[i] ? 1 / (1 - p) : 0.0;
    nbt_assert_close(xl->grad, e, 1e-15, 1e-15);
    free(xv);
    free(a);
    free(b);
}

/* ---- activations ---- */
static double gelu_exact(double x) { return 0.5 * x * (1 + erf(x / sqrt(2.0))); }
static double gelu_tanh(double x) {
    return 0.5 * x * (1 + tanh(sqrt(2 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
}
static double relu(double x) { return x > 0 ? x : 0; }

NBT_CPU_TEST(test_activations) {
    nb_module *mods[] = {nb_relu_new(ctx), nb_gelu_new(ctx, NB_GELU_EXACT),
                         nb_gelu_new(ctx, NB_GELU_TANH), nb_tanh_new(ctx)};
    double (*ref[])(double) = {relu, gelu_exact, gelu_tanh, tanh};
    for (int k = 0; k < 2; k++)
        for (int a = 0; a < 4; a++) {
            nb_dtype dt = k ? NB_F32 : NB_F64;
            nb_tensor *x = nb_mul_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(4, 5), 70 + a), 2.0);
            double *xv = host(x), e[20];
            for (int i = 0; i < 20; i++) e[i] = ref[a](xv[i]);
            nbt_assert_close(nb_module_forward(mods[a], ctx, x), e, tol_for(dt), tol_for(dt));
            free(xv);
            if (!k) gradcheck_module(mods[a], nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 80 + a));
        }
}

/* ---- pooling ---- */
/* x (P, H, W) planes; max (is_max) or average counting padded zeros */
static void ref_pool(double *y, const double *x, int64_t planes, int64_t h, int64_t w,
                     const nb_pool2d_opts *o, bool is_max, int64_t oh, int64_t ow) {
    int sh = o->stride[0] ? o->stride[0] : o->kernel[0], sw = o->stride[1] ? o->stride[1] : o->kernel[1];
    for (int64_t p = 0; p < planes; p++)
        for (int64_t r = 0; r < oh; r++)
            for (int64_t q = 0; q < ow; q++) {
                double acc = is_max ? -INFINITY : 0;
                for (int u = 0; u < o->kernel[0]; u++)
                    for (int v = 0; v < o->kernel[1]; v++) {
                        int64_t yy = r * sh - o->padding[0] + u, xx = q * sw - o->padding[1] + v;
                        bool in = yy >= 0 && yy < h && xx >= 0 && xx < w;
                        if (is_max) {
                            if (in) acc = fmax(acc, x[(p * h + yy) * w + xx]);
                        } else if (in) {
                            acc += x[(p * h + yy) * w + xx];
                        }
                    }
                y[(p * oh + r) * ow + q] = is_max ? acc : acc / (o->kernel[0] * o->kernel[1]);
            }
}

NBT_CPU_TEST(test_pooling) {
    nb_pool2d_opts opts[] = {{{2, 2}, {0, 0}, {0, 0}}, {{3, 2}, {2, 1}, {1, 1}}};
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 2; j++)
            for (int is_max = 0; is_max < 2; is_max++) {
                nb_dtype dt = k ? NB_F32 : NB_F64;
                const nb_pool2d_opts *o = &opts[j];
                nb_module *m = is_max ? nb_max_pool2d_new(ctx, o) : nb_avg_pool2d_new(ctx, o);
                nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 3, 6, 5), 90 + j);
                nb_tensor *y = nb_module_forward(m, ctx, x);
                int sh = o->stride[0] ? o->stride[0] : o->kernel[0];
                int sw = o->stride[1] ? o->stride[1] : o->kernel[1];
                int64_t oh = (6 + 2 * o->padding[0] - o->kernel[0]) / sh + 1;
                int64_t ow = (5 + 2 * o->padding[1] - o->kernel[1]) / sw + 1;
                ck_assert(y->ndim == 4 && y->shape[2] == oh && y->shape[3] == ow);
                double *xv = host(x), *e = malloc(sizeof(double) * (size_t)nb_numel(y));
                ref_pool(e, xv, 6, 6, 5, o, is_max, oh, ow);
                nbt_assert_close(y, e, tol_for(dt), tol_for(dt));
                free(xv);
                free(e);
                if (!k && j == 1)
                    gradcheck_module(m, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(1, 2, 4, 3), 95 + is_max));
            }
    /* global average pooling */
    NBT_FOR_F64_F32(k, dt) {
        nb_module *g = nb_global_avg_pool2d_new(ctx);
        nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 3, 4, 5), 99);
        nb_tensor *y = nb_module_forward(g, ctx, x);
        ck_assert(y->ndim == 4 && y->shape[0] == 2 && y->shape[1] == 3 && y->shape[2] == 1 &&
                  y->shape[3] == 1);
        double *xv = host(x), e[6];
        for (int p = 0; p < 6; p++) {
            e[p] = 0;
            for (int i = 0; i < 20; i++) e[p] += xv[p * 20 + i] / 20;
        }
        nbt_assert_close(y, e, tol_for(dt), tol_for(dt));
        free(xv);
        if (!k) gradcheck_module(g, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 2, 3, 2), 100));
        NBT_EXPECT_ABORT(nb_module_forward(g, ctx, nb_zeros(ctx, dt, NB_SHAPE(2, 3, 4))),
                         "GlobalAvgPool2d: input must be 4-D (N, C, H, W), got shape (2, 3, 4)");
    }
}

/* ---- Flatten and Sequential ---- */
NBT_CPU_TEST(test_flatten) {
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(2, 3, 4, 5), 110);
    nb_tensor *y = nb_module_forward(nb_flatten_new(ctx, 1, -1), ctx, x);
    ck_assert(y->ndim == 2 && y->shape[0] == 2 && y->shape[1] == 60);
    nbt_assert_tensors_close(nb_reshape(ctx, y, 4, x->shape), x, 0, 0);
    y = nb_module_forward(nb_flatten_new(ctx, 1, 2), ctx, x);
    ck_assert(y->ndim == 3 && y->shape[0] == 2 && y->shape[1] == 12 && y->shape[2] == 5);
    y = nb_module_forward(nb_flatten_new(ctx, 0, -1), ctx, nb_transpose(ctx, x, 0, 3));
    ck_assert(y->ndim == 1 && y->shape[0] == 120);
    double *xv = host(nb_contiguous(ctx, nb_transpose(ctx, x, 0, 3)));
    nbt_assert_close(y, xv, 0, 0);
    free(xv);
}

NBT_CPU_TEST(test_sequential) {
    nb_rng rng = nb_rng_make(120);
    nb_module *l1 = nb_linear_new(ctx, NB_F64, 4, 6, true, &rng);
    nb_module *act = nb_gelu_new(ctx, NB_GELU_EXACT);
    nb_module *l2 = nb_linear_new(ctx, NB_F64, 6, 2, true, &rng);
    nb_module *seq = nb_sequential_new(ctx, 2, (nb_module *[]){l1, act});
    nb_module_append(seq, l2);
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(5, 4), 121);
    nb_tensor *by_hand = nb_module_forward(l2, ctx, nb_module_forward(act, ctx, nb_module_forward(l1, ctx, x)));
    nbt_assert_tensors_close(nb_module_forward(seq, ctx, x), by_hand, 0, 0);
    gradcheck_module(seq, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 122));
    /* an empty Sequential is the identity */
    ck_assert_ptr_eq(nb_module_forward(nb_sequential_new(ctx, 0, NULL), ctx, x), x);
    /* a ModuleList holds children but has no forward */
    nb_module *list = nb_module_list_new(ctx);
    nb_module_append(list, l1);
    ck_assert_ptr_eq(nb_module_child(list, "0"), l1);
}

/* ---- losses ---- */
NBT_CPU_TEST(test_losses) {
    NBT_FOR_F64_F32(k, dt) {
        /* cross entropy with an ignored target and label smoothing */
        nb_cross_entropy_opts co = {2, 0.1};
        nb_module *ce = nb_cross_entropy_loss_new(ctx, &co);
        nb_tensor *logits = nbt_randn(ctx, dt, NB_SHAPE(4, 3), 130);
        int64_t t[4] = {0, 2, 2, 1};
        nb_tensor *target = nb_from_host(ctx, NB_I64, NB_SHAPE(4), t);
        double *lv = host(logits), sum = 0;
        int counted = 0;
        for (int i = 0; i < 4; i++) {
            if (t[i] == 2) continue;
            double mx = fmax(fmax(lv[i * 3], lv[i * 3 + 1]), lv[i * 3 + 2]), z = 0;
            for (int c = 0; c < 3; c++) z += exp(lv[i * 3 + c] - mx);
            double lse = mx + log(z), smooth = 0;
            for (int c = 0; c < 3; c++) smooth += (lse - lv[i * 3 + c]) / 3;
            sum += 0.9 * (lse - lv[i * 3 + t[i]]) + 0.1 * smooth;
            counted++;
        }
        ck_assert_double_eq_tol(nb_item(nb_loss_forward(ce, ctx, logits, target)), sum / counted,
                                tol_for(dt));
        /* defaults: plain mean */
        nb_module *ce0 = nb_cross_entropy_loss_new(ctx, NULL);
        double plain = 0;
        for (int i = 0; i < 4; i++) {
            double z = 0;
            for (int c = 0; c < 3; c++) z += exp(lv[i * 3 + c]);
            plain += (log(z) - lv[i * 3 + t[i]]) / 4;
        }
        ck_assert_double_eq_tol(nb_item(nb_loss_forward(ce0, ctx, logits, target)), plain, tol_for(dt));
        free(lv);

        nb_tensor *a = nbt_randn(ctx, dt, NB_SHAPE(2, 5), 131), *b = nbt_randn(ctx, dt, NB_SHAPE(2, 5), 132);
        double *av = host(a), *bv = host(b), mse = 0, bce = 0;
        for (int i = 0; i < 10; i++) {
            mse += (av[i] - bv[i]) * (av[i] - bv[i]) / 10;
            double y = 1 / (1 + exp(-bv[i])); /* targets in (0, 1) */
            bce += -(y * log(1 / (1 + exp(-av[i]))) + (1 - y) * log(1 - 1 / (1 + exp(-av[i])))) / 10;
        }
        ck_assert_double_eq_tol(nb_item(nb_loss_forward(nb_mse_loss_new(ctx), ctx, a, b)), mse, tol_for(dt));
        ck_assert_double_eq_tol(
            nb_item(nb_loss_forward(nb_bce_with_logits_loss_new(ctx), ctx, a, nb_sigmoid(ctx, b))), bce,
            10 * tol_for(dt));
        free(av);
        free(bv);
    }
    /* a model's output through a loss module, by gradcheck */
    nb_module *lin = nb_linear_new(ctx, NB_F64, 3, 4, true, NULL);
    nb_module *ce = nb_cross_entropy_loss_new(ctx, NULL);
    nb_tensor *target = nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){3, 0});
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(2, 3), 133);
    ck_assert(nb_loss_forward(ce, ctx, nb_module_forward(lin, ctx, x), target)->requires_grad);
    NBT_EXPECT_ABORT(nb_module_forward(ce, ctx, x),
                     "nb_module_forward: a CrossEntropyLoss takes an input and a target; call "
                     "nb_loss_forward(loss, ctx, input, target)");
    NBT_EXPECT_ABORT(nb_loss_forward(lin, ctx, x, x), "nb_loss_forward: the module is a Linear, not a loss");
    NBT_EXPECT_ABORT(nb_loss_forward(nb_mse_loss_new(ctx), ctx, x, NULL),
                     "nb_loss_forward: MSELoss needs an input and a target");
}

typedef struct loss_case {
    nb_module *lin, *loss;
    nb_tensor *target;
} loss_case;

static nb_tensor *loss_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    loss_case *c = user;
    return nb_loss_forward(c->loss, ctx, nb_module_forward(c->lin, ctx, in[0]), c->target);
}

NBT_CPU_TEST(test_loss_gradcheck) {
    nb_cross_entropy_opts co = {-100, 0.2};
    loss_case cases[3] = {
        {nb_linear_new(ctx, NB_F64, 3, 4, true, NULL), nb_cross_entropy_loss_new(ctx, &co),
         nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){3, 0})},
        {nb_linear_new(ctx, NB_F64, 3, 4, true, NULL), nb_mse_loss_new(ctx),
         nbt_randn(ctx, NB_F64, NB_SHAPE(2, 4), 140)},
        {nb_linear_new(ctx, NB_F64, 3, 4, true, NULL), nb_bce_with_logits_loss_new(ctx),
         nb_sigmoid(ctx, nbt_randn(ctx, NB_F64, NB_SHAPE(2, 4), 141))},
    };
    for (int k = 0; k < 3; k++) {
        nb_named_tensor p[2];
        nb_module_named_parameters(cases[k].lin, p, 2);
        nb_tensor *in[3] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 142 + k), p[0].tensor, p[1].tensor};
        NBT_GRADCHECK(loss_fn, &cases[k], 3, in);
    }
}

NBT_CPU_TEST(test_layer_errors) {
    nb_module *lin = nb_linear_new(ctx, NB_F64, 5, 3, true, NULL);
    NBT_EXPECT_ABORT(nb_module_forward(lin, ctx, nb_zeros(ctx, NB_F64, NB_SHAPE(2, 6))),
                     "Linear: input (2, 6) has 6 features in its last dim, the layer takes 5");
    NBT_EXPECT_ABORT(nb_module_forward(lin, ctx, nb_zeros(ctx, NB_F64, 0, NULL)),
                     "Linear: input () has 0 features in its last dim, the layer takes 5");
    NBT_EXPECT_ABORT(nb_module_forward(lin, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 5))),
                     "Linear: input (2, 5) is f32 but the layer's parameters are f64");
    nb_module *conv = nb_conv2d_new(ctx, NB_F32, 3, 4, 3, 3, NULL, true, NULL);
    NBT_EXPECT_ABORT(nb_module_forward(conv, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 4, 5, 5))),
                     "Conv2d: input (2, 4, 5, 5) must be (N, 3, H, W)");
    NBT_EXPECT_ABORT(nb_module_forward(conv, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(3, 5, 5))),
                     "Conv2d: input (3, 5, 5) must be (N, 3, H, W)");
    NBT_EXPECT_ABORT(nb_module_forward(conv, ctx, nb_zeros(ctx, NB_F64, NB_SHAPE(1, 3, 5, 5))),
                     "Conv2d: input (1, 3, 5, 5) is f64 but the layer's parameters are f32");
    nb_module *pool = nb_max_pool2d_new(ctx, &(nb_pool2d_opts){{2, 2}, {0, 0}, {0, 0}});
    NBT_EXPECT_ABORT(nb_module_forward(pool, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3))),
                     "nb_max_pool2d: input must be 4-D (N, C, H, W), got shape (2, 3)");
}

/* ---- module paths in errors (Note [Module paths in errors], nn/module.c) ---- */
/* Block: x + proj(norm(x)); the sum aborts inside the Block when proj changes the width. */
typedef struct block {
    nb_module *norm, *proj;
} block;
static nb_tensor *block_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
static const nb_module_type block_type = {"Block", sizeof(block), block_forward, NULL};
static nb_tensor *block_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    block *b = nb_module_self(m, &block_type);
    nb_tensor *h = nb_module_forward(b->proj, ctx, nb_module_forward(b->norm, ctx, x));
    return nb_add(ctx, x, h); /* aborts in the Block when proj changes the width */
}
static nb_module *block_new(nb_ctx *ctx, int64_t in, int64_t out) {
    nb_module *m = nb_module_new(ctx, &block_type);
    block *b = nb_module_self(m, &block_type);
    b->norm = nb_module_add(m, "norm", nb_layer_norm_new(ctx, NB_F32, 1, (int64_t[]){in}, NULL));
    b->proj = nb_module_add(m, "proj", nb_linear_new(ctx, NB_F32, in, out, true, NULL));
    return m;
}
/* Net: blocks (a Sequential of Blocks), then head.fc (in a ModuleList) called directly. */
static nb_tensor *net_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
static const nb_module_type net_type = {"Net", 0, net_forward, NULL};
static nb_tensor *net_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    x = nb_module_forward(nb_module_child(m, "blocks"), ctx, x);
    return nb_module_forward(nb_module_child(m, "head.fc"), ctx, x);
}
static nb_module *net_new(nb_ctx *ctx, int64_t w1, int64_t head_in) {
    nb_module *m = nb_module_new(ctx, &net_type);
    nb_module *blocks[2] = {block_new(ctx, 8, 8), block_new(ctx, 8, w1)};
    nb_module_add(m, "blocks", nb_sequential_new(ctx, 2, blocks));
    nb_module *head = nb_module_add(m, "head", nb_module_list_new(ctx));
    nb_module_add(head, "fc", nb_linear_new(ctx, NB_F32, head_in, 2, false, NULL));
    return m;
}

NBT_CPU_TEST(test_errors_name_module_path) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 8));
    nb_module *ok = net_new(ctx, 8, 8);
    nb_tensor *y = nb_module_forward(ok, ctx, x);
    ck_assert_int_eq(y->shape[2], 2);

    /* a layer's own message: "Linear: " becomes "path (Linear): " */
    NBT_EXPECT_ABORT(nb_module_forward(net_new(ctx, 8, 6), ctx, x), "head.fc (Linear)");
    ck_assert_str_eq(nbt_abort_msg, "head.fc (Linear): input (2, 3, 8) has 8 features in its last "
                                    "dim, the layer takes 6");
    NBT_EXPECT_ABORT(nb_module_forward(ok, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 5))),
                     "blocks.0.norm (LayerNorm)");
    ck_assert_str_eq(nbt_abort_msg, "blocks.0.norm (LayerNorm): input (2, 3, 5) does not end in "
                                    "the normalized shape (8,)");
    NBT_EXPECT_ABORT(nb_module_forward(ok, ctx, nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3, 8))),
                     "blocks.0.norm (LayerNorm)");
    ck_assert_str_eq(nbt_abort_msg, "blocks.0.norm (LayerNorm): input (2, 3, 8) is f64 but the "
                                    "layer's parameters are f32");
    /* an op's message inside a user's module: prefixed with the module */
    NBT_EXPECT_ABORT(nb_module_forward(net_new(ctx, 4, 4), ctx, x), "blocks.1 (Block): nb_add");
    ck_assert_ptr_eq(strstr(nbt_abort_msg, "blocks.1 (Block): nb_add"), nbt_abort_msg);
    /* inside a module called directly, below the root of the failing call */
    nb_module *net = net_new(ctx, 8, 6);
    NBT_EXPECT_ABORT(nb_module_forward(nb_module_child(net, "blocks"), ctx,
                                       nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 5))),
                     "0.norm (LayerNorm)");
    ck_assert_str_eq(nbt_abort_msg, "0.norm (LayerNorm): input (2, 3, 5) does not end in the "
                                    "normalized shape (8,)");
    /* the module called directly keeps its message, with nothing left over from
     * the forwards the aborts above left by longjmp */
    NBT_EXPECT_ABORT(nb_module_forward(nb_module_child(net, "head.fc"), ctx, x), "Linear");
    ck_assert_str_eq(nbt_abort_msg, "Linear: input (2, 3, 8) has 8 features in its last dim, the "
                                    "layer takes 6");
    NBT_EXPECT_ABORT(nb_add(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(5))), "nb_add");
    ck_assert_ptr_eq(strstr(nbt_abort_msg, "nb_add"), nbt_abort_msg);
    /* under recomputation the forward is the same door */
    nb_module_set_recompute(nb_module_child(net, "blocks.1"), true);
    nb_tensor *xg = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(2, 3, 8), 1);
    NBT_EXPECT_ABORT(nb_module_forward(net, ctx, xg), "head.fc (Linear)");
}

NBT_MAIN("nn_layers", "core", 0,
         test_linear_values, test_linear_gradcheck, test_linear_matches_composed, test_conv2d_values,
         test_conv2d_gradcheck, test_conv2d_groups, test_embedding, test_layer_norm, test_dropout, test_activations,
         test_pooling, test_flatten, test_sequential, test_losses, test_loss_gradcheck, test_layer_errors,
         test_errors_name_module_path)
