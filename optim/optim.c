/* The optimizer handle: construction and checks, parameter groups, the
 * step loop, zero_grad, hyperparameter access, and the state exported for
 * checkpoints. The update rules themselves are the backends' multi-tensor
 * updates (tensor/cpu/optim.c, tensor/cuda/optim.cu; Note [Optimizer step]).
 *
 * State is allocated eagerly, zero-filled, at construction (moments and
 * momentum buffers have their parameter's shape and dtype), with a
 * per-parameter step count of 0. A step count of 0 plays the role of
 * PyTorch's "no state yet": SGD takes it to mean "initialise the momentum
 * buffer with the gradient", and a checkpoint taken before a parameter's
 * first update restores exactly that. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim/internal.h"
#include "tensor/backend.h"
#include "util/handle.h"

const char *nb_optim_kind_name(nb_optim_kind kind) {
    switch (kind) {
    case NB_OPTIM_SGD: return "sgd";
    case NB_OPTIM_ADAM: return "adam";
    case NB_OPTIM_ADAMW: return "adamw";
    }
    return "unknown";
}

static const char *hp_names[NB__HP_COUNT] = {
    [NB__HP_LR] = "lr",           [NB__HP_WEIGHT_DECAY] = "weight_decay",
    [NB__HP_MOMENTUM] = "momentum", [NB__HP_DAMPENING] = "dampening",
    [NB__HP_NESTEROV] = "nesterov", [NB__HP_BETA1] = "beta1",
    [NB__HP_BETA2] = "beta2",     [NB__HP_EPS] = "eps",
    [NB__HP_AMSGRAD] = "amsgrad",
};

static bool hp_applies(nb_optim_kind kind, int k) {
    if (k == NB__HP_LR || k == NB__HP_WEIGHT_DECAY) return true;
    bool sgd_only = k == NB__HP_MOMENTUM || k == NB__HP_DAMPENING || k == NB__HP_NESTEROV;
    return (kind == NB_OPTIM_SGD) == sgd_only;
}

const char *nb__optim_check_hparams(nb_optim_kind kind, const double *hp, char *buf, size_t n) {
    double lr = hp[NB__HP_LR], wd = hp[NB__HP_WEIGHT_DECAY];
    if (!(isfinite(lr) && lr >= 0)) return snprintf(buf, n, "lr = %g must be finite and >= 0", lr), buf;
    if (!(isfinite(wd) && wd >= 0))
        return snprintf(buf, n, "weight_decay = %g must be finite and >= 0", wd), buf;
    if (kind == NB_OPTIM_SGD) {
        double mom = hp[NB__HP_MOMENTUM], damp = hp[NB__HP_DAMPENING], nest = hp[NB__HP_NESTEROV];
        if (!(isfinite(mom) && mom >= 0))
            return snprintf(buf, n, "momentum = %g must be finite and >= 0", mom), buf;
        if (!isfinite(damp)) return snprintf(buf, n, "dampening = %g must be finite", damp), buf;
        if (nest != 0 && nest != 1) return snprintf(buf, n, "nesterov = %g must be 0 or 1", nest), buf;
        if (nest == 1 && (mom <= 0 || damp != 0))
            return snprintf(buf, n, "nesterov momentum needs momentum > 0 and dampening 0 "
                            "(momentum = %g, dampening = %g)", mom, damp), buf;
        return NULL;
    }
    for (int k = NB__HP_BETA1; k <= NB__HP_BETA2; k++)
        if (!(hp[k] >= 0 && hp[k] < 1))
            return snprintf(buf, n, "%s = %g must be in [0, 1)", hp_names[k], hp[k]), buf;
    if (!(isfinite(hp[NB__HP_EPS]) && hp[NB__HP_EPS] >= 0))
        return snprintf(buf, n, "eps = %g must be finite and >= 0", hp[NB__HP_EPS]), buf;
    if (hp[NB__HP_AMSGRAD] != 0 && hp[NB__HP_AMSGRAD] != 1)
        return snprintf(buf, n, "amsgrad = %g must be 0 or 1", hp[NB__HP_AMSGRAD]), buf;
    return NULL;
}

static void hp_from_struct(const nb_optim_hparams *h, double *hp) {
    hp[NB__HP_LR] = h->lr;
    hp[NB__HP_WEIGHT_DECAY] = h->weight_decay;
    hp[NB__HP_MOMENTUM] = h->momentum;
    hp[NB__HP_DAMPENING] = h->dampening;
    hp[NB__HP_NESTEROV] = h->nesterov ? 1 : 0;
    hp[NB__HP_BETA1] = h->beta1;
    hp[NB__HP_BETA2] = h->beta2;
    hp[NB__HP_EPS] = h->eps;
    hp[NB__HP_AMSGRAD] = h->amsgrad ? 1 : 0;
}

static const char *copy_str(nb_ctx *ctx, const char *a, const char *b, const char *c) {
    size_t na = strlen(a), nb = strlen(b), nc = strlen(c);
    char *s = nb__ctx_meta(ctx, na + nb + nc + 1);
    memcpy(s, a, na);
    memcpy(s + na, b, nb);
    memcpy(s + na + nb, c, nc + 1);
    return s;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(((const nb_named_tensor *)a)->name, ((const nb_named_tensor *)b)->name);
}

static int cmp_tensor(const void *a, const void *b) {
    const nb_tensor *x = ((const nb_named_tensor *)a)->tensor;
    const nb_tensor *y = ((const nb_named_tensor *)b)->tensor;
    return x < y ? -1 : x > y;
}

static void check_param(const char *who, const nb_named_tensor *nt, int group, int index) {
    NB_CHECK(nt->name && nt->name[0], "%s: parameter %d of group %d has no name (names key the "
             "optimizer state in checkpoints)", who, index, group);
    const nb_tensor *t = nt->tensor;
    NB_CHECK(t, "%s: parameter \"%s\" is NULL", who, nt->name);
    NB_CHECK(nb_is_leaf(t), "%s: parameter \"%s\" %s is not a leaf that requires grad%s", who,
             nt->name, nb_shape_str(t), t->node ? " (it was made by an op)" : "");
    NB_CHECK(t->dtype == NB_F32 || t->dtype == NB_F64,
             "%s: parameter \"%s\" has dtype %s; optimizers update f32 or f64 parameters", who,
             nt->name, nb_dtype_name(t->dtype));
    NB_CHECK(nb_is_contiguous(t), "%s: parameter \"%s\" %s is not contiguous", who, nt->name,
             nb_shape_str(t));
}

/* Rejects a name or a tensor that appears twice, over all groups; aborts
 * with nothing allocated. */
static void check_unique(const char *who, int n_groups, const nb_param_group *groups, int total) {
    nb_named_tensor *v = malloc(sizeof *v * (size_t)total);
    NB_CHECK(v, "%s: out of memory", who);
    int k = 0;
    for (int g = 0; g < n_groups; g++)
        for (int i = 0; i < groups[g].n; i++) v[k++] = groups[g].params[i];
    char a[128] = "", b[128] = "";
    qsort(v, (size_t)total, sizeof *v, cmp_name);
    for (int i = 1; i < total && !a[0]; i++)
        if (strcmp(v[i - 1].name, v[i].name) == 0) snprintf(a, sizeof a, "%s", v[i].name);
    if (a[0]) {
        free(v);
        NB_ABORT("%s: two parameters are named \"%s\"", who, a);
    }
    qsort(v, (size_t)total, sizeof *v, cmp_tensor);
    for (int i = 1; i < total && !a[0]; i++)
        if (v[i - 1].tensor == v[i].tensor) {
            /* name order, so the message does not depend on addresses */
            bool swap = strcmp(v[i - 1].name, v[i].name) > 0;
            snprintf(a, sizeof a, "%s", v[i - 1 + swap].name);
            snprintf(b, sizeof b, "%s", v[i - swap].name);
        }
    free(v);
    NB_CHECK(!a[0], "%s: \"%s\" and \"%s\" are the same tensor; a parameter may appear in only "
             "one group, once", who, a, b);
}

static int n_moments(const nb_optim *opt, const nb__optim_param *p);
static const char *const *moment_names(const nb_optim *opt);
static void alloc_moments(nb_optim *opt);

static void add_state(nb_optim *opt, const char *name, nb_tensor *t) {
    opt->state[opt->n_state].name = name;
    opt->state[opt->n_state].tensor = t;
    opt->n_state++;
}

nb_optim *nb_optim_new_groups(nb_optim_kind kind, int n_groups, const nb_param_group *groups) {
    const char *who = "nb_optim_new";
    NB_CHECK(kind == NB_OPTIM_SGD || kind == NB_OPTIM_ADAM || kind == NB_OPTIM_ADAMW,
             "%s: unknown optimizer kind %d", who, (int)kind);
    NB_CHECK(n_groups > 0 && groups, "%s: %d parameter groups given; need at least one", who,
             n_groups);
    int total = 0;
    for (int g = 0; g < n_groups; g++) {
        NB_CHECK(groups[g].n >= 0 && (groups[g].n == 0 || groups[g].params),
                 "%s: group %d has %d parameters and params %p", who, g, groups[g].n,
                 (const void *)groups[g].params);
        NB_CHECK(groups[g].n <= INT32_MAX - total, "%s: too many parameters", who);
        total += groups[g].n;
        double hp[NB__HP_COUNT];
        hp_from_struct(&groups[g].h, hp);
        char msg[256];
        const char *bad = nb__optim_check_hparams(kind, hp, msg, sizeof msg);
        NB_CHECK(!bad, "%s (%s): group %d: %s", who, nb_optim_kind_name(kind), g, bad);
        for (int i = 0; i < groups[g].n; i++) check_param(who, &groups[g].params[i], g, i);
    }
    NB_CHECK(total > 0, "%s: the optimizer got an empty parameter list", who);
    check_unique(who, n_groups, groups, total);

    nb_device dev = nb_cpu();
    for (int g = 0; g < n_groups; g++)
        if (groups[g].n > 0) {
            dev = groups[g].params[0].tensor->device;
            break;
        }
    for (int g = 0; g < n_groups; g++)
        for (int i = 0; i < groups[g].n; i++) {
            const nb_tensor *t = groups[g].params[i].tensor;
            NB_CHECK(nb_device_eq(t->device, dev), "%s: parameter \"%s\" is on %s, others on %s",
                     who, groups[g].params[i].name, nb_device_name(t->device),
                     nb_device_name(dev));
        }

    nb_optim *opt = calloc(1, sizeof *opt);
    NB_CHECK(opt, "%s: out of memory", who);
    opt->kind = kind;
    opt->n_counted = -1;
    /* the moments in a context of their own, so that ZeRO-1 can free them
     * (nb__optim_release_state) */
    opt->host_ctx = nb_ctx_new(nb_cpu(), 4096);
    opt->n_groups = n_groups;
    opt->n_params = total;
    opt->params = nb__ctx_meta(opt->host_ctx, sizeof *opt->params * (size_t)total);
    opt->group_hp = nb__ctx_meta(opt->host_ctx, sizeof *opt->group_hp * (size_t)n_groups);
    int k = 0;
    for (int g = 0; g < n_groups; g++) {
        opt->group_hp[g] = nb_zeros(opt->host_ctx, NB_F64, NB_SHAPE(NB__HP_COUNT));
        hp_from_struct(&groups[g].h, nb__optim_hp(opt, g));
        for (int i = 0; i < groups[g].n; i++, k++) {
            nb__optim_param *p = &opt->params[k];
            p->param = groups[g].params[i].tensor;
            p->name = copy_str(opt->host_ctx, groups[g].params[i].name, "", "");
            p->group = g;
        }
    }
    /* Note [Flat gradients] in autograd/backward.c: the gradients to come in one buffer */
    nb_tensor **ts = malloc(sizeof *ts * (size_t)total);
    NB_CHECK(ts, "%s: out of memory", who);
    for (int i = 0; i < total; i++) ts[i] = opt->params[i].param;
    nb__grad_flat_reserve(ts, total);
    free(ts);

    /* state: optim.step, the groups' hyperparameters, then per parameter */
    int per_param = kind == NB_OPTIM_SGD ? 2 : 4;
    opt->state = nb__ctx_meta(opt->host_ctx, sizeof *opt->state *
                              (size_t)(1 + NB__HP_COUNT * n_groups + per_param * total));
    opt->step_count = nb_zeros(opt->host_ctx, NB_I64, 0, NULL);
    add_state(opt, "optim.step", opt->step_count);
    for (int g = 0; g < n_groups; g++) {
        char prefix[48];
        snprintf(prefix, sizeof prefix, "optim.group.%d.", g);
        for (int h = 0; h < NB__HP_COUNT; h++) {
            if (!hp_applies(kind, h)) continue;
            /* amsgrad only where on: checkpoints without it keep their names */
            if (h == NB__HP_AMSGRAD && nb__optim_hp(opt, g)[h] == 0) continue;
            nb_tensor *v = nb__view(opt->host_ctx, opt->group_hp[g], 0, NULL, NULL,
                                    nb__optim_hp(opt, g) + h);
            add_state(opt, copy_str(opt->host_ctx, prefix, hp_names[h], ""), v);
        }
    }
    for (int i = 0; i < total; i++) {
        nb__optim_param *p = &opt->params[i];
        const char *prefix = copy_str(opt->host_ctx, "optim.state.", p->name, ".");
        p->step = nb_zeros(opt->host_ctx, NB_I64, 0, NULL);
        add_state(opt, copy_str(opt->host_ctx, prefix, "step", ""), p->step);
        p->state_at = opt->n_state;
        p->n_moments = n_moments(opt, p);
        for (int m = 0; m < p->n_moments; m++)
            add_state(opt, copy_str(opt->host_ctx, prefix, moment_names(opt)[m], ""), NULL);
    }
    alloc_moments(opt);
    return opt;
}

/* Element-wise state per parameter, in state-list order: SGD with
 * momentum: momentum_buffer; Adam, AdamW: exp_avg, exp_avg_sq and, with
 * amsgrad, max_exp_avg_sq. */
static int n_moments(const nb_optim *opt, const nb__optim_param *p) {
    const double *hp = nb__optim_hp(opt, p->group);
    if (opt->kind == NB_OPTIM_SGD) return hp[NB__HP_MOMENTUM] != 0;
    return hp[NB__HP_AMSGRAD] != 0 ? 3 : 2;
}

static const char *const *moment_names(const nb_optim *opt) {
    static const char *const sgd[] = {"momentum_buffer"};
    static const char *const adam[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    return opt->kind == NB_OPTIM_SGD ? sgd : adam;
}

static nb_tensor **moment_slot(nb__optim_param *p, nb_optim_kind kind, int k) {
    if (kind == NB_OPTIM_SGD) return &p->momentum_buffer;
    return k == 0 ? &p->exp_avg : k == 1 ? &p->exp_avg_sq : &p->max_exp_avg_sq;
}

/* Zero-filled moments in a fresh opt->ctx, entered into the state list. */
static void alloc_moments(nb_optim *opt) {
    size_t bytes = 4096;
    for (int i = 0; i < opt->n_params; i++) {
        const nb_tensor *t = opt->params[i].param;
        bytes += (size_t)opt->params[i].n_moments *
                 ((size_t)nb_numel(t) * nb_dtype_size(t->dtype) + 128) + 256;
    }
    opt->ctx = nb_ctx_new(opt->params[0].param->device, bytes);
    for (int i = 0; i < opt->n_params; i++) {
        nb__optim_param *p = &opt->params[i];
        for (int k = 0; k < p->n_moments; k++) {
            nb_tensor *m = nb_zeros_like(opt->ctx, p->param);
            *moment_slot(p, opt->kind, k) = m;
            opt->state[p->state_at + k].tensor = m;
        }
    }
    opt->released = false;
}

void nb__optim_release_state(nb_optim *opt) {
    if (opt->released) return;
    for (int i = 0; i < opt->n_params; i++) {
        nb__optim_param *p = &opt->params[i];
        for (int k = 0; k < p->n_moments; k++) {
            *moment_slot(p, opt->kind, k) = NULL;
            opt->state[p->state_at + k].tensor = NULL;
        }
    }
    nb_ctx_free(opt->ctx);
    opt->ctx = NULL;
    opt->released = true;
}

void nb__optim_alloc_state(nb_optim *opt) {
    if (opt->released) alloc_moments(opt);
}

int nb__optim_moment_count(const nb_optim *opt) {
    int k = 0;
    for (int i = 0; i < opt->n_params; i++)
        if (opt->params[i].n_moments > k) k = opt->params[i].n_moments;
    return k;
}

nb_tensor *nb__optim_moment(nb_optim *opt, int i, int k) {
    NB_CHECK(i >= 0 && i < opt->n_params && k >= 0, "nb__optim_moment: parameter %d of %d, moment %d", i,
             opt->n_params, k);
    nb__optim_param *p = &opt->params[i];
    return k < p->n_moments && !opt->released ? *moment_slot(p, opt->kind, k) : NULL;
}

const nb_named_tensor *nb__optim_state_entries(const nb_optim *opt, int *n) {
    *n = opt->n_state;
    return opt->state;
}

int nb__optim_moment_entry(const nb_optim *opt, int i, int k) {
    NB_CHECK(i >= 0 && i < opt->n_params && k >= 0, "nb__optim_moment_entry: parameter %d of %d, moment %d", i,
             opt->n_params, k);
    return k < opt->params[i].n_moments ? opt->params[i].state_at + k : -1;
}

static size_t moment_bytes(const nb_optim *opt) {
    size_t bytes = 0;
    for (int i = 0; i < opt->n_params; i++) {
        const nb__optim_param *p = &opt->params[i];
        const nb_tensor *m[4] = {p->exp_avg, p->exp_avg_sq, p->max_exp_avg_sq, p->momentum_buffer};
        for (int k = 0; k < 4; k++)
            if (m[k]) bytes += (size_t)nb_numel(m[k]) * nb_dtype_size(m[k]->dtype);
    }
    return bytes;
}

NB__HANDLE_GETTER(size_t, nb_optim_state_bytes, const nb_optim, opt, "optimizer",
                  moment_bytes(opt) + (opt->shard ? moment_bytes(opt->shard) : 0))

nb_optim *nb_optim_new(nb_optim_kind kind, const nb_named_tensor *params, int n,
                       const nb_optim_hparams *h) {
    NB_CHECK(h, "nb_optim_new: NULL hyperparameters (use e.g. &NB_ADAMW_DEFAULTS)");
    nb_param_group g = {params, n, *h};
    return nb_optim_new_groups(kind, 1, &g);
}

void nb_optim_free(nb_optim *opt) {
    if (!opt) return;
    nb_ctx_free(opt->host_ctx);
    nb_ctx_free(opt->ctx);
    free(opt->counted);
    free(opt);
}

void nb_optim_split_decay(const nb_named_tensor *params, int n, const nb_optim_hparams *h,
                          nb_named_tensor *scratch, nb_param_group out[2]) {
    NB_CHECK(n >= 0 && (n == 0 || (params && scratch)) && h && out,
             "nb_optim_split_decay: bad arguments (n = %d)", n);
    int k = 0;
    for (int pass = 0; pass < 2; pass++) {
        out[pass].params = scratch + k;
        out[pass].h = *h;
        int start = k;
        for (int i = 0; i < n; i++) {
            NB_CHECK(params[i].tensor, "nb_optim_split_decay: parameter %d (\"%s\") is NULL", i,
                     params[i].name ? params[i].name : "");
            bool matrix = params[i].tensor->ndim >= 2;
            if (matrix == (pass == 0)) scratch[k++] = params[i];
        }
        out[pass].n = k - start;
    }
    out[1].h.weight_decay = 0;
}

/* ---- stepping ---- */
static void check_grad(const nb__optim_param *p, const nb_tensor *g) {
    NB_CHECK(nb_same_shape(g, p->param) && g->dtype == p->param->dtype,
             "nb_optim_step: gradient of \"%s\" is %s %s, parameter is %s %s", p->name,
             nb_dtype_name(g->dtype), nb_shape_str(g), nb_dtype_name(p->param->dtype),
             nb_shape_str(p->param));
    NB_CHECK(nb_is_contiguous(g) && nb_device_eq(g->device, p->param->device),
             "nb_optim_step: gradient of \"%s\" %s must be contiguous and on the parameter's "
             "device (%s); it is on %s", p->name, nb_shape_str(g),
             nb_device_name(p->param->device), nb_device_name(g->device));
}

/* Note [Optimizer step]: every parameter with a gradient, grouped by
 * dtype, goes into one multi-tensor update of the parameters' backend
 * (tensor/backend.h: on CUDA one fused launch, on the CPU a loop). Step
 * counts and hyperparameters stay in host memory (opt->host_ctx), so the
 * step reads nothing back from the device. */
/* The parameters idx[0..n) (all of them when idx is NULL) that have a
 * gradient: one multi-tensor update per dtype. */
static void step_list(nb_optim *opt, const int *idx, int n, const nb__update_extras *x,
                      bool record) {
    const nb__backend *be = nb__backend_of(opt->params[0].param->device);
    nb_tensor **t = malloc(sizeof *t * 6 * (size_t)(n > 0 ? n : 1));
    int64_t *steps = malloc(sizeof *steps * (size_t)(n > 0 ? n : 1));
    const double **hp = malloc(sizeof *hp * (size_t)(n > 0 ? n : 1));
    NB_CHECK(t && steps && hp, "nb_optim_step: out of memory");
    nb_tensor **ps = t, **gs = t + n, **as = t + 2 * n, **bs = t + 3 * n, **cs = t + 4 * n;
    nb_tensor **hs = t + 5 * n; /* Note [Parameter shadows] in tensor/shadow.c */
    static const nb_dtype dtypes[2] = {NB_F32, NB_F64};
    if (record) {
        free(opt->counted);
        opt->counted = malloc(sizeof *opt->counted * (size_t)(n > 0 ? n : 1));
        NB_CHECK(opt->counted, "nb_optim_step: out of memory");
        opt->n_counted = 0;
    } else {
        opt->n_counted = -1;
    }
    for (int pass = 0; pass < 2; pass++) {
        int k = 0;
        bool any_shadow = false;
        for (int j = 0; j < n; j++) {
            nb__optim_param *p = &opt->params[idx ? idx[j] : j];
            nb_tensor *g = p->param->grad;
            if (!g || p->param->dtype != dtypes[pass]) continue;
            check_grad(p, g);
            steps[k] = ++*(int64_t *)p->step->data;
            if (record) opt->counted[opt->n_counted++] = idx ? idx[j] : j;
            hp[k] = nb__optim_hp(opt, p->group);
            ps[k] = p->param;
            gs[k] = g;
            as[k] = opt->kind == NB_OPTIM_SGD ? p->momentum_buffer : p->exp_avg;
            bs[k] = p->exp_avg_sq;
            cs[k] = p->max_exp_avg_sq;
            hs[k] = nb__shadow_for_update(p->param);
            any_shadow |= hs[k] != NULL;
            k++;
        }
        if (k == 0) continue;
        nb__update_extras xs = x ? *x : (nb__update_extras){0};
        xs.shadow = any_shadow ? hs : NULL;
        if (opt->kind == NB_OPTIM_SGD) be->sgd(k, ps, gs, as, steps, hp, &xs);
        else be->adam(k, ps, gs, as, bs, cs, steps, hp, opt->kind == NB_OPTIM_ADAMW, &xs);
        for (int j = 0; j < k; j++)
            if (hs[j]) nb__shadow_stamp(ps[j]);
    }
    free(t);
    free(steps);
    free(hp);
}

static const char *sharded_by(const nb_optim *opt) {
    return opt->lost ? "a DDP wrapper freed while attached (the shards are lost; call "
                       "nb_ddp_set_zero(ddp, NULL) before nb_ddp_free to keep the state)"
                     : "a DDP wrapper";
}

void nb__optim_check_not_bucket_stepped(const nb_optim *opt, const char *who) {
    NB_CHECK(opt->owner != NB__OPTIM_BUCKET_STEPPED,
             "%s: this optimizer is stepped per bucket by a DDP wrapper (nb_ddp_set_optimizer): "
             "nb_ddp_backward has already updated the parameters; do not call %s with it (to "
             "clip, scale or step by hand, detach it first with nb_ddp_set_optimizer(ddp, NULL))",
             who, who);
}

void nb__optim_check_not_sharded(const nb_optim *opt, const char *who, const char *instead) {
    NB_CHECK(opt->owner != NB__OPTIM_SHARDED && !opt->lost,
             "%s: this optimizer's state is sharded over the ranks by %s (ZeRO-1, "
             "nb_ddp_set_zero): %s", who, sharded_by(opt), instead);
}

void nb_optim_step(nb_optim *opt) {
    NB__CHECK_HANDLE("nb_optim_step", opt, "optimizer");
    nb__optim_check_not_bucket_stepped(opt, "nb_optim_step");
    nb__optim_check_not_sharded(opt, "nb_optim_step", "step with nb_ddp_step(ddp)");
    ++*(int64_t *)opt->step_count->data;
    step_list(opt, NULL, opt->n_params, NULL, false);
}

void nb__optim_step_extras(nb_optim *opt, const nb__update_extras *x, bool record) {
    ++*(int64_t *)opt->step_count->data;
    step_list(opt, NULL, opt->n_params, x, record);
}

void nb_optim_unstep(nb_optim *opt) {
    NB__CHECK_HANDLE("nb_optim_unstep", opt, "optimizer");
    NB_CHECK(opt->n_counted >= 0,
             "nb_optim_unstep: the optimizer's last step was not an nb_optim_step_clipped that "
             "advanced the step counts (or it was taken back already)");
    for (int j = 0; j < opt->n_counted; j++) --*(int64_t *)opt->params[opt->counted[j]].step->data;
    --*(int64_t *)opt->step_count->data;
    opt->n_counted = -1;
}

void nb__optim_step_params(nb_optim *opt, const int *idx, int n) {
    for (int j = 0; j < n; j++)
        NB_CHECK(idx[j] >= 0 && idx[j] < opt->n_params,
                 "nb__optim_step_params: index %d of %d parameters", idx[j], opt->n_params);
    step_list(opt, idx, n, NULL, false);
}

void nb__optim_count_step(nb_optim *opt) { ++*(int64_t *)opt->step_count->data; }

nb_tensor *nb__optim_param_tensor(const nb_optim *opt, int i) {
    NB_CHECK(i >= 0 && i < opt->n_params, "nb__optim_param_tensor: %d of %d", i, opt->n_params);
    return opt->params[i].param;
}

const char *nb__optim_param_name(const nb_optim *opt, int i) {
    NB_CHECK(i >= 0 && i < opt->n_params, "nb__optim_param_name: %d of %d", i, opt->n_params);
    return opt->params[i].name;
}

int nb__optim_param_index(const nb_optim *opt, const nb_tensor *t) {
    for (int i = 0; i < opt->n_params; i++)
        if (opt->params[i].param == t) return i;
    return -1;
}

/* Note [Flat gradients] in autograd/backward.c: the buffers (made) whose
 * every slot is one of opt's parameters', one memset each (a slot whose
 * parameter holds another gradient, or none, is not read).
 * nb_optim_zero_grad keeps PyTorch's set_to_none=False meaning: a
 * parameter that gets no gradient in the next backward holds zeros, which
 * Adam's update and weight decay still apply to, and the program may read
 * a gradient (nb_get, a norm) before any backward. The memset and the
 * first writer's read of the zeros are what nb_optim_zero_grad_to_none
 * saves (Note [Gradients set to none] in autograd/backward.c): there the
 * "not yet written" state is the NULL gradient, which every reader of
 * gradients already skips. */
/* flats: room for opt->n_params (one segment a parameter at most: Note
 * [Gradient segments]); a parameter's segment is found among the last
 * ones seen first, as the parameters come in slot order. */
static int whole_flats(nb_optim *opt, nb__grad_flat **flats) {
    int *count = calloc((size_t)opt->n_params + 1, sizeof *count);
    NB_CHECK(count, "nb_optim_zero_grad: out of memory for %d counts", opt->n_params);
    int nf = 0, nw = 0;
    for (int i = 0; i < opt->n_params; i++) {
        const nb__grad_slot *s = opt->params[i].param->priv->grad_slot;
        nb__grad_flat *f = s && s->flat->buf && !s->flat->released ? s->flat : NULL;
        if (!f) continue;
        int k = nf - 1;
        while (k >= 0 && flats[k] != f) k--;
        if (k < 0) flats[k = nf++] = f;
        count[k]++;
    }
    for (int k = 0; k < nf; k++)
        if (count[k] == flats[k]->n_slots) flats[nw++] = flats[k];
    free(count);
    return nw;
}

void nb_optim_zero_grad(nb_optim *opt) {
    NB__CHECK_HANDLE("nb_optim_zero_grad", opt, "optimizer");
    nb__grad_flat **flats = malloc(((size_t)opt->n_params + 1) * sizeof *flats);
    NB_CHECK(flats, "nb_optim_zero_grad: out of memory for %d buffers", opt->n_params);
    int nw = whole_flats(opt, flats);
    for (int k = 0; k < nw; k++) {
        nb_tensor *b = flats[k]->buf;
        nb__backend_at(b)->memset(b->device.index, b->data, 0,
                                  (size_t)nb_numel(b) * nb_dtype_size(b->dtype));
    }
    for (int i = 0; i < opt->n_params; i++) {
        nb_tensor *g = opt->params[i].param->grad;
        if (!g) continue;
        nb__grad_flat *f = nb_numel(g) ? nb__grad_in_flat(opt->params[i].param) : NULL;
        bool cleared = false;
        for (int k = 0; k < nw && f && !cleared; k++) cleared = flats[k] == f;
        if (cleared) continue;
        size_t bytes = (size_t)nb_numel(g) * nb_dtype_size(g->dtype); /* 0.0 is all zeros */
        if (!nb_is_contiguous(g) || bytes == 0)
            nb_zero_grad(opt->params[i].param);
        else
            nb__backend_at(g)->memset(g->device.index, g->data, 0, bytes);
    }
    free(flats);
}

/* Note [Gradients set to none] in autograd/backward.c. An owner that
 * reads or zeroes gradient memory itself is refused: ZeRO's reduce-scatter
 * of whole bucket flats and its step over their shards, the per-bucket
 * step, FSDP's shard gradients (zeroed by nb_fsdp_step). Plain DDP is
 * served: its reducer zero-fills a NULL gradient before its bucket is
 * reduced. */
void nb_optim_zero_grad_to_none(nb_optim *opt) {
    NB__CHECK_HANDLE("nb_optim_zero_grad_to_none", opt, "optimizer");
    NB_CHECK(!opt->owner && !opt->lost,
             "nb_optim_zero_grad_to_none: this optimizer is %s, which reads or zeroes the "
             "gradients' memory itself (whole bucket flats, shard gradients), where a gradient "
             "set to none would be read stale; use nb_optim_zero_grad",
             opt->owner == NB__OPTIM_BUCKET_STEPPED
                 ? "stepped per bucket by a DDP wrapper (nb_ddp_set_optimizer)"
                 : "sharded over the ranks (ZeRO, nb_ddp_set_zero; or FSDP, nb_fsdp_set_optimizer)");
    for (int i = 0; i < opt->n_params; i++) nb__grad_set_none(opt->params[i].param);
    /* Note [Gradient segments]: the segments all of whose slots are these
     * parameters' (none holds a gradient now) are given back */
    nb__grad_flat **flats = malloc(((size_t)opt->n_params + 1) * sizeof *flats);
    NB_CHECK(flats, "nb_optim_zero_grad_to_none: out of memory for %d buffers", opt->n_params);
    int nw = whole_flats(opt, flats);
    for (int k = 0; k < nw; k++) nb__grad_flat_release(flats[k]);
    free(flats);
}

/* ---- access ---- */
static void check_group(const char *who, const nb_optim *opt, int group) {
    NB_CHECK(opt, "%s: NULL optimizer", who);
    NB_CHECK(group >= 0 && group < opt->n_groups, "%s: group %d out of range (the optimizer has %d)",
             who, group, opt->n_groups);
}

NB__HANDLE_GETTER(nb_optim_kind, nb_optim_get_kind, const nb_optim, opt, "optimizer", opt->kind)
NB__HANDLE_GETTER(int, nb_optim_group_count, const nb_optim, opt, "optimizer", opt->n_groups)
NB__HANDLE_GETTER(int, nb_optim_param_count, const nb_optim, opt, "optimizer", opt->n_params)
NB__HANDLE_GETTER(int64_t, nb_optim_step_count, const nb_optim, opt, "optimizer",
                  *(const int64_t *)opt->step_count->data)

nb_optim_hparams nb_optim_group_hparams(const nb_optim *opt, int group) {
    NB__CHECK_HANDLE("nb_optim_group_hparams", opt, "optimizer");
    check_group("nb_optim_group_hparams", opt, group);
    const double *hp = nb__optim_hp(opt, group);
    nb_optim_hparams h = {
        .lr = hp[NB__HP_LR],
        .weight_decay = hp[NB__HP_WEIGHT_DECAY],
        .momentum = hp[NB__HP_MOMENTUM],
        .dampening = hp[NB__HP_DAMPENING],
        .nesterov = hp[NB__HP_NESTEROV] != 0,
        .beta1 = hp[NB__HP_BETA1],
        .beta2 = hp[NB__HP_BETA2],
        .eps = hp[NB__HP_EPS],
        .amsgrad = hp[NB__HP_AMSGRAD] != 0,
    };
    return h;
}

double nb_optim_lr(const nb_optim *opt, int group) {
    NB__CHECK_HANDLE("nb_optim_lr", opt, "optimizer");
    check_group("nb_optim_lr", opt, group);
    return nb__optim_hp(opt, group)[NB__HP_LR];
}

void nb_optim_set_lr(nb_optim *opt, int group, double lr) {
    NB__CHECK_HANDLE("nb_optim_set_lr", opt, "optimizer");
    check_group("nb_optim_set_lr", opt, group);
    NB_CHECK(isfinite(lr) && lr >= 0, "nb_optim_set_lr: lr = %g must be finite and >= 0", lr);
    nb__optim_hp(opt, group)[NB__HP_LR] = lr;
}

void nb_optim_set_lr_all(nb_optim *opt, double lr) {
    NB__CHECK_HANDLE("nb_optim_set_lr_all", opt, "optimizer");
    for (int g = 0; g < opt->n_groups; g++) nb_optim_set_lr(opt, g, lr);
}

void nb_optim_set_weight_decay(nb_optim *opt, int group, double weight_decay) {
    NB__CHECK_HANDLE("nb_optim_set_weight_decay", opt, "optimizer");
    check_group("nb_optim_set_weight_decay", opt, group);
    NB_CHECK(isfinite(weight_decay) && weight_decay >= 0,
             "nb_optim_set_weight_decay: weight_decay = %g must be finite and >= 0", weight_decay);
    nb__optim_hp(opt, group)[NB__HP_WEIGHT_DECAY] = weight_decay;
}

/* ---- state ---- */
const nb_named_tensor *nb_optim_state(nb_optim *opt, int *n) {
    NB__CHECK_HANDLE("nb_optim_state", opt, "optimizer");
    NB_CHECK(opt && n, "nb_optim_state: NULL argument");
    NB_CHECK(!opt->released,
             "nb_optim_state: this optimizer's state is sharded over the ranks by %s (ZeRO-1, "
             "nb_ddp_set_zero); to save it, gather it first with "
             "nb_ddp_consolidate_optimizer(ddp, root) (on root, or every rank with root -1); to "
             "load a checkpoint, load before nb_ddp_set_zero or after nb_ddp_set_zero(ddp, NULL)",
             sharded_by(opt));
    *n = opt->n_state;
    return opt->state;
}

nb_status nb_optim_state_validate(nb_optim *opt) {
    NB__CHECK_HANDLE("nb_optim_state_validate", opt, "optimizer");
    NB_CHECK(opt->owner != NB__OPTIM_SHARDED && !opt->lost,
             "nb_optim_state_validate: this optimizer's state is sharded over the ranks by %s "
             "(ZeRO-1, nb_ddp_set_zero), and a consolidated copy (nb_ddp_consolidate_optimizer) "
             "is only for saving: the next nb_ddp_step would ignore what was loaded into it; load "
             "a checkpoint before nb_ddp_set_zero or after nb_ddp_set_zero(ddp, NULL)",
             sharded_by(opt));
    if (nb_optim_step_count(opt) < 0)
        return nb_set_error(NB_ERR_FORMAT, "optimizer state: optim.step = %lld is negative",
                            (long long)nb_optim_step_count(opt));
    for (int g = 0; g < opt->n_groups; g++) {
        char msg[256];
        const char *bad = nb__optim_check_hparams(opt->kind, nb__optim_hp(opt, g), msg, sizeof msg);
        if (bad)
            return nb_set_error(NB_ERR_FORMAT, "optimizer state (%s): optim.group.%d: %s",
                                nb_optim_kind_name(opt->kind), g, bad);
        if (opt->kind == NB_OPTIM_SGD && nb__optim_hp(opt, g)[NB__HP_MOMENTUM] != 0)
            for (int i = 0; i < opt->n_params; i++)
                if (opt->params[i].group == g && !opt->params[i].momentum_buffer)
                    return nb_set_error(NB_ERR_MISMATCH,
                                        "optimizer state: optim.group.%d.momentum = %g, but the "
                                        "optimizer was made without momentum and has no "
                                        "momentum buffer for \"%s\"",
                                        g, nb__optim_hp(opt, g)[NB__HP_MOMENTUM],
                                        opt->params[i].name);
        if (opt->kind != NB_OPTIM_SGD)
            for (int i = 0; i < opt->n_params; i++) {
                const nb__optim_param *p = &opt->params[i];
                bool on = nb__optim_hp(opt, g)[NB__HP_AMSGRAD] != 0;
                if (p->group == g && on != (p->max_exp_avg_sq != NULL))
                    return nb_set_error(NB_ERR_MISMATCH,
                                        "optimizer state: optim.group.%d.amsgrad = %d, but the "
                                        "optimizer was made %s amsgrad and %s max_exp_avg_sq "
                                        "for \"%s\"; amsgrad is fixed at construction",
                                        g, on, on ? "without" : "with", on ? "has no" : "keeps",
                                        p->name);
            }
    }
    for (int i = 0; i < opt->n_params; i++) {
        int64_t s = *(const int64_t *)opt->params[i].step->data;
        if (s < 0)
            return nb_set_error(NB_ERR_FORMAT, "optimizer state: optim.state.%s.step = %lld is "
                                "negative", opt->params[i].name, (long long)s);
    }
    return NB_OK;
}
