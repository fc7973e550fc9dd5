/* Differentiable operations. Every op takes the context that receives its
 * output (and, under grad mode, its tape node) first, checks its inputs
 * (shapes, dtypes, devices) and aborts with a message naming the op and the
 * shapes when they are wrong. Inputs may be non-contiguous views. Math ops
 * need f32 or f64 on the CPU.
 *
 * Letters in shape comments: N batch, C channels/classes, H/W height/width,
 * L any leading dims, (..) any shape. */
#ifndef NABLA_OPS_H
#define NABLA_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/random.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- elementwise, with NumPy broadcasting ---- */
NB_API nb_tensor *nb_add(nb_ctx *ctx, nb_tensor *a, nb_tensor *b);
NB_API nb_tensor *nb_sub(nb_ctx *ctx, nb_tensor *a, nb_tensor *b);
NB_API nb_tensor *nb_mul(nb_ctx *ctx, nb_tensor *a, nb_tensor *b);
/* i32/i64: truncates toward zero; a zero divisor aborts naming it */
NB_API nb_tensor *nb_div(nb_ctx *ctx, nb_tensor *a, nb_tensor *b);
NB_API nb_tensor *nb_add_scalar(nb_ctx *ctx, nb_tensor *a, double s);
NB_API nb_tensor *nb_sub_scalar(nb_ctx *ctx, nb_tensor *a, double s);
NB_API nb_tensor *nb_mul_scalar(nb_ctx *ctx, nb_tensor *a, double s);
NB_API nb_tensor *nb_div_scalar(nb_ctx *ctx, nb_tensor *a, double s);
NB_API nb_tensor *nb_neg(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_pow(nb_ctx *ctx, nb_tensor *a, double exponent);
NB_API nb_tensor *nb_exp(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_log(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_sqrt(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_rsqrt(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_abs(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_tanh(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_sigmoid(nb_ctx *ctx, nb_tensor *a);
NB_API nb_tensor *nb_relu(nb_ctx *ctx, nb_tensor *a);

typedef enum nb_gelu_approx { NB_GELU_EXACT = 0, NB_GELU_TANH = 1 } nb_gelu_approx;
NB_API nb_tensor *nb_gelu(nb_ctx *ctx, nb_tensor *a, nb_gelu_approx approx);

/* where(cond, a, b): a where cond != 0, else b; all three broadcast. cond
 * may have any dtype and gets no gradient. */
NB_API nb_tensor *nb_where(nb_ctx *ctx, nb_tensor *cond, nb_tensor *a, nb_tensor *b);
/* x with `value` where mask != 0; mask broadcasts to x. */
NB_API nb_tensor *nb_masked_fill(nb_ctx *ctx, nb_tensor *x, nb_tensor *mask, double value);

/* ---- matrix products (OpenBLAS on the CPU) ---- */
/* a (.., M, K) @ b (.., K, N) -> (.., M, N); 1-D operands are not
 * promoted; batch dims broadcast. */
NB_API nb_tensor *nb_matmul(nb_ctx *ctx, nb_tensor *a, nb_tensor *b);
/* Same with op(a) = a^T when trans_a (swap the last two dims, no copy). */
NB_API nb_tensor *nb_matmul_t(nb_ctx *ctx, nb_tensor *a, nb_tensor *b, bool trans_a, bool trans_b);

/* ---- reductions ----
 * `axes` lists `naxes` dims (negative allowed); naxes = 0 reduces all. */
NB_API nb_tensor *nb_sum(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim);
NB_API nb_tensor *nb_mean(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim);
/* Gradient goes to the first maximum in each reduced group. */
NB_API nb_tensor *nb_max(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim);
/* i64 index of the maximum along `dim` (negative allowed): the first of
 * equal maxima, and the first NaN when the slice has one (as torch.argmax).
 * Not differentiable: the output never requires grad. An empty `dim` is an
 * error. */
NB_API nb_tensor *nb_argmax(nb_ctx *ctx, nb_tensor *x, int dim, bool keepdim);
/* Variance with divisor (n - correction): 1 unbiased, 0 biased. */
NB_API nb_tensor *nb_var(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, int correction,
                  bool keepdim);
NB_API nb_tensor *nb_sum_all(nb_ctx *ctx, nb_tensor *x);
NB_API nb_tensor *nb_mean_all(nb_ctx *ctx, nb_tensor *x);

/* ---- classification metrics (no gradient) ----
 * How many rows of logits (N, C) have their argmax (nb_argmax's rule:
 * first of equal maxima, NaN first) equal to targets (N, i32/i64, on the
 * logits' device); a target outside [0, C) never matches. The argmax goes
 * in ctx; the count is read back to the host, so on CUDA this waits for the
 * logits. */
NB_API int64_t nb_count_correct(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets);

/* ---- softmax and losses ---- */
NB_API nb_tensor *nb_softmax(nb_ctx *ctx, nb_tensor *x, int axis);
NB_API nb_tensor *nb_log_softmax(nb_ctx *ctx, nb_tensor *x, int axis);
/* Causal attention weights from scores x (.., T, S): along the last dim,
 * softmax(scale x) where key j <= query i and exactly 0 where j > i,
 * i.e. nb_softmax(nb_masked_fill(scale x, j > i, -inf), -1) in one pass
 * that never reads the masked scores (CPU and CUDA). Every row keeps j = 0,
 * so no row is all masked. scale: finite, nonzero (1 / sqrt(D) in
 * attention). */
NB_API nb_tensor *nb_softmax_causal(nb_ctx *ctx, nb_tensor *x, double scale);

typedef struct nb_cross_entropy_opts {
    int64_t ignore_index;   /* targets equal to it count for nothing; default -100 */
    double label_smoothing; /* in [0, 1] */
} nb_cross_entropy_opts;
#define NB_CROSS_ENTROPY_DEFAULTS                                                              \
    ((nb_cross_entropy_opts){.ignore_index = -100, .label_smoothing = 0.0})
/* logits (N, C), targets (N) of i32/i64 class indices; mean over the
 * targets not ignored (all ignored: NaN, as 0/0, with a zero gradient).
 * Label smoothing eps: (1 - eps) (-log p_target) + eps/C sum_c (-log p_c).
 * opts NULL: the defaults. */
NB_API nb_tensor *nb_cross_entropy(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets,
                            const nb_cross_entropy_opts *opts);
/* mean((pred - target)^2); same shapes. */
NB_API nb_tensor *nb_mse_loss(nb_ctx *ctx, nb_tensor *pred, nb_tensor *target);
/* mean(max(x,0) - x*y + log(1 + exp(-|x|))); same shapes; y gets no gradient. */
NB_API nb_tensor *nb_bce_with_logits(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets);

/* ---- layers' math ---- */
/* weight (V, C), indices (..) of i32/i64 -> (.., C). */
NB_API nb_tensor *nb_embedding(nb_ctx *ctx, nb_tensor *weight, nb_tensor *indices);
/* Normalises over the last `norm_ndim` dims; weight and bias have those
 * dims' shape or are NULL. */
NB_API nb_tensor *nb_layer_norm(nb_ctx *ctx, nb_tensor *x, int norm_ndim, nb_tensor *weight,
                         nb_tensor *bias, double eps);
/* x (N, C, ..). Training: batch statistics (needs more than one value per
 * channel); running_mean/var (C), both or neither, updated
 * in place when given (momentum; the running variance is unbiased).
 * Eval: running statistics. weight, bias (C) or NULL. */
NB_API nb_tensor *nb_batch_norm(nb_ctx *ctx, nb_tensor *x, nb_tensor *weight, nb_tensor *bias,
                         nb_tensor *running_mean, nb_tensor *running_var, bool training,
                         double momentum, double eps);

typedef struct nb_conv2d_opts {
    int stride[2];
    int padding[2];
    int dilation[2];
    /* Channel groups G, as PyTorch's: C and O divisible by G, input channels
     * [g C/G, (g+1) C/G) feed only output channels [g O/G, (g+1) O/G).
     * G = C is a depthwise convolution. 0 (an initialiser that leaves it
     * out) means 1. */
    int groups;
} nb_conv2d_opts;
#define NB_CONV2D_DEFAULTS                                                                     \
    ((nb_conv2d_opts){.stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1})
/* x (N, C, H, W), weight (O, C/G, KH, KW), bias (O) or NULL -> (N, O, OH, OW);
 * G = opts->groups. */
NB_API nb_tensor *nb_conv2d(nb_ctx *ctx, nb_tensor *x, nb_tensor *weight, nb_tensor *bias,
                     const nb_conv2d_opts *opts);

typedef struct nb_pool2d_opts {
    int kernel[2];
    int stride[2]; /* 0: the kernel size */
    int padding[2];
} nb_pool2d_opts;
/* x (N, C, H, W). Max pooling ignores padding; average pooling counts
 * padded zeros (PyTorch's count_include_pad=True). */
NB_API nb_tensor *nb_max_pool2d(nb_ctx *ctx, nb_tensor *x, const nb_pool2d_opts *opts);
NB_API nb_tensor *nb_avg_pool2d(nb_ctx *ctx, nb_tensor *x, const nb_pool2d_opts *opts);

/* Zeroes each element with probability p and scales the rest by 1/(1-p).
 * The mask is a function of (rng, element index); see Note [Random streams].
 * When !training or p == 0 it returns x. rng NULL: the default generator. */
NB_API nb_tensor *nb_dropout(nb_ctx *ctx, nb_tensor *x, double p, bool training, nb_rng *rng);

/* ---- joining and splitting ---- */
NB_API nb_tensor *nb_concat(nb_ctx *ctx, int n, nb_tensor *const *xs, int axis);
NB_API nb_tensor *nb_stack(nb_ctx *ctx, int n, nb_tensor *const *xs, int axis);
/* Splits along `axis` into n pieces of sizes[i] (views), written to out[i]. */
NB_API void nb_split(nb_ctx *ctx, nb_tensor *x, int n, const int64_t *sizes, int axis,
              nb_tensor **out);

#ifdef __cplusplus
}
#endif
#endif
