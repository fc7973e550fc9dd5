/* The program in README.md: fits y = x w + b by gradient descent. */
#include <stdio.h>

#include <nabla/nabla.h>

int main(void) {
    nb_manual_seed(0);
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0); /* lives for the whole run */
    nb_ctx *step = nb_ctx_new(nb_cpu(), 0);   /* activations and tape, reset every step */

    /* 256 samples with 3 features; y = x (2, -1, 0.5) + 0.5. */
    nb_tensor *x = nb_rand_normal(params, NB_F32, NB_SHAPE(256, 3), 0.0, 1.0, NULL);
    nb_tensor *w_true = nb_from_host(params, NB_F32, NB_SHAPE(3, 1), (float[]){2, -1, 0.5f});
    nb_tensor *y = nb_add_scalar(params, nb_matmul(params, x, w_true), 0.5);

    nb_tensor *w = nb_zeros(params, NB_F32, NB_SHAPE(3, 1));
    nb_tensor *b = nb_zeros(params, NB_F32, NB_SHAPE(1));
    nb_set_requires_grad(w, true);
    nb_set_requires_grad(b, true);

    for (int i = 0; i <= 100; i++) {
        nb_tensor *loss = nb_mse_loss(step, nb_add(step, nb_matmul(step, x, w), b), y);
        nb_backward(loss);
        if (i % 20 == 0) printf("step %3d  loss %.6f\n", i, nb_item(loss));
        nb_axpy_(w, -0.1, w->grad); /* plain SGD; never recorded by autograd */
        nb_axpy_(b, -0.1, b->grad);
        nb_zero_grad(w);
        nb_zero_grad(b);
        nb_ctx_reset(step);
    }
    float wv[3];
    nb_to_host(w, wv);
    printf("w = (%.3f, %.3f, %.3f), b = %.3f\n", wv[0], wv[1], wv[2], nb_item(b));

    nb_ctx_free(step);
    nb_ctx_free(params);
    return 0;
}
