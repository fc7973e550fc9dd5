/* Tests of nb_matmul and nb_matmul_t: values against a naive triple loop in
 * double over the logical elements, every transpose combination, batched
 * and broadcast batch dims, non-contiguous operands (and that BLAS-readable
 * views are not copied), zero-size dims, gradient checks, and the error
 * messages; and the attention's causal products (nb__sgemm_causal) against
 * the same kind of loop. */
#include <math.h>
#include <stdlib.h>

#include "tensor/cpu/sgemm.h"
#include "testutil.h"

/* ---- reference ---- */

typedef struct ref_out {
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    double *v; /* row-major, malloc'd */
} ref_out;

/* Row-major flat index into t's logical elements of (batch index l aligned
 * right to nbd output batch dims, matrix element (r, c) of the stored
 * last two dims). */
static int64_t flat_of(const nb_tensor *t, int nbd, const int64_t *l, int64_t r, int64_t c) {
    int tb = t->ndim - 2;
    int64_t f = 0;
    for (int d = 0; d < tb; d++) {
        int i = nbd - tb + d;
        f = f * t->shape[d] + (t->shape[d] == 1 ? 0 : l[i]);
    }
    f = f * t->shape[tb] + r;
    return f * t->shape[tb + 1] + c;
}

static ref_out ref_matmul(const nb_tensor *a, const nb_tensor *b, bool ta, bool tb) {
    double *av = malloc(sizeof(double) * (size_t)(nb_numel(a) + 1));
    double *bv = malloc(sizeof(double) * (size_t)(nb_numel(b) + 1));
    nb_to_host_f64(a, av);
    nb_to_host_f64(b, bv);
    ref_out o = {0};
    o.ndim = a->ndim > b->ndim ? a->ndim : b->ndim;
    int nbd = o.ndim - 2;
    for (int i = 0; i < nbd; i++) {
        int da = a->ndim - 2 - nbd + i, db = b->ndim - 2 - nbd + i;
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        o.shape[i] = sa > sb ? sa : sb;
    }
    int64_t m = ta ? a->shape[a->ndim - 1] : a->shape[a->ndim - 2];
    int64_t k = ta ? a->shape[a->ndim - 2] : a->shape[a->ndim - 1];
    int64_t n = tb ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
    o.shape[nbd] = m;
    o.shape[nbd + 1] = n;
    int64_t batch = 1;
    for (int i = 0; i < nbd; i++) batch *= o.shape[i];
    o.v = malloc(sizeof(double) * (size_t)(batch * m * n + 1));
    int64_t l[NB_MAX_DIMS] = {0};
    for (int64_t j = 0; j < batch; j++) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < n; c++) {
                double s = 0;
                for (int64_t q = 0; q < k; q++) {
                    double x = av[ta ? flat_of(a, nbd, l, q, r) : flat_of(a, nbd, l, r, q)];
                    double y = bv[tb ? flat_of(b, nbd, l, c, q) : flat_of(b, nbd, l, q, c)];
                    s += x * y;
                }
                o.v[(j * m + r) * n + c] = s;
            }
        for (int i = nbd - 1; i >= 0 && ++l[i] == o.shape[i]; i--) l[i] = 0;
    }
    free(av);
    free(bv);
    return o;
}

static void check_against_ref(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool ta,
                              bool tb, double tol) {
    ref_out r = ref_matmul(a, b, ta, tb);
    ck_assert_int_eq(out->ndim, r.ndim);
    for (int d = 0; d < r.ndim; d++) ck_assert_int_eq(out->shape[d], r.shape[d]);
    nbt_assert_close(out, r.v, tol, tol);
    free(r.v);
}

/* ---- forward ---- */

static const nb_dtype dtypes[2] = {NB_F64, NB_F32};
static const double tols[2] = {1e-11, 2e-5};

NBT_CPU_TEST(test_2d_all_transposes) {
    int64_t m = 5, k = 7, n = 3;
    for (int di = 0; di < 2; di++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                nb_tensor *a = ta ? nbt_randn(ctx, dtypes[di], NB_SHAPE(k, m), 1)
                                  : nbt_randn(ctx, dtypes[di], NB_SHAPE(m, k), 1);
                nb_tensor *b = tb ? nbt_randn(ctx, dtypes[di], NB_SHAPE(n, k), 2)
                                  : nbt_randn(ctx, dtypes[di], NB_SHAPE(k, n), 2);
                nb_tensor *c = nb_matmul_t(ctx, a, b, ta, tb);
                ck_assert_int_eq(c->dtype, dtypes[di]);
                check_against_ref(c, a, b, ta, tb, tols[di]);
            }
    nb_tensor *a = nbt_randn(ctx, NB_F64, NB_SHAPE(4, 6), 3), *b = nbt_randn(ctx, NB_F64, NB_SHAPE(6, 2), 4);
    check_against_ref(nb_matmul(ctx, a, b), a, b, false, false, 1e-12);
}

NBT_CPU_TEST(test_f32_against_f64) {
    nb_tensor *a = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 33, 40), 5);
    nb_tensor *b = nbt_randn(ctx, NB_F64, NB_SHAPE(40, 17), 6);
    nb_tensor *c64 = nb_matmul(ctx, a, b);
    nb_tensor *c32 = nb_matmul(ctx, nb_cast(ctx, a, NB_F32), nb_cast(ctx, b, NB_F32));
    ck_assert_int_eq(c32->dtype, NB_F32);
    nbt_assert_tensors_close(c32, c64, 1e-4, 1e-4);
}

typedef struct bcase {
    int na, nb;
    int64_t sa[4], sb[4]; /* stored shapes */
    bool ta, tb;
} bcase;

static const bcase batch_cases[] = {
    {3, 3, {4, 3, 5}, {4, 5, 2}, false, false},
    {4, 4, {2, 3, 4, 5}, {2, 3, 5, 6}, false, false},
    {3, 3, {2, 5, 3}, {2, 6, 5}, true, true},
    {3, 3, {2, 3, 5}, {2, 6, 5}, false, true},
    {3, 3, {2, 5, 3}, {2, 5, 6}, true, false},
    /* b shared by the batch (folded into one GEMM when a allows it) */
    {3, 2, {4, 3, 5}, {5, 6}, false, false},
    {3, 2, {4, 3, 5}, {6, 5}, false, true},
    {3, 2, {4, 5, 3}, {5, 6}, true, false},
    {4, 3, {2, 3, 4, 5}, {1, 5, 6}, false, false},
    /* a shared by the batch */
    {2, 3, {4, 5}, {3, 5, 6}, false, false},
    {2, 3, {5, 4}, {3, 6, 5}, true, true},
    /* both broadcast */
    {4, 3, {2, 1, 4, 5}, {3, 5, 6}, false, false},
    {4, 4, {1, 3, 4, 5}, {2, 1, 6, 5}, false, true},
};

NBT_CPU_TEST(test_batched_and_broadcast) {
    for (size_t i = 0; i < sizeof batch_cases / sizeof batch_cases[0]; i++) {
        const bcase *bc = &batch_cases[i];
        for (int di = 0; di < 2; di++) {
            nb_tensor *a = nbt_randn(ctx, dtypes[di], bc->na, bc->sa, 10 + i);
            nb_tensor *b = nbt_randn(ctx, dtypes[di], bc->nb, bc->sb, 20 + i);
            check_against_ref(nb_matmul_t(ctx, a, b, bc->ta, bc->tb), a, b, bc->ta, bc->tb, tols[di]);
        }
    }
}

/* Linear-layer shape, large enough that OpenBLAS uses its threaded path. */
NBT_CPU_TEST(test_large_folded) {
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(4, 32, 64), 30);
    nb_tensor *w = nbt_randn(ctx, NB_F32, NB_SHAPE(64, 96), 31);
    check_against_ref(nb_matmul(ctx, x, w), x, w, false, false, 1e-4);
    nb_tensor *wt = nbt_randn(ctx, NB_F32, NB_SHAPE(96, 64), 32);
    check_against_ref(nb_matmul_t(ctx, x, wt, false, true), x, wt, false, true, 1e-4);
}

/* Bytes of data a matmul allocated beyond its output. */
static size_t extra_bytes(nb_ctx *ctx, nb_tensor *a, nb_tensor *b, bool ta, bool tb) {
    size_t before = nb_ctx_used(ctx);
    nb_tensor *c = nb_matmul_t(ctx, a, b, ta, tb);
    size_t out = ((size_t)nb_numel(c) * nb_dtype_size(c->dtype) + 63) / 64 * 64;
    check_against_ref(c, a, b, ta, tb, 1e-11);
    return nb_ctx_used(ctx) - before - out;
}

START_TEST(test_noncontiguous) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *vctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a_km = nbt_randn(ctx, NB_F64, NB_SHAPE(6, 4), 40);  /* (K, M) */
    nb_tensor *b_nk = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 6), 41);  /* (N, K) */
    nb_tensor *b_big = nbt_randn(ctx, NB_F64, NB_SHAPE(12, 6), 42);
    nb_tensor *a3 = nbt_randn(ctx, NB_F64, NB_SHAPE(4, 2, 6), 43); /* (M, B, K) */
    nb_tensor *a1 = nbt_randn(ctx, NB_F64, NB_SHAPE(1, 4, 6), 44);

    /* transposed views: read in place through the BLAS transpose flag */
    nb_tensor *at = nb_transpose(vctx, a_km, 0, 1), *bt = nb_transpose(vctx, b_nk, 0, 1);
    ck_assert_uint_eq(extra_bytes(vctx, at, bt, false, false), 0);
    ck_assert_uint_eq(extra_bytes(vctx, at, b_nk, false, true), 0);
    ck_assert_uint_eq(extra_bytes(vctx, at, at, true, false), 0); /* at^T @ at */
    /* every other row: row stride 2K, still in place */
    nb_tensor *rows = nb_slice(vctx, b_big, 0, 0, 12, 2); /* (6, 6) */
    ck_assert_uint_eq(extra_bytes(vctx, at, rows, false, false), 0);
    /* every other column of a transposed matrix: unit row stride, in place */
    nb_tensor *tcols = nb_slice(vctx, nb_transpose(vctx, b_big, 0, 1), 1, 0, 12, 2); /* (6, 6) */
    ck_assert_uint_eq(extra_bytes(vctx, at, tcols, false, false), 0);
    /* every other column: no unit stride, copied */
    nb_tensor *cols = nb_slice(vctx, nb_reshape(vctx, b_big, NB_SHAPE(6, 12)), 1, 0, 12, 2);
    ck_assert_uint_gt(extra_bytes(vctx, at, cols, false, false), 0);
    nb_tensor *cols2 = nb_slice(vctx, b_big, 1, 0, 6, 2); /* (12, 3), column stride 2 */
    nb_tensor *a12 = nbt_randn(ctx, NB_F64, NB_SHAPE(5, 12), 45);
    check_against_ref(nb_matmul(vctx, a12, cols2), a12, cols2, false, false, 1e-11);
    /* permuted batch: (B, M, K) with batch stride K, row stride B*K */
    nb_tensor *ap = nb_permute(vctx, a3, (int[]){1, 0, 2});
    ck_assert_uint_eq(extra_bytes(vctx, ap, bt, false, false), 0);
    ck_assert_uint_eq(extra_bytes(vctx, ap, b_nk, false, true), 0);
    /* expanded batch (stride 0) */
    nb_tensor *ae = nb_expand(vctx, a1, NB_SHAPE(3, 4, 6));
    ck_assert_uint_eq(extra_bytes(vctx, ae, bt, false, false), 0);
    nb_tensor *b3 = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 6, 2), 46);
    check_against_ref(nb_matmul(vctx, ae, b3), ae, b3, false, false, 1e-11);
    nb_ctx_free(vctx);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_zero_size) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *octx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3, 0), 50);
    nb_tensor *b = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(0, 4), 51);
    /* K = 0 must write zeros, not leave the arena's old contents */
    nb_fill_(nb_empty(octx, NB_F64, NB_SHAPE(2, 3, 4)), NAN);
    nb_ctx_reset(octx);
    nb_tensor *c = nb_matmul(octx, a, b);
    ck_assert_int_eq(c->ndim, 3);
    ck_assert_int_eq(c->shape[2], 4);
    double zeros[24] = {0};
    nbt_assert_close(c, zeros, 0, 0);
    nb_backward_with(c, nb_ones(octx, NB_F64, NB_SHAPE(2, 3, 4)));
    ck_assert_int_eq(nb_numel(a->grad), 0);
    ck_assert_int_eq(b->grad->shape[0], 0);
    ck_assert_int_eq(b->grad->shape[1], 4);

    nb_tensor *e = nb_matmul(octx, nbt_randn(ctx, NB_F64, NB_SHAPE(0, 5), 52),
                             nbt_randn(ctx, NB_F64, NB_SHAPE(5, 3), 53));
    ck_assert_int_eq(e->shape[0], 0);
    ck_assert_int_eq(e->shape[1], 3);
    nb_tensor *f = nb_matmul(octx, nbt_randn(ctx, NB_F32, NB_SHAPE(0, 2, 5), 54),
                             nbt_randn(ctx, NB_F32, NB_SHAPE(5, 3), 55));
    ck_assert_int_eq(f->ndim, 3);
    ck_assert_int_eq(nb_numel(f), 0);
    nb_ctx_free(octx);
    nb_ctx_free(ctx);
}
END_TEST

/* ---- gradients ---- */

enum view { V_NONE, V_TRANSPOSE, V_SLICE_ROWS, V_SLICE_COLS };

typedef struct gcase {
    bool ta, tb;
    enum view va, vb; /* view applied to the leaf inside the function */
    bool same;        /* b is a itself */
} gcase;

static nb_tensor *apply_view(nb_ctx *ctx, nb_tensor *x, enum view v) {
    switch (v) {
    case V_TRANSPOSE: return nb_transpose(ctx, x, -1, -2);
    case V_SLICE_ROWS: return nb_slice(ctx, x, -2, 0, x->shape[x->ndim - 2], 2);
    case V_SLICE_COLS: return nb_slice(ctx, x, -1, 0, x->shape[x->ndim - 1], 2);
    default: return x;
    }
}

static nb_tensor *mm_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const gcase *g = user;
    nb_tensor *a = apply_view(ctx, in[0], g->va);
    nb_tensor *b = g->same ? a : apply_view(ctx, in[1], g->vb);
    return nb_matmul_t(ctx, a, b, g->ta, g->tb);
}

static void gradcheck_case(int na, const int64_t *sa, int nb, const int64_t *sb, gcase g,
                           uint64_t seed) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *in[2] = {nbt_randn_leaf(ctx, NB_F64, na, sa, seed),
                        nbt_randn_leaf(ctx, NB_F64, nb, sb, seed + 1)};
    NBT_GRADCHECK(mm_fn, &g, 2, in);
    nb_ctx_free(ctx);
}

START_TEST(test_grad_2d_transposes) {
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int64_t sa[2] = {ta ? 4 : 3, ta ? 3 : 4}, sb[2] = {tb ? 5 : 4, tb ? 4 : 5};
            gradcheck_case(2, sa, 2, sb, (gcase){ta, tb, V_NONE, V_NONE, false}, (uint64_t)(100 + ta * 2 + tb));
        }
}
END_TEST

START_TEST(test_grad_batched_broadcast) {
    for (size_t i = 0; i < sizeof batch_cases / sizeof batch_cases[0]; i++) {
        const bcase *bc = &batch_cases[i];
        gradcheck_case(bc->na, bc->sa, bc->nb, bc->sb, (gcase){bc->ta, bc->tb, V_NONE, V_NONE, false},
                       200 + 2 * i);
    }
}
END_TEST

START_TEST(test_grad_noncontiguous) {
    /* leaves (K, M) and (N, K) used as (M, K) and (K, N) through views */
    gradcheck_case(2, (int64_t[]){4, 3}, 2, (int64_t[]){5, 4},
                   (gcase){false, false, V_TRANSPOSE, V_TRANSPOSE, false}, 300);
    /* transposed view, transposed again by the flag */
    gradcheck_case(3, (int64_t[]){2, 3, 4}, 2, (int64_t[]){4, 5},
                   (gcase){true, false, V_TRANSPOSE, V_NONE, false}, 302);
    /* strided rows (in place) and strided columns (copied) */
    gradcheck_case(3, (int64_t[]){2, 6, 4}, 2, (int64_t[]){4, 10},
                   (gcase){false, false, V_SLICE_ROWS, V_SLICE_COLS, false}, 304);
    gradcheck_case(2, (int64_t[]){3, 8}, 3, (int64_t[]){2, 4, 5},
                   (gcase){false, false, V_SLICE_COLS, V_NONE, false}, 306);
    /* x @ x^T: both gradients land on one leaf */
    gradcheck_case(2, (int64_t[]){3, 4}, 2, (int64_t[]){1, 1},
                   (gcase){false, true, V_NONE, V_NONE, true}, 308);
}
END_TEST

/* The b-shared fold in backward against the plain batched formula. */
NBT_CPU_TEST(test_grad_shared_weight_values) {
    int64_t B = 3, M = 4, K = 5, N = 6;
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(B, M, K), 60);
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(K, N), 61);
    nb_tensor *gy = nbt_randn(ctx, NB_F64, NB_SHAPE(B, M, N), 62);
    nb_backward_with(nb_matmul(ctx, x, w), gy);
    double xv[60], gv[72], expect[30] = {0};
    nb_to_host_f64(x, xv);
    nb_to_host_f64(gy, gv);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++)
                for (int64_t j = 0; j < N; j++)
                    expect[k * N + j] += xv[(b * M + i) * K + k] * gv[(b * M + i) * N + j];
    nbt_assert_close(w->grad, expect, 1e-12, 1e-12);
    /* a second backward accumulates into the leaf's gradient */
    nb_backward_with(nb_matmul(ctx, x, w), gy);
    for (int i = 0; i < 30; i++) expect[i] *= 2;
    nbt_assert_close(w->grad, expect, 1e-12, 1e-12);
}

/* ---- errors ---- */


/* ---- nb__sgemm_causal (Note [Causal products]) ---- */

/* op(a) (m x k) and op(b) (k x n) stored with leading dimensions wider
 * than the matrices (as the attention's views into qkv are), entries
 * outside the structure's promise set to zero, against a double loop over
 * the whole product. */
static void check_causal(nb__tri tri, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                         uint32_t seed) {
    int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
    int64_t ar = ta ? k : m, br = tb ? n : k;
    float *a = malloc(sizeof(float) * (size_t)(ar * lda)), *b = malloc(sizeof(float) * (size_t)(br * ldb));
    float *c = malloc(sizeof(float) * (size_t)(m * ldc));
    uint32_t x = seed;
    for (int64_t i = 0; i < ar * lda; i++) {
        x = x * 1664525u + 1013904223u;
        a[i] = (float)((x >> 8) % 2001) / 1000.0f - 1.0f;
    }
    for (int64_t i = 0; i < br * ldb; i++) {
        x = x * 1664525u + 1013904223u;
        b[i] = (float)((x >> 8) % 2001) / 1000.0f - 1.0f;
    }
    for (int64_t i = 0; i < m; i++) /* the zeros the structure promises */
        for (int64_t p = 0; p < k; p++)
            if ((tri == NB_TRI_K_UPTO_ROW && p > i) || (tri == NB_TRI_K_FROM_ROW && p < i))
                a[ta ? p * lda + i : i * lda + p] = 0.0f;
    for (int64_t i = 0; i < m * ldc; i++) c[i] = NAN; /* c is written, not read */
    nb__sgemm_causal(tri, ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            double e = 0, mag = 0;
            for (int64_t p = 0; p < k; p++) {
                double t = (double)a[ta ? p * lda + i : i * lda + p] * b[tb ? j * ldb + p : p * ldb + j];
                e += t;
                mag += fabs(t);
            }
            float got = c[i * ldc + j];
            if (tri == NB_TRI_LOWER && j > i) continue; /* may be left unwritten */
            ck_assert_msg(fabs(got - e) <= 1e-5 * mag + 1e-6,
                          "tri %d ta %d tb %d (%lld x %lld x %lld): c[%lld][%lld] = %.9g, expected %.9g",
                          (int)tri, ta, tb, (long long)m, (long long)n, (long long)k, (long long)i,
                          (long long)j, got, e);
        }
        for (int64_t j = n; j < ldc; j++) ck_assert(isnan(c[i * ldc + j])); /* nothing past n */
    }
    free(a);
    free(b);
    free(c);
}

/* Every structure and transpose on sizes around the 6 x 16 tile (partial
 * row and column panels, k of 1, m != k), long k, and square causal
 * shapes like the attention's; with the tile kernel and through OpenBLAS
 * (the fallback). */
START_TEST(test_causal_products) {
    static const int64_t sizes[][3] = {{1, 1, 1},   {6, 16, 6},   {7, 17, 7},   {5, 3, 5},
                                       {13, 33, 13}, {64, 32, 64}, {96, 64, 96}, {31, 20, 47},
                                       {47, 20, 31}, {130, 40, 130}, {300, 24, 300}, {40, 600, 40}};
    int prev = nb__sgemm_set_enabled(1);
    for (int on = 2; on >= 0; on--) { /* the widest tile, the AVX2 tile, OpenBLAS */
        nb__sgemm_set_enabled(on > 0);
        nb__sgemm_set_width(on == 1 ? 256 : 0);
        uint32_t seed = 1;
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (int tri = 0; tri < 4; tri++)
                for (int t = 0; t < 4; t++) {
                    int64_t m = sizes[s][0], n = sizes[s][1], k = sizes[s][2];
                    if (tri == NB_TRI_LOWER) n = m; /* a square score matrix */
                    check_causal((nb__tri)tri, t & 1, t & 2, m, n, k, seed++);
                }
    }
    nb__sgemm_set_enabled(prev);
    nb__sgemm_set_width(0); /* back to the widest */
}
END_TEST

/* The AVX-512 tile (8 x 16) against the AVX2 tile (6 x 16) on an AVX-512
 * CPU: the same values, element for element (Note [Causal products]: one
 * FMA chain a element, k in order, wherever the tiles fall), on the
 * attention's shapes and ragged ones. */
START_TEST(test_causal_widths_agree) {
    nb__sgemm_set_width(0);
    if (!nb__sgemm_kernel_on() || nb__sgemm_width() != 512) return;
    static const int64_t sizes[][3] = {{128, 64, 128}, {37, 19, 37}, {9, 16, 9}, {130, 40, 130}};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int tri = 0; tri < 4; tri++)
            for (int t = 0; t < 4; t++) {
                bool ta = t & 1, tb = t & 2;
                int64_t m = sizes[s][0], k = sizes[s][2], n = tri == NB_TRI_LOWER ? m : sizes[s][1];
                int64_t lda = (ta ? m : k) + 1, ldb = (tb ? k : n) + 3, ar = ta ? k : m, br = tb ? n : k;
                float *a = malloc(sizeof(float) * (size_t)(ar * lda)), *b = malloc(sizeof(float) * (size_t)(br * ldb));
                float *c[2] = {malloc(sizeof(float) * (size_t)(m * n)), malloc(sizeof(float) * (size_t)(m * n))};
                uint32_t x = (uint32_t)(s * 16 + (size_t)tri * 4 + (size_t)t + 7);
                for (int64_t i = 0; i < ar * lda; i++) {
                    x = x * 1664525u + 1013904223u;
                    a[i] = (float)(int32_t)x * 0x1p-31f;
                }
                for (int64_t i = 0; i < br * ldb; i++) {
                    x = x * 1664525u + 1013904223u;
                    b[i] = (float)(int32_t)x * 0x1p-31f;
                }
                for (int64_t i = 0; i < m; i++)
                    for (int64_t p = 0; p < k; p++)
                        if ((tri == NB_TRI_K_UPTO_ROW && p > i) || (tri == NB_TRI_K_FROM_ROW && p < i))
                            a[ta ? p * lda + i : i * lda + p] = 0.0f;
                for (int w = 0; w < 2; w++) {
                    nb__sgemm_set_width(w ? 512 : 256);
                    nb__sgemm_causal((nb__tri)tri, ta, tb, m, n, k, a, lda, b, ldb, c[w], n);
                }
                for (int64_t i = 0; i < m; i++)
                    for (int64_t j = 0; j < n; j++)
                        if (tri != NB_TRI_LOWER || j <= i)
                            ck_assert_msg(c[0][i * n + j] == c[1][i * n + j],
                                          "tri %d ta %d tb %d (%lld x %lld x %lld): c[%lld][%lld] %a (AVX2) %a (AVX-512)",
                                          tri, ta, tb, (long long)m, (long long)n, (long long)k, (long long)i,
                                          (long long)j, c[0][i * n + j], c[1][i * n + j]);
                free(a), free(b), free(c[0]), free(c[1]);
            }
    nb__sgemm_set_width(0);
}
END_TEST

/* LOWER leaves the tiles strictly above the diagonal alone (that is what
 * it saves), and the K ranges drop terms: a NaN in op(b)'s row p reaches
 * only the rows of c whose range includes p. */
static void causal_skips(void) {
    enum { T = 40, D = 8 };
    const int mr = nb__sgemm_tile_rows(); /* 6, or 8 with AVX-512 */
    float q[T * D], kk[T * D], s[T * T], v[T * D], p[T * T], y[T * D];
    for (int i = 0; i < T * D; i++) q[i] = kk[i] = v[i] = 0.5f;
    for (int i = 0; i < T * T; i++) s[i] = -7.0f;
    nb__sgemm_causal(NB_TRI_LOWER, false, true, T, T, D, q, D, kk, D, s, T);
    for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) {
            if (j <= i) ck_assert_float_eq(s[i * T + j], 2.0f);
            if (j >= (i / mr) * mr + mr + 16) ck_assert_float_eq(s[i * T + j], -7.0f);
        }
    for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) p[i * T + j] = j <= i ? 1.0f : 0.0f;
    v[30 * D + 3] = NAN; /* row 30 of v */
    nb__sgemm_causal(NB_TRI_K_UPTO_ROW, false, false, T, D, T, p, T, v, D, y, D);
    for (int i = 0; i < T; i++) {
        bool sees = i / mr * mr + mr > 30; /* row panels that reach k = 30 */
        ck_assert_msg(isnan(y[i * D + 3]) == (i >= 30 || sees), "row %d", i);
        if (i < 30 && !sees) ck_assert_float_eq(y[i * D + 3], 0.5f * (float)(i + 1));
    }
}

START_TEST(test_causal_skips) {
    if (!nb__sgemm_kernel_on()) return; /* the fallback computes everything */
    nb__sgemm_set_width(0);
    int widest = nb__sgemm_width();
    for (int w = 256; w <= widest; w += 256) {
        nb__sgemm_set_width(w);
        causal_skips();
    }
    nb__sgemm_set_width(0);
}
END_TEST

/* NABLA_CAUSAL_GEMM: 0 holds the products to OpenBLAS, 1 (or unset) lets the
 * kernel run, anything else is an error naming the value; read on first
 * use and again after nb__sgemm_set_enabled(-1). */
START_TEST(test_causal_env) {
    int prev = nb__sgemm_set_enabled(1);
    setenv("NABLA_CAUSAL_GEMM", "0", 1);
    nb__sgemm_set_enabled(-1);
    ck_assert(!nb__sgemm_kernel_on());
    setenv("NABLA_CAUSAL_GEMM", "1", 1);
    ck_assert(!nb__sgemm_kernel_on()); /* read once, not at every product */
    setenv("NABLA_CAUSAL_GEMM", "on", 1);
    nb__sgemm_set_enabled(-1); /* read again at the next use */
    NBT_EXPECT_ABORT(nb__sgemm_kernel_on(), "NABLA_CAUSAL_GEMM=on: expected 0");
    setenv("NABLA_CAUSAL_GEMM", "1", 1);
    nb__sgemm_set_enabled(0); /* an explicit setting wins over the environment */
    ck_assert(!nb__sgemm_kernel_on());
    unsetenv("NABLA_CAUSAL_GEMM");
    nb__sgemm_set_enabled(-1);
    float a[4] = {1, 2, 3, 4}, c[4];
    nb__sgemm_causal(NB_TRI_FULL, false, false, 2, 2, 2, a, 2, a, 2, c, 2); /* either path */
    ck_assert(c[0] == 7 && c[1] == 10 && c[2] == 15 && c[3] == 22);
    nb__sgemm_set_enabled(prev);
}
END_TEST

NBT_CPU_TEST(test_errors) {
    nb_tensor *a = nb_zeros(ctx, NB_F32, NB_SHAPE(32, 64));
    nb_tensor *b = nb_zeros(ctx, NB_F32, NB_SHAPE(32, 10));
    NBT_EXPECT_ABORT(nb_matmul(ctx, a, b), "nb_matmul: inner dimensions differ: (32, 64) @ (32, 10)");
    NBT_EXPECT_ABORT(nb_matmul_t(ctx, a, b, false, true),
                     "nb_matmul_t: inner dimensions differ: (32, 64) @ (32, 10)^T");
    nb_tensor *v = nb_zeros(ctx, NB_F32, NB_SHAPE(64));
    NBT_EXPECT_ABORT(nb_matmul(ctx, a, v), "nb_matmul: operands need at least 2 dims");
    NBT_EXPECT_ABORT(nb_matmul(ctx, v, b), "got (64,) @ (32, 10)");
    nb_tensor *s = nb_scalar(ctx, NB_F32, 1);
    NBT_EXPECT_ABORT(nb_matmul(ctx, s, s), "at least 2 dims");
    nb_tensor *d = nb_zeros(ctx, NB_F64, NB_SHAPE(64, 10));
    NBT_EXPECT_ABORT(nb_matmul(ctx, a, d), "nb_matmul: dtypes differ: f32 (32, 64) vs f64 (64, 10)");
    nb_tensor *i1 = nb_zeros(ctx, NB_I32, NB_SHAPE(2, 3)), *i2 = nb_zeros(ctx, NB_I32, NB_SHAPE(3, 2));
    NBT_EXPECT_ABORT(nb_matmul(ctx, i1, i2), "nb_matmul: dtype i32 is not supported");
    nb_tensor *p = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 4)), *q = nb_zeros(ctx, NB_F32, NB_SHAPE(5, 4, 6));
    NBT_EXPECT_ABORT(nb_matmul(ctx, p, q),
                     "nb_matmul: batch dimensions do not broadcast: (2, 3, 4) @ (5, 4, 6)");
}

static Suite *matmul_suite(void) {
    Suite *s = suite_create("matmul");
    nbt_suite_add(s, "forward", 0, (const TTest *[]){test_2d_all_transposes, test_f32_against_f64,
                  test_batched_and_broadcast, test_large_folded, test_noncontiguous, test_zero_size,
                  test_causal_products, test_causal_widths_agree, test_causal_skips, test_causal_env, NULL});
    nbt_suite_add(s, "backward", 0, (const TTest *[]){test_grad_2d_transposes, test_grad_batched_broadcast,
                  test_grad_noncontiguous, test_grad_shared_weight_values, NULL});
    nbt_suite_add(s, "errors", 0, (const TTest *[]){test_errors, NULL});
    return s;
}

int main(void) { return nbt_run(matmul_suite()); }
