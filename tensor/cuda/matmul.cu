/* GEMM for nb_matmul on CUDA (cuda.h, "GEMM"), through cuBLASLt.
 *
 * Letters: L batch, M and N output rows and columns, K inner size.
 *
 * Note [Row-major GEMM in cuBLASLt]
 * cuBLASLt is column-major. Our out (M, N) row-major is, read column-major,
 * D (N, M) = out^T = op(b)^T op(a)^T, so cuBLASLt's A is our b and its B is
 * our a. An operand stored row-major (R, C) with leading dimension ld is,
 * column-major, an (C, R) matrix with the same ld: no copies, transposes go
 * into CUBLASLT_MATMUL_DESC_TRANSA/B. A batch is one strided call when the
 * batch dims of a and b (aligned to out's, 0 where broadcast) each flatten
 * to one stride; otherwise the outer dims are looped over and the innermost
 * run that does flatten is one call. When b is one matrix for the whole
 * batch and a's batch continues its rows, the batch is folded into M (the
 * linear-layer case), as on the CPU.
 *
 * Plans (descriptors, layouts and the heuristic's algorithm) are cached per
 * shape key in a small host table, so that steady-state calls make no
 * heuristic query. The key holds the alignment of every operand, because
 * the heuristic picks algorithms for the alignments it is told (the default
 * assumption is 256 bytes, which views at an offset break). An algorithm's
 * alignment requirement covers the operand's pointer, its leading dimension
 * and its batch stride (CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_*_BYTES in
 * cublasLt.h), so the alignment we state is that of all three: a view with
 * an odd leading dimension must not get a kernel that loads 16 bytes at a
 * time from every column.
 *
 * Epilogues: bias (N) and GELU(tanh) run in cuBLASLt (BIAS, GELU_BIAS,
 * GELU_AUX_BIAS with aux = pre) when its heuristic finds an algorithm for
 * them (it needs, e.g., N divisible by 8 for the aux matrix); otherwise the
 * GEMM runs plain and a small kernel applies them. K = 0 is a zero fill and
 * the same kernel. The bias may be f32 with a 16-bit output
 * (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE), so an f32 bias is read as it is
 * stored. In backward (Note [GEMM epilogues in backward] in
 * tensor/ops_matmul.c): DGELU (aux = the GELU's pre-activation, read)
 * multiplies the product by GELU_tanh'(pre), and BGRADB writes the sums of
 * cuBLASLt's B (our op(a)) over K, the bias gradient that the weight's
 * gradient GEMM g^T x forms from g on the way; the same fallbacks apply
 * (epilogue_kernel, bgrad_kernel).
 *
 * Accumulation: with `accumulate` the GEMM adds its product to out (beta =
 * 1, C = D), which is how a weight's gradient is formed in place (Note
 * [Gradients added in place] in autograd/backward.c): no product tensor,
 * no add kernel, no second read of the gradient. Not with an epilogue but
 * BGRADB (which writes the bias gradient and leaves D's beta alone).
 *
 * Residual (Note [Residual in the GEMM] in tensor/ops_matmul.c): D =
 * op(A) op(B) + bias + C with C the residual (beta = 1, its own layout
 * descriptor, D a fresh tensor), the BIAS epilogue (or none) beside it,
 * summed in f32 and rounded once. Where the heuristic has no algorithm for
 * that, the GEMM runs plain (beta = 0, no epilogue) and epilogue_kernel
 * adds the bias and the residual to the rounded product: one kernel more,
 * and a second rounding. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"
#include "tensor/gemm_layout.h"

#define OP "nb_matmul"

/* ------------------------------------------------------------- kernels */

/* nb_gelu(NB_GELU_TANH)'s formula (tensor/op_table.h) */
static __device__ __forceinline__ float gelu_tanh(float x) { return nb__f_gelu_tanh_f32(x, 0); }
static __device__ __forceinline__ double gelu_tanh(double x) { return nb__f_gelu_tanh_f64(x, 0); }
static __device__ __forceinline__ float gelu_tanh_grad(float x) {
    return nb__f_gelu_tanh_grad_f32(x, 0);
}
static __device__ __forceinline__ double gelu_tanh_grad(double x) {
    return nb__f_gelu_tanh_grad_f64(x, 0);
}

/* out (R, N) contiguous. dpre: out *= gelu'(dpre). Else v = out +
 * bias[col] (bias of B: T, or float with a 16-bit T) + resid (R, N, never
 * with gelu); pre = v; out = gelu(v). */
template <typename T, typename B>
static __global__ void epilogue_kernel(T *out, T *pre, const B *bias, const T *dpre,
                                       const T *resid, int64_t total, int64_t n, bool gelu) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        auto v = to_math(out[i]);
        if (dpre) {
            put(&out[i], v * gelu_tanh_grad(to_math(dpre[i])));
            continue;
        }
        if (bias) v += (decltype(v))to_math(bias[i % n]);
        if (resid) v += to_math(resid[i]);
        if (pre) put(&pre[i], v);
        if (gelu) v = gelu_tanh(v);
        put(&out[i], v);
    }
}

#define BGRAD_THREADS 256
/* out[i] = sum over j < k of a[i * si + j * sk] (op(a)'s row i), one block
 * per row, in the math type of T (f32 for 16-bit), written as f32. */
template <typename T>
static __global__ void bgrad_kernel(float *out, const T *a, int64_t m, int64_t k, int64_t si,
                                    int64_t sk) {
    using M = decltype(to_math(T{}));
    __shared__ M part[BGRAD_THREADS / 32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
        M s = 0;
        for (int64_t j = threadIdx.x; j < k; j += BGRAD_THREADS) s += to_math(a[i * si + j * sk]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0) part[w] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            M t = 0;
            for (int q = 0; q < BGRAD_THREADS / 32; q++) t += part[q];
            out[i] = (float)t;
        }
        __syncthreads();
    }
}

/* ----------------------------------------------------------- launchers */
template <typename T>
static void epilogue_launch(cudaStream_t st, void *out, void *pre, const void *bias,
                            bool bias_f32, const void *dpre, const void *resid, int64_t total,
                            int64_t n, bool gelu) {
    int64_t blocks = (total + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    if (bias_f32)
        epilogue_kernel<T, float><<<(unsigned)blocks, 256, 0, st>>>(
            (T *)out, (T *)pre, (const float *)bias, (const T *)dpre, (const T *)resid, total, n,
            gelu);
    else
        epilogue_kernel<T, T><<<(unsigned)blocks, 256, 0, st>>>(
            (T *)out, (T *)pre, (const T *)bias, (const T *)dpre, (const T *)resid, total, n, gelu);
    NB_CUDA_CHECK_LAUNCH(OP);
}

/* bias_dt: the bias's dtype (f32, or dt). resid: NULL, or out's layout. */
static void epilogue(cudaStream_t st, nb_dtype dt, void *out, void *pre, const void *bias,
                     nb_dtype bias_dt, const void *dpre, const void *resid, int64_t total,
                     int64_t n, bool gelu) {
    if (total == 0) return;
    bool bias_f32 = bias && bias_dt == NB_F32 && dt != NB_F32;
    BY_FLOAT_DTYPE(OP, dt, epilogue_launch, st, out, pre, bias, bias_f32, dpre, resid, total, n,
                   gelu);
}

template <typename T>
static void bgrad_launch(cudaStream_t st, float *out, const void *a, int64_t m, int64_t k,
                         int64_t si, int64_t sk) {
    int64_t blocks = m < 65536 ? m : 65536;
    bgrad_kernel<T><<<(unsigned)blocks, BGRAD_THREADS, 0, st>>>(out, (const T *)a, m, k, si, sk);
    NB_CUDA_CHECK_LAUNCH(OP);
}

/* out (m) f32 = row sums of the (m, k) matrix at a with strides (si, sk). */
static void bgrad(cudaStream_t st, nb_dtype dt, float *out, const void *a, int64_t m, int64_t k,
                  int64_t si, int64_t sk) {
    if (m == 0) return;
    BY_FLOAT_DTYPE(OP, dt, bgrad_launch, st, out, a, m, k, si, sk);
}

/* ------------------------------------------------------------- layouts */
typedef nb__gemm_layout layout;

/* tensor/gemm_layout.h, without BLAS's int limit (cuBLASLt takes int64). */
static bool get_layout(const nb_tensor *t, layout *l) { return nb__gemm_layout_of(t, l); }

/* tensor/gemm_layout.h (the meta device counts the calls the same way). */
static bool flat_stride(const int64_t *shape, const int64_t *st, int lo, int hi, int64_t *s) {
    return nb__gemm_flat_stride(shape, st, lo, hi, s);
}

extern "C" bool nb__cuda_gemm_readable(const nb_tensor *t) {
    layout l;
    int64_t s;
    return t->ndim >= 2 && get_layout(t, &l) && flat_stride(t->shape, t->strides, 0, t->ndim - 2, &s);
}

/* ---------------------------------------------------------- plan cache */
/* Every field int64_t: no padding, so keys compare with memcmp. */
typedef struct gemm_key {
    int64_t device, dt_in, dt_out, tf32;
    int64_t op_a, op_b;       /* cuBLASLt's A (our b) and B (our a) transposed */
    int64_t m, n, k;          /* cuBLASLt's: m = our N, n = our M */
    int64_t lda, ldb, ldd;
    int64_t batch, stride_a, stride_b, stride_d;
    int64_t epilogue, aux_ld, aux_stride, bias_dt;
    int64_t resid; /* C is a residual apart from D (beta = 1) */
    int64_t align_a, align_b, align_c, align_d, align_bias, align_aux;
} gemm_key;

typedef struct gemm_plan {
    bool used, ok; /* ok: the heuristic found an algorithm */
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc, ld; /* lc: C's, ld itself unless a residual */
    cublasLtMatmulAlgo_t algo;
} gemm_plan;

#define PLAN_SLOTS 512
#define PLAN_PROBE 8
static gemm_plan plans[PLAN_SLOTS];
static pthread_mutex_t plans_lock = PTHREAD_MUTEX_INITIALIZER;

/* Note [Aborts under the plan lock]
 * Plans are made and GEMMs enqueued with plans_lock held. An abort there
 * (a cuBLASLt call that fails, no algorithm for a shape) must release the
 * lock first: a handler that returns control to the program, like the
 * tests' (in-process: the CUDA suites run with CK_FORK=no), would
 * otherwise leave every later GEMM of the process blocked on it, and a
 * suite's first failure would turn into a silent hang. So every check in
 * the locked region goes through LT_CHECK, and the runtime calls that may
 * abort (handle, workspace, stream) are made before the lock is taken. */
static cublasStatus_t unlock_on_failure(cublasStatus_t s) {
    if (s != CUBLAS_STATUS_SUCCESS) pthread_mutex_unlock(&plans_lock);
    return s;
}
#define LT_CHECK(call) NB_CUBLAS_CHECK(OP, unlock_on_failure(call))

static uint64_t key_hash(const gemm_key *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void plan_free(gemm_plan *p) {
    if (!p->used) return;
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc != p->ld) cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatrixLayoutDestroy(p->ld);
    cublasLtMatmulDescDestroy(p->desc);
    p->used = false;
}

static cudaDataType_t cuda_type(nb_dtype dt) {
    switch (dt) {
    case NB_F32: return CUDA_R_32F;
    case NB_F64: return CUDA_R_64F;
    case NB_BF16: return CUDA_R_16BF;
    case NB_F16: return CUDA_R_16F;
    default: NB_ABORT("%s: unsupported dtype %s", OP, nb_dtype_name(dt));
    }
    return CUDA_R_32F;
}

/* The largest power of two (at most 256) dividing the address p and the
 * byte strides ld_bytes and stride_bytes (0: none). */
static int64_t align_of(const void *p, int64_t ld_bytes, int64_t stride_bytes) {
    uint64_t v = (uint64_t)(uintptr_t)p | (uint64_t)ld_bytes | (uint64_t)stride_bytes | 256u;
    return (int64_t)(v & (~v + 1));
}

static cublasLtMatrixLayout_t make_layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                                          int64_t batch, int64_t stride) {
    cublasLtMatrixLayout_t l;
    LT_CHECK(cublasLtMatrixLayoutCreate(&l, t, (uint64_t)rows, (uint64_t)cols, ld));
    if (batch > 1) {
        int32_t count = (int32_t)batch;
        LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                  sizeof count));
        LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                  &stride, sizeof stride));
    }
    return l;
}

/* Builds the plan for key k; bias and aux are the pointers of this call
 * (the heuristic reads their alignment from the descriptor); ws_bytes is
 * the workspace every call of the plan will be given. Called with
 * plans_lock held. */
static void plan_make(gemm_plan *p, const gemm_key *k, const void *bias, void *aux,
                      cublasLtHandle_t h, size_t ws_bytes) {
    nb_dtype din = (nb_dtype)k->dt_in, dout = (nb_dtype)k->dt_out;
    bool f64 = din == NB_F64;
    cublasComputeType_t ct = f64 ? CUBLAS_COMPUTE_64F
                             : k->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                       : CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = f64 ? CUDA_R_64F : CUDA_R_32F;
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, ct, scale));
    cublasOperation_t ta = k->op_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = k->op_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtEpilogue_t epi = (cublasLtEpilogue_t)k->epilogue;
    LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (bias) {
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof bias));
        int32_t bt = (int32_t)cuda_type((nb_dtype)k->bias_dt);
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                sizeof bt));
    }
    if (aux) {
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                &aux, sizeof aux));
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                &k->aux_ld, sizeof k->aux_ld));
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc,
                                                CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE,
                                                &k->aux_stride, sizeof k->aux_stride));
    }
    /* cuBLASLt's A = our b: (m, k) after op; B = our a: (k, n) after op. */
    p->la = make_layout(cuda_type(din), k->op_a ? k->k : k->m, k->op_a ? k->m : k->k, k->lda,
                        k->batch, k->stride_a);
    p->lb = make_layout(cuda_type(din), k->op_b ? k->n : k->k, k->op_b ? k->k : k->n, k->ldb,
                        k->batch, k->stride_b);
    p->ld = make_layout(cuda_type(dout), k->m, k->n, k->ldd, k->batch, k->stride_d);
    p->lc = k->resid ? make_layout(cuda_type(dout), k->m, k->n, k->ldd, k->batch, k->stride_d)
                     : p->ld;

    uint64_t ws = ws_bytes;
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &ws, sizeof ws));
    uint32_t al[4] = {(uint32_t)k->align_a, (uint32_t)k->align_b,
                      (uint32_t)(k->resid ? k->align_c : k->align_d), (uint32_t)k->align_d};
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                  &al[0], sizeof al[0]));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                  &al[1], sizeof al[1]));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                  &al[2], sizeof al[2]));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                  &al[3], sizeof al[3]));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(h, p->desc, p->la, p->lb, p->lc, p->ld, pref,
                                                      1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    p->ok = s == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS;
    if (p->ok) p->algo = res.algo;
    p->key = *k;
    p->used = true;
}

/* The cached plan for k (made on a miss). Called with plans_lock held. */
static gemm_plan *plan_get(const gemm_key *k, const void *bias, void *aux, cublasLtHandle_t lt,
                           size_t ws_bytes) {
    uint64_t h = key_hash(k);
    for (int i = 0; i < PLAN_PROBE; i++) {
        gemm_plan *p = &plans[(h + (uint64_t)i) % PLAN_SLOTS];
        if (p->used && memcmp(&p->key, k, sizeof *k) == 0) return p;
    }
    gemm_plan *slot = NULL;
    for (int i = 0; i < PLAN_PROBE && !slot; i++) {
        gemm_plan *p = &plans[(h + (uint64_t)i) % PLAN_SLOTS];
        if (!p->used) slot = p;
    }
    if (!slot) {
        slot = &plans[h % PLAN_SLOTS];
        plan_free(slot);
    }
    plan_make(slot, k, bias, aux, lt, ws_bytes);
    return slot;
}

/* ------------------------------------------------------------ one call */
typedef struct gemm_call {
    int device;
    cublasLtHandle_t h; /* fetched before plans_lock (Note [Aborts under the plan lock]) */
    void *ws;
    size_t ws_bytes;
    cudaStream_t st;
    nb_dtype dt_in, dt_out;
    bool op_a, op_b;
    int64_t m, n, k, lda, ldb, ldd;
    int64_t batch, stride_a, stride_b, stride_d; /* elements */
    const void *a, *b;                           /* cuBLASLt's A (our b) and B (our a) */
    void *d;
    const void *bias;
    nb_dtype bias_dt; /* f32, or dt_out */
    bool gelu;
    void *pre;        /* aux: pre-activation, same layout as d (written; with dgelu read) */
    bool dgelu;       /* d = product * gelu'(pre) */
    float *bgrad;     /* (our M): cuBLASLt's B summed over k */
    bool accumulate;  /* beta = 1: d += product */
    const void *resid; /* C apart from d, d's layout (beta = 1): d = product + bias + resid */
} gemm_call;

/* D = op(A) op(B) (+ epilogue); returns false when the epilogue was not
 * applied (the caller runs the kernel instead). Called with plans_lock held. */
static bool gemm_run(const gemm_call *c, bool with_epilogue) {
    gemm_key k;
    memset(&k, 0, sizeof k);
    size_t ein = nb_dtype_size(c->dt_in), eout = nb_dtype_size(c->dt_out);
    k.device = c->device;
    k.dt_in = c->dt_in;
    k.dt_out = c->dt_out;
    k.tf32 = c->dt_in == NB_F32 && nb__cuda_tf32();
    k.op_a = c->op_a;
    k.op_b = c->op_b;
    k.m = c->m;
    k.n = c->n;
    k.k = c->k;
    k.lda = c->lda;
    k.ldb = c->ldb;
    k.ldd = c->ldd;
    k.batch = c->batch;
    k.stride_a = c->batch > 1 ? c->stride_a : 0;
    k.stride_b = c->batch > 1 ? c->stride_b : 0;
    k.stride_d = c->batch > 1 ? c->stride_d : 0;
    k.align_a = align_of(c->a, c->lda * (int64_t)ein, k.stride_a * (int64_t)ein);
    k.align_b = align_of(c->b, c->ldb * (int64_t)ein, k.stride_b * (int64_t)ein);
    k.align_d = align_of(c->d, c->ldd * (int64_t)eout, k.stride_d * (int64_t)eout);
    const void *resid = with_epilogue ? c->resid : NULL;
    if (resid) {
        k.resid = 1;
        k.align_c = align_of(resid, c->ldd * (int64_t)eout, k.stride_d * (int64_t)eout);
    }
    const void *bias = NULL;
    void *aux = NULL;
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    bool aux_ok = c->pre && c->ldd % 8 == 0 && k.stride_d % 8 == 0 &&
                  align_of(c->pre, c->ldd * (int64_t)eout, k.stride_d * (int64_t)eout) >= 16;
    if (with_epilogue && c->dgelu) {
        if (!aux_ok) return false;
        aux = c->pre;
        epi = CUBLASLT_EPILOGUE_DGELU;
        k.aux_ld = c->ldd;
        k.aux_stride = k.stride_d;
        k.align_aux = align_of(aux, c->ldd * (int64_t)eout, k.stride_d * (int64_t)eout);
    } else if (with_epilogue && c->bgrad) {
        bias = c->bgrad;
        epi = CUBLASLT_EPILOGUE_BGRADB;
        k.bias_dt = NB_F32;
        k.align_bias = align_of(bias, 0, 0);
    } else if (with_epilogue && (c->bias || c->gelu)) {
        bias = c->bias;
        if (c->gelu && c->pre && !aux_ok) return false;
        if (c->gelu && c->pre) {
            aux = c->pre;
            epi = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
            k.aux_ld = c->ldd;
            k.aux_stride = k.stride_d;
            k.align_aux = align_of(aux, c->ldd * (int64_t)eout, k.stride_d * (int64_t)eout);
        } else if (c->gelu) {
            epi = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
        } else {
            epi = CUBLASLT_EPILOGUE_BIAS;
        }
        if (bias) {
            k.align_bias = align_of(bias, 0, 0);
            k.bias_dt = c->bias_dt;
        }
    }
    k.epilogue = epi;
    gemm_plan *p = plan_get(&k, bias, aux, c->h, c->ws_bytes);
    if (!p->ok) {
        if (epi != CUBLASLT_EPILOGUE_DEFAULT || resid) return false;
        pthread_mutex_unlock(&plans_lock); /* Note [Aborts under the plan lock] */
        NB_ABORT("%s: cuBLASLt has no algorithm for %s (%lld x %lld) @ (%lld x %lld) -> %s, "
                 "batch %lld, leading dims %lld, %lld, %lld, pointer alignments %lld, %lld, %lld "
                 "bytes",
                 OP, nb_dtype_name(c->dt_in), (long long)c->n, (long long)c->k, (long long)c->k,
                 (long long)c->m, nb_dtype_name(c->dt_out), (long long)c->batch,
                 (long long)c->ldb, (long long)c->lda, (long long)c->ldd, (long long)k.align_b,
                 (long long)k.align_a, (long long)k.align_d);
    }
    if (bias)
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof bias));
    if (aux)
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                &aux, sizeof aux));
    bool beta1 = c->accumulate || resid;
    float one_f = 1.0f, beta_f = beta1 ? 1.0f : 0.0f;
    double one_d = 1.0, beta_d = beta1 ? 1.0 : 0.0;
    bool f64 = c->dt_in == NB_F64;
    LT_CHECK(cublasLtMatmul(c->h, p->desc, f64 ? (const void *)&one_d : (const void *)&one_f, c->a,
                            p->la, c->b, p->lb, f64 ? (const void *)&beta_d : (const void *)&beta_f,
                            resid ? resid : c->d, p->lc, c->d, p->ld, &p->algo, c->ws, c->ws_bytes,
                            c->st));
    return true;
}

#define MAX_BATCH_PER_CALL 65535

extern "C" void nb__cuda_gemm(nb_tensor *out, const nb_tensor *a, const nb_tensor *b,
                              bool trans_a, bool trans_b, const nb__gemm_epilogue *epi) {
    nb__gemm_epilogue e;
    if (epi) e = *epi;
    else memset(&e, 0, sizeof e);
    const nb_tensor *bias = e.bias;
    bool gelu = e.gelu, accumulate = e.accumulate;
    int dev = out->device.index;
    cudaStream_t st = nb__cuda_enter(OP, dev);
    int nbd = out->ndim - 2;
    int64_t m = out->shape[nbd], n = out->shape[nbd + 1];
    int64_t k = a->shape[a->ndim - (trans_a ? 2 : 1)];
    int64_t batch = nb__numel_shape(nbd, out->shape);
    nb_dtype dt_out = out->dtype;
    size_t ein = nb_dtype_size(a->dtype), eout = nb_dtype_size(dt_out);
    NB_CHECK(!accumulate || (!bias && !gelu && !e.dgelu_pre), "%s: a GEMM that adds into its "
             "output %s takes no bias, GELU or DGELU epilogue", OP, nb_shape_str(out));
    bool pre_ok = e.dgelu_pre && e.dgelu_pre->ndim == out->ndim;
    for (int i = 0; pre_ok && i < out->ndim; i++) pre_ok = e.dgelu_pre->shape[i] == out->shape[i];
    NB_CHECK(!e.dgelu_pre || (!bias && !gelu && !e.bgrad && e.dgelu_pre->dtype == dt_out && pre_ok &&
                              nb_is_contiguous(e.dgelu_pre)),
             "%s: a DGELU epilogue takes a contiguous pre-activation of the output's shape and "
             "dtype (%s %s) and no other epilogue", OP, nb_dtype_name(dt_out), nb_shape_str(out));
    NB_CHECK(!e.bgrad || (!bias && !gelu && out->ndim == 2 && e.bgrad->dtype == NB_F32 &&
                          e.bgrad->ndim == 1 && e.bgrad->shape[0] == m),
             "%s: a bias gradient takes a 2-D output (got %s), an f32 vector of its %lld rows and "
             "no bias or GELU", OP, nb_shape_str(out), (long long)m);
    NB_CHECK(!bias || bias->dtype == dt_out || bias->dtype == NB_F32,
             "%s: a bias %s for an output %s: it is the output's dtype or f32", OP,
             nb_dtype_name(bias->dtype), nb_dtype_name(dt_out));
    const nb_tensor *r = e.residual;
    bool r_ok = r && r->ndim == out->ndim && r->dtype == dt_out && nb_is_contiguous(r) &&
                r->data != out->data;
    for (int i = 0; r_ok && i < out->ndim; i++) r_ok = r->shape[i] == out->shape[i];
    NB_CHECK(!r || (r_ok && !gelu && !accumulate && !e.dgelu_pre && !e.bgrad),
             "%s: a residual %s %s for an output %s %s: it is contiguous, of the output's shape "
             "and dtype, not the output itself, and beside a bias only", OP,
             nb_dtype_name(r->dtype), nb_shape_str(r), nb_dtype_name(dt_out), nb_shape_str(out));
    if (batch == 0 || m == 0 || n == 0) {
        if (e.bgrad && m > 0) /* sums over K = 0 or over no column: zeros */
            NB_CUDA_CHECK(OP, cudaMemsetAsync(e.bgrad->data, 0, (size_t)m * sizeof(float), st));
        return;
    }
    void *pre_data = gelu && e.pre ? e.pre->data : e.dgelu_pre ? e.dgelu_pre->data : NULL;
    const void *bias_data = bias ? bias->data : NULL;
    nb_dtype bias_dt = bias ? bias->dtype : dt_out;
    if (k == 0) {
        if (e.bgrad) NB_CUDA_CHECK(OP, cudaMemsetAsync(e.bgrad->data, 0, (size_t)m * sizeof(float), st));
        if (accumulate) return; /* out += 0 */
        NB_CUDA_CHECK(OP, cudaMemsetAsync(out->data, 0, (size_t)(batch * m * n) * eout, st));
        if (bias || gelu || r)
            epilogue(st, dt_out, out->data, pre_data, bias_data, bias_dt, NULL,
                     r ? r->data : NULL, batch * m * n, n, gelu);
        return;
    }
    layout la, lb;
    if (!get_layout(a, &la) || !get_layout(b, &lb))
        NB_ABORT("%s: operands %s and %s are not readable by cuBLASLt in place",
                 OP, nb_shape_str(a), nb_shape_str(b));
    /* Row-major flags as for BLAS: operand stored (R, C) row-major with ld. */
    bool fa = trans_a != la.col_major, fb = trans_b != lb.col_major;
    int64_t sa[NB_MAX_DIMS], sb[NB_MAX_DIMS];
    nb__gemm_batch_strides(a, nbd, sa);
    nb__gemm_batch_strides(b, nbd, sb);

    gemm_call c;
    memset(&c, 0, sizeof c);
    c.device = dev;
    c.h = (cublasLtHandle_t)nb__cuda_cublaslt(dev);
    c.ws = nb__cuda_gemm_workspace(dev, &c.ws_bytes);
    c.st = st;
    c.dt_in = a->dtype;
    c.dt_out = dt_out;
    c.op_a = fb;
    c.op_b = fa;
    c.n = m;
    c.m = n;
    c.k = k;
    c.lda = lb.ld;
    c.ldb = la.ld;
    c.ldd = n;
    c.bias = bias_data;
    c.bias_dt = bias_dt;
    c.gelu = gelu;
    c.dgelu = e.dgelu_pre != NULL;
    c.bgrad = e.bgrad ? (float *)e.bgrad->data : NULL;
    c.accumulate = accumulate;

    /* Batch split: dims [0, j) looped over, [j, nbd) one strided call. */
    int64_t run_a = 0, run_b = 0;
    int j = nbd;
    bool fold = batch > 1 && !fa && nb__gemm_can_fold(nbd, out->shape, sa, sb, la.ld, m);
    if (fold) {
        c.n = batch * m;
        j = 0;
    } else {
        int64_t ta, tb;
        while (j > 0 && flat_stride(out->shape, sa, j - 1, nbd, &ta) &&
               flat_stride(out->shape, sb, j - 1, nbd, &tb))
            j--;
        (void)flat_stride(out->shape, sa, j, nbd, &run_a);
        (void)flat_stride(out->shape, sb, j, nbd, &run_b);
    }
    int64_t inner = fold ? 1 : nb__numel_shape(nbd - j, out->shape + j);
    int64_t outer = fold ? 1 : batch / inner;
    c.stride_a = run_b; /* cuBLASLt's A is our b */
    c.stride_b = run_a;
    c.stride_d = m * n;

    (void)cuda_type(c.dt_in); /* aborts on a bad dtype here, not under the lock */
    (void)cuda_type(c.dt_out);
    pthread_mutex_lock(&plans_lock);
    int64_t idx[NB_MAX_DIMS] = {0};
    for (int64_t o = 0; o < outer; o++) {
        int64_t oa = 0, ob = 0;
        for (int i = 0; i < j; i++) {
            oa += idx[i] * sa[i];
            ob += idx[i] * sb[i];
        }
        for (int64_t i0 = 0; i0 < inner; i0 += MAX_BATCH_PER_CALL) {
            int64_t cnt = inner - i0 < MAX_BATCH_PER_CALL ? inner - i0 : MAX_BATCH_PER_CALL;
            c.batch = cnt;
            c.a = (const char *)b->data + (ob + i0 * run_b) * (int64_t)ein;
            c.b = (const char *)a->data + (oa + i0 * run_a) * (int64_t)ein;
            int64_t od = (o * inner + i0) * m * n * (int64_t)eout;
            c.d = (char *)out->data + od;
            c.pre = pre_data ? (char *)pre_data + od : NULL;
            c.resid = r ? (const char *)r->data + od : NULL;
            if (!gemm_run(&c, true)) {
                (void)gemm_run(&c, false);
                /* the kernels need no plan: launched (and checked) outside the lock */
                pthread_mutex_unlock(&plans_lock);
                if (c.bgrad) /* op(a) (M, K) of the 2-D a: row i at i * ld, or column i */
                    bgrad(st, a->dtype, c.bgrad, c.b, m, k, fa ? 1 : la.ld, fa ? la.ld : 1);
                else
                    epilogue(st, dt_out, c.d, c.dgelu ? NULL : c.pre, bias_data, bias_dt,
                             c.dgelu ? c.pre : NULL, c.resid, cnt * c.n * c.m, n, gelu);
                pthread_mutex_lock(&plans_lock);
            }
        }
        for (int i = j - 1; i >= 0 && ++idx[i] == out->shape[i]; i--) idx[i] = 0;
    }
    pthread_mutex_unlock(&plans_lock);
}
