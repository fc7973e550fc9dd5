/* Samplers: the handle and the built-in orders (sequential, random,
 * distributed, exact-evaluation shard). Semantics in
 * include/nabla/sampler.h; permutations per Note [Permutations]. */
#include <stdlib.h>

#include "data/internal.h"
#include "util/handle.h"

struct nb_sampler {
    const nb_sampler_vtable *vt;
    void *self;
    int64_t epoch;
};

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

int64_t nb_sampler_len(const nb_sampler *s) {
    NB__CHECK_HANDLE("nb_sampler_len", s, "sampler");
    return s->vt->len(s->self);
}
void nb_sampler_set_epoch(nb_sampler *s, int64_t epoch) {
    NB__CHECK_HANDLE("nb_sampler_set_epoch", s, "sampler");
    s->epoch = epoch;
}
int64_t nb_sampler_epoch(const nb_sampler *s) {
    NB__CHECK_HANDLE("nb_sampler_epoch", s, "sampler");
    return s->epoch;
}
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
static int64_t dist_len(void *self) {
    order *o = self;
    return o->drop_last ? o->n / o->world : (o->n + o->world - 1) / o->world;
}

static void dist_indices(void *self, int64_t epoch, int64_t *out) {
    order *o = self;
    int64_t per_rank = dist_len(o);
    if (per_rank == 0) return;
    int64_t *all = alloc_indices(o->n);
    base_order(o, epoch, all);
    /* padded (or cut) list: element i is all[i mod n] */
    for (int64_t k = 0; k < per_rank; k++) out[k] = all[(o->rank + k * o->world) % o->n];
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
    return nb_sampler_new(&distributed_vt, o);
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
