/* Stand-in for cuBLASLt (dev/cuda_emu): the part tensor/cuda/matmul.cu
 * calls, computing cublasLtMatmul on the CPU with the documented semantics
 * (column-major; D = alpha op(A) op(B) + beta C per strided batch, C read
 * through its own layout and pointer, in place (C = D) or apart; then the
 * epilogue: BIAS adds bias[row of D]; GELU, GELU_AUX (the pre-GELU value
 * written to aux) and their _BIAS forms apply GELU(tanh); DGELU multiplies
 * by GELU_tanh'(aux); BGRADB writes the sums of op(B) over k, one per column
 * of D). Products and sums in f32 (f64 for CUBLAS_COMPUTE_64F), each output
 * rounded once to its type. The heuristic finds an algorithm for every plan
 * unless emu_cublaslt_refuse_epilogues is set, when a plan with an
 * epilogue, or with a C layout apart from D's (a residual), gets none
 * (matmul.cu then runs its own kernels). Written from cublasLt.h's
 * documentation, not from its implementation. */
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
inline const char *cublasGetStatusName(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS         ? "CUBLAS_STATUS_SUCCESS"
           : s == CUBLAS_STATUS_INVALID_VALUE ? "CUBLAS_STATUS_INVALID_VALUE"
                                              : "CUBLAS_STATUS_NOT_SUPPORTED";
}
inline const char *cublasGetStatusString(cublasStatus_t s) { return cublasGetStatusName(s); }

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum {
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
    CUBLAS_COMPUTE_64F = 70
} cublasComputeType_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType_t;

typedef enum {
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
    CUBLASLT_EPILOGUE_GELU = 32,
    CUBLASLT_EPILOGUE_GELU_AUX = 32 | 128,
    CUBLASLT_EPILOGUE_GELU_BIAS = 32 | 4,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
    CUBLASLT_EPILOGUE_DGELU = 64 | 128,
    CUBLASLT_EPILOGUE_BGRADB = 512
} cublasLtEpilogue_t;

typedef enum {
    CUBLASLT_MATMUL_DESC_TRANSA,
    CUBLASLT_MATMUL_DESC_TRANSB,
    CUBLASLT_MATMUL_DESC_EPILOGUE,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER,
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE
} cublasLtMatmulDescAttributes_t;
typedef enum {
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET
} cublasLtMatrixLayoutAttribute_t;
typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES
} cublasLtMatmulPreferenceAttributes_t;

struct emu_lt_handle {
    int unused;
};
struct emu_lt_desc {
    cublasComputeType_t compute;
    int32_t trans_a, trans_b, epilogue, bias_type;
    const void *bias;
    void *aux;
    int64_t aux_ld, aux_stride;
};
struct emu_lt_layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld, stride;
    int32_t batch;
};
struct emu_lt_pref {
    int unused;
};
typedef emu_lt_handle *cublasLtHandle_t;
typedef emu_lt_desc *cublasLtMatmulDesc_t;
typedef emu_lt_layout *cublasLtMatrixLayout_t;
typedef emu_lt_pref *cublasLtMatmulPreference_t;
typedef struct {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;

inline bool emu_cublaslt_refuse_epilogues;

inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t ct,
                                               cudaDataType_t) {
    *d = new emu_lt_desc{ct, 0, 0, CUBLASLT_EPILOGUE_DEFAULT, -1, nullptr, nullptr, 0, 0};
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}
template <class T> inline cublasStatus_t emu_lt_set(T *field, const void *buf, size_t size) {
    if (size != sizeof *field) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                                     cublasLtMatmulDescAttributes_t a,
                                                     const void *buf, size_t size) {
    switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return emu_lt_set(&d->trans_a, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB: return emu_lt_set(&d->trans_b, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return emu_lt_set(&d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return emu_lt_set(&d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return emu_lt_set(&d->bias_type, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return emu_lt_set(&d->aux, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return emu_lt_set(&d->aux_ld, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE: return emu_lt_set(&d->aux_stride, buf, size);
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}
inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t t,
                                                 uint64_t rows, uint64_t cols, int64_t ld) {
    *l = new emu_lt_layout{t, rows, cols, ld, 0, 1};
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                       cublasLtMatrixLayoutAttribute_t a,
                                                       const void *buf, size_t size) {
    if (a == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) return emu_lt_set(&l->batch, buf, size);
    return emu_lt_set(&l->stride, buf, size);
}
inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    *p = new emu_lt_pref{0};
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t,
                                                           cublasLtMatmulPreferenceAttributes_t,
                                                           const void *, size_t) {
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                                     cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                                     cublasLtMatrixLayout_t lc, cublasLtMatrixLayout_t ld,
                                                     cublasLtMatmulPreference_t, int,
                                                     cublasLtMatmulHeuristicResult_t *r, int *found) {
    memset(r, 0, sizeof *r);
    bool special = d->epilogue != CUBLASLT_EPILOGUE_DEFAULT || lc != ld;
    *found = emu_cublaslt_refuse_epilogues && special ? 0 : 1;
    r->state = CUBLAS_STATUS_SUCCESS;
    return CUBLAS_STATUS_SUCCESS;
}

inline double emu_lt_load(cudaDataType_t t, const void *p, int64_t i) {
    switch (t) {
    case CUDA_R_32F: return ((const float *)p)[i];
    case CUDA_R_64F: return ((const double *)p)[i];
    case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: return __half2float(((const __half *)p)[i]);
    }
}
inline void emu_lt_store(cudaDataType_t t, void *p, int64_t i, double v) {
    switch (t) {
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    case CUDA_R_64F: ((double *)p)[i] = v; break;
    case CUDA_R_16BF: ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v); break;
    default: ((__half *)p)[i] = __float2half((float)v); break;
    }
}
/* GELU(tanh) and its derivative, in the compute precision. */
template <class M> inline M emu_lt_gelu(M x) {
    const M c = (M)0.7978845608028654, k = (M)0.044715;
    return (M)0.5 * x * ((M)1 + std::tanh(c * (x + k * x * x * x)));
}
template <class M> inline M emu_lt_dgelu(M x) {
    const M c = (M)0.7978845608028654, k = (M)0.044715;
    M t = std::tanh(c * (x + k * x * x * x));
    return (M)0.5 * ((M)1 + t) + (M)0.5 * x * ((M)1 - t * t) * c * ((M)1 + (M)3 * k * x * x);
}

/* op(X)(i, p) of a column-major X with leading dimension ld. */
inline int64_t emu_lt_at(bool trans, int64_t ld, int64_t i, int64_t p) {
    return trans ? p + i * ld : i + p * ld;
}

template <class M>
inline void emu_lt_matmul(const emu_lt_desc *d, M alpha, const void *A, const emu_lt_layout *la,
                          const void *B, const emu_lt_layout *lb, M beta, const void *C,
                          const emu_lt_layout *lc, void *D, const emu_lt_layout *ld) {
    int64_t m = (int64_t)ld->rows, n = (int64_t)ld->cols;
    int64_t k = d->trans_a ? (int64_t)la->rows : (int64_t)la->cols;
    int e = d->epilogue;
    bool bias = e & CUBLASLT_EPILOGUE_BIAS, gelu = (e & 32) != 0, aux_out = (e & 128) && gelu;
    bool dgelu = (e & 64) != 0, bgradb = e == CUBLASLT_EPILOGUE_BGRADB;
    cudaDataType_t bt = d->bias_type < 0 ? ld->type : (cudaDataType_t)d->bias_type;
    for (int32_t b = 0; b < ld->batch; b++) {
        const char *a0 = (const char *)A, *b0 = (const char *)B, *c0 = (const char *)C;
        int64_t oa = la->batch > 1 ? b * la->stride : 0, ob = lb->batch > 1 ? b * lb->stride : 0;
        int64_t oc = lc->batch > 1 ? b * lc->stride : 0, od = ld->batch > 1 ? b * ld->stride : 0;
        int64_t ox = b * d->aux_stride;
        for (int64_t j = 0; j < n; j++) {
            if (bgradb) {
                M s = 0;
                for (int64_t p = 0; p < k; p++)
                    s += (M)emu_lt_load(lb->type, b0, ob + emu_lt_at(d->trans_b, lb->ld, p, j));
                emu_lt_store(bt, (void *)d->bias, j, s);
            }
            for (int64_t i = 0; i < m; i++) {
                M s = 0;
                for (int64_t p = 0; p < k; p++)
                    s += (M)emu_lt_load(la->type, a0, oa + emu_lt_at(d->trans_a, la->ld, i, p)) *
                         (M)emu_lt_load(lb->type, b0, ob + emu_lt_at(d->trans_b, lb->ld, p, j));
                M v = alpha * s;
                if (beta != 0) v += beta * (M)emu_lt_load(lc->type, c0, oc + i + j * lc->ld);
                if (bias) v += (M)emu_lt_load(bt, d->bias, i);
                if (aux_out) emu_lt_store(ld->type, d->aux, ox + i + j * d->aux_ld, v);
                if (gelu) v = emu_lt_gelu(v);
                if (dgelu) v *= emu_lt_dgelu((M)emu_lt_load(ld->type, d->aux, ox + i + j * d->aux_ld));
                emu_lt_store(ld->type, D, od + i + j * ld->ld, v);
            }
        }
    }
}

inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void *alpha,
                                     const void *A, cublasLtMatrixLayout_t la, const void *B,
                                     cublasLtMatrixLayout_t lb, const void *beta, const void *C,
                                     cublasLtMatrixLayout_t lc, void *D, cublasLtMatrixLayout_t ld,
                                     const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t) {
    if (d->compute == CUBLAS_COMPUTE_64F)
        emu_lt_matmul<double>(d, *(const double *)alpha, A, la, B, lb, *(const double *)beta, C,
                              lc, D, ld);
    else
        emu_lt_matmul<float>(d, *(const float *)alpha, A, la, B, lb, *(const float *)beta, C, lc,
                             D, ld);
    return CUBLAS_STATUS_SUCCESS;
}
