/* The CPU backend's elementwise losses (tensor/backend.h; the ops are in
 * tensor/ops_loss.c): the mean over elements of (a - b)^2 (kind 0) or of
 * max(a, 0) - a b + log1p(exp(-|a|)) (kind 1), summed in double; a and b
 * contiguous f32 or f64 of one shape. The sum is cut into pieces of PIECE
 * elements, each summed in order and added in order, pieces on the thread
 * pool (Note [Deterministic parallel kernels] in tensor/cpu/threads.h). */
#include <math.h>
#include <stdlib.h>

#include "tensor/cpu/cpu.h"
#include "tensor/cpu/threads.h"

typedef enum pair_loss { LOSS_MSE, LOSS_BCE } pair_loss;

/* sum over elements of the loss term, in double; a and b contiguous */
#define DEFINE_PAIR_SUM(T, LOG1P, EXP, FABS)                                                \
    static double pair_sum_##T(pair_loss kind, const T *a, const T *b, int64_t n) {          \
        double s = 0;                                                                       \
        if (kind == LOSS_MSE) {                                                             \
            for (int64_t i = 0; i < n; i++) {                                               \
                double d = (double)a[i] - (double)b[i];                                     \
                s += d * d;                                                                 \
            }                                                                               \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                T x = a[i];                                                                 \
                s += (double)((x > 0 ? x : (T)0) - x * b[i] + LOG1P(EXP(-FABS(x))));         \
            }                                                                               \
        }                                                                                   \
        return s;                                                                           \
    }

DEFINE_PAIR_SUM(float, log1pf, expf, fabsf)
DEFINE_PAIR_SUM(double, log1p, exp, fabs)

#define PIECE 32768

typedef struct loss_job {
    pair_loss kind;
    const nb_tensor *a, *b;
    int64_t n;
    double *partial;
} loss_job;

static double piece_sum(const loss_job *j, int64_t lo, int64_t hi) {
    if (j->a->dtype == NB_F32)
        return pair_sum_float(j->kind, (const float *)j->a->data + lo,
                              (const float *)j->b->data + lo, hi - lo);
    return pair_sum_double(j->kind, (const double *)j->a->data + lo,
                           (const double *)j->b->data + lo, hi - lo);
}

static void loss_chunk(void *varg, int64_t c, int tid) {
    (void)tid;
    const loss_job *j = varg;
    int64_t lo = c * PIECE;
    j->partial[c] = piece_sum(j, lo, lo + PIECE < j->n ? lo + PIECE : j->n);
}

void nb__cpu_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b) {
    loss_job j = {(pair_loss)kind, a, b, nb_numel(a), NULL};
    int64_t pieces = nb__chunk_count(j.n, PIECE);
    double s = 0;
    if (pieces == 1) {
        s = piece_sum(&j, 0, j.n);
    } else {
        j.partial = malloc((size_t)pieces * sizeof *j.partial);
        NB_CHECK(j.partial, "nb loss: out of memory for %lld partial sums", (long long)pieces);
        nb__parallel_for(pieces, loss_chunk, &j);
        for (int64_t c = 0; c < pieces; c++) s += j.partial[c];
        free(j.partial);
    }
    nb__store(out->data, out->dtype, s / (double)j.n);
}
