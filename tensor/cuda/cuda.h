/* The CUDA backend's internal interface, callable from C: the runtime
 * (devices, streams, device memory, handles, deferred checks) and one entry
 * point per kernel family. The op front ends (tensor/ops_*.c) check shapes
 * and dtypes, allocate outputs with nb__empty and call these when their
 * inputs are on a CUDA device, through the backend table
 * (tensor/backend.h, filled by tensor/cuda/backend.c); the CPU kernels
 * they mirror are in tensor/cpu/. Implemented by tensor/cuda/ *.cu;
 * without CUDA in the build
 * tensor/cuda_stub.c provides versions that abort (they are unreachable:
 * no CUDA context can be made).
 *
 * Conventions for every kernel entry point:
 * - Tensors are on one device (the front end checked); the work is enqueued
 *   on that device's compute stream and the call returns without waiting.
 * - Scratch memory comes from the output tensor's context
 *   (nb_ctx_alloc(out->ctx, ...)), so it is freed at that context's reset.
 *   The libraries' workspaces are the exception: one per device, kept by
 *   the runtime and reused by every call (cuBLASLt's of a fixed size,
 *   cuDNN's grown on demand).
 * - bf16 and f16 are computed in f32; f64 in f64.
 * - Every CUDA, cuBLAS(Lt) and cuDNN call goes through NB_CUDA_CHECK,
 *   NB_CUBLAS_CHECK or NB_CUDNN_CHECK (tensor/cuda/check.h), which abort
 *   naming the op and the call.
 *
 * Letters: as in the CPU kernel headers (tensor/cpu/ *.h). */
#ifndef NABLA_TENSOR_CUDA_H
#define NABLA_TENSOR_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/backend.h" /* nb__stream, nb__event */
#include "tensor/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================== runtime (runtime.cu) */
/* Visible devices; 0 when there is no driver or no device. */
int nb__cuda_device_count(void);
/* cudaSetDevice, as a status. */
nb_status nb__cuda_set_device(int device);
/* Makes `device` current for the calling thread (aborts naming `op` when
 * it does not exist). Every entry point calls it first. */
void nb__cuda_use(const char *op, int device);

/* Device memory for contexts' arenas (cudaMalloc); NULL when out of memory. */
void *nb__cuda_malloc(int device, size_t bytes);
void nb__cuda_free(int device, void *p);
/* Pinned (page-locked) host memory; NULL when it cannot be had. */
void *nb__cuda_host_alloc(size_t bytes);
void nb__cuda_host_free(void *p);

/* Per-device streams, created on first use: compute (every kernel of
 * every op), copy (the data loader's host-to-device copies). The
 * communication streams belong to the NCCL process groups. */
nb__stream nb__cuda_compute_stream(int device);
nb__stream nb__cuda_copy_stream(int device);
/* Events, for ordering one stream after another (never a device-wide sync). */
nb__event nb__cuda_event_new(int device);
void nb__cuda_event_free(nb__event e);
void nb__cuda_event_record(nb__event e, nb__stream s);
void nb__cuda_stream_wait(nb__stream s, nb__event e);
/* Blocks the host until e has happened (at once when nothing was recorded). */
void nb__cuda_event_wait(nb__event e);
/* Blocks the host until the compute stream has finished everything queued,
 * then reports a pending deferred fault (aborting with its message). */
void nb__cuda_sync(int device);

/* Copies on the compute stream. Host to device returns once the source
 * may be reused (small copies are staged through pinned memory and do not
 * wait for the device: Note [Staged uploads] in runtime.cu); device to host
 * returns when the copy is done (so it waits for all queued work, and
 * checks deferred faults); device to device and memset do not wait. Host
 * memory may be pageable or pinned. */
void nb__cuda_memcpy_h2d(int device, void *dst, const void *src, size_t bytes);
void nb__cuda_memcpy_d2h(int device, void *dst, const void *src, size_t bytes);
void nb__cuda_memcpy_d2d(int device, void *dst, const void *src, size_t bytes);
void nb__cuda_memset(int device, void *dst, int byte, size_t bytes);
/* Asynchronous host-to-device copy on stream s (src should be pinned). */
void nb__cuda_memcpy_h2d_async(int device, void *dst, const void *src, size_t bytes,
                               nb__stream s);

/* Handles, created on first use, bound to the compute stream. Returned as
 * void * so that C callers need no CUDA headers: cublasLtHandle_t and
 * cudnnHandle_t. */
void *nb__cuda_cublaslt(int device);
void *nb__cuda_cudnn(int device);
/* cuBLASLt's workspace: one per device, allocated once. */
void *nb__cuda_gemm_workspace(int device, size_t *bytes);
/* cuDNN's lock and workspace, one per device (Note [cuDNN workspace] in
 * runtime.cu). nb__cuda_cudnn_lock makes the handle if needed (it may
 * abort then, before locking), takes the device's cuDNN lock and returns
 * the handle; hold it from the first use of the handle until every call
 * that uses the workspace is enqueued, then nb__cuda_cudnn_unlock. Under
 * the lock, nb__cuda_cudnn_workspace sets *ws to the device's workspace,
 * grown to at least `bytes` (NULL while nothing was ever asked for); it
 * never aborts: a failure to grow returns NB_ERR_NOMEM (or
 * NB_ERR_INTERNAL) with nb_last_error() saying why, the lock still held
 * and the old buffer unchanged. Work using the workspace must be enqueued
 * on the compute stream. */
void *nb__cuda_cudnn_lock(int device);
void nb__cuda_cudnn_unlock(int device);
nb_status nb__cuda_cudnn_workspace(int device, size_t bytes, void **ws);
/* The workspace an algorithm may take before a leaner one is preferred:
 * a sixteenth of the device's memory, at least 1 GiB. */
size_t nb__cuda_cudnn_workspace_limit(int device);
/* For tests: the workspace's size now and (buffers not NULL) how many
 * buffers were allocated for it since the process started. */
size_t nb__cuda_cudnn_workspace_size(int device, int64_t *buffers);

/* Note [Poisoned outputs]: when on (tests), nb__empty fills every new
 * CUDA tensor with 0xFF bytes (NaN for floats, -1 for integers), so an
 * element a kernel forgot to write shows up in a comparison. */
void nb__cuda_set_poison(bool on);
bool nb__cuda_poison(void);

/* Note [Deferred device checks]
 * Kernels that find bad data (an embedding index or a cross-entropy
 * target out of range, a SyncBatchNorm batch of one value per channel
 * across the ranks) cannot abort. They record the first such fault in
 * a per-device slot of mapped host memory (atomicCAS on `code`, then the
 * other fields); the host reads the slot at every synchronisation
 * (nb__cuda_sync, device-to-host copies, nb_cuda_synchronize) and aborts
 * with a message naming the op, the bad value, its position and the
 * valid range (the slot is cleared first, so a test that catches the
 * abort can go on). The results of that step are garbage. */
typedef enum nb__cuda_fault_code {
    NB__FAULT_NONE = 0,
    NB__FAULT_EMBEDDING_INDEX = 1,  /* value = index, position, limit = rows */
    NB__FAULT_CROSS_ENTROPY_TARGET = 2, /* value = target, position, limit = classes */
    NB__FAULT_SYNC_BATCH_NORM_COUNT = 3 /* value = global values per channel */
} nb__cuda_fault_code;
typedef struct nb__cuda_fault {
    int code; /* nb__cuda_fault_code, claimed by atomicCAS from 0 */
    int pad;
    long long value, position, limit;
} nb__cuda_fault;
/* Device-visible pointer to the device's fault slot. */
nb__cuda_fault *nb__cuda_fault_slot(int device);

/* TF32 for f32 GEMM and convolution (nb_cuda_set_allow_tf32). */
bool nb__cuda_tf32(void);

/* ============================================ elementwise (elementwise.cu)
 * Same contracts as the nb__cpu_* engine in tensor/internal.h: out is
 * contiguous with out's shape; inputs have any strides and broadcast to it
 * (stride 0); up to NB_MAX_DIMS dims; dtypes f32, f64, bf16, f16 (where's
 * cond: any dtype; copy: any pair of dtypes, integers included). */
void nb__cuda_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s);
void nb__cuda_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b);
void nb__cuda_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a,
                    const nb_tensor *b);
/* dst (any strides, not necessarily contiguous) = src broadcast to dst's
 * shape, converting dtypes. Also used for fills: src may be a 0-d tensor
 * whose data is HOST memory when src->device is the CPU (value passed by
 * the kernel launch, no copy). */
void nb__cuda_copy(nb_tensor *dst, const nb_tensor *src);
/* y (any strides) += alpha * x (same shape, any strides, y's dtype). */
void nb__cuda_axpy(nb_tensor *y, double alpha, const nb_tensor *x);

/* ================================================== reductions (reduce.cu)
 * rows: contiguous (outer, inner); reductions run along inner, f32 rows
 * accumulate in f32 with a tree (or f64: the kernel's choice), f64 in f64. */
void nb__cuda_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner,
                       double scale);
/* out (outer) = max of each row, arg (i64, outer) = index of the first
 * maximum (NaN counts as the maximum, as on the CPU). */
void nb__cuda_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                       int64_t inner);
/* arg (i64, outer) = index of each row's first maximum, NaN first (as
 * nb__cuda_max_rows); inner > 0. */
void nb__cuda_argmax_rows(nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner);
/* gp (outer, inner) contiguous, fully written: g[o] at arg[o], 0 elsewhere. */
void nb__cuda_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g,
                                int64_t outer, int64_t inner);
/* out (outer) = sum (x - mean)^2 / denom (NaN when denom <= 0), mean (outer). */
void nb__cuda_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                       int64_t inner, double denom);
/* out (0-d) = mean over elements of (a - b)^2 (kind 0) or of
 * max(a,0) - a b + log1p(exp(-|a|)) (kind 1); a, b contiguous, same shape. */
void nb__cuda_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b);
/* out (0-d, f64 or f32) = sum of squares of every element of the n tensors
 * (contiguous, float dtypes), accumulated in f64 (gradient clipping). */
void nb__cuda_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts);

/* =============================================== softmax family (softmax.cu)
 * Same contracts as tensor/cpu/softmax.h. */
void nb__cuda_softmax(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k, int64_t inner,
                      bool take_log);
void nb__cuda_softmax_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                               int64_t outer, int64_t k, int64_t inner, bool take_log);
/* Fused cross-entropy over logits (N, C) contiguous and targets (N) i32/i64.
 * Writes lse (N, logits' dtype; f32 for bf16/f16 logits), count (0-d f32: the targets not
 * ignored) and loss (0-d, logits' dtype) = sum over those rows of
 * (1 - eps)(lse - x[t]) + eps (lse - mean_c x[c]), divided by count
 * (0/0 = NaN when all are ignored). A target outside [0, C) that is not
 * ignore_index raises NB__FAULT_CROSS_ENTROPY_TARGET. */
void nb__cuda_cross_entropy(nb_tensor *loss, nb_tensor *lse, nb_tensor *count,
                            const nb_tensor *logits, const nb_tensor *targets,
                            int64_t ignore_index, double eps);
/* dlogits[i, c] = (g / count) (softmax(x)[i, c] - eps / C - (1 - eps)[c = t_i]) for
 * rows not ignored, 0 for ignored rows (0 everywhere when count is 0);
 * g (0-d) and count are device tensors (no host read). */
void nb__cuda_cross_entropy_backward(nb_tensor *dlogits, const nb_tensor *logits,
                                     const nb_tensor *lse, const nb_tensor *targets,
                                     const nb_tensor *g, const nb_tensor *count,
                                     int64_t ignore_index, double eps);

/* ====================================== causal softmax (softmax_causal.cu)
 * Same contracts as nb__cpu_softmax_causal(_backward) (tensor/cpu/softmax.h):
 * x, y, g, dx contiguous (B, T, S) of one dtype; row i keeps
 * j < min(i + 1, S): y = softmax(scale x) there, 0 elsewhere (x is not
 * read there); dx = scale y (g - sum_j g y) on the kept entries, 0
 * elsewhere. */
void nb__cuda_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s,
                             double scale);
void nb__cuda_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                      int64_t b, int64_t t, int64_t s, double scale);

/* =========================================================== GEMM (matmul.cu) */
/* True when cuBLASLt can read the last two dims of t in place (unit
 * stride in one of them, a leading dimension >= the other size) and the
 * batch dims, flattened, have one stride (or the tensor has one matrix). */
bool nb__cuda_gemm_readable(const nb_tensor *t);
/* out (L, M, N) contiguous = op(a) (La, M, K) @ op(b) (Lb, K, N), La and
 * Lb broadcast to L (a batch of one is stride 0). a and b share a dtype:
 * f32 (TF32 when nb__cuda_tf32()), f64, bf16 or f16 (f32 accumulation);
 * out has a's dtype, or f32 when a is bf16/f16 (the front end asks for f32
 * in a context whose compute dtype is bf16/f16). bias (N) of out's dtype
 * or NULL is added to every row (cuBLASLt epilogue); gelu applies
 * GELU(tanh) after the bias, writing the pre-activation into `pre` (same
 * shape as out) when pre is not NULL. K = 0 gives zeros (+ bias). */
void nb__cuda_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                     bool trans_b, const nb_tensor *bias, bool gelu, nb_tensor *pre);

/* ================================================= convolution (conv.cu)
 * cuDNN, NCHW, the geometry nb__conv2d_geom (letters of
 * tensor/cpu/conv.h); buffers contiguous of dtype dt (f32, f64, bf16,
 * f16; TF32 per nb__cuda_tf32()). The algorithm is chosen once per
 * geometry and dtype and cached; the workspace is the device's cuDNN
 * workspace (nothing is taken from ctx). */
void nb__cuda_conv2d_forward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *out,
                             const void *x, const void *w, const void *b);
/* Each of dx, dw, db is written (not accumulated) unless NULL. */
void nb__cuda_conv2d_backward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *dx,
                              void *dw, void *db, const void *gout, const void *x,
                              const void *w);
/* For tests: the workspace bytes of the algorithms chosen on `device` for
 * forward, backward data and backward filter (bytes[0], [1], [2]), choosing them
 * as a call would. */
void nb__cuda_conv2d_workspace_sizes(int device, nb_dtype dt, const nb__conv2d_geom *g,
                                     size_t *bytes);

/* ================================================ batch norm (batch_norm.cu)
 * x, y contiguous (N, C, S). weight/bias (C) contiguous of any float dtype
 * (the front end passes x's) or NULL (then 1 and 0). The saved statistics
 * mean and invstd (C) are f64 when x is f64, else f32. Training: batch
 * statistics; saves mean and invstd = 1/sqrt(biased var + eps), and updates
 * running_mean/var (C, f32 or f64, any stride, or NULL) in place with
 * momentum and the unbiased variance. Eval: the running statistics (then
 * save_mean/save_invstd receive mean and 1/sqrt(running var + eps), for
 * backward). Through cuDNN where it can, else our kernels: Note [Batch
 * norm: cuDNN or our kernels] in batch_norm.cu. */
void nb__cuda_batch_norm(nb_tensor *y, nb_tensor *save_mean, nb_tensor *save_invstd,
                         const nb_tensor *x, const nb_tensor *weight, const nb_tensor *bias,
                         nb_tensor *running_mean, nb_tensor *running_var, bool training,
                         double momentum, double eps, int64_t n, int64_t c, int64_t s);
/* Any of dx, dw, db may be NULL (dw, db: weight's dtype); g of x's dtype;
 * mean, invstd as saved by forward with the same eps; training as for the
 * CPU kernel. */
void nb__cuda_batch_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                  const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                  const nb_tensor *invstd, const nb_tensor *weight, bool training,
                                  double eps, int64_t n, int64_t c, int64_t s);
/* Whether a call with these arguments goes through cuDNN (x (N, C, ...) on
 * a CUDA device; backward: running statistics NULL, training true). */
bool nb__cuda_batch_norm_cudnn_ok(const nb_tensor *x, const nb_tensor *running_mean,
                                  const nb_tensor *running_var, bool training, double eps);
/* For tests and debugging: on (the default, or NABLA_CUDA_BN=cudnn) uses
 * cuDNN where it can; off (NABLA_CUDA_BN=own) uses our kernels only.
 * Process-wide; returns the previous setting. */
bool nb__cuda_batch_norm_set_cudnn(bool on);
/* How many forward (training and eval) and backward calls have gone
 * through cuDNN since the process started. */
void nb__cuda_batch_norm_cudnn_calls(int64_t *forward, int64_t *backward);

/* ===================================================== pooling (pool.cu) */
/* Same semantics as tensor/ops_pool.c; x, out, dx, g contiguous. */
void nb__cuda_max_pool2d(nb_tensor *out, nb_tensor *arg, const nb_tensor *x,
                         const nb__pool2d_geom *g);
void nb__cuda_max_pool2d_backward(nb_tensor *dx, const nb_tensor *arg, const nb_tensor *gout,
                                  const nb__pool2d_geom *g);
void nb__cuda_avg_pool2d(nb_tensor *out, const nb_tensor *x, const nb__pool2d_geom *g);
void nb__cuda_avg_pool2d_backward(nb_tensor *dx, const nb_tensor *gout,
                                  const nb__pool2d_geom *g);

/* ================================================ layer norm (layer_norm.cu)
 * Same contracts as tensor/cpu/norm.h except that mean and rstd are f32
 * (M), or f64 when x is f64 (f32 statistics would cost f64 backward its
 * precision); x, y, g, dx contiguous (M, D); w, b (D) or NULL; dw, db
 * written (not accumulated), deterministically. */
void nb__cuda_layer_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x,
                         const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d,
                         double eps);
void nb__cuda_layer_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                  const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                  const nb_tensor *rstd, const nb_tensor *w, int64_t m,
                                  int64_t d);

/* ================================================== embedding (embedding.cu) */
/* out (P, C) contiguous = w[idx[p]] (w (V, C) any strides, idx contiguous
 * i32/i64 of P entries); an index outside [0, V) raises
 * NB__FAULT_EMBEDDING_INDEX (and that row is written as zeros). */
void nb__cuda_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np);
/* gw (V, C) contiguous, fully written: row v = sum of g's rows p with
 * idx[p] = v, summed in increasing p (deterministic, bitwise reproducible). */
void nb__cuda_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                 int64_t np);

/* ===================================================== dropout (dropout.cu) */
/* Note [Random streams] (tensor/random.c): element i of x (contiguous, n
 * elements) is kept when lane i % 4 of philox(seed, offset + i / 4), as
 * nb_u32_to_unit, compared as a double, is >= p. out = x * mask, mask =
 * 1/(1-p) where kept, 0 elsewhere (mask may be NULL). Bit-identical masks
 * to the CPU. */
void nb__cuda_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p,
                      uint64_t seed, uint64_t offset);
/* Same stream as tensor/tensor.c's uniform and normal fills, on the device:
 * t contiguous float (any of the four dtypes), n = numel(t). */
void nb__cuda_rand_uniform(nb_tensor *t, double low, double high, uint64_t seed,
                           uint64_t offset);
void nb__cuda_rand_normal(nb_tensor *t, double mean, double std, uint64_t seed, uint64_t offset);

/* ================================================== optimizers (optim.cu)
 * One fused multi-tensor launch per call over n parameters (contiguous,
 * f32 or f64, each p[i], g[i], m[i], v[i] and vmax[i] the same shape and
 * dtype; vmax or vmax[i] NULL: no AMSGrad), with
 * the order of operations of tensor/cpu/optim.c; steps[i] is
 * parameter i's step count after the increment, hp[i] its group's
 * hyperparameters (NB__HP_*, tensor/backend.h); buf[i] NULL: SGD
 * without momentum. */
void nb__cuda_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m,
                   nb_tensor *const *v, nb_tensor *const *vmax, const int64_t *steps,
                   const double *const *hp, bool decoupled);
void nb__cuda_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf,
                  const int64_t *steps, const double *const *hp);

/* =========================================== per-channel statistics (channel.cu)
 * SyncBatchNorm's steps (contracts: nb__backend's channel_* in
 * tensor/backend.h); x, y, dy, dx of f32, f64, bf16 or f16; nothing is
 * read by the host. A global count of at most one per channel raises
 * NB__FAULT_SYNC_BATCH_NORM_COUNT. */
void nb__cuda_channel_stats(nb_tensor *stats, const nb_tensor *x, int64_t n, int64_t c, int64_t s);
void nb__cuda_channel_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                               nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                               double eps, int64_t c, const nb_tensor *input);
void nb__cuda_channel_normalize(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                                const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                                int64_t n, int64_t c, int64_t s);
void nb__cuda_channel_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                    const nb_tensor *mean, const nb_tensor *invstd, int64_t n,
                                    int64_t c, int64_t s);
void nb__cuda_channel_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                                  const nb_tensor *mean, const nb_tensor *invstd,
                                  const nb_tensor *w, const nb_tensor *sums,
                                  const nb_tensor *stats, int64_t n, int64_t c, int64_t s);

#ifdef __cplusplus
}
#endif
#endif
