/* What every backend shares about a collective: names, the fingerprint
 * ranks compare (Note [Hang diagnostics] in pg_diag.c), its fixed-size
 * header (Note [Collective headers] in pg_check.c), and the elementwise
 * reductions the Gloo shim hands to Gloo.
 *
 * bf16 and f16 reduce through f32: each pair of elements is widened,
 * combined and rounded back, so values travel as 16 bits and a sum over
 * R ranks is rounded R - 1 times (as NCCL does). min and max of floats
 * propagate NaN. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "distributed/internal.h"

const char *nb__coll_name(nb__coll_kind kind) {
    switch (kind) {
    case NB__ALL_REDUCE: return "all_reduce";
    case NB__BROADCAST: return "broadcast";
    case NB__ALL_GATHER: return "all_gather";
    case NB__REDUCE_SCATTER: return "reduce_scatter";
    case NB__BARRIER: return "barrier";
    }
    return "?";
}

const char *nb__reduce_name(nb_reduce_op op) {
    switch (op) {
    case NB_REDUCE_SUM: return "sum";
    case NB_REDUCE_AVG: return "avg";
    case NB_REDUCE_MIN: return "min";
    case NB_REDUCE_MAX: return "max";
    }
    return "?";
}

void nb__coll_fingerprint(const nb__coll *c, char *buf, size_t len) {
    const char *name = nb__coll_name(c->kind);
    const char *dt = nb_dtype_name(c->dtype);
    switch (c->kind) {
    case NB__ALL_REDUCE:
    case NB__REDUCE_SCATTER:
        snprintf(buf, len, "%s(%s, %s, count=%" PRId64 ")", name, nb__reduce_name(c->op), dt, c->count);
        break;
    case NB__BROADCAST:
        snprintf(buf, len, "%s(%s, count=%" PRId64 ", root=%d)", name, dt, c->count, c->root);
        break;
    case NB__ALL_GATHER:
        snprintf(buf, len, "%s(%s, count=%" PRId64 ")", name, dt, c->count);
        break;
    case NB__BARRIER:
        snprintf(buf, len, "barrier()");
        break;
    }
}

/* "NBC1": a peer built from another nabla would speak another header. */
#define HEADER_MAGIC 0x3143424e

void nb__coll_header(const nb__coll *c, int64_t h[NB__COLL_HEADER_WORDS]) {
    bool reduces = c->kind == NB__ALL_REDUCE || c->kind == NB__REDUCE_SCATTER;
    bool data = c->kind != NB__BARRIER;
    h[0] = HEADER_MAGIC;
    h[1] = c->kind;
    h[2] = reduces ? c->op : 0;
    h[3] = data ? c->dtype : 0;
    h[4] = data ? c->count : 0;
    h[5] = c->kind == NB__BROADCAST ? c->root : 0;
}

bool nb__coll_header_wanted(nb__dist_check mode, bool cheap, const nb__coll *c) {
    if (mode == NB__CHECK_OFF) return false;
    if (mode == NB__CHECK_FULL || cheap) return true;
    return c->kind == NB__BROADCAST || c->seq <= NB__CHECK_FIRST;
}

bool nb__coll_from_header(const int64_t h[NB__COLL_HEADER_WORDS], nb__coll *c) {
    memset(c, 0, sizeof *c);
    if (h[0] != HEADER_MAGIC || h[1] < NB__ALL_REDUCE || h[1] > NB__BARRIER || h[2] < NB_REDUCE_SUM ||
        h[2] > NB_REDUCE_MAX || h[3] < 0 || h[3] >= NB_DTYPE_COUNT || h[4] < 0 || h[5] < 0 || h[5] > INT32_MAX)
        return false;
    c->kind = (nb__coll_kind)h[1];
    c->op = (nb_reduce_op)h[2];
    c->dtype = (nb_dtype)h[3];
    c->count = h[4];
    c->root = (int)h[5];
    if (c->kind == NB__BARRIER) c->dtype = NB_I32;
    return true;
}

#define NUM_LOOP(T, expr)                                                  \
    do {                                                                   \
        T *a_ = acc;                                                       \
        const T *x_ = x;                                                   \
        for (size_t i = 0; i < n; i++) {                                   \
            T a = a_[i], b = x_[i];                                        \
            a_[i] = (expr);                                                \
        }                                                                  \
    } while (0)

#define FLOAT_OPS(T)                                                       \
    switch (op) {                                                          \
    case NB_REDUCE_SUM:                                                    \
    case NB_REDUCE_AVG: NUM_LOOP(T, a + b); break;                         \
    case NB_REDUCE_MIN: NUM_LOOP(T, (isnan(b) || b < a) ? b : a); break;   \
    case NB_REDUCE_MAX: NUM_LOOP(T, (isnan(b) || b > a) ? b : a); break;   \
    }

/* Integer sums wrap (two's complement), computed unsigned to stay defined. */
#define INT_OPS(T, U)                                                      \
    switch (op) {                                                          \
    case NB_REDUCE_SUM:                                                    \
    case NB_REDUCE_AVG: NUM_LOOP(T, (T)((U)a + (U)b)); break;              \
    case NB_REDUCE_MIN: NUM_LOOP(T, b < a ? b : a); break;                 \
    case NB_REDUCE_MAX: NUM_LOOP(T, b > a ? b : a); break;                 \
    }

static float half_combine(nb_reduce_op op, float a, float b) {
    switch (op) {
    case NB_REDUCE_SUM:
    case NB_REDUCE_AVG: return a + b;
    case NB_REDUCE_MIN: return (isnan(b) || b < a) ? b : a;
    case NB_REDUCE_MAX: return (isnan(b) || b > a) ? b : a;
    }
    return a;
}

void nb__reduce_into(nb_dtype dtype, nb_reduce_op op, void *acc, const void *x, size_t n) {
    switch (dtype) {
    case NB_F32: FLOAT_OPS(float); break;
    case NB_F64: FLOAT_OPS(double); break;
    case NB_I32: INT_OPS(int32_t, uint32_t); break;
    case NB_I64: INT_OPS(int64_t, uint64_t); break;
    case NB_BF16:
        NUM_LOOP(uint16_t, nb_f32_to_bf16(half_combine(op, nb_bf16_to_f32(a), nb_bf16_to_f32(b))));
        break;
    case NB_F16:
        NUM_LOOP(uint16_t, nb_f32_to_f16(half_combine(op, nb_f16_to_f32(a), nb_f16_to_f32(b))));
        break;
    default:
        NB_ABORT("nb__reduce_into: dtype %s cannot be reduced", nb_dtype_name(dtype));
    }
}

void nb__scale_down(nb_dtype dtype, void *x, size_t n, double d) {
    switch (dtype) {
    case NB_F32: {
        float *p = x;
        for (size_t i = 0; i < n; i++) p[i] = (float)((double)p[i] / d);
        break;
    }
    case NB_F64: {
        double *p = x;
        for (size_t i = 0; i < n; i++) p[i] /= d;
        break;
    }
    case NB_BF16: {
        uint16_t *p = x;
        for (size_t i = 0; i < n; i++) p[i] = nb_f32_to_bf16((float)((double)nb_bf16_to_f32(p[i]) / d));
        break;
    }
    case NB_F16: {
        uint16_t *p = x;
        for (size_t i = 0; i < n; i++) p[i] = nb_f32_to_f16((float)((double)nb_f16_to_f32(p[i]) / d));
        break;
    }
    default:
        NB_ABORT("nb__scale_down: avg needs a floating dtype, got %s", nb_dtype_name(dtype));
    }
}
