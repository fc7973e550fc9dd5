/* CUDA GEMM (tensor/cuda/matmul.cu) against the CPU: nb_matmul_t in all
 * four transpose combinations, odd sizes, K = 1, single rows and columns,
 * batches with broadcast (one stride and several), non-contiguous operands
 * (transposed views and narrowed columns), f32 with and without TF32,
 * bf16, f16 and f64, with gradients through the parity harness; K = 0;
 * the bias and GELU epilogues of the CUDA GEMM entry, called directly, against
 * CPU ops (folded and strided batches, a bias at an odd address); and nn's
 * Linear through them, mixed precision included; the backward's epilogues
 * (a bias gradient beside an accumulating GEMM, DGELU) called directly
 * against f64 loops, and an MLP whose backward uses them against the CPU;
 * a residual added by the GEMM (C apart from D), alone and after an MLP.
 * Skipped without a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_parity.h"
#include "tensor/backend.h"
#include "tensor/cuda/cuda.h"
#include "tensor/internal.h"

typedef struct mm_case {
    int nbd_a, nbd_b;
    int64_t batch_a[2], batch_b[2];
    int64_t m, k, n;
} mm_case;

static const mm_case cases[] = {
    {0, 0, {0}, {0}, 1, 1, 1},
    {0, 0, {0}, {0}, 7, 1, 5},              /* K = 1 */
    {0, 0, {0}, {0}, 33, 65, 17},
    {0, 0, {0}, {0}, 128, 300, 96},
    {1, 0, {3}, {0}, 9, 33, 16},            /* b broadcast: folded into M */
    {1, 1, {4}, {4}, 7, 20, 9},
    {0, 1, {0}, {5}, 8, 13, 31},            /* a broadcast */
    {2, 2, {2, 1}, {1, 3}, 5, 11, 7},       /* two batch dims, no single stride */
    {2, 1, {2, 3}, {3}, 17, 1000, 3},       /* long K */
    {0, 0, {0}, {0}, 1, 37, 19},            /* one row (M = 1) */
    {0, 0, {0}, {0}, 23, 41, 1},            /* one column (N = 1) */
    {1, 1, {6}, {6}, 1, 16, 24},            /* a batch of single rows */
    {1, 0, {4}, {0}, 3, 8, 1},              /* folded into M, one column */
};

typedef struct mm_flags {
    bool ta, tb;
} mm_flags;

static nb_tensor *op_matmul_t(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const mm_flags *f = user;
    return nb_matmul_t(ctx, in[0], in[1], f->ta, f->tb);
}

/* Inputs for case c: a (.., M, K) or (.., K, M) when ta; b likewise. */
static void fill_inputs(const mm_case *c, bool ta, bool tb, nb_dtype dt, bool trans_view,
                        nbt_input in[2]) {
    memset(in, 0, 2 * sizeof *in);
    in[0].dtype = in[1].dtype = dt;
    in[0].ndim = c->nbd_a + 2;
    in[1].ndim = c->nbd_b + 2;
    for (int i = 0; i < c->nbd_a; i++) in[0].shape[i] = c->batch_a[i];
    for (int i = 0; i < c->nbd_b; i++) in[1].shape[i] = c->batch_b[i];
    in[0].shape[c->nbd_a] = ta ? c->k : c->m;
    in[0].shape[c->nbd_a + 1] = ta ? c->m : c->k;
    in[1].shape[c->nbd_b] = tb ? c->n : c->k;
    in[1].shape[c->nbd_b + 1] = tb ? c->k : c->n;
    in[0].transposed = in[1].transposed = trans_view;
}

static void run_cases(nb_dtype dt, double tol, const char *label) {
    char name[128];
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (int t = 0; t < 4; t++)
            for (int view = 0; view < 2; view++) {
                mm_flags f = {(t & 1) != 0, (t & 2) != 0};
                nbt_input in[2];
                fill_inputs(&cases[ci], f.ta, f.tb, dt, view != 0, in);
                nbt_parity_opts o = {.tol = tol, .seed = 1000 + ci * 8 + (uint64_t)(t * 2 + view)};
                snprintf(name, sizeof name, "%s case %zu ta=%d tb=%d view=%d", label, ci, f.ta,
                         f.tb, view);
                nbt_parity(name, op_matmul_t, &f, 2, in, &o);
            }
}

START_TEST(test_f32) { run_cases(NB_F32, 0, "f32"); }
END_TEST

START_TEST(test_f32_tf32) {
    NBT_DEVICE_ONLY("TF32");
    nb_cuda_set_allow_tf32(true);
    ck_assert(nb_cuda_allow_tf32());
    run_cases(NB_F32, NBT_TOL_TF32, "tf32");
    nb_cuda_set_allow_tf32(false);
    /* and back to full f32, through the same cached shapes */
    run_cases(NB_F32, 0, "f32 after tf32");
}
END_TEST

START_TEST(test_bf16) {
    NBT_DEVICE_ONLY("bf16 only: a storage type on the CPU");
    run_cases(NB_BF16, 0, "bf16");
}
END_TEST

START_TEST(test_f16) {
    NBT_DEVICE_ONLY("f16 only: a storage type on the CPU");
    run_cases(NB_F16, 0, "f16");
}
END_TEST

START_TEST(test_f64) { run_cases(NB_F64, 0, "f64"); }
END_TEST

/* Columns narrowed out of a wider matrix: leading dimension > columns. */
static nb_tensor *op_narrowed(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    nb_tensor *a = nb_narrow(ctx, in[0], 1, 3, 20);            /* (9, 20) of (9, 40) */
    nb_tensor *b = nb_narrow(ctx, in[1], 0, 1, 20);            /* (20, 6) of (24, 6) */
    nb_tensor *bt = nb_narrow(ctx, in[2], 1, 2, 20);           /* (6, 20) of (6, 23) */
    return nb_add(ctx, nb_matmul(ctx, a, b), nb_matmul_t(ctx, a, bt, false, true));
}

START_TEST(test_narrowed_views) {
    nbt_input in[3] = {
        {.dtype = NB_F32, .ndim = 2, .shape = {9, 40}},
        {.dtype = NB_F32, .ndim = 2, .shape = {24, 6}},
        {.dtype = NB_F32, .ndim = 2, .shape = {6, 23}},
    };
    nbt_parity("narrowed f32", op_narrowed, NULL, 3, in, NULL);
    for (int i = 0; i < 3; i++) in[i].dtype = NB_BF16;
    nbt_parity("narrowed bf16", op_narrowed, NULL, 3, in, NULL);
}
END_TEST

/* Batch dims that do not flatten to one stride: a permuted 4-D tensor. */
static nb_tensor *op_permuted(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    nb_tensor *a = nb_permute(ctx, in[0], (const int[]){1, 0, 2, 3}); /* (3, 2, 5, 7) */
    return nb_matmul(ctx, a, in[1]);
}

START_TEST(test_permuted_batch) {
    nbt_input in[2] = {
        {.dtype = NB_F32, .ndim = 4, .shape = {2, 3, 5, 7}},
        {.dtype = NB_F32, .ndim = 3, .shape = {2, 7, 4}},
    };
    nbt_parity("permuted batch", op_permuted, NULL, 2, in, NULL);
}
END_TEST

START_TEST(test_k_zero) {
    NBT_DEVICE_ONLY("poisoning");
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    bool prev = nb__cuda_poison();
    nb__cuda_set_poison(true);
    nb_tensor *a = nb_zeros(dev, NB_F32, NB_SHAPE(2, 3, 0));
    nb_tensor *b = nb_zeros(dev, NB_F32, NB_SHAPE(0, 5));
    nb_tensor *c = nb_matmul(dev, a, b);
    nb__cuda_set_poison(prev);
    ck_assert_int_eq(c->ndim, 3);
    ck_assert_int_eq(c->shape[2], 5);
    double *v = nbt_values(c);
    for (int i = 0; i < 30; i++) ck_assert_double_eq(v[i], 0);
    free(v);
    /* zero-size outputs launch nothing */
    nb_tensor *e = nb_matmul(dev, nb_zeros(dev, NB_F32, NB_SHAPE(0, 4)), nb_zeros(dev, NB_F32, NB_SHAPE(4, 3)));
    ck_assert_int_eq(nb_numel(e), 0);
    nb_cuda_synchronize(nb_cuda(0));
    nb_ctx_free(dev);
}
END_TEST

/* ---- epilogues: the CUDA GEMM entry with bias and GELU, against CPU ops ---- */
static double *host_values(int64_t n, uint64_t seed) {
    double *v = malloc(sizeof *v * (size_t)n);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (double)(s >> 11) * 0x1.0p-53 * 2 - 1;
    }
    return v;
}

/* What check_epilogue varies besides the shape. */
typedef struct epi_opts {
    bool bias, gelu, pre;
    bool a_view;          /* a handed over as the transpose of a (L, K, M) tensor: not
                             foldable, so one strided batched call (b at stride 0) */
    bool bias_unaligned;  /* the bias one element into a longer buffer */
} epi_opts;

/* out = gelu?(a (L, M, K) @ b (K, N) + bias (N)) on the GPU in dtype dt,
 * compared with the same in f64 on the CPU; pre checked when gelu. */
static void check_epilogue(nb_dtype dt, int64_t l, int64_t m, int64_t k, int64_t n,
                           const epi_opts *e, double tol) {
    nb_ctx *host = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nb_cuda(0), 0);
    double *av = host_values(l * m * k, 11 + (uint64_t)n), *bv = host_values(k * n, 12 + (uint64_t)m);
    double *cv = host_values(n + 1, 13);
    nb_tensor *ah = nb_from_host(host, NB_F64, 3, (int64_t[]){l, m, k}, av);
    nb_tensor *bh = nb_from_host(host, NB_F64, 2, (int64_t[]){k, n}, bv);
    nb_tensor *ch_all = nb_from_host(host, NB_F64, 1, (int64_t[]){n + 1}, cv);
    /* the reference sees the values the device holds */
    ah = nb_cast(host, nb_cast(host, ah, dt), NB_F64);
    bh = nb_cast(host, nb_cast(host, bh, dt), NB_F64);
    nb_dtype odt = dt;
    nb_tensor *ch = nb_cast(host, nb_cast(host, nb_narrow(host, ch_all, 0, 1, n), odt), NB_F64);
    nb_tensor *ref_pre = nb_matmul(host, ah, bh);
    if (e->bias) ref_pre = nb_add(host, ref_pre, ch);
    nb_tensor *ref = e->gelu ? nb_gelu(host, ref_pre, NB_GELU_TANH) : ref_pre;

    nb_tensor *a, *b = nb_to(dev, nb_cast(host, bh, dt)), *bias = NULL;
    if (e->a_view) {
        nb_tensor *at = nb_contiguous(host, nb_transpose(host, nb_cast(host, ah, dt), -1, -2));
        a = nb_transpose(dev, nb_to(dev, at), -1, -2);
    } else {
        a = nb_to(dev, nb_cast(host, ah, dt));
    }
    if (e->bias && e->bias_unaligned)
        bias = nb_narrow(dev, nb_to(dev, nb_cast(host, ch_all, odt)), 0, 1, n);
    else if (e->bias)
        bias = nb_to(dev, nb_cast(host, ch, odt));
    bool prev = nb__cuda_poison();
    nb__cuda_set_poison(true);
    nb_tensor *out = nb__empty(dev, odt, 3, (int64_t[]){l, m, n});
    nb_tensor *pre = e->pre ? nb__empty(dev, odt, 3, (int64_t[]){l, m, n}) : NULL;
    nb__cuda_set_poison(prev);
    const nb__backend *be = nb__backend_at(out);
    nb__gemm_epilogue epi = {.bias = bias, .gelu = e->gelu, .pre = pre};
    be->matmul(out, a, b, false, false, &epi);
    be->matmul(out, a, b, false, false, &epi); /* the cached plan */

    int64_t total = l * m * n;
    double *got = nbt_values(out), *want = nbt_values(ref);
    double *gp = e->pre ? nbt_values(pre) : NULL, *wp = nbt_values(ref_pre);
    double scale = 1e-6, err = 0, errp = 0;
    for (int64_t i = 0; i < total; i++) scale = fmax(scale, fabs(wp[i]));
    for (int64_t i = 0; i < total; i++) {
        err = fmax(err, isnan(got[i]) ? INFINITY : fabs(got[i] - want[i]) / scale);
        if (gp) errp = fmax(errp, isnan(gp[i]) ? INFINITY : fabs(gp[i] - wp[i]) / scale);
    }
    ck_assert_msg(err <= tol && errp <= tol,
                  "epilogue %s L=%lld M=%lld K=%lld N=%lld bias=%d gelu=%d pre=%d a_view=%d "
                  "bias_unaligned=%d: error %g, pre %g (tol %g)",
                  nb_dtype_name(dt), (long long)l, (long long)m, (long long)k, (long long)n,
                  e->bias, e->gelu, e->pre, e->a_view, e->bias_unaligned, err, errp, tol);
    free(got);
    free(want);
    free(gp);
    free(wp);
    free(av);
    free(bv);
    free(cv);
    nb_ctx_free(dev);
    nb_ctx_free(host);
}

START_TEST(test_epilogues) {
    NBT_DEVICE_ONLY("the CUDA GEMM's entry called directly");
    /* L, M, K, N: aligned; odd; N not a multiple of 8 (no aux matrix);
     * large; K = 0; one row; one column; a batch whose aux stride M N is a
     * multiple of 8 */
    static const int64_t shapes[][4] = {{1, 16, 32, 64}, {3, 7, 33, 40}, {1, 5, 9, 33},
                                        {2, 64, 128, 256}, {1, 3, 0, 24}, {1, 1, 16, 64},
                                        {3, 7, 33, 1}, {4, 6, 24, 48}};
    static const struct { nb_dtype dt; double tol; } dts[] = {
        {NB_F32, NBT_TOL_F32}, {NB_BF16, NBT_TOL_BF16}, {NB_F16, NBT_TOL_F16}, {NB_F64, NBT_TOL_F64}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
            for (int mode = 0; mode < 5; mode++)
                for (int variant = 0; variant < 3; variant++) {
                    /* bias; gelu+bias; gelu+bias+pre; gelu+pre; gelu */
                    epi_opts e = {.bias = mode <= 2, .gelu = mode >= 1, .pre = mode == 2 || mode == 3};
                    /* plain; a as a transposed view; the bias at an odd address */
                    e.a_view = variant == 1;
                    e.bias_unaligned = variant == 2;
                    if (e.bias_unaligned && !e.bias) continue;
                    const int64_t *s = shapes[si];
                    /* cuBLASLt's GELU epilogue is not correctly rounded: 1e-4 for f32 and f64 */
                    double tol = e.gelu && dts[di].tol < 1e-4 ? 1e-4 : dts[di].tol;
                    check_epilogue(dts[di].dt, s[0], s[1], s[2], s[3], &e, tol);
                }
}
END_TEST

START_TEST(test_gemm_readable) {
    NBT_DEVICE_ONLY("the CUDA backend's gemm_readable");
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    bool (*readable)(const nb_tensor *) = nb__backend_of(nb_cuda(0))->gemm_readable;
    nb_tensor *x = nb_zeros(dev, NB_F32, NB_SHAPE(2, 3, 4, 5));
    ck_assert(readable(x));
    ck_assert(readable(nb_transpose(dev, x, -1, -2)));
    ck_assert(readable(nb_narrow(dev, x, 3, 1, 3)));
    /* batch dims (3, 2) with strides (20, 60): not one stride */
    ck_assert(!readable(nb_transpose(dev, x, 0, 1)));
    /* neither of the last two dims has unit stride */
    ck_assert(!readable(nb_transpose(dev, x, 1, 3)));
    nb_ctx_free(dev);
}
END_TEST

/* nn's Linear: x @ w^T + bias with the bias in the GEMM's epilogue on
 * CUDA, against the CPU's product and add; also under a bf16 or f16
 * compute dtype (user: a const nb_dtype *; f32 operands cast, f32 out),
 * where the bias stays f32. */
static nb_tensor *op_linear(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    if (user && nb_ctx_device(ctx).type == NB_DEVICE_CUDA)
        nb_ctx_set_compute_dtype(ctx, *(const nb_dtype *)user);
    return nb__linear(ctx, in[0], in[1], in[2]);
}

static nb_tensor *op_linear_gelu(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    if (user && nb_ctx_device(ctx).type == NB_DEVICE_CUDA)
        nb_ctx_set_compute_dtype(ctx, *(const nb_dtype *)user);
    return nb__linear_gelu(ctx, in[0], in[1], in[2]);
}

static const nb_dtype compute_bf16 = NB_BF16, compute_f16 = NB_F16;

/* A case of fn under a bf16 or f16 compute dtype, which the op sets on the
 * CUDA side only; not run by the CPU stand-in (f32 compute only). */
static void compute_parity(const char *name, nbt_op_fn fn, const nb_dtype *compute,
                           const nbt_input *in, double tol) {
    if (!nbt_dtype_runs(*compute)) return;
    nbt_parity(name, fn, (void *)compute, 3, in, &(nbt_parity_opts){.tol = tol});
}

/* Linear + GELU(tanh) with the GELU in the epilogue (pre-activation kept
 * for backward) against the CPU's product, add and nb_gelu. */
START_TEST(test_linear_gelu_epilogue) {
    nbt_input in[3] = {
        {.dtype = NB_F32, .ndim = 3, .shape = {2, 9, 24}, .lo = -2, .hi = 2},
        {.dtype = NB_F32, .ndim = 2, .shape = {40, 24}},
        {.dtype = NB_F32, .ndim = 1, .shape = {40}},
    };
    nbt_parity("linear+gelu f32", op_linear_gelu, NULL, 3, in,
               &(nbt_parity_opts){.tol = 1e-4});
    compute_parity("linear+gelu, bf16 compute", op_linear_gelu, &compute_bf16, in, NBT_TOL_BF16);
    compute_parity("linear+gelu, f16 compute", op_linear_gelu, &compute_f16, in, NBT_TOL_F16);
    /* x a transposed view: a strided batch of 2 with the aux matrix (batch stride 9 * 40) */
    in[0].transposed = true;
    nbt_parity("linear+gelu f32, transposed x", op_linear_gelu, NULL, 3, in,
               &(nbt_parity_opts){.tol = 1e-4});
    compute_parity("linear+gelu, transposed x, bf16 compute", op_linear_gelu, &compute_bf16, in,
                   NBT_TOL_BF16);
    in[0].transposed = false;
    in[1].shape[0] = 37; /* N not a multiple of 8: the epilogue may fall back to a kernel */
    in[2].shape[0] = 37;
    nbt_parity("linear+gelu f32, N = 37", op_linear_gelu, NULL, 3, in,
               &(nbt_parity_opts){.tol = 1e-4});
    for (int i = 0; i < 3; i++) in[i].dtype = NB_BF16; /* bf16 tensors, bf16 out and bias */
    nbt_parity("linear+gelu bf16, N = 37", op_linear_gelu, NULL, 3, in,
               &(nbt_parity_opts){.tol = NBT_TOL_BF16});
}
END_TEST

START_TEST(test_linear_bias_epilogue) {
    nbt_input in[3] = {
        {.dtype = NB_F32, .ndim = 3, .shape = {4, 7, 33}},
        {.dtype = NB_F32, .ndim = 2, .shape = {19, 33}},
        {.dtype = NB_F32, .ndim = 1, .shape = {19}},
    };
    nbt_parity("linear f32", op_linear, NULL, 3, in, NULL);
    in[1].transposed = true; /* w stored (33, 19) and transposed back */
    nbt_parity("linear f32, transposed weight", op_linear, NULL, 3, in, NULL);
    in[1].transposed = false;
    compute_parity("linear, bf16 compute", op_linear, &compute_bf16, in, NBT_TOL_BF16);
    compute_parity("linear, f16 compute", op_linear, &compute_f16, in, NBT_TOL_F16);
    /* x a transposed view: not folded into M, a strided batch of 4 with the bias epilogue */
    in[0].transposed = true;
    nbt_parity("linear f32, transposed x", op_linear, NULL, 3, in, NULL);
    compute_parity("linear, transposed x, bf16 compute", op_linear, &compute_bf16, in,
                   NBT_TOL_BF16);
    in[0].transposed = false;
    /* f16 and bf16 tensors (f32 compute dtype): out and bias in the tensors' dtype */
    for (int i = 0; i < 3; i++) in[i].dtype = NB_F16;
    nbt_parity("linear f16", op_linear, NULL, 3, in, NULL);
    for (int i = 0; i < 3; i++) in[i].dtype = NB_BF16;
    nbt_parity("linear bf16", op_linear, NULL, 3, in, NULL);
    for (int i = 0; i < 3; i++) in[i].dtype = NB_F32;
    /* a module: the same path through nn */
    nb_ctx *c = nb_ctx_new(nb_cpu(), 0), *g = nb_ctx_new(nbt_device(), 0);
    nb_module *lc = nb_linear_new(c, NB_F32, 33, 19, true, &(nb_rng){5, 0});
    nb_module *lg = nb_linear_new(g, NB_F32, 33, 19, true, &(nb_rng){5, 0});
    nb_tensor *xc = nb_rand_uniform(c, NB_F32, NB_SHAPE(6, 33), -1, 1, &(nb_rng){6, 0});
    nb_tensor *yc = nb_module_forward(lc, c, xc);
    nb_tensor *yg = nb_module_forward(lg, g, nb_to(g, xc));
    double *a = nbt_values(yc), *b = nbt_values(yg);
    for (int i = 0; i < 6 * 19; i++) ck_assert_msg(fabs(a[i] - b[i]) < 1e-4, "element %d: %g vs %g", i, a[i], b[i]);
    free(a);
    free(b);
    nb_ctx_free(g);
    nb_ctx_free(c);
}
END_TEST

/* The MLP x -> gelu(x w1^T + b1) -> . w2^T + b2: on CUDA its backward
 * takes GELU's gradient in c_proj's input-gradient GEMM (DGELU) and the
 * biases' gradients in the weights' gradient GEMMs (BGRADB), Note [GEMM
 * epilogues in backward]; against the CPU's separate ops. */
static nb_tensor *op_mlp(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    if (user && nb_ctx_device(ctx).type == NB_DEVICE_CUDA)
        nb_ctx_set_compute_dtype(ctx, *(const nb_dtype *)user);
    return nb__linear(ctx, nb__linear_gelu(ctx, in[0], in[1], in[2]), in[3], in[4]);
}

/* x, w1, b1, w2, b2, and a residual of the output's shape */
static const nbt_input mlp_inputs[6] = {
    {.dtype = NB_F32, .ndim = 3, .shape = {2, 9, 24}, .lo = -2, .hi = 2},
    {.dtype = NB_F32, .ndim = 2, .shape = {64, 24}},
    {.dtype = NB_F32, .ndim = 1, .shape = {64}},
    {.dtype = NB_F32, .ndim = 2, .shape = {16, 64}},
    {.dtype = NB_F32, .ndim = 1, .shape = {16}},
    {.dtype = NB_F32, .ndim = 3, .shape = {2, 9, 16}, .lo = -4, .hi = 4},
};

START_TEST(test_mlp_backward_epilogues) {
    nbt_input in[5];
    memcpy(in, mlp_inputs, sizeof in);
    nbt_parity("mlp f32", op_mlp, NULL, 5, in, &(nbt_parity_opts){.tol = 1e-4});
    if (nbt_dtype_runs(compute_bf16))
        nbt_parity("mlp, bf16 compute", op_mlp, (void *)&compute_bf16, 5, in,
                   &(nbt_parity_opts){.tol = NBT_TOL_BF16});
    in[1].shape[0] = in[2].shape[0] = in[3].shape[1] = 60; /* no aligned aux matrix: kernels */
    nbt_parity("mlp f32, hidden 60", op_mlp, NULL, 5, in, &(nbt_parity_opts){.tol = 1e-4});
}
END_TEST

/* r + (x w^T + b) with the add in the GEMM on CUDA (C = r with beta = 1,
 * D apart: Note [Residual in the GEMM] in tensor/ops_matmul.c) against the
 * CPU's product and add, gradients included (r's is the incoming one);
 * under a bf16 compute dtype r is cast to it, as the GPT's residual
 * stream is. Then a GPT block's MLP branch and its add: c_proj's input
 * gradient through GELU (DGELU) beside the residual. */
static nb_tensor *residual_of(nb_ctx *ctx, nb_tensor *r, void *user) {
    if (!user || nb_ctx_device(ctx).type != NB_DEVICE_CUDA) return r;
    nb_ctx_set_compute_dtype(ctx, *(const nb_dtype *)user);
    return nb_cast(ctx, r, *(const nb_dtype *)user);
}

static nb_tensor *op_linear_residual(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *r = residual_of(ctx, in[3], user);
    return nb__linear_residual(ctx, in[0], in[1], in[2], r);
}

static nb_tensor *op_mlp_residual(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    nb_tensor *r = residual_of(ctx, in[5], user);
    return nb__linear_residual(ctx, nb__linear_gelu(ctx, in[0], in[1], in[2]), in[3], in[4], r);
}

START_TEST(test_linear_residual) {
    nbt_input in[4] = {
        {.dtype = NB_F32, .ndim = 3, .shape = {4, 7, 32}},
        {.dtype = NB_F32, .ndim = 2, .shape = {24, 32}},
        {.dtype = NB_F32, .ndim = 1, .shape = {24}},
        {.dtype = NB_F32, .ndim = 3, .shape = {4, 7, 24}, .lo = -4, .hi = 4},
    };
    nbt_parity("linear+residual f32", op_linear_residual, NULL, 4, in, NULL);
    if (nbt_dtype_runs(compute_bf16))
        nbt_parity("linear+residual, bf16 compute", op_linear_residual, (void *)&compute_bf16, 4,
                   in, &(nbt_parity_opts){.tol = NBT_TOL_BF16});
    in[0].transposed = true; /* not folded into M: a strided batch of 4, C and D at M N apart */
    nbt_parity("linear+residual f32, transposed x", op_linear_residual, NULL, 4, in, NULL);
    in[0].transposed = false;
    in[1].shape[0] = in[2].shape[0] = in[3].shape[2] = 19; /* odd N */
    nbt_parity("linear+residual f32, N = 19", op_linear_residual, NULL, 4, in, NULL);
    nbt_parity("mlp+residual f32", op_mlp_residual, NULL, 6, mlp_inputs,
               &(nbt_parity_opts){.tol = 1e-4});
    if (nbt_dtype_runs(compute_bf16))
        nbt_parity("mlp+residual, bf16 compute", op_mlp_residual, (void *)&compute_bf16, 6,
                   mlp_inputs, &(nbt_parity_opts){.tol = NBT_TOL_BF16});
}
END_TEST

/* The CUDA GEMM entry's backward epilogues, called directly, against f64
 * loops: out (M, N) f32 += a^T b with a (K, M), b (K, N) of dtype dt and
 * bgrad (M) the sums of a's columns (BGRADB beside beta = 1); then d (M, N)
 * of dt = (a^T b) * GELU_tanh'(pre) (DGELU). */
static double gelu_grad_ref(double x) {
    double c = 0.7978845608028654, t = tanh(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
}

static void check_backward_epilogues(nb_dtype dt, int64_t m, int64_t k, int64_t n, double tol) {
    nb_ctx *host = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nb_cuda(0), 0);
    double *av = host_values(k * m, 21), *bv = host_values(k * n, 22), *cv = host_values(m * n, 23);
    nb_tensor *ah = nb_cast(host, nb_cast(host, nb_from_host(host, NB_F64, 2, (int64_t[]){k, m}, av), dt), NB_F64);
    nb_tensor *bh = nb_cast(host, nb_cast(host, nb_from_host(host, NB_F64, 2, (int64_t[]){k, n}, bv), dt), NB_F64);
    nb_tensor *ph = nb_cast(host, nb_cast(host, nb_from_host(host, NB_F64, 2, (int64_t[]){m, n}, cv), dt), NB_F64);
    double *a = nbt_values(ah), *b = nbt_values(bh), *pre = nbt_values(ph);
    nb_tensor *ad = nb_to(dev, nb_cast(host, ah, dt)), *bd = nb_to(dev, nb_cast(host, bh, dt));
    nb_tensor *pd = nb_to(dev, nb_cast(host, ph, dt));
    nb_tensor *acc = nb_to(dev, nb_cast(host, ph, NB_F32)); /* the gradient added into */
    nb_tensor *bg = nb_full(dev, NB_F32, 1, &m, NAN), *d = nb_full(dev, dt, 2, (int64_t[]){m, n}, NAN);
    const nb__backend *be = nb__backend_at(ad);
    for (int rep = 0; rep < 2; rep++) { /* the second through the cached plan */
        if (rep) nb_copy_(acc, nb_to(dev, nb_cast(host, ph, NB_F32)));
        be->matmul(acc, ad, bd, true, false, &(nb__gemm_epilogue){.accumulate = true, .bgrad = bg});
        be->matmul(d, ad, bd, true, false, &(nb__gemm_epilogue){.dgelu_pre = pd});
    }
    double *gacc = nbt_values(acc), *gbg = nbt_values(bg), *gd = nbt_values(d);
    double scale = 1, err_acc = 0, err_bg = 0, err_d = 0;
    for (int64_t i = 0; i < m; i++) {
        double s = 0;
        for (int64_t j = 0; j < k; j++) s += a[j * m + i];
        err_bg = fmax(err_bg, isnan(gbg[i]) ? INFINITY : fabs(gbg[i] - s) / fmax(scale, k));
        for (int64_t c = 0; c < n; c++) {
            double p = 0;
            for (int64_t j = 0; j < k; j++) p += a[j * m + i] * b[j * n + c];
            double want_acc = (double)(float)pre[i * n + c] + p, want_d = p * gelu_grad_ref(pre[i * n + c]);
            err_acc = fmax(err_acc, isnan(gacc[i * n + c]) ? INFINITY : fabs(gacc[i * n + c] - want_acc) / fmax(scale, k));
            err_d = fmax(err_d, isnan(gd[i * n + c]) ? INFINITY : fabs(gd[i * n + c] - want_d) / fmax(scale, k));
        }
    }
    ck_assert_msg(err_acc <= tol && err_bg <= tol && err_d <= tol,
                  "backward epilogues %s M=%lld K=%lld N=%lld: accumulated %g, bias sums %g, DGELU "
                  "%g (tol %g)", nb_dtype_name(dt), (long long)m, (long long)k, (long long)n,
                  err_acc, err_bg, err_d, tol);
    free(a), free(b), free(pre), free(gacc), free(gbg), free(gd), free(av), free(bv), free(cv);
    nb_ctx_free(dev);
    nb_ctx_free(host);
}

START_TEST(test_backward_epilogues) {
    NBT_DEVICE_ONLY("the CUDA GEMM's entry called directly");
    /* M, K, N: aligned; odd (the DGELU aux not 8-aligned: the kernel); K = 1 */
    static const int64_t shapes[][3] = {{64, 96, 32}, {37, 51, 19}, {16, 1, 24}};
    static const struct { nb_dtype dt; double tol; } dts[] = {
        {NB_F32, 1e-4}, {NB_BF16, NBT_TOL_BF16}, {NB_F16, NBT_TOL_F16}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
            check_backward_epilogues(dts[di].dt, shapes[si][0], shapes[si][1], shapes[si][2],
                                     dts[di].tol);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    Suite *s = suite_create("cuda_matmul");
    TCase *tc = nbt_tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_f32);
    tcase_add_test(tc, test_f32_tf32);
    tcase_add_test(tc, test_bf16);
    tcase_add_test(tc, test_f16);
    tcase_add_test(tc, test_f64);
    tcase_add_test(tc, test_narrowed_views);
    tcase_add_test(tc, test_permuted_batch);
    tcase_add_test(tc, test_k_zero);
    tcase_add_test(tc, test_epilogues);
    tcase_add_test(tc, test_gemm_readable);
    tcase_add_test(tc, test_linear_bias_epilogue);
    tcase_add_test(tc, test_linear_gelu_epilogue);
    tcase_add_test(tc, test_mlp_backward_epilogues);
    tcase_add_test(tc, test_backward_epilogues);
    tcase_add_test(tc, test_linear_residual);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
