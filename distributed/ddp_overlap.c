/* Overlap of communication with backward measured across ranks
 * (nb_ddp_overlap_across_ranks): every rank's recorded steps on one clock,
 * the time a bucket's collective waits for a later rank told apart from
 * the communication itself.
 *
 * Note [Overlap across ranks]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * A rank's own figures (nb_ddp_step_stats, ddp_stats.c) time bucket b's
 * collective from its start S to its finish F on that rank and call hidden
 * the part before the rank's own end of backward E. When ranks' backward
 * passes end at different times (uneven load, a noisy machine, a slower
 * device), a collective cannot finish before the last rank has launched
 * it, so the faster rank counts the wait for the slower one as
 * communication, and as exposed once its own backward is over, although
 * the job's backward (the slowest rank's) is still running. On a 2-core
 * machine the ranks' backward passes ended 4-35 ms apart, and that wait,
 * not the network, made most of the "exposed" time (benchmarks/RESULTS.md).
 *
 * With every rank's launch times L, S, F and E on one clock:
 *   ready_b = max over ranks of L_b         (the bucket is launched everywhere)
 *   T       = max over ranks of E           (the job's backward has ended)
 *   wait    = min(ready_b, F) - S, at least 0       (peer_wait_s)
 *   comm    = F - max(S, ready_b), at least 0       (the communication proper)
 *   hidden  = the part of [max(S, ready_b), F] before T
 * summed over ranks, steps and buckets; hidden_fraction = hidden / comm,
 * own_hidden_fraction = (the part of [S, F] before E) / (F - S), pooled the
 * same way.
 *
 * One clock: processes under one kernel share CLOCK_MONOTONIC (the ranks
 * compare /proc/sys/kernel/random/boot_id, or the host name where it is
 * unreadable); then the offsets are 0. Across hosts, rank r's offset from
 * rank 0 is the median over NB_BARRIERS barriers of the difference of the
 * times at which each rank left the barrier: right to about the time a
 * barrier's last message takes to reach every rank; clock_error_s reports
 * the largest distance of a barrier's difference from that median.
 *
 * The records travel through the store (the group's device may be a GPU,
 * the records are host data): one key per rank, read by all, deleted by
 * its owner after a barrier.
 *
 * The recording is a feature of the reducer (Note [DDP hook points] in
 * ddp.c), attached at construction with record_timeline when the wrapper
 * has buckets: it keeps each synchronised step's timeline (sync_end). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "distributed/ddp_internal.h"
#include "util/handle.h"

#define NB_BARRIERS 5
#define MAGIC "nbovl01"
#define MAX_STEPS 1024 /* between two nb_ddp_overlap_across_ranks */

typedef struct overlap_state {
    trace_step *steps; /* MAX_STEPS (malloc'd on first use) */
    int n, lost, calls;
} overlap_state;

size_t nb__ddp_overlap_record_cap = 0;

typedef struct head {
    char magic[8];
    char host[64]; /* boot id, or host name */
    int32_t steps, lost;
    double left[NB_BARRIERS]; /* when this rank left each barrier */
} head;

/* ---- recording ---- */

static void overlap_sync_end(nb_ddp *d, void *self, double done) {
    overlap_state *o = self;
    if (o->n == MAX_STEPS) {
        o->lost++;
        return;
    }
    if (!o->steps) o->steps = nb__ddp_calloc(MAX_STEPS, sizeof *o->steps);
    nb__ddp_step_timeline(d, done, &o->steps[o->n++]);
}

static void drop_steps(overlap_state *o) {
    for (int i = 0; i < o->n; i++) {
        free(o->steps[i].b);
        o->steps[i].b = NULL;
    }
    o->n = 0;
    o->lost = 0;
}

static void overlap_free(nb_ddp *d, void *self) {
    (void)d;
    overlap_state *o = self;
    drop_steps(o);
    free(o->steps);
    free(o);
}

static const nb__ddp_hooks overlap_hooks = {
    .name = "the overlap record",
    .sync_end = overlap_sync_end,
    .free = overlap_free,
};

void nb__ddp_overlap_attach(nb_ddp *d) {
    nb__ddp_attach(d, NB__DDP_OVERLAP, &overlap_hooks, nb__ddp_calloc(1, sizeof(overlap_state)));
}

/* ---- the figures ---- */

static double clamp0(double x) { return x > 0 ? x : 0; }

void nb__ddp_overlap_compute(int world, int steps, trace_step *const *steps_of, const double *offset,
                             nb_ddp_overlap *out) {
    double skew = 0, comm_raw = 0, wait = 0, comm = 0, hidden = 0, own_hidden = 0;
    for (int s = 0; s < steps; s++) {
        int nb = steps_of[0][s].n;
        double first_end = 0, last_end = 0;
        for (int r = 0; r < world; r++) {
            double e = steps_of[r][s].bw_end - offset[r];
            if (r == 0 || e < first_end) first_end = e;
            if (r == 0 || e > last_end) last_end = e;
        }
        skew += last_end - first_end;
        for (int b = 0; b < nb; b++) {
            double ready = 0;
            for (int r = 0; r < world; r++) {
                double l = steps_of[r][s].b[b].launch - offset[r];
                if (r == 0 || l > ready) ready = l;
            }
            for (int r = 0; r < world; r++) {
                const nb_ddp_bucket_time *t = &steps_of[r][s].b[b];
                double S = t->start - offset[r], F = t->finish - offset[r];
                double E = steps_of[r][s].bw_end - offset[r];
                double from = S > ready ? S : ready;
                comm_raw += clamp0(F - S);
                wait += clamp0((ready < F ? ready : F) - S);
                comm += clamp0(F - from);
                hidden += clamp0((F < last_end ? F : last_end) - from);
                own_hidden += clamp0((F < E ? F : E) - S);
            }
        }
    }
    double per = steps > 0 ? (double)steps * world : 1;
    out->steps = steps;
    out->skew_s = steps > 0 ? skew / steps : 0;
    out->comm_s = comm_raw / per;
    out->peer_wait_s = wait / per;
    out->hidden_fraction = comm > 0 ? hidden / comm : 0;
    out->own_hidden_fraction = comm_raw > 0 ? own_hidden / comm_raw : 0;
}

/* ---- the exchange ---- */

static void clock_id(char *out, size_t cap) {
    memset(out, 0, cap);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        size_t n = fread(out, 1, cap - 1, f);
        fclose(f);
        while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == ' ')) out[--n] = 0;
        if (n > 0) return;
    }
    memcpy(out, "host:", 5);
    if (gethostname(out + 5, cap - 6) != 0) out[5] = 0;
    out[cap - 1] = 0;
}

/* This rank's record: head, then per step n, bw_end and n (launch, start,
 * finish) triples, as doubles. One over the store's limit is sent as its
 * head alone with steps -1, so that every rank fails alike instead of
 * waiting for it. */
static char *pack(const overlap_state *o, const double *left, size_t *len, size_t *full) {
    size_t n = sizeof(head);
    for (int s = 0; s < o->n; s++) n += sizeof(double) * (2 + 3 * (size_t)o->steps[s].n);
    *full = n;
    bool over = n > (nb__ddp_overlap_record_cap ? nb__ddp_overlap_record_cap : NB_STORE_MAX_VALUE);
    if (over) n = sizeof(head);
    char *buf = nb__ddp_calloc(n, 1);
    head h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, MAGIC, sizeof h.magic);
    clock_id(h.host, sizeof h.host);
    h.steps = over ? -1 : o->n;
    h.lost = o->lost;
    memcpy(h.left, left, sizeof h.left);
    memcpy(buf, &h, sizeof h);
    *len = n;
    if (over) return buf;
    double *p = (double *)(buf + sizeof h);
    for (int s = 0; s < o->n; s++) {
        *p++ = o->steps[s].n;
        *p++ = o->steps[s].bw_end;
        for (int b = 0; b < o->steps[s].n; b++) {
            *p++ = o->steps[s].b[b].launch;
            *p++ = o->steps[s].b[b].start;
            *p++ = o->steps[s].b[b].finish;
        }
    }
    return buf;
}

/* Rank r's record into its head and steps (malloc'd; none for steps -1);
 * false if malformed. */
static bool unpack(const char *buf, size_t len, head *h, trace_step **steps) {
    if (len < sizeof *h) return false;
    memcpy(h, buf, sizeof *h);
    if (memcmp(h->magic, MAGIC, sizeof h->magic) != 0 || h->steps < -1 || h->steps > MAX_STEPS)
        return false;
    if (h->steps == -1) return len == sizeof *h;
    h->host[sizeof h->host - 1] = 0;
    size_t at = sizeof *h, nd = (len - at) / sizeof(double);
    if ((len - at) % sizeof(double) != 0) return false;
    double *v = nb__ddp_calloc(nd ? nd : 1, sizeof *v);
    memcpy(v, buf + at, nd * sizeof *v);
    trace_step *st = nb__ddp_calloc((size_t)h->steps + 1, sizeof *st);
    size_t k = 0;
    bool ok = true;
    for (int s = 0; s < h->steps && ok; s++) {
        if (k + 2 > nd || !(v[k] >= 0 && v[k] <= 1e6) || v[k] != (double)(int)v[k]) { /* NaN too */
            ok = false;
            break;
        }
        st[s].n = (int)v[k];
        st[s].bw_end = v[k + 1];
        k += 2;
        if (k + 3 * (size_t)st[s].n > nd) {
            ok = false;
            break;
        }
        st[s].b = nb__ddp_calloc((size_t)st[s].n + 1, sizeof *st[s].b);
        for (int b = 0; b < st[s].n; b++, k += 3)
            st[s].b[b] = (nb_ddp_bucket_time){v[k], v[k + 1], v[k + 2], 0};
    }
    free(v);
    if (ok && k != nd) ok = false;
    if (!ok) {
        for (int s = 0; s < h->steps; s++) free(st[s].b);
        free(st);
        return false;
    }
    *steps = st;
    return true;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static nb_status barrier(nb_ddp *d) { return nb_work_finish(nb_pg_barrier(d->pg)); }

nb_status nb_ddp_overlap_across_ranks(nb_ddp *d, nb_ddp_overlap *out) {
    NB__CHECK_HANDLE("nb_ddp_overlap_across_ranks", d, "DDP handle");
    NB_CHECK(d != NULL && out != NULL, "nb_ddp_overlap_across_ranks: wrapper or output is NULL");
    memset(out, 0, sizeof *out);
    if (!d->o.record_timeline)
        return nb_set_error(NB_ERR_INVALID, "nb_ddp_overlap_across_ranks: the wrapper was made without "
                                            "record_timeline, so no step was recorded");
    overlap_state none = {0}, *o = nb__ddp_state(d, NB__DDP_OVERLAP);
    if (!o) o = &none; /* no buckets: no step recorded */
    if (d->world == 1) { /* one rank: no one to wait for */
        trace_step *mine = o->steps;
        double zero = 0;
        nb__ddp_overlap_compute(1, o->n, &mine, &zero, out);
        out->steps_lost = o->lost;
        drop_steps(o);
        return NB_OK;
    }
    double left[NB_BARRIERS];
    for (int k = 0; k < NB_BARRIERS; k++) {
        nb_status st = barrier(d);
        if (st != NB_OK) return st;
        left[k] = nb__ddp_now();
    }
    int call = ++o->calls;
    nb_store *store = nb_pg_store(d->pg);
    char key[128];
    size_t len, full;
    char *mine = pack(o, left, &len, &full);
    snprintf(key, sizeof key, "nb/ddp/%u/overlap/%d/%d", d->id, call, nb_pg_global_rank(d->pg, d->rank));
    nb_status st = nb_store_set(store, key, mine, len);
    free(mine);
    head *heads = nb__ddp_calloc((size_t)d->world, sizeof *heads);
    trace_step **steps = nb__ddp_calloc((size_t)d->world, sizeof *steps);
    for (int r = 0; r < d->world && st == NB_OK; r++) {
        char k2[128];
        snprintf(k2, sizeof k2, "nb/ddp/%u/overlap/%d/%d", d->id, call, nb_pg_global_rank(d->pg, r));
        void *v = NULL;
        size_t n = 0;
        st = nb_store_get(store, k2, -1, &v, &n);
        if (st == NB_OK && !unpack(v, n, &heads[r], &steps[r]))
            st = nb_set_error(NB_ERR_MISMATCH, "nb_ddp_overlap_across_ranks: rank %d's record (%zu bytes) "
                                               "is malformed", r, n);
        else if (st == NB_OK && heads[r].steps == -1)
            st = nb_set_error(NB_ERR_INVALID, "nb_ddp_overlap_across_ranks: rank %d's %d steps of up to %d "
                                              "buckets make a record over the store's %zu bytes (this rank's: "
                                              "%zu); call it more often", r, o->n, d->n_buckets,
                              nb__ddp_overlap_record_cap ? nb__ddp_overlap_record_cap
                                                         : (size_t)NB_STORE_MAX_VALUE, full);
        free(v);
    }
    for (int r = 1; r < d->world && st == NB_OK; r++) {
        if (heads[r].steps != heads[0].steps)
            st = nb_set_error(NB_ERR_MISMATCH, "nb_ddp_overlap_across_ranks: rank 0 recorded %d steps since "
                                               "the last call, rank %d %d", heads[0].steps, r, heads[r].steps);
        for (int s = 0; s < heads[0].steps && st == NB_OK; s++)
            if (steps[r][s].n != steps[0][s].n)
                st = nb_set_error(NB_ERR_MISMATCH, "nb_ddp_overlap_across_ranks: step %d has %d buckets on "
                                                   "rank 0 and %d on rank %d", s, steps[0][s].n, steps[r][s].n, r);
    }
    if (st == NB_OK) {
        double *offset = nb__ddp_calloc((size_t)d->world, sizeof *offset), err = 0;
        bool one_clock = true;
        for (int r = 1; r < d->world; r++) one_clock = one_clock && strcmp(heads[r].host, heads[0].host) == 0;
        if (!one_clock) {
            for (int r = 1; r < d->world; r++) {
                double diff[NB_BARRIERS];
                for (int k = 0; k < NB_BARRIERS; k++) diff[k] = heads[r].left[k] - heads[0].left[k];
                qsort(diff, NB_BARRIERS, sizeof *diff, cmp_double);
                offset[r] = diff[NB_BARRIERS / 2];
                for (int k = 0; k < NB_BARRIERS; k++) {
                    double e = diff[k] - offset[r];
                    if (e < 0) e = -e;
                    if (e > err) err = e;
                }
            }
        }
        nb__ddp_overlap_compute(d->world, heads[0].steps, steps, offset, out);
        int lost = 0;
        for (int r = 0; r < d->world; r++)
            if (heads[r].lost > lost) lost = heads[r].lost;
        out->steps_lost = lost;
        out->clock_error_s = err;
        free(offset);
    }
    for (int r = 0; r < d->world; r++) {
        if (steps[r])
            for (int s = 0; s < heads[r].steps; s++) free(steps[r][s].b);
        free(steps[r]);
    }
    free(steps);
    free(heads);
    drop_steps(o);
    if (st != NB_OK) return st;
    st = barrier(d); /* everyone has read every record */
    if (st == NB_OK) nb_store_delete(store, key, NULL);
    return st;
}
