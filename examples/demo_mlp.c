/* demo_mlp: trains a small multilayer perceptron with autograd and SGD on a
 * synthetic task (three interleaved spirals in the plane, 3 classes) and
 * prints the loss falling and the final accuracy.
 *
 * It shows the shape of every nabla training program: parameters in a
 * persistent context, one per-step context reset each iteration, forward,
 * nb_backward, an in-place update, zeroed gradients. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

#define N_PER_CLASS 200
#define N_CLASSES 3
#define N (N_PER_CLASS * N_CLASSES)
#define HIDDEN 64
#define STEPS 1500
#define LR 0.5

static void make_spirals(float *x, int64_t *y, nb_rng *rng) {
    uint32_t r[4];
    for (int c = 0; c < N_CLASSES; c++)
        for (int i = 0; i < N_PER_CLASS; i++) {
            int k = c * N_PER_CLASS + i;
            double t = (double)i / N_PER_CLASS;
            nb_philox4x32(rng->seed, rng->offset++, r);
            double noise = ((double)nb_u32_to_unit(r[0]) - 0.5) * 0.4;
            double angle = c * 2.0 * 3.14159265358979 / N_CLASSES + 4.0 * t + noise;
            x[2 * k] = (float)(t * cos(angle));
            x[2 * k + 1] = (float)(t * sin(angle));
            y[k] = c;
        }
}

static nb_tensor *param(nb_ctx *ctx, const char *name, int64_t rows, int64_t cols, int64_t fan_in, nb_rng *rng) {
    double bound = 1.0 / sqrt((double)fan_in);
    nb_tensor *t = rows ? nb_rand_uniform(ctx, NB_F32, NB_SHAPE(rows, cols), -bound, bound, rng)
                        : nb_rand_uniform(ctx, NB_F32, NB_SHAPE(cols), -bound, bound, rng);
    nb_set_requires_grad(t, true);
    nb_set_name(t, name);
    return t;
}

int main(int argc, char **argv) {
    int steps = STEPS;
    if (argc > 1) steps = atoi(argv[1]);
    if (steps <= 0) {
        fprintf(stderr, "usage: %s [steps]   (steps > 0, default %d)\n", argv[0], STEPS);
        return 2;
    }
    nb_rng rng = nb_rng_make(1234);
    static float xs[N * 2];
    static int64_t ys[N];
    make_spirals(xs, ys, &rng);

    nb_ctx *params = nb_ctx_new(nb_cpu(), 0); /* parameters and their gradients */
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);   /* activations and the tape; reset every step */
    nb_tensor *w[3] = {param(params, "fc1.weight", 2, HIDDEN, 2, &rng),
                       param(params, "fc2.weight", HIDDEN, HIDDEN, HIDDEN, &rng),
                       param(params, "fc3.weight", HIDDEN, N_CLASSES, HIDDEN, &rng)};
    nb_tensor *b[3] = {param(params, "fc1.bias", 0, HIDDEN, 2, &rng),
                       param(params, "fc2.bias", 0, HIDDEN, HIDDEN, &rng),
                       param(params, "fc3.bias", 0, N_CLASSES, HIDDEN, &rng)};
    nb_ctx *data = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_from_host(data, NB_F32, NB_SHAPE(N, 2), xs);
    nb_tensor *y = nb_from_host(data, NB_I64, NB_SHAPE(N), ys);

    printf("nabla demo: MLP 2-%d-%d-%d on %d points of 3 spirals, full-batch SGD, lr %.2f\n", HIDDEN,
           HIDDEN, N_CLASSES, N, LR);
    double first = 0, last = 0, acc = 0;
    for (int it = 0; it <= steps; it++) {
        nb_ctx_reset(step);
        nb_tensor *h = x;
        for (int l = 0; l < 3; l++) {
            h = nb_add(step, nb_matmul(step, h, w[l]), b[l]);
            if (l < 2) h = nb_tanh(step, h);
        }
        nb_tensor *loss = nb_cross_entropy(step, h, y, NULL);
        nb_backward(loss);
        for (int l = 0; l < 3; l++) {
            nb_axpy_(w[l], -LR, w[l]->grad);
            nb_axpy_(b[l], -LR, b[l]->grad);
            nb_zero_grad(w[l]);
            nb_zero_grad(b[l]);
        }
        last = nb_item(loss);
        if (it == 0) first = last;
        if (it % (steps / 10 > 0 ? steps / 10 : 1) == 0 || it == steps) {
            bool prev = nb_no_grad_begin();
            nb_tensor *pred = nb_max(step, h, 1, (int[]){1}, false);
            int correct = 0;
            for (int i = 0; i < N; i++) {
                double best = nb_get(pred, (int64_t[]){i});
                correct += nb_get(h, (int64_t[]){i, ys[i]}) == best;
            }
            nb_no_grad_end(prev);
            acc = (double)correct / N;
            printf("step %5d   loss %.4f   accuracy %5.1f%%\n", it, last, 100.0 * acc);
        }
    }
    printf("loss %.4f -> %.4f; peak step memory %.1f KiB, parameters %.1f KiB\n", first, last,
           nb_ctx_peak(step) / 1024.0, nb_ctx_used(params) / 1024.0);
    nb_ctx_free(step);
    nb_ctx_free(params);
    nb_ctx_free(data);
    return last < first ? 0 : 1;
}
