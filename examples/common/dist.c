/* The distributed side of the training programs (see dist.h). Every rank
 * runs the same calls in the same order; anything that fails comes back as
 * a status with nb_last_error() set, and the program exits non-zero, which
 * makes the launcher stop the other ranks (and their collectives fail fast
 * with a message naming the rank that left). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"

nb_status run_dist_init(run_dist *d) {
    *d = (run_dist){0, 1, 0, nb_cpu(), NULL, NULL, NULL, 0, NULL, NULL};
    nb_dist_env env;
    nb_status s = nb_dist_env_read(&env);
    if (s != NB_OK) return s;
    d->rank = env.rank; /* the label of errors before the group exists (the join's own) */
    if (env.world_size == 1) {
        /* a GPU when the build has CUDA and one is visible, else the CPU */
        s = nb_dist_select_device(&env, true, &d->device);
        if (s == NB_ERR_UNSUPPORTED) s = nb_dist_select_device(&env, false, &d->device);
        return s;
    }
    s = nb_pg_init_env(&d->pg, &env, NULL);
    if (s != NB_OK) return s;
    d->rank = nb_pg_rank(d->pg);
    d->world_size = nb_pg_size(d->pg);
    d->local_rank = env.local_rank;
    d->device = nb_pg_device(d->pg);
    return NB_OK;
}

nb_status run_dist_wrap(run_dist *d, nb_module *model, bool sync_bn) {
    d->model = model;
    if (d->pg && sync_bn) nb_convert_sync_batchnorm(model, d->pg);
    if (d->zero_stage == 3) return nb_fsdp_new(&d->fsdp, model, d->pg, NULL); /* a world of one too */
    if (!d->pg) return NB_OK;
    nb_ddp_options o = NB_DDP_DEFAULTS;
    return nb_ddp_new(&d->ddp, model, d->pg, &o);
}

nb_status run_dist_forward(run_dist *d, nb_ctx *ctx, nb_tensor *x, nb_tensor **out) {
    if (d->fsdp) return nb_fsdp_forward(d->fsdp, ctx, x, out);
    if (d->ddp) return nb_ddp_forward(d->ddp, ctx, x, out);
    *out = nb_module_forward(d->model, ctx, x);
    return NB_OK;
}

nb_status run_dist_backward(run_dist *d, nb_tensor *loss) {
    if (d->fsdp) return nb_fsdp_backward(d->fsdp, loss);
    if (d->ddp) return nb_ddp_backward(d->ddp, loss);
    nb_backward(loss);
    return NB_OK;
}

void run_dist_set_no_sync(run_dist *d, bool no_sync) {
    if (d->ddp) nb_ddp_set_no_sync(d->ddp, no_sync);
}

int run_dist_zero_stage(const char *value, const char *program) {
    if (!value) return 0;
    if (!*value || !strcmp(value, "1")) return 1;
    if (!strcmp(value, "2")) return 2;
    if (!strcmp(value, "3")) return 3;
    fprintf(stderr, "%s: --zero takes no value, 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters "
            "too), not \"%s\"\n", program, value);
    return -1;
}

nb_status run_dist_set_zero(run_dist *d, nb_optim *opt, int stage) {
    if (d->fsdp) return nb_fsdp_set_optimizer(d->fsdp, opt);
    return d->ddp && stage > 0 ? nb_ddp_set_zero_stage(d->ddp, opt, stage) : NB_OK;
}

static nb_ddp *ddp_zero(const run_dist *d) { return d->ddp && nb_ddp_zero_stage(d->ddp) ? d->ddp : NULL; }

nb_status run_dist_clip(run_dist *d, nb_optim *opt, double max_norm, double *norm) {
    if (d->fsdp) return nb_fsdp_clip_grad_norm(d->fsdp, max_norm, 2.0, norm);
    if (ddp_zero(d)) return nb_ddp_clip_grad_norm(d->ddp, max_norm, 2.0, norm);
    *norm = nb_optim_clip_grad_norm(opt, max_norm, 2.0);
    return NB_OK;
}

nb_status run_dist_step(run_dist *d, nb_optim *opt) {
    if (d->fsdp) return nb_fsdp_step(d->fsdp);
    if (ddp_zero(d)) return nb_ddp_step(d->ddp);
    nb_optim_step(opt);
    return NB_OK;
}

nb_status run_dist_consolidate(run_dist *d, int root) {
    if (d->fsdp) {
        nb_status s = nb_fsdp_gather_full(d->fsdp);
        return s == NB_OK ? nb_fsdp_consolidate_optimizer(d->fsdp, root) : s;
    }
    return ddp_zero(d) ? nb_ddp_consolidate_optimizer(d->ddp, root) : NB_OK;
}

nb_status run_dist_clip_step(run_dist *d, nb_optim *opt, nb_ctx *ctx, double max_norm, double *norm) {
    if (d->fsdp || ddp_zero(d)) {
        nb_status st = run_dist_clip(d, opt, max_norm, norm);
        return st != NB_OK || !isfinite(*norm) ? st : run_dist_step(d, opt);
    }
    *norm = nb_item(nb_optim_step_clipped(opt, ctx, max_norm, 2.0));
    if (!isfinite(*norm)) nb_optim_unstep(opt); /* the device skipped the update */
    return NB_OK;
}

nb_status run_dist_unshard(run_dist *d) {
    if (d->fsdp) return nb_fsdp_gather_full(d->fsdp);
    return ddp_zero(d) ? nb_ddp_set_zero(d->ddp, NULL) : NB_OK;
}

const char *run_dist_zero_label(const run_dist *d) {
    static const char *const label[] = {"", " (ZeRO-1)", " (ZeRO-2)"};
    if (d->fsdp) return " (ZeRO-3)";
    return d->ddp ? label[nb_ddp_zero_stage(d->ddp)] : "";
}

size_t run_dist_state_bytes(run_dist *d, nb_optim *opt) {
    if (d->fsdp) return nb_fsdp_state_bytes(d->fsdp, opt);
    if (d->ddp) return nb_ddp_state_bytes(d->ddp, opt);
    size_t bytes = nb_optim_state_bytes(opt);
    int n = nb_module_named_parameters(d->model, NULL, 0);
    nb_named_tensor *p = malloc(sizeof *p * (size_t)(n ? n : 1));
    if (!p) return 0;
    nb_module_named_parameters(d->model, p, n);
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = p[i].tensor;
        if (!t->requires_grad) continue;
        bytes += (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
        if (t->grad) bytes += (size_t)nb_numel(t->grad) * nb_dtype_size(t->grad->dtype);
    }
    free(p);
    return bytes;
}

nb_status run_dist_sync_buffers(run_dist *d) {
    if (d->fsdp) return nb_fsdp_gather_full(d->fsdp); /* evaluation reads the parameters whole */
    return d->ddp ? nb_ddp_pre_forward(d->ddp) : NB_OK;
}

nb_status run_dist_sum(run_dist *d, double *v, int n) {
    if (!d->pg) return NB_OK;
    /* one context for the run, not one per call: on a GPU that would be a
     * cudaMalloc and a cudaFree (which waits for the whole device) per step */
    if (!d->sum_ctx) d->sum_ctx = nb_ctx_new(nb_pg_device(d->pg), 4096);
    nb_ctx_reset(d->sum_ctx); /* the last call's tensor was read back: nothing uses it */
    nb_tensor *t = nb_from_host(d->sum_ctx, NB_F64, NB_SHAPE(n), v);
    nb_status s = nb_work_finish(nb_pg_all_reduce(d->pg, t, NB_REDUCE_SUM));
    if (s == NB_OK) nb_to_host(t, v);
    return s;
}

nb_status run_dist_train_loader(run_dist *d, nb_dataset *ds, int64_t batch, uint64_t seed, nb_sampler **sampler,
                                nb_loader **loader) {
    nb_distributed_options o = {d->world_size, d->rank, true, seed, true};
    *sampler = nb_sampler_distributed(nb_dataset_len(ds), &o);
    nb_loader_options lo = {.batch_size = batch, .drop_last = true, .sampler = *sampler,
                           .device = d->device, .pin_memory = true /* only matters on a GPU */};
    return nb_loader_new(loader, ds, &lo);
}

nb_status run_dist_evaluate(run_dist *d, nb_module *model, nb_loader *loader, nb_ctx *ctx, int n,
                            run_eval_fn *fn, void *user, nb_metric_sums *sums) {
    nb_metric_sums_init(sums, n);
    nb_status s = run_dist_sync_buffers(d);
    if (s == NB_OK) s = nb_loader_seek(loader, 0, 0);
    if (s != NB_OK) return s;
    nb_module_eval(model);
    bool prev = nb_no_grad_begin();
    double v[NB_METRIC_MAX];
    for (;;) {
        nb_ctx_reset(ctx);
        nb_batch b;
        s = nb_loader_next(loader, ctx, &b);
        if (s != NB_OK || !b.inputs) break;
        fn(user, ctx, &b, v);
        nb_metric_sums_add(sums, v, b.size);
    }
    nb_no_grad_end(prev);
    nb_module_train(model, true);
    if (s == NB_OK) s = run_dist_sum(d, nb_metric_sums_data(sums), nb_metric_sums_size(sums));
    return s;
}

nb_status run_dist_finish(run_dist *d) {
    nb_ddp_free(d->ddp);
    d->ddp = NULL;
    nb_fsdp_free(d->fsdp);
    d->fsdp = NULL;
    nb_ctx_free(d->sum_ctx);
    d->sum_ctx = NULL;
    nb_status s = d->pg ? nb_pg_free(d->pg) : NB_OK;
    d->pg = NULL;
    return s;
}
