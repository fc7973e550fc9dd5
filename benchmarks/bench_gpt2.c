/* bench_gpt2: training-step speed of a GPT on one device; by default
 * GPT-2 small (12 layers, 12 heads, width 768, sequence 1024, vocabulary
 * 50304) on cuda:0 with batch 8, AdamW and gradient clipping at 1.0, as
 * train_gpt trains. --bf16 sets the step context's compute dtype to bf16
 * (matrix products in bf16 with f32 accumulation; weights, optimizer and
 * everything else f32), as train_gpt --bf16 does.
 *
 * Each step: forward, loss, backward, clip, AdamW step, zero_grad, and the
 * loss read back (nb_item, which waits for the device), timed on a
 * monotonic clock; the tokens come from a few random batches made on the
 * device beforehand, so no host copy is timed. Prints the median step
 * after --warmup steps, tokens/s and the model FLOPs utilisation
 * MFU = 6 * parameters * tokens/s / peak (the attention's FLOPs are not
 * counted, as in the usual 6N estimate; --peak-tflops, default 989, the
 * H100/H200 SXM dense bf16 peak). --machine prints one key=value line for
 * benchmarks/gpt2_gpu.py.
 *
 * Memory: the step context's peak and the model context's beside the floor
 * from the model's shape (nb_gpt_memory_floor: parameters, gradients,
 * AdamW state, what backward needs, the logits), and the process's peak
 * RSS on the CPU. --recompute recomputes each block in backward
 * (nb_gpt_set_recompute); --no-give-back keeps every tensor of a step
 * until the reset (nb_ctx_set_give_back), as before memory was given back.
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

#define N_BATCHES 4

static int usage(const char *prog) {
    fprintf(stderr,
            "usage: %s [--device cuda|cpu] [--gpu N] [--bf16] [--tf32] [--layers 12] [--heads 12] "
            "[--width 768] [--seq-len 1024] [--vocab 50304] [--batch 8] [--steps 20] [--warmup 3] "
            "[--no-clip] [--recompute] [--no-give-back] [--peak-tflops 989] [--machine]\n", prog);
    return 2;
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
    int64_t layers = 12, heads = 12, width = 768, seq = 1024, vocab = 50304, batch = 8, steps = 20, warmup = 3;
    double peak = 989;
    bool bf16 = false, tf32 = false, clip = true, machine = false, cpu = false, recompute = false,
         give_back = true;
    int gpu = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "--bf16")) bf16 = true;
        else if (!strcmp(a, "--tf32")) tf32 = true;
        else if (!strcmp(a, "--no-clip")) clip = false;
        else if (!strcmp(a, "--recompute")) recompute = true;
        else if (!strcmp(a, "--no-give-back")) give_back = false;
        else if (!strcmp(a, "--machine")) machine = true;
        else if (!strcmp(a, "--device") && has) {
            const char *d = argv[++i];
            if (!strcmp(d, "cpu")) cpu = true;
            else if (strcmp(d, "cuda")) return usage(argv[0]);
        } else if (!strcmp(a, "--gpu") && has) gpu = atoi(argv[++i]);
        else if (!strcmp(a, "--layers") && has) layers = atoll(argv[++i]);
        else if (!strcmp(a, "--heads") && has) heads = atoll(argv[++i]);
        else if (!strcmp(a, "--width") && has) width = atoll(argv[++i]);
        else if (!strcmp(a, "--seq-len") && has) seq = atoll(argv[++i]);
        else if (!strcmp(a, "--vocab") && has) vocab = atoll(argv[++i]);
        else if (!strcmp(a, "--batch") && has) batch = atoll(argv[++i]);
        else if (!strcmp(a, "--steps") && has) steps = atoll(argv[++i]);
        else if (!strcmp(a, "--warmup") && has) warmup = atoll(argv[++i]);
        else if (!strcmp(a, "--peak-tflops") && has) peak = atof(argv[++i]);
        else return usage(argv[0]);
    }
    if (layers < 1 || heads < 1 || width < 1 || width % heads || seq < 1 || vocab < 2 || batch < 1 ||
        steps < 1 || warmup < 0 || !(peak > 0)) {
        fprintf(stderr, "bench_gpt2: sizes must be positive, --width a multiple of --heads\n");
        return 2;
    }
    size_t start_rss = library_baseline();
    nb_device dev = cpu ? nb_cpu() : nb_cuda(gpu);
    if (!cpu && !nb_cuda_available()) {
        fprintf(stderr, "bench_gpt2: no GPU (nabla built without CUDA, or no device visible); skipped\n");
        return 77;
    }
    if (!cpu) nb_cuda_set_allow_tf32(tf32);

    nb_ctx *params = nb_ctx_new(dev, 0), *step = nb_ctx_new(dev, 0);
    if (bf16) nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_ctx_set_give_back(step, give_back);
    nb_gpt_config cfg = {vocab, seq, (int)layers, (int)heads, width, 0.0};
    nb_rng rng = nb_rng_make(1337);
    nb_module *model = nb_gpt_new(params, NB_F32, &cfg, &rng);
    nb_gpt_set_recompute(model, recompute);
    int np = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *p = malloc((size_t)np * sizeof *p);
    nb_module_named_parameters(model, p, np);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 6e-4, h.weight_decay = 0.1, h.beta2 = 0.95;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, np, &h);
    int64_t n_params = nb_module_num_params(model);

    /* (N, T) inputs and targets, random tokens, on the device */
    nb_tensor *x[N_BATCHES], *y[N_BATCHES];
    int64_t n_tok = batch * seq;
    int64_t *buf = malloc((size_t)(n_tok + 1) * sizeof *buf);
    for (int b = 0; b < N_BATCHES; b++) {
        uint32_t r[4];
        for (int64_t i = 0; i <= n_tok; i++) {
            if (i % 4 == 0) nb_philox4x32(99, (uint64_t)b * (uint64_t)(n_tok + 4) + (uint64_t)i / 4, r);
            buf[i] = (int64_t)(r[i % 4] % (uint32_t)vocab);
        }
        x[b] = nb_from_host(params, NB_I64, NB_SHAPE(batch, seq), buf);
        y[b] = nb_from_host(params, NB_I64, NB_SHAPE(batch, seq), buf + 1);
    }
    free(buf);

    double *t = malloc((size_t)steps * sizeof *t), loss = NAN, first_loss = NAN;
    for (int64_t s = 0; s < warmup + steps; s++) {
        double t0 = now_s();
        nb_ctx_reset(step);
        nb_tensor *l = nb_gpt_forward_loss(model, step, x[s % N_BATCHES], y[s % N_BATCHES]);
        nb_backward(l);
        if (clip) nb_optim_clip_grad_norm(opt, 1.0, 2.0);
        nb_optim_step(opt);
        nb_optim_zero_grad(opt);
        loss = nb_item(l);
        if (s == 0) first_loss = loss;
        if (s >= warmup) t[s - warmup] = now_s() - t0;
    }
    qsort(t, (size_t)steps, sizeof *t, cmp_double);
    double med = t[steps / 2], tok_s = (double)n_tok / med;
    double mfu = 6.0 * (double)n_params * tok_s / (peak * 1e12);
    const char *dtype = bf16 ? "bf16" : tf32 ? "tf32" : "f32";
    nb_memory_floor floor = nb_gpt_memory_floor(model, batch, seq, 2);
    char mem[512];
    if (machine) {
        printf("model=gpt device=%s dtype=%s layers=%lld heads=%lld width=%lld seq=%lld vocab=%lld "
               "batch=%lld steps=%lld params=%lld ms=%.4f min_ms=%.4f tok_s=%.1f mfu=%.4f "
               "peak_tflops=%g first_loss=%.4f loss=%.4f step_ctx_gib=%.3f params_ctx_gib=%.3f "
               "step_extent_gib=%.3f floor_step_gib=%.3f floor_model_gib=%.3f peak_rss_gib=%.3f "
               "recompute=%d give_back=%d start_rss_gib=%.3f\n",
               nb_device_name(dev), dtype, (long long)layers, (long long)heads, (long long)width,
               (long long)seq, (long long)vocab, (long long)batch, (long long)steps,
               (long long)n_params, 1e3 * med, 1e3 * t[0], tok_s, mfu, peak, first_loss, loss,
               (double)nb_ctx_peak(step) / (1 << 30), (double)nb_ctx_peak(params) / (1 << 30),
               (double)nb_ctx_extent(step) / (1 << 30), (double)(floor.saved + floor.logits) / (1 << 30),
               (double)(floor.params + floor.grads + floor.optim_state) / (1 << 30),
               (double)nb_peak_rss() / (1 << 30), recompute, give_back, (double)start_rss / (1 << 30));
    } else {
        printf("bench_gpt2: GPT %lld layers, %lld heads, width %lld, sequence %lld, vocabulary %lld: "
               "%.1fM parameters, on %s, %s, batch %lld\n",
               (long long)layers, (long long)heads, (long long)width, (long long)seq, (long long)vocab,
               (double)n_params / 1e6, nb_device_name(dev), dtype, (long long)batch);
        printf("median step %.2f ms over %lld steps (after %lld warm-up): %.0f tokens/s, MFU %.1f%% of "
               "%g TFLOP/s (6 N tokens/s); loss %.3f -> %.3f (ln V = %.3f)\n",
               1e3 * med, (long long)steps, (long long)warmup, tok_s, 100 * mfu, peak, first_loss, loss,
               log((double)vocab));
        printf("%s\n", nb_memory_report(mem, sizeof mem, &floor, step, params));
    }
    nb_optim_free(opt);
    free(p);
    free(t);
    nb_ctx_free(step);
    nb_ctx_free(params);
    return 0;
}
