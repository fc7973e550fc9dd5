/* Tests of nb_embedding: rows gathered for i32/i64 indices of several
 * shapes against a naive lookup, strided weights and indices, the
 * scatter-add backward with repeated indices, a gradient check, and the
 * error messages. And of the GPT's input, nb__embedding_pos (token plus
 * position rows): against a naive lookup, the same bits as the add and
 * the cast it stands for, gradient checks with the tables also used by a
 * product (tied, as GPT's output head: the backward then adds into a
 * gradient that holds the product's part, Note [Embedding gradients in
 * place]), the in-place sums equal to a separate tensor plus an add, bit
 * for bit, and its errors. */
#include <stdlib.h>
#include <string.h>

#include "tensor/internal.h"
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

/* A gradient check of fn at n f64 leaf tables of rows[k] x c values,
 * seeded seed + k (both ops' checks) */
static void gradcheck_tables(nb_ctx *ctx, nb_gradcheck_fn fn, void *user, int n,
                             const int64_t *rows, int64_t c, uint64_t seed) {
    nb_tensor *in[2];
    for (int k = 0; k < n; k++) in[k] = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(rows[k], c), seed + k);
    NBT_GRADCHECK(fn, user, n, in);
}

/* repeated i64 indices into a (6, 4) table; i32 indices of three dims
 * into a transposed one */
NBT_CPU_TEST(test_gradcheck) {
    emb_case plain = {nb_from_host(ctx, NB_I64, NB_SHAPE(7), (int64_t[]){2, 0, 2, 5, 2, 0, 1}), false};
    gradcheck_tables(ctx, emb_fn, &plain, 1, (int64_t[]){6}, 4, 40);
    emb_case transposed = {make_indices(ctx, NB_I32, NB_SHAPE(2, 2, 3), 5, 41), true};
    gradcheck_tables(ctx, emb_fn, &transposed, 1, (int64_t[]){3}, 5, 42);
}

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

/* ---- the GPT's input: nb__embedding_pos ---- */
START_TEST(test_pos_forward) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    enum { V = 11, C = 5, N = 3, T = 4, P = 6 };
    const nb_dtype wdt[2] = {NB_F32, NB_F64};
    for (int wi = 0; wi < 2; wi++) {
        nb_tensor *te = nbt_randn(ctx, wdt[wi], NB_SHAPE(V, C), 50), *pe = nbt_randn(ctx, wdt[wi], NB_SHAPE(P, C), 51);
        nb_tensor *idx = make_indices(ctx, wi ? NB_I32 : NB_I64, NB_SHAPE(N, T), V, 52);
        nb_tensor *out = nb__embedding_pos(ctx, te, pe, idx, wdt[wi]);
        ck_assert_int_eq(out->ndim, 3);
        ck_assert_int_eq(out->shape[2], C);
        double tv[V * C], pv[P * C], iv[N * T], expect[N * T * C];
        nb_to_host_f64(te, tv);
        nb_to_host_f64(pe, pv);
        nb_to_host_f64(idx, iv);
        for (int p = 0; p < N * T; p++)
            for (int j = 0; j < C; j++) expect[p * C + j] = tv[(int)iv[p] * C + j] + pv[(p % T) * C + j];
        nbt_assert_close(out, expect, wi ? 0 : 1e-6, wi ? 0 : 1e-6);
    }
    nb_ctx_free(ctx);
}
END_TEST

static bool same_bits(const nb_tensor *a, const nb_tensor *b) {
    return a->dtype == b->dtype && nb_numel(a) == nb_numel(b) &&
           !memcmp(a->data, b->data, (size_t)nb_numel(a) * nb_dtype_size(a->dtype));
}

/* The values of what the GPT computed before: the two gathers, the f32 add,
 * the cast to the compute dtype. Scaled tables, so that many sums round. */
START_TEST(test_pos_same_bits_as_add_and_cast) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *te = nb_mul_scalar(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(40, 33), 60), 37.0);
    nb_tensor *pe = nb_mul_scalar(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(9, 33), 61), 0.013);
    nb_tensor *idx = make_indices(ctx, NB_I64, NB_SHAPE(4, 7), 40, 62);
    nb_tensor *sum = nb_add(ctx, nb_embedding(ctx, te, idx), nb_embedding(ctx, pe, nb_arange(ctx, NB_I64, 0, 7, 1)));
    ck_assert(same_bits(nb__embedding_pos(ctx, te, pe, idx, NB_F32), sum));
    const nb_dtype half[2] = {NB_BF16, NB_F16};
    for (int h = 0; h < 2; h++)
        ck_assert_msg(same_bits(nb__embedding_pos(ctx, te, pe, idx, half[h]), nb_cast(ctx, sum, half[h])),
                      "%s: not the bits of the f32 add and the cast", nb_dtype_name(half[h]));
    nb_ctx_free(ctx);
}
END_TEST

typedef struct pos_case {
    nb_tensor *idx;
    bool tied; /* both tables also used by a product after the embedding */
} pos_case;

/* y = wte[idx] + wpe[:T]; tied: y @ wte^T and y @ wpe^T, squared, so that
 * the products' parts of the gradients reach the tables first */
static nb_tensor *pos_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const pos_case *e = user;
    nb_tensor *y = nb__embedding_pos(ctx, in[0], in[1], e->idx, NB_F64);
    if (!e->tied) return y;
    nb_tensor *a = nb_matmul(ctx, y, nb_transpose(ctx, in[0], 0, 1));
    nb_tensor *b = nb_matmul(ctx, y, nb_transpose(ctx, in[1], 0, 1));
    return nb_add(ctx, nb_sum_all(ctx, nb_mul(ctx, a, a)), nb_sum_all(ctx, nb_mul(ctx, b, b)));
}

NBT_CPU_TEST(test_pos_gradcheck) {
    for (int tied = 0; tied < 2; tied++) {
        pos_case e = {make_indices(ctx, tied ? NB_I32 : NB_I64, NB_SHAPE(3, 4), 6, 70 + tied), tied};
        gradcheck_tables(ctx, pos_fn, &e, 2, (int64_t[]){6, 7}, 5, 72);
    }
}

/* The backward's sums added into gradients that hold values (the tied
 * case, and a second backward) equal, bit for bit, the old way's: a
 * gradient tensor of its own per table, then an add. f32 and bf16
 * gradients (a bf16 output from f32 tables). */
START_TEST(test_pos_backward_in_place_bits) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    enum { V = 13, C = 70, N = 5, T = 6, P = 8 };
    const nb_dtype odt[2] = {NB_F32, NB_BF16};
    for (int o = 0; o < 2; o++) {
        nb_ctx *sc = nb_ctx_new(nb_cpu(), 0);
        if (odt[o] != NB_F32) nb_ctx_set_compute_dtype(sc, odt[o]);
        nb_tensor *te = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(V, C), 80);
        nb_tensor *pe = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(P, C), 81);
        nb_tensor *idx = make_indices(ctx, NB_I64, NB_SHAPE(N, T), V, 82); /* repeats, rows missed */
        nb_tensor *g = nb_cast(sc, nbt_randn(ctx, NB_F32, NB_SHAPE(N, T, C), 83), odt[o]);
        nb_tensor *old_te = nbt_randn(ctx, NB_F32, NB_SHAPE(V, C), 84);
        nb_tensor *old_pe = nbt_randn(ctx, NB_F32, NB_SHAPE(P, C), 85);
        /* the gradients already hold values: the in-place path */
        nb_set_grad(te, nb_clone(ctx, old_te));
        nb_set_grad(pe, nb_clone(ctx, old_pe));
        nb_backward_with(nb__embedding_pos(sc, te, pe, idx, odt[o]), g);
        /* the old way: the GPT's graph before (two gathers, the f32 add
         * broadcasting the positions, the cast), into fresh gradients */
        nb_tensor *te2 = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(V, C), 80);
        nb_tensor *pe2 = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(P, C), 81);
        nb_tensor *sum = nb_add(sc, nb_embedding(sc, te2, idx), nb_embedding(sc, pe2, nb_arange(sc, NB_I64, 0, T, 1)));
        nb_backward_with(odt[o] == NB_F32 ? sum : nb_cast(sc, sum, odt[o]), g);
        nb_tensor *want_te = nb_add(ctx, old_te, te2->grad), *want_pe = nb_add(ctx, old_pe, pe2->grad);
        ck_assert_msg(same_bits(te->grad, want_te), "%s: token table's gradient", nb_dtype_name(odt[o]));
        ck_assert_msg(same_bits(pe->grad, want_pe), "%s: position table's gradient", nb_dtype_name(odt[o]));
        /* rows no index hits kept their values exactly; rows >= T too */
        double tv[P * C], ov[P * C];
        nb_to_host_f64(pe->grad, tv);
        nb_to_host_f64(old_pe, ov);
        for (int i = T * C; i < P * C; i++) ck_assert(tv[i] == ov[i]);
        nb_ctx_free(sc);
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_pos_errors) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *te = nb_zeros(ctx, NB_F32, NB_SHAPE(10, 4)), *pe = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 4));
    nb_tensor *idx = nb_zeros(ctx, NB_I64, NB_SHAPE(2, 3));
    NBT_EXPECT_ABORT(nb__embedding_pos(ctx, te, pe, nb_zeros(ctx, NB_I64, NB_SHAPE(2, 4)), NB_F32),
                     "nb_embedding (token + position): 4 positions, the position table (3, 4) has 3 rows");
    NBT_EXPECT_ABORT(nb__embedding_pos(ctx, te, nb_zeros(ctx, NB_F32, NB_SHAPE(3, 5)), idx, NB_F32),
                     "token table (10, 4) and position table (3, 5) differ in width");
    NBT_EXPECT_ABORT(nb__embedding_pos(ctx, te, pe, nb_zeros(ctx, NB_I64, NB_SHAPE(6)), NB_F32),
                     "indices must be (N, T), got (6,)");
    NBT_EXPECT_ABORT(nb__embedding_pos(ctx, te, pe, idx, NB_F64),
                     "output dtype f64 for f32 tables");
    int64_t bad[6] = {0, 1, 2, 3, 10, 4};
    NBT_EXPECT_ABORT(nb__embedding_pos(ctx, te, pe, nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), bad), NB_F32),
                     "index 10 at position 4 is out of range for 10 rows");
    nb_ctx_free(ctx);
}
END_TEST

static Suite *embedding_suite(void) {
    const TTest *tests[] = {test_forward_shapes_dtypes, test_forward_strided, test_backward_repeated_indices,
                             test_gradcheck, test_errors, test_pos_forward,
                             test_pos_same_bits_as_add_and_cast, test_pos_gradcheck,
                             test_pos_backward_in_place_bits, test_pos_errors, NULL};
    return nbt_suite("embedding", "embedding", 0, tests);
}

int main(void) { return nbt_run(embedding_suite()); }
