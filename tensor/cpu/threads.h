/* The CPU kernels' thread pool (tensor/cpu/threads.c; the public side is
 * include/nabla/threads.h).
 *
 * Note [Deterministic parallel kernels]: a kernel cuts its work into
 * chunks whose bounds depend only on the sizes of the problem (never on the
 * thread count), each chunk writes only its own outputs, and a reduction
 * keeps one partial per chunk and combines the partials in chunk order on
 * the calling thread. Which thread runs which chunk is then irrelevant, and
 * the result is bitwise the same for 1, 2 or 64 threads. A kernel whose
 * problem is smaller than its threshold runs as one chunk on the caller, so
 * small ops keep their fixed cost. */
#ifndef NABLA_TENSOR_CPU_THREADS_H
#define NABLA_TENSOR_CPU_THREADS_H

#include <stdint.h>

/* Runs chunk `chunk` of a job; `tid`, in [0, nb__parallel_threads(n)),
 * names the thread running it (for per-thread scratch). */
typedef void (*nb__task_fn)(void *arg, int64_t chunk, int tid);

/* Runs fn(arg, c, tid) for every c in [0, n_chunks) on up to
 * nb__parallel_threads(n_chunks) threads, the caller among them, and
 * returns when all are done. Called from inside a chunk, or while another
 * thread's job holds the pool, it runs every chunk on the caller (tid 0). */
void nb__parallel_for(int64_t n_chunks, nb__task_fn fn, void *arg);

/* How many threads nb__parallel_for(n_chunks, ...) may use: min(n_chunks,
 * the pool's size), at least 1. */
int nb__parallel_threads(int64_t n_chunks);

/* Runs fn(arg, lo, hi) over [0, n) cut into pieces of `grain` items (the
 * last one shorter), on the pool when there are two pieces or more. */
typedef void (*nb__range_fn)(void *arg, int64_t lo, int64_t hi);
void nb__parallel_range(int64_t n, int64_t grain, nb__range_fn fn, void *arg);

/* Items per piece for items of `cost` elements each: about
 * NB__PARALLEL_GRAIN elements of work a piece, at least one item. */
#define NB__PARALLEL_GRAIN 16384
static inline int64_t nb__grain(int64_t cost) {
    return cost >= NB__PARALLEL_GRAIN ? 1 : NB__PARALLEL_GRAIN / (cost > 0 ? cost : 1);
}

/* Where the pool's size came from, in words ("NABLA_NUM_THREADS", "the
 * cores this process may use", ...), for nb_config_string. */
const char *nb__threads_source(void);

/* ceil(n / grain), at least 1 */
static inline int64_t nb__chunk_count(int64_t n, int64_t grain) {
    return n <= grain ? 1 : (n + grain - 1) / grain;
}

#endif
