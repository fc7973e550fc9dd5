/* The CPU kernels' thread pool (tensor/cpu/threads.h) and its size
 * (include/nabla/threads.h).
 *
 * Workers are started on the first job after the size is set, and live
 * until the size changes. A job is published as a new generation of a
 * ticket word (generation << 32 | next chunk); a thread claims a chunk by
 * compare-and-swap on the ticket, so a claim can only succeed for the
 * generation it was read in, and counts the chunks it completes. The
 * caller claims chunks too and then waits only for chunks that others
 * claimed: a worker that was not scheduled in time (a loaded machine)
 * finds nothing left and costs nothing. Which thread runs which chunk is
 * then a matter of timing, and irrelevant (Note [Deterministic parallel
 * kernels] in threads.h). Between jobs a worker spins for a short while
 * (a step's kernels come back to back) and then sleeps on a condition
 * variable, so an idle pool does not take a core from OpenBLAS, Gloo or
 * another process; the caller waits for the last claimed chunk the same
 * way. One job at a time: a job started while another thread's job holds
 * the pool, or from inside a chunk, runs on its caller alone. After fork()
 * the child has no workers; it starts its own on its first job. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nabla/error.h"
#include "nabla/threads.h"
#include "tensor/cpu/threads.h"

#define MAX_THREADS 1024
/* A waiting thread spins for SPIN_NS before it sleeps: longer than the
 * gap between two kernels of a step, far shorter than what a sleeping
 * worker is woken for. While spinning it yields the core every few
 * iterations, so that another runnable thread on it (OpenBLAS's worker,
 * which spins after a GEMM too) is not kept waiting. */
#define SPIN_NS 50000

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("pause");
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* One step of a spin that started at *start (0: not yet); false once
 * SPIN_NS have passed. */
static bool spin_on(int64_t *start, int *iter) {
    cpu_relax();
    if (++*iter % 64) return true;
    int64_t t = now_ns();
    if (*start == 0) *start = t;
    sched_yield();
    return t - *start < SPIN_NS;
}

typedef struct pool {
    pthread_mutex_t mu; /* guards the sleeping and the worker set */
    pthread_cond_t wake, done;
    _Atomic int size; /* threads a job may use, the caller's included; 0 = unresolved */
    int nworkers;     /* started workers (size - 1 once started) */
    pthread_t *workers;
    bool stop;
    uint32_t base_gen; /* the generation before the new workers' first job */
    int sleepers;      /* workers waiting on `wake` */
    bool caller_sleeps;
    /* the job: fn and arg are read only by a thread holding a claim */
    atomic_uint_fast64_t ticket; /* generation << 32 | next chunk */
    _Atomic int64_t n;
    nb__task_fn fn;
    void *arg;
    atomic_int_fast64_t completed; /* chunks of the current job done */
} pool;

static uint32_t gen_of(uint_fast64_t t) { return (uint32_t)(t >> 32); }

static pool P = {.mu = PTHREAD_MUTEX_INITIALIZER,
                 .wake = PTHREAD_COND_INITIALIZER,
                 .done = PTHREAD_COND_INITIALIZER};
/* Held by the thread whose job runs on the pool (and while resizing). */
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local bool in_job;
static int explicit_size; /* from nb_set_num_threads; 0 = from the environment */

/* ---- size ---- */
static int parse_count(const char *name, const char *v, const char *what) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    /* OpenMP allows a list ("4,2": 4 at the outer level); we take its first */
    bool list = *end == ',' && strcmp(name, "OMP_NUM_THREADS") == 0;
    NB_CHECK(end != v && (*end == 0 || list) && errno == 0 && n >= 1 && n <= MAX_THREADS,
             "%s='%s' is not a %s (a whole number from 1 to %d); unset it or fix it", name, v,
             what, MAX_THREADS);
    return (int)n;
}

static int available_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int size_from_env(void) {
    const char *v = getenv("NABLA_NUM_THREADS");
    if (v && *v) return parse_count("NABLA_NUM_THREADS", v, "thread count");
    v = getenv("OMP_NUM_THREADS");
    if (v && *v) return parse_count("OMP_NUM_THREADS", v, "thread count");
    int cores = available_cores(), local = 1;
    v = getenv("LOCAL_WORLD_SIZE");
    if (v && *v) local = parse_count("LOCAL_WORLD_SIZE", v, "process count");
    /* bound by nbrun (Note [CPU binding] in distributed/cpu_bind.c), the
     * mask is this rank's share already */
    v = getenv("NABLA_CPU_BIND");
    if (v && strcmp(v, "cores") == 0) local = 1;
    int n = cores / local;
    n = n < 1 ? 1 : n;
    return n > MAX_THREADS ? MAX_THREADS : n;
}

/* ---- workers ---- */
/* Claims and runs chunks of generation g until none is left. */
static void run_chunks(uint32_t g, int tid) {
    bool was = in_job;
    in_job = true;
    uint_fast64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
    for (;;) {
        /* n read after the ticket: when the claim below succeeds, the
         * generation did not change in between, so n is this job's */
        int64_t n = atomic_load_explicit(&P.n, memory_order_acquire);
        if (gen_of(t) == g && (uint32_t)t == UINT32_MAX) { /* being published */
            cpu_relax();
            t = atomic_load_explicit(&P.ticket, memory_order_acquire);
            continue;
        }
        if (gen_of(t) != g || (int64_t)(uint32_t)t >= n || tid >= n) break;
        if (!atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        P.fn(P.arg, (int64_t)(uint32_t)t, tid);
        int64_t done = atomic_fetch_add_explicit(&P.completed, 1, memory_order_acq_rel) + 1;
        if (done == n && tid != 0) {
            pthread_mutex_lock(&P.mu);
            if (P.caller_sleeps) pthread_cond_signal(&P.done);
            pthread_mutex_unlock(&P.mu);
        }
        t = atomic_load_explicit(&P.ticket, memory_order_acquire);
    }
    in_job = was;
}

static void *worker_main(void *varg) {
    int tid = (int)(intptr_t)varg;
    uint32_t seen = P.base_gen; /* not the ticket's: a job may be out already */
    for (;;) {
        uint32_t g;
        int64_t start = 0;
        int iter = 0;
        while ((g = gen_of(atomic_load_explicit(&P.ticket, memory_order_acquire))) == seen &&
               spin_on(&start, &iter)) {
        }
        if (g == seen) {
            pthread_mutex_lock(&P.mu);
            P.sleepers++;
            while ((g = gen_of(atomic_load_explicit(&P.ticket, memory_order_acquire))) == seen &&
                   !P.stop)
                pthread_cond_wait(&P.wake, &P.mu);
            P.sleepers--;
            bool stop = P.stop;
            pthread_mutex_unlock(&P.mu);
            if (stop) return NULL;
        }
        seen = g;
        run_chunks(g, tid);
    }
}

/* With `busy` held. */
static void stop_workers(void) {
    if (P.nworkers == 0) return;
    pthread_mutex_lock(&P.mu);
    P.stop = true;
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.nworkers; i++) pthread_join(P.workers[i], NULL);
    free(P.workers);
    P.workers = NULL;
    P.nworkers = 0;
    P.stop = false;
}

static void fork_prepare(void) {
    pthread_mutex_lock(&busy);
    pthread_mutex_lock(&P.mu);
}
static void fork_parent(void) {
    pthread_mutex_unlock(&P.mu);
    pthread_mutex_unlock(&busy);
}
/* The workers did not come along: forget them (their array is dropped
 * rather than freed), and make new condition variables, as the old ones
 * still count the parent's sleeping workers as waiters (a signal would go
 * to one of them and be lost). */
static void fork_child(void) {
    pthread_cond_init(&P.wake, NULL);
    pthread_cond_init(&P.done, NULL);
    P.workers = NULL;
    P.nworkers = 0;
    P.sleepers = 0;
    P.caller_sleeps = false;
    pthread_mutex_unlock(&P.mu);
    pthread_mutex_unlock(&busy);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

/* With `busy` held and the size resolved: starts the workers. */
static void ensure_started(void) {
    if (P.nworkers == P.size - 1) return;
    pthread_once(&atfork_once, install_atfork);
    stop_workers();
    P.base_gen = gen_of(atomic_load_explicit(&P.ticket, memory_order_relaxed));
    P.workers = malloc((size_t)(P.size - 1) * sizeof *P.workers);
    NB_CHECK(P.workers, "nb thread pool: out of memory for %d threads", P.size);
    for (int i = 0; i < P.size - 1; i++) {
        int rc = pthread_create(&P.workers[i], NULL, worker_main, (void *)(intptr_t)(i + 1));
        if (rc != 0) { /* run with the ones we have */
            P.size = i + 1;
            break;
        }
        P.nworkers = i + 1;
    }
}

/* ---- public and internal entry points ---- */
int nb__parallel_threads(int64_t n_chunks) {
    if (n_chunks <= 1) return 1;
    int s = nb_get_num_threads();
    return n_chunks < s ? (int)n_chunks : s;
}

static void run_alone(int64_t n, nb__task_fn fn, void *arg) {
    bool was = in_job;
    in_job = true;
    for (int64_t c = 0; c < n; c++) fn(arg, c, 0);
    in_job = was;
}

void nb__parallel_for(int64_t n, nb__task_fn fn, void *arg) {
    if (n <= 0) return;
    if (n == 1 || n >= INT32_MAX || nb_get_num_threads() == 1 || in_job ||
        pthread_mutex_trylock(&busy) != 0) {
        run_alone(n, fn, arg);
        return;
    }
    ensure_started();
    if (P.nworkers == 0) {
        pthread_mutex_unlock(&busy);
        run_alone(n, fn, arg);
        return;
    }
    /* The new generation first with no chunk to claim (index 2^32 - 1),
     * so that no claim of the previous one can succeed while the job's
     * fields change; then its first chunk. */
    uint32_t g = gen_of(atomic_load_explicit(&P.ticket, memory_order_relaxed)) + 1;
    atomic_store_explicit(&P.ticket, (uint_fast64_t)g << 32 | UINT32_MAX, memory_order_seq_cst);
    P.fn = fn;
    P.arg = arg;
    /* release: whoever reads this n also sees the invalidation above */
    atomic_store_explicit(&P.completed, 0, memory_order_relaxed);
    atomic_store_explicit(&P.n, n, memory_order_release);
    atomic_store_explicit(&P.ticket, (uint_fast64_t)g << 32, memory_order_release);
    pthread_mutex_lock(&P.mu);
    if (P.sleepers) pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    run_chunks(g, 0);
    int64_t start = 0;
    int iter = 0;
    while (atomic_load_explicit(&P.completed, memory_order_acquire) != n && spin_on(&start, &iter)) {
    }
    if (atomic_load_explicit(&P.completed, memory_order_acquire) != n) {
        pthread_mutex_lock(&P.mu);
        P.caller_sleeps = true;
        while (atomic_load_explicit(&P.completed, memory_order_acquire) != n)
            pthread_cond_wait(&P.done, &P.mu);
        P.caller_sleeps = false;
        pthread_mutex_unlock(&P.mu);
    }
    pthread_mutex_unlock(&busy);
}

typedef struct range_job {
    nb__range_fn fn;
    void *arg;
    int64_t n, grain;
} range_job;

static void range_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const range_job *j = varg;
    int64_t lo = c * j->grain, hi = lo + j->grain < j->n ? lo + j->grain : j->n;
    j->fn(j->arg, lo, hi);
}

void nb__parallel_range(int64_t n, int64_t grain, nb__range_fn fn, void *arg) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (n <= grain) {
        fn(arg, 0, n);
        return;
    }
    range_job j = {fn, arg, n, grain};
    nb__parallel_for(nb__chunk_count(n, grain), range_chunk, &j);
}

void nb_set_num_threads(int n) {
    NB_CHECK(n >= 0 && n <= MAX_THREADS,
             "nb_set_num_threads: n = %d is out of range (1 to %d threads, or 0 for the size the "
             "environment gives)", n, MAX_THREADS);
    NB_CHECK(!in_job, "nb_set_num_threads: called from inside a parallel kernel");
    int size = n ? n : size_from_env(); /* may abort: before taking the lock */
    pthread_mutex_lock(&busy);
    explicit_size = n;
    if (size != P.size) {
        stop_workers();
        P.size = size; /* workers start on the next job */
    }
    pthread_mutex_unlock(&busy);
}

const char *nb__threads_source(void) {
    if (explicit_size) return "nb_set_num_threads";
    const char *v = getenv("NABLA_NUM_THREADS");
    if (v && *v) return "NABLA_NUM_THREADS";
    v = getenv("OMP_NUM_THREADS");
    if (v && *v) return "OMP_NUM_THREADS";
    v = getenv("LOCAL_WORLD_SIZE");
    return v && *v ? "the cores this process may use / LOCAL_WORLD_SIZE"
                   : "the cores this process may use";
}

int nb_get_num_threads(void) {
    int s = P.size;
    if (s) return s;
    s = size_from_env(); /* may abort: before taking the lock */
    pthread_mutex_lock(&busy);
    if (P.size == 0) P.size = explicit_size ? explicit_size : s;
    s = P.size;
    pthread_mutex_unlock(&busy);
    return s;
}
