/* DDP's bucket partition and bucket orders (Note [Buckets] in ddp.c):
 * pure functions of sizes and orders, with no tensors and no process
 * group. */
#include <stdbool.h>
#include <stdlib.h>

#include "distributed/ddp_buckets.h"
#include "nabla/error.h"

int nb__ddp_partition(int n, const int *order, const int64_t *numel, const nb_dtype *dtype,
                      size_t first_bytes, size_t cap_bytes, int *starts) {
    int nb = 0;
    for (int start = 0; start < n;) {
        size_t limit = nb == 0 ? first_bytes : cap_bytes, bytes = 0;
        nb_dtype dt = dtype[order[start]];
        int end = start;
        while (end < n && dtype[order[end]] == dt) {
            bytes += (size_t)numel[order[end]] * nb_dtype_size(dt);
            end++;
            if (bytes >= limit) break;
        }
        starts[nb++] = start;
        start = end;
    }
    starts[nb] = n;
    return nb;
}

/* Note [Default bucket cap]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~
 * PyTorch's Reducer caps buckets at 25 MiB after a first one of 1 MiB.
 * For a model whose gradients take less than about 26 MiB that leaves
 * everything after the first MiB to one bucket, whose parameters (the
 * first layers) become ready only as backward ends: its all-reduce starts
 * then and none of it can hide behind backward. So the default cap
 * follows the model: a sixteenth of the gradients' bytes, so that the
 * buckets launched while backward runs carry most of them; at least
 * 256 KiB, the smallest cap measured (a floor, so that a small model is
 * not cut into many all-reduces, each with its fixed costs: the worker's
 * wake-up, the exchange's round trips); at most PyTorch's 25 MiB, which
 * a model of more than 400 MiB of gradients keeps (GPT-2 small's are
 * 475 MiB), as it keeps the 1 MiB first bucket. An explicit
 * bucket_cap_bytes is used as given.
 *
 * Measured with bench_ddp on 2 CPU ranks bound one to a vCPU, 1 thread
 * each, the builds before and after alternated on a machine shared with
 * other work (load average 4.7-5.4; benchmarks/RESULTS.md, "DDP's default
 * bucket cap from the gradients' size"), rank 0's hidden share and the
 * step, medians [min-max]:
 *   gpt (3.2 MB: buckets of 1032 and 2139 KiB, now 1032 KiB, eight of
 *   256-260 KiB and 74 KiB), 12 rounds: hidden 0.78 [0.60-0.88] ->
 *   0.92 [0.76-0.99], step 186.8 -> 133.5 ms, shorter in 12 of 12 pairs;
 *   gpt6 (19.2 MB: 1026 and 17693 KiB, now 13 buckets of 1-1.8 MiB), 6
 *   rounds: hidden 0.31 -> 0.98, step 617 -> 476 ms, shorter in 5 of 6.
 * The step's gain came partly from a shorter backward under that load
 * and may be smaller on an idle machine (not measured: none was idle).
 * Against other caps for the gpt (8 rounds each), 25 MiB after
 * a first bucket of 256 KiB hid 0.51 (its last bucket the bigger), whole
 * buckets of 512 KiB 0.88 and 0.96 (two caps giving the same buckets), of
 * 256 KiB 0.98. */
size_t nb__ddp_default_first(void) { return (size_t)1 << 20; }

size_t nb__ddp_default_cap(size_t grad_bytes) {
    size_t cap = grad_bytes / 16, lo = (size_t)256 << 10, hi = (size_t)25 << 20;
    return cap < lo ? lo : cap > hi ? hi : cap;
}

void nb__ddp_initial_order(int n, int *order) {
    for (int i = 0; i < n; i++) order[i] = n - 1 - i;
}

void nb__ddp_rebuild_order(int n, const int *ready, int n_ready, int *order) {
    bool *seen = calloc((size_t)(n ? n : 1), 1);
    NB_CHECK(seen != NULL, "nb_ddp: out of memory for %d parameters", n);
    int k = 0;
    for (int i = 0; i < n_ready; i++) {
        if (ready[i] < 0 || ready[i] >= n || seen[ready[i]]) {
            free(seen);
            NB_ABORT("nb_ddp: ready order entry %d (%d) is out of range or repeated (%d parameters)", i,
                     ready[i], n);
        }
        order[k++] = ready[i];
        seen[ready[i]] = true;
    }
    for (int i = n - 1; i >= 0; i--)
        if (!seen[i]) order[k++] = i;
    free(seen);
}
