/* nb_scale: projects the step time and weak-scaling efficiency of data
 * parallel training at 1 to 1024 devices from one rank's step trace
 * (written by bench_ddp --trace), with a cost model of the collectives
 * (Note [Scaling model] in distributed/scale.c). Its figures are
 * projections, and it says so.
 *
 *   nb_scale TRACE [--intra LINK] [--inter LINK] [--per-node G] [--max-world N]
 *            [--mode ddp|zero1] [--bf16-wire] [--powersgd RANK] [--algo ring|tree|best]
 *            [--bucket-mb MB]
 *   nb_scale --presets
 *
 * LINK: a preset (nb_scale --presets lists them with their sources),
 * measured:FILE (fitted to the table bench_collectives prints, saved in
 * FILE) or ALPHA_US,GB/S. Defaults: --intra nvlink-h100 --inter ib400
 * --per-node 8 --max-world 1024 --mode ddp --algo best, DDP's buckets
 * (first 1 MiB, then a sixteenth of the gradients' bytes within 256 KiB-25
 * MiB; --bucket-mb sets both). The last column
 * names the bucket cap with the shortest projected step at that size.
 * --powersgd RANK projects PowerSGD's steady state (nb_ddp_set_powersgd,
 * min_compression_rate 2 as its default).
 * docs/benchmarks.md explains how to read it. Exit status 0, 1 when the
 * trace or a measured table cannot be read, 2 on bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_buckets.h"
#include "distributed/scale.h"

static int usage(void) {
    fprintf(stderr, "usage: nb_scale TRACE [--intra LINK] [--inter LINK] [--per-node G] [--max-world N]\n"
                    "                [--mode ddp|zero1] [--bf16-wire] [--powersgd RANK] [--algo ring|tree|best]\n"
                    "                [--bucket-mb MB]\n"
                    "       nb_scale --presets\n"
                    "LINK: a preset, measured:FILE (bench_collectives' table) or ALPHA_US,GB/S\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *path = NULL, *intra = "nvlink-h100", *inter = "ib400";
    int max_world = 1024;
    double bucket_mb = 0;
    nb__scale_config c = {.nodes = 1, .per_node = 8, .mode = NB__SCALE_DDP, .algo = NB__SCALE_BEST,
                          .first_bucket = nb__ddp_default_first(), .powersgd_min_rate = 2.0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--presets")) {
            nb__scale_presets_print(stdout);
            return 0;
        } else if (!strcmp(a, "--bf16-wire")) {
            c.bf16_wire = true;
        } else if (v && !strcmp(a, "--intra")) {
            intra = argv[++i];
        } else if (v && !strcmp(a, "--inter")) {
            inter = argv[++i];
        } else if (v && !strcmp(a, "--per-node")) {
            c.per_node = atoi(argv[++i]);
        } else if (v && !strcmp(a, "--powersgd")) {
            c.powersgd_rank = atoi(argv[++i]);
            if (c.powersgd_rank < 1) return usage();
        } else if (v && !strcmp(a, "--max-world")) {
            max_world = atoi(argv[++i]);
        } else if (v && !strcmp(a, "--bucket-mb")) {
            bucket_mb = atof(argv[++i]);
        } else if (v && !strcmp(a, "--mode") && (!strcmp(v, "ddp") || !strcmp(v, "zero1"))) {
            c.mode = !strcmp(argv[++i], "ddp") ? NB__SCALE_DDP : NB__SCALE_ZERO1;
        } else if (v && !strcmp(a, "--algo") && (!strcmp(v, "ring") || !strcmp(v, "tree") || !strcmp(v, "best"))) {
            i++;
            c.algo = !strcmp(v, "ring") ? NB__SCALE_RING : !strcmp(v, "tree") ? NB__SCALE_TREE : NB__SCALE_BEST;
        } else if (a[0] != '-' && !path) {
            path = a;
        } else {
            return usage();
        }
    }
    if (!path || c.per_node < 1 || max_world < 1 || bucket_mb < 0) return usage();
    if (bucket_mb > 0) c.first_bucket = c.bucket_cap = (size_t)(bucket_mb * 1048576.0);
    nb__scale_trace t;
    if (nb__scale_link_parse(intra, &c.intra) != NB_OK || nb__scale_link_parse(inter, &c.inter) != NB_OK ||
        nb__scale_trace_read(path, &t) != NB_OK) {
        fprintf(stderr, "%s\n", nb_last_error());
        return 1;
    }
    if (!c.bucket_cap) { /* DDP's default (Note [Default bucket cap] in distributed/ddp_buckets.c) */
        size_t grad_bytes = 0;
        for (int i = 0; i < t.n; i++) grad_bytes += (size_t)t.p[i].numel * nb_dtype_size(t.p[i].dtype);
        c.bucket_cap = nb__ddp_default_cap(grad_bytes);
    }
    nb__scale_report(stdout, &t, &c, max_world);
    nb__scale_trace_free(&t);
    return 0;
}
