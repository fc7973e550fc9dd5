/* The boundary between libnabla and its CUDA backend: what the backend
 * hands libnabla. The backend is tensor/cuda/ with the NCCL process group
 * (distributed/pg_nccl.c); libnabla (tensor/cuda_plugin.c) gets it on
 * first use, from the plugin libnabla_cuda.so (libnabla.so) or linked in
 * (libnabla.a), and the backend (tensor/cuda/plugin.c) answers with its
 * table. Note [CUDA plugin].
 *
 * Note [CUDA plugin]
 * With the shared library, the CUDA backend and the NCCL process group
 * are not in libnabla.so: they form a separate shared object,
 * libnabla_cuda.so, that libnabla opens with dlopen the first time a
 * program asks about CUDA devices (nb_cuda_device_count, nb_ctx_new on a
 * CUDA device, nb_pg_init choosing or asked for NCCL, device selection
 * from LOCAL_RANK). A program that never asks maps none of the CUDA
 * libraries (cudart, cuBLAS(Lt), cuDNN, NCCL), starts where they are
 * absent, and is smaller in memory by their size.
 *
 * The plugin links libnabla.so, as ggml's backends link ggml-base: its
 * code calls libnabla's public functions (NB_API, include/nabla/api.h)
 * and the few internals marked NB_PLUGIN_API, which libnabla.so exports
 * for it (tests/test_exports.py keeps that list short). A kernel that
 * calls another internal fails to link the plugin (it is linked with
 * --no-undefined), naming the function. The plugin exports one symbol,
 * nb__cuda_plugin_init (a version script); the rest of it is local. The
 * two refuse each other unless their plugin ABI number and nabla version
 * agree.
 *
 * The static library, libnabla.a, has the CUDA backend linked in (a build
 * with CUDA): a program linked with it never opens a plugin, which would
 * bring a second copy of libnabla (libnabla.so) into the process, and
 * maps the CUDA libraries from its start (tensor/cuda_plugin.c's
 * NB__CUDA_LINKED).
 *
 * Where the plugin is looked for (libnabla.so; the first that loads
 * wins; the environment variable, when set, is the only candidate):
 *   1. $NABLA_CUDA_PLUGIN, a path to the file;
 *   2. the directory of libnabla.so (dladdr);
 *   3. that directory's sibling library directory (../lib from bin/ in
 *      the build tree; the install's bindir-to-libdir path);
 *   4. the install's library directory (CMAKE_INSTALL_FULL_LIBDIR);
 *   5. the bare file name, through the dynamic loader's own search
 *      (LD_LIBRARY_PATH, the loader's cache).
 * When none loads, no CUDA device is visible, and every place that
 * needs one (nb_ctx_new, nb_pg_init with NCCL, device selection) says
 * why, naming each file tried and dlerror's text for it
 * (nb__cuda_plugin_error). A failure is remembered: the plugin is
 * looked for once per process. */
#ifndef NABLA_TENSOR_CUDA_PLUGIN_H
#define NABLA_TENSOR_CUDA_PLUGIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Raised whenever the table below, or a struct the plugin shares with
 * libnabla (nb_tensor, nb_ctx internals, nb_pg, nb_work, nb__coll),
 * changes its layout or meaning. */
#define NB__CUDA_PLUGIN_ABI 4
#define NB__CUDA_PLUGIN_FILE "libnabla_cuda.so"
#define NB__CUDA_PLUGIN_ENV "NABLA_CUDA_PLUGIN"
#define NB__CUDA_PLUGIN_INIT "nb__cuda_plugin_init"
#define NB__CUDA_STR_(x) #x
#define NB__CUDA_STR(x) NB__CUDA_STR_(x)
#define NB__CUDA_PLUGIN_VERSION                                                                   \
    NB__CUDA_STR(NABLA_VERSION_MAJOR) "." NB__CUDA_STR(NABLA_VERSION_MINOR) "." NB__CUDA_STR(     \
        NABLA_VERSION_PATCH)

struct nb__pg_ops;

/* What the CUDA backend hands libnabla. abi and version first, in every
 * ABI; the rest is read only when they match libnabla's. */
typedef struct nb__cuda_plugin {
    uint32_t abi;               /* NB__CUDA_PLUGIN_ABI */
    const char *version;        /* NB__CUDA_PLUGIN_VERSION */
    const nb__backend *backend; /* tensor/cuda/backend.c */
    /* The NCCL process group's table (distributed/pg.h, where distributed/
     * reads it: an opaque pointer for libnabla's tensor/). */
    const struct nb__pg_ops *nccl;
    int (*device_count)(void); /* 0 without a driver or a device */
    nb_status (*set_device)(int device);
    /* Hooks for the GPU suites (tensor/cuda/cuda.h says what they do). */
    size_t (*cudnn_workspace_size)(int device, int64_t *buffers);
    size_t (*cudnn_workspace_limit)(int device);
    void (*conv2d_workspace_sizes)(int device, nb_dtype dt, const nb__conv2d_geom *g,
                                   size_t *bytes);
    bool (*batch_norm_set_cudnn)(bool on);
    void (*batch_norm_cudnn_calls)(int64_t *forward, int64_t *backward);
    bool (*batch_norm_cudnn_ok)(const nb_tensor *x, const nb_tensor *running_mean,
                                const nb_tensor *running_var, bool training, double eps);
    /* The events profile (nb_cuda_profile_reset/write, nabla/cuda.h). */
    void (*profile_reset)(void);
    nb_status (*profile_write)(const char *path);
} nb__cuda_plugin;

/* The backend's one entry point (NB__CUDA_PLUGIN_INIT, tensor/cuda/plugin.c). */
typedef const nb__cuda_plugin *nb__cuda_plugin_init_fn(void);
nb__cuda_plugin_init_fn nb__cuda_plugin_init;

/* ---- libnabla's side (tensor/cuda_plugin.c) ---- */
/* The CUDA backend, loaded on the first call (thread-safe); NULL when it
 * could not be loaded (or the build has no CUDA): then
 * nb__cuda_plugin_error() says why. */
const nb__cuda_plugin *nb__cuda_plugin_get(void);
/* Why the backend is not there: the files tried and dlerror's text for
 * each, or "nabla was built without CUDA"; "" once it is loaded. Loads
 * it first if nobody asked yet. */
const char *nb__cuda_plugin_error(void);

#ifdef __cplusplus
}
#endif
#endif
