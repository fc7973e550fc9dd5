/* The bf16 communication hook (comm_hook NB_DDP_HOOK_BF16): each bucket is
 * cast to a bf16 copy, all-reduced (half the bytes on the wire for f32
 * gradients) and widened back into the bucket, as c10d's bf16 compression
 * hook. A bucket that holds bf16 gradients is sent as it is. On CUDA the
 * casts stay on the device (Note [DDP on CUDA] in ddp.c). */
#include <stdlib.h>

#include "distributed/ddp_internal.h"

typedef struct wire_state {
    nb_tensor **wire; /* per bucket: the bf16 copy (in the buckets' context), or NULL */
} wire_state;

static void wire_buckets_made(nb_ddp *d, void *self) {
    wire_state *w = self;
    free(w->wire);
    w->wire = nb__ddp_calloc((size_t)d->n_buckets, sizeof *w->wire);
    for (int b = 0; b < d->n_buckets; b++)
        if (d->buckets[b].dtype != NB_BF16) w->wire[b] = nb_empty(d->ctx, NB_BF16, 1, &d->buckets[b].numel);
}

static nb_work *wire_launch(nb_ddp *d, void *self, int b, nb_reduce_op op, size_t *bytes) {
    wire_state *w = self;
    bucket *bk = &d->buckets[b];
    *bytes = (size_t)bk->numel * nb_dtype_size(NB_BF16);
    if (!w->wire[b]) return nb_pg_all_reduce(d->pg, bk->flat, op);
    nb_copy_(w->wire[b], bk->flat);
    return nb_pg_all_reduce(d->pg, w->wire[b], op);
}

static nb_status wire_finish(nb_ddp *d, void *self, int b, bool keep, double *started, double *finished) {
    (void)started, (void)finished; /* the launch's all-reduce's, as the reducer set them */
    wire_state *w = self;
    if (keep && w->wire[b]) nb_copy_(d->buckets[b].flat, w->wire[b]);
    return NB_OK;
}

static void wire_free(nb_ddp *d, void *self) {
    (void)d;
    wire_state *w = self;
    free(w->wire);
    free(w);
}

static const nb__ddp_hooks wire_hooks = {
    .name = "the bf16 communication hook",
    .collective = "all-reduce",
    .launch = wire_launch,
    .finish = wire_finish,
    .buckets_made = wire_buckets_made,
    .free = wire_free,
};

void nb__ddp_wire_attach(nb_ddp *d) {
    wire_state *w = nb__ddp_calloc(1, sizeof *w);
    nb__ddp_attach(d, NB__DDP_WIRE, &wire_hooks, w);
    wire_buckets_made(d, w); /* the buckets made before it */
}
