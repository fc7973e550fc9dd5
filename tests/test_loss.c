/* Losses: cross-entropy against a naive double reference (ignore_index,
 * label smoothing, i32/i64 targets, all-ignored NaN, large logits), MSE
 * and BCE-with-logits against their formulas (BCE for large |x| too),
 * gradchecks including non-contiguous inputs, and error messages. The
 * fused classifier (Note [Fused classifier] in tensor/ops_loss.c): its
 * gradient for g = 1 bitwise the unfused one, for any g by gradcheck,
 * and the logits written only when a backward can come. */
#include <math.h>
#include <string.h>

#include "tensor/internal.h" /* nb__cross_entropy_fused, scopes */
#include "testutil.h"

/* ---- cross-entropy ---- */
/* PyTorch's definition, written from the per-class log-probabilities. */
static double ref_cross_entropy(const double *x, const int64_t *t, int64_t n, int64_t c,
                                int64_t ignore, double eps) {
    double total = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (t[i] == ignore) continue;
        const double *row = x + i * c;
        double mx = row[0];
        for (int64_t j = 1; j < c; j++) mx = fmax(mx, row[j]);
        double s = 0;
        for (int64_t j = 0; j < c; j++) s += exp(row[j] - mx);
        double smooth = 0;
        for (int64_t j = 0; j < c; j++) smooth += -(row[j] - mx - log(s));
        total += (1 - eps) * -(row[t[i]] - mx - log(s)) + eps / (double)c * smooth;
        count++;
    }
    return total / (double)count;
}

static nb_tensor *targets_tensor(nb_ctx *ctx, nb_dtype dt, int64_t n, const int64_t *t) {
    nb_tensor *out = nb_empty(ctx, dt, 1, &n);
    for (int64_t i = 0; i < n; i++) nb_set(out, &i, (double)t[i]);
    return out;
}

START_TEST(test_ce_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t t[6] = {0, 4, -100, 2, 1, 2};
    double xv[30];
    static const struct {
        int64_t ignore;
        double eps;
        bool null_opts;
    } cases[] = {{-100, 0.0, true}, {-100, 0.0, false}, {-100, 0.1, false}, {2, 0.25, false},
                 {-100, 1.0, false}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        NBT_FOR_F64_F32(dti, dt) {
            nb_tensor *x = nb_mul_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(6, 5), 40 + k), 2.0);
            nb_to_host_f64(x, xv);
            nb_tensor *tt = targets_tensor(ctx, dti ? NB_I32 : NB_I64, 6, t);
            int64_t ignore = cases[k].ignore;
            if (ignore == 2) { /* an in-range ignore index; -100 is now a bad target */
                int64_t i = 2, v = 3;
                nb_set(tt, &i, (double)v);
            }
            int64_t tv[6];
            for (int64_t i = 0; i < 6; i++) tv[i] = (int64_t)nb_get(tt, &i);
            nb_cross_entropy_opts o = {ignore, cases[k].eps};
            nb_tensor *loss = nb_cross_entropy(ctx, x, tt, cases[k].null_opts ? NULL : &o);
            ck_assert(loss->ndim == 0 && loss->dtype == dt);
            double e = ref_cross_entropy(xv, tv, 6, 5, ignore, cases[k].eps);
            nbt_assert_close(loss, &e, dti ? 1e-6 : 1e-14, dti ? 1e-5 : 1e-12);
        }
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_ce_large_logits_and_all_ignored) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    /* row (1000, 0, -1000) target 1: loss 1000 exactly (to f32 precision) */
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(2, 3),
                                (float[]){1000.0f, 0.0f, -1000.0f, 50.0f, 50.0f, 50.0f});
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){1, 2});
    double e = (1000.0 + log(3.0)) / 2;
    nbt_assert_close(nb_cross_entropy(ctx, x, t, NULL), &e, 1e-4, 1e-6);

    /* all ignored: 0 / 0 as in PyTorch; the gradient is zero */
    nb_tensor *xl = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 5);
    nb_tensor *ti = nb_from_host(ctx, NB_I32, NB_SHAPE(2), (int32_t[]){-100, -100});
    nb_tensor *loss = nb_cross_entropy(ctx, xl, ti, NULL);
    ck_assert(isnan(nb_item(loss)));
    nb_backward(loss);
    double z[6] = {0};
    nbt_assert_close(xl->grad, z, 0, 0);
    nb_ctx_free(ctx);
}
END_TEST

/* Gradient of the mean loss over 3 rows of 4, targets tv (-100 ignored;
 * two counted): (softmax - smoothed one-hot) / 2. */
static void ce_grad_3x4(const double *xv, const int64_t *tv, double eps, double *e) {
    for (int i = 0; i < 3; i++) {
        double s = 0;
        for (int j = 0; j < 4; j++) s += exp(xv[i * 4 + j]);
        for (int j = 0; j < 4; j++) {
            double target = eps / 4 + (j == tv[i] ? 1 - eps : 0.0);
            e[i * 4 + j] = tv[i] == -100 ? 0 : (exp(xv[i * 4 + j]) / s - target) / 2;
        }
    }
}

START_TEST(test_ce_grad_closed_form) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 8);
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(3), (int64_t[]){3, -100, 0});
    nb_cross_entropy_opts o = {-100, 0.2};
    nb_backward(nb_cross_entropy(ctx, x, t, &o));
    double xv[12], e[12];
    nb_to_host_f64(x, xv);
    ce_grad_3x4(xv, (int64_t[]){3, -100, 0}, 0.2, e);
    nbt_assert_close(x->grad, e, 1e-14, 1e-12);
    nb_ctx_free(ctx);
}
END_TEST

typedef struct ce_case {
    nb_tensor *targets;
    nb_cross_entropy_opts opts;
    bool transpose;
} ce_case;

static nb_tensor *ce_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    ce_case *c = user;
    nb_tensor *x = c->transpose ? nb_transpose(ctx, in[0], 0, 1) : in[0];
    return nb_cross_entropy(ctx, x, c->targets, &c->opts);
}

/* ---- the fused classifier ---- */
/* The loss of logits the library makes (x * 1 inside a scope, as
 * nb_gpt_forward_loss's are), through the fused entry; *fused says whether
 * the forward wrote the gradient (its node keeps no lse). */
static nb_tensor *fused_loss(nb_ctx *ctx, nb_tensor *x, nb_tensor *t,
                             const nb_cross_entropy_opts *o, nb_dtype dt, bool *fused) {
    nb__scope_enter(ctx);
    nb_tensor *logits = dt == x->dtype ? nb_mul_scalar(ctx, x, 1.0) : nb_cast(ctx, x, dt);
    nb_tensor *loss = nb__cross_entropy_fused(ctx, logits, t, o);
    if (fused) *fused = loss->node && loss->node->saved[0] && !loss->node->saved[2];
    nb__scope_exit(ctx, loss);
    return loss;
}

static nb_tensor *plain_loss(nb_ctx *ctx, nb_tensor *x, nb_tensor *t,
                             const nb_cross_entropy_opts *o, nb_dtype dt) {
    nb_tensor *logits = dt == x->dtype ? nb_mul_scalar(ctx, x, 1.0) : nb_cast(ctx, x, dt);
    return nb_cross_entropy(ctx, logits, t, o);
}

static nb_tensor *fused_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    ce_case *c = user;
    nb_tensor *x = c->transpose ? nb_transpose(ctx, in[0], 0, 1) : in[0];
    bool fused = false;
    nb_tensor *loss = fused_loss(ctx, x, c->targets, &c->opts, x->dtype, &fused);
    ck_assert(fused || !nb_grad_enabled());
    return loss;
}

/* the plain loss, and the fused one for any g: gradcheck weighs the loss
 * by a random factor, so the backward scales the forward's gradient (one
 * pass, in place) */
START_TEST(test_ce_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(4), (int64_t[]){2, -100, 0, 4});
    nb_tensor *t32 = nb_from_host(ctx, NB_I32, NB_SHAPE(4), (int32_t[]){1, 1, 3, 0});
    ce_case cases[] = {
        {t, {-100, 0.0}, false}, {t, {-100, 0.3}, false}, {t, {-100, 0.1}, true},
        {t32, {1, 0.2}, false},  {t32, {-100, 0.0}, true},
    };
    for (size_t k = 0; k < 2 * (sizeof cases / sizeof cases[0]); k++) {
        ce_case *c = &cases[k / 2];
        nb_tensor *x = c->transpose ? nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(5, 4), 60 + k)
                                    : nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 5), 60 + k);
        NBT_GRADCHECK(k % 2 ? fused_fn : ce_fn, c, 1, &x);
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_f32_backward) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(4), (int64_t[]){2, -100, 0, 4});
    nb_cross_entropy_opts o = {-100, 0.1};
    nb_tensor *x64, *x32;
    nbt_twin_leaves(ctx, NB_SHAPE(4, 5), 400, &x64, &x32);
    nb_backward(nb_cross_entropy(ctx, x64, t, &o));
    nb_backward(nb_cross_entropy(ctx, x32, t, &o));
    nbt_assert_tensors_close(x32->grad, x64->grad, 1e-6, 1e-5);
    nb_tensor *y64 = nb_rand_uniform(ctx, NB_F64, NB_SHAPE(4, 5), 0, 1, NULL);
    nb_tensor *y32 = nb_cast(ctx, y64, NB_F32);
    nb_zero_grad(x64);
    nb_zero_grad(x32);
    nb_backward(nb_bce_with_logits(ctx, x64, y64));
    nb_backward(nb_bce_with_logits(ctx, x32, y32));
    nbt_assert_tensors_close(x32->grad, x64->grad, 1e-6, 1e-5);
    nb_ctx_free(ctx);
}
END_TEST

/* g = 1 (nb_backward(loss): no kernel in the backward): loss and gradient
 * bitwise the unfused ones, in f64, f32 and bf16 logits; g = 0.37 (a
 * scaled loss: the scaling pass) within rounding of the unfused one. */
START_TEST(test_ce_fused_matches_unfused) {
    static const struct {
        nb_dtype dt;
        int64_t ignore;
        double eps;
    } cases[] = {{NB_F64, -100, 0.0}, {NB_F32, -100, 0.0}, {NB_F32, 3, 0.1},
                 {NB_F32, -100, 0.25}, {NB_BF16, -100, 0.0}, {NB_BF16, 3, 0.1}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const int64_t tv[6] = {0, 4, cases[k].ignore, 3, 1, 2};
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
        nb_dtype dt = cases[k].dt, leaf = dt == NB_F64 ? NB_F64 : NB_F32;
        if (dt == NB_BF16) nb_ctx_set_compute_dtype(ctx, NB_BF16);
        nb_tensor *x = nbt_randn_leaf(ctx, leaf, NB_SHAPE(6, 7), 90 + k);
        nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(6), tv);
        nb_cross_entropy_opts o = {cases[k].ignore, cases[k].eps};
        double lp, lf, gp[42], gf[42];
        for (int scaled = 0; scaled < 2; scaled++) {
            nb_zero_grad(x);
            nb_tensor *loss = plain_loss(ctx, x, t, &o, dt);
            lp = nb_item(loss);
            nb_backward(scaled ? nb_mul_scalar(ctx, loss, 0.37) : loss);
            nb_to_host_f64(x->grad, gp);
            nb_zero_grad(x);
            bool fused = false;
            loss = fused_loss(ctx, x, t, &o, dt, &fused);
            ck_assert_msg(fused, "case %zu: the forward did not write the gradient", k);
            lf = nb_item(loss);
            nb_backward(scaled ? nb_mul_scalar(ctx, loss, 0.37) : loss);
            nb_to_host_f64(x->grad, gf);
            ck_assert_msg(memcmp(&lp, &lf, sizeof lp) == 0, "case %zu: loss %.17g, unfused %.17g",
                          k, lf, lp);
            double tol = dt == NB_F64 ? 1e-15 : dt == NB_F32 ? 4e-7 : 1e-2; /* two roundings */
            for (int i = 0; i < 42; i++)
                if (scaled)
                    ck_assert_msg(fabs(gf[i] - gp[i]) <= tol * (fabs(gp[i]) + 1e-3),
                                  "case %zu g 0.37: dx[%d] = %.9g, unfused %.9g", k, i, gf[i],
                                  gp[i]);
                else
                    ck_assert_msg(memcmp(&gf[i], &gp[i], sizeof gf[i]) == 0,
                                  "case %zu g 1: dx[%d] = %.17g, unfused %.17g", k, i, gf[i],
                                  gp[i]);
        }
        nb_ctx_free(ctx);
    }
}
END_TEST

/* The forward writes over the logits only when a backward can come: the
 * logits hold (softmax - onehot) / count after a training forward, and
 * their values after one under no-grad (eval); and never the user's. */
START_TEST(test_ce_fused_writes) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 11);
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(3), (int64_t[]){3, -100, 0});
    double xv[12], after[12], e[12];
    nb_to_host_f64(x, xv);
    ce_grad_3x4(xv, (int64_t[]){3, -100, 0}, 0, e);
    for (int grad = 0; grad < 2; grad++) {
        bool prev = nb_set_grad_enabled(grad);
        nb__scope_enter(ctx);
        nb_tensor *logits = nb_mul_scalar(ctx, x, 1.0);
        nb_tensor *loss = nb__cross_entropy_fused(ctx, logits, t, NULL);
        nb_to_host_f64(logits, after);
        nb__scope_exit(ctx, loss);
        nb_set_grad_enabled(prev);
        for (int i = 0; i < 12; i++)
            ck_assert_msg(fabs(after[i] - (grad ? e[i] : xv[i])) <= 1e-14, "%s: logits[%d] = %.17g",
                          grad ? "training" : "eval", i, after[i]);
    }
    /* the user's logits (made outside any scope) are never written */
    nb_tensor *mine = nb_mul_scalar(ctx, x, 1.0);
    nb_tensor *loss = nb__cross_entropy_fused(ctx, mine, t, NULL);
    nb_to_host_f64(mine, after);
    ck_assert(memcmp(after, xv, sizeof xv) == 0);
    ck_assert_ptr_nonnull(loss->node->saved[2]);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_ce_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 5));
    nb_tensor *t = nb_from_host(ctx, NB_I64, NB_SHAPE(3), (int64_t[]){0, 1, 7});
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x, t, NULL),
                     "nb_cross_entropy: target 7 at position 2 is out of range for 5 classes");
    nb_tensor *tn = nb_from_host(ctx, NB_I32, NB_SHAPE(3), (int32_t[]){0, -1, 4});
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x, tn, NULL), "target -1 at position 1");
    nb_tensor *t100 = nb_from_host(ctx, NB_I32, NB_SHAPE(3), (int32_t[]){-100, 0, 0});
    nb_cross_entropy_opts o = {0, 0.0};
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x, t100, &o), "target -100 at position 0");
    nb_tensor *tf = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x, tf, NULL),
                     "nb_cross_entropy: targets must be i32 or i64 class indices, got f32");
    nb_tensor *t4 = nb_zeros(ctx, NB_I64, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x, t4, NULL), "got targets (4,) for logits (3, 5)");
    nb_tensor *x3 = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 5, 2));
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x3, t, NULL), "logits must be (N, C), got shape (3, 5, 2)");
    nb_cross_entropy_opts bad = {-100, 1.5};
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, x, t100, &bad), "label_smoothing must be in [0, 1]");
    nb_tensor *xi = nb_zeros(ctx, NB_I64, NB_SHAPE(3, 5));
    NBT_EXPECT_ABORT(nb_cross_entropy(ctx, xi, t100, NULL), "nb_cross_entropy: dtype i64");
    nb_ctx_free(ctx);
}
END_TEST

/* ---- MSE ---- */
START_TEST(test_mse_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    NBT_FOR_F64_F32(dti, dt) {
        nb_tensor *p = nbt_randn(ctx, dt, NB_SHAPE(4, 3), 1);
        nb_tensor *base = nbt_randn(ctx, dt, NB_SHAPE(3, 4), 2);
        nb_tensor *q = nb_transpose(ctx, base, 0, 1); /* non-contiguous target */
        double pv[12], qv[12], e = 0;
        nb_to_host_f64(p, pv);
        nb_to_host_f64(q, qv);
        for (int i = 0; i < 12; i++) e += (pv[i] - qv[i]) * (pv[i] - qv[i]) / 12;
        nb_tensor *loss = nb_mse_loss(ctx, p, q);
        ck_assert(loss->ndim == 0 && loss->dtype == dt);
        nbt_assert_close(loss, &e, dti ? 1e-6 : 1e-15, dti ? 1e-6 : 1e-13);
    }
    nb_ctx_free(ctx);
}
END_TEST

static nb_tensor *mse_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *p = user ? nb_transpose(ctx, in[0], 0, 1) : in[0];
    return nb_mse_loss(ctx, p, in[1]);
}

START_TEST(test_mse_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *in[2] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 3),
                        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 4)};
    NBT_GRADCHECK(mse_fn, NULL, 2, in);
    nb_tensor *tin[2] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3), 5),
                         nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 6)};
    NBT_GRADCHECK(mse_fn, (void *)1, 2, tin);
    /* only the target requires grad */
    nb_tensor *p = nbt_randn(ctx, NB_F64, NB_SHAPE(5), 7);
    nb_tensor *q = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(5), 8);
    nb_tensor *oin[2] = {p, q};
    NBT_GRADCHECK(mse_fn, NULL, 2, oin);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_mse_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3)), *b = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 2));
    NBT_EXPECT_ABORT(nb_mse_loss(ctx, a, b),
                     "nb_mse_loss: pred (2, 3) and target (3, 2) must have the same shape");
    nb_tensor *c = nb_zeros(ctx, NB_F64, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_mse_loss(ctx, a, c), "nb_mse_loss: dtypes differ");
    nb_tensor *i = nb_zeros(ctx, NB_I32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_mse_loss(ctx, i, i), "nb_mse_loss: dtype i32");
    nb_ctx_free(ctx);
}
END_TEST

/* ---- BCE with logits ---- */
/* -(y log s(x) + (1 - y) log s(-x)), with log s(z) computed without overflow */
static double log_sigmoid(double z) { return z > 0 ? -log1p(exp(-z)) : z - log1p(exp(z)); }
static double ref_bce(double x, double y) { return -(y * log_sigmoid(x) + (1 - y) * log_sigmoid(-x)); }

START_TEST(test_bce_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    NBT_FOR_F64_F32(dti, dt) {
        nb_tensor *x = nb_mul_scalar(ctx, nbt_randn(ctx, dt, NB_SHAPE(3, 5), 9), 3.0);
        nb_tensor *y = nb_rand_uniform(ctx, dt, NB_SHAPE(3, 5), 0, 1, NULL);
        double xv[15], yv[15], e = 0;
        nb_to_host_f64(x, xv);
        nb_to_host_f64(y, yv);
        for (int i = 0; i < 15; i++) e += ref_bce(xv[i], yv[i]) / 15;
        nb_tensor *loss = nb_bce_with_logits(ctx, x, y);
        ck_assert(loss->ndim == 0 && loss->dtype == dt);
        nbt_assert_close(loss, &e, dti ? 1e-6 : 1e-14, dti ? 1e-5 : 1e-12);
    }
    /* large |x|: no overflow, exact limits */
    float xb[4] = {200.0f, 200.0f, -200.0f, -200.0f}, yb[4] = {1, 0, 1, 0};
    double eb[4] = {0, 200, 200, 0};
    for (int i = 0; i < 4; i++) {
        nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(1), &xb[i]);
        nb_tensor *y = nb_from_host(ctx, NB_F32, NB_SHAPE(1), &yb[i]);
        nbt_assert_close(nb_bce_with_logits(ctx, x, y), &eb[i], 1e-6, 1e-6);
    }
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(4), (double[]){800, -800, 30, -30});
    nb_tensor *y = nb_from_host(ctx, NB_F64, NB_SHAPE(4), (double[]){0.25, 0.5, 1, 0});
    double e = (ref_bce(800, 0.25) + ref_bce(-800, 0.5) + ref_bce(30, 1) + ref_bce(-30, 0)) / 4;
    ck_assert(isfinite(e));
    nbt_assert_close(nb_bce_with_logits(ctx, x, y), &e, 1e-14, 1e-13);
    nb_ctx_free(ctx);
}
END_TEST

static nb_tensor *bce_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *x = user ? nb_transpose(ctx, in[0], 0, 1) : in[0];
    return nb_bce_with_logits(ctx, x, in[1]);
}

START_TEST(test_bce_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *y = nb_rand_uniform(ctx, NB_F64, NB_SHAPE(3, 4), 0, 1, NULL);
    nb_tensor *in[2] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 4), 10), y};
    NBT_GRADCHECK(bce_fn, NULL, 2, in);
    nb_tensor *tin[2] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3), 11), y};
    NBT_GRADCHECK(bce_fn, (void *)1, 2, tin);
    /* targets get no gradient even when they require it */
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(6), 12);
    nb_tensor *yl = nb_rand_uniform(ctx, NB_F64, NB_SHAPE(6), 0, 1, NULL);
    nb_set_requires_grad(yl, true);
    nb_backward(nb_bce_with_logits(ctx, x, yl));
    ck_assert(yl->grad == NULL);
    double xv[6], yv[6], e[6];
    nb_to_host_f64(x, xv);
    nb_to_host_f64(yl, yv);
    for (int i = 0; i < 6; i++) e[i] = (1 / (1 + exp(-xv[i])) - yv[i]) / 6;
    nbt_assert_close(x->grad, e, 1e-15, 1e-12);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_bce_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(4)), *b = nb_zeros(ctx, NB_F32, NB_SHAPE(4, 1));
    NBT_EXPECT_ABORT(nb_bce_with_logits(ctx, a, b),
                     "nb_bce_with_logits: logits (4,) and targets (4, 1) must have the same shape");
    nb_tensor *c = nb_zeros(ctx, NB_F64, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_bce_with_logits(ctx, a, c), "nb_bce_with_logits: dtypes differ");
    nb_ctx_free(ctx);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_ce_values, test_ce_large_logits_and_all_ignored, test_ce_grad_closed_form,
                             test_ce_gradcheck, test_ce_fused_matches_unfused,
                             test_ce_fused_writes, test_f32_backward, test_ce_errors, test_mse_values,
                             test_mse_gradcheck, test_mse_errors, test_bce_values, test_bce_gradcheck,
                             test_bce_errors, NULL};
    return nbt_suite("loss", "core", 0, tests);
}

int main(void) { return nbt_run(suite()); }
