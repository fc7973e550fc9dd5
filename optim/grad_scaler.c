/* Dynamic loss scaling for f16 training, with PyTorch's GradScaler
 * semantics (docs/optim.md): the loss is multiplied by the scale before
 * backward; before the optimizer step the gradients are divided by it in
 * place and checked; a step whose gradients hold an inf or a NaN is
 * skipped and the scale backs off; `interval` finite steps in a row grow
 * it.
 *
 * The check is one pass and one host read, the backend's all_finite
 * (tensor/backend.h): on the CPU a scan of the gradients, on CUDA one sum
 * of squares over all of them (f64 accumulation), whose result is finite
 * exactly when every element is, except for f64 gradients above ~1e154,
 * whose squares overflow (they are then reported as not finite). */
#include <math.h>
#include <stdlib.h>

#include "optim/internal.h"
#include "tensor/backend.h"
#include "util/handle.h"

typedef enum scaler_stage { STAGE_READY = 0, STAGE_UNSCALED, STAGE_STEPPED } scaler_stage;

struct nb_grad_scaler {
    double scale, growth, backoff;
    int64_t interval, growth_tracker;
    scaler_stage stage;
    bool found_inf;
};

nb_grad_scaler *nb_grad_scaler_new(double init_scale, double growth_factor,
                                   double backoff_factor, int64_t growth_interval) {
    const char *who = "nb_grad_scaler_new";
    NB_CHECK(isfinite(init_scale) && init_scale > 0, "%s: init_scale = %g must be finite and > 0",
             who, init_scale);
    NB_CHECK(isfinite(growth_factor) && growth_factor > 1,
             "%s: growth_factor = %g must be finite and > 1", who, growth_factor);
    NB_CHECK(backoff_factor > 0 && backoff_factor < 1, "%s: backoff_factor = %g must be in (0, 1)",
             who, backoff_factor);
    NB_CHECK(growth_interval >= 1, "%s: growth_interval = %lld must be >= 1", who,
             (long long)growth_interval);
    nb_grad_scaler *s = calloc(1, sizeof *s);
    NB_CHECK(s, "%s: out of memory", who);
    s->scale = init_scale;
    s->growth = growth_factor;
    s->backoff = backoff_factor;
    s->interval = growth_interval;
    return s;
}

void nb_grad_scaler_free(nb_grad_scaler *s) { free(s); }

NB__HANDLE_GETTER(double, nb_grad_scaler_get_scale, const nb_grad_scaler, s, "gradient scaler",
                  s->scale)

nb_tensor *nb_grad_scaler_scale(nb_grad_scaler *s, nb_ctx *ctx, nb_tensor *loss) {
    NB__CHECK_HANDLE("nb_grad_scaler_scale", s, "gradient scaler");
    NB_CHECK(s && ctx && loss, "nb_grad_scaler_scale: NULL argument");
    return nb_mul_scalar(ctx, loss, s->scale);
}

static bool grads_finite(nb_optim *opt) {
    nb_device dev = opt->params[0].param->device;
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)(opt->n_params > 0 ? opt->n_params : 1));
    int k = 0;
    for (int i = 0; i < opt->n_params; i++) {
        nb_tensor *g = opt->params[i].param->grad;
        if (g) gl[k++] = nb__contig(sc, g);
    }
    return nb__backend_of(dev)->all_finite(sc, k, gl);
}

double nb__grad_scaler_begin_unscale(nb_grad_scaler *s, const char *who) {
    NB_CHECK(s->stage == STAGE_READY, "%s: the gradients were already %s since the last "
             "nb_grad_scaler_update", who, s->stage == STAGE_UNSCALED ? "unscaled" : "stepped");
    return 1.0 / s->scale;
}

void nb__grad_scaler_end_unscale(nb_grad_scaler *s, bool found_inf) {
    s->found_inf = found_inf;
    s->stage = STAGE_UNSCALED;
}

bool nb__grad_scaler_begin_step(nb_grad_scaler *s, const char *who) {
    NB_CHECK(s->stage != STAGE_STEPPED,
             "%s: called twice without nb_grad_scaler_update in between", who);
    return s->stage == STAGE_READY;
}

bool nb__grad_scaler_end_step(nb_grad_scaler *s) {
    s->stage = STAGE_STEPPED;
    return !s->found_inf;
}

/* who's checks: both handles, and opt neither stepped per bucket nor
 * sharded (`instead`: what to call for a sharded one). */
static void check_args(nb_grad_scaler *s, nb_optim *opt, const char *who, const char *instead) {
    NB__CHECK_HANDLE(who, s, "gradient scaler");
    NB__CHECK_HANDLE(who, opt, "optimizer");
    NB_CHECK(s && opt, "%s: NULL argument", who);
    nb__optim_check_not_bucket_stepped(opt, who);
    nb__optim_check_not_sharded(opt, who, instead);
}

void nb_grad_scaler_unscale(nb_grad_scaler *s, nb_optim *opt) {
    check_args(s, opt, "nb_grad_scaler_unscale", "unscale with nb_ddp_scaler_unscale(ddp, scaler)");
    double inv = nb__grad_scaler_begin_unscale(s, "nb_grad_scaler_unscale");
    for (int i = 0; i < opt->n_params; i++) {
        nb_tensor *g = opt->params[i].param->grad;
        if (g) nb_scale_(g, inv);
    }
    nb__grad_scaler_end_unscale(s, !grads_finite(opt));
}

bool nb_grad_scaler_step(nb_grad_scaler *s, nb_optim *opt) {
    check_args(s, opt, "nb_grad_scaler_step", "step with nb_ddp_scaler_step(ddp, scaler, &stepped)");
    if (nb__grad_scaler_begin_step(s, "nb_grad_scaler_step")) nb_grad_scaler_unscale(s, opt);
    if (!nb__grad_scaler_end_step(s)) return false;
    nb_optim_step(opt);
    return true;
}

void nb_grad_scaler_update(nb_grad_scaler *s) {
    NB__CHECK_HANDLE("nb_grad_scaler_update", s, "gradient scaler");
    NB_CHECK(s->stage != STAGE_READY, "nb_grad_scaler_update: no gradients were checked since "
             "the last update (call nb_grad_scaler_step first)");
    if (s->found_inf) {
        s->scale *= s->backoff;
        s->growth_tracker = 0;
    } else if (++s->growth_tracker >= s->interval) {
        double grown = s->scale * s->growth;
        if (isfinite(grown)) s->scale = grown;
        s->growth_tracker = 0;
    }
    s->stage = STAGE_READY;
    s->found_inf = false;
}
