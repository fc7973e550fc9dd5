/* ZeRO-1 and ZeRO-2 for DDP: the optimizer's state sharded over the ranks
 * (nb_ddp_set_zero), with the gradients too (nb_ddp_set_zero_stage, Note
 * [ZeRO-2]), the sharded step with its all-gather pipelined per
 * bucket (nb_ddp_step), global-norm clipping over the shards
 * (nb_ddp_clip_grad_norm), the grad scaler over the shards
 * (nb_ddp_scaler_unscale / _step) and the consolidation of the state for
 * checkpoints (nb_ddp_consolidate_optimizer).
 *
 * Note [ZeRO-1]
 * Shards are cut per bucket: bucket b's flat buffer (numel elements) is
 * padded with zeros to chunk * R, chunk = ceil(numel / R), and rank r owns
 * elements [r * chunk, min((r + 1) * chunk, numel)) of it. Per bucket, and
 * not one shard of the whole flat vector, because then the bucket's
 * collective is still launched from the gradient-ready hooks as soon as the
 * bucket is complete: it is a reduce-scatter (average) into the bucket's
 * `shard` instead of an all-reduce, and the overlap with backward is kept
 * as it is; the padding makes every rank's piece the same length, as the
 * collective needs, and costs at most R - 1 elements per bucket. A shard
 * cuts across parameters (and so across parameter groups): the part of a
 * parameter inside the rank's chunk is a "piece", and the
 * sharded optimizer (optim/sharded.c, Note [Sharded optimizer]) keeps the
 * state of the pieces, each with a view of the bucket's shard as its
 * gradient; this file hands it pieces and drives its steps through
 * optim/sharded.h's verbs and touches no field of the optimizer.
 *
 * The step and the parameters' all-gather go bucket by bucket: the rank
 * updates its pieces of bucket b (nb__optim_shard_step), copies the updated elements of its chunk (every parameter in
 * it, also those the optimizer does not step) into a send buffer and
 * launches b's all-gather without waiting; the gathered flat vector is
 * copied back into the parameters once the gather has finished. Two slots
 * of send and gather buffers (2 x the largest chunk, 2 x chunk * R) let
 * bucket b's gather run on the group's thread while bucket b+1's pieces
 * are updated; before slot b % 2 is reused, bucket b-2's gather is waited
 * for and copied back. nb_ddp_step returns only when every gather has been
 * copied back (also on failure: the collectives in flight are drained), so
 * nothing that reads the parameters afterwards needs to wait. Keeping the
 * gathers in flight into the next forward would hide more of them, but
 * then every reader of the parameters (forward, checkpoints, consolidate,
 * detach, free, verify, the user's own reads through the module) would
 * have to wait first, and a missed one is a silent stale read; the
 * per-bucket pipeline needs none of that. Measured (bench_ddp --zero
 * --machine, 2 ranks, width 1024, 4 layers, 30 steps, 14 interleaved runs
 * each on a loaded, shared 2-core machine): medians 38.6 -> 37.6 ms per
 * step, 12.6 -> 11.8 ms in the step phase, within that machine's noise:
 * with one core per rank the update and Gloo's copies share the core. The
 * overlap pays where collectives run beside the computation (NCCL's own
 * stream) or the link is slow. Parameter ->grad keeps pointing into
 * the flat buffers, so local accumulation (no_sync) and zero_grad are as
 * in plain DDP; after a synchronised backward ->grad holds this rank's
 * local sum, the averaged gradient exists only in the shards.
 *
 * The bucket rebuild after the first synchronised backward (Note [Buckets]
 * in ddp.c) changes the chunks: it waits for the end of the first
 * nb_ddp_step, which gathers the state on every rank, rebuilds, and takes
 * the new shards (once, with the full state held for that moment).
 *
 * Consolidation all-gathers each moment bucket by bucket in the same padded
 * layout and writes it into the user's optimizer's tensors on the ranks
 * that asked for it: nb_optim_state then gives exactly the tensors, names
 * and step counts a plain optimizer would, and a checkpoint written from it
 * is the same file. Loading goes the other way: load into the full
 * optimizer (before nb_ddp_set_zero, or after detaching), and
 * nb_ddp_set_zero takes each rank's pieces out of it, whatever world size
 * wrote the file.
 *
 * A world of one without buckets has nothing to shard: the optimizer keeps
 * its state and nb_ddp_step is its plain step.
 *
 * ZeRO-1 meets the reducer only through its hook points (Note [DDP hook
 * points] in ddp.c): a communication hook that pads each bucket's flat
 * (flat_numel) and reduce-scatters it (launch), per-bucket chunks and
 * shards remade with the buckets (buckets_made), the averaged gradients
 * marked fresh (sync_end) and the one-time rebuild taken over
 * (take_rebuild).
 *
 * Note [ZeRO-2]
 * After a synchronised backward a rank needs only its averaged shard of
 * each bucket; the bucket's flat (the local sums) is dead once the
 * reduce-scatter has read it. With stage 2 that memory is given back as
 * soon as the bucket's collective has been waited for (grads_final, in
 * the end-of-backward loop, bucket by bucket: nb__ddp_drop_bucket_grads,
 * which frees the bucket's own context and sets its parameters' ->grad to
 * NULL), and made again, zeros, when the next nb_ddp_backward begins
 * (backward_begin, nb__ddp_make_bucket_grads), so that autograd still
 * accumulates straight into communication memory. A no_sync backward
 * reduces nothing and frees nothing: the accumulated sums stay until the
 * synchronising one. The arithmetic is ZeRO-1's (the same reduce-scatter
 * into the same shards, the same step), so the results are the same bits.
 * The memory saved is what lives between backwards (the forward, the step,
 * the data loading); during the backward every bucket's flat exists from
 * its start, so the step's peak is plain DDP's. Making a bucket's flat
 * only when its first gradient arrives is what the optimizer's flat
 * gradient buffer now does (Note [Gradient segments] in
 * autograd/backward.c: a segment is made at the first gradient one of its
 * slots receives); the buckets do not use that yet. After the bucket
 * rebuild (new flats, zeros) they are given back again at once. Each
 * bucket's memory is a context of its own, made and freed per step: on
 * CUDA that is a device allocation and a free (which waits for the
 * device) per bucket and step, a cost the CPU does not have; taking the
 * blocks back into one arena would remove it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_reducer.h"
#include "distributed/internal.h"
#include "optim/sharded.h"
#include "tensor/backend.h"
#include "tensor/internal.h"
#include "util/handle.h"

/* ZeRO-1: the part of one parameter that lies in this rank's chunk of its
 * bucket. */
typedef struct zero_piece {
    int param;       /* wrapper index */
    int bucket;
    int64_t start;   /* first element, in the parameter */
    int64_t len;
    int64_t at;      /* first element, in the bucket's shard */
} zero_piece;

typedef struct zero_state {
    nb_optim *opt;         /* the user's optimizer whose state is sharded */
    nb__optim_shard *sh;   /* the optimizer's state for this rank's pieces (optim/sharded.c) */
    zero_piece *pieces;    /* malloc'd */
    int n_pieces;
    /* per bucket (malloc'd, remade with the buckets): flat has chunk * world
     * elements (zero padding after numel); shard receives this rank's
     * averaged chunk (in the buckets' context) */
    int64_t *chunk;
    nb_tensor **shard;
    nb_tensor *send, *gather; /* all-gather buffers (largest chunk, chunk * world) in d->ctx */
    int stage;             /* 1: optimizer state sharded; 2: and gradients (Note [ZeRO-2]) */
    bool fresh;            /* a synchronised backward reduce-scattered since the last step */
    bool rebuild;          /* the bucket rebuild waits for the end of nb_ddp_step */
} zero_state;

static zero_state *zero_of(const nb_ddp *d) { return nb__ddp_state(d, NB__DDP_ZERO); }

/* ---- hook points ---- */

static int64_t zero_flat_numel(const nb_ddp *d, void *self, int64_t numel) {
    (void)self;
    return (numel + d->world - 1) / d->world * d->world;
}

static void zero_buckets_made(nb_ddp *d, void *self) {
    zero_state *z = self;
    free(z->chunk);
    free(z->shard);
    z->chunk = nb__ddp_calloc((size_t)d->n_buckets, sizeof *z->chunk);
    z->shard = nb__ddp_calloc((size_t)d->n_buckets, sizeof *z->shard);
    for (int bi = 0; bi < d->n_buckets; bi++) {
        z->chunk[bi] = (d->buckets[bi].numel + d->world - 1) / d->world;
        z->shard[bi] = nb_zeros(d->ctx, d->buckets[bi].dtype, 1, &z->chunk[bi]);
    }
}

static nb_work *zero_launch(nb_ddp *d, void *self, int b, nb_reduce_op op, size_t *bytes) {
    (void)op; /* join, the only other reduction, is refused with ZeRO-1 */
    zero_state *z = self;
    bucket *bk = &d->buckets[b];
    *bytes = (size_t)bk->numel * nb_dtype_size(bk->dtype);
    return nb_pg_reduce_scatter(d->pg, z->shard[b], bk->flat, NB_REDUCE_AVG);
}

static void zero_sync_end(nb_ddp *d, void *self, double done) {
    (void)d;
    (void)done;
    ((zero_state *)self)->fresh = true;
}

static bool zero_take_rebuild(nb_ddp *d, void *self) {
    (void)d;
    ((zero_state *)self)->rebuild = true; /* after the step (Note [ZeRO-1]) */
    return true;
}

/* ZeRO-2: the buckets' gradient memory is made again for a backward ... */
static void zero_backward_begin(nb_ddp *d, void *self) {
    zero_state *z = self;
    if (z->stage < 2 || !d->bucketed) return;
    for (int b = 0; b < d->n_buckets; b++) nb__ddp_make_bucket_grads(d, b);
}

/* ... and given back as soon as the bucket's reduce-scatter has finished. */
static void zero_grads_final(nb_ddp *d, void *self, const int *params, int n) {
    zero_state *z = self;
    if (z->stage < 2 || !d->bucketed || n == 0) return;
    nb__ddp_drop_bucket_grads(d, d->bucket_of[params[0]]);
}

static void drop_all_grads(nb_ddp *d) {
    for (int b = 0; b < d->n_buckets; b++) nb__ddp_drop_bucket_grads(d, b);
}

static void make_all_grads(nb_ddp *d) {
    for (int b = 0; b < d->n_buckets; b++) nb__ddp_make_bucket_grads(d, b);
}

static void zero_forget(nb_ddp *d, void *self);

static const nb__ddp_hooks zero_hooks = {
    .name = "ZeRO",
    .collective = "reduce-scatter",
    .flat_numel = zero_flat_numel,
    .launch = zero_launch,
    .buckets_made = zero_buckets_made,
    .backward_begin = zero_backward_begin,
    .grads_final = zero_grads_final,
    .sync_end = zero_sync_end,
    .take_rebuild = zero_take_rebuild,
    .free = zero_forget,
};

/* 1-D view of elements [start, start + len) of contiguous t. */
static nb_tensor *flat_view(nb_ctx *ctx, nb_tensor *t, int64_t start, int64_t len) {
    int64_t st = 1;
    return nb__view(ctx, t, 1, &len, &st, (char *)t->data + start * (int64_t)nb_dtype_size(t->dtype));
}

/* t's shape over elements [start, ...) of contiguous flat. */
static nb_tensor *shaped_view(nb_ctx *ctx, nb_tensor *flat, int64_t start, const nb_tensor *t) {
    int64_t st[NB_MAX_DIMS];
    nb__contig_strides(t->ndim, t->shape, st);
    return nb__view(ctx, flat, t->ndim, t->shape, st,
                    (char *)flat->data + start * (int64_t)nb_dtype_size(flat->dtype));
}

/* The pieces of this rank's chunks and the sharded optimizer over them,
 * its moments taken from the user's (full) optimizer, whose own are then
 * released (Note [Sharded optimizer] in optim/sharded.c). */
static void zero_build(nb_ddp *d, zero_state *z) {
    free(z->pieces);
    z->pieces = NULL;
    z->n_pieces = 0;
    int cap = d->n + d->n_buckets;
    z->pieces = nb__ddp_calloc((size_t)cap, sizeof(zero_piece));
    int64_t max_chunk = 0;
    for (int bi = 0; bi < d->n_buckets; bi++) {
        bucket *b = &d->buckets[bi];
        int64_t chunk = z->chunk[bi];
        if (chunk > max_chunk) max_chunk = chunk;
        int64_t lo = (int64_t)d->rank * chunk, hi = lo + chunk < b->numel ? lo + chunk : b->numel;
        for (int k = 0; k < b->n; k++) {
            int64_t o = b->offsets[k], m = nb_numel(d->p[b->params[k]].tensor);
            int64_t a = o > lo ? o : lo, e = o + m < hi ? o + m : hi;
            if (a >= e) continue;
            NB_CHECK(z->n_pieces < cap, "nb_ddp_set_zero: more pieces than expected (%d)", cap);
            z->pieces[z->n_pieces++] = (zero_piece){b->params[k], bi, a - o, e - a, a - lo};
        }
    }
    int64_t gather = 2 * max_chunk * d->world, send = 2 * max_chunk; /* two slots */
    nb_dtype dt = d->n_buckets ? d->buckets[0].dtype : NB_F32;
    for (int bi = 0; bi < d->n_buckets; bi++)
        if (nb_dtype_size(d->buckets[bi].dtype) > nb_dtype_size(dt)) dt = d->buckets[bi].dtype;
    z->send = nb_empty(d->ctx, dt, 1, &send);
    z->gather = nb_empty(d->ctx, dt, 1, &gather);
    nb__optim_piece *pc = nb__ddp_calloc((size_t)(z->n_pieces ? z->n_pieces : 1), sizeof *pc);
    for (int j = 0; j < z->n_pieces; j++) {
        zero_piece *zp = &z->pieces[j];
        pc[j] = (nb__optim_piece){d->p[zp->param].tensor, zp->start, zp->len,
                                  flat_view(d->ctx, z->shard[zp->bucket], zp->at, zp->len), d->p[zp->param].name, NULL};
    }
    z->sh = nb__optim_shard_new(z->opt, d->ctx, z->n_pieces, pc);
    free(pc);
}

static void zero_drop_shard(zero_state *z) {
    nb__optim_shard_free(z->sh);
    z->sh = NULL;
}

/* Moments of every piece gathered into the user's optimizer on `root`
 * (every rank when root < 0). Collective. */
static nb_status zero_gather(nb_ddp *d, zero_state *z, int root) {
    nb_optim *opt = z->opt;
    bool receive = root < 0 || root == d->rank;
    if (receive) nb__optim_alloc_state(opt);
    int K = nb__optim_moment_count(opt); /* the same on every rank */
    for (int bi = 0; bi < d->n_buckets; bi++) {
        bucket *b = &d->buckets[bi];
        nb_tensor *send = flat_view(d->ctx, z->send, 0, z->chunk[bi]);
        nb_tensor *out = flat_view(d->ctx, z->gather, 0, z->chunk[bi] * d->world);
        send->dtype = out->dtype = b->dtype;
        for (int k = 0; k < K; k++) {
            nb_fill_(send, 0);
            for (int j = 0; j < z->n_pieces; j++) {
                zero_piece *pc = &z->pieces[j];
                if (pc->bucket != bi) continue;
                nb_tensor *m = nb__optim_shard_moment(z->sh, j, k);
                if (m) nb_copy_(flat_view(d->ctx, send, pc->at, pc->len), m);
            }
            nb_status st = nb_work_finish(nb_pg_all_gather(d->pg, out, send));
            if (st != NB_OK) return st;
            if (!receive) continue;
            for (int j = 0; j < b->n; j++) {
                int oi = nb__optim_param_index(opt, d->p[b->params[j]].tensor);
                if (oi < 0) continue;
                nb_tensor *m = nb__optim_moment(opt, oi, k);
                if (m) nb_copy_(m, shaped_view(d->ctx, out, b->offsets[j], m));
            }
        }
    }
    return NB_OK;
}

/* The bucket rebuild under ZeRO-1: state gathered, buckets rebuilt, shards
 * taken again (Note [ZeRO-1]). */
static nb_status zero_rebuild(nb_ddp *d, zero_state *z) {
    nb_status st = zero_gather(d, z, -1);
    if (st != NB_OK) return st;
    zero_drop_shard(z);
    st = nb__ddp_rebuild_buckets(d);
    zero_build(d, z); /* from the full state, also when the rebuild's broadcast failed */
    if (z->stage >= 2) drop_all_grads(d); /* the new buckets' memory: consumed gradients */
    return st;
}

static void zero_state_free(zero_state *z) {
    free(z->pieces);
    free(z->chunk);
    free(z->shard);
    free(z);
}

/* nb_ddp_free while attached. */
static void zero_forget(nb_ddp *d, void *self) {
    (void)d;
    zero_state *z = self;
    zero_drop_shard(z);
    nb__optim_give_back(z->opt); /* the shards are lost unless the state was gathered back */
    zero_state_free(z);
}

static nb_status set_zero(nb_ddp *d, nb_optim *opt, int stage, const char *who) {
    NB__CHECK_HANDLE(who, d, "DDP handle");
    NB_CHECK(!d->in_backward, "%s: rank %d: called inside a backward", who, d->rank);
    NB_CHECK(stage == 1 || stage == 2, "%s: rank %d: stage %d; 1 shards the optimizer state, 2 the "
             "gradients too (parameter sharding, stage 3, is not available)", who, d->rank, stage);
    zero_state *z = zero_of(d);
    if (z && opt == z->opt) {
        if (z->stage == 2 && stage == 1) make_all_grads(d);
        z->stage = stage;
        return NB_OK;
    }
    if (!opt && !z) return NB_OK;
    if (!opt) { /* detach: every rank gets the whole state back */
        nb_status st = d->bucketed ? zero_gather(d, z, -1) : NB_OK;
        if (st != NB_OK) return st;
        zero_drop_shard(z);
        nb__optim_give_back(z->opt);
        bool rebuild = z->rebuild;
        make_all_grads(d); /* ZeRO-2 gave them back: zeros, as after zero_grad */
        nb__ddp_detach(d, NB__DDP_ZERO);
        zero_state_free(z);
        if (rebuild) return nb__ddp_rebuild_buckets(d); /* the rebuild a step would have done, unpadded now */
        return NB_OK;
    }
    /* combinations the wrapper refuses are statuses, as in nb_ddp_set_optimizer */
    if (z)
        return nb_set_error(NB_ERR_INVALID, "%s: rank %d: ZeRO is already on with another "
                            "optimizer; detach it first with nb_ddp_set_zero(ddp, NULL)", who, d->rank);
    nb_status st = nb__ddp_check_conflicts(d, NB__DDP_ZERO, who); /* Note [Feature conflicts] */
    if (st != NB_OK) return st;
    st = nb__optim_can_take(opt, NB__OPTIM_SHARDED, who, d->rank);
    if (st != NB_OK) return st;
    for (int j = 0; j < nb_optim_param_count(opt); j++) {
        bool in = false;
        for (int i = 0; i < d->n && !in; i++) in = d->p[i].tensor == nb__optim_param_tensor(opt, j);
        if (!in)
            return nb_set_error(NB_ERR_INVALID, "%s: rank %d: optimizer parameter \"%s\" is not a "
                                "parameter (that requires grad) of the wrapped model; ZeRO shards only the "
                                "wrapper's parameters", who, d->rank, nb__optim_param_name(opt, j));
    }
    st = nb__optim_take(opt, NB__OPTIM_SHARDED, who, d->rank);
    if (st != NB_OK) return st;
    z = nb__ddp_calloc(1, sizeof *z);
    z->opt = opt;
    z->stage = stage;
    nb__ddp_attach(d, NB__DDP_ZERO, &zero_hooks, z);
    if (d->bucketed) {
        nb__ddp_reassign_buckets(d); /* padded, with shards (zero_buckets_made) */
        zero_build(d, z);
    }
    return NB_OK;
}

nb_status nb_ddp_set_zero(nb_ddp *d, nb_optim *opt) {
    zero_state *z = d ? zero_of(d) : NULL;
    return set_zero(d, opt, z && z->opt == opt ? z->stage : 1, "nb_ddp_set_zero");
}

nb_status nb_ddp_set_zero_stage(nb_ddp *d, nb_optim *opt, int stage) {
    return set_zero(d, opt, stage, "nb_ddp_set_zero_stage");
}

int nb_ddp_zero_stage(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_zero_stage", d, "DDP handle");
    zero_state *z = zero_of(d);
    return z ? z->stage : 0;
}

size_t nb_ddp_state_bytes(const nb_ddp *d, const nb_optim *opt) {
    NB__CHECK_HANDLE("nb_ddp_state_bytes", d, "DDP handle");
    size_t bytes = opt ? nb_optim_state_bytes(opt) : 0;
    for (int i = 0; i < d->n; i++) {
        const nb_tensor *t = d->p[i].tensor;
        bytes += (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
        if (!d->bucketed && t->grad) bytes += (size_t)nb_numel(t->grad) * nb_dtype_size(t->grad->dtype);
    }
    for (int b = 0; b < d->n_buckets; b++)
        if (d->buckets[b].flat) bytes += (size_t)nb_numel(d->buckets[b].flat) * nb_dtype_size(d->buckets[b].dtype);
    zero_state *z = zero_of(d);
    if (z && d->bucketed)
        for (int b = 0; b < d->n_buckets; b++) bytes += (size_t)z->chunk[b] * nb_dtype_size(d->buckets[b].dtype);
    return bytes;
}

nb_optim *nb_ddp_zero_optimizer(const nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_zero_optimizer", d, "DDP handle");
    zero_state *z = zero_of(d);
    return z ? z->opt : NULL;
}

nb_status nb_ddp_consolidate_optimizer(nb_ddp *d, int root) {
    NB__CHECK_HANDLE("nb_ddp_consolidate_optimizer", d, "DDP handle");
    zero_state *z = d ? zero_of(d) : NULL;
    NB_CHECK(d && z, "nb_ddp_consolidate_optimizer: %s",
             d ? "ZeRO-1 is off (nb_ddp_set_zero)" : "NULL wrapper");
    NB_CHECK(root >= -1 && root < d->world,
             "nb_ddp_consolidate_optimizer: rank %d: root %d outside [-1, %d)", d->rank, root, d->world);
    return d->bucketed ? zero_gather(d, z, root) : NB_OK;
}

/* ---- sharded checkpoints ---- */

/* Whether t is a wrapper parameter in a bucket (its elements are then cut
 * over the ranks' chunks). */
static bool in_bucket(void *user, const nb_tensor *t) {
    const nb_ddp *d = user;
    for (int bi = 0; bi < d->n_buckets; bi++)
        for (int k = 0; k < d->buckets[bi].n; k++)
            if (d->p[d->buckets[bi].params[k]].tensor == t) return true;
    return false;
}

nb_status nb_ddp_zero_checkpoint_pieces(nb_ddp *d, const nb_named_tensor *model, int n_model, nb_ctx *ctx,
                                        nb_checkpoint_piece **pieces, int *n_out) {
    NB__CHECK_HANDLE("nb_ddp_zero_checkpoint_pieces", d, "DDP handle");
    zero_state *z = zero_of(d);
    NB_CHECK(z, "nb_ddp_zero_checkpoint_pieces: ZeRO is off (nb_ddp_set_zero)");
    NB_CHECK(n_model >= 0 && (n_model == 0 || model) && ctx && pieces && n_out,
             "nb_ddp_zero_checkpoint_pieces: bad arguments");
    nb__optim_piece *pc = nb__ddp_calloc((size_t)(z->n_pieces + 1), sizeof *pc);
    for (int j = 0; j < z->n_pieces; j++) {
        nb_tensor *t = d->p[z->pieces[j].param].tensor;
        pc[j] = (nb__optim_piece){.param = t, .start = z->pieces[j].start, .len = z->pieces[j].len,
                                  .data = flat_view(ctx, t, z->pieces[j].start, z->pieces[j].len)};
    }
    nb__optim_checkpoint_pieces(z->opt, z->sh, pc, z->sh ? z->n_pieces : 0, d->rank == 0, in_bucket, d, model,
                                n_model, pieces, n_out);
    free(pc);
    return NB_OK;
}

/* ---- the step ---- */

/* Slot s (of two) of the all-gather buffers, typed for bucket bi. */
static void gather_slot(nb_ddp *d, zero_state *z, nb_ctx *sc, int bi, int s, nb_tensor **send,
                        nb_tensor **out) {
    int64_t max_chunk = nb_numel(z->send) / 2, chunk = z->chunk[bi];
    *send = flat_view(sc, z->send, s * max_chunk, chunk);
    *out = flat_view(sc, z->gather, s * max_chunk * d->world, chunk * d->world);
    (*send)->dtype = (*out)->dtype = d->buckets[bi].dtype;
}

/* Waits for bucket bi's gather in slot s and copies it into the parameters. */
static nb_status gather_finish(nb_ddp *d, zero_state *z, nb_ctx *sc, int bi, int s, nb_work *w) {
    nb_status st = nb_work_finish(w);
    if (st != NB_OK) return st;
    bucket *b = &d->buckets[bi];
    nb_tensor *send, *out;
    gather_slot(d, z, sc, bi, s, &send, &out);
    for (int j = 0; j < b->n; j++) {
        nb_tensor *t = d->p[b->params[j]].tensor;
        nb_copy_(t, shaped_view(sc, out, b->offsets[j], t));
    }
    return NB_OK;
}

/* The shard optimizer's update and the parameters' all-gather, bucket by
 * bucket with two gathers in flight (Note [ZeRO-1]): bucket bi's pieces
 * are updated while bucket bi-1's gather runs. Every gather has finished
 * and been copied back when it returns, also on failure. */
static nb_status step_and_gather(nb_ddp *d, zero_state *z) {
    nb_ctx *sc = nb__optim_scratch(nb_pg_device(d->pg)); /* the views, reset at its next use */
    nb_work *work[2] = {NULL, NULL};
    int held[2] = {-1, -1}; /* the bucket whose gather a slot holds */
    nb_status st = NB_OK;
    int j = 0;
    for (int bi = 0; bi < d->n_buckets; bi++) {
        bucket *b = &d->buckets[bi];
        int64_t chunk = z->chunk[bi];
        int first = j;
        while (j < z->n_pieces && z->pieces[j].bucket == bi) j++;
        nb__optim_shard_step(z->sh, first, j);
        int s = bi & 1;
        if (work[s]) {
            nb_status f = gather_finish(d, z, sc, held[s], s, work[s]);
            if (st == NB_OK) st = f;
            work[s] = NULL;
        }
        if (st != NB_OK) continue; /* a failed group: no new collective, the rest are drained */
        nb_tensor *send, *out;
        gather_slot(d, z, sc, bi, s, &send, &out);
        int64_t own = b->numel - (int64_t)d->rank * chunk; /* the rest of the chunk is padding */
        own = own < 0 ? 0 : own < chunk ? own : chunk;
        if (own < chunk) nb_fill_(flat_view(sc, send, own, chunk - own), 0);
        for (int q = first; q < j; q++) {
            zero_piece *pc = &z->pieces[q];
            nb_copy_(flat_view(sc, send, pc->at, pc->len),
                     flat_view(sc, d->p[pc->param].tensor, pc->start, pc->len));
        }
        work[s] = nb_pg_all_gather(d->pg, out, send);
        held[s] = bi;
    }
    NB_CHECK(j == z->n_pieces, "nb_ddp_step: rank %d: pieces out of bucket order (%d of %d)",
             d->rank, j, z->n_pieces);
    for (int n = 0; n < 2; n++) {
        int s = (d->n_buckets + n) & 1; /* the older gather first */
        if (!work[s]) continue;
        nb_status f = gather_finish(d, z, sc, held[s], s, work[s]);
        if (st == NB_OK) st = f;
    }
    return st;
}

nb_status nb_ddp_step(nb_ddp *d) {
    NB__CHECK_HANDLE("nb_ddp_step", d, "DDP handle");
    zero_state *z = zero_of(d);
    NB_CHECK(z, "nb_ddp_step: rank %d: ZeRO-1 is off; attach the optimizer with "
             "nb_ddp_set_zero(ddp, opt) (or step it yourself with nb_optim_step)", d->rank);
    NB_CHECK(z->fresh, "nb_ddp_step: rank %d: no synchronised nb_ddp_backward since the last "
             "step (a no_sync backward only accumulates locally: turn no_sync off for the "
             "backward that reduces)", d->rank);
    nb_optim *opt = z->opt;
    z->fresh = false;
    if (!d->bucketed) { /* nothing sharded: the plain step */
        int n = nb_optim_param_count(opt), *all = nb__ddp_calloc((size_t)n, sizeof(int));
        for (int i = 0; i < n; i++) all[i] = i;
        nb__optim_count_step(opt);
        nb__optim_step_params(opt, all, n);
        free(all);
        return NB_OK;
    }
    nb__optim_shard_begin_step(z->sh);
    nb_status st = step_and_gather(d, z);
    if (st != NB_OK) return st;
    if (z->rebuild) {
        z->rebuild = false;
        st = zero_rebuild(d, z);
    }
    return st;
}

/* ---- clipping ---- */

/* Each rank holds slices of the gradient (ZeRO's shards of each bucket,
 * FSDP's of each unit), so the norm is the all-reduced sum of the squares
 * of every rank's slices (the max of the maxima for norm_type inf), and
 * each rank scales its own slices by the coefficient nb_clip_grad_norm
 * would use. A NaN anywhere makes the sum NaN (the max may have dropped
 * it); a non-finite norm scales nothing. */
nb_status nb__shard_clip_grad_norm(nb_pg *pg, nb_ctx *sc, int k, nb_tensor **gl, double max_norm,
                                   double norm_type, double *norm) {
    const nb__backend *be = nb__backend_of(nb_ctx_device(sc));
    double v2[2] = {0, 0}; /* sum of squares, max |g| */
    nb_tensor *out = nb__empty(sc, NB_F64, 0, NULL);
    be->sum_squares(out, k, gl);
    v2[0] = nb_item(out);
    if (norm_type != 2.0) {
        be->max_abs(sc, out, k, gl);
        v2[1] = nb_item(out);
    }
    if (pg) {
        nb_tensor *v = nb_from_host(sc, NB_F64, NB_SHAPE(2), v2);
        nb_status st = nb_work_finish(nb_pg_all_reduce(pg, flat_view(sc, v, 0, 1), NB_REDUCE_SUM));
        if (st == NB_OK && norm_type != 2.0)
            st = nb_work_finish(nb_pg_all_reduce(pg, flat_view(sc, v, 1, 1), NB_REDUCE_MAX));
        if (st != NB_OK) return st;
        nb_to_host(v, v2);
    }
    double total = isnan(v2[0]) ? NAN : norm_type == 2.0 ? sqrt(v2[0]) : v2[1];
    *norm = total;
    if (!isfinite(total)) return NB_OK;
    double coef = max_norm / (total + 1e-6);
    if (coef < 1.0 && k) be->scale(k, gl, coef);
    return NB_OK;
}

nb_status nb_ddp_clip_grad_norm(nb_ddp *d, double max_norm, double norm_type, double *norm) {
    NB__CHECK_HANDLE("nb_ddp_clip_grad_norm", d, "DDP handle");
    NB_CHECK(d && norm, "nb_ddp_clip_grad_norm: NULL argument");
    *norm = NAN;
    NB_CHECK(!nb__ddp_attached(d, NB__DDP_BUCKET_STEP), "nb_ddp_clip_grad_norm: rank %d: the wrapper steps "
             "an optimizer per bucket (nb_ddp_set_optimizer): nb_ddp_backward has already applied the "
             "gradients", d->rank);
    zero_state *z = zero_of(d);
    if (!z || !d->bucketed) { /* every rank holds the averaged gradients */
        *norm = nb_clip_grad_norm(d->p, d->n, max_norm, norm_type);
        return NB_OK;
    }
    NB_CHECK(norm_type == 2.0 || (isinf(norm_type) && norm_type > 0),
             "nb_ddp_clip_grad_norm: norm_type = %g; supported are 2 and INFINITY", norm_type);
    NB_CHECK(max_norm >= 0 && !isnan(max_norm), "nb_ddp_clip_grad_norm: max_norm = %g must be >= 0",
             max_norm);
    NB_CHECK(z->fresh, "nb_ddp_clip_grad_norm: rank %d: no synchronised nb_ddp_backward since "
             "the last step: there are no averaged gradients to clip", d->rank);
    nb_device dev = nb_pg_device(d->pg);
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)(d->n_buckets ? d->n_buckets : 1));
    int k = 0;
    for (int bi = 0; bi < d->n_buckets; bi++) {
        int64_t lo = (int64_t)d->rank * z->chunk[bi];
        int64_t own = d->buckets[bi].numel - lo < z->chunk[bi] ? d->buckets[bi].numel - lo : z->chunk[bi];
        if (own > 0) gl[k++] = flat_view(sc, z->shard[bi], 0, own);
    }
    return nb__shard_clip_grad_norm(d->pg, sc, k, gl, max_norm, norm_type, norm);
}

/* ---- the grad scaler (Note [ZeRO-1 grad scaler]) ----
 *
 * Note [ZeRO-1 grad scaler]
 * Under ZeRO-1 the averaged gradients exist only in the shards, so the
 * scaler's unscale and check run there: each rank multiplies its own part
 * of every bucket's shard by 1 / scale and checks it; an inf or NaN in any
 * rank's local gradient reaches, through the reduce-scatter's sum, the
 * shard of the rank that owns that element, so the ranks then agree on
 * found-inf by an all-reduce (max) of their flags: all skip or all step,
 * as with plain DDP, where the all-reduce gives every rank the inf. A
 * skipped step consumes the gradients (the next step needs a new
 * synchronised backward) and does the bucket rebuild a first step would
 * have done. With a world of one without buckets the optimizer's own
 * gradients are unscaled and checked, as nb_grad_scaler_unscale does. */

/* This rank's averaged gradients: its part of each shard (bucketed), else
 * the gradients of opt's parameters. */
static int own_grads(nb_ddp *d, zero_state *z, nb_ctx *sc, nb_tensor ***out) {
    int cap = (d->bucketed ? d->n_buckets : nb_optim_param_count(z->opt)) + 1, k = 0;
    nb_tensor **gl = nb__ctx_meta(sc, sizeof *gl * (size_t)cap);
    if (d->bucketed) {
        for (int bi = 0; bi < d->n_buckets; bi++) {
            int64_t lo = (int64_t)d->rank * z->chunk[bi];
            int64_t own = d->buckets[bi].numel - lo < z->chunk[bi] ? d->buckets[bi].numel - lo : z->chunk[bi];
            if (own > 0) gl[k++] = flat_view(sc, z->shard[bi], 0, own);
        }
    } else {
        for (int i = 0; i < nb_optim_param_count(z->opt); i++) {
            nb_tensor *g = nb__optim_param_tensor(z->opt, i)->grad;
            if (g) gl[k++] = nb__contig(sc, g);
        }
    }
    *out = gl;
    return k;
}

static void check_fresh(const nb_ddp *d, const char *who) {
    NB_CHECK(zero_of(d)->fresh, "%s: rank %d: no synchronised nb_ddp_backward since the last step: "
             "there are no averaged gradients to unscale", who, d->rank);
}

static nb_status scaler_unscale(nb_ddp *d, nb_grad_scaler *s, const char *who) {
    double inv = nb__grad_scaler_begin_unscale(s, who);
    check_fresh(d, who);
    nb_device dev = nb_pg_device(d->pg);
    nb_ctx *sc = nb__optim_scratch(dev);
    nb_tensor **gl;
    int k = own_grads(d, zero_of(d), sc, &gl);
    const nb__backend *be = nb__backend_of(dev);
    for (int i = 0; i < k; i++) nb_scale_(gl[i], inv); /* the arithmetic of nb_grad_scaler_unscale */
    double bad = k && !be->all_finite(sc, k, gl) ? 1 : 0;
    if (d->bucketed) {
        nb_tensor *v = nb_from_host(sc, NB_F64, NB_SHAPE(1), &bad);
        nb_status st = nb_work_finish(nb_pg_all_reduce(d->pg, v, NB_REDUCE_MAX));
        if (st != NB_OK) return st;
        nb_to_host(v, &bad);
    }
    nb__grad_scaler_end_unscale(s, bad != 0);
    return NB_OK;
}

static void check_scaler_call(const nb_ddp *d, const nb_grad_scaler *s, const char *who) {
    NB_CHECK(d && s, "%s: NULL argument", who);
    NB_CHECK(zero_of(d), "%s: rank %d: ZeRO-1 is off (nb_ddp_set_zero); without it use "
             "nb_grad_scaler_unscale / nb_grad_scaler_step on the optimizer", who, d->rank);
}

nb_status nb_ddp_scaler_unscale(nb_ddp *d, nb_grad_scaler *s) {
    NB__CHECK_HANDLE("nb_ddp_scaler_unscale", d, "DDP handle");
    NB__CHECK_HANDLE("nb_ddp_scaler_unscale", s, "gradient scaler");
    check_scaler_call(d, s, "nb_ddp_scaler_unscale");
    return scaler_unscale(d, s, "nb_ddp_scaler_unscale");
}

nb_status nb_ddp_scaler_step(nb_ddp *d, nb_grad_scaler *s, bool *stepped) {
    NB__CHECK_HANDLE("nb_ddp_scaler_step", d, "DDP handle");
    NB__CHECK_HANDLE("nb_ddp_scaler_step", s, "gradient scaler");
    const char *who = "nb_ddp_scaler_step";
    check_scaler_call(d, s, who);
    NB_CHECK(stepped, "%s: NULL argument", who);
    *stepped = false;
    if (nb__grad_scaler_begin_step(s, who)) {
        nb_status st = scaler_unscale(d, s, who);
        if (st != NB_OK) return st;
    } else {
        check_fresh(d, who);
    }
    if (nb__grad_scaler_end_step(s)) {
        *stepped = true;
        return nb_ddp_step(d);
    }
    zero_state *z = zero_of(d);
    z->fresh = false;
    if (z->rebuild) {
        z->rebuild = false;
        return zero_rebuild(d, z);
    }
    return NB_OK;
}
