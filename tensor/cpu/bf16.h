/* bf16 <-> f32 conversions for the CPU kernels: inline and branch-free, so
 * that loops over contiguous runs vectorise; the same values as
 * nb_f32_to_bf16 / nb_bf16_to_f32 (round to nearest even, a NaN stays a
 * quiet NaN). */
#ifndef NABLA_TENSOR_CPU_BF16_H
#define NABLA_TENSOR_CPU_BF16_H

#include <stdint.h>
#include <string.h>

#include "tensor/cpu/simd.h"

static inline uint16_t nb__bf16_of_f32(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float nb__f32_of_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Contiguous runs, in AVX2's width where there is one (integer
 * operations: the same bits in both clones; Note [Vector width]). */
NB_CPU_CLONES __attribute__((unused)) static void nb__bf16_from_f32_n(uint16_t *restrict dst,
                                                                     const float *restrict src,
                                                                     int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = nb__bf16_of_f32(src[i]);
}

NB_CPU_CLONES __attribute__((unused)) static void nb__f32_from_bf16_n(float *restrict dst,
                                                                     const uint16_t *restrict src,
                                                                     int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = nb__f32_of_bf16(src[i]);
}

/* dst[i] += src[i] as a separate bf16 add would: src rounded to bf16,
 * added to dst in f32, the sum rounded (an output added into in place:
 * NB__LN_ADD_DX, tensor/backend.h) */
NB_CPU_CLONES __attribute__((unused)) static void nb__bf16_add_rounded_n(uint16_t *restrict dst,
                                                                        const float *restrict src,
                                                                        int64_t n) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = nb__bf16_of_f32(nb__f32_of_bf16(dst[i]) + nb__f32_of_bf16(nb__bf16_of_f32(src[i])));
}

/* ---- bf16 activations (Note [bf16 activations on the CPU] in
 * tensor/cpu/bf16.c): the entries of the compute-dtype table that take
 * bf16 tensors widen them to f32 twins, run their f32 kernel and round
 * the outputs once. Each is called by its entry when a tensor it is given
 * is bf16. ---- */
#include "tensor/cpu/cpu.h"

void nb__cpu_unary_bf16(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s);
void nb__cpu_binary_bf16(nb__binary_op op, nb_tensor *out, const nb_tensor *a,
                         const nb_tensor *b);
void nb__cpu_matmul_bf16_out(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool ta,
                             bool tb, const nb_tensor *bias, bool gelu, nb_tensor *pre,
                             const nb_tensor *dgelu_pre);
nb__backend_gelu_tanh_backward_fn nb__cpu_gelu_tanh_backward_bf16;
nb__backend_softmax_fn nb__cpu_softmax_bf16;
nb__backend_softmax_backward_fn nb__cpu_softmax_backward_bf16;
nb__backend_softmax_causal_fn nb__cpu_softmax_causal_bf16;
nb__backend_softmax_causal_backward_fn nb__cpu_softmax_causal_backward_bf16;
nb__backend_causal_attention_fn nb__cpu_causal_attention_bf16;
nb__backend_causal_attention_backward_fn nb__cpu_causal_attention_backward_bf16;
nb__backend_layer_norm_fn nb__cpu_layer_norm_bf16;
nb__backend_layer_norm_backward_fn nb__cpu_layer_norm_backward_bf16;
nb__backend_cross_entropy_fn nb__cpu_cross_entropy_bf16;
nb__backend_cross_entropy_backward_fn nb__cpu_cross_entropy_backward_bf16;
nb__backend_dropout_fn nb__cpu_dropout_bf16;
nb__backend_sum_rows_fn nb__cpu_sum_rows_bf16;
nb__backend_max_rows_fn nb__cpu_max_rows_bf16;
nb__backend_argmax_rows_fn nb__cpu_argmax_rows_bf16;
nb__backend_var_rows_fn nb__cpu_var_rows_bf16;

/* GELU's gradient on bf16 dx, g and pre without twins, when they are
 * contiguous (Note [bf16 elementwise in blocks] in
 * tensor/cpu/elementwise.c); false, having done nothing, otherwise. */
bool nb__cpu_gelu_tanh_backward_blocks(nb_tensor *dx, const nb_tensor *g, const nb_tensor *pre);

static inline bool nb__cpu_is_bf16(const nb_tensor *t) { return t && t->dtype == NB_BF16; }

#endif
