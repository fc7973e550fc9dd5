/* Tests of nb_conv2d: forward against a naive 7-loop reference in double
 * for several (stride, padding, dilation, groups) settings, f32 against the
 * f64 reference, gradient checks for input, weight and bias, non-contiguous
 * operands, and the error messages. */
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

typedef struct geom {
    int64_t n, c, h, w, o, kh, kw;
    nb_conv2d_opts opts;
} geom;

static int64_t groups_of(const nb_conv2d_opts *o) { return o->groups > 0 ? o->groups : 1; }

static int64_t ref_out(int64_t in, int64_t k, int s, int p, int d) {
    return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

/* out (N, O, OH, OW), computed in double straight from the definition */
static double *ref_conv(const geom *g, const double *x, const double *w, const double *b,
                        int64_t *oh_out, int64_t *ow_out) {
    const nb_conv2d_opts *o = &g->opts;
    int64_t OH = ref_out(g->h, g->kh, o->stride[0], o->padding[0], o->dilation[0]);
    int64_t OW = ref_out(g->w, g->kw, o->stride[1], o->padding[1], o->dilation[1]);
    /* output channel oc sees input channels [gi CG, (gi+1) CG) of its group gi */
    int64_t G = groups_of(o), CG = g->c / G, OG = g->o / G;
    double *out = calloc((size_t)(g->n * g->o * OH * OW), sizeof(double));
    for (int64_t n = 0; n < g->n; n++)
        for (int64_t oc = 0; oc < g->o; oc++)
            for (int64_t oh = 0; oh < OH; oh++)
                for (int64_t ow = 0; ow < OW; ow++) {
                    double s = b ? b[oc] : 0.0;
                    for (int64_t cl = 0; cl < CG; cl++)
                        for (int64_t i = 0; i < g->kh; i++)
                            for (int64_t j = 0; j < g->kw; j++) {
                                int64_t ih = oh * o->stride[0] - o->padding[0] + i * o->dilation[0];
                                int64_t iw = ow * o->stride[1] - o->padding[1] + j * o->dilation[1];
                                if (ih < 0 || ih >= g->h || iw < 0 || iw >= g->w) continue;
                                int64_t c = oc / OG * CG + cl;
                                s += x[((n * g->c + c) * g->h + ih) * g->w + iw] *
                                     w[((oc * CG + cl) * g->kh + i) * g->kw + j];
                            }
                    out[((n * g->o + oc) * OH + oh) * OW + ow] = s;
                }
    *oh_out = OH;
    *ow_out = OW;
    return out;
}

static double *host(const nb_tensor *t) {
    double *v = malloc(sizeof(double) * (size_t)nb_numel(t));
    nb_to_host_f64(t, v);
    return v;
}

/* Runs nb_conv2d in dtype dt (inputs made in f64 and cast) and compares
 * with the reference. */
static void check_forward(const geom *g, bool with_bias, nb_dtype dt, double tol) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn(ctx, NB_F64, 4, (int64_t[]){g->n, g->c, g->h, g->w}, 1);
    nb_tensor *w =
        nbt_randn(ctx, NB_F64, 4, (int64_t[]){g->o, g->c / groups_of(&g->opts), g->kh, g->kw}, 2);
    nb_tensor *b = with_bias ? nbt_randn(ctx, NB_F64, 1, (int64_t[]){g->o}, 3) : NULL;
    double *xh = host(x), *wh = host(w), *bh = b ? host(b) : NULL;
    int64_t OH, OW;
    double *ref = ref_conv(g, xh, wh, bh, &OH, &OW);
    nb_tensor *y = nb_conv2d(ctx, nb_cast(ctx, x, dt), nb_cast(ctx, w, dt),
                             b ? nb_cast(ctx, b, dt) : NULL, &g->opts);
    ck_assert_int_eq(y->dtype, dt);
    ck_assert_int_eq(y->ndim, 4);
    ck_assert_int_eq(y->shape[0], g->n);
    ck_assert_int_eq(y->shape[1], g->o);
    ck_assert_int_eq(y->shape[2], OH);
    ck_assert_int_eq(y->shape[3], OW);
    nbt_assert_close(y, ref, tol, tol);
    free(ref);
    free(xh);
    free(wh);
    free(bh);
    nb_ctx_free(ctx);
}

#define OPTS(s0, s1, p0, p1, d0, d1) ((nb_conv2d_opts){{s0, s1}, {p0, p1}, {d0, d1}, 1})

static const nb_conv2d_opts combos[] = {
    OPTS(1, 1, 0, 0, 1, 1), OPTS(2, 1, 1, 2, 1, 1), OPTS(1, 2, 2, 1, 2, 1),
    OPTS(3, 2, 0, 1, 1, 2), OPTS(2, 2, 1, 1, 2, 2), OPTS(1, 1, 3, 0, 1, 3),
};
#define NCOMBOS ((int)(sizeof combos / sizeof combos[0]))

START_TEST(test_forward_f64) {
    for (int k = 0; k < NCOMBOS; k++) {
        geom g = {2, 3, 9, 8, 4, 3, 2, combos[k]};
        check_forward(&g, true, NB_F64, 1e-12);
        check_forward(&g, false, NB_F64, 1e-12);
    }
}
END_TEST

START_TEST(test_forward_shapes) {
    /* 1x1 kernels (the no-im2col path and a strided one), a kernel as large
     * as the padded input, a single channel, batch of one */
    geom gs[] = {
        {3, 5, 4, 6, 7, 1, 1, OPTS(1, 1, 0, 0, 1, 1)},
        {2, 3, 5, 5, 2, 1, 1, OPTS(2, 2, 0, 0, 1, 1)},
        {2, 3, 5, 5, 2, 1, 1, OPTS(1, 1, 1, 1, 1, 1)},
        {1, 2, 4, 3, 3, 6, 5, OPTS(1, 1, 1, 1, 1, 1)},
        {1, 1, 6, 7, 1, 3, 3, OPTS(2, 3, 1, 0, 1, 1)},
    };
    for (size_t k = 0; k < sizeof gs / sizeof gs[0]; k++) {
        check_forward(&gs[k], true, NB_F64, 1e-12);
        check_forward(&gs[k], false, NB_F64, 1e-12);
    }
}
END_TEST

START_TEST(test_forward_f32) {
    for (int k = 0; k < NCOMBOS; k++) {
        geom g = {2, 3, 9, 8, 4, 3, 2, combos[k]};
        check_forward(&g, true, NB_F32, 1e-4);
    }
    geom g1 = {2, 4, 5, 5, 3, 1, 1, OPTS(1, 1, 0, 0, 1, 1)};
    check_forward(&g1, false, NB_F32, 1e-4);
}
END_TEST

NBT_CPU_TEST(test_default_opts) {
    nb_tensor *x = nbt_randn(ctx, NB_F64, 4, (int64_t[]){1, 2, 5, 4}, 4);
    nb_tensor *w = nbt_randn(ctx, NB_F64, 4, (int64_t[]){3, 2, 2, 2}, 5);
    nb_conv2d_opts def = NB_CONV2D_DEFAULTS;
    nbt_assert_tensors_close(nb_conv2d(ctx, x, w, NULL, NULL), nb_conv2d(ctx, x, w, NULL, &def), 0,
                             0);
}

/* ---- gradients ---- */
typedef struct conv_case {
    nb_conv2d_opts opts;
    bool transpose_x; /* inputs[0] is (N, C, W, H); convolve its transpose */
} conv_case;

static nb_tensor *conv_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const conv_case *cc = user;
    nb_tensor *x = cc->transpose_x ? nb_transpose(ctx, in[0], 2, 3) : in[0];
    return nb_conv2d(ctx, x, in[1], in[2], &cc->opts);
}

static nb_tensor *conv_fn_nobias(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const conv_case *cc = user;
    return nb_conv2d(ctx, in[0], in[1], NULL, &cc->opts);
}

NBT_CPU_TEST(test_gradcheck) {
    for (int k = 0; k < NCOMBOS; k++) {
        conv_case cc = {combos[k], false};
        nb_tensor *in[3] = {
            nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){2, 2, 6, 5}, 10 + (uint64_t)k),
            nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){3, 2, 3, 2}, 20 + (uint64_t)k),
            nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){3}, 30 + (uint64_t)k),
        };
        NBT_GRADCHECK(conv_fn, &cc, 3, in);
        NBT_GRADCHECK(conv_fn_nobias, &cc, 2, in);
    }
}

NBT_CPU_TEST(test_gradcheck_pointwise) {
    conv_case cc = {OPTS(1, 1, 0, 0, 1, 1), false};
    nb_tensor *in[3] = {
        nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){2, 3, 3, 4}, 40),
        nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){2, 3, 1, 1}, 41),
        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){2}, 42),
    };
    NBT_GRADCHECK(conv_fn, &cc, 3, in);
}

NBT_CPU_TEST(test_gradcheck_partial) {
    /* only one of the operands requires grad at a time */
    conv_case cc = {OPTS(2, 1, 1, 1, 1, 2), false};
    for (int which = 0; which < 3; which++) {
        nb_tensor *in[3] = {
            nbt_randn(ctx, NB_F64, 4, (int64_t[]){2, 2, 5, 6}, 50),
            nbt_randn(ctx, NB_F64, 4, (int64_t[]){2, 2, 3, 2}, 51),
            nbt_randn(ctx, NB_F64, 1, (int64_t[]){2}, 52),
        };
        nb_set_requires_grad(in[which], true);
        NBT_GRADCHECK(conv_fn, &cc, 3, in);
    }
}

NBT_CPU_TEST(test_non_contiguous) {
    conv_case cc = {OPTS(1, 2, 1, 0, 1, 1), true};
    /* x stored as (N, C, W, H); weight a strided slice of a larger tensor */
    nb_tensor *xt = nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){2, 2, 5, 6}, 60);
    nb_tensor *wbig = nbt_randn(ctx, NB_F64, 4, (int64_t[]){6, 2, 3, 2}, 61);
    nb_tensor *w = nb_slice(ctx, wbig, 0, 0, 6, 2);
    ck_assert(!nb_is_contiguous(w));
    nb_tensor *x = nb_transpose(ctx, xt, 2, 3);
    ck_assert(!nb_is_contiguous(x));
    nb_tensor *y = nb_conv2d(ctx, x, w, NULL, &cc.opts);

    geom g = {2, 2, 6, 5, 3, 3, 2, cc.opts};
    double *xh = host(x), *wh = host(w);
    int64_t OH, OW;
    double *ref = ref_conv(&g, xh, wh, NULL, &OH, &OW);
    nbt_assert_close(y, ref, 1e-12, 1e-12);
    free(ref);
    free(xh);
    free(wh);

    nb_tensor *in[3] = {xt, nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){3, 2, 3, 2}, 62),
                        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){3}, 63)};
    NBT_GRADCHECK(conv_fn, &cc, 3, in);
}

NBT_CPU_TEST(test_backward_accumulates) {
    /* the weight gradient sums over images: a batch of two equals the sum of
     * two batches of one */
    nb_conv2d_opts o = OPTS(1, 1, 1, 1, 1, 1);
    nb_tensor *x = nbt_randn(ctx, NB_F64, 4, (int64_t[]){2, 2, 4, 4}, 70);
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){3, 2, 3, 3}, 71);
    nb_tensor *b = nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){3}, 72);
    nb_backward(nb_sum_all(ctx, nb_conv2d(ctx, x, w, b, &o)));
    nb_tensor *gw_batch = nb_clone(ctx, w->grad), *gb_batch = nb_clone(ctx, b->grad);
    nb_zero_grad(w);
    nb_zero_grad(b);
    for (int64_t i = 0; i < 2; i++)
        nb_backward(nb_sum_all(ctx, nb_conv2d(ctx, nb_narrow(ctx, x, 0, i, 1), w, b, &o)));
    nbt_assert_tensors_close(w->grad, gw_batch, 1e-12, 1e-12);
    nbt_assert_tensors_close(b->grad, gb_batch, 1e-12, 1e-12);
    /* bias gradient of sum(y) is N * OH * OW */
    double expect_b[3] = {2 * 16, 2 * 16, 2 * 16};
    nbt_assert_close(gb_batch, expect_b, 0, 0);
}

/* ---- errors ---- */
/* Several images per GEMM (Note [Images per GEMM] in tensor/cpu/conv.c):
 * columns (K 18 + OG 14) * P 4096 per image put two images in a GEMM, so a
 * batch of 3 runs a chunk of two and one of one, in two groups. Forward and
 * the three gradients of sum(y * r) against loops in double straight from
 * the definition. */
NBT_CPU_TEST(test_images_per_gemm) {
    nb_conv2d_opts o = OPTS(1, 1, 1, 1, 1, 1);
    o.groups = 2;
    const geom g = {3, 4, 64, 64, 28, 3, 3, o};
    const int64_t CG = 2, OG = 14, OH = 64, OW = 64;
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){g.n, g.c, g.h, g.w}, 41);
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){g.o, CG, g.kh, g.kw}, 42);
    nb_tensor *b = nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){g.o}, 43);
    nb_tensor *r = nbt_randn(ctx, NB_F64, 4, (int64_t[]){g.n, g.o, OH, OW}, 44);
    nb_tensor *y = nb_conv2d(ctx, x, w, b, &g.opts);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, y, r)));
    double *xh = host(x), *wh = host(w), *bh = host(b), *rh = host(r);
    int64_t oh_, ow_;
    double *ref = ref_conv(&g, xh, wh, bh, &oh_, &ow_);
    nbt_assert_close(y, ref, 1e-12, 1e-12);
    double *dx = calloc((size_t)nb_numel(x), sizeof(double));
    double *dw = calloc((size_t)nb_numel(w), sizeof(double));
    double *db = calloc((size_t)g.o, sizeof(double));
    for (int64_t n = 0; n < g.n; n++)
        for (int64_t oc = 0; oc < g.o; oc++)
            for (int64_t oh = 0; oh < OH; oh++)
                for (int64_t ow = 0; ow < OW; ow++) {
                    double rv = rh[((n * g.o + oc) * OH + oh) * OW + ow];
                    db[oc] += rv;
                    for (int64_t cl = 0; cl < CG; cl++)
                        for (int64_t i = 0; i < g.kh; i++)
                            for (int64_t j = 0; j < g.kw; j++) {
                                int64_t ih = oh - 1 + i, iw = ow - 1 + j;
                                if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) continue;
                                int64_t xi = ((n * g.c + oc / OG * CG + cl) * g.h + ih) * g.w + iw;
                                int64_t wi = ((oc * CG + cl) * g.kh + i) * g.kw + j;
                                dx[xi] += rv * wh[wi];
                                dw[wi] += rv * xh[xi];
                            }
                }
    nbt_assert_close(x->grad, dx, 1e-11, 1e-11);
    nbt_assert_close(w->grad, dw, 1e-11, 1e-11);
    nbt_assert_close(b->grad, db, 1e-11, 1e-11);
    free(xh), free(wh), free(bh), free(rh), free(ref), free(dx), free(dw), free(db);
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3, 8, 8));
    nb_tensor *w = nb_zeros(ctx, NB_F32, NB_SHAPE(16, 4, 3, 3));
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, w, NULL, NULL),
                     "nb_conv2d: input has 3 channels but weight (16, 4, 3, 3) expects 4");
    nb_tensor *w3 = nb_zeros(ctx, NB_F32, NB_SHAPE(16, 3, 3, 3));
    NBT_EXPECT_ABORT(nb_conv2d(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(3, 8, 8)), w3, NULL, NULL),
                     "nb_conv2d: input must be 4-D (N, C, H, W), got shape (3, 8, 8)");
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(16, 3, 3)), NULL, NULL),
                     "nb_conv2d: weight must be 4-D");
    nb_tensor *small = nb_zeros(ctx, NB_F32, NB_SHAPE(1, 3, 2, 8));
    NBT_EXPECT_ABORT(nb_conv2d(ctx, small, w3, NULL, NULL),
                     "nb_conv2d: output size is not positive");
    nb_conv2d_opts dil = OPTS(1, 1, 0, 0, 4, 1); /* effective kernel 9 > 8 */
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, w3, NULL, &dil), "output size is not positive");
    nb_conv2d_opts s0 = OPTS(0, 1, 0, 0, 1, 1);
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, w3, NULL, &s0),
                     "nb_conv2d: stride must be positive, got (0, 1)");
    nb_conv2d_opts d0 = OPTS(1, 1, 0, 0, 1, -1);
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, w3, NULL, &d0),
                     "nb_conv2d: dilation must be positive, got (1, -1)");
    nb_conv2d_opts pn = OPTS(1, 1, -1, 0, 1, 1);
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, w3, NULL, &pn), "nb_conv2d: padding must be non-negative");
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, w3, nb_zeros(ctx, NB_F32, NB_SHAPE(15)), NULL),
                     "nb_conv2d: bias (15,) does not match weight (16, 3, 3, 3)");
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, nb_zeros(ctx, NB_F64, NB_SHAPE(16, 3, 3, 3)), NULL, NULL),
                     "nb_conv2d: dtypes differ");
    NBT_EXPECT_ABORT(nb_conv2d(ctx, nb_zeros(ctx, NB_I32, NB_SHAPE(2, 3, 8, 8)), w3, NULL, NULL),
                     "nb_conv2d: dtype i32 is not supported");
}

/* ---- channel groups ---- */
static nb_conv2d_opts with_groups(nb_conv2d_opts o, int groups) {
    o.groups = groups;
    return o;
}

/* (C, O, G): two and four groups, depthwise (G = C), depthwise with a
 * channel multiplier of 2 (O = 2C), and groups of more than one input
 * channel feeding fewer outputs */
static const int64_t group_shapes[][3] = {{4, 6, 2}, {8, 8, 4}, {3, 3, 3}, {4, 8, 4}, {6, 2, 2}};
#define NGROUP_SHAPES ((int)(sizeof group_shapes / sizeof group_shapes[0]))

START_TEST(test_groups_forward) {
    for (int s = 0; s < NGROUP_SHAPES; s++)
        for (int k = 0; k < NCOMBOS; k++) {
            const int64_t *cs = group_shapes[s];
            geom g = {2, cs[0], 9, 8, cs[1], 3, 2, with_groups(combos[k], (int)cs[2])};
            check_forward(&g, true, NB_F64, 1e-12);
            check_forward(&g, false, NB_F64, 1e-12);
            check_forward(&g, true, NB_F32, 1e-4);
        }
    /* 1x1 kernels (the image is its own columns) and a kernel as large as
     * the padded input, grouped and depthwise */
    geom gs[] = {
        {3, 4, 4, 6, 6, 1, 1, with_groups(OPTS(1, 1, 0, 0, 1, 1), 2)},
        {2, 4, 5, 5, 4, 1, 1, with_groups(OPTS(1, 1, 0, 0, 1, 1), 4)},
        {2, 4, 5, 5, 8, 1, 1, with_groups(OPTS(2, 2, 0, 0, 1, 1), 4)},
        {1, 4, 4, 3, 2, 6, 5, with_groups(OPTS(1, 1, 1, 1, 1, 1), 2)},
        {1, 3, 4, 3, 3, 6, 5, with_groups(OPTS(1, 1, 1, 1, 1, 1), 3)},
    };
    for (size_t k = 0; k < sizeof gs / sizeof gs[0]; k++) {
        check_forward(&gs[k], true, NB_F64, 1e-12);
        check_forward(&gs[k], false, NB_F64, 1e-12);
    }
}
END_TEST

NBT_CPU_TEST(test_groups_gradcheck) {
    const nb_conv2d_opts settings[] = {OPTS(1, 1, 0, 0, 1, 1), OPTS(2, 1, 1, 2, 1, 1),
                                       OPTS(1, 2, 2, 1, 2, 1), OPTS(1, 1, 1, 0, 1, 1)};
    const int64_t kernels[][2] = {{3, 2}, {2, 3}, {3, 3}, {1, 1}};
    for (int s = 0; s < NGROUP_SHAPES; s++)
        for (int k = 0; k < 4; k++) {
            const int64_t *cs = group_shapes[s];
            conv_case cc = {with_groups(settings[k], (int)cs[2]), false};
            uint64_t seed = 100 + 10 * (uint64_t)(s * 4 + k);
            nb_tensor *in[3] = {
                nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){2, cs[0], 5, 6}, seed),
                nbt_randn_leaf(ctx, NB_F64, 4,
                               (int64_t[]){cs[1], cs[0] / cs[2], kernels[k][0], kernels[k][1]},
                               seed + 1),
                nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){cs[1]}, seed + 2),
            };
            NBT_GRADCHECK(conv_fn, &cc, 3, in);
            NBT_GRADCHECK(conv_fn_nobias, &cc, 2, in);
        }
}

NBT_CPU_TEST(test_groups_gradcheck_partial) {
    /* one operand requiring grad at a time, grouped (GEMM path) and
     * depthwise (direct path) */
    const int64_t shapes[][3] = {{4, 6, 2}, {4, 8, 4}};
    for (int s = 0; s < 2; s++)
        for (int which = 0; which < 3; which++) {
            const int64_t *cs = shapes[s];
            conv_case cc = {with_groups(OPTS(2, 1, 1, 1, 1, 2), (int)cs[2]), false};
            nb_tensor *in[3] = {
                nbt_randn(ctx, NB_F64, 4, (int64_t[]){2, cs[0], 5, 6}, 200),
                nbt_randn(ctx, NB_F64, 4, (int64_t[]){cs[1], cs[0] / cs[2], 3, 2}, 201),
                nbt_randn(ctx, NB_F64, 1, (int64_t[]){cs[1]}, 202),
            };
            nb_set_requires_grad(in[which], true);
            NBT_GRADCHECK(conv_fn, &cc, 3, in);
        }
}

NBT_CPU_TEST(test_groups_non_contiguous) {
    /* a transposed input through a depthwise convolution */
    conv_case cc = {with_groups(OPTS(1, 2, 1, 0, 1, 1), 3), true};
    nb_tensor *in[3] = {nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){2, 3, 5, 6}, 210),
                        nbt_randn_leaf(ctx, NB_F64, 4, (int64_t[]){6, 1, 3, 2}, 211),
                        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){6}, 212)};
    NBT_GRADCHECK(conv_fn, &cc, 3, in);
}

NBT_CPU_TEST(test_groups_errors) {
    nb_tensor *x = nb_zeros(ctx, NB_F32, NB_SHAPE(2, 6, 8, 8));
    nb_conv2d_opts g4 = with_groups(OPTS(1, 1, 0, 0, 1, 1), 4);
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(8, 1, 3, 3)), NULL, &g4),
                     "nb_conv2d: input (2, 6, 8, 8) has 6 channels, not divisible by groups 4");
    nb_conv2d_opts g3 = with_groups(OPTS(1, 1, 0, 0, 1, 1), 3);
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(4, 2, 3, 3)), NULL, &g3),
                     "nb_conv2d: weight (4, 2, 3, 3) has 4 output channels, not divisible by "
                     "groups 3");
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(6, 6, 3, 3)), NULL, &g3),
                     "nb_conv2d: input (2, 6, 8, 8) with groups 3 has 2 channels per group but "
                     "weight (6, 6, 3, 3) expects 6 (weight must be (O, C/groups, KH, KW))");
    nb_conv2d_opts gn = with_groups(OPTS(1, 1, 0, 0, 1, 1), -2);
    NBT_EXPECT_ABORT(nb_conv2d(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(6, 3, 3, 3)), NULL, &gn),
                     "nb_conv2d: groups must be positive, got -2");
    /* groups 0 (an initialiser without the field) is one group */
    nb_conv2d_opts g0 = with_groups(OPTS(1, 1, 0, 0, 1, 1), 0);
    nb_tensor *y = nb_conv2d(ctx, x, nb_zeros(ctx, NB_F32, NB_SHAPE(5, 6, 3, 3)), NULL, &g0);
    ck_assert_int_eq(y->shape[1], 5);
}

static Suite *conv_suite(void) {
    const TTest *tests[] = {test_forward_f64, test_forward_shapes, test_forward_f32, test_images_per_gemm,
                             test_default_opts, test_gradcheck, test_gradcheck_pointwise,
                             test_gradcheck_partial, test_non_contiguous, test_backward_accumulates,
                             test_errors, test_groups_forward, test_groups_gradcheck,
                             test_groups_gradcheck_partial, test_groups_non_contiguous, test_groups_errors,
                             NULL};
    return nbt_suite("conv", "conv2d", 0, tests);
}

int main(void) { return nbt_run(conv_suite()); }
