/* CPU elementwise engine: unary, binary, where and copy/cast over any
 * strides, with broadcasting through zero strides.
 *
 * An iterator collapses dimensions that are contiguous for every operand,
 * so a contiguous operation becomes one flat loop; the inner loop has a
 * unit-stride branch that the compiler can vectorise. f32 math is done in
 * float, f64 math in double, with the formulas of tensor/op_table.h. */
#include <math.h>
#include <string.h>

#include "tensor/cpu/bf16.h"
#include "tensor/cpu/cpu.h"
#include "tensor/cpu/simd.h"
#include "tensor/cpu/threads.h"
#include "tensor/internal.h"

#define MAXOPS 4

typedef struct iter {
    int ndim, nops;
    int64_t shape[NB_MAX_DIMS];
    char *ptr[MAXOPS];
    int64_t st[MAXOPS][NB_MAX_DIMS]; /* bytes */
} iter;

typedef void (*inner_fn)(int64_t n, char **p, const int64_t *st, const void *arg);

/* out must have the iteration shape; inputs are broadcast to it. */
static void iter_init(iter *it, const nb_tensor *out, int nin, const nb_tensor *const *in) {
    it->ndim = out->ndim;
    it->nops = nin + 1;
    memcpy(it->shape, out->shape, sizeof it->shape);
    it->ptr[0] = out->data;
    for (int d = 0; d < out->ndim; d++) it->st[0][d] = out->strides[d] * (int64_t)nb_dtype_size(out->dtype);
    for (int k = 0; k < nin; k++) {
        int64_t st[NB_MAX_DIMS];
        nb__broadcast_strides(in[k], out->ndim, out->shape, st);
        it->ptr[k + 1] = in[k]->data;
        for (int d = 0; d < out->ndim; d++) it->st[k + 1][d] = st[d] * (int64_t)nb_dtype_size(in[k]->dtype);
    }
    /* drop size-1 dims, then merge a dim into the next when contiguous for all */
    int nd = 0;
    for (int d = 0; d < it->ndim; d++) {
        if (it->shape[d] == 1) continue;
        it->shape[nd] = it->shape[d];
        for (int k = 0; k < it->nops; k++) it->st[k][nd] = it->st[k][d];
        nd++;
    }
    if (nd == 0) {
        it->ndim = 1;
        it->shape[0] = 1;
        for (int k = 0; k < it->nops; k++) it->st[k][0] = 0;
        return;
    }
    int m = 0;
    for (int d = 1; d < nd; d++) {
        bool ok = true;
        for (int k = 0; k < it->nops; k++)
            if (it->st[k][m] != it->st[k][d] * it->shape[d]) ok = false;
        if (ok) {
            it->shape[m] *= it->shape[d];
            for (int k = 0; k < it->nops; k++) it->st[k][m] = it->st[k][d];
        } else {
            m++;
            it->shape[m] = it->shape[d];
            for (int k = 0; k < it->nops; k++) it->st[k][m] = it->st[k][d];
        }
    }
    it->ndim = m + 1;
}

/* Runs fn over the linear positions [start, end) of the iteration space
 * (row-major over it->shape), cutting at the ends of inner rows. */
static void iter_run_range(const iter *it, inner_fn fn, const void *arg, int64_t start,
                           int64_t end) {
    int last = it->ndim - 1;
    int64_t idx[NB_MAX_DIMS] = {0}, rem = start;
    for (int d = last; d >= 0 && rem; d--) {
        idx[d] = rem % it->shape[d];
        rem /= it->shape[d];
    }
    char *p[MAXOPS];
    int64_t inner_st[MAXOPS];
    for (int k = 0; k < it->nops; k++) inner_st[k] = it->st[k][last];
    for (int64_t pos = start; pos < end;) {
        int64_t len = it->shape[last] - idx[last];
        if (len > end - pos) len = end - pos;
        for (int k = 0; k < it->nops; k++) {
            char *q = it->ptr[k];
            for (int d = 0; d <= last; d++) q += idx[d] * it->st[k][d];
            p[k] = q;
        }
        fn(len, p, inner_st, arg);
        pos += len;
        idx[last] = 0;
        int d = last - 1;
        while (d >= 0 && ++idx[d] == it->shape[d]) idx[d--] = 0;
    }
}

/* Large operations run in chunks of GRAIN elements on the thread pool
 * (Note [Deterministic parallel kernels] in tensor/cpu/threads.h: each
 * element is computed by the same formula wherever it runs); below
 * 2 GRAIN elements, one call on the caller. */
#define GRAIN 16384

typedef struct iter_job {
    const iter *it;
    inner_fn fn;
    const void *arg;
    int64_t total;
} iter_job;

static void iter_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const iter_job *j = varg;
    int64_t end = (c + 1) * GRAIN < j->total ? (c + 1) * GRAIN : j->total;
    iter_run_range(j->it, j->fn, j->arg, c * GRAIN, end);
}

/* An output aliased through zero strides accumulates in visiting order
 * (nb__sum_to relies on it: ordered_elementwise in tensor/backend.h). Such
 * a job is cut along dim `split`, where the output's stride is not zero:
 * each piece owns its output elements and visits them in the order the
 * whole iteration would, so the sums are the same bits. At most one piece
 * per pool thread: a piece runs one inner loop per row of its slice, and
 * GRAIN-sized pieces of a bias gradient ((B*T, N) summed to (N)) were 16
 * columns wide (the (1024, 1024) -> (1024) sum of a backward took 1.74 ms
 * on one thread with those pieces and the scalar in-place loop, 0.66 ms
 * with one piece and BINARY_INPLACE_CASE: bench_ops, "bias gradient" row). */
typedef struct split_job {
    const iter *it;
    inner_fn fn;
    const void *arg;
    int split;
    int64_t grain;
} split_job;

static void split_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const split_job *j = varg;
    iter sub = *j->it;
    int64_t lo = c * j->grain, n = j->it->shape[j->split];
    sub.shape[j->split] = lo + j->grain < n ? j->grain : n - lo;
    for (int k = 0; k < sub.nops; k++) sub.ptr[k] += lo * sub.st[k][j->split];
    int64_t total = 1;
    for (int d = 0; d < sub.ndim; d++) total *= sub.shape[d];
    iter_run_range(&sub, j->fn, j->arg, 0, total);
}

static void iter_run_on(iter *it, inner_fn fn, const void *arg, bool parallel) {
    if (it->ndim == 1 && it->shape[0] < 2 * GRAIN) { /* small and flat: the fixed cost */
        int64_t st[MAXOPS];
        for (int k = 0; k < it->nops; k++) st[k] = it->st[k][0];
        if (it->shape[0] > 0) fn(it->shape[0], it->ptr, st, arg);
        return;
    }
    int64_t total = 1;
    for (int d = 0; d < it->ndim; d++) total *= it->shape[d];
    if (total == 0) return;
    if (!parallel || total < 2 * GRAIN) {
        iter_run_range(it, fn, arg, 0, total);
        return;
    }
    int split = -1;
    bool aliased = false;
    for (int d = 0; d < it->ndim; d++) {
        if (it->st[0][d] == 0) aliased = true;
        else if (split < 0 && it->shape[d] > 1) split = d;
    }
    if (aliased) {
        if (split < 0) {
            iter_run_range(it, fn, arg, 0, total);
            return;
        }
        int64_t n = it->shape[split], nthr = nb_get_num_threads();
        int64_t grain = nb__grain(total / n), per = (n + nthr - 1) / nthr;
        split_job j = {it, fn, arg, split, grain > per ? grain : per};
        nb__parallel_for(nb__chunk_count(it->shape[split], j.grain), split_chunk, &j);
        return;
    }
    iter_job j = {it, fn, arg, total};
    nb__parallel_for(nb__chunk_count(total, GRAIN), iter_chunk, &j);
}

static void iter_run(iter *it, inner_fn fn, const void *arg) { iter_run_on(it, fn, arg, true); }

/* ---- bf16 in blocks ----
 * Note [bf16 elementwise in blocks]
 * A bf16 output of unary, binary and GELU's gradient is computed by the
 * f32 inner loop on blocks of BLOCK elements: each bf16 input run is
 * widened into a buffer on the stack (an f32 input is read in place when
 * its run is contiguous), the f32 loop writes a second buffer, and that is
 * rounded into the output. Every element is the f32 formula on the bf16
 * values, rounded once, as with whole-tensor f32 twins (Note [bf16
 * activations on the CPU] in tensor/cpu/bf16.c), but the data stays in L1
 * and nothing is allocated. A block reads all its inputs before it writes,
 * so an output that is one of its inputs (same place, same strides: the
 * in-place add of a gradient, the residual add) gets what the twins gave;
 * any other overlap, and an output aliased through a zero stride, take the
 * twins (blocks_apply). */
#define BLOCK 512

typedef struct half_arg {
    inner_fn f32; /* the f32 inner loop, its argument and inputs */
    const void *arg;
    int nin;
    nb_dtype in[MAXOPS - 1];
} half_arg;

/* n (<= BLOCK) values of dtype dt at p, stride st bytes, as f32: a pointer
 * into p itself when they are contiguous f32, else into buf. */
static const float *widen_run(float *buf, const char *p, int64_t st, nb_dtype dt, int64_t n) {
    if (dt == NB_F32) {
        if (st == 4) return (const float *)p;
        for (int64_t i = 0; i < n; i++) buf[i] = *(const float *)(p + i * st);
        return buf;
    }
    if (st == 2) {
        nb__f32_from_bf16_n(buf, (const uint16_t *)p, n);
        return buf;
    }
    for (int64_t i = 0; i < n; i++) buf[i] = nb__f32_of_bf16(*(const uint16_t *)(p + i * st));
    return buf;
}

static void narrow_run(char *p, int64_t st, const float *v, int64_t n) {
    if (st == 2) {
        nb__bf16_from_f32_n((uint16_t *)p, v, n);
        return;
    }
    for (int64_t i = 0; i < n; i++) *(uint16_t *)(p + i * st) = nb__bf16_of_f32(v[i]);
}

/* An inner loop over a bf16 output (p[0]) and bf16 or f32 inputs. */
static void half_inner(int64_t n, char **p, const int64_t *st, const void *varg) {
    const half_arg *h = varg;
    float buf[MAXOPS][BLOCK];
    const int64_t unit[MAXOPS] = {4, 4, 4, 4};
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t len = n - lo < BLOCK ? n - lo : BLOCK;
        char *q[MAXOPS] = {(char *)buf[0]};
        for (int k = 1; k <= h->nin; k++)
            q[k] = (char *)widen_run(buf[k], p[k] + lo * st[k], st[k], h->in[k - 1], len);
        h->f32(len, q, unit, h->arg);
        narrow_run(p[0] + lo * st[0], st[0], buf[0], len);
    }
}

/* An inner loop over an f32 output (p[0]) and bf16 or f32 inputs: bf16
 * runs widened into buffers, the output and f32 inputs read and written
 * in place with their strides, so an output aliased through zero strides
 * accumulates in visiting order as on f32 inputs (nb__sum_to_f32). */
static void wide_inner(int64_t n, char **p, const int64_t *st, const void *varg) {
    const half_arg *h = varg;
    float buf[MAXOPS][BLOCK];
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t len = n - lo < BLOCK ? n - lo : BLOCK;
        char *q[MAXOPS] = {p[0] + lo * st[0]};
        int64_t qst[MAXOPS] = {st[0]};
        for (int k = 1; k <= h->nin; k++) {
            bool half = h->in[k - 1] == NB_BF16;
            q[k] = half ? (char *)widen_run(buf[k], p[k] + lo * st[k], st[k], NB_BF16, len)
                        : p[k] + lo * st[k];
            qst[k] = half ? 4 : st[k];
        }
        h->f32(len, q, qst, h->arg);
    }
}

/* whether t and u are the same elements: same place, shape and strides */
static bool same_layout(const nb_tensor *t, const nb_tensor *u) {
    if (t->data != u->data || t->ndim != u->ndim) return false;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] != u->shape[d] || (t->shape[d] > 1 && t->strides[d] != u->strides[d]))
            return false;
    return true;
}

static bool overlaps(const nb_tensor *t, const nb_tensor *u);

/* Whether the blocks give what the twins give (Note [bf16 elementwise in
 * blocks]): inputs bf16 or f32, none overlapping the output unless it is
 * the output, and no output element written twice. */
static bool blocks_apply(const nb_tensor *out, int nin, const nb_tensor *const *in) {
    for (int d = 0; d < out->ndim; d++)
        if (out->shape[d] > 1 && out->strides[d] == 0) return false;
    for (int k = 0; k < nin; k++) {
        if (in[k]->dtype != NB_BF16 && in[k]->dtype != NB_F32) return false;
        if (overlaps(out, in[k]) && !same_layout(out, in[k])) return false;
    }
    return true;
}


/* ---- unary ---- */
typedef struct unary_arg {
    nb__unary_op op;
    double s;
} unary_arg;

/* tanh through one exp: accurate to about 1e-7 absolute, which is all
 * GELU's 0.5 x (1 + t) needs, and it vectorises. */
static inline float tanh_via_exp(float u) { return 1.0f - 2.0f / (1.0f + nb__exp_f32(2.0f * u)); }

/* The f32 formulas with that tanh in GELU_TANH and its gradient: nb__f_*_f32v
 * (Note [Op tables] in tensor/op_table.h). */
NB__UNARY_FORMULAS(float, f32v, f, tanh_via_exp)

/* One case per table row; LOOP and FORMULA are defined by the caller. */
#define UNARY_CASE(E, f, name) case NB_U_##E: LOOP(FORMULA(f)(x, s)); break;

/* o[i] = EXPR of x = a[i] over n elements of type T: contiguous (unit),
 * else strided by st (bytes). */
#define UNARY_LOOP(T, EXPR)                                                                  \
    if (unit) {                                                                              \
        T *o = (T *)p[0];                                                                    \
        const T *a = (const T *)p[1];                                                        \
        for (int64_t i = 0; i < n; i++) { T x = a[i]; o[i] = (EXPR); }                       \
    } else {                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                    \
            T x = *(const T *)(p[1] + i * st[1]);                                            \
            *(T *)(p[0] + i * st[0]) = (EXPR);                                               \
        }                                                                                    \
    }

NB_CPU_CLONES static void unary_f32(int64_t n, char **p, const int64_t *st, const void *varg) {
    const unary_arg *arg = varg;
    float s = (float)arg->s;
    bool unit = st[0] == 4 && st[1] == 4;
#define LOOP(EXPR) UNARY_LOOP(float, EXPR)
#define FORMULA(f) nb__f_##f##_f32v
    switch (arg->op) { NB_UNARY_OPS(UNARY_CASE) }
#undef FORMULA
#undef LOOP
}

static void unary_f64(int64_t n, char **p, const int64_t *st, const void *varg) {
    const unary_arg *arg = varg;
    double s = arg->s;
    bool unit = st[0] == 8 && st[1] == 8;
#define LOOP(EXPR) UNARY_LOOP(double, EXPR)
#define FORMULA(f) nb__f_##f##_f64
    switch (arg->op) { NB_UNARY_OPS(UNARY_CASE) }
#undef FORMULA
#undef LOOP
}

void nb__cpu_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s) {
    unary_arg arg = {op, s};
    if (nb__cpu_is_bf16(out)) {
        if (!blocks_apply(out, 1, &a)) {
            nb__cpu_unary_bf16(op, out, a, s);
            return;
        }
        iter it;
        iter_init(&it, out, 1, &a);
        half_arg h = {unary_f32, &arg, 1, {a->dtype}};
        iter_run(&it, half_inner, &h);
        return;
    }
    iter it;
    iter_init(&it, out, 1, &a);
    if (out->dtype == NB_F32) iter_run(&it, unary_f32, &arg);
    else if (out->dtype == NB_F64) iter_run(&it, unary_f64, &arg);
    else NB_ABORT("%s: dtype %s has no CPU math", nb__unary_name(op), nb_dtype_name(out->dtype));
}

NB_CPU_CLONES static void gelu_tanh_backward_f32(float *dx, const float *g, const float *x,
                                                 int64_t n) {
    for (int64_t i = 0; i < n; i++) dx[i] = g[i] * nb__f_gelu_tanh_grad_f32v(x[i], 0);
}

/* dx = g * GELU'(x) over n contiguous elements of f32 (half false) or
 * bf16, in chunks of GRAIN on the pool when there are two or more */
typedef struct gelu_job {
    void *dx;
    const void *g, *x;
    int64_t n;
    bool half;
} gelu_job;

/* bf16 dx, g and x: the f32 loop in blocks (Note [bf16 elementwise in
 * blocks]) */
static void gelu_backward_half(uint16_t *dx, const uint16_t *g, const uint16_t *x, int64_t n) {
    float bd[BLOCK], bg[BLOCK], bx[BLOCK];
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t len = n - lo < BLOCK ? n - lo : BLOCK;
        nb__f32_from_bf16_n(bg, g + lo, len);
        nb__f32_from_bf16_n(bx, x + lo, len);
        gelu_tanh_backward_f32(bd, bg, bx, len);
        nb__bf16_from_f32_n(dx + lo, bd, len);
    }
}

static void gelu_backward_range(const gelu_job *j, int64_t lo, int64_t len) {
    if (j->half)
        gelu_backward_half((uint16_t *)j->dx + lo, (const uint16_t *)j->g + lo,
                           (const uint16_t *)j->x + lo, len);
    else
        gelu_tanh_backward_f32((float *)j->dx + lo, (const float *)j->g + lo,
                               (const float *)j->x + lo, len);
}

static void gelu_backward_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const gelu_job *j = varg;
    int64_t lo = c * GRAIN, len = j->n - lo < GRAIN ? j->n - lo : GRAIN;
    gelu_backward_range(j, lo, len);
}

static void gelu_backward_run(const gelu_job *j) {
    if (j->n < 2 * GRAIN) gelu_backward_range(j, 0, j->n);
    else nb__parallel_for(nb__chunk_count(j->n, GRAIN), gelu_backward_chunk, (void *)j);
}

void nb__cpu_gelu_tanh_backward_f32(nb_tensor *dx, const nb_tensor *g, const nb_tensor *x) {
    gelu_backward_run(&(gelu_job){dx->data, g->data, x->data, nb_numel(x), false});
}

bool nb__cpu_gelu_tanh_backward_blocks(nb_tensor *dx, const nb_tensor *g, const nb_tensor *x) {
    const nb_tensor *in[2] = {g, x};
    if (g->dtype != NB_BF16 || x->dtype != NB_BF16 || !nb_is_contiguous(dx) ||
        !nb_is_contiguous(g) || !nb_is_contiguous(x) || !blocks_apply(dx, 2, in))
        return false;
    gelu_backward_run(&(gelu_job){dx->data, g->data, x->data, nb_numel(x), true});
    return true;
}

/* ---- binary ---- */
/* One loop per table row over unit strides (it vectorises), one switch
 * per element otherwise. An output that is its first input (in-place
 * accumulation: a gradient's second contribution, nb__sum_to's aliased
 * sum) has a loop of its own: with o == a the compiler's run-time overlap
 * check fails and its vectorised loop is skipped for the scalar one. */
#define BINARY_UNIT_CASE(E, f, name)                                                         \
    case NB_B_##E: for (int64_t i = 0; i < n; i++) o[i] = FORMULA(f)(a[i], b[i]); break;
#define BINARY_INPLACE_CASE(E, f, name)                                                      \
    case NB_B_##E: for (int64_t i = 0; i < n; i++) o[i] = FORMULA(f)(o[i], b[i]); break;
#define BINARY_CASE(E, f, name) case NB_B_##E: r = FORMULA(f)(x, y); break;
#define BINARY_BODY(T)                                                                       \
    nb__binary_op op = *(const nb__binary_op *)varg;                                         \
    const int64_t sz = (int64_t)sizeof(T);                                                   \
    if (st[0] == sz && st[1] == sz && st[2] == sz) {                                         \
        T *o = (T *)p[0];                                                                    \
        const T *a = (const T *)p[1], *b = (const T *)p[2];                                  \
        if (p[0] == p[1] && p[0] != p[2]) {                                                  \
            switch (op) { NB_BINARY_OPS(BINARY_INPLACE_CASE) }                               \
            return;                                                                          \
        }                                                                                    \
        switch (op) { NB_BINARY_OPS(BINARY_UNIT_CASE) }                                      \
        return;                                                                              \
    }                                                                                        \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T x = *(const T *)(p[1] + i * st[1]), y = *(const T *)(p[2] + i * st[2]), r = 0;     \
        switch (op) { NB_BINARY_OPS(BINARY_CASE) }                                           \
        *(T *)(p[0] + i * st[0]) = r;                                                        \
    }

#define FORMULA(f) nb__f_##f##_f32
NB_CPU_CLONES static void binary_f32(int64_t n, char **p, const int64_t *st, const void *varg) { BINARY_BODY(float) }
#undef FORMULA
#define FORMULA(f) nb__f_##f##_f64
static void binary_f64(int64_t n, char **p, const int64_t *st, const void *varg) { BINARY_BODY(double) }
#undef FORMULA
/* Integers: the table's formulas, except that division never traps. The
 * front end refuses a zero divisor (Note [Integer division] in
 * tensor/ops_elementwise.c); MIN / -1 wraps to MIN, and a zero that reaches
 * the kernel anyway (an internal caller) gives 0, never SIGFPE. */
#define INT_FORMULAS(T, S, U)                                                                \
    static inline T int_add_##S(T x, T y) { return nb__f_add_##S(x, y); }                    \
    static inline T int_sub_##S(T x, T y) { return nb__f_sub_##S(x, y); }                    \
    static inline T int_mul_##S(T x, T y) { return nb__f_mul_##S(x, y); }                    \
    static inline T int_div_##S(T x, T y) {                                                  \
        return y == 0 ? (T)0 : y == -1 ? (T)((U)0 - (U)x) : x / y;                           \
    }
INT_FORMULAS(int32_t, i32, uint32_t)
INT_FORMULAS(int64_t, i64, uint64_t)
#define FORMULA(f) int_##f##_i32
static void binary_i32(int64_t n, char **p, const int64_t *st, const void *varg) { BINARY_BODY(int32_t) }
#undef FORMULA
#define FORMULA(f) int_##f##_i64
static void binary_i64(int64_t n, char **p, const int64_t *st, const void *varg) { BINARY_BODY(int64_t) }
#undef FORMULA

void nb__cpu_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b) {
    const nb_tensor *in[2] = {a, b};
    if (nb__cpu_is_bf16(out)) {
        if (!blocks_apply(out, 2, in)) {
            nb__cpu_binary_bf16(op, out, a, b);
            return;
        }
        iter it;
        iter_init(&it, out, 2, in);
        half_arg h = {binary_f32, &op, 2, {a->dtype, b->dtype}};
        iter_run(&it, half_inner, &h);
        return;
    }
    iter it;
    iter_init(&it, out, 2, in);
    if (out->dtype == NB_F32 && (nb__cpu_is_bf16(a) || nb__cpu_is_bf16(b))) {
        NB_CHECK((a->dtype == NB_F32 || a->dtype == NB_BF16) && (b->dtype == NB_F32 || b->dtype == NB_BF16),
                 "%s: f32 output, inputs %s and %s", nb__binary_name(op), nb_dtype_name(a->dtype),
                 nb_dtype_name(b->dtype));
        half_arg h = {binary_f32, &op, 2, {a->dtype, b->dtype}};
        iter_run(&it, wide_inner, &h);
        return;
    }
    switch (out->dtype) {
    case NB_F32: iter_run(&it, binary_f32, &op); break;
    case NB_F64: iter_run(&it, binary_f64, &op); break;
    case NB_I32: iter_run(&it, binary_i32, &op); break;
    case NB_I64: iter_run(&it, binary_i64, &op); break;
    default: NB_ABORT("%s: dtype %s has no CPU math", nb__binary_name(op), nb_dtype_name(out->dtype));
    }
}

/* ---- where ---- */
typedef struct where_arg {
    nb_dtype cond_dtype;
    size_t size;
} where_arg;

static void where_inner(int64_t n, char **p, const int64_t *st, const void *varg) {
    const where_arg *arg = varg;
    for (int64_t i = 0; i < n; i++) {
        bool c = nb__load(p[1] + i * st[1], arg->cond_dtype) != 0;
        memcpy(p[0] + i * st[0], c ? p[2] + i * st[2] : p[3] + i * st[3], arg->size);
    }
}

void nb__cpu_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a, const nb_tensor *b) {
    const nb_tensor *in[3] = {cond, a, b};
    iter it;
    iter_init(&it, out, 3, in);
    where_arg arg = {cond->dtype, nb_dtype_size(out->dtype)};
    iter_run(&it, where_inner, &arg);
}

/* ---- copy and cast ---- */
typedef struct copy_arg {
    nb_dtype dst, src;
} copy_arg;

/* Strided copies element by element with a constant size, so that each
 * memcpy is one load and one store (a variable size is a libc call per
 * element: a fill, a stride-0 source, ran at ~0.3 GB/s); a stride-0
 * source (nb_full, nb_ones, expand then copy) is one value stored n times. */
#define COPY_STRIDED(SZ)                                                                      \
    do {                                                                                      \
        if (st[1] == 0) {                                                                     \
            char v[SZ];                                                                       \
            memcpy(v, p[1], SZ);                                                              \
            if (st[0] == SZ)                                                                  \
                for (int64_t i = 0; i < n; i++) memcpy(p[0] + i * SZ, v, SZ);                 \
            else                                                                              \
                for (int64_t i = 0; i < n; i++) memcpy(p[0] + i * st[0], v, SZ);              \
        } else {                                                                              \
            for (int64_t i = 0; i < n; i++) memcpy(p[0] + i * st[0], p[1] + i * st[1], SZ);   \
        }                                                                                     \
    } while (0)

static void copy_same(int64_t n, char **p, const int64_t *st, const void *varg) {
    const copy_arg *arg = varg;
    int64_t sz = (int64_t)nb_dtype_size(arg->dst);
    if (st[0] == sz && st[1] == sz) {
        memmove(p[0], p[1], (size_t)(n * sz));
        return;
    }
    switch (sz) {
    case 2: COPY_STRIDED(2); break;
    case 4: COPY_STRIDED(4); break;
    case 8: COPY_STRIDED(8); break;
    default:
        for (int64_t i = 0; i < n; i++) memcpy(p[0] + i * st[0], p[1] + i * st[1], (size_t)sz);
    }
}

static void copy_cast(int64_t n, char **p, const int64_t *st, const void *varg) {
    const copy_arg *arg = varg;
    if (arg->src == NB_F32 && arg->dst == NB_BF16) {
        if (st[0] == 2 && st[1] == 4) {
            nb__bf16_from_f32_n((uint16_t *)p[0], (const float *)p[1], n);
            return;
        }
        for (int64_t i = 0; i < n; i++)
            *(uint16_t *)(p[0] + i * st[0]) = nb_f32_to_bf16(*(const float *)(p[1] + i * st[1]));
        return;
    }
    if (arg->src == NB_BF16 && arg->dst == NB_F32) {
        if (st[0] == 4 && st[1] == 2) {
            nb__f32_from_bf16_n((float *)p[0], (const uint16_t *)p[1], n);
            return;
        }
        for (int64_t i = 0; i < n; i++)
            *(float *)(p[0] + i * st[0]) = nb_bf16_to_f32(*(const uint16_t *)(p[1] + i * st[1]));
        return;
    }
    if (arg->src == NB_I64 && arg->dst == NB_I32) {
        for (int64_t i = 0; i < n; i++)
            *(int32_t *)(p[0] + i * st[0]) = (int32_t)*(const int64_t *)(p[1] + i * st[1]);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        nb__store(p[0] + i * st[0], arg->dst, nb__load(p[1] + i * st[1], arg->src));
}

/* whether the bytes that t spans, [lowest, highest element], meet u's */
static void byte_extent(const nb_tensor *t, const char **lo, const char **hi) {
    int64_t a = 0, b = 0, es = (int64_t)nb_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++) {
        int64_t span = (t->shape[d] - 1) * t->strides[d];
        if (span < 0) a += span;
        else b += span;
    }
    *lo = (const char *)t->data + a * es;
    *hi = (const char *)t->data + (b + 1) * es;
}

static bool overlaps(const nb_tensor *t, const nb_tensor *u) {
    const char *tl, *th, *ul, *uh;
    if (nb_numel(t) == 0 || nb_numel(u) == 0) return false;
    byte_extent(t, &tl, &th);
    byte_extent(u, &ul, &uh);
    return tl < uh && ul < th;
}

void nb__cpu_copy(nb_tensor *dst, const nb_tensor *src) {
    iter it;
    iter_init(&it, dst, 1, &src);
    copy_arg arg = {dst->dtype, src->dtype};
    /* overlapping memory is copied as memmove would, in one piece */
    iter_run_on(&it, dst->dtype == src->dtype ? copy_same : copy_cast, &arg,
                !overlaps(dst, src));
}
