/* Stand-in for the CUDA runtime header (dev/cuda_emu): the kernel model
 * (emu.h) and the few runtime calls our kernel files make; streams are
 * ignored, every call runs at once. */
#pragma once
#include "emu.h"
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef int cudaError_t;
#define cudaSuccess 0
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
inline cudaError_t cudaGetLastError() { return cudaSuccess; } /* emu_launch aborts on a bad launch */
inline const char *cudaGetErrorName(cudaError_t) { return "cuda_emu"; }
inline const char *cudaGetErrorString(cudaError_t) { return "cuda_emu"; }
inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t = 0) { memset(p, v, n); return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t = 0) {
    memmove(d, s, n);
    return cudaSuccess;
}
