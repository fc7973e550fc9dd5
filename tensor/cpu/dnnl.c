/* oneDNN on the CPU (tensor/cpu/dnnl.h): matmul and 2-D convolution
 * primitives on the caller's buffers (memory objects wrap the pointers, no
 * copies, plain layouts: row-major or strided matrices, NCHW images, OIHW
 * weights), created once per shape and kept in a cache, and the rule that
 * picks oneDNN or OpenBLAS per op (Note [oneDNN dispatch]).
 *
 * The cache is an open-addressed table keyed by everything a primitive
 * depends on (op, dtypes, dims, strides, bias, post-ops, thread count);
 * a key whose primitive oneDNN cannot make, or makes only as its slow
 * reference implementation, is cached as "not supported" so that the
 * caller's kernel runs without asking again. A mutex guards the table
 * (lookups and creations); executions run outside it, each thread with
 * its own stream and scratchpad buffer (primitives use user-provided
 * scratchpads, so one primitive may run on several threads at once).
 * Entries live as long as the process; once the table is 3/4 full, new
 * keys get a primitive made, run and destroyed per call (a training step
 * uses a few dozen shapes, the table holds 768).
 *
 * Threads: Debian's oneDNN uses OpenMP; its thread count is set with
 * omp_set_num_threads on the calling thread before each execution, to
 * OpenBLAS's (openblas_get_num_threads, which follows OPENBLAS_NUM_THREADS
 * / OMP_NUM_THREADS and what nabla sets) unless nb__dnnl_set_num_threads
 * chose another; but above one thread only when OMP_WAIT_POLICY=passive,
 * else one (Note [oneDNN dispatch]).
 *
 * Note [oneDNN dispatch]
 * ~~~~~~~~~~~~~~~~~~~~~~
 * The rule (rule_matmul, rule_conv below; NABLA_DNNL=1, the default):
 *  - bf16 operands: oneDNN where the CPU computes bf16 natively
 *    (AVX512_BF16 or AMX, as oneDNN sees it: ONEDNN_MAX_CPU_ISA caps
 *    it); elsewhere the f32 fallback of matmul.c / conv.c (exact bf16 ->
 *    f32 conversion + the f32 product). On AVX-512 without BF16, oneDNN
 *    2.6 still takes bf16 products, emulating the arithmetic, and that
 *    is slower than the fallback by far: GPT bf16 steps of 221-240 ms
 *    against 76-81 in f32 on the Xeon of 2026-11-27 held to AVX512_CORE
 *    (benchmarks/RESULTS.md, "oneDNN's ISA cap"), where the fallback
 *    costs f32's step plus the conversions (~1.3x f32 on the Zen 3).
 *    (Forced, NABLA_DNNL=2, oneDNN takes them there too. Without
 *    AVX-512 oneDNN has no bf16 kernel: forced, the key is cached as
 *    unsupported and the fallback runs.)
 *  - f32 matmul: oneDNN when OpenBLAS runs on one thread and the product
 *    has at least 2^20 multiply-adds (batch * M * N * K); OpenBLAS on more
 *    threads and for small products; on a CPU without AVX-512 (oneDNN's
 *    AVX2 kernels) only when A is not transposed and K <= 512: its weight
 *    gradients (A transposed, K = the rows of the batch) and long-K
 *    products run at half OpenBLAS's speed there (figures below);
 *  - f32 convolution: our im2col + OpenBLAS; bf16 convolution: oneDNN
 *    (on native bf16, as for matmul).
 *  - OpenBLAS on a generic core (Note [BLAS that does not know the CPU]
 *    in tensor/cpu/cpuinfo.h; oneDNN with AVX2 kernels or better): every
 *    f32 product from 2^20 multiply-adds goes to oneDNN, at every thread
 *    count: the large 2-D products in row blocks on nabla's pool (Note
 *    [oneDNN products on the pool]), the others on oneDNN's own threads
 *    as below (one unless OMP_WAIT_POLICY=passive); f32 convolutions stay
 *    im2col, their GEMMs on oneDNN's GEMM (dnnl_sgemm, JIT kernels by
 *    instruction set, nb__dnnl_conv_gemm) on the same threads: on the
 *    digits CNN's small images oneDNN's convolution primitive on plain
 *    NCHW is its gemm-based one, whose own im2col is slow (figures
 *    below, "Convolutions on the generic core").
 *    Generic SSE3 kernels on N threads are slower than oneDNN on one (a
 *    2-core Xeon with AVX-512 and AMX, 2026-12-01: GPT L6
 *    f32 step 833 ms at 2 threads on the Prescott core, 390 ms on one
 *    thread through oneDNN, 207 ms with OPENBLAS_CORETYPE=SkylakeX). The
 *    bf16 fallbacks' f32 products follow the same rule.
 *  - layer norm, softmax, batch norm: our kernels (see below);
 *  - oneDNN on one thread when OpenBLAS runs on more, unless
 *    OMP_WAIT_POLICY=passive (see below).
 * NABLA_DNNL=0 never uses oneDNN (the f32 kernels, the bf16 fallbacks);
 * NABLA_DNNL=2 uses it wherever it has a non-reference implementation.
 *
 * Figures: build/bin/bench_dnnl --threads 1 --rounds 5 --ms 30, Zen 4 with
 * AVX512_BF16, 2 cores shared with other jobs (load average 3.2 to 3.9),
 * GFLOP/s, medians of 5 interleaved rounds; columns OpenBLAS f32 / oneDNN
 * f32 / oneDNN bf16 (bf16 operands, f32 product) / bf16 through the f32
 * fallback:
 *   GPT B16 T64 C128 (compare_torch), 1024 rows:
 *     qkv fwd (K 128, N 384)        99.8 109.4 215.7 70.9
 *     fc fwd (K 128, N 512)         99.6 110.3 216.8 75.6
 *     fc dW (M 512, K 1024)        100.8 114.4 204.5 47.3
 *     head fwd (N 79)               84.8 109.8 211.2 36.6
 *     attention q@k^T 64 x (64,32)@(32,64)   75.4  98.9 178.8 18.4
 *     attention p@v 64 x (64,64)@(64,32)    110.4 108.7 189.2 15.2
 *   GPT L6 C256 T128 b8, 1024 rows:
 *     fc fwd (K 256, N 1024)        99.3 108.3 216.2 81.0
 *     fc dW (M 1024, K 1024)        99.3 102.2 200.2 64.6
 *     attention p@v 32 x (128,128)@(128,64)  92.3 113.1 213.5 26.0
 *   MLP batch 8: (8,30)@(30,64) 39.1 10.4 12.3 4.8; (8,64)@(64,32) 68.5 11.1
 *     13.0 4.9
 * On one thread oneDNN's f32 matmul is 0-30% faster than OpenBLAS on every
 * GPT product (with AVX-512), and bf16 doubles it; the f32 fallback for bf16 is slower
 * than oneDNN's bf16 everywhere. On products of a few thousand
 * multiply-adds oneDNN's fixed cost per call (memory objects, lock,
 * dispatch: about 3 us against OpenBLAS's 0.5 to 1) loses by 3-6x, hence
 * the 2^20 threshold for f32 (bf16 keeps oneDNN: its fallback is slower
 * still).
 * --threads 2 on the same machine (load average 3.2 to 4.1) with OpenMP's
 * default (active) wait policy: oneDNN's workers spin and then wait at
 * barriers for a descheduled thread, and most rows collapse (GPT-s fc fwd
 * f32 100.0 OpenBLAS vs 17.6 oneDNN, bf16 16.8; GPT-m attention q@k^T
 * 66.9 vs 8.4, bf16 8.4, i.e. one 8 ms scheduler tick per call), while
 * OpenBLAS degrades gracefully. With OMP_WAIT_POLICY=passive (set before
 * the process starts; OpenMP reads it at load) the collapse is gone
 * (GPT-s fc fwd 38.4 / 84.5 / 213.2; GPT-m attention q@k^T 67.6 / 104.4 /
 * 196.0), though on this loaded machine no faster than one thread (GPT-m
 * fc fwd bf16 201.5 at 2 threads, 216.2 at 1). Hence f32 stays on
 * OpenBLAS above one thread, and oneDNN itself (for bf16) runs on one
 * thread when OpenBLAS runs on more, unless OMP_WAIT_POLICY=passive: one
 * thread of bf16 (~215) still beats every 2-thread alternative measured.
 * (tests/test_cpu_bf16 at OPENBLAS_NUM_THREADS=2 under load: 12.9 s with
 * oneDNN on 2 active-wait threads, 2.9 s passive.)
 * Without AVX-512 (Zen 3, AVX2 only, 2026-11-26, quiet machine, load
 * average 0.6-0.9; same command, same columns; oneDNN's bf16 is not used
 * there, the fallback column is what runs):
 *   GPT B16 T64 C128: qkv fwd (K 128) 78.3 86.3; qkv dX (K 384) 81.1 86.3;
 *     qkv dW (A^T, K 1024) 64.2 60.6; fc fwd 64.7 74.9; fc dX (K 512)
 *     79.4 85.0; fc dW 71.2 50.1; mlp_proj dW 62.5 47.9; attention q@k^T
 *     39.2 54.1
 *   GPT L6 C256 T128 b8: qkv fwd (K 256) 71.6 86.2; qkv dX (K 768) 77.3
 *     76.3; qkv dW 71.1 62.4; fc fwd 79.8 85.0; fc dX (K 1024) 75.7 69.3;
 *     fc dW 68.0 38.9; mlp_proj fwd (K 1024) 75.9 70.9; mlp_proj dX (K 256)
 *     80.3 84.7; mlp_proj dW 82.0 36.2
 * so on AVX2 oneDNN keeps the products with A as it is and K <= 512 (5-20%
 * faster) and OpenBLAS the rest (tests/test_dnnl.c test_f32_rule; the
 * AVX2 branch also runs on AVX-512 CPUs as test_dnnl_avx2).
 * Whole f32 training step of the compare_torch GPT (B16 T64 C128 L4),
 * OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 bench_ddp --model gpt --no-ddp
 * --device cpu --steps 20, NABLA_DNNL=0 and 1 alternated, 7 pairs, load
 * average 4 to 6: median 72.4 ms without oneDNN, 68.4 ms with the rule
 * (per-pair ratio median 0.95, range 0.93 to 1.35).
 * The same step in bf16 (bench_ddp --bf16, same conditions, load 7 to 10,
 * 5 runs): 145.8 ms with oneDNN, 231.4 ms with NABLA_DNNL=0, against
 * 100.8 ms in f32. perf record of the bf16 step: 39% in scalar f32 <-> bf16
 * casts (nb_f32_to_bf16 per element through the elementwise engine's
 * copy_cast, nb_bf16_to_f32), 26% in oneDNN's JIT kernels: the products
 * are no longer what bounds the bf16 step; vectorised casts are.
 * Convolutions, GFLOP/s, columns im2col / oneDNN f32 / oneDNN bf16 / bf16
 * through the f32 fallback, one thread, batch 32, 3x3 same (the digits
 * CNN; the library's plain NCHW layouts, where oneDNN runs its own
 * gemm-based convolution), bench_dnnl --threads 1 --only conv:
 *     1->16 8x8 fwd / bwd       33.3 33.5 19.1  7.9 / 33.1 14.0 15.8 11.9
 *     16->32 4x4 fwd / bwd      35.6 37.6 40.8 26.6 / 35.7 38.1 44.2 28.8
 *     32->64 2x2 fwd / bwd      28.0  9.4 15.3 15.0 / 21.9 13.7 23.1 16.0
 *     32->64 32x32 fwd / bwd    56.9 52.5 35.7 37.4 / 47.6 35.1 75.6 28.8
 * im2col wins or ties in f32; in bf16 oneDNN beats the fallback (or ties).
 * A blocked layout (nChw16c) would need a reorder per call; not tried.
 * Convolutions on the generic core (OPENBLAS_CORETYPE=Prescott on the
 * 2-core Xeon with AVX-512 and AMX, 2026-12-02, bench_dnnl --threads 1
 * --rounds 3 --ms 20 --only conv, load average 5 rising to 17, GFLOP/s),
 * im2col with oneDNN's GEMM against oneDNN's convolution (gemm:jit on
 * these plain layouts), forward / backward: 1->16 8x8 25.7 / 32.2
 * against 12.1 / 17.0; 16->32 4x4 93.6 / 73.2 against 44.9 / 42.7;
 * 32->64 2x2 74.9 / 25.5 against 21.7 / 25.7; 32->64 32x32 42.1 / 103.0
 * against 50.6 / 52.7. The digits CNN's step at batch 64 on one thread
 * (bench_ddp --no-ddp --model cnn --batch 64): 2.2-2.4 ms with the
 * primitive, 1.3-1.5 ms with im2col on oneDNN's GEMM (1.44-1.48 with
 * OpenBLAS's own SkylakeX core). Depthwise convolutions keep their
 * direct loops (no GEMM) on every core.
 * Forward layer norm / softmax / batch norm (f32, one thread, GB/s of x
 * read + y written, ours / oneDNN's, bench_dnnl --threads 1 --only norm):
 * layer norm (1024, 128) 14.9 / 32.6, (1024, 256) 19.3 / 35.1; softmax
 * rows of 64 2.1 / 10.5, of 128 2.0 / 11.1; batch norm (32, 16, 8x8) 4.6
 * / 4.5, (32, 64, 32x32) 3.3 / 3.0. oneDNN wins layer norm and softmax forward;
 * not adopted here: our saved statistics are f64 (oneDNN's f32), the
 * GPT's softmax is the fused causal one (no oneDNN equivalent), and the
 * thread-pool work rewrites those kernels now; a candidate for later.
 * On the Zen 3 of 2026-11-26 (AVX2), after the f32 softmax rows went to
 * lanes with nb__exp_f32 and batch norm's sums to lanes (load average 3.5,
 * so low for both columns): layer norm 9.5 / 16.2 and 10.9 / 21.7;
 * softmax rows of 64 3.0 / 5.7, of 128 3.8 / 9.9, head (1024, 79) 3.0 /
 * 7.7 (1.6-1.7 for ours before); batch norm 12.0 / 3.3, 8.0 / 3.0, 5.4 /
 * 2.2.
 * 2026-11-27, Zen 3, after the softmax rows' maximum was vectorised (GCC
 * had left it scalar) and the row's scaling cloned for AVX2, the same
 * softmax rows, old and new library alternated, two rounds: 2.3-3.0 ->
 * 3.2-3.3 (64), 2.5-3.0 -> 3.5-3.9 (128), 2.0-2.6 -> 2.6-3.3 (head),
 * oneDNN 5.5-9.8 beside them. oneDNN's softmax stays ~2x faster; it is not
 * used: ours sums in double lanes (oneDNN in f32) and runs on the pool with
 * the same bits for any thread count, while oneDNN would run here on one
 * thread (see above), so a rule choosing by thread count would make
 * softmax's bits depend on it.
 * The fused causal attention's f32 per-head products do not come here:
 * they are ours (tensor/cpu/sgemm.c, Note [Causal products]), 2.4x
 * OpenBLAS's effective rate on 8 x 8 heads of 128 x 128 x 32 (bench_ops
 * --kernels, Zen 3, 2026-11-27: 106.4 against 43.5 GFLOP/s one caller,
 * 84.4 two callers) since they skip the masked half; an unblocked use of
 * the same 6x16 tile for the linears' products measured within +-10% of
 * OpenBLAS (82-91 against 75-87 GFLOP/s on the L6 C256 shapes, and 37-60
 * on the weight gradients), so those stay here. */
#include "tensor/cpu/dnnl.h"

#include <cblas.h>
#include <dnnl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#endif

#include "nabla/threads.h"
#include "tensor/cpu/cpuinfo.h"
#include "tensor/cpu/matmul.h"
#include "tensor/cpu/threads.h"
#include "tensor/internal.h"

/* ------------------------------------------------------------ state */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t engine;

/* Each executing thread's stream and scratchpad, freed when it exits. */
typedef struct per_thread {
    dnnl_stream_t stream;
    void *scratch, *pack; /* oneDNN's scratchpad; a block's packed operand */
    size_t scratch_bytes, pack_bytes;
} per_thread;

static pthread_key_t thread_key;
static pthread_once_t thread_key_once = PTHREAD_ONCE_INIT;

static void per_thread_free(void *p) {
    per_thread *t = p;
    if (t->stream) dnnl_stream_destroy(t->stream);
    free(t->scratch);
    free(t->pack);
    free(t);
}

static void make_thread_key(void) {
    NB_CHECK(pthread_key_create(&thread_key, per_thread_free) == 0,
             "oneDNN: pthread_key_create failed");
}
static int mode_set = -1; /* -1: from the environment */
static int mode_env = -1; /* NABLA_DNNL, once read */
static int threads_set;   /* 0: OpenBLAS's */
static atomic_llong n_created, n_hits, n_exec, n_packed;

static void check(dnnl_status_t st, const char *what) {
    if (st != dnnl_success) NB_ABORT("oneDNN: %s failed with status %d", what, (int)st);
}

static int env_mode(void) {
    if (mode_env < 0) {
        const char *s = getenv("NABLA_DNNL");
        if (!s || !*s) mode_env = NB_DNNL_AUTO;
        else if (!strcmp(s, "0")) mode_env = NB_DNNL_OFF;
        else if (!strcmp(s, "1")) mode_env = NB_DNNL_AUTO;
        else if (!strcmp(s, "2")) mode_env = NB_DNNL_FORCE;
        else
            NB_ABORT("NABLA_DNNL=%s: expected 0 (never use oneDNN), 1 (measured rule, the default) "
                     "or 2 (oneDNN wherever it can)",
                     s);
    }
    return mode_env;
}

nb__dnnl_mode nb__dnnl_mode_now(void) {
    return (nb__dnnl_mode)(mode_set >= 0 ? mode_set : env_mode());
}

nb__dnnl_mode nb__dnnl_set_mode(int mode) {
    NB_CHECK(mode >= -1 && mode <= NB_DNNL_FORCE, "nb__dnnl_set_mode: mode %d is not -1, 0, 1 or 2",
             mode);
    nb__dnnl_mode prev = nb__dnnl_mode_now();
    mode_set = mode;
    if (mode < 0) mode_env = -1; /* read the environment again */
    return prev;
}

void nb__dnnl_set_num_threads(int n) { threads_set = n > 0 ? n : 0; }

/* The thread count nabla asks for: nb__dnnl_set_num_threads's, else OpenBLAS's. */
static int blas_threads(void) {
    if (threads_set > 0) return threads_set;
    int n = openblas_get_num_threads();
    return n > 0 ? n : 1;
}

/* OpenBLAS runs a generic core on a CPU that oneDNN has AVX2 kernels for
 * (Note [BLAS that does not know the CPU]): f32 products and convolutions
 * come here at every size above the small-product threshold and every
 * thread count. */
static bool has_isa(dnnl_cpu_isa_t want);
static bool generic_blas(void) { return nb__blas_generic() && has_isa(dnnl_cpu_isa_avx2); }

/* Whether OpenMP's workers sleep while they wait (OMP_WAIT_POLICY=passive,
 * read by the OpenMP runtime when it loads, so read here the same way). */
static bool passive_wait(void) {
    static int passive = -1;
    if (passive < 0) {
        const char *s = getenv("OMP_WAIT_POLICY");
        passive = s && !strcasecmp(s, "passive");
    }
    return passive;
}

/* oneDNN's thread count: an explicit nb__dnnl_set_num_threads, else
 * OpenBLAS's, but one thread under OpenMP's default active wait policy
 * (Note [oneDNN dispatch]: its spinning workers collapse on a shared
 * machine). */
static int want_threads(void) {
    if (threads_set > 0) return threads_set;
    int n = blas_threads();
    return n > 1 && !passive_wait() ? 1 : n;
}

static void set_threads(int n) {
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
    if (omp_get_max_threads() != n) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* ISA values are nested bit sets: each includes the ones below it */
static bool has_isa(dnnl_cpu_isa_t want) {
    return ((unsigned)dnnl_get_effective_cpu_isa() & (unsigned)want) == (unsigned)want;
}

bool nb__dnnl_native_bf16(void) { return has_isa(dnnl_cpu_isa_avx512_core_bf16); }

bool nb__dnnl_bf16_kernels(void) { return has_isa(dnnl_cpu_isa_avx512_core); }

int64_t nb__dnnl_primitives_created(void) { return (int64_t)atomic_load(&n_created); }
int64_t nb__dnnl_cache_hits(void) { return (int64_t)atomic_load(&n_hits); }
int64_t nb__dnnl_executions(void) { return (int64_t)atomic_load(&n_exec); }
int64_t nb__dnnl_packed_blocks(void) { return (int64_t)atomic_load(&n_packed); }

static void init_engine(void) {
    if (!engine) check(dnnl_engine_create(&engine, dnnl_cpu, 0), "dnnl_engine_create (CPU)");
}

/* ------------------------------------------------------------ cache */

enum { OP_MATMUL = 1, OP_CONV_FWD, OP_CONV_BWD_DATA, OP_CONV_BWD_WEIGHTS };
enum { MAX_MD = 5, SLOTS = 1024 };

typedef struct pkey {
    int32_t op, dt, nthr, flags;
    int32_t nd[3];
    int64_t dims[3][NB_MAX_DIMS];
    int64_t strides[3][NB_MAX_DIMS];
    int64_t conv[16];
} pkey;

typedef struct entry {
    pkey key;
    dnnl_primitive_t prim; /* NULL: not supported */
    bool cached;           /* in the table; else the caller drops it after use */
    size_t scratch;        /* bytes of scratchpad, the last md when > 0 */
    int n_md;
    int md_arg[MAX_MD];
    dnnl_memory_desc_t md[MAX_MD];
} entry;

static entry *table[SLOTS];
static int n_used;

static uint64_t hash_key(const pkey *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static entry *lookup(const pkey *k, int *slot) {
    uint64_t h = hash_key(k);
    for (int i = 0; i < SLOTS; i++) {
        int s = (int)((h + (uint64_t)i) % SLOTS);
        if (!table[s]) {
            *slot = s;
            return NULL;
        }
        if (!memcmp(&table[s]->key, k, sizeof *k)) return table[s];
    }
    *slot = -1;
    return NULL;
}

/* A new entry for k (its primitive still to make), in the free slot that
 * lookup found, or outside the table when that is 3/4 full. */
static entry *insert(const pkey *k, int slot) {
    entry *e = calloc(1, sizeof *e);
    NB_CHECK(e, "oneDNN primitive cache: out of memory");
    e->key = *k;
    if (slot >= 0 && n_used < SLOTS * 3 / 4) {
        table[slot] = e;
        e->cached = true;
        n_used++;
    }
    return e;
}

/* Drops e after use when it is not in the table. */
static void release(entry *e) {
    if (!e || e->cached) return;
    if (e->prim) dnnl_primitive_destroy(e->prim);
    free(e);
}

static dnnl_primitive_attr_t user_scratchpad_attr(void) {
    dnnl_primitive_attr_t attr;
    check(dnnl_primitive_attr_create(&attr), "dnnl_primitive_attr_create");
    check(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user),
          "dnnl_primitive_attr_set_scratchpad_mode");
    return attr;
}

/* e's primitive from pd (taken over and destroyed), unless pd is NULL or
 * oneDNN offers only its reference implementation for it. */
static void add_md(entry *e, int arg, const dnnl_memory_desc_t *md);

static void finish_entry(entry *e, dnnl_primitive_desc_t pd) {
    atomic_fetch_add(&n_created, 1);
    if (!pd) return;
    const char *impl = NULL;
    if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl &&
        strncmp(impl, "ref", 3) != 0) {
        if (dnnl_primitive_create(&e->prim, pd) != dnnl_success) e->prim = NULL;
        const dnnl_memory_desc_t *sp =
            dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
        e->scratch = sp ? dnnl_memory_desc_get_size(sp) : 0;
        if (e->prim && e->scratch > 0) add_md(e, DNNL_ARG_SCRATCHPAD, sp);
    }
    dnnl_primitive_desc_destroy(pd);
}

static void add_md(entry *e, int arg, const dnnl_memory_desc_t *md) {
    e->md_arg[e->n_md] = arg;
    e->md[e->n_md++] = *md;
}

/* Runs e on the buffers ptr[i] of its memory descriptors (the scratchpad
 * is this thread's), on this thread's stream, outside the lock. */
static per_thread *this_thread(void) {
    pthread_once(&thread_key_once, make_thread_key);
    per_thread *t = pthread_getspecific(thread_key);
    if (!t) {
        t = calloc(1, sizeof *t);
        NB_CHECK(t && pthread_setspecific(thread_key, t) == 0,
                 "oneDNN: cannot set up this thread's stream");
        check(dnnl_stream_create(&t->stream, engine, dnnl_stream_default_flags),
              "dnnl_stream_create");
    }
    return t;
}

/* *buf, a 64-byte aligned buffer of this thread holding *cap bytes, grown
 * to at least `bytes` (in whole pages); what: for the error. */
static void *thread_buffer(void **buf, size_t *cap, size_t bytes, const char *what) {
    if (bytes > *cap) {
        free(*buf);
        *cap = (bytes + 4095) / 4096 * 4096;
        *buf = aligned_alloc(64, *cap);
        NB_CHECK(*buf, "oneDNN: out of memory for %s (%zu bytes)", what, *cap);
    }
    return *buf;
}

static void execute(const entry *e, void *const *ptr, int nthr) {
    per_thread *t = this_thread();
    thread_buffer(&t->scratch, &t->scratch_bytes, e->scratch, "a scratchpad");
    dnnl_exec_arg_t args[MAX_MD];
    for (int i = 0; i < e->n_md; i++) {
        void *p = e->md_arg[i] == DNNL_ARG_SCRATCHPAD ? t->scratch : ptr[i];
        args[i].arg = e->md_arg[i];
        check(dnnl_memory_create(&args[i].memory, &e->md[i], engine, p), "dnnl_memory_create");
    }
    set_threads(nthr);
    check(dnnl_primitive_execute(e->prim, t->stream, e->n_md, args), "dnnl_primitive_execute");
    check(dnnl_stream_wait(t->stream), "dnnl_stream_wait");
    atomic_fetch_add(&n_exec, 1);
    for (int i = 0; i < e->n_md; i++) dnnl_memory_destroy(args[i].memory);
}

static dnnl_data_type_t dnnl_dt(nb_dtype dt) { return dt == NB_BF16 ? dnnl_bf16 : dnnl_f32; }

/* ------------------------------------------------------------ matmul */

/* op(t)'s dims and strides aligned to nd output dims: t's batch dims
 * (1 where t has none, or where t is expanded: stride 0, one matrix that
 * oneDNN broadcasts), then op(t)'s rows and columns. Strides of size-1
 * dims are normalised (they are never used) so that equal layouts make
 * equal keys. */
static void matrix_layout(const nb_tensor *t, bool trans, int nd, int64_t *dims, int64_t *st) {
    int off = nd - t->ndim;
    for (int i = 0; i < nd - 2; i++) {
        dims[i] = i < off ? 1 : t->shape[i - off];
        st[i] = i < off ? 0 : t->strides[i - off];
        if (st[i] == 0) dims[i] = 1;
    }
    int r = t->ndim - 2, c = t->ndim - 1;
    dims[nd - 2] = t->shape[trans ? c : r];
    dims[nd - 1] = t->shape[trans ? r : c];
    st[nd - 2] = t->strides[trans ? c : r];
    st[nd - 1] = t->strides[trans ? r : c];
    for (int i = 0; i < nd; i++)
        if (dims[i] == 1) st[i] = 0;
}

/* Folds the batch of a into its rows when b is one matrix for all of it
 * and a's batch dims continue its rows: (L, M, K) @ (K, N) as one
 * (L*M, K) @ (K, N). Rewrites the layouts to 2 dims and returns true. */
static bool fold_batch(int nd, int64_t (*dims)[NB_MAX_DIMS], int64_t (*st)[NB_MAX_DIMS]) {
    int64_t m = dims[0][nd - 2];
    if (nd == 2 || (dims[0][nd - 1] > 1 && st[0][nd - 1] != 1)) return false;
    int64_t row = m > 1 ? st[0][nd - 2] : dims[0][nd - 1], expect = row * m, rows = m;
    for (int i = nd - 3; i >= 0; i--) {
        if (dims[1][i] != 1) return false;
        if (dims[2][i] == 1) continue;
        if (dims[0][i] != dims[2][i] || st[0][i] != expect) return false;
        expect *= dims[0][i];
        rows *= dims[0][i];
    }
    for (int j = 0; j < 3; j++) {
        dims[j][0] = dims[j][nd - 2];
        dims[j][1] = dims[j][nd - 1];
        st[j][0] = st[j][nd - 2];
        st[j][1] = st[j][nd - 1];
    }
    dims[0][0] = rows;
    dims[2][0] = rows;
    st[0][0] = rows > 1 ? row : 0;
    st[0][1] = dims[0][1] > 1 ? 1 : 0;
    st[2][0] = rows > 1 ? dims[2][1] : 0;
    return true;
}

static void dense_strides(int nd, const int64_t *dims, int64_t *st) {
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        st[i] = dims[i] == 1 ? 0 : s;
        s *= dims[i];
    }
}

/* oneDNN wants positive strides even where a dim is 1 */
static void md_init(dnnl_memory_desc_t *md, int nd, const int64_t *dims, const int64_t *st,
                    dnnl_data_type_t dt) {
    dnnl_dims_t d = {0}, s = {0}; /* the API reads DNNL_MAX_NDIMS entries */
    int64_t inner = 1;
    for (int i = nd - 1; i >= 0; i--) {
        d[i] = dims[i];
        s[i] = st[i] ? st[i] : inner;
        if (st[i]) inner = st[i] * dims[i];
        else inner *= dims[i];
    }
    check(dnnl_memory_desc_init_by_strides(md, nd, d, dt, s), "dnnl_memory_desc_init_by_strides");
}

enum { F_BIAS = 1, F_GELU = 2, F_SUM = 4, F_OUT_BF16 = 8 };

static entry *matmul_entry(const pkey *k) {
    int slot;
    entry *e = lookup(k, &slot);
    if (e) {
        atomic_fetch_add(&n_hits, 1);
        return e;
    }
    e = insert(k, slot);
    set_threads(k->nthr); /* read when the primitive is made: Note [oneDNN threads at creation] */
    int nd = k->nd[2];
    dnnl_data_type_t dt = (dnnl_data_type_t)k->dt;
    dnnl_memory_desc_t a, b, c, bias;
    md_init(&a, nd, k->dims[0], k->strides[0], dt);
    md_init(&b, nd, k->dims[1], k->strides[1], dt);
    md_init(&c, nd, k->dims[2], k->strides[2], (k->flags & F_OUT_BF16) ? dnnl_bf16 : dnnl_f32);
    int64_t bd[NB_MAX_DIMS], bs[NB_MAX_DIMS];
    for (int i = 0; i < nd; i++) bd[i] = 1;
    bd[nd - 1] = k->dims[2][nd - 1];
    dense_strides(nd, bd, bs);
    md_init(&bias, nd, bd, bs, dnnl_f32);
    dnnl_matmul_desc_t desc;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    bool ok = dnnl_matmul_desc_init(&desc, &a, &b, (k->flags & F_BIAS) ? &bias : NULL, &c) ==
              dnnl_success;
    attr = user_scratchpad_attr();
    check(dnnl_post_ops_create(&po), "dnnl_post_ops_create");
    if (k->flags & F_SUM) check(dnnl_post_ops_append_sum(po, 1.0f), "dnnl_post_ops_append_sum");
    if (k->flags & F_GELU)
        check(dnnl_post_ops_append_eltwise(po, 1.0f, dnnl_eltwise_gelu_tanh, 0, 0),
              "dnnl_post_ops_append_eltwise");
    check(dnnl_primitive_attr_set_post_ops(attr, po), "dnnl_primitive_attr_set_post_ops");
    if (ok && dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL) != dnnl_success) pd = NULL;
    dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
    add_md(e, DNNL_ARG_SRC, &a);
    add_md(e, DNNL_ARG_WEIGHTS, &b);
    add_md(e, DNNL_ARG_DST, &c);
    if (k->flags & F_BIAS) add_md(e, DNNL_ARG_BIAS, &bias);
    finish_entry(e, pd);
    return e;
}

static bool rule_matmul(nb_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_a);

/* Note [oneDNN products on the pool]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * Where OpenBLAS's core is generic, f32 products come to oneDNN at every
 * thread count, but oneDNN's own threads are OpenMP's, whose workers spin
 * and then stall at barriers whenever a core is taken (Note [oneDNN
 * dispatch]): on the loaded 2-core Zen 3 of 2026-12-02 (load average
 * 70-110) the digits CNN's step took 338 ms once with oneDNN on 2 OpenMP
 * threads, against 1.4-13 ms on one. So a large 2-D product (the Linear
 * layers' forward and gradients: at least 256 rows and 2^22
 * multiply-adds) is cut into blocks of BLOCK_ROWS rows of C, each a
 * one-thread oneDNN product on its rows of op(A), and the blocks run on
 * nabla's pool, which never waits for a thread the system has not
 * scheduled (docs/threads.md). The blocks depend only on the shape, so
 * the result is the same for any pool size. bf16 products (native bf16,
 * on any OpenBLAS core) go in blocks the same way: they ran on one
 * oneDNN thread at every thread count, and the GPT L6 bf16 step at
 * default threads (2-core Xeon with AMX, OPENBLAS_CORETYPE=Prescott,
 * bench_ddp --no-ddp --model gpt6 --bf16 --steps 10, 2026-12-02, load
 * average 3-17, base and blocks alternated, 3 pairs) took 107-145 ms
 * whole against 84-90 ms in blocks; on one thread blocks cost 1-3%
 * (136-137 ms whole, 140-142 in blocks, load average 2): each block
 * packs B again. Whole and blocked results can differ in the last bits
 * (a weight gradient's shape did), which is why the blocks do not
 * depend on the pool's size. Every block's primitive
 * (two shapes at most: whole blocks and the last) is made before any
 * block runs, so a product oneDNN declines is declined whole and the
 * caller's kernel runs on untouched memory (an accumulating product must
 * not be added twice). */
enum { BLOCK_ROWS = 128 };

typedef struct block_job {
    const pkey *key;
    entry *whole, *last; /* the primitives of whole blocks and of the last one */
    void *const *ptr;
    size_t es, out_es; /* bytes of an element of A and of C */
    int64_t rows;
    bool pack; /* op(A) = A^T: each block's rows packed first (below) */
} block_job;

/* Note [Packed blocks of a transposed A]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * When op(A) = A^T (a weight gradient, dY^T X with A the (K, M) output
 * gradient), a block's rows of op(A) are BLOCK_ROWS columns of A: K
 * pieces of BLOCK_ROWS elements, M elements apart, which oneDNN 2.6 runs
 * with its `gemm:jit` kernel reading them in place (the same product
 * whole, A^T dense, gets `brg:avx512_core`). Once M elements are a page
 * or more (4096 bytes), every piece is on a page of its own, and the
 * hardware's prefetchers, which stop at page boundaries, no longer help:
 * on the 2-core AVX-512 Xeon of 2026-12-02 (1 thread, OPENBLAS_CORETYPE=
 * Prescott, K = 1024, N = 256, the fastest of 30 interleaved calls under
 * load) a product of M = 1024 took 3.3-3.7 ms in place against 3.0-3.1
 * with the block copied first (2.8-2.9 whole), M = 2048 9.3 against 6.4,
 * while below a page the copy costs more than it saves (M = 768: 2.1
 * against 2.3; M = 256: 0.67 against 0.73). So from a page on, each
 * block first copies its columns of A, K contiguous runs of its rows
 * (memcpy, no transpose), to a dense (K, rows) buffer of its thread and
 * runs on that. The copy is exact, and whether to copy depends only on
 * the shape, so results stay the same for any pool size. */
static void matmul_block(void *arg, int64_t blk, int tid) {
    (void)tid;
    const block_job *j = arg;
    int64_t r0 = blk * BLOCK_ROWS;
    entry *e = r0 + BLOCK_ROWS < j->rows ? j->whole : j->last;
    void *ptr[MAX_MD];
    memcpy(ptr, j->ptr, sizeof ptr);
    ptr[0] = (char *)ptr[0] + (size_t)(r0 * j->key->strides[0][0]) * j->es;
    ptr[2] = (char *)ptr[2] + (size_t)(r0 * j->key->strides[2][0]) * j->out_es;
    if (j->pack) {
        int64_t n = e->key.dims[0][0], k = j->key->dims[0][1], ld = j->key->strides[0][1];
        size_t row = (size_t)n * j->es;
        per_thread *t = this_thread();
        char *buf =
            thread_buffer(&t->pack, &t->pack_bytes, row * (size_t)k, "a product's packed block");
        for (int64_t i = 0; i < k; i++)
            memcpy(buf + (size_t)i * row, (const char *)ptr[0] + (size_t)(i * ld) * j->es, row);
        ptr[0] = buf;
        atomic_fetch_add(&n_packed, 1);
    }
    execute(e, ptr, 1);
}

static entry *block_entry(const pkey *whole, int64_t rows, bool pack) {
    pkey k = *whole;
    k.dims[0][0] = k.dims[2][0] = rows;
    if (pack) { /* dense (K, rows), Note [Packed blocks of a transposed A] */
        k.strides[0][0] = 1;
        k.strides[0][1] = rows;
    }
    if (rows == 1) k.strides[0][0] = k.strides[2][0] = 0; /* as matrix_layout normalises */
    return matmul_entry(&k);
}

static bool matmul_blocks(const pkey *key, void *const *ptr, size_t es, size_t out_es) {
    int64_t rows = key->dims[2][0], n_blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int64_t last_rows = rows - (n_blocks - 1) * BLOCK_ROWS;
    /* Note [Packed blocks of a transposed A]: op(A)'s rows 1 apart, its
     * columns a page or more apart */
    bool pack = key->strides[0][0] == 1 && key->dims[0][1] > 1 &&
                (size_t)key->strides[0][1] * es >= 4096;
    pthread_mutex_lock(&lock);
    init_engine();
    entry *whole = block_entry(key, BLOCK_ROWS, pack);
    entry *last = last_rows == BLOCK_ROWS ? whole : block_entry(key, last_rows, pack);
    pthread_mutex_unlock(&lock);
    bool ok = whole->prim && last->prim;
    if (ok) {
        block_job j = {key, whole, last, ptr, es, out_es, rows, pack};
        nb__parallel_for(n_blocks, matmul_block, &j);
    }
    if (last != whole) release(last);
    release(whole);
    return ok;
}

bool nb__dnnl_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                     bool trans_b, const nb_tensor *bias, bool gelu, bool accumulate) {
    nb__dnnl_mode mode = nb__dnnl_mode_now();
    bool out_bf16 = out->dtype == NB_BF16 && a->dtype == NB_BF16 && !accumulate;
    if (mode == NB_DNNL_OFF || (out->dtype != NB_F32 && !out_bf16) || a->dtype != b->dtype ||
        (a->dtype != NB_F32 && a->dtype != NB_BF16) || (bias && bias->dtype != NB_F32))
        return false;
    int nd = out->ndim, nbd = nd - 2;
    int64_t m = out->shape[nbd], n = out->shape[nbd + 1];
    int64_t k = a->shape[a->ndim - (trans_a ? 2 : 1)];
    int64_t batch = nb__numel_shape(nbd, out->shape);
    if (batch == 0 || m == 0 || n == 0 || k == 0) return false;
    if (mode == NB_DNNL_AUTO && !rule_matmul(a->dtype, batch, m, n, k, trans_a)) return false;

    pkey key;
    memset(&key, 0, sizeof key);
    key.op = OP_MATMUL;
    key.dt = (int32_t)dnnl_dt(a->dtype);
    key.nthr = want_threads();
    key.flags = (bias ? F_BIAS : 0) | (gelu ? F_GELU : 0) | (accumulate ? F_SUM : 0) |
                (out_bf16 ? F_OUT_BF16 : 0);
    matrix_layout(a, trans_a, nd, key.dims[0], key.strides[0]);
    matrix_layout(b, trans_b, nd, key.dims[1], key.strides[1]);
    for (int i = 0; i < nd; i++) key.dims[2][i] = out->shape[i];
    dense_strides(nd, key.dims[2], key.strides[2]);
    if (!fold_batch(nd, key.dims, key.strides)) {
        for (int i = 0; i < nbd; i++) /* oneDNN broadcasts size-1 batch dims only */
            for (int j = 0; j < 2; j++)
                if (key.dims[j][i] != 1 && key.dims[j][i] != key.dims[2][i]) return false;
        key.nd[0] = key.nd[1] = key.nd[2] = nd;
    } else {
        key.nd[0] = key.nd[1] = key.nd[2] = 2;
        for (int j = 0; j < 3; j++)
            for (int i = 2; i < NB_MAX_DIMS; i++) key.dims[j][i] = key.strides[j][i] = 0;
    }

    void *ptr[MAX_MD] = {(void *)a->data, (void *)b->data, out->data, bias ? bias->data : NULL};
    /* Note [oneDNN products on the pool]: f32 on a generic core, and bf16 */
    if (key.nd[2] == 2 && (a->dtype == NB_BF16 || generic_blas()) && key.nthr == 1 &&
        key.dims[2][0] >= 2 * BLOCK_ROWS && (double)key.dims[2][0] * key.dims[2][1] * k >= 4194304.0)
        return matmul_blocks(&key, ptr, nb_dtype_size(a->dtype), nb_dtype_size(out->dtype));
    pthread_mutex_lock(&lock);
    init_engine();
    entry *e = matmul_entry(&key);
    pthread_mutex_unlock(&lock);
    bool ok = e->prim != NULL;
    if (ok) execute(e, ptr, key.nthr);
    release(e);
    return ok;
}

/* ------------------------------------------------------------ convolution */

static void conv_key(pkey *k, int op, nb_dtype dt, const nb__conv2d_geom *g, int flags) {
    memset(k, 0, sizeof *k);
    k->op = op;
    k->dt = (int32_t)dnnl_dt(dt);
    k->nthr = want_threads();
    k->flags = flags;
    int64_t v[16] = {g->n,  g->c,  g->h,  g->w,  g->o,  g->kh, g->kw,     g->oh,
                     g->ow, g->sh, g->sw, g->ph, g->pw, g->dh, g->dw, g->groups};
    memcpy(k->conv, v, sizeof v);
}

typedef struct conv_mds {
    dnnl_memory_desc_t src, wei, bias, dst;
    dnnl_dims_t strides, dil, pl, pr;
} conv_mds;

static void md_tag(dnnl_memory_desc_t *md, int nd, const int64_t *dims, dnnl_data_type_t dt,
                   dnnl_format_tag_t tag) {
    dnnl_dims_t d = {0};
    memcpy(d, dims, sizeof(int64_t) * (size_t)nd);
    check(dnnl_memory_desc_init_by_tag(md, nd, d, dt, tag), "dnnl_memory_desc_init_by_tag");
}

static void conv_descs(conv_mds *d, dnnl_data_type_t dt, const nb__conv2d_geom *g) {
    int64_t G = g->groups;
    memset(d, 0, sizeof *d);
    md_tag(&d->src, 4, (int64_t[]){g->n, g->c, g->h, g->w}, dt, dnnl_nchw);
    md_tag(&d->dst, 4, (int64_t[]){g->n, g->o, g->oh, g->ow}, dt, dnnl_nchw);
    if (G == 1) md_tag(&d->wei, 4, (int64_t[]){g->o, g->c, g->kh, g->kw}, dt, dnnl_oihw);
    else md_tag(&d->wei, 5, (int64_t[]){G, g->o / G, g->c / G, g->kh, g->kw}, dt, dnnl_goihw);
    md_tag(&d->bias, 1, (int64_t[]){g->o}, dt, dnnl_a);
    d->strides[0] = g->sh;
    d->strides[1] = g->sw;
    d->dil[0] = g->dh - 1;
    d->dil[1] = g->dw - 1;
    d->pl[0] = g->ph;
    d->pl[1] = g->pw;
    /* the right padding that makes oneDNN's output size ours (floor division) */
    d->pr[0] = (g->oh - 1) * g->sh + (g->kh - 1) * g->dh + 1 - g->h - g->ph;
    d->pr[1] = (g->ow - 1) * g->sw + (g->kw - 1) * g->dw + 1 - g->w - g->pw;
}

static dnnl_primitive_desc_t conv_fwd_pd(const conv_mds *d, bool bias,
                                         const_dnnl_primitive_attr_t attr) {
    dnnl_convolution_desc_t desc;
    dnnl_primitive_desc_t pd = NULL;
    if (dnnl_dilated_convolution_forward_desc_init(
            &desc, dnnl_forward_training, dnnl_convolution_direct, &d->src, &d->wei,
            bias ? &d->bias : NULL, &d->dst, d->strides, d->dil, d->pl, d->pr) != dnnl_success)
        return NULL;
    if (dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL) != dnnl_success) return NULL;
    return pd;
}

static entry *conv_entry(int op, nb_dtype dt, const nb__conv2d_geom *g, bool bias) {
    pkey k;
    conv_key(&k, op, dt, g, bias ? F_BIAS : 0);
    int slot;
    entry *e = lookup(&k, &slot);
    if (e) {
        atomic_fetch_add(&n_hits, 1);
        return e;
    }
    e = insert(&k, slot);
    /* Note [oneDNN threads at creation]
     * Some oneDNN implementations fix their thread count when the primitive
     * is made (the gemm-based convolution of plain layouts reads
     * omp_get_max_threads() then and runs that many at every execution),
     * so the count of the key is set before, not only before executing:
     * made on 2 OpenMP threads and executed "on 1", the digits CNN's step
     * took 27-32 ms against 1.6 ms on the loaded 2-core Zen 3 of
     * 2026-12-02 (OpenMP's spinning workers; bench_ddp --model cnn). */
    set_threads(k.nthr);
    conv_mds d;
    conv_descs(&d, dnnl_dt(dt), g);
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_attr_t attr = user_scratchpad_attr();
    if (op == OP_CONV_FWD) {
        pd = conv_fwd_pd(&d, bias, attr);
        add_md(e, DNNL_ARG_SRC, &d.src);
        add_md(e, DNNL_ARG_WEIGHTS, &d.wei);
        add_md(e, DNNL_ARG_DST, &d.dst);
        if (bias) add_md(e, DNNL_ARG_BIAS, &d.bias);
    } else {
        dnnl_primitive_desc_t hint = conv_fwd_pd(&d, bias, NULL);
        dnnl_convolution_desc_t desc;
        dnnl_status_t st = hint ? dnnl_success : dnnl_unimplemented;
        if (st == dnnl_success && op == OP_CONV_BWD_DATA) {
            st = dnnl_dilated_convolution_backward_data_desc_init(
                &desc, dnnl_convolution_direct, &d.src, &d.wei, &d.dst, d.strides, d.dil, d.pl,
                d.pr);
            add_md(e, DNNL_ARG_DIFF_SRC, &d.src);
            add_md(e, DNNL_ARG_WEIGHTS, &d.wei);
            add_md(e, DNNL_ARG_DIFF_DST, &d.dst);
        } else if (st == dnnl_success) {
            st = dnnl_dilated_convolution_backward_weights_desc_init(
                &desc, dnnl_convolution_direct, &d.src, &d.wei, bias ? &d.bias : NULL, &d.dst,
                d.strides, d.dil, d.pl, d.pr);
            add_md(e, DNNL_ARG_SRC, &d.src);
            add_md(e, DNNL_ARG_DIFF_WEIGHTS, &d.wei);
            add_md(e, DNNL_ARG_DIFF_DST, &d.dst);
            if (bias) add_md(e, DNNL_ARG_DIFF_BIAS, &d.bias);
        }
        if (st == dnnl_success && dnnl_primitive_desc_create(&pd, &desc, attr, engine, hint) !=
                                      dnnl_success)
            pd = NULL;
        if (hint) dnnl_primitive_desc_destroy(hint);
    }
    dnnl_primitive_attr_destroy(attr);
    finish_entry(e, pd);
    return e;
}

static bool rule_conv(nb_dtype dt, const nb__conv2d_geom *g);

bool nb__dnnl_conv2d_forward(nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                             const void *w, const void *b) {
    nb__dnnl_mode mode = nb__dnnl_mode_now();
    if (mode == NB_DNNL_OFF || (dt != NB_F32 && dt != NB_BF16)) return false;
    if (mode == NB_DNNL_AUTO && !rule_conv(dt, g)) return false;
    pthread_mutex_lock(&lock);
    init_engine();
    entry *e = conv_entry(OP_CONV_FWD, dt, g, b != NULL);
    pthread_mutex_unlock(&lock);
    bool ok = e->prim != NULL;
    if (ok) execute(e, (void *[MAX_MD]){(void *)x, (void *)w, out, (void *)b}, e->key.nthr);
    release(e);
    return ok;
}

bool nb__dnnl_conv2d_backward(nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw,
                              void *db, const void *gout, const void *x, const void *w) {
    nb__dnnl_mode mode = nb__dnnl_mode_now();
    if (mode == NB_DNNL_OFF || (dt != NB_F32 && dt != NB_BF16) || (db && !dw)) return false;
    if (mode == NB_DNNL_AUTO && !rule_conv(dt, g)) return false;
    pthread_mutex_lock(&lock);
    init_engine();
    entry *ed = dx ? conv_entry(OP_CONV_BWD_DATA, dt, g, false) : NULL;
    entry *ew = dw ? conv_entry(OP_CONV_BWD_WEIGHTS, dt, g, db != NULL) : NULL;
    pthread_mutex_unlock(&lock);
    bool ok = (!ed || ed->prim) && (!ew || ew->prim);
    if (ok && ed) execute(ed, (void *[MAX_MD]){dx, (void *)w, (void *)gout}, ed->key.nthr);
    if (ok && ew) execute(ew, (void *[MAX_MD]){(void *)x, dw, (void *)gout, db}, ew->key.nthr);
    release(ed);
    release(ew);
    return ok;
}

/* ------------------------------------------------------------ GEMM */

bool nb__dnnl_conv_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                        float *c, int64_t ldc) {
    nb__dnnl_mode mode = nb__dnnl_mode_now();
    if (mode == NB_DNNL_OFF || (mode == NB_DNNL_AUTO && !generic_blas()) || m == 0 || n == 0 ||
        k == 0)
        return false;
    set_threads(want_threads());
    check(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta,
                     c, ldc),
          "dnnl_sgemm");
    atomic_fetch_add(&n_exec, 1);
    return true;
}

/* ------------------------------------------------------------ the rule */

/* Note [oneDNN dispatch]: bf16 on native bf16; f32 on one thread from 2^20
 * multiply-adds, and below AVX-512 only with A not transposed and K at
 * most 512; never f32 on more threads. */
enum { SMALL_MACS = 1 << 20 };

static bool rule_matmul(nb_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_a) {
    if (dt == NB_BF16) return nb__dnnl_native_bf16();
    if ((double)batch * (double)m * (double)n * (double)k < (double)SMALL_MACS) return false;
    if (generic_blas()) return true;
    if (blas_threads() != 1) return false;
    return has_isa(dnnl_cpu_isa_avx512_core) || (!trans_a && k <= 512);
}

/* Note [oneDNN dispatch]: bf16 on native bf16; f32 always im2col, whose
 * GEMMs take oneDNN's where OpenBLAS runs a generic core
 * (nb__dnnl_conv_gemm). */
static bool rule_conv(nb_dtype dt, const nb__conv2d_geom *g) {
    (void)g;
    return dt == NB_BF16 && nb__dnnl_native_bf16();
}

/* ------------------------------------------------------------ the report */

static const char *dnnl_isa_name(void) {
    switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return "other";
    }
}

#define ADD(...) (len += (size_t)snprintf(buf + (len < cap ? len : cap), len < cap ? cap - len : 0, __VA_ARGS__))

static size_t threads_str(char *buf, size_t cap, int n) {
    size_t len = 0;
    ADD("%d thread%s", n, n == 1 ? "" : "s");
    return len;
}

size_t nb__dnnl_describe(char *buf, size_t cap) {
    size_t len = 0;
    const dnnl_version_t *v = dnnl_version();
    int bt = blas_threads(), dt = want_threads();
    char bth[32], dth[32], blas[96], dnnl[96];
    threads_str(bth, sizeof bth, bt);
    threads_str(dth, sizeof dth, dt);
    int core_isa = nb__blas_core_isa(nb__blas_core());
    snprintf(blas, sizeof blas, "openblas %s %s (%s)", nb__blas_core(),
             core_isa < 0 ? "unknown-isa" : nb__isa_name((nb__isa)core_isa), bth);
    snprintf(dnnl, sizeof dnnl, "onednn %s (%s)", dnnl_isa_name(), dth);
    nb__dnnl_mode mode = nb__dnnl_mode_now();
    ADD("onednn: %d.%d.%d, isa %s, %s, %s%s\n", v->major, v->minor, v->patch, dnnl_isa_name(),
        DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP ? "OpenMP" : "its own threads", dth,
        mode == NB_DNNL_OFF ? " (off: NABLA_DNNL=0)" : mode == NB_DNNL_FORCE ? " (forced: NABLA_DNNL=2)" : "");
    /* the rule of rule_matmul and rule_conv, in words: the first library
     * named is the one a large product (A as stored, K <= 512) takes */
    if (mode == NB_DNNL_OFF) {
        ADD("f32 matmul: %s\n", blas);
        ADD("f32 conv2d: %s on im2col columns\n", blas);
    } else if (mode == NB_DNNL_FORCE) {
        ADD("f32 matmul: %s wherever it has a kernel, else %s\n", dnnl, blas);
        ADD("f32 conv2d: %s wherever it has a kernel, else onednn sgemm on im2col columns\n", dnnl);
    } else if (generic_blas()) {
        if (dt == 1)
            ADD("f32 matmul: onednn %s (blocks of %d rows, one thread each, on the pool's %d thread%s) "
                "from 2^22 multiply-adds and 256 rows, %s from 2^20, %s below\n",
                dnnl_isa_name(), BLOCK_ROWS, nb_get_num_threads(), nb_get_num_threads() == 1 ? "" : "s",
                dnnl, blas);
        else
            ADD("f32 matmul: %s from 2^20 multiply-adds, %s below\n", dnnl, blas);
        ADD("f32 conv2d: onednn sgemm %s (%s) on im2col columns\n", dnnl_isa_name(), dth);
    } else if (bt == 1) {
        ADD("f32 matmul: %s from 2^20 multiply-adds%s, %s for the rest\n", dnnl,
            has_isa(dnnl_cpu_isa_avx512_core) ? "" : " with A as stored and K <= 512", blas);
        ADD("f32 conv2d: %s on im2col columns\n", blas);
    } else {
        ADD("f32 matmul: %s (onednn on one thread only)\n", blas);
        ADD("f32 conv2d: %s on im2col columns\n", blas);
    }
    bool bf = mode == NB_DNNL_FORCE ? nb__dnnl_bf16_kernels()
                                    : mode == NB_DNNL_AUTO && nb__dnnl_native_bf16();
    if (bf) {
        if (dt == 1)
            ADD("bf16 matmul: onednn %s (blocks of %d rows, one thread each, on the pool's %d thread%s) "
                "from 2^22 multiply-adds and 256 rows, %s below\n",
                dnnl_isa_name(), BLOCK_ROWS, nb_get_num_threads(), nb_get_num_threads() == 1 ? "" : "s",
                dnnl);
        else
            ADD("bf16 matmul: %s\n", dnnl);
        ADD("bf16 conv2d: %s\n", dnnl);
    } else {
        ADD("bf16 matmul: as f32 matmul, on exact f32 copies (no native bf16 in onednn here)\n");
        ADD("bf16 conv2d: as f32 conv2d, on exact f32 copies\n");
    }
    ADD("f64 matmul: %s\n", blas);
    return len;
}
