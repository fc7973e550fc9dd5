/* The meta device (nabla/meta.h, tensor/meta.c): each counted op's bytes,
 * FLOPs and launches against formulas written here from the definitions
 * (bytes: every tensor read plus every tensor written, whole, a broadcast
 * one by its own elements; GEMM FLOPs
 * 2 m n k; launches from the CUDA kernels), meta:cpu's peak for a GPT step
 * against the real CPU step's, and host reads refused by name. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/cuda_plugin.h"
#include "tensor/internal.h"
#include "testutil.h"

/* The counts of `name` since the last nb_meta_reset (calls 0 if none). */
static nb_meta_entry find(const char *name) {
    nb_meta_entry e[256];
    int n = nb_meta_entries(e, 256);
    for (int i = 0; i < n && i < 256; i++)
        if (!strcmp(e[i].name, name)) return e[i];
    return (nb_meta_entry){.name = name};
}

static void expect(const char *name, int64_t calls, double bytes, double flops, double gemm_flops,
                   int64_t launches) {
    nb_meta_entry e = find(name);
    ck_assert_msg(e.calls == calls, "%s: %lld calls, expected %lld", name, (long long)e.calls,
                  (long long)calls);
    ck_assert_msg(e.bytes == bytes, "%s: %.0f bytes, expected %.0f", name, e.bytes, bytes);
    ck_assert_msg(e.flops == flops, "%s: %.0f FLOPs, expected %.0f", name, e.flops, flops);
    ck_assert_msg(e.gemm_flops == gemm_flops, "%s: %.0f GEMM FLOPs, expected %.0f", name,
                  e.gemm_flops, gemm_flops);
    ck_assert_msg(e.launches == launches, "%s: %lld launches, expected %lld", name,
                  (long long)e.launches, (long long)launches);
}

static const nb_device_type kinds[2] = {NB_DEVICE_CPU, NB_DEVICE_CUDA};

START_TEST(test_matmul) {
    enum { M = 48, K = 40, N = 24 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *a = nb_empty(ctx, NB_F32, NB_SHAPE(M, K)), *b = nb_empty(ctx, NB_F32, NB_SHAPE(K, N));
        nb_meta_reset();
        nb_tensor *c = nb_matmul(ctx, a, b);
        ck_assert_int_eq(c->shape[0], M);
        expect("matmul", 1, 4.0 * (M * K + K * N + M * N), 0, 2.0 * M * N * K, cuda ? 1 : 0);
        ck_assert_int_eq(nb_meta_total().calls, 1);
        nb_ctx_free(ctx);
    }
}
END_TEST

START_TEST(test_batched_matmul) {
    enum { B = 6, M = 16, K = 8, N = 32 };
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_ctx_set_compute_dtype(ctx, NB_BF16);
    nb_tensor *a = nb_empty(ctx, NB_BF16, NB_SHAPE(B, M, K));
    nb_tensor *b = nb_empty(ctx, NB_BF16, NB_SHAPE(B, K, N));
    nb_meta_reset();
    nb_tensor *c = nb_matmul(ctx, a, b);
    /* bf16 operands, bf16 result (Note [Compute dtype] in tensor/context.c) */
    ck_assert_int_eq(c->dtype, NB_BF16);
    expect("matmul", 1, 2.0 * (B * M * K + B * K * N) + 2.0 * B * M * N, 0, 2.0 * B * M * N * K, 1);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_layer_norm) {
    enum { M = 10, D = 64 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *x = nb_empty(ctx, NB_F32, NB_SHAPE(M, D));
        nb_tensor *w = nb_empty(ctx, NB_F32, NB_SHAPE(D)), *b = nb_empty(ctx, NB_F32, NB_SHAPE(D));
        nb_meta_reset();
        nb_layer_norm(ctx, x, 1, w, b, 1e-5);
        /* x, w, b read; y written, and mean and rstd per row: f32 on CUDA,
         * f64 on the CPU */
        double stats = 2.0 * M * (cuda ? 4 : 8);
        expect("layer_norm", 1, 4.0 * (M * D + 2 * D + M * D) + stats, 8.0 * M * D, 0, cuda ? 1 : 0);
        nb_ctx_free(ctx);
    }
}
END_TEST

/* Note [Layer norm's gradients added in place] (tensor/ops_norm.c): in a
 * residual block made as a module's forward makes it, h = x + ln(x) W, the
 * second backward adds dx, dw and db into the gradients they belong to,
 * so the layer norm also reads them (D f32 each for w and b, M D for x),
 * and no separate add follows; the first finds w and b without gradients
 * and writes theirs. */
START_TEST(test_layer_norm_adds) {
    enum { M = 10, D = 64 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *a = nb_empty(ctx, NB_F32, NB_SHAPE(M, D)), *W = nb_empty(ctx, NB_F32, NB_SHAPE(D, D));
        nb_tensor *w = nb_empty(ctx, NB_F32, NB_SHAPE(D)), *b = nb_empty(ctx, NB_F32, NB_SHAPE(D));
        nb_tensor *r = nb_empty(ctx, NB_F32, NB_SHAPE(M, D));
        a->requires_grad = W->requires_grad = w->requires_grad = b->requires_grad = true;
        double stats = 2.0 * M * (cuda ? 4 : 8);
        for (int step = 0; step < 2; step++) {
            nb__scope_enter(ctx);
            nb_tensor *x = nb_mul_scalar(ctx, a, 2.0);
            nb_tensor *h = nb_add(ctx, x, nb_matmul(ctx, nb_layer_norm(ctx, x, 1, w, b, 1e-5), W));
            nb_tensor *loss = nb_sum(ctx, nb_mul(ctx, h, r), 0, NULL, false);
            nb__scope_exit(ctx, loss);
            nb_meta_reset();
            nb_backward(loss);
            /* g, x, stats, w read; dx, dw, db written; dx (both steps), dw
             * and db (the second) read */
            double wb_read = step ? 2.0 * D : 0;
            expect("layer_norm_backward", 1,
                   4.0 * (2 * M * D + D + M * D + 2 * D) + stats + 4.0 * (M * D + wb_read),
                   10.0 * M * D, 0, cuda ? 2 : 0);
        }
        nb_ctx_free(ctx);
    }
}
END_TEST

/* A broadcast operand counts its own elements once (nabla/meta.h): x
 * (R, C) + b (C) reads R C + C elements and writes R C on both devices;
 * on the CPU b's gradient, g summed over the rows by an add into b's
 * memory seen as an (R, C) view with stride 0 along R (nb__sum_to's
 * aliased add), reads g and b and writes b: R C + 2 C. */
START_TEST(test_broadcast_bytes) {
    enum { R = 12, C = 100 };
    for (int i = 0; i < 2; i++) {
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *x = nb_empty(ctx, NB_F32, NB_SHAPE(R, C)), *b = nb_zeros(ctx, NB_F32, NB_SHAPE(C));
        nb_set_requires_grad(b, true);
        nb_meta_reset();
        nb_tensor *y = nb_add(ctx, x, b);
        expect("binary.add", 1, 4.0 * (R * C + C + R * C), R * C, 0, kinds[i] == NB_DEVICE_CUDA ? 1 : 0);
        if (kinds[i] == NB_DEVICE_CPU) {
            nb_tensor *g = nb_empty(ctx, NB_F32, NB_SHAPE(R, C));
            nb_meta_reset();
            nb_backward_ex(y, &(nb_backward_options){g, false});
            expect("binary.add", 1, 4.0 * (R * C + 2 * C), R * C, 0, 0);
        }
        nb_ctx_free(ctx);
    }
}
END_TEST

START_TEST(test_softmax) {
    enum { R = 12, C = 100 };
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_tensor *x = nb_empty(ctx, NB_F32, NB_SHAPE(R, C));
    nb_meta_reset();
    nb_softmax(ctx, x, -1);
    expect("softmax", 1, 2 * 4.0 * R * C, 5.0 * R * C, 0, 1);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_cross_entropy) {
    enum { N = 16, C = 50 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *logits = nb_empty(ctx, NB_F32, NB_SHAPE(N, C));
        logits->requires_grad = true;
        nb_tensor *t = nb_zeros(ctx, NB_I64, NB_SHAPE(N));
        nb_meta_reset();
        nb_tensor *loss = nb_cross_entropy(ctx, logits, t, NULL);
        /* reads logits and targets; writes the loss, the log-sum-exp per
         * row and the count (f32 on CUDA, f64 on the CPU) */
        double count = cuda ? 4 : 8;
        expect("cross_entropy", 1, 4.0 * N * C + 8.0 * N + 4 + 4.0 * N + count, 4.0 * N * C, 0,
               cuda ? 2 : 0);
        nb_meta_reset();
        nb_backward(loss);
        /* reads logits, lse, targets, the loss's gradient and the count;
         * writes dlogits */
        expect("cross_entropy_backward", 1, 4.0 * N * C + 4.0 * N + 8.0 * N + 4 + count + 4.0 * N * C,
               3.0 * N * C, 0, cuda ? 1 : 0);
        nb_ctx_free(ctx);
    }
}
END_TEST

/* Note [Fused classifier]: logits the library made (in a scope) get their
 * gradient in the forward: it reads logits and targets once, writes the
 * loss, the count and dlogits (no lse); CUDA counts the targets first (a
 * kernel reading them and writing the count). The backward of
 * nb_backward(loss) then runs no entry; with g = 0.5 one pass reads
 * dlogits and g and writes dlogits. */
START_TEST(test_cross_entropy_fused) {
    enum { N = 16, C = 50 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *x = nb_empty(ctx, NB_F32, NB_SHAPE(N, C));
        x->requires_grad = true;
        nb_tensor *t = nb_zeros(ctx, NB_I64, NB_SHAPE(N));
        double count = cuda ? 4 : 8;
        for (int scaled = 0; scaled < 2; scaled++) {
            nb__scope_enter(ctx);
            nb_tensor *logits = nb_mul_scalar(ctx, x, 1.0);
            nb_meta_reset();
            nb_tensor *loss = nb__cross_entropy_fused(ctx, logits, t, NULL);
            nb__scope_exit(ctx, loss);
            expect("cross_entropy", 1,
                   4.0 * N * C + 8.0 * N + 4 + count + 4.0 * N * C + (cuda ? 8.0 * N + 4 : 0),
                   7.0 * N * C, 0, cuda ? 3 : 0);
            if (scaled) loss = nb_mul_scalar(ctx, loss, 0.5);
            nb_meta_reset();
            nb_backward(loss);
            if (scaled)
                expect("cross_entropy_backward", 1, 4.0 * N * C + 4 + 4.0 * N * C, 1.0 * N * C, 0,
                       cuda ? 1 : 0);
            else
                ck_assert_int_eq(find("cross_entropy_backward").calls, 0);
        }
        nb_ctx_free(ctx);
    }
}
END_TEST

START_TEST(test_adamw) {
    int64_t sizes[3] = {1000, 37, 4096};
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_named_tensor p[3];
    double elems = 0;
    for (int i = 0; i < 3; i++) {
        p[i].name = i == 0 ? "a" : i == 1 ? "b" : "c";
        p[i].tensor = nb_empty(ctx, NB_F32, NB_SHAPE(sizes[i]));
        p[i].tensor->requires_grad = true;
        p[i].tensor->grad = nb_zeros(ctx, NB_F32, NB_SHAPE(sizes[i]));
        elems += (double)sizes[i];
    }
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, 3, &h);
    nb_meta_reset();
    nb_optim_step(opt);
    /* reads p, g, m, v and writes p, m, v: 7 f32 per element; one launch
     * takes up to 192 tensors */
    expect("adam", 1, 7 * 4.0 * elems, 12 * elems, 0, 1);
    /* the clip inside the step (Note [Clipping inside the step]): the sum
     * of squares (each gradient read, the f64 sum written; one partial
     * launch for up to 192 tensors, then the final one), its square root,
     * and the update reading the norm too; no clip_scale pass */
    nb_meta_reset();
    nb_tensor *norm = nb_optim_step_clipped(opt, ctx, 1.0, 2.0);
    ck_assert(norm->dtype == NB_F64 && norm->ndim == 0);
    expect("sum_squares", 1, 4.0 * elems + 8, 2 * elems, 0, 2);
    expect("unary.sqrt", 1, 16, 1, 0, 1);
    expect("adam", 1, 7 * 4.0 * elems + 8, 12 * elems, 0, 1);
    expect("clip_scale", 0, 0, 0, 0, 0);
    ck_assert_int_eq(nb_meta_total().launches, 4);
    nb_optim_free(opt);
    nb_ctx_free(ctx);
}
END_TEST

/* 200 gradients: two launches of each multi-tensor kernel (192 a launch). */
START_TEST(test_adamw_many) {
    enum { NP = 200 };
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_named_tensor p[NP];
    char names[NP][8];
    for (int i = 0; i < NP; i++) {
        snprintf(names[i], sizeof names[i], "p%d", i);
        p[i].name = names[i];
        p[i].tensor = nb_empty(ctx, NB_F32, NB_SHAPE(64));
        p[i].tensor->requires_grad = true;
        p[i].tensor->grad = nb_zeros(ctx, NB_F32, NB_SHAPE(64));
    }
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, NP, &h);
    nb_meta_reset();
    (void)nb_optim_step_clipped(opt, ctx, 1.0, 2.0);
    expect("sum_squares", 1, 4.0 * 64 * NP + 8, 2.0 * 64 * NP, 0, 3);
    expect("adam", 1, 7 * 4.0 * 64 * NP + 8, 12.0 * 64 * NP, 0, 2);
    nb_optim_free(opt);
    nb_ctx_free(ctx);
}
END_TEST

/* A GPT of 2 layers, width 32 and T 32 on dev: its parameters in a
 * context *params, and a step context *step of compute dtype cd. */
static nb_module *small_gpt(nb_device dev, nb_dtype cd, nb_ctx **params, nb_ctx **step) {
    nb_gpt_config cfg = {128, 32, 2, 2, 32, 0.0};
    *params = nb_ctx_new(dev, 0);
    *step = nb_ctx_new(dev, 0);
    nb_ctx_set_compute_dtype(*step, cd);
    nb_rng rng = nb_rng_make(7);
    return nb_gpt_new(*params, NB_F32, &cfg, &rng);
}

/* small_gpt with AdamW over its parameters and a (4, 32) batch of zeros:
 * what the GPT step tests set up, and gpt_rig_free what they tear down. */
typedef struct {
    nb_ctx *params, *step;
    nb_module *gpt;
    nb_named_tensor *p;
    int np;
    nb_optim *opt;
    nb_tensor *x, *y;
} gpt_rig;

static gpt_rig gpt_rig_new(nb_device dev, nb_dtype cd) {
    gpt_rig r;
    r.gpt = small_gpt(dev, cd, &r.params, &r.step);
    r.np = nb_module_named_parameters(r.gpt, NULL, 0);
    r.p = malloc((size_t)r.np * sizeof *r.p);
    ck_assert(r.p);
    nb_module_named_parameters(r.gpt, r.p, r.np);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    r.opt = nb_optim_new(NB_OPTIM_ADAMW, r.p, r.np, &h);
    r.x = nb_zeros(r.params, NB_I64, NB_SHAPE(4, 32));
    r.y = nb_zeros(r.params, NB_I64, NB_SHAPE(4, 32));
    return r;
}

static void gpt_rig_free(gpt_rig *r) {
    nb_optim_free(r->opt);
    free(r->p);
    nb_ctx_free(r->step);
    nb_ctx_free(r->params);
}

/* One GPT step, twice (the first makes the gradients and AdamW's state):
 * the step context's peak, the parameters' context and the state. On a
 * meta device the counts left are those of the second step's backward
 * and update. */
static void gpt_step_peaks(nb_device dev, size_t *step_peak, size_t *model) {
    gpt_rig r = gpt_rig_new(dev, NB_F32);
    for (int s = 0; s < 2; s++) {
        nb_ctx_reset(r.step);
        nb_tensor *loss = nb_gpt_forward_loss(r.gpt, r.step, r.x, r.y);
        nb_meta_reset();
        nb_backward(loss);
        nb_optim_clip_grad_norm(r.opt, 1.0, 2.0);
        nb_optim_step(r.opt);
        nb_optim_zero_grad(r.opt);
    }
    *step_peak = nb_ctx_peak(r.step);
    *model = nb_ctx_peak(r.params) + nb_optim_state_bytes(r.opt);
    gpt_rig_free(&r);
}

/* Embedding backward: on CUDA every row of the weight's gradient written
 * once (no zeroing pass): the keys kernel, CUB's radix sort (an upsweep
 * and one pass per 8 bits of V: V = 100 takes 7 bits, one pass), the row
 * kernel; on the CPU the gradient zeroed and the rows hit written, min(P,
 * V) of them. Into a gradient that holds values (Note [Embedding gradients in
 * place]): the rows hit read and written, min(P, V) of them, no other
 * tensor and no add. */
START_TEST(test_embedding_backward) {
    enum { V = 100, C = 16, B = 4, T = 5 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_ctx *ctx = nb_ctx_new(nb_meta(kinds[i]), 0);
        nb_tensor *w = nb_empty(ctx, NB_F32, NB_SHAPE(V, C));
        w->requires_grad = true;
        nb_tensor *idx = nb_zeros(ctx, NB_I64, NB_SHAPE(B, T));
        nb_tensor *y = nb_embedding(ctx, w, idx);
        nb_meta_reset();
        nb_backward_with(y, nb_ones(ctx, NB_F32, NB_SHAPE(B, T, C)));
        double g = 4.0 * B * T * C, gw = 4.0 * V * C, ib = 8.0 * B * T;
        expect("embedding_backward", 1, g + ib + gw + (cuda ? 0 : g), B * T * C, 0, cuda ? 4 : 0);
        nb_tensor *y2 = nb_embedding(ctx, w, idx), *ones = nb_ones(ctx, NB_F32, NB_SHAPE(B, T, C));
        nb_meta_reset();
        nb_backward_with(y2, ones);
        expect("embedding_backward", 1, g + ib + 2 * 4.0 * B * T * C, B * T * C, 0, cuda ? 4 : 0);
        /* the seed gradient's copy and the backward: no add, no temporary */
        ck_assert_int_eq(nb_meta_total().calls, 2);
        ck_assert_int_eq(find("copy").calls, 1);
        nb_ctx_free(ctx);
    }
}
END_TEST

/* The GPT's input under bf16 on meta:cuda: one kernel forward (the token
 * rows gathered, the position rows once, the bf16 output), no cast; in
 * backward the bf16 gradient read as it is, the token table's sums added
 * into the gradient its tied output head's GEMM wrote, the position table's
 * batch sums into its own: written the first step (no gradient yet), added
 * from the second (zero_grad keeps the buffer). No other entry touches a
 * (V, C) or (P, C) table's gradient. */
START_TEST(test_gpt_input) {
    enum { V = 128, P = 32, L = 2, C = 32, N = 4, T = 32 }; /* gpt_rig's */
    gpt_rig r = gpt_rig_new(nb_meta(NB_DEVICE_CUDA), NB_BF16);
    double nt = N * T, idx = 8.0 * nt, g = 2.0 * nt * C;
    for (int s = 0; s < 2; s++) {
        nb_ctx_reset(r.step);
        nb_meta_reset();
        nb_backward(nb_gpt_forward_loss(r.gpt, r.step, r.x, r.y));
        expect("embedding_pos", 1, idx + 2.0 * nt * C + 4.0 * (nt + T) * C, nt * C, 0, 1);
        expect("embedding_backward", 1, g + idx + 2 * 4.0 * (nt < V ? nt : V) * C, nt * C, 0, 2 + 1 + 1);
        expect("embedding_pos_backward", 1, g + (s ? 2 * 4.0 * T * C : 4.0 * P * C), nt * C, 0, 1);
        ck_assert_int_eq(find("embedding").calls, 0);
        ck_assert_int_eq(find("copy.f32>bf16").calls, s ? 0 : 4 * L + 1); /* step 0: the weights' */
        ck_assert_int_eq(find("copy.bf16>f32").calls, 0);
        nb_optim_step(r.opt);
        nb_optim_zero_grad(r.opt);
    }
    gpt_rig_free(&r);
}
END_TEST

/* Note [Parameter shadows]: under bf16 on meta:cuda, the first step casts
 * each weight and bias at its use; from the second on the products read
 * the shadows the update wrote (2 bytes per parameter element more in the
 * update), and no cast is left (the embeddings' sum is made in bf16). */
START_TEST(test_gpt_shadows) {
    gpt_rig r = gpt_rig_new(nb_meta(NB_DEVICE_CUDA), NB_BF16);
    double elems = 0;
    for (int i = 0; i < r.np; i++) elems += (double)nb_numel(r.p[i].tensor);
    int64_t casts[3];
    for (int s = 0; s < 3; s++) {
        nb_ctx_reset(r.step);
        nb_meta_reset();
        nb_backward(nb_gpt_forward_loss(r.gpt, r.step, r.x, r.y));
        casts[s] = find("copy.f32>bf16").calls;
        /* the fused classifier: three launches forward, none backward */
        ck_assert_int_eq(find("cross_entropy").launches, 3);
        ck_assert_int_eq(find("cross_entropy_backward").calls, 0);
        nb_optim_step(r.opt);
        nb_optim_zero_grad(r.opt);
    }
    /* the first step: each block's four weights and the tied lm_head's
     * (biases ride the GEMM in f32, uncast) */
    ck_assert_msg(casts[0] == 4 * 2 + 1 && casts[1] == 0 && casts[2] == 0, "casts %lld, %lld, %lld",
                  (long long)casts[0], (long long)casts[1], (long long)casts[2]);
    /* the steady update: p, g, m, v, 7 f32 per element, and the shadows
     * of the matrices the products use, 2 bytes each */
    nb_meta_entry a = find("adam");
    double shadowed = 0;
    for (int i = 0; i < r.np; i++)
        if (r.p[i].tensor->priv->grad_slot && r.p[i].tensor->priv->grad_slot->shadow)
            shadowed += (double)nb_numel(r.p[i].tensor);
    ck_assert(shadowed > 0.5 * elems && shadowed < elems);
    ck_assert_msg(a.bytes == 28.0 * elems + 2.0 * shadowed, "adam %.0f bytes", a.bytes);
    gpt_rig_free(&r);
}
END_TEST

/* A GPT step's layer norms on meta:cuda (Note [Layer norm's gradients
 * added in place] in tensor/ops_norm.c): from the second step on, every
 * layer norm adds its weight's and bias's gradients into theirs, and each
 * block's two add dx into the residual stream's gradient (ln_f's x feeds
 * nothing else: written); two launches each. */
START_TEST(test_gpt_layer_norm_backward) {
    enum { B = 4, T = 32, L = 2, C = 32 }; /* gpt_step_peaks' model and batch */
    size_t step_peak, model;
    gpt_step_peaks(nb_meta(NB_DEVICE_CUDA), &step_peak, &model);
    /* each: g, x, mean, rstd (f32), w read; dx, dw, db written; dw, db read */
    double md = (double)B * T * C;
    double one = 4.0 * (2 * md + 2.0 * B * T + C) + 4.0 * (md + 2 * C) + 4.0 * 2 * C;
    expect("layer_norm_backward", 2 * L + 1, (2 * L + 1) * one + 2 * L * 4.0 * md,
           (2 * L + 1) * 10.0 * md, 0, 2 * (2 * L + 1));
}
END_TEST

START_TEST(test_gpt_peak_matches_cpu) {
    size_t real_step, real_model, meta_step, meta_model;
    gpt_step_peaks(nb_cpu(), &real_step, &real_model);
    gpt_step_peaks(nb_meta(NB_DEVICE_CPU), &meta_step, &meta_model);
    ck_assert_msg(fabs((double)meta_step - (double)real_step) <= 0.02 * (double)real_step,
                  "meta:cpu step peak %zu, the CPU's %zu", meta_step, real_step);
    ck_assert_uint_eq(meta_model, real_model);
}
END_TEST

/* Note [Peak report]: what was live at the peak's last moment, grouped by
 * maker, dtype and shape: here the user's input and the library's
 * temporary of the same shape (given back since, still in the report),
 * and not what was made after the peak. */
START_TEST(test_peak_report) {
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CPU), 0);
    nb_ctx_watch_peak(ctx, true);
    bool prev = nb_set_grad_enabled(false);
    nb_tensor *a = nb_empty(ctx, NB_F32, NB_SHAPE(1000));
    nb__scope_enter(ctx);
    nb_tensor *s = nb_sum_all(ctx, nb_exp(ctx, a));
    nb__scope_exit(ctx, s); /* the exp's output is given back */
    nb_tensor *late = nb_empty(ctx, NB_F64, NB_SHAPE(10, 3));
    ck_assert(nb_ctx_used(ctx) < nb_ctx_peak(ctx));
    nb_set_grad_enabled(prev);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    nb_ctx_print_peak(ctx, f, 10);
    fclose(f);
    ck_assert_msg(strstr(text, "3 tensors") != NULL, "%s", text);
    ck_assert_msg(strstr(text, "2  f32   (1000,)") != NULL, "%s", text);
    ck_assert_msg(strstr(text, "(10, 3)") == NULL, "%s", text);
    ck_assert_ptr_nonnull(late);
    free(text);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_no_values) {
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_tensor *s = nb_sum_all(ctx, nb_ones(ctx, NB_F32, NB_SHAPE(3, 4)));
    NBT_EXPECT_ABORT(nb_item(s), "nb_item: tensor f32 () is on meta:cuda, which holds no values");
    float buf[12];
    NBT_EXPECT_ABORT(nb_to_host(nb_ones(ctx, NB_F32, NB_SHAPE(3, 4)), buf), "nb_to_host");
    nb_ctx *cpu = nb_ctx_new(nb_cpu(), 0);
    NBT_EXPECT_ABORT(nb_copy_(nb_zeros(cpu, NB_F32, NB_SHAPE(2)), nb_ones(ctx, NB_F32, NB_SHAPE(2))),
                     "nb_copy_");
    nb_ctx *mcpu = nb_ctx_new(nb_meta(NB_DEVICE_CPU), 0);
    NBT_EXPECT_ABORT(nb_item(nb_ones(mcpu, NB_F32, NB_SHAPE(1))), "meta:cpu, which holds no values");
    nb_ctx_free(mcpu);
    nb_ctx_free(cpu);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_device_names) {
    nb_device d;
    ck_assert_int_eq(nb_device_parse("meta:cuda", &d), NB_OK);
    ck_assert(nb_device_eq(d, nb_meta(NB_DEVICE_CUDA)));
    ck_assert_str_eq(nb_device_name(d), "meta:cuda");
    ck_assert_int_eq(nb_device_parse("meta:cpu", &d), NB_OK);
    ck_assert_str_eq(nb_device_name(d), "meta:cpu");
    ck_assert_int_eq(nb_device_parse("cuda:3", &d), NB_OK);
    ck_assert(nb_device_eq(d, nb_cuda(3)));
    NBT_EXPECT_STATUS(nb_device_parse("meta:tpu", &d), NB_ERR_INVALID, "'meta:tpu' is not a device");
    NBT_EXPECT_STATUS(nb_device_parse("cuda:x", &d), NB_ERR_INVALID, "not a device");
    NBT_EXPECT_ABORT(nb_ctx_new(nb_meta((nb_device_type)7), 0), "is not a meta device");
}
END_TEST

/* Each meta table fills every entry and carries the flags of the backend it
 * stands for (Note [Meta device]): the CPU's, and CUDA's (tensor/cuda/
 * flags.h; in a CUDA build, the loaded plugin's table). */
static void assert_same_flags(const nb__backend *m, const nb__backend *of) {
    ck_assert(m->meta && !of->meta);
    ck_assert_int_eq(m->device_memory, of->device_memory);
    ck_assert_int_eq(m->gemm_accumulate, of->gemm_accumulate);
    ck_assert_int_eq(m->ordered_elementwise, of->ordered_elementwise);
    ck_assert_int_eq(m->strided_elementwise_out, of->strided_elementwise_out);
    ck_assert_int_eq(m->half_compute, of->half_compute);
    ck_assert_uint_eq(m->product_dtypes, of->product_dtypes);
    ck_assert_int_eq(m->f32_norm_stats, of->f32_norm_stats);
    ck_assert_uint_eq(m->causal_attention_dtypes, of->causal_attention_dtypes);
    ck_assert_int_eq(m->causal_attention != NULL, of->causal_attention != NULL);
#define KERNEL(e) ck_assert_msg(m->e != NULL, "%s: kernel entry %s is empty", m->name, #e);
    NB__BACKEND_KERNELS(KERNEL)
#undef KERNEL
}

START_TEST(test_tables) {
    const nb__backend *mcpu = nb__backend_of(nb_meta(NB_DEVICE_CPU));
    const nb__backend *mcuda = nb__backend_of(nb_meta(NB_DEVICE_CUDA));
    ck_assert_str_eq(mcpu->name, "meta:cpu");
    ck_assert_str_eq(mcuda->name, "meta:cuda");
    assert_same_flags(mcpu, &nb__cpu_backend);
    /* what the CUDA backend is today, written here */
    ck_assert(mcuda->device_memory && mcuda->half_compute && !mcuda->strided_elementwise_out);
    ck_assert_uint_eq(mcuda->product_dtypes, (1u << NB_BF16) | (1u << NB_F16));
#if NABLA_HAVE_CUDA
    const nb__cuda_plugin *plugin = nb__cuda_plugin_get();
    if (plugin) assert_same_flags(mcuda, plugin->backend);
#endif
    /* a bf16 compute dtype is refused on meta:cpu's products only for f16, as on the CPU */
    nb_ctx *c = nb_ctx_new(nb_meta(NB_DEVICE_CPU), 0);
    NBT_EXPECT_ABORT(nb_ctx_set_compute_dtype(c, NB_F16), "f16 compute is not supported on meta:cpu");
    nb_ctx_free(c);
}
END_TEST

/* meta:cuda fuses the attention where the CUDA backend does: head
 * dimensions up to its kernels' largest, not under
 * NABLA_CUDA_ATTENTION=composed (then the front end composes it). */
START_TEST(test_attention_path) {
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_tensor *small = nb_empty(ctx, NB_BF16, NB_SHAPE(2, 16, 3 * 2 * 64)); /* D = 64 */
    nb_tensor *wide = nb_empty(ctx, NB_BF16, NB_SHAPE(2, 16, 3 * 2 * 256)); /* D = 256 */
    unsetenv("NABLA_CUDA_ATTENTION");
    ck_assert_ptr_nonnull(nb__causal_attention(ctx, small, 2, 0.125));
    ck_assert_ptr_null(nb__causal_attention(ctx, wide, 2, 0.0625));
    nb_meta_reset();
    ck_assert_ptr_nonnull(nb__causal_attention(ctx, small, 2, 0.125));
    /* y (2, 16, 128) and lse (2, 2, 16) f32 written, qkv read; 2 causal
     * products of 16 * 17 / 2 rows by 64 per head */
    expect("causal_attention", 1, 2.0 * 2 * 16 * 384 + 2.0 * 2 * 16 * 128 + 4.0 * 2 * 2 * 16,
           5.0 * 2 * 2 * 16 * 17 / 2, 2 * (2.0 * 2 * 16 * 17 / 2 * 2 * 64), 1);
    setenv("NABLA_CUDA_ATTENTION", "composed", 1);
    ck_assert_ptr_null(nb__causal_attention(ctx, small, 2, 0.125));
    unsetenv("NABLA_CUDA_ATTENTION");
    nb_ctx_free(ctx);
}
END_TEST

/* The Linear tests' setup: a parameter context holding f32 weights and
 * biases that require gradients, and a step context under a bf16 compute
 * dtype, on the same meta device. */
typedef struct linear_step {
    nb_ctx *params, *step;
} linear_step;

static linear_step linear_step_new(nb_device_type kind) {
    linear_step s = {nb_ctx_new(nb_meta(kind), 0), nb_ctx_new(nb_meta(kind), 0)};
    nb_ctx_set_compute_dtype(s.step, NB_BF16);
    return s;
}

/* A Linear's weight (out, in) and bias (out) in s's parameter context */
static void linear_params(const linear_step *s, int64_t out, int64_t in, nb_tensor **w,
                          nb_tensor **b) {
    *w = nb_empty(s->params, NB_F32, NB_SHAPE(out, in));
    *b = nb_empty(s->params, NB_F32, NB_SHAPE(out));
    nb_set_requires_grad(*w, true);
    nb_set_requires_grad(*b, true);
}

static void linear_step_free(linear_step *s) {
    nb_ctx_free(s->step);
    nb_ctx_free(s->params);
}

/* An MLP's Linear layers under a bf16 compute dtype (f32 weights and
 * biases): on meta:cuda the biases ride the GEMMs as f32 (no cast), the
 * bias gradients come from the weights' gradient GEMMs (BGRADB) and GELU's
 * gradient from c_proj's input-gradient GEMM (DGELU): Note [GEMM
 * epilogues in backward]. Bytes and FLOPs of each GEMM by formula; on
 * meta:cpu the separate ops remain. */
START_TEST(test_linear_epilogues) {
    enum { R = 64, C = 32, H = 128 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        linear_step s = linear_step_new(kinds[i]);
        nb_ctx *step = s.step;
        nb_tensor *w1, *b1, *w2, *b2;
        linear_params(&s, H, C, &w1, &b1);
        linear_params(&s, C, H, &w2, &b2);
        nb_tensor *ps[4] = {w1, b1, w2, b2};
        nb_tensor *x = nb_empty(step, NB_BF16, NB_SHAPE(R, C));
        nb_meta_reset();
        nb_tensor *h = nb__linear_gelu(step, x, w1, b1);
        nb_tensor *y = nb__linear(step, h, w2, b2);
        ck_assert_int_eq(y->dtype, NB_BF16);
        /* c_fc: x, w1 (bf16), b1 (f32) read; h and pre written; c_proj: h,
         * w2, b2 read, y written */
        double fwd = 2.0 * R * C + 2.0 * H * C + 4.0 * H + 2 * 2.0 * R * H;
        fwd += 2.0 * R * H + 2.0 * C * H + 4.0 * C + 2.0 * R * C;
        expect("matmul", 2, fwd, 9.0 * R * H + 1.0 * R * C, 4.0 * R * H * C, cuda ? 2 : 0);
        /* the weights are cast, the biases not */
        expect("copy.f32>bf16", 2, 6.0 * H * C + 6.0 * C * H, 0, 0, cuda ? 2 : 0);
        nb_meta_reset();
        nb_backward_with(y, nb_empty(step, NB_BF16, NB_SHAPE(R, C)));
        if (cuda) {
            /* dh through GELU: g, w2, pre read, dpre written; dw2 (f32) and
             * db2 from g^T h; dw1 and db1 from dpre^T x */
            double bw = 2.0 * R * C + 2.0 * C * H + 2.0 * R * H + 2.0 * R * H;
            bw += 2.0 * R * C + 2.0 * R * H + 4.0 * C * H + 4.0 * C;
            bw += 2.0 * R * H + 2.0 * R * C + 4.0 * H * C + 4.0 * H;
            expect("matmul", 3, bw, 10.0 * R * H + 1.0 * R * C + 1.0 * R * H, 6.0 * R * H * C, 3);
            ck_assert_int_eq(find("gelu_tanh_backward").calls, 0);
            ck_assert_int_eq(find("sum_rows").calls, 0);
        } else {
            ck_assert_int_eq(find("gelu_tanh_backward").calls, 1);
        }
        for (int k = 0; k < 4; k++) ck_assert_int_eq(ps[k]->grad->dtype, NB_F32);
        linear_step_free(&s);
    }
}
END_TEST

/* Note [Residual in the GEMM]: r + (x w^T + b) under bf16 (f32 w and b,
 * bf16 x and r) is one GEMM call that reads x, w (its bf16 cast), b (f32)
 * and r (C, once) and writes y (D, apart): one launch on meta:cuda, no
 * add. The CPU's one op is the product and then the add's kernel, so
 * meta:cpu counts what the separate ops count. Its backward makes the
 * calls the separate ops' backward makes (the add's is none: r's gradient
 * is the incoming one). */
START_TEST(test_linear_residual) {
    enum { R = 64, C = 32, K = 128 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        nb_meta_entry bw[2];
        for (int fuse = 1; fuse >= 0; fuse--) {
            linear_step s = linear_step_new(kinds[i]);
            nb_ctx *step = s.step;
            nb_tensor *w, *b;
            linear_params(&s, C, K, &w, &b);
            nb_tensor *x = nb_empty(step, NB_BF16, NB_SHAPE(R, K));
            nb_tensor *r = nb_empty(step, NB_BF16, NB_SHAPE(R, C));
            nb_set_requires_grad(x, true);
            nb_set_requires_grad(r, true);
            nb__linear_residual_fuse(fuse);
            nb_meta_reset();
            nb_tensor *y = nb__linear_residual(step, x, w, b, r);
            nb__linear_residual_fuse(true);
            ck_assert_int_eq(y->dtype, NB_BF16);
            double gemm = 2.0 * R * K + 2.0 * C * K + 4.0 * C + 2.0 * R * C; /* x, w, b; D */
            if (fuse && cuda) {
                expect("matmul", 1, gemm + 2.0 * R * C, 2.0 * R * C, 2.0 * R * C * K, 1);
                ck_assert_int_eq(find("binary.add").calls, 0);
            } else { /* the product, then r and it read and y written by the add */
                expect("matmul", 1, gemm, 1.0 * R * C, 2.0 * R * C * K, cuda ? 1 : 0);
                expect("binary.add", 1, 3 * 2.0 * R * C, 1.0 * R * C, 0, cuda ? 1 : 0);
            }
            ck_assert_int_eq(find("copy.f32>bf16").calls, 1); /* w's cast */
            ck_assert_int_eq(nb_meta_total().calls, 3 - (fuse && cuda));
            nb_meta_reset();
            nb_backward_with(y, nb_empty(step, NB_BF16, NB_SHAPE(R, C)));
            bw[fuse] = nb_meta_total();
            linear_step_free(&s);
        }
        ck_assert_int_eq(bw[1].calls, bw[0].calls);
        ck_assert_int_eq(bw[1].launches, bw[0].launches);
        ck_assert(bw[1].bytes == bw[0].bytes && bw[1].gemm_flops == bw[0].gemm_flops);
    }
}
END_TEST

/* One GPT step under bf16 on meta:cuda (the trace of bench_gpt2), with
 * the residual adds in the projections' GEMMs or apart: each of the 2 L
 * adds fused is one launch fewer and 2 (N, T, C) bf16 tensors fewer moved
 * (apart: the product writes one, the add reads two and writes one; fused:
 * C read, D written). Nothing else changes. On meta:cpu the fused op is
 * the product and the add, as apart: the same counts. */
static nb_meta_entry gpt_step_counts(nb_device_type kind, bool fuse, int64_t *adds) {
    nb_ctx *params, *step;
    nb_module *gpt = small_gpt(nb_meta(kind), NB_BF16, &params, &step);
    nb_tensor *x = nb_zeros(params, NB_I64, NB_SHAPE(4, 32)), *y = nb_zeros(params, NB_I64, NB_SHAPE(4, 32));
    nb__linear_residual_fuse(fuse);
    nb_meta_reset();
    nb_backward(nb_gpt_forward_loss(gpt, step, x, y));
    nb__linear_residual_fuse(true);
    nb_meta_entry total = nb_meta_total();
    *adds = find("binary.add").calls;
    nb_ctx_free(step);
    nb_ctx_free(params);
    return total;
}

START_TEST(test_gpt_residual_adds) {
    enum { L = 2, N = 4, T = 32, C = 32 };
    for (int i = 0; i < 2; i++) {
        bool cuda = kinds[i] == NB_DEVICE_CUDA;
        int64_t adds_fused, adds_apart;
        nb_meta_entry fused = gpt_step_counts(kinds[i], true, &adds_fused);
        nb_meta_entry apart = gpt_step_counts(kinds[i], false, &adds_apart);
        int64_t fewer = cuda ? 2 * L : 0;
        ck_assert_int_eq(adds_apart - adds_fused, fewer);
        ck_assert_int_eq(apart.launches - fused.launches, fewer);
        ck_assert_msg(apart.bytes - fused.bytes == fewer * 2 * (2.0 * N * T * C),
                      "bytes %.0f apart, %.0f fused", apart.bytes, fused.bytes);
        ck_assert(apart.gemm_flops == fused.gemm_flops && apart.flops == fused.flops);
        ck_assert_int_eq(apart.calls - fused.calls, fewer);
    }
}
END_TEST

/* Note [Gradients set to none] in autograd/backward.c: a weight's
 * gradient GEMM into a gradient set to none runs with beta = 0 and counts
 * C once (written), not read and written; the bias's sums go from the
 * BGRAD epilogue straight into its gradient, no temporary and no add. One
 * Linear under bf16 on meta:cuda, its third backward after zero_grad and
 * after zero_grad_to_none, against the second. */
START_TEST(test_gemm_fresh_gradient) {
    enum { R = 64, C = 32, H = 48 };
    nb_ctx *ctx = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0), *step = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_tensor *w = nb_empty(ctx, NB_F32, NB_SHAPE(H, C)), *b = nb_empty(ctx, NB_F32, NB_SHAPE(H));
    nb_set_requires_grad(w, true);
    nb_set_requires_grad(b, true);
    nb_named_tensor p[2] = {{"w", w}, {"b", b}};
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, 2, &h);
    /* g^T x read (bf16), D (f32 dw) written, the bias's sums (f32) written */
    double gemm = 2.0 * R * H + 2.0 * R * C + 4.0 * H * C + 4.0 * H;
    for (int s = 0; s < 3; s++) {
        nb_ctx_reset(step);
        nb_tensor *y = nb__linear(step, nb_empty(step, NB_BF16, NB_SHAPE(R, C)), w, b);
        nb_meta_reset();
        nb_backward_with(y, nb_empty(step, NB_BF16, NB_SHAPE(R, H)));
        if (s == 1) { /* after zero_grad: C read too, the bias's sums added */
            expect("matmul", 1, gemm + 4.0 * H * C, 1.0 * R * H, 2.0 * R * H * C, 1);
            expect("binary.add", 1, 3 * 4.0 * H, 1.0 * H, 0, 1);
        } else { /* the first backward, and after zero_grad_to_none: written */
            expect("matmul", 1, gemm, 1.0 * R * H, 2.0 * R * H * C, 1);
            ck_assert_int_eq(find("binary.add").calls, 0);
        }
        ck_assert_int_eq(find("copy").calls, 1); /* the seed's; nothing copied into a gradient */
        nb_meta_reset();
        if (s == 0) nb_optim_zero_grad(opt);
        else nb_optim_zero_grad_to_none(opt);
        /* one memset over the flat buffer, or nothing */
        expect("memset", s == 0, s == 0 ? 4.0 * (H * C + H) : 0, 0, 0, s == 0);
    }
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(ctx);
}
END_TEST

/* A steady GPT step under bf16 on meta:cuda (forward, backward, AdamW,
 * the gradients cleared), as bench_gpt2 counts it, with zero_grad and
 * with zero_grad_to_none. What the second saves, by formula: the memset
 * over the flat buffer (4 bytes per parameter, one launch; small_gpt's
 * sizes are multiples of 16, so no slot padding); each weight's gradient
 * GEMM's read of C (4 bytes per element of the 4 L block matrices and the
 * tied wte/lm_head); the 4 L bias gradients' adds (two (N) f32 read, one
 * written, one launch each); each layer norm's read of dw and db; and the
 * position table's gradient written whole instead of its T rows read and
 * written. Nothing else changes. */
static nb_meta_entry gpt_step_cleared(bool to_none, double *n_params) {
    gpt_rig r = gpt_rig_new(nb_meta(NB_DEVICE_CUDA), NB_BF16);
    *n_params = 0;
    for (int i = 0; i < r.np; i++) *n_params += (double)nb_numel(r.p[i].tensor);
    for (int s = 0; s < 2; s++) {
        nb_ctx_reset(r.step);
        nb_meta_reset();
        nb_backward(nb_gpt_forward_loss(r.gpt, r.step, r.x, r.y));
        nb_optim_step(r.opt);
        if (to_none) nb_optim_zero_grad_to_none(r.opt);
        else nb_optim_zero_grad(r.opt);
    }
    nb_meta_entry total = nb_meta_total();
    gpt_rig_free(&r);
    return total;
}

START_TEST(test_gpt_step_to_none) {
    enum { V = 128, P = 32, L = 2, C = 32, T = 32 }; /* small_gpt's, batch (4, 32) */
    double n_params, n2;
    nb_meta_entry zeros = gpt_step_cleared(false, &n_params), none = gpt_step_cleared(true, &n2);
    double matrices = L * (3.0 * C * C + 1.0 * C * C + 4.0 * C * C + 4.0 * C * C) + 1.0 * V * C;
    double biases = L * (3.0 * C + C + 4.0 * C + C);
    double saved = 4.0 * n_params + 4.0 * matrices + 3 * 4.0 * biases + (2 * L + 1) * 2 * 4.0 * C +
                   (2 * 4.0 * T * C - 4.0 * P * C);
    ck_assert_msg(zeros.bytes - none.bytes == saved, "bytes %.0f with zeros, %.0f set to none: %.0f saved, "
                  "expected %.0f", zeros.bytes, none.bytes, zeros.bytes - none.bytes, saved);
    ck_assert_int_eq(zeros.launches - none.launches, 1 + 4 * L);
    ck_assert_int_eq(zeros.calls - none.calls, 1 + 4 * L);
    ck_assert(zeros.gemm_flops == none.gemm_flops);
}
END_TEST

/* Note [GELU recomputed in backward] (tensor/ops_matmul.c), one GPT step
 * under bf16 on meta:cuda with each MLP's GELU output made again in
 * backward or kept: per layer one kernel more (GELU's: the (N, T, 4C) bf16
 * pre-activation read, the output written), the same GEMMs, and a peak
 * (in the output head's backward: a vocabulary large beside 4C, as
 * GPT-2's) lower by the L outputs no longer kept. */
static void gpt_gelu_counts(bool recompute, nb_meta_entry *total, nb_meta_entry *gelu,
                            size_t *peak) {
    nb_gpt_config cfg = {1024, 32, 2, 2, 32, 0.0};
    nb_ctx *params = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0), *step = nb_ctx_new(nb_meta(NB_DEVICE_CUDA), 0);
    nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_rng rng = nb_rng_make(7);
    nb_module *gpt = nb_gpt_new(params, NB_F32, &cfg, &rng);
    nb_gpt_set_recompute_gelu(gpt, recompute);
    nb_tensor *x = nb_zeros(params, NB_I64, NB_SHAPE(4, 32)), *y = nb_zeros(params, NB_I64, NB_SHAPE(4, 32));
    nb_meta_reset();
    nb_backward(nb_gpt_forward_loss(gpt, step, x, y));
    *total = nb_meta_total();
    *gelu = find("unary.gelu");
    *peak = nb_ctx_peak(step);
    nb_ctx_free(step);
    nb_ctx_free(params);
}

START_TEST(test_gpt_recompute_gelu) {
    enum { L = 2, N = 4, T = 32, C = 32 };
    nb_meta_entry t0, t1, g0, g1;
    size_t p0, p1;
    gpt_gelu_counts(false, &t0, &g0, &p0);
    gpt_gelu_counts(true, &t1, &g1, &p1);
    double h = 2.0 * N * T * 4 * C; /* one GELU output, bf16 */
    ck_assert_int_eq(g0.calls, 0);
    expect("unary.gelu", L, L * 2 * h, L * (double)N * T * 4 * C, 0, L);
    ck_assert_int_eq(t1.calls - t0.calls, L);
    ck_assert_int_eq(t1.launches - t0.launches, L);
    ck_assert_msg(t1.bytes - t0.bytes == L * 2 * h, "bytes %.0f recomputing, %.0f keeping", t1.bytes,
                  t0.bytes);
    ck_assert(t1.gemm_flops == t0.gemm_flops);
    ck_assert_msg(p0 - p1 == (size_t)(L * h), "peak %zu recomputing, %zu keeping: %zu less, "
                  "%.0f expected", p1, p0, p0 - p1, L * h);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_tables, test_matmul, test_batched_matmul, test_linear_epilogues,
                             test_linear_residual, test_gpt_residual_adds,
                             test_gpt_recompute_gelu, test_layer_norm,
                             test_layer_norm_adds, test_broadcast_bytes, test_softmax, test_cross_entropy,
                             test_cross_entropy_fused, test_adamw, test_embedding_backward,
                             test_gpt_input, test_adamw_many, test_gpt_shadows, test_attention_path,
                             test_gpt_layer_norm_backward, test_gpt_peak_matches_cpu, test_peak_report,
                             test_no_values,
                             test_device_names, test_gemm_fresh_gradient, test_gpt_step_to_none, NULL};
    return nbt_suite("meta", "core", 60, tests);
}

int main(void) { return nbt_run(suite()); }
