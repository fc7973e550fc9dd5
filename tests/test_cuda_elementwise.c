/* CUDA elementwise kernels against the CPU (tests/cuda_parity.h): every
 * unary op, and through their gradients the backward-only ones (sign,
 * relu mask, the GELU gradients, reciprocal); every binary op with
 * broadcasting, scalar and transposed operands, on floats and integers;
 * where and masked_fill; casts between every pair of dtypes (contiguous,
 * strided source, strided destination); fills; axpy and scale in place;
 * concat, stack, whole-tensor sums and views with their backward; and
 * every row of the unary table (tensor/op_table.h) through the kernel-level
 * nb__unary, so that a new row is compared without a new case here.
 * Skipped (77) without CUDA or a GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_parity.h"
#include "tensor/internal.h"

static const nb_dtype float_dtypes[] = {NB_F32, NB_BF16, NB_F16, NB_F64};
#define N_FLOAT_DTYPES 4
static const nb_dtype all_dtypes[] = {NB_F32, NB_F64, NB_BF16, NB_F16, NB_I32, NB_I64};
#define N_ALL_DTYPES 6

static double tol_of(nb_dtype dt) {
    switch (dt) {
    case NB_BF16: return NBT_TOL_BF16;
    case NB_F16: return NBT_TOL_F16;
    case NB_F64: return NBT_TOL_F64;
    default: return NBT_TOL_F32;
    }
}

/* ---- unary ---- */
typedef enum unary_kind {
    U_NEG, U_EXP, U_LOG, U_SQRT, U_RSQRT, U_ABS, U_TANH, U_SIGMOID, U_RELU, U_GELU,
    U_GELU_TANH, U_POW, U_ADD_S, U_SUB_S, U_MUL_S, U_DIV_S
} unary_kind;

typedef struct unary_case {
    const char *name;
    unary_kind kind;
    double s, lo, hi;
} unary_case;

static const unary_case unary_cases[] = {
    {"neg", U_NEG, 0, -2, 2},           {"exp", U_EXP, 0, -3, 3},
    {"log", U_LOG, 0, 0.1, 4},          {"sqrt", U_SQRT, 0, 0.1, 4},
    {"rsqrt", U_RSQRT, 0, 0.2, 4},      {"abs", U_ABS, 0, -2, 2},
    {"tanh", U_TANH, 0, -3, 3},         {"sigmoid", U_SIGMOID, 0, -8, 8},
    {"relu", U_RELU, 0, -2, 2},         {"gelu", U_GELU, 0, -4, 4},
    {"gelu_tanh", U_GELU_TANH, 0, -4, 4}, {"pow 3", U_POW, 3, -2, 2},
    {"pow 0.5", U_POW, 0.5, 0.1, 4},    {"pow -1.5", U_POW, -1.5, 0.3, 3},
    {"add_scalar", U_ADD_S, 0.75, -2, 2}, {"sub_scalar", U_SUB_S, 1.5, -2, 2},
    {"mul_scalar", U_MUL_S, -1.25, -2, 2}, {"div_scalar", U_DIV_S, 4, -2, 2},
};

static nb_tensor *unary_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const unary_case *c = user;
    nb_tensor *x = in[0];
    switch (c->kind) {
    case U_NEG: return nb_neg(ctx, x);
    case U_EXP: return nb_exp(ctx, x);
    case U_LOG: return nb_log(ctx, x);
    case U_SQRT: return nb_sqrt(ctx, x);
    case U_RSQRT: return nb_rsqrt(ctx, x);
    case U_ABS: return nb_abs(ctx, x);
    case U_TANH: return nb_tanh(ctx, x);
    case U_SIGMOID: return nb_sigmoid(ctx, x);
    case U_RELU: return nb_relu(ctx, x);
    case U_GELU: return nb_gelu(ctx, x, NB_GELU_EXACT);
    case U_GELU_TANH: return nb_gelu(ctx, x, NB_GELU_TANH);
    case U_POW: return nb_pow(ctx, x, c->s);
    case U_ADD_S: return nb_add_scalar(ctx, x, c->s);
    case U_SUB_S: return nb_sub_scalar(ctx, x, c->s);
    case U_MUL_S: return nb_mul_scalar(ctx, x, c->s);
    case U_DIV_S: return nb_div_scalar(ctx, x, c->s);
    }
    return NULL;
}

START_TEST(test_unary) {
    /* (5, 37) contiguous; (37, 5) transposed; a long contiguous row */
    static const int64_t shapes[3][2] = {{5, 37}, {37, 5}, {3, 4099}};
    for (size_t c = 0; c < sizeof unary_cases / sizeof unary_cases[0]; c++)
        for (int d = 0; d < N_FLOAT_DTYPES; d++)
            for (int s = 0; s < 3; s++) {
                const unary_case *uc = &unary_cases[c];
                nbt_input in = {.dtype = float_dtypes[d], .ndim = 2,
                                .shape = {shapes[s][0], shapes[s][1]}, .lo = uc->lo,
                                .hi = uc->hi, .transposed = s == 1};
                char name[96];
                snprintf(name, sizeof name, "%s %s %s", uc->name, nb_dtype_name(in.dtype),
                         s == 1 ? "transposed" : "contiguous");
                nbt_parity(name, unary_op, (void *)uc, 1, &in, NULL);
            }
}
END_TEST

/* Every row of the unary table, through nb__unary (no backward: it records
 * nothing). Inputs in [0.2, 3) suit every op; [-3, 3) every op defined on
 * negatives too. */
typedef struct table_case {
    nb__unary_op op;
    double s;
} table_case;

static nb_tensor *table_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const table_case *c = user;
    return nb__unary(ctx, c->op, in[0], c->s);
}

START_TEST(test_unary_table) {
    for (int op = 0; op < NB_U_COUNT; op++) {
        table_case tc = {(nb__unary_op)op, op == NB_U_POW ? 1.5 : op == NB_U_ADD_S ? -0.75 : 1.25};
        bool signed_ok = op != NB_U_LOG && op != NB_U_SQRT && op != NB_U_RSQRT && op != NB_U_POW &&
                         op != NB_U_RECIP;
        for (int d = 0; d < N_FLOAT_DTYPES; d++)
            for (int sg = 0; sg < 1 + signed_ok; sg++)
                for (int tr = 0; tr < 2; tr++) {
                    nbt_input in = {.dtype = float_dtypes[d], .ndim = 2, .shape = {9, 37},
                                    .lo = sg ? -3 : 0.2, .hi = 3, .transposed = tr,
                                    .no_grad = true};
                    nbt_parity_opts o = {.no_backward = true};
                    char name[96];
                    snprintf(name, sizeof name, "table row %d (%s) %s %s%s", op,
                             nb__unary_name(tc.op), nb_dtype_name(in.dtype),
                             sg ? "signed" : "positive", tr ? " transposed" : "");
                    nbt_parity(name, table_op, &tc, 1, &in, &o);
                }
    }
}
END_TEST

/* ---- binary ---- */
static nb_tensor *binary_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    switch (*(const int *)user) {
    case 0: return nb_add(ctx, in[0], in[1]);
    case 1: return nb_sub(ctx, in[0], in[1]);
    case 2: return nb_mul(ctx, in[0], in[1]);
    default: return nb_div(ctx, in[0], in[1]);
    }
}

typedef struct shape_pair {
    const char *name;
    int nda, ndb;
    int64_t a[3], b[3];
    bool ta, tb; /* transposed */
} shape_pair;

static const shape_pair binary_shapes[] = {
    {"same shape", 2, 2, {6, 35}, {6, 35}, false, false},
    {"broadcast last dim", 3, 1, {4, 6, 35}, {35}, false, false},
    {"broadcast middle", 3, 2, {4, 6, 35}, {6, 1}, false, false},
    {"scalar b", 2, 0, {6, 35}, {0}, false, false},
    {"scalar a", 0, 2, {0}, {6, 35}, false, false},
    {"outer product", 2, 2, {1, 35}, {6, 1}, false, false},
    {"a transposed", 2, 2, {6, 35}, {6, 35}, true, false},
    {"both transposed", 2, 2, {35, 6}, {35, 6}, true, true},
    {"transposed and broadcast", 3, 2, {3, 33, 7}, {33, 7}, true, false},
    {"long rows", 2, 1, {3, 5001}, {5001}, false, false},
};

static const char *const binary_names[] = {"add", "sub", "mul", "div"};

START_TEST(test_binary_float) {
    static const int ops[] = {0, 1, 2, 3};
    for (int op = 0; op < 4; op++)
        for (size_t k = 0; k < sizeof binary_shapes / sizeof binary_shapes[0]; k++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++) {
                const shape_pair *sp = &binary_shapes[k];
                nbt_input in[2] = {
                    {.dtype = float_dtypes[d], .ndim = sp->nda, .lo = -2, .hi = 2,
                     .transposed = sp->ta},
                    {.dtype = float_dtypes[d], .ndim = sp->ndb, .lo = op == 3 ? 0.5 : -2,
                     .hi = 2, .transposed = sp->tb},
                };
                for (int i = 0; i < sp->nda; i++) in[0].shape[i] = sp->a[i];
                for (int i = 0; i < sp->ndb; i++) in[1].shape[i] = sp->b[i];
                char name[128];
                snprintf(name, sizeof name, "%s %s %s", binary_names[op], sp->name,
                         nb_dtype_name(float_dtypes[d]));
                nbt_parity(name, binary_op, (void *)&ops[op], 2, in, NULL);
            }
}
END_TEST

START_TEST(test_binary_int) {
    static const int ops[] = {0, 1, 2, 3};
    static const nb_dtype dts[] = {NB_I32, NB_I64};
    for (int op = 0; op < 4; op++)
        for (int d = 0; d < 2; d++)
            for (int k = 0; k < 3; k++) {
                const shape_pair *sp = &binary_shapes[k == 2 ? 6 : k];
                nbt_input in[2] = {
                    {.dtype = dts[d], .ndim = sp->nda, .lo = -50, .hi = 50, .transposed = sp->ta},
                    /* positive divisors: C truncates toward zero on both sides */
                    {.dtype = dts[d], .ndim = sp->ndb, .lo = op == 3 ? 1 : -50, .hi = 50},
                };
                for (int i = 0; i < sp->nda; i++) in[0].shape[i] = sp->a[i];
                for (int i = 0; i < sp->ndb; i++) in[1].shape[i] = sp->b[i];
                char name[128];
                snprintf(name, sizeof name, "%s %s %s", binary_names[op], sp->name,
                         nb_dtype_name(dts[d]));
                nbt_parity(name, binary_op, (void *)&ops[op], 2, in, NULL);
            }
}
END_TEST

/* ---- where and masked_fill ---- */
static nb_tensor *where_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_where(ctx, in[0], in[1], in[2]);
}

static nb_tensor *masked_fill_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_masked_fill(ctx, in[0], in[1], -7.5);
}

START_TEST(test_where) {
    /* a float condition with zeros, negative zeros and NaN-free nonzeros */
    static double cond_values[6 * 35];
    for (int i = 0; i < 6 * 35; i++) cond_values[i] = i % 3 == 0 ? 0.0 : i % 3 == 1 ? -0.0 : 0.5 * (i % 7 - 3.5);
    for (int d = 0; d < N_FLOAT_DTYPES; d++) {
        nb_dtype dt = float_dtypes[d];
        /* integer condition (6, 1), a (6, 35), b (35) */
        nbt_input in1[3] = {{.dtype = NB_I32, .ndim = 2, .shape = {6, 1}, .lo = 0, .hi = 2},
                            {.dtype = dt, .ndim = 2, .shape = {6, 35}},
                            {.dtype = dt, .ndim = 1, .shape = {35}}};
        nbt_parity("where i32 cond, broadcast", where_op, NULL, 3, in1, NULL);
        /* i64 condition of the full shape, a transposed, b a scalar */
        nbt_input in2[3] = {{.dtype = NB_I64, .ndim = 2, .shape = {6, 35}, .lo = 0, .hi = 2},
                            {.dtype = dt, .ndim = 2, .shape = {6, 35}, .transposed = true},
                            {.dtype = dt, .ndim = 0}};
        nbt_parity("where i64 cond, transposed a, scalar b", where_op, NULL, 3, in2, NULL);
        /* a float condition of the tested dtype */
        nbt_input in3[3] = {{.dtype = dt, .ndim = 2, .shape = {6, 35}, .no_grad = true,
                             .values = cond_values},
                            {.dtype = dt, .ndim = 2, .shape = {6, 35}},
                            {.dtype = dt, .ndim = 2, .shape = {6, 35}}};
        nbt_parity("where float cond", where_op, NULL, 3, in3, NULL);
        nbt_input in4[2] = {{.dtype = dt, .ndim = 3, .shape = {4, 6, 35}},
                            {.dtype = NB_I64, .ndim = 2, .shape = {1, 35}, .lo = 0, .hi = 2}};
        nbt_parity("masked_fill", masked_fill_op, NULL, 2, in4, NULL);
    }
}
END_TEST

/* ---- casts ---- */
/* Values exact in every dtype (multiples of 1/4 in [-3.75, 3.75], or
 * integers), so that casts have one right answer. */
#define CAST_N (7 * 33)
static double cast_float_values[CAST_N], cast_int_values[CAST_N];

static void init_cast_values(void) {
    for (int i = 0; i < CAST_N; i++) {
        cast_float_values[i] = ((i * 37) % 31 - 15) * 0.25;
        cast_int_values[i] = (i * 37) % 31 - 15;
    }
}

static nb_tensor *cast_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_cast(ctx, in[0], *(const nb_dtype *)user);
}

/* dst (W, H) written through its transpose: a strided destination. */
static nb_tensor *copy_strided_dst_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *x = in[0];
    nb_tensor *y = nb_empty(ctx, *(const nb_dtype *)user, NB_SHAPE(x->shape[1], x->shape[0]));
    nb_copy_(nb_transpose(ctx, y, 0, 1), x);
    return y;
}

START_TEST(test_casts) {
    init_cast_values();
    for (int s = 0; s < N_ALL_DTYPES; s++)
        for (int d = 0; d < N_ALL_DTYPES; d++)
            for (int t = 0; t < 2; t++) {
                nb_dtype src = all_dtypes[s];
                /* the CPU stand-in cannot take a gradient through bf16/f16 */
                if (!nbt_dtype_runs(all_dtypes[d])) continue;
                bool fsrc = nb_dtype_is_float(src);
                nbt_input in = {.dtype = src, .ndim = 2, .shape = {7, 33}, .transposed = t == 1,
                                .values = fsrc ? cast_float_values : cast_int_values};
                double tol = tol_of(src) > tol_of(all_dtypes[d]) ? tol_of(src) : tol_of(all_dtypes[d]);
                /* a gradient only flows between float dtypes */
                nbt_parity_opts o = {.tol = tol,
                                     .no_backward = !fsrc || !nb_dtype_is_float(all_dtypes[d])};
                char name[96];
                snprintf(name, sizeof name, "cast %s -> %s%s", nb_dtype_name(src),
                         nb_dtype_name(all_dtypes[d]), t ? " (transposed source)" : "");
                nbt_parity(name, cast_op, (void *)&all_dtypes[d], 1, &in, &o);
                snprintf(name, sizeof name, "copy %s -> strided %s%s", nb_dtype_name(src),
                         nb_dtype_name(all_dtypes[d]), t ? " (transposed source)" : "");
                nbt_parity_opts o2 = {.tol = tol, .no_backward = true};
                nbt_parity(name, copy_strided_dst_op, (void *)&all_dtypes[d], 1, &in, &o2);
            }
}
END_TEST

/* ---- fills ---- */
static nb_tensor *fill_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *x = in[0];
    double v = x->dtype == NB_I64 ? 3e9 : x->dtype == NB_I32 ? -123456.0 : -1.25;
    nb_tensor *f = nb_empty(ctx, x->dtype, x->ndim, x->shape);
    nb_fill_(f, v);
    /* a strided fill: the transpose of a second buffer, read back transposed */
    nb_tensor *g = nb_empty(ctx, x->dtype, NB_SHAPE(x->shape[1], x->shape[0]));
    nb_fill_(nb_transpose(ctx, g, 0, 1), 0.5);
    return nb_add(ctx, nb_add(ctx, x, f), nb_transpose(ctx, g, 0, 1));
}

START_TEST(test_fill) {
    for (int d = 0; d < N_ALL_DTYPES; d++) {
        nb_dtype dt = all_dtypes[d];
        nbt_input in = {.dtype = dt, .ndim = 2, .shape = {9, 130}, .lo = -3, .hi = 3,
                        .no_grad = true};
        nbt_parity_opts o = {.tol = tol_of(dt), .no_backward = true};
        char name[64];
        snprintf(name, sizeof name, "fill %s", nb_dtype_name(dt));
        nbt_parity(name, fill_op, NULL, 1, &in, &o);
    }
}
END_TEST

/* ---- axpy and scale in place ---- */
static nb_tensor *axpy_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *y = nb_clone(ctx, in[0]);
    nb_axpy_(y, -0.75, in[1]);
    return y;
}

/* y strided: the transpose of a copy of in[0] (W, H) */
static nb_tensor *axpy_strided_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *base = nb_clone(ctx, in[0]);
    nb_axpy_(nb_transpose(ctx, base, 0, 1), 2.5, in[1]);
    return base;
}

static nb_tensor *scale_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *y = nb_clone(ctx, in[0]);
    nb_scale_(y, -3.0);
    return y;
}

START_TEST(test_axpy_scale) {
    nbt_parity_opts o = {.no_backward = true};
    for (int d = 0; d < N_FLOAT_DTYPES; d++) {
        nb_dtype dt = float_dtypes[d];
        nbt_input in[2] = {{.dtype = dt, .ndim = 2, .shape = {17, 300}, .no_grad = true},
                           {.dtype = dt, .ndim = 2, .shape = {17, 300}, .no_grad = true}};
        nbt_parity("axpy contiguous", axpy_op, NULL, 2, in, &o);
        in[1].transposed = true;
        nbt_parity("axpy transposed x", axpy_op, NULL, 2, in, &o);
        nbt_input ins[2] = {{.dtype = dt, .ndim = 2, .shape = {300, 17}, .no_grad = true},
                            {.dtype = dt, .ndim = 2, .shape = {17, 300}, .no_grad = true}};
        nbt_parity("axpy strided y", axpy_strided_op, NULL, 2, ins, &o);
        nbt_parity("scale", scale_op, NULL, 1, in, &o);
    }
}
END_TEST

/* ---- contiguous views at an offset ----
 * Rows [r0, r0 + 3) of a (9, 37) input are contiguous but start r0 * 37
 * elements in: element-aligned only (r0 = 1), or 16-byte aligned for
 * every dtype (r0 = 16: 592 elements). Note [Vectorised contiguous path]
 * in tensor/cuda/elementwise.cu takes the wide loads only in the second
 * case; both must agree with the CPU, tails (111 elements) included. */
typedef struct view_case {
    int kind; /* 0: exp, 1: mul of two views, 2: axpy into a view */
    int64_t r0, r1;
} view_case;

static nb_tensor *view_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const view_case *c = user;
    nb_tensor *a = nb_narrow(ctx, in[0], 0, c->r0, 3);
    nb_tensor *b = nb_narrow(ctx, in[1], 0, c->r1, 3);
    switch (c->kind) {
    case 0: return nb_exp(ctx, a);
    case 1: return nb_mul(ctx, a, b);
    default: {
        nb_tensor *y = nb_clone(ctx, in[0]);
        nb_axpy_(nb_narrow(ctx, y, 0, c->r0, 3), -0.5, b);
        return y;
    }
    }
}

START_TEST(test_offset_views) {
    static const view_case cases[] = {
        {0, 1, 0}, {0, 16, 0}, {1, 16, 16}, {1, 1, 16}, {1, 16, 2}, {2, 16, 16}, {2, 1, 5},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int d = 0; d < N_FLOAT_DTYPES; d++) {
            bool in_place = cases[k].kind == 2; /* axpy writes into a clone: no grad */
            /* exp reads the first input only: the second gets no gradient */
            nbt_input in[2] = {{.dtype = float_dtypes[d], .ndim = 2, .shape = {20, 37},
                                .no_grad = in_place},
                               {.dtype = float_dtypes[d], .ndim = 2, .shape = {20, 37},
                                .no_grad = in_place || cases[k].kind == 0}};
            nbt_parity_opts o = {.no_backward = in_place};
            char name[96];
            snprintf(name, sizeof name, "%s on rows from %lld and %lld %s",
                     cases[k].kind == 0 ? "exp" : cases[k].kind == 1 ? "mul" : "axpy",
                     (long long)cases[k].r0, (long long)cases[k].r1,
                     nb_dtype_name(float_dtypes[d]));
            nbt_parity(name, view_op, (void *)&cases[k], 2, in, &o);
        }
}
END_TEST

/* ---- shape ops: concat, stack, whole-tensor reductions and views, whose
 * backward scatters or sums gradients into the input's shape ---- */
typedef enum shape_kind {
    S_CONCAT, S_STACK, S_SUM_ALL, S_MEAN_ALL, S_NARROW_SLICE, S_SELECT, S_PERMUTE,
    S_EXPAND, S_RESHAPE_T, N_SHAPE_KINDS
} shape_kind;
static const char *const shape_names[] = {
    "concat axis 1 of 3", "stack axis 2 of 3", "sum_all", "mean_all", "narrow then slice step 3",
    "select", "permute made contiguous", "expand times a tensor", "reshape of a transposed view",
};

static nb_tensor *shape_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    shape_kind k = *(const shape_kind *)user;
    nb_tensor *x = in[0];
    switch (k) {
    case S_CONCAT: return nb_concat(ctx, 3, in, 1);
    case S_STACK: {
        nb_tensor *xs[3] = {in[0], nb_narrow(ctx, in[1], 1, 0, 6), nb_narrow(ctx, in[2], 1, 1, 6)};
        return nb_stack(ctx, 3, xs, 2);
    }
    case S_SUM_ALL: return nb_sum_all(ctx, x);
    case S_MEAN_ALL: return nb_mean_all(ctx, x);
    case S_NARROW_SLICE:
        return nb_exp(ctx, nb_slice(ctx, nb_narrow(ctx, x, 0, 1, 3), 1, 1, 6, 3));
    case S_SELECT: return nb_mul_scalar(ctx, nb_select(ctx, x, 1, 4), 2.0);
    case S_PERMUTE: {
        static const int perm[3] = {2, 0, 1};
        return nb_contiguous(ctx, nb_permute(ctx, x, perm));
    }
    case S_EXPAND: {
        nb_tensor *col = nb_narrow(ctx, x, 1, 2, 1); /* (4, 1) of a (4, 6) */
        int64_t shape[3] = {5, 4, 6};
        return nb_mul(ctx, nb_expand(ctx, col, 3, shape), in[1]);
    }
    case S_RESHAPE_T: {
        int64_t shape[2] = {3, 8};
        return nb_reshape(ctx, nb_transpose(ctx, x, 0, 1), 2, shape);
    }
    default: return NULL;
    }
}

START_TEST(test_shape_ops) {
    for (int k = 0; k < N_SHAPE_KINDS; k++)
        for (int d = 0; d < N_FLOAT_DTYPES; d++) {
            nb_dtype dt = float_dtypes[d];
            nbt_input in[3] = {{.dtype = dt, .ndim = 2, .shape = {4, 6}},
                               {.dtype = dt, .ndim = 2, .shape = {4, 6}},
                               {.dtype = dt, .ndim = 2, .shape = {4, 6}}};
            int n = 1;
            if (k == S_CONCAT) {
                in[1].shape[1] = 1;
                in[2].shape[1] = 9;
                in[2].transposed = true;
                n = 3;
            } else if (k == S_STACK) {
                in[1].shape[1] = 7;
                in[2].shape[1] = 8;
                n = 3;
            } else if (k == S_PERMUTE) {
                in[0] = (nbt_input){.dtype = dt, .ndim = 3, .shape = {3, 5, 7}};
            } else if (k == S_EXPAND) {
                in[1] = (nbt_input){.dtype = dt, .ndim = 3, .shape = {5, 4, 6}};
                n = 2;
            }
            nbt_parity_opts o = {.tol = tol_of(dt)};
            char name[96];
            snprintf(name, sizeof name, "%s %s", shape_names[k], nb_dtype_name(dt));
            nbt_parity(name, shape_op, &k, n, in, &o);
        }
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("cuda_elementwise");
    TCase *tc = nbt_tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_unary);
    tcase_add_test(tc, test_unary_table);
    tcase_add_test(tc, test_binary_float);
    tcase_add_test(tc, test_binary_int);
    tcase_add_test(tc, test_where);
    tcase_add_test(tc, test_casts);
    tcase_add_test(tc, test_fill);
    tcase_add_test(tc, test_axpy_scale);
    tcase_add_test(tc, test_offset_views);
    tcase_add_test(tc, test_shape_ops);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    nbt_cuda_require();
    return nbt_run(suite());
}
