/* What optim/ offers the layers that own an optimizer: DDP's per-bucket
 * step (distributed/ddp_bucket_step.c) and ZeRO's sharded optimizer
 * (distributed/ddp_zero.c). Verbs only: code outside optim/ reads and
 * writes no field of nb_optim (optim/internal.h is optim/'s own; Note
 * [Sharded optimizer] in optim/sharded.c). Not installed. */
#ifndef NABLA_OPTIM_SHARDED_H
#define NABLA_OPTIM_SHARDED_H

#include "nabla/checkpoint.h"
#include "nabla/optim.h"
#include "nabla/error.h"

/* ---- owners ----
 * An optimizer has at most one owner besides its user. While owned, the
 * user's own step, clipping and grad scaler on it abort with a message
 * naming the owner and the call to use instead. */
typedef enum nb__optim_owner {
    NB__OPTIM_BUCKET_STEPPED = 1, /* stepped per bucket inside nb_ddp_backward */
    NB__OPTIM_SHARDED,            /* its state sharded over the ranks (ZeRO) */
} nb__optim_owner;

/* Takes opt for `owner`; NB_ERR_INVALID, naming `who`, rank, the owner
 * it has and the one asked for, when it is owned already. */
nb_status nb__optim_take(nb_optim *opt, nb__optim_owner owner, const char *who, int rank);
/* The same answer without taking it. */
nb_status nb__optim_can_take(const nb_optim *opt, nb__optim_owner owner, const char *who, int rank);
/* Gives opt back to its user. A sharded optimizer whose state was not
 * gathered back (released, see below) stays refused, saying the shards
 * are lost. */
void nb__optim_give_back(nb_optim *opt);

/* A context for temporaries on `device`, one per thread and device,
 * reset at every call (what it held before is gone). */
nb_ctx *nb__optim_scratch(nb_device device);

/* ---- stepping parameters (Note [Per-bucket step] in distributed/ddp_bucket_step.c) ----
 * nb__optim_step_params updates parameters idx[0..n) (indices into the
 * optimizer's list) exactly as nb_optim_step updates them: each one's
 * step count +1 and the group's current hyperparameters;
 * nb__optim_count_step adds the one optimizer-wide step (optim.step) that
 * a whole step counts. */
void nb__optim_step_params(nb_optim *opt, const int *idx, int n);
void nb__optim_count_step(nb_optim *opt);
/* Index of tensor t among the optimizer's parameters, or -1. */
int nb__optim_param_index(const nb_optim *opt, const nb_tensor *t);
/* Parameter i's tensor and name. */
nb_tensor *nb__optim_param_tensor(const nb_optim *opt, int i);
const char *nb__optim_param_name(const nb_optim *opt, int i);

/* ---- the sharded optimizer (Note [Sharded optimizer] in optim/sharded.c) ---- */

/* A piece: elements [start, start + len) of a parameter (contiguous),
 * with its gradient (a 1-D tensor of len elements) and its name. `data`
 * is the 1-D tensor (len elements) that holds the piece's values: NULL
 * when they are the parameter's own memory (ZeRO-1 and 2, every rank
 * holds the whole parameter), a view of the rank's parameter shard under
 * ZeRO-3 (distributed/fsdp.c), where the parameter's own memory exists
 * only while its unit is gathered. */
typedef struct nb__optim_piece {
    nb_tensor *param;
    int64_t start, len;
    nb_tensor *grad;
    const char *name;
    nb_tensor *data;
} nb__optim_piece;

typedef struct nb__optim_shard nb__optim_shard;

/* opt's state for pieces[0..n) (the pieces of parameters opt does not
 * hold are kept and never stepped): the moments of each piece copied
 * out of opt's own, which are then released (opt's step counts and
 * hyperparameters stay). Views go into ctx, which must outlive the
 * shard. Aborts when opt's state is released and some piece needs it. */
nb__optim_shard *nb__optim_shard_new(nb_optim *opt, nb_ctx *ctx, int n, const nb__optim_piece *pieces);
void nb__optim_shard_free(nb__optim_shard *s); /* NULL is fine */
/* A step begins: opt's released moments stay released (a consolidated
 * copy is stale from here), opt counts one step and each of its
 * parameters one update, and the shard takes opt's hyperparameters and
 * step counts (learning-rate schedules act on opt). */
void nb__optim_shard_begin_step(nb__optim_shard *s);
/* Updates pieces [first, end) (those opt holds) from their gradients. */
void nb__optim_shard_step(nb__optim_shard *s, int first, int end);
/* Moment k (0 .. nb__optim_moment_count(opt) - 1) of piece j, or NULL
 * (a piece opt does not hold, or a moment its parameter has not). */
nb_tensor *nb__optim_shard_moment(nb__optim_shard *s, int j, int k);

/* Moment tensors per parameter at most (the same on every rank). */
int nb__optim_moment_count(const nb_optim *opt);
/* Moment k of parameter i of opt, or NULL (also while released). */
nb_tensor *nb__optim_moment(nb_optim *opt, int i, int k);
/* opt's state list as nb_optim_state gives it, also while its moments
 * are released (their entries' tensors are then NULL), for a sharded
 * checkpoint's names and order; and the entry of moment k of parameter i
 * in it (-1: none). */
const nb_named_tensor *nb__optim_state_entries(const nb_optim *opt, int *n);
int nb__optim_moment_entry(const nb_optim *opt, int i, int k);
/* The pieces of a sharded checkpoint (nabla/checkpoint.h) this rank
 * writes, for model[0..n_model) then opt's state list, in that order and
 * under nb_checkpoint_save_training's names. pieces[0..n) are the rank's
 * (in s's order, `data` a view of the parameter's current elements; n = 0
 * and s NULL when nothing is sharded yet). A model tensor for which
 * is_sharded(user, t) holds goes as this rank's pieces of it, and so do
 * the moments of its parameter; every other tensor goes whole, from the
 * `lead` rank only. *out is malloc'ed (the caller frees it). */
void nb__optim_checkpoint_pieces(nb_optim *opt, nb__optim_shard *s, const nb__optim_piece *pieces, int n,
                                 bool lead, bool (*is_sharded)(void *user, const nb_tensor *t), void *user,
                                 const nb_named_tensor *model, int n_model, nb_checkpoint_piece **out,
                                 int *n_out);
/* Frees opt's moments (their memory, their entries in the state list);
 * step counts and hyperparameters stay. */
void nb__optim_release_state(nb_optim *opt);
/* Allocates them again, zero-filled, when released (no-op otherwise). */
void nb__optim_alloc_state(nb_optim *opt);

/* The grad scaler's stages, for nb_ddp_scaler_unscale / _step:
 * begin_unscale checks that nothing was unscaled since the last update
 * (aborting, naming who) and returns 1 / scale; end_unscale records the
 * (agreed) found-inf; begin_step checks that nothing was stepped and says
 * whether the gradients still need unscaling; end_step says whether to
 * step. */
double nb__grad_scaler_begin_unscale(nb_grad_scaler *s, const char *who);
void nb__grad_scaler_end_unscale(nb_grad_scaler *s, bool found_inf);
bool nb__grad_scaler_begin_step(nb_grad_scaler *s, const char *who);
bool nb__grad_scaler_end_step(nb_grad_scaler *s);

#endif
