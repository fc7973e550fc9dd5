/* bf16 activations on the CPU: the bf16 side of the entries in the
 * compute-dtype table (docs/cuda.md, "What each op returns").
 *
 * Note [bf16 activations on the CPU]
 * Under a bf16 compute dtype the activations between ops are bf16 on
 * every device (Note [Compute dtype] in tensor/context.c). CUDA's kernels
 * load bf16, compute in f32 and store bf16; the CPU gives the same
 * semantics with the f32 kernels it has: each bf16 input is widened to a
 * contiguous f32 twin (exact: bf16 is f32's top half), the f32 kernel
 * runs on the twins, and each bf16 output is rounded once, to nearest
 * even, from the kernel's f32 result. f32 tensors (layer norm's weights,
 * the loss, the log-sum-exp) are passed through untouched. So a bf16 op
 * here is exactly the f32 op on the bf16 values, rounded at its output,
 * which is what CI checks of the table (tests/test_cpu_bf16.c); it costs
 * two passes more than an f32 op, as the CPU's bf16 products already do
 * (tensor/cpu/matmul.c). The twins are malloc'd and freed within the
 * call.
 * The entries a GPT step spends its time in take no twins: they give the
 * same bits from small f32 blocks that stay in cache (elementwise ops and
 * GELU's gradient: Note [bf16 elementwise in blocks] in
 * tensor/cpu/elementwise.c; attention: Note [bf16 attention without
 * twins] in tensor/cpu/attention.c; layer norm: Note [bf16 layer norm in
 * row groups] in tensor/cpu/norm.c; a bias's gradient: Note [Broadcast
 * gradients of storage halves] in tensor/ops_reduce.c; cross-entropy:
 * Note [bf16 cross-entropy in pieces] in tensor/cpu/softmax.c; softmax,
 * log-softmax and the causal softmax: Note [bf16 softmax in blocks], there
 * too; dropout: Note [bf16 dropout in blocks] in tensor/cpu/dropout.c;
 * the reductions over an axis: Note [bf16 rows read in place] in
 * tensor/cpu/reduce.c). The twins
 * below remain for the other entries and for the layouts those decline. */
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/attention.h"
#include "tensor/cpu/bf16.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/matmul.h"
#include "tensor/cpu/softmax.h"

typedef struct twin {
    nb_tensor t;
    bool owned;
} twin;

/* t itself, or (t bf16) an f32 contiguous twin: holding t's values when
 * `read`, else uninitialised. NULL stays NULL. */
static nb_tensor *widen(twin *w, const nb_tensor *t, bool read) {
    w->owned = false;
    if (!t) return NULL;
    if (t->dtype != NB_BF16) return (nb_tensor *)t;
    w->t = *t;
    w->t.dtype = NB_F32;
    w->t.base = NULL;
    int64_t n = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        w->t.strides[d] = n;
        n *= t->shape[d];
    }
    w->t.data = malloc((size_t)(n ? n : 1) * sizeof(float));
    NB_CHECK(w->t.data, "bf16 activations: out of memory widening %s to f32 (%lld bytes)",
             nb_shape_str(t), (long long)(n * (int64_t)sizeof(float)));
    w->owned = true;
    if (read) nb__cpu_copy(&w->t, t);
    return &w->t;
}

static const nb_tensor *in(twin *w, const nb_tensor *t) { return widen(w, t, true); }
static nb_tensor *out(twin *w, nb_tensor *t) { return widen(w, t, false); }

/* Rounds an output's twin into it (when it has one) and frees the twin. */
static void narrow(twin *w, nb_tensor *t) {
    if (!w->owned) return;
    nb__cpu_copy(t, &w->t);
    free(w->t.data);
    w->owned = false;
}

/* t (contiguous) += its twin's values rounded to t's dtype: the f32 sums
 * rounded once more, the bits of a separate add (add_half in
 * autograd/backward.c). */
static void narrow_add(twin *w, nb_tensor *t) {
    NB_CHECK(nb_is_contiguous(t), "bf16 activations: internal error: adding into a %s view",
             nb_shape_str(t));
    uint16_t *p = t->data;
    const float *v = w->t.data;
    for (int64_t i = 0, n = nb_numel(t); i < n; i++)
        p[i] = nb_f32_to_bf16(nb_bf16_to_f32(p[i]) + nb_bf16_to_f32(nb_f32_to_bf16(v[i])));
    free(w->t.data);
    w->owned = false;
}

static void done(twin *w) {
    if (w->owned) free(w->t.data);
    w->owned = false;
}

void nb__cpu_unary_bf16(nb__unary_op op, nb_tensor *y, const nb_tensor *a, double s) {
    twin wy, wa;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_unary(op, ty, in(&wa, a), s);
    done(&wa);
    narrow(&wy, y);
}

void nb__cpu_binary_bf16(nb__binary_op op, nb_tensor *y, const nb_tensor *a, const nb_tensor *b) {
    twin wy, wa, wb;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_binary(op, ty, in(&wa, a), in(&wb, b));
    done(&wa);
    done(&wb);
    narrow(&wy, y);
}

/* bf16 output (and pre-activation): the product, bias and GELU (or
 * GELU's gradient) in f32, each output rounded once. A kept pre-activation
 * is rounded first and GELU applied to that, by nb_gelu's bf16 kernel: so
 * y is nb_gelu(pre) bit for bit, the values a backward that makes y again
 * from pre gets (Note [GELU recomputed in backward] in tensor/ops_matmul.c). */
void nb__cpu_matmul_bf16_out(nb_tensor *y, const nb_tensor *a, const nb_tensor *b, bool ta,
                             bool tb, const nb_tensor *bias, bool gelu, nb_tensor *pre,
                             const nb_tensor *dgelu_pre) {
    twin wy, wp, wbias, wd;
    /* Note [bf16 products stored as bf16]
     * Where oneDNN takes the product (native bf16), it stores the output
     * as bf16 itself: the same f32 sums, bias and GELU post-op, rounded to
     * nearest even once as they are stored (tensor/cpu/dnnl.h), so no f32
     * twin of the output is allocated and no pass rounds it. A kept
     * pre-activation is stored that way and y made from it by nb_gelu's
     * kernel, as below. GPT L6 bf16 step on one thread (bench_ddp --no-ddp
     * --model gpt6 --bf16, 2-core Xeon with AMX, 2026-12-02, load average
     * 2, 3 runs each): 136-137 ms against 139-141 with the twin (the
     * products whole in both). */
    nb_tensor *dst = gelu && pre ? pre : y;
    if (!dgelu_pre && y->dtype == NB_BF16 && dst->dtype == NB_BF16 && nb_is_contiguous(dst)) {
        const nb_tensor *tbias = in(&wbias, bias);
        bool took = nb__dnnl_matmul(dst, a, b, ta, tb, tbias, gelu && !pre, false);
        done(&wbias);
        if (took) {
            if (gelu && pre) nb__cpu_unary(NB_U_GELU_TANH, y, pre, 0);
            return;
        }
    }
    if (gelu && pre && pre->dtype == NB_BF16 && y->dtype == NB_BF16) {
        nb_tensor *tp = out(&wp, pre);
        nb__cpu_matmul(tp, a, b, ta, tb, &(nb__gemm_epilogue){.bias = in(&wbias, bias)});
        done(&wbias);
        narrow(&wp, pre);
        nb__cpu_unary(NB_U_GELU_TANH, y, pre, 0);
        return;
    }
    nb_tensor *ty = out(&wy, y), *tp = out(&wp, pre);
    nb__cpu_matmul(ty, a, b, ta, tb,
                   &(nb__gemm_epilogue){.bias = in(&wbias, bias), .gelu = gelu, .pre = tp,
                                        .dgelu_pre = in(&wd, dgelu_pre)});
    done(&wbias);
    done(&wd);
    narrow(&wy, y);
    narrow(&wp, pre);
}

void nb__cpu_gelu_tanh_backward_bf16(nb_tensor *dx, const nb_tensor *g, const nb_tensor *pre) {
    if (nb__cpu_gelu_tanh_backward_blocks(dx, g, pre)) return;
    twin wd, wg, wp;
    nb_tensor *td = out(&wd, dx);
    nb__cpu_gelu_tanh_backward(td, in(&wg, g), in(&wp, pre));
    done(&wg);
    done(&wp);
    narrow(&wd, dx);
}

void nb__cpu_softmax_bf16(nb_tensor *y, const nb_tensor *x, int64_t o, int64_t k, int64_t i,
                          bool take_log) {
    twin wy, wx;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_softmax(ty, in(&wx, x), o, k, i, take_log);
    done(&wx);
    narrow(&wy, y);
}

void nb__cpu_softmax_backward_bf16(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                   int64_t o, int64_t k, int64_t i, bool take_log) {
    twin wd, wy, wg;
    nb_tensor *td = out(&wd, dx);
    nb__cpu_softmax_backward(td, in(&wy, y), in(&wg, g), o, k, i, take_log);
    done(&wy);
    done(&wg);
    narrow(&wd, dx);
}

void nb__cpu_softmax_causal_bf16(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t,
                                 int64_t s, double scale) {
    twin wy, wx;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_softmax_causal(ty, in(&wx, x), b, t, s, scale);
    done(&wx);
    narrow(&wy, y);
}

void nb__cpu_softmax_causal_backward_bf16(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                          int64_t b, int64_t t, int64_t s, double scale) {
    twin wd, wy, wg;
    nb_tensor *td = out(&wd, dx);
    nb__cpu_softmax_causal_backward(td, in(&wy, y), in(&wg, g), b, t, s, scale);
    done(&wy);
    done(&wg);
    narrow(&wd, dx);
}

/* qkv, y bf16; lse f32 */
void nb__cpu_causal_attention_bf16(nb_ctx *ctx, nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv,
                                   int h, double scale) {
    twin wy, wq;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_causal_attention(ctx, ty, lse, in(&wq, qkv), h, scale);
    done(&wq);
    narrow(&wy, y);
}

void nb__cpu_causal_attention_backward_bf16(nb_ctx *ctx, nb_tensor *dqkv, const nb_tensor *qkv,
                                            const nb_tensor *y, const nb_tensor *lse,
                                            const nb_tensor *gy, int h, double scale) {
    twin wd, wq, wy, wg;
    nb_tensor *td = out(&wd, dqkv);
    nb__cpu_causal_attention_backward(ctx, td, in(&wq, qkv), in(&wy, y), lse, in(&wg, gy), h,
                                      scale);
    done(&wq);
    done(&wy);
    done(&wg);
    narrow(&wd, dqkv);
}

/* x, y bf16; w and b f32 or bf16 (widened too: the f32 kernel reads
 * floats); mean, rstd f32 or f64 */
void nb__cpu_layer_norm_bf16(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x,
                             const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d,
                             double eps) {
    twin wy, wx, ww, wb;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_layer_norm(ty, mean, rstd, in(&wx, x), in(&ww, w), in(&wb, b), m, d, eps);
    done(&wx);
    done(&ww);
    done(&wb);
    narrow(&wy, y);
}

/* dx, g, x bf16; w f32 or bf16 (widened), dw and db f32 or bf16 (the
 * sums rounded to their dtype as they are stored) */
void nb__cpu_layer_norm_backward_bf16(nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                      const nb_tensor *g, const nb_tensor *x,
                                      const nb_tensor *mean, const nb_tensor *rstd,
                                      const nb_tensor *w, int64_t m, int64_t d, unsigned add) {
    twin wd, wg, wx, ww;
    nb_tensor *td = out(&wd, dx);
    nb__cpu_layer_norm_backward(ctx, td, dw, db, in(&wg, g), in(&wx, x), mean, rstd, in(&ww, w), m,
                                d, add & ~(unsigned)NB__LN_ADD_DX);
    done(&wg);
    done(&wx);
    done(&ww);
    if (dx && (add & NB__LN_ADD_DX)) narrow_add(&wd, dx);
    else narrow(&wd, dx);
}

/* bf16 logits that are not contiguous (the contiguous ones go in pieces);
 * the loss and the log-sum-exp f32 */
void nb__cpu_cross_entropy_bf16(nb_ctx *ctx, nb_tensor *loss, nb_tensor **lse, nb_tensor **count,
                                nb_tensor *dlogits, const nb_tensor *logits,
                                const nb_tensor *targets, int64_t ignore_index, double eps) {
    twin wd, wx;
    const nb_tensor *tx = in(&wx, logits); /* before dlogits, which may be the logits' storage */
    nb_tensor *td = out(&wd, dlogits);
    nb__cpu_cross_entropy(ctx, loss, lse, count, td, tx, targets, ignore_index, eps);
    done(&wx);
    narrow(&wd, dlogits);
}

void nb__cpu_cross_entropy_backward_bf16(nb_tensor *dlogits, const nb_tensor *logits,
                                         const nb_tensor *lse, const nb_tensor *targets,
                                         const nb_tensor *g, const nb_tensor *count,
                                         int64_t ignore_index, double eps) {
    twin wd, wx;
    const nb_tensor *tx = in(&wx, logits); /* before dlogits, which may be the logits' storage */
    nb_tensor *td = out(&wd, dlogits);
    nb__cpu_cross_entropy_backward(td, tx, lse, targets, g, count, ignore_index, eps);
    done(&wx);
    narrow(&wd, dlogits);
}

/* bf16 dropout whose tensors are not all contiguous bf16 (the others go in blocks) */
void nb__cpu_dropout_bf16(nb_tensor *y, nb_tensor *mask, const nb_tensor *x, double p,
                          uint64_t seed, uint64_t offset) {
    twin wy, wm, wx;
    nb_tensor *ty = out(&wy, y), *tm = out(&wm, mask);
    nb__cpu_dropout(ty, tm, in(&wx, x), p, seed, offset);
    done(&wx);
    narrow(&wy, y);
    narrow(&wm, mask);
}

void nb__cpu_sum_rows_bf16(nb_tensor *y, const nb_tensor *rows, int64_t outer, int64_t inner,
                           double scale) {
    twin wy, wr;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_sum_rows(ty, in(&wr, rows), outer, inner, scale);
    done(&wr);
    narrow(&wy, y);
}

void nb__cpu_max_rows_bf16(nb_tensor *y, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                           int64_t inner) {
    twin wy, wr;
    nb_tensor *ty = out(&wy, y);
    nb__cpu_max_rows(ty, arg, in(&wr, rows), outer, inner);
    done(&wr);
    narrow(&wy, y);
}

void nb__cpu_argmax_rows_bf16(nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                              int64_t inner) {
    twin wr;
    nb__cpu_argmax_rows(arg, in(&wr, rows), outer, inner);
    done(&wr);
}

void nb__cpu_var_rows_bf16(nb_tensor *y, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                           int64_t inner, double denom) {
    twin wy, wm, wr;
    nb_tensor *ty = out(&wy, y), *tm = out(&wm, mean);
    nb__cpu_var_rows(ty, tm, in(&wr, rows), outer, inner, denom);
    done(&wr);
    narrow(&wy, y);
    narrow(&wm, mean);
}
