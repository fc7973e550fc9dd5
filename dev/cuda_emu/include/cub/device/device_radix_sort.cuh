/* Stand-in for CUB's DeviceRadixSort (dev/cuda_emu): SortPairs as a
 * stable sort on the host by the key bits [begin_bit, end_bit), which is
 * what the radix sort computes (tensor/cuda/embedding.cu relies on its
 * stability). The first call (temp NULL) asks for a byte of scratch. */
#pragma once
#include <stdint.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "cuda_runtime.h"

namespace cub {
struct DeviceRadixSort {
    template <class K, class V>
    static cudaError_t SortPairs(void *temp, size_t &temp_bytes, const K *keys_in, K *keys_out,
                                 const V *vals_in, V *vals_out, int n, int begin_bit = 0,
                                 int end_bit = (int)(sizeof(K) * 8), cudaStream_t = 0) {
        if (!temp) {
            temp_bytes = 1;
            return cudaSuccess;
        }
        auto bits = [&](K k) {
            uint64_t u = (uint64_t)k >> begin_bit;
            int w = end_bit - begin_bit;
            return w >= 64 ? u : u & ((uint64_t(1) << w) - 1);
        };
        std::vector<int> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](int a, int b) { return bits(keys_in[a]) < bits(keys_in[b]); });
        std::vector<K> k(n);
        std::vector<V> v(n);
        for (int i = 0; i < n; i++) k[i] = keys_in[order[i]], v[i] = vals_in[order[i]];
        std::copy(k.begin(), k.end(), keys_out);
        std::copy(v.begin(), v.end(), vals_out);
        return cudaSuccess;
    }
};
} // namespace cub
