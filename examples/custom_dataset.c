/* A user-defined dataset, as docs/data.md describes it: points on the line
 * y = 3x - 1 with noise, generated from the sample index alone (so any
 * worker can make any sample, and the order does not depend on the worker
 * count). A threaded loader feeds a linear model trained by SGD. */
#include <stdio.h>
#include <stdlib.h>

#include <nabla/nabla.h>

typedef struct line_data {
    int64_t n;
    uint64_t seed;
} line_data;

static int64_t line_len(void *self) { return ((line_data *)self)->n; }

/* Sample i: x uniform in [-1, 1), y = 3x - 1 + noise in [-0.1, 0.1). */
static nb_status line_get(void *self, int64_t i, void *input, void *target) {
    line_data *d = self;
    uint32_t r[4];
    nb_philox4x32(d->seed, (uint64_t)i, r);
    float x = 2.0f * nb_u32_to_unit(r[0]) - 1.0f;
    float noise = 0.2f * nb_u32_to_unit(r[1]) - 0.1f;
    ((float *)input)[0] = x;
    ((float *)target)[0] = 3.0f * x - 1.0f + noise;
    return NB_OK;
}

static void line_free(void *self) { free(self); }

static const nb_dataset_vtable line_vt = {"line", line_len, line_get, line_free};

static nb_dataset *line_dataset(int64_t n, uint64_t seed) {
    line_data *d = malloc(sizeof *d);
    if (!d) return NULL;
    d->n = n;
    d->seed = seed;
    /* each sample: input (1) f32, target (1) f32 */
    return nb_dataset_new(&line_vt, d, nb_field_of(NB_F32, NB_SHAPE(1)),
                          nb_field_of(NB_F32, NB_SHAPE(1)));
}

int main(void) {
    nb_dataset *ds = line_dataset(1000, 42);
    nb_loader *loader;
    nb_loader_options opts = {.batch_size = 32, .shuffle = true, .seed = 0, .num_workers = 2};
    if (nb_loader_new(&loader, ds, &opts) != NB_OK) {
        fprintf(stderr, "%s\n", nb_last_error());
        return 1;
    }
    nb_dataset_free(ds); /* the loader keeps its own reference */

    nb_ctx *params = nb_ctx_new(nb_cpu(), 0);
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_zeros(params, NB_F32, NB_SHAPE(1, 1));
    nb_tensor *b = nb_zeros(params, NB_F32, NB_SHAPE(1));
    nb_set_requires_grad(w, true);
    nb_set_requires_grad(b, true);

    for (int epoch = 0; epoch < 5; epoch++) {
        nb_loader_set_epoch(loader, epoch);
        double loss_sum = 0;
        int64_t seen = 0;
        for (;;) {
            nb_batch batch;
            if (nb_loader_next(loader, step, &batch) != NB_OK) {
                fprintf(stderr, "%s\n", nb_last_error());
                return 1;
            }
            if (!batch.inputs) break; /* end of the epoch */
            nb_tensor *pred = nb_add(step, nb_matmul(step, batch.inputs, w), b); /* (B, 1) */
            nb_tensor *loss = nb_mse_loss(step, pred, batch.targets);
            nb_backward(loss);
            nb_axpy_(w, -0.2, w->grad);
            nb_axpy_(b, -0.2, b->grad);
            nb_zero_grad(w);
            nb_zero_grad(b);
            loss_sum += nb_item(loss) * (double)batch.size;
            seen += batch.size;
            nb_ctx_reset(step); /* the batch tensors go with the step's other tensors */
        }
        printf("epoch %d  mean loss %.5f  (%lld samples)\n", epoch, loss_sum / (double)seen,
               (long long)seen);
    }
    printf("w = %.3f, b = %.3f (true: 3, -1)\n", nb_item(w), nb_item(b));

    nb_loader_free(loader);
    nb_ctx_free(step);
    nb_ctx_free(params);
    return 0;
}
