/* Failures of a distributed run and what they print: a rank that never
 * arrives (timeout naming it), a desync (both fingerprints, long before the
 * timeout), a rank that exits with 3 (nbrun exits 3 and shows its stderr
 * last), a rank that is killed and the store's host dying (the others fail
 * at once, naming what happened).
 *
 * Each case runs tests/dist_scenario with 3 ranks, under nbrun or, where
 * the survivors' own messages are the point, started directly by this test
 * (nbrun would stop the survivors as soon as the first rank dies). The
 * time limits asserted are ten times what the behaviour needs and a
 * fraction of the collective timeout, so they separate "failed fast" from
 * "waited for the timeout" without measuring speed. */
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dist/proc.h"
#include "testutil.h"

static char nbrun_path[4096], scenario_path[4096];

static void paths(void) {
    snprintf(nbrun_path, sizeof nbrun_path, "%s/bin/nbrun", NABLA_BINARY_DIR);
    snprintf(scenario_path, sizeof scenario_path, "%s/tests/dist_scenario", NABLA_BINARY_DIR);
}

#define EXPECT_IN(text, needle) \
    ck_assert_msg(strstr((text), (needle)) != NULL, "expected \"%s\" in:\n%s", (needle), (text))

/* nbrun --nproc-per-node 3 dist_scenario NAME, with the collective timeout given. */
static void run_nbrun(nbt_proc *p, const char *name, const char *timeout_env) {
    static char *argv[8];
    argv[0] = nbrun_path;
    argv[1] = "--nproc-per-node";
    argv[2] = "3";
    argv[3] = scenario_path;
    argv[4] = (char *)name;
    argv[5] = NULL;
    memset(p, 0, sizeof *p);
    p->argv = argv;
    p->env[0] = timeout_env;
    p->pass_fd = -1;
    nbt_proc_start(p);
    nbt_proc_wait_all(p, 1, 90);
}

START_TEST(test_absent_rank_times_out) {
    nbt_proc p;
    run_nbrun(&p, "absent", "NABLA_PG_TIMEOUT=2");
    ck_assert_msg(p.code == 1, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    EXPECT_IN(p.err, "nb_pg_all_reduce: collective #2 all_reduce(sum, f32, count=8) on group 'world'");
    EXPECT_IN(p.err, "did not complete within 2.0 s");
    EXPECT_IN(p.err, "rank 2 did not arrive (its last collective on this group was #1 "
                     "all_reduce(sum, f32, count=8))");
    EXPECT_IN(p.err, "arrived: ranks 0, 1");
    EXPECT_IN(p.err, "failed first: exited with code 1; the other ranks were stopped");
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_desync_names_both_fingerprints) {
    nbt_proc p;
    run_nbrun(&p, "desync", "NABLA_PG_TIMEOUT=60");
    ck_assert_msg(p.code == 1, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    EXPECT_IN(p.err, "ranks disagree on collective #2: rank 0 issued broadcast(f32, count=8, root=0); "
                     "ranks 1, 2 issued all_reduce(sum, f32, count=8)");
    ck_assert_msg(p.seconds < 30, "the desync took %.1f s to report (timeout 60 s)", p.seconds);
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_exit_code_and_stderr_of_failing_rank) {
    nbt_proc p;
    run_nbrun(&p, "exit3", "NABLA_PG_TIMEOUT=60");
    ck_assert_msg(p.code == 3, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    ck_assert_msg(p.seconds < 30, "nbrun took %.1f s to stop the run", p.seconds);
    EXPECT_IN(p.err, "nbrun: rank 1 (local rank 1, pid ");
    EXPECT_IN(p.err, "failed first: exited with code 3");
    char last[256];
    ck_assert_str_eq(nbt_last_line(p.err, last, sizeof last), "  [rank 1] rank 1 gives up: no data in shard 1");
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_killed_rank_under_nbrun) {
    nbt_proc p;
    run_nbrun(&p, "killed", "NABLA_PG_TIMEOUT=60");
    ck_assert_msg(p.code == 137, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    EXPECT_IN(p.err, "nbrun: rank 1 (local rank 1, pid ");
    EXPECT_IN(p.err, "failed first: was killed by signal 9");
    nbt_proc_free(&p);
}
END_TEST

/* Starts the 3 ranks of `name` directly, as nbrun would, and waits. */
static void run_direct(nbt_proc ps[3], const char *name) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert(bind(lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(lfd, 64) == 0);
    socklen_t sl = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &sl);
    fcntl(lfd, F_SETFD, FD_CLOEXEC);
    static char env[3][8][64];
    static char *argv[3];
    argv[0] = scenario_path;
    argv[1] = (char *)name;
    argv[2] = NULL;
    for (int r = 0; r < 3; r++) {
        memset(&ps[r], 0, sizeof ps[r]);
        snprintf(env[r][0], 64, "RANK=%d", r);
        snprintf(env[r][1], 64, "LOCAL_RANK=%d", r);
        snprintf(env[r][2], 64, "WORLD_SIZE=3");
        snprintf(env[r][3], 64, "LOCAL_WORLD_SIZE=3");
        snprintf(env[r][4], 64, "MASTER_ADDR=127.0.0.1");
        snprintf(env[r][5], 64, "MASTER_PORT=%d", ntohs(a.sin_port));
        snprintf(env[r][6], 64, "NABLA_PG_TIMEOUT=60");
        snprintf(env[r][7], 64, "NABLA_STORE_FD=%d", lfd);
        for (int k = 0; k < (r == 0 ? 8 : 7); k++) ps[r].env[k] = env[r][k];
        ps[r].argv = argv;
        ps[r].pass_fd = r == 0 ? lfd : -1;
        nbt_proc_start(&ps[r]);
    }
    close(lfd);
    nbt_proc_wait_all(ps, 3, 90);
}

/* Rank 0 serves the store, so it always learns from it that rank 1 died.
 * Rank 2 does too, unless rank 0 has already failed and exited, taking
 * the store with it; then it says so. */
START_TEST(test_killed_rank_makes_others_fail_fast) {
    nbt_proc ps[3];
    run_direct(ps, "killed");
    ck_assert_msg(ps[1].code == 137, "rank 1 exited with %d", ps[1].code);
    const char *dead = "rank 1 disconnected from the store without saying goodbye: its process exited or was killed";
    for (int r = 0; r < 3; r += 2) {
        ck_assert_msg(ps[r].code == 1, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        EXPECT_IN(ps[r].err, "collective #2 all_reduce(sum, f32, count=8)");
        if (r == 0 || !strstr(ps[r].err, "the store is unreachable too")) EXPECT_IN(ps[r].err, dead);
        ck_assert_msg(ps[r].seconds < 30, "rank %d took %.1f s to fail (timeout 60 s)", r, ps[r].seconds);
    }
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

START_TEST(test_store_host_dies) {
    nbt_proc ps[3];
    run_direct(ps, "store");
    ck_assert_msg(ps[0].code == 137, "rank 0 exited with %d", ps[0].code);
    for (int r = 1; r < 3; r++) {
        ck_assert_msg(ps[r].code == 1, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        EXPECT_IN(ps[r].err, "collective #2 all_reduce(sum, f32, count=8)");
        EXPECT_IN(ps[r].err, "lost the connection to the store at 127.0.0.1:");
        ck_assert_msg(ps[r].seconds < 30, "rank %d took %.1f s to fail (timeout 60 s)", r, ps[r].seconds);
    }
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("dist_failures");
    TCase *tc = tcase_create("failures");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_absent_rank_times_out);
    tcase_add_test(tc, test_desync_names_both_fingerprints);
    tcase_add_test(tc, test_exit_code_and_stderr_of_failing_rank);
    tcase_add_test(tc, test_killed_rank_under_nbrun);
    tcase_add_test(tc, test_killed_rank_makes_others_fail_fast);
    tcase_add_test(tc, test_store_host_dies);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    paths();
    if (!NABLA_HAVE_GLOO) {
        fprintf(stderr, "skipped: this build has no Gloo\n");
        return 77;
    }
    return nbt_run(suite());
}
