/* nb_gpt_sample: writes a small GPT's weights as a safetensors file under
 * their GPT-2 names and prints, as JSON on stdout, the configuration, a
 * batch of token ids and the logits nabla computes for them.
 *
 *   nb_gpt_sample OUT.safetensors
 *
 * Every parameter, LayerNorm weights and biases included, is drawn from
 * N(0, 0.3) so that a wrong mapping (a missed transpose, swapped LayerNorms,
 * an untied head) changes the logits. tests/test_gpt_names.py loads the
 * file into a PyTorch GPT-2 and compares. Exit status 0 on success, 1 on a
 * save error (message on stderr), 2 on bad usage. */
#include <stdio.h>
#include <stdlib.h>

#include <nabla/nabla.h>

#define N 2
#define T 7

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: nb_gpt_sample OUT.safetensors\n");
        return 2;
    }
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_gpt_config cfg = {23, 9, 2, 3, 12, 0.0};
    nb_rng rng = nb_rng_make(2024);
    nb_module *gpt = nb_gpt_new(ctx, NB_F32, &cfg, &rng);
    int n = nb_module_state(gpt, NULL, 0);
    nb_named_tensor *state = malloc((size_t)n * sizeof *state);
    nb_module_state(gpt, state, n);
    for (int i = 0; i < n; i++) nb_init_normal_(state[i].tensor, 0.0, 0.3, &rng);

    char v[32], b[32], l[32], h[32], c[32];
    snprintf(v, sizeof v, "%lld", (long long)cfg.vocab_size);
    snprintf(b, sizeof b, "%lld", (long long)cfg.block_size);
    snprintf(l, sizeof l, "%d", cfg.n_layer);
    snprintf(h, sizeof h, "%d", cfg.n_head);
    snprintf(c, sizeof c, "%lld", (long long)cfg.n_embd);
    nb_kv meta[] = {{"format", "pt"}, {"vocab_size", v}, {"block_size", b},
                    {"n_layer", l},   {"n_head", h},     {"n_embd", c}};
    if (nb_checkpoint_save(argv[1], state, n, meta, 6) != NB_OK) {
        fprintf(stderr, "nb_gpt_sample: %s\n", nb_last_error());
        return 1;
    }

    int64_t tokens[N * T];
    for (int i = 0; i < N * T; i++) tokens[i] = (i * 7 + 3) % cfg.vocab_size;
    nb_tensor *logits = nb_gpt_forward(gpt, ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(N, T), tokens));
    int64_t count = nb_numel(logits);
    double *values = malloc((size_t)count * sizeof *values);
    nb_to_host_f64(logits, values);

    printf("{\"config\": {\"vocab_size\": %s, \"block_size\": %s, \"n_layer\": %s, \"n_head\": %s, "
           "\"n_embd\": %s},\n \"tokens\": [", v, b, l, h, c);
    for (int i = 0; i < N; i++) {
        printf("%s[", i ? ", " : "");
        for (int j = 0; j < T; j++) printf("%s%lld", j ? ", " : "", (long long)tokens[i * T + j]);
        printf("]");
    }
    printf("],\n \"logits\": [");
    for (int64_t i = 0; i < count; i++) printf("%s%.9g", i ? ", " : "", values[i]);
    printf("]}\n");
    free(values);
    free(state);
    nb_ctx_free(ctx);
    return 0;
}
