/* Liveness: the rendezvous that names ranks that never joined, each process's heartbeat thread,
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
 * register, and names those that never did (Note [Joining]); the same
 * limit bounds Gloo's connection set-up that follows (pg_gloo.c). */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "distributed/pg.h"

#define BEAT_MAX_S 1.0
#define JOIN_POLL_S 1.0  /* Note [Joining] */
#define JOIN_NOTE_S 20.0
#define JOIN_FIRST_NOTE_S 5.0 /* Note [Joining]: the first line comes sooner */
#define JOIN_LINGER_S 5.0
#define JOIN_STRAYS_SAID 8 /* refused strays said on stderr, at most */
#define JOIN_ABORT_KEY "nb/join/abort" /* Note [Joining] */
#define JOIN_STRAY_KEY "nb/join/stray"

/* ------------------------------------------------------------ the launcher's lifeline */

/* Note [Launcher lifeline]
 * A rank must not outlive the launcher that started it. PR_SET_PDEATHSIG
 * reaches only nbrun's direct child: a rank started through a wrapper
 * (`nbrun sh -c 'prog; ...'`, a script that forks, a double fork) is a
 * grandchild, and after `kill -9 nbrun` it would go on training with
 * parent 1. So nbrun also hands every process it starts the read end of a
 * pipe whose only write end nbrun holds (NABLA_LAUNCHER_FD); descriptors
 * are inherited through any wrapper and fork. The kernel closes the write
 * end when nbrun dies however it dies, and the read end then reports end
 * of file. When a program makes its world group (nb__launcher_lifeline,
 * before the join), the library takes the descriptor, and the heartbeat
 * thread looks at it at each beat (a poll that does not wait: no thread of
 * its own, since one more thread made a killed rank's death reach nbrun
 * after the death of the peer it made fail, in one run in two under load).
 * At end of file it says so on stderr and kills its own process with
 * SIGKILL: the end PR_SET_PDEATHSIG gives a direct child, within a beat
 * (a second at most). A descriptor that is not a pipe is ignored (a
 * variable inherited by a program that is not nbrun's). */
static int lifeline_fd = -1;

static void lifeline_take(void) {
    const char *v = getenv("NABLA_LAUNCHER_FD");
    if (!v || !*v) return;
    char *end;
    long fd = strtol(v, &end, 10);
    struct stat st;
    if (end == v || *end || fd < 0 || fd > INT32_MAX || fstat((int)fd, &st) != 0 || !S_ISFIFO(st.st_mode))
        return;
    lifeline_fd = (int)fd;
}

void nb__launcher_lifeline(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, lifeline_take);
}

/* The heartbeat thread's look: the launcher is gone when the pipe reads end of file. */
static void lifeline_check(void) {
    if (lifeline_fd < 0) return;
    struct pollfd p = {lifeline_fd, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0) return;
    char buf[64];
    ssize_t got = read(lifeline_fd, buf, sizeof buf);
    if (got != 0) return; /* nbrun never writes; an error is not its death */
    const char *rank = getenv("RANK");
    char line[256];
    int n = snprintf(line, sizeof line,
                     "nabla: rank %s (pid %ld): the launcher that started this process is gone "
                     "(NABLA_LAUNCHER_FD %d closed); stopping, as its direct children do\n",
                     rank ? rank : "?", (long)getpid(), lifeline_fd);
    ssize_t w = write(2, line, (size_t)n);
    (void)w;
    kill(getpid(), SIGKILL);
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
        lifeline_check();
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

/* Fetches the n keys of the join (values[r] malloc'd or NULL). */
static nb_status join_records(nb_pg *pg, char **keys, char **vals, int n) {
    nb_status st = NB_OK;
    for (int i = 0; i < n && st == NB_OK; i += NB_STORE_MAX_KEYS) {
        int m = n - i < NB_STORE_MAX_KEYS ? n - i : NB_STORE_MAX_KEYS;
        st = nb__store_mget(pg->store_main, (const char *const *)keys + i, m, vals + i);
    }
    return st;
}

/* The WORLD_SIZE a join record states (0 when it states none). */
static long record_world(const char *v) {
    const char *w = v ? strstr(v, " world=") : NULL;
    return w ? strtol(w + 7, NULL, 10) : 0;
}

/* After the join failed (status `st`, nb_last_error() its message): says
 * so (nb/join/seen/<rank>), and, on rank 0, which serves the store, waits
 * until `until` at most for every other rank of its world not in `skip`
 * (NULL: none) to say so too (those still starting included), so that they
 * read the records or the reason (JOIN_ABORT_KEY) that show it before the
 * store goes away with this process. Returns `st` with the message kept. */
static nb_status join_linger(nb_pg *pg, nb_status st, double until, const bool *skip, int beyond) {
    char msg[NB__MSG_LEN], key[64];
    snprintf(msg, sizeof msg, "%s", nb_last_error());
    snprintf(key, sizeof key, "nb/join/seen/%d", pg->rank);
    nb_store_set(pg->store_main, key, "1", 1);
    if (pg->rank == 0) {
        for (int r = 1; r < pg->size; r++) {
            double left = until - nb__now();
            if (left <= 0) break;
            if (skip && skip[r]) continue;
            snprintf(key, sizeof key, "nb/join/seen/%d", r);
            const char *k = key;
            if (nb_store_wait(pg->store_main, &k, 1, left) != NB_OK) break;
        }
        /* ranks beyond this world cannot say it: the store tells each its world when it refuses it */
        while (pg->server && beyond > 0 && nb__store_server_beyond(pg->server) < (uint64_t)beyond &&
               nb__now() < until)
            nb__sleep(0.02);
    }
    return nb_set_error(st, "%s", msg);
}

/* Rank 0 ends the join for every rank: publishes why (the thread's last
 * error) under JOIN_ABORT_KEY, which the others read at their next poll,
 * and lingers until they have. */
static nb_status join_end(nb_pg *pg, nb_status st, double until, const bool *skip) {
    const char *msg = nb_last_error();
    nb_store_set(pg->store_main, JOIN_ABORT_KEY, msg, strlen(msg));
    return join_linger(pg, st, until, skip, 0);
}

/* How long rank 0 lingers after a disagreement: a little, within the join limit. */
static double linger_until(double deadline) {
    double until = nb__now() + JOIN_LINGER_S;
    return until < deadline ? until : deadline;
}

/* Rank 0, which serves the store: the HELLOs its store refused for another
 * run id since the last look (Note [Joining]). A claimed rank still missing
 * fails the join (NB_ERR_MISMATCH, the status; *claimed: that rank); any
 * other is said on stderr (at most JOIN_STRAYS_SAID lines) and kept in
 * `stray` for the timeout message. */
static nb_status join_refusals(nb_pg *pg, const bool *missing, uint64_t *seen, int *said, char *stray,
                               size_t len, int *claimed) {
    nb__store_refusal rf[NB__STORE_REFUSALS_KEPT];
    int k = pg->server ? nb__store_server_refusals(pg->server, seen, rf, NB__STORE_REFUSALS_KEPT) : 0;
    for (int i = 0; i < k; i++) {
        const nb__store_refusal *f = &rf[i];
        bool in_world = f->rank >= 0 && f->rank < pg->size;
        /* with a secret, anyone on the network may have sent it: said, not trusted */
        if (in_world && f->rank != pg->rank && missing[f->rank] && !pg->store_secret) {
            *claimed = (int)f->rank;
            return nb_set_error(NB_ERR_MISMATCH,
                                "nb_pg_init: rank %lld tried to join with run id '%s', this run's is '%s' "
                                "(from %s; its store connection was refused); start every rank with the "
                                "same run id (NABLA_RUN_ID)",
                                (long long)f->rank, f->run_id, pg->env.run_id, f->peer);
        }
        snprintf(stray, len, "; a process at %s tried to join as rank %lld with run id '%s', this run's is '%s' "
                 "(refused)", f->peer, (long long)f->rank, f->run_id, pg->env.run_id);
        if (*said < JOIN_STRAYS_SAID)
            fprintf(stderr,
                    "nabla: rank %d: rank %lld tried to join with run id '%s', this run's is '%s' (from %s); "
                    "refused, and ignored: %s\n",
                    pg->rank, (long long)f->rank, f->run_id, pg->env.run_id, f->peer,
                    !in_world ? "not a rank of this run"
                    : f->rank == pg->rank || !missing[f->rank] ? "that rank has already joined"
                    : "the store has a secret and the refused process did not prove it, so its claim "
                      "to be that rank is not trusted");
        else if (*said == JOIN_STRAYS_SAID)
            fprintf(stderr, "nabla: rank %d: more processes of other runs were refused; not said\n", pg->rank);
        (*said)++;
    }
    return NB_OK;
}

/* Rank 0, which serves the store (Note [Joining]): what its store saw of
 * the missing ranks, appended to `out`: those no process ever connected
 * as, and the connections that never proved they belong to the run. */
static void join_seen(nb_pg *pg, const bool *missing, char *out, size_t len) {
    if (!pg->server) return;
    int n = pg->size;
    bool *seen = calloc((size_t)n, sizeof *seen), *never = calloc((size_t)n, sizeof *never);
    NB_CHECK(seen && never, "nb_pg_init: out of memory");
    int m = nb__store_server_ranks_seen(pg->server, seen, n), count = 0;
    for (int r = 0; r < m; r++) count += never[r] = missing[r] && !seen[r];
    if (count) {
        char who[512] = "";
        list_ranks(never, n, who, sizeof who);
        size_t u = strlen(out);
        snprintf(out + u, len - u, "; no process has connected to the store as rank%s %s: %s not started, or "
                 "started with another MASTER_ADDR (%s) or MASTER_PORT (%d)", count == 1 ? "" : "s", who,
                 count == 1 ? "it is" : "they are", pg->env.master_addr, pg->env.master_port);
    }
    char unproven[800];
    if (nb__store_server_unproven(pg->server, unproven, sizeof unproven)) {
        size_t u = strlen(out);
        snprintf(out + u, len - u, "; the store closed %s", unproven);
    }
    free(seen);
    free(never);
}

/* Note [Joining]: every rank registers "host pid world=W" under
 * nb/join/<rank> and polls all ranks' records (each second, up to 5 s in
 * worlds over 64 ranks; waking early when they arrive) until every rank
 * below its WORLD_SIZE has registered.
 * A record that states another WORLD_SIZE fails the join at once, on every
 * rank that reads it: both values named, not a wait for a rank that will
 * never come, nor a Gloo connection that cannot be made. Rank 0, which
 * serves the store, then waits up to 5 s for the other ranks of its world,
 * started or still starting, to read the records that show it before it
 * leaves (join_linger). A rank whose RANK lies beyond rank 0's WORLD_SIZE
 * is refused by the store, which tells it the world's ranks and size (its
 * own WORLD_SIZE is added to the message); when a record of rank 0's
 * world states a larger WORLD_SIZE, rank 0 also waits (within those 5 s)
 * until its store has refused that many ranks beyond its world, so they
 * hear it before the store goes. Ranks beyond the world when every record
 * agrees (ranks 0 and 1 with WORLD_SIZE=2, rank 2 with 3) are refused
 * too, but the world they meet is complete and goes on (a launcher stops
 * it when the refused rank fails).
 * The run id needs no record: the store refuses a process of another run
 * when it connects, telling it only its own id (Note [Store
 * authentication]), and rank 0 reads the refusals of its own store at each
 * poll (join_refusals): one claiming a rank still missing fails rank 0's
 * join at once, naming both ids, so that a misconfigured rank costs
 * seconds, not the join timeout; one claiming a rank outside the world or
 * one already joined is said and ignored (only a registered rank can stop
 * the run). Failing early trusts the refused process's claim to be that
 * rank, so it is done only where the store has no secret: such a store
 * is reached only by the user's own processes (a Unix-domain socket, Note
 * [Store on one node] in store_unix.c), on loopback, or on a network
 * declared trusted, and the
 * misconfiguration it catches is a hand launch's (nbrun gives every rank
 * the same run id and a secret). With a secret the claim is said on stderr
 * and named in the timeout message, never trusted: a peer that can reach
 * the port cannot end the join.
 * The other ranks cannot read rank 0's refusals, so rank 0 publishes what
 * it learns in the store: when it ends the join (a refusal it trusts, or
 * its own timeout), the message under nb/join/abort, which every waiting
 * rank reads at its next poll and fails with ("rank 0 ended the join:
 * ..."), and rank 0 lingers until the ranks that joined have said so
 * (nb/join/seen/<rank>), rather than leave them to find its store gone;
 * an untrusted claim, said only, under nb/join/stray, which the others'
 * timeout messages name as rank 0's does. So in a world of any size every
 * rank that joined names both run ids; the refused process names its own
 * only (the store never tells an unproven process the run's id). Every
 * 20 s (every third of NABLA_JOIN_TIMEOUT when that is shorter) a waiting
 * rank says on stderr which ranks it still waits for, so a slow start is
 * not silent until the timeout; the first comes after 5 s at most, and on
 * rank 0 it says what its store saw (join_seen): the ranks no process has
 * connected as (nothing started for them: a launcher that failed, a node
 * never started, another MASTER_PORT), and the connections that never
 * proved they belong to the run (Note [Admission under a flood] in
 * store_server.c), which the timeout message repeats. */
nb_status nb__join(nb_pg *pg) {
    const nb_dist_env *e = &pg->env;
    char host[256] = "?", key[64], val[320];
    gethostname(host, sizeof host - 1);
    snprintf(key, sizeof key, "nb/join/%d", pg->rank);
    int vn = snprintf(val, sizeof val, "%s %ld world=%d", host, (long)getpid(), pg->size);
    nb_status st = nb_store_set(pg->store_main, key, val, (size_t)vn);
    if (st != NB_OK) return st;
    int n = pg->size;
    /* the records, then what rank 0 publishes for the others (JOIN_ABORT_KEY, JOIN_STRAY_KEY) */
    char **keys = malloc((size_t)(n + 2) * sizeof *keys), **vals = calloc((size_t)n + 2, sizeof *vals);
    char *buf = malloc((size_t)n * 32);
    bool *missing = calloc((size_t)n, sizeof *missing), *joined = calloc((size_t)n, sizeof *joined);
    NB_CHECK(keys && vals && buf && missing && joined, "nb_pg_init: out of memory");
    for (int r = 0; r < n; r++) {
        keys[r] = buf + (size_t)r * 32;
        snprintf(keys[r], 32, "nb/join/%d", r);
    }
    keys[n] = (char *)JOIN_ABORT_KEY;
    keys[n + 1] = (char *)JOIN_STRAY_KEY;
    double t0 = nb__now(), deadline = t0 + pg->join_s;
    double every = pg->join_s / 3 < JOIN_NOTE_S ? pg->join_s / 3 : JOIN_NOTE_S;
    double next_note = t0 + (every < JOIN_FIRST_NOTE_S ? every : JOIN_FIRST_NOTE_S);
    uint64_t refusals_seen = 0;
    int strays_said = 0;
    char stray[320] = "", stray_said[320] = "";
    nb_status lost = NB_OK; /* the wait failed: one last look at the records */
    char lost_msg[NB__MSG_LEN];
    for (;;) {
        st = join_records(pg, keys, vals, n + 2);
        if (st != NB_OK && lost != NB_OK) st = nb_set_error(lost, "%s", lost_msg);
        if (st != NB_OK) break;
        int nmiss = 0, other = -1;
        for (int r = 0; r < n; r++) {
            missing[r] = vals[r] == NULL;
            joined[r] = !missing[r];
            nmiss += missing[r];
            if (other < 0 && vals[r] && record_world(vals[r]) != n) other = r;
        }
        if (vals[n] && pg->rank != 0) {
            /* rank 0 read a refusal that fails the join (join_refusals) */
            const char *why = vals[n];
            if (strncmp(why, "nb_pg_init: ", 12) == 0) why += 12;
            st = nb_set_error(NB_ERR_MISMATCH, "nb_pg_init: rank 0 ended the join: %s", why);
            st = join_linger(pg, st, nb__now(), NULL, 0);
            break;
        }
        if (vals[n + 1] && pg->rank != 0) snprintf(stray, sizeof stray, "%s", vals[n + 1]);
        if (other >= 0) {
            char who[1024] = "";
            int listed = 0;
            for (int r = 0; r < n && listed < 8; r++) {
                long w = record_world(vals[r]);
                if (!vals[r] || w == n) continue;
                char host_r[256] = "?";
                long pid = 0;
                sscanf(vals[r], "%255s %ld", host_r, &pid);
                size_t u = strlen(who);
                snprintf(who + u, sizeof who - u, "%srank %d (host %s, pid %ld) has WORLD_SIZE=%ld", listed ? ", " : "",
                         r, host_r, pid, w);
                listed++;
            }
            st = nb_set_error(NB_ERR_MISMATCH,
                              "nb_pg_init: ranks disagree on WORLD_SIZE: this process (rank %d) has WORLD_SIZE=%d but "
                              "%s; start every rank with the same WORLD_SIZE",
                              pg->rank, n, who);
            /* the ranks from n to the largest WORLD_SIZE stated are refused by this store */
            long most = n;
            for (int r = 0; r < n; r++)
                if (vals[r] && record_world(vals[r]) > most) most = record_world(vals[r]);
            st = join_linger(pg, st, linger_until(deadline), NULL, (int)(most - n));
            break;
        }
        int claimed = -1;
        st = join_refusals(pg, missing, &refusals_seen, &strays_said, stray, sizeof stray, &claimed);
        if (st != NB_OK) {
            /* the others wait for the claimed rank too: they read why from the store */
            memset(missing, 0, (size_t)n * sizeof *missing);
            missing[claimed] = true;
            st = join_end(pg, st, linger_until(deadline), missing);
            break;
        }
        if (pg->rank == 0 && strcmp(stray, stray_said) != 0) {
            /* said, never trusted: the others' timeout messages name it too */
            snprintf(stray_said, sizeof stray_said, "%s", stray);
            nb_store_set(pg->store_main, JOIN_STRAY_KEY, stray, strlen(stray));
        }
        if (lost != NB_OK) {
            st = nb_set_error(lost, "%s", lost_msg);
            break;
        }
        if (nmiss == 0) break;
        double now = nb__now();
        char who[512] = "", in[512] = "";
        list_ranks(missing, n, who, sizeof who);
        list_ranks(joined, n, in, sizeof in);
        char seen[1600] = "";
        if (now >= deadline || now >= next_note) join_seen(pg, missing, seen, sizeof seen);
        if (now >= deadline) {
            st = nb_set_error(NB_ERR_TIMEOUT,
                              "nb_pg_init: rank%s %s of %d never joined within %.1f s (joined: rank%s "
                              "%s); start every rank with the same MASTER_ADDR (%s), MASTER_PORT (%d), "
                              "WORLD_SIZE (%d) and run id (%s), each with its own RANK; "
                              "NABLA_JOIN_TIMEOUT sets how long to wait%s%s",
                              nmiss == 1 ? "" : "s", who, n, pg->join_s, n - nmiss == 1 ? "" : "s", in,
                              e->master_addr, e->master_port, n, e->run_id, stray, seen);
            /* the ranks that joined hear it from rank 0 rather than lose its store */
            st = pg->rank == 0 ? join_end(pg, st, nb__now() + JOIN_LINGER_S, missing)
                               : join_linger(pg, st, nb__now(), NULL, 0);
            break;
        }
        if (now >= next_note) {
            fprintf(stderr,
                    "nabla: rank %d: still waiting for rank%s %s of %d to join (%.0f s of NABLA_JOIN_TIMEOUT=%g s; "
                    "joined: rank%s %s)%s\n",
                    pg->rank, nmiss == 1 ? "" : "s", who, n, now - t0, pg->join_s, n - nmiss == 1 ? "" : "s", in,
                    seen);
            next_note = (next_note - t0 < every ? t0 : next_note) + every;
        }
        for (int r = 0; r < n + 2; r++) {
            free(vals[r]);
            vals[r] = NULL;
        }
        /* Sleep until the first missing ranks arrive or the next poll. */
        const char *wait_keys[NB_STORE_MAX_KEYS];
        int m = 0;
        for (int r = 0; r < n && m < NB_STORE_MAX_KEYS; r++)
            if (missing[r]) wait_keys[m++] = keys[r];
        /* Each poll reads n records: a large world polls less often. */
        double left = deadline - now, slice = n > 64 ? JOIN_POLL_S * n / 64 : JOIN_POLL_S;
        if (slice > 5 * JOIN_POLL_S) slice = 5 * JOIN_POLL_S;
        if (next_note - now < slice) slice = next_note - now;
        if (left < slice) slice = left;
        st = nb_store_wait(pg->store_main, wait_keys, m, slice > 0.001 ? slice : 0.001);
        if (st != NB_OK && st != NB_ERR_TIMEOUT) {
            lost = st;
            snprintf(lost_msg, sizeof lost_msg, "%s", nb_last_error());
        }
    }
    for (int r = 0; r < n + 2; r++) free(vals[r]);
    free(vals);
    free(missing);
    free(joined);
    free(buf);
    free(keys);
    if (st == NB_OK) {
        char *w = whereabouts(pg, 0);
        snprintf(pg->store_owner, sizeof pg->store_owner, "%s", w);
        free(w);
    }
    return st;
}
