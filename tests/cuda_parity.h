/* CUDA-against-CPU parity checks for the GPU suites (tests/test_cuda_*.c).
 *
 * nbt_parity runs one op twice on the same random inputs: on the CPU in
 * f64 (the reference) and on CUDA in the dtype under test, with poisoned
 * outputs (Note [Poisoned outputs] in tensor/cuda/cuda.h). It compares the
 * outputs and, unless told not to, the gradients of every float input
 * that requires grad, after a backward of sum(out * R) with a random R
 * (the same on both sides). The error is normalised:
 *     max |cuda - ref| / max(max |ref|, floor)
 * with floor 1e-6, or 2^-14 for an f16 result (the smallest normal f16:
 * below it f16 steps by 2^-24 absolute, so relative figures mean nothing),
 * and must stay under the tolerance of the dtype under test (NBT_TOL_*),
 * or the case's own. A NaN anywhere in the CUDA result where the
 * reference has none fails the check (an element the kernel did not write
 * is NaN by poisoning). Failure messages name the case, the tensor
 * (output, or grad of input i), the worst element and both values.
 *
 * Note [CPU stand-in mode]
 * With NBT_PARITY_DEVICE=cpu in the environment the side under test runs
 * on the CPU instead of CUDA, in the dtype under test, without poisoning:
 * the CPU in f32 (or f64) against the CPU in f64. This runs the tests'
 * own logic (shapes, which inputs get gradients, expectations, tolerances)
 * on a machine without a GPU, so that a test bug shows before a run on
 * a GPU. CTest runs each GPU suite that has parity cases a second time
 * in this mode, as <suite>_logic (label cpu). It says nothing about the
 * CUDA kernels.
 * In this mode:
 *   - nbt_parity returns 0 at once, counted as "not run here", for a
 *     case with a bf16 or f16 input (storage types on the CPU); cases
 *     with other reasons to be left out are filtered by the tests
 *     (nbt_dtype_runs, e.g. a bf16 compute dtype or a cast to f16);
 *   - a test that only makes sense on a device (poisoning, streams,
 *     deferred faults, cuDNN counters, TF32, bitwise CUDA-vs-CPU random
 *     numbers, nb_cuda_* calls) starts with NBT_DEVICE_ONLY("why");
 *   - a test of a TCase made by nbt_tcase_create fails when it ran no
 *     case at all (nbt_parity or nbt_device) and was not NBT_DEVICE_ONLY,
 *     so that a filter cannot quietly empty a test. */
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
 * why when nabla was built without CUDA or no device is visible, unless in
 * the CPU stand-in mode (Note [CPU stand-in mode]). Sets CK_FORK=no. */
void nbt_cuda_require(void);

/* Whether the CPU stand-in mode is on (NBT_PARITY_DEVICE=cpu). */
bool nbt_standin(void);

/* The device of the side under test: cuda:0, or the CPU in the stand-in
 * mode. For tests that compare on their own; counts as a case run. */
nb_device nbt_device(void);

/* Whether the side under test computes in dt: always on CUDA; in the
 * stand-in mode not bf16 and f16, which the CPU only stores. */
bool nbt_dtype_runs(nb_dtype dt);

/* A TCase (tcase_create) whose tests, in the stand-in mode, must run at
 * least one case or be NBT_DEVICE_ONLY. */
TCase *nbt_tcase_create(const char *name);

/* In the stand-in mode: prints that the test is left out and why, marks it
 * so for nbt_tcase_create's check, and returns true. Otherwise false. */
bool nbt_device_only(const char *test, const char *why);

/* First statement of a test that only makes sense on a real device. */
#define NBT_DEVICE_ONLY(why)                                                              \
    do {                                                                                  \
        if (nbt_device_only(__func__, why)) return;                                       \
    } while (0)

/* Host values of any tensor (any device, any dtype) as doubles, in
 * row-major order; the caller frees. */
double *nbt_values(const nb_tensor *t);

#endif
