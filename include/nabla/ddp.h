/* Data-parallel training: the DDP wrapper and SyncBatchNorm.
 *
 * nb_ddp wraps a module on every rank of a process group. Gradients live in
 * buckets (flat buffers, one per group of parameters); each parameter's
 * ->grad is a view into its bucket. As backward makes a parameter's
 * gradient final, its gradient-ready hook marks it; a bucket whose
 * parameters are all ready is all-reduced at once, on the group's
 * background thread (Gloo) or communication stream (NCCL), while backward
 * goes on with earlier layers. nb_ddp_backward() waits for the last bucket
 * and leaves every gradient averaged over the ranks. See docs/ddp.md. */
#ifndef NABLA_DDP_H
#define NABLA_DDP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "nabla/api.h"
#include "nabla/checkpoint.h"
#include "nabla/dist.h"
#include "nabla/nn.h"
#include "nabla/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_ddp nb_ddp;

typedef enum nb_ddp_comm_hook {
    NB_DDP_HOOK_ALLREDUCE = 0, /* average in the gradients' dtype */
    NB_DDP_HOOK_BF16 = 1,      /* send bf16 (half the bytes), average, widen back */
} nb_ddp_comm_hook;

typedef struct nb_ddp_options {
    size_t first_bucket_bytes; /* 0: 1 MiB */
    size_t bucket_cap_bytes;   /* 0: a sixteenth of the gradients' bytes, at least
                                  256 KiB and at most 25 MiB (PyTorch's cap) */
    /* Parameters that get no gradient in a step are reduced as they are
     * (zeros after zero_grad). A gradient set to none
     * (nb_optim_zero_grad_to_none) that no rank fills stays NULL, as in
     * PyTorch; one filled on some rank gets the average (zeros from the
     * others). Costs a walk of the tape and one small all-reduce (an i32
     * per parameter) per synchronising backward. Without it, such a
     * parameter is an error. */
    bool find_unused_parameters;
    /* Rank 0's buffers (BatchNorm running stats) are broadcast before each
     * forward made through nb_ddp_forward / nb_ddp_pre_forward. */
    bool broadcast_buffers;
    nb_ddp_comm_hook comm_hook;
    /* Keep each step's timeline for nb_ddp_write_trace. */
    bool record_timeline;
} nb_ddp_options;

#define NB_DDP_DEFAULTS                                                                        \
    ((nb_ddp_options){.first_bucket_bytes = 0,                                             \
                      .bucket_cap_bytes = 0,                                               \
                      .find_unused_parameters = false,                                     \
                      .broadcast_buffers = true,                                           \
                      .comm_hook = NB_DDP_HOOK_ALLREDUCE,                                  \
                      .record_timeline = false})

/* Checks that every rank has the same parameters (count, names, dtypes,
 * shapes), broadcasts parameters and buffers from rank 0, and places the
 * gradients of the parameters that require grad in bucket memory owned by
 * the wrapper. Collective: every rank of `pg` calls it. A mismatch returns
 * NB_ERR_MISMATCH on every rank, naming the first differing parameter and
 * the ranks. */
NB_API nb_status nb_ddp_new(nb_ddp **out, nb_module *model, nb_pg *pg, const nb_ddp_options *opts);
/* Gives the gradients back their own memory (values kept) and frees the
 * wrapper. NULL is fine. */
NB_API void nb_ddp_free(nb_ddp *ddp);

NB_API nb_module *nb_ddp_module(nb_ddp *ddp);

/* Broadcasts buffers from rank 0 when broadcast_buffers is set (a
 * collective); programs whose modules take several inputs call it before
 * their forward. */
NB_API nb_status nb_ddp_pre_forward(nb_ddp *ddp);
/* nb_ddp_pre_forward, then nb_module_forward into *out. A failed broadcast
 * or a failed collective inside the forward (a SyncBatchNorm's, when a peer
 * died or froze) is returned, naming the peer in nb_last_error(), with
 * *out NULL. */
NB_API nb_status nb_ddp_forward(nb_ddp *ddp, nb_ctx *ctx, nb_tensor *x, nb_tensor **out);

/* Runs backward from `loss` with bucketed, overlapped all-reduce and
 * returns once every gradient holds the average over ranks. Use it in place
 * of nb_backward. In a no_sync step it is nb_backward: gradients only
 * accumulate locally. NB_ERR_INVALID when a parameter got no gradient and
 * find_unused_parameters is off (the message names it; the buckets are
 * still reduced so that other ranks do not hang); a communication failure
 * (a bucket's, or a SyncBatchNorm's inside backward) is returned with the
 * message naming the peer. */
NB_API nb_status nb_ddp_backward(nb_ddp *ddp, nb_tensor *loss);

/* Gradient accumulation: while on, nb_ddp_backward communicates nothing;
 * the first backward after turning it off reduces the accumulated sums. */
NB_API void nb_ddp_set_no_sync(nb_ddp *ddp, bool no_sync);

/* ---- optimizer step overlapped per bucket (docs/ddp.md, "Per-bucket
 * optimizer step") ---- */
/* From now on each synchronising nb_ddp_backward also steps `opt`: as soon
 * as a bucket's all-reduce completes (and is averaged), the optimizer
 * updates that bucket's parameters, while later buckets are still in
 * flight; when nb_ddp_backward returns, the step is done (one optimizer
 * step, optim.step + 1, with the learning rates set before the backward).
 * A no_sync backward steps nothing. Every parameter of opt must be one of
 * the wrapper's parameters. While attached, nb_optim_step,
 * nb_optim_clip_grad_norm, nb_grad_scaler_unscale and nb_grad_scaler_step
 * on opt abort with a message naming the situation (clipping needs the
 * norm of every gradient before any update; nb_clip_grad_norm on the
 * parameters' list must not be used either). nb_optim_zero_grad stays the
 * user's. NULL detaches. Local: every rank should make the same choice.
 * NB_ERR_INVALID, with nothing attached and the reason in nb_last_error(),
 * when the wrapper is in join mode or has ZeRO-1 on (naming both features,
 * as join and ZeRO-1 do the other way round), when opt is sharded by
 * ZeRO-1 or stepped by another wrapper, or when a parameter of opt is not
 * one of the wrapper's. */
NB_API NB_MUST_CHECK nb_status nb_ddp_set_optimizer(nb_ddp *ddp, nb_optim *opt);
NB_API nb_optim *nb_ddp_optimizer(const nb_ddp *ddp);

/* ---- ZeRO-1: optimizer state sharded over the ranks (docs/ddp.md, "ZeRO-1") ---- */
/* Shards opt's state: each rank keeps the moments / momentum buffers of
 * only its contiguous share (about 1/R) of every bucket, gradients are
 * reduce-scattered instead of all-reduced (still launched during
 * backward), and nb_ddp_step updates the rank's share and all-gathers the
 * parameters. opt may be freshly made or loaded from a checkpoint (of any
 * world size, sharded or not): each rank takes its pieces of opt's state,
 * then opt's own moments are freed; its step counts and hyperparameters
 * stay (nb_optim_set_lr etc. keep working). Every parameter of opt must be
 * one of the wrapper's. While attached, nb_optim_step,
 * nb_optim_clip_grad_norm, nb_grad_scaler_unscale / _step and nb_optim_state
 * on opt abort naming what to call instead (nb_ddp_step,
 * nb_ddp_clip_grad_norm, nb_ddp_scaler_unscale / _step,
 * nb_ddp_consolidate_optimizer). Per-bucket steps (nb_ddp_set_optimizer),
 * join, the bf16 comm hook, ZeRO-1 already on with another optimizer, an
 * optimizer already sharded and a parameter of opt that is not one of the
 * wrapper's are refused: NB_ERR_INVALID, nothing attached, the reason in
 * nb_last_error().
 * Attaching is local (every rank makes the same call); NULL detaches and
 * is collective: every rank gets the whole state back into opt. Free the
 * wrapper only after detaching, or opt's state is lost (opt then refuses
 * to step). */
NB_API NB_MUST_CHECK nb_status nb_ddp_set_zero(nb_ddp *ddp, nb_optim *opt);

/* PowerSGD gradient compression (Vogels et al., 2019), with the semantics
 * of PyTorch's powerSGD_hook: after start_iter synchronised steps of plain
 * all-reduce, each gradient matrix (a parameter viewed as shape[0] x the
 * rest) worth compressing is sent as a rank-`rank` approximation P Q^T
 * (two all-reduces: P = M Q, then Q = M^T P), the others as they are;
 * error_feedback adds each rank's compression error to its next gradient,
 * warm_start starts Q from the last step's. Note [PowerSGD] in
 * distributed/ddp_powersgd.c gives the arithmetic. */
typedef struct nb_ddp_powersgd_options {
    int rank;                    /* of the approximation, >= 1 */
    int start_iter;              /* synchronised steps of plain all-reduce first */
    double min_compression_rate; /* compress n x m when (n + m) rank * this < n m */
    bool error_feedback, warm_start;
    uint64_t seed;               /* of the random first Q (the same on every rank) */
} nb_ddp_powersgd_options;

#define NB_DDP_POWERSGD_DEFAULTS                                                               \
    ((nb_ddp_powersgd_options){.rank = 1,                                                  \
                               .start_iter = 1000,                                         \
                               .min_compression_rate = 2.0,                                \
                               .error_feedback = true,                                     \
                               .warm_start = true,                                         \
                               .seed = 0})

/* Attaches PowerSGD as the communication hook (NULL detaches; a second
 * call replaces the first, starting afresh). Every rank makes the same
 * call before a backward. CPU gradients of f32 or f64 only
 * (NB_ERR_UNSUPPORTED otherwise); with the bf16 hook, ZeRO or join on,
 * NB_ERR_INVALID naming the conflict; nothing attached on an error. */
NB_API NB_MUST_CHECK nb_status nb_ddp_set_powersgd(nb_ddp *ddp,
                                                   const nb_ddp_powersgd_options *opts);
/* nb_ddp_set_zero with a stage: 1 shards the optimizer state (what
 * nb_ddp_set_zero does), 2 the gradients too (ZeRO-2, docs/ddp.md): the
 * buckets' gradient memory exists only from the start of an
 * nb_ddp_backward until its bucket's reduce-scatter has finished, and each
 * rank keeps only its averaged shard; between steps the parameters' ->grad
 * are NULL. Called with the optimizer already attached it changes the
 * stage; other stages abort. nb_ddp_set_zero keeps the stage of an
 * optimizer already attached, else attaches with stage 1. */
NB_API NB_MUST_CHECK nb_status nb_ddp_set_zero_stage(nb_ddp *ddp, nb_optim *opt, int stage);
/* 0 (ZeRO off), 1 or 2. */
NB_API int nb_ddp_zero_stage(const nb_ddp *ddp);
NB_API nb_optim *nb_ddp_zero_optimizer(const nb_ddp *ddp);
/* The bytes of state this rank holds now: the wrapper's parameters (those
 * that require grad), their gradient memory (the buckets', ZeRO's
 * averaged shards) and opt's state (nb_optim_state_bytes, with its
 * shards; opt may be NULL). Communication buffers are not counted. */
NB_API size_t nb_ddp_state_bytes(const nb_ddp *ddp, const nb_optim *opt);
/* The optimizer step under ZeRO-1 (after a synchronising nb_ddp_backward
 * and, if wanted, nb_ddp_clip_grad_norm): the rank's shard is updated with
 * the averaged gradients, then every bucket's parameters are all-gathered.
 * Collective. One step of opt (optim.step + 1, each parameter's step + 1). */
NB_API nb_status nb_ddp_step(nb_ddp *ddp);
/* Global-norm clipping of the averaged gradients, as nb_clip_grad_norm
 * over every parameter of the wrapper (same norm_type, max_norm and
 * non-finite rules); the norm goes to *norm. Under ZeRO-1 the norm is the
 * square root of the sum over ranks of their shards' sums of squares (max
 * for INFINITY) and only the shards are scaled; collective then. Without
 * ZeRO-1 it is nb_clip_grad_norm on the parameters (local). Aborts while
 * an optimizer is stepped per bucket (nb_ddp_set_optimizer). */
NB_API nb_status nb_ddp_clip_grad_norm(nb_ddp *ddp, double max_norm, double norm_type,
                                       double *norm);
/* Gathers the whole optimizer state into opt on rank `root` (every rank
 * with -1), for nb_optim_state / nb_checkpoint_save_training: the file is
 * the same as the one a plain optimizer with that state writes. Valid until
 * the next nb_ddp_step, which frees it again. Collective. */
NB_API nb_status nb_ddp_consolidate_optimizer(nb_ddp *ddp, int root);
/* This rank's share of the training state for a sharded checkpoint
 * (nb_checkpoint_save_shard, docs/checkpoints.md): model[0..n_model) (the
 * checkpoint's model tensors, the wrapper's parameters among them), then
 * the state of the optimizer ZeRO shards, in the order and under the names
 * nb_checkpoint_save_training writes them. Each rank gives the elements of
 * its chunks (Note [ZeRO-1]) of the parameters and of their moments; rank
 * 0 also gives whole every other tensor (buffers, parameters in no bucket,
 * step counts, hyperparameters). With nothing sharded (no buckets yet),
 * rank 0 gives everything whole. *pieces is malloc'ed (the caller frees
 * it); the views are made in ctx and stay valid until the next
 * nb_ddp_step. Aborts when ZeRO is off. Local. */
NB_API nb_status nb_ddp_zero_checkpoint_pieces(nb_ddp *ddp, const nb_named_tensor *model, int n_model, nb_ctx *ctx,
                                        nb_checkpoint_piece **pieces, int *n);
/* The grad scaler under ZeRO-1 (nb_grad_scaler_unscale / _step refuse a
 * sharded optimizer): nb_ddp_scaler_unscale divides the averaged gradients
 * (the rank's shards) by the scale and checks them; the ranks agree on
 * found-inf (an inf or NaN on any rank counts for all). nb_ddp_scaler_step
 * unscales first unless done since the last nb_grad_scaler_update, then
 * calls nb_ddp_step when no rank found an inf or NaN (*stepped = true) and
 * skips the step otherwise, on every rank alike; nb_grad_scaler_update(s)
 * follows as without ZeRO. Both are collective (Note [ZeRO-1 grad scaler]
 * in distributed/ddp_zero.c). */
NB_API nb_status nb_ddp_scaler_unscale(nb_ddp *ddp, nb_grad_scaler *s);
NB_API nb_status nb_ddp_scaler_step(nb_ddp *ddp, nb_grad_scaler *s, bool *stepped);

/* ---- uneven inputs: join (docs/ddp.md, "Uneven inputs: join") ---- */
typedef struct nb_ddp_join_options {
    /* true (NB_DDP_JOIN_DEFAULTS): a step's gradients are the sum over the
     * ranks that trained in it divided by the world size, so every sample
     * weighs the same; false: divided by the number of those ranks. */
    bool divide_by_initial_world_size;
} nb_ddp_join_options;

#define NB_DDP_JOIN_DEFAULTS ((nb_ddp_join_options){.divide_by_initial_world_size = true})

/* Enters join mode (local; every rank calls it before its training loop;
 * NULL opts: the defaults). From then on each step must go through
 * nb_ddp_forward (or nb_ddp_pre_forward) and nb_ddp_backward, which count
 * the ranks still training and divide gradients as the options say; set
 * no_sync before a step's forward. NB_ERR_INVALID, nothing changed and the
 * reason in nb_last_error(), when per-bucket steps (nb_ddp_set_optimizer)
 * or ZeRO-1 are on: the same refusal, naming both features, that those
 * calls give in join mode. */
NB_API NB_MUST_CHECK nb_status nb_ddp_join_begin(nb_ddp *ddp, const nb_ddp_join_options *opts);
/* Called by a rank that has no batches left: answers the other ranks'
 * steps with zero contributions (buffer broadcasts, SyncBatchNorm
 * statistics and gradient sums, gradient buckets) until every rank has
 * called it, then gives every rank the parameters and buffers of the last
 * rank(s) still training, and leaves join mode. The joined rank's
 * gradients are zero; its optimizer state is left as it was. A failed
 * collective (a peer died) is returned, naming it. */
NB_API nb_status nb_ddp_join(nb_ddp *ddp);

/* ---- buckets and measured overlap ---- */
NB_API int nb_ddp_num_buckets(const nb_ddp *ddp);
/* Parameter indices (in nb_module_named_parameters order, counting only
 * those that require grad) of bucket b, in bucket order; returns the count,
 * writes at most cap. */
NB_API int nb_ddp_bucket_params(const nb_ddp *ddp, int b, int *out, int cap);
NB_API bool nb_ddp_buckets_rebuilt(const nb_ddp *ddp);

typedef struct nb_ddp_bucket_time {
    double launch;   /* seconds, relative to the end of backward (negative: before it) */
    double start;    /* when the collective began running */
    double finish;   /* when it completed */
    size_t bytes;    /* sent per rank */
} nb_ddp_bucket_time;

typedef struct nb_ddp_step_stats {
    int n_buckets;
    const nb_ddp_bucket_time *buckets; /* valid until the next backward */
    double backward_s;        /* backward's duration (nb_backward alone) */
    double wait_s;            /* time spent waiting for buckets after backward (with
                                 nb_ddp_set_optimizer: and stepping them) */
    double comm_s;            /* sum of the buckets' running times */
    double hidden_fraction;   /* share of comm_s that ran before backward ended */
    int launched_before_end;  /* buckets launched before backward ended */
} nb_ddp_step_stats;

/* The last synchronised step's figures. */
NB_API nb_ddp_step_stats nb_ddp_last_stats(const nb_ddp *ddp);

/* Overlap across ranks (Note [Overlap across ranks] in
 * distributed/ddp_overlap.c). A rank's own figures (nb_ddp_step_stats)
 * count as communication the time a bucket's collective waits for a rank
 * that launches it later, and a later rank's backward as not hidden; this
 * puts every rank's recorded steps on one clock and separates the two. */
typedef struct nb_ddp_overlap {
    int steps;                  /* steps summarised: recorded since the last call */
    int steps_lost;             /* recorded after the timeline was full (not summarised) */
    double skew_s;              /* per step, mean: last rank's end of backward minus the first's */
    double comm_s;              /* per rank and step, mean: the buckets' running time (comm_s of
                                   nb_ddp_step_stats) */
    double peer_wait_s;         /* of comm_s: before the last rank launched the bucket */
    double hidden_fraction;     /* share of comm_s - peer_wait_s that ran before the last rank's
                                   backward ended */
    double own_hidden_fraction; /* share of comm_s that ran before the rank's own backward ended
                                   (hidden_fraction of nb_ddp_step_stats, pooled) */
    double clock_error_s;       /* 0: every rank on one host (one clock); else the spread of the
                                   clock offsets estimated at barriers */
} nb_ddp_overlap;

/* Summarises the steps recorded (record_timeline) since the previous call
 * on every rank: a collective, every rank of the wrapper's group calls it
 * between steps; every rank gets the same figures. Exchanges the records
 * through the store and runs a few barriers. NB_ERR_INVALID without
 * record_timeline; NB_ERR_MISMATCH when the ranks recorded different steps
 * or buckets; the store's or group's failure otherwise. A world of one has
 * no buckets and records no step (steps 0). */
NB_API nb_status nb_ddp_overlap_across_ranks(nb_ddp *ddp, nb_ddp_overlap *out);

/* Chrome trace JSON (opens in Perfetto / chrome://tracing) of the steps
 * recorded so far (record_timeline): forward, backward and each bucket's
 * all-reduce on their own tracks, process = rank. */
NB_API nb_status nb_ddp_write_trace(const nb_ddp *ddp, const char *path);

/* ---- SyncBatchNorm ---- */
/* Batch norm whose training statistics are those of the whole global
 * batch: per-channel (count, sum, sum of squares) are all-reduced in f64,
 * so ranks may have different batch sizes; backward all-reduces (sum dy,
 * sum dy * xhat). Eval mode uses the running statistics and communicates
 * nothing. Weight and bias gradients stay local (DDP averages them).
 * When an all-reduce fails (a peer died), the output (in backward: the
 * input's gradient) is all NaN, the running statistics are unchanged and
 * the group is broken: nb_ddp_forward / nb_ddp_backward return the
 * failure, and so do nb_pg_status(pg) and every later collective on pg. */
NB_API nb_tensor *nb_sync_batch_norm(nb_ctx *ctx, nb_pg *pg, nb_tensor *x, nb_tensor *weight,
                              nb_tensor *bias, nb_tensor *running_mean, nb_tensor *running_var,
                              bool training, double momentum, double eps);

/* Replaces every BatchNorm1d/2d in the tree by a SyncBatchNorm over `pg`
 * that keeps the same parameter and buffer tensors (and names). Returns the
 * number replaced. */
NB_API int nb_convert_sync_batchnorm(nb_module *model, nb_pg *pg);

#ifdef __cplusplus
}
#endif
#endif
