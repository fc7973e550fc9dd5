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
 * (tests/dist/dist_scenario.c), not taken from the library. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/proc.h"
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
};

/* "rank 1" or "ranks 1, 2": the ranks of [lo, hi). */
static void ranks_text(int lo, int hi, char *out, size_t len) {
    size_t u = (size_t)snprintf(out, len, "%s", hi - lo == 1 ? "rank " : "ranks ");
    for (int r = lo; r < hi; r++) u += (size_t)snprintf(out + u, len - u, "%s%d", r > lo ? ", " : "", r);
}

static void run_case(const mm_case *c, int R) {
    char np[8];
    snprintf(np, sizeof np, "%d", R);
    char *argv[] = {nbrun_path, "--nproc-per-node", np, "--master-port", "0", scenario_path, (char *)c->name, NULL};
    nbt_proc p;
    memset(&p, 0, sizeof p);
    p.argv = argv;
    p.env[0] = "NABLA_PG_TIMEOUT=60";
    p.pass_fd = -1;
    nbt_proc_start(&p);
    nbt_proc_wait_all(&p, 1, 90);
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
    char np[8];
    snprintf(np, sizeof np, "%d", R);
    char *argv[] = {nbrun_path, "--nproc-per-node", np, "--master-port", "0", scenario_path, "mm_group", NULL};
    nbt_proc p;
    memset(&p, 0, sizeof p);
    p.argv = argv;
    p.env[0] = "NABLA_PG_TIMEOUT=60";
    p.pass_fd = -1;
    nbt_proc_start(&p);
    nbt_proc_wait_all(&p, 1, 90);
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

static Suite *suite(void) {
    Suite *s = suite_create("dist_mismatch");
    TCase *tc = tcase_create("mismatch");
    tcase_set_timeout(tc, 120);
    /* The four collectives at 2 ranks; every kind of difference at 3. */
    tcase_add_loop_test(tc, test_mismatch_2_ranks, 0, 4);
    tcase_add_loop_test(tc, test_mismatch_3_ranks, 0, (int)(sizeof cases / sizeof cases[0]));
    tcase_add_loop_test(tc, test_mismatch_in_subgroup, 0, 2);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    snprintf(nbrun_path, sizeof nbrun_path, "%s/bin/nbrun", NABLA_BINARY_DIR);
    snprintf(scenario_path, sizeof scenario_path, "%s/tests/dist_scenario", NABLA_BINARY_DIR);
    if (!NABLA_HAVE_GLOO) {
        fprintf(stderr, "skipped: this build has no Gloo\n");
        return 77;
    }
    return nbt_run(suite());
}
