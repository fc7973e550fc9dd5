/* The per-device backend interface (tensor/backend.h): every table is
 * complete (the optional fused attention all there or absent), the lookup
 * refuses a device this build has no backend for, and the device-neutral
 * ops it made possible hold on the CPU: the fused linear + GELU(tanh)
 * against its unfused composition (values and gradients), and the
 * multi-tensor updates against textbook Adam and SGD written here in
 * double, with per-tensor steps and hyperparameters. */
#include <math.h>
#include <string.h>

#include "optim/internal.h"
#include "tensor/backend.h"
#include "tensor/cuda_plugin.h"
#include "testutil.h"

/* ---- the tables ---- */
static void assert_complete(const nb__backend *be) {
    ck_assert_ptr_nonnull(be->name);
    /* the runtime, written out; the kernels, one per row of NB__BACKEND_KERNELS */
    const void *entries[] = {
        (const void *)be->use, (const void *)be->sync, (const void *)be->mem_alloc,
        (const void *)be->mem_free, (const void *)be->poison, (const void *)be->memset,
        (const void *)be->memcpy_d2d, (const void *)be->memcpy_h2d, (const void *)be->memcpy_d2h,
        (const void *)be->memcpy_h2d_async, (const void *)be->host_alloc,
        (const void *)be->host_free, (const void *)be->compute_stream,
        (const void *)be->copy_stream, (const void *)be->event_new, (const void *)be->event_free,
        (const void *)be->event_record, (const void *)be->stream_wait,
        (const void *)be->event_wait,
    };
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++)
        ck_assert_msg(entries[i] != NULL, "%s backend: runtime entry %zu is empty", be->name, i);
#define KERNEL(e) ck_assert_msg(be->e != NULL, "%s backend: kernel entry %s is empty", be->name, #e);
    NB__BACKEND_KERNELS(KERNEL)
#undef KERNEL
    /* optional: the fused causal attention, both entries and its dtypes or none of them */
    bool fused = be->causal_attention != NULL;
    ck_assert_msg((be->causal_attention_backward != NULL) == fused &&
                      (be->causal_attention_dtypes != 0) == fused,
                  "%s backend: causal attention half filled in", be->name);
}

START_TEST(test_tables_complete) {
    assert_complete(&nb__cpu_backend);
    ck_assert_str_eq(nb__cpu_backend.name, "cpu");
    ck_assert(!nb__cpu_backend.device_memory);
    ck_assert(nb__cpu_backend.strided_elementwise_out && !nb__cpu_backend.half_compute);
    ck_assert_uint_eq(nb__cpu_backend.product_dtypes, 1u << NB_BF16);
    ck_assert_uint_eq(nb__cpu_backend.causal_attention_dtypes,
                      (1u << NB_F32) | (1u << NB_F64) | (1u << NB_BF16));
#if NABLA_HAVE_CUDA
    const nb__cuda_plugin *plugin = nb__cuda_plugin_get(); /* the table is the plugin's */
    ck_assert_msg(plugin, "%s", nb__cuda_plugin_error());
    const nb__backend *cuda = plugin->backend;
    assert_complete(cuda);
    ck_assert_str_eq(cuda->name, "cuda");
    ck_assert(cuda->device_memory);
    ck_assert(!cuda->strided_elementwise_out && cuda->half_compute);
    ck_assert_uint_eq(cuda->product_dtypes, (1u << NB_BF16) | (1u << NB_F16));
#endif
}
END_TEST

START_TEST(test_lookup) {
    ck_assert_ptr_eq(nb__backend_of(nb_cpu()), &nb__cpu_backend);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *t = nb_zeros(ctx, NB_F32, NB_SHAPE(2));
    ck_assert_ptr_eq(nb__backend_at(t), &nb__cpu_backend);
    ck_assert_int_eq(nb__device_available("probe", nb_cpu()), NB_OK);
    ck_assert_int_eq(nb__device_available("probe", nb_cuda(4096)), NB_ERR_UNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(nb_last_error(), "probe: device cuda:4096 is not available"));
#if NABLA_HAVE_CUDA
    ck_assert_ptr_nonnull(nb__cuda_plugin_get());
    ck_assert_ptr_eq(nb__backend_of(nb_cuda(0)), nb__cuda_plugin_get()->backend);
#else
    NBT_EXPECT_ABORT(nb__backend_of(nb_cuda(0)),
                     "nb__backend_of: no backend for device cuda:0 in this build (built without "
                     "CUDA)");
#endif
    nb_ctx_free(ctx);
}
END_TEST

/* ---- fused linear + GELU(tanh) ---- */
static nb_tensor *unfused(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b) {
    nb_tensor *h = nb_matmul_t(ctx, x, w, false, true);
    if (b) h = nb_add(ctx, h, b);
    return nb_gelu(ctx, h, NB_GELU_TANH);
}

/* Forward values and the gradients of a weighted sum for x, w, b. */
static void check_against_composition(nb_dtype dt, int xdim, const int64_t *xshape, bool bias,
                                      double tol) {
    int64_t in = xshape[xdim - 1], out = 7;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x[2], *w[2], *b[2] = {NULL, NULL}, *y[2];
    for (int k = 0; k < 2; k++) {
        x[k] = nbt_randn_leaf(ctx, dt, xdim, xshape, 11);
        w[k] = nbt_randn_leaf(ctx, dt, 2, (int64_t[]){out, in}, 12);
        if (bias) b[k] = nbt_randn_leaf(ctx, dt, 1, &out, 13);
    }
    y[0] = nb__linear_gelu(ctx, x[0], w[0], b[0]);
    y[1] = unfused(ctx, x[1], w[1], b[1]);
    ck_assert_ptr_nonnull(y[0]->node);
    ck_assert_str_eq(y[0]->node->op, "nb_linear_gelu"); /* one node: the fused op */
    nbt_assert_tensors_close(y[0], y[1], tol, tol);
    for (int k = 0; k < 2; k++) nb_backward(nbt_weighted_sum(ctx, y[k]));
    nbt_assert_tensors_close(x[0]->grad, x[1]->grad, tol, tol);
    nbt_assert_tensors_close(w[0]->grad, w[1]->grad, tol, tol);
    if (bias) nbt_assert_tensors_close(b[0]->grad, b[1]->grad, tol, tol);
    nb_ctx_free(ctx);
}

START_TEST(test_linear_gelu_matches_composition) {
    check_against_composition(NB_F64, 2, (int64_t[]){4, 5}, true, 1e-12);
    check_against_composition(NB_F64, 3, (int64_t[]){2, 3, 5}, true, 1e-12);
    check_against_composition(NB_F64, 3, (int64_t[]){2, 3, 5}, false, 1e-12);
    check_against_composition(NB_F32, 3, (int64_t[]){2, 3, 33}, true, 1e-5);
    check_against_composition(NB_F32, 2, (int64_t[]){9, 17}, false, 1e-5);
}
END_TEST

static nb_tensor *linear_gelu_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    return nb__linear_gelu(ctx, in[0], in[1], in[2]);
}

NBT_CPU_TEST(test_linear_gelu_gradcheck) {
    nb_tensor *in[3] = {nbt_randn_leaf(ctx, NB_F64, 3, (int64_t[]){2, 3, 4}, 1),
                        nbt_randn_leaf(ctx, NB_F64, 2, (int64_t[]){5, 4}, 2),
                        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){5}, 3)};
    NBT_GRADCHECK(linear_gelu_fn, NULL, 3, in);
}

/* ---- Note [GEMM epilogues in backward] ---- */
/* An MLP x -> gelu(x w1^T + b1) -> . w2^T + b2, then a weighted sum; its
 * leaves' gradients after `steps` backwards (the second adds into existing
 * gradients), in a context of compute dtype cd, with the backward's GEMM
 * epilogues forced on or off. xs, ws: leaves of dtype dt, made from seeds. */
static void mlp_grads(nb_dtype dt, nb_dtype cd, bool fused, int steps, double out[5][512],
                      int64_t *counts) {
    enum { R = 6, C = 8, H = 16 };
    nb__gemm_epilogues_force(fused);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *p[5] = {nbt_randn_leaf(ctx, dt, 3, (int64_t[]){2, R / 2, C}, 1),
                       nbt_randn_leaf(ctx, NB_F32 == cd ? dt : NB_F32, 2, (int64_t[]){H, C}, 2),
                       nbt_randn_leaf(ctx, NB_F32 == cd ? dt : NB_F32, 1, (int64_t[]){H}, 3),
                       nbt_randn_leaf(ctx, NB_F32 == cd ? dt : NB_F32, 2, (int64_t[]){C, H}, 4),
                       nbt_randn_leaf(ctx, NB_F32 == cd ? dt : NB_F32, 1, (int64_t[]){C}, 5)};
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(step, cd);
    for (int s = 0; s < steps; s++) {
        nb_tensor *h = nb__linear_gelu(step, p[0], p[1], p[2]);
        nb_tensor *y = nb__linear(step, h, p[3], p[4]);
        nb_backward(nbt_weighted_sum(step, y));
        nb_ctx_reset(step);
    }
    for (int k = 0; k < 5; k++) {
        counts[k] = nb_numel(p[k]);
        ck_assert_ptr_nonnull(p[k]->grad);
        nb_tensor *v = nb_contiguous(ctx, nb_cast(ctx, p[k]->grad, NB_F64));
        memcpy(out[k], v->data, (size_t)counts[k] * sizeof(double));
    }
    nb_ctx_free(step);
    nb_ctx_free(ctx);
    nb__gemm_epilogues_force(-1);
}

/* The epilogues' gradients against the separate ops' (bias sums by
 * nb__accum_grad, GELU's own backward), in f32 and under bf16, after one
 * backward and after two (the second adds into existing gradients: the
 * GEMM's beta = 1 with the bias sums beside it). */
START_TEST(test_gemm_epilogues_backward) {
    static double a[5][512], b[5][512];
    int64_t n[5];
    struct { nb_dtype dt, cd; double tol; } cases[] = {{NB_F32, NB_F32, 1e-5},
                                                       {NB_F32, NB_BF16, 2e-2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int steps = 1; steps <= 2; steps++) {
            mlp_grads(cases[c].dt, cases[c].cd, true, steps, a, n);
            mlp_grads(cases[c].dt, cases[c].cd, false, steps, b, n);
            for (int k = 0; k < 5; k++) {
                double scale = 1e-3;
                for (int64_t i = 0; i < n[k]; i++) scale = fmax(scale, fabs(b[k][i]));
                for (int64_t i = 0; i < n[k]; i++)
                    ck_assert_msg(fabs(a[k][i] - b[k][i]) <= cases[c].tol * scale,
                                  "case %zu, %d steps, leaf %d [%lld]: fused %.9g, separate %.9g",
                                  c, steps, k, (long long)i, a[k][i], b[k][i]);
            }
        }
    }
}
END_TEST

static nb_tensor *mlp_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    nb_tensor *h = nb__linear_gelu(ctx, in[0], in[1], in[2]);
    return nb__linear(ctx, h, in[3], in[4]);
}

/* f64 with the epilogues on: GELU's gradient taken by the product (DGELU;
 * f64 bias gradients stay nb__accum_grad's) against finite differences. */
START_TEST(test_gemm_epilogues_gradcheck) {
    nb__gemm_epilogues_force(1);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *in[5] = {nbt_randn_leaf(ctx, NB_F64, 3, (int64_t[]){2, 3, 4}, 1),
                        nbt_randn_leaf(ctx, NB_F64, 2, (int64_t[]){8, 4}, 2),
                        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){8}, 3),
                        nbt_randn_leaf(ctx, NB_F64, 2, (int64_t[]){5, 8}, 4),
                        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){5}, 5)};
    NBT_GRADCHECK(mlp_fn, NULL, 5, in);
    nb_ctx_free(ctx);
    nb__gemm_epilogues_force(-1);
}
END_TEST

/* The CPU entry's bias gradient: op(a)'s rows summed over K, both layouts. */
NBT_CPU_TEST(test_gemm_bgrad_entry) {
    for (int ta = 0; ta < 2; ta++) {
        int64_t m = 5, k = 7, n = 3;
        nb_tensor *a = nbt_randn(ctx, NB_F32, 2, ta ? (int64_t[]){k, m} : (int64_t[]){m, k}, 7);
        nb_tensor *b = nbt_randn(ctx, NB_F32, 2, (int64_t[]){k, n}, 8);
        nb_tensor *out = nb_zeros(ctx, NB_F32, 2, (int64_t[]){m, n});
        nb_tensor *bg = nb_zeros(ctx, NB_F32, 1, &m);
        nb__cpu_backend.matmul(out, a, b, ta, false,
                               &(nb__gemm_epilogue){.accumulate = true, .bgrad = bg});
        nb_tensor *ref = nb_matmul_t(ctx, a, b, ta, false);
        nbt_assert_tensors_close(out, ref, 1e-5, 1e-5);
        for (int64_t i = 0; i < m; i++) {
            double s = 0;
            for (int64_t j = 0; j < k; j++)
                s += nb_get(a, ta ? (int64_t[]){j, i} : (int64_t[]){i, j});
            ck_assert_msg(fabs(nb_get(bg, &i) - s) <= 1e-5 * fmax(1, fabs(s)),
                          "ta %d: bgrad[%lld] %.9g, sum %.9g", ta, (long long)i, nb_get(bg, &i), s);
        }
    }
}

/* ---- Note [Residual in the GEMM] ---- */
/* Bytes of t and u, contiguous of one dtype and shape, equal. */
static void assert_same_bits(const char *what, const nb_tensor *t, const nb_tensor *u) {
    ck_assert_msg(t->dtype == u->dtype && nb_same_shape(t, u) && nb_is_contiguous(t) &&
                      nb_is_contiguous(u),
                  "%s: %s %s vs %s %s", what, nb_dtype_name(t->dtype), nb_shape_str(t),
                  nb_dtype_name(u->dtype), nb_shape_str(u));
    ck_assert_msg(!memcmp(t->data, u->data, (size_t)nb_numel(t) * nb_dtype_size(t->dtype)),
                  "%s: the bits differ", what);
}

/* r + (x w^T [+ b]) on the CPU, in f32 and under bf16 (f32 leaves, r
 * cast to the stream's bf16 as the GPT's is): one node for the pair, and
 * its value and every leaf's gradient bit for bit those of nb_add(r,
 * nb__linear(x, w, b)), the separate ops. */
static void residual_vs_add(nb_dtype cd, bool bias) {
    enum { N = 2, T = 5, C = 8, K = 12 };
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(step, cd);
    nb_tensor *x[2], *w[2], *b[2], *r[2], *y[2];
    for (int k = 0; k < 2; k++) {
        x[k] = nbt_randn_leaf(ctx, NB_F32, 3, (int64_t[]){N, T, K}, 1);
        w[k] = nbt_randn_leaf(ctx, NB_F32, 2, (int64_t[]){C, K}, 2);
        b[k] = bias ? nbt_randn_leaf(ctx, NB_F32, 1, (int64_t[]){C}, 3) : NULL;
        r[k] = nbt_randn_leaf(ctx, NB_F32, 3, (int64_t[]){N, T, C}, 4);
    }
    for (int k = 0; k < 2; k++) {
        nb_tensor *rs = cd == NB_F32 ? r[k] : nb_cast(step, r[k], cd);
        y[k] = k == 0 ? nb__linear_residual(step, x[k], w[k], b[k], rs)
                      : nb_add(step, rs, nb__linear(step, x[k], w[k], b[k]));
    }
    ck_assert_str_eq(y[0]->node->op, "nb_linear");
    ck_assert_int_eq(y[0]->node->n_in, bias ? 4 : 3);
    assert_same_bits("value", y[0], y[1]);
    for (int k = 0; k < 2; k++) nb_backward(nbt_weighted_sum(step, y[k]));
    assert_same_bits("x's gradient", x[0]->grad, x[1]->grad);
    assert_same_bits("w's gradient", w[0]->grad, w[1]->grad);
    assert_same_bits("r's gradient", r[0]->grad, r[1]->grad);
    if (bias) assert_same_bits("b's gradient", b[0]->grad, b[1]->grad);
    nb_ctx_free(step);
    nb_ctx_free(ctx);
}

START_TEST(test_linear_residual_matches_add) {
    for (int bias = 0; bias < 2; bias++) {
        residual_vs_add(NB_F32, bias);
        residual_vs_add(NB_BF16, bias);
    }
}
END_TEST

static nb_tensor *linear_residual_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    bool bias = user != NULL;
    return nb__linear_residual(ctx, in[0], in[1], bias ? in[2] : NULL, in[bias ? 3 : 2]);
}

/* A block's MLP branch and its residual add: r + gelu(x w1^T + b1) w2^T + b2. */
static nb_tensor *mlp_residual_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    nb_tensor *h = nb__linear_gelu(ctx, in[0], in[1], in[2]);
    return nb__linear_residual(ctx, h, in[3], in[4], in[5]);
}

/* f64 against finite differences: the op with and without a bias, and
 * after nb__linear_gelu with the backward's epilogues on (DGELU through
 * the fused node's input gradient). r's gradient is the incoming one, the
 * very tensor (no copy). */
START_TEST(test_linear_residual_gradcheck) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *in[4] = {nbt_randn_leaf(ctx, NB_F64, 3, (int64_t[]){2, 3, 4}, 1),
                        nbt_randn_leaf(ctx, NB_F64, 2, (int64_t[]){5, 4}, 2),
                        nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){5}, 3),
                        nbt_randn_leaf(ctx, NB_F64, 3, (int64_t[]){2, 3, 5}, 4)};
    NBT_GRADCHECK(linear_residual_fn, (void *)1, 4, in);
    nb_tensor *nobias[3] = {in[0], in[1], in[3]};
    NBT_GRADCHECK(linear_residual_fn, NULL, 3, nobias);
    nb__gemm_epilogues_force(1);
    nb_tensor *mlp[6] = {nbt_randn_leaf(ctx, NB_F64, 3, (int64_t[]){2, 3, 4}, 5),
                         nbt_randn_leaf(ctx, NB_F64, 2, (int64_t[]){8, 4}, 6),
                         nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){8}, 7),
                         nbt_randn_leaf(ctx, NB_F64, 2, (int64_t[]){4, 8}, 8),
                         nbt_randn_leaf(ctx, NB_F64, 1, (int64_t[]){4}, 9),
                         in[0]};
    NBT_GRADCHECK(mlp_residual_fn, NULL, 6, mlp);
    nb__gemm_epilogues_force(-1);
    /* r made by an op (not a leaf): its gradient is y's itself */
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *r = nb_mul_scalar(step, in[3], 2.0);
    nb_tensor *y = nb__linear_residual(step, in[0], in[1], in[2], r);
    nb_tensor *g = nbt_randn(step, NB_F64, 3, (int64_t[]){2, 3, 5}, 10);
    nb_backward_with(y, g);
    ck_assert_ptr_nonnull(y->grad);
    ck_assert_ptr_eq(r->grad, y->grad);
    nb_ctx_free(step);
    nb_ctx_free(ctx);
}
END_TEST

/* Where r is not of the product's shape, dtype or device, the op is the
 * add after the linear: broadcast as nb_add broadcasts, refused with
 * nb_add's message. The CPU entry refuses a residual it cannot add. */
START_TEST(test_linear_residual_fallback) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn(ctx, NB_F32, 2, (int64_t[]){3, 4}, 1);
    nb_tensor *w = nbt_randn(ctx, NB_F32, 2, (int64_t[]){5, 4}, 2);
    nb_tensor *b = nbt_randn(ctx, NB_F32, 1, (int64_t[]){5}, 3);
    nb_tensor *row = nbt_randn(ctx, NB_F32, 1, (int64_t[]){5}, 4);
    nb_tensor *y = nb__linear_residual(ctx, x, w, b, row);
    ck_assert_str_eq(y->node ? y->node->op : "nb_add", "nb_add");
    nbt_assert_tensors_close(y, nb_add(ctx, row, nb__linear(ctx, x, w, b)), 0, 0);
    nb_tensor *r64 = nbt_randn(ctx, NB_F64, 2, (int64_t[]){3, 5}, 5);
    NBT_EXPECT_ABORT(nb__linear_residual(ctx, x, w, b, r64),
                     "nb_add: dtypes differ: f64 (3, 5) vs f32 (3, 5)");
    nb_tensor *out = nb_empty(ctx, NB_F32, 2, (int64_t[]){3, 5});
    NBT_EXPECT_ABORT(nb__cpu_backend.matmul(out, x, w, false, true,
                                            &(nb__gemm_epilogue){.bias = b, .residual = out}),
                     "nb__cpu_matmul: a residual f32 (3, 5) for an output f32 (3, 5): it is "
                     "contiguous, of the output's shape and dtype, not the output itself");
    nb_ctx_free(ctx);
}
END_TEST

/* ---- multi-tensor updates ---- */
#define NT 3
#define LEN 5

static double grad_of(int t, int i, int k) { return sin(0.7 * i + 0.3 * t + k) + 0.05 * k; }

/* Parameter k of a list of NT: f32, f64, f32, of LEN elements each. */
static nb_dtype dtype_of(int k) { return k == 1 ? NB_F64 : NB_F32; }

START_TEST(test_multi_tensor_adam) {
    /* amsgrad: tensors 1 and 2 keep vmax, tensor 0 does not (one list may
     * mix both); the gradients shrink tenfold per step */
    for (int variant = 0; variant < 4; variant++) {
        bool decoupled = variant & 1, amsgrad = variant & 2;
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
        nb_tensor *p[NT], *g[NT], *m[NT], *v[NT], *vmax[NT];
        double rp[NT][LEN], rm[NT][LEN] = {{0}}, rv[NT][LEN] = {{0}}, rvmax[NT][LEN] = {{0}};
        double hp[NT][NB__HP_COUNT];
        const double *hps[NT];
        int64_t steps[NT];
        int first_step[NT] = {1, 4, 2}; /* each tensor has its own count */
        for (int k = 0; k < NT; k++) {
            int64_t n = LEN;
            p[k] = nbt_randn(ctx, dtype_of(k), 1, &n, 20 + k);
            g[k] = nb_zeros(ctx, dtype_of(k), 1, &n);
            m[k] = nb_zeros(ctx, dtype_of(k), 1, &n);
            v[k] = nb_zeros(ctx, dtype_of(k), 1, &n);
            vmax[k] = amsgrad && k > 0 ? nb_zeros(ctx, dtype_of(k), 1, &n) : NULL;
            for (int64_t i = 0; i < LEN; i++) rp[k][i] = nb_get(p[k], &i);
            memset(hp[k], 0, sizeof hp[k]);
            hp[k][NB__HP_LR] = 0.01 * (k + 1);
            hp[k][NB__HP_WEIGHT_DECAY] = 0.1 * k;
            hp[k][NB__HP_BETA1] = 0.9 - 0.1 * k;
            /* amsgrad: a short memory, so v falls far below its maximum */
            hp[k][NB__HP_BETA2] = amsgrad ? 0.6 - 0.1 * k : 0.999 - 0.01 * k;
            hp[k][NB__HP_EPS] = 1e-8;
            hp[k][NB__HP_AMSGRAD] = vmax[k] != NULL;
            hps[k] = hp[k];
        }
        int below_max = 0;
        for (int t = 0; t < 3; t++) {
            for (int k = 0; k < NT; k++) {
                steps[k] = first_step[k] + t;
                double lr = hp[k][NB__HP_LR], wd = hp[k][NB__HP_WEIGHT_DECAY];
                double b1 = hp[k][NB__HP_BETA1], b2 = hp[k][NB__HP_BETA2];
                for (int64_t i = 0; i < LEN; i++) {
                    double gi = grad_of(t, (int)i, k) * (amsgrad ? pow(0.1, t) : 1.0);
                    nb_set(g[k], &i, gi);
                    /* the textbook form, bias corrections applied to m and v */
                    if (decoupled) rp[k][i] *= 1 - lr * wd;
                    else gi += wd * rp[k][i];
                    rm[k][i] = b1 * rm[k][i] + (1 - b1) * gi;
                    rv[k][i] = b2 * rv[k][i] + (1 - b2) * gi * gi;
                    rvmax[k][i] = fmax(rvmax[k][i], rv[k][i]);
                    double second = vmax[k] ? rvmax[k][i] : rv[k][i];
                    below_max += vmax[k] && rv[k][i] < rvmax[k][i];
                    double mh = rm[k][i] / (1 - pow(b1, (double)steps[k]));
                    double vh = second / (1 - pow(b2, (double)steps[k]));
                    rp[k][i] -= lr * mh / (sqrt(vh) + hp[k][NB__HP_EPS]);
                }
            }
            nb__cpu_backend.adam(NT, p, g, m, v, vmax, steps, hps, decoupled, NULL);
        }
        ck_assert(amsgrad ? below_max > 0 : below_max == 0);
        for (int k = 0; k < NT; k++) {
            double tol = dtype_of(k) == NB_F64 ? 1e-12 : 2e-6;
            nbt_assert_close(p[k], rp[k], tol, tol);
            nbt_assert_close(m[k], rm[k], tol, tol);
            nbt_assert_close(v[k], rv[k], tol, tol);
            if (vmax[k]) nbt_assert_close(vmax[k], rvmax[k], tol, tol);
        }
        nb_ctx_free(ctx);
    }
}
END_TEST

NBT_CPU_TEST(test_multi_tensor_sgd) {
    nb_tensor *p[NT], *g[NT], *buf[NT];
    double rp[NT][LEN], rb[NT][LEN] = {{0}};
    double hp[NT][NB__HP_COUNT];
    const double *hps[NT];
    int64_t steps[NT];
    for (int k = 0; k < NT; k++) {
        int64_t n = LEN;
        p[k] = nbt_randn(ctx, dtype_of(k), 1, &n, 30 + k);
        g[k] = nb_zeros(ctx, dtype_of(k), 1, &n);
        /* tensor 2 has no momentum buffer: plain SGD */
        buf[k] = k == 2 ? NULL : nb_zeros(ctx, dtype_of(k), 1, &n);
        for (int64_t i = 0; i < LEN; i++) rp[k][i] = nb_get(p[k], &i);
        memset(hp[k], 0, sizeof hp[k]);
        hp[k][NB__HP_LR] = 0.05 * (k + 1);
        hp[k][NB__HP_WEIGHT_DECAY] = 0.01 * k;
        hp[k][NB__HP_MOMENTUM] = k == 2 ? 0 : 0.9;
        hp[k][NB__HP_DAMPENING] = k == 0 ? 0.1 : 0;
        hp[k][NB__HP_NESTEROV] = k == 1;
        hps[k] = hp[k];
    }
    for (int t = 0; t < 4; t++) {
        for (int k = 0; k < NT; k++) {
            steps[k] = t + 1;
            double lr = hp[k][NB__HP_LR], wd = hp[k][NB__HP_WEIGHT_DECAY];
            double mu = hp[k][NB__HP_MOMENTUM], damp = hp[k][NB__HP_DAMPENING];
            for (int64_t i = 0; i < LEN; i++) {
                double gi = grad_of(t, (int)i, k);
                nb_set(g[k], &i, gi);
                double d = gi + wd * rp[k][i];
                if (buf[k]) {
                    rb[k][i] = t == 0 ? d : mu * rb[k][i] + (1 - damp) * d;
                    d = hp[k][NB__HP_NESTEROV] != 0 ? d + mu * rb[k][i] : rb[k][i];
                }
                rp[k][i] -= lr * d;
            }
        }
        nb__cpu_backend.sgd(NT, p, g, buf, steps, hps, NULL);
    }
    for (int k = 0; k < NT; k++) {
        double tol = dtype_of(k) == NB_F64 ? 1e-12 : 2e-6;
        nbt_assert_close(p[k], rp[k], tol, tol);
        if (buf[k]) nbt_assert_close(buf[k], rb[k], tol, tol);
    }
}

/* An optimizer over f32 and f64 parameters steps both (one multi-tensor
 * update per dtype). */
NBT_CPU_TEST(test_optim_step_mixed_dtypes) {
    int64_t n = 4;
    nb_tensor *a = nbt_randn_leaf(ctx, NB_F32, 1, &n, 40), *b = nbt_randn_leaf(ctx, NB_F64, 1, &n, 41);
    double a0[4], b0[4], ea[4], eb[4];
    nb_to_host_f64(a, a0);
    nb_to_host_f64(b, b0);
    nb_set_grad(a, nb_full(ctx, NB_F32, 1, &n, 2.0));
    nb_set_grad(b, nb_full(ctx, NB_F64, 1, &n, -3.0));
    nb_optim_hparams h = NB_SGD_DEFAULTS;
    h.lr = 0.5;
    nb_named_tensor np[2] = {{"a", a}, {"b", b}};
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, np, 2, &h);
    nb_optim_step(opt);
    for (int i = 0; i < 4; i++) {
        ea[i] = a0[i] - 1.0;
        eb[i] = b0[i] + 1.5;
    }
    nbt_assert_close(a, ea, 1e-6, 1e-6);
    nbt_assert_close(b, eb, 1e-15, 1e-15);
    nb_optim_free(opt);
}

NBT_CPU_TEST(test_multi_tensor_reductions) {
    nb_tensor *t[3] = {nb_from_host(ctx, NB_F32, NB_SHAPE(3), (float[]){1, -2, 3}),
                       nb_from_host(ctx, NB_F64, NB_SHAPE(11),
                                    (double[]){0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -5}),
                       nb_zeros(ctx, NB_F32, NB_SHAPE(0))};
    nb_tensor *out = nb_zeros(ctx, NB_F64, 0, NULL);
    nb__cpu_backend.sum_squares(out, 3, t);
    ck_assert_double_eq(nb_item(out), 39.0);
    nb__cpu_backend.max_abs(ctx, out, 3, t);
    ck_assert_double_eq(nb_item(out), 5.0);
    nb__cpu_backend.max_abs(ctx, out, 1, t + 2);
    ck_assert_double_eq(nb_item(out), 0.0);
    ck_assert(nb__cpu_backend.all_finite(ctx, 3, t));
    nb__cpu_backend.scale(2, t, 0.5);
    nbt_assert_close(t[0], (double[]){0.5, -1, 1.5}, 0, 0);
    int64_t last = 10;
    ck_assert_double_eq(nb_get(t[1], &last), -2.5);
    nb_set(t[1], &last, NAN);
    ck_assert(!nb__cpu_backend.all_finite(ctx, 3, t));
    nb__cpu_backend.max_abs(ctx, out, 3, t);
    ck_assert(isnan(nb_item(out)));
}

/* SyncBatchNorm's per-channel steps on the CPU: statistics, then the
 * finalize that refuses a global batch of one value per channel (here
 * after a pretend all-reduce left the count at 1). */
NBT_CPU_TEST(test_channel_steps) {
    /* x (N=2, C=2, S=2): channel 0 = {1, 2, 3, 4}, channel 1 = {0, 0, 2, 2} */
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(2, 2, 2), (double[]){1, 2, 0, 0, 3, 4, 2, 2});
    nb_tensor *stats = nb_zeros(ctx, NB_F64, NB_SHAPE(6));
    nb__cpu_backend.channel_stats(stats, x, 2, 2, 2);
    nbt_assert_close(stats, (double[]){4, 4, 10, 4, 30, 8}, 0, 0);
    nb_tensor *mean = nb_zeros(ctx, NB_F64, NB_SHAPE(2)), *invstd = nb_zeros(ctx, NB_F64, NB_SHAPE(2));
    nb__cpu_backend.channel_finalize(mean, invstd, stats, NULL, NULL, 0.1, 0, 2, x);
    nbt_assert_close(mean, (double[]){2.5, 1}, 1e-15, 0);
    nbt_assert_close(invstd, (double[]){1 / sqrt(1.25), 1}, 1e-15, 1e-15);
    nb_tensor *one = nb_from_host(ctx, NB_F64, NB_SHAPE(6), (double[]){1, 1, 5, 5, 25, 25});
    NBT_EXPECT_ABORT(nb__cpu_backend.channel_finalize(mean, invstd, one, NULL, NULL, 0.1, 1e-5, 2, x),
                     "nb_sync_batch_norm: the global batch has 1 value(s) per channel; training "
                     "needs more than one (input (2, 2, 2) on this rank)");
}

/* ---- row reductions: the CPU entries' contract (in order, f32 in f64) ----
 * Values of mixed magnitude make the summation order visible: a pairwise
 * or f32 accumulation gives other bits than the sequential f64 sum here. */
START_TEST(test_cpu_row_reductions) {
    enum { OUTER = 3, INNER = 1001 };
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int64_t shape[2] = {OUTER, INNER}, outer = OUTER;
    nb_tensor *rows = nb_empty(ctx, NB_F32, 2, shape);
    float *r = rows->data;
    for (int i = 0; i < OUTER * INNER; i++)
        r[i] = (float)((i % 7 == 0 ? 1e7 : 1.0) * sin(0.37 * i + 1.0));
    r[1 * INNER + 17] = r[1 * INNER + 500] = NAN; /* row 1: the first NaN */
    r[2 * INNER + 3] = r[2 * INNER + 900] = 1e9f; /* row 2: the first of equal maxima */
    nb_tensor *sum = nb_empty(ctx, NB_F32, 1, &outer), *mx = nb_empty(ctx, NB_F32, 1, &outer);
    nb_tensor *var = nb_empty(ctx, NB_F32, 1, &outer), *mean = nb_empty(ctx, NB_F32, 1, &outer);
    nb_tensor *arg = nb_empty(ctx, NB_I64, 1, &outer), *amax = nb_empty(ctx, NB_I64, 1, &outer);
    const nb__backend *be = &nb__cpu_backend;
    be->sum_rows(sum, rows, OUTER, INNER, 0.5);
    be->max_rows(mx, arg, rows, OUTER, INNER);
    be->argmax_rows(amax, rows, OUTER, INNER);
    be->var_rows(var, mean, rows, OUTER, INNER, INNER - 1);
    int64_t best[OUTER] = {0, 17, 3};
    for (int i = 1; i < INNER; i++) /* row 0 has no NaN */
        if (r[i] > r[best[0]]) best[0] = i;
    for (int o = 0; o < OUTER; o++) {
        const float *x = r + o * INNER;
        double acc = 0;
        for (int i = 0; i < INNER; i++) acc += x[i];
        ck_assert_int_eq(((int64_t *)arg->data)[o], best[o]);
        ck_assert_int_eq(((int64_t *)amax->data)[o], best[o]);
        if (o == 1) {
            ck_assert(isnan(((float *)sum->data)[o]) && isnan(((float *)mx->data)[o]));
            ck_assert(isnan(((float *)var->data)[o]));
            continue;
        }
        ck_assert_float_eq(((float *)sum->data)[o], (float)(acc * 0.5));
        ck_assert_float_eq(((float *)mx->data)[o], x[best[o]]);
        double mu = acc / INNER, ss = 0;
        for (int i = 0; i < INNER; i++) ss += (x[i] - mu) * (x[i] - mu);
        ck_assert_float_eq(((float *)mean->data)[o], (float)mu);
        ck_assert_float_eq(((float *)var->data)[o], (float)(ss / (INNER - 1)));
    }
    /* max's backward: g[o] at arg[o], zeros elsewhere (gp fully written) */
    nb_tensor *g = nb_from_host(ctx, NB_F32, 1, &outer, (const float[]){2, 3, 4});
    nb_tensor *gp = nb_full(ctx, NB_F32, 2, shape, 7);
    be->max_rows_backward(gp, arg, g, OUTER, INNER);
    for (int o = 0; o < OUTER; o++)
        for (int i = 0; i < INNER; i++)
            ck_assert_float_eq(((float *)gp->data)[o * INNER + i],
                               i == best[o] ? (float)(o + 2) : 0.0f);
    nb_ctx_free(ctx);
}
END_TEST

int main(void) {
    const TTest *tests[] = {test_tables_complete, test_lookup, test_linear_gelu_matches_composition,
                             test_linear_gelu_gradcheck, test_gemm_epilogues_backward,
                             test_gemm_epilogues_gradcheck, test_gemm_bgrad_entry,
                             test_linear_residual_matches_add, test_linear_residual_gradcheck,
                             test_linear_residual_fallback, test_multi_tensor_adam,
                             test_multi_tensor_sgd, test_optim_step_mixed_dtypes,
                             test_multi_tensor_reductions, test_channel_steps, test_cpu_row_reductions, NULL};
    return nbt_run(nbt_suite("backend", "core", 0, tests));
}
