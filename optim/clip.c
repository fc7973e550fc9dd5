/* Global gradient-norm clipping, device-neutral: the norm is one
 * multi-tensor reduction of the gradients' backend (tensor/backend.h), the
 * scaling one multi-tensor update by a coefficient formed on the device
 * (Note [Clipping without a host read]).
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
 * into a per-thread, per-device scratch context, reset at each use.
 *
 * Note [Clipping without a host read]
 * Reading the norm on the host (nb_item) mid-step makes the host wait for
 * the whole backward on a GPU before it can queue the clip's scaling and
 * the optimizer's step, and the device then idles while they are queued.
 * So when every gradient is f32 and contiguous, the norm is formed on the
 * gradients' device and stays there (a 0-d f64 tensor: a sum of squares,
 * then its square root; or the max |g|), and the scaling takes its
 * coefficient from it where it lives (the backend's clip_scale: coef =
 * max_norm / (norm + 1e-6) in double, applied when below 1 and the norm is
 * finite), so nothing waits: nb_clip_grad_norm_tensor returns that tensor,
 * and its value is read only when the caller asks (nb_item, which waits).
 * nb_clip_grad_norm reads it once, after the scaling is queued. The
 * arithmetic is the host path's, so results are bitwise the same. f64
 * gradients (whose sum of squares can overflow and is then formed again
 * from scaled copies), 16-bit and non-contiguous ones keep the host path. */
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
    return be->meta ? 1e15 : nb_item(out); /* a norm that clips: nabla/meta.h */
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

/* The checks; the gradients' device, and whether they can stay there
 * (Note [Clipping without a host read]: all f32 and contiguous). */
static nb_device check_args(const char *fn, const nb_named_tensor *params, int n, double max_norm,
                            double norm_type, bool *on_device) {
    NB_CHECK(n >= 0 && (n == 0 || params), "%s: bad parameter list (n = %d)", fn, n);
    NB_CHECK(norm_type == 2.0 || (isinf(norm_type) && norm_type > 0),
             "%s: norm_type = %g; supported are 2 and INFINITY", fn, norm_type);
    NB_CHECK(max_norm >= 0 && !isnan(max_norm), "%s: max_norm = %g must be >= 0", fn, max_norm);
    nb_device dev = nb_cpu();
    bool first = true;
    *on_device = true;
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = params[i].tensor;
        NB_CHECK(t, "%s: parameter %d is NULL", fn, i);
        if (t->grad) {
            nb__check_float(fn, t->grad);
            NB_CHECK(first || nb_device_eq(dev, t->grad->device),
                     "%s: gradients on %s and %s; all must be on one device", fn,
                     nb_device_name(dev), nb_device_name(t->grad->device));
            dev = t->grad->device;
            first = false;
            *on_device &= t->grad->dtype == NB_F32 && nb_is_contiguous(t->grad);
        }
    }
    return dev;
}

/* Note [Clipping without a host read]: the norm (0-d f64, in ctx) queued,
 * nothing read; *k receives the gradients' count, gl them (when not NULL). */
static nb_tensor *norm_on_device(nb_ctx *ctx, nb_device dev, const nb_named_tensor *params, int n,
                                 bool l2, nb_tensor ***gl_out, int *k_out) {
    const nb__backend *be = nb__backend_of(dev);
    nb_tensor **gl = nb__ctx_meta(ctx, sizeof *gl * (size_t)(n > 0 ? n : 1));
    int k = 0;
    for (int i = 0; i < n; i++)
        if (params[i].tensor->grad) gl[k++] = params[i].tensor->grad;
    nb_tensor *norm = nb__empty(ctx, NB_F64, 0, NULL);
    if (l2) {
        be->sum_squares(norm, k, gl);
        nb__run_unary(NB_U_SQRT, norm, norm, 0);
    } else {
        be->max_abs(ctx, norm, k, gl);
    }
    if (gl_out) *gl_out = gl;
    if (k_out) *k_out = k;
    return norm;
}

/* the norm and the scaling queued, nothing read */
static nb_tensor *clip_on_device(nb_ctx *ctx, nb_device dev, const nb_named_tensor *params, int n,
                                 double max_norm, bool l2) {
    nb_tensor **gl;
    int k;
    nb_tensor *norm = norm_on_device(ctx, dev, params, n, l2, &gl, &k);
    if (k) nb__backend_of(dev)->clip_scale(k, gl, norm, max_norm);
    return norm;
}

/* the host path: the norm read, then the scaling */
static double clip_on_host(nb_device dev, const nb_named_tensor *params, int n, double max_norm,
                           bool l2) {
    double norm = grad_norm(dev, params, n, l2);
    if (!isfinite(norm)) return norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) scale_grads(dev, params, n, coef);
    return norm;
}

double nb_clip_grad_norm(const nb_named_tensor *params, int n, double max_norm,
                         double norm_type) {
    bool on_device;
    nb_device dev = check_args("nb_clip_grad_norm", params, n, max_norm, norm_type, &on_device);
    if (!on_device) return clip_on_host(dev, params, n, max_norm, norm_type == 2.0);
    nb_tensor *norm = clip_on_device(nb__optim_scratch(dev), dev, params, n, max_norm, norm_type == 2.0);
    return nb__backend_of(dev)->meta ? 1e15 : nb_item(norm); /* a norm that clips: nabla/meta.h */
}

nb_tensor *nb_clip_grad_norm_tensor(nb_ctx *ctx, const nb_named_tensor *params, int n,
                                    double max_norm, double norm_type) {
    const char *fn = "nb_clip_grad_norm_tensor";
    NB_CHECK(ctx, "%s: NULL context", fn);
    bool on_device;
    nb_device dev = check_args(fn, params, n, max_norm, norm_type, &on_device);
    if (!on_device) { /* the host path, its norm made a tensor */
        double v = clip_on_host(dev, params, n, max_norm, norm_type == 2.0);
        return nb_from_host(ctx, NB_F64, 0, NULL, &v);
    }
    bool any = false;
    for (int i = 0; i < n && !any; i++) any = params[i].tensor->grad != NULL;
    if (!any) dev = nb_ctx_device(ctx); /* no gradient: the norm is 0 */
    NB_CHECK(nb_device_eq(nb_ctx_device(ctx), dev),
             "%s: the context is on %s, the gradients on %s", fn,
             nb_device_name(nb_ctx_device(ctx)), nb_device_name(dev));
    return clip_on_device(ctx, dev, params, n, max_norm, norm_type == 2.0);
}

/* the optimizer's parameters as a list (malloc'ed) */
static nb_named_tensor *optim_list(nb_optim *opt, const char *fn) {
    NB__CHECK_HANDLE(fn, opt, "optimizer");
    nb__optim_check_not_bucket_stepped(opt, fn);
    nb__optim_check_not_sharded(opt, fn,
                                "each rank holds only its shard of the averaged gradients; clip "
                                "with nb_ddp_clip_grad_norm(ddp, ...)");
    nb_named_tensor *list = malloc(sizeof *list * (size_t)(opt->n_params ? opt->n_params : 1));
    NB_CHECK(list, "%s: out of memory", fn);
    for (int i = 0; i < opt->n_params; i++) {
        list[i].name = opt->params[i].name;
        list[i].tensor = opt->params[i].param;
    }
    return list;
}

double nb_optim_clip_grad_norm(nb_optim *opt, double max_norm, double norm_type) {
    nb_named_tensor *list = optim_list(opt, "nb_optim_clip_grad_norm");
    double norm = nb_clip_grad_norm(list, opt->n_params, max_norm, norm_type);
    free(list);
    return norm;
}

nb_tensor *nb_optim_clip_grad_norm_tensor(nb_optim *opt, nb_ctx *ctx, double max_norm,
                                          double norm_type) {
    nb_named_tensor *list = optim_list(opt, "nb_optim_clip_grad_norm_tensor");
    nb_tensor *norm = nb_clip_grad_norm_tensor(ctx, list, opt->n_params, max_norm, norm_type);
    free(list);
    return norm;
}

/* Note [Clipping inside the step]
 * Clipping then stepping reads and writes every gradient once more than
 * the step alone (clip_scale's pass: a read and a write of 4 bytes per
 * parameter, 1 GB a step for GPT-2 small) and launches for it. So
 * nb_optim_step_clipped hands the norm to the update itself
 * (nb__update_extras in tensor/backend.h): each kernel forms the
 * coefficient from the norm where it lives, exactly as clip_scale does
 * (max_norm / (norm + 1e-6) in double, applied when below 1), and reads
 * each gradient element as clip_scale would have written it, (g * coef)
 * rounded, so the parameters and state are bit for bit those of the two
 * passes; the gradients stay unscaled. A norm that is not finite makes
 * every block of the update return at once (the step skipped on the
 * device), and the caller who reads it takes the host's step counts back
 * with nb_optim_unstep. On the CPU the norm is host memory and the update
 * reads a scaled copy of each piece of a gradient. */
nb_tensor *nb_optim_step_clipped(nb_optim *opt, nb_ctx *ctx, double max_norm, double norm_type) {
    const char *fn = "nb_optim_step_clipped";
    NB_CHECK(ctx, "%s: NULL context", fn);
    nb_named_tensor *list = optim_list(opt, fn);
    bool on_device;
    nb_device dev = check_args(fn, list, opt->n_params, max_norm, norm_type, &on_device);
    bool any = false;
    for (int i = 0; i < opt->n_params && !any; i++) any = list[i].tensor->grad != NULL;
    if (!any) dev = nb_ctx_device(ctx);
    if (!on_device) { /* the host path */
        opt->n_counted = -1;
        double v = clip_on_host(dev, list, opt->n_params, max_norm, norm_type == 2.0);
        free(list);
        if (isfinite(v)) nb_optim_step(opt);
        return nb_from_host(ctx, NB_F64, 0, NULL, &v);
    }
    NB_CHECK(nb_device_eq(nb_ctx_device(ctx), dev), "%s: the context is on %s, the gradients on %s",
             fn, nb_device_name(nb_ctx_device(ctx)), nb_device_name(dev));
    nb_tensor *norm = norm_on_device(ctx, dev, list, opt->n_params, norm_type == 2.0, NULL, NULL);
    free(list);
    nb__optim_step_extras(opt, &(nb__update_extras){.clip_norm = norm, .max_norm = max_norm}, true);
    return norm;
}
