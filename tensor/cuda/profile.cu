/* The events profile (NABLA_CUDA_PROFILE=events): per backend entry, the
 * calls and the time the compute stream spent in them, measured with a
 * pair of CUDA events around each call.
 *
 * Note [Events profile]
 * Where no kernel profiler (ncu) is at hand, this is how a step's time is
 * split by backend entry, to be set beside the meta device's projection of
 * the same step (benchmarks/kernel_profile.py --events). It wraps the
 * backend's table, as a debug mode should, and changes no arithmetic:
 * nb__cuda_profile_table hands libnabla, instead of the CUDA table, a copy
 * whose kernel entries (and memset, memcpy_d2d, memcpy_h2d) record an event
 * on the device's compute stream, call the real entry, and record a second
 * one. Everything an entry enqueues runs on that stream (its kernels, and
 * the cuBLASLt and cuDNN calls bound to it), so the time between the two
 * events is the entry's: its kernels and library calls, with whatever gaps
 * the host leaves between them inside the entry. Entries are named as the
 * meta device names them (tensor/meta.c: "matmul", "binary.add",
 * "copy.f32>bf16", "fill" for a fill from the host), so the two tables join
 * row by row, and the calls equal its counts for the same program
 * (dev/cuda_emu/drv_profile.cpp checks this). Adapters in backend.c call
 * other entries directly, not through the table, so an entry is timed
 * once, as a whole.
 * Off (the variable unset or "off"), libnabla gets the CUDA table itself:
 * the profile costs nothing, not even a branch per call. On, each call costs
 * two cudaEventRecord. Events come from a pool of EVENT_PAIRS pairs per
 * device, made on first use; the pairs are read (cudaEventElapsedTime,
 * after waiting for the last one) and added to the totals when the pool is
 * full (a wait in the middle of the work, far apart: a GPT-2 step makes a
 * few hundred calls), at every synchronisation (nb__cuda_sync), and when
 * the totals are written: nb_cuda_profile_write, or at exit to the file
 * NABLA_CUDA_PROFILE_FILE names (stderr without it) when calls were
 * recorded since the last write or reset. A profile is meant for one host
 * thread issuing a device's work, as a training step does: calls from
 * several threads at once are each timed, but their pairs overlap. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <type_traits>

#include "nabla/cuda.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

#define EVENT_PAIRS 4096
#define MAX_KEYS 256
#define MAX_DEVICES 64
#define OP "nb_cuda (events profile)"

/* Recorded pairs not yet read, one pool per device. */
typedef struct pool {
    cudaEvent_t begin[EVENT_PAIRS], end[EVENT_PAIRS];
    int key[EVENT_PAIRS];
    bool closed[EVENT_PAIRS]; /* its end was recorded */
    int n;
} pool;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    bool on;
    pool *pools[MAX_DEVICES];
    char names[MAX_KEYS][48];
    int64_t calls[MAX_KEYS];
    double us[MAX_KEYS];
    int n_keys;
    bool unwritten; /* calls recorded since the last write or reset */
    unsigned devices; /* bit d: device d recorded something (devices 0-31) */
} prof;

/* The key's index, added when new (under the lock). */
static int intern(const char *name) {
    for (int i = 0; i < prof.n_keys; i++)
        if (!strcmp(prof.names[i], name)) return i;
    NB_CHECK(prof.n_keys < MAX_KEYS, "%s: more than %d distinct entries", OP, MAX_KEYS);
    int i = prof.n_keys++;
    snprintf(prof.names[i], sizeof prof.names[i], "%s", name);
    prof.calls[i] = 0;
    prof.us[i] = 0;
    return i;
}

/* Adds the closed pairs of device d's pool to the totals and empties it
 * (under the lock); waits for the last pair. */
static void resolve_locked(int d) {
    pool *p = prof.pools[d];
    if (!p || p->n == 0) return;
    nb__cuda_use(OP, d);
    for (int i = p->n - 1; i >= 0; i--)
        if (p->closed[i]) {
            NB_CUDA_CHECK(OP, cudaEventSynchronize(p->end[i]));
            break;
        }
    for (int i = 0; i < p->n; i++) {
        if (!p->closed[i]) continue; /* the entry aborted before its end */
        float ms = 0;
        NB_CUDA_CHECK(OP, cudaEventElapsedTime(&ms, p->begin[i], p->end[i]));
        prof.calls[p->key[i]]++;
        prof.us[p->key[i]] += 1e3 * (double)ms;
    }
    p->n = 0;
}

/* A pair opened for `name` on device d: its begin recorded. -1 when the
 * call names no CUDA device (then nothing is recorded). */
static int begin(const char *name, int d) {
    if (d < 0 || d >= MAX_DEVICES) return -1;
    pthread_mutex_lock(&lock);
    pool *p = prof.pools[d];
    if (!p) {
        p = (pool *)calloc(1, sizeof *p);
        NB_CHECK(p, "%s: out of host memory", OP);
        nb__cuda_use(OP, d);
        for (int i = 0; i < EVENT_PAIRS; i++) {
            NB_CUDA_CHECK(OP, cudaEventCreate(&p->begin[i]));
            NB_CUDA_CHECK(OP, cudaEventCreate(&p->end[i]));
        }
        prof.pools[d] = p;
    }
    if (p->n == EVENT_PAIRS) resolve_locked(d);
    int i = p->n++;
    p->key[i] = intern(name);
    p->closed[i] = false;
    NB_CUDA_CHECK(OP, cudaEventRecord(p->begin[i], nb__cuda_compute_stream(d)));
    prof.unwritten = true;
    if (d < 32) prof.devices |= 1u << d;
    pthread_mutex_unlock(&lock);
    return d * EVENT_PAIRS + i;
}

static void end(int slot) {
    if (slot < 0) return;
    int d = slot / EVENT_PAIRS, i = slot % EVENT_PAIRS;
    pthread_mutex_lock(&lock);
    pool *p = prof.pools[d];
    NB_CUDA_CHECK(OP, cudaEventRecord(p->end[i], nb__cuda_compute_stream(d)));
    p->closed[i] = true;
    pthread_mutex_unlock(&lock);
}

/* ---- the wrapped table ---- */
static const nb__backend *inner;
static nb__backend wrapped;

/* The device a call works on: that of its first tensor (the front end
 * put them all on one device), or of the first tensor of its first list
 * (a multi-tensor update's, which the first int argument counts: an empty
 * list is not read), or of its context (convolution's, whose buffers are
 * bare pointers). A multi-tensor call over no tensor, which the meta device
 * does not count either, names none. */
struct device_of {
    int d = -1, n = -1, ctx = -1;
    void see(const nb_tensor *t) {
        if (d < 0 && t) d = t->device.index;
    }
    void see(nb_tensor *t) { see((const nb_tensor *)t); }
    void see(nb_tensor *const *ts) {
        if (d < 0 && n > 0 && ts) see(ts[0]);
    }
    void see(nb_ctx *c) {
        if (ctx < 0 && c) ctx = nb_ctx_device(c).index;
    }
    void see(int v) {
        if (n < 0) n = v;
    }
    template <class T> void see(const T &) {}
    int device() const { return d >= 0 ? d : n != 0 ? ctx : -1; }
};

/* A kernel entry, timed under its own name (set by make_table). */
template <auto M> struct timed;
template <class R, class... A, R (*nb__backend::*M)(A...)> struct timed<M> {
    static inline const char *name;
    static R call(A... a) {
        device_of f;
        (f.see(a), ...);
        int slot = begin(name, f.device());
        if constexpr (std::is_void_v<R>) {
            (inner->*M)(a...);
            end(slot);
        } else {
            R r = (inner->*M)(a...);
            end(slot);
            return r;
        }
    }
};

/* A runtime copy or memset (device first), timed under its own name. */
template <auto M> struct timed_raw;
template <class... A, void (*nb__backend::*M)(int, A...)> struct timed_raw<M> {
    static inline const char *name;
    static void call(int device, A... a) {
        int slot = begin(name, device);
        (inner->*M)(device, a...);
        end(slot);
    }
};

/* The entries the meta device names by their operation or dtypes:
 * "unary.exp", "binary.add" (the op's name without nb_). */
static void op_key(char (&key)[48], const char *family, const char *op) {
    snprintf(key, sizeof key, "%s.%s", family, strncmp(op, "nb_", 3) ? op : op + 3);
}

static void unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s) {
    char key[48];
    op_key(key, "unary", nb__unary_name(op));
    int slot = begin(key, out->device.index);
    inner->unary(op, out, a, s);
    end(slot);
}

static void binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b) {
    char key[48];
    op_key(key, "binary", nb__binary_name(op));
    int slot = begin(key, out->device.index);
    inner->binary(op, out, a, b);
    end(slot);
}

static void copy(nb_tensor *dst, const nb_tensor *src) {
    char key[48] = "fill"; /* from a host scalar */
    if (src->device.type != NB_DEVICE_CPU)
        snprintf(key, sizeof key, src->dtype == dst->dtype ? "copy" : "copy.%s>%s",
                 nb_dtype_name(src->dtype), nb_dtype_name(dst->dtype));
    int slot = begin(key, dst->device.index);
    inner->copy(dst, src);
    end(slot);
}

static void write_at_exit(void) {
    if (!prof.unwritten) return;
    const char *f = getenv("NABLA_CUDA_PROFILE_FILE");
    if (nb__cuda_profile_write(f && *f ? f : NULL) != NB_OK)
        fprintf(stderr, "nabla: NABLA_CUDA_PROFILE=events: %s\n", nb_last_error());
}

static void make_table(const nb__backend *of) {
    inner = of;
    wrapped = *of;
#define TIMED(e)                                                                                   \
    timed<&nb__backend::e>::name = #e;                                                             \
    wrapped.e = timed<&nb__backend::e>::call;
    NB__BACKEND_KERNELS(TIMED)
#undef TIMED
    wrapped.unary = unary;
    wrapped.binary = binary;
    wrapped.copy = copy;
    wrapped.gemm_readable = of->gemm_readable; /* a question, not work */
#define TIMED_RAW(e, key)                                                                          \
    timed_raw<&nb__backend::e>::name = key;                                                        \
    wrapped.e = timed_raw<&nb__backend::e>::call;
    TIMED_RAW(memset, "memset")
    TIMED_RAW(memcpy_d2d, "memcpy")
    TIMED_RAW(memcpy_h2d, "memcpy_h2d")
#undef TIMED_RAW
    if (of->causal_attention) {
        timed<&nb__backend::causal_attention>::name = "causal_attention";
        timed<&nb__backend::causal_attention_backward>::name = "causal_attention_backward";
        wrapped.causal_attention = timed<&nb__backend::causal_attention>::call;
        wrapped.causal_attention_backward = timed<&nb__backend::causal_attention_backward>::call;
    }
}

extern "C" {
const nb__backend *nb__cuda_profile_table(const nb__backend *of) {
    const char *e = getenv("NABLA_CUDA_PROFILE");
    if (!e || !*e || !strcmp(e, "off")) return of;
    NB_CHECK(!strcmp(e, "events"), "NABLA_CUDA_PROFILE=%s: the profiles are events (per backend "
             "entry, Note [Events profile] in tensor/cuda/profile.cu) or off", e);
    make_table(of);
    prof.on = true;
    atexit(write_at_exit);
    return &wrapped;
}

bool nb__cuda_profile_on(void) { return prof.on; }

void nb__cuda_profile_resolve(int device) {
    if (!prof.on || device < 0 || device >= MAX_DEVICES) return;
    pthread_mutex_lock(&lock);
    resolve_locked(device);
    pthread_mutex_unlock(&lock);
}

void nb__cuda_profile_reset(void) {
    if (!prof.on) return;
    pthread_mutex_lock(&lock);
    for (int d = 0; d < MAX_DEVICES; d++) resolve_locked(d);
    memset(prof.calls, 0, sizeof prof.calls);
    memset(prof.us, 0, sizeof prof.us);
    prof.unwritten = false;
    prof.devices = 0;
    pthread_mutex_unlock(&lock);
}

nb_status nb__cuda_profile_write(const char *path) {
    if (!prof.on)
        return nb_set_error(NB_ERR_UNSUPPORTED, "nb_cuda_profile_write: the events profile is "
                            "off (set NABLA_CUDA_PROFILE=events before the first CUDA call)");
    pthread_mutex_lock(&lock);
    for (int d = 0; d < MAX_DEVICES; d++) resolve_locked(d);
    int order[MAX_KEYS], n = 0;
    for (int i = 0; i < prof.n_keys; i++)
        if (prof.calls[i]) order[n++] = i;
    std::sort(order, order + n, [](int a, int b) { return prof.us[a] > prof.us[b]; });
    FILE *f = path ? fopen(path, "w") : stderr;
    if (!f) {
        pthread_mutex_unlock(&lock);
        return nb_set_error(NB_ERR_IO, "nb_cuda_profile_write: cannot open %s: %s", path,
                            strerror(errno));
    }
    int64_t calls = 0;
    double us = 0;
    for (int k = 0; k < n; k++) calls += prof.calls[order[k]], us += prof.us[order[k]];
    fprintf(f, "# nabla CUDA events profile (NABLA_CUDA_PROFILE=events), devices 0x%x: per "
               "backend entry, its calls and the microseconds between an event recorded on the "
               "compute stream before each call and one after\n# entry calls us\n",
            prof.devices);
    for (int k = 0; k < n; k++)
        fprintf(f, "%s %lld %.3f\n", prof.names[order[k]], (long long)prof.calls[order[k]],
                prof.us[order[k]]);
    fprintf(f, "# total %lld %.3f\n", (long long)calls, us);
    bool bad = ferror(f) != 0;
    if (path) bad |= fclose(f) != 0;
    else fflush(f);
    memset(prof.calls, 0, sizeof prof.calls);
    memset(prof.us, 0, sizeof prof.us);
    prof.unwritten = false;
    prof.devices = 0;
    pthread_mutex_unlock(&lock);
    if (bad) return nb_set_error(NB_ERR_IO, "nb_cuda_profile_write: writing %s failed", path);
    return NB_OK;
}
}
