/* Elementwise ops: front ends (checks, broadcasting, dispatch) and their
 * backward functions, and the unrecorded nb__unary / nb__binary that
 * backward functions and optimizers use. The CPU kernels are in
 * tensor/cpu/elementwise.c. */
#include <stdlib.h>

#include "tensor/backend.h"
#include "tensor/internal.h"

/* ---- names, from the tables (Note [Op tables] in tensor/op_table.h) ---- */
#define UNARY_NAME(E, f, name) [NB_U_##E] = name,
#define BINARY_NAME(E, f, name) [NB_B_##E] = name,
static const char *const unary_names[] = {NB_UNARY_OPS(UNARY_NAME)};
static const char *const binary_names[] = {NB_BINARY_OPS(BINARY_NAME)};
_Static_assert(sizeof unary_names / sizeof unary_names[0] == NB_U_COUNT,
               "one name per unary op");
_Static_assert(sizeof binary_names / sizeof binary_names[0] == NB_B_COUNT,
               "one name per binary op");

const char *nb__unary_name(nb__unary_op op) {
    return (unsigned)op < NB_U_COUNT ? unary_names[op] : "elementwise op";
}

const char *nb__binary_name(nb__binary_op op) {
    return (unsigned)op < NB_B_COUNT ? binary_names[op] : "elementwise op";
}

/* ---- unrecorded helpers for backward functions and optimizers: the
 * backend of a's device does the work ---- */
nb_tensor *nb__unary(nb_ctx *ctx, nb__unary_op op, nb_tensor *a, double s) {
    nb_tensor *out = nb__empty(ctx, a->dtype, a->ndim, a->shape);
    nb__run_unary(op, out, a, s);
    return out;
}

nb_tensor *nb__binary(nb_ctx *ctx, nb__binary_op op, nb_tensor *a, nb_tensor *b) {
    int64_t shape[NB_MAX_DIMS];
    int nd = nb__broadcast_shape("elementwise op", a, b, shape);
    nb__check_same_dtype("elementwise op", a, b);
    nb_tensor *out = nb__empty(ctx, a->dtype, nd, shape);
    nb__run_binary(op, out, a, b);
    return out;
}

/* ---- binary ---- */
static void add_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void sub_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void div_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void pass_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void scale_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void neg_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void exp_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void sqrt_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void rsqrt_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void tanh_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void sigmoid_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);
static void relu_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g);

static nb_tensor *binary(nb_ctx *ctx, const char *name, nb__binary_op op, nb_tensor *a,
                         nb_tensor *b, nb_backward_fn bw) {
    nb__check_ctx(name, ctx, a);
    nb__check_same_dtype(name, a, b);
    if (a->dtype == NB_BF16 || a->dtype == NB_F16) nb__check_compute_float(name, ctx, a);
    int64_t shape[NB_MAX_DIMS];
    int nd = nb__broadcast_shape(name, a, b, shape);
    nb_tensor *out = nb__empty(ctx, a->dtype, nd, shape);
    nb__run_binary(op, out, a, b);
    nb_tensor *in[2] = {a, b};
    nb_node *n = nb__record(ctx, name, bw, out, 2, in);
    /* Note [Memory given back]: what each backward reads */
    if (bw == add_backward || bw == sub_backward) nb__node_reads(n, 0);
    else if (bw == div_backward) nb__node_reads(n, NB__READS_IN | NB__READS_OUT);
    return out;
}

/* Note [Integer division]: nb_div of i32 or i64 tensors truncates toward
 * zero, as C does. A zero divisor is a programmer error naming the op and
 * the element, on every device, as PyTorch's CPU integer division raises
 * ZeroDivisionError; the hardware alternative is SIGFPE on the CPU and an
 * unspecified number on a GPU. The divisor is read on the host to find it
 * (for a tensor in device memory that is a copy and a wait; integer
 * division is rare and its tensors small). INT_MIN / -1, the other quotient
 * the CPU traps on, wraps to INT_MIN, as PyTorch's integer division does
 * (tensor/cpu/elementwise.c). */
static void check_int_divisor(const nb_tensor *a, const nb_tensor *b) {
    nb__check_live("nb_div", b);
    if (b->dtype != a->dtype) return; /* binary() names the dtypes */
    int64_t n = nb_numel(b);
    if (n == 0) return;
    size_t size = nb_dtype_size(b->dtype);
    char *host = malloc((size_t)n * size);
    NB_CHECK(host, "nb_div: out of host memory reading the divisor %s", nb_shape_str(b));
    nb_to_host(b, host);
    int64_t zero = -1;
    for (int64_t i = 0; i < n && zero < 0; i++) {
        int64_t v = b->dtype == NB_I32 ? ((const int32_t *)host)[i] : ((const int64_t *)host)[i];
        if (v == 0) zero = i;
    }
    free(host);
    if (zero < 0) return;
    int64_t index[NB_MAX_DIMS], rest = zero;
    for (int d = b->ndim - 1; d >= 0; d--) {
        index[d] = rest % b->shape[d];
        rest /= b->shape[d];
    }
    NB_ABORT("nb_div: integer division by zero: the divisor (%s %s) is 0 at index %s (dividend "
             "%s); cast both to a float type for IEEE results (inf, nan)",
             nb_dtype_name(b->dtype), nb_shape_str(b), nb__shape_str_n(b->ndim, index),
             nb_shape_str(a));
}

static void add_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb__accum_grad(ctx, n->in[0], g);
    nb__accum_grad(ctx, n->in[1], g);
}

static void sub_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb__accum_grad(ctx, n->in[0], g);
    if (n->in[1]->requires_grad) nb__accum_grad(ctx, n->in[1], nb__unary(ctx, NB_U_NEG, g, 0));
}

static void mul_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    if (n->in[0]->requires_grad) nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, n->in[1]));
    if (n->in[1]->requires_grad) nb__accum_grad(ctx, n->in[1], nb__binary(ctx, NB_B_MUL, g, n->in[0]));
}

static void div_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *a = n->in[0], *b = n->in[1];
    nb_tensor *gb = nb__binary(ctx, NB_B_DIV, g, b); /* g / b */
    if (a->requires_grad) nb__accum_grad(ctx, a, gb);
    if (b->requires_grad) { /* -g a / b^2 = -(g / b) * out */
        nb_tensor *t = nb__binary(ctx, NB_B_MUL, gb, n->out);
        nb__accum_grad(ctx, b, nb__unary(ctx, NB_U_NEG, t, 0));
    }
}

nb_tensor *nb_add(nb_ctx *ctx, nb_tensor *a, nb_tensor *b) { return binary(ctx, "nb_add", NB_B_ADD, a, b, add_backward); }
nb_tensor *nb_sub(nb_ctx *ctx, nb_tensor *a, nb_tensor *b) { return binary(ctx, "nb_sub", NB_B_SUB, a, b, sub_backward); }
nb_tensor *nb_mul(nb_ctx *ctx, nb_tensor *a, nb_tensor *b) { return binary(ctx, "nb_mul", NB_B_MUL, a, b, mul_backward); }
nb_tensor *nb_div(nb_ctx *ctx, nb_tensor *a, nb_tensor *b) {
    if (a->dtype == NB_I32 || a->dtype == NB_I64) check_int_divisor(a, b);
    return binary(ctx, "nb_div", NB_B_DIV, a, b, div_backward);
}

/* ---- unary ---- */
static nb_tensor *unary(nb_ctx *ctx, const char *name, nb__unary_op op, nb_tensor *a, double s,
                        nb_backward_fn bw) {
    nb__check_ctx(name, ctx, a);
    nb__check_compute_float(name, ctx, a);
    nb_tensor *out = nb__empty(ctx, a->dtype, a->ndim, a->shape);
    nb__run_unary(op, out, a, s);
    nb_node *n = nb__record(ctx, name, bw, out, 1, &a);
    if (n) n->f[0] = s;
    /* Note [Memory given back]: what each backward reads */
    if (bw == pass_backward || bw == scale_backward || bw == neg_backward) nb__node_reads(n, 0);
    else if (bw == exp_backward || bw == sqrt_backward || bw == rsqrt_backward ||
             bw == tanh_backward || bw == sigmoid_backward || bw == relu_backward)
        nb__node_reads(n, NB__READS_OUT);
    return out;
}

static void pass_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { nb__accum_grad(ctx, n->in[0], g); }

static void scale_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb__accum_grad(ctx, n->in[0], nb__unary(ctx, NB_U_MUL_S, g, n->f[0]));
}

static void neg_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb__accum_grad(ctx, n->in[0], nb__unary(ctx, NB_U_NEG, g, 0));
}

/* g * f(x) for a derivative f computed from the input */
static void grad_times_unary_of_input(nb_ctx *ctx, nb_node *n, nb_tensor *g, nb__unary_op f, double s) {
    nb_tensor *d = nb__unary(ctx, f, n->in[0], s);
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, d));
}

static void pow_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    double p = n->f[0];
    nb_tensor *d = nb__unary(ctx, NB_U_POW, n->in[0], p - 1.0);
    d = nb__unary(ctx, NB_U_MUL_S, d, p);
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, d));
}

static void exp_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, n->out));
}

static void log_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_DIV, g, n->in[0]));
}

static void sqrt_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { /* g / (2 sqrt x) */
    nb_tensor *t = nb__binary(ctx, NB_B_DIV, g, n->out);
    nb__accum_grad(ctx, n->in[0], nb__unary(ctx, NB_U_MUL_S, t, 0.5));
}

static void rsqrt_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { /* -g/2 * out^3 */
    nb_tensor *c = nb__unary(ctx, NB_U_POW, n->out, 3.0);
    c = nb__unary(ctx, NB_U_MUL_S, c, -0.5);
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, c));
}

static void abs_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { grad_times_unary_of_input(ctx, n, g, NB_U_SIGN, 0); }
/* out > 0 exactly where x > 0 (NaN and -0 included), so the mask comes from
 * the output, which the next op keeps anyway (pooling, a product), and the
 * input can be given back (Note [Memory given back]). */
static void relu_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *d = nb__unary(ctx, NB_U_RELU_MASK, n->out, 0);
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, d));
}
static void gelu_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { grad_times_unary_of_input(ctx, n, g, NB_U_GELU_GRAD, 0); }
static void gelu_tanh_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *x = n->in[0];
    if (x->dtype == NB_F32 && nb_is_contiguous(x) && nb_is_contiguous(g)) {
        nb_tensor *dx = nb__empty(ctx, x->dtype, x->ndim, x->shape); /* one pass on the CPU */
        nb__backend_at(x)->gelu_tanh_backward(dx, g, x);
        nb__accum_grad(ctx, x, dx);
        return;
    }
    grad_times_unary_of_input(ctx, n, g, NB_U_GELU_TANH_GRAD, 0);
}

static void tanh_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { /* g (1 - out^2) */
    nb_tensor *sq = nb__binary(ctx, NB_B_MUL, n->out, n->out);
    nb_tensor *d = nb__unary(ctx, NB_U_ADD_S, nb__unary(ctx, NB_U_NEG, sq, 0), 1.0);
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, d));
}

static void sigmoid_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) { /* g out (1 - out) */
    nb_tensor *one_minus = nb__unary(ctx, NB_U_ADD_S, nb__unary(ctx, NB_U_NEG, n->out, 0), 1.0);
    nb_tensor *d = nb__binary(ctx, NB_B_MUL, n->out, one_minus);
    nb__accum_grad(ctx, n->in[0], nb__binary(ctx, NB_B_MUL, g, d));
}

nb_tensor *nb_add_scalar(nb_ctx *ctx, nb_tensor *a, double s) { return unary(ctx, "nb_add_scalar", NB_U_ADD_S, a, s, pass_backward); }
nb_tensor *nb_sub_scalar(nb_ctx *ctx, nb_tensor *a, double s) { return unary(ctx, "nb_sub_scalar", NB_U_ADD_S, a, -s, pass_backward); }
nb_tensor *nb_mul_scalar(nb_ctx *ctx, nb_tensor *a, double s) { return unary(ctx, "nb_mul_scalar", NB_U_MUL_S, a, s, scale_backward); }
nb_tensor *nb_div_scalar(nb_ctx *ctx, nb_tensor *a, double s) {
    NB_CHECK(s != 0, "nb_div_scalar: division by zero (tensor %s)", nb_shape_str(a));
    return unary(ctx, "nb_div_scalar", NB_U_MUL_S, a, 1.0 / s, scale_backward);
}
nb_tensor *nb_neg(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_neg", NB_U_NEG, a, 0, neg_backward); }
nb_tensor *nb_pow(nb_ctx *ctx, nb_tensor *a, double p) { return unary(ctx, "nb_pow", NB_U_POW, a, p, pow_backward); }
nb_tensor *nb_exp(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_exp", NB_U_EXP, a, 0, exp_backward); }
nb_tensor *nb_log(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_log", NB_U_LOG, a, 0, log_backward); }
nb_tensor *nb_sqrt(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_sqrt", NB_U_SQRT, a, 0, sqrt_backward); }
nb_tensor *nb_rsqrt(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_rsqrt", NB_U_RSQRT, a, 0, rsqrt_backward); }
nb_tensor *nb_abs(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_abs", NB_U_ABS, a, 0, abs_backward); }
nb_tensor *nb_tanh(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_tanh", NB_U_TANH, a, 0, tanh_backward); }
nb_tensor *nb_sigmoid(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_sigmoid", NB_U_SIGMOID, a, 0, sigmoid_backward); }
nb_tensor *nb_relu(nb_ctx *ctx, nb_tensor *a) { return unary(ctx, "nb_relu", NB_U_RELU, a, 0, relu_backward); }
nb_tensor *nb_gelu(nb_ctx *ctx, nb_tensor *a, nb_gelu_approx approx) {
    NB_CHECK(approx == NB_GELU_EXACT || approx == NB_GELU_TANH, "nb_gelu: unknown approximation %d", (int)approx);
    if (approx == NB_GELU_TANH) return unary(ctx, "nb_gelu", NB_U_GELU_TANH, a, 0, gelu_tanh_backward);
    return unary(ctx, "nb_gelu", NB_U_GELU, a, 0, gelu_backward);
}

/* ---- where / masked fill ---- */
static void where_backward(nb_ctx *ctx, nb_node *n, nb_tensor *g) {
    nb_tensor *cond = n->saved[0], *a = n->in[0], *b = n->in[1];
    nb_tensor *zero = nb_zeros(ctx, g->dtype, 0, NULL);
    if (a->requires_grad) {
        nb_tensor *ga = nb__empty(ctx, g->dtype, g->ndim, g->shape);
        nb__run_where(ga, cond, g, zero);
        nb__accum_grad(ctx, a, ga);
    }
    if (b->requires_grad) {
        nb_tensor *gb = nb__empty(ctx, g->dtype, g->ndim, g->shape);
        nb__run_where(gb, cond, zero, g);
        nb__accum_grad(ctx, b, gb);
    }
}

static nb_tensor *where_impl(nb_ctx *ctx, const char *name, nb_tensor *cond, nb_tensor *a,
                             nb_tensor *b) {
    nb__check_ctx(name, ctx, a);
    nb__check_ctx(name, ctx, cond);
    nb__check_same_dtype(name, a, b);
    int64_t s1[NB_MAX_DIMS], shape[NB_MAX_DIMS];
    int nd1 = nb__broadcast_shape(name, cond, a, s1);
    nb_tensor tmp = {0};
    tmp.ndim = nd1;
    for (int d = 0; d < nd1; d++) tmp.shape[d] = s1[d];
    int nd = nb__broadcast_shape(name, &tmp, b, shape);
    nb_tensor *out = nb__empty(ctx, a->dtype, nd, shape);
    nb__run_where(out, cond, a, b);
    nb_tensor *in[2] = {a, b};
    nb_node *n = nb__record(ctx, name, where_backward, out, 2, in);
    if (n) n->saved[0] = cond;
    return out;
}

nb_tensor *nb_where(nb_ctx *ctx, nb_tensor *cond, nb_tensor *a, nb_tensor *b) {
    return where_impl(ctx, "nb_where", cond, a, b);
}

nb_tensor *nb_masked_fill(nb_ctx *ctx, nb_tensor *x, nb_tensor *mask, double value) {
    nb__check_ctx("nb_masked_fill", ctx, x);
    int64_t shape[NB_MAX_DIMS];
    int nd = nb__broadcast_shape("nb_masked_fill", mask, x, shape);
    NB_CHECK(nd == x->ndim && nb__numel_shape(nd, shape) == nb_numel(x),
             "nb_masked_fill: mask %s does not broadcast to the input's shape %s", nb_shape_str(mask),
             nb_shape_str(x));
    nb_tensor *fill = nb_full(ctx, x->dtype, 0, NULL, value);
    return where_impl(ctx, "nb_masked_fill", mask, fill, x);
}
