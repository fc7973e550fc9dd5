/* train_classifier: trains a classifier on a shipped table, on one process
 * or on N under a launcher, with the distributed sampler and DDP.
 *
 *   --model mlp  the breast-cancer table (569 rows, 30 features, 2
 *                classes): a seeded 455 / 114 split, features standardised
 *                with the training part's statistics, an MLP, batch 8 per
 *                process, SGD with momentum.
 *   --model cnn  the 8x8 digits (1797 images, 10 classes): a seeded 80 / 20
 *                split, pixels scaled to [0, 1], a small CNN with
 *                BatchNorm (--sync-bn: SyncBatchNorm over the ranks),
 *                batch 32 per process, Adam.
 *
 * Each epoch ends with an exact evaluation: every test sample is evaluated
 * once, by one rank (a shard sampler, no padding), and the loss and
 * correct-count sums are all-reduced, so the accuracy is the same whatever
 * the number of processes. Rank 0 prints, logs metrics and saves a
 * checkpoint after every epoch; --resume continues from the epoch after
 * it on every rank. --bf16 computes the matrix products and convolutions
 * in bf16 (f32 weights, f32 accumulation), on a GPU or the CPU. --zero
 * shards the optimizer's state over the processes (ZeRO-1, docs/ddp.md),
 * --zero 2 the gradients too (ZeRO-2): each keeps only its share, the
 * checkpoints are the same; --zero 3 the parameters too (ZeRO-3 / FSDP,
 * the same checkpoints too); the last line gives state_bytes=, what this
 * process holds at the end of the last step. docs/examples.md
 * describes every flag. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

#include "common/cli.h"
#include "common/divergence.h"
#include "common/files.h"
#include "common/dist.h"
#include "common/report.h"
#include "common/resume.h"

typedef struct args {
    const char *model, *data, *hidden, *channels, *optim;
    int64_t epochs, stop_at, batch_size, seed, split_seed, max_skipped_steps;
    double lr, momentum, weight_decay, test_fraction;
    bool sync_bn, resume, bf16; /* resume: a checkpoint is loaded */
    const char *zero;           /* --zero: NULL, "", "1", "2" or "3" */
    int zero_stage;             /* 0 (off), 1, 2 or 3 */
    const char *ckpt_dir, *metrics, *plot, *progress;
    const char *resume_mode; /* --resume: NULL, "", "auto" or "auto-or-fresh" */
    int64_t keep_checkpoints; /* --keep-checkpoints: Note [Kept checkpoints] in common/resume.c */
    bool ckpt_sharded;        /* --ckpt-sharded: Note [Sharded save] in common/resume.c */
} args;

typedef struct run {
    args a;
    size_t state_bytes; /* run_dist_state_bytes at the end of the last step */
    bool cnn, sgd;
    int64_t widths[16]; /* --hidden or --channels */
    int n_widths;
    nb_progress_mode progress_mode; /* --progress */
    int64_t stop;                   /* the epoch this invocation ends at (--stop-at or --epochs) */
    run_dist d;
    int64_t side; /* cnn: images are side x side */
    nb_dataset *train, *test;
    nb_sampler *train_sampler, *test_sampler;
    nb_loader *train_loader, *test_loader;
    nb_ctx *params, *step_ctx;
    nb_module *model;
    int64_t n_classes;
    nb_named_tensor *state, *param_list;
    int n_state;
    nb_optim *opt;
    nb_lr_schedule sched;
    int64_t step, epoch0, per_epoch; /* optimizer steps so far, the first epoch to run, steps per epoch */
    divergence guard; /* --max-skipped-steps */
    nb_progress *progress;
    nb_metrics_log *log;
    char ckpt_path[4096];
    char resume_path[4096]; /* the checkpoint --resume loads */
} run;

/* Loss and accuracy over every test row, and the number of rows. */
typedef struct test_result {
    double loss, accuracy, count;
} test_result;

static int fail(const run *r, const char *what) {
    fprintf(stderr, "train_classifier (rank %d): %s: %s\n", r->d.rank, what, nb_last_error());
    return 1;
}

#define TRY(r, call, what)                                                  \
    do {                                                                    \
        if ((call) != NB_OK) return fail((r), (what));                      \
    } while (0)

/* "64,32" -> {64, 32}; the count, or -1 when malformed. */
static int parse_list(const char *s, int64_t *out, int cap) {
    int n = 0;
    while (*s) {
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0 || n == cap) return -1;
        out[n++] = v;
        s = end;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}

/* ------------------------------------------------------------------ data */
static nb_status open_data(run *r) {
    const args *a = &r->a;
    nb_dataset *table, *train_raw, *test_raw;
    nb_status s = nb_dataset_open_csv(&table, a->data, NULL);
    if (s != NB_OK) return s;
    nb_dataset_split(table, a->test_fraction, (uint64_t)a->split_seed, &train_raw, &test_raw);
    nb_field in = nb_dataset_input(table);
    int64_t f = nb_field_numel(&in);
    double *mean = calloc((size_t)f, sizeof *mean), *std = malloc((size_t)f * sizeof *std);
    if (r->cnn) {
        r->side = (int64_t)llround(sqrt((double)f));
        if (r->side * r->side != f) {
            s = nb_set_error(NB_ERR_FORMAT, "%s: %lld features are not a square image", a->data,
                             (long long)f);
        }
        for (int64_t i = 0; i < f; i++) std[i] = 16.0; /* pixel counts 0..16 -> [0, 1] */
    } else {
        s = nb_dataset_fit_standardizer(train_raw, mean, std); /* the training part only */
    }
    if (s == NB_OK) {
        r->train = nb_dataset_standardize(train_raw, mean, std);
        r->test = nb_dataset_standardize(test_raw, mean, std);
    }
    free(mean), free(std);
    nb_dataset_free(train_raw), nb_dataset_free(test_raw), nb_dataset_free(table);
    if (s != NB_OK) return s;

    int64_t n_train = nb_dataset_len(r->train);
    if (n_train / r->d.world_size < a->batch_size)
        return nb_set_error(NB_ERR_INVALID, "%lld training rows are too few for batch %lld on %d "
                            "processes", (long long)n_train, (long long)a->batch_size, r->d.world_size);
    s = run_dist_train_loader(&r->d, r->train, a->batch_size, (uint64_t)a->seed, &r->train_sampler,
                              &r->train_loader);
    if (s != NB_OK) return s;
    r->test_sampler = nb_sampler_shard(nb_dataset_len(r->test), r->d.world_size, r->d.rank);
    nb_loader_options eo = {.batch_size = 64, .sampler = r->test_sampler, .device = r->d.device};
    return nb_loader_new(&r->test_loader, r->test, &eo);
}

/* (b, F) -> the model's input */
static nb_tensor *as_input(run *r, nb_tensor *x) {
    return r->cnn ? nb_reshape(r->step_ctx, x, NB_SHAPE(x->shape[0], 1, r->side, r->side)) : x;
}

/* A test batch's summed loss and number of correct answers. */
static void eval_batch(void *user, nb_ctx *ctx, const nb_batch *b, double *v) {
    run *r = user;
    nb_tensor *logits = nb_module_forward(r->model, ctx, as_input(r, b->inputs));
    v[0] = nb_item(nb_cross_entropy(ctx, logits, b->targets, NULL)) * (double)b->size;
    v[1] = (double)nb_count_correct(ctx, logits, b->targets);
}

/* Exact test metrics: loss and accuracy over every test row, once. */
static nb_status evaluate(run *r, double *loss, double *accuracy, double *count) {
    nb_metric_sums sums;
    nb_status s = run_dist_evaluate(&r->d, r->model, r->test_loader, r->step_ctx, 2, eval_batch, r, &sums);
    *loss = nb_metric_sums_mean(&sums, 0);
    *accuracy = nb_metric_sums_mean(&sums, 1);
    *count = nb_metric_sums_count(&sums);
    return s;
}

/* ------------------------------------------------------------ checkpoints */
static void run_meta(const run *r, char v[][64], nb_kv *kv, int *n) {
    const args *a = &r->a;
    *n = 0;
#define ADD(key, fmt, value)                                                \
    (snprintf(v[*n], 64, fmt, value), kv[*n] = (nb_kv){key, v[*n]}, (*n)++)
    ADD("model", "%s", a->model);
    ADD("layers", "%s", r->cnn ? a->channels : a->hidden);
    ADD("world_size", "%d", r->d.world_size);
    ADD("batch_size", "%lld", (long long)a->batch_size);
    ADD("seed", "%lld", (long long)a->seed);
    ADD("optim", "%s", a->optim);
#undef ADD
}

static nb_status save_checkpoint(run *r, int64_t step, int64_t epochs_done, bool sharded) {
    char v[8][64];
    nb_kv kv[8];
    int n;
    run_meta(r, v, kv, &n);
    kv[n++] = (nb_kv){"program", "train_classifier"};
    nb_train_state st = {step, epochs_done, 0, nb_rng_make(0)};
    if (sharded) /* --ckpt-sharded: every rank writes its shard, rank 0 the index */
        return resume_save_sharded(&r->d, r->a.ckpt_dir, r->ckpt_path, "train_classifier",
                                   (int)r->a.keep_checkpoints, r->step_ctx, r->state, r->n_state, r->opt, &st, kv, n);
    /* never a diverged state over the last good checkpoint */
    char what[96];
    snprintf(what, sizeof what, "epoch %lld not saved", (long long)epochs_done);
    int n_opt;
    const nb_named_tensor *opt_state = nb_optim_state(r->opt, &n_opt);
    nb_status s = divergence_check_finite(r->step_ctx, r->state, r->n_state, what);
    if (s == NB_OK) s = divergence_check_finite(r->step_ctx, opt_state, n_opt, what);
    if (s == NB_OK) s = files_make_dirs(r->a.ckpt_dir);
    if (s == NB_OK) s = nb_checkpoint_keep(r->a.ckpt_dir, "train_classifier", (int)r->a.keep_checkpoints);
    if (s == NB_OK) s = nb_checkpoint_save_training(r->ckpt_path, r->state, r->n_state, r->opt, &st, kv, n);
    return s;
}

static nb_status load_checkpoint(run *r, int64_t *step, int64_t *epochs_done) {
    bool found;
    int64_t found_step;
    nb_status s = resume_find(&r->d, r->a.ckpt_dir, r->a.resume_mode, "train_classifier", r->resume_path,
                              sizeof r->resume_path, &found, &found_step);
    if (s != NB_OK || !found) {
        r->a.resume = false; /* --resume auto without a checkpoint: a fresh start */
        return s;
    }
    nb_checkpoint *ck;
    s = nb_checkpoint_open(r->resume_path, &ck);
    if (s != NB_OK) return s;
    char v[8][64];
    nb_kv kv[8];
    int n;
    run_meta(r, v, kv, &n);
    const char *world0 = nb_checkpoint_meta(ck, "world_size");
    if (world0 && atoi(world0) != r->d.world_size)
        s = nb_set_error(NB_ERR_MISMATCH, "%s was written with world_size %s, this run has %d: train_classifier "
                         "resumes only on the number of processes of its checkpoint (its batches per epoch and "
                         "learning-rate schedule depend on it; train_gpt --keep-batch resumes on another)",
                         r->resume_path, world0, r->d.world_size);
    else
        s = resume_check_meta(ck, r->resume_path, kv, n);
    nb_checkpoint_close(ck);
    if (s != NB_OK) return s;
    nb_train_state st;
    s = nb_checkpoint_load_training(r->resume_path, r->state, r->n_state, r->opt, &st);
    *step = st.step;
    *epochs_done = st.epoch;
    return s;
}

/* ------------------------------------------------------------- setup */
/* Fills r->a from the command line, with the chosen model's defaults.
 * -1: go on; otherwise the exit code (0 after --help, 2 after a bad flag). */
static int parse_args(run *r, int argc, char **argv) {
    args *a = &r->a;
    *a = (args){.model = "mlp", .hidden = "64,32", .channels = "16,32,64", .epochs = 0, .batch_size = 0,
                .seed = 0, .split_seed = 42, .lr = 0, .momentum = 0.9, .test_fraction = 0.2,
                .max_skipped_steps = DIVERGENCE_DEFAULT_MAX_SKIPPED, .progress = "auto", .keep_checkpoints = 3};
    cli_flag flags[] = {
        {"model", CLI_STRING, &a->model, "mlp (breast-cancer table) or cnn (8x8 digits)"},
        {"data", CLI_STRING, &a->data, "CSV table, label in the last column (default: the model's shipped table)"},
        {"hidden", CLI_STRING, &a->hidden, "mlp: hidden layer widths"},
        {"channels", CLI_STRING, &a->channels, "cnn: channels of the conv-BatchNorm-ReLU blocks"},
        {"bf16", CLI_BOOL, &a->bf16, "matrix products and convolutions in bf16 (f32 weights, f32 accumulation)"},
        {"sync-bn", CLI_BOOL, &a->sync_bn, "cnn: BatchNorm statistics over all processes (SyncBatchNorm)"},
        {"zero", CLI_OPTIONAL, &a->zero, "ZeRO: 1 (the flag alone) shards the optimizer's state over the processes, 2 the gradients too, 3 the parameters too (FSDP)"},
        {"epochs", CLI_INT, &a->epochs, "passes over the training rows (0: 20 for mlp, 15 for cnn)"},
        {"stop-at", CLI_INT, &a->stop_at, "stop after this epoch, saving a checkpoint (0: --epochs)"},
        {"batch-size", CLI_INT, &a->batch_size, "rows per process per step (0: 8 for mlp, 32 for cnn)"},
        {"optim", CLI_STRING, &a->optim, "sgd (with --momentum) or adam (default: sgd for mlp, adam for cnn)"},
        {"lr", CLI_DOUBLE, &a->lr, "peak learning rate, cosine-decayed to 1/100 (0: 0.01 for sgd, 0.003 for adam)"},
        {"momentum", CLI_DOUBLE, &a->momentum, "sgd momentum"},
        {"weight-decay", CLI_DOUBLE, &a->weight_decay, "L2 penalty"},
        {"test-fraction", CLI_DOUBLE, &a->test_fraction, "share of the rows held out"},
        {"split-seed", CLI_INT, &a->split_seed, "seed of the train/test split"},
        {"seed", CLI_INT, &a->seed, "initialisation and shuffling"},
        {"max-skipped-steps", CLI_INT, &a->max_skipped_steps, "stop after this many consecutive steps skipped for a non-finite gradient (0: never)"},
        {"ckpt-dir", CLI_STRING, &a->ckpt_dir, "directory for ckpt.safetensors (saved every epoch)"},
        {"resume", CLI_OPTIONAL, &a->resume_mode, "continue from --ckpt-dir/ckpt.safetensors; 'auto': from the newest checkpoint in --ckpt-dir that loads (saying which it passes over and why), afresh when there is none, and refusing to start when every one is damaged; 'auto-or-fresh': the same, but afresh then"},
        {"ckpt-sharded", CLI_BOOL, &a->ckpt_sharded, "with --zero on several processes: each writes its shard of the state, rank 0 an index (ckpt.safetensors); nb_ckpt consolidate makes the single file"},
        {"keep-checkpoints", CLI_INT, &a->keep_checkpoints, "checkpoints kept in --ckpt-dir: ckpt.safetensors and the older ckpt.step<N>.safetensors (1: the newest only)"},
        {"metrics", CLI_STRING, &a->metrics, "JSON-lines metrics file"},
        {"plot", CLI_STRING, &a->plot, "SVG loss and accuracy plot (default: --metrics with .svg)"},
        {"progress", CLI_STRING, &a->progress, "auto, line, plain or off"},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    int rc = cli_parse(argc, argv, "train_classifier",
                       "Trains an MLP or a CNN classifier (see docs/examples.md).", flags, nf);
    if (rc) return rc == 1 ? 0 : 2;
    if (!report_progress_mode("train_classifier", a->progress, &r->progress_mode)) return 2;
    r->cnn = !strcmp(a->model, "cnn");
    if (!r->cnn && strcmp(a->model, "mlp")) {
        fprintf(stderr, "train_classifier: --model must be mlp or cnn, not \"%s\"\n", a->model);
        return 2;
    }
    if (!a->data) a->data = r->cnn ? NABLA_SOURCE_DIR "/examples/datasets/digits.csv"
                                   : NABLA_SOURCE_DIR "/examples/datasets/breast_cancer.csv";
    if (!a->epochs) a->epochs = r->cnn ? 15 : 20;
    if (!a->batch_size) a->batch_size = r->cnn ? 32 : 8;
    if (!a->optim) a->optim = r->cnn ? "adam" : "sgd";
    r->sgd = !strcmp(a->optim, "sgd");
    if (!r->sgd && strcmp(a->optim, "adam")) {
        fprintf(stderr, "train_classifier: --optim must be sgd or adam, not \"%s\"\n", a->optim);
        return 2;
    }
    if (!a->lr) a->lr = r->sgd ? 0.01 : 0.003;
    a->zero_stage = run_dist_zero_stage(a->zero, "train_classifier");
    if (a->zero_stage < 0) return 2;
    a->resume = a->resume_mode != NULL;
    if (a->resume_mode && *a->resume_mode && strcmp(a->resume_mode, "auto") && strcmp(a->resume_mode, "auto-or-fresh")) {
        fprintf(stderr, "train_classifier: --resume takes no value, 'auto' or 'auto-or-fresh', not \"%s\"\n", a->resume_mode);
        return 2;
    }
    r->n_widths = parse_list(r->cnn ? a->channels : a->hidden, r->widths, 16);
    if (r->n_widths < 0 || (r->cnn && r->n_widths == 0)) {
        fprintf(stderr, "train_classifier: --%s must be a comma-separated list of positive widths\n",
                r->cnn ? "channels" : "hidden");
        return 2;
    }
    if (a->keep_checkpoints < 1) {
        fprintf(stderr, "train_classifier: --keep-checkpoints must be >= 1\n");
        return 2;
    }
    if (a->max_skipped_steps < 0) {
        fprintf(stderr, "train_classifier: --max-skipped-steps must be >= 0 (0: never stop)\n");
        return 2;
    }
    r->guard.max_skipped = a->max_skipped_steps;
    if (a->epochs < 1 || a->batch_size < 1 || !(a->lr > 0) || a->momentum < 0 || a->weight_decay < 0 ||
        !(a->test_fraction > 0 && a->test_fraction < 1) || (a->resume && !a->ckpt_dir)) {
        fprintf(stderr, "train_classifier: need --epochs, --batch-size >= 1, --lr > 0, --momentum "
                        "and --weight-decay >= 0, --test-fraction in (0, 1), and --ckpt-dir with --resume\n");
        return 2;
    }
    if (a->ckpt_sharded && (!a->ckpt_dir || !a->zero)) {
        fprintf(stderr, "train_classifier: --ckpt-sharded needs --ckpt-dir and --zero\n");
        return 2;
    }
    r->stop = a->stop_at > 0 && a->stop_at < a->epochs ? a->stop_at : a->epochs;
    return -1;
}

/* 1 + the largest training label. */
static nb_status count_classes(run *r) {
    nb_field in = nb_dataset_input(r->train);
    void *row = malloc(nb_field_bytes(&in));
    nb_status s = NB_OK;
    r->n_classes = 0;
    for (int64_t i = 0; i < nb_dataset_len(r->train) && s == NB_OK; i++) {
        int64_t y;
        s = nb_dataset_get(r->train, i, row, &y);
        if (s == NB_OK && y + 1 > r->n_classes) r->n_classes = y + 1;
    }
    free(row);
    return s;
}

/* The model on this rank's device, its state list for checkpoints, the
 * optimizer and the learning-rate schedule. */
static void build_model(run *r) {
    const args *a = &r->a;
    r->params = nb_ctx_new(r->d.device, 0);
    r->step_ctx = nb_ctx_new(r->d.device, 0);
    /* training and evaluation both run in step_ctx */
    if (a->bf16) nb_ctx_set_compute_dtype(r->step_ctx, NB_BF16);
    nb_rng init = nb_rng_make((uint64_t)a->seed);
    nb_field in = nb_dataset_input(r->train);
    r->model = r->cnn ? nb_cnn_new(r->params, NB_F32, 1, r->n_widths, r->widths, r->n_classes, &init)
                      : nb_mlp_new(r->params, NB_F32, nb_field_numel(&in), r->n_widths, r->widths,
                                   r->n_classes, &init);
    r->n_state = nb_module_state(r->model, NULL, 0);
    r->state = malloc((size_t)r->n_state * sizeof *r->state);
    nb_module_state(r->model, r->state, r->n_state);
    int n_params = nb_module_named_parameters(r->model, NULL, 0);
    r->param_list = malloc((size_t)n_params * sizeof *r->param_list);
    nb_module_named_parameters(r->model, r->param_list, n_params);
    nb_optim_hparams h = r->sgd ? NB_SGD_DEFAULTS : NB_ADAM_DEFAULTS;
    h.lr = a->lr, h.weight_decay = a->weight_decay;
    if (r->sgd) h.momentum = a->momentum;
    r->opt = nb_optim_new(r->sgd ? NB_OPTIM_SGD : NB_OPTIM_ADAM, r->param_list, n_params, &h);
    r->per_epoch = nb_loader_len(r->train_loader);
    r->sched = nb_lr_cosine(a->lr, 0, a->epochs * r->per_epoch, a->lr / 100);
    if (a->ckpt_dir) snprintf(r->ckpt_path, sizeof r->ckpt_path, "%s/ckpt.safetensors", a->ckpt_dir);
}

/* The progress display (rank 0 only) and the metrics log (rank 0, with
 * --metrics). */
static nb_status open_monitor(run *r) {
    const args *a = &r->a;
    bool lead = r->d.rank == 0;
    nb_progress_opts po = {lead ? r->progress_mode : NB_PROGRESS_OFF, "samples", r->per_epoch, 0};
    r->progress = nb_progress_new(stdout, r->step, r->stop * r->per_epoch, &po);
    if (!lead || !a->metrics) return NB_OK;
    nb_status s = files_make_parent_dirs(a->metrics);
    return s == NB_OK ? nb_metrics_log_open(&r->log, a->metrics, a->resume, 0) : s;
}

/* What is about to be trained, on what, by how many processes. */
static void print_banner(run *r) {
    const args *a = &r->a;
    nb_progress_printf(r->progress, "train_classifier: %s with %lld parameters on %s: %lld training and %lld "
                       "test rows, %lld classes; on %s%s", r->cnn ? "CNN" : "MLP",
                       (long long)nb_module_num_params(r->model), a->data,
                       (long long)nb_dataset_len(r->train), (long long)nb_dataset_len(r->test),
                       (long long)r->n_classes, nb_device_name(r->d.device), a->bf16 ? ", bf16" : "");
    nb_progress_printf(r->progress, "%d process%s%s, batch %lld per process, %lld steps per epoch, %s lr %g%s",
                       r->d.world_size, r->d.world_size > 1 ? "es" : "", r->d.ddp ? " with DDP" : r->d.fsdp ? " with ZeRO-3" : "",
                       (long long)a->batch_size, (long long)r->per_epoch, a->optim, a->lr,
                       r->cnn && a->sync_bn ? ", SyncBatchNorm" : "");
    if (a->resume_mode && !strncmp(a->resume_mode, "auto", 4))
        nb_progress_printf(r->progress, a->resume ? "--resume auto: from %s" : "--resume auto: no checkpoint "
                           "in %s: a fresh start", a->resume ? r->resume_path : a->ckpt_dir);
    nb_progress_printf(r->progress, "optimizer state per process: %zu bytes%s", nb_optim_state_bytes(r->opt),
                       run_dist_zero_label(&r->d));
}

/* ----------------------------------------------------- during training */
/* The epoch's line (train sums already over every rank) and its metrics
 * record. */
static nb_status report_epoch(run *r, int64_t epoch, const nb_metric_sums *train,
                              const test_result *t) {
    double train_loss = nb_metric_sums_mean(train, 0), train_acc = nb_metric_sums_mean(train, 1);
    nb_progress_printf(r->progress, "epoch %lld/%lld: train loss %.4f, accuracy %.2f%% | test loss %.4f, "
                       "accuracy %.2f%% (%.0f rows)", (long long)epoch + 1, (long long)r->a.epochs,
                       train_loss, 100 * train_acc, t->loss, 100 * t->accuracy, t->count);
    if (!r->log) return NB_OK;
    return nb_metrics_log_write(r->log, "epoch", r->step, (nb_metric_value[]){
        {"epoch", (double)(epoch + 1)}, {"loss", train_loss}, {"accuracy", train_acc},
        {"test_loss", t->loss}, {"test_accuracy", t->accuracy}}, 5);
}

/* ------------------------------------------------------------- the end */
/* After the last epoch: the test result (evaluated here when no epoch
 * ran), the plot, where the files are; then leaves the run and frees
 * everything. The exit code. */
static int finish(run *r, test_result *t) {
    const args *a = &r->a;
    nb_progress_free(r->progress);
    if (r->epoch0 >= r->stop) TRY(r, evaluate(r, &t->loss, &t->accuracy, &t->count), "evaluation");
    if (r->d.rank == 0) {
        printf("test accuracy %.2f%% (%.0f rows), test loss %.4f; state_bytes=%zu\n", 100 * t->accuracy, t->count,
               t->loss, r->state_bytes);
        if (a->ckpt_dir) printf("checkpoint: %s (epoch %lld)\n", r->ckpt_path, (long long)r->stop);
    }
    if (r->log) {
        nb_metrics_log_close(r->log);
        char plot[4096];
        report_plot_path(plot, sizeof plot, a->plot, a->metrics);
        report_curve c[4] = {{"epoch", "loss", "train loss"}, {"epoch", "test_loss", "test loss"},
                             {"epoch", "accuracy", "train accuracy"},
                             {"epoch", "test_accuracy", "test accuracy"}};
        nb_plot_opts o = {r->cnn ? "train_classifier --model cnn" : "train_classifier --model mlp",
                          "epoch", "loss / accuracy", 0, 0, false, true, true}; /* markers, whole epochs */
        TRY(r, report_plot(plot, a->metrics, "epoch", c, 4, &o), "plot");
        printf("metrics:    %s\nplot:       %s\n", a->metrics, plot);
    }
    TRY(r, run_dist_finish(&r->d), "shutting down");
    nb_optim_free(r->opt);
    nb_loader_free(r->train_loader), nb_loader_free(r->test_loader);
    nb_sampler_free(r->train_sampler), nb_sampler_free(r->test_sampler);
    nb_dataset_free(r->train), nb_dataset_free(r->test);
    nb_ctx_free(r->step_ctx), nb_ctx_free(r->params);
    free(r->state), free(r->param_list);
    return 0;
}

/* ------------------------------------------------------------------ main */
int main(int argc, char **argv) {
    static run r;
    const args *a = &r.a;
    int rc = parse_args(&r, argc, argv);
    if (rc >= 0) return rc;
    TRY(&r, run_dist_init(&r.d), "joining the run");
    TRY(&r, open_data(&r), "data");
    TRY(&r, count_classes(&r), "data");
    build_model(&r);
    if (a->resume) TRY(&r, load_checkpoint(&r, &r.step, &r.epoch0), "resuming");
    r.d.zero_stage = a->zero_stage;
    TRY(&r, run_dist_wrap(&r.d, r.model, r.cnn && a->sync_bn), a->zero_stage == 3 ? "ZeRO-3" : "DDP");
    TRY(&r, run_dist_set_zero(&r.d, r.opt, a->zero_stage), "ZeRO");
    TRY(&r, open_monitor(&r), "metrics");
    print_banner(&r);

    test_result test = {NAN, NAN, 0};
    for (int64_t epoch = r.epoch0; epoch < r.stop; epoch++) {
        nb_loader_set_epoch(r.train_loader, epoch);
        nb_metric_sums train; /* loss and correct predictions */
        nb_metric_sums_init(&train, 2);
        for (;;) {
            nb_ctx_reset(r.step_ctx);
            nb_batch b;
            TRY(&r, nb_loader_next(r.train_loader, r.step_ctx, &b), "data");
            if (!b.inputs) break;
            nb_optim_set_lr_all(r.opt, nb_lr_schedule_at(&r.sched, r.step));
            nb_tensor *logits;
            TRY(&r, run_dist_forward(&r.d, r.step_ctx, as_input(&r, b.inputs), &logits), "forward");
            nb_tensor *loss = nb_cross_entropy(r.step_ctx, logits, b.targets, NULL);
            TRY(&r, run_dist_backward(&r.d, loss), "backward");
            /* a non-finite gradient (the same on every rank) skips the step */
            double norm;
            TRY(&r, run_dist_clip(&r.d, r.opt, INFINITY, &norm), "gradient norm");
            if (isfinite(norm)) TRY(&r, run_dist_step(&r.d, r.opt), "optimizer step");
            else nb_progress_printf(r.progress, "step %lld: gradient norm %g, step skipped", (long long)r.step + 1, norm);
            TRY(&r, divergence_step(&r.guard, r.step_ctx, r.param_list, nb_optim_param_count(r.opt), r.step + 1, norm), "stopping");
            nb_optim_zero_grad(r.opt);
            r.state_bytes = run_dist_state_bytes(&r.d, r.opt); /* at the end of the step, before a checkpoint gathers */
            double l = nb_item(loss);
            double correct = (double)nb_count_correct(r.step_ctx, logits, b.targets);
            nb_metric_sums_add(&train, (double[]){l * (double)b.size, correct}, b.size);
            r.step++;
            nb_progress_update(r.progress, r.step, l, b.size * r.d.world_size);
        }
        TRY(&r, run_dist_sum(&r.d, nb_metric_sums_data(&train), nb_metric_sums_size(&train)), "all-reduce");
        TRY(&r, evaluate(&r, &test.loss, &test.accuracy, &test.count), "evaluation");
        TRY(&r, report_epoch(&r, epoch, &train, &test), "metrics");
        if (a->ckpt_dir && a->ckpt_sharded && (r.d.ddp || r.d.fsdp)) {
            TRY(&r, save_checkpoint(&r, r.step, epoch + 1, true), "checkpoint");
        } else if (a->ckpt_dir) {
            TRY(&r, run_dist_consolidate(&r.d, 0), "gathering the state");
            if (r.d.rank == 0) TRY(&r, save_checkpoint(&r, r.step, epoch + 1, false), "checkpoint");
        }
    }
    TRY(&r, run_dist_unshard(&r.d), "ZeRO"); /* the whole state back before the unwrap */
    return finish(&r, &test);
}
