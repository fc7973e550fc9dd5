/* CUDA against the CPU: layer norm (with and without weight and bias, f32,
 * bf16, f64, one or two normalised dims, odd and large rows, transposed
 * input), embedding (repeated indices, i32 and i64, transposed table,
 * bitwise-deterministic backward equal to the CPU's for f32, out-of-range
 * indices reported at synchronisation), the GPT's input (token plus
 * position rows: f32 and bf16 outputs, its backward adding into gradients
 * that hold values, bitwise equal to the CPU's), dropout and the random fills
 * (bit-identical to the CPU's for f32). Skipped (77) without CUDA or a GPU.
 *
 * The suite runs without fork (CUDA does not survive one); the
 * out-of-range test leaves a fault reported on the device, so it runs last. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_parity.h"
#include "tensor/internal.h"
#include "testutil.h"

/* ---- helpers ---- */
static nb_ctx *cpu_ctx(void) { return nb_ctx_new(nb_cpu(), 0); }
static nb_ctx *gpu_ctx(void) { return nb_ctx_new(nb_cuda(0), 0); }

/* a and b (any devices, any dtypes) hold the same values, bit for bit. */
static void assert_bitwise(const char *what, const nb_tensor *a, const nb_tensor *b) {
    ck_assert_msg(nb_numel(a) == nb_numel(b), "%s: %lld vs %lld elements", what,
                  (long long)nb_numel(a), (long long)nb_numel(b));
    double *va = nbt_values(a), *vb = nbt_values(b);
    int64_t n = nb_numel(a), bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (memcmp(&va[i], &vb[i], sizeof(double)) != 0 && !(isnan(va[i]) && isnan(vb[i])))
            bad = i;
    double x = bad >= 0 ? va[bad] : 0, y = bad >= 0 ? vb[bad] : 0;
    free(va);
    free(vb);
    ck_assert_msg(bad < 0, "%s: element %lld differs: %.9g vs %.9g", what, (long long)bad, x, y);
}

/* ---- layer norm ---- */
typedef struct ln_case {
    int norm_ndim;
    bool weight, bias;
} ln_case;

static nb_tensor *ln_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const ln_case *c = user;
    int k = 1;
    nb_tensor *w = c->weight ? in[k++] : NULL;
    nb_tensor *b = c->bias ? in[k++] : NULL;
    return nb_layer_norm(ctx, in[0], c->norm_ndim, w, b, 1e-5);
}

static void ln_parity(const char *name, nb_dtype dt, int ndim, const int64_t *shape, ln_case c,
                      bool transposed) {
    nbt_input in[3] = {{0}};
    int n = 0;
    in[n].dtype = dt;
    in[n].ndim = ndim;
    memcpy(in[n].shape, shape, sizeof(int64_t) * (size_t)ndim);
    in[n].lo = -2;
    in[n].hi = 3; /* mean away from zero */
    in[n].transposed = transposed;
    n++;
    for (int p = 0; p < 2; p++) {
        if (!(p == 0 ? c.weight : c.bias)) continue;
        in[n].dtype = dt;
        in[n].ndim = c.norm_ndim;
        memcpy(in[n].shape, shape + ndim - c.norm_ndim, sizeof(int64_t) * (size_t)c.norm_ndim);
        in[n].lo = 0.5;
        in[n].hi = 1.5;
        n++;
    }
    nbt_parity(name, ln_op, &c, n, in, NULL);
}

/* Note [Layer norm's gradients added in place] (tensor/ops_norm.c): two
 * residual blocks h + ln(h) W sharing w, b and W, made as a module's
 * forward makes them: the first block's x is the leaf (its gradient from
 * the add, then ln's added into it), the second's the library's h (added
 * into once the product's node has run); the second block's ln writes the
 * weight's and bias's gradients, the first's adds into them. */
static nb_tensor *ln_residual_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    nb__scope_enter(ctx);
    nb_tensor *h = in[0];
    for (int k = 0; k < 2; k++)
        h = nb_add(ctx, h, nb_matmul(ctx, nb_layer_norm(ctx, h, 1, in[1], in[2], 1e-5), in[3]));
    nb__scope_exit(ctx, h);
    return h;
}

START_TEST(test_layer_norm_residual_parity) {
    const nb_dtype dts[] = {NB_F32, NB_BF16};
    for (int k = 0; k < 2; k++) {
        nbt_input in[4] = {{.dtype = dts[k], .ndim = 2, .shape = {70, 96}, .lo = -2, .hi = 3},
                           {.dtype = dts[k], .ndim = 1, .shape = {96}, .lo = 0.5, .hi = 1.5},
                           {.dtype = dts[k], .ndim = 1, .shape = {96}, .lo = -1, .hi = 1},
                           {.dtype = dts[k], .ndim = 2, .shape = {96, 96}, .lo = -0.2, .hi = 0.2}};
        nbt_parity("layer_norm residual blocks (70, 96)", ln_residual_op, NULL, 4, in, NULL);
    }
}
END_TEST

START_TEST(test_layer_norm_parity) {
    const ln_case full = {1, true, true}, none = {1, false, false}, w_only = {1, true, false};
    const ln_case b_only = {1, false, true}, two = {2, true, true};
    const nb_dtype dts[] = {NB_F32, NB_BF16, NB_F64};
    for (int k = 0; k < 3; k++) {
        nb_dtype dt = dts[k];
        ln_parity("layer_norm (3, 5, 33)", dt, 3, (int64_t[]){3, 5, 33}, full, false);
        ln_parity("layer_norm no affine (7, 64)", dt, 2, (int64_t[]){7, 64}, none, false);
        ln_parity("layer_norm weight only (4, 7)", dt, 2, (int64_t[]){4, 7}, w_only, false);
        ln_parity("layer_norm bias only (9, 31)", dt, 2, (int64_t[]){9, 31}, b_only, false);
        ln_parity("layer_norm one row (1, 1037)", dt, 2, (int64_t[]){1, 1037}, full, false);
        ln_parity("layer_norm d = 1 (5, 1)", dt, 2, (int64_t[]){5, 1}, full, false);
        ln_parity("layer_norm two dims (3, 4, 5)", dt, 3, (int64_t[]){3, 4, 5}, two, false);
        ln_parity("layer_norm transposed (33, 7)", dt, 2, (int64_t[]){33, 7}, full, true);
    }
    /* many rows: several row chunks in the dw/db reduction */
    ln_parity("layer_norm (2500, 96)", NB_F32, 2, (int64_t[]){2500, 96}, full, false);
    ln_parity("layer_norm (2, 1111, 40)", NB_BF16, 3, (int64_t[]){2, 1111, 40}, full, false);
}
END_TEST

/* The register path of tensor/cuda/layer_norm.cu (Note [Layer norm rows in
 * registers]) against the CPU, in every float dtype: GPT-2 widths (one warp
 * per row, groups of 64 and more threads), widths that 4 or 8 does not
 * divide (element accesses), rows longer than the register path takes (the
 * general kernels), rows at an offset that is not 16-byte aligned, many
 * rows (dw/db over many blocks), and each of dx, dw, db absent. */
typedef struct ln_view_case {
    ln_case c;
    int64_t m, d;
    int view; /* 0: plain (m, d); 1: rows 1..m of (m + 1, d); 2: elements 1.. of m d + 1 */
} ln_view_case;

static nb_tensor *ln_view_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const ln_view_case *v = user;
    nb_tensor *x = in[0];
    if (v->view == 1) x = nb_narrow(ctx, x, 0, 1, v->m);
    if (v->view == 2)
        x = nb_reshape(ctx, nb_narrow(ctx, x, 0, 1, v->m * v->d), NB_SHAPE(v->m, v->d));
    int k = 1;
    nb_tensor *w = v->c.weight ? in[k++] : NULL;
    nb_tensor *b = v->c.bias ? in[k++] : NULL;
    return nb_layer_norm(ctx, x, 1, w, b, 1e-5);
}

/* no_grad: bit 0 x, bit 1 weight, bit 2 bias */
static void ln_view_parity(const char *what, nb_dtype dt, int64_t m, int64_t d, int view,
                           ln_case c, int no_grad) {
    ln_view_case v = {c, m, d, view};
    nbt_input in[3] = {{0}};
    int n = 0;
    in[n].dtype = dt;
    in[n].ndim = view == 2 ? 1 : 2;
    in[n].shape[0] = view == 0 ? m : view == 1 ? m + 1 : m * d + 1;
    in[n].shape[1] = d;
    in[n].lo = -2;
    in[n].hi = 3;
    in[n].no_grad = no_grad & 1;
    n++;
    for (int p = 0; p < 2; p++) {
        if (!(p == 0 ? c.weight : c.bias)) continue;
        in[n].dtype = dt;
        in[n].ndim = 1;
        in[n].shape[0] = d;
        in[n].lo = 0.5;
        in[n].hi = 1.5;
        in[n].no_grad = (no_grad >> (1 + p)) & 1;
        n++;
    }
    char name[128];
    snprintf(name, sizeof name, "layer_norm %s (%lld, %lld) %s", what, (long long)m, (long long)d,
             nb_dtype_name(dt));
    nbt_parity(name, ln_view_op, &v, n, in, NULL);
}

START_TEST(test_layer_norm_parity_rows) {
    const ln_case full = {1, true, true}, none = {1, false, false};
    const nb_dtype dts[] = {NB_F32, NB_BF16, NB_F16, NB_F64};
    for (int k = 0; k < 4; k++) {
        nb_dtype dt = dts[k];
        const int64_t widths[] = {768, 1024, 1600, 4096};
        for (int i = 0; i < 4; i++) ln_view_parity("GPT-2 width", dt, 5, widths[i], 0, full, 0);
        ln_view_parity("d % 4 = 2", dt, 6, 770, 0, full, 0);
        ln_view_parity("d % 8 = 4", dt, 6, 1036, 0, full, 0);
        ln_view_parity("odd d", dt, 6, 1027, 0, full, 0);
        ln_view_parity("odd d, groups of 128", dt, 3, 2999, 0, full, 0);
        ln_view_parity("small d", dt, 9, 40, 0, full, 0);
        ln_view_parity("longer rows", dt, 3, 6000, 0, full, 0);
        ln_view_parity("longer than the register path", dt, 2, 20000, 0, full, 0);
        ln_view_parity("rows at an odd offset", dt, 7, 1027, 1, full, 0);
        ln_view_parity("rows one element in", dt, 7, 768, 2, full, 0);
        ln_view_parity("rows one element in, block groups", dt, 3, 1600, 2, full, 0);
        ln_view_parity("many rows", dt, 2100, 768, 0, full, 0);
        ln_view_parity("no affine", dt, 33, 768, 0, none, 0);
        ln_view_parity("dw, db only", dt, 33, 1024, 0, full, 1);
        ln_view_parity("dx, db only", dt, 33, 768, 0, full, 2);
        ln_view_parity("dx, dw only", dt, 33, 1600, 0, full, 4);
        ln_view_parity("dx only, with affine", dt, 33, 768, 0, full, 6);
    }
    /* more than 512 x 32 rows: the dw/db blocks hold more than 32 rows each */
    ln_view_parity("rows beyond the block cap", NB_F32, 17000, 64, 0, full, 0);
    ln_view_parity("rows beyond the block cap, a row view", NB_BF16, 17000, 72, 1, full, 0);
}
END_TEST

/* Layer norm backward twice on the same (m, d) inputs of dtype dt: dx, dw
 * and db bitwise equal. */
static void layer_norm_backward_twice(nb_dtype dt, int64_t m, int64_t d, uint64_t seed,
                                      const char *what) {
    nb_ctx *g = gpu_ctx();
    nb_tensor *out[2][3];
    nb_tensor *r = nb_rand_normal(g, dt, NB_SHAPE(m, d), 0.0, 1.0, &(nb_rng){seed + 1, 0});
    for (int run = 0; run < 2; run++) {
        nb_tensor *xl = nb_rand_normal(g, dt, NB_SHAPE(m, d), 1.0, 2.0, &(nb_rng){seed, 0});
        nb_set_requires_grad(xl, true);
        nb_tensor *w = nb_rand_uniform(g, dt, NB_SHAPE(d), 0.5, 1.5, &(nb_rng){seed + 3, 0});
        nb_tensor *b = nb_rand_uniform(g, dt, NB_SHAPE(d), -1, 1, &(nb_rng){seed + 4, 0});
        nb_set_requires_grad(w, true);
        nb_set_requires_grad(b, true);
        nb_tensor *y = nb_layer_norm(g, xl, 1, w, b, 1e-5);
        nb_backward(nb_sum_all(g, nb_mul(g, y, r)));
        out[run][0] = xl->grad;
        out[run][1] = w->grad;
        out[run][2] = b->grad;
    }
    static const char *const names[3] = {"dx", "dw", "db"};
    for (int i = 0; i < 3; i++) {
        char name[96];
        snprintf(name, sizeof name, "layer_norm %s (%s, d = %lld)", names[i], what, (long long)d);
        assert_bitwise(name, out[0][i], out[1][i]);
    }
    nb_ctx_free(g);
}

/* The register path's dw/db, for a width with one warp per row (groups
 * added in shared memory) and one with a group per block, on rows that
 * take many blocks. */
START_TEST(test_layer_norm_backward_deterministic_rows) {
    NBT_DEVICE_ONLY("determinism of the CUDA backward");
    layer_norm_backward_twice(NB_BF16, 5000, 256, 21, "register path");
    layer_norm_backward_twice(NB_BF16, 5000, 1600, 21, "register path");
}
END_TEST

/* Rows of 77, not a multiple of any vector width. */
START_TEST(test_layer_norm_backward_deterministic) {
    NBT_DEVICE_ONLY("determinism of the CUDA backward");
    layer_norm_backward_twice(NB_F32, 4099, 77, 11, "odd width");
}
END_TEST

/* ---- embedding ---- */
static nb_tensor *emb_op(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    return nb_embedding(ctx, in[0], in[1]);
}

START_TEST(test_embedding_parity) {
    /* indices with many repeats: 40 positions over 6 rows of 37 */
    double rep[40];
    for (int i = 0; i < 40; i++) rep[i] = (double)((i * 7) % 6 + (i % 3 == 0 ? 30 : 0));
    const nb_dtype dts[] = {NB_F32, NB_BF16, NB_F64};
    const nb_dtype its[] = {NB_I64, NB_I32};
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < 2; j++) {
            nbt_input in[2] = {{.dtype = dts[k], .ndim = 2, .shape = {37, 19}},
                               {.dtype = its[j], .ndim = 2, .shape = {5, 8}, .values = rep}};
            nbt_parity("embedding repeated (37, 19)[(5, 8)]", emb_op, NULL, 2, in, NULL);
            nbt_input rnd[2] = {{.dtype = dts[k], .ndim = 2, .shape = {1001, 33}},
                                {.dtype = its[j], .ndim = 1, .shape = {777}, .lo = 0, .hi = 1001}};
            nbt_parity("embedding random (1001, 33)[777]", emb_op, NULL, 2, rnd, NULL);
            nbt_input tr[2] = {{.dtype = dts[k], .ndim = 2, .shape = {50, 7}, .transposed = true},
                               {.dtype = its[j], .ndim = 1, .shape = {9}, .lo = 0, .hi = 50}};
            nbt_parity("embedding transposed table (50, 7)[9]", emb_op, NULL, 2, tr, NULL);
            nbt_input one[2] = {{.dtype = dts[k], .ndim = 2, .shape = {1, 1}},
                                {.dtype = its[j], .ndim = 1, .shape = {3}, .lo = 0, .hi = 1}};
            nbt_parity("embedding (1, 1)[3]", emb_op, NULL, 2, one, NULL);
        }
}
END_TEST

/* gw of a backward with many repeats, twice on CUDA and once on the CPU:
 * all three bitwise equal (f32 sums in increasing position everywhere). */
START_TEST(test_embedding_backward_bitwise) {
    NBT_DEVICE_ONLY("bitwise CUDA against the CPU: trivially true on the CPU");
    nb_ctx *c = cpu_ctx(), *g = gpu_ctx();
    int64_t v = 53, ch = 129, np = 5000; /* indices reach 12 + 40 = 52 */
    int64_t *idx = malloc(sizeof *idx * (size_t)np);
    for (int64_t p = 0; p < np; p++) idx[p] = (p * 2654435761u >> 7) % 13 + (p % 97 == 0 ? 40 : 0);
    nb_tensor *wc = nb_rand_normal(c, NB_F32, NB_SHAPE(v, ch), 0, 1, &(nb_rng){21, 0});
    nb_tensor *rc = nb_rand_normal(c, NB_F32, NB_SHAPE(np, ch), 0, 1, &(nb_rng){22, 0});
    nb_tensor *ic = nb_from_host(c, NB_I64, NB_SHAPE(np), idx);
    nb_set_requires_grad(wc, true);
    nb_backward(nb_sum_all(c, nb_mul(c, nb_embedding(c, wc, ic), rc)));
    nb_tensor *gws[2];
    for (int run = 0; run < 2; run++) {
        /* the CPU's values, uploaded: this test is about the backward's
         * order of additions, not about the device's normal fill */
        nb_tensor *wg = nb_to(g, nb_detach(c, wc)), *rg = nb_to(g, rc);
        nb_tensor *ig = nb_from_host(g, NB_I64, NB_SHAPE(np), idx);
        nb_set_requires_grad(wg, true);
        nb_backward(nb_sum_all(g, nb_mul(g, nb_embedding(g, wg, ig), rg)));
        gws[run] = wg->grad;
    }
    assert_bitwise("embedding backward, two CUDA runs", gws[0], gws[1]);
    assert_bitwise("embedding backward, CUDA vs CPU", gws[0], wc->grad);
    free(idx);
    nb_ctx_free(g);
    nb_ctx_free(c);
}
END_TEST

/* ---- dropout and random fills ---- */
START_TEST(test_dropout_bitwise) {
    NBT_DEVICE_ONLY("bitwise CUDA against the CPU: trivially true on the CPU");
    nb_ctx *c = cpu_ctx(), *g = gpu_ctx();
    const int64_t ns[] = {1, 7, 4099};
    const double ps[] = {0.1, 0.5, 0.9, 1.0};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 4; b++) {
            int64_t n = ns[a];
            nb_tensor *xc = nb_rand_normal(c, NB_F32, 1, &n, 0, 1, &(nb_rng){31, 0});
            nb_tensor *xg = nb_rand_normal(g, NB_F32, 1, &n, 0, 1, &(nb_rng){31, 0});
            assert_bitwise("dropout input", xc, xg);
            nb_set_requires_grad(xc, true);
            nb_set_requires_grad(xg, true);
            nb_rng rc = {77, 5 + (uint64_t)a}, rg = rc;
            nb_tensor *yc = nb_dropout(c, xc, ps[b], true, &rc);
            nb_tensor *yg = nb_dropout(g, xg, ps[b], true, &rg);
            ck_assert(rc.offset == rg.offset);
            assert_bitwise("dropout output", yc, yg);
            nb_backward(nb_sum_all(c, yc));
            nb_backward(nb_sum_all(g, yg));
            assert_bitwise("dropout mask (gradient)", xc->grad, xg->grad);
            /* bf16: the same elements dropped */
            nb_rng rb = {77, 5 + (uint64_t)a};
            nb_tensor *yb = nb_dropout(g, nb_cast(g, xg, NB_BF16), ps[b], true, &rb);
            double *vb = nbt_values(yb), *vc = nbt_values(yc);
            for (int64_t i = 0; i < n; i++)
                ck_assert_msg((vb[i] == 0) == (vc[i] == 0), "bf16 dropout element %lld: %g vs %g",
                              (long long)i, vb[i], vc[i]);
            free(vb);
            free(vc);
        }
    /* a view one element in (not aligned for the vector accesses), and an
     * aligned one: the same masks either way */
    for (int64_t start = 1; start <= 4; start += 3) {
        int64_t n = 4099;
        nb_tensor *xc = nb_rand_normal(c, NB_F32, 1, &n, 0, 1, &(nb_rng){32, 0});
        nb_tensor *xg = nb_rand_normal(g, NB_F32, 1, &n, 0, 1, &(nb_rng){32, 0});
        nb_rng rc = {78, 3}, rg = rc;
        nb_tensor *yc = nb_dropout(c, nb_narrow(c, xc, 0, start, n - start), 0.3, true, &rc);
        nb_tensor *yg = nb_dropout(g, nb_narrow(g, xg, 0, start, n - start), 0.3, true, &rg);
        assert_bitwise(start == 1 ? "dropout of an unaligned view" : "dropout of an aligned view",
                       yc, yg);
    }
    nb_ctx_free(g);
    nb_ctx_free(c);
}
END_TEST

START_TEST(test_rand_fills_bitwise) {
    NBT_DEVICE_ONLY("bitwise CUDA against the CPU: trivially true on the CPU");
    nb_ctx *c = cpu_ctx(), *g = gpu_ctx();
    const int64_t ns[] = {1, 2, 3, 5, 1001, 4099};
    const nb_dtype exact[] = {NB_F32, NB_BF16, NB_F16};
    for (int a = 0; a < 6; a++) {
        int64_t n = ns[a];
        for (int k = 0; k < 3; k++) {
            nb_rng rc = {1234 + (uint64_t)a, 99}, rg = rc;
            nb_tensor *uc = nb_rand_uniform(c, exact[k], 1, &n, -2, 3, &rc);
            nb_tensor *ug = nb_rand_uniform(g, exact[k], 1, &n, -2, 3, &rg);
            assert_bitwise("rand_uniform", uc, ug);
            nb_tensor *zc = nb_rand_normal(c, exact[k], 1, &n, 0.5, 2, &rc);
            nb_tensor *zg = nb_rand_normal(g, exact[k], 1, &n, 0.5, 2, &rg);
            assert_bitwise("rand_normal", zc, zg);
            ck_assert(rc.offset == rg.offset);
        }
        /* f64: uniform exact; normal within the last bits of CUDA's log/sin/cos */
        nb_rng rc = {555, 0}, rg = rc;
        assert_bitwise("rand_uniform f64", nb_rand_uniform(c, NB_F64, 1, &n, -1, 1, &rc),
                       nb_rand_uniform(g, NB_F64, 1, &n, -1, 1, &rg));
        nb_tensor *zc = nb_rand_normal(c, NB_F64, 1, &n, 0, 1, &rc);
        nb_tensor *zg = nb_rand_normal(g, NB_F64, 1, &n, 0, 1, &rg);
        nbt_assert_tensors_close(zg, zc, 1e-14, 1e-14);
    }
    nb_ctx_free(g);
    nb_ctx_free(c);
}
END_TEST

/* Last: the fault stays reported on the device. */
/* nb__embedding_pos on CUDA and the CPU, from the same tables: the output
 * (f32, and bf16 from f32 tables) and the tables' gradients, added into
 * gradients that already hold the same values on both, bit for bit (f32
 * additions in the same order, one rounding); twice on CUDA, the same. */
START_TEST(test_embedding_pos_bitwise) {
    NBT_DEVICE_ONLY("bitwise CUDA against the CPU: trivially true on the CPU");
    enum { V = 97, C = 130, N = 6, T = 33, P = 40 };
    int64_t *idx = malloc(sizeof *idx * N * T);
    for (int64_t p = 0; p < N * T; p++) idx[p] = (p * 2654435761u >> 7) % 29 + (p % 31 == 0 ? 60 : 0);
    const nb_dtype odt[2] = {NB_F32, NB_BF16};
    for (int o = 0; o < 2; o++) {
        nb_tensor *outs[3], *gte[3], *gpe[3];
        nb_ctx *ctxs[6];
        for (int run = 0; run < 3; run++) { /* 0: the CPU, 1 and 2: CUDA */
            nb_ctx *c = ctxs[2 * run] = run ? gpu_ctx() : cpu_ctx(), *k = ctxs[2 * run + 1] = cpu_ctx();
            if (odt[o] != NB_F32) nb_ctx_set_compute_dtype(c, odt[o]);
            nb_tensor *te = nb_to(c, nb_rand_normal(k, NB_F32, NB_SHAPE(V, C), 0, 1, &(nb_rng){31, 0}));
            nb_tensor *pe = nb_to(c, nb_rand_normal(k, NB_F32, NB_SHAPE(P, C), 0, 1, &(nb_rng){32, 0}));
            nb_tensor *g = nb_to(c, nb_cast(k, nb_rand_normal(k, NB_F32, NB_SHAPE(N, T, C), 0, 1, &(nb_rng){33, 0}), odt[o]));
            nb_set_requires_grad(te, true);
            nb_set_requires_grad(pe, true);
            nb_set_grad(te, nb_to(c, nb_rand_normal(k, NB_F32, NB_SHAPE(V, C), 0, 1, &(nb_rng){34, 0})));
            nb_set_grad(pe, nb_to(c, nb_rand_normal(k, NB_F32, NB_SHAPE(P, C), 0, 1, &(nb_rng){35, 0})));
            nb_tensor *out = nb__embedding_pos(c, te, pe, nb_from_host(c, NB_I64, NB_SHAPE(N, T), idx), odt[o]);
            nb_backward_with(out, g);
            outs[run] = nb_to(k, out);
            gte[run] = nb_to(k, te->grad);
            gpe[run] = nb_to(k, pe->grad);
        }
        for (int run = 1; run < 3; run++) {
            assert_bitwise("token + position, output", outs[run], outs[0]);
            assert_bitwise("token + position, token table's gradient", gte[run], gte[0]);
            assert_bitwise("token + position, position table's gradient", gpe[run], gpe[0]);
        }
        for (int i = 0; i < 6; i++) nb_ctx_free(ctxs[i]);
    }
    free(idx);
}
END_TEST

START_TEST(test_embedding_index_out_of_range) {
    NBT_DEVICE_ONLY("a deferred device fault");
    nb_ctx *g = gpu_ctx();
    nb_tensor *w = nb_rand_normal(g, NB_F32, NB_SHAPE(37, 4), 0, 1, &(nb_rng){41, 0});
    int64_t idx[5] = {0, 3, 36, 37, 1};
    nb_tensor *i = nb_from_host(g, NB_I64, NB_SHAPE(5), idx);
    nb_embedding(g, w, i); /* deferred: no abort here */
    NBT_EXPECT_ABORT(nb_cuda_synchronize(nb_cuda(0)), "nb_embedding");
    nb_ctx_free(g);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    setenv("CK_FORK", "no", 1);
    Suite *s = suite_create("cuda_layers");
    TCase *tc = nbt_tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_layer_norm_parity);
    tcase_add_test(tc, test_layer_norm_residual_parity);
    tcase_add_test(tc, test_layer_norm_backward_deterministic);
    tcase_add_test(tc, test_layer_norm_parity_rows);
    tcase_add_test(tc, test_layer_norm_backward_deterministic_rows);
    tcase_add_test(tc, test_embedding_parity);
    tcase_add_test(tc, test_embedding_backward_bitwise);
    tcase_add_test(tc, test_embedding_pos_bitwise);
    tcase_add_test(tc, test_dropout_bitwise);
    tcase_add_test(tc, test_rand_fills_bitwise);
    tcase_add_test(tc, test_embedding_index_out_of_range);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
