/* Layer norm kernels (tensor/cuda/layer_norm.cu) against the CPU library's
 * layer norm in f64 (tensor/cpu/norm.c); the backward's outputs written,
 * and added into (NB__LN_ADD_*): against the f64 sums, and bit for bit
 * against the written outputs added separately (the rounding the backend
 * interface states, tensor/backend.h). */
#include "check.h"
extern "C" {
#include "tensor/cpu/norm.h"
}

/* old + c in t's dtype's arithmetic (f32 for the 16-bit ones), rounded
 * to it: a separate add of a written output. */
static std::vector<double> added(nb_dtype dt, const std::vector<double> &old, const std::vector<double> &c) {
    std::vector<double> r(old.size());
    for (size_t i = 0; i < r.size(); i++) {
        double v = dt == NB_F64 ? old[i] + c[i] : (double)((float)old[i] + (float)c[i]);
        char b[8];
        nb__store(b, dt, v);
        r[i] = nb__load(b, dt);
    }
    return r;
}

/* The backward with the outputs present (dx, dw, db: as the plain call
 * wrote them) added into where add (NB__LN_ADD_*, bit k for output k)
 * says, from random starting values, the rest written: each against the
 * written output, added separately where added, bit for bit, and against
 * the f64 reference (plus the starting values). */
static void ln_add(const std::string &nm, unsigned add, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                   nb_tensor *dx64, nb_tensor *dw64, nb_tensor *db64, const nb_tensor *g,
                   const nb_tensor *x, const nb_tensor *ms, const nb_tensor *rs, const nb_tensor *w,
                   int64_t m, int64_t d, int off, double tol) {
    nb_tensor *out[3] = {dx, dw, db}, *ref[3] = {dx64, dw64, db64}, *acc[3] = {nullptr, nullptr, nullptr};
    std::vector<double> old[3];
    for (int k = 0; k < 3; k++) {
        if (!out[k]) continue;
        acc[k] = mk(out[k]->dtype, std::vector<int64_t>(out[k]->shape, out[k]->shape + out[k]->ndim), k ? 0 : off);
        if (add & (1u << k)) fill(acc[k], -1, 1);
        old[k] = add & (1u << k) ? get(acc[k]) : std::vector<double>(nb_numel(acc[k]), 0.0);
    }
    nb__cuda_layer_norm_backward_rows(acc[0], acc[1], acc[2], g, x, ms, rs, w, m, d, add);
    const char *names[3] = {" dx", " dw", " db"};
    for (int k = 0; k < 3; k++) {
        if (!out[k]) continue;
        std::string what = nm + fmt(" add %u", add) + names[k];
        cmpv(what + " bits", get(acc[k]),
             add & (1u << k) ? added(out[k]->dtype, old[k], get(out[k])) : get(out[k]), 0);
        std::vector<double> want = get(ref[k]);
        for (size_t i = 0; i < want.size(); i++) want[i] += old[k][i];
        cmpv(what, get(acc[k]), want, k ? tol * 4 : tol * 8, k ? sqrt((double)m) : 1);
    }
}

/* x (m, d) of dtype dt with statistics of dtype sdt, weight and bias
 * (and their gradients) of dtype pdt (dt, or f32 for a bf16/f16 x: Note
 * [Compute dtype] in tensor/context.c); w, b, dx, dw, db each present or
 * not as the flags say. */
static void ln(nb_dtype dt, nb_dtype sdt, nb_dtype pdt, int64_t m, int64_t d, int off, bool w_on,
               bool b_on, bool dx_on, bool dw_on, bool db_on, bool adds) {
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
                                 w_on ? w : nullptr, m, d, 0);
    nb_tensor *dx64 = mk(NB_F64, {m, d}), *dw64 = mk(NB_F64, {d}), *db64 = mk(NB_F64, {d});
    std::vector<double> ws(2 * d);
    nb__cpu_layer_norm_backward_ws(dx64, dw64, db64, ws.data(), as(g, NB_F64), x64, as(ms, NB_F64), as(rs, NB_F64),
                                w_on ? w64 : nullptr, m, d, 0);
    /* dw, db add m terms of size ~1: absolute error grows like sqrt(m) */
    if (dx_on) cmpt(nm + " dx", dx, dx64, tol * 8);
    if (dw_on) cmpv(nm + " dw", get(dw), get(dw64), tol * 4, sqrt((double)m));
    if (db_on) cmpv(nm + " db", get(db), get(db64), tol * 4, sqrt((double)m));
    /* added into (adds; f32 and bf16 x): every output present, then each
     * one with the others written */
    if (!adds || (dt != NB_F32 && dt != NB_BF16)) return;
    nb_tensor *o[3] = {dx_on ? dx : nullptr, dw_on ? dw : nullptr, db_on ? db : nullptr};
    const nb_tensor *wp = w_on ? w : nullptr;
    ln_add(nm, NB__LN_ADD_DX | NB__LN_ADD_DW | NB__LN_ADD_DB, o[0], o[1], o[2], dx64, dw64, db64, g, x,
           ms, rs, wp, m, d, off, tol);
    for (int k = 0; k < 3; k++) /* one added into, the others written */
        if (o[k]) ln_add(nm, 1u << k, o[0], o[1], o[2], dx64, dw64, db64, g, x, ms, rs, wp, m, d, off, tol);
}

/* `drv_layer_norm add`: the cases that add into the outputs only. */
int main(int argc, char **argv) {
    bool only_adds = argc > 1 && !strcmp(argv[1], "add");
    init();
    struct { nb_dtype dt, sdt, pdt; } dts[] = {{NB_F32, NB_F32, NB_F32},   {NB_F64, NB_F64, NB_F64},
                                               {NB_BF16, NB_F32, NB_BF16}, {NB_F16, NB_F32, NB_F16},
                                               {NB_F64, NB_F32, NB_F64},   {NB_BF16, NB_F32, NB_F32},
                                               {NB_F16, NB_F32, NB_F32}};
    /* register path (16-byte or element accesses), several rows per block,
     * wider groups, and rows long enough for the general path */
    /* add: the adding modes too (16-byte and element accesses, an
     * unaligned start, several rows per block, the general path) */
    struct { int64_t m, d; int off; bool add; } cs[] = {
        {5, 768, 0, true}, {3, 1600, 0, false}, {6, 770, 0, true},  {6, 1027, 0, false},
        {7, 768, 1, true}, {9, 40, 0, false},   {5, 1, 0, false},   {4, 7, 0, false},
        {64, 96, 0, true}, {2, 9000, 0, true},  {1, 17000, 0, false}};
    for (auto &t : dts) {
        if (only_adds && t.dt != NB_F32 && t.dt != NB_BF16) continue;
        for (auto &c : cs)
            if (!only_adds || c.add) ln(t.dt, t.sdt, t.pdt, c.m, c.d, c.off, true, true, true, true, true, c.add);
        if (only_adds) continue;
        ln(t.dt, t.sdt, t.pdt, 33, 768, 0, false, false, true, false, false, false);
        ln(t.dt, t.sdt, t.pdt, 33, 1024, 0, true, true, false, true, true, false);
        ln(t.dt, t.sdt, t.pdt, 33, 768, 1, true, true, true, false, true, true);
        ln(t.dt, t.sdt, t.pdt, 33, 100, 0, true, false, true, true, false, false);
    }
    return done("layer_norm");
}
