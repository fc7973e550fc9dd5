/* Copies, casts and views. Views share storage and are recorded on the
 * tape like any op; the backward of a view that drops elements (narrow,
 * slice, select) scatters the gradient into zeros by applying the same view
 * to a zero tensor of the input's shape. */
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

/* ---- copies ---- */
static void copy_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { nb__accum_grad(ctx, n->in[0], g); }

nb_tensor *nb_clone(nb_ctx *ctx, nb_tensor *x) {
    nb__check_ctx("nb_clone", ctx, x);
    nb_tensor *out = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb__run_copy(out, x);
    nb__node_reads(nb__record(ctx, "nb_clone", copy_backward, out, 1, &x), 0);
    return out;
}

nb_tensor *nb_contiguous(nb_ctx *ctx, nb_tensor *x) {
    nb__check_live("nb_contiguous", x);
    if (nb_is_contiguous(x)) return x;
    return nb_clone(ctx, x);
}

nb_tensor *nb__contig(nb_ctx *ctx, nb_tensor *x) {
    if (nb_is_contiguous(x)) return x;
    nb_tensor *out = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb__run_copy(out, x);
    return out;
}

/* The gradient goes back to x's device: into x's own (step) context when
 * x was made by an op, else through a temporary context, so that nothing
 * accumulates in a persistent one. */
static void to_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    (void)ctx;
    nb_tensor *x = n->in[0];
    if (!x->requires_grad) return;
    nb_ctx *tmp = NULL, *dst = x->ctx;
    if (!x->node) {
        size_t bytes = (size_t)nb_numel(g) * nb_dtype_size(x->dtype) + 4096;
        dst = tmp = nb_ctx_new(x->device, bytes);
    }
    nb_tensor *gx = nb__empty(dst, x->dtype, g->ndim, g->shape);
    nb__run_copy(gx, g);
    nb__accum_grad(dst, x, gx);
    if (tmp) {
        nb__backend_at(x)->sync(x->device.index); /* before its memory goes */
        nb_ctx_free(tmp);
    }
}

nb_tensor *nb_to(nb_ctx *ctx, nb_tensor *x) {
    nb__check_live("nb_to", x);
    if (nb_device_eq(nb_ctx_device(ctx), x->device)) return x;
    nb_tensor *out = nb__empty(ctx, x->dtype, x->ndim, x->shape);
    nb__run_copy(out, x);
    if (nb_dtype_is_float(x->dtype))
        nb__node_reads(nb__record(ctx, "nb_to", to_backward, out, 1, &x), 0);
    return out;
}

/* A cast's own backward (the same as a copy's), so that nb__accum_grad can
 * tell a cast's output: Note [Wide gradients] in autograd/backward.c. */
void nb__cast_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { nb__accum_grad(ctx, n->in[0], g); }

nb_tensor *nb_cast(nb_ctx *ctx, nb_tensor *x, nb_dtype dtype) {
    nb__check_ctx("nb_cast", ctx, x);
    nb_tensor *out = nb__empty(ctx, dtype, x->ndim, x->shape);
    nb__run_copy(out, x);
    if (nb_dtype_is_float(dtype) && nb_dtype_is_float(x->dtype))
        nb__node_reads(nb__record(ctx, "nb_cast", nb__cast_backward, out, 1, &x), 0);
    return out;
}

/* ---- reshape family ---- */
static void reshape_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0];
    nb__accum_grad(ctx, x, nb_reshape(ctx, nb__contig(ctx, g), x->ndim, x->shape));
}

/* Strides for viewing x as `shape` without a copy, or false. Works dim
 * group by dim group: each run of new dims must cover a run of old dims
 * that is contiguous among itself. */
static bool view_strides(const nb_tensor *x, int ndim, const int64_t *shape, int64_t *strides) {
    int64_t os[NB_MAX_DIMS], osh[NB_MAX_DIMS];
    int on = 0;
    for (int d = 0; d < x->ndim; d++) {
        if (x->shape[d] == 1) continue;
        osh[on] = x->shape[d];
        os[on++] = x->strides[d];
    }
    int oi = 0;
    for (int d = ndim - 1; d >= 0;) {
        if (shape[d] == 1) {
            strides[d] = 1;
            d--;
            continue;
        }
        /* take old dims from the right until their product matches new dims' product */
        if (on - 1 - oi < 0) return false;
        int o_end = on - 1 - oi;
        int64_t oprod = osh[o_end];
        int o_start = o_end;
        int64_t nprod = shape[d];
        int n_end = d, n_start = d;
        while (oprod != nprod) {
            if (oprod < nprod) {
                if (--o_start < 0) return false;
                if (os[o_start] != os[o_start + 1] * osh[o_start + 1]) return false;
                oprod *= osh[o_start];
            } else {
                if (--n_start < 0) return false;
                nprod *= shape[n_start];
            }
        }
        int64_t s = os[o_end];
        for (int k = n_end; k >= n_start; k--) {
            strides[k] = s;
            s *= shape[k];
        }
        oi += o_end - o_start + 1;
        d = n_start - 1;
    }
    return oi == on;
}

nb_tensor *nb_reshape(nb_ctx *ctx, nb_tensor *x, int ndim, const int64_t *shape_in) {
    nb__check_live("nb_reshape", x);
    NB_CHECK(ndim >= 0 && ndim <= NB_MAX_DIMS, "nb_reshape: %d dimensions; at most %d", ndim,
             NB_MAX_DIMS);
    int64_t shape[NB_MAX_DIMS];
    int infer = -1;
    int64_t known = 1;
    for (int d = 0; d < ndim; d++) {
        shape[d] = shape_in[d];
        if (shape[d] == -1) {
            NB_CHECK(infer < 0, "nb_reshape: more than one -1 in %s", nb__shape_str_n(ndim, shape_in));
            infer = d;
        } else {
            NB_CHECK(shape[d] >= 0, "nb_reshape: bad size in %s", nb__shape_str_n(ndim, shape_in));
            NB_CHECK(shape[d] == 0 || known <= INT64_MAX / shape[d],
                     "nb_reshape: shape %s has more than INT64_MAX elements",
                     nb__shape_str_n(ndim, shape_in));
            known *= shape[d];
        }
    }
    int64_t n = nb_numel(x);
    if (infer >= 0) {
        NB_CHECK(known > 0 && n % known == 0, "nb_reshape: cannot reshape %s into %s", nb_shape_str(x),
                 nb__shape_str_n(ndim, shape_in));
        shape[infer] = n / known;
    }
    NB_CHECK(nb__numel_shape(ndim, shape) == n, "nb_reshape: cannot reshape %s (%lld elements) into %s",
             nb_shape_str(x), (long long)n, nb__shape_str_n(ndim, shape_in));
    int64_t strides[NB_MAX_DIMS];
    nb_tensor *src = x, *out;
    if (n > 0 && !view_strides(x, ndim, shape, strides)) {
        src = nb__contig(ctx, x);
        nb__contig_strides(ndim, shape, strides);
    } else if (n == 0) {
        nb__contig_strides(ndim, shape, strides);
    }
    out = nb__view(ctx, src, ndim, shape, strides, src->data);
    nb__node_reads(nb__record(ctx, "nb_reshape", reshape_backward, out, 1, &x), 0);
    return out;
}

nb_tensor *nb_flatten(nb_ctx *ctx, nb_tensor *x, int start_dim, int end_dim) {
    nb__check_live("nb_flatten", x);
    if (x->ndim == 0) return nb_reshape(ctx, x, 1, (int64_t[]){1});
    int s = nb_normalize_dim("nb_flatten", start_dim, x->ndim);
    int e = nb_normalize_dim("nb_flatten", end_dim, x->ndim);
    NB_CHECK(s <= e, "nb_flatten: start_dim %d after end_dim %d", start_dim, end_dim);
    int64_t shape[NB_MAX_DIMS];
    int nd = 0;
    for (int d = 0; d < s; d++) shape[nd++] = x->shape[d];
    int64_t p = 1;
    for (int d = s; d <= e; d++) p *= x->shape[d];
    shape[nd++] = p;
    for (int d = e + 1; d < x->ndim; d++) shape[nd++] = x->shape[d];
    return nb_reshape(ctx, x, nd, shape);
}

nb_tensor *nb_unsqueeze(nb_ctx *ctx, nb_tensor *x, int dim) {
    nb__check_live("nb_unsqueeze", x);
    int d = nb_normalize_dim("nb_unsqueeze", dim, x->ndim + 1);
    NB_CHECK(x->ndim < NB_MAX_DIMS, "nb_unsqueeze: %s already has %d dims", nb_shape_str(x), NB_MAX_DIMS);
    int64_t shape[NB_MAX_DIMS];
    for (int i = 0, k = 0; i <= x->ndim; i++) shape[i] = i == d ? 1 : x->shape[k++];
    return nb_reshape(ctx, x, x->ndim + 1, shape);
}

nb_tensor *nb_squeeze(nb_ctx *ctx, nb_tensor *x, int dim) {
    nb__check_live("nb_squeeze", x);
    int d = nb_normalize_dim("nb_squeeze", dim, x->ndim);
    NB_CHECK(x->shape[d] == 1, "nb_squeeze: dimension %d of %s is not 1", dim, nb_shape_str(x));
    int64_t shape[NB_MAX_DIMS];
    for (int i = 0, k = 0; i < x->ndim; i++)
        if (i != d) shape[k++] = x->shape[i];
    return nb_reshape(ctx, x, x->ndim - 1, shape);
}

/* ---- narrowing views ---- */
static nb_tensor *same_slice(nb_ctx *ctx, nb_node *n, nb_tensor *t) {
    if (n->i[0] == 0) return nb_slice(ctx, t, (int)n->i[1], n->i[2], n->i[3], n->i[4]);
    return nb_select(ctx, t, (int)n->i[1], n->i[2]);
}

/* A non-leaf input (the qkv of attention, split in three) gets g added
 * into the slice of its own gradient buffer, so its pieces share one
 * buffer instead of a zero-padded copy each that is then summed: where
 * the elementwise engine writes strided outputs (the CPU). */
static void slice_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0];
    if (!x->requires_grad) return;
    if (x->node && nb__backend_at(x)->strided_elementwise_out && g->dtype == x->dtype) {
        nb_tensor *v = same_slice(ctx, n, nb__grad_to_update(ctx, x));
        nb__run_binary(NB_B_ADD, v, v, g);
        return;
    }
    nb_tensor *gx = nb_zeros(ctx, g->dtype, x->ndim, x->shape);
    nb__run_copy(same_slice(ctx, n, gx), g);
    nb__accum_grad(ctx, x, gx);
}

nb_tensor *nb_slice(nb_ctx *ctx, nb_tensor *x, int dim, int64_t start, int64_t end, int64_t step) {
    nb__check_live("nb_slice", x);
    int d = nb_normalize_dim("nb_slice", dim, x->ndim);
    int64_t size = x->shape[d];
    NB_CHECK(step > 0, "nb_slice: step must be positive, got %lld", (long long)step);
    if (start < 0) start += size;
    if (end < 0) end += size;
    if (end > size) end = size;
    NB_CHECK(start >= 0 && start <= size && end >= start,
             "nb_slice: range [%lld, %lld) out of bounds for dimension %d of %s", (long long)start,
             (long long)end, dim, nb_shape_str(x));
    int64_t shape[NB_MAX_DIMS], strides[NB_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    memcpy(strides, x->strides, sizeof strides);
    shape[d] = (end - start + step - 1) / step;
    strides[d] = x->strides[d] * step;
    char *data = (char *)x->data + start * x->strides[d] * (int64_t)nb_dtype_size(x->dtype);
    nb_tensor *out = nb__view(ctx, x, x->ndim, shape, strides, data);
    nb_node *n = nb__record(ctx, "nb_slice", slice_backward, out, 1, &x);
    nb__node_reads(n, 0);
    if (n) {
        n->i[0] = 0;
        n->i[1] = d;
        n->i[2] = start;
        n->i[3] = end;
        n->i[4] = step;
    }
    return out;
}

nb_tensor *nb_narrow(nb_ctx *ctx, nb_tensor *x, int dim, int64_t start, int64_t length) {
    nb__check_live("nb_narrow", x);
    int d = nb_normalize_dim("nb_narrow", dim, x->ndim);
    NB_CHECK(start >= 0 && length >= 0 && start + length <= x->shape[d],
             "nb_narrow: [%lld, %lld) out of bounds for dimension %d of %s", (long long)start,
             (long long)(start + length), dim, nb_shape_str(x));
    return nb_slice(ctx, x, d, start, start + length, 1);
}

nb_tensor *nb_select(nb_ctx *ctx, nb_tensor *x, int dim, int64_t index) {
    nb__check_live("nb_select", x);
    int d = nb_normalize_dim("nb_select", dim, x->ndim);
    if (index < 0) index += x->shape[d];
    NB_CHECK(index >= 0 && index < x->shape[d], "nb_select: index %lld out of range for dimension %d of %s",
             (long long)index, dim, nb_shape_str(x));
    int64_t shape[NB_MAX_DIMS], strides[NB_MAX_DIMS];
    for (int i = 0, k = 0; i < x->ndim; i++) {
        if (i == d) continue;
        shape[k] = x->shape[i];
        strides[k++] = x->strides[i];
    }
    char *data = (char *)x->data + index * x->strides[d] * (int64_t)nb_dtype_size(x->dtype);
    nb_tensor *out = nb__view(ctx, x, x->ndim - 1, shape, strides, data);
    nb_node *n = nb__record(ctx, "nb_select", slice_backward, out, 1, &x);
    nb__node_reads(n, 0);
    if (n) {
        n->i[0] = 1;
        n->i[1] = d;
        n->i[2] = index;
    }
    return out;
}

/* ---- permutations ---- */
static void permute_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    int inv[NB_MAX_DIMS];
    for (int d = 0; d < g->ndim; d++) inv[n->i[d]] = d;
    nb__accum_grad(ctx, n->in[0], nb_permute(ctx, g, inv));
}

nb_tensor *nb_permute(nb_ctx *ctx, nb_tensor *x, const int *perm) {
    nb__check_live("nb_permute", x);
    int64_t shape[NB_MAX_DIMS], strides[NB_MAX_DIMS];
    bool used[NB_MAX_DIMS] = {false};
    for (int d = 0; d < x->ndim; d++) {
        int p = perm[d];
        NB_CHECK(p >= 0 && p < x->ndim && !used[p], "nb_permute: invalid permutation for %s (entry %d is %d)",
                 nb_shape_str(x), d, p);
        used[p] = true;
        shape[d] = x->shape[p];
        strides[d] = x->strides[p];
    }
    nb_tensor *out = nb__view(ctx, x, x->ndim, shape, strides, x->data);
    nb_node *n = nb__record(ctx, "nb_permute", permute_backward, out, 1, &x);
    nb__node_reads(n, 0);
    if (n)
        for (int d = 0; d < x->ndim; d++) n->i[d] = perm[d];
    return out;
}

nb_tensor *nb_transpose(nb_ctx *ctx, nb_tensor *x, int dim0, int dim1) {
    nb__check_live("nb_transpose", x);
    int a = nb_normalize_dim("nb_transpose", dim0, x->ndim);
    int b = nb_normalize_dim("nb_transpose", dim1, x->ndim);
    int perm[NB_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++) perm[d] = d;
    perm[a] = b;
    perm[b] = a;
    return nb_permute(ctx, x, perm);
}

/* ---- expand ---- */
static void expand_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { nb__accum_grad(ctx, n->in[0], g); }

nb_tensor *nb_expand(nb_ctx *ctx, nb_tensor *x, int ndim, const int64_t *shape) {
    nb__check_live("nb_expand", x);
    NB_CHECK(ndim >= x->ndim && ndim <= NB_MAX_DIMS, "nb_expand: cannot expand %s to %s",
             nb_shape_str(x), nb__shape_str_n(ndim, shape));
    int64_t full[NB_MAX_DIMS], strides[NB_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        int d = x->ndim - ndim + i;
        full[i] = shape[i] == -1 && d >= 0 ? x->shape[d] : shape[i];
        NB_CHECK(full[i] >= 0 && (d < 0 || x->shape[d] == full[i] || x->shape[d] == 1),
                 "nb_expand: cannot expand %s to %s", nb_shape_str(x), nb__shape_str_n(ndim, shape));
    }
    NB_CHECK(nb__numel_shape(ndim, full) >= 0, "nb_expand: shape %s has more than INT64_MAX "
             "elements", nb__shape_str_n(ndim, full));
    nb__broadcast_strides(x, ndim, full, strides);
    nb_tensor *out = nb__view(ctx, x, ndim, full, strides, x->data);
    nb__node_reads(nb__record(ctx, "nb_expand", expand_backward, out, 1, &x), 0);
    return out;
}

/* ---- autograd flags ---- */
nb_tensor *nb_detach(nb_ctx *ctx, nb_tensor *x) {
    nb__check_live("nb_detach", x);
    return nb__view(ctx, x, x->ndim, x->shape, x->strides, x->data);
}

void nb_set_requires_grad(nb_tensor *t, bool requires_grad) {
    nb__check_live("nb_set_requires_grad", t);
    NB_CHECK(t->node == NULL || requires_grad,
             "nb_set_requires_grad: tensor %s was made by %s; use nb_detach to stop gradients",
             nb_shape_str(t), t->node ? t->node->op : "");
    NB_CHECK(!requires_grad || nb_dtype_is_float(t->dtype),
             "nb_set_requires_grad: only float tensors can require grad (got %s)", nb_dtype_name(t->dtype));
    t->requires_grad = requires_grad;
}
