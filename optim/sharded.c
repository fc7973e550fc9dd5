/* The sharded optimizer, and the owners of an optimizer (optim/sharded.h).
 *
 * Note [Sharded optimizer]
 * ZeRO shards an optimizer's element-wise state over the ranks: each rank
 * keeps the moments of the pieces of the parameters it owns (how pieces
 * are cut, per DDP bucket, is Note [ZeRO-1] in distributed/ddp_zero.c).
 * Here that state is an optimizer of its own, `part`, of the user's kind,
 * with one parameter per piece that the user's optimizer holds: a 1-D view
 * of the parameter's memory whose gradient is the piece's gradient (the
 * caller's view of its reduced shard), in the group of its parameter. Its
 * moments are the only element-wise state on the rank; the user's
 * optimizer gives its own up (nb__optim_release_state) and keeps the step
 * counts and hyperparameters, which each step copies into `part` first
 * (nb__optim_shard_begin_step), so learning-rate schedules keep working on
 * the user's optimizer. The update rules are element-wise, so a piece
 * updated alone gets the bits the whole parameter would get from the same
 * gradient. The sharding layer (distributed/) drives it only through
 * these verbs and never touches an optimizer's fields: what crosses is
 * pieces, moments and whole steps.
 *
 * An optimizer has at most one owner besides its user (the per-bucket
 * step or a sharding layer); nb__optim_take refuses a second with a
 * status naming both, and the optimizer's own step, clipping, grad scaler
 * and state calls refuse while it is owned. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim/internal.h"
#include "util/handle.h"

static const char *owner_name(nb__optim_owner o) {
    return o == NB__OPTIM_BUCKET_STEPPED ? "stepped per bucket by a DDP wrapper (nb_ddp_set_optimizer)"
                                         : "sharded over the ranks by a DDP wrapper (ZeRO, nb_ddp_set_zero)";
}

nb_status nb__optim_can_take(const nb_optim *opt, nb__optim_owner owner, const char *who, int rank) {
    NB__CHECK_HANDLE(who, opt, "optimizer");
    if (opt->owner || opt->lost)
        return nb_set_error(NB_ERR_INVALID, "%s: rank %d: this optimizer is %s%s; it cannot also be %s",
                            who, rank, opt->lost ? "sharded by a DDP wrapper freed while attached (the "
                            "shards are lost)" : owner_name(opt->owner),
                            opt->owner == owner ? " already" : "", owner_name(owner));
    return NB_OK;
}

nb_status nb__optim_take(nb_optim *opt, nb__optim_owner owner, const char *who, int rank) {
    nb_status st = nb__optim_can_take(opt, owner, who, rank);
    if (st == NB_OK) opt->owner = owner;
    return st;
}

void nb__optim_give_back(nb_optim *opt) {
    opt->lost = opt->owner == NB__OPTIM_SHARDED && opt->released;
    opt->owner = 0;
}

struct nb__optim_shard {
    nb_optim *opt;  /* the user's */
    nb_optim *part; /* over the pieces opt holds; NULL when there are none */
    int n;          /* pieces */
    int *full;      /* per piece: its parameter's index in opt, or -1 (malloc'd) */
    int *index;     /* per piece: its index in part, or -1 (malloc'd) */
    int *scratch;   /* n (malloc'd) */
};

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    NB_CHECK(p, "nb__optim_shard_new: out of memory (%zu x %zu bytes)", n, size);
    return p;
}

/* 1-D view of elements [start, start + len) of contiguous t. */
static nb_tensor *flat_view(nb_ctx *ctx, nb_tensor *t, int64_t start, int64_t len) {
    int64_t st = 1;
    return nb__view(ctx, t, 1, &len, &st, (char *)t->data + start * (int64_t)nb_dtype_size(t->dtype));
}

nb__optim_shard *nb__optim_shard_new(nb_optim *opt, nb_ctx *ctx, int n, const nb__optim_piece *pieces) {
    nb__optim_shard *s = xcalloc(1, sizeof *s);
    s->opt = opt;
    s->n = n;
    s->full = xcalloc((size_t)n, sizeof(int));
    s->index = xcalloc((size_t)n, sizeof(int));
    s->scratch = xcalloc((size_t)n, sizeof(int));
    for (int j = 0; j < n; j++) {
        s->full[j] = nb__optim_param_index(opt, pieces[j].param);
        s->index[j] = -1;
    }
    int ng = opt->n_groups, total = 0;
    nb_param_group *groups = xcalloc((size_t)ng, sizeof *groups);
    nb_named_tensor *list = xcalloc((size_t)n, sizeof *list);
    char **names = xcalloc((size_t)n, sizeof *names);
    for (int g = 0; g < ng; g++) {
        groups[g].params = list + total;
        groups[g].h = nb_optim_group_hparams(opt, g);
        for (int j = 0; j < n; j++) {
            const nb__optim_piece *pc = &pieces[j];
            if (s->full[j] < 0 || opt->params[s->full[j]].group != g) continue;
            nb_tensor *v = pc->data ? flat_view(ctx, pc->data, 0, pc->len) : flat_view(ctx, pc->param, pc->start, pc->len);
            v->requires_grad = true;
            v->grad = pc->grad;
            size_t len = strlen(pc->name) + 48;
            names[total] = xcalloc(len, 1);
            snprintf(names[total], len, "%s[%lld:%lld]", pc->name, (long long)pc->start,
                     (long long)(pc->start + pc->len));
            list[total] = (nb_named_tensor){names[total], v};
            s->index[j] = total++;
            groups[g].n++;
        }
    }
    s->part = total ? nb_optim_new_groups(opt->kind, ng, groups) : NULL;
    for (int j = 0; j < total; j++) free(names[j]);
    free(names);
    free(list);
    free(groups);
    if (s->part) {
        NB_CHECK(!opt->released, "nb__optim_shard_new: the optimizer's state is released");
        int K = nb__optim_moment_count(opt);
        for (int j = 0; j < n; j++) {
            if (s->index[j] < 0) continue;
            for (int k = 0; k < K; k++) {
                nb_tensor *src = nb__optim_moment(opt, s->full[j], k), *dst = nb__optim_moment(s->part, s->index[j], k);
                NB_CHECK((src == NULL) == (dst == NULL), "nb__optim_shard_new: moment %d of \"%s\"", k,
                         opt->params[s->full[j]].name);
                if (src) nb_copy_(dst, flat_view(ctx, src, pieces[j].start, pieces[j].len));
            }
        }
    }
    nb__optim_release_state(opt);
    opt->shard = s->part;
    return s;
}

void nb__optim_shard_free(nb__optim_shard *s) {
    if (!s) return;
    if (s->opt->shard == s->part) s->opt->shard = NULL;
    nb_optim_free(s->part);
    free(s->full);
    free(s->index);
    free(s->scratch);
    free(s);
}

void nb__optim_shard_begin_step(nb__optim_shard *s) {
    nb_optim *opt = s->opt;
    nb__optim_release_state(opt); /* a consolidated copy is stale from here */
    nb__optim_count_step(opt);
    if (s->part) {
        for (int g = 0; g < opt->n_groups; g++)
            memcpy(nb__optim_hp(s->part, g), nb__optim_hp(opt, g), sizeof(double) * NB__HP_COUNT);
        for (int j = 0; j < s->n; j++)
            if (s->index[j] >= 0)
                *(int64_t *)s->part->params[s->index[j]].step->data = *(int64_t *)opt->params[s->full[j]].step->data;
        nb__optim_count_step(s->part);
    }
    /* every parameter has a gradient (its bucket's view): each is updated */
    for (int i = 0; i < opt->n_params; i++) ++*(int64_t *)opt->params[i].step->data;
}

void nb__optim_shard_step(nb__optim_shard *s, int first, int end) {
    NB_CHECK(first >= 0 && first <= end && end <= s->n, "nb__optim_shard_step: pieces [%d, %d) of %d", first,
             end, s->n);
    int k = 0;
    for (int j = first; j < end; j++)
        if (s->index[j] >= 0) s->scratch[k++] = s->index[j];
    if (k) nb__optim_step_params(s->part, s->scratch, k);
}

nb_tensor *nb__optim_shard_moment(nb__optim_shard *s, int j, int k) {
    NB_CHECK(j >= 0 && j < s->n, "nb__optim_shard_moment: piece %d of %d", j, s->n);
    return s->index[j] < 0 ? NULL : nb__optim_moment(s->part, s->index[j], k);
}

static void add_piece(nb_checkpoint_piece *out, int *n, const char *name, int order, const nb_tensor *whole,
                      int64_t start, nb_tensor *data) {
    nb_checkpoint_piece *p = &out[(*n)++];
    *p = (nb_checkpoint_piece){.name = name, .order = order, .ndim = whole->ndim, .start = start, .data = data};
    memcpy(p->shape, whole->shape, sizeof p->shape);
}

void nb__optim_checkpoint_pieces(nb_optim *opt, nb__optim_shard *s, const nb__optim_piece *pieces, int n,
                                 bool lead, bool (*is_sharded)(void *user, const nb_tensor *t), void *user,
                                 const nb_named_tensor *model, int n_model, nb_checkpoint_piece **out,
                                 int *n_out) {
    int n_state = 0, K = opt ? nb__optim_moment_count(opt) : 0;
    const nb_named_tensor *state = opt ? nb__optim_state_entries(opt, &n_state) : NULL;
    nb_checkpoint_piece *o = xcalloc((size_t)(n_model + n_state + n * (1 + K) + 1), sizeof *o);
    int k = 0;
    /* per state entry: the parameter (an optimizer index) and moment it holds, or -1 */
    int *param_of = xcalloc((size_t)(n_state + 1), sizeof *param_of), *moment_of = xcalloc((size_t)(n_state + 1),
                                                                                            sizeof *moment_of);
    for (int j = 0; j < n_state; j++) param_of[j] = moment_of[j] = -1;
    for (int i = 0; opt && i < opt->n_params; i++)
        for (int m = 0; m < K; m++) {
            int j = nb__optim_moment_entry(opt, i, m);
            if (j >= 0) param_of[j] = i, moment_of[j] = m;
        }
    for (int m = 0; m < n_model; m++) {
        nb_tensor *t = model[m].tensor;
        if (!s || !is_sharded(user, t)) {
            if (lead) add_piece(o, &k, model[m].name, m, t, 0, t);
            continue;
        }
        for (int q = 0; q < n; q++)
            if (pieces[q].param == t) add_piece(o, &k, model[m].name, m, t, pieces[q].start, pieces[q].data);
    }
    for (int j = 0; j < n_state; j++) {
        int i = param_of[j];
        nb_tensor *p = i >= 0 ? opt->params[i].param : NULL;
        if (!s || !p || !is_sharded(user, p)) {
            NB_CHECK(state[j].tensor, "nb__optim_checkpoint_pieces: \"%s\" is released", state[j].name);
            if (lead) add_piece(o, &k, state[j].name, n_model + j, state[j].tensor, 0, state[j].tensor);
            continue;
        }
        for (int q = 0; q < n; q++) {
            if (pieces[q].param != p) continue;
            nb_tensor *mom = nb__optim_shard_moment(s, q, moment_of[j]);
            NB_CHECK(mom, "nb__optim_checkpoint_pieces: no moment for \"%s\"", state[j].name);
            add_piece(o, &k, state[j].name, n_model + j, p, pieces[q].start, mom);
        }
    }
    free(param_of);
    free(moment_of);
    *out = o;
    *n_out = k;
}
