#include "check.h"
extern "C" {
#include "tensor/cpu/softmax.h"
}
static void cs(nb_dtype dt, int64_t b, int64_t t, int64_t s, double scale, int off, bool infs = false) {
    std::string nm = fmt("causal %s (%lld,%lld,%lld) scale %g off %d%s", dtn(dt), (long long)b, (long long)t, (long long)s, scale, off, infs ? " inf" : "");
    nb_tensor *x = mk(dt, {b, t, s}, off), *y = mk(dt, {b, t, s}, off);
    fill(x, -5, 5);
    if (infs) { auto v = get(x); for (size_t i = 0; i < v.size(); i += 3) v[i] = -INFINITY; put(x, v); }
    /* poison the masked part: it must never be read */
    { auto v = get(x); for (int64_t r = 0; r < b * t; r++) for (int64_t j = std::min(r % t + 1, s); j < s; j++) v[r * s + j] = NAN; put(x, v); }
    nb_tensor *y64 = mk(NB_F64, {b, t, s});
    nb__cuda_softmax_causal(y, x, b, t, s, scale);
    nb__cpu_softmax_causal(y64, as(x, NB_F64), b, t, s, scale);
    cmpt(nm + " fwd", y, y64, tol_of(dt));
    nb_tensor *yy = as(y64, dt), *g = mk(dt, {b, t, s}, off), *dx = mk(dt, {b, t, s}, off), *dx64 = mk(NB_F64, {b, t, s});
    fill(g, -1, 1);
    nb__cuda_softmax_causal_backward(dx, yy, g, b, t, s, scale);
    nb__cpu_softmax_causal_backward(dx64, as(yy, NB_F64), as(g, NB_F64), b, t, s, scale);
    cmpt(nm + " bwd", dx, dx64, tol_of(dt) * 4);
}
int main() {
    init();
    for (nb_dtype dt : ALL_DT) {
        cs(dt, 2, 5, 5, 0.5, 0);
        cs(dt, 2, 7, 3, 1.0, 1);
        cs(dt, 1, 3, 40, -0.7, 0);
        cs(dt, 3, 9, 9, 0.125, 1, true);
        cs(dt, 1, 2, 1500, 0.3, 0);
        cs(dt, 1, 40, 33, 2.0, 0);
        /* rows in registers: 8, 16, 32 per lane, with -inf entries too */
        cs(dt, 1, 4, 200, 0.125, 1);
        cs(dt, 1, 3, 700, -0.5, 0, true);
        cs(dt, 1, 2, 1024, 0.3, 1);
    }
    return done("causal");
}
