/* The fixture the DDP suites share (tests/test_ddp*.c): the world they run
 * in, a seeded global batch and a rank's shard of it, the models they train
 * (each from a fixed seed, so every rank and the single-process reference
 * build the same parameters), DDP with small buckets, an AdamW for a module,
 * and the comparisons of models and optimizer states across ranks, with a
 * reference, or with their initial values. Included by one file per test
 * program; the tests keep their own steps, references and tolerances. */
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

/* Rank me's cross-entropy on micro-batch (it, micro) of a global batch of
 * R x 3 rows (seed 100 + 10 it + micro); the whole global batch when `whole`. */
static inline nb_tensor *loss_of(nb_ctx *step, nb_module *m, int it, int micro, bool whole) {
    const int64_t B = 3;
    nb_tensor *x, *y;
    make_batch(step, R * B, 100 + (uint64_t)(it * 10 + micro), &x, &y);
    if (!whole) {
        x = shard(step, x, me * B, B);
        y = shard(step, y, me * B, B);
    }
    return nb_cross_entropy(step, nb_module_forward(m, step, x), y, NULL);
}

/* ---- models ---- */

/* Linear(F_IN, N_CLASSES) children "a", "b", "c" of a list (seeds 3, 4, 5). */
static inline nb_module *three_heads(nb_ctx *ctx) {
    nb_module *root = nb_module_list_new(ctx);
    const char *names[3] = {"a", "b", "c"};
    for (int k = 0; k < 3; k++) {
        nb_rng rng = nb_rng_make(3 + (uint64_t)k);
        nb_module_add(root, names[k], nb_linear_new(ctx, NB_F64, F_IN, N_CLASSES, true, &rng));
    }
    return root;
}

/* Linear(F_IN, hidden), Tanh, Linear(hidden, N_CLASSES); seed 7. */
static inline nb_module *mlp_of(nb_ctx *ctx, nb_dtype dt, int64_t hidden) {
    nb_rng rng = nb_rng_make(7);
    nb_module *c[3] = {nb_linear_new(ctx, dt, F_IN, hidden, true, &rng), nb_tanh_new(ctx),
                       nb_linear_new(ctx, dt, hidden, N_CLASSES, true, &rng)};
    return nb_sequential_new(ctx, 3, c);
}

/* f64 Linear(F_IN, 16), Tanh, Linear(16, 12), Tanh, Linear(12, N_CLASSES);
 * seed 7: six parameters, enough for several buckets that cut across them. */
static inline nb_module *deep_mlp(nb_ctx *ctx) {
    nb_rng rng = nb_rng_make(7);
    nb_module *c[5] = {nb_linear_new(ctx, NB_F64, F_IN, 16, true, &rng), nb_tanh_new(ctx),
                       nb_linear_new(ctx, NB_F64, 16, 12, true, &rng), nb_tanh_new(ctx),
                       nb_linear_new(ctx, NB_F64, 12, N_CLASSES, true, &rng)};
    return nb_sequential_new(ctx, 5, c);
}

/* f64 Conv2d(1, 4, 3x3, padding 1, no bias), BatchNorm2d(4), ReLU, global
 * average pooling, Flatten, Linear(4, N_CLASSES); seed 11. Input (N, 1, H, W). */
static inline nb_module *cnn(nb_ctx *ctx) {
    nb_rng rng = nb_rng_make(11);
    nb_conv2d_opts co = NB_CONV2D_DEFAULTS;
    co.padding[0] = co.padding[1] = 1;
    nb_module *c[6] = {nb_conv2d_new(ctx, NB_F64, 1, 4, 3, 3, &co, false, &rng),
                       nb_batch_norm2d_new(ctx, NB_F64, 4, NULL),
                       nb_relu_new(ctx),
                       nb_global_avg_pool2d_new(ctx),
                       nb_flatten_new(ctx, 1, -1),
                       nb_linear_new(ctx, NB_F64, 4, N_CLASSES, true, &rng)};
    return nb_sequential_new(ctx, 6, c);
}

/* ---- DDP ---- */

/* Options with small buckets (first `first` bytes, then `cap`), so that
 * even these small models get several. */
static inline nb_ddp_options small_buckets(size_t first, size_t cap) {
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.first_bucket_bytes = first;
    o.bucket_cap_bytes = cap;
    return o;
}

/* m wrapped in DDP over world; with more than one rank, more than
 * `more_than` buckets (-1: not checked). */
static inline nb_ddp *ddp_wrap(nb_module *m, const nb_ddp_options *o, int more_than) {
    nb_ddp *ddp = NULL;
    nb_status st = nb_ddp_new(&ddp, m, world, o);
    ck_assert_msg(st == NB_OK, "nb_ddp_new: %s", nb_last_error());
    if (R > 1 && more_than >= 0) ck_assert_int_gt(nb_ddp_num_buckets(ddp), more_than);
    return ddp;
}

/* nb_ddp_forward that must succeed. */
static inline nb_tensor *ddp_fwd(nb_ddp *ddp, nb_ctx *ctx, nb_tensor *x) {
    nb_tensor *out = NULL;
    nb_status st = nb_ddp_forward(ddp, ctx, x, &out);
    ck_assert_msg(st == NB_OK && out != NULL, "nb_ddp_forward: %s", nb_last_error());
    return out;
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

/* A Check test whose body gets a parameter context `pctx` and a step
 * context `step`, freed after it:
 *     DDP_TEST(test_x) { ... }
 * stands for START_TEST(test_x) { nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0),
 * *step = nb_ctx_new(nb_cpu(), 0); ... nb_ctx_free(step);
 * nb_ctx_free(pctx); } END_TEST. */
#define DDP_TEST(name)                                                                    \
    static void name##_body(nb_ctx *pctx, nb_ctx *step);                                  \
    START_TEST(name) {                                                                    \
        nb_ctx *pctx_ = nb_ctx_new(nb_cpu(), 0), *step_ = nb_ctx_new(nb_cpu(), 0);        \
        name##_body(pctx_, step_);                                                        \
        nb_ctx_free(step_);                                                               \
        nb_ctx_free(pctx_);                                                               \
    }                                                                                     \
    END_TEST                                                                              \
    static void name##_body(nb_ctx *pctx, nb_ctx *step)

/* A DDP test's handles: two copies of one model (m, under test, and ref,
 * its reference, built alike in pctx), a step context, and the wrappers
 * and optimizers the test makes for them (NULL until it does).
 * ddp_pair_free frees all of them. */
typedef struct ddp_pair {
    nb_ctx *pctx, *step;
    nb_module *m, *ref;
    nb_ddp *ddp, *rddp;
    nb_optim *opt, *ropt;
} ddp_pair;

/* The contexts and the two copies of what `make` builds. */
static inline ddp_pair ddp_pair_new(nb_module *(*make)(nb_ctx *)) {
    ddp_pair p = {.pctx = nb_ctx_new(nb_cpu(), 0), .step = nb_ctx_new(nb_cpu(), 0)};
    p.m = make(p.pctx);
    p.ref = make(p.pctx);
    return p;
}

/* ddp_pair_new(deep_mlp), m wrapped by `wrap` (and ref too when
 * `wrap_ref`), each copy given its optimizer by optim(copy, arg). */
static inline ddp_pair ddp_pair_wrapped(nb_ddp *(*wrap)(nb_module *), nb_optim *(*optim)(nb_module *, int),
                                        int arg, bool wrap_ref) {
    ddp_pair p = ddp_pair_new(deep_mlp);
    p.ddp = wrap(p.m);
    if (wrap_ref) p.rddp = wrap(p.ref);
    p.opt = optim(p.m, arg);
    p.ropt = optim(p.ref, arg);
    return p;
}

static inline void ddp_pair_free(ddp_pair *p) {
    nb_ddp_free(p->ddp);
    nb_ddp_free(p->rddp);
    nb_optim_free(p->opt);
    nb_optim_free(p->ropt);
    nb_ctx_free(p->step);
    nb_ctx_free(p->pctx);
}

/* ---- comparisons ---- */

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

/* a[i] against b[i], name by name: within rtol of b[i]'s largest element
 * (at least min_scale), or the same bits when rtol is 0. */
static inline void assert_named_close(const nb_named_tensor *a, const nb_named_tensor *b, int n, double rtol,
                                      double min_scale, const char *what) {
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(a[i].name, b[i].name);
        ck_assert(nb_same_shape(a[i].tensor, b[i].tensor));
        int64_t k = nb_numel(a[i].tensor);
        double *va = malloc(sizeof(double) * (size_t)(k + 1)), *vb = malloc(sizeof(double) * (size_t)(k + 1));
        nb_to_host_f64(a[i].tensor, va);
        nb_to_host_f64(b[i].tensor, vb);
        double scale = 0;
        for (int64_t j = 0; j < k; j++) scale = fmax(scale, fabs(vb[j]));
        for (int64_t j = 0; j < k; j++) {
            if (rtol == 0)
                ck_assert_msg(memcmp(&va[j], &vb[j], sizeof(double)) == 0,
                              "rank %d: %s %s[%lld]: %.17g vs %.17g (not the same bits)", me, what,
                              a[i].name, (long long)j, va[j], vb[j]);
            else
                ck_assert_msg(fabs(va[j] - vb[j]) <= rtol * fmax(scale, min_scale),
                              "rank %d: %s %s[%lld]: %.17g vs %.17g", me, what, a[i].name, (long long)j,
                              va[j], vb[j]);
        }
        free(va);
        free(vb);
    }
}

/* Parameters and buffers of a against b's (assert_named_close). */
static inline void assert_models_match(nb_module *a, nb_module *b, double rtol, double min_scale) {
    int n = nb_module_state(a, NULL, 0);
    ck_assert_int_eq(n, nb_module_state(b, NULL, 0));
    nb_named_tensor *sa = malloc(sizeof *sa * (size_t)n), *sb = malloc(sizeof *sb * (size_t)n);
    nb_module_state(a, sa, n);
    nb_module_state(b, sb, n);
    assert_named_close(sa, sb, n, rtol, min_scale, "parameter");
    free(sa);
    free(sb);
}

/* Parameters and buffers of a within rtol (relative to b's largest) of b. */
static inline void assert_models_close(nb_module *a, nb_module *b, double rtol) {
    assert_models_match(a, b, rtol, 1e-12);
}

/* The state of optimizer a against b's (assert_named_close). */
static inline void assert_optim_states_match(nb_optim *a, nb_optim *b, double rtol, double min_scale) {
    int na, nb;
    const nb_named_tensor *ta = nb_optim_state(a, &na), *tb = nb_optim_state(b, &nb);
    ck_assert_int_eq(na, nb);
    assert_named_close(ta, tb, na, rtol, min_scale, "optimizer state");
}

/* Every parameter of m differs from init's (the same model before
 * training): the steps were not no-ops. */
static inline void assert_params_moved(nb_module *m, nb_module *init) {
    int n = nb_module_named_parameters(m, NULL, 0);
    ck_assert_int_eq(n, nb_module_named_parameters(init, NULL, 0));
    nb_named_tensor *a = malloc(sizeof *a * (size_t)n), *b = malloc(sizeof *b * (size_t)n);
    nb_module_named_parameters(m, a, n);
    nb_module_named_parameters(init, b, n);
    for (int i = 0; i < n; i++) {
        size_t bytes = (size_t)nb_numel(a[i].tensor) * nb_dtype_size(a[i].tensor->dtype);
        ck_assert_msg(memcmp(a[i].tensor->data, b[i].tensor->data, bytes) != 0, "%s never changed",
                      a[i].name);
    }
    free(a);
    free(b);
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
