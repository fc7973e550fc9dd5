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
