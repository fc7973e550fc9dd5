/* The optimizer's private layout, shared by the files of optim/. Not installed. */
#ifndef NABLA_OPTIM_INTERNAL_H
#define NABLA_OPTIM_INTERNAL_H

#include "nabla/optim.h"
#include "optim/sharded.h"
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
    /* Who owns it besides the user (0: nobody; nb__optim_take in
     * sharded.c). `lost`: a sharded optimizer whose wrapper was freed
     * before gathering the state back stays refused. `shard` is the
     * sharded optimizer's part over this rank's pieces (counted by
     * nb_optim_state_bytes); `released` says the moments of opt itself are
     * freed (nb_optim_state refuses then). */
    nb__optim_owner owner;
    bool lost;
    nb_optim *shard;
    bool released;
    /* the parameters whose step counts the last nb_optim_step_clipped
     * advanced without knowing whether the device skipped the update
     * (nb_optim_unstep takes them back); n_counted < 0: none */
    int *counted;
    int n_counted;
};

static inline double *nb__optim_hp(const nb_optim *opt, int group) {
    return (double *)opt->group_hp[group]->data;
}

/* One step of every parameter with a gradient, with the update's extras
 * (tensor/backend.h; NULL: none). When `record` is set, the parameters
 * counted go to opt->counted (for nb_optim_unstep). */
void nb__optim_step_extras(nb_optim *opt, const nb__update_extras *x, bool record);

/* Checks hyperparameters; NULL when valid, else a message in buf. */
const char *nb__optim_check_hparams(nb_optim_kind kind, const double *hp, char *buf, size_t n);

/* Abort, naming `who` (and the call to use `instead`), while a DDP
 * wrapper steps opt per bucket / shards its state. */
void nb__optim_check_not_bucket_stepped(const nb_optim *opt, const char *who);
void nb__optim_check_not_sharded(const nb_optim *opt, const char *who, const char *instead);

#endif
