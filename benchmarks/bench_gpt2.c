/* bench_gpt2: training-step speed of a GPT on one device; by default
 * GPT-2 small (12 layers, 12 heads, width 768, sequence 1024, vocabulary
 * 50304) on cuda:0 with batch 8, AdamW and gradient clipping at 1.0, as
 * train_gpt trains. --bf16 sets the step context's compute dtype to bf16
 * (matrix products in bf16 with f32 accumulation; weights, optimizer and
 * everything else f32), as train_gpt --bf16 does.
 *
 * Each step: forward, loss, backward, clip, AdamW step, zero_grad_to_none, and the
 * loss read back (nb_item, which waits for the device), timed on a
 * monotonic clock; the tokens come from a few random batches made on the
 * device beforehand, so no host copy is timed. Prints the median step
 * after --warmup steps, tokens/s and, on a GPU, the model FLOPs
 * utilisation MFU = 6 * parameters * tokens/s / peak (the attention's
 * FLOPs are not counted, as in the usual 6N estimate; --peak-tflops,
 * default 989, the H100/H200 SXM dense bf16 peak). A CPU's peak is not
 * known to it, so there it prints no MFU. --machine prints one key=value
 * line for benchmarks/gpt2_gpu.py.
 *
 * Before the first step it says what a step at these shapes costs: a pass
 * on the meta device of the same kind (nabla/meta.h; meta:cuda for a GPU)
 * gives the peak memory, the bytes moved, the products' FLOPs and, on a
 * GPU, the kernel launches. Steps longer than 2 s (--progress-after) print
 * a progress line on stderr with the time left.
 *
 * --device meta:cuda --gpu h100|h200|a100 (or meta:cpu) runs no step on a
 * device: it prints the meta device's per-entry table (calls, launches,
 * bytes, FLOPs, projected microseconds by roofline with the efficiencies
 * of nabla/meta.h and the GPU's peak figures with their source), the
 * peak, and the projected step time, tokens/s, MFU and the roofline bound
 * (6 N + 12 L C T) tokens / ((bytes / bandwidth + GEMM FLOPs / peak) peak).
 * --trace FILE writes one line per counted call (nb_meta_trace).
 * --step-trace FILE writes the projected step as a step trace for
 * tools/nb_scale (Note [Step trace] in distributed/scale.c): forward,
 * backward and optimizer on the projected clock (the sum of the counted
 * calls' projected microseconds so far), and each parameter's gradient-
 * ready time in backward on that clock.
 * With --machine, one line with peak_bytes= bytes_moved= gemm_flops=
 * launches= params= tokens=. peak_bytes (the largest live total of the
 * device: the step context, the parameters' context, which holds their
 * gradients, and the optimizer's state together, nb_device_max_allocated)
 * is printed the same way on every device, so a projection and a
 * measurement sit side by side.
 *
 * Memory: the step context's peak and the model context's beside the floor
 * from the model's shape (nb_gpt_memory_floor: parameters, gradients,
 * AdamW state, what backward needs, the logits), and the process's peak
 * RSS on the CPU. --recompute recomputes each block in backward
 * (nb_gpt_set_recompute), --recompute-gelu each MLP's GELU output
 * (nb_gpt_set_recompute_gelu); --no-give-back keeps every tensor of a step
 * until the reset (nb_ctx_set_give_back), as before memory was given back.
 *
 * --profile-events FILE (--device cuda) times the last timed step entry by
 * entry with CUDA events (NABLA_CUDA_PROFILE=events, nb_cuda_profile_write:
 * each backend entry's calls and microseconds, named as the meta device
 * names them) into FILE, for benchmarks/kernel_profile.py --events; every
 * step of such a run carries the events' small cost.
 *
 * Exits 77 with a message when --device cuda but no GPU is visible;
 * --device cpu with small --layers/--width/--seq-len/--vocab checks the
 * program on the CPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nabla/nabla.h>
#include "bench_time.h"
#include "distributed/scale.h"

#define N_BATCHES 4
#define GIB (1024.0 * 1024.0 * 1024.0)

static int usage(const char *prog) {
    fprintf(stderr,
            "usage: %s [--device cuda|cpu|meta:cuda|meta:cpu] [--gpu N | --gpu h100|h200|a100] "
            "[--bf16] [--tf32] [--layers 12] [--heads 12] [--width 768] [--seq-len 1024] "
            "[--vocab 50304] [--batch 8] [--steps 20] [--warmup 3] [--no-clip] [--recompute] "
            "[--recompute-gelu] [--no-give-back] [--peak-tflops 989] [--progress-after 2] [--trace FILE] [--step-trace FILE] "
            "[--profile-events FILE] [--peak-report ROWS] [--machine]\n"
            "  --gpu: a GPU's index for --device cuda; for meta:cuda, the GPU whose figures the "
            "projection uses (default h100)\n"
            "  --progress-after S: a progress line on stderr after each step longer than S seconds\n"
            "  --trace FILE: with a meta device, one line per counted call (entry, shapes, dtypes, "
            "bytes, FLOPs, launches)\n"
            "  --step-trace FILE: with a meta device, the projected step as a step trace for nb_scale\n"
            "  --profile-events FILE: on a GPU, the last timed step's calls and time per backend entry "
            "(CUDA events) into FILE\n"
            "  --peak-report ROWS: what is live in the step context at its peak, grouped by the op "
            "that made it, dtype and shape, largest first (nb_ctx_print_peak)\n",
            prog);
    return 2;
}

typedef struct opts {
    int64_t layers, heads, width, seq, vocab, batch, steps, warmup;
    bool bf16, clip, recompute, give_back;
    int peak_rows; /* --peak-report: 0 = none */
    bool recompute_gelu;
} opts;

/* A model, its optimizer and (N, T) batches of tokens on one device. */
typedef struct run {
    nb_ctx *params, *step;
    nb_module *model;
    nb_named_tensor *p;
    nb_optim *opt;
    int64_t n_params;
    nb_tensor *x[N_BATCHES], *y[N_BATCHES];
} run;

static void run_make(run *r, nb_device dev, const opts *o) {
    nb_device_reset_peak(dev); /* this run's own peak (Note [Device totals] in tensor/context.c) */
    r->params = nb_ctx_new(dev, 0);
    r->step = nb_ctx_new(dev, 0);
    if (o->bf16) nb_ctx_set_compute_dtype(r->step, NB_BF16);
    nb_ctx_set_give_back(r->step, o->give_back);
    if (o->peak_rows) nb_ctx_watch_peak(r->step, true);
    nb_gpt_config cfg = {o->vocab, o->seq, (int)o->layers, (int)o->heads, o->width, 0.0};
    nb_rng rng = nb_rng_make(1337);
    r->model = nb_gpt_new(r->params, NB_F32, &cfg, &rng);
    nb_gpt_set_recompute(r->model, o->recompute);
    nb_gpt_set_recompute_gelu(r->model, o->recompute_gelu);
    int np = nb_module_named_parameters(r->model, NULL, 0);
    r->p = malloc((size_t)np * sizeof *r->p);
    nb_module_named_parameters(r->model, r->p, np);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 6e-4, h.weight_decay = 0.1, h.beta2 = 0.95;
    r->opt = nb_optim_new(NB_OPTIM_ADAMW, r->p, np, &h);
    r->n_params = nb_module_num_params(r->model);

    /* random tokens, made on the host and copied to the device */
    int64_t n_tok = o->batch * o->seq;
    int64_t *buf = malloc((size_t)(n_tok + 1) * sizeof *buf);
    for (int b = 0; b < N_BATCHES; b++) {
        uint32_t rnd[4];
        for (int64_t i = 0; i <= n_tok; i++) {
            if (i % 4 == 0) nb_philox4x32(99, (uint64_t)b * (uint64_t)(n_tok + 4) + (uint64_t)i / 4, rnd);
            buf[i] = (int64_t)(rnd[i % 4] % (uint32_t)o->vocab);
        }
        r->x[b] = nb_from_host(r->params, NB_I64, NB_SHAPE(o->batch, o->seq), buf);
        r->y[b] = nb_from_host(r->params, NB_I64, NB_SHAPE(o->batch, o->seq), buf + 1);
    }
    free(buf);
}

static void run_free(run *r, const opts *o) {
    if (o->peak_rows) nb_ctx_print_peak(r->step, stdout, o->peak_rows);
    nb_optim_free(r->opt);
    free(r->p);
    nb_ctx_free(r->step);
    nb_ctx_free(r->params);
}

/* Forward, loss, backward, AdamW with the clip inside, the gradients set to
 * none (Note [Gradients set to none] in autograd/backward.c: the next
 * backward writes them); the loss, not read. */
static nb_tensor *run_step(run *r, int64_t s, bool clip) {
    nb_ctx_reset(r->step);
    nb_tensor *l = nb_gpt_forward_loss(r->model, r->step, r->x[s % N_BATCHES], r->y[s % N_BATCHES]);
    nb_backward(l);
    if (clip) nb_optim_step_clipped(r->opt, r->step, 1.0, 2.0); /* the norm not read */
    else nb_optim_step(r->opt);
    nb_optim_zero_grad_to_none(r->opt);
    return l;
}

/* The model's memory (the parameters' context, which holds their
 * gradients, and the optimizer's state), and peak_bytes: the largest total
 * the device held at once, the step's and the model's memory together (at
 * most the sum of their peaks). */
static size_t model_bytes(const run *r) {
    return nb_ctx_peak(r->params) + nb_optim_state_bytes(r->opt);
}
static size_t peak_bytes(const run *r) { return nb_device_max_allocated(nb_ctx_device(r->params)); }

/* What one steady step costs on the meta device standing for `of`: a first
 * step makes the gradients and the optimizer's state, the second is
 * counted (nb_meta_total, nb_meta_entries). */
typedef struct cost {
    size_t peak, step_peak, model_peak;
    int64_t n_params;
    nb_meta_entry total;
} cost;

static cost meta_cost(nb_device_type of, const opts *o, const nb_meta_gpu *gpu, FILE *trace) {
    run r;
    run_make(&r, nb_meta(of), o);
    nb_meta_set_gpu(gpu);
    (void)run_step(&r, 0, o->clip);
    nb_meta_reset();
    nb_meta_trace(trace);
    (void)run_step(&r, 1, o->clip);
    nb_meta_trace(NULL);
    cost c = {peak_bytes(&r), nb_ctx_peak(r.step), model_bytes(&r), r.n_params, nb_meta_total()};
    run_free(&r, o);
    return c;
}

/* Gradient-ready hook: the projected clock (microseconds) into *user. */
static void ready_on_clock(nb_tensor *leaf, void *user) {
    (void)leaf;
    *(double *)user = nb_meta_total().us;
}

/* --step-trace: a steady step on the meta device, timed on its projected clock. */
static int meta_step_trace(nb_device_type of, const opts *o, const nb_meta_gpu *gpu, const char *path) {
    run r;
    run_make(&r, nb_meta(of), o);
    nb_meta_set_gpu(gpu);
    (void)run_step(&r, 0, o->clip);
    int np = nb_module_named_parameters(r.model, NULL, 0);
    double *ready = calloc((size_t)np, sizeof *ready);
    for (int i = 0; i < np; i++) nb_add_grad_hook(r.p[i].tensor, ready_on_clock, &ready[i]);
    nb_meta_reset();
    nb_ctx_reset(r.step);
    nb_tensor *l = nb_gpt_forward_loss(r.model, r.step, r.x[1], r.y[1]);
    double f = nb_meta_total().us;
    nb_backward(l);
    double b = nb_meta_total().us;
    if (o->clip) nb_optim_step_clipped(r.opt, r.step, 1.0, 2.0);
    else nb_optim_step(r.opt);
    nb_optim_zero_grad_to_none(r.opt);
    double e = nb_meta_total().us;
    for (int i = 0; i < np; i++) ready[i] = (ready[i] - f) * 1e-6;
    char src[256];
    snprintf(src, sizeof src,
             "bench_gpt2 --device %s --gpu %s: GPT %lld layers, width %lld, sequence %lld, batch %lld, %s; "
             "projected by the meta device's roofline, not measured",
             nb_device_name(nb_meta(of)), gpu ? gpu->name : "none", (long long)o->layers, (long long)o->width,
             (long long)o->seq, (long long)o->batch, o->bf16 ? "bf16" : "f32");
    nb__scale_trace t;
    nb__scale_trace_make(&t, np, r.p, ready, f * 1e-6, (b - f) * 1e-6, (e - b) * 1e-6, src);
    nb_status st = nb__scale_trace_write(path, &t);
    nb__scale_trace_free(&t);
    free(ready);
    run_free(&r, o);
    if (st != NB_OK) {
        fprintf(stderr, "bench_gpt2: %s\n", nb_last_error());
        return 1;
    }
    printf("bench_gpt2: step trace (projected) written to %s\n", path);
    return 0;
}

/* The products' peak of gpu in this dtype (nabla/meta.h). */
static double gpu_peak(const nb_meta_gpu *g, bool bf16) {
    return bf16 ? g->bf16_flops : nb_cuda_allow_tf32() ? g->tf32_flops : g->f32_flops;
}

static int cmp_us(const void *a, const void *b) {
    const nb_meta_entry *x = a, *y = b;
    double u = x->us > 0 || y->us > 0 ? x->us : x->bytes, v = x->us > 0 || y->us > 0 ? y->us : y->bytes;
    return (u < v) - (u > v);
}

static int meta_main(nb_device dev, const opts *o, const nb_meta_gpu *gpu, bool machine,
                     const char *dtype, FILE *trace) {
    bool cuda = dev.index == NB_DEVICE_CUDA;
    cost c = meta_cost((nb_device_type)dev.index, o, cuda ? gpu : NULL, trace);
    int64_t tokens = o->batch * o->seq;
    const nb_meta_entry *t = &c.total;
    double step_s = t->us * 1e-6, tok_s = step_s > 0 ? (double)tokens / step_s : 0;
    double peak = cuda ? gpu_peak(gpu, o->bf16) : 0;
    double mfu = cuda ? 6.0 * (double)c.n_params * tok_s / peak : 0;
    /* the bound: model FLOPs over the time at full bandwidth and peak */
    double model_flops = (6.0 * (double)c.n_params + 12.0 * (double)(o->layers * o->width * o->seq)) *
                         (double)tokens;
    double bound = cuda ? model_flops / ((t->bytes / gpu->bytes_per_s + t->gemm_flops / peak) * peak)
                        : 0;
    if (machine) {
        printf("model=gpt device=%s gpu=%s dtype=%s layers=%lld heads=%lld width=%lld seq=%lld "
               "vocab=%lld batch=%lld params=%lld tokens=%lld peak_bytes=%zu bytes_moved=%.0f "
               "gemm_flops=%.0f flops=%.0f launches=%lld calls=%lld step_ctx_gib=%.3f "
               "model_gib=%.3f",
               nb_device_name(dev), cuda ? gpu->name : "none", dtype, (long long)o->layers,
               (long long)o->heads, (long long)o->width, (long long)o->seq, (long long)o->vocab,
               (long long)o->batch, (long long)c.n_params, (long long)tokens, c.peak, t->bytes,
               t->gemm_flops, t->flops, (long long)t->launches, (long long)t->calls,
               (double)c.step_peak / GIB, (double)c.model_peak / GIB);
        if (cuda)
            printf(" projected_ms=%.3f tok_s=%.1f mfu=%.4f roofline=%.4f peak_tflops=%g", 1e3 * step_s,
                   tok_s, mfu, bound, peak / 1e12);
        printf("\n");
        return 0;
    }
    printf("bench_gpt2: GPT %lld layers, %lld heads, width %lld, sequence %lld, vocabulary %lld: "
           "%.1fM parameters, %s, batch %lld, on %s: counted, not run\n",
           (long long)o->layers, (long long)o->heads, (long long)o->width, (long long)o->seq,
           (long long)o->vocab, (double)c.n_params / 1e6, dtype, (long long)o->batch,
           nb_device_name(dev));
    if (cuda)
        printf("projection for the %s: %.3g TB/s, %.4g TFLOP/s for %s products (%s); efficiencies "
               "%.0f%% of bandwidth, %.0f%% of the products' peak, at least %.0f us a launch\n",
               gpu->label, gpu->bytes_per_s / 1e12, peak / 1e12, dtype, gpu->source,
               100 * NB_META_BW_EFF, 100 * NB_META_GEMM_EFF, NB_META_LAUNCH_US);
    int n = nb_meta_entries(NULL, 0);
    nb_meta_entry *e = malloc((size_t)(n > 0 ? n : 1) * sizeof *e);
    nb_meta_entries(e, n);
    qsort(e, (size_t)n, sizeof *e, cmp_us);
    printf("%-32s %7s %8s %10s %10s %11s %11s %6s\n", "entry (one steady step)", "calls",
           "launches", "GB moved", "GFLOP", "GEMM GFLOP", cuda ? "proj. us" : "", cuda ? "share" : "");
    for (int i = 0; i <= n; i++) {
        const nb_meta_entry *x = i < n ? &e[i] : t;
        printf("%-32s %7lld %8lld %10.3f %10.3f %11.2f", x->name, (long long)x->calls,
               (long long)x->launches, x->bytes / 1e9, x->flops / 1e9, x->gemm_flops / 1e9);
        if (cuda) printf(" %11.1f %5.1f%%", x->us, t->us > 0 ? 100 * x->us / t->us : 0);
        printf("\n");
    }
    free(e);
    printf("peak %.2f GiB (peak_bytes %zu, the device's largest total; the step context's own peak "
           "%.2f GiB, parameters, gradients and optimizer state %.2f GiB)", c.peak / GIB,
           c.peak, (double)c.step_peak / GIB, (double)c.model_peak / GIB);
    if (cuda)
        printf(", %.2f GB: %s on the %s's %.0f GB (with about 1 GB more for the CUDA runtime and "
               "the libraries' workspaces)",
               (double)c.peak / 1e9, (double)c.peak <= gpu->memory_bytes ? "fits" : "DOES NOT FIT",
               gpu->name, gpu->memory_bytes / 1e9);
    printf("\n");
    if (cuda)
        printf("projected step %.2f ms (a projection: roofline, not measured): %.0f tokens/s, MFU "
               "%.1f%% (6 N tokens/s / %.4g TFLOP/s); roofline bound (6 N + 12 L C T) tokens / "
               "((bytes / %.3g TB/s + GEMM FLOPs / peak) peak) = %.1f%%\n",
               1e3 * step_s, tok_s, 100 * mfu, peak / 1e12, gpu->bytes_per_s / 1e12, 100 * bound);
    return 0;
}

/* The line before the first step (issue: a step's cost, said before it starts). */
static void say_cost(nb_device dev, const opts *o) {
    bool cuda = dev.type == NB_DEVICE_CUDA;
    const nb_meta_gpu *h100 = nb_meta_gpu_find("h100");
    cost c = meta_cost(dev.type, o, cuda ? h100 : NULL, NULL);
    fprintf(stderr,
            "bench_gpt2: a step at these shapes (meta device, %s): peak %.2f GiB, %.2f GB moved, "
            "%.1f GFLOP in products, %.1f GFLOP other",
            nb_device_name(nb_meta(dev.type)), c.peak / GIB, c.total.bytes / 1e9,
            c.total.gemm_flops / 1e9, c.total.flops / 1e9);
    if (cuda)
        fprintf(stderr, ", %lld launches; about %.1f ms on an H100 (a roofline projection)",
                (long long)c.total.launches, c.total.us / 1e3);
    fprintf(stderr, "\n");
    fflush(stderr);
}

/* The resident set now (VmRSS), in bytes; 0 where unknown. */
static size_t rss_now(void) {
    FILE *f = fopen("/proc/self/status", "r");
    unsigned long long kib = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6) && sscanf(line + 6, "%llu", &kib) == 1) break;
    if (f) fclose(f);
    return (size_t)kib * 1024;
}

/* The libraries' own memory, as `import torch` is PyTorch's: the resident
 * set after one small product on the CPU has started the BLAS and the
 * thread pool, before the model exists. */
static size_t library_baseline(void) {
    nb_ctx *c = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = nb_ones(c, NB_F32, NB_SHAPE(64, 64));
    (void)nb_item(nb_sum_all(c, nb_matmul(c, a, a)));
    nb_ctx_free(c);
    return rss_now();
}

int main(int argc, char **argv) {
    opts o = {12, 12, 768, 1024, 50304, 8, 20, 3, false, true, false, true, 0, false};
    double peak = 989, progress_after = 2.0;
    bool tf32 = false, machine = false;
    const char *gpu_arg = NULL, *trace = NULL, *step_trace = NULL, *profile_events = NULL;
    nb_device dev = nb_cuda(0);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "--bf16")) o.bf16 = true;
        else if (!strcmp(a, "--tf32")) tf32 = true;
        else if (!strcmp(a, "--no-clip")) o.clip = false;
        else if (!strcmp(a, "--recompute")) o.recompute = true;
        else if (!strcmp(a, "--recompute-gelu")) o.recompute_gelu = true;
        else if (!strcmp(a, "--no-give-back")) o.give_back = false;
        else if (!strcmp(a, "--machine")) machine = true;
        else if (!strcmp(a, "--device") && has) {
            if (nb_device_parse(argv[++i], &dev) != NB_OK) {
                fprintf(stderr, "bench_gpt2: %s\n", nb_last_error());
                return usage(argv[0]);
            }
        } else if (!strcmp(a, "--gpu") && has) gpu_arg = argv[++i];
        else if (!strcmp(a, "--layers") && has) o.layers = atoll(argv[++i]);
        else if (!strcmp(a, "--heads") && has) o.heads = atoll(argv[++i]);
        else if (!strcmp(a, "--width") && has) o.width = atoll(argv[++i]);
        else if (!strcmp(a, "--seq-len") && has) o.seq = atoll(argv[++i]);
        else if (!strcmp(a, "--vocab") && has) o.vocab = atoll(argv[++i]);
        else if (!strcmp(a, "--batch") && has) o.batch = atoll(argv[++i]);
        else if (!strcmp(a, "--steps") && has) o.steps = atoll(argv[++i]);
        else if (!strcmp(a, "--warmup") && has) o.warmup = atoll(argv[++i]);
        else if (!strcmp(a, "--peak-tflops") && has) peak = atof(argv[++i]);
        else if (!strcmp(a, "--progress-after") && has) progress_after = atof(argv[++i]);
        else if (!strcmp(a, "--trace") && has) trace = argv[++i];
        else if (!strcmp(a, "--step-trace") && has) step_trace = argv[++i];
        else if (!strcmp(a, "--profile-events") && has) profile_events = argv[++i];
        else if (!strcmp(a, "--peak-report") && has) o.peak_rows = atoi(argv[++i]);
        else return usage(argv[0]);
    }
    if (o.layers < 1 || o.heads < 1 || o.width < 1 || o.width % o.heads || o.seq < 1 || o.vocab < 2 ||
        o.batch < 1 || o.steps < 1 || o.warmup < 0 || !(peak > 0)) {
        fprintf(stderr, "bench_gpt2: sizes must be positive, --width a multiple of --heads\n");
        return 2;
    }
    bool cpu = dev.type == NB_DEVICE_CPU;
    if (profile_events) {
        if (dev.type != NB_DEVICE_CUDA) {
            fprintf(stderr, "bench_gpt2: --profile-events times CUDA entries: --device cuda only\n");
            return 2;
        }
        setenv("NABLA_CUDA_PROFILE", "events", 1); /* read when the CUDA backend loads */
    }
    nb_cuda_set_allow_tf32(tf32);
    const char *dtype = o.bf16 ? "bf16" : tf32 ? "tf32" : "f32";
    if (dev.type == NB_DEVICE_META) {
        const nb_meta_gpu *gpu = nb_meta_gpu_find(gpu_arg ? gpu_arg : "h100");
        if (!gpu && dev.index == NB_DEVICE_CUDA) {
            fprintf(stderr, "bench_gpt2: --gpu %s: not a GPU the meta device knows (h100, h200, a100)\n",
                    gpu_arg);
            return 2;
        }
        if (step_trace) return meta_step_trace((nb_device_type)dev.index, &o, gpu, step_trace);
        FILE *tf = trace ? fopen(trace, "w") : NULL;
        if (trace && !tf) {
            perror(trace);
            return 2;
        }
        int rc = meta_main(dev, &o, gpu, machine, dtype, tf);
        if (tf) fclose(tf);
        return rc;
    }
    if (gpu_arg) {
        char *end;
        long g = strtol(gpu_arg, &end, 10);
        if (*end || g < 0) {
            fprintf(stderr, "bench_gpt2: --gpu %s: an index for --device cuda (names are for "
                    "--device meta:cuda)\n", gpu_arg);
            return 2;
        }
        if (!cpu) dev = nb_cuda((int)g);
    }
    size_t start_rss = library_baseline();
    if (!cpu && !nb_cuda_available()) {
        fprintf(stderr, "bench_gpt2: no GPU (nabla built without CUDA, or no device visible); skipped\n");
        return 77;
    }
    say_cost(dev, &o);

    run r;
    run_make(&r, dev, &o);
    int64_t n_tok = o.batch * o.seq;
    double *t = malloc((size_t)o.steps * sizeof *t), loss = NAN, first_loss = NAN;
    double started = now_s();
    for (int64_t s = 0; s < o.warmup + o.steps; s++) {
        bool profiled = profile_events && s == o.warmup + o.steps - 1;
        if (profiled) nb_cuda_profile_reset();
        double t0 = now_s();
        nb_tensor *l = run_step(&r, s, o.clip);
        loss = nb_item(l);
        double dt = now_s() - t0;
        if (profiled && nb_cuda_profile_write(profile_events) != NB_OK) {
            fprintf(stderr, "bench_gpt2: --profile-events: %s\n", nb_last_error());
            return 1;
        }
        if (s == 0) first_loss = loss;
        if (s >= o.warmup) t[s - o.warmup] = dt;
        if (dt > progress_after) { /* a long step: say where the run is */
            int64_t left = o.warmup + o.steps - s - 1;
            fprintf(stderr, "bench_gpt2: step %lld/%lld took %.1f s (loss %.3f); about %.0f s left\n",
                    (long long)(s + 1), (long long)(o.warmup + o.steps), dt, loss,
                    (double)left * (now_s() - started) / (double)(s + 1));
            fflush(stderr);
        }
    }
    qsort(t, (size_t)o.steps, sizeof *t, cmp_double);
    double med = t[o.steps / 2], tok_s = (double)n_tok / med;
    double mfu = 6.0 * (double)r.n_params * tok_s / (peak * 1e12);
    nb_memory_floor floor = nb_gpt_memory_floor(r.model, o.batch, o.seq, 2);
    char mem[512];
    if (machine) {
        printf("model=gpt device=%s dtype=%s layers=%lld heads=%lld width=%lld seq=%lld vocab=%lld "
               "batch=%lld steps=%lld params=%lld tokens=%lld ms=%.4f min_ms=%.4f tok_s=%.1f ",
               nb_device_name(dev), dtype, (long long)o.layers, (long long)o.heads, (long long)o.width,
               (long long)o.seq, (long long)o.vocab, (long long)o.batch, (long long)o.steps,
               (long long)r.n_params, (long long)n_tok, 1e3 * med, 1e3 * t[0], tok_s);
        if (!cpu) printf("mfu=%.4f peak_tflops=%g ", mfu, peak);
        printf("first_loss=%.4f loss=%.4f peak_bytes=%zu step_ctx_gib=%.3f params_ctx_gib=%.3f "
               "step_extent_gib=%.3f floor_step_gib=%.3f floor_model_gib=%.3f peak_rss_gib=%.3f "
               "recompute=%d recompute_gelu=%d give_back=%d start_rss_gib=%.3f\n",
               first_loss, loss, peak_bytes(&r), (double)nb_ctx_peak(r.step) / GIB,
               (double)nb_ctx_peak(r.params) / GIB, (double)nb_ctx_extent(r.step) / GIB,
               (double)(floor.saved + floor.logits) / GIB,
               (double)(floor.params + floor.grads + floor.optim_state) / GIB,
               (double)nb_peak_rss() / GIB, o.recompute, o.recompute_gelu, o.give_back,
               (double)start_rss / GIB);
    } else {
        printf("bench_gpt2: GPT %lld layers, %lld heads, width %lld, sequence %lld, vocabulary %lld: "
               "%.1fM parameters, on %s, %s, batch %lld\n",
               (long long)o.layers, (long long)o.heads, (long long)o.width, (long long)o.seq,
               (long long)o.vocab, (double)r.n_params / 1e6, nb_device_name(dev), dtype,
               (long long)o.batch);
        printf("median step %.2f ms over %lld steps (after %lld warm-up): %.0f tokens/s", 1e3 * med,
               (long long)o.steps, (long long)o.warmup, tok_s);
        if (!cpu) printf(", MFU %.1f%% of %g TFLOP/s (6 N tokens/s)", 100 * mfu, peak);
        printf("; loss %.3f -> %.3f (ln V = %.3f)\n", first_loss, loss, log((double)o.vocab));
        printf("peak_bytes %zu (the largest total of the step's memory, the parameters, gradients "
               "and optimizer state together)\n", peak_bytes(&r));
        printf("%s\n", nb_memory_report(mem, sizeof mem, &floor, r.step, r.params));
    }
    free(t);
    run_free(&r, &o);
    return 0;
}
