/* The scaling model (distributed/scale.c, Note [Scaling model]): the
 * collective costs against their closed forms worked out by hand, the
 * replay of a made-up trace against a hand-worked timeline (DDP, the bf16
 * wire, ZeRO-1), the trace file's round trip and its errors, the fit of a
 * "measured" link to a made-up bench_collectives table, and the bucket
 * suggestion. The expected numbers are in the comments. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "distributed/scale.h"
#include "testutil.h"

#define NEAR(got, want) ck_assert_msg(fabs((double)(got) - (double)(want)) <= 1e-12 + 1e-9 * fabs((double)(want)), "%s = %.12g, want %.12g", #got, (double)(got), (double)(want))

static const nb__scale_link slow = {"slow", 1e-5, 1e9, "test"}, fast = {"fast", 1e-6, 100e9, "test"};

START_TEST(test_flat_closed_forms) {
    /* p = 4, n = 4e6 B, alpha 10 us, 1 GB/s:
     * ring all-reduce 2*3*1e-5 + 2*3/4*4e-3 = 6e-5 + 6e-3
     * tree all-reduce 2*log2(4)*(1e-5 + 4e-3) = 4*(4.01e-3)
     * reduce-scatter = all-gather = 3e-5 + 3e-3 */
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_RING, 4, 4e6, &slow), 6.06e-3);
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_TREE, 4, 4e6, &slow), 16.04e-3);
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_BEST, 4, 4e6, &slow), 6.06e-3);
    NEAR(nb__scale_flat(NB__SCALE_REDUCE_SCATTER, NB__SCALE_TREE, 4, 4e6, &slow), 3.03e-3);
    NEAR(nb__scale_flat(NB__SCALE_ALL_GATHER, NB__SCALE_RING, 4, 4e6, &slow), 3.03e-3);
    /* p = 5: ceil(log2 5) = 3; 4 bytes: ring 8e-5 + 8/5*4e-9, tree 6*(1e-5 + 4e-9): the tree is cheaper */
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_TREE, 5, 4, &slow), 6.0024e-5);
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_BEST, 5, 4, &slow), 6.0024e-5);
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_RING, 5, 4, &slow), 8.00064e-5);
    /* one device: nothing to send */
    NEAR(nb__scale_flat(NB__SCALE_ALL_REDUCE, NB__SCALE_RING, 1, 4e6, &slow), 0);
}
END_TEST

START_TEST(test_hierarchical_closed_forms) {
    /* 2 nodes x 4, n = 8e6 B, ring. Inside: reduce-scatter 3*1e-6 + 3/4*8e6/1e11 = 6.3e-5;
     * between: all-reduce of 2e6 B over 2 nodes, 2*1e-5 + 2e6/1e9 = 2.02e-3.
     * all-reduce = 2*6.3e-5 + 2.02e-3 = 2.146e-3;
     * reduce-scatter = 6.3e-5 + (1e-5 + 1e-3) = 1.073e-3 */
    NEAR(nb__scale_collective(NB__SCALE_ALL_REDUCE, NB__SCALE_RING, 2, 4, 8e6, &fast, &slow), 2.146e-3);
    NEAR(nb__scale_collective(NB__SCALE_REDUCE_SCATTER, NB__SCALE_RING, 2, 4, 8e6, &fast, &slow), 1.073e-3);
    NEAR(nb__scale_collective(NB__SCALE_ALL_GATHER, NB__SCALE_RING, 2, 4, 8e6, &fast, &slow), 1.073e-3);
    /* one node: the intra-node ring alone; one device per node: the inter-node ring alone */
    NEAR(nb__scale_collective(NB__SCALE_ALL_REDUCE, NB__SCALE_RING, 1, 4, 8e6, &fast, &slow), 1.26e-4);
    NEAR(nb__scale_collective(NB__SCALE_ALL_REDUCE, NB__SCALE_RING, 4, 1, 4e6, &fast, &slow), 6.06e-3);
}
END_TEST

/* The made-up trace: forward 10 ms, backward 100 ms, optimizer 5 ms; f32
 * parameters a (1e6 B, ready at 20 ms), b (1e6 B, 50 ms), c (2e6 B, 90 ms,
 * a 500 x 1000 matrix), d (1e6 B, 100 ms); the others vectors. */
static nb__scale_trace made_up(void) {
    static nb__scale_param p[4] = {{"a", NB_F32, 250000, 0.02, 0}, {"b", NB_F32, 250000, 0.05, 0},
                                   {"c", NB_F32, 500000, 0.09, 500}, {"d", NB_F32, 250000, 0.10, 0}};
    nb__scale_trace t = {0.010, 0.100, 0.005, 4, p, "made up"};
    return t;
}

START_TEST(test_replay_timeline) {
    /* Buckets at first 1e6 B, cap 2e6 B: {a} (1e6), {b, c} (3e6), {d} (1e6), ready at 20, 90,
     * 100 ms. 2 devices, alpha 0, 100 MB/s: a ring all-reduce costs n/B: 10, 30, 10 ms.
     * b0 runs 20..30, b1 90..120, b2 waits for b1: 120..130. The step is 10 + 130 + 5 = 145 ms,
     * 30 ms exposed, 50 ms of communication; efficiency 115/145. */
    double cost[] = {0.01, 0.03, 0.01}, ready[] = {0.02, 0.09, 0.10}, s[3], e[3];
    nb__scale_result r = nb__scale_replay_buckets(3, cost, NULL, ready, 0.010, 0.100, 0.005, 0, s, e);
    double ws[] = {0.02, 0.09, 0.12}, we[] = {0.03, 0.12, 0.13};
    for (int b = 0; b < 3; b++) {
        NEAR(s[b], ws[b]);
        NEAR(e[b], we[b]);
    }
    NEAR(r.step_s, 0.145);
    NEAR(r.exposed_s, 0.030);

    nb__scale_trace t = made_up();
    nb__scale_link wire = {"wire", 0, 1e8, "test"};
    nb__scale_config c = {.nodes = 1, .per_node = 2, .mode = NB__SCALE_DDP, .algo = NB__SCALE_RING,
                          .first_bucket = 1000000, .bucket_cap = 2000000, .intra = wire, .inter = wire};
    r = nb__scale_replay(&t, &c);
    ck_assert_int_eq(r.n_buckets, 3);
    NEAR(r.step_s, 0.145);
    NEAR(r.exposed_s, 0.030);
    NEAR(r.comm_s, 0.050);
    NEAR(r.efficiency, 0.115 / 0.145);
    /* bf16 wire: 5, 15, 5 ms: 20..25, 90..105, 105..110; step 10 + 110 + 5 = 125 ms */
    c.bf16_wire = true;
    r = nb__scale_replay(&t, &c);
    NEAR(r.step_s, 0.125);
    NEAR(r.exposed_s, 0.010);
    /* ZeRO-1: reduce-scatters of n/2B, the same 5, 15, 5 ms (ends at 110 ms); the optimizer's
     * half, 2.5 ms; then the all-gather of the 5e6 B of parameters, 25 ms:
     * 10 + 110 + 2.5 + 25 = 147.5 ms */
    c.bf16_wire = false;
    c.mode = NB__SCALE_ZERO1;
    r = nb__scale_replay(&t, &c);
    NEAR(r.step_s, 0.1475);
    NEAR(r.comm_s, 0.050);
    /* PowerSGD rank 4 (min rate 2): c is compressed ((500 + 1000) 4 2 = 12000 < 5e5), P 2000
     * and Q 4000 elements. {a}: one all-reduce, 20..30. {b, c}: first all-reduce of b and P,
     * 252000 x 4 B, 10.08 ms, 90..100.08. {d}'s launch at 100 waits for it (backward held up
     * 0.08 ms), starts the Qs', 16000 B, 0.16 ms: 100.08..100.24, then its own 10 ms:
     * 100.24..110.24. Step 10 + 110.24 + 5 = 125.24 ms, 10.24 exposed, 30.24 ms of
     * communication. */
    c.mode = NB__SCALE_DDP;
    c.powersgd_rank = 4, c.powersgd_min_rate = 2;
    r = nb__scale_replay(&t, &c);
    NEAR(r.step_s, 0.12524);
    NEAR(r.exposed_s, 0.01024);
    NEAR(r.comm_s, 0.03024);
    /* the same buckets by hand, {b, c}'s Qs started at the end of backward when it is the last:
     * b0 20..30, b1 90..100.08, its Qs at max(100, 100.08) .. 100.24; step 10 + 100.24 + 5 */
    double two[] = {0, 0.00016};
    r = nb__scale_replay_buckets(2, (double[]){0.01, 0.01008}, two, ready, 0.010, 0.100, 0.005, 0, s, e);
    NEAR(e[1], 0.10024);
    NEAR(r.step_s, 0.11524);
    /* a rank above the matrix's rate: nothing compressed, plain DDP's 145 ms */
    c.powersgd_rank = 400;
    NEAR(nb__scale_replay(&t, &c).step_s, 0.145);
    c.powersgd_rank = 0;
    /* one device: no communication at all, efficiency 1 */
    c.mode = NB__SCALE_DDP;
    c.per_node = 1;
    r = nb__scale_replay(&t, &c);
    NEAR(r.step_s, 0.115);
    NEAR(r.efficiency, 1);
}
END_TEST

START_TEST(test_suggest_bucket) {
    /* alpha 1 s dwarfs everything: the fewest buckets win. At a 4 MiB cap (4194304 B) a, b, c
     * (4e6 B) stay open and d closes one bucket; at 2 MiB {a, b, c} then {d}: the suggestion is
     * 4 MiB, the smallest cap with one bucket. */
    nb__scale_trace t = made_up();
    nb__scale_link lat = {"lat", 1.0, 1e9, "test"};
    nb__scale_config c = {.nodes = 1, .per_node = 2, .mode = NB__SCALE_DDP, .algo = NB__SCALE_RING,
                          .first_bucket = 1 << 20, .bucket_cap = 25 << 20, .intra = lat, .inter = lat};
    double step;
    NEAR(nb__scale_suggest(&t, &c, &step), 4);
    /* one bucket ready at 100 ms: 2 s of latency + 5e6/1e9 s, then the optimizer */
    NEAR(step, 0.010 + 0.100 + 2.0 + 5e-3 + 0.005);
}
END_TEST

START_TEST(test_trace_file) {
    char path[] = "/tmp/nb_trace_XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    close(fd);
    nb__scale_trace t = made_up(), back;
    ck_assert_int_eq(nb__scale_trace_write(path, &t), NB_OK);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_OK);
    ck_assert_int_eq(back.n, 4);
    ck_assert_str_eq(back.source, "made up");
    ck_assert_str_eq(back.p[2].name, "c");
    ck_assert_int_eq(back.p[2].numel, 500000);
    ck_assert_int_eq(back.p[2].rows, 500);
    ck_assert_int_eq(back.p[1].rows, 0);
    NEAR(back.p[3].ready_s, 0.10);
    NEAR(back.backward_s, 0.100);
    nb__scale_trace_free(&back);
    /* errors name the file and line */
    FILE *f = fopen(path, "w");
    fputs("nabla-step-trace 1\nforward_s 1\nbackward_s 1\noptimizer_s 1\nparam x f32 4 0.5\nparam y f32 4 0.2\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), ":6: parameter y") != NULL, "%s", nb_last_error());
    f = fopen(path, "w");
    fputs("nabla-step-trace 1\nforward_s 1\nbogus 3\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), ":3: cannot read \"bogus 3\"") != NULL, "%s", nb_last_error());
    f = fopen(path, "w"); /* a time that is not a number */
    fputs("nabla-step-trace 1\nforward_s 1\nbackward_s 1\noptimizer_s 1\nparam x f32 4 nan\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), ":5: parameter x") != NULL, "%s", nb_last_error());
    f = fopen(path, "w");
    fputs("nabla-step-trace 1\nforward_s inf\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_ERR_FORMAT);
    f = fopen(path, "w");
    fputs("step 1\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_ERR_FORMAT);
    f = fopen(path, "w");
    fputs("nabla-step-trace 1\nforward_s 1\nbackward_s 1\nparam x f32 4 0.5\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_trace_read(path, &back), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), "a phase time") != NULL, "%s", nb_last_error());
    remove(path);
}
END_TEST

START_TEST(test_fit_measured) {
    /* A bench_collectives table for 4 ranks made from alpha 20 us, 2 GB/s:
     * t = 6 alpha + 1.5 n / bw; the fit must give them back. */
    char path[] = "/tmp/nb_coll_XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("# all_reduce(sum, f32), backend gloo, 4 ranks, device cpu\n# busbw = ...\n"
          "      size       count  iters    time (us) algbw (GB/s) busbw (GB/s)\n", f);
    for (double bytes = 4096; bytes <= 64.0 * 1048576; bytes *= 4) {
        double us = 1e6 * (6 * 20e-6 + 1.5 * bytes / 2e9);
        fprintf(f, "%6.0f KB %11lld %6d %12.3f %12.3f %12.3f\n", bytes / 1024, (long long)(bytes / 4), 10, us, 1.0, 1.0);
    }
    fclose(f);
    nb__scale_link l;
    ck_assert_int_eq(nb__scale_link_parse(strcat(strcpy((char[64]){0}, "measured:"), path), &l), NB_OK);
    ck_assert_msg(fabs(l.alpha_s - 20e-6) < 1e-8 && fabs(l.bw - 2e9) < 1e3, "alpha %g bw %g", l.alpha_s, l.bw);
    ck_assert_str_eq(l.name, "measured");
    f = fopen(path, "w");
    fputs("# all_reduce(sum, f32), backend gloo, 1 ranks, device cpu\n", f);
    fclose(f);
    ck_assert_int_eq(nb__scale_fit(path, &l), NB_ERR_FORMAT);
    remove(path);
    /* presets and the custom form */
    ck_assert(nb__scale_preset("ib400", &l) && l.bw == 50e9);
    ck_assert_int_eq(nb__scale_link_parse("10,1.25", &l), NB_OK);
    NEAR(l.alpha_s, 10e-6);
    NEAR(l.bw, 1.25e9);
    ck_assert_int_eq(nb__scale_link_parse("warp-drive", &l), NB_ERR_INVALID);
}
END_TEST

NBT_MAIN("scale", "model", 0,
         test_flat_closed_forms, test_hierarchical_closed_forms, test_replay_timeline, test_suggest_bucket,
         test_trace_file, test_fit_measured)
