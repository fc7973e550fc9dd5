/* DDP and SyncBatchNorm on CUDA, in a world of one NCCL group on GPU 0
 * (NCCL allows one rank per GPU). NABLA_DDP_FORCE_BUCKETS=1 makes the
 * wrapper build its buckets anyway, so the gradients live in device
 * bucket memory, are all-reduced (averaged) by NCCL, rebuilt after the
 * first step, and cast by the bf16 hook on the device. Checked against
 * the same model trained with plain nb_backward; SyncBatchNorm against
 * nb_batch_norm on CUDA (a world of one has the same statistics).
 * Skipped (77) without CUDA in the build or without a visible GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_parity.h"
#include "nabla/ddp.h"
#include "testutil.h"

#if NABLA_HAVE_CUDA

static nb_pg *pg;

typedef struct twin {
    nb_ctx *meta, *params, *step;
    nb_module *m;
} twin;

/* The same MLP (the same seed) with its parameters on GPU 0. */
static twin make_mlp(void) {
    twin t;
    t.meta = nb_ctx_new(nb_cpu(), 0);
    t.params = nb_ctx_new(nb_cuda(0), 0);
    t.step = nb_ctx_new(nb_cuda(0), 0);
    nb_rng rng = nb_rng_make(42);
    t.m = nb_sequential_new(t.meta, 5,
                            (nb_module *[]){nb_linear_new(t.meta, NB_F32, 7, 33, true, &rng),
                                            nb_relu_new(t.meta),
                                            nb_linear_new(t.meta, NB_F32, 33, 17, true, &rng),
                                            nb_relu_new(t.meta),
                                            nb_linear_new(t.meta, NB_F32, 17, 3, true, &rng)});
    ck_assert_int_eq(nb_module_to(t.m, t.params), NB_OK);
    return t;
}

static void free_twin(twin *t) {
    nb_ctx_free(t->step);
    nb_ctx_free(t->params);
    nb_ctx_free(t->meta);
}

static nb_tensor *loss_of(twin *t, uint64_t seed) {
    nb_tensor *x = nbt_randn(t->step, NB_F32, NB_SHAPE(9, 7), seed);
    nb_tensor *y = nbt_randn(t->step, NB_F32, NB_SHAPE(9, 3), seed + 1);
    return nb_mse_loss(t->step, nb_module_forward(t->m, t->step, x), y);
}

static void expect_same_grads(nb_module *a, nb_module *b, double rtol) {
    int n = nb_module_named_parameters(a, NULL, 0);
    nb_named_tensor pa[16], pb[16];
    ck_assert_int_le(n, 16);
    nb_module_named_parameters(a, pa, n);
    nb_module_named_parameters(b, pb, n);
    for (int i = 0; i < n; i++) {
        ck_assert_msg(pa[i].tensor->grad && pb[i].tensor->grad, "%s has no gradient", pa[i].name);
        ck_assert(pa[i].tensor->grad->device.type == NB_DEVICE_CUDA);
        nbt_assert_tensors_close(pa[i].tensor->grad, pb[i].tensor->grad, 1e-7, rtol);
    }
}

static void check_ok(nb_status st) { ck_assert_msg(st == NB_OK, "status %d: %s", st, nb_last_error()); }

/* Several small buckets; steps 1 (registration order) and 2, 3 (rebuilt). */
static void ddp_vs_plain(nb_ddp_comm_hook hook, double rtol) {
    twin a = make_mlp(), b = make_mlp();
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.first_bucket_bytes = 64;
    o.bucket_cap_bytes = 1024;
    o.comm_hook = hook;
    nb_ddp *d = NULL;
    check_ok(nb_ddp_new(&d, a.m, pg, &o));
    ck_assert_int_gt(nb_ddp_num_buckets(d), 2);
    for (int step = 0; step < 3; step++) {
        nb_module_zero_grad(a.m);
        nb_module_zero_grad(b.m);
        check_ok(nb_ddp_backward(d, loss_of(&a, 100 + (uint64_t)step)));
        nb_backward(loss_of(&b, 100 + (uint64_t)step));
        expect_same_grads(a.m, b.m, rtol);
        ck_assert(nb_ddp_buckets_rebuilt(d));
        nb_ctx_reset(a.step);
        nb_ctx_reset(b.step);
    }
    /* no_sync: two local backwards, then one that reduces the sum */
    nb_module_zero_grad(a.m);
    nb_module_zero_grad(b.m);
    nb_ddp_set_no_sync(d, true);
    for (int k = 0; k < 2; k++) {
        check_ok(nb_ddp_backward(d, loss_of(&a, 200 + (uint64_t)k)));
        nb_backward(loss_of(&b, 200 + (uint64_t)k));
    }
    nb_ddp_set_no_sync(d, false);
    check_ok(nb_ddp_backward(d, loss_of(&a, 202)));
    nb_backward(loss_of(&b, 202));
    expect_same_grads(a.m, b.m, rtol);
    nb_ddp_step_stats st = nb_ddp_last_stats(d);
    ck_assert_int_eq(st.n_buckets, nb_ddp_num_buckets(d));
    for (int k = 0; k < st.n_buckets; k++) ck_assert(st.buckets[k].finish >= st.buckets[k].launch);
    nb_ddp_free(d); /* gradients back in their own (device) memory */
    expect_same_grads(a.m, b.m, rtol);
    free_twin(&a);
    free_twin(&b);
}

START_TEST(test_ddp_matches_plain_backward) { ddp_vs_plain(NB_DDP_HOOK_ALLREDUCE, 1e-6); }
END_TEST

START_TEST(test_ddp_bf16_hook) { ddp_vs_plain(NB_DDP_HOOK_BF16, 1e-2); }
END_TEST

/* SyncBatchNorm against nb_batch_norm, both on CUDA: outputs, the input,
 * weight and bias gradients, and the running statistics. */
static void sbn_case(int64_t n, int64_t c, int64_t s, bool affine) {
    nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
    int64_t shape[3] = {n, c, s};
    nb_tensor *x1 = nbt_randn_leaf(ctx, NB_F32, 3, shape, 5), *x2 = nbt_randn_leaf(ctx, NB_F32, 3, shape, 5);
    nb_scale_(x1, 3.0);
    nb_scale_(x2, 3.0);
    nb_tensor *w1 = NULL, *w2 = NULL, *b1 = NULL, *b2 = NULL;
    if (affine) {
        w1 = nbt_randn_leaf(ctx, NB_F32, 1, &c, 6);
        w2 = nbt_randn_leaf(ctx, NB_F32, 1, &c, 6);
        b1 = nbt_randn_leaf(ctx, NB_F32, 1, &c, 7);
        b2 = nbt_randn_leaf(ctx, NB_F32, 1, &c, 7);
    }
    nb_tensor *rm1 = nb_zeros(ctx, NB_F32, 1, &c), *rm2 = nb_zeros(ctx, NB_F32, 1, &c);
    nb_tensor *rv1 = nb_ones(ctx, NB_F32, 1, &c), *rv2 = nb_ones(ctx, NB_F32, 1, &c);
    nb_tensor *y1 = nb_sync_batch_norm(ctx, pg, x1, w1, b1, rm1, rv1, true, 0.1, 1e-5);
    nb_tensor *y2 = nb_batch_norm(ctx, x2, w2, b2, rm2, rv2, true, 0.1, 1e-5);
    ck_assert(y1->device.type == NB_DEVICE_CUDA);
    nbt_assert_tensors_close(y1, y2, 1e-5, 1e-5);
    nbt_assert_tensors_close(rm1, rm2, 1e-6, 1e-5);
    nbt_assert_tensors_close(rv1, rv2, 1e-6, 1e-5);
    nb_backward(nbt_weighted_sum(ctx, y1));
    nb_backward(nbt_weighted_sum(ctx, y2));
    nbt_assert_tensors_close(x1->grad, x2->grad, 1e-5, 1e-4);
    if (affine) {
        nbt_assert_tensors_close(w1->grad, w2->grad, 1e-5, 1e-4);
        nbt_assert_tensors_close(b1->grad, b2->grad, 1e-5, 1e-4);
    }
    /* eval mode: the running statistics, no communication */
    nb_tensor *e1 = nb_sync_batch_norm(ctx, pg, x1, w1, b1, rm1, rv1, false, 0.1, 1e-5);
    nb_tensor *e2 = nb_batch_norm(ctx, x2, w2, b2, rm2, rv2, false, 0.1, 1e-5);
    nbt_assert_tensors_close(e1, e2, 1e-5, 1e-5);
    nb_ctx_free(ctx);
}

START_TEST(test_sync_batch_norm_matches_batch_norm) {
    sbn_case(4, 3, 7, true);
    sbn_case(1, 5, 33, true);
    sbn_case(33, 2, 1, false);
    sbn_case(8, 1, 1000, true);
}
END_TEST

START_TEST(test_sync_batch_norm_f64) {
    nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(6, 4, 5), 9);
    nb_tensor *y = nb_sync_batch_norm(ctx, pg, x, NULL, NULL, NULL, NULL, true, 0.1, 1e-5);
    /* each channel of y: mean 0, biased variance var / (var + eps) */
    double *v = nbt_values(y);
    for (int ch = 0; ch < 4; ch++) {
        double sum = 0;
        for (int i = 0; i < 6; i++)
            for (int k = 0; k < 5; k++) sum += v[(i * 4 + ch) * 5 + k];
        ck_assert_double_eq_tol(sum / 30, 0, 1e-12);
    }
    free(v);
    nb_ctx_free(ctx);
}
END_TEST

/* One value per channel across the ranks: the CPU aborts at once; on CUDA
 * the count stays on the device, so the same message comes at the next
 * synchronisation (a deferred device check). Runs last. */
START_TEST(test_sync_batch_norm_one_value_per_channel) {
    nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(1, 3, 1), 5);
    nb_tensor *rm = nb_zeros(ctx, NB_F32, NB_SHAPE(3)), *rv = nb_ones(ctx, NB_F32, NB_SHAPE(3));
    (void)nb_sync_batch_norm(ctx, pg, x, NULL, NULL, rm, rv, true, 0.1, 1e-5);
    NBT_EXPECT_ABORT(nb_cuda_synchronize(nb_cuda(0)),
                     "nb_sync_batch_norm (cuda:0): the global batch has 1 value(s) per channel");
    nb_cuda_synchronize(nb_cuda(0)); /* reported once */
    nb_ctx_free(ctx);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    setenv("NABLA_DDP_FORCE_BUCKETS", "1", 1);
    if (!(pg = nbt_nccl_world_of_one("test-cuda-ddp"))) return 1;
    Suite *s = suite_create("cuda_ddp");
    TCase *tc = tcase_create("ddp");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_ddp_matches_plain_backward);
    tcase_add_test(tc, test_ddp_bf16_hook);
    tcase_add_test(tc, test_sync_batch_norm_matches_batch_norm);
    tcase_add_test(tc, test_sync_batch_norm_f64);
    tcase_add_test(tc, test_sync_batch_norm_one_value_per_channel);
    suite_add_tcase(s, tc);
    return nbt_pg_finish(pg, nbt_run(s));
}

#else

int main(void) {
    fprintf(stderr, "skipped: this build has no CUDA\n");
    return 77;
}

#endif
