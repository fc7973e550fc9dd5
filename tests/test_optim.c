/* Optimizers, parameter groups, schedules and clipping.
 *
 * Updates are checked two ways: against closed forms (a constant gradient
 * makes SGD's momentum a geometric series and Adam's step lr g/(|g|+eps))
 * and against a textbook recurrence written here in double with varying
 * gradients (m_hat / (sqrt(v_hat) + eps) rather than the library's
 * factored form). AMSGrad likewise, with gradients that shrink so that the
 * second moment falls below its running maximum, and a checkpoint resume. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensor/internal.h"
#include "testutil.h"

#define N 6

/* A 1-D f64 or f32 leaf of n elements with a zero gradient buffer. */
static nb_tensor *leaf_with_grad(nb_ctx *ctx, nb_dtype dtype, int64_t n, uint64_t seed) {
    nb_tensor *p = nbt_randn_leaf(ctx, dtype, 1, &n, seed);
    nb_set_grad(p, nb_zeros_like(ctx, p));
    return p;
}

static double get1(const nb_tensor *t, int64_t i) { return nb_get(t, &i); }
static void set1(nb_tensor *t, int64_t i, double v) { nb_set(t, &i, v); }

/* gradient at step t (1-based) of element i, the same in every test */
static double grad_at(int t, int64_t i) { return sin(0.9 * (double)i + 0.7 * t) + 0.1 * (double)i; }

/* ---- SGD ---- */
typedef struct sgd_case {
    double lr, momentum, dampening, wd;
    bool nesterov;
} sgd_case;

/* p_T after T steps with constant gradient c, from the closed forms. */
static double sgd_closed_form(sgd_case k, double p0, double c, int T) {
    double mu = k.momentum, p = p0;
    if (k.wd != 0) { /* plain SGD with L2: p_t = r p_{t-1} - lr c */
        double r = 1 - k.lr * k.wd;
        return pow(r, T) * p0 - k.lr * c * (1 - pow(r, T)) / (1 - r);
    }
    for (int t = 1; t <= T; t++) {
        /* buf_t = mu^(t-1) c + (1 - dampening) c (1 - mu^(t-1)) / (1 - mu) */
        double buf = mu == 0 ? c
                             : pow(mu, t - 1) * c +
                                   (1 - k.dampening) * c * (1 - pow(mu, t - 1)) / (1 - mu);
        double d = k.nesterov ? c + mu * buf : buf;
        p -= k.lr * d;
    }
    return p;
}

START_TEST(test_sgd_closed_form) {
    sgd_case cases[] = {
        {0.1, 0, 0, 0, false},    {0.05, 0.9, 0, 0, false}, {0.05, 0.8, 0.3, 0, false},
        {0.05, 0.9, 0, 0, true},  {0.1, 0, 0, 0.2, false},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
        nb_tensor *p = leaf_with_grad(ctx, NB_F64, N, 10 + k);
        double p0[N], c[N];
        for (int i = 0; i < N; i++) {
            p0[i] = get1(p, i);
            c[i] = 0.5 - 0.3 * i;
            set1(p->grad, i, c[i]);
        }
        nb_optim_hparams h = NB_SGD_DEFAULTS;
        h.lr = cases[k].lr;
        h.momentum = cases[k].momentum;
        h.dampening = cases[k].dampening;
        h.weight_decay = cases[k].wd;
        h.nesterov = cases[k].nesterov;
        nb_named_tensor np = {"p", p};
        nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, &np, 1, &h);
        const int T = 7;
        for (int t = 0; t < T; t++) nb_optim_step(opt);
        double expect[N];
        for (int i = 0; i < N; i++) expect[i] = sgd_closed_form(cases[k], p0[i], c[i], T);
        nbt_assert_close(p, expect, 1e-13, 1e-12);
        ck_assert_int_eq(nb_optim_step_count(opt), T);
        nb_optim_free(opt);
        nb_ctx_free(ctx);
    }
}
END_TEST

/* Textbook SGD in double with the gradients of grad_at. */
static void sgd_reference(sgd_case k, double *p, int n, int T) {
    double buf[N] = {0};
    for (int t = 1; t <= T; t++)
        for (int i = 0; i < n; i++) {
            double d = grad_at(t, i) + k.wd * p[i];
            if (k.momentum != 0) {
                buf[i] = t == 1 ? d : k.momentum * buf[i] + (1 - k.dampening) * d;
                d = k.nesterov ? d + k.momentum * buf[i] : buf[i];
            }
            p[i] -= k.lr * d;
        }
}

START_TEST(test_sgd_reference) {
    sgd_case cases[] = {{0.1, 0.9, 0.1, 0.01, false}, {0.03, 0.95, 0, 0.05, true},
                        {0.2, 0, 0, 0.1, false}};
    nb_dtype dtypes[] = {NB_F64, NB_F32};
    for (size_t k = 0; k < 3; k++)
        for (int di = 0; di < 2; di++) {
            nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
            nb_tensor *p = leaf_with_grad(ctx, dtypes[di], N, 20 + k);
            double ref[N];
            for (int i = 0; i < N; i++) ref[i] = get1(p, i);
            nb_optim_hparams h = {.lr = cases[k].lr, .momentum = cases[k].momentum,
                                  .dampening = cases[k].dampening,
                                  .weight_decay = cases[k].wd, .nesterov = cases[k].nesterov};
            nb_named_tensor np = {"p", p};
            nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, &np, 1, &h);
            const int T = 6;
            for (int t = 1; t <= T; t++) {
                for (int i = 0; i < N; i++) set1(p->grad, i, grad_at(t, i));
                nb_optim_step(opt);
            }
            sgd_reference(cases[k], ref, N, T);
            if (dtypes[di] == NB_F64) nbt_assert_close(p, ref, 1e-13, 1e-12);
            else nbt_assert_close(p, ref, 1e-5, 1e-5);
            nb_optim_free(opt);
            nb_ctx_free(ctx);
        }
}
END_TEST

/* ---- Adam, AdamW ---- */
START_TEST(test_adam_closed_form) {
    /* constant g: m_hat = g and sqrt(v_hat) = |g| exactly, so every step
     * moves p by lr g / (|g| + eps); AdamW first shrinks p by r = 1 - lr wd. */
    for (int decoupled = 0; decoupled < 2; decoupled++) {
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
        nb_tensor *p = leaf_with_grad(ctx, NB_F64, N, 30);
        double p0[N], g[N];
        for (int i = 0; i < N; i++) {
            p0[i] = get1(p, i);
            g[i] = (i % 2 ? -1.0 : 1.0) * (0.25 + i); /* mixed signs, |g| >> eps */
            set1(p->grad, i, g[i]);
        }
        nb_optim_hparams h = decoupled ? NB_ADAMW_DEFAULTS : NB_ADAM_DEFAULTS;
        h.lr = 0.01;
        h.eps = 1e-3; /* large enough to matter */
        if (decoupled) h.weight_decay = 0.5;
        nb_named_tensor np = {"p", p};
        nb_optim *opt = nb_optim_new(decoupled ? NB_OPTIM_ADAMW : NB_OPTIM_ADAM, &np, 1, &h);
        const int T = 5;
        for (int t = 0; t < T; t++) nb_optim_step(opt);
        double expect[N];
        for (int i = 0; i < N; i++) {
            double a = h.lr * g[i] / (fabs(g[i]) + h.eps);
            double r = 1 - h.lr * h.weight_decay;
            expect[i] = decoupled ? pow(r, T) * p0[i] - a * (1 - pow(r, T)) / (1 - r)
                                  : p0[i] - T * a;
        }
        nbt_assert_close(p, expect, 1e-12, 1e-12);
        nb_optim_free(opt);
        nb_ctx_free(ctx);
    }
}
END_TEST

/* Textbook Adam (AMSGrad when amsgrad) in double, bias corrections on m and
 * v, gradient grad(t, i) at step t: vmax = max(vmax, v), v_hat = vmax / (1
 * - beta2^t) under AMSGrad, v / (1 - beta2^t) without. Counts in
 * *below_max the steps and elements where v fell below vmax; vmax_out, when
 * not NULL, gets vmax. */
static void adam_reference(const nb_optim_hparams *h, bool decoupled, bool amsgrad, double (*grad)(int, int64_t),
                           double *p, double *vmax_out, int *below_max, int T) {
    double m[N] = {0}, v[N] = {0}, vmax[N] = {0};
    *below_max = 0;
    for (int t = 1; t <= T; t++)
        for (int i = 0; i < N; i++) {
            double g = grad(t, i);
            if (decoupled) p[i] -= h->lr * h->weight_decay * p[i];
            else g += h->weight_decay * p[i];
            m[i] = h->beta1 * m[i] + (1 - h->beta1) * g;
            v[i] = h->beta2 * v[i] + (1 - h->beta2) * g * g;
            vmax[i] = v[i] > vmax[i] ? v[i] : vmax[i];
            *below_max += v[i] < vmax[i];
            double mhat = m[i] / (1 - pow(h->beta1, t));
            double vhat = (amsgrad ? vmax[i] : v[i]) / (1 - pow(h->beta2, t));
            p[i] -= h->lr * mhat / (sqrt(vhat) + h->eps);
        }
    if (vmax_out) memcpy(vmax_out, vmax, sizeof vmax);
}

START_TEST(test_adam_reference) {
    nb_dtype dtypes[] = {NB_F64, NB_F32};
    for (int decoupled = 0; decoupled < 2; decoupled++)
        for (int di = 0; di < 2; di++)
            for (int variant = 0; variant < 2; variant++) {
                nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
                nb_tensor *p = leaf_with_grad(ctx, dtypes[di], N, 40 + variant);
                double ref[N];
                for (int i = 0; i < N; i++) ref[i] = get1(p, i);
                nb_optim_hparams h = decoupled ? NB_ADAMW_DEFAULTS : NB_ADAM_DEFAULTS;
                h.lr = 0.02;
                h.weight_decay = 0.1;
                if (variant) { /* beta1 >= 0.5 exercises the other lerp branch */
                    h.beta1 = 0.3;
                    h.beta2 = 0.9;
                    h.eps = 1e-4;
                }
                nb_named_tensor np = {"p", p};
                nb_optim *opt = nb_optim_new(decoupled ? NB_OPTIM_ADAMW : NB_OPTIM_ADAM, &np, 1, &h);
                const int T = 8;
                for (int t = 1; t <= T; t++) {
                    for (int i = 0; i < N; i++) set1(p->grad, i, grad_at(t, i));
                    nb_optim_step(opt);
                }
                int below;
                adam_reference(&h, decoupled, false, grad_at, ref, NULL, &below, T);
                if (dtypes[di] == NB_F64) nbt_assert_close(p, ref, 1e-13, 1e-12);
                else nbt_assert_close(p, ref, 2e-6, 2e-6);
                nb_optim_free(opt);
                nb_ctx_free(ctx);
            }
}
END_TEST

/* ---- AMSGrad ---- */
/* Gradients that first grow, then shrink 5x a step: from step 4 on v falls
 * below the largest v so far, which is what AMSGrad keeps. */
static double amsgrad_grad_at(int t, int64_t i) {
    return grad_at(t, i) * (t <= 3 ? (double)t : 3.0 * pow(0.2, t - 3));
}

static const nb_tensor *state_named(nb_optim *opt, const char *name) {
    int n;
    const nb_named_tensor *st = nb_optim_state(opt, &n);
    for (int i = 0; i < n; i++)
        if (strcmp(st[i].name, name) == 0) return st[i].tensor;
    return NULL;
}

START_TEST(test_amsgrad_reference) {
    nb_dtype dtypes[] = {NB_F64, NB_F32};
    for (int decoupled = 0; decoupled < 2; decoupled++)
        for (int di = 0; di < 2; di++)
            for (int variant = 0; variant < 2; variant++) {
                nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
                nb_tensor *p = leaf_with_grad(ctx, dtypes[di], N, 50 + variant);
                double ref[N], plain[N], vmax[N];
                for (int i = 0; i < N; i++) ref[i] = plain[i] = get1(p, i);
                nb_optim_hparams h = decoupled ? NB_ADAMW_DEFAULTS : NB_ADAM_DEFAULTS;
                h.amsgrad = true;
                h.lr = 0.02;
                h.weight_decay = 0.1;
                h.beta2 = 0.95; /* with 0.999 v would fall only 0.1% a step */
                if (variant) { /* a shorter memory: v drops far below its maximum */
                    h.beta1 = 0.3;
                    h.beta2 = 0.7;
                    h.eps = 1e-4;
                }
                nb_named_tensor np = {"p", p};
                nb_optim *opt = nb_optim_new(decoupled ? NB_OPTIM_ADAMW : NB_OPTIM_ADAM, &np, 1, &h);
                ck_assert(nb_optim_group_hparams(opt, 0).amsgrad);
                const int T = 8;
                for (int t = 1; t <= T; t++) {
                    for (int i = 0; i < N; i++) set1(p->grad, i, amsgrad_grad_at(t, i));
                    nb_optim_step(opt);
                }
                int below, below_plain;
                adam_reference(&h, decoupled, true, amsgrad_grad_at, ref, vmax, &below, T);
                adam_reference(&h, decoupled, false, amsgrad_grad_at, plain, NULL, &below_plain, T);
                /* the maximum mattered: plain Adam ends far from AMSGrad */
                ck_assert_int_gt(below, N);
                double gap = 0;
                for (int i = 0; i < N; i++) gap = fmax(gap, fabs(plain[i] - ref[i]));
                ck_assert_msg(gap > 1e-3, "AMSGrad and Adam differ by only %g", gap);
                const nb_tensor *vm = state_named(opt, "optim.state.p.max_exp_avg_sq");
                ck_assert_ptr_nonnull(vm);
                if (dtypes[di] == NB_F64) {
                    nbt_assert_close(p, ref, 1e-13, 1e-12);
                    nbt_assert_close(vm, vmax, 1e-16, 1e-12);
                } else {
                    nbt_assert_close(p, ref, 2e-6, 2e-6);
                    nbt_assert_close(vm, vmax, 1e-9, 2e-6);
                }
                nb_optim_free(opt);
                nb_ctx_free(ctx);
            }
}
END_TEST

NBT_CPU_TEST(test_amsgrad_nan_propagates) {
    /* max(vmax, NaN) is NaN, as torch.maximum gives (fmax would keep vmax) */
    nb_tensor *p = leaf_with_grad(ctx, NB_F32, N, 3);
    nb_optim_hparams h = NB_ADAM_DEFAULTS;
    h.amsgrad = true;
    nb_named_tensor np = {"p", p};
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAM, &np, 1, &h);
    for (int i = 0; i < N; i++) set1(p->grad, i, 1.0);
    nb_optim_step(opt);
    set1(p->grad, 2, NAN);
    nb_optim_step(opt);
    const nb_tensor *vm = state_named(opt, "optim.state.p.max_exp_avg_sq");
    ck_assert(isnan(get1(vm, 2)) && isnan(get1(p, 2)));
    ck_assert(!isnan(get1(vm, 1)) && !isnan(get1(p, 1)));
    nb_optim_free(opt);
}

NBT_CPU_TEST(test_amsgrad_state) {
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 2), 1);
    nb_tensor *b = leaf_with_grad(ctx, NB_F32, 2, 2);
    nb_named_tensor ps[] = {{"w", w}, {"b", b}};
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.amsgrad = true;
    /* amsgrad in group 0 only: its flag and buffers, none for group 1 */
    nb_optim_hparams h1 = h;
    h1.amsgrad = false;
    nb_param_group groups[2] = {{ps, 1, h}, {ps + 1, 1, h1}};
    nb_optim *opt = nb_optim_new_groups(NB_OPTIM_ADAMW, 2, groups);
    int n;
    const nb_named_tensor *st = nb_optim_state(opt, &n);
    const char *names[] = {"optim.step",
                           "optim.group.0.lr", "optim.group.0.weight_decay",
                           "optim.group.0.beta1", "optim.group.0.beta2", "optim.group.0.eps",
                           "optim.group.0.amsgrad",
                           "optim.group.1.lr", "optim.group.1.weight_decay",
                           "optim.group.1.beta1", "optim.group.1.beta2", "optim.group.1.eps",
                           "optim.state.w.step", "optim.state.w.exp_avg",
                           "optim.state.w.exp_avg_sq", "optim.state.w.max_exp_avg_sq",
                           "optim.state.b.step", "optim.state.b.exp_avg",
                           "optim.state.b.exp_avg_sq"};
    ck_assert_int_eq(n, 19);
    for (int i = 0; i < n; i++) ck_assert_str_eq(st[i].name, names[i]);
    ck_assert(nb_item(st[6].tensor) == 1 && st[6].tensor->dtype == NB_F64);
    ck_assert(nb_same_shape(st[15].tensor, w) && st[15].tensor->dtype == NB_F64);
    ck_assert(nb_optim_group_hparams(opt, 0).amsgrad && !nb_optim_group_hparams(opt, 1).amsgrad);
    /* values a checkpoint could carry */
    nb_fill_(st[6].tensor, 0.5);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_ERR_FORMAT);
    ck_assert_str_eq(nb_last_error(), "optimizer state (adamw): optim.group.0: amsgrad = 0.5 must "
                     "be 0 or 1");
    nb_fill_(st[6].tensor, 0);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_ERR_MISMATCH);
    ck_assert_str_eq(nb_last_error(), "optimizer state: optim.group.0.amsgrad = 0, but the "
                     "optimizer was made with amsgrad and keeps max_exp_avg_sq for \"w\"; "
                     "amsgrad is fixed at construction");
    nb_fill_(st[6].tensor, 1);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_OK);
    nb_optim_free(opt);
    /* SGD ignores the field */
    nb_optim_hparams sgd = NB_SGD_DEFAULTS;
    sgd.amsgrad = true;
    opt = nb_optim_new(NB_OPTIM_SGD, ps, 2, &sgd);
    st = nb_optim_state(opt, &n);
    ck_assert_int_eq(n, 8);
    for (int i = 0; i < n; i++) ck_assert(!strstr(st[i].name, "amsgrad") && !strstr(st[i].name, "max_"));
    nb_optim_free(opt);
}

/* An AMSGrad AdamW over one f32 parameter "w" of N elements. */
static nb_optim *amsgrad_optim(nb_ctx *ctx, bool amsgrad, uint64_t seed, nb_named_tensor *np) {
    np->name = "w";
    np->tensor = leaf_with_grad(ctx, NB_F32, N, seed);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 0.05;
    h.beta2 = 0.7;
    h.amsgrad = amsgrad;
    return nb_optim_new(NB_OPTIM_ADAMW, np, 1, &h);
}

static void amsgrad_step(nb_optim *opt, nb_tensor *p, int t) {
    for (int i = 0; i < N; i++) set1(p->grad, i, amsgrad_grad_at(t, i));
    nb_optim_step(opt);
}

START_TEST(test_amsgrad_checkpoint_resume) {
    char dir[] = "/tmp/nb_test_optim_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[256], plain_path[256];
    snprintf(path, sizeof path, "%s/amsgrad.safetensors", dir);
    snprintf(plain_path, sizeof plain_path, "%s/adamw.safetensors", dir);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);

    /* 5 steps, save, a 6th step: the reference */
    nb_named_tensor a;
    nb_optim *oa = amsgrad_optim(ctx, true, 1, &a);
    for (int t = 1; t <= 5; t++) amsgrad_step(oa, a.tensor, t);
    const nb_tensor *vma = state_named(oa, "optim.state.w.max_exp_avg_sq");
    const nb_tensor *va = state_named(oa, "optim.state.w.exp_avg_sq");
    int below = 0;
    for (int i = 0; i < N; i++) below += get1(va, i) < get1(vma, i);
    ck_assert_int_gt(below, 0); /* the saved maximum is not exp_avg_sq again */
    nb_train_state ts = {.step = 5};
    ck_assert_int_eq(nb_checkpoint_save_training(path, &a, 1, oa, &ts, NULL, 0), NB_OK);
    amsgrad_step(oa, a.tensor, 6);
    float want[N], want_vmax[N];
    nb_to_host(a.tensor, want);
    nb_to_host(vma, want_vmax);

    /* other parameter values, a fresh optimizer, load, the 6th step: the same bits */
    nb_named_tensor b;
    nb_optim *ob = amsgrad_optim(ctx, true, 99, &b);
    nb_train_state got = {0};
    ck_assert_int_eq(nb_checkpoint_load_training(path, &b, 1, ob, &got), NB_OK);
    ck_assert_int_eq(got.step, 5);
    ck_assert_int_eq(nb_optim_step_count(ob), 5);
    amsgrad_step(ob, b.tensor, 6);
    float have[N], have_vmax[N];
    nb_to_host(b.tensor, have);
    nb_to_host(state_named(ob, "optim.state.w.max_exp_avg_sq"), have_vmax);
    ck_assert(memcmp(have, want, sizeof want) == 0);
    ck_assert(memcmp(have_vmax, want_vmax, sizeof want) == 0);

    /* the resumed step depends on the restored maximum */
    ck_assert_int_eq(nb_checkpoint_load_training(path, &b, 1, ob, &got), NB_OK);
    nb_fill_((nb_tensor *)state_named(ob, "optim.state.w.max_exp_avg_sq"), 0);
    amsgrad_step(ob, b.tensor, 6);
    nb_to_host(b.tensor, have);
    ck_assert(memcmp(have, want, sizeof want) != 0);

    /* an AMSGrad checkpoint does not load into plain AdamW, nor the other way round */
    nb_named_tensor c;
    nb_optim *oc = amsgrad_optim(ctx, false, 2, &c);
    ck_assert_int_eq(nb_checkpoint_load_training(path, &c, 1, oc, &got), NB_ERR_MISMATCH);
    ck_assert_msg(strstr(nb_last_error(), "nothing was read: unexpected key(s) (2): ") &&
                      strstr(nb_last_error(), "\"optim.group.0.amsgrad\"") &&
                      strstr(nb_last_error(), "\"optim.state.w.max_exp_avg_sq\""),
                  "%s", nb_last_error());
    amsgrad_step(oc, c.tensor, 1);
    ck_assert_int_eq(nb_checkpoint_save_training(plain_path, &c, 1, oc, &ts, NULL, 0), NB_OK);
    ck_assert_int_eq(nb_checkpoint_load_training(plain_path, &b, 1, ob, &got), NB_ERR_MISMATCH);
    ck_assert_msg(strstr(nb_last_error(), "missing key(s) (2): ") &&
                      strstr(nb_last_error(), "\"optim.group.0.amsgrad\"") &&
                      strstr(nb_last_error(), "\"optim.state.w.max_exp_avg_sq\""),
                  "%s", nb_last_error());

    nb_optim_free(oa);
    nb_optim_free(ob);
    nb_optim_free(oc);
    nb_ctx_free(ctx);
    ck_assert_int_eq(remove(path), 0);
    ck_assert_int_eq(remove(plain_path), 0);
    ck_assert_int_eq(rmdir(dir), 0);
}
END_TEST

NBT_CPU_TEST(test_adam_moment_exact_at_beta1_zero) {
    /* lerp(m, g, 1) is exactly g in the form the library uses (PyTorch's);
     * m + 1 * (g - m) would round */
    nb_tensor *p = leaf_with_grad(ctx, NB_F32, 64, 1);
    nb_optim_hparams h = NB_ADAM_DEFAULTS;
    h.beta1 = 0;
    nb_named_tensor np = {"p", p};
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAM, &np, 1, &h);
    int n;
    const nb_named_tensor *st = nb_optim_state(opt, &n);
    ck_assert_str_eq(st[7].name, "optim.state.p.exp_avg");
    for (int t = 1; t <= 4; t++) {
        for (int i = 0; i < 64; i++) set1(p->grad, i, 1e3 * grad_at(t, i) + 1e-3 * i);
        nb_optim_step(opt);
        ck_assert(memcmp(st[7].tensor->data, p->grad->data, 64 * sizeof(float)) == 0);
    }
    nb_optim_free(opt);
}

NBT_CPU_TEST(test_skips_params_without_grad) {
    nb_tensor *a = leaf_with_grad(ctx, NB_F64, N, 1);
    int64_t n = N;
    nb_tensor *b = nbt_randn_leaf(ctx, NB_F64, 1, &n, 2); /* never gets a gradient */
    for (int i = 0; i < N; i++) set1(a->grad, i, 1.0);
    double b0[N];
    nb_to_host(b, b0);
    nb_named_tensor ps[] = {{"a", a}, {"b", b}};
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, ps, 2, &NB_ADAMW_DEFAULTS);
    nb_optim_step(opt);
    nb_optim_step(opt);
    nbt_assert_close(b, b0, 0, 0); /* untouched, not even decayed */
    int ns;
    const nb_named_tensor *st = nb_optim_state(opt, &ns);
    for (int i = 0; i < ns; i++) {
        if (strcmp(st[i].name, "optim.state.a.step") == 0) ck_assert_int_eq(nb_item(st[i].tensor), 2);
        if (strcmp(st[i].name, "optim.state.b.step") == 0) ck_assert_int_eq(nb_item(st[i].tensor), 0);
    }
    nb_optim_free(opt);
}

NBT_CPU_TEST(test_zero_grad_keeps_buffers) {
    nb_tensor *a = leaf_with_grad(ctx, NB_F32, N, 1);
    nb_tensor *grad = a->grad;
    for (int i = 0; i < N; i++) set1(a->grad, i, 3.0);
    nb_named_tensor np = {"a", a};
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, &np, 1, &NB_SGD_DEFAULTS);
    nb_optim_zero_grad(opt);
    ck_assert_ptr_eq(a->grad, grad);
    double zero[N] = {0};
    nbt_assert_close(a->grad, zero, 0, 0);
    nb_optim_free(opt);
}

/* Note [Flat gradients]: an optimizer's parameters get their gradients in
 * one buffer, in reverse order of its list, 64-byte aligned; the values
 * are those made without an optimizer (bitwise); a parameter backward
 * does not reach keeps no gradient; zero_grad clears them all; a gradient
 * set by hand replaces the slot and zero_grad still clears both. */
static bool all_zero(const nb_tensor *t) { /* f32, at most 64 elements */
    float v[64];
    nb_to_host(t, v);
    bool z = true;
    for (int64_t i = 0; i < nb_numel(t); i++) z &= v[i] == 0;
    return z;
}

static nb_tensor *flat_model_loss(nb_ctx *ctx, nb_tensor *const *p, nb_tensor *x) {
    nb_tensor *h = nb_tanh(ctx, nb_add(ctx, nb_matmul(ctx, x, p[0]), p[1]));
    return nb_sum_all(ctx, nb_mul(ctx, nb_matmul(ctx, h, p[2]), nb_matmul(ctx, h, p[2])));
}

START_TEST(test_flat_gradients) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *p[4] = {nbt_randn_leaf(params, NB_F32, NB_SHAPE(5, 7), 1),
                       nbt_randn_leaf(params, NB_F32, NB_SHAPE(7), 2),
                       nbt_randn_leaf(params, NB_F32, NB_SHAPE(7, 3), 3),
                       nbt_randn_leaf(params, NB_F32, NB_SHAPE(2), 4)}; /* unused */
    nb_tensor *x = nbt_randn(params, NB_F32, NB_SHAPE(4, 5), 5);
    /* the reference: gradients of their own, no optimizer */
    nb_backward(flat_model_loss(step, p, x));
    float want[3][35];
    for (int i = 0; i < 3; i++) {
        nb_to_host(p[i]->grad, want[i]);
        nb_set_grad(p[i], NULL);
    }
    nb_ctx_reset(step);
    nb_named_tensor np[4] = {{"w1", p[0]}, {"b1", p[1]}, {"w2", p[2]}, {"unused", p[3]}};
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, np, 4, &(nb_optim_hparams){.lr = 0.1});
    ck_assert(p[0]->grad == NULL); /* reserved, not made: PyTorch's None */
    nb_backward(flat_model_loss(step, p, x));
    ck_assert(p[3]->grad == NULL);
    for (int i = 0; i < 3; i++) {
        float got[35];
        nb_to_host(p[i]->grad, got);
        ck_assert_msg(memcmp(got, want[i], sizeof(float) * (size_t)nb_numel(p[i])) == 0,
                      "parameter %d's gradient differs from the one made without an optimizer", i);
        ck_assert(p[i]->grad->base && p[i]->grad->base == p[0]->grad->base);
        ck_assert((uintptr_t)p[i]->grad->data % 64 == 0);
    }
    /* reverse order of the list, each slot at a multiple of 16 floats: unused (2
     * floats) at 0, w2 (21) at 16, b1 (7) at 48, w1 (35) at 64 */
    const char *base = p[0]->grad->base->data;
    ck_assert_ptr_eq(p[2]->grad->data, base + 4 * 16);
    ck_assert_ptr_eq(p[1]->grad->data, base + 4 * 48);
    ck_assert_ptr_eq(p[0]->grad->data, base + 4 * 64);
    ck_assert_int_eq(nb_numel(p[0]->grad->base), 64 + 35);
    nb_optim_zero_grad(opt);
    for (int i = 0; i < 3; i++) ck_assert(all_zero(p[i]->grad));
    /* a gradient set by hand: the slot is left, zero_grad clears both kinds */
    nb_set_grad(p[1], nb_full(params, NB_F32, NB_SHAPE(7), 2.0));
    nb_backward(flat_model_loss(step, p, x));
    ck_assert(p[1]->grad->base != p[0]->grad->base);
    nb_optim_zero_grad(opt);
    for (int i = 0; i < 3; i++) ck_assert(all_zero(p[i]->grad));
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(params);
}
END_TEST

/* Note [Gradient segments]: slots in segments of at most 32 MiB, each made
 * at the first gradient one of its slots receives; zero_grad clears each.
 * Three 12 MiB parameters: the last two of the list (slot order) share a
 * segment of 24 MiB, the first has one of its own. */
static double sum_sq(nb_ctx *ctx, nb_tensor *t) { return nb_item(nb_sum_all(ctx, nb_mul(ctx, t, t))); }

START_TEST(test_gradient_segments) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    enum { R = 1024, C = 3072 }; /* 12 MiB of f32 */
    const size_t mib12 = (size_t)R * C * 4;
    nb_tensor *p[3];
    nb_named_tensor np[3];
    for (int i = 0; i < 3; i++) {
        p[i] = nb_full(params, NB_F32, NB_SHAPE(R, C), 1.0 + i);
        nb_set_requires_grad(p[i], true);
        np[i] = (nb_named_tensor){i == 0 ? "a" : i == 1 ? "b" : "c", p[i]};
    }
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, np, 3, &(nb_optim_hparams){.lr = 0.1});
    size_t before = nb_ctx_used(params);
    /* only c reached: its segment (c and b) is made, a's is not */
    nb_backward(nb_sum_all(step, nb_mul(step, p[2], p[2])));
    ck_assert_uint_eq(nb_ctx_used(params) - before, 2 * mib12);
    ck_assert(p[0]->grad == NULL && p[1]->grad == NULL);
    ck_assert_double_eq(sum_sq(step, p[2]->grad), 36.0 * R * C); /* d(c^2) = 2c = 6 */
    nb_ctx_reset(step);
    /* all three: a's segment made now, b's slot beside c's */
    nb_backward(nb_sum_all(step, nb_add(step, nb_add(step, p[0], p[1]), p[2])));
    ck_assert_uint_eq(nb_ctx_used(params) - before, 3 * mib12);
    ck_assert(p[1]->grad->base == p[2]->grad->base && p[0]->grad->base != p[2]->grad->base);
    ck_assert_ptr_eq(p[1]->grad->data, (const char *)p[2]->grad->data + mib12);
    ck_assert_double_eq(sum_sq(step, p[0]->grad), 1.0 * R * C);
    ck_assert_double_eq(sum_sq(step, p[1]->grad), 1.0 * R * C);
    ck_assert_double_eq(sum_sq(step, p[2]->grad), 49.0 * R * C); /* 6 + 1 */
    nb_optim_zero_grad(opt); /* one memset a segment */
    for (int i = 0; i < 3; i++) ck_assert_double_eq(sum_sq(step, p[i]->grad), 0);
    /* set to none: both segments given back; a gradient kept from before is
     * refused; the next backward makes a's segment again only, under the
     * same tensor, with the values written (no stale ones) */
    nb_tensor *old_a = p[0]->grad, *old_c = p[2]->grad;
    nb_ctx_reset(step);
    nb_backward(nb_sum_all(step, nb_add(step, p[0], p[2]))); /* gradients 1 + 0 = 1 in a, 1 in c */
    nb_optim_zero_grad_to_none(opt);
    ck_assert_uint_eq(nb_ctx_used(params), before);
    NBT_EXPECT_ABORT(nb_item(nb_sum_all(step, old_a)), "given back");
    /* memory given back is taken by the next tensor of the context: the
     * segment made again is elsewhere, and nothing writes this one */
    nb_tensor *filler = nb_full(params, NB_F32, NB_SHAPE(R, C), 7.0);
    nb_ctx_reset(step);
    nb_backward(nb_sum_all(step, nb_mul(step, p[0], p[0]))); /* 2a = 2 */
    ck_assert_uint_eq(nb_ctx_used(params) - before, 2 * mib12);
    ck_assert_double_eq(sum_sq(step, filler), 49.0 * R * C);
    ck_assert(p[0]->grad == old_a && p[1]->grad == NULL && p[2]->grad == NULL);
    ck_assert_ptr_eq(p[0]->grad->data, p[0]->grad->base->data); /* a's view on the new memory */
    ck_assert_double_eq(sum_sq(step, p[0]->grad), 4.0 * R * C);
    NBT_EXPECT_ABORT(nb_item(nb_sum_all(step, old_c)), "given back");
    nb_optim_free(opt);
    (void)filler;
    nb_ctx_free(step);
    nb_ctx_free(params);
}
END_TEST

NBT_CPU_TEST(test_param_groups) {
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 1);
    nb_tensor *bias = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 2);
    nb_tensor *norm = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 3);
    nb_tensor *emb = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 3), 4);
    nb_named_tensor ps[] = {{"fc.weight", w}, {"fc.bias", bias}, {"ln.weight", norm},
                            {"emb.weight", emb}};
    nb_tensor *all[] = {w, bias, norm, emb};
    double before[4][12];
    for (int k = 0; k < 4; k++) {
        nb_set_grad(all[k], nb_ones(ctx, NB_F64, all[k]->ndim, all[k]->shape));
        nb_to_host(all[k], before[k]);
    }
    nb_optim_hparams h = {.lr = 0.1, .weight_decay = 0.5};
    nb_named_tensor scratch[4];
    nb_param_group groups[2];
    nb_optim_split_decay(ps, 4, &h, scratch, groups);
    ck_assert_int_eq(groups[0].n, 2);
    ck_assert_int_eq(groups[1].n, 2);
    ck_assert_str_eq(groups[0].params[0].name, "fc.weight");
    ck_assert_str_eq(groups[0].params[1].name, "emb.weight");
    ck_assert_str_eq(groups[1].params[0].name, "fc.bias");
    ck_assert_str_eq(groups[1].params[1].name, "ln.weight");
    ck_assert(groups[0].h.weight_decay == 0.5 && groups[1].h.weight_decay == 0);
    ck_assert(groups[0].h.lr == 0.1 && groups[1].h.lr == 0.1);
    nb_optim *opt = nb_optim_new_groups(NB_OPTIM_SGD, 2, groups);
    memset(scratch, 0, sizeof scratch); /* the optimizer keeps its own copy */
    ck_assert_int_eq(nb_optim_group_count(opt), 2);
    ck_assert_int_eq(nb_optim_param_count(opt), 4);
    nb_optim_set_lr(opt, 1, 0.01);
    ck_assert(nb_optim_lr(opt, 0) == 0.1 && nb_optim_lr(opt, 1) == 0.01);
    ck_assert(nb_optim_group_hparams(opt, 0).weight_decay == 0.5);
    nb_optim_step(opt);
    /* decayed group: p - 0.1 (1 + 0.5 p); the other: p - 0.01 */
    for (int k = 0; k < 4; k++) {
        bool matrix = all[k]->ndim == 2;
        double expect[12];
        for (int64_t i = 0; i < nb_numel(all[k]); i++)
            expect[i] = matrix ? before[k][i] - 0.1 * (1 + 0.5 * before[k][i]) : before[k][i] - 0.01;
        nbt_assert_close(all[k], expect, 1e-15, 1e-15);
    }
    nb_optim_set_lr_all(opt, 0.5);
    nb_optim_set_weight_decay(opt, 0, 0.25);
    ck_assert(nb_optim_lr(opt, 1) == 0.5 && nb_optim_group_hparams(opt, 0).weight_decay == 0.25);
    NBT_EXPECT_ABORT(nb_optim_set_lr(opt, 2, 0.1), "nb_optim_set_lr: group 2 out of range (the "
                     "optimizer has 2)");
    NBT_EXPECT_ABORT(nb_optim_set_lr(opt, 0, -1), "nb_optim_set_lr: lr = -1 must be finite and >= 0");
    NBT_EXPECT_ABORT(nb_optim_set_weight_decay(opt, 0, NAN), "weight_decay = nan");
    nb_optim_free(opt);
    /* an empty group is fine as long as some group has parameters */
    nb_param_group only_vectors[2] = {{NULL, 0, h}, {ps + 1, 2, h}};
    opt = nb_optim_new_groups(NB_OPTIM_ADAM, 2, only_vectors);
    ck_assert_int_eq(nb_optim_param_count(opt), 2);
    nb_optim_free(opt);
}

NBT_CPU_TEST(test_construction_errors) {
    nb_tensor *a = leaf_with_grad(ctx, NB_F32, 3, 1);
    nb_tensor *b = leaf_with_grad(ctx, NB_F32, 3, 2);
    nb_tensor *not_leaf = nb_mul(ctx, a, b);
    nb_tensor *frozen = nb_zeros(ctx, NB_F32, NB_SHAPE(3));
    nb_tensor *half = nb_zeros(ctx, NB_BF16, NB_SHAPE(3));
    nb_set_requires_grad(half, true);
    /* a leaf with transposed strides (only internal code makes such a thing) */
    nb_tensor *base = nbt_randn(ctx, NB_F32, NB_SHAPE(2, 3), 3);
    nb_tensor *strided = nb__view(ctx, base, 2, (int64_t[]){3, 2}, (int64_t[]){1, 3}, base->data);
    nb_set_requires_grad(strided, true);
    nb_optim_hparams sgd = NB_SGD_DEFAULTS, adam = NB_ADAM_DEFAULTS;

    nb_named_tensor dup_name[] = {{"w", a}, {"w", b}};
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, dup_name, 2, &sgd), "two parameters are named \"w\"");
    nb_named_tensor dup_tensor[] = {{"a", a}, {"also_a", a}};
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, dup_tensor, 2, &sgd),
                     "\"a\" and \"also_a\" are the same tensor");
    nb_named_tensor bad[] = {{"x", not_leaf}};
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, bad, 1, &sgd),
                     "parameter \"x\" (3,) is not a leaf that requires grad (it was made by an op)");
    bad[0].tensor = frozen;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, bad, 1, &sgd), "is not a leaf that requires grad");
    bad[0].tensor = half;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, bad, 1, &sgd),
                     "parameter \"x\" has dtype bf16; optimizers update f32 or f64 parameters");
    bad[0].tensor = strided;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, bad, 1, &sgd), "parameter \"x\" (3, 2) is not contiguous");
    nb_named_tensor unnamed[] = {{NULL, a}};
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, unnamed, 1, &sgd), "parameter 0 of group 0 has no name");
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, NULL, 0, &sgd), "empty parameter list");
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, dup_name, 1, NULL), "NULL hyperparameters");

    nb_named_tensor ok[] = {{"a", a}};
    nb_optim_hparams h = sgd;
    h.lr = -0.1;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, ok, 1, &h), "nb_optim_new (sgd): group 0: lr = -0.1 "
                     "must be finite and >= 0");
    h = sgd;
    h.nesterov = true;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, ok, 1, &h), "nesterov momentum needs momentum > 0 "
                     "and dampening 0 (momentum = 0, dampening = 0)");
    h.momentum = 0.9;
    h.dampening = 0.1;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, ok, 1, &h), "(momentum = 0.9, dampening = 0.1)");
    h = sgd;
    h.momentum = -1;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_SGD, ok, 1, &h), "momentum = -1 must be finite and >= 0");
    h = adam;
    h.beta1 = 1.0;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_ADAM, ok, 1, &h), "nb_optim_new (adam): group 0: beta1 = "
                     "1 must be in [0, 1)");
    h = adam;
    h.beta2 = -0.5;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_ADAMW, ok, 1, &h), "beta2 = -0.5 must be in [0, 1)");
    h = adam;
    h.eps = -1e-8;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_ADAM, ok, 1, &h), "eps = -1e-08 must be finite and >= 0");
    h = adam;
    h.weight_decay = INFINITY;
    NBT_EXPECT_ABORT(nb_optim_new(NB_OPTIM_ADAM, ok, 1, &h), "weight_decay = inf must be finite");
    NBT_EXPECT_ABORT(nb_optim_new((nb_optim_kind)7, ok, 1, &adam), "unknown optimizer kind 7");
}

NBT_CPU_TEST(test_state_export) {
    nb_tensor *w = leaf_with_grad(ctx, NB_F64, 4, 1);
    nb_tensor *b = leaf_with_grad(ctx, NB_F64, 2, 2);
    nb_named_tensor ps[] = {{"w", w}, {"b", b}};
    for (int i = 0; i < 4; i++) set1(w->grad, i, 2.0);
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, ps, 2, &NB_ADAMW_DEFAULTS);
    int n;
    const nb_named_tensor *st = nb_optim_state(opt, &n);
    const char *names[] = {"optim.step",           "optim.group.0.lr",
                           "optim.group.0.weight_decay", "optim.group.0.beta1",
                           "optim.group.0.beta2",  "optim.group.0.eps",
                           "optim.state.w.step",   "optim.state.w.exp_avg",
                           "optim.state.w.exp_avg_sq", "optim.state.b.step",
                           "optim.state.b.exp_avg", "optim.state.b.exp_avg_sq"};
    ck_assert_int_eq(n, 12);
    for (int i = 0; i < n; i++) ck_assert_str_eq(st[i].name, names[i]);
    ck_assert(nb_item(st[1].tensor) == 1e-3 && nb_item(st[2].tensor) == 1e-2);
    ck_assert(st[1].tensor->ndim == 0 && st[1].tensor->dtype == NB_F64);
    ck_assert(st[0].tensor->dtype == NB_I64 && st[6].tensor->dtype == NB_I64);
    nb_optim_step(opt);
    ck_assert_int_eq(nb_item(st[0].tensor), 1);
    ck_assert_int_eq(nb_item(st[6].tensor), 1);
    double m[4] = {0.2, 0.2, 0.2, 0.2}, v[4];
    for (int i = 0; i < 4; i++) v[i] = 0.001 * 4.0;
    nbt_assert_close(st[7].tensor, m, 1e-15, 1e-15);
    nbt_assert_close(st[8].tensor, v, 1e-15, 1e-12);
    /* writing through the views is what loading does */
    nb_fill_(st[1].tensor, 0.25);
    ck_assert(nb_optim_lr(opt, 0) == 0.25);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_OK);
    nb_fill_(st[3].tensor, 1.5);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_ERR_FORMAT);
    ck_assert_str_eq(nb_last_error(), "optimizer state (adamw): optim.group.0: beta1 = 1.5 must be "
                     "in [0, 1)");
    nb_fill_(st[3].tensor, 0.9);
    nb_fill_(st[9].tensor, -3);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_ERR_FORMAT);
    ck_assert_str_eq(nb_last_error(), "optimizer state: optim.state.b.step = -3 is negative");
    nb_optim_free(opt);

    /* SGD: momentum buffers only with momentum; nesterov stored as 0 or 1 */
    opt = nb_optim_new(NB_OPTIM_SGD, ps, 2, &NB_SGD_DEFAULTS);
    st = nb_optim_state(opt, &n);
    const char *plain[] = {"optim.step", "optim.group.0.lr", "optim.group.0.weight_decay",
                           "optim.group.0.momentum", "optim.group.0.dampening",
                           "optim.group.0.nesterov", "optim.state.w.step", "optim.state.b.step"};
    ck_assert_int_eq(n, 8);
    for (int i = 0; i < n; i++) ck_assert_str_eq(st[i].name, plain[i]);
    nb_fill_(st[5].tensor, 0.5);
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_ERR_FORMAT);
    ck_assert_str_eq(nb_last_error(), "optimizer state (sgd): optim.group.0: nesterov = 0.5 must be "
                     "0 or 1");
    nb_fill_(st[5].tensor, 0);
    nb_fill_(st[3].tensor, 0.9); /* momentum without buffers */
    ck_assert_int_eq(nb_optim_state_validate(opt), NB_ERR_MISMATCH);
    ck_assert(strstr(nb_last_error(), "has no momentum buffer for \"w\""));
    nb_optim_free(opt);
    nb_optim_hparams h = NB_SGD_DEFAULTS;
    h.momentum = 0.9;
    opt = nb_optim_new(NB_OPTIM_SGD, ps, 2, &h);
    st = nb_optim_state(opt, &n);
    ck_assert_int_eq(n, 10);
    ck_assert_str_eq(st[7].name, "optim.state.w.momentum_buffer");
    ck_assert_str_eq(st[9].name, "optim.state.b.momentum_buffer");
    nb_optim_free(opt);
}

/* ---- schedules ---- */
START_TEST(test_schedules) {
    nb_lr_schedule c = nb_lr_constant(0.5, 10);
    ck_assert(nb_lr_schedule_at(&c, 0) == 0.05);   /* warmup start: lr / W */
    ck_assert(nb_lr_schedule_at(&c, 4) == 0.25);
    ck_assert(nb_lr_schedule_at(&c, 9) == 0.5);    /* warmup end */
    ck_assert(nb_lr_schedule_at(&c, 10) == 0.5);
    ck_assert(nb_lr_schedule_at(&c, 1000000) == 0.5);
    nb_lr_schedule none = nb_lr_constant(0.5, 0);
    ck_assert(nb_lr_schedule_at(&none, 0) == 0.5);

    nb_lr_schedule s = nb_lr_step_decay(1.0, 0, 3, 0.5);
    double want_s[] = {1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125};
    for (int i = 0; i < 10; i++) ck_assert(nb_lr_schedule_at(&s, i) == want_s[i]);
    s.warmup_steps = 2; /* decay counts from the end of warmup */
    ck_assert(nb_lr_schedule_at(&s, 0) == 0.5);
    ck_assert(nb_lr_schedule_at(&s, 1) == 1.0);
    ck_assert(nb_lr_schedule_at(&s, 4) == 1.0);
    ck_assert(nb_lr_schedule_at(&s, 5) == 0.5);

    nb_lr_schedule k = nb_lr_cosine(1.0, 10, 110, 0.1);
    ck_assert(nb_lr_schedule_at(&k, 0) == 0.1);
    ck_assert(nb_lr_schedule_at(&k, 9) == 1.0);
    ck_assert(nb_lr_schedule_at(&k, 10) == 1.0);                       /* cosine start */
    ck_assert(fabs(nb_lr_schedule_at(&k, 60) - 0.55) < 1e-15);        /* midpoint */
    ck_assert(fabs(nb_lr_schedule_at(&k, 35) - (0.1 + 0.45 * (1 + sqrt(0.5)))) < 1e-15);
    ck_assert(fabs(nb_lr_schedule_at(&k, 109) - (0.1 + 0.45 * (1 + cos(3.14159265358979323846 * 0.99)))) < 1e-15);
    ck_assert(nb_lr_schedule_at(&k, 110) == 0.1); /* end */
    ck_assert(nb_lr_schedule_at(&k, 5000) == 0.1);
    /* pure: the same answer in any order */
    double forward[120];
    for (int i = 0; i < 120; i++) forward[i] = nb_lr_schedule_at(&k, i);
    for (int i = 119; i >= 0; i--) ck_assert(nb_lr_schedule_at(&k, i) == forward[i]);
    nb_lr_schedule k0 = nb_lr_cosine(1.0, 0, 100, 0.0);
    ck_assert(nb_lr_schedule_at(&k0, 0) == 1.0);
    ck_assert(fabs(nb_lr_schedule_at(&k0, 50) - 0.5) < 1e-15);
    ck_assert(nb_lr_schedule_at(&k0, 100) == 0.0);

    nb_lr_schedule bad = nb_lr_cosine(1.0, 10, 5, 0.0);
    NBT_EXPECT_ABORT(nb_lr_schedule_at(&bad, 20), "cosine schedule with total_steps = 5 < "
                     "warmup_steps = 10");
    bad = nb_lr_cosine(1.0, 0, 5, 2.0);
    NBT_EXPECT_ABORT(nb_lr_schedule_at(&bad, 1), "min_lr = 2 must be in [0, lr = 1]");
    bad = nb_lr_step_decay(1.0, 0, 0, 0.5);
    NBT_EXPECT_ABORT(nb_lr_schedule_at(&bad, 1), "step decay needs step_size > 0, got 0");
    NBT_EXPECT_ABORT(nb_lr_schedule_at(&c, -1), "nb_lr_schedule_at: step -1 is negative");
    bad = nb_lr_constant(-1, 0);
    NBT_EXPECT_ABORT(nb_lr_schedule_at(&bad, 0), "lr = -1 must be finite and >= 0");
}
END_TEST

/* ---- clipping ---- */
NBT_CPU_TEST(test_clip_grad_norm) {
    nb_tensor *a = leaf_with_grad(ctx, NB_F64, 2, 1);
    nb_tensor *b = leaf_with_grad(ctx, NB_F32, 1, 2);
    int64_t one = 1;
    nb_tensor *c = nbt_randn_leaf(ctx, NB_F32, 1, &one, 3); /* no gradient: ignored */
    nb_named_tensor ps[] = {{"a", a}, {"b", b}, {"c", c}};
    set1(a->grad, 0, 3);
    set1(a->grad, 1, -4);
    set1(b->grad, 0, 12);
    /* below the limit: untouched, bit for bit */
    ck_assert(nb_clip_grad_norm(ps, 3, 20.0, 2.0) == 13.0);
    nbt_assert_close(a->grad, (double[]){3, -4}, 0, 0);
    nbt_assert_close(b->grad, (double[]){12}, 0, 0);
    /* above: scaled by max / (norm + 1e-6) */
    ck_assert(nb_clip_grad_norm(ps, 3, 6.5, 2.0) == 13.0);
    double k = 6.5 / (13.0 + 1e-6);
    nbt_assert_close(a->grad, (double[]){3 * k, -4 * k}, 1e-15, 1e-15);
    nbt_assert_close(b->grad, (double[]){12 * k}, 0, 1e-7);
    /* the inf-norm */
    set1(a->grad, 0, 3);
    set1(a->grad, 1, -4);
    set1(b->grad, 0, 12);
    ck_assert(nb_clip_grad_norm(ps, 3, 6.0, INFINITY) == 12.0);
    k = 6.0 / (12.0 + 1e-6);
    nbt_assert_close(a->grad, (double[]){3 * k, -4 * k}, 1e-15, 1e-15);
    /* through the optimizer: the same */
    set1(a->grad, 0, 3);
    set1(a->grad, 1, -4);
    set1(b->grad, 0, 12);
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, ps, 3, &NB_SGD_DEFAULTS);
    ck_assert(nb_optim_clip_grad_norm(opt, 100.0, 2.0) == 13.0);
    nb_optim_free(opt);

    /* non-finite norms leave the gradients as they were */
    set1(a->grad, 0, INFINITY);
    ck_assert(isinf(nb_clip_grad_norm(ps, 3, 1.0, 2.0)));
    ck_assert(isinf(nb_clip_grad_norm(ps, 3, 1.0, INFINITY)));
    ck_assert(get1(a->grad, 1) == -4 && get1(b->grad, 0) == 12);
    set1(a->grad, 0, NAN);
    ck_assert(isnan(nb_clip_grad_norm(ps, 3, 1.0, 2.0)));
    ck_assert(isnan(nb_clip_grad_norm(ps, 3, 1.0, INFINITY)));
    ck_assert(get1(a->grad, 1) == -4 && get1(b->grad, 0) == 12);
    set1(a->grad, 0, -INFINITY);
    set1(b->grad, 0, NAN);
    ck_assert(isnan(nb_clip_grad_norm(ps, 3, 1.0, 2.0)));

    /* f64 squares that overflow: the norm is still exact */
    set1(a->grad, 0, 3e200);
    set1(a->grad, 1, 4e200);
    set1(b->grad, 0, 0);
    double norm = nb_clip_grad_norm(ps, 2, 1.0, 2.0);
    ck_assert_msg(fabs(norm - 5e200) <= 1e-15 * 5e200, "norm %g", norm);
    nbt_assert_close(a->grad, (double[]){0.6, 0.8}, 1e-15, 1e-12);

    NBT_EXPECT_ABORT(nb_clip_grad_norm(ps, 3, 1.0, 1.0), "nb_clip_grad_norm: norm_type = 1; "
                     "supported are 2 and INFINITY");
    NBT_EXPECT_ABORT(nb_clip_grad_norm(ps, 3, -1.0, 2.0), "max_norm = -1 must be >= 0");
}

/* x rounded to f32 (through memory: GCC 12 at -O3 has been seen to drop a
 * (float) cast inside a vectorised initialiser of doubles) */
static double round_f32(double x) {
    volatile float f = (float)x;
    return f;
}

/* The norm left on the device (Note [Clipping without a host read]): f32
 * gradients, the norm a 0-d f64 tensor of the context given, the values
 * worked by hand: 3, -4, 12 have the 2-norm 13 and the inf-norm 12. */
START_TEST(test_clip_grad_norm_tensor) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *a = leaf_with_grad(ctx, NB_F32, 2, 1);
    nb_tensor *b = leaf_with_grad(ctx, NB_F32, 1, 2);
    int64_t one = 1;
    nb_tensor *c = nbt_randn_leaf(ctx, NB_F32, 1, &one, 3); /* no gradient: ignored */
    nb_named_tensor ps[] = {{"a", a}, {"b", b}, {"c", c}};
    const double norm_types[] = {2.0, INFINITY}, norms[] = {13.0, 12.0};
    for (int nt = 0; nt < 2; nt++) {
        set1(a->grad, 0, 3);
        set1(a->grad, 1, -4);
        set1(b->grad, 0, 12);
        nb_tensor *n = nb_clip_grad_norm_tensor(step, ps, 3, 20.0, norm_types[nt]);
        ck_assert(n->ndim == 0 && n->dtype == NB_F64 && n->ctx == step);
        ck_assert(nb_item(n) == norms[nt]);
        nbt_assert_close(b->grad, (double[]){12}, 0, 0); /* below the limit: untouched */
        n = nb_clip_grad_norm_tensor(step, ps, 3, 6.5, norm_types[nt]);
        ck_assert(nb_item(n) == norms[nt]);
        /* scaled as the host path scales: (float)(x * coef), coef in double */
        double k = 6.5 / (norms[nt] + 1e-6);
        nbt_assert_close(a->grad, (double[]){round_f32(3 * k), round_f32(-4 * k)}, 0, 0);
        nbt_assert_close(b->grad, (double[]){round_f32(12 * k)}, 0, 0);
        /* non-finite: the norm says so, the gradients stay */
        set1(a->grad, 0, 3);
        set1(b->grad, 0, nt ? -INFINITY : NAN);
        n = nb_clip_grad_norm_tensor(step, ps, 3, 1.0, norm_types[nt]);
        ck_assert(nt ? isinf(nb_item(n)) : isnan(nb_item(n)));
        ck_assert(get1(a->grad, 0) == 3 && get1(a->grad, 1) == round_f32(-4 * k));
    }
    /* through the optimizer, and with no gradient at all: 0 */
    set1(b->grad, 0, 12);
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, ps, 3, &NB_SGD_DEFAULTS);
    ck_assert(nb_item(nb_optim_clip_grad_norm_tensor(opt, step, 100.0, INFINITY)) == 12.0);
    nb_optim_free(opt);
    ck_assert(nb_item(nb_clip_grad_norm_tensor(step, ps + 2, 1, 1.0, 2.0)) == 0.0);
    /* f64 gradients take the host path: still a tensor, the overflow handled */
    nb_tensor *d = leaf_with_grad(ctx, NB_F64, 2, 4);
    set1(d->grad, 0, 3e200);
    set1(d->grad, 1, 4e200);
    nb_named_tensor pd = {"d", d};
    double nd = nb_item(nb_clip_grad_norm_tensor(step, &pd, 1, 1.0, 2.0));
    ck_assert_msg(fabs(nd - 5e200) <= 1e-15 * 5e200, "norm %g", nd);
    NBT_EXPECT_ABORT(nb_clip_grad_norm_tensor(step, ps, 3, 1.0, 1.0),
                     "nb_clip_grad_norm_tensor: norm_type = 1; supported are 2 and INFINITY");
    nb_ctx_free(step);
    nb_ctx_free(ctx);
}
END_TEST

/* f32 tensors' bytes equal */
static bool same_bits(const nb_tensor *a, const nb_tensor *b) {
    size_t n = (size_t)nb_numel(a) * nb_dtype_size(a->dtype);
    return nb_same_shape(a, b) && a->dtype == b->dtype && memcmp(a->data, b->data, n) == 0;
}

/* Two optimizers over parameters of the same values (the sizes straddle
 * the CPU kernels' pieces), their gradients set alike. */
typedef struct clip_side {
    nb_tensor *p[2];
    nb_optim *opt;
} clip_side;

static void clip_side_new(nb_ctx *ctx, clip_side *c, nb_optim_kind kind) {
    const int64_t sizes[2] = {70001, 37};
    nb_named_tensor ps[2];
    for (int i = 0; i < 2; i++) {
        c->p[i] = nbt_randn_leaf(ctx, NB_F32, 1, &sizes[i], 10 + (uint64_t)i);
        ps[i] = (nb_named_tensor){i ? "b" : "a", c->p[i]};
    }
    nb_optim_hparams h = kind == NB_OPTIM_SGD ? NB_SGD_DEFAULTS : NB_ADAMW_DEFAULTS;
    if (kind == NB_OPTIM_SGD) h.momentum = 0.9, h.lr = 0.1;
    c->opt = nb_optim_new(kind, ps, 2, &h);
}

static void clip_side_grads(nb_ctx *step, clip_side *c, int t) {
    for (int i = 0; i < 2; i++) {
        nb_tensor *p = c->p[i];
        nb_tensor *g = nbt_randn_leaf(step, NB_F32, 1, p->shape, 100 + (uint64_t)(10 * t + i));
        if (!p->grad) nb_set_grad(p, nb_zeros_like(p->ctx, p));
        nb_copy_(p->grad, g);
    }
}

static void assert_same_optim(clip_side *a, clip_side *b) {
    for (int i = 0; i < 2; i++) ck_assert(same_bits(a->p[i], b->p[i]));
    int na, nb;
    const nb_named_tensor *sa = nb_optim_state(a->opt, &na), *sb = nb_optim_state(b->opt, &nb);
    ck_assert_int_eq(na, nb);
    for (int k = 0; k < na; k++) ck_assert_msg(same_bits(sa[k].tensor, sb[k].tensor), "%s", sa[k].name);
}

/* Note [Clipping inside the step]: nb_optim_step_clipped leaves the
 * parameters and state bit for bit as clipping then stepping does, whether
 * the norm clips or not, and the gradients unscaled; a non-finite norm
 * skips the update, and nb_optim_unstep takes the step counts back. */
START_TEST(test_step_clipped) {
    const nb_optim_kind kinds[2] = {NB_OPTIM_ADAMW, NB_OPTIM_SGD};
    for (int kk = 0; kk < 2; kk++) {
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
        clip_side two, one; /* clip then step; the step with the clip inside */
        clip_side_new(ctx, &two, kinds[kk]);
        clip_side_new(ctx, &one, kinds[kk]);
        /* clips (the 2-norm is about 265, the inf-norm about 4), does not, clipping off */
        const double max_norms[3] = {50.0, 1e9, INFINITY};
        for (int t = 0; t < 6; t++) {
            nb_ctx_reset(step);
            clip_side_grads(step, &two, t);
            clip_side_grads(step, &one, t);
            nb_tensor *g0 = nb_cast(step, one.p[0]->grad, NB_F32); /* a copy */
            double mx = t == 3 ? 1.0 : max_norms[t % 3];
            double n2 = nb_optim_clip_grad_norm(two.opt, mx, t < 3 ? 2.0 : INFINITY);
            nb_optim_step(two.opt);
            double n1 = nb_item(nb_optim_step_clipped(one.opt, step, mx, t < 3 ? 2.0 : INFINITY));
            ck_assert(n1 == n2);
            assert_same_optim(&two, &one);
            ck_assert(same_bits(one.p[0]->grad, g0)); /* not scaled */
            ck_assert(t % 3 != 0 || !same_bits(two.p[0]->grad, g0)); /* the two-pass one is */
        }
        /* a NaN gradient: nothing updated; unstep leaves the skipped step's state */
        nb_ctx_reset(step);
        clip_side_grads(step, &one, 7);
        nb_set(one.p[1]->grad, (int64_t[]){3}, NAN);
        nb_tensor *before = nb_cast(step, one.p[0], NB_F32);
        int64_t count = nb_optim_step_count(one.opt);
        ck_assert(isnan(nb_item(nb_optim_step_clipped(one.opt, step, 1.0, 2.0))));
        ck_assert(same_bits(one.p[0], before));
        ck_assert(nb_optim_step_count(one.opt) == count + 1);
        nb_optim_unstep(one.opt);
        ck_assert(nb_optim_step_count(one.opt) == count);
        assert_same_optim(&two, &one); /* as two, which skipped that step */
        int n;
        const nb_named_tensor *st = nb_optim_state(one.opt, &n);
        for (int k = 0; k < n; k++)
            if (strstr(st[k].name, ".step")) ck_assert(*(int64_t *)st[k].tensor->data == count);
        NBT_EXPECT_ABORT(nb_optim_unstep(one.opt), "nb_optim_unstep: the optimizer's last step");
        nb_optim_step(one.opt); /* a plain step: nothing to undo */
        NBT_EXPECT_ABORT(nb_optim_unstep(one.opt), "nb_optim_unstep");
        nb_optim_free(two.opt);
        nb_optim_free(one.opt);
        nb_ctx_free(step);
        nb_ctx_free(ctx);
    }
}
END_TEST

/* Note [Parameter shadows]: a two-layer product model under a bf16
 * compute dtype, trained by an optimizer whose parameters have shadows
 * (made before any gradient) and by one whose have none (gradients given
 * first, so no slot): the same bits at every step, through writes that
 * make the shadows stale (nb_copy_, nb_fill_, nb_set on a parameter) and
 * a step the device skips (a NaN gradient, nb_optim_step_clipped). */
typedef struct shadow_model {
    nb_tensor *w1, *w2;
    nb_optim *opt;
} shadow_model;

static void shadow_model_new(nb_ctx *ctx, shadow_model *m, bool slots) {
    m->w1 = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(16, 24), 21);
    m->w2 = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(24, 8), 22);
    if (!slots) {
        nb_set_grad(m->w1, nb_zeros_like(ctx, m->w1));
        nb_set_grad(m->w2, nb_zeros_like(ctx, m->w2));
    }
    nb_named_tensor ps[] = {{"w1", m->w1}, {"w2", m->w2}};
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 0.05;
    m->opt = nb_optim_new(NB_OPTIM_ADAMW, ps, 2, &h);
}

/* One step; the loss, and w1's gradient zeroed after. */
static double shadow_model_step(nb_ctx *step, shadow_model *m, nb_tensor *x, bool nan) {
    nb_ctx_reset(step);
    nb_tensor *y = nb_matmul(step, nb_matmul(step, x, m->w1), m->w2); /* bf16 */
    nb_tensor *l = nb_sum_all(step, nb_mul(step, y, y));
    nb_backward(l);
    if (nan) nb_set(m->w2->grad, (int64_t[]){1, 2}, NAN);
    double norm = nb_item(nb_optim_step_clipped(m->opt, step, 5.0, 2.0));
    if (!isfinite(norm)) nb_optim_unstep(m->opt);
    nb_optim_zero_grad(m->opt);
    return nb_item(l);
}

START_TEST(test_param_shadows) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *s1 = nb_ctx_new(nb_cpu(), 0), *s2 = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(s1, NB_BF16);
    nb_ctx_set_compute_dtype(s2, NB_BF16);
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(6, 16), 23);
    x->requires_grad = false;
    shadow_model a, b; /* with shadows; without */
    shadow_model_new(ctx, &a, true);
    shadow_model_new(ctx, &b, false);
    ck_assert(a.w1->priv->grad_slot && !b.w1->priv->grad_slot);
    for (int t = 0; t < 12; t++) {
        if (t == 4) { /* writes the shadows must see */
            nb_tensor *v = nbt_randn_leaf(s1, NB_F32, NB_SHAPE(16, 24), 30);
            nb_copy_(a.w1, v), nb_copy_(b.w1, v);
        }
        if (t == 6) nb_fill_(a.w2, 0.01), nb_fill_(b.w2, 0.01);
        if (t == 8) nb_set(a.w1, (int64_t[]){3, 5}, 2.5), nb_set(b.w1, (int64_t[]){3, 5}, 2.5);
        double la = shadow_model_step(s1, &a, x, t == 9);
        double lb = shadow_model_step(s2, &b, x, t == 9);
        ck_assert_msg(la == lb, "step %d: loss %.9g with shadows, %.9g without", t, la, lb);
        ck_assert(same_bits(a.w1, b.w1) && same_bits(a.w2, b.w2));
        ck_assert(nb_optim_step_count(a.opt) == nb_optim_step_count(b.opt));
    }
    ck_assert(a.w1->priv->grad_slot->shadow && a.w1->priv->grad_slot->shadow->dtype == NB_BF16);
    /* a valid shadow is read in place of a cast: its bits are the cast's */
    nb_ctx_reset(s1);
    nb_tensor *c = nb_matmul(s1, x, a.w1);
    (void)c;
    nb_tensor *cast = nb_cast(s1, a.w1, NB_BF16);
    ck_assert(memcmp(cast->data, a.w1->priv->grad_slot->shadow->data, 16 * 24 * 2) == 0);
    nb_optim_free(a.opt);
    nb_optim_free(b.opt);
    nb_ctx_free(s1);
    nb_ctx_free(s2);
    nb_ctx_free(ctx);
}
END_TEST

NBT_CPU_TEST(test_clip_accumulates_in_double) {
    /* 2^20 f32 values of 1e-3: a float accumulator is off by more than
     * 1e-5 relative, a double one by less than n * 2^-53 ~ 1e-10 */
    int64_t n = 1 << 20;
    nb_tensor *p = nbt_randn_leaf(ctx, NB_F32, 1, &n, 1);
    nb_set_grad(p, nb_full(ctx, NB_F32, 1, &n, 1e-3));
    nb_named_tensor np = {"p", p};
    double x = (double)1e-3f;
    double expect = sqrt((double)n * x * x);
    double norm = nb_clip_grad_norm(&np, 1, 1e9, 2.0);
    ck_assert_msg(fabs(norm - expect) <= 1e-10 * expect, "norm %.17g expected %.17g", norm, expect);
}

START_TEST(test_training_decreases_loss) {
    /* a least-squares problem: every optimizer must make progress */
    nb_optim_kind kinds[] = {NB_OPTIM_SGD, NB_OPTIM_ADAM, NB_OPTIM_ADAMW};
    for (int k = 0; k < 3; k++) {
        nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
        nb_tensor *w = nbt_randn_leaf(params, NB_F32, NB_SHAPE(4, 1), 1);
        nb_tensor *x = nbt_randn(params, NB_F32, NB_SHAPE(32, 4), 2);
        nb_tensor *y = nb_matmul(params, x, nbt_randn(params, NB_F32, NB_SHAPE(4, 1), 3));
        nb_named_tensor np = {"w", w};
        nb_optim_hparams h = k == 0 ? NB_SGD_DEFAULTS : k == 1 ? NB_ADAM_DEFAULTS : NB_ADAMW_DEFAULTS;
        h.lr = k == 0 ? 0.05 : 0.05;
        h.momentum = k == 0 ? 0.9 : 0;
        nb_optim *opt = nb_optim_new(kinds[k], &np, 1, &h);
        double first = 0, last = 0;
        for (int it = 0; it < 100; it++) {
            nb_ctx_reset(step);
            nb_tensor *loss = nb_mse_loss(step, nb_matmul(step, x, w), y);
            nb_optim_zero_grad(opt);
            nb_backward(loss);
            nb_optim_step(opt);
            last = nb_item(loss);
            if (it == 0) first = last;
        }
        ck_assert_msg(last < 0.05 * first, "%s: loss %g -> %g", nb_optim_kind_name(kinds[k]), first,
                      last);
        nb_optim_free(opt);
        nb_ctx_free(step);
        nb_ctx_free(params);
    }
}
END_TEST

/* ---- dynamic loss scaling ---- */
/* A small least-squares model: loss = mean((x w + b - y)^2), in ctx. */
static nb_tensor *scaler_model_loss(nb_ctx *ctx, nb_tensor *w, nb_tensor *b, nb_tensor *x,
                                    nb_tensor *y) {
    return nb_mse_loss(ctx, nb_add(ctx, nb_matmul(ctx, x, w), b), y);
}

START_TEST(test_grad_scaler_unscaled_equal_plain) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nbt_randn_leaf(params, NB_F32, NB_SHAPE(5, 3), 1);
    nb_tensor *b = nbt_randn_leaf(params, NB_F32, NB_SHAPE(3), 2);
    nb_tensor *x = nbt_randn(params, NB_F32, NB_SHAPE(8, 5), 3);
    nb_tensor *y = nbt_randn(params, NB_F32, NB_SHAPE(8, 3), 4);
    nb_named_tensor np[] = {{"w", w}, {"b", b}};
    nb_optim *opt = nb_optim_new(NB_OPTIM_SGD, np, 2, &(nb_optim_hparams){.lr = 0.1});
    nb_backward(scaler_model_loss(step, w, b, x, y));
    float gw[15], gb[3];
    nb_to_host(w->grad, gw);
    nb_to_host(b->grad, gb);
    nb_optim_zero_grad(opt);
    nb_ctx_reset(step);

    nb_grad_scaler *gs = nb_grad_scaler_new(65536.0, 2.0, 0.5, 2000);
    ck_assert(nb_grad_scaler_get_scale(gs) == 65536.0);
    nb_tensor *loss = scaler_model_loss(step, w, b, x, y);
    nb_tensor *scaled = nb_grad_scaler_scale(gs, step, loss);
    ck_assert(nb_item(scaled) == (double)(float)(nb_item(loss) * 65536.0));
    nb_backward(scaled);
    ck_assert(nb_get(w->grad, (int64_t[]){0, 0}) == 65536.0 * gw[0]);
    nb_grad_scaler_unscale(gs, opt);
    float uw[15], ub[3];
    nb_to_host(w->grad, uw);
    nb_to_host(b->grad, ub);
    ck_assert(memcmp(uw, gw, sizeof gw) == 0 && memcmp(ub, gb, sizeof gb) == 0);
    /* the step uses the unscaled gradients (not unscaled twice) */
    float w0 = (float)nb_get(w, (int64_t[]){0, 0});
    ck_assert(nb_grad_scaler_step(gs, opt));
    ck_assert(nb_get(w, (int64_t[]){0, 0}) == (double)(w0 + -0.1f * gw[0]));
    nb_grad_scaler_update(gs);
    ck_assert(nb_grad_scaler_get_scale(gs) == 65536.0);
    nb_grad_scaler_free(gs);
    nb_optim_free(opt);
    nb_ctx_free(step);
    nb_ctx_free(params);
}
END_TEST

NBT_CPU_TEST(test_grad_scaler_skip_growth_backoff) {
    nb_tensor *p = leaf_with_grad(ctx, NB_F32, N, 5);
    nb_tensor *q = leaf_with_grad(ctx, NB_F64, 2, 6);
    nb_named_tensor np[] = {{"p", p}, {"q", q}};
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAM, np, 2, &NB_ADAM_DEFAULTS);
    nb_grad_scaler *gs = nb_grad_scaler_new(1024.0, 2.0, 0.5, 3);
    double before[N];
    for (int i = 0; i < N; i++) before[i] = get1(p, i);
    const double bad[] = {INFINITY, -INFINITY, NAN};
    for (int k = 0; k < 3; k++) {
        /* one non-finite element anywhere: no step, the scale backs off */
        for (int i = 0; i < N; i++) set1(p->grad, i, 1024.0 * (i + 1));
        set1(q->grad, 0, 1.0);
        set1(q->grad, 1, 2.0);
        if (k == 2) set1(q->grad, 1, bad[k]);
        else set1(p->grad, 3, bad[k]);
        ck_assert(!nb_grad_scaler_step(gs, opt));
        nb_grad_scaler_update(gs);
        ck_assert_msg(nb_grad_scaler_get_scale(gs) == 1024.0 / (2 << k), "scale %g",
                      nb_grad_scaler_get_scale(gs));
        nbt_assert_close(p, before, 0, 0);
        ck_assert_int_eq(nb_optim_step_count(opt), 0);
    }
    /* finite steps: the scale grows after every 3 in a row, a skip resets the count */
    double scale = 128.0;
    set1(q->grad, 1, 2.0);
    for (int t = 1; t <= 7; t++) {
        for (int i = 0; i < N; i++) set1(p->grad, i, scale * 0.5);
        ck_assert(nb_grad_scaler_step(gs, opt));
        for (int i = 0; i < N; i++) ck_assert(get1(p->grad, i) == 0.5);
        nb_grad_scaler_update(gs);
        if (t % 3 == 0) scale *= 2;
        ck_assert_msg(nb_grad_scaler_get_scale(gs) == scale, "step %d: scale %g, expected %g", t,
                      nb_grad_scaler_get_scale(gs), scale);
    }
    ck_assert_int_eq(nb_optim_step_count(opt), 7);
    for (int i = 0; i < N; i++) ck_assert(get1(p, i) != before[i]);
    set1(p->grad, 0, NAN);
    ck_assert(!nb_grad_scaler_step(gs, opt));
    nb_grad_scaler_update(gs);
    ck_assert(nb_grad_scaler_get_scale(gs) == scale / 2);
    for (int t = 1; t <= 2; t++) {
        set1(p->grad, 0, 1.0);
        ck_assert(nb_grad_scaler_step(gs, opt));
        nb_grad_scaler_update(gs);
    }
    ck_assert(nb_grad_scaler_get_scale(gs) == scale / 2); /* 2 of 3 since the skip */

    /* misuse */
    NBT_EXPECT_ABORT(nb_grad_scaler_update(gs), "no gradients were checked since the last update");
    nb_grad_scaler_step(gs, opt);
    NBT_EXPECT_ABORT(nb_grad_scaler_step(gs, opt), "called twice");
    NBT_EXPECT_ABORT(nb_grad_scaler_unscale(gs, opt), "already stepped");
    nb_grad_scaler_update(gs);
    NBT_EXPECT_ABORT(nb_grad_scaler_new(0, 2, 0.5, 1), "init_scale = 0 must be finite and > 0");
    NBT_EXPECT_ABORT(nb_grad_scaler_new(1, 1, 0.5, 1), "growth_factor = 1 must be finite and > 1");
    NBT_EXPECT_ABORT(nb_grad_scaler_new(1, 2, 1, 1), "backoff_factor = 1 must be in (0, 1)");
    NBT_EXPECT_ABORT(nb_grad_scaler_new(1, 2, 0.5, 0), "growth_interval = 0 must be >= 1");
    nb_grad_scaler_free(gs);
    nb_grad_scaler_free(NULL);
    nb_optim_free(opt);
}

/* ---- gradients set to none (Note [Gradients set to none] in autograd/backward.c) ---- */

enum { MAX_TWIN = 40 };

/* t's values as doubles (f32 or f64; malloc'ed) */
static double *values_of(const nb_tensor *t) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    if (t->dtype == NB_F64) {
        nb_to_host(t, v);
    } else {
        float *f = malloc(sizeof *f * (size_t)(n ? n : 1));
        nb_to_host(t, f);
        for (int64_t i = 0; i < n; i++) v[i] = f[i];
        free(f);
    }
    return v;
}

/* a and b hold the same numbers (compared as numbers: a GEMM writing a
 * zero may give -0 where adding into zeros gives +0) */
static void assert_same_values(const char *what, const nb_tensor *a, const nb_tensor *b) {
    ck_assert_int_eq(nb_numel(a), nb_numel(b));
    double *u = values_of(a), *v = values_of(b);
    for (int64_t i = 0; i < nb_numel(a); i++)
        ck_assert_msg(u[i] == v[i], "%s[%lld]: %.17g and %.17g", what, (long long)i, u[i], v[i]);
    free(u);
    free(v);
}

/* A model with its AdamW and a step context of its own. */
typedef struct twin {
    nb_ctx *params, *step;
    nb_module *m;
    nb_named_tensor p[MAX_TWIN];
    int np;
    nb_optim *opt;
} twin;

typedef nb_module *(*make_fn)(nb_ctx *ctx);
typedef nb_tensor *(*loss_fn)(nb_module *m, nb_ctx *step, int it, int micro);

static void twin_new(twin *t, make_fn make, nb_dtype cd, double wd) {
    t->params = nb_ctx_new(nb_cpu(), 0);
    t->step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx_set_compute_dtype(t->step, cd);
    t->m = make(t->params);
    t->np = nb_module_named_parameters(t->m, t->p, MAX_TWIN);
    ck_assert_int_le(t->np, MAX_TWIN);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 0.01;
    h.weight_decay = wd;
    t->opt = nb_optim_new(NB_OPTIM_ADAMW, t->p, t->np, &h);
}

static void twin_free(twin *t) {
    nb_optim_free(t->opt);
    nb_ctx_free(t->step);
    nb_ctx_free(t->params);
}

/* Linear(8, 16), GELU(tanh), Linear(16, 16), Tanh, Linear(16, 4), f32; seed 5 */
static nb_module *none_mlp(nb_ctx *ctx) {
    nb_rng rng = nb_rng_make(5);
    nb_module *c[5] = {nb_linear_new(ctx, NB_F32, 8, 16, true, &rng), nb_gelu_new(ctx, NB_GELU_TANH),
                       nb_linear_new(ctx, NB_F32, 16, 16, true, &rng), nb_tanh_new(ctx),
                       nb_linear_new(ctx, NB_F32, 16, 4, true, &rng)};
    return nb_sequential_new(ctx, 5, c);
}

static nb_tensor *none_labels(nb_ctx *ctx, int64_t n, int64_t classes, uint64_t seed) {
    int64_t *lab = malloc(sizeof *lab * (size_t)n);
    for (int64_t i = 0; i < n; i++) lab[i] = (int64_t)((i * 5 + seed * 3) % (uint64_t)classes);
    nb_tensor *y = nb_from_host(ctx, NB_I64, NB_SHAPE(n), lab);
    free(lab);
    return y;
}

static nb_tensor *none_mlp_loss(nb_module *m, nb_ctx *step, int it, int micro) {
    uint64_t seed = 40 + 10 * (uint64_t)it + (uint64_t)micro;
    nb_tensor *x = nbt_randn(step, NB_F32, 2, (int64_t[]){12, 8}, seed);
    return nb_cross_entropy(step, nb_module_forward(m, step, x), none_labels(step, 12, 4, seed), NULL);
}

/* a GPT of 2 layers, vocabulary 64, block 16, width 16, f32; seed 9 */
static nb_module *none_gpt(nb_ctx *ctx) {
    nb_gpt_config cfg = {64, 16, 2, 2, 16, 0.0};
    nb_rng rng = nb_rng_make(9);
    return nb_gpt_new(ctx, NB_F32, &cfg, &rng);
}

static nb_tensor *none_gpt_loss(nb_module *m, nb_ctx *step, int it, int micro) {
    uint64_t seed = 60 + 10 * (uint64_t)it + (uint64_t)micro;
    int64_t tok[2][64];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 64; i++) tok[k][i] = (int64_t)((uint64_t)(i * (7 + k) + 3 * k) * seed % 64);
    nb_tensor *x = nb_from_host(step, NB_I64, NB_SHAPE(4, 16), tok[0]);
    nb_tensor *y = nb_from_host(step, NB_I64, NB_SHAPE(4, 16), tok[1]);
    return nb_gpt_forward_loss(m, step, x, y);
}

/* Training with nb_optim_zero_grad (a) and nb_optim_zero_grad_to_none (b)
 * from the same start: after every backward the same gradients, b's in
 * the memory its gradients had before they were set to none; after every
 * step b's gradients NULL; the same parameters throughout. Bitwise (as
 * numbers): the first writer's GEMM with beta = 0 forms the product the
 * beta = 1 GEMM adds to zeros, layer norm and the embeddings write the
 * sums they would add to zeros, and x + 0 = x. */
static void check_to_none_same(make_fn make, loss_fn loss, nb_dtype cd, int steps) {
    twin a, b;
    twin_new(&a, make, cd, 0.1);
    twin_new(&b, make, cd, 0.1);
    void *mem[MAX_TWIN] = {0};
    for (int it = 0; it < steps; it++) {
        twin *t[2] = {&a, &b};
        for (int k = 0; k < 2; k++) {
            nb_ctx_reset(t[k]->step);
            nb_backward(loss(t[k]->m, t[k]->step, it, 0));
        }
        for (int i = 0; i < a.np; i++) {
            ck_assert_ptr_nonnull(b.p[i].tensor->grad);
            assert_same_values(a.p[i].name, a.p[i].tensor->grad, b.p[i].tensor->grad);
            if (it == 0) mem[i] = b.p[i].tensor->grad->data;
            ck_assert_msg(b.p[i].tensor->grad->data == mem[i], "%s: gradient moved", b.p[i].name);
        }
        nb_optim_step(a.opt);
        nb_optim_step(b.opt);
        nb_optim_zero_grad(a.opt);
        nb_optim_zero_grad_to_none(b.opt);
        for (int i = 0; i < b.np; i++) ck_assert_ptr_null(b.p[i].tensor->grad);
    }
    for (int i = 0; i < a.np; i++) assert_same_values(a.p[i].name, a.p[i].tensor, b.p[i].tensor);
    twin_free(&a);
    twin_free(&b);
}

START_TEST(test_to_none_same_training) {
    for (int epi = 0; epi < 2; epi++) { /* the bias's gradient by the GEMM's BGRAD epilogue, or apart */
        nb__gemm_epilogues_force(epi);
        check_to_none_same(none_mlp, none_mlp_loss, NB_F32, 4);
        check_to_none_same(none_gpt, none_gpt_loss, NB_F32, 3);
        check_to_none_same(none_gpt, none_gpt_loss, NB_BF16, 3);
        nb__gemm_epilogues_force(-1);
    }
}
END_TEST

/* f64: E (7, 4) gathered by indices with repeats, layer norm (w, b),
 * Linear (W (3, 4), bias (3)), loss sum(out * r) */
typedef struct none_small {
    nb_ctx *ctx;
    nb_tensor *p[5];
    nb_tensor *idx, *r;
} none_small;

/* element i of t in row-major order */
static void flat_index(const nb_tensor *t, int64_t i, int64_t *at) {
    for (int d = t->ndim - 1; d >= 0; d--) {
        at[d] = i % t->shape[d];
        i /= t->shape[d];
    }
}
static double flat_get(const nb_tensor *t, int64_t i) {
    int64_t at[NB_MAX_DIMS];
    flat_index(t, i, at);
    return nb_get(t, at);
}
static void flat_set(nb_tensor *t, int64_t i, double v) {
    int64_t at[NB_MAX_DIMS];
    flat_index(t, i, at);
    nb_set(t, at, v);
}

static nb_tensor *none_small_loss(none_small *s, nb_ctx *step) {
    nb_tensor *h = nb_layer_norm(step, nb_embedding(step, s->p[0], s->idx), 1, s->p[1], s->p[2], 1e-5);
    return nb_sum_all(step, nb_mul(step, nb__linear(step, h, s->p[3], s->p[4]), s->r));
}

/* After a step and nb_optim_zero_grad_to_none (the memory holding the
 * last gradients), the next backward's gradients equal float64 central
 * differences: every first contribution was written over the stale ones. */
START_TEST(test_to_none_gradcheck) {
    for (int epi = 0; epi < 2; epi++) {
        nb__gemm_epilogues_force(epi);
        none_small s = {.ctx = nb_ctx_new(nb_cpu(), 0)};
        int64_t shapes[5][2] = {{7, 4}, {4, 0}, {4, 0}, {3, 4}, {3, 0}};
        nb_named_tensor np[5];
        const char *names[5] = {"E", "ln.w", "ln.b", "W", "bias"};
        for (int k = 0; k < 5; k++) {
            s.p[k] = nbt_randn_leaf(s.ctx, NB_F64, shapes[k][1] ? 2 : 1, shapes[k], 70 + (uint64_t)k);
            np[k] = (nb_named_tensor){names[k], s.p[k]};
        }
        int64_t ix[10] = {0, 1, 1, 3, 0, 6, 6, 2, 0, 1};
        s.idx = nb_from_host(s.ctx, NB_I64, NB_SHAPE(2, 5), ix);
        s.r = nbt_randn(s.ctx, NB_F64, 3, (int64_t[]){2, 5, 3}, 80);
        nb_optim_hparams h = NB_ADAMW_DEFAULTS;
        h.lr = 0.1;
        nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, np, 5, &h);
        nb_ctx *step = nb_ctx_new(nb_cpu(), 0);
        nb_backward(none_small_loss(&s, step));
        nb_optim_step(opt);
        nb_optim_zero_grad_to_none(opt);
        nb_ctx_reset(step);
        nb_backward(none_small_loss(&s, step));
        bool prev = nb_set_grad_enabled(false);
        for (int k = 0; k < 5; k++) {
            const nb_tensor *g = s.p[k]->grad;
            ck_assert_ptr_nonnull(g);
            for (int64_t i = 0; i < nb_numel(s.p[k]); i++) {
                double x0 = flat_get(s.p[k], i), e = 1e-5;
                flat_set(s.p[k], i, x0 + e);
                nb_ctx_reset(step);
                double up = nb_item(none_small_loss(&s, step));
                flat_set(s.p[k], i, x0 - e);
                nb_ctx_reset(step);
                double down = nb_item(none_small_loss(&s, step));
                flat_set(s.p[k], i, x0);
                double fd = (up - down) / (2 * e), an = flat_get(g, i);
                ck_assert_msg(fabs(an - fd) <= 1e-7 * (1 + fabs(fd)), "epilogues %d: %s[%lld]: %.12g, finite "
                              "differences %.12g", epi, names[k], (long long)i, an, fd);
            }
        }
        nb_set_grad_enabled(prev);
        nb__gemm_epilogues_force(-1);
        nb_optim_free(opt);
        nb_ctx_free(step);
        nb_ctx_free(s.ctx);
    }
}
END_TEST

/* Linear a and Linear b (6 -> 3, f32) added; seed 3 */
static nb_module *none_branches(nb_ctx *ctx) {
    nb_rng rng = nb_rng_make(3);
    nb_module *m = nb_module_list_new(ctx);
    nb_module_add(m, "a", nb_linear_new(ctx, NB_F32, 6, 3, true, &rng));
    nb_module_add(m, "b", nb_linear_new(ctx, NB_F32, 6, 3, true, &rng));
    return m;
}

/* A parameter unused in a step after nb_optim_zero_grad_to_none keeps its
 * gradient NULL and its value (AdamW with weight decay, which moves it
 * after nb_optim_zero_grad: the old call's zero gradient), and its step
 * count; the used ones get the same values both ways. */
START_TEST(test_to_none_unused_kept) {
    twin t[2];
    for (int k = 0; k < 2; k++) twin_new(&t[k], none_branches, NB_F32, 0.1);
    double *before[4];
    for (int it = 0; it < 2; it++)
        for (int k = 0; k < 2; k++) {
            nb_ctx_reset(t[k].step);
            nb_tensor *x = nbt_randn(t[k].step, NB_F32, 2, (int64_t[]){5, 6}, 90 + (uint64_t)it);
            nb_tensor *y = nb_module_forward(nb_module_child(t[k].m, "a"), t[k].step, x);
            if (it == 0)
                y = nb_add(t[k].step, y, nb_module_forward(nb_module_child(t[k].m, "b"), t[k].step, x));
            nb_backward(nbt_weighted_sum(t[k].step, y));
            if (it == 1 && k == 1) {
                for (int i = 0; i < t[k].np; i++) {
                    bool of_b = strncmp(t[k].p[i].name, "b.", 2) == 0;
                    ck_assert_msg((t[k].p[i].tensor->grad == NULL) == of_b, "%s", t[k].p[i].name);
                    if (of_b) before[i] = values_of(t[k].p[i].tensor);
                }
            }
            nb_optim_step(t[k].opt);
            if (k == 0) nb_optim_zero_grad(t[k].opt);
            else nb_optim_zero_grad_to_none(t[k].opt);
        }
    int n_b = 0;
    for (int i = 0; i < t[1].np; i++) {
        nb_tensor *p1 = t[1].p[i].tensor, *p0 = t[0].p[i].tensor;
        if (strncmp(t[1].p[i].name, "b.", 2) != 0) {
            assert_same_values(t[1].p[i].name, p0, p1);
            continue;
        }
        n_b++;
        double *now = values_of(p1), *old_way = values_of(p0);
        bool moved = false;
        for (int64_t j = 0; j < nb_numel(p1); j++) {
            ck_assert_msg(now[j] == before[i][j], "%s[%lld] moved", t[1].p[i].name, (long long)j);
            moved |= old_way[j] != now[j];
        }
        ck_assert_msg(moved, "%s: the old call's zero gradient should have moved it", t[1].p[i].name);
        ck_assert_ptr_null(p1->grad);
        char key[64];
        snprintf(key, sizeof key, "optim.state.%s.step", t[1].p[i].name);
        ck_assert_int_eq(*(const int64_t *)state_named(t[1].opt, key)->data, 1);
        free(now);
        free(old_way);
        free(before[i]);
    }
    ck_assert_int_eq(n_b, 2);
    for (int k = 0; k < 2; k++) twin_free(&t[k]);
}
END_TEST

static nb_module *none_mlp64(nb_ctx *ctx) {
    nb_rng rng = nb_rng_make(6);
    nb_module *c[3] = {nb_linear_new(ctx, NB_F64, 8, 16, true, &rng), nb_tanh_new(ctx),
                       nb_linear_new(ctx, NB_F64, 16, 4, true, &rng)};
    return nb_sequential_new(ctx, 3, c);
}

static nb_tensor *none_mlp64_loss(nb_module *m, nb_ctx *step, int it, int micro) {
    uint64_t seed = 140 + 10 * (uint64_t)it + (uint64_t)micro;
    nb_tensor *x = nbt_randn(step, NB_F64, 2, (int64_t[]){6, 8}, seed);
    return nb_cross_entropy(step, nb_module_forward(m, step, x), none_labels(step, 6, 4, seed), NULL);
}

/* Gradient accumulation over two micro-batches after
 * nb_optim_zero_grad_to_none: the first backward writes, the second adds.
 * The same numbers as with nb_optim_zero_grad, and, within rounding (the
 * sums are formed in another order), the gradients of one backward of
 * both micro-batches' losses added. f64. */
START_TEST(test_to_none_accumulation) {
    twin t[3];
    for (int k = 0; k < 3; k++) twin_new(&t[k], none_mlp64, NB_F32, 0.0);
    for (int it = 0; it < 3; it++) {
        for (int k = 0; k < 2; k++) {
            nb_ctx_reset(t[k].step);
            nb_backward(none_mlp64_loss(t[k].m, t[k].step, it, 0));
            nb_backward(none_mlp64_loss(t[k].m, t[k].step, it, 1));
        }
        nb_ctx_reset(t[2].step);
        nb_backward(nb_add(t[2].step, none_mlp64_loss(t[2].m, t[2].step, it, 0),
                           none_mlp64_loss(t[2].m, t[2].step, it, 1)));
        for (int i = 0; i < t[0].np; i++) {
            assert_same_values(t[0].p[i].name, t[0].p[i].tensor->grad, t[1].p[i].tensor->grad);
            nbt_assert_tensors_close(t[1].p[i].tensor->grad, t[2].p[i].tensor->grad, 1e-14, 1e-12);
        }
        for (int k = 0; k < 3; k++) nb_optim_step(t[k].opt);
        nb_optim_zero_grad(t[0].opt);
        nb_optim_zero_grad_to_none(t[1].opt);
        nb_optim_zero_grad(t[2].opt);
    }
    for (int k = 0; k < 3; k++) twin_free(&t[k]);
}
END_TEST

START_TEST(test_kind_names) {
    ck_assert_str_eq(nb_optim_kind_name(NB_OPTIM_SGD), "sgd");
    ck_assert_str_eq(nb_optim_kind_name(NB_OPTIM_ADAM), "adam");
    ck_assert_str_eq(nb_optim_kind_name(NB_OPTIM_ADAMW), "adamw");
}
END_TEST

/* Note [NULL handles] in util/handle.h: optimizer, scaler and DDP entry
 * points given NULL abort naming themselves. */
START_TEST(test_null_handles) {
    NBT_EXPECT_ABORT(nb_optim_step(NULL), "nb_optim_step: the optimizer is NULL: the call that "
                     "should have made it most likely failed and its nb_status was not checked");
    NBT_EXPECT_ABORT(nb_optim_zero_grad(NULL), "nb_optim_zero_grad: the optimizer is NULL");
    NBT_EXPECT_ABORT(nb_optim_zero_grad_to_none(NULL), "nb_optim_zero_grad_to_none: the optimizer is NULL");
    NBT_EXPECT_ABORT(nb_optim_lr(NULL, 0), "nb_optim_lr: the optimizer is NULL");
    NBT_EXPECT_ABORT(nb_optim_step_count(NULL), "nb_optim_step_count: the optimizer is NULL");
    NBT_EXPECT_ABORT(nb_optim_clip_grad_norm(NULL, 1, 2), "nb_optim_clip_grad_norm: the optimizer");
    NBT_EXPECT_ABORT(nb_grad_scaler_update(NULL), "nb_grad_scaler_update: the gradient scaler is NULL");
    NBT_EXPECT_ABORT(nb_ddp_step(NULL), "nb_ddp_step: the DDP handle is NULL");
    NBT_EXPECT_ABORT(nb_ddp_backward(NULL, NULL), "nb_ddp_backward: the DDP handle is NULL");
    NBT_EXPECT_ABORT(nb_ddp_forward(NULL, NULL, NULL, NULL), "nb_ddp_forward: the DDP handle");
    NBT_EXPECT_ABORT(nb_ddp_module(NULL), "nb_ddp_module: the DDP handle is NULL");
    nb_optim_free(NULL);
    nb_grad_scaler_free(NULL);
    nb_ddp_free(NULL);
}
END_TEST

int main(void) {
    const TTest *tests[] = {test_sgd_closed_form, test_sgd_reference, test_adam_closed_form,
                             test_adam_reference, test_amsgrad_reference, test_amsgrad_nan_propagates,
                             test_amsgrad_state, test_amsgrad_checkpoint_resume,
                             test_adam_moment_exact_at_beta1_zero, test_skips_params_without_grad,
                             test_zero_grad_keeps_buffers, test_flat_gradients, test_gradient_segments, test_param_groups,
                             test_construction_errors, test_state_export, test_schedules, test_clip_grad_norm,
                             test_clip_grad_norm_tensor, test_step_clipped, test_param_shadows,
                             test_clip_accumulates_in_double,
                             test_training_decreases_loss, test_grad_scaler_unscaled_equal_plain,
                             test_grad_scaler_skip_growth_backoff, test_to_none_same_training,
                             test_to_none_gradcheck, test_to_none_unused_kept, test_to_none_accumulation,
                             test_kind_names, test_null_handles, NULL};
    return nbt_run(nbt_suite("optim", "core", 0, tests));
}
