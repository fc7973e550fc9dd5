/* Layer norm forward and backward on CUDA (tensor/cpu/norm.c computes the
 * same function; Note there for the backward formulas).
 *
 * Statistics: two passes (mean, then the mean of squared deviations,
 * biased) as on the CPU, rstd = 1 / sqrt(var + eps). Math in f32 for
 * f32/bf16/f16 and in f64 for f64. mean and rstd are written in their
 * tensors' dtype: f32, or f64 when x is f64 and the front end asks for f64
 * statistics (the f32 ones would cost f64 backward its precision).
 *
 * Two implementations of each direction:
 *  - the register path (Note [Layer norm rows in registers]) for rows of
 *    up to a few thousand elements: each row is read from memory once,
 *    with 16-byte accesses when the rows are aligned, and the backward
 *    also makes the dw/db partial sums of its rows on the way;
 *  - the general path (longer rows, f64 input with f32 statistics): one
 *    warp per row reading the row from memory for each pass, and dw/db
 *    made by a separate pass over g and x: the rows are cut into a fixed
 *    number of chunks; a block of (32 columns x 8 row lanes) sums its chunk
 *    of rows for 32 columns, row lanes combined in a fixed order, into a
 *    scratch array (chunks, D); a second kernel adds the chunks of each
 *    column in increasing order.
 * Either way dw and db are made without atomics, in an order that depends
 * only on M and D: bitwise reproducible. dx, dw and db are written, or added
 * into (the last kernel adds dw and db, the row kernel dx) with the
 * rounding of a separate add: add_rounded.
 *
 * Letters: M rows, D elements per row.
 *
 * Note [Layer norm rows in registers]
 * A row group of P threads (a warp, or 64..512 threads) owns a row; thread
 * t holds the elements (k P + t) W + j, k < E / W, j < W, in registers
 * (E values per thread, W = 16 / sizeof(T) when x, y, g, dx, w, b are
 * 16-byte aligned and W divides D, else W = 1). Forward: one read of x,
 * the mean and the squared deviations summed from the registers (per
 * thread, then over the group in a fixed order: deterministic), one write
 * of y. Backward: one read of x and g; the thread keeps xhat and g w (for
 * dx) and adds g xhat and g into per-column accumulators (its columns are
 * the same for every row it handles); at the end the row groups of a block
 * add their accumulators in shared memory, group by group in order, into
 * one row of a (blocks, D) scratch that a last kernel sums over blocks,
 * lanes over strided blocks then the lanes in order. The number of blocks
 * depends only on M (at most MAX_CHUNKS, at least ROWS_PER_CHUNK rows
 * each), so the sums are reproducible; the scratch costs 16 D bytes per
 * block (f32 sums, written and read) against the 3 D es bytes of each of
 * its >= 32 rows (es the element size): under 10% in bf16, less with more
 * rows.
 *
 * Sizes: P = the smallest power of two >= 32 with P E_max >= D, then E =
 * the smallest multiple of 8 with P E >= D. E_max is 32 for the forward
 * (16 for f64) and 16 for the backward, which keeps four arrays of E
 * (xhat, g w, and the two accumulators; 8 for f64). So the forward uses a
 * warp per row up to D = 1024 (GPT-2: 768 -> E = 24, 1024 -> 32; 1600 ->
 * P = 64, E = 32). The forward takes rows up to D = 16384 (f64: 8192), the
 * backward up to 8192 (f64: 4096); longer rows take the general path. Groups
 * narrower than BLOCK_THREADS share a block (BLOCK_THREADS / P rows at a
 * time; the whole block loops together so that block-wide reductions are
 * legal).
 *
 * Occupancy (registers from ptxas -v for sm_90 at the time of writing, no
 * spills anywhere; an SM has 64K registers and 2048 threads; blocks of
 * 256 threads unless P > 256):
 *  - forward, 16-byte accesses, f32/bf16/f16: 40-64 registers (E = 24, 32:
 *    64, capped there by __launch_bounds__ (512, 2)): 4 blocks, 1024
 *    threads per SM (50%). Each thread has E / W 16-byte loads of x in
 *    flight at once (D = 768: 6 in f32, 3 in bf16), so >= 48 KB per SM,
 *    well above bandwidth x latency per SM (H100: ~3.35 TB/s x ~0.7 us / 132
 *    SMs ~ 18 KB).
 *  - forward, element accesses (W = 1) or f64: 45-128 registers (the
 *    compiler keeps the unrolled per-element addresses and predicates),
 *    2 to 5 blocks per SM, no spills: the unaligned and odd-width cases, and
 *    f64, which serves gradient checks rather than speed.
 *  - backward: E = 16 (f32/bf16/f16): 97-117 registers, 2 blocks per SM;
 *    E = 8: 60-64, 4 blocks; f64 (E = 8): 114, 2 blocks. With dw/db the
 *    grid is at most MAX_CHUNKS blocks (M = 8192: 256), about two per SM of
 *    an H100 (132 SMs) anyway: one wave; each thread then has 2 E / W
 *    16-byte loads in flight (f32, D = 768: 8).
 * These are estimates from the register counts; the bandwidth itself is
 * measured by benchmarks/bench_cuda.c (layer norm forward and fwd+bwd next
 * to a device copy). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

/* ------------------------------------------------------------------ helpers */

static __device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
static __device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

/* old + v, v rounded to T first, the sum in T's math type (never merged
 * into an FMA) and rounded again: the bits of writing v and adding it
 * separately (Note [Layer norm's gradients added in place] in
 * tensor/ops_norm.c). */
template <typename T, typename A> static __device__ __forceinline__ T add_rounded(T old, A v) {
    return store_as<T>(add_rn(to_math(old), to_math(store_as<T>(v))));
}

template <typename A> static __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static const int WARPS = 4;          /* rows per block, forward and dx */
static const int COL_TILE = 32;      /* dw/db: columns per block */
static const int ROW_LANES = 8;      /* dw/db: threads along the rows */
static const int MAX_CHUNKS = 512;   /* dw/db: row chunks (grid.y) */

/* ------------------------------------------------------------------ kernels */
// y, x (M, D); w, b (D) or NULL; mean, rstd (M)
template <typename T, typename S, typename P>
static __global__ void layer_norm_kernel(T *__restrict__ y, S *__restrict__ mean,
                                         S *__restrict__ rstd, const T *__restrict__ x,
                                         const P *__restrict__ w, const P *__restrict__ b,
                                         int64_t m, int64_t d, double eps) {
    typedef math_t<T> A;
    int lane = threadIdx.x & 31;
    for (int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); row < m;
         row += (int64_t)gridDim.x * WARPS) {
        const T *xr = x + row * d;
        T *yr = y + row * d;
        A s = 0;
        for (int64_t j = lane; j < d; j += 32) s += to_math(xr[j]);
        A mu = warp_sum(s) / (A)d;
        A v = 0;
        for (int64_t j = lane; j < d; j += 32) {
            A t = to_math(xr[j]) - mu;
            v += t * t;
        }
        A r = (A)1 / sqrt(warp_sum(v) / (A)d + (A)eps);
        if (lane == 0) {
            mean[row] = (S)mu;
            rstd[row] = (S)r;
        }
        for (int64_t j = lane; j < d; j += 32) {
            A h = (to_math(xr[j]) - mu) * r;
            if (w) h *= to_math(w[j]);
            if (b) h += to_math(b[j]);
            yr[j] = store_as<T>(h);
        }
    }
}

// dx, g, x (M, D); w (D) or NULL; dx written, or added into (add_dx)
template <typename T, typename S, typename P>
static __global__ void layer_norm_dx_kernel(T *__restrict__ dx, const T *__restrict__ g,
                                            const T *__restrict__ x, const S *__restrict__ mean,
                                            const S *__restrict__ rstd, const P *__restrict__ w,
                                            int64_t m, int64_t d, bool add_dx) {
    typedef math_t<T> A;
    int lane = threadIdx.x & 31;
    for (int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); row < m;
         row += (int64_t)gridDim.x * WARPS) {
        const T *xr = x + row * d, *gr = g + row * d;
        T *dr = dx + row * d;
        A mu = (A)mean[row], r = (A)rstd[row], sa = 0, sb = 0;
        for (int64_t j = lane; j < d; j += 32) {
            A h = (to_math(xr[j]) - mu) * r;
            A dh = to_math(gr[j]) * (w ? to_math(w[j]) : (A)1);
            sa += dh;
            sb += dh * h;
        }
        sa = warp_sum(sa) / (A)d;
        sb = warp_sum(sb) / (A)d;
        for (int64_t j = lane; j < d; j += 32) {
            A h = (to_math(xr[j]) - mu) * r;
            A dh = to_math(gr[j]) * (w ? to_math(w[j]) : (A)1);
            A v = r * (dh - sa - h * sb);
            dr[j] = add_dx ? add_rounded(dr[j], v) : store_as<T>(v);
        }
    }
}

// The lanes' partial sums of one column tile (block (COL_TILE, LANES)),
// added in lane order by lane 0: true there, with the totals
template <int LANES, typename A>
static __device__ bool sum_over_lanes(A (*sw)[COL_TILE + 1], A (*sb)[COL_TILE + 1], A aw, A ab,
                                      A *tw, A *tb) {
    int tx = threadIdx.x, ty = threadIdx.y;
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty != 0) return false;
    A w = 0, b = 0;
#pragma unroll
    for (int k = 0; k < LANES; k++) {
        w += sw[k][tx];
        b += sb[k][tx];
    }
    *tw = w;
    *tb = b;
    return true;
}

// pw, pb (chunks, D) = per chunk of rows: sum g xhat, sum g
// block (COL_TILE, ROW_LANES), grid (ceil(D / COL_TILE), chunks)
template <typename T, typename S>
static __global__ void layer_norm_dwdb_partial_kernel(
    math_t<T> *__restrict__ pw, math_t<T> *__restrict__ pb,
    const T *__restrict__ g, const T *__restrict__ x, const S *__restrict__ mean,
    const S *__restrict__ rstd, int64_t m, int64_t d, int64_t rows_per_chunk) {
    typedef math_t<T> A;
    __shared__ A sw[ROW_LANES][COL_TILE + 1], sb[ROW_LANES][COL_TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * COL_TILE + tx;
    int64_t start = (int64_t)blockIdx.y * rows_per_chunk;
    int64_t end = start + rows_per_chunk < m ? start + rows_per_chunk : m;
    A aw = 0, ab = 0;
    if (col < d)
        for (int64_t row = start + ty; row < end; row += ROW_LANES) {
            A gv = to_math(g[row * d + col]);
            A h = (to_math(x[row * d + col]) - (A)mean[row]) * (A)rstd[row];
            aw += gv * h;
            ab += gv;
        }
    A tw, tb;
    if (sum_over_lanes<ROW_LANES>(sw, sb, aw, ab, &tw, &tb) && col < d) {
        pw[blockIdx.y * d + col] = tw;
        pb[blockIdx.y * d + col] = tb;
    }
}

// dw, db (D) or NULL = sums of pw, pb (chunks, D) over the chunks, in order;
// added into where add_w, add_b say
template <typename T, typename P>
static __global__ void layer_norm_dwdb_final_kernel(
    P *__restrict__ dw, P *__restrict__ db, const math_t<T> *__restrict__ pw,
    const math_t<T> *__restrict__ pb, int64_t chunks, int64_t d, bool add_w, bool add_b) {
    typedef math_t<T> A;
    for (int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; col < d;
         col += (int64_t)gridDim.x * blockDim.x) {
        A tw = 0, tb = 0;
        for (int64_t c = 0; c < chunks; c++) {
            tw += pw[c * d + col];
            tb += pb[c * d + col];
        }
        if (dw) dw[col] = add_w ? add_rounded(dw[col], tw) : store_as<P>(tw);
        if (db) db[col] = add_b ? add_rounded(db[col], tb) : store_as<P>(tb);
    }
}

/* ------------------------------------------------- register path: kernels */
/* Note [Layer norm rows in registers]. */
static const int BLOCK_THREADS = 256;   /* groups narrower than this share a block */
static const int MAX_ROW_THREADS = 512; /* threads per row, at most */
static const int ROWS_PER_CHUNK = 32;   /* backward: rows per block, at least */
static const int SUM_LANES = 16;        /* dw/db sum over blocks: lanes per column */

/* Values per thread, at most (a multiple of 8). */
template <typename T> struct max_values {
    static const int fwd = 32, bwd = 16;
};
template <> struct max_values<double> {
    static const int fwd = 16, bwd = 8;
};

/* Forward: blocks of MAX_ROW_THREADS per SM that ptxas must allow for, so
 * 64 registers per thread for the 16-byte paths of 2- and 4-byte types;
 * the others need more without spilling (Note [Layer norm rows in registers]). */
template <typename T, int W> static constexpr int min_blocks() {
    return W > 1 && sizeof(T) < 8 ? 2 : 1;
}

/* N elements of T, aligned to their size: one 16-byte access for N W. */
template <typename T, int N> struct alignas(sizeof(T) * N) vec {
    T v[N];
};

/* W parameters at p (aligned to 16 bytes where W > 1): one access when
 * they fill at most 16 bytes (the parameters of the input's dtype), else
 * one per element (f32 weights of a bf16 or f16 input, Note [Compute
 * dtype] in tensor/context.c). */
template <typename P, int W>
static __device__ __forceinline__ vec<P, W> load_params(const P *p) {
    if constexpr (sizeof(P) * W <= 16) {
        return *(const vec<P, W> *)p;
    } else {
        vec<P, W> r;
#pragma unroll
        for (int j = 0; j < W; j++) r.v[j] = p[j];
        return r;
    }
}

/* The sum of v over the row group of the calling thread (threadIdx.x of
 * blockDim.x; row group threadIdx.y), returned to all of its threads, in a
 * fixed order. Every thread of the block calls it (groups wider than a
 * warp synchronise the block); sm has one entry per warp of the block. */
template <typename A> static __device__ __forceinline__ A group_sum(A v, A *sm) {
    v = warp_sum(v);
    if (blockDim.x == 32) return v;
    int nw = blockDim.x >> 5;
    A *gs = sm + threadIdx.y * nw;
    if ((threadIdx.x & 31) == 0) gs[threadIdx.x >> 5] = v;
    __syncthreads();
    A s = gs[0];
    for (int q = 1; q < nw; q++) s += gs[q];
    __syncthreads();
    return s;
}

/* group_sum of a and of b, with one pair of synchronisations. */
template <typename A>
static __device__ __forceinline__ void group_sum2(A &a, A &b, A *sma, A *smb) {
    a = warp_sum(a);
    b = warp_sum(b);
    if (blockDim.x == 32) return;
    int nw = blockDim.x >> 5, base = threadIdx.y * nw;
    if ((threadIdx.x & 31) == 0) {
        sma[base + (threadIdx.x >> 5)] = a;
        smb[base + (threadIdx.x >> 5)] = b;
    }
    __syncthreads();
    a = sma[base];
    b = smb[base];
    for (int q = 1; q < nw; q++) {
        a += sma[base + q];
        b += smb[base + q];
    }
    __syncthreads();
}

// y, x (M, D); w, b (D) or NULL; mean, rstd (M)
// block (P, rows per block), E values per thread, W elements per access
template <typename T, typename S, typename P, int E, int W>
static __global__ void __launch_bounds__(MAX_ROW_THREADS, min_blocks<T, W>())
    layer_norm_regs_kernel(T *__restrict__ y, S *__restrict__ mean, S *__restrict__ rstd,
                           const T *__restrict__ x, const P *__restrict__ w,
                           const P *__restrict__ b, int64_t m, int d, double eps) {
    typedef math_t<T> A;
    typedef vec<T, W> V;
    const int K = E / W, t = threadIdx.x, p = blockDim.x;
    __shared__ A sm[MAX_ROW_THREADS / 32];
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < m;
         base += (int64_t)gridDim.x * blockDim.y) {
        int64_t row = base + threadIdx.y;
        bool live = row < m;
        const T *xr = x + row * d;
        A v[E];
        A s = 0;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int i = (k * p + t) * W;
            if (live && i < d) {
                V a = *(const V *)(xr + i);
#pragma unroll
                for (int j = 0; j < W; j++) v[k * W + j] = to_math(a.v[j]);
            } else {
#pragma unroll
                for (int j = 0; j < W; j++) v[k * W + j] = 0;
            }
        }
#pragma unroll
        for (int e = 0; e < E; e++) s += v[e];
        A mu = group_sum(s, sm) / (A)d;
        A q = 0;
#pragma unroll
        for (int k = 0; k < K; k++) {
            if ((k * p + t) * W < d) {
#pragma unroll
                for (int j = 0; j < W; j++) {
                    A c = v[k * W + j] - mu;
                    q += c * c;
                }
            }
        }
        A r = (A)1 / sqrt(group_sum(q, sm) / (A)d + (A)eps);
        if (!live) continue; /* after the last group_sum of the row */
        if (t == 0) {
            mean[row] = (S)mu;
            rstd[row] = (S)r;
        }
        T *yr = y + row * d;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int i = (k * p + t) * W;
            if (i >= d) continue;
            V o;
            vec<P, W> wv, bv;
            if (w) wv = load_params<P, W>(w + i);
            if (b) bv = load_params<P, W>(b + i);
#pragma unroll
            for (int j = 0; j < W; j++) {
                A h = (v[k * W + j] - mu) * r;
                if (w) h *= to_math(wv.v[j]);
                if (b) h += to_math(bv.v[j]);
                o.v[j] = store_as<T>(h);
            }
            *(V *)(yr + i) = o;
        }
    }
}

// dx, g, x (M, D) (dx or NULL: written, or added into when add_dx); w (D) or
// NULL; mean, rstd (M);
// pw, pb (gridDim.x, D) or NULL = per block, the sums over its rows of g xhat and g
// block (P, rows per block), E values per thread, W elements per access
template <typename T, typename S, typename P, int E, int W>
static __global__ void __launch_bounds__(MAX_ROW_THREADS) layer_norm_backward_regs_kernel(
    T *__restrict__ dx, math_t<T> *__restrict__ pw,
    math_t<T> *__restrict__ pb, const T *__restrict__ g,
    const T *__restrict__ x, const S *__restrict__ mean, const S *__restrict__ rstd,
    const P *__restrict__ w, int64_t m, int d, bool add_dx) {
    typedef math_t<T> A;
    typedef vec<T, W> V;
    const int K = E / W, t = threadIdx.x, p = blockDim.x;
    __shared__ A sma[MAX_ROW_THREADS / 32], smb[MAX_ROW_THREADS / 32];
    /* groups sharing a block: P <= BLOCK_THREADS / 2, so D <= 128 E */
    __shared__ A red[2][(BLOCK_THREADS / 2) * E];
    A aw[E], ab[E];
#pragma unroll
    for (int e = 0; e < E; e++) aw[e] = ab[e] = 0;
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < m;
         base += (int64_t)gridDim.x * blockDim.y) {
        int64_t row = base + threadIdx.y;
        bool live = row < m;
        A mu = live ? (A)mean[row] : (A)0, r = live ? (A)rstd[row] : (A)0;
        const T *xr = x + row * d, *gr = g + row * d;
        A h[E], dh[E];
        A sa = 0, sb = 0;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int i = (k * p + t) * W;
            if (live && i < d) {
                V xv = *(const V *)(xr + i), gv = *(const V *)(gr + i);
                vec<P, W> wv;
                if (w) wv = load_params<P, W>(w + i);
#pragma unroll
                for (int j = 0; j < W; j++) {
                    A hj = (to_math(xv.v[j]) - mu) * r, gj = to_math(gv.v[j]);
                    aw[k * W + j] += gj * hj;
                    ab[k * W + j] += gj;
                    A dj = w ? gj * to_math(wv.v[j]) : gj;
                    sa += dj;
                    sb += dj * hj;
                    h[k * W + j] = hj;
                    dh[k * W + j] = dj;
                }
            } else {
#pragma unroll
                for (int j = 0; j < W; j++) h[k * W + j] = dh[k * W + j] = 0;
            }
        }
        group_sum2(sa, sb, sma, smb);
        if (!live || !dx) continue;
        sa /= (A)d;
        sb /= (A)d;
        T *dr = dx + row * d;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int i = (k * p + t) * W;
            if (i >= d) continue;
            V o;
            if (add_dx) o = *(const V *)(dr + i);
#pragma unroll
            for (int j = 0; j < W; j++) {
                A v = r * (dh[k * W + j] - sa - h[k * W + j] * sb);
                o.v[j] = add_dx ? add_rounded(o.v[j], v) : store_as<T>(v);
            }
            *(V *)(dr + i) = o;
        }
    }
    if (!pw) return; /* the same for the whole block */
    A *ow = pw + (int64_t)blockIdx.x * d, *ob = pb + (int64_t)blockIdx.x * d;
    if (blockDim.y == 1) { /* one group: its threads own distinct columns */
#pragma unroll
        for (int k = 0; k < K; k++) {
            int i = (k * p + t) * W;
            if (i >= d) continue;
#pragma unroll
            for (int j = 0; j < W; j++) {
                ow[i + j] = aw[k * W + j];
                ob[i + j] = ab[k * W + j];
            }
        }
        return;
    }
    /* several groups: add them in shared memory, group 0 first */
    for (int gq = 0; gq < (int)blockDim.y; gq++) {
        if ((int)threadIdx.y == gq) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                int i = (k * p + t) * W;
                if (i >= d) continue;
#pragma unroll
                for (int j = 0; j < W; j++) {
                    red[0][i + j] = gq ? red[0][i + j] + aw[k * W + j] : aw[k * W + j];
                    red[1][i + j] = gq ? red[1][i + j] + ab[k * W + j] : ab[k * W + j];
                }
            }
        }
        __syncthreads();
    }
    for (int c = threadIdx.y * p + t; c < d; c += p * blockDim.y) {
        ow[c] = red[0][c];
        ob[c] = red[1][c];
    }
}

// dw, db (D) or NULL = sums of pw, pb (chunks, D) over the chunks; added
// into where add_w, add_b say
// block (COL_TILE, SUM_LANES), grid ceil(D / COL_TILE): lane l adds chunks
// l, l + SUM_LANES, ... in order, then the lanes are added in order
template <typename T, typename P>
static __global__ void layer_norm_dwdb_sum_kernel(P *__restrict__ dw, P *__restrict__ db,
                                                  const math_t<T> *__restrict__ pw,
                                                  const math_t<T> *__restrict__ pb,
                                                  int64_t chunks, int64_t d, bool add_w,
                                                  bool add_b) {
    typedef math_t<T> A;
    __shared__ A sw[SUM_LANES][COL_TILE + 1], sb[SUM_LANES][COL_TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * COL_TILE + tx;
    A aw = 0, ab = 0;
    if (col < d)
#pragma unroll 4
        for (int64_t c = ty; c < chunks; c += SUM_LANES) {
            aw += pw[c * d + col];
            ab += pb[c * d + col];
        }
    A tw, tb;
    if (sum_over_lanes<SUM_LANES>(sw, sb, aw, ab, &tw, &tb) && col < d) {
        if (dw) dw[col] = add_w ? add_rounded(dw[col], tw) : store_as<P>(tw);
        if (db) db[col] = add_b ? add_rounded(db[col], tb) : store_as<P>(tb);
    }
}

/* ---------------------------------------------------------------- launchers */
static unsigned row_grid(int64_t m) {
    int64_t b = (m + WARPS - 1) / WARPS;
    return (unsigned)(b < 65536 ? b : 65536);
}

static const void *data_or_null(const nb_tensor *t) { return t ? t->data : NULL; }

/* Register path geometry (Note [Layer norm rows in registers]): P threads
 * per row, rows per block, E values per thread, W elements per access. */
struct regs_cfg {
    int p, rows, e, w;
};

static bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

/* The register path serves T when the statistics are in T's math type. */
template <typename T, typename S> static constexpr bool regs_path_for() {
    return sizeof(S) == sizeof(math_t<T>);
}

/* False when a row of d elements needs more than e_max values per thread
 * at MAX_ROW_THREADS threads. ptrs: the data of every row tensor and of w
 * and b (NULL for an absent one): W > 1 only if all are 16-byte aligned. */
template <typename T>
static bool regs_config(int64_t d, int e_max, const void *const *ptrs, int n, regs_cfg *c) {
    for (int p = 32; p <= MAX_ROW_THREADS; p *= 2) {
        if ((int64_t)p * e_max < d) continue;
        c->p = p;
        c->rows = p < BLOCK_THREADS ? BLOCK_THREADS / p : 1;
        c->e = 8;
        while ((int64_t)p * c->e < d) c->e += 8;
        const int wide = (int)(16 / sizeof(T));
        bool ok = d % wide == 0;
        for (int k = 0; k < n; k++) ok = ok && aligned16(ptrs[k]);
        c->w = ok ? wide : 1;
        return true;
    }
    return false;
}

template <typename T, typename S, typename P, int E>
static void forward_regs(const regs_cfg &c, unsigned grid, cudaStream_t s, T *y, S *mean,
                         S *rstd, const T *x, const P *w, const P *b, int64_t m, int64_t d,
                         double eps) {
    if constexpr (E <= max_values<T>::fwd) {
        if (c.e != E) {
            forward_regs<T, S, P, E + 8>(c, grid, s, y, mean, rstd, x, w, b, m, d, eps);
            return;
        }
        const int wide = (int)(16 / sizeof(T));
        dim3 block((unsigned)c.p, (unsigned)c.rows);
        if (c.w == wide)
            layer_norm_regs_kernel<T, S, P, E, wide>
                <<<grid, block, 0, s>>>(y, mean, rstd, x, w, b, m, (int)d, eps);
        else
            layer_norm_regs_kernel<T, S, P, E, 1>
                <<<grid, block, 0, s>>>(y, mean, rstd, x, w, b, m, (int)d, eps);
    }
}

template <typename T, typename S, typename P, int E>
static void backward_regs(const regs_cfg &c, unsigned grid, cudaStream_t s, T *dx,
                          math_t<T> *pw, math_t<T> *pb,
                          const T *g, const T *x, const S *mean, const S *rstd, const P *w,
                          int64_t m, int64_t d, bool add_dx) {
    if constexpr (E <= max_values<T>::bwd) {
        if (c.e != E) {
            backward_regs<T, S, P, E + 8>(c, grid, s, dx, pw, pb, g, x, mean, rstd, w, m, d,
                                          add_dx);
            return;
        }
        const int wide = (int)(16 / sizeof(T));
        dim3 block((unsigned)c.p, (unsigned)c.rows);
        if (c.w == wide)
            layer_norm_backward_regs_kernel<T, S, P, E, wide>
                <<<grid, block, 0, s>>>(dx, pw, pb, g, x, mean, rstd, w, m, (int)d, add_dx);
        else
            layer_norm_backward_regs_kernel<T, S, P, E, 1>
                <<<grid, block, 0, s>>>(dx, pw, pb, g, x, mean, rstd, w, m, (int)d, add_dx);
    }
}

template <typename T, typename S, typename P>
static void launch_forward(cudaStream_t s, nb_tensor *y, nb_tensor *mean, nb_tensor *rstd,
                           const nb_tensor *x, const nb_tensor *w, const nb_tensor *b, int64_t m,
                           int64_t d, double eps) {
    const P *wp = (const P *)data_or_null(w), *bp = (const P *)data_or_null(b);
    if constexpr (regs_path_for<T, S>()) {
        const void *ptrs[4] = {x->data, y->data, wp, bp};
        regs_cfg c;
        if (regs_config<T>(d, max_values<T>::fwd, ptrs, 4, &c)) {
            int64_t nb = (m + c.rows - 1) / c.rows;
            forward_regs<T, S, P, 8>(c, (unsigned)(nb < 65536 ? nb : 65536), s, (T *)y->data,
                                  (S *)mean->data, (S *)rstd->data, (const T *)x->data, wp, bp,
                                  m, d, eps);
            return;
        }
    }
    layer_norm_kernel<T, S, P><<<row_grid(m), WARPS * 32, 0, s>>>(
        (T *)y->data, (S *)mean->data, (S *)rstd->data, (const T *)x->data, wp, bp, m, d, eps);
}

/* The register path of the backward; false (nothing done) when it does not
 * apply. */
template <typename T, typename S, typename P>
static bool launch_backward_regs(cudaStream_t s, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                 const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                 const nb_tensor *rstd, const nb_tensor *w, int64_t m,
                                 int64_t d, unsigned add, const char *op) {
    if constexpr (!regs_path_for<T, S>()) {
        return false;
    } else {
        typedef math_t<T> A;
        const void *ptrs[4] = {x->data, g->data, data_or_null(dx), data_or_null(w)};
        regs_cfg c;
        if (m == 0 || !regs_config<T>(d, max_values<T>::bwd, ptrs, 4, &c)) return false;
        bool sums = dw || db;
        /* with dw/db: blocks of >= ROWS_PER_CHUNK rows, at most MAX_CHUNKS
         * (depends on M only: reproducible sums) */
        int64_t nb = sums ? (m + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK : (m + c.rows - 1) / c.rows;
        int64_t cap = sums ? MAX_CHUNKS : 65536;
        nb = nb < cap ? nb : cap;
        A *pw = NULL, *pb = NULL;
        if (sums) {
            pw = (A *)nb_ctx_alloc((dw ? dw : db)->ctx, 2 * (size_t)nb * (size_t)d * sizeof(A), 0);
            pb = pw + nb * d;
        }
        backward_regs<T, S, P, 8>(c, (unsigned)nb, s, dx ? (T *)dx->data : NULL, pw, pb,
                                  (const T *)g->data, (const T *)x->data, (const S *)mean->data,
                                  (const S *)rstd->data, (const P *)data_or_null(w), m, d,
                                  (add & NB__LN_ADD_DX) != 0);
        NB_CUDA_CHECK_LAUNCH(op);
        if (sums) {
            dim3 grid((unsigned)((d + COL_TILE - 1) / COL_TILE)), block(COL_TILE, SUM_LANES);
            layer_norm_dwdb_sum_kernel<T, P><<<grid, block, 0, s>>>(
                dw ? (P *)dw->data : NULL, db ? (P *)db->data : NULL, pw, pb, nb, d,
                (add & NB__LN_ADD_DW) != 0, (add & NB__LN_ADD_DB) != 0);
            NB_CUDA_CHECK_LAUNCH(op);
            nb__ctx_scratch_done((dw ? dw : db)->ctx, pw, 2 * (size_t)nb * (size_t)d * sizeof(A));
        }
        return true;
    }
}

template <typename T, typename S, typename P>
static void launch_backward(cudaStream_t s, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                            const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                            const nb_tensor *rstd, const nb_tensor *w, int64_t m, int64_t d,
                            unsigned add, const char *op) {
    typedef math_t<T> A;
    if (launch_backward_regs<T, S, P>(s, dx, dw, db, g, x, mean, rstd, w, m, d, add, op)) return;
    const S *mu = (const S *)mean->data, *r = (const S *)rstd->data;
    if (dx && m > 0) {
        layer_norm_dx_kernel<T, S, P><<<row_grid(m), WARPS * 32, 0, s>>>(
            (T *)dx->data, (const T *)g->data, (const T *)x->data, mu, r,
            (const P *)data_or_null(w), m, d, (add & NB__LN_ADD_DX) != 0);
        NB_CUDA_CHECK_LAUNCH(op);
    }
    if (!dw && !db) return;
    int64_t rows_per_chunk = (m + MAX_CHUNKS - 1) / MAX_CHUNKS;
    if (rows_per_chunk < 4 * ROW_LANES) rows_per_chunk = 4 * ROW_LANES;
    int64_t chunks = m > 0 ? (m + rows_per_chunk - 1) / rows_per_chunk : 1;
    nb_ctx *ctx = (dw ? dw : db)->ctx;
    A *pw = (A *)nb_ctx_alloc(ctx, 2 * (size_t)chunks * (size_t)d * sizeof(A), 0);
    A *pb = pw + chunks * d;
    if (m > 0) {
        dim3 grid((unsigned)((d + COL_TILE - 1) / COL_TILE), (unsigned)chunks);
        dim3 block(COL_TILE, ROW_LANES);
        layer_norm_dwdb_partial_kernel<T, S><<<grid, block, 0, s>>>(
            pw, pb, (const T *)g->data, (const T *)x->data, mu, r, m, d, rows_per_chunk);
        NB_CUDA_CHECK_LAUNCH(op);
    } else {
        NB_CUDA_CHECK(op, cudaMemsetAsync(pw, 0, 2 * (size_t)d * sizeof(A), s));
    }
    int64_t fb = (d + 255) / 256;
    layer_norm_dwdb_final_kernel<T, P><<<(unsigned)(fb < 65536 ? fb : 65536), 256, 0, s>>>(
        dw ? (P *)dw->data : NULL, db ? (P *)db->data : NULL, pw, pb, chunks, d,
        (add & NB__LN_ADD_DW) != 0, (add & NB__LN_ADD_DB) != 0);
    NB_CUDA_CHECK_LAUNCH(op);
    nb__ctx_scratch_done(ctx, pw, 2 * (size_t)chunks * (size_t)d * sizeof(A));
}

/* ------------------------------------------------------------- entry points */
/* Whether the weight and bias (and their gradients), those given, are f32
 * for a bf16 or f16 x; else they must be of x's dtype. */
static bool params_f32(const char *op, const nb_tensor *x, const nb_tensor *p,
                       const nb_tensor *q) {
    nb_dtype pd = p ? p->dtype : q ? q->dtype : x->dtype;
    bool half = x->dtype == NB_BF16 || x->dtype == NB_F16;
    NB_CHECK((!p || p->dtype == pd) && (!q || q->dtype == pd) &&
                 (pd == x->dtype || (half && pd == NB_F32)),
             "%s: weight and bias must be of the input's dtype %s (or f32 for a bf16 or f16 "
             "input), got %s", op, nb_dtype_name(x->dtype), nb_dtype_name(pd));
    return pd != x->dtype;
}

void nb__cuda_layer_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x,
                         const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d,
                         double eps) {
    const char *op = "nb_layer_norm";
    int dev = x->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    if (m == 0) return;
    bool f64_stats = mean->dtype == NB_F64;
    NB_CHECK(mean->dtype == rstd->dtype &&
                 (mean->dtype == NB_F32 || (f64_stats && x->dtype == NB_F64)),
             "%s: statistics must be f32 (or f64 for f64 input), got %s for %s input", op,
             nb_dtype_name(mean->dtype), nb_dtype_name(x->dtype));
    bool f32_params = params_f32(op, x, w, b);
    by_float_dtype(op, x->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        if constexpr (std::is_same_v<T, double>) {
            if (f64_stats) {
                launch_forward<double, double, double>(s, y, mean, rstd, x, w, b, m, d, eps);
                return;
            }
        }
        if constexpr (sizeof(T) == 2) {
            if (f32_params) {
                launch_forward<T, float, float>(s, y, mean, rstd, x, w, b, m, d, eps);
                return;
            }
        }
        launch_forward<T, float, T>(s, y, mean, rstd, x, w, b, m, d, eps);
    });
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_layer_norm_backward_rows(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                       const nb_tensor *g, const nb_tensor *x,
                                       const nb_tensor *mean, const nb_tensor *rstd,
                                       const nb_tensor *w, int64_t m, int64_t d, unsigned add) {
    const char *op = "nb_layer_norm (backward)";
    int dev = x->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    if (d == 0 || (!dx && !dw && !db)) return;
    bool f64_stats = mean->dtype == NB_F64;
    bool f32_params = params_f32(op, x, w, dw ? dw : db);
    by_float_dtype(op, x->dtype, [&](auto t) {
        typedef typename decltype(t)::type T;
        if constexpr (std::is_same_v<T, double>) {
            if (f64_stats) {
                launch_backward<double, double, double>(s, dx, dw, db, g, x, mean, rstd, w, m, d,
                                                        add, op);
                return;
            }
        }
        if constexpr (sizeof(T) == 2) {
            if (f32_params) {
                launch_backward<T, float, float>(s, dx, dw, db, g, x, mean, rstd, w, m, d, add, op);
                return;
            }
        }
        launch_backward<T, float, T>(s, dx, dw, db, g, x, mean, rstd, w, m, d, add, op);
    });
}
