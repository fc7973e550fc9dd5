/* The CUDA backend's table (tensor/backend.h), compiled only when nabla is
 * built with CUDA: one nb__cuda_<entry> per row of NB__BACKEND_KERNELS
 * (tensor/cuda/cuda.h), and below the adapters where a kernel's own
 * signature is narrower than the entry's. An adapter composes other
 * entries of this backend, never an op front end (nb_abs, nb_max, ...):
 * those would check, record and dispatch again. */
#include <math.h>

#include "tensor/backend.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/flags.h"

void nb__cuda_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool ta, bool tb,
                     const nb__gemm_epilogue *epi) {
    nb__cuda_gemm(out, a, b, ta, tb, epi);
}

void nb__cuda_gelu_tanh_backward(nb_tensor *dx, const nb_tensor *g, const nb_tensor *pre) {
    nb__cuda_unary(NB_U_GELU_TANH_GRAD, dx, pre, 0);
    nb__cuda_binary(NB_B_MUL, dx, g, dx);
}

/* max over the tensors' maxima of |x| (NaN counts as the maximum: Note
 * [Max with NaN] in reduce.cu), gathered in f64: per tensor |x| and its
 * maximum, cast into its slot of an f64 row whose maximum is the result */
void nb__cuda_max_abs(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts) {
    int64_t nm = 0;
    for (int i = 0; i < n; i++) nm += nb_numel(ts[i]) > 0;
    if (nm == 0) {
        nb__cuda_memset(out->device.index, out->data, 0, sizeof(double));
        return;
    }
    int64_t one = 1;
    nb_tensor *row = nb__empty(ctx, NB_F64, 1, &nm);
    nb_tensor *arg = nb__empty(ctx, NB_I64, 1, &one);
    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        nb_tensor *t = ts[i];
        if (nb_numel(t) == 0) continue;
        nb_tensor *a = nb__empty(ctx, t->dtype, t->ndim, t->shape);
        nb_tensor *m = nb__empty(ctx, t->dtype, 1, &one);
        nb__cuda_unary(NB_U_ABS, a, t, 0);
        nb__cuda_max_rows(m, arg, a, 1, nb_numel(t));
        nb_tensor slot = *m; /* element k of row, as m's shape */
        slot.dtype = NB_F64;
        slot.data = (double *)row->data + k++;
        nb__cuda_copy(&slot, m);
    }
    nb_tensor res = *out; /* out viewed as row's one maximum, shape (1) */
    res.ndim = 1;
    res.shape[0] = 1;
    res.strides[0] = 1;
    nb__cuda_max_rows(&res, arg, row, 1, nm);
}

void nb__cuda_scale(int n, nb_tensor *const *ts, double coef) {
    for (int i = 0; i < n; i++) nb__cuda_unary(NB_U_MUL_S, ts[i], ts[i], coef);
}

/* finite exactly when every square is: f64 values above ~1e154 overflow */
bool nb__cuda_all_finite(nb_ctx *ctx, int n, nb_tensor *const *ts) {
    if (n == 0) return true;
    nb_tensor *out = nb__empty(ctx, NB_F64, 0, NULL);
    nb__cuda_sum_squares(out, n, ts);
    double v;
    nb__cuda_memcpy_d2h(out->device.index, &v, out->data, sizeof v);
    return isfinite(v) != 0;
}

void nb__cuda_layer_norm_backward(nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                  const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                  const nb_tensor *rstd, const nb_tensor *w, int64_t m, int64_t d,
                                  unsigned add) {
    (void)ctx;
    nb__cuda_layer_norm_backward_rows(dx, dw, db, g, x, mean, rstd, w, m, d, add);
}

/* lse in f32 for 16-bit logits (none when fused); count 0-d f32; nothing
 * read by the host */
void nb__cuda_cross_entropy(nb_ctx *ctx, nb_tensor *loss, nb_tensor **lse, nb_tensor **count,
                            nb_tensor *dlogits, const nb_tensor *logits, const nb_tensor *targets,
                            int64_t ignore_index, double eps) {
    int64_t n = logits->shape[0];
    bool half = logits->dtype == NB_BF16 || logits->dtype == NB_F16;
    *lse = dlogits ? NULL : nb__empty(ctx, half ? NB_F32 : logits->dtype, 1, &n);
    *count = nb__empty(ctx, NB_F32, 0, NULL);
    nb__cuda_cross_entropy_rows(loss, *lse, *count, dlogits, logits, targets, ignore_index, eps);
}

/* Note [Poisoned outputs] */
static void poison(int device, void *p, size_t bytes) {
    if (nb__cuda_poison()) nb__cuda_memset(device, p, 0xff, bytes);
}

const nb__backend nb__cuda_backend = {
    .name = "cuda",
    NB__CUDA_BACKEND_FLAGS, /* tensor/cuda/flags.h */
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
#define NB__CUDA_ENTRY(e) .e = nb__cuda_##e,
    NB__BACKEND_KERNELS(NB__CUDA_ENTRY)
#undef NB__CUDA_ENTRY
    /* the fused attention's dtypes are a flag (flags.h) */
    .causal_attention_takes = nb__cuda_causal_attention_takes,
    .causal_attention = nb__cuda_causal_attention,
    .causal_attention_backward = nb__cuda_causal_attention_backward,
};
