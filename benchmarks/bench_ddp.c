/* bench_ddp: training-step speed and DDP's cost and scaling, on CPU
 * processes (Gloo) or one GPU per rank (NCCL; --device, default auto: GPUs
 * when there are any; GPU steps are timed to completion).
 * Each rank trains one model on its own batch (weak scaling) for `--steps`
 * steps with AdamW; rank 0 prints a line naming the run, the table's header
 * (--no-header leaves both out) and one row: world size, mode,
 * milliseconds per step, samples (or tokens) per second over all
 * ranks, time in backward, time waiting for buckets after backward (each
 * the median over the timed steps), and
 * the share of all-reduce time hidden behind backward as the rank sees it,
 * and the same across ranks (nb_ddp_overlap_across_ranks: the time a
 * bucket waits for a rank that launches it later, "peer-wait" in ms per
 * rank and step, is not counted as communication, and "hid-all" is the
 * share hidden behind the last rank's backward).
 *
 *   --model wide  an MLP of --layers Linear layers of --width (default; batch 64)
 *   --model mlp   the bundled MLP classifier as train_classifier builds it:
 *                 30 -> 64 -> 32 -> 2, batch 8
 *   --model cnn   the bundled CNN on 8x8 digits: channels 16,32,64, 10
 *                 classes, batch 32
 *   --model gpt   train_gpt's character-level GPT: vocabulary 79, 4 layers,
 *                 4 heads, width 128, batch 16 x 64 tokens
 *   --model gpt6  a larger GPT: vocabulary 79, 6 layers, 4 heads, width 256,
 *                 batch 8 x 128 tokens
 *   --width W and --layers L give either GPT another width (a multiple of
 *   its 4 heads) and depth: about 12 L W^2 parameters, for a model whose
 *   gradients outweigh its compute on a slow link, where PowerSGD is meant
 *   to help
 *
 *   nbrun --nproc-per-node 1 build/bin/bench_ddp --no-ddp   (the baseline)
 *   nbrun --nproc-per-node 2 build/bin/bench_ddp --model gpt
 *   build/bin/bench_ddp --no-ddp --model cnn --machine      (no launcher needed)
 *
 * --bucket-step attaches the optimizer to the wrapper (nb_ddp_set_optimizer):
 * each bucket's parameters are updated as soon as its all-reduce is done,
 * inside nb_ddp_backward, instead of one nb_optim_step after it; the mode
 * column then reads "ddp-bs" and ms/step compares with the "ddp" row.
 *
 * --bf16 computes the products in bf16 (the step context's compute dtype,
 * as train_gpt --bf16).
 * --bucket-mb MB sets both the first bucket's size and the cap of the
 * others (nb_ddp_options; default 1 MiB, then a sixteenth of the
 * gradients' bytes within 256 KiB-25 MiB: Note [Default bucket cap] in
 * distributed/ddp_buckets.c). Under PyTorch's 25 MiB cap a model of a few
 * MiB has its second and last bucket launched only when backward reaches
 * the first layers, so little of it can be hidden.
 * --first-bucket-mb MB then sets the first bucket's size alone. The
 * --machine line names the buckets rank 0 ended with: bucket_kb= their
 * sizes (KiB, in launch order), bucket_launch_ms= and bucket_ms= the
 * median over the timed steps of each one's launch (against the end of
 * backward: negative is before it) and running time (start to finish).
 * --zero shards the optimizer's state over the ranks (ZeRO-1,
 * nb_ddp_set_zero): gradients are reduce-scattered, each rank steps its
 * shard and the parameters are all-gathered (nb_ddp_step); mode "zero".
 * --zero2 shards the gradients too (ZeRO-2, nb_ddp_set_zero_stage): each
 * bucket's gradient memory is given back once its reduce-scatter is done;
 * mode "zero2". The column "state" is the optimizer state (AdamW's two
 * moments) held per rank (nb_optim_state_bytes): about 1/R of the "ddp"
 * row's under ZeRO; "held" adds the parameters and the gradient memory
 * (nb_ddp_state_bytes) at the end of the last step.
 *
 * --zero3 wraps the model in nb_fsdp instead (ZeRO-3: parameters sharded
 * too, each unit all-gathered before its forward and again in backward,
 * its gradients reduce-scattered; nabla/fsdp.h); mode "zero3". Its
 * "backward" column is nb_fsdp_backward's whole time, "wait" the time the
 * host waited for gathers and reduce-scatters in the step (forward
 * included), and "hidden" 1 - wait / their running time
 * (nb_fsdp_take_stats): the share of its communication that compute hid.
 * --zero3-kept keeps each unit gathered from its forward to its backward
 * (keep_gathered: no second gather, no second forward); mode "zero3k".
 *
 * --powersgd RANK makes PowerSGD the communication hook
 * (nb_ddp_set_powersgd: rank RANK, compressed from the third step, that
 * is within the warm-up; the other options PyTorch's defaults); mode
 * "psgd".
 *
 * --text FILE (GPT models) trains on the bytes of FILE (at most 79
 * distinct bytes, numbered in byte order; examples/datasets/austen.txt has
 * exactly 79) instead of the made-up tokens: each rank's sequences start at
 * offsets drawn from its own seed and the step. The --machine line then
 * has loss=, rank 0's mean training loss over the last 10 steps (or all,
 * if fewer), for comparing the loss a setting reaches after N steps
 * (PowerSGD against plain DDP).
 *
 * --trace FILE writes this rank's step trace (Note [Step trace] in
 * distributed/scale.c): the median forward, backward and optimizer times
 * and each parameter's median gradient-ready time in backward, for
 * tools/nb_scale. Under DDP at world > 1 rank 0 writes it with backward
 * alone (nb_ddp_last_stats' backward_s) as the backward time: the compute
 * of that run, for checking the model's communication against it. --project LINK prints the scaling model's projection of
 * that trace to 1 .. 1024 ranks, one per machine, joined by LINK (a
 * preset, measured:FILE or ALPHA_US,GB/S; as nb_scale TRACE --per-node 1
 * --inter LINK), under the measured table.
 *
 * docs/benchmarks.md explains every column.
 * --machine prints one key=value line (with forward / backward / optimizer
 * medians) for scripts instead of the table; --plot-scaling LINES SVG reads
 * such lines (benchmarks/run_scaling.sh collects them), prints the scaling
 * table with the efficiency against world size 1 and writes the plot.
 * benchmarks/run_ddp.sh and run_scaling.sh run the series. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nabla/ddp.h"
#include "nabla/fsdp.h"
#include "nabla/models.h"
#include "nabla/monitor.h"
#include "nabla/nabla.h"
#include "bench_time.h"
#include "distributed/ddp_buckets.h"
#include "distributed/scale.h"

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

enum { WIDE, MLP, CNN, GPT, GPT6 };
static const char *model_names[] = {"wide", "mlp", "cnn", "gpt", "gpt6"};
#define GPT_VOCAB 79 /* distinct bytes of examples/datasets/austen.txt */
#define IS_GPT(kind) ((kind) == GPT || (kind) == GPT6)
#define GPT_T(kind) ((kind) == GPT6 ? 128 : 64)

static nb_module *build(nb_ctx *ctx, int kind, int width, int layers, nb_rng *rng) {
    switch (kind) {
    case MLP: return nb_mlp_new(ctx, NB_F32, 30, 2, (int64_t[]){64, 32}, 2, rng);
    case CNN: return nb_cnn_new(ctx, NB_F32, 1, 3, (int64_t[]){16, 32, 64}, 10, rng);
    case GPT:
    case GPT6: { /* width and layers: the model's own unless --width / --layers were given */
        nb_gpt_config cfg = {GPT_VOCAB, GPT_T(kind), layers, 4, width, 0.0};
        return nb_gpt_new(ctx, NB_F32, &cfg, rng);
    }
    default: {
        nb_module **c = calloc((size_t)(2 * layers), sizeof *c);
        for (int l = 0; l < layers; l++) {
            c[2 * l] = nb_linear_new(ctx, NB_F32, width, l == layers - 1 ? 10 : width, true, rng);
            c[2 * l + 1] = nb_relu_new(ctx);
        }
        nb_module *m = nb_sequential_new(ctx, 2 * layers - 1, c);
        free(c);
        return m;
    }
    }
}

/* --text: the file's bytes as token ids, the ids in byte order. */
typedef struct text {
    int64_t *tok, n;
} text;

static int text_load(const char *path, text *t) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "bench_ddp: --text: cannot open %s\n", path);
        return 1;
    }
    unsigned char *raw = NULL;
    size_t cap = 0, n = 0, got;
    do {
        if (n == cap && !(raw = realloc(raw, cap = cap ? 2 * cap : 1 << 20))) break;
        got = fread(raw + n, 1, cap - n, f);
        n += got;
    } while (got > 0);
    fclose(f);
    int id[256], v = 0;
    for (int c = 0; c < 256; c++) id[c] = -1;
    for (size_t i = 0; raw && i < n; i++) id[raw[i]] = 0;
    for (int c = 0; c < 256; c++)
        if (id[c] == 0) id[c] = v++;
    if (!raw || n < (size_t)GPT_T(GPT6) + 2 || v > GPT_VOCAB) {
        fprintf(stderr, "bench_ddp: --text %s: %zu bytes, %d distinct; the GPT needs at least %d bytes and at most "
                        "%d distinct ones\n", path, n, v, GPT_T(GPT6) + 2, GPT_VOCAB);
        free(raw);
        return 1;
    }
    t->tok = malloc(sizeof(int64_t) * n);
    if (!t->tok) {
        free(raw);
        fprintf(stderr, "bench_ddp: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++) t->tok[i] = id[raw[i]];
    t->n = (int64_t)n;
    free(raw);
    return 0;
}

static uint64_t mix64(uint64_t z) { /* splitmix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* One batch of random inputs and labels in `step` (from `txt` when it has tokens). */
static void make_batch(nb_ctx *step, int kind, int64_t batch, int width, int s, nb_rng *data, const text *txt,
                       nb_tensor **x, nb_tensor **y) {
    int64_t n_lab = IS_GPT(kind) ? batch * GPT_T(kind) : batch, n_cls = kind == MLP ? 2 : 10;
    /* host arrays (the step context may be on a GPU) */
    int64_t *lab = malloc(sizeof(int64_t) * (size_t)n_lab * 2), *tok = lab + n_lab;
    if (!lab) {
        fprintf(stderr, "bench_ddp: out of memory\n");
        exit(1);
    }
    if (IS_GPT(kind)) {
        int64_t T = GPT_T(kind);
        for (int64_t i = 0; i < n_lab; i++) {
            if (txt->tok) { /* sequence i / T starts at an offset drawn from the rank's seed and the step */
                int64_t at = (int64_t)(mix64(data->seed * 0x9e3779b97f4a7c15ull + (uint64_t)s * 1000003u +
                                             (uint64_t)(i / T)) % (uint64_t)(txt->n - T - 1));
                tok[i] = txt->tok[at + i % T], lab[i] = txt->tok[at + i % T + 1];
                continue;
            }
            tok[i] = (i * 37 + s * 11 + (int64_t)data->seed) % GPT_VOCAB;
            lab[i] = (i * 53 + s * 7) % GPT_VOCAB;
        }
        *x = nb_from_host(step, NB_I64, NB_SHAPE(batch, GPT_T(kind)), tok);
        *y = nb_from_host(step, NB_I64, NB_SHAPE(batch, GPT_T(kind)), lab);
        free(lab);
        return;
    }
    for (int64_t i = 0; i < n_lab; i++) lab[i] = (i + s) % n_cls;
    *y = nb_from_host(step, NB_I64, NB_SHAPE(batch), lab);
    free(lab);
    if (kind == MLP) *x = nb_rand_normal(step, NB_F32, NB_SHAPE(batch, 30), 0, 1, data);
    else if (kind == CNN) *x = nb_rand_normal(step, NB_F32, NB_SHAPE(batch, 1, 8, 8), 0, 1, data);
    else *x = nb_rand_normal(step, NB_F32, NB_SHAPE(batch, width), 0, 1, data);
}

/* Gradient-ready times of every parameter, per timed step (--trace). */
typedef struct ready_rec {
    double t0;      /* when this step's backward began */
    double *t;      /* steps x n */
    int n, step;    /* step < 0: not recording */
} ready_rec;
typedef struct ready_ref {
    ready_rec *r;
    int i;
} ready_ref;

static void on_ready(nb_tensor *leaf, void *user) {
    (void)leaf;
    ready_ref *ref = user;
    if (ref->r->step >= 0) ref->r->t[(size_t)ref->r->step * ref->r->n + ref->i] = now_s() - ref->r->t0;
}

/* The step trace of the timed steps: medians of the phases and of each
 * parameter's ready time. */
static void make_trace(nb__scale_trace *t, const ready_rec *rec, const nb_named_tensor *p, int steps, double fwd,
                       double bwd, double opt, const char *source) {
    double *med = calloc((size_t)(rec->n ? rec->n : 1), sizeof *med), *v = calloc((size_t)steps, sizeof *v);
    if (!med || !v) {
        fprintf(stderr, "bench_ddp: out of memory for the trace\n");
        exit(1);
    }
    for (int i = 0; i < rec->n; i++) {
        for (int s = 0; s < steps; s++) v[s] = rec->t[(size_t)s * rec->n + i];
        med[i] = median(v, steps);
    }
    nb__scale_trace_make(t, rec->n, p, med, fwd, bwd, opt, source);
    free(med);
    free(v);
}

#define MAX_ROWS 64
typedef struct row {
    char model[16];
    int world;
    double per_s, hidden, ms, wait_ms;
} row;

/* Reads the --machine lines in `path`, prints the scaling table and writes
 * throughput and efficiency against world size on one plot per measure. */
static int plot_scaling(const char *path, const char *svg) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "bench_ddp: cannot open %s\n", path);
        return 1;
    }
    row rows[MAX_ROWS], proj[MAX_ROWS];
    int n = 0, np = 0;
    char line[512], link[32] = "";
    while (n < MAX_ROWS && fgets(line, sizeof line, f)) {
        char *p = strstr(line, "model=");
        char *pe = strstr(line, " efficiency="), *pw = strstr(line, " world="), *pl = strstr(line, " link=");
        if (p && strstr(line, "mode=projected") && pe && pw && np < MAX_ROWS) { /* run_scaling.sh's nb_scale rows */
            row *r = &proj[np];
            if (sscanf(p, "model=%15s", r->model) == 1 && sscanf(pw, " world=%d", &r->world) == 1 &&
                sscanf(pe, " efficiency=%lf", &r->per_s) == 1) /* per_s holds the efficiency */
                np++;
            if (pl && sscanf(pl, " link=%31s", link) != 1) link[0] = 0;
            continue;
        }
        if (!p || !strstr(line, "mode=ddp")) continue;
        row *r = &rows[n];
        char hid[32] = "";
        char *w = strstr(p, "world="), *q = strstr(p, "per_s="), *h = strstr(p, "hidden=");
        if (sscanf(p, "model=%15s", r->model) != 1 || !w || sscanf(w, "world=%d", &r->world) != 1 || !q ||
            sscanf(q, "per_s=%lf", &r->per_s) != 1)
            continue;
        r->hidden = h && sscanf(h, "hidden=%31s", hid) == 1 ? atof(hid) : NAN;
        char *ms = strstr(p, " ms="), *wt = strstr(p, " wait_ms=");
        r->ms = ms && sscanf(ms, " ms=%31s", hid) == 1 ? atof(hid) : NAN;
        r->wait_ms = wt && sscanf(wt, " wait_ms=%31s", hid) == 1 ? atof(hid) : NAN;
        n++;
    }
    fclose(f);
    printf("%-6s %6s %14s %11s %8s %9s %9s\n", "model", "world", "throughput/s", "efficiency", "hidden", "ms/step",
           "wait ms");
    nb_plot_series ser[8];
    double xs[8][MAX_ROWS], ys[8][MAX_ROWS];
    char names[8][16];
    int ns = 0;
    for (int i = 0; i < n; i++) {
        double base = NAN;
        for (int j = 0; j < n; j++)
            if (!strcmp(rows[j].model, rows[i].model) && rows[j].world == 1) base = rows[j].per_s;
        double eff = rows[i].per_s / (base * rows[i].world); /* 100%: N ranks do N times the work */
        char hid[16] = "-";
        if (rows[i].world > 1 && !isnan(rows[i].hidden)) snprintf(hid, sizeof hid, "%.0f%%", 100 * rows[i].hidden);
        char wts[16] = "-";
        if (rows[i].world > 1 && !isnan(rows[i].wait_ms)) snprintf(wts, sizeof wts, "%.2f", rows[i].wait_ms);
        printf("%-6s %6d %14.0f %10.0f%% %8s %9.2f %9s\n", rows[i].model, rows[i].world, rows[i].per_s, 100 * eff,
               hid, rows[i].ms, wts);
        int s = 0;
        while (s < ns && strcmp(names[s], rows[i].model)) s++;
        if (s == ns) {
            if (ns == 8) continue;
            snprintf(names[ns], sizeof names[ns], "%.15s", rows[i].model);
            ser[ns] = (nb_plot_series){names[ns], xs[ns], ys[ns], 0};
            ns++;
        }
        xs[s][ser[s].n] = rows[i].world;
        ys[s][ser[s].n++] = 100 * eff;
    }
    for (int i = 0; i < np; i++) { /* the projected curves: "M projected", beside the measured */
        char nm[16];
        snprintf(nm, sizeof nm, "%.5s projected", proj[i].model);
        int s = 0;
        while (s < ns && strcmp(names[s], nm)) s++;
        if (s == ns) {
            if (ns == 8) continue;
            snprintf(names[ns], sizeof names[ns], "%s", nm);
            ser[ns] = (nb_plot_series){names[ns], xs[ns], ys[ns], 0};
            ns++;
        }
        xs[s][ser[s].n] = proj[i].world;
        ys[s][ser[s].n++] = 100 * proj[i].per_s;
    }
    char title[128] = "Weak scaling (each rank its own batch)";
    if (np) snprintf(title, sizeof title, "Weak scaling: measured, and projected (nb_scale) on link %s", link);
    nb_plot_opts o = {title, "world size", "efficiency vs world size 1 (%)", 0, 0, false, .markers = true,
                      .integer_x = true};
    if (nb_plot_svg(svg, ser, ns, &o) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    printf("plot: %s\n", svg);
    return 0;
}

int main(int argc, char **argv) {
    int steps = 30, width = 0, layers = 0, header = 1, machine = 0, kind = WIDE; /* 0: the model's default */
    int64_t batch = 0;
    bool use_ddp = true, bucket_step = false, bf16 = false, zero = false, zero3 = false, kept = false;
    int zero_stage = 1;
    double bucket_mb = 0; /* 0: the wrapper's defaults (Note [Default bucket cap]) */
    double first_mb = -1;  /* < 0: as bucket_mb */
    const char *device_arg = "auto", *trace_path = NULL, *project = NULL, *text_path = NULL;
    int powersgd = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--info")) return fputs(nb_config_string(), stdout) < 0;
        else if (!strcmp(argv[i], "--no-ddp")) use_ddp = false;
        else if (!strcmp(argv[i], "--bucket-step")) bucket_step = true;
        else if (!strcmp(argv[i], "--bf16")) bf16 = true;
        else if (!strcmp(argv[i], "--zero")) zero = true;
        else if (!strcmp(argv[i], "--zero2")) zero = true, zero_stage = 2;
        else if (!strcmp(argv[i], "--zero3")) zero3 = true;
        else if (!strcmp(argv[i], "--zero3-kept")) zero3 = kept = true;
        else if (!strcmp(argv[i], "--no-header")) header = 0;
        else if (!strcmp(argv[i], "--machine")) machine = 1;
        else if (!strcmp(argv[i], "--plot-scaling") && i + 2 < argc) return plot_scaling(argv[i + 1], argv[i + 2]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bucket-mb") && i + 1 < argc) bucket_mb = atof(argv[++i]);
        else if (!strcmp(argv[i], "--first-bucket-mb") && i + 1 < argc) first_mb = atof(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--width") && i + 1 < argc) width = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device_arg = argv[++i];
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace_path = argv[++i];
        else if (!strcmp(argv[i], "--project") && i + 1 < argc) project = argv[++i];
        else if (!strcmp(argv[i], "--text") && i + 1 < argc) text_path = argv[++i];
        else if (!strcmp(argv[i], "--powersgd") && i + 1 < argc) powersgd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) {
            const char *m = argv[++i];
            for (kind = 0; kind < 5 && strcmp(m, model_names[kind]); kind++) {}
            if (kind == 5) {
                fprintf(stderr, "bench_ddp: --model must be wide, mlp, cnn, gpt or gpt6, not \"%s\"\n", m);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: %s [--model wide|mlp|cnn|gpt|gpt6] [--device auto|cpu|cuda] [--no-ddp] "
                            "[--bucket-step | --zero | --zero2 | --zero3 | --zero3-kept] [--bf16] [--bucket-mb MB] [--first-bucket-mb MB] [--steps N] [--batch B] [--width W] [--layers L] [--no-header | --machine] [--powersgd RANK] [--text FILE] [--trace FILE] [--project LINK] [--info]\n"
                            "       %s --plot-scaling LINES SVG\n", argv[0], argv[0]);
            return 2;
        }
    }
    if (steps < 1) steps = 1;
    if (bucket_step && !use_ddp) {
        fprintf(stderr, "bench_ddp: --bucket-step steps inside nb_ddp_backward; it needs DDP (drop --no-ddp)\n");
        return 2;
    }
    if (zero && (!use_ddp || bucket_step)) {
        fprintf(stderr, "bench_ddp: --zero shards the optimizer over DDP's ranks; it needs DDP and "
                        "cannot be combined with --bucket-step\n");
        return 2;
    }
    if (zero3 && (!use_ddp || bucket_step || zero || powersgd || trace_path || project)) {
        fprintf(stderr, "bench_ddp: --zero3 replaces DDP by nb_fsdp: it cannot be combined with --no-ddp, "
                        "--bucket-step, --zero, --zero2, --powersgd, --trace or --project\n");
        return 2;
    }
    if (powersgd < 0 || (powersgd && (!use_ddp || zero))) {
        fprintf(stderr, "bench_ddp: --powersgd RANK compresses DDP's buckets: it needs DDP, a rank >= 1, "
                        "and not --zero\n");
        return 2;
    }
    text txt = {NULL, 0};
    if (text_path && !IS_GPT(kind)) {
        fprintf(stderr, "bench_ddp: --text trains the GPT models (--model gpt or gpt6) on a file\n");
        return 2;
    }
    if (text_path && text_load(text_path, &txt)) return 1;
    if ((width || layers) && kind != WIDE && !IS_GPT(kind)) {
        fprintf(stderr, "bench_ddp: --width and --layers shape the wide MLP and the GPT models only\n");
        return 2;
    }
    if (!width) width = kind == GPT ? 128 : kind == GPT6 ? 256 : 512;
    if (!layers) layers = kind == GPT6 ? 6 : 4;
    if (width < 1 || layers < 1 || (IS_GPT(kind) && width % 4)) {
        fprintf(stderr, "bench_ddp: --width %d --layers %d: both >= 1, and the GPT's width a multiple of its 4 "
                        "heads\n", width, layers);
        return 2;
    }
    if (!batch) batch = kind == MLP ? 8 : kind == CNN ? 32 : kind == GPT ? 16 : kind == GPT6 ? 8 : 64;
    /* auto: one GPU per rank (cuda:LOCAL_RANK, NCCL) when there are GPUs, else the CPU (Gloo) */
    bool cuda = !strcmp(device_arg, "cuda") || (!strcmp(device_arg, "auto") && nb_cuda_available());
    if (strcmp(device_arg, "cuda") && strcmp(device_arg, "cpu") && strcmp(device_arg, "auto")) {
        fprintf(stderr, "bench_ddp: --device must be auto, cpu or cuda, not \"%s\"\n", device_arg);
        return 2;
    }
    if (cuda && !nb_cuda_available()) {
        fprintf(stderr, "bench_ddp: --device cuda, but no GPU is visible (or nabla was built without CUDA)\n");
        return 2;
    }
    /* Without DDP no process group is needed, so the baseline runs with or without nbrun. */
    nb_pg *pg = NULL;
    nb_pg_options po = {cuda ? NB_PG_NCCL : NB_PG_GLOO, 0};
    if (use_ddp && nb_pg_init(&pg, &po) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    nb_device dev = nb_cpu();
    if (cuda) {
        nb_dist_env env;
        dev = pg ? nb_pg_device(pg) : nb_cuda(nb_dist_env_read(&env) == NB_OK ? env.local_rank : 0);
    }
    int rank = pg ? nb_pg_rank(pg) : 0, world = pg ? nb_pg_size(pg) : 1;
    nb_ctx *pctx = nb_ctx_new(dev, 0), *step = nb_ctx_new(dev, 0);
    if (bf16) nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_rng rng = nb_rng_make(1);
    nb_module *model = build(pctx, kind, width, layers, &rng);
    nb_ddp *ddp = NULL;
    nb_ddp_options dopts = NB_DDP_DEFAULTS;
    dopts.first_bucket_bytes = dopts.bucket_cap_bytes = (size_t)(bucket_mb * 1048576.0);
    if (first_mb >= 0) dopts.first_bucket_bytes = (size_t)(first_mb * 1048576.0);
    dopts.record_timeline = true; /* for nb_ddp_overlap_across_ranks */
    if (use_ddp && !zero3 && nb_ddp_new(&ddp, model, pg, &dopts) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    int np = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *p = calloc((size_t)np, sizeof *p);
    nb_module_named_parameters(model, p, np);
    int64_t n_params = 0;
    for (int i = 0; i < np; i++) n_params += nb_numel(p[i].tensor);
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, np, &NB_ADAMW_DEFAULTS);
    nb_fsdp *fsdp = NULL; /* --zero3: made after the optimizer, whose state is shaped like the parameters */
    nb_fsdp_options fo = NB_FSDP_DEFAULTS;
    fo.keep_gathered = kept;
    if (zero3 && (nb_fsdp_new(&fsdp, model, pg, &fo) != NB_OK || nb_fsdp_set_optimizer(fsdp, opt) != NB_OK)) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    if (bucket_step && nb_ddp_set_optimizer(ddp, opt) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    if (zero && nb_ddp_set_zero_stage(ddp, opt, zero_stage) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    ready_rec rec = {0, NULL, np, -1};
    ready_ref *refs = calloc((size_t)np, sizeof *refs);
    if (trace_path || project) {
        rec.t = calloc((size_t)steps * (size_t)np, sizeof(double));
        for (int i = 0; i < np; i++) {
            refs[i] = (ready_ref){&rec, i};
            nb_add_grad_hook(p[i].tensor, on_ready, &refs[i]);
        }
    }
    if (powersgd) {
        nb_ddp_powersgd_options pso = NB_DDP_POWERSGD_DEFAULTS;
        pso.rank = powersgd, pso.start_iter = 2;
        if (nb_ddp_set_powersgd(ddp, &pso) != NB_OK) {
            fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
            return 1;
        }
    }
    const char *mode = fsdp                ? (kept ? "zero3k" : "zero3")
                       : !ddp              ? "no-ddp"
                       : bucket_step       ? "ddp-bs"
                       : zero              ? (zero_stage == 2 ? "zero2" : "zero")
                       : powersgd          ? "psgd"
                                           : "ddp";
    nb_rng data = nb_rng_make(100 + (uint64_t)rank);
    /* per timed step; the table and --machine give medians of all of them, so that the
     * wait stands beside a step time of the same kind */
    double *t_step = calloc((size_t)steps * 7, sizeof(double)), *t_fwd = t_step + steps,
           *t_bwd = t_fwd + steps, *t_opt = t_bwd + steps, *s_bw = t_opt + steps, *s_wait = s_bw + steps,
           *s_hidden = s_wait + steps;
    double loss_sum = 0; /* rank 0's loss over the last 10 steps (--text) */
    int loss_n = 0;
    int measured = 0;
    nb_ddp_overlap ov = {0};
    enum { MAX_B = 32 }; /* per-bucket figures of the --machine line, for the first MAX_B buckets */
    double *b_launch = calloc((size_t)steps * MAX_B * 2, sizeof(double)), *b_run = b_launch + steps * MAX_B;
    size_t b_bytes[MAX_B] = {0};
    int n_b = 0;
    for (int s = 0; s < steps + 3; s++) { /* 3 warm-up steps */
        if (s == 3 && ddp && nb_ddp_overlap_across_ranks(ddp, &ov) != NB_OK) { /* leaves the warm-up out */
            fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
            return 1;
        }
        nb_ctx_reset(step);
        nb_tensor *x, *y;
        make_batch(step, kind, batch, width, s, &data, &txt, &x, &y);
        double t0 = now_s();
        nb_tensor *out;
        nb_status fst = fsdp ? nb_fsdp_forward(fsdp, step, x, &out) : NB_OK;
        if (!ddp && !fsdp) out = nb_module_forward(model, step, x);
        else if (fst != NB_OK || (ddp && nb_ddp_forward(ddp, step, x, &out) != NB_OK)) {
            fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
            return 1;
        }
        nb_tensor *loss = IS_GPT(kind) ? nb_gpt_loss(step, out, y) : nb_cross_entropy(step, out, y, NULL);
        if (txt.tok && s >= steps + 3 - 10) loss_sum += nb_item(loss), loss_n++; /* on a GPU this waits for forward, as the synchronize below */
        if (cuda) nb_cuda_synchronize(dev); /* GPU work is queued: time it done */
        double tf = now_s();
        rec.t0 = tf, rec.step = s >= 3 && rec.t ? s - 3 : -1;
        if (ddp || fsdp) {
            if ((ddp ? nb_ddp_backward(ddp, loss) : nb_fsdp_backward(fsdp, loss)) != NB_OK) {
                fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
                return 1;
            }
        } else {
            nb_backward(loss);
        }
        if (cuda) nb_cuda_synchronize(dev);
        double tb = now_s();
        if (zero || fsdp) {
            if ((fsdp ? nb_fsdp_step(fsdp) : nb_ddp_step(ddp)) != NB_OK) {
                fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
                return 1;
            }
        } else if (!bucket_step) {
            nb_optim_step(opt); /* else nb_ddp_backward did it */
        }
        nb_optim_zero_grad(opt);
        if (cuda) nb_cuda_synchronize(dev);
        double t1 = now_s();
        if (s >= 3) {
            t_fwd[measured] = tf - t0, t_bwd[measured] = tb - tf, t_opt[measured] = t1 - tb;
            t_step[measured++] = t1 - t0;
            if (ddp && world > 1) {
                nb_ddp_step_stats st = nb_ddp_last_stats(ddp);
                s_bw[measured - 1] = st.backward_s;
                s_wait[measured - 1] = st.wait_s;
                s_hidden[measured - 1] = st.hidden_fraction;
                n_b = st.n_buckets < MAX_B ? st.n_buckets : MAX_B;
                for (int b = 0; b < n_b; b++) {
                    b_launch[b * steps + measured - 1] = st.buckets[b].launch;
                    b_run[b * steps + measured - 1] = st.buckets[b].finish - st.buckets[b].start;
                    b_bytes[b] = st.buckets[b].bytes;
                }
            }
            if (fsdp && world > 1) { /* the step's gathers and reduce-scatters: exposed, and the share hidden */
                nb_fsdp_stats st = nb_fsdp_take_stats(fsdp);
                s_bw[measured - 1] = tb - tf;
                s_wait[measured - 1] = st.exposed_s;
                s_hidden[measured - 1] = st.hidden_fraction;
            }
        }
        if (fsdp) nb_fsdp_take_stats(fsdp); /* the warm-up's are dropped */
    }
    if (ddp && nb_ddp_overlap_across_ranks(ddp, &ov) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    bool across = ddp && world > 1 && ov.steps > 0;
    size_t state_bytes = nb_optim_state_bytes(opt),
           held = ddp ? nb_ddp_state_bytes(ddp, opt) : fsdp ? nb_fsdp_state_bytes(fsdp, opt) : 0;
    bool comm = (ddp || fsdp) && world > 1; /* the wait and hidden columns */
    double hidden = median(s_hidden, measured), bw = median(s_bw, measured), wait = median(s_wait, measured);
    double med = median(t_step, measured), per_s = (double)batch * (IS_GPT(kind) ? GPT_T(kind) : 1) * world / med;
    if (rank == 0 && machine) {
        printf("model=%s mode=%s world=%d batch=%lld ms=%.4f fwd=%.4f bwd=%.4f opt=%.4f per_s=%.1f unit=%s "
               "hidden=%.4f hidden_all=%.4f peer_wait_ms=%.4f skew_ms=%.4f ddp_backward_ms=%.4f wait_ms=%.4f "
               "params=%lld state_bytes=%zu held_bytes=%zu",
               model_names[kind], mode, world, (long long)batch, 1e3 * med,
               1e3 * median(t_fwd, measured), 1e3 * median(t_bwd, measured), 1e3 * median(t_opt, measured),
               per_s, IS_GPT(kind) ? "tokens" : "samples", comm ? hidden : NAN,
               across ? ov.hidden_fraction : NAN, across ? 1e3 * ov.peer_wait_s : NAN,
               across ? 1e3 * ov.skew_s : NAN, comm ? 1e3 * bw : NAN,
               comm ? 1e3 * wait : NAN, (long long)n_params, state_bytes, held);
        if (loss_n) printf(" loss=%.5f", loss_sum / loss_n);
        if (ddp && world > 1 && n_b > 0 && measured > 0) {
            printf(" bucket_kb=");
            for (int b = 0; b < n_b; b++) printf("%s%.0f", b ? "/" : "", b_bytes[b] / 1024.0);
            printf(" bucket_launch_ms=");
            for (int b = 0; b < n_b; b++) printf("%s%.2f", b ? "/" : "", 1e3 * median(b_launch + b * steps, measured));
            printf(" bucket_ms=");
            for (int b = 0; b < n_b; b++) printf("%s%.2f", b ? "/" : "", 1e3 * median(b_run + b * steps, measured));
        }
        printf("\n");
    } else if (rank == 0) {
        if (header) {
            char toks[32] = "";
            if (IS_GPT(kind)) snprintf(toks, sizeof toks, " x %d tokens", GPT_T(kind));
            printf("bench_ddp: model %s (%lld parameters), batch %lld%s per rank, %s%s%s, AdamW, median of %d "
                   "steps after 3 warm-up steps\n",
                   model_names[kind], (long long)n_params, (long long)batch, toks,
                   cuda ? "one GPU per rank" : "CPU processes", ddp || fsdp ? (cuda ? " over NCCL" : " over Gloo") : "",
                   bf16 ? ", bf16 products" : "", steps);
            printf("%-6s %-7s %10s %12s %11s %9s %8s %10s %8s %10s %10s\n", "world", "mode", "ms/step",
                   IS_GPT(kind) ? "tokens/s" : "samples/s", "backward", "wait", "hidden", "peer-wait", "hid-all",
                   "state", "held");
        }
        char hid[16] = "-", bws[16] = "-", ws[16] = "-", pw[16] = "-", hall[16] = "-";
        if (across) {
            snprintf(pw, sizeof pw, "%.2f ms", 1e3 * ov.peer_wait_s);
            snprintf(hall, sizeof hall, "%.0f%%", 100 * ov.hidden_fraction);
        }
        if (comm) {
            snprintf(hid, sizeof hid, "%.0f%%", 100 * hidden);
            snprintf(bws, sizeof bws, "%.2f ms", 1e3 * bw);
            snprintf(ws, sizeof ws, "%.2f ms", 1e3 * wait);
        }
        char sts[24], hs[24] = "-";
        snprintf(sts, sizeof sts, "%.2f MiB", (double)state_bytes / (1 << 20));
        if (ddp || fsdp) snprintf(hs, sizeof hs, "%.2f MiB", (double)held / (1 << 20));
        printf("%-6d %-7s %10.2f %12.0f %11s %9s %8s %10s %8s %10s %10s\n", world, mode, 1e3 * med, per_s, bws,
               ws, hid, pw, hall, sts, hs);
        if (loss_n) printf("loss %.5f (rank 0's training loss, mean of the last %d steps)\n", loss_sum / loss_n, loss_n);
    }
    if (rank == 0 && (trace_path || project)) {
        char src[256];
        snprintf(src, sizeof src, "bench_ddp --model %s, batch %lld, %s%s, mode %s, world %d, median of %d steps",
                 model_names[kind], (long long)batch, cuda ? "cuda" : "cpu", bf16 ? ", bf16 products" : "", mode,
                 world, measured);
        nb__scale_trace tr;
        /* under DDP at world > 1, backward alone (the statistics' backward_s), not nb_ddp_backward's wait */
        make_trace(&tr, &rec, p, measured, median(t_fwd, measured), ddp && world > 1 ? bw : median(t_bwd, measured),
                   median(t_opt, measured), src);
        if (trace_path && nb__scale_trace_write(trace_path, &tr) != NB_OK) {
            fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
            return 1;
        }
        if (project) {
            nb__scale_config c = {.nodes = 1, .per_node = 1, .mode = zero ? NB__SCALE_ZERO1 : NB__SCALE_DDP,
                                  .algo = NB__SCALE_BEST, .first_bucket = dopts.first_bucket_bytes,
                                  .bucket_cap = dopts.bucket_cap_bytes, .powersgd_rank = powersgd,
                                  .powersgd_min_rate = NB_DDP_POWERSGD_DEFAULTS.min_compression_rate};
            size_t grad_bytes = 0; /* DDP's defaults (Note [Default bucket cap] in distributed/ddp_buckets.c) */
            for (int i = 0; i < tr.n; i++) grad_bytes += (size_t)tr.p[i].numel * nb_dtype_size(tr.p[i].dtype);
            if (!c.first_bucket) c.first_bucket = nb__ddp_default_first();
            if (!c.bucket_cap) c.bucket_cap = nb__ddp_default_cap(grad_bytes);
            if (nb__scale_link_parse(project, &c.inter) != NB_OK) {
                fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
                return 1;
            }
            c.intra = c.inter;
            nb__scale_report(stdout, &tr, &c, 1024);
        }
        nb__scale_trace_free(&tr);
    }
    free(rec.t);
    free(txt.tok);
    if (zero && nb_ddp_set_zero(ddp, NULL) != NB_OK) { /* the whole state back before the free */
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    nb_ddp_free(ddp); /* first: it detaches the optimizer */
    nb_fsdp_free(fsdp);
    nb_optim_free(opt);
    free(p);
    free(t_step);
    free(b_launch);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
    free(refs);
    return !pg || nb_pg_free(pg) == NB_OK ? 0 : 1;
}
