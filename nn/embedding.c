/* Embedding over nb_embedding: a (num, dim) table initialised N(0, 1) as
 * PyTorch does; padding_idx and max_norm are not supported. */
#include "nn/internal.h"

typedef struct embedding {
    int64_t num, dim;
    nb_tensor *weight; /* (num, dim) */
} embedding;

static void emb_describe(nb_module *m, char *buf, size_t size) {
    const embedding *e = m->self;
    snprintf(buf, size, "%lld, %lld", (long long)e->num, (long long)e->dim);
}

static nb_tensor *emb_forward(nb_module *m, nb_ctx *ctx, nb_tensor *idx) {
    const embedding *e = m->self;
    return nb_embedding(ctx, e->weight, idx);
}

static const nb_module_type emb_type = {"Embedding", sizeof(embedding), emb_forward, emb_describe};

nb_module *nb_embedding_new(nb_ctx *ctx, nb_dtype dtype, int64_t num_embeddings,
                            int64_t embedding_dim, nb_rng *rng) {
    nb__nn_check_dtype("nb_embedding_new", dtype);
    NB_CHECK(num_embeddings > 0 && embedding_dim > 0,
             "nb_embedding_new: num_embeddings %lld and embedding_dim %lld must be positive",
             (long long)num_embeddings, (long long)embedding_dim);
    nb_module *m = nb_module_new(ctx, &emb_type);
    embedding *e = m->self;
    e->num = num_embeddings;
    e->dim = embedding_dim;
    e->weight = nb_module_add_param(
        m, "weight", nb_rand_normal(ctx, dtype, NB_SHAPE(num_embeddings, embedding_dim), 0.0, 1.0, rng));
    return m;
}
