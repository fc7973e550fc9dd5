/* The DDP reducer's state and its one-way API (Note [DDP hook points] in
 * ddp.c). The reducer (ddp.c, with ddp_verify.c and ddp_buckets.c) owns
 * the parameters, the buckets, the gradient-ready hooks, the launch order
 * and the wait; every feature (the statistics and trace, the overlap
 * record, the bf16 wire format, join, ZeRO-1, the per-bucket step) keeps
 * its own state in its own file and attaches a table of hooks. Features
 * read the reducer's fields below and call the functions declared here;
 * the reducer includes no feature's header and calls features only
 * through the tables attached to it. Not installed. */
#ifndef NABLA_DISTRIBUTED_DDP_REDUCER_H
#define NABLA_DISTRIBUTED_DDP_REDUCER_H

#include "nabla/ddp.h"
#include "util/handle.h"

/* Reducer data only: what a feature keeps per bucket lives in its own
 * arrays, indexed by bucket, remade by its buckets_made hook. */
typedef struct bucket {
    nb_dtype dtype;
    int64_t numel;
    nb_tensor *flat;    /* gradient memory: numel elements, then the comm hook's padding */
    nb_ctx *gctx;       /* flat's memory and the parameters' views of it; NULL (and flat
                           NULL, the parameters' ->grad NULL) while given back */
    int n;              /* parameters */
    int *params;        /* indices, in bucket order */
    int64_t *offsets;   /* element offset of each parameter in flat */
    int pending;        /* parameters not ready yet */
    nb_work *work;      /* the collective in flight, or NULL */
    double t_launch;
    size_t bytes;       /* sent per rank by the last launch */
} bucket;

typedef struct hook_ref {
    nb_ddp *ddp;
    int index;
} hook_ref;

/* One synchronised step's timeline: absolute host times. */
typedef struct trace_step {
    double fwd_start, bw_start, bw_end, done;
    int n;
    nb_ddp_bucket_time *b; /* malloc'd */
} trace_step;

/* The features, one slot each. A slot's index is also the order in which
 * the reducer calls the attached tables at each hook point. The string:
 * what a message calls it (with the call that switches it on). */
#define NB__DDP_FEATURE_LIST(X)                                                                     \
    X(NB__DDP_STATS, "the step statistics")              /* ddp_stats.c: statistics, Chrome trace */ \
    X(NB__DDP_OVERLAP, "the overlap record (record_timeline)") /* ddp_overlap.c */                 \
    X(NB__DDP_WIRE, "the bf16 compression hook (comm_hook NB_DDP_HOOK_BF16)") /* ddp_wire.c */     \
    X(NB__DDP_JOIN, "join mode (nb_ddp_join_begin)")      /* ddp_join.c: uneven inputs */          \
    X(NB__DDP_ZERO, "ZeRO (nb_ddp_set_zero)")             /* ddp_zero.c: ZeRO-1, ZeRO-2 */         \
    X(NB__DDP_BUCKET_STEP, "per-bucket optimizer steps (nb_ddp_set_optimizer)") /* ddp_bucket_step.c */ \
    X(NB__DDP_POWERSGD, "the PowerSGD communication hook (nb_ddp_set_powersgd)") /* ddp_powersgd.c */

typedef enum nb__ddp_feature {
#define NB__DDP_FEATURE_ENUM(slot, what) slot,
    NB__DDP_FEATURE_LIST(NB__DDP_FEATURE_ENUM)
#undef NB__DDP_FEATURE_ENUM
    NB__DDP_FEATURES
} nb__ddp_feature;

/* Note [Feature conflicts]
 * The pairs of features that cannot be on together, each written once
 * with the reason. nb__ddp_check_conflicts (ddp.c) reads this table
 * before a feature attaches: the first pair whose other feature is on is
 * an NB_ERR_INVALID naming both features and the reason, whichever of the
 * two is switched on second, so both orders get the same answer. */
#define NB__DDP_CONFLICT_LIST(X)                                                                    \
    X(NB__DDP_JOIN, NB__DDP_ZERO,                                                                   \
      "a joined rank would have to step its shard on the others' gradients")                       \
    X(NB__DDP_JOIN, NB__DDP_BUCKET_STEP,                                                            \
      "a joined rank replays the others' steps without training, and the per-bucket step "         \
      "would update its parameters from zero gradients")                                           \
    X(NB__DDP_ZERO, NB__DDP_BUCKET_STEP,                                                            \
      "ZeRO steps each rank's shard after backward, the per-bucket step the whole "                \
      "parameters inside it")                                                                      \
    X(NB__DDP_ZERO, NB__DDP_WIRE,                                                                   \
      "ZeRO's reduce-scatter replaces the bucket collective that the bf16 hook compresses")                       \
    X(NB__DDP_WIRE, NB__DDP_POWERSGD, "both are communication hooks: a bucket is sent one way")      \
    X(NB__DDP_ZERO, NB__DDP_POWERSGD,                                                               \
      "ZeRO's reduce-scatter replaces the bucket collective that PowerSGD compresses")              \
    X(NB__DDP_JOIN, NB__DDP_POWERSGD,                                                               \
      "a joined rank shadows one all-reduce per bucket, PowerSGD issues two")

/* A feature's hook points; NULL where it has nothing to do. `self` is the
 * state it attached. At most one attached table has `launch` (the
 * communication hook); without one the reducer all-reduces each bucket's
 * flat with the reduction set by nb__ddp_set_reduction.
 *
 * Note [Two-stage communication hooks]
 * A communication hook has two stages, as c10d's hooks return a future
 * that later callbacks complete. `launch` runs inside backward, when the
 * bucket is complete: it starts the bucket's communication and returns
 * without waiting for it, so backward goes on while it travels. `finish`
 * runs after backward, bucket by bucket in index order: it completes the
 * bucket (waits for what launch started, issues and waits for any further
 * collective, puts the result into the flat) and returns a status. A hook
 * whose communication is one collective returns it from launch and the
 * reducer waits for it before finish (the default, bf16, ZeRO); a hook of
 * several dependent collectives (PowerSGD: P, then Q from P's result)
 * returns NULL and holds its own works. Every rank must issue the same
 * collectives in the same order, so a hook may start a later stage of an
 * earlier bucket inside a launch (PowerSGD starts bucket b-1's Q in bucket
 * b's launch) only at a point fixed by the bucket order, never because a
 * collective happens to have finished. */
typedef struct nb__ddp_hooks {
    const char *name; /* in messages */
    /* --- the communication hook --- */
    const char *collective; /* its name in the trace ("reduce-scatter") */
    /* Elements of a bucket's flat for numel gradient elements (padding). */
    int64_t (*flat_numel)(const nb_ddp *d, void *self, int64_t numel);
    /* Starts bucket b's communication and returns at once: the collective
     * the reducer waits for before finish, or NULL when the hook holds its
     * own; *bytes: what the bucket sends per rank. */
    nb_work *(*launch)(nb_ddp *d, void *self, int b, nb_reduce_op op, size_t *bytes);
    /* Completes bucket b once launch's collective (if any) is done: with
     * `keep` (it succeeded and the result is wanted) the result goes into
     * the flat; without, the hook only gives back what it holds (a failed
     * step, join's shadow). NB_OK or the hook's own first failure.
     * *started, *finished: the bucket's communication times, set by the
     * reducer from launch's collective (0 without one); a hook with
     * collectives of its own sets them. NULL: nothing to complete. */
    nb_status (*finish)(nb_ddp *d, void *self, int b, bool keep, double *started, double *finished);
    /* --- every feature --- */
    /* New buckets (construction, reassignment, the rebuild): per-bucket
     * arrays remade; memory that lives as long as the buckets goes in d->ctx. */
    void (*buckets_made)(nb_ddp *d, void *self);
    /* Before the buffer broadcast of a step's pre-forward (world > 1);
     * `what` names it in nb_ddp_forward's message. */
    nb_status (*before_forward)(nb_ddp *d, void *self);
    const char *before_forward_what;
    /* At the start of every nb_ddp_backward. */
    void (*backward_begin)(nb_ddp *d, void *self);
    /* Parameter i's gradient became final (bucketed backward). */
    void (*on_ready)(nb_ddp *d, void *self, int i);
    /* A synchronised backward is about to hand out its averaged gradients;
     * usable: backward succeeded and every parameter has a gradient (or
     * find_unused_parameters is on). */
    void (*sync_begin)(nb_ddp *d, void *self, bool usable);
    /* The gradients of params[0..n) are averaged and final (a bucket, or
     * every parameter without buckets); only while no collective failed. */
    void (*grads_final)(nb_ddp *d, void *self, const int *params, int n);
    /* A synchronised backward succeeded, at `done` (times in d->times). */
    void (*sync_end)(nb_ddp *d, void *self, double done);
    /* The one-time bucket rebuild is due: true takes it over (the feature
     * calls nb__ddp_rebuild_buckets itself later). */
    bool (*take_rebuild)(nb_ddp *d, void *self);
    /* nb_ddp_free: the feature gives up what it holds. */
    void (*free)(nb_ddp *d, void *self);
} nb__ddp_hooks;

struct nb_ddp {
    nb__handle handle; /* first: Note [Freed handles] in util/handle.h */
    nb_module *model;
    nb_pg *pg;
    nb_ddp_options o;
    int rank, world;
    unsigned id;          /* the wrapper's number in the run (same on every rank) */
    bool bucketed;        /* world > 1, or forced (Note [DDP on CUDA]) */
    /* per parameter (those that require grad), malloc'd */
    int n;
    nb_named_tensor *p;
    nb_tensor **own_grad; /* each parameter's grad before the wrapper took it */
    hook_ref *refs;       /* registered with the tensors' hooks */
    int *bucket_of;
    bool *ready;
    bool *none_unused;    /* marked ready with a NULL gradient (Note [Unused parameters]) */
    int n_ready;
    int *ready_order;     /* the first synchronised backward's order */
    int *all;             /* 0..n-1, for grads_final without buckets (malloc'd) */
    int *slot;            /* open-addressing map: tensor pointer -> parameter index */
    int slot_mask;
    /* buckets: memory and records in ctx, replaced at every assignment */
    nb_ctx *ctx;
    int n_buckets;
    bucket *buckets;
    int next_launch;
    bool in_backward, no_sync, rebuilt, synced_once;
    /* the reduction (nb__ddp_set_reduction) */
    nb_reduce_op op;
    double divisor;       /* > 0: each bucket divided by it after its collective */
    int root;             /* the rank whose buffers and bucket order the others take */
    /* the map of used parameters (find_unused_parameters; Note [Unused parameters]) */
    nb_ctx *used_ctx;     /* its tensor's, on the group's device; reset at each launch */
    nb_tensor *used_map;  /* i32 (n): 1 where a rank holds a gradient, summed over the ranks */
    int32_t *used_host;   /* the map on the host (malloc'd, n) */
    nb_work *used_work;   /* its all-reduce in flight, or NULL */
    nb_status used_st;    /* the last launch's wait */
    /* the step being measured */
    double fwd_start, bw_start, bw_end;
    nb_ddp_bucket_time *times; /* n_buckets (malloc'd) */
    /* attached features */
    struct {
        const nb__ddp_hooks *h;
        void *self;
    } feat[NB__DDP_FEATURES];
    const nb__ddp_hooks *comm; /* the communication hook's table (the default all-reduce) */
    void *comm_self;
};

double nb__ddp_now(void);
void *nb__ddp_calloc(size_t n, size_t size); /* aborts when out of memory */

/* The wrapper's reducer: parameters checked and broadcast (world > 1),
 * buckets made when bucketed; no feature attached. */
nb_status nb__ddp_reducer_new(nb_ddp **out, nb_module *model, nb_pg *pg, const nb_ddp_options *opts);
/* Every attached feature's free hook, then the reducer. */
void nb__ddp_reducer_free(nb_ddp *d);

/* Attaches feature f's table with its state (aborts when f is attached
 * already, or when a second table brings a communication hook). */
void nb__ddp_attach(nb_ddp *d, nb__ddp_feature f, const nb__ddp_hooks *h, void *self);
/* Detaches f (its state is the feature's to free). */
void nb__ddp_detach(nb_ddp *d, nb__ddp_feature f);
/* NB_OK when f may attach beside the features attached now; else
 * NB_ERR_INVALID naming who (the caller), the rank, both features and
 * why (Note [Feature conflicts]). */
nb_status nb__ddp_check_conflicts(const nb_ddp *d, nb__ddp_feature f, const char *who);
/* f's state, or NULL when f is not attached. */
void *nb__ddp_state(const nb_ddp *d, nb__ddp_feature f);
static inline bool nb__ddp_attached(const nb_ddp *d, nb__ddp_feature f) { return d->feat[f].h != NULL; }
/* The bucket collective's name ("all-reduce" without a communication hook). */
const char *nb__ddp_collective(const nb_ddp *d);

/* The bucket collectives' reduce op, the divisor applied after them (0:
 * none) and the root of the buffer broadcasts and of the rebuilt order
 * (by default NB_REDUCE_AVG, 0, 0). */
void nb__ddp_set_reduction(nb_ddp *d, nb_reduce_op op, double divisor, int root);

/* Starts a synchronised backward: nothing ready, no bucket launched. */
void nb__ddp_reset_ready(nb_ddp *d);
/* Parameter i's gradient is final: launches the buckets that are complete. */
void nb__ddp_mark_ready(nb_ddp *d, int i);
/* Starts the all-reduce (sum) of the map of used parameters (Note [Unused
 * parameters] in ddp.c) once every bucket is launched: 1 where this rank
 * holds a gradient; all zeros unless `trained` (a joined rank's shadow). */
void nb__ddp_used_launch(nb_ddp *d, bool trained);
/* Waits for it (NB_OK at once when it was waited for already, or when
 * nothing was launched) and brings the sums to d->used_host. */
nb_status nb__ddp_used_wait(nb_ddp *d);
/* Waits for every bucket launched and forgets their works; the first
 * failure. */
nb_status nb__ddp_finish_buckets(nb_ddp *d);
/* A synchronised backward has ended: after the first, the one-time bucket
 * rebuild (Note [Buckets]) unless !rebuild or a feature takes it over. */
nb_status nb__ddp_synced(nb_ddp *d, bool rebuild);
/* The one-time bucket rebuild from the root's ready order (Note [Buckets]). */
nb_status nb__ddp_rebuild_buckets(nb_ddp *d);
/* New bucket memory for the current bucket order; gradients keep their
 * values (after a communication hook that pads was attached). */
void nb__ddp_reassign_buckets(nb_ddp *d);
/* Bucket b's gradient memory given back at once; its parameters' ->grad
 * become NULL (ZeRO-2, Note [ZeRO-2] in ddp_zero.c). No-op when given back. */
void nb__ddp_drop_bucket_grads(nb_ddp *d, int b);
/* Bucket b's gradient memory made again, zeros, when given back. */
void nb__ddp_make_bucket_grads(nb_ddp *d, int b);
/* t = the step that just ended at `done` (its bucket times copied, malloc'd). */
void nb__ddp_step_timeline(const nb_ddp *d, double done, trace_step *t);

/* ddp_verify.c */
/* Every rank's parameter list against rank 0's; a mismatch names the
 * first differing parameter and the ranks (every rank gets the verdict). */
nb_status nb__ddp_verify_params(nb_ddp *d);
/* Broadcasts rank root's buffers (buffers_only) or whole state to every rank. */
nb_status nb__ddp_broadcast_tensors(nb_ddp *d, bool buffers_only, int root);

#endif
