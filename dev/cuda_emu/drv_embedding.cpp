/* Driver: the CUDA embedding backward (tensor/cuda/embedding.cu: keys,
 * CUB's radix sort through include/cub's stand-in, the row kernel that
 * writes every row of gw once) against the CPU's (tensor/cpu), bit for bit
 * (the same additions in the same order; bf16 and f16 against the CPU's
 * f32 sums rounded once, as CUDA accumulates them in f32). Cases: one row
 * hit by every position, rows no position hits (they must come out 0:
 * gw starts as NaN bytes), i32 and i64 indices, C not a multiple of the
 * 32-column tile, and positions out of range (skipped on CUDA, where the
 * forward reports them; the reference leaves them out). */
#include "check.h"
extern "C" {
#include "tensor/cpu/cpu.h"
}

static void run(nb_dtype dt, nb_dtype it, int64_t v, int64_t c, int64_t np, int bad) {
    std::string nm = fmt("embedding backward %s, %s indices, V %lld, C %lld, %lld positions%s", dtn(dt), dtn(it),
                         (long long)v, (long long)c, (long long)np, bad ? ", some out of range" : "");
    nb_tensor *g = mk(dt, {np, c}), *idx = mk(it, {np}), *gw = mk(dt, {v, c});
    fill(g, -1, 1);
    std::vector<double> iv(np), keep;
    for (int64_t p = 0; p < np; p++) {
        iv[p] = v == 1 ? 0 : (double)(int64_t)urand(0, (double)v / 3); /* duplicates, rows left out */
        if (bad && p % 5 == 2) iv[p] = p % 2 ? -1 : (double)v;
        if (iv[p] >= 0 && iv[p] < v) keep.push_back((double)p);
    }
    put(idx, iv);
    nb__cuda_embedding_backward(gw, g, idx, np);
    /* the reference: the in-range positions only, in f32 for 16-bit
     * gradients (the CPU's kernel takes f32 and f64; CUDA accumulates
     * 16-bit ones in f32, in the same order, and rounds once) */
    int64_t nk = (int64_t)keep.size();
    nb_dtype rdt = dt == NB_F64 ? NB_F64 : NB_F32;
    nb_tensor *rg = mk(rdt, {nk > 0 ? nk : 1, c}), *ridx = mk(NB_I64, {nk > 0 ? nk : 1}), *rw = mk(rdt, {v, c});
    std::vector<double> gv = get(g), rgv((size_t)(nk * c)), riv(nk);
    for (int64_t k = 0; k < nk; k++) {
        int64_t p = (int64_t)keep[k];
        riv[k] = iv[p];
        for (int64_t j = 0; j < c; j++) rgv[k * c + j] = gv[p * c + j];
    }
    put(rg, rgv);
    put(ridx, riv);
    nb__cpu_embedding_backward(rw, rg, ridx, nk);
    cmpt(nm, gw, dt == rdt ? rw : as(rw, dt), 0);
}

int main() {
    init();
    for (nb_dtype dt : ALL_DT) {
        run(dt, NB_I64, 50, 40, 37, 0);
        run(dt, NB_I32, 1, 33, 20, 0);
    }
    run(NB_F32, NB_I64, 300, 96, 64, 0);  /* three column tiles, most rows not hit */
    run(NB_F32, NB_I32, 70, 8, 200, 1);   /* out of range: -1 and V */
    run(NB_F32, NB_I64, 1000, 5, 3, 0);   /* nearly every row zero */
    run(NB_BF16, NB_I64, 40, 64, 128, 1);
    return done("embedding");
}
