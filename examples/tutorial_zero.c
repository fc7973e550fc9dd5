/* tutorial_zero: the second program of docs/tutorial.md, the combination a
 * real run uses. The tutorial quotes all of it; tests/test_tutorial.py
 * checks that the pieces put together are this file and that a run stopped
 * and resumed ends bit for bit where an uninterrupted one does, and
 * tests/test_install.py builds it against an installed nabla.
 *
 * An MLP learns the 8x8 digits for a number of optimizer steps, with
 * AdamW whose state is sharded over the ranks (ZeRO-1), the gradients'
 * global norm clipped, a learning rate that warms up then follows a cosine,
 * a checkpoint of the whole optimizer state (consolidated on rank 0) every
 * few steps, and an exact resume: same step, same schedule, same batch.
 * With --zero3 the parameters and gradients are sharded too (ZeRO-3 /
 * FSDP, nb_fsdp), without checkpoints.
 *
 *   tutorial_zero [--data FILE] [--steps N] [--stop-at N] [--ckpt-dir DIR]
 *                 [--resume [auto|auto-or-fresh]] [--zero3]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

static int rank = 0; /* for messages: from the launcher's variables, then from the group */

#define CHECK(call)                                                          \
    do {                                                                     \
        nb_status s_ = (call);                                               \
        if (s_ != NB_OK) {                                                   \
            fprintf(stderr, "tutorial_zero (rank %d): %s: %s\n", rank,       \
                    nb_status_str(s_), nb_last_error());                     \
            return 1;                                                        \
        }                                                                    \
    } while (0)

/* Test loss and accuracy over every test row, each counted once. */
static nb_status evaluate(nb_module *model, nb_pg *pg, nb_loader *test, nb_ctx *step, double *loss,
                          double *accuracy) {
    nb_status s = nb_loader_seek(test, 0, 0);
    if (s != NB_OK) return s;
    double sums[3] = {0, 0, 0}; /* loss sum, correct count, rows */
    nb_module_eval(model);
    bool prev = nb_no_grad_begin();
    for (;;) {
        nb_ctx_reset(step);
        nb_batch b;
        s = nb_loader_next(test, step, &b);
        if (s != NB_OK || !b.inputs) break;
        nb_tensor *logits = nb_module_forward(model, step, b.inputs);
        sums[0] += nb_item(nb_cross_entropy(step, logits, b.targets, NULL)) * (double)b.size;
        sums[1] += (double)nb_count_correct(step, logits, b.targets);
        sums[2] += (double)b.size;
    }
    nb_no_grad_end(prev);
    nb_module_train(model, true);
    if (s != NB_OK) return s;
    nb_ctx_reset(step);
    nb_tensor *t = nb_from_host(step, NB_F64, NB_SHAPE(3), sums);
    s = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM));
    if (s != NB_OK) return s;
    nb_to_host(t, sums);
    *loss = sums[0] / sums[2];
    *accuracy = sums[1] / sums[2];
    return NB_OK;
}

/* --resume auto: the newest checkpoint in dir that loads (nb_checkpoint_find_latest
 * says what it passes over, and refuses when files are there but none
 * loads, unless auto-or-fresh), the same on every rank: the largest step
 * found and the largest of minus each, that is the smallest, must agree.
 * *found false: start afresh. */
static nb_status find_resume(nb_pg *pg, const char *dir, const char *mode, char *path, size_t cap,
                             bool *found) {
    int64_t step;
    nb_status s = nb_checkpoint_find_latest(dir, "tutorial_zero", strcmp(mode, "auto-or-fresh") == 0, path,
                                            cap, found, &step);
    if (s != NB_OK) return s;
    nb_ctx *ctx = nb_ctx_new(nb_pg_device(pg), 0);
    nb_tensor *t = nb_from_host(ctx, NB_F64, NB_SHAPE(2), (double[]){(double)step, -(double)step});
    s = nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_MAX));
    double range[2];
    if (s == NB_OK) nb_to_host(t, range);
    nb_ctx_free(ctx);
    if (s == NB_OK && range[0] != -range[1])
        s = nb_set_error(NB_ERR_MISMATCH, "--resume %s: the ranks found checkpoints of steps %g to %g in %s "
                         "(is the folder the same on every node?)", mode, -range[1], range[0], dir);
    return s;
}

/* Saves the run at `step` as dir/ckpt.safetensors: a collective (the
 * shards are gathered on rank 0), then rank 0 keeps the file it replaces
 * (the last 3, for --resume auto) and writes. The file is the one plain
 * DDP would write. */
static nb_status save(nb_ddp *ddp, nb_optim *opt, nb_loader *train, const nb_named_tensor *state,
                      int n_state, const char *dir, int64_t step, int world) {
    nb_status s = nb_ddp_consolidate_optimizer(ddp, 0);
    if (s == NB_OK && rank == 0) s = nb_checkpoint_keep(dir, "tutorial_zero", 3);
    if (s != NB_OK || rank != 0) return s;
    char path[4096];
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    nb_train_state ts = {.step = step, .rng = nb_rng_make(0)};
    nb_loader_position(train, &ts.epoch, &ts.data_position); /* the next batch to read */
    char world_s[16];
    snprintf(world_s, sizeof world_s, "%d", world);
    nb_kv meta[] = {{"world_size", world_s}, {"program", "tutorial_zero"}};
    return nb_checkpoint_save_training(path, state, n_state, opt, &ts, meta, 2);
}

int main(int argc, char **argv) {
    const char *data = "examples/datasets/digits.csv", *ckpt_dir = NULL;
    int64_t steps = 200, stop_at = 0, warmup = 20, save_every = 50, log_every = 50;
    double lr = 3e-3, max_norm = 1.0;
    bool zero3 = false;
    const char *resume = NULL; /* --resume: "" (DIR/ckpt.safetensors), "auto" or "auto-or-fresh" */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--data") && i + 1 < argc) data = argv[++i];
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--stop-at") && i + 1 < argc) stop_at = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--ckpt-dir") && i + 1 < argc) ckpt_dir = argv[++i];
        else if (!strcmp(argv[i], "--resume"))
            resume = i + 1 < argc && !strncmp(argv[i + 1], "auto", 4) ? argv[++i] : "";
        else if (!strcmp(argv[i], "--zero3")) zero3 = true;
        else {
            fprintf(stderr, "usage: tutorial_zero [--data FILE] [--steps N] [--stop-at N] "
                            "[--ckpt-dir DIR] [--resume [auto|auto-or-fresh]] [--zero3]\n");
            return 2;
        }
    }
    bool resume_ok = !resume || !*resume || !strcmp(resume, "auto") || !strcmp(resume, "auto-or-fresh");
    if (steps < 1 || stop_at < 0 || ((resume || stop_at) && !ckpt_dir) || (zero3 && ckpt_dir) || !resume_ok) {
        fprintf(stderr, "tutorial_zero: need --steps >= 1, and --ckpt-dir with --resume or --stop-at "
                        "(not with --zero3)\n");
        return 2;
    }
    int64_t stop = stop_at > 0 && stop_at < steps ? stop_at : steps;

    /* 1. The rank for messages before the group exists, then the group. */
    nb_dist_env env;
    if (nb_dist_env_read(&env) == NB_OK) rank = env.rank; /* else nb_pg_init says what is wrong */
    nb_pg *pg;
    CHECK(nb_pg_init(&pg, NULL));
    rank = nb_pg_rank(pg);
    int world = nb_pg_size(pg);
    nb_device device = nb_pg_device(pg);

    /* 2. Data: a seeded split, standardised with the training part's statistics. */
    nb_dataset *table, *train_raw, *test_raw;
    CHECK(nb_dataset_open_csv(&table, data, NULL));
    nb_field in = nb_dataset_input(table);
    int64_t n_features = nb_field_numel(&in), n_classes = 10; /* digits.csv: 64 pixels, 10 digits */
    nb_dataset_split(table, 0.2, 42, &train_raw, &test_raw);
    double *mean = malloc((size_t)n_features * sizeof *mean);
    double *std = malloc((size_t)n_features * sizeof *std);
    CHECK(nb_dataset_fit_standardizer(train_raw, mean, std));
    nb_dataset *train = nb_dataset_standardize(train_raw, mean, std);
    nb_dataset *test = nb_dataset_standardize(test_raw, mean, std);
    free(mean), free(std);
    nb_dataset_free(train_raw), nb_dataset_free(test_raw), nb_dataset_free(table);

    nb_distributed_options so = {.world_size = world, .rank = rank, .shuffle = true, .seed = 0,
                                 .drop_last = true};
    nb_sampler *train_sampler = nb_sampler_distributed(nb_dataset_len(train), &so);
    nb_loader_options lo = {.batch_size = 16, .drop_last = true, .sampler = train_sampler,
                            .device = device};
    nb_loader *train_loader;
    CHECK(nb_loader_new(&train_loader, train, &lo));
    nb_sampler *test_sampler = nb_sampler_shard(nb_dataset_len(test), world, rank);
    nb_loader_options eo = {.batch_size = 128, .sampler = test_sampler, .device = device};
    nb_loader *test_loader;
    CHECK(nb_loader_new(&test_loader, test, &eo));

    /* 3. The model, and AdamW with weight decay on the matrices only. */
    nb_ctx *params = nb_ctx_new(device, 0), *step_ctx = nb_ctx_new(device, 0);
    nb_rng init = nb_rng_make(0);
    nb_module *model = nb_mlp_new(params, NB_F32, n_features, 2, (int64_t[]){128, 64}, n_classes, &init);
    int n_params = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *named = malloc((size_t)n_params * sizeof *named);
    nb_named_tensor *scratch = malloc((size_t)n_params * sizeof *scratch);
    nb_module_named_parameters(model, named, n_params);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.weight_decay = 0.05;
    nb_param_group groups[2]; /* matrices decay, biases do not */
    nb_optim_split_decay(named, n_params, &h, scratch, groups);
    nb_optim *opt = nb_optim_new_groups(NB_OPTIM_ADAMW, 2, groups);
    nb_lr_schedule schedule = nb_lr_cosine(lr, warmup, steps, lr / 10);

    /* 4. Resume: load the whole state into the optimizer before ZeRO-1 shards it. */
    char ckpt[4096] = "";
    if (ckpt_dir) snprintf(ckpt, sizeof ckpt, "%s/ckpt.safetensors", ckpt_dir);
    if (rank == 0 && ckpt_dir) CHECK(nb_checkpoint_make_dir(ckpt_dir)); /* now, not at the first save */
    int n_state = nb_module_state(model, NULL, 0);
    nb_named_tensor *state = malloc((size_t)n_state * sizeof *state);
    nb_module_state(model, state, n_state);
    nb_train_state ts = {0};
    char from[4096] = ""; /* the file to resume from; saves still go to ckpt */
    bool found = resume && !*resume; /* --resume alone: ckpt, which must exist */
    if (found) snprintf(from, sizeof from, "%s", ckpt);
    if (resume && *resume) CHECK(find_resume(pg, ckpt_dir, resume, from, sizeof from, &found));
    if (found) {
        nb_checkpoint *ck;
        CHECK(nb_checkpoint_open(from, &ck));
        const char *meta = nb_checkpoint_meta(ck, "world_size");
        char saved[32]; /* a copy: the checkpoint's strings go with it */
        snprintf(saved, sizeof saved, "%s", meta ? meta : "(unknown)");
        bool same = meta && atoi(meta) == world;
        nb_checkpoint_close(ck);
        if (!same)
            CHECK(nb_set_error(NB_ERR_MISMATCH, "%s was written by a run of %s processes, this run has %d "
                               "(the order of the data depends on it)", from, saved, world));
        CHECK(nb_checkpoint_load_training(from, state, n_state, opt, &ts));
        CHECK(nb_loader_seek(train_loader, ts.epoch, ts.data_position));
        if (rank == 0)
            printf("resumed from %s at step %lld (epoch %lld, batch %lld)\n", from, (long long)ts.step,
                   (long long)ts.epoch, (long long)ts.data_position);
    }

    /* 5. DDP with ZeRO-1: each rank keeps and updates its share of the state.
     * --zero3: nb_fsdp instead, each rank keeping its share of the parameters too. */
    nb_ddp *ddp = NULL;
    nb_fsdp *fsdp = NULL;
    nb_ddp_options dopts = NB_DDP_DEFAULTS;
    if (zero3) {
        CHECK(nb_fsdp_new(&fsdp, model, pg, NULL)); /* after the optimizer: its state is shaped like them */
        CHECK(nb_fsdp_set_optimizer(fsdp, opt));
    } else {
        CHECK(nb_ddp_new(&ddp, model, pg, &dopts));
        CHECK(nb_ddp_set_zero(ddp, opt));
    }
    if (rank == 0 && zero3)
        printf("%d process%s, ZeRO-3: parameters, gradients and optimizer state %zu bytes per process; "
               "steps %lld..%lld of %lld\n", world, world > 1 ? "es" : "", nb_fsdp_state_bytes(fsdp, opt),
               (long long)ts.step + 1, (long long)stop, (long long)steps);
    else if (rank == 0)
        printf("%d process%s, ZeRO-1: optimizer state %zu bytes per process; steps %lld..%lld of %lld\n",
               world, world > 1 ? "es" : "", nb_optim_state_bytes(opt), (long long)ts.step + 1,
               (long long)stop, (long long)steps);

    /* 6. Train by steps: schedule, forward, backward, clip, step. */
    int64_t step = ts.step;
    while (step < stop) {
        nb_ctx_reset(step_ctx);
        nb_batch b;
        CHECK(nb_loader_next(train_loader, step_ctx, &b));
        if (!b.inputs) continue; /* the end of an epoch: the loader moves on to the next one */
        nb_optim_set_lr_all(opt, nb_lr_schedule_at(&schedule, step));
        nb_tensor *logits;
        CHECK(zero3 ? nb_fsdp_forward(fsdp, step_ctx, b.inputs, &logits)
                    : nb_ddp_forward(ddp, step_ctx, b.inputs, &logits));
        nb_tensor *loss = nb_cross_entropy(step_ctx, logits, b.targets, NULL);
        /* reduce-scatter: each rank gets its share, averaged */
        CHECK(zero3 ? nb_fsdp_backward(fsdp, loss) : nb_ddp_backward(ddp, loss));
        double norm; /* the global norm, over the shards */
        CHECK(zero3 ? nb_fsdp_clip_grad_norm(fsdp, max_norm, 2.0, &norm)
                    : nb_ddp_clip_grad_norm(ddp, max_norm, 2.0, &norm));
        CHECK(zero3 ? nb_fsdp_step(fsdp) : nb_ddp_step(ddp)); /* update the share (ZeRO-1: all-gather) */
        nb_optim_zero_grad(opt);
        step++;
        if (rank == 0 && (step % log_every == 0 || step == stop))
            printf("step %lld: loss %.4f, gradient norm %.3f, lr %.2e\n", (long long)step, nb_item(loss),
                   norm, nb_lr_schedule_at(&schedule, step - 1));
        if (ckpt_dir && (step % save_every == 0 || step == stop))
            CHECK(save(ddp, opt, train_loader, state, n_state, ckpt_dir, step, world));
    }

    /* 7. Evaluate, then leave: the whole state back on every rank before the wrapper goes. */
    double test_loss, accuracy;
    if (zero3) CHECK(nb_fsdp_gather_full(fsdp)); /* the parameters whole: ranks may evaluate unequal batches */
    CHECK(evaluate(model, pg, test_loader, step_ctx, &test_loss, &accuracy));
    if (rank == 0) {
        printf("step %lld: test loss %.6f, accuracy %.2f%%\n", (long long)step, test_loss, 100 * accuracy);
        if (ckpt_dir) printf("checkpoint: %s (step %lld)\n", ckpt, (long long)step);
    }
    if (ddp) CHECK(nb_ddp_set_zero(ddp, NULL));
    nb_ddp_free(ddp);
    nb_fsdp_free(fsdp);
    CHECK(nb_pg_free(pg));
    nb_optim_free(opt);
    nb_loader_free(train_loader), nb_loader_free(test_loader);
    nb_sampler_free(train_sampler), nb_sampler_free(test_sampler);
    nb_dataset_free(train), nb_dataset_free(test);
    nb_ctx_free(step_ctx), nb_ctx_free(params);
    free(named), free(scratch), free(state);
    return 0;
}
