/* The NCCL process group on one GPU, as a world of one, with tensors of
 * real CUDA contexts: every collective and the dtypes NCCL takes, zero
 * counts, ordering after work queued on the compute stream, ordering of
 * later compute after a wait, agree, barrier, the device check, and the
 * header exchange of Note [Which collectives are checked] (distributed/pg_check.c):
 * the headers come back through the communicator, behind collectives
 * still queued, and every collective still gives its result when each
 * one checks (NABLA_DIST_CHECK=full). A mismatch needs two ranks, hence
 * two GPUs; its comparison and message are the Gloo path's, tested on
 * the CPU in tests/test_dist_mismatch.c.
 * Skipped (77) without CUDA in the build or without a visible GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_parity.h"
#include "distributed/internal.h"
#include "distributed/pg.h"
#include "testutil.h"

#if NABLA_HAVE_CUDA

static nb_pg *pg;
static nb_ctx *dev;

/* f64 host values -> a (n) tensor of dtype dt on the GPU. */
static nb_tensor *upload(nb_dtype dt, int64_t n, const double *v) {
    nb_ctx *host = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *h = nb_cast(host, nb_from_host(host, NB_F64, 1, &n, v), dt);
    nb_tensor *t = nb_from_host(dev, dt, 1, &n, h->data);
    nb_ctx_free(host);
    return t;
}

static void download(const nb_tensor *t, double *v) {
    double *got = nbt_values(t);
    memcpy(v, got, sizeof(double) * (size_t)nb_numel(t));
    free(got);
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
            nb_tensor *t = upload(dts[d], 1001, v);
            check_ok(nb_work_finish(nb_pg_all_reduce(pg, t, (nb_reduce_op)op)));
            download(t, got);
            for (int i = 0; i < 1001; i++) ck_assert_double_eq(got[i], v[i]);
        }
        nb_tensor *t = upload(dts[d], 1001, v);
        nb_tensor *o = nb_zeros(dev, dts[d], NB_SHAPE(1001));
        check_ok(nb_work_finish(nb_pg_broadcast(pg, t, 0)));
        check_ok(nb_work_finish(nb_pg_all_gather(pg, o, t)));
        download(o, got);
        for (int i = 0; i < 1001; i++) ck_assert_double_eq(got[i], v[i]);
        nb_fill_(o, 0);
        check_ok(nb_work_finish(nb_pg_reduce_scatter(pg, o, t, NB_REDUCE_SUM)));
        download(o, got);
        for (int i = 0; i < 1001; i++) ck_assert_double_eq(got[i], v[i]);
        nb_ctx_reset(dev);
    }
    nb_tensor *z = nb_zeros(dev, NB_F32, NB_SHAPE(0));
    check_ok(nb_work_finish(nb_pg_all_reduce(pg, z, NB_REDUCE_SUM)));
    check_ok(nb_work_finish(nb_pg_barrier(pg)));
    bool any, all;
    check_ok(nb_pg_agree(pg, true, &any, &all));
    ck_assert(any && all);
    check_ok(nb_pg_agree(pg, false, &any, &all));
    ck_assert(!any && !all);
    nb_ctx_reset(dev);
}
END_TEST

/* A collective sees what the compute stream wrote before it was issued:
 * the input holds ones, is zeroed on the compute stream (asynchronously,
 * behind a large fill that keeps the stream busy), then gathered; and an
 * op issued after the wait sees the collective's result: the output is
 * scaled on the compute stream right after nb_work_wait. */
START_TEST(test_ordered_with_compute) {
    const int64_t n = 1 << 22;
    nb_tensor *busy = nb_zeros(dev, NB_F32, NB_SHAPE(1 << 26));
    nb_tensor *in = nb_full(dev, NB_F32, 1, &n, 1.0), *out = nb_full(dev, NB_F32, 1, &n, 5.0);
    nb__cuda_sync(0);
    nb_fill_(busy, 3.0);
    nb_fill_(in, 2.0);
    nb_work *w = nb_pg_all_gather(pg, out, in);
    check_ok(nb_work_wait(w));
    nb_work_free(w);
    nb_scale_(out, 0.5);
    float x[2] = {0, 0};
    int64_t last = n - 1;
    x[0] = (float)nb_get(out, &last);
    int64_t first = 0;
    x[1] = (float)nb_get(out, &first);
    ck_assert_float_eq(x[0], 1.0f);
    ck_assert_float_eq(x[1], 1.0f);
    /* nb_work_test polls to completion just the same */
    nb_fill_(in, 4.0);
    w = nb_pg_all_reduce(pg, in, NB_REDUCE_SUM);
    bool done = false;
    while (!done) check_ok(nb_work_test(w, &done));
    nb_work_free(w);
    ck_assert_double_eq(nb_get(in, &last), 4.0);
    nb_ctx_reset(dev);
}
END_TEST

/* Many collectives in flight at once (more than the event pool keeps),
 * freed in any order: each result is right. */
START_TEST(test_many_in_flight) {
    enum { K = 80 };
    nb_tensor *t[K];
    nb_work *w[K];
    for (int k = 0; k < K; k++) {
        t[k] = nb_full(dev, NB_F32, NB_SHAPE(33), (double)k);
        w[k] = nb_pg_all_reduce(pg, t[k], NB_REDUCE_MAX);
    }
    for (int k = K - 1; k >= 0; k--) check_ok(nb_work_finish(w[k]));
    for (int k = 0; k < K; k++) {
        int64_t i = 32;
        ck_assert_double_eq(nb_get(t[k], &i), (double)k);
    }
    nb_ctx_reset(dev);
}
END_TEST

/* The exchange itself: a header made up here comes back as every rank's
 * (this rank's, in a world of one), also when issued behind an all-reduce
 * still running on the group's stream. */
START_TEST(test_headers_exchanged) {
    int64_t mine[NB__COLL_HEADER_WORDS] = {0x3143424e, 1, 0, 0, 123456789, 0}, all[NB__COLL_HEADER_WORDS];
    nb_tensor *big = nb_full(dev, NB_F32, NB_SHAPE(1 << 24), 1.0);
    nb_work *w = nb_pg_all_reduce(pg, big, NB_REDUCE_SUM);
    for (int round = 0; round < 3; round++) {
        memset(all, 0, sizeof all);
        mine[4] = 123456789 + round;
        int r = nb__nccl_exchange(pg->impl, mine, all, sizeof mine, true);
        ck_assert_msg(r == 0, "start: %d: %s", r, nb_last_error());
        while ((r = nb__nccl_exchange(pg->impl, mine, all, sizeof mine, false)) == 0) nb__sleep(1e-5);
        ck_assert_msg(r == 1, "poll: %d: %s", r, nb_last_error());
        for (int i = 0; i < NB__COLL_HEADER_WORDS; i++) ck_assert_int_eq(all[i], mine[i]);
    }
    check_ok(nb_work_finish(w));
    nb_ctx_reset(dev);
}
END_TEST

/* With every collective checking first (NABLA_DIST_CHECK=full), the
 * results are the same and a zero-count collective passes. */
START_TEST(test_every_collective_checked) {
    nb__dist_check saved = pg->check;
    pg->check = NB__CHECK_FULL;
    double v[257], got[257];
    for (int i = 0; i < 257; i++) v[i] = i - 100;
    for (int k = 0; k < 40; k++) {
        nb_tensor *t = upload(NB_F32, 257, v);
        check_ok(nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM)));
        check_ok(nb_work_finish(nb_pg_broadcast(pg, t, 0)));
        download(t, got);
        for (int i = 0; i < 257; i++) ck_assert_double_eq(got[i], v[i]);
        nb_ctx_reset(dev);
    }
    nb_tensor *z = nb_zeros(dev, NB_F32, NB_SHAPE(0));
    check_ok(nb_work_finish(nb_pg_all_reduce(pg, z, NB_REDUCE_SUM)));
    check_ok(nb_work_finish(nb_pg_barrier(pg)));
    pg->check = saved;
    nb_ctx_reset(dev);
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
    nbt_cuda_require();
    if (!(pg = nbt_nccl_world_of_one("test-nccl"))) return 1;
    dev = nb_ctx_new(nb_cuda(0), 0);
    Suite *s = suite_create("cuda_nccl");
    TCase *tc = tcase_create("nccl");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_world_of_one);
    tcase_add_test(tc, test_ordered_with_compute);
    tcase_add_test(tc, test_many_in_flight);
    tcase_add_test(tc, test_device_check);
    tcase_add_test(tc, test_headers_exchanged);
    tcase_add_test(tc, test_every_collective_checked);
    suite_add_tcase(s, tc);
    int rc = nbt_run(s);
    nb_ctx_free(dev);
    return nbt_pg_finish(pg, rc);
}

#else

int main(void) {
    fprintf(stderr, "skipped: this build has no CUDA\n");
    return 77;
}

#endif
