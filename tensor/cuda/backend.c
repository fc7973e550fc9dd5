/* The CUDA backend's table (tensor/backend.h), compiled only when nabla is
 * built with CUDA: the entry points of tensor/cuda/cuda.h, and small
 * adapters where a kernel's signature is narrower than the table's. */
#include <math.h>

#include "tensor/backend.h"
#include "tensor/cuda/cuda.h"

static void matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool ta, bool tb,
                   const nb_tensor *bias, bool gelu, nb_tensor *pre, bool accumulate) {
    NB_CHECK(!accumulate, "nb_matmul (%s): the CUDA GEMM does not add into its output",
             nb_device_name(out->device));
    nb__cuda_matmul(out, a, b, ta, tb, bias, gelu, pre);
}

static void gelu_tanh_backward(nb_tensor *dx, const nb_tensor *g, const nb_tensor *pre) {
    nb__cuda_unary(NB_U_GELU_TANH_GRAD, dx, pre, 0);
    nb__cuda_binary(NB_B_MUL, dx, g, dx);
}

/* max over the tensors' maxima of |x| (op front ends: NaN counts as the
 * maximum), gathered in f64 */
static void max_abs(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts) {
    nb_tensor **m = nb__ctx_meta(ctx, sizeof *m * (size_t)(n > 0 ? n : 1));
    int nm = 0;
    for (int i = 0; i < n; i++) {
        if (nb_numel(ts[i]) == 0) continue;
        nb_tensor *mi = nb_max(ctx, nb_abs(ctx, ts[i]), 0, NULL, false);
        m[nm] = nb__empty(ctx, NB_F64, 0, NULL);
        nb_copy_(m[nm], mi);
        nm++;
    }
    if (nm == 0) nb__cuda_memset(out->device.index, out->data, 0, sizeof(double));
    else nb_copy_(out, nb_max(ctx, nb_stack(ctx, nm, m, 0), 0, NULL, false));
}

static void scale(int n, nb_tensor *const *ts, double coef) {
    for (int i = 0; i < n; i++) nb_scale_(ts[i], coef);
}

/* finite exactly when every square is: f64 values above ~1e154 overflow */
static bool all_finite(nb_ctx *ctx, int n, nb_tensor *const *ts) {
    if (n == 0) return true;
    nb_tensor *out = nb__empty(ctx, NB_F64, 0, NULL);
    nb__cuda_sum_squares(out, n, ts);
    return isfinite(nb_item(out)) != 0;
}

static void layer_norm_backward(nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                const nb_tensor *rstd, const nb_tensor *w, int64_t m, int64_t d) {
    (void)ctx;
    nb__cuda_layer_norm_backward(dx, dw, db, g, x, mean, rstd, w, m, d);
}

/* lse in f32 for 16-bit logits; count 0-d f32; nothing read by the host */
static void cross_entropy(nb_ctx *ctx, nb_tensor *loss, nb_tensor **lse, nb_tensor **count,
                          const nb_tensor *logits, const nb_tensor *targets, int64_t ignore_index,
                          double eps) {
    int64_t n = logits->shape[0];
    bool half = logits->dtype == NB_BF16 || logits->dtype == NB_F16;
    *lse = nb__empty(ctx, half ? NB_F32 : logits->dtype, 1, &n);
    *count = nb__empty(ctx, NB_F32, 0, NULL);
    nb__cuda_cross_entropy(loss, *lse, *count, logits, targets, ignore_index, eps);
}

/* Note [Poisoned outputs] */
static void poison(int device, void *p, size_t bytes) {
    if (nb__cuda_poison()) nb__cuda_memset(device, p, 0xff, bytes);
}

const nb__backend nb__cuda_backend = {
    .name = "cuda",
    .device_memory = true,
    .gemm_accumulate = false,
    .ordered_elementwise = false,
    .strided_elementwise_out = false,
    .half_compute = true,
    .product_dtypes = (1u << NB_BF16) | (1u << NB_F16),
    .use = nb__cuda_use,
    .sync = nb__cuda_sync,
    .mem_alloc = nb__cuda_malloc,
    .mem_free = nb__cuda_free,
    .poison = poison,
    .memset = nb__cuda_memset,
    .memcpy_d2d = nb__cuda_memcpy_d2d,
    .memcpy_h2d = nb__cuda_memcpy_h2d,
    .memcpy_d2h = nb__cuda_memcpy_d2h,
    .memcpy_h2d_async = nb__cuda_memcpy_h2d_async,
    .host_alloc = nb__cuda_host_alloc,
    .host_free = nb__cuda_host_free,
    .compute_stream = nb__cuda_compute_stream,
    .copy_stream = nb__cuda_copy_stream,
    .event_new = nb__cuda_event_new,
    .event_free = nb__cuda_event_free,
    .event_record = nb__cuda_event_record,
    .stream_wait = nb__cuda_stream_wait,
    .event_wait = nb__cuda_event_wait,
    .unary = nb__cuda_unary,
    .binary = nb__cuda_binary,
    .where = nb__cuda_where,
    .copy = nb__cuda_copy,
    .axpy = nb__cuda_axpy,
    .sum_rows = nb__cuda_sum_rows,
    .max_rows = nb__cuda_max_rows,
    .argmax_rows = nb__cuda_argmax_rows,
    .max_rows_backward = nb__cuda_max_rows_backward,
    .var_rows = nb__cuda_var_rows,
    .gemm_readable = nb__cuda_gemm_readable,
    .matmul = matmul,
    .gelu_tanh_backward = gelu_tanh_backward,
    .softmax = nb__cuda_softmax,
    .softmax_backward = nb__cuda_softmax_backward,
    .softmax_causal = nb__cuda_softmax_causal,
    .softmax_causal_backward = nb__cuda_softmax_causal_backward,
    .f32_norm_stats = true,
    .layer_norm = nb__cuda_layer_norm,
    .layer_norm_backward = layer_norm_backward,
    .batch_norm = nb__cuda_batch_norm,
    .batch_norm_backward = nb__cuda_batch_norm_backward,
    .conv2d = nb__cuda_conv2d_forward,
    .conv2d_backward = nb__cuda_conv2d_backward,
    .max_pool2d = nb__cuda_max_pool2d,
    .max_pool2d_backward = nb__cuda_max_pool2d_backward,
    .avg_pool2d = nb__cuda_avg_pool2d,
    .avg_pool2d_backward = nb__cuda_avg_pool2d_backward,
    .rand_uniform = nb__cuda_rand_uniform,
    .rand_normal = nb__cuda_rand_normal,
    .dropout = nb__cuda_dropout,
    .embedding = nb__cuda_embedding,
    .embedding_backward = nb__cuda_embedding_backward,
    .cross_entropy = cross_entropy,
    .cross_entropy_backward = nb__cuda_cross_entropy_backward,
    .pair_loss = nb__cuda_pair_loss,
    .adam = nb__cuda_adam,
    .sgd = nb__cuda_sgd,
    .sum_squares = nb__cuda_sum_squares,
    .max_abs = max_abs,
    .scale = scale,
    .all_finite = all_finite,
    .channel_stats = nb__cuda_channel_stats,
    .channel_finalize = nb__cuda_channel_finalize,
    .channel_normalize = nb__cuda_channel_normalize,
    .channel_backward_sums = nb__cuda_channel_backward_sums,
    .channel_backward_dx = nb__cuda_channel_backward_dx,
};
