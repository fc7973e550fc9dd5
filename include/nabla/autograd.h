/* Reverse-mode autograd on a tape (Note [Tape] in autograd/backward.c).
 *
 * Under grad mode, an op whose input requires grad appends a node to the
 * tape of the context it writes to. nb_backward() walks that tape in
 * reverse. Gradients of leaves accumulate (+=) until zeroed; gradients of
 * other tensors are rewritten by each backward. When a leaf's gradient is
 * final within a backward pass, its gradient-ready hooks run, before the
 * tape nodes that come earlier are processed. */
#ifndef NABLA_AUTOGRAD_H
#define NABLA_AUTOGRAD_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backpropagates from a one-element tensor (seed 1). */
NB_API void nb_backward(nb_tensor *loss);
/* Backpropagates from any tensor with the given seed gradient (same shape). */
NB_API void nb_backward_with(nb_tensor *out, nb_tensor *grad_out);

/* A backward marks the graph it walked; a backward from the same loss, or
 * from any tensor of that graph, aborts ("already walked by a backward")
 * unless the earlier backward passed retain_graph; then the leaves
 * accumulate a second time, as in PyTorch. A new loss that only shares
 * part of a walked graph may be backpropagated (Note [Walked graphs] in
 * autograd/backward.c). */
typedef struct nb_backward_options {
    nb_tensor *grad;   /* seed gradient of out's shape; NULL: 1 (out has one element) */
    bool retain_graph; /* leave the graph walkable by another backward */
} nb_backward_options;
#define NB_BACKWARD_DEFAULTS ((nb_backward_options){.grad = NULL, .retain_graph = false})
/* nb_backward (grad NULL) or nb_backward_with (grad set) with options;
 * opts NULL: the defaults. */
NB_API void nb_backward_ex(nb_tensor *out, const nb_backward_options *opts);

/* Grad mode is per thread and on by default. */
NB_API bool nb_grad_enabled(void);
NB_API bool nb_set_grad_enabled(bool enabled); /* returns the previous mode */
/* Scope helpers: bool prev = nb_no_grad_begin(); ...; nb_no_grad_end(prev); */
static inline bool nb_no_grad_begin(void) { return nb_set_grad_enabled(false); }
static inline void nb_no_grad_end(bool previous) { nb_set_grad_enabled(previous); }

/* A view of x's storage that does not require grad. */
NB_API nb_tensor *nb_detach(nb_ctx *ctx, nb_tensor *x);

/* Gradient-ready hook: called with the leaf whose ->grad is now final for
 * this backward pass. Hooks run in registration order, on the thread that
 * called nb_backward. The hook record lives in the leaf's context. */
typedef void (*nb_grad_hook_fn)(nb_tensor *leaf, void *user);
NB_API void nb_add_grad_hook(nb_tensor *leaf, nb_grad_hook_fn fn, void *user);
/* Unregisters the hook added with the same (fn, user); false if none. */
NB_API bool nb_remove_grad_hook(nb_tensor *leaf, nb_grad_hook_fn fn, void *user);

/* Zeroes the gradient in place (keeps the buffer); no-op without one. */
NB_API void nb_zero_grad(nb_tensor *t);
/* Makes `grad` (same shape and dtype, any context) the gradient buffer of
 * leaf t; later backwards accumulate into it. DDP uses this to place
 * gradients in bucket memory. */
NB_API void nb_set_grad(nb_tensor *t, nb_tensor *grad);

/* ---- gradient check against float64 central differences ----
 * fn builds an output from the inputs in ctx; the check compares the
 * analytic gradient of sum(out * R), R a fixed random tensor, with
 * (f(x + eps) - f(x - eps)) / (2 eps) element by element, for every input
 * that requires grad (those must be f64). */
typedef nb_tensor *(*nb_gradcheck_fn)(nb_ctx *ctx, nb_tensor *const *inputs, void *user);

typedef struct nb_gradcheck_result {
    bool ok;
    double max_abs_err;  /* worst |analytic - numeric| */
    int worst_input;     /* which input */
    int64_t worst_index; /* row-major element index in that input */
    double analytic, numeric;
    char message[256];   /* human-readable summary */
} nb_gradcheck_result;

/* eps 0 -> 1e-6, atol 0 -> 1e-5, rtol 0 -> 1e-4; an element fails when
 * |a - n| > atol + rtol * |n|. */
NB_API nb_gradcheck_result nb_gradcheck(nb_gradcheck_fn fn, void *user, int n_inputs,
                                 nb_tensor *const *inputs, double eps, double atol,
                                 double rtol);

#ifdef __cplusplus
}
#endif
#endif
