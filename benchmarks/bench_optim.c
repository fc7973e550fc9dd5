/* Optimizer benchmark: the time of one nb_optim_step (AdamW, Adam, SGD with
 * and without momentum), of gradient clipping and of zero_grad, on f32
 * parameters in one tensor of 10M and of 100M elements, against the bytes
 * the step must move. An optimizer step is memory-bound, so the figure
 * that matters is the achieved bandwidth; the table sets it beside a
 * plain in-place axpy y[i] += s * x[i] over the same memory (the access
 * pattern of an SGD step: two streams read, one written back in place),
 * about the most a single-threaded loop gets from this machine.
 *
 * Bytes per parameter (f32, each array read and/or written once):
 *   Adam, AdamW     read p, g, m, v; write p, m, v        28
 *   SGD + momentum  read p, g, buf;  write p, buf         20
 *   SGD             read p, g;       write p              12
 *   clip (clips)    read g (norm);   read + write g       12
 *   clip (norm)     read g                                 4
 *   zero_grad       write g                                4
 *   axpy            read y, x;       write y              12
 * Each figure is the best of a few timed repetitions after one warm-up
 * (which also faults the pages in). `--quick` runs 100k parameters (a
 * smoke check). The kernels are single-threaded. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nabla/nabla.h>
#include "bench_time.h"

typedef void (*bench_fn)(void *arg);

/* Best time of `reps` calls after one warm-up call; `prep` (may be NULL)
 * runs untimed before each call. */
static double best_of_prep(bench_fn fn, bench_fn prep, void *arg, int reps) {
    if (prep) prep(arg);
    fn(arg);
    double best = INFINITY;
    for (int r = 0; r < reps; r++) {
        if (prep) prep(arg);
        double t0 = now_s();
        fn(arg);
        double t = now_s() - t0;
        if (t < best) best = t;
    }
    return best;
}

static double best_of(bench_fn fn, void *arg, int reps) { return best_of_prep(fn, NULL, arg, reps); }

static const char *fmt_time(double s, char *buf, size_t n) {
    if (s < 1e-3) snprintf(buf, n, "%.1f us", s * 1e6);
    else if (s < 1.0) snprintf(buf, n, "%.2f ms", s * 1e3);
    else snprintf(buf, n, "%.3f s", s);
    return buf;
}

static const char *fmt_count(int64_t n, char *buf, size_t len) {
    buf[0] = 0;
    if (n >= 1000000 && n % 1000000 == 0) snprintf(buf, len, "%lldM", (long long)(n / 1000000));
    else if (n >= 1000 && n % 1000 == 0) snprintf(buf, len, "%lldk", (long long)(n / 1000));
    else snprintf(buf, len, "%lld", (long long)n);
    return buf;
}

static double g_ref_gbs; /* the axpy's, at the current size, for the last column */

static void row(const char *what, int64_t n, double bytes_per, double t) {
    char cb[32], tb[32], bb[32];
    double gbs = bytes_per * (double)n / t * 1e-9;
    snprintf(bb, sizeof bb, "%.2f GB", bytes_per * (double)n * 1e-9);
    printf("%-26s %6s %10s %11s %10.2f %9.0f%%\n", what, fmt_count(n, cb, sizeof cb), bb,
           fmt_time(t, tb, sizeof tb), gbs, 100.0 * gbs / g_ref_gbs);
}

/* ---- the reference ---- */
typedef struct axpy_arg {
    float *y;
    const float *x;
    int64_t n;
} axpy_arg;

static void run_axpy(void *p) {
    axpy_arg *a = p;
    float *restrict y = a->y;
    const float *restrict x = a->x;
    for (int64_t i = 0; i < a->n; i++) y[i] += 1e-9f * x[i];
}

/* ---- optimizer steps ---- */
typedef struct step_arg {
    nb_optim *opt;
    nb_named_tensor *params;
    double max_norm, norm_type;
} step_arg;

static void run_step(void *p) { nb_optim_step(((step_arg *)p)->opt); }
static void run_zero(void *p) { nb_optim_zero_grad(((step_arg *)p)->opt); }

static void run_clip(void *p) {
    step_arg *s = p;
    nb_clip_grad_norm(s->params, 1, s->max_norm, s->norm_type);
}

/* Before each clip: the gradient back to 0.01 everywhere, so every call
 * finds the norm above max_norm and scales. */
static void refill_grad(void *p) {
    nb_tensor *g = ((step_arg *)p)->params->tensor->grad;
    float *x = g->data;
    for (int64_t i = 0, n = nb_numel(g); i < n; i++) x[i] = 0.01f;
}

static void bench_size(int64_t n, int reps) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), (size_t)n * 8 + 4096);
    nb_tensor *p = nb_full(ctx, NB_F32, 1, &n, 0.5);
    nb_tensor *g = nb_full(ctx, NB_F32, 1, &n, 0.01);
    nb_set_requires_grad(p, true);
    nb_set_grad(p, g);
    nb_named_tensor named = {"w", p};

    axpy_arg ax = {p->data, g->data, n};
    double t_ref = best_of(run_axpy, &ax, reps);
    g_ref_gbs = 12.0 * (double)n / t_ref * 1e-9;
    row("y += a*x (reference)", n, 12, t_ref);

    struct {
        const char *name;
        nb_optim_kind kind;
        double momentum;
        double bytes;
    } cases[] = {
        {"AdamW step", NB_OPTIM_ADAMW, 0, 28},
        {"Adam step", NB_OPTIM_ADAM, 0, 28},
        {"SGD step (momentum 0.9)", NB_OPTIM_SGD, 0.9, 20},
        {"SGD step", NB_OPTIM_SGD, 0, 12},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        nb_optim_hparams h = cases[i].kind == NB_OPTIM_SGD ? NB_SGD_DEFAULTS : NB_ADAMW_DEFAULTS;
        h.momentum = cases[i].momentum;
        h.lr = 1e-6; /* keep the parameters from drifting far over the repetitions */
        nb_optim *opt = nb_optim_new(cases[i].kind, &named, 1, &h);
        step_arg sa = {opt, &named, 0, 2.0};
        row(cases[i].name, n, cases[i].bytes, best_of(run_step, &sa, reps));
        if (i == 0) {
            step_arg ca = {opt, &named, 0.5 * 0.01 * sqrt((double)n), 2.0};
            row("clip_grad_norm (clips)", n, 12, best_of_prep(run_clip, refill_grad, &ca, reps));
            ca.max_norm = INFINITY;
            row("clip_grad_norm (norm only)", n, 4, best_of(run_clip, &ca, reps));
            ca.max_norm = 0.5 * 0.01;
            ca.norm_type = INFINITY;
            row("clip_grad_norm inf (clips)", n, 12, best_of_prep(run_clip, refill_grad, &ca, reps));
            row("zero_grad", n, 4, best_of(run_zero, &sa, reps));
        }
        nb_optim_free(opt);
    }
    nb_ctx_free(ctx);
}

int main(int argc, char **argv) {
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = true;
        else {
            fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
            return 2;
        }
    }
    printf("nabla optimizer benchmark: f32 parameters, one thread; GB/s = bytes moved / time\n");
    printf("%-26s %6s %10s %11s %10s %10s\n", "what", "params", "bytes", "time", "GB/s",
           "of axpy");
    if (quick) {
        bench_size(100000, 3);
    } else {
        bench_size(10000000, 5);
        bench_size(100000000, 3);
    }
    return 0;
}
