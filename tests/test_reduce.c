/* Reductions: sum, mean, max, var against naive loops, keepdim, negative
 * and multiple axes, strided inputs, gradchecks and errors. */
#include <math.h>

#include "testutil.h"

/* naive reference over a (2, 3, 4) tensor reducing the axes in mask */
static void naive(const nb_tensor *x, bool red[3], char kind, int correction, double *out) {
    int64_t S[3] = {x->shape[0], x->shape[1], x->shape[2]};
    int o = 0;
    for (int64_t i = 0; i < (red[0] ? 1 : S[0]); i++)
        for (int64_t j = 0; j < (red[1] ? 1 : S[1]); j++)
            for (int64_t k = 0; k < (red[2] ? 1 : S[2]); k++) {
                double s = 0, m = -INFINITY, n = 0;
                for (int64_t a = 0; a < (red[0] ? S[0] : 1); a++)
                    for (int64_t b = 0; b < (red[1] ? S[1] : 1); b++)
                        for (int64_t c = 0; c < (red[2] ? S[2] : 1); c++) {
                            double v = nb_get(x, (int64_t[]){red[0] ? a : i, red[1] ? b : j, red[2] ? c : k});
                            s += v;
                            m = v > m ? v : m;
                            n++;
                        }
                double mu = s / n, ss = 0;
                for (int64_t a = 0; a < (red[0] ? S[0] : 1); a++)
                    for (int64_t b = 0; b < (red[1] ? S[1] : 1); b++)
                        for (int64_t c = 0; c < (red[2] ? S[2] : 1); c++) {
                            double v = nb_get(x, (int64_t[]){red[0] ? a : i, red[1] ? b : j, red[2] ? c : k});
                            ss += (v - mu) * (v - mu);
                        }
                out[o++] = kind == 's' ? s : kind == 'm' ? mu : kind == 'x' ? m : ss / (n - correction);
            }
}

static nb_tensor *reduce(nb_ctx *ctx, char kind, nb_tensor *x, int naxes, const int *axes, bool keep) {
    switch (kind) {
    case 's': return nb_sum(ctx, x, naxes, axes, keep);
    case 'm': return nb_mean(ctx, x, naxes, axes, keep);
    case 'x': return nb_max(ctx, x, naxes, axes, keep);
    default: return nb_var(ctx, x, naxes, axes, 1, keep);
    }
}

static const int axis_sets[][3] = {{0}, {1}, {-1}, {0, 2}, {2, 0}, {1, 2}, {0, 1, 2}};
static const int axis_counts[] = {1, 1, 1, 2, 2, 2, 3};

START_TEST(test_values) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const char kinds[] = "smxv";
    nb_tensor *base = nbt_randn(ctx, NB_F64, NB_SHAPE(4, 3, 2), 3);
    nb_tensor *xs[2] = {nbt_randn(ctx, NB_F64, NB_SHAPE(2, 3, 4), 1), nb_permute(ctx, base, (int[]){2, 1, 0})};
    for (int xi = 0; xi < 2; xi++)
        for (int ki = 0; ki < 4; ki++)
            for (int s = 0; s < 7; s++) {
                bool red[3] = {false, false, false};
                for (int a = 0; a < axis_counts[s]; a++) red[(axis_sets[s][a] + 3) % 3] = true;
                double e[24];
                naive(xs[xi], red, kinds[ki], 1, e);
                for (int keep = 0; keep < 2; keep++) {
                    nb_tensor *y = reduce(ctx, kinds[ki], xs[xi], axis_counts[s], axis_sets[s], keep);
                    ck_assert_int_eq(y->ndim, keep ? 3 : 3 - axis_counts[s]);
                    nbt_assert_close(y, e, 1e-12, 1e-12);
                    nb_tensor *yf = reduce(ctx, kinds[ki], nb_cast(ctx, xs[xi], NB_F32), axis_counts[s],
                                           axis_sets[s], keep);
                    nbt_assert_close(yf, e, 1e-5, 1e-5);
                }
            }
    /* naxes = 0 reduces everything */
    nb_tensor *all = nb_sum(ctx, xs[0], 0, NULL, false);
    ck_assert_int_eq(all->ndim, 0);
    double e[1];
    naive(xs[0], (bool[]){true, true, true}, 's', 0, e);
    ck_assert_double_eq_tol(nb_item(all), e[0], 1e-12);
    ck_assert_double_eq_tol(nb_item(nb_mean_all(ctx, xs[0])), e[0] / 24, 1e-12);
    /* biased variance */
    double ev[6];
    naive(xs[0], (bool[]){false, false, true}, 'v', 0, ev);
    nbt_assert_close(nb_var(ctx, xs[0], 1, (int[]){2}, 0, false), ev, 1e-12, 1e-12);
    nb_ctx_free(ctx);
}
END_TEST

static char g_kind;
static int g_set;
static nb_tensor *reduce_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    bool strided = u != NULL;
    nb_tensor *x = strided ? nb_permute(ctx, in[0], (int[]){2, 1, 0}) : in[0];
    return reduce(ctx, g_kind, x, axis_counts[g_set], axis_sets[g_set], g_set % 2 == 0);
}

START_TEST(test_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const char kinds[] = "smxv";
    for (int ki = 0; ki < 4; ki++)
        for (int s = 0; s < 7; s++) {
            g_kind = kinds[ki];
            g_set = s;
            nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3, 4), 20 + s);
            nb_gradcheck_result r = nb_gradcheck(reduce_fn, NULL, 1, &x, 0, 0, 0);
            ck_assert_msg(r.ok, "%c axes set %d: %s", kinds[ki], s, r.message);
            nb_tensor *xt = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3, 2), 40 + s);
            r = nb_gradcheck(reduce_fn, (void *)1, 1, &xt, 0, 0, 0);
            ck_assert_msg(r.ok, "%c strided axes set %d: %s", kinds[ki], s, r.message);
        }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_max_ties_gradient_to_first) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(2, 3), (double[]){1, 5, 5, 2, 2, -1});
    nb_set_requires_grad(x, true);
    nb_backward(nb_sum_all(ctx, nb_max(ctx, x, 1, (int[]){1}, false)));
    double e[6] = {0, 1, 0, 1, 0, 0};
    nbt_assert_close(x->grad, e, 0, 0);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_sum(ctx, x, 1, (int[]){2}, false), "nb_sum: dimension 2 out of range for a 2-d tensor");
    NBT_EXPECT_ABORT(nb_mean(ctx, x, 2, (int[]){1, -1}, false), "axis -1 given twice");
    NBT_EXPECT_ABORT(nb_max(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 0)), 1, (int[]){1}, false), "empty dimension");
    NBT_EXPECT_ABORT(nb_sum_all(ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(2))), "nb_sum: dtype i64");
    nb_ctx_free(ctx);
}
END_TEST

int main(void) {
    Suite *s = suite_create("reduce");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_values);
    tcase_add_test(tc, test_gradcheck);
    tcase_add_test(tc, test_max_ties_gradient_to_first);
    tcase_add_test(tc, test_errors);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
