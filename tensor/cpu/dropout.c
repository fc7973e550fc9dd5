/* The CPU backend's dropout (tensor/backend.h; the mask's stream is
 * described in tensor/ops_dropout.c): x, out, mask contiguous f32 or f64,
 * or bf16 (in blocks, below; other bf16 layouts through f32 twins). */
#include "tensor/cpu/bf16.h"
#include "tensor/cpu/cpu.h"

#include "tensor/cpu/threads.h"

/* elements [i0, i1): out, mask and x point at element i0; the stream's
 * index is the element's, so any cut gives the same values */
#define DEFINE_DROPOUT(T, S)                                                                  \
    static void dropout_##S(int64_t i0, int64_t i1, T *out, T *mask, const T *x, double p,    \
                            uint64_t seed, uint64_t offset) {                                 \
        T scale = p < 1 ? (T)(1.0 / (1.0 - p)) : (T)0;                                        \
        uint32_t r[4];                                                                        \
        if (i0 & 3) nb_philox4x32(seed, offset + (uint64_t)i0 / 4, r);                        \
        for (int64_t i = i0; i < i1; i++) {                                                   \
            if ((i & 3) == 0) nb_philox4x32(seed, offset + (uint64_t)i / 4, r);               \
            T m = (double)nb_u32_to_unit(r[i & 3]) >= p ? scale : (T)0;                       \
            out[i - i0] = x[i - i0] * m;                                                      \
            if (mask) mask[i - i0] = m;                                                       \
        }                                                                                     \
    }

DEFINE_DROPOUT(float, f32)
DEFINE_DROPOUT(double, f64)

/* Note [bf16 dropout in blocks]
 * bf16 x, out and mask: each block of BLOCK elements is widened into an f32
 * buffer on the stack, the f32 loop runs on it, and out's and the mask's
 * elements are rounded once: the bits of the f32 op on f32 twins of the
 * bf16 values (Note [bf16 activations on the CPU] in tensor/cpu/bf16.c),
 * without the three twins. */
enum { BLOCK = 1024, GRAIN = 16 * BLOCK };

typedef struct dropout_job {
    nb_dtype dt;
    void *out, *mask;
    const void *x;
    double p;
    uint64_t seed, offset;
} dropout_job;

static void dropout_range(void *arg, int64_t lo, int64_t hi) {
    const dropout_job *j = arg;
    if (j->dt == NB_F32) {
        dropout_f32(lo, hi, (float *)j->out + lo, j->mask ? (float *)j->mask + lo : NULL,
                    (const float *)j->x + lo, j->p, j->seed, j->offset);
    } else if (j->dt == NB_F64) {
        dropout_f64(lo, hi, (double *)j->out + lo, j->mask ? (double *)j->mask + lo : NULL,
                    (const double *)j->x + lo, j->p, j->seed, j->offset);
    } else {
        float bx[BLOCK], by[BLOCK], bm[BLOCK];
        for (int64_t b = lo; b < hi; b += BLOCK) {
            int64_t len = hi - b < BLOCK ? hi - b : BLOCK;
            nb__f32_from_bf16_n(bx, (const uint16_t *)j->x + b, len);
            dropout_f32(b, b + len, by, j->mask ? bm : NULL, bx, j->p, j->seed, j->offset);
            nb__bf16_from_f32_n((uint16_t *)j->out + b, by, len);
            if (j->mask) nb__bf16_from_f32_n((uint16_t *)j->mask + b, bm, len);
        }
    }
}

/* On the pool in pieces of GRAIN elements (Note [Deterministic parallel
 * kernels] in tensor/cpu/threads.h: each element's value depends only on
 * its index). */
void nb__cpu_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p, uint64_t seed,
                     uint64_t offset) {
    bool half = nb__cpu_is_bf16(x);
    if (half && !(out->dtype == NB_BF16 && (!mask || mask->dtype == NB_BF16) &&
                  nb_is_contiguous(x) && nb_is_contiguous(out) && (!mask || nb_is_contiguous(mask)))) {
        nb__cpu_dropout_bf16(out, mask, x, p, seed, offset);
        return;
    }
    dropout_job j = {x->dtype, out->data, mask ? mask->data : NULL, x->data, p, seed, offset};
    nb__parallel_range(nb_numel(x), GRAIN, dropout_range, &j);
}
