/* The meta device (include/nabla/meta.h): two backend tables, meta:cpu and
 * meta:cuda, whose kernel entries record what the call would move and
 * compute instead of running it, and whose memory is address space that is
 * never touched.
 *
 * Note [Meta device]
 * The front end decides everything that shapes a step from the backend's
 * flags (tensor/backend.h): which dtypes the products take and return,
 * whether a gradient is added into a leaf in place, whether the fused
 * attention runs, whether logits are overwritten by their gradient. Each
 * meta table copies the flags of the backend it stands for (the CPU's
 * from nb__cpu_backend, CUDA's from tensor/cuda/flags.h, which the CUDA
 * table reads too, so this works in a build without CUDA), so the front
 * end makes the same calls, in the same dtypes, on the same shapes, and
 * allocates the same tensors: nb_ctx_peak of a meta context is the real
 * path's. Where a kernel entry allocates in its context (cross-entropy's
 * saved log-sum-exp, scratch), the meta entry allocates what that
 * backend's entry does: exactly for the CPU (attention's per-thread blocks,
 * layer norm's sums, im2col), and for CUDA the tensors it keeps; CUDA's
 * transient scratch (reduction partials, the embedding sort's buffers, a
 * few hundred KB at GPT-2's shapes) is not counted.
 * The arena's blocks are PROT_NONE mappings with MAP_NORESERVE: they cost
 * address space only, and a stray host access faults at once instead of
 * reading something. Host reads of values abort naming the op
 * (nb__meta_no_values), through the flag `meta` that tensor/tensor.c and
 * tensor/print.c test before touching data.
 * Launch counts for meta:cuda come from tensor/cuda/launches.h (one row
 * per entry, with the kernels named), plus what depends on the shapes,
 * computed here as the CUDA code does: the GEMM's batch split, the split
 * reduction, the multi-tensor batching, the radix sort's passes. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "tensor/backend.h"
#include "tensor/cpu/attention.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/matmul.h"
#include "tensor/cuda/flags.h"
#include "tensor/cuda/launches.h"
#include "tensor/gemm_layout.h"
#include "tensor/internal.h"

/* ------------------------------------------------------------ the GPUs */
static const nb_meta_gpu gpus[] = {
    {"h100", "NVIDIA H100 SXM5 80GB", 3.35e12, 989e12, 494.5e12, 66.9e12, 80e9,
     "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s HBM3; dense BF16 989.5, TF32 494.7, "
     "FP32 66.9 TFLOPS)"},
    {"h200", "NVIDIA H200 SXM 141GB", 4.8e12, 989e12, 494.5e12, 66.9e12, 141e9,
     "NVIDIA H200 Tensor Core GPU datasheet (SXM: 4.8 TB/s HBM3e; dense BF16 989.5, TF32 494.7, "
     "FP32 66.9 TFLOPS)"},
    {"a100", "NVIDIA A100 SXM4 80GB", 2.039e12, 312e12, 156e12, 19.5e12, 80e9,
     "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 2.039 TB/s HBM2e; dense BF16 312, TF32 "
     "156, FP32 19.5 TFLOPS)"},
};

const nb_meta_gpu *nb_meta_gpus(int *n) {
    if (n) *n = (int)(sizeof gpus / sizeof gpus[0]);
    return gpus;
}

const nb_meta_gpu *nb_meta_gpu_find(const char *name) {
    for (size_t i = 0; name && i < sizeof gpus / sizeof gpus[0]; i++)
        if (!strcmp(gpus[i].name, name)) return &gpus[i];
    return NULL;
}

/* ------------------------------------------------------------ counters */
#define MAX_ENTRIES 256

static struct {
    nb_meta_entry e[MAX_ENTRIES];
    char names[MAX_ENTRIES][48];
    int n;
    nb_meta_entry total;
    const nb_meta_gpu *gpu;
    FILE *trace;
} rec = {.total = {.name = "total"}};

void nb_meta_set_gpu(const nb_meta_gpu *gpu) { rec.gpu = gpu; }
void nb_meta_trace(FILE *f) { rec.trace = f; }

void nb_meta_reset(void) {
    rec.n = 0;
    memset(&rec.total, 0, sizeof rec.total);
    rec.total.name = "total";
}

nb_meta_entry nb_meta_total(void) { return rec.total; }

int nb_meta_entries(nb_meta_entry *out, int cap) {
    for (int i = 0; i < rec.n && i < cap; i++) out[i] = rec.e[i];
    return rec.n;
}

static nb_meta_entry *entry(const char *name, const char *sub) {
    char key[48];
    snprintf(key, sizeof key, "%s%s%s", name, sub ? "." : "", sub ? sub : "");
    for (int i = 0; i < rec.n; i++)
        if (!strcmp(rec.names[i], key)) return &rec.e[i];
    NB_CHECK(rec.n < MAX_ENTRIES, "meta device: more than %d distinct entries", MAX_ENTRIES);
    int i = rec.n++;
    snprintf(rec.names[i], sizeof rec.names[i], "%s", key);
    memset(&rec.e[i], 0, sizeof rec.e[i]);
    rec.e[i].name = rec.names[i];
    return &rec.e[i];
}

/* The product's peak on the GPU: bf16/f16 tensor cores, tf32 when allowed,
 * else f32 (f64 at half that: below any GPU's f64 rate only on the data
 * centre parts, which this table does not list). */
static double gemm_peak(const nb_meta_gpu *g, nb_dtype dt) {
    if (dt == NB_BF16 || dt == NB_F16) return g->bf16_flops;
    if (dt == NB_F32) return nb_cuda_allow_tf32() ? g->tf32_flops : g->f32_flops;
    return g->f32_flops / 2;
}

/* t's bytes: its elements along the dims it does not broadcast (stride
 * 0: the same memory again) */
static size_t tbytes(const nb_tensor *t) {
    if (!t) return 0;
    size_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        if (t->strides[d] != 0 || t->shape[d] == 0) n *= (size_t)t->shape[d];
    return n * nb_dtype_size(t->dtype);
}

/* One call: the tensors it reads and writes (NULL ones skipped; bytes
 * counted per tensor, whole, a broadcast view by its own elements: tbytes),
 * plus extra bytes (memsets, raw buffers). */
typedef struct call {
    const char *name, *sub;
    const nb_tensor *r[8], *w[4];
    double extra_bytes, flops, gemm_flops;
    nb_dtype gemm_dtype;
    int64_t launches;
} call;

static void record(const call *c) {
    double bytes = c->extra_bytes;
    for (int i = 0; i < 8; i++) bytes += (double)tbytes(c->r[i]);
    for (int i = 0; i < 4; i++) bytes += (double)tbytes(c->w[i]);
    double us = 0;
    if (rec.gpu) {
        double t = bytes / (rec.gpu->bytes_per_s * NB_META_BW_EFF) +
                   c->gemm_flops / (gemm_peak(rec.gpu, c->gemm_dtype) * NB_META_GEMM_EFF);
        us = 1e6 * t;
        if (us < (double)c->launches * NB_META_LAUNCH_US) us = (double)c->launches * NB_META_LAUNCH_US;
    }
    nb_meta_entry *e = entry(c->name, c->sub);
    nb_meta_entry *all[2] = {e, &rec.total};
    for (int i = 0; i < 2; i++) {
        all[i]->calls++;
        all[i]->launches += c->launches;
        all[i]->bytes += bytes;
        all[i]->flops += c->flops;
        all[i]->gemm_flops += c->gemm_flops;
        all[i]->us += us;
    }
    if (rec.trace) {
        fprintf(rec.trace, "%s%s%s", c->name, c->sub ? "." : "", c->sub ? c->sub : "");
        for (int i = 0; i < 4; i++)
            if (c->w[i])
                fprintf(rec.trace, " w%s%s", nb_shape_str(c->w[i]), nb_dtype_name(c->w[i]->dtype));
        for (int i = 0; i < 8; i++)
            if (c->r[i])
                fprintf(rec.trace, " r%s%s", nb_shape_str(c->r[i]), nb_dtype_name(c->r[i]->dtype));
        fprintf(rec.trace, " bytes=%.0f flops=%.0f gemm_flops=%.0f launches=%lld\n", bytes,
                c->flops, c->gemm_flops, (long long)c->launches);
    }
}

/* Which device a meta call stands for. */
static bool on_cuda(const nb_tensor *t) { return t->device.index == NB_DEVICE_CUDA; }
#define L(t, e) (on_cuda(t) ? (int64_t)NB__CUDA_LAUNCHES_##e : 0)

static const char *op_name(const char *full) { /* "nb_add" -> "add" */
    return strncmp(full, "nb_", 3) ? full : full + 3;
}

static double numel(const nb_tensor *t) { return (double)nb_numel(t); }

void nb__meta_no_values(const char *op, const nb_tensor *t) {
    NB_ABORT("%s: tensor %s %s is on %s, which holds no values: the meta device computes nothing "
             "(it counts bytes, FLOPs, launches and memory; nabla/meta.h). Read values on a real "
             "device",
             op, nb_dtype_name(t->dtype), nb_shape_str(t), nb_device_name(t->device));
}

/* ------------------------------------------------------------ runtime */
/* The blocks handed out, with their sizes for munmap. */
typedef struct mapping {
    void *p;
    size_t bytes;
    struct mapping *next;
} mapping;
static mapping *maps;

static void use(const char *op, int device) { (void)op, (void)device; }
static void sync_device(int device) { (void)device; }

static void *mem_alloc(int device, size_t bytes) {
    (void)device;
    void *p = mmap(NULL, bytes ? bytes : 64, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    mapping *m = p == MAP_FAILED ? NULL : malloc(sizeof *m);
    if (!m) {
        if (p != MAP_FAILED) munmap(p, bytes ? bytes : 64);
        nb_set_error(NB_ERR_NOMEM, "meta device: no address space for %zu bytes", bytes);
        return NULL;
    }
    *m = (mapping){p, bytes ? bytes : 64, maps};
    maps = m;
    return p;
}

static void mem_free(int device, void *p) {
    (void)device;
    for (mapping **m = &maps; *m; m = &(*m)->next)
        if ((*m)->p == p) {
            mapping *dead = *m;
            *m = dead->next;
            munmap(dead->p, dead->bytes);
            free(dead);
            return;
        }
}

static void poison(int device, void *p, size_t bytes) { (void)device, (void)p, (void)bytes; }

static void raw(const char *name, int device, double bytes, int64_t launches) {
    call c = {.name = name, .extra_bytes = bytes};
    c.launches = device == NB_DEVICE_CUDA ? launches : 0;
    record(&c);
}

static void set_bytes(int device, void *dst, int byte, size_t bytes) {
    (void)dst, (void)byte;
    raw("memset", device, (double)bytes, NB__CUDA_LAUNCHES_memset);
}

static void copy_d2d(int device, void *dst, const void *src, size_t bytes) {
    (void)dst, (void)src;
    raw("memcpy", device, 2.0 * (double)bytes, NB__CUDA_LAUNCHES_memcpy);
}

static void copy_h2d(int device, void *dst, const void *src, size_t bytes) {
    (void)dst, (void)src;
    raw("memcpy_h2d", device, (double)bytes, NB__CUDA_LAUNCHES_memcpy);
}

static void copy_h2d_async(int device, void *dst, const void *src, size_t bytes, nb__stream s) {
    (void)s;
    copy_h2d(device, dst, src, bytes);
}

static void copy_d2h(int device, void *dst, const void *src, size_t bytes) {
    (void)dst, (void)src;
    NB_ABORT("meta device (%s): a copy of %zu bytes to the host: the meta device holds no values",
             nb_device_name(nb_meta((nb_device_type)device)), bytes);
}

static nb__stream no_stream(int device) { (void)device; return NULL; }
static nb__event no_event(int device) { (void)device; return NULL; }
static void event_free(nb__event e) { (void)e; }
static void event_record(nb__event e, nb__stream s) { (void)e, (void)s; }
static void stream_wait(nb__stream s, nb__event e) { (void)s, (void)e; }
static void event_wait(nb__event e) { (void)e; }

/* ------------------------------------------------------------ elementwise */
static void meta_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s) {
    (void)s;
    record(&(call){.name = "unary", .sub = op_name(nb__unary_name(op)), .r = {a}, .w = {out},
                   .flops = numel(out), .launches = L(out, unary)});
}

static void meta_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b) {
    record(&(call){.name = "binary", .sub = op_name(nb__binary_name(op)), .r = {a, b}, .w = {out},
                   .flops = numel(out), .launches = L(out, binary)});
}

static void meta_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a,
                       const nb_tensor *b) {
    record(&(call){.name = "where", .r = {cond, a, b}, .w = {out}, .flops = numel(out),
                   .launches = L(out, where)});
}

/* From a host tensor (a fill, or a host copy's upload): writes only. */
static void meta_copy(nb_tensor *dst, const nb_tensor *src) {
    bool host = src->device.type != NB_DEVICE_META;
    char cast[24];
    snprintf(cast, sizeof cast, "%s>%s", nb_dtype_name(src->dtype), nb_dtype_name(dst->dtype));
    record(&(call){.name = host ? "fill" : "copy", .sub = !host && src->dtype != dst->dtype ? cast : NULL,
                   .r = {host ? NULL : src}, .w = {dst}, .launches = L(dst, copy)});
}

static void meta_axpy(nb_tensor *y, double alpha, const nb_tensor *x) {
    (void)alpha;
    record(&(call){.name = "axpy", .r = {y, x}, .w = {y}, .flops = 2 * numel(x),
                   .launches = L(y, axpy)});
}

/* ------------------------------------------------------------ reductions */
/* run_rows in tensor/cuda/reduce.cu: a second launch for the split layout. */
static int64_t rows_launches(const nb_tensor *t, int64_t base, int64_t outer, int64_t inner) {
    if (!on_cuda(t) || outer == 0) return 0;
    return base + (inner > 65536 && outer < 256 ? 1 : 0);
}

static void meta_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner,
                          double scale) {
    (void)scale;
    record(&(call){.name = "sum_rows", .r = {rows}, .w = {out}, .flops = numel(rows),
                   .launches = rows_launches(out, NB__CUDA_LAUNCHES_sum_rows, outer, inner)});
}

static void meta_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer,
                          int64_t inner) {
    record(&(call){.name = "max_rows", .r = {rows}, .w = {out, arg}, .flops = numel(rows),
                   .launches = rows_launches(out, NB__CUDA_LAUNCHES_max_rows, outer, inner)});
}

static void meta_argmax_rows(nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner) {
    record(&(call){.name = "argmax_rows", .r = {rows}, .w = {arg}, .flops = numel(rows),
                   .launches = rows_launches(arg, NB__CUDA_LAUNCHES_argmax_rows, outer, inner)});
}

static void meta_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g,
                                   int64_t outer, int64_t inner) {
    (void)outer, (void)inner;
    record(&(call){.name = "max_rows_backward", .r = {arg, g}, .w = {gp},
                   .launches = L(gp, max_rows_backward)});
}

static void meta_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer,
                          int64_t inner, double denom) {
    (void)denom;
    /* two passes over the rows */
    record(&(call){.name = "var_rows", .r = {rows, rows}, .w = {out, mean},
                   .flops = 3 * numel(rows),
                   .launches = rows_launches(out, NB__CUDA_LAUNCHES_var_rows, outer, inner)});
}

static void meta_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b) {
    (void)kind;
    record(&(call){.name = "pair_loss", .r = {a, b}, .w = {out}, .flops = 3 * numel(a),
                   .launches = rows_launches(out, NB__CUDA_LAUNCHES_pair_loss, 1, nb_numel(a))});
}

/* ------------------------------------------------------------ GEMM */
static bool cuda_gemm_readable(const nb_tensor *t) {
    nb__gemm_layout l;
    int64_t s;
    return t->ndim >= 2 && nb__gemm_layout_of(t, &l) &&
           nb__gemm_flat_stride(t->shape, t->strides, 0, t->ndim - 2, &s);
}

static bool meta_gemm_readable(const nb_tensor *t) {
    return on_cuda(t) ? cuda_gemm_readable(t) : nb__cpu_gemm_readable(t);
}

/* The cublasLtMatmul calls of nb__cuda_gemm (tensor/cuda/matmul.cu): the
 * batch folded into the rows, or dims [j, nbd) as one strided call (in
 * calls of at most 65535) looped over dims [0, j). */
static int64_t gemm_calls(const nb_tensor *out, const nb_tensor *a, const nb_tensor *b,
                          bool trans_a) {
    int nbd = out->ndim - 2;
    int64_t m = out->shape[nbd], batch = nb__numel_shape(nbd, out->shape);
    nb__gemm_layout la, lb;
    if (!nb__gemm_layout_of(a, &la) || !nb__gemm_layout_of(b, &lb)) return 1;
    bool fa = trans_a != la.col_major;
    int64_t sa[NB_MAX_DIMS], sb[NB_MAX_DIMS];
    nb__gemm_batch_strides(a, nbd, sa);
    nb__gemm_batch_strides(b, nbd, sb);
    if (batch > 1 && !fa && nb__gemm_can_fold(nbd, out->shape, sa, sb, la.ld, m)) return 1;
    int j = nbd;
    int64_t ta, tb;
    while (j > 0 && nb__gemm_flat_stride(out->shape, sa, j - 1, nbd, &ta) &&
           nb__gemm_flat_stride(out->shape, sb, j - 1, nbd, &tb))
        j--;
    int64_t inner = nb__numel_shape(nbd - j, out->shape + j);
    int64_t outer = inner ? batch / inner : 0;
    return outer * ((inner + 65534) / 65535);
}

/* Bytes: the operands, the bias (or the bias gradient written), C when
 * it accumulates or is a residual (read once, D apart), D, and the aux
 * matrix (the pre-activation written by GELU_AUX, read by DGELU). FLOPs
 * besides the product: the bias and residual adds, 8 for GELU, 10 for its
 * gradient, one add per summed element of a bias gradient. A residual on
 * the CPU is not in its GEMM: nb__cpu_matmul runs the product and then the
 * add's own kernel, out = r + out (Note [Residual in the GEMM] in
 * tensor/ops_matmul.c), so meta:cpu records those two calls. */
static void meta_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a,
                        bool trans_b, const nb__gemm_epilogue *epi) {
    (void)trans_b;
    nb__gemm_epilogue e = epi ? *epi : (nb__gemm_epilogue){0};
    const nb_tensor *cpu_residual = on_cuda(out) ? NULL : e.residual;
    e.residual = on_cuda(out) ? e.residual : NULL;
    int nbd = out->ndim - 2;
    double mn = numel(out), k = (double)a->shape[a->ndim - (trans_a ? 2 : 1)];
    int64_t launches = 0;
    if (on_cuda(out) && mn > 0) {
        if (k == 0) { /* zeros (+ the epilogue); adding zeros launches nothing */
            launches = (e.bgrad ? NB__CUDA_LAUNCHES_memset : 0) +
                       (e.accumulate ? 0
                                     : NB__CUDA_LAUNCHES_memset +
                                           (e.bias || e.gelu || e.residual ? 1 : 0));
        } else {
            int64_t calls = gemm_calls(out, a, b, trans_a);
            int64_t n = out->shape[nbd + 1], m = out->shape[nbd];
            bool aux_ok = n % 8 == 0 && (m * n) % 8 == 0;
            bool kernel = (e.gelu && e.pre && !aux_ok) || (e.dgelu_pre && !aux_ok);
            launches = calls * (NB__CUDA_LAUNCHES_matmul + (kernel ? 1 : 0));
        }
    } else if (on_cuda(out) && e.bgrad && nb_numel(e.bgrad) > 0) {
        launches = NB__CUDA_LAUNCHES_memset; /* no column to sum: zeros */
    }
    record(&(call){.name = "matmul",
                   .r = {a, b, e.bias, e.accumulate ? out : NULL, e.dgelu_pre, e.residual},
                   .w = {out, e.gelu ? e.pre : NULL, e.bgrad},
                   .flops = (e.bias ? mn : 0) + (e.residual ? mn : 0) + (e.gelu ? 8 * mn : 0) +
                            (e.dgelu_pre ? 10 * mn : 0) + (e.bgrad ? numel(a) : 0),
                   .gemm_flops = 2 * mn * k, .gemm_dtype = a->dtype, .launches = launches});
    if (cpu_residual) meta_binary(NB_B_ADD, out, cpu_residual, out);
}

static void meta_gelu_tanh_backward(nb_tensor *dx, const nb_tensor *g, const nb_tensor *pre) {
    /* CUDA: two kernels (dx = GELU'(pre), then dx *= g); the CPU's f32
     * path is one pass (tensor/cpu/backend.c) */
    bool two = on_cuda(dx) || dx->dtype != NB_F32 || !nb_is_contiguous(g);
    record(&(call){.name = "gelu_tanh_backward", .r = {g, pre, two ? dx : NULL},
                   .w = {dx, two ? dx : NULL}, .flops = 10 * numel(dx),
                   .launches = L(dx, gelu_tanh_backward)});
}

/* ------------------------------------------------------------ softmax family */
static void meta_softmax(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k, int64_t inner,
                         bool take_log) {
    (void)outer, (void)k, (void)inner, (void)take_log;
    record(&(call){.name = "softmax", .r = {x}, .w = {y}, .flops = 5 * numel(x),
                   .launches = L(y, softmax)});
}

static void meta_softmax_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                  int64_t outer, int64_t k, int64_t inner, bool take_log) {
    (void)outer, (void)k, (void)inner, (void)take_log;
    record(&(call){.name = "softmax_backward", .r = {y, g}, .w = {dx}, .flops = 4 * numel(y),
                   .launches = L(dx, softmax_backward)});
}

static void meta_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s,
                                double scale) {
    (void)b, (void)t, (void)s, (void)scale;
    record(&(call){.name = "softmax_causal", .r = {x}, .w = {y}, .flops = 5 * numel(x),
                   .launches = L(y, softmax_causal)});
}

static void meta_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g,
                                         int64_t b, int64_t t, int64_t s, double scale) {
    (void)b, (void)t, (void)s, (void)scale;
    record(&(call){.name = "softmax_causal_backward", .r = {y, g}, .w = {dx},
                   .flops = 4 * numel(y), .launches = L(dx, softmax_causal_backward)});
}

/* Causal products of one (T, T) by (T, D) per head: the lower triangle's
 * T (T + 1) / 2 rows-by-columns, 2 D FLOPs each. */
static double causal_products(const nb_tensor *qkv, int h) {
    double n = (double)qkv->shape[0], t = (double)qkv->shape[1];
    double d = (double)qkv->shape[2] / 3 / h;
    return n * h * t * (t + 1) / 2 * 2 * d;
}

/* The CPU's per-thread blocks (tensor/cpu/attention.c), taken and given back. */
static void attention_scratch(nb_ctx *ctx, const nb_tensor *qkv, int h, int blocks) {
    if (on_cuda(qkv)) return;
    size_t bytes = nb__cpu_attention_scratch_bytes(qkv, h, blocks);
    if (!bytes) return;
    void *p = nb_ctx_alloc(ctx, bytes, 0);
    nb__ctx_scratch_done(ctx, p, bytes);
}

static void meta_causal_attention(nb_ctx *ctx, nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv,
                                  int h, double scale) {
    (void)scale;
    attention_scratch(ctx, qkv, h, 1);
    double t = (double)qkv->shape[1];
    record(&(call){.name = "causal_attention", .r = {qkv}, .w = {y, lse},
                   .flops = 5 * (double)qkv->shape[0] * h * t * (t + 1) / 2,
                   .gemm_flops = 2 * causal_products(qkv, h), .gemm_dtype = qkv->dtype,
                   .launches = L(y, causal_attention)});
}

/* What the CUDA backend's causal_attention_takes answers (tensor/cuda/
 * attention.cu): a head dimension its kernels have, and not
 * NABLA_CUDA_ATTENTION=composed, which meta:cuda honours too. */
static bool meta_cuda_attention_takes(const nb_tensor *qkv, int h) {
    const char *e = getenv("NABLA_CUDA_ATTENTION");
    int64_t d = qkv->shape[2] / 3 / h;
    return !(e && !strcmp(e, "composed")) && d >= 1 && d <= NB__CUDA_ATTENTION_MAX_D &&
           (int64_t)qkv->shape[0] * h <= INT32_MAX;
}

static void meta_causal_attention_backward(nb_ctx *ctx, nb_tensor *dqkv, const nb_tensor *qkv,
                                           const nb_tensor *y, const nb_tensor *lse,
                                           const nb_tensor *gy, int h, double scale) {
    (void)scale;
    attention_scratch(ctx, qkv, h, 2);
    if (on_cuda(qkv)) { /* our kernels' row sums, f32 (N, H, T), given back (cuDNN's path: none) */
        size_t bytes = sizeof(float) * (size_t)(qkv->shape[0] * h * qkv->shape[1]);
        void *p = nb_ctx_alloc(ctx, bytes, 0);
        nb__ctx_scratch_done(ctx, p, bytes);
    }
    double t = (double)qkv->shape[1];
    /* p again (q k^T), dp = gy v^T, dq = ds k, dk = ds^T q, dv = p^T gy;
     * y and lse are read (Note [Attention contract], tensor/backend.h) */
    record(&(call){.name = "causal_attention_backward", .r = {qkv, y, lse, gy}, .w = {dqkv},
                   .flops = 9 * (double)qkv->shape[0] * h * t * (t + 1) / 2,
                   .gemm_flops = 5 * causal_products(qkv, h), .gemm_dtype = qkv->dtype,
                   .launches = L(dqkv, causal_attention_backward)});
}

/* ------------------------------------------------------------ normalisation */
static void meta_layer_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x,
                            const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d,
                            double eps) {
    (void)eps;
    record(&(call){.name = "layer_norm", .r = {x, w, b}, .w = {y, mean, rstd},
                   .flops = 8 * (double)m * (double)d,
                   .launches = m ? L(y, layer_norm) : 0});
}

static void meta_layer_norm_backward(nb_ctx *ctx, nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                     const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                     const nb_tensor *rstd, const nb_tensor *w, int64_t m,
                                     int64_t d, unsigned add) {
    bool cuda = on_cuda(g);
    if (!cuda && (dw || db)) { /* tensor/cpu/backend.c: 2 d f64 sums */
        size_t bytes = 2 * (size_t)d * sizeof(double);
        void *p = nb_ctx_alloc(ctx, bytes, 0);
        nb__ctx_scratch_done(ctx, p, bytes);
    }
    int64_t launches = 0;
    if (cuda && d && (dx || dw || db))
        launches = !(dw || db) ? 1
                   : d <= 8192 ? NB__CUDA_LAUNCHES_layer_norm_backward
                               : NB__CUDA_LAUNCHES_layer_norm_backward_wide;
    /* an output added into is read too */
    record(&(call){.name = "layer_norm_backward",
                   .r = {g, x, mean, rstd, w, add & NB__LN_ADD_DX ? dx : NULL,
                         add & NB__LN_ADD_DW ? dw : NULL, add & NB__LN_ADD_DB ? db : NULL},
                   .w = {dx, dw, db},
                   .flops = 10 * (double)m * (double)d, .launches = launches});
}

static void meta_batch_norm(nb_tensor *y, nb_tensor *save_mean, nb_tensor *save_invstd,
                            const nb_tensor *x, const nb_tensor *weight, const nb_tensor *bias,
                            nb_tensor *running_mean, nb_tensor *running_var, bool training,
                            double momentum, double eps, int64_t n, int64_t c, int64_t s) {
    (void)momentum, (void)eps, (void)n, (void)c, (void)s;
    record(&(call){.name = "batch_norm",
                   .r = {x, training ? x : NULL, weight, bias, running_mean, running_var},
                   .w = {y, save_mean, save_invstd, training ? running_mean : NULL},
                   .flops = 6 * numel(x), .launches = L(y, batch_norm)});
}

static void meta_batch_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db,
                                     const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean,
                                     const nb_tensor *invstd, const nb_tensor *weight,
                                     bool training, double eps, int64_t n, int64_t c, int64_t s) {
    (void)training, (void)eps, (void)n, (void)c, (void)s;
    record(&(call){.name = "batch_norm_backward", .r = {g, x, mean, invstd, weight, g, x},
                   .w = {dx, dw, db}, .flops = 8 * numel(x), .launches = L(g, batch_norm_backward)});
}

/* ------------------------------------------------------------ convolution */
static void conv_sizes(nb_dtype dt, const nb__conv2d_geom *g, double *x, double *w, double *y,
                       double *flops) {
    double es = (double)nb_dtype_size(dt);
    *x = es * (double)(g->n * g->c * g->h * g->w);
    *w = es * (double)(g->o * (g->c / g->groups) * g->kh * g->kw);
    *y = es * (double)(g->n * g->o * g->oh * g->ow);
    *flops = 2.0 * (double)(g->n * g->o * g->oh * g->ow) * (double)(g->c / g->groups * g->kh * g->kw);
}

static void cols_scratch(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g) {
    if (nb_ctx_device(ctx).index == NB_DEVICE_CUDA) return;
    size_t bytes = nb__conv2d_cols_bytes(dt, g);
    void *p = nb_ctx_alloc(ctx, bytes, 0);
    nb__ctx_scratch_done(ctx, p, bytes);
}

static void meta_conv2d(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *out,
                        const void *x, const void *w, const void *b) {
    (void)out, (void)x, (void)w;
    cols_scratch(ctx, dt, g);
    double xb, wb, yb, fl;
    conv_sizes(dt, g, &xb, &wb, &yb, &fl);
    bool cuda = nb_ctx_device(ctx).index == NB_DEVICE_CUDA;
    double bb = b ? (double)(g->o * (int64_t)nb_dtype_size(dt)) : 0;
    record(&(call){.name = "conv2d", .extra_bytes = xb + wb + yb + bb + (b ? 2 * yb : 0),
                   .flops = b ? yb / (double)nb_dtype_size(dt) : 0, .gemm_flops = fl,
                   .gemm_dtype = dt,
                   .launches = cuda ? NB__CUDA_LAUNCHES_conv2d + (b ? 1 : 0) : 0});
}

static void meta_conv2d_backward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *dx,
                                 void *dw, void *db, const void *gout, const void *x,
                                 const void *w) {
    (void)gout, (void)x, (void)w;
    cols_scratch(ctx, dt, g);
    double xb, wb, yb, fl;
    conv_sizes(dt, g, &xb, &wb, &yb, &fl);
    bool cuda = nb_ctx_device(ctx).index == NB_DEVICE_CUDA;
    double bytes = 0, gemm = 0;
    if (dx) bytes += yb + wb + xb, gemm += fl;
    if (dw) bytes += yb + xb + wb, gemm += fl;
    if (db) bytes += yb + (double)(g->o * (int64_t)nb_dtype_size(dt));
    record(&(call){.name = "conv2d_backward", .extra_bytes = bytes, .gemm_flops = gemm,
                   .gemm_dtype = dt,
                   .launches = cuda ? NB__CUDA_LAUNCHES_conv2d_backward + !!dx + !!dw + !!db : 0});
}

/* ------------------------------------------------------------ pooling */
static void meta_max_pool2d(nb_tensor *out, nb_tensor *arg, const nb_tensor *x,
                            const nb__pool2d_geom *g) {
    record(&(call){.name = "max_pool2d", .r = {x}, .w = {out, arg},
                   .flops = numel(out) * (double)(g->kh * g->kw), .launches = L(out, max_pool2d)});
}

static void meta_max_pool2d_backward(nb_tensor *dx, const nb_tensor *arg, const nb_tensor *gout,
                                     const nb__pool2d_geom *g) {
    (void)g;
    record(&(call){.name = "max_pool2d_backward", .r = {arg, gout}, .w = {dx},
                   .flops = numel(gout), .launches = L(dx, max_pool2d_backward)});
}

static void meta_avg_pool2d(nb_tensor *out, const nb_tensor *x, const nb__pool2d_geom *g) {
    record(&(call){.name = "avg_pool2d", .r = {x}, .w = {out},
                   .flops = numel(out) * (double)(g->kh * g->kw), .launches = L(out, avg_pool2d)});
}

static void meta_avg_pool2d_backward(nb_tensor *dx, const nb_tensor *gout,
                                     const nb__pool2d_geom *g) {
    record(&(call){.name = "avg_pool2d_backward", .r = {gout}, .w = {dx},
                   .flops = numel(gout) * (double)(g->kh * g->kw),
                   .launches = L(dx, avg_pool2d_backward)});
}

/* ------------------------------------------------------------ random, embedding, losses */
static void meta_rand_uniform(nb_tensor *t, double low, double high, uint64_t seed,
                              uint64_t offset) {
    (void)low, (void)high, (void)seed, (void)offset;
    record(&(call){.name = "rand_uniform", .w = {t}, .flops = numel(t),
                   .launches = L(t, rand_uniform)});
}

static void meta_rand_normal(nb_tensor *t, double mean, double std, uint64_t seed,
                             uint64_t offset) {
    (void)mean, (void)std, (void)seed, (void)offset;
    record(&(call){.name = "rand_normal", .w = {t}, .flops = numel(t),
                   .launches = L(t, rand_normal)});
}

static void meta_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p,
                         uint64_t seed, uint64_t offset) {
    (void)p, (void)seed, (void)offset;
    record(&(call){.name = "dropout", .r = {x}, .w = {out, mask}, .flops = numel(x),
                   .launches = L(out, dropout)});
}

/* The rows gathered (np rows of w's width), not all of w. */
static void meta_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np) {
    (void)w, (void)np;
    record(&(call){.name = "embedding", .r = {idx}, .w = {out}, .extra_bytes = (double)tbytes(out),
                   .launches = L(out, embedding)});
}

/* CUDA's sort of the index positions for the backward (the keys kernel,
 * CUB's radix sort: an upsweep and one pass per 8 bits of V), then the row
 * kernel: NB__CUDA_LAUNCHES_embedding_backward. */
static int64_t sort_launches(int64_t v) {
    int end_bit = 1;
    while (end_bit < 64 && ((uint64_t)v >> end_bit) != 0) end_bit++;
    return NB__CUDA_LAUNCHES_embedding_backward + 1 + (end_bit + 7) / 8;
}

/* Writing: on CUDA every row of gw once, from the rows of g that hit it
 * (tensor/cuda/embedding.cu; without positions, gw zeroed); on the CPU gw
 * zeroed, then the rows hit written. Accumulating: the rows hit read and
 * written. Rows hit are counted as min(P, V): exact when the indices are
 * distinct, an upper bound otherwise (the meta device sees no index). */
static void meta_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx,
                                    int64_t np, bool accumulate) {
    bool cuda = on_cuda(gw);
    int64_t launches = 0, v = gw->shape[0];
    if (cuda && nb_numel(gw) && (np || !accumulate))
        launches = np ? sort_launches(v) : NB__CUDA_LAUNCHES_memset;
    double rows = (double)(np < v ? np : v) * (double)gw->shape[1] * (double)nb_dtype_size(gw->dtype);
    record(&(call){.name = "embedding_backward", .r = {np ? g : NULL, np ? idx : NULL},
                   .w = {accumulate ? NULL : gw},
                   .extra_bytes = accumulate ? 2 * rows : cuda ? 0 : rows,
                   .flops = numel(g), .launches = launches});
}

/* Each position's token row gathered, the (T, C) position rows once (a
 * thread per position and column runs over the batch), the output. */
static void meta_embedding_pos(nb_tensor *out, const nb_tensor *wte, const nb_tensor *wpe,
                               const nb_tensor *idx) {
    double c = (double)wte->shape[1], np = numel(idx);
    double rows = (np + (double)idx->shape[1]) * c * (double)nb_dtype_size(wte->dtype);
    (void)wpe;
    record(&(call){.name = "embedding_pos", .r = {idx}, .w = {out}, .extra_bytes = rows,
                   .flops = numel(out), .launches = L(out, embedding_pos)});
}

/* g read once; gpos's first T rows read and written (accumulating) or all
 * of gpos written. */
static void meta_embedding_pos_backward(nb_tensor *gpos, const nb_tensor *g, bool accumulate) {
    double rows = (double)g->shape[1] * (double)gpos->shape[1] * (double)nb_dtype_size(gpos->dtype);
    record(&(call){.name = "embedding_pos_backward", .r = {g}, .w = {accumulate ? NULL : gpos},
                   .extra_bytes = accumulate ? 2 * rows : 0, .flops = numel(g),
                   .launches = L(gpos, embedding_pos_backward)});
}

/* The tensors each backend's entry keeps for the backward: the CPU's lse in
 * the logits' dtype and an f64 count; CUDA's an f32 lse for 16-bit logits
 * and an f32 count, and its per-row partials (n f64 and n int), never given
 * back (tensor/cuda/softmax.cu). Fused (dlogits): no lse, dlogits written,
 * CUDA's count kernel reads the targets once more and writes the count
 * (Note [Fused classifier] in tensor/ops_loss.c). */
static void meta_cross_entropy(nb_ctx *ctx, nb_tensor *loss, nb_tensor **lse, nb_tensor **count,
                               nb_tensor *dlogits, const nb_tensor *logits,
                               const nb_tensor *targets, int64_t ignore_index, double eps) {
    (void)ignore_index, (void)eps;
    int64_t n = logits->shape[0];
    bool cuda = on_cuda(logits), half = logits->dtype == NB_BF16 || logits->dtype == NB_F16;
    *lse = dlogits ? NULL : nb__empty(ctx, cuda && half ? NB_F32 : logits->dtype, 1, &n);
    *count = nb__empty(ctx, cuda ? NB_F32 : NB_F64, 0, NULL);
    if (cuda && n > 0) {
        (void)nb_ctx_alloc(ctx, (size_t)n * sizeof(double), 0);
        (void)nb_ctx_alloc(ctx, (size_t)n * sizeof(int), 0);
    }
    double counting = cuda && dlogits ? (double)(tbytes(targets) + tbytes(*count)) : 0;
    record(&(call){.name = "cross_entropy", .r = {logits, targets}, .w = {loss, *lse, *count, dlogits},
                   .extra_bytes = counting, .flops = (dlogits ? 7 : 4) * numel(logits),
                   .launches = dlogits ? L(logits, cross_entropy_fused) : L(logits, cross_entropy)});
}

/* lse NULL: dlogits = g logits (after a fused forward) */
static void meta_cross_entropy_backward(nb_tensor *dlogits, const nb_tensor *logits,
                                        const nb_tensor *lse, const nb_tensor *targets,
                                        const nb_tensor *g, const nb_tensor *count,
                                        int64_t ignore_index, double eps) {
    (void)ignore_index, (void)eps;
    record(&(call){.name = "cross_entropy_backward",
                   .r = {logits, lse, lse ? targets : NULL, g, lse ? count : NULL},
                   .w = {dlogits}, .flops = (lse ? 3 : 1) * numel(logits),
                   .launches = L(dlogits, cross_entropy_backward)});
}

/* ------------------------------------------------------------ multi-tensor updates */
static int64_t per_launch(const nb_tensor *t, int n, int per) {
    return on_cuda(t) ? (n + per - 1) / per : 0;
}

static double sum_bytes(int n, nb_tensor *const *ts) {
    double b = 0;
    for (int i = 0; ts && i < n; i++) b += (double)tbytes(ts[i]);
    return b;
}

static double sum_numel(int n, nb_tensor *const *ts) {
    double e = 0;
    for (int i = 0; i < n; i++) e += numel(ts[i]);
    return e;
}

/* The extras of an update (tensor/backend.h): the norm read (the
 * gradients are read once either way), each shadow written. */
static double extras_bytes(int n, const nb__update_extras *x) {
    if (!x) return 0;
    return (double)tbytes(x->clip_norm) + sum_bytes(n, x->shadow);
}

static void meta_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m,
                      nb_tensor *const *v, nb_tensor *const *vmax, const int64_t *steps,
                      const double *const *hp, bool decoupled, const nb__update_extras *x) {
    (void)steps, (void)hp, (void)decoupled;
    if (n <= 0) return;
    /* reads p, g, m, v (vmax); writes p, m, v (vmax) */
    double bytes = 2 * sum_bytes(n, p) + sum_bytes(n, g) + 2 * sum_bytes(n, m) +
                   2 * sum_bytes(n, v) + 2 * sum_bytes(n, vmax) + extras_bytes(n, x);
    record(&(call){.name = "adam", .extra_bytes = bytes, .flops = 12 * sum_numel(n, p),
                   .launches = per_launch(p[0], n, NB__CUDA_OPTIM_TENSORS_PER_LAUNCH)});
}

static void meta_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf,
                     const int64_t *steps, const double *const *hp, const nb__update_extras *x) {
    (void)steps, (void)hp;
    if (n <= 0) return;
    double bytes = 2 * sum_bytes(n, p) + sum_bytes(n, g) + 2 * sum_bytes(n, buf) + extras_bytes(n, x);
    record(&(call){.name = "sgd", .extra_bytes = bytes, .flops = 4 * sum_numel(n, p),
                   .launches = per_launch(p[0], n, NB__CUDA_OPTIM_TENSORS_PER_LAUNCH)});
}

static void meta_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts) {
    int64_t launches = per_launch(out, n, NB__CUDA_SUMSQ_TENSORS_PER_LAUNCH) + (on_cuda(out) ? 1 : 0);
    if (on_cuda(out) && n > 0) /* tensor/cuda/reduce.cu: partial sums, kept */
        (void)nb_ctx_alloc(out->ctx, sizeof(double), 0);
    record(&(call){.name = "sum_squares", .w = {out}, .extra_bytes = sum_bytes(n, ts),
                   .flops = 2 * sum_numel(n, ts), .launches = launches});
}

static void meta_max_abs(nb_ctx *ctx, nb_tensor *out, int n, nb_tensor *const *ts) {
    (void)ctx;
    int nm = 0;
    for (int i = 0; i < n; i++) nm += nb_numel(ts[i]) > 0;
    record(&(call){.name = "max_abs", .w = {out}, .extra_bytes = sum_bytes(n, ts),
                   .flops = sum_numel(n, ts),
                   .launches = on_cuda(out) ? (int64_t)NB__CUDA_LAUNCHES_max_abs_per_tensor * nm +
                                                  NB__CUDA_LAUNCHES_max_abs
                                            : 0});
}

static void meta_scale(int n, nb_tensor *const *ts, double coef) {
    (void)coef;
    if (n <= 0) return;
    record(&(call){.name = "scale", .extra_bytes = 2 * sum_bytes(n, ts), .flops = sum_numel(n, ts),
                   .launches = on_cuda(ts[0]) ? (int64_t)NB__CUDA_LAUNCHES_scale_per_tensor * n
                                              : 0});
}

/* counted as when it clips (each tensor read and written); the norm read */
static void meta_clip_scale(int n, nb_tensor *const *ts, const nb_tensor *norm, double max_norm) {
    (void)max_norm;
    if (n <= 0) return;
    record(&(call){.name = "clip_scale", .r = {norm}, .extra_bytes = 2 * sum_bytes(n, ts),
                   .flops = sum_numel(n, ts),
                   .launches = per_launch(ts[0], n, NB__CUDA_CLIP_TENSORS_PER_LAUNCH)});
}

/* nabla/meta.h: the values are taken as finite. */
static bool meta_all_finite(nb_ctx *ctx, int n, nb_tensor *const *ts) {
    (void)ctx;
    if (n <= 0) return true;
    int64_t launches = on_cuda(ts[0]) ? per_launch(ts[0], n, NB__CUDA_SUMSQ_TENSORS_PER_LAUNCH) + 1 +
                                            NB__CUDA_LAUNCHES_all_finite
                                      : 0;
    record(&(call){.name = "all_finite", .extra_bytes = sum_bytes(n, ts),
                   .flops = 2 * sum_numel(n, ts), .launches = launches});
    return true;
}

/* ------------------------------------------------------------ per-channel statistics */
static void meta_channel_stats(nb_tensor *stats, const nb_tensor *x, int64_t n, int64_t c,
                               int64_t s) {
    (void)n, (void)c, (void)s;
    record(&(call){.name = "channel_stats", .r = {x}, .w = {stats, stats}, .flops = 3 * numel(x),
                   .launches = L(x, channel_stats)});
}

static void meta_channel_finalize(nb_tensor *mean, nb_tensor *invstd, const nb_tensor *stats,
                                  nb_tensor *running_mean, nb_tensor *running_var, double momentum,
                                  double eps, int64_t c, const nb_tensor *input) {
    (void)momentum, (void)eps, (void)c, (void)input;
    record(&(call){.name = "channel_finalize", .r = {stats, running_mean, running_var},
                   .w = {mean, invstd, running_mean, running_var}, .flops = 8 * numel(mean),
                   .launches = L(mean, channel_finalize)});
}

static void meta_channel_normalize(nb_tensor *y, const nb_tensor *x, const nb_tensor *mean,
                                   const nb_tensor *invstd, const nb_tensor *w, const nb_tensor *b,
                                   int64_t n, int64_t c, int64_t s) {
    (void)n, (void)c, (void)s;
    record(&(call){.name = "channel_normalize", .r = {x, mean, invstd, w, b}, .w = {y},
                   .flops = 4 * numel(x), .launches = L(y, channel_normalize)});
}

static void meta_channel_backward_sums(nb_tensor *sums, const nb_tensor *dy, const nb_tensor *x,
                                       const nb_tensor *mean, const nb_tensor *invstd, int64_t n,
                                       int64_t c, int64_t s) {
    (void)n, (void)c, (void)s;
    record(&(call){.name = "channel_backward_sums", .r = {dy, x, mean, invstd},
                   .w = {sums, sums}, .flops = 4 * numel(x),
                   .launches = L(dy, channel_backward_sums)});
}

static void meta_channel_backward_dx(nb_tensor *dx, const nb_tensor *dy, const nb_tensor *x,
                                     const nb_tensor *mean, const nb_tensor *invstd,
                                     const nb_tensor *w, const nb_tensor *sums,
                                     const nb_tensor *stats, int64_t n, int64_t c, int64_t s) {
    (void)n, (void)c, (void)s;
    record(&(call){.name = "channel_backward_dx", .r = {dy, x, mean, invstd, w, sums, stats},
                   .w = {dx}, .flops = 6 * numel(x), .launches = L(dx, channel_backward_dx)});
}

/* ------------------------------------------------------------ the tables */
#define META_ENTRY(e) .e = meta_##e,
#define META_TABLE(NAME) \
    .name = NAME, .meta = true, .use = use, .sync = sync_device, .mem_alloc = mem_alloc, \
    .mem_free = mem_free, .poison = poison, .memset = set_bytes, .memcpy_d2d = copy_d2d, \
    .memcpy_h2d = copy_h2d, .memcpy_d2h = copy_d2h, .memcpy_h2d_async = copy_h2d_async, \
    .host_alloc = malloc, .host_free = free, .compute_stream = no_stream, \
    .copy_stream = no_stream, .event_new = no_event, .event_free = event_free, \
    .event_record = event_record, .stream_wait = stream_wait, .event_wait = event_wait, \
    NB__BACKEND_KERNELS(META_ENTRY)

/* The flags CUDA's table has (tensor/cuda/flags.h). */
static const nb__backend cuda_flags = {NB__CUDA_BACKEND_FLAGS};

static nb__backend meta_tables[2] = {{META_TABLE("meta:cpu")}, {META_TABLE("meta:cuda")}};
static bool flags_set;

/* Copies the flags of the backend a table stands for (Note [Meta device]). */
static void take_flags(nb__backend *m, const nb__backend *of) {
    m->device_memory = of->device_memory;
    m->gemm_accumulate = of->gemm_accumulate;
    m->gemm_epilogues = of->gemm_epilogues;
    m->ordered_elementwise = of->ordered_elementwise;
    m->strided_elementwise_out = of->strided_elementwise_out;
    m->half_compute = of->half_compute;
    m->product_dtypes = of->product_dtypes;
    m->f32_norm_stats = of->f32_norm_stats;
    m->causal_attention_dtypes = of->causal_attention_dtypes;
    m->causal_attention = of->causal_attention_dtypes ? meta_causal_attention : NULL;
    m->causal_attention_backward = of->causal_attention_dtypes ? meta_causal_attention_backward
                                                               : NULL;
}

const nb__backend *nb__meta_backend(int of) {
    if (of != NB_DEVICE_CPU && of != NB_DEVICE_CUDA) return NULL;
    if (!flags_set) { /* the same values on every call: a race writes them twice */
        take_flags(&meta_tables[NB_DEVICE_CPU], &nb__cpu_backend);
        take_flags(&meta_tables[NB_DEVICE_CUDA], &cuda_flags);
        meta_tables[NB_DEVICE_CPU].causal_attention_takes = nb__cpu_backend.causal_attention_takes;
        if (cuda_flags.causal_attention_dtypes)
            meta_tables[NB_DEVICE_CUDA].causal_attention_takes = meta_cuda_attention_takes;
        flags_set = true;
    }
    return &meta_tables[of];
}
