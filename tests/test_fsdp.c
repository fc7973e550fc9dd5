/* ZeRO-3 / FSDP (nabla/fsdp.h) on Gloo: CTest runs it under nbrun with 2, 3
 * and 4 ranks, and alone as a world of one.
 *
 * The reference is plain DDP on a second copy of the same model (same seed,
 * the same per-rank batches), stepped by nb_optim_step. The sharded path
 * averages each gradient element by a reduce-scatter instead of an
 * all-reduce and adds the ranks in another order, and a unit's forward runs
 * again during backward (bitwise the first: Note [Recomputation]), so
 * values are compared within tolerances: losses within 1e-5 relative after
 * 20 AdamW steps, gradients within 1e-6 (read as one SGD step of learning
 * rate 1 from the same parameters). Memory: the state a rank holds between
 * steps (nb_fsdp_state_bytes) against DDP's (nb_ddp_state_bytes), and the
 * step context's peak against DDP's plus one unit's gathered parameters,
 * that bound worked out from the model's shapes here. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_common.h"
#include "nabla/fsdp.h"
#include "nabla/models.h"

/* A GPT small enough for seconds: V 23, block 16, 2 layers, 2 heads, width 16. */
#define T_SEQ 16
#define B_ROWS 4
static const nb_gpt_config CFG = {23, T_SEQ, 2, 2, 16, 0.0};

static nb_module *tiny_gpt(nb_ctx *ctx) {
    nb_rng rng = nb_rng_make(5);
    return nb_gpt_new(ctx, NB_F32, &CFG, &rng);
}

/* Rank me's batch at step `it`: tokens and next-token targets. */
static void batch(nb_ctx *ctx, int it, nb_tensor **idx, nb_tensor **tgt) {
    int64_t tok[B_ROWS * (T_SEQ + 1)];
    uint64_t s = 1000003u * (uint64_t)(it + 1) + 7919u * (uint64_t)me;
    for (int b = 0; b < B_ROWS; b++) { /* a random start, then t -> 3t + 1 mod V: learnable */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tok[b * (T_SEQ + 1)] = (int64_t)((s >> 33) % (uint64_t)CFG.vocab_size);
        for (int t = 1; t <= T_SEQ; t++)
            tok[b * (T_SEQ + 1) + t] = (3 * tok[b * (T_SEQ + 1) + t - 1] + 1) % CFG.vocab_size;
    }
    int64_t in[B_ROWS * T_SEQ], out[B_ROWS * T_SEQ];
    for (int b = 0; b < B_ROWS; b++)
        for (int t = 0; t < T_SEQ; t++) {
            in[b * T_SEQ + t] = tok[b * (T_SEQ + 1) + t];
            out[b * T_SEQ + t] = tok[b * (T_SEQ + 1) + t + 1];
        }
    *idx = nb_from_host(ctx, NB_I64, NB_SHAPE(B_ROWS, T_SEQ), in);
    *tgt = nb_from_host(ctx, NB_I64, NB_SHAPE(B_ROWS, T_SEQ), out);
}

static bool KEEP; /* keep_gathered for the wrappers fsdp_wrap makes */
static bool GELU; /* nb_gpt_set_recompute_gelu on the FSDP side (DDP's keeps GELU's output) */

static nb_fsdp *fsdp_wrap(nb_module *m) {
    nb_fsdp *f = NULL;
    nb_fsdp_options o = NB_FSDP_DEFAULTS;
    o.keep_gathered = KEEP;
    nb_status st = nb_fsdp_new(&f, m, world, &o);
    ck_assert_msg(st == NB_OK, "nb_fsdp_new: %s", nb_last_error());
    return f;
}

static nb_optim *optim_of(nb_module *m, nb_optim_kind kind, double lr) {
    int n = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *p = malloc(sizeof *p * (size_t)n);
    nb_module_named_parameters(m, p, n);
    nb_optim_hparams h = kind == NB_OPTIM_SGD ? NB_SGD_DEFAULTS : NB_ADAMW_DEFAULTS;
    h.lr = lr;
    nb_optim *o = nb_optim_new(kind, p, n, &h);
    free(p);
    return o;
}

/* The mean over ranks of x. */
static double mean_over_ranks(double x) {
    nb_ctx *c = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t = nb_from_host(c, NB_F64, NB_SHAPE(1), &x);
    ck_assert_int_eq(nb_work_finish(nb_pg_all_reduce(world, t, NB_REDUCE_AVG)), NB_OK);
    double v = nb_item(t);
    nb_ctx_free(c);
    return v;
}

/* One step of each; returns the mean loss over ranks (DDP's in *ref). */
static double step_both(nb_ddp *ddp, nb_optim *ropt, nb_ctx *rstep, nb_fsdp *f, nb_ctx *step, int it,
                        double *ref) {
    nb_tensor *idx, *tgt, *logits;
    nb_ctx_reset(rstep);
    batch(rstep, it, &idx, &tgt);
    nb_tensor *rl = nb_gpt_loss(rstep, ddp_fwd(ddp, rstep, idx), tgt);
    ck_assert_int_eq(nb_ddp_backward(ddp, rl), NB_OK);
    nb_optim_step(ropt);
    nb_optim_zero_grad(ropt);
    *ref = mean_over_ranks(nb_item(rl));

    nb_ctx_reset(step);
    batch(step, it, &idx, &tgt);
    ck_assert_msg(nb_fsdp_forward(f, step, idx, &logits) == NB_OK, "nb_fsdp_forward: %s", nb_last_error());
    nb_tensor *l = nb_gpt_loss(step, logits, tgt);
    ck_assert_msg(nb_fsdp_backward(f, l) == NB_OK, "nb_fsdp_backward: %s", nb_last_error());
    ck_assert_int_eq(nb_fsdp_step(f), NB_OK);
    return mean_over_ranks(nb_item(l));
}

/* A model under FSDP beside an identical one under DDP, each with its
 * optimizer (of `kind`, learning rate lr) and its step context; the FSDP
 * side's optimizer is attached when `attach`. */
typedef struct pair {
    nb_ctx *pa, *pb, *step, *rstep;
    nb_module *m, *ref;
    nb_ddp *ddp;
    nb_optim *opt, *ropt;
    nb_fsdp *f;
} pair;

static pair pair_new(nb_optim_kind kind, double lr, bool attach) {
    pair p = {.pa = nb_ctx_new(nb_cpu(), 0), .pb = nb_ctx_new(nb_cpu(), 0), .step = nb_ctx_new(nb_cpu(), 0),
              .rstep = nb_ctx_new(nb_cpu(), 0)};
    p.m = tiny_gpt(p.pa);
    p.ref = tiny_gpt(p.pb);
    nb_gpt_set_recompute_gelu(p.m, GELU);
    p.ddp = ddp_wrap(p.ref, NULL, -1);
    p.ropt = optim_of(p.ref, kind, lr);
    p.opt = optim_of(p.m, kind, lr);
    p.f = fsdp_wrap(p.m);
    if (attach) ck_assert_int_eq(nb_fsdp_set_optimizer(p.f, p.opt), NB_OK);
    return p;
}

static void pair_free(pair *p) {
    nb_fsdp_free(p->f);
    nb_ddp_free(p->ddp);
    nb_optim_free(p->opt);
    nb_optim_free(p->ropt);
    nb_ctx_free(p->step);
    nb_ctx_free(p->rstep);
    nb_ctx_free(p->pa);
    nb_ctx_free(p->pb);
}

/* 20 AdamW steps: the same losses as DDP's, step by step, within 1e-5
 * relative; then the parameters, gathered whole, close to DDP's. */
static void loss_matches_ddp(void) {
    pair p = pair_new(NB_OPTIM_ADAMW, 1e-2, true);
    ck_assert_int_eq(nb_fsdp_num_units(p.f), CFG.n_layer); /* the blocks; the rest is the root */
    double first = 0, last = 0, rlast = 0;
    for (int it = 0; it < 20; it++) {
        double r, l = step_both(p.ddp, p.ropt, p.rstep, p.f, p.step, it, &r);
        ck_assert_msg(fabs(l - r) <= 1e-5 * fabs(r), "rank %d of %d, step %d: loss %.9g, DDP's %.9g", me, R,
                      it + 1, l, r);
        if (it == 0) first = l;
        last = l, rlast = r;
    }
    ck_assert_msg(last < first - 0.1, "the loss did not go down: %g -> %g", first, last);
    printf("rank %d of %d: loss after 20 steps %.9g, DDP's %.9g\n", me, R, last, rlast);
    ck_assert_int_eq(nb_fsdp_gather_full(p.f), NB_OK);
    assert_models_match(p.m, p.ref, 1e-3, 1.0); /* a key bias, whose gradient is rounding noise, moves by Adam's lr either way */
    ck_assert_int_eq(nb_fsdp_consolidate_optimizer(p.f, -1), NB_OK); /* the whole state, as DDP's optimizer holds it */
    assert_optim_states_match(p.opt, p.ropt, 1e-2, 1e-6);
    pair_free(&p);
}

START_TEST(test_loss_matches_ddp) {
    KEEP = false;
    loss_matches_ddp();
}
END_TEST

/* The same with each unit kept gathered from its forward to its backward. */
START_TEST(test_loss_matches_ddp_kept) {
    KEEP = true;
    loss_matches_ddp();
    KEEP = false;
}
END_TEST

/* Gradients: one SGD step of learning rate 1 from the same parameters moves
 * each parameter by minus its averaged gradient; both paths' moves agree
 * within 1e-6, and they are not all zero. */
static void gradients_match_ddp(void) {
    pair p = pair_new(NB_OPTIM_SGD, 1.0, true);
    nb_ctx *pc = nb_ctx_new(nb_cpu(), 0);
    nb_module *init = tiny_gpt(pc);
    double r;
    step_both(p.ddp, p.ropt, p.rstep, p.f, p.step, 3, &r);
    ck_assert_int_eq(nb_fsdp_gather_full(p.f), NB_OK);
    nb_named_tensor a[64], b[64], c[64];
    int n = nb_module_named_parameters(p.m, a, 64);
    ck_assert_int_eq(nb_module_named_parameters(p.ref, b, 64), n);
    nb_module_named_parameters(init, c, 64);
    double biggest = 0;
    for (int i = 0; i < n; i++) {
        int64_t k = nb_numel(a[i].tensor);
        float *va = malloc(sizeof(float) * (size_t)k), *vb = malloc(sizeof(float) * (size_t)k),
              *vc = malloc(sizeof(float) * (size_t)k);
        nb_to_host(a[i].tensor, va);
        nb_to_host(b[i].tensor, vb);
        nb_to_host(c[i].tensor, vc);
        for (int64_t j = 0; j < k; j++) {
            double ga = (double)vc[j] - va[j], gb = (double)vc[j] - vb[j];
            ck_assert_msg(fabs(ga - gb) <= 1e-6, "rank %d of %d: %s[%lld]: gradient %.9g, DDP's %.9g", me, R,
                          a[i].name, (long long)j, ga, gb);
            if (fabs(gb) > biggest) biggest = fabs(gb);
        }
        free(va);
        free(vb);
        free(vc);
    }
    ck_assert_msg(biggest > 1e-3, "no parameter moved (largest gradient %g)", biggest);
    pair_free(&p);
    nb_ctx_free(pc);
}

START_TEST(test_gradients_match_ddp) {
    KEEP = false;
    gradients_match_ddp();
}
END_TEST

START_TEST(test_gradients_match_ddp_kept) {
    KEEP = true;
    gradients_match_ddp();
    KEEP = false;
}
END_TEST

/* The same with the FSDP side's GELU outputs made again in backward (Note
 * [GELU recomputed in backward] in tensor/ops_matmul.c), inside each
 * unit's recomputed forward, and with the units kept gathered. */
START_TEST(test_gradients_match_ddp_recompute_gelu) {
    GELU = true;
    for (int keep = 0; keep < 2; keep++) {
        KEEP = keep;
        gradients_match_ddp();
    }
    KEEP = GELU = false;
}
END_TEST

/* Bytes of block 0's parameters (a unit), from the configuration: two
 * layer norms (2C each), the attention's QKV (3C x C + 3C) and projection
 * (C x C + C), the MLP's (4C x C + 4C, C x 4C + C); f32. */
static size_t unit_bytes(void) {
    int64_t C = CFG.n_embd;
    return (size_t)(4 * C + 3 * C * C + 3 * C + C * C + C + 4 * C * C + 4 * C + 4 * C * C + C) * sizeof(float);
}

/* Memory: the state held between steps, and the step context's peak. */
START_TEST(test_memory) {
    KEEP = false; /* the bound is the default's: one unit gathered at a time (and the prefetched one) */
    nb_ctx *pm = nb_ctx_new(nb_cpu(), 0);
    nb_named_tensor blk[32];
    nb_module *shapes = tiny_gpt(pm);
    int nb = nb_module_named_parameters(nb_module_child_at(nb_module_child(shapes, "transformer.h"), 0), blk, 32);
    size_t counted = 0;
    for (int i = 0; i < nb; i++) counted += (size_t)nb_numel(blk[i].tensor) * sizeof(float);
    ck_assert_uint_eq(counted, unit_bytes()); /* the formula holds the model's shapes */
    nb_ctx_free(pm);
    pair p = pair_new(NB_OPTIM_ADAMW, 1e-3, true);
    nb_ctx *step = p.step, *rstep = p.rstep;
    double r;
    for (int it = 0; it < 2; it++) step_both(p.ddp, p.ropt, rstep, p.f, step, it, &r);
    size_t mine = nb_fsdp_state_bytes(p.f, p.opt), dp = nb_ddp_state_bytes(p.ddp, p.ropt);
    printf("rank %d of %d: state_bytes ZeRO-3 %zu, DDP %zu (%.3fx); step peak ZeRO-3 %zu, DDP %zu, one unit %zu\n",
           me, R, mine, dp, (double)mine / (double)dp, nb_ctx_peak(step), nb_ctx_peak(rstep), unit_bytes());
    /* 1/R of everything, plus each unit's padding (at most 16 elements per
     * parameter and R - 1 per unit) */
    ck_assert_msg((double)mine <= (double)dp / R + 4.0 * 4 * (16 * 20 + R), "rank %d: %zu bytes, DDP's %zu / %d",
                  me, mine, dp, R);
    if (R == 4) ck_assert_msg((double)mine <= 0.3 * (double)dp, "%zu > 0.3 x %zu", mine, dp);
    ck_assert_msg(nb_ctx_peak(step) <= nb_ctx_peak(rstep) + unit_bytes(),
                  "rank %d: the step's peak %zu is more than DDP's %zu plus one unit (%zu)", me,
                  nb_ctx_peak(step), nb_ctx_peak(rstep), unit_bytes());
    pair_free(&p);
}
END_TEST

/* A sharded parameter read outside its unit is refused by name; made whole,
 * it reads as DDP's; clipping agrees with DDP's norm. */
START_TEST(test_refusals_and_clip) {
    KEEP = false;
    pair pr = pair_new(NB_OPTIM_ADAMW, 1e-3, false);
    nb_ctx *step = pr.step, *rstep = pr.rstep;
    nb_module *m = pr.m, *ref = pr.ref;
    nb_ddp *ddp = pr.ddp;
    nb_optim *opt = pr.opt, *ropt = pr.ropt;
    nb_fsdp *f = pr.f;
    nb_named_tensor p[64];
    nb_module_named_parameters(m, p, 64);
    NBT_EXPECT_ABORT(nb_mul_scalar(step, p[0].tensor, 2.0), "is sharded over the ranks (ZeRO-3");
    ck_assert_int_eq(nb_fsdp_set_optimizer(f, opt), NB_OK);
    NBT_EXPECT_STATUS(nb_fsdp_set_optimizer(f, opt), NB_ERR_INVALID, "attached already");
    NBT_EXPECT_ABORT(nb_optim_step(opt), "sharded");
    nb_tensor *idx, *tgt, *logits;
    batch(rstep, 0, &idx, &tgt);
    ck_assert_int_eq(nb_ddp_backward(ddp, nb_gpt_loss(rstep, ddp_fwd(ddp, rstep, idx), tgt)), NB_OK);
    double rnorm = nb_clip_grad_norm(p, 0, 0.01, 2.0); /* on no parameter: 0 */
    ck_assert(rnorm == 0);
    nb_named_tensor q[64];
    int n = nb_module_named_parameters(ref, q, 64);
    rnorm = nb_clip_grad_norm(q, n, 0.01, 2.0);
    batch(step, 0, &idx, &tgt);
    ck_assert_int_eq(nb_fsdp_forward(f, step, idx, &logits), NB_OK);
    ck_assert_int_eq(nb_fsdp_backward(f, nb_gpt_loss(step, logits, tgt)), NB_OK);
    ck_assert_ptr_null(p[0].tensor->grad);
    double norm;
    ck_assert_int_eq(nb_fsdp_clip_grad_norm(f, 0.01, 2.0, &norm), NB_OK);
    ck_assert_msg(fabs(norm - rnorm) <= 1e-5 * rnorm, "norm %.9g, DDP's %.9g", norm, rnorm);
    ck_assert_int_eq(nb_fsdp_step(f), NB_OK);
    nb_optim_step(ropt);
    ck_assert_int_eq(nb_fsdp_gather_full(f), NB_OK);
    assert_models_close(m, ref, 1e-5);
    pair_free(&pr);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_loss_matches_ddp, test_gradients_match_ddp, test_loss_matches_ddp_kept,
                             test_gradients_match_ddp_kept, test_gradients_match_ddp_recompute_gelu,
                             test_memory, test_refusals_and_clip, NULL};
    return nbt_suite("fsdp", "fsdp", 120, tests);
}

int main(void) { return nbt_run_world(ddp_setup); }
