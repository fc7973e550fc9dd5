/* What the DDP suites share (tests/test_ddp*.c):
 * the world they run in, a seeded global batch, a rank's shard of it, an
 * AdamW for a module, and the comparisons of models across ranks and with
 * a single-process reference. Included by one file per test program. */
#ifndef NABLA_TESTS_DDP_COMMON_H
#define NABLA_TESTS_DDP_COMMON_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/ddp.h"
#include "testutil.h"

#define F_IN 6
#define N_CLASSES 3

static nb_pg *world;
static int R, me;

/* Global batch: x (n, F_IN) normal, y (n) in [0, N_CLASSES). */
static inline void make_batch(nb_ctx *ctx, int64_t n, uint64_t seed, nb_tensor **x, nb_tensor **y) {
    nb_rng rng = nb_rng_make(seed);
    *x = nb_rand_normal(ctx, NB_F64, NB_SHAPE(n, F_IN), 0, 1, &rng);
    int64_t *lab = malloc(sizeof *lab * (size_t)n);
    for (int64_t i = 0; i < n; i++) lab[i] = (i * 7 + (int64_t)seed) % N_CLASSES;
    *y = nb_from_host(ctx, NB_I64, NB_SHAPE(n), lab);
    free(lab);
}

static inline nb_tensor *shard(nb_ctx *ctx, nb_tensor *t, int64_t start, int64_t len) {
    return nb_contiguous(ctx, nb_narrow(ctx, t, 0, start, len));
}

static inline nb_optim *adamw_for(nb_module *m) {
    int n = nb_module_named_parameters(m, NULL, 0);
    nb_named_tensor *p = malloc(sizeof *p * (size_t)n);
    nb_module_named_parameters(m, p, n);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 0.01;
    nb_optim *o = nb_optim_new(NB_OPTIM_ADAMW, p, n, &h);
    free(p);
    return o;
}

/* Every tensor of m's state equals rank 0's, bit for bit. */
static inline void assert_same_on_all_ranks(nb_module *m) {
    int n = nb_module_state(m, NULL, 0);
    nb_named_tensor *s = malloc(sizeof *s * (size_t)n);
    nb_module_state(m, s, n);
    nb_ctx *tmp = nb_ctx_new(nb_cpu(), 0);
    for (int i = 0; i < n; i++) {
        nb_tensor *c = nb_clone(tmp, s[i].tensor);
        ck_assert_int_eq(nb_work_finish(nb_pg_broadcast(world, c, 0)), NB_OK);
        size_t bytes = (size_t)nb_numel(c) * nb_dtype_size(c->dtype);
        ck_assert_msg(memcmp(c->data, s[i].tensor->data, bytes) == 0, "rank %d: %s differs from rank 0",
                      me, s[i].name);
    }
    nb_ctx_free(tmp);
    free(s);
}

/* Parameters and buffers of a within rtol (relative to b's largest) of b. */
static inline void assert_models_close(nb_module *a, nb_module *b, double rtol) {
    int n = nb_module_state(a, NULL, 0);
    ck_assert_int_eq(n, nb_module_state(b, NULL, 0));
    nb_named_tensor *sa = malloc(sizeof *sa * (size_t)n), *sb = malloc(sizeof *sb * (size_t)n);
    nb_module_state(a, sa, n);
    nb_module_state(b, sb, n);
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(sa[i].name, sb[i].name);
        int64_t k = nb_numel(sa[i].tensor);
        double *va = malloc(sizeof(double) * (size_t)k), *vb = malloc(sizeof(double) * (size_t)k);
        nb_to_host_f64(sa[i].tensor, va);
        nb_to_host_f64(sb[i].tensor, vb);
        double scale = 0;
        for (int64_t j = 0; j < k; j++) scale = fmax(scale, fabs(vb[j]));
        for (int64_t j = 0; j < k; j++)
            ck_assert_msg(fabs(va[j] - vb[j]) <= rtol * fmax(scale, 1e-12), "rank %d: %s[%lld]: %.12g vs %.12g",
                          me, sa[i].name, (long long)j, va[j], vb[j]);
        free(va);
        free(vb);
    }
    free(sa);
    free(sb);
}

/* The suite of the including file, made once the world is known. */
static Suite *suite(void);

/* nbt_run_world's setup for a DDP suite: main is
 * `return nbt_run_world(ddp_setup);`. */
static inline Suite *ddp_setup(nb_pg *pg) {
    world = pg;
    R = nb_pg_size(world);
    me = nb_pg_rank(world);
    return suite();
}

#endif
