/* The CUDA backend, seen from a program: whether it is there, waiting for
 * it, and its precision switches.
 *
 * Tensors live on a GPU when they are made in a context of that device:
 * nb_ctx_new(nb_cuda(i), 0). Ops on them are queued on the device's
 * compute stream and return at once; the host waits only where it reads
 * device memory (nb_to_host, nb_item, nb_get, printing) or calls
 * nb_cuda_synchronize. Bad data found by a kernel (an embedding index or a
 * cross-entropy target out of range) is reported at that next wait, with
 * the op and the offending value. Without CUDA in the build every query
 * answers "no device". */
#ifndef NABLA_CUDA_H
#define NABLA_CUDA_H

#include <stdbool.h>

#include "nabla/api.h"
#include "nabla/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* True when nabla was built with CUDA and at least one GPU is visible. */
NB_API bool nb_cuda_available(void);
/* Visible GPUs (0 without CUDA in the build or without a driver). */
NB_API int nb_cuda_device_count(void);
/* Waits until every op queued on the device has run, then reports any
 * fault a kernel found (through nb_abort, naming the op). */
NB_API void nb_cuda_synchronize(nb_device device);
/* TF32 tensor cores for f32 matrix products and convolutions (about 10
 * bits of mantissa in the products): off by default, as in PyTorch. */
NB_API void nb_cuda_set_allow_tf32(bool on);
NB_API bool nb_cuda_allow_tf32(void);

/* The events profile: with NABLA_CUDA_PROFILE=events in the environment
 * when the CUDA backend loads, every backend entry (matmul, layer_norm,
 * binary.add, ...) is timed on the GPU with a pair of CUDA events, and the
 * calls and microseconds per entry are summed (docs/cuda.md, "Profiling
 * without ncu"). nb_cuda_profile_reset forgets the sums so far (say, at the
 * start of the step to profile); nb_cuda_profile_write waits for the
 * recorded events, writes one line `entry calls us` per entry since the
 * last reset or write (path NULL: stderr), and starts the sums again. What
 * is unwritten at exit goes to $NABLA_CUDA_PROFILE_FILE, else stderr.
 * nb_cuda_profile_write returns NB_ERR_UNSUPPORTED when the profile is off
 * (or there is no CUDA), NB_ERR_IO when the file cannot be written. */
NB_API void nb_cuda_profile_reset(void);
NB_API nb_status nb_cuda_profile_write(const char *path);

#ifdef __cplusplus
}
#endif
#endif
