/* oneDNN against OpenBLAS / our im2col kernels on the products of the
 * bundled models, the figures behind Note [oneDNN dispatch]
 * (tensor/cpu/dnnl.c):
 *  - matmul, GFLOP/s: OpenBLAS f32, oneDNN f32, oneDNN bf16 (bf16 operands,
 *    f32 product), and bf16 through the f32 fallback (conversion +
 *    OpenBLAS, what NABLA_DNNL=0 does), for each forward product of the GPT's linears and
 *    attention and of the MLP, and the two backward products of each linear
 *    (dX = dY @ W, dW = dY^T @ X);
 *  - conv2d, GFLOP/s of forward and of backward (input and weight
 *    gradients together): im2col + OpenBLAS f32, oneDNN f32, oneDNN bf16,
 *    bf16 through the f32 fallback,
 *    for the digits CNN's three convolutions;
 *  - forward layer norm, softmax and batch norm (training), GB/s of x read
 *    + y written: our kernels against oneDNN's primitives (f32; called
 *    here directly, not through the library, which does not use them).
 * Rounds are interleaved (every variant of a row once per round, rounds
 * repeated) and each cell is the median over rounds; a round times a
 * variant over at least --ms milliseconds of calls, after one warm-up call
 * (which also makes the oneDNN primitive). `--threads N` sets OpenBLAS's
 * thread count, which oneDNN follows. The load average is printed before
 * and after: the machine is shared. `--quick`: 2 rounds, short budgets;
 * `--only matmul|conv|norm`: one table. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <dnnl.h>
#include <nabla/nabla.h>
#include <omp.h>

#include "tensor/cpu/conv.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/matmul.h"
#include "tensor/cpu/norm.h"
#include "tensor/cpu/softmax.h"
#include "bench_time.h"

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void print_load(const char *when) {
    double l[3] = {0};
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf %lf %lf", &l[0], &l[1], &l[2]) != 3) l[0] = -1;
        fclose(f);
    }
    printf("# load average %s: %.2f %.2f %.2f\n", when, l[0], l[1], l[2]);
}

typedef void (*run_fn)(void *arg);

/* Seconds per call over at least budget_s of calls. */
static double time_calls(run_fn fn, void *arg, double budget_s) {
    fn(arg);
    int reps = 0;
    double t0 = now_s(), t;
    do {
        fn(arg);
        reps++;
        t = now_s();
    } while (t - t0 < budget_s);
    return (t - t0) / reps;
}

/* ---- matmul ---- */

typedef struct mm_arg {
    nb_tensor *out, *a, *b;
    bool ta, tb;
    int mode;
} mm_arg;

static void run_mm(void *p) {
    mm_arg *m = p;
    nb__dnnl_set_mode(m->mode);
    nb__cpu_gemm(m->out, m->a, m->b, m->ta, m->tb, false);
}

typedef struct mm_row {
    const char *name;
    int64_t batch, m, n, k;
    bool ta, tb; /* a stored (K, M) / b stored (N, K) */
} mm_row;

/* (M, K) of a (B*T, C) activation against a (K, N) weight stored as
 * nn.Linear's (N, K): forward x @ W^T, backward dX = dY @ W and
 * dW = dY^T @ X, as the op front end issues them. */
#define LINEAR(tag, bt, k, n)                                     \
    {tag " fwd", 1, bt, n, k, false, true},                       \
    {tag " dX", 1, bt, k, n, false, false},                       \
    {tag " dW", 1, n, k, bt, true, false}

static const mm_row mm_rows[] = {
    /* compare_torch GPT: B16 T64 C128, 4 heads (head dim 32), vocab 79 */
    LINEAR("gpt-s qkv", 1024, 128, 384),
    LINEAR("gpt-s proj", 1024, 128, 128),
    LINEAR("gpt-s fc", 1024, 128, 512),
    LINEAR("gpt-s mlp_proj", 1024, 512, 128),
    LINEAR("gpt-s head", 1024, 128, 79),
    {"gpt-s att q@k^T", 64, 64, 64, 32, false, true},
    {"gpt-s att p@v", 64, 64, 32, 64, false, false},
    /* GPT L6 C256 T128 b8, 4 heads (head dim 64) */
    LINEAR("gpt-m qkv", 1024, 256, 768),
    LINEAR("gpt-m fc", 1024, 256, 1024),
    LINEAR("gpt-m mlp_proj", 1024, 1024, 256),
    {"gpt-m att q@k^T", 32, 128, 128, 64, false, true},
    {"gpt-m att p@v", 32, 128, 64, 128, false, false},
    /* MLP of compare_torch: batch 8, 30 -> 64 -> 32 -> 2 */
    {"mlp fc1 fwd", 1, 8, 64, 30, false, true},
    {"mlp fc2 fwd", 1, 8, 32, 64, false, true},
};

static nb_tensor *rand_mat(nb_ctx *ctx, nb_dtype dt, int64_t batch, int64_t r, int64_t c) {
    nb_tensor *t = nb_rand_normal(ctx, NB_F32, 3, (int64_t[]){batch, r, c}, 0, 1, NULL);
    return dt == NB_F32 ? t : nb_cast(ctx, t, dt);
}

static void bench_matmul(int rounds, double budget) {
    printf("\n%-20s %5s %5s %5s %5s  %9s %9s %9s %9s   (GFLOP/s, median of %d rounds)\n",
           "matmul", "batch", "M", "N", "K", "blas-f32", "dnnl-f32", "dnnl-bf16", "blas-bf16",
           rounds);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (size_t i = 0; i < sizeof mm_rows / sizeof mm_rows[0]; i++) {
        const mm_row *r = &mm_rows[i];
        nb_tensor *out = nb_empty(ctx, NB_F32, 3, (int64_t[]){r->batch, r->m, r->n});
        mm_arg args[4];
        for (int v = 0; v < 4; v++) {
            nb_dtype dt = v >= 2 ? NB_BF16 : NB_F32;
            args[v].out = out;
            args[v].a = r->ta ? rand_mat(ctx, dt, r->batch, r->k, r->m)
                              : rand_mat(ctx, dt, r->batch, r->m, r->k);
            args[v].b = r->tb ? rand_mat(ctx, dt, r->batch, r->n, r->k)
                              : rand_mat(ctx, dt, r->batch, r->k, r->n);
            args[v].ta = r->ta;
            args[v].tb = r->tb;
            args[v].mode = v == 0 || v == 3 ? NB_DNNL_OFF : NB_DNNL_FORCE;
        }
        double g[4][32], flop = 2.0 * (double)(r->batch * r->m * r->n * r->k);
        for (int k = 0; k < rounds; k++)
            for (int v = 0; v < 4; v++)
                g[v][k] = flop / time_calls(run_mm, &args[v], budget) * 1e-9;
        printf("%-20s %5lld %5lld %5lld %5lld  %9.1f %9.1f %9.1f %9.1f\n", r->name,
               (long long)r->batch, (long long)r->m, (long long)r->n, (long long)r->k,
               median(g[0], rounds), median(g[1], rounds), median(g[2], rounds),
               median(g[3], rounds));
        fflush(stdout);
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
}

/* ---- conv ---- */

typedef struct conv_arg {
    nb__conv2d_geom g;
    nb_dtype dt;
    int mode;
    bool backward;
    void *x, *w, *y, *dx, *dw, *cols;
} conv_arg;

static void run_conv(void *p) {
    conv_arg *c = p;
    nb__dnnl_set_mode(c->mode);
    if (c->backward)
        nb__cpu_conv2d_backward_cols(c->dt, &c->g, c->dx, c->dw, NULL, c->y, c->x, c->w, c->cols);
    else nb__cpu_conv2d_forward_cols(c->dt, &c->g, c->y, c->x, c->w, NULL, c->cols);
}

typedef struct conv_row {
    const char *name;
    nb__conv2d_geom g;
} conv_row;

static const conv_row conv_rows[] = {
    /* the digits CNN of compare_torch: batch 32, 8x8 images, 3x3 "same", no bias */
    {"cnn conv1 1->16 8x8", {32, 1, 8, 8, 16, 3, 3, 8, 8, 1, 1, 1, 1, 1, 1, 1}},
    {"cnn conv2 16->32 4x4", {32, 16, 4, 4, 32, 3, 3, 4, 4, 1, 1, 1, 1, 1, 1, 1}},
    {"cnn conv3 32->64 2x2", {32, 32, 2, 2, 64, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1}},
    /* a larger image for scale: batch 32, 32x32, 32 -> 64 */
    {"conv 32->64 32x32", {32, 32, 32, 32, 64, 3, 3, 32, 32, 1, 1, 1, 1, 1, 1, 1}},
};

static void *rand_buf(nb_ctx *ctx, nb_dtype dt, int64_t n) {
    nb_tensor *t = nb_rand_normal(ctx, NB_F32, 1, &n, 0, 1, NULL);
    return (dt == NB_F32 ? t : nb_cast(ctx, t, dt))->data;
}

static void bench_conv(int rounds, double budget) {
    printf("\n%-22s %4s  %9s %9s %9s %9s   (GFLOP/s, median of %d rounds)\n", "conv2d",
           "pass", "im2col", "dnnl-f32", "dnnl-bf16", "i2c-bf16", rounds);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (size_t i = 0; i < sizeof conv_rows / sizeof conv_rows[0]; i++) {
        const nb__conv2d_geom *g = &conv_rows[i].g;
        int64_t nx = g->n * g->c * g->h * g->w, nw = g->o * g->c * g->kh * g->kw;
        int64_t ny = g->n * g->o * g->oh * g->ow;
        double flop = 2.0 * (double)(ny * g->c * g->kh * g->kw);
        for (int bw = 0; bw < 2; bw++) {
            conv_arg args[4];
            for (int v = 0; v < 4; v++) {
                nb_dtype dt = v >= 2 ? NB_BF16 : NB_F32;
                int mode = v == 0 || v == 3 ? NB_DNNL_OFF : NB_DNNL_FORCE;
                args[v] = (conv_arg){*g, dt, mode, bw == 1,
                                     rand_buf(ctx, dt, nx), rand_buf(ctx, dt, nw),
                                     rand_buf(ctx, dt, ny), rand_buf(ctx, dt, nx),
                                     rand_buf(ctx, dt, nw),
                                     rand_buf(ctx, NB_F32, nb__conv2d_cols_numel(g) + 1)};
            }
            double gf[4][32];
            for (int k = 0; k < rounds; k++)
                for (int v = 0; v < 4; v++)
                    gf[v][k] = flop * (bw ? 2 : 1) / time_calls(run_conv, &args[v], budget) * 1e-9;
            printf("%-22s %4s  %9.2f %9.2f %9.2f %9.2f\n", conv_rows[i].name, bw ? "bwd" : "fwd",
                   median(gf[0], rounds), median(gf[1], rounds), median(gf[2], rounds),
                   median(gf[3], rounds));
            fflush(stdout);
        }
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
}

/* ---- normalisation and softmax ---- */

static dnnl_engine_t eng;
static dnnl_stream_t strm;

static void ok(dnnl_status_t st, const char *what) {
    if (st != dnnl_success) {
        fprintf(stderr, "bench_dnnl: %s failed (%d)\n", what, (int)st);
        exit(1);
    }
}

typedef struct prim_arg {
    dnnl_primitive_t prim;
    int n;
    dnnl_exec_arg_t args[8];
} prim_arg;

static void run_prim(void *p) {
    prim_arg *a = p;
    ok(dnnl_primitive_execute(a->prim, strm, a->n, a->args), "execute");
    ok(dnnl_stream_wait(strm), "wait");
}

static void make_prim(prim_arg *a, const void *desc) {
    dnnl_primitive_desc_t pd;
    ok(dnnl_primitive_desc_create(&pd, desc, NULL, eng, NULL), "primitive_desc_create");
    ok(dnnl_primitive_create(&a->prim, pd), "primitive_create");
    dnnl_primitive_desc_destroy(pd);
}

static void add_arg(prim_arg *a, int arg, int nd, const int64_t *dims, void *ptr) {
    dnnl_dims_t d = {0};
    memcpy(d, dims, sizeof(int64_t) * (size_t)nd);
    dnnl_format_tag_t tag = nd == 1 ? dnnl_a : nd == 2 ? dnnl_ab : dnnl_abcd;
    dnnl_memory_desc_t md;
    ok(dnnl_memory_desc_init_by_tag(&md, nd, d, dnnl_f32, tag), "memory_desc");
    a->args[a->n].arg = arg;
    ok(dnnl_memory_create(&a->args[a->n].memory, &md, eng, ptr), "memory_create");
    a->n++;
}

static dnnl_memory_desc_t plain_md(int nd, const int64_t *dims) {
    dnnl_dims_t d = {0};
    memcpy(d, dims, sizeof(int64_t) * (size_t)nd);
    dnnl_memory_desc_t md;
    ok(dnnl_memory_desc_init_by_tag(&md, nd, d, dnnl_f32, nd == 2 ? dnnl_ab : dnnl_abcd),
       "memory_desc");
    return md;
}

typedef struct ours_arg {
    int kind; /* 0 layer norm, 1 softmax, 2 batch norm */
    nb_tensor *y, *x, *w, *b, *mean, *rstd, *rm, *rv;
    int64_t d0, d1, d2;
} ours_arg;

static void run_ours(void *p) {
    ours_arg *o = p;
    if (o->kind == 0)
        nb__cpu_layer_norm(o->y, o->mean, o->rstd, o->x, o->w, o->b, o->d0, o->d1, 1e-5);
    else if (o->kind == 1) nb__cpu_softmax(o->y, o->x, o->d0, o->d1, 1, false);
    else
        nb__cpu_batch_norm(o->y, o->mean, o->rstd, o->x, o->w, o->b, o->rm, o->rv, true, 0.1,
                                1e-5, o->d0, o->d1, o->d2);
}

static void bench_norms(int rounds, double budget) {
    printf("\n%-30s  %9s %9s   (GB/s of x + y, median of %d rounds)\n", "forward, f32", "nabla",
           "dnnl", rounds);
    omp_set_num_threads(openblas_get_num_threads()); /* as tensor/cpu/dnnl.c does */
    ok(dnnl_engine_create(&eng, dnnl_cpu, 0), "engine");
    ok(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags), "stream");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    static const struct {
        const char *name;
        int kind;
        int64_t d0, d1, d2;
    } rows[] = {
        {"layer norm gpt-s (1024, 128)", 0, 1024, 128, 1},
        {"layer norm gpt-m (1024, 256)", 0, 1024, 256, 1},
        {"softmax gpt-s att (4096, 64)", 1, 4096, 64, 1},
        {"softmax gpt-m att (4096, 128)", 1, 4096, 128, 1},
        {"softmax head (1024, 79)", 1, 1024, 79, 1},
        {"batch norm cnn1 (32, 16, 64)", 2, 32, 16, 64},
        {"batch norm cnn2 (32, 32, 16)", 2, 32, 32, 16},
        {"batch norm (32, 64, 1024)", 2, 32, 64, 1024},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        int kind = rows[i].kind;
        int64_t d0 = rows[i].d0, d1 = rows[i].d1, d2 = rows[i].d2, n = d0 * d1 * d2;
        int64_t feat = d1, nstat = kind == 0 ? d0 : d1;
        ours_arg o = {kind,
                      nb_empty(ctx, NB_F32, 1, &n),
                      nb_rand_normal(ctx, NB_F32, 1, &n, 0, 1, NULL),
                      nb_ones(ctx, NB_F32, 1, &feat), nb_zeros(ctx, NB_F32, 1, &feat),
                      nb_empty(ctx, NB_F64, 1, &nstat), nb_empty(ctx, NB_F64, 1, &nstat),
                      nb_zeros(ctx, NB_F32, 1, &feat), nb_ones(ctx, NB_F32, 1, &feat), d0, d1, d2};
        float *dy = nb_empty(ctx, NB_F32, 1, &n)->data;
        float *mean = nb_empty(ctx, NB_F32, 1, &nstat)->data;
        float *var = nb_empty(ctx, NB_F32, 1, &nstat)->data;
        prim_arg a = {0};
        if (kind == 0) {
            int64_t dims[2] = {d0, d1};
            dnnl_memory_desc_t md = plain_md(2, dims), st;
            ok(dnnl_memory_desc_init_by_tag(&st, 1, (dnnl_dims_t){d0}, dnnl_f32, dnnl_a), "md");
            dnnl_layer_normalization_desc_t desc;
            ok(dnnl_layer_normalization_forward_desc_init(&desc, dnnl_forward_training, &md, &st,
                                                           1e-5f, dnnl_use_scale | dnnl_use_shift),
               "layer_normalization_forward_desc_init");
            make_prim(&a, &desc);
            add_arg(&a, DNNL_ARG_SRC, 2, dims, o.x->data);
            add_arg(&a, DNNL_ARG_DST, 2, dims, dy);
            add_arg(&a, DNNL_ARG_SCALE, 1, &d1, o.w->data);
            add_arg(&a, DNNL_ARG_SHIFT, 1, &d1, o.b->data);
            add_arg(&a, DNNL_ARG_MEAN, 1, &d0, mean);
            add_arg(&a, DNNL_ARG_VARIANCE, 1, &d0, var);
        } else if (kind == 1) {
            int64_t dims[2] = {d0, d1};
            dnnl_memory_desc_t md = plain_md(2, dims);
            dnnl_softmax_desc_t desc;
            ok(dnnl_softmax_forward_desc_init(&desc, dnnl_forward_training, &md, 1),
               "softmax_forward_desc_init");
            make_prim(&a, &desc);
            add_arg(&a, DNNL_ARG_SRC, 2, dims, o.x->data);
            add_arg(&a, DNNL_ARG_DST, 2, dims, dy);
        } else {
            int64_t dims[4] = {d0, d1, d2, 1};
            dnnl_memory_desc_t md = plain_md(4, dims);
            dnnl_batch_normalization_desc_t desc;
            ok(dnnl_batch_normalization_forward_desc_init(&desc, dnnl_forward_training, &md, 1e-5f,
                                                           dnnl_use_scale | dnnl_use_shift),
               "batch_normalization_forward_desc_init");
            make_prim(&a, &desc);
            add_arg(&a, DNNL_ARG_SRC, 4, dims, o.x->data);
            add_arg(&a, DNNL_ARG_DST, 4, dims, dy);
            add_arg(&a, DNNL_ARG_SCALE, 1, &d1, o.w->data);
            add_arg(&a, DNNL_ARG_SHIFT, 1, &d1, o.b->data);
            add_arg(&a, DNNL_ARG_MEAN, 1, &d1, mean);
            add_arg(&a, DNNL_ARG_VARIANCE, 1, &d1, var);
        }
        double g[2][32], bytes = 8.0 * (double)n;
        for (int k = 0; k < rounds; k++) {
            g[0][k] = bytes / time_calls(run_ours, &o, budget) * 1e-9;
            g[1][k] = bytes / time_calls(run_prim, &a, budget) * 1e-9;
        }
        printf("%-30s  %9.2f %9.2f\n", rows[i].name, median(g[0], rounds), median(g[1], rounds));
        fflush(stdout);
        for (int j = 0; j < a.n; j++) dnnl_memory_destroy(a.args[j].memory);
        dnnl_primitive_destroy(a.prim);
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
    dnnl_stream_destroy(strm);
    dnnl_engine_destroy(eng);
}

int main(int argc, char **argv) {
    int rounds = 7, threads = 0;
    const char *only = "";
    double budget = 0.05;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--info")) return fputs(nb_config_string(), stdout) < 0;
        else if (!strcmp(argv[i], "--quick")) rounds = 2, budget = 0.002;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ms") && i + 1 < argc) budget = atof(argv[++i]) * 1e-3;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else {
            fprintf(stderr,
                    "usage: %s [--threads N] [--rounds R] [--ms MS] [--only matmul|conv|norm] "
                    "[--quick] [--info]\n",
                    argv[0]);
            return 2;
        }
    }
    if (rounds < 1 || rounds > 32) rounds = 7;
    if (threads > 0) openblas_set_num_threads(threads);
    printf("# bench_dnnl: OpenBLAS threads %d (oneDNN follows), native bf16 %s\n",
           openblas_get_num_threads(), nb__dnnl_native_bf16() ? "yes" : "no");
    print_load("before");
    if (!*only || !strcmp(only, "matmul")) bench_matmul(rounds, budget);
    if (!*only || !strcmp(only, "conv")) bench_conv(rounds, budget);
    if (!*only || !strcmp(only, "norm")) bench_norms(rounds, budget);
    print_load("after");
    return 0;
}
