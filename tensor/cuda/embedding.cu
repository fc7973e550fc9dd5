/* Embedding gather, the GPT's input (token plus position rows), and their
 * deterministic backwards on CUDA (the op is tensor/ops_embedding.c, the
 * CPU's kernels tensor/cpu/embedding.c).
 *
 * Forward copies rows (any dtype, raw bits); an index outside [0, V)
 * writes a zero row and raises NB__FAULT_EMBEDDING_INDEX (Note [Deferred
 * device checks] in tensor/cuda/cuda.h). The GPT's input has a thread per
 * (position t, column) that reads wpe[t] once and runs over the batch,
 * adding in f32 (f64 for f64) and rounding once to the output's dtype.
 *
 * Backward without atomics: the (index, position) pairs are sorted by
 * index with CUB's radix sort, which is stable, so equal indices keep
 * their positions in increasing order; out-of-range indices get the key V
 * and sort last, where no row looks. Then, for each row r of gw and each
 * tile of 32 columns (grid.y), one warp finds r's run of equal keys by
 * binary search in the sorted keys and sums that run's rows of g, in
 * increasing position from 0, into row r (a lane per column): written, a
 * row no index hits written 0 the same way, so gw needs no zeroing pass
 * first and each of its elements is written once; or, accumulating (Note
 * [Embedding gradients in place] in tensor/ops_embedding.c), added into
 * the row, rows no index hits left alone. Tiles of one run go to different
 * warps, so a frequent index (a padding token) does not leave all of C to
 * one warp. For f32 this is the CPU's own sequence of additions, so the
 * result is bit-identical to it; 16-bit gradients (into a gw of their own
 * dtype or an f32 one) accumulate in f32. The position table's gradient is
 * a thread per (t, column) summing over the batch in increasing n.
 *
 * Letters: V rows of the table, C columns, P index positions (N sequences
 * of T). */
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/types.cuh"

/* ------------------------------------------------------------------ helpers */

static const int THREADS = 256;
static const int WARPS = THREADS / 32;

static unsigned grid_for(int64_t work, int per_block) {
    int64_t b = (work + per_block - 1) / per_block;
    return (unsigned)(b < 65536 ? b : 65536);
}

/* ------------------------------------------------------------------ kernels */
// out (P, C) = w[idx[p]]; w (V, C) with strides (sv, sc); E: a type of the element's size
template <typename E, typename I>
static __global__ void embedding_kernel(E *__restrict__ out, const E *__restrict__ w,
                                        const I *__restrict__ idx, int64_t np, int64_t v,
                                        int64_t c, int64_t sv, int64_t sc,
                                        nb__cuda_fault *fault) {
    int64_t total = np * c;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int64_t p = e / c, j = e - p * c;
        int64_t r = (int64_t)idx[p];
        if (r >= 0 && r < v) {
            out[e] = w[r * sv + j * sc];
        } else {
            out[e] = E(0);
            if (j == 0 && atomicCAS(&fault->code, 0, (int)NB__FAULT_EMBEDDING_INDEX) == 0) {
                fault->value = (long long)r;
                fault->position = (long long)p;
                fault->limit = (long long)v;
                __threadfence_system();
            }
        }
    }
}

// keys (P) = idx, or V when out of range; pos (P) = 0, 1, ...
template <typename I>
static __global__ void embedding_keys_kernel(uint64_t *__restrict__ keys, int32_t *__restrict__ pos,
                                             const I *__restrict__ idx, int64_t np, int64_t v) {
    for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < np;
         p += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = (int64_t)idx[p];
        keys[p] = (uint64_t)(r >= 0 && r < v ? r : v);
        pos[p] = (int32_t)p;
    }
}

// The first of keys[0, np) (sorted) that is >= r.
static __device__ __forceinline__ int64_t first_at_least(const uint64_t *__restrict__ keys,
                                                         int64_t np, uint64_t r) {
    int64_t lo = 0, hi = np;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < r) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// gw (V, C), every row: the sum of g (P, C)'s rows of its run of equal sorted keys, stored
// (0 for a row no index hits) or added (rows no index hits untouched); grid (rows / WARPS,
// column tiles of 32)
template <typename T, typename G>
static __global__ void embedding_backward_kernel(T *__restrict__ gw, const G *__restrict__ g,
                                                 const uint64_t *__restrict__ keys,
                                                 const int32_t *__restrict__ pos, int64_t np,
                                                 int64_t v, int64_t c, bool accumulate) {
    typedef math_t<T> A;
    int lane = threadIdx.x & 31;
    for (int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); r < v;
         r += (int64_t)gridDim.x * WARPS) {
        int64_t i = first_at_least(keys, np, (uint64_t)r), end = i;
        while (end < np && keys[end] == (uint64_t)r) end++;
        if (accumulate && i == end) continue;
        T *dst = gw + r * c;
        for (int64_t j = (int64_t)blockIdx.y * 32 + lane; j < c; j += (int64_t)gridDim.y * 32) {
            A acc = 0;
            for (int64_t k = i; k < end; k++) acc += (A)to_math(g[(int64_t)pos[k] * c + j]);
            dst[j] = store_as<T>(accumulate ? (A)to_math(dst[j]) + acc : acc);
        }
    }
}

// out (N, T, C) = wte[idx[n, t]] + wpe[t], rounded once; a thread per (t, column), over n
template <typename W, typename O, typename I>
static __global__ void embedding_pos_kernel(O *__restrict__ out, const W *__restrict__ wte,
                                            const W *__restrict__ wpe, const I *__restrict__ idx,
                                            int64_t n, int64_t t, int64_t v, int64_t c,
                                            int64_t sv, int64_t sc, int64_t pv, int64_t pc,
                                            nb__cuda_fault *fault) {
    typedef math_t<W> A;
    int64_t total = t * c;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int64_t tt = e / c, j = e - tt * c;
        A b = (A)to_math(wpe[tt * pv + j * pc]);
        for (int64_t s = 0; s < n; s++) {
            int64_t p = s * t + tt, r = (int64_t)idx[p];
            if (r >= 0 && r < v) {
                out[p * c + j] = store_as<O>((A)to_math(wte[r * sv + j * sc]) + b);
            } else {
                out[p * c + j] = store_as<O>(A(0));
                if (j == 0 && atomicCAS(&fault->code, 0, (int)NB__FAULT_EMBEDDING_INDEX) == 0) {
                    fault->value = (long long)r;
                    fault->position = (long long)p;
                    fault->limit = (long long)v;
                    __threadfence_system();
                }
            }
        }
    }
}

// gpos (P, C): row t < T the sum over n of g (N, T, C)'s (n, t) rows, stored or added; rows
// >= T 0 or, accumulating, untouched
template <typename T, typename G>
static __global__ void embedding_pos_backward_kernel(T *__restrict__ gpos, const G *__restrict__ g,
                                                     int64_t n, int64_t t, int64_t rows, int64_t c,
                                                     bool accumulate) {
    typedef math_t<T> A;
    int64_t total = (accumulate ? t : rows) * c;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int64_t tt = e / c, j = e - tt * c;
        A acc = 0;
        if (tt < t)
            for (int64_t s = 0; s < n; s++) acc += (A)to_math(g[(s * t + tt) * c + j]);
        gpos[e] = store_as<T>(accumulate ? (A)to_math(gpos[e]) + acc : acc);
    }
}

/* ---------------------------------------------------------------- launchers */
template <typename E>
static void launch_forward(cudaStream_t s, nb_tensor *out, const nb_tensor *w,
                           const nb_tensor *idx, int64_t np, nb__cuda_fault *fault) {
    int64_t v = w->shape[0], c = w->shape[1];
    unsigned grid = grid_for(np * c, THREADS);
    if (idx->dtype == NB_I32)
        embedding_kernel<E, int32_t><<<grid, THREADS, 0, s>>>(
            (E *)out->data, (const E *)w->data, (const int32_t *)idx->data, np, v, c,
            w->strides[0], w->strides[1], fault);
    else
        embedding_kernel<E, int64_t><<<grid, THREADS, 0, s>>>(
            (E *)out->data, (const E *)w->data, (const int64_t *)idx->data, np, v, c,
            w->strides[0], w->strides[1], fault);
}

template <typename T, typename G>
static void launch_backward(cudaStream_t s, nb_tensor *gw, const nb_tensor *g, const uint64_t *keys,
                            const int32_t *pos, int64_t np, bool accumulate) {
    int64_t c = gw->shape[1], tiles = (c + 31) / 32;
    dim3 grid(grid_for(gw->shape[0], WARPS), (unsigned)(tiles < 65535 ? tiles : 65535));
    embedding_backward_kernel<T, G><<<grid, THREADS, 0, s>>>(
        (T *)gw->data, (const G *)g->data, keys, pos, np, gw->shape[0], c, accumulate);
}

template <typename W, typename O>
static void launch_pos(cudaStream_t s, nb_tensor *out, const nb_tensor *wte, const nb_tensor *wpe,
                       const nb_tensor *idx, nb__cuda_fault *fault) {
    int64_t n = idx->shape[0], t = idx->shape[1], v = wte->shape[0], c = wte->shape[1];
    unsigned grid = grid_for(t * c, THREADS);
    if (idx->dtype == NB_I32)
        embedding_pos_kernel<W, O, int32_t><<<grid, THREADS, 0, s>>>(
            (O *)out->data, (const W *)wte->data, (const W *)wpe->data,
            (const int32_t *)idx->data, n, t, v, c, wte->strides[0], wte->strides[1],
            wpe->strides[0], wpe->strides[1], fault);
    else
        embedding_pos_kernel<W, O, int64_t><<<grid, THREADS, 0, s>>>(
            (O *)out->data, (const W *)wte->data, (const W *)wpe->data,
            (const int64_t *)idx->data, n, t, v, c, wte->strides[0], wte->strides[1],
            wpe->strides[0], wpe->strides[1], fault);
}

template <typename T, typename G>
static void launch_pos_backward(cudaStream_t s, nb_tensor *gpos, const nb_tensor *g,
                                bool accumulate) {
    int64_t rows = gpos->shape[0], c = gpos->shape[1];
    unsigned grid = grid_for((accumulate ? g->shape[1] : rows) * c, THREADS);
    embedding_pos_backward_kernel<T, G><<<grid, THREADS, 0, s>>>(
        (T *)gpos->data, (const G *)g->data, g->shape[0], g->shape[1], rows, c, accumulate);
}

/* fn(tag<T>{}, tag<G>{}) for a gradient table of dtype tw and a gradient of
 * dtype tg: tg = tw, or 16-bit into f32 (the pairs the backend's contract
 * allows) */
template <class Fn> static void by_grad_dtypes(const char *op, nb_dtype tw, nb_dtype tg, Fn fn) {
    if (tw == NB_F32 && tg == NB_BF16) return fn(tag<float>{}, tag<bf16>{});
    if (tw == NB_F32 && tg == NB_F16) return fn(tag<float>{}, tag<f16>{});
    NB_CHECK(tw == tg, "%s: a %s gradient into a %s table has no CUDA kernel", op,
             nb_dtype_name(tg), nb_dtype_name(tw));
    by_float_dtype(op, tw, [&](auto t) { fn(t, t); });
}

/* ------------------------------------------------------------- entry points */
void nb__cuda_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np) {
    const char *op = "nb_embedding";
    int dev = w->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    if (np == 0 || w->shape[1] == 0) return;
    nb__cuda_fault *fault = nb__cuda_fault_slot(dev);
    by_dtype_bits(w->dtype, [&](auto t) {
        launch_forward<typename decltype(t)::type>(s, out, w, idx, np, fault);
    });
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                 int64_t np, bool accumulate) {
    const char *op = "nb_embedding (backward)";
    int dev = gw->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    int64_t v = gw->shape[0], c = gw->shape[1];
    if (v == 0 || c == 0 || (np == 0 && accumulate)) return;
    if (np == 0) { /* nothing to sort: zeros */
        NB_CUDA_CHECK(op, cudaMemsetAsync(gw->data, 0, (size_t)(v * c) * nb_dtype_size(gw->dtype), s));
        return;
    }
    NB_CHECK(np <= INT32_MAX, "%s: %lld index positions; at most %d are supported", op,
             (long long)np, INT32_MAX);
    int n = (int)np;
    int end_bit = 1;
    while (end_bit < 64 && ((uint64_t)v >> end_bit) != 0) end_bit++;

    nb_ctx *ctx = gw->ctx;
    uint64_t *keys_in = (uint64_t *)nb_ctx_alloc(ctx, 2 * (size_t)n * sizeof(uint64_t), 0);
    uint64_t *keys_out = keys_in + n;
    int32_t *pos_in = (int32_t *)nb_ctx_alloc(ctx, 2 * (size_t)n * sizeof(int32_t), 0);
    int32_t *pos_out = pos_in + n;
    size_t temp_bytes = 0;
    NB_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out,
                                                      pos_in, pos_out, n, 0, end_bit, s));
    void *temp = nb_ctx_alloc(ctx, temp_bytes ? temp_bytes : 1, 0);

    if (idx->dtype == NB_I32)
        embedding_keys_kernel<int32_t><<<grid_for(np, THREADS), THREADS, 0, s>>>(
            keys_in, pos_in, (const int32_t *)idx->data, np, v);
    else
        embedding_keys_kernel<int64_t><<<grid_for(np, THREADS), THREADS, 0, s>>>(
            keys_in, pos_in, (const int64_t *)idx->data, np, v);
    NB_CUDA_CHECK_LAUNCH(op);
    NB_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out,
                                                      pos_in, pos_out, n, 0, end_bit, s));
    by_grad_dtypes(op, gw->dtype, g->dtype, [&](auto tw, auto tg) {
        launch_backward<typename decltype(tw)::type, typename decltype(tg)::type>(
            s, gw, g, keys_out, pos_out, np, accumulate);
    });
    NB_CUDA_CHECK_LAUNCH(op);
    /* later kernels on s reuse them after these: Note [Memory given back] */
    nb__ctx_scratch_done(ctx, temp, temp_bytes ? temp_bytes : 1);
    nb__ctx_scratch_done(ctx, pos_in, 2 * (size_t)n * sizeof(int32_t));
    nb__ctx_scratch_done(ctx, keys_in, 2 * (size_t)n * sizeof(uint64_t));
}

void nb__cuda_embedding_pos(nb_tensor *out, const nb_tensor *wte, const nb_tensor *wpe,
                            const nb_tensor *idx) {
    const char *op = "nb_embedding (token + position)";
    int dev = wte->device.index;
    cudaStream_t s = nb__cuda_enter(op, dev);
    if (nb_numel(out) == 0) return;
    nb__cuda_fault *fault = nb__cuda_fault_slot(dev);
    by_float_dtype(op, wte->dtype, [&](auto tw) {
        typedef typename decltype(tw)::type W;
        if (out->dtype == wte->dtype) return launch_pos<W, W>(s, out, wte, wpe, idx, fault);
        NB_CHECK(wte->dtype == NB_F32 && (out->dtype == NB_BF16 || out->dtype == NB_F16),
                 "%s: %s output of %s tables has no CUDA kernel", op, nb_dtype_name(out->dtype),
                 nb_dtype_name(wte->dtype));
        if constexpr (std::is_same_v<W, float>) {
            if (out->dtype == NB_BF16) launch_pos<float, bf16>(s, out, wte, wpe, idx, fault);
            else launch_pos<float, f16>(s, out, wte, wpe, idx, fault);
        }
    });
    NB_CUDA_CHECK_LAUNCH(op);
}

void nb__cuda_embedding_pos_backward(nb_tensor *gpos, const nb_tensor *g, bool accumulate) {
    const char *op = "nb_embedding (token + position, backward)";
    cudaStream_t s = nb__cuda_enter(op, gpos->device.index);
    if (nb_numel(gpos) == 0) return;
    by_grad_dtypes(op, gpos->dtype, g->dtype, [&](auto tw, auto tg) {
        launch_pos_backward<typename decltype(tw)::type, typename decltype(tg)::type>(
            s, gpos, g, accumulate);
    });
    NB_CUDA_CHECK_LAUNCH(op);
}
