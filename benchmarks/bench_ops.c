/* CPU op benchmarks, printed as one table:
 *  - matmul GFLOP/s of nb_matmul against cblas_sgemm called directly on
 *    the same buffers (square sizes and a transformer MLP shape, where
 *    nb_matmul gets a (B, T, C) input and BLAS the flat (B*T, C) matrix);
 *  - elementwise GB/s of nb_add, nb_gelu and the f32 <-> bf16 casts,
 *    counting bytes read + written;
 *  - the fixed cost of one tiny op (nb_add on 4 elements) with grad mode
 *    off and with an input that requires grad (dispatch + tape node), the
 *    step context reset after every call as a training loop does.
 * Each figure is the best of a few rounds that each repeat the call for a
 * share of a time budget; the whole program takes well under 30 s.
 * `--quick` runs tiny sizes (a smoke check); `--fixed-cost` only the
 * fixed-cost rows (for before/after comparisons of the op front end, run
 * interleaved several times); `--kernels` only nabla's own kernels on a GPT
 * step's shapes at 1 and 2 threads of nabla's pool (nb_set_num_threads,
 * the two counts interleaved round by round) and the attention's per-head
 * GEMMs three ways (see bench_heads). Exits 1 if nb_matmul and cblas_sgemm
 * disagree. */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nabla/nabla.h>

#include "tensor/cpu/sgemm.h"
#include "bench_time.h"

typedef struct bench_cfg {
    bool quick, fixed_only, kernels;
    double budget_s; /* per measured function */
} bench_cfg;

typedef void (*bench_fn)(void *arg);

/* Seconds per call, averaged over batches of calls that together run for
 * at least `budget_s`. */
static double time_per_call(bench_fn fn, void *arg, double budget_s) {
    long calls = 0, batch = 1;
    double start = now_s(), elapsed = 0;
    while (elapsed < budget_s) {
        for (long i = 0; i < batch; i++) fn(arg);
        calls += batch;
        elapsed = now_s() - start;
        if (elapsed < budget_s / 8) batch *= 2;
    }
    return elapsed / (double)calls;
}

#define ROUNDS 3

/* Best of ROUNDS interleaved rounds for each of n functions, after one
 * warm-up call each: interleaving keeps a change in machine load from
 * favouring one side of a comparison. */
static void time_best(int n, const bench_fn *fns, void *arg, double budget_s, double *best) {
    for (int i = 0; i < n; i++) {
        fns[i](arg);
        best[i] = INFINITY;
    }
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < n; i++) {
            double t = time_per_call(fns[i], arg, budget_s / ROUNDS);
            if (t < best[i]) best[i] = t;
        }
}

static const char *fmt_time(double s, char *buf, size_t n) {
    if (s < 1e-6) snprintf(buf, n, "%.1f ns", s * 1e9);
    else if (s < 1e-3) snprintf(buf, n, "%.2f us", s * 1e6);
    else if (s < 1.0) snprintf(buf, n, "%.2f ms", s * 1e3);
    else snprintf(buf, n, "%.3f s", s);
    return buf;
}

#define ROW_FMT "%-34s %-24s %11s %16s %16s %9s"

/* One table line, without trailing blanks. */
static void print_row(const char *c0, const char *c1, const char *c2, const char *c3,
                      const char *c4, const char *c5) {
    char line[256];
    int n = snprintf(line, sizeof line, ROW_FMT, c0, c1, c2, c3, c4, c5);
    if (n > (int)sizeof line - 1) n = (int)sizeof line - 1;
    while (n > 0 && (line[n - 1] == ' ' || line[n - 1] == '\n')) line[--n] = 0;
    puts(line);
}

static void row(const char *name, const char *shape, double t, const char *rate, const char *ref,
                const char *ratio) {
    char tb[32];
    print_row(name, shape, fmt_time(t, tb, sizeof tb), rate, ref, ratio);
}

/* ---- matmul ---- */

typedef struct mm_arg {
    nb_ctx *step;
    nb_tensor *a, *b, *out;
    bool tb;
    int m, n, k; /* the flat GEMM */
    float *c;    /* cblas output */
} mm_arg;

static void run_nb_matmul(void *p) {
    mm_arg *a = p;
    nb_ctx_reset(a->step);
    a->out = nb_matmul_t(a->step, a->a, a->b, false, a->tb);
}

static void run_cblas(void *p) {
    mm_arg *a = p;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, a->tb ? CblasTrans : CblasNoTrans, a->m, a->n, a->k, 1.0f,
                a->a->data, a->k, a->b->data, a->tb ? a->k : a->n, 0.0f, a->c, a->n);
}

/* Returns false when the two results disagree. */
static bool bench_matmul(const bench_cfg *cfg, nb_ctx *pers, nb_ctx *step, const char *name,
                         int nda, const int64_t *sa, int64_t k, int64_t n, bool tb) {
    nb_rng rng = nb_rng_make(7);
    nb_tensor *a = nb_rand_normal(pers, NB_F32, nda, sa, 0, 1, &rng);
    nb_tensor *b = tb ? nb_rand_normal(pers, NB_F32, 2, (int64_t[]){n, k}, 0, 1, &rng)
                      : nb_rand_normal(pers, NB_F32, 2, (int64_t[]){k, n}, 0, 1, &rng);
    int64_t m = nb_numel(a) / k;
    mm_arg arg = {step, a, b, NULL, tb, (int)m, (int)n, (int)k, malloc(sizeof(float) * (size_t)(m * n))};
    double t[2];
    time_best(2, (bench_fn[]){run_nb_matmul, run_cblas}, &arg, cfg->budget_s, t);
    double t_nb = t[0], t_bl = t[1];

    run_nb_matmul(&arg);
    run_cblas(&arg);
    const float *o = arg.out->data;
    double worst = 0;
    for (int64_t i = 0; i < m * n; i++) {
        double d = fabs((double)o[i] - (double)arg.c[i]) / (1.0 + fabs((double)arg.c[i]));
        if (d > worst) worst = d;
    }
    free(arg.c);

    double flop = 2.0 * (double)m * (double)n * (double)k;
    char shape[64], rate[32], ref[32], ratio[16];
    if (nda == 2)
        snprintf(shape, sizeof shape, "%lldx%lld @ %lldx%lld%s", (long long)m, (long long)k,
                 (long long)(tb ? n : k), (long long)(tb ? k : n), tb ? "^T" : "");
    else
        snprintf(shape, sizeof shape, "%lldx%lldx%lld @ %lldx%lld%s", (long long)sa[0],
                 (long long)sa[1], (long long)sa[2], (long long)(tb ? n : k),
                 (long long)(tb ? k : n), tb ? "^T" : "");
    snprintf(rate, sizeof rate, "%.1f GFLOP/s", flop / t_nb * 1e-9);
    snprintf(ref, sizeof ref, "%.1f GFLOP/s", flop / t_bl * 1e-9);
    snprintf(ratio, sizeof ratio, "%.2fx", t_bl / t_nb);
    row(name, shape, t_nb, rate, ref, ratio);
    if (worst > 1e-4) {
        fprintf(stderr, "bench_ops: nb_matmul and cblas_sgemm differ on %s (relative %.3g)\n",
                shape, worst);
        return false;
    }
    return true;
}

/* ---- elementwise ---- */

typedef struct ew_arg {
    nb_ctx *step;
    nb_tensor *x, *y, *xb; /* xb: x in bf16 */
} ew_arg;

static void run_add(void *p) {
    ew_arg *a = p;
    nb_ctx_reset(a->step);
    nb_add(a->step, a->x, a->y);
}

static void run_gelu(void *p) {
    ew_arg *a = p;
    nb_ctx_reset(a->step);
    nb_gelu(a->step, a->x, NB_GELU_TANH);
}

static void run_gelu_exact(void *p) {
    ew_arg *a = p;
    nb_ctx_reset(a->step);
    nb_gelu(a->step, a->x, NB_GELU_EXACT);
}

static void run_to_bf16(void *p) {
    ew_arg *a = p;
    nb_ctx_reset(a->step);
    nb_cast(a->step, a->x, NB_BF16);
}

static void run_from_bf16(void *p) {
    ew_arg *a = p;
    nb_ctx_reset(a->step);
    nb_cast(a->step, a->xb, NB_F32);
}

/* A Linear's bias gradient: the backward of x (1024, 1024) + b (1024), the
 * seed gradient summed over the rows into b's (nb__sum_to's aliased add). */
typedef struct bias_arg {
    nb_ctx *step;
    nb_tensor *x, *b;
} bias_arg;

static void run_bias_grad(void *p) {
    bias_arg *a = p;
    nb_ctx_reset(a->step);
    nb_tensor *y = nb_add(a->step, a->x, a->b);
    nb_backward_ex(y, &(nb_backward_options){nb_ones(a->step, NB_F32, 2, y->shape), false});
}

static void bench_bias_grad(const bench_cfg *cfg, nb_ctx *pers, nb_ctx *step) {
    nb_rng rng = nb_rng_make(12);
    bias_arg arg = {step, nb_rand_normal(pers, NB_F32, 2, (int64_t[]){1024, 1024}, 0, 1, &rng),
                    nb_zeros(pers, NB_F32, 1, (int64_t[]){1024})};
    nb_set_requires_grad(arg.b, true);
    bench_fn fn = run_bias_grad;
    double t;
    time_best(1, &fn, &arg, cfg->budget_s, &t);
    char rate[32];
    snprintf(rate, sizeof rate, "%.2f GB/s", 1024.0 * 1024.0 * sizeof(float) / t * 1e-9);
    row("bias gradient (rows summed, seed incl.)", "1024x1024 -> 1024", t, rate, "", "");
}

static void bench_elementwise(const bench_cfg *cfg, nb_ctx *pers, nb_ctx *step, int64_t numel) {
    nb_rng rng = nb_rng_make(11);
    ew_arg arg = {step, nb_rand_normal(pers, NB_F32, 1, &numel, 0, 1, &rng),
                  nb_rand_normal(pers, NB_F32, 1, &numel, 0, 1, &rng), NULL};
    arg.xb = nb_cast(pers, arg.x, NB_BF16);
    struct { const char *name; bench_fn fn; int bytes; /* per element, read + written */ } cases[] = {
        {"nb_add f32 (2 reads, 1 write)", run_add, 12},
        {"nb_gelu f32 tanh (1 read, 1 write)", run_gelu, 8},
        {"nb_gelu f32 exact", run_gelu_exact, 8},
        {"nb_cast f32 -> bf16", run_to_bf16, 6},
        {"nb_cast bf16 -> f32", run_from_bf16, 6},
    };
    char shape[32], rate[32];
    snprintf(shape, sizeof shape, "%lld", (long long)numel);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double t;
        time_best(1, &cases[i].fn, &arg, cfg->budget_s, &t);
        double bytes = (double)cases[i].bytes * (double)numel;
        snprintf(rate, sizeof rate, "%.2f GB/s", bytes / t * 1e-9);
        row(cases[i].name, shape, t, rate, "", "");
    }
}

/* ---- fixed cost ---- */

static void run_reset(void *p) { nb_ctx_reset(((ew_arg *)p)->step); }

static void bench_fixed_cost(const bench_cfg *cfg, nb_ctx *pers, nb_ctx *step) {
    ew_arg plain = {step, nb_ones(pers, NB_F32, 1, (int64_t[]){4}), nb_ones(pers, NB_F32, 1, (int64_t[]){4}),
                    NULL};
    ew_arg leaf = {step, nb_ones(pers, NB_F32, 1, (int64_t[]){4}), plain.y, NULL};
    nb_set_requires_grad(leaf.x, true);

    bool prev = nb_set_grad_enabled(false);
    double t_off, t_grad, t_reset;
    time_best(1, (bench_fn[]){run_add}, &plain, cfg->budget_s, &t_off);
    time_best(1, (bench_fn[]){run_reset}, &plain, cfg->budget_s, &t_reset);
    nb_set_grad_enabled(true);
    time_best(1, (bench_fn[]){run_add}, &leaf, cfg->budget_s, &t_grad);
    nb_set_grad_enabled(prev);

    row("nb_add, grad mode off", "4", t_off, "", "", "");
    row("nb_add, requires-grad input", "4", t_grad, "", "", "");
    row("  (of which nb_ctx_reset)", "-", t_reset, "", "", "");
}

/* ---- nabla's kernels at 1 and 2 pool threads ----
 * Shapes of the GPT of benchmarks/RESULTS.md (L6 C256 T128 b8: 1024 rows
 * of 256, MLP width 1024, 8 heads) and a vocabulary of 8192. */
typedef struct kern_arg {
    nb_ctx *step;
    nb_tensor *x, *x4, *x3, *w, *b, *logits, *big, *scores, *g, *g4, *g3;
    nb_tensor *targets;
    nb_module *attn;
    nb_optim *opt;
} kern_arg;

static void k_add(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_add(a->step, a->x4, a->x4);
}
static void k_gelu(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_gelu(a->step, a->x4, NB_GELU_TANH);
}
static void k_gelu_bwd(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_backward_with(nb_gelu(a->step, a->x4, NB_GELU_TANH), a->g4);
}
static void k_ln(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_layer_norm(a->step, a->x, 1, a->w, a->b, 1e-5);
}
static void k_ln_bwd(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_backward_with(nb_layer_norm(a->step, a->x, 1, a->w, a->b, 1e-5), a->g);
}
static void k_softmax_causal(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_softmax_causal(a->step, a->scores, 0.125);
}
static void k_ce(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_backward(nb_cross_entropy(a->step, a->logits, a->targets, NULL));
}
static void k_sum(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_sum_all(a->step, a->big);
}
static void k_attn(void *p) {
    kern_arg *a = p;
    nb_ctx_reset(a->step);
    nb_backward_with(nb_module_forward(a->attn, a->step, a->x3), a->g3);
}
static void k_adamw(void *p) { nb_optim_step(((kern_arg *)p)->opt); }

static void bench_kernels(const bench_cfg *cfg, nb_ctx *pers, nb_ctx *step) {
    int64_t rows = cfg->quick ? 64 : 1024, c = cfg->quick ? 32 : 256, v = cfg->quick ? 64 : 8192;
    int64_t bt = cfg->quick ? 2 : 8, t = cfg->quick ? 32 : 128, h = 8;
    nb_rng rng = nb_rng_make(3);
    kern_arg a = {.step = step};
    a.x = nb_rand_normal(pers, NB_F32, 2, (int64_t[]){rows, c}, 0, 1, &rng);
    a.x4 = nb_rand_normal(pers, NB_F32, 2, (int64_t[]){rows, 4 * c}, 0, 1, &rng);
    a.g = nb_rand_normal(pers, NB_F32, 2, (int64_t[]){rows, c}, 0, 1, &rng);
    a.g4 = nb_rand_normal(pers, NB_F32, 2, (int64_t[]){rows, 4 * c}, 0, 1, &rng);
    a.x3 = nb_reshape(pers, a.x, 3, (int64_t[]){bt, t, c});
    a.g3 = nb_reshape(pers, a.g, 3, (int64_t[]){bt, t, c});
    a.w = nb_rand_normal(pers, NB_F32, 1, &c, 1, 0.1, &rng);
    a.b = nb_rand_normal(pers, NB_F32, 1, &c, 0, 0.1, &rng);
    a.logits = nb_rand_normal(pers, NB_F32, 2, (int64_t[]){rows, v}, 0, 1, &rng);
    a.scores = nb_rand_normal(pers, NB_F32, 3, (int64_t[]){bt * h, t, t}, 0, 1, &rng);
    a.big = nb_rand_normal(pers, NB_F32, 1, (int64_t[]){(int64_t)1 << (cfg->quick ? 16 : 22)}, 0, 1, &rng);
    int64_t *tg = malloc((size_t)rows * sizeof *tg);
    for (int64_t i = 0; i < rows; i++) tg[i] = (i * 7919) % v;
    a.targets = nb_from_host(pers, NB_I64, 1, &rows, tg);
    free(tg);
    nb_set_requires_grad(a.x, true);
    nb_set_requires_grad(a.x4, true);
    nb_set_requires_grad(a.w, true);
    nb_set_requires_grad(a.b, true);
    nb_set_requires_grad(a.logits, true);
    a.attn = nb_causal_self_attention_new(pers, NB_F32, c, (int)h, NULL, &rng);
    /* AdamW over the parameters of a 6-layer block stack of width C */
    int64_t per_layer = 12 * c * c + 13 * c, n_par = 6 * per_layer;
    nb_tensor *par = nb_rand_normal(pers, NB_F32, 1, &n_par, 0, 0.02, &rng);
    nb_set_requires_grad(par, true);
    nb_tensor *gp = nb_rand_normal(pers, NB_F32, 1, &n_par, 0, 0.02, &rng);
    nb_backward_with(nb_mul_scalar(step, par, 1.0), gp);
    nb_ctx_reset(step);
    nb_named_tensor np = {"p", par};
    nb_optim_hparams hp = NB_ADAMW_DEFAULTS;
    a.opt = nb_optim_new(NB_OPTIM_ADAMW, &np, 1, &hp);

    char shape_rc[32], shape_r4c[32], shape_rv[32], shape_att[48], shape_big[32], shape_p[32];
    snprintf(shape_rc, sizeof shape_rc, "%lldx%lld", (long long)rows, (long long)c);
    snprintf(shape_r4c, sizeof shape_r4c, "%lldx%lld", (long long)rows, (long long)(4 * c));
    snprintf(shape_rv, sizeof shape_rv, "%lldx%lld", (long long)rows, (long long)v);
    snprintf(shape_att, sizeof shape_att, "%lldx%lldx%lld, %lld heads", (long long)bt, (long long)t,
             (long long)c, (long long)h);
    snprintf(shape_big, sizeof shape_big, "%lld", (long long)nb_numel(a.big));
    snprintf(shape_p, sizeof shape_p, "%lld params", (long long)n_par);
    struct { const char *name, *shape; bench_fn fn; } cases[] = {
        {"nb_add f32", shape_r4c, k_add},
        {"nb_gelu tanh", shape_r4c, k_gelu},
        {"nb_gelu tanh fwd+bwd", shape_r4c, k_gelu_bwd},
        {"nb_layer_norm", shape_rc, k_ln},
        {"nb_layer_norm fwd+bwd", shape_rc, k_ln_bwd},
        {"nb_softmax_causal", shape_att, k_softmax_causal},
        {"nb_cross_entropy fwd+bwd", shape_rv, k_ce},
        {"nb_sum_all", shape_big, k_sum},
        {"attention layer fwd+bwd", shape_att, k_attn},
        {"AdamW step", shape_p, k_adamw},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    print_row("kernel (nabla's pool)", "shape", "1 thread", "2 threads", "speedup", "");
    for (int i = 0; i < n; i++) {
        double best[2] = {INFINITY, INFINITY};
        for (int k = 0; k < 2; k++) {
            nb_set_num_threads(k + 1);
            cases[i].fn(&a);
        }
        for (int r = 0; r < ROUNDS; r++)
            for (int k = 0; k < 2; k++) {
                nb_set_num_threads(k + 1);
                double tk = time_per_call(cases[i].fn, &a, cfg->budget_s / ROUNDS);
                if (tk < best[k]) best[k] = tk;
            }
        char t1[32], t2[32], sp[32];
        fmt_time(best[0], t1, sizeof t1);
        fmt_time(best[1], t2, sizeof t2);
        snprintf(sp, sizeof sp, "%.2fx", best[0] / best[1]);
        print_row(cases[i].name, cases[i].shape, t1, t2, sp, "");
    }
    nb_set_num_threads(0);
    nb_optim_free(a.opt);
    nb_ctx_reset(step);
}

/* ---- the attention's per-head GEMMs, three ways ----
 * Per (batch, head) the products of the attention kernel's forward
 * (tensor/cpu/attention.c): S = Q K^T (T x T x D) and Y = S V (T x D x T),
 * on BT x H heads: (a) one thread calling, OpenBLAS on 1 thread; (b) one
 * thread calling, OpenBLAS on 2 threads; (c) two threads each calling on
 * half the heads, OpenBLAS on 1 thread (what the kernel did before its
 * f32 products became nb__sgemm_causal); (d) one thread calling
 * nb__sgemm_causal, which skips what the causal mask zeroes (Note [Causal
 * products]; its GFLOP/s counts the full products' flops, as the others':
 * the effective rate). */
typedef struct heads_arg {
    int64_t t, d, c, heads;
    float *qkv, *s, *y;
    int64_t lo, hi;
    bool causal; /* (d): nb__sgemm_causal instead of cblas_sgemm */
} heads_arg;

static void heads_range(heads_arg *a, float *s) {
    int64_t w = 3 * a->c, hn = a->c / a->d, t = a->t;
    for (int64_t p = a->lo; p < a->hi; p++) {
        int64_t b = p / hn, hh = p % hn;
        const float *q = a->qkv + b * t * w + hh * a->d, *k = q + a->c, *v = q + 2 * a->c;
        float *y = a->y + b * t * a->c + hh * a->d;
        if (a->causal) {
            nb__sgemm_causal(NB_TRI_LOWER, false, true, t, t, a->d, q, w, k, w, s, t);
            for (int64_t i = 0; i < t; i++) /* what the causal rows leave above the diagonal */
                for (int64_t j = i + 1; j < t; j++) s[i * t + j] = 0.0f;
            nb__sgemm_causal(NB_TRI_K_UPTO_ROW, false, false, t, a->d, t, s, t, v, w, y, a->c);
            continue;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)t, (int)t, (int)a->d, 1.0f, q,
                    (int)w, k, (int)w, 0.0f, s, (int)t);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)t, (int)a->d, (int)t, 1.0f, s,
                    (int)t, v, (int)w, 0.0f, y, (int)a->c);
    }
}

/* (c)'s second thread: started for the rounds of (c) only, it spins on
 * `go` (a call's half is ~100 us, too short to sleep between). */
static heads_arg heads_cfg;
static atomic_int heads_go, heads_done, heads_quit;

static void *heads_helper(void *p) {
    (void)p;
    heads_arg b = heads_cfg;
    b.lo = b.heads / 2, b.hi = b.heads;
    b.s = b.s + b.t * b.t;
    while (!atomic_load(&heads_quit)) {
        if (!atomic_exchange(&heads_go, 0)) continue;
        heads_range(&b, b.s);
        atomic_store(&heads_done, 1);
    }
    return NULL;
}

static void heads_one(void *p) {
    (void)p;
    heads_arg a = heads_cfg;
    a.lo = 0, a.hi = a.heads;
    heads_range(&a, a.s);
}
static void heads_causal(void *p) {
    (void)p;
    heads_arg a = heads_cfg;
    a.lo = 0, a.hi = a.heads, a.causal = true;
    heads_range(&a, a.s);
}
static void heads_two(void *p) {
    (void)p;
    heads_arg a = heads_cfg;
    a.lo = 0, a.hi = a.heads / 2;
    atomic_store(&heads_go, 1);
    heads_range(&a, a.s);
    while (!atomic_exchange(&heads_done, 0)) {
    }
}

static void bench_heads(const bench_cfg *cfg) {
    int64_t bt = cfg->quick ? 2 : 8, t = cfg->quick ? 32 : 128, c = cfg->quick ? 32 : 256, h = 8;
    heads_arg a = {t, c / h, c, bt * h, NULL, NULL, NULL, 0, 0, false};
    a.qkv = malloc((size_t)(bt * t * 3 * c) * sizeof(float));
    a.s = malloc((size_t)(2 * t * t) * sizeof(float));
    a.y = malloc((size_t)(bt * t * c) * sizeof(float));
    for (int64_t i = 0; i < bt * t * 3 * c; i++) a.qkv[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    heads_cfg = a;
    double flops = 2.0 * 2.0 * (double)(bt * h) * (double)(t * t) * (double)(c / h);
    int saved = openblas_get_num_threads();
    struct { const char *name; int blas; bench_fn fn; } ways[] = {
        {"per-head GEMMs, 1 caller, BLAS 1", 1, heads_one},
        {"per-head GEMMs, 1 caller, BLAS 2", 2, heads_one},
        {"per-head GEMMs, 2 callers, BLAS 1", 1, heads_two},
        {"per-head causal GEMMs, 1 caller", 1, heads_causal},
    };
    enum { NW = sizeof ways / sizeof ways[0] };
    double best[NW];
    for (int i = 0; i < NW; i++) best[i] = INFINITY;
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < NW; i++) {
            openblas_set_num_threads(ways[i].blas);
            pthread_t th;
            atomic_store(&heads_quit, 0);
            if (i == 2) pthread_create(&th, NULL, heads_helper, NULL);
            ways[i].fn(NULL);
            double tk = time_per_call(ways[i].fn, NULL, cfg->budget_s / ROUNDS);
            if (tk < best[i]) best[i] = tk;
            atomic_store(&heads_quit, 1);
            if (i == 2) pthread_join(th, NULL);
        }
    openblas_set_num_threads(saved);
    char shape[48], rate[32];
    snprintf(shape, sizeof shape, "%lldx(%lldx%lldx%lld)", (long long)(bt * h), (long long)t,
             (long long)t, (long long)(c / h));
    for (int i = 0; i < NW; i++) {
        snprintf(rate, sizeof rate, "%.1f GFLOP/s", flops / best[i] * 1e-9);
        row(ways[i].name, shape, best[i], rate, "", "");
    }
    free(a.qkv), free(a.s), free(a.y);
}

/* The matmul and elementwise rows; false if nb_matmul and cblas_sgemm disagree. */
static bool bench_throughput(const bench_cfg *cfg, nb_ctx *pers, nb_ctx *step) {
    bool ok = true;
    static const int64_t full[] = {64, 256, 512, 1024}, quick[] = {8, 32};
    const int64_t *sizes = cfg->quick ? quick : full;
    int nsizes = cfg->quick ? 2 : 4;
    for (int i = 0; i < nsizes; i++) {
        int64_t s = sizes[i];
        ok &= bench_matmul(cfg, pers, step, "nb_matmul", 2, (int64_t[]){s, s}, s, s, false);
    }
    /* GPT-2 small MLP: (B, T, C) @ (C, 4C), and the weight stored (4C, C) */
    int64_t B = cfg->quick ? 2 : 8, T = cfg->quick ? 16 : 128, C = cfg->quick ? 32 : 768;
    int64_t x_shape[3] = {B, T, C};
    ok &= bench_matmul(cfg, pers, step, "nb_matmul (B,T,C) x (C,4C)", 3, x_shape, C, 4 * C, false);
    ok &= bench_matmul(cfg, pers, step, "nb_matmul_t (B,T,C) x (4C,C)^T", 3, x_shape, C, 4 * C, true);
    nb_ctx_reset(pers);

    bench_elementwise(cfg, pers, step, cfg->quick ? (int64_t)1 << 16 : (int64_t)1 << 24);
    if (!cfg->quick) /* and a size that stays in the caches, as a model's activations do */
        bench_elementwise(cfg, pers, step, (int64_t)1 << 18);
    nb_ctx_reset(pers);
    bench_bias_grad(cfg, pers, step);
    nb_ctx_reset(pers);
    return ok;
}

int main(int argc, char **argv) {
    bench_cfg cfg = {false, false, false, 0.3};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--info") == 0) {
            return fputs(nb_config_string(), stdout) < 0;
        } else if (strcmp(argv[i], "--quick") == 0) {
            cfg.quick = true;
            cfg.budget_s = 0.01;
        } else if (strcmp(argv[i], "--fixed-cost") == 0) {
            cfg.fixed_only = true;
        } else if (strcmp(argv[i], "--kernels") == 0) {
            cfg.kernels = true;
        } else {
            fprintf(stderr, "usage: %s [--quick] [--fixed-cost] [--kernels] [--info]\n", argv[0]);
            return 2;
        }
    }
    nb_ctx *pers = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);

    printf("nabla bench_ops: CPU, %ld cores online, OpenBLAS %d threads, nabla's pool %d threads, "
           "f32%s\n", sysconf(_SC_NPROCESSORS_ONLN), openblas_get_num_threads(),
           nb_get_num_threads(), cfg.quick ? " (--quick sizes)" : "");
    if (cfg.kernels) {
        bench_kernels(&cfg, pers, step);
        bench_heads(&cfg);
        nb_ctx_free(step);
        nb_ctx_free(pers);
        return 0;
    }
    print_row("benchmark", "shape", "time/call", "nabla", "cblas_sgemm", "nb speed");
    print_row("---------", "-----", "---------", "-----", "-----------", "--------");

    bool ok = cfg.fixed_only || bench_throughput(&cfg, pers, step);
    bench_fixed_cost(&cfg, pers, step);

    nb_ctx_free(step);
    nb_ctx_free(pers);
    return ok ? 0 : 1;
}
