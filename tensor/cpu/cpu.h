/* The CPU backend's entry points that have no kernel header of their own:
 * multi-tensor updates (tensor/cpu/optim.c), per-channel statistics
 * (tensor/cpu/channel.c), pooling, dropout, embedding and the elementwise
 * losses (tensor/cpu/pool.c, dropout.c, embedding.c, loss.c), the row
 * reductions (tensor/cpu/reduce.c), the random fills and axpy
 * (tensor/cpu/fill.c). Contracts: the matching members of nb__backend
 * (tensor/backend.h). */
#ifndef NABLA_TENSOR_CPU_CPU_H
#define NABLA_TENSOR_CPU_CPU_H

#include "tensor/internal.h"

void nb__cpu_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m,
                  nb_tensor *const *v, nb_tensor *const *vmax, const int64_t *steps,
                  const double *const *hp, bool decoupled);
void nb__cpu_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf,
                 const int64_t *steps, const double *const *hp);
void nb__cpu_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts);
void nb__cpu_max_abs(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts);
void nb__cpu_scale(int n, nb_tensor *const *ts, double coef);
bool nb__cpu_all_finite(nb_ctx *ctx, int n, nb_tensor *const *ts);

void nb__cpu_channel_stats(nb_tensor *stats, const nb_tensor *x, int64_t n, int64_t c, int64_t s);
void nb__cpu_channel_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                              nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                              double eps, int64_t c, const nb_tensor *input);
void nb__cpu_channel_normalize(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                               const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                               int64_t n, int64_t c, int64_t s);
void nb__cpu_channel_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                   const nb_tensor *mean, const nb_tensor *invstd, int64_t n,
                                   int64_t c, int64_t s);
void nb__cpu_channel_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                                 const nb_tensor *mean, const nb_tensor *invstd,
                                 const nb_tensor *w, const nb_tensor *sums,
                                 const nb_tensor *stats, int64_t n, int64_t c, int64_t s);

/* pooling (tensor/cpu/pool.c) */
void nb__cpu_max_pool2d(nb_tensor *out, nb_tensor *arg, const nb_tensor *x, const nb__pool2d_geom *g);
void nb__cpu_max_pool2d_backward(nb_tensor *dx, const nb_tensor *arg, const nb_tensor *gout,
                                 const nb__pool2d_geom *g);
void nb__cpu_avg_pool2d(nb_tensor *out, const nb_tensor *x, const nb__pool2d_geom *g);
void nb__cpu_avg_pool2d_backward(nb_tensor *dx, const nb_tensor *gout, const nb__pool2d_geom *g);

/* dropout, embedding, elementwise losses (tensor/cpu/dropout.c,
 * embedding.c, loss.c) */
void nb__cpu_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p, uint64_t seed,
                     uint64_t offset);
void nb__cpu_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np);
void nb__cpu_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                int64_t np);
void nb__cpu_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b);

/* row reductions (tensor/cpu/reduce.c) */
void nb__cpu_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner,
                      double scale);
void nb__cpu_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                      int64_t inner);
void nb__cpu_argmax_rows(nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner);
void nb__cpu_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g,
                               int64_t outer, int64_t inner);
void nb__cpu_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                      int64_t inner, double denom);

/* random fills (Note [Random streams] in tensor/random.c) and axpy
 * (tensor/cpu/fill.c) */
void nb__cpu_rand_uniform(nb_tensor *t, double low, double high, uint64_t seed, uint64_t offset);
void nb__cpu_rand_normal(nb_tensor *t, double mean, double std, uint64_t seed, uint64_t offset);
void nb__cpu_axpy(nb_tensor *y, double alpha, const nb_tensor *x);

#endif
