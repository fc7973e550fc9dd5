/* The CUDA execution model on the CPU, for dev/cuda_emu (README.md there).
 *
 * A launch runs its blocks one after another; each block runs one
 * std::thread per CUDA thread. __syncthreads is a barrier over the block;
 * a warp shuffle writes the value into the warp's exchange slots, waits on
 * the warp's barrier, reads the source lane's slot and waits again. Threads
 * that return early drop out of both barriers (as exited threads do on the
 * GPU). __shared__ variables become function statics: one copy, which is
 * right because only one block runs at a time. */
#pragma once
#include <barrier>
#include <functional>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
extern std::barrier<> *emu_block_bar;              /* the running block's barrier */
extern std::vector<std::barrier<> *> emu_warp_bar; /* one per warp of that block */
extern unsigned char emu_xchg[32][32][16];         /* [warp][lane] shuffle slots */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __constant__ static
#define __launch_bounds__(...)

/* Runs fn (the kernel call) for every thread of a grid (emu_rt.cpp). */
void emu_launch(dim3 grid, dim3 block, size_t smem, std::function<void()> fn);
/* What launch.py writes for `kernel<<<grid, block, smem, stream>>>(args)`. */
#define EMU_LAUNCH(g, b, sm, ...) emu_launch(dim3(g), dim3(b), (size_t)(sm), [&] { __VA_ARGS__; })

inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
inline unsigned emu_tid() {
    return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_bar[emu_tid() / 32]->arrive_and_wait(); }

/* Every live lane of the warp must take part (the mask is not modelled). */
template <class V> inline V emu_shfl(V v, int src_lane(int lane, int arg), int arg) {
    static_assert(sizeof(V) <= 16, "shuffle of a value over 16 bytes");
    unsigned tid = emu_tid(), w = tid / 32, lane = tid % 32;
    memcpy(emu_xchg[w][lane], &v, sizeof v);
    emu_warp_bar[w]->arrive_and_wait();
    V r;
    memcpy(&r, emu_xchg[w][src_lane((int)lane, arg)], sizeof r);
    emu_warp_bar[w]->arrive_and_wait();
    return r;
}
inline int emu_lane_xor(int l, int o) { return l ^ o; }
inline int emu_lane_down(int l, int o) { return l + o < 32 ? l + o : l; }
inline int emu_lane_up(int l, int o) { return l - o >= 0 ? l - o : l; }
inline int emu_lane_idx(int, int s) { return s & 31; }
template <class V> inline V __shfl_xor_sync(unsigned, V v, int o, int = 32) { return emu_shfl(v, emu_lane_xor, o); }
template <class V> inline V __shfl_down_sync(unsigned, V v, unsigned o, int = 32) { return emu_shfl(v, emu_lane_down, (int)o); }
template <class V> inline V __shfl_up_sync(unsigned, V v, unsigned o, int = 32) { return emu_shfl(v, emu_lane_up, (int)o); }
template <class V> inline V __shfl_sync(unsigned, V v, int s, int = 32) { return emu_shfl(v, emu_lane_idx, s); }

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <class T> inline T emu_cas(T *p, T cmp, T val) {
    __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp; /* the old value either way */
}
/* overloads, as CUDA has: arguments convert (an enum constant to int) */
inline int atomicCAS(int *p, int c, int v) { return emu_cas(p, c, v); }
inline unsigned atomicCAS(unsigned *p, unsigned c, unsigned v) { return emu_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long c, unsigned long long v) {
    return emu_cas(p, c, v);
}
template <class T> inline T atomicAdd(T *p, T v) {
    if constexpr (std::is_floating_point_v<T>) {
        T old = *p, sum; /* CAS loop: GCC has no atomic add for floating types */
        do sum = old + v;
        while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
        return old;
    } else {
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
    }
}

template <class T> inline T __ldg(const T *p) { return *p; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
/* The _rn operations: one IEEE rounding (the Makefile builds with
 * -ffp-contract=off, so no fused multiply-add is made behind our back). */
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return sqrt(a); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline double rsqrt(double a) { return 1.0 / sqrt(a); }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) double2 { double x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
