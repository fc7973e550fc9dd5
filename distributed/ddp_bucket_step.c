/* The optimizer stepped per bucket inside nb_ddp_backward
 * (nb_ddp_set_optimizer): a feature of the reducer (Note [DDP hook points]
 * in ddp.c) that counts the step when a synchronised backward hands out
 * its gradients (sync_begin) and updates each bucket's parameters as soon
 * as they are final (grads_final).
 *
 * Note [Per-bucket step]
 * With an optimizer attached (nb_ddp_set_optimizer), the end-of-backward
 * loop that waits for bucket b, widens and averages it, then hands b's
 * parameters to the optimizer (nb__optim_step_params) before waiting for
 * bucket b + 1: the update of b runs while the later buckets' all-reduces
 * are still in flight. The update of each parameter is elementwise and
 * reads only that parameter's gradient and state, so stepping bucket by
 * bucket gives the same bits as one nb_optim_step after the last bucket;
 * the optimizer-wide step count is added once per backward and the
 * learning rates are those set before it. The decision to step is taken
 * before the first wait: a backward that failed, or one where a parameter
 * got no gradient without find_unused_parameters, steps nothing (as a
 * user would not step after the error). A bucket whose all-reduce fails
 * stops the stepping: the buckets before it were updated, it and the
 * later ones were not, and the error says the group is broken anyway.
 * Global-norm clipping needs every gradient before the first update, the
 * grad scaler's found-inf check too, and join replays steps on ranks that
 * do not train: those combinations are refused (nb__optim_check_not_bucket_stepped,
 * Note [Feature conflicts]). A no_sync backward reduces nothing and steps
 * nothing; the synchronising backward after it steps on the accumulated
 * sums. */
#include <stdlib.h>

#include "distributed/ddp_reducer.h"
#include "optim/sharded.h"
#include "util/handle.h"

typedef struct step_state {
    nb_optim *opt;
    int *opt_index; /* per parameter: its index in opt, or -1 (malloc'd) */
    int *step_idx;  /* scratch, n (malloc'd) */
    bool stepping;  /* this backward steps */
} step_state;

static void step_sync_begin(nb_ddp *d, void *self, bool usable) {
    (void)d;
    step_state *s = self;
    s->stepping = usable;
    if (s->stepping) nb__optim_count_step(s->opt);
}

/* Steps the optimizer's parameters among params[0..n) (Note [Per-bucket step]). */
static void step_grads_final(nb_ddp *d, void *self, const int *params, int n) {
    (void)d;
    step_state *s = self;
    if (!s->stepping) return;
    int k = 0;
    for (int j = 0; j < n; j++)
        if (s->opt_index[params[j]] >= 0) s->step_idx[k++] = s->opt_index[params[j]];
    if (k) nb__optim_step_params(s->opt, s->step_idx, k);
}

static void step_free(nb_ddp *d, void *self) {
    (void)d;
    step_state *s = self;
    nb__optim_give_back(s->opt);
    free(s->opt_index);
    free(s->step_idx);
    free(s);
}

static const nb__ddp_hooks step_hooks = {
    .name = "the per-bucket optimizer step",
    .sync_begin = step_sync_begin,
    .grads_final = step_grads_final,
    .free = step_free,
};

/* A combination the wrapper refuses is a status (Note [Feature conflicts]
 * in ddp_reducer.h): a program may fall back to a plain step. Called
 * inside a backward, it aborts. */
nb_status nb_ddp_set_optimizer(nb_ddp *d, nb_optim *opt) {
    NB__CHECK_HANDLE("nb_ddp_set_optimizer", d, "DDP handle");
    NB_CHECK(!d->in_backward, "nb_ddp_set_optimizer: rank %d: called inside a backward", d->rank);
    step_state *cur = nb__ddp_state(d, NB__DDP_BUCKET_STEP);
    if (cur && cur->opt == opt) return NB_OK;
    if (opt) {
        nb_status st = nb__ddp_check_conflicts(d, NB__DDP_BUCKET_STEP, "nb_ddp_set_optimizer");
        if (st != NB_OK) return st; /* Note [Feature conflicts] */
    }
    if (opt) {
        nb_status st = nb__optim_can_take(opt, NB__OPTIM_BUCKET_STEPPED, "nb_ddp_set_optimizer", d->rank);
        if (st != NB_OK) return st;
    }
    int *index = NULL;
    if (opt) {
        index = nb__ddp_calloc((size_t)(d->n ? d->n : 1), sizeof(int));
        for (int i = 0; i < d->n; i++) index[i] = nb__optim_param_index(opt, d->p[i].tensor);
        int found = 0;
        for (int i = 0; i < d->n; i++) found += index[i] >= 0;
        if (found != nb_optim_param_count(opt)) {
            const char *name = "?";
            for (int j = 0; j < nb_optim_param_count(opt) && name[0] == '?'; j++) {
                bool in = false;
                for (int i = 0; i < d->n && !in; i++) in = index[i] == j;
                if (!in) name = nb__optim_param_name(opt, j);
            }
            free(index);
            return nb_set_error(NB_ERR_INVALID, "nb_ddp_set_optimizer: rank %d: optimizer parameter \"%s\" is "
                                "not a parameter (that requires grad) of the wrapped model; a per-bucket step "
                                "updates only the wrapper's parameters, so it would never be stepped",
                                d->rank, name);
        }
    }
    if (opt) {
        nb_status st = nb__optim_take(opt, NB__OPTIM_BUCKET_STEPPED, "nb_ddp_set_optimizer", d->rank);
        if (st != NB_OK) {
            free(index);
            return st;
        }
    }
    if (cur) {
        nb__ddp_detach(d, NB__DDP_BUCKET_STEP);
        step_free(d, cur);
    }
    if (!opt) return NB_OK;
    step_state *s = nb__ddp_calloc(1, sizeof *s);
    s->opt = opt;
    s->opt_index = index;
    s->step_idx = nb__ddp_calloc((size_t)(d->n ? d->n : 1), sizeof(int));
    nb__ddp_attach(d, NB__DDP_BUCKET_STEP, &step_hooks, s);
    return NB_OK;
}

nb_optim *nb_ddp_optimizer(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_optimizer", d, "DDP handle");
    step_state *s = nb__ddp_state(d, NB__DDP_BUCKET_STEP);
    return s ? s->opt : NULL;
}
