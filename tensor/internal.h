/* Internal interface shared by the op front ends, the CPU kernels and
 * autograd. Not installed.
 *
 * An op front end: checks its inputs (NB_CHECK, naming the op and shapes),
 * allocates its output with nb__empty(), runs a kernel, and, when
 * nb__needs_grad() says so, records a node with nb__record(). A backward
 * function runs with grad mode off, computes the gradient of each input
 * that requires grad (usually with other ops) and hands it to
 * nb__accum_grad(), which reduces broadcast dims away. */
#ifndef NABLA_TENSOR_INTERNAL_H
#define NABLA_TENSOR_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "nabla/nabla.h"
#include "tensor/op_table.h"

#ifdef __cplusplus
extern "C" { /* the CUDA backend's .cu files include this header */
#endif

/* Note [Tensor bookkeeping]
 * What the library keeps about a tensor beside its public fields: made
 * with the tensor, in the same allocation of the context's metadata
 * (nb__empty, nb__view: no allocation of its own), and reached through
 * t->priv, an opaque pointer in the public struct (include/nabla/tensor.h
 * shows none of it). A copy of the struct shares its original's part, so
 * it is as live or stale as the original; a tensor struct the library
 * makes on the stack from nothing (a host view of a buffer, backward's
 * seed) has a context of NULL, which nb__check_live never looks past. */
typedef struct nb__tensor_priv {
    nb_hook *hooks;      /* gradient-ready hooks (leaves) */
    uint64_t bw_id;      /* the backward that last counted its uses */
    int64_t bw_pending;  /* uses left in that backward */
    bool bw_seen;
    bool grad_owned;     /* grad was made for this tensor alone: may be added into */
    bool grad_held;      /* holds a reference on grad's storage: Note [Memory given back] */
    uint32_t gen;        /* ctx's generation when made: Note [Stale tensors] */
    struct nb__mem *mem; /* its storage's record (shared by views), or NULL */
    struct nb__grad_slot *grad_slot; /* where its first gradient goes: Note [Flat gradients] */
    nb_tensor *grad_home; /* its gradient's memory while grad is NULL: Note [Gradients set to none] */
    bool seed_one;       /* a root's gradient nb_backward seeded with ones (no host read needed) */
} nb__tensor_priv;

/* Marks an internal function the CUDA plugin calls: libnabla.so exports it
 * beside the public NB_API surface (include/nabla/api.h); the list stays
 * short (tests/test_exports.py). */
#define NB_PLUGIN_API NB_API

typedef void (*nb_backward_fn)(nb_ctx *ctx, nb_node *node, nb_tensor *grad_out);

#define NB_NODE_SAVED 4
#define NB_NODE_PARAMS 8

/* Note [Tape]: nodes are made in the context of their output and linked
 * newest-first through `prev`; that order is a topological order. */
struct nb_node {
    const char *op;        /* "nb_matmul": for messages */
    nb_backward_fn backward;
    nb_tensor *out;
    int n_in;
    nb_tensor **in;        /* inputs, in the op's argument order */
    nb_tensor *saved[NB_NODE_SAVED]; /* extra tensors kept for backward */
    double f[NB_NODE_PARAMS];        /* scalar parameters */
    int64_t i[NB_NODE_PARAMS];       /* integer parameters */
    void *extra;           /* anything else, allocated in the context */
    nb_node *prev;         /* the node recorded before this one */
    nb_ctx *ctx;
    uint64_t bw_id;        /* backward pass that marked it needed */
    bool walked;           /* a backward without retain_graph went through it */
    uint8_t refs;          /* NB__REFS_*: its references (Note [Memory given back]) */
    uint8_t reads;         /* NB__READS_*: what its backward reads besides saved[] */
    uint8_t unread_in;     /* bit i: in[i]'s data is not read although reads has
                            * NB__READS_IN (Note [Inputs recomputed in backward]) */
};

/* ---- memory given back within a step (tensor/memory.c) ---- */
enum { NB__REFS_NONE, NB__REFS_HELD, NB__REFS_DROPPED };
/* The data a backward function reads: the inputs' (the default) and the
 * output's (exp, tanh, softmax, ...); an op whose backward needs only
 * shapes (add, views, casts, sums) reads neither, so its inputs can go
 * before it runs. Saved tensors are always read. */
enum { NB__READS_IN = 1, NB__READS_OUT = 2 };
static inline void nb__node_reads(nb_node *n, unsigned reads) {
    if (n) n->reads = (uint8_t)reads;
}
/* Note [Inputs recomputed in backward]
 * A node may mark an input whose values its backward makes again from a
 * tensor it saved (node->unread_in, bit i for in[i], i < 8) instead of
 * reading them: the tape then holds no reference on that input's storage,
 * so the input is given back as soon as nothing else reads it, and
 * nb_backward checks only that it is of this step, not that its data is
 * live. The input stays in[i] for the graph (its gradient goes there); the
 * backward reads the saved tensor and makes the values in a temporary that
 * it gives back right after use (nb__give_back_now). The one user: a
 * product whose input is a GELU output (Note [GELU recomputed in backward]
 * in tensor/ops_matmul.c). */
static inline bool nb__node_reads_in(const nb_node *n, int i) {
    return (n->reads & NB__READS_IN) && !(i < 8 && (n->unread_in >> i & 1));
}
/* A storage's record: Note [Memory given back] in tensor/memory.c. */
typedef struct nb__mem {
    nb_tensor *t;     /* the tensor it was made for (messages, context) */
    void *data;
    size_t bytes;
    int32_t refs;     /* nodes of the tape and gradients' holders using it */
    bool library;     /* the library's (may be given back), else the user's */
    bool scoped;      /* on an open frame's list: that frame decides */
    bool given_back;
    bool sharded;     /* a parameter whose values are sharded over ranks (distributed/fsdp.c) */
    bool in_backward; /* made inside a backward function (Note [Peak report]) */
    struct nb__mem *next;
    struct nb__mem *live_prev, *live_next; /* the watched context's live list */
} nb__mem;
/* Gives t (made by nb__empty, `bytes` of data) its record when ctx gives back. */
void nb__mem_new(nb_ctx *ctx, nb_tensor *t, size_t bytes);
/* Note [Peak report]: copies what is live when ctx, watched, is at its peak. */
void nb__peak_check(nb_ctx *ctx);
/* t, saved by node n, was made by the op itself: the library's. */
void nb__mem_internal(nb_node *n, nb_tensor *t);
void nb__keep(nb_tensor *t);
/* Gives t's storage (made by nb__empty: the user's, or a backward
 * function's temporary) back now; t is then refused as given back, and
 * the frame t was made in skips it when it closes. Nothing where its
 * context does not give back. */
void nb__give_back_now(nb_tensor *t);
/* t (made by nb__empty), given back, holds `data` now (new memory of its
 * context, of its size): its record is live again. */
void nb__mem_renew(nb_tensor *t, void *data);
/* A module's forward: tensors made in ctx between enter and exit are the
 * library's; at exit those nothing uses are given back, and ret (the
 * returned tensor) becomes the user's when no other forward is open. */
void nb__scope_enter(nb_ctx *ctx);
void nb__scope_exit(nb_ctx *ctx, nb_tensor *ret);
/* A backward function's call: what it made and no tensor adopted as its
 * gradient is given back at close. */
void nb__window_open(nb_ctx *ctx);
void nb__window_close(void);
/* Drops this thread's frames on ctx (its reset or free). */
void nb__frames_forget(const nb_ctx *ctx);
/* The tape's references on a node's tensors, taken once and dropped once. */
void nb__node_acquire(nb_node *n);
void nb__node_release(nb_node *n);
/* Note [Memory given back]: t's storage as a fresh tensor of t's shape for
 * a gradient that a backward function writes in place of t's values, when
 * t is the library's and only node n (running) still reads it; else NULL.
 * t is then refused as given back. */
nb_tensor *nb__reuse_for_grad(nb_ctx *ctx, nb_node *n, nb_tensor *t);
/* Whether an op may write over t's values now and its backward then take
 * t's storage for a gradient (nb__reuse_for_grad): t is the library's,
 * made in a scope still open, covers its storage, and no node on the tape
 * reads it. The caller answers for the nodes recorded later (Note [Fused
 * classifier] in tensor/ops_loss.c). */
bool nb__overwritable(nb_ctx *ctx, const nb_tensor *t);
/* nb_cross_entropy, writing the logits' gradient over them in the forward
 * when nb__overwritable allows (Note [Fused classifier] in
 * tensor/ops_loss.c); the caller promises that nothing reads the logits
 * after the loss. */
nb_tensor *nb__cross_entropy_fused(nb_ctx *ctx, nb_tensor *logits, nb_tensor *targets,
                                   const nb_cross_entropy_opts *opts);
/* t->grad = g, holding g's storage and dropping the old one's hold. */
void nb__set_grad(nb_tensor *t, nb_tensor *g);
/* Drops t's hold on its gradient (t->grad stays, to be reported if read). */
void nb__drop_grad(nb_tensor *t);
/* Whether t's hold is the only reference to its gradient's storage (no
 * other tensor's gradient, no node of the tape uses it) and the storage is
 * the library's. False when the context does not give back: without the
 * records nothing is known. */
bool nb__grad_sole_holder(const nb_tensor *t);
/* ---- the context's side of it (tensor/context.c) ---- */
bool nb__ctx_gives_back(const nb_ctx *ctx);
void nb__ctx_give_back(nb_ctx *ctx, void *p, size_t bytes);
/* A kernel's scratch (nb_ctx_alloc) that nothing reads after the kernel:
 * given back where ctx gives back. On CUDA, call it after the last launch
 * that uses it: a later kernel reusing the memory runs after on the stream. */
NB_PLUGIN_API void nb__ctx_scratch_done(nb_ctx *ctx, void *p, size_t bytes);
/* Counts backward passes since the last reset (Note [Growing contexts]). */
void nb__ctx_note_backward(nb_ctx *ctx);

/* ---- contexts ---- */
/* Newest node of the context's tape, and a link hook for nb__record. */
nb_node *nb__ctx_tape(nb_ctx *ctx);
void nb__ctx_push_node(nb_ctx *ctx, nb_node *node);
/* Host memory for metadata (tensor structs, nodes), from the context's arena. */
NB_PLUGIN_API void *nb__ctx_meta(nb_ctx *ctx, size_t bytes);

/* ---- tensors ---- */
/* A contiguous tensor, uninitialised. */
NB_PLUGIN_API nb_tensor *nb__empty(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape);
/* A tensor struct that views `src`'s storage with a new shape, strides and
 * data pointer (no node recorded). */
nb_tensor *nb__view(nb_ctx *ctx, nb_tensor *src, int ndim, const int64_t *shape,
                    const int64_t *strides, void *data);
/* x if contiguous, else a contiguous copy (no node recorded). */
nb_tensor *nb__contig(nb_ctx *ctx, nb_tensor *x);
void nb__contig_strides(int ndim, const int64_t *shape, int64_t *strides);
NB_PLUGIN_API int64_t nb__numel_shape(int ndim, const int64_t *shape); /* -1: more than INT64_MAX */

/* Element access by raw pointer, converting to and from double. */
NB_PLUGIN_API double nb__load(const void *p, nb_dtype dtype);
NB_PLUGIN_API void nb__store(void *p, nb_dtype dtype, double v);

/* ---- context for nb_abort's message ---- */
/* A thread's chain of frames, innermost first (nb_module_forward pushes
 * one: Note [Module paths in errors] in nn/module.c). nb_abort hands the
 * message to the innermost frame's `annotate`, which writes the message to
 * print into out, and empties the chain before calling the handler (a
 * handler that longjmps leaves no frame behind). Frames live on the stack
 * of the function that pushed them and are popped in reverse order. */
typedef struct nb__abort_frame nb__abort_frame;
struct nb__abort_frame {
    nb__abort_frame *up;
    void (*annotate)(const nb__abort_frame *f, const char *msg, char *out, size_t size);
};
void nb__abort_frame_push(nb__abort_frame *f);
void nb__abort_frame_pop(nb__abort_frame *f);

/* ---- checks (abort naming `op`) ---- */
void nb__check_float(const char *op, const nb_tensor *t);  /* f32/f64 for math */
/* nb__check_float, or, for the ops of the compute-dtype table, a half
 * dtype that is ctx's compute dtype (Note [Compute dtype] in
 * tensor/context.c). */
void nb__check_compute_float(const char *op, const nb_ctx *ctx, const nb_tensor *t);
void nb__check_same_dtype(const char *op, const nb_tensor *a, const nb_tensor *b);
void nb__check_index_dtype(const char *op, const nb_tensor *t); /* i32/i64 */
void nb__check_ctx(const char *op, nb_ctx *ctx, const nb_tensor *t); /* same device */

/* Liveness (Note [Stale tensors] in tensor/context.c): a tensor is live
 * while its context's generation, the first member of struct nb_ctx, is the
 * one it was made in. A tensor without a context (a struct on the stack) is
 * always live. nb__check_live aborts naming `op` for a stale tensor; the
 * checks above and nb__record call it, so op front ends rarely need to. */
typedef struct nb__ctx_head {
    uint32_t gen; /* bumped by nb_ctx_reset */
} nb__ctx_head;
static inline uint32_t nb__ctx_gen(const nb_ctx *ctx) {
    return ((const nb__ctx_head *)(const void *)ctx)->gen;
}
#if defined(__SANITIZE_ADDRESS__)
#define NB__ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NB__ASAN 1
#endif
#endif
#ifdef NB__ASAN
int __asan_address_is_poisoned(void const volatile *addr);
#define NB__RELEASED(t) __asan_address_is_poisoned(&(t)->dtype) /* freed by a reset */
#else
#define NB__RELEASED(t) 0
#endif
NB_NORETURN void nb__stale_abort(const char *op, const nb_tensor *t);
/* Whether t may still be used (not NULL, not released by a reset, not
 * given back). */
static inline bool nb__is_live(const nb_tensor *t) {
    return t && !NB__RELEASED(t) && !(t->ctx && (t->priv->gen != nb__ctx_gen(t->ctx) ||
                                                 (t->priv->mem && t->priv->mem->given_back)));
}
static inline void nb__check_live(const char *op, const nb_tensor *t) {
    if (!nb__is_live(t)) nb__stale_abort(op, t); /* says which, NULL included */
}

/* Broadcast shape of a and b into out (returns its ndim); aborts naming op. */
int nb__broadcast_shape(const char *op, const nb_tensor *a, const nb_tensor *b,
                        int64_t *out_shape);
/* Strides of t seen as `ndim`-dim `shape` (broadcast dims get stride 0). */
void nb__broadcast_strides(const nb_tensor *t, int ndim, const int64_t *shape,
                           int64_t *strides);

/* ---- autograd ---- */
bool nb__needs_grad(int n, nb_tensor *const *inputs);
/* Records a node for out (sets out->node, out->requires_grad) and returns
 * it, or returns NULL when grad mode is off or no input requires grad. */
nb_node *nb__record(nb_ctx *ctx, const char *op, nb_backward_fn backward, nb_tensor *out,
                    int n, nb_tensor *const *inputs);
/* Adds g into t's gradient for this backward pass; g may have broadcast
 * dims that t lacks (they are summed away). Ignores t without requires_grad. */
void nb__accum_grad(nb_ctx *ctx, nb_tensor *t, nb_tensor *g);
/* nb_cast's backward (tensor/view.c): a node with it is a cast. */
void nb__cast_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
/* The gradient of non-leaf t as a contiguous tensor of its own that the
 * caller may add into in place (zeros when t had none yet); for backward
 * functions that scatter a gradient into a part of t's (narrowing views). */
nb_tensor *nb__grad_to_update(nb_ctx *ctx, nb_tensor *t);
/* The existing gradient tensor a backward function may add its
 * contribution to t, of dtype dt, straight into (contiguous, of dt and t's
 * device): leaf t's own when dt is t's dtype, or, when t is a recorded
 * cast of a leaf of the wider dtype dt (a weight cast to the compute
 * dtype), that leaf's (Note [Wide gradients]); counted as this pass's
 * contribution. NULL otherwise (use nb__accum_grad). Note [Gradients added
 * in place] in autograd/backward.c. */
nb_tensor *nb__leaf_grad_target(nb_tensor *t, nb_dtype dt);
/* The sibling for a leaf with no gradient yet (t, dt resolved as above):
 * its reserved memory (the gradient's memory before it was set to none,
 * else its flat slot), now its gradient, counted as this pass's
 * contribution; the caller must WRITE every element of it (a fresh
 * gradient holds garbage, not zeros). NULL when the leaf has a gradient
 * or nothing reserved (then nb__leaf_grad_target or nb__accum_grad).
 * Note [Gradients set to none] in autograd/backward.c. */
nb_tensor *nb__leaf_grad_fresh(nb_tensor *t, nb_dtype dt);
/* Note [Gradients set to none]: t's gradient becomes NULL, its memory
 * kept for the next first contribution (nb_optim_zero_grad_to_none). */
void nb__grad_set_none(nb_tensor *t);
/* A leaf with no gradient but reserved memory gets that memory, zeroed,
 * as its gradient (a reader of every slot, DDP's bucket collective, is
 * about to read it); no-op otherwise. */
void nb__grad_zero_fill_none(nb_tensor *t);
/* The same for any t: a leaf's as above; a non-leaf's existing gradient
 * (contiguous, t's shape, dtype dt = t's, t's device) when it is t's alone,
 * made for t or handed to t by a backward that already ran and held by no
 * other tensor (nb__grad_sole_holder); it is t's own from then on. NULL
 * otherwise (use nb__accum_grad). */
nb_tensor *nb__grad_add_target(nb_tensor *t, nb_dtype dt);
/* Note [Flat gradients] in autograd/backward.c: one buffer for the
 * gradients of parameters of one context and dtype, made at the first
 * gradient one of them receives; a slot per parameter. */
typedef struct nb__grad_flat {
    nb_ctx *ctx;
    nb_dtype dtype;
    int64_t numel;  /* elements, the slots' alignment included */
    int n_slots;
    nb_tensor *buf; /* NULL until the first gradient */
    bool released;  /* Note [Gradient segments]: given back, made again at the next gradient */
    struct nb__grad_slot *slots;
} nb__grad_flat;
typedef struct nb__grad_slot {
    nb__grad_flat *flat;
    int64_t offset; /* elements */
    nb_tensor *view;            /* the parameter's gradient in it, made once */
    struct nb__grad_slot *next; /* the flat's slots */
    /* Note [Parameter shadows] in tensor/shadow.c: the shadow (NULL until
     * a product casts the parameter), the write epoch it was stamped with
     * and the parameter storage it copies */
    nb_tensor *shadow;
    uint64_t shadow_epoch;
    const void *shadow_of;
} nb__grad_slot;
/* ---- Note [Parameter shadows] in tensor/shadow.c ---- */
/* t's values were written other than by an optimizer's update: the
 * shadows go stale when t is a parameter (a leaf that requires grad) or a
 * view of one; t NULL: whatever was written. */
void nb__values_written(const nb_tensor *t);
/* x cast to cd, recorded as nb_cast: an f32 parameter's valid shadow
 * (no kernel), else nb_cast. */
nb_tensor *nb__cast_param(nb_ctx *ctx, nb_tensor *x, nb_dtype cd);
/* For an update of p about to be queued: the shadow it is to write
 * (refreshed by a cast when stale, so that a skipped update leaves it
 * right), or NULL when no product made one. */
nb_tensor *nb__shadow_for_update(nb_tensor *p);
/* After that update is queued: p's shadow is valid. */
void nb__shadow_stamp(nb_tensor *p);
/* Gives each of the n leaves that requires grad and has neither gradient
 * nor slot a slot, in reverse order of the list. */
void nb__grad_flat_reserve(nb_tensor *const *ts, int n);
/* The buffer whose slot holds t's gradient, or NULL. */
nb__grad_flat *nb__grad_in_flat(const nb_tensor *t);
/* Gives f's memory back (Note [Gradient segments]); the caller knows that
 * no parameter holds a gradient in it. Nothing where f's context keeps no
 * records. */
void nb__grad_flat_release(nb__grad_flat *f);
/* Calls fn for each leaf requiring grad that a backward from root would
 * reach (a leaf may be reported more than once). */
void nb__graph_leaves(nb_tensor *root, void (*fn)(nb_tensor *leaf, void *user), void *user);
/* Sums g down to `shape` (the inverse of broadcasting). */
nb_tensor *nb__sum_to(nb_ctx *ctx, nb_tensor *g, int ndim, const int64_t *shape);
/* The same sum in f32 of a bf16 or f16 g, on a device where they are
 * storage only: the sum of g widened to f32 (Note [Broadcast gradients of
 * storage halves] in tensor/ops_reduce.c). */
nb_tensor *nb__sum_to_f32(nb_ctx *ctx, nb_tensor *g, int ndim, const int64_t *shape);

/* ---- elementwise ops: the tables, and who runs them ---- */
/* The op enums come from the tables in tensor/op_table.h (Note [Op tables]). */
#define NB__ENUM_U(E, f, name) NB_U_##E,
#define NB__ENUM_B(E, f, name) NB_B_##E,
typedef enum nb__unary_op { NB_UNARY_OPS(NB__ENUM_U) } nb__unary_op;
typedef enum nb__binary_op { NB_BINARY_OPS(NB__ENUM_B) } nb__binary_op;
#undef NB__ENUM_U
#undef NB__ENUM_B
#define NB_U_COUNT NB__COUNT(NB_UNARY_OPS)
#define NB_B_COUNT NB__COUNT(NB_BINARY_OPS)
/* The op's name for messages ("nb_exp"), from the table. */
NB_PLUGIN_API const char *nb__unary_name(nb__unary_op op);
NB_PLUGIN_API const char *nb__binary_name(nb__binary_op op);

/* Unary, binary, where and copy, run by the backend of out's (dst's)
 * device: the CPU engine (tensor/cpu/elementwise.c) or its CUDA twin. */
void nb__run_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s);
void nb__run_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b);
void nb__run_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a, const nb_tensor *b);
void nb__run_copy(nb_tensor *dst, const nb_tensor *src);

/* Kernel-level (unrecorded) elementwise ops for backward functions and
 * optimizers: fresh contiguous result in ctx. */
nb_tensor *nb__unary(nb_ctx *ctx, nb__unary_op op, nb_tensor *a, double s);
nb_tensor *nb__binary(nb_ctx *ctx, nb__binary_op op, nb_tensor *a, nb_tensor *b);

/* ---- layers ---- */
/* x (.., in) @ w (out, in)^T + b (out), b optional (NULL): the Linear
 * layer's product, recorded, with the bias fused into the GEMM
 * (tensor/ops_matmul.c). */
nb_tensor *nb__linear(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b);
/* gelu_tanh(nb__linear(x, w, b)) as one op on every device (tensor/ops_matmul.c). */
nb_tensor *nb__linear_gelu(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b);
/* The same; recompute: a product that reads the output (as its first
 * operand) keeps the pre-activation instead and makes the output again in
 * its backward (Note [GELU recomputed in backward] in tensor/ops_matmul.c). */
nb_tensor *nb__linear_gelu_ex(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b,
                              bool recompute);
/* r + nb__linear(x, w, b) as one op, the add in the GEMM where r has the
 * product's shape, dtype and device (Note [Residual in the GEMM] in
 * tensor/ops_matmul.c). */
nb_tensor *nb__linear_residual(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b,
                               nb_tensor *r);
/* Tests: false makes nb__linear_residual the add after nb__linear (the
 * path without the fusion), true (the default) fuses again. */
void nb__linear_residual_fuse(bool on);
/* The GPT's input: wte[idx] + wpe[:T] for idx (N, T), of dtype dtype (the
 * tables' dtype, or 16-bit for f32 tables), as one op: one kernel, and a
 * backward that adds into the tables' gradients in place
 * (tensor/ops_embedding.c). */
nb_tensor *nb__embedding_pos(nb_ctx *ctx, nb_tensor *wte, nb_tensor *wpe, nb_tensor *idx,
                             nb_dtype dtype);
/* Tests: 1 or 0 makes the matrix products use (or not) the backward's GEMM
 * epilogues whatever the backend says, -1 follows it again (Note [GEMM
 * epilogues in backward] in tensor/ops_matmul.c). */
void nb__gemm_epilogues_force(int on);
/* Causal self-attention from qkv (N, T, 3C) of h heads to y (N, T, C), scores
 * scaled by scale, as one recorded op (tensor/ops_softmax.c), or NULL where
 * the backend has no fused kernel for it (then the caller composes it). */
nb_tensor *nb__causal_attention(nb_ctx *ctx, nb_tensor *qkv, int h, double scale);

/* ---- convolution geometry (tensor/ops_conv.c; the kernels' letters in
 * tensor/cpu/conv.h) ---- */
typedef struct nb__conv2d_geom {
    int64_t n, c, h, w;  /* input (N, C, H, W) */
    int64_t o, kh, kw;   /* weight (O, C/G, KH, KW) */
    int64_t oh, ow;      /* output (N, O, OH, OW) */
    int64_t sh, sw, ph, pw, dh, dw;
    int64_t groups;      /* G >= 1, dividing C and O */
} nb__conv2d_geom;

/* ---- pooling geometry (tensor/ops_pool.c) ---- */
typedef struct nb__pool2d_geom {
    int64_t planes, h, w, oh, ow; /* planes = N * C */
    int64_t kh, kw, sh, sw, ph, pw;
} nb__pool2d_geom;

/* ---- generators a forward used (Note [Recomputation] in nn/recompute.c) ---- */
#define NB__RNG_LOG 8
typedef struct nb__rng_log {
    int n;
    nb_rng *rng[NB__RNG_LOG];
    nb_rng before[NB__RNG_LOG], after[NB__RNG_LOG];
} nb__rng_log;
/* While a log is open on this thread, nb__rng_used records each generator
 * the first time it is drawn from, with its state then. */
void nb__rng_log_open(nb__rng_log *log);
void nb__rng_log_close(void); /* records each generator's state now, in `after` */
void nb__rng_used(nb_rng *rng);

/* An inner backward from out (Note [Recomputation]): leaves get their
 * gradients; their use counts and hooks are the enclosing backward's. */
void nb__backward_inner(nb_tensor *out, nb_tensor *grad_out);

/* ---- shape strings ---- */
const char *nb__shape_str_n(int ndim, const int64_t *shape);

#ifdef __cplusplus
}
#endif
#endif
