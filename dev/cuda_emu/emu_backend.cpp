/* What drv_profile needs besides the kernels to run the front end over the
 * real CUDA table (tensor/cuda/backend.c): the rest of tensor/cuda/
 * runtime.cu, on host memory (streams and events ignored, every copy done
 * at once). */
#include <stdlib.h>
#include <string.h>

#include "tensor/cuda/cuda.h"

extern "C" {
void nb__cuda_sync(int device) { nb__cuda_profile_resolve(device); }
void *nb__cuda_malloc(int, size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64); }
void nb__cuda_free(int, void *p) { free(p); }
void *nb__cuda_host_alloc(size_t bytes) { return malloc(bytes ? bytes : 1); }
void nb__cuda_host_free(void *p) { free(p); }
nb__stream nb__cuda_copy_stream(int) { return nullptr; }
nb__event nb__cuda_event_new(int) { return nullptr; }
void nb__cuda_event_free(nb__event) {}
void nb__cuda_event_record(nb__event, nb__stream) {}
void nb__cuda_stream_wait(nb__stream, nb__event) {}
void nb__cuda_event_wait(nb__event) {}
void nb__cuda_memset(int, void *dst, int byte, size_t bytes) { memset(dst, byte, bytes); }
void nb__cuda_memcpy_d2d(int, void *dst, const void *src, size_t bytes) { memmove(dst, src, bytes); }
void nb__cuda_memcpy_h2d(int, void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
void nb__cuda_memcpy_d2h(int, void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
void nb__cuda_memcpy_h2d_async(int, void *dst, const void *src, size_t bytes, nb__stream) {
    memcpy(dst, src, bytes);
}
}
