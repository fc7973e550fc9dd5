/* Causal multi-head self-attention with a fused qkv projection, composed of
 * existing ops so that it runs wherever they do.
 *
 * Letters: N batch, T sequence, C = n_embd, H heads, D = C / H per head.
 *   qkv = c_attn(x)                          (N, T, 3C)
 *   q, k, v = split(qkv, C, C, C)            (N, T, C) each, views
 *   q -> (N, T, H, D) -> (N, H, T, D), same for k, v
 *   att = q k^T                              (N, H, T, T)
 *   att = softmax over j of att / sqrt(D) where j <= i, 0 where j > i
 *         (nb_softmax_causal: one fused pass); attn_dropout
 *   y = att v                                (N, H, T, D) -> (N, T, H, D) -> (N, T, C)
 *   out = resid_dropout(c_proj(y))
 * A block's residual add after it (r + out, nb__attention_forward_residual)
 * rides c_proj's GEMM when resid_dropout does nothing (p 0, or not
 * training): Note [Residual in the GEMM] in tensor/ops_matmul.c.
 * The children are named as in nanoGPT's CausalSelfAttention (c_attn,
 * c_proj, attn_dropout, resid_dropout); their Linear weights are (out, in),
 * the transpose of GPT-2's Conv1D checkpoints.
 *
 * Where the backend has it (the CPU) and no attention dropout is active,
 * everything between c_attn and c_proj is one op (nb__causal_attention,
 * tensor/ops_softmax.c; kernels in tensor/cpu/attention.c): per head, the
 * same products and softmax rows, read and written in place in the (N, T,
 * 3C) and (N, T, C) rows, so no split or head transpose is recorded or
 * copied, forward or backward. */
#include <math.h>

#include "nn/internal.h"

typedef struct attention {
    int64_t c;
    int h;
    nb_dtype dtype;
    double attn_p, resid_p; /* attention and output dropout probabilities */
    nb_module *c_attn, *c_proj, *attn_dropout, *resid_dropout;
} attention;

static void attn_describe(nb_module *m, char *buf, size_t size) {
    const attention *a = m->self;
    snprintf(buf, size, "n_embd=%lld, n_head=%d", (long long)a->c, a->h);
}

/* (N, T, C) -> (N, H, T, D) */
static nb_tensor *split_heads(nb_ctx *ctx, nb_tensor *x, int64_t n, int64_t t, int h, int64_t d) {
    return nb_transpose(ctx, nb_reshape(ctx, x, NB_SHAPE(n, t, h, d)), 1, 2);
}

/* x (N, T, C) -> y (N, T, C), the heads' outputs before c_proj */
static nb_tensor *attn_heads(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const attention *a = m->self;
    NB_CHECK(x->ndim == 3 && x->shape[2] == a->c,
             "CausalSelfAttention: input %s must be (N, T, %lld)", nb_shape_str(x),
             (long long)a->c);
    nb__nn_check_input_dtype("CausalSelfAttention", x, a->dtype);
    int64_t n = x->shape[0], t = x->shape[1], c = a->c, d = c / a->h;
    nb_tensor *qkv = nb_module_forward(a->c_attn, ctx, x); /* (N, T, 3C) */
    double scale = 1.0 / sqrt((double)d);
    /* one fused op where the backend has one and no attention dropout is active */
    nb_tensor *y = a->attn_p == 0 || !nb_module_is_training(a->attn_dropout)
                       ? nb__causal_attention(ctx, qkv, a->h, scale)
                       : NULL;
    if (y) return y;
    nb_tensor *parts[3];
    nb_split(ctx, qkv, 3, (int64_t[]){c, c, c}, 2, parts);
    nb_tensor *q = split_heads(ctx, parts[0], n, t, a->h, d);
    nb_tensor *k = split_heads(ctx, parts[1], n, t, a->h, d);
    nb_tensor *v = split_heads(ctx, parts[2], n, t, a->h, d);
    nb_tensor *att = nb_softmax_causal(ctx, nb_matmul_t(ctx, q, k, false, true), scale);
    att = nb_module_forward(a->attn_dropout, ctx, att);
    y = nb_matmul(ctx, att, v);                                        /* (N, H, T, D) */
    return nb_reshape(ctx, nb_transpose(ctx, y, 1, 2), NB_SHAPE(n, t, c)); /* copies once */
}

static nb_tensor *attn_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const attention *a = m->self;
    nb_tensor *y = attn_heads(m, ctx, x);
    return nb_module_forward(a->resid_dropout, ctx, nb_module_forward(a->c_proj, ctx, y));
}

static nb_tensor *attn_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r) {
    const attention *a = m->self;
    nb_tensor *y = attn_heads(m, ctx, x);
    if (a->resid_p == 0 || !nb_module_is_training(a->resid_dropout))
        return nb__linear_forward_residual(a->c_proj, ctx, y, r);
    return nb_add(ctx, r, nb_module_forward(a->resid_dropout, ctx, nb_module_forward(a->c_proj, ctx, y)));
}

static const nb_module_type attn_type = {"CausalSelfAttention", sizeof(attention), attn_forward,
                                         attn_describe};

nb_tensor *nb__attention_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r) {
    nb_module_self(m, &attn_type);
    return nb__module_forward_residual(m, ctx, x, r, attn_forward_residual);
}

nb_module *nb_causal_self_attention_new(nb_ctx *ctx, nb_dtype dtype, int64_t n_embd, int n_head,
                                        const nb_attention_opts *opts, nb_rng *rng) {
    const char *fn = "nb_causal_self_attention_new";
    nb__nn_check_dtype(fn, dtype);
    NB_CHECK(n_embd > 0 && n_head > 0 && n_embd % n_head == 0,
             "%s: n_embd %lld must be a positive multiple of n_head %d", fn, (long long)n_embd,
             n_head);
    nb_attention_opts o = opts ? *opts : NB_ATTENTION_DEFAULTS;
    NB_CHECK(o.attn_dropout >= 0 && o.attn_dropout <= 1 && o.resid_dropout >= 0 &&
                 o.resid_dropout <= 1,
             "%s: attn_dropout %g and resid_dropout %g must be in [0, 1]", fn, o.attn_dropout,
             o.resid_dropout);
    nb_module *m = nb_module_new(ctx, &attn_type);
    attention *a = m->self;
    a->c = n_embd;
    a->h = n_head;
    a->dtype = dtype;
    a->attn_p = o.attn_dropout;
    a->resid_p = o.resid_dropout;
    a->c_attn = nb_module_add(m, "c_attn", nb_linear_new(ctx, dtype, n_embd, 3 * n_embd, o.bias, rng));
    a->c_proj = nb_module_add(m, "c_proj", nb_linear_new(ctx, dtype, n_embd, n_embd, o.bias, rng));
    a->attn_dropout =
        nb_module_add(m, "attn_dropout", nb_dropout_new(ctx, o.attn_dropout, o.dropout_rng));
    a->resid_dropout =
        nb_module_add(m, "resid_dropout", nb_dropout_new(ctx, o.resid_dropout, o.dropout_rng));
    return m;
}
