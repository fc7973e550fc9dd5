/* Mixed precision on the CPU (Note [Compute dtype] in
 * tensor/context.c): every op that takes the compute dtype (nb_matmul and
 * nb_matmul_t with each transpose, batched and broadcast; nb__linear with
 * its bias; nb__linear_gelu; nb_conv2d with stride, padding, dilation and
 * groups) and its gradients, under a bf16 compute dtype, checked two ways:
 *
 * 1. Against an independent reference in double that multiplies the
 *    bf16-rounded operands (rounded here, by bf16_round) and sums exactly:
 *    the CPU computes exactly those products (a product of two bf16 values
 *    is exact in f32) summed in f32, so the only differences allowed are
 *    the f32 summation's, |err| <= K 2^-24 sum|terms| for K terms, plus
 *    half a bf16 ulp, 2^-8 |value|, where the result is rounded to bf16
 *    (a product's output, conv2d's output and the gradients of its
 *    operands; a matrix product's gradients reach its f32 operands
 *    unrounded, Note [Wide gradients] in autograd/backward.c).
 * 2. Against the same op in f32. bf16 keeps 8 significant bits, so each
 *    operand is off by at most u = 2^-8 relative (half its ulp) and each
 *    product by 2u + u^2; the bound used is the worst case, (2u + u^2)
 *    sum|terms| (+ u |value| where rounded, + twice the f32 summation
 *    bound), which no data can exceed. The typical error is much smaller:
 *    K independent roundings add up like a random walk, ~sqrt(K) u |term|
 *    ~ u |value| for O(1) values of random sign (measured here: relative
 *    RMS errors of 2e-3 to 5e-3 over a tensor), so the relative RMS error
 *    is also checked, against 2^-6 = 0.0156.
 *
 * Also: the parameters (master weights) and their gradients stay f32 and
 * an optimizer step updates them; f32 gradient contributions to one bf16
 * cast output reach its f32 input unrounded; bf16 tensors are refused outside
 * the ops of the compute-dtype table and outside a bf16 context; each op of
 * the table (docs/cuda.md) returns the dtype it says, with values and
 * gradients against the op in f64 on the same bf16 values (test_table); a
 * small GPT trained 300 steps in bf16 ends within 2% of the f32 run's loss. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/attention.h" /* the kernels, for bit-for-bit checks */
#include "tensor/cpu/cpu.h"
#include "tensor/cpu/sgemm.h"
#include "tensor/cpu/simd.h" /* nb__exp_f32 */
#include "tensor/op_table.h"
#include "tensor/internal.h" /* nb__linear, nb__linear_gelu */
#include "testutil.h"

#define U 0x1p-8       /* bf16's unit roundoff: 8 significant bits */
#define F32_EPS 0x1p-24 /* f32's unit roundoff */

/* Round to nearest even at bf16's 8 significant bits (finite values). */
static double bf16_round(double v) {
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static double *host(const nb_tensor *t) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    nb_to_host_f64(t, v);
    return v;
}

static double *zeroed(int64_t n) { return calloc((size_t)(n ? n : 1), sizeof(double)); }

/* What the bf16 computation of one tensor should be: s the exact sum of
 * the (rounded) terms, sa the sum of their magnitudes, mt the largest
 * magnitude, k the terms per element (for the f32 summation bound). */
typedef struct expect {
    int64_t n;
    double *s, *sa, *mt;
    int64_t k;
    bool rounded; /* the result is rounded to bf16 */
    double *extra; /* more error allowed against f32 (GELU's slope) */
} expect;

static expect expect_new(int64_t n, int64_t k, bool rounded) {
    return (expect){n, zeroed(n), zeroed(n), zeroed(n), k, rounded, zeroed(n)};
}

static void expect_add(expect *e, int64_t i, double term) {
    e->s[i] += term;
    e->sa[i] += fabs(term);
    if (fabs(term) > e->mt[i]) e->mt[i] = fabs(term);
}

static void expect_free(expect *e) {
    free(e->s);
    free(e->sa);
    free(e->mt);
    free(e->extra);
}

/* extra_ulps: terms whose bf16 factor came from an f32 value the library
 * computed (GELU's gradient) may round to a neighbour of the reference's;
 * allow that many such terms a bf16 ulp (2^-8 relative) each. */
static void check_ref(const char *what, const nb_tensor *t, const expect *e, int extra_ulps) {
    ck_assert_int_eq(nb_numel(t), e->n);
    double *v = host(t);
    for (int64_t i = 0; i < e->n; i++) {
        double sum_tol = (double)e->k * F32_EPS * e->sa[i] * (1 + U);
        double tol = (e->rounded ? U * (fabs(e->s[i]) + sum_tol) : 0) + sum_tol +
                     extra_ulps * 2 * U * e->mt[i] + 1e-30;
        ck_assert_msg(fabs(v[i] - e->s[i]) <= tol,
                      "%s: element %lld is %.9g, the reference %.9g (|diff| %.3g > %.3g)", what,
                      (long long)i, v[i], e->s[i], fabs(v[i] - e->s[i]), tol);
    }
    free(v);
}

static void check_f32(const char *what, const nb_tensor *t16, const nb_tensor *t32,
                      const expect *e) {
    double *a = host(t16), *b = host(t32), num = 0, den = 0;
    for (int64_t i = 0; i < e->n; i++) {
        /* sa is over rounded terms: (1 + 2u) covers the unrounded ones */
        double sa = e->sa[i] * (1 + 2 * U);
        double tol = (2 * U + U * U) * sa + 2 * (double)e->k * F32_EPS * sa;
        tol += e->extra[i];
        if (e->rounded) tol = U * fabs(b[i]) + (1 + U) * tol;
        ck_assert_msg(fabs(a[i] - b[i]) <= tol + 1e-30,
                      "%s: bf16 element %lld is %.9g, f32 %.9g (|diff| %.3g > %.3g)", what,
                      (long long)i, a[i], b[i], fabs(a[i] - b[i]), tol);
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    ck_assert_msg(num <= 0x1p-12 * den, "%s: relative RMS error %.3g above 2^-6", what,
                  sqrt(num / (den > 0 ? den : 1)));
    free(a);
    free(b);
}

/* ---- matrix products ---- */

/* A case: a (La, M, K) stored transposed when ta, b (Lb, K, N) stored
 * transposed when tb; La, Lb in {0 (a 2-D operand), L}; op selects the
 * front end; bias (N) for nb__linear/nb__linear_gelu. */
enum { OP_MATMUL_T, OP_LINEAR, OP_LINEAR_GELU };
typedef struct mm_case {
    const char *name;
    int op;
    int64_t L, M, N, K;
    bool a_batched, b_batched, ta, tb;
} mm_case;

typedef struct mm_io {
    nb_tensor *a, *b, *bias, *y;
} mm_io;

static mm_io mm_run(nb_ctx *pctx, nb_ctx *step, const mm_case *c, const nb_tensor *gy_like) {
    int64_t ash[3], bsh[3];
    int na = 0, nbn = 0;
    if (c->a_batched) ash[na++] = c->L;
    ash[na++] = c->ta ? c->K : c->M;
    ash[na++] = c->ta ? c->M : c->K;
    if (c->b_batched) bsh[nbn++] = c->L;
    bsh[nbn++] = c->tb ? c->N : c->K;
    bsh[nbn++] = c->tb ? c->K : c->N;
    mm_io io = {0};
    io.a = nbt_randn_leaf(pctx, NB_F32, na, ash, 11);
    io.b = nbt_randn_leaf(pctx, NB_F32, nbn, bsh, 12);
    if (c->op != OP_MATMUL_T) io.bias = nbt_randn_leaf(pctx, NB_F32, 1, &c->N, 13);
    if (c->op == OP_MATMUL_T) io.y = nb_matmul_t(step, io.a, io.b, c->ta, c->tb);
    else if (c->op == OP_LINEAR) io.y = nb__linear(step, io.a, io.b, io.bias);
    else io.y = nb__linear_gelu(step, io.a, io.b, io.bias);
    (void)gy_like;
    return io;
}

static double gelu(double x) {
    return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

static double gelu_grad(double x) {
    double t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) +
           0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x);
}

static void mm_case_run(const mm_case *c) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *s32 = nb_ctx_new(nb_cpu(), 0),
           *s16 = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(s16, NB_BF16);
    mm_io f = mm_run(pctx, s32, c, NULL), h = mm_run(pctx, s16, c, NULL);
    ck_assert_int_eq(h.y->dtype, NB_BF16); /* a product writes the compute dtype */
    nb_tensor *kept_gelu = NULL; /* nb_gelu of the kept pre-activation, before backward */
    if (c->op == OP_LINEAR_GELU) {
        bool prev = nb_set_grad_enabled(false);
        kept_gelu = nb_gelu(s16, h.y->node->saved[0], NB_GELU_TANH);
        nb_set_grad_enabled(prev);
    }
    int64_t L = c->L, M = c->M, N = c->N, K = c->K;
    int64_t nl = c->a_batched || c->b_batched ? L : 1;
    nb_tensor *gy = nbt_randn(pctx, NB_F32, h.y->ndim, h.y->shape, 14);
    nb_backward_with(f.y, gy);
    nb_backward_with(h.y, nb_cast(pctx, gy, NB_BF16));
    ck_assert(h.a->dtype == NB_F32 && h.a->grad && h.a->grad->dtype == NB_F32);
    ck_assert(h.b->dtype == NB_F32 && h.b->grad && h.b->grad->dtype == NB_F32);

    double *a = host(h.a), *b = host(h.b), *g = host(gy), *bias = h.bias ? host(h.bias) : NULL;
    /* forward: pre = sum_k a~ b~ (+ bias, the f32 bias added as it is),
     * rounded to bf16 */
    expect pre = expect_new(nl * M * N, K + (bias != NULL), true);
    for (int64_t l = 0; l < nl; l++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                int64_t o = (l * M + i) * N + j;
                if (bias) expect_add(&pre, o, bias[j]);
                for (int64_t k = 0; k < K; k++) {
                    int64_t ia = (c->a_batched ? l * M * K : 0) + (c->ta ? k * M + i : i * K + k);
                    int64_t ib = (c->b_batched ? l * K * N : 0) + (c->tb ? j * K + k : k * N + j);
                    expect_add(&pre, o, bf16_round(a[ia]) * bf16_round(b[ib]));
                }
            }
    /* the gradient reaching the product: g~, or g~ gelu'(pre~) with pre
     * kept in bf16 */
    bool gl = c->op == OP_LINEAR_GELU;
    double *gp = zeroed(nl * M * N);
    for (int64_t o = 0; o < nl * M * N; o++)
        gp[o] = gl ? bf16_round(g[o]) * gelu_grad(bf16_round(pre.s[o])) : bf16_round(g[o]);
    /* each operand's gradient: sum of g~ times the other operand, in its
     * own layout, summed over the batch where it was broadcast; the f32
     * product reaches the f32 operand unrounded (Note [Wide gradients]) */
    int64_t an = nb_numel(h.a), bn = nb_numel(h.b);
    expect ga = expect_new(an, N * (c->a_batched ? 1 : nl), false);
    expect gb = expect_new(bn, M * (c->b_batched ? 1 : nl), false);
    expect gbias = expect_new(N, nl * M, false);
    for (int64_t l = 0; l < nl; l++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                int64_t o = (l * M + i) * N + j;
                double gr = bf16_round(gp[o]);
                /* against f32, GELU's gradient differs by |g gelu''| (< 0.8 |g|)
                 * times pre's difference (its products' and its rounding) */
                double dgp = gl ? 0.8 * fabs(g[o]) *
                                      ((2 * U + U * U) * pre.sa[o] * (1 + 2 * U) +
                                       U * fabs(pre.s[o]))
                                : 0;
                if (bias) expect_add(&gbias, j, gr);
                for (int64_t k = 0; k < K; k++) {
                    int64_t ia = (c->a_batched ? l * M * K : 0) + (c->ta ? k * M + i : i * K + k);
                    int64_t ib = (c->b_batched ? l * K * N : 0) + (c->tb ? j * K + k : k * N + j);
                    expect_add(&ga, ia, gr * bf16_round(b[ib]));
                    expect_add(&gb, ib, gr * bf16_round(a[ia]));
                    ga.extra[ia] += dgp * fabs(b[ib]) * (1 + U);
                    gb.extra[ib] += dgp * fabs(a[ia]) * (1 + U);
                }
            }
    char what[160];
    if (gl) {
        /* y = gelu(pre~), pre~ the pre-activation kept (pre's f32 sum
         * rounded to bf16), rounded to bf16 once: bit for bit nb_gelu of
         * the kept pre~ (Note [GELU recomputed in backward] in
         * tensor/ops_matmul.c); against the reference's y, GELU's f32
         * error, its slope (< 1.13) times pre~'s error (the summation
         * bound and the rounding to bf16), and half a bf16 ulp */
        ck_assert_int_eq(h.y->dtype, NB_BF16);
        double *y = host(h.y);
        double *again = host(kept_gelu);
        for (int64_t o = 0; o < pre.n; o++) {
            ck_assert_msg(y[o] == again[o], "%s: y element %lld is %.9g, nb_gelu of the kept "
                          "pre-activation %.9g", c->name, (long long)o, y[o], again[o]);
            double sum = (double)pre.k * F32_EPS * pre.sa[o] * (1 + U);
            double tol = 1.13 * (sum + U * (fabs(pre.s[o]) + sum)) +
                         4 * F32_EPS * (fabs(pre.s[o]) + 1);
            tol += U * (fabs(gelu(pre.s[o])) + tol);
            ck_assert_msg(fabs(y[o] - gelu(pre.s[o])) <= tol,
                          "%s: y element %lld is %.9g, reference %.9g", c->name, (long long)o,
                          y[o], gelu(pre.s[o]));
        }
        free(y);
        free(again);
    } else {
        snprintf(what, sizeof what, "%s: y vs reference", c->name);
        check_ref(what, h.y, &pre, 0);
    }
    /* GELU's gradient: the library's f32 g gelu'(pre) may round to another
     * bf16 neighbour than the reference's for an element or two */
    int extra = gl ? 2 : 0;
    snprintf(what, sizeof what, "%s: a's gradient vs reference", c->name);
    check_ref(what, h.a->grad, &ga, extra);
    snprintf(what, sizeof what, "%s: b's gradient vs reference", c->name);
    check_ref(what, h.b->grad, &gb, extra);
    if (bias) {
        snprintf(what, sizeof what, "%s: bias gradient vs reference", c->name);
        check_ref(what, h.bias->grad, &gbias, extra);
    }

    /* against f32 (GELU: pre's bound through its slope) */
    snprintf(what, sizeof what, "%s: y vs f32", c->name);
    if (!gl) check_f32(what, h.y, f.y, &pre);
    snprintf(what, sizeof what, "%s: a's gradient vs f32", c->name);
    check_f32(what, h.a->grad, f.a->grad, &ga);
    snprintf(what, sizeof what, "%s: b's gradient vs f32", c->name);
    check_f32(what, h.b->grad, f.b->grad, &gb);
    snprintf(what, sizeof what, "%s: bias gradient vs f32", c->name);
    if (bias && !gl) check_f32(what, h.bias->grad, f.bias->grad, &gbias);

    expect_free(&pre);
    expect_free(&ga);
    expect_free(&gb);
    expect_free(&gbias);
    free(a);
    free(b);
    free(g);
    free(bias);
    free(gp);
    nb_ctx_free(s16);
    nb_ctx_free(s32);
    nb_ctx_free(pctx);
}

static const mm_case mm_cases[] = {
    {"matmul", OP_MATMUL_T, 1, 13, 11, 37, false, false, false, false},
    {"matmul_t a^T", OP_MATMUL_T, 1, 13, 11, 37, false, false, true, false},
    {"matmul_t b^T", OP_MATMUL_T, 1, 13, 11, 37, false, false, false, true},
    {"matmul_t a^T b^T", OP_MATMUL_T, 1, 13, 11, 37, false, false, true, true},
    {"batched", OP_MATMUL_T, 3, 7, 9, 64, true, true, false, false},
    {"batched a^T b^T", OP_MATMUL_T, 3, 7, 9, 64, true, true, true, true},
    {"batched, b broadcast (folded)", OP_MATMUL_T, 4, 5, 6, 33, true, false, false, false},
    {"batched a^T, b^T broadcast", OP_MATMUL_T, 4, 5, 6, 33, true, false, true, true},
    {"batched, a broadcast", OP_MATMUL_T, 3, 6, 5, 20, false, true, false, false},
    {"nb_linear with bias", OP_LINEAR, 4, 6, 10, 48, true, false, false, true},
    {"nb_linear_gelu", OP_LINEAR_GELU, 4, 6, 40, 16, true, false, false, true},
};

START_TEST(test_products) { mm_case_run(&mm_cases[_i]); }
END_TEST

/* ---- conv2d ---- */

typedef struct conv_case {
    const char *name;
    int64_t n, c, h, w, o, kh, kw;
    nb_conv2d_opts opts;
} conv_case;

static const conv_case conv_cases[] = {
    {"3x3 pad 1", 2, 3, 7, 6, 4, 3, 3, {{1, 1}, {1, 1}, {1, 1}, 1}},
    {"3x2 stride 2 pad (1, 0)", 2, 4, 9, 8, 6, 3, 2, {{2, 2}, {1, 0}, {1, 1}, 1}},
    {"groups 2, dilation 2", 1, 4, 8, 8, 6, 3, 3, {{1, 1}, {2, 2}, {2, 2}, 2}},
    {"depthwise", 2, 3, 6, 5, 6, 3, 3, {{1, 2}, {1, 1}, {1, 1}, 3}},
    {"1x1", 2, 5, 4, 4, 3, 1, 1, {{1, 1}, {0, 0}, {1, 1}, 1}},
};

typedef struct conv_io {
    nb_tensor *x, *w, *b, *y;
} conv_io;

static conv_io conv_run(nb_ctx *pctx, nb_ctx *step, const conv_case *c) {
    int64_t G = c->opts.groups;
    conv_io io;
    io.x = nbt_randn_leaf(pctx, NB_F32, NB_SHAPE(c->n, c->c, c->h, c->w), 21);
    io.w = nbt_randn_leaf(pctx, NB_F32, NB_SHAPE(c->o, c->c / G, c->kh, c->kw), 22);
    io.b = nbt_randn_leaf(pctx, NB_F32, NB_SHAPE(c->o), 23);
    io.y = nb_conv2d(step, io.x, io.w, io.b, &c->opts);
    return io;
}

static void conv_case_run(const conv_case *c) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *s32 = nb_ctx_new(nb_cpu(), 0),
           *s16 = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(s16, NB_BF16);
    conv_io f = conv_run(pctx, s32, c), h = conv_run(pctx, s16, c);
    ck_assert_int_eq(h.y->dtype, NB_F32);
    nb_tensor *gy = nbt_randn(pctx, NB_F32, 4, h.y->shape, 24);
    nb_backward_with(f.y, gy);
    nb_backward_with(h.y, gy);
    int64_t G = c->opts.groups, CG = c->c / G, OG = c->o / G;
    int64_t OH = h.y->shape[2], OW = h.y->shape[3];
    const nb_conv2d_opts *o = &c->opts;
    double *x = host(h.x), *w = host(h.w), *b = host(h.b), *g = host(gy);
    int64_t nk = CG * c->kh * c->kw;
    /* bias rounded too (cast with the operands), output rounded */
    expect y = expect_new(nb_numel(h.y), nk + 1, true);
    expect gx = expect_new(nb_numel(h.x), 0, true), gw = expect_new(nb_numel(h.w), 0, true);
    expect gb = expect_new(c->o, c->n * OH * OW, true);
    for (int64_t n = 0; n < c->n; n++)
        for (int64_t oc = 0; oc < c->o; oc++)
            for (int64_t oh = 0; oh < OH; oh++)
                for (int64_t ow = 0; ow < OW; ow++) {
                    int64_t yi = ((n * c->o + oc) * OH + oh) * OW + ow;
                    double gr = bf16_round(g[yi]);
                    expect_add(&y, yi, bf16_round(b[oc]));
                    expect_add(&gb, oc, gr);
                    for (int64_t ci = 0; ci < CG; ci++)
                        for (int64_t ki = 0; ki < c->kh; ki++)
                            for (int64_t kj = 0; kj < c->kw; kj++) {
                                int64_t ih = oh * o->stride[0] - o->padding[0] + ki * o->dilation[0];
                                int64_t iw = ow * o->stride[1] - o->padding[1] + kj * o->dilation[1];
                                if (ih < 0 || ih >= c->h || iw < 0 || iw >= c->w) continue;
                                int64_t cin = (oc / OG) * CG + ci;
                                int64_t xi = ((n * c->c + cin) * c->h + ih) * c->w + iw;
                                int64_t wi = ((oc * CG + ci) * c->kh + ki) * c->kw + kj;
                                double xv = bf16_round(x[xi]), wv = bf16_round(w[wi]);
                                expect_add(&y, yi, xv * wv);
                                expect_add(&gx, xi, gr * wv);
                                expect_add(&gw, wi, gr * xv);
                            }
                }
    gx.k = OG * c->kh * c->kw; /* at most, per input element */
    gw.k = c->n * OH * OW;
    char what[160];
#define CHECK_BOTH(label, t16, t32, e)                                  \
    do {                                                                \
        snprintf(what, sizeof what, "conv %s: %s vs reference", c->name, label); \
        check_ref(what, t16, e, 0);                                     \
        snprintf(what, sizeof what, "conv %s: %s vs f32", c->name, label); \
        check_f32(what, t16, t32, e);                                   \
    } while (0)
    CHECK_BOTH("y", h.y, f.y, &y);
    CHECK_BOTH("x's gradient", h.x->grad, f.x->grad, &gx);
    CHECK_BOTH("w's gradient", h.w->grad, f.w->grad, &gw);
    CHECK_BOTH("bias gradient", h.b->grad, f.b->grad, &gb);
#undef CHECK_BOTH
    expect_free(&y);
    expect_free(&gx);
    expect_free(&gw);
    expect_free(&gb);
    free(x);
    free(w);
    free(b);
    free(g);
    nb_ctx_free(s16);
    nb_ctx_free(s32);
    nb_ctx_free(pctx);
}

START_TEST(test_conv2d) { conv_case_run(&conv_cases[_i]); }
END_TEST

/* ---- graph, masters, refusals ---- */

/* One bf16 cast used by two products: its two f32 gradient contributions
 * reach the f32 leaf unrounded and are added there in f32 (Note [Wide
 * gradients]); the cast's own output gets no gradient. */
NBT_CPU_TEST(test_cast_gradient_accumulates) {
    nb_ctx_set_compute_dtype(ctx, NB_BF16);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(5, 24), 31);
    nb_tensor *w1 = nbt_randn(ctx, NB_F32, NB_SHAPE(24, 7), 32);
    nb_tensor *w2 = nbt_randn(ctx, NB_F32, NB_SHAPE(24, 7), 33);
    nb_tensor *gy = nbt_randn(ctx, NB_F32, NB_SHAPE(5, 7), 34);
    nb_tensor *c = nb_cast(ctx, x, NB_BF16);
    nb_backward_with(nb_add(ctx, nb_matmul(ctx, c, w1), nb_matmul(ctx, c, w2)),
                     nb_cast(ctx, gy, NB_BF16));
    ck_assert_int_eq(x->grad->dtype, NB_F32);
    ck_assert_ptr_null(c->grad);
    double *v1 = host(w1), *v2 = host(w2), *g = host(gy), *got = host(x->grad);
    for (int64_t i = 0; i < 5; i++)
        for (int64_t k = 0; k < 24; k++) {
            double s1 = 0, s2 = 0, a1 = 0, a2 = 0;
            for (int64_t j = 0; j < 7; j++) {
                double gr = bf16_round(g[i * 7 + j]);
                s1 += gr * bf16_round(v1[k * 7 + j]);
                s2 += gr * bf16_round(v2[k * 7 + j]);
                a1 += fabs(gr * bf16_round(v1[k * 7 + j]));
                a2 += fabs(gr * bf16_round(v2[k * 7 + j]));
            }
            /* two f32 sums of 7 terms, then their f32 sum: no bf16 rounding */
            double tol = 3 * 7 * F32_EPS * (a1 + a2) + 1e-30;
            ck_assert_msg(fabs(got[i * 24 + k] - (s1 + s2)) <= tol,
                          "x.grad[%lld][%lld] = %.9g, reference %.9g", (long long)i,
                          (long long)k, got[i * 24 + k], s1 + s2);
        }
    free(v1);
    free(v2);
    free(g);
    free(got);
}

/* A Linear layer's f32 parameters (the master weights) get f32 gradients
 * through the casts and an optimizer step updates them in f32. */
START_TEST(test_masters_stay_f32) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(41);
    nb_module *lin = nb_linear_new(pctx, NB_F32, 16, 8, true, &rng);
    nb_named_tensor ps[2];
    ck_assert_int_eq(nb_module_named_parameters(lin, ps, 2), 2);
    nb_optim_hparams hp = NB_SGD_DEFAULTS;
    hp.lr = 0.1;
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, ps, 2, &hp);
    double *before = host(ps[0].tensor);
    nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_tensor *y = nb_module_forward(lin, step, nbt_randn(step, NB_F32, NB_SHAPE(4, 16), 42));
    ck_assert_int_eq(y->dtype, NB_BF16);
    nb_backward(nb_sum_all(step, nb_mul(step, y, y)));
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(ps[i].tensor->dtype, NB_F32);
        ck_assert_ptr_nonnull(ps[i].tensor->grad);
        ck_assert_int_eq(ps[i].tensor->grad->dtype, NB_F32);
    }
    double *gw = host(ps[0].tensor->grad);
    nb_optim_step(opt);
    ck_assert_int_eq(ps[0].tensor->dtype, NB_F32);
    double *after = host(ps[0].tensor);
    /* SGD: w - lr g, computed in f32 on the f32 master */
    for (int i = 0; i < 16 * 8; i++)
        ck_assert_msg(fabs(after[i] - (before[i] - 0.1 * gw[i])) <= 1e-6 * (1 + fabs(before[i])),
                      "weight %d: %.9g, expected %.9g", i, after[i], before[i] - 0.1 * gw[i]);
    ck_assert(fabs(gw[0]) > 0);
    free(before);
    free(after);
    free(gw);
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
}
END_TEST

NBT_CPU_TEST(test_refusals) {
    nb_tensor *x = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(3, 4), 51), NB_BF16);
    nb_tensor *w = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(4, 2), 52), NB_BF16);
    nb_tensor *img = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(1, 1, 4, 4), 53), NB_BF16);
    nb_tensor *k = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(1, 1, 3, 3), 54), NB_BF16);
    /* an f32 context: bf16 products refused, naming the way out */
    NBT_EXPECT_ABORT(nb_matmul(ctx, x, w),
                     "nb_matmul: dtype bf16 is a storage type on cpu, taken by the ops of the "
                     "compute-dtype table only in a context whose compute dtype is it "
                     "(nb_ctx_set_compute_dtype), and this context's is f32; nb_cast to f32 first "
                     "(tensor of shape (3, 4))");
    NBT_EXPECT_ABORT(nb_conv2d(ctx, img, k, NULL, NULL), "nb_conv2d: dtype bf16 is a storage type");
    NBT_EXPECT_ABORT(nb_add(ctx, x, x), "nb_add: dtype bf16 is a storage type on cpu, taken by");
    NBT_EXPECT_ABORT(nb_sum_all(ctx, x), "nb_sum: dtype bf16 is a storage type on cpu");
    NBT_EXPECT_ABORT(nb_gelu(ctx, x, NB_GELU_TANH), "nb_gelu: dtype bf16 is a storage type");
    /* a bf16 context: the ops of the table take bf16 and return it; the
     * others (pooling, batch norm, the pair losses) do not */
    nb_ctx_set_compute_dtype(ctx, NB_BF16);
    nb_tensor *y = nb_matmul(ctx, x, w);
    ck_assert_int_eq(y->dtype, NB_BF16);
    ck_assert_int_eq(nb_conv2d(ctx, img, k, NULL, NULL)->dtype, NB_BF16);
    ck_assert_int_eq(nb_add(ctx, x, x)->dtype, NB_BF16);
    ck_assert_int_eq(nb_gelu(ctx, x, NB_GELU_TANH)->dtype, NB_BF16);
    ck_assert_int_eq(nb_sum_all(ctx, x)->dtype, NB_BF16);
    NBT_EXPECT_ABORT(nb_mse_loss(ctx, x, x), "nb_mse_loss: dtype bf16 is not supported");
    nb_tensor *h = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(3, 4), 55), NB_F16);
    NBT_EXPECT_ABORT(nb_matmul(ctx, h, nb_cast(ctx, w, NB_F16)),
                     "nb_matmul: dtype f16 is a storage type on cpu; nb_cast to f32 first");
}

/* bf16 operands that are views BLAS reads in place (a row slice with a
 * leading dimension above its width, a transpose, a batch broadcast with
 * stride 0): converted to f32 twins of their own layout; the product is
 * the exact one of their values up to f32 summation, rounded to bf16. */
NBT_CPU_TEST(test_bf16_views) {
    nb_ctx_set_compute_dtype(ctx, NB_BF16);
    nb_tensor *big = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(6, 10), 71), NB_BF16);
    nb_tensor *a = nb_narrow(ctx, big, 1, 2, 8);                                   /* (6, 8), ld 10 */
    nb_tensor *bt = nb_cast(ctx, nbt_randn(ctx, NB_F32, NB_SHAPE(5, 8), 72), NB_BF16);
    nb_tensor *b = nb_transpose(ctx, bt, 0, 1);                                    /* (8, 5) */
    nb_tensor *a3 = nb_expand(ctx, nb_reshape(ctx, a, NB_SHAPE(1, 6, 8)), NB_SHAPE(3, 6, 8));
    nb_tensor *b3 = nb_expand(ctx, nb_reshape(ctx, b, NB_SHAPE(1, 8, 5)), NB_SHAPE(3, 8, 5));
    nb_tensor *ys[2] = {nb_matmul(ctx, a, b), nb_matmul(ctx, a3, b3)};
    double *av = host(a), *bv = host(b);
    for (int k = 0; k < 2; k++) {
        double *y = host(ys[k]);
        ck_assert_int_eq(ys[k]->dtype, NB_BF16);
        for (int64_t r = 0; r < (k ? 3 : 1) * 6; r++)
            for (int64_t j = 0; j < 5; j++) {
                double s = 0, sa = 0;
                for (int64_t i = 0; i < 8; i++) {
                    s += av[(r % 6) * 8 + i] * bv[i * 5 + j];
                    sa += fabs(av[(r % 6) * 8 + i] * bv[i * 5 + j]);
                }
                double tol = 8 * F32_EPS * sa * (1 + U);
                ck_assert_msg(fabs(y[r * 5 + j] - s) <= U * (fabs(s) + tol) + tol + 1e-30,
                              "view case %d: y[%lld][%lld] = %.9g, reference %.9g", k,
                              (long long)r, (long long)j, y[r * 5 + j], s);
            }
        free(y);
    }
    free(av);
    free(bv);
}

/* Casts f32 <-> bf16 (contiguous runs take a vectorised loop): round to
 * nearest even, ties both ways, infinities, NaN kept a NaN, overflow to
 * infinity; the same bits strided and contiguous. */
NBT_CPU_TEST(test_casts) {
    float v[16] = {1.0f, 1.00390625f /* tie, to even: 1 */, 1.01171875f /* tie, up */, -2.5f,
                   0x1.fffffep127f /* rounds to inf */, -0.0f, 1e-40f, 0x1.010002p0f,
                   3.14159265f, -1e30f, (float)INFINITY, -(float)INFINITY, (float)NAN,
                   65504.0f, 0x1.7fp-3f, -0x1.808p5f};
    uint16_t want[16];
    for (int i = 0; i < 16; i++) {
        double r = bf16_round(v[i]);
        float f = (float)r;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        want[i] = (uint16_t)(u >> 16);
    }
    nb_tensor *x = nb_from_host(ctx, NB_F32, NB_SHAPE(16), v);
    nb_tensor *strided = nb_transpose(ctx, nb_reshape(ctx, x, NB_SHAPE(4, 4)), 0, 1);
    uint16_t got[16], got_t[16];
    nb_to_host(nb_cast(ctx, x, NB_BF16), got);
    nb_to_host(nb_cast(ctx, strided, NB_BF16), got_t);
    for (int i = 0; i < 16; i++) {
        if (isnan(v[i])) {
            ck_assert_msg((got[i] & 0x7f80u) == 0x7f80u && (got[i] & 0x7fu), "NaN became %#x",
                          got[i]);
            continue;
        }
        ck_assert_msg(got[i] == want[i], "bf16 of %a: %#x, want %#x", (double)v[i], got[i], want[i]);
        ck_assert_uint_eq(got_t[(i % 4) * 4 + i / 4], want[i]);
    }
    /* and back: exact */
    float back[16];
    nb_to_host(nb_cast(ctx, nb_cast(ctx, x, NB_BF16), NB_F32), back);
    for (int i = 0; i < 16; i++) {
        uint32_t u = (uint32_t)got[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        ck_assert(memcmp(&back[i], &f, sizeof f) == 0);
    }
}

/* ---- bf16 kernels without f32 twins ---- */

/* A bf16 tensor of random bf16 values. */
static nb_tensor *rand16(nb_ctx *ctx, int ndim, const int64_t *shape, uint64_t seed) {
    nb_tensor *r = nbt_randn(ctx, NB_F32, ndim, shape, seed), *h = nb_empty(ctx, NB_BF16, ndim, shape);
    nb__cpu_copy(h, r);
    return h;
}

/* t widened to a contiguous f32 tensor (exact), or rounded back */
static nb_tensor *as(nb_ctx *ctx, const nb_tensor *t, nb_dtype dt) {
    nb_tensor *w = nb_empty(ctx, dt, t->ndim, t->shape);
    nb__cpu_copy(w, t);
    return w;
}

static void same_bits(const char *what, const nb_tensor *got, const nb_tensor *want) {
    ck_assert(got->dtype == NB_BF16 && want->dtype == NB_BF16 && nb_same_shape(got, want));
    int64_t n = nb_numel(got);
    uint16_t *a = malloc((size_t)n * 2), *b = malloc((size_t)n * 2);
    nb_to_host(got, a);
    nb_to_host(want, b);
    for (int64_t i = 0; i < n; i++)
        ck_assert_msg(a[i] == b[i], "%s: element %lld of %lld is %#x, the f32 op rounded %#x",
                      what, (long long)i, (long long)n, a[i], b[i]);
    free(a);
    free(b);
}

/* Elementwise ops with a bf16 output (Note [bf16 elementwise in blocks] in
 * tensor/cpu/elementwise.c): bit for bit the f32 kernel on the widened
 * inputs, rounded once, on sizes that are not multiples of the block nor
 * of the pool's grain, with large tensors cut for the pool (1 and 2
 * threads), broadcast and transposed inputs, an f32 operand, and the
 * output being an input. */
NBT_CPU_TEST(test_elementwise_without_twins) {
    const int64_t big[2] = {5, 7001}, small[2] = {3, 7};
    const nb__unary_op uops[] = {NB_U_GELU_TANH, NB_U_EXP, NB_U_RELU, NB_U_MUL_S, NB_U_TANH};
    const nb__binary_op bops[] = {NB_B_ADD, NB_B_SUB, NB_B_MUL, NB_B_DIV};
    char what[128];
    for (int threads = 1; threads <= 2; threads++) {
        nb_set_num_threads(threads);
        for (int z = 0; z < 2; z++) {
            const int64_t *sh = z ? small : big;
            nb_tensor *a = rand16(ctx, 2, sh, 11), *b = rand16(ctx, 2, sh, 12);
            nb_tensor *row = rand16(ctx, 2, (int64_t[]){1, sh[1]}, 13);
            nb_tensor *col = rand16(ctx, 2, (int64_t[]){sh[0], 1}, 14);
            nb_tensor *at = nb_transpose(ctx, rand16(ctx, 2, (int64_t[]){sh[1], sh[0]}, 15), 0, 1);
            nb_tensor *b32 = nbt_randn(ctx, NB_F32, 2, sh, 16);
            for (size_t u = 0; u < sizeof uops / sizeof uops[0]; u++) {
                nb_tensor *const ins[2] = {a, at};
                for (int k = 0; k < 2; k++) {
                    nb_tensor *y = nb_empty(ctx, NB_BF16, 2, sh), *y32 = nb_empty(ctx, NB_F32, 2, sh);
                    nb__cpu_unary(uops[u], y, ins[k], 0.375);
                    nb__cpu_unary(uops[u], y32, as(ctx, ins[k], NB_F32), 0.375);
                    snprintf(what, sizeof what, "%s on %lldx%lld%s, %d threads",
                             nb__unary_name(uops[u]), (long long)sh[0], (long long)sh[1],
                             k ? " transposed" : "", threads);
                    same_bits(what, y, as(ctx, y32, NB_BF16));
                }
            }
            for (size_t o = 0; o < sizeof bops / sizeof bops[0]; o++) {
                nb_tensor *const rhs[4] = {b, row, col, b32};
                const char *const names[4] = {"", " by a row", " by a column", " with f32"};
                for (int k = 0; k < 4; k++) {
                    nb_tensor *y = nb_empty(ctx, NB_BF16, 2, sh), *y32 = nb_empty(ctx, NB_F32, 2, sh);
                    nb__cpu_binary(bops[o], y, at, rhs[k]);
                    nb__cpu_binary(bops[o], y32, as(ctx, at, NB_F32), rhs[k]->dtype == NB_F32
                                   ? rhs[k] : as(ctx, rhs[k], NB_F32));
                    snprintf(what, sizeof what, "%s on %lldx%lld%s, %d threads",
                             nb__binary_name(bops[o]), (long long)sh[0], (long long)sh[1],
                             names[k], threads);
                    same_bits(what, y, as(ctx, y32, NB_BF16));
                }
                /* in place: the output is the first, then the second input */
                for (int k = 0; k < 2; k++) {
                    nb_tensor *y = as(ctx, a, NB_BF16), *y32 = nb_empty(ctx, NB_F32, 2, sh);
                    nb_tensor *a32 = as(ctx, a, NB_F32), *b32w = as(ctx, b, NB_F32);
                    if (k == 0) nb__cpu_binary(bops[o], y, y, b), nb__cpu_binary(bops[o], y32, a32, b32w);
                    else nb__cpu_binary(bops[o], y, b, y), nb__cpu_binary(bops[o], y32, b32w, a32);
                    snprintf(what, sizeof what, "%s in place (input %d) on %lldx%lld, %d threads",
                             nb__binary_name(bops[o]), k, (long long)sh[0], (long long)sh[1],
                             threads);
                    same_bits(what, y, as(ctx, y32, NB_BF16));
                }
            }
            /* GELU's gradient: dx = g GELU'(pre), also written over g */
            for (int k = 0; k < 2; k++) {
                nb_tensor *dx = k ? as(ctx, b, NB_BF16) : nb_empty(ctx, NB_BF16, 2, sh);
                nb_tensor *dx32 = nb_empty(ctx, NB_F32, 2, sh);
                nb__cpu_gelu_tanh_backward(dx, k ? dx : b, a);
                nb__cpu_gelu_tanh_backward(dx32, as(ctx, b, NB_F32), as(ctx, a, NB_F32));
                snprintf(what, sizeof what, "GELU's gradient%s on %lldx%lld, %d threads",
                         k ? " over g" : "", (long long)sh[0], (long long)sh[1], threads);
                same_bits(what, dx, as(ctx, dx32, NB_BF16));
            }
        }
    }
    nb_set_num_threads(0);
}

/* Fused causal attention on bf16 qkv (Note [bf16 attention without twins]
 * in tensor/cpu/attention.c): y, the log-sum-exp and dqkv bit for bit the
 * f32 kernel's on the widened qkv and gy, rounded once; T and D odd, at 1
 * and 2 threads, with the causal GEMM and with cblas_sgemm. */
START_TEST(test_attention_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t n = 2, t = 37, h = 3, d = 9, c = h * d;
    const double scale = 0.3;
    nb_tensor *qkv = rand16(ctx, 3, (int64_t[]){n, t, 3 * c}, 21);
    nb_tensor *gy = rand16(ctx, 3, (int64_t[]){n, t, c}, 22);
    nb_tensor *q32 = as(ctx, qkv, NB_F32), *g32 = as(ctx, gy, NB_F32);
    char what[128];
    for (int kernel = 0; kernel < 2; kernel++) {
        int was = nb__sgemm_set_enabled(kernel ? -1 : 0);
        for (int threads = 1; threads <= 2; threads++) {
            nb_set_num_threads(threads);
            nb_tensor *y = nb_empty(ctx, NB_BF16, 3, (int64_t[]){n, t, c});
            nb_tensor *y32 = nb_empty(ctx, NB_F32, 3, (int64_t[]){n, t, c});
            nb_tensor *lse = nb_empty(ctx, NB_F32, 3, (int64_t[]){n, h, t});
            nb_tensor *lse32 = nb_empty(ctx, NB_F32, 3, (int64_t[]){n, h, t});
            nb__cpu_causal_attention(ctx, y, lse, qkv, (int)h, scale);
            nb__cpu_causal_attention(ctx, y32, lse32, q32, (int)h, scale);
            snprintf(what, sizeof what, "attention's y, %s, %d threads",
                     kernel ? "causal GEMM" : "cblas_sgemm", threads);
            same_bits(what, y, as(ctx, y32, NB_BF16));
            float a[n * h * t], b[n * h * t];
            nb_to_host(lse, a);
            nb_to_host(lse32, b);
            ck_assert_msg(memcmp(a, b, sizeof a) == 0, "%s: the log-sum-exp differs", what);
            nb_tensor *dqkv = nb_empty(ctx, NB_BF16, 3, (int64_t[]){n, t, 3 * c});
            nb_tensor *d32 = nb_empty(ctx, NB_F32, 3, (int64_t[]){n, t, 3 * c});
            nb__cpu_causal_attention_backward(ctx, dqkv, qkv, y, lse, gy, (int)h, scale);
            nb__cpu_causal_attention_backward(ctx, d32, q32, y32, lse32, g32, (int)h, scale);
            snprintf(what, sizeof what, "attention's dqkv, %s, %d threads",
                     kernel ? "causal GEMM" : "cblas_sgemm", threads);
            same_bits(what, dqkv, as(ctx, d32, NB_BF16));
        }
        nb__sgemm_set_enabled(was);
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* Layer norm on bf16 x (Note [bf16 layer norm in row groups] in
 * tensor/cpu/norm.c): y, the statistics, dx (written, or added: rounded,
 * added in f32, rounded again) and the f32 weight and bias gradients bit
 * for bit the f32 kernel's on the widened x and g; D not a divisor of the
 * group buffer, rows cut for the pool, with and without weight and bias,
 * dx not asked for, D past the buffer (the twins), 1 and 2 threads. */
START_TEST(test_layer_norm_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t cases[][2] = {{203, 300}, {5, 7}, {3, 2049}};
    char what[128];
    for (size_t cs = 0; cs < sizeof cases / sizeof cases[0]; cs++) {
        int64_t m = cases[cs][0], d = cases[cs][1];
        nb_tensor *x = rand16(ctx, 2, (int64_t[]){m, d}, 31), *g = rand16(ctx, 2, (int64_t[]){m, d}, 32);
        nb_tensor *old = rand16(ctx, 2, (int64_t[]){m, d}, 33);
        nb_tensor *x32 = as(ctx, x, NB_F32), *g32 = as(ctx, g, NB_F32);
        for (int affine = 0; affine < 2; affine++)
            for (int threads = 1; threads <= 2; threads++)
                for (unsigned add = 0; add < 8; add += 7) {
                    nb_set_num_threads(threads);
                    nb_tensor *w = affine ? nbt_randn(ctx, NB_F32, 1, &d, 34) : NULL;
                    nb_tensor *b = affine ? nbt_randn(ctx, NB_F32, 1, &d, 35) : NULL;
                    nb_tensor *y = nb_empty(ctx, NB_BF16, 2, (int64_t[]){m, d});
                    nb_tensor *y32 = nb_empty(ctx, NB_F32, 2, (int64_t[]){m, d});
                    nb_tensor *st[4];
                    for (int k = 0; k < 4; k++) st[k] = nb_empty(ctx, NB_F64, 1, &m);
                    nb__cpu_layer_norm(y, st[0], st[1], x, w, b, m, d, 1e-5);
                    nb__cpu_layer_norm(y32, st[2], st[3], x32, w, b, m, d, 1e-5);
                    snprintf(what, sizeof what, "layer norm %lldx%lld%s, %d threads, add %u",
                             (long long)m, (long long)d, affine ? " affine" : "", threads, add);
                    same_bits(what, y, as(ctx, y32, NB_BF16));
                    for (int k = 0; k < 2; k++) {
                        double a[m], c[m];
                        nb_to_host(st[k], a);
                        nb_to_host(st[k + 2], c);
                        ck_assert_msg(memcmp(a, c, sizeof a) == 0, "%s: statistics differ", what);
                    }
                    /* backward: dx (written or added), dw and db (f32, added into when add) */
                    for (int want_dx = 0; want_dx < 2; want_dx++) {
                        nb_tensor *dx = want_dx ? as(ctx, old, NB_BF16) : NULL;
                        nb_tensor *dx32 = want_dx ? nb_empty(ctx, NB_F32, 2, (int64_t[]){m, d}) : NULL;
                        nb_tensor *dw = NULL, *db = NULL, *dw32 = NULL, *db32 = NULL;
                        if (affine) {
                            dw = nbt_randn(ctx, NB_F32, 1, &d, 36), db = nbt_randn(ctx, NB_F32, 1, &d, 37);
                            dw32 = nbt_randn(ctx, NB_F32, 1, &d, 36), db32 = nbt_randn(ctx, NB_F32, 1, &d, 37);
                        }
                        nb__cpu_layer_norm_backward(ctx, dx, dw, db, g, x, st[0], st[1], w, m, d,
                                                    affine ? add : add & NB__LN_ADD_DX);
                        nb__cpu_layer_norm_backward(ctx, dx32, dw32, db32, g32, x32, st[2], st[3], w,
                                                    m, d, affine ? add & ~(unsigned)NB__LN_ADD_DX : 0);
                        if (affine) {
                            float a[d], c[d];
                            nb_to_host(dw, a);
                            nb_to_host(dw32, c);
                            ck_assert_msg(memcmp(a, c, sizeof a) == 0, "%s: dw differs", what);
                            nb_to_host(db, a);
                            nb_to_host(db32, c);
                            ck_assert_msg(memcmp(a, c, sizeof a) == 0, "%s: db differs", what);
                        }
                        if (!want_dx) continue;
                        nb_tensor *want = as(ctx, dx32, NB_BF16);
                        if (add & NB__LN_ADD_DX) { /* old + the rounded contribution, in f32, rounded */
                            nb_tensor *sum = nb_empty(ctx, NB_F32, 2, (int64_t[]){m, d});
                            float *o = as(ctx, old, NB_F32)->data, *cw = as(ctx, want, NB_F32)->data;
                            for (int64_t i = 0; i < m * d; i++) ((float *)sum->data)[i] = o[i] + cw[i];
                            want = as(ctx, sum, NB_BF16);
                        }
                        snprintf(what, sizeof what, "layer norm's dx %lldx%lld%s, %d threads, add %u",
                                 (long long)m, (long long)d, affine ? " affine" : "", threads, add);
                        same_bits(what, dx, want);
                    }
                }
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* Cross-entropy on bf16 logits in pieces (Note [bf16 cross-entropy in
 * pieces] in tensor/cpu/softmax.c): the loss and the log-sum-exp bit for
 * bit those of the f32 op on f32 copies of the logits, and the gradient
 * (the fused forward's, written apart or over the logits, and the
 * backward's, from the log-sum-exp or from a fused gradient, for g = 0.7)
 * the f32 op's rounded to bf16; rows of 3000 (5 a piece), 20000 (one) and
 * 24 (all), an ignored row, label smoothing 0 and 0.1, 1 and 2 threads.
 * Logits that are a strided view take the f32 twins: the same bits. */
START_TEST(test_cross_entropy_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t cases[][2] = {{37, 3000}, {5, 20000}, {3, 24}};
    char what[160];
    for (size_t cs = 0; cs < sizeof cases / sizeof cases[0]; cs++) {
        int64_t n = cases[cs][0], c = cases[cs][1];
        nb_tensor *x = rand16(ctx, 2, (int64_t[]){n, c}, 41), *x32 = as(ctx, x, NB_F32);
        int64_t *t = malloc(sizeof(int64_t) * (size_t)n);
        for (int64_t i = 0; i < n; i++) t[i] = i == 1 ? -100 : (i * 7919) % c;
        nb_tensor *tg = nb_from_host(ctx, NB_I64, 1, &n, t);
        nb_tensor *g = nb_full(ctx, NB_F32, 0, NULL, 0.7);
        for (int smooth = 0; smooth < 2; smooth++)
            for (int threads = 1; threads <= 2; threads++)
                for (int mode = 0; mode < 4; mode++) { /* plain, fused apart, fused over, strided */
                    nb_set_num_threads(threads);
                    double eps = smooth ? 0.1 : 0.0;
                    snprintf(what, sizeof what, "cross-entropy %lldx%lld, eps %.1f, %d threads, %s",
                             (long long)n, (long long)c, eps, threads,
                             (const char *[]){"plain", "fused", "fused over the logits", "strided"}[mode]);
                    nb_tensor *xin = nb_clone(ctx, x), *xin32 = nb_clone(ctx, x32);
                    if (mode == 3) /* a strided view of the same values */
                        xin = nb_transpose(ctx, nb_contiguous(ctx, nb_transpose(ctx, xin, 0, 1)), 0, 1);
                    nb_tensor *d = NULL, *d32 = NULL;
                    if (mode == 1) {
                        d = nb_empty(ctx, NB_BF16, 2, (int64_t[]){n, c});
                        d32 = nb_empty(ctx, NB_F32, 2, (int64_t[]){n, c});
                    } else if (mode == 2) {
                        d = xin, d32 = xin32;
                    }
                    nb_tensor *loss = nb_empty(ctx, NB_F32, 0, NULL), *loss32 = nb_empty(ctx, NB_F32, 0, NULL);
                    nb_tensor *lse, *lse32, *count, *count32;
                    nb__cpu_cross_entropy(ctx, loss, &lse, &count, d, xin, tg, -100, eps);
                    nb__cpu_cross_entropy(ctx, loss32, &lse32, &count32, d32, xin32, tg, -100, eps);
                    float l[2];
                    nb_to_host(loss, &l[0]);
                    nb_to_host(loss32, &l[1]);
                    ck_assert_msg(memcmp(&l[0], &l[1], sizeof(float)) == 0, "%s: loss %.9g, f32 %.9g", what,
                                  l[0], l[1]);
                    if (mode == 1 || mode == 2) {
                        same_bits(what, d, as(ctx, d32, NB_BF16));
                        continue;
                    }
                    ck_assert(lse->dtype == NB_F32);
                    float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
                    nb_to_host(lse, a);
                    nb_to_host(lse32, b);
                    ck_assert_msg(memcmp(a, b, sizeof(float) * (size_t)n) == 0, "%s: lse differs", what);
                    free(a), free(b);
                    /* the backward from the log-sum-exp, then from a fused gradient (lse NULL) */
                    nb_tensor *dx = nb_empty(ctx, NB_BF16, 2, (int64_t[]){n, c});
                    nb_tensor *dx32 = nb_empty(ctx, NB_F32, 2, (int64_t[]){n, c});
                    nb__cpu_cross_entropy_backward(dx, xin, lse, tg, g, count, -100, eps);
                    nb__cpu_cross_entropy_backward(dx32, xin32, lse32, tg, g, count32, -100, eps);
                    same_bits(what, dx, as(ctx, dx32, NB_BF16));
                    nb_tensor *h = nb_clone(ctx, x), *h32 = as(ctx, h, NB_F32);
                    nb__cpu_cross_entropy_backward(h, h, NULL, tg, g, count, -100, eps);
                    nb__cpu_cross_entropy_backward(h32, h32, NULL, tg, g, count32, -100, eps);
                    same_bits(what, h, as(ctx, h32, NB_BF16));
                }
        free(t);
        nb_ctx_reset(ctx);
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* Dropout on bf16 in blocks (Note [bf16 dropout in blocks] in
 * tensor/cpu/dropout.c): out and the mask bit for bit the f32 op's on the
 * same values, rounded, with and without a mask, over lengths that are not
 * multiples of the block, the pool's piece or the stream's 4, on 1 and 2
 * threads; and the f32 op itself the same on 1 and 2 threads. */
START_TEST(test_dropout_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t lens[] = {1, 7, 1023, 1025, 16384 * 2 + 5};
    char what[128];
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int64_t n = lens[li];
        nb_tensor *x = rand16(ctx, 1, &n, 51), *x32 = as(ctx, x, NB_F32);
        nb_tensor *ref = NULL, *ref_mask = NULL;
        for (int threads = 1; threads <= 2; threads++)
            for (int with_mask = 0; with_mask < 2; with_mask++) {
                nb_set_num_threads(threads);
                nb_tensor *y = nb_empty(ctx, NB_BF16, 1, &n), *y32 = nb_empty(ctx, NB_F32, 1, &n);
                nb_tensor *m = with_mask ? nb_empty(ctx, NB_BF16, 1, &n) : NULL;
                nb_tensor *m32 = with_mask ? nb_empty(ctx, NB_F32, 1, &n) : NULL;
                nb__cpu_dropout(y, m, x, 0.3, 77, 5);
                nb__cpu_dropout(y32, m32, x32, 0.3, 77, 5);
                snprintf(what, sizeof what, "dropout of %lld, %d threads%s", (long long)n, threads,
                         with_mask ? ", mask" : "");
                same_bits(what, y, as(ctx, y32, NB_BF16));
                if (with_mask) same_bits(what, m, as(ctx, m32, NB_BF16));
                if (!ref) { /* the first f32 run: every other must give its bits */
                    ref = y32;
                    continue;
                }
                float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
                nb_to_host(y32, a);
                nb_to_host(ref, b);
                ck_assert_msg(memcmp(a, b, sizeof(float) * (size_t)n) == 0, "%s: f32 differs", what);
                if (with_mask && ref_mask) {
                    nb_to_host(m32, a);
                    nb_to_host(ref_mask, b);
                    ck_assert_msg(memcmp(a, b, sizeof(float) * (size_t)n) == 0, "%s: mask differs", what);
                }
                if (with_mask) ref_mask = m32;
                free(a), free(b);
            }
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* Softmax and log-softmax on bf16 in blocks (Note [bf16 softmax in
 * blocks] in tensor/cpu/softmax.c), forward and backward: bit for bit the
 * f32 op's on the same values, rounded; the axis last (rows) or not
 * (columns in tiles, 70 of them: more than one tile), on 1 and 2 threads. */
START_TEST(test_softmax_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t cases[][3] = {{300, 40, 1}, {3, 7, 70}, {1, 20000, 1}};
    char what[128];
    for (size_t cs = 0; cs < sizeof cases / sizeof cases[0]; cs++) {
        int64_t o = cases[cs][0], k = cases[cs][1], in = cases[cs][2], n = o * k * in;
        nb_tensor *x = rand16(ctx, 1, &n, 61), *g = rand16(ctx, 1, &n, 62);
        nb_tensor *x32 = as(ctx, x, NB_F32), *g32 = as(ctx, g, NB_F32);
        for (int take_log = 0; take_log < 2; take_log++)
            for (int threads = 1; threads <= 2; threads++) {
                nb_set_num_threads(threads);
                snprintf(what, sizeof what, "%s (%lld, %lld, %lld), %d threads",
                         take_log ? "log-softmax" : "softmax", (long long)o, (long long)k, (long long)in,
                         threads);
                nb_tensor *y = nb_empty(ctx, NB_BF16, 1, &n), *y32 = nb_empty(ctx, NB_F32, 1, &n);
                nb__cpu_softmax(y, x, o, k, in, take_log);
                nb__cpu_softmax(y32, x32, o, k, in, take_log);
                same_bits(what, y, as(ctx, y32, NB_BF16));
                /* the backward from the bf16 output, against f32 on its values */
                nb_tensor *yw = as(ctx, y, NB_F32);
                nb_tensor *dx = nb_empty(ctx, NB_BF16, 1, &n), *dx32 = nb_empty(ctx, NB_F32, 1, &n);
                nb__cpu_softmax_backward(dx, y, g, o, k, in, take_log);
                nb__cpu_softmax_backward(dx32, yw, g32, o, k, in, take_log);
                same_bits(what, dx, as(ctx, dx32, NB_BF16));
            }
        nb_ctx_reset(ctx);
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* The causal softmax on bf16 row by row (Note [bf16 softmax in blocks] in
 * tensor/cpu/softmax.c), forward and backward: bit for bit the f32 op's on
 * the same values, rounded, the masked part NaN in x (never read), on 1
 * and 2 threads. */
START_TEST(test_causal_softmax_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t cases[][3] = {{2, 7, 7}, {1, 130, 130}, {3, 5, 9}};
    char what[128];
    for (size_t cs = 0; cs < sizeof cases / sizeof cases[0]; cs++) {
        int64_t b = cases[cs][0], t = cases[cs][1], sl = cases[cs][2], n = b * t * sl;
        nb_tensor *x = rand16(ctx, 1, &n, 71), *g = rand16(ctx, 1, &n, 72);
        uint16_t *xb = x->data;
        for (int64_t r = 0; r < b * t; r++)
            for (int64_t j = r % t + 1; j < sl; j++) xb[r * sl + j] = 0x7fc0; /* NaN, masked */
        nb_tensor *x32 = as(ctx, x, NB_F32), *g32 = as(ctx, g, NB_F32);
        for (int threads = 1; threads <= 2; threads++) {
            nb_set_num_threads(threads);
            snprintf(what, sizeof what, "causal softmax (%lld, %lld, %lld), %d threads", (long long)b,
                     (long long)t, (long long)sl, threads);
            nb_tensor *y = nb_empty(ctx, NB_BF16, 1, &n), *y32 = nb_empty(ctx, NB_F32, 1, &n);
            nb__cpu_softmax_causal(y, x, b, t, sl, 0.5);
            nb__cpu_softmax_causal(y32, x32, b, t, sl, 0.5);
            same_bits(what, y, as(ctx, y32, NB_BF16));
            nb_tensor *yw = as(ctx, y, NB_F32);
            nb_tensor *dx = nb_empty(ctx, NB_BF16, 1, &n), *dx32 = nb_empty(ctx, NB_F32, 1, &n);
            nb__cpu_softmax_causal_backward(dx, y, g, b, t, sl, 0.5);
            nb__cpu_softmax_causal_backward(dx32, yw, g32, b, t, sl, 0.5);
            same_bits(what, dx, as(ctx, dx32, NB_BF16));
        }
        nb_ctx_reset(ctx);
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* Row reductions of bf16 rows read in place (Note [bf16 rows read in
 * place] in tensor/cpu/reduce.c): sum (scaled), max with its index,
 * argmax and variance with the mean, into bf16 and f32 outputs, bit for
 * bit the f32 op's on f32 copies of the rows, rounded; a NaN in a row;
 * many short rows and one row longer than two of the sums' pieces (its
 * pieces on the pool), 1 and 2 threads. */
START_TEST(test_reductions_without_twins) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t cases[][2] = {{50, 37}, {1, 70000}};
    char what[128];
    for (size_t cs = 0; cs < sizeof cases / sizeof cases[0]; cs++) {
        int64_t o = cases[cs][0], in = cases[cs][1], n = o * in;
        nb_tensor *x = rand16(ctx, 1, &n, 81);
        if (o > 3) ((uint16_t *)x->data)[3 * in + 5] = 0x7fc0; /* a NaN in row 3 */
        nb_tensor *x32 = as(ctx, x, NB_F32);
        for (int threads = 1; threads <= 2; threads++)
            for (int out16 = 0; out16 < 2; out16++) {
                nb_set_num_threads(threads);
                nb_dtype odt = out16 ? NB_BF16 : NB_F32;
                snprintf(what, sizeof what, "reductions (%lld, %lld) into %s, %d threads", (long long)o,
                         (long long)in, nb_dtype_name(odt), threads);
                nb_tensor *s = nb_empty(ctx, odt, 1, &o), *s32 = nb_empty(ctx, NB_F32, 1, &o);
                nb__cpu_sum_rows(s, x, o, in, 0.25);
                nb__cpu_sum_rows(s32, x32, o, in, 0.25);
                nb_tensor *m = nb_empty(ctx, odt, 1, &o), *m32 = nb_empty(ctx, NB_F32, 1, &o);
                nb_tensor *a = nb_empty(ctx, NB_I64, 1, &o), *a32 = nb_empty(ctx, NB_I64, 1, &o);
                nb__cpu_max_rows(m, a, x, o, in);
                nb__cpu_max_rows(m32, a32, x32, o, in);
                nb_tensor *v = nb_empty(ctx, odt, 1, &o), *v32 = nb_empty(ctx, NB_F32, 1, &o);
                nb_tensor *mu = nb_empty(ctx, odt, 1, &o), *mu32 = nb_empty(ctx, NB_F32, 1, &o);
                nb__cpu_var_rows(v, mu, x, o, in, (double)(in - 1));
                nb__cpu_var_rows(v32, mu32, x32, o, in, (double)(in - 1));
                nb_tensor *got[4] = {s, m, v, mu}, *want[4] = {s32, m32, v32, mu32};
                for (int k = 0; k < 4; k++) {
                    nb_tensor *w = as(ctx, want[k], odt);
                    size_t bytes = (size_t)o * nb_dtype_size(odt);
                    ck_assert_msg(memcmp(got[k]->data, w->data, bytes) == 0, "%s: output %d differs", what, k);
                }
                ck_assert(memcmp(a->data, a32->data, (size_t)o * sizeof(int64_t)) == 0);
                nb__cpu_argmax_rows(a, x, o, in);
                nb__cpu_argmax_rows(a32, x32, o, in);
                ck_assert_msg(memcmp(a->data, a32->data, (size_t)o * sizeof(int64_t)) == 0, "%s: argmax", what);
            }
        nb_ctx_reset(ctx);
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* A bf16 gradient summed to a broadcast input's shape in f32 (Note
 * [Broadcast gradients of storage halves] in tensor/ops_reduce.c): the
 * f32 sums read from g itself are bit for bit those of an f32 copy of g
 * summed, on the pool's pieces (1 and 2 threads), for a bias's shape and
 * others; and the CPU's binary with an f32 output widens bf16 inputs. */
START_TEST(test_broadcast_gradient_without_twin) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const int64_t gs[3] = {4, 37, 1500};
    const int64_t targets[][3] = {{1500, 0, 0}, {1, 1, 1500}, {4, 1, 1}, {37, 1, 0}, {1, 37, 1500},
                                  {4, 37, 1500}};
    const int nds[] = {1, 3, 3, 2, 3, 3};
    nb_tensor *g = rand16(ctx, 3, gs, 41), *g32 = as(ctx, g, NB_F32);
    for (int threads = 1; threads <= 2; threads++) {
        nb_set_num_threads(threads);
        for (size_t k = 0; k < sizeof nds / sizeof nds[0]; k++) {
            nb_tensor *got = nb__sum_to_f32(ctx, g, nds[k], targets[k]);
            nb_tensor *want = nb__sum_to(ctx, g32, nds[k], targets[k]);
            ck_assert(got->dtype == NB_F32 && nb_same_shape(got, want));
            int64_t n = nb_numel(want);
            float *a = malloc((size_t)n * 4), *b = malloc((size_t)n * 4);
            nb_to_host(got, a);
            nb_to_host(want, b);
            ck_assert_msg(memcmp(a, b, (size_t)n * 4) == 0, "sum to target %zu differs, %d threads",
                          k, threads);
            free(a);
            free(b);
        }
        /* f32 output, a bf16 and an f32 input */
        nb_tensor *y = nb_empty(ctx, NB_F32, 3, gs), *y32 = nb_empty(ctx, NB_F32, 3, gs);
        nb_tensor *f = nbt_randn(ctx, NB_F32, 3, gs, 42);
        nb__cpu_binary(NB_B_MUL, y, f, g);
        nb__cpu_binary(NB_B_MUL, y32, f, g32);
        ck_assert(memcmp(y->data, y32->data, (size_t)nb_numel(y) * 4) == 0);
    }
    nb_set_num_threads(0);
    nb_ctx_free(ctx);
}
END_TEST

/* GELU (tanh) and its gradient, the f32 kernels under every bf16 GELU:
 * bit for bit the table's f32 formula (tensor/op_table.h, with the tanh
 * of tensor/cpu/elementwise.c) computed here one element at a time,
 * whichever clone the CPU runs (Note [Vector width] in
 * tensor/cpu/simd.h); n not a multiple of any width, cut for the pool. */
static inline float ref_tanh(float u) { return 1.0f - 2.0f / (1.0f + nb__exp_f32(2.0f * u)); }
NB__UNARY_FORMULAS(float, ref, f, ref_tanh)

NBT_CPU_TEST(test_gelu_any_width) {
    enum { N = 70001 };
    float *x = malloc(N * sizeof(float)), *g = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) x[i] = -12.0f + 24.0f * (float)i / (float)(N - 1);
    for (int i = 0; i < N; i++) g[i] = 0.5f + (float)(i % 7) * 0.25f;
    x[3] = 1e-30f, x[4] = -0.0f, x[5] = 100.0f, x[6] = -100.0f;
    nb_tensor *tx = nb_from_host(ctx, NB_F32, NB_SHAPE(N), x);
    nb_tensor *tg = nb_from_host(ctx, NB_F32, NB_SHAPE(N), g);
    nb_tensor *y = nb_empty(ctx, NB_F32, 1, (int64_t[]){N}), *dx = nb_empty(ctx, NB_F32, 1, (int64_t[]){N});
    nb__cpu_unary(NB_U_GELU_TANH, y, tx, 0);
    nb__cpu_gelu_tanh_backward(dx, tg, tx);
    const float *py = y->data, *pd = dx->data;
    for (int i = 0; i < N; i++) {
        volatile float want = nb__f_gelu_tanh_ref(x[i], 0); /* one element, not vectorised */
        volatile float wantd = g[i] * nb__f_gelu_tanh_grad_ref(x[i], 0);
        ck_assert_msg(memcmp(&py[i], (const void *)&want, 4) == 0,
                      "GELU(%a) = %a, the formula %a", (double)x[i], (double)py[i], (double)want);
        ck_assert_msg(memcmp(&pd[i], (const void *)&wantd, 4) == 0, "GELU'(%a) g = %a, the formula %a",
                      (double)x[i], (double)pd[i], (double)wantd);
    }
    free(x);
    free(g);
}

/* ---- the compute-dtype table (docs/cuda.md) on the CPU ---- */

/* A bf16 leaf holding bf16 values and the f64 leaf of the same values
 * (exact): the inputs of the bf16 op and of its f64 reference. */
static void leaf_pair(nb_ctx *ctx, int ndim, const int64_t *shape, uint64_t seed, double scale,
                      nb_tensor **x16, nb_tensor **x64) {
    nb_tensor *r = nb_mul_scalar(ctx, nbt_randn(ctx, NB_F32, ndim, shape, seed), scale);
    *x16 = nb_cast(ctx, r, NB_BF16);
    *x64 = nb_cast(ctx, *x16, NB_F64);
    nb_set_requires_grad(*x16, true);
    nb_set_requires_grad(*x64, true);
}

/* got against the f64 reference: every element within `rel` of the
 * largest reference magnitude, plus half a bf16 ulp of its own value when
 * got is bf16 (rounded once from f32 arithmetic on the same bf16 values). */
static void check_table(const char *what, const nb_tensor *got, const nb_tensor *ref,
                        nb_dtype want, double rel) {
    ck_assert_msg(got->dtype == want, "%s: dtype %s, the table says %s", what,
                  nb_dtype_name(got->dtype), nb_dtype_name(want));
    ck_assert(nb_same_shape(got, ref));
    int64_t n = nb_numel(ref);
    double *a = host(got), *b = host(ref), big = 0;
    for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(b[i]));
    for (int64_t i = 0; i < n; i++) {
        double tol = rel * big + (want == NB_BF16 ? U * fabs(b[i]) : 0) + 1e-30;
        ck_assert_msg(fabs(a[i] - b[i]) <= tol, "%s: element %lld is %.9g, f64 %.9g (|diff| %.3g > %.3g)",
                      what, (long long)i, a[i], b[i], fabs(a[i] - b[i]), tol);
    }
    free(a);
    free(b);
}

enum { T_LAYER_NORM, T_SOFTMAX, T_LOG_SOFTMAX, T_CAUSAL, T_ATTENTION, T_ADD, T_GELU, T_SUM,
       T_CROSS_ENTROPY, T_COUNT };
static const char *const table_ops[T_COUNT] = {
    "layer norm (f32 weight and bias)", "softmax", "log-softmax", "causal softmax",
    "fused causal attention", "add", "gelu (tanh)", "sum over an axis", "cross-entropy"};

/* op on x (and, for layer norm, its f32 or f64 weight w and bias b; for
 * add, y) in ctx */
static nb_tensor *table_op(int op, nb_ctx *ctx, nb_tensor *x, nb_tensor *y, nb_tensor *w,
                           nb_tensor *b, nb_tensor *targets) {
    switch (op) {
    case T_LAYER_NORM: return nb_layer_norm(ctx, x, 1, w, b, 1e-5);
    case T_SOFTMAX: return nb_softmax(ctx, x, -1);
    case T_LOG_SOFTMAX: return nb_log_softmax(ctx, x, 1);
    case T_CAUSAL: return nb_softmax_causal(ctx, x, 0.5);
    case T_ATTENTION: return nb__causal_attention(ctx, x, 2, 0.25);
    case T_ADD: return nb_add(ctx, x, y);
    case T_GELU: return nb_gelu(ctx, x, NB_GELU_TANH);
    case T_SUM: return nb_sum(ctx, x, 1, (int[]){1}, false);
    default: return nb_cross_entropy(ctx, x, targets, NULL);
    }
}

/* Each op of the table in a bf16 context: the dtype the table gives, and
 * values and gradients against the same op in f64 on the same bf16
 * values: the output within half a bf16 ulp (one rounding of f32
 * arithmetic), the gradients (computed from bf16 saved values and a bf16
 * incoming gradient) within 4 bf16 ulps of the largest. f32 parameters
 * get f32 gradients. */
START_TEST(test_table) {
    int op = _i;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *c64 = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(ctx, NB_BF16);
    int64_t shape[3] = {3, 5, 24};
    int nd = 3;
    if (op == T_CAUSAL) shape[1] = shape[2] = 7;
    if (op == T_CROSS_ENTROPY) {
        nd = 2;
        shape[1] = 24;
    }
    nb_tensor *x16, *x64, *y16 = NULL, *y64 = NULL, *w = NULL, *b = NULL, *w64 = NULL, *b64 = NULL;
    leaf_pair(c64, nd, shape, 90 + (uint64_t)op, op == T_ATTENTION ? 1.0 : 2.0, &x16, &x64);
    if (op == T_ADD) leaf_pair(c64, nd, shape, 80, 2.0, &y16, &y64);
    if (op == T_LAYER_NORM) {
        w = nbt_randn_leaf(c64, NB_F32, 1, &shape[2], 81);
        b = nbt_randn_leaf(c64, NB_F32, 1, &shape[2], 82);
        w64 = nb_cast(c64, nbt_randn(c64, NB_F32, 1, &shape[2], 81), NB_F64); /* w's values */
        b64 = nb_cast(c64, nbt_randn(c64, NB_F32, 1, &shape[2], 82), NB_F64);
        nb_set_requires_grad(w64, true);
        nb_set_requires_grad(b64, true);
    }
    nb_tensor *tg = NULL;
    if (op == T_CROSS_ENTROPY) {
        int64_t t[3] = {4, 0, 23};
        tg = nb_from_host(c64, NB_I64, NB_SHAPE(3), t);
    }
    nb_tensor *o16 = table_op(op, ctx, x16, y16, w, b, tg);
    nb_tensor *o64 = table_op(op, c64, x64, y64, w64, b64, tg);
    ck_assert_ptr_nonnull(o16);
    char what[160];
    snprintf(what, sizeof what, "%s: output", table_ops[op]);
    nb_dtype want = op == T_CROSS_ENTROPY ? NB_F32 : NB_BF16;
    check_table(what, o16, o64, want, 1e-6);

    /* backward from the same incoming gradient (bf16 values) */
    nb_tensor *g16 = NULL, *g64 = NULL;
    if (op == T_CROSS_ENTROPY) {
        nb_backward(o16);
        nb_backward(o64);
    } else {
        nb_tensor *g = nb_cast(c64, nbt_randn(c64, NB_F32, o16->ndim, o16->shape, 83), NB_BF16);
        g16 = g;
        g64 = nb_cast(c64, g, NB_F64);
        nb_backward_with(o16, g16);
        nb_backward_with(o64, g64);
    }
    ck_assert_ptr_nonnull(x16->grad);
    snprintf(what, sizeof what, "%s: input's gradient", table_ops[op]);
    check_table(what, x16->grad, x64->grad, NB_BF16, 4 * U);
    if (y16) {
        snprintf(what, sizeof what, "%s: second input's gradient", table_ops[op]);
        check_table(what, y16->grad, y64->grad, NB_BF16, 4 * U);
    }
    if (w) { /* the master weights' gradients: f32 */
        snprintf(what, sizeof what, "%s: weight's gradient", table_ops[op]);
        check_table(what, w->grad, w64->grad, NB_F32, 4 * U);
        snprintf(what, sizeof what, "%s: bias's gradient", table_ops[op]);
        check_table(what, b->grad, b64->grad, NB_F32, 4 * U);
    }
    nb_ctx_free(ctx);
    nb_ctx_free(c64);
}
END_TEST

/* ---- a small GPT, 300 steps ---- */

/* Tokens of a fixed random Markov chain whose next token is one of 3
 * equally likely successors: the loss can fall to ln 3, not to 0, so a
 * relative comparison of final losses means something. */
static uint64_t next_u64(uint64_t *state) { /* xorshift64 */
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

static void markov_batch(int64_t *tok, int64_t n, int64_t t, int64_t v, uint64_t *rng) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = (next_u64(rng) >> 11) % (uint64_t)v;
        for (int64_t j = 0; j < t; j++) {
            tok[i * t + j] = (int64_t)s;
            uint64_t r = (next_u64(rng) >> 11) % 3;
            s = (s * 7 + 3 + r * 5) % (uint64_t)v;
        }
    }
}

static double train_gpt(bool bf16, double *first) {
    const int64_t V = 32, T = 16, N = 8;
    nb_gpt_config cfg = {V, T, 2, 2, 32, 0.0};
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_rng init = nb_rng_make(61);
    uint64_t data = 62;
    nb_module *g = nb_gpt_new(pctx, NB_F32, &cfg, &init);
    nb_named_tensor ps[64];
    int np = nb_module_named_parameters(g, ps, 64);
    nb_optim_hparams hp = NB_ADAMW_DEFAULTS;
    hp.lr = 3e-3;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, ps, np, &hp);
    int64_t tok[N * (T + 1)], x[N * T], y[N * T];
    double tail = 0;
    for (int it = 0; it < 300; it++) {
        nb_ctx_reset(step);
        if (bf16) nb_ctx_set_compute_dtype(step, NB_BF16);
        markov_batch(tok, N, T + 1, V, &data);
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < T; j++) {
                x[i * T + j] = tok[i * (T + 1) + j];
                y[i * T + j] = tok[i * (T + 1) + j + 1];
            }
        nb_tensor *logits = nb_gpt_forward(g, step, nb_from_host(step, NB_I64, NB_SHAPE(N, T), x));
        nb_tensor *loss = nb_gpt_loss(step, logits, nb_from_host(step, NB_I64, NB_SHAPE(N, T), y));
        double l = nb_item(loss);
        if (it == 0) *first = l;
        if (it >= 280) tail += l / 20;
        nb_optim_zero_grad(opt);
        nb_backward(loss);
        nb_optim_step(opt);
    }
    for (int i = 0; i < np; i++) ck_assert_int_eq(ps[i].tensor->dtype, NB_F32);
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
    return tail;
}

START_TEST(test_gpt_trains_in_bf16) {
    double first32, first16;
    double l32 = train_gpt(false, &first32), l16 = train_gpt(true, &first16);
    printf("GPT 300 steps, mean loss of the last 20: f32 %.4f -> %.4f, bf16 %.4f -> %.4f\n",
           first32, l32, first16, l16);
    /* both learned (ln 32 = 3.47 at the start, ln 3 = 1.10 the floor) */
    ck_assert_msg(l32 < 0.6 * first32 && l16 < 0.6 * first16,
                  "losses: f32 %.4f -> %.4f, bf16 %.4f -> %.4f", first32, l32, first16, l16);
    /* the compute dtype took effect, and the result is within 2% */
    ck_assert_msg(first16 != first32, "the bf16 run's first loss equals the f32 run's (%.9g)",
                  first32);
    ck_assert_msg(fabs(l16 - l32) <= 0.02 * l32,
                  "mean loss of the last 20 steps: bf16 %.5f, f32 %.5f (%.2f%% apart)", l16, l32,
                  100 * fabs(l16 - l32) / l32);
}
END_TEST

static Suite *cpu_bf16_suite(void) {
    Suite *s = suite_create("cpu_bf16");
    TCase *tc = tcase_create("core");
    tcase_add_loop_test(tc, test_products, 0, (int)(sizeof mm_cases / sizeof mm_cases[0]));
    tcase_add_loop_test(tc, test_conv2d, 0, (int)(sizeof conv_cases / sizeof conv_cases[0]));
    tcase_add_test(tc, test_cast_gradient_accumulates);
    tcase_add_test(tc, test_masters_stay_f32);
    tcase_add_test(tc, test_refusals);
    tcase_add_test(tc, test_casts);
    tcase_add_test(tc, test_bf16_views);
    tcase_add_test(tc, test_elementwise_without_twins);
    tcase_add_test(tc, test_attention_without_twins);
    tcase_add_test(tc, test_layer_norm_without_twins);
    tcase_add_test(tc, test_broadcast_gradient_without_twin);
    tcase_add_test(tc, test_cross_entropy_without_twins);
    tcase_add_test(tc, test_dropout_without_twins);
    tcase_add_test(tc, test_softmax_without_twins);
    tcase_add_test(tc, test_causal_softmax_without_twins);
    tcase_add_test(tc, test_reductions_without_twins);
    tcase_add_test(tc, test_gelu_any_width);
    tcase_add_loop_test(tc, test_table, 0, T_COUNT);
    tcase_add_test(tc, test_gpt_trains_in_bf16);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return nbt_run(cpu_bf16_suite()); }
