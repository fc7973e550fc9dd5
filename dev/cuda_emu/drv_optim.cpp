/* Driver: the CUDA Adam/AdamW and SGD kernels (tensor/cuda/optim.cu,
 * amsgrad included, with and without the clip inside the update and the
 * 16-bit shadows) and the clip scaling against the CPU's (tensor/cpu/optim.c),
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

/* The update's extras (tensor/backend.h) on both sides: clip by a norm
 * of normv (none when has_clip is false; nothing updated when it is not
 * finite), and bf16 or f16 shadows of f32 parameters (shadow_dt NB_F32:
 * none). */
struct extras {
    nb_tensor *norm = nullptr;
    double max_norm = 0;
    std::vector<nb_tensor *> cpu_sh, emu_sh;
    nb__update_extras xc{}, xe{};
};

static void make_extras(extras &x, nb_dtype dt, const std::vector<int64_t> &sizes, bool has_clip, double normv,
                        nb_dtype shadow_dt) {
    if (has_clip) {
        x.norm = mk(NB_F64, {});
        put(x.norm, {normv});
        x.max_norm = 0.5;
    }
    for (size_t k = 0; shadow_dt != NB_F32 && dt == NB_F32 && k < sizes.size(); k++) {
        nb_tensor *h = mk(shadow_dt, {sizes[k]});
        put(h, std::vector<double>(sizes[k], 0.0));
        x.cpu_sh.push_back(k == 2 ? nullptr : h); /* one parameter without a shadow */
        x.emu_sh.push_back(k == 2 ? nullptr : as(h, shadow_dt));
    }
    x.xc = {x.norm, x.max_norm, x.cpu_sh.empty() ? nullptr : x.cpu_sh.data()};
    x.xe = {x.norm, x.max_norm, x.emu_sh.empty() ? nullptr : x.emu_sh.data()};
}

static void cmp_shadows(const std::string &nm, const extras &x) {
    for (size_t k = 0; k < x.cpu_sh.size(); k++)
        if (x.cpu_sh[k]) cmpt(nm + fmt(" shadow[%zu]", k), x.emu_sh[k], x.cpu_sh[k], 0);
}

static void run(nb_dtype dt, const std::vector<int64_t> &sizes, bool (*ams)(int), bool decoupled, double beta1,
                int steps, bool nan, bool has_clip = false, double normv = 0, nb_dtype shadow_dt = NB_F32) {
    std::string nm = fmt("adam%s %s, %zu parameters, beta1 %g%s", decoupled ? "w" : "", dtn(dt), sizes.size(),
                         beta1, nan ? ", a NaN gradient" : "");
    if (has_clip) nm += fmt(", clip by a norm of %g", normv);
    if (shadow_dt != NB_F32) nm += fmt(", %s shadows", dtn(shadow_dt));
    side cpu, emu;
    make(cpu, emu, dt, sizes, ams);
    extras x;
    make_extras(x, dt, sizes, has_clip, normv, shadow_dt);
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
                     hps.data(), decoupled, &x.xc);
        nb__cuda_adam(n, emu.p.data(), emu.g.data(), emu.m.data(), emu.v.data(), emu.vmax.data(), st.data(),
                      hps.data(), decoupled, &x.xe);
    }
    for (int k = 0; k < n; k++) cmpt(nm + fmt(" g[%d] (not written)", k), emu.g[k], cpu.g[k], 0);
    cmp_shadows(nm, x);
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

/* SGD with momentum (first and later updates), Nesterov, decay, with the
 * extras. */
static void run_sgd(nb_dtype dt, const std::vector<int64_t> &sizes, bool has_clip, double normv,
                    nb_dtype shadow_dt) {
    std::string nm = fmt("sgd %s, %zu parameters%s", dtn(dt), sizes.size(),
                         has_clip ? fmt(", clip by a norm of %g", normv).c_str() : "");
    if (shadow_dt != NB_F32) nm += fmt(", %s shadows", dtn(shadow_dt));
    side cpu, emu;
    make(cpu, emu, dt, sizes, ams_odd); /* m: the momentum buffers; v, vmax unused */
    extras x;
    make_extras(x, dt, sizes, has_clip, normv, shadow_dt);
    int n = (int)sizes.size();
    std::vector<std::vector<double>> hp(n, std::vector<double>(NB__HP_COUNT, 0.0));
    std::vector<const double *> hps(n);
    std::vector<nb_tensor *> cb(n), eb(n);
    std::vector<int64_t> st(n);
    for (int k = 0; k < n; k++) {
        hp[k][NB__HP_LR] = 0.05;
        hp[k][NB__HP_WEIGHT_DECAY] = 0.01 * (k % 2);
        hp[k][NB__HP_MOMENTUM] = k % 3 ? 0.9 : 0.0;
        hp[k][NB__HP_NESTEROV] = k % 3 == 2;
        hps[k] = hp[k].data();
        cb[k] = k % 3 ? cpu.m[k] : nullptr;
        eb[k] = k % 3 ? emu.m[k] : nullptr;
    }
    for (int t = 1; t <= 3; t++) {
        for (int k = 0; k < n; k++) {
            st[k] = t;
            std::vector<double> gv(sizes[k]);
            for (auto &g : gv) g = urand(-1, 1);
            put(cpu.g[k], gv);
            put(emu.g[k], gv);
        }
        nb__cpu_sgd(n, cpu.p.data(), cpu.g.data(), cb.data(), st.data(), hps.data(), &x.xc);
        nb__cuda_sgd(n, emu.p.data(), emu.g.data(), eb.data(), st.data(), hps.data(), &x.xe);
    }
    for (int k = 0; k < n; k++) {
        cmpt(nm + fmt(" p[%d]", k), emu.p[k], cpu.p[k], 0);
        if (cb[k]) cmpt(nm + fmt(" buf[%d]", k), emu.m[k], cpu.m[k], 0);
    }
    cmp_shadows(nm, x);
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
    /* the clip inside the update (clipping, not, NaN and inf: nothing
     * updated) and the shadows (Note [Parameter shadows]) */
    for (double nv : {13.0, 0.3, (double)NAN, (double)INFINITY}) {
        run(NB_F32, sizes, ams_odd, true, 0.9, 3, false, true, nv, NB_BF16);
        run(NB_F64, sizes, ams_all, false, 0.9, 2, false, true, nv);
        run_sgd(NB_F32, sizes, true, nv, NB_F16);
        run_sgd(NB_F64, sizes, true, nv, NB_F32);
    }
    run(NB_F32, sizes, ams_all, false, 0.3, 2, false, false, 0, NB_F16);
    run_sgd(NB_F32, sizes, false, 0, NB_BF16);
    run(NB_F32, std::vector<int64_t>(200, 2), ams_odd, true, 0.9, 2, false, true, 13.0, NB_BF16);
    for (double nv : {13.0, 0.3, (double)NAN, (double)INFINITY}) clip(sizes, nv, 0.5);
    clip(std::vector<int64_t>(300, 3), 7.0, 1.0); /* three launches */
    return done("optim");
}
