/* Dropout over nb_dropout: active in training mode only. The generator is
 * kept by pointer so that the caller decides where dropout's randomness
 * comes from (one stream per rank, say) and its offset advances across
 * steps. */
#include "nn/internal.h"

typedef struct dropout {
    double p;
    nb_rng *rng; /* NULL: the default generator */
} dropout;

static void dropout_describe(nb_module *m, char *buf, size_t size) {
    snprintf(buf, size, "p=%g", ((const dropout *)m->self)->p);
}

static nb_tensor *dropout_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    const dropout *d = m->self;
    return nb_dropout(ctx, x, d->p, m->training, d->rng);
}

static const nb_module_type dropout_type = {"Dropout", sizeof(dropout), dropout_forward,
                                            dropout_describe};

nb_module *nb_dropout_new(nb_ctx *ctx, double p, nb_rng *rng) {
    NB_CHECK(p >= 0 && p <= 1, "nb_dropout_new: p must be in [0, 1], got %g", p);
    nb_module *m = nb_module_new(ctx, &dropout_type);
    dropout *d = m->self;
    d->p = p;
    d->rng = rng;
    return m;
}
