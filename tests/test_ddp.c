/* DDP and SyncBatchNorm, on R ranks over Gloo (CTest runs this suite under
 * nbrun with 2 and 3 ranks, and alone as a world of one).
 *
 * The reference for every equivalence is computed on each rank by a plain
 * single-process run over the whole global batch: same initial parameters
 * (same seed), nb_backward instead of nb_ddp_backward, ordinary BatchNorm
 * instead of SyncBatchNorm. Rank r's shard of a global batch is rows
 * [offset(r), offset(r) + size(r)). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ddp_common.h"
#include "distributed/ddp_internal.h" /* nb__ddp_overlap_compute */

/* One training step on both sides: DDP on rank me's B rows of (x, y),
 * then the reference on all of them; the ranks' models must agree. */
static void step_both(nb_ctx *step, nb_ddp *ddp, nb_optim *opt, nb_module *ref, nb_optim *ropt, nb_tensor *x,
                      nb_tensor *y, int64_t B) {
    nb_tensor *loss = nb_cross_entropy(step, ddp_fwd(ddp, step, shard(step, x, me * B, B)),
                                       shard(step, y, me * B, B), NULL);
    ck_assert_int_eq(nb_ddp_backward(ddp, loss), NB_OK);
    nb_optim_step(opt);
    nb_optim_zero_grad(opt);
    nb_backward(nb_cross_entropy(step, nb_module_forward(ref, step, x), y, NULL));
    nb_optim_step(ropt);
    nb_optim_zero_grad(ropt);
    assert_same_on_all_ranks(nb_ddp_module(ddp));
}

/* ---- equivalence: MLP ---- */

DDP_TEST(test_mlp_equivalence) {
    const int64_t B = 4;
    nb_module *model = mlp_of(pctx, NB_F64, 16), *ref = mlp_of(pctx, NB_F64, 16);
    nb_ddp_options o = small_buckets(256, 512); /* several buckets even for this small model */
    nb_ddp *ddp = ddp_wrap(model, &o, 1);
    nb_optim *opt = adamw_for(model), *ropt = adamw_for(ref);
    for (int it = 0; it < 5; it++) {
        nb_ctx_reset(step);
        nb_tensor *x, *y;
        make_batch(step, R * B, 100 + it, &x, &y);
        step_both(step, ddp, opt, ref, ropt, x, y, B);
    }
    assert_models_close(model, ref, 1e-9);
    if (R > 1) ck_assert(nb_ddp_buckets_rebuilt(ddp));
    nb_ddp_free(ddp);
    nb_optim_free(opt);
    nb_optim_free(ropt);
}

/* ---- equivalence: CNN with SyncBatchNorm ---- */

DDP_TEST(test_cnn_sync_bn_equivalence) {
    const int64_t B = 3;
    nb_module *model = cnn(pctx), *ref = cnn(pctx);
    ck_assert_int_eq(nb_convert_sync_batchnorm(model, world), 1);
    ck_assert_str_eq(nb_module_type_name(nb_module_child(model, "1")), "SyncBatchNorm");
    ck_assert_ptr_nonnull(nb_module_find(model, "1.running_var"));
    nb_ddp *ddp = ddp_wrap(model, NULL, -1);
    nb_optim *opt = adamw_for(model), *ropt = adamw_for(ref);
    for (int it = 0; it < 5; it++) {
        nb_ctx_reset(step);
        nb_rng rng = nb_rng_make(200 + (uint64_t)it);
        nb_tensor *x = nb_rand_normal(step, NB_F64, NB_SHAPE(R * B, 1, 5, 5), 0.5, 2, &rng);
        nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(R * B), (int64_t[]){0, 1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2});
        step_both(step, ddp, opt, ref, ropt, x, y, B);
    }
    assert_models_close(model, ref, 1e-9); /* parameters and running statistics */
    nb_ddp_free(ddp);
    nb_optim_free(opt);
    nb_optim_free(ropt);
}

/* ---- SyncBatchNorm alone, unequal batches ---- */

NBT_CPU_TEST(test_sync_bn_unequal_batches) {
    const int64_t C = 3;
    int64_t total = 0, offset = 0;
    for (int r = 0; r < R; r++) {
        if (r == me) offset = total;
        total += r + 2; /* rank r holds r + 2 samples */
    }
    int64_t mine = me + 2;
    nb_rng rng = nb_rng_make(5);
    nb_tensor *xg = nb_rand_normal(ctx, NB_F64, NB_SHAPE(total, C, 2), 1, 3, &rng);
    nb_tensor *wr = nb_rand_normal(ctx, NB_F64, NB_SHAPE(total, C, 2), 0, 1, &rng); /* loss weights */
    nb_tensor *w = nb_from_host(ctx, NB_F64, NB_SHAPE(C), (double[]){1.5, -0.5, 2});
    nb_tensor *b = nb_from_host(ctx, NB_F64, NB_SHAPE(C), (double[]){0.1, 0.2, -0.3});
    nb_tensor *w2 = nb_clone(ctx, w), *b2 = nb_clone(ctx, b);
    nb_set_requires_grad(w, true);
    nb_set_requires_grad(b, true);
    nb_set_requires_grad(w2, true);
    nb_set_requires_grad(b2, true);
    nb_tensor *rm = nb_zeros(ctx, NB_F64, NB_SHAPE(C)), *rv = nb_ones(ctx, NB_F64, NB_SHAPE(C));
    nb_tensor *rm2 = nb_zeros(ctx, NB_F64, NB_SHAPE(C)), *rv2 = nb_ones(ctx, NB_F64, NB_SHAPE(C));
    /* reference: the concatenated batch on one process */
    nb_tensor *xr = nb_clone(ctx, xg);
    nb_set_requires_grad(xr, true);
    nb_tensor *yr = nb_batch_norm(ctx, xr, w2, b2, rm2, rv2, true, 0.1, 1e-5);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, yr, wr)));
    /* this rank's shard through SyncBatchNorm */
    nb_tensor *x = shard(ctx, xg, offset, mine);
    nb_set_requires_grad(x, true);
    nb_tensor *y = nb_sync_batch_norm(ctx, world, x, w, b, rm, rv, true, 0.1, 1e-5);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, y, shard(ctx, wr, offset, mine))));
    nbt_assert_tensors_close(y, nb_narrow(ctx, yr, 0, offset, mine), 1e-12, 1e-10);
    nbt_assert_tensors_close(rm, rm2, 1e-12, 1e-10);
    nbt_assert_tensors_close(rv, rv2, 1e-12, 1e-10);
    nbt_assert_tensors_close(x->grad, nb_narrow(ctx, xr->grad, 0, offset, mine), 1e-12, 1e-9);
    /* weight and bias gradients are local: their sum over ranks is the reference */
    ck_assert_int_eq(nb_work_finish(nb_pg_all_reduce(world, w->grad, NB_REDUCE_SUM)), NB_OK);
    ck_assert_int_eq(nb_work_finish(nb_pg_all_reduce(world, b->grad, NB_REDUCE_SUM)), NB_OK);
    nbt_assert_tensors_close(w->grad, w2->grad, 1e-12, 1e-9);
    nbt_assert_tensors_close(b->grad, b2->grad, 1e-12, 1e-9);
    /* eval mode: running statistics, no communication (so ranks may differ in count) */
    nb_tensor *ye = nb_sync_batch_norm(ctx, world, x, w, b, rm, rv, false, 0.1, 1e-5);
    nb_tensor *ye2 = nb_batch_norm(ctx, x, w, b, rm, rv, false, 0.1, 1e-5);
    nbt_assert_tensors_close(ye, ye2, 0, 0);
}

/* ---- no_sync ---- */

START_TEST(test_no_sync_accumulation) {
    const int64_t B = 2, K = 3;
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = mlp_of(pctx, NB_F64, 8), *ref = mlp_of(pctx, NB_F64, 8);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    nb_tensor *x, *y;
    make_batch(step, R * B * K, 300, &x, &y);
    for (int k = 0; k < K; k++) { /* micro-batch k: rows [(k R + me) B, +B) */
        nb_ddp_set_no_sync(ddp, k < K - 1);
        int64_t start = ((int64_t)k * R + me) * B;
        nb_tensor *loss = nb_cross_entropy(step, ddp_fwd(ddp, step, shard(step, x, start, B)),
                                           shard(step, y, start, B), NULL);
        ck_assert_int_eq(nb_ddp_backward(ddp, nb_div_scalar(step, loss, (double)K)), NB_OK);
    }
    nb_backward(nb_cross_entropy(step, nb_module_forward(ref, step, x), y, NULL));
    int n = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor p[8], q[8];
    ck_assert_int_le(n, 8);
    nb_module_named_parameters(model, p, n);
    nb_module_named_parameters(ref, q, n);
    for (int i = 0; i < n; i++) nbt_assert_tensors_close(p[i].tensor->grad, q[i].tensor->grad, 1e-13, 1e-10);
    nb_ddp_free(ddp);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* ---- unused parameters ---- */

DDP_TEST(test_unused_parameters) {
    for (int find = 0; find < 2; find++) {
        nb_module *root = nb_module_list_new(pctx);
        nb_rng rng = nb_rng_make(3);
        nb_module *a = nb_module_add(root, "a", nb_linear_new(pctx, NB_F64, F_IN, N_CLASSES, true, &rng));
        nb_module *skip = nb_module_add(root, "skipped", nb_linear_new(pctx, NB_F64, F_IN, N_CLASSES, true, &rng));
        nb_ddp_options o = NB_DDP_DEFAULTS;
        o.find_unused_parameters = find;
        nb_ddp *ddp;
        ck_assert_int_eq(nb_ddp_new(&ddp, root, world, &o), NB_OK);
        for (int it = 0; it < 2; it++) {
            nb_ctx_reset(step);
            nb_tensor *x, *y;
            make_batch(step, 4, 400 + (uint64_t)it, &x, &y);
            /* step 0 uses both branches, step 1 skips one */
            nb_tensor *logits = nb_module_forward(a, step, x);
            if (it == 0) logits = nb_add(step, logits, nb_module_forward(skip, step, x));
            nb_status st = nb_ddp_backward(ddp, nb_cross_entropy(step, logits, y, NULL));
            if (it == 0 || find || R == 1) {
                ck_assert_msg(st == NB_OK, "%s", nb_last_error());
            } else {
                ck_assert_int_eq(st, NB_ERR_INVALID);
                ck_assert_msg(strstr(nb_last_error(), "parameter skipped.weight") != NULL, "%s", nb_last_error());
                ck_assert(strstr(nb_last_error(), "find_unused_parameters") != NULL);
            }
            nb_module_zero_grad(root);
        }
        nb_ddp_free(ddp);
    }
}

/* ---- bucket rebuild ---- */

START_TEST(test_bucket_rebuild_agrees) {
    if (R == 1) return; /* no buckets at world size 1 */
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(9);
    /* registered second-layer-first, so registration order != execution order */
    nb_module *root = nb_module_list_new(pctx);
    nb_module *l2 = nb_module_add(root, "second", nb_linear_new(pctx, NB_F64, 16, N_CLASSES, true, &rng));
    nb_module *l1 = nb_module_add(root, "first", nb_linear_new(pctx, NB_F64, F_IN, 16, true, &rng));
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.first_bucket_bytes = o.bucket_cap_bytes = 8; /* one parameter per bucket */
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, root, world, &o), NB_OK);
    ck_assert_int_eq(nb_ddp_num_buckets(ddp), 4);
    int idx[4];
    nb_ddp_bucket_params(ddp, 0, idx, 4);
    ck_assert_int_eq(idx[0], 3); /* reverse registration: first.bias */
    nb_tensor *x, *y;
    make_batch(step, 4, 500, &x, &y);
    nb_tensor *h = nb_tanh(step, nb_module_forward(l1, step, x));
    ck_assert_int_eq(nb_ddp_backward(ddp, nb_cross_entropy(step, nb_module_forward(l2, step, h), y, NULL)), NB_OK);
    ck_assert(nb_ddp_buckets_rebuilt(ddp));
    /* now the execution order: second's gradients are ready first */
    int64_t assign[4];
    for (int b = 0; b < 4; b++) {
        ck_assert_int_eq(nb_ddp_bucket_params(ddp, b, idx, 1), 1);
        assign[b] = idx[0];
    }
    ck_assert(assign[0] == 0 || assign[0] == 1); /* second.weight or second.bias */
    ck_assert(assign[3] == 2 || assign[3] == 3);
    nb_tensor *a = nb_from_host(step, NB_I64, NB_SHAPE(4), assign), *a0 = nb_clone(step, a);
    ck_assert_int_eq(nb_work_finish(nb_pg_broadcast(world, a0, 0)), NB_OK);
    nbt_assert_tensors_close(a, a0, 0, 0);
    nb_ddp_free(ddp);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

/* ---- overlap and the trace ---- */

/* L f32 Linear(W) + GELU layers; c[2 l] is layer l's Linear (c: 2 L). */
static nb_module *layers(nb_ctx *pctx, int L, int64_t W, nb_module **c) {
    nb_rng rng = nb_rng_make(13);
    for (int l = 0; l < L; l++) {
        c[2 * l] = nb_linear_new(pctx, NB_F32, l == 0 ? F_IN : W, W, true, &rng);
        c[2 * l + 1] = nb_gelu_new(pctx, NB_GELU_EXACT);
    }
    return nb_sequential_new(pctx, 2 * L, c);
}

DDP_TEST(test_overlap_recorded) {
    if (R == 1) return;
    nb_module *c[12], *model = layers(pctx, 6, 192, c);
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.first_bucket_bytes = 64 << 10;
    o.bucket_cap_bytes = 64 << 10;
    o.record_timeline = true;
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, &o), NB_OK);
    int best = 0;
    for (int it = 0; it < 3; it++) {
        nb_ctx_reset(step);
        nb_tensor *x = nb_cast(step, nbt_randn(step, NB_F64, NB_SHAPE(512, F_IN), 600 + it), NB_F32);
        nb_tensor *out = ddp_fwd(ddp, step, x);
        ck_assert_int_eq(nb_ddp_backward(ddp, nb_mean_all(step, nb_mul(step, out, out))), NB_OK);
        nb_ddp_step_stats s = nb_ddp_last_stats(ddp);
        ck_assert_int_eq(s.n_buckets, nb_ddp_num_buckets(ddp));
        ck_assert_int_gt(s.n_buckets, 2);
        for (int b = 0; b < s.n_buckets; b++) {
            ck_assert(s.buckets[b].launch <= s.buckets[b].start + 1e-9);
            ck_assert(s.buckets[b].start <= s.buckets[b].finish);
            ck_assert(s.buckets[b].finish <= s.wait_s + 1e-6);
        }
        ck_assert(s.hidden_fraction >= 0 && s.hidden_fraction <= 1);
        if (s.launched_before_end > best) best = s.launched_before_end;
        nb_module_zero_grad(model);
    }
    ck_assert_msg(best >= 1, "no bucket was launched before backward ended");
    char path[64];
    snprintf(path, sizeof path, "ddp_trace_rank%d_of%d.json", me, R);
    ck_assert_int_eq(nb_ddp_write_trace(ddp, path), NB_OK);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    remove(path);
    ck_assert(strstr(buf, "\"traceEvents\"") && strstr(buf, "\"backward\"") && strstr(buf, "all-reduce bucket 0"));
    nb_ddp_free(ddp);
}

/* The figures of Note [Overlap across ranks] on a timeline worked by hand:
 * 2 ranks, 3 buckets; rank 0's backward ends at 10 s, rank 1's at 12 s.
 * Rank 0 starts bucket 1 at 9.5 (queued after its launch at 8, later than
 * rank 1's launch at 9) and bucket 2 at 11 (after bucket 1, before rank 1
 * launched it at 12). */
START_TEST(test_overlap_figures) {
    nb_ddp_bucket_time b0[3] = {{4, 4, 6, 0}, {8, 9.5, 11, 0}, {10, 11, 14, 0}},
                       b1[3] = {{5, 5, 6, 0}, {9, 9, 11, 0}, {12, 12, 14, 0}};
    for (int shifted = 0; shifted < 2; shifted++) {
        double off = shifted ? 100 : 0; /* rank 1's clock 100 s ahead */
        nb_ddp_bucket_time c1[3];
        for (int b = 0; b < 3; b++)
            c1[b] = (nb_ddp_bucket_time){b1[b].launch + off, b1[b].start + off, b1[b].finish + off, 0};
        trace_step s0 = {.bw_end = 10, .n = 3, .b = b0}, s1 = {.bw_end = 12 + off, .n = 3, .b = c1};
        trace_step *steps[2] = {&s0, &s1};
        double offset[2] = {0, off};
        nb_ddp_overlap o;
        memset(&o, 0xff, sizeof o);
        nb__ddp_overlap_compute(2, 1, steps, offset, &o);
        ck_assert_int_eq(o.steps, 1);
        /* per bucket, rank 0 then rank 1:
         *   running      2, 1.5, 3  |  1, 2, 2    = 11.5
         *   peer wait    1, 0,   1  |  0, 0, 0    = 2
         *   proper       1, 1.5, 2  |  1, 2, 2    = 9.5
         *   hidden (12)  1, 1.5, 0  |  1, 2, 0    = 5.5
         *   own hidden   2, 0.5, 0  |  1, 2, 0    = 5.5 */
        ck_assert_double_eq_tol(o.skew_s, 2, 1e-9);
        ck_assert_double_eq_tol(o.comm_s, 11.5 / 2, 1e-9);
        ck_assert_double_eq_tol(o.peer_wait_s, 2.0 / 2, 1e-9);
        ck_assert_double_eq_tol(o.hidden_fraction, 5.5 / 9.5, 1e-9);
        ck_assert_double_eq_tol(o.own_hidden_fraction, 5.5 / 11.5, 1e-9);
    }
}
END_TEST

static void sleep_hook(nb_tensor *leaf, void *user) {
    (void)leaf, (void)user;
    nanosleep(&(struct timespec){0, 60 * 1000 * 1000}, NULL);
}

/* The last rank sleeps 60 ms when its last layer's weight gradient is
 * ready: every later bucket waits for it on the other ranks. */
DDP_TEST(test_overlap_across_ranks) {
    enum { L = 4 };
    nb_module *c[2 * L], *model = layers(pctx, L, 128, c);
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.first_bucket_bytes = 32 << 10;
    o.bucket_cap_bytes = 32 << 10;
    nb_ddp *ddp;
    nb_ddp_overlap ov;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, &o), NB_OK);
    ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_ERR_INVALID); /* nothing recorded */
    ck_assert(strstr(nb_last_error(), "record_timeline") != NULL);
    nb_ddp_free(ddp);
    o.record_timeline = true;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, &o), NB_OK);
    nb_tensor *last_w = nb_module_find(c[2 * L - 2], "weight");
    enum { STEPS = 3 };
    for (int it = 0; it < 2 * STEPS; it++) {
        if (it == STEPS) { /* the first STEPS steps (the bucket rebuild among them) are left out */
            ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_OK);
            ck_assert_int_eq(ov.steps, R > 1 ? STEPS : 0); /* one rank: no buckets, nothing recorded */
            if (me == R - 1 && R > 1) nb_add_grad_hook(last_w, sleep_hook, NULL);
        }
        nb_ctx_reset(step);
        nb_tensor *x = nb_cast(step, nbt_randn(step, NB_F64, NB_SHAPE(64, F_IN), 700 + it), NB_F32);
        nb_tensor *out = ddp_fwd(ddp, step, x);
        ck_assert_int_eq(nb_ddp_backward(ddp, nb_mean_all(step, nb_mul(step, out, out))), NB_OK);
        nb_module_zero_grad(model);
    }
    ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_OK);
    ck_assert_int_eq(ov.steps, R > 1 ? STEPS : 0);
    ck_assert_int_eq(ov.steps_lost, 0);
    ck_assert_double_eq(ov.clock_error_s, 0); /* one host */
    ck_assert(ov.hidden_fraction >= 0 && ov.hidden_fraction <= 1);
    ck_assert(ov.own_hidden_fraction >= 0 && ov.own_hidden_fraction <= 1);
    ck_assert(ov.peer_wait_s >= 0 && ov.peer_wait_s <= ov.comm_s + 1e-12);
    if (R > 1) {
        ck_assert_int_gt(nb_ddp_num_buckets(ddp), 2);
        /* the sleeper ends >= 60 ms after the others; each of them waits for
         * its later launches: at most (R - 1) * 60 ms over R ranks per step,
         * less what the others' own backward covers (a few ms on a quiet
         * machine, 20 ms and more on a loaded one). Without the comparison
         * across ranks the peer wait is 0, so a third of the most is the bar. */
        ck_assert_msg(ov.skew_s > 0.045, "skew %g s", ov.skew_s);
        ck_assert_msg(ov.peer_wait_s > 0.020 * (R - 1) / R, "peer wait %g s of %g", ov.peer_wait_s, ov.comm_s);
    } else {
        ck_assert_double_eq(ov.comm_s, 0);
    }
    ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_OK); /* nothing new */
    ck_assert_int_eq(ov.steps, 0);
    if (R > 1) { /* a record over the store's limit: every rank fails alike, none waits */
        nb_ctx_reset(step);
        nb_tensor *x = nb_cast(step, nbt_randn(step, NB_F64, NB_SHAPE(64, F_IN), 800), NB_F32);
        nb_tensor *out = ddp_fwd(ddp, step, x);
        ck_assert_int_eq(nb_ddp_backward(ddp, nb_mean_all(step, nb_mul(step, out, out))), NB_OK);
        nb__ddp_overlap_record_cap = 200; /* the head alone is 120 bytes, one step of 3+ buckets over 200 */
        ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_ERR_INVALID);
        nb__ddp_overlap_record_cap = 0;
        ck_assert_msg(strstr(nb_last_error(), "call it more often") != NULL, "%s", nb_last_error());
        ck_assert_int_eq(nb_ddp_overlap_across_ranks(ddp, &ov), NB_OK); /* dropped: a fresh start */
        ck_assert_int_eq(ov.steps, 0);
        nb_module_zero_grad(model);
    }
    if (me == R - 1 && R > 1) ck_assert(nb_remove_grad_hook(last_w, sleep_hook, NULL));
    nb_ddp_free(ddp);
}

/* ---- bf16 compression ---- */

DDP_TEST(test_bf16_hook) {
    nb_module *model = mlp_of(pctx, NB_F32, 8), *ref = mlp_of(pctx, NB_F32, 8);
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.comm_hook = NB_DDP_HOOK_BF16;
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, &o), NB_OK);
    nb_tensor *x, *y;
    make_batch(step, R * 4, 700, &x, &y);
    nb_tensor *xf = nb_cast(step, x, NB_F32);
    nb_tensor *loss = nb_cross_entropy(step, nb_module_forward(model, step, shard(step, xf, me * 4, 4)),
                                       shard(step, y, me * 4, 4), NULL);
    ck_assert_int_eq(nb_ddp_backward(ddp, loss), NB_OK);
    nb_backward(nb_cross_entropy(step, nb_module_forward(ref, step, xf), y, NULL));
    nb_named_tensor p[4], q[4];
    nb_module_named_parameters(model, p, 4);
    nb_module_named_parameters(ref, q, 4);
    for (int i = 0; i < 4; i++) nbt_assert_tensors_close(p[i].tensor->grad, q[i].tensor->grad, 2e-3, 1e-2);
    nb_ddp_free(ddp);
}

/* ---- construction ---- */

START_TEST(test_mismatch_named) {
    if (R == 1) return;
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0);
    nb_module *model = mlp_of(pctx, NB_F64, me == R - 1 ? 12 : 16); /* the last rank differs */
    nb_ddp *ddp = NULL;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_ERR_MISMATCH);
    ck_assert_ptr_null(ddp);
    char expect[160];
    snprintf(expect, sizeof expect, "differ at parameter 0: rank 0 has \"0.weight f64 (16, 6)\", rank %d has "
             "\"0.weight f64 (12, 6)\"", R - 1);
    ck_assert_msg(strstr(nb_last_error(), expect) != NULL, "%s", nb_last_error());
    nb_ctx_free(pctx);
}
END_TEST

/* Note [Freed handles]: a wrapper used after nb_ddp_free aborts with a
 * message naming the call and the free, instead of reading freed memory. */
DDP_TEST(test_freed_wrapper_named) {
    nb_module *model = mlp_of(pctx, NB_F64, 16);
    nb_ddp *ddp = NULL;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    nb_ddp_free(ddp);
    nb_tensor *x = nb_zeros(step, NB_F64, NB_SHAPE(2, 6));
    nb_tensor *y = NULL;
    NBT_EXPECT_ABORT(nb_ddp_forward(ddp, step, x, &y), "nb_ddp_forward: the DDP handle was freed (nb_ddp_free)");
    NBT_EXPECT_ABORT(nb_ddp_module(ddp), "nb_ddp_module: the DDP handle was freed (nb_ddp_free)");
    NBT_EXPECT_ABORT(nb_ddp_free(ddp), "nb_ddp_free: the DDP handle was freed (nb_ddp_free)");
}

DDP_TEST(test_gradients_are_bucket_views) {
    nb_module *model = mlp_of(pctx, NB_F64, 8);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    nb_named_tensor p[4];
    nb_module_named_parameters(model, p, 4);
    /* no gradient yet: the wrapper gives none (Note [Unused parameters] in
     * distributed/ddp.c), and the first backward writes them */
    for (int i = 0; i < 4; i++) ck_assert_msg(p[i].tensor->grad == NULL, "%s", p[i].name);
    nb_status st = nb_ddp_backward(ddp, loss_of(step, model, 0, 0, false));
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    if (R > 1) {
        /* all four in one bucket: their gradients are consecutive slices of
         * one buffer (in the order the first backward made them ready) */
        ck_assert_int_eq(nb_ddp_num_buckets(ddp), 1);
        const char *lo = p[0].tensor->grad->data, *hi = lo;
        int64_t total = 0;
        for (int i = 0; i < 4; i++) {
            const char *at = p[i].tensor->grad->data;
            lo = at < lo ? at : lo;
            hi = at + nb_numel(p[i].tensor) * 8 > hi ? at + nb_numel(p[i].tensor) * 8 : hi;
            total += nb_numel(p[i].tensor) * 8;
            for (int j = 0; j < i; j++) /* no two overlap */
                ck_assert(at + nb_numel(p[i].tensor) * 8 <= (const char *)p[j].tensor->grad->data ||
                          (const char *)p[j].tensor->grad->data + nb_numel(p[j].tensor) * 8 <= at);
        }
        ck_assert_int_eq(hi - lo, total); /* no gap between them */
    } else {
        ck_assert_int_eq(nb_ddp_num_buckets(ddp), 0); /* world size 1: nothing */
    }
    nb_ddp_free(ddp);
    /* freed: the gradients have memory of their own again, values kept */
    for (int i = 0; i < 4; i++) ck_assert(p[i].tensor->grad == NULL || p[i].tensor->grad->ctx == pctx);
}

/* Note [Default bucket cap] in distributed/ddp_buckets.c, in the wrapper:
 * 40 f64 Linear(128, 128) layers, each a weight of 131072 bytes and a bias
 * of 1024, 5283840 bytes in all. Worked by hand: the cap is 5283840 / 16 =
 * 330240 bytes (over the 256 KiB floor). In reverse registration order
 * (layer l's weight is parameter 2 l, its bias 2 l + 1), the first bucket
 * closes at 1 MiB: 7 layers and a bias are 925696 bytes, 8 layers 1056768,
 * so it holds layers 39-32 (16 parameters). Then 2 layers and a bias are
 * 265216 < 330240 and 3 layers 396288: ten buckets of three layers (31-2),
 * and the last, layers 1-0, four parameters. 12 buckets; the 256 KiB floor
 * would make 17 (two layers each), PyTorch's 25 MiB two. */
START_TEST(test_default_bucket_cap) {
    if (R == 1) return; /* no buckets at world size 1 */
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(3);
    nb_module *c[40];
    for (int l = 0; l < 40; l++) c[l] = nb_linear_new(pctx, NB_F64, 128, 128, true, &rng);
    nb_module *model = nb_sequential_new(pctx, 40, c);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    ck_assert_int_eq(nb_ddp_num_buckets(ddp), 12);
    int idx[16];
    ck_assert_int_eq(nb_ddp_bucket_params(ddp, 0, idx, 16), 16);
    ck_assert_int_eq(idx[0], 79); /* layer 39's bias */
    ck_assert_int_eq(idx[15], 64); /* layer 32's weight */
    for (int b = 1; b <= 10; b++) {
        ck_assert_int_eq(nb_ddp_bucket_params(ddp, b, idx, 16), 6);
        int top = 31 - 3 * (b - 1); /* the bucket's layers: top, top - 1, top - 2 */
        ck_assert_int_eq(idx[0], 2 * top + 1);
        ck_assert_int_eq(idx[5], 2 * (top - 2));
    }
    ck_assert_int_eq(nb_ddp_bucket_params(ddp, 11, idx, 16), 4);
    ck_assert(idx[0] == 3 && idx[3] == 0);
    nb_ddp_free(ddp);
    /* an explicit cap is used as given: 25 MiB, two buckets */
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.bucket_cap_bytes = 25u << 20;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, &o), NB_OK);
    ck_assert_int_eq(nb_ddp_num_buckets(ddp), 2);
    nb_ddp_free(ddp);
    nb_ctx_free(pctx);
}
END_TEST

/* ---- gradients set to none (Note [Gradients set to none] in autograd/backward.c) ---- */

/* Every parameter of a and b has the same values, compared as numbers. */
static void assert_same_params(nb_module *a, nb_module *b) {
    nb_named_tensor p[8], q[8];
    int n = nb_module_named_parameters(a, p, 8);
    ck_assert_int_eq(nb_module_named_parameters(b, q, 8), n);
    for (int i = 0; i < n; i++) {
        int64_t k = nb_numel(p[i].tensor);
        double *u = malloc(sizeof *u * (size_t)k), *v = malloc(sizeof *v * (size_t)k);
        nb_to_host(p[i].tensor, u);
        nb_to_host(q[i].tensor, v);
        for (int64_t j = 0; j < k; j++)
            ck_assert_msg(u[j] == v[j], "rank %d: %s[%lld]: %.17g and %.17g", me, p[i].name, (long long)j,
                          u[j], v[j]);
        free(u);
        free(v);
    }
}

/* The same DDP training with nb_optim_zero_grad and with
 * nb_optim_zero_grad_to_none: equal parameters after every step, also
 * where branch b gets no gradient on the odd ranks (find_unused_parameters:
 * the reducer zeroes its NULL gradient's bucket slice before the
 * all-reduce, which is the old call's zeros). Gradients set to none read
 * NULL until the next backward. Owners that handle the memory themselves
 * are refused. */
DDP_TEST(test_grad_set_to_none) {
    nb_module *m[2];
    nb_ddp *d[2];
    nb_optim *o[2];
    for (int k = 0; k < 2; k++) {
        m[k] = nb_module_list_new(pctx);
        nb_rng rng = nb_rng_make(3);
        nb_module_add(m[k], "a", nb_linear_new(pctx, NB_F64, F_IN, N_CLASSES, true, &rng));
        nb_module_add(m[k], "b", nb_linear_new(pctx, NB_F64, F_IN, N_CLASSES, true, &rng));
        nb_ddp_options opts = small_buckets(64, 128);
        opts.find_unused_parameters = true;
        d[k] = ddp_wrap(m[k], &opts, 1);
        o[k] = adamw_for(m[k]);
    }
    for (int it = 0; it < 4; it++) {
        nb_ctx_reset(step);
        nb_tensor *x, *y;
        make_batch(step, R * 4, 500 + (uint64_t)it, &x, &y);
        x = shard(step, x, me * 4, 4);
        y = shard(step, y, me * 4, 4);
        bool skip = R > 1 && it % 2 == 1 && me % 2 == 1;
        for (int k = 0; k < 2; k++) {
            nb_tensor *logits = nb_module_forward(nb_module_child(m[k], "a"), step, x);
            if (!skip) logits = nb_add(step, logits, nb_module_forward(nb_module_child(m[k], "b"), step, x));
            nb_status st = nb_ddp_backward(d[k], nb_cross_entropy(step, logits, y, NULL));
            ck_assert_msg(st == NB_OK, "%s", nb_last_error());
            nb_optim_step(o[k]);
            if (k == 0) nb_optim_zero_grad(o[k]);
            else nb_optim_zero_grad_to_none(o[k]);
        }
        nb_named_tensor p[4];
        nb_module_named_parameters(m[1], p, 4);
        for (int i = 0; i < 4; i++) ck_assert_ptr_null(p[i].tensor->grad);
        assert_same_params(m[0], m[1]);
    }
    if (R > 1) {
        ck_assert_int_eq(nb_ddp_set_zero(d[1], o[1]), NB_OK);
        NBT_EXPECT_ABORT(nb_optim_zero_grad_to_none(o[1]), "nb_optim_zero_grad_to_none: this optimizer is "
                         "sharded over the ranks (ZeRO, nb_ddp_set_zero; or FSDP");
        ck_assert_int_eq(nb_ddp_set_zero(d[1], NULL), NB_OK);
        ck_assert_int_eq(nb_ddp_set_optimizer(d[1], o[1]), NB_OK);
        NBT_EXPECT_ABORT(nb_optim_zero_grad_to_none(o[1]), "this optimizer is stepped per bucket");
        ck_assert_int_eq(nb_ddp_set_optimizer(d[1], NULL), NB_OK);
    }
    for (int k = 0; k < 2; k++) {
        nb_ddp_free(d[k]);
        nb_optim_free(o[k]);
    }
}

/* nb_ddp_free gives each gradient memory of its own again: a gradient
 * set to none stays none (a None grad is None with or without a wrapper,
 * never zeros for the optimizer to step on), that memory its home, which
 * the next backward writes: the same values as after nb_optim_zero_grad.
 * The memory the gradients had before the wrapper was given back by
 * nb_optim_zero_grad_to_none (their flat segment held no gradient): a
 * gradient that holds one at the free (a backward after it) gets new
 * memory with its value. */
static void free_keeps_none(nb_ctx *pctx, nb_ctx *step, bool backward_after) {
    nb_module *model = mlp_of(pctx, NB_F64, 8);
    nb_named_tensor p[4];
    nb_module_named_parameters(model, p, 4);
    nb_optim *opt = adamw_for(model);
    nb_backward(loss_of(step, model, 0, 0, false)); /* gradients of their own before the wrapper */
    for (int i = 0; i < 4; i++) ck_assert_ptr_nonnull(p[i].tensor->grad);
    nb_ddp *ddp;
    ck_assert_int_eq(nb_ddp_new(&ddp, model, world, NULL), NB_OK);
    nb_ctx_reset(step);
    nb_optim_zero_grad(opt);
    ck_assert_int_eq(nb_ddp_backward(ddp, loss_of(step, model, 1, 0, false)), NB_OK);
    nb_optim_zero_grad_to_none(opt);
    if (backward_after) {
        nb_ctx_reset(step);
        ck_assert_int_eq(nb_ddp_backward(ddp, loss_of(step, model, 3, 0, false)), NB_OK);
        nb_tensor *kept[4];
        for (int i = 0; i < 4; i++) kept[i] = nb_clone(pctx, p[i].tensor->grad);
        nb_ddp_free(ddp);
        for (int i = 0; i < 4; i++) {
            ck_assert(p[i].tensor->grad && p[i].tensor->grad->ctx == pctx);
            nbt_assert_tensors_close(p[i].tensor->grad, kept[i], 0, 0);
        }
        nb_optim_free(opt);
        return;
    }
    nb_ddp_free(ddp);
    for (int i = 0; i < 4; i++) ck_assert_msg(p[i].tensor->grad == NULL, "%s has a gradient", p[i].name);
    nb_ctx_reset(step);
    nb_backward(loss_of(step, model, 2, 0, false)); /* written into the home */
    nb_tensor *g[4];
    for (int i = 0; i < 4; i++) {
        ck_assert_ptr_nonnull(p[i].tensor->grad);
        g[i] = nb_clone(pctx, p[i].tensor->grad);
    }
    nb_ctx_reset(step);
    nb_optim_zero_grad(opt);
    nb_backward(loss_of(step, model, 2, 0, false)); /* added to zeros */
    for (int i = 0; i < 4; i++) nbt_assert_tensors_close(p[i].tensor->grad, g[i], 0, 0);
    nb_optim_free(opt);
}

DDP_TEST(test_free_keeps_none) {
    free_keeps_none(pctx, step, false);
    free_keeps_none(pctx, step, true);
}

/* Cross-entropy of child `name` of m on rows [start, start + n) of (x, y). */
static nb_tensor *head_loss(nb_ctx *step, nb_module *m, const char *name, nb_tensor *x, nb_tensor *y,
                            int64_t start, int64_t n) {
    return nb_cross_entropy(step, nb_module_forward(nb_module_child(m, name), step, shard(step, x, start, n)),
                            shard(step, y, start, n), NULL);
}

/* Note [Unused parameters] in distributed/ddp.c: head "b" is unused on
 * every rank, head "c" is used on rank 0 only, head "a" everywhere; AdamW
 * with weight decay, 3 steps, the gradients cleared before each, by
 * nb_optim_zero_grad_to_none or by nb_optim_zero_grad. Either way b's
 * gradients are NULL after every backward (also after the bucket rebuild
 * that ends the first: b never had a gradient, and the wrapper gives it
 * none) and its values stay bit for bit, as in one process (PyTorch's DDP
 * leaves a globally unused parameter's None grad alone, and its
 * zero_grad leaves a None grad None); had the wrapper given b zeros, AdamW
 * would decay it, p (1 - lr wd) per step. c gets rank 0's gradient /
 * world on every rank. The reference: one process, nb_backward of
 * CE(a(X), Y) + CE(c(X0), Y0) / world over the whole batch X and rank
 * 0's rows X0, the same optimizer. */
static void unused_on_every_rank(nb_ctx *pctx, nb_ctx *step, bool to_none, size_t first, size_t cap) {
    const int64_t B = 4;
    nb_module *m = three_heads(pctx), *ref = three_heads(pctx), *init = three_heads(pctx);
    nb_ddp_options o = small_buckets(first, cap);
    o.find_unused_parameters = true;
    nb_ddp *ddp = ddp_wrap(m, &o, -1);
    nb_optim *opt = adamw_for(m), *ropt = adamw_for(ref);
    nb_named_tensor p[6], q[6], b0[2];
    ck_assert_int_eq(nb_module_named_parameters(m, p, 6), 6);
    nb_module_named_parameters(ref, q, 6);
    nb_module_named_parameters(nb_module_child(init, "b"), b0, 2);
    ck_assert_str_eq(p[2].name, "b.weight");
    ck_assert_str_eq(p[3].name, "b.bias");
    for (int it = 0; it < 3; it++) {
        nb_ctx_reset(step);
        if (to_none) { /* before each step, as PyTorch's loop */
            nb_optim_zero_grad_to_none(opt);
            nb_optim_zero_grad_to_none(ropt);
        } else {
            nb_optim_zero_grad(opt);
            nb_optim_zero_grad(ropt);
        }
        nb_tensor *x, *y;
        make_batch(step, R * B, 700 + (uint64_t)it, &x, &y);
        nb_tensor *loss = head_loss(step, m, "a", x, y, me * B, B);
        if (me == 0) loss = nb_add(step, loss, head_loss(step, m, "c", x, y, 0, B));
        nb_status st = nb_ddp_backward(ddp, loss);
        ck_assert_msg(st == NB_OK, "%s", nb_last_error());
        nb_tensor *rloss = nb_add(step, head_loss(step, ref, "a", x, y, 0, R * B),
                                  nb_div_scalar(step, head_loss(step, ref, "c", x, y, 0, B), (double)R));
        nb_backward(rloss);
        for (int i = 0; i < 6; i++) {
            bool in_b = strncmp(p[i].name, "b.", 2) == 0;
            if (in_b) {
                ck_assert_msg(p[i].tensor->grad == NULL, "rank %d, step %d: %s has a gradient", me, it, p[i].name);
            } else {
                ck_assert_msg(p[i].tensor->grad != NULL, "rank %d, step %d: %s", me, it, p[i].name);
                nbt_assert_tensors_close(p[i].tensor->grad, q[i].tensor->grad, 1e-13, 1e-10);
            }
        }
        nb_optim_step(opt);
        nb_optim_step(ropt);
        assert_same_on_all_ranks(m);
        for (int k = 0; k < 2; k++)
            nbt_assert_tensors_close(p[2 + k].tensor, b0[k].tensor, 0, 0); /* bit for bit */
    }
    for (int i = 0; i < 6; i++)
        if (strncmp(p[i].name, "b.", 2) != 0)
            nbt_assert_tensors_close(p[i].tensor, q[i].tensor, 0, 1e-9);
    nb_ddp_free(ddp);
    nb_optim_free(opt);
    nb_optim_free(ropt);
}

DDP_TEST(test_unused_on_every_rank) {
    for (int to_none = 1; to_none >= 0; to_none--) {
        unused_on_every_rank(pctx, step, to_none, 64, 128); /* b's tensors in buckets of their own or shared */
        unused_on_every_rank(pctx, step, to_none, 0, 0);    /* one bucket for all six */
    }
}

static Suite *suite(void) {
    const TTest *tests[] = {test_mlp_equivalence, test_cnn_sync_bn_equivalence, test_sync_bn_unequal_batches,
                             test_no_sync_accumulation, test_unused_parameters, test_bucket_rebuild_agrees,
                             test_overlap_recorded, test_overlap_figures, test_overlap_across_ranks,
                             test_bf16_hook, test_mismatch_named, test_freed_wrapper_named,
                             test_gradients_are_bucket_views, test_grad_set_to_none, test_unused_on_every_rank,
                             test_free_keeps_none,
                             test_default_bucket_cap, NULL};
    return nbt_suite("ddp", "ddp", 120, tests);
}

int main(void) { return nbt_run_world(ddp_setup); }
