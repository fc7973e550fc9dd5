/* Reductions: sum, mean, max, var against naive loops, keepdim, negative
 * and multiple axes, strided inputs, gradchecks and errors; argmax (ties,
 * NaN, no gradient) and nb_count_correct. */
#include <math.h>

#include "tensor/internal.h" /* nb__sum_to */
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

NBT_CPU_TEST(test_values) {
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
}

static char g_kind;
static int g_set;
static nb_tensor *reduce_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    bool strided = u != NULL;
    nb_tensor *x = strided ? nb_permute(ctx, in[0], (int[]){2, 1, 0}) : in[0];
    return reduce(ctx, g_kind, x, axis_counts[g_set], axis_sets[g_set], g_set % 2 == 0);
}

/* The gradient of a broadcast input: summed over the broadcast dims; a
 * gradient that only has extra leading dims of size 1 is viewed, not
 * copied (a batch-of-one product's weight gradient). */
NBT_CPU_TEST(test_sum_to) {
    nb_tensor *g = nb_arange(ctx, NB_F32, 0, 24, 1);
    nb_tensor *g3 = nb_reshape(ctx, g, NB_SHAPE(1, 4, 6));
    nb_tensor *v = nb__sum_to(ctx, g3, 2, (int64_t[]){4, 6});
    ck_assert_int_eq(v->ndim, 2);
    ck_assert(v->shape[0] == 4 && v->shape[1] == 6);
    ck_assert_ptr_eq(v->data, g->data);
    ck_assert_float_eq(nb_get(v, (int64_t[]){3, 5}), 23);
    /* broadcast dims are summed: (2, 4, 6) -> (4, 6), (4, 6) -> (1, 6) */
    nb_tensor *g2 = nb_reshape(ctx, nb_arange(ctx, NB_F32, 0, 48, 1), NB_SHAPE(2, 4, 6));
    nb_tensor *s = nb__sum_to(ctx, g2, 2, (int64_t[]){4, 6});
    ck_assert_float_eq(nb_get(s, (int64_t[]){1, 2}), 8 + 32);
    nb_tensor *r = nb__sum_to(ctx, nb_reshape(ctx, g, NB_SHAPE(4, 6)), 2, (int64_t[]){1, 6});
    ck_assert_float_eq(nb_get(r, (int64_t[]){0, 1}), 1 + 7 + 13 + 19);
}

NBT_CPU_TEST(test_gradcheck) {
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
}

NBT_CPU_TEST(test_max_ties_gradient_to_first) {
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(2, 3), (double[]){1, 5, 5, 2, 2, -1});
    nb_set_requires_grad(x, true);
    nb_backward(nb_sum_all(ctx, nb_max(ctx, x, 1, (int[]){1}, false)));
    double e[6] = {0, 1, 0, 1, 0, 0};
    nbt_assert_close(x->grad, e, 0, 0);
}

/* index of the maximum of x[.., i, ..] over dim d of a (2, 3, 4) tensor at
 * the other coordinates in `at`, by a plain scan: strict > keeps the first
 * of ties, and the first NaN ends the search */
static int64_t naive_argmax(const nb_tensor *x, int d, const int64_t at[3]) {
    int64_t idx[3] = {at[0], at[1], at[2]}, best = 0;
    idx[d] = 0;
    double bv = nb_get(x, idx);
    for (int64_t i = 1; i < x->shape[d] && bv == bv; i++) {
        idx[d] = i;
        double v = nb_get(x, idx);
        if (v != v || v > bv) best = i, bv = v;
    }
    return best;
}

static void check_argmax(nb_ctx *ctx, nb_tensor *x, const char *what) {
    for (int dim = -3; dim < 3; dim++)
        for (int keep = 0; keep < 2; keep++) {
            int d = (dim + 3) % 3;
            nb_tensor *y = nb_argmax(ctx, x, dim, keep);
            ck_assert_int_eq(y->dtype, NB_I64);
            ck_assert_int_eq(y->ndim, keep ? 3 : 2);
            ck_assert(!y->requires_grad && !y->node);
            for (int64_t i = 0; i < (d == 0 ? 1 : x->shape[0]); i++)
                for (int64_t j = 0; j < (d == 1 ? 1 : x->shape[1]); j++)
                    for (int64_t l = 0; l < (d == 2 ? 1 : x->shape[2]); l++) {
                        int64_t want = naive_argmax(x, d, (int64_t[]){i, j, l});
                        int64_t at3[3] = {i, j, l}, at2[2];
                        int n2 = 0;
                        for (int e = 0; e < 3; e++)
                            if (e != d) at2[n2++] = at3[e];
                        if (keep) at3[d] = 0;
                        int64_t got = (int64_t)nb_get(y, keep ? at3 : at2);
                        ck_assert_msg(got == want, "%s: argmax dim %d keepdim %d at (%lld, %lld, %lld): "
                                      "%lld, expected %lld", what, dim, keep, (long long)i,
                                      (long long)j, (long long)l, (long long)got, (long long)want);
                    }
        }
}

NBT_CPU_TEST(test_argmax) {
    /* distinct values, f64 and f32, contiguous and a permuted view */
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(2, 3, 4), 5);
    check_argmax(ctx, x, "randn f64");
    check_argmax(ctx, nb_cast(ctx, x, NB_F32), "randn f32");
    check_argmax(ctx, nb_permute(ctx, nbt_randn(ctx, NB_F64, NB_SHAPE(4, 3, 2), 6), (int[]){2, 1, 0}),
                 "permuted");
    /* ties everywhere: values in {0, 1, 2} */
    double tv[24];
    for (int i = 0; i < 24; i++) tv[i] = (double)((i * 7 + i / 5) % 3);
    nb_tensor *t = nb_from_host(ctx, NB_F64, NB_SHAPE(2, 3, 4), tv);
    check_argmax(ctx, t, "ties f64");
    check_argmax(ctx, nb_cast(ctx, t, NB_F32), "ties f32");
    /* NaN: the first NaN wins over larger numbers and over later NaNs */
    double nv[24];
    for (int i = 0; i < 24; i++) nv[i] = (i % 5 == 3 || i % 7 == 6) ? NAN : (double)(i % 4);
    nb_tensor *nx = nb_from_host(ctx, NB_F64, NB_SHAPE(2, 3, 4), nv);
    check_argmax(ctx, nx, "NaN f64");
    check_argmax(ctx, nb_cast(ctx, nx, NB_F32), "NaN f32");
    /* the same facts on hand-written rows: ties, a NaN after the maximum,
     * two NaNs, -inf only */
    nb_tensor *h = nb_from_host(ctx, NB_F32, NB_SHAPE(4, 3),
                                (float[]){5, 5, 1, 1, 9, NAN, NAN, 2, NAN, -INFINITY, -INFINITY, -INFINITY});
    int64_t got[4];
    nb_to_host(nb_argmax(ctx, h, -1, false), got);
    ck_assert_int_eq(got[0], 0);
    ck_assert_int_eq(got[1], 2);
    ck_assert_int_eq(got[2], 0);
    ck_assert_int_eq(got[3], 0);
    /* no gradient: a leaf's argmax records nothing and backward through
     * the rest is unchanged */
    nb_tensor *leaf = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 2), 7);
    nb_tensor *a = nb_argmax(ctx, leaf, 0, true);
    ck_assert(!a->requires_grad && !a->node);
    ck_assert_int_eq(a->ndim, 2);
    ck_assert_int_eq(a->shape[0], 1);
    nb_backward(nb_sum_all(ctx, leaf));
    double ones[6] = {1, 1, 1, 1, 1, 1};
    nbt_assert_close(leaf->grad, ones, 0, 0);
    /* a 1-D tensor gives a 0-d index; an empty outer dim an empty result */
    ck_assert_int_eq((int64_t)nb_item(nb_argmax(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(3),
                                                                  (double[]){1, 3, 2}), 0, false)), 1);
    nb_tensor *e = nb_argmax(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(0, 3)), 1, false);
    ck_assert_int_eq(e->ndim, 1);
    ck_assert_int_eq(e->shape[0], 0);
}

NBT_CPU_TEST(test_count_correct) {
    /* rows: argmax 1, tie -> 0, NaN -> 2, argmax 2 */
    nb_tensor *logits = nb_from_host(ctx, NB_F32, NB_SHAPE(4, 3),
                                     (float[]){0, 2, 1, 3, 3, 0, 1, 9, NAN, -1, -2, 0});
    int64_t t64[4] = {1, 1, 2, 2};
    ck_assert_int_eq(nb_count_correct(ctx, logits, nb_from_host(ctx, NB_I64, NB_SHAPE(4), t64)), 3);
    int32_t t32[4] = {1, 0, 2, -100};
    ck_assert_int_eq(nb_count_correct(ctx, logits, nb_from_host(ctx, NB_I32, NB_SHAPE(4), t32)), 3);
    ck_assert_int_eq(nb_count_correct(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(0, 3)),
                                      nb_zeros(ctx, NB_I64, NB_SHAPE(0))), 0);
    NBT_EXPECT_ABORT(nb_count_correct(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(4)), logits),
                     "nb_count_correct: logits must be 2-D (N, C), got shape (4,)");
    NBT_EXPECT_ABORT(nb_count_correct(ctx, logits, nb_zeros(ctx, NB_I64, NB_SHAPE(3))),
                     "nb_count_correct: targets must have shape (4,) for logits of shape (4, 3), got shape (3,)");
    NBT_EXPECT_ABORT(nb_count_correct(ctx, logits, nb_zeros(ctx, NB_F32, NB_SHAPE(4))),
                     "nb_count_correct: targets must be i32 or i64 class indices, got f32");
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb_sum(ctx, x, 1, (int[]){2}, false), "nb_sum: dimension 2 out of range for a 2-d tensor");
    NBT_EXPECT_ABORT(nb_mean(ctx, x, 2, (int[]){1, -1}, false), "axis -1 given twice");
    NBT_EXPECT_ABORT(nb_max(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 0)), 1, (int[]){1}, false), "empty dimension");
    NBT_EXPECT_ABORT(nb_sum_all(ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(2))), "nb_sum: dtype i64");
    NBT_EXPECT_ABORT(nb_argmax(ctx, x, 2, false), "nb_argmax: dimension 2 out of range for a 2-d tensor");
    NBT_EXPECT_ABORT(nb_argmax(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 0)), 1, false),
                     "nb_argmax: dimension 1 of (2, 0) is empty");
    NBT_EXPECT_ABORT(nb_argmax(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(0, 0)), -1, false),
                     "nb_argmax: dimension -1 of (0, 0) is empty");
    NBT_EXPECT_ABORT(nb_argmax(ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(2)), 0, false), "nb_argmax: dtype i64");
}

int main(void) {
    const TTest *tests[] = {test_values, test_sum_to, test_gradcheck, test_max_ties_gradient_to_first,
                             test_argmax, test_count_correct, test_errors, NULL};
    return nbt_run(nbt_suite("reduce", "core", 60, tests));
}
