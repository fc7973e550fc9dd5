/* libFuzzer target for the scaling model's file readers (distributed/
 * scale.c): the step trace (nb__scale_trace_read) and bench_collectives'
 * table (nb__scale_fit), each on the input written to a scratch file.
 * A refused trace leaves no parameters and a message naming the file; an
 * accepted one has parameters with a dtype, a positive count, rows that
 * divide it and ready times that never decrease, writes and reads back the
 * same, and replays at 2 x 4 devices (ring, DDP, PowerSGD rank 2) to a
 * finite step no shorter than its compute; an accepted fit has a
 * nonnegative latency and a positive, finite bandwidth. */
/* smoke-instrument: distributed/scale.c */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "distributed/scale.h"

static const char *scratch_dir(void) { return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp"; }

static const char *file_path(const char *what) {
    static char path[2][96];
    int i = what[0] == 'b';
    if (!path[i][0]) snprintf(path[i], sizeof path[i], "%s/nb_fuzz_scale_%s_%d", scratch_dir(), what, (int)getpid());
    return path[i];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *in = file_path("in"), *back = file_path("back");
    FILE *f = fopen(in, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    fclose(f);

    nb__scale_trace t;
    if (nb__scale_trace_read(in, &t) != NB_OK) {
        if (t.p || t.n || !strstr(nb_last_error(), in)) abort();
    } else {
        if (t.n <= 0) abort();
        for (int i = 0; i < t.n; i++) {
            const nb__scale_param *p = &t.p[i];
            if (p->numel <= 0 || p->rows < 0 || (p->rows && p->numel % p->rows) || p->ready_s < 0 ||
                (i && p->ready_s < t.p[i - 1].ready_s) || (int)p->dtype >= NB_DTYPE_COUNT)
                abort();
        }
        nb__scale_trace u;
        if (nb__scale_trace_write(back, &t) != NB_OK || nb__scale_trace_read(back, &u) != NB_OK || u.n != t.n)
            abort();
        for (int i = 0; i < t.n; i++)
            if (strcmp(u.p[i].name, t.p[i].name) || u.p[i].numel != t.p[i].numel || u.p[i].rows != t.p[i].rows)
                abort();
        nb__scale_trace_free(&u);
        nb__scale_link l = {"fuzz", 1e-5, 1e9, "fuzz"};
        nb__scale_config c = {.nodes = 2, .per_node = 4, .mode = NB__SCALE_DDP, .algo = NB__SCALE_RING,
                              .first_bucket = 1 << 20, .bucket_cap = 25 << 20, .powersgd_rank = 2,
                              .powersgd_min_rate = 2, .intra = l, .inter = l};
        nb__scale_result r = nb__scale_replay(&t, &c);
        if (isfinite(t.forward_s + t.backward_s + t.optimizer_s) &&
            (!(r.step_s >= r.compute_s * (1 - 1e-12)) || r.n_buckets < 1 || r.n_buckets > t.n))
            abort();
        nb__scale_trace_free(&t);
    }

    nb__scale_link fit;
    if (nb__scale_fit(in, &fit) == NB_OK && !(fit.alpha_s >= 0 && fit.bw > 0 && isfinite(fit.bw))) abort();
    return 0;
}
