/* Hang diagnostics: the flight recorder of fingerprints, their
 * publication in the store, and the messages that name the ranks at
 * fault.
 *
 * Note [Hang diagnostics]
 * Every collective of a group gets a sequence number (1, 2, ... in issue
 * order, the same on every rank when the program is right) and a
 * fingerprint: op, reduction, dtype, count, root. When a collective
 * starts on a rank, the rank notes "<seq> <fingerprint>" in the group's
 * flight recorder, a ring of NB__FP_SLOTS entries in memory (as NCCL's
 * flight recorder): nothing leaves the process while collectives complete
 * in time (test_dist_store counts the store's fingerprint writes). A
 * rank publishes the entries it has not published yet, each under
 * nb/fp/<group>/<rank>/<seq mod 16> with a SET that expects no reply,
 * when one of its waits runs long (the watchdog's first poll, half a
 * second in) and before it writes a failure's diagnosis, which then waits
 * until the failed collective is POLL_AFTER_S + POLL_EVERY_S old on this
 * rank (1 s), so that the members waiting on it have published too.
 *
 * While a rank waits on a collective that has run for more than half a
 * second, the waiting thread polls the store every half second:
 *   - NB__STORE_ABORT_KEY set (the server saw a rank's connection drop):
 *     fail now, naming that rank (a dead peer is noticed within a second,
 *     not at the timeout);
 *   - after a second, some rank published this sequence number with a
 *     different fingerprint: fail now with both fingerprints (a desync
 *     never completes, so there is no point waiting for the timeout).
 *     The headers ranks exchange before any data (Note [Collective
 *     headers] in pg_check.c) name such a mismatch first, on every rank,
 *     wherever they are exchanged; this comparison remains for the NCCL
 *     collectives that do not exchange them (Note [Which collectives are
 *     checked] in pg_check.c) and under NABLA_DIST_CHECK=off.
 * At the timeout (measured from when the collective became the group's
 * oldest unfinished one on this rank) it fails, naming the ranks whose
 * slot does not hold this sequence number yet: they did not arrive, and
 * their newest slot says where they are, or, when newer, the collective
 * before this one, which completed here and so had every member. A rank
 * that arrived but never waited long (it issued the collective and went
 * on computing) has published nothing and is counted as not arrived. A failure inside the transport
 * (Gloo's or NCCL's own error) gets the same diagnosis appended, since
 * "connection closed by peer" alone does not say which rank died.
 *
 * After the first failure the group is broken: the failure's message is
 * the answer to every later wait on it. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/pg.h"

#define PUBLISHED_AFTER_S 1.0 /* the watchdog's first poll (pg.c) and one more */

static void fp_key(const nb_pg *pg, int rank, uint64_t seq, char *key, size_t len) {
    snprintf(key, len, NB__STORE_FP_PREFIX "%s/%d/%u", pg->name, rank, (unsigned)(seq % NB__FP_SLOTS));
}

void nb__diag_record(nb_pg *pg, const nb_work *w) {
    pthread_mutex_lock(&pg->mu);
    nb__fp_entry *e = &pg->ring[w->coll.seq % NB__FP_SLOTS];
    e->seq = w->coll.seq;
    snprintf(e->fp, sizeof e->fp, "%s", w->fingerprint);
    pthread_mutex_unlock(&pg->mu);
}

void nb__diag_publish(nb_pg *pg) {
    nb__fp_entry ring[NB__FP_SLOTS];
    pthread_mutex_lock(&pg->mu);
    memcpy(ring, pg->ring, sizeof ring);
    uint64_t from = pg->ring_published;
    pthread_mutex_unlock(&pg->mu);
    uint64_t newest = from;
    nb_pg *root = pg->root;
    pthread_mutex_lock(&root->monitor_mu);
    for (int k = 0; k < NB__FP_SLOTS; k++) {
        if (ring[k].seq <= from) continue;
        char key[160], val[256];
        fp_key(pg, pg->rank, ring[k].seq, key, sizeof key);
        int n = snprintf(val, sizeof val, "%" PRIu64 " %s", ring[k].seq, ring[k].fp);
        /* A store that is gone is reported by the waits; publishing is best effort. */
        nb__store_set_quiet(root->store_monitor, key, val, (size_t)n);
        pg->stats.published++;
        if (ring[k].seq > newest) newest = ring[k].seq;
    }
    pthread_mutex_unlock(&root->monitor_mu);
    pthread_mutex_lock(&pg->mu);
    if (newest > pg->ring_published) pg->ring_published = newest;
    pthread_mutex_unlock(&pg->mu);
}

/* The newest collective before `seq` this rank started: every member
 * entered it, or it would not have completed here (the group's works
 * complete in issue order, and `seq` is the oldest unfinished one). */
static nb__fp_entry completed_before(nb_pg *pg, uint64_t seq) {
    nb__fp_entry best = {0, ""};
    pthread_mutex_lock(&pg->mu);
    for (int k = 0; k < NB__FP_SLOTS; k++)
        if (pg->ring[k].seq < seq && pg->ring[k].seq > best.seq) best = pg->ring[k];
    pthread_mutex_unlock(&pg->mu);
    return best;
}

/* MGET on the monitor connection, in chunks of NB_STORE_MAX_KEYS. */
nb_status nb__diag_mget(nb_pg *pg, char **keys, int n, char **values) {
    nb_pg *root = pg->root;
    nb_status st = NB_OK;
    pthread_mutex_lock(&root->monitor_mu);
    for (int i = 0; i < n && st == NB_OK; i += NB_STORE_MAX_KEYS) {
        int m = n - i < NB_STORE_MAX_KEYS ? n - i : NB_STORE_MAX_KEYS;
        st = nb__store_mget(root->store_monitor, (const char *const *)keys + i, m, values + i);
    }
    pthread_mutex_unlock(&root->monitor_mu);
    return st;
}

/* The abort reason, or NULL (malloc'd). *err gets the store's failure. */
static char *abort_reason(nb_pg *pg, nb_status *err) {
    char *key = (char *)NB__STORE_ABORT_KEY, *val = NULL;
    *err = nb__diag_mget(pg, &key, 1, &val);
    return val;
}

typedef struct slot {
    bool present;
    uint64_t seq;
    const char *fp; /* points into the value */
} slot;

static slot parse_slot(const char *v) {
    slot s = {false, 0, ""};
    if (!v) return s;
    char *end;
    s.seq = strtoull(v, &end, 10);
    if (end == v || *end != ' ') return s;
    s.present = true;
    s.fp = end + 1;
    return s;
}

/* Fetches every member's slot for `seq`; values[] are the raw strings. */
static nb_status fetch_slots(nb_pg *pg, uint64_t seq, char **values) {
    int n = pg->size;
    char **keys = malloc((size_t)n * sizeof *keys);
    char *buf = malloc((size_t)n * 160);
    NB_CHECK(keys && buf, "nb_pg: out of memory for diagnostics");
    for (int r = 0; r < n; r++) {
        keys[r] = buf + (size_t)r * 160;
        fp_key(pg, r, seq, keys[r], 160);
    }
    nb_status st = nb__diag_mget(pg, keys, n, values);
    free(buf);
    free(keys);
    return st;
}

/* " (world rank 5)" for a subgroup member, "" in the world group. */
static void world_note(const nb_pg *pg, int r, char *buf, size_t len) {
    if (pg->parent && pg->global[r] != r) snprintf(buf, len, " (world rank %d)", pg->global[r]);
    else buf[0] = 0;
}

/* Appends "rank 2" or "ranks 0, 1, 3" for the members flagged in `sel`. */
static void append_ranks(const nb_pg *pg, const bool *sel, char *out, size_t len) {
    int count = 0;
    for (int r = 0; r < pg->size; r++) count += sel[r];
    size_t used = strlen(out);
    used += (size_t)snprintf(out + used, used < len ? len - used : 0, "%s", count == 1 ? "rank " : "ranks ");
    int listed = 0;
    for (int r = 0; r < pg->size && used < len; r++) {
        if (!sel[r]) continue;
        if (listed == 16) {
            snprintf(out + used, len - used, " and %d more", count - listed);
            return;
        }
        char note[48];
        world_note(pg, r, note, sizeof note);
        used += (size_t)snprintf(out + used, len - used, "%s%d%s", listed ? ", " : "", r, note);
        listed++;
    }
}

#define APPEND(...)                                                                    \
    do {                                                                               \
        size_t u_ = strlen(out);                                                       \
        if (u_ < len) snprintf(out + u_, len - u_, __VA_ARGS__);                       \
    } while (0)

/* Appends "its last collective on this group was #N fingerprint" for
 * member r, which did not arrive at `seq`: the newest of its published
 * slots, or, when newer, the collective before `seq` that completed here
 * (a member that never waited long published nothing). */
static void last_collective(nb_pg *pg, int r, uint64_t seq, char *out, size_t len) {
    char *keys[NB__FP_SLOTS], *vals[NB__FP_SLOTS], buf[NB__FP_SLOTS][160];
    for (int k = 0; k < NB__FP_SLOTS; k++) {
        keys[k] = buf[k];
        snprintf(buf[k], sizeof buf[k], NB__STORE_FP_PREFIX "%s/%d/%d", pg->name, r, k);
    }
    if (nb__diag_mget(pg, keys, NB__FP_SLOTS, vals) != NB_OK) return;
    slot best = {false, 0, ""};
    int best_k = -1;
    for (int k = 0; k < NB__FP_SLOTS; k++) {
        slot s = parse_slot(vals[k]);
        if (s.present && (!best.present || s.seq > best.seq)) {
            best = s;
            best_k = k;
        }
    }
    nb__fp_entry here = completed_before(pg, seq);
    if (here.seq > 0 && (best_k < 0 || here.seq > best.seq))
        APPEND("its last collective on this group was #%" PRIu64 " %s", here.seq, here.fp);
    else if (best_k < 0) APPEND("it has not started any collective on this group");
    else APPEND("its last collective on this group was #%" PRIu64 " %s", best.seq, best.fp);
    for (int k = 0; k < NB__FP_SLOTS; k++) free(vals[k]);
}

/* Where a rank that did not arrive is: the newest of its slots. */
static void describe_absent(nb_pg *pg, int r, uint64_t seq, char *out, size_t len) {
    char last[400] = "";
    last_collective(pg, r, seq, last, sizeof last);
    if (*last) APPEND(" (%s)", last);
}

void nb__diag_explain(nb_pg *pg, const nb_work *w, const char *what, char *out, size_t len) {
    uint64_t seq = w->coll.seq;
    snprintf(out, len, "nb_pg_%s: collective #%" PRIu64 " %s on group '%s' (rank %d of %d) %s",
             nb__coll_name(w->coll.kind), seq, w->fingerprint, pg->name, pg->rank, pg->size, what);

    nb_status err;
    char *reason = abort_reason(pg, &err);
    if (!reason && err == NB_OK && strstr(what, "transport")) {
        /* A dead peer shows in the transport and in the store at about the
         * same moment; give the store a second to say which rank it was. */
        for (int i = 0; i < 10 && !reason && err == NB_OK; i++) {
            nb__sleep(0.1);
            reason = abort_reason(pg, &err);
        }
    }
    if (err != NB_OK) {
        if (!strstr(what, "the store is unreachable"))
            APPEND("; the store is unreachable too (%s)", nb_last_error());
        return;
    }
    if (reason) APPEND("; the run was aborted: %s", reason);
    free(reason);

    /* Note [Hang diagnostics]: this rank's fingerprints, and time for the
     * members waiting on w to publish theirs. */
    nb__diag_publish(pg);
    double age = nb__now() - w->t_start;
    if (age < PUBLISHED_AFTER_S) nb__sleep(PUBLISHED_AFTER_S - age);

    int n = pg->size;
    char **vals = calloc((size_t)n, sizeof *vals);
    bool *sel = calloc((size_t)n, sizeof *sel);
    bool *seen = calloc((size_t)n, sizeof *seen);
    NB_CHECK(vals && sel && seen, "nb_pg: out of memory for diagnostics");
    if (fetch_slots(pg, seq, vals) != NB_OK) {
        APPEND("; cannot read the other ranks' fingerprints (%s)", nb_last_error());
        goto done;
    }
    /* Ranks that arrived, grouped by fingerprint; first the groups that
     * disagree with this rank. */
    bool disagree = false;
    for (int r = 0; r < n; r++) {
        slot s = parse_slot(vals[r]);
        if (s.present && s.seq == seq && strcmp(s.fp, w->fingerprint) != 0) disagree = true;
    }
    if (disagree) {
        APPEND("; ranks disagree on collective #%" PRIu64 ":", seq);
        bool first = true;
        for (int r = 0; r < n; r++) {
            slot s = parse_slot(vals[r]);
            if (seen[r] || !s.present || s.seq != seq) continue;
            memset(sel, 0, (size_t)n * sizeof *sel);
            for (int q = r; q < n; q++) {
                slot t = parse_slot(vals[q]);
                if (!seen[q] && t.present && t.seq == seq && strcmp(t.fp, s.fp) == 0) sel[q] = seen[q] = true;
            }
            APPEND("%s ", first ? "" : ";");
            append_ranks(pg, sel, out, len);
            APPEND(" issued %s", s.fp);
            first = false;
        }
    }
    int absent = 0, described = 0;
    for (int r = 0; r < n; r++) {
        slot s = parse_slot(vals[r]);
        if (s.present && s.seq >= seq) continue;
        absent++;
        if (described < 8) {
            char note[48];
            world_note(pg, r, note, sizeof note);
            APPEND("; rank %d%s did not arrive", r, note);
            describe_absent(pg, r, seq, out, len);
            described++;
        }
    }
    if (absent > described) APPEND("; %d more ranks did not arrive", absent - described);
    if (!disagree && absent == 0)
        APPEND("; every rank arrived at it with the same fingerprint");
    else if (!disagree && absent < n) {
        memset(sel, 0, (size_t)n * sizeof *sel);
        for (int r = 0; r < n; r++) {
            slot s = parse_slot(vals[r]);
            sel[r] = s.present && s.seq == seq;
        }
        APPEND("; arrived: ");
        append_ranks(pg, sel, out, len);
    }
done:
    for (int r = 0; r < n; r++) free(vals[r]);
    free(vals);
    free(sel);
    free(seen);
}

/* "count", "dtype and count", ...: the fields in which headers a and b differ. */
static void header_diff(const nb__coll *a, const nb__coll *b, char *out, size_t len) {
    const char *names[4];
    int n = 0;
    if (a->op != b->op) names[n++] = "reduction";
    if (a->dtype != b->dtype) names[n++] = "dtype";
    if (a->count != b->count) names[n++] = "count";
    if (a->root != b->root) names[n++] = "root";
    out[0] = 0;
    for (int i = 0; i < n; i++)
        APPEND("%s%s", i == 0 ? "" : i == n - 1 ? " and " : ", ", names[i]);
}

void nb__diag_mismatch(nb_pg *pg, const nb_work *w, const int64_t *headers, char *out, size_t len) {
    int n = pg->size;
    uint64_t seq = w->coll.seq;
    snprintf(out, len,
             "nb_pg_%s: collective #%" PRIu64 " %s on group '%s' (rank %d of %d) cannot run; ranks disagree on "
             "collective #%" PRIu64 ":",
             nb__coll_name(w->coll.kind), seq, w->fingerprint, pg->name, pg->rank, pg->size, seq);
    nb__coll *colls = calloc((size_t)n, sizeof *colls);
    bool *valid = calloc((size_t)n, sizeof *valid), *sel = calloc((size_t)n, sizeof *sel);
    bool *seen = calloc((size_t)n, sizeof *seen);
    NB_CHECK(colls && valid && sel && seen, "nb_pg: out of memory for diagnostics");
    for (int r = 0; r < n; r++) valid[r] = nb__coll_from_header(headers + (size_t)r * NB__COLL_HEADER_WORDS, &colls[r]);
    /* Ranks grouped by what they issued, in order of their lowest rank. */
    int groups = 0;
    bool same_kind = true;
    for (int r = 0; r < n; r++) {
        if (seen[r]) continue;
        const int64_t *h = headers + (size_t)r * NB__COLL_HEADER_WORDS;
        memset(sel, 0, (size_t)n * sizeof *sel);
        for (int q = r; q < n; q++)
            if (!seen[q] && memcmp(headers + (size_t)q * NB__COLL_HEADER_WORDS, h,
                                   NB__COLL_HEADER_WORDS * sizeof *h) == 0)
                sel[q] = seen[q] = true;
        APPEND("%s ", groups ? ";" : "");
        append_ranks(pg, sel, out, len);
        if (valid[r]) {
            char fp[160];
            nb__coll_fingerprint(&colls[r], fp, sizeof fp);
            APPEND(" issued %s", fp);
            same_kind = same_kind && colls[r].kind == colls[0].kind;
        } else {
            APPEND(" sent a header this nabla does not read (a different build of nabla?)");
            same_kind = false;
        }
        groups++;
    }
    if (same_kind) {
        /* Every field in which some rank differs from rank 0. */
        nb__coll any = colls[0];
        for (int r = 1; r < n; r++) {
            if (colls[r].op != colls[0].op) any.op = (nb_reduce_op)-1;
            if (colls[r].dtype != colls[0].dtype) any.dtype = (nb_dtype)-1;
            if (colls[r].count != colls[0].count) any.count = -1;
            if (colls[r].root != colls[0].root) any.root = -1;
        }
        char diff[64];
        header_diff(&colls[0], &any, diff, sizeof diff);
        APPEND(" (they differ in %s)", diff);
    } else {
        APPEND(" (different collectives)");
    }
    APPEND("; no data was exchanged");
    free(colls);
    free(valid);
    free(sel);
    free(seen);
}

nb_status nb__diag_headers(nb_pg *pg, const nb_work *w, const int64_t *headers, char *out, size_t len) {
    int64_t mine[NB__COLL_HEADER_WORDS];
    nb__coll_header(&w->coll, mine);
    for (int r = 0; r < pg->size; r++)
        if (memcmp(headers + (size_t)r * NB__COLL_HEADER_WORDS, mine, sizeof mine) != 0) {
            nb__diag_mismatch(pg, w, headers, out, len);
            return NB_ERR_MISMATCH;
        }
    return NB_OK;
}

void nb__diag_store_lost(nb_pg *pg, char *what, size_t len) {
    const char *owner = pg->root->store_owner;
    snprintf(what, len, "could not complete: the store is unreachable (%s)%s%s", nb_last_error(),
             *owner ? "; rank 0 runs on " : "", owner);
}

nb_status nb__diag_check(nb_pg *pg, const nb_work *w, bool check_desync, char *what, size_t len) {
    nb_status err;
    char *reason = abort_reason(pg, &err);
    if (err != NB_OK) {
        nb__diag_store_lost(pg, what, len);
        return err;
    }
    if (reason) {
        free(reason);
        snprintf(what, len, "could not complete");
        return NB_ERR_CLOSED;
    }
    if (!check_desync) return NB_OK;
    int n = pg->size;
    char **vals = calloc((size_t)n, sizeof *vals);
    NB_CHECK(vals != NULL, "nb_pg: out of memory for diagnostics");
    nb_status st = NB_OK;
    if (fetch_slots(pg, w->coll.seq, vals) == NB_OK) {
        for (int r = 0; r < n; r++) {
            slot s = parse_slot(vals[r]);
            if (s.present && s.seq == w->coll.seq && strcmp(s.fp, w->fingerprint) != 0) {
                snprintf(what, len, "cannot complete");
                st = NB_ERR_MISMATCH;
            }
        }
    }
    for (int r = 0; r < n; r++) free(vals[r]);
    free(vals);
    return st;
}
