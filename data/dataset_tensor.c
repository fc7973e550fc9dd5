/* In-memory datasets: copies of an inputs tensor (N, ...) and a targets
 * tensor (N, ...); sample i is row i of each. */
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"

typedef struct tensor_ds {
    int64_t n;
    size_t in_bytes, tgt_bytes; /* per sample */
    char *inputs, *targets;
} tensor_ds;

static int64_t tensor_len(void *self) { return ((tensor_ds *)self)->n; }

static nb_status tensor_get(void *self, int64_t i, void *input, void *target) {
    tensor_ds *t = self;
    memcpy(input, t->inputs + (size_t)i * t->in_bytes, t->in_bytes);
    memcpy(target, t->targets + (size_t)i * t->tgt_bytes, t->tgt_bytes);
    return NB_OK;
}

static void tensor_free(void *self) {
    tensor_ds *t = self;
    free(t->inputs);
    free(t->targets);
    free(t);
}

static const nb_dataset_vtable tensor_vt = {"tensors", tensor_len, tensor_get, tensor_free};

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
    tensor_ds *t = calloc(1, sizeof *t);
    NB_CHECK(t, "nb_dataset_from_tensors: out of memory");
    nb_field in = row_field(inputs), tgt = row_field(targets);
    t->n = inputs->shape[0];
    t->in_bytes = nb_field_bytes(&in);
    t->tgt_bytes = nb_field_bytes(&tgt);
    t->inputs = host_copy(inputs);
    t->targets = host_copy(targets);
    return nb_dataset_new(&tensor_vt, t, in, tgt);
}
