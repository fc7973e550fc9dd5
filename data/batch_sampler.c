/* The batch sampler: a sampler's epoch list cut into batches. The list is
 * computed once per epoch and cached; it is recomputed when the sampler's
 * epoch has changed since. */
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "util/handle.h"

struct nb_batch_sampler {
    nb_sampler *sampler;
    int64_t batch_size;
    bool drop_last;
    int64_t *list, list_len;
    int64_t list_epoch;
    bool valid;
};

int64_t nb_batch_count(int64_t n, int64_t batch_size, bool drop_last) {
    NB_CHECK(batch_size > 0, "nb_batch_count: batch_size %lld must be > 0", (long long)batch_size);
    return drop_last ? n / batch_size : (n + batch_size - 1) / batch_size;
}

nb_batch_sampler *nb_batch_sampler_new(nb_sampler *sampler, int64_t batch_size, bool drop_last) {
    NB__CHECK_HANDLE("nb_batch_sampler_new", sampler, "sampler");
    NB_CHECK(batch_size > 0, "nb_batch_sampler_new: batch_size %lld must be > 0",
             (long long)batch_size);
    nb_batch_sampler *bs = calloc(1, sizeof *bs);
    NB_CHECK(bs, "nb_batch_sampler_new: out of memory");
    bs->sampler = sampler;
    bs->batch_size = batch_size;
    bs->drop_last = drop_last;
    return bs;
}

void nb_batch_sampler_free(nb_batch_sampler *bs) {
    if (!bs) return;
    free(bs->list);
    free(bs);
}

NB__HANDLE_GETTER(int64_t, nb_batch_sampler_len, const nb_batch_sampler, bs, "batch sampler",
                  nb_batch_count(nb_sampler_len(bs->sampler), bs->batch_size, bs->drop_last))

void nb_batch_sampler_set_epoch(nb_batch_sampler *bs, int64_t epoch) {
    NB__CHECK_HANDLE("nb_batch_sampler_set_epoch", bs, "batch sampler");
    nb_sampler_set_epoch(bs->sampler, epoch);
}

static void refresh(nb_batch_sampler *bs) {
    int64_t epoch = nb_sampler_epoch(bs->sampler), n = nb_sampler_len(bs->sampler);
    if (bs->valid && bs->list_epoch == epoch && bs->list_len == n) return;
    int64_t *list = realloc(bs->list, sizeof *list * (size_t)(n ? n : 1));
    NB_CHECK(list, "nb_batch_sampler_get: out of memory for %lld indices", (long long)n);
    nb_sampler_indices(bs->sampler, list);
    bs->list = list;
    bs->list_len = n;
    bs->list_epoch = epoch;
    bs->valid = true;
}

int64_t nb_batch_sampler_get(nb_batch_sampler *bs, int64_t k, int64_t *out) {
    NB__CHECK_HANDLE("nb_batch_sampler_get", bs, "batch sampler");
    int64_t len = nb_batch_sampler_len(bs);
    NB_CHECK(k >= 0 && k < len, "nb_batch_sampler_get: batch %lld is out of range (%lld batches "
             "per epoch)", (long long)k, (long long)len);
    refresh(bs);
    int64_t start = k * bs->batch_size, size = bs->list_len - start;
    if (size > bs->batch_size) size = bs->batch_size;
    memcpy(out, bs->list + start, sizeof *out * (size_t)size);
    return size;
}
