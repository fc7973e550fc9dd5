/* The distributed side of the training programs, kept in these few
 * functions: joining the run (nbrun, torchrun, mpirun or srun set the
 * environment), wrapping the model in DDP (with SyncBatchNorm on request),
 * forward and backward through the wrapper, sums over ranks for exact
 * metrics, and leaving the run. A world of one (no launcher) needs no
 * process group: every call is then the plain single-process equivalent,
 * and no socket is opened. */
#ifndef NABLA_EXAMPLES_DIST_H
#define NABLA_EXAMPLES_DIST_H

#include <stdbool.h>

#include <nabla/nabla.h>

typedef struct run_dist {
    int rank, world_size, local_rank;
    nb_device device; /* where this rank computes: cuda:LOCAL_RANK with a GPU build and GPUs, else the CPU */
    nb_pg *pg;   /* NULL in a world of one */
    nb_ddp *ddp; /* NULL in a world of one, and under ZeRO-3 */
    nb_fsdp *fsdp; /* ZeRO-3 (zero_stage 3), in any world */
    int zero_stage; /* set before run_dist_wrap: 3 wraps in nb_fsdp instead of DDP */
    nb_module *model;
    nb_ctx *sum_ctx; /* run_dist_sum's buffer on the group's device, made once */
} run_dist;

/* Joins the run the environment describes (a process group when it has
 * more than one process). */
nb_status run_dist_init(run_dist *d);
/* Wraps `model` for data-parallel training (a collective: every rank calls
 * it); first converts its BatchNorms to SyncBatchNorm when sync_bn. */
nb_status run_dist_wrap(run_dist *d, nb_module *model, bool sync_bn);
/* The model's forward (through DDP, which broadcasts buffers first). */
nb_status run_dist_forward(run_dist *d, nb_ctx *ctx, nb_tensor *x, nb_tensor **out);
/* Backward with gradients averaged over ranks (or only accumulated
 * locally while no_sync is on). */
nb_status run_dist_backward(run_dist *d, nb_tensor *loss);
void run_dist_set_no_sync(run_dist *d, bool no_sync);
/* The training loader of every program: a distributed sampler over ds
 * (shuffled with seed + epoch), batches of `batch` samples on this rank's
 * device, with drop_last in the sampler and the loader, so that every rank
 * takes the same number of full batches. */
nb_status run_dist_train_loader(run_dist *d, nb_dataset *ds, int64_t batch, uint64_t seed, nb_sampler **sampler,
                                nb_loader **loader);
/* Gives every rank rank 0's buffers (BatchNorm running statistics): call
 * it on every rank before evaluating, which bypasses DDP because ranks may
 * evaluate different numbers of batches. Under ZeRO-3 it makes the
 * parameters whole too (nb_fsdp_gather_full), so that evaluating needs no
 * collective. */
nb_status run_dist_sync_buffers(run_dist *d);
/* v[0..n) = its sum over ranks. */
nb_status run_dist_sum(run_dist *d, double *v, int n);
/* One evaluation batch's n values for run_dist_evaluate, each a sum over the
 * batch's samples (a mean loss times b->size, a count of correct answers). */
typedef void run_eval_fn(void *user, nb_ctx *ctx, const nb_batch *b, double *v);
/* Exact metrics over every batch of `loader`, once, the same on every rank:
 * the buffers synchronised (run_dist_sync_buffers), model in evaluation
 * mode without gradients (back in training mode after), each batch made in
 * ctx (reset per batch) and measured by fn, the sums over the ranks left in
 * `sums` (n metrics; nb_metric_sums_mean gives the means). */
nb_status run_dist_evaluate(run_dist *d, nb_module *model, nb_loader *loader, nb_ctx *ctx, int n,
                            run_eval_fn *fn, void *user, nb_metric_sums *sums);
/* --zero's value (a CLI_OPTIONAL flag): NULL (not given) 0, "" (the flag
 * alone) or "1" ZeRO-1, "2" ZeRO-2, "3" ZeRO-3; anything else -1, after a
 * message to stderr naming the program. */
int run_dist_zero_stage(const char *value, const char *program);
/* Shards opt over the ranks with ZeRO of `stage` (1 or 2: nothing to do
 * for 0 or in a world of one; 3: nb_fsdp_set_optimizer, in any world). Make
 * opt before run_dist_wrap under ZeRO-3. */
nb_status run_dist_set_zero(run_dist *d, nb_optim *opt, int stage);
/* Global-norm clipping (norm_type 2) of the averaged gradients wherever they
 * are (the parameters', ZeRO's shards); the norm to *norm. */
nb_status run_dist_clip(run_dist *d, nb_optim *opt, double max_norm, double *norm);
/* The optimizer step (ZeRO's sharded one under ZeRO). */
nb_status run_dist_step(run_dist *d, nb_optim *opt);
/* Before a checkpoint (collective): under ZeRO the whole optimizer state
 * gathered into opt on rank `root` (every rank with -1), and under ZeRO-3
 * the parameters made whole on every rank too, so that the file is the one
 * a run without sharding writes. Valid until the next step. */
nb_status run_dist_consolidate(run_dist *d, int root);
/* run_dist_clip, then run_dist_step when the norm is finite, into *norm; without
 * sharding the clip rides the optimizer's update (nb_optim_step_clipped: no pass
 * over the gradients, the norm read once the step is queued). */
nb_status run_dist_clip_step(run_dist *d, nb_optim *opt, nb_ctx *ctx, double max_norm, double *norm);
/* Before leaving: ZeRO-1 and 2 give the whole state back to opt (ZeRO-3
 * keeps it sharded; its parameters are made whole). Collective. */
nb_status run_dist_unshard(run_dist *d);
/* The name of the sharding in use, for banners: "", " (ZeRO-1)", ... */
const char *run_dist_zero_label(const run_dist *d);
/* The parameter, gradient and optimizer-state bytes this rank holds now
 * (nb_ddp_state_bytes, nb_fsdp_state_bytes; counted the same way in a
 * world of one). */
size_t run_dist_state_bytes(run_dist *d, nb_optim *opt);
/* Unwraps and leaves the run (every rank calls it); the first failure. */
nb_status run_dist_finish(run_dist *d);

#endif
