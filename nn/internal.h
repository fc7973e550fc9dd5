/* Internal interface of nn/: the module struct (Note [Modules] in
 * nn/module.c), the name cache of nn/state.c and checks shared by the
 * layers. Not installed. */
#ifndef NABLA_NN_INTERNAL_H
#define NABLA_NN_INTERNAL_H

#include <stdio.h>

#include "nabla/nn.h"
#include "tensor/internal.h"

/* Longest dotted name, terminator included. */
#define NB__NAME_MAX 512

typedef struct nb__slot {
    const char *name; /* copied into the module's context */
    void *ptr;        /* nb_tensor * or nb_module * */
} nb__slot;

typedef struct nb__slots {
    nb__slot *v;
    int n, cap;
} nb__slots;

typedef enum nb__list { NB__LIST_PARAMS, NB__LIST_BUFFERS, NB__LIST_STATE, NB__LIST_COUNT } nb__list;

struct nb_module {
    const nb_module_type *type;
    nb_ctx *ctx;
    void *self;
    bool training;
    bool recompute; /* Note [Recomputation] in nn/recompute.c */
    const struct nb__unit_hook *unit; /* a sharding unit's forward (distributed/fsdp.c), or NULL */
    nb__slots params, buffers, children; /* registration order */
    /* Flattened (name, tensor) lists relative to this module, rebuilt when
     * the subtree's registration count differs from cache_key. */
    int64_t cache_key;
    nb_named_tensor *cache[NB__LIST_COUNT];
    int cache_n[NB__LIST_COUNT];
};

/* m's forward run without a tape, recorded as one node that runs it again
 * during backward (nn/recompute.c). */
nb_tensor *nb__module_forward_recompute(nb_module *m, nb_ctx *ctx, nb_tensor *x);

/* A recomputed forward whose owner acts around each run (Note [FSDP] in
 * distributed/fsdp.c): before(user, backward) runs before the forward
 * (backward: before the run during backward and its inner walk),
 * after(user, backward) after it (backward: after the inner walk); the
 * node's inputs are x and leaves[0..n_leaves), which stand for the
 * module's parameters (their hooks fire after the node), instead of the
 * parameters themselves. */
typedef struct nb__recompute_ops {
    void (*before)(void *user, bool backward);
    void (*after)(void *user, bool backward);
    void *user;
    int n_leaves;
    nb_tensor **leaves;
} nb__recompute_ops;
nb_tensor *nb__module_forward_recompute_ops(nb_module *m, nb_ctx *ctx, nb_tensor *x,
                                            const nb__recompute_ops *ops);

/* A module whose forward a sharding layer runs: nb_module_forward calls
 * forward(m, ctx, x, user) in place of its own dispatch (recomputation
 * included). */
typedef struct nb__unit_hook {
    nb_tensor *(*forward)(nb_module *m, nb_ctx *ctx, nb_tensor *x, void *user);
    void *user;
} nb__unit_hook;
/* Sets or (NULL) clears m's hook; the hook struct outlives it. */
void nb__module_set_unit(nb_module *m, const nb__unit_hook *hook);
/* nb_module_forward without the unit hook. */
nb_tensor *nb__module_forward_own(nb_module *m, nb_ctx *ctx, nb_tensor *x);

/* Note [Fused module forwards]
 * A caller may compute a module's forward inside a larger fused op (a
 * residual add in the branch's last GEMM, the GPT's two embeddings in one
 * gather) instead of calling nb_module_forward. It must not change what
 * the module's forward does around the computation, so the fused op runs
 * through nb__module_forward_fused, as nb_module_forward runs m's own
 * forward: m's frame on the abort chain (an error inside names m's path,
 * Note [Module paths in errors] in nn/module.c) and m's memory scope. And
 * it may run only where nothing else acts on the forward: where
 * nb__module_forward_plain(m) is false (a sharding unit's hook, or
 * recomputation while gradients are on) the caller takes the module's
 * own forward; nb__module_forward_fused refuses such a module. Anything
 * new that acts on a module's forward joins that one predicate. */
bool nb__module_forward_plain(const nb_module *m);
typedef nb_tensor *(*nb__fused_forward_fn)(nb_module *m, nb_ctx *ctx, void *arg);
nb_tensor *nb__module_forward_fused(nb_module *m, nb_ctx *ctx, nb__fused_forward_fn fn, void *arg);

/* r + m(x) for a residual branch m whose forward fwd(m, ctx, x, r) adds r
 * itself, fused into its last op (Note [Residual in the GEMM] in
 * tensor/ops_matmul.c), through nb__module_forward_fused. A module that is
 * not plain (a unit hook or recomputation, which take x alone) is run by
 * nb_module_forward and r added after it. */
typedef nb_tensor *(*nb__residual_forward_fn)(nb_module *m, nb_ctx *ctx, nb_tensor *x,
                                              nb_tensor *r);
nb_tensor *nb__module_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r,
                                       nb__residual_forward_fn fwd);
/* r + the Linear m of x, the add in its GEMM (nn/linear.c). */
nb_tensor *nb__linear_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r);
/* r + the causal self-attention m of x, the add in c_proj's GEMM when no
 * active dropout stands between them (nn/attention.c). */
nb_tensor *nb__attention_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r);

/* The entry named `name` (len bytes, not terminated) or NULL. */
void *nb__slots_find(const nb__slots *s, const char *name, size_t len);
/* The cached list `which` of m, brought up to date. */
const nb_named_tensor *nb__module_cached(nb_module *m, nb__list which, int *n);

/* ---- checks shared by layer constructors and forwards ---- */
/* dtype must be f32 or f64 (what layers compute in on the CPU). */
void nb__nn_check_dtype(const char *fn, nb_dtype dtype);
/* x must have the parameters' dtype: "Linear: input is f32 but the layer's
 * parameters are f64". */
void nb__nn_check_input_dtype(const char *layer, const nb_tensor *x, nb_dtype dtype);

/* ---- SyncBatchNorm conversion (distributed/sync_batch_norm.c) ---- */
typedef nb_tensor *(*nb__batch_norm_fn)(nb_ctx *ctx, void *user, nb_tensor *x, nb_tensor *weight,
                                         nb_tensor *bias, nb_tensor *running_mean,
                                         nb_tensor *running_var, bool training, double momentum,
                                         double eps);
/* Turns a BatchNorm1d/2d into a "SyncBatchNorm" whose math is impl(user,
 * ...), keeping its tensors; false (and nothing done) for other modules. */
bool nb__batch_norm_convert(nb_module *m, nb__batch_norm_fn impl, void *user);

#endif
