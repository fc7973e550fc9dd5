/* The meta device: a device that computes nothing and counts what another
 * device would do.
 *
 * A context made on nb_meta(NB_DEVICE_CUDA) ("meta:cuda") or
 * nb_meta(NB_DEVICE_CPU) ("meta:cpu") takes tensors, ops, autograd,
 * optimizers and models like any other: the front end runs exactly as for
 * that device (its backend's flags: which dtypes the products take, which
 * ops are fused, which gradients are added in place), every backend entry
 * call is recorded instead of run, and memory goes through the same arena
 * accounting without a page being touched, so nb_ctx_peak is the real
 * path's peak. What it answers: does a model fit on a GPU at a batch size,
 * how many bytes and FLOPs a step moves, how many kernels it launches,
 * and, with a GPU's figures, about how long it takes (a roofline
 * projection, labelled as one). docs/cuda.md says how to read it.
 *
 * Per call of a backend entry it records the entry, the shapes and dtypes
 * (nb_meta_trace), and:
 * - bytes: each tensor the call reads plus each it writes, whole, with no
 *   cache reuse (a GEMM counts A, B and C, C twice when it accumulates; a
 *   broadcast operand, a view with stride 0 along a dim, counts its own
 *   elements once, as a bias added to every row or a bias's gradient
 *   summed from them occupies only its own memory;
 *   memsets and copies count; an embedding counts the rows it gathers,
 *   and a backward adding into a table's gradient the rows it reads and
 *   writes, min(positions, rows): exact for distinct indices, an upper
 *   bound otherwise, as no index is seen);
 * - gemm_flops: 2 m n k per matrix product (attention's causal products
 *   count their lower triangle only);
 * - flops: the other arithmetic, per element: 1 for elementwise ops and
 *   reductions, 2 axpy and sums of squares, 5 softmax, 4 its backward,
 *   8 layer norm, 10 its backward, 4 cross-entropy, 3 its backward,
 *   12 Adam, 4 SGD;
 * - launches: on meta:cuda, the kernel launches, memsets, copies and
 *   library calls the CUDA path issues (tensor/cuda/launches.h); 0 on
 *   meta:cpu.
 *
 * No values exist: reading one (nb_item, nb_get, nb_to_host, printing, a
 * copy to another device) aborts naming the op, except where the library's
 * own step needs one: gradient clipping (nb_clip_grad_norm) sees a norm of
 * 1e15, so it scales the gradients (the costlier path, as early in
 * training), and the finiteness check of loss scaling and ZeRO sees finite
 * values. The counters are the process's, not a thread's: use the meta
 * device from one thread at a time. */
#ifndef NABLA_META_H
#define NABLA_META_H

#include <stdint.h>
#include <stdio.h>

#include "nabla/api.h"
#include "nabla/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Counts of one backend entry ("matmul", "binary.add", "memset", ...) or
 * of all of them (nb_meta_total). */
typedef struct nb_meta_entry {
    const char *name;
    int64_t calls, launches;
    double bytes, flops, gemm_flops;
    double us; /* projected microseconds on the GPU of nb_meta_set_gpu; 0 without one */
} nb_meta_entry;

/* A GPU's peak figures, for the roofline projection. */
typedef struct nb_meta_gpu {
    const char *name;    /* "h100" */
    const char *label;   /* "NVIDIA H100 SXM5 80GB" */
    double bytes_per_s;  /* memory bandwidth */
    double bf16_flops;   /* dense tensor-core bf16/f16, per second */
    double tf32_flops;   /* dense tensor-core tf32 */
    double f32_flops;    /* f32 without tensor cores */
    double memory_bytes; /* device memory */
    const char *source;  /* where the figures come from */
} nb_meta_gpu;

/* The roofline's stated efficiencies: a call takes
 * max(launches * NB_META_LAUNCH_US, bytes / (bandwidth * NB_META_BW_EFF)
 *     + gemm_flops / (peak * NB_META_GEMM_EFF)),
 * peak being the GPU's for the product's dtype (bf16/f16, tf32 when
 * nb_cuda_allow_tf32, else f32); the other FLOPs are taken as hidden under
 * the memory traffic. */
#define NB_META_BW_EFF 0.8
#define NB_META_GEMM_EFF 0.7
#define NB_META_LAUNCH_US 2.0

/* The GPU named ("h100", "h200", "a100"), or NULL. */
NB_API const nb_meta_gpu *nb_meta_gpu_find(const char *name);
/* The known GPUs, for listing: *n receives their count. */
NB_API const nb_meta_gpu *nb_meta_gpus(int *n);
/* Projects each later call onto gpu (NULL: no projection). */
NB_API void nb_meta_set_gpu(const nb_meta_gpu *gpu);
/* Zeroes the counters (the memory figures are the contexts': nb_ctx_peak). */
NB_API void nb_meta_reset(void);
/* Totals since the last reset (name "total"). */
NB_API nb_meta_entry nb_meta_total(void);
/* The entries seen since the last reset, in the order first seen: copies
 * up to cap of them into out (out may be NULL with cap 0) and returns how
 * many there are. */
NB_API int nb_meta_entries(nb_meta_entry *out, int cap);
/* One line per recorded call to f (entry, each tensor's shape and dtype,
 * bytes, FLOPs, launches); NULL stops. */
NB_API void nb_meta_trace(FILE *f);

#ifdef __cplusplus
}
#endif
#endif
