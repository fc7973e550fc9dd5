/* oneDNN on the CPU (tensor/cpu/dnnl.c): matmul (f32, and bf16 operands
 * with an f32 product) and 2-D convolution forward and backward (f32,
 * bf16), on the caller's buffers, with primitives cached by shape.
 *
 * Each nb__dnnl_* product returns false, having done nothing, when the
 * dispatch rule of Note [oneDNN dispatch] gives the op to OpenBLAS or our
 * kernels, when oneDNN is switched off (NABLA_DNNL=0, nb__dnnl_set_mode),
 * or when oneDNN has no fast implementation for it; the caller then runs
 * its own kernel (for bf16 operands, the f32 fallbacks of
 * tensor/cpu/matmul.c and conv.c: exact conversion to f32, OpenBLAS). */
#ifndef NABLA_TENSOR_CPU_DNNL_H
#define NABLA_TENSOR_CPU_DNNL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/tensor.h"
#include "tensor/cpu/conv.h"

typedef enum nb__dnnl_mode {
    NB_DNNL_OFF = 0,   /* never oneDNN */
    NB_DNNL_AUTO = 1,  /* the measured rule (default) */
    NB_DNNL_FORCE = 2, /* oneDNN wherever it has a fast implementation */
} nb__dnnl_mode;

/* The mode: NABLA_DNNL=0|1|2 in the environment, read on first use (any
 * other value aborts naming it), unless set here; -1 returns to the
 * environment's, read again. Returns the previous mode (the environment's
 * is read for it). */
nb__dnnl_mode nb__dnnl_set_mode(int mode);
nb__dnnl_mode nb__dnnl_mode_now(void);

/* oneDNN's thread count: n >= 1 here, or (n <= 0, the default)
 * OpenBLAS's (openblas_get_num_threads, read at each call), reduced to one
 * unless OMP_WAIT_POLICY=passive (Note [oneDNN dispatch]). */
void nb__dnnl_set_num_threads(int n);

/* Whether the CPU has native bf16 dot products (AVX512_BF16 or AMX) as
 * oneDNN sees them (ONEDNN_MAX_CPU_ISA can lower what it sees): the rule
 * gives bf16 products to oneDNN only then; and whether oneDNN 2.6 has
 * bf16 kernels at all (AVX-512 core: emulated below AVX512_BF16), which
 * a forced mode uses; without them bf16 products take the f32 fallbacks. */
bool nb__dnnl_native_bf16(void);
bool nb__dnnl_bf16_kernels(void);

/* Primitives created so far (cache misses, including keys found not
 * supported), cached lookups that found one, and primitives executed: for
 * tests of the cache and of which path ran. */
int64_t nb__dnnl_primitives_created(void);
int64_t nb__dnnl_cache_hits(void);
int64_t nb__dnnl_executions(void);
/* Blocks whose rows of op(A) were copied first (Note [Packed blocks of a
 * transposed A] in tensor/cpu/dnnl.c), since the process began. */
int64_t nb__dnnl_packed_blocks(void);

/* out (L, M, N) contiguous f32 = op(a) @ op(b) as nb__cpu_gemm
 * (tensor/cpu/matmul.h), a and b both f32 or both bf16, + bias (N, f32)
 * when not NULL, GELU(tanh) of the whole when gelu, + out's previous
 * contents first when accumulate. With a and b bf16, out may be bf16 (not
 * accumulate): the same f32 sums, bias and GELU, each output rounded once
 * to nearest even as it is stored. */
bool nb__dnnl_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                     bool trans_b, const nb_tensor *bias, bool gelu, bool accumulate);

/* nb__cpu_conv2d_forward_cols / _backward (tensor/cpu/conv.h) for dt f32 or
 * bf16 (every buffer of that dtype). */
bool nb__dnnl_conv2d_forward(nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                             const void *w, const void *b);
bool nb__dnnl_conv2d_backward(nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw,
                              void *db, const void *gout, const void *x, const void *w);

/* Row-major f32 C (m, n) = alpha op(A) op(B) + beta C, leading dimensions
 * lda, ldb, ldc, on oneDNN's GEMM (dnnl_sgemm: JIT kernels chosen by
 * instruction set when it runs), for the GEMMs of the f32 im2col
 * convolution in tensor/cpu/conv.c where Note [oneDNN dispatch] sends them
 * there (OpenBLAS on a generic core; every GEMM under NABLA_DNNL=2). */
bool nb__dnnl_conv_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                        float *c, int64_t ldc);

/* Appends to buf (snprintf's way: returns the length the whole text
 * needs) oneDNN's version, instruction set and threads, and one line per
 * kind of product (f32, bf16, f64 matmul; f32, bf16 conv2d) naming the
 * library, its instruction set and thread count that the rule picks now:
 * the first library named is the one a large product takes (for
 * nb_config_string, include/nabla/config.h). */
size_t nb__dnnl_describe(char *buf, size_t cap);

#endif
