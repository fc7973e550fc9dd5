/* CUDA-against-CPU parity checks for the GPU suites (tests/test_cuda_*.c).
 *
 * nbt_parity runs one op twice on the same random inputs: on the CPU in
 * f64 (the reference) and on CUDA in the dtype under test, with poisoned
 * outputs (Note [Poisoned outputs] in tensor/cuda/cuda.h). It compares the
 * outputs and, unless told not to, the gradients of every float input
 * that requires grad, after a backward of sum(out * R) with a random R
 * (the same on both sides). The error is normalised:
 *     max |cuda - ref| / max(max |ref|, 1e-6)
 * and must stay under the tolerance of the dtype under test (NBT_TOL_*),
 * or the case's own. A NaN anywhere in the CUDA result where the
 * reference has none fails the check (an element the kernel did not write
 * is NaN by poisoning). Failure messages name the case, the tensor
 * (output, or grad of input i), the worst element and both values. */
#ifndef NABLA_TESTS_CUDA_PARITY_H
#define NABLA_TESTS_CUDA_PARITY_H

#include <stdbool.h>
#include <stdint.h>

#include "testutil.h"

/* Default tolerances by the precision of the CUDA computation. */
#define NBT_TOL_F32 1e-5
#define NBT_TOL_TF32 5e-3
#define NBT_TOL_BF16 3e-2
#define NBT_TOL_F16 5e-3
#define NBT_TOL_F64 1e-12

typedef struct nbt_input {
    nb_dtype dtype;    /* of the CUDA tensor; the CPU reference uses f64 for floats */
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    double lo, hi;     /* floats: uniform in [lo, hi) (both 0: [-1, 1));
                          integers: uniform in [lo, hi) */
    bool no_grad;      /* a float input that does not require grad */
    bool transposed;   /* hand the op a non-contiguous view: the tensor is made
                          with its last two dims swapped, then transposed back */
    const double *values; /* explicit values (numel of them) instead of random ones */
} nbt_input;

/* The op under test: makes its output from the inputs in ctx. `in` are
 * on the context's device (CPU f64 reference or CUDA). It may return a
 * tensor of any float dtype; integer outputs are compared exactly and get
 * no backward. */
typedef nb_tensor *(*nbt_op_fn)(nb_ctx *ctx, nb_tensor *const *in, void *user);

typedef struct nbt_parity_opts {
    double tol;        /* 0: by the dtype of the first float input (NBT_TOL_*) */
    double grad_tol;   /* 0: same as tol */
    bool no_backward;  /* compare the output only */
    uint64_t seed;     /* 0: a fixed default */
} nbt_parity_opts;

/* Runs the comparison; fails the current Check test (ck_assert) on a
 * mismatch. opts NULL: defaults. Returns the worst normalised error seen. */
double nbt_parity(const char *name, nbt_op_fn fn, void *user, int n, const nbt_input *in,
                  const nbt_parity_opts *opts);

/* Call first in main(): exits with 77 (CTest "skipped") and a line saying
 * why when nabla was built without CUDA or no device is visible. */
void nbt_cuda_require(void);

/* Host values of any tensor (any device, any dtype) as doubles, in
 * row-major order; the caller frees. */
double *nbt_values(const nb_tensor *t);

#endif
