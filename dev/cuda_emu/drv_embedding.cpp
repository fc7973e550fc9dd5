/* Driver: the CUDA embedding backward and the GPT's input (token plus
 * position rows) and its backward (tensor/cuda/embedding.cu: keys, CUB's
 * radix sort through include/cub's stand-in, the row kernel; the position
 * kernels) against the CPU's kernels (tensor/cpu/embedding.c) in the same
 * dtypes, bit for bit (the same additions in the same order, in f32 for
 * 16-bit data, rounded once), and against plain f64 loops within a few
 * units in the last place. Backward cases: writing (rows no position hits
 * must come out 0: gw starts as NaN bytes) and accumulating into a
 * gradient that already holds values (rows no position hits must keep
 * theirs), gradients of the table's dtype and bf16/f16 into an f32 table,
 * one row hit by every position, repeated indices, i32 and i64 indices, C
 * not a multiple of the 32-column tile, positions out of range (skipped on
 * CUDA, where the forward reports them; the references leave them out).
 * The position gradient: written (rows past T come out 0) and accumulated
 * (they keep their values). */
#include "check.h"
extern "C" {
#include "tensor/cpu/cpu.h"
}

static std::vector<double> indices(int64_t v, int64_t np, int bad) {
    std::vector<double> iv(np);
    for (int64_t p = 0; p < np; p++) {
        iv[p] = v == 1 ? 0 : (double)(int64_t)urand(0, (double)v / 3); /* duplicates, rows left out */
        if (bad && p % 5 == 2) iv[p] = p % 2 ? -1 : (double)v;
    }
    return iv;
}

static void backward(nb_dtype dt, nb_dtype gdt, nb_dtype it, int64_t v, int64_t c, int64_t np,
                     int bad, bool acc) {
    std::string nm = fmt("embedding backward %s into %s%s, %s indices, V %lld, C %lld, %lld positions%s",
                         dtn(gdt), dtn(dt), acc ? " (accumulating)" : "", dtn(it), (long long)v,
                         (long long)c, (long long)np, bad ? ", some out of range" : "");
    nb_tensor *g = mk(gdt, {np, c}), *idx = mk(it, {np}), *gw = mk(dt, {v, c});
    fill(g, -1, 1);
    if (acc) fill(gw, -2, 2);
    std::vector<double> iv = indices(v, np, bad), before = get(gw), gv = get(g);
    put(idx, iv);
    nb__cuda_embedding_backward(gw, g, idx, np, acc);

    /* the CPU's kernel, in the same dtypes, on the in-range positions only */
    std::vector<double> kiv, kgv;
    for (int64_t p = 0; p < np; p++)
        if (iv[p] >= 0 && iv[p] < v) {
            kiv.push_back(iv[p]);
            kgv.insert(kgv.end(), gv.begin() + p * c, gv.begin() + (p + 1) * c);
        }
    int64_t nk = (int64_t)kiv.size();
    nb_tensor *rg = mk(gdt, {nk > 0 ? nk : 1, c}), *ridx = mk(NB_I64, {nk > 0 ? nk : 1}), *rw = mk(dt, {v, c});
    put(rg, kgv);
    put(ridx, kiv);
    if (acc) put(rw, before);
    nb__cpu_embedding_backward(rw, rg, ridx, nk, acc);
    cmpt(nm + ", CPU kernel", gw, rw, 0);

    /* plain f64 loops */
    std::vector<double> ref((size_t)(v * c), 0.0);
    for (int64_t k = 0; k < nk; k++)
        for (int64_t j = 0; j < c; j++) ref[(size_t)((int64_t)kiv[k] * c + j)] += kgv[(size_t)(k * c + j)];
    if (acc)
        for (size_t e = 0; e < ref.size(); e++) ref[e] += before[e];
    cmpv(nm + ", f64", get(gw), ref, tol_of(dt == NB_F64 ? dt : gdt == NB_F64 ? NB_F64 : dt), 4);
}

static void pos_forward(nb_dtype wdt, nb_dtype odt, nb_dtype it, int64_t v, int64_t c, int64_t n,
                        int64_t t, int64_t rows) {
    std::string nm = fmt("token + position %s -> %s, %s indices, V %lld, C %lld, (%lld, %lld), %lld positions",
                         dtn(wdt), dtn(odt), dtn(it), (long long)v, (long long)c, (long long)n,
                         (long long)t, (long long)rows);
    nb_tensor *te = mk(wdt, {v, c}), *pe = mk(wdt, {rows, c}, 1), *idx = mk(it, {n, t});
    nb_tensor *out = mk(odt, {n, t, c}), *ref = mk(odt, {n, t, c});
    fill(te, -1, 1);
    fill(pe, -1, 1);
    std::vector<double> iv = indices(v, n * t, 0);
    put(idx, iv);
    nb__cuda_embedding_pos(out, te, pe, idx);
    nb__cpu_embedding_pos(ref, te, pe, idx);
    cmpt(nm + ", CPU kernel", out, ref, 0);
    std::vector<double> tv = get(te), pv = get(pe), r((size_t)(n * t * c));
    for (int64_t p = 0; p < n * t; p++)
        for (int64_t j = 0; j < c; j++)
            r[(size_t)(p * c + j)] = tv[(size_t)((int64_t)iv[p] * c + j)] + pv[(size_t)((p % t) * c + j)];
    cmpv(nm + ", f64", get(out), r, tol_of(odt));
}

static void pos_backward(nb_dtype dt, nb_dtype gdt, int64_t c, int64_t n, int64_t t, int64_t rows,
                         bool acc) {
    std::string nm = fmt("position gradient %s into %s%s, C %lld, (%lld, %lld), %lld rows", dtn(gdt),
                         dtn(dt), acc ? " (accumulating)" : "", (long long)c, (long long)n,
                         (long long)t, (long long)rows);
    nb_tensor *g = mk(gdt, {n, t, c}), *gp = mk(dt, {rows, c}), *rp = mk(dt, {rows, c});
    fill(g, -1, 1);
    if (acc) fill(gp, -2, 2);
    std::vector<double> before = get(gp), gv = get(g);
    put(rp, before);
    nb__cuda_embedding_pos_backward(gp, g, acc);
    nb__cpu_embedding_pos_backward(rp, g, acc);
    cmpt(nm + ", CPU kernel", gp, rp, 0);
    std::vector<double> r((size_t)(rows * c), 0.0);
    for (int64_t s = 0; s < n; s++)
        for (int64_t e = 0; e < t * c; e++) r[(size_t)e] += gv[(size_t)(s * t * c + e)];
    if (acc)
        for (size_t e = 0; e < r.size(); e++) r[e] += before[e];
    cmpv(nm + ", f64", get(gp), r, tol_of(dt == NB_F64 ? dt : gdt == NB_F64 ? NB_F64 : dt), 4);
}

int main() {
    init();
    for (bool acc : {false, true}) {
        for (nb_dtype dt : ALL_DT) {
            backward(dt, dt, NB_I64, 50, 40, 37, 0, acc);
            backward(dt, dt, NB_I32, 1, 33, 20, 0, acc);
        }
        backward(NB_F32, NB_BF16, NB_I64, 300, 96, 64, 0, acc); /* the GPT's: bf16 into f32 */
        backward(NB_F32, NB_F16, NB_I32, 70, 40, 200, 1, acc);
        backward(NB_F32, NB_F32, NB_I64, 300, 96, 64, 0, acc);  /* three column tiles, most rows not hit */
        backward(NB_F32, NB_F32, NB_I32, 70, 8, 200, 1, acc);   /* out of range: -1 and V */
        backward(NB_F32, NB_F32, NB_I64, 1000, 5, 3, 0, acc);   /* nearly every row untouched */
        backward(NB_BF16, NB_BF16, NB_I64, 40, 64, 128, 1, acc);
        backward(NB_F32, NB_F32, NB_I64, 20, 7, 0, 0, acc);     /* no positions */
    }
    for (nb_dtype dt : ALL_DT) pos_forward(dt, dt, NB_I64, 30, 37, 2, 9, 12);
    pos_forward(NB_F32, NB_BF16, NB_I64, 50, 40, 3, 11, 11); /* the GPT's under bf16 */
    pos_forward(NB_F32, NB_F16, NB_I32, 50, 33, 1, 5, 16);
    for (bool acc : {false, true}) {
        for (nb_dtype dt : ALL_DT) pos_backward(dt, dt, 37, 2, 9, 12, acc);
        pos_backward(NB_F32, NB_BF16, 40, 3, 11, 11, acc);
        pos_backward(NB_F32, NB_F16, 33, 4, 5, 16, acc);
    }
    return done("embedding");
}
