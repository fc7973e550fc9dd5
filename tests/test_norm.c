/* Layer norm and batch norm: values against naive double references (with
 * and without affine parameters, several shapes, f32 and f64, training and
 * eval), the running-statistics update against its closed form (unbiased
 * variance), gradchecks for x, weight and bias (non-contiguous x too), and
 * error messages. Layer norm's gradients added in place (Note [Layer
 * norm's gradients added in place] in tensor/ops_norm.c): gradchecks of
 * graphs where x's gradient is x's alone (a residual stream) or still
 * shared with a node yet to run, and the backend's adding entry bit for
 * bit against a write and a separate add. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"
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

/* ---- gradients added in place ----
 * The graphs run as a module's forward would (nb__scope_enter): their
 * tensors are the library's, so a gradient no longer shared can be proven
 * so (a user's tensor keeps its gradient for the user to read, and is never
 * added into). Inputs: a, a2 (4, 6), w, b (6), W (6, 6), all f64 leaves. */
enum { LN_RESIDUAL, LN_SHARED_OWN, LN_SHARED_PENDING, LN_DOUBLED, LN_LEAF, LN_TWICE, LN_GRAPHS };

static nb_tensor *ln_(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b) {
    return nb_layer_norm(ctx, x, 1, w, b, 1e-5);
}

static nb_tensor *ln_graph_body(nb_ctx *ctx, nb_tensor *const *in, int kind) {
    nb_tensor *a = in[0], *a2 = in[1], *w = in[2], *b = in[3], *W = in[4];
    nb_tensor *x = nb_mul_scalar(ctx, a, 1.5);
    switch (kind) {
    case LN_RESIDUAL: { /* two blocks h + ln(h) W sharing w, b and W: x's g is its alone */
        nb_tensor *h = nb_add(ctx, x, nb_matmul(ctx, ln_(ctx, x, w, b), W));
        return nb_add(ctx, h, nb_matmul(ctx, ln_(ctx, h, w, b), W));
    }
    case LN_SHARED_OWN: { /* y = ln(x) + x: the add's g is ln's own gradient too */
        nb_tensor *y = nb_add(ctx, ln_(ctx, x, w, b), x);
        return nb_add(ctx, ln_(ctx, y, w, b), y);
    }
    case LN_SHARED_PENDING: { /* s = p + x hands its g to p, whose node runs after ln's */
        nb_tensor *p = nb_mul_scalar(ctx, a2, 2.0);
        nb_tensor *q = ln_(ctx, x, w, b);
        nb_tensor *s = nb_add(ctx, p, x);
        return nb_add(ctx, nb_mul(ctx, s, s), nb_matmul(ctx, q, W));
    }
    case LN_DOUBLED: { /* z = x + x feeds a residual and ln; x feeds ln too */
        nb_tensor *z = nb_add(ctx, x, x);
        nb_tensor *r = nb_add(ctx, z, nb_matmul(ctx, ln_(ctx, z, w, b), W));
        return nb_add(ctx, r, ln_(ctx, x, w, b));
    }
    case LN_LEAF: /* the residual stream is the leaf a itself */
        return nb_add(ctx, a, nb_matmul(ctx, ln_(ctx, a, w, b), W));
    default: /* two layer norms of x: the second adds into the first's dx */
        return nb_add(ctx, nb_matmul(ctx, ln_(ctx, x, w, b), W), ln_(ctx, x, w, NULL));
    }
}

static nb_tensor *ln_graph(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb__scope_enter(ctx);
    nb_tensor *out = ln_graph_body(ctx, in, *(const int *)user);
    nb__scope_exit(ctx, out);
    return out;
}

static void ln_graph_inputs(nb_ctx *ctx, nb_dtype dt, uint64_t seed, nb_tensor **in) {
    in[0] = nbt_randn_leaf(ctx, dt, NB_SHAPE(4, 6), seed);
    in[1] = nbt_randn_leaf(ctx, dt, NB_SHAPE(4, 6), seed + 1);
    in[2] = nbt_randn_leaf(ctx, dt, NB_SHAPE(6), seed + 2);
    in[3] = nbt_randn_leaf(ctx, dt, NB_SHAPE(6), seed + 3);
    in[4] = nbt_randn_leaf(ctx, dt, NB_SHAPE(6, 6), seed + 4);
}

START_TEST(test_layer_norm_grads_in_place_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int kind = 0; kind < LN_GRAPHS; kind++) {
        nb_tensor *in[5];
        ln_graph_inputs(ctx, NB_F64, 100 + 10 * (uint64_t)kind, in);
        NBT_GRADCHECK(ln_graph, &kind, 5, in);
    }
    nb_ctx_free(ctx);
}
END_TEST

/* Each graph's gradients, twice (the second backward adds into the first's
 * leaf gradients), in dtype dt, with giving back on (x's gradient added
 * into where proven safe) and off (nothing proven: always a separate add):
 * the same bits. */
static nb_ctx *ln_graph_grads(nb_dtype dt, int kind, bool give_back, nb_tensor **grads) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_give_back(ctx, give_back);
    nb_tensor *in[5];
    ln_graph_inputs(ctx, dt, 300 + 10 * (uint64_t)kind, in);
    for (int step = 0; step < 2; step++) nb_backward(nbt_weighted_sum(ctx, ln_graph(ctx, in, &kind)));
    for (int k = 0; k < 5; k++) grads[k] = in[k]->grad;
    return ctx;
}

START_TEST(test_layer_norm_grads_in_place_bitwise) {
    const nb_dtype dts[] = {NB_F32, NB_F64};
    for (int k = 0; k < 2; k++)
        for (int kind = 0; kind < LN_GRAPHS; kind++) {
            nb_tensor *on[5], *off[5];
            nb_ctx *c_on = ln_graph_grads(dts[k], kind, true, on);
            nb_ctx *c_off = ln_graph_grads(dts[k], kind, false, off);
            for (int i = 0; i < 5; i++) {
                ck_assert_msg((on[i] == NULL) == (off[i] == NULL), "graph %d input %d", kind, i);
                if (!on[i]) continue;
                size_t bytes = (size_t)nb_numel(on[i]) * nb_dtype_size(on[i]->dtype);
                ck_assert_msg(!memcmp(on[i]->data, off[i]->data, bytes),
                              "graph %d %s: input %d's gradient differs with giving back on", kind,
                              nb_dtype_name(dts[k]), i);
            }
            nb_ctx_free(c_on);
            nb_ctx_free(c_off);
        }
}
END_TEST

/* The backend's entry with dx, dw, db added into against the same entry
 * writing them and a separate nb_add, bit for bit: f32, f64, bf16 x with
 * f32 and with bf16 weights. */
START_TEST(test_layer_norm_backward_adds_bitwise) {
    enum { M = 37, D = 45 };
    const struct { nb_dtype x, p; } dts[] = {{NB_F32, NB_F32}, {NB_F64, NB_F64}, {NB_BF16, NB_F32},
                                             {NB_BF16, NB_BF16}};
    for (int k = 0; k < 4; k++)
        for (unsigned add = 1; add < 8; add++) {
            nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
            nb_dtype dt = dts[k].x, pd = dts[k].p;
            nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(M, D), 60 + k);
            nb_tensor *g = nbt_randn(ctx, dt, NB_SHAPE(M, D), 70 + k);
            nb_tensor *w = nbt_randn(ctx, pd, NB_SHAPE(D), 80 + k);
            nb_tensor *b = nbt_randn(ctx, pd, NB_SHAPE(D), 81 + k);
            const nb__backend *be = nb__backend_at(x);
            int64_t m = M;
            nb_tensor *y = nb_empty(ctx, dt, NB_SHAPE(M, D));
            nb_tensor *mean = nb_empty(ctx, NB_F64, 1, &m), *rstd = nb_empty(ctx, NB_F64, 1, &m);
            be->layer_norm(y, mean, rstd, x, w, b, M, D, 1e-5);
            nb_tensor *put[3] = {nb_empty(ctx, dt, NB_SHAPE(M, D)), nb_empty(ctx, pd, NB_SHAPE(D)),
                                 nb_empty(ctx, pd, NB_SHAPE(D))};
            be->layer_norm_backward(ctx, put[0], put[1], put[2], g, x, mean, rstd, w, M, D, 0);
            nb_tensor *old[3] = {nbt_randn(ctx, dt, NB_SHAPE(M, D), 90 + k),
                                 nbt_randn(ctx, pd, NB_SHAPE(D), 91 + k),
                                 nbt_randn(ctx, pd, NB_SHAPE(D), 92 + k)};
            nb_tensor *acc[3];
            for (int i = 0; i < 3; i++)
                acc[i] = add & (1u << i) ? nb_clone(ctx, old[i]) : nb_empty_like(ctx, old[i]);
            be->layer_norm_backward(ctx, acc[0], acc[1], acc[2], g, x, mean, rstd, w, M, D, add);
            for (int i = 0; i < 3; i++) {
                nb_tensor *want = put[i];
                if (add & (1u << i)) { /* the add nb__accum_grad makes */
                    want = nb_empty_like(ctx, old[i]);
                    nb__run_binary(NB_B_ADD, want, old[i], put[i]);
                }
                size_t bytes = (size_t)nb_numel(want) * nb_dtype_size(want->dtype);
                ck_assert_msg(!memcmp(acc[i]->data, want->data, bytes),
                              "%s x, %s weights, add %u: output %d differs from a write and an add",
                              nb_dtype_name(dt), nb_dtype_name(pd), add, i);
            }
            nb_ctx_free(ctx);
        }
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

/* bf16 x with bf16 weight and bias (a model held in bf16; the CPU's
 * kernels widen all three), in a context whose compute dtype is bf16:
 * y, and x's, w's and b's gradients for an upstream gradient gy, against
 * f64 formulas on the same bf16 values, within bf16's rounding. D = 40
 * rows go through the f32 twins; D = 3000, longer than the row groups'
 * buffers, too. */
START_TEST(test_layer_norm_bf16_params) {
    static const int64_t dims[] = {40, 3000};
    for (int c = 0; c < 2; c++) {
        const int64_t M = 5, D = dims[c];
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
        nb_ctx_set_compute_dtype(ctx, NB_BF16);
        nb_tensor *x = nbt_randn_leaf(ctx, NB_BF16, NB_SHAPE(M, D), 11);
        nb_tensor *w = nbt_randn_leaf(ctx, NB_BF16, NB_SHAPE(D), 12);
        nb_tensor *b = nbt_randn_leaf(ctx, NB_BF16, NB_SHAPE(D), 13);
        nb_tensor *gy = nbt_randn(ctx, NB_BF16, NB_SHAPE(M, D), 14);
        double *xv = malloc(sizeof(double) * (size_t)(M * D)), *gv = malloc(sizeof(double) * (size_t)(M * D));
        double *wv = malloc(sizeof(double) * (size_t)D), *bv = malloc(sizeof(double) * (size_t)D);
        double *ey = malloc(sizeof(double) * (size_t)(M * D)), *edx = malloc(sizeof(double) * (size_t)(M * D));
        double *edw = calloc((size_t)D, sizeof(double)), *edb = calloc((size_t)D, sizeof(double));
        nb_to_host_f64(x, xv);
        nb_to_host_f64(w, wv);
        nb_to_host_f64(b, bv);
        nb_to_host_f64(gy, gv);
        nbt_ref_layer_norm(ey, xv, wv, bv, M, D, 1e-5);
        for (int64_t i = 0; i < M; i++) {
            const double *xr = xv + i * D, *gr = gv + i * D;
            double mu = 0, var = 0, sa = 0, sb = 0;
            for (int64_t j = 0; j < D; j++) mu += xr[j];
            mu /= (double)D;
            for (int64_t j = 0; j < D; j++) var += (xr[j] - mu) * (xr[j] - mu);
            double r = 1.0 / sqrt(var / (double)D + 1e-5);
            for (int64_t j = 0; j < D; j++) {
                double h = (xr[j] - mu) * r, dh = gr[j] * wv[j];
                sa += dh;
                sb += dh * h;
                edw[j] += gr[j] * h;
                edb[j] += gr[j];
            }
            for (int64_t j = 0; j < D; j++)
                edx[i * D + j] = r * (gr[j] * wv[j] - sa / (double)D - (xr[j] - mu) * r * sb / (double)D);
        }
        nb_tensor *y = nb_layer_norm(ctx, x, 1, w, b, 1e-5);
        ck_assert_int_eq(y->dtype, NB_BF16);
        nbt_assert_close(y, ey, 3e-2, 1e-2);
        nb_backward_ex(y, &(nb_backward_options){gy, false});
        ck_assert(x->grad && w->grad && b->grad);
        nbt_assert_close(x->grad, edx, 3e-2, 2e-2);
        nbt_assert_close(w->grad, edw, 5e-2, 2e-2);
        nbt_assert_close(b->grad, edb, 5e-2, 2e-2);
        free(xv), free(gv), free(wv), free(bv), free(ey), free(edx), free(edw), free(edb);
        nb_ctx_free(ctx);
    }
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_layer_norm_values, test_layer_norm_gradcheck,
                             test_layer_norm_grads_in_place_gradcheck,
                             test_layer_norm_grads_in_place_bitwise,
                             test_layer_norm_backward_adds_bitwise, test_layer_norm_bf16_params,
                             test_layer_norm_errors,
                             test_batch_norm_train_values, test_batch_norm_running_update_f32,
                             test_batch_norm_eval_values, test_batch_norm_gradcheck, test_f32_backward,
                             test_batch_norm_errors, NULL};
    return nbt_suite("norm", "core", 0, tests);
}

int main(void) { return nbt_run(suite()); }
