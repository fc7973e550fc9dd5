/* What this build and this machine compute with: which library and which
 * instruction set each kind of product uses on the CPU, and on how many
 * threads (as torch.__config__.show() does for PyTorch). The bundled
 * programs print it with --info. */
#ifndef NABLA_CONFIG_H
#define NABLA_CONFIG_H

#include "nabla/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A text of "key: value" lines, for people first: nabla's version; the
 * CPU (name, the widest vector instruction set it and the OS allow);
 * OpenBLAS (its configuration, the core it runs and that core's
 * instruction set, threads); oneDNN (version, instruction set, threads);
 * nabla's thread pool (size and where it came from); then one line per
 * kind of product ("f32 matmul: ", "f32 conv2d: ", "bf16 matmul: ",
 * "bf16 conv2d: ", "f64 matmul: ", "f32 attention: "), whose first words
 * are the library a large product takes now and its instruction set
 * ("f32 matmul: onednn avx512_core (2 threads) ..."). When OpenBLAS runs a
 * generic core on a CPU with AVX2 or AVX-512 (it does not know the
 * model), one line starting "note: " says so and what nabla does
 * instead (docs/threads.md). The text reflects the thread counts and
 * switches in force when it is called; it lives in a buffer of the
 * calling thread, valid until that thread's next call. */
NB_API const char *nb_config_string(void);

#ifdef __cplusplus
}
#endif

#endif
