/* Softmax and log-softmax: values against a naive double reference on
 * several axes (including one wider than the kernel's column tile and a
 * non-contiguous input), rows summing to one, stability for large logits,
 * gradchecks and error messages. The causal softmax: values against a
 * reference and against the composed scale + masked_fill + softmax (the
 * path CUDA tensors take), exact zeros above the diagonal, gradchecks, f32
 * against f64 gradients, errors. */
#include <math.h>

#include "testutil.h"

#define MAXN 1024

/* Reference along `axis` of a row-major array of `shape`, in double. */
static void ref_softmax(double *out, const double *x, int ndim, const int64_t *shape, int axis,
                        bool take_log) {
    int64_t strides[NB_MAX_DIMS], n = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = n;
        n *= shape[d];
    }
    for (int64_t e = 0; e < n; e++) {
        /* the first element of e's row along axis */
        int64_t idx = (e / strides[axis]) % shape[axis];
        int64_t base = e - idx * strides[axis];
        double mx = -INFINITY, s = 0;
        for (int64_t k = 0; k < shape[axis]; k++) mx = fmax(mx, x[base + k * strides[axis]]);
        for (int64_t k = 0; k < shape[axis]; k++) s += exp(x[base + k * strides[axis]] - mx);
        out[e] = take_log ? x[e] - mx - log(s) : exp(x[e] - mx) / s;
    }
}

static void check_against_ref(nb_tensor *x, int axis, bool take_log) {
    nb_ctx *ctx = x->ctx;
    static double xv[MAXN], e[MAXN];
    int64_t n = nb_numel(x);
    ck_assert(n <= MAXN);
    nb_to_host_f64(x, xv);
    int d = axis < 0 ? axis + x->ndim : axis;
    ref_softmax(e, xv, x->ndim, x->shape, d, take_log);
    nb_tensor *y = take_log ? nb_log_softmax(ctx, x, axis) : nb_softmax(ctx, x, axis);
    ck_assert(y->dtype == x->dtype && nb_same_shape(y, x));
    bool f32 = x->dtype == NB_F32;
    nbt_assert_close(y, e, f32 ? 1e-6 : 1e-14, f32 ? 1e-5 : 1e-12);
}

NBT_CPU_TEST(test_values_axes) {
    static const int64_t shapes[][3] = {{3, 5, 1}, {2, 3, 4}, {2, 3, 70}};
    static const int ndims[] = {2, 3, 3};
    for (int si = 0; si < 3; si++) {
        for (int axis = -ndims[si]; axis < ndims[si]; axis++) {
            for (int dti = 0; dti < 2; dti++) {
                nb_tensor *x = nbt_randn(ctx, dti ? NB_F32 : NB_F64, ndims[si], shapes[si],
                                         (uint64_t)(100 + si * 10 + axis));
                nb_tensor *x3 = nb_mul_scalar(ctx, x, 3.0);
                check_against_ref(x3, axis, false);
                check_against_ref(x3, axis, true);
            }
        }
    }
}

NBT_CPU_TEST(test_rows_sum_to_one) {
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(4, 6, 5), 7);
    nb_tensor *y = nb_softmax(ctx, x, 1);
    double v[120];
    nb_to_host_f64(y, v);
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < 5; c++) {
            double s = 0;
            for (int b = 0; b < 6; b++) {
                double p = v[(a * 6 + b) * 5 + c];
                ck_assert(p > 0 && p < 1);
                s += p;
            }
            ck_assert_msg(fabs(s - 1) < 1e-6, "sum %g", s);
        }
    /* exp(log_softmax) is softmax */
    nb_tensor *ly = nb_exp(ctx, nb_log_softmax(ctx, x, 1));
    nbt_assert_tensors_close(ly, y, 1e-6, 1e-5);
}

NBT_CPU_TEST(test_non_contiguous) {
    nb_tensor *base = nbt_randn(ctx, NB_F64, NB_SHAPE(5, 4, 3), 11);
    nb_tensor *xt = nb_transpose(ctx, base, 0, 2);             /* (3, 4, 5) */
    nb_tensor *xs = nb_slice(ctx, base, 1, 0, 4, 2);            /* (5, 2, 3) */
    ck_assert(!nb_is_contiguous(xt) && !nb_is_contiguous(xs));
    for (int axis = 0; axis < 3; axis++) {
        check_against_ref(xt, axis, false);
        check_against_ref(xt, axis, true);
        check_against_ref(xs, axis, false);
        check_against_ref(xs, axis, true);
    }
}

NBT_CPU_TEST(test_large_logits) {
    float xv[6] = {1000.0f, 1001.0f, 1002.0f, -1000.0f, -1001.0f, -3000.0f};
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(2, 3), xv);
    /* closed forms: softmax(0, 1, 2) and softmax(0, -1, -2000) */
    double z = 1 + exp(1.0) + exp(2.0), z2 = 1 + exp(-1.0);
    double e[6] = {1 / z, exp(1.0) / z, exp(2.0) / z, 1 / z2, exp(-1.0) / z2, 0};
    nbt_assert_close(nb_softmax(ctx, x, 1), e, 1e-7, 1e-6);
    double le[6] = {-log(z), 1 - log(z), 2 - log(z), -log(z2), -1 - log(z2), -2000 - log(z2)};
    nbt_assert_close(nb_log_softmax(ctx, x, 1), le, 1e-4, 1e-6);
    /* column-wise (tiled) path too */
    nb_tensor *xt = nb_transpose(ctx, x, 0, 1);
    double et[6] = {e[0], e[3], e[1], e[4], e[2], e[5]};
    nbt_assert_close(nb_softmax(ctx, nb_contiguous(ctx, xt), 0), et, 1e-7, 1e-6);
}

/* Rows of 11 (a block of 8 lanes and a tail) with non-finite entries: a
 * NaN or a +inf makes the whole row NaN, a -inf entry is exactly 0 (and
 * -inf in log-softmax) while the others are the softmax of the finite
 * ones; f32 and f64. */
NBT_CPU_TEST(test_nonfinite_rows) {
    double v[33];
    for (int i = 0; i < 33; i++) v[i] = 0.25 * (i % 11) - 1.0;
    v[4] = NAN;           /* row 0 */
    v[11 + 9] = INFINITY; /* row 1 */
    v[22 + 2] = -INFINITY, v[22 + 10] = -INFINITY; /* row 2: lane and tail */
    double z = 0;
    for (int j = 0; j < 11; j++)
        if (j != 2 && j != 10) z += exp(0.25 * j - 1.0);
    NBT_FOR_F64_F32(k, dt) {
        nb_tensor *x = nb_cast(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(3, 11), v), dt);
        double y[33], ly[33];
        nb_to_host_f64(nb_softmax(ctx, x, 1), y);
        nb_to_host_f64(nb_log_softmax(ctx, x, 1), ly);
        for (int j = 0; j < 22; j++)
            ck_assert_msg(isnan(y[j]) && isnan(ly[j]), "%s: element %d: %g, %g", nb_dtype_name(dt), j,
                          y[j], ly[j]);
        for (int j = 0; j < 11; j++) {
            double x_j = 0.25 * j - 1.0;
            if (j == 2 || j == 10) {
                ck_assert_msg(y[22 + j] == 0 && ly[22 + j] == -INFINITY, "%s: masked %d: %g, %g",
                              nb_dtype_name(dt), j, y[22 + j], ly[22 + j]);
                continue;
            }
            ck_assert_msg(fabs(y[22 + j] - exp(x_j) / z) < 1e-6 * exp(x_j) / z, "%s: %d: %.9g vs %.9g",
                          nb_dtype_name(dt), j, y[22 + j], exp(x_j) / z);
            ck_assert_msg(fabs(ly[22 + j] - (x_j - log(z))) < 1e-6, "%s: log %d: %.9g vs %.9g",
                          nb_dtype_name(dt), j, ly[22 + j], x_j - log(z));
        }
    }
}

typedef struct sm_case {
    int axis;
    bool take_log;
    bool transpose;
} sm_case;

static nb_tensor *sm_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const sm_case *c = user;
    nb_tensor *x = in[0];
    if (c->transpose) x = nb_transpose(ctx, x, 0, x->ndim - 1);
    return c->take_log ? nb_log_softmax(ctx, x, c->axis) : nb_softmax(ctx, x, c->axis);
}

NBT_CPU_TEST(test_gradcheck) {
    static const int64_t shapes[][3] = {{3, 4, 0}, {2, 3, 4}};
    static const int ndims[] = {2, 3};
    for (int si = 0; si < 2; si++)
        for (int axis = 0; axis < ndims[si]; axis++)
            for (int lg = 0; lg < 2; lg++)
                for (int tr = 0; tr < 2; tr++) {
                    sm_case c = {axis, lg != 0, tr != 0};
                    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, ndims[si], shapes[si],
                                                  (uint64_t)(200 + si * 10 + axis));
                    NBT_GRADCHECK(sm_fn, &c, 1, &x);
                }
}

/* The analytic gradient equals the closed form for a one-hot seed. */
NBT_CPU_TEST(test_backward_closed_form) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(1, 4), 3);
    nb_tensor *y = nb_softmax(ctx, x, 1);
    double yv[4];
    nb_to_host_f64(y, yv);
    nb_backward(nb_select(ctx, y, 1, 2)); /* d y2 / d xj = y2 ([j = 2] - yj) */
    double e[4];
    for (int j = 0; j < 4; j++) e[j] = yv[2] * ((j == 2) - yv[j]);
    nbt_assert_close(x->grad, e, 1e-14, 1e-12);
}

/* The f32 backward kernels agree with the f64 ones. */
NBT_CPU_TEST(test_f32_backward) {
    for (int axis = 0; axis < 3; axis++)
        for (int lg = 0; lg < 2; lg++) {
            nb_tensor *x64, *x32;
            nbt_twin_leaves(ctx, NB_SHAPE(3, 4, 5), 300 + axis, &x64, &x32);
            nb_tensor *(*f)(nb_ctx *, nb_tensor *, int) = lg ? nb_log_softmax : nb_softmax;
            nb_backward(nbt_weighted_sum(ctx, f(ctx, x64, axis)));
            nb_backward(nbt_weighted_sum(ctx, f(ctx, x32, axis)));
            nbt_assert_tensors_close(x32->grad, x64->grad, 1e-5, 1e-4);
        }
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_softmax(ctx, x, 2), "nb_softmax: dimension 2 out of range");
    NBT_EXPECT_ABORT(nb_log_softmax(ctx, x, -3), "nb_log_softmax: dimension -3 out of range");
    nb_tensor *xi = nb_zeros(ctx, NB_I32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_softmax(ctx, xi, 1), "nb_softmax: dtype i32");
    NBT_EXPECT_ABORT(nb_log_softmax(ctx, xi, 1), "nb_log_softmax: dtype i32");
}

/* ---- causal softmax ---- */

/* Reference of nb_softmax_causal over a row-major (B, T, S) array. */
static void ref_softmax_causal(double *out, const double *x, int64_t b, int64_t t, int64_t s,
                               double scale) {
    for (int64_t r = 0; r < b * t; r++) {
        int64_t l = r % t + 1 < s ? r % t + 1 : s;
        const double *xr = x + r * s;
        double *yr = out + r * s, mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < l; j++) mx = fmax(mx, scale * xr[j]);
        for (int64_t j = 0; j < l; j++) sum += exp(scale * xr[j] - mx);
        for (int64_t j = 0; j < s; j++) yr[j] = j < l ? exp(scale * xr[j] - mx) / sum : 0;
    }
}

/* The composition that nb_softmax_causal replaces (and runs on CUDA). */
static nb_tensor *composed_causal(nb_ctx *ctx, nb_tensor *x, double scale) {
    int64_t t = x->shape[x->ndim - 2], s = x->shape[x->ndim - 1];
    nb_tensor *i = nb_reshape(ctx, nb_arange(ctx, NB_F32, 0, (double)t, 1), NB_SHAPE(t, 1));
    nb_tensor *j = nb_reshape(ctx, nb_arange(ctx, NB_F32, 0, (double)s, 1), NB_SHAPE(1, s));
    nb_tensor *mask = nb_relu(ctx, nb_sub(ctx, j, i));
    return nb_softmax(ctx, nb_masked_fill(ctx, nb_mul_scalar(ctx, x, scale), mask, -INFINITY), -1);
}

/* Exactly zero where j > i in every (T, S) matrix of y. */
static void assert_upper_zero(const nb_tensor *y) {
    static double v[MAXN];
    int64_t t = y->shape[y->ndim - 2], s = y->shape[y->ndim - 1], n = nb_numel(y);
    nb_to_host_f64(y, v);
    for (int64_t e = 0; e < n; e++)
        if (e % s > (e / s) % t) ck_assert_msg(v[e] == 0, "element %lld is %g, not 0", (long long)e, v[e]);
}

NBT_CPU_TEST(test_causal_values) {
    /* square, wider and taller than square, rows longer than the kernel's
     * 8 lanes with tails, a single element */
    static const int64_t shapes[][4] = {{5, 5}, {3, 7}, {7, 3}, {2, 1, 19, 21}, {1, 1}};
    static const int ndims[] = {2, 2, 2, 4, 2};
    static const double scales[] = {1.0, 0.35, -2.0};
    static double xv[MAXN], e[MAXN];
    for (int si = 0; si < 5; si++)
        for (int sc = 0; sc < 3; sc++)
            NBT_FOR_F64_F32(dti, dt) {
                nb_tensor *x = nb_mul_scalar(ctx, nbt_randn(ctx, dt, ndims[si], shapes[si], (uint64_t)(500 + si)), 3.0);
                int64_t t = x->shape[x->ndim - 2], s = x->shape[x->ndim - 1];
                int64_t b = nb_numel(x) / (t * s);
                ck_assert(nb_numel(x) <= MAXN);
                nb_to_host_f64(x, xv);
                ref_softmax_causal(e, xv, b, t, s, scales[sc]);
                nb_tensor *y = nb_softmax_causal(ctx, x, scales[sc]);
                ck_assert(y->dtype == dt && nb_same_shape(y, x));
                nbt_assert_close(y, e, dti ? 1e-6 : 1e-14, dti ? 1e-5 : 1e-12);
                assert_upper_zero(y);
                nb_tensor *c = composed_causal(ctx, x, scales[sc]);
                nbt_assert_tensors_close(y, c, dti ? 1e-6 : 1e-14, dti ? 1e-5 : 1e-12);
            }
}

NBT_CPU_TEST(test_causal_non_contiguous_and_extremes) {
    static double xv[MAXN], e[MAXN];
    /* a transposed view: made contiguous first */
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(3, 10, 10), 7);
    nb_tensor *xt = nb_transpose(ctx, x, 1, 2);
    nb_tensor *xc = nb_contiguous(ctx, xt);
    nb_to_host_f64(xc, xv);
    ref_softmax_causal(e, xv, 3, 10, 10, 0.5);
    nbt_assert_close(nb_softmax_causal(ctx, xt, 0.5), e, 1e-6, 1e-5);
    /* large logits do not overflow; scores far below the row's maximum
     * (and -inf ones, masked by the caller) weigh exactly 0 */
    double big[9] = {1000, -1e30, -1e30, 990, 1000, -INFINITY, -5e4, 3e4, 3e4};
    nb_tensor *xb = nb_from_host(ctx, NB_F64, NB_SHAPE(3, 3), big);
    nb_tensor *xb32 = nb_cast(ctx, xb, NB_F32);
    for (int k = 0; k < 2; k++) {
        nb_tensor *y = nb_softmax_causal(ctx, k ? xb32 : xb, 1.0);
        double w = 1 / (1 + exp(-10.0));
        double ev[9] = {1, 0, 0, 1 - w, w, 0, 0, 0.5, 0.5};
        nbt_assert_close(y, ev, 1e-6, 1e-6);
        assert_upper_zero(y);
    }
}

typedef struct causal_case {
    double scale;
    bool transpose;
} causal_case;

static nb_tensor *causal_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const causal_case *c = user;
    nb_tensor *x = in[0];
    if (c->transpose) x = nb_transpose(ctx, x, -1, -2);
    return nb_softmax_causal(ctx, x, c->scale);
}

NBT_CPU_TEST(test_causal_gradcheck) {
    static const int64_t shapes[][3] = {{4, 4, 0}, {3, 6, 0}, {6, 3, 0}, {2, 3, 5}};
    static const int ndims[] = {2, 2, 2, 3};
    for (int si = 0; si < 4; si++)
        for (int k = 0; k < 3; k++) {
            causal_case c = {k == 1 ? -0.7 : 0.5, k == 2};
            nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, ndims[si], shapes[si], (uint64_t)(600 + si));
            NBT_GRADCHECK(causal_fn, &c, 1, &x);
        }
}

/* The f32 backward kernel (lanes and tails) agrees with the f64 one and
 * with the composed path; nothing flows to the masked scores. */
NBT_CPU_TEST(test_causal_f32_backward) {
    nb_tensor *x64, *x32;
    nbt_twin_leaves(ctx, NB_SHAPE(1, 2, 19, 21), 700, &x64, &x32);
    nb_backward(nbt_weighted_sum(ctx, nb_softmax_causal(ctx, x64, 0.3)));
    nb_backward(nbt_weighted_sum(ctx, nb_softmax_causal(ctx, x32, 0.3)));
    nbt_assert_tensors_close(x32->grad, x64->grad, 1e-6, 1e-4);
    assert_upper_zero(x32->grad);
    nb_tensor *c64, *c32;
    nbt_twin_leaves(ctx, NB_SHAPE(1, 2, 19, 21), 700, &c64, &c32);
    nb_backward(nbt_weighted_sum(ctx, composed_causal(ctx, c64, 0.3)));
    nbt_assert_tensors_close(x64->grad, c64->grad, 1e-13, 1e-11);
}

NBT_CPU_TEST(test_causal_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 3));
    NBT_EXPECT_ABORT(nb_softmax_causal(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(3)), 1.0),
                     "nb_softmax_causal: input (3,) needs at least 2 dims");
    NBT_EXPECT_ABORT(nb_softmax_causal(ctx, x, 0.0), "nb_softmax_causal: scale 0 must be finite and nonzero");
    NBT_EXPECT_ABORT(nb_softmax_causal(ctx, x, NAN), "must be finite");
    NBT_EXPECT_ABORT(nb_softmax_causal(ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(3, 3)), 1.0),
                     "nb_softmax_causal: dtype i64");
}

NBT_MAIN("softmax", "core", 0,
         test_values_axes, test_rows_sum_to_one, test_non_contiguous, test_large_logits, test_nonfinite_rows,
         test_gradcheck, test_backward_closed_form, test_f32_backward, test_errors, test_causal_values,
         test_causal_non_contiguous_and_extremes, test_causal_gradcheck, test_causal_f32_backward, test_causal_errors)
