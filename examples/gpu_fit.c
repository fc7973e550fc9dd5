/* gpu_fit: does my GPT fit on this GPU at this batch size, and about how
 * fast would it train? Answered on any machine, without a GPU, by the
 * meta device (nabla/meta.h, docs/cuda.md): the training step runs on
 * "meta:cuda", which follows the CUDA path's ops, dtypes and memory
 * exactly and computes nothing, so the step's peak memory is the GPU's,
 * and a roofline over the bytes and FLOPs it counted projects the time.
 *
 *   gpu_fit [--gpu h100|h200|a100] [--layers 12] [--heads 12] [--width 768]
 *           [--seq-len 1024] [--vocab 50304] [--batch 8] [--f32]
 *
 * Prints, for the batch asked and for batches 1, 2, 4, ... up to the first
 * that does not fit: the peak memory against the GPU's, the projected
 * step time and tokens/s (bf16 products unless --f32, AdamW, clipping at
 * 1.0). The projection is a bound of the roofline's kind: a real GPU runs
 * slower where kernels fall short of the stated efficiencies. Exits 1 when
 * the batch asked does not fit. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

typedef struct shape {
    int64_t layers, heads, width, seq, vocab;
    bool bf16;
} shape;

typedef struct answer {
    size_t peak;
    double step_ms;
} answer;

/* Two training steps on meta:cuda; the second, steady, is counted. */
static answer try_batch(const shape *s, int64_t batch, const nb_meta_gpu *gpu) {
    nb_device dev = nb_meta(NB_DEVICE_CUDA);
    nb_device_reset_peak(dev); /* this batch's own peak */
    nb_ctx *params = nb_ctx_new(dev, 0), *step = nb_ctx_new(dev, 0);
    if (s->bf16) nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_gpt_config cfg = {s->vocab, s->seq, (int)s->layers, (int)s->heads, s->width, 0.0};
    nb_rng rng = nb_rng_make(1);
    nb_module *gpt = nb_gpt_new(params, NB_F32, &cfg, &rng);
    int np = nb_module_named_parameters(gpt, NULL, 0);
    nb_named_tensor *p = malloc((size_t)np * sizeof *p);
    nb_module_named_parameters(gpt, p, np);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, np, &h);
    nb_tensor *x = nb_zeros(params, NB_I64, NB_SHAPE(batch, s->seq));
    nb_tensor *y = nb_zeros(params, NB_I64, NB_SHAPE(batch, s->seq));
    nb_meta_set_gpu(gpu);
    for (int i = 0; i < 2; i++) {
        nb_meta_reset();
        nb_ctx_reset(step);
        nb_backward(nb_gpt_forward_loss(gpt, step, x, y));
        nb_optim_step_clipped(opt, step, 1.0, 2.0);
        nb_optim_zero_grad_to_none(opt); /* gradients' memory given back between steps */
    }
    /* the largest total of the step, the parameters, their gradients and
     * the optimizer's state together */
    answer a = {nb_device_max_allocated(dev), nb_meta_total().us / 1e3};
    nb_optim_free(opt);
    free(p);
    nb_ctx_free(step);
    nb_ctx_free(params);
    return a;
}

static void line(const shape *s, int64_t batch, const nb_meta_gpu *gpu, const answer *a) {
    bool fits = (double)a->peak <= gpu->memory_bytes;
    printf("batch %4lld: peak %7.2f GB of %.0f GB: %-12s step %8.2f ms, %9.0f tokens/s\n",
           (long long)batch, (double)a->peak / 1e9, gpu->memory_bytes / 1e9,
           fits ? "fits" : "DOES NOT FIT", a->step_ms,
           (double)(batch * s->seq) / (a->step_ms / 1e3));
}

int main(int argc, char **argv) {
    shape s = {12, 12, 768, 1024, 50304, true};
    int64_t batch = 8;
    const char *gpu_name = "h100";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "--gpu") && has) gpu_name = argv[++i];
        else if (!strcmp(a, "--layers") && has) s.layers = atoll(argv[++i]);
        else if (!strcmp(a, "--heads") && has) s.heads = atoll(argv[++i]);
        else if (!strcmp(a, "--width") && has) s.width = atoll(argv[++i]);
        else if (!strcmp(a, "--seq-len") && has) s.seq = atoll(argv[++i]);
        else if (!strcmp(a, "--vocab") && has) s.vocab = atoll(argv[++i]);
        else if (!strcmp(a, "--batch") && has) batch = atoll(argv[++i]);
        else if (!strcmp(a, "--f32")) s.bf16 = false;
        else {
            fprintf(stderr, "usage: %s [--gpu h100|h200|a100] [--layers N] [--heads N] [--width N] "
                    "[--seq-len N] [--vocab N] [--batch N] [--f32]\n", argv[0]);
            return 2;
        }
    }
    const nb_meta_gpu *gpu = nb_meta_gpu_find(gpu_name);
    if (!gpu) {
        fprintf(stderr, "gpu_fit: --gpu %s: known GPUs are h100, h200, a100\n", gpu_name);
        return 2;
    }
    if (s.layers < 1 || s.heads < 1 || s.width % s.heads || s.seq < 1 || s.vocab < 2 || batch < 1) {
        fprintf(stderr, "gpu_fit: sizes must be positive, --width a multiple of --heads\n");
        return 2;
    }
    printf("GPT %lld layers, %lld heads, width %lld, sequence %lld, vocabulary %lld, %s, AdamW, on "
           "the %s (projected by the meta device: a roofline, not a measurement)\n",
           (long long)s.layers, (long long)s.heads, (long long)s.width, (long long)s.seq,
           (long long)s.vocab, s.bf16 ? "bf16 products" : "f32", gpu->label);
    printf("(peak: the step's tensors, parameters, gradients and AdamW's state; the CUDA runtime "
           "and the libraries' workspaces take about 1 GB more)\n");
    answer asked = try_batch(&s, batch, gpu);
    line(&s, batch, gpu, &asked);
    printf("other batch sizes:\n");
    for (int64_t b = 1; b <= 4096; b *= 2) {
        answer a = try_batch(&s, b, gpu);
        line(&s, b, gpu, &a);
        if ((double)a.peak > gpu->memory_bytes) break;
    }
    return (double)asked.peak <= gpu->memory_bytes ? 0 : 1;
}
