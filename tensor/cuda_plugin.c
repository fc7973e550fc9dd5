/* libnabla's side of the CUDA backend: getting it on first use (opening
 * the plugin, libnabla_cuda.so, from libnabla.so; linked in, in
 * libnabla.a: NB__CUDA_LINKED), and what code outside tensor/cuda/ asks
 * about CUDA (device count and selection, the poisoning and TF32
 * switches, the public nabla/cuda.h functions, the GPU suites' hooks),
 * answered through the backend once it is there and as "no device"
 * before, when it cannot be had, and in a build without CUDA. Note [CUDA
 * plugin] in tensor/cuda_plugin.h: why a plugin, where it is looked for.
 *
 * Compiled once for each library (CMakeLists.txt), with NB__CUDA_LINKED
 * 1 for libnabla.a of a CUDA build (the backend's objects are in the
 * archive: its functions are called directly, and this file defines none
 * of them again) and 0 for libnabla.so and a build without CUDA. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nabla/cuda.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda_plugin.h"

#ifndef NB__CUDA_LINKED
#define NB__CUDA_LINKED 0
#endif

const nb__backend *nb__cuda_table;

/* Note [Poisoned outputs] and nb_cuda_set_allow_tf32: switches kept here,
 * so that setting them loads nothing; the backend reads them. */
static bool poison_on, tf32_on;
void nb__cuda_set_poison(bool on) { poison_on = on; }
bool nb__cuda_poison(void) { return poison_on; }
void nb_cuda_set_allow_tf32(bool on) { tf32_on = on && NABLA_HAVE_CUDA; } /* stays off without CUDA */
bool nb_cuda_allow_tf32(void) { return tf32_on; }
bool nb__cuda_tf32(void) { return tf32_on; }

#if NB__CUDA_LINKED
static const nb__cuda_plugin *linked;
static pthread_once_t link_once = PTHREAD_ONCE_INIT;

static void link_backend(void) {
    linked = nb__cuda_plugin_init();
    __atomic_store_n(&nb__cuda_table, linked->backend, __ATOMIC_RELEASE);
}

const nb__cuda_plugin *nb__cuda_plugin_get(void) {
    pthread_once(&link_once, link_backend);
    return linked;
}

const char *nb__cuda_plugin_error(void) { return ""; }
#elif NABLA_HAVE_CUDA
static const nb__cuda_plugin *plugin;
static char load_error[1024];

#ifndef NABLA_CUDA_PLUGIN_LIBDIR_REL
#define NABLA_CUDA_PLUGIN_LIBDIR_REL "../lib"
#endif
#ifndef NABLA_CUDA_PLUGIN_INSTALL_LIBDIR
#define NABLA_CUDA_PLUGIN_INSTALL_LIBDIR ""
#endif

static pthread_once_t load_once = PTHREAD_ONCE_INIT;

/* Appends "; " (after the first) and the formatted text to load_error,
 * cut at its size. */
static void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char *fmt, ...) {
    size_t n = strlen(load_error);
    if (n + 3 >= sizeof load_error) return;
    if (n) {
        memcpy(load_error + n, "; ", 3);
        n += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(load_error + n, sizeof load_error - n, fmt, ap);
    va_end(ap);
}

/* Opens and checks one candidate; true when it is the plugin. */
static bool try_load(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        /* dlerror names the path when the file itself is the trouble */
        if (e && strstr(e, path)) note("%s", e);
        else note("%s: %s", path, e ? e : "dlopen failed");
        return false;
    }
    nb__cuda_plugin_init_fn *init = (nb__cuda_plugin_init_fn *)dlsym(h, NB__CUDA_PLUGIN_INIT);
    if (!init) {
        note("%s: no symbol %s (not nabla's CUDA plugin)", path, NB__CUDA_PLUGIN_INIT);
        dlclose(h);
        return false;
    }
    const nb__cuda_plugin *p = init();
    if (!p || p->abi != NB__CUDA_PLUGIN_ABI || !p->version ||
        strcmp(p->version, NB__CUDA_PLUGIN_VERSION) != 0) {
        note("%s: built for nabla %s (plugin ABI %u), this is nabla %s (ABI %u)", path,
             p && p->version ? p->version : "?", p ? p->abi : 0u, NB__CUDA_PLUGIN_VERSION,
             (unsigned)NB__CUDA_PLUGIN_ABI);
        dlclose(h); /* it kept nothing of ours */
        return false;
    }
    plugin = p;
    __atomic_store_n(&nb__cuda_table, p->backend, __ATOMIC_RELEASE);
    return true; /* never closed: its code runs until the process ends */
}

/* Candidate 2's and 3's directory: where libnabla's code is. */
static bool code_dir(char *dir, size_t len) {
    Dl_info info;
    if (!dladdr((void *)&try_load, &info) || !info.dli_fname || !*info.dli_fname) return false;
    const char *f = info.dli_fname;
    char exe[4096];
    if (f[0] != '/') {
        /* the main program, named as it was run ("./train"), relative to a
         * directory the program may have left: its absolute name instead */
        const char *base = strrchr(f, '/') ? strrchr(f, '/') + 1 : f;
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = 0;
            const char *exe_base = strrchr(exe, '/') ? strrchr(exe, '/') + 1 : exe;
            if (strcmp(base, exe_base) == 0) f = exe;
        }
        if (f != exe && !strchr(f, '/')) return false;
    }
    const char *slash = strrchr(f, '/');
    size_t n = (size_t)(slash - f);
    if (n + 1 > len) return false;
    memcpy(dir, f, n);
    dir[n] = 0;
    if (n == 0) memcpy(dir, "/", 2);
    return true;
}

static void load(void) {
    const char *env = getenv(NB__CUDA_PLUGIN_ENV);
    if (env && *env) {
        if (!try_load(env)) {
            size_t n = strlen(load_error);
            snprintf(load_error + n, sizeof load_error - n, " (the file %s names)",
                     NB__CUDA_PLUGIN_ENV);
        }
        return;
    }
    char tried[4][4096];
    int n = 0;
    char dir[3900];
    if (code_dir(dir, sizeof dir)) {
        snprintf(tried[n++], sizeof tried[0], "%s/%s", dir, NB__CUDA_PLUGIN_FILE);
        snprintf(tried[n++], sizeof tried[0], "%s/%s/%s", dir, NABLA_CUDA_PLUGIN_LIBDIR_REL,
                 NB__CUDA_PLUGIN_FILE);
    }
    if (*NABLA_CUDA_PLUGIN_INSTALL_LIBDIR)
        snprintf(tried[n++], sizeof tried[0], "%s/%s", NABLA_CUDA_PLUGIN_INSTALL_LIBDIR,
                 NB__CUDA_PLUGIN_FILE);
    snprintf(tried[n++], sizeof tried[0], "%s", NB__CUDA_PLUGIN_FILE);
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < i; j++) seen |= strcmp(tried[i], tried[j]) == 0;
        if (seen) continue;
        /* a candidate that is not there is listed without dlerror's words */
        if (strchr(tried[i], '/') && access(tried[i], F_OK) != 0) {
            note("%s: not found", tried[i]);
            continue;
        }
        if (try_load(tried[i])) {
            load_error[0] = 0;
            return;
        }
    }
    note("set %s to the plugin's path", NB__CUDA_PLUGIN_ENV);
}

const nb__cuda_plugin *nb__cuda_plugin_get(void) {
    pthread_once(&load_once, load);
    return plugin;
}

const char *nb__cuda_plugin_error(void) {
    if (nb__cuda_plugin_get()) return "";
    return load_error;
}
#else
const nb__cuda_plugin *nb__cuda_plugin_get(void) { return NULL; }
const char *nb__cuda_plugin_error(void) { return "nabla was built without CUDA"; }
#endif

/* ---- runtime queries, through the plugin's table (libnabla.a calls the
 * backend's functions of these names directly) ---- */
#if !NB__CUDA_LINKED
int nb__cuda_device_count(void) {
    const nb__cuda_plugin *p = nb__cuda_plugin_get();
    return p ? p->device_count() : 0;
}

nb_status nb__cuda_set_device(int device) {
    const nb__cuda_plugin *p = nb__cuda_plugin_get();
    if (!p)
        return nb_set_error(NB_ERR_UNSUPPORTED, "nb__cuda_set_device: device %d: %s", device,
                            nb__cuda_plugin_error());
    return p->set_device(device);
}

/* Every caller below has a CUDA device in hand, so the plugin is loaded. */
static const nb__cuda_plugin *loaded(const char *op) {
    const nb__cuda_plugin *p = nb__cuda_plugin_get();
    NB_CHECK(p, "%s: no CUDA backend: %s", op, nb__cuda_plugin_error());
    return p;
}

void nb__cuda_sync(int device) { loaded("nb_cuda_synchronize")->backend->sync(device); }

size_t nb__cuda_cudnn_workspace_size(int device, int64_t *buffers) {
    return loaded("nb__cuda_cudnn_workspace_size")->cudnn_workspace_size(device, buffers);
}
size_t nb__cuda_cudnn_workspace_limit(int device) {
    return loaded("nb__cuda_cudnn_workspace_limit")->cudnn_workspace_limit(device);
}
void nb__cuda_conv2d_workspace_sizes(int device, nb_dtype dt, const nb__conv2d_geom *g,
                                     size_t *bytes) {
    loaded("nb__cuda_conv2d_workspace_sizes")->conv2d_workspace_sizes(device, dt, g, bytes);
}
bool nb__cuda_batch_norm_set_cudnn(bool on) {
    return loaded("nb__cuda_batch_norm_set_cudnn")->batch_norm_set_cudnn(on);
}
void nb__cuda_batch_norm_cudnn_calls(int64_t *forward, int64_t *backward) {
    loaded("nb__cuda_batch_norm_cudnn_calls")->batch_norm_cudnn_calls(forward, backward);
}
bool nb__cuda_batch_norm_cudnn_ok(const nb_tensor *x, const nb_tensor *running_mean,
                                  const nb_tensor *running_var, bool training, double eps) {
    return loaded("nb__cuda_batch_norm_cudnn_ok")
        ->batch_norm_cudnn_ok(x, running_mean, running_var, training, eps);
}
void nb__cuda_profile_reset(void) {
    const nb__cuda_plugin *p = nb__cuda_plugin_get();
    if (p) p->profile_reset();
}
nb_status nb__cuda_profile_write(const char *path) {
    const nb__cuda_plugin *p = nb__cuda_plugin_get();
    if (!p)
        return nb_set_error(NB_ERR_UNSUPPORTED, "nb_cuda_profile_write: no CUDA backend: %s",
                            nb__cuda_plugin_error());
    return p->profile_write(path);
}
#endif

/* ---- public ---- */
bool nb_cuda_available(void) { return nb__cuda_device_count() > 0; }
int nb_cuda_device_count(void) { return nb__cuda_device_count(); }

void nb_cuda_synchronize(nb_device device) {
    NB_CHECK(device.type == NB_DEVICE_CUDA, "nb_cuda_synchronize: %s is not a CUDA device",
             nb_device_name(device));
    NB_CHECK(device.index >= 0 && device.index < nb__cuda_device_count(),
             "nb_cuda_synchronize: %s is not a visible CUDA device (%s)", nb_device_name(device),
             *nb__cuda_plugin_error() ? nb__cuda_plugin_error() : "no such device");
    nb__cuda_sync(device.index);
}

/* Note [Events profile] in tensor/cuda/profile.cu */
void nb_cuda_profile_reset(void) { nb__cuda_profile_reset(); }
nb_status nb_cuda_profile_write(const char *path) { return nb__cuda_profile_write(path); }
