/* Device availability and the lookup's failure path (tensor/backend.h). */
#include "tensor/backend.h"
#include "tensor/cuda/cuda.h" /* nb__cuda_device_count (0 without CUDA) */
#include "tensor/cuda_plugin.h"

nb_status nb__device_available(const char *op, nb_device device) {
    if (device.type == NB_DEVICE_CPU) return NB_OK;
    if (device.type == NB_DEVICE_META && nb__meta_backend(device.index)) return NB_OK;
    if (device.type == NB_DEVICE_CUDA && device.index >= 0 &&
        device.index < nb__cuda_device_count())
        return NB_OK;
    const char *why = NABLA_HAVE_CUDA ? nb__cuda_plugin_error() : "this build has no CUDA";
    return nb_set_error(NB_ERR_UNSUPPORTED, "%s: device %s is not available (%s)", op,
                        nb_device_name(device), *why ? why : "not a visible CUDA device");
}

void nb__backend_missing(nb_device device) {
    NB_ABORT("nb__backend_of: no backend for device %s in this build%s", nb_device_name(device),
             device.type != NB_DEVICE_CUDA ? ""
             : NABLA_HAVE_CUDA             ? " (the CUDA backend is not loaded)"
                                           : " (built without CUDA)");
}
