/* The dataset handle: a vtable, its object, the two sample fields and a
 * reference count. Reference counts are plain integers: datasets are made
 * and freed on one thread (see include/nabla/dataset.h). */
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"
#include "util/handle.h"

struct nb_dataset {
    const nb_dataset_vtable *vt;
    void *self;
    nb_field input, target;
    int refs;
};

nb_field nb_field_of(nb_dtype dtype, int ndim, const int64_t *shape) {
    NB_CHECK(ndim >= 0 && ndim <= NB_MAX_DIMS - 1,
             "nb_field_of: %d dims; a sample has at most %d (a batch adds one)", ndim,
             NB_MAX_DIMS - 1);
    nb_field f;
    memset(&f, 0, sizeof f);
    f.dtype = dtype;
    f.ndim = ndim;
    for (int d = 0; d < ndim; d++) f.shape[d] = shape[d];
    return f;
}

int64_t nb_field_numel(const nb_field *f) {
    int64_t n = 1;
    for (int d = 0; d < f->ndim; d++) n *= f->shape[d];
    return n;
}

size_t nb_field_bytes(const nb_field *f) {
    return (size_t)nb_field_numel(f) * nb_dtype_size(f->dtype);
}

void nb__check_field(const char *op, const char *which, const nb_field *f) {
    NB_CHECK((unsigned)f->dtype < NB_DTYPE_COUNT, "%s: %s dtype %d is not a dtype", op, which,
             (int)f->dtype);
    NB_CHECK(f->ndim >= 0 && f->ndim <= NB_MAX_DIMS - 1, "%s: %s has %d dims (at most %d)", op,
             which, f->ndim, NB_MAX_DIMS - 1);
    for (int d = 0; d < f->ndim; d++)
        NB_CHECK(f->shape[d] > 0, "%s: %s dimension %d has size %lld", op, which, d,
                 (long long)f->shape[d]);
}

nb_dataset *nb_dataset_new(const nb_dataset_vtable *vt, void *self, nb_field input,
                           nb_field target) {
    NB_CHECK(vt && vt->len && vt->get, "nb_dataset_new: the vtable needs len and get");
    nb__check_field("nb_dataset_new", "input", &input);
    nb__check_field("nb_dataset_new", "target", &target);
    nb_dataset *ds = calloc(1, sizeof *ds);
    NB_CHECK(ds, "nb_dataset_new: out of memory");
    ds->vt = vt;
    ds->self = self;
    ds->input = input;
    ds->target = target;
    ds->refs = 1;
    return ds;
}

nb_dataset *nb_dataset_retain(nb_dataset *ds) {
    NB__CHECK_HANDLE("nb_dataset_retain", ds, "dataset");
    NB_CHECK(ds && ds->refs > 0, "nb_dataset_retain: dataset already freed");
    ds->refs++;
    return ds;
}

void nb_dataset_free(nb_dataset *ds) {
    if (!ds) return;
    NB_CHECK(ds->refs > 0, "nb_dataset_free: dataset already freed");
    if (--ds->refs > 0) return;
    if (ds->vt->free) ds->vt->free(ds->self);
    free(ds);
}

NB__HANDLE_GETTER(int64_t, nb_dataset_len, const nb_dataset, ds, "dataset", ds->vt->len(ds->self))
NB__HANDLE_GETTER(nb_field, nb_dataset_input, const nb_dataset, ds, "dataset", ds->input)
NB__HANDLE_GETTER(nb_field, nb_dataset_target, const nb_dataset, ds, "dataset", ds->target)
NB__HANDLE_GETTER(const char *, nb_dataset_name, const nb_dataset, ds, "dataset",
                  ds->vt->name ? ds->vt->name : "dataset")

nb_status nb_dataset_get(const nb_dataset *ds, int64_t index, void *input, void *target) {
    NB__CHECK_HANDLE("nb_dataset_get", ds, "dataset");
    int64_t n = nb_dataset_len(ds);
    NB_CHECK(index >= 0 && index < n, "nb_dataset_get: index %lld out of range for %s dataset "
             "of %lld samples", (long long)index, nb_dataset_name(ds), (long long)n);
    return ds->vt->get(ds->self, index, input, target);
}

nb_status nb__dataset_get(const nb_dataset *ds, int64_t index, void *input, void *target) {
    return ds->vt->get(ds->self, index, input, target);
}

void *nb__dataset_self(const nb_dataset *ds, const nb_dataset_vtable *vt) {
    return ds->vt == vt ? ds->self : NULL;
}
