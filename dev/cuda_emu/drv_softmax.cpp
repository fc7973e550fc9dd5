#include "check.h"
extern "C" {
#include "tensor/cpu/softmax.h"
}
static void softmax_case(nb_dtype dt, int64_t o, int64_t k, int64_t in, bool lg, int off) {
    std::string nm = fmt("softmax%s %s (%lld,%lld,%lld) off %d", lg ? " log" : "", dtn(dt), (long long)o, (long long)k, (long long)in, off);
    nb_tensor *x = mk(dt, {o, k, in}, off), *y = mk(dt, {o, k, in}, off);
    fill(x, -8, 8);
    nb_tensor *x64 = as(x, NB_F64), *y64 = mk(NB_F64, {o, k, in});
    nb__cuda_softmax(y, x, o, k, in, lg);
    nb__cpu_softmax(y64, x64, o, k, in, lg);
    cmpt(nm + " fwd", y, y64, tol_of(dt));
    /* backward: y from the reference (rounded), g random */
    nb_tensor *yy = as(y64, dt), *g = mk(dt, {o, k, in}, off), *dx = mk(dt, {o, k, in}, off);
    fill(g, -1, 1);
    nb_tensor *dx64 = mk(NB_F64, {o, k, in});
    nb__cuda_softmax_backward(dx, yy, g, o, k, in, lg);
    nb__cpu_softmax_backward(dx64, as(yy, NB_F64), as(g, NB_F64), o, k, in, lg);
    cmpt(nm + " bwd", dx, dx64, tol_of(dt) * 4);
}
/* Rows with special values, forward against the CPU in f64: all -inf
 * (NaN), a +inf (NaN row), a NaN (NaN row), -inf among finite values (0
 * there), a plain row. */
static void softmax_special(nb_dtype dt, int64_t k, bool lg) {
    std::string nm = fmt("softmax%s %s special rows K=%lld", lg ? " log" : "", dtn(dt), (long long)k);
    const int64_t o = 5;
    nb_tensor *x = mk(dt, {o, k, 1}), *y = mk(dt, {o, k, 1});
    fill(x, -8, 8);
    auto v = get(x);
    for (int64_t j = 0; j < k; j++) v[j] = -INFINITY;
    v[1 * k + k / 2] = INFINITY;
    v[2 * k + k - 1] = NAN;
    v[3 * k + 0] = -INFINITY;
    v[3 * k + k / 3] = -INFINITY;
    put(x, v);
    nb_tensor *y64 = mk(NB_F64, {o, k, 1});
    nb__cuda_softmax(y, x, o, k, 1, lg);
    nb__cpu_softmax(y64, as(x, NB_F64), o, k, 1, lg);
    cmpt(nm, y, y64, tol_of(dt));
}

/* f32_loss: the loss of bf16/f16 logits in f32 (Note [Compute dtype] in tensor/context.c) */
static void ce_case(nb_dtype dt, nb_dtype tdt, int64_t n, int64_t c, int64_t ignore, double eps, int tstride, bool bad = false,
                    bool f32_loss = false) {
    std::string nm = fmt("ce %s t%s (%lld,%lld) ign %lld eps %g ts %d%s%s", dtn(dt), dtn(tdt), (long long)n, (long long)c, (long long)ignore, eps, tstride, bad ? " bad" : "",
                         f32_loss ? " f32 loss" : "");
    nb_tensor *x = mk(dt, {n, c});
    fill(x, -6, 6);
    nb_tensor *tb = mk(tdt, {n * tstride});
    std::vector<double> tv(n * tstride);
    for (auto &v : tv) v = (double)(int64_t)urand(0, (double)c);
    for (int64_t i = 0; i < n; i += 3) tv[i * tstride] = (double)ignore; /* some ignored */
    if (bad) tv[(n - 1) * tstride] = (double)c;
    put(tb, tv);
    int64_t sh[1] = {n}, st[1] = {tstride};
    nb_tensor *t = nb__view(CTX, tb, 1, sh, st, tb->data);
    nb_tensor *tc = mk(tdt, {n});
    for (int64_t i = 0; i < n; i++) nb__store((char *)tc->data + i * nb_dtype_size(tdt), tdt, tv[i * tstride]);
    nb_tensor *loss = mk(f32_loss ? NB_F32 : dt, {}), *lse = mk(dt == NB_F64 ? NB_F64 : NB_F32, {n}), *count = mk(NB_F32, {});
    memset(nb__cuda_fault_slot(0), 0, sizeof(nb__cuda_fault));
    nb__cuda_cross_entropy_rows(loss, lse, count, nullptr, x, t, ignore, eps);
    nb__cuda_fault *f = nb__cuda_fault_slot(0);
    if (bad) {
        CHECKS++;
        if (f->code != NB__FAULT_CROSS_ENTROPY_TARGET || f->value != c || f->position != n - 1 || f->limit != c) { FAILS++; printf("FAIL %s: fault %d %lld %lld %lld\n", nm.c_str(), f->code, f->value, f->position, f->limit); }
        return;
    }
    if (f->code) { FAILS++; printf("FAIL %s: unexpected fault\n", nm.c_str()); }
    nb_tensor *x64 = as(x, NB_F64), *lse64 = mk(NB_F64, {n});
    double tot = nb__cpu_cross_entropy_rows(lse64, nullptr, x64, tc, ignore, eps, 0);
    int64_t cnt = 0;
    for (int64_t i = 0; i < n; i++) cnt += (int64_t)tv[i * tstride] != ignore;
    cmpv(nm + " loss", get(loss), {tot / (double)cnt}, tol_of(f32_loss ? NB_F32 : dt));
    cmpv(nm + " count", get(count), {(double)cnt}, 0);
    cmpt(nm + " lse", lse, lse64, dt == NB_F64 ? 1e-12 : 2e-6);
    nb_tensor *g = mk(NB_F32, {});
    put(g, {1.7});
    nb_tensor *dx = mk(dt, {n, c}), *dx64 = mk(NB_F64, {n, c});
    nb__cuda_cross_entropy_backward(dx, x, lse, t, g, count, ignore, eps);
    nb__cpu_cross_entropy_backward_rows(dx64, x64, lse64, tc, ignore, eps, cnt > 0 ? get(g)[0] / (double)cnt : 0);
    cmpv(nm + " dx", get(dx), get(dx64), tol_of(dt) * 2, 1.7 / (double)(cnt > 0 ? cnt : 1));
    /* written over the logits, as nb_cross_entropy's backward does with
     * logits no other node reads (Note [Memory given back]) */
    nb_tensor *xa = mk(dt, {n, c});
    put(xa, get(x));
    nb__cuda_cross_entropy_backward(xa, xa, lse, t, g, count, ignore, eps);
    cmpv(nm + " dx over x", get(xa), get(dx64), tol_of(dt) * 2, 1.7 / (double)(cnt > 0 ? cnt : 1));
    /* fused (Note [Fused classifier] in tensor/ops_loss.c): the forward
     * writes the gradient for g = 1 over the logits, no lse; then the
     * backward's scaling pass, in place, for g = 1.7 */
    nb_tensor *xf = mk(dt, {n, c}), *lossf = mk(f32_loss ? NB_F32 : dt, {}), *countf = mk(NB_F32, {});
    put(xf, get(x));
    nb__cuda_cross_entropy_rows(lossf, nullptr, countf, xf, xf, t, ignore, eps);
    if (f->code) { FAILS++; printf("FAIL %s: unexpected fault (fused)\n", nm.c_str()); }
    cmpv(nm + " fused loss", get(lossf), {tot / (double)cnt}, tol_of(f32_loss ? NB_F32 : dt));
    cmpv(nm + " fused count", get(countf), {(double)cnt}, 0);
    nb_tensor *dx1 = mk(NB_F64, {n, c});
    nb__cpu_cross_entropy_backward_rows(dx1, x64, lse64, tc, ignore, eps, cnt > 0 ? 1.0 / (double)cnt : 0);
    cmpv(nm + " fused dx", get(xf), get(dx1), tol_of(dt) * 2, 1.0 / (double)(cnt > 0 ? cnt : 1));
    nb__cuda_cross_entropy_backward(xf, xf, nullptr, t, g, countf, ignore, eps);
    cmpv(nm + " fused dx * g", get(xf), get(dx64), tol_of(dt) * 3, 1.7 / (double)(cnt > 0 ? cnt : 1));
}
int main(int argc, char **argv) {
    init();
    int part = argc > 1 ? atoi(argv[1]) : -1;
    if (part < 0 || part == 0)
        for (nb_dtype dt : ALL_DT)
            for (bool lg : {false, true}) {
                struct { int64_t o, k, in; int off; } cs[] = {{3, 1, 1, 0}, {9, 7, 1, 1}, {5, 33, 1, 1}, {1, 1025, 1, 1},
                                                          {1, 5000, 1, 0}, {3, 5, 7, 0}, {1, 300, 33, 1}, {4, 1, 40, 0},
                                                          /* rows in registers: 4, 8, 16, 32 per lane */
                                                          {2, 100, 1, 0}, {2, 200, 1, 1}, {1, 300, 1, 0},
                                                          {2, 1000, 1, 1}, {1, 1024, 1, 0}};
                for (auto &c : cs) softmax_case(dt, c.o, c.k, c.in, lg, c.off);
                for (int64_t k : {5, 700, 1500}) softmax_special(dt, k, lg);
            }
    if (part < 0 || part == 1)
        for (nb_dtype dt : ALL_DT)
            for (nb_dtype tdt : {NB_I32, NB_I64}) {
                ce_case(dt, tdt, 19, 10, -100, 0, 1);
                ce_case(dt, tdt, 19, 10, 2, 0.1, 2);
                ce_case(dt, tdt, 2, 1500, -100, 0.2, 1);
                ce_case(dt, tdt, 9, 33, -1, 0, 1);
                ce_case(dt, tdt, 9, 33, -100, 0, 1, true);
                ce_case(dt, tdt, 1, 10, 0, 0, 1); /* maybe everything ignored? first row ignored always */
                if (nb_dtype_size(dt) == 2) {
                    ce_case(dt, tdt, 19, 10, 2, 0.1, 2, false, true);
                    ce_case(dt, tdt, 2, 1500, -100, 0.2, 1, false, true);
                }
            }
    return done("softmax");
}
