/* The CPU backend's table (tensor/backend.h): the kernels of tensor/cpu/
 * (one nb__cpu_<entry> per row of NB__BACKEND_KERNELS, the adapters below
 * where a kernel's own signature is narrower) and a runtime with nothing
 * to wait for (work is done when a call returns; memory is host memory;
 * streams and events are NULL). */
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/cpu/attention.h"
#include "tensor/cpu/bf16.h"
#include "tensor/cpu/cpu.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/matmul.h"
#include "tensor/cpu/norm.h"
#include "tensor/cpu/softmax.h"

static void use(const char *op, int device) { (void)op, (void)device; }
static void sync(int device) { (void)device; }
static void set_bytes(int device, void *dst, int byte, size_t bytes) {
    (void)device;
    memset(dst, byte, bytes);
}
static void copy_bytes(int device, void *dst, const void *src, size_t bytes) {
    (void)device;
    memcpy(dst, src, bytes);
}
size_t nb__cpu_alloc_cap = 0;

static void *mem_alloc(int device, size_t bytes) {
    (void)device;
    if (nb__cpu_alloc_cap && bytes > nb__cpu_alloc_cap) return NULL;
    return aligned_alloc(64, bytes);
}
static void mem_free(int device, void *p) {
    (void)device;
    free(p);
}
static void no_poison(int device, void *p, size_t bytes) { (void)device, (void)p, (void)bytes; }
static void copy_bytes_async(int device, void *dst, const void *src, size_t bytes, nb__stream s) {
    (void)device, (void)s;
    memcpy(dst, src, bytes);
}
static nb__stream no_stream(int device) {
    (void)device;
    return NULL;
}
static nb__event no_event(int device) {
    (void)device;
    return NULL;
}
static void event_free(nb__event e) { (void)e; }
static void event_record(nb__event e, nb__stream s) { (void)e, (void)s; }
static void stream_wait(nb__stream s, nb__event e) { (void)s, (void)e; }
static void event_wait(nb__event e) { (void)e; }

/* epi->bgrad (M) = op(a)'s rows summed over K, in f64, rounded once. */
static void bias_grad(nb_tensor *bgrad, const nb_tensor *a, bool ta) {
    NB_CHECK(a->ndim == 2 && bgrad->dtype == NB_F32 && bgrad->ndim == 1 &&
                 bgrad->shape[0] == a->shape[ta ? 1 : 0],
             "nb__cpu_matmul: a bias gradient %s %s for op(a) of %s%s", nb_dtype_name(bgrad->dtype),
             nb_shape_str(bgrad), nb_shape_str(a), ta ? "^T" : "");
    int64_t m = bgrad->shape[0], k = a->shape[ta ? 0 : 1];
    int64_t sm = a->strides[ta ? 1 : 0], sk = a->strides[ta ? 0 : 1];
    size_t es = nb_dtype_size(a->dtype);
    float *out = bgrad->data;
    for (int64_t i = 0; i < m; i++) {
        double s = 0;
        for (int64_t j = 0; j < k; j++)
            s += nb__load((const char *)a->data + (i * sm + j * sk) * (int64_t)es, a->dtype);
        out[i] = (float)s;
    }
}

/* out *= GELU_tanh'(pre), both contiguous f32 or f64 (bf16 comes widened). */
static void dgelu(nb_tensor *out, const nb_tensor *pre) {
    NB_CHECK((out->dtype == NB_F32 || out->dtype == NB_F64) && pre->dtype == out->dtype &&
                 nb_same_shape(pre, out) && nb_is_contiguous(pre),
             "nb__cpu_matmul: a DGELU epilogue takes a contiguous pre-activation of the output's "
             "shape and dtype (%s %s), got %s %s", nb_dtype_name(out->dtype), nb_shape_str(out),
             nb_dtype_name(pre->dtype), nb_shape_str(pre));
    if (out->dtype == NB_F32) { /* one pass; out is read before it is written */
        nb__cpu_gelu_tanh_backward_f32(out, out, pre);
        return;
    }
    double *o = out->data;
    const double *p = pre->data;
    for (int64_t i = 0, n = nb_numel(out); i < n; i++) o[i] *= nb__f_gelu_tanh_grad_f64(p[i], 0);
}

/* oneDNN where Note [oneDNN dispatch] picks it, with the bias (and GELU
 * when `pre` is not kept) as post-ops. Otherwise, bias: written into the
 * rows, then the GEMM adds the product to it (like addmm; no separate
 * pass). GELU: a pass over the product, from `pre` when it is kept; its
 * gradient (dgelu_pre) a pass over the product too. */
static void product(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool ta, bool tb,
                    nb__gemm_epilogue e) {
    if (e.bgrad) bias_grad(e.bgrad, a, ta);
    if (nb__cpu_is_bf16(out)) {
        NB_CHECK(!e.accumulate, "nb__cpu_matmul: a bf16 output %s is written, never added into",
                 nb_shape_str(out));
        nb__cpu_matmul_bf16_out(out, a, b, ta, tb, e.bias, e.gelu, e.pre, e.dgelu_pre);
        return;
    }
    nb_tensor *dst = e.gelu && e.pre ? e.pre : out;
    if (!e.dgelu_pre && nb__dnnl_matmul(dst, a, b, ta, tb, e.bias, e.gelu && !e.pre, e.accumulate)) {
        if (e.gelu && e.pre) nb__cpu_unary(NB_U_GELU_TANH, out, dst, 0);
        return;
    }
    bool accumulate = e.accumulate;
    if (e.bias) {
        nb__cpu_copy(dst, e.bias);
        accumulate = true;
    }
    nb__cpu_gemm(dst, a, b, ta, tb, accumulate);
    if (e.gelu) nb__cpu_unary(NB_U_GELU_TANH, out, dst, 0);
    if (e.dgelu_pre) dgelu(out, e.dgelu_pre);
}

/* The residual (Note [Residual in the GEMM] in tensor/ops_matmul.c) is
 * added after the product and bias by the add's own kernel, so the result
 * is nb_add(residual, linear) bit for bit. */
void nb__cpu_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool ta, bool tb,
                    const nb__gemm_epilogue *epi) {
    nb__gemm_epilogue e = epi ? *epi : (nb__gemm_epilogue){0};
    const nb_tensor *r = e.residual;
    NB_CHECK(!r || (!e.gelu && !e.accumulate && !e.dgelu_pre && !e.bgrad && r->dtype == out->dtype &&
                    nb_same_shape(r, out) && nb_is_contiguous(r) && r->data != out->data),
             "nb__cpu_matmul: a residual %s %s for an output %s %s: it is contiguous, of the "
             "output's shape and dtype, not the output itself, and beside a bias only",
             nb_dtype_name(r->dtype), nb_shape_str(r), nb_dtype_name(out->dtype), nb_shape_str(out));
    e.residual = NULL;
    product(out, a, b, ta, tb, e);
    if (r) nb__cpu_binary(NB_B_ADD, out, r, out);
}

void nb__cpu_gelu_tanh_backward(nb_tensor *dx, const nb_tensor *g, const nb_tensor *pre) {
    if (nb__cpu_is_bf16(dx)) {
        nb__cpu_gelu_tanh_backward_bf16(dx, g, pre);
        return;
    }
    if (dx->dtype == NB_F32 && nb_is_contiguous(g)) { /* one pass, not two */
        nb__cpu_gelu_tanh_backward_f32(dx, g, pre);
        return;
    }
    nb__cpu_unary(NB_U_GELU_TANH_GRAD, dx, pre, 0);
    nb__cpu_binary(NB_B_MUL, dx, g, dx);
}

void nb__cpu_layer_norm_backward(nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                 const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                 const nb_tensor *rstd, const nb_tensor *w, int64_t m, int64_t d,
                                 unsigned add) {
    if (nb__cpu_is_bf16(x) && !nb__cpu_layer_norm_half_ok(dx, x, g, w, NULL, d)) {
        nb__cpu_layer_norm_backward_bf16(ctx, dx, dw, db, g, x, mean, rstd, w, m, d, add);
        return;
    }
    size_t bytes = 2 * (size_t)d * sizeof(double);
    double *ws = (dw || db) ? nb_ctx_alloc(ctx, bytes, 0) : NULL;
    nb__cpu_layer_norm_backward_ws(dx, dw, db, ws, g, x, mean, rstd, w, m, d, add);
    if (ws) nb__ctx_scratch_done(ctx, ws, bytes);
}

void nb__cpu_batch_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db, const nb_tensor *g,
                                 const nb_tensor *x, const nb_tensor *mean,
                                 const nb_tensor *invstd, const nb_tensor *w, bool training,
                                 double eps, int64_t n, int64_t c, int64_t s) {
    (void)eps; /* invstd already has it */
    nb__cpu_batch_norm_backward_invstd(dx, dw, db, g, x, mean, invstd, w, training, n, c, s);
}

/* im2col buffers from ctx */
void nb__cpu_conv2d(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                    const void *w, const void *b) {
    size_t bytes = nb__conv2d_cols_bytes(dt, g);
    void *cols = nb_ctx_alloc(ctx, bytes, 0);
    nb__cpu_conv2d_forward_cols(dt, g, out, x, w, b, cols);
    nb__ctx_scratch_done(ctx, cols, bytes);
}

void nb__cpu_conv2d_backward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *dx,
                             void *dw, void *db, const void *gout, const void *x, const void *w) {
    size_t bytes = nb__conv2d_cols_bytes(dt, g);
    void *cols = nb_ctx_alloc(ctx, bytes, 0);
    nb__cpu_conv2d_backward_cols(dt, g, dx, dw, db, gout, x, w, cols);
    nb__ctx_scratch_done(ctx, cols, bytes);
}

/* Targets are checked here, on the host; count is f64 (exact for any batch). */
void nb__cpu_cross_entropy(nb_ctx *ctx, nb_tensor *loss, nb_tensor **lse, nb_tensor **count,
                           nb_tensor *dlogits, const nb_tensor *logits, const nb_tensor *targets,
                           int64_t ignore_index, double eps) {
    /* bf16 logits: in pieces (Note [bf16 cross-entropy in pieces] in
     * tensor/cpu/softmax.c) when they and dlogits are contiguous bf16, else
     * through f32 twins */
    bool half = nb__cpu_is_bf16(logits);
    if (half && !(nb_is_contiguous(logits) &&
                  (!dlogits || (dlogits->dtype == NB_BF16 && nb_is_contiguous(dlogits))))) {
        nb__cpu_cross_entropy_bf16(ctx, loss, lse, count, dlogits, logits, targets, ignore_index,
                                   eps);
        return;
    }
    int64_t n = logits->shape[0], c = logits->shape[1], kept = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t t = nb__cpu_target_at(targets, i);
        if (t == ignore_index) continue;
        NB_CHECK(t >= 0 && t < c,
                 "nb_cross_entropy: target %lld at position %lld is out of range for %lld classes "
                 "(valid: 0..%lld, or ignore_index %lld); logits %s",
                 (long long)t, (long long)i, (long long)c, (long long)(c - 1),
                 (long long)ignore_index, nb_shape_str(logits));
        kept++;
    }
    *lse = dlogits ? NULL : nb__empty(ctx, half ? NB_F32 : logits->dtype, 1, &n);
    *count = nb__empty(ctx, NB_F64, 0, NULL);
    *(double *)(*count)->data = (double)kept;
    /* the scale the backward uses for g = 1 */
    double total = nb__cpu_cross_entropy_rows(*lse, dlogits, logits, targets, ignore_index, eps,
                                              kept > 0 ? 1.0 / (double)kept : 0);
    nb__store(loss->data, loss->dtype, total / (double)kept);
}

void nb__cpu_cross_entropy_backward(nb_tensor *dlogits, const nb_tensor *logits,
                                    const nb_tensor *lse, const nb_tensor *targets,
                                    const nb_tensor *g, const nb_tensor *count,
                                    int64_t ignore_index, double eps) {
    if (nb__cpu_is_bf16(logits) &&
        !(nb_is_contiguous(logits) && dlogits->dtype == NB_BF16 && nb_is_contiguous(dlogits) &&
          (!lse || lse->dtype == NB_F32))) {
        nb__cpu_cross_entropy_backward_bf16(dlogits, logits, lse, targets, g, count, ignore_index,
                                            eps);
        return;
    }
    double kept = *(const double *)count->data, gv = nb__load(g->data, g->dtype);
    double scale = lse ? (kept > 0 ? gv / kept : 0) : gv; /* lse NULL: logits hold dlogits for g = 1 */
    nb__cpu_cross_entropy_backward_rows(dlogits, logits, lse, targets, ignore_index, eps, scale);
}

const nb__backend nb__cpu_backend = {
    .name = "cpu",
    .device_memory = false,
    .gemm_accumulate = true,
    .gemm_epilogues = false, /* f32 results as before: the bias sums and GELU's backward stay their own ops */
    .ordered_elementwise = true,
    .strided_elementwise_out = true,
    .half_compute = false,
    .product_dtypes = 1u << NB_BF16,
    .f32_norm_stats = false,
    .use = use,
    .sync = sync,
    .mem_alloc = mem_alloc,
    .mem_free = mem_free,
    .poison = no_poison,
    .memset = set_bytes,
    .memcpy_d2d = copy_bytes,
    .memcpy_h2d = copy_bytes,
    .memcpy_d2h = copy_bytes,
    .memcpy_h2d_async = copy_bytes_async,
    .host_alloc = malloc,
    .host_free = free,
    .compute_stream = no_stream,
    .copy_stream = no_stream,
    .event_new = no_event,
    .event_free = event_free,
    .event_record = event_record,
    .stream_wait = stream_wait,
    .event_wait = event_wait,
#define NB__CPU_ENTRY(e) .e = nb__cpu_##e,
    NB__BACKEND_KERNELS(NB__CPU_ENTRY)
#undef NB__CPU_ENTRY
    .causal_attention_dtypes = (1u << NB_F32) | (1u << NB_F64) | (1u << NB_BF16),
    .causal_attention = nb__cpu_causal_attention,
    .causal_attention_backward = nb__cpu_causal_attention_backward,
};
