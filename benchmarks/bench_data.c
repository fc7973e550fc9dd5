/* Dataloader throughput, printed as one table, with 0 to 4 workers on
 *  - the shipped breast-cancer CSV (batch 32, 30 features), and
 *  - a token shard made in /tmp from the shipped Austen text, one token per
 *    byte (batch 8 windows of T = 256 tokens).
 * Two runs per row: "take only", where the caller does nothing but take
 * batches (copy into its context, reset), the most the loader can
 * deliver; and "with a step", where the caller computes (spins) between
 * batches for as long as the compute a training step cannot avoid, timed
 * here: forward + backward + update of a 30-64-2 MLP on one breast-cancer
 * batch, and one forward matmul of a d = 128 model's MLP on one token
 * batch, (B*T, 128) @ (128, 512), a small fraction of a real step. The
 * time spent inside nb_loader_next per batch in that run is what a step
 * would wait for data. `--quick` runs tiny budgets (a smoke check). Exits 1
 * when the loader fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nabla/nabla.h>
#include "bench_time.h"

static void die(const char *what) {
    fprintf(stderr, "bench_data: %s: %s\n", what, nb_last_error());
    exit(1);
}

typedef struct result {
    double samples_per_s, s_per_batch, wait_per_batch;
} result;

static void spin_until(double t) {
    while (now_s() < t) {
    }
}

/* Takes batches for `budget` seconds after the first one, spending
 * `work_s` of busy computation on the calling thread after each (a
 * stand-in for the training step); wait_per_batch is the time spent
 * inside nb_loader_next. */
static result run_loader(nb_dataset *ds, int64_t batch_size, int workers, double budget,
                         double work_s) {
    nb_loader *l;
    nb_loader_options o = {.batch_size = batch_size, .shuffle = true, .seed = 0,
                           .num_workers = workers};
    if (nb_loader_new(&l, ds, &o) != NB_OK) die("nb_loader_new");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    if (nb_loader_next(l, ctx, &b) != NB_OK) die("nb_loader_next");
    int64_t samples = 0, batches = 0;
    double t0 = now_s(), t = t0, waited = 0;
    while (t - t0 < budget) {
        nb_ctx_reset(ctx);
        if (nb_loader_next(l, ctx, &b) != NB_OK) die("nb_loader_next");
        double got = now_s();
        waited += got - t;
        if (b.inputs) {
            samples += b.size;
            batches++;
            if (work_s > 0) spin_until(got + work_s);
        }
        t = now_s();
    }
    nb_loader_free(l);
    nb_ctx_free(ctx);
    double per = 1.0 / (double)(batches ? batches : 1);
    result r = {(double)samples / (t - t0), (t - t0) * per, waited * per};
    return r;
}

static const char *fmt_time(double s, char *buf, size_t n) {
    if (s < 1e-3) snprintf(buf, n, "%.1f us", s * 1e6);
    else if (s < 1.0) snprintf(buf, n, "%.2f ms", s * 1e3);
    else snprintf(buf, n, "%.3f s", s);
    return buf;
}

/* Seconds per call of an MLP training step on one batch of 32. */
static double time_mlp_step(double budget) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(1);
    nb_tensor *w1 = nb_rand_normal(params, NB_F32, NB_SHAPE(30, 64), 0, 0.1, &rng);
    nb_tensor *b1 = nb_zeros(params, NB_F32, NB_SHAPE(64));
    nb_tensor *w2 = nb_rand_normal(params, NB_F32, NB_SHAPE(64, 2), 0, 0.1, &rng);
    nb_tensor *b2 = nb_zeros(params, NB_F32, NB_SHAPE(2));
    nb_tensor *ps[4] = {w1, b1, w2, b2};
    for (int i = 0; i < 4; i++) nb_set_requires_grad(ps[i], true);
    nb_tensor *x = nb_rand_normal(params, NB_F32, NB_SHAPE(32, 30), 0, 1, &rng);
    int64_t labels[32];
    for (int i = 0; i < 32; i++) labels[i] = i % 2;
    nb_tensor *y = nb_from_host(params, NB_I64, NB_SHAPE(32), labels);
    long calls = 0;
    double t0 = now_s(), t = t0;
    while (t - t0 < budget || calls < 3) {
        nb_tensor *h = nb_relu(step, nb_add(step, nb_matmul(step, x, w1), b1));
        nb_tensor *logits = nb_add(step, nb_matmul(step, h, w2), b2);
        nb_backward(nb_cross_entropy(step, logits, y, NULL));
        for (int i = 0; i < 4; i++) {
            nb_axpy_(ps[i], -0.01, ps[i]->grad);
            nb_zero_grad(ps[i]);
        }
        nb_ctx_reset(step);
        calls++;
        t = now_s();
    }
    nb_ctx_free(step);
    nb_ctx_free(params);
    return (t - t0) / (double)calls;
}

/* Seconds per (rows, 128) @ (128, 512) matmul, no grad. */
static double time_matmul(int64_t rows, double budget) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(2);
    nb_tensor *a = nb_rand_normal(ctx, NB_F32, NB_SHAPE(rows, 128), 0, 1, &rng);
    nb_tensor *w = nb_rand_normal(ctx, NB_F32, NB_SHAPE(128, 512), 0, 1, &rng);
    long calls = 0;
    double t0 = now_s(), t = t0;
    while (t - t0 < budget || calls < 3) {
        nb_matmul(step, a, w);
        nb_ctx_reset(step);
        calls++;
        t = now_s();
    }
    nb_ctx_free(step);
    nb_ctx_free(ctx);
    return (t - t0) / (double)calls;
}

/* The Austen text as a token shard (token = byte) in a fresh temporary
 * directory; returns the shard's path. */
static const char *make_token_shard(char *dir, size_t dir_size, char *path, size_t path_size) {
    snprintf(dir, dir_size, "/tmp/nabla_bench_data_XXXXXX");
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench_data: cannot make a directory in /tmp\n");
        exit(1);
    }
    const char *text = NABLA_SOURCE_DIR "/examples/datasets/austen.txt";
    FILE *f = fopen(text, "rb");
    if (!f) {
        fprintf(stderr, "bench_data: cannot open %s\n", text);
        exit(1);
    }
    size_t cap = 1 << 21, n = 0;
    unsigned char *bytes = malloc(cap);
    n = fread(bytes, 1, cap, f);
    fclose(f);
    uint16_t *tokens = malloc(sizeof *tokens * (n ? n : 1));
    for (size_t i = 0; i < n; i++) tokens[i] = bytes[i];
    snprintf(path, path_size, "%s/austen_bytes.bin", dir);
    if (nb_tokens_write(path, tokens, (int64_t)n) != NB_OK) die("nb_tokens_write");
    free(bytes);
    free(tokens);
    return path;
}

int main(int argc, char **argv) {
    bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    double budget = quick ? 0.02 : 0.6;
    char dir[64], shard[128], buf[2][32];

    nb_dataset *csv, *tok;
    if (nb_dataset_open_csv(&csv, NABLA_SOURCE_DIR "/examples/datasets/breast_cancer.csv", NULL))
        die("open breast_cancer.csv");
    make_token_shard(dir, sizeof dir, shard, sizeof shard);
    if (nb_dataset_open_tokens(&tok, shard, 256, 0, 256)) die("open the token shard");

    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    double mlp = time_mlp_step(budget), mm = time_matmul(8 * 256, budget);
    struct {
        const char *name;
        nb_dataset *ds;
        int64_t batch;
        double work;
    } rows[2] = {{"breast_cancer.csv, batch 32", csv, 32, mlp},
                 {"austen tokens, batch 8 x T=256", tok, 8, mm}};
    printf("dataloader throughput (%s; %ld cores online; shuffled)\n", quick ? "--quick" : "full run",
           cores);
    printf("  take only: the caller does nothing but take batches (the loader's ceiling)\n");
    printf("  with a step: the caller computes between batches for as long as the step below;\n"
           "  'waits' is the time spent in nb_loader_next per batch, what a step would lose\n");
    printf("compute a step cannot avoid, used as the step:\n");
    printf("  breast cancer: an MLP 30-64-2 training step on batch 32:       %s\n",
           fmt_time(mlp, buf[0], sizeof buf[0]));
    printf("  tokens: one (2048, 128) @ (128, 512) matmul (a d=128 model's\n"
           "          MLP forward on batch 8 x 256; a real step is far more): %s\n\n",
           fmt_time(mm, buf[0], sizeof buf[0]));
    printf("%-32s %7s %12s %11s %12s %11s\n", "dataset", "workers", "take only", "per batch",
           "with a step", "waits");
    printf("%-32s %7s %12s %11s %12s %11s\n", "", "", "samples/s", "", "samples/s", "per batch");
    for (int r = 0; r < 2; r++)
        for (int w = 0; w <= 4; w++) {
            result bare = run_loader(rows[r].ds, rows[r].batch, w, budget, 0);
            result step = run_loader(rows[r].ds, rows[r].batch, w, budget, rows[r].work);
            char a[32], c[32];
            snprintf(a, sizeof a, "%.3g", bare.samples_per_s);
            snprintf(c, sizeof c, "%.3g", step.samples_per_s);
            printf("%-32s %7d %12s %11s %12s %11s\n", w == 0 ? rows[r].name : "", w, a,
                   fmt_time(bare.s_per_batch, buf[0], sizeof buf[0]), c,
                   fmt_time(step.wait_per_batch, buf[1], sizeof buf[1]));
        }

    nb_dataset_free(csv);
    nb_dataset_free(tok);
    unlink(shard);
    rmdir(dir);
    return 0;
}
