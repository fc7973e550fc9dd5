/* Reductions along axes: sum, mean, max, var; argmax (no gradient).
 *
 * The front end moves the reduced axes last (a permuted view made
 * contiguous), so every kernel reduces rows of `inner` consecutive
 * elements: the backend's row reductions (tensor/backend.h; the CPU's in
 * tensor/cpu/reduce.c). */
#include <math.h>
#include <string.h>

#include "nabla/autograd.h"
#include "tensor/backend.h"
#include "tensor/internal.h"

typedef struct plan {
    int ndim;                  /* of x */
    bool reduced[NB_MAX_DIMS];
    int perm[NB_MAX_DIMS];     /* kept dims, then reduced dims */
    int64_t outer, inner;
    int out_ndim;
    int64_t out_shape[NB_MAX_DIMS];
    int64_t keep_shape[NB_MAX_DIMS]; /* x's shape with reduced dims set to 1 */
} plan;

static void make_plan(const char *op, const nb_tensor *x, int naxes, const int *axes, bool keepdim,
                      plan *p) {
    memset(p, 0, sizeof *p);
    p->ndim = x->ndim;
    NB_CHECK(naxes >= 0 && naxes <= x->ndim && (naxes == 0 || axes),
             "%s: %d axes given for a tensor of shape %s", op, naxes, nb_shape_str(x));
    for (int i = 0; i < naxes; i++) {
        int d = nb_normalize_dim(op, axes[i], x->ndim);
        NB_CHECK(!p->reduced[d], "%s: axis %d given twice for shape %s", op, axes[i], nb_shape_str(x));
        p->reduced[d] = true;
    }
    if (naxes == 0)
        for (int d = 0; d < x->ndim; d++) p->reduced[d] = true;
    int k = 0;
    p->outer = p->inner = 1;
    for (int d = 0; d < x->ndim; d++)
        if (!p->reduced[d]) {
            p->perm[k++] = d;
            p->outer *= x->shape[d];
        }
    for (int d = 0; d < x->ndim; d++)
        if (p->reduced[d]) {
            p->perm[k++] = d;
            p->inner *= x->shape[d];
        }
    for (int d = 0; d < x->ndim; d++) {
        p->keep_shape[d] = p->reduced[d] ? 1 : x->shape[d];
        if (keepdim) p->out_shape[p->out_ndim++] = p->keep_shape[d];
        else if (!p->reduced[d]) p->out_shape[p->out_ndim++] = x->shape[d];
    }
}

/* x with reduced dims last, contiguous */
static nb_tensor *rows_of(nb_ctx *ctx, nb_tensor *x, const plan *p) {
    int64_t shape[NB_MAX_DIMS], strides[NB_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++) {
        shape[d] = x->shape[p->perm[d]];
        strides[d] = x->strides[p->perm[d]];
    }
    nb_tensor *v = nb__view(ctx, x, x->ndim, shape, strides, x->data);
    return nb__contig(ctx, v);
}

/* g (output shape) seen with x's shape through zero strides */
static nb_tensor *expand_grad(nb_ctx *ctx, nb_tensor *g, const nb_tensor *x, const plan *p) {
    g = nb__contig(ctx, g);
    int64_t st[NB_MAX_DIMS], kst[NB_MAX_DIMS];
    nb__contig_strides(x->ndim, p->keep_shape, kst);
    for (int d = 0; d < x->ndim; d++) st[d] = p->reduced[d] ? 0 : kst[d];
    return nb__view(ctx, g, x->ndim, x->shape, st, g->data);
}

static plan *save_plan(nb_ctx *ctx, nb_node *n, const plan *p) {
    plan *s = nb__ctx_meta(ctx, sizeof *s);
    *s = *p;
    n->extra = s;
    return s;
}

/* ---- sum and mean ---- */
static void sum_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0];
    const plan *p = n->extra;
    nb_tensor *ge = expand_grad(ctx, g, x, p);
    if (n->f[0] != 1.0) ge = nb__unary(ctx, NB_U_MUL_S, ge, n->f[0]);
    nb__accum_grad(ctx, x, ge);
}

static nb_tensor *sum_impl(nb_ctx *ctx, const char *op, nb_tensor *x, int naxes, const int *axes,
                           bool keepdim, bool mean) {
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    plan p;
    make_plan(op, x, naxes, axes, keepdim, &p);
    double scale = mean ? (p.inner > 0 ? 1.0 / (double)p.inner : NAN) : 1.0;
    nb_tensor *rows = rows_of(ctx, x, &p);
    nb_tensor *out = nb__empty(ctx, x->dtype, p.out_ndim, p.out_shape);
    nb__backend_at(out)->sum_rows(out, rows, p.outer, p.inner, scale);
    nb_node *n = nb__record(ctx, op, sum_backward, out, 1, &x);
    nb__node_reads(n, 0);
    if (n) {
        save_plan(ctx, n, &p);
        n->f[0] = scale;
    }
    return out;
}

nb_tensor *nb_sum(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim) {
    return sum_impl(ctx, "nb_sum", x, naxes, axes, keepdim, false);
}
nb_tensor *nb_mean(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim) {
    return sum_impl(ctx, "nb_mean", x, naxes, axes, keepdim, true);
}
nb_tensor *nb_sum_all(nb_ctx *ctx, nb_tensor *x) { return nb_sum(ctx, x, 0, NULL, false); }
nb_tensor *nb_mean_all(nb_ctx *ctx, nb_tensor *x) { return nb_mean(ctx, x, 0, NULL, false); }

/* ---- max ---- */
static void max_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0];
    const plan *p = n->extra;
    int64_t pshape[NB_MAX_DIMS], pstrides[NB_MAX_DIMS], strides[NB_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++) pshape[d] = x->shape[p->perm[d]];
    nb__contig_strides(x->ndim, pshape, pstrides);
    nb_tensor *gc = nb__contig(ctx, g);
    nb_tensor *gp = nb__empty(ctx, x->dtype, x->ndim, pshape);
    nb__backend_at(x)->max_rows_backward(gp, n->saved[0], gc, p->outer, p->inner);
    for (int d = 0; d < x->ndim; d++) strides[p->perm[d]] = pstrides[d];
    nb__accum_grad(ctx, x, nb__view(ctx, gp, x->ndim, x->shape, strides, gp->data));
}

nb_tensor *nb_max(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, bool keepdim) {
    const char *op = "nb_max";
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    plan p;
    make_plan(op, x, naxes, axes, keepdim, &p);
    NB_CHECK(p.inner > 0 || p.outer == 0, "nb_max: cannot reduce an empty dimension of %s", nb_shape_str(x));
    nb_tensor *rows = rows_of(ctx, x, &p);
    nb_tensor *out = nb__empty(ctx, x->dtype, p.out_ndim, p.out_shape);
    nb_tensor *arg = nb__empty(ctx, NB_I64, 1, &p.outer);
    nb__backend_at(x)->max_rows(out, arg, rows, p.outer, p.inner);
    nb_node *n = nb__record(ctx, op, max_backward, out, 1, &x);
    if (n) {
        save_plan(ctx, n, &p);
        n->saved[0] = arg;
        nb__mem_internal(n, arg);
    }
    return out;
}

/* ---- var ---- */
static void var_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    /* d var / dx = 2 (x - mean) / (n - correction) */
    nb_tensor *x = n->in[0];
    const plan *p = n->extra;
    nb_tensor *mean = n->saved[0]; /* keep_shape */
    nb_tensor *d = nb__binary(ctx, NB_B_SUB, x, mean);
    nb_tensor *ge = expand_grad(ctx, g, x, p);
    nb_tensor *r = nb__binary(ctx, NB_B_MUL, d, ge);
    nb__accum_grad(ctx, x, nb__unary(ctx, NB_U_MUL_S, r, n->f[0]));
}

nb_tensor *nb_var(nb_ctx *ctx, nb_tensor *x, int naxes, const int *axes, int correction, bool keepdim) {
    const char *op = "nb_var";
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    NB_CHECK(correction >= 0, "nb_var: negative correction %d", correction);
    plan p;
    make_plan(op, x, naxes, axes, keepdim, &p);
    nb_tensor *rows = rows_of(ctx, x, &p);
    nb_tensor *out = nb__empty(ctx, x->dtype, p.out_ndim, p.out_shape);
    nb_tensor *mean = nb__empty(ctx, x->dtype, x->ndim, p.keep_shape);
    double denom = (double)(p.inner - correction);
    nb__backend_at(x)->var_rows(out, mean, rows, p.outer, p.inner, denom);
    nb_node *n = nb__record(ctx, op, var_backward, out, 1, &x);
    if (n) {
        save_plan(ctx, n, &p);
        n->saved[0] = mean;
        nb__mem_internal(n, mean);
        n->f[0] = denom > 0 ? 2.0 / denom : NAN;
    }
    return out;
}

/* ---- argmax ----
 * The index of the maximum along one dim, with nb_max's rule (Note [Max
 * with NaN] in tensor/cuda/reduce.cu): the first NaN if the row has one,
 * else the first of equal maxima, as torch.argmax. Not differentiable: the
 * output is i64 and the tape gets nothing, not even a node for the copy
 * that lays the rows out (evaluation code calls this on logits that
 * require grad, once per batch). */
nb_tensor *nb_argmax(nb_ctx *ctx, nb_tensor *x, int dim, bool keepdim) {
    const char *op = "nb_argmax";
    nb__check_ctx(op, ctx, x);
    nb__check_compute_float(op, ctx, x);
    plan p;
    make_plan(op, x, 1, &dim, keepdim, &p);
    NB_CHECK(p.inner > 0, "nb_argmax: dimension %d of %s is empty", dim,
             nb_shape_str(x));
    bool prev = nb_no_grad_begin();
    nb_tensor *rows = rows_of(ctx, x, &p);
    nb_no_grad_end(prev);
    nb_tensor *out = nb__empty(ctx, NB_I64, p.out_ndim, p.out_shape);
    if (p.outer == 0) return out;
    nb__backend_at(x)->argmax_rows(out, rows, p.outer, p.inner);
    return out;
}

/* g summed over the dims it was broadcast along, to `shape`: the gradient
 * of a broadcast input (autograd's nb__accum_grad). */
static nb_tensor *sum_to(nb_ctx *ctx, nb_tensor *g, int ndim, const int64_t *shape,
                         nb_dtype out_dtype);

nb_tensor *nb__sum_to(nb_ctx *ctx, nb_tensor *g, int ndim, const int64_t *shape) {
    return sum_to(ctx, g, ndim, shape, g->dtype);
}

static nb_tensor *as_f32(nb_ctx *ctx, nb_tensor *t) {
    if (t->dtype == NB_F32) return t;
    nb_tensor *c = nb__empty(ctx, NB_F32, t->ndim, t->shape);
    nb__run_copy(c, t);
    return c;
}

/* Note [Broadcast gradients of storage halves]
 * A bf16 gradient summed to a broadcast input's shape (a bias's, on a
 * device where bf16 is storage only) is summed in f32: the sum of g
 * widened to f32. Where elementwise kernels visit elements in order, the
 * aliased add reads g's bf16 values itself into the f32 sums (the CPU's
 * binary takes bf16 inputs beside an f32 output, widening them as it
 * reads), the same additions in the same order as on an f32 copy of g,
 * without making that copy; elsewhere the copy is made first. */
nb_tensor *nb__sum_to_f32(nb_ctx *ctx, nb_tensor *g, int ndim, const int64_t *shape) {
    if (!nb__backend_at(g)->ordered_elementwise)
        return sum_to(ctx, as_f32(ctx, g), ndim, shape, NB_F32);
    return as_f32(ctx, sum_to(ctx, g, ndim, shape, NB_F32));
}

static nb_tensor *sum_to(nb_ctx *ctx, nb_tensor *g, int ndim, const int64_t *shape,
                         nb_dtype out_dtype) {
    if (g->ndim == ndim) {
        bool same = true;
        for (int d = 0; d < ndim; d++) same &= g->shape[d] == shape[d];
        if (same) return g;
    }
    if (g->ndim > ndim) { /* leading dims of size 1 and the rest the target's: a view */
        int lead = g->ndim - ndim;
        bool ones = true;
        for (int d = 0; d < g->ndim; d++)
            ones &= d < lead ? g->shape[d] == 1 : g->shape[d] == shape[d - lead];
        if (ones) return nb__view(ctx, g, ndim, shape, g->strides + lead, g->data);
    }
    if (g->ndim < ndim) { /* g lacks leading size-1 dims of the target */
        int64_t gs[NB_MAX_DIMS], gst[NB_MAX_DIMS];
        int pad = ndim - g->ndim;
        for (int d = 0; d < ndim; d++) {
            gs[d] = d < pad ? 1 : g->shape[d - pad];
            gst[d] = d < pad ? 0 : g->strides[d - pad];
        }
        g = nb__view(ctx, g, ndim, gs, gst, g->data);
        return sum_to(ctx, g, ndim, shape, out_dtype);
    }
    if (!nb__backend_at(g)->ordered_elementwise) {
        /* Each output element written by its own thread: the aliasing
         * trick below would race, so reduce the broadcast dims. */
        int axes[NB_MAX_DIMS], n = 0, lead = g->ndim - ndim; /* g's extra leading dims */
        for (int d = 0; d < g->ndim; d++)
            if (d < lead || (shape[d - lead] == 1 && g->shape[d] != 1)) axes[n++] = d;
        nb_tensor *r = n ? nb_sum(ctx, g, n, axes, true) : g;
        return nb_reshape(ctx, r, ndim, shape);
    }
    nb_tensor *out = nb_zeros(ctx, out_dtype, ndim, shape);
    /* out seen with g's shape: zero strides on the broadcast dims; the
     * sequential add accumulates every element that maps to one place. */
    int64_t st[NB_MAX_DIMS];
    nb__broadcast_strides(out, g->ndim, g->shape, st);
    nb_tensor *view = nb__view(ctx, out, g->ndim, g->shape, st, out->data);
    nb__run_binary(NB_B_ADD, view, view, g);
    return out;
}
