/* The CUDA runtime layer (placeholder until the full runtime lands). */
#include <cuda_runtime.h>

#include "tensor/cuda/cuda.h"

int nb__cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver or no device: clear the sticky error */
        return 0;
    }
    return n;
}

nb_status nb__cuda_set_device(int device) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return nb_set_error(NB_ERR_INTERNAL, "cudaSetDevice(%d) failed: %s", device,
                            cudaGetErrorString(e));
    return NB_OK;
}
