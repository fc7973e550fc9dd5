/* DDP join (uneven inputs) on R ranks over Gloo: CTest runs this suite
 * under nbrun with 2 and 3 ranks (a short NABLA_PG_TIMEOUT, so a rank left
 * waiting fails the test in seconds instead of hanging), and alone as a
 * world of one.
 *
 * Rank r has its own number of batches (3 or 5, alternating; 0 in one
 * test). The reference, computed on every rank by one plain process,
 * applies the documented rule step by step: in step s the ranks with more
 * than s batches train; the gradient is the sum of their shards' gradients
 * divided by the world size (the default) or by their number; with
 * SyncBatchNorm the batch statistics are those of their shards together.
 * Rank r's shard of step s's global batch is rows [r B, r B + B). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_common.h"

/* ---- batches per rank ---- */

/* Rank r's number of batches: `even` for even ranks, `odd` for odd ones. */
static int batches_of(int r, int even, int odd) { return r % 2 == 0 ? even : odd; }

static int most_batches(int even, int odd) {
    int m = 0;
    for (int r = 0; r < R; r++) m = batches_of(r, even, odd) > m ? batches_of(r, even, odd) : m;
    return m;
}

/* ---- MLP ---- */

/* Trains with join; rank r has batches_of(r, even, odd) batches; the
 * result must equal the reference rule on every rank. */
static void run_mlp(int even, int odd, bool divide_by_initial) {
    const int64_t B = 4;
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = mlp_of(pctx, NB_F64, 16), *ref = mlp_of(pctx, NB_F64, 16);
    nb_ddp_options o = small_buckets(256, 512); /* several buckets, and a rebuild, even for this model */
    o.record_timeline = true;
    nb_ddp *ddp = ddp_wrap(model, &o, -1);
    nb_optim *opt = adamw_for(model), *ropt = adamw_for(ref);
    nb_ddp_join_options jo = NB_DDP_JOIN_DEFAULTS;
    jo.divide_by_initial_world_size = divide_by_initial;
    ck_assert_int_eq(nb_ddp_join_begin(ddp, &jo), NB_OK);
    int mine = batches_of(me, even, odd), most = most_batches(even, odd);
    for (int s = 0; s < most; s++) {
        nb_ctx_reset(step);
        nb_tensor *x, *y;
        make_batch(step, R * B, 300 + (uint64_t)s, &x, &y);
        if (s < mine) {
            nb_tensor *out = ddp_fwd(ddp, step, shard(step, x, me * B, B));
            nb_tensor *loss = nb_cross_entropy(step, out, shard(step, y, me * B, B), NULL);
            ck_assert_msg(nb_ddp_backward(ddp, loss) == NB_OK, "nb_ddp_backward: %s", nb_last_error());
            nb_optim_step(opt);
            nb_optim_zero_grad(opt);
        }
        int active = 0;
        for (int r = 0; r < R; r++) active += batches_of(r, even, odd) > s;
        double D = divide_by_initial ? R : active;
        for (int r = 0; r < R; r++)
            if (batches_of(r, even, odd) > s) {
                nb_tensor *lr = nb_cross_entropy(step, nb_module_forward(ref, step, shard(step, x, r * B, B)),
                                                 shard(step, y, r * B, B), NULL);
                nb_backward(nb_mul_scalar(step, lr, 1.0 / D));
            }
        nb_optim_step(ropt);
        nb_optim_zero_grad(ropt);
    }
    nb_status st = nb_ddp_join(ddp);
    ck_assert_msg(st == NB_OK, "nb_ddp_join: %s", nb_last_error());
    assert_same_on_all_ranks(model);
    assert_models_close(model, ref, 1e-9);
    /* a joined rank records no step of its own: the ranks' records differ,
     * and every rank says so (none waits for the others) */
    nb_ddp_overlap ov;
    st = nb_ddp_overlap_across_ranks(ddp, &ov);
    if (R > 1 && even != odd) {
        ck_assert_int_eq(st, NB_ERR_MISMATCH);
        char want[96];
        snprintf(want, sizeof want, "rank 0 recorded %d steps since the last call, rank 1 %d", even, odd);
        ck_assert_msg(strstr(nb_last_error(), want) != NULL, "%s", nb_last_error());
    } else {
        ck_assert_int_eq(st, NB_OK);
    }
    ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_OK); /* the records were dropped */
    ck_assert_int_eq(ov.steps, 0);
    nb_ddp_free(ddp);
    nb_optim_free(opt);
    nb_optim_free(ropt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}

START_TEST(test_join_3_and_5_batches) { run_mlp(3, 5, true); }
END_TEST

START_TEST(test_join_divide_by_active_ranks) { run_mlp(5, 3, false); }
END_TEST

/* Rank 0 has no batch at all: the buffers' root, the bucket rebuild's
 * order and the final state come from another rank. */
START_TEST(test_join_rank0_without_batches) { run_mlp(0, 3, true); }
END_TEST

/* ---- CNN with SyncBatchNorm ---- */

START_TEST(test_join_sync_batch_norm) {
    const int64_t B = 3;
    const int even = 3, odd = 5;
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = cnn(pctx), *ref = cnn(pctx);
    ck_assert_int_eq(nb_convert_sync_batchnorm(model, world), 1);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    nb_optim *opt = adamw_for(model), *ropt = adamw_for(ref);
    ck_assert_int_eq(nb_ddp_join_begin(ddp, NULL), NB_OK);
    int mine = batches_of(me, even, odd), most = most_batches(even, odd);
    for (int s = 0; s < most; s++) {
        nb_ctx_reset(step);
        nb_rng rng = nb_rng_make(400 + (uint64_t)s);
        nb_tensor *x = nb_rand_normal(step, NB_F64, NB_SHAPE(R * B, 1, 5, 5), 0.5, 2, &rng);
        int64_t lab[16];
        for (int i = 0; i < R * B; i++) lab[i] = (i * 5 + s) % N_CLASSES;
        nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(R * B), lab);
        nb_tensor *out = NULL;
        if (s < mine) {
            out = ddp_fwd(ddp, step, shard(step, x, me * B, B));
            nb_tensor *loss = nb_cross_entropy(step, out, shard(step, y, me * B, B), NULL);
            ck_assert_msg(nb_ddp_backward(ddp, loss) == NB_OK, "nb_ddp_backward: %s", nb_last_error());
            nb_optim_step(opt);
            nb_optim_zero_grad(opt);
        }
        /* reference: plain BatchNorm over the training ranks' shards together;
         * the loss is the sum of their mean losses divided by the world size */
        nb_tensor *xs[8], *ys[8];
        int active = 0, pos = -1;
        for (int r = 0; r < R; r++)
            if (batches_of(r, even, odd) > s) {
                if (r == me) pos = active;
                xs[active] = shard(step, x, r * B, B);
                ys[active++] = shard(step, y, r * B, B);
            }
        nb_tensor *outr = nb_module_forward(ref, step, nb_concat(step, active, xs, 0));
        nb_tensor *lossr = nb_cross_entropy(step, outr, nb_concat(step, active, ys, 0), NULL);
        nb_backward(nb_mul_scalar(step, lossr, (double)active / R));
        nb_optim_step(ropt);
        nb_optim_zero_grad(ropt);
        if (out) nbt_assert_tensors_close(out, nb_narrow(step, outr, 0, pos * B, B), 1e-12, 1e-9);
    }
    nb_status st = nb_ddp_join(ddp);
    ck_assert_msg(st == NB_OK, "nb_ddp_join: %s", nb_last_error());
    assert_same_on_all_ranks(model);
    assert_models_close(model, ref, 1e-9); /* parameters and running statistics */
    nb_ddp_free(ddp);
    nb_optim_free(opt);
    nb_optim_free(ropt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* ---- misuse ---- */

START_TEST(test_join_without_begin) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, mlp_of(pctx, NB_F64, 16), world, NULL), NB_OK);
    NBT_EXPECT_ABORT(nb_ddp_join(ddp), "nb_ddp_join: rank");
    NBT_EXPECT_ABORT(nb_ddp_join(ddp), "every rank calls nb_ddp_join_begin");
    nb_ddp_free(ddp);
    nb_ctx_free(pctx);
}
END_TEST

/* A step whose forward bypassed the wrapper cannot be counted: loud, before
 * any collective, so every rank can still finish with nb_ddp_join. */
START_TEST(test_join_backward_needs_counted_forward) {
    if (R == 1) return; /* a world of one counts nothing */
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = mlp_of(pctx, NB_F64, 16);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    ck_assert_int_eq(nb_ddp_join_begin(ddp, NULL), NB_OK);
    nb_tensor *x, *y;
    make_batch(step, 4, 1, &x, &y);
    nb_tensor *loss = nb_cross_entropy(step, nb_module_forward(model, step, x), y, NULL);
    NBT_EXPECT_ABORT(nb_ddp_backward(ddp, loss), "every step must start with nb_ddp_forward or nb_ddp_pre_forward");
    ck_assert_int_eq(nb_ddp_join(ddp), NB_OK);
    nb_ddp_free(ddp);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* Ranks that disagree on no_sync in a step fail together, naming it. */
DDP_TEST(test_join_no_sync_disagreement) {
    if (R == 1) return;
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, mlp_of(pctx, NB_F64, 16), world, NULL), NB_OK);
    ck_assert_int_eq(nb_ddp_join_begin(ddp, NULL), NB_OK);
    nb_ddp_set_no_sync(ddp, me == 0);
    nb_tensor *x, *y, *out = (nb_tensor *)1;
    make_batch(step, 4, 2, &x, &y);
    ck_assert_int_eq(nb_ddp_forward(ddp, step, x, &out), NB_ERR_MISMATCH);
    ck_assert_ptr_null(out);
    char want[160];
    snprintf(want, sizeof want, "of the %d ranks still training, %d reduce gradients in this step and 1 are in no_sync",
             R, R - 1);
    ck_assert_msg(strstr(nb_last_error(), want) != NULL, "rank %d: %s", me, nb_last_error());
    nb_ddp_set_no_sync(ddp, false);
    ck_assert_int_eq(nb_ddp_join(ddp), NB_OK);
    nb_ddp_free(ddp);
}

/* A rank without a step cannot replay SyncBatchNorm's all-reduces: it says
 * so before any collective (here every rank, so nobody waits). */
START_TEST(test_join_sync_bn_needs_a_step) {
    if (R == 1) return;
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = cnn(pctx);
    nb_convert_sync_batchnorm(model, world);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    ck_assert_int_eq(nb_ddp_join_begin(ddp, NULL), NB_OK);
    ck_assert_int_eq(nb_ddp_join(ddp), NB_ERR_INVALID);
    char want[120];
    snprintf(want, sizeof want, "nb_ddp_join: rank %d joined without a synchronised training step", me);
    ck_assert_msg(strstr(nb_last_error(), want) != NULL, "%s", nb_last_error());
    ck_assert_ptr_nonnull(strstr(nb_last_error(), "SyncBatchNorm"));
    nb_ddp_free(ddp);
    nb_ctx_free(pctx);
}
END_TEST

/* find_unused_parameters with gradients set to none (Note [Unused
 * parameters] in distributed/ddp.c): head "b" is used by no rank, and the
 * odd ranks join after one step, answering the map of used parameters with
 * zeros. b's gradient stays NULL on the training ranks and its values stay
 * bit for bit everywhere; head "a" follows the reference rule. */
START_TEST(test_join_unused_stays_none) {
    const int64_t B = 4;
    const int even = 3, odd = 1;
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = nb_module_list_new(pctx), *ref = nb_module_list_new(pctx);
    for (int k = 0; k < 2; k++) {
        nb_module *m = k ? ref : model;
        nb_rng rng = nb_rng_make(3);
        nb_module_add(m, "a", nb_linear_new(pctx, NB_F64, F_IN, N_CLASSES, true, &rng));
        nb_module_add(m, "b", nb_linear_new(pctx, NB_F64, F_IN, N_CLASSES, true, &rng));
    }
    nb_named_tensor p[4], q[4];
    nb_module_named_parameters(model, p, 4);
    nb_module_named_parameters(ref, q, 4);
    ck_assert_str_eq(p[2].name, "b.weight");
    nb_tensor *b0[2] = {nb_clone(pctx, p[2].tensor), nb_clone(pctx, p[3].tensor)};
    nb_ddp_options o = small_buckets(64, 128);
    o.find_unused_parameters = true;
    nb_ddp *ddp = ddp_wrap(model, &o, -1);
    nb_optim *opt = adamw_for(model), *ropt = adamw_for(ref);
    ck_assert_int_eq(nb_ddp_join_begin(ddp, NULL), NB_OK);
    int mine = batches_of(me, even, odd), most = most_batches(even, odd);
    for (int s = 0; s < most; s++) {
        nb_ctx_reset(step);
        nb_tensor *x, *y;
        make_batch(step, R * B, 900 + (uint64_t)s, &x, &y);
        if (s < mine) {
            nb_optim_zero_grad_to_none(opt);
            ck_assert_msg(nb_ddp_pre_forward(ddp) == NB_OK, "%s", nb_last_error());
            nb_tensor *out = nb_module_forward(nb_module_child(model, "a"), step, shard(step, x, me * B, B));
            nb_tensor *loss = nb_cross_entropy(step, out, shard(step, y, me * B, B), NULL);
            ck_assert_msg(nb_ddp_backward(ddp, loss) == NB_OK, "nb_ddp_backward: %s", nb_last_error());
            ck_assert_ptr_null(p[2].tensor->grad);
            ck_assert_ptr_null(p[3].tensor->grad);
            ck_assert_ptr_nonnull(p[0].tensor->grad);
            nb_optim_step(opt);
        }
        nb_optim_zero_grad_to_none(ropt);
        for (int r = 0; r < R; r++)
            if (batches_of(r, even, odd) > s) {
                nb_tensor *lr = nb_cross_entropy(step, nb_module_forward(nb_module_child(ref, "a"), step,
                                                                         shard(step, x, r * B, B)),
                                                 shard(step, y, r * B, B), NULL);
                nb_backward(nb_mul_scalar(step, lr, 1.0 / R));
            }
        nb_optim_step(ropt);
    }
    ck_assert_msg(nb_ddp_join(ddp) == NB_OK, "nb_ddp_join: %s", nb_last_error());
    assert_same_on_all_ranks(model);
    nbt_assert_tensors_close(p[2].tensor, b0[0], 0, 0);
    nbt_assert_tensors_close(p[3].tensor, b0[1], 0, 0);
    for (int i = 0; i < 2; i++) nbt_assert_tensors_close(p[i].tensor, q[i].tensor, 0, 1e-9);
    nb_ddp_free(ddp);
    nb_optim_free(opt);
    nb_optim_free(ropt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_join_3_and_5_batches, test_join_divide_by_active_ranks,
                             test_join_rank0_without_batches, test_join_sync_batch_norm,
                             test_join_without_begin, test_join_backward_needs_counted_forward,
                             test_join_no_sync_disagreement, test_join_sync_bn_needs_a_step,
                             test_join_unused_stays_none, NULL};
    return nbt_suite("ddp_join", "ddp_join", 60, tests);
}

int main(void) { return nbt_run_world(ddp_setup); }
