/* CPU features by cpuid and OpenBLAS's core by name (tensor/cpu/cpuinfo.h,
 * Note [BLAS that does not know the CPU]). */
#include "tensor/cpu/cpuinfo.h"

#include <cblas.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define HAVE_CPUID 1
#else
#define HAVE_CPUID 0
#endif

static nb__cpu_features features;
static pthread_once_t features_once = PTHREAD_ONCE_INIT;

#if HAVE_CPUID
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

static void read_features(void) {
    nb__cpu_features *f = &features;
#if HAVE_CPUID
    unsigned a, b, c, d, max;
    if (!__get_cpuid(0, &max, &b, &c, &d)) return;
    memcpy(f->vendor, &b, 4);
    memcpy(f->vendor + 4, &d, 4);
    memcpy(f->vendor + 8, &c, 4);
    unsigned ext = __get_cpuid_max(0x80000000u, NULL);
    if (ext >= 0x80000004u) {
        unsigned r[12];
        for (unsigned i = 0; i < 3; i++)
            __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        char raw[49];
        memcpy(raw, r, 48);
        raw[48] = 0;
        const char *s = raw;
        while (*s == ' ') s++;
        size_t n = strlen(s);
        while (n && s[n - 1] == ' ') n--;
        memcpy(f->brand, s, n);
        f->brand[n] = 0;
    }
    __get_cpuid(1, &a, &b, &c, &d);
    bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12);
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    bool ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6, tiles = (xcr0 & 0x60000) == 0x60000;
    f->avx = avx && ymm;
    f->fma = fma && f->avx;
    if (max < 7) return;
    __cpuid_count(7, 0, a, b, c, d);
    f->avx2 = f->avx && (b & (1u << 5));
    /* AVX-512 F (16), DQ (17), BW (30), VL (31) */
    uint32_t core = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    f->avx512 = zmm && (b & core) == core;
    f->amx = tiles && (d & (1u << 22)) && (d & (1u << 24)); /* AMX-BF16, AMX-TILE */
    unsigned a1 = 0, b1, c1, d1;
    if (a >= 1) __cpuid_count(7, 1, a1, b1, c1, d1);
    f->avx512_bf16 = f->avx512 && (a1 & (1u << 5));
#else
    (void)f;
#endif
}

const nb__cpu_features *nb__cpu_features_get(void) {
    pthread_once(&features_once, read_features);
    return &features;
}

nb__isa nb__cpu_isa(void) {
    const nb__cpu_features *f = nb__cpu_features_get();
    if (f->avx512 && f->avx2 && f->fma) return NB_ISA_AVX512;
    if (f->avx2 && f->fma) return NB_ISA_AVX2;
    if (f->avx) return NB_ISA_AVX;
    return NB_ISA_SSE;
}

const char *nb__isa_name(nb__isa isa) {
    static const char *names[] = {"sse", "avx", "avx2", "avx512"};
    return isa >= NB_ISA_SSE && isa <= NB_ISA_AVX512 ? names[isa] : "?";
}

/* OpenBLAS's x86-64 cores (driver/others/dynamic.c's names; a build for one
 * target names it in capitals) by the instruction set of their kernels. */
static const struct {
    const char *name;
    nb__isa isa;
} cores[] = {
    {"Katmai", NB_ISA_SSE},        {"Coppermine", NB_ISA_SSE},  {"Northwood", NB_ISA_SSE},
    {"Prescott", NB_ISA_SSE},      {"Banias", NB_ISA_SSE},      {"Atom", NB_ISA_SSE},
    {"Core2", NB_ISA_SSE},         {"Penryn", NB_ISA_SSE},      {"Dunnington", NB_ISA_SSE},
    {"Nehalem", NB_ISA_SSE},       {"Athlon", NB_ISA_SSE},      {"Opteron", NB_ISA_SSE},
    {"Opteron_SSE3", NB_ISA_SSE},  {"Barcelona", NB_ISA_SSE},   {"Nano", NB_ISA_SSE},
    {"Bobcat", NB_ISA_SSE},        {"Generic", NB_ISA_SSE},     {"Unknown", NB_ISA_SSE},
    {"Sandybridge", NB_ISA_AVX},   {"Bulldozer", NB_ISA_AVX},   {"Piledriver", NB_ISA_AVX},
    {"Steamroller", NB_ISA_AVX},   {"Haswell", NB_ISA_AVX2},    {"Excavator", NB_ISA_AVX2},
    {"Zen", NB_ISA_AVX2},          {"SkylakeX", NB_ISA_AVX512}, {"Cooperlake", NB_ISA_AVX512},
    {"SapphireRapids", NB_ISA_AVX512},
};

int nb__blas_core_isa(const char *core) {
    if (!core) return -1;
    for (size_t i = 0; i < sizeof cores / sizeof cores[0]; i++)
        if (!strcasecmp(core, cores[i].name)) return (int)cores[i].isa;
    return -1;
}

const char *nb__blas_core(void) {
    const char *s = openblas_get_corename();
    return s ? s : "";
}

const char *nb__blas_config(void) {
    const char *s = openblas_get_config();
    return s ? s : "";
}

static bool generic;
static pthread_once_t generic_once = PTHREAD_ONCE_INIT;

static void read_generic(void) {
    int core = nb__blas_core_isa(nb__blas_core());
    generic = core >= 0 && core < NB_ISA_AVX2 && nb__cpu_isa() >= NB_ISA_AVX2;
}

bool nb__blas_generic(void) {
    pthread_once(&generic_once, read_generic);
    return generic;
}
