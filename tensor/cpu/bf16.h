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

#endif
