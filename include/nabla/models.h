/* Bundled models: a GPT-2-style transformer language model, and two
 * classifiers (an MLP for tabular data, a small CNN with BatchNorm for
 * images). Each is an ordinary module tree (include/nabla/nn.h), so
 * optimizers, checkpoints and DDP take it like any other model.
 * docs/models.md is the guide; docs/examples.md shows the training programs
 * built on them.
 *
 * Letters in shape comments: N batch, T sequence, V vocabulary, C width,
 * F features, K classes, H/W height and width. */
#ifndef NABLA_MODELS_H
#define NABLA_MODELS_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/context.h"
#include "nabla/nn.h"
#include "nabla/random.h"
#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ GPT
 * Token and position embeddings, n_layer pre-LayerNorm blocks
 *   x = x + attn(ln_1(x));  x = x + mlp(ln_2(x)),  mlp = c_proj(gelu_tanh(c_fc(.)))
 * a final LayerNorm and an output head tied to the token embedding.
 *
 * Parameter names are GPT-2's, one to one (Note [GPT-2 names] in
 * models/gpt.c): transformer.wte.weight (V, C), transformer.wpe.weight
 * (block_size, C), transformer.h.<i>.{ln_1,ln_2}.{weight,bias} (C),
 * transformer.h.<i>.attn.c_attn.{weight (3C, C), bias (3C)},
 * transformer.h.<i>.attn.c_proj.{weight (C, C), bias (C)},
 * transformer.h.<i>.mlp.c_fc.{weight (4C, C), bias (4C)},
 * transformer.h.<i>.mlp.c_proj.{weight (C, 4C), bias (C)},
 * transformer.ln_f.{weight,bias} (C). The four Linear weights per block are
 * stored (out, in); GPT-2's Conv1D files store them (in, out), the
 * transpose. The head is registered as lm_head.weight but is the same
 * tensor as transformer.wte.weight, so the parameter and state lists (and
 * checkpoints) hold it once, under the embedding's name; a GPT-2 loader
 * sets lm_head.weight = transformer.wte.weight, as GPT-2 itself ties them.
 *
 * Initialisation is GPT-2's: every Linear weight and both embeddings
 * N(0, 0.02), the two residual projections (attn.c_proj.weight,
 * mlp.c_proj.weight) N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm
 * weights 1; drawn from `rng` in parameter order. */
typedef struct nb_gpt_config {
    int64_t vocab_size; /* V */
    int64_t block_size; /* longest sequence: rows of the position embedding */
    int n_layer;
    int n_head;
    int64_t n_embd;     /* C, a multiple of n_head */
    double dropout;     /* after the embeddings, on attention weights, on both residual branches */
} nb_gpt_config;

/* GPT-2 small: V 50257, block 1024, 12 layers, 12 heads, width 768. */
#define NB_GPT2_SMALL ((nb_gpt_config){50257, 1024, 12, 12, 768, 0.0})

/* A GPT with parameters of `dtype` (f32; f64 for gradient checks) in ctx.
 * Aborts, naming the field, on a configuration that does not make sense. */
NB_API nb_module *nb_gpt_new(nb_ctx *ctx, nb_dtype dtype, const nb_gpt_config *cfg, nb_rng *rng);
NB_API bool nb_gpt_is(const nb_module *m);
NB_API nb_gpt_config nb_gpt_get_config(nb_module *gpt);
/* The generator of every dropout mask of the model, owned by it (in its
 * context): save and restore it with a training checkpoint, and set it per
 * rank when ranks should draw different masks. It starts as the state of
 * `rng` (or of the default generator) after initialisation. */
NB_API nb_rng *nb_gpt_dropout_rng(nb_module *gpt);

/* idx (N, T) of i32/i64 token ids, 1 <= T <= block_size -> logits
 * (N, T, V). nb_module_forward(gpt, ctx, idx) does the same. */
NB_API nb_tensor *nb_gpt_forward(nb_module *gpt, nb_ctx *ctx, nb_tensor *idx);
/* Recomputation of every block (nb_module_set_recompute): a block keeps
 * its input only and runs again during backward; same gradients, a lower
 * peak, about a third more compute (train_gpt --recompute). */
NB_API void nb_gpt_set_recompute(nb_module *gpt, bool on);
/* Recomputation of each MLP's GELU output (default off): the step keeps
 * the MLP's pre-activation only, and c_proj's backward runs GELU on it
 * again for its weight's gradient (one elementwise kernel per layer);
 * (N, T, 4C) less kept per layer. The same loss and gradients where the
 * forward's GELU output is GELU of the kept pre-activation (the CPU); on
 * CUDA under bf16 c_proj's weight gradient differs by the rounding of the
 * pre-activation (Note [GELU recomputed in backward] in
 * tensor/ops_matmul.c). Composes with
 * nb_gpt_set_recompute, dropout and FSDP units (train_gpt
 * --recompute-gelu). */
NB_API void nb_gpt_set_recompute_gelu(nb_module *gpt, bool on);
/* Mean next-token cross-entropy: logits (N, T, V) against targets (N, T). */
NB_API nb_tensor *nb_gpt_loss(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets);
/* nb_gpt_loss(nb_gpt_forward(idx), targets) without handing the logits to
 * the caller: they are the library's, so their gradient is written over
 * them in backward (on the CPU) and the step needs one (N, T, V) tensor
 * less (Note [Memory given back] in tensor/memory.c). */
NB_API nb_tensor *nb_gpt_forward_loss(nb_module *gpt, nb_ctx *ctx, nb_tensor *idx,
                                      nb_tensor *targets);

/* Parameter elements without the position embedding (GPT-2's custom of
 * counting), and FLOPs of one training step per token (forward and
 * backward: 6 N + 12 L T C, the attention term for sequence length T). */
NB_API int64_t nb_gpt_num_params_non_embedding(nb_module *gpt);
NB_API double nb_gpt_flops_per_token(nb_module *gpt, int64_t seq_len);

/* The memory a training step of the GPT cannot do without, in bytes, from
 * its shape: its parameters, their gradients, `optim_states` tensors of
 * optimizer state per parameter (AdamW: 2, SGD with momentum: 1), the
 * tensors its ops keep for backward at batch (N, T) (per block: the
 * block's input, the layer norms' outputs and statistics, qkv, the
 * attention's output, the MLP's pre-activation and activation; then the
 * final layer norm's; not the attention's probabilities (N, H, T, T),
 * which a fused attention makes again in backward), and the
 * logits (N, T, V). Activations in the parameters' dtype; dropout masks
 * (dropout > 0) are not counted. A step context's peak is this floor's
 * `saved + logits` plus the working set of the op running at the peak
 * (the logits' gradient, at the start of backward): Note [Memory given
 * back] in tensor/memory.c, docs/design.md. */
typedef struct nb_memory_floor {
    size_t params, grads, optim_state; /* in the model's context */
    size_t saved;                      /* what backward needs, in the step's */
    size_t logits;                     /* the logits, in the step's */
} nb_memory_floor;
NB_API nb_memory_floor nb_gpt_memory_floor(nb_module *gpt, int64_t batch, int64_t seq_len,
                                    int optim_states);
/* Sum of every field. */
NB_API size_t nb_memory_floor_total(const nb_memory_floor *f);

/* ---- sampling ---- */
typedef struct nb_sample_opts {
    double temperature; /* > 0; 0: always the most likely token */
    int top_k;          /* > 0: sample among the k most likely; 0: all */
} nb_sample_opts;
#define NB_SAMPLE_DEFAULTS ((nb_sample_opts){.temperature = 1.0, .top_k = 0})

/* One index in [0, n) drawn from softmax(logits / temperature) with one
 * Philox counter of rng (NULL: the default generator), which then advances
 * by one. Top-k keeps every logit at least the k-th largest (ties
 * included). Temperature 0 returns the first largest logit and draws
 * nothing. */
NB_API int64_t nb_sample_logits(const double *logits, int64_t n, const nb_sample_opts *opts,
                         nb_rng *rng);

/* Extends tokens[0 .. n_prompt) (n_prompt >= 1) to tokens[0 .. n_total),
 * one token at a time, each conditioned on the last block_size tokens.
 * Runs without recording gradients and in evaluation mode (the module's
 * mode is restored afterwards). `scratch` is a step context on the model's
 * device; it is reset before each token. opts NULL: the defaults. */
NB_API void nb_gpt_generate(nb_module *gpt, nb_ctx *scratch, int64_t *tokens, int64_t n_prompt,
                     int64_t n_total, const nb_sample_opts *opts, nb_rng *rng);

/* ------------------------------------------------------------ classifiers */
/* A multilayer perceptron: Linear(F, hidden[0]), ReLU, ..., Linear(hidden[n-1], K)
 * in a Sequential (names "0.weight", "0.bias", "2.weight", ...), PyTorch's
 * default initialisation. n_hidden may be 0 (logistic regression).
 * x (N, F) -> logits (N, K). */
NB_API nb_module *nb_mlp_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_features, int n_hidden,
                      const int64_t *hidden, int64_t n_classes, nb_rng *rng);

/* A small CNN for (N, C_in, H, W) images: n_blocks blocks
 * "blocks.<i>.conv" Conv2d 3x3, padding 1, no bias -> "blocks.<i>.bn"
 * BatchNorm2d -> ReLU, each block but the last followed by 2x2 max pooling
 * (when the map is still at least 2x2), then global average pooling,
 * flatten and a Linear "head" (channels[n-1] -> K). The BatchNorms are
 * ordinary BatchNorm2d modules, so nb_convert_sync_batchnorm (nabla/ddp.h)
 * turns them into SyncBatchNorm. */
NB_API nb_module *nb_cnn_new(nb_ctx *ctx, nb_dtype dtype, int64_t in_channels, int n_blocks,
                      const int64_t *channels, int64_t n_classes, nb_rng *rng);

#ifdef __cplusplus
}
#endif
#endif
