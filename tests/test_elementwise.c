/* Elementwise ops: values against libm in double, broadcasting, strided
 * inputs, gradchecks, error messages, and every row of the op tables
 * (tensor/op_table.h) run by the CPU kernels against its own reference. */
#define _DEFAULT_SOURCE /* for M_PI */
#include <math.h>

#include "tensor/cpu/cpu.h" /* nb__cpu_unary, nb__cpu_binary */
#include "tensor/internal.h"
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

NBT_CPU_TEST(test_unary_values) {
    for (int k = 0; k < N_UNARY; k++) {
        NBT_FOR_F64_F32(dti, dt) {
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
}

static int current_unary;
static nb_tensor *unary_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    return unaries[current_unary].op(ctx, in[0]);
}

NBT_CPU_TEST(test_unary_gradcheck) {
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
}

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

NBT_CPU_TEST(test_binary_broadcast_values) {
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
}

static int current_binary;
static nb_tensor *binary_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    return binaries[current_binary].op(ctx, in[0], in[1]);
}
static nb_tensor *binary_strided_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    /* in[0] (3, 4) used transposed as (4, 3); in[1] (3,) broadcast */
    return binaries[current_binary].op(ctx, nb_transpose(ctx, in[0], 0, 1), in[1]);
}

NBT_CPU_TEST(test_binary_gradcheck) {
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
}

static nb_tensor *where_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    nb_tensor *cond = u;
    nb_tensor *w = nb_where(ctx, cond, in[0], in[1]);
    return nb_masked_fill(ctx, nb_mul(ctx, w, in[0]), nb_transpose(ctx, cond, 0, 1), -2.0);
}

NBT_CPU_TEST(test_where_masked_fill) {
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
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    nb_tensor *b = nb_zeros(ctx, NB_F32, NB_SHAPE(4, 3));
    NBT_EXPECT_ABORT(nb_add(ctx, a, b), "nb_add: shapes (2, 3) and (4, 3) cannot be broadcast");
    nb_tensor *d = nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_mul(ctx, a, d), "nb_mul: dtypes differ: f32 (2, 3) vs f64 (2, 3)");
    nb_tensor *i = nb_zeros(ctx, NB_I32, NB_SHAPE(2));
    NBT_EXPECT_ABORT(nb_exp(ctx, i), "nb_exp: dtype i32 is not supported");
    NBT_EXPECT_ABORT(nb_div_scalar(ctx, a, 0), "division by zero");
    NBT_EXPECT_ABORT(nb_gelu(ctx, a, (nb_gelu_approx)7), "unknown approximation");
}

NBT_CPU_TEST(test_inplace_helpers) {
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
}

/* GELU(tanh)'s f32 backward (one fused pass when x and g are contiguous,
 * the generic two passes otherwise) against the f64 one. */
NBT_CPU_TEST(test_gelu_tanh_f32_backward) {
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
}

/* ---- every row of the op tables (Note [Op tables] in tensor/op_table.h) ---- */
static double r_sign(double x, double s) { return x > 0 ? 1 : x < 0 ? -1 : 0; }
static double r_relu_mask(double x, double s) { return x > 0 ? 1 : 0; }
static double r_gelu_grad(double x, double s) { /* d/dx x Phi(x) */
    return 0.5 * (1 + erf(x / sqrt(2.0))) + x * exp(-x * x / 2) / sqrt(2 * M_PI);
}
static double r_gelu_tanh_grad(double x, double s) { /* d/dx x (1 + tanh u(x)) / 2 */
    double k = sqrt(2.0 / M_PI), u = k * (x + 0.044715 * x * x * x);
    double du = k * (1 + 3 * 0.044715 * x * x);
    return 0.5 * (1 + tanh(u)) + 0.5 * x * du / (cosh(u) * cosh(u));
}
static double r_neg(double x, double s) { return -x; }
static double r_exp(double x, double s) { return exp(x); }
static double r_log(double x, double s) { return log(x); }
static double r_sqrt(double x, double s) { return sqrt(x); }
static double r_rsqrt(double x, double s) { return 1 / sqrt(x); }
static double r_abs(double x, double s) { return fabs(x); }
static double r_tanh(double x, double s) { return tanh(x); }
static double r_sigmoid(double x, double s) { return ref_sigmoid(x); }
static double r_relu(double x, double s) { return ref_relu(x); }
static double r_gelu(double x, double s) { return ref_gelu(x); }
static double r_gelu_tanh(double x, double s) { return ref_gelu_tanh(x); }
static double r_pow(double x, double s) { return pow(x, s); }
static double r_add_s(double x, double s) { return x + s; }
static double r_mul_s(double x, double s) { return x * s; }
static double r_recip(double x, double s) { return 1 / x; }

/* Indexed by op: adding a row to the table without a reference here fails
 * to compile. s: the scalar; positive: domain x > 0. */
static const struct {
    double (*ref)(double x, double s);
    double s;
    bool positive;
} table_unary[] = {
    [NB_U_NEG] = {r_neg, 0, false},         [NB_U_EXP] = {r_exp, 0, false},
    [NB_U_LOG] = {r_log, 0, true},          [NB_U_SQRT] = {r_sqrt, 0, true},
    [NB_U_RSQRT] = {r_rsqrt, 0, true},      [NB_U_ABS] = {r_abs, 0, false},
    [NB_U_TANH] = {r_tanh, 0, false},       [NB_U_SIGMOID] = {r_sigmoid, 0, false},
    [NB_U_RELU] = {r_relu, 0, false},       [NB_U_GELU] = {r_gelu, 0, false},
    [NB_U_GELU_TANH] = {r_gelu_tanh, 0, false}, [NB_U_POW] = {r_pow, 2.5, true},
    [NB_U_ADD_S] = {r_add_s, -0.75, false}, [NB_U_MUL_S] = {r_mul_s, 1.25, false},
    [NB_U_SIGN] = {r_sign, 0, false},       [NB_U_RELU_MASK] = {r_relu_mask, 0, false},
    [NB_U_GELU_GRAD] = {r_gelu_grad, 0, false},
    [NB_U_GELU_TANH_GRAD] = {r_gelu_tanh_grad, 0, false}, [NB_U_RECIP] = {r_recip, 0, false},
};
_Static_assert(sizeof table_unary / sizeof table_unary[0] == NB_U_COUNT,
               "a reference for every unary op");

static double r_add(double x, double y) { return x + y; }
static double r_sub(double x, double y) { return x - y; }
static double r_mul(double x, double y) { return x * y; }
static double r_div(double x, double y) { return x / y; }
static double (*const table_binary[])(double, double) = {
    [NB_B_ADD] = r_add, [NB_B_SUB] = r_sub, [NB_B_MUL] = r_mul, [NB_B_DIV] = r_div};
_Static_assert(sizeof table_binary / sizeof table_binary[0] == NB_B_COUNT,
               "a reference for every binary op");

/* The kernels on (7, 9) contiguous and transposed inputs, f64 and f32. */
NBT_CPU_TEST(test_table_unary_ops) {
    for (int op = 0; op < NB_U_COUNT; op++) {
        ck_assert_ptr_nonnull(table_unary[op].ref);
        ck_assert_msg(nb__unary_name((nb__unary_op)op)[0] != 0, "op %d has no name", op);
        for (int dti = 0; dti < 2; dti++)
            for (int tr = 0; tr < 2; tr++) {
                nb_dtype dt = dti ? NB_F32 : NB_F64;
                nb_tensor *x =
                    domain_input(ctx, dt, NB_SHAPE(9, 7), table_unary[op].positive, 200 + op);
                if (tr) x = nb_transpose(ctx, x, 0, 1);
                else x = nb_reshape(ctx, x, NB_SHAPE(7, 9));
                nb_tensor *y = nb__unary(ctx, (nb__unary_op)op, x, table_unary[op].s);
                double xv[63], e[63];
                nb_to_host_f64(x, xv);
                for (int i = 0; i < 63; i++) e[i] = table_unary[op].ref(xv[i], table_unary[op].s);
                ck_assert_msg(y->dtype == dt, "%s dtype", nb__unary_name((nb__unary_op)op));
                nbt_assert_close(y, e, dt == NB_F32 ? 1e-6 : 1e-13, dt == NB_F32 ? 1e-5 : 1e-13);
            }
    }
    ck_assert_str_eq(nb__unary_name(NB_U_EXP), "nb_exp");
    ck_assert_str_eq(nb__unary_name((nb__unary_op)NB_U_COUNT), "elementwise op");
    nb_tensor *i = nb_zeros(ctx, NB_I32, NB_SHAPE(2));
    NBT_EXPECT_ABORT(nb__cpu_unary(NB_U_SIGN, nb_zeros(ctx, NB_I32, NB_SHAPE(2)), i, 0),
                     "sign: dtype i32 has no CPU math");
}

/* Every binary op on every dtype with CPU math, broadcast (3, 1) with (4). */
NBT_CPU_TEST(test_table_binary_ops) {
    static const nb_dtype dts[] = {NB_F64, NB_F32, NB_I32, NB_I64};
    double av[3] = {7, -9, 12}, bv[4] = {2, -3, 5, 4};
    for (int op = 0; op < NB_B_COUNT; op++)
        for (int d = 0; d < 4; d++) {
            nb_tensor *a = nb_cast(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(3, 1), av), dts[d]);
            nb_tensor *b = nb_cast(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(4), bv), dts[d]);
            nb_tensor *y = nb__binary(ctx, (nb__binary_op)op, a, b);
            double e[12];
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 4; j++) {
                    double r = table_binary[op](av[i], bv[j]);
                    e[i * 4 + j] = dts[d] == NB_I32 || dts[d] == NB_I64 ? trunc(r) : r;
                }
            ck_assert_msg(y->dtype == dts[d], "%s dtype", nb__binary_name((nb__binary_op)op));
            nbt_assert_close(y, e, 1e-6, 1e-6);
        }
    ck_assert_str_eq(nb__binary_name(NB_B_DIV), "nb_div");
    /* bf16 is computed through f32 (Note [bf16 activations on the CPU]); f16 is not */
    nb_tensor *h = nb_zeros(ctx, NB_F16, NB_SHAPE(2));
    NBT_EXPECT_ABORT(nb__cpu_binary(NB_B_MUL, nb_zeros(ctx, NB_F16, NB_SHAPE(2)), h, h),
                     "nb_mul: dtype f16 has no CPU math");
}

/* Note [Integer division]: truncation toward zero, a zero divisor refused
 * naming the op and the element (never SIGFPE), MIN / -1 wrapping to MIN. */
NBT_CPU_TEST(test_integer_division) {
    nb_tensor *a = nb_from_host(ctx, NB_I64, NB_SHAPE(4), (int64_t[]){7, -7, INT64_MIN, 5});
    nb_tensor *b = nb_from_host(ctx, NB_I64, NB_SHAPE(4), (int64_t[]){2, 2, -1, -5});
    int64_t q[4];
    nb_to_host(nb_div(ctx, a, b), q);
    ck_assert_int_eq(q[0], 3);
    ck_assert_int_eq(q[1], -3);
    ck_assert(q[2] == INT64_MIN);
    ck_assert_int_eq(q[3], -1);
    nb_tensor *a32 = nb_from_host(ctx, NB_I32, NB_SHAPE(2), (int32_t[]){INT32_MIN, 9});
    nb_tensor *b32 = nb_from_host(ctx, NB_I32, NB_SHAPE(2), (int32_t[]){-1, -1});
    int32_t q32[2];
    nb_to_host(nb_div(ctx, a32, b32), q32);
    ck_assert(q32[0] == INT32_MIN);
    ck_assert_int_eq(q32[1], -9);
    /* a zero divisor, found in a broadcast (2, 3) divisor and in a transposed view */
    nb_tensor *z = nb_from_host(ctx, NB_I32, NB_SHAPE(2, 3), (int32_t[]){1, 2, 3, 4, 0, 6});
    nb_tensor *x = nb_ones(ctx, NB_I32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_div(ctx, x, z),
                     "nb_div: integer division by zero: the divisor (i32 (2, 3)) is 0 at index (1, 1)");
    NBT_EXPECT_ABORT(nb_div(ctx, nb_ones(ctx, NB_I32, NB_SHAPE(3, 2)), nb_transpose(ctx, z, 0, 1)),
                     "is 0 at index (1, 1) (dividend (3, 2))");
    NBT_EXPECT_ABORT(nb_div(ctx, a, nb_zeros(ctx, NB_I64, NB_SHAPE(1))), "is 0 at index (0,)");
    /* floats keep IEEE division */
    nb_tensor *f = nb_div(ctx, nb_ones(ctx, NB_F32, NB_SHAPE(1)), nb_zeros(ctx, NB_F32, NB_SHAPE(1)));
    ck_assert(isinf(nb_item(f)));
}

int main(void) {
    const TTest *tests[] = {test_unary_values, test_unary_gradcheck, test_gelu_tanh_f32_backward,
                             test_binary_broadcast_values, test_binary_gradcheck, test_where_masked_fill,
                             test_errors, test_inplace_helpers, test_table_unary_ops, test_table_binary_ops,
                             test_integer_division, NULL};
    return nbt_run(nbt_suite("elementwise", "core", 60, tests));
}
