/* dtype facts and the bf16/f16 conversions (round to nearest even). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/dtype.h"
#include "nabla/error.h"

static const struct {
    const char *name;
    size_t size;
    bool is_float;
} dtype_info[NB_DTYPE_COUNT] = {
    [NB_F32] = {"f32", 4, true},  [NB_F64] = {"f64", 8, true},  [NB_BF16] = {"bf16", 2, true},
    [NB_F16] = {"f16", 2, true},  [NB_I32] = {"i32", 4, false}, [NB_I64] = {"i64", 8, false},
};

static void check_dtype(nb_dtype d) {
    NB_CHECK((unsigned)d < NB_DTYPE_COUNT, "invalid dtype value %d", (int)d);
}

size_t nb_dtype_size(nb_dtype d) { check_dtype(d); return dtype_info[d].size; }
const char *nb_dtype_name(nb_dtype d) {
    if ((unsigned)d >= NB_DTYPE_COUNT) return "invalid-dtype";
    return dtype_info[d].name;
}
bool nb_dtype_is_float(nb_dtype d) { check_dtype(d); return dtype_info[d].is_float; }

const char *nb_device_name(nb_device device) {
    static _Thread_local char bufs[4][32];
    static _Thread_local unsigned next;
    if (device.type == NB_DEVICE_CPU) return "cpu";
    char *buf = bufs[next++ & 3];
    if (device.type == NB_DEVICE_META)
        snprintf(buf, sizeof bufs[0], "meta:%s",
                 device.index == NB_DEVICE_CPU    ? "cpu"
                 : device.index == NB_DEVICE_CUDA ? "cuda"
                                                  : "?");
    else snprintf(buf, sizeof bufs[0], "cuda:%d", device.index);
    return buf;
}

nb_status nb_device_parse(const char *name, nb_device *out) {
    char *end = NULL;
    if (name && !strcmp(name, "cpu")) *out = nb_cpu();
    else if (name && !strcmp(name, "cuda")) *out = nb_cuda(0);
    else if (name && !strcmp(name, "meta:cpu")) *out = nb_meta(NB_DEVICE_CPU);
    else if (name && !strcmp(name, "meta:cuda")) *out = nb_meta(NB_DEVICE_CUDA);
    else if (name && !strncmp(name, "cuda:", 5) && name[5] >= '0' && name[5] <= '9' &&
             (strtol(name + 5, &end, 10), *end == 0) && end - (name + 5) < 9)
        *out = nb_cuda((int)strtol(name + 5, NULL, 10));
    else
        return nb_set_error(NB_ERR_INVALID,
                            "nb_device_parse: '%s' is not a device (cpu, cuda, cuda:N, meta:cpu, "
                            "meta:cuda)",
                            name ? name : "(null)");
    return NB_OK;
}

static uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

uint16_t nb_f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + rounding) >> 16);
}

float nb_bf16_to_f32(uint16_t x) { return bits_f32((uint32_t)x << 16); }

uint16_t nb_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
    if (absu >= 0x477ff000u) {                                  /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (absu < 0x38800000u) { /* below the smallest normal half (2^-14): subnormal or zero */
        /* value = absf; subnormal unit is 2^-24. Round to nearest even. */
        float absf = bits_f32(absu);
        float scaled = absf * 16777216.0f; /* / 2^-24, exact in float */
        float r = nearbyintf(scaled);      /* default rounding mode: nearest even */
        return (uint16_t)(sign | (uint32_t)r);
    }
    uint32_t exp = ((absu >> 23) - 127 + 15);
    uint32_t mant = absu & 0x7fffffu;
    uint32_t half = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
}

float nb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)mant * (1.0f / 16777216.0f); /* mant * 2^-24 */
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}
