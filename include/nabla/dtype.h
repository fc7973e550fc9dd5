/* Element types and devices. bf16 and f16 are storage types on the CPU:
 * they can be created, cast and copied, and math on them needs a cast to f32
 * (CUDA computes on them directly), except for bf16 in the ops of the
 * compute-dtype table in a context whose compute dtype is bf16
 * (nb_ctx_set_compute_dtype). */
#ifndef NABLA_DTYPE_H
#define NABLA_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/api.h"
#include "nabla/error.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum nb_dtype {
    NB_F32 = 0,
    NB_F64,
    NB_BF16,
    NB_F16,
    NB_I32,
    NB_I64,
    NB_DTYPE_COUNT
} nb_dtype;

NB_API size_t nb_dtype_size(nb_dtype dtype);
NB_API const char *nb_dtype_name(nb_dtype dtype); /* "f32", "bf16", ... */
NB_API bool nb_dtype_is_float(nb_dtype dtype);    /* f32, f64, bf16, f16 */

/* Round-to-nearest-even conversions; NaN stays NaN, overflow gives inf. */
NB_API uint16_t nb_f32_to_bf16(float x);
NB_API float nb_bf16_to_f32(uint16_t x);
NB_API uint16_t nb_f32_to_f16(float x);
NB_API float nb_f16_to_f32(uint16_t x);

/* NB_DEVICE_META: the meta device (nabla/meta.h), which computes nothing
 * and counts what another device's backend would do: its index is that
 * device's type (nb_meta(NB_DEVICE_CUDA) is "meta:cuda"). */
typedef enum nb_device_type {
    NB_DEVICE_CPU = 0,
    NB_DEVICE_CUDA = 1,
    NB_DEVICE_META = 2
} nb_device_type;

typedef struct nb_device {
    nb_device_type type;
    int index; /* CUDA ordinal; 0 for the CPU; the device type a meta device stands for */
} nb_device;

static inline nb_device nb_cpu(void) { nb_device d = {NB_DEVICE_CPU, 0}; return d; }
static inline nb_device nb_cuda(int index) { nb_device d = {NB_DEVICE_CUDA, index}; return d; }
static inline nb_device nb_meta(nb_device_type of) {
    nb_device d = {NB_DEVICE_META, (int)of};
    return d;
}
static inline bool nb_device_eq(nb_device a, nb_device b) {
    return a.type == b.type && a.index == b.index;
}
/* "cpu", "cuda:1" or "meta:cuda", in a thread-local buffer (four in
 * rotation, so a few calls can share one printf). */
NB_API const char *nb_device_name(nb_device device);
/* The device a name names: "cpu", "cuda" (cuda:0), "cuda:N", "meta:cpu",
 * "meta:cuda"; NB_ERR_INVALID with a message naming the text otherwise.
 * Whether the device exists is a separate question (nb_ctx_new). */
NB_API nb_status nb_device_parse(const char *name, nb_device *out);

#ifdef __cplusplus
}
#endif
#endif
