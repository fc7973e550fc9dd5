/* Stand-in for cuda_fp16.h (dev/cuda_emu): the compiler's _Float16,
 * whose conversions round to nearest even. */
#pragma once
struct __half { _Float16 x; };
inline float __half2float(__half h) { return (float)h.x; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __double2half(double d) { return __half{(_Float16)d}; }
