/* Metric sums with a sample count, for exact (distributed) evaluation. */
#include <math.h>
#include <string.h>

#include "nabla/error.h"
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
