/* One checking path for every CUDA runtime, cuBLAS(Lt) and cuDNN call
 * (for .cu files only). A failure aborts through nb_abort with the op, the
 * call as written and the library's own message, e.g.
 *   nb_matmul: cublasLtMatmul(...) failed: CUBLAS_STATUS_NOT_SUPPORTED
 * Kernel launches are checked with NB_CUDA_CHECK_LAUNCH right after the
 * launch (cudaGetLastError catches bad configurations; faults inside a
 * kernel surface at the next synchronising call). */
#ifndef NABLA_TENSOR_CUDA_CHECK_H
#define NABLA_TENSOR_CUDA_CHECK_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "nabla/dtype.h"
#include "nabla/error.h"

#define NB_CUDA_CHECK(op, call)                                                                  \
    do {                                                                                         \
        cudaError_t nb_e_ = (call);                                                              \
        if (nb_e_ != cudaSuccess)                                                                \
            nb_abort(__FILE__, __LINE__, "%s: %s failed: %s (%s)", (op), #call,                  \
                     cudaGetErrorName(nb_e_), cudaGetErrorString(nb_e_));                        \
    } while (0)

#define NB_CUDA_CHECK_LAUNCH(op) NB_CUDA_CHECK(op, cudaGetLastError())

#define NB_CUBLAS_CHECK(op, call)                                                                \
    do {                                                                                         \
        cublasStatus_t nb_s_ = (call);                                                           \
        if (nb_s_ != CUBLAS_STATUS_SUCCESS)                                                      \
            nb_abort(__FILE__, __LINE__, "%s: %s failed: %s (%s)", (op), #call,                  \
                     cublasGetStatusName(nb_s_), cublasGetStatusString(nb_s_));                  \
    } while (0)

#define NB_CUDNN_CHECK(op, call)                                                                 \
    do {                                                                                         \
        cudnnStatus_t nb_s_ = (call);                                                            \
        if (nb_s_ != CUDNN_STATUS_SUCCESS)                                                       \
            nb_abort(__FILE__, __LINE__, "%s: %s failed: %s", (op), #call,                      \
                     cudnnGetErrorString(nb_s_));                                                \
    } while (0)

/* cuDNN's data type for a float dtype; any other aborts naming op. */
static inline cudnnDataType_t nb__cudnn_dtype(const char *op, nb_dtype dt) {
    switch (dt) {
    case NB_F32: return CUDNN_DATA_FLOAT;
    case NB_F64: return CUDNN_DATA_DOUBLE;
    case NB_BF16: return CUDNN_DATA_BFLOAT16;
    case NB_F16: return CUDNN_DATA_HALF;
    default: NB_ABORT("%s: cuDNN has no data type for %s", op, nb_dtype_name(dt));
    }
    return CUDNN_DATA_FLOAT;
}

#endif
