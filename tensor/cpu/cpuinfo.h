/* What the CPU can do and what OpenBLAS will run on it (tensor/cpu/cpuinfo.c).
 *
 * Note [BLAS that does not know the CPU]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * OpenBLAS picks its kernels (a "core") once, when it loads, from the CPU
 * model it recognises. A CPU newer than the OpenBLAS build is not
 * recognised and gets a generic core: Debian's 0.3.21 runs "Prescott"
 * (SSE3) on a Xeon with AVX-512 and AMX, and its f32 products are about 3x
 * slower than with the SkylakeX core the same library has. A user cannot
 * be expected to know OPENBLAS_CORETYPE, and setting it from here is too
 * late: OpenBLAS reads it in its own constructor, which runs before
 * libnabla's (libnabla depends on it), so the core is chosen before any
 * nabla code runs.
 *
 * So nabla asks both sides: what the CPU can do (cpuid, with the OS's
 * consent to the wide registers: xgetbv), and which core OpenBLAS runs
 * (openblas_get_corename). When the core's kernels are older than AVX2 on
 * a CPU with AVX2 and FMA, OpenBLAS is "generic" here and the f32
 * products and convolutions go to oneDNN, which chooses its kernels by
 * instruction set at run time (Note [oneDNN dispatch] in
 * tensor/cpu/dnnl.c), at every thread count. A core with AVX2 kernels on
 * an AVX-512 CPU (an OpenBLAS without SkylakeX) is reported but not
 * overridden: it is within the usual spread of the two libraries.
 * nb_config_string() (include/nabla/config.h) says what was found and
 * which library and instruction set each kind of product uses. */
#ifndef NABLA_TENSOR_CPU_CPUINFO_H
#define NABLA_TENSOR_CPU_CPUINFO_H

#include <stdbool.h>

/* Vector instruction sets, each including those below it. */
typedef enum nb__isa {
    NB_ISA_SSE = 0,  /* SSE2/SSE3: the x86-64 baseline, or not x86 */
    NB_ISA_AVX = 1,  /* AVX (Sandy Bridge, Bulldozer) */
    NB_ISA_AVX2 = 2, /* AVX2 and FMA */
    NB_ISA_AVX512 = 3, /* AVX-512 F, BW, VL, DQ (Skylake-SP and later, Zen 4) */
} nb__isa;

typedef struct nb__cpu_features {
    char vendor[13];
    char brand[49];  /* the processor's name, trimmed; "" where cpuid has none */
    bool avx, avx2, fma, avx512, avx512_bf16, amx; /* usable: the OS saves the registers */
} nb__cpu_features;

/* The CPU's features (cpuid, read once). */
const nb__cpu_features *nb__cpu_features_get(void);

/* The widest of nb__isa that the CPU and the OS allow. */
nb__isa nb__cpu_isa(void);

/* "sse", "avx", "avx2", "avx512" */
const char *nb__isa_name(nb__isa isa);

/* OpenBLAS's core (openblas_get_corename: "Zen", "SkylakeX", "Prescott"),
 * its configuration line (openblas_get_config), and the instruction set
 * of a core's kernels by name (case ignored); -1 for a name this table
 * does not know, which is never taken as generic. */
const char *nb__blas_core(void);
const char *nb__blas_config(void);
int nb__blas_core_isa(const char *core);

/* Whether OpenBLAS runs a core older than AVX2 on a CPU with AVX2 and FMA
 * (Note [BLAS that does not know the CPU]); read once. */
bool nb__blas_generic(void);

#endif
