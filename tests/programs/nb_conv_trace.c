/* nb_conv_trace: runs nb_conv2d forward and backward on fixed inputs for
 * grouped, depthwise and ungrouped settings, and prints every input and
 * result as JSON on stdout, so that tests/test_conv_vs_torch.py can replay
 * them with torch.nn.functional.conv2d and compare.
 *
 * Each case: x (N, C, H, W), weight (O, C/G, KH, KW), bias (O) or none, and
 * an output gradient gy; the backward is that of sum(y * gy), so dx, dw and
 * db are the vector-Jacobian products with gy. Values are printed with 17
 * significant digits (exact for f64 and f32). Usage: nb_conv_trace */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <nabla/nabla.h>

#include "driver.h"

typedef struct conv_cfg {
    int64_t n, c, h, w, o, kh, kw;
    nb_conv2d_opts opts;
    bool bias;
} conv_cfg;

static void print_values(const char *key, const nb_tensor *t) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof(double) * (size_t)n);
    nb_to_host_f64(t, v);
    printf(", \"%s\": [", key);
    for (int64_t i = 0; i < n; i++) printf(i ? ", %.17g" : "%.17g", v[i]);
    printf("]");
    free(v);
}

/* A tensor of `shape` with smooth, sign-changing values (phase picks them). */
static nb_tensor *filled(nb_ctx *ctx, nb_dtype dt, int ndim, const int64_t *shape, double phase) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    double *v = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = sin(0.7 * (double)i + phase) * (1.0 + 0.25 * (double)(i % 5));
    nb_tensor *t = nb_from_host(ctx, NB_F64, ndim, shape, v);
    free(v);
    return dt == NB_F64 ? t : nb_cast(ctx, t, dt);
}

static void run(const conv_cfg *cf, nb_dtype dt, int index) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const nb_conv2d_opts *o = &cf->opts;
    int64_t g = o->groups > 0 ? o->groups : 1;
    nb_tensor *x = filled(ctx, dt, 4, (int64_t[]){cf->n, cf->c, cf->h, cf->w}, 0.1 * index);
    nb_tensor *w = filled(ctx, dt, 4, (int64_t[]){cf->o, cf->c / g, cf->kh, cf->kw}, 1.0 + index);
    nb_tensor *b = cf->bias ? filled(ctx, dt, 1, (int64_t[]){cf->o}, 2.0) : NULL;
    nb_set_requires_grad(x, true);
    nb_set_requires_grad(w, true);
    if (b) nb_set_requires_grad(b, true);
    nb_tensor *y = nb_conv2d(ctx, x, w, b, o);
    nb_tensor *gy = filled(ctx, dt, 4, y->shape, 3.0);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, y, gy)));
    printf("%s{\"dtype\": \"%s\", \"stride\": [%d, %d], \"padding\": [%d, %d], "
           "\"dilation\": [%d, %d], \"groups\": %lld, \"bias\": %s",
           index ? ",\n  " : "  ", dt == NB_F32 ? "float32" : "float64", o->stride[0],
           o->stride[1], o->padding[0], o->padding[1], o->dilation[0], o->dilation[1],
           (long long)g, b ? "true" : "false");
    printf(", \"x_shape\": [%lld, %lld, %lld, %lld], \"w_shape\": [%lld, %lld, %lld, %lld]",
           (long long)cf->n, (long long)cf->c, (long long)cf->h, (long long)cf->w,
           (long long)cf->o, (long long)(cf->c / g), (long long)cf->kh, (long long)cf->kw);
    print_values("x", x);
    print_values("w", w);
    if (b) print_values("b", b);
    print_values("gy", gy);
    print_values("y", y);
    print_values("dx", x->grad);
    print_values("dw", w->grad);
    if (b) print_values("db", b->grad);
    printf("}");
    nb_ctx_free(ctx);
}

int main(int argc, char **argv) {
    driver_args(argc, argv, 0, "  (prints JSON on stdout)");
    static const conv_cfg cfgs[] = {
        {2, 4, 7, 6, 6, 3, 3, {{1, 1}, {1, 1}, {1, 1}, 1}, true},  /* ungrouped */
        {2, 4, 7, 6, 6, 3, 3, {{1, 1}, {1, 1}, {1, 1}, 2}, true},  /* 2 groups */
        {2, 8, 9, 7, 8, 3, 2, {{2, 1}, {1, 0}, {1, 2}, 4}, false}, /* 4 groups, strided */
        {2, 6, 8, 8, 6, 3, 3, {{1, 1}, {1, 1}, {1, 1}, 6}, true},  /* depthwise */
        {1, 3, 9, 8, 6, 3, 3, {{2, 2}, {2, 1}, {2, 1}, 3}, true},  /* depthwise, 2 per channel */
        {2, 6, 5, 5, 4, 1, 1, {{1, 1}, {0, 0}, {1, 1}, 2}, false}, /* grouped 1x1 */
    };
    int n = (int)(sizeof cfgs / sizeof cfgs[0]), k = 0;
    printf("{\"cases\": [\n");
    for (int d = 0; d < 2; d++)
        for (int i = 0; i < n; i++) run(&cfgs[i], d ? NB_F32 : NB_F64, k++);
    printf("\n]}\n");
    return 0;
}
