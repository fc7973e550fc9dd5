/* Driver: the CUDA Adam/AdamW kernel (tensor/cuda/optim.cu, amsgrad
 * included) and the clip scaling against the CPU's (tensor/cpu/optim.c),
 * bit for bit: both do
 * the same operations in the same order without contraction. Lists mix
 * parameters with and without max_exp_avg_sq, f32 and f64, sizes across
 * block boundaries, per-parameter step counts, both lerp forms, L2 and
 * decoupled decay, a NaN gradient (AMSGrad's maximum must carry it), and
 * more parameters than one launch takes (MAX_TENSORS). */
#include "check.h"
#include "optim/internal.h"
extern "C" {
#include "tensor/cpu/cpu.h"
}

struct side {
    std::vector<nb_tensor *> p, g, m, v, vmax;
};

/* Two identical sides of n parameters; parameter k keeps vmax when ams(k). */
static void make(side &a, side &b, nb_dtype dt, const std::vector<int64_t> &sizes, bool (*ams)(int)) {
    for (size_t k = 0; k < sizes.size(); k++) {
        nb_tensor *t[4];
        for (int j = 0; j < 4; j++) {
            t[j] = mk(dt, {sizes[k]});
            if (j == 0) fill(t[j], -2, 2);
            else put(t[j], std::vector<double>(sizes[k], 0.0));
        }
        nb_tensor *vm = ams((int)k) ? mk(dt, {sizes[k]}) : nullptr;
        if (vm) put(vm, std::vector<double>(sizes[k], 0.0));
        a.p.push_back(t[0]), a.g.push_back(t[1]), a.m.push_back(t[2]), a.v.push_back(t[3]), a.vmax.push_back(vm);
        b.p.push_back(as(t[0], dt)), b.g.push_back(as(t[1], dt)), b.m.push_back(as(t[2], dt));
        b.v.push_back(as(t[3], dt)), b.vmax.push_back(vm ? as(vm, dt) : nullptr);
    }
}

static bool ams_odd(int k) { return k % 2 == 1; }
static bool ams_all(int) { return true; }

static void run(nb_dtype dt, const std::vector<int64_t> &sizes, bool (*ams)(int), bool decoupled, double beta1,
                int steps, bool nan) {
    std::string nm = fmt("adam%s %s, %zu parameters, beta1 %g%s", decoupled ? "w" : "", dtn(dt), sizes.size(),
                         beta1, nan ? ", a NaN gradient" : "");
    side cpu, emu;
    make(cpu, emu, dt, sizes, ams);
    int n = (int)sizes.size();
    std::vector<std::vector<double>> hp(n, std::vector<double>(NB__HP_COUNT, 0.0));
    std::vector<const double *> hps(n);
    std::vector<int64_t> st(n);
    for (int k = 0; k < n; k++) {
        hp[k][NB__HP_LR] = 0.01 * (1 + k % 3);
        hp[k][NB__HP_WEIGHT_DECAY] = 0.1 * (k % 2);
        hp[k][NB__HP_BETA1] = beta1;
        hp[k][NB__HP_BETA2] = 0.5 + 0.1 * (k % 4); /* short memories: v falls below its maximum */
        hp[k][NB__HP_EPS] = 1e-8;
        hp[k][NB__HP_AMSGRAD] = ams(k);
        hps[k] = hp[k].data();
    }
    for (int t = 1; t <= steps; t++) {
        for (int k = 0; k < n; k++) {
            st[k] = t + k % 3;
            std::vector<double> gv(sizes[k]);
            double scale = t % 2 ? 1.0 : 0.1; /* alternating sizes */
            for (auto &x : gv) x = scale * urand(-1, 1);
            if (nan && t == 2 && k == 1 && sizes[k] > 0) gv[sizes[k] / 2] = NAN;
            put(cpu.g[k], gv);
            put(emu.g[k], gv);
        }
        nb__cpu_adam(n, cpu.p.data(), cpu.g.data(), cpu.m.data(), cpu.v.data(), cpu.vmax.data(), st.data(),
                     hps.data(), decoupled);
        nb__cuda_adam(n, emu.p.data(), emu.g.data(), emu.m.data(), emu.v.data(), emu.vmax.data(), st.data(),
                      hps.data(), decoupled);
    }
    for (int k = 0; k < n; k++) {
        cmpt(nm + fmt(" p[%d]", k), emu.p[k], cpu.p[k], 0);
        cmpt(nm + fmt(" m[%d]", k), emu.m[k], cpu.m[k], 0);
        cmpt(nm + fmt(" v[%d]", k), emu.v[k], cpu.v[k], 0);
        if (cpu.vmax[k]) cmpt(nm + fmt(" vmax[%d]", k), emu.vmax[k], cpu.vmax[k], 0);
    }
    if (nan) { /* the NaN went into vmax on both sides (cmpv matches NaN with NaN) */
        CHECKS++;
        if (!std::isnan(get(emu.vmax[1])[sizes[1] / 2])) {
            FAILS++;
            printf("FAIL %s: vmax[1] lost the NaN\n", nm.c_str());
        }
    }
}

/* Gradient clipping's scaling by a norm on the device (nb__cuda_clip_scale)
 * against tensor/cpu/optim.c's, bit for bit: a norm that clips, one that
 * does not, NaN and infinity (nothing written), over n f32 tensors. */
static void clip(const std::vector<int64_t> &sizes, double normv, double max_norm) {
    std::string nm = fmt("clip_scale %zu tensors, norm %g, max %g", sizes.size(), normv, max_norm);
    std::vector<nb_tensor *> a, b;
    for (int64_t m : sizes) {
        nb_tensor *t = mk(NB_F32, {m});
        fill(t, -3, 3);
        a.push_back(t);
        b.push_back(as(t, NB_F32));
    }
    nb_tensor *norm = mk(NB_F64, {});
    put(norm, {normv});
    nb__cpu_clip_scale((int)a.size(), a.data(), norm, max_norm);
    nb__cuda_clip_scale((int)b.size(), b.data(), norm, max_norm);
    for (size_t k = 0; k < a.size(); k++) cmpt(nm + fmt(" [%zu]", k), b[k], a[k], 0);
}

int main() {
    init();
    const std::vector<int64_t> sizes = {1, 7, 1000, 1025, 4099, 3, 0};
    for (nb_dtype dt : {NB_F32, NB_F64})
        for (int decoupled = 0; decoupled < 2; decoupled++)
            for (double beta1 : {0.9, 0.3}) {
                run(dt, sizes, ams_odd, decoupled, beta1, 4, false);
                run(dt, sizes, ams_all, decoupled, beta1, 3, false);
            }
    run(NB_F32, sizes, ams_odd, true, 0.9, 3, true);
    run(NB_F64, sizes, ams_all, false, 0.9, 3, true);
    run(NB_F32, std::vector<int64_t>(200, 2), ams_odd, true, 0.9, 2, false); /* two launches */
    for (double nv : {13.0, 0.3, (double)NAN, (double)INFINITY}) clip(sizes, nv, 0.5);
    clip(std::vector<int64_t>(300, 3), 7.0, 1.0); /* three launches */
    return done("optim");
}
