/* CUDA reductions and the softmax family against the CPU
 * (tests/cuda_parity.h), through the public ops: sum, mean, max and var
 * over various axes and row shapes (one thread, one warp, one block per
 * row, and rows split across blocks), softmax and log-softmax on every
 * axis (rows and column tiles), the causal softmax of attention and the
 * fused causal attention,
 * cross-entropy with ignore_index and label
 * smoothing, mse and bce; the gradient norm of many tensors; argmax on
 * every row layout, with ties and NaNs; and the
 * deferred check of an out-of-range cross-entropy target. Skipped (77)
 * without CUDA or a GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_parity.h"
#include "tensor/internal.h" /* nb__causal_attention */

static const nb_dtype float_dtypes[] = {NB_F32, NB_BF16, NB_F16, NB_F64};
#define N_FLOAT_DTYPES 4

/* ---- sum, mean, max, var ---- */
typedef enum red_kind { R_SUM, R_MEAN, R_MAX, R_VAR } red_kind;
static const char *const red_names[] = {"sum", "mean", "max", "var"};

typedef struct red_case {
    red_kind kind;
    int naxes;
    int axes[3];
    bool keepdim;
    int correction;
} red_case;

static nb_tensor *reduce_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const red_case *c = user;
    switch (c->kind) {
    case R_SUM: return nb_sum(ctx, in[0], c->naxes, c->axes, c->keepdim);
    case R_MEAN: return nb_mean(ctx, in[0], c->naxes, c->axes, c->keepdim);
    case R_MAX: return nb_max(ctx, in[0], c->naxes, c->axes, c->keepdim);
    default: return nb_var(ctx, in[0], c->naxes, c->axes, c->correction, c->keepdim);
    }
}

typedef struct red_shape {
    const char *name;
    int ndim;
    int64_t shape[3];
    bool transposed;
    int naxes;
    int axes[3];
    bool big; /* f32 and f64 only (the CPU reference is slow, bf16 has ties) */
} red_shape;

static const red_shape red_shapes[] = {
    {"(7, 33, 5) axis 1", 3, {7, 33, 5}, false, 1, {1}, false},
    {"(7, 33, 5) axes 0, 2", 3, {7, 33, 5}, false, 2, {0, 2}, false},
    {"(7, 33, 5) axis -1", 3, {7, 33, 5}, false, 1, {-1}, false},
    {"(7, 33, 5) all", 3, {7, 33, 5}, false, 0, {0}, false},
    {"(1000, 3) axis 1: a thread per row", 2, {1000, 3}, false, 1, {1}, false},
    {"(1000, 3) axis 0: a warp per row", 2, {1000, 3}, false, 1, {0}, false},
    {"(5, 1) axis 1: rows of one", 2, {5, 1}, false, 1, {1}, false},
    {"(33, 7) transposed axis 0", 2, {33, 7}, true, 1, {0}, false},
    {"(3, 1500) axis 1: a block per row", 2, {3, 1500}, false, 1, {1}, false},
    {"(300, 1100) axis 1: blocks over many rows", 2, {300, 1100}, false, 1, {1}, true},
    {"(2, 70001) axis 1: split rows", 2, {2, 70001}, false, 1, {1}, true},
    {"(200003) all: one split row", 1, {200003}, false, 0, {0}, true},
};

START_TEST(test_reductions) {
    for (int kind = R_SUM; kind <= R_VAR; kind++)
        for (size_t k = 0; k < sizeof red_shapes / sizeof red_shapes[0]; k++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++)
                for (int keep = 0; keep < 2; keep++) {
                    const red_shape *rs = &red_shapes[k];
                    nb_dtype dt = float_dtypes[d];
                    if (rs->big && (dt == NB_BF16 || dt == NB_F16 || keep)) continue;
                    red_case c = {(red_kind)kind, rs->naxes, {rs->axes[0], rs->axes[1], rs->axes[2]},
                                  keep == 1, kind == R_VAR ? 1 : 0};
                    nbt_input in = {.dtype = dt, .ndim = rs->ndim, .transposed = rs->transposed};
                    for (int i = 0; i < rs->ndim; i++) in.shape[i] = rs->shape[i];
                    char name[160];
                    snprintf(name, sizeof name, "%s %s %s%s", red_names[kind], rs->name,
                             nb_dtype_name(dt), keep ? " keepdim" : "");
                    nbt_parity(name, reduce_op, &c, 1, &in, NULL);
                }
}
END_TEST

START_TEST(test_var_corrections) {
    /* correction 0, and a denominator <= 0 (NaN on both sides) */
    for (int corr = 0; corr <= 2; corr += 2) {
        red_case c = {R_VAR, 1, {1, 0, 0}, false, corr};
        nbt_input in = {.dtype = NB_F32, .ndim = 2, .shape = {9, corr ? 2 : 40}};
        nbt_parity_opts o = {.no_backward = corr != 0};
        nbt_parity(corr ? "var with n - correction = 0" : "var correction 0", reduce_op, &c, 1,
                   &in, &o);
    }
}
END_TEST

/* ---- softmax family ---- */
typedef struct softmax_case {
    bool take_log;
    int axis;
} softmax_case;

static nb_tensor *softmax_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const softmax_case *c = user;
    return c->take_log ? nb_log_softmax(ctx, in[0], c->axis) : nb_softmax(ctx, in[0], c->axis);
}

START_TEST(test_softmax) {
    static const struct {
        int ndim;
        int64_t shape[3];
        bool transposed;
        double scale;
    } shapes[] = {
        {3, {7, 33, 5}, false, 3},     {2, {64, 10}, false, 3},  {2, {4, 1500}, false, 3},
        {3, {3, 2000, 2}, false, 3},   {2, {33, 7}, true, 3},    {2, {6, 1}, false, 3},
        {2, {8, 100}, false, 20}, /* large logits */
        /* rows held in registers (Note [Rows in registers]): 8, 16, 32 per lane */
        {2, {4, 200}, false, 3},       {2, {3, 300}, false, 3},  {2, {5, 1000}, false, 3},
        {2, {2, 1024}, false, 3},
    };
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
        for (int axis = -1; axis < shapes[k].ndim; axis++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++)
                for (int lg = 0; lg < 2; lg++) {
                    softmax_case c = {lg == 1, axis};
                    nbt_input in = {.dtype = float_dtypes[d], .ndim = shapes[k].ndim,
                                    .lo = -shapes[k].scale, .hi = shapes[k].scale,
                                    .transposed = shapes[k].transposed};
                    for (int i = 0; i < shapes[k].ndim; i++) in.shape[i] = shapes[k].shape[i];
                    char name[128];
                    snprintf(name, sizeof name, "%s shape #%zu axis %d %s",
                             lg ? "log_softmax" : "softmax", k, axis,
                             nb_dtype_name(float_dtypes[d]));
                    nbt_parity(name, softmax_op, &c, 1, &in, NULL);
                }
}
END_TEST

/* Rows with special values, as the CPU treats them: all -inf (NaN), a
 * +inf (the whole row NaN: exp(inf - inf)), a NaN (NaN), some -inf among
 * finite values (zeros there), +inf and -inf together, and a plain row.
 * K = 5 and 1000 (a warp per row, in registers), 1500 (a block per row),
 * and the same rows as
 * columns of a (K, 8, 3) tensor (column tiles, softmax over axis 0). */
#define SPECIAL_ROWS 8
static double special_value(int r, int64_t j, int64_t k) {
    double v = 3 * sin(0.7 * (double)(j + 1) + r);
    switch (r) {
    case 0: return -INFINITY;
    case 1: return j == 1 ? INFINITY : v;
    case 2: return j == k - 1 ? NAN : v;
    case 3: return j == 0 || j == 2 ? -INFINITY : v;
    case 4: return j == 0 || j == k - 1 ? INFINITY : v;
    case 5: return v;
    case 6: return j == k / 2 ? v : -INFINITY;
    default: return j == 0 ? -INFINITY : j == 1 ? INFINITY : v;
    }
}

START_TEST(test_softmax_special_values) {
    static const int64_t ks[] = {5, 1000, 1500};
    for (size_t q = 0; q < sizeof ks / sizeof ks[0]; q++) {
        int64_t k = ks[q];
        double *rows = malloc(sizeof(double) * SPECIAL_ROWS * (size_t)k);
        double *cols = malloc(sizeof(double) * SPECIAL_ROWS * 3 * (size_t)k);
        for (int r = 0; r < SPECIAL_ROWS; r++)
            for (int64_t j = 0; j < k; j++) {
                rows[r * k + j] = special_value(r, j, k);
                for (int c = 0; c < 3; c++) /* (K, 8, 3): column (r, c) is row r */
                    cols[(j * SPECIAL_ROWS + r) * 3 + c] = special_value(r, j, k);
            }
        for (int d = 0; d < N_FLOAT_DTYPES; d++)
            for (int lg = 0; lg < 2; lg++) {
                char name[128];
                softmax_case c = {lg == 1, 1};
                nbt_input in = {.dtype = float_dtypes[d], .ndim = 2, .shape = {SPECIAL_ROWS, k},
                                .values = rows};
                snprintf(name, sizeof name, "%s special rows K=%lld %s",
                         lg ? "log_softmax" : "softmax", (long long)k,
                         nb_dtype_name(float_dtypes[d]));
                nbt_parity(name, softmax_op, &c, 1, &in, NULL);
                softmax_case c0 = {lg == 1, 0};
                nbt_input inc = {.dtype = float_dtypes[d], .ndim = 3,
                                 .shape = {k, SPECIAL_ROWS, 3}, .values = cols};
                snprintf(name, sizeof name, "%s special columns K=%lld %s",
                         lg ? "log_softmax" : "softmax", (long long)k,
                         nb_dtype_name(float_dtypes[d]));
                nbt_parity(name, softmax_op, &c0, 1, &inc, NULL);
            }
        free(rows);
        free(cols);
    }
}
END_TEST

typedef struct ce_case {
    int64_t ignore;
    double eps;
} ce_case;

static nb_tensor *ce_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const ce_case *c = user;
    nb_cross_entropy_opts o = {c->ignore, c->eps};
    return nb_cross_entropy(ctx, in[0], in[1], &o);
}

START_TEST(test_cross_entropy) {
    static const int64_t sizes[][2] = {{16, 10}, {33, 7}, {5, 1500}, {2, 3000}, {1, 1}};
    static const ce_case cases[] = {{-100, 0.0}, {-100, 0.1}, {2, 0.25}, {-100, 1.0}};
    static double tv[64];
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++)
                for (int ti = 0; ti < 2; ti++) {
                    int64_t n = sizes[s][0], c = sizes[s][1];
                    /* targets cycle through the classes; every third is the ignore index */
                    for (int64_t i = 0; i < n; i++)
                        tv[i] = i % 3 == 1 ? (double)cases[k].ignore : (double)((i * 7) % c);
                    nbt_input in[2] = {
                        {.dtype = float_dtypes[d], .ndim = 2, .shape = {n, c}, .lo = -4, .hi = 4,
                         .transposed = ti == 1 && n > 1 && c > 1},
                        {.dtype = ti ? NB_I32 : NB_I64, .ndim = 1, .shape = {n}, .values = tv},
                    };
                    char name[128];
                    snprintf(name, sizeof name, "cross_entropy (%lld, %lld) ignore %lld eps %g %s %s",
                             (long long)n, (long long)c, (long long)cases[k].ignore, cases[k].eps,
                             nb_dtype_name(float_dtypes[d]), nb_dtype_name(in[1].dtype));
                    nbt_parity(name, ce_op, (void *)&cases[k], 2, in, NULL);
                }
}
END_TEST

/* Logits rows with special values (special_value): every row counted
 * (the loss is NaN on both sides; the gradient rows are compared), then
 * only the rows with finite log-sum-exp counted (a finite loss without
 * smoothing; with it, row 3's -inf logits make the loss +inf on both sides). */
START_TEST(test_cross_entropy_special_values) {
    static const int64_t ks[] = {5, 1000, 1500};
    static double tv[SPECIAL_ROWS], tv_ign[SPECIAL_ROWS];
    for (size_t q = 0; q < sizeof ks / sizeof ks[0]; q++) {
        int64_t k = ks[q];
        double *x = malloc(sizeof(double) * SPECIAL_ROWS * (size_t)k);
        for (int r = 0; r < SPECIAL_ROWS; r++) {
            for (int64_t j = 0; j < k; j++) x[r * k + j] = special_value(r, j, k);
            tv[r] = (double)((r * 3 + 1) % k);
            tv_ign[r] = r == 3 || r == 5 || r == 6 ? tv[r] : -100;
        }
        tv_ign[3] = 1; /* a finite logit of row 3 */
        tv_ign[6] = (double)(k / 2);
        for (int d = 0; d < N_FLOAT_DTYPES; d++)
            for (int ign = 0; ign < 2; ign++)
                for (int e = 0; e < 2; e++) {
                    ce_case c = {-100, e ? 0.1 : 0.0};
                    nbt_input in[2] = {
                        {.dtype = float_dtypes[d], .ndim = 2, .shape = {SPECIAL_ROWS, k},
                         .values = x},
                        {.dtype = NB_I64, .ndim = 1, .shape = {SPECIAL_ROWS},
                         .values = ign ? tv_ign : tv},
                    };
                    char name[128];
                    snprintf(name, sizeof name, "cross_entropy special rows K=%lld%s eps %g %s",
                             (long long)k, ign ? " (finite rows only)" : "", c.eps,
                             nb_dtype_name(float_dtypes[d]));
                    nbt_parity(name, ce_op, &c, 2, in, NULL);
                }
        free(x);
    }
}
END_TEST

START_TEST(test_cross_entropy_all_ignored) {
    /* 0/0: NaN loss on both sides, zero gradient */
    static const double tv[4] = {-100, -100, -100, -100};
    ce_case c = {-100, 0.0};
    nbt_input in[2] = {{.dtype = NB_F32, .ndim = 2, .shape = {4, 6}},
                       {.dtype = NB_I64, .ndim = 1, .shape = {4}, .values = tv}};
    nbt_parity("cross_entropy all ignored", ce_op, &c, 2, in, NULL);
}
END_TEST

static nb_tensor *pair_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return *(const int *)user ? nb_bce_with_logits(ctx, in[0], in[1]) : nb_mse_loss(ctx, in[0], in[1]);
}

START_TEST(test_mse_bce) {
    static const int kinds[] = {0, 1};
    static const int64_t sizes[][2] = {{7, 33}, {1, 5}, {3, 100003}};
    for (int kind = 0; kind < 2; kind++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++)
                for (int t = 0; t < 2; t++) {
                    nb_dtype dt = float_dtypes[d];
                    nbt_input in[2] = {
                        {.dtype = dt, .ndim = 2, .shape = {sizes[s][0], sizes[s][1]}, .lo = -3,
                         .hi = 3, .transposed = t == 1},
                        /* bce targets are probabilities, and get no gradient */
                        {.dtype = dt, .ndim = 2, .shape = {sizes[s][0], sizes[s][1]},
                         .lo = kind ? 0 : -3, .hi = kind ? 1 : 3, .no_grad = kind == 1},
                    };
                    char name[128];
                    snprintf(name, sizeof name, "%s (%lld, %lld) %s%s", kind ? "bce" : "mse",
                             (long long)sizes[s][0], (long long)sizes[s][1], nb_dtype_name(dt),
                             t ? " transposed" : "");
                    nbt_parity(name, pair_op, (void *)&kinds[kind], 2, in, NULL);
                }
}
END_TEST

/* ---- gradient norm (sum of squares of many tensors) ---- */
START_TEST(test_grad_norm) {
    /* 40 parameters (more than one launch's batch), sizes 1 .. 40000;
     * loss = sum(p * p) / 2 makes each gradient equal to its parameter */
    enum { NP = 40 };
    nb_ctx *ctx = nb_ctx_new(nbt_device(), 0);
    nb_named_tensor params[NP];
    double expect = 0;
    nb_tensor *loss = NULL;
    for (int i = 0; i < NP; i++) {
        int64_t n = i == 0 ? 1 : (int64_t)((i * 997) % 40000) + 1;
        double *v = malloc(sizeof(double) * (size_t)n);
        for (int64_t j = 0; j < n; j++) {
            v[j] = sin((double)(j + 1) * (i + 1) * 0.37);
            expect += v[j] * v[j];
        }
        nb_tensor *p = nb_from_host(ctx, NB_F64, 1, &n, v);
        free(v);
        nb_set_requires_grad(p, true);
        params[i].name = "p";
        params[i].tensor = p;
        nb_tensor *term = nb_mul_scalar(ctx, nb_sum_all(ctx, nb_mul(ctx, p, p)), 0.5);
        loss = loss ? nb_add(ctx, loss, term) : term;
    }
    nb_backward(loss);
    double norm = nb_clip_grad_norm(params, NP, 1e30, 2.0);
    ck_assert_msg(fabs(norm - sqrt(expect)) <= 1e-12 * sqrt(expect), "norm %.17g, expected %.17g",
                  norm, sqrt(expect));
    nb_ctx_free(ctx);
}
END_TEST

/* ---- deferred target check ---- */
START_TEST(test_cross_entropy_bad_target) {
    /* Runs last, in its own case. The fault is reported once: the slot is
     * cleared before the abort, so the next read goes on (garbage value). */
    NBT_DEVICE_ONLY("a deferred device fault");
    nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
    static const float xv[4 * 5] = {0.5f, -1, 2, 0, 1, 1, 1, 1, 1, 1, 3, 2, 1, 0, -1, 0, 0, 0, 0, 0};
    static const int64_t tv[4] = {0, 7, -100, 2};
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(4, 5), xv);
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(4), tv);
    nb_tensor *loss = nb_cross_entropy(ctx, x, t, NULL);
    NBT_EXPECT_ABORT(nb_cuda_synchronize(nb_cuda(0)), "nb_cross_entropy");
    (void)nb_item(loss);
    nb_ctx_free(ctx);
}
END_TEST

/* The fused causal attention (nb__causal_attention; on CUDA
 * tensor/cuda/attention.cu, cuDNN's for bf16 where NABLA_CUDA_ATTENTION
 * allows) against the CPU's in f64: y and the gradient of qkv, with T odd
 * and not a multiple of the tiles, head dimensions 32 to 128 and 40,
 * 1-3 heads, batch 1-2. */
typedef struct attention_case {
    int h;
    double scale;
} attention_case;

static nb_tensor *op_attention(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const attention_case *c = user;
    nb_tensor *y = nb__causal_attention(ctx, in[0], c->h, c->scale);
    ck_assert_msg(y != NULL, "%s: no fused attention for %s %s", nb_device_name(in[0]->device),
                  nb_dtype_name(in[0]->dtype), nb_shape_str(in[0]));
    return y;
}

START_TEST(test_causal_attention) {
    static const struct { int64_t n, t; int h; int64_t d; } cases[] = {
        {1, 1, 1, 32}, {2, 37, 3, 32}, {1, 77, 2, 64}, {1, 50, 1, 128}, {2, 130, 2, 64}, {1, 33, 3, 40},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int d = 0; d < 2; d++) {
            nb_dtype dt = d ? NB_BF16 : NB_F32;
            if (!nbt_dtype_runs(dt)) continue;
            attention_case c = {cases[k].h, 1 / sqrt((double)cases[k].d)};
            nbt_input in = {.dtype = dt, .ndim = 3, .lo = -2, .hi = 2,
                            .shape = {cases[k].n, cases[k].t, 3 * cases[k].h * cases[k].d}};
            char name[96];
            snprintf(name, sizeof name, "causal attention N %lld T %lld H %d D %lld %s",
                     (long long)cases[k].n, (long long)cases[k].t, cases[k].h,
                     (long long)cases[k].d, nb_dtype_name(dt));
            nbt_parity(name, op_attention, &c, 1, &in, NULL);
        }
}
END_TEST

/* nb_softmax_causal on CUDA (tensor/cuda/softmax_causal.cu) against the
 * CPU's kernel: square, wide and tall score matrices with batch dims (a
 * warp per row) in f32, bf16 and f64; a negative scale; rows longer than
 * 1024 (a block per row), wide (T = 3, S = 1500: short kept prefixes, long
 * zero tails) and square (T = S = 1100: long kept prefixes). */
static nb_tensor *op_softmax_causal(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return nb_softmax_causal(ctx, in[0], *(const double *)user);
}

START_TEST(test_softmax_causal) {
    typedef struct causal_case {
        int64_t shape[4];
        double scale;
        int ndt;
        nb_dtype dts[3];
    } causal_case;
    static const causal_case cases[] = {
        {{2, 3, 16, 16}, 0.125, 3, {NB_F32, NB_BF16, NB_F64}},
        {{1, 2, 5, 33}, 0.125, 3, {NB_F32, NB_BF16, NB_F64}},
        {{1, 1, 40, 7}, 0.125, 3, {NB_F32, NB_BF16, NB_F64}},
        {{2, 3, 9, 9}, -0.7, 2, {NB_F32, NB_F64}},
        {{2, 1, 3, 1500}, -0.5, 3, {NB_F32, NB_BF16, NB_F64}},
        {{1, 1, 1100, 1100}, 0.3, 1, {NB_F32}},
        /* rows in registers (Note [Rows in registers]): 8, 16, 32 per lane */
        {{1, 2, 200, 200}, 0.125, 2, {NB_F32, NB_BF16}},
        {{1, 1, 300, 500}, 0.125, 2, {NB_F32, NB_F64}},
        {{1, 1, 1024, 1024}, 0.125, 2, {NB_F32, NB_BF16}},
        {{1, 1, 1000, 1000}, -0.3, 1, {NB_F64}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int d = 0; d < cases[k].ndt; d++) {
            nbt_input in = {.dtype = cases[k].dts[d], .ndim = 4, .lo = -4, .hi = 4};
            for (int i = 0; i < 4; i++) in.shape[i] = cases[k].shape[i];
            char name[96];
            snprintf(name, sizeof name, "softmax_causal case %zu (scale %g) %s", k,
                     cases[k].scale, nb_dtype_name(in.dtype));
            nbt_parity(name, op_softmax_causal, (void *)&cases[k].scale, 1, &in, NULL);
        }
}
END_TEST

/* Causal rows with special values among the kept entries (+inf: NaN
 * row; -inf: zero there; NaN: NaN row; all kept -inf: NaN row) and NaN
 * and +inf in the masked entries, which are never read: S = 6 and 700 (a
 * warp per row, in registers) and S = 1500 (a block per row), both signs
 * of the scale. */
static double causal_special(int64_t i, int64_t j, int64_t s) {
    double v = 3 * sin(0.9 * (double)(i * s + j + 1));
    if (j > i) return j % 2 ? NAN : INFINITY; /* masked */
    switch (i % 6) {
    case 0: return -INFINITY;
    case 1: return j == 1 ? INFINITY : v;
    case 2: return j == 0 ? -INFINITY : v;
    case 3: return j == 2 ? NAN : v;
    case 4: return j == 0 || j == i ? INFINITY : v;
    default: return v;
    }
}

START_TEST(test_softmax_causal_special_values) {
    static const int64_t ss[] = {6, 700, 1500};
    static const double scales[] = {0.5, -0.5};
    for (size_t q = 0; q < sizeof ss / sizeof ss[0]; q++) {
        int64_t t = 6, s = ss[q];
        double *x = malloc(sizeof(double) * (size_t)(t * s));
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < s; j++) x[i * s + j] = causal_special(i, j, s);
        for (int sc = 0; sc < 2; sc++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++) {
                nbt_input in = {.dtype = float_dtypes[d], .ndim = 4, .shape = {1, 1, t, s},
                                .values = x};
                char name[96];
                snprintf(name, sizeof name, "softmax_causal special S=%lld scale %g %s",
                         (long long)s, scales[sc], nb_dtype_name(in.dtype));
                nbt_parity(name, op_softmax_causal, (void *)&scales[sc], 1, &in, NULL);
            }
        free(x);
    }
}
END_TEST

/* ---- argmax ----
 * The inputs are rounded to the dtype under test before the f64 reference
 * sees them, so ties and NaNs are the same on both sides and the indices
 * must agree exactly (integer outputs), whatever the tree of combines. */
typedef struct argmax_case {
    int dim;
    bool keepdim;
} argmax_case;

static nb_tensor *argmax_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const argmax_case *c = user;
    return nb_argmax(ctx, in[0], c->dim, c->keepdim);
}

START_TEST(test_argmax) {
    size_t most = 0;
    for (size_t k = 0; k < sizeof red_shapes / sizeof red_shapes[0]; k++) {
        size_t n = 1;
        for (int i = 0; i < red_shapes[k].ndim; i++) n *= (size_t)red_shapes[k].shape[i];
        most = n > most ? n : most;
    }
    /* ties: few distinct values, the maximum many times in every row;
     * nans: the same with a NaN now and then (the first one wins) */
    double *ties = malloc(most * sizeof *ties), *nans = malloc(most * sizeof *nans);
    ck_assert(ties && nans);
    for (size_t i = 0; i < most; i++) {
        ties[i] = (double)((i * i + 3 * i) % 7);
        nans[i] = (i * 31) % 1009 == 500 ? NAN : ties[i];
    }
    const double *values[3] = {NULL, ties, nans};
    static const char *const value_names[3] = {"random", "ties", "NaNs"};
    for (size_t k = 0; k < sizeof red_shapes / sizeof red_shapes[0]; k++)
        for (int v = 0; v < 3; v++)
            for (int d = 0; d < N_FLOAT_DTYPES; d++)
                for (int keep = 0; keep < 2; keep++) {
                    const red_shape *rs = &red_shapes[k];
                    nb_dtype dt = float_dtypes[d];
                    if (rs->naxes != 1 || (rs->big && keep)) continue;
                    if (v > 0 && rs->transposed) continue; /* values are given in the made layout */
                    argmax_case c = {rs->axes[0], keep == 1};
                    nbt_input in = {.dtype = dt, .ndim = rs->ndim, .transposed = rs->transposed,
                                    .no_grad = true, .values = values[v]};
                    for (int i = 0; i < rs->ndim; i++) in.shape[i] = rs->shape[i];
                    char name[160];
                    snprintf(name, sizeof name, "argmax %s %s %s%s", rs->name, value_names[v],
                             nb_dtype_name(dt), keep ? " keepdim" : "");
                    nbt_parity(name, argmax_op, &c, 1, &in, NULL);
                }
    free(ties), free(nans);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("cuda_reduce");
    TCase *tc = nbt_tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_reductions);
    tcase_add_test(tc, test_var_corrections);
    tcase_add_test(tc, test_softmax);
    tcase_add_test(tc, test_softmax_special_values);
    tcase_add_test(tc, test_softmax_causal);
    tcase_add_test(tc, test_softmax_causal_special_values);
    tcase_add_test(tc, test_causal_attention);
    tcase_add_test(tc, test_cross_entropy);
    tcase_add_test(tc, test_cross_entropy_special_values);
    tcase_add_test(tc, test_cross_entropy_all_ignored);
    tcase_add_test(tc, test_mse_bce);
    tcase_add_test(tc, test_grad_norm);
    tcase_add_test(tc, test_argmax);
    suite_add_tcase(s, tc);
    TCase *faults = nbt_tcase_create("faults");
    tcase_add_test(faults, test_cross_entropy_bad_target);
    suite_add_tcase(s, faults);
    return s;
}

int main(void) {
    nbt_cuda_require();
    return nbt_run(suite());
}
