/* train_gpt: trains a GPT language model, on one process or on N under a
 * launcher (`nbrun --nproc-per-node N train_gpt ...`, torchrun, mpirun,
 * srun) with the distributed sampler and DDP.
 *
 * Data: character-level text (default: the shipped Austen novels; each
 * distinct byte is a token) or, with --data, token shards in llm.c's
 * format, or with --synthetic random tokens (for benchmarks: no dataset
 * needed). --bf16 computes the matrix products in bf16 and keeps the
 * activations in bf16 (f32 weights, f32 accumulation, f32 loss), on a GPU
 * or the CPU. Training windows are the first part
 * of the data, the held-out windows the last --val-fraction (or
 * --val-data). AdamW with the usual two
 * parameter groups (no decay on biases and LayerNorm weights), linear
 * warmup then cosine decay, gradient accumulation, global-norm clipping;
 * --zero shards AdamW's state over the processes (ZeRO-1, docs/ddp.md);
 * --zero 2 the gradients too (ZeRO-2), --zero 3 the parameters too
 * (ZeRO-3 / FSDP: each block gathered for its forward and backward; its
 * checkpoints are consolidated on rank 0 too). The end-of-run memory line gives
 * state_bytes=, the parameter, gradient and optimizer-state bytes this
 * process holds at the end of the last step.
 * Only rank 0 prints, writes the metrics log and the plot, and saves
 * checkpoints (atomically); every rank loads on --resume and continues
 * exactly where the checkpoint left off: the same batches, learning rates
 * and dropout masks as a run that never stopped. At the end rank 0 prints a
 * sample drawn from the model. docs/examples.md describes every flag. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

#include "common/cli.h"
#include "common/divergence.h"
#include "common/fault.h"
#include "common/files.h"
#include "common/dist.h"
#include "common/report.h"
#include "common/resume.h"
#include "common/synthetic.h"

typedef struct args {
    const char *text, *data, *val_data;
    double val_fraction;
    int64_t vocab_size;
    int64_t layers, heads, width;
    double dropout;
    int64_t batch_size, seq_len, steps, stop_at, warmup, grad_accum;
    double lr, min_lr, weight_decay, beta1, beta2, clip;
    int64_t max_skipped_steps;
    int64_t eval_interval, eval_windows, log_interval, metrics_interval;
    const char *ckpt_dir;
    int64_t ckpt_interval;
    const char *resume_mode; /* --resume: NULL, "", "auto" or "auto-or-fresh" */
    int64_t keep_checkpoints; /* --keep-checkpoints: Note [Kept checkpoints] in common/resume.c */
    bool ckpt_sharded;        /* --ckpt-sharded: Note [Sharded save] in common/resume.c */
    bool resume;             /* a checkpoint is loaded */
    int64_t seed, sample_len, top_k;
    double temperature;
    const char *prompt, *metrics, *plot, *progress;
    bool print_device, bf16, synthetic, recompute, recompute_gelu;
    const char *zero; /* --zero: NULL, "", "1", "2" or "3" */
    int zero_stage;   /* 0 (off), 1, 2 or 3 */
    const char *keep_batch; /* --keep-batch: NULL, "global" or "rank" */
    const char *log_samples;
} args;

/* Everything the training loop touches. */
typedef struct run {
    args a;
    size_t state_bytes;             /* run_dist_state_bytes at the end of the last step */
    nb_progress_mode progress_mode; /* --progress */
    int64_t stop;                   /* the step this invocation ends at (--stop-at or --steps) */
    run_dist d;
    bool is_text;
    int vocab;
    uint8_t bytes[256]; /* text: the byte of each token id */
    nb_dataset *train, *val;
    nb_sampler *train_sampler, *eval_sampler;
    nb_loader *train_loader, *eval_loader;
    nb_ctx *params, *step_ctx;
    nb_module *model;
    nb_named_tensor *state;
    int n_state;
    nb_named_tensor *param_list, *groups_scratch; /* what the optimizer's two groups point into */
    nb_optim *opt;
    nb_lr_schedule sched;
    uint64_t dropout_seed;
    int64_t step, tokens_per_step;
    double lr; /* this step's learning rate */
    double elapsed0; /* seconds of training before a resume */
    double loss_sum; /* training losses since the last metrics record */
    int64_t loss_count;
    double val_loss;
    int64_t evaluated_at; /* the step of the last evaluation, -1: none yet */
    divergence guard; /* --max-skipped-steps */
    nb_progress *progress;
    nb_metrics_log *log;
    char ckpt_path[4096], plot_path[4096];
    char resume_path[4096]; /* the checkpoint --resume loads */
    /* Note [Another world size]: */
    int64_t end;            /* the step the schedule ends at (--steps, unless counted in samples) */
    int64_t samples;        /* training sequences consumed since the start, over every rank */
    int64_t schedule_batch; /* the global batch --steps and --warmup count in */
    bool sample_schedule;   /* the learning rate follows samples / schedule_batch */
    nb_lr_schedule sched_samples;
    bool resized;           /* resumed from a checkpoint of another world size */
    int64_t epoch_samples;  /* the checkpoint's position in its epoch (-1: an older file without it) */
    char resize_note[512];  /* what the banner says about it */
    FILE *sample_log;       /* --log-samples */
} run;

static int fail(const run *r, const char *what) {
    fprintf(stderr, "train_gpt (rank %d): %s: %s\n", r->d.rank, what, nb_last_error());
    return 1;
}

#define TRY(r, call, what)                                                  \
    do {                                                                    \
        if ((call) != NB_OK) return fail((r), (what));                      \
    } while (0)

/* ------------------------------------------------------------------ data */
static const char *data_name(const args *a) {
    return a->synthetic ? "random tokens (--synthetic)" : a->data ? a->data : a->text;
}

/* Windows [begin, end) of `all` as their own dataset. */
static nb_dataset *window_range(nb_dataset *all, int64_t begin, int64_t end) {
    int64_t n = end - begin;
    int64_t *idx = malloc((size_t)n * sizeof *idx);
    for (int64_t i = 0; i < n; i++) idx[i] = begin + i;
    nb_dataset *ds = nb_dataset_subset(all, idx, n);
    free(idx);
    return ds;
}

static nb_status open_data(run *r) {
    const args *a = &r->a;
    nb_dataset *all;
    nb_status s;
    if (a->synthetic) {
        /* enough training windows for every step, plus the held-out share */
        int64_t need = a->batch_size * r->d.world_size * a->grad_accum * a->steps;
        if (need < a->batch_size * r->d.world_size + 1) need = a->batch_size * r->d.world_size + 1;
        int64_t n_all = (int64_t)ceil((double)need / (1 - a->val_fraction)) + 1;
        all = synthetic_tokens_new(n_all, a->seq_len, a->vocab_size, (uint64_t)a->seed);
        r->vocab = (int)a->vocab_size;
        s = NB_OK;
    } else if (a->data) {
        s = nb_dataset_open_tokens(&all, a->data, a->seq_len, 0, a->vocab_size);
        if (s != NB_OK) return s;
        r->vocab = (int)a->vocab_size;
    } else {
        s = nb_dataset_open_text(&all, a->text, a->seq_len, 0, NB_TEXT_COMPACT);
        if (s != NB_OK) return s;
        r->vocab = nb_dataset_text_vocab(all, r->bytes);
        r->is_text = true;
    }
    int64_t n = nb_dataset_len(all);
    if (a->val_data) {
        r->train = nb_dataset_retain(all);
        s = nb_dataset_open_tokens(&r->val, a->val_data, a->seq_len, 0, a->vocab_size);
    } else {
        int64_t n_val = (int64_t)llround((double)n * a->val_fraction);
        if (n_val < 1) n_val = 1;
        if (n_val >= n) {
            nb_dataset_free(all);
            return nb_set_error(NB_ERR_INVALID, "%lld windows of %lld tokens: too few to hold out "
                                "a fraction %g", (long long)n, (long long)a->seq_len, a->val_fraction);
        }
        r->train = window_range(all, 0, n - n_val);
        r->val = window_range(all, n - n_val, n);
    }
    nb_dataset_free(all);
    if (s != NB_OK) return s;

    int64_t n_train = nb_dataset_len(r->train);
    if (n_train / r->d.world_size < a->batch_size)
        return nb_set_error(NB_ERR_INVALID, "%lld training windows are too few for batch %lld on "
                            "%d processes", (long long)n_train, (long long)a->batch_size,
                            r->d.world_size);
    s = run_dist_train_loader(&r->d, r->train, a->batch_size, (uint64_t)a->seed, &r->train_sampler,
                              &r->train_loader);
    if (s != NB_OK) return s;

    /* evaluation: eval_windows spread over the held-out windows, each
     * evaluated by exactly one rank */
    int64_t n_val = nb_dataset_len(r->val), n_eval = a->eval_windows;
    if (n_eval <= 0 || n_eval > n_val) n_eval = n_val;
    int64_t *idx = malloc((size_t)n_eval * sizeof *idx);
    for (int64_t i = 0; i < n_eval; i++) idx[i] = i * n_val / n_eval;
    nb_dataset *eval = nb_dataset_subset(r->val, idx, n_eval);
    free(idx);
    r->eval_sampler = nb_sampler_shard(n_eval, r->d.world_size, r->d.rank);
    nb_loader_options eo = {.batch_size = a->batch_size, .sampler = r->eval_sampler, .device = r->d.device};
    s = nb_loader_new(&r->eval_loader, eval, &eo);
    nb_dataset_free(eval);
    return s;
}

/* The next training batch, moving to the next epoch at the end of one. */
static nb_status next_batch(run *r, nb_batch *b) {
    for (int tries = 0; tries < 2; tries++) {
        nb_status s = nb_loader_next(r->train_loader, r->step_ctx, b);
        if (s != NB_OK || b->inputs) return s;
    }
    return nb_set_error(NB_ERR_INTERNAL, "the training loader gave an empty epoch");
}

/* An evaluation batch's next-token loss, summed over its windows. */
static void eval_batch(void *user, nb_ctx *ctx, const nb_batch *b, double *v) {
    run *r = user;
    v[0] = nb_item(nb_gpt_loss(ctx, nb_gpt_forward(r->model, ctx, b->inputs), b->targets)) * (double)b->size;
}

/* Mean next-token loss over the evaluation windows, the same on every rank. */
static nb_status evaluate(run *r, double *loss) {
    nb_metric_sums sums;
    nb_status s = run_dist_evaluate(&r->d, r->model, r->eval_loader, r->step_ctx, 1, eval_batch, r, &sums);
    *loss = nb_metric_sums_mean(&sums, 0);
    return s;
}

/* ------------------------------------------------------------ checkpoints */
typedef struct meta_buf {
    char v[24][64];
    nb_kv kv[24];
    int n;
} meta_buf;

static void meta_add(meta_buf *m, const char *key, const char *fmt, long long value) {
    snprintf(m->v[m->n], sizeof m->v[0], fmt, value);
    m->kv[m->n] = (nb_kv){key, m->v[m->n]};
    m->n++;
}

/* What a checkpoint must agree on with the run that resumes from it. */
static void run_meta(const run *r, meta_buf *m) {
    const args *a = &r->a;
    m->n = 0;
    bool resized = r->resized; /* world and batch size were checked by plan_resume */
    meta_add(m, "vocab_size", "%lld", r->vocab);
    meta_add(m, "block_size", "%lld", a->seq_len);
    meta_add(m, "n_layer", "%lld", a->layers);
    meta_add(m, "n_head", "%lld", a->heads);
    meta_add(m, "n_embd", "%lld", a->width);
    if (!resized) meta_add(m, "world_size", "%lld", r->d.world_size);
    if (!resized) meta_add(m, "batch_size", "%lld", a->batch_size);
    meta_add(m, "grad_accum", "%lld", a->grad_accum);
    meta_add(m, "seed", "%lld", a->seed);
}

/* The metadata and loop state of a checkpoint after steps_done steps. */
static nb_train_state checkpoint_meta(run *r, int64_t steps_done, meta_buf *m, char *elapsed, size_t cap) {
    int64_t epoch, position;
    nb_loader_position(r->train_loader, &epoch, &position);
    run_meta(r, m);
    snprintf(elapsed, cap, "%.3f", r->log ? nb_metrics_log_time(r->log) : 0.0);
    m->kv[m->n++] = (nb_kv){"program", "train_gpt"};
    m->kv[m->n++] = (nb_kv){"data", data_name(&r->a)};
    m->kv[m->n++] = (nb_kv){"elapsed_s", elapsed};
    /* the epoch's position as a global sample count (Note [Another world size]); the loader counts
     * from the epoch's start, the batches before a resume point (base) included, and the sampler
     * adds the samples taken before it */
    int64_t before = nb_sampler_distributed_taken(r->train_sampler, 0);
    int64_t base = before / (r->a.batch_size * r->d.world_size);
    int64_t epoch_samples = nb_sampler_distributed_taken(r->train_sampler, (position - base) * r->a.batch_size);
    meta_add(m, "epoch_samples", "%lld", epoch_samples);
    meta_add(m, "samples", "%lld", r->samples);
    meta_add(m, "schedule_batch", "%lld", r->schedule_batch);
    m->kv[m->n++] = (nb_kv){"schedule", r->sample_schedule ? "samples" : "steps"};
    return (nb_train_state){steps_done, epoch, position, *nb_gpt_dropout_rng(r->model)};
}

/* Rank 0, the optimizer's state whole (consolidated under ZeRO). */
static nb_status save_checkpoint(run *r, int64_t steps_done) {
    meta_buf m;
    char elapsed[64];
    nb_train_state st = checkpoint_meta(r, steps_done, &m, elapsed, sizeof elapsed);
    /* never a diverged state over the last good checkpoint */
    char what[96];
    snprintf(what, sizeof what, "step %lld not saved", (long long)steps_done);
    int n_opt;
    const nb_named_tensor *opt_state = nb_optim_state(r->opt, &n_opt);
    nb_status s = divergence_check_finite(r->step_ctx, r->state, r->n_state, what);
    if (s == NB_OK) s = divergence_check_finite(r->step_ctx, opt_state, n_opt, what);
    if (s == NB_OK) s = files_make_dirs(r->a.ckpt_dir);
    if (s == NB_OK) s = nb_checkpoint_keep(r->a.ckpt_dir, "train_gpt", (int)r->a.keep_checkpoints);
    if (s == NB_OK) s = nb_checkpoint_save_training(r->ckpt_path, r->state, r->n_state, r->opt, &st, m.kv, m.n);
    return s;
}

/* --ckpt-sharded under ZeRO (1, 2 or 3): every rank writes its shard, rank 0 the index. */
static nb_status save_sharded(run *r, int64_t steps_done) {
    meta_buf m;
    char elapsed[64];
    nb_train_state st = checkpoint_meta(r, steps_done, &m, elapsed, sizeof elapsed);
    return resume_save_sharded(&r->d, r->a.ckpt_dir, r->ckpt_path, "train_gpt", (int)r->a.keep_checkpoints,
                               r->step_ctx, r->state, r->n_state, r->opt, &st, m.kv, m.n);
}

static nb_status load_checkpoint(run *r) {
    nb_checkpoint *ck;
    nb_status s = nb_checkpoint_open(r->resume_path, &ck);
    if (s != NB_OK) return s;
    meta_buf m;
    run_meta(r, &m);
    s = resume_check_meta(ck, r->resume_path, m.kv, m.n);
    const char *elapsed = nb_checkpoint_meta(ck, "elapsed_s");
    r->elapsed0 = elapsed ? atof(elapsed) : 0;
    nb_checkpoint_close(ck);
    if (s != NB_OK) return s;
    nb_train_state st;
    s = nb_checkpoint_load_training(r->resume_path, r->state, r->n_state, r->opt, &st);
    if (s != NB_OK) return s;
    r->step = st.step;
    if (r->epoch_samples >= 0) {
        /* the position as the epoch's global sample count: Note [Another world size] */
        if (r->epoch_samples > nb_dataset_len(r->train))
            return nb_set_error(NB_ERR_MISMATCH, "%s: its position, %lld sequences into epoch %lld, is past the "
                                "%lld training windows (a checkpoint of other data?)", r->resume_path,
                                (long long)r->epoch_samples, (long long)st.epoch, (long long)nb_dataset_len(r->train));
        nb_sampler_distributed_resume(r->train_sampler, st.epoch, r->epoch_samples);
        s = nb_loader_seek(r->train_loader, st.epoch, 0);
    } else {
        s = nb_loader_seek(r->train_loader, st.epoch, st.data_position); /* a checkpoint of other data? */
    }
    if (s != NB_OK) return s;
    /* every rank draws its own masks; all are at the same offset */
    *nb_gpt_dropout_rng(r->model) = (nb_rng){r->dropout_seed, st.rng.offset};
    return NB_OK;
}

/* Which checkpoint --resume loads; with --resume auto and none there, the
 * run starts afresh (a->resume becomes false). */
static nb_status find_resume(run *r) {
    bool found;
    int64_t step;
    nb_status s = resume_find(&r->d, r->a.ckpt_dir, r->a.resume_mode, "train_gpt", r->resume_path,
                              sizeof r->resume_path, &found, &step);
    r->a.resume = found;
    return s;
}

/* Note [Another world size]
 * A checkpoint carries the data position as the epoch's global sample
 * count ("epoch_samples", Note [Resuming at another world size] in
 * data/sampler.c), the sequences consumed since the start ("samples") and
 * the global batch that --steps and --warmup count in ("schedule_batch").
 * Resumed on another number of processes R' (R before), the run keeps what
 * --keep-batch says:
 *   global: the global batch G = R x B x grad_accum; each process takes
 *           G / (R' x grad_accum) sequences per micro-step (refused when
 *           that is not a whole number). Every step consumes the same G
 *           sequences of the epoch's list as before, so steps, schedule and
 *           data are unchanged; only the sums' order differs (gradients
 *           agree to rounding, not bit for bit).
 *   rank:   the per-process batch B; a step consumes R' x B x grad_accum
 *           sequences, and the learning rate follows the sequences consumed
 *           (warmup and length scaled by schedule_batch), the run ending
 *           once steps x schedule_batch sequences are consumed.
 * Either way the epoch continues after the sequences already consumed, on
 * the new ranks, with none taken twice. Once counted in samples, the
 * schedule stays so in later resumes. A checkpoint without these keys
 * (written before them) resumes only at its own world size. */
static nb_status meta_int(nb_checkpoint *ck, const char *path, const char *key, int64_t *v) {
    const char *s = nb_checkpoint_meta(ck, key);
    char *end;
    if (!s) return NB_ERR_NOT_FOUND;
    long long x = strtoll(s, &end, 10);
    if (end == s || *end || x < 0)
        return nb_set_error(NB_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not a non-negative integer", path,
                            key, s);
    *v = x;
    return NB_OK;
}

/* Reads the checkpoint's world size, batch and position before the data
 * and the model are made: on another world size, decides the batch
 * (--keep-batch) or refuses. */
static nb_status plan_resume(run *r) {
    args *a = &r->a;
    nb_checkpoint *ck;
    nb_status s = nb_checkpoint_open(r->resume_path, &ck);
    if (s != NB_OK) return s;
    const char *path = r->resume_path;
    int64_t world0 = 0, batch0 = 0, accum0 = 0, steps0 = 0;
    if ((s = meta_int(ck, path, "world_size", &world0)) != NB_OK || (s = meta_int(ck, path, "batch_size", &batch0)) != NB_OK ||
        (s = meta_int(ck, path, "grad_accum", &accum0)) != NB_OK || (s = meta_int(ck, path, "step", &steps0)) != NB_OK) {
        if (s == NB_ERR_NOT_FOUND)
            s = nb_set_error(NB_ERR_FORMAT, "%s: not a train_gpt checkpoint (world_size, batch_size, grad_accum "
                             "or step missing from its metadata)", path);
        nb_checkpoint_close(ck);
        return s;
    }
    int64_t global0 = world0 * batch0 * accum0;
    r->epoch_samples = -1;
    r->samples = steps0 * global0;
    r->schedule_batch = global0;
    const char *unit = nb_checkpoint_meta(ck, "schedule");
    bool has_position = meta_int(ck, path, "epoch_samples", &r->epoch_samples) == NB_OK &&
                        meta_int(ck, path, "samples", &r->samples) == NB_OK &&
                        meta_int(ck, path, "schedule_batch", &r->schedule_batch) == NB_OK && unit;
    if (!has_position) r->epoch_samples = -1;
    r->sample_schedule = has_position && !strcmp(unit, "samples");
    nb_checkpoint_close(ck);
    int world = r->d.world_size;
    if (world0 == world) return NB_OK; /* the settings are checked as always, by load_checkpoint */
    if (!a->keep_batch) {
        int64_t g = global0 / world, b = g / a->grad_accum;
        char global_hint[128] = "";
        if (global0 % (world * a->grad_accum) == 0)
            snprintf(global_hint, sizeof global_hint, ", %lld per process", (long long)b);
        else
            snprintf(global_hint, sizeof global_hint, ", which %d processes cannot share", world);
        return nb_set_error(NB_ERR_MISMATCH, "%s was written with world_size %lld, this run has %d: to continue on "
                            "%d processes, choose what stays fixed: --keep-batch global (the global batch of %lld "
                            "sequences%s) or --keep-batch rank (%lld sequences per process: %lld per step, the "
                            "learning-rate schedule counted in sequences)", path, (long long)world0, world, world,
                            (long long)global0, global_hint, (long long)batch0,
                            (long long)(batch0 * world * accum0));
    }
    if (!has_position)
        return nb_set_error(NB_ERR_MISMATCH, "%s was written with world_size %lld, this run has %d, and it lacks its "
                            "data position in samples (\"epoch_samples\", written since nabla resumes at another "
                            "world size): it resumes only on %lld processes", path, (long long)world0, world,
                            (long long)world0);
    if (accum0 != a->grad_accum)
        return nb_set_error(NB_ERR_MISMATCH, "%s was written with grad_accum %lld, this run has %lld (resume with "
                            "the same settings)", path, (long long)accum0, (long long)a->grad_accum);
    r->resized = true;
    if (!strcmp(a->keep_batch, "global")) {
        if (global0 % ((int64_t)world * a->grad_accum) != 0)
            return nb_set_error(NB_ERR_INVALID, "--keep-batch global: the global batch of %lld sequences (%lld "
                                "processes x %lld x %lld micro-steps) cannot be shared by %d processes x %lld "
                                "micro-steps; resume on a divisor of it, or with --keep-batch rank", (long long)global0,
                                (long long)world0, (long long)batch0, (long long)accum0, world, (long long)a->grad_accum);
        a->batch_size = global0 / ((int64_t)world * a->grad_accum);
        snprintf(r->resize_note, sizeof r->resize_note, "world size %lld -> %d since the checkpoint, --keep-batch "
                 "global: the global batch stays %lld sequences, now %lld per process (was %lld)", (long long)world0,
                 world, (long long)global0, (long long)a->batch_size, (long long)batch0);
    } else {
        a->batch_size = batch0;
        r->sample_schedule = true;
        snprintf(r->resize_note, sizeof r->resize_note, "world size %lld -> %d since the checkpoint, --keep-batch "
                 "rank: %lld sequences per process, %lld per step (was %lld); the learning-rate schedule counts "
                 "sequences (%lld per scheduled step)", (long long)world0, world, (long long)batch0,
                 (long long)(batch0 * world * accum0), (long long)global0, (long long)r->schedule_batch);
    }
    return NB_OK;
}

/* The learning-rate schedule and the last step, once the batch is known. */
static void plan_schedule(run *r) {
    const args *a = &r->a;
    int64_t global = a->batch_size * r->d.world_size * a->grad_accum;
    if (!r->schedule_batch) r->schedule_batch = global; /* a fresh start */
    r->end = a->steps;
    if (r->sample_schedule) {
        int64_t total = a->steps * r->schedule_batch, left = total > r->samples ? total - r->samples : 0;
        r->end = r->step + (left + global - 1) / global;
        r->sched_samples = nb_lr_cosine(a->lr, a->warmup * r->schedule_batch, total, a->min_lr);
    }
    r->stop = a->stop_at > 0 && a->stop_at < r->end ? a->stop_at : r->end;
}

/* ------------------------------------------------------------- sampling */
static nb_status print_sample(run *r) {
    const args *a = &r->a;
    int64_t n_prompt = 0, total;
    int64_t *tok = NULL;
    if (r->is_text) {
        int id_of[256];
        for (int i = 0; i < 256; i++) id_of[i] = -1;
        for (int i = 0; i < r->vocab; i++) id_of[r->bytes[i]] = i;
        size_t len = strlen(a->prompt);
        total = (int64_t)len + a->sample_len;
        tok = malloc((size_t)(total > 0 ? total : 1) * sizeof *tok);
        for (size_t i = 0; i < len; i++) {
            int id = id_of[(unsigned char)a->prompt[i]];
            if (id < 0) {
                free(tok);
                return nb_set_error(NB_ERR_INVALID, "--prompt: character '%c' does not occur in the "
                                    "training text", a->prompt[i]);
            }
            tok[n_prompt++] = id;
        }
    } else {
        total = 1 + a->sample_len;
        tok = malloc((size_t)total * sizeof *tok);
        tok[n_prompt++] = r->vocab > 50256 ? 50256 : 0; /* GPT-2's <|endoftext|> */
    }
    if (n_prompt == 0) {
        free(tok);
        return nb_set_error(NB_ERR_INVALID, "--prompt is empty");
    }
    nb_sample_opts so = {a->temperature, (int)a->top_k};
    nb_rng rng = nb_rng_make((uint64_t)a->seed);
    nb_gpt_generate(r->model, r->step_ctx, tok, n_prompt, total, &so, &rng);
    nb_progress_printf(r->progress, "sample (%lld %s, temperature %g):\n--------",
                       (long long)a->sample_len, r->is_text ? "characters" : "tokens", a->temperature);
    if (r->is_text) {
        char *text = malloc((size_t)total + 1);
        for (int64_t i = 0; i < total; i++) text[i] = (char)r->bytes[tok[i]];
        text[total] = 0;
        nb_progress_printf(r->progress, "%s\n--------", text);
        free(text);
    } else {
        for (int64_t i = 0; i < total; i++) printf("%lld%c", (long long)tok[i], i + 1 < total ? ' ' : '\n');
        nb_progress_printf(r->progress, "--------");
    }
    free(tok);
    return NB_OK;
}

/* ------------------------------------------------------------- setup */
static bool check_args(const args *a) {
    const char *bad = NULL;
    if (a->layers < 1 || a->heads < 1 || a->width < 1 || a->width % a->heads) bad = "--width must be a positive multiple of --heads, with --layers >= 1";
    else if (a->batch_size < 1 || a->seq_len < 1 || a->steps < 1 || a->grad_accum < 1) bad = "--batch-size, --seq-len, --steps and --grad-accum must be >= 1";
    else if (!(a->lr > 0) || a->min_lr < 0 || a->warmup < 0 || a->weight_decay < 0 || a->clip < 0) bad = "--lr must be > 0; --min-lr, --warmup, --weight-decay and --clip >= 0";
    else if (!(a->val_fraction > 0 && a->val_fraction < 1)) bad = "--val-fraction must be in (0, 1)";
    else if (a->dropout < 0 || a->dropout >= 1) bad = "--dropout must be in [0, 1)";
    else if (a->resume && !a->ckpt_dir) bad = "--resume needs --ckpt-dir";
    else if (a->max_skipped_steps < 0) bad = "--max-skipped-steps must be >= 0 (0: never stop)";
    else if (a->keep_checkpoints < 1) bad = "--keep-checkpoints must be >= 1";
    else if (a->ckpt_sharded && (!a->ckpt_dir || !a->zero)) bad = "--ckpt-sharded needs --ckpt-dir and --zero";
    else if (a->eval_interval < 0 || a->ckpt_interval < 0 || a->log_interval < 1 || a->metrics_interval < 1 || a->sample_len < 0) bad = "--eval-interval, --ckpt-interval, --sample-len must be >= 0, --log-interval and --metrics-interval >= 1";
    else if ((a->data || a->synthetic) && a->vocab_size < 2) bad = "--vocab-size must be >= 2";
    else if (a->synthetic && (a->data || a->val_data)) bad = "--synthetic makes its own tokens: drop --data and --val-data";
    if (bad) fprintf(stderr, "train_gpt: %s\n", bad);
    return !bad;
}

/* Fills r->a from the command line. -1: go on; otherwise the exit code (0
 * after --help, 2 after a bad flag). */
static int parse_args(run *r, int argc, char **argv) {
    args *a = &r->a;
    *a = (args){.text = NABLA_SOURCE_DIR "/examples/datasets/austen.txt", .val_fraction = 0.1,
                .vocab_size = 50257, .layers = 4, .heads = 4, .width = 128, .batch_size = 16,
                .seq_len = 64, .steps = 2000, .warmup = 100, .grad_accum = 1, .lr = 3e-3,
                .max_skipped_steps = DIVERGENCE_DEFAULT_MAX_SKIPPED,
                .min_lr = -1, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.99, .clip = 1.0,
                .eval_interval = 250, .eval_windows = 256, .log_interval = 10, .metrics_interval = 10, .seed = 1337,
                .sample_len = 300, .temperature = 0.8, .prompt = "\n", .progress = "auto", .keep_checkpoints = 3};
    cli_flag flags[] = {
        {"text", CLI_STRING, &a->text, "character-level training text"},
        {"data", CLI_STRING, &a->data, "llm.c token shards (file or glob) instead of --text"},
        {"synthetic", CLI_BOOL, &a->synthetic, "random tokens of --vocab-size instead of --text or --data (benchmarks)"},
        {"val-data", CLI_STRING, &a->val_data, "held-out token shards (default: the last --val-fraction)"},
        {"val-fraction", CLI_DOUBLE, &a->val_fraction, "share of the windows held out for evaluation"},
        {"vocab-size", CLI_INT, &a->vocab_size, "vocabulary of --data (above every token id)"},
        {"layers", CLI_INT, &a->layers, "transformer blocks"},
        {"heads", CLI_INT, &a->heads, "attention heads"},
        {"width", CLI_INT, &a->width, "embedding width (a multiple of --heads)"},
        {"dropout", CLI_DOUBLE, &a->dropout, "dropout probability"},
        {"bf16", CLI_BOOL, &a->bf16, "bf16 matrix products and activations (f32 weights and accumulation)"},
        {"recompute", CLI_BOOL, &a->recompute, "keep each block's input only and run the block again in backward (less memory, ~1/3 more compute, same gradients)"},
        {"recompute-gelu", CLI_BOOL, &a->recompute_gelu, "keep each MLP's pre-activation only and run GELU on it again in backward (one (N, T, 4C) tensor less per layer, one elementwise kernel more)"},
        {"batch-size", CLI_INT, &a->batch_size, "sequences per process per micro-step"},
        {"seq-len", CLI_INT, &a->seq_len, "tokens per sequence (the model's block size)"},
        {"steps", CLI_INT, &a->steps, "optimizer steps (the schedule's length)"},
        {"stop-at", CLI_INT, &a->stop_at, "stop after this step, saving a checkpoint (0: --steps)"},
        {"lr", CLI_DOUBLE, &a->lr, "peak learning rate"},
        {"min-lr", CLI_DOUBLE, &a->min_lr, "final learning rate of the cosine decay (negative: lr / 10)"},
        {"warmup", CLI_INT, &a->warmup, "linear warmup steps"},
        {"weight-decay", CLI_DOUBLE, &a->weight_decay, "AdamW decay of weight matrices and embeddings"},
        {"beta1", CLI_DOUBLE, &a->beta1, "AdamW beta1"},
        {"beta2", CLI_DOUBLE, &a->beta2, "AdamW beta2"},
        {"grad-accum", CLI_INT, &a->grad_accum, "micro-steps per optimizer step"},
        {"clip", CLI_DOUBLE, &a->clip, "gradient-norm clipping threshold (0: off)"},
        {"max-skipped-steps", CLI_INT, &a->max_skipped_steps, "stop after this many consecutive steps skipped for a non-finite gradient (0: never)"},
        {"zero", CLI_OPTIONAL, &a->zero, "ZeRO: 1 (the flag alone) shards AdamW's state over the processes, 2 the gradients too, 3 the parameters too (FSDP)"},
        {"eval-interval", CLI_INT, &a->eval_interval, "steps between evaluations (0: only at the end)"},
        {"eval-windows", CLI_INT, &a->eval_windows, "held-out windows per evaluation (0: all)"},
        {"log-interval", CLI_INT, &a->log_interval, "steps between progress lines when output is not a terminal"},
        {"metrics-interval", CLI_INT, &a->metrics_interval, "steps between records in the metrics file"},
        {"ckpt-dir", CLI_STRING, &a->ckpt_dir, "directory for ckpt.safetensors"},
        {"ckpt-interval", CLI_INT, &a->ckpt_interval, "steps between checkpoints (0: only at the end)"},
        {"resume", CLI_OPTIONAL, &a->resume_mode, "continue from --ckpt-dir/ckpt.safetensors; 'auto': from the newest checkpoint in --ckpt-dir that loads (saying which it passes over and why), afresh when there is none, and refusing to start when every one is damaged; 'auto-or-fresh': the same, but afresh then"},
        {"ckpt-sharded", CLI_BOOL, &a->ckpt_sharded, "with --zero on several processes: each writes its shard of the state, rank 0 an index (ckpt.safetensors); it resumes at any world size, and nb_ckpt consolidate makes the single file"},
        {"keep-checkpoints", CLI_INT, &a->keep_checkpoints, "checkpoints kept in --ckpt-dir: ckpt.safetensors and the older ckpt.step<N>.safetensors (1: the newest only)"},
        {"keep-batch", CLI_STRING, &a->keep_batch, "resuming on another number of processes: keep the 'global' batch or the per-process batch ('rank', the schedule then counted in sequences)"},
        {"log-samples", CLI_STRING, &a->log_samples, "append each micro-batch's dataset indices to FILE.<rank> (step, epoch, indices)"},
        {"seed", CLI_INT, &a->seed, "initialisation, data order, dropout and sampling"},
        {"sample-len", CLI_INT, &a->sample_len, "tokens to generate at the end (0: none)"},
        {"temperature", CLI_DOUBLE, &a->temperature, "sampling temperature (0: greedy)"},
        {"top-k", CLI_INT, &a->top_k, "sample among the k most likely tokens (0: all)"},
        {"prompt", CLI_STRING, &a->prompt, "text the sample continues (--text only)"},
        {"metrics", CLI_STRING, &a->metrics, "JSON-lines metrics file"},
        {"plot", CLI_STRING, &a->plot, "SVG loss plot (default: --metrics with .svg)"},
        {"progress", CLI_STRING, &a->progress, "auto, line, plain or off"},
        {"print-device", CLI_BOOL, &a->print_device, "print the device a rank would train on (cpu, cuda:N) and exit"},
    };
    int nf = (int)(sizeof flags / sizeof flags[0]);
    int rc = cli_parse(argc, argv, "train_gpt", "Trains a GPT language model (see docs/examples.md).",
                       flags, nf);
    if (rc) return rc == 1 ? 0 : 2;
    if (!report_progress_mode("train_gpt", a->progress, &r->progress_mode)) return 2;
    if (a->min_lr < 0) a->min_lr = a->lr / 10;
    a->zero_stage = run_dist_zero_stage(a->zero, "train_gpt");
    if (a->zero_stage < 0) return 2;
    a->resume = a->resume_mode != NULL;
    if (a->resume_mode && *a->resume_mode && strcmp(a->resume_mode, "auto") && strcmp(a->resume_mode, "auto-or-fresh")) {
        fprintf(stderr, "train_gpt: --resume takes no value, 'auto' or 'auto-or-fresh', not \"%s\"\n", a->resume_mode);
        return 2;
    }
    if (a->keep_batch && strcmp(a->keep_batch, "global") && strcmp(a->keep_batch, "rank")) {
        fprintf(stderr, "train_gpt: --keep-batch must be global or rank, not \"%s\"\n", a->keep_batch);
        return 2;
    }
    if (!check_args(a)) return 2;
    r->guard.max_skipped = a->max_skipped_steps;
    r->stop = a->stop_at > 0 && a->stop_at < a->steps ? a->stop_at : a->steps;
    return -1;
}

/* The model on this rank's device, its state list for checkpoints, AdamW
 * with the usual two parameter groups, and the learning-rate schedule. */
static void build_model(run *r) {
    const args *a = &r->a;
    r->params = nb_ctx_new(r->d.device, 0);
    r->step_ctx = nb_ctx_new(r->d.device, 0);
    /* forward, backward, evaluation and sampling all run in step_ctx */
    if (a->bf16) nb_ctx_set_compute_dtype(r->step_ctx, NB_BF16);
    nb_gpt_config cfg = {r->vocab, a->seq_len, (int)a->layers, (int)a->heads, a->width, a->dropout};
    nb_rng init = nb_rng_make((uint64_t)a->seed);
    r->model = nb_gpt_new(r->params, NB_F32, &cfg, &init);
    nb_gpt_set_recompute(r->model, a->recompute);
    nb_gpt_set_recompute_gelu(r->model, a->recompute_gelu);
    r->dropout_seed = (uint64_t)a->seed * 0x9E3779B97F4A7C15ull + 1 + (uint64_t)r->d.rank;
    *nb_gpt_dropout_rng(r->model) = nb_rng_make(r->dropout_seed);
    r->n_state = nb_module_state(r->model, NULL, 0);
    r->state = malloc((size_t)r->n_state * sizeof *r->state);
    nb_module_state(r->model, r->state, r->n_state);

    int n_params = nb_module_named_parameters(r->model, NULL, 0);
    r->param_list = malloc((size_t)n_params * sizeof *r->param_list);
    r->groups_scratch = malloc((size_t)n_params * sizeof *r->groups_scratch);
    nb_module_named_parameters(r->model, r->param_list, n_params);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = a->lr, h.weight_decay = a->weight_decay, h.beta1 = a->beta1, h.beta2 = a->beta2;
    nb_param_group groups[2];
    nb_optim_split_decay(r->param_list, n_params, &h, r->groups_scratch, groups);
    r->opt = nb_optim_new_groups(NB_OPTIM_ADAMW, 2, groups);
    r->sched = nb_lr_cosine(a->lr, a->warmup, a->steps, a->min_lr);
    if (a->ckpt_dir) snprintf(r->ckpt_path, sizeof r->ckpt_path, "%s/ckpt.safetensors", a->ckpt_dir);
}

/* The progress display (rank 0 only), the metrics log (rank 0, with
 * --metrics) and the plot's path. */
static nb_status open_monitor(run *r) {
    const args *a = &r->a;
    bool lead = r->d.rank == 0;
    r->tokens_per_step = a->batch_size * a->seq_len * a->grad_accum * r->d.world_size;
    nb_progress_opts po = {lead ? r->progress_mode : NB_PROGRESS_OFF, "tok", a->log_interval, 0};
    r->progress = nb_progress_new(stdout, r->step, r->stop, &po);
    if (lead && a->metrics) {
        nb_status s = files_make_parent_dirs(a->metrics);
        if (s == NB_OK) s = nb_metrics_log_open(&r->log, a->metrics, a->resume, r->elapsed0);
        if (s != NB_OK) return s;
    }
    report_plot_path(r->plot_path, sizeof r->plot_path, a->plot, a->metrics);
    return NB_OK;
}

/* What is about to be trained, on what, by how many processes. */
static void print_banner(run *r) {
    const args *a = &r->a;
    nb_progress_printf(r->progress, "train_gpt: GPT with %lld layers, %lld heads, width %lld: %.2fM "
                       "parameters; vocabulary %d (%s); on %s%s", (long long)a->layers, (long long)a->heads,
                       (long long)a->width, (double)nb_module_num_params(r->model) / 1e6, r->vocab,
                       r->is_text ? "the characters of the text" : a->synthetic ? "random tokens" : "token shards",
                       nb_device_name(r->d.device), a->bf16 ? ", bf16 matrix products" : "");
    nb_progress_printf(r->progress, "data: %lld training and %lld held-out windows of %lld tokens "
                       "from %s", (long long)nb_dataset_len(r->train), (long long)nb_dataset_len(r->val),
                       (long long)a->seq_len, data_name(a));
    char steps[160];
    if (r->step < r->stop)
        snprintf(steps, sizeof steps, "steps %lld..%lld of %lld%s", (long long)r->step + 1, (long long)r->stop,
                 (long long)r->end, a->resume ? " (resumed)" : "");
    else /* resumed at or past the end: say so rather than "steps 801..800" */
        snprintf(steps, sizeof steps, "nothing to train: the checkpoint is at step %lld of %lld (%s)",
                 (long long)r->step, (long long)r->end,
                 r->step >= r->end ? "a larger --steps trains further" : "--stop-at is not after it");
    nb_progress_printf(r->progress, "%d process%s%s: batch %lld x %lld tokens per process, %lld "
                       "micro-step%s per step = %lld tokens per step; %s",
                       r->d.world_size, r->d.world_size > 1 ? "es" : "", r->d.ddp ? " with DDP" : r->d.fsdp ? " with ZeRO-3" : "",
                       (long long)a->batch_size, (long long)a->seq_len, (long long)a->grad_accum,
                       a->grad_accum > 1 ? "s" : "", (long long)r->tokens_per_step, steps);
    if (r->resize_note[0]) nb_progress_printf(r->progress, "%s", r->resize_note);
    if (a->resume_mode && !strncmp(a->resume_mode, "auto", 4))
        nb_progress_printf(r->progress, a->resume ? "--resume auto: from %s" : "--resume auto: no checkpoint "
                           "in %s: a fresh start", a->resume ? r->resume_path : a->ckpt_dir);
    nb_progress_printf(r->progress, "optimizer state per process: %zu bytes%s", nb_optim_state_bytes(r->opt),
                       run_dist_zero_label(&r->d));
}

/* ----------------------------------------------------- during training */
/* Whether step `done` is one of every `interval` (0: never), or the last. */
static bool due(const run *r, int64_t done, int64_t interval) {
    return (interval > 0 && done % interval == 0) || done == r->stop;
}

/* Adds a step's loss to the current metrics record and writes the record
 * (the mean loss since the last one) every --metrics-interval steps. */
static nb_status log_train(run *r, int64_t done, double loss, double grad_norm) {
    r->loss_sum += loss, r->loss_count++;
    if (!r->log || !due(r, done, r->a.metrics_interval)) return NB_OK;
    nb_status s = nb_metrics_log_write(r->log, "train", done, (nb_metric_value[]){
        {"loss", r->loss_sum / (double)r->loss_count}, {"lr", r->lr},
        {"grad_norm", grad_norm}, {"tokens", (double)r->samples * (double)r->a.seq_len}}, 4);
    r->loss_sum = 0, r->loss_count = 0;
    return s;
}

/* --log-samples: FILE.<rank>, appended to (a resumed run continues it). */
static nb_status open_sample_log(run *r) {
    if (!r->a.log_samples) return NB_OK;
    char path[4200];
    snprintf(path, sizeof path, "%s.%d", r->a.log_samples, r->d.rank);
    r->sample_log = fopen(path, "a");
    if (!r->sample_log) return nb_set_error(NB_ERR_IO, "cannot open \"%s\": %s", path, strerror(errno));
    return NB_OK;
}

/* "step S epoch E: i i ...", flushed so that a killed rank leaves whole lines. */
static void log_samples(run *r, const nb_batch *b) {
    fprintf(r->sample_log, "step %lld epoch %lld:", (long long)r->step + 1, (long long)b->epoch);
    for (int64_t i = 0; i < b->size; i++) fprintf(r->sample_log, " %lld", (long long)b->indices[i]);
    fputc('\n', r->sample_log);
    fflush(r->sample_log);
}

/* ------------------------------------------------------------- the end */
/* After the last step: an evaluation unless that step made one, the
 * sample, the plot, where the files are; then leaves the run and frees
 * everything. The exit code. */
static int finish(run *r) {
    const args *a = &r->a;
    bool lead = r->d.rank == 0;
    nb_progress_free(r->progress);
    nb_progress_opts po = {lead ? NB_PROGRESS_PLAIN : NB_PROGRESS_OFF, NULL, 1, 0};
    r->progress = nb_progress_new(stdout, 0, 0, &po);
    if (r->evaluated_at != r->stop && r->stop > 0) {
        TRY(r, evaluate(r, &r->val_loss), "evaluation");
        nb_progress_printf(r->progress, "val loss %.4f", r->val_loss);
    }
    if (lead && a->sample_len > 0 && r->stop == r->end) TRY(r, print_sample(r), "sampling");
    if (r->log) {
        nb_metrics_log_close(r->log);
        r->log = NULL;
        if (lead && r->plot_path[0]) {
            report_curve c[2] = {{"train", "loss", "train loss"}, {"eval", "val_loss", "val loss"}};
            nb_plot_opts o = {"train_gpt: loss per token (nats)", "step", "loss", 0, 0, false, false, false};
            TRY(r, report_plot(r->plot_path, a->metrics, "step", c, 2, &o), "plot");
        }
    }
    if (nb_ctx_peak(r->step_ctx) > 0) { /* the last step's memory beside the floor */
        char mem[512];
        nb_memory_floor floor = nb_gpt_memory_floor(r->model, a->batch_size, a->seq_len, 2);
        nb_progress_printf(r->progress, "%s; state_bytes=%zu", nb_memory_report(mem, sizeof mem, &floor, r->step_ctx, r->params),
                           r->state_bytes);
    }
    if (a->ckpt_dir) nb_progress_printf(r->progress, "checkpoint: %s (step %lld)", r->ckpt_path, (long long)r->stop);
    if (a->metrics) nb_progress_printf(r->progress, "metrics:    %s", a->metrics);
    if (r->plot_path[0] && a->metrics) nb_progress_printf(r->progress, "plot:       %s", r->plot_path);
    nb_progress_free(r->progress);

    TRY(r, run_dist_finish(&r->d), "shutting down");
    nb_optim_free(r->opt);
    nb_loader_free(r->train_loader);
    nb_loader_free(r->eval_loader);
    nb_sampler_free(r->train_sampler);
    nb_sampler_free(r->eval_sampler);
    nb_dataset_free(r->train);
    nb_dataset_free(r->val);
    nb_ctx_free(r->step_ctx);
    nb_ctx_free(r->params);
    if (r->sample_log) fclose(r->sample_log);
    free(r->state);
    free(r->param_list);
    free(r->groups_scratch);
    return 0;
}

/* ------------------------------------------------------------------ main */
int main(int argc, char **argv) {
    static run r = {.evaluated_at = -1, .val_loss = NAN};
    const args *a = &r.a;
    int rc = parse_args(&r, argc, argv);
    if (rc >= 0) return rc;
    TRY(&r, run_dist_init(&r.d), "joining the run");
    if (a->print_device) {
        printf("%s\n", nb_device_name(r.d.device));
        return run_dist_finish(&r.d) == NB_OK ? 0 : 1;
    }
    if (a->resume) TRY(&r, find_resume(&r), "resuming");
    if (a->resume) TRY(&r, plan_resume(&r), "resuming");
    TRY(&r, open_data(&r), "data");
    build_model(&r);
    if (a->resume) TRY(&r, load_checkpoint(&r), "resuming");
    plan_schedule(&r);
    TRY(&r, open_sample_log(&r), "--log-samples");
    r.d.zero_stage = a->zero_stage;
    TRY(&r, run_dist_wrap(&r.d, r.model, false), a->zero_stage == 3 ? "ZeRO-3" : "DDP");
    TRY(&r, run_dist_set_zero(&r.d, r.opt, a->zero_stage), "ZeRO");
    TRY(&r, open_monitor(&r), "metrics");
    print_banner(&r);

    /* the training loop: one optimizer step per iteration, over --grad-accum micro-batches */
    for (; r.step < r.stop; r.step++) {
        fault_at_step(r.d.rank, r.step + 1);
        r.lr = r.sample_schedule ? nb_lr_schedule_at(&r.sched_samples, r.samples) : nb_lr_schedule_at(&r.sched, r.step);
        nb_optim_set_lr_all(r.opt, r.lr);
        double loss = 0;
        for (int64_t micro = 0; micro < a->grad_accum; micro++) {
            nb_ctx_reset(r.step_ctx);
            nb_batch b;
            TRY(&r, next_batch(&r, &b), "data");
            if (r.sample_log) log_samples(&r, &b);
            run_dist_set_no_sync(&r.d, micro + 1 < a->grad_accum); /* all-reduce on the last only */
            nb_tensor *logits;
            TRY(&r, run_dist_forward(&r.d, r.step_ctx, b.inputs, &logits), "forward");
            nb_tensor *l = nb_gpt_loss(r.step_ctx, logits, b.targets);
            nb_tensor *lb = a->grad_accum > 1 ? nb_mul_scalar(r.step_ctx, l, 1.0 / (double)a->grad_accum) : l;
            TRY(&r, run_dist_backward(&r.d, lb), "backward");
            /* read once backward is queued: on a GPU, reading it before would
             * stall the host until the forward finished, idling the device */
            loss += nb_item(l) / (double)a->grad_accum;
        }
        double norm, max_norm = a->clip > 0 ? a->clip : INFINITY;
        /* the clip inside the optimizer's update where nothing is sharded: the norm stays
         * on the device while the step is queued, read once all of it is (the divergence
         * guard and a skipped step's counts need it every step) */
        TRY(&r, run_dist_clip_step(&r.d, r.opt, r.step_ctx, max_norm, &norm), "optimizer step");
        if (!isfinite(norm)) nb_progress_printf(r.progress, "step %lld: gradient norm %g, step skipped", (long long)r.step + 1, norm);
        TRY(&r, divergence_step(&r.guard, r.step_ctx, r.param_list, nb_optim_param_count(r.opt), r.step + 1, norm), "stopping");
        /* set to none (the next backward writes them, no zeroing pass), where
         * no ZeRO stage owns the optimizer and handles the gradients itself */
        if (a->zero_stage) nb_optim_zero_grad(r.opt);
        else nb_optim_zero_grad_to_none(r.opt);
        r.state_bytes = run_dist_state_bytes(&r.d, r.opt); /* at the end of the step, before a checkpoint gathers */
        TRY(&r, run_dist_sum(&r.d, &loss, 1), "all-reduce");
        loss /= r.d.world_size;

        r.samples += a->batch_size * a->grad_accum * r.d.world_size;
        int64_t done = r.step + 1;
        nb_progress_update(r.progress, done, loss, r.tokens_per_step);
        TRY(&r, log_train(&r, done, loss, norm), "metrics");
        if (due(&r, done, a->eval_interval)) {
            TRY(&r, evaluate(&r, &r.val_loss), "evaluation");
            r.evaluated_at = done;
            nb_progress_printf(r.progress, "step %lld: train loss %.4f, val loss %.4f", (long long)done, loss, r.val_loss);
            if (r.log) TRY(&r, nb_metrics_log_write(r.log, "eval", done, (nb_metric_value[]){{"val_loss", r.val_loss}}, 1), "metrics");
        }
        if (a->ckpt_dir && due(&r, done, a->ckpt_interval)) {
            if (a->ckpt_sharded && (r.d.ddp || r.d.fsdp)) {
                TRY(&r, save_sharded(&r, done), "checkpoint");
            } else {
                TRY(&r, run_dist_consolidate(&r.d, 0), "gathering the state");
                if (r.d.rank == 0) TRY(&r, save_checkpoint(&r, done), "checkpoint");
            }
        }
    }
    TRY(&r, run_dist_unshard(&r.d), "ZeRO"); /* the whole state back before the unwrap */
    return finish(&r);
}
