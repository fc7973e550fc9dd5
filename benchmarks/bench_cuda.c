/* CUDA op benchmarks, printed as one table (or one JSON object, --json):
 *  - GEMM TFLOP/s of nb_matmul at 4096^3 and 8192^3 on bf16 tensors, on f32
 *    with TF32 allowed, on f32 without TF32, and at 4096^3 on f32 tensors in
 *    a context whose compute dtype is bf16 (the casts included: what
 *    train_gpt --bf16 pays per product);
 *  - memory-bound ops (nb_layer_norm forward and forward + backward,
 *    nb_softmax along the last axis, nb_cross_entropy forward and
 *    forward + backward) on GPT-2-small
 *    shapes, in GB/s counting the fewest bytes the op must move (each input
 *    read once, each output written once), next to a device-to-device
 *    nb_copy_ moving the same bytes, and that as a share of the copy;
 *  - the cost of one small op: nb_add on 1-element tensors, 10k calls
 *    queued back to back, and with a nb_cuda_synchronize after each.
 * Timing: warm-up calls, then ROUNDS rounds of calls each closed by
 * nb_cuda_synchronize and read off a monotonic clock; the median round.
 * Inputs are random (never zeros) and, where one set would fit in L2, the
 * calls rotate over several sets so that the figures are not the cache's.
 * Every call resets the step context first, as a training loop does.
 *
 * Exits 77 with a message when nabla has no CUDA or no GPU is visible.
 * --cpu runs the same code on the CPU at tiny sizes (no bf16 there): a
 * check of this program, not a benchmark. benchmarks/compare_torch_cuda.py
 * reads --json and runs the same cases in PyTorch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nabla/nabla.h>
#include "bench_time.h"

#define ROUNDS 5
#define MAX_SETS 8
#define LAUNCH_CALLS 10000
/* Rotate over input sets until they hold this many bytes (L2: 50-60 MB). */
#define ROTATE_BYTES ((size_t)256 << 20)

typedef struct bench_cfg {
    bool json, quick, cpu;
    nb_device dev;
    double budget_s; /* per measured case, over all rounds */
} bench_cfg;

static void sync_dev(const bench_cfg *c) {
    if (c->dev.type == NB_DEVICE_CUDA) nb_cuda_synchronize(c->dev);
}

/* Runs one call on input set `i` (modulo the number of sets). */
typedef void (*op_fn)(void *arg, int i);

/* Median seconds per call: 3 warm-up calls, then ROUNDS rounds of `calls`
 * calls and one synchronisation; calls (when 0) is chosen so that the
 * rounds take about budget_s together. */
static double time_op(const bench_cfg *c, op_fn fn, void *arg, long calls) {
    for (int i = 0; i < 3; i++) fn(arg, i);
    sync_dev(c);
    if (calls <= 0) {
        double t0 = now_s();
        fn(arg, 0);
        sync_dev(c);
        double one = now_s() - t0;
        calls = (long)(c->budget_s / ROUNDS / (one > 1e-7 ? one : 1e-7));
        if (calls < 2) calls = 2;
        if (calls > 100000) calls = 100000;
    }
    double t[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_s();
        for (long i = 0; i < calls; i++) fn(arg, (int)(i % MAX_SETS));
        sync_dev(c);
        t[r] = (now_s() - t0) / (double)calls;
    }
    qsort(t, ROUNDS, sizeof t[0], cmp_double);
    return t[ROUNDS / 2];
}

/* ------------------------------------------------------------- results */
typedef struct result {
    char group[16], name[48], dtype[16], shape[48];
    double seconds;
    double tflops;               /* gemm */
    double bytes, gbps, copy_gbps; /* bandwidth */
    int64_t m, n, k;             /* gemm: M, N, K; bandwidth: rows, cols */
} result;

#define MAX_RESULTS 64
static result results[MAX_RESULTS];
static int n_results;

static result *add_result(const char *group, const char *name, const char *dtype) {
    if (n_results == MAX_RESULTS) {
        fprintf(stderr, "bench_cuda: more than %d results\n", MAX_RESULTS);
        exit(1);
    }
    result *r = &results[n_results++];
    memset(r, 0, sizeof *r);
    snprintf(r->group, sizeof r->group, "%s", group);
    snprintf(r->name, sizeof r->name, "%s", name);
    snprintf(r->dtype, sizeof r->dtype, "%s", dtype);
    return r;
}

static const char *fmt_time(double s, char *buf, size_t n) {
    if (s < 1e-6) snprintf(buf, n, "%.1f ns", s * 1e9);
    else if (s < 1e-3) snprintf(buf, n, "%.2f us", s * 1e6);
    else snprintf(buf, n, "%.3f ms", s * 1e3);
    return buf;
}

static void print_table(const bench_cfg *c) {
    char tb[32];
    printf("nabla bench_cuda: %s%s\n", nb_device_name(c->dev),
           c->cpu ? " (--cpu: a check of the program, not a benchmark)" : c->quick ? " (--quick sizes)" : "");
    printf("\nGEMM through nb_matmul (target: within 5%% of torch.matmul; compare_torch_cuda.py)\n");
    printf("%-34s %-20s %12s %12s\n", "case", "M x N x K", "time/call", "TFLOP/s");
    for (int i = 0; i < n_results; i++) {
        const result *r = &results[i];
        if (strcmp(r->group, "gemm")) continue;
        printf("%-34s %-20s %12s %12.*f\n", r->name, r->shape, fmt_time(r->seconds, tb, sizeof tb),
               r->tflops >= 10 ? 1 : 3, r->tflops);
    }
    printf("\nMemory-bound ops, GB/s of bytes read + written (target: >= 80%% of the copy)\n");
    printf("%-34s %-20s %12s %10s %10s %8s\n", "case", "shape", "time/call", "GB/s", "copy GB/s", "of copy");
    for (int i = 0; i < n_results; i++) {
        const result *r = &results[i];
        if (strcmp(r->group, "bandwidth")) continue;
        double pct = 100 * r->gbps / r->copy_gbps;
        printf("%-34s %-20s %12s %10.1f %10.1f %7.0f%%%s\n", r->name, r->shape,
               fmt_time(r->seconds, tb, sizeof tb), r->gbps, r->copy_gbps, pct, pct >= 80 ? "" : " <");
    }
    printf("\nSmall ops\n");
    for (int i = 0; i < n_results; i++) {
        const result *r = &results[i];
        if (strcmp(r->group, "launch")) continue;
        printf("%-55s %12s\n", r->name, fmt_time(r->seconds, tb, sizeof tb));
    }
}

static void print_json(const bench_cfg *c) {
    printf("{\"device\": \"%s\", \"cpu\": %s, \"quick\": %s, \"cases\": [\n", nb_device_name(c->dev),
           c->cpu ? "true" : "false", c->quick ? "true" : "false");
    for (int i = 0; i < n_results; i++) {
        const result *r = &results[i];
        printf("  {\"group\": \"%s\", \"name\": \"%s\", \"dtype\": \"%s\", \"m\": %lld, \"n\": %lld, "
               "\"k\": %lld, \"seconds\": %.9g, \"tflops\": %.6g, \"bytes\": %.6g, \"gbps\": %.6g, "
               "\"copy_gbps\": %.6g}%s\n",
               r->group, r->name, r->dtype, (long long)r->m, (long long)r->n, (long long)r->k, r->seconds,
               r->tflops, r->bytes, r->gbps, r->copy_gbps, i + 1 < n_results ? "," : "");
    }
    printf("]}\n");
}

/* ---------------------------------------------------------------- GEMM */
typedef struct gemm_arg {
    nb_ctx *step;
    nb_tensor *a, *b;
} gemm_arg;

static void run_gemm(void *p, int i) {
    (void)i; /* compute-bound: one set */
    gemm_arg *g = p;
    nb_ctx_reset(g->step);
    nb_matmul(g->step, g->a, g->b);
}

/* kind: "bf16" (bf16 tensors), "tf32" / "f32" (f32 tensors, TF32 on / off),
 * "bf16-compute" (f32 tensors, the context's compute dtype bf16). */
static void bench_gemm(const bench_cfg *c, nb_ctx *data, nb_ctx *step, const char *kind, int64_t s) {
    bool bf16 = !strcmp(kind, "bf16"), compute = !strcmp(kind, "bf16-compute");
    nb_dtype dt = bf16 ? NB_BF16 : NB_F32;
    nb_rng rng = nb_rng_make(7);
    gemm_arg g = {step, nb_rand_normal(data, dt, NB_SHAPE(s, s), 0, 1, &rng),
                  nb_rand_normal(data, dt, NB_SHAPE(s, s), 0, 1, &rng)};
    bool prev_tf32 = nb_cuda_allow_tf32();
    if (!c->cpu) nb_cuda_set_allow_tf32(!strcmp(kind, "tf32"));
    if (compute) nb_ctx_set_compute_dtype(step, NB_BF16);
    double t = time_op(c, run_gemm, &g, 0);
    if (compute) nb_ctx_set_compute_dtype(step, NB_F32);
    if (!c->cpu) nb_cuda_set_allow_tf32(prev_tf32);

    static const struct { const char *kind, *name; } names[] = {
        {"bf16", "nb_matmul bf16"},
        {"tf32", "nb_matmul f32, TF32 allowed"},
        {"f32", "nb_matmul f32, no TF32"},
        {"bf16-compute", "nb_matmul f32 in, compute dtype bf16"},
    };
    const char *name = kind;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(names[i].kind, kind)) name = names[i].name;
    result *r = add_result("gemm", name, kind);
    r->m = r->n = r->k = s;
    snprintf(r->shape, sizeof r->shape, "%lld^3", (long long)s);
    r->seconds = t;
    r->tflops = 2.0 * (double)s * (double)s * (double)s / t * 1e-12;
    nb_ctx_reset(step);
    nb_ctx_reset(data);
}

/* ----------------------------------------------------- memory-bound ops */
enum { OP_LAYER_NORM, OP_LAYER_NORM_BACKWARD, OP_SOFTMAX, OP_CE, OP_CE_BACKWARD, OP_COPY };

typedef struct bw_arg {
    int op, nsets;
    nb_ctx *step;
    nb_tensor *x[MAX_SETS], *w, *b, *targets, *dst;
    nb_tensor *gy[MAX_SETS]; /* layer norm fwd+bwd: the output's gradient, per set */
} bw_arg;

static void run_bw(void *p, int i) {
    bw_arg *a = p;
    nb_tensor *x = a->x[i % a->nsets];
    nb_ctx_reset(a->step);
    switch (a->op) {
    case OP_LAYER_NORM: nb_layer_norm(a->step, x, 1, a->w, a->b, 1e-5); break;
    case OP_LAYER_NORM_BACKWARD: {
        /* fresh leaves each call, as torch's benchmark sets .grad = None */
        nb_tensor *leaf = nb_detach(a->step, x), *w = nb_detach(a->step, a->w);
        nb_tensor *b = nb_detach(a->step, a->b);
        nb_set_requires_grad(leaf, true);
        nb_set_requires_grad(w, true);
        nb_set_requires_grad(b, true);
        nb_backward_with(nb_layer_norm(a->step, leaf, 1, w, b, 1e-5), a->gy[i % a->nsets]);
        break;
    }
    case OP_SOFTMAX: nb_softmax(a->step, x, -1); break;
    case OP_CE: nb_cross_entropy(a->step, x, a->targets, NULL); break;
    case OP_CE_BACKWARD: {
        /* a fresh leaf each call, as torch's benchmark sets .grad = None */
        nb_tensor *leaf = nb_detach(a->step, x);
        nb_set_requires_grad(leaf, true);
        nb_backward(nb_cross_entropy(a->step, leaf, a->targets, NULL));
        break;
    }
    default: nb_copy_(a->dst, x); break;
    }
}

/* Input sets of `bytes` each: enough to exceed ROTATE_BYTES, at most MAX_SETS. */
static int sets_for(size_t bytes) {
    size_t n = (ROTATE_BYTES + bytes - 1) / bytes;
    return n < 1 ? 1 : n > MAX_SETS ? MAX_SETS : (int)n;
}

/* GB/s of a device-to-device nb_copy_ that moves `bytes` (read + write). */
static double copy_gbps(const bench_cfg *c, nb_ctx *data, nb_ctx *step, nb_dtype dt, double bytes) {
    int64_t n = (int64_t)(bytes / (2.0 * (double)nb_dtype_size(dt)));
    bw_arg a = {OP_COPY, sets_for((size_t)n * nb_dtype_size(dt)), step, {0}, NULL, NULL, NULL, NULL, {0}};
    nb_rng rng = nb_rng_make(5);
    for (int i = 0; i < a.nsets; i++) a.x[i] = nb_rand_normal(data, dt, NB_SHAPE(n), 0, 1, &rng);
    a.dst = nb_empty(data, dt, NB_SHAPE(n));
    double t = time_op(c, run_bw, &a, 0);
    return 2.0 * (double)n * (double)nb_dtype_size(dt) / t * 1e-9;
}

static void bench_bw(const bench_cfg *c, nb_ctx *data, nb_ctx *step, int op, nb_dtype dt, int64_t rows,
                     int64_t cols) {
    size_t es = nb_dtype_size(dt), set_bytes = (size_t)(rows * cols) * es;
    bw_arg a = {op, op == OP_CE_BACKWARD || op == OP_CE ? 1 : sets_for(set_bytes), step,
                {0}, NULL, NULL, NULL, NULL, {0}};
    nb_rng rng = nb_rng_make(3);
    for (int i = 0; i < a.nsets; i++) a.x[i] = nb_rand_normal(data, dt, NB_SHAPE(rows, cols), 0, 1, &rng);
    double elems = (double)rows * (double)cols, bytes = 0;
    const char *name = "";
    switch (op) {
    case OP_LAYER_NORM:
        a.w = nb_rand_normal(data, dt, NB_SHAPE(cols), 1, 0.1, &rng);
        a.b = nb_rand_normal(data, dt, NB_SHAPE(cols), 0, 0.1, &rng);
        bytes = 2 * elems * (double)es + 2 * (double)cols * (double)es; /* x, y; w, b */
        name = "nb_layer_norm (last dim)";
        break;
    case OP_LAYER_NORM_BACKWARD:
        a.w = nb_rand_normal(data, dt, NB_SHAPE(cols), 1, 0.1, &rng);
        a.b = nb_rand_normal(data, dt, NB_SHAPE(cols), 0, 0.1, &rng);
        for (int i = 0; i < a.nsets; i++)
            a.gy[i] = nb_rand_normal(data, dt, NB_SHAPE(rows, cols), 0, 1, &rng);
        /* forward: x, w, b in, y out; backward: g, x, w in, dx, dw, db out */
        bytes = 5 * elems * (double)es + 5 * (double)cols * (double)es;
        name = "nb_layer_norm fwd+bwd";
        break;
    case OP_SOFTMAX:
        bytes = 2 * elems * (double)es;
        name = "nb_softmax (last axis)";
        break;
    case OP_CE:
    case OP_CE_BACKWARD: {
        int64_t *t = malloc((size_t)rows * sizeof *t);
        uint32_t r[4];
        for (int64_t i = 0; i < rows; i++) {
            if (i % 4 == 0) nb_philox4x32(11, (uint64_t)(i / 4), r);
            t[i] = (int64_t)(r[i % 4] % (uint32_t)cols);
        }
        a.targets = nb_from_host(data, NB_I64, NB_SHAPE(rows), t);
        free(t);
        /* forward reads the logits; backward reads them again and writes their gradient */
        bytes = (op == OP_CE ? 1 : 3) * elems * (double)es + 8.0 * (double)rows;
        name = op == OP_CE ? "nb_cross_entropy forward" : "nb_cross_entropy fwd+bwd";
        break;
    }
    default: break;
    }
    bool prev = nb_set_grad_enabled(op == OP_CE_BACKWARD || op == OP_LAYER_NORM_BACKWARD);
    double t = time_op(c, run_bw, &a, 0);
    nb_set_grad_enabled(prev);
    nb_ctx_reset(step);

    result *r = add_result("bandwidth", name, nb_dtype_name(dt));
    r->m = rows, r->n = cols;
    snprintf(r->shape, sizeof r->shape, "%s (%lld, %lld)", nb_dtype_name(dt), (long long)rows, (long long)cols);
    r->seconds = t;
    r->bytes = bytes;
    r->gbps = bytes / t * 1e-9;
    nb_ctx_reset(data);
    r->copy_gbps = copy_gbps(c, data, step, dt, bytes);
    nb_ctx_reset(step);
    nb_ctx_reset(data);
}

/* ----------------------------------------------------------- small ops */
typedef struct small_arg {
    const bench_cfg *c;
    nb_ctx *step;
    nb_tensor *x, *y;
    bool sync_each;
} small_arg;

static void run_small(void *p, int i) {
    (void)i;
    small_arg *a = p;
    nb_ctx_reset(a->step);
    nb_add(a->step, a->x, a->y);
    if (a->sync_each) sync_dev(a->c);
}

static void bench_small(const bench_cfg *c, nb_ctx *data, nb_ctx *step) {
    small_arg a = {c, step, nb_full(data, NB_F32, NB_SHAPE(1), 1.5), nb_full(data, NB_F32, NB_SHAPE(1), 2.5), false};
    bool prev = nb_set_grad_enabled(false);
    double t_queue = time_op(c, run_small, &a, LAUNCH_CALLS);
    a.sync_each = true;
    double t_sync = time_op(c, run_small, &a, c->quick || c->cpu ? 100 : 2000);
    nb_set_grad_enabled(prev);
    result *r = add_result("launch", "nb_add, 1 element, 10k calls queued (per call)", "f32");
    r->seconds = t_queue;
    r = add_result("launch", "nb_add, 1 element, synchronised after each call", "f32");
    r->seconds = t_sync;
    nb_ctx_reset(step);
    nb_ctx_reset(data);
}

int main(int argc, char **argv) {
    bench_cfg cfg = {false, false, false, nb_cuda(0), 1.0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) cfg.json = true;
        else if (!strcmp(argv[i], "--quick")) cfg.quick = true;
        else if (!strcmp(argv[i], "--cpu")) cfg.cpu = true;
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) cfg.dev = nb_cuda(atoi(argv[++i]));
        else if (!strcmp(argv[i], "--budget") && i + 1 < argc) cfg.budget_s = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--json] [--quick] [--device N] [--budget SECONDS] [--cpu]\n", argv[0]);
            return 2;
        }
    }
    if (cfg.cpu) {
        cfg.dev = nb_cpu();
        cfg.quick = true;
    } else if (!nb_cuda_available()) {
        fprintf(stderr, "bench_cuda: no GPU (nabla built without CUDA, or no device visible); skipped\n");
        return 77;
    } else if (cfg.dev.index < 0 || cfg.dev.index >= nb_cuda_device_count()) {
        fprintf(stderr, "bench_cuda: --device %d, but %d GPU(s) are visible\n", cfg.dev.index,
                nb_cuda_device_count());
        return 2;
    }
    if (cfg.quick) cfg.budget_s = cfg.budget_s < 0.1 ? cfg.budget_s : 0.1;
    nb_ctx *data = nb_ctx_new(cfg.dev, 0), *step = nb_ctx_new(cfg.dev, 0);

    static const int64_t full_sizes[] = {4096, 8192}, quick_sizes[] = {64, 256};
    const int64_t *sizes = cfg.quick ? quick_sizes : full_sizes;
    for (int i = 0; i < 2; i++) {
        if (!cfg.cpu) bench_gemm(&cfg, data, step, "bf16", sizes[i]);
        if (!cfg.cpu) bench_gemm(&cfg, data, step, "tf32", sizes[i]);
        bench_gemm(&cfg, data, step, "f32", sizes[i]);
    }
    if (!cfg.cpu) bench_gemm(&cfg, data, step, "bf16-compute", sizes[0]);

    /* GPT-2 small, batch 8 x 1024 tokens: B*T rows of width C; attention
     * scores (B*H*T, T); logits (B*T, V) */
    int64_t bt = cfg.quick ? 64 : 8 * 1024, c = cfg.quick ? 96 : 768, v = cfg.quick ? 1000 : 50304;
    int64_t att_rows = cfg.quick ? 256 : 8 * 12 * 1024, att_cols = cfg.quick ? 128 : 1024;
    nb_dtype dts[2] = {NB_F32, NB_BF16};
    for (int d = 0; d < (cfg.cpu ? 1 : 2); d++) {
        bench_bw(&cfg, data, step, OP_LAYER_NORM, dts[d], bt, c);
        bench_bw(&cfg, data, step, OP_LAYER_NORM_BACKWARD, dts[d], bt, c);
        bench_bw(&cfg, data, step, OP_SOFTMAX, dts[d], att_rows, att_cols);
        bench_bw(&cfg, data, step, OP_CE, dts[d], bt, v);
        bench_bw(&cfg, data, step, OP_CE_BACKWARD, dts[d], bt, v);
    }

    bench_small(&cfg, data, step);

    if (cfg.json) print_json(&cfg);
    else print_table(&cfg);
    nb_ctx_free(step);
    nb_ctx_free(data);
    return 0;
}
