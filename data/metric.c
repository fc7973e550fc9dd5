/* Metric sums with a sample count, for exact (distributed) evaluation, and
 * the count of correct predictions of a classifier's batch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/error.h"
#include "nabla/ops.h"
#include "nabla/sampler.h"

void nb_metric_sums_init(nb_metric_sums *m, int n_metrics) {
    NB_CHECK(n_metrics >= 0 && n_metrics <= NB_METRIC_MAX,
             "nb_metric_sums_init: %d metrics (at most %d)", n_metrics, NB_METRIC_MAX);
    memset(m, 0, sizeof *m);
    m->n = n_metrics;
}

void nb_metric_sums_add(nb_metric_sums *m, const double *sums, int64_t count) {
    NB_CHECK(count >= 0, "nb_metric_sums_add: count %lld < 0", (long long)count);
    m->v[0] += (double)count;
    for (int k = 0; k < m->n; k++) m->v[1 + k] += sums[k];
}

void nb_metric_sums_merge(nb_metric_sums *dst, const nb_metric_sums *src) {
    NB_CHECK(dst->n == src->n, "nb_metric_sums_merge: %d metrics vs %d", dst->n, src->n);
    for (int k = 0; k <= dst->n; k++) dst->v[k] += src->v[k];
}

double *nb_metric_sums_data(nb_metric_sums *m) { return m->v; }
int nb_metric_sums_size(const nb_metric_sums *m) { return 1 + m->n; }
double nb_metric_sums_count(const nb_metric_sums *m) { return m->v[0]; }

double nb_metric_sums_mean(const nb_metric_sums *m, int k) {
    NB_CHECK(k >= 0 && k < m->n, "nb_metric_sums_mean: metric %d of %d", k, m->n);
    return m->v[0] > 0 ? m->v[1 + k] / m->v[0] : NAN;
}

int64_t nb_count_correct(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets) {
    const char *fn = "nb_count_correct";
    NB_CHECK(logits->ndim == 2, "%s: logits must be 2-D (N, C), got shape %s", fn,
             nb_shape_str(logits));
    NB_CHECK(targets->ndim == 1 && targets->shape[0] == logits->shape[0],
             "%s: targets must have shape (%lld,) for logits of shape %s, got shape %s", fn,
             (long long)logits->shape[0], nb_shape_str(logits), nb_shape_str(targets));
    NB_CHECK(targets->dtype == NB_I32 || targets->dtype == NB_I64,
             "%s: targets must be i32 or i64 class indices, got %s", fn,
             nb_dtype_name(targets->dtype));
    NB_CHECK(targets->device.type == logits->device.type &&
                 targets->device.index == logits->device.index,
             "%s: logits on %s but targets on %s", fn, nb_device_name(logits->device),
             nb_device_name(targets->device));
    int64_t n = logits->shape[0];
    if (n == 0) return 0;
    nb_tensor *pred = nb_argmax(ctx, logits, 1, false);
    double *buf = malloc(2 * (size_t)n * sizeof *buf);
    NB_CHECK(buf, "%s: out of host memory for %lld rows", fn, (long long)n);
    nb_to_host_f64(pred, buf);
    nb_to_host_f64(targets, buf + n);
    int64_t correct = 0;
    for (int64_t i = 0; i < n; i++) correct += buf[i] == buf[n + i];
    free(buf);
    return correct;
}
