/* Index subsets of a dataset, and the seeded train/test split built on
 * them. A subset holds a reference to its base. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "util/handle.h"

typedef struct subset_ds {
    nb_dataset *base;
    int64_t n;
    int64_t *indices;
} subset_ds;

static int64_t subset_len(void *self) { return ((subset_ds *)self)->n; }

static nb_status subset_get(void *self, int64_t i, void *input, void *target) {
    subset_ds *s = self;
    return nb__dataset_get(s->base, s->indices[i], input, target);
}

static void subset_free(void *self) {
    subset_ds *s = self;
    nb_dataset_free(s->base);
    free(s->indices);
    free(s);
}

static const nb_dataset_vtable subset_vt = {"subset", subset_len, subset_get, subset_free};

nb_dataset *nb_dataset_subset(nb_dataset *base, const int64_t *indices, int64_t n) {
    NB__CHECK_HANDLE("nb_dataset_subset", base, "dataset");
    NB_CHECK(n >= 0 && (n == 0 || indices), "nb_dataset_subset: %lld indices at %p",
             (long long)n, (const void *)indices);
    int64_t len = nb_dataset_len(base);
    for (int64_t i = 0; i < n; i++)
        NB_CHECK(indices[i] >= 0 && indices[i] < len, "nb_dataset_subset: indices[%lld] = %lld "
                 "is out of range for a dataset of %lld samples", (long long)i,
                 (long long)indices[i], (long long)len);
    subset_ds *s = calloc(1, sizeof *s);
    int64_t *copy = malloc(sizeof *copy * (size_t)(n ? n : 1));
    NB_CHECK(s && copy, "nb_dataset_subset: out of memory for %lld indices", (long long)n);
    if (n) memcpy(copy, indices, sizeof *copy * (size_t)n);
    s->base = nb_dataset_retain(base);
    s->n = n;
    s->indices = copy;
    return nb_dataset_new(&subset_vt, s, nb_dataset_input(base), nb_dataset_target(base));
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

void nb_dataset_split(nb_dataset *ds, double test_fraction, uint64_t seed, nb_dataset **train,
                      nb_dataset **test) {
    NB_CHECK(test_fraction >= 0 && test_fraction <= 1,
             "nb_dataset_split: test_fraction %g is not in [0, 1]", test_fraction);
    NB__CHECK_HANDLE("nb_dataset_split", ds, "dataset");
    int64_t n = nb_dataset_len(ds);
    int64_t n_test = (int64_t)floor(test_fraction * (double)n + 0.5);
    if (n_test > n) n_test = n;
    int64_t *perm = malloc(sizeof *perm * (size_t)(n ? n : 1));
    NB_CHECK(perm, "nb_dataset_split: out of memory for %lld indices", (long long)n);
    nb__randperm(perm, n, seed);
    qsort(perm, (size_t)n_test, sizeof *perm, cmp_i64);
    qsort(perm + n_test, (size_t)(n - n_test), sizeof *perm, cmp_i64);
    *test = nb_dataset_subset(ds, perm, n_test);
    *train = nb_dataset_subset(ds, perm + n_test, n - n_test);
    free(perm);
}
