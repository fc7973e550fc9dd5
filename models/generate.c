/* Sampling from a language model: one token from a row of logits
 * (temperature, top-k, one Philox draw), and autoregressive generation with
 * a GPT. There is no key/value cache: each new token runs the model over
 * the last block_size tokens, which is plenty for printing a sample at the
 * end of training. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/autograd.h"
#include "nabla/models.h"
#include "nabla/ops.h"

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* A uniform double in [0, 1) with 53 random bits from one Philox counter. */
static double draw_unit(nb_rng *rng) {
    uint32_t r[4];
    nb_philox4x32(rng->seed, rng->offset++, r);
    uint64_t bits = ((uint64_t)(r[0] >> 5) << 26) | (uint64_t)(r[1] >> 6);
    return (double)bits * (1.0 / 9007199254740992.0);
}

int64_t nb_sample_logits(const double *logits, int64_t n, const nb_sample_opts *opts,
                         nb_rng *rng) {
    nb_sample_opts o = opts ? *opts : NB_SAMPLE_DEFAULTS;
    NB_CHECK(logits && n > 0, "nb_sample_logits: need n > 0 logits, got %lld", (long long)n);
    NB_CHECK(o.temperature >= 0 && isfinite(o.temperature),
             "nb_sample_logits: temperature %g must be finite and >= 0", o.temperature);
    NB_CHECK(o.top_k >= 0, "nb_sample_logits: top_k %d must be >= 0", o.top_k);
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    NB_CHECK(isfinite(logits[best]), "nb_sample_logits: the largest logit is %g", logits[best]);
    if (o.temperature == 0) return best;

    double threshold = -INFINITY;
    if (o.top_k > 0 && o.top_k < n) {
        double *sorted = malloc((size_t)n * sizeof *sorted);
        NB_CHECK(sorted, "nb_sample_logits: out of memory for %lld logits", (long long)n);
        memcpy(sorted, logits, (size_t)n * sizeof *sorted);
        qsort(sorted, (size_t)n, sizeof *sorted, cmp_desc);
        threshold = sorted[o.top_k - 1];
        free(sorted);
    }
    if (!rng) rng = nb_rng_default();
    double total = 0;
    for (int64_t i = 0; i < n; i++)
        if (logits[i] >= threshold) total += exp((logits[i] - logits[best]) / o.temperature);
    double target = draw_unit(rng) * total, cum = 0;
    int64_t last = best;
    for (int64_t i = 0; i < n; i++) {
        if (!(logits[i] >= threshold)) continue;
        double w = exp((logits[i] - logits[best]) / o.temperature);
        if (w <= 0) continue;
        cum += w;
        last = i;
        if (cum > target) return i;
    }
    return last; /* rounding left target at the very top */
}

void nb_gpt_generate(nb_module *gpt, nb_ctx *scratch, int64_t *tokens, int64_t n_prompt,
                     int64_t n_total, const nb_sample_opts *opts, nb_rng *rng) {
    NB_CHECK(nb_gpt_is(gpt), "nb_gpt_generate: the module is a %s, not a GPT",
             gpt ? nb_module_type_name(gpt) : "NULL");
    NB_CHECK(n_prompt >= 1 && n_total >= n_prompt,
             "nb_gpt_generate: need 1 <= n_prompt (%lld) <= n_total (%lld)", (long long)n_prompt,
             (long long)n_total);
    nb_gpt_config cfg = nb_gpt_get_config(gpt);
    for (int64_t i = 0; i < n_prompt; i++)
        NB_CHECK(tokens[i] >= 0 && tokens[i] < cfg.vocab_size,
                 "nb_gpt_generate: prompt token %lld at position %lld is outside [0, %lld)",
                 (long long)tokens[i], (long long)i, (long long)cfg.vocab_size);
    double *row = malloc((size_t)cfg.vocab_size * sizeof *row);
    NB_CHECK(row, "nb_gpt_generate: out of memory for %lld logits", (long long)cfg.vocab_size);
    bool was_training = nb_module_is_training(gpt);
    nb_module_eval(gpt);
    bool prev = nb_no_grad_begin();
    for (int64_t pos = n_prompt; pos < n_total; pos++) {
        nb_ctx_reset(scratch);
        int64_t len = pos < cfg.block_size ? pos : cfg.block_size;
        nb_tensor *idx = nb_from_host(scratch, NB_I64, NB_SHAPE(1, len), tokens + pos - len);
        nb_tensor *logits = nb_gpt_forward(gpt, scratch, idx);           /* (1, len, V) */
        nb_to_host_f64(nb_select(scratch, nb_select(scratch, logits, 0, 0), 0, len - 1), row);
        tokens[pos] = nb_sample_logits(row, cfg.vocab_size, opts, rng);
    }
    nb_no_grad_end(prev);
    nb_module_train(gpt, was_training);
    free(row);
}
