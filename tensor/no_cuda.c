/* Without CUDA in the build: the CUDA runtime queries that code outside
 * tensor/cuda/ calls whatever the build (device counting in
 * tensor/context.c, tensor/backend.c and distributed/env.c, the poisoning
 * switch of the tests), answering "no device", and the public nabla/cuda.h
 * functions. The kernels have no stand-ins: nothing outside tensor/cuda/
 * calls them but through the backend table, and a build without CUDA has
 * no CUDA table (nb__backend_of refuses a CUDA device, and no CUDA context
 * can be made). */
#include "nabla/cuda.h"
#include "tensor/cuda/cuda.h"

#if !NABLA_HAVE_CUDA
int nb__cuda_device_count(void) { return 0; }

nb_status nb__cuda_set_device(int device) {
    return nb_set_error(NB_ERR_UNSUPPORTED,
                        "nb__cuda_set_device: device %d: nabla was built without CUDA", device);
}

/* Note [Poisoned outputs]: nothing to poison without CUDA tensors. */
static bool poison;
void nb__cuda_set_poison(bool on) { poison = on; }
bool nb__cuda_poison(void) { return poison; }

bool nb_cuda_available(void) { return false; }
int nb_cuda_device_count(void) { return 0; }
void nb_cuda_synchronize(nb_device device) {
    NB_ABORT("nb_cuda_synchronize: %s: nabla was built without CUDA", nb_device_name(device));
}
void nb_cuda_set_allow_tf32(bool on) { (void)on; }
bool nb_cuda_allow_tf32(void) { return false; }
#endif
