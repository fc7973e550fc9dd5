/* The launcher: flags and usage errors, the environment each rank gets,
 * rank-prefixed lines that never mix, failure propagation (first failing
 * rank's exit code, its stderr printed last, TERM then KILL), Ctrl-C, and
 * children dying with nbrun, restarts (--max-restarts). The ranks are small
 * sh scripts. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dist/proc.h"
#include "distributed/internal.h"
#include "testutil.h"

static char nbrun_path[4096], scenario_path[4096];

#define EXPECT_IN(text, needle) \
    ck_assert_msg(strstr((text), (needle)) != NULL, "expected \"%s\" in:\n%s", (needle), (text))

/* nbrun with up to 8 arguments, then `sh -c script`. */
static void run(nbt_proc *p, const char *env0, const char *const *args, const char *script) {
    static char *argv[16];
    int n = 0;
    argv[n++] = nbrun_path;
    for (int i = 0; args && args[i]; i++) argv[n++] = (char *)args[i];
    if (script) {
        argv[n++] = "sh";
        argv[n++] = "-c";
        argv[n++] = (char *)script;
    }
    argv[n] = NULL;
    memset(p, 0, sizeof *p);
    p->argv = argv;
    p->env[0] = env0;
    p->pass_fd = -1;
    nbt_proc_start(p);
}

START_TEST(test_help) {
    nbt_proc p;
    const char *a[] = {"--help", NULL};
    run(&p, NULL, a, NULL);
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_int_eq(p.code, 0);
    const char *words[] = {"--nproc-per-node N|gpu", "--nnodes K", "--node-rank i", "--master-addr A",
                           "--master-port P", "[rank R] ", "SIGTERM", "SIGKILL", "NBRUN_GRACE",
                           "PR_SET_PDEATHSIG", "Ctrl-C", "exit status", "LOCAL_WORLD_SIZE", "NABLA_RUN_ID",
                           "--max-restarts N", "NABLA_RESTART_COUNT", "--resume auto", "--nnodes MIN:MAX",
                           "--rdzv-timeout S", "--cpu-bind none|cores|auto", "NABLA_CPU_BIND"};
    for (unsigned i = 0; i < sizeof words / sizeof words[0]; i++) EXPECT_IN(p.out, words[i]);
    nbt_proc_free(&p);
}
END_TEST

static void usage_error(const char *env0, const char *const *args, const char *script, const char *msg) {
    nbt_proc p;
    run(&p, env0, args, script);
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_msg(p.code == 2, "exit %d for %s", p.code, msg);
    EXPECT_IN(p.err, msg);
    nbt_proc_free(&p);
}

START_TEST(test_usage_errors) {
    usage_error(NULL, NULL, NULL, "nbrun: no program to run");
    const char *a1[] = {"--nproc-per-node", "0", NULL};
    usage_error(NULL, a1, "true", "--nproc-per-node expects an integer in [1, 4096], got '0'");
    const char *a2[] = {"--bogus", NULL};
    usage_error(NULL, a2, "true", "unknown option '--bogus'");
    const char *a3[] = {"--nnodes", "2", NULL};
    usage_error(NULL, a3, "true", "--master-addr is required with --nnodes 2");
    const char *a4[] = {"--nnodes=2", "--master-addr=10.0.0.1", "--master-port=0", NULL};
    usage_error(NULL, a4, "true", "--master-port must be a fixed port with --nnodes 2");
    const char *a5[] = {"--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1", NULL};
    usage_error(NULL, a5, "true", "--node-rank 2 must be below --nnodes 2");
    const char *a6[] = {"--nproc-per-node", "gpu", NULL};
    usage_error("CUDA_VISIBLE_DEVICES=", a6, "true", "--nproc-per-node gpu: no GPU found");
    const char *a7[] = {"--max-restarts", "-1", NULL};
    usage_error(NULL, a7, "true", "--max-restarts expects an integer in [0, 1048576], got '-1'");
    const char *a8[] = {"--nnodes", "2", "--master-addr", "h", "--master-port", "1", "--max-restarts", "1", NULL};
    usage_error(NULL, a8, "true", "--max-restarts with several nodes needs --nnodes MIN:MAX");
    const char *a9[] = {"--nnodes", "3:2", "--master-addr", "h", "--master-port", "1", NULL};
    usage_error(NULL, a9, "true", "--nnodes 3:2: MIN is above MAX");
    const char *a10[] = {"--nnodes", "1:2", "--master-addr", "h", "--master-port", "1", "--rdzv-timeout", "0", NULL};
    usage_error(NULL, a10, "true", "--rdzv-timeout expects a number of seconds > 0, got '0'");
    const char *a11[] = {"--cpu-bind", "sockets", NULL};
    usage_error(NULL, a11, "true", "--cpu-bind expects none, cores or auto, got 'sockets'");
    usage_error("NABLA_CPU_BIND=numa", NULL, "true", "NABLA_CPU_BIND expects none, cores or auto, got 'numa'");
}
END_TEST

START_TEST(test_environment_and_prefixes) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "3", NULL};
    run(&p, NULL, a,
        "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR "
        "${NABLA_STORE_FD:-nofd} $NABLA_RUN_ID $MASTER_PORT\"; echo \"to stderr $RANK\" >&2; printf \"no newline $RANK\"");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_int_eq(p.code, 0);
    char want[128], run_id[128] = "", port[16] = "";
    for (int r = 0; r < 3; r++) {
        snprintf(want, sizeof want, "[rank %d] env %d 3 %d 3 0 127.0.0.1 ", r, r, r);
        const char *line = strstr(p.out, want);
        ck_assert_msg(line != NULL, "no \"%s\" in:\n%s", want, p.out);
        char fd[16], id[128], pt[16];
        ck_assert_int_eq(sscanf(line + strlen(want), "%15s %127s %15s", fd, id, pt), 3);
        /* only rank 0 gets the store's socket */
        ck_assert_msg(r == 0 ? strcmp(fd, "nofd") != 0 : strcmp(fd, "nofd") == 0, "rank %d: fd %s", r, fd);
        ck_assert_msg(strncmp(id, "nbrun-", 6) == 0, "run id %s", id);
        if (r == 0) {
            snprintf(run_id, sizeof run_id, "%s", id);
            snprintf(port, sizeof port, "%s", pt);
        }
        ck_assert_str_eq(id, run_id); /* the same for every rank */
        ck_assert_str_eq(pt, port);
        ck_assert_int_gt(atoi(pt), 0); /* --master-port 0 became a real port */
        snprintf(want, sizeof want, "[rank %d] to stderr %d\n", r, r);
        EXPECT_IN(p.err, want);
        snprintf(want, sizeof want, "[rank %d] no newline %d\n", r, r);
        EXPECT_IN(p.out, want);
    }
    ck_assert(strstr(p.out, "to stderr") == NULL);
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_multinode_environment) {
    nbt_proc p;
    const char *a[] = {"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                       "--master-addr", "127.0.0.1", "--master-port", "29999", NULL};
    setenv("NABLA_STORE_SECRET", "a secret of the run, 32 bytes..", 1); /* several nodes need one */
    run(&p, "NABLA_RUN_ID=my-run", a, "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $NABLA_RUN_ID $MASTER_PORT\"");
    unsetenv("NABLA_STORE_SECRET");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_msg(p.code == 0, "exit %d: %s", p.code, p.err);
    EXPECT_IN(p.out, "[rank 2] 2 4 0 1 my-run 29999\n");
    EXPECT_IN(p.out, "[rank 3] 3 4 1 1 my-run 29999\n");
    nbt_proc_free(&p);
}
END_TEST

/* Lines of concurrent ranks stay whole; a very long line is cut into
 * prefixed pieces. */
/* The run's secret reaches every rank as an inherited descriptor of a
 * mode-0600 memory file: the same for the ranks of a run, new for each run,
 * never in a command line or an environment value (/proc/PID/cmdline and
 * environ of the rank and of nbrun). */
static void secrets_of_a_run(char secret[2][80]) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "2", NULL};
    run(&p, NULL, a,
        "f=$NABLA_STORE_SECRET_FD; s=$(cat /proc/self/fd/$f); "
        "echo \"secret $s mode $(stat -L -c %a /proc/self/fd/$f)\"; "
        "for w in /proc/$$/cmdline /proc/$$/environ /proc/$PPID/cmdline /proc/$PPID/environ; do "
        "if grep -qaF -- \"$s\" $w; then echo \"LEAK in $w\"; fi; done");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_msg(p.code == 0, "exit %d: %s", p.code, p.err);
    ck_assert_msg(strstr(p.out, "LEAK") == NULL, "%s", p.out);
    for (int r = 0; r < 2; r++) {
        char want[32];
        snprintf(want, sizeof want, "[rank %d] secret ", r);
        const char *line = strstr(p.out, want);
        ck_assert_msg(line != NULL, "no \"%s\" in:\n%s", want, p.out);
        char mode[16];
        ck_assert_int_eq(sscanf(line + strlen(want), "%79s mode %15s", secret[r], mode), 2);
        ck_assert_uint_eq(strlen(secret[r]), 64);
        ck_assert_uint_eq(strspn(secret[r], "0123456789abcdef"), 64);
        ck_assert_str_eq(mode, "600");
    }
    ck_assert_str_eq(secret[0], secret[1]);
    nbt_proc_free(&p);
}

START_TEST(test_secret_by_descriptor) {
    char one[2][80], two[2][80];
    secrets_of_a_run(one);
    secrets_of_a_run(two);
    ck_assert_str_ne(one[0], two[0]);
}
END_TEST

/* Several nodes take the user's secret, checked before anything starts. */
START_TEST(test_several_nodes_need_a_secret) {
    const char *a[] = {"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                       "--master-port", "29998", NULL};
    usage_error(NULL, a, "true", "nbrun: --nnodes 2 needs the run's secret, the same on every node");
    char path[] = "/tmp/nbrun-secret-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "0123456789abcdef0123", 20), 20);
    close(fd);
    chmod(path, 0640);
    char env[128];
    snprintf(env, sizeof env, "NABLA_STORE_SECRET_FILE=%s", path);
    nbt_proc p;
    run(&p, env, a, "true");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_int_eq(p.code, 2);
    EXPECT_IN(p.err, "may be read by other users (mode 0640)");
    nbt_proc_free(&p);
    chmod(path, 0600);
    run(&p, env, a, "echo \"fd ${NABLA_STORE_SECRET_FD:-none} file $NABLA_STORE_SECRET_FILE\"");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_msg(p.code == 0, "exit %d: %s", p.code, p.err);
    char want[160];
    snprintf(want, sizeof want, "[rank 1] fd none file %s\n", path);
    EXPECT_IN(p.out, want);
    nbt_proc_free(&p);
    unlink(path);
    run(&p, "NABLA_STORE_TRUSTED_NETWORK=1", a, "true");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_msg(p.code == 0, "exit %d: %s", p.code, p.err);
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_lines_never_mix) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "2", NULL};
    run(&p, NULL, a,
        "i=0; while [ $i -lt 2000 ]; do echo \"line $i of rank $RANK with some padding text\"; i=$((i+1)); done");
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_int_eq(p.code, 0);
    int lines = 0;
    for (char *s = p.out, *nl; (nl = strchr(s, '\n')) != NULL; s = nl + 1) {
        *nl = 0;
        int r1, i, r2;
        ck_assert_msg(sscanf(s, "[rank %d] line %d of rank %d with some padding text", &r1, &i, &r2) == 3 && r1 == r2,
                      "mangled line: %s", s);
        lines++;
    }
    ck_assert_int_eq(lines, 4000);
    nbt_proc_free(&p);

    run(&p, NULL, NULL, "head -c 100000 /dev/zero | tr '\\0' a; echo");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_int_eq(p.code, 0);
    ck_assert_int_eq(nbt_count(p.out, "[rank 0] "), 2);
    ck_assert_int_eq(p.out_len, 100000 + 2 * strlen("[rank 0] ") + 2);
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_first_failure_decides) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "3", NULL};
    run(&p, NULL, a,
        "if [ $RANK = 1 ]; then i=1; while [ $i -le 25 ]; do echo \"problem $i\" >&2; i=$((i+1)); done; exit 3; fi; "
        "echo waiting; exec sleep 60");
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_msg(p.code == 3, "exit %d\n%s", p.code, p.err);
    ck_assert_msg(p.seconds < 30, "took %.1f s: the sleeping ranks were not stopped", p.seconds);
    EXPECT_IN(p.err, "nbrun: rank 1 (local rank 1, pid ");
    EXPECT_IN(p.err, "failed first: exited with code 3; the other ranks were stopped\n"
                     "nbrun: last 20 lines of rank 1's stderr:\n  [rank 1] problem 6\n");
    char last[128];
    ck_assert_str_eq(nbt_last_line(p.err, last, sizeof last), "  [rank 1] problem 25");
    nbt_proc_free(&p);

    /* killed by a signal: 128 + 9 */
    run(&p, NULL, a, "if [ $RANK = 2 ]; then kill -9 $$; fi; exec sleep 60");
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_int_eq(p.code, 137);
    EXPECT_IN(p.err, "nbrun: rank 2 (local rank 2, pid ");
    EXPECT_IN(p.err, "failed first: was killed by signal 9");
    EXPECT_IN(p.err, "nbrun: rank 2 wrote nothing to stderr");
    nbt_proc_free(&p);

    /* cannot start the program */
    const char *b[] = {"/nonexistent/program", NULL};
    run(&p, NULL, b, NULL);
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_int_eq(p.code, 127);
    EXPECT_IN(p.err, "cannot run '/nonexistent/program'");
    nbt_proc_free(&p);
}
END_TEST

/* A rank that ignores SIGTERM gets SIGKILL after the grace period. */
START_TEST(test_term_then_kill) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "2", NULL};
    run(&p, "NBRUN_GRACE=0.5", a, "if [ $RANK = 1 ]; then sleep 0.2; exit 1; fi; trap '' TERM; exec sleep 60");
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_int_eq(p.code, 1);
    ck_assert_msg(p.seconds < 30, "took %.1f s: SIGKILL did not follow", p.seconds);
    nbt_proc_free(&p);
}
END_TEST

START_TEST(test_interrupt_stops_all) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "2", NULL};
    run(&p, NULL, a, "echo ready; exec sleep 60");
    p.trigger = "ready";
    p.trigger_count = 2;
    p.trigger_signal = SIGINT;
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_msg(p.code == 130, "exit %d\n%s", p.code, p.err);
    ck_assert_msg(p.seconds < 30, "took %.1f s to stop", p.seconds);
    EXPECT_IN(p.err, "nbrun: stopped by signal 2 (Interrupt); all ranks were stopped");
    nbt_proc_free(&p);
}
END_TEST

/* Every generation starts every rank with NABLA_RESTART_COUNT, a new run
 * id and a new store port; each restart names its cause and count; when
 * none is left, the last failure's code. */
START_TEST(test_max_restarts) {
    nbt_proc p;
    /* rank 1 fails in generations 0 and 1, once rank 0 has written its line */
    char dir[] = "/tmp/nb_test_nbrun_XXXXXX", script[1024];
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(script, sizeof script,
             "echo \"gen $NABLA_RESTART_COUNT $NABLA_RUN_ID $MASTER_PORT\"; touch %s/$RANK.$NABLA_RESTART_COUNT; "
             "if [ $RANK = 1 ] && [ $NABLA_RESTART_COUNT -lt 2 ]; then "
             "while [ ! -e %s/0.$NABLA_RESTART_COUNT ]; do sleep 0.02; done; "
             "echo \"lost $NABLA_RESTART_COUNT\" >&2; exit 3; fi; exec sleep 0.3", dir, dir);
    const char *a[] = {"--nproc-per-node", "2", "--max-restarts", "2", NULL};
    run(&p, NULL, a, script);
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_msg(p.code == 0, "exit %d\n%s", p.code, p.err);
    char ids[3][128], ports[3][16], want[160];
    for (int g = 0; g < 3; g++) {
        for (int r = 0; r < 2; r++) {
            snprintf(want, sizeof want, "[rank %d] gen %d ", r, g);
            const char *line = strstr(p.out, want);
            ck_assert_msg(line != NULL, "no \"%s\" in:\n%s", want, p.out);
            char id[128], port[16];
            ck_assert_int_eq(sscanf(line + strlen(want), "%127s %15s", id, port), 2);
            if (r == 0) snprintf(ids[g], sizeof ids[g], "%s", id), snprintf(ports[g], sizeof ports[g], "%s", port);
            ck_assert_str_eq(id, ids[g]);
            ck_assert_str_eq(port, ports[g]);
        }
        if (g > 0) {
            snprintf(want, sizeof want, "%s-r%d", ids[0], g);
            ck_assert_str_eq(ids[g], want); /* a new run id per generation */
            ck_assert_str_ne(ports[g], ports[g - 1]); /* and a new store */
            snprintf(want, sizeof want, "nbrun: restart %d of 2 after: rank 1 (local rank 1, pid ", g);
            EXPECT_IN(p.err, want);
            snprintf(want, sizeof want, ") exited with code 3 (\"lost %d\")\n", g - 1);
            EXPECT_IN(p.err, want);
        }
    }
    ck_assert(strstr(p.out, "gen 3") == NULL);
    nbt_proc_free(&p);

    const char *b[] = {"--nproc-per-node", "2", "--max-restarts", "1", NULL};
    run(&p, NULL, b, script);
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_msg(p.code == 3, "exit %d\n%s", p.code, p.err);
    EXPECT_IN(p.err, "nbrun: restart 1 of 1 after: rank 1 ");
    EXPECT_IN(p.err, "nbrun: no restart left (--max-restarts 1): the run fails\nnbrun: rank 1 (local rank 1, pid ");
    char last[128];
    ck_assert_str_eq(nbt_last_line(p.err, last, sizeof last), "  [rank 1] lost 1");
    nbt_proc_free(&p);
    char rm[128];
    snprintf(rm, sizeof rm, "rm -rf %s", dir);
    ck_assert_int_eq(system(rm), 0);
}
END_TEST

/* Note [Store on one node]: on one node rank 0's store is the Unix-domain
 * socket NABLA_STORE_DIR/store-<port>.sock, mode 0600; a restart on the same
 * --master-port binds it again and joins; nothing is left when nbrun ends. */
START_TEST(test_store_socket_on_one_node) {
    nbt_proc p;
    char dir[] = "/tmp/nb_test_sock_XXXXXX", env[64], script[9000], sock[128];
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(env, sizeof env, "NABLA_STORE_DIR=%s", dir);
    char port[16];
    snprintf(port, sizeof port, "%d", nbt_free_port());
    snprintf(sock, sizeof sock, "%s/store-%s.sock", dir, port);
    snprintf(script, sizeof script,
             "echo \"sock $(stat -c %%a:%%F %s)\"; if [ \"$NABLA_RESTART_COUNT\" = 0 ]; then exec %s killed; "
             "else exec %s ok; fi", sock, scenario_path, scenario_path);
    const char *args[] = {"--nproc-per-node", "2", "--master-port", port, "--max-restarts", "1", NULL};
    run(&p, env, args, script);
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_msg(p.code == 0, "exit %d\n%s", p.code, p.err);
    EXPECT_IN(p.err, "nbrun: restart 1 of 1 after: rank 1 ");
    EXPECT_IN(p.out, "[rank 0] sock 600:socket\n");
    struct stat sb;
    ck_assert_msg(stat(sock, &sb) != 0, "%s is left behind", sock);
    ck_assert_int_eq(rmdir(dir), 0);
    nbt_proc_free(&p);
}
END_TEST

static bool alive(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool zombie = fgets(buf, sizeof buf, f) && strstr(buf, ") Z ") != NULL;
    fclose(f);
    return !zombie;
}

START_TEST(test_children_die_with_nbrun) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "2", NULL};
    run(&p, NULL, a, "echo \"pid $$\"; exec sleep 60");
    p.trigger = "pid ";
    p.trigger_count = 2;
    p.trigger_signal = SIGKILL;
    nbt_proc_wait_all(&p, 1, 60);
    ck_assert_int_eq(p.code, 137);
    int pids[2], n = 0;
    for (const char *s = p.out; (s = strstr(s, "pid ")) != NULL && n < 2; s += 4) pids[n++] = atoi(s + 4);
    ck_assert_int_eq(n, 2);
    double t0 = nbt_now();
    while ((alive(pids[0]) || alive(pids[1])) && nbt_now() - t0 < 20) poll(NULL, 0, 20);
    ck_assert_msg(!alive(pids[0]) && !alive(pids[1]), "ranks %d and %d outlived nbrun", pids[0], pids[1]);
    nbt_proc_free(&p);
}
END_TEST

/* Note [Launcher lifeline]: ranks that are grandchildren of nbrun (a
 * wrapper that does not exec, a double fork) die within 3 s of kill -9 of
 * nbrun; PR_SET_PDEATHSIG reaches only the wrapper. */
static void lifeline_case(const char *script) {
    nbt_proc p;
    const char *a[] = {"--nproc-per-node", "2", NULL};
    run(&p, NULL, a, script);
    p.trigger = "pid ";
    p.trigger_count = 2;
    p.trigger_signal = SIGKILL;
    nbt_proc_wait_all(&p, 1, 60);
    double t0 = nbt_now();
    ck_assert_int_eq(p.code, 137);
    int pids[2], n = 0;
    for (const char *s = p.out; (s = strstr(s, "pid ")) != NULL && n < 2; s += 4) pids[n++] = atoi(s + 4);
    ck_assert_msg(n == 2, "expected two pids in:\n%s\n%s", p.out, p.err);
    while ((alive(pids[0]) || alive(pids[1])) && nbt_now() - t0 < 3) poll(NULL, 0, 20);
    ck_assert_msg(!alive(pids[0]) && !alive(pids[1]), "ranks %d and %d outlived nbrun by 3 s (%s)", pids[0],
                  pids[1], script);
    nbt_proc_free(&p);
}

START_TEST(test_wrapped_ranks_die_with_nbrun) {
    char script[4400];
    /* sh runs the program as its child and waits: the rank is nbrun's grandchild */
    snprintf(script, sizeof script, "%s orphan; echo done", scenario_path);
    lifeline_case(script);
    /* the rank's parent exits at once: it is reparented to init */
    snprintf(script, sizeof script, "(%s orphan &); exec sleep 60", scenario_path);
    lifeline_case(script);
}
END_TEST

/* ---- Note [CPU binding] ---- */

/* "0-2,5" into a set; false when it is not such a list. */
static bool parse_cpu_list(const char *s, cpu_set_t *set) {
    CPU_ZERO(set);
    while (*s && *s != '\n') {
        char *end;
        long lo = strtol(s, &end, 10), hi = lo;
        if (end == s || lo < 0 || lo >= CPU_SETSIZE) return false;
        s = end;
        if (*s == '-') {
            hi = strtol(s + 1, &end, 10);
            if (end == s + 1 || hi < lo || hi >= CPU_SETSIZE) return false;
            s = end;
        }
        for (long c = lo; c <= hi; c++) CPU_SET((int)c, set);
        if (*s == ',') s++;
    }
    return true;
}

static void set_of(const int *cpus, int n, cpu_set_t *set) {
    CPU_ZERO(set);
    for (int i = 0; i < n; i++) CPU_SET(cpus[i], set);
}

START_TEST(test_cpu_share_table) {
    /* {cpu, package, core}; the hardware threads of a core share its id */
    const nb__cpu_slot two[] = {{0, 0, 0}, {1, 0, 1}};
    const nb__cpu_slot smt[] = {{0, 0, 0}, {1, 0, 1}, {2, 0, 2}, {3, 0, 3},
                                {4, 0, 0}, {5, 0, 1}, {6, 0, 2}, {7, 0, 3}}; /* siblings i, i+4 */
    const nb__cpu_slot six[] = {{0, 0, 0}, {1, 0, 1}, {2, 0, 2}, {3, 0, 3}, {4, 0, 4}, {5, 0, 5}};
    const nb__cpu_slot holes[] = {{7, 0, 7}, {2, 0, 2}, {5, 0, 5}, {3, 0, 3}}; /* taskset -c 2,3,5,7 */
    const nb__cpu_slot packages[] = {{3, 1, 1}, {0, 0, 0}, {2, 1, 0}, {1, 0, 1}}; /* core ids repeat */
    const nb__cpu_slot smt2[] = {{0, 0, 0}, {1, 0, 0}, {2, 0, 1}, {3, 0, 1}}; /* 2 cores x 2 */
    struct {
        const nb__cpu_slot *slots;
        int n, nlocal;
        const char *want[8]; /* each local rank's CPUs */
    } cases[] = {
        {two, 2, 1, {"0-1"}},
        {two, 2, 2, {"0", "1"}},
        {two, 2, 3, {"0", "0", "1"}}, /* more ranks than CPUs (asked for): spread evenly */
        {smt, 8, 2, {"0-1,4-5", "2-3,6-7"}}, /* whole cores, siblings together */
        {smt, 8, 4, {"0,4", "1,5", "2,6", "3,7"}},
        {smt, 8, 3, {"0,4", "1,5", "2-3,6-7"}},
        {smt, 8, 8, {"0", "4", "1", "5", "2", "6", "3", "7"}}, /* fewer cores than ranks */
        {six, 6, 4, {"0", "1-2", "3", "4-5"}},
        {holes, 4, 2, {"2-3", "5,7"}}, /* only the inherited mask */
        {holes, 4, 3, {"2", "3", "5,7"}},
        {packages, 4, 2, {"0-1", "2-3"}}, /* a package each, not core 0 of both */
        {smt2, 4, 3, {"0", "1", "2-3"}},
    };
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        cpu_set_t all, seen;
        CPU_ZERO(&all);
        CPU_ZERO(&seen);
        for (int i = 0; i < cases[c].n; i++) CPU_SET(cases[c].slots[i].cpu, &all);
        for (int r = 0; r < cases[c].nlocal; r++) {
            int out[16];
            int k = nb__cpu_share(cases[c].slots, cases[c].n, cases[c].nlocal, r, out);
            cpu_set_t got, want, both;
            set_of(out, k, &got);
            ck_assert(parse_cpu_list(cases[c].want[r], &want));
            ck_assert_msg(CPU_EQUAL(&got, &want), "case %u, rank %d of %d: %d CPUs, want %s", c, r,
                          cases[c].nlocal, k, cases[c].want[r]);
            ck_assert_int_eq(k, CPU_COUNT(&want)); /* no CPU twice */
            for (int i = 1; i < k; i++) ck_assert_int_ne(out[i - 1], out[i]);
            /* with as many CPUs as ranks, the shares are disjoint */
            CPU_AND(&both, &got, &seen);
            if (cases[c].nlocal <= cases[c].n) ck_assert_int_eq(CPU_COUNT(&both), 0);
            CPU_OR(&seen, &seen, &got);
        }
        ck_assert_msg(CPU_EQUAL(&seen, &all), "case %u: the shares leave CPUs out", c);
    }
    int out[4];
    ck_assert_int_eq(nb__cpu_share(two, 2, 2, 2, out), 0);
    ck_assert_int_eq(nb__cpu_share(two, 2, 0, 0, out), 0);
    ck_assert_int_eq(nb__cpu_share(two, 0, 1, 0, out), 0);
}
END_TEST

/* Each rank's mask as its own /proc/PID/status says, and NABLA_CPU_BIND. */
static void run_masks(const char *bind, int nproc, cpu_set_t *masks, char binds[][8]) {
    nbt_proc p;
    char n[16], flag[32];
    snprintf(n, sizeof n, "%d", nproc);
    snprintf(flag, sizeof flag, "--cpu-bind=%s", bind ? bind : "auto");
    const char *a[] = {"--nproc-per-node", n, flag, NULL};
    run(&p, NULL, a, "echo \"mask $(grep Cpus_allowed_list /proc/$$/status | cut -f2) $NABLA_CPU_BIND\"");
    nbt_proc_wait_all(&p, 1, 30);
    ck_assert_msg(p.code == 0, "exit %d: %s", p.code, p.err);
    for (int r = 0; r < nproc; r++) {
        char want[32], list[256];
        snprintf(want, sizeof want, "[rank %d] mask ", r);
        const char *line = strstr(p.out, want);
        ck_assert_msg(line != NULL, "no \"%s\" in:\n%s", want, p.out);
        ck_assert_int_eq(sscanf(line + strlen(want), "%255s %7s", list, binds[r]), 2);
        ck_assert_msg(parse_cpu_list(list, &masks[r]), "rank %d: mask '%s'", r, list);
    }
    nbt_proc_free(&p);
}

START_TEST(test_cpu_binding) {
    cpu_set_t mine, masks[4];
    char binds[4][8];
    ck_assert_int_eq(sched_getaffinity(0, sizeof mine, &mine), 0);
    int cpus = CPU_COUNT(&mine);
    /* auto with as many CPUs as ranks: disjoint shares that cover this
     * process's mask, each rank told so */
    int nproc = cpus >= 2 ? 2 : 1;
    run_masks(NULL, nproc, masks, binds);
    cpu_set_t seen;
    CPU_ZERO(&seen);
    for (int r = 0; r < nproc; r++) {
        cpu_set_t both, outside;
        CPU_AND(&both, &masks[r], &seen);
        ck_assert_int_eq(CPU_COUNT(&both), 0);
        CPU_XOR(&outside, &masks[r], &mine);
        CPU_AND(&outside, &outside, &masks[r]);
        ck_assert_int_eq(CPU_COUNT(&outside), 0);
        ck_assert_int_ge(CPU_COUNT(&masks[r]), cpus / nproc);
        CPU_OR(&seen, &seen, &masks[r]);
        ck_assert_str_eq(binds[r], "cores");
    }
    ck_assert(CPU_EQUAL(&seen, &mine));
    /* none: every rank keeps the whole mask */
    run_masks("none", nproc, masks, binds);
    for (int r = 0; r < nproc; r++) {
        ck_assert(CPU_EQUAL(&masks[r], &mine));
        ck_assert_str_eq(binds[r], "none");
    }
    /* nbrun on one CPU (taskset): auto binds nothing for 2 ranks; cores puts
     * both on that CPU, never outside it */
    int last = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &mine)) last = c;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(last, &one);
    ck_assert_int_eq(sched_setaffinity(0, sizeof one, &one), 0);
    run_masks(NULL, 2, masks, binds);
    for (int r = 0; r < 2; r++) {
        ck_assert(CPU_EQUAL(&masks[r], &one));
        ck_assert_str_eq(binds[r], "none");
    }
    run_masks("cores", 2, masks, binds);
    for (int r = 0; r < 2; r++) {
        ck_assert(CPU_EQUAL(&masks[r], &one));
        ck_assert_str_eq(binds[r], "cores");
    }
    ck_assert_int_eq(sched_setaffinity(0, sizeof mine, &mine), 0);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_help, test_usage_errors, test_environment_and_prefixes,
                             test_multinode_environment, test_secret_by_descriptor,
                             test_several_nodes_need_a_secret, test_lines_never_mix,
                             test_first_failure_decides, test_term_then_kill, test_interrupt_stops_all,
                             test_children_die_with_nbrun, test_wrapped_ranks_die_with_nbrun,
                             test_max_restarts, test_store_socket_on_one_node, test_cpu_share_table,
                             test_cpu_binding, NULL};
    return nbt_suite("nbrun", "launcher", 120, tests);
}

int main(void) {
    snprintf(nbrun_path, sizeof nbrun_path, "%s/bin/nbrun", NABLA_BINARY_DIR);
    snprintf(scenario_path, sizeof scenario_path, "%s/tests/dist_scenario", NABLA_BINARY_DIR);
    return nbt_run(suite());
}
