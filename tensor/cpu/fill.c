/* The CPU's in-place fills behind tensor/tensor.c: the uniform and normal
 * random fills (the streams of Note [Random streams] in tensor/random.c,
 * element by element in order) and axpy. Contracts: the matching members
 * of nb__backend (tensor/backend.h). */
#include <math.h>

#include "nabla/random.h"
#include "tensor/cpu/cpu.h"

void nb__cpu_rand_uniform(nb_tensor *t, double low, double high, uint64_t seed, uint64_t offset) {
    int64_t n = nb_numel(t);
    size_t sz = nb_dtype_size(t->dtype);
    uint32_t r[4];
    for (int64_t i = 0; i < n; i++) {
        if ((i & 3) == 0) nb_philox4x32(seed, offset + (uint64_t)(i >> 2), r);
        double u = nb_u32_to_unit(r[i & 3]);
        nb__store((char *)t->data + i * (int64_t)sz, t->dtype, low + (high - low) * u);
    }
}

void nb__cpu_rand_normal(nb_tensor *t, double mean, double std, uint64_t seed, uint64_t offset) {
    int64_t n = nb_numel(t);
    size_t sz = nb_dtype_size(t->dtype);
    uint32_t r[4];
    double radius = 0, theta = 0;
    for (int64_t i = 0; i < n; i++) {
        if ((i & 1) == 0) {
            nb_philox4x32(seed, offset + (uint64_t)(i >> 1), r);
            double u1 = ((double)r[0] + 1.0) * (1.0 / 4294967296.0);
            double u2 = (double)r[1] * (1.0 / 4294967296.0);
            radius = sqrt(-2.0 * log(u1));
            theta = 6.283185307179586 * u2; /* 2 pi */
        }
        double z = (i & 1) ? radius * sin(theta) : radius * cos(theta);
        nb__store((char *)t->data + i * (int64_t)sz, t->dtype, mean + std * z);
    }
}

/* Contiguous: one loop (f32 scaled in f32); otherwise alpha * x into a
 * temporary, then added. */
void nb__cpu_axpy(nb_tensor *y, double alpha, const nb_tensor *x) {
    int64_t n = nb_numel(y);
    if (nb_is_contiguous(y) && nb_is_contiguous(x)) {
        if (y->dtype == NB_F32) {
            float *py = y->data, a = (float)alpha;
            const float *px = x->data;
            for (int64_t i = 0; i < n; i++) py[i] += a * px[i];
        } else {
            double *py = y->data;
            const double *px = x->data;
            for (int64_t i = 0; i < n; i++) py[i] += alpha * px[i];
        }
        return;
    }
    nb_ctx *tmp = nb_ctx_new(nb_cpu(), (size_t)n * nb_dtype_size(x->dtype) + 4096);
    nb_tensor *sx = nb__empty(tmp, x->dtype, x->ndim, x->shape);
    nb__cpu_unary(NB_U_MUL_S, sx, x, alpha);
    nb__cpu_binary(NB_B_ADD, y, y, sx);
    nb_ctx_free(tmp);
}
