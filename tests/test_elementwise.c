/* Elementwise ops: values against libm in double, broadcasting, strided
 * inputs, gradchecks, and error messages. */
#define _DEFAULT_SOURCE /* for M_PI */
#include <math.h>

#include "testutil.h"

typedef nb_tensor *(*unary_op)(nb_ctx *, nb_tensor *);
static nb_tensor *gelu_exact(nb_ctx *c, nb_tensor *x) { return nb_gelu(c, x, NB_GELU_EXACT); }
static nb_tensor *gelu_tanh(nb_ctx *c, nb_tensor *x) { return nb_gelu(c, x, NB_GELU_TANH); }
static nb_tensor *pow3(nb_ctx *c, nb_tensor *x) { return nb_pow(c, x, 3.0); }
static nb_tensor *pow_half(nb_ctx *c, nb_tensor *x) { return nb_pow(c, x, 0.5); }
static nb_tensor *adds(nb_ctx *c, nb_tensor *x) { return nb_add_scalar(c, x, 1.5); }
static nb_tensor *subs(nb_ctx *c, nb_tensor *x) { return nb_sub_scalar(c, x, 1.5); }
static nb_tensor *muls(nb_ctx *c, nb_tensor *x) { return nb_mul_scalar(c, x, -3); }
static nb_tensor *divs(nb_ctx *c, nb_tensor *x) { return nb_div_scalar(c, x, 4); }

static double ref_gelu(double x) { return 0.5 * x * (1 + erf(x / sqrt(2.0))); }
static double ref_gelu_tanh(double x) {
    return 0.5 * x * (1 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double ref_sigmoid(double x) { return 1 / (1 + exp(-x)); }
static double ref_relu(double x) { return x > 0 ? x : 0; }
static double ref_neg(double x) { return -x; }
static double ref_rsqrt(double x) { return 1 / sqrt(x); }
static double ref_pow3(double x) { return x * x * x; }
static double ref_pow_half(double x) { return sqrt(x); }
static double ref_adds(double x) { return x + 1.5; }
static double ref_subs(double x) { return x - 1.5; }
static double ref_muls(double x) { return x * -3; }
static double ref_divs(double x) { return x / 4; }

static const struct {
    const char *name;
    unary_op op;
    double (*ref)(double);
    bool positive; /* domain x > 0 */
} unaries[] = {
    {"neg", nb_neg, ref_neg, false},      {"exp", nb_exp, exp, false},
    {"log", nb_log, log, true},           {"sqrt", nb_sqrt, sqrt, true},
    {"rsqrt", nb_rsqrt, ref_rsqrt, true}, {"abs", nb_abs, fabs, false},
    {"tanh", nb_tanh, tanh, false},       {"sigmoid", nb_sigmoid, ref_sigmoid, false},
    {"relu", nb_relu, ref_relu, false},   {"gelu", gelu_exact, ref_gelu, false},
    {"gelu_tanh", gelu_tanh, ref_gelu_tanh, false}, {"pow3", pow3, ref_pow3, false},
    {"pow_half", pow_half, ref_pow_half, true}, {"add_scalar", adds, ref_adds, false},
    {"sub_scalar", subs, ref_subs, false}, {"mul_scalar", muls, ref_muls, false},
    {"div_scalar", divs, ref_divs, false},
};
#define N_UNARY (int)(sizeof unaries / sizeof unaries[0])

/* inputs away from 0 (kinks of abs/relu) and positive where needed */
static nb_tensor *domain_input(nb_ctx *ctx, nb_dtype dt, int ndim, const int64_t *shape, bool positive,
                               uint64_t seed) {
    nb_tensor *x = nbt_randn(ctx, NB_F64, ndim, shape, seed);
    int64_t n = nb_numel(x);
    double *p = x->data;
    for (int64_t i = 0; i < n; i++) {
        if (fabs(p[i]) < 0.1) p[i] = p[i] < 0 ? -0.1 - p[i] : 0.1 + p[i];
        if (positive) p[i] = fabs(p[i]) + 0.2;
    }
    return nb_cast(ctx, x, dt);
}

START_TEST(test_unary_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int k = 0; k < N_UNARY; k++) {
        for (int dti = 0; dti < 2; dti++) {
            nb_dtype dt = dti ? NB_F32 : NB_F64;
            nb_tensor *x = domain_input(ctx, dt, NB_SHAPE(3, 7), unaries[k].positive, 10 + k);
            nb_tensor *y = unaries[k].op(ctx, x);
            double xv[21], e[21];
            nb_to_host_f64(x, xv);
            for (int i = 0; i < 21; i++) e[i] = unaries[k].ref(xv[i]);
            ck_assert_msg(y->dtype == dt, "%s dtype", unaries[k].name);
            nbt_assert_close(y, e, dt == NB_F32 ? 1e-6 : 1e-13, dt == NB_F32 ? 1e-5 : 1e-13);
        }
    }
    /* sigmoid is stable for large |x| */
    nb_tensor *big = nb_from_host(ctx, NB_F32, NB_SHAPE(2), (float[]){-100.0f, 100.0f});
    double e[2] = {ref_sigmoid(-100), 1.0};
    nbt_assert_close(nb_sigmoid(ctx, big), e, 1e-30, 1e-5);
    nb_ctx_free(ctx);
}
END_TEST

static int current_unary;
static nb_tensor *unary_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    return unaries[current_unary].op(ctx, in[0]);
}

START_TEST(test_unary_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int k = 0; k < N_UNARY; k++) {
        current_unary = k;
        nb_tensor *x = domain_input(ctx, NB_F64, NB_SHAPE(3, 4), unaries[k].positive, 50 + k);
        nb_set_requires_grad(x, true);
        nb_gradcheck_result r = nb_gradcheck(unary_fn, NULL, 1, &x, 0, 0, 0);
        ck_assert_msg(r.ok, "%s: %s", unaries[k].name, r.message);
        /* and through a transposed (non-contiguous) view */
        nb_tensor *base = domain_input(ctx, NB_F64, NB_SHAPE(4, 3), unaries[k].positive, 80 + k);
        nb_set_requires_grad(base, true);
        nb_tensor *xt = nb_transpose(ctx, base, 0, 1);
        nb_tensor *yt = unaries[k].op(ctx, xt);
        nb_tensor *yc = unaries[k].op(ctx, nb_contiguous(ctx, xt));
        nbt_assert_tensors_close(yt, yc, 0, 0);
    }
    nb_ctx_free(ctx);
}
END_TEST

typedef nb_tensor *(*binary_op)(nb_ctx *, nb_tensor *, nb_tensor *);
static const struct {
    const char *name;
    binary_op op;
    char sym;
} binaries[] = {{"add", nb_add, '+'}, {"sub", nb_sub, '-'}, {"mul", nb_mul, '*'}, {"div", nb_div, '/'}};

static double apply(char sym, double a, double b) {
    switch (sym) {
    case '+': return a + b;
    case '-': return a - b;
    case '*': return a * b;
    default: return a / b;
    }
}

START_TEST(test_binary_broadcast_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int k = 0; k < 4; k++) {
        /* a (2, 1, 3) with b (4, 1): result (2, 4, 3) */
        nb_tensor *a = domain_input(ctx, NB_F64, NB_SHAPE(2, 1, 3), false, 1);
        nb_tensor *b = domain_input(ctx, NB_F64, NB_SHAPE(4, 1), false, 2);
        nb_tensor *y = binaries[k].op(ctx, a, b);
        ck_assert_int_eq(y->ndim, 3);
        ck_assert_int_eq(y->shape[0], 2);
        ck_assert_int_eq(y->shape[1], 4);
        ck_assert_int_eq(y->shape[2], 3);
        double e[24];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 3; l++)
                    e[(i * 4 + j) * 3 + l] = apply(binaries[k].sym, nb_get(a, (int64_t[]){i, 0, l}),
                                                   nb_get(b, (int64_t[]){j, 0}));
        nbt_assert_close(y, e, 1e-14, 1e-14);
        /* f32 with a 0-d operand */
        nb_tensor *af = nb_cast(ctx, a, NB_F32);
        nb_tensor *s = nb_scalar(ctx, NB_F32, 0.75);
        nb_tensor *ys = binaries[k].op(ctx, af, s);
        double es[6];
        for (int i = 0; i < 6; i++) es[i] = apply(binaries[k].sym, nb_get(af, (int64_t[]){i / 3, 0, i % 3}), 0.75);
        nbt_assert_close(ys, es, 1e-6, 1e-6);
    }
    /* integer arithmetic */
    nb_tensor *ia = nb_arange(ctx, NB_I64, 0, 4, 1);
    double ei[4] = {0, 2, 4, 6};
    nbt_assert_close(nb_add(ctx, ia, ia), ei, 0, 0);
    nb_ctx_free(ctx);
}
END_TEST

static int current_binary;
static nb_tensor *binary_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    return binaries[current_binary].op(ctx, in[0], in[1]);
}
static nb_tensor *binary_strided_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    /* in[0] (3, 4) used transposed as (4, 3); in[1] (3,) broadcast */
    return binaries[current_binary].op(ctx, nb_transpose(ctx, in[0], 0, 1), in[1]);
}

START_TEST(test_binary_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int k = 0; k < 4; k++) {
        current_binary = k;
        nb_tensor *in[2] = {domain_input(ctx, NB_F64, NB_SHAPE(2, 3, 4), false, 3),
                            domain_input(ctx, NB_F64, NB_SHAPE(3, 1), false, 4)};
        nb_set_requires_grad(in[0], true);
        nb_set_requires_grad(in[1], true);
        nb_gradcheck_result r = nb_gradcheck(binary_fn, NULL, 2, in, 0, 0, 0);
        ck_assert_msg(r.ok, "%s broadcast: %s", binaries[k].name, r.message);
        nb_tensor *in2[2] = {domain_input(ctx, NB_F64, NB_SHAPE(3, 4), false, 5),
                             domain_input(ctx, NB_F64, NB_SHAPE(3), false, 6)};
        nb_set_requires_grad(in2[0], true);
        nb_set_requires_grad(in2[1], true);
        r = nb_gradcheck(binary_strided_fn, NULL, 2, in2, 0, 0, 0);
        ck_assert_msg(r.ok, "%s strided: %s", binaries[k].name, r.message);
    }
    nb_ctx_free(ctx);
}
END_TEST

static nb_tensor *where_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    nb_tensor *cond = u;
    nb_tensor *w = nb_where(ctx, cond, in[0], in[1]);
    return nb_masked_fill(ctx, nb_mul(ctx, w, in[0]), nb_transpose(ctx, cond, 0, 1), -2.0);
}

START_TEST(test_where_masked_fill) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *cond = nb_from_host(ctx, NB_I32, NB_SHAPE(3, 3), (int32_t[]){1, 0, 0, 1, 1, 0, 1, 1, 1});
    nb_tensor *a = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 3), 1);
    nb_tensor *b = nbt_randn(ctx, NB_F64, NB_SHAPE(3), 2); /* broadcasts */
    nb_tensor *w = nb_where(ctx, cond, a, b);
    double e[9];
    for (int i = 0; i < 9; i++)
        e[i] = nb_get(cond, (int64_t[]){i / 3, i % 3}) ? nb_get(a, (int64_t[]){i / 3, i % 3})
                                                      : nb_get(b, (int64_t[]){i % 3});
    nbt_assert_close(w, e, 0, 0);
    /* causal mask: fill above the diagonal */
    nb_tensor *mask = nb_from_host(ctx, NB_F32, NB_SHAPE(3, 3), (float[]){0, 1, 1, 0, 0, 1, 0, 0, 0});
    nb_tensor *m = nb_masked_fill(ctx, a, mask, -INFINITY);
    ck_assert(isinf(nb_get(m, (int64_t[]){0, 2})) && nb_get(m, (int64_t[]){0, 2}) < 0);
    ck_assert_double_eq(nb_get(m, (int64_t[]){2, 1}), nb_get(a, (int64_t[]){2, 1}));
    nb_tensor *in[2] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 3), 5), nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 3), 6)};
    NBT_GRADCHECK(where_fn, cond, 2, in);
    NBT_EXPECT_ABORT(nb_masked_fill(ctx, b, mask, 0), "does not broadcast to the input's shape (3,)");
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    nb_tensor *b = nb_zeros(ctx, NB_F32, NB_SHAPE(4, 3));
    NBT_EXPECT_ABORT(nb_add(ctx, a, b), "nb_add: shapes (2, 3) and (4, 3) cannot be broadcast");
    nb_tensor *d = nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_mul(ctx, a, d), "nb_mul: dtypes differ: f32 (2, 3) vs f64 (2, 3)");
    nb_tensor *i = nb_zeros(ctx, NB_I32, NB_SHAPE(2));
    NBT_EXPECT_ABORT(nb_exp(ctx, i), "nb_exp: dtype i32 is not supported");
    NBT_EXPECT_ABORT(nb_div_scalar(ctx, a, 0), "division by zero");
    NBT_EXPECT_ABORT(nb_gelu(ctx, a, (nb_gelu_approx)7), "unknown approximation");
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_inplace_helpers) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *y = nb_from_host(ctx, NB_F32, NB_SHAPE(3), (float[]){1, 2, 3});
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(3), (float[]){1, 1, 2});
    nb_axpy_(y, -0.5, x);
    double e[3] = {0.5, 1.5, 2};
    nbt_assert_close(y, e, 0, 0);
    nb_scale_(y, 2);
    double e2[3] = {1, 3, 4};
    nbt_assert_close(y, e2, 0, 0);
    /* strided destination */
    nb_tensor *m = nb_zeros(ctx, NB_F64, NB_SHAPE(2, 2));
    nb_tensor *col = nb_select(ctx, m, 1, 1);
    nb_fill_(col, 7);
    double e3[4] = {0, 7, 0, 7};
    nbt_assert_close(m, e3, 0, 0);
    nb_copy_(col, nb_from_host(ctx, NB_I32, NB_SHAPE(2), (int32_t[]){-1, 5}));
    double e4[4] = {0, -1, 0, 5};
    nbt_assert_close(m, e4, 0, 0);
    nb_axpy_(col, 2, nb_from_host(ctx, NB_F64, NB_SHAPE(2), (double[]){1, 1}));
    double e5[4] = {0, 1, 0, 7};
    nbt_assert_close(m, e5, 0, 0);
    NBT_EXPECT_ABORT(nb_copy_(col, y), "nb_copy_: shapes differ: (2,) vs (3,)");
    nb_ctx_free(ctx);
}
END_TEST

/* GELU(tanh)'s f32 backward (one fused pass when x and g are contiguous,
 * the generic two passes otherwise) against the f64 one. */
START_TEST(test_gelu_tanh_f32_backward) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int tr = 0; tr < 2; tr++) {
        nb_tensor *x64, *x32;
        nbt_twin_leaves(ctx, NB_SHAPE(5, 37), 90 + tr, &x64, &x32);
        nb_tensor *a64 = nb_mul_scalar(ctx, x64, 3.0), *a32 = nb_mul_scalar(ctx, x32, 3.0);
        if (tr) { /* a non-contiguous input */
            a64 = nb_transpose(ctx, a64, 0, 1);
            a32 = nb_transpose(ctx, a32, 0, 1);
        }
        nb_backward(nbt_weighted_sum(ctx, nb_gelu(ctx, a64, NB_GELU_TANH)));
        nb_backward(nbt_weighted_sum(ctx, nb_gelu(ctx, a32, NB_GELU_TANH)));
        nbt_assert_tensors_close(x32->grad, x64->grad, 1e-5, 1e-4);
    }
    nb_ctx_free(ctx);
}
END_TEST

int main(void) {
    Suite *s = suite_create("elementwise");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_unary_values);
    tcase_add_test(tc, test_unary_gradcheck);
    tcase_add_test(tc, test_gelu_tanh_f32_backward);
    tcase_add_test(tc, test_binary_broadcast_values);
    tcase_add_test(tc, test_binary_gradcheck);
    tcase_add_test(tc, test_where_masked_fill);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_inplace_helpers);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
