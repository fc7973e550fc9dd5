/* Global gradient-norm clipping, device-neutral: the norm is one
 * multi-tensor reduction of the gradients' backend (tensor/backend.h) and
 * one host read, the scaling one multi-tensor update.
 *
 * The 2-norm is accumulated in f64 over every gradient as one vector
 * (tensor/cpu/optim.c: eight partial sums in a fixed order; CUDA: one
 * launch), so the result is the same on every run. Sums of squares of f32
 * values cannot overflow a double, but those of large f64 values can:
 * when the 2-norm comes out infinite while every element is finite, it is
 * computed again from copies scaled by the largest magnitude. The
 * infinity norm is the max of |g| (NaN when any is NaN). A non-finite
 * norm leaves the gradients untouched (see nabla/optim.h). Gradients that
 * are not contiguous are read through contiguous copies. Temporaries go
 * into a per-thread, per-device scratch context, reset at each use. */
#include <math.h>
#include <stdlib.h>

#include "optim/internal.h"
#include "tensor/backend.h"
#include "util/handle.h"

enum { MAX_SCRATCH = 16 };

nb_ctx *nb__optim_scratch(nb_device device) {
    static _Thread_local struct {
        nb_device device;
        nb_ctx *ctx;
    } scratch[MAX_SCRATCH];
    static _Thread_local int n_scratch;
    for (int i = 0; i < n_scratch; i++)
        if (nb_device_eq(scratch[i].device, device)) {
            nb_ctx_reset(scratch[i].ctx);
            return scratch[i].ctx;
        }
    NB_CHECK(n_scratch < MAX_SCRATCH, "nb__optim_scratch: more than %d devices in one thread (%s)",
             MAX_SCRATCH, nb_device_name(device));
    scratch[n_scratch].device = device;
    scratch[n_scratch].ctx = nb_ctx_new(device, 1 << 16);
    return scratch[n_scratch++].ctx;
}

/* The k gradients, contiguous, in sc. */
static int grad_list(nb_ctx *sc, const nb_named_tensor *params, int n, nb_tensor **gl) {
    int k = 0;
    for (int i = 0; i < n; i++)
        if (params[i].tensor->grad) gl[k++] = nb__contig(sc, params[i].tensor->grad);
    return k;
}

static double reduce(nb_ctx *sc, int k, nb_tensor *const *gl, bool l2) {
    const nb__backend *be = nb__backend_of(nb_ctx_device(sc));
    nb_tensor *out = nb__empty(sc, NB_F64, 0, NULL);
    if (l2) be->sum_squares(out, k, gl);
    else be->max_abs(sc, out, k, gl);
    return be->meta ? 1e30 : nb_item(out); /* a norm that clips: nabla/meta.h */
}

static double grad_norm(nb_device dev, const nb_named_tensor *params, int n, bool l2) {
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)(n > 0 ? n : 1));
    int k = grad_list(sc, params, n, gl);
    if (!l2) return reduce(sc, k, gl, false);
    double norm = sqrt(reduce(sc, k, gl, true));
    if (!isinf(norm)) return norm;
    double maxabs = reduce(sc, k, gl, false);
    if (isnan(maxabs)) return NAN;
    if (!isfinite(maxabs) || maxabs == 0) return norm;
    for (int i = 0; i < k; i++) gl[i] = nb__unary(sc, NB_U_MUL_S, gl[i], 1.0 / maxabs);
    return maxabs * sqrt(reduce(sc, k, gl, true)); /* may still be inf: a true overflow */
}

/* every gradient *= coef: the contiguous ones in one multi-tensor update */
static void scale_grads(nb_device dev, const nb_named_tensor *params, int n, double coef) {
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)(n > 0 ? n : 1));
    int k = 0;
    for (int i = 0; i < n; i++) {
        nb_tensor *g = params[i].tensor->grad;
        if (!g) continue;
        if (nb_is_contiguous(g)) gl[k++] = g;
        else nb_scale_(g, coef);
    }
    if (k) nb__backend_of(dev)->scale(k, gl, coef);
}

double nb_clip_grad_norm(const nb_named_tensor *params, int n, double max_norm,
                         double norm_type) {
    NB_CHECK(n >= 0 && (n == 0 || params), "nb_clip_grad_norm: bad parameter list (n = %d)", n);
    NB_CHECK(norm_type == 2.0 || (isinf(norm_type) && norm_type > 0),
             "nb_clip_grad_norm: norm_type = %g; supported are 2 and INFINITY", norm_type);
    NB_CHECK(max_norm >= 0 && !isnan(max_norm),
             "nb_clip_grad_norm: max_norm = %g must be >= 0", max_norm);
    nb_device dev = nb_cpu();
    bool first = true;
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = params[i].tensor;
        NB_CHECK(t, "nb_clip_grad_norm: parameter %d is NULL", i);
        if (t->grad) {
            nb__check_float("nb_clip_grad_norm", t->grad);
            NB_CHECK(first || nb_device_eq(dev, t->grad->device),
                     "nb_clip_grad_norm: gradients on %s and %s; all must be on one device",
                     nb_device_name(dev), nb_device_name(t->grad->device));
            dev = t->grad->device;
            first = false;
        }
    }
    double norm = grad_norm(dev, params, n, norm_type == 2.0);
    if (!isfinite(norm)) return norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) scale_grads(dev, params, n, coef);
    return norm;
}

double nb_optim_clip_grad_norm(nb_optim *opt, double max_norm, double norm_type) {
    NB__CHECK_HANDLE("nb_optim_clip_grad_norm", opt, "optimizer");
    nb__optim_check_not_bucket_stepped(opt, "nb_optim_clip_grad_norm");
    nb__optim_check_not_sharded(opt, "nb_optim_clip_grad_norm",
                                "each rank holds only its shard of the averaged gradients; clip "
                                "with nb_ddp_clip_grad_norm(ddp, ...)");
    nb_named_tensor *list = malloc(sizeof *list * (size_t)opt->n_params);
    NB_CHECK(list, "nb_optim_clip_grad_norm: out of memory");
    for (int i = 0; i < opt->n_params; i++) {
        list[i].name = opt->params[i].name;
        list[i].tensor = opt->params[i].param;
    }
    double norm = nb_clip_grad_norm(list, opt->n_params, max_norm, norm_type);
    free(list);
    return norm;
}
