/* Liveness: the limits (liveness, join, stall warning), the rendezvous
 * that names ranks that never joined, each process's heartbeat thread,
 * and the check that names a rank whose heartbeat stopped.
 *
 * Note [Liveness and progress]
 * A collective that waits may wait for two different reasons: a peer is
 * alive but busy (a long evaluation, a large checkpoint, a slow
 * collective), or a peer is gone (stopped with SIGSTOP or a debugger,
 * frozen, its host down). The first must be left alone for as long as
 * the work takes; the second should be named in seconds. One timeout
 * cannot do both, so nabla keeps two clocks:
 *   - liveness: every process of the world group runs a thread that bumps
 *     nb/hb/<rank> in the store every second (every tenth of the limit if
 *     that is shorter). A thread, so it beats while the main thread
 *     computes or writes; a stopped or frozen process stops beating, and
 *     so does one whose host died. A rank waiting on a collective (the
 *     watchdog of pg.c, twice a second) reads its peers' counters and
 *     notes when each last changed, on its own clock (no clock agreement
 *     between hosts is needed). A member silent for NABLA_LIVENESS_TIMEOUT
 *     (default 15 s) fails the collective, naming its rank, host, pid and
 *     the last collective it entered. The store answers every request
 *     at once, so a store that has not answered within the same limit is
 *     stopped or frozen too (rank 0 serves it): store_client.c gives up
 *     then and says so.
 *   - progress: NABLA_PG_TIMEOUT (default 1800 s, like PyTorch's 30
 *     minutes) bounds how long a collective may wait on ranks that are
 *     alive. Before that, at NABLA_STALL_WARNING (default 20 s; 0: never)
 *     the waiting rank prints one warning per collective naming the ranks
 *     that have not arrived and where they are, so a deadlock in user code
 *     (alive, never arriving) is named within seconds without ending runs
 *     whose ranks are merely busy.
 * Joining is a third clock: nb_pg_init waits NABLA_JOIN_TIMEOUT (default
 * 120 s: room for slow node starts and container pulls) for every rank to
 * register, and names those that never did. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "distributed/pg.h"

#define DEFAULT_LIVENESS_S 15.0
#define DEFAULT_JOIN_S 120.0
#define DEFAULT_STALL_S 20.0
#define BEAT_MAX_S 1.0

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

nb_status nb__liveness_options(double *liveness, double *join, double *stall) {
    nb_status st = read_seconds("NABLA_LIVENESS_TIMEOUT", DEFAULT_LIVENESS_S, false, liveness);
    if (st == NB_OK) st = read_seconds("NABLA_JOIN_TIMEOUT", DEFAULT_JOIN_S, false, join);
    if (st == NB_OK) st = read_seconds("NABLA_STALL_WARNING", DEFAULT_STALL_S, true, stall);
    return st;
}

/* ------------------------------------------------------------ heartbeat */

static void *beat_main(void *arg) {
    nb_pg *pg = arg;
    char key[64], val[32];
    snprintf(key, sizeof key, "nb/hb/%d", pg->rank);
    double period = pg->liveness_s / 10 < BEAT_MAX_S ? pg->liveness_s / 10 : BEAT_MAX_S;
    int64_t n = 0;
    pthread_mutex_lock(&pg->hb_mu);
    while (!pg->hb_stop) {
        pthread_mutex_unlock(&pg->hb_mu);
        int len = snprintf(val, sizeof val, "%" PRId64, ++n);
        /* A store that is gone is reported by the waits, not here. */
        nb_status st = nb__store_set_quiet(pg->store_hb, key, val, (size_t)len);
        pthread_mutex_lock(&pg->hb_mu);
        if (st != NB_OK) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)(period * 1e9);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        if (!pg->hb_stop) pthread_cond_timedwait(&pg->hb_cond, &pg->hb_mu, &ts);
    }
    pthread_mutex_unlock(&pg->hb_mu);
    return NULL;
}

nb_status nb__hb_start(nb_pg *pg) {
    nb_status st = nb__store_connect_like(&pg->store_hb, pg->store_main, -1, pg->join_s);
    if (st != NB_OK) return st;
    pg->hb_val = malloc((size_t)pg->size * sizeof *pg->hb_val);
    pg->hb_since = malloc((size_t)pg->size * sizeof *pg->hb_since);
    NB_CHECK(pg->hb_val && pg->hb_since, "nb_pg_init: out of memory");
    double now = nb__now();
    for (int r = 0; r < pg->size; r++) {
        pg->hb_val[r] = -1;
        pg->hb_since[r] = now;
    }
    pthread_mutex_init(&pg->hb_mu, NULL);
    pthread_cond_init(&pg->hb_cond, NULL);
    if (pthread_create(&pg->hb_thread, NULL, beat_main, pg) != 0)
        return nb_set_error(NB_ERR_INTERNAL, "nb_pg_init: cannot start the heartbeat thread");
    pg->hb_started = true;
    return NB_OK;
}

void nb__hb_stop(nb_pg *pg) {
    if (pg->hb_started) {
        pthread_mutex_lock(&pg->hb_mu);
        pg->hb_stop = true;
        pthread_cond_broadcast(&pg->hb_cond);
        pthread_mutex_unlock(&pg->hb_mu);
        pthread_join(pg->hb_thread, NULL);
        pthread_mutex_destroy(&pg->hb_mu);
        pthread_cond_destroy(&pg->hb_cond);
        pg->hb_started = false;
    }
    nb_store_close(pg->store_hb);
    pg->store_hb = NULL;
    free(pg->hb_val);
    free(pg->hb_since);
    pg->hb_val = NULL;
    pg->hb_since = NULL;
}

/* "host h, pid p" of world rank r as it registered, or "" (malloc'd). */
static char *whereabouts(nb_pg *root, int r) {
    char key[64], *val = NULL;
    snprintf(key, sizeof key, "nb/join/%d", r);
    char *keys[1] = {key};
    nb__diag_mget(root, keys, 1, &val);
    char host[256] = "?";
    long pid = 0;
    char *out = malloc(320);
    NB_CHECK(out != NULL, "nb_pg: out of memory");
    if (val && sscanf(val, "%255s %ld", host, &pid) == 2) snprintf(out, 320, "host %s, pid %ld", host, pid);
    else snprintf(out, 320, "host unknown");
    free(val);
    return out;
}

nb_status nb__hb_check(nb_pg *pg, char *what, size_t len) {
    nb_pg *root = pg->root;
    if (!root->hb_val) return NB_OK;
    int n = pg->size;
    char **keys = malloc((size_t)n * sizeof *keys), **vals = calloc((size_t)n, sizeof *vals);
    char *buf = malloc((size_t)n * 32);
    NB_CHECK(keys && vals && buf, "nb_pg: out of memory for the liveness check");
    for (int r = 0; r < n; r++) {
        keys[r] = buf + (size_t)r * 32;
        snprintf(keys[r], 32, "nb/hb/%d", pg->global[r]);
    }
    nb_status st = nb__diag_mget(pg, keys, n, vals);
    int silent = -1;
    double quiet = 0, *quiet_r = calloc((size_t)n, sizeof *quiet_r);
    NB_CHECK(quiet_r != NULL, "nb_pg: out of memory for the liveness check");
    if (st == NB_OK) {
        double now = nb__now();
        pthread_mutex_lock(&root->monitor_mu);
        for (int r = 0; r < n; r++) {
            int g = pg->global[r];
            int64_t v = vals[r] ? strtoll(vals[r], NULL, 10) : -1;
            if (v != root->hb_val[g]) {
                root->hb_val[g] = v;
                root->hb_since[g] = now;
            } else if (r != pg->rank) {
                quiet_r[r] = now - root->hb_since[g];
                if (quiet_r[r] > root->liveness_s && silent < 0) silent = r, quiet = quiet_r[r];
            }
        }
        pthread_mutex_unlock(&root->monitor_mu);
    }
    for (int r = 0; r < n; r++) free(vals[r]);
    free(vals);
    free(buf);
    free(keys);
    if (st != NB_OK) {
        free(quiet_r);
        nb__diag_store_lost(pg, what, len);
        return st;
    }
    if (silent < 0) {
        free(quiet_r);
        return NB_OK;
    }
    char *where = whereabouts(root, pg->global[silent]);
    char note[48] = "";
    if (pg->parent && pg->global[silent] != silent)
        snprintf(note, sizeof note, " (world rank %d)", pg->global[silent]);
    /* Where it stopped follows in nb__diag_explain: "did not arrive (its
     * last collective ...)", or that every rank arrived at this one. */
    snprintf(what, len,
             "cannot complete: rank %d%s (%s) has shown no sign of life for %.1f s "
             "(NABLA_LIVENESS_TIMEOUT=%g s): it is stopped (SIGSTOP, a debugger), frozen, or its host "
             "is down",
             silent, note, where, quiet, root->liveness_s);
    free(where);
    /* The others that went quiet at about the same time (a lost node, a cut
     * link: all of its ranks): more than half the limit, which a live rank,
     * beating every tenth of it, never reaches. */
    int listed = 0;
    for (int r = 0; r < n; r++) {
        size_t u = strlen(what);
        if (r == silent || quiet_r[r] <= root->liveness_s / 2 || u + 1 >= len) continue;
        if (listed == 8) {
            snprintf(what + u, len - u, ", ...");
            break;
        }
        char *w = whereabouts(root, pg->global[r]);
        char wr[32] = "";
        if (pg->parent && pg->global[r] != r) snprintf(wr, sizeof wr, " (world rank %d)", pg->global[r]);
        snprintf(what + u, len - u, "%s rank %d%s (%s) for %.1f s", listed ? "," : "; silent as well:", r, wr,
                 w, quiet_r[r]);
        free(w);
        listed++;
    }
    free(quiet_r);
    return NB_ERR_TIMEOUT;
}

/* ------------------------------------------------------------ joining */

/* Appends "1, 2, 5" (at most 16, then "and N more") for the flagged ranks. */
static void list_ranks(const bool *sel, int n, char *out, size_t len) {
    int listed = 0, count = 0;
    for (int r = 0; r < n; r++) count += sel[r];
    for (int r = 0; r < n; r++) {
        if (!sel[r]) continue;
        size_t u = strlen(out);
        if (u >= len) return;
        if (listed == 16) {
            snprintf(out + u, len - u, " and %d more", count - listed);
            return;
        }
        snprintf(out + u, len - u, "%s%d", listed ? ", " : "", r);
        listed++;
    }
}

nb_status nb__join(nb_pg *pg) {
    const nb_dist_env *e = &pg->env;
    char host[256] = "?", key[64], val[320];
    gethostname(host, sizeof host - 1);
    snprintf(key, sizeof key, "nb/join/%d", pg->rank);
    int vn = snprintf(val, sizeof val, "%s %ld", host, (long)getpid());
    nb_status st = nb_store_set(pg->store_main, key, val, (size_t)vn);
    if (st != NB_OK) return st;
    int n = pg->size;
    char **keys = malloc((size_t)n * sizeof *keys);
    char *buf = malloc((size_t)n * 32);
    NB_CHECK(keys && buf, "nb_pg_init: out of memory");
    for (int r = 0; r < n; r++) {
        keys[r] = buf + (size_t)r * 32;
        snprintf(keys[r], 32, "nb/join/%d", r);
    }
    double deadline = nb__now() + pg->join_s;
    for (int i = 0; i < n && st == NB_OK; i += NB_STORE_MAX_KEYS) {
        int m = n - i < NB_STORE_MAX_KEYS ? n - i : NB_STORE_MAX_KEYS;
        double left = deadline - nb__now();
        st = nb_store_wait(pg->store_main, (const char *const *)keys + i, m, left > 0.001 ? left : 0.001);
    }
    if (st == NB_ERR_TIMEOUT) {
        char **vals = calloc((size_t)n, sizeof *vals);
        bool *missing = calloc((size_t)n, sizeof *missing), *joined = calloc((size_t)n, sizeof *joined);
        NB_CHECK(vals && missing && joined, "nb_pg_init: out of memory");
        nb_status mst = NB_OK;
        for (int i = 0; i < n && mst == NB_OK; i += NB_STORE_MAX_KEYS) {
            int m = n - i < NB_STORE_MAX_KEYS ? n - i : NB_STORE_MAX_KEYS;
            mst = nb__store_mget(pg->store_main, (const char *const *)keys + i, m, vals + i);
        }
        int nmiss = 0;
        for (int r = 0; r < n; r++) {
            missing[r] = vals[r] == NULL;
            joined[r] = !missing[r];
            nmiss += missing[r];
            free(vals[r]);
        }
        char who[512] = "", in[512] = "";
        list_ranks(missing, n, who, sizeof who);
        list_ranks(joined, n, in, sizeof in);
        if (mst == NB_OK && nmiss > 0)
            st = nb_set_error(NB_ERR_TIMEOUT,
                              "nb_pg_init: rank%s %s of %d never joined within %.1f s (joined: rank%s "
                              "%s); start every rank with the same MASTER_ADDR (%s), MASTER_PORT (%d), "
                              "WORLD_SIZE (%d) and run id (%s), each with its own RANK; "
                              "NABLA_JOIN_TIMEOUT sets how long to wait",
                              nmiss == 1 ? "" : "s", who, n, pg->join_s, n - nmiss == 1 ? "" : "s", in,
                              e->master_addr, e->master_port, n, e->run_id);
        free(vals);
        free(missing);
        free(joined);
    }
    free(buf);
    free(keys);
    if (st == NB_OK) {
        char *w = whereabouts(pg, 0);
        snprintf(pg->store_owner, sizeof pg->store_owner, "%s", w);
        free(w);
    }
    return st;
}
