#include "check.h"
static void rc(nb_dtype dt, int64_t o, int64_t in, bool special) {
    std::string nm = fmt("reduce %s (%lld,%lld)%s", dtn(dt), (long long)o, (long long)in, special ? " nan/ties" : "");
    nb_tensor *x = mk(dt, {o, in});
    fill(x, -3, 4);
    auto xv = get(x);
    if (special) {
        for (int64_t r = 0; r < o; r++) {
            if (r % 3 == 0) xv[r * in + (in * 2) / 3] = NAN, xv[r * in + in / 3] = NAN;
            if (r % 3 == 1) xv[r * in + in / 2] = 9, xv[r * in + in - 1] = 9, xv[r * in] = -INFINITY;
            if (r % 3 == 2) for (int64_t j = 0; j < in; j++) xv[r * in + j] = -INFINITY;
        }
        put(x, xv);
    }
    std::vector<double> sum(o), mx(o), arg(o), var(o), mean(o);
    for (int64_t r = 0; r < o; r++) {
        double s = 0, m = -INFINITY; int64_t a = 0; bool nan = false;
        for (int64_t j = 0; j < in; j++) {
            double v = xv[r * in + j];
            s += v;
            if (nan) continue;
            if (std::isnan(v)) { nan = true; m = v; a = j; }
            else if (v > m || j == 0) { m = v; a = j; }
        }
        sum[r] = s; mx[r] = m; arg[r] = (double)a; mean[r] = s / in;
        double q = 0;
        for (int64_t j = 0; j < in; j++) q += (xv[r * in + j] - mean[r]) * (xv[r * in + j] - mean[r]);
        var[r] = in - 1 > 0 ? q / (in - 1) : NAN;
    }
    nb_tensor *out = mk(dt, {o});
    nb__cuda_sum_rows(out, x, o, in, 0.5);
    std::vector<double> half(o);
    for (int64_t r = 0; r < o; r++) half[r] = sum[r] * 0.5;
    if (!special) cmpv(nm + " sum", get(out), half, tol_of(dt), 1);
    nb_tensor *mo = mk(dt, {o}), *ma = mk(NB_I64, {o});
    nb__cuda_max_rows(mo, ma, x, o, in);
    cmpv(nm + " max", get(mo), mx, 0);
    cmpv(nm + " argmax", get(ma), arg, 0);
    nb_tensor *g = mk(dt, {o}), *gp = mk(dt, {o, in});
    fill(g, 1, 2);
    nb__cuda_max_rows_backward(gp, ma, g, o, in);
    std::vector<double> gr(o * in, 0), gv = get(g);
    for (int64_t r = 0; r < o; r++) gr[r * in + (int64_t)arg[r]] = gv[r];
    cmpv(nm + " max bwd", get(gp), gr, 0);
    if (!special) {
        nb_tensor *vo = mk(dt, {o}), *vm = mk(dt, {o});
        nb__cuda_var_rows(vo, vm, x, o, in, (double)(in - 1));
        cmpv(nm + " var", get(vo), var, tol_of(dt));
        cmpv(nm + " var mean", get(vm), mean, tol_of(dt), 1);
    }
}
static void losses(nb_dtype dt, int64_t n) {
    nb_tensor *a = mk(dt, {n}), *b = mk(dt, {n});
    fill(a, -4, 4); fill(b, 0, 1);
    auto av = get(a), bv = get(b);
    double mse = 0, bce = 0;
    for (int64_t i = 0; i < n; i++) {
        mse += (av[i] - bv[i]) * (av[i] - bv[i]);
        bce += std::max(av[i], 0.0) - av[i] * bv[i] + log1p(exp(-fabs(av[i])));
    }
    nb_tensor *o = mk(dt, {});
    nb__cuda_pair_loss(o, 0, a, b);
    cmpv(fmt("mse %s %lld", dtn(dt), (long long)n), get(o), {mse / n}, tol_of(dt));
    nb__cuda_pair_loss(o, 1, a, b);
    cmpv(fmt("bce %s %lld", dtn(dt), (long long)n), get(o), {bce / n}, tol_of(dt) * 2);
}
static void sumsq(nb_dtype odt, std::vector<int64_t> sizes) {
    std::vector<nb_tensor *> ts;
    double ref = 0;
    int i = 0;
    for (auto s : sizes) {
        nb_tensor *t = mk(ALL_DT[i++ % 4], {s});
        fill(t, -1, 1);
        for (double v : get(t)) ref += v * v;
        t->device.type = NB_DEVICE_CUDA;
        ts.push_back(t);
    }
    nb_tensor *o = mk(odt, {});
    o->device.type = NB_DEVICE_CUDA;
    nb__cuda_sum_squares(o, (int)ts.size(), ts.data());
    cmpv(fmt("sumsq %s n %zu", dtn(odt), sizes.size()), get(o), {ref}, odt == NB_F64 ? 1e-12 : 1e-6);
}
int main(int argc, char **argv) {
    init();
    int part = argc > 1 ? atoi(argv[1]) : -1;
    if (part < 0 || part == 0)
        for (nb_dtype dt : ALL_DT) {
            struct { int64_t o, in; } cs[] = {{7, 1}, {30, 5}, {9, 8}, {9, 9}, {20, 100}, {3, 1024}, {5, 1025}, {2, 5000}, {1, 20000}};
            for (auto &c : cs) { rc(dt, c.o, c.in, false); rc(dt, c.o, c.in, true); }
        }
    if (part < 0 || part == 1) {
        for (nb_dtype dt : ALL_DT) { losses(dt, 7); losses(dt, 3000); losses(dt, 20001); }
        sumsq(NB_F32, {5, 0, 4097, 70000, 3});
        sumsq(NB_F64, {1, 2, 3});
        std::vector<int64_t> many(40);
        for (size_t k = 0; k < many.size(); k++) many[k] = 100 + 37 * (int64_t)k;
        sumsq(NB_F64, many);
        sumsq(NB_F32, {0, 0});
    }
    return done("reduce");
}
