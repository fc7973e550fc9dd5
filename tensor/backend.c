/* Device availability and the lookup's failure path (tensor/backend.h). */
#include "tensor/backend.h"
#include "tensor/cuda/cuda.h" /* nb__cuda_device_count (0 without CUDA) */

nb_status nb__device_available(const char *op, nb_device device) {
    if (device.type == NB_DEVICE_CPU) return NB_OK;
    if (device.type == NB_DEVICE_CUDA && device.index >= 0 &&
        device.index < nb__cuda_device_count())
        return NB_OK;
    return nb_set_error(NB_ERR_UNSUPPORTED, "%s: device %s is not available (%s)", op,
                        nb_device_name(device),
                        NABLA_HAVE_CUDA ? "not a visible CUDA device" : "this build has no CUDA");
}

void nb__backend_missing(nb_device device) {
    NB_ABORT("nb__backend_of: no backend for device %s in this build%s", nb_device_name(device),
             device.type == NB_DEVICE_CUDA && !NABLA_HAVE_CUDA ? " (built without CUDA)" : "");
}
