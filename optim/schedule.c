/* Learning-rate schedules: pure functions of the step (nabla/optim.h has
 * the formulas), so a resumed run recomputes exactly the rates it would
 * have used. */
#include <math.h>

#include "optim/internal.h"

#define PI 3.14159265358979323846

nb_lr_schedule nb_lr_constant(double lr, int64_t warmup_steps) {
    nb_lr_schedule s = {.kind = NB_LR_CONSTANT, .lr = lr, .warmup_steps = warmup_steps};
    return s;
}

nb_lr_schedule nb_lr_step_decay(double lr, int64_t warmup_steps, int64_t step_size, double gamma) {
    nb_lr_schedule s = {.kind = NB_LR_STEP, .lr = lr, .warmup_steps = warmup_steps,
                        .step_size = step_size, .gamma = gamma};
    return s;
}

nb_lr_schedule nb_lr_cosine(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr) {
    nb_lr_schedule s = {.kind = NB_LR_COSINE, .lr = lr, .warmup_steps = warmup_steps,
                        .total_steps = total_steps, .min_lr = min_lr};
    return s;
}

double nb_lr_schedule_at(const nb_lr_schedule *s, int64_t step) {
    const char *who = "nb_lr_schedule_at";
    NB_CHECK(s, "%s: NULL schedule", who);
    NB_CHECK(step >= 0, "%s: step %lld is negative", who, (long long)step);
    NB_CHECK(isfinite(s->lr) && s->lr >= 0, "%s: lr = %g must be finite and >= 0", who, s->lr);
    NB_CHECK(s->warmup_steps >= 0, "%s: warmup_steps = %lld is negative", who,
             (long long)s->warmup_steps);
    if (step < s->warmup_steps) return s->lr * (double)(step + 1) / (double)s->warmup_steps;
    int64_t t = step - s->warmup_steps;
    switch (s->kind) {
    case NB_LR_CONSTANT: return s->lr;
    case NB_LR_STEP:
        NB_CHECK(s->step_size > 0, "%s: step decay needs step_size > 0, got %lld", who,
                 (long long)s->step_size);
        NB_CHECK(isfinite(s->gamma) && s->gamma >= 0, "%s: gamma = %g must be finite and >= 0",
                 who, s->gamma);
        return s->lr * pow(s->gamma, (double)(t / s->step_size));
    case NB_LR_COSINE: {
        NB_CHECK(s->total_steps >= s->warmup_steps,
                 "%s: cosine schedule with total_steps = %lld < warmup_steps = %lld", who,
                 (long long)s->total_steps, (long long)s->warmup_steps);
        NB_CHECK(isfinite(s->min_lr) && s->min_lr >= 0 && s->min_lr <= s->lr,
                 "%s: min_lr = %g must be in [0, lr = %g]", who, s->min_lr, s->lr);
        int64_t span = s->total_steps - s->warmup_steps;
        if (t >= span) return s->min_lr;
        double progress = (double)t / (double)span;
        return s->min_lr + 0.5 * (s->lr - s->min_lr) * (1.0 + cos(PI * progress));
    }
    }
    NB_ABORT("%s: unknown schedule kind %d", who, (int)s->kind);
}
