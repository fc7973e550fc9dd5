/* The GPT model: module tree, GPT-2 initialisation, forward, loss and
 * size figures. Sampling is in models/generate.c.
 *
 * Letters: N batch, T sequence, V vocabulary, C width, L layers.
 *
 * Note [GPT-2 names]
 * The tree is laid out so that every parameter's dotted name is the key
 * GPT-2 checkpoints use (Hugging Face's GPT2LMHeadModel, nanoGPT):
 *
 *   GPT
 *     transformer   ModuleDict: wte Embedding(V, C), wpe Embedding(block, C),
 *                   drop Dropout, h ModuleList of Block, ln_f LayerNorm(C)
 *       h.<i>       Block: ln_1, attn (nn's CausalSelfAttention: c_attn,
 *                   c_proj), ln_2, mlp (MLP: c_fc, gelu, c_proj, dropout)
 *     lm_head       LMHead whose one parameter "weight" IS wte's weight
 *
 * Because lm_head.weight is the very tensor registered first as
 * transformer.wte.weight, the parameter and state lists hold it once, under
 * that name; a checkpoint therefore has no lm_head.weight and a GPT-2
 * loader ties it to the embedding, as GPT-2 does. In the other direction,
 * a GPT-2 file's lm_head.weight (if present) equals its wte and is dropped.
 * nb_module_find(gpt, "lm_head.weight") still finds the tensor.
 *
 * Weights of the four Linear layers per block (attn.c_attn, attn.c_proj,
 * mlp.c_fc, mlp.c_proj) are (out, in) as nn's Linear stores them; GPT-2's
 * own files come from a Conv1D layer that stores (in, out), so a converter
 * transposes exactly those four; embeddings, LayerNorms and biases are
 * identical. GPT-2 files may also carry the causal-mask buffers
 * attn.bias / attn.masked_bias, which have no counterpart here (the mask is
 * computed) and are skipped. tests/test_gpt_names.py checks all of this
 * against a PyTorch GPT-2 built from those conventions.
 *
 * Note [Residual stream under a compute dtype]
 * Under a bf16 compute dtype the sum of the two embeddings is rounded to
 * bf16 once, by the op that forms it (nb__embedding_pos), and the residual stream stays bf16 (as llm.c keeps it): the
 * residual adds read and write bf16 with f32 arithmetic, layer norm reads
 * bf16 (its weights f32) and writes bf16 for the next product, so no cast
 * runs between ops. The other way, an f32 stream, needs a cast of each
 * branch's bf16 output up to f32 before its add and of each layer norm's
 * f32 output down to bf16 for the product: 4 more kernels per block, and
 * per element of the stream 64 bytes of forward traffic per block instead
 * of 20 (GPT-2 small at batch 8, T 1024: 3.3 GB more per forward; the two
 * saved layer norm inputs f32: 0.3 GB more kept for backward). Measured on
 * the CPU (4 layers, 4 heads, width 64, T 32, batch 8, AdamW 3e-3, the
 * Markov data of tests/test_cpu_bf16.c; mean loss of steps 501-600, two
 * seeds): f32 1.178102 / 1.183009, bf16 stream 1.178194 / 1.183144, f32
 * stream 1.178233 / 1.183087: both within 0.02% of f32 and of each other,
 * so the bf16 stream, at a third of the traffic, is kept. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/models.h"
#include "nabla/ops.h"
#include "nn/internal.h"     /* nb__module_forward_residual, a module's unit and recompute */
#include "tensor/internal.h" /* nb__linear_gelu, nb__embedding_pos */

/* ---------------------------------------------------------------- MLP */
typedef struct gpt_mlp {
    nb_module *c_fc, *c_proj, *dropout;
    double p;           /* dropout's probability */
    bool recompute_gelu; /* nb_gpt_set_recompute_gelu */
} gpt_mlp;

static nb_tensor *gpt_mlp_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
static const nb_module_type gpt_mlp_type = {"MLP", sizeof(gpt_mlp), gpt_mlp_forward, NULL};

/* x (N, T, C) -> h (N, T, 4C): c_fc and GELU(tanh) as one op (on CUDA in
 * the GEMM's epilogue); h made again in c_proj's backward from the
 * pre-activation when recompute_gelu is set (Note [GELU recomputed in
 * backward] in tensor/ops_matmul.c) */
static nb_tensor *gpt_mlp_hidden(gpt_mlp *s, nb_ctx *ctx, nb_tensor *x) {
    return nb__linear_gelu_ex(ctx, x, nb_module_find(s->c_fc, "weight"),
                              nb_module_find(s->c_fc, "bias"), s->recompute_gelu);
}

/* x (N, T, C) -> (N, T, C) */
static nb_tensor *gpt_mlp_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    gpt_mlp *s = nb_module_self(m, &gpt_mlp_type);
    nb_tensor *h = nb_module_forward(s->c_proj, ctx, gpt_mlp_hidden(s, ctx, x));
    return nb_module_forward(s->dropout, ctx, h);
}

/* r + the MLP of x, the add in c_proj's GEMM when the dropout does nothing
 * (Note [Residual in the GEMM] in tensor/ops_matmul.c) */
static nb_tensor *gpt_mlp_forward_residual(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *r) {
    gpt_mlp *s = nb_module_self(m, &gpt_mlp_type);
    nb_tensor *h = gpt_mlp_hidden(s, ctx, x);
    if (s->p == 0 || !nb_module_is_training(s->dropout))
        return nb__linear_forward_residual(s->c_proj, ctx, h, r);
    return nb_add(ctx, r, nb_module_forward(s->dropout, ctx, nb_module_forward(s->c_proj, ctx, h)));
}

/* -------------------------------------------------------------- Block */
typedef struct gpt_block {
    nb_module *ln_1, *attn, *ln_2, *mlp;
} gpt_block;

static nb_tensor *gpt_block_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);
static const nb_module_type gpt_block_type = {"Block", sizeof(gpt_block), gpt_block_forward, NULL};

/* x (N, T, C) -> (N, T, C), pre-LayerNorm residual branches */
static nb_tensor *gpt_block_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    gpt_block *s = nb_module_self(m, &gpt_block_type);
    /* each branch's residual add rides its last GEMM */
    x = nb__attention_forward_residual(s->attn, ctx, nb_module_forward(s->ln_1, ctx, x), x);
    return nb__module_forward_residual(s->mlp, ctx, nb_module_forward(s->ln_2, ctx, x), x,
                                       gpt_mlp_forward_residual);
}

/* ------------------------------------------------- containers and head */
static const nb_module_type gpt_dict_type = {"ModuleDict", 0, NULL, NULL};

typedef struct gpt_head {
    nb_tensor *weight; /* (V, C), the token embedding's */
} gpt_head;

static nb_tensor *gpt_head_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x);

static void gpt_head_describe(nb_module *m, char *buf, size_t size) {
    snprintf(buf, size, "tied to transformer.wte.weight");
}

static const nb_module_type gpt_head_type = {"LMHead", sizeof(gpt_head), gpt_head_forward,
                                             gpt_head_describe};

/* x (.., C) -> (.., V) = x wte^T */
static nb_tensor *gpt_head_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    gpt_head *s = nb_module_self(m, &gpt_head_type);
    return nb_matmul_t(ctx, x, s->weight, false, true);
}

/* ---------------------------------------------------------------- GPT */
typedef struct gpt {
    nb_gpt_config cfg;
    nb_dtype dtype;
    nb_module *wte, *wpe, *drop, *h, *ln_f, *lm_head;
    nb_rng dropout_rng; /* lives in the model's context: the dropouts keep &dropout_rng */
} gpt;

static nb_tensor *gpt_forward(nb_module *m, nb_ctx *ctx, nb_tensor *idx);

static void gpt_describe(nb_module *m, char *buf, size_t size);

static const nb_module_type gpt_type = {"GPT", sizeof(gpt), gpt_forward, gpt_describe};

static void gpt_describe(nb_module *m, char *buf, size_t size) {
    const gpt *g = nb_module_self(m, &gpt_type);
    snprintf(buf, size, "vocab_size=%lld, block_size=%lld, n_layer=%d, n_head=%d, n_embd=%lld, "
             "dropout=%g", (long long)g->cfg.vocab_size, (long long)g->cfg.block_size,
             g->cfg.n_layer, g->cfg.n_head, (long long)g->cfg.n_embd, g->cfg.dropout);
}

typedef struct embedding_pos_args {
    nb_tensor *te, *pe, *idx;
    nb_dtype dt;
} embedding_pos_args;

static nb_tensor *embedding_pos(nb_module *wte, nb_ctx *ctx, void *arg) {
    (void)wte;
    const embedding_pos_args *a = arg;
    return nb__embedding_pos(ctx, a->te, a->pe, a->idx, a->dt);
}

/* wte[idx] + wpe[:T] (N, T, C), in the compute dtype when the tables are
 * f32: one op (nb__embedding_pos) when nothing acts on either table's
 * forward, run as wte's forward (Note [Fused module forwards] in
 * nn/internal.h: a bad token index names transformer.wte, as the unfused
 * path does; the positions cannot be bad, gpt_forward checks T); else (a
 * table a sharding unit gathers in its own forward, or recomputes) through
 * the modules' forwards, an add and a cast, which give the same values. */
static nb_tensor *input_embedding(gpt *g, nb_ctx *ctx, nb_tensor *idx, nb_dtype cd) {
    nb_tensor *te = nb_module_find(g->wte, "weight"), *pe = nb_module_find(g->wpe, "weight");
    nb_dtype dt = cd != NB_F32 && te->dtype == NB_F32 ? cd : te->dtype;
    if (nb__module_forward_plain(g->wte) && nb__module_forward_plain(g->wpe) &&
        te->dtype == pe->dtype)
        return nb__module_forward_fused(g->wte, ctx, embedding_pos,
                                        &(embedding_pos_args){te, pe, idx, dt});
    nb_tensor *pos = nb_arange(ctx, NB_I64, 0, (double)idx->shape[1], 1); /* (T) */
    nb_tensor *x = nb_add(ctx, nb_module_forward(g->wte, ctx, idx),      /* (N, T, C) */
                          nb_module_forward(g->wpe, ctx, pos));          /* (T, C) */
    return x->dtype == dt ? x : nb_cast(ctx, x, dt);
}

/* idx (N, T) -> logits (N, T, V) */
static nb_tensor *gpt_forward(nb_module *m, nb_ctx *ctx, nb_tensor *idx) {
    gpt *g = nb_module_self(m, &gpt_type);
    NB_CHECK(idx->ndim == 2 && (idx->dtype == NB_I64 || idx->dtype == NB_I32),
             "GPT: token ids must be (N, T) of i32 or i64, got %s of %s", nb_shape_str(idx),
             nb_dtype_name(idx->dtype));
    int64_t t = idx->shape[1];
    NB_CHECK(t >= 1 && t <= g->cfg.block_size,
             "GPT: sequence length %lld must be in [1, block_size %lld]", (long long)t,
             (long long)g->cfg.block_size);
    /* Under a compute dtype the residual stream is in it: Note [Residual
     * stream under a compute dtype] */
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    nb_tensor *x = input_embedding(g, ctx, idx, cd); /* (N, T, C) */
    x = nb_module_forward(g->drop, ctx, x);
    for (int i = 0; i < g->cfg.n_layer; i++)
        x = nb_module_forward(nb_module_child_at(g->h, i), ctx, x);
    x = nb_module_forward(g->ln_f, ctx, x);
    return nb_module_forward(g->lm_head, ctx, x);
}

nb_tensor *nb_gpt_forward(nb_module *gpt_m, nb_ctx *ctx, nb_tensor *idx) {
    return nb_module_forward(gpt_m, ctx, idx);
}

/* The loss of logits (N, T, V); fused: the logits are the library's and
 * nothing reads them after (Note [Fused classifier] in tensor/ops_loss.c) */
static nb_tensor *gpt_loss(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets, bool fused) {
    NB_CHECK(logits->ndim == 3 && targets->ndim == 2 && targets->shape[0] == logits->shape[0] &&
                 targets->shape[1] == logits->shape[1],
             "nb_gpt_loss: logits %s must be (N, T, V) and targets %s (N, T)",
             nb_shape_str(logits), nb_shape_str(targets));
    int64_t nt = logits->shape[0] * logits->shape[1];
    nb_tensor *flat = nb_reshape(ctx, logits, NB_SHAPE(nt, logits->shape[2]));
    nb_tensor *tflat = nb_reshape(ctx, targets, NB_SHAPE(nt));
    return fused ? nb__cross_entropy_fused(ctx, flat, tflat, NULL)
                 : nb_cross_entropy(ctx, flat, tflat, NULL);
}

nb_tensor *nb_gpt_forward_loss(nb_module *gpt_m, nb_ctx *ctx, nb_tensor *idx, nb_tensor *targets) {
    nb__scope_enter(ctx); /* the logits are the library's: Note [Memory given back] */
    nb_tensor *loss = gpt_loss(ctx, nb_module_forward(gpt_m, ctx, idx), targets, true);
    nb__scope_exit(ctx, loss);
    return loss;
}

void nb_gpt_set_recompute(nb_module *m, bool on) {
    gpt *g = nb_module_self(m, &gpt_type);
    for (int i = 0; i < g->cfg.n_layer; i++) nb_module_set_recompute(nb_module_child_at(g->h, i), on);
}

void nb_gpt_set_recompute_gelu(nb_module *m, bool on) {
    gpt *g = nb_module_self(m, &gpt_type);
    for (int i = 0; i < g->cfg.n_layer; i++) {
        gpt_block *b = nb_module_self(nb_module_child_at(g->h, i), &gpt_block_type);
        ((gpt_mlp *)nb_module_self(b->mlp, &gpt_mlp_type))->recompute_gelu = on;
    }
}

nb_tensor *nb_gpt_loss(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets) {
    return gpt_loss(ctx, logits, targets, false);
}

static nb_module *layer_norm(nb_ctx *ctx, nb_dtype dtype, int64_t c) {
    return nb_layer_norm_new(ctx, dtype, NB_SHAPE(c), NULL);
}

static nb_module *block_new(nb_ctx *ctx, nb_dtype dtype, const nb_gpt_config *cfg, nb_rng *drop,
                            nb_rng *scratch) {
    int64_t c = cfg->n_embd;
    nb_module *m = nb_module_new(ctx, &gpt_block_type);
    gpt_block *b = nb_module_self(m, &gpt_block_type);
    b->ln_1 = nb_module_add(m, "ln_1", layer_norm(ctx, dtype, c));
    nb_attention_opts ao = {.bias = true, .attn_dropout = cfg->dropout,
                            .resid_dropout = cfg->dropout, .dropout_rng = drop};
    b->attn = nb_module_add(m, "attn",
                            nb_causal_self_attention_new(ctx, dtype, c, cfg->n_head, &ao, scratch));
    b->ln_2 = nb_module_add(m, "ln_2", layer_norm(ctx, dtype, c));
    nb_module *mlp = nb_module_new(ctx, &gpt_mlp_type);
    gpt_mlp *p = nb_module_self(mlp, &gpt_mlp_type);
    p->c_fc = nb_module_add(mlp, "c_fc", nb_linear_new(ctx, dtype, c, 4 * c, true, scratch));
    /* The forward fuses GELU into c_fc (nb__linear_gelu) and never calls
     * this module; it is registered so that the tree prints as nanoGPT's
     * MLP does (c_fc, gelu, c_proj, dropout) and mlp.gelu can be found. */
    nb_module_add(mlp, "gelu", nb_gelu_new(ctx, NB_GELU_TANH));
    p->c_proj = nb_module_add(mlp, "c_proj", nb_linear_new(ctx, dtype, 4 * c, c, true, scratch));
    p->dropout = nb_module_add(mlp, "dropout", nb_dropout_new(ctx, cfg->dropout, drop));
    p->p = cfg->dropout;
    b->mlp = nb_module_add(m, "mlp", mlp);
    return m;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* GPT-2's scheme over the parameters in order; see the header. LayerNorm
 * weights and biases keep the values their constructor gave them. */
static void gpt2_init(nb_module *m, int n_layer, nb_rng *rng) {
    int n = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *p = malloc((size_t)n * sizeof *p);
    NB_CHECK(p, "nb_gpt_new: out of memory listing %d parameters", n);
    nb_module_named_parameters(m, p, n);
    double resid_std = 0.02 / sqrt(2.0 * n_layer);
    for (int i = 0; i < n; i++) {
        const char *name = p[i].name;
        if (strstr(name, ".ln_")) continue;
        if (ends_with(name, ".bias")) nb_fill_(p[i].tensor, 0.0);
        else if (ends_with(name, "c_proj.weight")) nb_init_normal_(p[i].tensor, 0.0, resid_std, rng);
        else nb_init_normal_(p[i].tensor, 0.0, 0.02, rng);
    }
    free(p);
}

nb_module *nb_gpt_new(nb_ctx *ctx, nb_dtype dtype, const nb_gpt_config *cfg, nb_rng *rng) {
    const char *fn = "nb_gpt_new";
    NB_CHECK(cfg, "%s: config is NULL", fn);
    NB_CHECK(dtype == NB_F32 || dtype == NB_F64, "%s: dtype %s; the model computes in f32 or f64",
             fn, nb_dtype_name(dtype));
    NB_CHECK(cfg->vocab_size > 0, "%s: vocab_size %lld must be positive", fn,
             (long long)cfg->vocab_size);
    NB_CHECK(cfg->block_size > 0, "%s: block_size %lld must be positive", fn,
             (long long)cfg->block_size);
    NB_CHECK(cfg->n_layer > 0, "%s: n_layer %d must be positive", fn, cfg->n_layer);
    NB_CHECK(cfg->n_head > 0 && cfg->n_embd > 0 && cfg->n_embd % cfg->n_head == 0,
             "%s: n_embd %lld must be a positive multiple of n_head %d", fn,
             (long long)cfg->n_embd, cfg->n_head);
    NB_CHECK(cfg->dropout >= 0 && cfg->dropout < 1, "%s: dropout %g must be in [0, 1)", fn,
             cfg->dropout);
    if (!rng) rng = nb_rng_default();

    nb_module *m = nb_module_new(ctx, &gpt_type);
    gpt *g = nb_module_self(m, &gpt_type);
    g->cfg = *cfg;
    g->dtype = dtype;
    /* The layers draw their own (PyTorch-default) values from a throwaway
     * generator; gpt2_init then draws every parameter from rng. */
    nb_rng scratch = nb_rng_make(0);
    int64_t c = cfg->n_embd;

    nb_module *tr = nb_module_add(m, "transformer", nb_module_new(ctx, &gpt_dict_type));
    g->wte = nb_module_add(tr, "wte", nb_embedding_new(ctx, dtype, cfg->vocab_size, c, &scratch));
    g->wpe = nb_module_add(tr, "wpe", nb_embedding_new(ctx, dtype, cfg->block_size, c, &scratch));
    g->drop = nb_module_add(tr, "drop", nb_dropout_new(ctx, cfg->dropout, &g->dropout_rng));
    g->h = nb_module_add(tr, "h", nb_module_list_new(ctx));
    for (int i = 0; i < cfg->n_layer; i++)
        nb_module_append(g->h, block_new(ctx, dtype, cfg, &g->dropout_rng, &scratch));
    g->ln_f = nb_module_add(tr, "ln_f", layer_norm(ctx, dtype, c));

    g->lm_head = nb_module_add(m, "lm_head", nb_module_new(ctx, &gpt_head_type));
    gpt_head *head = nb_module_self(g->lm_head, &gpt_head_type);
    head->weight = nb_module_add_param(g->lm_head, "weight", nb_module_find(g->wte, "weight"));

    gpt2_init(m, cfg->n_layer, rng);
    g->dropout_rng = *rng;
    return m;
}

bool nb_gpt_is(const nb_module *m) { return m && nb_module_is(m, &gpt_type); }

nb_gpt_config nb_gpt_get_config(nb_module *m) {
    return ((gpt *)nb_module_self(m, &gpt_type))->cfg;
}

nb_rng *nb_gpt_dropout_rng(nb_module *m) {
    return &((gpt *)nb_module_self(m, &gpt_type))->dropout_rng;
}

int64_t nb_gpt_num_params_non_embedding(nb_module *m) {
    gpt *g = nb_module_self(m, &gpt_type);
    return nb_module_num_params(m) - nb_numel(nb_module_find(g->wpe, "weight"));
}

double nb_gpt_flops_per_token(nb_module *m, int64_t seq_len) {
    gpt *g = nb_module_self(m, &gpt_type);
    NB_CHECK(seq_len > 0 && seq_len <= g->cfg.block_size,
             "nb_gpt_flops_per_token: seq_len %lld must be in [1, block_size %lld]",
             (long long)seq_len, (long long)g->cfg.block_size);
    return 6.0 * (double)nb_gpt_num_params_non_embedding(m) +
           12.0 * g->cfg.n_layer * (double)seq_len * (double)g->cfg.n_embd;
}

nb_memory_floor nb_gpt_memory_floor(nb_module *m, int64_t batch, int64_t seq_len,
                                    int optim_states) {
    gpt *g = nb_module_self(m, &gpt_type);
    NB_CHECK(batch > 0 && seq_len > 0 && seq_len <= g->cfg.block_size && optim_states >= 0,
             "nb_gpt_memory_floor: batch %lld, seq_len %lld (block_size %lld) and optim_states "
             "%d must be positive", (long long)batch, (long long)seq_len,
             (long long)g->cfg.block_size, optim_states);
    size_t e = nb_dtype_size(g->dtype), p = (size_t)nb_module_num_params(m) * e;
    double n = (double)batch, t = (double)seq_len, c = (double)g->cfg.n_embd,
           v = (double)g->cfg.vocab_size;
    /* per block: x, ln_1(x), y, x + attn, ln_2(.) (5 NTC), qkv (3 NTC), the
     * MLP's pre-activation and GELU (8 NTC), two layer norms' mean and rstd
     * (4 NT); then ln_f's input, output and statistics. Not the attention's
     * probabilities (N H T T): a fused attention makes them again in its
     * backward (Note [Attention without stored probabilities] in
     * tensor/cpu/attention.c); where attention is composed of ops they are
     * kept, above this floor. */
    double block = 16 * n * t * c + 4 * n * t;
    double saved = g->cfg.n_layer * block + 2 * n * t * c + 2 * n * t;
    return (nb_memory_floor){p, p, (size_t)optim_states * p, (size_t)(saved * (double)e),
                             (size_t)(n * t * v * (double)e)};
}

size_t nb_memory_floor_total(const nb_memory_floor *f) {
    return f->params + f->grads + f->optim_state + f->saved + f->logits;
}
