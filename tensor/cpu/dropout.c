/* The CPU backend's dropout (tensor/backend.h; the mask's stream is
 * described in tensor/ops_dropout.c): x, out, mask contiguous f32 or f64. */
#include "tensor/cpu/bf16.h"
#include "tensor/cpu/cpu.h"

#define DEFINE_DROPOUT(T, S)                                                                  \
    static void dropout_##S(int64_t n, T *out, T *mask, const T *x, double p, uint64_t seed,  \
                            uint64_t offset) {                                                \
        T scale = p < 1 ? (T)(1.0 / (1.0 - p)) : (T)0;                                        \
        uint32_t r[4];                                                                        \
        for (int64_t i = 0; i < n; i++) {                                                     \
            if ((i & 3) == 0) nb_philox4x32(seed, offset + (uint64_t)i / 4, r);               \
            T m = (double)nb_u32_to_unit(r[i & 3]) >= p ? scale : (T)0;                       \
            out[i] = x[i] * m;                                                                \
            if (mask) mask[i] = m;                                                            \
        }                                                                                     \
    }

DEFINE_DROPOUT(float, f32)
DEFINE_DROPOUT(double, f64)

void nb__cpu_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p, uint64_t seed,
                     uint64_t offset) {
    if (nb__cpu_is_bf16(x)) {
        nb__cpu_dropout_bf16(out, mask, x, p, seed, offset);
        return;
    }
    int64_t n = nb_numel(x);
    void *m = mask ? mask->data : NULL;
    if (x->dtype == NB_F32) dropout_f32(n, out->data, m, x->data, p, seed, offset);
    else dropout_f64(n, out->data, m, x->data, p, seed, offset);
}
