/* Tests of nb_config_string (include/nabla/config.h) and of the products
 * that do not depend on OpenBLAS knowing the CPU (Note [BLAS that does not
 * know the CPU] in tensor/cpu/cpuinfo.h).
 *
 * The report is checked against what runs: a large f32 product and a
 * convolution are computed, and oneDNN's execution counter says whether
 * they went to oneDNN; the report's first library must agree, at one and
 * at two OpenBLAS threads. The CPU features are checked against GCC's own
 * detection (__builtin_cpu_supports), and whether OpenBLAS is "generic"
 * against the core's name written out here.
 *
 * CTest runs this suite twice: as test_config, in the environment as it
 * is, and as test_config_prescott with OPENBLAS_CORETYPE=Prescott, which
 * makes OpenBLAS run its generic SSE3 kernels as it does on a CPU it does
 * not know. There, on a CPU with AVX2 and FMA, the report must have its
 * one "note:" line and f32 products and convolutions must take oneDNN at
 * every thread count (and give the right values: checked against f64
 * loops, to 1e-5 relative to the sum of the terms' magnitudes, since
 * oneDNN sums in another order than OpenBLAS), the large ones in row blocks
 * on the pool with the same bits for any pool size. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "nabla/config.h"
#include "tensor/cpu/cpuinfo.h"
#include "tensor/cpu/dnnl.h"
#include "testutil.h"

static bool cpu_avx2_fma(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* the value after "key: " on its line, copied into out (up to the line's end) */
static bool field(const char *text, const char *key, char *out, size_t cap) {
    size_t k = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (!strncmp(p, key, k) && p[k] == ':' && p[k + 1] == ' ') {
            const char *v = p + k + 2, *e = strchr(v, '\n');
            size_t n = e ? (size_t)(e - v) : strlen(v);
            if (n >= cap) n = cap - 1;
            memcpy(out, v, n);
            out[n] = 0;
            return true;
        }
    }
    return false;
}

static int count_lines_starting(const char *text, const char *prefix) {
    int n = 0;
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        n += !strncmp(p, prefix, strlen(prefix));
    return n;
}

static bool forced_prescott(void) {
    const char *s = getenv("OPENBLAS_CORETYPE");
    return s && !strcasecmp(s, "Prescott");
}

static uint64_t lcg = 1;
static float urand(void) {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(lcg >> 11) / 9007199254740992.0 * 2 - 1);
}

static nb_tensor *rand_f32(nb_ctx *ctx, int nd, const int64_t *shape, float **host) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    float *h = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) h[i] = urand();
    nb_tensor *t = nb_from_host(ctx, NB_F32, nd, shape, h);
    *host = h;
    return t;
}

/* (M, K) @ (K, N) with M K N = 2^24 multiply-adds, A as stored, K 256:
 * the report's first library for "f32 matmul" is the one that runs it.
 * Returns whether oneDNN ran it; checks the values on a few rows. */
static bool matmul_took_onednn(void) {
    enum { M = 256, K = 256, N = 256 };
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    float *ha, *hb;
    nb_tensor *a = rand_f32(ctx, 2, (int64_t[]){M, K}, &ha);
    nb_tensor *b = rand_f32(ctx, 2, (int64_t[]){K, N}, &hb);
    int64_t before = nb__dnnl_executions();
    nb_tensor *c = nb_matmul(ctx, a, b);
    bool took = nb__dnnl_executions() > before;
    float *hc = malloc(sizeof(float) * M * N);
    nb_to_host(c, hc);
    for (int i = 0; i < M; i += 37)
        for (int j = 0; j < N; j++) {
            double ref = 0, mag = 0;
            for (int p = 0; p < K; p++) {
                ref += (double)ha[i * K + p] * hb[p * N + j];
                mag += fabs((double)ha[i * K + p] * hb[p * N + j]);
            }
            ck_assert_msg(fabs(hc[i * N + j] - ref) <= 1e-5 * mag + 1e-6,
                          "c[%d][%d] = %g, expected %g", i, j, hc[i * N + j], ref);
        }
    free(ha);
    free(hb);
    free(hc);
    nb_ctx_free(ctx);
    return took;
}

/* A 3x3 convolution, 16 -> 32 channels on 16x16 images of a batch of 8,
 * padding 1: whether oneDNN ran its forward; values checked at a few
 * outputs. */
static bool conv_took_onednn(void) {
    enum { B = 8, C = 16, O = 32, H = 16, W = 16 };
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    float *hx, *hw;
    nb_tensor *x = rand_f32(ctx, 4, (int64_t[]){B, C, H, W}, &hx);
    nb_tensor *w = rand_f32(ctx, 4, (int64_t[]){O, C, 3, 3}, &hw);
    nb_conv2d_opts o = NB_CONV2D_DEFAULTS;
    o.padding[0] = o.padding[1] = 1;
    int64_t before = nb__dnnl_executions();
    nb_tensor *y = nb_conv2d(ctx, x, w, NULL, &o);
    bool took = nb__dnnl_executions() > before;
    float *hy = malloc(sizeof(float) * B * O * H * W);
    nb_to_host(y, hy);
    for (int idx = 0; idx < B * O * H * W; idx += 997) {
        int n = idx / (O * H * W), oc = idx / (H * W) % O, i = idx / W % H, j = idx % W;
        double ref = 0, mag = 0;
        for (int c = 0; c < C; c++)
            for (int di = 0; di < 3; di++)
                for (int dj = 0; dj < 3; dj++) {
                    int ii = i + di - 1, jj = j + dj - 1;
                    if (ii < 0 || ii >= H || jj < 0 || jj >= W) continue;
                    double t = (double)hx[((n * C + c) * H + ii) * W + jj] *
                               hw[((oc * C + c) * 3 + di) * 3 + dj];
                    ref += t;
                    mag += fabs(t);
                }
        ck_assert_msg(fabs(hy[idx] - ref) <= 1e-5 * mag + 1e-6, "y[%d] = %g, expected %g", idx,
                      hy[idx], ref);
    }
    free(hx);
    free(hw);
    free(hy);
    nb_ctx_free(ctx);
    return took;
}

static bool first_word_is(const char *value, const char *word) {
    size_t n = strlen(word);
    return !strncmp(value, word, n) && (value[n] == ' ' || value[n] == 0);
}

/* The report names what runs, at one and at two OpenBLAS threads. */
START_TEST(test_report_matches_what_runs) {
    int blas = openblas_get_num_threads();
    for (int t = 1; t <= 2; t++) {
        openblas_set_num_threads(t);
        const char *r = nb_config_string();
        char mm[512], cv[512];
        ck_assert_msg(field(r, "f32 matmul", mm, sizeof mm), "no f32 matmul line in:\n%s", r);
        ck_assert_msg(field(r, "f32 conv2d", cv, sizeof cv), "no f32 conv2d line in:\n%s", r);
        bool mm_dnnl = matmul_took_onednn(), cv_dnnl = conv_took_onednn();
        ck_assert_msg(first_word_is(mm, mm_dnnl ? "onednn" : "openblas"),
                      "%d OpenBLAS thread(s): the product ran on %s, the report says \"%s\"", t,
                      mm_dnnl ? "oneDNN" : "OpenBLAS", mm);
        ck_assert_msg(first_word_is(cv, cv_dnnl ? "onednn" : "openblas"),
                      "%d OpenBLAS thread(s): the convolution ran on %s, the report says \"%s\"",
                      t, cv_dnnl ? "oneDNN" : "OpenBLAS", cv);
    }
    openblas_set_num_threads(blas);
}
END_TEST

/* cpuid against GCC's detection; the OpenBLAS line names its core. */
START_TEST(test_cpu_and_blas_lines) {
    const nb__cpu_features *f = nb__cpu_features_get();
    ck_assert_int_eq(f->avx2, __builtin_cpu_supports("avx2") != 0);
    ck_assert_int_eq(f->fma, __builtin_cpu_supports("fma") != 0);
    ck_assert_int_eq(f->avx512, __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                    __builtin_cpu_supports("avx512vl") &&
                                    __builtin_cpu_supports("avx512dq"));
    const char *r = nb_config_string();
    char v[512], want[128];
    ck_assert(field(r, "cpu", v, sizeof v));
    ck_assert_ptr_nonnull(strstr(v, nb__isa_name(nb__cpu_isa())));
    ck_assert(field(r, "openblas", v, sizeof v));
    snprintf(want, sizeof want, "core %s ", openblas_get_corename());
    ck_assert_msg(strstr(v, want), "\"%s\" does not name the core (%s)", v, want);
    ck_assert(field(r, "pool", v, sizeof v));
    ck_assert(field(r, "onednn", v, sizeof v));
    ck_assert(field(r, "bf16 matmul", v, sizeof v));
    ck_assert(field(r, "f32 attention", v, sizeof v));
}
END_TEST

/* Generic, by the core's name as OpenBLAS's list has it, against the
 * CPU as GCC sees it; the note is one line, present exactly then. */
START_TEST(test_generic_core_note) {
    static const char *old[] = {"Prescott", "Core2", "Katmai", "Nehalem", "Penryn", "Atom",
                                "Barcelona", "Opteron", "Athlon", "Dunnington", "Banias",
                                "Northwood", "Coppermine", "Nano", "Bobcat", "Opteron_SSE3",
                                "Sandybridge", "Bulldozer", "Piledriver", "Steamroller"};
    const char *core = openblas_get_corename();
    bool old_core = false;
    for (size_t i = 0; i < sizeof old / sizeof old[0]; i++) old_core |= !strcasecmp(core, old[i]);
    bool expect = old_core && cpu_avx2_fma();
    ck_assert_int_eq(nb__blas_generic(), expect);
    const char *r = nb_config_string();
    ck_assert_msg(count_lines_starting(r, "note: ") == (expect ? 1 : 0), "core %s:\n%s", core, r);
    if (forced_prescott()) {
        ck_assert_msg(!strcasecmp(core, "Prescott"),
                      "OPENBLAS_CORETYPE=Prescott, but OpenBLAS runs %s (not a DYNAMIC_ARCH build?)",
                      core);
    } else {
        ck_assert_int_eq(nb__blas_core_isa("Zen"), NB_ISA_AVX2);
        ck_assert_int_eq(nb__blas_core_isa("SKYLAKEX"), NB_ISA_AVX512);
        ck_assert_int_eq(nb__blas_core_isa("Prescott"), NB_ISA_SSE);
        ck_assert_int_eq(nb__blas_core_isa("NeoverseN1"), -1); /* unknown: never generic */
    }
}
END_TEST

/* Under OPENBLAS_CORETYPE=Prescott on a CPU with AVX2 and FMA: f32
 * products and convolutions take oneDNN at one and two OpenBLAS threads,
 * and the report says so with oneDNN's vector instruction set. */
START_TEST(test_prescott_fast_path) {
    if (!forced_prescott() || !cpu_avx2_fma()) return;
    int blas = openblas_get_num_threads();
    for (int t = 1; t <= 2; t++) {
        openblas_set_num_threads(t);
        const char *r = nb_config_string();
        char mm[512], cv[512];
        ck_assert(field(r, "f32 matmul", mm, sizeof mm) && field(r, "f32 conv2d", cv, sizeof cv));
        ck_assert_msg(first_word_is(mm, "onednn") && strncmp(mm, "onednn sse", 10) &&
                          strncmp(mm, "onednn avx ", 11),
                      "%d thread(s): \"%s\"", t, mm);
        ck_assert_msg(first_word_is(cv, "onednn"), "%d thread(s): \"%s\"", t, cv);
        ck_assert(matmul_took_onednn());
        ck_assert(conv_took_onednn());
    }
    openblas_set_num_threads(blas);
}
END_TEST

/* The blocks of Note [oneDNN products on the pool] (generic core only): a
 * weight-gradient-like product, op(A) = A^T with A (K, M), added to C's
 * previous contents, against f64 loops; bitwise the same on 1 and 2 pool
 * threads. M = 300: two whole blocks of 128 and one of 44, read in place;
 * M = 1025 (A's columns a page apart): 8 blocks and one of a single row,
 * each copied first (Note [Packed blocks of a transposed A]). */
static const struct {
    int m, k, n, blocks, packed;
} block_cases[] = {{300, 160, 96, 3, 0}, {1025, 64, 64, 9, 9}};

static void prescott_blocks_case(int ci) {
    const int M = block_cases[ci].m, K = block_cases[ci].k, N = block_cases[ci].n;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    float *ha, *hb, *hc0;
    nb_tensor *a = rand_f32(ctx, 2, (int64_t[]){K, M}, &ha);
    nb_tensor *b = rand_f32(ctx, 2, (int64_t[]){K, N}, &hb);
    (void)rand_f32(ctx, 2, (int64_t[]){M, N}, &hc0);
    float *got[2];
    for (int t = 1; t <= 2; t++) {
        nb_set_num_threads(t);
        nb_tensor *c = nb_from_host(ctx, NB_F32, 2, (int64_t[]){M, N}, hc0);
        int64_t before = nb__dnnl_executions(), packed = nb__dnnl_packed_blocks();
        ck_assert(nb__dnnl_matmul(c, a, b, true, false, NULL, false, true));
        ck_assert_int_eq(nb__dnnl_executions() - before, block_cases[ci].blocks); /* one a block */
        ck_assert_int_eq(nb__dnnl_packed_blocks() - packed, block_cases[ci].packed);
        got[t - 1] = malloc(sizeof(float) * M * N);
        nb_to_host(c, got[t - 1]);
    }
    nb_set_num_threads(0);
    ck_assert(!memcmp(got[0], got[1], sizeof(float) * M * N));
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double ref = hc0[i * N + j], mag = fabs(ref);
            for (int p = 0; p < K; p++) {
                ref += (double)ha[p * M + i] * hb[p * N + j];
                mag += fabs((double)ha[p * M + i] * hb[p * N + j]);
            }
            ck_assert_msg(fabs(got[0][i * N + j] - ref) <= 1e-5 * mag + 1e-6, "M %d: c[%d][%d] = %g, expected %g", M,
                          i, j, got[0][i * N + j], ref);
        }
    free(got[0]), free(got[1]), free(ha), free(hb), free(hc0);
    nb_ctx_free(ctx);
}

START_TEST(test_prescott_blocks) {
    if (!forced_prescott() || !cpu_avx2_fma()) return;
    for (int ci = 0; ci < 2; ci++) prescott_blocks_case(ci);
}
END_TEST

NBT_MAIN("config", "core", 60,
         test_cpu_and_blas_lines, test_generic_core_note, test_report_matches_what_runs, test_prescott_fast_path,
         test_prescott_blocks)
