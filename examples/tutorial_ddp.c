/* tutorial_ddp: the distributed training program of docs/tutorial.md. The
 * tutorial quotes all of it, in pieces; tests/test_tutorial.py checks that
 * the pieces put together are this file, and tests/test_install.py builds
 * it against an installed nabla.
 *
 * A classifier learns a table of the CSV format that nabla ships, with
 * AdamW, on one process or on N under a launcher: a process group from the
 * environment, the distributed sampler, DDP (and SyncBatchNorm with
 * --cnn), exact evaluation, rank-0 checkpoints and resume on every rank.
 *
 *   tutorial_ddp [--data FILE] [--cnn] [--epochs N] [--ckpt-dir DIR]
 *                [--resume [auto|auto-or-fresh]]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

static int rank = 0; /* for messages: the launcher's rank, then the group's */

/* Every recoverable failure is a status with the story in nb_last_error(). */
#define CHECK(call)                                                          \
    do {                                                                     \
        nb_status s_ = (call);                                               \
        if (s_ != NB_OK) {                                                   \
            fprintf(stderr, "tutorial_ddp (rank %d): %s: %s\n", rank,        \
                    nb_status_str(s_), nb_last_error());                     \
            return 1;                                                        \
        }                                                                    \
    } while (0)

/* *n = 1 + the largest class label of ds (labels are i64 class indices). */
static nb_status count_classes(const nb_dataset *ds, int64_t *n) {
    nb_field in = nb_dataset_input(ds);
    void *row = malloc(nb_field_bytes(&in));
    nb_status s = NB_OK;
    *n = 0;
    for (int64_t i = 0; s == NB_OK && i < nb_dataset_len(ds); i++) {
        int64_t label;
        s = nb_dataset_get(ds, i, row, &label);
        if (s == NB_OK && label + 1 > *n) *n = label + 1;
    }
    free(row);
    return s;
}

/* The model's input: the rows (B, F) as they are, or with --cnn (side > 0)
 * as one-channel images (B, 1, side, side), a view of the same memory. */
static nb_tensor *model_input(nb_ctx *step, nb_tensor *rows, int64_t side) {
    return side ? nb_reshape(step, rows, NB_SHAPE(rows->shape[0], 1, side, side)) : rows;
}

/* v[0..n) = its sum over the ranks of pg. */
static nb_status sum_over_ranks(nb_pg *pg, double *v, int n) {
    nb_ctx *ctx = nb_ctx_new(nb_pg_device(pg), 0);
    nb_tensor *t = nb_from_host(ctx, NB_F64, NB_SHAPE(n), v);
    nb_status s = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM));
    if (s == NB_OK) nb_to_host(t, v);
    nb_ctx_free(ctx);
    return s;
}

/* Test loss and accuracy over every test row, each counted once. */
static nb_status evaluate(nb_ddp *ddp, nb_pg *pg, nb_loader *test, nb_ctx *step, int64_t side,
                          double *loss, double *accuracy, double *rows) {
    nb_module *model = nb_ddp_module(ddp);
    nb_status s = nb_ddp_pre_forward(ddp); /* rank 0's buffers, if the model has any */
    if (s == NB_OK) s = nb_loader_seek(test, 0, 0); /* the first test batch */
    if (s != NB_OK) return s;
    nb_metric_sums sums;
    nb_metric_sums_init(&sums, 2); /* loss sum, correct count */
    nb_module_eval(model);
    bool prev = nb_no_grad_begin();
    for (;;) {
        nb_ctx_reset(step);
        nb_batch b;
        s = nb_loader_next(test, step, &b);
        if (s != NB_OK || !b.inputs) break;
        nb_tensor *logits = nb_module_forward(model, step, model_input(step, b.inputs, side));
        double l = nb_item(nb_cross_entropy(step, logits, b.targets, NULL));
        double correct = (double)nb_count_correct(step, logits, b.targets); /* argmax == target */
        nb_metric_sums_add(&sums, (double[]){l * (double)b.size, correct}, b.size);
    }
    nb_no_grad_end(prev);
    nb_module_train(model, true);
    if (s == NB_OK) s = sum_over_ranks(pg, nb_metric_sums_data(&sums), nb_metric_sums_size(&sums));
    *loss = nb_metric_sums_mean(&sums, 0);
    *accuracy = nb_metric_sums_mean(&sums, 1);
    *rows = nb_metric_sums_count(&sums);
    return s;
}

/* --resume auto: the newest checkpoint in dir that loads, by the rule of
 * nb_checkpoint_find_latest (it says what it passes over, and refuses when
 * files are there but none loads, unless auto-or-fresh), the same on every
 * rank: n * sum(x^2) equals sum(x)^2 only when the n steps x are equal.
 * *found false: start afresh. */
static nb_status find_resume(nb_pg *pg, const char *dir, const char *mode, char *path, size_t cap,
                             bool *found) {
    int64_t step;
    nb_status s = nb_checkpoint_find_latest(dir, "tutorial_ddp", strcmp(mode, "auto-or-fresh") == 0, path,
                                            cap, found, &step);
    double v[2] = {(double)step, (double)step * (double)step};
    if (s == NB_OK) s = sum_over_ranks(pg, v, 2);
    if (s == NB_OK && v[1] * nb_pg_size(pg) != v[0] * v[0])
        s = nb_set_error(NB_ERR_MISMATCH, "--resume %s: the ranks found different checkpoints in %s (is "
                         "the folder the same on every node?)", mode, dir);
    return s;
}

/* Refuses a checkpoint written by a run with a different world size: the
 * sampler's shards, and so the order of the data, depend on it. */
static nb_status check_world_size(const char *path, int world) {
    nb_checkpoint *ck;
    nb_status s = nb_checkpoint_open(path, &ck);
    if (s != NB_OK) return s;
    const char *saved = nb_checkpoint_meta(ck, "world_size");
    if (!saved || atoi(saved) != world)
        s = nb_set_error(NB_ERR_MISMATCH, "%s was written by a run of %s processes, this run has %d",
                         path, saved ? saved : "(unknown)", world);
    nb_checkpoint_close(ck);
    return s;
}

int main(int argc, char **argv) {
    const char *data = "examples/datasets/breast_cancer.csv"; /* from the source tree's root */
    bool cnn = false;
    const char *resume = NULL; /* --resume: "" (DIR/ckpt.safetensors), "auto" or "auto-or-fresh" */
    int64_t epochs = 10;
    const char *ckpt_dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--data") && i + 1 < argc) data = argv[++i];
        else if (!strcmp(argv[i], "--cnn")) cnn = true;
        else if (!strcmp(argv[i], "--epochs") && i + 1 < argc) epochs = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--ckpt-dir") && i + 1 < argc) ckpt_dir = argv[++i];
        else if (!strcmp(argv[i], "--resume"))
            resume = i + 1 < argc && !strncmp(argv[i + 1], "auto", 4) ? argv[++i] : "";
        else {
            fprintf(stderr, "usage: tutorial_ddp [--data FILE] [--cnn] [--epochs N] "
                            "[--ckpt-dir DIR] [--resume [auto|auto-or-fresh]]\n");
            return 2;
        }
    }
    bool resume_ok = !resume || !*resume || !strcmp(resume, "auto") || !strcmp(resume, "auto-or-fresh");
    if (epochs < 1 || (resume && !ckpt_dir) || !resume_ok) {
        fprintf(stderr, "tutorial_ddp: need --epochs >= 1, and --ckpt-dir with --resume [auto|auto-or-fresh]\n");
        return 2;
    }

    /* 1. Join the run: rank, world size and device come from the launcher. */
    nb_dist_env env; /* the rank for messages until the group exists */
    if (nb_dist_env_read(&env) == NB_OK) rank = env.rank; /* if not, nb_pg_init says why */
    nb_pg *pg;
    CHECK(nb_pg_init(&pg, NULL));
    rank = nb_pg_rank(pg);
    int world = nb_pg_size(pg);
    nb_device device = nb_pg_device(pg); /* cuda:LOCAL_RANK with NCCL, else the CPU */
    if (rank == 0)
        printf("%d process%s (%s backend, launched by %s)\n", world, world > 1 ? "es" : "",
               nb_pg_backend_name(nb_pg_backend_of(pg)), nb_pg_env(pg)->source);

    /* 2. Data: a seeded split, standardised with the training part's statistics. */
    nb_dataset *table, *train_raw, *test_raw;
    if (nb_dataset_open_csv(&table, data, NULL) != NB_OK) {
        fprintf(stderr, "tutorial_ddp (rank %d): %s\n(--data FILE names the table: nabla ships "
                        "examples/datasets/*.csv in its source tree, installed in "
                        "<prefix>/share/nabla/datasets/)\n", rank, nb_last_error());
        nb_pg_free(pg);
        return 1;
    }
    nb_field in = nb_dataset_input(table);
    int64_t n_features = nb_field_numel(&in), n_classes; /* 30 and 2 for breast_cancer.csv */
    int64_t side = 0; /* --cnn: the images' side, 8 for digits.csv's 64 features */
    while (cnn && side * side < n_features) side++;
    if (side * side != (cnn ? n_features : 0)) {
        fprintf(stderr, "tutorial_ddp: --cnn needs square images, and %s has %lld features\n", data,
                (long long)n_features);
        nb_dataset_free(table);
        nb_pg_free(pg);
        return 2;
    }
    nb_dataset_split(table, 0.2, 42, &train_raw, &test_raw);
    CHECK(count_classes(table, &n_classes));
    double *mean = malloc((size_t)n_features * sizeof *mean);
    double *std = malloc((size_t)n_features * sizeof *std);
    CHECK(nb_dataset_fit_standardizer(train_raw, mean, std));
    nb_dataset *train = nb_dataset_standardize(train_raw, mean, std);
    nb_dataset *test = nb_dataset_standardize(test_raw, mean, std);
    free(mean), free(std);
    nb_dataset_free(train_raw), nb_dataset_free(test_raw), nb_dataset_free(table);

    /* 3. Training batches: each rank takes its own shard of a shuffled order. */
    nb_distributed_options so = {.world_size = world, .rank = rank, .shuffle = true, .seed = 0,
                                 .drop_last = true};
    nb_sampler *train_sampler = nb_sampler_distributed(nb_dataset_len(train), &so);
    nb_loader_options lo = {.batch_size = 8, .drop_last = true, .sampler = train_sampler,
                            .device = device};
    nb_loader *train_loader;
    CHECK(nb_loader_new(&train_loader, train, &lo));
    /* Test batches: every test row on exactly one rank, no padding. */
    nb_sampler *test_sampler = nb_sampler_shard(nb_dataset_len(test), world, rank);
    nb_loader_options eo = {.batch_size = 64, .sampler = test_sampler, .device = device};
    nb_loader *test_loader;
    CHECK(nb_loader_new(&test_loader, test, &eo));

    /* 4. The model, SyncBatchNorm, and the optimizer. */
    nb_ctx *params = nb_ctx_new(device, 0); /* parameters: the whole run */
    nb_ctx *step = nb_ctx_new(device, 0);   /* activations and tape: one step */
    nb_rng init = nb_rng_make(0);
    nb_module *model =
        cnn ? nb_cnn_new(params, NB_F32, 1, 2, (int64_t[]){16, 32}, n_classes, &init)
            : nb_mlp_new(params, NB_F32, n_features, 2, (int64_t[]){64, 32}, n_classes, &init);
    if (cnn) nb_convert_sync_batchnorm(model, pg); /* statistics of the global batch */
    int n_params = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *named = malloc((size_t)n_params * sizeof *named);
    nb_module_named_parameters(model, named, n_params);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 1e-3;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, named, n_params, &h);

    /* 5. Resume: every rank loads the same file, before DDP is set up. */
    char ckpt[4096] = "";
    if (ckpt_dir) snprintf(ckpt, sizeof ckpt, "%s/ckpt.safetensors", ckpt_dir);
    if (rank == 0 && ckpt_dir) CHECK(nb_checkpoint_make_dir(ckpt_dir)); /* now, not after an epoch */
    int n_state = nb_module_state(model, NULL, 0);
    nb_named_tensor *state = malloc((size_t)n_state * sizeof *state);
    nb_module_state(model, state, n_state);
    int64_t first_epoch = 0;
    char from[4096] = ""; /* the file to resume from; saves still go to ckpt */
    bool found = resume && !*resume; /* --resume alone: ckpt, which must exist */
    if (found) snprintf(from, sizeof from, "%s", ckpt);
    if (resume && *resume) CHECK(find_resume(pg, ckpt_dir, resume, from, sizeof from, &found));
    if (found) {
        CHECK(check_world_size(from, world));
        nb_train_state ts;
        CHECK(nb_checkpoint_load_training(from, state, n_state, opt, &ts));
        first_epoch = ts.epoch;
        if (rank == 0) printf("resumed from %s at epoch %lld\n", from, (long long)first_epoch);
    }

    /* 6. Wrap the model: same parameters everywhere, gradients averaged. */
    nb_ddp *ddp;
    nb_ddp_options dopts = NB_DDP_DEFAULTS;
    CHECK(nb_ddp_new(&ddp, model, pg, &dopts));

    /* 7. Train. */
    for (int64_t epoch = first_epoch; epoch < epochs; epoch++) {
        nb_loader_set_epoch(train_loader, epoch); /* a new shuffle, the same on every rank */
        nb_metric_sums seen;
        nb_metric_sums_init(&seen, 1);
        for (;;) {
            nb_ctx_reset(step);
            nb_batch b;
            CHECK(nb_loader_next(train_loader, step, &b));
            if (!b.inputs) break; /* end of the epoch */
            nb_tensor *logits;
            CHECK(nb_ddp_forward(ddp, step, model_input(step, b.inputs, side), &logits));
            nb_tensor *loss = nb_cross_entropy(step, logits, b.targets, NULL);
            double l = nb_item(loss);
            bool skip;
            CHECK(nb_pg_agree(pg, !isfinite(l), &skip, NULL));
            if (skip) continue; /* a non-finite loss on some rank: every rank skips */
            CHECK(nb_ddp_backward(ddp, loss)); /* gradients now averaged over ranks */
            nb_optim_step(opt);
            nb_optim_zero_grad(opt);
            nb_metric_sums_add(&seen, (double[]){l * (double)b.size}, b.size);
        }
        CHECK(sum_over_ranks(pg, nb_metric_sums_data(&seen), nb_metric_sums_size(&seen)));

        /* 8. Evaluate exactly, then save on rank 0. */
        double test_loss, accuracy, rows;
        CHECK(evaluate(ddp, pg, test_loader, step, side, &test_loss, &accuracy, &rows));
        if (rank == 0)
            printf("epoch %lld: train loss %.4f | test loss %.4f, accuracy %.2f%% (%.0f rows)\n",
                   (long long)epoch + 1, nb_metric_sums_mean(&seen, 0), test_loss, 100 * accuracy,
                   rows);
        if (rank == 0 && ckpt_dir) {
            char world_s[16];
            snprintf(world_s, sizeof world_s, "%d", world);
            nb_kv meta[] = {{"world_size", world_s}, {"program", "tutorial_ddp"}};
            nb_train_state ts = {.step = nb_optim_step_count(opt), .epoch = epoch + 1,
                                 .rng = nb_rng_make(0)};
            CHECK(nb_checkpoint_keep(ckpt_dir, "tutorial_ddp", 3)); /* the file it replaces, for --resume auto */
            CHECK(nb_checkpoint_save_training(ckpt, state, n_state, opt, &ts, meta, 2));
        }
    }

    /* 9. Leave the run: every rank, even after the last collective. */
    nb_ddp_free(ddp);
    CHECK(nb_pg_free(pg));
    nb_optim_free(opt);
    nb_loader_free(train_loader), nb_loader_free(test_loader);
    nb_sampler_free(train_sampler), nb_sampler_free(test_sampler);
    nb_dataset_free(train), nb_dataset_free(test);
    nb_ctx_free(step), nb_ctx_free(params);
    free(named), free(state);
    return 0;
}
