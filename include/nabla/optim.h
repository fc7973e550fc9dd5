/* Optimizers (SGD, Adam, AdamW with PyTorch's update rules), parameter
 * groups, learning-rate schedules and gradient-norm clipping.
 *
 * An optimizer is an opaque handle over named parameters (nb_named_tensor:
 * the names key its state in checkpoints). Its state (moments, momentum
 * buffers, step counts, each group's hyperparameters) lives in a
 * persistent context of its own and is exported as named tensors, so that
 * it goes into the same checkpoint as the model (include/nabla/checkpoint.h).
 *
 * Each nb_optim_step() updates every parameter that has a gradient, one
 * pass over its memory; parameters whose ->grad is NULL are skipped, as
 * PyTorch skips parameters whose .grad is None. nb_optim_zero_grad() fills
 * gradients with zeros and keeps their buffers (a parameter that once had
 * a gradient is therefore updated by every later step, as in PyTorch with
 * zero_grad(set_to_none=False)); nb_optim_zero_grad_to_none() sets them to
 * NULL, as zero_grad(set_to_none=True). docs/optim.md has the exact update
 * rules. */
#ifndef NABLA_OPTIM_H
#define NABLA_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/error.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_optim nb_optim;

typedef enum nb_optim_kind { NB_OPTIM_SGD = 0, NB_OPTIM_ADAM, NB_OPTIM_ADAMW } nb_optim_kind;

/* "sgd", "adam", "adamw". */
NB_API const char *nb_optim_kind_name(nb_optim_kind kind);

/* Hyperparameters of one parameter group. Fields that do not apply to the
 * optimizer's kind are ignored. */
typedef struct nb_optim_hparams {
    double lr;
    /* SGD and Adam: L2 penalty, wd * p added to the gradient.
     * AdamW: decoupled decay, p *= 1 - lr * wd before the Adam update. */
    double weight_decay;
    double momentum;  /* SGD, >= 0 */
    double dampening; /* SGD */
    bool nesterov;    /* SGD: needs momentum > 0 and dampening 0 */
    double beta1;     /* Adam, AdamW: in [0, 1) */
    double beta2;     /* Adam, AdamW: in [0, 1) */
    double eps;       /* Adam, AdamW: added outside the square root, >= 0 */
    /* Adam, AdamW: the AMSGrad variant (PyTorch's amsgrad=True): each
     * parameter keeps max_exp_avg_sq, the elementwise maximum of every
     * exp_avg_sq so far, and the denominator uses it instead of
     * exp_avg_sq. Costs one more tensor of the parameter's size, made only
     * for parameters of groups with amsgrad on. Fixed at construction. */
    bool amsgrad;
} nb_optim_hparams;

/* PyTorch's defaults. */
#define NB_SGD_DEFAULTS ((nb_optim_hparams){.lr = 1e-3})
#define NB_ADAM_DEFAULTS ((nb_optim_hparams){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8})
#define NB_ADAMW_DEFAULTS                                                   \
    ((nb_optim_hparams){.lr = 1e-3, .weight_decay = 1e-2, .beta1 = 0.9, .beta2 = 0.999,   \
                        .eps = 1e-8})

typedef struct nb_param_group {
    const nb_named_tensor *params;
    int n;
    nb_optim_hparams h;
} nb_param_group;

/* An optimizer over n_groups groups (copied: the arrays need not outlive
 * the call). Every parameter must be a leaf that requires grad, f32 or
 * f64, contiguous, with a unique non-empty name, in exactly one group;
 * groups may be empty but not all of them. Aborts with a message naming
 * the parameter or hyperparameter otherwise. */
NB_API nb_optim *nb_optim_new_groups(nb_optim_kind kind, int n_groups,
                                     const nb_param_group *groups);
/* One group. */
NB_API nb_optim *nb_optim_new(nb_optim_kind kind, const nb_named_tensor *params, int n,
                       const nb_optim_hparams *h);
NB_API void nb_optim_free(nb_optim *opt); /* NULL is fine */

/* The usual two groups: group 0 holds the parameters with ndim >= 2
 * (weight matrices, embeddings, kernels) with h's weight decay; group 1
 * holds those with ndim < 2 (biases, norm weights) with weight decay 0.
 * `scratch` receives the n parameters reordered (group 0 first) and must
 * live until the groups are passed to nb_optim_new_groups. */
NB_API void nb_optim_split_decay(const nb_named_tensor *params, int n, const nb_optim_hparams *h,
                          nb_named_tensor *scratch, nb_param_group out[2]);

/* One update of every parameter that has a gradient. */
NB_API void nb_optim_step(nb_optim *opt);
/* Zeroes the gradient of every parameter that has one (buffers are kept);
 * a parameter without one keeps none, as PyTorch's
 * zero_grad(set_to_none=False). */
NB_API void nb_optim_zero_grad(nb_optim *opt);
/* Sets the gradient of every parameter to NULL, as PyTorch's
 * zero_grad(set_to_none=True); the memory stays reserved, and the next
 * backward's first contribution to a parameter is written into it rather
 * than added to zeros (no zeroing pass, no read of zeros). A parameter
 * that gets no gradient before the next step keeps NULL and is not
 * updated (no weight decay either). Works with DDP (find_unused_parameters):
 * a parameter unused on some ranks gets zeros there, its bucket being
 * reduced, so it ends with the average of the ranks that used it; one
 * unused on every rank keeps NULL, as PyTorch's DDP leaves its grad None
 * (Note [Unused parameters] in distributed/ddp.c). Aborts for an
 * optimizer stepped per bucket or sharded (ZeRO, FSDP), whose owner
 * handles the gradients' memory itself. */
NB_API void nb_optim_zero_grad_to_none(nb_optim *opt);

NB_API nb_optim_kind nb_optim_get_kind(const nb_optim *opt);
NB_API int nb_optim_group_count(const nb_optim *opt);
NB_API int nb_optim_param_count(const nb_optim *opt);
/* Number of nb_optim_step calls so far (restored from checkpoints). */
NB_API int64_t nb_optim_step_count(const nb_optim *opt);
NB_API nb_optim_hparams nb_optim_group_hparams(const nb_optim *opt, int group);
NB_API double nb_optim_lr(const nb_optim *opt, int group);
NB_API void nb_optim_set_lr(nb_optim *opt, int group, double lr);
NB_API void nb_optim_set_lr_all(nb_optim *opt, double lr);
NB_API void nb_optim_set_weight_decay(nb_optim *opt, int group, double weight_decay);

/* ---- state, for checkpoints ----
 * Named views of the optimizer's whole state, in its own context (valid
 * until nb_optim_free); *n receives the count. Names:
 *   optim.step                           i64 scalar, nb_optim_step calls
 *   optim.group.<g>.<hparam>             f64 scalars: lr, weight_decay, and
 *                                        momentum, dampening, nesterov (SGD)
 *                                        or beta1, beta2, eps (Adam, AdamW),
 *                                        and amsgrad (1) only for Adam and
 *                                        AdamW groups made with amsgrad
 *   optim.state.<param>.step             i64 scalar, updates of that parameter
 *   optim.state.<param>.exp_avg          Adam, AdamW: first moment
 *   optim.state.<param>.exp_avg_sq       Adam, AdamW: second moment
 *   optim.state.<param>.max_exp_avg_sq   Adam, AdamW with amsgrad: the
 *                                        maximum of exp_avg_sq so far
 *   optim.state.<param>.momentum_buffer  SGD with momentum
 * (A checkpoint made without amsgrad therefore has the same names as
 * before the option existed, and one made with it does not load into an
 * optimizer made without it, nor the other way round: the strict load
 * names the missing or unexpected tensors.)
 * Loading a checkpoint writes into these tensors, hyperparameters
 * included (as PyTorch's load_state_dict does); call
 * nb_optim_state_validate afterwards (nb_checkpoint_load_training does). */
NB_API const nb_named_tensor *nb_optim_state(nb_optim *opt, int *n);
/* NB_ERR_FORMAT, with a message naming the value, when loaded state is out
 * of range (negative step count or learning rate, beta outside [0, 1),
 * nesterov or amsgrad neither 0 nor 1, ...); NB_ERR_MISMATCH when it asks
 * for state the optimizer was not made with (momentum without momentum
 * buffers, amsgrad turned off in a group made with it). */
NB_API nb_status nb_optim_state_validate(nb_optim *opt);
/* Bytes of element-wise state this rank holds for opt (moments, momentum
 * buffers, max_exp_avg_sq; not the scalars): with ZeRO-1
 * (nb_ddp_set_zero) the shard's, about 1/R of the whole. */
NB_API size_t nb_optim_state_bytes(const nb_optim *opt);

/* ---- gradient clipping ----
 * Total norm of the gradients of params (those with a gradient), over all
 * of them as one vector, computed in double; norm_type is 2.0 or INFINITY.
 * When the norm exceeds max_norm, every gradient is scaled by
 * max_norm / (norm + 1e-6). When the norm is inf or NaN the gradients are
 * left untouched and the non-finite norm is returned, so the caller can
 * skip the step (PyTorch would scale them by NaN). */
NB_API double nb_clip_grad_norm(const nb_named_tensor *params, int n, double max_norm,
                         double norm_type);
/* The same over all parameters of an optimizer. */
NB_API double nb_optim_clip_grad_norm(nb_optim *opt, double max_norm, double norm_type);
/* The same clipping without waiting for the device: the norm is returned
 * as a 0-d f64 tensor made in ctx (on the gradients' device) and the
 * gradients are scaled by a coefficient formed there, so on a GPU the
 * host goes on queueing the optimizer's step while the norm is computed.
 * Read the norm with nb_item only when you want it (after the step, say):
 * that read waits for the device. The results are those of
 * nb_clip_grad_norm, bit for bit. Gradients that are not all f32 and
 * contiguous are clipped as nb_clip_grad_norm does (one host read inside). */
NB_API nb_tensor *nb_clip_grad_norm_tensor(nb_ctx *ctx, const nb_named_tensor *params, int n,
                                    double max_norm, double norm_type);
NB_API nb_tensor *nb_optim_clip_grad_norm_tensor(nb_optim *opt, nb_ctx *ctx, double max_norm,
                                          double norm_type);
/* Clipping folded into the step (Note [Clipping inside the step] in
 * optim/clip.c): the norm of the optimizer's gradients is formed on their
 * device (a 0-d f64 tensor made in ctx, returned) and the update reads
 * each gradient element as nb_optim_clip_grad_norm would have left it,
 * coefficient included, so no pass scales the gradients and the host
 * reads nothing: the parameters and state come out bit for bit as after
 * nb_optim_clip_grad_norm then nb_optim_step. The gradients themselves
 * are left unscaled. A norm that is not finite skips the update (the
 * parameters and state stay as they were); the host cannot know that
 * without reading the norm, so the step counts have advanced: a caller
 * that reads a non-finite norm calls nb_optim_unstep to take them back,
 * which leaves the optimizer exactly as a skipped nb_optim_step would.
 * Gradients that are not all f32 and contiguous take the host path
 * (nb_optim_clip_grad_norm, then nb_optim_step when the norm is finite;
 * one host read; nb_optim_unstep is then refused as nothing is to undo). */
NB_API nb_tensor *nb_optim_step_clipped(nb_optim *opt, nb_ctx *ctx, double max_norm,
                                        double norm_type);
/* After nb_optim_step_clipped whose norm turned out not finite: takes
 * back the step counts it advanced (the device did not update). Aborts
 * when the last step was not such a step. */
NB_API void nb_optim_unstep(nb_optim *opt);

/* ---- dynamic loss scaling (f16 training) ----
 * PyTorch's GradScaler: multiply the loss by the scale before backward
 * (nb_grad_scaler_scale); nb_grad_scaler_step divides every gradient of the
 * optimizer's parameters by the scale in place, checks that all are
 * finite (one reduction, one host read), and steps the optimizer only
 * then; nb_grad_scaler_update then multiplies the scale by backoff_factor
 * after a step with an inf or a NaN, or by growth_factor after
 * growth_interval finite steps in a row. PyTorch's defaults: 65536.0, 2.0,
 * 0.5, 2000. CPU and CUDA parameters. docs/optim.md has an example. */
typedef struct nb_grad_scaler nb_grad_scaler;

NB_API nb_grad_scaler *nb_grad_scaler_new(double init_scale, double growth_factor,
                                   double backoff_factor, int64_t growth_interval);
NB_API void nb_grad_scaler_free(nb_grad_scaler *s); /* NULL is fine */
/* loss * scale, recorded by autograd (in ctx). */
NB_API nb_tensor *nb_grad_scaler_scale(nb_grad_scaler *s, nb_ctx *ctx, nb_tensor *loss);
/* Divides the gradients by the scale and checks them, without stepping
 * (to clip unscaled gradients before nb_grad_scaler_step, which then does
 * not unscale again). At most once between two updates. */
NB_API void nb_grad_scaler_unscale(nb_grad_scaler *s, nb_optim *opt);
/* Unscales (unless nb_grad_scaler_unscale did) and steps the optimizer
 * when every gradient is finite; returns whether it stepped. Once between
 * two updates. */
NB_API bool nb_grad_scaler_step(nb_grad_scaler *s, nb_optim *opt);
/* Adjusts the scale after nb_grad_scaler_step. */
NB_API void nb_grad_scaler_update(nb_grad_scaler *s);
NB_API double nb_grad_scaler_get_scale(const nb_grad_scaler *s);

/* ---- learning-rate schedules ----
 * A schedule is a pure function of the step (the 0-based index of the
 * update about to be made), so resuming from a checkpoint gives the same
 * rates. With warmup W > 0, steps 0 .. W-1 ramp linearly:
 * lr * (step + 1) / W. After warmup, with t = step - W:
 *   constant: lr
 *   step:     lr * gamma^floor(t / step_size)            (PyTorch's StepLR)
 *   cosine:   min_lr + (lr - min_lr) (1 + cos(pi t / (total - W))) / 2,
 *             and min_lr from step `total` on. */
typedef enum nb_lr_kind { NB_LR_CONSTANT = 0, NB_LR_STEP, NB_LR_COSINE } nb_lr_kind;

typedef struct nb_lr_schedule {
    nb_lr_kind kind;
    double lr;            /* peak / base rate */
    int64_t warmup_steps; /* 0: none */
    int64_t step_size;    /* STEP */
    double gamma;         /* STEP */
    int64_t total_steps;  /* COSINE: step at which min_lr is reached */
    double min_lr;        /* COSINE */
} nb_lr_schedule;

NB_API nb_lr_schedule nb_lr_constant(double lr, int64_t warmup_steps);
NB_API nb_lr_schedule nb_lr_step_decay(double lr, int64_t warmup_steps, int64_t step_size,
                                       double gamma);
NB_API nb_lr_schedule nb_lr_cosine(double lr, int64_t warmup_steps, int64_t total_steps,
                                   double min_lr);
/* The rate at `step` (>= 0). */
NB_API double nb_lr_schedule_at(const nb_lr_schedule *s, int64_t step);

#ifdef __cplusplus
}
#endif
#endif
