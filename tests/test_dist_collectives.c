/* Process groups over Gloo: every collective, dtype and reduction against
 * closed forms, zero and odd counts, async handles, barrier, agree,
 * subgroups, and the argument checks.
 *
 * Every rank runs this same suite (CTest starts it under nbrun with 2, 3
 * and 4 ranks, and alone as a world of one), in CK_NOFORK mode: the
 * tests share the world group made in main, and every rank issues the
 * same collectives in the same order. Rank r's element i is value(r, i),
 * chosen so that sums over up to 4 ranks are exact in every dtype. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "distributed/pg.h"
#include "nabla/dist.h"
#include "testutil.h"

static nb_pg *world;
static int R, me;

static const nb_dtype dtypes[] = {NB_F32, NB_F64, NB_BF16, NB_F16, NB_I32, NB_I64};
#define N_DTYPES 6

static double value(nb_dtype dt, int r, int64_t i) {
    switch (dt) {
    case NB_F32:
    case NB_F64: return (r + 1) * 0.5 + (double)(i % 13) - 6;
    case NB_BF16:
    case NB_F16: return (r + 1) + (double)(i % 5) - 2;
    case NB_I32: return (r + 1) * 1000003.0 + (double)(i * 7) - (double)(i % 3) * 100000;
    case NB_I64: return (double)((int64_t)(r + 1) << 40) + (double)i;
    default: return 0;
    }
}

/* A rank's input: value(r, i) for i < n, in dtype. */
static nb_tensor *input(nb_ctx *ctx, nb_dtype dt, int r, int64_t n, int64_t offset) {
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = value(dt, r, offset + i);
    nb_tensor *t64 = nb_from_host(ctx, NB_F64, NB_SHAPE(n), v);
    free(v);
    return dt == NB_F64 ? t64 : nb_cast(ctx, t64, dt);
}

/* What op over all ranks of value(., i) is, rounded as the dtype stores it. */
static double expected(nb_dtype dt, nb_reduce_op op, int64_t i) {
    double acc = value(dt, 0, i);
    for (int r = 1; r < R; r++) {
        double x = value(dt, r, i);
        if (op == NB_REDUCE_SUM || op == NB_REDUCE_AVG) acc += x;
        else if (op == NB_REDUCE_MIN) acc = x < acc ? x : acc;
        else acc = x > acc ? x : acc;
    }
    if (op == NB_REDUCE_AVG) {
        if (dt == NB_BF16) return nb_bf16_to_f32(nb_f32_to_bf16((float)(acc / R)));
        if (dt == NB_F16) return nb_f16_to_f32(nb_f32_to_f16((float)(acc / R)));
        if (dt == NB_F32) return (float)(acc / R);
        return acc / R;
    }
    return acc;
}

static const char *op_name(nb_reduce_op op) {
    static const char *names[] = {"sum", "avg", "min", "max"};
    return names[op];
}

static void check_ok(nb_status st) { ck_assert_msg(st == NB_OK, "status %d: %s", st, nb_last_error()); }

static void assert_expected(const nb_tensor *t, nb_dtype dt, nb_reduce_op op, int64_t offset,
                            const char *what) {
    int64_t n = nb_numel(t);
    double *got = malloc((size_t)(n ? n : 1) * sizeof *got);
    nb_to_host_f64(t, got);
    for (int64_t i = 0; i < n; i++) {
        double want = expected(dt, op, offset + i);
        ck_assert_msg(got[i] == want, "%s %s %s count %" PRId64 ": element %" PRId64 " is %.17g, want %.17g",
                      what, nb_dtype_name(dt), op_name(op), n, i, got[i], want);
    }
    free(got);
}

START_TEST(test_all_reduce) {
    const int64_t counts[] = {0, 1, 7, 1001, 40001};
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int d = 0; d < N_DTYPES; d++) {
        for (int op = NB_REDUCE_SUM; op <= NB_REDUCE_MAX; op++) {
            if (op == NB_REDUCE_AVG && !nb_dtype_is_float(dtypes[d])) continue;
            for (int c = 0; c < 5; c++) {
                nb_tensor *t = input(ctx, dtypes[d], me, counts[c], 0);
                check_ok(nb_work_finish(nb_pg_all_reduce(world, t, (nb_reduce_op)op)));
                assert_expected(t, dtypes[d], (nb_reduce_op)op, 0, "all_reduce");
            }
            nb_ctx_reset(ctx);
        }
    }
    nb_ctx_free(ctx);
}
END_TEST

/* Note [Small collectives in one message] (distributed/pg_gloo.c): with
 * more than one rank, a collective whose data fit in min(32768, 65536 /
 * (R - 1)) bytes rounded down to 8 goes in one message from each rank to
 * each other (the group counts them), one that does not goes through
 * Gloo's algorithms; both give the closed forms. Sizes on either side of
 * the limit, for each kind, with the check layer (NABLA_DIST_CHECK=auto)
 * and without it (off; the group's table switched as nb_pg_init switches
 * it): under the layer the small ones' data travel in its header
 * exchange, one exchange in all (the group counts those too). */
static double *host_values(const nb_tensor *t) {
    double *v = malloc((size_t)(nb_numel(t) + 1) * sizeof *v);
    nb_to_host_f64(t, v);
    return v;
}

START_TEST(test_small_collectives_in_one_message) {
    if (R == 1) return;
    size_t p = 65536 / (size_t)(R - 1);
    p = (p > 32768 ? 32768 : p) / 8 * 8;
    const nb__pg_ops *saved = world->ops;
    nb__dist_check saved_mode = world->check;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int checked = 0; checked < 2; checked++) {
        world->check = checked ? NB__CHECK_AUTO : NB__CHECK_OFF;
        world->ops = checked ? nb__pg_checked(world->base) : world->base;
        for (int big = 0; big < 2; big++) {
            int64_t n = (int64_t)(p / 4) + big; /* f32: p bytes, then one element more */
            uint64_t before = world->stats.small, framed_before = world->stats.small_framed;
            nb_tensor *t = input(ctx, NB_F32, me, n, 0);
            check_ok(nb_work_finish(nb_pg_all_reduce(world, t, NB_REDUCE_SUM)));
            assert_expected(t, NB_F32, NB_REDUCE_SUM, 0, "all_reduce");
            nb_tensor *b = input(ctx, NB_F32, me, n, 0);
            check_ok(nb_work_finish(nb_pg_broadcast(world, b, R - 1)));
            double *got = host_values(b);
            for (int64_t i = 0; i < n; i++) ck_assert_double_eq(got[i], (float)value(NB_F32, R - 1, i));
            free(got);
            nb_tensor *in = input(ctx, NB_F32, me, n, 0), *all = nb_zeros(ctx, NB_F32, NB_SHAPE((int64_t)R * n));
            check_ok(nb_work_finish(nb_pg_all_gather(world, all, in)));
            got = host_values(all);
            for (int r = 0; r < R; r++)
                for (int64_t i = 0; i < n; i++) ck_assert_double_eq(got[r * n + i], (float)value(NB_F32, r, i));
            free(got);
            int64_t g = (int64_t)(p / 4) / R + big; /* per rank: R g elements, the reduce-scatter's input */
            nb_tensor *rin = input(ctx, NB_F32, me, (int64_t)R * g, 0), *rout = nb_zeros(ctx, NB_F32, NB_SHAPE(g));
            check_ok(nb_work_finish(nb_pg_reduce_scatter(world, rout, rin, NB_REDUCE_MAX)));
            assert_expected(rout, NB_F32, NB_REDUCE_MAX, (int64_t)me * g, "reduce_scatter");
            uint64_t rode = world->stats.small - before, framed = world->stats.small_framed - framed_before;
            ck_assert_msg(rode == (big ? 0u : 4u), "checks %s, %s: %llu of 4 collectives of %s went in one message",
                          checked ? "on" : "off", big ? "over the limit" : "within the limit",
                          (unsigned long long)rode, big ? "one element over the payload" : "a full payload");
            ck_assert_msg(framed == (checked && !big ? 4u : 0u),
                          "checks %s, %s: %llu of 4 collectives had their data in the header exchange",
                          checked ? "on" : "off", big ? "over the limit" : "within the limit",
                          (unsigned long long)framed);
            nb_ctx_reset(ctx);
        }
    }
    world->ops = saved;
    world->check = saved_mode;
    nb_ctx_free(ctx);
}
END_TEST

/* A small collective's data travel with its header, and headers are
 * posted while an earlier collective runs (Note [Collective headers] in
 * distributed/pg_check.c): so not one that reads what the running
 * collective or one queued before it writes. Rank 0 issues 0.2 s after
 * the others, so on every other rank the first collective waits while the
 * rest are queued. An all-reduce (sum) of another tensor, then four of one
 * tensor, issued at once, then waited for: each of the four reads the one
 * before's result, R^3 (R (R + 1) / 2) in all, and only the first of them
 * may go early (while the other tensor's runs); the same with a tensor
 * beyond the limit, whose headers go early (no data ride with them); then
 * four of distinct tensors, whose headers go early with their data: each
 * the sum. */
START_TEST(test_small_collectives_back_to_back) {
    if (R == 1) return;
    enum { K = 4 };
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *one = nb_full(ctx, NB_F32, NB_SHAPE(8), (double)(me + 1)), *t[K];
    nb_tensor *lead = input(ctx, NB_F32, me, 8, 0);
    nb_work *w[K];
    uint64_t early = world->stats.headers_early;
    if (me == 0) nb__sleep(0.2);
    nb_work *lw = nb_pg_all_reduce(world, lead, NB_REDUCE_SUM);
    for (int k = 0; k < K; k++) w[k] = nb_pg_all_reduce(world, one, NB_REDUCE_SUM);
    check_ok(nb_work_finish(lw));
    for (int k = 0; k < K; k++) check_ok(nb_work_finish(w[k]));
    assert_expected(lead, NB_F32, NB_REDUCE_SUM, 0, "all_reduce");
    double want = (double)R * (R + 1) / 2 * R * R * R, got[8];
    nb_to_host_f64(one, got);
    for (int i = 0; i < 8; i++)
        ck_assert_msg(got[i] == want, "rank %d: four all-reduces of one tensor issued at once give %g, want %g", me,
                      got[i], want);
    ck_assert_msg(world->stats.headers_early <= early + 1,
                  "rank %d: %llu headers of four all-reduces of one tensor went early", me,
                  (unsigned long long)(world->stats.headers_early - early));
    /* beyond the one-message limit no data ride with a header: those of one
     * tensor's all-reduces go early too */
    nb_tensor *big = nb_full(ctx, NB_F32, NB_SHAPE(10000), (double)(me + 1));
    early = world->stats.headers_early;
    if (me == 0) nb__sleep(0.2);
    for (int k = 0; k < K; k++) w[k] = nb_pg_all_reduce(world, big, NB_REDUCE_SUM);
    for (int k = 0; k < K; k++) check_ok(nb_work_finish(w[k]));
    double *bv = host_values(big);
    for (int i = 0; i < 10000; i++)
        ck_assert_msg(bv[i] == want, "rank %d: four all-reduces of one large tensor give %g, want %g", me, bv[i], want);
    free(bv);
    if (me != 0)
        ck_assert_msg(world->stats.headers_early > early, "rank %d: no header of four large all-reduces went early", me);
    if (me == 0) nb__sleep(0.2);
    early = world->stats.headers_early;
    for (int k = 0; k < K; k++) {
        t[k] = input(ctx, NB_F32, me, 100 + k, 0);
        w[k] = nb_pg_all_reduce(world, t[k], NB_REDUCE_SUM);
    }
    for (int k = 0; k < K; k++) check_ok(nb_work_finish(w[k]));
    for (int k = 0; k < K; k++) assert_expected(t[k], NB_F32, NB_REDUCE_SUM, 0, "all_reduce");
    if (me != 0)
        ck_assert_msg(world->stats.headers_early > early, "rank %d: no header of four distinct all-reduces went early",
                      me);
    nb_ctx_free(ctx);
}
END_TEST

/* Note [Small collectives in one message]: the collective checks do not
 * choose the arithmetic (a small collective's data may travel in the
 * check's exchange, and are then reduced as they would be from the
 * backend's own message), so NABLA_DIST_CHECK gives bitwise the same
 * all-reduce for every size class: tiny, on either side of the
 * one-message limit, large; f32, f64 and bf16; sum, avg and max. The
 * option puts the check layer (distributed/pg_check.c) around the backend
 * (auto, full) or leaves it out (off); the group's table is switched here
 * as nb_pg_init switches it. The values are irregular, so that the order
 * of a sum shows in the last bits (with three ranks and more). Within the
 * limit, the result is also the reduction in rank order worked here from
 * every rank's values, rounded as each dtype rounds. */
static double irregular(nb_dtype dt, int r, int64_t i) {
    float v = (float)(sin(1.0 + 0.37 * (double)i + 1.91 * r) * 1000.0 / (double)(1 + i % 7));
    return dt == NB_BF16 ? nb_bf16_to_f32(nb_f32_to_bf16(v)) : dt == NB_F32 ? v : v * (1 + 1e-9 * (double)i);
}

static float bf16_round(float x) { return nb_bf16_to_f32(nb_f32_to_bf16(x)); }

/* Rank 0's value, then rank 1's, ... combined one at a time, as dtype dt holds them. */
static void rank_order(nb_dtype dt, nb_reduce_op op, int64_t n, void *out) {
    for (int64_t i = 0; i < n; i++) {
        double a64 = irregular(dt, 0, i);
        float a32 = (float)a64;
        for (int r = 1; r < R; r++) {
            double b = irregular(dt, r, i);
            if (op == NB_REDUCE_MAX) {
                a64 = b > a64 ? b : a64;
                a32 = (float)b > a32 ? (float)b : a32;
            } else {
                a64 = a64 + b;
                a32 = dt == NB_BF16 ? bf16_round(a32 + (float)b) : a32 + (float)b;
            }
        }
        if (op == NB_REDUCE_AVG) {
            a64 = a64 / R;
            a32 = (float)((double)a32 / R);
        }
        if (dt == NB_F64) ((double *)out)[i] = a64;
        else if (dt == NB_F32) ((float *)out)[i] = a32;
        else ((uint16_t *)out)[i] = nb_f32_to_bf16(a32);
    }
}

START_TEST(test_checks_do_not_choose_the_arithmetic) {
    if (R == 1) return;
    size_t limit = 65536 / (size_t)(R - 1);
    limit = (limit > 32768 ? 32768 : limit) / 8 * 8;
    const nb_dtype dts[] = {NB_F32, NB_F64, NB_BF16};
    const nb_reduce_op ops[] = {NB_REDUCE_SUM, NB_REDUCE_AVG, NB_REDUCE_MAX};
    const nb__dist_check modes[] = {NB__CHECK_OFF, NB__CHECK_AUTO, NB__CHECK_FULL};
    const nb__pg_ops *saved = world->ops;
    nb__dist_check saved_mode = world->check;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int differ_from_rank_order = 0;
    uint64_t pairs = 0, pairs_before = world->stats.pair, rings = 0, rings_before = world->stats.ring;
    for (int d = 0; d < 3; d++) {
        nb_dtype dt = dts[d];
        size_t es = nb_dtype_size(dt);
        int64_t lim = (int64_t)(limit / es);
        const int64_t counts[] = {1, 3, lim - 1, lim, lim + 1, 3 * lim + 5, 200000};
        for (int o = 0; o < 3; o++) {
            for (int k = 0; k < 7; k++) {
                int64_t n = counts[k];
                double *v = malloc((size_t)n * sizeof *v);
                unsigned char *got[3], *want = malloc((size_t)n * es);
                for (int m = 0; m < 3; m++) {
                    world->check = modes[m];
                    world->ops = modes[m] == NB__CHECK_OFF ? world->base : nb__pg_checked(world->base);
                    for (int64_t i = 0; i < n; i++) v[i] = irregular(dt, me, i);
                    nb_tensor *t = nb_from_host(ctx, NB_F64, NB_SHAPE(n), v);
                    if (dt != NB_F64) t = nb_cast(ctx, t, dt);
                    check_ok(nb_work_finish(nb_pg_all_reduce(world, t, ops[o])));
                    pairs += R == 2 && (size_t)n * es > limit;
                    rings += R >= 3 && (size_t)n * es > limit;
                    got[m] = malloc((size_t)n * es);
                    memcpy(got[m], t->data, (size_t)n * es);
                    nb_ctx_reset(ctx);
                }
                for (int m = 1; m < 3; m++)
                    ck_assert_msg(memcmp(got[0], got[m], (size_t)n * es) == 0,
                                  "all_reduce(%s, %s, count=%lld): NABLA_DIST_CHECK=off and %s give different bits",
                                  nb__reduce_name(ops[o]), nb_dtype_name(dt), (long long)n,
                                  modes[m] == NB__CHECK_AUTO ? "auto" : "full");
                if ((size_t)n * es <= limit || R == 2) { /* R == 2: Note [All-reduce of two ranks] */
                    rank_order(dt, ops[o], n, want);
                    ck_assert_msg(memcmp(got[0], want, (size_t)n * es) == 0,
                                  "all_reduce(%s, %s, count=%lld) %s is not the reduction in rank order",
                                  nb__reduce_name(ops[o]), nb_dtype_name(dt), (long long)n,
                                  (size_t)n * es <= limit ? "within the one-message limit" : "of two ranks");
                } else if (ops[o] != NB_REDUCE_MAX) {
                    rank_order(dt, ops[o], n, want);
                    differ_from_rank_order += memcmp(got[0], want, (size_t)n * es) != 0;
                }
                for (int m = 0; m < 3; m++) free(got[m]);
                free(want);
                free(v);
            }
        }
    }
    world->ops = saved;
    world->check = saved_mode;
    ck_assert_msg(world->stats.pair - pairs_before == pairs, "rank %d: %llu all-reduces of two ranks in one exchange, want %llu",
                  me, (unsigned long long)(world->stats.pair - pairs_before), (unsigned long long)pairs);
    ck_assert_msg(world->stats.ring - rings_before == rings,
                  "rank %d: %llu all-reduces by the ring on blocking connections, want %llu", me,
                  (unsigned long long)(world->stats.ring - rings_before), (unsigned long long)rings);
    /* the large ones went round the ring (Note [Ring on blocking connections]): some sums came out
     * in another order (with three ranks and more), which the bitwise
     * comparison above then had to match */
    if (me == 0 && R >= 3) printf("%d large sums differ from the rank order\n", differ_from_rank_order);
    nb_ctx_free(ctx);
}
END_TEST

/* A barrier holds every rank until the last arrives, with the check layer
 * (whose header exchange is a barrier too) and without it: under
 * NABLA_DIST_CHECK=off it used to return at once. Rank 1 arrives 0.4 s
 * late. */
START_TEST(test_barrier_waits_without_checks) {
    if (R == 1) return;
    const nb__pg_ops *saved = world->ops;
    nb__dist_check saved_mode = world->check;
    for (int m = 0; m < 2; m++) {
        world->check = m ? NB__CHECK_AUTO : NB__CHECK_OFF;
        world->ops = m ? nb__pg_checked(world->base) : world->base;
        check_ok(nb_work_finish(nb_pg_barrier(world)));
        double t0 = nb__now();
        if (me == 1) nb__sleep(0.4);
        check_ok(nb_work_finish(nb_pg_barrier(world)));
        double waited = nb__now() - t0;
        if (me != 1) ck_assert_msg(waited > 0.3, "checks %s: rank %d left the barrier after %.3f s, before rank 1 came",
                                   m ? "on" : "off", me, waited);
    }
    world->ops = saved;
    world->check = saved_mode;
}
END_TEST

/* Note [Hang diagnostics] (distributed/pg_diag.c): while waits are short,
 * fingerprints stay in the flight recorder and the store receives none
 * (rank 0 serves it and counts the sets of keys under nb/fp/); a wait that
 * runs long publishes them. */
static uint64_t fp_writes_settled(void) {
    nb__sleep(0.3); /* the publications are sets without a reply */
    return me == 0 ? nb__store_server_fp_writes(world->server) : 0;
}

START_TEST(test_fingerprints_stay_home_while_waits_are_short) {
    if (R == 1) return;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    check_ok(nb_work_finish(nb_pg_barrier(world)));
    check_ok(nb_work_finish(nb_pg_barrier(world)));
    uint64_t before = fp_writes_settled(), mine = world->stats.published;
    for (int k = 0; k < 30; k++) {
        nb_tensor *t = input(ctx, NB_F32, me, 1 + 300 * (k % 3), 0);
        check_ok(nb_work_finish(nb_pg_all_reduce(world, t, NB_REDUCE_SUM)));
        nb_ctx_reset(ctx);
    }
    check_ok(nb_work_finish(nb_pg_barrier(world)));
    uint64_t after = fp_writes_settled();
    ck_assert_msg(after == before, "the store received %llu fingerprints while no wait ran long",
                  (unsigned long long)(after - before));
    ck_assert_uint_eq(world->stats.published, mine);
    /* rank 1 arrives a second late: the others' waits run long */
    if (me == 1) nb__sleep(1.2);
    nb_tensor *t = input(ctx, NB_F32, me, 8, 0);
    check_ok(nb_work_finish(nb_pg_all_reduce(world, t, NB_REDUCE_SUM)));
    if (me != 1) ck_assert_msg(world->stats.published > mine, "rank %d waited 1.2 s and published nothing", me);
    check_ok(nb_work_finish(nb_pg_barrier(world)));
    after = fp_writes_settled();
    if (me == 0) ck_assert_msg(after > before, "a long wait sent no fingerprint to the store");
    nb_ctx_free(ctx);
}
END_TEST

/* Collectives issued back to back: while one's data move, the next one's
 * header travels (posted early), so the run pays the header's latency
 * about once. Eight large all-reduces issued at once, then waited for:
 * each result is right. Rank 0 issues its eight 0.2 s after the others,
 * so on every other rank the first one's header exchange waits that long
 * for rank 0 while its seven successors are issued: when its data move,
 * the second is queued and its header goes early (on rank 0 that depends
 * on how soon its own thread issues them, so it is not asserted). */
START_TEST(test_headers_posted_while_data_move) {
    if (R == 1) return;
    enum { K = 8 };
    int64_t n = 10000; /* 40 KB of f32: beyond any payload */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t[K];
    nb_work *w[K];
    uint64_t before = world->stats.headers_early;
    if (me == 0) nb__sleep(0.2);
    for (int k = 0; k < K; k++) {
        t[k] = input(ctx, NB_F32, me, n, 0);
        w[k] = nb_pg_all_reduce(world, t[k], NB_REDUCE_SUM);
    }
    for (int k = 0; k < K; k++) check_ok(nb_work_finish(w[k]));
    for (int k = 0; k < K; k++) assert_expected(t[k], NB_F32, NB_REDUCE_SUM, 0, "all_reduce");
    uint64_t early = world->stats.headers_early - before;
    ck_assert_msg(early <= K - 1 && (me == 0 || early >= 1), "rank %d: %llu of %d headers were posted early", me,
                  (unsigned long long)early, K - 1);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_broadcast) {
    const int64_t counts[] = {0, 13, 40001};
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int d = 0; d < N_DTYPES; d++) {
        for (int root = 0; root < R; root += (R > 1 ? R - 1 : 1)) {
            for (int c = 0; c < 3; c++) {
                nb_tensor *t = input(ctx, dtypes[d], me, counts[c], 0);
                check_ok(nb_work_finish(nb_pg_broadcast(world, t, root)));
                double *got = malloc((size_t)(counts[c] + 1) * sizeof *got);
                nb_to_host_f64(t, got);
                for (int64_t i = 0; i < counts[c]; i++)
                    ck_assert_msg(got[i] == value(dtypes[d], root, i), "broadcast %s root %d: element %" PRId64,
                                  nb_dtype_name(dtypes[d]), root, i);
                free(got);
            }
            nb_ctx_reset(ctx);
        }
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_all_gather) {
    const int64_t counts[] = {0, 3, 10001};
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int d = 0; d < N_DTYPES; d++) {
        for (int c = 0; c < 3; c++) {
            int64_t n = counts[c];
            nb_tensor *in = input(ctx, dtypes[d], me, n, 0);
            nb_tensor *out = nb_full(ctx, dtypes[d], NB_SHAPE((int64_t)R * n), -1);
            check_ok(nb_work_finish(nb_pg_all_gather(world, out, in)));
            double *got = malloc((size_t)(R * n + 1) * sizeof *got);
            nb_to_host_f64(out, got);
            for (int r = 0; r < R; r++)
                for (int64_t i = 0; i < n; i++)
                    ck_assert_msg(got[r * n + i] == value(dtypes[d], r, i),
                                  "all_gather %s count %" PRId64 ": rank %d's element %" PRId64,
                                  nb_dtype_name(dtypes[d]), n, r, i);
            free(got);
        }
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_reduce_scatter) {
    const int64_t counts[] = {0, 1, 5, 1001};
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int d = 0; d < N_DTYPES; d++) {
        for (int op = NB_REDUCE_SUM; op <= NB_REDUCE_MAX; op++) {
            if (op == NB_REDUCE_AVG && !nb_dtype_is_float(dtypes[d])) continue;
            for (int c = 0; c < 4; c++) {
                int64_t n = counts[c];
                nb_tensor *in = input(ctx, dtypes[d], me, (int64_t)R * n, 0);
                nb_tensor *out = nb_full(ctx, dtypes[d], NB_SHAPE(n), -1);
                check_ok(nb_work_finish(nb_pg_reduce_scatter(world, out, in, (nb_reduce_op)op)));
                assert_expected(out, dtypes[d], (nb_reduce_op)op, (int64_t)me * n, "reduce_scatter");
            }
            nb_ctx_reset(ctx);
        }
    }
    nb_ctx_free(ctx);
}
END_TEST

/* No rank leaves a barrier before every rank has entered it: each rank
 * writes a key before its barrier, and finds everyone's key after it. */
START_TEST(test_barrier) {
    nb_store *store = nb_pg_store(world);
    for (int round = 0; round < 3; round++) {
        char key[64];
        snprintf(key, sizeof key, "test/barrier/%d/%d", round, me);
        check_ok(nb_store_set(store, key, "x", 1));
        check_ok(nb_work_finish(nb_pg_barrier(world)));
        for (int r = 0; r < R; r++) {
            snprintf(key, sizeof key, "test/barrier/%d/%d", round, r);
            void *v = NULL;
            nb_status st = nb_store_get(store, key, 0, &v, NULL);
            ck_assert_msg(st == NB_OK, "round %d: rank %d passed the barrier before rank %d entered it", round, me, r);
            free(v);
        }
    }
}
END_TEST

/* Ten collectives in flight at once, waited for in reverse order. */
START_TEST(test_async_in_order) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t[10];
    nb_work *w[10];
    for (int k = 0; k < 10; k++) {
        t[k] = nb_full(ctx, NB_F64, NB_SHAPE(257), k + me);
        w[k] = nb_pg_all_reduce(world, t[k], NB_REDUCE_SUM);
        if (k) ck_assert_uint_eq(nb_work_seq(w[k]), nb_work_seq(w[k - 1]) + 1);
    }
    bool done = false;
    while (!done) check_ok(nb_work_test(w[9], &done));
    for (int k = 9; k >= 0; k--) {
        check_ok(nb_work_wait(w[k]));
        check_ok(nb_work_test(w[k], &done));
        ck_assert(done);
        nb_work_free(w[k]);
        double want = 0;
        for (int r = 0; r < R; r++) want += k + r;
        ck_assert_double_eq(nb_get(t[k], (int64_t[]){256}), want);
    }
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_agree) {
    bool any = false, all = true;
    check_ok(nb_pg_agree(world, me == R - 1, &any, &all));
    ck_assert(any);
    ck_assert(all == (R == 1));
    check_ok(nb_pg_agree(world, true, &any, &all));
    ck_assert(any && all);
    check_ok(nb_pg_agree(world, false, &any, NULL));
    ck_assert(!any);
}
END_TEST

START_TEST(test_subgroups) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    /* {R-1, 0}, in that order: world rank R-1 is rank 0 of the group. */
    int pair[2] = {R - 1, 0};
    int n_pair = R > 1 ? 2 : 1;
    nb_pg *g = NULL;
    check_ok(nb_pg_new_group(world, pair, n_pair, &g));
    bool member = me == R - 1 || me == 0;
    ck_assert(member == (g != NULL));
    /* the odd world ranks */
    int odd[2] = {1, 3};
    int n_odd = R > 3 ? 2 : R > 1 ? 1 : 0;
    nb_pg *o = NULL;
    if (n_odd) check_ok(nb_pg_new_group(world, odd, n_odd, &o));
    ck_assert((o != NULL) == (me % 2 == 1));

    if (g) {
        ck_assert_int_eq(nb_pg_size(g), n_pair);
        ck_assert_int_eq(nb_pg_rank(g), me == R - 1 ? 0 : 1);
        ck_assert_int_eq(nb_pg_global_rank(g, 0), R - 1);
        nb_tensor *t = nb_full(ctx, NB_I64, NB_SHAPE(3), me + 1);
        check_ok(nb_work_finish(nb_pg_all_reduce(g, t, NB_REDUCE_SUM)));
        ck_assert_double_eq(nb_get(t, (int64_t[]){2}), R > 1 ? R + 1 : 1);
        nb_tensor *b = nb_full(ctx, NB_F32, NB_SHAPE(5), me);
        check_ok(nb_work_finish(nb_pg_broadcast(g, b, 0))); /* group rank 0 = world rank R-1 */
        ck_assert_double_eq(nb_get(b, (int64_t[]){4}), R - 1);
    }
    /* a world collective between the subgroups' */
    nb_tensor *w = nb_full(ctx, NB_F32, NB_SHAPE(2), 1);
    check_ok(nb_work_finish(nb_pg_all_reduce(world, w, NB_REDUCE_SUM)));
    ck_assert_double_eq(nb_get(w, (int64_t[]){0}), R);
    if (o) {
        nb_tensor *t = nb_full(ctx, NB_F64, NB_SHAPE(4), me);
        check_ok(nb_work_finish(nb_pg_all_reduce(o, t, NB_REDUCE_MAX)));
        ck_assert_double_eq(nb_get(t, (int64_t[]){0}), n_odd == 2 ? 3 : 1);
    }
    /* a subgroup of a subgroup: group rank 1 of g is world rank 0 */
    if (g) {
        nb_pg *gg = NULL;
        int one[1] = {n_pair - 1};
        check_ok(nb_pg_new_group(g, one, 1, &gg));
        ck_assert((gg != NULL) == (me == 0));
        if (gg) {
            ck_assert_int_eq(nb_pg_global_rank(gg, 0), 0);
            nb_tensor *t = nb_full(ctx, NB_F32, NB_SHAPE(1), 5);
            check_ok(nb_work_finish(nb_pg_all_reduce(gg, t, NB_REDUCE_SUM)));
            ck_assert_double_eq(nb_item(t), 5);
            NBT_EXPECT_ABORT(nb_pg_free(g), "still has 1 subgroup");
            check_ok(nb_pg_free(gg));
            /* Note [Freed handles]: a group used after nb_pg_free is named */
            NBT_EXPECT_ABORT(nb_pg_all_reduce(gg, t, NB_REDUCE_SUM),
                             "nb_pg_all_reduce: the process group was freed (nb_pg_free)");
            NBT_EXPECT_ABORT(nb_pg_rank(gg), "nb_pg_rank: the process group was freed (nb_pg_free)");
            NBT_EXPECT_ABORT(nb_pg_free(gg), "nb_pg_free: the process group was freed (nb_pg_free)");
        }
        check_ok(nb_pg_free(g));
    }
    check_ok(nb_pg_free(o));
    /* non-members may not issue on the group they did not get */
    NBT_EXPECT_ABORT(nb_pg_barrier(NULL), "is this rank a member of the subgroup?");
    nb_ctx_free(ctx);
}
END_TEST

/* Ranks 0 and 1 agree on {0, 1}; rank 2 says {0, 2}: rank 2 learns that
 * rank 0 was given another list. */
START_TEST(test_subgroup_mismatch) {
    if (R != 3) return;
    int a[2] = {0, 1}, b[2] = {0, 2};
    nb_pg *g = NULL;
    nb_status st = nb_pg_new_group(world, me == 2 ? b : a, 2, &g);
    if (me == 2) {
        ck_assert_int_eq(st, NB_ERR_MISMATCH);
        ck_assert_ptr_null(g);
        ck_assert_msg(strstr(nb_last_error(), "rank 0 was given [0, 1], rank 2 was given [0, 2]"), "%s",
                      nb_last_error());
    } else {
        check_ok(st);
        ck_assert_ptr_nonnull(g);
        check_ok(nb_work_finish(nb_pg_barrier(g)));
        check_ok(nb_pg_free(g));
    }
}
END_TEST

/* Note [No exception crosses the shim]: what Gloo (or the shim) throws in
 * the calling thread comes back as a status with its text. Both calls
 * throw before anything is sent, so the ranks stay in step. */
START_TEST(test_shim_exceptions_become_statuses) {
    float x[4] = {0};
    nb__coll bad_dtype = {NB__ALL_REDUCE, NB_REDUCE_SUM, (nb_dtype)99, 4, 0, x, NULL, 1000};
    ck_assert_int_eq(nb__gloo_run(nb__pg_gloo(world), &bad_dtype), NB_ERR_NETWORK);
    ck_assert_str_eq(nb_last_error(), "Gloo all_reduce: unsupported dtype");
    nb__coll bad_root = {NB__BROADCAST, NB_REDUCE_SUM, NB_F32, 4, R + 5, x, NULL, 1001};
    ck_assert_int_eq(nb__gloo_run(nb__pg_gloo(world), &bad_root), NB_ERR_NETWORK);
    ck_assert_msg(strncmp(nb_last_error(), "Gloo broadcast: [enforce fail at ", 33) == 0, "%s", nb_last_error());
    check_ok(nb_work_finish(nb_pg_barrier(world)));
}
END_TEST

START_TEST(test_argument_checks) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *m = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3));
    nb_tensor *mt = nb_transpose(ctx, m, 0, 1);
    NBT_EXPECT_ABORT(nb_pg_all_reduce(world, mt, NB_REDUCE_SUM), "nb_pg_all_reduce: tensor must be contiguous (shape (3, 2))");
    nb_tensor *i = nb_zeros(ctx, NB_I32, NB_SHAPE(4));
    NBT_EXPECT_ABORT(nb_pg_all_reduce(world, i, NB_REDUCE_AVG), "avg needs a floating dtype, got i32");
    NBT_EXPECT_ABORT(nb_pg_broadcast(world, m, R), "root");
    nb_tensor *small = nb_zeros(ctx, NB_F32, NB_SHAPE(R * 3 + 1));
    nb_tensor *three = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    NBT_EXPECT_ABORT(nb_pg_all_gather(world, small, three), "nb_pg_all_gather: out (");
    NBT_EXPECT_ABORT(nb_pg_reduce_scatter(world, three, small, NB_REDUCE_SUM), "nb_pg_reduce_scatter: in (");
    nb_tensor *d = nb_zeros(ctx, NB_F64, NB_SHAPE(R * 3));
    NBT_EXPECT_ABORT(nb_pg_all_gather(world, d, three), "out is f64 but in is f32");
    nb_tensor fake = *three;
    fake.device = nb_cuda(0);
    NBT_EXPECT_ABORT(nb_pg_all_reduce(world, &fake, NB_REDUCE_SUM),
                     "tensor is on cuda:0 but the group's gloo backend works on cpu tensors");
    int dup[2] = {0, 0};
    nb_pg *g;
    NBT_EXPECT_ABORT(nb_pg_new_group(world, dup, 2, &g), R > 1 ? "rank 0 is listed twice" : "2 ranks for a subgroup");
    int out_of_range[1] = {R};
    NBT_EXPECT_ABORT(nb_pg_new_group(world, out_of_range, 1, &g), "outside the group");
    /* none of these took a sequence number: the next collective still matches */
    check_ok(nb_work_finish(nb_pg_barrier(world)));
    nb_ctx_free(ctx);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_all_reduce, test_broadcast, test_small_collectives_in_one_message,
                             test_small_collectives_back_to_back,
                             test_headers_posted_while_data_move, test_checks_do_not_choose_the_arithmetic,
                             test_barrier_waits_without_checks,
                             test_fingerprints_stay_home_while_waits_are_short, test_all_gather,
                             test_reduce_scatter, test_barrier, test_async_in_order, test_agree,
                             test_subgroups, test_subgroup_mismatch, test_shim_exceptions_become_statuses,
                             test_argument_checks, NULL};
    return nbt_suite("dist_collectives", "gloo", 0, tests);
}

static Suite *setup(nb_pg *pg) {
    world = pg;
    R = nb_pg_size(world);
    me = nb_pg_rank(world);
    return suite();
}

int main(void) { return nbt_run_world(setup); }
