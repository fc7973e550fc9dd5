/* Samplers: the handle and the built-in orders (sequential, random,
 * distributed, exact-evaluation shard). Semantics in
 * include/nabla/sampler.h; permutations per Note [Permutations]; a
 * distributed epoch resumed at another world size per Note [Resuming at
 * another world size]. */
#include <stdlib.h>

#include "data/internal.h"
#include "util/handle.h"

struct nb_sampler {
    const nb_sampler_vtable *vt;
    void *self;
    int64_t epoch;
    uint64_t version; /* bumped when the order of an epoch changes (a resume) */
};

uint64_t nb__sampler_version(const nb_sampler *s) { return s->version; }

nb_sampler *nb_sampler_new(const nb_sampler_vtable *vt, void *self) {
    NB_CHECK(vt && vt->len && vt->indices, "nb_sampler_new: the vtable needs len and indices");
    nb_sampler *s = calloc(1, sizeof *s);
    NB_CHECK(s, "nb_sampler_new: out of memory");
    s->vt = vt;
    s->self = self;
    return s;
}

void nb_sampler_free(nb_sampler *s) {
    if (!s) return;
    if (s->vt->free) s->vt->free(s->self);
    free(s);
}

static const nb_sampler_vtable distributed_vt;
static void dist_set_epoch(void *self, int64_t epoch);

NB__HANDLE_GETTER(int64_t, nb_sampler_len, const nb_sampler, s, "sampler", s->vt->len(s->self))
void nb_sampler_set_epoch(nb_sampler *s, int64_t epoch) {
    NB__CHECK_HANDLE("nb_sampler_set_epoch", s, "sampler");
    s->epoch = epoch;
    if (s->vt == &distributed_vt) dist_set_epoch(s->self, epoch);
}
NB__HANDLE_GETTER(int64_t, nb_sampler_epoch, const nb_sampler, s, "sampler", s->epoch)
void nb_sampler_indices(const nb_sampler *s, int64_t *out) {
    NB__CHECK_HANDLE("nb_sampler_indices", s, "sampler");
    s->vt->indices(s->self, s->epoch, out);
}

/* ---- the built-in samplers share one object ---- */
typedef struct order {
    int64_t n;
    bool shuffle, drop_last;
    uint64_t seed;
    int world, rank;
    int64_t epoch;                 /* the handle's, for the distributed length */
    int64_t resume_epoch, resumed; /* positions of resume_epoch already taken (distributed) */
} order;

static void order_free(void *self) { free(self); }

static order *order_new(const char *op, int64_t n) {
    NB_CHECK(n >= 0, "%s: n = %lld samples", op, (long long)n);
    order *o = calloc(1, sizeof *o);
    NB_CHECK(o, "%s: out of memory", op);
    o->n = n;
    o->world = 1;
    return o;
}

static int64_t *alloc_indices(int64_t n) {
    int64_t *p = malloc(sizeof *p * (size_t)(n ? n : 1));
    NB_CHECK(p, "nb_sampler_indices: out of memory for %lld indices", (long long)n);
    return p;
}

/* The epoch's full list (a permutation when shuffling) into out[0..n). */
static void base_order(const order *o, int64_t epoch, int64_t *out) {
    if (o->shuffle) nb__randperm(out, o->n, o->seed + (uint64_t)epoch);
    else
        for (int64_t i = 0; i < o->n; i++) out[i] = i;
}

static int64_t whole_len(void *self) { return ((order *)self)->n; }
static void whole_indices(void *self, int64_t epoch, int64_t *out) { base_order(self, epoch, out); }

static const nb_sampler_vtable sequential_vt = {"sequential", whole_len, whole_indices, order_free};
static const nb_sampler_vtable random_vt = {"random", whole_len, whole_indices, order_free};

nb_sampler *nb_sampler_sequential(int64_t n) {
    return nb_sampler_new(&sequential_vt, order_new("nb_sampler_sequential", n));
}

nb_sampler *nb_sampler_random(int64_t n, uint64_t seed) {
    order *o = order_new("nb_sampler_random", n);
    o->shuffle = true;
    o->seed = seed;
    return nb_sampler_new(&random_vt, o);
}

/* ---- distributed ---- */

/* Note [Resuming at another world size]
 * PyTorch's layout gives rank r the positions r, r + R, r + 2R, ... of the
 * epoch's list (the permutation, padded by wrapping around or cut with
 * drop_last). After every rank has taken k indices, the positions taken
 * are exactly 0 .. kR - 1: a prefix of the list, whatever R. So the
 * position in an epoch is one number, the global count c = kR of
 * positions taken, and an epoch resumed after c positions at world size
 * R' deals the rest of the list the same way: rank r' takes c + r',
 * c + r' + R', ... With m = n - c samples left (0 when c >= n, the
 * padding being reached), each rank takes floor(m / R') with drop_last
 * (the last m mod R' are dropped, as PyTorch drops a tail) and
 * ceil(m / R') without (padding wraps around to the list's start, as
 * PyTorch pads), position p meaning sample list[p mod n]. For R' = R and
 * c = kR this is the original layout's remainder, index for index; for
 * any R' no sample of the epoch is taken twice and none before the
 * dropped tail is skipped. Only the resumed epoch is affected; the next
 * starts at 0 with the new R. */
static void dist_set_epoch(void *self, int64_t epoch) { ((order *)self)->epoch = epoch; }

static int64_t dist_taken(const order *o) { return o->epoch == o->resume_epoch ? o->resumed : 0; }

static int64_t dist_len(void *self) {
    order *o = self;
    int64_t c = dist_taken(o), m = o->n > c ? o->n - c : 0;
    if (c == 0) return o->drop_last ? o->n / o->world : (o->n + o->world - 1) / o->world;
    return o->drop_last ? m / o->world : (m + o->world - 1) / o->world;
}

static void dist_indices(void *self, int64_t epoch, int64_t *out) {
    order *o = self;
    int64_t saved = o->epoch;
    o->epoch = epoch;
    int64_t per_rank = dist_len(o), c = dist_taken(o);
    o->epoch = saved;
    if (per_rank == 0) return;
    int64_t *all = alloc_indices(o->n);
    base_order(o, epoch, all);
    /* padded (or cut) list: element i is all[i mod n] */
    for (int64_t k = 0; k < per_rank; k++) out[k] = all[(c + o->rank + k * o->world) % o->n];
    free(all);
}

static const nb_sampler_vtable distributed_vt = {"distributed", dist_len, dist_indices, order_free};

static void check_rank(const char *op, int world, int rank) {
    NB_CHECK(world >= 1, "%s: world_size %d must be >= 1", op, world);
    NB_CHECK(rank >= 0 && rank < world, "%s: rank %d is not in [0, %d)", op, rank, world);
}

nb_sampler *nb_sampler_distributed(int64_t n, const nb_distributed_options *opts) {
    NB_CHECK(opts, "nb_sampler_distributed: options are required (world_size, rank)");
    check_rank("nb_sampler_distributed", opts->world_size, opts->rank);
    order *o = order_new("nb_sampler_distributed", n);
    o->world = opts->world_size;
    o->rank = opts->rank;
    o->shuffle = opts->shuffle;
    o->seed = opts->seed;
    o->drop_last = opts->drop_last;
    o->resume_epoch = -1;
    return nb_sampler_new(&distributed_vt, o);
}

static order *distributed_order(const nb_sampler *s, const char *op) {
    NB__CHECK_HANDLE(op, s, "sampler");
    NB_CHECK(s->vt == &distributed_vt, "%s: the sampler is %s, not a distributed sampler", op,
             s->vt->name);
    return s->self;
}

void nb_sampler_distributed_resume(nb_sampler *s, int64_t epoch, int64_t taken) {
    order *o = distributed_order(s, "nb_sampler_distributed_resume");
    NB_CHECK(epoch >= 0 && taken >= 0, "nb_sampler_distributed_resume: epoch %lld and taken %lld must be >= 0",
             (long long)epoch, (long long)taken);
    o->resume_epoch = taken > 0 ? epoch : -1;
    o->resumed = taken;
    s->version++;
}

int64_t nb__sampler_skipped(const nb_sampler *s) {
    if (s->vt != &distributed_vt) return 0;
    const order *o = s->self;
    return dist_taken(o) / o->world;
}

int64_t nb_sampler_distributed_taken(const nb_sampler *s, int64_t per_rank) {
    order *o = distributed_order(s, "nb_sampler_distributed_taken");
    NB_CHECK(per_rank >= 0, "nb_sampler_distributed_taken: per_rank %lld must be >= 0", (long long)per_rank);
    return dist_taken(o) + per_rank * o->world;
}

/* ---- exact evaluation shard ---- */
static int64_t shard_len(void *self) {
    order *o = self;
    return o->n > o->rank ? (o->n - o->rank + o->world - 1) / o->world : 0;
}

static void shard_indices(void *self, int64_t epoch, int64_t *out) {
    order *o = self;
    (void)epoch;
    int64_t len = shard_len(o);
    for (int64_t k = 0; k < len; k++) out[k] = o->rank + k * o->world;
}

static const nb_sampler_vtable shard_vt = {"shard", shard_len, shard_indices, order_free};

nb_sampler *nb_sampler_shard(int64_t n, int world_size, int rank) {
    check_rank("nb_sampler_shard", world_size, rank);
    order *o = order_new("nb_sampler_shard", n);
    o->world = world_size;
    o->rank = rank;
    return nb_sampler_new(&shard_vt, o);
}
