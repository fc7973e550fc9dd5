/* Tensors: a public struct, owned by a context, read-only by convention.
 *
 * Shapes have at most NB_MAX_DIMS dimensions; strides are in elements and
 * may be zero (expand) or describe any permutation (transpose). `data`
 * points at the element of index (0, ..., 0). Views share their base's
 * storage. Functions that take a context allocate their result there. */
#ifndef NABLA_TENSOR_H
#define NABLA_TENSOR_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "nabla/api.h"
#include "nabla/context.h"
#include "nabla/dtype.h"
#include "nabla/random.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NB_MAX_DIMS 6

typedef struct nb_tensor nb_tensor;
typedef struct nb_node nb_node;
typedef struct nb_hook nb_hook;

struct nb_tensor {
    nb_dtype dtype;
    nb_device device;
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    int64_t strides[NB_MAX_DIMS]; /* in elements */
    void *data;                   /* element (0, ..., 0) */
    nb_tensor *base;              /* tensor whose storage this one views, or NULL */
    nb_ctx *ctx;                  /* where it was made */
    const char *name;             /* optional, for messages and state dicts */
    bool requires_grad;
    nb_tensor *grad;              /* accumulated gradient (leaves), last gradient (others) */
    nb_node *node;                /* the op that made it; NULL for leaves */
    struct nb__tensor_priv *priv; /* the library's bookkeeping: not for programs */
};

/* A tensor with a PyTorch-style dotted name ("blocks.0.attn.qkv.weight"):
 * the unit of state dicts, optimizer state and checkpoints. */
typedef struct nb_named_tensor {
    const char *name;
    nb_tensor *tensor;
} nb_named_tensor;

/* Shape literal: nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3)). */
#define NB_SHAPE(...)                                                       \
    (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

/* ---- facts ---- */
NB_API int64_t nb_numel(const nb_tensor *t);
NB_API bool nb_is_contiguous(const nb_tensor *t);
NB_API bool nb_is_leaf(const nb_tensor *t); /* requires grad and made by no op */
NB_API bool nb_same_shape(const nb_tensor *a, const nb_tensor *b);
/* "(2, 3)": a thread-local buffer, eight of them in rotation. */
NB_API const char *nb_shape_str(const nb_tensor *t);

/* ---- creation ---- */
NB_API nb_tensor *nb_empty(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape);
NB_API nb_tensor *nb_zeros(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape);
NB_API nb_tensor *nb_ones(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape);
NB_API nb_tensor *nb_full(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                          double value);
NB_API nb_tensor *nb_scalar(nb_ctx *ctx, nb_dtype dtype, double value); /* 0-d */
/* start, start + step, ... while < stop (> stop for a negative step). */
NB_API nb_tensor *nb_arange(nb_ctx *ctx, nb_dtype dtype, double start, double stop, double step);
/* Copies `numel` elements of `dtype` from contiguous host memory. */
NB_API nb_tensor *nb_from_host(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                        const void *src);
NB_API nb_tensor *nb_zeros_like(nb_ctx *ctx, const nb_tensor *t);
NB_API nb_tensor *nb_empty_like(nb_ctx *ctx, const nb_tensor *t);

/* Random tensors from `rng` (NULL: the default generator), float dtypes. */
NB_API nb_tensor *nb_rand_uniform(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                           double low, double high, nb_rng *rng);
NB_API nb_tensor *nb_rand_normal(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape,
                          double mean, double std, nb_rng *rng);

/* ---- reading ---- */
/* Copies the elements, in row-major order, to contiguous host memory in
 * the tensor's own dtype. */
NB_API void nb_to_host(const nb_tensor *t, void *dst);
/* Same, converted to double (any dtype). */
NB_API void nb_to_host_f64(const nb_tensor *t, double *dst);
/* One element as a double; `index` has t->ndim entries (NULL for 0-d). */
NB_API double nb_get(const nb_tensor *t, const int64_t *index);
/* The value of a tensor with one element. */
NB_API double nb_item(const nb_tensor *t);

/* ---- writing in place (never recorded by autograd) ---- */
NB_API void nb_fill_(nb_tensor *t, double value);
NB_API void nb_copy_(nb_tensor *dst, const nb_tensor *src);     /* same shape; casts */
NB_API void nb_axpy_(nb_tensor *y, double alpha, const nb_tensor *x); /* y += alpha * x */
NB_API void nb_scale_(nb_tensor *t, double alpha);                 /* t *= alpha */
NB_API void nb_set(nb_tensor *t, const int64_t *index, double value);

/* ---- copies and casts (recorded by autograd) ---- */
NB_API nb_tensor *nb_cast(nb_ctx *ctx, nb_tensor *x, nb_dtype dtype);
NB_API nb_tensor *nb_contiguous(nb_ctx *ctx, nb_tensor *x); /* x itself if already contiguous */
NB_API nb_tensor *nb_clone(nb_ctx *ctx, nb_tensor *x);      /* always a fresh copy */
/* x on ctx's device (a copy; x itself when already there), same dtype;
 * the gradient flows back to x's device. Copies from a GPU wait for it. */
NB_API nb_tensor *nb_to(nb_ctx *ctx, nb_tensor *x);

/* ---- views (share storage; recorded by autograd) ---- */
/* One entry of `shape` may be -1. Copies when the strides do not allow a view. */
NB_API nb_tensor *nb_reshape(nb_ctx *ctx, nb_tensor *x, int ndim, const int64_t *shape);
NB_API nb_tensor *nb_flatten(nb_ctx *ctx, nb_tensor *x, int start_dim, int end_dim);
NB_API nb_tensor *nb_narrow(nb_ctx *ctx, nb_tensor *x, int dim, int64_t start, int64_t length);
/* Elements start, start+step, ... < end of `dim` (step > 0). */
NB_API nb_tensor *nb_slice(nb_ctx *ctx, nb_tensor *x, int dim, int64_t start, int64_t end,
                    int64_t step);
NB_API nb_tensor *nb_select(nb_ctx *ctx, nb_tensor *x, int dim, int64_t index); /* drops dim */
NB_API nb_tensor *nb_transpose(nb_ctx *ctx, nb_tensor *x, int dim0, int dim1);
NB_API nb_tensor *nb_permute(nb_ctx *ctx, nb_tensor *x, const int *perm);
/* Size-1 dimensions broadcast to `shape` with stride 0; new leading dims allowed. */
NB_API nb_tensor *nb_expand(nb_ctx *ctx, nb_tensor *x, int ndim, const int64_t *shape);
NB_API nb_tensor *nb_unsqueeze(nb_ctx *ctx, nb_tensor *x, int dim);
NB_API nb_tensor *nb_squeeze(nb_ctx *ctx, nb_tensor *x, int dim);

/* ---- names and flags ---- */
NB_API void nb_set_name(nb_tensor *t, const char *name); /* copied into t's context */
NB_API void nb_set_requires_grad(nb_tensor *t, bool requires_grad);
/* Makes t (and every view of its storage) the user's: it lives until its
 * context's reset even if a module's forward made it. Needed only for a
 * tensor made inside a module that is read after nb_backward, for
 * example one a custom module keeps for inspection (Note [Memory given
 * back] in tensor/memory.c; a module's returned output is the user's
 * already). Returns t. */
NB_API nb_tensor *nb_keep(nb_tensor *t);

/* ---- printing ---- */
/* PyTorch-style: tensor([[...]], dtype=f32, shape=(2, 3)); long
 * dimensions are abbreviated with "...". */
NB_API void nb_tensor_fprint(FILE *f, const nb_tensor *t);
NB_API void nb_tensor_print(const nb_tensor *t);

/* Negative dims count from the end; aborts naming `op` when out of range. */
NB_API int nb_normalize_dim(const char *op, int dim, int ndim);

#ifdef __cplusplus
}
#endif
#endif
