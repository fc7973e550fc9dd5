/* Memory given back within a step (Note [Memory given back] in
 * tensor/memory.c): the step context's peak against the floor computed
 * from the model's shape, training bitwise equal with giving back on and
 * off, the message for a tensor read after it was given back, nb_keep,
 * retain_graph, and the arena's free ranges. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensor/internal.h" /* nb__ctx_give_back */
#include "testutil.h"

/* ------------------------------------------------------------ the arena */
START_TEST(test_free_ranges) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 1 << 20);
    /* a, b, c in a row; b given back, then a: one hole of both, reused by
     * a tensor that fits it, best fit over a larger hole */
    nb_tensor *a = nb_empty(ctx, NB_F32, NB_SHAPE(1024)); /* 4 KiB each */
    nb_tensor *b = nb_empty(ctx, NB_F32, NB_SHAPE(1024));
    nb_tensor *c = nb_empty(ctx, NB_F32, NB_SHAPE(1024));
    nb_tensor *big = nb_empty(ctx, NB_F32, NB_SHAPE(4096));
    nb_tensor *d = nb_empty(ctx, NB_F32, NB_SHAPE(16));
    (void)d;
    size_t used = nb_ctx_used(ctx);
    ck_assert_uint_eq(used, 3 * 4096 + 16384 + 64);
    nb__ctx_give_back(ctx, b->data, 4096);
    nb__ctx_give_back(ctx, a->data, 4096);
    ck_assert_uint_eq(nb_ctx_used(ctx), used - 8192);
    nb__ctx_give_back(ctx, big->data, 16384);
    nb_tensor *e = nb_empty(ctx, NB_F32, NB_SHAPE(2048)); /* 8 KiB: the a+b hole, not big's */
    ck_assert_ptr_eq(e->data, a->data);
    nb_tensor *f = nb_empty(ctx, NB_F32, NB_SHAPE(512)); /* 2 KiB: best fit is big's hole */
    ck_assert_ptr_eq(f->data, big->data);
    /* the top of the block folds back into the bump pointer */
    size_t extent = nb_ctx_extent(ctx);
    nb_tensor *top = nb_empty(ctx, NB_F32, NB_SHAPE(1 << 16));
    ck_assert_uint_eq(nb_ctx_extent(ctx), extent + 262144);
    nb__ctx_give_back(ctx, top->data, 262144);
    nb_tensor *again = nb_empty(ctx, NB_F32, NB_SHAPE(1 << 16));
    ck_assert_ptr_eq(again->data, top->data);
    ck_assert_uint_eq(nb_ctx_extent(ctx), extent + 262144);
    (void)c;
    nb_ctx_free(ctx);
}
END_TEST

/* Note [Device totals] in tensor/context.c: the device's peak is that of
 * its contexts' sum, below the sum of their peaks when they peak apart;
 * giving back, resets and frees come off the total. On meta:cuda, which no
 * other test of this binary allocates on. */
START_TEST(test_device_totals) {
    nb_device d = nb_meta(NB_DEVICE_CUDA);
    size_t base = nb_device_allocated(d);
    nb_device_reset_peak(d);
    ck_assert_uint_eq(nb_device_max_allocated(d), base);
    nb_ctx *a = nb_ctx_new(d, 1 << 20), *b = nb_ctx_new(d, 1 << 20);
    nb_tensor *a1 = nb_empty(a, NB_F32, NB_SHAPE(1024)); /* 4096 bytes */
    (void)nb_empty(b, NB_F32, NB_SHAPE(2048));           /* 8192: 12288 live */
    nb__ctx_give_back(a, a1->data, 4096);                /* 8192 */
    (void)nb_empty(b, NB_F32, NB_SHAPE(512));            /* 10240 */
    ck_assert_uint_eq(nb_device_allocated(d), base + 10240);
    ck_assert_uint_eq(nb_device_max_allocated(d), base + 12288);
    ck_assert_uint_eq(nb_ctx_peak(a) + nb_ctx_peak(b), 4096 + 10240); /* the sum of peaks: more */
    nb_ctx_reset(b);
    ck_assert_uint_eq(nb_device_allocated(d), base);
    (void)nb_empty(a, NB_F32, NB_SHAPE(256)); /* 1024 */
    ck_assert_uint_eq(nb_device_allocated(d), base + 1024);
    nb_ctx_free(a);
    nb_ctx_free(b);
    ck_assert_uint_eq(nb_device_allocated(d), base);
    ck_assert_uint_eq(nb_device_max_allocated(d), base + 12288);
    nb_device_reset_peak(d);
    ck_assert_uint_eq(nb_device_max_allocated(d), base);
    /* another device's total is apart */
    ck_assert_uint_eq(nb_device_allocated(nb_meta(NB_DEVICE_CPU)), 0);
}
END_TEST

/* ------------------------------------------------------------ attention */
/* The fused attention keeps nothing of size (N, H, T, T) from its forward
 * for its backward (Note [Attention without stored probabilities] in
 * tensor/cpu/attention.c): what the forward leaves in the context is y
 * (and its record), a small fraction of the probabilities; the backward
 * that makes them again gives the composed ops' gradient. */
START_TEST(test_attention_keeps_no_probabilities) {
    enum { N = 2, T = 128, H = 4, C = 16 };
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *qkv = nbt_randn(ctx, NB_F32, NB_SHAPE(N, T, 3 * C), 31);
    qkv->requires_grad = true;
    double scale = 1 / sqrt((double)(C / H));
    size_t before = nb_ctx_used(ctx);
    nb_tensor *y = nb__causal_attention(ctx, qkv, H, scale);
    ck_assert_ptr_nonnull(y); /* the CPU has the fused op for f32 */
    size_t kept = nb_ctx_used(ctx) - before, probs = (size_t)N * H * T * T * sizeof(float);
    ck_assert_msg(kept < probs / 8, "the attention's forward kept %zu bytes; its probabilities "
                  "are %zu", kept, probs);
    nb_tensor *r = nbt_randn(ctx, NB_F32, NB_SHAPE(N, T, C), 32);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, y, r)));
    nb_tensor *fused = nb_clone(ctx, qkv->grad);
    /* the composed form: q k^T, the causal softmax, times v, per head */
    qkv->grad = NULL;
    nb_tensor *q = nb_narrow(ctx, qkv, 2, 0, C), *k = nb_narrow(ctx, qkv, 2, C, C),
              *v = nb_narrow(ctx, qkv, 2, 2 * C, C);
    int64_t hs[] = {N, T, H, C / H};
    q = nb_transpose(ctx, nb_reshape(ctx, q, 4, hs), 1, 2); /* (N, H, T, D) */
    k = nb_transpose(ctx, nb_reshape(ctx, k, 4, hs), 1, 2);
    v = nb_transpose(ctx, nb_reshape(ctx, v, 4, hs), 1, 2);
    nb_tensor *att = nb_softmax_causal(ctx, nb_matmul_t(ctx, q, k, false, true), scale);
    nb_tensor *yh = nb_contiguous(ctx, nb_transpose(ctx, nb_matmul(ctx, att, v), 1, 2));
    nb_tensor *yc = nb_reshape(ctx, yh, NB_SHAPE(N, T, C));
    nbt_assert_tensors_close(yc, y, 1e-5, 1e-5);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, yc, r)));
    nbt_assert_tensors_close(fused, qkv->grad, 1e-4, 1e-5);
    nb_ctx_free(ctx);
}
END_TEST

/* ------------------------------------------------------------------ GPT */
typedef struct gpt_run {
    size_t peak, extent;
    float loss[3];
    double logits_sum; /* read after backward */
    float *params;     /* every parameter after the steps, concatenated */
    int64_t n_params;
} gpt_run;

static const nb_gpt_config small = {256, 64, 2, 4, 64, 0.0};
enum { BATCH = 4, SEQ = 64 };

static void tokens(int64_t *idx, int64_t *tgt, int step) {
    for (int i = 0; i < BATCH * SEQ; i++) {
        idx[i] = (i * 7 + step * 13) % small.vocab_size;
        tgt[i] = (i * 11 + step * 5 + 3) % small.vocab_size;
    }
}

static void count_hook(nb_tensor *leaf, void *user) {
    (void)leaf;
    ++*(int *)user;
}

enum { RE_BLOCKS = 1, RE_GELU = 2 }; /* nb_gpt_set_recompute, nb_gpt_set_recompute_gelu */

/* `steps` AdamW steps of a GPT of configuration cfg; the step context gives
 * back or not; the blocks and the GELU outputs are recomputed or not
 * (recompute: RE_* bits). Every gradient-ready hook must fire once per
 * parameter and step. */
static gpt_run gpt_train_ex(const nb_gpt_config *cfg, bool give_back, unsigned recompute,
                            bool fused, int steps) {
    gpt_run r = {0};
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_give_back(step, give_back);
    nb_rng rng = nb_rng_make(7);
    nb_module *g = nb_gpt_new(pctx, NB_F32, cfg, &rng);
    nb_gpt_set_recompute(g, recompute & RE_BLOCKS);
    nb_gpt_set_recompute_gelu(g, recompute & RE_GELU);
    nb_named_tensor p[64];
    int np = nb_module_named_parameters(g, p, 64), fired = 0;
    for (int i = 0; i < np; i++) nb_add_grad_hook(p[i].tensor, count_hook, &fired);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, np, &h);
    int64_t idx[BATCH * SEQ], tgt[BATCH * SEQ];
    for (int s = 0; s < steps; s++) {
        nb_ctx_reset(step);
        tokens(idx, tgt, 0);
        nb_tensor *x = nb_from_host(step, NB_I64, NB_SHAPE(BATCH, SEQ), idx);
        nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(BATCH, SEQ), tgt);
        nb_optim_zero_grad(opt);
        if (fused) { /* the logits are the library's: their gradient takes their place */
            nb_tensor *loss = nb_gpt_forward_loss(g, step, x, y);
            nb_backward(loss);
            r.loss[s] = (float)nb_item(loss);
        } else {
            nb_tensor *logits = nb_gpt_forward(g, step, x);
            nb_tensor *loss = nb_gpt_loss(step, logits, y);
            nb_backward(loss);
            r.loss[s] = (float)nb_item(loss);
            r.logits_sum = nb_item(nb_sum_all(step, logits)); /* the user's: still readable */
        }
        nb_optim_step(opt);
        ck_assert_int_eq(fired, (s + 1) * np);
    }
    r.peak = nb_ctx_peak(step);
    r.extent = nb_ctx_extent(step);
    for (int i = 0; i < np; i++) r.n_params += nb_numel(p[i].tensor);
    r.params = malloc((size_t)r.n_params * sizeof(float));
    int64_t off = 0;
    for (int i = 0; i < np; i++) {
        nb_to_host(p[i].tensor, r.params + off);
        off += nb_numel(p[i].tensor);
    }
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
    return r;
}

static gpt_run gpt_train(bool give_back, int steps) {
    return gpt_train_ex(&small, give_back, false, false, steps);
}

START_TEST(test_gpt_bitwise) {
    gpt_run on = gpt_train(true, 3), off = gpt_train(false, 3);
    ck_assert_int_eq(on.n_params, off.n_params);
    ck_assert(memcmp(on.loss, off.loss, sizeof on.loss) == 0);
    ck_assert(on.logits_sum == off.logits_sum);
    ck_assert_msg(memcmp(on.params, off.params, (size_t)on.n_params * sizeof(float)) == 0,
                  "parameters after 3 steps differ with giving back on and off");
    ck_assert(on.loss[2] < on.loss[0]); /* it trains */
    free(on.params), free(off.params);
}
END_TEST

START_TEST(test_gpt_peak) {
    gpt_run on = gpt_train(true, 2), off = gpt_train(false, 2);
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0);
    nb_module *g = nb_gpt_new(pctx, NB_F32, &small, NULL);
    nb_memory_floor f = nb_gpt_memory_floor(g, BATCH, SEQ, 2);
    size_t floor = f.saved + f.logits;
    ck_assert_msg(on.peak <= 1.3 * floor, "GPT step peak %zu above 1.3 x floor %zu", on.peak,
                  floor);
    ck_assert_msg(on.extent <= 1.3 * floor, "GPT step extent %zu (live bytes and holes) above "
                  "1.3 x floor %zu", on.extent, floor);
    ck_assert_msg(off.peak > 1.3 * floor, "without giving back the peak %zu was expected above "
                  "1.3 x floor %zu: the test would not see a regression", off.peak, floor);
    ck_assert_uint_gt(nb_memory_floor_total(&f), floor); /* parameters, gradients, AdamW state */
    free(on.params), free(off.params);
    nb_ctx_free(pctx);
}
END_TEST


/* Note [Recomputation]: the blocks run again in backward; the same
 * parameters bit for bit after 3 steps, with dropout too (the masks drawn
 * again from the generator's state of the first forward), and a lower peak. */
START_TEST(test_gpt_recompute) {
    nb_gpt_config drop = small;
    drop.dropout = 0.1;
    const nb_gpt_config *cfgs[2] = {&small, &drop};
    for (int c = 0; c < 2; c++) {
        gpt_run plain = gpt_train_ex(cfgs[c], true, false, false, 3);
        gpt_run re = gpt_train_ex(cfgs[c], true, RE_BLOCKS, false, 3);
        ck_assert(memcmp(plain.loss, re.loss, sizeof re.loss) == 0);
        ck_assert_msg(memcmp(plain.params, re.params, (size_t)re.n_params * sizeof(float)) == 0,
                      "parameters differ with recomputation (dropout %g)", cfgs[c]->dropout);
        ck_assert_msg(re.peak < 0.8 * plain.peak, "recomputed peak %zu not below 0.8 x %zu",
                      re.peak, plain.peak);
        free(plain.params), free(re.params);
    }
}
END_TEST

/* Note [GELU recomputed in backward] (tensor/ops_matmul.c): the same
 * losses and parameters bit for bit after 3 steps, with dropout too and
 * with the blocks recomputed. The peak: where it is in the output head's
 * backward (nb_gpt_forward_loss and a vocabulary large beside 4C, as
 * bench_gpt2's GPT-2), lower by exactly
 * each layer's GELU output, (N, T, 4C) f32, which the step no longer
 * keeps; with the blocks recomputed only the recomputed block's GELU
 * output was live at once, and the peak does not rise. */
START_TEST(test_gpt_recompute_gelu) {
    nb_gpt_config big_vocab = small, drop = small;
    big_vocab.vocab_size = 1024;
    drop.vocab_size = 1024;
    drop.dropout = 0.1;
    const nb_gpt_config *cfgs[2] = {&big_vocab, &drop};
    size_t h = (size_t)BATCH * SEQ * 4 * small.n_embd * sizeof(float);
    for (int c = 0; c < 2; c++)
        for (unsigned blocks = 0; blocks <= RE_BLOCKS; blocks += RE_BLOCKS) {
            gpt_run plain = gpt_train_ex(cfgs[c], true, blocks, true, 3);
            gpt_run re = gpt_train_ex(cfgs[c], true, blocks | RE_GELU, true, 3);
            ck_assert(memcmp(plain.loss, re.loss, sizeof re.loss) == 0);
            ck_assert_msg(memcmp(plain.params, re.params, (size_t)re.n_params * sizeof(float)) == 0,
                          "parameters differ with GELU recomputed (dropout %g, blocks %u)",
                          cfgs[c]->dropout, blocks);
            if (blocks)
                ck_assert_msg(re.peak <= plain.peak, "peak %zu, %zu without recomputing GELU",
                              re.peak, plain.peak);
            else
                ck_assert_msg(plain.peak - re.peak == (size_t)small.n_layer * h,
                              "peak %zu, %zu without recomputing GELU: %zu less, %d x %zu expected",
                              re.peak, plain.peak, plain.peak - re.peak, small.n_layer, h);
            free(plain.params), free(re.params);
        }
}
END_TEST

/* nb_gpt_forward_loss: the logits' gradient written over them; the same
 * parameters bit for bit, and the peak lower by at least most of the
 * logits' size. */
START_TEST(test_gpt_forward_loss) {
    gpt_run plain = gpt_train_ex(&small, true, false, false, 3);
    gpt_run fused = gpt_train_ex(&small, true, false, true, 3);
    ck_assert(memcmp(plain.loss, fused.loss, sizeof fused.loss) == 0);
    ck_assert(memcmp(plain.params, fused.params, (size_t)fused.n_params * sizeof(float)) == 0);
    size_t logits = (size_t)(BATCH * SEQ * small.vocab_size) * sizeof(float);
    ck_assert_msg(fused.peak + logits * 3 / 4 <= plain.peak, "peak %zu, %zu without: less than "
                  "3/4 of the logits' %zu bytes saved", fused.peak, plain.peak, logits);
    free(plain.params), free(fused.params);
}
END_TEST

/* ------------------------------------------------------------------ CNN */
/* The CNN with BatchNorm: conv -> BN -> ReLU per block, 2x2 max pooling
 * between blocks, global average pooling, a linear head. */
enum { CN = 8, CIN = 3, CHW = 16, CK = 10 };
static const int64_t cnn_channels[2] = {8, 16};

static size_t cnn_step_peak(bool give_back, float *loss_out) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_give_back(step, give_back);
    nb_rng rng = nb_rng_make(3);
    nb_module *m = nb_cnn_new(pctx, NB_F32, CIN, 2, cnn_channels, CK, &rng);
    nb_tensor *x = nb_rand_normal(step, NB_F32, NB_SHAPE(CN, CIN, CHW, CHW), 0, 1, &rng);
    int64_t y[CN];
    for (int i = 0; i < CN; i++) y[i] = i % CK;
    nb_tensor *t = nb_from_host(step, NB_I64, NB_SHAPE(CN), y);
    size_t before = nb_ctx_used(step);
    nb_tensor *loss = nb_cross_entropy(step, nb_module_forward(m, step, x), t, NULL);
    nb_backward(loss);
    *loss_out = (float)nb_item(loss);
    size_t peak = nb_ctx_peak(step) - before;
    nb_ctx_free(step);
    nb_ctx_free(pctx);
    return peak;
}

/* What backward needs, from the shapes alone: per block the convolution's
 * input, the BatchNorm's input and statistics, the ReLU's output (which
 * the pooling reads too) and the pooling's argmax (i64); then the head's
 * input and the logits. The input batch is the user's and not counted.
 * Plus the working set of the op at the peak: an im2col convolution needs
 * its columns (N, C_in 3 3, H W), the first block's the largest here. */
static size_t cnn_floor(void) {
    size_t f = 4, floor = (size_t)(CN * CIN * 9 * CHW * CHW) * 4;
    int64_t hw = CHW * CHW, cin = CIN;
    for (int b = 0; b < 2; b++) {
        int64_t c = cnn_channels[b];
        if (b > 0) floor += (size_t)(CN * cin * hw) * f; /* conv input (block 0's: the batch) */
        floor += (size_t)(CN * c * hw) * f * 2 + 2 * (size_t)c * f; /* BN input, ReLU output, stats */
        if (b == 0) {
            hw /= 4;
            floor += (size_t)(CN * c * hw) * 8; /* argmax */
        }
        cin = c;
    }
    return floor + (size_t)(CN * cin) * f + (size_t)(CN * CK) * f;
}

START_TEST(test_cnn_peak) {
    float on_loss, off_loss;
    size_t on = cnn_step_peak(true, &on_loss), off = cnn_step_peak(false, &off_loss);
    size_t floor = cnn_floor();
    ck_assert(on_loss == off_loss);
    ck_assert_msg(on <= 1.3 * floor, "CNN step peak %zu above 1.3 x floor %zu (off: %zu)", on,
                  floor, off);
    ck_assert_msg(off > 1.3 * floor, "without giving back the peak %zu was expected above 1.3 x "
                  "floor %zu: the test would not see a regression", off, floor);
}
END_TEST

/* ---------------------------------------------- the user's and the library's */
/* A module that keeps a pointer to a tensor it made (as a user's module
 * might, for inspection): relu(x W^T) then a second product. */
typedef struct peek {
    nb_module *a, *b;
    nb_tensor *hidden;
    bool keep;
} peek;
static nb_tensor *peek_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
static const nb_module_type peek_type = {"Peek", sizeof(peek), peek_forward, NULL};
static nb_tensor *peek_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    peek *p = nb_module_self(m, &peek_type);
    p->hidden = nb_relu(ctx, nb_module_forward(p->a, ctx, x));
    nb_set_name(p->hidden, "hidden");
    if (p->keep) nb_keep(p->hidden);
    return nb_module_forward(p->b, ctx, p->hidden);
}

static nb_module *peek_new(nb_ctx *ctx, bool keep) {
    nb_rng rng = nb_rng_make(1);
    nb_module *m = nb_module_new(ctx, &peek_type);
    peek *p = nb_module_self(m, &peek_type);
    p->a = nb_module_add(m, "a", nb_linear_new(ctx, NB_F32, 4, 8, true, &rng));
    p->b = nb_module_add(m, "b", nb_linear_new(ctx, NB_F32, 8, 2, true, &rng));
    p->keep = keep;
    return m;
}

START_TEST(test_given_back_read) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *m = peek_new(pctx, false);
    nb_rng rng = nb_rng_make(2);
    nb_tensor *x = nb_rand_normal(step, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng);
    nb_tensor *out = nb_module_forward(m, step, x);
    nb_tensor *hidden = ((peek *)nb_module_self(m, &peek_type))->hidden;
    double before = nb_item(nb_sum_all(step, hidden)); /* readable until backward */
    nb_backward(nb_sum_all(step, out));
    /* the module's output and the input are the user's */
    ck_assert(isfinite(nb_item(nb_sum_all(step, out))));
    ck_assert(isfinite(nb_item(nb_sum_all(step, x))));
    /* the hidden activation was given back: read, it is named, never read */
    float buf[24];
    NBT_EXPECT_ABORT(nb_to_host(hidden, buf), "'hidden'");
    ck_assert_ptr_nonnull(strstr(nbt_abort_msg, "given back"));
    ck_assert_ptr_nonnull(strstr(nbt_abort_msg, "nb_keep"));
    ck_assert_ptr_nonnull(strstr(nbt_abort_msg, "made by nb_relu"));
    NBT_EXPECT_ABORT(nb_item(nb_sum_all(step, hidden)), "given back");
    /* kept, the same program reads it after backward */
    nb_ctx_reset(step);
    nb_module *k = peek_new(pctx, true);
    x = nb_rand_normal(step, NB_F32, NB_SHAPE(3, 4), 0, 1, &(nb_rng){0});
    rng = nb_rng_make(2);
    x = nb_rand_normal(step, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng);
    out = nb_module_forward(k, step, x);
    nb_backward(nb_sum_all(step, out));
    hidden = ((peek *)nb_module_self(k, &peek_type))->hidden;
    ck_assert(nb_item(nb_sum_all(step, hidden)) == before); /* same weights, same input */
    /* a forward without gradients gives the hidden activation back at once */
    nb_ctx_reset(step);
    bool prev = nb_set_grad_enabled(false);
    out = nb_module_forward(m, step, nb_rand_normal(step, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng));
    nb_set_grad_enabled(prev);
    hidden = ((peek *)nb_module_self(m, &peek_type))->hidden;
    NBT_EXPECT_ABORT(nb_item(nb_sum_all(step, hidden)), "given back");
    ck_assert(isfinite(nb_item(nb_sum_all(step, out))));
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* retain_graph: a second backward through the same graph adds the same
 * gradients, bitwise those with giving back off; a third, after a
 * backward without it, is refused as before. */
static void retain_grads(bool give_back, float *grads, int64_t *n) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_give_back(step, give_back);
    nb_rng rng = nb_rng_make(5);
    nb_module *g = nb_gpt_new(pctx, NB_F32, &small, &rng);
    int64_t idx[BATCH * SEQ], tgt[BATCH * SEQ];
    tokens(idx, tgt, 0);
    nb_tensor *x = nb_from_host(step, NB_I64, NB_SHAPE(BATCH, SEQ), idx);
    nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(BATCH, SEQ), tgt);
    nb_tensor *loss = nb_gpt_loss(step, nb_gpt_forward(g, step, x), y);
    nb_backward_ex(loss, &(nb_backward_options){.retain_graph = true});
    nb_backward(loss);
    NBT_EXPECT_ABORT(nb_backward(loss), "already walked");
    nb_named_tensor p[64];
    int np = nb_module_named_parameters(g, p, 64);
    *n = 0;
    for (int i = 0; i < np; i++) {
        nb_to_host(p[i].tensor->grad, grads + *n);
        *n += nb_numel(p[i].tensor);
    }
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}

START_TEST(test_retain_graph) {
    enum { MAXP = 200000 };
    float *on = malloc(MAXP * sizeof(float)), *off = malloc(MAXP * sizeof(float));
    int64_t n_on, n_off;
    retain_grads(true, on, &n_on);
    retain_grads(false, off, &n_off);
    ck_assert_int_eq(n_on, n_off);
    ck_assert_int_le(n_on, MAXP);
    ck_assert(memcmp(on, off, (size_t)n_on * sizeof(float)) == 0);
    free(on), free(off);
}
END_TEST

/* Note [Walked graphs]: a second loss over a trunk whose saved tensors the
 * first backward gave back is refused, naming retain_graph. */
START_TEST(test_second_loss_after_give_back) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *m = peek_new(pctx, false);
    nb_rng rng = nb_rng_make(2);
    nb_tensor *out = nb_module_forward(m, step, nb_rand_normal(step, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng));
    nb_backward(nb_sum_all(step, out));
    NBT_EXPECT_ABORT(nb_backward(nb_sum_all(step, nb_mul(step, out, out))), "retain_graph");
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* Note [Growing contexts]: a loop that never resets is told once. */
NBT_CPU_TEST(test_growth_warning) {
    nb_tensor *w = nb_ones(ctx, NB_F32, NB_SHAPE(64));
    nb_set_requires_grad(w, true);
    fflush(stderr);
    FILE *tmp = tmpfile();
    int saved = dup(2);
    dup2(fileno(tmp), 2);
    for (int i = 0; i < 120; i++) nb_backward(nb_sum_all(ctx, nb_mul(ctx, w, w)));
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char text[2048] = {0};
    rewind(tmp);
    size_t got = fread(text, 1, sizeof text - 1, tmp);
    fclose(tmp);
    ck_assert_msg(got > 0 && strstr(text, "keeps growing") && strstr(text, "nb_ctx_reset"),
                  "no growth warning: \"%s\"", text);
    ck_assert_msg(!strstr(strstr(text, "keeps growing") + 1, "keeps growing"),
                  "warned more than once: \"%s\"", text);
    /* reset once per step: no warning */
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);
    tmp = tmpfile();
    saved = dup(2);
    dup2(fileno(tmp), 2);
    for (int i = 0; i < 120; i++) {
        nb_ctx_reset(step);
        nb_backward(nb_sum_all(step, nb_mul(step, w, w)));
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ck_assert_int_eq(ftell(tmp), 0);
    fclose(tmp);
    nb_ctx_free(step);
}

NBT_MAIN("memory", "core", 120,
         test_free_ranges, test_device_totals, test_attention_keeps_no_probabilities, test_gpt_bitwise, test_gpt_peak, test_gpt_recompute,
         test_gpt_recompute_gelu,
         test_gpt_forward_loss, test_cnn_peak, test_given_back_read, test_retain_graph,
         test_second_loss_after_give_back, test_growth_warning)
