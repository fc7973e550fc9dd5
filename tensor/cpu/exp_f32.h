/* A vectorisable f32 exp shared by the CPU kernels (elementwise GELU,
 * causal softmax). */
#ifndef NABLA_TENSOR_CPU_EXP_F32_H
#define NABLA_TENSOR_CPU_EXP_F32_H

#include <stdint.h>

/* exp(x) for f32 without a libm call, so that loops using it vectorise:
 * x = n ln2 + r with n = round(x / ln2) (the 1.5 * 2^23 trick rounds to
 * nearest), ln2 split in two parts for an exact r, exp(r) from the degree-6
 * polynomial of the Cephes expf (relative error ~1e-7 on |r| <= ln2/2), and
 * 2^n built in the exponent bits. Inputs are clamped to where 2^n is a
 * normal float, so the result saturates instead of overflowing. */
static inline float nb__exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {((int32_t)n + 127) << 23};
    return e * scale.f;
}

#endif
