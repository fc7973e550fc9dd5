/* The CUDA backend's internal interface, callable from C: the runtime
 * (devices, streams, device memory, handles, deferred checks) and one entry
 * point per kernel entry. The op front ends (tensor/ops_*.c) check shapes
 * and dtypes, allocate outputs with nb__empty and call these when their
 * inputs are on a CUDA device, through the backend table
 * (tensor/backend.h, filled by tensor/cuda/backend.c); the CPU kernels
 * they mirror are in tensor/cpu/. An entry point of the table is declared
 * through its entry's function type (tensor/backend.h: the signature and
 * contract, written once for both backends); what is said here adds the
 * CUDA specifics. Implemented by tensor/cuda/ *.cu, which are the CUDA
 * plugin, not libnabla (Note [CUDA plugin] in tensor/cuda_plugin.h):
 * libnabla's tensor/cuda_plugin.c answers the runtime queries that code
 * outside tensor/cuda/ makes, through the plugin or as "no device".
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

/* The kernel entries: nb__cuda_<entry> for each row of NB__BACKEND_KERNELS
 * (tensor/backend.h), defined in the family's .cu file, or, where the
 * kernel's own signature is narrower, as an adapter in tensor/cuda/backend.c.
 * Some are declared again below with what is CUDA-specific about them. */
#define NB__CUDA_DECLARE(e) nb__backend_##e##_fn nb__cuda_##e;
NB__BACKEND_KERNELS(NB__CUDA_DECLARE)
#undef NB__CUDA_DECLARE

/* ===================================================== runtime (runtime.cu) */
/* Visible devices; 0 when there is no driver or no device. */
int nb__cuda_device_count(void);
/* cudaSetDevice, as a status. */
nb_status nb__cuda_set_device(int device);
/* Makes `device` current for the calling thread (aborts naming `op` when
 * it does not exist). Every entry point calls it first. */
nb__backend_use_fn nb__cuda_use;

/* Device memory for contexts' arenas (cudaMalloc); NULL when out of memory. */
nb__backend_mem_alloc_fn nb__cuda_malloc;
nb__backend_mem_free_fn nb__cuda_free;
/* Pinned (page-locked) host memory; NULL when it cannot be had. */
nb__backend_host_alloc_fn nb__cuda_host_alloc;
nb__backend_host_free_fn nb__cuda_host_free;

/* Per-device streams, created on first use: compute (every kernel of
 * every op), copy (the data loader's host-to-device copies). The
 * communication streams belong to the NCCL process groups. */
nb__backend_compute_stream_fn nb__cuda_compute_stream;
nb__backend_copy_stream_fn nb__cuda_copy_stream;
/* The prologue of every CUDA entry point: `device` checked and made
 * current for `op` (nb__cuda_use), and its compute stream, where the
 * entry queues its work. */
static inline nb__stream nb__cuda_enter(const char *op, int device) {
    nb__cuda_use(op, device);
    return nb__cuda_compute_stream(device);
}
/* Events, for ordering one stream after another (never a device-wide sync). */
nb__backend_event_new_fn nb__cuda_event_new;
nb__backend_event_free_fn nb__cuda_event_free;
nb__backend_event_record_fn nb__cuda_event_record;
nb__backend_stream_wait_fn nb__cuda_stream_wait;
/* Blocks the host until e has happened (at once when nothing was recorded). */
nb__backend_event_wait_fn nb__cuda_event_wait;
/* Blocks the host until the compute stream has finished everything queued,
 * then reports a pending deferred fault (aborting with its message). */
nb__backend_sync_fn nb__cuda_sync;

/* The events profile (Note [Events profile] in profile.cu). The table
 * libnabla gets: `of` itself, or, with NABLA_CUDA_PROFILE=events, a copy
 * whose entries are timed with CUDA events (read once; another value
 * aborts naming it). */
const nb__backend *nb__cuda_profile_table(const nb__backend *of);
bool nb__cuda_profile_on(void);
/* Adds the device's recorded pairs to the totals (nb__cuda_sync, once the
 * stream is idle). */
void nb__cuda_profile_resolve(int device);
/* nb_cuda_profile_reset and nb_cuda_profile_write (nabla/cuda.h). */
void nb__cuda_profile_reset(void);
nb_status nb__cuda_profile_write(const char *path);

/* Copies on the compute stream. Host to device returns once the source
 * may be reused (small copies are staged through pinned memory and do not
 * wait for the device: Note [Staged uploads] in runtime.cu); device to host
 * returns when the copy is done (so it waits for all queued work, and
 * checks deferred faults); device to device and memset do not wait. Host
 * memory may be pageable or pinned. */
nb__backend_memcpy_h2d_fn nb__cuda_memcpy_h2d;
nb__backend_memcpy_d2h_fn nb__cuda_memcpy_d2h;
nb__backend_memcpy_d2d_fn nb__cuda_memcpy_d2d;
nb__backend_memset_fn nb__cuda_memset;
/* Asynchronous host-to-device copy on stream s (src should be pinned). */
nb__backend_memcpy_h2d_async_fn nb__cuda_memcpy_h2d_async;

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
NB_PLUGIN_API bool nb__cuda_poison(void);

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
NB_PLUGIN_API bool nb__cuda_tf32(void);

/* ============================================ elementwise (elementwise.cu)
 * Same contracts as the nb__cpu_* engine in tensor/internal.h: out is
 * contiguous with out's shape; inputs have any strides and broadcast to it
 * (stride 0); up to NB_MAX_DIMS dims; dtypes f32, f64, bf16, f16 (where's
 * cond: any dtype; copy: any pair of dtypes, integers included). */
nb__backend_unary_fn nb__cuda_unary;
nb__backend_binary_fn nb__cuda_binary;
nb__backend_where_fn nb__cuda_where;
/* dst (any strides, not necessarily contiguous) = src broadcast to dst's
 * shape, converting dtypes. Also used for fills: src may be a 0-d tensor
 * whose data is HOST memory when src->device is the CPU (value passed by
 * the kernel launch, no copy). */
nb__backend_copy_fn nb__cuda_copy;
/* y (any strides) += alpha * x (same shape, any strides, y's dtype). */
nb__backend_axpy_fn nb__cuda_axpy;

/* ================================================== reductions (reduce.cu)
 * rows: contiguous (outer, inner); reductions run along inner, f32 rows
 * accumulate in f32 with a tree (or f64: the kernel's choice), f64 in f64. */
nb__backend_sum_rows_fn nb__cuda_sum_rows;
/* out (outer) = max of each row, arg (i64, outer) = index of the first
 * maximum (NaN counts as the maximum, as on the CPU). */
nb__backend_max_rows_fn nb__cuda_max_rows;
/* arg (i64, outer) = index of each row's first maximum, NaN first (as
 * nb__cuda_max_rows); inner > 0. */
nb__backend_argmax_rows_fn nb__cuda_argmax_rows;
/* gp (outer, inner) contiguous, fully written: g[o] at arg[o], 0 elsewhere. */
nb__backend_max_rows_backward_fn nb__cuda_max_rows_backward;
/* out (outer) = sum (x - mean)^2 / denom (NaN when denom <= 0), mean (outer). */
nb__backend_var_rows_fn nb__cuda_var_rows;
/* out (0-d) = mean over elements of (a - b)^2 (kind 0) or of
 * max(a,0) - a b + log1p(exp(-|a|)) (kind 1); a, b contiguous, same shape. */
nb__backend_pair_loss_fn nb__cuda_pair_loss;
/* out (0-d, f64 or f32) = sum of squares of every element of the n tensors
 * (contiguous, float dtypes), accumulated in f64 (gradient clipping). */
nb__backend_sum_squares_fn nb__cuda_sum_squares;

/* =============================================== softmax family (softmax.cu)
 * Same contracts as tensor/cpu/softmax.h. */
nb__backend_softmax_fn nb__cuda_softmax;
nb__backend_softmax_backward_fn nb__cuda_softmax_backward;
/* Fused cross-entropy over logits (N, C) contiguous and targets (N) i32/i64.
 * Writes lse (N, logits' dtype; f32 for bf16/f16 logits), count (0-d f32: the targets not
 * ignored) and loss (0-d, logits' dtype) = sum over those rows of
 * (1 - eps)(lse - x[t]) + eps (lse - mean_c x[c]), divided by count
 * (0/0 = NaN when all are ignored). A target outside [0, C) that is not
 * ignore_index raises NB__FAULT_CROSS_ENTROPY_TARGET. */
/* With dlogits (contiguous, the logits' shape and dtype; may be logits:
 * the fused classifier) it also writes dlogits = what the backward below
 * writes for g = 1, and lse may be NULL; three launches (a count kernel
 * first) instead of two. */
void nb__cuda_cross_entropy_rows(nb_tensor *loss, nb_tensor *lse, nb_tensor *count,
                                 nb_tensor *dlogits, const nb_tensor *logits,
                                 const nb_tensor *targets, int64_t ignore_index, double eps);
/* dlogits[i, c] = (g / count) (softmax(x)[i, c] - eps / C - (1 - eps)[c = t_i]) for
 * rows not ignored, 0 for ignored rows (0 everywhere when count is 0);
 * g (0-d) and count are device tensors (no host read). lse NULL: logits
 * hold the fused forward's dlogits, and dlogits = g logits (dlogits may
 * be logits). */
nb__backend_cross_entropy_backward_fn nb__cuda_cross_entropy_backward;

/* ============================ fused causal attention (attention.cu)
 * Note [Attention contract] in tensor/backend.h; f32, bf16 and f16, D at
 * most 128 (takes says so); the path (cuDNN's, our kernels, none) is
 * NABLA_CUDA_ATTENTION's (Note [CUDA attention paths] in attention.cu). */
nb__backend_causal_attention_takes_fn nb__cuda_causal_attention_takes;
nb__backend_causal_attention_fn nb__cuda_causal_attention;
nb__backend_causal_attention_backward_fn nb__cuda_causal_attention_backward;
/* cuDNN's fused attention through the cudnn-frontend graph API
 * (attention_cudnn.cpp), the same contract: true when it enqueued the
 * call; false, with *why saying why in a few words, when cuDNN cannot take
 * it (then nothing was enqueued). Graphs are built once per shape and
 * dtype and kept. In a build without the cudnn-frontend headers it always
 * says so. */
bool nb__cuda_cudnn_attention(nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv, int h,
                              double scale, const char **why);
bool nb__cuda_cudnn_attention_backward(nb_tensor *dqkv, const nb_tensor *qkv,
                                       const nb_tensor *y, const nb_tensor *lse,
                                       const nb_tensor *gy, int h, double scale,
                                       const char **why);

/* ====================================== causal softmax (softmax_causal.cu)
 * Same contracts as nb__cpu_softmax_causal(_backward) (tensor/cpu/softmax.h):
 * x, y, g, dx contiguous (B, T, S) of one dtype; row i keeps
 * j < min(i + 1, S): y = softmax(scale x) there, 0 elsewhere (x is not
 * read there); dx = scale y (g - sum_j g y) on the kept entries, 0
 * elsewhere. */
nb__backend_softmax_causal_fn nb__cuda_softmax_causal;
nb__backend_softmax_causal_backward_fn nb__cuda_softmax_causal_backward;

/* =========================================================== GEMM (matmul.cu) */
/* True when cuBLASLt can read the last two dims of t in place (unit
 * stride in one of them, a leading dimension >= the other size) and the
 * batch dims, flattened, have one stride (or the tensor has one matrix). */
nb__backend_gemm_readable_fn nb__cuda_gemm_readable;
/* out (L, M, N) contiguous = op(a) (La, M, K) @ op(b) (Lb, K, N), La and
 * Lb broadcast to L (a batch of one is stride 0). a and b share a dtype:
 * f32 (TF32 when nb__cuda_tf32()), f64, bf16 or f16 (f32 accumulation);
 * out has a's dtype, or f32 when a is bf16/f16 (the front end asks for f32
 * in a context whose compute dtype is bf16/f16). bias (N) of out's dtype
 * or f32, or NULL, is added to every row (cuBLASLt epilogue); gelu applies
 * GELU(tanh) after the bias, writing the pre-activation into `pre` (same
 * shape as out) when pre is not NULL. K = 0 gives zeros (+ bias).
 * accumulate (no bias, no gelu): out += the product (beta = 1). dgelu_pre:
 * out = product * GELU_tanh'(dgelu_pre) (DGELU); bgrad (M) f32 for a 2-D
 * out: op(a)'s rows summed over K (BGRADB), with accumulate or alone;
 * residual (out's shape and dtype, contiguous, not out): out = product +
 * bias + residual, C = residual with beta = 1 (nb__gemm_epilogue in
 * tensor/backend.h). An epilogue cuBLASLt has no algorithm for runs as a
 * kernel after the plain GEMM. */
void nb__cuda_gemm(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                   bool trans_b, const nb__gemm_epilogue *epi);

/* ================================================= convolution (conv.cu)
 * cuDNN, NCHW, the geometry nb__conv2d_geom (letters of
 * tensor/cpu/conv.h); buffers contiguous of dtype dt (f32, f64, bf16,
 * f16; TF32 per nb__cuda_tf32()). The algorithm is chosen once per
 * geometry and dtype and cached; the workspace is the device's cuDNN
 * workspace (nothing is taken from ctx). */
nb__backend_conv2d_fn nb__cuda_conv2d;
/* Each of dx, dw, db is written (not accumulated) unless NULL. */
nb__backend_conv2d_backward_fn nb__cuda_conv2d_backward;
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
nb__backend_batch_norm_fn nb__cuda_batch_norm;
/* Any of dx, dw, db may be NULL (dw, db: weight's dtype); g of x's dtype;
 * mean, invstd as saved by forward with the same eps; training as for the
 * CPU kernel. */
nb__backend_batch_norm_backward_fn nb__cuda_batch_norm_backward;
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
nb__backend_max_pool2d_fn nb__cuda_max_pool2d;
nb__backend_max_pool2d_backward_fn nb__cuda_max_pool2d_backward;
nb__backend_avg_pool2d_fn nb__cuda_avg_pool2d;
nb__backend_avg_pool2d_backward_fn nb__cuda_avg_pool2d_backward;

/* ================================================ layer norm (layer_norm.cu)
 * Same contracts as tensor/cpu/norm.h except that mean and rstd are f32
 * (M), or f64 when x is f64 (f32 statistics would cost f64 backward its
 * precision); x, y, g, dx contiguous (M, D); w, b (D) or NULL; dx, dw, db
 * written, or added into where add (NB__LN_ADD_*, tensor/backend.h) says
 * so, deterministically. */
nb__backend_layer_norm_fn nb__cuda_layer_norm;
void nb__cuda_layer_norm_backward_rows(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                       const nb_tensor *g, const nb_tensor *x,
                                       const nb_tensor *mean, const nb_tensor *rstd,
                                       const nb_tensor *w, int64_t m, int64_t d, unsigned add);

/* ================================================== embedding (embedding.cu) */
/* out (P, C) contiguous = w[idx[p]] (w (V, C) any strides, idx contiguous
 * i32/i64 of P entries); an index outside [0, V) raises
 * NB__FAULT_EMBEDDING_INDEX (and that row is written as zeros). */
nb__backend_embedding_fn nb__cuda_embedding;
/* gw (V, C) contiguous: row v's sum of g's rows p with idx[p] = v, summed
 * in increasing p from 0 (deterministic, bitwise reproducible), stored
 * (gw fully written) or, with accumulate, added (rows no index hits
 * untouched); g of gw's dtype or 16-bit for an f32 gw. */
nb__backend_embedding_backward_fn nb__cuda_embedding_backward;
/* out (N, T, C) contiguous = wte[idx[n, t]] + wpe[t] in f32 (f64 for f64),
 * rounded once (out of the tables' dtype, or 16-bit for f32 tables); an
 * index outside [0, V) as nb__cuda_embedding's. */
nb__backend_embedding_pos_fn nb__cuda_embedding_pos;
/* gpos (P, C) contiguous, row t < T (+)= sum over n of g (N, T, C), in
 * increasing n from 0; written: rows >= T 0. */
nb__backend_embedding_pos_backward_fn nb__cuda_embedding_pos_backward;

/* ===================================================== dropout (dropout.cu) */
/* Note [Random streams] (tensor/random.c): element i of x (contiguous, n
 * elements) is kept when lane i % 4 of philox(seed, offset + i / 4), as
 * nb_u32_to_unit, compared as a double, is >= p. out = x * mask, mask =
 * 1/(1-p) where kept, 0 elsewhere (mask may be NULL). Bit-identical masks
 * to the CPU. */
nb__backend_dropout_fn nb__cuda_dropout;
/* Same stream as tensor/tensor.c's uniform and normal fills, on the device:
 * t contiguous float (any of the four dtypes), n = numel(t). */
nb__backend_rand_uniform_fn nb__cuda_rand_uniform;
nb__backend_rand_normal_fn nb__cuda_rand_normal;

/* ================================================== optimizers (optim.cu)
 * One fused multi-tensor launch per call over n parameters (contiguous,
 * f32 or f64, each p[i], g[i], m[i], v[i] and vmax[i] the same shape and
 * dtype; vmax or vmax[i] NULL: no AMSGrad), with
 * the order of operations of tensor/cpu/optim.c; steps[i] is
 * parameter i's step count after the increment, hp[i] its group's
 * hyperparameters (NB__HP_*, tensor/backend.h); buf[i] NULL: SGD
 * without momentum. */
nb__backend_adam_fn nb__cuda_adam;
nb__backend_sgd_fn nb__cuda_sgd;

/* =========================================== per-channel statistics (channel.cu)
 * SyncBatchNorm's steps (contracts: nb__backend's channel_* in
 * tensor/backend.h); x, y, dy, dx of f32, f64, bf16 or f16; nothing is
 * read by the host. A global count of at most one per channel raises
 * NB__FAULT_SYNC_BATCH_NORM_COUNT. */
nb__backend_channel_stats_fn nb__cuda_channel_stats;
nb__backend_channel_finalize_fn nb__cuda_channel_finalize;
nb__backend_channel_normalize_fn nb__cuda_channel_normalize;
nb__backend_channel_backward_sums_fn nb__cuda_channel_backward_sums;
nb__backend_channel_backward_dx_fn nb__cuda_channel_backward_dx;

#ifdef __cplusplus
}
#endif
#endif
