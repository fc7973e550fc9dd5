/* The CPU backend's entry points that have no kernel header of their own:
 * the elementwise engine (tensor/cpu/elementwise.c), multi-tensor updates
 * (tensor/cpu/optim.c), per-channel statistics (tensor/cpu/channel.c),
 * pooling, dropout, embedding and the elementwise losses
 * (tensor/cpu/pool.c, dropout.c, embedding.c, loss.c), the row reductions
 * (tensor/cpu/reduce.c), the random fills and axpy (tensor/cpu/fill.c).
 * Each is declared through its entry's function type, whose contract is in
 * tensor/backend.h. */
#ifndef NABLA_TENSOR_CPU_CPU_H
#define NABLA_TENSOR_CPU_CPU_H

#include "tensor/backend.h"

/* elementwise engine (tensor/cpu/elementwise.c) */
/* out (contiguous, shape of out) = op(a) with a broadcast to out's shape.
 * s is the scalar of POW/ADD_S/MUL_S. */
nb__backend_unary_fn nb__cpu_unary;
/* out = a op b, with a and b broadcast to out's shape (out may alias
 * neither unless it is exactly the same tensor layout). */
nb__backend_binary_fn nb__cpu_binary;
/* dx = g * GELU_tanh'(x), all three contiguous f32 of one shape: the
 * gradient of nb_gelu(NB_GELU_TANH) in one pass. */
nb__backend_gelu_tanh_backward_fn nb__cpu_gelu_tanh_backward;
/* out = cond != 0 ? a : b, broadcast. */
nb__backend_where_fn nb__cpu_where;
/* dst (any strides) = src broadcast to dst's shape, with dtype conversion. */
nb__backend_copy_fn nb__cpu_copy;

nb__backend_adam_fn nb__cpu_adam;
nb__backend_sgd_fn nb__cpu_sgd;
nb__backend_sum_squares_fn nb__cpu_sum_squares;
nb__backend_max_abs_fn nb__cpu_max_abs;
nb__backend_scale_fn nb__cpu_scale;
nb__backend_all_finite_fn nb__cpu_all_finite;

nb__backend_channel_stats_fn nb__cpu_channel_stats;
nb__backend_channel_finalize_fn nb__cpu_channel_finalize;
nb__backend_channel_normalize_fn nb__cpu_channel_normalize;
nb__backend_channel_backward_sums_fn nb__cpu_channel_backward_sums;
nb__backend_channel_backward_dx_fn nb__cpu_channel_backward_dx;

/* pooling (tensor/cpu/pool.c) */
nb__backend_max_pool2d_fn nb__cpu_max_pool2d;
nb__backend_max_pool2d_backward_fn nb__cpu_max_pool2d_backward;
nb__backend_avg_pool2d_fn nb__cpu_avg_pool2d;
nb__backend_avg_pool2d_backward_fn nb__cpu_avg_pool2d_backward;

/* dropout, embedding, elementwise losses (tensor/cpu/dropout.c,
 * embedding.c, loss.c) */
nb__backend_dropout_fn nb__cpu_dropout;
nb__backend_embedding_fn nb__cpu_embedding;
nb__backend_embedding_backward_fn nb__cpu_embedding_backward;
nb__backend_pair_loss_fn nb__cpu_pair_loss;

/* row reductions (tensor/cpu/reduce.c) */
nb__backend_sum_rows_fn nb__cpu_sum_rows;
nb__backend_max_rows_fn nb__cpu_max_rows;
nb__backend_argmax_rows_fn nb__cpu_argmax_rows;
nb__backend_max_rows_backward_fn nb__cpu_max_rows_backward;
nb__backend_var_rows_fn nb__cpu_var_rows;

/* random fills (Note [Random streams] in tensor/random.c) and axpy
 * (tensor/cpu/fill.c) */
nb__backend_rand_uniform_fn nb__cpu_rand_uniform;
nb__backend_rand_normal_fn nb__cpu_rand_normal;
nb__backend_axpy_fn nb__cpu_axpy;

#endif
