/* The per-device backend interface: one struct of entry points per device
 * type, filled by tensor/cpu/backend.c and (in the CUDA plugin, Note
 * [CUDA plugin] in tensor/cuda_plugin.h) tensor/cuda/backend.c, looked
 * up from a tensor's or context's device with nb__backend_of. Code above tensor/ (layers, models, optimizers,
 * data, distributed) calls the device-neutral wrappers below or the op
 * front ends, never a device's kernels: Note [Backend interface] in
 * docs/design.md says what belongs here and how to add an entry point.
 *
 * Each entry's signature is written once, as a function type
 * nb__backend_<entry>_fn below with its contract; each kernel entry is also
 * a row of NB__BACKEND_KERNELS, from which the table's member, both
 * backends' declarations (`nb__backend_softmax_fn nb__cpu_softmax;` in
 * tensor/cpu/cpu.h, nb__cuda_softmax in tensor/cuda/cuda.h) and both
 * tables' initialisers are generated, so a kernel whose definition drifts
 * from the contract fails to compile and a missing one fails to link. A
 * kernel with a narrower signature has a name of its own and is reached
 * through an adapter named after the entry, in its backend's backend.c.
 * Contracts are device-neutral: the front end has checked shapes, dtypes
 * and devices and allocated the outputs; an entry enqueues its work on the
 * device (on the CPU: does it) and returns. */
#ifndef NABLA_TENSOR_BACKEND_H
#define NABLA_TENSOR_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A device's queue and a marker in it (cudaStream_t and cudaEvent_t on
 * CUDA; NULL on the CPU, where work is done when its call returns). */
typedef struct CUstream_st *nb__stream;
typedef struct CUevent_st *nb__event;

/* The hyperparameters of an optimizer's parameter group, in this order:
 * the multi-tensor updates (adam, sgd) read them from hp[i]; optim/
 * keeps them as the elements of one f64 tensor per group (so checkpoints
 * restore them). */
enum {
    NB__HP_LR,
    NB__HP_WEIGHT_DECAY,
    NB__HP_MOMENTUM,
    NB__HP_DAMPENING,
    NB__HP_NESTEROV,
    NB__HP_BETA1,
    NB__HP_BETA2,
    NB__HP_EPS,
    NB__HP_AMSGRAD, /* 0 or 1 */
    NB__HP_COUNT
};

/* ---- runtime ---- */
/* Makes `device` current for the calling thread (aborts naming op). */
typedef void nb__backend_use_fn(const char *op, int device);
/* Blocks the host until the device has done everything queued. */
typedef void nb__backend_sync_fn(int device);
/* A context's arena memory on `device`: bytes a multiple of 64, the
 * block aligned to 64 at least; NULL when there is none. */
typedef void *nb__backend_mem_alloc_fn(int device, size_t bytes);
typedef void nb__backend_mem_free_fn(int device, void *p);
/* Fresh tensor data (nb__empty): filled with 0xFF bytes while Note
 * [Poisoned outputs] (tensor/cuda/cuda.h) is on; else untouched. */
typedef void nb__backend_poison_fn(int device, void *p, size_t bytes);
typedef void nb__backend_memset_fn(int device, void *dst, int byte, size_t bytes);
typedef void nb__backend_memcpy_d2d_fn(int device, void *dst, const void *src, size_t bytes);
/* dst (device) = src (host); returns once src may be reused (small
 * copies do not wait for the device: Note [Staged uploads] in
 * tensor/cuda/runtime.cu). */
typedef void nb__backend_memcpy_h2d_fn(int device, void *dst, const void *src, size_t bytes);
/* dst (host) = src (device); returns when the copy is done, so after
 * everything queued before it (and reports deferred device faults). */
typedef void nb__backend_memcpy_d2h_fn(int device, void *dst, const void *src, size_t bytes);
/* dst (device) = src (host, pinned where possible), on stream s. */
typedef void nb__backend_memcpy_h2d_async_fn(int device, void *dst, const void *src, size_t bytes,
                                             nb__stream s);
/* Host memory the device reads fast (pinned); NULL when none. */
typedef void *nb__backend_host_alloc_fn(size_t bytes);
typedef void nb__backend_host_free_fn(void *p);
typedef nb__stream nb__backend_compute_stream_fn(int device);
typedef nb__stream nb__backend_copy_stream_fn(int device);
typedef nb__event nb__backend_event_new_fn(int device);
typedef void nb__backend_event_free_fn(nb__event e);
typedef void nb__backend_event_record_fn(nb__event e, nb__stream s);
/* Stream s waits for e (the host does not). */
typedef void nb__backend_stream_wait_fn(nb__stream s, nb__event e);
/* The host waits for e (at once when nothing was recorded). */
typedef void nb__backend_event_wait_fn(nb__event e);

/* ---- elementwise engine (nb__cpu_unary & co., tensor/internal.h) ---- */
typedef void nb__backend_unary_fn(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s);
typedef void nb__backend_binary_fn(nb__binary_op op, nb_tensor *out, const nb_tensor *a,
                                   const nb_tensor *b);
typedef void nb__backend_where_fn(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a,
                                  const nb_tensor *b);
/* dst (any strides) = src broadcast to dst's shape, converting dtypes
 * (integers included). src is on dst's device, or is a 0-d tensor in
 * host memory (src->device the CPU): a fill (nb_fill_). Between two
 * devices, tensor/tensor.c stages through the host with memcpy_h2d/d2h. */
typedef void nb__backend_copy_fn(nb_tensor *dst, const nb_tensor *src);
/* y (any strides) += alpha * x (same shape, any strides, y's float dtype). */
typedef void nb__backend_axpy_fn(nb_tensor *y, double alpha, const nb_tensor *x);

/* ---- row reductions (tensor/ops_reduce.c lays the input out as rows:
 * contiguous (outer, inner), reduced along inner; CPU: in order, f32
 * accumulating in f64; CUDA: a tree, f32 in f32 or f64) ---- */
/* out (outer) = scale * sum of each row. */
typedef void nb__backend_sum_rows_fn(nb_tensor *out, const nb_tensor *rows, int64_t outer,
                                     int64_t inner, double scale);
/* out (outer) = max of each row, arg (i64, outer) its index: the first
 * maximum, NaN counting as the maximum (Note [Max with NaN] in
 * tensor/cuda/reduce.cu); inner > 0 unless outer is 0. */
typedef void nb__backend_max_rows_fn(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows,
                                     int64_t outer, int64_t inner);
/* arg (i64, outer) = index of each row's first maximum, the first NaN
 * if the row has one (torch.argmax); inner > 0. */
typedef void nb__backend_argmax_rows_fn(nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                                        int64_t inner);
/* gp (outer, inner) contiguous, fully written: g[o] (g contiguous,
 * outer) at arg[o], 0 elsewhere. */
typedef void nb__backend_max_rows_backward_fn(nb_tensor *gp, const nb_tensor *arg,
                                              const nb_tensor *g, int64_t outer, int64_t inner);
/* mean (outer) = mean of each row; out (outer) = sum (x - mean)^2 /
 * denom, NaN when denom <= 0. */
typedef void nb__backend_var_rows_fn(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows,
                                     int64_t outer, int64_t inner, double denom);

/* ---- GEMM (tensor/cpu/matmul.h, nb__cuda_gemm) ---- */
/* Whether the GEMM reads t in place (else the front end copies it). */
typedef bool nb__backend_gemm_readable_fn(const nb_tensor *t);
/* What a GEMM does besides the product (NULL: nothing). bias (N), of
 * out's dtype or f32, is added to every row; gelu: GELU(tanh) of that,
 * the pre-activation written into pre (out's shape and dtype) when not
 * NULL. accumulate (only where gemm_accumulate, with neither): out += the
 * product. dgelu_pre (out's shape and dtype): out = product *
 * GELU_tanh'(dgelu_pre), the gradient through a GELU (cuBLASLt's DGELU).
 * bgrad (M) f32, out 2-D: written with op(a)'s rows summed over K, a bias
 * gradient (cuBLASLt's BGRADB); with accumulate or alone, never with the
 * others. The last two only where gemm_epilogues (Note [GEMM epilogues in
 * backward] in tensor/ops_matmul.c); every backend computes them.
 * residual (out's shape and dtype, contiguous, never out itself): out =
 * residual + the product and bias (C in with beta = 1, D apart; cuBLASLt's
 * one rounding, the CPU's two: Note [Residual in the GEMM]); with bias
 * only, every backend. */
typedef struct nb__gemm_epilogue {
    const nb_tensor *bias;
    bool gelu;
    nb_tensor *pre;
    bool accumulate;
    const nb_tensor *dgelu_pre;
    nb_tensor *bgrad;
    const nb_tensor *residual;
} nb__gemm_epilogue;
/* out (L, M, N) = op(a) @ op(b), then epi (when not NULL). */
typedef void nb__backend_matmul_fn(nb_tensor *out, const nb_tensor *a, const nb_tensor *b,
                                   bool trans_a, bool trans_b, const nb__gemm_epilogue *epi);
/* dx = g * GELU_tanh'(pre), all contiguous of one shape and dtype. */
typedef void nb__backend_gelu_tanh_backward_fn(nb_tensor *dx, const nb_tensor *g,
                                               const nb_tensor *pre);

/* ---- softmax family (tensor/cpu/softmax.h) ---- */
typedef void nb__backend_softmax_fn(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k,
                                    int64_t inner, bool take_log);
typedef void nb__backend_softmax_backward_fn(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                             int64_t outer, int64_t k, int64_t inner,
                                             bool take_log);
typedef void nb__backend_softmax_causal_fn(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t,
                                           int64_t s, double scale);
typedef void nb__backend_softmax_causal_backward_fn(nb_tensor *dx, const nb_tensor *y,
                                                    const nb_tensor *g, int64_t b, int64_t t,
                                                    int64_t s, double scale);
/* Fused causal self-attention (optional: tensor/cpu/attention.h says what
 * it computes). Note [Attention contract]: the forward writes y (N, T, C)
 * from qkv (N, T, 3C) with h heads and lse (N, H, T), f32 whatever the
 * dtype: row i's log-sum-exp of the scaled scores, log sum_{j <= i}
 * exp(scale q_i . k_j). The backward writes every element of dqkv
 * (N, T, 3C) in place (no zeroed buffer, slices or adds) from qkv, the
 * forward's y and lse, and gy, the gradient of y. qkv, y and gy are
 * contiguous of qkv's dtype. Nothing of size (N, H, T, T) is kept between
 * the two: a backend makes the probabilities again, from lse
 * (p = exp(scale q k^T - lse), the flash-attention way) or whole (the CPU:
 * Note [Attention without stored probabilities] in tensor/cpu/attention.c).
 * Scratch comes from ctx and is given back before the call returns. */
typedef void nb__backend_causal_attention_fn(nb_ctx *ctx, nb_tensor *y, nb_tensor *lse,
                                             const nb_tensor *qkv, int h, double scale);
typedef void nb__backend_causal_attention_backward_fn(nb_ctx *ctx, nb_tensor *dqkv,
                                                      const nb_tensor *qkv, const nb_tensor *y,
                                                      const nb_tensor *lse, const nb_tensor *gy,
                                                      int h, double scale);
/* Whether the fused attention takes this call of its dtypes (a head
 * dimension it has tiles for, a path a setting has not turned off); NULL
 * where it takes every one. */
typedef bool nb__backend_causal_attention_takes_fn(const nb_tensor *qkv, int h);
typedef void nb__backend_layer_norm_fn(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd,
                                       const nb_tensor *x, const nb_tensor *w, const nb_tensor *b,
                                       int64_t m, int64_t d, double eps);
/* Which of layer norm backward's outputs are added into (they hold a
 * gradient already: Note [Layer norm's gradients added in place] in
 * tensor/ops_norm.c) rather than written. */
enum { NB__LN_ADD_DX = 1, NB__LN_ADD_DW = 2, NB__LN_ADD_DB = 4 };
/* dx, dw, db written, or added into where add (NB__LN_ADD_*) says so:
 * each contribution is rounded to its output's dtype, then added to what
 * the output holds in that dtype's arithmetic (f32 for bf16 and f16) and
 * rounded again, the bits a separate add of a written output would give.
 * ctx holds scratch. */
typedef void nb__backend_layer_norm_backward_fn(nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw,
                                                nb_tensor *db, const nb_tensor *g,
                                                const nb_tensor *x, const nb_tensor *mean,
                                                const nb_tensor *rstd, const nb_tensor *w,
                                                int64_t m, int64_t d, unsigned add);
/* The whole batch norm, running statistics included (nb__cuda_batch_norm). */
typedef void nb__backend_batch_norm_fn(nb_tensor *y, nb_tensor *save_mean, nb_tensor *save_invstd,
                                       const nb_tensor *x, const nb_tensor *weight,
                                       const nb_tensor *bias, nb_tensor *running_mean,
                                       nb_tensor *running_var, bool training, double momentum,
                                       double eps, int64_t n, int64_t c, int64_t s);
typedef void nb__backend_batch_norm_backward_fn(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                                const nb_tensor *g, const nb_tensor *x,
                                                const nb_tensor *mean, const nb_tensor *invstd,
                                                const nb_tensor *weight, bool training, double eps,
                                                int64_t n, int64_t c, int64_t s);

/* ---- convolution (nb__conv2d_geom, tensor/internal.h; contiguous buffers
 * of dtype dt; scratch from ctx) ---- */
typedef void nb__backend_conv2d_fn(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *out,
                                   const void *x, const void *w, const void *b);
/* Each of dx, dw, db is written (not accumulated) unless NULL. */
typedef void nb__backend_conv2d_backward_fn(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g,
                                            void *dx, void *dw, void *db, const void *gout,
                                            const void *x, const void *w);

/* ---- pooling (tensor/ops_pool.c; contiguous) ---- */
typedef void nb__backend_max_pool2d_fn(nb_tensor *out, nb_tensor *arg, const nb_tensor *x,
                                       const nb__pool2d_geom *g);
typedef void nb__backend_max_pool2d_backward_fn(nb_tensor *dx, const nb_tensor *arg,
                                                const nb_tensor *gout, const nb__pool2d_geom *g);
typedef void nb__backend_avg_pool2d_fn(nb_tensor *out, const nb_tensor *x,
                                       const nb__pool2d_geom *g);
typedef void nb__backend_avg_pool2d_backward_fn(nb_tensor *dx, const nb_tensor *gout,
                                                const nb__pool2d_geom *g);

/* ---- random fills, dropout, embedding, losses (contracts:
 * tensor/cuda/cuda.h) ---- */
/* t (contiguous, float) = the uniform or normal stream of generator
 * (seed, offset) (Note [Random streams] in tensor/random.c); the caller
 * advances the offset. */
typedef void nb__backend_rand_uniform_fn(nb_tensor *t, double low, double high, uint64_t seed,
                                         uint64_t offset);
typedef void nb__backend_rand_normal_fn(nb_tensor *t, double mean, double std, uint64_t seed,
                                        uint64_t offset);
typedef void nb__backend_dropout_fn(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p,
                                    uint64_t seed, uint64_t offset);
/* An index out of range: an abort naming it on the CPU, a deferred
 * device fault on CUDA. */
typedef void nb__backend_embedding_fn(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx,
                                      int64_t np);
/* gw (V, C) contiguous; g (P, C) contiguous, of gw's dtype or, for an
 * f32 gw, bf16 or f16 (read as it is, summed in f32). Row v's sum, of g's
 * rows p with idx[p] = v in increasing p from 0, is formed first; then
 * with accumulate it is added into row v (rows no index hits untouched),
 * else gw is fully written (those rows 0). Deterministic. */
typedef void nb__backend_embedding_backward_fn(nb_tensor *gw, const nb_tensor *g,
                                               const nb_tensor *idx, int64_t np, bool accumulate);
/* The GPT's input: out (N, T, C) contiguous = wte[idx[n, t]] + wpe[t]
 * (wte (V, C) and wpe (P >= T, C) of one float dtype, any strides; idx
 * (N, T) contiguous), added in f32 (f64 for f64) and rounded once to out's
 * dtype (the weights', or 16-bit for f32 weights). An index out of range
 * as nb__backend_embedding_fn's. */
typedef void nb__backend_embedding_pos_fn(nb_tensor *out, const nb_tensor *wte,
                                          const nb_tensor *wpe, const nb_tensor *idx);
/* gpos (P >= T, C) contiguous, row t < T: sum over n of g (N, T, C)
 * contiguous (dtypes as nb__backend_embedding_backward_fn's), in
 * increasing n from 0, then added (accumulate; rows >= T untouched) or
 * written (rows >= T 0). Deterministic. */
typedef void nb__backend_embedding_pos_backward_fn(nb_tensor *gpos, const nb_tensor *g,
                                                   bool accumulate);
/* Fused cross-entropy (contract: nb__cuda_cross_entropy_rows). The entry
 * makes lse (N) and count (0-d: the targets not ignored) in ctx, in
 * the dtypes its backward reads; a target out of range is an abort
 * naming it on the CPU, a deferred device fault on CUDA. With dlogits
 * (the fused classifier, Note [Fused classifier] in tensor/ops_loss.c)
 * it also writes dlogits = the backward's result for g = 1 (dlogits may
 * be logits: each element read before it is written) and makes no lse
 * (*lse = NULL). */
typedef void nb__backend_cross_entropy_fn(nb_ctx *ctx, nb_tensor *loss, nb_tensor **lse,
                                          nb_tensor **count, nb_tensor *dlogits,
                                          const nb_tensor *logits, const nb_tensor *targets,
                                          int64_t ignore_index, double eps);
/* g (0-d) and count as made by forward. lse NULL: logits hold the fused
 * forward's dlogits for g = 1, and dlogits = g logits (one elementwise
 * pass; dlogits may be logits). */
typedef void nb__backend_cross_entropy_backward_fn(nb_tensor *dlogits, const nb_tensor *logits,
                                                   const nb_tensor *lse, const nb_tensor *targets,
                                                   const nb_tensor *g, const nb_tensor *count,
                                                   int64_t ignore_index, double eps);
/* out (0-d) = mean of (a - b)^2 (kind 0) or of the BCE-with-logits term (kind 1). */
typedef void nb__backend_pair_loss_fn(nb_tensor *out, int kind, const nb_tensor *a,
                                      const nb_tensor *b);

/* What an update does besides its rule (nb__backend_adam_fn, _sgd_fn;
 * NULL: nothing):
 * - clip_norm: NULL, or a gradient norm (0-d f64 on the parameters'
 *   device, never read by the host): when it is finite, each gradient
 *   element is read as (g * coef) rounded to g's dtype, coef = max_norm /
 *   (norm + 1e-6) in double, where coef < 1 (clip_scale's rule, so the
 *   update is the one after clip_scale, bit for bit); when it is not
 *   finite, the update writes nothing (a skipped step). The gradients
 *   themselves are not written (Note [Clipping inside the step] in
 *   optim/clip.c).
 * - shadow: NULL, or per parameter NULL or a contiguous 16-bit tensor of
 *   its shape, written with the updated parameter rounded to nearest
 *   (Note [Parameter shadows] in tensor/shadow.c). */
typedef struct nb__update_extras {
    const nb_tensor *clip_norm;
    double max_norm;
    nb_tensor *const *shadow;
} nb__update_extras;

/* ---- multi-tensor updates (optimizers, clipping) ----
 * n tensors, each contiguous f32 or f64, one launch (CUDA) or loop
 * (CPU) per call; the order of operations of tensor/cpu/optim.c.
 * steps[i]: parameter i's step count after the increment; hp[i]: its
 * group's hyperparameters (NB__HP_*, above).
 * Adam: vmax[i] non-NULL makes parameter i's update AMSGrad's
 * (vmax[i] = max(vmax[i], v[i]), NaN-propagating, is the denominator's
 * second moment); vmax itself may be NULL: no AMSGrad at all. */
typedef void nb__backend_adam_fn(int n, nb_tensor *const *p, nb_tensor *const *g,
                                 nb_tensor *const *m, nb_tensor *const *v, nb_tensor *const *vmax,
                                 const int64_t *steps, const double *const *hp, bool decoupled,
                                 const nb__update_extras *x);
/* buf[i] NULL: SGD without momentum for parameter i. */
typedef void nb__backend_sgd_fn(int n, nb_tensor *const *p, nb_tensor *const *g,
                                nb_tensor *const *buf, const int64_t *steps,
                                const double *const *hp, const nb__update_extras *x);
/* out (0-d f64) = sum of squares of every element of the n tensors,
 * accumulated in f64 in a fixed order. */
typedef void nb__backend_sum_squares_fn(nb_tensor *out, int n, nb_tensor *const *ts);
/* out (0-d f64) = max |x| over the n tensors (NaN when any is NaN; 0
 * when they are empty); ctx holds temporaries. */
typedef void nb__backend_max_abs_fn(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts);
/* Every element of the n tensors *= coef (computed in f64, rounded). */
typedef void nb__backend_scale_fn(int n, nb_tensor *const *ts, double coef);
/* Gradient clipping by a norm that stays where it was computed: norm is
 * 0-d f64 on the tensors' device; when it is finite and coef = max_norm /
 * (norm + 1e-6) < 1, every element *= coef as scale does, else nothing.
 * No host read (Note [Clipping without a host read] in optim/clip.c). */
typedef void nb__backend_clip_scale_fn(int n, nb_tensor *const *ts, const nb_tensor *norm,
                                       double max_norm);
/* Whether every element of the n tensors (any float dtype) is finite;
 * one host read. CUDA answers from a sum of squares: f64 values
 * above ~1e154 count as not finite there. */
typedef bool nb__backend_all_finite_fn(nb_ctx *ctx, int n, nb_tensor *const *ts);

/* ---- per-channel statistics (SyncBatchNorm; Note [SyncBatchNorm] in
 * distributed/sync_batch_norm.c). x, y, dy, dx contiguous (N, C, S) of
 * one float dtype; the statistics are f64 and computed in f64. */
/* stats (3 C) = [count | sum | sum of squares] per channel. */
typedef void nb__backend_channel_stats_fn(nb_tensor *stats, const nb_tensor *x, int64_t n,
                                          int64_t c, int64_t s);
/* From all-reduced stats: mean, invstd (C) with the biased variance;
 * running_mean/var (C, f32 or f64, any stride, or NULL) updated with
 * momentum and the unbiased variance. A global count of at most one
 * is an error (naming the input on this rank, for the message): at
 * once on the CPU, a deferred device fault on CUDA. */
typedef void nb__backend_channel_finalize_fn(nb_tensor *mean, nb_tensor *invstd,
                                             const nb_tensor *stats, nb_tensor *running_mean,
                                             nb_tensor *running_var, double momentum, double eps,
                                             int64_t c, const nb_tensor *input);
/* y = (x - mean[c]) invstd[c] w[c] + b[c]; w, b (C) contiguous or NULL. */
typedef void nb__backend_channel_normalize_fn(nb_tensor *y, const nb_tensor *x,
                                              const nb_tensor *mean, const nb_tensor *invstd,
                                              const nb_tensor *w, const nb_tensor *b, int64_t n,
                                              int64_t c, int64_t s);
/* sums (2 C) = [sum dy | sum dy xhat] per channel. */
typedef void nb__backend_channel_backward_sums_fn(nb_tensor *sums, const nb_tensor *dy,
                                                  const nb_tensor *x, const nb_tensor *mean,
                                                  const nb_tensor *invstd, int64_t n, int64_t c,
                                                  int64_t s);
/* dx = w invstd (dy - sum dy / M - xhat sum(dy xhat) / M), M = stats[c]. */
typedef void nb__backend_channel_backward_dx_fn(nb_tensor *dx, const nb_tensor *dy,
                                                const nb_tensor *x, const nb_tensor *mean,
                                                const nb_tensor *invstd, const nb_tensor *w,
                                                const nb_tensor *sums, const nb_tensor *stats,
                                                int64_t n, int64_t c, int64_t s);

/* The kernel entries every backend fills, in the table's order. Each row
 * e has its function type nb__backend_e_fn above, and becomes the member
 * `e`, the declaration `nb__backend_e_fn nb__cpu_e;` (tensor/cpu/cpu.h)
 * and `nb__backend_e_fn nb__cuda_e;` (tensor/cuda/cuda.h), the table
 * entries `.e = nb__cpu_e` / `.e = nb__cuda_e`, and a line of
 * tests/test_backend.c's completeness check: a new kernel entry is a
 * function type and a row here, and each backend's kernel under that
 * name (a kernel of narrower signature is reached through an adapter
 * with the entry's name, in its backend's backend.c). */
#define NB__BACKEND_KERNELS(X) \
    /* elementwise engine */ \
    X(unary) \
    X(binary) \
    X(where) \
    X(copy) \
    X(axpy) \
    /* row reductions */ \
    X(sum_rows) \
    X(max_rows) \
    X(argmax_rows) \
    X(max_rows_backward) \
    X(var_rows) \
    /* GEMM */ \
    X(gemm_readable) \
    X(matmul) \
    X(gelu_tanh_backward) \
    /* softmax family */ \
    X(softmax) \
    X(softmax_backward) \
    X(softmax_causal) \
    X(softmax_causal_backward) \
    /* normalisation */ \
    X(layer_norm) \
    X(layer_norm_backward) \
    X(batch_norm) \
    X(batch_norm_backward) \
    /* convolution */ \
    X(conv2d) \
    X(conv2d_backward) \
    /* pooling */ \
    X(max_pool2d) \
    X(max_pool2d_backward) \
    X(avg_pool2d) \
    X(avg_pool2d_backward) \
    /* random fills, dropout, embedding, losses */ \
    X(rand_uniform) \
    X(rand_normal) \
    X(dropout) \
    X(embedding) \
    X(embedding_backward) \
    X(embedding_pos) \
    X(embedding_pos_backward) \
    X(cross_entropy) \
    X(cross_entropy_backward) \
    X(pair_loss) \
    /* multi-tensor updates */ \
    X(adam) \
    X(sgd) \
    X(sum_squares) \
    X(max_abs) \
    X(scale) \
    X(clip_scale) \
    X(all_finite) \
    /* per-channel statistics */ \
    X(channel_stats) \
    X(channel_finalize) \
    X(channel_normalize) \
    X(channel_backward_sums) \
    X(channel_backward_dx)

typedef struct nb__backend {
    const char *name;
    /* Device memory is not host memory: host data reaches it by a copy
     * (the data loader stages batches through host buffers then). */
    bool device_memory;
    /* The GEMM can add into its output (matmul's `accumulate`), so a
     * leaf's gradient may be written in place (Note [Gradients added in
     * place] in autograd/backward.c). */
    bool gemm_accumulate;
    /* The front end hands the GEMM the backward's epilogues (matmul's
     * dgelu_pre and bgrad): a bias's gradient formed by the weight's
     * gradient GEMM, GELU's backward by the product before it (Note [GEMM
     * epilogues in backward] in tensor/ops_matmul.c). */
    bool gemm_epilogues;
    /* Elementwise kernels visit elements in order on one thread, so an
     * output aliased through zero strides accumulates (nb__sum_to sums a
     * broadcast gradient so); otherwise each element has its own writer. */
    bool ordered_elementwise;
    /* The elementwise engine writes outputs of any strides (else `out` is
     * contiguous), so a gradient may be added into a slice of a buffer. */
    bool strided_elementwise_out;
    /* bf16 and f16 are computed in (in f32 inside the kernels); otherwise
     * they are storage types, and math asks for a cast to f32 first. */
    bool half_compute;
    /* The compute dtypes of mixed precision (nb_ctx_set_compute_dtype) on
     * this device, one bit (1u << dtype) each: the matrix products (matmul,
     * conv2d) take operands of these dtypes and accumulate in f32. Without
     * half_compute only they, casts and gradient accumulation see such
     * tensors, and only in a context of that compute dtype (Note [Mixed
     * precision on the CPU] in tensor/context.c). */
    unsigned product_dtypes;
    /* Saved statistics (layer norm's mean/rstd, batch norm's mean/invstd)
     * are f32 for non-f64 inputs (else f64 everywhere). */
    bool f32_norm_stats;
    /* The meta device (tensor/meta.c): kernels compute nothing and data
     * pointers address no memory, so the host reads no values from it
     * (nb__meta_no_values says so, naming the op). */
    bool meta;

    /* ---- runtime ---- */
    nb__backend_use_fn *use;
    nb__backend_sync_fn *sync;
    nb__backend_mem_alloc_fn *mem_alloc;
    nb__backend_mem_free_fn *mem_free;
    nb__backend_poison_fn *poison;
    nb__backend_memset_fn *memset;
    nb__backend_memcpy_d2d_fn *memcpy_d2d;
    nb__backend_memcpy_h2d_fn *memcpy_h2d;
    nb__backend_memcpy_d2h_fn *memcpy_d2h;
    nb__backend_memcpy_h2d_async_fn *memcpy_h2d_async;
    nb__backend_host_alloc_fn *host_alloc;
    nb__backend_host_free_fn *host_free;
    nb__backend_compute_stream_fn *compute_stream;
    nb__backend_copy_stream_fn *copy_stream;
    nb__backend_event_new_fn *event_new;
    nb__backend_event_free_fn *event_free;
    nb__backend_event_record_fn *event_record;
    nb__backend_stream_wait_fn *stream_wait;
    nb__backend_event_wait_fn *event_wait;

    /* ---- kernels: one member per row of NB__BACKEND_KERNELS ---- */
#define NB__BACKEND_MEMBER(e) nb__backend_##e##_fn *e;
    NB__BACKEND_KERNELS(NB__BACKEND_MEMBER)
#undef NB__BACKEND_MEMBER

    /* ---- optional: the fused causal self-attention (NULL, with
     * causal_attention_dtypes 0, where a device has none: the front end
     * composes it from matmul and softmax_causal) ---- */
    unsigned causal_attention_dtypes;
    nb__backend_causal_attention_takes_fn *causal_attention_takes;
    nb__backend_causal_attention_fn *causal_attention;
    nb__backend_causal_attention_backward_fn *causal_attention_backward;
} nb__backend;

extern const nb__backend nb__cpu_backend;
/* Tests only: when nonzero, the CPU backend's mem_alloc refuses blocks
 * larger than this many bytes, as a device with that much memory left
 * would (Note [Arena growth], tensor/context.c). */
extern size_t nb__cpu_alloc_cap;
/* The CUDA table: the loaded plugin's (Note [CUDA plugin] in
 * tensor/cuda_plugin.h), NULL until it is loaded and in a build without
 * CUDA. No CUDA context, hence no CUDA tensor, exists before it is. */
extern const nb__backend *nb__cuda_table;

/* NB_OK when tensors can be made on `device` in this process; else
 * NB_ERR_UNSUPPORTED, with "<op>: device <d> is not available (<why>)". */
nb_status nb__device_available(const char *op, nb_device device);

/* Aborts: no backend for `device` in this build (unreachable through a
 * context, which refuses such a device when it is made). */
void nb__backend_missing(nb_device device);

/* The meta device's table for the device type it stands for (tensor/meta.c);
 * NULL for another type. */
const nb__backend *nb__meta_backend(int of);
/* Aborts: `op` asked for the values of t, which is on the meta device. */
NB_NORETURN void nb__meta_no_values(const char *op, const nb_tensor *t);

static inline const nb__backend *nb__backend_of(nb_device device) {
    if (device.type == NB_DEVICE_CPU) return &nb__cpu_backend;
    if (device.type == NB_DEVICE_CUDA && nb__cuda_table) return nb__cuda_table;
    if (device.type == NB_DEVICE_META && nb__meta_backend(device.index))
        return nb__meta_backend(device.index);
    nb__backend_missing(device);
    return &nb__cpu_backend;
}
static inline const nb__backend *nb__backend_at(const nb_tensor *t) {
    return nb__backend_of(t->device);
}

#ifdef __cplusplus
}
#endif
#endif
