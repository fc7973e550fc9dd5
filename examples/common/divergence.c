/* Divergence guard of the training programs (divergence.h). A tensor is
 * finite when the sum of its elements times 0 is 0: 0 * NaN and 0 * inf are
 * NaN, and a sum with a NaN is NaN, on any device, without a host copy. */
#include "divergence.h"

#include <math.h>
#include <stdio.h>

static bool all_finite(nb_ctx *ctx, nb_tensor *t) {
    if (!t || !nb_dtype_is_float(t->dtype) || nb_numel(t) == 0) return true;
    bool prev = nb_no_grad_begin();
    if (t->dtype != NB_F32 && t->dtype != NB_F64) t = nb_cast(ctx, t, NB_F32);
    double s = nb_item(nb_sum_all(ctx, nb_mul_scalar(ctx, t, 0.0)));
    nb_no_grad_end(prev);
    return isfinite(s);
}

nb_status divergence_step(divergence *g, nb_ctx *ctx, const nb_named_tensor *params, int n,
                          int64_t step, double norm) {
    if (isfinite(norm)) {
        g->skipped = 0;
        return NB_OK;
    }
    if (g->skipped++ == 0) g->first_skipped = step;
    if (g->max_skipped <= 0 || g->skipped < g->max_skipped) return NB_OK;
    const char *first = NULL;
    for (int i = 0; i < n && !first; i++)
        if (params[i].tensor->grad && !all_finite(ctx, params[i].tensor->grad)) first = params[i].name;
    return nb_set_error(NB_ERR_FORMAT, "the run diverged: %lld consecutive steps skipped (steps "
                        "%lld to %lld), the last with gradient norm %g; the first parameter whose "
                        "gradient is not finite: %s. Lower the learning rate (or warm it up), or "
                        "allow more with --max-skipped-steps (0: no limit)",
                        (long long)g->skipped, (long long)g->first_skipped, (long long)step, norm,
                        first ? first : "none (the norm itself overflowed)");
}

nb_status divergence_check_finite(nb_ctx *ctx, const nb_named_tensor *list, int n,
                                  const char *what) {
    for (int i = 0; i < n; i++)
        if (!all_finite(ctx, list[i].tensor))
            return nb_set_error(NB_ERR_FORMAT, "%s: \"%s\" holds a NaN or an infinity (the run "
                                "diverged); the checkpoint on disk is left as it was, the last "
                                "good one", what, list[i].name);
    return NB_OK;
}
