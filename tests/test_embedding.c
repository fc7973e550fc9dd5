/* Tests of nb_embedding: rows gathered for i32/i64 indices of several
 * shapes against a naive lookup, strided weights and indices, the
 * scatter-add backward with repeated indices, a gradient check, and the
 * error messages. */
#include <stdlib.h>

#include "testutil.h"

/* expect[p * C + c] = w[idx[p], c], from logical values */
static void check_lookup(const nb_tensor *out, const nb_tensor *w, const nb_tensor *idx) {
    int64_t v = w->shape[0], c = w->shape[1], np = nb_numel(idx);
    ck_assert_int_eq(out->ndim, idx->ndim + 1);
    for (int d = 0; d < idx->ndim; d++) ck_assert_int_eq(out->shape[d], idx->shape[d]);
    ck_assert_int_eq(out->shape[idx->ndim], c);
    ck_assert_int_eq(out->dtype, w->dtype);
    double *wv = malloc(sizeof(double) * (size_t)(v * c + 1));
    double *iv = malloc(sizeof(double) * (size_t)(np + 1));
    double *expect = malloc(sizeof(double) * (size_t)(np * c + 1));
    nb_to_host_f64(w, wv);
    nb_to_host_f64(idx, iv);
    for (int64_t p = 0; p < np; p++)
        for (int64_t j = 0; j < c; j++) expect[p * c + j] = wv[(int64_t)iv[p] * c + j];
    nbt_assert_close(out, expect, 0, 0);
    free(wv);
    free(iv);
    free(expect);
}

/* Pseudo-random indices in [0, v), repeats likely. */
static nb_tensor *make_indices(nb_ctx *ctx, nb_dtype dt, int ndim, const int64_t *shape, int64_t v,
                               uint64_t seed) {
    nb_tensor *t = nb_empty(ctx, dt, ndim, shape);
    int64_t n = nb_numel(t);
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int64_t r = (int64_t)((s >> 33) % (uint64_t)v);
        if (dt == NB_I32) ((int32_t *)t->data)[i] = (int32_t)r;
        else ((int64_t *)t->data)[i] = r;
    }
    return t;
}

START_TEST(test_forward_shapes_dtypes) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const nb_dtype wdt[2] = {NB_F32, NB_F64}, idt[2] = {NB_I32, NB_I64};
    struct { int nd; int64_t s[3]; } shapes[] = {{1, {7}}, {2, {2, 3}}, {3, {2, 2, 3}}, {0, {0}}, {1, {0}}};
    for (int wi = 0; wi < 2; wi++)
        for (int ii = 0; ii < 2; ii++)
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                nb_tensor *w = nbt_randn(ctx, wdt[wi], NB_SHAPE(10, 4), 1 + si);
                nb_tensor *idx = make_indices(ctx, idt[ii], shapes[si].nd, shapes[si].s, 10, si);
                check_lookup(nb_embedding(ctx, w, idx), w, idx);
            }
    /* every row, including the first and last */
    nb_tensor *w = nbt_randn(ctx, NB_F32, NB_SHAPE(5, 3), 9);
    nb_tensor *all = nb_arange(ctx, NB_I64, 4, -1, -1);
    check_lookup(nb_embedding(ctx, w, all), w, all);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_forward_strided) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *wt = nbt_randn(ctx, NB_F64, NB_SHAPE(4, 9), 20);
    nb_tensor *w = nb_transpose(ctx, wt, 0, 1); /* (9, 4), column stride 9 */
    nb_tensor *idx = make_indices(ctx, NB_I64, NB_SHAPE(3, 5), 9, 21);
    check_lookup(nb_embedding(ctx, w, idx), w, idx);
    nb_tensor *ws = nb_slice(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(12, 6), 22), 0, 1, 12, 2); /* (6, 6) */
    nb_tensor *it = nb_transpose(ctx, make_indices(ctx, NB_I32, NB_SHAPE(4, 3), 6, 23), 0, 1);
    check_lookup(nb_embedding(ctx, ws, it), ws, it);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_backward_repeated_indices) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const nb_dtype wdt[2] = {NB_F64, NB_F32};
    for (int wi = 0; wi < 2; wi++) {
        nb_tensor *w = nbt_randn_leaf(ctx, wdt[wi], NB_SHAPE(5, 3), 30);
        int32_t iv[6] = {1, 1, 3, 1, 0, 3};
        nb_tensor *idx = nb_from_host(ctx, NB_I32, NB_SHAPE(2, 3), iv);
        nb_tensor *g = nbt_randn(ctx, wdt[wi], NB_SHAPE(2, 3, 3), 31);
        nb_tensor *out = nb_embedding(ctx, w, idx);
        nb_backward_with(out, g);
        double gv[18], expect[15] = {0};
        nb_to_host_f64(g, gv);
        for (int p = 0; p < 6; p++)
            for (int j = 0; j < 3; j++) expect[iv[p] * 3 + j] += gv[p * 3 + j];
        nbt_assert_close(w->grad, expect, 1e-6, 1e-6);
        ck_assert(!idx->requires_grad);
        ck_assert_ptr_null(idx->grad);
        /* rows 2 and 4 were never used: exactly zero */
        for (int j = 0; j < 3; j++) {
            ck_assert(nb_get(w->grad, (int64_t[]){2, j}) == 0.0);
            ck_assert(nb_get(w->grad, (int64_t[]){4, j}) == 0.0);
        }
        /* a second backward accumulates into the leaf gradient */
        nb_backward_with(nb_embedding(ctx, w, idx), g);
        for (int i = 0; i < 15; i++) expect[i] *= 2;
        nbt_assert_close(w->grad, expect, 1e-6, 1e-6);
    }
    nb_ctx_free(ctx);
}
END_TEST

typedef struct emb_case {
    nb_tensor *idx;
    bool transpose_weight; /* the leaf is (C, V); use its transpose */
} emb_case;

static nb_tensor *emb_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const emb_case *e = user;
    nb_tensor *w = e->transpose_weight ? nb_transpose(ctx, in[0], 0, 1) : in[0];
    return nb_embedding(ctx, w, e->idx);
}

START_TEST(test_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int64_t iv[7] = {2, 0, 2, 5, 2, 0, 1};
    emb_case e1 = {nb_from_host(ctx, NB_I64, NB_SHAPE(7), iv), false};
    nb_tensor *w1 = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(6, 4), 40);
    NBT_GRADCHECK(emb_fn, &e1, 1, &w1);
    emb_case e2 = {make_indices(ctx, NB_I32, NB_SHAPE(2, 2, 3), 5, 41), true};
    nb_tensor *w2 = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3, 5), 42);
    NBT_GRADCHECK(emb_fn, &e2, 1, &w2);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_zeros(ctx, NB_F32, NB_SHAPE(10, 4));
    int64_t bad[5] = {0, 9, 3, 12, 1};
    nb_tensor *ib = nb_from_host(ctx, NB_I64, NB_SHAPE(5), bad);
    NBT_EXPECT_ABORT(nb_embedding(ctx, w, ib),
                     "nb_embedding: index 12 at position 3 is out of range for 10 rows");
    int32_t neg[4] = {1, 2, 3, -1};
    nb_tensor *in = nb_from_host(ctx, NB_I32, NB_SHAPE(2, 2), neg);
    NBT_EXPECT_ABORT(nb_embedding(ctx, w, in),
                     "nb_embedding: index -1 at position 3 is out of range for 10 rows");
    int32_t ten[1] = {10};
    NBT_EXPECT_ABORT(nb_embedding(ctx, w, nb_from_host(ctx, NB_I32, NB_SHAPE(1), ten)),
                     "index 10 at position 0 is out of range for 10 rows");
    nb_tensor *fidx = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_embedding(ctx, w, fidx), "nb_embedding: indices must be i32 or i64, got f32");
    nb_tensor *w1 = nb_zeros(ctx, NB_F32, NB_SHAPE(10));
    NBT_EXPECT_ABORT(nb_embedding(ctx, w1, ib), "nb_embedding: weight must be 2-D (V, C), got (10,)");
    nb_tensor *wi = nb_zeros(ctx, NB_I64, NB_SHAPE(10, 4));
    NBT_EXPECT_ABORT(nb_embedding(ctx, wi, ib), "nb_embedding: dtype i64 is not supported");
    nb_tensor *deep = nb_zeros(ctx, NB_I64, NB_SHAPE(1, 1, 1, 1, 1, 2));
    NBT_EXPECT_ABORT(nb_embedding(ctx, w, deep), "nb_embedding: indices (1, 1, 1, 1, 1, 2) have 6 dims");
    nb_ctx_free(ctx);
}
END_TEST

static Suite *embedding_suite(void) {
    const TTest *tests[] = {test_forward_shapes_dtypes, test_forward_strided, test_backward_repeated_indices,
                             test_gradcheck, test_errors, NULL};
    return nbt_suite("embedding", "embedding", 0, tests);
}

int main(void) { return nbt_run(embedding_suite()); }
