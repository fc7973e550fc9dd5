/* Tensor creation, element access, checks and broadcasting helpers. Views
 * live in tensor/view.c, printing in tensor/print.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

/* ---- facts ---- */
/* -1 when the product exceeds INT64_MAX (Note [Creation sizes]); a zero
 * size anywhere makes it 0. */
int64_t nb__numel_shape(int ndim, const int64_t *shape) {
    int64_t n = 1;
    bool over = false;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0) return 0;
        if (shape[d] > 0 && n > INT64_MAX / shape[d]) over = true;
        else n *= shape[d];
    }
    return over ? -1 : n;
}

int64_t nb_numel(const nb_tensor *t) { return nb__numel_shape(t->ndim, t->shape); }

void nb__contig_strides(int ndim, const int64_t *shape, int64_t *strides) {
    /* Saturates: a product past INT64_MAX is possible only in a tensor with
     * a zero size elsewhere (Note [Creation sizes]), whose strides no
     * element uses. */
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = s;
        int64_t k = shape[d] > 0 ? shape[d] : 1;
        s = s > INT64_MAX / k ? INT64_MAX : s * k;
    }
}

bool nb_is_contiguous(const nb_tensor *t) {
    int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != s) return false;
        s *= t->shape[d];
    }
    return true;
}

bool nb_is_leaf(const nb_tensor *t) { return t->requires_grad && t->node == NULL; }

bool nb_same_shape(const nb_tensor *a, const nb_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

const char *nb__shape_str_n(int ndim, const int64_t *shape) {
    static _Thread_local char bufs[8][128];
    static _Thread_local int next;
    char *b = bufs[next++ & 7];
    size_t n = 0;
    n += (size_t)snprintf(b + n, 128 - n, "(");
    for (int d = 0; d < ndim && n < 120; d++)
        n += (size_t)snprintf(b + n, 128 - n, d ? ", %lld" : "%lld", (long long)shape[d]);
    snprintf(b + n, 128 - n, "%s)", ndim == 1 ? "," : "");
    return b;
}

const char *nb_shape_str(const nb_tensor *t) { return nb__shape_str_n(t->ndim, t->shape); }

int nb_normalize_dim(const char *op, int dim, int ndim) {
    int d = dim < 0 ? dim + ndim : dim;
    NB_CHECK(d >= 0 && d < ndim, "%s: dimension %d out of range for a %d-d tensor", op, dim, ndim);
    return d;
}

/* ---- checks ---- */
void nb__check_float(const char *op, const nb_tensor *t) {
    nb__check_live(op, t);
    if ((t->dtype == NB_BF16 || t->dtype == NB_F16) && nb__backend_at(t)->half_compute) return;
    NB_CHECK(t->dtype == NB_F32 || t->dtype == NB_F64,
             "%s: dtype %s is not supported here (need f32 or f64%s), tensor of shape %s", op,
             nb_dtype_name(t->dtype),
             (t->dtype == NB_BF16 || t->dtype == NB_F16) ? "; bf16/f16 are storage types on the "
                                                          "CPU: nb_cast to f32 first"
                                                        : "",
             nb_shape_str(t));
}

/* Note [Compute dtype] in tensor/context.c */
void nb__check_compute_float(const char *op, const nb_ctx *ctx, const nb_tensor *t) {
    nb__check_live(op, t);
    const nb__backend *be = nb__backend_at(t);
    bool half = t->dtype == NB_BF16 || t->dtype == NB_F16;
    if (!half || be->half_compute) {
        nb__check_float(op, t);
        return;
    }
    bool product = (be->product_dtypes & (1u << t->dtype)) != 0;
    NB_CHECK(product && t->dtype == nb_ctx_compute_dtype(ctx),
             "%s: dtype %s is a storage type on %s%s%s; nb_cast to f32 first (tensor of shape "
             "%s)",
             op, nb_dtype_name(t->dtype), nb_device_name(t->device),
             product ? ", taken by the ops of the compute-dtype table only in a context whose "
                       "compute dtype is it (nb_ctx_set_compute_dtype), and this context's is "
                     : "",
             product ? nb_dtype_name(nb_ctx_compute_dtype(ctx)) : "", nb_shape_str(t));
}

void nb__check_same_dtype(const char *op, const nb_tensor *a, const nb_tensor *b) {
    nb__check_live(op, a);
    nb__check_live(op, b);
    NB_CHECK(a->dtype == b->dtype, "%s: dtypes differ: %s %s vs %s %s", op, nb_dtype_name(a->dtype),
             nb_shape_str(a), nb_dtype_name(b->dtype), nb_shape_str(b));
    NB_CHECK(nb_device_eq(a->device, b->device), "%s: devices differ: %s vs %s", op,
             nb_device_name(a->device), nb_device_name(b->device));
}

void nb__check_index_dtype(const char *op, const nb_tensor *t) {
    nb__check_live(op, t);
    NB_CHECK(t->dtype == NB_I32 || t->dtype == NB_I64,
             "%s: indices must be i32 or i64, got %s of shape %s", op, nb_dtype_name(t->dtype),
             nb_shape_str(t));
}

void nb__check_ctx(const char *op, nb_ctx *ctx, const nb_tensor *t) {
    nb__check_live(op, t);
    NB_CHECK(nb_device_eq(nb_ctx_device(ctx), t->device),
             "%s: tensor of shape %s is on %s but the context is on %s", op, nb_shape_str(t),
             nb_device_name(t->device), nb_device_name(nb_ctx_device(ctx)));
}

int nb__broadcast_shape(const char *op, const nb_tensor *a, const nb_tensor *b, int64_t *out) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int da = a->ndim - nd + i, db = b->ndim - nd + i;
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        NB_CHECK(sa == sb || sa == 1 || sb == 1,
                 "%s: shapes %s and %s cannot be broadcast (dimension %d: %lld vs %lld)", op,
                 nb_shape_str(a), nb_shape_str(b), i, (long long)sa, (long long)sb);
        out[i] = sa == 1 ? sb : sa;
    }
    return nd;
}

void nb__broadcast_strides(const nb_tensor *t, int ndim, const int64_t *shape, int64_t *strides) {
    NB_CHECK(t->ndim <= ndim, "broadcast: tensor %s has more dims than target %s",
             nb_shape_str(t), nb__shape_str_n(ndim, shape));
    for (int i = 0; i < ndim; i++) {
        int d = t->ndim - ndim + i;
        if (d < 0) {
            strides[i] = 0;
            continue;
        }
        NB_CHECK(t->shape[d] == shape[i] || t->shape[d] == 1,
                 "broadcast: shape %s does not broadcast to %s", nb_shape_str(t),
                 nb__shape_str_n(ndim, shape));
        strides[i] = (t->shape[d] == 1 && shape[i] != 1) ? 0 : t->strides[d];
    }
}

/* ---- element access ---- */
double nb__load(const void *p, nb_dtype dtype) {
    switch (dtype) {
    case NB_F32: return *(const float *)p;
    case NB_F64: return *(const double *)p;
    case NB_BF16: return nb_bf16_to_f32(*(const uint16_t *)p);
    case NB_F16: return nb_f16_to_f32(*(const uint16_t *)p);
    case NB_I32: return *(const int32_t *)p;
    case NB_I64: return (double)*(const int64_t *)p;
    default: NB_ABORT("invalid dtype %d", (int)dtype);
    }
}

void nb__store(void *p, nb_dtype dtype, double v) {
    switch (dtype) {
    case NB_F32: *(float *)p = (float)v; break;
    case NB_F64: *(double *)p = v; break;
    case NB_BF16: *(uint16_t *)p = nb_f32_to_bf16((float)v); break;
    case NB_F16: *(uint16_t *)p = nb_f32_to_f16((float)v); break;
    case NB_I32: *(int32_t *)p = (int32_t)v; break;
    case NB_I64: *(int64_t *)p = (int64_t)v; break;
    default: NB_ABORT("invalid dtype %d", (int)dtype);
    }
}

/* ---- creation ---- */
/* Note [Creation sizes]: a shape's element count and its byte size are
 * checked before anything is computed from them. Unchecked, the product of
 * (INT64_MAX/2, 4) wraps to a small or negative count, the arena hands out a
 * few bytes and memset or a kernel then writes far past them. The byte size
 * is held to PTRDIFF_MAX, the largest object C can address; anything that
 * passes but is more than the device has is the arena's out-of-memory
 * error, which names the request. Views are checked too (nb_reshape,
 * nb_expand): (2^61 + 1) * 8 wraps to 8, and a reshape of 8 elements to
 * that shape would otherwise be accepted and read far past them. */
static void check_shape(const char *op, nb_dtype dtype, int ndim, const int64_t *shape) {
    NB_CHECK(ndim >= 0 && ndim <= NB_MAX_DIMS, "%s: %d dimensions requested; at most %d", op, ndim,
             NB_MAX_DIMS);
    for (int d = 0; d < ndim; d++)
        NB_CHECK(shape[d] >= 0, "%s: negative size in shape %s", op, nb__shape_str_n(ndim, shape));
    int64_t n = 1, size = (int64_t)nb_dtype_size(dtype);
    for (int d = 0; d < ndim; d++) {
        NB_CHECK(shape[d] == 0 || n <= INT64_MAX / shape[d],
                 "%s: shape %s has more than INT64_MAX elements", op, nb__shape_str_n(ndim, shape));
        n *= shape[d];
    }
    NB_CHECK(size > 0 && n <= (int64_t)(PTRDIFF_MAX / size),
             "%s: shape %s of %s needs more than PTRDIFF_MAX (%lld) bytes", op,
             nb__shape_str_n(ndim, shape), nb_dtype_name(dtype), (long long)PTRDIFF_MAX);
}

static nb_tensor *empty_named(const char *op, nb_ctx *ctx, nb_dtype dtype, int ndim,
                              const int64_t *shape);

nb_tensor *nb__empty(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape) {
    return empty_named("nb_empty", ctx, dtype, ndim, shape);
}

/* A zeroed tensor struct and its bookkeeping, in one allocation of ctx's
 * metadata (Note [Tensor bookkeeping] in tensor/internal.h). */
static nb_tensor *new_tensor(nb_ctx *ctx) {
    struct both {
        nb_tensor t;
        nb__tensor_priv p;
    } *b = nb__ctx_meta(ctx, sizeof *b);
    b->t.priv = &b->p;
    return &b->t;
}

static nb_tensor *empty_named(const char *op, nb_ctx *ctx, nb_dtype dtype, int ndim,
                              const int64_t *shape) {
    check_shape(op, dtype, ndim, shape);
    nb_tensor *t = new_tensor(ctx);
    t->dtype = dtype;
    t->device = nb_ctx_device(ctx);
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    nb__contig_strides(ndim, t->shape, t->strides);
    t->ctx = ctx;
    t->priv->gen = nb__ctx_gen(ctx);
    size_t bytes = (size_t)nb__numel_shape(ndim, shape) * nb_dtype_size(dtype);
    t->data = nb_ctx_alloc(ctx, bytes, 0);
    nb__backend_at(t)->poison(t->device.index, t->data, bytes);
    nb__mem_new(ctx, t, bytes);
    return t;
}

/* ---- backend dispatch of the elementwise engine ---- */
void nb__run_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s) {
    nb__backend_at(out)->unary(op, out, a, s);
}

void nb__run_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b) {
    nb__backend_at(out)->binary(op, out, a, b);
}

void nb__run_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a, const nb_tensor *b) {
    nb__backend_at(out)->where(out, cond, a, b);
}

/* Between devices (CPU and GPU, or two GPUs): through a contiguous host
 * copy in dst's dtype. */
static void copy_across(nb_tensor *dst, const nb_tensor *src);

/* On one device, or from a host 0-d tensor (a fill): dst's backend. */
void nb__run_copy(nb_tensor *dst, const nb_tensor *src) {
    if (nb_device_eq(dst->device, src->device) ||
        (src->ndim == 0 && !nb__backend_at(src)->device_memory))
        nb__backend_at(dst)->copy(dst, src);
    else copy_across(dst, src);
}

nb_tensor *nb__view(nb_ctx *ctx, nb_tensor *src, int ndim, const int64_t *shape,
                    const int64_t *strides, void *data) {
    nb_tensor *t = new_tensor(ctx);
    t->dtype = src->dtype;
    t->device = src->device;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        t->shape[d] = shape[d];
        t->strides[d] = strides[d];
    }
    t->data = data;
    t->base = src->base ? src->base : src;
    t->ctx = ctx;
    t->priv->gen = nb__ctx_gen(ctx);
    t->priv->mem = src->priv->mem;
    return t;
}

nb_tensor *nb_keep(nb_tensor *t) {
    NB_CHECK(t, "nb_keep: tensor is NULL");
    nb__check_live("nb_keep", t);
    nb__keep(t);
    return t;
}

nb_tensor *nb_empty(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape) {
    return nb__empty(ctx, dtype, ndim, shape);
}

nb_tensor *nb_full(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape, double value) {
    nb_tensor *t = empty_named("nb_full", ctx, dtype, ndim, shape);
    nb_fill_(t, value);
    return t;
}

nb_tensor *nb_zeros(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape) {
    nb_tensor *t = empty_named("nb_zeros", ctx, dtype, ndim, shape);
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(dtype);
    if (bytes) nb__backend_at(t)->memset(t->device.index, t->data, 0, bytes);
    return t;
}

nb_tensor *nb_ones(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape) {
    return nb_full(ctx, dtype, ndim, shape, 1.0);
}

nb_tensor *nb_scalar(nb_ctx *ctx, nb_dtype dtype, double value) {
    return nb_full(ctx, dtype, 0, NULL, value);
}

nb_tensor *nb_zeros_like(nb_ctx *ctx, const nb_tensor *t) {
    nb__check_live("nb_zeros_like", t);
    return nb_zeros(ctx, t->dtype, t->ndim, t->shape);
}

nb_tensor *nb_empty_like(nb_ctx *ctx, const nb_tensor *t) {
    nb__check_live("nb_empty_like", t);
    return nb__empty(ctx, t->dtype, t->ndim, t->shape);
}

nb_tensor *nb_arange(nb_ctx *ctx, nb_dtype dtype, double start, double stop, double step) {
    NB_CHECK(step != 0 && isfinite(start) && isfinite(stop) && isfinite(step),
             "nb_arange: bad range start=%g stop=%g step=%g", start, stop, step);
    double count = ceil((stop - start) / step);
    NB_CHECK(count < 0x1p62, "nb_arange: start=%g stop=%g step=%g gives %g elements", start, stop,
             step, count);
    int64_t n = count > 0 ? (int64_t)count : 0;
    nb_tensor *t = nb__empty(ctx, dtype, 1, &n);
    size_t sz = nb_dtype_size(dtype);
    const nb__backend *be = nb__backend_at(t);
    if (be->meta) { /* no values to write; the upload the device's path makes, counted */
        if (be->device_memory) be->memcpy_h2d(t->device.index, t->data, NULL, (size_t)n * sz);
        return t;
    }
    char *host = be->device_memory ? malloc((size_t)n * sz + 1) : t->data;
    NB_CHECK(host, "nb_arange: out of host memory for %lld elements", (long long)n);
    for (int64_t i = 0; i < n; i++) nb__store(host + i * (int64_t)sz, dtype, start + (double)i * step);
    if (host != t->data) {
        be->memcpy_h2d(t->device.index, t->data, host, (size_t)n * sz);
        free(host);
    }
    return t;
}

nb_tensor *nb_from_host(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                        const void *src) {
    nb_tensor *t = empty_named("nb_from_host", ctx, dtype, ndim, shape);
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(dtype);
    NB_CHECK(src || bytes == 0, "nb_from_host: NULL source for shape %s", nb_shape_str(t));
    if (bytes) nb__backend_at(t)->memcpy_h2d(t->device.index, t->data, src, bytes);
    return t;
}

/* A float tensor of the uniform (a, b: low, high) or normal (mean, std)
 * stream of rng, whose offset then advances past the counters used: 4
 * values a counter uniform, 2 normal (Note [Random streams] in
 * tensor/random.c). */
static nb_tensor *rand_fill(const char *op, bool normal, nb_ctx *ctx, nb_dtype dtype, int ndim,
                            const int64_t *shape, double a, double b, nb_rng *rng) {
    NB_CHECK(nb_dtype_is_float(dtype), "%s: dtype %s is not a float type", op,
             nb_dtype_name(dtype));
    nb_tensor *t = empty_named(op, ctx, dtype, ndim, shape);
    if (!rng) rng = nb_rng_default();
    const nb__backend *be = nb__backend_at(t);
    (normal ? be->rand_normal : be->rand_uniform)(t, a, b, rng->seed, rng->offset);
    int64_t per = normal ? 2 : 4;
    rng->offset += (uint64_t)((nb_numel(t) + per - 1) / per);
    return t;
}

nb_tensor *nb_rand_uniform(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                           double low, double high, nb_rng *rng) {
    return rand_fill("nb_rand_uniform", false, ctx, dtype, ndim, shape, low, high, rng);
}

nb_tensor *nb_rand_normal(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                          double mean, double std, nb_rng *rng) {
    return rand_fill("nb_rand_normal", true, ctx, dtype, ndim, shape, mean, std, rng);
}

/* ---- reading ---- */
/* A host tensor struct over `dst` with t's shape, contiguous, of `dtype`. */
static nb_tensor host_view(const nb_tensor *t, nb_dtype dtype, void *dst) {
    nb_tensor d = *t;
    d.dtype = dtype;
    d.device = nb_cpu();
    d.data = dst;
    d.base = NULL;
    nb__contig_strides(d.ndim, d.shape, d.strides);
    return d;
}

/* t (in device memory, any strides), contiguous in its own dtype, into
 * host memory dst (waits for the device). */
static void read_raw(const nb__backend *be, const nb_tensor *t, void *dst) {
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    if (nb_is_contiguous(t)) {
        be->memcpy_d2h(t->device.index, dst, t->data, bytes);
        return;
    }
    nb_ctx *tmp = nb_ctx_new(t->device, bytes + 64);
    nb_tensor *c = nb__empty(tmp, t->dtype, t->ndim, t->shape);
    be->copy(c, t);
    be->memcpy_d2h(t->device.index, dst, c->data, bytes);
    nb_ctx_free(tmp);
}

/* h (a host view) = t (any device) broadcast to h's shape, in h's dtype. */
static void read_into(const char *op, nb_tensor *h, const nb_tensor *t) {
    const nb__backend *be = nb__backend_at(t);
    if (be->meta) nb__meta_no_values(op, t);
    if (!be->device_memory) {
        be->copy(h, t);
        return;
    }
    if (h->dtype == t->dtype && nb_same_shape(h, t)) {
        read_raw(be, t, h->data);
        return;
    }
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    void *raw = malloc(bytes ? bytes : 1);
    NB_CHECK(raw, "%s: out of host memory staging %zu bytes", op, bytes);
    read_raw(be, t, raw);
    nb_tensor r = host_view(t, t->dtype, raw);
    nb__cpu_backend.copy(h, &r); /* host to host */
    free(raw);
}

/* t (any device and strides) = h (a host view of t's shape and dtype). */
static void write_from(nb_tensor *t, const nb_tensor *h) {
    const nb__backend *be = nb__backend_at(t);
    if (!be->device_memory) {
        be->copy(t, h);
        return;
    }
    size_t bytes = (size_t)nb_numel(t) * nb_dtype_size(t->dtype);
    if (nb_is_contiguous(t)) {
        be->memcpy_h2d(t->device.index, t->data, h->data, bytes);
        return;
    }
    nb_ctx *tmp = nb_ctx_new(t->device, bytes + 64);
    nb_tensor *c = nb__empty(tmp, t->dtype, t->ndim, t->shape);
    be->memcpy_h2d(t->device.index, c->data, h->data, bytes);
    be->copy(t, c);
    be->sync(t->device.index); /* before tmp's memory goes */
    nb_ctx_free(tmp);
}

static void copy_across(nb_tensor *dst, const nb_tensor *src) {
    size_t bytes = (size_t)nb_numel(dst) * nb_dtype_size(dst->dtype);
    void *host = malloc(bytes ? bytes : 1);
    NB_CHECK(host, "nb_copy_: out of host memory staging %zu bytes (%s to %s)", bytes,
             nb_device_name(src->device), nb_device_name(dst->device));
    nb_tensor h = host_view(dst, dst->dtype, host);
    read_into("nb_copy_", &h, src);
    write_from(dst, &h);
    free(host);
}

void nb_to_host(const nb_tensor *t, void *dst) {
    nb__check_live("nb_to_host", t);
    nb_tensor d = host_view(t, t->dtype, dst);
    read_into("nb_to_host", &d, t);
}

void nb_to_host_f64(const nb_tensor *t, double *dst) {
    nb__check_live("nb_to_host_f64", t);
    nb_tensor d = host_view(t, NB_F64, dst);
    read_into("nb_to_host_f64", &d, t);
}

static char *element_ptr(const char *op, const nb_tensor *t, const int64_t *index) {
    int64_t off = 0;
    for (int d = 0; d < t->ndim; d++) {
        NB_CHECK(index[d] >= 0 && index[d] < t->shape[d],
                 "%s: index %lld out of range for dimension %d of shape %s", op,
                 (long long)index[d], d, nb_shape_str(t));
        off += index[d] * t->strides[d];
    }
    return (char *)t->data + off * (int64_t)nb_dtype_size(t->dtype);
}

static double get(const char *op, const nb_tensor *t, const int64_t *index) {
    char *p = element_ptr(op, t, index), buf[8];
    if (nb__backend_at(t)->meta) nb__meta_no_values(op, t);
    nb__backend_at(t)->memcpy_d2h(t->device.index, buf, p, nb_dtype_size(t->dtype));
    return nb__load(buf, t->dtype);
}

double nb_get(const nb_tensor *t, const int64_t *index) {
    nb__check_live("nb_get", t);
    return get("nb_get", t, index);
}

void nb_set(nb_tensor *t, const int64_t *index, double value) {
    nb__check_live("nb_set", t);
    nb__values_written(t); /* Note [Parameter shadows] */
    char *p = element_ptr("nb_set", t, index), buf[8];
    nb__store(buf, t->dtype, value);
    nb__backend_at(t)->memcpy_h2d(t->device.index, p, buf, nb_dtype_size(t->dtype));
}

double nb_item(const nb_tensor *t) {
    nb__check_live("nb_item", t);
    NB_CHECK(nb_numel(t) == 1, "nb_item: tensor of shape %s has %lld elements, not 1",
             nb_shape_str(t), (long long)nb_numel(t));
    int64_t zero[NB_MAX_DIMS] = {0};
    return get("nb_item", t, zero);
}

/* ---- in place ---- */
void nb_fill_(nb_tensor *t, double value) {
    nb__check_live("nb_fill_", t);
    nb__values_written(t); /* Note [Parameter shadows] */
    nb_tensor s = {0};
    s.dtype = t->dtype;
    s.device = nb_cpu(); /* buf is host memory: the copy entry's fill */
    char buf[8];
    nb__store(buf, t->dtype, value);
    s.data = buf;
    nb__backend_at(t)->copy(t, &s);
}

void nb_copy_(nb_tensor *dst, const nb_tensor *src) {
    nb__check_live("nb_copy_", dst);
    nb__values_written(dst); /* Note [Parameter shadows] */
    nb__check_live("nb_copy_", src);
    NB_CHECK(nb_same_shape(dst, src), "nb_copy_: shapes differ: %s vs %s", nb_shape_str(dst),
             nb_shape_str(src));
    nb__run_copy(dst, src);
}

void nb_axpy_(nb_tensor *y, double alpha, const nb_tensor *x) {
    nb__check_live("nb_axpy_", y);
    nb__values_written(y); /* Note [Parameter shadows] */
    nb__check_live("nb_axpy_", x);
    NB_CHECK(nb_same_shape(y, x), "nb_axpy_: shapes differ: %s vs %s", nb_shape_str(y),
             nb_shape_str(x));
    nb__check_same_dtype("nb_axpy_", y, x);
    nb__check_float("nb_axpy_", y);
    nb__backend_at(y)->axpy(y, alpha, x);
}

void nb_scale_(nb_tensor *t, double alpha) {
    nb__check_float("nb_scale_", t);
    nb__values_written(t); /* Note [Parameter shadows] */
    nb__run_unary(NB_U_MUL_S, t, t, alpha);
}

void nb_set_name(nb_tensor *t, const char *name) {
    nb__check_live("nb_set_name", t);
    if (!name) {
        t->name = NULL;
        return;
    }
    size_t n = strlen(name) + 1;
    char *s = nb__ctx_meta(t->ctx, n);
    memcpy(s, name, n);
    t->name = s;
}
