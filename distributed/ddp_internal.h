/* What the wrapper's constructor (ddp_wrapper.c) and the tests reach of
 * DDP's features: the features that the options switch on attach here.
 * Features switched on by a public call (nb_ddp_join_begin,
 * nb_ddp_set_zero, nb_ddp_set_optimizer) attach themselves and need no
 * line. The reducer (ddp.c) never includes this header (Note [DDP hook
 * points] in ddp.c). Not installed. */
#ifndef NABLA_DISTRIBUTED_DDP_INTERNAL_H
#define NABLA_DISTRIBUTED_DDP_INTERNAL_H

#include "distributed/ddp_reducer.h"

/* ddp_stats.c: step statistics (and, with record_timeline, the trace) of
 * every synchronised bucketed step. */
void nb__ddp_stats_attach(nb_ddp *d);

/* ddp_overlap.c: steps kept for nb_ddp_overlap_across_ranks (record_timeline). */
void nb__ddp_overlap_attach(nb_ddp *d);
/* Tests only: when nonzero, the largest overlap record sent (bytes), in
 * place of the store's NB_STORE_MAX_VALUE. */
extern size_t nb__ddp_overlap_record_cap;
/* The figures of nb_ddp_overlap_across_ranks from every rank's steps:
 * steps[r][s] is rank r's step s (times absolute on rank r's clock, whose
 * offset from the common clock is offset[r]); every rank's step s has the
 * same bucket count. Pure: no communication. */
void nb__ddp_overlap_compute(int world, int steps, trace_step *const *steps_of, const double *offset,
                             nb_ddp_overlap *out);

/* ddp_wire.c: the bf16 communication hook (comm_hook NB_DDP_HOOK_BF16). */
void nb__ddp_wire_attach(nb_ddp *d);

#endif
