/* Fused causal self-attention on CUDA (Note [Attention contract] in
 * tensor/backend.h): our own flash-style kernels, and the choice between
 * them, cuDNN's fused attention (attention_cudnn.cpp) and the composed ops
 * (NABLA_CUDA_ATTENTION, Note [CUDA attention paths]).
 *
 * Letters: N batch, T sequence, H heads, D per head (at most 128), C = H D.
 * qkv (N, T, 3C) holds q, k, v of head h at columns h D, C + h D, 2C + h D
 * of each row; y and gy (N, T, C) at h D; lse and the backward's row sums
 * (N, H, T) in f32.
 *
 * Note [Flash attention kernels]: FlashAttention-2's algorithm in plain
 * f32 multiply-adds (no tensor-core instructions, so that dev/cuda_emu runs
 * the very same source). Nothing of size (N, H, T, T) exists anywhere: a
 * block holds one tile of queries (or keys) in shared memory and walks the
 * tiles of keys (or queries) the causal mask keeps, each tile's scores
 * living only in registers and a (rows, 32) slice of shared memory.
 * - Forward, one block per (query tile, n, h): for each key tile of 32
 *   keys (lane j of a warp takes key j), each warp's rows get their scores
 *   s = scale q . k, an online softmax (running max m and sum l; the
 *   output accumulated so far is rescaled by exp(m_old - m_new)), and
 *   o += p v, lane owning columns lane + 32 c. At the end y = o / l and
 *   lse = m + log l.
 * - Backward, FlashAttention-2's split without atomics, so that dqkv is
 *   written once, in place, in a fixed order (deterministic): a dq kernel,
 *   one block per query tile, which first writes each row's
 *   r_i = gy_i . y_i (scratch), then walks the key tiles with
 *   p = exp(scale q . k - lse), dp = gy . v, ds = p (dp - r) and
 *   dq += scale ds k; then a dk/dv kernel, one block per key tile, which
 *   walks the query tiles from its first key on: dv += p gy, dk += scale
 *   ds q. The scores are made twice (once per kernel), the price of
 *   having no atomics and no zeroed buffer.
 * Inputs of 16 bits are widened to f32 on their way into shared memory;
 * everything accumulates in f32; outputs are rounded once. Tile shapes are
 * chosen per head-dimension class (DC = ceil(D / 32) columns per lane) so
 * that every instantiation's static shared memory stays within SMEM_BUDGET
 * (asserted below and, on the compiled code for the default architectures,
 * by tests/test_attention_ptxas.py, which also allows no register spills). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cuda/flags.h"
#include "tensor/cuda/types.cuh"

#define WARPS 4  /* warps per block */
#define TILE 32  /* keys (forward, dq) or queries (dk/dv) per step: one per lane */
/* Static shared memory per block, for every instantiation: within the
 * 48 KiB a block may have without opting in, with room to spare. */
#define SMEM_BUDGET (44 * 1024)
#define MAX_D NB__CUDA_ATTENTION_MAX_D /* tensor/cuda/flags.h */

/* Rows of a warp: query rows (forward, dq) or key rows (dk/dv). */
static __host__ __device__ constexpr int fwd_rows(int dc) { return dc <= 3 ? 8 : 4; }
static __host__ __device__ constexpr int bwd_rows(int dc) { return dc <= 2 ? 8 : dc == 3 ? 4 : 2; }
/* Shared memory of each kernel, in floats (the arrays below). */
static __host__ __device__ constexpr int fwd_smem(int dc) {
    return WARPS * fwd_rows(dc) * 32 * dc + TILE * (32 * dc + 1) + TILE * 32 * dc +
           WARPS * fwd_rows(dc) * TILE;
}
static __host__ __device__ constexpr int dq_smem(int dc) {
    return 2 * WARPS * bwd_rows(dc) * 32 * dc + 2 * TILE * (32 * dc + 1) +
           WARPS * bwd_rows(dc) * TILE;
}
static __host__ __device__ constexpr int dkdv_smem(int dc) {
    return 2 * WARPS * bwd_rows(dc) * 32 * dc + 2 * TILE * (32 * dc + 1) + 2 * TILE +
           2 * WARPS * bwd_rows(dc) * TILE;
}
static_assert(4 * fwd_smem(1) <= SMEM_BUDGET && 4 * fwd_smem(2) <= SMEM_BUDGET &&
                  4 * fwd_smem(3) <= SMEM_BUDGET && 4 * fwd_smem(4) <= SMEM_BUDGET,
              "forward tiles over the shared-memory budget");
static_assert(4 * dq_smem(1) <= SMEM_BUDGET && 4 * dq_smem(2) <= SMEM_BUDGET &&
                  4 * dq_smem(3) <= SMEM_BUDGET && 4 * dq_smem(4) <= SMEM_BUDGET,
              "dq tiles over the shared-memory budget");
static_assert(4 * dkdv_smem(1) <= SMEM_BUDGET && 4 * dkdv_smem(2) <= SMEM_BUDGET &&
                  4 * dkdv_smem(3) <= SMEM_BUDGET && 4 * dkdv_smem(4) <= SMEM_BUDGET,
              "dk/dv tiles over the shared-memory budget");

static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

/* rows [r0, r0 + R) of a (T, ld) matrix's columns [col, col + d) into
 * s (R, W) in f32; rows past T and columns past d are 0 */
template <int R, int W, class T>
static __device__ __forceinline__ void load_tile(float (*s)[W], const T *m, int64_t ld,
                                                 int r0, int t, int d) {
    for (int e = threadIdx.x; e < R * W; e += WARPS * 32) {
        int r = e / W, c = e % W;
        s[r][c] = r0 + r < t && c < d ? (float)to_math(m[(int64_t)(r0 + r) * ld + c]) : 0.f;
    }
}

/* acc[r][k] += sum_j a[r][j] b[j][lane + 32 k]: a warp's RW rows of a
 * (rows, TILE) block in shared memory (probabilities or score gradients)
 * times a (TILE, W) tile, each lane its columns. */
template <int RW, int DC, int W>
static __device__ __forceinline__ void rows_times_tile(float (&acc)[RW][DC], const float (*a)[TILE],
                                                       const float (*b)[W], int lane) {
    for (int j = 0; j < TILE; j++)
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const float x = a[r][j];
#pragma unroll
            for (int k = 0; k < DC; k++) acc[r][k] += x * b[j][lane + 32 * k];
        }
}

/* A warp's RW result rows, times f, into rows row0 + r of a (T, ld)
 * matrix at out (rows past T left alone), each lane its columns below d. */
template <class T, int RW, int DC>
static __device__ __forceinline__ void store_rows(T *out, int64_t ld, const float (&acc)[RW][DC],
                                                  int row0, int t, int d, int lane, float f) {
#pragma unroll
    for (int r = 0; r < RW; r++) {
        if (row0 + r >= t) continue;
        T *row = out + (int64_t)(row0 + r) * ld;
#pragma unroll
        for (int k = 0; k < DC; k++)
            if (lane + 32 * k < d) row[lane + 32 * k] = store_as<T>(acc[r][k] * f);
    }
}

/* ------------------------------------------------------------ forward */
// grid (N H, tiles of BR queries); block WARPS warps
template <class T, int DC>
static __global__ void __launch_bounds__(WARPS * 32, 1)
    attention_kernel(T *y, float *lse, const T *qkv, int t, int h, int d, float scale) {
    constexpr int DM = 32 * DC, RW = fwd_rows(DC), BR = WARPS * RW;
    __shared__ float qs[BR][DM];
    __shared__ float ks[TILE][DM + 1]; /* odd stride: lane j reads row j */
    __shared__ float vs[TILE][DM];
    __shared__ float ps[WARPS][RW][TILE];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int64_t pair = blockIdx.x, n = pair / h, c = (int64_t)h * d, ld = 3 * c;
    const T *q = qkv + n * t * ld + (pair % h) * d;
    const int r0 = blockIdx.y * BR, last = (r0 + BR < t ? r0 + BR : t) - 1;
    load_tile<BR>(qs, q, ld, r0, t, d);
    float o[RW][DC], m[RW], l[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) {
        m[r] = -INFINITY, l[r] = 0;
#pragma unroll
        for (int k = 0; k < DC; k++) o[r][k] = 0;
    }
    for (int k0 = 0; k0 <= last; k0 += TILE) {
        __syncthreads(); /* the previous tile's reads are done */
        load_tile<TILE>(ks, q + c, ld, k0, t, d);
        load_tile<TILE>(vs, q + 2 * c, ld, k0, t, d);
        __syncthreads();
        const int j = k0 + lane;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int qr = w * RW + r, i = r0 + qr;
            float s = -INFINITY;
            if (j <= i && i < t) {
                float a = 0;
                for (int e = 0; e < d; e++) a += qs[qr][e] * ks[lane][e];
                s = a * scale;
            }
            const float mn = fmaxf(m[r], warp_max(s));
            /* a row with nothing kept yet (mn = -inf) stays empty */
            const float p = mn == -INFINITY ? 0.f : expf(s - mn);
            const float alpha = mn == -INFINITY ? 1.f : expf(m[r] - mn);
            l[r] = l[r] * alpha + warp_sum(p);
            m[r] = mn;
#pragma unroll
            for (int k = 0; k < DC; k++) o[r][k] *= alpha;
            ps[w][r][lane] = p;
        }
        __syncwarp();
        rows_times_tile(o, ps[w], vs, lane);
    }
#pragma unroll
    for (int r = 0; r < RW; r++) {
        const int i = r0 + w * RW + r;
#pragma unroll
        for (int k = 0; k < DC; k++) o[r][k] /= l[r];
        if (lane == 0 && i < t) lse[pair * t + i] = m[r] + logf(l[r]);
    }
    store_rows(y + n * t * c + (pair % h) * d, c, o, r0 + w * RW, t, d, lane, 1.f);
}

/* ------------------------------------------------------------ backward */
// dq, and rsum (N H T) = gy . y per row; grid (N H, tiles of BR queries)
template <class T, int DC>
static __global__ void __launch_bounds__(WARPS * 32, 1)
    attention_dq_kernel(T *dqkv, float *rsum, const T *qkv, const T *y, const T *gy,
                        const float *lse, int t, int h, int d, float scale) {
    constexpr int DM = 32 * DC, RW = bwd_rows(DC), BR = WARPS * RW;
    __shared__ float qs[BR][DM];
    __shared__ float gs[BR][DM];
    __shared__ float ks[TILE][DM + 1];
    __shared__ float vs[TILE][DM + 1];
    __shared__ float dss[WARPS][RW][TILE];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int64_t pair = blockIdx.x, n = pair / h, c = (int64_t)h * d, ld = 3 * c;
    const int64_t hd = (pair % h) * d;
    const T *q = qkv + n * t * ld + hd;
    const int r0 = blockIdx.y * BR, last = (r0 + BR < t ? r0 + BR : t) - 1;
    load_tile<BR>(qs, q, ld, r0, t, d);
    load_tile<BR>(gs, gy + n * t * c + hd, c, r0, t, d);
    __syncthreads();
    float acc[RW][DC], lr[RW], rr[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) {
        const int i = r0 + w * RW + r;
        float a = 0;
#pragma unroll
        for (int k = 0; k < DC; k++) {
            acc[r][k] = 0;
            if (i < t && lane + 32 * k < d)
                a += gs[w * RW + r][lane + 32 * k] *
                     (float)to_math(y[(n * t + i) * c + hd + lane + 32 * k]);
        }
        rr[r] = warp_sum(a);
        lr[r] = i < t ? lse[pair * t + i] : 0.f;
        if (i < t && lane == 0) rsum[pair * t + i] = rr[r];
    }
    for (int k0 = 0; k0 <= last; k0 += TILE) {
        __syncthreads();
        load_tile<TILE>(ks, q + c, ld, k0, t, d);
        load_tile<TILE>(vs, q + 2 * c, ld, k0, t, d);
        __syncthreads();
        const int j = k0 + lane;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int qr = w * RW + r, i = r0 + qr;
            float ds = 0;
            if (j <= i && i < t) {
                float a = 0, dp = 0;
                for (int e = 0; e < d; e++) {
                    a += qs[qr][e] * ks[lane][e];
                    dp += gs[qr][e] * vs[lane][e];
                }
                ds = expf(a * scale - lr[r]) * (dp - rr[r]);
            }
            dss[w][r][lane] = ds;
        }
        __syncwarp();
        rows_times_tile(acc, dss[w], ks, lane);
    }
    store_rows(dqkv + n * t * ld + hd, ld, acc, r0 + w * RW, t, d, lane, scale);
}

// dk and dv; grid (N H, tiles of BK keys)
template <class T, int DC>
static __global__ void __launch_bounds__(WARPS * 32, 1)
    attention_dkdv_kernel(T *dqkv, const T *qkv, const T *gy, const float *lse,
                          const float *rsum, int t, int h, int d, float scale) {
    constexpr int DM = 32 * DC, RW = bwd_rows(DC), BK = WARPS * RW;
    __shared__ float ks[BK][DM];
    __shared__ float vs[BK][DM];
    __shared__ float qs[TILE][DM + 1];
    __shared__ float gs[TILE][DM + 1];
    __shared__ float ls[TILE], rs[TILE];
    __shared__ float ps[WARPS][RW][TILE];
    __shared__ float dss[WARPS][RW][TILE];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int64_t pair = blockIdx.x, n = pair / h, c = (int64_t)h * d, ld = 3 * c;
    const int64_t hd = (pair % h) * d;
    const T *q = qkv + n * t * ld + hd;
    const int j0 = blockIdx.y * BK;
    load_tile<BK>(ks, q + c, ld, j0, t, d);
    load_tile<BK>(vs, q + 2 * c, ld, j0, t, d);
    float dk[RW][DC], dv[RW][DC];
#pragma unroll
    for (int r = 0; r < RW; r++)
#pragma unroll
        for (int k = 0; k < DC; k++) dk[r][k] = dv[r][k] = 0;
    /* queries before j0 see none of this block's keys */
    for (int i0 = j0; i0 < t; i0 += TILE) {
        __syncthreads();
        load_tile<TILE>(qs, q, ld, i0, t, d);
        load_tile<TILE>(gs, gy + n * t * c + hd, c, i0, t, d);
        if (threadIdx.x < TILE) {
            const int i = i0 + threadIdx.x;
            ls[threadIdx.x] = i < t ? lse[pair * t + i] : 0.f;
            rs[threadIdx.x] = i < t ? rsum[pair * t + i] : 0.f;
        }
        __syncthreads();
        const int i = i0 + lane;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int kr = w * RW + r, j = j0 + kr;
            float p = 0, ds = 0;
            if (j <= i && i < t) {
                float a = 0, dp = 0;
                for (int e = 0; e < d; e++) {
                    a += qs[lane][e] * ks[kr][e];
                    dp += gs[lane][e] * vs[kr][e];
                }
                p = expf(a * scale - ls[lane]);
                ds = p * (dp - rs[lane]);
            }
            ps[w][r][lane] = p;
            dss[w][r][lane] = ds;
        }
        __syncwarp();
        rows_times_tile(dv, ps[w], gs, lane);
        rows_times_tile(dk, dss[w], qs, lane);
    }
    T *rows = dqkv + n * t * ld + hd;
    store_rows(rows + c, ld, dk, j0 + w * RW, t, d, lane, scale);
    store_rows(rows + 2 * c, ld, dv, j0 + w * RW, t, d, lane, 1.f);
}

/* ------------------------------------------------------------ launchers */
/* Calls fn(std::integral_constant<int, DC>) for d's column class. */
template <class Fn> static void by_dc(int d, Fn fn) {
    if (d <= 32) fn(std::integral_constant<int, 1>{});
    else if (d <= 64) fn(std::integral_constant<int, 2>{});
    else if (d <= 96) fn(std::integral_constant<int, 3>{});
    else fn(std::integral_constant<int, 4>{});
}

static unsigned tiles(int t, int rows) { return (unsigned)((t + rows - 1) / rows); }

template <class T>
static void launch_forward(cudaStream_t st, T *y, float *lse, const T *qkv, int64_t n, int t,
                           int h, int d, float scale) {
    by_dc(d, [&](auto dc) {
        constexpr int DC = decltype(dc)::value;
        dim3 grid((unsigned)(n * h), tiles(t, WARPS * fwd_rows(DC)));
        attention_kernel<T, DC><<<grid, WARPS * 32, 0, st>>>(y, lse, qkv, t, h, d, scale);
    });
}

template <class T>
static void launch_backward(cudaStream_t st, T *dqkv, float *rsum, const T *qkv, const T *y,
                            const T *gy, const float *lse, int64_t n, int t, int h, int d,
                            float scale) {
    by_dc(d, [&](auto dc) {
        constexpr int DC = decltype(dc)::value;
        dim3 grid((unsigned)(n * h), tiles(t, WARPS * bwd_rows(DC)));
        attention_dq_kernel<T, DC>
            <<<grid, WARPS * 32, 0, st>>>(dqkv, rsum, qkv, y, gy, lse, t, h, d, scale);
        attention_dkdv_kernel<T, DC>
            <<<grid, WARPS * 32, 0, st>>>(dqkv, qkv, gy, lse, rsum, t, h, d, scale);
    });
}

/* ------------------------------------------------------------ path choice */
/* Note [CUDA attention paths]: NABLA_CUDA_ATTENTION, read once:
 * - auto (default, or unset): cuDNN's fused attention where it takes the
 *   call (16-bit inputs, a cuDNN and GPU that support it, a build with the
 *   cudnn-frontend headers), else our kernels, saying why once on stderr;
 * - cudnn: cuDNN's or a loud error naming why not;
 * - own: our kernels;
 * - composed: no fused attention, the front end composes it from matmul and
 *   the causal softmax (what CUDA did before; keeps (N, H, T, T)).
 * A backward runs on the path its forward took when cuDNN's would refuse
 * it; the log-sum-exp both write is the same quantity, so either backward
 * can follow either forward. */
enum { PATH_AUTO, PATH_CUDNN, PATH_OWN, PATH_COMPOSED };
static int path_setting = -1; /* -1: not read yet */

static int attention_path(void) {
    int v = __atomic_load_n(&path_setting, __ATOMIC_RELAXED);
    if (v >= 0) return v;
    const char *e = getenv("NABLA_CUDA_ATTENTION");
    if (!e || !*e || strcmp(e, "auto") == 0) v = PATH_AUTO;
    else if (strcmp(e, "cudnn") == 0) v = PATH_CUDNN;
    else if (strcmp(e, "own") == 0) v = PATH_OWN;
    else if (strcmp(e, "composed") == 0) v = PATH_COMPOSED;
    else
        NB_ABORT("CausalSelfAttention: NABLA_CUDA_ATTENTION must be auto, cudnn, own or "
                 "composed, got \"%s\"",
                 e);
    __atomic_store_n(&path_setting, v, __ATOMIC_RELAXED);
    return v;
}

/* After cuDNN's answer `ok` (why: its reason when false): true when
 * cuDNN did the call, false when our kernels are to run. */
static bool via_cudnn(const char *op, bool ok, const char *why) {
    if (ok) return true;
    int path = attention_path();
    if (path == PATH_CUDNN) NB_ABORT("%s: NABLA_CUDA_ATTENTION=cudnn, but %s", op, why);
    if (path == PATH_AUTO) {
        static int said;
        if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
            fprintf(stderr, "nabla: %s: cuDNN's fused attention not used (%s); nabla's own kernel "
                            "runs instead\n", op, why);
    }
    return false;
}

bool nb__cuda_causal_attention_takes(const nb_tensor *qkv, int h) {
    int64_t d = qkv->shape[2] / 3 / h;
    return attention_path() != PATH_COMPOSED && d >= 1 && d <= MAX_D &&
           (int64_t)qkv->shape[0] * h <= INT32_MAX;
}

/* Both entries: on `out`'s device, cuDNN first where the path allows
 * (cudnn(&why) enqueues its call or says why not), else own(tag<T>{},
 * stream) launches our kernels for the storage type T. */
template <class Cudnn, class Own>
static void run(const char *op, const nb_tensor *out, const nb_tensor *qkv, Cudnn cudnn, Own own) {
    cudaStream_t st = nb__cuda_enter(op, out->device.index);
    if (qkv->shape[0] == 0 || qkv->shape[1] == 0) return;
    if (attention_path() != PATH_OWN) {
        const char *why = "";
        bool ok = cudnn(&why);
        if (via_cudnn(op, ok, why)) return;
    }
    by_float_dtype(op, qkv->dtype, [&](auto tg) {
        if constexpr (std::is_same_v<typename decltype(tg)::type, double>)
            NB_ABORT("%s: f64 has no fused CUDA kernel", op);
        else
            own(tg, st);
    });
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_causal_attention(nb_ctx *ctx, nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv,
                               int h, double scale) {
    (void)ctx;
    int64_t n = qkv->shape[0];
    int t = (int)qkv->shape[1], d = (int)(qkv->shape[2] / 3 / h);
    run(
        "CausalSelfAttention", y, qkv,
        [&](const char **why) { return nb__cuda_cudnn_attention(y, lse, qkv, h, scale, why); },
        [&](auto tg, cudaStream_t st) {
            typedef typename decltype(tg)::type T;
            launch_forward<T>(st, (T *)y->data, (float *)lse->data, (const T *)qkv->data, n, t, h,
                              d, (float)scale);
        });
}

void nb__cuda_causal_attention_backward(nb_ctx *ctx, nb_tensor *dqkv, const nb_tensor *qkv,
                                        const nb_tensor *y, const nb_tensor *lse,
                                        const nb_tensor *gy, int h, double scale) {
    int64_t n = qkv->shape[0];
    int t = (int)qkv->shape[1], d = (int)(qkv->shape[2] / 3 / h);
    run(
        "CausalSelfAttention backward", dqkv, qkv,
        [&](const char **why) {
            return nb__cuda_cudnn_attention_backward(dqkv, qkv, y, lse, gy, h, scale, why);
        },
        [&](auto tg, cudaStream_t st) {
            typedef typename decltype(tg)::type T;
            size_t bytes = sizeof(float) * (size_t)(n * h * t);
            float *rsum = (float *)nb_ctx_alloc(ctx, bytes, 0);
            launch_backward<T>(st, (T *)dqkv->data, rsum, (const T *)qkv->data,
                               (const T *)y->data, (const T *)gy->data,
                               (const float *)lse->data, n, t, h, d, (float)scale);
            nb__ctx_scratch_done(ctx, rsum, bytes); /* stream-ordered: later work comes after */
        });
}
