/* The DDP wrapper's insides, shared by ddp.c (the reducer: buckets,
 * hooks, launches, backward, the rebuild), ddp_verify.c (checks and
 * broadcasts at construction and before forward), ddp_stats.c (step
 * statistics and the Chrome trace) and ddp_join.c (uneven inputs). Not
 * installed. */
#ifndef NABLA_DISTRIBUTED_DDP_INTERNAL_H
#define NABLA_DISTRIBUTED_DDP_INTERNAL_H

#include "nabla/ddp.h"

#define NB__DDP_MAX_TRACE_STEPS 256
#define NB__DDP_MAX_OVERLAP_STEPS 1024 /* between two nb_ddp_overlap_across_ranks */

typedef struct bucket {
    nb_dtype dtype;
    int64_t numel;
    nb_tensor *flat;    /* gradient memory */
    nb_tensor *wire;    /* bf16 copy sent by the compression hook, or NULL */
    int n;              /* parameters */
    int *params;        /* indices, in bucket order */
    int64_t *offsets;   /* element offset of each parameter in flat */
    int pending;
    nb_work *work;
    double t_launch;
    /* ZeRO-1 (Note [ZeRO-1] in ddp_zero.c): flat has chunk * world elements
     * (zero padding after numel); shard receives this rank's averaged chunk */
    int64_t chunk;
    nb_tensor *shard;
} bucket;

/* ZeRO-1: the part of one parameter that lies in this rank's chunk of its
 * bucket. */
typedef struct zero_piece {
    int param;       /* wrapper index */
    int bucket;
    int64_t start;   /* first element, in the parameter */
    int64_t len;
    int64_t at;      /* first element, in the bucket's shard */
    int opt_index;   /* the parameter's index in the user's optimizer, or -1 */
    int shard_index; /* its index in the shard optimizer, or -1 */
} zero_piece;

typedef struct hook_ref {
    nb_ddp *ddp;
    int index;
} hook_ref;

/* One collective-relevant event of a training step, recorded in join mode
 * so that a joined rank can replay the step (Note [Join] in ddp_join.c). */
typedef struct join_event {
    int param;      /* >= 0: parameter `param` became ready; -1: a SyncBatchNorm all-reduce */
    nb_dtype dtype; /* of the SyncBatchNorm all-reduce */
    int64_t numel;
} join_event;

typedef struct trace_step {
    double fwd_start, bw_start, bw_end, done;
    int n;
    nb_ddp_bucket_time *b; /* absolute times; malloc'd */
} trace_step;

struct nb_ddp {
    nb_module *model;
    nb_pg *pg;
    nb_ddp_options o;
    int rank, world;
    bool bucketed;        /* world > 1, or forced (Note [DDP on CUDA]) */
    /* per parameter (those that require grad), malloc'd */
    int n;
    nb_named_tensor *p;
    nb_tensor **own_grad; /* each parameter's grad before the wrapper took it */
    hook_ref *refs;       /* registered with the tensors' hooks */
    int *bucket_of;
    bool *ready;
    int n_ready;
    int *ready_order;     /* the first synchronised backward's order */
    int *slot;            /* open-addressing map: tensor pointer -> parameter index */
    int slot_mask;
    /* buckets: memory and records in ctx, replaced at the rebuild */
    nb_ctx *ctx;
    int n_buckets;
    bucket *buckets;
    int next_launch;
    bool in_backward, no_sync, rebuilt, synced_once;
    /* the last synchronised step */
    double fwd_start, bw_start, bw_end;
    nb_ddp_bucket_time *times;      /* n_buckets, being measured (malloc'd) */
    nb_ddp_bucket_time *stat_times; /* the last step's, relative to bw_end (malloc'd) */
    nb_ddp_step_stats stats;
    trace_step trace[NB__DDP_MAX_TRACE_STEPS];
    int n_trace;
    /* steps kept for nb_ddp_overlap_across_ranks (ddp_overlap.c) */
    unsigned id;           /* the wrapper's number in the run (same on every rank) */
    trace_step *ov;        /* malloc'd, NB__DDP_MAX_OVERLAP_STEPS */
    int n_ov, ov_lost, ov_calls;
    /* join (ddp_join.c) */
    bool join_on;          /* from nb_ddp_join_begin to the end of nb_ddp_join */
    bool join_div_initial; /* divide by the world size, not by the ranks still training */
    bool join_counted;     /* this step's count was all-reduced (pre-forward) */
    bool join_sync;        /* this step reduces gradients (some training rank is not in no_sync) */
    bool join_shadow;      /* replaying a step on a joined rank */
    int join_active;       /* ranks training in this step */
    int join_root;         /* lowest of them: buffers and the bucket order come from it */
    join_event *events;    /* this rank's last training step (malloc'd) */
    int n_events, cap_events;
    /* per-bucket step (Note [Per-bucket step] in ddp.c) */
    nb_optim *opt;         /* NULL: the user steps after nb_ddp_backward */
    int *opt_index;        /* per parameter: its index in opt, or -1 (malloc'd) */
    int *step_idx;         /* scratch, n (malloc'd) */
    /* ZeRO-1 (Note [ZeRO-1] in ddp_zero.c) */
    nb_optim *zopt;        /* the user's optimizer whose state is sharded; NULL: off */
    nb_optim *zshard;      /* optimizer over this rank's pieces (NULL: it owns none) */
    zero_piece *pieces;    /* malloc'd */
    int n_pieces;
    nb_tensor *zsend, *zgather; /* all-gather buffers (largest chunk, chunk * world) in ctx */
    bool zero_fresh;       /* a synchronised backward reduce-scattered since the last step */
    bool zero_rebuild;     /* the bucket rebuild waits for the end of nb_ddp_step */
};

/* ddp.c */
double nb__ddp_now(void);
void *nb__ddp_calloc(size_t n, size_t size); /* aborts when out of memory */
/* Starts a synchronised backward: nothing ready, no bucket launched. */
void nb__ddp_reset_ready(nb_ddp *d);
/* Parameter i's gradient is final: launches the buckets that are complete. */
void nb__ddp_mark_ready(nb_ddp *d, int i);
/* The one-time bucket rebuild from the root's ready order (Note [Buckets]). */
nb_status nb__ddp_rebuild_buckets(nb_ddp *d);
/* New bucket memory for the current bucket order (padded for ZeRO-1 when
 * d->zopt is set); gradients keep their values. */
void nb__ddp_reassign_buckets(nb_ddp *d);

/* ddp_verify.c */
/* Every rank's parameter list against rank 0's; a mismatch names the
 * first differing parameter and the ranks (every rank gets the verdict). */
nb_status nb__ddp_verify_params(nb_ddp *d);
/* Broadcasts rank root's buffers (buffers_only) or whole state to every rank. */
nb_status nb__ddp_broadcast_tensors(nb_ddp *d, bool buffers_only, int root);

/* ddp_stats.c */
/* t = the step that just ended at `done` (its bucket times copied, malloc'd). */
void nb__ddp_trace_take(trace_step *t, const nb_ddp *d, double done);
/* Fills d->stats (and the timeline) from the step that just ended at `done`. */
void nb__ddp_record_stats(nb_ddp *d, double done);

/* ddp_overlap.c */
/* Tests only: when nonzero, the largest overlap record sent (bytes), in
 * place of the store's NB_STORE_MAX_VALUE. */
extern size_t nb__ddp_overlap_record_cap;
/* Keeps the step that just ended for nb_ddp_overlap_across_ranks. */
void nb__ddp_overlap_note(nb_ddp *d, double done);
void nb__ddp_overlap_forget(nb_ddp *d); /* at nb_ddp_free */
/* The figures of nb_ddp_overlap_across_ranks from every rank's steps:
 * steps[r][s] is rank r's step s (times absolute on rank r's clock, whose
 * offset from the common clock is offset[r]); every rank's step s has the
 * same bucket count. Pure: no communication. */
void nb__ddp_overlap_compute(int world, int steps, trace_step *const *steps_of, const double *offset,
                             nb_ddp_overlap *out);
/* ddp_join.c */
/* A training rank's count all-reduce at the start of a step in join mode. */
nb_status nb__ddp_join_count(nb_ddp *d);
/* Records a ready parameter for the joined ranks' replay. */
void nb__ddp_join_record_param(nb_ddp *d, int i);
/* The reduce op of the bucket all-reduces and the divisor applied after
 * them (0: none, the op averaged). */
nb_reduce_op nb__ddp_join_reduce_op(const nb_ddp *d);
double nb__ddp_join_divisor(const nb_ddp *d);
void nb__ddp_join_forget(nb_ddp *d); /* at nb_ddp_free */

/* ddp_zero.c */
/* Launches bucket b's reduce-scatter into b->shard. */
void nb__ddp_zero_launch(nb_ddp *d, bucket *b);
/* The bucket rebuild under ZeRO-1: state gathered, buckets rebuilt, shards taken again. */
nb_status nb__ddp_zero_rebuild(nb_ddp *d);
void nb__ddp_zero_forget(nb_ddp *d); /* at nb_ddp_free */

#endif
