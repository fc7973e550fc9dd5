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

/* nbrun --nproc-per-node 3 dist_scenario NAME, with the variables of
 * `envs` (NULL-terminated) set. */
static void run_nbrun_env(nbt_proc *p, const char *name, const char *const *envs) {
    static char *argv[8];
    argv[0] = nbrun_path;
    argv[1] = "--nproc-per-node";
    argv[2] = "3";
    argv[3] = scenario_path;
    argv[4] = (char *)name;
    argv[5] = NULL;
    memset(p, 0, sizeof *p);
    p->argv = argv;
    for (int i = 0; envs[i] && i < 15; i++) p->env[i] = envs[i];
    p->pass_fd = -1;
    nbt_proc_start(p);
    nbt_proc_wait_all(p, 1, 90);
}

/* The same with the collective timeout given. */
static void run_nbrun(nbt_proc *p, const char *name, const char *timeout_env) {
    const char *envs[] = {timeout_env, NULL};
    run_nbrun_env(p, name, envs);
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

/* The pids of `pid`'s children (at most n), from /proc; how many. */
static int children_of(pid_t pid, pid_t *out, int n) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)pid, (int)pid);
    FILE *f = fopen(path, "r");
    int k = 0, c;
    while (f && k < n && fscanf(f, "%d", &c) == 1) out[k++] = (pid_t)c;
    if (f) fclose(f);
    return k;
}

static void pause_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static bool is_zombie(pid_t pid) {
    char path[64], state = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return true;
    int r = fscanf(f, "%*d (%*[^)]) %c", &state);
    fclose(f);
    return r == 1 && state == 'Z';
}

/* nbrun is stopped while rank 1 exits with 3 and the others, learning of
 * it within milliseconds, fail too; resumed, it reaps all three at once
 * (the kernel lists rank 0 first) and must still name rank 1, whose
 * SIGCHLD came first. */
START_TEST(test_first_failure_named_when_reaped_together) {
    nbt_proc p;
    char *argv[] = {nbrun_path, "--nproc-per-node", "3", scenario_path, "exit3", NULL};
    memset(&p, 0, sizeof p);
    p.argv = argv;
    p.env[0] = "NABLA_PG_TIMEOUT=60";
    p.pass_fd = -1;
    nbt_proc_start(&p);
    pid_t kids[3];
    double t0 = nbt_now();
    while (children_of(p.pid, kids, 3) < 3 && nbt_now() - t0 < 20) pause_s(0.001);
    ck_assert_msg(children_of(p.pid, kids, 3) == 3, "nbrun did not start 3 ranks");
    kill(p.pid, SIGSTOP);
    bool all_dead = false;
    while (!all_dead && nbt_now() - t0 < 40) {
        pause_s(0.02);
        all_dead = is_zombie(kids[0]) && is_zombie(kids[1]) && is_zombie(kids[2]);
    }
    kill(p.pid, SIGCONT);
    ck_assert_msg(all_dead, "the ranks did not all end while nbrun was stopped");
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_msg(p.code == 3, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    EXPECT_IN(p.err, "nbrun: rank 1 (local rank 1, pid ");
    EXPECT_IN(p.err, "failed first: exited with code 3");
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

/* A listening socket on a free port of 127.0.0.1 (close-on-exec). */
static int listen_free(int *port) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert(bind(lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(lfd, 64) == 0);
    socklen_t sl = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &sl);
    fcntl(lfd, F_SETFD, FD_CLOEXEC);
    *port = ntohs(a.sin_port);
    return lfd;
}

typedef struct direct_opts {
    int world;          /* ranks in the run */
    int start;          /* ranks actually started: 0 .. start-1 */
    bool local_vars;    /* set LOCAL_RANK and LOCAL_WORLD_SIZE */
    int held_fd;        /* >= 0: MASTER_PORT is this socket's, not handed to rank 0 */
    const char *extra[4];
    int world_of[4];    /* > 0: WORLD_SIZE of that rank instead of `world` */
    const char *rank_env[4]; /* one more variable for that rank only */
    const char *rank_env2[4]; /* and another (set after, so it may override) */
} direct_opts;

/* Starts ranks of `name` directly, as nbrun would (or as a hand launch
 * would, per `o`), and waits. */
static void run_direct_opts(nbt_proc *ps, const char *name, const direct_opts *o) {
    int port, lfd;
    if (o->held_fd >= 0) {
        lfd = o->held_fd;
        struct sockaddr_in a;
        socklen_t sl = sizeof a;
        getsockname(lfd, (struct sockaddr *)&a, &sl);
        port = ntohs(a.sin_port);
    } else {
        lfd = listen_free(&port);
    }
    static char env[4][8][64];
    static char *argv[3];
    argv[0] = scenario_path;
    argv[1] = (char *)name;
    argv[2] = NULL;
    for (int r = 0; r < o->start; r++) {
        memset(&ps[r], 0, sizeof ps[r]);
        int k = 0;
        snprintf(env[r][k++], 64, "RANK=%d", r);
        snprintf(env[r][k++], 64, "WORLD_SIZE=%d", o->world_of[r] > 0 ? o->world_of[r] : o->world);
        if (o->local_vars) {
            snprintf(env[r][k++], 64, "LOCAL_RANK=%d", r);
            snprintf(env[r][k++], 64, "LOCAL_WORLD_SIZE=%d", o->world);
        }
        snprintf(env[r][k++], 64, "MASTER_ADDR=127.0.0.1");
        snprintf(env[r][k++], 64, "MASTER_PORT=%d", port);
        /* a TCP socket handed over: the store on TCP (Note [Store on one node]) */
        snprintf(env[r][k++], 64, "NABLA_STORE_TRANSPORT=tcp");
        bool pass = r == 0 && o->held_fd < 0;
        if (pass) snprintf(env[r][k++], 64, "NABLA_STORE_FD=%d", lfd);
        int e = 0;
        for (int i = 0; i < k; i++) ps[r].env[e++] = env[r][i];
        ps[r].env[e++] = "NABLA_PG_TIMEOUT=60";
        for (int i = 0; i < 4 && o->extra[i]; i++) ps[r].env[e++] = o->extra[i];
        if (o->rank_env[r]) ps[r].env[e++] = o->rank_env[r];
        if (o->rank_env2[r]) ps[r].env[e++] = o->rank_env2[r];
        ps[r].argv = argv;
        ps[r].pass_fd = pass ? lfd : -1;
        nbt_proc_start(&ps[r]);
    }
    if (o->held_fd < 0) close(lfd);
    nbt_proc_wait_all(ps, o->start, 90);
}

static void run_direct(nbt_proc ps[3], const char *name) {
    direct_opts o = {3, 3, true, -1, {NULL}, {0}, {NULL}, {NULL}};
    run_direct_opts(ps, name, &o);
}

/* run_direct_opts of "ok" in which every started rank must fail (exit
 * code 1), each within max_s seconds when max_s > 0. */
static void run_all_fail(nbt_proc *ps, const direct_opts *o, double max_s) {
    run_direct_opts(ps, "ok", o);
    for (int r = 0; r < o->start; r++) {
        ck_assert_msg(ps[r].code == 1, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        if (max_s > 0)
            ck_assert_msg(ps[r].seconds < max_s, "rank %d took %.1f s (limit %g s)", r, ps[r].seconds, max_s);
    }
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

/* Note [Liveness and progress]: a stopped rank is named at the liveness
 * limit (2 s here), long before the collective timeout (60 s). */
START_TEST(test_stopped_rank_named_at_liveness_limit) {
    nbt_proc p;
    const char *envs[] = {"NABLA_PG_TIMEOUT=60", "NABLA_LIVENESS_TIMEOUT=2", "NBRUN_GRACE=30", NULL};
    run_nbrun_env(&p, "stopped", envs);
    char host[256] = "", want[512];
    gethostname(host, sizeof host - 1);
    ck_assert_msg(p.code == 1, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    EXPECT_IN(p.err, "nb_pg_all_reduce: collective #2 all_reduce(sum, f32, count=8) on group 'world' (rank ");
    snprintf(want, sizeof want, "cannot complete: rank 1 (host %s, pid ", host);
    EXPECT_IN(p.err, want);
    EXPECT_IN(p.err, "(NABLA_LIVENESS_TIMEOUT=2 s): it is stopped (SIGSTOP, a debugger), frozen, or its host "
                     "is down; rank 1 did not arrive (its last collective on this group was #1 all_reduce(sum, "
                     "f32, count=8))");
    EXPECT_IN(p.err, "failed first: exited with code 1");
    EXPECT_IN(p.err, "nb_pg_free repeated the failure after ");
    EXPECT_IN(p.err, "nbrun: rank 1 (local rank 1, pid ");
    EXPECT_IN(p.err, ") was stopped by signal ");
    /* nbrun resumes a stopped rank after SIGTERM, so its grace (30 s) is not waited out */
    ck_assert_msg(p.seconds < 20, "took %.1f s (liveness 2 s, timeout 60 s)", p.seconds);
    nbt_proc_free(&p);
}
END_TEST

/* Rank 0 stopped: the store it serves stops answering, and the others
 * say so at the liveness limit, naming its host and pid. */
START_TEST(test_stopped_store_named_at_liveness_limit) {
    nbt_proc p;
    const char *envs[] = {"NABLA_PG_TIMEOUT=60", "NABLA_LIVENESS_TIMEOUT=2", "NBRUN_GRACE=30", NULL};
    run_nbrun_env(&p, "stopped0", envs);
    char host[256] = "", want[512];
    gethostname(host, sizeof host - 1);
    ck_assert_msg(p.code == 1, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    EXPECT_IN(p.err, "collective #2 all_reduce(sum, f32, count=8) on group 'world' (rank ");
    /* on one node the store is a Unix-domain socket (Note [Store on one node]) */
    EXPECT_IN(p.err, "could not complete: the store is unreachable (nb_store_mget: no reply from the store at "
                     "/tmp/nabla-");
    EXPECT_IN(p.err, ".sock within 2.0 s (NABLA_LIVENESS_TIMEOUT): rank 0, which serves it, is stopped (SIGSTOP, a "
                     "debugger) or frozen, or its host is unreachable)");
    snprintf(want, sizeof want, "rank 0 runs on host %s, pid ", host);
    EXPECT_IN(p.err, want);
    ck_assert_msg(p.seconds < 20, "took %.1f s (liveness 2 s, timeout 60 s)", p.seconds);
    nbt_proc_free(&p);
}
END_TEST

/* A rank busy for 5 s with a liveness limit of 3 s: its heartbeat thread
 * keeps it alive; the waiters warn once and then complete. */
START_TEST(test_slow_rank_is_not_killed) {
    nbt_proc p;
    const char *envs[] = {"NABLA_LIVENESS_TIMEOUT=3", "NABLA_STALL_WARNING=1", NULL};
    run_nbrun_env(&p, "slow", envs);
    ck_assert_msg(p.code == 0, "nbrun exited with %d; stderr:\n%s", p.code, p.err);
    for (int r = 0; r < 3; r++) {
        char want[64];
        snprintf(want, sizeof want, "rank %d: collective #2 completed", r);
        EXPECT_IN(p.out, want);
    }
    EXPECT_IN(p.err, "nabla: warning: nb_pg_all_reduce: collective #2 all_reduce(sum, f32, count=8) on "
                     "group 'world' (rank 0 of 3) has waited ");
    EXPECT_IN(p.err, "rank 1 did not arrive (its last collective on this group was #1 all_reduce(sum, f32, "
                     "count=8)); arrived: ranks 0, 2; every rank is alive (heartbeats flow)");
    nbt_proc_free(&p);
}
END_TEST

/* Note [Joining]: the wait is not silent; a line every third of the join
 * limit (every 20 s at the default 120 s) names the ranks still missing. */
START_TEST(test_rank_that_never_joined) {
    nbt_proc ps[1];
    direct_opts o = {2, 1, true, -1, {"NABLA_JOIN_TIMEOUT=1.5", NULL}, {0}, {NULL}, {NULL}};
    run_direct_opts(ps, "ok", &o);
    ck_assert_msg(ps[0].code == 1, "rank 0 exited with %d; stderr:\n%s", ps[0].code, ps[0].err);
    EXPECT_IN(ps[0].err, "nabla: rank 0: still waiting for rank 1 of 2 to join (");
    int lines = nbt_count(ps[0].err, " s of NABLA_JOIN_TIMEOUT=1.5 s; joined: rank 0); no process has connected "
                                     "to the store as rank 1: it is not started, or started with another "
                                     "MASTER_ADDR (127.0.0.1) or MASTER_PORT (");
    ck_assert_msg(lines >= 2 && lines <= 3, "expected 2 progress lines (at 0.5 and 1 s) in:\n%s", ps[0].err);
    EXPECT_IN(ps[0].err, "nb_pg_init: rank 1 of 2 never joined within 1.5 s (joined: rank 0); start every "
                         "rank with the same MASTER_ADDR (127.0.0.1), MASTER_PORT (");
    EXPECT_IN(ps[0].err, "WORLD_SIZE (2) and run id (default), each with its own RANK; NABLA_JOIN_TIMEOUT sets how "
                         "long to wait; no process has connected to the store as rank 1: it is not started");
    ck_assert_msg(ps[0].seconds < 20, "took %.1f s (join timeout 1 s)", ps[0].seconds);
    nbt_proc_free(&ps[0]);
}
END_TEST

/* Note [Joining]: ranks started with different WORLD_SIZE fail at the
 * join, each naming both values, long before the join limit (20 s) and
 * the collective timeout (60 s); no rank waits for one that will never
 * come or in Gloo's connection set-up. */
START_TEST(test_world_size_disagreement_2_ranks) {
    nbt_proc ps[2];
    direct_opts o = {2, 2, false, -1, {"NABLA_JOIN_TIMEOUT=20", NULL}, {0, 3}, {NULL}, {NULL}};
    run_all_fail(ps, &o, 10);
    char host[256] = "", want[512];
    gethostname(host, sizeof host - 1);
    snprintf(want, sizeof want, "nb_pg_init: ranks disagree on WORLD_SIZE: this process (rank 0) has WORLD_SIZE=2 "
             "but rank 1 (host %s, pid %d) has WORLD_SIZE=3; start every rank with the same WORLD_SIZE", host,
             (int)ps[1].pid);
    EXPECT_IN(ps[0].err, want);
    snprintf(want, sizeof want, "nb_pg_init: ranks disagree on WORLD_SIZE: this process (rank 1) has WORLD_SIZE=3 "
             "but rank 0 (host %s, pid %d) has WORLD_SIZE=2; start every rank with the same WORLD_SIZE", host,
             (int)ps[0].pid);
    EXPECT_IN(ps[1].err, want);
    for (int r = 0; r < 2; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* Three ranks, the middle one with a smaller WORLD_SIZE: every rank names it. */
START_TEST(test_world_size_disagreement_3_ranks) {
    nbt_proc ps[3];
    direct_opts o = {3, 3, false, -1, {"NABLA_JOIN_TIMEOUT=20", NULL}, {0, 2, 0}, {NULL}, {NULL}};
    run_all_fail(ps, &o, 10);
    char host[256] = "", want[512];
    gethostname(host, sizeof host - 1);
    for (int r = 0; r < 3; r += 2) {
        snprintf(want, sizeof want, "ranks disagree on WORLD_SIZE: this process (rank %d) has WORLD_SIZE=3 but rank 1 "
                 "(host %s, pid %d) has WORLD_SIZE=2;", r, host, (int)ps[1].pid);
        EXPECT_IN(ps[r].err, want);
    }
    snprintf(want, sizeof want, "ranks disagree on WORLD_SIZE: this process (rank 1) has WORLD_SIZE=2 but rank 0 "
             "(host %s, pid %d) has WORLD_SIZE=3;", host, (int)ps[0].pid);
    EXPECT_IN(ps[1].err, want);
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* Note [Joining]: rank 1 started with another run id is refused by the
 * store, which tells it its own id only; rank 0 reads the refusal from its
 * store and fails at once naming both ids, long before the join limit. */
START_TEST(test_run_id_disagreement_2_ranks) {
    nbt_proc ps[2];
    direct_opts o = {2, 2, false, -1, {"NABLA_JOIN_TIMEOUT=20", "NABLA_RUN_ID=runA", NULL}, {0}, {NULL,
                     "NABLA_RUN_ID=runB"}, {NULL}};
    run_all_fail(ps, &o, 10);
    EXPECT_IN(ps[0].err, "nb_pg_init: rank 1 tried to join with run id 'runB', this run's is 'runA' (from 127.0.0.1:");
    EXPECT_IN(ps[0].err, "; its store connection was refused); start every rank with the same run id (NABLA_RUN_ID)");
    EXPECT_IN(ps[1].err, "refused rank 1: the process is of run 'runB' but this store serves another run");
    ck_assert_msg(strstr(ps[1].err, "runA") == NULL, "rank 1 was told the store's run id:\n%s", ps[1].err);
    for (int r = 0; r < 2; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* Three ranks, the last with another run id: rank 0 reads the refusal and
 * fails naming both ids; rank 1, which waits for rank 2 like rank 0 but
 * has no store of its own to read refusals from, gets the same reason from
 * rank 0 through the store (Note [Joining]), not "the store went away";
 * rank 2 learns only that the store serves another run. All within the
 * join limit. */
START_TEST(test_run_id_disagreement_3_ranks) {
    nbt_proc ps[3];
    direct_opts o = {3, 3, false, -1, {"NABLA_JOIN_TIMEOUT=20", "NABLA_RUN_ID=runA", NULL}, {0}, {NULL, NULL,
                     "NABLA_RUN_ID=runB"}, {NULL}};
    run_all_fail(ps, &o, 10);
    EXPECT_IN(ps[0].err, "nb_pg_init: rank 2 tried to join with run id 'runB', this run's is 'runA' (from 127.0.0.1:");
    EXPECT_IN(ps[1].err, "nb_pg_init: rank 0 ended the join: rank 2 tried to join with run id 'runB', this run's is "
                         "'runA' (from 127.0.0.1:");
    EXPECT_IN(ps[1].err, "; its store connection was refused); start every rank with the same run id (NABLA_RUN_ID)");
    EXPECT_IN(ps[2].err, "refused rank 2: the process is of run 'runB' but this store serves another run");
    ck_assert_msg(strstr(ps[2].err, "runA") == NULL, "rank 2 was told the store's run id:\n%s", ps[2].err);
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* Three ranks, rank 0 with WORLD_SIZE=2: rank 1 reads rank 0's record and
 * rank 0 rank 1's; rank 2, beyond rank 0's world, is refused by its store,
 * and says both world sizes too. */
START_TEST(test_world_size_disagreement_rank_beyond_store_world) {
    nbt_proc ps[3];
    direct_opts o = {3, 3, false, -1, {"NABLA_JOIN_TIMEOUT=20", NULL}, {2, 0, 0}, {NULL}, {NULL}};
    run_all_fail(ps, &o, 10);
    EXPECT_IN(ps[0].err, "ranks disagree on WORLD_SIZE: this process (rank 0) has WORLD_SIZE=2 but rank 1 ");
    EXPECT_IN(ps[1].err, "ranks disagree on WORLD_SIZE: this process (rank 1) has WORLD_SIZE=3 but rank 0 ");
    EXPECT_IN(ps[2].err, "rank 2 is not a rank of this run, whose ranks are 0 to 1 (WORLD_SIZE=2); this process has "
                         "WORLD_SIZE=3");
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* With a secret, three ranks: rank 0 says the unproven claim and does not
 * end the join before its limit; rank 1's message names the refused
 * process as rank 0's does (published in the store), and is the timeout's,
 * not that the store went away with rank 0. */
START_TEST(test_run_id_claim_untrusted_with_secret_3_ranks) {
    nbt_proc ps[3];
    direct_opts o = {3, 3, false, -1, {"NABLA_JOIN_TIMEOUT=3", "NABLA_RUN_ID=runA",
                     "NABLA_STORE_SECRET=0123456789abcdef0123456789abcdef"}, {0}, {NULL, NULL, "NABLA_RUN_ID=runB"},
                     {NULL}};
    run_all_fail(ps, &o, 0);
    for (int r = 0; r < 2; r++) {
        EXPECT_IN(ps[r].err, "rank 2 of 3 never joined within 3.0 s");
        EXPECT_IN(ps[r].err, "tried to join as rank 2 with run id 'runB', this run's is 'runA' (refused)");
        ck_assert_msg(!strstr(ps[r].err, "nb_pg_init: rank 2 tried") && !strstr(ps[r].err, "ended the join: rank 2 tried"),
                      "an unproven claim ended the join:\n%s", ps[r].err);
    }
    ck_assert_msg(strstr(ps[2].err, "runA") == NULL, "rank 2 was told the store's run id:\n%s", ps[2].err);
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* With a secret, the refused process proved nothing: its claim to be the
 * missing rank 1 is said, not trusted, and the join waits for its limit
 * (so a peer that can reach the port cannot end it). */
START_TEST(test_run_id_claim_untrusted_with_secret) {
    nbt_proc ps[2];
    direct_opts o = {2, 2, false, -1, {"NABLA_JOIN_TIMEOUT=3", "NABLA_RUN_ID=runA",
                     "NABLA_STORE_SECRET=0123456789abcdef0123456789abcdef"}, {0}, {NULL, "NABLA_RUN_ID=runB"}, {NULL}};
    run_all_fail(ps, &o, 0);
    EXPECT_IN(ps[0].err, "nabla: rank 0: rank 1 tried to join with run id 'runB', this run's is 'runA'");
    EXPECT_IN(ps[0].err, "did not prove it, so its claim to be that rank is not trusted");
    EXPECT_IN(ps[0].err, "nb_pg_init: rank 1 of 2 never joined within 3.0 s");
    ck_assert_msg(strstr(ps[0].err, "nb_pg_init: rank 1 tried") == NULL, "an unproven claim ended the join:\n%s",
                  ps[0].err);
    ck_assert_msg(strstr(ps[1].err, "runA") == NULL, "rank 1 was told the store's run id:\n%s", ps[1].err);
    for (int r = 0; r < 2; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* A process of another run claiming a rank outside the world (5 of 2) is
 * said on rank 0, its id cut and made printable, but does not end the
 * join: rank 0 still waits for rank 1 until the join limit (3 s), and that
 * message names the stray too. */
START_TEST(test_stray_run_id_does_not_end_the_join) {
    nbt_proc ps[2];
    direct_opts o = {2, 2, false, -1, {"NABLA_JOIN_TIMEOUT=3", "NABLA_RUN_ID=runA", NULL}, {0, 8},
                     {NULL, "NABLA_RUN_ID=runB\t012345678901234567890123456789012345678901234567890123456789"}, {NULL, "RANK=5"}};
    run_all_fail(ps, &o, 0);
    const char *cut = "runB?012345678901234567890123456789012345678901'";
    char want[512];
    snprintf(want, sizeof want, "nabla: rank 0: rank 5 tried to join with run id '%s, this run's is 'runA' (from "
             "127.0.0.1:", cut);
    EXPECT_IN(ps[0].err, want);
    EXPECT_IN(ps[0].err, "); refused, and ignored: not a rank of this run\n");
    EXPECT_IN(ps[0].err, "nb_pg_init: rank 1 of 2 never joined within 3.0 s (joined: rank 0);");
    snprintf(want, sizeof want, "; a process at 127.0.0.1:");
    EXPECT_IN(ps[0].err, want);
    snprintf(want, sizeof want, "tried to join as rank 5 with run id '%s, this run's is 'runA' (refused)", cut);
    EXPECT_IN(ps[0].err, want);
    ck_assert_msg(strstr(ps[0].err, "nb_pg_init: rank 5 tried") == NULL, "the stray ended the join:\n%s", ps[0].err);
    ck_assert_msg(strstr(ps[1].err, "runA") == NULL, "the stray was told the store's run id:\n%s", ps[1].err);
    for (int r = 0; r < 2; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* Gloo's connection set-up is bounded by NABLA_JOIN_TIMEOUT (2 s here),
 * not NABLA_PG_TIMEOUT (60 s): rank 1 cannot open its Gloo device (no such
 * interface), so it never publishes an address; rank 0 gives up on it
 * within the join limit, saying which limit it was. */
START_TEST(test_gloo_connect_bounded_by_join_timeout) {
    nbt_proc ps[2];
    direct_opts o = {2, 2, true, -1, {"NABLA_JOIN_TIMEOUT=2", NULL}, {0}, {NULL, "NABLA_SOCKET_IFNAME=nbnosuch0"}, {NULL}};
    run_all_fail(ps, &o, 0);
    EXPECT_IN(ps[1].err, "nb_pg_init: cannot open a Gloo TCP device on nbnosuch0: ");
    EXPECT_IN(ps[0].err, "nb_pg_init: Gloo could not connect rank 0 of 2: ");
    EXPECT_IN(ps[0].err, "(within 2 s, NABLA_JOIN_TIMEOUT;");
    ck_assert_msg(ps[0].seconds < 15, "rank 0 took %.1f s (join limit 2 s, collective timeout 60 s)", ps[0].seconds);
    for (int r = 0; r < 2; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* MASTER_PORT held by a program that is not ours: every rank says so,
 * within the liveness limit. */
START_TEST(test_held_port_reported_on_every_rank) {
    int port;
    int held = listen_free(&port);
    nbt_proc ps[2];
    direct_opts o = {2, 2, true, held, {"NABLA_LIVENESS_TIMEOUT=1", "NABLA_JOIN_TIMEOUT=20", NULL}, {0}, {NULL}, {NULL}};
    run_all_fail(ps, &o, 10);
    close(held);
    EXPECT_IN(ps[0].err, "another program holds the port (MASTER_PORT)");
    EXPECT_IN(ps[1].err, "accepted the connection but did not answer its greeting within 1.0 s "
                         "(NABLA_LIVENESS_TIMEOUT): rank 0, which serves it, is stopped or overloaded");
    EXPECT_IN(ps[1].err, "or another program holds MASTER_PORT");
    for (int r = 0; r < 2; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* PyTorch's env:// variables only: no LOCAL_RANK, no LOCAL_WORLD_SIZE. */
START_TEST(test_env_launch_without_local_variables) {
    nbt_proc ps[2];
    direct_opts o = {2, 2, false, -1, {NULL}, {0}, {NULL}, {NULL}};
    run_direct_opts(ps, "ok", &o);
    for (int r = 0; r < 2; r++) {
        ck_assert_msg(ps[r].code == 0, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        nbt_proc_free(&ps[r]);
    }
}
END_TEST

/* A peer dies while the others are in nb_ddp_forward's buffer broadcast:
 * a status naming it, not an abort. */
START_TEST(test_ddp_peer_failure_is_a_status) {
    nbt_proc ps[3];
    run_direct(ps, "ddp");
    ck_assert_msg(ps[1].code == 137, "rank 1 exited with %d", ps[1].code);
    for (int r = 0; r < 3; r += 2) {
        ck_assert_msg(ps[r].code == 1, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        EXPECT_IN(ps[r].err, "nb_ddp_forward: broadcasting the buffers failed: nb_pg_broadcast: collective");
        if (r == 0 || !strstr(ps[r].err, "the store is unreachable too"))
            EXPECT_IN(ps[r].err, "rank 1 disconnected from the store without saying goodbye");
    }
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* A peer dies while the others are in a SyncBatchNorm's all-reduce inside
 * nb_ddp_forward (Note [Failures inside a forward]): a status naming it,
 * not an abort; the group keeps the failure (nb_pg_status) and a
 * SyncBatchNorm on it gives NaN and leaves the running statistics. */
START_TEST(test_sync_batch_norm_peer_failure_in_forward) {
    nbt_proc ps[3];
    run_direct(ps, "sbnfwd");
    ck_assert_msg(ps[1].code == 137, "rank 1 exited with %d", ps[1].code);
    for (int r = 0; r < 3; r += 2) {
        ck_assert_msg(ps[r].code == 1, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        EXPECT_IN(ps[r].err, "nb_ddp_forward: the model's forward failed: nb_sync_batch_norm: all-reduce of the "
                             "batch statistics failed: nb_pg_all_reduce: collective #");
        if (r == 0 || !strstr(ps[r].err, "the store is unreachable too"))
            EXPECT_IN(ps[r].err, "rank 1 disconnected from the store without saying goodbye");
        EXPECT_IN(ps[r].err, "nb_ddp_forward's output is NULL");
        EXPECT_IN(ps[r].err, "nb_pg_status gives the same status: nb_pg_all_reduce: collective #");
        EXPECT_IN(ps[r].err, "a SyncBatchNorm on the broken group gives 6 NaN of 6, running statistics kept: "
                             "nb_sync_batch_norm: all-reduce of the batch statistics failed: ");
        ck_assert_msg(ps[r].seconds < 30, "rank %d took %.1f s to fail (timeout 60 s)", r, ps[r].seconds);
    }
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

/* The same when the peer dies between forward and backward: the
 * SyncBatchNorm's backward all-reduce fails inside nb_ddp_backward. */
START_TEST(test_sync_batch_norm_peer_failure_in_backward) {
    nbt_proc ps[3];
    run_direct(ps, "sbnbwd");
    ck_assert_msg(ps[1].code == 137, "rank 1 exited with %d", ps[1].code);
    for (int r = 0; r < 3; r += 2) {
        ck_assert_msg(ps[r].code == 1, "rank %d exited with %d; stderr:\n%s", r, ps[r].code, ps[r].err);
        EXPECT_IN(ps[r].out, "forward completed");
        EXPECT_IN(ps[r].err, "nb_ddp_backward: the backward failed: nb_sync_batch_norm: all-reduce of the "
                             "gradient sums failed: nb_pg_all_reduce: collective #");
        EXPECT_IN(ps[r].err, "nb_pg_status gives the same status: nb_pg_all_reduce: collective #");
        if (r == 0 || !strstr(ps[r].err, "the store is unreachable too"))
            EXPECT_IN(ps[r].err, "rank 1 disconnected from the store without saying goodbye");
        EXPECT_IN(ps[r].err, "a SyncBatchNorm on the broken group gives 6 NaN of 6, running statistics kept");
        ck_assert_msg(ps[r].seconds < 30, "rank %d took %.1f s to fail (timeout 60 s)", r, ps[r].seconds);
    }
    for (int r = 0; r < 3; r++) nbt_proc_free(&ps[r]);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_absent_rank_times_out, test_desync_names_both_fingerprints,
                             test_exit_code_and_stderr_of_failing_rank, test_killed_rank_under_nbrun,
                             test_first_failure_named_when_reaped_together,
                             test_killed_rank_makes_others_fail_fast, test_store_host_dies,
                             test_stopped_rank_named_at_liveness_limit,
                             test_stopped_store_named_at_liveness_limit, test_slow_rank_is_not_killed,
                             test_rank_that_never_joined, test_world_size_disagreement_2_ranks,
                             test_world_size_disagreement_3_ranks, test_run_id_disagreement_2_ranks,
                             test_run_id_disagreement_3_ranks,
                             test_world_size_disagreement_rank_beyond_store_world,
                             test_run_id_claim_untrusted_with_secret_3_ranks,
                             test_stray_run_id_does_not_end_the_join, test_run_id_claim_untrusted_with_secret,
                             test_gloo_connect_bounded_by_join_timeout, test_held_port_reported_on_every_rank,
                             test_env_launch_without_local_variables, test_ddp_peer_failure_is_a_status,
                             test_sync_batch_norm_peer_failure_in_forward,
                             test_sync_batch_norm_peer_failure_in_backward, NULL};
    return nbt_suite("dist_failures", "failures", 120, tests);
}

int main(void) {
    paths();
    if (!NABLA_HAVE_GLOO) {
        fprintf(stderr, "skipped: this build has no Gloo\n");
        return 77;
    }
    return nbt_run(suite());
}
