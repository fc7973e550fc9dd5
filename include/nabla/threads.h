/* Threads of the CPU kernels.
 *
 * nabla's own CPU kernels (elementwise, GELU, softmax, layer norm,
 * reductions, losses, optimizer updates, attention across heads) run on a
 * small pool of threads of the process; the GEMMs run on OpenBLAS's own
 * threads. Results are bitwise identical for any thread count: work is cut
 * into pieces whose size does not depend on the count, and partial sums are
 * combined in a fixed order.
 *
 * The pool's size is, first found: nb_set_num_threads(n); the variable
 * NABLA_NUM_THREADS; OMP_NUM_THREADS (so that a run pinned to one thread
 * for a comparison is pinned on every side); the cores this process may
 * run on (sched_getaffinity) divided by the ranks sharing the node
 * (LOCAL_WORLD_SIZE, which nbrun and torchrun set), at least 1, or not
 * divided when nbrun bound the process to its own share of the CPUs
 * (NABLA_CPU_BIND=cores). A variable
 * that is set but is not a whole number from 1 to 1024 aborts with a
 * message naming it and its value. */
#ifndef NABLA_THREADS_H
#define NABLA_THREADS_H

#include "nabla/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs the CPU kernels on n threads (the caller's included) from now on;
 * n = 0 goes back to the size the environment gives (above). n < 0 or
 * n > 1024 aborts. OpenBLAS keeps its own thread count
 * (OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else every core; or
 * openblas_set_num_threads): results are bitwise the same for any n, and
 * changing OpenBLAS's count may change GEMMs in the last bits (its
 * one-thread path uses other kernels for some shapes). Call it between
 * steps, from the thread that runs the model. */
NB_API void nb_set_num_threads(int n);

/* The number of threads the CPU kernels run on (resolving the environment
 * on first use). */
NB_API int nb_get_num_threads(void);

#ifdef __cplusplus
}
#endif

#endif
