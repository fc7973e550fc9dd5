/* The launch environment: which launcher started this process, where it
 * sits in the run, and the limits of Note [Liveness and progress]
 * (heartbeat.c) that the environment sets.
 *
 * One family of variables is read, the first present of: torchrun's
 * (also what nbrun sets), OpenMPI's, Slurm's. Within it every variable is
 * required and must agree with the others; a family is never completed
 * from another, since a mix usually means a process inherited variables
 * from an outer launcher. MASTER_ADDR and MASTER_PORT come from the
 * environment in every case (mpirun -x, or exported before srun). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"
#include "tensor/cuda_plugin.h" /* why no GPU: Note [CUDA plugin] */

static const char *env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static nb_status parse_int(const char *name, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno != 0 || end == v || *end != 0 || x < lo || x > hi)
        return nb_set_error(NB_ERR_INVALID, "nb_dist_env_read: %s='%s' is not an integer in [%ld, %ld]",
                            name, v, lo, hi);
    *out = (int)x;
    return NB_OK;
}

/* Reads the `n` variables of one family into `out`; all are required. */
static nb_status read_family(const char *family, const char *const *names, int n, int *out[]) {
    const char *missing = NULL, *present = NULL;
    for (int i = 0; i < n; i++) {
        if (env(names[i])) present = names[i];
        else if (!missing) missing = names[i];
    }
    if (missing) {
        char all[256] = "";
        for (int i = 0; i < n; i++)
            snprintf(all + strlen(all), sizeof all - strlen(all), "%s%s", i ? ", " : "", names[i]);
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: %s is set but %s is not (a %s launch sets all of %s)",
                            present, missing, family, all);
    }
    for (int i = 0; i < n; i++) {
        nb_status st = parse_int(names[i], env(names[i]), 0, INT_MAX, out[i]);
        if (st != NB_OK) return st;
    }
    return NB_OK;
}

/* Note [Optional LOCAL_*]: PyTorch's env:// needs only RANK, WORLD_SIZE,
 * MASTER_ADDR and MASTER_PORT, so a hand launch may leave out LOCAL_RANK
 * and LOCAL_WORLD_SIZE. The defaults are right for one node and loud for
 * several: LOCAL_WORLD_SIZE defaults to WORLD_SIZE (every rank on this
 * node), LOCAL_RANK to RANK mod LOCAL_WORLD_SIZE (torchrun's numbering:
 * nodes filled in rank order, the same count on each). On several nodes
 * without LOCAL_WORLD_SIZE a rank's local rank is its global rank, which
 * exceeds the node's GPU count and is refused by nb_dist_select_device
 * rather than sharing a GPU by accident. */
static nb_status read_torch(const char *const *names, int *out[]) {
    if (!env(names[0]) && !env(names[1]))
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: %s is set but RANK and WORLD_SIZE are not (a "
                            "torchrun-style launch sets at least RANK, WORLD_SIZE, MASTER_ADDR, "
                            "MASTER_PORT)",
                            env(names[2]) ? names[2] : names[3]);
    nb_status st = read_family("torchrun-style", names, 2, out);
    if (st != NB_OK) return st;
    const char *lws = env(names[3]), *lr = env(names[2]);
    *out[3] = *out[1];
    if (lws && (st = parse_int(names[3], lws, 0, INT_MAX, out[3])) != NB_OK) return st;
    *out[2] = *out[3] > 0 ? *out[0] % *out[3] : 0;
    if (lr && (st = parse_int(names[2], lr, 0, INT_MAX, out[2])) != NB_OK) return st;
    return NB_OK;
}

/* Slurm's SLURM_TASKS_PER_NODE: "4(x2),3" = 4 tasks on nodes 0-1, 3 on node 2. */
static nb_status slurm_tasks_on_node(const char *spec, int node, int *tasks) {
    const char *p = spec;
    int index = 0;
    while (*p) {
        char *end;
        long count = strtol(p, &end, 10);
        long repeat = 1;
        if (end == p || count < 0 || count > INT_MAX) break;
        p = end;
        if (*p == '(') {
            if (p[1] != 'x') break;
            repeat = strtol(p + 2, &end, 10);
            if (end == p + 2 || *end != ')' || repeat < 1 || repeat > INT_MAX) break;
            p = end + 1;
        }
        /* node >= index here; node - index < repeat, not node < index +
         * repeat, which overflows for a repeat near LONG_MAX (found by
         * fuzz/fuzz_env.c) */
        if ((long)node - index < repeat) {
            *tasks = (int)count;
            return NB_OK;
        }
        index += (int)repeat;
        if (*p == ',') p++;
        else if (*p) break;
    }
    return nb_set_error(NB_ERR_INVALID,
                        "nb_dist_env_read: SLURM_TASKS_PER_NODE='%s' does not say how many tasks "
                        "run on node %d (SLURM_NODEID)",
                        spec, node);
}

static void read_run_id(nb_dist_env *e) {
    const char *id = env("NABLA_RUN_ID");
    if (!id) id = env("TORCHELASTIC_RUN_ID");
    if (!id && env("SLURM_JOB_ID")) {
        if (env("SLURM_STEP_ID"))
            snprintf(e->run_id, sizeof e->run_id, "slurm-%s.%s", env("SLURM_JOB_ID"), env("SLURM_STEP_ID"));
        else
            snprintf(e->run_id, sizeof e->run_id, "slurm-%s", env("SLURM_JOB_ID"));
        return;
    }
    if (!id) id = env("PMIX_NAMESPACE");
    snprintf(e->run_id, sizeof e->run_id, "%s", id ? id : "default");
}

nb_status nb_dist_env_read(nb_dist_env *e) {
    NB_CHECK(e != NULL, "nb_dist_env_read: env is NULL");
    memset(e, 0, sizeof *e);
    nb_status st;
    static const char *const torch[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
    static const char *const ompi[] = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
    static const char *const slurm[] = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"};
    int *dst[4] = {&e->rank, &e->world_size, &e->local_rank, &e->local_world_size};
    if (env(torch[0]) || env(torch[1]) || env(torch[2]) || env(torch[3])) {
        e->source = "torchrun";
        st = read_torch(torch, dst);
    } else if (env(ompi[0]) || env(ompi[1]) || env(ompi[2]) || env(ompi[3])) {
        e->source = "OpenMPI";
        st = read_family("OpenMPI", ompi, 4, dst);
    } else if (env(slurm[0])) {
        e->source = "Slurm";
        int node = 0;
        int *sdst[4] = {&e->rank, &e->world_size, &e->local_rank, &node};
        st = read_family("Slurm", slurm, 4, sdst);
        if (st == NB_OK) {
            const char *spec = env("SLURM_TASKS_PER_NODE");
            if (!spec)
                return nb_set_error(NB_ERR_INVALID,
                                    "nb_dist_env_read: SLURM_PROCID is set but SLURM_TASKS_PER_NODE "
                                    "is not (run the program with srun)");
            st = slurm_tasks_on_node(spec, node, &e->local_world_size);
        }
    } else {
        e->source = "none";
        e->world_size = e->local_world_size = 1;
        st = NB_OK;
    }
    if (st != NB_OK) return st;

    if (e->world_size < 1)
        return nb_set_error(NB_ERR_INVALID, "nb_dist_env_read: world size %d (from %s) must be >= 1",
                            e->world_size, e->source);
    if (e->rank >= e->world_size)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: rank %d is not below the world size %d (%s variables)",
                            e->rank, e->world_size, e->source);
    if (e->local_world_size < 1 || e->local_rank >= e->local_world_size)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: local rank %d is not below the local world size %d "
                            "(%s variables)",
                            e->local_rank, e->local_world_size, e->source);
    if (e->local_world_size > e->world_size)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: local world size %d exceeds the world size %d (%s "
                            "variables)",
                            e->local_world_size, e->world_size, e->source);

    const char *addr = env("MASTER_ADDR"), *port = env("MASTER_PORT");
    if (e->world_size > 1 && (!addr || !port))
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: %s is not set; a run of %d processes needs "
                            "MASTER_ADDR and MASTER_PORT (where rank 0 serves the store)",
                            !addr ? "MASTER_ADDR" : "MASTER_PORT", e->world_size);
    snprintf(e->master_addr, sizeof e->master_addr, "%s", addr ? addr : "127.0.0.1");
    if (strlen(addr ? addr : "") >= sizeof e->master_addr)
        return nb_set_error(NB_ERR_INVALID, "nb_dist_env_read: MASTER_ADDR is longer than %zu bytes",
                            sizeof e->master_addr - 1);
    if (port) {
        st = parse_int("MASTER_PORT", port, 0, 65535, &e->master_port);
        if (st != NB_OK) return st;
    }
    if (e->master_port == 0 && e->world_size > 1)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: MASTER_PORT=0 with %d processes: the other ranks "
                            "cannot learn which port rank 0 picks (nbrun passes the real port)",
                            e->world_size);
    e->store_port = e->master_port;
    const char *agent = env("TORCHELASTIC_USE_AGENT_STORE");
    if (agent && strcmp(agent, "True") == 0 && e->master_port > 0) e->store_port = e->master_port + 1;
    const char *sp = env("NABLA_STORE_PORT");
    if (sp) {
        st = parse_int("NABLA_STORE_PORT", sp, 1, 65535, &e->store_port);
        if (st != NB_OK) return st;
    }
    if (e->store_port > 65535)
        return nb_set_error(NB_ERR_INVALID,
                            "nb_dist_env_read: MASTER_PORT=%d leaves no port for nabla's store next "
                            "to torchrun's; set NABLA_STORE_PORT",
                            e->master_port);
    read_run_id(e);
    return NB_OK;
}

/* Note [One GPU per process]: local rank i uses GPU i of those the
 * process sees. A launcher may instead bind each process to one GPU of its
 * own (Slurm's --gpu-bind, or CUDA_VISIBLE_DEVICES set per process): then the
 * process sees exactly one GPU, whatever its local rank, and uses it. Two
 * processes that see the same single GPU are caught by NCCL at
 * nb_pg_init ("Duplicate GPU"). */
nb_status nb__dist_pick_gpu(int local_rank, int visible, const char *cvd, int *index) {
    if (visible <= 0) {
        const char *why = nb__cuda_plugin_error(); /* "" when the CUDA backend is loaded */
        return nb_set_error(NB_ERR_UNSUPPORTED,
                            "nb_dist_select_device: no GPU is visible to this process%s%s%s",
                            *why ? " (" : "", why, *why ? ")" : "");
    }
    if (local_rank < visible) {
        *index = local_rank;
        return NB_OK;
    }
    if (visible == 1) {
        *index = 0;
        return NB_OK;
    }
    return nb_set_error(NB_ERR_INVALID,
                        "nb_dist_select_device: local rank %d needs GPU %d but %d GPUs are visible "
                        "(CUDA_VISIBLE_DEVICES=%s); start at most %d processes per node, or bind "
                        "one GPU to each process",
                        local_rank, local_rank, visible, cvd ? cvd : "(unset)", visible);
}

nb_status nb_dist_select_device(const nb_dist_env *e, bool want_gpu, nb_device *device) {
    NB_CHECK(e != NULL && device != NULL, "nb_dist_select_device: NULL argument");
    *device = nb_cpu();
    if (!want_gpu) return NB_OK;
    int index = 0;
    nb_status st = nb__dist_pick_gpu(e->local_rank, nb__cuda_device_count(),
                                     getenv("CUDA_VISIBLE_DEVICES"), &index);
    if (st != NB_OK) return st;
    st = nb__cuda_set_device(index);
    if (st != NB_OK) return st;
    *device = nb_cuda(index);
    return NB_OK;
}

/* ---- the liveness limits (Note [Liveness and progress] in heartbeat.c) ---- */
#define DEFAULT_LIVENESS_S 15.0
#define DEFAULT_JOIN_S 120.0
#define DEFAULT_STALL_S 20.0

/* Seconds from `name`; `dflt` when unset. allow_zero: 0 is a value. */
static nb_status read_seconds(const char *name, double dflt, bool allow_zero, double *out) {
    *out = dflt;
    const char *v = getenv(name);
    if (!v || !*v) return NB_OK;
    char *end;
    double t = strtod(v, &end);
    if (end == v || *end != 0 || !(allow_zero ? t >= 0 : t > 0) || t > 1e9)
        return nb_set_error(NB_ERR_INVALID, "nb_pg_init: %s='%s' is not a %s number of seconds", name, v,
                            allow_zero ? "non-negative" : "positive");
    *out = t;
    return NB_OK;
}

double nb__liveness_s(void) {
    double t;
    if (read_seconds("NABLA_LIVENESS_TIMEOUT", DEFAULT_LIVENESS_S, false, &t) != NB_OK)
        return DEFAULT_LIVENESS_S;
    return t;
}

nb_status nb__dist_check_option(nb__dist_check *out) {
    const char *v = getenv("NABLA_DIST_CHECK");
    *out = NB__CHECK_AUTO;
    if (!v || !*v || strcmp(v, "auto") == 0) return NB_OK;
    if (strcmp(v, "full") == 0) *out = NB__CHECK_FULL;
    else if (strcmp(v, "off") == 0) *out = NB__CHECK_OFF;
    else
        return nb_set_error(NB_ERR_INVALID, "nb_pg_init: NABLA_DIST_CHECK='%s' is not auto, full or off", v);
    return NB_OK;
}

nb_status nb__liveness_options(double *liveness, double *join, double *stall) {
    nb_status st = read_seconds("NABLA_LIVENESS_TIMEOUT", DEFAULT_LIVENESS_S, false, liveness);
    if (st == NB_OK) st = read_seconds("NABLA_JOIN_TIMEOUT", DEFAULT_JOIN_S, false, join);
    if (st == NB_OK) st = read_seconds("NABLA_STALL_WARNING", DEFAULT_STALL_S, true, stall);
    return st;
}
