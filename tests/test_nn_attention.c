/* Causal self-attention: the forward against a naive per-batch, per-head,
 * per-position loop in double (f64 and f32, several head counts, with and
 * without biases, with dropout masks reproduced from the Philox stream),
 * the causal property for values and gradients, gradchecks over the input
 * and every parameter (dropout included), parameter names and shapes, and
 * errors. Letters: N batch, T positions, C features, H heads, D = C / H. */
#include <math.h>
#include <stdlib.h>

#include "tensor/internal.h"
#include "testutil.h"

static double *host(const nb_tensor *t) {
    double *v = malloc(sizeof(double) * (size_t)(nb_numel(t) ? nb_numel(t) : 1));
    nb_to_host_f64(t, v);
    return v;
}

/* Dropout masks as Note [Random streams] defines them: element i of a
 * request at offset `off` is kept when lane i % 4 of philox(seed, off + i/4)
 * is >= p; kept elements are scaled by 1 / (1 - p). */
static double keep_scale(uint64_t seed, uint64_t off, int64_t i, double p) {
    if (p == 0) return 1;
    uint32_t r[4];
    nb_philox4x32(seed, off + (uint64_t)i / 4, r);
    return (double)nb_u32_to_unit(r[i % 4]) >= p ? 1 / (1 - p) : 0;
}

typedef struct ref_dropout {
    double p_attn, p_resid;
    uint64_t seed, offset;
} ref_dropout;

/* x (N, T, C); wa (3C, C), ba (3C); wp (C, C), bp (C); biases may be NULL */
static void ref_attention(double *out, const double *x, const double *wa, const double *ba,
                          const double *wp, const double *bp, int64_t n, int64_t t, int64_t c, int h,
                          const ref_dropout *drop) {
    int64_t d = c / h;
    double *qkv = malloc(sizeof(double) * (size_t)(n * t * 3 * c));
    double *y = malloc(sizeof(double) * (size_t)(n * t * c));
    double *p = malloc(sizeof(double) * (size_t)t);
    for (int64_t r = 0; r < n * t; r++)
        for (int64_t o = 0; o < 3 * c; o++) {
            double s = ba ? ba[o] : 0;
            for (int64_t i = 0; i < c; i++) s += x[r * c + i] * wa[o * c + i];
            qkv[r * 3 * c + o] = s;
        }
    uint64_t off_attn = drop ? drop->offset : 0;
    uint64_t off_resid = off_attn + (drop && drop->p_attn > 0 ? (uint64_t)(n * h * t * t + 3) / 4 : 0);
    for (int64_t b = 0; b < n; b++)
        for (int hh = 0; hh < h; hh++)
            for (int64_t i = 0; i < t; i++) {
                const double *q = &qkv[(b * t + i) * 3 * c + hh * d];
                double mx = -INFINITY, z = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double *k = &qkv[(b * t + j) * 3 * c + c + hh * d];
                    double s = 0;
                    for (int64_t e = 0; e < d; e++) s += q[e] * k[e];
                    p[j] = s / sqrt((double)d);
                    mx = fmax(mx, p[j]);
                }
                for (int64_t j = 0; j <= i; j++) z += (p[j] = exp(p[j] - mx));
                for (int64_t j = 0; j <= i; j++) {
                    p[j] /= z;
                    if (drop) p[j] *= keep_scale(drop->seed, off_attn, ((b * h + hh) * t + i) * t + j, drop->p_attn);
                }
                for (int64_t e = 0; e < d; e++) {
                    double s = 0;
                    for (int64_t j = 0; j <= i; j++) s += p[j] * qkv[(b * t + j) * 3 * c + 2 * c + hh * d + e];
                    y[(b * t + i) * c + hh * d + e] = s;
                }
            }
    for (int64_t r = 0; r < n * t; r++)
        for (int64_t o = 0; o < c; o++) {
            double s = bp ? bp[o] : 0;
            for (int64_t i = 0; i < c; i++) s += y[r * c + i] * wp[o * c + i];
            if (drop) s *= keep_scale(drop->seed, off_resid, r * c + o, drop->p_resid);
            out[r * c + o] = s;
        }
    free(qkv);
    free(y);
    free(p);
}

/* the module's output against the reference, from the module's own weights */
static void check_against_ref(nb_module *m, nb_ctx *ctx, nb_tensor *x, int h, const ref_dropout *drop,
                              double tol) {
    int64_t n = x->shape[0], t = x->shape[1], c = x->shape[2];
    nb_tensor *ba = nb_module_find(m, "c_attn.bias"), *bp = nb_module_find(m, "c_proj.bias");
    double *xv = host(x), *wa = host(nb_module_find(m, "c_attn.weight"));
    double *wp = host(nb_module_find(m, "c_proj.weight"));
    double *bav = ba ? host(ba) : NULL, *bpv = bp ? host(bp) : NULL;
    double *e = malloc(sizeof(double) * (size_t)(n * t * c));
    ref_attention(e, xv, wa, bav, wp, bpv, n, t, c, h, drop);
    nb_tensor *y = nb_module_forward(m, ctx, x);
    ck_assert(y->ndim == 3 && y->shape[0] == n && y->shape[1] == t && y->shape[2] == c);
    nbt_assert_close(y, e, tol, tol);
    free(xv);
    free(wa);
    free(wp);
    free(bav);
    free(bpv);
    free(e);
}

NBT_CPU_TEST(test_values) {
    int heads[] = {1, 2, 4};
    for (int k = 0; k < 2; k++)
        for (int hi = 0; hi < 3; hi++)
            for (int bias = 0; bias < 2; bias++) {
                nb_dtype dt = k ? NB_F32 : NB_F64;
                nb_rng rng = nb_rng_make(100 + hi);
                nb_attention_opts o = NB_ATTENTION_DEFAULTS;
                o.bias = bias;
                nb_module *m = nb_causal_self_attention_new(ctx, dt, 8, heads[hi], &o, &rng);
                nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 5, 8), 200 + hi);
                check_against_ref(m, ctx, x, heads[hi], NULL, k ? 1e-5 : 1e-12);
                /* one position, and a strided input */
                check_against_ref(m, ctx, nbt_randn(ctx, dt, NB_SHAPE(3, 1, 8), 210), heads[hi], NULL,
                                  k ? 1e-5 : 1e-12);
                nb_tensor *xt = nb_transpose(ctx, nbt_randn(ctx, dt, NB_SHAPE(4, 2, 8), 220), 0, 1);
                check_against_ref(m, ctx, xt, heads[hi], NULL, k ? 1e-5 : 1e-12);
            }
}

/* Changing positions >= s leaves the outputs at positions < s bit for bit. */
NBT_CPU_TEST(test_causal_values) {
    NBT_FOR_F64_F32(k, dt) {
        nb_module *m = nb_causal_self_attention_new(ctx, dt, 8, 2, NULL, NULL);
        nb_tensor *x = nbt_randn(ctx, dt, NB_SHAPE(2, 6, 8), 300);
        nb_tensor *y = nb_module_forward(m, ctx, x);
        for (int s = 1; s < 6; s++) {
            nb_tensor *x2 = nb_clone(ctx, x);
            nb_tensor *tail = nb_narrow(ctx, x2, 1, s, 6 - s);
            nb_copy_(tail, nb_mul_scalar(ctx, nbt_randn(ctx, dt, 3, tail->shape, 301 + s), 10.0));
            nb_tensor *y2 = nb_module_forward(m, ctx, x2);
            nbt_assert_tensors_close(nb_narrow(ctx, y2, 1, 0, s), nb_narrow(ctx, y, 1, 0, s), 0, 0);
            double *a = host(nb_narrow(ctx, y2, 1, s, 1)), *b = host(nb_narrow(ctx, y, 1, s, 1));
            int differ = 0;
            for (int i = 0; i < 16; i++) differ += a[i] != b[i];
            ck_assert_int_eq(differ, 16);
            free(a);
            free(b);
        }
    }
}

/* The gradient of an output position with respect to later inputs is exactly zero. */
NBT_CPU_TEST(test_causal_gradients) {
    nb_module *m = nb_causal_self_attention_new(ctx, NB_F64, 8, 4, NULL, NULL);
    for (int s = 0; s < 4; s++) {
        nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 4, 8), 400);
        nb_tensor *y = nb_module_forward(m, ctx, x);
        nb_backward(nb_sum_all(ctx, nb_narrow(ctx, y, 1, s, 1)));
        double *g = host(x->grad);
        for (int b = 0; b < 2; b++)
            for (int t = 0; t < 4; t++) {
                double mag = 0;
                for (int c = 0; c < 8; c++) mag += fabs(g[(b * 4 + t) * 8 + c]);
                ck_assert_msg(t > s ? mag == 0 : mag > 0, "output %d, input %d: |grad| %g", s, t, mag);
            }
        free(g);
        nb_module_zero_grad(m);
    }
}

typedef struct attn_case {
    nb_module *m;
    nb_rng *rng;
    uint64_t offset;
} attn_case;

static nb_tensor *attn_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    attn_case *c = user;
    if (c->rng) c->rng->offset = c->offset; /* the same dropout masks at every evaluation */
    return nb_module_forward(c->m, ctx, in[0]);
}

static void gradcheck_attention(attn_case *c, nb_tensor *x) {
    nb_named_tensor p[4];
    int n = nb_module_named_parameters(c->m, p, 4);
    nb_tensor *in[5] = {x};
    for (int i = 0; i < n; i++) in[1 + i] = p[i].tensor;
    NBT_GRADCHECK(attn_fn, c, 1 + n, in);
}

NBT_CPU_TEST(test_gradcheck) {
    nb_rng rng = nb_rng_make(500);
    attn_case c = {nb_causal_self_attention_new(ctx, NB_F64, 4, 2, NULL, &rng), NULL, 0};
    gradcheck_attention(&c, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3, 4), 501));
    nb_attention_opts o = {false, 0.3, 0.2, &rng};
    attn_case d = {nb_causal_self_attention_new(ctx, NB_F64, 4, 1, &o, &rng), &rng, 17};
    gradcheck_attention(&d, nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(1, 4, 4), 502));
}

/* f32 (the vectorised rows and the f32 products of the CPU's fused path)
 * against f64 at a longer sequence: values against the naive reference,
 * gradients of the input and every parameter against the f64 module's
 * (which test_gradcheck checks against central differences). */
NBT_CPU_TEST(test_f32_long) {
    int heads[] = {1, 4};
    for (int hi = 0; hi < 2; hi++) {
        int h = heads[hi];
        nb_rng rng = nb_rng_make(700 + hi);
        nb_module *m64 = nb_causal_self_attention_new(ctx, NB_F64, 16, h, NULL, &rng);
        nb_module *m32 = nb_causal_self_attention_new(ctx, NB_F32, 16, h, NULL, NULL);
        nb_named_tensor p64[4], p32[4];
        ck_assert_int_eq(nb_module_named_parameters(m64, p64, 4), 4);
        nb_module_named_parameters(m32, p32, 4);
        for (int i = 0; i < 4; i++) nb_copy_(p32[i].tensor, p64[i].tensor);
        nb_tensor *x64 = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 21, 16), 710 + hi);
        nb_tensor *x32 = nb_cast(ctx, x64, NB_F32); /* both leaves */
        x64->requires_grad = x32->requires_grad = true;
        check_against_ref(m32, ctx, x32, h, NULL, 1e-5);
        nb_tensor *r = nbt_randn(ctx, NB_F64, NB_SHAPE(3, 21, 16), 720 + hi);
        nb_backward(nb_sum_all(ctx, nb_mul(ctx, nb_module_forward(m64, ctx, x64), r)));
        nb_backward(nb_sum_all(ctx, nb_mul(ctx, nb_module_forward(m32, ctx, x32),
                                           nb_cast(ctx, r, NB_F32))));
        nbt_assert_tensors_close(x32->grad, x64->grad, 1e-4, 1e-4);
        for (int i = 0; i < 4; i++) nbt_assert_tensors_close(p32[i].tensor->grad, p64[i].tensor->grad, 1e-4, 1e-4);
    }
}

NBT_CPU_TEST(test_dropout) {
    nb_rng init = nb_rng_make(600), drop = nb_rng_make(601);
    nb_attention_opts o = {true, 0.4, 0.25, &drop};
    nb_module *m = nb_causal_self_attention_new(ctx, NB_F64, 8, 2, &o, &init);
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(2, 5, 8), 602);
    drop.offset = 9;
    ref_dropout rd = {0.4, 0.25, 601, 9};
    check_against_ref(m, ctx, x, 2, &rd, 1e-12);
    /* attention weights (2*2*5*5 = 100 -> 25 counters), then the output (80 -> 20) */
    ck_assert_int_eq(drop.offset, 9 + 25 + 20);
    /* evaluation: no dropout and no randomness used */
    nb_module_eval(m);
    check_against_ref(m, ctx, x, 2, NULL, 1e-12);
    ck_assert_int_eq(drop.offset, 9 + 45);
}

/* Without active attention dropout the CPU runs everything between c_attn
 * and c_proj as one recorded op (nb__causal_attention, the backend's fused
 * kernel); with it, the layer composes the ops (split, products, causal
 * softmax, dropout). Both paths' values are checked above. */
NBT_CPU_TEST(test_fused_path) {
    nb_rng drop = nb_rng_make(801);
    nb_attention_opts o = {true, 0.3, 0.0, &drop};
    for (int k = 0; k < 3; k++) {
        nb_dtype dt = k == 1 ? NB_F64 : NB_F32;
        nb_module *m = nb_causal_self_attention_new(ctx, dt, 8, 2, k == 2 ? &o : NULL, NULL);
        nb_tensor *x = nbt_randn_leaf(ctx, dt, NB_SHAPE(2, 5, 8), 800);
        nb_tensor *y = nb_module_forward(m, ctx, x); /* c_proj's output */
        ck_assert_ptr_nonnull(y->node);
        nb_tensor *inner = y->node->in[0]; /* what c_proj read */
        ck_assert_ptr_nonnull(inner->node);
        if (k < 2) ck_assert_str_eq(inner->node->op, "CausalSelfAttention");
        else ck_assert_str_ne(inner->node->op, "CausalSelfAttention");
    }
}

NBT_CPU_TEST(test_names) {
    nb_module *block = nb_module_list_new(ctx);
    nb_module_append(block, nb_causal_self_attention_new(ctx, NB_F32, 12, 3, NULL, NULL));
    nb_named_tensor p[8];
    ck_assert_int_eq(nb_module_named_parameters(block, p, 8), 4);
    static const char *const names[] = {"0.c_attn.weight", "0.c_attn.bias", "0.c_proj.weight",
                                        "0.c_proj.bias"};
    static const int64_t rows[] = {36, 36, 12, 12};
    for (int i = 0; i < 4; i++) {
        ck_assert_str_eq(p[i].name, names[i]);
        ck_assert_int_eq(p[i].tensor->shape[0], rows[i]);
        if (i % 2 == 0) ck_assert_int_eq(p[i].tensor->shape[1], 12);
    }
    ck_assert_ptr_nonnull(nb_module_child(block, "0.attn_dropout"));
    ck_assert_ptr_nonnull(nb_module_child(block, "0.resid_dropout"));
    nb_attention_opts o = NB_ATTENTION_DEFAULTS;
    o.bias = false;
    ck_assert_int_eq(nb_module_named_parameters(nb_causal_self_attention_new(ctx, NB_F32, 12, 3, &o, NULL), NULL, 0), 2);
}

NBT_CPU_TEST(test_errors) {
    nb_module *m = nb_causal_self_attention_new(ctx, NB_F32, 8, 2, NULL, NULL);
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(5, 8))),
                     "CausalSelfAttention: input (5, 8) must be (N, T, 8)");
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(2, 5, 6))),
                     "CausalSelfAttention: input (2, 5, 6) must be (N, T, 8)");
    NBT_EXPECT_ABORT(nb_module_forward(m, ctx, nb_zeros(ctx, NB_F64, NB_SHAPE(2, 5, 8))),
                     "CausalSelfAttention: input (2, 5, 8) is f64 but the layer's parameters are f32");
}

NBT_MAIN("nn_attention", "core", 0,
         test_values, test_causal_values, test_causal_gradients, test_gradcheck, test_f32_long, test_dropout,
         test_fused_path, test_names, test_errors)
