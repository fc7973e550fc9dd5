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

#ifdef __cplusplus
}
#endif
#endif
