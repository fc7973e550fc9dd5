#include "check.h"
extern "C" {
#include "tensor/cpu/cpu.h" /* the CPU kernels compared against */
}
/* Every row of the unary and binary tables (tensor/op_table.h) through
 * elementwise.cu's three paths (vectorised, flat, strided), against the CPU
 * kernels in f64; where and fills (by_dtype_bits), casts, axpy. */
static const nb_dtype INT_DT[] = {NB_I32, NB_I64};

/* The op on the CPU in f64 from x's own (already rounded) values (as() and
 * get() read storage in order, so x is made contiguous first). */
static std::vector<double> ref_unary(nb__unary_op op, const nb_tensor *x, double s) {
    nb_tensor *x64 = as(nb_contiguous(CTX, (nb_tensor *)x), NB_F64);
    nb_tensor *r = mk(NB_F64, std::vector<int64_t>(x->shape, x->shape + x->ndim));
    nb__cpu_unary(op, r, x64, s);
    return get(r);
}

/* layout 0: contiguous at an aligned start (vectorised path); 1: one element
 * past it (flat path); 2: a transposed view (strided path). */
static void unary(nb__unary_op op, nb_dtype dt, int layout) {
    const bool positive = op == NB_U_LOG || op == NB_U_SQRT || op == NB_U_RSQRT || op == NB_U_POW;
    const double s = op == NB_U_POW ? 1.5 : op == NB_U_ADD_S ? -0.75 : op == NB_U_MUL_S ? 1.25 : 0;
    std::string nm = fmt("%s %s layout %d", nb__unary_name(op), dtn(dt), layout);
    nb_tensor *x = mk(dt, {37, 41}, layout == 1); /* 6 blocks: MAX_BLOCKS=2 loops round */
    fill(x, positive ? 0.2 : -3, 3);
    if (layout == 2) x = nb_transpose(CTX, x, 0, 1);
    nb_tensor *out = mk(dt, std::vector<int64_t>(x->shape, x->shape + x->ndim), layout == 1);
    nb__cuda_unary(op, out, x, s);
    cmpv(nm, get(out), ref_unary(op, x, s), tol_of(dt) * 4, 1);
}

static void binary(nb__binary_op op, nb_dtype dt, int layout) {
    std::string nm = fmt("%s %s layout %d", nb__binary_name(op), dtn(dt), layout);
    bool ints = dt == NB_I32 || dt == NB_I64;
    nb_tensor *a, *b;
    if (layout < 2) {
        a = mk(dt, {7, 19}, layout), b = mk(dt, {7, 19}, layout);
    } else { /* (7, 19) transposed with (19, 1) broadcast */
        a = nb_transpose(CTX, mk(dt, {19, 7}), 0, 1);
        b = mk(dt, {7, 1});
    }
    fill(a, ints ? -50 : -3, ints ? 50 : 3);
    fill(b, ints ? 1 : 0.5, ints ? 9 : 3);
    if (ints) { /* integer values */
        auto av = get(a), bv = get(b);
        for (auto &v : av) v = trunc(v);
        for (auto &v : bv) v = trunc(v);
        put(a, av), put(b, bv);
    }
    nb_tensor *out = mk(dt, {7, 19}, layout == 1);
    nb__cuda_binary(op, out, a, b);
    nb_dtype rdt = ints ? dt : NB_F64;
    nb_tensor *r = mk(rdt, {7, 19});
    nb__cpu_binary(op, r, ints ? a : as(nb_contiguous(CTX, a), NB_F64), ints ? b : as(b, NB_F64));
    cmpv(nm, get(out), get(r), ints ? 0 : tol_of(dt), 1);
}

static void where_fill(nb_dtype dt) {
    std::string nm = fmt("where %s", dtn(dt));
    nb_tensor *c = mk(NB_I32, {5, 1}), *a = mk(dt, {5, 9}), *b = mk(dt, {9});
    put(c, {0, 1, 0, 3, -2});
    fill(a, -2, 2), fill(b, -2, 2);
    nb_tensor *out = mk(dt, {5, 9});
    nb__cuda_where(out, c, a, b);
    std::vector<double> e(45), av = get(a), bv = get(b), cv = get(c);
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 9; j++) e[i * 9 + j] = cv[i] != 0 ? av[i * 9 + j] : bv[j];
    cmpv(nm, get(out), e, 0);
    nb_tensor *v = mk(NB_F64, {1}), *f = mk(dt, {4, 3}, 1);
    put(v, {-1.25});
    nb__cuda_copy(f, v); /* a CPU source of one value: a fill */
    double e1 = dt == NB_I32 || dt == NB_I64 ? -1 : -1.25; /* a truncating cast */
    cmpv(fmt("fill %s", dtn(dt)), get(f), std::vector<double>(12, e1), 0);
}

static void cast_axpy(nb_dtype dd, nb_dtype sd) {
    std::string nm = fmt("copy %s -> %s", dtn(sd), dtn(dd));
    nb_tensor *src = mk(sd, {6, 5}), *dst = mk(dd, {5, 6});
    fill(src, -40, 40);
    nb_tensor *srct = nb_transpose(CTX, src, 0, 1);
    srct->device.type = NB_DEVICE_CUDA; /* a device source: a kernel, not a fill */
    nb__cuda_copy(dst, srct);
    srct->device.type = NB_DEVICE_CPU;
    nb_tensor *r = mk(dd, {5, 6});
    nb__cpu_copy(r, srct);
    cmpv(nm, get(dst), get(r), 0);
    if (dd == sd && dd != NB_I32 && dd != NB_I64) {
        nb_tensor *y = mk(dd, {37}), *x = mk(dd, {37});
        fill(y, -1, 1), fill(x, -1, 1);
        std::vector<double> e(37), yv = get(y), xv = get(x);
        for (int i = 0; i < 37; i++) e[i] = yv[i] - 0.5 * xv[i];
        nb__cuda_axpy(y, -0.5, x);
        cmpv(fmt("axpy %s", dtn(dd)), get(y), e, tol_of(dd), 1);
    }
}

int main() {
    init();
    for (int op = 0; op < NB_U_COUNT; op++)
        for (nb_dtype dt : ALL_DT)
            for (int layout = 0; layout < 3; layout++) unary((nb__unary_op)op, dt, layout);
    for (int op = 0; op < NB_B_COUNT; op++) {
        for (nb_dtype dt : ALL_DT)
            for (int layout = 0; layout < 3; layout++) binary((nb__binary_op)op, dt, layout);
        for (nb_dtype dt : INT_DT)
            for (int layout = 0; layout < 3; layout++) binary((nb__binary_op)op, dt, layout);
    }
    for (nb_dtype dt : ALL_DT) where_fill(dt);
    for (nb_dtype dt : INT_DT) where_fill(dt);
    const nb_dtype every[] = {NB_F32, NB_F64, NB_BF16, NB_F16, NB_I32, NB_I64};
    for (nb_dtype dd : every)
        for (nb_dtype sd : every) cast_axpy(dd, sd);
    return done("elementwise");
}
