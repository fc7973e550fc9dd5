#include "check.h"
#include "nabla/random.h"
extern "C" nb_tensor *nb_dropout(nb_ctx *ctx, nb_tensor *x, double p, bool training, nb_rng *rng);
static bool bits_eq(const std::string &nm, const nb_tensor *a, const nb_tensor *b) {
    CHECKS++;
    size_t sz = nb_dtype_size(a->dtype) * nb_numel(a);
    if (memcmp(a->data, b->data, sz)) {
        for (int64_t i = 0; i < nb_numel(a); i++)
            if (memcmp((char *)a->data + i * nb_dtype_size(a->dtype), (char *)b->data + i * nb_dtype_size(a->dtype), nb_dtype_size(a->dtype))) {
                printf("FAIL %s: element %lld differs: %.9g vs %.9g\n", nm.c_str(), (long long)i, get(a)[i], get(b)[i]);
                break;
            }
        FAILS++;
        return false;
    }
    return true;
}
static void drop(nb_dtype dt, int64_t n, double p, int off, uint64_t seed, uint64_t offset, bool with_mask) {
    std::string nm = fmt("dropout %s n %lld p %g off %d mask %d", dtn(dt), (long long)n, p, off, with_mask);
    nb_tensor *x = mk(dt, {n}, off), *out = mk(dt, {n}, off), *mask = with_mask ? mk(dt, {n}, off) : nullptr;
    fill(x, -2, 2);
    nb__cuda_dropout(out, mask, x, p, seed, offset);
    nb_dtype cdt = dt == NB_F64 ? NB_F64 : NB_F32;
    nb_tensor *xc = as(x, cdt);
    xc->requires_grad = true;
    nb_rng rng = {seed, offset};
    nb_tensor *ref = nb_dropout(CTX, xc, p, true, &rng);
    nb_tensor *rmask;
    if (p == 0) { rmask = mk(cdt, {n}); put(rmask, std::vector<double>(n, 1.0)); }
    else { if (!ref->node) { printf("no node\n"); abort(); } rmask = ref->node->saved[0]; }
    if (dt == cdt) {
        bits_eq(nm + " out", out, ref);
        if (with_mask) bits_eq(nm + " mask", mask, rmask);
    } else {
        bits_eq(nm + " out", out, as(ref, dt));
        if (with_mask) bits_eq(nm + " mask", mask, as(rmask, dt));
    }
}
static void fills(nb_dtype dt, int64_t n, int off, uint64_t seed, uint64_t offset) {
    std::string nm = fmt("fill %s n %lld off %d", dtn(dt), (long long)n, off);
    nb_tensor *t = mk(dt, {n}, off);
    nb__cuda_rand_uniform(t, -0.3, 1.7, seed, offset);
    nb_rng rng = {seed, offset};
    int64_t sh[1] = {n};
    nb_tensor *r = nb_rand_uniform(CTX, dt, 1, sh, -0.3, 1.7, &rng);
    bits_eq(nm + " uniform", t, r);
    nb__cuda_rand_normal(t, 0.5, 2.0, seed, offset);
    rng = {seed, offset};
    r = nb_rand_normal(CTX, dt, 1, sh, 0.5, 2.0, &rng);
    bits_eq(nm + " normal", t, r);
}
int main() {
    init();
    for (nb_dtype dt : ALL_DT)
        for (int off : {0, 1, 2, 3}) {
            for (int64_t n : {1, 3, 4, 5, 8, 13, 1000, 1027})
                for (double p : {0.0, 0.1, 0.5, 1.0}) drop(dt, n, p, off, 42 + n, 7 * n + off, (n + off) % 2 == 0);
            for (int64_t n : {1, 2, 3, 4, 5, 7, 1001, 1024}) fills(dt, n, off, 1234567890123ull + n, 3 * n);
        }
    drop(NB_F32, 70000, 0.3, 0, 5, 0xfffffffffffffff0ull, true); /* counter wraps */
    return done("dropout");
}
