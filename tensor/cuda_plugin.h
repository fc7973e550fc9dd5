/* The boundary between libnabla and its CUDA plugin (libnabla_cuda.so):
 * what each side hands the other. libnabla (tensor/cuda_plugin.c) loads
 * the plugin on first use and passes it a table of its own functions;
 * the plugin (tensor/cuda/plugin.c) answers with its backend table, its
 * NCCL process-group table and its runtime queries. Both sides are built
 * from one tree in one build and refuse each other unless their ABI
 * number, nabla version and the hash of the headers they share agree.
 * Note [CUDA plugin].
 *
 * Note [CUDA plugin]
 * The CUDA backend (tensor/cuda/) and the NCCL process group
 * (distributed/pg_nccl.c) are not in libnabla: they form a separate
 * shared object, libnabla_cuda.so, that libnabla opens with dlopen the
 * first time a program asks about CUDA devices (nb_cuda_device_count,
 * nb_ctx_new on a CUDA device, nb_pg_init choosing or asked for NCCL,
 * device selection from LOCAL_RANK). A program that never asks maps
 * none of the CUDA libraries (cudart, cuBLAS(Lt), cuDNN, NCCL), starts
 * where they are absent, and is smaller in memory by their size.
 *
 * Which functions of libnabla the plugin calls. The plugin links nothing
 * of nabla: it gets libnabla's functions as a table of pointers
 * (nb__cuda_host, filled from NB__CUDA_HOST_FUNCS below), and
 * tensor/cuda/plugin.c defines, for each, a function of the same name
 * that calls through the table. Kernel code keeps calling nb_abort,
 * nb__empty, nb_store_set ... as before. So the plugin works the same
 * under the shared libnabla.so and under a program linked with the
 * static libnabla.a (which need not export anything), and it cannot
 * bind to a second copy of the library. The plugin exports one symbol,
 * nb__cuda_plugin_init; everything else in it is local (a version
 * script), so its forwarders never interpose on libnabla's functions. A
 * kernel that calls a function of libnabla not yet in the list fails to
 * link the plugin (it is linked with --no-undefined), naming the
 * function: add a row to NB__CUDA_HOST_FUNCS.
 *
 * Where the plugin is looked for (the first that loads wins; the
 * environment variable, when set, is the only candidate):
 *   1. $NABLA_CUDA_PLUGIN, a path to the file;
 *   2. the directory of the file holding libnabla's code (dladdr): the
 *      directory of libnabla.so, or of the program linked with libnabla.a;
 *   3. that directory's sibling library directory (../lib from bin/ in
 *      the build tree; the install's bindir-to-libdir path), for programs
 *      linked with libnabla.a;
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

/* Raised whenever either table below, or a struct the plugin shares with
 * libnabla (nb_tensor, nb_ctx internals, nb_pg, nb_work, nb__coll),
 * changes its layout or meaning. */
#define NB__CUDA_PLUGIN_ABI 2
#define NB__CUDA_PLUGIN_FILE "libnabla_cuda.so"
#define NB__CUDA_PLUGIN_ENV "NABLA_CUDA_PLUGIN"
#define NB__CUDA_PLUGIN_INIT "nb__cuda_plugin_init"
#define NB__CUDA_STR_(x) #x
#define NB__CUDA_STR(x) NB__CUDA_STR_(x)
/* The version and the id of the shared headers (a hash, made by the
 * build: cmake/NablaLayoutId.cmake), "0.1.0+1f2e...": a plugin built
 * from other headers than the library, even of the same version, is
 * refused. Only the two files that compare it (tensor/cuda_plugin.c,
 * tensor/cuda/plugin.c) define NB__CUDA_PLUGIN_SIDE and see it; the
 * build gives them the generated header. */
#ifdef NB__CUDA_PLUGIN_SIDE
#include "nabla_layout_id.h"
#define NB__CUDA_PLUGIN_VERSION                                                                   \
    NB__CUDA_STR(NABLA_VERSION_MAJOR) "." NB__CUDA_STR(NABLA_VERSION_MINOR) "." NB__CUDA_STR(     \
        NABLA_VERSION_PATCH) "+" NB__LAYOUT_ID
#endif

struct nb__coll;
struct nb__pg_ops;
struct nb__nccl;

/* libnabla's functions the plugin calls: X(return type, name, (parameters),
 * (arguments)). nb_abort and nb_set_error, which take a format, are
 * passed separately (nb__cuda_host's abort and set_error). */
#define NB__CUDA_HOST_FUNCS(X)                                                                    \
    X(const char *, nb_last_error, (void), ())                                                    \
    X(const char *, nb_dtype_name, (nb_dtype dtype), (dtype))                                     \
    X(size_t, nb_dtype_size, (nb_dtype dtype), (dtype))                                           \
    X(bool, nb_dtype_is_float, (nb_dtype dtype), (dtype))                                         \
    X(const char *, nb_device_name, (nb_device device), (device))                                 \
    X(const char *, nb_shape_str, (const nb_tensor *t), (t))                                      \
    X(int64_t, nb_numel, (const nb_tensor *t), (t))                                               \
    X(bool, nb_is_contiguous, (const nb_tensor *t), (t))                                          \
    X(double, nb_item, (const nb_tensor *t), (t))                                                 \
    X(nb_device, nb_ctx_device, (const nb_ctx *ctx), (ctx))                                       \
    X(void *, nb_ctx_alloc, (nb_ctx * ctx, size_t bytes, int zero), (ctx, bytes, zero))           \
    X(void *, nb__ctx_meta, (nb_ctx * ctx, size_t bytes), (ctx, bytes))                           \
    X(void, nb__ctx_scratch_done, (nb_ctx * ctx, void *p, size_t bytes), (ctx, p, bytes))         \
    X(nb_tensor *, nb__empty, (nb_ctx * ctx, nb_dtype dtype, int ndim, const int64_t *shape),     \
      (ctx, dtype, ndim, shape))                                                                  \
    X(int64_t, nb__numel_shape, (int ndim, const int64_t *shape), (ndim, shape))                  \
    X(double, nb__load, (const void *p, nb_dtype dtype), (p, dtype))                              \
    X(void, nb__store, (void *p, nb_dtype dtype, double v), (p, dtype, v))                        \
    X(const char *, nb__unary_name, (nb__unary_op op), (op))                                      \
    X(const char *, nb__binary_name, (nb__binary_op op), (op))                                    \
    X(nb_tensor *, nb_abs, (nb_ctx * ctx, nb_tensor *a), (ctx, a))                                \
    X(nb_tensor *, nb_max, (nb_ctx * ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim), \
      (ctx, x, naxes, axes, keepdim))                                                             \
    X(nb_tensor *, nb_stack, (nb_ctx * ctx, int n, nb_tensor *const *xs, int axis),               \
      (ctx, n, xs, axis))                                                                         \
    X(void, nb_copy_, (nb_tensor * dst, const nb_tensor *src), (dst, src))                        \
    X(void, nb_scale_, (nb_tensor * t, double alpha), (t, alpha))                                 \
    X(bool, nb__cuda_poison, (void), ())                                                          \
    X(bool, nb__cuda_tf32, (void), ())                                                            \
    X(nb_status, nb_store_set, (nb_store * store, const char *key, const void *value, size_t len), \
      (store, key, value, len))                                                                   \
    X(nb_status, nb_store_get,                                                                    \
      (nb_store * store, const char *key, double timeout_s, void **value, size_t *len),           \
      (store, key, timeout_s, value, len))                                                        \
    X(void, nb__sleep, (double seconds), (seconds))                                               \
    X(nb_work *, nb__pg_issue, (nb_pg * pg, const struct nb__coll *c), (pg, c))                   \
    X(nb_status, nb_work_finish, (nb_work * work), (work))                                        \
    X(void, nb__work_put, (nb_work * w), (w))                                                     \
    X(void, nb__pg_finish_locked, (nb_pg * pg, nb_work *w, nb_status st, const char *msg),        \
      (pg, w, st, msg))                                                                           \
    X(void, nb__pg_fail, (nb_pg * pg, nb_work *w, nb_status st, const char *what),                \
      (pg, w, st, what))

/* What libnabla hands the plugin. abi and version first, in every ABI. */
typedef struct nb__cuda_host {
    uint32_t abi;        /* NB__CUDA_PLUGIN_ABI */
    const char *version; /* NB__CUDA_PLUGIN_VERSION */
    /* nb_abort (never returns) and nb_set_error, with the message
     * already formatted. */
    void (*abort)(const char *file, int line, const char *message);
    nb_status (*set_error)(nb_status status, const char *message);
#define NB__CUDA_HOST_MEMBER(ret, name, params, args) ret(*name) params;
    NB__CUDA_HOST_FUNCS(NB__CUDA_HOST_MEMBER)
#undef NB__CUDA_HOST_MEMBER
} nb__cuda_host;

/* What the plugin hands back. abi and version first, in every ABI; the
 * rest is read only when they match libnabla's. */
typedef struct nb__cuda_plugin {
    uint32_t abi;
    const char *version;
    const nb__backend *backend;     /* tensor/cuda/backend.c */
    const struct nb__pg_ops *nccl;  /* distributed/pg_nccl.c */
    int (*device_count)(void);      /* 0 without a driver or a device */
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
    /* distributed/internal.h says what it does */
    int (*nccl_exchange)(struct nb__nccl *n, const void *mine, void *all, size_t bytes, bool start);
} nb__cuda_plugin;

/* The plugin's one exported function (NB__CUDA_PLUGIN_INIT). It keeps
 * `host` only when host->abi and host->version match its own; it always
 * returns its table, whose abi and version libnabla compares. */
typedef const nb__cuda_plugin *nb__cuda_plugin_init_fn(const nb__cuda_host *host);

/* ---- libnabla's side (tensor/cuda_plugin.c) ---- */
/* The plugin, loaded on the first call (thread-safe); NULL when it could
 * not be loaded (or the build has no CUDA): then nb__cuda_plugin_error()
 * says why. */
const nb__cuda_plugin *nb__cuda_plugin_get(void);
/* Why the plugin is not there: the files tried and dlerror's text for
 * each, or "nabla was built without CUDA"; "" once it is loaded. Loads
 * it first if nobody asked yet. */
const char *nb__cuda_plugin_error(void);
/* The plugin's NCCL process-group table (distributed/pg.h), NULL when it
 * is not loaded. */
const struct nb__pg_ops *nb__cuda_nccl_ops(void);

#ifdef __cplusplus
}
#endif
#endif
