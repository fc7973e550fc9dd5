/* The CPU row reductions behind nb_sum/nb_mean, nb_max, nb_var and
 * nb_argmax (tensor/ops_reduce.c lays the input out as contiguous rows).
 * f32 rows accumulate in double. A row is summed in pieces of PIECE
 * elements, each in order, and the pieces' sums are added in order; rows
 * run in parallel, and a single long row's pieces do (Note [Deterministic
 * parallel kernels] in tensor/cpu/threads.h: the same bits for any thread
 * count). Contracts: the matching members of nb__backend
 * (tensor/backend.h).
 *
 * Note [bf16 rows read in place]
 * bf16 rows are read where they are, each element widened as it is read,
 * and the results (f32 or bf16 outputs) stored as the f32 op's rounded:
 * the same sums in the same order as on f32 twins of the rows, so the
 * bits of the f32 op on the bf16 values (Note [bf16 activations on the
 * CPU] in tensor/cpu/bf16.c), without the twins. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cpu/bf16.h"
#include "tensor/cpu/cpu.h"
#include "tensor/cpu/threads.h"

#define PIECE 32768

/* sum of r[i] (kind 0) or of (r[i] - mu)^2 (kind 1) over [lo, hi), in order */
static double piece_sum(nb_dtype dt, const void *r, int64_t lo, int64_t hi, int kind, double mu) {
    double acc = 0;
    if (dt == NB_F32) {
        const float *x = r;
        if (kind == 0)
            for (int64_t i = lo; i < hi; i++) acc += x[i];
        else
            for (int64_t i = lo; i < hi; i++) acc += (x[i] - mu) * (x[i] - mu);
    } else if (dt == NB_BF16) { /* Note [bf16 rows read in place] */
        const uint16_t *x = r;
        if (kind == 0)
            for (int64_t i = lo; i < hi; i++) acc += nb__f32_of_bf16(x[i]);
        else
            for (int64_t i = lo; i < hi; i++) {
                float v = nb__f32_of_bf16(x[i]);
                acc += (v - mu) * (v - mu);
            }
    } else {
        const double *x = r;
        if (kind == 0)
            for (int64_t i = lo; i < hi; i++) acc += x[i];
        else
            for (int64_t i = lo; i < hi; i++) acc += (x[i] - mu) * (x[i] - mu);
    }
    return acc;
}

/* out[o] = v in the output's dtype: f64, or rounded to f32 (and then to
 * bf16, as the f32 op's output rounded) */
static void put(void *out, nb_dtype dt, int64_t o, double v) {
    if (dt == NB_F64) ((double *)out)[o] = v;
    else if (dt == NB_F32) ((float *)out)[o] = (float)v;
    else ((uint16_t *)out)[o] = nb__bf16_of_f32((float)v);
}

/* the row's sum: its pieces' sums added in order */
static double row_sum(nb_dtype dt, const void *r, int64_t inner, int kind, double mu) {
    if (inner <= PIECE) return piece_sum(dt, r, 0, inner, kind, mu);
    double acc = 0;
    for (int64_t lo = 0; lo < inner; lo += PIECE)
        acc += piece_sum(dt, r, lo, lo + PIECE < inner ? lo + PIECE : inner, kind, mu);
    return acc;
}

typedef struct red_job {
    void *out, *aux;
    const void *rows;
    nb_dtype dt, odt, adt; /* the rows', the output's, aux's (var's means) */
    int64_t inner;
    double scale, mu;
    int kind;
    double *partial;
} red_job;

static const void *row_at(const red_job *j, int64_t o) {
    return (const char *)j->rows + o * j->inner * (int64_t)nb_dtype_size(j->dt);
}

static void piece_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const red_job *j = varg;
    int64_t lo = c * PIECE, hi = lo + PIECE < j->inner ? lo + PIECE : j->inner;
    j->partial[c] = piece_sum(j->dt, j->rows, lo, hi, j->kind, j->mu);
}

/* row_sum of one long row, its pieces on the pool */
static double long_row_sum(nb_dtype dt, const void *r, int64_t inner, int kind, double mu) {
    int64_t pieces = nb__chunk_count(inner, PIECE);
    double *partial = malloc((size_t)pieces * sizeof *partial);
    NB_CHECK(partial, "row reduction: out of memory for %lld partial sums", (long long)pieces);
    red_job j = {.rows = r, .dt = dt, .inner = inner, .kind = kind, .mu = mu, .partial = partial};
    nb__parallel_for(pieces, piece_chunk, &j);
    double acc = 0;
    for (int64_t c = 0; c < pieces; c++) acc += partial[c];
    free(partial);
    return acc;
}

static void sum_range(void *varg, int64_t lo, int64_t hi) {
    const red_job *j = varg;
    for (int64_t o = lo; o < hi; o++) {
        put(j->out, j->odt, o, row_sum(j->dt, row_at(j, o), j->inner, 0, 0) * j->scale);
    }
}

/* bf16 rows (contiguous: ops_reduce.c lays them out so) whose outputs are
 * bf16 or f32, read in place (Note [bf16 rows read in place]) */
static bool half_in_place(const nb_tensor *rows, int n, const nb_tensor *const *outs) {
    if (rows->dtype != NB_BF16 || !nb_is_contiguous(rows)) return false;
    for (int i = 0; i < n; i++)
        if (outs[i] && ((outs[i]->dtype != NB_BF16 && outs[i]->dtype != NB_F32) ||
                        !nb_is_contiguous(outs[i])))
            return false;
    return true;
}

void nb__cpu_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner,
                      double scale) {
    if (nb__cpu_is_bf16(rows) && !half_in_place(rows, 1, (const nb_tensor *[]){out})) {
        nb__cpu_sum_rows_bf16(out, rows, outer, inner, scale);
        return;
    }
    red_job j = {.out = out->data, .rows = rows->data, .dt = rows->dtype, .odt = out->dtype,
                 .inner = inner, .scale = scale};
    if (outer == 1 && inner > 2 * PIECE) {
        put(j.out, j.odt, 0, long_row_sum(j.dt, j.rows, inner, 0, 0) * scale);
        return;
    }
    nb__parallel_range(outer, nb__grain(inner), sum_range, &j);
}

/* Note [Max with NaN] in tensor/cuda/reduce.cu: NaN counts as the maximum. */
#define MAX_ROWS(T)                                                               \
    do {                                                                          \
        T *dst = j->out;                                                          \
        int64_t *a = j->aux;                                                      \
        for (int64_t o = lo; o < hi; o++) {                                       \
            const T *r = row_at(j, o);                                            \
            int64_t best = 0;                                                     \
            for (int64_t i = 1; i < j->inner; i++)                                \
                if (r[i] > r[best] || (isnan(r[i]) && !isnan(r[best]))) best = i; \
            a[o] = best;                                                          \
            dst[o] = r[best];                                                     \
        }                                                                         \
    } while (0)

static void max_range(void *varg, int64_t lo, int64_t hi) {
    const red_job *j = varg;
    if (j->dt == NB_F32) {
        MAX_ROWS(float);
    } else if (j->dt == NB_F64) {
        MAX_ROWS(double);
    } else { /* Note [bf16 rows read in place]: the maximum's value is exact */
        int64_t *a = j->aux;
        for (int64_t o = lo; o < hi; o++) {
            const uint16_t *r = row_at(j, o);
            int64_t best = 0;
            float vb = nb__f32_of_bf16(r[0]);
            for (int64_t i = 1; i < j->inner; i++) {
                float v = nb__f32_of_bf16(r[i]);
                if (v > vb || (isnan(v) && !isnan(vb))) best = i, vb = v;
            }
            a[o] = best;
            put(j->out, j->odt, o, vb);
        }
    }
}

void nb__cpu_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                      int64_t inner) {
    if (nb__cpu_is_bf16(rows) && !half_in_place(rows, 1, (const nb_tensor *[]){out})) {
        nb__cpu_max_rows_bf16(out, arg, rows, outer, inner);
        return;
    }
    red_job j = {.out = out->data, .aux = arg->data, .rows = rows->data, .dt = rows->dtype,
                 .odt = out->dtype, .inner = inner};
    nb__parallel_range(outer, nb__grain(inner), max_range, &j);
}

#define ARGMAX_ROWS(T)                                                            \
    do {                                                                          \
        int64_t *a = j->aux;                                                      \
        for (int64_t o = lo; o < hi; o++) {                                       \
            const T *r = row_at(j, o);                                            \
            int64_t best = 0;                                                     \
            for (int64_t i = 1; i < j->inner && !isnan(r[best]); i++)             \
                if (r[i] > r[best] || isnan(r[i])) best = i;                      \
            a[o] = best;                                                          \
        }                                                                         \
    } while (0)

static void argmax_range(void *varg, int64_t lo, int64_t hi) {
    const red_job *j = varg;
    if (j->dt == NB_F32) {
        ARGMAX_ROWS(float);
    } else if (j->dt == NB_F64) {
        ARGMAX_ROWS(double);
    } else { /* Note [bf16 rows read in place] */
        int64_t *a = j->aux;
        for (int64_t o = lo; o < hi; o++) {
            const uint16_t *r = row_at(j, o);
            int64_t best = 0;
            float vb = nb__f32_of_bf16(r[0]);
            for (int64_t i = 1; i < j->inner && !isnan(vb); i++) {
                float v = nb__f32_of_bf16(r[i]);
                if (v > vb || isnan(v)) best = i, vb = v;
            }
            a[o] = best;
        }
    }
}

void nb__cpu_argmax_rows(nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner) {
    if (nb__cpu_is_bf16(rows) && !half_in_place(rows, 0, NULL)) {
        nb__cpu_argmax_rows_bf16(arg, rows, outer, inner);
        return;
    }
    red_job j = {.aux = arg->data, .rows = rows->data, .dt = rows->dtype, .inner = inner};
    nb__parallel_range(outer, nb__grain(inner), argmax_range, &j);
}

void nb__cpu_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g,
                               int64_t outer, int64_t inner) {
    const int64_t *a = arg->data;
    size_t gsz = nb_dtype_size(g->dtype), psz = nb_dtype_size(gp->dtype);
    if (outer * inner > 0) memset(gp->data, 0, (size_t)(outer * inner) * psz);
    for (int64_t o = 0; o < outer; o++) {
        double v = nb__load((const char *)g->data + o * (int64_t)gsz, g->dtype);
        nb__store((char *)gp->data + (o * inner + a[o]) * (int64_t)psz, gp->dtype, v);
    }
}

/* mean and then the sum of squared deviations from it, each a row_sum */
static void var_store(const red_job *j, int64_t o, double s, const void *r, bool long_row) {
    double mu = s / (double)j->inner;
    double ss = long_row ? long_row_sum(j->dt, r, j->inner, 1, mu) : row_sum(j->dt, r, j->inner, 1, mu);
    double v = j->scale > 0 ? ss / j->scale : NAN;
    put(j->aux, j->adt, o, mu);
    put(j->out, j->odt, o, v);
}

static void var_range(void *varg, int64_t lo, int64_t hi) {
    const red_job *j = varg;
    for (int64_t o = lo; o < hi; o++) {
        const void *r = row_at(j, o);
        var_store(j, o, row_sum(j->dt, r, j->inner, 0, 0), r, false);
    }
}

/* (red_job: scale is the denominator, aux the means) */
void nb__cpu_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                      int64_t inner, double denom) {
    if (nb__cpu_is_bf16(rows) && !half_in_place(rows, 2, (const nb_tensor *[]){out, mean})) {
        nb__cpu_var_rows_bf16(out, mean, rows, outer, inner, denom);
        return;
    }
    red_job j = {.out = out->data, .aux = mean->data, .rows = rows->data, .dt = rows->dtype,
                 .odt = out->dtype, .adt = mean->dtype, .inner = inner, .scale = denom};
    if (outer == 1 && inner > 2 * PIECE) {
        var_store(&j, 0, long_row_sum(j.dt, j.rows, inner, 0, 0), j.rows, true);
        return;
    }
    nb__parallel_range(outer, nb__grain(2 * inner), var_range, &j);
}
