/* Tests of the oneDNN wrapper (tensor/cpu/dnnl.c): matmul (f32; bf16
 * operands with an f32 product) and 2-D convolution forward and backward
 * (f32, bf16), each through oneDNN (mode forced) and through the path
 * without it (NABLA_DNNL=0's: OpenBLAS, or the bf16 -> f32 fallback),
 * against independent f64 loops written here; the primitive cache; the
 * NABLA_DNNL switch.
 *
 * Tolerances. With f32 accumulation the error of an output is bounded by
 * about K * 2^-24 times the sum of the absolute values of its terms (S); the
 * tests allow 1e-5 * S (K <= 200 here) plus 1e-5 relative. bf16 operands are
 * made exactly representable (the f32 values are rounded to bf16 before the
 * reference sees them), and a product of two bf16 values is exact in f32,
 * so a bf16 matmul with an f32 output meets the same bound. Where the output
 * itself is bf16 (convolutions in bf16) it carries one more rounding to an
 * 8-bit significand: 2^-8 relative to the output, on top. */
#include <cblas.h>
#include <dnnl.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/cpuinfo.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/matmul.h"
#include "testutil.h"

/* ---- data ---- */

static uint64_t lcg;

static double urand(void) {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(lcg >> 11) / 9007199254740992.0 * 2 - 1;
}

static int64_t numel(int nd, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    return n;
}

/* Random values in [-1, 1], rounded to bf16 when dt is bf16 (so that the
 * tensor holds them exactly); *host gets them as f64 (malloc'd). */
static nb_tensor *rand_tensor(nb_ctx *ctx, nb_dtype dt, int nd, const int64_t *shape,
                              double **host) {
    int64_t n = numel(nd, shape);
    float *f = malloc(sizeof(float) * (size_t)(n + 1));
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n + 1));
    double *d = malloc(sizeof(double) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++) {
        f[i] = (float)urand();
        h[i] = nb_f32_to_bf16(f[i]);
        if (dt == NB_BF16) f[i] = nb_bf16_to_f32(h[i]);
        d[i] = f[i];
    }
    nb_tensor *t = nb_from_host(ctx, dt, nd, shape, dt == NB_BF16 ? (void *)h : (void *)f);
    free(f);
    free(h);
    if (host) *host = d;
    else free(d);
    return t;
}

static double gelu_tanh(double x) {
    return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

/* |got - ref| <= 1e-5 (|ref| + S) (+ 2^-8 |ref| for a bf16 output). */
static void assert_bound(const char *what, int64_t n, const double *got, const double *ref,
                         const double *s, bool bf16_out) {
    for (int64_t i = 0; i < n; i++) {
        double tol = 1e-5 * (fabs(ref[i]) + s[i]) + (bf16_out ? ldexp(fabs(ref[i]), -8) : 0);
        ck_assert_msg(fabs(got[i] - ref[i]) <= tol,
                      "%s: element %lld is %.9g, reference %.9g (|terms| %.4g, tolerance %.3g)",
                      what, (long long)i, got[i], ref[i], s[i], tol);
    }
}

/* ---- matmul ---- */

typedef struct mm_case {
    int nda, ndb;
    int64_t sa[4], sb[4]; /* logical op(a), op(b) shapes */
    bool ta, tb;          /* operands passed transposed through the flags */
    bool view_a, view_b;  /* ... or as transposed views (strides) */
} mm_case;

static const mm_case mm_cases[] = {
    {2, 2, {7, 13}, {13, 5}, false, false, false, false},
    {2, 2, {7, 13}, {13, 5}, true, false, false, false},
    {2, 2, {7, 13}, {13, 5}, false, true, false, false},
    {2, 2, {7, 13}, {13, 5}, true, true, false, false},
    {2, 2, {7, 13}, {13, 5}, false, false, true, true},
    {3, 2, {4, 6, 9}, {9, 11}, false, true, false, false},      /* linear: batch folds */
    {3, 3, {4, 6, 9}, {4, 9, 11}, false, false, false, true},   /* batched */
    {4, 3, {2, 3, 5, 8}, {3, 8, 4}, true, false, false, false}, /* b broadcast over dim 0 */
    {3, 4, {1, 5, 8}, {2, 3, 8, 4}, false, true, false, false}, /* a broadcast */
    {2, 2, {1, 200}, {200, 1}, false, false, false, false},
};

/* The operand as the kernels get it: logical (.., R, C) values v, stored
 * transposed when trans (the flag) or view (a transposed view). */
static nb_tensor *mm_operand(nb_ctx *ctx, nb_dtype dt, int nd, const int64_t *logical, bool trans,
                             bool view, double **v) {
    int64_t st[4];
    memcpy(st, logical, sizeof(int64_t) * (size_t)nd);
    if (trans || view) {
        st[nd - 2] = logical[nd - 1];
        st[nd - 1] = logical[nd - 2];
    }
    double *stored;
    nb_tensor *t = rand_tensor(ctx, dt, nd, st, &stored);
    int64_t r = logical[nd - 2], c = logical[nd - 1], mats = numel(nd - 2, logical);
    *v = malloc(sizeof(double) * (size_t)(numel(nd, logical) + 1));
    for (int64_t l = 0; l < mats; l++)
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < c; j++)
                (*v)[(l * r + i) * c + j] =
                    (trans || view) ? stored[(l * c + j) * r + i] : stored[(l * r + i) * c + j];
    free(stored);
    return view ? nb_transpose(ctx, t, nd - 2, nd - 1) : t;
}

/* ref and S of (.., M, N) = a @ b (+ bias) (+ acc), broadcast batch dims. */
static void mm_reference(const mm_case *c, const double *a, const double *b, const double *bias,
                         const double *acc, int nd, const int64_t *oshape, double *ref,
                         double *s) {
    int nbd = nd - 2;
    int64_t m = oshape[nbd], n = oshape[nbd + 1], k = c->sa[c->nda - 1];
    int64_t batch = numel(nbd, oshape), idx[4] = {0};
    for (int64_t l = 0; l < batch; l++) {
        int64_t la = 0, lb = 0;
        for (int i = 0; i < nbd; i++) {
            int da = c->nda - 2 - nbd + i, db = c->ndb - 2 - nbd + i;
            if (da >= 0) la = la * c->sa[da] + (c->sa[da] == 1 ? 0 : idx[i]);
            if (db >= 0) lb = lb * c->sb[db] + (c->sb[db] == 1 ? 0 : idx[i]);
        }
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double r = 0, sa = 0;
                for (int64_t q = 0; q < k; q++) {
                    double t = a[(la * m + i) * k + q] * b[(lb * k + q) * n + j];
                    r += t;
                    sa += fabs(t);
                }
                int64_t o = (l * m + i) * n + j;
                if (bias) r += bias[j], sa += fabs(bias[j]);
                if (acc) r += acc[o], sa += fabs(acc[o]);
                ref[o] = r;
                s[o] = sa;
            }
        for (int i = nbd - 1; i >= 0 && ++idx[i] == oshape[i]; i--) idx[i] = 0;
    }
}

enum { V_PLAIN, V_BIAS, V_GELU, V_ACC, V_BIAS_GELU_PRE };

/* One case, dtype and variant through the CPU backend's matmul entry (the
 * one the op front end calls), in the given mode. */
/* Whether a product (or each convolution pass) in `mode` runs one oneDNN
 * primitive (1) or none (0); -1 where the test does not say. Forced: f32
 * always, bf16 where oneDNN has bf16 kernels (without them the key is
 * cached as unsupported; values are checked either way). Off: never. The
 * rule (checked for bf16): bf16 on native bf16 only, else the f32 fallback. */
static int dnnl_runs(nb_dtype dt, nb__dnnl_mode mode) {
    if (mode == NB_DNNL_OFF) return 0;
    /* (on a generic OpenBLAS core the bf16 fallback's f32 products may go to oneDNN too) */
    if (mode == NB_DNNL_AUTO)
        return dt == NB_BF16 && (nb__dnnl_native_bf16() || !nb__blas_generic()) ? nb__dnnl_native_bf16() : -1;
    return dt == NB_F32 || nb__dnnl_bf16_kernels() ? 1 : -1;
}

static void mm_check(int ci, nb_dtype dt, int variant, nb__dnnl_mode mode) {
    const mm_case *c = &mm_cases[ci];
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    lcg = 1000u + (uint64_t)ci * 31u + (uint64_t)variant;
    double *av, *bv, *biasv = NULL, *accv = NULL;
    nb_tensor *a = mm_operand(ctx, dt, c->nda, c->sa, c->ta, c->view_a, &av);
    nb_tensor *b = mm_operand(ctx, dt, c->ndb, c->sb, c->tb, c->view_b, &bv);
    int nd = c->nda > c->ndb ? c->nda : c->ndb, nbd = nd - 2;
    int64_t oshape[4];
    for (int i = 0; i < nbd; i++) {
        int da = c->nda - 2 - nbd + i, db = c->ndb - 2 - nbd + i;
        int64_t x = da >= 0 ? c->sa[da] : 1, y = db >= 0 ? c->sb[db] : 1;
        oshape[i] = x > y ? x : y;
    }
    oshape[nbd] = c->sa[c->nda - 2];
    oshape[nbd + 1] = c->sb[c->ndb - 1];
    int64_t n_out = numel(nd, oshape);
    nb_tensor *bias = NULL, *out, *pre = NULL;
    if (variant == V_BIAS || variant == V_GELU || variant == V_BIAS_GELU_PRE)
        bias = rand_tensor(ctx, NB_F32, 1, &oshape[nbd + 1], &biasv);
    if (variant == V_ACC) out = rand_tensor(ctx, NB_F32, nd, oshape, &accv);
    else out = nb_empty(ctx, NB_F32, nd, oshape);
    if (variant == V_BIAS_GELU_PRE) pre = nb_empty(ctx, NB_F32, nd, oshape);

    double *ref = malloc(sizeof(double) * (size_t)n_out);
    double *s = malloc(sizeof(double) * (size_t)n_out);
    double *got = malloc(sizeof(double) * (size_t)n_out);
    mm_reference(c, av, bv, biasv, accv, nd, oshape, ref, s);

    nb__dnnl_mode prev = nb__dnnl_set_mode(mode);
    int64_t ran = nb__dnnl_executions();
    bool gelu = variant == V_GELU || variant == V_BIAS_GELU_PRE;
    nb__cpu_backend.matmul(out, a, b, c->ta, c->tb,
                           &(nb__gemm_epilogue){.bias = bias, .gelu = gelu, .pre = pre,
                                                .accumulate = variant == V_ACC});
    ran = nb__dnnl_executions() - ran;
    nb__dnnl_set_mode(prev);
    int runs = dnnl_runs(dt, mode); /* one primitive */
    if (runs >= 0)
        ck_assert_msg(ran == runs,
                      "matmul case %d %s variant %d mode %d: %lld oneDNN executions", ci,
                      nb_dtype_name(dt), variant, (int)mode, (long long)ran);

    char what[128];
    snprintf(what, sizeof what, "matmul case %d %s variant %d mode %d", ci, nb_dtype_name(dt),
             variant, (int)mode);
    if (pre) {
        nb_to_host_f64(pre, got);
        assert_bound(what, n_out, got, ref, s, false);
    }
    if (gelu)
        for (int64_t i = 0; i < n_out; i++) ref[i] = gelu_tanh(ref[i]), s[i] = 1.2 * s[i] + 0.1;
    nb_to_host_f64(out, got);
    assert_bound(what, n_out, got, ref, s, false);
    free(av), free(bv), free(biasv), free(accv), free(ref), free(s), free(got);
    nb_ctx_free(ctx);
}

START_TEST(test_matmul_f32_dnnl) {
    for (int v = V_PLAIN; v <= V_BIAS_GELU_PRE; v++) mm_check(_i, NB_F32, v, NB_DNNL_FORCE);
}
END_TEST

START_TEST(test_matmul_f32_openblas) {
    for (int v = V_PLAIN; v <= V_BIAS_GELU_PRE; v++) mm_check(_i, NB_F32, v, NB_DNNL_OFF);
}
END_TEST

START_TEST(test_matmul_bf16_dnnl) {
    for (int v = V_PLAIN; v <= V_BIAS_GELU_PRE; v++) mm_check(_i, NB_BF16, v, NB_DNNL_FORCE);
}
END_TEST

START_TEST(test_matmul_bf16_fallback) {
    for (int v = V_PLAIN; v <= V_BIAS_GELU_PRE; v++) mm_check(_i, NB_BF16, v, NB_DNNL_OFF);
}
END_TEST

/* The default rule gives bf16 products to oneDNN where the CPU has native
 * bf16 (AVX512_BF16 or AMX), and to the f32 fallback elsewhere, also on
 * AVX-512 without BF16, where oneDNN would emulate bf16 (Note [oneDNN
 * dispatch]; test_dnnl_avx512 holds oneDNN to that ISA). */
START_TEST(test_matmul_bf16_auto) { mm_check(5, NB_BF16, V_BIAS, NB_DNNL_AUTO); }
END_TEST

NBT_CPU_TEST(test_matmul_bf16_needs_f32_out) {
    nb_tensor *a = rand_tensor(ctx, NB_BF16, 2, (int64_t[]){3, 4}, NULL);
    nb_tensor *out = nb_empty(ctx, NB_BF16, 2, (int64_t[]){3, 3});
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_OFF);
    NBT_EXPECT_ABORT(nb__cpu_gemm(out, a, a, false, true, false),
                     "need an f32 output, got bf16");
    nb__dnnl_set_mode(prev);
}

/* An operand expanded along a batch dim (stride 0, size > 1): every batch
 * element reads the same matrix, in both paths. */
static void expanded_check(nb__dnnl_mode mode, bool expand_a) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    lcg = 99;
    double *av, *bv;
    nb_tensor *a = rand_tensor(ctx, NB_F32, 3, (int64_t[]){expand_a ? 1 : 3, 5, 8}, &av);
    nb_tensor *b = rand_tensor(ctx, NB_F32, 3, (int64_t[]){expand_a ? 3 : 1, 8, 4}, &bv);
    if (expand_a) a = nb_expand(ctx, a, 3, (int64_t[]){3, 5, 8});
    else b = nb_expand(ctx, b, 3, (int64_t[]){3, 8, 4});
    nb_tensor *out = nb_empty(ctx, NB_F32, 3, (int64_t[]){3, 5, 4});
    nb__dnnl_mode prev = nb__dnnl_set_mode(mode);
    int64_t ran = nb__dnnl_executions();
    nb__cpu_gemm(out, a, b, false, false, false);
    ran = nb__dnnl_executions() - ran;
    nb__dnnl_set_mode(prev);
    ck_assert_int_eq(ran, mode == NB_DNNL_OFF ? 0 : 1);
    double got[60], ref[60], s[60];
    nb_to_host_f64(out, got);
    for (int l = 0; l < 3; l++)
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 4; j++) {
                double r = 0, sa = 0;
                for (int q = 0; q < 8; q++) {
                    double x = av[((expand_a ? 0 : l) * 5 + i) * 8 + q];
                    double y = bv[((expand_a ? l : 0) * 8 + q) * 4 + j];
                    r += x * y;
                    sa += fabs(x * y);
                }
                ref[(l * 5 + i) * 4 + j] = r;
                s[(l * 5 + i) * 4 + j] = sa;
            }
    assert_bound(expand_a ? "expanded a" : "expanded b", 60, got, ref, s, false);
    free(av), free(bv);
    nb_ctx_free(ctx);
}

START_TEST(test_matmul_expanded_operands) {
    for (int e = 0; e < 2; e++) {
        expanded_check(NB_DNNL_FORCE, e);
        expanded_check(NB_DNNL_OFF, e);
    }
}
END_TEST

/* ---- primitive cache ---- */

NBT_CPU_TEST(test_cache_reuses_primitives) {
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_FORCE);
    nb_tensor *a = rand_tensor(ctx, NB_F32, 2, (int64_t[]){17, 19}, NULL);
    nb_tensor *b = rand_tensor(ctx, NB_F32, 2, (int64_t[]){19, 23}, NULL);
    nb_tensor *out = nb_empty(ctx, NB_F32, 2, (int64_t[]){17, 23});
    ck_assert(nb__dnnl_matmul(out, a, b, false, false, NULL, false, false));
    int64_t made = nb__dnnl_primitives_created(), hits = nb__dnnl_cache_hits();
    for (int i = 0; i < 5; i++)
        ck_assert(nb__dnnl_matmul(out, a, b, false, false, NULL, false, false));
    ck_assert_int_eq(nb__dnnl_primitives_created(), made);
    ck_assert_int_eq(nb__dnnl_cache_hits(), hits + 5);
    /* another shape, or another post-op, is another primitive */
    nb_tensor *out2 = nb_empty(ctx, NB_F32, 2, (int64_t[]){19, 19});
    ck_assert(nb__dnnl_matmul(out2, a, a, true, false, NULL, false, false));
    ck_assert_int_eq(nb__dnnl_primitives_created(), made + 1);
    ck_assert(nb__dnnl_matmul(out, a, b, false, false, NULL, false, true));
    ck_assert_int_eq(nb__dnnl_primitives_created(), made + 2);
    /* a different thread count is a different key */
    nb__dnnl_set_num_threads(1);
    ck_assert(nb__dnnl_matmul(out, a, b, false, false, NULL, false, false));
    nb__dnnl_set_num_threads(2);
    ck_assert(nb__dnnl_matmul(out, a, b, false, false, NULL, false, false));
    nb__dnnl_set_num_threads(0);
    ck_assert_int_ge(nb__dnnl_primitives_created(), made + 3);
    nb__dnnl_set_mode(prev);
}

/* The default rule for f32 on one thread (Note [oneDNN dispatch]): a product
 * under 2^20 multiply-adds stays on OpenBLAS; above it, one with A as it is
 * and K <= 512 goes to oneDNN, and one with A transposed (a weight gradient)
 * or a long K only where oneDNN has AVX-512 kernels (test_dnnl_avx2 runs this
 * with oneDNN held to AVX2, so both answers are checked on an AVX-512 CPU). */
static bool f32_auto_takes(bool ta, int64_t m, int64_t n, int64_t k) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = ta ? nb_zeros(ctx, NB_F32, 2, (int64_t[]){k, m})
                      : nb_zeros(ctx, NB_F32, 2, (int64_t[]){m, k});
    nb_tensor *b = nb_zeros(ctx, NB_F32, 2, (int64_t[]){k, n});
    nb_tensor *out = nb_empty(ctx, NB_F32, 2, (int64_t[]){m, n});
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_AUTO);
    bool took = nb__dnnl_matmul(out, a, b, ta, false, NULL, false, false);
    nb__dnnl_set_mode(prev);
    nb_ctx_free(ctx);
    return took;
}

START_TEST(test_f32_rule) {
    int blas = openblas_get_num_threads();
    openblas_set_num_threads(1);
    bool avx512 = nb__dnnl_bf16_kernels(); /* AVX-512 core, as oneDNN sees it */
    /* OpenBLAS on a generic core (Note [BLAS that does not know the CPU]):
     * every large product, at any thread count (test_config_prescott) */
    bool generic = nb__blas_generic() && nb__dnnl_mode_now() == NB_DNNL_AUTO &&
                   dnnl_get_effective_cpu_isa() >= dnnl_cpu_isa_avx2;
    ck_assert(!f32_auto_takes(false, 64, 64, 64));           /* 2^18 multiply-adds */
    ck_assert(f32_auto_takes(false, 1024, 256, 256));        /* a forward product */
    ck_assert(f32_auto_takes(false, 1024, 256, 512));
    ck_assert_int_eq(f32_auto_takes(true, 256, 256, 1024), avx512 || generic); /* a weight gradient */
    ck_assert_int_eq(f32_auto_takes(false, 1024, 256, 1024), avx512 || generic); /* K 1024 */
    openblas_set_num_threads(2); /* more threads: f32 stays on OpenBLAS */
    ck_assert_int_eq(f32_auto_takes(false, 1024, 256, 256), generic);
    openblas_set_num_threads(blas);
}
END_TEST

/* ---- thread count ---- */

/* oneDNN follows OpenBLAS's thread count, reduced to one under OpenMP's
 * active wait policy (the suite runs without OMP_WAIT_POLICY); an explicit
 * count is taken as it is. */
START_TEST(test_thread_count) {
    ck_assert_ptr_null(getenv("OMP_WAIT_POLICY"));
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_FORCE);
    nb_tensor *a = rand_tensor(ctx, NB_F32, 2, (int64_t[]){8, 8}, NULL);
    nb_tensor *out = nb_empty(ctx, NB_F32, 2, (int64_t[]){8, 8});
    int blas = openblas_get_num_threads();
    openblas_set_num_threads(1);
    ck_assert(nb__dnnl_matmul(out, a, a, false, false, NULL, false, false));
    ck_assert_int_eq(omp_get_max_threads(), 1);
    openblas_set_num_threads(2);
    ck_assert(nb__dnnl_matmul(out, a, a, false, false, NULL, false, false));
    ck_assert_int_eq(omp_get_max_threads(), 1);
    nb__dnnl_set_num_threads(2);
    ck_assert(nb__dnnl_matmul(out, a, a, false, false, NULL, false, false));
    ck_assert_int_eq(omp_get_max_threads(), 2);
    nb__dnnl_set_num_threads(0);
    openblas_set_num_threads(blas);
    nb__dnnl_set_mode(prev);
    nb_ctx_free(ctx);
}
END_TEST

/* The thread count of the key holds from the primitive's making (Note
 * [oneDNN threads at creation]): a convolution made and run on one thread
 * while OpenMP's default would be more starts no OpenMP worker (the
 * gemm-based convolution reads the count when it is made; each test runs
 * in a fresh child, so no OpenMP team exists before). */
static int process_threads(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "Threads:", 8)) n = atoi(line + 8);
    if (f) fclose(f);
    return n;
}

START_TEST(test_threads_at_creation) {
    if (omp_get_max_threads() < 2) return; /* one core: nothing to tell apart */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb__conv2d_geom g = {8, 16, 16, 16, 32, 3, 3, 16, 16, 1, 1, 1, 1, 1, 1, 1};
    nb_tensor *x = rand_tensor(ctx, NB_F32, 4, (int64_t[]){g.n, g.c, g.h, g.w}, NULL);
    nb_tensor *w = rand_tensor(ctx, NB_F32, 4, (int64_t[]){g.o, g.c, 3, 3}, NULL);
    nb_tensor *y = nb_empty(ctx, NB_F32, 4, (int64_t[]){g.n, g.o, g.oh, g.ow});
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_FORCE);
    nb__dnnl_set_num_threads(1);
    int before = process_threads();
    ck_assert(nb__dnnl_conv2d_forward(NB_F32, &g, y->data, x->data, w->data, NULL));
    ck_assert(nb__dnnl_conv2d_forward(NB_F32, &g, y->data, x->data, w->data, NULL));
    ck_assert_int_eq(process_threads(), before);
    nb__dnnl_set_num_threads(0);
    nb__dnnl_set_mode(prev);
    nb_ctx_free(ctx);
}
END_TEST

/* ---- several threads at once ---- */

typedef struct mt_job {
    nb_tensor *out, *a, *b;
    int reps, taken;
} mt_job;

static void *mt_run(void *p) {
    mt_job *j = p;
    for (int i = 0; i < j->reps; i++)
        j->taken += nb__dnnl_matmul(j->out, j->a, j->b, false, true, NULL, false, i > 0);
    return NULL;
}

/* One primitive run by four threads at once on their own buffers (each
 * thread its own stream and scratchpad) gives each thread's product. */
NBT_CPU_TEST(test_concurrent_execution) {
    nb_dtype dt = nb__dnnl_bf16_kernels() ? NB_BF16 : NB_F32;
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_FORCE);
    enum { NT = 4, REPS = 25 };
    mt_job jobs[NT];
    double *av[NT], *bv[NT];
    int64_t m = 48, n = 40, k = 64;
    lcg = 5;
    for (int t = 0; t < NT; t++) {
        jobs[t].a = rand_tensor(ctx, dt, 2, (int64_t[]){m, k}, &av[t]);
        jobs[t].b = rand_tensor(ctx, dt, 2, (int64_t[]){n, k}, &bv[t]);
        jobs[t].out = nb_empty(ctx, NB_F32, 2, (int64_t[]){m, n});
        jobs[t].reps = REPS;
        jobs[t].taken = 0;
    }
    pthread_t th[NT];
    for (int t = 0; t < NT; t++)
        ck_assert_int_eq(pthread_create(&th[t], NULL, mt_run, &jobs[t]), 0);
    for (int t = 0; t < NT; t++) pthread_join(th[t], NULL);
    double *got = malloc(sizeof(double) * (size_t)(m * n));
    for (int t = 0; t < NT; t++) {
        ck_assert_int_eq(jobs[t].taken, REPS);
        nb_to_host_f64(jobs[t].out, got);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double r = 0, sa = 0;
                for (int64_t q = 0; q < k; q++) {
                    r += av[t][i * k + q] * bv[t][j * k + q];
                    sa += fabs(av[t][i * k + q] * bv[t][j * k + q]);
                }
                /* REPS accumulations of the same product */
                double tol = 1e-5 * REPS * (fabs(r) + sa);
                ck_assert_msg(fabs(got[i * n + j] - REPS * r) <= tol,
                              "thread %d element (%lld, %lld): %.9g, reference %.9g", t,
                              (long long)i, (long long)j, got[i * n + j], REPS * r);
            }
        free(av[t]);
        free(bv[t]);
    }
    free(got);
    nb__dnnl_set_mode(prev);
}

/* ---- the switch ---- */

NBT_CPU_TEST(test_env_switch) {
    nb_tensor *a = rand_tensor(ctx, NB_BF16, 2, (int64_t[]){3, 4}, NULL);
    nb_tensor *out = nb_empty(ctx, NB_F32, 2, (int64_t[]){3, 3});
    nb__dnnl_mode prev = nb__dnnl_set_mode(-1);
    setenv("NABLA_DNNL", "0", 1);
    nb__dnnl_set_mode(-1);
    ck_assert_int_eq(nb__dnnl_mode_now(), NB_DNNL_OFF);
    ck_assert(!nb__dnnl_matmul(out, a, a, false, true, NULL, false, false));
    setenv("NABLA_DNNL", "2", 1);
    nb__dnnl_set_mode(-1);
    ck_assert_int_eq(nb__dnnl_mode_now(), NB_DNNL_FORCE);
    setenv("NABLA_DNNL", "yes", 1);
    nb__dnnl_set_mode(-1);
    NBT_EXPECT_ABORT(nb__dnnl_mode_now(), "NABLA_DNNL=yes: expected 0");
    unsetenv("NABLA_DNNL");
    nb__dnnl_set_mode(-1);
    ck_assert_int_eq(nb__dnnl_mode_now(), NB_DNNL_AUTO);
    NBT_EXPECT_ABORT(nb__dnnl_set_mode(5), "nb__dnnl_set_mode: mode 5");
    nb__dnnl_set_mode((int)prev);
}

/* ---- convolution ---- */

static const nb__conv2d_geom conv_cases[] = {
    /* n, c, h, w, o, kh, kw, oh, ow (filled in), sh, sw, ph, pw, dh, dw, groups */
    {2, 3, 9, 8, 4, 3, 3, 0, 0, 1, 1, 1, 1, 1, 1, 1},
    {2, 4, 11, 10, 6, 3, 2, 0, 0, 2, 1, 1, 0, 1, 1, 2},  /* stride, groups */
    {1, 3, 12, 12, 5, 3, 3, 0, 0, 1, 2, 2, 1, 2, 2, 1},  /* dilation */
    {2, 4, 7, 7, 8, 3, 3, 0, 0, 1, 1, 1, 1, 1, 1, 4},    /* depthwise, multiplier 2 */
    {2, 8, 5, 6, 16, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1},   /* pointwise */
    {3, 1, 14, 14, 8, 5, 5, 0, 0, 1, 1, 2, 2, 1, 1, 1},  /* the digits CNN's first layer */
};

static nb__conv2d_geom conv_geom(int ci) {
    nb__conv2d_geom g = conv_cases[ci];
    g.oh = (g.h + 2 * g.ph - g.dh * (g.kh - 1) - 1) / g.sh + 1;
    g.ow = (g.w + 2 * g.pw - g.dw * (g.kw - 1) - 1) / g.sw + 1;
    return g;
}

/* f64 reference: y, and the gradients from gy; each with its S. */
typedef struct conv_ref {
    double *y, *sy, *dx, *sdx, *dw, *sdw, *db, *sdb;
} conv_ref;

static conv_ref conv_reference(const nb__conv2d_geom *g, const double *x, const double *w,
                               const double *b, const double *gy) {
    int64_t G = g->groups, CG = g->c / G, OG = g->o / G;
    int64_t nx = g->n * g->c * g->h * g->w, nw = g->o * CG * g->kh * g->kw;
    int64_t ny = g->n * g->o * g->oh * g->ow;
    conv_ref r;
    r.y = calloc((size_t)ny, sizeof(double)), r.sy = calloc((size_t)ny, sizeof(double));
    r.dx = calloc((size_t)nx, sizeof(double)), r.sdx = calloc((size_t)nx, sizeof(double));
    r.dw = calloc((size_t)nw, sizeof(double)), r.sdw = calloc((size_t)nw, sizeof(double));
    r.db = calloc((size_t)g->o, sizeof(double)), r.sdb = calloc((size_t)g->o, sizeof(double));
    for (int64_t n = 0; n < g->n; n++)
        for (int64_t o = 0; o < g->o; o++)
            for (int64_t i = 0; i < g->oh; i++)
                for (int64_t j = 0; j < g->ow; j++) {
                    int64_t yi = ((n * g->o + o) * g->oh + i) * g->ow + j;
                    double acc = b ? b[o] : 0, sacc = b ? fabs(b[o]) : 0;
                    for (int64_t cg = 0; cg < CG; cg++)
                        for (int64_t ki = 0; ki < g->kh; ki++)
                            for (int64_t kj = 0; kj < g->kw; kj++) {
                                int64_t ih = i * g->sh - g->ph + ki * g->dh;
                                int64_t iw = j * g->sw - g->pw + kj * g->dw;
                                if (ih < 0 || ih >= g->h || iw < 0 || iw >= g->w) continue;
                                int64_t c = (o / OG) * CG + cg;
                                int64_t xi = ((n * g->c + c) * g->h + ih) * g->w + iw;
                                int64_t wi = ((o * CG + cg) * g->kh + ki) * g->kw + kj;
                                acc += x[xi] * w[wi];
                                sacc += fabs(x[xi] * w[wi]);
                                r.dx[xi] += gy[yi] * w[wi];
                                r.sdx[xi] += fabs(gy[yi] * w[wi]);
                                r.dw[wi] += gy[yi] * x[xi];
                                r.sdw[wi] += fabs(gy[yi] * x[xi]);
                            }
                    r.y[yi] = acc;
                    r.sy[yi] = sacc;
                    r.db[o] += gy[yi];
                    r.sdb[o] += fabs(gy[yi]);
                }
    return r;
}

static void conv_ref_free(conv_ref *r) {
    free(r->y), free(r->sy), free(r->dx), free(r->sdx), free(r->dw), free(r->sdw), free(r->db),
        free(r->sdb);
}

/* Returns the oneDNN executions it saw (primitives and GEMMs). */
static int64_t conv_check(int ci, nb_dtype dt, bool with_bias, nb__dnnl_mode mode) {
    nb__conv2d_geom g = conv_geom(ci);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    lcg = 77u + (uint64_t)ci;
    double *xv, *wv, *bv = NULL, *gv;
    nb_tensor *x = rand_tensor(ctx, dt, 4, (int64_t[]){g.n, g.c, g.h, g.w}, &xv);
    nb_tensor *w = rand_tensor(ctx, dt, 4, (int64_t[]){g.o, g.c / g.groups, g.kh, g.kw}, &wv);
    nb_tensor *b = with_bias ? rand_tensor(ctx, dt, 1, &g.o, &bv) : NULL;
    nb_tensor *gy = rand_tensor(ctx, dt, 4, (int64_t[]){g.n, g.o, g.oh, g.ow}, &gv);
    nb_tensor *y = nb_empty_like(ctx, gy), *dx = nb_empty_like(ctx, x), *dw = nb_empty_like(ctx, w);
    nb_tensor *db = with_bias ? nb_empty(ctx, dt, 1, &g.o) : NULL;
    conv_ref r = conv_reference(&g, xv, wv, bv, gv);
    size_t cols = nb__conv2d_cols_bytes(dt, &g) + 16;
    void *scratch = malloc(cols);

    nb__dnnl_mode prev = nb__dnnl_set_mode(mode);
    int64_t ran = nb__dnnl_executions();
    nb__cpu_conv2d_forward_cols(dt, &g, y->data, x->data, w->data, b ? b->data : NULL, scratch);
    nb__cpu_conv2d_backward_cols(dt, &g, dx->data, dw->data, db ? db->data : NULL, gy->data,
                                 x->data, w->data, scratch);
    ran = nb__dnnl_executions() - ran;
    nb__dnnl_set_mode(prev);
    int runs = dnnl_runs(dt, mode); /* forward, backward data, backward weights */
    if (runs >= 0)
        ck_assert_msg(ran == 3 * runs,
                  "conv case %d %s bias %d mode %d: %lld oneDNN executions", ci, nb_dtype_name(dt),
                  with_bias, (int)mode, (long long)ran);

    char what[128];
    int64_t ny = nb_numel(y), nx = nb_numel(x), nw = nb_numel(w);
    int64_t most = ny > nx ? ny : nx;
    double *got = malloc(sizeof(double) * (size_t)(most > nw ? most : nw));
    bool low = dt == NB_BF16;
    snprintf(what, sizeof what, "conv case %d %s bias %d mode %d: y", ci, nb_dtype_name(dt),
             with_bias, (int)mode);
    nb_to_host_f64(y, got);
    assert_bound(what, ny, got, r.y, r.sy, low);
    what[strlen(what) - 1] = 0;
    strcat(what, "dx");
    nb_to_host_f64(dx, got);
    assert_bound(what, nx, got, r.dx, r.sdx, low);
    what[strlen(what) - 2] = 0;
    strcat(what, "dw");
    nb_to_host_f64(dw, got);
    assert_bound(what, nw, got, r.dw, r.sdw, low);
    if (db) {
        what[strlen(what) - 2] = 0;
        strcat(what, "db");
        nb_to_host_f64(db, got);
        assert_bound(what, g.o, got, r.db, r.sdb, low);
    }
    free(got), free(scratch), free(xv), free(wv), free(bv), free(gv);
    conv_ref_free(&r);
    nb_ctx_free(ctx);
    return ran;
}

START_TEST(test_conv_f32_dnnl) {
    conv_check(_i, NB_F32, true, NB_DNNL_FORCE);
    conv_check(_i, NB_F32, false, NB_DNNL_FORCE);
}
END_TEST

START_TEST(test_conv_f32_im2col) { conv_check(_i, NB_F32, true, NB_DNNL_OFF); }
END_TEST

START_TEST(test_conv_bf16_dnnl) {
    conv_check(_i, NB_BF16, true, NB_DNNL_FORCE);
    conv_check(_i, NB_BF16, false, NB_DNNL_FORCE);
}
END_TEST

START_TEST(test_conv_bf16_fallback) { conv_check(_i, NB_BF16, true, NB_DNNL_OFF); }
END_TEST

/* bf16 products in row blocks on the pool (Note [oneDNN products on the
 * pool]; native bf16 only): op(A) = A^T with A (K, M), into an f32 C added
 * to its previous contents, and into a bf16 C (Note [bf16 products stored
 * as bf16] in tensor/cpu/bf16.c) with a bias; against f64 sums of the same
 * bf16 values (f32 summation's bound, and half a bf16 ulp where stored as
 * bf16), bitwise the same on 1 and 2 pool threads. M = 300: two blocks of
 * 128 and one of 44, read in place; M = 2049 (A's columns a page apart):
 * 16 blocks and one of a single row, each copied first (Note [Packed
 * blocks of a transposed A]). */
static const struct {
    int m, k, n, blocks, packed;
} bf16_block_cases[] = {{300, 160, 96, 3, 0}, {2049, 32, 64, 17, 17}};

START_TEST(test_bf16_blocks) {
    if (!nb__dnnl_native_bf16()) return;
    const int M = bf16_block_cases[_i].m, K = bf16_block_cases[_i].k, N = bf16_block_cases[_i].n;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    lcg = 4242u;
    double *av, *bv, *cv, *biasv;
    nb_tensor *a = rand_tensor(ctx, NB_BF16, 2, (int64_t[]){K, M}, &av);
    nb_tensor *b = rand_tensor(ctx, NB_BF16, 2, (int64_t[]){K, N}, &bv);
    nb_tensor *c0 = rand_tensor(ctx, NB_F32, 2, (int64_t[]){M, N}, &cv);
    nb_tensor *bias = rand_tensor(ctx, NB_F32, 1, (int64_t[]){N}, &biasv);
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_AUTO);
    for (int out_bf16 = 0; out_bf16 < 2; out_bf16++) {
        double *got[2];
        for (int t = 1; t <= 2; t++) {
            nb_set_num_threads(t);
            nb_tensor *c = out_bf16 ? nb_empty(ctx, NB_BF16, 2, (int64_t[]){M, N}) : nb_clone(ctx, c0);
            int64_t before = nb__dnnl_executions(), packed = nb__dnnl_packed_blocks();
            ck_assert(nb__dnnl_matmul(c, a, b, true, false, out_bf16 ? bias : NULL, false, !out_bf16));
            /* one execution per block */
            ck_assert_int_eq(nb__dnnl_executions() - before, bf16_block_cases[_i].blocks);
            ck_assert_int_eq(nb__dnnl_packed_blocks() - packed, bf16_block_cases[_i].packed);
            got[t - 1] = malloc(sizeof(double) * M * N);
            nb_to_host_f64(c, got[t - 1]);
        }
        nb_set_num_threads(0);
        ck_assert(!memcmp(got[0], got[1], sizeof(double) * M * N));
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double ref = out_bf16 ? biasv[j] : cv[i * N + j], mag = fabs(ref);
                for (int p = 0; p < K; p++) {
                    ref += av[p * M + i] * bv[p * N + j];
                    mag += fabs(av[p * M + i] * bv[p * N + j]);
                }
                double tol = (K + 1) * 0x1p-24 * mag + (out_bf16 ? 0x1p-8 * fabs(ref) : 0) + 1e-30;
                ck_assert_msg(fabs(got[0][i * N + j] - ref) <= tol, "bf16 out %d: c[%d][%d] = %.9g, expected %.9g",
                              out_bf16, i, j, got[0][i * N + j], ref);
            }
        free(got[0]), free(got[1]);
    }
    nb__dnnl_set_mode(prev);
    free(av), free(bv), free(cv), free(biasv);
    nb_ctx_free(ctx);
}
END_TEST

/* The default rule for f32 convolutions: im2col, whose GEMMs are oneDNN's
 * where OpenBLAS runs a generic core (test_dnnl_prescott), OpenBLAS's
 * elsewhere (depthwise: direct loops, no GEMM); the values within f32's
 * bound either way. */
START_TEST(test_conv_f32_auto) {
    bool generic = nb__blas_generic() && dnnl_get_effective_cpu_isa() >= dnnl_cpu_isa_avx2;
    nb__conv2d_geom g = conv_geom(_i);
    bool gemms = !(g.groups > 1 && g.c == g.groups); /* depthwise: direct loops, no GEMM */
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_AUTO);
    int64_t made = nb__dnnl_primitives_created();
    int64_t ran = conv_check(_i, NB_F32, true, NB_DNNL_AUTO);
    ck_assert_int_eq(nb__dnnl_primitives_created(), made); /* no convolution primitive */
    ck_assert_msg(generic && gemms ? ran >= 3 : ran == 0,
                  "conv case %d: %lld oneDNN GEMMs (generic core: %d, GEMMs: %d)", _i, (long long)ran,
                  (int)generic, (int)gemms);
    nb__dnnl_set_mode(prev);
}
END_TEST

/* nb__dnnl_conv_gemm (forced, so on any CPU) against f64 loops: each
 * transposition, leading dimensions wider than the matrices, alpha and
 * beta; columns past n in C left alone. */
START_TEST(test_conv_gemm) {
    enum { M = 37, N = 53, K = 70, PAD = 5 };
    nb__dnnl_mode prev = nb__dnnl_set_mode(NB_DNNL_FORCE);
    for (int t = 0; t < 4; t++) {
        bool ta = t & 1, tb = t & 2;
        int64_t ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
        int64_t lda = ca + PAD, ldb = cb + PAD, ldc = N + PAD;
        float *a = malloc(sizeof(float) * (size_t)(ra * lda)), *b = malloc(sizeof(float) * (size_t)(rb * ldb));
        float *c = malloc(sizeof(float) * (size_t)(M * ldc)), *c0 = malloc(sizeof(float) * (size_t)(M * ldc));
        lcg = 5u + (uint64_t)t;
        for (int64_t i = 0; i < ra * lda; i++) a[i] = (float)urand();
        for (int64_t i = 0; i < rb * ldb; i++) b[i] = (float)urand();
        for (int64_t i = 0; i < M * ldc; i++) c[i] = c0[i] = (float)urand();
        int64_t ran = nb__dnnl_executions();
        ck_assert(nb__dnnl_conv_gemm(ta, tb, M, N, K, 0.5f, a, lda, b, ldb, 2.0f, c, ldc));
        ck_assert_int_eq(nb__dnnl_executions(), ran + 1);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < ldc; j++) {
                if (j >= N) {
                    ck_assert_msg(c[i * ldc + j] == c0[i * ldc + j], "t %d: c[%lld][%lld] written", t,
                                  (long long)i, (long long)j);
                    continue;
                }
                double s = 0, mag = 0;
                for (int64_t p = 0; p < K; p++) {
                    double x = ta ? a[p * lda + i] : a[i * lda + p], y = tb ? b[j * ldb + p] : b[p * ldb + j];
                    s += x * y;
                    mag += fabs(x * y);
                }
                double want = 0.5 * s + 2.0 * c0[i * ldc + j];
                ck_assert_msg(fabs(c[i * ldc + j] - want) <= 1e-6 * (0.5 * mag + 2.0 * fabs(c0[i * ldc + j])) + 1e-6,
                              "t %d: c[%lld][%lld] = %.9g, expected %.9g", t, (long long)i, (long long)j,
                              c[i * ldc + j], want);
            }
        free(a), free(b), free(c), free(c0);
    }
    nb__dnnl_set_mode(NB_DNNL_OFF);
    float one = 1, out = 0;
    ck_assert(!nb__dnnl_conv_gemm(false, false, 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &out, 1));
    nb__dnnl_set_mode(prev);
}
END_TEST

/* the default rule for bf16 convolutions: as test_matmul_bf16_auto */
START_TEST(test_conv_bf16_auto) { conv_check(_i, NB_BF16, true, NB_DNNL_AUTO); }
END_TEST

static Suite *dnnl_suite(void) {
    Suite *s = suite_create("dnnl");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    int nmm = (int)(sizeof mm_cases / sizeof mm_cases[0]);
    int ncv = (int)(sizeof conv_cases / sizeof conv_cases[0]);
    tcase_add_loop_test(tc, test_matmul_f32_dnnl, 0, nmm);
    tcase_add_loop_test(tc, test_matmul_f32_openblas, 0, nmm);
    tcase_add_loop_test(tc, test_matmul_bf16_dnnl, 0, nmm);
    tcase_add_loop_test(tc, test_matmul_bf16_fallback, 0, nmm);
    tcase_add_test(tc, test_matmul_bf16_auto);
    tcase_add_test(tc, test_matmul_bf16_needs_f32_out);
    tcase_add_test(tc, test_matmul_expanded_operands);
    tcase_add_test(tc, test_cache_reuses_primitives);
    tcase_add_test(tc, test_env_switch);
    tcase_add_test(tc, test_concurrent_execution);
    tcase_add_test(tc, test_f32_rule);
    tcase_add_test(tc, test_thread_count);
    tcase_add_test(tc, test_threads_at_creation);
    tcase_add_loop_test(tc, test_conv_f32_dnnl, 0, ncv);
    tcase_add_loop_test(tc, test_conv_f32_im2col, 0, ncv);
    tcase_add_loop_test(tc, test_conv_f32_auto, 0, ncv);
    tcase_add_test(tc, test_conv_gemm);
    tcase_add_loop_test(tc, test_bf16_blocks, 0, 2);
    tcase_add_loop_test(tc, test_conv_bf16_dnnl, 0, ncv);
    tcase_add_loop_test(tc, test_conv_bf16_fallback, 0, ncv);
    tcase_add_loop_test(tc, test_conv_bf16_auto, 0, ncv);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return nbt_run(dnnl_suite()); }
