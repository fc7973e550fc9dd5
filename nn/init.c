/* In-place initialisation of existing tensors from a random stream, and the
 * fan-in that PyTorch's default schemes use.
 *
 * The values are drawn exactly as nb_rand_uniform / nb_rand_normal would
 * draw them for a fresh tensor of the same shape with the same generator
 * state, into a scratch context on the tensor's device, then copied in. */
#include "nn/internal.h"

static void fill_from(nb_tensor *t, double a, double b, nb_rng *rng, bool normal,
                      const char *fn) {
    NB_CHECK(t, "%s: tensor is NULL", fn);
    NB_CHECK(nb_dtype_is_float(t->dtype), "%s: tensor %s has dtype %s; only float tensors can be "
             "initialised", fn, nb_shape_str(t), nb_dtype_name(t->dtype));
    nb_ctx *scratch = nb_ctx_new(t->device, (size_t)nb_numel(t) * nb_dtype_size(t->dtype) + 64);
    nb_tensor *r = normal ? nb_rand_normal(scratch, t->dtype, t->ndim, t->shape, a, b, rng)
                          : nb_rand_uniform(scratch, t->dtype, t->ndim, t->shape, a, b, rng);
    nb_copy_(t, r);
    nb_ctx_free(scratch);
}

void nb_init_uniform_(nb_tensor *t, double low, double high, nb_rng *rng) {
    NB_CHECK(low <= high, "nb_init_uniform_: low %g > high %g", low, high);
    fill_from(t, low, high, rng, false, "nb_init_uniform_");
}

void nb_init_normal_(nb_tensor *t, double mean, double std, nb_rng *rng) {
    NB_CHECK(std >= 0, "nb_init_normal_: std %g is negative", std);
    fill_from(t, mean, std, rng, true, "nb_init_normal_");
}

int64_t nb_init_fan_in(const nb_tensor *weight) {
    NB_CHECK(weight->ndim >= 2, "nb_init_fan_in: weight %s needs at least 2 dims (out, in, ..)",
             nb_shape_str(weight));
    int64_t fan = weight->shape[1];
    for (int d = 2; d < weight->ndim; d++) fan *= weight->shape[d];
    return fan;
}
