/* Helper of tests/test_dist_failures.c: one rank of a run that goes wrong
 * on purpose. `dist_scenario NAME`, started by nbrun (or by the test
 * itself) with 3 ranks. Every rank makes the world group and does one
 * good all-reduce (collective #1); then:
 *
 *   absent   rank 2 never issues collective #2 (it sleeps), the others
 *            all-reduce and time out (NABLA_PG_TIMEOUT)
 *   desync   rank 0 broadcasts where the others all-reduce
 *   exit3    rank 1 writes to stderr and exits with 3; the others all-reduce
 *   killed   rank 1 kills itself (SIGKILL); the others all-reduce
 *   store    rank 0, which serves the store, kills itself; the others all-reduce
 *   stopped  rank 1 stops itself (SIGSTOP); the others all-reduce and name it
 *            at the liveness limit (NABLA_LIVENESS_TIMEOUT)
 *   stopped0 the same with rank 0, which serves the store
 *   slow     rank 1 sleeps 5 s (its heartbeat goes on) before all-reducing;
 *            every rank completes
 *   ok       every rank all-reduces (a launch test)
 *   orphan   every rank prints "pid P" and sleeps 60 s (a test kills the
 *            launcher and looks for the pids: Note [Launcher lifeline])
 *   ddp      every rank wraps a Linear + BatchNorm in DDP; rank 1 kills
 *            itself; the others' nb_ddp_forward (a buffer broadcast) fails
 *   sbnfwd   the same model with its BatchNorm converted to SyncBatchNorm
 *            and no buffer broadcast; rank 1 kills itself; the others'
 *            nb_ddp_forward fails in the SyncBatchNorm's all-reduce; they
 *            print nb_pg_status and what a SyncBatchNorm called on the
 *            broken group gives (NaN, running statistics kept)
 *   sbnbwd   the same, but rank 1 dies after the forward; the others'
 *            nb_ddp_backward fails in the SyncBatchNorm's backward
 *   mm_WHAT  collective #2 differs between ranks (any number of ranks):
 *            mm_count   all-reduce, rank 0 of 10 floats, the others of 20
 *            mm_bcast   broadcast from rank 0 of 10 floats, the others 20
 *            mm_gather  all-gather, rank 0 gives 3 floats, the others 4
 *            mm_rs      reduce-scatter, rank 0 gets 3 floats, the others 4
 *            mm_dtype   all-reduce, the last rank's in f64, the others f32
 *            mm_op      all-reduce, the last rank's max, the others' sum
 *            mm_root    broadcast, the last rank names root 1, the others 0
 *            mm_zero    all-reduce, rank 0 of no floats, the others of 8
 *            mm_small   all-reduce, rank 0 of 1000 floats, the others of 1024
 *            mm_limit   broadcast from rank 0 of 8 floats, the others 10000
 *            mm_pair    NABLA_DIST_CHECK=off, two ranks: all-reduce, rank
 *                       0 of 10000 floats, rank 1 of 12000 (Note
 *                       [All-reduce of two ranks] in distributed/pg_gloo.c)
 *            mm_group   on the subgroup of world ranks R-1 and R-2 (in that
 *                       order): all-reduce, R-1 of 5 floats, R-2 of 6; the
 *                       other ranks are not members
 *            every rank prints its failure and whether its buffers kept
 *            their values ("buffers untouched"), then waits (through the
 *            store) until every rank has printed, so that nbrun stops no
 *            rank before it has spoken
 *
 * A rank whose collective fails prints "rank R: <status>: <message>" to
 * stderr and exits 1; one that succeeds exits 0. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nabla/nabla.h"
#include "nabla/dist.h"
#include "nabla/ddp.h"
#include "nabla/nn.h"

static nb_ctx *ctx;

/* A failing rank leaves without nb_pg_free: its group is broken anyway. */
static int report(int rank, nb_status st) {
    fprintf(stderr, "rank %d: %s: %s\n", rank, nb_status_str(st), nb_last_error());
    nb_ctx_free(ctx);
    return 1;
}

/* After a SyncBatchNorm failed inside nb_ddp_forward / nb_ddp_backward:
 * what the group says, and what a SyncBatchNorm on it gives now. */
static void after_sbn_failure(nb_pg *pg, int rank, nb_status failed, bool bwd, nb_tensor *out) {
    char msg[4096];
    snprintf(msg, sizeof msg, "%s", nb_last_error());
    nb_status st = nb_pg_status(pg);
    if (!bwd) fprintf(stderr, "rank %d: nb_ddp_forward's output %s\n", rank, out ? "is set" : "is NULL");
    fprintf(stderr, "rank %d: nb_pg_status gives %s: %s\n", rank,
            st == failed ? "the same status" : nb_status_str(st), nb_last_error());
    nb_tensor *x = nb_ones(ctx, NB_F32, NB_SHAPE(2, 3));
    nb_set(x, (int64_t[]){1, 2}, 5.0);
    nb_tensor *rm = nb_zeros(ctx, NB_F32, NB_SHAPE(3)), *rv = nb_ones(ctx, NB_F32, NB_SHAPE(3));
    nb_tensor *y = nb_sync_batch_norm(ctx, pg, x, NULL, NULL, rm, rv, true, 0.5, 1e-5);
    int n_nan = 0;
    bool kept = true;
    for (int64_t i = 0; i < 2; i++)
        for (int64_t j = 0; j < 3; j++) n_nan += isnan(nb_get(y, (int64_t[]){i, j}));
    for (int64_t j = 0; j < 3; j++)
        kept = kept && nb_get(rm, &j) == 0 && nb_get(rv, &j) == 1;
    fprintf(stderr, "rank %d: a SyncBatchNorm on the broken group gives %d NaN of 6, running statistics %s: %s\n",
            rank, n_nan, kept ? "kept" : "changed", nb_last_error());
    nb_set_error(failed, "%s", msg);
}

/* A tensor of n floats (or doubles) holding 100 (rank + 1) + i. */
static nb_tensor *filled(nb_dtype dt, int rank, int64_t n) {
    nb_tensor *t = nb_zeros(ctx, dt, NB_SHAPE(n));
    for (int64_t i = 0; i < n; i++) nb_set(t, &i, 100.0 * (rank + 1) + (double)i);
    return t;
}

static bool untouched(const nb_tensor *t, int rank) {
    for (int64_t i = 0; i < nb_numel(t); i++)
        if (nb_get(t, &i) != 100.0 * (rank + 1) + (double)i) return false;
    return true;
}

/* The mm_* scenarios: collective #2 differs between ranks. */
static int mismatch(nb_pg *pg, const char *what) {
    int rank = nb_pg_rank(pg), R = nb_pg_size(pg);
    bool first = rank == 0, last = rank == R - 1;
    nb_tensor *a = NULL, *b = NULL; /* b: the output of all-gather and reduce-scatter */
    nb_work *w = NULL;
    nb_pg *sub = NULL;
    if (strcmp(what, "mm_count") == 0) {
        a = filled(NB_F32, rank, first ? 10 : 20);
        w = nb_pg_all_reduce(pg, a, NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_bcast") == 0) {
        a = filled(NB_F32, rank, first ? 10 : 20);
        w = nb_pg_broadcast(pg, a, 0);
    } else if (strcmp(what, "mm_gather") == 0) {
        int64_t n = first ? 3 : 4;
        a = filled(NB_F32, rank, n);
        b = filled(NB_F32, rank, n * R);
        w = nb_pg_all_gather(pg, b, a);
    } else if (strcmp(what, "mm_rs") == 0) {
        int64_t n = first ? 3 : 4;
        a = filled(NB_F32, rank, n * R);
        b = filled(NB_F32, rank, n);
        w = nb_pg_reduce_scatter(pg, b, a, NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_dtype") == 0) {
        a = filled(last ? NB_F64 : NB_F32, rank, 8);
        w = nb_pg_all_reduce(pg, a, NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_op") == 0) {
        a = filled(NB_F32, rank, 8);
        w = nb_pg_all_reduce(pg, a, last ? NB_REDUCE_MAX : NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_root") == 0) {
        a = filled(NB_F32, rank, 8);
        w = nb_pg_broadcast(pg, a, last ? 1 : 0);
    } else if (strcmp(what, "mm_zero") == 0) {
        a = filled(NB_F32, rank, first ? 0 : 8);
        w = nb_pg_all_reduce(pg, a, NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_small") == 0) {
        a = filled(NB_F32, rank, first ? 1000 : 1024);
        w = nb_pg_all_reduce(pg, a, NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_limit") == 0) {
        a = filled(NB_F32, rank, first ? 8 : 10000);
        w = nb_pg_broadcast(pg, a, 0);
    } else if (strcmp(what, "mm_pair") == 0) {
        a = filled(NB_F32, rank, first ? 10000 : 12000);
        w = nb_pg_all_reduce(pg, a, NB_REDUCE_SUM);
    } else if (strcmp(what, "mm_group") == 0) {
        int members[2] = {R - 1, R - 2};
        nb_status gst = nb_pg_new_group(pg, members, 2, &sub);
        if (gst != NB_OK) return report(rank, gst);
        if (sub) {
            a = filled(NB_F32, rank, rank == R - 1 ? 5 : 6);
            w = nb_pg_all_reduce(sub, a, NB_REDUCE_SUM);
        }
    } else {
        fprintf(stderr, "dist_scenario: unknown scenario %s\n", what);
        return 2;
    }
    nb_status st = w ? nb_work_finish(w) : NB_OK;
    if (!w) {
        printf("rank %d: not a member\n", rank);
    } else if (st == NB_OK) {
        printf("rank %d: collective #2 completed\n", rank);
    } else {
        fprintf(stderr, "rank %d: %s: %s\n", rank, nb_status_str(st), nb_last_error());
        fprintf(stderr, "rank %d: buffers %s\n", rank,
                untouched(a, rank) && (!b || untouched(b, rank)) ? "untouched" : "CHANGED");
    }
    fflush(stdout);
    fflush(stderr);
    /* Rank 0 serves the store: nobody leaves before every rank has spoken. */
    int64_t n = 0;
    nb_store *store = nb_pg_store(pg);
    if (nb_store_add(store, "mm/spoken", 1, &n) == NB_OK && n == R) nb_store_set(store, "mm/all", "1", 1);
    const char *all = "mm/all";
    nb_store_wait(store, &all, 1, 30);
    if (st == NB_OK && sub) st = nb_pg_free(sub);
    if (st == NB_OK) st = nb_pg_free(pg);
    nb_ctx_free(ctx);
    return st == NB_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: dist_scenario orphan|absent|desync|exit3|killed|store|stopped|stopped0|slow|ok|ddp|sbnfwd|sbnbwd|mm_*\n");
        return 2;
    }
    const char *what = argv[1];
    if (strcmp(what, "mm_pair") == 0) setenv("NABLA_DIST_CHECK", "off", 1); /* no headers: the exchange's own sizes */
    nb_pg *pg;
    nb_pg_options opts = {NB_PG_GLOO, 0};
    nb_status st = nb_pg_init(&pg, &opts);
    if (st != NB_OK) {
        fprintf(stderr, "nb_pg_init: %s\n", nb_last_error());
        return st == NB_ERR_UNSUPPORTED ? 77 : 1;
    }
    int rank = nb_pg_rank(pg);
    ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t = nb_ones(ctx, NB_F32, NB_SHAPE(8));
    st = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM));
    if (st != NB_OK) return report(rank, st);

    if (strncmp(what, "mm_", 3) == 0) return mismatch(pg, what);
    if (strcmp(what, "orphan") == 0) {
        printf("pid %ld\n", (long)getpid());
        fflush(stdout);
        sleep(60);
        return 0;
    }
    if (strcmp(what, "absent") == 0 && rank == 2) {
        sleep(30);
        nb_ctx_free(ctx);
        return 0;
    }
    if (strcmp(what, "exit3") == 0 && rank == 1) {
        fprintf(stderr, "rank 1 gives up: no data in shard 1\n");
        nb_ctx_free(ctx);
        return 3;
    }
    if ((strcmp(what, "killed") == 0 && rank == 1) || (strcmp(what, "store") == 0 && rank == 0))
        raise(SIGKILL);
    if ((strcmp(what, "stopped") == 0 && rank == 1) || (strcmp(what, "stopped0") == 0 && rank == 0))
        raise(SIGSTOP);
    if (strcmp(what, "slow") == 0 && rank == 1) sleep(5);
    if (strcmp(what, "ddp") == 0) {
        nb_rng rng = nb_rng_make(5);
        nb_module *layers[2] = {nb_linear_new(ctx, NB_F32, 4, 4, true, &rng),
                                nb_batch_norm1d_new(ctx, NB_F32, 4, NULL)};
        nb_module *model = nb_sequential_new(ctx, 2, layers);
        nb_ddp *ddp;
        st = nb_ddp_new(&ddp, model, pg, NULL);
        if (st != NB_OK) return report(rank, st);
        if (rank == 1) raise(SIGKILL);
        nb_tensor *out = NULL;
        st = nb_ddp_forward(ddp, ctx, nb_ones(ctx, NB_F32, NB_SHAPE(2, 4)), &out);
        if (st != NB_OK) return report(rank, st);
        printf("rank %d: forward completed\n", rank);
        nb_ddp_free(ddp);
    }

    if (strcmp(what, "sbnfwd") == 0 || strcmp(what, "sbnbwd") == 0) {
        bool bwd = strcmp(what, "sbnbwd") == 0;
        nb_rng rng = nb_rng_make(5);
        nb_module *layers[2] = {nb_linear_new(ctx, NB_F32, 4, 4, true, &rng),
                                nb_batch_norm1d_new(ctx, NB_F32, 4, NULL)};
        nb_module *model = nb_sequential_new(ctx, 2, layers);
        nb_convert_sync_batchnorm(model, pg);
        nb_ddp_options o = NB_DDP_DEFAULTS;
        o.broadcast_buffers = false; /* the forward's first collective is the SyncBatchNorm's */
        nb_ddp *ddp;
        st = nb_ddp_new(&ddp, model, pg, &o);
        if (st != NB_OK) return report(rank, st);
        if (rank == 1 && !bwd) raise(SIGKILL);
        nb_tensor *x = nb_rand_normal(ctx, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng), *out = x;
        st = nb_ddp_forward(ddp, ctx, x, &out);
        if (st == NB_OK && bwd) {
            /* rank 1 dies once the others have their forward's result, not
             * while the all-reduce's last bytes are still on their way */
            char key[32];
            snprintf(key, sizeof key, "sbnbwd/%d", rank);
            if (rank != 1) st = nb_store_set(nb_pg_store(pg), key, "1", 1);
            const char *keys[2] = {"sbnbwd/0", "sbnbwd/2"};
            if (rank == 1 && nb_store_wait(nb_pg_store(pg), keys, 2, 30) == NB_OK) raise(SIGKILL);
            if (st != NB_OK) return report(rank, st);
            printf("rank %d: forward completed\n", rank);
            fflush(stdout);
            st = nb_ddp_backward(ddp, nb_sum_all(ctx, nb_mul(ctx, out, out)));
        }
        if (st != NB_OK) {
            nb_status fst = st;
            after_sbn_failure(pg, rank, fst, bwd, out);
            return report(rank, fst);
        }
        printf("rank %d: %s completed\n", rank, bwd ? "backward" : "forward");
        nb_ddp_free(ddp);
    }

    if (strcmp(what, "desync") == 0 && rank == 0) st = nb_work_finish(nb_pg_broadcast(pg, t, 0));
    else st = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM));
    if (st != NB_OK && strcmp(what, "stopped") == 0) {
        /* cleaning up after the failure must not wait for Gloo's timeout */
        char msg[4096];
        snprintf(msg, sizeof msg, "%s", nb_last_error());
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        nb_status fst = nb_pg_free(pg);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double took = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        fprintf(stderr, "rank %d: nb_pg_free %s after %.0f s\n", rank, fst == st ? "repeated the failure" : "said otherwise", took);
        nb_set_error(st, "%s", msg);
    }
    if (st != NB_OK) return report(rank, st);
    printf("rank %d: collective #2 completed\n", rank);
    st = nb_pg_free(pg);
    if (st != NB_OK) return report(rank, st);
    nb_ctx_free(ctx);
    return 0;
}
