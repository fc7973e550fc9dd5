/* The scaling model (Note [Scaling model] in scale.c): one rank's step
 * trace replayed against an alpha-beta cost model of the collectives, to
 * project step time and weak-scaling efficiency at world sizes the
 * machine at hand does not have. Used by tools/nb_scale.c and
 * bench_ddp --trace/--project; tested by tests/test_scale.c. Not
 * installed. */
#ifndef NABLA_DISTRIBUTED_SCALE_H
#define NABLA_DISTRIBUTED_SCALE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "nabla/dtype.h"
#include "nabla/error.h"
#include "nabla/nn.h"

/* A link level: the latency of one message and the bandwidth one device
 * gets in one direction (bytes per second). */
typedef struct nb__scale_link {
    const char *name;
    double alpha_s;
    double bw;
    const char *source; /* where the figures come from */
} nb__scale_link;

/* The presets (name, alpha in seconds, bandwidth in bytes/s, source). */
#define NB__SCALE_PRESET_LIST(X)                                                                     \
    X("nvlink-h100", 3e-6, 450e9,                                                                   \
      "NVIDIA H100 SXM datasheet: NVLink 900 GB/s per GPU, both directions together; "             \
      "latency assumed")                                                                            \
    X("pcie5", 5e-6, 63e9,                                                                          \
      "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b coding, one direction; latency assumed")         \
    X("ib400", 5e-6, 50e9,                                                                          \
      "400 Gb/s InfiniBand NDR, one port per GPU (as in NVIDIA's DGX H100); latency assumed")      \
    X("eth100", 20e-6, 12.5e9, "100 Gb/s Ethernet, line rate; latency assumed (TCP)")              \
    X("eth10", 50e-6, 1.25e9, "10 Gb/s Ethernet, line rate; latency assumed (TCP)")

/* The preset called `name`, or false. */
bool nb__scale_preset(const char *name, nb__scale_link *out);
/* Prints every preset with its source. */
void nb__scale_presets_print(FILE *f);
/* A "measured" link fitted (least squares, t = a + b * bytes) to
 * bench_collectives' table in `path`: alpha = a / (2 (R - 1)),
 * bw = 2 (R - 1) / (R b), with R read from its header. */
nb_status nb__scale_fit(const char *path, nb__scale_link *out);

typedef enum nb__scale_algo { NB__SCALE_RING, NB__SCALE_TREE, NB__SCALE_BEST } nb__scale_algo;
typedef enum nb__scale_coll { NB__SCALE_ALL_REDUCE, NB__SCALE_REDUCE_SCATTER, NB__SCALE_ALL_GATHER } nb__scale_coll;

/* Seconds for collective c of `bytes` (the whole buffer) over p devices on
 * one link level. */
double nb__scale_flat(nb__scale_coll c, nb__scale_algo a, int p, double bytes, const nb__scale_link *l);
/* The same over nodes x per_node devices: hierarchical (Note [Scaling
 * model]); one level when nodes or per_node is 1. */
double nb__scale_collective(nb__scale_coll c, nb__scale_algo a, int nodes, int per_node, double bytes,
                            const nb__scale_link *intra, const nb__scale_link *inter);

/* One parameter of a trace: its gradient became final ready_s seconds
 * after backward began. */
typedef struct nb__scale_param {
    char name[96];
    nb_dtype dtype;
    int64_t numel;
    double ready_s;
    int64_t rows; /* shape[0] of a tensor of 2 dimensions or more; 0 for a vector */
} nb__scale_param;

/* A step trace (the file format: Note [Step trace] in scale.c). */
typedef struct nb__scale_trace {
    double forward_s, backward_s, optimizer_s;
    int n;                  /* parameters, in the order they became ready */
    nb__scale_param *p;     /* malloc'd */
    char source[256];
} nb__scale_trace;

nb_status nb__scale_trace_read(const char *path, nb__scale_trace *t);
nb_status nb__scale_trace_write(const char *path, const nb__scale_trace *t);
void nb__scale_trace_free(nb__scale_trace *t);
/* A trace of the n parameters p, parameter i's gradient final ready_s[i]
 * after backward began: sorted by that time (ties by index), t->p
 * malloc'd. */
void nb__scale_trace_make(nb__scale_trace *t, int n, const nb_named_tensor *p, const double *ready_s,
                          double forward_s, double backward_s, double optimizer_s, const char *source);

typedef enum nb__scale_mode { NB__SCALE_DDP, NB__SCALE_ZERO1 } nb__scale_mode;

typedef struct nb__scale_config {
    int nodes, per_node;
    nb__scale_mode mode;
    nb__scale_algo algo;
    bool bf16_wire;                  /* f32 gradients sent as bf16: half the bytes */
    int powersgd_rank;               /* > 0: PowerSGD at this rank (Note [PowerSGD], ddp_powersgd.c) */
    double powersgd_min_rate;        /* its min_compression_rate */
    size_t first_bucket, bucket_cap; /* bytes (DDP's defaults: 1 MiB, 25 MiB) */
    nb__scale_link intra, inter;
} nb__scale_config;

typedef struct nb__scale_result {
    double step_s;      /* projected step */
    double compute_s;   /* the step with free communication */
    double exposed_s;   /* step_s - compute_s */
    double comm_s;      /* all collectives' time, hidden or not */
    double efficiency;  /* world-1 step / step_s (weak scaling) */
    int n_buckets;
} nb__scale_result;

/* The replay of nb buckets (in launch order; ready: seconds after backward
 * began), bucket b's collective costing cost[b]; second[b] > 0 (second
 * may be NULL) is a second collective of bucket b that bucket b+1's launch
 * starts (the end of backward for the last bucket) after waiting for
 * bucket b's first, holding backward up meanwhile (PowerSGD's Q stage,
 * Note [PowerSGD]). start[b], end[b] filled when not NULL (seconds after
 * backward began; end: of the last collective of the bucket). */
nb__scale_result nb__scale_replay_buckets(int nb, const double *cost, const double *second, const double *ready,
                                          double forward_s, double backward_s, double optimizer_s, double after_s,
                                          double *start, double *end);
/* The trace's parameters bucketed as DDP does (nb__ddp_partition, in the
 * ready order) and replayed under `c`. */
nb__scale_result nb__scale_replay(const nb__scale_trace *t, const nb__scale_config *c);

/* A link from a preset's name, "measured:FILE" (nb__scale_fit) or
 * "ALPHA_US,GB/S". */
nb_status nb__scale_link_parse(const char *spec, nb__scale_link *out);
/* The bucket cap (MiB, first bucket the same) among 0.25 .. 256 MiB with
 * the shortest projected step under `c` (*best_step: that step). */
double nb__scale_suggest(const nb__scale_trace *t, const nb__scale_config *c, double *best_step);
/* Prints the projection table for world sizes 1 .. max_world: 1, 2, 4 ..
 * devices in one node, then 2, 4 .. full nodes of c->per_node devices. */
void nb__scale_report(FILE *f, const nb__scale_trace *t, const nb__scale_config *c, int max_world);

#endif
