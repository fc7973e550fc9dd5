/* The NCCL process group on one GPU, as a world of one: every collective
 * and the dtypes NCCL takes, zero counts, ordering after work queued on
 * the compute stream, agree, barrier, and the device check. Skipped (77)
 * without CUDA in the build or without a visible GPU.
 *
 * nabla has no CUDA contexts yet, so the tensors here are made by hand:
 * the public struct around cudaMalloc'd memory. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"
#include "testutil.h"

#if NABLA_HAVE_CUDA
#include <cuda_runtime.h>

static nb_pg *pg;

static nb_tensor *dev_tensor(nb_dtype dt, int64_t n) {
    nb_tensor *t = calloc(1, sizeof *t);
    t->dtype = dt;
    t->device = nb_pg_device(pg);
    t->ndim = 1;
    t->shape[0] = n;
    t->strides[0] = 1;
    ck_assert_int_eq(cudaMalloc(&t->data, (size_t)(n ? n : 1) * nb_dtype_size(dt)), cudaSuccess);
    return t;
}

static void dev_free(nb_tensor *t) {
    cudaFree(t->data);
    free(t);
}

/* Host values (as f64) <-> a device tensor of any dtype, through a CPU tensor. */
static void upload(nb_tensor *t, const double *v) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *h = nb_cast(ctx, nb_from_host(ctx, NB_F64, NB_SHAPE(t->shape[0]), v), t->dtype);
    cudaMemcpy(t->data, h->data, (size_t)t->shape[0] * nb_dtype_size(t->dtype), cudaMemcpyHostToDevice);
    nb_ctx_free(ctx);
}

static void download(const nb_tensor *t, double *v) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *h = nb_empty(ctx, t->dtype, NB_SHAPE(t->shape[0]));
    cudaMemcpy(h->data, t->data, (size_t)t->shape[0] * nb_dtype_size(t->dtype), cudaMemcpyDeviceToHost);
    nb_to_host_f64(h, v);
    nb_ctx_free(ctx);
}

static void check_ok(nb_status st) { ck_assert_msg(st == NB_OK, "status %d: %s", st, nb_last_error()); }

START_TEST(test_world_of_one) {
    ck_assert_int_eq(nb_pg_size(pg), 1);
    ck_assert_int_eq(nb_pg_backend_of(pg), NB_PG_NCCL);
    const nb_dtype dts[] = {NB_F32, NB_F64, NB_BF16, NB_F16, NB_I32, NB_I64};
    double v[1001], got[1001];
    for (int i = 0; i < 1001; i++) v[i] = (i % 17) - 8;
    for (int d = 0; d < 6; d++) {
        for (int op = NB_REDUCE_SUM; op <= NB_REDUCE_MAX; op++) {
            if (op == NB_REDUCE_AVG && !nb_dtype_is_float(dts[d])) continue;
            nb_tensor *t = dev_tensor(dts[d], 1001);
            upload(t, v);
            check_ok(nb_work_finish(nb_pg_all_reduce(pg, t, (nb_reduce_op)op)));
            download(t, got);
            for (int i = 0; i < 1001; i++) ck_assert_double_eq(got[i], v[i]);
            dev_free(t);
        }
        nb_tensor *t = dev_tensor(dts[d], 1001), *o = dev_tensor(dts[d], 1001);
        upload(t, v);
        check_ok(nb_work_finish(nb_pg_broadcast(pg, t, 0)));
        check_ok(nb_work_finish(nb_pg_all_gather(pg, o, t)));
        download(o, got);
        for (int i = 0; i < 1001; i++) ck_assert_double_eq(got[i], v[i]);
        check_ok(nb_work_finish(nb_pg_reduce_scatter(pg, o, t, NB_REDUCE_SUM)));
        download(o, got);
        for (int i = 0; i < 1001; i++) ck_assert_double_eq(got[i], v[i]);
        dev_free(t);
        dev_free(o);
    }
    nb_tensor *z = dev_tensor(NB_F32, 0);
    check_ok(nb_work_finish(nb_pg_all_reduce(pg, z, NB_REDUCE_SUM)));
    dev_free(z);
    check_ok(nb_work_finish(nb_pg_barrier(pg)));
    bool any, all;
    check_ok(nb_pg_agree(pg, true, &any, &all));
    ck_assert(any && all);
}
END_TEST

/* A collective sees what the compute stream wrote before it was issued:
 * the input is filled with NaN patterns synchronously, then zeroed on the
 * compute stream (asynchronously), then gathered. */
START_TEST(test_ordered_after_compute) {
    const size_t n = 1 << 22;
    nb_tensor *in = dev_tensor(NB_F32, (int64_t)n), *out = dev_tensor(NB_F32, (int64_t)n);
    cudaMemset(in->data, 0xff, n * 4);
    cudaMemset(out->data, 0xff, n * 4);
    cudaMemsetAsync(in->data, 0, n * 4, 0);
    nb_work *w = nb_pg_all_gather(pg, out, in);
    bool done = false;
    while (!done) check_ok(nb_work_test(w, &done));
    nb_work_free(w);
    float x = 1;
    cudaMemcpy(&x, (float *)out->data + n - 1, 4, cudaMemcpyDeviceToHost);
    ck_assert_float_eq(x, 0);
    dev_free(in);
    dev_free(out);
}
END_TEST

START_TEST(test_device_check) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *c = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_pg_all_reduce(pg, c, NB_REDUCE_SUM), "tensor is on cpu but the group's nccl backend works on cuda:");
    nb_ctx_free(ctx);
}
END_TEST

int main(void) {
    if (nb__cuda_device_count() == 0) {
        fprintf(stderr, "skipped: no GPU visible\n");
        return 77;
    }
    setenv("CK_FORK", "no", 1); /* one communicator for every test */
    nb_dist_env env;
    memset(&env, 0, sizeof env);
    env.world_size = env.local_world_size = 1;
    snprintf(env.master_addr, sizeof env.master_addr, "127.0.0.1");
    snprintf(env.run_id, sizeof env.run_id, "test-nccl");
    env.source = "none";
    nb_status st = nb_pg_init_env(&pg, &env, &(nb_pg_options){NB_PG_NCCL, 60});
    if (st != NB_OK) {
        fprintf(stderr, "nb_pg_init: %s\n", nb_last_error());
        return 1;
    }
    Suite *s = suite_create("cuda_nccl");
    TCase *tc = tcase_create("nccl");
    tcase_add_test(tc, test_world_of_one);
    tcase_add_test(tc, test_ordered_after_compute);
    tcase_add_test(tc, test_device_check);
    suite_add_tcase(s, tc);
    int rc = nbt_run(s);
    if (nb_pg_free(pg) != NB_OK) {
        fprintf(stderr, "nb_pg_free: %s\n", nb_last_error());
        rc = 1;
    }
    return rc;
}

#else

int main(void) {
    fprintf(stderr, "skipped: this build has no CUDA\n");
    return 77;
}

#endif
