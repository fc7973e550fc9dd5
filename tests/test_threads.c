/* The CPU kernels' thread pool (tensor/cpu/threads.c): every threaded
 * kernel gives the same bits at 1, 2, 3 and 4 threads (Note [Deterministic
 * parallel kernels] in tensor/cpu/threads.h) and the right values at sizes
 * that engage the pool; the size's precedence (nb_set_num_threads >
 * NABLA_NUM_THREADS > OMP_NUM_THREADS > cores / LOCAL_WORLD_SIZE) and its
 * errors; the pool's own behaviour (every chunk once, other threads
 * really used, nesting, resizing, fork). */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tensor/cpu/attention.h"
#include "tensor/cpu/threads.h"
#include "testutil.h"

static const int counts[] = {1, 2, 3, 4};
#define NCOUNTS 4

/* ---- helpers ---- */
static void clear_env(void) {
    unsetenv("NABLA_NUM_THREADS");
    unsetenv("OMP_NUM_THREADS");
    unsetenv("LOCAL_WORLD_SIZE");
    unsetenv("NABLA_CPU_BIND");
}

static double *host(const nb_tensor *t) {
    double *d = malloc((size_t)nb_numel(t) * sizeof *d);
    nb_to_host_f64(t, d);
    return d;
}

/* A growing list of byte buffers: everything a run produced. */
typedef struct outputs {
    int n;
    size_t size[256];
    void *data[256];
} outputs;

static void keep(outputs *o, const nb_tensor *t) {
    ck_assert_int_lt(o->n, 256);
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    o->size[o->n] = bytes;
    o->data[o->n] = malloc(bytes ? bytes : 1);
    nb_to_host(t, o->data[o->n]);
    o->n++;
}

static void free_outputs(outputs *o) {
    for (int i = 0; i < o->n; i++) free(o->data[i]);
    o->n = 0;
}

/* Runs `fn` at 1, 2, 3 and 4 threads and asserts memcmp-identical outputs. */
static void same_bits_for_any_count(const char *what, void (*fn)(outputs *o)) {
    outputs ref = {0}, o = {0};
    nb_set_num_threads(1);
    fn(&ref);
    ck_assert_int_gt(ref.n, 0);
    for (int k = 1; k < NCOUNTS; k++) {
        nb_set_num_threads(counts[k]);
        ck_assert_int_eq(nb_get_num_threads(), counts[k]);
        fn(&o);
        ck_assert_int_eq(o.n, ref.n);
        for (int i = 0; i < ref.n; i++) {
            ck_assert_uint_eq(o.size[i], ref.size[i]);
            ck_assert_msg(memcmp(o.data[i], ref.data[i], ref.size[i]) == 0,
                          "%s: output %d differs between 1 and %d threads", what, i, counts[k]);
        }
        free_outputs(&o);
    }
    free_outputs(&ref);
    nb_set_num_threads(0);
}

/* ---- the kernels, at sizes above their thresholds ---- */
#define BIG (3 * 16384 + 123) /* elementwise: four chunks, the last partial */

static void run_elementwise(outputs *o) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(BIG), 1);
    nb_tensor *b = nbt_randn(ctx, NB_F32, NB_SHAPE(BIG), 2);
    /* broadcast and strided: (R, C) + (C), and a transposed operand */
    nb_tensor *m = nbt_randn(ctx, NB_F32, NB_SHAPE(301, 257), 3);
    nb_tensor *row = nbt_randn(ctx, NB_F32, NB_SHAPE(257), 4);
    keep(o, nb_add(ctx, m, row));
    keep(o, nb_add(ctx, nb_transpose(ctx, m, 0, 1), nb_transpose(ctx, m, 0, 1)));
    keep(o, nb_contiguous(ctx, nb_transpose(ctx, m, 0, 1)));
    nb_tensor *y = nb_gelu(ctx, nb_mul(ctx, a, b), NB_GELU_TANH);
    keep(o, y);
    keep(o, nb_exp(ctx, b));
    nb_backward(nbt_weighted_sum(ctx, y)); /* the fused GELU backward */
    keep(o, a->grad);
    nb_ctx_free(ctx);
}

static void run_rows(outputs *o) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    /* softmax over the last axis and over a middle axis */
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(700, 97), 5);
    nb_tensor *s = nb_softmax(ctx, x, 1);
    keep(o, s);
    nb_tensor *x3 = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(40, 33, 70), 6);
    nb_tensor *s3 = nb_log_softmax(ctx, x3, 1);
    keep(o, s3);
    nb_tensor *c = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(6, 128, 128), 7);
    nb_tensor *sc = nb_softmax_causal(ctx, c, 0.125);
    keep(o, sc);
    nb_backward(nb_add(ctx, nb_add(ctx, nbt_weighted_sum(ctx, s), nbt_weighted_sum(ctx, s3)),
                       nbt_weighted_sum(ctx, sc)));
    keep(o, x->grad);
    keep(o, x3->grad);
    keep(o, c->grad);
    nb_ctx_free(ctx);
}

static void run_norm_loss(outputs *o) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(333, 150), 8);
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(150), 9);
    nb_tensor *b = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(150), 10);
    nb_tensor *y = nb_layer_norm(ctx, x, 1, w, b, 1e-5);
    keep(o, y);
    nb_tensor *logits = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(1001, 61), 11);
    int64_t tgt[1001];
    for (int i = 0; i < 1001; i++) tgt[i] = i % 7 == 3 ? -100 : (i * 37) % 61;
    nb_cross_entropy_opts ce = {.ignore_index = -100, .label_smoothing = 0.1};
    nb_tensor *l1 = nb_cross_entropy(ctx, logits, nb_from_host(ctx, NB_I64, NB_SHAPE(1001), tgt),
                                     &ce);
    keep(o, l1);
    nb_tensor *p = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(100003), 12);
    nb_tensor *q = nbt_randn(ctx, NB_F32, NB_SHAPE(100003), 13);
    nb_tensor *l2 = nb_mse_loss(ctx, p, q);
    nb_tensor *l3 = nb_bce_with_logits(ctx, p, nb_mul_scalar(ctx, nb_exp(ctx, q), 0.1));
    keep(o, l2);
    keep(o, l3);
    nb_tensor *table = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(50, 96), 14);
    int64_t idx[700];
    for (int i = 0; i < 700; i++) idx[i] = (i * i + 3) % 50;
    nb_tensor *e = nb_embedding(ctx, table, nb_from_host(ctx, NB_I64, NB_SHAPE(700), idx));
    keep(o, e);
    nb_tensor *total = nb_add(ctx, nb_add(ctx, nbt_weighted_sum(ctx, y), l1),
                              nb_add(ctx, nb_add(ctx, l2, l3), nbt_weighted_sum(ctx, e)));
    nb_backward(total);
    keep(o, x->grad);
    keep(o, w->grad);
    keep(o, b->grad);
    keep(o, logits->grad);
    keep(o, p->grad);
    keep(o, table->grad);
    nb_ctx_free(ctx);
}

/* odd sizes: one long row (pieces of 32768 on the pool), many rows */
static void run_reductions(outputs *o) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int di = 0; di < 2; di++) {
        nb_dtype dt = di ? NB_F64 : NB_F32;
        nb_tensor *v = nbt_randn(ctx, dt, NB_SHAPE(200003), 15);
        nb_tensor *m = nbt_randn(ctx, dt, NB_SHAPE(517, 131), 16);
        int ax1[1] = {1}, ax0[1] = {0};
        keep(o, nb_sum_all(ctx, v));
        keep(o, nb_mean_all(ctx, v));
        keep(o, nb_var(ctx, v, 1, ax0, 1, false));
        keep(o, nb_sum(ctx, m, 1, ax1, false));
        keep(o, nb_sum(ctx, m, 1, ax0, false));
        keep(o, nb_var(ctx, m, 1, ax1, 0, false));
        keep(o, nb_max(ctx, m, 1, ax1, false));
        keep(o, nb_argmax(ctx, m, 1, false));
    }
    nb_ctx_free(ctx);
}

/* A small GPT's step: logits, loss, every gradient (attention across
 * heads, GELU, layer norm, embedding backward, cross-entropy), the
 * gradient norm and the parameters after two AdamW updates. */
static void run_gpt_step(outputs *o) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_gpt_config cfg = {67, 64, 2, 4, 64, 0.0};
    nb_rng rng = nb_rng_make(42);
    nb_module *g = nb_gpt_new(pctx, NB_F32, &cfg, &rng);
    nb_named_tensor ps[64];
    int np = nb_module_named_parameters(g, ps, 64);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 1e-2;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, ps, np, &h);
    int64_t tok[8 * 64], tgt[8 * 64];
    for (int i = 0; i < 8 * 64; i++) {
        tok[i] = (i * 13 + i / 7) % 67;
        tgt[i] = (i * 5 + 1) % 67;
    }
    for (int step = 0; step < 2; step++) {
        nb_ctx_reset(ctx);
        nb_optim_zero_grad(opt);
        nb_tensor *logits = nb_gpt_forward(g, ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(8, 64), tok));
        nb_tensor *loss = nb_gpt_loss(ctx, logits, nb_from_host(ctx, NB_I64, NB_SHAPE(8, 64), tgt));
        nb_backward(loss);
        if (step == 0) {
            keep(o, logits);
            keep(o, loss);
            for (int i = 0; i < np; i++) keep(o, ps[i].tensor->grad);
        }
        double norm = nb_optim_clip_grad_norm(opt, 1e9, 2.0);
        nb_tensor *nt = nb_from_host(ctx, NB_F64, 0, NULL, &norm);
        keep(o, nt);
        nb_optim_step(opt);
    }
    for (int i = 0; i < np; i++) keep(o, ps[i].tensor);
    nb_optim_free(opt);
    nb_ctx_free(ctx);
    nb_ctx_free(pctx);
}

START_TEST(test_same_bits_elementwise) { same_bits_for_any_count("elementwise", run_elementwise); }
END_TEST
START_TEST(test_same_bits_rows) { same_bits_for_any_count("softmax", run_rows); }
END_TEST
START_TEST(test_same_bits_norm_loss) { same_bits_for_any_count("norm/loss", run_norm_loss); }
END_TEST
START_TEST(test_same_bits_reductions) { same_bits_for_any_count("reductions", run_reductions); }
END_TEST
START_TEST(test_same_bits_gpt_step) { same_bits_for_any_count("GPT step", run_gpt_step); }
END_TEST

/* ---- values at threaded sizes, against plain loops here ---- */
START_TEST(test_values_at_threaded_sizes) {
    nb_set_num_threads(3);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int64_t n = 200003;
    nb_tensor *v = nbt_randn(ctx, NB_F64, NB_SHAPE(n), 21);
    double *hv = host(v), want = 0, ss = 0;
    for (int64_t i = 0; i < n; i++) want += hv[i];
    double mu = want / (double)n;
    for (int64_t i = 0; i < n; i++) ss += (hv[i] - mu) * (hv[i] - mu);
    ck_assert_double_eq_tol(nb_item(nb_sum_all(ctx, v)), want, 1e-9 * n);
    int ax0[1] = {0};
    ck_assert_double_eq_tol(nb_item(nb_var(ctx, v, 1, ax0, 1, false)), ss / (double)(n - 1), 1e-9);

    /* x * y + gelu_tanh(x), elementwise */
    nb_tensor *a = nbt_randn(ctx, NB_F32, NB_SHAPE(BIG), 22);
    nb_tensor *b = nbt_randn(ctx, NB_F32, NB_SHAPE(BIG), 23);
    double *ha = host(a), *hb = host(b), *w = malloc(BIG * sizeof *w);
    for (int64_t i = 0; i < BIG; i++) {
        double x = ha[i];
        w[i] = x * hb[i] + 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    }
    nbt_assert_close(nb_add(ctx, nb_mul(ctx, a, b), nb_gelu(ctx, a, NB_GELU_TANH)), w, 1e-5, 1e-5);

    /* layer norm rows and its weight gradient (sum over rows of g xhat) */
    int64_t m = 333, d = 150;
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(m, d), 24);
    nb_tensor *lw = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(d), 25);
    nb_tensor *y = nb_layer_norm(ctx, x, 1, lw, NULL, 1e-5);
    nb_backward(nb_sum_all(ctx, y));
    double *hx = host(x), *hw = host(lw), *wy = malloc((size_t)(m * d) * sizeof *wy);
    double *wdw = calloc((size_t)d, sizeof *wdw);
    for (int64_t i = 0; i < m; i++) {
        double s = 0, q = 0;
        for (int64_t j = 0; j < d; j++) s += hx[i * d + j];
        s /= (double)d;
        for (int64_t j = 0; j < d; j++) q += (hx[i * d + j] - s) * (hx[i * d + j] - s);
        double r = 1 / sqrt(q / (double)d + 1e-5);
        for (int64_t j = 0; j < d; j++) {
            wy[i * d + j] = (hx[i * d + j] - s) * r * hw[j];
            wdw[j] += (hx[i * d + j] - s) * r;
        }
    }
    nbt_assert_close(y, wy, 1e-12, 1e-12);
    nbt_assert_close(lw->grad, wdw, 1e-10, 1e-12);

    /* a broadcast input's gradient: column sums of g, accumulated through
     * an output aliased by zero strides (cut by columns on the pool) */
    nb_tensor *bias = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(257), 27);
    nb_tensor *rows = nbt_randn(ctx, NB_F64, NB_SHAPE(301, 257), 28);
    nb_tensor *gw = nbt_randn(ctx, NB_F64, NB_SHAPE(301, 257), 29);
    nb_backward_with(nb_add(ctx, rows, bias), gw);
    double *hg = host(gw), *colsum = calloc(257, sizeof *colsum);
    for (int i = 0; i < 301; i++)
        for (int k = 0; k < 257; k++) colsum[k] += hg[i * 257 + k];
    nbt_assert_close(bias->grad, colsum, 1e-12, 1e-12);
    free(hg), free(colsum);

    /* cross-entropy over 1001 rows */
    nb_tensor *lg = nbt_randn(ctx, NB_F64, NB_SHAPE(1001, 61), 26);
    int64_t tgt[1001];
    for (int i = 0; i < 1001; i++) tgt[i] = (i * 37) % 61;
    double *hl = host(lg), ce = 0;
    for (int i = 0; i < 1001; i++) {
        double mx = -INFINITY, se = 0;
        for (int j = 0; j < 61; j++) mx = fmax(mx, hl[i * 61 + j]);
        for (int j = 0; j < 61; j++) se += exp(hl[i * 61 + j] - mx);
        ce += mx + log(se) - hl[i * 61 + tgt[i]];
    }
    ck_assert_double_eq_tol(
        nb_item(nb_cross_entropy(ctx, lg, nb_from_host(ctx, NB_I64, NB_SHAPE(1001), tgt), NULL)),
        ce / 1001, 1e-12);
    free(hv), free(ha), free(hb), free(w), free(hx), free(hw), free(wy), free(wdw), free(hl);
    nb_ctx_free(ctx);
    nb_set_num_threads(0);
}
END_TEST

/* The attention across heads on 4 threads against f64 loops, with each
 * row's log-sum-exp. */
START_TEST(test_attention_heads_against_composed) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int64_t n = 3, t = 40, h = 4, dd = 16, c = h * dd;
    nb_tensor *qkv = nbt_randn(ctx, NB_F64, NB_SHAPE(n, t, 3 * c), 31);
    double *hq = host(qkv), *want = calloc((size_t)(n * t * c), sizeof *want);
    double scale = 1 / sqrt((double)dd), *att = malloc((size_t)t * sizeof *att);
    double *want_lse = malloc((size_t)(n * h * t) * sizeof *want_lse);
    for (int64_t b = 0; b < n; b++)
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t i = 0; i < t; i++) {
                const double *qi = hq + (b * t + i) * 3 * c + hh * dd;
                double mx = -INFINITY, se = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double *kj = hq + (b * t + j) * 3 * c + c + hh * dd;
                    double s = 0;
                    for (int64_t e = 0; e < dd; e++) s += qi[e] * kj[e];
                    att[j] = s * scale;
                    mx = fmax(mx, att[j]);
                }
                for (int64_t j = 0; j <= i; j++) se += att[j] = exp(att[j] - mx);
                want_lse[(b * h + hh) * t + i] = mx + log(se);
                for (int64_t j = 0; j <= i; j++) {
                    const double *vj = hq + (b * t + j) * 3 * c + 2 * c + hh * dd;
                    for (int64_t e = 0; e < dd; e++)
                        want[(b * t + i) * c + hh * dd + e] += att[j] / se * vj[e];
                }
            }
    nb_set_num_threads(4);
    nb_tensor *y = nb_zeros(ctx, NB_F64, NB_SHAPE(n, t, c));
    nb_tensor *lse = nb_zeros(ctx, NB_F32, NB_SHAPE(n, h, t));
    nb__cpu_causal_attention(ctx, y, lse, qkv, (int)h, scale);
    nbt_assert_close(y, want, 1e-12, 1e-12);
    nbt_assert_close(lse, want_lse, 1e-6, 1e-6); /* f32 */
    free(hq), free(want), free(att), free(want_lse);
    nb_ctx_free(ctx);
    nb_set_num_threads(0);
}
END_TEST

/* ---- the size ---- */
static int cores(void) {
    cpu_set_t set;
    ck_assert_int_eq(sched_getaffinity(0, sizeof set, &set), 0);
    return CPU_COUNT(&set);
}

START_TEST(test_size_precedence) {
    clear_env();
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), cores());
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), cores() / 2 > 0 ? cores() / 2 : 1);
    setenv("NABLA_CPU_BIND", "cores", 1); /* bound by nbrun: the mask is the rank's own */
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), cores());
    setenv("NABLA_CPU_BIND", "none", 1);
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), cores() / 2 > 0 ? cores() / 2 : 1);
    unsetenv("NABLA_CPU_BIND");
    setenv("LOCAL_WORLD_SIZE", "1000", 1); /* more ranks than cores: still one thread */
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), 1);
    setenv("OMP_NUM_THREADS", "3", 1);
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), 3);
    setenv("OMP_NUM_THREADS", "5,2", 1); /* an OpenMP list: its outer level */
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), 5);
    setenv("NABLA_NUM_THREADS", "2", 1);
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), 2);
    nb_set_num_threads(4);
    ck_assert_int_eq(nb_get_num_threads(), 4);
    setenv("NABLA_NUM_THREADS", "1", 1); /* the explicit size wins over a later variable */
    ck_assert_int_eq(nb_get_num_threads(), 4);
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), 1);
    clear_env();
    nb_set_num_threads(0);
}
END_TEST

START_TEST(test_size_errors) {
    clear_env();
    setenv("NABLA_NUM_THREADS", "two", 1);
    NBT_EXPECT_ABORT(nb_set_num_threads(0), "NABLA_NUM_THREADS='two' is not a thread count");
    setenv("NABLA_NUM_THREADS", "0", 1);
    NBT_EXPECT_ABORT(nb_set_num_threads(0), "NABLA_NUM_THREADS='0'");
    setenv("NABLA_NUM_THREADS", "3x", 1);
    NBT_EXPECT_ABORT(nb_set_num_threads(0), "NABLA_NUM_THREADS='3x'");
    unsetenv("NABLA_NUM_THREADS");
    setenv("OMP_NUM_THREADS", "-1", 1);
    NBT_EXPECT_ABORT(nb_set_num_threads(0), "OMP_NUM_THREADS='-1' is not a thread count");
    unsetenv("OMP_NUM_THREADS");
    setenv("LOCAL_WORLD_SIZE", "99999999999", 1);
    NBT_EXPECT_ABORT(nb_set_num_threads(0), "LOCAL_WORLD_SIZE='99999999999' is not a process count");
    clear_env();
    NBT_EXPECT_ABORT(nb_set_num_threads(-2), "nb_set_num_threads: n = -2 is out of range");
    NBT_EXPECT_ABORT(nb_set_num_threads(1025), "nb_set_num_threads: n = 1025 is out of range");
    setenv("OMP_NUM_THREADS", "", 1); /* empty is unset */
    nb_set_num_threads(0);
    ck_assert_int_eq(nb_get_num_threads(), cores());
    /* the pool still works after the aborts */
    nb_set_num_threads(2);
    ck_assert_int_eq(nb_get_num_threads(), 2);
    clear_env();
    nb_set_num_threads(0);
}
END_TEST

/* ---- the pool itself ---- */
typedef struct count_job {
    atomic_int runs[1000];
    atomic_int bad_tid;
    int limit;
} count_job;

static void count_chunk(void *varg, int64_t c, int tid) {
    count_job *j = varg;
    atomic_fetch_add(&j->runs[c], 1);
    if (tid < 0 || tid >= j->limit) atomic_store(&j->bad_tid, 1);
}

static void check_counts(int64_t n) {
    static count_job j;
    for (int i = 0; i < 1000; i++) atomic_store(&j.runs[i], 0);
    atomic_store(&j.bad_tid, 0);
    j.limit = nb__parallel_threads(n);
    nb__parallel_for(n, count_chunk, &j);
    for (int64_t i = 0; i < n; i++) ck_assert_int_eq(atomic_load(&j.runs[i]), 1);
    for (int64_t i = n; i < 1000; i++) ck_assert_int_eq(atomic_load(&j.runs[i]), 0);
    ck_assert_int_eq(atomic_load(&j.bad_tid), 0);
}

/* many jobs, every chunk exactly once with tid below the limit, while the
 * size changes under it */
START_TEST(test_pool_many_jobs_and_resizes) {
    for (int round = 0; round < 3000; round++) {
        if (round % 100 == 0) nb_set_num_threads(1 + (round / 100) % 5);
        check_counts(1 + (round * 7) % 999);
    }
    nb_set_num_threads(0);
}
END_TEST

/* Each chunk waits until two threads are inside chunks at once: passes
 * only if a worker really runs chunks beside the caller. */
typedef struct meet_job {
    atomic_int inside;
    atomic_int met;
    atomic_int tid_seen[8];
} meet_job;

static void meet_chunk(void *varg, int64_t c, int tid) {
    (void)c;
    meet_job *j = varg;
    atomic_store(&j->tid_seen[tid], 1);
    atomic_fetch_add(&j->inside, 1);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (atomic_load(&j->inside) < 2) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec > 20) return; /* the test fails below */
    }
    atomic_store(&j->met, 1);
}

START_TEST(test_pool_runs_on_other_threads) {
    nb_set_num_threads(2);
    for (int rep = 0; rep < 3; rep++) { /* the first job starts the workers, later ones wake them */
        meet_job j = {0};
        nb__parallel_for(2, meet_chunk, &j);
        ck_assert_msg(atomic_load(&j.met), "two chunks never ran at the same time");
        ck_assert(atomic_load(&j.tid_seen[0]) && atomic_load(&j.tid_seen[1]));
        struct timespec pause = {0, 5 * 1000 * 1000}; /* long enough for the worker to sleep */
        nanosleep(&pause, NULL);
    }
    nb_set_num_threads(0);
}
END_TEST

/* a job started inside a chunk runs on that thread */
static void inner_chunk(void *varg, int64_t c, int tid) {
    (void)c;
    if (tid != 0) atomic_store((atomic_int *)varg, 1);
}

static void outer_chunk(void *varg, int64_t c, int tid) {
    (void)c, (void)tid;
    nb__parallel_for(16, inner_chunk, varg);
}

START_TEST(test_pool_nested_runs_inline) {
    nb_set_num_threads(4);
    atomic_int wrong = 0;
    nb__parallel_for(8, outer_chunk, &wrong);
    ck_assert_int_eq(atomic_load(&wrong), 0);
    nb_set_num_threads(0);
}
END_TEST

/* The child of a fork has no workers; its first job starts its own. */
START_TEST(test_pool_after_fork) {
    nb_set_num_threads(3);
    check_counts(500); /* workers running in the parent */
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        meet_job j = {0};
        nb__parallel_for(2, meet_chunk, &j);
        count_job *cj = calloc(1, sizeof *cj);
        cj->limit = 3;
        nb__parallel_for(999, count_chunk, cj);
        bool ok = atomic_load(&j.met) && !atomic_load(&cj->bad_tid);
        for (int i = 0; i < 999; i++) ok &= atomic_load(&cj->runs[i]) == 1;
        _exit(ok ? 0 : 1);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's pool failed");
    check_counts(500); /* and the parent's still works */
    nb_set_num_threads(0);
}
END_TEST

/* Leaves idle workers behind: the process (Check's child, or this one
 * under CK_FORK=no) exits with them asleep, which ASan checks. */
START_TEST(test_pool_exit_with_idle_workers) {
    nb_set_num_threads(4);
    check_counts(100);
    struct timespec pause = {0, 2 * 1000 * 1000};
    nanosleep(&pause, NULL);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_same_bits_elementwise, test_same_bits_rows, test_same_bits_norm_loss,
                             test_same_bits_reductions, test_same_bits_gpt_step,
                             test_values_at_threaded_sizes, test_attention_heads_against_composed,
                             test_size_precedence, test_size_errors, test_pool_many_jobs_and_resizes,
                             test_pool_runs_on_other_threads, test_pool_nested_runs_inline,
                             test_pool_after_fork, test_pool_exit_with_idle_workers, NULL};
    return nbt_suite("threads", "core", 240, tests);
}

int main(void) {
    clear_env(); /* the sizes below are the tests' own */
    return nbt_run(suite());
}
