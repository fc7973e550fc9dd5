/* Fused causal attention (tensor/cuda/attention.cu, our own kernels)
 * against the CPU library's fused attention in f64
 * (tensor/cpu/attention.c): y, the log-sum-exp, and every element of dqkv. */
#include "check.h"
extern "C" {
#include "tensor/cpu/attention.h"
}

static double max_abs(const std::vector<double> &v) {
    double m = 0;
    for (double x : v) m = std::max(m, fabs(x));
    return m;
}

/* Errors measured against the tensor's largest element: a flash kernel
 * sums in another order than the reference, so small entries carry the
 * error of the large ones. */
static void close_to(const std::string &nm, const nb_tensor *g, const nb_tensor *r, double tol) {
    auto rv = get(r);
    cmpv(nm, get(g), rv, tol, max_abs(rv));
}

static void attn(nb_dtype dt, int64_t n, int64_t t, int h, int64_t d) {
    std::string nm = fmt("attention %s N %lld T %lld H %d D %lld", dtn(dt), (long long)n, (long long)t, h,
                         (long long)d);
    int64_t c = h * d;
    double scale = 1 / sqrt((double)d);
    nb_tensor *qkv = mk(dt, {n, t, 3 * c});
    fill(qkv, -2, 2);
    nb_tensor *y = mk(dt, {n, t, c}), *lse = mk(NB_F32, {n, h, t});
    nb__cuda_causal_attention(CTX, y, lse, qkv, h, scale);
    nb_tensor *qkv64 = as(qkv, NB_F64), *y64 = mk(NB_F64, {n, t, c}), *lse64 = mk(NB_F32, {n, h, t});
    nb__cpu_causal_attention(CTX, y64, lse64, qkv64, h, scale);
    /* f32: sums of T terms; bf16: one rounding of the output */
    double tol = dt == NB_F32 ? 2e-5 : 8e-3;
    close_to(nm + " y", y, y64, tol);
    cmpt(nm + " lse", lse, lse64, dt == NB_F32 ? 2e-6 : 1e-5);

    /* backward from the reference y (rounded to dt) and lse, on both sides */
    nb_tensor *gy = mk(dt, {n, t, c});
    fill(gy, -1, 1);
    nb_tensor *dqkv = mk(dt, {n, t, 3 * c}), *dqkv64 = mk(NB_F64, {n, t, 3 * c});
    nb_tensor *yr = as(y64, dt);
    nb__cuda_causal_attention_backward(CTX, dqkv, qkv, yr, lse64, gy, h, scale);
    nb__cpu_causal_attention_backward(CTX, dqkv64, qkv64, as(yr, NB_F64), lse64, as(gy, NB_F64), h, scale);
    /* dq, dk and dv apart: each against its own largest element (or a
     * hundredth of dqkv's, where it is 0: T = 1 has dq = dk = 0) */
    std::vector<double> g = get(dqkv), r = get(dqkv64);
    const char *part[3] = {"dq", "dk", "dv"};
    for (int p = 0; p < 3; p++) {
        std::vector<double> gp, rp;
        for (int64_t row = 0; row < n * t; row++)
            for (int64_t e = 0; e < c; e++) {
                gp.push_back(g[row * 3 * c + p * c + e]);
                rp.push_back(r[row * 3 * c + p * c + e]);
            }
        cmpv(nm + " " + part[p], gp, rp, dt == NB_F32 ? 5e-5 : 2e-2, std::max(max_abs(rp), max_abs(r) / 100));
    }
}

int main() {
    init();
    setenv("NABLA_CUDA_ATTENTION", "own", 1); /* cuDNN cannot run here */
    /* T odd and not a multiple of any tile (16, 32), a single row, several
     * query and key tiles; D at each column class (32, 64, 96, 128) and
     * between (40); 1-3 heads; batch 1-2 */
    struct { int64_t n, t; int h; int64_t d; } cs[] = {
        {1, 1, 1, 32}, {2, 37, 3, 32}, {1, 77, 2, 64}, {2, 50, 1, 128}, {1, 33, 3, 128},
        {1, 45, 2, 40}, {1, 19, 1, 96}, {1, 130, 1, 64},
    };
    for (nb_dtype dt : {NB_F32, NB_BF16})
        for (auto &k : cs) attn(dt, k.n, k.t, k.h, k.d);
    return done("attention");
}
