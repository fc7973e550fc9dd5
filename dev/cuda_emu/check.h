/* What the drivers share (dev/cuda_emu): tensors on the CPU, random
 * fills, and comparisons that count checks and failures. */
#pragma once
#include <algorithm>
#include <random>
#include <string>

#include "emu.h"
#include "tensor/cuda/cuda.h"
#include "tensor/internal.h"

extern long emu_launches, emu_blocks;
static nb_ctx *CTX;
static std::mt19937_64 RNG(1);
static int CHECKS, FAILS;

static double urand(double lo, double hi) {
    return lo + (hi - lo) * std::uniform_real_distribution<double>(0, 1)(RNG);
}
template <class... A> static std::string fmt(const char *f, A... a) {
    char b[256];
    snprintf(b, sizeof b, f, a...);
    return b;
}
static const char *dtn(nb_dtype d) { return nb_dtype_name(d); }

/* A contiguous tensor whose data starts `off` elements past an aligned
 * start (to reach the kernels' unaligned paths), filled with 0xff bytes
 * (NaN) so that an element the kernel forgets shows. */
static nb_tensor *mk(nb_dtype dt, std::vector<int64_t> shape, int off = 0) {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    int64_t len[1] = {n + off + 8};
    nb_tensor *b = nb__empty(CTX, dt, 1, len);
    memset(b->data, 0xff, (size_t)len[0] * nb_dtype_size(dt));
    int64_t st[NB_MAX_DIMS];
    nb__contig_strides((int)shape.size(), shape.data(), st);
    return nb__view(CTX, b, (int)shape.size(), shape.data(), st, (char *)b->data + off * nb_dtype_size(dt));
}
static std::vector<double> get(const nb_tensor *t) {
    std::vector<double> v(nb_numel(t));
    for (size_t i = 0; i < v.size(); i++) v[i] = nb__load((char *)t->data + i * nb_dtype_size(t->dtype), t->dtype);
    return v;
}
static void put(nb_tensor *t, const std::vector<double> &v) {
    for (size_t i = 0; i < v.size(); i++) nb__store((char *)t->data + i * nb_dtype_size(t->dtype), t->dtype, v[i]);
}
static void fill(nb_tensor *t, double lo, double hi) {
    std::vector<double> v(nb_numel(t));
    for (auto &x : v) x = urand(lo, hi);
    put(t, v);
}
/* A copy of t in dtype dt (values converted). */
static nb_tensor *as(const nb_tensor *t, nb_dtype dt) {
    nb_tensor *r = mk(dt, std::vector<int64_t>(t->shape, t->shape + t->ndim));
    put(r, get(t));
    return r;
}

/* One check: |g - r| <= tol (scale + |r|) for every element; NaN must meet
 * NaN and an infinity the same infinity. */
static bool cmpv(const std::string &what, const std::vector<double> &g, const std::vector<double> &r, double tol,
                 double scale = 1) {
    CHECKS++;
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < r.size(); i++) {
        double e;
        if (std::isnan(r[i]) || std::isnan(g[i])) e = std::isnan(r[i]) && std::isnan(g[i]) ? 0 : INFINITY;
        else if (std::isinf(r[i]) || std::isinf(g[i])) e = r[i] == g[i] ? 0 : INFINITY;
        else if (tol == 0) e = g[i] == r[i] ? 0 : INFINITY;
        else e = fabs(g[i] - r[i]) / (tol * (scale + fabs(r[i])));
        if (e > worst) worst = e, at = i;
    }
    if (worst <= 1) return true;
    FAILS++;
    printf("FAIL %s: element %zu is %.9g, want %.9g (error/tolerance %.3g)\n", what.c_str(), at, g[at], r[at], worst);
    return false;
}
static bool cmpt(const std::string &what, const nb_tensor *g, const nb_tensor *r, double tol) {
    return cmpv(what, get(g), get(r), tol);
}
/* A few units in the last place of the kernels' compute type. */
static double tol_of(nb_dtype dt) {
    return dt == NB_F64 ? 1e-12 : dt == NB_F32 ? 2e-6 : dt == NB_BF16 ? 1.6e-2 : 2e-3;
}
static const nb_dtype ALL_DT[] = {NB_F32, NB_F64, NB_BF16, NB_F16};

static void init() { CTX = nb_ctx_new(nb_cpu(), 0); }
/* Prints the summary; the exit status: 1 on any failure. */
static int done(const char *name) {
    printf("%s: %d checks, %d failures (%ld launches, %ld blocks)\n", name, CHECKS, FAILS, emu_launches, emu_blocks);
    return FAILS != 0;
}
