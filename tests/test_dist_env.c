/* The launch environment: torchrun's, OpenMPI's and Slurm's variables,
 * their precedence, every error message, run ids, and the option errors of
 * nb_pg_init. Each test runs in its own process (Check forks), so setenv
 * does not leak between tests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"
#include "nabla/dist.h"
#include "testutil.h"

static void clear_env(void) {
    const char *names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                           "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                           "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID",
                           "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASKS_PER_NODE",
                           "SLURM_JOB_ID", "SLURM_STEP_ID", "NABLA_RUN_ID", "TORCHELASTIC_RUN_ID",
                           "PMIX_NAMESPACE", "NABLA_PG_TIMEOUT", "NABLA_STORE_FD", "NABLA_STORE_PORT",
                           "TORCHELASTIC_USE_AGENT_STORE"};
    for (unsigned i = 0; i < sizeof names / sizeof names[0]; i++) unsetenv(names[i]);
}

static void torchrun(const char *rank, const char *world, const char *lrank, const char *lworld) {
    setenv("RANK", rank, 1);
    setenv("WORLD_SIZE", world, 1);
    setenv("LOCAL_RANK", lrank, 1);
    setenv("LOCAL_WORLD_SIZE", lworld, 1);
    setenv("MASTER_ADDR", "10.1.2.3", 1);
    setenv("MASTER_PORT", "29500", 1);
}

static void expect_error(const char *msg) {
    nb_dist_env e;
    nb_status st = nb_dist_env_read(&e);
    ck_assert_msg(st == NB_ERR_INVALID, "expected an error \"%s\", got %s", msg, nb_status_str(st));
    ck_assert_msg(strstr(nb_last_error(), msg) != NULL, "\"%s\" lacks \"%s\"", nb_last_error(), msg);
}

/* nb_dist_env_read succeeds and reads a launch by `source` with these
 * ranks and sizes; returns what it read, for the other fields. */
static nb_dist_env expect_launch(const char *source, int rank, int world, int lrank, int lworld) {
    nb_dist_env e;
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_str_eq(e.source, source);
    ck_assert_int_eq(e.rank, rank);
    ck_assert_int_eq(e.world_size, world);
    ck_assert_int_eq(e.local_rank, lrank);
    ck_assert_int_eq(e.local_world_size, lworld);
    return e;
}

/* Sets each NAME, VALUE pair of vars (ended by NULL) in the environment. */
static void set_vars(const char *const *vars) {
    for (; *vars; vars += 2) setenv(vars[0], vars[1], 1);
}

START_TEST(test_no_launcher_is_a_world_of_one) {
    clear_env();
    nb_dist_env e = expect_launch("none", 0, 1, 0, 1);
    ck_assert_str_eq(e.master_addr, "127.0.0.1");
    ck_assert_int_eq(e.master_port, 0);
    ck_assert_str_eq(e.run_id, "default");
}
END_TEST

START_TEST(test_torchrun) {
    clear_env();
    torchrun("5", "8", "1", "4");
    nb_dist_env e = expect_launch("torchrun", 5, 8, 1, 4);
    ck_assert_str_eq(e.master_addr, "10.1.2.3");
    ck_assert_int_eq(e.master_port, 29500);
    ck_assert_int_eq(e.store_port, 29500);
    /* torchrun's agent keeps its own store on MASTER_PORT */
    setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_int_eq(e.store_port, 29501);
    setenv("NABLA_STORE_PORT", "4000", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_int_eq(e.store_port, 4000);
    setenv("NABLA_STORE_PORT", "0", 1);
    expect_error("NABLA_STORE_PORT='0' is not an integer in [1, 65535]");
    unsetenv("NABLA_STORE_PORT");
    setenv("MASTER_PORT", "65535", 1);
    expect_error("MASTER_PORT=65535 leaves no port for nabla's store next to torchrun's; set NABLA_STORE_PORT");
    unsetenv("TORCHELASTIC_USE_AGENT_STORE");
    setenv("MASTER_PORT", "29500", 1);
    /* torchrun's names win over the others */
    setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    setenv("SLURM_PROCID", "0", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_str_eq(e.source, "torchrun");
    ck_assert_int_eq(e.rank, 5);
}
END_TEST

/* PyTorch's env:// variables alone (Note [Optional LOCAL_*] in env.c). */
START_TEST(test_torchrun_without_local) {
    clear_env();
    torchrun("3", "4", "0", "0");
    unsetenv("LOCAL_RANK");
    unsetenv("LOCAL_WORLD_SIZE");
    nb_dist_env e = expect_launch("torchrun", 3, 4, 3, 4); /* one node: local = global */
    setenv("LOCAL_WORLD_SIZE", "2", 1);      /* two nodes of two: rank 3 is the second of node 1 */
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_int_eq(e.local_rank, 1);
    ck_assert_int_eq(e.local_world_size, 2);
    unsetenv("LOCAL_WORLD_SIZE");
    setenv("LOCAL_RANK", "0", 1);            /* given: taken as is */
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_int_eq(e.local_rank, 0);
    ck_assert_int_eq(e.local_world_size, 4);
}
END_TEST

START_TEST(test_torchrun_errors) {
    clear_env();
    setenv("RANK", "1", 1);
    expect_error("nb_dist_env_read: RANK is set but WORLD_SIZE is not (a torchrun-style launch sets "
                 "all of RANK, WORLD_SIZE)");
    unsetenv("RANK");
    setenv("LOCAL_RANK", "1", 1);
    expect_error("nb_dist_env_read: LOCAL_RANK is set but RANK and WORLD_SIZE are not");
    /* RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and the error */
    static const char *const bad[][5] = {
        {"1", "2", "x", "2", "LOCAL_RANK='x' is not an integer"},
        {"1", "2", "1", "-2", "LOCAL_WORLD_SIZE='-2' is not an integer"},
        {"x1", "2", "0", "2", "RANK='x1' is not an integer in [0, 2147483647]"},
        {"-1", "2", "0", "2", "RANK='-1' is not an integer"},
        {"2", "2", "0", "2", "rank 2 is not below the world size 2 (torchrun variables)"},
        {"1", "2", "2", "2", "local rank 2 is not below the local world size 2"},
        {"1", "2", "0", "3", "local world size 3 exceeds the world size 2"},
        {"0", "0", "0", "1", "world size 0 (from torchrun) must be >= 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        torchrun(bad[i][0], bad[i][1], bad[i][2], bad[i][3]);
        expect_error(bad[i][4]);
    }
    torchrun("1", "2", "1", "2");
    unsetenv("MASTER_ADDR");
    expect_error("MASTER_ADDR is not set; a run of 2 processes needs MASTER_ADDR and MASTER_PORT");
    torchrun("1", "2", "1", "2");
    setenv("MASTER_PORT", "70000", 1);
    expect_error("MASTER_PORT='70000' is not an integer in [0, 65535]");
    setenv("MASTER_PORT", "0", 1);
    expect_error("MASTER_PORT=0 with 2 processes");
}
END_TEST

START_TEST(test_openmpi) {
    clear_env();
    set_vars((const char *const[]){"OMPI_COMM_WORLD_RANK", "3", "OMPI_COMM_WORLD_SIZE", "4",
                                    "OMPI_COMM_WORLD_LOCAL_RANK", "1", "OMPI_COMM_WORLD_LOCAL_SIZE", "2",
                                    "MASTER_ADDR", "node0", "MASTER_PORT", "1234",
                                    "PMIX_NAMESPACE", "prterun-node0-42@1", NULL});
    nb_dist_env e = expect_launch("OpenMPI", 3, 4, 1, 2);
    ck_assert_str_eq(e.run_id, "prterun-node0-42@1");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    expect_error("OMPI_COMM_WORLD_LOCAL_RANK is set but OMPI_COMM_WORLD_LOCAL_SIZE is not (a OpenMPI launch");
}
END_TEST

START_TEST(test_slurm) {
    clear_env();
    set_vars((const char *const[]){"SLURM_PROCID", "6", "SLURM_NTASKS", "7", "SLURM_LOCALID", "0",
                                    "SLURM_NODEID", "3", "SLURM_TASKS_PER_NODE", "2(x3),1",
                                    "SLURM_JOB_ID", "777", "SLURM_STEP_ID", "2", "MASTER_ADDR", "node0",
                                    "MASTER_PORT", "1234", NULL});
    nb_dist_env e = expect_launch("Slurm", 6, 7, 0, 1);
    ck_assert_str_eq(e.run_id, "slurm-777.2");
    set_vars((const char *const[]){"SLURM_NODEID", "1", "SLURM_PROCID", "3", "SLURM_LOCALID", "1", NULL});
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_int_eq(e.local_world_size, 2);
    setenv("SLURM_NODEID", "4", 1);
    expect_error("SLURM_TASKS_PER_NODE='2(x3),1' does not say how many tasks run on node 4");
    /* repeats up to INT_MAX; one past LONG_MAX's reach is refused, not an
     * overflow (UBSan in make test-asan; found by fuzz/fuzz_env.c) */
    setenv("SLURM_TASKS_PER_NODE", "1,2(x2147483647)", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_int_eq(e.local_world_size, 2);
    setenv("SLURM_TASKS_PER_NODE", "1,1(x9223372036854775807)", 1);
    expect_error("SLURM_TASKS_PER_NODE='1,1(x9223372036854775807)' does not say how many tasks run on node 4");
    setenv("SLURM_TASKS_PER_NODE", "2(y3)", 1);
    expect_error("SLURM_TASKS_PER_NODE='2(y3)'");
    unsetenv("SLURM_TASKS_PER_NODE");
    expect_error("SLURM_PROCID is set but SLURM_TASKS_PER_NODE is not");
}
END_TEST

START_TEST(test_run_ids) {
    clear_env();
    nb_dist_env e;
    setenv("SLURM_JOB_ID", "5", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_str_eq(e.run_id, "slurm-5");
    setenv("TORCHELASTIC_RUN_ID", "elastic", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_str_eq(e.run_id, "elastic");
    setenv("NABLA_RUN_ID", "mine", 1);
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    ck_assert_str_eq(e.run_id, "mine");
}
END_TEST

START_TEST(test_device_and_options) {
    clear_env();
    nb_dist_env e;
    ck_assert_int_eq(nb_dist_env_read(&e), NB_OK);
    nb_device d = nb_cuda(3);
    ck_assert_int_eq(nb_dist_select_device(&e, false, &d), NB_OK);
    ck_assert(nb_device_eq(d, nb_cpu()));
    nb_pg *pg = NULL;
    if (nb_dist_select_device(&e, true, &d) == NB_OK) {
        ck_assert(nb_device_eq(d, nb_cuda(0))); /* a GPU machine: local rank 0's GPU */
    } else {
        ck_assert_msg(strstr(nb_last_error(), "no GPU is visible to this process"), "%s", nb_last_error());
        ck_assert_int_eq(nb_pg_init(&pg, &(nb_pg_options){NB_PG_NCCL, 0}), NB_ERR_UNSUPPORTED);
        ck_assert_ptr_null(pg);
    }
    setenv("NABLA_PG_TIMEOUT", "soon", 1);
    ck_assert_int_eq(nb_pg_init(&pg, NULL), NB_ERR_INVALID);
    ck_assert_msg(strstr(nb_last_error(), "NABLA_PG_TIMEOUT='soon' is not a positive number of seconds"),
                  "%s", nb_last_error());
    NBT_EXPECT_ABORT(nb_pg_init(&pg, &(nb_pg_options){NB_PG_GLOO, -1}), "nb_pg_init: timeout -1 s must be >= 0");
    unsetenv("NABLA_PG_TIMEOUT");
    setenv("RANK", "0", 1);
    ck_assert_int_eq(nb_pg_init(&pg, NULL), NB_ERR_INVALID);
    ck_assert_msg(strstr(nb_last_error(), "RANK is set but WORLD_SIZE is not"), "%s", nb_last_error());
    ck_assert_str_eq(nb_pg_backend_name(NB_PG_GLOO), "gloo");
    ck_assert_str_eq(nb_pg_backend_name(NB_PG_NCCL), "nccl");
}
END_TEST

/* Local rank -> GPU index: rank i on GPU i, or the one GPU a launcher bound
 * to the process; too few GPUs names the rank and CUDA_VISIBLE_DEVICES. */
START_TEST(test_pick_gpu) {
    int idx = -1;
    ck_assert_int_eq(nb__dist_pick_gpu(0, 4, NULL, &idx), NB_OK);
    ck_assert_int_eq(idx, 0);
    ck_assert_int_eq(nb__dist_pick_gpu(3, 4, NULL, &idx), NB_OK);
    ck_assert_int_eq(idx, 3);
    idx = -1;
    ck_assert_int_eq(nb__dist_pick_gpu(5, 1, "2", &idx), NB_OK); /* bound: its own GPU */
    ck_assert_int_eq(idx, 0);
    idx = -1;
    ck_assert_int_eq(nb__dist_pick_gpu(2, 2, "0,1", &idx), NB_ERR_INVALID);
    ck_assert_int_eq(idx, -1);
    ck_assert_msg(strstr(nb_last_error(), "local rank 2 needs GPU 2 but 2 GPUs are visible "
                                          "(CUDA_VISIBLE_DEVICES=0,1)"),
                  "%s", nb_last_error());
    ck_assert_int_eq(nb__dist_pick_gpu(0, 0, NULL, &idx), NB_ERR_UNSUPPORTED);
    ck_assert_msg(strstr(nb_last_error(), "no GPU is visible to this process"), "%s", nb_last_error());
}
END_TEST

NBT_MAIN("dist_env", "env", 0,
         test_no_launcher_is_a_world_of_one, test_torchrun, test_torchrun_without_local, test_torchrun_errors,
         test_openmpi, test_slurm, test_run_ids, test_device_and_options, test_pick_gpu)
