/* ZeRO-3 / fully sharded data parallel (FSDP): parameters, gradients and
 * optimizer state all sharded over the ranks.
 *
 * nb_fsdp wraps a module on every rank of a process group. The module's
 * parameters are grouped into units (a block by default) and each unit's
 * parameters are laid out as one flat vector cut into equal chunks, one per
 * rank: a rank keeps only its chunk (the shard, in the parameters' dtype),
 * its gradient and the optimizer state for it. Before a unit's forward its
 * parameters are all-gathered into the step context (the next unit's
 * gather is launched as the current one computes) and given back when its
 * forward returns; during backward the unit is gathered again, its forward
 * run again (Note [Recomputation]) and walked, and its gradients are
 * reduce-scattered (averaged) into the shards' gradients while the earlier
 * units' backward goes on. Parameters in no unit form the root unit,
 * gathered from nb_fsdp_forward to the end of nb_fsdp_backward. The same
 * API on Gloo and NCCL; a NULL group is a world of one (nothing sent).
 * docs/ddp.md, "ZeRO-3", and Note [FSDP] in distributed/fsdp.c. */
#ifndef NABLA_FSDP_H
#define NABLA_FSDP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/checkpoint.h"
#include "nabla/dist.h"
#include "nabla/nn.h"
#include "nabla/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_fsdp nb_fsdp;

typedef struct nb_fsdp_options {
    /* Wrapping policy. 0: every child of a ModuleList or Sequential that
     * holds parameters and has a single-input forward is a unit (a GPT's
     * blocks, an MLP's layers). > 0: size-based auto-wrap, as FSDP's: going
     * up from the leaves, a module (not the root) with a single-input
     * forward becomes a unit when the parameters under it that are in no
     * unit yet number at least this many elements. */
    int64_t min_unit_params;
    /* Launch the next unit's all-gather while the current one computes
     * (forward: the next unit in registration order; backward: the one
     * before). */
    bool prefetch;
    /* When the forward's context computes in bf16 (nb_ctx_set_compute_dtype),
     * the all-gathers carry bf16 (half the bytes) and every parameter arrives
     * rounded to bf16 (FSDP's param_dtype); the shards, their gradients and
     * the optimizer stay in the parameters' dtype. */
    bool bf16_gather;
    /* Keep each unit gathered from its forward to the end of its backward
     * (FSDP's reshard_after_forward off): no second all-gather and no
     * second forward, but every unit's parameters are in the step context
     * at the end of the forward. Off: gathered again, run again. */
    bool keep_gathered;
} nb_fsdp_options;

#define NB_FSDP_DEFAULTS                                                                         \
    ((nb_fsdp_options){.min_unit_params = 0, .prefetch = true, .bf16_gather = true, .keep_gathered = false})

/* Collective. Checks that every rank has the same parameters (count and
 * elements), broadcasts parameters and buffers from rank 0, forms the
 * units, copies each rank's chunks into its shards and gives the
 * parameters' own memory back to their context: from now on a parameter
 * read outside its unit's forward and backward is refused with a message
 * naming it (nb_fsdp_gather_full makes them whole): make the optimizer
 * before wrapping (its state is shaped like the parameters). Parameters must share
 * one float dtype and be contiguous (NB_ERR_UNSUPPORTED); a parameter
 * shared by two units is refused too. */
NB_API nb_status nb_fsdp_new(nb_fsdp **out, nb_module *model, nb_pg *pg,
                             const nb_fsdp_options *opts);
/* Frees the wrapper. Parameters made whole by nb_fsdp_gather_full keep
 * that memory; otherwise they stay refused. An attached optimizer is given
 * back with its state lost (it refuses to step). NULL is fine. Local. */
NB_API void nb_fsdp_free(nb_fsdp *f);

NB_API nb_module *nb_fsdp_module(nb_fsdp *f);
NB_API int nb_fsdp_num_units(const nb_fsdp *f); /* the root unit not counted */

/* The forward: gathers the root unit, then nb_module_forward into *out
 * (each unit gathered on the way). Collective. A failed collective is
 * returned (the step's values are then meaningless), naming the peer. */
NB_API nb_status nb_fsdp_forward(nb_fsdp *f, nb_ctx *ctx, nb_tensor *x, nb_tensor **out);
/* Backward from `loss` (made from nb_fsdp_forward's output); when it
 * returns, each rank's shard gradients hold the average over the ranks of
 * the gradients, added to what they held (several backwards before a step
 * accumulate, each one communicating). Parameters' ->grad are NULL.
 * Collective. */
NB_API nb_status nb_fsdp_backward(nb_fsdp *f, nb_tensor *loss);

/* Shards opt's state as nb_ddp_set_zero does (opt fresh, or loaded from a
 * checkpoint of any world size: each rank takes its pieces, then opt's own
 * moments are freed; step counts and hyperparameters stay, so learning-rate
 * schedules keep working on opt). Every parameter of opt must be one of
 * the wrapper's. While attached, nb_optim_step, clipping, the grad scaler
 * and nb_optim_state on opt abort. NB_ERR_INVALID (an optimizer attached
 * already, opt owned by something else, a parameter not the wrapper's),
 * nothing attached. Local. */
NB_API NB_MUST_CHECK nb_status nb_fsdp_set_optimizer(nb_fsdp *f, nb_optim *opt);
/* Updates every rank's shards from their gradients (one step of opt), then
 * zeroes the shard gradients. Nothing is gathered: the next forward gathers
 * the updated values. Local. */
NB_API nb_status nb_fsdp_step(nb_fsdp *f);
/* Global-norm clipping over the shard gradients, as nb_clip_grad_norm over
 * every parameter (norm_type 2 or INFINITY); the norm to *norm. Collective. */
NB_API nb_status nb_fsdp_clip_grad_norm(nb_fsdp *f, double max_norm, double norm_type,
                                        double *norm);
/* Gathers every parameter whole into fresh memory of its own context, until
 * the next nb_fsdp_forward (for a checkpoint, an evaluation through
 * nb_module_forward, reading values), and gives every rank rank 0's buffers
 * (BatchNorm's running statistics, which the wrapper does not broadcast
 * before each forward). Collective. */
NB_API nb_status nb_fsdp_gather_full(nb_fsdp *f);

/* Gathers the whole optimizer state into opt on rank `root` (every rank
 * with -1), as nb_ddp_consolidate_optimizer does for ZeRO-1: with the
 * parameters made whole (nb_fsdp_gather_full), nb_checkpoint_save_training
 * then writes the file a run without sharding writes; load such a file
 * into the model and optimizer before nb_fsdp_new, at any world size.
 * Valid until the next nb_fsdp_step, which frees it again. Collective. */
NB_API nb_status nb_fsdp_consolidate_optimizer(nb_fsdp *f, int root);

/* This rank's share of the training state for a sharded checkpoint
 * (nb_checkpoint_save_shard, docs/checkpoints.md), as
 * nb_ddp_zero_checkpoint_pieces gives ZeRO-1's: model[0..n_model) (the
 * wrapper's parameters among them) then the attached optimizer's state, in
 * nb_checkpoint_save_training's order and names; the elements of the
 * rank's chunks of every parameter (from its shards, nothing gathered) and
 * of their moments; rank 0 also gives whole the tensors nobody shards
 * (buffers, step counts, hyperparameters). *pieces is malloc'ed (the
 * caller frees it); views in ctx, valid until the next nb_fsdp_step.
 * Aborts without an attached optimizer. Local. */
NB_API nb_status nb_fsdp_checkpoint_pieces(nb_fsdp *f, const nb_named_tensor *model, int n_model, nb_ctx *ctx,
                                           nb_checkpoint_piece **pieces, int *n);

/* The bytes of state this rank holds between steps: its parameter shards,
 * their gradients and opt's state (nb_optim_state_bytes, shards included;
 * opt may be NULL). Gathered parameters, which live in the step context,
 * are not counted. */
NB_API size_t nb_fsdp_state_bytes(const nb_fsdp *f, const nb_optim *opt);

/* Communication since the last call (then reset). A collective's running
 * time is from when it began running to when it finished; exposed is the
 * time the host waited for one; hidden_fraction = 1 - exposed / comm. */
typedef struct nb_fsdp_stats {
    int all_gathers, reduce_scatters;
    size_t bytes;            /* sent per rank (all-gathers: the shard; reduce-scatters: the flat) */
    double comm_s;           /* sum of the collectives' running times */
    double exposed_s;        /* time spent waiting for them */
    double hidden_fraction;  /* 1 - exposed / comm (1 without communication) */
} nb_fsdp_stats;
NB_API nb_fsdp_stats nb_fsdp_take_stats(nb_fsdp *f);

#ifdef __cplusplus
}
#endif
#endif
