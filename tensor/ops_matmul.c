/* nb_matmul and nb_matmul_t: front end (checks, batch broadcasting,
 * dispatch) and backward. The CPU kernel is in tensor/cpu/matmul.c.
 *
 * Letters: L batch dims, M and N output rows and columns, K inner size;
 * op(x) is x with its last two dims swapped when its flag is set.
 *
 * Backward of C = op(A) @ op(B): dop(A) = dC @ op(B)^T, dop(B) = op(A)^T @ dC,
 * each written as one nb_matmul_t whose flags give the gradient directly
 * in A's or B's own layout (dA = op(B) @ dC^T when A was transposed, and
 * so on), then summed over the batch dims that the input broadcast. When B
 * is one matrix for the whole batch, its gradient is a single GEMM over the
 * batch folded into the rows instead of a batch of products and a sum.
 *
 * Mixed precision: in a context whose compute dtype is bf16 or f16
 * (nb_ctx_set_compute_dtype; bf16 only on the CPU) f32 operands are cast
 * to it first (recorded casts, so gradients reach the f32 originals; a
 * bias too) and the product, accumulated in f32, comes out in the compute
 * dtype. The backward's products run in the same context and so in the
 * same precision; the gradient of an f32 tensor that was cast (a weight)
 * comes out in f32 (Note [Compute dtype] in tensor/context.c).
 *
 * nb__linear (x @ w^T + b, the Linear layer) fuses the bias into the
 * GEMM, through the backend table (tensor/backend.h): on CUDA it rides
 * cuBLASLt's epilogue; on the CPU b is written into the output rows and
 * the GEMM adds the product to it (beta = 1), like PyTorch's addmm. No
 * separate bias pass either way. Its node is the matmul's with b as a
 * third input. Where the bias does not fit (another dtype or shape) it is
 * nb_matmul_t then nb_add. nb__linear_gelu adds GELU(tanh) after it, on
 * every device (in the CUDA epilogue; a pass over the product on the
 * CPU), keeping the pre-activation for backward: one node for the pair.
 * Under a compute dtype an f32 bias is added as it is, in f32, to the
 * GEMM's f32 sums (no cast of it; its gradient goes to it directly).
 *
 * Note [GEMM epilogues in backward]
 * Where the backend says gemm_epilogues (CUDA: cuBLASLt's BGRADB and DGELU
 * epilogues), the backward of a Linear with a bias and of a Linear after
 * GELU ride the GEMMs they already run:
 *  - a bias's gradient, the sum of g over the rows, is formed by the
 *    weight's gradient GEMM g^T x, which reads g anyway (BGRADB: the row
 *    sums of its op(a) = g^T over K), in f32 into a (N) vector that is
 *    then added to the f32 bias's gradient: no pass over g of its own, and
 *    none widening a bf16 g to f32 first;
 *  - the gradient of h = gelu(x w1^T + b1), when h's only consumer in this
 *    backward is a product (the MLP's c_proj), is taken through the GELU by
 *    that product's input-gradient GEMM: g w2 * gelu'(pre), pre the
 *    pre-activation the forward kept (DGELU), written as h's gradient and
 *    marked on h's node (i[2]), whose backward then skips GELU's own
 *    backward pass. h's consumers are counted by nb_backward's first pass
 *    (bw_pending: Note [Tape] in autograd/backward.c); another consumer,
 *    or a gradient already there, keeps the unfused path, since it would
 *    add a gradient of h to one of pre.
 * The sums and products are the same, rounded in other places (f32 sums in
 * the GEMM's order; GELU's gradient in the GEMM's f32 registers before the
 * output's rounding). The CPU computes both epilogues (in f64 sums) but
 * does not set the flag, so its f32 results stay those of the separate
 * ops; nb__gemm_epilogues_force turns the front end's use on for tests.
 *
 * Note [Residual in the GEMM]
 * nb__linear_residual(x, w, b, r) = r + (x w^T + b), a residual branch's
 * last product and the add after it (a transformer block's two), is one
 * op and one node, on every device. CUDA: one cuBLASLt call, D = A B +
 * bias + C with C = r (beta = 1) and D a fresh tensor (C is read once,
 * never added into), each output rounded once; where cuBLASLt has no
 * algorithm for it, the plain GEMM and a kernel adding the bias and r
 * (tensor/cuda/matmul.cu). The CPU computes the linear as nb__linear does
 * and then adds r with the add's own kernel, so its results are those of
 * nb_add(r, nb__linear(x, w, b)) bit for bit; CUDA's differ by rounding
 * the sum once instead of twice. Backward: the linear's (and its
 * epilogues above), and r's gradient is g itself, passed through as
 * nb_add's backward passes it (no copy, no kernel). Where r does not fit
 * (another shape, dtype or device than the product's) it is nb_add(r,
 * nb__linear(x, w, b)), with the add's checks and messages.
 *
 * Note [GELU recomputed in backward]
 * h = nb__linear_gelu(x, w1, b1) keeps its pre-activation pre for its own
 * backward; the product that reads h (the MLP's c_proj, h w2^T) keeps h
 * for its weight's gradient g^T h. Both are (N, T, 4C): at a GPT's peak
 * every layer holds the two. With recompute set (nb__linear_gelu_ex; the
 * GPT's nb_gpt_set_recompute_gelu) h's node says that its output may be
 * made again from pre (i[3]), and a product recorded on h as its first
 * operand, untransposed, saves pre (saved[1]) and marks h unread (Note
 * [Inputs recomputed in backward] in tensor/internal.h): the tape holds no
 * reference on h, which is given back when the forward that made it
 * returns, as llm.c's recompute does. The forward is unchanged. In the
 * product's backward, where its second operand needs a gradient, GELU runs
 * once on pre (nb_gelu(NB_GELU_TANH)'s unary kernel) into a temporary that
 * the weight's gradient GEMM reads and that is given back right after it;
 * h's gradient needs only g, w2 and pre (the DGELU epilogue or h's own
 * backward), never h. Cost per layer: one elementwise kernel (pre read, h
 * written) in backward; saved: h, for every layer at once. pre lives as
 * long as before (until h's node has run, after the product's).
 * The values. The weight's gradient is bitwise the one without
 * recomputation wherever the recomputed h has the forward's bits, that is
 * wherever the forward's h is nb_gelu of the pre it kept, element by
 * element, in the output's dtype: on the CPU, f32 (the same unary kernel
 * on the same pre) and bf16 (the forward, with the option or without,
 * rounds pre to bf16 first and applies GELU to that: tensor/cpu/bf16.c),
 * which tests/test_models.c checks, loss and every gradient. On CUDA the
 * forward's h comes from cuBLASLt's GELU_AUX epilogue (or epilogue_kernel
 * where it has no algorithm), which applies GELU to the f32 sum v and
 * rounds pre = v and h = gelu(v) each once. In bf16/f16 the recomputed h
 * is gelu(pre), GELU of the rounded v: it differs from the forward's by at
 * most GELU's slope (< 1.13) times pre's rounding plus the two outputs'
 * own roundings, and does so in about a third of the elements, by a unit
 * in the last place (dev/cuda_emu's drv_matmul checks the bound and counts
 * them). In f32 and f64 pre is v, and the emulator (epilogue_kernel, and
 * cuBLASLt's stand-in, both applying nb_gelu's formula of
 * tensor/op_table.h) gives the same bits; a real cuBLASLt's own GELU may
 * differ from that formula in the last bits, which no check here reaches.
 * Only the weight's gradient g^T h sees any of it (h's gradient goes
 * through pre either way), as the DGELU epilogue already takes GELU's
 * slope at the rounded pre.
 * Any other consumer of h that reads it keeps it alive, as before (then
 * nothing is saved, and the recomputation still gives the same values). */
#include <limits.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

static void matmul_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void matmul_bias_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);

/* bias: NULL, or (N) of the output's dtype or f32, added by the GEMM
 * (nb__linear checked it). back: NULL, or a backward's epilogue (dgelu_pre,
 * bgrad; grad mode is off there). */
static nb_tensor *matmul_impl_ex(nb_ctx *ctx, const char *name, nb_tensor *a, nb_tensor *b,
                                 bool ta, bool tb, nb_tensor *bias, nb_tensor **pre, bool wide,
                                 const nb__gemm_epilogue *back);

static nb_tensor *matmul_impl(nb_ctx *ctx, const char *name, nb_tensor *a, nb_tensor *b, bool ta,
                              bool tb, nb_tensor *bias) {
    return matmul_impl_ex(ctx, name, a, b, ta, tb, bias, NULL, false, NULL);
}

static int epilogues_forced = -1;

void nb__gemm_epilogues_force(int on) { epilogues_forced = on; }

/* Note [GEMM epilogues in backward]: whether t's backend takes them. */
static bool epilogues_on(const nb_tensor *t) {
    return epilogues_forced >= 0 ? epilogues_forced != 0 : nb__backend_at(t)->gemm_epilogues;
}

/* The dtype of a product of x-dtype operands in ctx: the compute dtype
 * (f32 when wide) under one, f64 and plain f32 as they are. */
static nb_dtype product_dtype(nb_ctx *ctx, nb_dtype x, bool wide) {
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    return cd == NB_F32 || x == NB_F64 ? x : wide ? NB_F32 : cd;
}

static void linear_gelu_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void linear_residual_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);

/* Note [GELU recomputed in backward]: the pre-activation x is GELU of,
 * when x is the output of nb__linear_gelu_ex with recompute (i[3]), else
 * NULL. */
static nb_tensor *recomputable_from(const nb_tensor *x) {
    const nb_node *n = x->node;
    if (!n || n->backward != linear_gelu_backward || !n->i[3] || n->out != x) return NULL;
    nb_tensor *pre = n->saved[0];
    return nb_same_shape(pre, x) && pre->dtype == x->dtype ? pre : NULL;
}

/* pre: NULL, or where to return the pre-activation of a GELU(tanh)
 * applied after the GEMM (on CUDA in its epilogue); the node then
 * differentiates through the GELU too. wide: under a compute dtype, the
 * output is f32 instead of the compute dtype (the gradient of an f32
 * tensor that was cast, Note [Wide gradients] in autograd/backward.c). */
static nb_tensor *matmul_impl_ex(nb_ctx *ctx, const char *name, nb_tensor *a, nb_tensor *b,
                                 bool ta, bool tb, nb_tensor *bias, nb_tensor **pre, bool wide,
                                 const nb__gemm_epilogue *back) {
    nb__check_ctx(name, ctx, a);
    nb__check_ctx(name, ctx, b);
    const char *sfx_a = ta ? "^T" : "", *sfx_b = tb ? "^T" : "";
    NB_CHECK(a->ndim >= 2 && b->ndim >= 2,
             "%s: operands need at least 2 dims (1-D operands are not promoted), got %s%s @ %s%s",
             name, nb_shape_str(a), sfx_a, nb_shape_str(b), sfx_b);
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    bool mixed = cd != NB_F32;
    if (mixed) { /* a parameter's shadow when it has one (Note [Parameter shadows]) */
        if (a->dtype == NB_F32) a = nb__cast_param(ctx, a, cd);
        if (b->dtype == NB_F32) b = nb__cast_param(ctx, b, cd);
    }
    nb__check_same_dtype(name, a, b);
    nb__check_compute_float(name, ctx, a);
    int na = a->ndim, nbn = b->ndim;
    int64_t m = a->shape[na - (ta ? 1 : 2)], ka = a->shape[na - (ta ? 2 : 1)];
    int64_t kb = b->shape[nbn - (tb ? 1 : 2)], n = b->shape[nbn - (tb ? 2 : 1)];
    NB_CHECK(ka == kb, "%s: inner dimensions differ: %s%s @ %s%s", name, nb_shape_str(a), sfx_a,
             nb_shape_str(b), sfx_b);
    NB_CHECK(m <= INT_MAX && n <= INT_MAX && ka <= INT_MAX,
             "%s: %s%s @ %s%s has a matrix dimension beyond what BLAS takes (%d)", name,
             nb_shape_str(a), sfx_a, nb_shape_str(b), sfx_b, INT_MAX);

    int nd = na > nbn ? na : nbn, nbd = nd - 2;
    int64_t shape[NB_MAX_DIMS];
    for (int i = 0; i < nbd; i++) {
        int da = na - 2 - nbd + i, db = nbn - 2 - nbd + i;
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        NB_CHECK(sa == sb || sa == 1 || sb == 1,
                 "%s: batch dimensions do not broadcast: %s%s @ %s%s (batch dim %d: %lld vs %lld)",
                 name, nb_shape_str(a), sfx_a, nb_shape_str(b), sfx_b, i, (long long)sa,
                 (long long)sb);
        shape[i] = sa == 1 ? sb : sa;
    }
    shape[nbd] = m;
    shape[nbd + 1] = n;

    /* f64 operands are not cast and stay f64 (cuBLASLt has no f64 -> f32 GEMM) */
    nb_dtype out_dt = product_dtype(ctx, a->dtype, wide);
    nb_tensor *out = nb__empty(ctx, out_dt, nd, shape);
    const nb__backend *be = nb__backend_at(a);
    nb_tensor *ca = be->gemm_readable(a) ? a : nb__contig(ctx, a);
    nb_tensor *cb = be->gemm_readable(b) ? b : nb__contig(ctx, b);
    nb__gemm_epilogue epi = back ? *back : (nb__gemm_epilogue){0};
    nb_tensor *resid = (nb_tensor *)epi.residual; /* nb__linear_residual checked it */
    if (resid) epi.residual = nb__contig(ctx, resid);
    epi.bias = bias ? nb__contig(ctx, bias) : NULL;
    if (pre) *pre = nb__empty(ctx, out->dtype, out->ndim, out->shape);
    epi.gelu = pre != NULL;
    epi.pre = pre ? *pre : NULL;
    be->matmul(out, ca, cb, ta, tb, &epi);

    /* inputs: a, b, then the bias, then the residual (last) */
    nb_tensor *in[4] = {a, b, bias ? bias : resid, resid};
    int n_in = 2 + (bias != NULL) + (resid != NULL);
    nb_backward_fn bw = resid  ? linear_residual_backward
                        : pre  ? linear_gelu_backward
                        : bias ? matmul_bias_backward
                               : matmul_backward;
    nb_node *node = nb__record(ctx, name, bw, out, n_in, in);
    if (node) {
        node->i[0] = ta;
        node->i[1] = tb;
        if (pre) {
            node->saved[0] = *pre;
            nb__mem_internal(node, *pre);
        }
        nb_tensor *from = ta ? NULL : recomputable_from(a);
        if (from) { /* Note [GELU recomputed in backward] */
            node->saved[1] = from;
            node->unread_in |= 1;
        }
    }
    return out;
}

nb_tensor *nb_matmul(nb_ctx *ctx, nb_tensor *a, nb_tensor *b) {
    return matmul_impl(ctx, "nb_matmul", a, b, false, false, NULL);
}

nb_tensor *nb_matmul_t(nb_ctx *ctx, nb_tensor *a, nb_tensor *b, bool trans_a, bool trans_b) {
    return matmul_impl(ctx, "nb_matmul_t", a, b, trans_a, trans_b, NULL);
}

static int64_t batch_numel(const nb_tensor *t) { return nb__numel_shape(t->ndim - 2, t->shape); }

/* Whether x's gradient goes, wide, to the f32 tensor x was cast from
 * (Note [Wide gradients] in autograd/backward.c): a parameter's, for one. */
static bool cast_of_f32(const nb_tensor *x) {
    return x->node && x->node->backward == nb__cast_backward && x->node->in[0]->dtype == NB_F32 &&
           x->dtype != NB_F32;
}

/* op(x) @ op(y) for the gradient of `of`: in of's compute dtype, or f32
 * when `of` is a cast of an f32 tensor. */
static nb_tensor *grad_product(nb_ctx *ctx, const nb_tensor *of, nb_tensor *x, nb_tensor *y,
                               bool tx, bool ty) {
    return matmul_impl_ex(ctx, "nb_matmul_t", x, y, tx, ty, NULL, NULL, cast_of_f32(of), NULL);
}

/* op(x) flattened to (rows, cols) over its batch dims; copies when the
 * view cannot express it. */
static nb_tensor *flat_op(nb_ctx *ctx, nb_tensor *x, bool trans, int64_t rows, int64_t cols) {
    if (trans) x = nb_transpose(ctx, x, -1, -2);
    return nb_reshape(ctx, x, 2, (int64_t[]){rows, cols});
}

static void matmul_backward_ex(nb_ctx *ctx, nb_node *node, nb_tensor *g, nb_tensor *bgrad);
static void weight_grad(nb_ctx *ctx, nb_node *node, nb_tensor *a, nb_tensor *g, nb_tensor *bgrad);

static void matmul_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    matmul_backward_ex(ctx, node, g, NULL);
}

/* The f32 tensor that takes a bias's gradient summed by the weight's
 * gradient GEMM (Note [GEMM epilogues in backward]), else NULL. */
static nb_tensor *bias_grad_fuses(const nb_node *node, const nb_tensor *g) {
    nb_tensor *bias = node->in[2], *w = node->in[1];
    nb_tensor *bt = cast_of_f32(bias) ? bias->node->in[0] : bias;
    bool ok = epilogues_on(g) && bt->requires_grad && bt->dtype == NB_F32 && bt->ndim == 1 &&
              w->requires_grad && w->ndim == 2 && node->i[1] && g->dtype != NB_F64 &&
              nb__numel_shape(g->ndim - 1, g->shape) <= INT_MAX;
    return ok ? bt : NULL;
}

/* x @ w^T + bias fused (nb__linear): the product's gradients, plus the
 * bias's (g summed over the rows: by the weight's gradient GEMM where the
 * backend takes the epilogue, else by nb__accum_grad's broadcast
 * reduction, which sums a 16-bit g in f32 into the f32 bias). */
static void matmul_bias_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    nb_tensor *bias = node->in[2];
    nb_tensor *bt = bias_grad_fuses(node, g);
    if (bt) { /* a bias with no gradient: its sums written into its memory (Note [Gradients set to none]) */
        nb_tensor *fresh = nb__leaf_grad_fresh(bt, NB_F32);
        nb_tensor *db = fresh ? fresh : nb__empty(ctx, NB_F32, 1, bt->shape);
        matmul_backward_ex(ctx, node, g, db);
        if (!fresh) nb__accum_grad(ctx, bt, db);
        return;
    }
    matmul_backward(ctx, node, g);
    /* summed in f32 straight into an f32 bias that was cast (Note [Wide gradients]) */
    nb__accum_grad(ctx, cast_of_f32(bias) ? bias->node->in[0] : bias, g);
}

/* gelu(x @ w^T + b) fused: the gradient of the pre-activation,
 * g gelu'(pre), goes through the product's and the bias's backward. When
 * the consumer's GEMM already took it through the GELU (i[2], Note [GEMM
 * epilogues in backward]), g is that gradient. */
static void linear_gelu_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    nb_tensor *pre = node->saved[0], *gp = g;
    if (node->i[2]) {
        node->i[2] = 0;
    } else {
        gp = nb__empty(ctx, pre->dtype, pre->ndim, pre->shape);
        nb__backend_at(pre)->gelu_tanh_backward(gp, nb__contig(ctx, g), pre);
    }
    if (node->n_in == 3) matmul_bias_backward(ctx, node, gp);
    else matmul_backward(ctx, node, gp);
}

/* r + (x @ w^T [+ b]) fused (Note [Residual in the GEMM]): r's gradient
 * is g, passed first, as nb_add's backward passes its first input's. */
static void linear_residual_backward(nb_ctx *ctx, nb_node *node, nb_tensor *g) {
    nb__accum_grad(ctx, node->in[node->n_in - 1], g);
    if (node->n_in == 4) matmul_bias_backward(ctx, node, g);
    else matmul_backward(ctx, node, g);
}

/* The pre-activation to take x's gradient through by a DGELU epilogue
 * (Note [GEMM epilogues in backward]): x is the output of
 * nb__linear_gelu, this backward's only use of it, and has no gradient. */
static nb_tensor *gelu_pre_of(const nb_tensor *x) {
    const nb_node *n = x->node;
    if (!n || n->backward != linear_gelu_backward || x->grad || x->priv->bw_pending != 1 ||
        !epilogues_on(x))
        return NULL;
    nb_tensor *pre = n->saved[0];
    return nb_same_shape(pre, x) && nb_is_contiguous(pre) ? pre : NULL;
}

/* out += op(x) @ op(y), out contiguous with the product's shape, where
 * the backend's GEMM accumulates (a leaf's gradient: Note [Gradients added
 * in place] in autograd/backward.c), or out = op(x) @ op(y) (beta = 0)
 * when out is a leaf's fresh gradient (Note [Gradients set to none]);
 * bgrad: NULL, or op(x)'s row sums written there (Note [GEMM epilogues in
 * backward]). */
static void matmul_into(nb_ctx *ctx, nb_tensor *out, bool add, nb_tensor *x, nb_tensor *y, bool tx,
                        bool ty, nb_tensor *bgrad) {
    const nb__backend *be = nb__backend_at(out);
    nb_tensor *cx = be->gemm_readable(x) ? x : nb__contig(ctx, x);
    nb_tensor *cy = be->gemm_readable(y) ? y : nb__contig(ctx, y);
    be->matmul(out, cx, cy, tx, ty, &(nb__gemm_epilogue){.accumulate = add, .bgrad = bgrad});
}

/* Note [Gradients added in place] and Note [Gradients set to none] in
 * autograd/backward.c: leaf b's gradient memory for a product of dtype
 * dt, *add telling whether to add into it (it holds a gradient) or write
 * it (fresh); NULL when neither */
static nb_tensor *weight_grad_dest(nb_tensor *b, nb_dtype dt, bool *add) {
    nb_tensor *fresh = nb__leaf_grad_fresh(b, dt);
    *add = fresh == NULL;
    return fresh ? fresh : nb__leaf_grad_target(b, dt);
}

/* Runs with grad mode off (Note [Tape]), so the ops below record nothing.
 * bgrad: NULL, or the (N) f32 vector the weight's gradient GEMM writes
 * the bias's gradient into (bias_grad_fuses said so: b is a 2-D weight
 * used transposed). */
static void matmul_backward_ex(nb_ctx *ctx, nb_node *node, nb_tensor *g, nb_tensor *bgrad) {
    nb_tensor *a = node->in[0], *b = node->in[1];
    bool ta = node->i[0] != 0, tb = node->i[1] != 0;
    /* under a compute dtype both products would cast g: cast it once */
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    if (cd != NB_F32 && g->dtype == NB_F32 && a->requires_grad && b->requires_grad)
        g = nb_cast(ctx, g, cd);
    if (a->requires_grad) {
        nb_tensor *pre = ta || a->ndim != g->ndim ? NULL : gelu_pre_of(a);
        nb_dtype gd = cd != NB_F32 && g->dtype == NB_F32 ? cd : g->dtype; /* as the product casts */
        if (pre && product_dtype(ctx, gd, false) == pre->dtype) {
            nb_tensor *ga = matmul_impl_ex(ctx, "nb_matmul_t", g, b, false, !tb, NULL, NULL, false,
                                           &(nb__gemm_epilogue){.dgelu_pre = pre});
            nb__accum_grad(ctx, a, ga);
            a->node->i[2] = 1; /* a's gradient is its pre-activation's */
        } else {
            nb_tensor *ga = ta ? grad_product(ctx, a, b, g, tb, true) : grad_product(ctx, a, g, b, false, !tb);
            nb__accum_grad(ctx, a, ga);
        }
    }
    if (b->requires_grad) {
        /* Note [GELU recomputed in backward]: a's values made again */
        nb_tensor *av = node->unread_in & 1 ? nb__unary(ctx, NB_U_GELU_TANH, node->saved[1], 0) : a;
        weight_grad(ctx, node, av, g, bgrad);
        if (av != a) nb__give_back_now(av);
    }
}

/* b's gradient for matmul_backward_ex, a's values read from a (node's
 * in[0] itself, or its values made again). */
static void weight_grad(nb_ctx *ctx, nb_node *node, nb_tensor *a, nb_tensor *g, nb_tensor *bgrad) {
    nb_tensor *b = node->in[1];
    bool ta = node->i[0] != 0, tb = node->i[1] != 0;
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    nb_tensor *gb;
    int64_t batch = batch_numel(g);
    /* Note [Gradients added in place]: a weight (or the weight a cast
     * to the compute dtype came from) whose gradient exists, in the
     * products' dtype pd */
    bool direct = nb__backend_at(g)->gemm_accumulate;
    nb_dtype pd = cd != NB_F32 && g->dtype != NB_F64 ? NB_F32 : g->dtype;
    if (direct && cd != NB_F32 && g->dtype == NB_F32) g = nb_cast(ctx, g, cd); /* as a product would */
    if ((batch > 1 && batch_numel(b) == 1) || bgrad) {
        int64_t m = g->shape[g->ndim - 2], n = g->shape[g->ndim - 1];
        int64_t k = a->shape[a->ndim - (ta ? 2 : 1)];
        nb_tensor *fa = flat_op(ctx, a, ta, batch * m, k);
        nb_tensor *fg = flat_op(ctx, g, false, batch * m, n);
        bool add = true;
        nb_tensor *dst =
            direct && b->ndim == 2 && batch * m <= INT_MAX ? weight_grad_dest(b, pd, &add) : NULL;
        if (dst) {
            if (tb) matmul_into(ctx, dst, add, fg, fa, true, false, bgrad);
            else matmul_into(ctx, dst, add, fa, fg, true, false, NULL);
            return;
        }
        if (bgrad) /* tb (bias_grad_fuses): the bias's sums are op(fg^T)'s rows' */
            gb = matmul_impl_ex(ctx, "nb_matmul_t", fg, fa, true, false, NULL, NULL,
                                cast_of_f32(b), &(nb__gemm_epilogue){.bgrad = bgrad});
        else
            gb = tb ? grad_product(ctx, b, fg, fa, true, false) : grad_product(ctx, b, fa, fg, true, false);
        gb = nb_reshape(ctx, gb, b->ndim, b->shape);
    } else {
        bool same_batch = b->ndim == g->ndim;
        for (int d = 0; same_batch && d < g->ndim - 2; d++) same_batch = b->shape[d] == g->shape[d];
        bool add = true;
        nb_tensor *dst = direct && same_batch ? weight_grad_dest(b, pd, &add) : NULL;
        if (dst) {
            if (tb) matmul_into(ctx, dst, add, g, a, true, ta, NULL);
            else matmul_into(ctx, dst, add, a, g, !ta, false, NULL);
            return;
        }
        gb = tb ? grad_product(ctx, b, g, a, true, ta) : grad_product(ctx, b, a, g, !ta, false);
    }
    nb__accum_grad(ctx, b, gb);
}

/* Whether b (N) can ride x @ w^T's GEMM: the output's dtype (or f32 for
 * a 16-bit output: added to the GEMM's f32 sums), device and width. */
static bool bias_fuses(nb_ctx *ctx, const nb_tensor *x, const nb_tensor *w, const nb_tensor *b) {
    nb_dtype out_dt = product_dtype(ctx, x->dtype, false);
    bool dt_ok = b && (b->dtype == out_dt || (b->dtype == NB_F32 && nb_dtype_size(out_dt) == 2));
    return x->ndim >= 2 && w->ndim == 2 &&
           (!b || (b->ndim == 1 && b->shape[0] == w->shape[0] && dt_ok &&
                   nb_device_eq(b->device, x->device)));
}

/* The bias as the GEMM takes it: an f32 bias as it is (bias_fuses), else
 * cast to the output's dtype under a compute dtype (a recorded cast, so
 * its gradient reaches the f32 master wide), as the weight is. */
static nb_tensor *bias_for(nb_ctx *ctx, const nb_tensor *x, const nb_tensor *w, nb_tensor *b) {
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    if (b && cd != NB_F32 && b->dtype == NB_F32 && x->dtype != NB_F64 && !bias_fuses(ctx, x, w, b))
        return nb_cast(ctx, b, cd);
    return b;
}

nb_tensor *nb__linear(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b) {
    if (!b) return nb_matmul_t(ctx, x, w, false, true);
    b = bias_for(ctx, x, w, b);
    if (bias_fuses(ctx, x, w, b)) return matmul_impl(ctx, "nb_linear", x, w, false, true, b);
    return nb_add(ctx, nb_matmul_t(ctx, x, w, false, true), b);
}

nb_tensor *nb__linear_gelu_ex(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b,
                              bool recompute) {
    b = bias_for(ctx, x, w, b);
    if (bias_fuses(ctx, x, w, b)) {
        nb_tensor *pre = NULL;
        nb_tensor *h = matmul_impl_ex(ctx, "nb_linear_gelu", x, w, false, true, b, &pre, false, NULL);
        if (h->node) h->node->i[3] = recompute; /* Note [GELU recomputed in backward] */
        return h;
    }
    return nb_gelu(ctx, nb__linear(ctx, x, w, b), NB_GELU_TANH); /* h kept by its consumers */
}

nb_tensor *nb__linear_gelu(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b) {
    return nb__linear_gelu_ex(ctx, x, w, b, false);
}

/* Whether r can be added by x @ w^T's GEMM: the product's shape, dtype
 * (after the casts a compute dtype makes) and device. */
static bool residual_fuses(nb_ctx *ctx, const nb_tensor *x, const nb_tensor *w,
                           const nb_tensor *r) {
    nb_dtype cd = nb_ctx_compute_dtype(ctx);
    nb_dtype xd = cd != NB_F32 && x->dtype == NB_F32 ? cd : x->dtype;
    if (x->ndim < 2 || w->ndim != 2 || r->ndim != x->ndim || r->dtype != product_dtype(ctx, xd, false) ||
        !nb_device_eq(r->device, x->device) || r->shape[r->ndim - 1] != w->shape[0])
        return false;
    for (int d = 0; d < x->ndim - 1; d++)
        if (r->shape[d] != x->shape[d]) return false;
    return true;
}

static bool residual_fusion = true;

void nb__linear_residual_fuse(bool on) { residual_fusion = on; }

nb_tensor *nb__linear_residual(nb_ctx *ctx, nb_tensor *x, nb_tensor *w, nb_tensor *b,
                               nb_tensor *r) {
    if (!residual_fusion || !residual_fuses(ctx, x, w, r))
        return nb_add(ctx, r, nb__linear(ctx, x, w, b));
    b = bias_for(ctx, x, w, b);
    if (!bias_fuses(ctx, x, w, b)) /* as nb__linear, then the add */
        return nb_add(ctx, r, nb_add(ctx, nb_matmul_t(ctx, x, w, false, true), b));
    nb__check_ctx("nb_linear", ctx, r);
    return matmul_impl_ex(ctx, "nb_linear", x, w, false, true, b, NULL, false,
                          &(nb__gemm_epilogue){.residual = r});
}
