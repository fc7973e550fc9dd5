/* CUDA convolution, batch norm and pooling (tensor/cuda/conv.cu,
 * batch_norm.cu, pool.cu) against the CPU: conv2d with stride, padding,
 * dilation, channel groups (grouped, depthwise, depthwise with a channel
 * multiplier), with and without bias, in f32 (with and without TF32), bf16,
 * f16 and f64, wide channels, an input without grad, under a bf16/f16
 * compute dtype, and an input at an odd address; batch norm through cuDNN
 * and through our kernels, in training and eval mode with and without
 * weight and bias, and its running statistics (f32, f64, strided) after two
 * steps; max and average pooling with padding and strides, ties and NaN,
 * and a deterministic backward. Outputs and gradients through the
 * parity harness. Skipped without a GPU. */
#include <math.h>
#include <stdlib.h>

#include "cuda_parity.h"
#include "tensor/backend.h"
#include "tensor/cuda/cuda.h"

/* cuDNN's FFT and Winograd algorithms round differently from a direct sum. */
#define CONV_TOL_F32 1e-4
#define CONV_TOL_F64 1e-10

static const nb_dtype float_dtypes[] = {NB_F32, NB_BF16, NB_F16, NB_F64};

static double tol_for(nb_dtype dt) {
    switch (dt) {
    case NB_F32: return CONV_TOL_F32;
    case NB_F64: return CONV_TOL_F64;
    case NB_BF16: return NBT_TOL_BF16;
    default: return NBT_TOL_F16;
    }
}

/* ------------------------------------------------------------ conv2d */
typedef struct conv_case {
    int64_t x[4], w[4];
    nb_conv2d_opts o;
    bool bias;
} conv_case;

static const conv_case conv_cases[] = {
    {{2, 3, 9, 11}, {4, 3, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}, true},
    {{1, 2, 8, 8}, {5, 2, 1, 1}, {{1, 1}, {0, 0}, {1, 1}, 1}, false},
    {{3, 4, 13, 10}, {6, 4, 3, 2}, {{2, 1}, {1, 0}, {2, 1}, 1}, true},
    {{2, 8, 7, 7}, {16, 8, 5, 5}, {{2, 2}, {2, 2}, {1, 1}, 1}, false},
    {{1, 1, 1, 1}, {1, 1, 1, 1}, {{1, 1}, {0, 0}, {1, 1}, 1}, true},
    {{2, 5, 17, 6}, {3, 5, 2, 3}, {{3, 2}, {0, 1}, {1, 2}, 1}, true},
    /* groups: two, depthwise (strided, dilated), depthwise with two outputs
     * per channel, grouped 1x1 */
    {{2, 4, 9, 8}, {6, 2, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 2}, true},
    {{2, 8, 10, 9}, {8, 1, 3, 3}, {{2, 1}, {1, 1}, {1, 2}, 8}, true},
    {{1, 6, 7, 7}, {12, 1, 5, 5}, {{1, 1}, {2, 2}, {1, 1}, 6}, false},
    {{2, 8, 6, 6}, {8, 2, 1, 1}, {{1, 1}, {0, 0}, {1, 1}, 4}, false},
};

static nb_tensor *op_conv(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const conv_case *c = user;
    return nb_conv2d(ctx, in[0], in[1], c->bias ? in[2] : NULL, &c->o);
}

static void conv_inputs(const conv_case *c, nb_dtype dt, nbt_input in[3]) {
    memset(in, 0, 3 * sizeof *in);
    for (int i = 0; i < 3; i++) in[i].dtype = dt;
    in[0].ndim = in[1].ndim = 4;
    for (int d = 0; d < 4; d++) {
        in[0].shape[d] = c->x[d];
        in[1].shape[d] = c->w[d];
    }
    in[2].ndim = 1;
    in[2].shape[0] = c->w[0];
}

START_TEST(test_conv2d) {
    char name[96];
    for (size_t ci = 0; ci < sizeof conv_cases / sizeof conv_cases[0]; ci++)
        for (size_t di = 0; di < 4; di++) {
            nb_dtype dt = float_dtypes[di];
            nbt_input in[3];
            conv_inputs(&conv_cases[ci], dt, in);
            nbt_parity_opts o = {.tol = tol_for(dt), .seed = 50 + ci};
            snprintf(name, sizeof name, "conv2d case %zu %s", ci, nb_dtype_name(dt));
            nbt_parity(name, op_conv, (void *)&conv_cases[ci], conv_cases[ci].bias ? 3 : 2, in, &o);
        }
}
END_TEST

START_TEST(test_conv2d_tf32) {
    NBT_DEVICE_ONLY("TF32");
    nb_cuda_set_allow_tf32(true);
    char name[96];
    for (size_t ci = 0; ci < sizeof conv_cases / sizeof conv_cases[0]; ci++) {
        nbt_input in[3];
        conv_inputs(&conv_cases[ci], NB_F32, in);
        nbt_parity_opts o = {.tol = NBT_TOL_TF32, .seed = 70 + ci};
        snprintf(name, sizeof name, "conv2d tf32 case %zu", ci);
        nbt_parity(name, op_conv, (void *)&conv_cases[ci], conv_cases[ci].bias ? 3 : 2, in, &o);
    }
    nb_cuda_set_allow_tf32(false);
}
END_TEST

/* Wider channels (what a CNN runs: tensor-core algorithms, workspaces),
 * every dtype. */
START_TEST(test_conv2d_wide) {
    static const conv_case c = {{4, 32, 12, 12}, {64, 32, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}, true};
    char name[96];
    for (size_t di = 0; di < 4; di++) {
        nb_dtype dt = float_dtypes[di];
        nbt_input in[3];
        conv_inputs(&c, dt, in);
        nbt_parity_opts o = {.tol = tol_for(dt), .seed = 90 + di};
        snprintf(name, sizeof name, "conv2d wide %s", nb_dtype_name(dt));
        nbt_parity(name, op_conv, (void *)&c, 3, in, &o);
    }
}
END_TEST

/* A depthwise 3x3 and a grouped 3x3 as a MobileNet or ResNeXt block runs
 * them (cuDNN's grouped algorithms), every dtype. */
START_TEST(test_conv2d_wide_groups) {
    static const conv_case cs[] = {
        {{4, 64, 14, 14}, {64, 1, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 64}, true},
        {{4, 64, 14, 14}, {64, 8, 3, 3}, {{2, 2}, {1, 1}, {1, 1}, 8}, false},
    };
    char name[96];
    for (size_t ci = 0; ci < 2; ci++)
        for (size_t di = 0; di < 4; di++) {
            nb_dtype dt = float_dtypes[di];
            nbt_input in[3];
            conv_inputs(&cs[ci], dt, in);
            nbt_parity_opts o = {.tol = tol_for(dt), .seed = 95 + 4 * ci + di};
            snprintf(name, sizeof name, "conv2d wide groups %zu %s", ci, nb_dtype_name(dt));
            nbt_parity(name, op_conv, (void *)&cs[ci], cs[ci].bias ? 3 : 2, in, &o);
        }
}
END_TEST

/* The input does not require grad (a network's first layer): no
 * backward-data call, only the weight's and the bias's gradients (also
 * grouped and depthwise). */
START_TEST(test_conv2d_no_input_grad) {
    static const size_t picked[] = {0, 1, 2, 6, 7};
    char name[96];
    for (size_t pi = 0; pi < sizeof picked / sizeof picked[0]; pi++)
        for (size_t di = 0; di < 4; di++) {
            size_t ci = picked[pi];
            nb_dtype dt = float_dtypes[di];
            nbt_input in[3];
            conv_inputs(&conv_cases[ci], dt, in);
            in[0].no_grad = true;
            nbt_parity_opts o = {.tol = tol_for(dt), .seed = 110 + ci};
            snprintf(name, sizeof name, "conv2d case %zu %s, input without grad", ci,
                     nb_dtype_name(dt));
            nbt_parity(name, op_conv, (void *)&conv_cases[ci], conv_cases[ci].bias ? 3 : 2, in,
                       &o);
        }
}
END_TEST

/* Mixed precision: f32 tensors in a context whose compute dtype is bf16 or
 * f16 (the convolution runs in it, the result comes back as f32). */
typedef struct conv_mixed {
    const conv_case *c;
    nb_dtype compute;
} conv_mixed;

static nb_tensor *op_conv_mixed(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const conv_mixed *m = user;
    if (nb_ctx_device(ctx).type == NB_DEVICE_CUDA) nb_ctx_set_compute_dtype(ctx, m->compute);
    nb_tensor *y = nb_conv2d(ctx, in[0], in[1], m->c->bias ? in[2] : NULL, &m->c->o);
    if (nb_ctx_device(ctx).type == NB_DEVICE_CUDA) ck_assert_int_eq(y->dtype, NB_F32);
    return y;
}

START_TEST(test_conv2d_mixed) {
    NBT_DEVICE_ONLY("a bf16/f16 compute dtype needs a CUDA context");
    char name[96];
    for (size_t ci = 0; ci < sizeof conv_cases / sizeof conv_cases[0]; ci++)
        for (int h = 0; h < 2; h++) {
            conv_mixed m = {&conv_cases[ci], h ? NB_F16 : NB_BF16};
            nbt_input in[3];
            conv_inputs(&conv_cases[ci], NB_F32, in);
            nbt_parity_opts o = {.tol = tol_for(m.compute), .seed = 130 + ci};
            snprintf(name, sizeof name, "conv2d case %zu, %s compute", ci,
                     nb_dtype_name(m.compute));
            nbt_parity(name, op_conv_mixed, &m, conv_cases[ci].bias ? 3 : 2, in, &o);
        }
}
END_TEST

/* A contiguous input that starts at an odd element (a narrowed batch:
 * 105 elements per image), so its address is only 4-byte (f32) or 2-byte
 * (bf16) aligned; cuDNN receives the view as it is. */
static nb_tensor *op_conv_batch_view(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    return nb_conv2d(ctx, nb_narrow(ctx, in[0], 0, 1, 2), in[1], in[2], &NB_CONV2D_DEFAULTS);
}

START_TEST(test_conv2d_unaligned_batch_view) {
    for (size_t di = 0; di < 4; di++) {
        nb_dtype dt = float_dtypes[di];
        nbt_input in[3] = {
            {.dtype = dt, .ndim = 4, .shape = {3, 3, 5, 7}},
            {.dtype = dt, .ndim = 4, .shape = {4, 3, 3, 3}},
            {.dtype = dt, .ndim = 1, .shape = {4}},
        };
        nbt_parity_opts o = {.tol = tol_for(dt), .seed = 150 + di};
        char name[96];
        snprintf(name, sizeof name, "conv2d unaligned batch view %s", nb_dtype_name(dt));
        nbt_parity(name, op_conv_batch_view, NULL, 3, in, &o);
    }
}
END_TEST

/* A non-contiguous input (the front end makes it contiguous). */
static nb_tensor *op_conv_transposed(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    return nb_conv2d(ctx, in[0], in[1], NULL, &NB_CONV2D_DEFAULTS);
}

START_TEST(test_conv2d_transposed_input) {
    nbt_input in[2] = {
        {.dtype = NB_F32, .ndim = 4, .shape = {2, 3, 6, 9}, .transposed = true},
        {.dtype = NB_F32, .ndim = 4, .shape = {2, 3, 3, 2}},
    };
    nbt_parity_opts o = {.tol = CONV_TOL_F32};
    nbt_parity("conv2d transposed input", op_conv_transposed, NULL, 2, in, &o);
}
END_TEST

/* ----------------------------------------------- the cuDNN workspace */
/* Note [cuDNN workspace] in tensor/cuda/runtime.cu: one workspace per
 * device, shared by every convolution and grown on demand. Layers of a
 * small CNN, of different shapes and workspace needs, run in one context:
 * all forwards, then all backwards in reverse, so the workspace grows
 * while calls that use the old buffer may still be queued. */
static const conv_case ws_cases[] = {
    {{4, 64, 28, 28}, {64, 64, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}, false},
    {{4, 32, 32, 32}, {48, 32, 5, 5}, {{1, 1}, {2, 2}, {1, 1}, 1}, true},
    {{4, 128, 14, 14}, {128, 128, 3, 3}, {{2, 2}, {1, 1}, {1, 1}, 1}, false},
    {{8, 3, 64, 64}, {32, 3, 7, 7}, {{2, 2}, {3, 3}, {1, 1}, 1}, true},
    {{4, 256, 7, 7}, {256, 256, 1, 1}, {{1, 1}, {0, 0}, {1, 1}, 1}, false},
    {{2, 16, 40, 40}, {16, 16, 3, 3}, {{1, 1}, {2, 2}, {2, 2}, 1}, true},
};
#define WS_CASES (sizeof ws_cases / sizeof ws_cases[0])

static nb__conv2d_geom geom_of(const conv_case *c) {
    nb__conv2d_geom g = {
        .n = c->x[0], .c = c->x[1], .h = c->x[2], .w = c->x[3], .o = c->w[0], .kh = c->w[2],
        .kw = c->w[3], .sh = c->o.stride[0], .sw = c->o.stride[1], .ph = c->o.padding[0],
        .pw = c->o.padding[1], .dh = c->o.dilation[0], .dw = c->o.dilation[1],
        .groups = c->o.groups > 0 ? c->o.groups : 1,
    };
    g.oh = (g.h + 2 * g.ph - g.dh * (g.kh - 1) - 1) / g.sh + 1;
    g.ow = (g.w + 2 * g.pw - g.dw * (g.kw - 1) - 1) / g.sw + 1;
    return g;
}

/* Every case's output, flattened and concatenated: one tensor for the
 * parity harness, whose backward runs every case's backward. */
static nb_tensor *op_conv_many(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    (void)user;
    nb_tensor *flat[WS_CASES];
    int k = 0;
    for (size_t i = 0; i < WS_CASES; i++) {
        const conv_case *c = &ws_cases[i];
        nb_tensor *x = in[k++], *w = in[k++], *b = c->bias ? in[k++] : NULL;
        nb_tensor *y = nb_conv2d(ctx, x, w, b, &c->o);
        int64_t n = nb_numel(y);
        flat[i] = nb_reshape(ctx, y, 1, &n);
    }
    return nb_concat(ctx, (int)WS_CASES, flat, 0);
}

static int many_inputs(nb_dtype dt, nbt_input *in) {
    int k = 0;
    for (size_t i = 0; i < WS_CASES; i++) {
        nbt_input ci[3];
        conv_inputs(&ws_cases[i], dt, ci);
        in[k++] = ci[0];
        in[k++] = ci[1];
        if (ws_cases[i].bias) in[k++] = ci[2];
    }
    return k;
}

/* The CUDA runtime's workspace figures for device 0 (nothing without
 * CUDA in the build, where the test that reads them never runs). */
static size_t ws_size(int64_t *buffers) {
#if NABLA_HAVE_CUDA
    return nb__cuda_cudnn_workspace_size(0, buffers);
#else
    *buffers = 0;
    return 0;
#endif
}
static size_t ws_limit(void) {
#if NABLA_HAVE_CUDA
    return nb__cuda_cudnn_workspace_limit(0);
#else
    return 0;
#endif
}
static void ws_chosen(nb_dtype dt, const nb__conv2d_geom *g, size_t *bytes) {
#if NABLA_HAVE_CUDA
    nb__cuda_conv2d_workspace_sizes(0, dt, g, bytes);
#else
    (void)dt, (void)g;
    bytes[0] = bytes[1] = bytes[2] = 0;
#endif
}

START_TEST(test_conv2d_shared_workspace) {
    NBT_DEVICE_ONLY("the device's cuDNN workspace");
    static const nb_dtype dts[] = {NB_F32, NB_BF16};
    nb_cuda_set_allow_tf32(false);
    int64_t buf0;
    size_t size0 = ws_size(&buf0);
    /* the largest workspace these calls ask for, from the algorithms chosen */
    size_t want = size0;
    for (size_t di = 0; di < 2; di++)
        for (size_t i = 0; i < WS_CASES; i++) {
            nb__conv2d_geom g = geom_of(&ws_cases[i]);
            size_t b[3];
            ws_chosen(dts[di], &g, b);
            for (int d = 0; d < 3; d++) want = b[d] > want ? b[d] : want;
        }
    ck_assert_msg(want <= ws_limit() || want == size0,
                  "a workspace of %zu bytes was chosen over the limit of %zu", want,
                  ws_limit());
    size_t size_after[2];
    int64_t buf_after[2];
    for (int pass = 0; pass < 2; pass++) {
        for (size_t di = 0; di < 2; di++) {
            nbt_input in[16];
            int n = many_inputs(dts[di], in);
            nbt_parity_opts o = {.tol = tol_for(dts[di]), .seed = 170 + di};
            char name[96];
            snprintf(name, sizeof name, "conv2d many shapes, one context, %s, pass %d",
                     nb_dtype_name(dts[di]), pass);
            nbt_parity(name, op_conv_many, NULL, n, in, &o);
        }
        size_after[pass] = ws_size(&buf_after[pass]);
    }
    ck_assert_msg(size_after[0] == want,
                  "the cuDNN workspace is %zu bytes, the largest asked for is %zu (it was %zu)",
                  size_after[0], want, size0);
    if (want == size0)
        ck_assert_msg(buf_after[0] == buf0, "%lld buffers allocated for a workspace that did "
                      "not need to grow", (long long)(buf_after[0] - buf0));
    else
        ck_assert_msg(buf_after[0] > buf0 && buf_after[0] - buf0 <= (int64_t)(6 * WS_CASES),
                      "%lld buffers allocated while growing from %zu to %zu bytes",
                      (long long)(buf_after[0] - buf0), size0, want);
    ck_assert_msg(size_after[1] == size_after[0] && buf_after[1] == buf_after[0],
                  "the second pass changed the workspace: %zu bytes, %lld buffers -> %zu bytes, "
                  "%lld buffers",
                  size_after[0], (long long)buf_after[0], size_after[1], (long long)buf_after[1]);
}
END_TEST

/* The convolution entry points take nothing from the context: the
 * workspace is the device's (before, each call's workspace stayed in the
 * context until its reset). */
START_TEST(test_conv2d_workspace_not_in_context) {
    NBT_DEVICE_ONLY("the device's cuDNN workspace");
    nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
    for (size_t i = 0; i < WS_CASES; i++) {
        const conv_case *c = &ws_cases[i];
        nb__conv2d_geom g = geom_of(c);
        int64_t ys[4] = {g.n, g.o, g.oh, g.ow};
        nb_tensor *x = nb_zeros(ctx, NB_F32, 4, c->x), *w = nb_zeros(ctx, NB_F32, 4, c->w);
        nb_tensor *y = nb_empty(ctx, NB_F32, 4, ys), *gy = nb_zeros(ctx, NB_F32, 4, ys);
        nb_tensor *dx = nb_empty(ctx, NB_F32, 4, c->x), *dw = nb_empty(ctx, NB_F32, 4, c->w);
        size_t used = nb_ctx_used(ctx);
        const nb__backend *be = nb__backend_of(nb_cuda(0));
        be->conv2d(ctx, NB_F32, &g, y->data, x->data, w->data, NULL);
        be->conv2d_backward(ctx, NB_F32, &g, dx->data, dw->data, NULL, gy->data, x->data,
                            w->data);
        ck_assert_msg(nb_ctx_used(ctx) == used,
                      "case %zu: the convolution took %zu bytes from the context", i,
                      nb_ctx_used(ctx) - used);
        double *v = nbt_values(dw); /* waits for the device: faults show here */
        ck_assert_double_eq(v[0], 0.0);
        free(v);
    }
    nb_ctx_free(ctx);
}
END_TEST

/* ---------------------------------------------------------- batch norm */
/* Every case runs twice: with cuDNN on (cuDNN where it can, our kernels
 * elsewhere) and off (our kernels only), Note [Batch norm: cuDNN or our
 * kernels] in tensor/cuda/batch_norm.cu. The cuDNN counters say which path
 * ran, and are checked against nb__cuda_batch_norm_cudnn_ok. */
typedef struct bn_case {
    bool training, weight, bias;
    bool x_no_grad; /* dx not wanted: only dw, db */
    nb_dtype rdt;   /* the running statistics' dtype */
    bool cudnn_fwd, cudnn_bwd; /* set by op_bn on CUDA: the path expected */
} bn_case;

#define BN_EPS 1e-5

/* cuDNN's switch and counters; the CPU stand-in has neither (one pass,
 * counters at 0, nothing asserted about the path), nor has a build
 * without CUDA. */
static bool bn_set_cudnn(bool on) {
#if NABLA_HAVE_CUDA
    if (!nbt_standin()) return nb__cuda_batch_norm_set_cudnn(on);
#endif
    return on;
}
static int bn_last_pass(void) { return nbt_standin() ? 1 : 0; }
static void bn_calls(int64_t *forward, int64_t *backward) {
#if NABLA_HAVE_CUDA
    if (!nbt_standin()) {
        nb__cuda_batch_norm_cudnn_calls(forward, backward);
        return;
    }
#endif
    *forward = 0;
    if (backward) *backward = 0;
}

/* Whether the batch-norm selection picks cuDNN (false without CUDA). */
static bool bn_cudnn_ok(const nb_tensor *x, const nb_tensor *rm, const nb_tensor *rv,
                        bool training) {
#if NABLA_HAVE_CUDA
    return nb__cuda_batch_norm_cudnn_ok(x, rm, rv, training, BN_EPS);
#else
    (void)x, (void)rm, (void)rv, (void)training;
    return false;
#endif
}

/* The dtype of cuDNN's per-channel tensors for x of dtype dt. */
static nb_dtype bn_param_dtype(nb_dtype dt) { return dt == NB_F64 ? NB_F64 : NB_F32; }

/* in: x, [weight], [bias], [running_mean, running_var (eval)] */
static nb_tensor *op_bn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    bn_case *c = user;
    int k = 1;
    nb_tensor *w = c->weight ? in[k++] : NULL, *b = c->bias ? in[k++] : NULL, *rm, *rv;
    int64_t ch = in[0]->shape[1];
    if (c->training) {
        rm = nb_zeros(ctx, c->rdt, 1, &ch);
        rv = nb_ones(ctx, c->rdt, 1, &ch);
    } else {
        rm = in[k++];
        rv = in[k++];
    }
    if (nb_ctx_device(ctx).type == NB_DEVICE_CUDA) {
        c->cudnn_fwd = bn_cudnn_ok(in[0], rm, rv, c->training);
        c->cudnn_bwd = c->training && bn_cudnn_ok(in[0], NULL, NULL, true);
    }
    return nb_batch_norm(ctx, in[0], w, b, rm, rv, c->training, 0.1, BN_EPS);
}

/* One parity run of case c on x of dtype dt and shape (ndim, shape), then
 * the check that it took the path the selection announced. */
static void bn_parity(bn_case *c, bool cudnn, nb_dtype dt, int ndim, const int64_t *shape,
                      uint64_t seed, const char *name) {
    nbt_input in[5];
    memset(in, 0, sizeof in);
    int n = 0;
    in[n].dtype = dt;
    in[n].ndim = ndim;
    for (int d = 0; d < ndim; d++) in[n].shape[d] = shape[d];
    /* an offset mean, so that a one-pass variance would show */
    in[n].lo = 2.0;
    in[n].hi = 4.0;
    in[n].no_grad = c->x_no_grad;
    n++;
    int64_t ch = shape[1];
    if (c->weight)
        in[n++] = (nbt_input){.dtype = dt, .ndim = 1, .shape = {ch}, .lo = 0.5, .hi = 1.5};
    if (c->bias) in[n++] = (nbt_input){.dtype = dt, .ndim = 1, .shape = {ch}};
    if (!c->training) {
        in[n++] = (nbt_input){
            .dtype = c->rdt, .ndim = 1, .shape = {ch}, .lo = 2, .hi = 4, .no_grad = true};
        in[n++] = (nbt_input){
            .dtype = c->rdt, .ndim = 1, .shape = {ch}, .lo = 0.5, .hi = 2, .no_grad = true};
    }
    /* f64 statistics for f64 input, f32 otherwise (bf16/f16: the defaults) */
    nbt_parity_opts o = {.tol = dt == NB_F64 ? 1e-9 : dt == NB_F32 ? 2e-5 : 0, .seed = seed};
    int64_t f0, b0, f1, b1;
    bn_calls(&f0, &b0);
    nbt_parity(name, op_bn, c, n, in, &o);
    if (nbt_standin()) return;
    bn_calls(&f1, &b1);
    ck_assert_msg(f1 - f0 == (c->cudnn_fwd ? 1 : 0),
                  "%s: %lld forward calls through cuDNN, expected %d", name, (long long)(f1 - f0),
                  c->cudnn_fwd ? 1 : 0);
    ck_assert_msg(b1 - b0 == (c->cudnn_bwd ? 1 : 0),
                  "%s: %lld backward calls through cuDNN, expected %d", name, (long long)(b1 - b0),
                  c->cudnn_bwd ? 1 : 0);
    /* cuDNN off: never; on: always for contiguous statistics of the
     * parameter dtype (bf16 needs compute capability 8.0, so not asserted) */
    if (!cudnn) ck_assert_msg(!c->cudnn_fwd && !c->cudnn_bwd, "%s: cuDNN chosen while off", name);
    bool plain = c->rdt == bn_param_dtype(dt);
    if (cudnn && dt != NB_BF16) {
        ck_assert_msg(c->cudnn_fwd == plain, "%s: forward %s cuDNN", name,
                      plain ? "should use" : "must not use");
        ck_assert_msg(c->cudnn_bwd == c->training, "%s: backward %s cuDNN", name,
                      c->training ? "should use" : "must not use");
    }
}

START_TEST(test_batch_norm) {
    static const int64_t shapes[][4] = {{4, 3, 5, 7}, {16, 5, 0, 0}, {2, 33, 1000, 0}, {1, 2, 3, 0}};
    static const int ndims[] = {4, 2, 3, 3};
    char name[160];
    bool prev = bn_set_cudnn(true);
    for (int cudnn = 1; cudnn >= bn_last_pass(); cudnn--) {
        bn_set_cudnn(cudnn);
        for (int si = 0; si < 4; si++)
            for (int mode = 0; mode < 6; mode++)
                for (size_t di = 0; di < 4; di++)
                    /* other: running statistics of the other float dtype, which
                     * cuDNN cannot update (our kernels); with cuDNN on only */
                    for (int other = 0; other < (cudnn && si < 2 ? 2 : 1); other++) {
                        nb_dtype dt = float_dtypes[di], pdt = bn_param_dtype(dt);
                        bn_case c = {mode < 3, mode % 3 != 1, mode % 3 == 0, false,
                                     other ? (pdt == NB_F64 ? NB_F32 : NB_F64) : pdt, false,
                                     false};
                        snprintf(name, sizeof name,
                                 "batch_norm cudnn=%d shape %d %s w=%d b=%d %s running %s", cudnn,
                                 si, c.training ? "train" : "eval", c.weight, c.bias,
                                 nb_dtype_name(dt), nb_dtype_name(c.rdt));
                        bn_parity(&c, cudnn, dt, ndims[si], shapes[si],
                                  300 + (uint64_t)(si * 10 + mode), name);
                    }
        /* only dw and db wanted: cuDNN still writes dx (into scratch) */
        for (size_t di = 0; di < 4; di++) {
            nb_dtype dt = float_dtypes[di];
            bn_case c = {true, true, true, true, bn_param_dtype(dt), false, false};
            snprintf(name, sizeof name, "batch_norm cudnn=%d x without grad %s", cudnn,
                     nb_dtype_name(dt));
            bn_parity(&c, cudnn, dt, ndims[0], shapes[0], 390, name);
        }
    }
    bn_set_cudnn(prev);
}
END_TEST

/* Running statistics after two training steps: CUDA against the CPU (f64
 * x), for f32 x with f32, f64 and strided running buffers and f64 x with
 * f64 and f32 ones; with cuDNN on and off. Kinds 0 and 3 go through cuDNN
 * when it is on, the others through our kernels. */
START_TEST(test_batch_norm_running_stats) {
    const int64_t n = 6, ch = 3, s = 10, total = n * ch * s;
    double *xv = malloc(sizeof *xv * (size_t)total);
    uint64_t st = 99;
    for (int64_t i = 0; i < total; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        xv[i] = 3.0 + (double)(st >> 11) * 0x1.0p-53 * 2 - 1 + (double)((i / s) % ch);
    }
    static const nb_dtype xdts[] = {NB_F32, NB_F32, NB_F32, NB_F64, NB_F64};
    static const nb_dtype rdts[] = {NB_F32, NB_F64, NB_F32, NB_F64, NB_F32};
    bool prev = bn_set_cudnn(true);
    for (int cudnn = 1; cudnn >= bn_last_pass(); cudnn--) {
        bn_set_cudnn(cudnn);
        for (int kind = 0; kind < 5; kind++) {
            nb_ctx *host = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nbt_device(), 0);
            nb_tensor *xh = nb_from_host(host, NB_F64, 3, (int64_t[]){n, ch, s}, xv);
            nb_tensor *xd = nb_to(dev, xdts[kind] == NB_F64 ? xh : nb_cast(host, xh, NB_F32));
            nb_tensor *rmh = nb_full(host, NB_F64, 1, &ch, 0.5);
            nb_tensor *rvh = nb_full(host, NB_F64, 1, &ch, 2.0);
            nb_dtype rdt = rdts[kind];
            nb_tensor *rmd, *rvd, *rm_store = NULL, *rv_store = NULL;
            if (kind == 2) {
                /* every other element of a (2C) buffer, the others must stay 7 */
                int64_t c2 = 2 * ch;
                rm_store = nb_full(dev, NB_F32, 1, &c2, 7.0);
                rv_store = nb_full(dev, NB_F32, 1, &c2, 7.0);
                rmd = nb_slice(dev, rm_store, 0, 0, c2, 2);
                rvd = nb_slice(dev, rv_store, 0, 1, c2, 2);
                nb_fill_(rmd, 0.5);
                nb_fill_(rvd, 2.0);
            } else {
                rmd = nb_full(dev, rdt, 1, &ch, 0.5);
                rvd = nb_full(dev, rdt, 1, &ch, 2.0);
            }
            bool want = cudnn && (kind == 0 || kind == 3) && !nbt_standin();
            if (!nbt_standin())
                ck_assert_msg(bn_cudnn_ok(xd, rmd, rvd, true) == want,
                              "cudnn=%d kind %d: the selection should %s cuDNN", cudnn, kind,
                              want ? "choose" : "not choose");
            int64_t f0, f1;
            bn_calls(&f0, NULL);
            for (int step = 0; step < 2; step++) {
                nb_batch_norm(host, xh, NULL, NULL, rmh, rvh, true, 0.1, 1e-5);
                nb_batch_norm(dev, xd, NULL, NULL, rmd, rvd, true, 0.1, 1e-5);
            }
            bn_calls(&f1, NULL);
            ck_assert_msg(f1 - f0 == (want ? 2 : 0), "cudnn=%d kind %d: %lld calls through cuDNN",
                          cudnn, kind, (long long)(f1 - f0));
            double *gm = nbt_values(rmd), *gv = nbt_values(rvd), *wm = nbt_values(rmh),
                   *wv = nbt_values(rvh);
            for (int64_t k = 0; k < ch; k++) {
                ck_assert_msg(fabs(gm[k] - wm[k]) <= 1e-5 * fmax(1, fabs(wm[k])),
                              "cudnn=%d kind %d running_mean[%lld]: cuda %.9g cpu %.9g", cudnn,
                              kind, (long long)k, gm[k], wm[k]);
                ck_assert_msg(fabs(gv[k] - wv[k]) <= 1e-5 * fmax(1, fabs(wv[k])),
                              "cudnn=%d kind %d running_var[%lld]: cuda %.9g cpu %.9g", cudnn,
                              kind, (long long)k, gv[k], wv[k]);
            }
            if (kind == 2) {
                double *am = nbt_values(rm_store), *av = nbt_values(rv_store);
                for (int64_t k = 0; k < ch; k++) {
                    ck_assert_double_eq(am[2 * k + 1], 7.0);
                    ck_assert_double_eq(av[2 * k], 7.0);
                }
                free(am);
                free(av);
            }
            free(gm);
            free(gv);
            free(wm);
            free(wv);
            nb_ctx_free(dev);
            nb_ctx_free(host);
        }
    }
    bn_set_cudnn(prev);
    free(xv);
}
END_TEST

/* ------------------------------------------------------------- pooling */
typedef struct pool_case {
    int64_t x[4];
    nb_pool2d_opts o;
    bool max;
} pool_case;

static nb_tensor *op_pool(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    const pool_case *c = user;
    return c->max ? nb_max_pool2d(ctx, in[0], &c->o) : nb_avg_pool2d(ctx, in[0], &c->o);
}

static const pool_case pool_cases[] = {
    {{2, 3, 9, 11}, {{3, 3}, {2, 2}, {1, 1}}, true},
    {{1, 2, 8, 8}, {{2, 2}, {0, 0}, {0, 0}}, true},
    {{2, 1, 7, 10}, {{3, 2}, {1, 2}, {1, 1}}, true},
    {{1, 1, 5, 5}, {{5, 5}, {1, 1}, {2, 2}}, true},
    {{3, 4, 33, 17}, {{2, 3}, {3, 1}, {1, 0}}, true},
};

START_TEST(test_pool) {
    char name[96];
    for (size_t ci = 0; ci < sizeof pool_cases / sizeof pool_cases[0]; ci++)
        for (int avg = 0; avg < 2; avg++)
            for (size_t di = 0; di < 4; di++) {
                pool_case c = pool_cases[ci];
                c.max = !avg;
                nb_dtype dt = float_dtypes[di];
                nbt_input in = {.dtype = dt, .ndim = 4};
                for (int d = 0; d < 4; d++) in.shape[d] = c.x[d];
                nbt_parity_opts o = {.seed = 500 + ci};
                snprintf(name, sizeof name, "%s_pool2d case %zu %s", avg ? "avg" : "max", ci,
                         nb_dtype_name(dt));
                nbt_parity(name, op_pool, &c, 1, &in, &o);
            }
}
END_TEST

/* Ties (the first maximum wins, so the gradient lands where the CPU's
 * does) and NaN (it wins over every number). */
START_TEST(test_max_pool_ties_and_nan) {
    static double v[2 * 7 * 9];
    for (int i = 0; i < 2 * 7 * 9; i++) v[i] = (double)((i * 7) % 3);
    pool_case c = {{1, 2, 7, 9}, {{3, 3}, {2, 2}, {1, 1}}, true};
    nbt_input in = {.dtype = NB_F32, .ndim = 4, .shape = {1, 2, 7, 9}, .values = v};
    nbt_parity("max_pool2d ties", op_pool, &c, 1, &in, NULL);
    in.dtype = NB_BF16;
    nbt_parity("max_pool2d ties bf16", op_pool, &c, 1, &in, NULL);
    v[10] = NAN;
    v[40] = NAN;
    v[41] = NAN;
    in.dtype = NB_F32;
    nbt_parity("max_pool2d nan", op_pool, &c, 1, &in, NULL);
    in.dtype = NB_F64;
    nbt_parity("max_pool2d nan f64", op_pool, &c, 1, &in, NULL);
}
END_TEST

/* Two backward runs give bitwise the same gradient. */
START_TEST(test_pool_backward_deterministic) {
    NBT_DEVICE_ONLY("determinism of the CUDA backward");
    const int64_t shape[4] = {2, 3, 31, 29}, total = 2 * 3 * 31 * 29;
    double *xv = malloc(sizeof *xv * (size_t)total), *rv = NULL;
    for (int64_t i = 0; i < total; i++) xv[i] = sin((double)i * 0.37) + (double)(i % 5) * 0.25;
    for (int max = 0; max < 2; max++) {
        nb_pool2d_opts o = {{3, 3}, {1, 1}, {1, 1}};
        double *g[2];
        for (int run = 0; run < 2; run++) {
            nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
            nb_tensor *x = nb_from_host(dev, NB_F64, 4, shape, xv);
            x = nb_cast(dev, x, NB_F32);
            nb_set_requires_grad(x, true);
            nb_tensor *y = max ? nb_max_pool2d(dev, x, &o) : nb_avg_pool2d(dev, x, &o);
            int64_t ny = nb_numel(y);
            if (!rv) {
                rv = malloc(sizeof *rv * (size_t)ny);
                for (int64_t i = 0; i < ny; i++) rv[i] = cos((double)i * 0.11);
            }
            nb_tensor *r = nb_cast(dev, nb_from_host(dev, NB_F64, y->ndim, y->shape, rv), NB_F32);
            nb_backward(nb_sum_all(dev, nb_mul(dev, y, r)));
            g[run] = nbt_values(x->grad);
            nb_ctx_free(dev);
        }
        ck_assert_msg(memcmp(g[0], g[1], sizeof(double) * (size_t)total) == 0,
                      "%s pool backward differs between runs", max ? "max" : "avg");
        free(g[0]);
        free(g[1]);
    }
    free(rv);
    free(xv);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    Suite *s = suite_create("cuda_conv");
    TCase *tc = nbt_tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_conv2d);
    tcase_add_test(tc, test_conv2d_tf32);
    tcase_add_test(tc, test_conv2d_transposed_input);
    tcase_add_test(tc, test_conv2d_wide);
    tcase_add_test(tc, test_conv2d_wide_groups);
    tcase_add_test(tc, test_conv2d_no_input_grad);
    tcase_add_test(tc, test_conv2d_mixed);
    tcase_add_test(tc, test_conv2d_unaligned_batch_view);
    tcase_add_test(tc, test_conv2d_shared_workspace);
    tcase_add_test(tc, test_conv2d_workspace_not_in_context);
    tcase_add_test(tc, test_batch_norm);
    tcase_add_test(tc, test_batch_norm_running_stats);
    tcase_add_test(tc, test_pool);
    tcase_add_test(tc, test_max_pool_ties_and_nan);
    tcase_add_test(tc, test_pool_backward_deterministic);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
