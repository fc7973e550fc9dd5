/* DDP with the optimizer step overlapped per bucket (nb_ddp_set_optimizer),
 * on R ranks over Gloo (CTest runs it under nbrun with 2 and 3 ranks, and
 * alone as a world of one).
 *
 * The reference is the plain path on a second copy of the model: its own
 * DDP wrapper, nb_ddp_backward, then nb_optim_step. Both copies start from
 * the same seed and see the same shards, so after every step their
 * parameters and optimizer states must be the same bits. The refusals
 * (clipping, grad scaler, join, a second nb_optim_step) have their
 * messages asserted. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_common.h"

/* The model wrapped in DDP with several buckets even for this small model. */
static nb_ddp *wrap(nb_module *m) {
    nb_ddp_options o = small_buckets(256, 512);
    return ddp_wrap(m, &o, 2);
}

static nb_optim *optim_for(nb_module *m, int kind) {
    int n = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *p = malloc(sizeof *p * (size_t)n);
    nb_module_named_parameters(m, p, n);
    nb_optim_hparams h = kind == NB_OPTIM_SGD ? NB_SGD_DEFAULTS : NB_ADAMW_DEFAULTS;
    if (kind == NB_OPTIM_SGD) {
        h.momentum = 0.9;
        h.weight_decay = 1e-3;
    }
    nb_optim *o = nb_optim_new((nb_optim_kind)kind, p, n, &h);
    free(p);
    return o;
}

/* Model and optimizer state of a and b (per bucket and plain) are the same bits. */
static void assert_same(nb_module *a, nb_module *b, nb_optim *oa, nb_optim *ob) {
    assert_models_match(a, b, 0, 0);
    assert_optim_states_match(oa, ob, 0, 0);
}

/* `steps` optimizer steps of `accum` micro-batches each (all but the last
 * under no_sync), per bucket on one copy and plain on the other, with a
 * learning rate changed before each step. */
static void run_equivalence(nb_optim_kind kind, int steps, int accum) {
    ddp_pair p = ddp_pair_wrapped(wrap, optim_for, kind, true);
    ck_assert_int_eq(nb_ddp_set_optimizer(p.ddp, p.opt), NB_OK);
    ck_assert_ptr_eq(nb_ddp_optimizer(p.ddp), p.opt);
    for (int it = 0; it < steps; it++) {
        double lr = 0.02 / (1 + it);
        nb_optim_set_lr_all(p.opt, lr);
        nb_optim_set_lr_all(p.ropt, lr);
        for (int k = 0; k < accum; k++) {
            nb_ctx_reset(p.step);
            bool last = k == accum - 1;
            nb_ddp_set_no_sync(p.ddp, !last);
            nb_ddp_set_no_sync(p.rddp, !last);
            ck_assert_int_eq(nb_ddp_pre_forward(p.ddp), NB_OK);
            ck_assert_int_eq(nb_ddp_backward(p.ddp, loss_of(p.step, p.m, it, k, false)), NB_OK);
            if (!last) /* accumulating: nothing stepped yet */
                ck_assert_int_eq(nb_optim_step_count(p.opt), it);
            ck_assert_int_eq(nb_ddp_pre_forward(p.rddp), NB_OK);
            ck_assert_int_eq(nb_ddp_backward(p.rddp, loss_of(p.step, p.ref, it, k, false)), NB_OK);
        }
        nb_optim_step(p.ropt);
        ck_assert_int_eq(nb_optim_step_count(p.opt), it + 1);
        assert_same(p.m, p.ref, p.opt, p.ropt);
        nb_optim_zero_grad(p.opt);
        nb_optim_zero_grad(p.ropt);
    }
    assert_same_on_all_ranks(p.m);
    /* the parameters moved: the step was not a no-op on both sides */
    assert_params_moved(p.m, deep_mlp(p.pctx));
    ddp_pair_free(&p);
}

START_TEST(test_adamw_equivalence) { run_equivalence(NB_OPTIM_ADAMW, 5, 1); }
END_TEST

START_TEST(test_sgd_momentum_equivalence) { run_equivalence(NB_OPTIM_SGD, 5, 1); }
END_TEST

START_TEST(test_no_sync_accumulation) { run_equivalence(NB_OPTIM_ADAMW, 3, 3); }
END_TEST

/* What cannot be combined with a per-bucket step is refused, by name. */
START_TEST(test_refusals) {
    /* p.ref, unwrapped, and p.ropt: another model and its optimizer */
    ddp_pair p = ddp_pair_wrapped(wrap, optim_for, NB_OPTIM_ADAMW, false);
    NBT_EXPECT_STATUS(nb_ddp_set_optimizer(p.ddp, p.ropt), NB_ERR_INVALID, "is not a parameter (that requires "
                      "grad) of the wrapped model");
    ck_assert_ptr_null(nb_ddp_optimizer(p.ddp)); /* nothing attached */
    ck_assert_int_eq(nb_ddp_set_optimizer(p.ddp, p.opt), NB_OK);
    ck_assert_int_eq(nb_ddp_pre_forward(p.ddp), NB_OK);
    ck_assert_int_eq(nb_ddp_backward(p.ddp, loss_of(p.step, p.m, 0, 0, false)), NB_OK);
    NBT_EXPECT_ABORT(nb_optim_step(p.opt), "nb_optim_step: this optimizer is stepped per bucket by a "
                                         "DDP wrapper (nb_ddp_set_optimizer): nb_ddp_backward has "
                                         "already updated the parameters");
    NBT_EXPECT_ABORT(nb_optim_clip_grad_norm(p.opt, 1.0, 2.0),
                     "nb_optim_clip_grad_norm: this optimizer is stepped per bucket");
    nb_grad_scaler *gs = nb_grad_scaler_new(1024, 2, 0.5, 100);
    NBT_EXPECT_ABORT(nb_grad_scaler_step(gs, p.opt), "nb_grad_scaler_step: this optimizer is stepped "
                                                   "per bucket");
    NBT_EXPECT_ABORT(nb_grad_scaler_unscale(gs, p.opt), "nb_grad_scaler_unscale: this optimizer is "
                                                      "stepped per bucket");
    /* a feature conflict: the same status both ways, naming both (Note [Feature conflicts]) */
    NBT_EXPECT_STATUS(nb_ddp_join_begin(p.ddp, NULL), NB_ERR_INVALID, "nb_ddp_join_begin: rank");
    NBT_EXPECT_STATUS(nb_ddp_join_begin(p.ddp, NULL), NB_ERR_INVALID, "join mode (nb_ddp_join_begin) cannot be "
                      "combined with per-bucket optimizer steps (nb_ddp_set_optimizer), which is on: a joined "
                      "rank replays");
    nb_ddp *second = wrap(p.ref);
    NBT_EXPECT_STATUS(nb_ddp_set_optimizer(second, p.opt), NB_ERR_INVALID, "this optimizer is stepped per "
                      "bucket by a DDP wrapper (nb_ddp_set_optimizer) already; it cannot also be stepped");
    nb_ddp_free(second);
    ck_assert_int_eq(nb_optim_step_count(p.opt), 1); /* the refused calls stepped nothing */
    /* detached, the optimizer is the user's again */
    ck_assert_int_eq(nb_ddp_set_optimizer(p.ddp, NULL), NB_OK);
    ck_assert_ptr_null(nb_ddp_optimizer(p.ddp));
    nb_optim_step(p.opt);
    ck_assert_int_eq(nb_optim_step_count(p.opt), 2);
    ck_assert_int_eq(nb_ddp_join_begin(p.ddp, NULL), NB_OK);
    NBT_EXPECT_STATUS(nb_ddp_set_optimizer(p.ddp, p.opt), NB_ERR_INVALID, "nb_ddp_set_optimizer: rank");
    NBT_EXPECT_STATUS(nb_ddp_set_optimizer(p.ddp, p.opt), NB_ERR_INVALID, "per-bucket optimizer steps "
                      "(nb_ddp_set_optimizer) cannot be combined with join mode (nb_ddp_join_begin), which is "
                      "on: a joined rank replays");
    ck_assert_ptr_null(nb_ddp_optimizer(p.ddp));
    ck_assert_int_eq(nb_ddp_join(p.ddp), NB_OK);
    nb_grad_scaler_free(gs);
    ddp_pair_free(&p);
}
END_TEST

/* find_unused_parameters (Note [Unused parameters] in distributed/ddp.c):
 * heads a (used everywhere), b (used nowhere) and c (rank 0 only) of one
 * list; stepped per bucket and plain, both wrappers with the option, after
 * nb_optim_zero_grad each step: the same bits, and b, which never has a
 * gradient, is never stepped (no weight decay), on either side. */
static nb_tensor *head_loss(nb_ctx *step, nb_module *m, int it) {
    nb_tensor *x, *y;
    make_batch(step, R * 4, 900 + (uint64_t)it, &x, &y);
    x = shard(step, x, me * 4, 4);
    y = shard(step, y, me * 4, 4);
    nb_tensor *logits = nb_module_forward(nb_module_child(m, "a"), step, x);
    if (me == 0) logits = nb_add(step, logits, nb_module_forward(nb_module_child(m, "c"), step, x));
    return nb_cross_entropy(step, logits, y, NULL);
}

START_TEST(test_unused_parameters) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *m = three_heads(pctx), *ref = three_heads(pctx), *init = three_heads(pctx);
    nb_ddp_options o = small_buckets(64, 128);
    o.find_unused_parameters = true;
    nb_ddp *d = ddp_wrap(m, &o, -1), *rd = ddp_wrap(ref, &o, -1);
    nb_optim *opt = optim_for(m, NB_OPTIM_ADAMW), *ropt = optim_for(ref, NB_OPTIM_ADAMW);
    if (R > 1) ck_assert_int_eq(nb_ddp_set_optimizer(d, opt), NB_OK);
    for (int it = 0; it < 3; it++) {
        nb_ctx_reset(step);
        nb_optim_zero_grad(opt);
        nb_optim_zero_grad(ropt);
        ck_assert_int_eq(nb_ddp_backward(d, head_loss(step, m, it)), NB_OK);
        if (R == 1) nb_optim_step(opt); /* a world of one has no buckets to step */
        ck_assert_int_eq(nb_ddp_backward(rd, head_loss(step, ref, it)), NB_OK);
        nb_optim_step(ropt);
        assert_same(m, ref, opt, ropt);
        nb_module *b = nb_module_child(m, "b"), *b0 = nb_module_child(init, "b");
        nb_named_tensor p[2], q[2];
        nb_module_named_parameters(b, p, 2);
        nb_module_named_parameters(b0, q, 2);
        for (int k = 0; k < 2; k++) {
            ck_assert_msg(p[k].tensor->grad == NULL, "rank %d, step %d: b.%s has a gradient", me, it, p[k].name);
            nbt_assert_tensors_close(p[k].tensor, q[k].tensor, 0, 0); /* never stepped */
        }
    }
    if (R > 1) ck_assert_int_eq(nb_ddp_set_optimizer(d, NULL), NB_OK);
    nb_ddp_free(d);
    nb_ddp_free(rd);
    nb_optim_free(opt);
    nb_optim_free(ropt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_adamw_equivalence, test_sgd_momentum_equivalence, test_no_sync_accumulation,
                             test_refusals, test_unused_parameters, NULL};
    return nbt_suite("ddp_bucket_step", "ddp_bucket_step", 120, tests);
}

int main(void) { return nbt_run_world(ddp_setup); }
