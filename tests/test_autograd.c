/* Autograd: the tape walk, accumulation, grad mode, detach, the timing of
 * gradient-ready hooks, cross-context graphs, and gradcheck itself. */
#include <math.h>

#include "tensor/internal.h"
#include "testutil.h"

NBT_CPU_TEST(test_simple_chain) {
    /* y = sum((a * b + a)^2): dy/da = 2 (ab + a)(b + 1), dy/db = 2 (ab + a) a */
    nb_tensor *a = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){1, 2, -1});
    nb_tensor *b = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){0.5, -1, 3});
    nb_set_requires_grad(a, true);
    nb_set_requires_grad(b, true);
    nb_tensor *y = nb_sum_all(ctx, nb_pow(ctx, nb_add(ctx, nb_mul(ctx, a, b), a), 2));
    ck_assert(y->requires_grad);
    ck_assert_ptr_nonnull(y->node);
    nb_backward(y);
    double ga[3], gb[3], av[3] = {1, 2, -1}, bv[3] = {0.5, -1, 3};
    for (int i = 0; i < 3; i++) {
        double u = av[i] * bv[i] + av[i];
        ga[i] = 2 * u * (bv[i] + 1);
        gb[i] = 2 * u * av[i];
    }
    nbt_assert_close(a->grad, ga, 1e-12, 1e-12);
    nbt_assert_close(b->grad, gb, 1e-12, 1e-12);
    /* a second backward accumulates into leaves */
    nb_tensor *y2 = nb_sum_all(ctx, nb_mul(ctx, a, b));
    nb_backward(y2);
    for (int i = 0; i < 3; i++) ga[i] += bv[i];
    nbt_assert_close(a->grad, ga, 1e-12, 1e-12);
    nb_zero_grad(a);
    double zero[3] = {0};
    nbt_assert_close(a->grad, zero, 0, 0);
}

NBT_CPU_TEST(test_reused_intermediate) {
    /* z = x * x used twice: y = sum(z + z * z) -> dy/dx = (1 + 2 z) 2x */
    nb_tensor *x = nb_from_host(ctx, NB_F64, NB_SHAPE(2), (double[]){1.5, -0.5});
    nb_set_requires_grad(x, true);
    nb_tensor *z = nb_mul(ctx, x, x);
    nb_backward(nb_sum_all(ctx, nb_add(ctx, z, nb_mul(ctx, z, z))));
    double e[2];
    double xv[2] = {1.5, -0.5};
    for (int i = 0; i < 2; i++) e[i] = (1 + 2 * xv[i] * xv[i]) * 2 * xv[i];
    nbt_assert_close(x->grad, e, 1e-12, 1e-12);
}

NBT_CPU_TEST(test_no_grad_and_detach) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(4), 1);
    ck_assert(nb_grad_enabled());
    bool prev = nb_no_grad_begin();
    nb_tensor *y = nb_mul(ctx, x, x);
    nb_no_grad_end(prev);
    ck_assert(!y->requires_grad);
    ck_assert_ptr_null(y->node);
    ck_assert(nb_grad_enabled());
    NBT_EXPECT_ABORT(nb_backward(nb_sum_all(ctx, y)), "does not require grad");
    nb_tensor *d = nb_detach(ctx, x);
    ck_assert(!d->requires_grad);
    ck_assert_ptr_eq(d->data, x->data);
    /* gradient flows only through the non-detached factor */
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, x, d)));
    nbt_assert_tensors_close(x->grad, x, 0, 0);
}

NBT_CPU_TEST(test_errors) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(2, 3), 1);
    NBT_EXPECT_ABORT(nb_backward(nb_mul(ctx, x, x)), "one element, got shape (2, 3)");
    nb_tensor *i = nb_zeros(ctx, NB_I64, NB_SHAPE(2));
    NBT_EXPECT_ABORT(nb_set_requires_grad(i, true), "only float tensors");
    nb_tensor *y = nb_mul(ctx, x, x);
    NBT_EXPECT_ABORT(nb_add_grad_hook(y, NULL, NULL), "NULL hook");
}

START_TEST(test_cross_context_graph_rejected) {
    nb_ctx *c1 = nb_ctx_new(nb_cpu(), 0), *c2 = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn_leaf(c1, NB_F32, NB_SHAPE(3), 1);
    nb_tensor *h = nb_exp(c1, x);
    nb_tensor *loss = nb_sum_all(c2, h);
    NBT_EXPECT_ABORT(nb_backward(loss), "another context");
    nb_ctx_free(c1);
    nb_ctx_free(c2);
}
END_TEST

/* ---- hooks ---- */
typedef struct hook_log {
    int calls[4];
    int order[8];
    int n;
    nb_tensor *w1;
    bool w1_grad_was_null;
} hook_log;

static hook_log *g_log;

static void hook0(nb_tensor *t, void *u) {
    hook_log *l = u;
    l->calls[0]++;
    l->order[l->n++] = 0;
}
static void hook1(nb_tensor *t, void *u) {
    hook_log *l = u;
    l->calls[1]++;
    l->order[l->n++] = 1;
    /* the later layer's weight is ready before the earlier layer's backward ran */
    l->w1_grad_was_null = l->w1->grad == NULL;
}
static void hook1b(nb_tensor *t, void *u) {
    hook_log *l = u;
    l->calls[2]++;
    l->order[l->n++] = 2;
}

START_TEST(test_hooks_fire_once_and_early) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *ctx = nb_ctx_new(nb_cpu(), 0);
    hook_log log = {0};
    g_log = &log;
    nb_tensor *w0 = nbt_randn_leaf(params, NB_F64, NB_SHAPE(4), 1); /* first layer */
    nb_tensor *w1 = nbt_randn_leaf(params, NB_F64, NB_SHAPE(4), 2); /* second layer */
    log.w1 = w0;
    nb_add_grad_hook(w0, hook0, &log);
    nb_add_grad_hook(w1, hook1, &log);
    nb_add_grad_hook(w1, hook1b, &log);
    nb_tensor *x = nbt_randn(ctx, NB_F64, NB_SHAPE(4), 3);
    /* w0 is used twice (two tape uses), w1 once, after w0 */
    nb_tensor *h = nb_tanh(ctx, nb_add(ctx, nb_mul(ctx, x, w0), w0));
    nb_tensor *loss = nb_sum_all(ctx, nb_mul(ctx, h, w1));
    /* a use outside the loss's graph must not hold back the hook */
    nb_tensor *metric = nb_sum_all(ctx, nb_mul(ctx, w0, w0));
    (void)metric;
    nb_backward(loss);
    ck_assert_int_eq(log.calls[0], 1);
    ck_assert_int_eq(log.calls[1], 1);
    ck_assert_int_eq(log.calls[2], 1);
    ck_assert_int_eq(log.n, 3);
    ck_assert_int_eq(log.order[0], 1); /* w1 first, in registration order */
    ck_assert_int_eq(log.order[1], 2);
    ck_assert_int_eq(log.order[2], 0);
    ck_assert(log.w1_grad_was_null);
    /* next step: again once each */
    nb_ctx_reset(ctx);
    log.n = 0;
    x = nbt_randn(ctx, NB_F64, NB_SHAPE(4), 4);
    loss = nb_sum_all(ctx, nb_mul(ctx, nb_mul(ctx, x, w0), w1));
    nb_backward(loss);
    ck_assert_int_eq(log.calls[0], 2);
    ck_assert_int_eq(log.calls[1], 2);
    /* a leaf that gets no gradient in a pass gets no hook call */
    nb_ctx_reset(ctx);
    loss = nb_sum_all(ctx, nb_exp(ctx, w1));
    nb_backward(loss);
    ck_assert_int_eq(log.calls[0], 2);
    ck_assert_int_eq(log.calls[1], 3);
    nb_ctx_free(ctx);
    nb_ctx_free(params);
}
END_TEST

NBT_CPU_TEST(test_cast_backward) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 1);
    nb_tensor *y = nb_cast(ctx, nb_mul_scalar(ctx, nb_cast(ctx, x, NB_F32), 2), NB_F64);
    nb_backward(nb_sum_all(ctx, y));
    ck_assert_int_eq(x->grad->dtype, NB_F64);
    double e[3] = {2, 2, 2};
    nbt_assert_close(x->grad, e, 0, 0);
}

static int removed_calls;
static void counting_hook(nb_tensor *t, void *u) { removed_calls += (int)(intptr_t)u; }

NBT_CPU_TEST(test_remove_hook) {
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 1);
    nb_add_grad_hook(w, counting_hook, (void *)1);
    nb_add_grad_hook(w, counting_hook, (void *)10);
    nb_backward(nb_sum_all(ctx, w));
    ck_assert_int_eq(removed_calls, 11);
    ck_assert(nb_remove_grad_hook(w, counting_hook, (void *)1));
    ck_assert(!nb_remove_grad_hook(w, counting_hook, (void *)1));
    nb_backward(nb_sum_all(ctx, w));
    ck_assert_int_eq(removed_calls, 21);
}

static void count_leaf(nb_tensor *leaf, void *u) {
    nb_tensor **seen = u;
    for (int i = 0; i < 4; i++)
        if (!seen[i] || seen[i] == leaf) {
            seen[i] = leaf;
            return;
        }
}

NBT_CPU_TEST(test_graph_leaves) {
    nb_tensor *a = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 1);
    nb_tensor *b = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 2);
    nb_tensor *unused = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 3);
    nb_tensor *side = nb_exp(ctx, unused); /* on the tape, not in the loss's graph */
    (void)side;
    nb_tensor *loss = nb_sum_all(ctx, nb_mul(ctx, nb_tanh(ctx, a), b));
    nb_tensor *seen[4] = {NULL};
    nb__graph_leaves(loss, count_leaf, seen);
    ck_assert(seen[0] != NULL && seen[1] != NULL && seen[2] == NULL);
    ck_assert((seen[0] == a && seen[1] == b) || (seen[0] == b && seen[1] == a));
    /* the walk leaves the tape ready for a real backward */
    nb_backward(loss);
    ck_assert_ptr_nonnull(a->grad);
    ck_assert_ptr_null(unused->grad);
}

NBT_CPU_TEST(test_set_grad_buffer) {
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 2), 1);
    nb_tensor *bucket = nb_zeros(ctx, NB_F64, NB_SHAPE(6));
    nb_tensor *view = nb_reshape(ctx, nb_narrow(ctx, bucket, 0, 1, 4), NB_SHAPE(2, 2));
    nb_set_grad(w, view);
    nb_backward(nb_sum_all(ctx, nb_mul_scalar(ctx, w, 3)));
    double e[6] = {0, 3, 3, 3, 3, 0};
    nbt_assert_close(bucket, e, 0, 0);
    NBT_EXPECT_ABORT(nb_set_grad(w, bucket), "does not match");
}

static nb_tensor *wrong_grad_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    /* forward is x^2, but the tape says the derivative of 2.1 x^2 (via a detached scale) */
    nb_tensor *x = in[0];
    nb_tensor *sq = nb_mul(ctx, x, x);
    nb_tensor *extra = nb_mul_scalar(ctx, nb_mul(ctx, x, nb_detach(ctx, x)), 0.1);
    nb_tensor *extra_no_value = nb_sub(ctx, extra, nb_detach(ctx, extra));
    return nb_add(ctx, sq, extra_no_value);
}

static nb_tensor *right_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) { return nb_mul(ctx, in[0], in[0]); }

NBT_CPU_TEST(test_gradcheck_catches_wrong_gradients) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(5), 1);
    nb_gradcheck_result ok = nb_gradcheck(right_fn, NULL, 1, &x, 0, 0, 0);
    ck_assert_msg(ok.ok, "%s", ok.message);
    nb_gradcheck_result bad = nb_gradcheck(wrong_grad_fn, NULL, 1, &x, 0, 0, 0);
    ck_assert(!bad.ok);
    ck_assert_int_eq(bad.worst_input, 0);
    ck_assert(bad.worst_index >= 0 && bad.worst_index < 5);
    ck_assert(strstr(bad.message, "FAILED") != NULL);
    nb_tensor *f = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(5), 1);
    NBT_EXPECT_ABORT(nb_gradcheck(right_fn, NULL, 1, &f, 0, 0, 0), "gradcheck needs f64");
}

static nb_tensor *views_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    /* every view op in one graph */
    nb_tensor *x = in[0];                                      /* (2, 3, 4) */
    nb_tensor *t = nb_transpose(ctx, x, 0, 2);                 /* (4, 3, 2) */
    nb_tensor *s = nb_slice(ctx, t, 0, 1, 4, 2);               /* (2, 3, 2) */
    nb_tensor *r = nb_reshape(ctx, s, NB_SHAPE(3, 4));         /* copies */
    nb_tensor *sel = nb_select(ctx, x, 1, 2);                  /* (2, 4) */
    nb_tensor *p = nb_permute(ctx, sel, (int[]){1, 0});        /* (4, 2) */
    nb_tensor *e = nb_expand(ctx, nb_unsqueeze(ctx, nb_narrow(ctx, p, 1, 1, 1), 0), NB_SHAPE(3, 4, 1));
    nb_tensor *q = nb_squeeze(ctx, e, 2);                      /* (3, 4) */
    nb_tensor *c = nb_cast(ctx, nb_clone(ctx, q), NB_F64);
    return nb_add(ctx, nb_mul(ctx, r, r), nb_mul(ctx, q, c));
}

NBT_CPU_TEST(test_gradcheck_views) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3, 4), 9);
    nb_gradcheck_result r = nb_gradcheck(views_fn, NULL, 1, &x, 1e-6, 1e-4, 1e-3);
    ck_assert_msg(r.ok, "%s", r.message);
}

/* ---- adopted gradients (Note [Adopted gradients]) ----
 * A non-leaf's first gradient is the backward function's own tensor, which
 * may also be another tensor's gradient; the checks below read the
 * intermediate gradients after backward to catch an in-place add into a
 * shared one. c weighs every element differently. */
static const double cw[3] = {0.5, -2, 3};

static nb_tensor *weights(nb_ctx *ctx) { return nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){0.5, -2, 3}); }

/* t's gradient is k c, bit for bit. */
static void expect_grad_kc(const nb_tensor *t, double k) {
    double e[3];
    for (int i = 0; i < 3; i++) e[i] = k * cw[i];
    nbt_assert_close(t->grad, e, 0, 0);
}

NBT_CPU_TEST(test_adopt_x_plus_x) {
    /* x = 3w, s = x + x, loss = sum(s c): add_backward hands s's gradient to x twice */
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 1);
    nb_tensor *x = nb_mul_scalar(ctx, w, 3);
    nb_tensor *s = nb_add(ctx, x, x);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, s, weights(ctx))));
    expect_grad_kc(s, 1);
    expect_grad_kc(x, 2);
    expect_grad_kc(w, 6);
    ck_assert_ptr_ne(x->grad, s->grad);
}

NBT_CPU_TEST(test_adopt_diamond) {
    /* x = 3w; a = 2x; b = x + 1; o = a + b; loss = sum(o c).
     * o, a, b and (first) x all receive the one tensor o's gradient; x's
     * second contribution must not write into it. Then the same with the
     * order of a and b's creation swapped (o = b + a): the pass-through
     * branch then runs last and adds into a made gradient. */
    for (int a_first = 1; a_first >= 0; a_first--) {
        nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 2);
        nb_tensor *x = nb_mul_scalar(ctx, w, 3), *a = NULL, *b = NULL;
        if (a_first) a = nb_mul_scalar(ctx, x, 2);
        b = nb_add_scalar(ctx, x, 1);
        if (!a_first) a = nb_mul_scalar(ctx, x, 2);
        nb_tensor *o = a_first ? nb_add(ctx, a, b) : nb_add(ctx, b, a);
        nb_backward(nb_sum_all(ctx, nb_mul(ctx, o, weights(ctx))));
        expect_grad_kc(o, 1);
        if (a_first) expect_grad_kc(a, 1);
        expect_grad_kc(b, 1);
        expect_grad_kc(x, 3);
        expect_grad_kc(w, 9);
    }
}

NBT_CPU_TEST(test_adopt_add_and_mul) {
    /* x = 1.5p; s = x + q; m = s x; loss = sum(m c):
     * dp = 1.5 c (2x + q), dq = c x, ds = c x */
    nb_tensor *p = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 3);
    nb_tensor *q = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 4);
    nb_tensor *x = nb_mul_scalar(ctx, p, 1.5);
    nb_tensor *s = nb_add(ctx, x, q);
    nb_tensor *m = nb_mul(ctx, s, x);
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, m, weights(ctx))));
    double pv[3], qv[3], e_p[3], e_q[3], e_m[3];
    nb_to_host_f64(p, pv);
    nb_to_host_f64(q, qv);
    for (int i = 0; i < 3; i++) {
        double xv = 1.5 * pv[i];
        e_p[i] = 1.5 * cw[i] * (2 * xv + qv[i]);
        e_q[i] = cw[i] * xv;
        e_m[i] = cw[i];
    }
    nbt_assert_close(p->grad, e_p, 1e-12, 1e-12);
    nbt_assert_close(q->grad, e_q, 1e-12, 1e-12);
    nbt_assert_close(s->grad, e_q, 1e-12, 1e-12);
    nbt_assert_close(m->grad, e_m, 0, 0);
}

NBT_CPU_TEST(test_adopt_concat_views) {
    /* concat's backward hands each input a narrow view of one gradient
     * (contiguous along axis 0, so adopted); x1 is used again after it. */
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(3), 5);
    nb_tensor *x1 = nb_mul_scalar(ctx, w, 2), *x2 = nb_mul_scalar(ctx, w, -1);
    nb_tensor *other = nb_sum_all(ctx, nb_mul(ctx, x1, weights(ctx))); /* its backward runs last */
    nb_tensor *cat = nb_concat(ctx, 2, (nb_tensor *[]){x1, x2}, 0);   /* (6) */
    nb_tensor *cc = nb_from_host(ctx, NB_F64, NB_SHAPE(6), (double[]){1, 2, 3, 4, 5, 6});
    nb_tensor *loss = nb_add(ctx, nb_sum_all(ctx, nb_mul(ctx, cat, cc)), other);
    nb_backward(loss);
    double e_cat[6] = {1, 2, 3, 4, 5, 6}, e_x1[3], e_x2[3] = {4, 5, 6}, e_w[3];
    for (int i = 0; i < 3; i++) {
        e_x1[i] = e_cat[i] + cw[i];
        e_w[i] = 2 * e_x1[i] - e_x2[i];
    }
    nbt_assert_close(cat->grad, e_cat, 0, 0);
    nbt_assert_close(x1->grad, e_x1, 0, 0);
    nbt_assert_close(x2->grad, e_x2, 0, 0);
    nbt_assert_close(w->grad, e_w, 0, 0);
}

typedef struct final_grad {
    double seen[3];
    int calls;
} final_grad;

static void record_grad(nb_tensor *leaf, void *user) {
    final_grad *f = user;
    f->calls++;
    nb_to_host_f64(leaf->grad, f->seen);
}

START_TEST(test_adopt_hooks_see_final_gradient) {
    /* y = w + 0; x = 2w; s = x + x; h = y + s; loss = sum(h c): dw = 5c,
     * which the hook must see whole. y and s share h's gradient, x adopts
     * it, and y's pass-through to w runs after x's second contribution. */
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nbt_randn_leaf(params, NB_F64, NB_SHAPE(3), 6);
    final_grad f = {{0}, 0};
    nb_add_grad_hook(w, record_grad, &f);
    for (int step = 1; step <= 2; step++) {
        nb_tensor *y = nb_add_scalar(ctx, w, 0);
        nb_tensor *x = nb_mul_scalar(ctx, w, 2);
        nb_tensor *h = nb_add(ctx, y, nb_add(ctx, x, x));
        nb_backward(nb_sum_all(ctx, nb_mul(ctx, h, weights(ctx))));
        double e[3];
        for (int i = 0; i < 3; i++) e[i] = 5 * cw[i] * step; /* leaves accumulate */
        ck_assert_int_eq(f.calls, step);
        for (int i = 0; i < 3; i++) ck_assert_double_eq_tol(f.seen[i], e[i], 1e-12);
        nbt_assert_close(w->grad, e, 1e-12, 0);
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
    nb_ctx_free(params);
}
END_TEST

NBT_CPU_TEST(test_adopt_slices_share_a_buffer) {
    /* the pieces of a split non-leaf add into one gradient buffer of x;
     * a full-width narrow next to x itself takes the copy-on-write path */
    nb_tensor *w = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(6), 7);
    nb_tensor *x = nb_mul_scalar(ctx, w, 1.5);
    nb_tensor *p[2];
    nb_split(ctx, x, 2, (int64_t[]){2, 4}, 0, p);
    nb_tensor *full = nb_narrow(ctx, x, 0, 0, 6);
    nb_tensor *y = nb_add(ctx, x, full); /* y's gradient goes to x and to full */
    nb_tensor *c6 = nb_from_host(ctx, NB_F64, NB_SHAPE(6), (double[]){1, -1, 2, -2, 3, -3});
    nb_tensor *c2 = nb_from_host(ctx, NB_F64, NB_SHAPE(2), (double[]){10, 20});
    nb_tensor *c4 = nb_from_host(ctx, NB_F64, NB_SHAPE(4), (double[]){30, 40, 50, 60});
    nb_tensor *loss = nb_add(ctx, nb_sum_all(ctx, nb_mul(ctx, y, c6)),
                             nb_add(ctx, nb_sum_all(ctx, nb_mul(ctx, p[0], c2)),
                                    nb_sum_all(ctx, nb_mul(ctx, p[1], c4))));
    nb_backward(loss);
    double e_y[6] = {1, -1, 2, -2, 3, -3}, e_x[6], e_w[6], e_p[6] = {10, 20, 30, 40, 50, 60};
    for (int i = 0; i < 6; i++) {
        e_x[i] = 2 * e_y[i] + e_p[i];
        e_w[i] = 1.5 * e_x[i];
    }
    nbt_assert_close(y->grad, e_y, 0, 0);
    nbt_assert_close(full->grad, e_y, 0, 0);
    nbt_assert_close(p[0]->grad, e_p, 0, 0);
    nbt_assert_close(p[1]->grad, e_p + 2, 0, 0);
    nbt_assert_close(x->grad, e_x, 0, 0);
    nbt_assert_close(w->grad, e_w, 1e-12, 0);
}

static nb_tensor *nonleaf_views_fn(nb_ctx *ctx, nb_tensor *const *in, void *u) {
    /* slices, a strided slice, selects and narrows of one non-leaf */
    nb_tensor *x = nb_mul(ctx, in[0], in[0]);                 /* (4, 6) */
    nb_tensor *a = nb_slice(ctx, x, 1, 1, 6, 2);              /* (4, 3) */
    nb_tensor *b = nb_select(ctx, x, 0, 2);                   /* (6) */
    nb_tensor *c = nb_narrow(ctx, x, 1, 2, 3);                /* (4, 3), overlaps a */
    nb_tensor *r = nb_add(ctx, nb_mul(ctx, a, c), nb_sum(ctx, x, 1, (int[]){1}, true));
    return nb_add(ctx, nb_sum_all(ctx, r), nb_sum_all(ctx, nb_mul(ctx, b, b)));
}

NBT_CPU_TEST(test_gradcheck_nonleaf_views) {
    nb_tensor *x = nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(4, 6), 11);
    NBT_GRADCHECK(nonleaf_views_fn, NULL, 1, &x);
}

/* ---- stale roots and leaves (Note [Stale tensors] in tensor/context.c) ---- */
START_TEST(test_backward_stale_root_and_leaf) {
    nb_ctx *params = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_from_host(params, NB_F64, NB_SHAPE(3), (double[]){1, 2, -3});
    nb_set_requires_grad(w, true);
    /* a loss kept across the loop and backpropagated in the next step */
    nb_tensor *loss = nb_sum_all(step, nb_mul(step, w, w));
    nb_set_name(loss, "loss");
    nb_ctx_reset(step);
    nb_tensor *next = nb_sum_all(step, nb_mul(step, w, nb_full(step, NB_F64, NB_SHAPE(3), 2)));
    NBT_EXPECT_ABORT(nb_backward(loss),
                     "nb_backward: tensor 'loss' f64 () was made before a reset of its context");
    NBT_EXPECT_ABORT(nb_backward_with(next, loss), "nb_backward: tensor 'loss' f64 ()");
    ck_assert_ptr_null(w->grad); /* nothing was accumulated */
    nb_backward(next);
    nbt_assert_close(w->grad, (double[]){2, 2, 2}, 0, 0);

    /* a leaf of another context reset between forward and backward */
    nb_ctx *data = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_from_host(data, NB_F64, NB_SHAPE(3), (double[]){1, 1, 1});
    nb_set_requires_grad(x, true);
    nb_set_name(x, "x");
    nb_ctx_reset(step);
    loss = nb_sum_all(step, nb_mul(step, w, x));
    nb_ctx_reset(data);
    NBT_EXPECT_ABORT(nb_backward(loss),
                     "nb_backward: tensor 'x' f64 (3,) was made before a reset of its context");
    nbt_assert_close(w->grad, (double[]){2, 2, 2}, 0, 0);
    nb_ctx_free(data);
    nb_ctx_free(step);
    nb_ctx_free(params);
}
END_TEST

/* ---- walking a graph twice (Note [Walked graphs] in autograd/backward.c) ---- */
#define WALKED "nb_backward: the graph of this loss was already walked by a backward"

NBT_CPU_TEST(test_second_backward_refused) {
    nb_tensor *w = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){1, 2, -3});
    nb_tensor *c = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){0.5, 1, 2});
    nb_set_requires_grad(w, true);
    nb_tensor *y = nb_sum_all(ctx, nb_mul(ctx, nb_mul(ctx, w, w), c)); /* dy/dw = 2 w c */
    nb_backward(y);
    double g1[3] = {1, 4, -12};
    nbt_assert_close(w->grad, g1, 0, 0);
    NBT_EXPECT_ABORT(nb_backward(y), WALKED " (the loss, made by nb_sum, was reached by an "
                                     "earlier nb_backward); pass retain_graph");
    ck_assert(nb_grad_enabled()); /* the refusal leaves grad mode as it was */
    NBT_EXPECT_ABORT(nb_backward_with(y, nb_scalar(ctx, NB_F64, 1)), WALKED);
    nbt_assert_close(w->grad, g1, 0, 0); /* not doubled */
    /* a tensor inside the walked graph is refused as a root too */
    nb_zero_grad(w);
    nb_tensor *h = nb_mul(ctx, w, c), *s = nb_sum_all(ctx, h);
    nb_backward(s);
    NBT_EXPECT_ABORT(nb_backward_with(h, nb_ones(ctx, NB_F64, NB_SHAPE(3))), WALKED " (the loss, made by nb_mul");
    /* a new loss sharing the walked part adds its own gradient: d(2 s)/dw = 2 c */
    nb_backward(nb_mul_scalar(ctx, s, 2));
    nbt_assert_close(w->grad, (double[]){1.5, 3, 6}, 0, 0);
    /* a fresh graph over the same leaves accumulates, as before */
    nb_backward(nb_sum_all(ctx, nb_mul(ctx, w, c)));
    nbt_assert_close(w->grad, (double[]){2, 4, 8}, 0, 0);
    /* a leaf as the root has no graph to walk */
    nb_zero_grad(w);
    nb_tensor *seed = nb_ones(ctx, NB_F64, NB_SHAPE(3));
    nb_backward_with(w, seed);
    nb_backward_with(w, seed);
    nbt_assert_close(w->grad, (double[]){2, 2, 2}, 0, 0);
}

NBT_CPU_TEST(test_retain_graph) {
    nb_tensor *w = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){1, 2, -3});
    nb_tensor *c = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){0.5, 1, 2});
    nb_set_requires_grad(w, true);
    nb_tensor *h = nb_mul(ctx, nb_mul(ctx, w, w), c);
    nb_tensor *y = nb_sum_all(ctx, h);
    nb_backward_ex(y, &(nb_backward_options){.retain_graph = true});
    nbt_assert_close(w->grad, (double[]){1, 4, -12}, 0, 0);
    nb_backward(y); /* walks it again: the leaves accumulate, exactly twice */
    nbt_assert_close(w->grad, (double[]){2, 8, -24}, 0, 0);
    NBT_EXPECT_ABORT(nb_backward(y), WALKED); /* the last one did not retain it */
    /* with a seed gradient, and NULL options meaning the defaults */
    nb_zero_grad(w);
    nb_tensor *h2 = nb_mul(ctx, w, c);
    nb_tensor *g = nb_from_host(ctx, NB_F64, NB_SHAPE(3), (double[]){1, 2, 4});
    nb_backward_ex(h2, &(nb_backward_options){.grad = g, .retain_graph = true});
    nb_backward_ex(h2, &(nb_backward_options){.grad = g, .retain_graph = true});
    nb_backward_with(h2, g);
    nbt_assert_close(w->grad, (double[]){1.5, 6, 24}, 0, 0); /* 3 * g * c */
    NBT_EXPECT_ABORT(nb_backward_ex(h2, &(nb_backward_options){.grad = g}), WALKED);
    nb_tensor *y3 = nb_sum_all(ctx, nb_mul(ctx, w, c));
    nb_backward_ex(y3, NULL);
    NBT_EXPECT_ABORT(nb_backward_ex(y3, &NB_BACKWARD_DEFAULTS), WALKED);
}

int main(void) {
    const TTest *tests[] = {test_simple_chain, test_reused_intermediate, test_no_grad_and_detach, test_errors,
                             test_cross_context_graph_rejected, test_hooks_fire_once_and_early,
                             test_cast_backward, test_remove_hook, test_graph_leaves, test_set_grad_buffer,
                             test_gradcheck_catches_wrong_gradients, test_gradcheck_views,
                             test_adopt_x_plus_x, test_adopt_diamond, test_adopt_add_and_mul,
                             test_adopt_concat_views, test_adopt_hooks_see_final_gradient,
                             test_adopt_slices_share_a_buffer, test_gradcheck_nonleaf_views,
                             test_backward_stale_root_and_leaf, test_second_backward_refused,
                             test_retain_graph, NULL};
    return nbt_run(nbt_suite("autograd", "core", 0, tests));
}
