/* Stand-in for the CUDA runtime header (dev/cuda_emu): the kernel model
 * (emu.h) and the few runtime calls our kernel files make; streams are
 * ignored, every call runs at once.
 * Events are a count-based stand-in for a clock: an event records how many
 * kernels the emulator had launched (emu_launches, emu_rt.cpp), and the
 * "elapsed time" between two is that difference at 1 us per launch (what
 * tensor/cuda/profile.cu reads is a count, not a time). */
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
extern long emu_launches;
struct CUevent_st {
    long launches;
};
#define cudaEventDefault 0u
#define cudaEventDisableTiming 2u
inline cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new CUevent_st{0};
    return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = 0) {
    e->launches = emu_launches;
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)(b->launches - a->launches) / 1000.0f;
    return cudaSuccess;
}
