/* The optimizer's private layout, shared by the files of optim/. Not installed. */
#ifndef NABLA_OPTIM_INTERNAL_H
#define NABLA_OPTIM_INTERNAL_H

#include "nabla/optim.h"
#include "tensor/backend.h" /* NB__HP_*: the layout of a group's hyperparameters */
#include "tensor/internal.h"

typedef struct nb__optim_param {
    nb_tensor *param;
    const char *name;
    int group;
    nb_tensor *step;            /* i64 scalar: updates of this parameter */
    nb_tensor *exp_avg;         /* Adam, AdamW */
    nb_tensor *exp_avg_sq;      /* Adam, AdamW */
    nb_tensor *max_exp_avg_sq;  /* Adam, AdamW with amsgrad, else NULL */
    nb_tensor *momentum_buffer; /* SGD with momentum */
    int state_at;               /* index in opt->state of its first moment entry */
    int n_moments;              /* moment tensors (fixed at construction) */
} nb__optim_param;

struct nb_optim {
    nb_optim_kind kind;
    nb_ctx *ctx;      /* on the parameters' device: moments, momentum buffers */
    nb_ctx *host_ctx; /* CPU (ctx itself for CPU parameters): step counts,
                         hyperparameters, names, the state list */
    int n_params, n_groups;
    nb__optim_param *params;
    nb_tensor **group_hp; /* n_groups f64 tensors of NB__HP_COUNT elements */
    nb_tensor *step_count; /* i64 scalar */
    nb_named_tensor *state;
    int n_state;
    /* Non-NULL while a DDP wrapper steps this optimizer per bucket
     * (nb_ddp_set_optimizer): names the owner in the refusals of
     * nb_optim_step, clipping and the grad scaler. */
    const char *stepped_by;
    /* Non-NULL while a DDP wrapper shards this optimizer's state (ZeRO-1,
     * nb_ddp_set_zero; Note [ZeRO-1] in distributed/ddp_zero.c): names the
     * owner in the refusals. `shard` is the wrapper's optimizer over this
     * rank's shard (counted by nb_optim_state_bytes); `released` says the
     * moments of opt itself are freed (nb_optim_state refuses then). */
    const char *sharded_by;
    nb_optim *shard;
    bool released;
};

static inline double *nb__optim_hp(const nb_optim *opt, int group) {
    return (double *)opt->group_hp[group]->data;
}

/* Checks hyperparameters; NULL when valid, else a message in buf. */
const char *nb__optim_check_hparams(nb_optim_kind kind, const double *hp, char *buf, size_t n);

/* A context for temporaries on `device`, one per thread and device,
 * reset at every call (what it held before is gone). */
nb_ctx *nb__optim_scratch(nb_device device);

/* Per-bucket stepping (Note [Per-bucket step] in distributed/ddp_bucket_step.c).
 * nb__optim_step_params updates parameters idx[0..n) (indices into
 * opt->params) exactly as nb_optim_step updates them: each one's step count
 * +1 and the group's current hyperparameters; nb__optim_count_step adds the
 * one optimizer-wide step (optim.step) that a whole step counts. */
void nb__optim_step_params(nb_optim *opt, const int *idx, int n);
void nb__optim_count_step(nb_optim *opt);
/* Index of tensor t among the optimizer's parameters, or -1. */
int nb__optim_param_index(const nb_optim *opt, const nb_tensor *t);
/* Aborts, naming `who`, when a DDP wrapper steps opt per bucket. */
void nb__optim_check_not_bucket_stepped(const nb_optim *opt, const char *who);

/* ZeRO-1 (Note [ZeRO-1] in distributed/ddp_zero.c). */
/* Aborts, naming `who` and the DDP call to use instead, while opt is sharded. */
void nb__optim_check_not_sharded(const nb_optim *opt, const char *who, const char *instead);
/* Frees the moments / momentum buffers (their memory, their entries in the
 * state list); step counts and hyperparameters stay. */
void nb__optim_release_state(nb_optim *opt);
/* Allocates them again, zero-filled, when released (no-op otherwise). */
void nb__optim_alloc_state(nb_optim *opt);
/* The grad scaler's stages, for nb_ddp_scaler_unscale / _step: begin_unscale
 * checks that nothing was unscaled since the last update (aborting, naming
 * who) and returns 1 / scale; end_unscale records the (agreed) found-inf;
 * begin_step checks that nothing was stepped and says whether the
 * gradients still need unscaling; end_step says whether to step. */
double nb__grad_scaler_begin_unscale(nb_grad_scaler *s, const char *who);
void nb__grad_scaler_end_unscale(nb_grad_scaler *s, bool found_inf);
bool nb__grad_scaler_begin_step(nb_grad_scaler *s, const char *who);
bool nb__grad_scaler_end_step(nb_grad_scaler *s);

#endif
