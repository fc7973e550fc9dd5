/* Stand-in for cuda_bf16.h (dev/cuda_emu): our own bf16 conversions,
 * round to nearest even, NaN kept NaN. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
struct __nv_bfloat16 { uint16_t x; };
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) { /* NaN: keep it quiet */
        h.x = (uint16_t)((u >> 16) | 0x40);
        return h;
    }
    u += 0x7fffu + ((u >> 16) & 1); /* ties to even */
    h.x = (uint16_t)(u >> 16);
    return h;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
/* One rounding from double: pick the nearer of the two bf16 neighbours of
 * (float)d, measured in double (ties to even). */
inline __nv_bfloat16 __double2bfloat16(double d) {
    __nv_bfloat16 h;
    if (d != d) {
        h.x = 0x7fc0;
        return h;
    }
    float f = (float)d;
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) >= 0x7f800000u) {
        h.x = (uint16_t)(u >> 16);
        return h;
    }
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u; /* neighbours by magnitude */
    float fl, fh;
    memcpy(&fl, &lo, 4);
    memcpy(&fh, &hi, 4);
    double dl = fabs(d - (double)fl), dh = fabs((double)fh - d);
    uint32_t r = dl < dh ? lo : dh < dl ? hi : ((lo >> 16) & 1) ? hi : lo;
    h.x = (uint16_t)(r >> 16);
    return h;
}
