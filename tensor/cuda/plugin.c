/* The CUDA backend's entry point, nb__cuda_plugin_init: its table for
 * libnabla (Note [CUDA plugin] in tensor/cuda_plugin.h). The only symbol
 * the plugin exports; in libnabla.a, called directly. */
#include "tensor/cuda/cuda.h"
#include "tensor/cuda_plugin.h"

extern const nb__backend nb__cuda_backend; /* tensor/cuda/backend.c */
/* distributed/pg_nccl.c's table, opaque here: distributed/ reads it */
extern const struct nb__pg_ops nb__pg_nccl_ops;

static nb__cuda_plugin self = { /* backend: set by nb__cuda_plugin_init */
    .abi = NB__CUDA_PLUGIN_ABI,
    .version = NB__CUDA_PLUGIN_VERSION,
    .nccl = &nb__pg_nccl_ops,
    .device_count = nb__cuda_device_count,
    .set_device = nb__cuda_set_device,
    .cudnn_workspace_size = nb__cuda_cudnn_workspace_size,
    .cudnn_workspace_limit = nb__cuda_cudnn_workspace_limit,
    .conv2d_workspace_sizes = nb__cuda_conv2d_workspace_sizes,
    .batch_norm_set_cudnn = nb__cuda_batch_norm_set_cudnn,
    .batch_norm_cudnn_calls = nb__cuda_batch_norm_cudnn_calls,
    .batch_norm_cudnn_ok = nb__cuda_batch_norm_cudnn_ok,
    .profile_reset = nb__cuda_profile_reset,
    .profile_write = nb__cuda_profile_write,
};

/* Called once (libnabla's pthread_once), before any CUDA tensor exists:
 * the CUDA table, or its timed copy under NABLA_CUDA_PROFILE=events (Note
 * [Events profile] in profile.cu). */
__attribute__((visibility("default"))) const nb__cuda_plugin *nb__cuda_plugin_init(void) {
    if (!self.backend) self.backend = nb__cuda_profile_table(&nb__cuda_backend);
    return &self;
}
