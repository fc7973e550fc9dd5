/* ZeRO-1 (nb_ddp_set_zero): optimizer state sharded over R ranks, on Gloo
 * (CTest runs it under nbrun with 2 and 3 ranks, and alone as a world of
 * one, where nothing is sharded). With NBT_ZERO_STAGE=2 (CTest's
 * test_ddp_zero2*) every sharded wrapper runs ZeRO-2 instead, gradients
 * sharded too: the same results are asserted against the same references,
 * and after each synchronised backward every parameter's gradient memory
 * must be gone (->grad NULL) and nb_ddp_state_bytes count only the shards.
 *
 * The reference is plain DDP on a second copy of the model (its own
 * wrapper, nb_ddp_backward, nb_optim_step) or, for checkpoints written or
 * read at another world size, one process training on the whole global
 * batch. Equality: the sharded path averages each gradient element by a
 * reduce-scatter instead of an all-reduce; with two ranks both add the same
 * two numbers and halve them, so parameters and state are the same bits
 * (asserted; this relies on the update being element-wise with the same
 * arithmetic wherever a piece starts, Note [Optimizer step], e.g. no
 * contraction into FMA in a vector body but not in its tail); with three
 * the two collectives may add in different orders
 * (one rounding of f64 per element per step), and the one-process
 * reference averages per-sample losses in another order, so parameters and
 * state are compared within RTOL of their largest element (f64 models:
 * that is thousands of roundings of headroom, and far below the changes a
 * missing or doubled update makes). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_common.h"
#include "nabla/checkpoint.h"

#define RTOL 1e-9

static int STAGE = 1; /* NBT_ZERO_STAGE */

static nb_status zero_on(nb_ddp *ddp, nb_optim *opt) { return nb_ddp_set_zero_stage(ddp, opt, STAGE); }

/* After a synchronised backward under ZeRO-2 with buckets, no parameter
 * holds gradient memory; under ZeRO-1 all do. */
static void assert_grads_held(nb_module *m) {
    nb_named_tensor p[64];
    int n = nb_module_named_parameters(m, p, 64);
    bool gone = STAGE == 2 && R > 1;
    for (int i = 0; i < n; i++)
        ck_assert_msg((p[i].tensor->grad == NULL) == gone, "rank %d, stage %d: %s's gradient %s", me, STAGE,
                      p[i].name, gone ? "is still held" : "is gone");
}

typedef enum cfg { C_ADAMW, C_SGD_NESTEROV, C_SGD_PLAIN, C_ADAM_AMSGRAD, C_GROUPS } cfg;

/* The model wrapped in DDP with several buckets, so shards cut across parameters. */
static nb_ddp *wrap(nb_module *m) {
    nb_ddp_options o = small_buckets(256, 700);
    return ddp_wrap(m, &o, 2);
}

static nb_optim *optim_for(nb_module *m, int c) {
    int n = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *p = malloc(sizeof *p * (size_t)n), *scratch = malloc(sizeof *p * (size_t)n);
    nb_module_named_parameters(m, p, n);
    nb_optim *o = NULL;
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    switch ((cfg)c) {
    case C_ADAMW: o = nb_optim_new(NB_OPTIM_ADAMW, p, n, &h); break;
    case C_ADAM_AMSGRAD:
        h = NB_ADAM_DEFAULTS;
        h.amsgrad = true;
        h.weight_decay = 1e-3;
        o = nb_optim_new(NB_OPTIM_ADAM, p, n, &h);
        break;
    case C_SGD_NESTEROV:
    case C_SGD_PLAIN:
        h = NB_SGD_DEFAULTS;
        h.weight_decay = 1e-3;
        if (c == C_SGD_NESTEROV) {
            h.momentum = 0.9;
            h.nesterov = true;
        }
        o = nb_optim_new(NB_OPTIM_SGD, p, n, &h);
        break;
    case C_GROUPS: {
        nb_param_group g[2];
        h.weight_decay = 0.1;
        nb_optim_split_decay(p, n, &h, scratch, g);
        g[1].h.amsgrad = true; /* the groups differ in lr (set per step), decay and amsgrad */
        o = nb_optim_new_groups(NB_OPTIM_ADAMW, 2, g);
        break;
    }
    }
    free(p);
    free(scratch);
    return o;
}

static void set_lrs(nb_optim *o, int it) {
    for (int g = 0; g < nb_optim_group_count(o); g++) nb_optim_set_lr(o, g, 0.02 / (1 + it) / (1 + g));
}

/* a's parameters and buffers against b's: within RTOL of b's largest
 * element, or the same bits when `exact`. */
static void assert_models(nb_module *a, nb_module *b, bool exact) {
    assert_models_match(a, b, exact ? 0 : RTOL, 1e-300);
}

/* opt's whole state (consolidated on every rank) against ref's. */
static void assert_states(nb_ddp *ddp, nb_optim *opt, nb_optim *ref, bool exact) {
    ck_assert_int_eq(nb_ddp_consolidate_optimizer(ddp, -1), NB_OK);
    assert_optim_states_match(opt, ref, exact ? 0 : RTOL, 1e-300);
}

/* `steps` steps of `accum` micro-batches (all but the last under no_sync),
 * sharded on one copy and plain DDP on the other; with clip > 0 both clip
 * to that global norm (norm_type clip_type) and the norms must agree. */
static void run_equivalence(cfg c, int steps, int accum, double clip, double clip_type) {
    ddp_pair p = ddp_pair_wrapped(wrap, optim_for, c, true);
    ck_assert_int_eq(zero_on(p.ddp, p.opt), NB_OK);
    ck_assert_ptr_eq(nb_ddp_zero_optimizer(p.ddp), p.opt);
    ck_assert_int_eq(nb_ddp_zero_stage(p.ddp), STAGE);
    bool exact = R <= 2;
    int clipped = 0;
    for (int it = 0; it < steps; it++) {
        set_lrs(p.opt, it);
        set_lrs(p.ropt, it);
        for (int k = 0; k < accum; k++) {
            nb_ctx_reset(p.step);
            bool last = k == accum - 1;
            nb_ddp_set_no_sync(p.ddp, !last);
            nb_ddp_set_no_sync(p.rddp, !last);
            ck_assert_int_eq(nb_ddp_backward(p.ddp, loss_of(p.step, p.m, it, k, false)), NB_OK);
            ck_assert_int_eq(nb_ddp_backward(p.rddp, loss_of(p.step, p.ref, it, k, false)), NB_OK);
        }
        assert_grads_held(p.m);
        if (R > 1) { /* the reduce-scatters start during backward, as the all-reduces do */
            nb_ddp_step_stats st = nb_ddp_last_stats(p.ddp);
            ck_assert_int_eq(st.n_buckets, nb_ddp_num_buckets(p.ddp));
            ck_assert_int_ge(st.launched_before_end, 1);
        }
        if (clip > 0) {
            double norm = 0, rnorm = 0;
            ck_assert_int_eq(nb_ddp_clip_grad_norm(p.ddp, clip, clip_type, &norm), NB_OK);
            ck_assert_int_eq(nb_ddp_clip_grad_norm(p.rddp, clip, clip_type, &rnorm), NB_OK);
            /* the reference norm, independently: nb_clip_grad_norm is what plain DDP users call */
            ck_assert_msg(fabs(norm - rnorm) <= 1e-12 * rnorm, "rank %d: norm %.17g vs %.17g", me,
                          norm, rnorm);
            clipped += rnorm > clip;
        }
        ck_assert_int_eq(nb_ddp_step(p.ddp), NB_OK);
        nb_optim_step(p.ropt);
        ck_assert_int_eq(nb_optim_step_count(p.opt), it + 1);
        assert_models(p.m, p.ref, exact && clip == 0);
        assert_states(p.ddp, p.opt, p.ropt, exact && clip == 0);
        nb_optim_zero_grad(p.opt);
        nb_optim_zero_grad(p.ropt);
    }
    if (clip > 0) ck_assert_int_gt(clipped, 0); /* the clipping did something */
    assert_same_on_all_ranks(p.m);
    /* the parameters moved */
    assert_params_moved(p.m, deep_mlp(p.pctx));
    ck_assert_int_eq(nb_ddp_set_zero(p.ddp, NULL), NB_OK);
    ck_assert_ptr_null(nb_ddp_zero_optimizer(p.ddp));
    ddp_pair_free(&p);
}

START_TEST(test_adamw) { run_equivalence(C_ADAMW, 5, 1, 0, 2); }
END_TEST
START_TEST(test_sgd_nesterov) { run_equivalence(C_SGD_NESTEROV, 5, 1, 0, 2); }
END_TEST
START_TEST(test_sgd_plain) { run_equivalence(C_SGD_PLAIN, 4, 1, 0, 2); }
END_TEST
START_TEST(test_adam_amsgrad) { run_equivalence(C_ADAM_AMSGRAD, 5, 1, 0, 2); }
END_TEST
START_TEST(test_two_groups) { run_equivalence(C_GROUPS, 5, 1, 0, 2); }
END_TEST
START_TEST(test_no_sync) { run_equivalence(C_ADAMW, 3, 3, 0, 2); }
END_TEST
START_TEST(test_clip_l2) { run_equivalence(C_ADAMW, 4, 1, 0.05, 2); }
END_TEST
START_TEST(test_clip_inf) { run_equivalence(C_SGD_NESTEROV, 4, 1, 0.01, INFINITY); }
END_TEST

/* The averaged gradients themselves, against plain DDP's: the sharded
 * path keeps them only in its shards, so they are read through a step of
 * SGD with learning rate 1 and nothing else (p' = p - g): g = p - p' on
 * every element of the model (the all-gather brings every rank's part),
 * compared with the reference wrapper's ->grad after the same backward
 * within 1e-6 of the largest |g| (the subtraction's rounding is ~1e-16 of
 * |p|). Two steps, so the second runs on the rebuilt buckets. */
DDP_TEST(test_gradients) {
    nb_module *m = deep_mlp(pctx), *ref = deep_mlp(pctx);
    nb_ddp *ddp = wrap(m), *rddp = wrap(ref);
    nb_named_tensor p[64], rp[64];
    int n = nb_module_named_parameters(m, p, 64);
    ck_assert_int_eq(nb_module_named_parameters(ref, rp, 64), n);
    nb_optim_hparams h = NB_SGD_DEFAULTS;
    h.lr = 1;
    h.weight_decay = 0;
    h.momentum = 0;
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, p, n, &h);
    ck_assert_int_eq(zero_on(ddp, opt), NB_OK);
    for (int it = 0; it < 2; it++) {
        nb_ctx_reset(step);
        nb_tensor *before[64];
        for (int i = 0; i < n; i++) before[i] = nb_clone(step, p[i].tensor);
        ck_assert_int_eq(nb_ddp_backward(ddp, loss_of(step, m, it, 0, false)), NB_OK);
        ck_assert_int_eq(nb_ddp_backward(rddp, loss_of(step, ref, it, 0, false)), NB_OK);
        ck_assert_int_eq(nb_ddp_step(ddp), NB_OK);
        double gmax = 0, worst = 0;
        for (int i = 0; i < n; i++) {
            int64_t k = nb_numel(p[i].tensor);
            double *b = malloc(sizeof *b * (size_t)k), *a = malloc(sizeof *a * (size_t)k), *g = malloc(sizeof *g * (size_t)k);
            nb_to_host(before[i], b);
            nb_to_host(p[i].tensor, a);
            nb_to_host(rp[i].tensor->grad, g);
            for (int64_t j = 0; j < k; j++) {
                gmax = fmax(gmax, fabs(g[j]));
                worst = fmax(worst, fabs((b[j] - a[j]) - g[j]));
            }
            free(b);
            free(a);
            free(g);
        }
        ck_assert_msg(gmax > 0, "rank %d: the reference gradients are all zero", me);
        ck_assert_msg(worst <= 1e-6 * gmax, "rank %d, stage %d, step %d: a gradient differs from plain DDP's by %g "
                      "(largest |g| %g)", me, STAGE, it, worst, gmax);
        /* the reference follows with the same plain step */
        for (int i = 0; i < n; i++) nb_axpy_(rp[i].tensor, -1.0, rp[i].tensor->grad);
        nb_optim_zero_grad(opt);
        for (int i = 0; i < n; i++) nb_zero_grad(rp[i].tensor);
    }
    ck_assert_int_eq(nb_ddp_set_zero(ddp, NULL), NB_OK);
    nb_ddp_free(ddp);
    nb_ddp_free(rddp);
    nb_optim_free(opt);
}

/* Bytes of state per rank: the rank's share of each bucket, counted here
 * from the bucket lists and the parameters' sizes. */
DDP_TEST(test_state_bytes) {
    nb_module *m = deep_mlp(pctx);
    nb_ddp *ddp = wrap(m);
    nb_optim *opt = optim_for(m, C_GROUPS); /* 2 moments, 3 in the amsgrad group */
    int n = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *p = malloc(sizeof *p * (size_t)n);
    nb_module_named_parameters(m, p, n);
    size_t full = 0;
    for (int i = 0; i < n; i++) full += (size_t)nb_numel(p[i].tensor) * 8 * (p[i].tensor->ndim >= 2 ? 2 : 3);
    ck_assert_uint_eq(nb_optim_state_bytes(opt), full);
    size_t param_bytes = 0;
    for (int i = 0; i < n; i++) param_bytes += (size_t)nb_numel(p[i].tensor) * 8;
    /* plain DDP: parameters, gradients (the buckets; a world of one has
     * none before its first backward), the whole state */
    ck_assert_uint_eq(nb_ddp_state_bytes(ddp, opt), (R > 1 ? 2 : 1) * param_bytes + full);
    ck_assert_int_eq(zero_on(ddp, opt), NB_OK);
    for (int round = 0; round < 2; round++) { /* before and after the bucket rebuild */
        size_t expect = R == 1 ? full : 0; /* a world of one has no buckets: nothing sharded */
        for (int b = 0; b < nb_ddp_num_buckets(ddp); b++) {
            int idx[64];
            int k = nb_ddp_bucket_params(ddp, b, idx, 64);
            int64_t numel = 0;
            for (int j = 0; j < k; j++) numel += nb_numel(p[idx[j]].tensor);
            int64_t chunk = (numel + R - 1) / R, lo = me * chunk, hi = lo + chunk, at = 0;
            for (int j = 0; j < k; j++) {
                const nb_tensor *t = p[idx[j]].tensor;
                int64_t a = at > lo ? at : lo, e = at + nb_numel(t) < hi ? at + nb_numel(t) : hi;
                if (e > a) expect += (size_t)(e - a) * 8 * (t->ndim >= 2 ? 2 : 3);
                at += nb_numel(t);
            }
        }
        ck_assert_uint_eq(nb_optim_state_bytes(opt), expect);
        if (R > 1) { /* about 1/R: the padding is at most R - 1 elements per bucket */
            size_t slack = (size_t)nb_ddp_num_buckets(ddp) * (size_t)R * 3 * 8;
            ck_assert_uint_le(nb_optim_state_bytes(opt), full / (size_t)R + slack);
        }
        /* the shares add up to the whole */
        nb_tensor *sum = nb_full(step, NB_I64, 0, NULL, (double)nb_optim_state_bytes(opt));
        ck_assert_int_eq(nb_work_finish(nb_pg_all_reduce(world, sum, NB_REDUCE_SUM)), NB_OK);
        ck_assert_int_eq((int64_t)nb_item(sum), (int64_t)full);
        ck_assert_int_eq(nb_ddp_backward(ddp, loss_of(step, m, round, 0, false)), NB_OK);
        /* gradient memory: ZeRO-1 keeps the buckets (padded to chunk * R) and
         * the shards (chunk), ZeRO-2 the shards only; a world of one the gradients */
        size_t grads = R == 1 ? param_bytes : 0;
        for (int b = 0; R > 1 && b < nb_ddp_num_buckets(ddp); b++) {
            int idx[64];
            int k = nb_ddp_bucket_params(ddp, b, idx, 64);
            int64_t numel = 0;
            for (int j = 0; j < k; j++) numel += nb_numel(p[idx[j]].tensor);
            int64_t chunk = (numel + R - 1) / R;
            grads += (size_t)chunk * 8 * (STAGE == 2 ? 1 : (size_t)R + 1);
        }
        ck_assert_uint_eq(nb_ddp_state_bytes(ddp, opt), param_bytes + grads + expect);
        assert_grads_held(m);
        ck_assert_int_eq(nb_ddp_step(ddp), NB_OK);
        if (R > 1) ck_assert(nb_ddp_buckets_rebuilt(ddp));
    }
    ck_assert_int_eq(nb_ddp_set_zero(ddp, NULL), NB_OK);
    ck_assert_uint_eq(nb_optim_state_bytes(opt), full);
    free(p);
    nb_ddp_free(ddp);
    nb_optim_free(opt);
}

static bool same_file(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    ck_assert(fa && fb);
    bool same = true;
    int ca, cb;
    do {
        ca = fgetc(fa);
        cb = fgetc(fb);
        if (ca != cb) same = false;
    } while (same && ca != EOF);
    fclose(fa);
    fclose(fb);
    return same;
}

static int model_state(nb_module *m, nb_named_tensor **out) {
    int n = nb_module_state(m, NULL, 0);
    *out = malloc(sizeof **out * (size_t)n);
    nb_module_state(m, *out, n);
    return n;
}

/* One process training on the whole global batch: steps [from, to). */
static void train_alone(nb_ctx *step, nb_module *m, nb_optim *o, int from, int to) {
    for (int it = from; it < to; it++) {
        nb_ctx_reset(step);
        set_lrs(o, it);
        nb_backward(loss_of(step, m, it, 0, true));
        nb_optim_step(o);
        nb_optim_zero_grad(o);
    }
}

/* Sharded training on R ranks: steps [from, to). */
static void train_zero(nb_ctx *step, nb_ddp *ddp, nb_module *m, nb_optim *o, int from, int to) {
    for (int it = from; it < to; it++) {
        nb_ctx_reset(step);
        set_lrs(o, it);
        ck_assert_int_eq(nb_ddp_backward(ddp, loss_of(step, m, it, 0, false)), NB_OK);
        ck_assert_int_eq(nb_ddp_step(ddp), NB_OK);
        nb_optim_zero_grad(o);
    }
}

/* Checkpoints: the consolidated file is plain DDP's file; a file written
 * by one process loads into R sharded ranks, and one written by R sharded
 * ranks into one process, and training goes on as the unsharded run. */
START_TEST(test_checkpoint) {
    char zpath[256], ppath[256], apath[256];
    /* one name for all ranks: rank 0's pid, broadcast */
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *pid = nb_full(step, NB_I64, 0, NULL, (double)getpid());
    ck_assert_int_eq(nb_work_finish(nb_pg_broadcast(world, pid, 0)), NB_OK);
    long id = (long)nb_item(pid);
    snprintf(zpath, sizeof zpath, "ddp_zero_%ld_z.safetensors", id);
    snprintf(ppath, sizeof ppath, "ddp_zero_%ld_p.safetensors", id);
    snprintf(apath, sizeof apath, "ddp_zero_%ld_a.safetensors", id);
    const cfg c = C_GROUPS;
    nb_train_state ts = {0};

    /* 1. R sharded ranks and plain DDP train 3 steps; rank 0 saves both */
    nb_module *m = deep_mlp(pctx), *ref = deep_mlp(pctx);
    nb_ddp *ddp = wrap(m), *rddp = wrap(ref);
    nb_optim *opt = optim_for(m, c), *ropt = optim_for(ref, c);
    ck_assert_int_eq(zero_on(ddp, opt), NB_OK);
    train_zero(step, ddp, m, opt, 0, 3);
    for (int it = 0; it < 3; it++) {
        nb_ctx_reset(step);
        set_lrs(ropt, it);
        ck_assert_int_eq(nb_ddp_backward(rddp, loss_of(step, ref, it, 0, false)), NB_OK);
        nb_optim_step(ropt);
        nb_optim_zero_grad(ropt);
    }
    if (R > 1) NBT_EXPECT_ABORT(nb_optim_state(opt, &(int){0}), "nb_ddp_consolidate_optimizer");
    ck_assert_int_eq(nb_ddp_consolidate_optimizer(ddp, 0), NB_OK);
    nb_named_tensor *ms, *rs;
    int nm = model_state(m, &ms);
    model_state(ref, &rs);
    ts.step = 3;
    if (me == 0) {
        ck_assert_int_eq(nb_checkpoint_save_training(zpath, ms, nm, opt, &ts, NULL, 0), NB_OK);
        ck_assert_int_eq(nb_checkpoint_save_training(ppath, rs, nm, ropt, &ts, NULL, 0), NB_OK);
        if (R <= 2) ck_assert_msg(same_file(zpath, ppath), "the ZeRO-1 checkpoint differs from plain DDP's");
    } else { /* consolidated on rank 0 only */
        NBT_EXPECT_ABORT(nb_optim_state(opt, &(int){0}), "sharded over the ranks");
    }

    /* 2. the sharded run goes on to step 6; the file it wrote, loaded by one
     *    process, goes on alone: the same parameters */
    train_zero(step, ddp, m, opt, 3, 6);
    nb_module *alone = deep_mlp(pctx);
    nb_optim *aopt = optim_for(alone, c);
    nb_named_tensor *as;
    model_state(alone, &as);
    ck_assert_int_eq(nb_work_finish(nb_pg_barrier(world)), NB_OK); /* the file is written */
    ck_assert_int_eq(nb_checkpoint_load_training(zpath, as, nm, aopt, &ts), NB_OK);
    ck_assert_int_eq(nb_optim_step_count(aopt), 3);
    train_alone(step, alone, aopt, 3, 6);
    assert_models(m, alone, false);
    ck_assert_int_eq(nb_ddp_consolidate_optimizer(ddp, -1), NB_OK);
    assert_optim_states_match(opt, aopt, RTOL, 1e-300);

    /* 3. a file written by one process (6 steps) loads into R sharded ranks,
     *    which go on to step 9 as the process does alone */
    ck_assert_int_eq(nb_work_finish(nb_pg_barrier(world)), NB_OK); /* everyone read zpath */
    ts.step = 6;
    if (me == 0) ck_assert_int_eq(nb_checkpoint_save_training(apath, as, nm, aopt, &ts, NULL, 0), NB_OK);
    ck_assert_int_eq(nb_work_finish(nb_pg_barrier(world)), NB_OK);
    nb_module *m2 = deep_mlp(pctx);
    nb_optim *opt2 = optim_for(m2, c);
    nb_named_tensor *ms2;
    model_state(m2, &ms2);
    ck_assert_int_eq(nb_checkpoint_load_training(apath, ms2, nm, opt2, &ts), NB_OK);
    nb_ddp *ddp2 = wrap(m2);
    ck_assert_int_eq(zero_on(ddp2, opt2), NB_OK);
    train_zero(step, ddp2, m2, opt2, 6, 9);
    train_alone(step, alone, aopt, 6, 9);
    assert_models(m2, alone, false);
    ck_assert_int_eq(nb_optim_step_count(opt2), 9);
    ck_assert_int_eq(nb_ddp_set_zero(ddp2, NULL), NB_OK); /* detached: the whole state back */
    assert_optim_states_match(opt2, aopt, RTOL, 1e-300);

    ck_assert_int_eq(nb_work_finish(nb_pg_barrier(world)), NB_OK);
    if (me == 0) {
        remove(zpath);
        remove(ppath);
        remove(apath);
    }
    free(ms);
    free(rs);
    free(as);
    free(ms2);
    ck_assert_int_eq(nb_ddp_set_zero(ddp, NULL), NB_OK);
    nb_ddp_free(ddp);
    nb_ddp_free(rddp);
    nb_ddp_free(ddp2);
    nb_optim_free(opt);
    nb_optim_free(ropt);
    nb_optim_free(aopt);
    nb_optim_free(opt2);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* The grad scaler under ZeRO-1 (nb_ddp_scaler_unscale / _step) against
 * plain DDP with the same scaler (nb_grad_scaler_unscale / _step): at
 * steps 0 and 3 the last rank's loss gets 1e300 * sum(last bias) (the
 * scaled gradient of that bias overflows to inf on that rank only, and
 * after the average its elements are inf only in the shard of the rank(s)
 * owning them): every rank must skip (the first skip is also the step
 * that rebuilds the buckets), the others step; scales, parameters and
 * state as the reference's after every step. */
START_TEST(test_scaler) {
    ddp_pair p = ddp_pair_wrapped(wrap, optim_for, C_ADAMW, true);
    ck_assert_int_eq(zero_on(p.ddp, p.opt), NB_OK);
    nb_grad_scaler *gs = nb_grad_scaler_new(1e10, 2, 0.5, 2), *rgs = nb_grad_scaler_new(1e10, 2, 0.5, 2);
    nb_named_tensor np[16], rnp[16];
    int n = nb_module_named_parameters(p.m, np, 16);
    ck_assert_int_eq(nb_module_named_parameters(p.ref, rnp, 16), n);
    ck_assert_int_eq(nb_numel(np[n - 1].tensor), N_CLASSES); /* the last layer's bias */
    bool exact = R <= 2;
    int skipped = 0;
    for (int it = 0; it < 6; it++) {
        set_lrs(p.opt, it);
        set_lrs(p.ropt, it);
        nb_ctx_reset(p.step);
        bool poison = it == 0 || it == 3;
        nb_tensor *l = loss_of(p.step, p.m, it, 0, false), *rl = loss_of(p.step, p.ref, it, 0, false);
        if (poison && me == R - 1) {
            l = nb_add(p.step, l, nb_mul_scalar(p.step, nb_sum(p.step, np[n - 1].tensor, 0, NULL, false), 1e300));
            rl = nb_add(p.step, rl, nb_mul_scalar(p.step, nb_sum(p.step, rnp[n - 1].tensor, 0, NULL, false), 1e300));
        }
        ck_assert_int_eq(nb_ddp_backward(p.ddp, nb_grad_scaler_scale(gs, p.step, l)), NB_OK);
        ck_assert_int_eq(nb_ddp_backward(p.rddp, nb_grad_scaler_scale(rgs, p.step, rl)), NB_OK);
        if (it == 4) { /* unscaled first (as before clipping), then stepped */
            ck_assert_int_eq(nb_ddp_scaler_unscale(p.ddp, gs), NB_OK);
            nb_grad_scaler_unscale(rgs, p.ropt);
            NBT_EXPECT_ABORT(nb_ddp_scaler_unscale(p.ddp, gs), "nb_ddp_scaler_unscale: the gradients "
                                                             "were already unscaled");
        }
        bool stepped = !poison;
        ck_assert_int_eq(nb_ddp_scaler_step(p.ddp, gs, &stepped), NB_OK);
        bool rstepped = nb_grad_scaler_step(rgs, p.ropt);
        ck_assert_msg(rstepped == !poison, "rank %d, step %d: the reference %s", me, it,
                      rstepped ? "stepped" : "skipped");
        ck_assert_msg(stepped == rstepped, "rank %d, step %d: ZeRO-1 %s, plain DDP %s", me, it,
                      stepped ? "stepped" : "skipped", rstepped ? "stepped" : "skipped");
        skipped += !stepped;
        NBT_EXPECT_ABORT(nb_ddp_scaler_step(p.ddp, gs, &stepped), "called twice without "
                                                               "nb_grad_scaler_update");
        nb_grad_scaler_update(gs);
        nb_grad_scaler_update(rgs);
        ck_assert(nb_grad_scaler_get_scale(gs) == nb_grad_scaler_get_scale(rgs));
        ck_assert_int_eq(nb_optim_step_count(p.opt), nb_optim_step_count(p.ropt));
        assert_models(p.m, p.ref, exact);
        assert_states(p.ddp, p.opt, p.ropt, exact);
        nb_optim_zero_grad(p.opt);
        nb_optim_zero_grad(p.ropt);
    }
    ck_assert_int_eq(skipped, 2);
    ck_assert_int_eq(nb_optim_step_count(p.opt), 4);
    if (R > 1) ck_assert(nb_ddp_buckets_rebuilt(p.ddp));
    assert_same_on_all_ranks(p.m);
    NBT_EXPECT_ABORT(nb_ddp_scaler_step(p.ddp, gs, &(bool){0}), "no synchronised nb_ddp_backward "
                                                             "since the last step");
    ck_assert_int_eq(nb_ddp_set_zero(p.ddp, NULL), NB_OK);
    NBT_EXPECT_ABORT(nb_ddp_scaler_unscale(p.ddp, gs), "nb_ddp_scaler_unscale: rank");
    NBT_EXPECT_ABORT(nb_ddp_scaler_unscale(p.ddp, gs), "ZeRO-1 is off");
    nb_grad_scaler_free(gs);
    nb_grad_scaler_free(rgs);
    ddp_pair_free(&p);
}
END_TEST

/* What ZeRO-1 does not combine with is refused, by name. */
START_TEST(test_refusals) {
    /* p.ref, unwrapped, and p.ropt: another model and its optimizer */
    ddp_pair p = ddp_pair_wrapped(wrap, optim_for, C_ADAMW, false);
    NBT_EXPECT_STATUS(nb_ddp_set_zero(p.ddp, p.ropt), NB_ERR_INVALID, "nb_ddp_set_zero: rank");
    NBT_EXPECT_STATUS(nb_ddp_set_zero(p.ddp, p.ropt), NB_ERR_INVALID, "is not a parameter (that requires grad) "
                                                                    "of the wrapped model");
    NBT_EXPECT_ABORT(nb_ddp_step(p.ddp), "nb_ddp_step: rank");
    NBT_EXPECT_ABORT(nb_ddp_step(p.ddp), "ZeRO-1 is off");
    ck_assert_int_eq(nb_ddp_set_zero(p.ddp, p.opt), NB_OK);
    NBT_EXPECT_ABORT(nb_ddp_step(p.ddp), "no synchronised nb_ddp_backward since the last step");
    nb_ddp_set_no_sync(p.ddp, true);
    ck_assert_int_eq(nb_ddp_backward(p.ddp, loss_of(p.step, p.m, 0, 0, false)), NB_OK);
    NBT_EXPECT_ABORT(nb_ddp_step(p.ddp), "a no_sync backward only accumulates locally");
    nb_ddp_set_no_sync(p.ddp, false);
    ck_assert_int_eq(nb_ddp_backward(p.ddp, loss_of(p.step, p.m, 0, 1, false)), NB_OK);
    NBT_EXPECT_ABORT(nb_optim_step(p.opt), "nb_optim_step: this optimizer's state is sharded over the "
                                         "ranks by a DDP wrapper (ZeRO-1, nb_ddp_set_zero): step "
                                         "with nb_ddp_step(ddp)");
    NBT_EXPECT_ABORT(nb_optim_clip_grad_norm(p.opt, 1.0, 2.0),
                     "nb_optim_clip_grad_norm: this optimizer's state is sharded");
    NBT_EXPECT_ABORT(nb_optim_clip_grad_norm(p.opt, 1.0, 2.0), "clip with nb_ddp_clip_grad_norm");
    nb_grad_scaler *gs = nb_grad_scaler_new(1024, 2, 0.5, 100);
    NBT_EXPECT_ABORT(nb_grad_scaler_step(gs, p.opt), "nb_grad_scaler_step: this optimizer's state is "
                                                   "sharded");
    NBT_EXPECT_ABORT(nb_grad_scaler_unscale(gs, p.opt), "unscale with nb_ddp_scaler_unscale(ddp, scaler)");
    NBT_EXPECT_ABORT(nb_grad_scaler_step(gs, p.opt), "step with nb_ddp_scaler_step(ddp, scaler, &stepped)");
    /* feature conflicts: a status both ways, naming both (Note [Feature conflicts]) */
    NBT_EXPECT_STATUS(nb_ddp_join_begin(p.ddp, NULL), NB_ERR_INVALID, "nb_ddp_join_begin: rank");
    NBT_EXPECT_STATUS(nb_ddp_join_begin(p.ddp, NULL), NB_ERR_INVALID, "join mode (nb_ddp_join_begin) cannot be "
                      "combined with ZeRO (nb_ddp_set_zero), which is on: a joined rank would have to step "
                      "its shard");
    NBT_EXPECT_STATUS(nb_ddp_set_optimizer(p.ddp, p.opt), NB_ERR_INVALID, "per-bucket optimizer steps "
                      "(nb_ddp_set_optimizer) cannot be combined with ZeRO (nb_ddp_set_zero), which is on: "
                      "ZeRO steps each rank's shard");
    NBT_EXPECT_STATUS(nb_ddp_set_zero(p.ddp, p.ropt), NB_ERR_INVALID, "already on with another optimizer");
    nb_ddp *second = wrap(p.ref);
    NBT_EXPECT_STATUS(nb_ddp_set_optimizer(second, p.opt), NB_ERR_INVALID, "this optimizer is sharded over the "
                      "ranks by a DDP wrapper (ZeRO, nb_ddp_set_zero); it cannot also be stepped per bucket");
    if (R > 1) NBT_EXPECT_ABORT(nb_optim_state(p.opt, &(int){0}), "nb_optim_state: this optimizer's "
                                                                "state is sharded");
    /* a consolidated copy is for saving: loading into it is refused */
    ck_assert_int_eq(nb_ddp_consolidate_optimizer(p.ddp, -1), NB_OK);
    NBT_EXPECT_ABORT(nb_optim_state_validate(p.opt), "is only for saving: the next nb_ddp_step would "
                                                   "ignore what was loaded into it");
    ck_assert_int_eq(nb_ddp_step(p.ddp), NB_OK);
    ck_assert_int_eq(nb_optim_step_count(p.opt), 1); /* the refused calls stepped nothing */
    /* detached, the optimizer is the user's again */
    ck_assert_int_eq(nb_ddp_set_zero(p.ddp, NULL), NB_OK);
    nb_optim_step(p.opt);
    ck_assert_int_eq(nb_optim_step_count(p.opt), 2);
    /* per-bucket steps and the bf16 hook refuse ZeRO-1 */
    ck_assert_int_eq(nb_ddp_set_optimizer(p.ddp, p.opt), NB_OK);
    NBT_EXPECT_STATUS(nb_ddp_set_zero(p.ddp, p.opt), NB_ERR_INVALID, "ZeRO (nb_ddp_set_zero) cannot be combined "
                      "with per-bucket optimizer steps (nb_ddp_set_optimizer), which is on: ZeRO steps each "
                      "rank's shard");
    NBT_EXPECT_ABORT(nb_ddp_clip_grad_norm(p.ddp, 1.0, 2.0, &(double){0}),
                     "nb_ddp_backward has already applied the gradients");
    ck_assert_int_eq(nb_ddp_set_optimizer(p.ddp, NULL), NB_OK);
    ck_assert_int_eq(nb_ddp_join_begin(p.ddp, NULL), NB_OK);
    NBT_EXPECT_STATUS(nb_ddp_set_zero(p.ddp, p.opt), NB_ERR_INVALID, "ZeRO (nb_ddp_set_zero) cannot be combined "
                      "with join mode (nb_ddp_join_begin), which is on: a joined rank would have to step its "
                      "shard");
    ck_assert_int_eq(nb_ddp_join(p.ddp), NB_OK);
    nb_ddp_free(second);
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.comm_hook = NB_DDP_HOOK_BF16;
    nb_ddp *bf;
    ck_assert_int_eq(nb_ddp_new(&bf, p.ref, world, &o), NB_OK);
    NBT_EXPECT_STATUS(nb_ddp_set_zero(bf, p.ropt), NB_ERR_INVALID, "ZeRO (nb_ddp_set_zero) cannot be combined "
                      "with the bf16 compression hook (comm_hook NB_DDP_HOOK_BF16), which is on");
    nb_ddp_free(bf);
    /* a wrapper freed while attached: the state is gone, and the optimizer says so */
    if (R > 1) {
        nb_ddp *lost = wrap(p.ref);
        ck_assert_int_eq(nb_ddp_set_zero(lost, p.ropt), NB_OK);
        nb_ddp_free(lost);
        NBT_EXPECT_ABORT(nb_optim_step(p.ropt), "freed while attached (the shards are lost");
    }
    nb_grad_scaler_free(gs);
    ddp_pair_free(&p);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_adamw, test_sgd_nesterov, test_sgd_plain, test_adam_amsgrad, test_two_groups,
                             test_no_sync, test_clip_l2, test_clip_inf, test_gradients, test_state_bytes,
                             test_checkpoint, test_scaler, test_refusals, NULL};
    return nbt_suite("ddp_zero", "ddp_zero", 120, tests);
}

int main(void) {
    const char *stage = getenv("NBT_ZERO_STAGE");
    if (stage) STAGE = atoi(stage);
    if (STAGE != 1 && STAGE != 2) {
        fprintf(stderr, "test_ddp_zero: NBT_ZERO_STAGE=%s: 1 or 2\n", stage);
        return 1;
    }
    return nbt_run_world(ddp_setup);
}
