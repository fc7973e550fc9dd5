/* Modules: a tree of layers with named parameters and buffers, and the
 * built-in layers and losses. See docs/modules.md for a guide and
 * Note [Modules] in nn/module.c for the design.
 *
 * A module is an opaque handle made in a persistent context, which holds
 * the module itself, its parameters and its buffers: there is nothing to
 * free but the context. A forward takes the per-step context that receives
 * activations and the tape. Names follow PyTorch's state_dict keys:
 * "blocks.0.attn.c_attn.weight", "bn1.running_mean".
 *
 * Letters in shape comments: N batch, C channels or features, H/W height and
 * width, T sequence length, (..) any leading dims. */
#ifndef NABLA_NN_H
#define NABLA_NN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "nabla/api.h"
#include "nabla/context.h"
#include "nabla/error.h"
#include "nabla/ops.h"
#include "nabla/random.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nb_module nb_module;

/* What a kind of module is and does: one static const instance per kind. */
typedef struct nb_module_type {
    const char *name; /* "Linear": for messages and printing */
    size_t self_size; /* bytes of per-module state, zeroed, from nb_module_self; may be 0 */
    /* Single-input forward, or NULL for modules called through functions of
     * their own (nb_loss_forward, a user's two-input block). */
    nb_tensor *(*forward)(nb_module *m, nb_ctx *ctx, nb_tensor *x);
    /* Optional: the configuration for printing, e.g. "in_features=3, out_features=4". */
    void (*describe)(nb_module *m, char *buf, size_t size);
} nb_module_type;

/* ---- building a tree ---- */
/* A module of `type`, its state zeroed, in training mode, made in ctx. */
NB_API nb_module *nb_module_new(nb_ctx *ctx, const nb_module_type *type);
/* The module's state block, after checking that m is of `type`. */
NB_API void *nb_module_self(nb_module *m, const nb_module_type *type);
NB_API bool nb_module_is(const nb_module *m, const nb_module_type *type);
NB_API const char *nb_module_type_name(const nb_module *m);
NB_API nb_ctx *nb_module_ctx(const nb_module *m);

/* Registration; each returns what it registered. A name is non-empty, has
 * no '.', and is unique among m's parameters, buffers and children. */
/* A child module. */
NB_API nb_module *nb_module_add(nb_module *m, const char *name, nb_module *child);
/* A child named after its index among m's children: "0", "1", ... */
NB_API nb_module *nb_module_append(nb_module *m, nb_module *child);
/* A parameter: a float leaf, made to require grad. */
NB_API nb_tensor *nb_module_add_param(nb_module *m, const char *name, nb_tensor *t);
/* A buffer: state saved with the parameters but not trained (running
 * statistics). Never requires grad. */
NB_API nb_tensor *nb_module_add_buffer(nb_module *m, const char *name, nb_tensor *t);

/* ---- running ---- */
/* Calls the module's single-input forward; aborts when it has none. */
NB_API nb_tensor *nb_module_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
/* Recomputation (PyTorch's activation checkpointing): with `on`, m's
 * forward keeps only its input, and backward runs the forward again to get
 * what it needs, trading one more forward of m for its activations'
 * memory. Gradients are bitwise those without it (dropout draws the same
 * masks). For modules whose forward has one input and whose parameters
 * are m's own (a transformer block: nb_gpt_set_recompute). Note
 * [Recomputation] in nn/recompute.c. */
NB_API void nb_module_set_recompute(nb_module *m, bool on);
/* Sets training (true) or evaluation mode on m and every descendant. */
NB_API void nb_module_train(nb_module *m, bool training);
NB_API void nb_module_eval(nb_module *m);
NB_API bool nb_module_is_training(const nb_module *m);

/* ---- children ---- */
NB_API int nb_module_num_children(const nb_module *m);
NB_API nb_module *nb_module_child_at(const nb_module *m, int i);
NB_API const char *nb_module_child_name_at(const nb_module *m, int i);
/* A descendant by dotted path ("blocks.0.attn"; "" is m itself), or NULL. */
NB_API nb_module *nb_module_child(nb_module *m, const char *path);

/* ---- parameters and state ----
 * Order: pre-order over the tree (a module, then its children in
 * registration order); within a module, its parameters, then (for the
 * state) its buffers, each in registration order. A tensor registered under
 * several names (tied weights, a shared child) appears once, under its
 * first name. Each call writes up to `cap` entries to `out` (out may be NULL
 * when cap is 0) and returns how many there are; the names are relative to
 * m and stay valid as long as m's context. */
NB_API int nb_module_named_parameters(nb_module *m, nb_named_tensor *out, int cap);
NB_API int nb_module_named_buffers(nb_module *m, nb_named_tensor *out, int cap);
/* Parameters and buffers: what a checkpoint saves. */
NB_API int nb_module_state(nb_module *m, nb_named_tensor *out, int cap);
/* A parameter or buffer by dotted name ("layers.0.weight"), or NULL. */
NB_API nb_tensor *nb_module_find(nb_module *m, const char *name);
/* Total elements over the parameters (each counted once). */
NB_API int64_t nb_module_num_params(nb_module *m);
/* Zeroes every parameter's gradient in place. */
NB_API void nb_module_zero_grad(nb_module *m);

/* Moves every parameter and buffer of the tree into ctx: new contiguous
 * storage on ctx's device (CPU to CPU included), the values copied, each
 * tensor's identity kept (pointers held elsewhere, by the layers, an
 * optimizer, stay valid: make the optimizer after the move, as its state
 * is on the old device), its name, requires_grad and hooks kept; a tensor
 * registered twice (tied weights) moves once and stays shared. Gradients
 * are dropped (->grad NULL). Tensors already in ctx stay where they are.
 * The module structs stay in their own context, which must outlive the
 * model as before. Reads of device memory wait for the device. NB_OK. */
NB_API nb_status nb_module_to(nb_module *m, nb_ctx *ctx);

/* PyTorch-style: "Sequential(\n  (0): Linear(in_features=2, ...)\n)". */
NB_API void nb_module_fprint(FILE *f, nb_module *m);
NB_API void nb_module_print(nb_module *m);

/* ---- initialisation (in place, from `rng`; NULL: the default generator) ---- */
NB_API void nb_init_uniform_(nb_tensor *t, double low, double high, nb_rng *rng);
NB_API void nb_init_normal_(nb_tensor *t, double mean, double std, nb_rng *rng);
/* shape[1] * prod(shape[2:]): in_features of a Linear weight (out, in),
 * in_channels / groups * kh * kw of a Conv2d weight (out, in / groups, kh, kw). */
NB_API int64_t nb_init_fan_in(const nb_tensor *weight);

/* ---- layers ----
 * Parameters are made in ctx with `dtype` (f32, or f64 for gradchecks) and
 * initialised as PyTorch does, drawing from `rng` (NULL: the default
 * generator) in the order listed. Names of parameters, buffers and children
 * are given in quotes. */

/* "weight" (out, in) ~ U(-1/sqrt(in), 1/sqrt(in)), "bias" (out) the same.
 * x (.., in) -> (.., out) = x weight^T + bias. */
NB_API nb_module *nb_linear_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_features,
                                int64_t out_features,
                         bool bias, nb_rng *rng);

/* "weight" (out, in / groups, kh, kw), "bias" (out), both U(-1/sqrt(fan_in),
 * 1/sqrt(fan_in)), fan_in = in / groups * kh * kw. x (N, in, H, W) -> (N, out,
 * OH, OW). opts NULL: stride 1, no padding, dilation 1, one group; in and out
 * must be divisible by opts->groups (groups = in: depthwise). */
NB_API nb_module *nb_conv2d_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_channels,
                                int64_t out_channels,
                         int kernel_h, int kernel_w, const nb_conv2d_opts *opts, bool bias,
                         nb_rng *rng);

/* Momentum value that asks for a cumulative moving average (PyTorch's
 * momentum=None): factor 1 / num_batches_tracked. */
#define NB_BATCH_NORM_CUMULATIVE (-1.0)
typedef struct nb_batch_norm_opts {
    double eps;               /* 1e-5 */
    double momentum;          /* 0.1; in [0, 1] or NB_BATCH_NORM_CUMULATIVE */
    bool affine;              /* "weight" (ones) and "bias" (zeros) */
    bool track_running_stats; /* "running_mean" (zeros), "running_var" (ones),
                                 "num_batches_tracked" (i64, 0-d) */
} nb_batch_norm_opts;
#define NB_BATCH_NORM_DEFAULTS                                                                 \
    ((nb_batch_norm_opts){                                                                 \
        .eps = 1e-5, .momentum = 0.1, .affine = true, .track_running_stats = true})
/* Training mode normalises with the batch statistics and updates the
 * running ones (unbiased variance); evaluation mode uses the running ones,
 * or the batch's when the layer does not track them. opts NULL: defaults.
 * 1d: x (N, C) or (N, C, L); 2d: x (N, C, H, W). */
NB_API nb_module *nb_batch_norm1d_new(nb_ctx *ctx, nb_dtype dtype, int64_t num_features,
                               const nb_batch_norm_opts *opts);
NB_API nb_module *nb_batch_norm2d_new(nb_ctx *ctx, nb_dtype dtype, int64_t num_features,
                               const nb_batch_norm_opts *opts);

typedef struct nb_layer_norm_opts {
    double eps;              /* 1e-5 */
    bool elementwise_affine; /* "weight" (ones) */
    bool bias;               /* "bias" (zeros); only with elementwise_affine */
} nb_layer_norm_opts;
#define NB_LAYER_NORM_DEFAULTS                                                                 \
    ((nb_layer_norm_opts){.eps = 1e-5, .elementwise_affine = true, .bias = true})
/* Normalises over the trailing dims `shape` (NB_SHAPE(768) works for the
 * ndim, shape pair). x (.., shape) -> same. opts NULL: defaults. */
NB_API nb_module *nb_layer_norm_new(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                             const nb_layer_norm_opts *opts);

/* "weight" (num, dim) ~ N(0, 1). indices (..) of i32/i64 -> (.., dim). */
NB_API nb_module *nb_embedding_new(nb_ctx *ctx, nb_dtype dtype, int64_t num_embeddings,
                            int64_t embedding_dim, nb_rng *rng);

/* Zeroes elements with probability p in training mode; the identity in
 * evaluation mode. Masks come from `rng` (kept: it must outlive the module;
 * NULL: the default generator at each forward). */
NB_API nb_module *nb_dropout_new(nb_ctx *ctx, double p, nb_rng *rng);

NB_API nb_module *nb_relu_new(nb_ctx *ctx);
NB_API nb_module *nb_gelu_new(nb_ctx *ctx, nb_gelu_approx approx);
NB_API nb_module *nb_tanh_new(nb_ctx *ctx);

/* x (N, C, H, W); see nb_max_pool2d / nb_avg_pool2d for the options. */
NB_API nb_module *nb_max_pool2d_new(nb_ctx *ctx, const nb_pool2d_opts *opts);
NB_API nb_module *nb_avg_pool2d_new(nb_ctx *ctx, const nb_pool2d_opts *opts);
/* Mean over H and W: x (N, C, H, W) -> (N, C, 1, 1), as PyTorch's
 * AdaptiveAvgPool2d(1); follow it with a Flatten for (N, C). */
NB_API nb_module *nb_global_avg_pool2d_new(nb_ctx *ctx);
/* nb_flatten(x, start_dim, end_dim); PyTorch's defaults are (1, -1). */
NB_API nb_module *nb_flatten_new(nb_ctx *ctx, int start_dim, int end_dim);

/* Children "0" .. "n-1" applied in order; more with nb_module_append. */
NB_API nb_module *nb_sequential_new(nb_ctx *ctx, int n, nb_module *const *children);
/* A container with no forward (PyTorch's ModuleList): fill it with
 * nb_module_append, reach the children with nb_module_child_at. */
NB_API nb_module *nb_module_list_new(nb_ctx *ctx);

typedef struct nb_attention_opts {
    bool bias;            /* biases in c_attn and c_proj (GPT-2 has them) */
    double attn_dropout;  /* on the attention weights */
    double resid_dropout; /* on the output projection */
    nb_rng *dropout_rng;  /* kept; NULL: the default generator */
} nb_attention_opts;
#define NB_ATTENTION_DEFAULTS                                                                  \
    ((nb_attention_opts){                                                                  \
        .bias = true, .attn_dropout = 0.0, .resid_dropout = 0.0, .dropout_rng = NULL})
/* Causal multi-head self-attention, x (N, T, C) -> (N, T, C), with
 * n_head heads of D = C / n_head. Children, in this order: "c_attn"
 * Linear(C, 3C) whose output is q, k, v in that order along the last dim,
 * each split into heads (head h takes features h*D .. (h+1)*D - 1);
 * "c_proj" Linear(C, C); "attn_dropout" and "resid_dropout", Dropout.
 * Position j is hidden from positions i < j. opts NULL: defaults. */
NB_API nb_module *nb_causal_self_attention_new(nb_ctx *ctx, nb_dtype dtype, int64_t n_embd,
                                               int n_head,
                                        const nb_attention_opts *opts, nb_rng *rng);

/* ---- losses (modules without parameters; the mean over the batch) ---- */
/* opts NULL: the defaults of nb_cross_entropy. */
NB_API nb_module *nb_cross_entropy_loss_new(nb_ctx *ctx, const nb_cross_entropy_opts *opts);
NB_API nb_module *nb_mse_loss_new(nb_ctx *ctx);
NB_API nb_module *nb_bce_with_logits_loss_new(nb_ctx *ctx);
/* The loss of `input` against `target` (shapes and dtypes as the op). */
NB_API nb_tensor *nb_loss_forward(nb_module *loss, nb_ctx *ctx, nb_tensor *input,
                                  nb_tensor *target);

#ifdef __cplusplus
}
#endif
#endif
