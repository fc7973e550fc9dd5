/* Memory given back within a step (Note [Memory given back] in
 * tensor/memory.c): the step context's peak against the floor computed
 * from the model's shape, training bitwise equal with giving back on and
 * off, the message for a tensor read after it was given back, nb_keep,
 * retain_graph, and the arena's free ranges. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* `steps` AdamW steps of the GPT above; the step context gives back or not. */
static gpt_run gpt_train(bool give_back, int steps) {
    gpt_run r = {0};
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_give_back(step, give_back);
    nb_rng rng = nb_rng_make(7);
    nb_module *g = nb_gpt_new(pctx, NB_F32, &small, &rng);
    nb_named_tensor p[64];
    int np = nb_module_named_parameters(g, p, 64);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, np, &h);
    int64_t idx[BATCH * SEQ], tgt[BATCH * SEQ];
    for (int s = 0; s < steps; s++) {
        nb_ctx_reset(step);
        tokens(idx, tgt, 0);
        nb_tensor *x = nb_from_host(step, NB_I64, NB_SHAPE(BATCH, SEQ), idx);
        nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(BATCH, SEQ), tgt);
        nb_optim_zero_grad(opt);
        nb_tensor *logits = nb_gpt_forward(g, step, x);
        nb_tensor *loss = nb_gpt_loss(step, logits, y);
        nb_backward(loss);
        r.loss[s] = (float)nb_item(loss);
        r.logits_sum = nb_item(nb_sum_all(step, logits)); /* the user's: still readable */
        nb_optim_step(opt);
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
    printf("peak on %zu extent %zu off %zu floor %zu (saved %zu logits %zu) total %zu\n", on.peak,
           on.extent, off.peak, floor, f.saved, f.logits, nb_memory_floor_total(&f));
    ck_assert_msg(on.peak <= 1.3 * floor, "peak %zu above 1.3 x floor %zu", on.peak, floor);
    free(on.params), free(off.params);
    nb_ctx_free(pctx);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("memory");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_free_ranges);
    tcase_add_test(tc, test_gpt_bitwise);
    tcase_add_test(tc, test_gpt_peak);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return nbt_run(suite()); }
