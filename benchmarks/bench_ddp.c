/* bench_ddp: DDP's cost and scaling on the CPU. Run it under nbrun; each
 * rank trains the same MLP on its own batch of `--batch` samples (weak
 * scaling) for `--steps` steps with AdamW, and rank 0 prints one table row:
 * world size, mode, milliseconds per step (median), samples per second
 * over all ranks, time in backward, time waiting for buckets after
 * backward, and the share of all-reduce time hidden behind backward.
 *
 *   nbrun --nproc-per-node 1 build/bin/bench_ddp --no-ddp   (the baseline)
 *   nbrun --nproc-per-node 1 build/bin/bench_ddp             (DDP overhead at world size 1)
 *   nbrun --nproc-per-node 2 build/bin/bench_ddp             (and 4, ...)
 *
 * benchmarks/run_ddp.sh runs that series and prints the table with the
 * efficiency against world size 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nabla/ddp.h"
#include "nabla/nabla.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int steps = 30, width = 512, layers = 4, header = 0;
    int64_t batch = 64;
    bool use_ddp = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-ddp")) use_ddp = false;
        else if (!strcmp(argv[i], "--header")) header = 1;
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--width") && i + 1 < argc) width = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--no-ddp] [--steps N] [--batch B] [--width W] [--layers L] [--header]\n",
                    argv[0]);
            return 2;
        }
    }
    if (header) {
        printf("%-6s %-7s %10s %12s %11s %9s %8s\n", "world", "mode", "ms/step", "samples/s", "backward", "wait",
               "hidden");
        return 0;
    }
    nb_pg *pg;
    nb_pg_options po = {NB_PG_GLOO, 0};
    if (nb_pg_init(&pg, &po) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    int rank = nb_pg_rank(pg), world = nb_pg_size(pg);
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(1);
    nb_module **c = calloc((size_t)(2 * layers), sizeof *c);
    for (int l = 0; l < layers; l++) {
        c[2 * l] = nb_linear_new(pctx, NB_F32, width, l == layers - 1 ? 10 : width, true, &rng);
        c[2 * l + 1] = nb_relu_new(pctx);
    }
    nb_module *model = nb_sequential_new(pctx, 2 * layers - 1, c);
    nb_ddp *ddp = NULL;
    if (use_ddp && nb_ddp_new(&ddp, model, pg, NULL) != NB_OK) {
        fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
        return 1;
    }
    int np = nb_module_named_parameters(model, NULL, 0);
    nb_named_tensor *p = calloc((size_t)np, sizeof *p);
    nb_module_named_parameters(model, p, np);
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, p, np, &NB_ADAMW_DEFAULTS);
    nb_rng data = nb_rng_make(100 + (uint64_t)rank);
    double *t_step = calloc((size_t)steps, sizeof(double)), bw = 0, wait = 0, hidden = 0;
    int measured = 0;
    for (int s = 0; s < steps + 3; s++) { /* 3 warm-up steps */
        nb_ctx_reset(step);
        nb_tensor *x = nb_rand_normal(step, NB_F32, NB_SHAPE(batch, width), 0, 1, &data);
        int64_t *lab = nb_ctx_alloc(step, sizeof(int64_t) * (size_t)batch, 0);
        for (int64_t i = 0; i < batch; i++) lab[i] = (i + s) % 10;
        nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(batch), lab);
        double t0 = now_s();
        nb_tensor *out = ddp ? nb_ddp_forward(ddp, step, x) : nb_module_forward(model, step, x);
        nb_tensor *loss = nb_cross_entropy(step, out, y, NULL);
        if (ddp) {
            if (nb_ddp_backward(ddp, loss) != NB_OK) {
                fprintf(stderr, "bench_ddp: %s\n", nb_last_error());
                return 1;
            }
        } else {
            nb_backward(loss);
        }
        nb_optim_step(opt);
        nb_optim_zero_grad(opt);
        double t1 = now_s();
        if (s >= 3) {
            t_step[measured++] = t1 - t0;
            if (ddp && world > 1) {
                nb_ddp_step_stats st = nb_ddp_last_stats(ddp);
                bw += st.backward_s;
                wait += st.wait_s;
                hidden += st.hidden_fraction;
            }
        }
    }
    qsort(t_step, (size_t)measured, sizeof(double), cmp_double);
    double med = t_step[measured / 2];
    if (rank == 0) {
        char hid[16] = "-", bws[16] = "-", ws[16] = "-";
        if (ddp && world > 1) {
            snprintf(hid, sizeof hid, "%.0f%%", 100 * hidden / measured);
            snprintf(bws, sizeof bws, "%.2f ms", 1e3 * bw / measured);
            snprintf(ws, sizeof ws, "%.2f ms", 1e3 * wait / measured);
        }
        printf("%-6d %-7s %10.2f %12.0f %11s %9s %8s\n", world, ddp ? "ddp" : "no-ddp", 1e3 * med,
               (double)batch * world / med, bws, ws, hid);
    }
    nb_optim_free(opt);
    nb_ddp_free(ddp);
    free(p);
    free(c);
    free(t_step);
    nb_ctx_free(step);
    nb_ctx_free(pctx);
    return nb_pg_free(pg) == NB_OK ? 0 : 1;
}
