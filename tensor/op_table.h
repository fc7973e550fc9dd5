/* The elementwise op families: one table per family and each op's formula,
 * written once for the C compiler (CPU kernels) and nvcc (CUDA kernels).
 *
 * Note [Op tables]
 * A table row X(ENUM, formula, "name") gives, in one place:
 *  - the enum value NB_U_ENUM / NB_B_ENUM (tensor/internal.h),
 *  - the name in messages, nb__unary_name / nb__binary_name
 *    (tensor/ops_elementwise.c, checked at compile time to have one entry
 *    per enum value),
 *  - the CPU kernel's case (tensor/cpu/elementwise.c) and the CUDA
 *    kernel's case (tensor/cuda/elementwise.cu), both calling the formula
 *    nb__f_<formula>_<type> defined below.
 * The formulas are instantiated per compute type by a generator macro:
 * f32 and f64 for unary ops (bf16 and f16 compute in f32 on CUDA), and
 * f32, f64, i32 and i64 for binary ops. A unary formula takes (x, s), s
 * being the op's scalar (POW, ADD_S, MUL_S; ignored by the others). The
 * math functions are the C library's for each type (expf for f32, exp for
 * f64), which CUDA provides on the device too; the one exception is the
 * tanh inside GELU_TANH and its gradient, a parameter of the generator, so
 * that the CPU's f32 kernel can use its vectorisable tanh
 * (tensor/cpu/elementwise.c) while everything else uses tanh/tanhf.
 * Adding an op: a row here, its formula in the generator, and a front end
 * in tensor/ops_elementwise.c; the kernels need no change. */
#ifndef NABLA_TENSOR_OP_TABLE_H
#define NABLA_TENSOR_OP_TABLE_H

#include <math.h>
#include <stdint.h>

/* X(ENUM, formula, "name in messages") */
#define NB_UNARY_OPS(X)                                                                     \
    X(NEG, neg, "nb_neg")                                                                   \
    X(EXP, exp, "nb_exp")                                                                   \
    X(LOG, log, "nb_log")                                                                   \
    X(SQRT, sqrt, "nb_sqrt")                                                                \
    X(RSQRT, rsqrt, "nb_rsqrt")                                                             \
    X(ABS, abs, "nb_abs")                                                                   \
    X(TANH, tanh, "nb_tanh")                                                                \
    X(SIGMOID, sigmoid, "nb_sigmoid")                                                       \
    X(RELU, relu, "nb_relu")                                                                \
    X(GELU, gelu, "nb_gelu")                                                                \
    X(GELU_TANH, gelu_tanh, "nb_gelu")                                                      \
    X(POW, pow, "nb_pow")                                                                   \
    X(ADD_S, add_s, "nb_add_scalar")                                                        \
    X(MUL_S, mul_s, "nb_mul_scalar")                                                        \
    X(SIGN, sign, "sign")                                                                   \
    X(RELU_MASK, relu_mask, "relu backward")                                                \
    X(GELU_GRAD, gelu_grad, "nb_gelu backward")                                             \
    X(GELU_TANH_GRAD, gelu_tanh_grad, "nb_gelu backward")                                   \
    X(RECIP, recip, "reciprocal")

#define NB_BINARY_OPS(X)                                                                    \
    X(ADD, add, "nb_add")                                                                   \
    X(SUB, sub, "nb_sub")                                                                   \
    X(MUL, mul, "nb_mul")                                                                   \
    X(DIV, div, "nb_div")

/* static inline, and callable from host and device code under nvcc */
#ifdef __CUDACC__
#define NB_HD static __host__ __device__ __forceinline__
#else
#define NB_HD static inline
#endif

#define NB_SQRT_2_OVER_PI 0.7978845608028654
#define NB_INV_SQRT_2 0.7071067811865476
#define NB_INV_SQRT_2PI 0.3989422804014327

/* Unary formulas for compute type T, named nb__f_<formula>_<S>; M is the
 * C library's suffix for T (f for float, empty for double), GTANH the tanh
 * of GELU_TANH and its gradient. */
#define NB__UNARY_FORMULAS(T, S, M, GTANH)                                                  \
    NB_HD T nb__f_neg_##S(T x, T s) { return -x; }                                          \
    NB_HD T nb__f_exp_##S(T x, T s) { return exp##M(x); }                                   \
    NB_HD T nb__f_log_##S(T x, T s) { return log##M(x); }                                   \
    NB_HD T nb__f_sqrt_##S(T x, T s) { return sqrt##M(x); }                                 \
    NB_HD T nb__f_rsqrt_##S(T x, T s) { return (T)1 / sqrt##M(x); }                         \
    NB_HD T nb__f_recip_##S(T x, T s) { return (T)1 / x; }                                  \
    NB_HD T nb__f_abs_##S(T x, T s) { return fabs##M(x); }                                  \
    NB_HD T nb__f_sign_##S(T x, T s) { return (T)((x > 0) - (x < 0)); }                     \
    NB_HD T nb__f_tanh_##S(T x, T s) { return tanh##M(x); }                                 \
    /* exp of a non-positive argument only, so no overflow to inf/inf */                     \
    NB_HD T nb__f_sigmoid_##S(T x, T s) {                                                   \
        return x >= 0 ? (T)1 / ((T)1 + exp##M(-x)) : exp##M(x) / ((T)1 + exp##M(x));        \
    }                                                                                       \
    NB_HD T nb__f_relu_##S(T x, T s) { return x > 0 ? x : (T)0; }                           \
    NB_HD T nb__f_relu_mask_##S(T x, T s) { return x > 0 ? (T)1 : (T)0; }                   \
    NB_HD T nb__f_gelu_##S(T x, T s) {                                                      \
        return (T)0.5 * x * ((T)1 + erf##M(x * (T)NB_INV_SQRT_2));                           \
    }                                                                                       \
    NB_HD T nb__f_gelu_grad_##S(T x, T s) {                                                 \
        return (T)0.5 * ((T)1 + erf##M(x * (T)NB_INV_SQRT_2)) +                              \
               x * (T)NB_INV_SQRT_2PI * exp##M((T)-0.5 * x * x);                            \
    }                                                                                       \
    NB_HD T nb__f_gelu_tanh_##S(T x, T s) {                                                 \
        return (T)0.5 * x * ((T)1 + GTANH((T)NB_SQRT_2_OVER_PI * (x + (T)0.044715 * x * x * x))); \
    }                                                                                       \
    NB_HD T nb__f_gelu_tanh_grad_##S(T x, T s) {                                            \
        const T k = (T)NB_SQRT_2_OVER_PI, c = (T)0.044715;                                  \
        T t = GTANH(k * (x + c * x * x * x));                                               \
        return (T)0.5 * ((T)1 + t) + (T)0.5 * x * ((T)1 - t * t) * k * ((T)1 + (T)3 * c * x * x); \
    }                                                                                       \
    NB_HD T nb__f_pow_##S(T x, T s) { return pow##M(x, s); }                                \
    NB_HD T nb__f_add_s_##S(T x, T s) { return x + s; }                                     \
    NB_HD T nb__f_mul_s_##S(T x, T s) { return x * s; }

/* Binary formulas for type T, named nb__f_<formula>_<S>. */
#define NB__BINARY_FORMULAS(T, S)                                                           \
    NB_HD T nb__f_add_##S(T x, T y) { return x + y; }                                       \
    NB_HD T nb__f_sub_##S(T x, T y) { return x - y; }                                       \
    NB_HD T nb__f_mul_##S(T x, T y) { return x * y; }                                       \
    NB_HD T nb__f_div_##S(T x, T y) { return x / y; }

NB__UNARY_FORMULAS(float, f32, f, tanhf)
NB__UNARY_FORMULAS(double, f64, , tanh)
NB__BINARY_FORMULAS(float, f32)
NB__BINARY_FORMULAS(double, f64)
NB__BINARY_FORMULAS(int32_t, i32)
NB__BINARY_FORMULAS(int64_t, i64)

/* Number of rows of a table: NB__COUNT(NB_UNARY_OPS). */
#define NB__PLUS_ONE(E, f, name) +1
#define NB__COUNT(TABLE) (0 TABLE(NB__PLUS_ONE))

#endif
