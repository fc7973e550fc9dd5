/* Causal self-attention's core, timed: a GPT block's qkv (N, T, 3C) to y
 * (N, T, C), forward and forward + backward, on the path the library
 * takes, at (N, H, T, D) = (8, 12, 1024, 64) bf16 by default.
 *
 * The fused op (the backend's causal_attention entry: the CPU's, or on
 * CUDA the kernel that NABLA_CUDA_ATTENTION chooses where the build has
 * that switch) runs when the backend offers it; otherwise, or with
 * --composed, the same products and causal softmax that nn/attention.c
 * composes. The output line says which ran ("path=fused" or
 * "path=composed"), so a caller asking for a fused path it does not get
 * sees that (benchmarks/attention_gpu.py runs this once per path and
 * PyTorch's scaled_dot_product_attention beside it).
 *
 * Timing: 3 warm-up calls, then ROUNDS rounds of calls each closed by a
 * synchronisation; the median round. Every call resets the step context
 * first, as a training step does; forward + backward includes a copy of
 * qkv into the step context (a leaf whose gradient goes with the reset),
 * which moves 2 (N, T, 3C) tensors. --machine prints one key=value line.
 * Exits 77 when CUDA is asked for and there is none. --cpu runs the same
 * code on the CPU (f32 at a small size by default): a check of the
 * program, not a benchmark. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>
#include "bench_time.h"
#include "tensor/internal.h"

#define ROUNDS 5

typedef struct cfg {
    int64_t n, h, t, d;
    bool composed, cpu, machine;
    nb_dtype dt;
    nb_device dev;
    long calls;
} cfg;

/* (N, T, C) -> (N, H, T, D) */
static nb_tensor *heads(nb_ctx *ctx, nb_tensor *x, const cfg *c) {
    return nb_transpose(ctx, nb_reshape(ctx, x, NB_SHAPE(c->n, c->t, c->h, c->d)), 1, 2);
}

/* nn/attention.c's composed form */
static nb_tensor *composed(nb_ctx *ctx, nb_tensor *qkv, const cfg *c, double scale) {
    int64_t e = c->h * c->d;
    nb_tensor *p[3];
    nb_split(ctx, qkv, 3, (int64_t[]){e, e, e}, 2, p);
    nb_tensor *att = nb_softmax_causal(
        ctx, nb_matmul_t(ctx, heads(ctx, p[0], c), heads(ctx, p[1], c), false, true), scale);
    nb_tensor *y = nb_matmul(ctx, att, heads(ctx, p[2], c));
    return nb_reshape(ctx, nb_transpose(ctx, y, 1, 2), NB_SHAPE(c->n, c->t, e));
}

static int path_fused = -1; /* what the first call found */

static nb_tensor *attention(nb_ctx *ctx, nb_tensor *qkv, const cfg *c) {
    double scale = 1.0 / sqrt((double)c->d);
    nb_tensor *y = c->composed ? NULL : nb__causal_attention(ctx, qkv, (int)c->h, scale);
    if (path_fused < 0) path_fused = y != NULL;
    return y ? y : composed(ctx, qkv, c, scale);
}

static void sync_dev(const cfg *c) {
    if (c->dev.type == NB_DEVICE_CUDA) nb_cuda_synchronize(c->dev);
}

/* median seconds per call of forward (backward false) or forward + backward */
static double time_case(const cfg *c, nb_ctx *step, nb_tensor *qkv, nb_tensor *gy, bool backward) {
    double r[ROUNDS];
    for (int k = -1; k < ROUNDS; k++) {
        long calls = k < 0 ? 3 : c->calls;
        double t0 = now_s();
        for (long i = 0; i < calls; i++) {
            nb_ctx_reset(step);
            nb_tensor *x = qkv;
            if (backward) { /* a leaf of the step, so its gradient goes with the reset */
                x = nb_clone(step, qkv);
                nb_set_requires_grad(x, true);
            }
            nb_tensor *y = attention(step, x, c);
            if (backward) nb_backward_with(y, gy);
        }
        sync_dev(c);
        if (k >= 0) r[k] = (now_s() - t0) / (double)calls;
    }
    for (int i = 1; i < ROUNDS; i++)
        for (int j = i; j > 0 && r[j] < r[j - 1]; j--) {
            double s = r[j];
            r[j] = r[j - 1];
            r[j - 1] = s;
        }
    return r[ROUNDS / 2];
}

int main(int argc, char **argv) {
    cfg c = {8, 12, 1024, 64, false, false, false, NB_BF16, {0}, 10};
    bool f32 = false, sized = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "--composed")) c.composed = true;
        else if (!strcmp(a, "--cpu")) c.cpu = true;
        else if (!strcmp(a, "--machine")) c.machine = true;
        else if (!strcmp(a, "--f32")) f32 = true;
        else if (!strcmp(a, "--calls") && has) c.calls = atol(argv[++i]);
        else if (!strcmp(a, "--shape") && i + 4 < argc) {
            c.n = atoll(argv[++i]);
            c.h = atoll(argv[++i]);
            c.t = atoll(argv[++i]);
            c.d = atoll(argv[++i]);
            sized = true;
        } else {
            fprintf(stderr,
                    "usage: %s [--shape N H T D (8 12 1024 64)] [--f32] [--composed] [--calls 10] "
                    "[--cpu] [--machine]\n",
                    argv[0]);
            return 2;
        }
    }
    if (c.n < 1 || c.h < 1 || c.t < 1 || c.d < 1 || c.calls < 1) {
        fprintf(stderr, "bench_attention: sizes and --calls must be positive\n");
        return 2;
    }
    if (c.cpu) {
        if (!sized) c.n = 2, c.h = 2, c.t = 64, c.d = 16;
        f32 = true; /* the CPU's fused attention takes f32 */
        c.dev = nb_cpu();
    } else {
        if (!nb_cuda_available()) {
            fprintf(stderr, "bench_attention: no GPU (nabla built without CUDA, or no device "
                            "visible); skipped\n");
            return 77;
        }
        c.dev = nb_cuda(0);
    }
    c.dt = f32 ? NB_F32 : NB_BF16;
    nb_ctx *params = nb_ctx_new(c.dev, 0), *step = nb_ctx_new(c.dev, 0);
    nb_rng rng = nb_rng_make(7);
    int64_t e = c.h * c.d;
    nb_tensor *qkv = nb_rand_normal(params, c.dt, NB_SHAPE(c.n, c.t, 3 * e), 0, 1, &rng);
    nb_tensor *gy = nb_rand_normal(params, c.dt, NB_SHAPE(c.n, c.t, e), 0, 1, &rng);
    double fwd = time_case(&c, step, qkv, gy, false);
    double both = time_case(&c, step, qkv, gy, true);
    /* the causal products: QK^T and PV, each 2 N H D T(T+1)/2, 2.5x that with backward */
    double flop = 2.0 * 2.0 * (double)(c.n * c.h * c.d) * (double)c.t * (double)(c.t + 1) / 2.0;
    const char *path = path_fused ? "fused" : "composed";
    if (c.machine)
        printf("attention n=%lld h=%lld t=%lld d=%lld dtype=%s path=%s fwd_ms=%.4f fwd_bwd_ms=%.4f "
               "fwd_tflops=%.2f fwd_bwd_tflops=%.2f peak_step_gib=%.4f\n",
               (long long)c.n, (long long)c.h, (long long)c.t, (long long)c.d, nb_dtype_name(c.dt),
               path, 1e3 * fwd, 1e3 * both, flop / fwd / 1e12, 3.5 * flop / both / 1e12,
               (double)nb_ctx_peak(step) / (1 << 30));
    else
        printf("causal attention (%lld, %lld, %lld, %lld) %s on %s, %s: forward %.3f ms "
               "(%.1f TFLOP/s), forward + backward %.3f ms (%.1f TFLOP/s), step context peak "
               "%.3f GiB\n",
               (long long)c.n, (long long)c.h, (long long)c.t, (long long)c.d, nb_dtype_name(c.dt),
               nb_device_name(c.dev), path, 1e3 * fwd, flop / fwd / 1e12, 1e3 * both,
               3.5 * flop / both / 1e12, (double)nb_ctx_peak(step) / (1 << 30));
    nb_ctx_free(step);
    nb_ctx_free(params);
    return 0;
}
