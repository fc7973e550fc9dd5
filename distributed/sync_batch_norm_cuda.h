/* SyncBatchNorm's CUDA kernels (distributed/sync_batch_norm.cu), called by
 * distributed/sync_batch_norm.c when the input is on a CUDA device. Every
 * tensor is on that device; the work goes on its compute stream and the
 * host reads nothing. x, y, dy, dx are contiguous (N, C, S) of one float
 * dtype (f32, f64, bf16, f16); the statistics are f64, computed and
 * applied in f64. Without CUDA in the build, sync_batch_norm.c defines
 * stubs that abort (unreachable: no CUDA tensor can be made). */
#ifndef NABLA_DISTRIBUTED_SYNC_BATCH_NORM_CUDA_H
#define NABLA_DISTRIBUTED_SYNC_BATCH_NORM_CUDA_H

#include <stdint.h>

#include "nabla/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* stats (3 C, f64, contiguous) = [count | sum | sum of squares] per channel. */
void nb__cuda_sbn_stats(nb_tensor *stats, const nb_tensor *x, int64_t n, int64_t c, int64_t s);
/* From the all-reduced stats: mean and invstd (C, f64) with the biased
 * variance, and the running statistics (C, f32 or f64, any stride, or
 * both NULL) updated with momentum and the unbiased variance (NaN when the
 * global count is 1 or less: the host cannot check it without a read). */
void nb__cuda_sbn_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                           nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                           double eps, int64_t c);
/* y = (x - mean[c]) invstd[c] w[c] + b[c]; w, b (C, contiguous, any float
 * dtype) or NULL (1 and 0). */
void nb__cuda_sbn_apply(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                        const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                        int64_t n, int64_t c, int64_t s);
/* sums (2 C, f64, contiguous) = [sum dy | sum dy xhat] per channel. */
void nb__cuda_sbn_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                const nb_tensor *mean, const nb_tensor *invstd, int64_t n,
                                int64_t c, int64_t s);
/* dx = w invstd (dy - sum dy / M - xhat sum(dy xhat) / M), with the
 * all-reduced sums and M = stats[c] (the global count). */
void nb__cuda_sbn_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                              const nb_tensor *mean, const nb_tensor *invstd, const nb_tensor *w,
                              const nb_tensor *sums, const nb_tensor *stats, int64_t n, int64_t c,
                              int64_t s);

#ifdef __cplusplus
}
#endif
#endif
