/* The data module end to end, as in docs/data.md: the shipped breast-cancer
 * table, a seeded 80/20 split, standardisation fitted on the training part,
 * a shuffling loader, a linear classifier trained with cross-entropy, and
 * an exact evaluation with a shard sampler and metric sums (one process
 * here; under DDP each rank passes its rank and the sums are all-reduced). */
#include <stdio.h>

#include <nabla/nabla.h>

#define CHECK_OK(call)                                                      \
    do {                                                                    \
        if ((call) != NB_OK) {                                              \
            fprintf(stderr, "%s\n", nb_last_error());                       \
            return 1;                                                       \
        }                                                                   \
    } while (0)

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : NABLA_SOURCE_DIR "/examples/datasets/breast_cancer.csv";
    nb_dataset *table, *train_raw, *test_raw;
    CHECK_OK(nb_dataset_open_csv(&table, path, NULL)); /* label: the last column, "target" */
    nb_dataset_split(table, 0.2, 42, &train_raw, &test_raw);

    double mean[30], std[30];
    CHECK_OK(nb_dataset_fit_standardizer(train_raw, mean, std)); /* training part only */
    nb_dataset *train = nb_dataset_standardize(train_raw, mean, std);
    nb_dataset *test = nb_dataset_standardize(test_raw, mean, std);
    printf("%lld training and %lld test samples\n", (long long)nb_dataset_len(train),
           (long long)nb_dataset_len(test));

    nb_loader *loader;
    nb_loader_options opts = {.batch_size = 32, .shuffle = true, .seed = 0};
    CHECK_OK(nb_loader_new(&loader, train, &opts));

    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_zeros(params, NB_F32, NB_SHAPE(30, 2));
    nb_tensor *b = nb_zeros(params, NB_F32, NB_SHAPE(2));
    nb_set_requires_grad(w, true);
    nb_set_requires_grad(b, true);

    for (int epoch = 0; epoch < 10; epoch++) {
        nb_loader_set_epoch(loader, epoch);
        nb_batch batch;
        for (;;) {
            CHECK_OK(nb_loader_next(loader, step, &batch));
            if (!batch.inputs) break;
            nb_tensor *logits = nb_add(step, nb_matmul(step, batch.inputs, w), b); /* (B, 2) */
            nb_backward(nb_cross_entropy(step, logits, batch.targets, NULL));
            nb_axpy_(w, -0.1, w->grad);
            nb_axpy_(b, -0.1, b->grad);
            nb_zero_grad(w);
            nb_zero_grad(b);
            nb_ctx_reset(step);
        }
    }

    /* Exact evaluation: rank 0 of a world of 1; metric 0 = loss, 1 = correct. */
    nb_sampler *shard = nb_sampler_shard(nb_dataset_len(test), 1, 0);
    nb_loader *eval;
    nb_loader_options eopts = {.batch_size = 64, .sampler = shard};
    CHECK_OK(nb_loader_new(&eval, test, &eopts));
    nb_metric_sums sums;
    nb_metric_sums_init(&sums, 2);
    bool prev = nb_no_grad_begin();
    nb_batch batch;
    for (;;) {
        CHECK_OK(nb_loader_next(eval, step, &batch));
        if (!batch.inputs) break;
        nb_tensor *logits = nb_add(step, nb_matmul(step, batch.inputs, w), b);
        double loss = nb_item(nb_cross_entropy(step, logits, batch.targets, NULL));
        double batch_sums[2] = {loss * (double)batch.size, 0};
        for (int64_t i = 0; i < batch.size; i++) {
            int predicted = nb_get(logits, (int64_t[]){i, 1}) > nb_get(logits, (int64_t[]){i, 0});
            batch_sums[1] += predicted == (int)nb_get(batch.targets, (int64_t[]){i});
        }
        nb_metric_sums_add(&sums, batch_sums, batch.size);
        nb_ctx_reset(step);
    }
    nb_no_grad_end(prev);
    /* With DDP: all-reduce (sum) nb_metric_sums_data(&sums), nb_metric_sums_size(&sums) doubles. */
    printf("test loss %.4f, accuracy %.1f%% over %.0f samples\n", nb_metric_sums_mean(&sums, 0),
           100 * nb_metric_sums_mean(&sums, 1), nb_metric_sums_count(&sums));

    nb_loader_free(eval);
    nb_sampler_free(shard);
    nb_loader_free(loader);
    nb_dataset_free(train);
    nb_dataset_free(test);
    nb_dataset_free(train_raw);
    nb_dataset_free(test_raw);
    nb_dataset_free(table);
    nb_ctx_free(step);
    nb_ctx_free(params);
    return 0;
}
