/* Divergence in the training programs: a run whose gradients stay
 * non-finite skips every step and would go on for ever looking alive, and
 * a checkpoint written then would replace the last good one with NaN.
 *
 * After each step the programs call divergence_step with the gradient
 * norm: a finite norm resets the count of consecutive skipped steps; past
 * --max-skipped-steps of them the run stops with a message naming the
 * steps and the first parameter (in registration order) whose gradient is
 * not finite. Before each save, divergence_check_finite refuses
 * parameters or optimizer state that are not finite, so the file on disk
 * stays the last good checkpoint. Gradients and parameters are the same on
 * every rank after DDP's all-reduce, so every rank stops at the same step. */
#ifndef NABLA_EXAMPLES_DIVERGENCE_H
#define NABLA_EXAMPLES_DIVERGENCE_H

#include <stdint.h>

#include <nabla/nabla.h>

#define DIVERGENCE_DEFAULT_MAX_SKIPPED 10

typedef struct divergence {
    int64_t max_skipped;   /* consecutive skipped steps allowed; 0: no limit */
    int64_t skipped;       /* consecutive skipped steps so far */
    int64_t first_skipped; /* the first of them (1-based step) */
} divergence;

/* After step `step` (1-based) whose gradient norm was `norm`. NB_ERR_FORMAT
 * when the run must stop, the message naming the skipped steps and the
 * first of params[0..n) whose gradient is not finite (its values are read
 * through tensors made in `ctx`). */
nb_status divergence_step(divergence *g, nb_ctx *ctx, const nb_named_tensor *params, int n,
                          int64_t step, double norm);

/* NB_OK when every floating-point tensor of list[0..n) is finite; else
 * NB_ERR_FORMAT naming the first that is not and `what` (e.g. "step 40 not
 * saved"). */
nb_status divergence_check_finite(nb_ctx *ctx, const nb_named_tensor *list, int n,
                                  const char *what);

#endif
