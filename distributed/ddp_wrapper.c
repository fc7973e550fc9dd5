/* The DDP wrapper's construction and destruction: the reducer (ddp.c) with
 * the features that its options switch on attached (Note [DDP hook points]
 * in ddp.c): the step statistics and, with record_timeline, the overlap
 * record, both only with buckets, and the bf16 wire format with comm_hook
 * NB_DDP_HOOK_BF16. Features switched on later by a call (join, ZeRO-1,
 * the per-bucket step) attach themselves. */
#include "distributed/ddp_internal.h"
#include "util/handle.h"

nb_status nb_ddp_new(nb_ddp **out, nb_module *model, nb_pg *pg, const nb_ddp_options *opts) {
    NB_CHECK(out && model && pg, "nb_ddp_new: NULL argument");
    nb_status st = nb__ddp_reducer_new(out, model, pg, opts);
    if (st != NB_OK) return st;
    nb_ddp *d = *out;
    if (d->bucketed) {
        nb__ddp_stats_attach(d);
        if (d->o.record_timeline) nb__ddp_overlap_attach(d);
    }
    if (d->o.comm_hook == NB_DDP_HOOK_BF16) nb__ddp_wire_attach(d);
    return NB_OK;
}

void nb_ddp_free(nb_ddp *d) {
    if (!d) return;
    NB__CHECK_HANDLE("nb_ddp_free", d, "DDP handle"); /* freed twice: Note [Freed handles] */
    nb__ddp_reducer_free(d);
}
