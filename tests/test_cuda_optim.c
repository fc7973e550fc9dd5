/* The optimizers on CUDA against the CPU: Adam, AdamW (with and without
 * amsgrad) and SGD (momentum, dampening, Nesterov, weight decay) over
 * several parameters of odd sizes
 * in two groups, with a parameter that gets its first gradient late (its
 * own step count), f32 and f64, N steps; the exported state; zero_grad;
 * gradient clipping (2-norm, inf-norm, non-finite norms); the grad scaler.
 * Skipped (77) without CUDA or a GPU.
 *
 * The CUDA kernels do the CPU's operations in the same order without FMA
 * contraction, so the results are expected to be bit-identical; the test
 * asserts a tight tolerance and prints how many elements differ at all. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_parity.h"
#include "tensor/internal.h" /* nb__grad_slot: the shadow */
#include "testutil.h"

#define NP 5
static const int64_t sizes[NP] = {1, 7, 1000, 4099, 3};
#define LATE 4 /* the parameter whose gradient appears at step 3 */

typedef struct side {
    nb_ctx *ctx, *scratch;
    nb_tensor *p[NP];
    nb_named_tensor named[NP];
} side;

static double init_value(int k, int64_t i) { return sin(1.3 * (double)i + k) * (1 + 0.1 * k); }
static double grad_value(int k, int64_t i, int t) {
    return cos(0.7 * (double)i + 0.3 * t + k) * (t % 2 ? 1.0 : 0.25) + 0.01 * k;
}

/* t = v (host doubles), through a tensor made on t's device */
static void set_values(nb_ctx *scratch, nb_tensor *t, const double *v) {
    nb_copy_(t, nb_from_host(scratch, NB_F64, t->ndim, t->shape, v));
}

static void side_init(side *s, nb_device dev, nb_dtype dt) {
    static const char *names[NP] = {"a", "b", "c", "d", "late"};
    s->ctx = nb_ctx_new(dev, 0);
    s->scratch = nb_ctx_new(dev, 0);
    double *v = malloc(sizeof *v * 4099);
    for (int k = 0; k < NP; k++) {
        for (int64_t i = 0; i < sizes[k]; i++) v[i] = init_value(k, i);
        s->p[k] = nb_zeros(s->ctx, dt, 1, &sizes[k]);
        set_values(s->scratch, s->p[k], v);
        nb_set_requires_grad(s->p[k], true);
        if (k != LATE) nb_set_grad(s->p[k], nb_zeros_like(s->ctx, s->p[k]));
        s->named[k] = (nb_named_tensor){names[k], s->p[k]};
    }
    free(v);
}

static void side_set_grads(side *s, int t) {
    double *v = malloc(sizeof *v * 4099);
    nb_ctx_reset(s->scratch);
    for (int k = 0; k < NP; k++) {
        if (k == LATE && t < 3) continue;
        if (!s->p[k]->grad) nb_set_grad(s->p[k], nb_zeros_like(s->ctx, s->p[k]));
        for (int64_t i = 0; i < sizes[k]; i++) v[i] = grad_value(k, i, t);
        set_values(s->scratch, s->p[k]->grad, v);
    }
    free(v);
}

static void side_free(side *s) {
    nb_ctx_free(s->scratch);
    nb_ctx_free(s->ctx);
}

/* max |a - b| / max(max |b|, 1e-30) <= tol; prints the count of elements not bitwise equal */
static void compare(const char *what, const nb_tensor *a, const nb_tensor *b, double tol) {
    ck_assert_int_eq(nb_numel(a), nb_numel(b));
    double *va = nbt_values(a), *vb = nbt_values(b), err = 0, scale = 1e-30;
    int64_t n = nb_numel(a), differ = 0;
    for (int64_t i = 0; i < n; i++) {
        err = fmax(err, fabs(va[i] - vb[i]));
        scale = fmax(scale, fabs(vb[i]));
        differ += va[i] != vb[i];
        ck_assert_msg(!isnan(va[i]) && !isnan(vb[i]), "%s: NaN at %lld", what, (long long)i);
    }
    free(va);
    free(vb);
    if (differ) printf("%s: %lld of %lld elements differ from the CPU's\n", what, (long long)differ,
                       (long long)n);
    ck_assert_msg(err / scale <= tol, "%s: normalised error %g > %g", what, err / scale, tol);
}

static void run_optim_case(const char *name, nb_optim_kind kind, nb_optim_hparams h, nb_dtype dt) {
    side cs, gs;
    side_init(&cs, nb_cpu(), dt);
    side_init(&gs, nbt_device(), dt);
    nb_optim *opt[2];
    side *sides[2] = {&cs, &gs};
    for (int k = 0; k < 2; k++) {
        nb_optim_hparams h1 = h;
        h1.lr = h.lr * 0.5;
        h1.weight_decay = 0;
        /* AdamW with amsgrad: in group 0 only, so one launch mixes both updates */
        if (kind == NB_OPTIM_ADAMW) h1.amsgrad = false;
        nb_param_group groups[2] = {{sides[k]->named, 3, h}, {sides[k]->named + 3, NP - 3, h1}};
        opt[k] = nb_optim_new_groups(kind, 2, groups);
    }
    const int T = 6;
    for (int t = 1; t <= T; t++)
        for (int k = 0; k < 2; k++) {
            side_set_grads(sides[k], t);
            nb_optim_step(opt[k]);
        }
    double tol = dt == NB_F32 ? 1e-6 : 1e-13;
    char what[160];
    for (int k = 0; k < NP; k++) {
        snprintf(what, sizeof what, "%s %s: parameter %s", name, nb_dtype_name(dt),
                 cs.named[k].name);
        compare(what, gs.p[k], cs.p[k], tol);
    }
    int nc = 0, ng = 0;
    const nb_named_tensor *sc = nb_optim_state(opt[0], &nc), *sg = nb_optim_state(opt[1], &ng);
    ck_assert_int_eq(nc, ng);
    for (int i = 0; i < nc; i++) {
        ck_assert_str_eq(sc[i].name, sg[i].name);
        ck_assert(sg[i].tensor->dtype == sc[i].tensor->dtype);
        snprintf(what, sizeof what, "%s %s: state %s", name, nb_dtype_name(dt), sg[i].name);
        if (sg[i].tensor->dtype == NB_I64 || sg[i].tensor->ndim == 0) {
            /* step counts and hyperparameters stay on the host */
            ck_assert_msg(sg[i].tensor->device.type == NB_DEVICE_CPU, "%s is on %s", what,
                          nb_device_name(sg[i].tensor->device));
            ck_assert_msg(nb_item(sg[i].tensor) == nb_item(sc[i].tensor), "%s: %g vs %g", what,
                          nb_item(sg[i].tensor), nb_item(sc[i].tensor));
        } else {
            ck_assert(nb_device_eq(sg[i].tensor->device, nb_ctx_device(gs.ctx)));
            compare(what, sg[i].tensor, sc[i].tensor, tol);
        }
    }
    ck_assert_int_eq(nb_optim_step_count(opt[1]), T);
    if (h.amsgrad) { /* the maximum mattered: exp_avg_sq fell below it somewhere */
        int64_t below = 0;
        for (int i = 0; i + 1 < nc; i++)
            if (strstr(sc[i + 1].name, ".max_exp_avg_sq")) {
                double *v = nbt_values(sc[i].tensor), *vmax = nbt_values(sc[i + 1].tensor);
                for (int64_t j = 0; j < nb_numel(sc[i].tensor); j++) below += v[j] < vmax[j];
                free(v);
                free(vmax);
            }
        ck_assert_msg(below > 0, "%s: exp_avg_sq never fell below max_exp_avg_sq", name);
    }
    /* zero_grad on the device */
    nb_optim_zero_grad(opt[1]);
    for (int k = 0; k < NP; k++) {
        double *v = nbt_values(gs.p[k]->grad);
        for (int64_t i = 0; i < sizes[k]; i++) ck_assert(v[i] == 0);
        free(v);
    }
    nb_optim_free(opt[0]);
    nb_optim_free(opt[1]);
    side_free(&gs);
    side_free(&cs);
}

START_TEST(test_adam_adamw_sgd) {
    const nb_dtype dts[] = {NB_F32, NB_F64};
    for (int d = 0; d < 2; d++) {
        nb_dtype dt = dts[d];
        nb_optim_hparams adam = NB_ADAM_DEFAULTS;
        adam.lr = 0.01;
        run_optim_case("adam", NB_OPTIM_ADAM, adam, dt);
        adam.weight_decay = 0.1;
        run_optim_case("adam + L2", NB_OPTIM_ADAM, adam, dt);
        nb_optim_hparams adamw = NB_ADAMW_DEFAULTS;
        adamw.lr = 0.02;
        adamw.weight_decay = 0.1;
        run_optim_case("adamw", NB_OPTIM_ADAMW, adamw, dt);
        adamw.beta1 = 0.3; /* lerp with weight >= 0.5 */
        run_optim_case("adamw beta1 0.3", NB_OPTIM_ADAMW, adamw, dt);
        /* a short memory, so that v falls below its maximum (gradients alternate in size) */
        adam.beta2 = 0.5;
        adam.amsgrad = true;
        run_optim_case("adam amsgrad + L2", NB_OPTIM_ADAM, adam, dt);
        adamw.beta2 = 0.5;
        adamw.amsgrad = true;
        run_optim_case("adamw amsgrad (group 0)", NB_OPTIM_ADAMW, adamw, dt);
        run_optim_case("sgd", NB_OPTIM_SGD, (nb_optim_hparams){.lr = 0.1}, dt);
        run_optim_case("sgd momentum", NB_OPTIM_SGD,
                       (nb_optim_hparams){.lr = 0.05, .momentum = 0.9, .dampening = 0.2}, dt);
        run_optim_case("sgd nesterov + wd", NB_OPTIM_SGD,
                       (nb_optim_hparams){.lr = 0.05, .momentum = 0.9, .nesterov = true,
                                          .weight_decay = 0.01},
                       dt);
        run_optim_case("sgd wd", NB_OPTIM_SGD, (nb_optim_hparams){.lr = 0.1, .weight_decay = 0.3},
                       dt);
    }
}
END_TEST

/* ---- clipping ---- */
START_TEST(test_clip_grad_norm) {
    const nb_dtype dts[] = {NB_F32, NB_F64};
    const double norm_types[] = {2.0, INFINITY};
    for (int d = 0; d < 2; d++)
        for (int nt = 0; nt < 2; nt++) {
            side cs, gs;
            side_init(&cs, nb_cpu(), dts[d]);
            side_init(&gs, nbt_device(), dts[d]);
            side_set_grads(&cs, 3);
            side_set_grads(&gs, 3);
            double nc = nb_clip_grad_norm(cs.named, NP, 1e9, norm_types[nt]);
            double ng = nb_clip_grad_norm(gs.named, NP, 1e9, norm_types[nt]);
            ck_assert_msg(fabs(nc - ng) <= 1e-12 * nc, "norm %.17g vs CPU %.17g", ng, nc);
            for (int k = 0; k < NP; k++)
                compare("unclipped gradient", gs.p[k]->grad, cs.p[k]->grad, 0);
            nc = nb_clip_grad_norm(cs.named, NP, 0.5, norm_types[nt]);
            ng = nb_clip_grad_norm(gs.named, NP, 0.5, norm_types[nt]);
            ck_assert_msg(fabs(nc - ng) <= 1e-12 * nc, "norm %.17g vs CPU %.17g", ng, nc);
            for (int k = 0; k < NP; k++)
                /* f64: the clip coefficient carries the norm's error, allowed 1e-12 above
                 * (the GPU sums the squares in another order than the CPU) */
                compare("clipped gradient", gs.p[k]->grad, cs.p[k]->grad,
                        dts[d] == NB_F32 ? 1e-6 : 1e-12);
            /* the norm left on the device (f32: the clip_scale kernel), clipped again */
            nb_tensor *tg = nb_clip_grad_norm_tensor(gs.scratch, gs.named, NP, 0.25, norm_types[nt]);
            nb_tensor *tc = nb_clip_grad_norm_tensor(cs.scratch, cs.named, NP, 0.25, norm_types[nt]);
            ck_assert(nb_device_eq(tg->device, nbt_device()) && tg->dtype == NB_F64);
            nc = nb_item(tc);
            ng = nb_item(tg);
            ck_assert_msg(fabs(nc - ng) <= 1e-12 * nc, "tensor norm %.17g vs CPU %.17g", ng, nc);
            for (int k = 0; k < NP; k++)
                compare("clipped gradient (norm on the device)", gs.p[k]->grad, cs.p[k]->grad,
                        dts[d] == NB_F32 ? 1e-6 : 1e-12);
            /* non-finite: the norm says so and the gradients stay as they were */
            const double bad[] = {INFINITY, NAN};
            for (int b = 0; b < 2; b++) {
                side_set_grads(&gs, 4);
                side_set_grads(&cs, 4);
                int64_t n = sizes[2];
                double *v = nbt_values(gs.p[2]->grad);
                v[n / 2] = bad[b];
                set_values(gs.scratch, gs.p[2]->grad, v);
                free(v);
                double r = nb_clip_grad_norm(gs.named, NP, 0.5, norm_types[nt]);
                ck_assert_msg(b == 0 ? isinf(r) : isnan(r), "norm %g", r);
                for (int k = 0; k < NP; k++)
                    if (k != 2) compare("untouched gradient", gs.p[k]->grad, cs.p[k]->grad, 0);
            }
            side_free(&gs);
            side_free(&cs);
        }
}
END_TEST

/* The clip inside the step (nb_optim_step_clipped): the update reads the
 * clipped gradients on both devices (the coefficient carries the norm's
 * rounding, the GPU summing in another order), the gradients stay as they
 * were, a NaN norm updates nothing. */
START_TEST(test_step_clipped_cuda) {
    side cs, gs;
    side_init(&cs, nb_cpu(), NB_F32);
    side_init(&gs, nbt_device(), NB_F32);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *oc = nb_optim_new(NB_OPTIM_ADAMW, cs.named, NP, &h);
    nb_optim *og = nb_optim_new(NB_OPTIM_ADAMW, gs.named, NP, &h);
    for (int t = 1; t <= 4; t++) {
        side_set_grads(&cs, t);
        side_set_grads(&gs, t);
        double max_norm = t % 2 ? 0.5 : 1e9;
        double nc = nb_item(nb_optim_step_clipped(oc, cs.scratch, max_norm, 2.0));
        double ng = nb_item(nb_optim_step_clipped(og, gs.scratch, max_norm, 2.0));
        ck_assert_msg(fabs(nc - ng) <= 1e-12 * nc, "norm %.17g vs CPU %.17g", ng, nc);
        for (int k = 0; k < NP; k++) {
            compare("parameter after the clipped step", gs.p[k], cs.p[k], 1e-6);
            if (gs.p[k]->grad) compare("gradient (not scaled)", gs.p[k]->grad, cs.p[k]->grad, 0);
        }
    }
    side_set_grads(&gs, 5);
    double *v = nbt_values(gs.p[2]->grad);
    v[3] = NAN;
    set_values(gs.scratch, gs.p[2]->grad, v);
    free(v);
    ck_assert(isnan(nb_item(nb_optim_step_clipped(og, gs.scratch, 0.5, 2.0))));
    nb_optim_unstep(og);
    for (int k = 0; k < NP; k++) compare("parameter after a skipped step", gs.p[k], cs.p[k], 1e-6);
    nb_optim_free(oc);
    nb_optim_free(og);
    side_free(&gs);
    side_free(&cs);
}
END_TEST

/* Note [Parameter shadows] on the GPU: the bf16 shadow the update writes
 * holds the bits nb_cast makes of the updated parameter. */
START_TEST(test_shadows_cuda) {
    nb_ctx *ctx = nb_ctx_new(nbt_device(), 0), *step = nb_ctx_new(nbt_device(), 0);
    nb_ctx_set_compute_dtype(step, NB_BF16);
    nb_tensor *w = nb_rand_normal(ctx, NB_F32, NB_SHAPE(40, 24), 0, 1, NULL);
    nb_set_requires_grad(w, true);
    nb_tensor *x = nb_rand_normal(ctx, NB_F32, NB_SHAPE(8, 40), 0, 1, NULL);
    nb_named_tensor p = {"w", w};
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, &p, 1, &h);
    for (int t = 0; t < 3; t++) {
        nb_ctx_reset(step);
        nb_tensor *y = nb_matmul(step, x, w);
        nb_backward(nb_sum_all(step, nb_mul(step, y, y)));
        nb_optim_step(opt);
        nb_optim_zero_grad(opt);
        ck_assert(w->priv->grad_slot && w->priv->grad_slot->shadow);
        uint16_t a[40 * 24], b[40 * 24];
        nb_to_host(w->priv->grad_slot->shadow, a);
        nb_to_host(nb_cast(step, w, NB_BF16), b);
        ck_assert_msg(memcmp(a, b, sizeof a) == 0, "step %d: the shadow is not the cast", t);
    }
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(ctx);
}
END_TEST

/* ---- grad scaler ---- */
START_TEST(test_grad_scaler_cuda) {
    side cs, gs;
    side_init(&cs, nb_cpu(), NB_F32);
    side_init(&gs, nbt_device(), NB_F32);
    nb_optim_hparams h = {.lr = 0.1, .momentum = 0.9};
    nb_optim *oc = nb_optim_new(NB_OPTIM_SGD, cs.named, NP, &h);
    nb_optim *og = nb_optim_new(NB_OPTIM_SGD, gs.named, NP, &h);
    nb_grad_scaler *sc = nb_grad_scaler_new(1024.0, 2.0, 0.5, 2);
    for (int t = 1; t <= 5; t++) {
        side_set_grads(&cs, t);
        side_set_grads(&gs, t);
        for (int k = 0; k < NP; k++)
            if (gs.p[k]->grad) nb_scale_(gs.p[k]->grad, nb_grad_scaler_get_scale(sc));
        bool inject = t == 3;
        if (inject) {
            double *v = nbt_values(gs.p[3]->grad);
            v[100] = INFINITY;
            set_values(gs.scratch, gs.p[3]->grad, v);
            free(v);
        }
        double before = nb_grad_scaler_get_scale(sc);
        bool stepped = nb_grad_scaler_step(sc, og);
        ck_assert_msg(stepped == !inject, "step %d: stepped = %d", t, stepped);
        if (!inject) {
            for (int k = 0; k < NP; k++)
                if (gs.p[k]->grad) compare("unscaled gradient", gs.p[k]->grad, cs.p[k]->grad, 0);
            nb_optim_step(oc);
        }
        nb_grad_scaler_update(sc);
        double expect = inject ? before * 0.5 : (t == 2 || t == 5) ? before * 2 : before;
        ck_assert_msg(nb_grad_scaler_get_scale(sc) == expect, "step %d: scale %g, expected %g", t,
                      nb_grad_scaler_get_scale(sc), expect);
    }
    for (int k = 0; k < NP; k++) compare("parameter after scaled steps", gs.p[k], cs.p[k], 1e-6);
    /* the scaled loss: unscaled gradients equal the plain ones */
    nb_ctx *step = nb_ctx_new(nbt_device(), 0);
    nb_tensor *x = nb_rand_normal(step, NB_F32, 1, &sizes[3], 0, 1, &(nb_rng){3, 0});
    nb_optim_zero_grad(og);
    nb_backward(nb_sum_all(step, nb_mul(step, nb_tanh(step, gs.p[3]), x)));
    double *plain = nbt_values(gs.p[3]->grad);
    nb_optim_zero_grad(og);
    nb_tensor *loss = nb_sum_all(step, nb_mul(step, nb_tanh(step, gs.p[3]), x));
    nb_backward(nb_grad_scaler_scale(sc, step, loss));
    nb_grad_scaler_unscale(sc, og);
    double *unscaled = nbt_values(gs.p[3]->grad);
    for (int64_t i = 0; i < sizes[3]; i++)
        ck_assert_msg(plain[i] == unscaled[i], "element %lld: %g vs %g", (long long)i, unscaled[i],
                      plain[i]);
    free(plain);
    free(unscaled);
    nb_ctx_free(step);
    nb_grad_scaler_free(sc);
    nb_optim_free(og);
    nb_optim_free(oc);
    side_free(&gs);
    side_free(&cs);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    setenv("CK_FORK", "no", 1);
    Suite *s = suite_create("cuda_optim");
    TCase *tc = nbt_tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_adam_adamw_sgd);
    tcase_add_test(tc, test_clip_grad_norm);
    tcase_add_test(tc, test_step_clipped_cuda);
    tcase_add_test(tc, test_shadows_cuda);
    tcase_add_test(tc, test_grad_scaler_cuda);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}
