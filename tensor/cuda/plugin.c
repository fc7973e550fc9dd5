/* The CUDA plugin's entry point and its view of libnabla: the one
 * exported function, nb__cuda_plugin_init, and for each function of
 * libnabla that the plugin's code calls a local function of the same
 * name that calls libnabla's through the table it was given (Note [CUDA
 * plugin] in tensor/cuda_plugin.h). Compiled only into the plugin. */
#define NB__CUDA_PLUGIN_SIDE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/pg.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda_plugin.h"

extern const nb__backend nb__cuda_backend; /* tensor/cuda/backend.c */

static const nb__cuda_host *host;

NB_NORETURN void nb_abort(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    host->abort(file, line, msg);
    abort(); /* not reached: libnabla's nb_abort does not return */
}

nb_status nb_set_error(nb_status status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return host->set_error(status, msg);
}

#define FORWARD(ret, name, params, args)                                                          \
    ret name params { return host->name args; }
NB__CUDA_HOST_FUNCS(FORWARD)
#undef FORWARD

static const nb__cuda_plugin self = {
    .abi = NB__CUDA_PLUGIN_ABI,
    .version = NB__CUDA_PLUGIN_VERSION,
    .backend = &nb__cuda_backend,
    .nccl = &nb__pg_nccl_ops,
    .device_count = nb__cuda_device_count,
    .set_device = nb__cuda_set_device,
    .cudnn_workspace_size = nb__cuda_cudnn_workspace_size,
    .cudnn_workspace_limit = nb__cuda_cudnn_workspace_limit,
    .conv2d_workspace_sizes = nb__cuda_conv2d_workspace_sizes,
    .batch_norm_set_cudnn = nb__cuda_batch_norm_set_cudnn,
    .batch_norm_cudnn_calls = nb__cuda_batch_norm_cudnn_calls,
    .batch_norm_cudnn_ok = nb__cuda_batch_norm_cudnn_ok,
    .nccl_exchange = nb__nccl_exchange,
};

__attribute__((visibility("default"))) const nb__cuda_plugin *
nb__cuda_plugin_init(const nb__cuda_host *h) {
    if (h && h->abi == NB__CUDA_PLUGIN_ABI && h->version &&
        strcmp(h->version, NB__CUDA_PLUGIN_VERSION) == 0)
        host = h;
    return &self;
}
