/* The bundled models: GPT's parameter names against GPT-2's key list, the
 * tied head, GPT-2's initialisation statistics, the forward against a naive
 * double-precision GPT written from the architecture's definition,
 * causality, a gradcheck through the whole model (tied weight included),
 * dropout's generator, the loss, the size figures, sampling (argmax, top-k,
 * frequencies against softmax) and generation; the MLP and the CNN (names,
 * shapes, values against hand-written forwards, BatchNorm conversion) and
 * every constructor error. Letters: N batch, T positions, V vocabulary,
 * C width, L layers, H heads, D = C / H. */
#define _DEFAULT_SOURCE /* M_PI */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/internal.h"
#include "testutil.h"

static double *host(const nb_tensor *t) {
    double *v = malloc(sizeof(double) * (size_t)(nb_numel(t) ? nb_numel(t) : 1));
    nb_to_host_f64(t, v);
    return v;
}

static double *param(nb_module *m, const char *name) {
    nb_tensor *t = nb_module_find(m, name);
    ck_assert_msg(t, "no parameter %s", name);
    return host(t);
}

/* Every parameter (biases, LayerNorms included) redrawn from N(0, std), so
 * that the comparison exercises every term. */
static void scramble(nb_module *m, double std, uint64_t seed) {
    nb_rng r = nb_rng_make(seed);
    nb_named_tensor p[256];
    int n = nb_module_named_parameters(m, p, 256);
    ck_assert_int_le(n, 256);
    for (int i = 0; i < n; i++) nb_init_normal_(p[i].tensor, 0.0, std, &r);
}

/* ------------------------------------------------- a naive GPT in double */
/* out (rows, o) = x (rows, in) w^T (w is (o, in)) + b */
static void ref_linear(double *out, const double *x, const double *w, const double *b,
                       int64_t rows, int64_t in, int64_t o) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < o; j++) {
            double s = b ? b[j] : 0;
            for (int64_t i = 0; i < in; i++) s += x[r * in + i] * w[j * in + i];
            out[r * o + j] = s;
        }
}

/* logits (T, V) of one sequence tok[0..T) */
static void ref_gpt(double *logits, nb_module *g, const int64_t *tok, int64_t t) {
    nb_gpt_config cfg = nb_gpt_get_config(g);
    int64_t c = cfg.n_embd, v = cfg.vocab_size, h = cfg.n_head, d = c / h;
    double *wte = param(g, "transformer.wte.weight"), *wpe = param(g, "transformer.wpe.weight");
    double *x = malloc(sizeof(double) * (size_t)(t * c)), *a = malloc(sizeof(double) * (size_t)(t * c));
    double *qkv = malloc(sizeof(double) * (size_t)(t * 3 * c)), *y = malloc(sizeof(double) * (size_t)(t * c));
    double *f = malloc(sizeof(double) * (size_t)(t * 4 * c)), *o = malloc(sizeof(double) * (size_t)(t * c));
    double *p = malloc(sizeof(double) * (size_t)t);
    for (int64_t i = 0; i < t; i++)
        for (int64_t k = 0; k < c; k++) x[i * c + k] = wte[tok[i] * c + k] + wpe[i * c + k];
    for (int l = 0; l < cfg.n_layer; l++) {
        char name[128];
#define P(field) (snprintf(name, sizeof name, "transformer.h.%d.%s", l, field), param(g, name))
        double *ln1w = P("ln_1.weight"), *ln1b = P("ln_1.bias"), *wa = P("attn.c_attn.weight"),
               *ba = P("attn.c_attn.bias"), *wp = P("attn.c_proj.weight"), *bp = P("attn.c_proj.bias"),
               *ln2w = P("ln_2.weight"), *ln2b = P("ln_2.bias"), *wf = P("mlp.c_fc.weight"),
               *bf = P("mlp.c_fc.bias"), *wm = P("mlp.c_proj.weight"), *bm = P("mlp.c_proj.bias");
#undef P
        nbt_ref_layer_norm(a, x, ln1w, ln1b, t, c, 1e-5);
        ref_linear(qkv, a, wa, ba, t, c, 3 * c);
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t i = 0; i < t; i++) {
                double mx = -INFINITY, z = 0;
                for (int64_t j = 0; j <= i; j++) {
                    double s = 0;
                    for (int64_t e = 0; e < d; e++)
                        s += qkv[i * 3 * c + hh * d + e] * qkv[j * 3 * c + c + hh * d + e];
                    p[j] = s / sqrt((double)d);
                    mx = fmax(mx, p[j]);
                }
                for (int64_t j = 0; j <= i; j++) z += p[j] = exp(p[j] - mx);
                for (int64_t e = 0; e < d; e++) {
                    double s = 0;
                    for (int64_t j = 0; j <= i; j++) s += p[j] / z * qkv[j * 3 * c + 2 * c + hh * d + e];
                    y[i * c + hh * d + e] = s;
                }
            }
        ref_linear(o, y, wp, bp, t, c, c);
        for (int64_t i = 0; i < t * c; i++) x[i] += o[i];
        nbt_ref_layer_norm(a, x, ln2w, ln2b, t, c, 1e-5);
        ref_linear(f, a, wf, bf, t, c, 4 * c);
        for (int64_t i = 0; i < t * 4 * c; i++) {
            double u = f[i];
            f[i] = 0.5 * u * (1 + tanh(sqrt(2 / M_PI) * (u + 0.044715 * u * u * u)));
        }
        ref_linear(o, f, wm, bm, t, 4 * c, c);
        for (int64_t i = 0; i < t * c; i++) x[i] += o[i];
        free(ln1w), free(ln1b), free(wa), free(ba), free(wp), free(bp);
        free(ln2w), free(ln2b), free(wf), free(bf), free(wm), free(bm);
    }
    double *lnw = param(g, "transformer.ln_f.weight"), *lnb = param(g, "transformer.ln_f.bias");
    nbt_ref_layer_norm(a, x, lnw, lnb, t, c, 1e-5);
    ref_linear(logits, a, wte, NULL, t, c, v); /* the head is the token embedding */
    free(lnw), free(lnb), free(wte), free(wpe);
    free(x), free(a), free(qkv), free(y), free(f), free(o), free(p);
}

static const nb_gpt_config tiny = {11, 6, 2, 2, 8, 0.0};

/* ------------------------------------------------------------------ GPT */
NBT_CPU_TEST(test_gpt_names) {
    nb_gpt_config cfg = {13, 7, 2, 2, 8, 0.0};
    nb_module *g = nb_gpt_new(ctx, NB_F32, &cfg, NULL);
    /* GPT-2's keys in its own order, minus the tied lm_head.weight */
    const char *per_layer[] = {"ln_1.weight",       "ln_1.bias",        "attn.c_attn.weight",
                               "attn.c_attn.bias",  "attn.c_proj.weight", "attn.c_proj.bias",
                               "ln_2.weight",       "ln_2.bias",        "mlp.c_fc.weight",
                               "mlp.c_fc.bias",     "mlp.c_proj.weight", "mlp.c_proj.bias"};
    const int64_t c = 8, shapes[12][2] = {{c, 0}, {c, 0},     {3 * c, c}, {3 * c, 0},
                                          {c, c}, {c, 0},     {c, 0},     {c, 0},
                                          {4 * c, c}, {4 * c, 0}, {c, 4 * c}, {c, 0}};
    char want[64][64];
    int64_t want_shape[64][2];
    int k = 0;
    snprintf(want[k], 64, "transformer.wte.weight"), want_shape[k][0] = 13, want_shape[k++][1] = c;
    snprintf(want[k], 64, "transformer.wpe.weight"), want_shape[k][0] = 7, want_shape[k++][1] = c;
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < 12; i++) {
            snprintf(want[k], 64, "transformer.h.%d.%s", l, per_layer[i]);
            want_shape[k][0] = shapes[i][0], want_shape[k++][1] = shapes[i][1];
        }
    snprintf(want[k], 64, "transformer.ln_f.weight"), want_shape[k][0] = c, want_shape[k++][1] = 0;
    snprintf(want[k], 64, "transformer.ln_f.bias"), want_shape[k][0] = c, want_shape[k++][1] = 0;

    nb_named_tensor p[64];
    int n = nb_module_named_parameters(g, p, 64);
    ck_assert_int_eq(n, k);
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(p[i].name, want[i]);
        const nb_tensor *t = p[i].tensor;
        ck_assert_int_eq(t->ndim, want_shape[i][1] ? 2 : 1);
        ck_assert_int_eq(t->shape[0], want_shape[i][0]);
        if (want_shape[i][1]) ck_assert_int_eq(t->shape[1], want_shape[i][1]);
    }
    ck_assert_int_eq(nb_module_state(g, NULL, 0), k); /* no buffers, the head not repeated */
    ck_assert_int_eq(nb_module_named_buffers(g, NULL, 0), 0);
    ck_assert_ptr_eq(nb_module_find(g, "lm_head.weight"), nb_module_find(g, "transformer.wte.weight"));
    /* V C + B C + L (12 C^2 + 13 C) + 2 C, the tied head counted once */
    ck_assert_int_eq(nb_module_num_params(g), 13 * c + 7 * c + 2 * (12 * c * c + 13 * c) + 2 * c);
    ck_assert_int_eq(nb_gpt_num_params_non_embedding(g), nb_module_num_params(g) - 7 * c);
    ck_assert(nb_gpt_is(g));
    ck_assert(!nb_gpt_is(nb_module_child(g, "transformer")));
    ck_assert_str_eq(nb_module_type_name(nb_module_child(g, "transformer.h.1")), "Block");
}

NBT_CPU_TEST(test_gpt_print) {
    nb_gpt_config cfg = {13, 7, 1, 2, 8, 0.1};
    nb_module *g = nb_gpt_new(ctx, NB_F32, &cfg, NULL);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_module_fprint(f, g);
    fclose(f);
    ck_assert_msg(strstr(buf, "GPT(\n  vocab_size=13, block_size=7, n_layer=1, n_head=2, n_embd=8, "
                              "dropout=0.1\n  (transformer): ModuleDict(\n    (wte): Embedding(13, 8)\n"),
                  "%s", buf);
    ck_assert_msg(strstr(buf, "(lm_head): LMHead(tied to transformer.wte.weight)"), "%s", buf);
    ck_assert_msg(strstr(buf, "(mlp): MLP(\n          (c_fc): Linear(in_features=8, out_features=32"),
                  "%s", buf);
    free(buf);
}

NBT_CPU_TEST(test_gpt_init) {
    nb_gpt_config cfg = {256, 64, 4, 4, 64, 0.0};
    nb_rng r = nb_rng_make(5);
    nb_module *g = nb_gpt_new(ctx, NB_F32, &cfg, &r);
    nb_named_tensor p[64];
    int n = nb_module_named_parameters(g, p, 64);
    for (int i = 0; i < n; i++) {
        int64_t m = nb_numel(p[i].tensor);
        double *v = host(p[i].tensor), s = 0, ss = 0;
        for (int64_t j = 0; j < m; j++) s += v[j], ss += v[j] * v[j];
        double mean = s / (double)m, sd = sqrt(ss / (double)m - mean * mean);
        const char *name = p[i].name;
        if (strstr(name, ".ln_")) {
            bool weight = strstr(name, ".weight") != NULL;
            for (int64_t j = 0; j < m; j++) ck_assert_double_eq(v[j], weight ? 1.0 : 0.0);
        } else if (strstr(name, ".bias")) {
            for (int64_t j = 0; j < m; j++) ck_assert_double_eq(v[j], 0.0);
        } else {
            /* 0.02, or 0.02 / sqrt(2 L) = 0.00707 for the residual projections */
            double want = strstr(name, "c_proj.weight") ? 0.02 / sqrt(8.0) : 0.02;
            ck_assert_msg(fabs(sd - want) < 0.06 * want && fabs(mean) < 4 * want / sqrt((double)m),
                          "%s: mean %g sd %g, want sd %g", name, mean, sd, want);
        }
        free(v);
    }
    /* the same seed gives the same model; the generator moved on */
    ck_assert_uint_ne(r.offset, 0);
    nb_rng r2 = nb_rng_make(5);
    nb_module *g2 = nb_gpt_new(ctx, NB_F32, &cfg, &r2);
    nb_named_tensor p2[64];
    nb_module_named_parameters(g2, p2, 64);
    for (int i = 0; i < n; i++) nbt_assert_tensors_close(p[i].tensor, p2[i].tensor, 0, 0);
    ck_assert_uint_eq(r.offset, r2.offset);
    /* the dropout generator starts where initialisation left rng */
    ck_assert_uint_eq(nb_gpt_dropout_rng(g)->seed, 5);
    ck_assert_uint_eq(nb_gpt_dropout_rng(g)->offset, r.offset);
}

NBT_CPU_TEST(test_gpt_values) {
    const nb_dtype dtypes[2] = {NB_F64, NB_F32};
    for (int di = 0; di < 2; di++) {
        nb_module *g = nb_gpt_new(ctx, dtypes[di], &tiny, NULL);
        scramble(g, 0.5, 17);
        const int64_t n = 2, t = 5, v = tiny.vocab_size;
        int64_t tok[10] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
        nb_tensor *logits = nb_gpt_forward(g, ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(n, t), tok));
        ck_assert_int_eq(logits->ndim, 3);
        ck_assert_int_eq(logits->shape[2], v);
        double *want = malloc(sizeof(double) * (size_t)(n * t * v));
        for (int64_t b = 0; b < n; b++) ref_gpt(want + b * t * v, g, tok + b * t, t);
        nbt_assert_close(logits, want, di == 0 ? 1e-10 : 2e-4, di == 0 ? 1e-10 : 2e-4);
        /* nb_module_forward is the same function; i32 ids give the same */
        int32_t tok32[10];
        for (int i = 0; i < 10; i++) tok32[i] = (int32_t)tok[i];
        nb_tensor *again = nb_module_forward(g, ctx, nb_from_host(ctx, NB_I32, NB_SHAPE(n, t), tok32));
        nbt_assert_tensors_close(again, logits, 0, 0);
        free(want);
    }
}

NBT_CPU_TEST(test_gpt_causal) {
    nb_module *g = nb_gpt_new(ctx, NB_F64, &tiny, NULL);
    scramble(g, 0.5, 3);
    int64_t a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 2, 3, 9, 0, 10};
    double *la = host(nb_gpt_forward(g, ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(1, 6), a)));
    double *lb = host(nb_gpt_forward(g, ctx, nb_from_host(ctx, NB_I64, NB_SHAPE(1, 6), b)));
    int64_t v = tiny.vocab_size;
    for (int64_t i = 0; i < 3 * v; i++) ck_assert_double_eq(la[i], lb[i]);
    bool differs = false;
    for (int64_t i = 3 * v; i < 6 * v; i++) differs |= la[i] != lb[i];
    ck_assert(differs);
    free(la), free(lb);
}

typedef struct gpt_case {
    nb_module *g;
    nb_tensor *idx, *targets;
} gpt_case;

/* The parameters are the inputs: gradcheck perturbs them in place. */
static nb_tensor *gpt_loss_fn(nb_ctx *ctx, nb_tensor *const *inputs, void *user) {
    gpt_case *c = user;
    return nb_gpt_loss(ctx, nb_gpt_forward(c->g, ctx, c->idx), c->targets);
}

/* The gradcheck of a small f64 GPT, its parameters scrambled with seed,
 * optionally with each MLP's GELU output made again in backward. */
static void gpt_gradcheck(nb_ctx *ctx, bool recompute_gelu, uint64_t seed) {
    nb_gpt_config cfg = {7, 4, 2, 2, 4, 0.0};
    nb_module *g = nb_gpt_new(ctx, NB_F64, &cfg, NULL);
    nb_gpt_set_recompute_gelu(g, recompute_gelu);
    scramble(g, 0.4, seed);
    int64_t x[6] = {1, 6, 2, 0, 3, 3}, y[6] = {6, 2, 0, 4, 3, 5};
    gpt_case c = {g, nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), x),
                  nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), y)};
    nb_named_tensor p[64];
    int n = nb_module_named_parameters(g, p, 64);
    nb_tensor *inputs[64];
    for (int i = 0; i < n; i++) inputs[i] = p[i].tensor;
    NBT_GRADCHECK(gpt_loss_fn, &c, n, inputs);
}

NBT_CPU_TEST(test_gpt_gradcheck) { gpt_gradcheck(ctx, false, 11); }

/* Note [GELU recomputed in backward] (tensor/ops_matmul.c): the same
 * gradcheck with each MLP's GELU output made again in c_proj's backward
 * (the recomputing node is checked against f64 central differences). */
NBT_CPU_TEST(test_gpt_gradcheck_recompute_gelu) { gpt_gradcheck(ctx, true, 12); }

/* One training step of a small GPT (forward, loss, backward) under compute
 * dtype cd: the loss and every parameter's gradient, raw f32 values in
 * parameter order. dropout: the model's probability (training mode);
 * block: nb_gpt_set_recompute; gelu: nb_gpt_set_recompute_gelu. */
typedef struct gpt_grads {
    float loss;
    float *g;
    int64_t n;
} gpt_grads;

static gpt_grads gpt_step_grads(nb_dtype cd, double dropout, bool block, bool gelu) {
    nb_gpt_config cfg = {61, 16, 2, 2, 16, dropout};
    enum { N = 3, T = 16 };
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(step, cd);
    nb_rng rng = nb_rng_make(21);
    nb_module *g = nb_gpt_new(pctx, NB_F32, &cfg, &rng);
    nb_gpt_set_recompute(g, block);
    nb_gpt_set_recompute_gelu(g, gelu);
    int64_t x[N * T], y[N * T];
    for (int i = 0; i < N * T; i++) x[i] = (i * 7 + 3) % 61, y[i] = (i * 13 + 5) % 61;
    nb_tensor *loss = nb_gpt_forward_loss(g, step, nb_from_host(step, NB_I64, NB_SHAPE(N, T), x),
                                          nb_from_host(step, NB_I64, NB_SHAPE(N, T), y));
    nb_backward(loss);
    gpt_grads r = {(float)nb_item(loss), NULL, 0};
    nb_named_tensor p[64];
    int np = nb_module_named_parameters(g, p, 64);
    for (int i = 0; i < np; i++) r.n += nb_numel(p[i].tensor);
    r.g = malloc((size_t)r.n * sizeof(float));
    int64_t off = 0;
    for (int i = 0; i < np; i++) {
        ck_assert_msg(p[i].tensor->grad, "%s has no gradient", p[i].name);
        ck_assert_int_eq(p[i].tensor->grad->dtype, NB_F32);
        nb_to_host(p[i].tensor->grad, r.g + off);
        off += nb_numel(p[i].tensor);
    }
    nb_ctx_free(step);
    nb_ctx_free(pctx);
    return r;
}

/* The loss and every gradient bitwise those without recomputing GELU, in
 * f32 and bf16, with the backward's GEMM epilogues (DGELU through the
 * kept pre-activation) on or off, with dropout and with the blocks
 * recomputed too. */
START_TEST(test_gpt_recompute_gelu_bitwise) {
    const nb_dtype cds[2] = {NB_F32, NB_BF16};
    for (int k = 0; k < 2 * 2 * 3; k++) {
        nb_dtype cd = cds[k % 2];
        int epi = k / 2 % 2, variant = k / 4; /* 0 plain, 1 dropout, 2 blocks recomputed */
        double dropout = variant == 1 ? 0.1 : 0.0;
        bool block = variant == 2;
        nb__gemm_epilogues_force(epi);
        gpt_grads plain = gpt_step_grads(cd, dropout, block, false);
        gpt_grads re = gpt_step_grads(cd, dropout, block, true);
        nb__gemm_epilogues_force(-1);
        ck_assert_int_eq(plain.n, re.n);
        ck_assert_msg(memcmp(&plain.loss, &re.loss, sizeof re.loss) == 0,
                      "%s, epilogues %d, variant %d: loss %.9g, %.9g without recomputing GELU",
                      nb_dtype_name(cd), epi, variant, re.loss, plain.loss);
        for (int64_t i = 0; i < re.n; i++)
            ck_assert_msg(memcmp(&plain.g[i], &re.g[i], sizeof(float)) == 0,
                          "%s, epilogues %d, variant %d: gradient element %lld is %.9g, %.9g "
                          "without recomputing GELU", nb_dtype_name(cd), epi, variant,
                          (long long)i, re.g[i], plain.g[i]);
        free(plain.g), free(re.g);
    }
}
END_TEST

NBT_CPU_TEST(test_gpt_loss) {
    nb_tensor *logits = nbt_randn(ctx, NB_F64, NB_SHAPE(2, 3, 5), 1);
    int64_t y[6] = {0, 4, 2, 2, 1, 3};
    nb_tensor *loss = nb_gpt_loss(ctx, logits, nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), y));
    double *l = host(logits), want = 0;
    for (int r = 0; r < 6; r++) {
        double z = 0;
        for (int k = 0; k < 5; k++) z += exp(l[r * 5 + k]);
        want += log(z) - l[r * 5 + y[r]];
    }
    ck_assert_double_eq_tol(nb_item(loss), want / 6, 1e-12);
    NBT_EXPECT_ABORT(nb_gpt_loss(ctx, logits, nb_from_host(ctx, NB_I64, NB_SHAPE(3, 2), y)),
                     "nb_gpt_loss: logits (2, 3, 5) must be (N, T, V) and targets (3, 2) (N, T)");
    free(l);
}

NBT_CPU_TEST(test_gpt_dropout) {
    nb_gpt_config cfg = tiny;
    cfg.dropout = 0.3;
    nb_module *g = nb_gpt_new(ctx, NB_F64, &cfg, NULL);
    scramble(g, 0.5, 2);
    int64_t tok[5] = {1, 2, 3, 4, 5};
    nb_tensor *idx = nb_from_host(ctx, NB_I64, NB_SHAPE(1, 5), tok);
    *nb_gpt_dropout_rng(g) = nb_rng_make(99);
    nb_tensor *a = nb_gpt_forward(g, ctx, idx);
    ck_assert_uint_gt(nb_gpt_dropout_rng(g)->offset, 0);
    nb_tensor *b = nb_gpt_forward(g, ctx, idx); /* new masks */
    *nb_gpt_dropout_rng(g) = nb_rng_make(99);
    nb_tensor *a2 = nb_gpt_forward(g, ctx, idx); /* the same masks again */
    nbt_assert_tensors_close(a2, a, 0, 0);
    double *va = host(a), *vb = host(b);
    bool differs = false;
    for (int64_t i = 0; i < nb_numel(a); i++) differs |= va[i] != vb[i];
    ck_assert(differs);
    /* evaluation mode: no dropout, the reference values */
    nb_module_eval(g);
    uint64_t off = nb_gpt_dropout_rng(g)->offset;
    double *want = malloc(sizeof(double) * 5 * 11);
    ref_gpt(want, g, tok, 5);
    nbt_assert_close(nb_gpt_forward(g, ctx, idx), want, 1e-10, 1e-10);
    ck_assert_uint_eq(nb_gpt_dropout_rng(g)->offset, off);
    free(va), free(vb), free(want);
}

NBT_CPU_TEST(test_gpt_flops) {
    nb_module *g = nb_gpt_new(ctx, NB_F32, &tiny, NULL);
    double n = (double)nb_gpt_num_params_non_embedding(g);
    ck_assert_double_eq(nb_gpt_flops_per_token(g, 4), 6 * n + 12.0 * 2 * 4 * 8);
    NBT_EXPECT_ABORT(nb_gpt_flops_per_token(g, 7),
                     "nb_gpt_flops_per_token: seq_len 7 must be in [1, block_size 6]");
}

NBT_CPU_TEST(test_gpt_errors) {
    nb_gpt_config c = tiny;
    c.n_embd = 9;
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_F32, &c, NULL),
                     "nb_gpt_new: n_embd 9 must be a positive multiple of n_head 2");
    c = tiny, c.vocab_size = 0;
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_F32, &c, NULL), "nb_gpt_new: vocab_size 0 must be positive");
    c = tiny, c.block_size = -1;
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_F32, &c, NULL), "nb_gpt_new: block_size -1 must be positive");
    c = tiny, c.n_layer = 0;
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_F32, &c, NULL), "nb_gpt_new: n_layer 0 must be positive");
    c = tiny, c.dropout = 1;
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_F32, &c, NULL), "nb_gpt_new: dropout 1 must be in [0, 1)");
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_BF16, &tiny, NULL),
                     "nb_gpt_new: dtype bf16; the model computes in f32 or f64");
    NBT_EXPECT_ABORT(nb_gpt_new(ctx, NB_F32, NULL, NULL), "nb_gpt_new: config is NULL");
    nb_module *g = nb_gpt_new(ctx, NB_F32, &tiny, NULL);
    NBT_EXPECT_ABORT(nb_gpt_forward(g, ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(2, 7))),
                     "GPT: sequence length 7 must be in [1, block_size 6]");
    NBT_EXPECT_ABORT(nb_gpt_forward(g, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3))),
                     "GPT: token ids must be (N, T) of i32 or i64, got (2, 3) of f32");
    NBT_EXPECT_ABORT(nb_gpt_forward(g, ctx, nb_zeros(ctx, NB_I64, NB_SHAPE(6))),
                     "GPT: token ids must be (N, T) of i32 or i64, got (6,) of i64");
    NBT_EXPECT_ABORT(nb_gpt_forward(g, ctx, nb_full(ctx, NB_I64, NB_SHAPE(1, 2), 11)),
                     "index 11 at position 0 is out of range for 11 rows");
    nb_module *lin = nb_linear_new(ctx, NB_F32, 2, 2, true, NULL);
    NBT_EXPECT_ABORT(nb_gpt_get_config(lin), "Linear");
    int64_t tok[2] = {0, 1};
    NBT_EXPECT_ABORT(nb_gpt_generate(lin, ctx, tok, 1, 2, NULL, NULL),
                     "nb_gpt_generate: the module is a Linear, not a GPT");
    NBT_EXPECT_ABORT(nb_gpt_generate(g, ctx, tok, 0, 2, NULL, NULL),
                     "nb_gpt_generate: need 1 <= n_prompt (0) <= n_total (2)");
    tok[0] = 12;
    NBT_EXPECT_ABORT(nb_gpt_generate(g, ctx, tok, 1, 2, NULL, NULL),
                     "nb_gpt_generate: prompt token 12 at position 0 is outside [0, 11)");
}

/* The GPT's input embedding is one fused op (nb__embedding_pos) unless
 * something acts on wte's or wpe's forward; both ways a bad token index is
 * named by the module that owns it, and a unit hook on the token table runs
 * (the fused path is not taken then) with the same values. */
typedef struct counting_unit {
    int calls;
} counting_unit;

static nb_tensor *counting_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x, void *user) {
    ((counting_unit *)user)->calls++;
    return nb__module_forward_own(m, ctx, x);
}

NBT_CPU_TEST(test_gpt_input_embedding_paths) {
    nb_module *g = nb_gpt_new(ctx, NB_F32, &tiny, NULL);
    nb_module_eval(g);
    nb_tensor *idx = nb_from_host(ctx, NB_I64, NB_SHAPE(2, 3), (int64_t[]){0, 3, 10, 7, 7, 1});
    nb_tensor *bad = nb_from_host(ctx, NB_I64, NB_SHAPE(1, 2), (int64_t[]){4, 11});
    const char *want = "transformer.wte (Embedding): nb_embedding: index 11 at position 1 is out "
                       "of range for 11 rows";
    /* fused */
    nb_tensor *fused = nb_gpt_forward(g, ctx, idx);
    NBT_EXPECT_ABORT(nb_gpt_forward(g, ctx, bad), want);
    char fused_msg[sizeof nbt_abort_msg];
    snprintf(fused_msg, sizeof fused_msg, "%s", nbt_abort_msg);
    /* through wte's module forward, its unit hook run */
    counting_unit count = {0};
    nb__unit_hook hook = {counting_forward, &count};
    nb__module_set_unit(nb_module_child(g, "transformer.wte"), &hook);
    nb_tensor *unfused = nb_gpt_forward(g, ctx, idx);
    ck_assert_int_eq(count.calls, 1);
    nbt_assert_tensors_close(unfused, fused, 0, 0);
    NBT_EXPECT_ABORT(nb_gpt_forward(g, ctx, bad), want);
    ck_assert_int_eq(count.calls, 2);
    ck_assert_str_eq(nbt_abort_msg, fused_msg);
    /* a hook on the position table alone is run as well */
    nb__module_set_unit(nb_module_child(g, "transformer.wte"), NULL);
    nb__module_set_unit(nb_module_child(g, "transformer.wpe"), &hook);
    nbt_assert_tensors_close(nb_gpt_forward(g, ctx, idx), fused, 0, 0);
    ck_assert_int_eq(count.calls, 3);
    nb__module_set_unit(nb_module_child(g, "transformer.wpe"), NULL);
    /* the fused op refuses a module something acts on */
    nb__module_set_unit(nb_module_child(g, "transformer.wte"), &hook);
    NBT_EXPECT_ABORT(nb__module_forward_fused(nb_module_child(g, "transformer.wte"), ctx, NULL, NULL),
                     "nb__module_forward_fused: the Embedding's forward is run by a sharding unit or "
                     "recomputed; call nb_module_forward");
    nb__module_set_unit(nb_module_child(g, "transformer.wte"), NULL);
}

/* ------------------------------------------------------------- sampling */
START_TEST(test_sample_argmax_topk) {
    double l[5] = {0.5, 2.0, -1.0, 2.0, 1.9};
    nb_rng r = nb_rng_make(1);
    nb_sample_opts greedy = {0.0, 0};
    ck_assert_int_eq(nb_sample_logits(l, 5, &greedy, &r), 1);
    ck_assert_uint_eq(r.offset, 0); /* temperature 0 draws nothing */
    nb_sample_opts top1 = {1.0, 1}, top2 = {5.0, 2};
    int seen[5] = {0};
    for (int i = 0; i < 400; i++) {
        int64_t k = nb_sample_logits(l, 5, &top1, &r);
        ck_assert(k == 1 || k == 3); /* ties with the largest are kept */
        seen[nb_sample_logits(l, 5, &top2, &r)]++;
    }
    ck_assert_uint_eq(r.offset, 800);
    ck_assert_int_eq(seen[0] + seen[2] + seen[4], 0);
    ck_assert(seen[1] > 100 && seen[3] > 100);
    NBT_EXPECT_ABORT(nb_sample_logits(l, 0, NULL, &r), "nb_sample_logits: need n > 0 logits, got 0");
    nb_sample_opts bad = {-1, 0};
    NBT_EXPECT_ABORT(nb_sample_logits(l, 5, &bad, &r),
                     "nb_sample_logits: temperature -1 must be finite and >= 0");
    bad = (nb_sample_opts){1, -2};
    NBT_EXPECT_ABORT(nb_sample_logits(l, 5, &bad, &r), "nb_sample_logits: top_k -2 must be >= 0");
    double inf[2] = {INFINITY, 0};
    NBT_EXPECT_ABORT(nb_sample_logits(inf, 2, NULL, &r), "nb_sample_logits: the largest logit is inf");
}
END_TEST

/* Frequencies of 40000 draws against softmax(l / temperature): each within
 * 5 standard deviations of its expected count. */
START_TEST(test_sample_frequencies) {
    const double l[4] = {1.0, 0.0, -0.5, 2.0};
    const double temps[2] = {1.0, 0.5};
    for (int ti = 0; ti < 2; ti++) {
        nb_rng r = nb_rng_make(7 + (uint64_t)ti);
        nb_sample_opts o = {temps[ti], 0};
        const int draws = 40000;
        int count[4] = {0};
        for (int i = 0; i < draws; i++) count[nb_sample_logits(l, 4, &o, &r)]++;
        double z = 0;
        for (int k = 0; k < 4; k++) z += exp(l[k] / temps[ti]);
        for (int k = 0; k < 4; k++) {
            double p = exp(l[k] / temps[ti]) / z, mu = draws * p, sd = sqrt(draws * p * (1 - p));
            ck_assert_msg(fabs(count[k] - mu) < 5 * sd, "T %g token %d: %d draws, expected %.0f",
                          temps[ti], k, count[k], mu);
        }
    }
}
END_TEST

START_TEST(test_generate) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *scratch = nb_ctx_new(nb_cpu(), 0);
    nb_module *g = nb_gpt_new(ctx, NB_F64, &tiny, NULL);
    scramble(g, 0.7, 23);
    /* greedy: each token is the argmax of the reference logits of the last
     * block_size (6) tokens, also past the block size */
    int64_t tok[12] = {4, 2}, want[12] = {4, 2};
    nb_sample_opts greedy = {0, 0};
    nb_gpt_generate(g, scratch, tok, 2, 12, &greedy, NULL);
    double logits[6 * 11];
    for (int64_t pos = 2; pos < 12; pos++) {
        int64_t len = pos < 6 ? pos : 6;
        ref_gpt(logits, g, want + pos - len, len);
        int64_t best = 0;
        for (int64_t k = 1; k < 11; k++)
            if (logits[(len - 1) * 11 + k] > logits[(len - 1) * 11 + best]) best = k;
        want[pos] = best;
    }
    for (int i = 0; i < 12; i++) ck_assert_int_eq(tok[i], want[i]);
    ck_assert(nb_module_is_training(g)); /* mode restored */
    ck_assert(nb_grad_enabled());
    /* sampling: reproducible from the generator, which advances once per token */
    int64_t s1[10] = {1}, s2[10] = {1};
    nb_rng r1 = nb_rng_make(3), r2 = nb_rng_make(3);
    nb_sample_opts o = {0.8, 5};
    nb_gpt_generate(g, scratch, s1, 1, 10, &o, &r1);
    nb_gpt_generate(g, scratch, s2, 1, 10, &o, &r2);
    for (int i = 0; i < 10; i++) {
        ck_assert_int_eq(s1[i], s2[i]);
        ck_assert(s1[i] >= 0 && s1[i] < 11);
    }
    ck_assert_uint_eq(r1.offset, 9);
    nb_ctx_free(scratch);
    nb_ctx_free(ctx);
}
END_TEST

/* ---------------------------------------------------------- classifiers */
NBT_CPU_TEST(test_mlp) {
    nb_rng r = nb_rng_make(4);
    nb_module *m = nb_mlp_new(ctx, NB_F64, 3, 2, (int64_t[]){5, 4}, 2, &r);
    nb_named_tensor p[8];
    ck_assert_int_eq(nb_module_named_parameters(m, p, 8), 6);
    const char *names[6] = {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"};
    for (int i = 0; i < 6; i++) ck_assert_str_eq(p[i].name, names[i]);
    ck_assert_int_eq(p[2].tensor->shape[0], 4);
    ck_assert_int_eq(p[2].tensor->shape[1], 5);
    /* PyTorch's default: U(+-1/sqrt(fan_in)) */
    double *w0 = host(p[0].tensor);
    for (int i = 0; i < 15; i++) ck_assert(fabs(w0[i]) <= 1 / sqrt(3.0));
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(4, 3), 9);
    double *xv = host(x), h1[4 * 5], h2[4 * 4], out[4 * 2];
    double *w[6];
    for (int i = 0; i < 6; i++) w[i] = host(p[i].tensor);
    ref_linear(h1, xv, w[0], w[1], 4, 3, 5);
    for (int i = 0; i < 20; i++) h1[i] = fmax(h1[i], 0);
    ref_linear(h2, h1, w[2], w[3], 4, 5, 4);
    for (int i = 0; i < 16; i++) h2[i] = fmax(h2[i], 0);
    ref_linear(out, h2, w[4], w[5], 4, 4, 2);
    nbt_assert_close(nb_module_forward(m, ctx, x), out, 1e-12, 1e-12);
    /* no hidden layer: logistic regression */
    nb_module *lr = nb_mlp_new(ctx, NB_F32, 30, 0, NULL, 2, NULL);
    ck_assert_int_eq(nb_module_num_params(lr), 62);
    NBT_EXPECT_ABORT(nb_mlp_new(ctx, NB_F32, 3, 1, (int64_t[]){0}, 2, NULL),
                     "nb_mlp_new: hidden[0] = 0 must be positive");
    NBT_EXPECT_ABORT(nb_mlp_new(ctx, NB_F32, 0, 0, NULL, 2, NULL), "nb_mlp_new: need in_features (0) > 0");
    for (int i = 0; i < 6; i++) free(w[i]);
    free(w0), free(xv);
}

/* The CNN's forward by hand, from nn's tested ops and the parameters. */
static nb_tensor *ref_cnn(nb_ctx *ctx, nb_module *m, nb_tensor *x, int n_blocks) {
    nb_conv2d_opts same = {{1, 1}, {1, 1}, {1, 1}, 1};
    nb_pool2d_opts two = {{2, 2}, {2, 2}, {0, 0}};
    char name[64];
    for (int i = 0; i < n_blocks; i++) {
#define T(field) (snprintf(name, sizeof name, "blocks.%d.%s", i, field), nb_module_find(m, name))
        x = nb_conv2d(ctx, x, T("conv.weight"), NULL, &same);
        x = nb_batch_norm(ctx, x, T("bn.weight"), T("bn.bias"), NULL, NULL, true, 0.1, 1e-5);
#undef T
        x = nb_relu(ctx, x);
        if (i + 1 < n_blocks && x->shape[2] >= 2 && x->shape[3] >= 2) x = nb_max_pool2d(ctx, x, &two);
    }
    x = nb_mean(ctx, x, 2, (int[]){2, 3}, false);
    return nb_add(ctx, nb_matmul_t(ctx, x, nb_module_find(m, "head.weight"), false, true),
                  nb_module_find(m, "head.bias"));
}

NBT_CPU_TEST(test_cnn) {
    nb_module *m = nb_cnn_new(ctx, NB_F64, 1, 3, (int64_t[]){4, 6, 8}, 10, NULL);
    const char *names[] = {"blocks.0.conv.weight", "blocks.0.bn.weight", "blocks.0.bn.bias",
                           "blocks.1.conv.weight", "blocks.1.bn.weight", "blocks.1.bn.bias",
                           "blocks.2.conv.weight", "blocks.2.bn.weight", "blocks.2.bn.bias",
                           "head.weight",          "head.bias"};
    nb_named_tensor p[16];
    ck_assert_int_eq(nb_module_named_parameters(m, p, 16), 11);
    for (int i = 0; i < 11; i++) ck_assert_str_eq(p[i].name, names[i]);
    ck_assert_int_eq(p[3].tensor->shape[0], 6);
    ck_assert_int_eq(p[3].tensor->shape[1], 4);
    ck_assert_int_eq(p[3].tensor->shape[2], 3);
    ck_assert_int_eq(nb_module_named_buffers(m, NULL, 0), 9); /* 3 per BatchNorm */
    ck_assert_ptr_nonnull(nb_module_find(m, "blocks.1.bn.running_var"));
    /* 8x8 -> pool -> 4x4 -> pool -> 2x2 (no pool after the last block) */
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(5, 1, 8, 8), 2);
    nb_tensor *y = nb_module_forward(m, ctx, x);
    ck_assert_int_eq(y->ndim, 2);
    ck_assert_int_eq(y->shape[0], 5);
    ck_assert_int_eq(y->shape[1], 10);
    double *want = host(ref_cnn(ctx, m, x, 3));
    nbt_assert_close(y, want, 1e-12, 1e-12);
    /* a 2x2 image stops pooling at 1x1 */
    nb_tensor *small = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 1, 2, 2), 4);
    double *want2 = host(ref_cnn(ctx, m, small, 3));
    nbt_assert_close(nb_module_forward(m, ctx, small), want2, 1e-12, 1e-12);
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nbt_randn(ctx, NB_F64, NB_SHAPE(2, 3, 8, 8), 1)),
                     "ConvNet: input (2, 3, 8, 8) must be (N, 1, H, W)");
    NBT_EXPECT_ABORT(nb_cnn_new(ctx, NB_F32, 1, 2, (int64_t[]){4, -1}, 10, NULL),
                     "nb_cnn_new: channels[1] = -1 must be positive");
    NBT_EXPECT_ABORT(nb_cnn_new(ctx, NB_F32, 1, 0, NULL, 10, NULL), "nb_cnn_new: need in_channels (1) > 0, n_blocks (0) > 0");
    free(want), free(want2);
}

/* What nb_convert_sync_batchnorm does, with a stand-in for the all-reduced
 * math: every BatchNorm of the CNN is found, converted in place with its
 * tensors and names, and then runs through the replacement. */
typedef struct bn_calls {
    int n;
} bn_calls;

static nb_tensor *counting_bn(nb_ctx *ctx, void *user, nb_tensor *x, nb_tensor *weight,
                              nb_tensor *bias, nb_tensor *running_mean, nb_tensor *running_var,
                              bool training, double momentum, double eps) {
    ((bn_calls *)user)->n++;
    return nb_batch_norm(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps);
}

static int convert_tree(nb_module *m, bn_calls *calls) {
    int n = nb__batch_norm_convert(m, counting_bn, calls) ? 1 : 0;
    for (int i = 0; i < nb_module_num_children(m); i++) n += convert_tree(nb_module_child_at(m, i), calls);
    return n;
}

NBT_CPU_TEST(test_cnn_sync_bn) {
    nb_module *m = nb_cnn_new(ctx, NB_F32, 1, 2, (int64_t[]){4, 8}, 10, NULL);
    nb_named_tensor before[32], after[32];
    int n = nb_module_state(m, before, 32);
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(4, 1, 8, 8), 1);
    nb_tensor *y0 = nb_module_forward(m, ctx, x);
    bn_calls calls = {0};
    ck_assert_int_eq(convert_tree(m, &calls), 2);
    ck_assert_str_eq(nb_module_type_name(nb_module_child(m, "blocks.1.bn")), "SyncBatchNorm");
    ck_assert_int_eq(nb_module_state(m, after, 32), n);
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(after[i].name, before[i].name);
        ck_assert_ptr_eq(after[i].tensor, before[i].tensor);
    }
    nb_tensor *y1 = nb_module_forward(m, ctx, x); /* training mode: batch statistics again */
    ck_assert_int_eq(calls.n, 2);
    nbt_assert_tensors_close(y1, y0, 0, 0);
}

static Suite *suite(void) {
    Suite *s = suite_create("models");
    nbt_suite_add(s, "gpt", 0, (const TTest *[]){test_gpt_names, test_gpt_print, test_gpt_init,
                  test_gpt_values, test_gpt_causal, test_gpt_gradcheck,
                  test_gpt_gradcheck_recompute_gelu, test_gpt_recompute_gelu_bitwise, test_gpt_loss, test_gpt_dropout,
                  test_gpt_flops, test_gpt_errors, test_gpt_input_embedding_paths, NULL});
    nbt_suite_add(s, "sampling", 0, (const TTest *[]){test_sample_argmax_topk, test_sample_frequencies,
                  test_generate, NULL});
    nbt_suite_add(s, "classifiers", 0, (const TTest *[]){test_mlp, test_cnn, test_cnn_sync_bn, NULL});
    return s;
}

int main(void) { return nbt_run(suite()); }
