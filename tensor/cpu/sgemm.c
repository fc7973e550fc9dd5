/* f32 GEMM with causal structure (tensor/cpu/sgemm.h, Note [Causal
 * products]). */
#include "tensor/cpu/sgemm.h"

#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/error.h"
#include "tensor/cpu/simd.h"

#define HAVE_KERNEL NB_HAVE_AVX2_FMA_KERNELS
#if HAVE_KERNEL
#include <immintrin.h>
#endif

#define MR 6
#define MR512 8 /* rows of the AVX-512 tile */
#define NR 16

static atomic_int enabled = -1; /* -1: the environment's, read at the next use */

static int env_enabled(void) {
    const char *s = getenv("NABLA_CAUSAL_GEMM");
    if (!s || !*s) return 1;
    NB_CHECK((s[0] == '0' || s[0] == '1') && s[1] == 0,
             "NABLA_CAUSAL_GEMM=%s: expected 0 (OpenBLAS for the attention's products) or 1", s);
    return s[0] - '0';
}

/* the setting, the environment's read once (not at every product) */
static int enabled_now(void) {
    int e = atomic_load(&enabled);
    if (e < 0) {
        e = env_enabled(); /* a bad value is an error on any CPU */
        atomic_store(&enabled, e);
    }
    return e;
}

int nb__sgemm_set_enabled(int on) {
    int prev = enabled_now();
    atomic_store(&enabled, on < 0 ? -1 : (on != 0));
    return prev;
}

bool nb__sgemm_kernel_on(void) { return enabled_now() && nb__cpu_avx2_fma(); }

static atomic_int width_set; /* 0: the widest this CPU runs */

static int width_now(void) {
    int w = atomic_load(&width_set);
    if (w == 0) w = nb__cpu_avx512f() ? 512 : 256;
    return w;
}

int nb__sgemm_set_width(int bits) {
    NB_CHECK(bits == 0 || bits == 256 || (bits == 512 && nb__cpu_avx512f()),
             "nb__sgemm_set_width(%d): expected 0, 256 or 512 (512 on a CPU with AVX-512F)", bits);
    int prev = width_now();
    atomic_store(&width_set, bits);
    return prev;
}

int nb__sgemm_tile_rows(void) { return width_now() == 512 ? MR512 : MR; }
int nb__sgemm_width(void) { return width_now(); }

static void full_product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float *a,
                         int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
}

#if HAVE_KERNEL

/* ---- a per-thread panel buffer ---- */

static pthread_key_t buf_key;
static pthread_once_t buf_once = PTHREAD_ONCE_INIT;
static bool buf_key_ok;

typedef struct buffer {
    float *p;
    size_t cap; /* floats */
} buffer;

static void buf_free(void *v) {
    buffer *bf = v;
    free(bf->p);
    free(bf);
}

static void buf_init(void) { buf_key_ok = pthread_key_create(&buf_key, buf_free) == 0; }

static float *panel_buffer(size_t floats) {
    pthread_once(&buf_once, buf_init);
    NB_CHECK(buf_key_ok, "nb__sgemm_causal: pthread_key_create failed");
    buffer *bf = pthread_getspecific(buf_key);
    if (!bf) {
        bf = calloc(1, sizeof *bf);
        NB_CHECK(bf && pthread_setspecific(buf_key, bf) == 0,
                 "nb__sgemm_causal: cannot set up the panel buffer");
    }
    if (bf->cap < floats) {
        free(bf->p);
        size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
        bf->p = aligned_alloc(64, bytes);
        NB_CHECK(bf->p, "nb__sgemm_causal: out of memory for a panel of %zu bytes", bytes);
        bf->cap = floats;
    }
    return bf->p;
}

/* columns [j0, j0 + cols) of op(b), all k rows, as a k x NR panel
 * (dst[p][c], padded with zeros) */
static void pack_b(float *dst, const float *b, int64_t ldb, bool tb, int64_t k, int64_t j0,
                   int64_t cols) {
    if (!tb) {
        for (int64_t p = 0; p < k; p++) {
            const float *s = b + p * ldb + j0;
            if (cols == NR) {
                memcpy(dst + p * NR, s, NR * sizeof(float));
                continue;
            }
            int64_t c = 0;
            for (; c < cols; c++) dst[p * NR + c] = s[c];
            for (; c < NR; c++) dst[p * NR + c] = 0.0f;
        }
        return;
    }
    const float *s[NR];
    for (int64_t c = 0; c < NR; c++) s[c] = b + (j0 + (c < cols ? c : 0)) * ldb;
    for (int64_t p = 0; p < k; p++)
        for (int64_t c = 0; c < NR; c++) dst[p * NR + c] = c < cols ? s[c][p] : 0.0f;
}

/* ---- the 6 x 16 tile ---- */

/* c[0, rows) x [0, cols) = the product over kc of rows of op(a), element
 * (r, p) at a[r * rs + p * ks], and a packed kc x 16 panel b: one FMA
 * chain from zero per element, k in order. op(a) is
 * read in place (its 6 elements of a step are broadcast from wherever
 * they are); missing rows of a partial tile read row 0 and are dropped. */
NB_AVX2_FMA static void tile(int64_t kc, const float *a, int64_t rs, int64_t ks, const float *b,
                      float *c, int64_t ldc, int rows, int cols) {
    const float *a0 = a, *a1 = rows > 1 ? a + rs : a, *a2 = rows > 2 ? a + 2 * rs : a;
    const float *a3 = rows > 3 ? a + 3 * rs : a, *a4 = rows > 4 ? a + 4 * rs : a;
    const float *a5 = rows > 5 ? a + 5 * rs : a;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
    for (int64_t p = 0; p < kc; p++) {
        __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8), x;
        int64_t o = p * ks;
        x = _mm256_broadcast_ss(a0 + o);
        c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a1 + o);
        c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a2 + o);
        c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a3 + o);
        c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a4 + o);
        c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a5 + o);
        c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
        b += NR;
    }
    if (rows == MR && cols == NR) {
        _mm256_storeu_ps(c, c00), _mm256_storeu_ps(c + 8, c01);
        _mm256_storeu_ps(c + ldc, c10), _mm256_storeu_ps(c + ldc + 8, c11);
        _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
        _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
        _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
        _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
        return;
    }
    float t[MR * NR] __attribute__((aligned(32)));
    _mm256_store_ps(t, c00), _mm256_store_ps(t + 8, c01);
    _mm256_store_ps(t + 16, c10), _mm256_store_ps(t + 24, c11);
    _mm256_store_ps(t + 32, c20), _mm256_store_ps(t + 40, c21);
    _mm256_store_ps(t + 48, c30), _mm256_store_ps(t + 56, c31);
    _mm256_store_ps(t + 64, c40), _mm256_store_ps(t + 72, c41);
    _mm256_store_ps(t + 80, c50), _mm256_store_ps(t + 88, c51);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) c[r * ldc + j] = t[r * NR + j];
}

/* The same with AVX-512F: an MR512 x 16 tile, one 16-wide register a row
 * (Note [Causal products]: each element is still one chain of FMAs from
 * zero, k in order, so the values are the AVX2 tile's). */
NB_AVX512F static void tile512(int64_t kc, const float *a, int64_t rs, int64_t ks, const float *b,
                               float *c, int64_t ldc, int rows, int cols) {
    const float *ar[MR512];
    __m512 acc[MR512];
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++) {
        ar[r] = r < rows ? a + r * rs : a;
        acc[r] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int64_t p = 0; p < kc; p++) {
        __m512 b0 = _mm512_load_ps(b);
        int64_t o = p * ks;
#pragma GCC unroll 8
        for (int r = 0; r < MR512; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(ar[r][o]), b0, acc[r]);
        b += NR;
    }
    __mmask16 mask = (__mmask16)((1u << cols) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++)
        if (r < rows) _mm512_mask_storeu_ps(c + r * ldc, mask, acc[r]);
}

/* The k range [lo, hi) that rows [ir, ir + rows) of c sum over. */
static void k_range(nb__tri tri, int64_t ir, int64_t rows, int64_t k, int64_t *lo, int64_t *hi) {
    *lo = 0;
    *hi = k;
    if (tri == NB_TRI_K_UPTO_ROW && ir + rows < k) *hi = ir + rows;
    if (tri == NB_TRI_K_FROM_ROW) *lo = ir < k ? ir : k;
}

/* Column panels outside, row panels inside: each B panel is packed once
 * (contiguous: read in place, the rows of v or q are a whole row of qkv
 * apart and a tile's walk down them crossed a page every few steps) and
 * reused by every row panel while it is in L1; op(a) is read in place. */
typedef void (*tile_fn)(int64_t kc, const float *a, int64_t rs, int64_t ks, const float *b,
                        float *c, int64_t ldc, int rows, int cols);

static void run(nb__tri tri, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float *a,
                int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    int64_t rs = ta ? 1 : lda, ks = ta ? lda : 1;
    bool wide = width_now() == 512;
    tile_fn kernel = wide ? tile512 : tile;
    int64_t mr = wide ? MR512 : MR;
    float *panel = panel_buffer((size_t)(k * NR));
    for (int64_t jr = 0; jr < n; jr += NR) {
        int64_t cols = n - jr < NR ? n - jr : NR;
        pack_b(panel, b, ldb, tb, k, jr, cols);
        /* LOWER: the first row panel reaching column jr */
        int64_t ir0 = tri == NB_TRI_LOWER ? jr / mr * mr : 0;
        for (int64_t ir = ir0; ir < m; ir += mr) {
            int64_t rows = m - ir < mr ? m - ir : mr, lo, hi;
            k_range(tri, ir, rows, k, &lo, &hi);
            if (lo >= hi) { /* nothing to sum: zeros */
                for (int64_t r = 0; r < rows; r++)
                    memset(c + (ir + r) * ldc + jr, 0, (size_t)cols * sizeof(float));
                continue;
            }
            kernel(hi - lo, a + ir * rs + lo * ks, rs, ks, panel + lo * NR, c + ir * ldc + jr, ldc,
                   (int)rows, (int)cols);
        }
    }
}

#endif

void nb__sgemm_causal(nb__tri tri, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                      int64_t ldc) {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
        for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, (size_t)n * sizeof(float));
        return;
    }
#if HAVE_KERNEL
    if (nb__sgemm_kernel_on()) {
        run(tri, ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
        return;
    }
#endif
    full_product(ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
}
