/* DDP's measurements: per-step statistics (bucket launch, start and finish
 * times against the end of backward, the hidden fraction of
 * communication) and the Chrome trace of the recorded steps. A feature of
 * the reducer (Note [DDP hook points] in ddp.c), attached at construction
 * when the wrapper has buckets: it reads the reducer's times of every
 * synchronised step (sync_end). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_internal.h"
#include "util/handle.h"

#define MAX_TRACE_STEPS 256

typedef struct stats_state {
    nb_ddp_step_stats stats;
    nb_ddp_bucket_time *times;          /* the last step's, relative to bw_end (malloc'd) */
    trace_step trace[MAX_TRACE_STEPS];  /* with record_timeline */
    int n_trace;
} stats_state;

static void stats_sync_end(nb_ddp *d, void *self, double done) {
    stats_state *ss = self;
    nb_ddp_step_stats *s = &ss->stats;
    memset(s, 0, sizeof *s);
    s->n_buckets = d->n_buckets;
    free(ss->times);
    ss->times = nb__ddp_calloc((size_t)d->n_buckets, sizeof(nb_ddp_bucket_time));
    s->buckets = ss->times;
    s->backward_s = d->bw_end - d->bw_start;
    s->wait_s = done - d->bw_end;
    double hidden = 0;
    for (int b = 0; b < d->n_buckets; b++) {
        nb_ddp_bucket_time *t = &d->times[b];
        double start = t->start, finish = t->finish; /* absolute for now */
        s->comm_s += finish - start;
        if (start < d->bw_end) hidden += (finish < d->bw_end ? finish : d->bw_end) - start;
        if (t->launch < d->bw_end) s->launched_before_end++;
    }
    s->hidden_fraction = s->comm_s > 0 ? hidden / s->comm_s : 0;
    if (d->o.record_timeline) {
        trace_step *ts = &ss->trace[ss->n_trace < MAX_TRACE_STEPS ? ss->n_trace++ : MAX_TRACE_STEPS - 1];
        free(ts->b);
        nb__ddp_step_timeline(d, done, ts);
    }
    for (int b = 0; b < d->n_buckets; b++) { /* relative to the end of backward */
        ss->times[b] = d->times[b];
        ss->times[b].launch -= d->bw_end;
        ss->times[b].start -= d->bw_end;
        ss->times[b].finish -= d->bw_end;
    }
}

static void stats_free(nb_ddp *d, void *self) {
    (void)d;
    stats_state *ss = self;
    free(ss->times);
    for (int i = 0; i < ss->n_trace; i++) free(ss->trace[i].b);
    free(ss);
}

static const nb__ddp_hooks stats_hooks = {
    .name = "the step statistics",
    .sync_end = stats_sync_end,
    .free = stats_free,
};

void nb__ddp_stats_attach(nb_ddp *d) {
    nb__ddp_attach(d, NB__DDP_STATS, &stats_hooks, nb__ddp_calloc(1, sizeof(stats_state)));
}

nb_ddp_step_stats nb_ddp_last_stats(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_last_stats", d, "DDP handle");
    const stats_state *ss = nb__ddp_state(d, NB__DDP_STATS);
    if (!ss) return (nb_ddp_step_stats){0}; /* no buckets: nothing measured */
    return ss->stats;
}

/* ---- Chrome trace ---- */

static void trace_event(FILE *f, bool *first, const char *name, int pid, int tid, double t0, double ts,
                        double te) {
    fprintf(f, "%s\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}",
            *first ? "" : ",", name, pid, tid, (ts - t0) * 1e6, (te - ts) * 1e6);
    *first = false;
}

nb_status nb_ddp_write_trace(const nb_ddp *d, const char *path) {
    NB__CHECK_HANDLE("nb_ddp_write_trace", d, "DDP handle");
    if (!d->o.record_timeline)
        return nb_set_error(NB_ERR_INVALID, "nb_ddp_write_trace: the wrapper was made without "
                                            "record_timeline, so there is nothing to write to %s", path);
    const stats_state *ss = nb__ddp_state(d, NB__DDP_STATS);
    const trace_step *trace = ss ? ss->trace : NULL;
    int n_trace = ss ? ss->n_trace : 0;
    FILE *f = fopen(path, "w");
    if (!f) return nb_set_error(NB_ERR_IO, "nb_ddp_write_trace: cannot open %s for writing", path);
    double t0 = n_trace ? trace[0].fwd_start : 0;
    if (n_trace && (t0 == 0 || t0 > trace[0].bw_start)) t0 = trace[0].bw_start;
    int pid = nb_pg_global_rank(d->pg, d->rank);
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
    bool first = true;
    fprintf(f, "\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}},", pid, pid);
    fprintf(f, "\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"compute\"}},", pid);
    fprintf(f, "\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":1,\"args\":{\"name\":\"communication\"}}", pid);
    first = false;
    for (int s = 0; s < n_trace; s++) {
        const trace_step *t = &trace[s];
        if (t->fwd_start > 0 && t->fwd_start <= t->bw_start)
            trace_event(f, &first, "forward", pid, 0, t0, t->fwd_start, t->bw_start);
        trace_event(f, &first, "backward", pid, 0, t0, t->bw_start, t->bw_end);
        trace_event(f, &first, "wait for buckets", pid, 0, t0, t->bw_end, t->done);
        for (int b = 0; b < t->n; b++) {
            char name[48];
            snprintf(name, sizeof name, "%s bucket %d", nb__ddp_collective(d), b);
            trace_event(f, &first, name, pid, 1, t0, t->b[b].start, t->b[b].finish);
        }
    }
    fprintf(f, "\n]}\n");
    bool bad = ferror(f) != 0;
    if (fclose(f) != 0 || bad) return nb_set_error(NB_ERR_IO, "nb_ddp_write_trace: writing %s failed", path);
    return NB_OK;
}
