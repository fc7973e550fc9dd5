/* Element types for the CUDA kernels (.cu files only): the storage types,
 * the type each computes in (f32 for bf16 and f16, else itself), loads and
 * stores between them, and the host-side switch from an nb_dtype to a
 * kernel instantiation. Everything here is static or a template, so each
 * .cu file gets its own copy and nothing clashes at link time. */
#ifndef NABLA_TENSOR_CUDA_TYPES_CUH
#define NABLA_TENSOR_CUDA_TYPES_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"

typedef __nv_bfloat16 bf16;
typedef __half f16;

#define FULL_MASK 0xffffffffu
#define MAX_BLOCKS 65535 /* the grid sizes we launch stay in gridDim.y/z's range too */

template <class T> struct math_of { typedef T type; };
template <> struct math_of<bf16> { typedef float type; };
template <> struct math_of<f16> { typedef float type; };
template <class T> using math_t = typename math_of<T>::type;

/* A value carrying a type, for the generic lambdas of by_float_dtype. */
template <class T> struct tag { typedef T type; };

template <class T> static __device__ __forceinline__ T to_math(T v) { return v; }
static __device__ __forceinline__ float to_math(bf16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ float to_math(f16 v) { return __half2float(v); }

template <class T, class M> static __device__ __forceinline__ T store_as(M v) {
    if constexpr (std::is_same_v<T, bf16>) return __float2bfloat16_rn((float)v);
    else if constexpr (std::is_same_v<T, f16>) return __float2half_rn((float)v);
    else return (T)v;
}

/* *p = v rounded to p's storage type. */
template <class T, class M> static __device__ __forceinline__ void put(T *p, M v) {
    *p = store_as<T>(v);
}

/* Element i of a float tensor of any dtype, as a double. */
static __device__ __forceinline__ double load_f64(const void *p, int64_t i, int dt) {
    switch (dt) {
    case NB_F32: return ((const float *)p)[i];
    case NB_F64: return ((const double *)p)[i];
    case NB_BF16: return __bfloat162float(((const bf16 *)p)[i]);
    default: return __half2float(((const f16 *)p)[i]);
    }
}

/* Element i of a float tensor of any dtype = v, rounded to its dtype. */
static __device__ __forceinline__ void store_f64(void *p, int64_t i, int dt, double v) {
    switch (dt) {
    case NB_F32: put((float *)p + i, v); break;
    case NB_F64: put((double *)p + i, v); break;
    case NB_BF16: put((bf16 *)p + i, v); break;
    default: put((f16 *)p + i, v); break;
    }
}

/* Calls fn(tag<T>{}) for the storage type T of the float dtype dt. */
template <class Fn> static void by_float_dtype(const char *op, nb_dtype dt, Fn fn) {
    switch (dt) {
    case NB_F32: fn(tag<float>{}); return;
    case NB_F64: fn(tag<double>{}); return;
    case NB_BF16: fn(tag<bf16>{}); return;
    case NB_F16: fn(tag<f16>{}); return;
    default: break;
    }
    NB_ABORT("%s: dtype %s has no CUDA kernel", op, nb_dtype_name(dt));
}

/* Calls fn(tag<U>{}) for the unsigned integer U of dt's size, for kernels
 * that move elements without looking at them. */
template <class Fn> static void by_dtype_bits(nb_dtype dt, Fn fn) {
    switch (nb_dtype_size(dt)) {
    case 2: fn(tag<uint16_t>{}); return;
    case 4: fn(tag<uint32_t>{}); return;
    default: fn(tag<uint64_t>{}); return;
    }
}

/* launch<T>(...) for the storage type T of the float dtype dt: by_float_dtype
 * for a launcher templated on T alone. */
#define BY_FLOAT_DTYPE(op, dt, launch, ...)                                                    \
    by_float_dtype(op, dt, [&](auto t_) { launch<typename decltype(t_)::type>(__VA_ARGS__); })

#endif
