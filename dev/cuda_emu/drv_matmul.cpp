/* The CUDA GEMM entry (tensor/cuda/matmul.cu: layouts, batch split, plan
 * cache, epilogues and their fallback kernels) against the CPU library's
 * matmul entry in f64 (tensor/cpu/backend.c), with cuBLASLt replaced by
 * include/cublasLt.h's stand-in. Each case runs twice: with the stand-in's
 * epilogues (BIAS, GELU_AUX_BIAS, DGELU, BGRADB beside beta = 1, a
 * residual C apart from D with beta = 1 and BIAS or none), and with the
 * heuristic refusing every epilogue and every C apart, so that matmul.cu's
 * own epilogue_kernel and bgrad_kernel run. A GELU forward's output is
 * also compared with GELU made again from its kept pre-activation by the
 * elementwise kernel (recomputed). */
#include "check.h"
#include <cublasLt.h>
extern "C" {
#include "tensor/backend.h"
}

/* A (rows, cols) tensor of dtype dt holding `of`'s values, or its
 * transpose's view when trans (stored (cols, rows)). */
static nb_tensor *operand(nb_dtype dt, const nb_tensor *of, bool trans) {
    if (!trans) return as(of, dt);
    int64_t r = of->shape[0], c = of->shape[1];
    nb_tensor *s = mk(dt, {c, r});
    std::vector<double> v = get(of), w(v.size());
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) w[j * r + i] = v[i * c + j];
    put(s, w);
    return nb_transpose(CTX, s, 0, 1);
}

/* Note [GELU recomputed in backward] (tensor/ops_matmul.c): the GELU output
 * made again from the kept pre-activation by the elementwise kernel
 * (elementwise.cu's GELU_TANH) against the GEMM's (the stand-in's GELU_AUX
 * epilogue, or epilogue_kernel). f32 and f64: the same bits (both apply
 * nb_gelu's formula to the same value). bf16 and f16: the GEMM applies it
 * to the f32 sum v and rounds, the kernel to pre = v rounded; they differ
 * by at most GELU's slope (< 1.13) times pre's rounding (u |pre|, u the
 * unit roundoff) plus each output's own rounding (u |out|, u |again|).
 * The elements that differ are counted and printed. */
static void recomputed(const std::string &nm, nb_dtype dt, const nb_tensor *out, const nb_tensor *pre) {
    nb_tensor *again = mk(dt, std::vector<int64_t>(out->shape, out->shape + out->ndim));
    nb__cuda_unary(NB_U_GELU_TANH, again, pre, 0);
    std::vector<double> o = get(out), g = get(again), p = get(pre);
    if (dt == NB_F32 || dt == NB_F64) {
        cmpv(nm + " GELU of the kept pre-activation", g, o, 0);
        return;
    }
    double u = dt == NB_BF16 ? 0x1p-8 : 0x1p-11;
    CHECKS++;
    size_t differ = 0, bad = 0, at = 0;
    for (size_t i = 0; i < o.size(); i++) {
        differ += g[i] != o[i];
        if (!(fabs(g[i] - o[i]) <= 1.13 * u * fabs(p[i]) + u * (fabs(o[i]) + fabs(g[i]))) && !bad++) at = i;
    }
    printf("%s: GELU of the kept pre-activation differs from the GEMM's output in %zu of %zu elements\n",
           nm.c_str(), differ, o.size());
    if (!bad) return;
    FAILS++;
    printf("FAIL %s GELU of the kept pre-activation: element %zu is %.9g, the GEMM's %.9g (pre %.9g), "
           "%zu elements past the bound\n", nm.c_str(), at, g[at], o[at], p[at], bad);
}

/* out (l, m, n) = op(a) (l, m, k) @ op(b) (k, n) + bias [gelu, pre]: the
 * Linear forward (b a (n, k) weight transposed: tb). */
static void forward(nb_dtype dt, nb_dtype bias_dt, int64_t l, int64_t m, int64_t k, int64_t n,
                    bool gelu, bool refuse) {
    std::string nm = fmt("forward %s bias %s (%lld,%lld,%lld,%lld) gelu %d refuse %d", dtn(dt),
                         dtn(bias_dt), (long long)l, (long long)m, (long long)k, (long long)n, gelu,
                         refuse);
    nb_tensor *a64 = mk(NB_F64, {l, m, k}), *w64 = mk(NB_F64, {n, k}), *bias64 = mk(NB_F64, {n});
    fill(a64, -1, 1), fill(w64, -1, 1), fill(bias64, -1, 1);
    a64 = as(as(a64, dt), NB_F64), w64 = as(as(w64, dt), NB_F64), bias64 = as(as(bias64, bias_dt), NB_F64);
    nb_tensor *a = as(a64, dt), *w = as(w64, dt), *bias = as(bias64, bias_dt);
    nb_tensor *out = mk(dt, {l, m, n}), *pre = gelu ? mk(dt, {l, m, n}) : nullptr;
    emu_cublaslt_refuse_epilogues = refuse;
    nb__gemm_epilogue e = {}, e64 = {};
    e.bias = bias, e.gelu = gelu, e.pre = pre;
    nb__cuda_gemm(out, a, w, false, true, &e);
    nb_tensor *o64 = mk(NB_F64, {l, m, n}), *p64 = gelu ? mk(NB_F64, {l, m, n}) : nullptr;
    e64.bias = bias64, e64.gelu = gelu, e64.pre = p64;
    nb__cpu_backend.matmul(o64, a64, w64, false, true, &e64);
    double tol = tol_of(dt) * 4;
    cmpv(nm + " out", get(out), get(o64), tol, (double)k);
    if (gelu) cmpv(nm + " pre", get(pre), get(p64), tol, (double)k);
    if (gelu) recomputed(nm, dt, out, pre);
}

/* out (l, m, n) = a (l, m, k) @ w (n, k)^T [+ bias] + r (l, m, n), r read
 * as C with beta = 1 and out written apart (Note [Residual in the GEMM]
 * in tensor/ops_matmul.c). */
static void residual(nb_dtype dt, nb_dtype bias_dt, bool with_bias, int64_t l, int64_t m,
                     int64_t k, int64_t n, bool refuse) {
    std::string nm = fmt("residual %s bias %s (%lld,%lld,%lld,%lld) refuse %d", dtn(dt),
                         with_bias ? dtn(bias_dt) : "none", (long long)l, (long long)m,
                         (long long)k, (long long)n, refuse);
    nb_tensor *a64 = mk(NB_F64, {l, m, k}), *w64 = mk(NB_F64, {n, k}), *bias64 = mk(NB_F64, {n});
    nb_tensor *r64 = mk(NB_F64, {l, m, n});
    fill(a64, -1, 1), fill(w64, -1, 1), fill(bias64, -1, 1), fill(r64, -4, 4);
    a64 = as(as(a64, dt), NB_F64), w64 = as(as(w64, dt), NB_F64);
    bias64 = as(as(bias64, bias_dt), NB_F64), r64 = as(as(r64, dt), NB_F64);
    nb_tensor *a = as(a64, dt), *w = as(w64, dt), *bias = as(bias64, bias_dt), *r = as(r64, dt);
    nb_tensor *out = mk(dt, {l, m, n}), *o64 = mk(NB_F64, {l, m, n});
    emu_cublaslt_refuse_epilogues = refuse;
    nb__gemm_epilogue e = {}, e64 = {};
    e.bias = with_bias ? bias : nullptr, e.residual = r;
    e64.bias = with_bias ? bias64 : nullptr, e64.residual = r64;
    nb__cuda_gemm(out, a, w, false, true, &e);
    nb__cpu_backend.matmul(o64, a64, w64, false, true, &e64);
    cmpv(nm, get(out), get(o64), tol_of(dt) * 4, (double)k + 4);
    cmpv(nm + " residual untouched", get(r), get(r64), 0, 1);
}

/* acc (m, n) f32 += op(a)^T-style weight gradient g^T x (a = g (k, m)
 * transposed, b = x (k, n)) with the bias gradient bgrad (m), the sums of
 * g's columns: BGRADB beside beta = 1. */
static void bias_grad(nb_dtype dt, int64_t m, int64_t k, int64_t n, bool refuse) {
    std::string nm = fmt("bgrad %s (%lld,%lld,%lld) refuse %d", dtn(dt), (long long)m, (long long)k,
                         (long long)n, refuse);
    nb_tensor *g64 = mk(NB_F64, {k, m}), *x64 = mk(NB_F64, {k, n}), *acc64 = mk(NB_F64, {m, n});
    fill(g64, -1, 1), fill(x64, -1, 1), fill(acc64, -1, 1);
    g64 = as(as(g64, dt), NB_F64), x64 = as(as(x64, dt), NB_F64);
    nb_dtype adt = dt == NB_F64 ? NB_F64 : NB_F32;
    acc64 = as(as(acc64, adt), NB_F64);
    nb_tensor *g = as(g64, dt), *x = as(x64, dt), *acc = as(acc64, adt), *bg = mk(NB_F32, {m});
    emu_cublaslt_refuse_epilogues = refuse;
    nb__gemm_epilogue e = {}, e64 = {};
    e.accumulate = true, e.bgrad = bg;
    nb__cuda_gemm(acc, g, x, true, false, &e);
    nb_tensor *bg64 = mk(NB_F32, {m});
    e64.accumulate = true, e64.bgrad = bg64;
    nb__cpu_backend.matmul(acc64, g64, x64, true, false, &e64);
    double tol = std::max(tol_of(adt), 2e-6) * 4;
    cmpv(nm + " accumulated", get(acc), get(acc64), tol, (double)k);
    cmpv(nm + " bias gradient", get(bg), get(bg64), tol, (double)k);
}

/* out (l, m, n) = (g (l, m, k) @ op(w) (k, n)) * GELU'(pre): DGELU, w
 * stored (k, n) or transposed. */
static void dgelu(nb_dtype dt, int64_t l, int64_t m, int64_t k, int64_t n, bool tw, bool refuse) {
    std::string nm = fmt("dgelu %s (%lld,%lld,%lld,%lld) tw %d refuse %d", dtn(dt), (long long)l,
                         (long long)m, (long long)k, (long long)n, tw, refuse);
    nb_tensor *g64 = mk(NB_F64, {l, m, k}), *w64 = mk(NB_F64, {k, n}), *p64 = mk(NB_F64, {l, m, n});
    fill(g64, -1, 1), fill(w64, -1, 1), fill(p64, -3, 3);
    g64 = as(as(g64, dt), NB_F64), w64 = as(as(w64, dt), NB_F64), p64 = as(as(p64, dt), NB_F64);
    nb_tensor *g = as(g64, dt), *w = operand(dt, w64, tw), *pre = as(p64, dt);
    nb_tensor *out = mk(dt, {l, m, n}), *o64 = mk(NB_F64, {l, m, n});
    emu_cublaslt_refuse_epilogues = refuse;
    nb__gemm_epilogue e = {}, e64 = {};
    e.dgelu_pre = pre, e64.dgelu_pre = p64;
    nb__cuda_gemm(out, g, tw ? nb_transpose(CTX, w, 0, 1) : w, false, tw, &e);
    nb__cpu_backend.matmul(o64, g64, w64, false, false, &e64);
    cmpv(nm, get(out), get(o64), tol_of(dt) * 4, (double)k);
}

int main() {
    init();
    for (int refuse = 0; refuse < 2; refuse++) {
        /* the plans are cached by shape: the refusing pass uses other sizes */
        int64_t r = refuse;
        for (nb_dtype dt : ALL_DT) {
            bool half = dt == NB_BF16 || dt == NB_F16;
            forward(dt, dt, 1, 8 + r, 16, 24, false, refuse);
            forward(dt, dt, 3, 5 + r, 12, 16, true, refuse);   /* folded batch, GELU_AUX_BIAS */
            forward(dt, dt, 2, 3 + r, 7, 9, true, refuse);     /* aux not 8-aligned: the kernel */
            if (half) {
                forward(dt, NB_F32, 2, 4 + r, 16, 32, false, refuse); /* an f32 bias, 16-bit out */
                forward(dt, NB_F32, 2, 4 + r, 16, 32, true, refuse);
            }
            residual(dt, dt, true, 1, 8 + r, 16, 24, refuse);
            residual(dt, dt, false, 3, 5 + r, 12, 16, refuse); /* folded batch, no bias */
            residual(dt, dt, true, 2, 3 + r, 7, 9, refuse);
            if (half) residual(dt, NB_F32, true, 2, 4 + r, 16, 32, refuse); /* the GPT's case */
            bias_grad(dt, 24, 40 + r, 16, refuse);
            bias_grad(dt, 7, 33 + r, 5, refuse);
            dgelu(dt, 2, 6 + r, 16, 32, false, refuse);
            dgelu(dt, 1, 5 + r, 8, 24, true, refuse);
            dgelu(dt, 2, 3 + r, 5, 7, false, refuse); /* aux not 8-aligned: the kernel */
        }
    }
    return done("matmul");
}
