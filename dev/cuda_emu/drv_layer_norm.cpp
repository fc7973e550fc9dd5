/* Layer norm kernels (tensor/cuda/layer_norm.cu) against the CPU library's
 * layer norm in f64 (tensor/cpu/norm.c). */
#include "check.h"
extern "C" {
#include "tensor/cpu/norm.h"
}

/* x (m, d) of dtype dt with statistics of dtype sdt, weight and bias
 * (and their gradients) of dtype pdt (dt, or f32 for a bf16/f16 x: Note
 * [Compute dtype] in tensor/context.c); w, b, dx, dw, db each present or
 * not as the flags say. */
static void ln(nb_dtype dt, nb_dtype sdt, nb_dtype pdt, int64_t m, int64_t d, int off, bool w_on,
               bool b_on, bool dx_on, bool dw_on, bool db_on) {
    std::string nm = fmt("layer_norm %s stats %s params %s (%lld,%lld) off %d w%d b%d dx%d dw%d db%d",
                         dtn(dt), dtn(sdt), dtn(pdt), (long long)m, (long long)d, off, w_on, b_on,
                         dx_on, dw_on, db_on);
    nb_tensor *x = mk(dt, {m, d}, off), *w = mk(pdt, {d}), *b = mk(pdt, {d});
    fill(x, -2, 3), fill(w, 0.5, 1.5), fill(b, -1, 1);
    nb_tensor *y = mk(dt, {m, d}, off), *mean = mk(sdt, {m}), *rstd = mk(sdt, {m});
    nb__cuda_layer_norm(y, mean, rstd, x, w_on ? w : nullptr, b_on ? b : nullptr, m, d, 1e-5);
    nb_tensor *x64 = as(x, NB_F64), *w64 = as(w, NB_F64), *b64 = as(b, NB_F64);
    nb_tensor *y64 = mk(NB_F64, {m, d}), *mean64 = mk(NB_F64, {m}), *rstd64 = mk(NB_F64, {m});
    nb__cpu_layer_norm(y64, mean64, rstd64, x64, w_on ? w64 : nullptr, b_on ? b64 : nullptr, m, d, 1e-5);
    double tol = std::max(tol_of(dt), tol_of(sdt));
    cmpt(nm + " y", y, y64, tol * 4);
    cmpt(nm + " mean", mean, mean64, tol);
    cmpt(nm + " rstd", rstd, rstd64, tol);

    /* backward from the reference statistics rounded to sdt, on both sides */
    nb_tensor *ms = as(mean64, sdt), *rs = as(rstd64, sdt), *g = mk(dt, {m, d}, off);
    fill(g, -1, 1);
    nb_tensor *dx = mk(dt, {m, d}, off), *dw = mk(pdt, {d}), *db = mk(pdt, {d});
    nb__cuda_layer_norm_backward_rows(dx_on ? dx : nullptr, dw_on ? dw : nullptr, db_on ? db : nullptr, g, x, ms, rs,
                                 w_on ? w : nullptr, m, d);
    nb_tensor *dx64 = mk(NB_F64, {m, d}), *dw64 = mk(NB_F64, {d}), *db64 = mk(NB_F64, {d});
    std::vector<double> ws(2 * d);
    nb__cpu_layer_norm_backward_ws(dx64, dw64, db64, ws.data(), as(g, NB_F64), x64, as(ms, NB_F64), as(rs, NB_F64),
                                w_on ? w64 : nullptr, m, d);
    /* dw, db add m terms of size ~1: absolute error grows like sqrt(m) */
    if (dx_on) cmpt(nm + " dx", dx, dx64, tol * 8);
    if (dw_on) cmpv(nm + " dw", get(dw), get(dw64), tol * 4, sqrt((double)m));
    if (db_on) cmpv(nm + " db", get(db), get(db64), tol * 4, sqrt((double)m));
}

int main() {
    init();
    struct { nb_dtype dt, sdt, pdt; } dts[] = {{NB_F32, NB_F32, NB_F32},   {NB_F64, NB_F64, NB_F64},
                                               {NB_BF16, NB_F32, NB_BF16}, {NB_F16, NB_F32, NB_F16},
                                               {NB_F64, NB_F32, NB_F64},   {NB_BF16, NB_F32, NB_F32},
                                               {NB_F16, NB_F32, NB_F32}};
    /* register path (16-byte or element accesses), several rows per block,
     * wider groups, and rows long enough for the general path */
    struct { int64_t m, d; int off; } cs[] = {{5, 768, 0}, {3, 1600, 0}, {6, 770, 0}, {6, 1027, 0}, {7, 768, 1}, {9, 40, 0},
                                              {5, 1, 0}, {4, 7, 0}, {64, 96, 0}, {2, 9000, 0}, {1, 17000, 0}};
    for (auto &t : dts) {
        for (auto &c : cs) ln(t.dt, t.sdt, t.pdt, c.m, c.d, c.off, true, true, true, true, true);
        ln(t.dt, t.sdt, t.pdt, 33, 768, 0, false, false, true, false, false);
        ln(t.dt, t.sdt, t.pdt, 33, 1024, 0, true, true, false, true, true);
        ln(t.dt, t.sdt, t.pdt, 33, 768, 1, true, true, true, false, true);
        ln(t.dt, t.sdt, t.pdt, 33, 100, 0, true, false, true, true, false);
    }
    return done("layer_norm");
}
