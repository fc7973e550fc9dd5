/* In-memory datasets: copies of an inputs tensor (N, ...) and a targets
 * tensor (N, ...); sample i is row i of each. */
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"

int64_t nb__rows_len(void *self) { return ((nb__rows *)self)->n; }

nb_status nb__rows_get(void *self, int64_t i, void *input, void *target) {
    nb__rows *r = self;
    memcpy(input, r->inputs + (size_t)i * r->in_bytes, r->in_bytes);
    memcpy(target, r->targets + (size_t)i * r->tgt_bytes, r->tgt_bytes);
    return NB_OK;
}

void nb__rows_free(void *self) {
    nb__rows *r = self;
    if (!r) return;
    free(r->inputs);
    free(r->targets);
    free(r);
}

static const nb_dataset_vtable tensor_vt = {"tensors", nb__rows_len, nb__rows_get, nb__rows_free};

static nb_field row_field(const nb_tensor *t) {
    return nb_field_of(t->dtype, t->ndim - 1, t->shape + 1);
}

static char *host_copy(const nb_tensor *t) {
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    char *p = malloc(bytes ? bytes : 1);
    NB_CHECK(p, "nb_dataset_from_tensors: out of memory copying %zu bytes", bytes);
    nb_to_host(t, p);
    return p;
}

nb_dataset *nb_dataset_from_tensors(const nb_tensor *inputs, const nb_tensor *targets) {
    NB_CHECK(inputs && targets, "nb_dataset_from_tensors: inputs and targets are required");
    NB_CHECK(inputs->ndim >= 1 && targets->ndim >= 1,
             "nb_dataset_from_tensors: inputs %s and targets %s need a first (sample) dimension",
             nb_shape_str(inputs), nb_shape_str(targets));
    NB_CHECK(inputs->shape[0] == targets->shape[0],
             "nb_dataset_from_tensors: inputs %s and targets %s have different sample counts",
             nb_shape_str(inputs), nb_shape_str(targets));
    NB_CHECK(inputs->device.type == NB_DEVICE_CPU && targets->device.type == NB_DEVICE_CPU,
             "nb_dataset_from_tensors: tensors on %s and %s; datasets hold host memory, "
             "give CPU tensors", nb_device_name(inputs->device), nb_device_name(targets->device));
    nb__rows *t = calloc(1, sizeof *t);
    NB_CHECK(t, "nb_dataset_from_tensors: out of memory");
    nb_field in = row_field(inputs), tgt = row_field(targets);
    t->n = inputs->shape[0];
    t->in_bytes = nb_field_bytes(&in);
    t->tgt_bytes = nb_field_bytes(&tgt);
    t->inputs = host_copy(inputs);
    t->targets = host_copy(targets);
    return nb_dataset_new(&tensor_vt, t, in, tgt);
}
