/* Collectives that differ between ranks (count, dtype, reduction, root)
 * fail on every rank with NB_ERR_MISMATCH, naming the ranks and what each
 * issued, before any data moves: every rank's buffers keep their values.
 * Without the header exchange of Note [Collective headers]
 * (distributed/pg_gloo.c), the count cases ended in SIGABRT inside Gloo and
 * the broadcast case returned NB_OK on every rank with stale data.
 *
 * Each case runs tests/dist_scenario mm_* under nbrun with 2 or 3 ranks;
 * one does it on a subgroup, whose ranks are named with their world ranks.
 * The expected lines are written out here from the scenarios' definitions
 * (tests/dist/dist_scenario.c), not taken from the library.
 *
 * Without processes (and without Gloo): the comparison both backends
 * decide with (nb__diag_headers, what an NCCL group runs on the headers
 * it all-gathers) on headers made up here, and which collectives an NCCL
 * group checks under each NABLA_DIST_CHECK (Note [Collective headers on
 * NCCL] in distributed/pg.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/proc.h"
#include "distributed/pg.h"
#include "testutil.h"

static char nbrun_path[4096], scenario_path[4096];

#define EXPECT_IN(text, needle) \
    ck_assert_msg(strstr((text), (needle)) != NULL, "expected \"%s\" in:\n%s", (needle), (text))

/* One scenario: the odd rank (first or last) issues `odd_fp`, the others
 * `fp`; both through `fn`; they differ in `diff`. */
typedef struct mm_case {
    const char *name, *fn;
    bool odd_is_last;
    const char *odd_fp, *fp, *diff;
} mm_case;

static const mm_case cases[] = {
    {"mm_count", "nb_pg_all_reduce", false, "all_reduce(sum, f32, count=10)", "all_reduce(sum, f32, count=20)", "count"},
    {"mm_bcast", "nb_pg_broadcast", false, "broadcast(f32, count=10, root=0)", "broadcast(f32, count=20, root=0)", "count"},
    {"mm_gather", "nb_pg_all_gather", false, "all_gather(f32, count=3)", "all_gather(f32, count=4)", "count"},
    {"mm_rs", "nb_pg_reduce_scatter", false, "reduce_scatter(sum, f32, count=3)", "reduce_scatter(sum, f32, count=4)", "count"},
    {"mm_dtype", "nb_pg_all_reduce", true, "all_reduce(sum, f64, count=8)", "all_reduce(sum, f32, count=8)", "dtype"},
    {"mm_op", "nb_pg_all_reduce", true, "all_reduce(max, f32, count=8)", "all_reduce(sum, f32, count=8)", "reduction"},
    {"mm_root", "nb_pg_broadcast", true, "broadcast(f32, count=8, root=1)", "broadcast(f32, count=8, root=0)", "root"},
    {"mm_zero", "nb_pg_all_reduce", false, "all_reduce(sum, f32, count=0)", "all_reduce(sum, f32, count=8)", "count"},
    /* Note [Small collectives in one message] (distributed/pg_gloo.c): the counts both within the one-message
     * limit (32768 bytes at 2-3 ranks), whose data travel with the header; then one within, one beyond it */
    {"mm_small", "nb_pg_all_reduce", false, "all_reduce(sum, f32, count=1000)", "all_reduce(sum, f32, count=1024)", "count"},
    {"mm_limit", "nb_pg_broadcast", false, "broadcast(f32, count=8, root=0)", "broadcast(f32, count=10000, root=0)", "count"},
};

/* "rank 1" or "ranks 1, 2": the ranks of [lo, hi). */
static void ranks_text(int lo, int hi, char *out, size_t len) {
    size_t u = (size_t)snprintf(out, len, "%s", hi - lo == 1 ? "rank " : "ranks ");
    for (int r = lo; r < hi; r++) u += (size_t)snprintf(out + u, len - u, "%s%d", r > lo ? ", " : "", r);
}

/* Runs scenario `name` under nbrun at R ranks, to its end (90 s at most). */
static void run_scenario(nbt_proc *p, const char *name, int R) {
    char np[8];
    snprintf(np, sizeof np, "%d", R);
    char *argv[] = {nbrun_path, "--nproc-per-node", np, "--master-port", "0", scenario_path, (char *)name, NULL};
    memset(p, 0, sizeof *p);
    p->argv = argv;
    p->env[0] = "NABLA_PG_TIMEOUT=60";
    p->pass_fd = -1;
    nbt_proc_start(p);
    nbt_proc_wait_all(p, 1, 90);
    p->argv = NULL; /* argv was this function's */
}

static void run_case(const mm_case *c, int R) {
    nbt_proc p;
    run_scenario(&p, c->name, R);
    ck_assert_msg(p.code == 1, "%s at %d ranks: nbrun exited with %d; stdout:\n%s\nstderr:\n%s", c->name, R, p.code,
                  p.out, p.err);
    ck_assert_msg(p.seconds < 30, "%s at %d ranks took %.1f s (timeout 60 s)", c->name, R, p.seconds);

    /* The ranks grouped in rank order: the odd one first or last. */
    int odd = c->odd_is_last ? R - 1 : 0;
    char odd_r[32], rest[32], body[512];
    ranks_text(odd, odd + 1, odd_r, sizeof odd_r);
    if (c->odd_is_last) {
        ranks_text(0, R - 1, rest, sizeof rest);
        snprintf(body, sizeof body, "ranks disagree on collective #2: %s issued %s; %s issued %s (they differ in %s); "
                 "no data was exchanged", rest, c->fp, odd_r, c->odd_fp, c->diff);
    } else {
        ranks_text(1, R, rest, sizeof rest);
        snprintf(body, sizeof body, "ranks disagree on collective #2: %s issued %s; %s issued %s (they differ in %s); "
                 "no data was exchanged", odd_r, c->odd_fp, rest, c->fp, c->diff);
    }
    for (int r = 0; r < R; r++) {
        char want[1024];
        snprintf(want, sizeof want,
                 "[rank %d] rank %d: mismatch between ranks or files: %s: collective #2 %s on group 'world' "
                 "(rank %d of %d) cannot run; %s",
                 r, r, c->fn, r == odd ? c->odd_fp : c->fp, r, R, body);
        EXPECT_IN(p.err, want);
        snprintf(want, sizeof want, "[rank %d] rank %d: buffers untouched", r, r);
        EXPECT_IN(p.err, want);
    }
    ck_assert_msg(strstr(p.out, "completed") == NULL, "%s at %d ranks: a rank completed:\n%s", c->name, R, p.out);
    nbt_proc_free(&p);
}

START_TEST(test_mismatch_2_ranks) { run_case(&cases[_i], 2); }
END_TEST

START_TEST(test_mismatch_3_ranks) { run_case(&cases[_i], 3); }
END_TEST

/* A subgroup whose ranks are not the world's (group 'world.g1' is world
 * ranks, in that order): group ranks, with their world ranks. */
static void run_group_case(int R) {
    nbt_proc p;
    run_scenario(&p, "mm_group", R);
    ck_assert_msg(p.code == 1, "mm_group at %d ranks: nbrun exited with %d; stderr:\n%s", R, p.code, p.err);
    /* A member's world rank is named where it differs from its group rank. */
    char note[2][32], body[512], want[1024];
    for (int g = 0; g < 2; g++) {
        if (R - 1 - g != g) snprintf(note[g], sizeof note[g], " (world rank %d)", R - 1 - g);
        else note[g][0] = 0;
    }
    snprintf(body, sizeof body, "ranks disagree on collective #1: rank 0%s issued all_reduce(sum, f32, count=5); "
             "rank 1%s issued all_reduce(sum, f32, count=6) (they differ in count); no data was exchanged",
             note[0], note[1]);
    for (int g = 0; g < 2; g++) {
        int w = R - 1 - g;
        snprintf(want, sizeof want,
                 "[rank %d] rank %d: mismatch between ranks or files: nb_pg_all_reduce: collective #1 all_reduce(sum, "
                 "f32, count=%d) on group 'world.g1' (rank %d of 2) cannot run; %s",
                 w, w, g == 0 ? 5 : 6, g, body);
        EXPECT_IN(p.err, want);
        snprintf(want, sizeof want, "[rank %d] rank %d: buffers untouched", w, w);
        EXPECT_IN(p.err, want);
    }
    nbt_proc_free(&p);
}

START_TEST(test_mismatch_in_subgroup) { run_group_case(2 + _i); }
END_TEST

/* Without the header exchange (NABLA_DIST_CHECK=off), two ranks whose
 * all-reduces beyond the one-message limit differ in count (10000 floats
 * against 12000) both fail, naming the two sizes (Note [Blocking
 * exchanges] in distributed/gloo_shim.cpp), or the two collectives when
 * the failure's diagnosis (pg_diag.c) read both fingerprints from the
 * store: rank 0 would otherwise have read rank 1's longer message as an
 * error and rank 1 rank 0's shorter one as its result. */
START_TEST(test_unchecked_pair_sizes) {
    nbt_proc p;
    run_scenario(&p, "mm_pair", 2);
    ck_assert_msg(p.code == 1, "mm_pair: nbrun exited with %d; stdout:\n%s\nstderr:\n%s", p.code, p.out, p.err);
    /* the exchange's words, or, when the failure's diagnosis found both
     * ranks' fingerprints in the store first, the mismatch they show */
    const char *diag = "ranks disagree on collective #2: rank 0 issued all_reduce(sum, f32, count=10000); rank 1 "
                       "issued all_reduce(sum, f32, count=12000)";
    for (int r = 0; r < 2; r++) {
        char mine[128], line[64];
        snprintf(mine, sizeof mine, "rank %d sends %d bytes but rank %d sends %d", r, r ? 48000 : 40000, 1 - r,
                 r ? 40000 : 48000);
        snprintf(line, sizeof line, "[rank %d] rank %d: ", r, r);
        const char *at = strstr(p.err, line);
        ck_assert_msg(at != NULL, "mm_pair: rank %d reported no failure:\n%s", r, p.err);
        const char *end = strchr(at, '\n');
        size_t len = end ? (size_t)(end - at) : strlen(at);
        char *msg = strndup(at, len);
        ck_assert_msg(strstr(msg, mine) || strstr(msg, diag), "mm_pair: rank %d: neither \"%s\" nor \"%s\" in:\n%s",
                      r, mine, diag, msg);
        free(msg);
    }
    EXPECT_IN(p.err, "[rank 0] rank 0: buffers untouched");
    EXPECT_IN(p.err, "[rank 1] rank 1: buffers untouched");
    ck_assert_msg(strstr(p.out, "completed") == NULL, "mm_pair: a rank completed:\n%s", p.out);
    nbt_proc_free(&p);
}
END_TEST

/* A group of 3 seen from rank 1, which issued `mine` as collective #7. */
static nb_status compare3(const nb__coll *mine, const nb__coll *each, char *out, size_t len) {
    static int global[3] = {0, 1, 2};
    nb_pg pg;
    memset(&pg, 0, sizeof pg);
    pg.root = &pg;
    pg.rank = 1;
    pg.size = 3;
    pg.global = global;
    snprintf(pg.name, sizeof pg.name, "world");
    nb_work w;
    memset(&w, 0, sizeof w);
    w.coll = *mine;
    w.coll.seq = 7;
    nb__coll_fingerprint(&w.coll, w.fingerprint, sizeof w.fingerprint);
    int64_t all[3 * NB__COLL_HEADER_WORDS];
    for (int r = 0; r < 3; r++) nb__coll_header(&each[r], all + r * NB__COLL_HEADER_WORDS);
    out[0] = 0;
    return nb__diag_headers(&pg, &w, all, out, len);
}

START_TEST(test_headers_compared) {
    char out[2048];
    nb__coll b20 = {.kind = NB__BROADCAST, .dtype = NB_F32, .count = 20}, b10 = b20;
    b10.count = 10;
    /* the broadcast whose root sends fewer elements than the others expect */
    nb__coll each[3] = {b10, b20, b20};
    ck_assert_int_eq(compare3(&b20, each, out, sizeof out), NB_ERR_MISMATCH);
    EXPECT_IN(out, "nb_pg_broadcast: collective #7 broadcast(f32, count=20, root=0) on group 'world' (rank 1 of 3) "
                   "cannot run; ranks disagree on collective #7: rank 0 issued broadcast(f32, count=10, root=0); "
                   "ranks 1, 2 issued broadcast(f32, count=20, root=0) (they differ in count); no data was exchanged");
    /* all equal: no message */
    nb__coll same[3] = {b20, b20, b20};
    ck_assert_int_eq(compare3(&b20, same, out, sizeof out), NB_OK);
    ck_assert_str_eq(out, "");
    /* an all-reduce's reduction differs; fields a kind does not use do not count */
    nb__coll sum = {.kind = NB__ALL_REDUCE, .op = NB_REDUCE_SUM, .dtype = NB_F32, .count = 8}, mx = sum;
    mx.op = NB_REDUCE_MAX;
    nb__coll ar[3] = {sum, sum, mx};
    ck_assert_int_eq(compare3(&sum, ar, out, sizeof out), NB_ERR_MISMATCH);
    EXPECT_IN(out, "ranks 0, 1 issued all_reduce(sum, f32, count=8); rank 2 issued all_reduce(max, f32, count=8) "
                   "(they differ in reduction)");
    nb__coll bar = {.kind = NB__BARRIER, .count = 5, .root = 2}, bar2 = {.kind = NB__BARRIER};
    nb__coll bars[3] = {bar, bar2, bar};
    ck_assert_int_eq(compare3(&bar2, bars, out, sizeof out), NB_OK);
    /* different kinds */
    nb__coll mixed[3] = {b20, sum, sum};
    ck_assert_int_eq(compare3(&sum, mixed, out, sizeof out), NB_ERR_MISMATCH);
    EXPECT_IN(out, "rank 0 issued broadcast(f32, count=20, root=0); ranks 1, 2 issued all_reduce(sum, f32, count=8) "
                   "(different collectives)");
}
END_TEST

/* Note [Which collectives are checked] (distributed/pg_check.c): Gloo checks every collective unless
 * off; NCCL by default every broadcast and the first 16 of a group. */
START_TEST(test_which_collectives_check) {
    nb__coll ar = {.kind = NB__ALL_REDUCE, .count = 8}, bc = {.kind = NB__BROADCAST, .count = 8};
    for (uint64_t seq = 1; seq <= 40; seq++) {
        ar.seq = bc.seq = seq;
        ck_assert(nb__coll_header_wanted(NB__CHECK_AUTO, true, &ar));
        ck_assert(nb__coll_header_wanted(NB__CHECK_AUTO, false, &ar) == (seq <= 16));
        ck_assert(nb__coll_header_wanted(NB__CHECK_AUTO, false, &bc));
        ck_assert(nb__coll_header_wanted(NB__CHECK_FULL, false, &ar));
        ck_assert(!nb__coll_header_wanted(NB__CHECK_OFF, true, &ar));
        ck_assert(!nb__coll_header_wanted(NB__CHECK_OFF, false, &bc));
    }
    nb__dist_check m = NB__CHECK_OFF;
    unsetenv("NABLA_DIST_CHECK");
    ck_assert_int_eq(nb__dist_check_option(&m), NB_OK);
    ck_assert_int_eq(m, NB__CHECK_AUTO);
    setenv("NABLA_DIST_CHECK", "full", 1);
    ck_assert_int_eq(nb__dist_check_option(&m), NB_OK);
    ck_assert_int_eq(m, NB__CHECK_FULL);
    setenv("NABLA_DIST_CHECK", "off", 1);
    ck_assert_int_eq(nb__dist_check_option(&m), NB_OK);
    ck_assert_int_eq(m, NB__CHECK_OFF);
    setenv("NABLA_DIST_CHECK", "always", 1);
    ck_assert_int_eq(nb__dist_check_option(&m), NB_ERR_INVALID);
    EXPECT_IN(nb_last_error(), "nb_pg_init: NABLA_DIST_CHECK='always' is not auto, full or off");
    unsetenv("NABLA_DIST_CHECK");
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("dist_mismatch");
    nbt_suite_add(s, "headers", 0, (const TTest *[]){test_headers_compared, test_which_collectives_check,
                  NULL});
    if (!NABLA_HAVE_GLOO) return s;
    TCase *tc = tcase_create("mismatch");
    tcase_set_timeout(tc, 120);
    /* The four collectives and the counts about the one-message limit at 2 ranks; every case at 3. */
    tcase_add_loop_test(tc, test_mismatch_2_ranks, 0, 4);
    tcase_add_loop_test(tc, test_mismatch_2_ranks, 8, 10);
    tcase_add_loop_test(tc, test_mismatch_3_ranks, 0, (int)(sizeof cases / sizeof cases[0]));
    tcase_add_loop_test(tc, test_mismatch_in_subgroup, 0, 2);
    tcase_add_test(tc, test_unchecked_pair_sizes);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    snprintf(nbrun_path, sizeof nbrun_path, "%s/bin/nbrun", NABLA_BINARY_DIR);
    snprintf(scenario_path, sizeof scenario_path, "%s/tests/dist_scenario", NABLA_BINARY_DIR);
    if (!NABLA_HAVE_GLOO) fprintf(stderr, "this build has no Gloo: the scenarios under nbrun are skipped\n");
    return nbt_run(suite());
}
