/* Contexts: two bump-pointer arenas, one for tensor storage on the
 * context's device (host memory, or cudaMalloc'd device memory) and one
 * for host metadata (tensor structs, tape nodes).
 *
 * An arena is a chain of blocks. An allocation that does not fit the
 * current block opens a new block at least twice the size of the last one.
 * Reset rewinds the first block in O(1); if the arena had grown past it,
 * the blocks are replaced by one block as large as all of them, so a
 * steady-state training loop allocates from one block and never calls the
 * system allocator. */
#include <stdlib.h>
#include <string.h>

#include "tensor/cuda/cuda.h"
#include "tensor/internal.h"

#define NB_ALIGN 64
#define NB_DEFAULT_BYTES (1u << 20)

typedef struct block {
    struct block *next;
    char *mem;
    size_t size, used;
} block;

typedef struct arena {
    block *first, *cur;
    size_t used, peak, reserved;
    int n_blocks;
    int cuda_device; /* -1: host memory */
} arena;

struct nb_ctx {
    nb_device device;
    nb_dtype compute_dtype;
    arena data, meta;
    nb_node *tape;
};

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static void mem_free(int cuda_device, char *mem) {
    if (cuda_device >= 0) nb__cuda_free(cuda_device, mem);
    else free(mem);
}

static block *block_new(size_t size, int cuda_device) {
    size = round_up(size, NB_ALIGN);
    block *b = malloc(sizeof *b);
    char *mem = cuda_device >= 0 ? nb__cuda_malloc(cuda_device, size)
                                 : aligned_alloc(NB_ALIGN, size);
    if (!b || !mem) {
        free(b);
        if (mem) mem_free(cuda_device, mem);
        return NULL;
    }
    b->next = NULL;
    b->mem = mem;
    b->size = size;
    b->used = 0;
    return b;
}

static void arena_init(arena *a, size_t bytes, int cuda_device) {
    memset(a, 0, sizeof *a);
    a->cuda_device = cuda_device;
    a->first = a->cur = block_new(bytes, cuda_device);
    NB_CHECK(a->first, "nb_ctx_new: cannot allocate %zu bytes%s%s", bytes,
             cuda_device >= 0 ? ": " : "", cuda_device >= 0 ? nb_last_error() : "");
    a->reserved = a->first->size;
    a->n_blocks = 1;
}

static void arena_release(arena *a) {
    int dev = a->cuda_device;
    for (block *b = a->first, *next; b; b = next) {
        next = b->next;
        mem_free(dev, b->mem);
        free(b);
    }
    memset(a, 0, sizeof *a);
    a->cuda_device = dev;
}

static void *arena_alloc(arena *a, size_t bytes, const char *what) {
    size_t need = round_up(bytes ? bytes : 1, NB_ALIGN);
    block *b = a->cur;
    if (b->used + need > b->size) {
        size_t size = b->size * 2 > need ? b->size * 2 : need;
        block *nb = block_new(size, a->cuda_device);
        NB_CHECK(nb, "nb_ctx: out of memory allocating %zu bytes of %s (context holds %zu bytes "
                 "in %d blocks)%s%s", bytes, what, a->reserved, a->n_blocks,
                 a->cuda_device >= 0 ? ": " : "", a->cuda_device >= 0 ? nb_last_error() : "");
        b->next = nb;
        a->cur = b = nb;
        a->reserved += nb->size;
        a->n_blocks++;
    }
    void *p = b->mem + b->used;
    b->used += need;
    a->used += need;
    if (a->used > a->peak) a->peak = a->used;
    return p;
}

/* On CUDA, work queued on the compute stream may still read blocks being
 * released; cudaFree waits for the device, so that is safe (and happens
 * only when the arena grew, not in the steady state). */
static void arena_reset(arena *a) {
    if (a->n_blocks > 1) {
        size_t total = a->reserved, peak = a->peak;
        arena_release(a);
        arena_init(a, total, a->cuda_device);
        a->peak = peak;
    } else {
        a->first->used = 0;
        a->cur = a->first;
        a->used = 0;
    }
}

nb_ctx *nb_ctx_new(nb_device device, size_t initial_bytes) {
    int cuda = -1;
    if (device.type == NB_DEVICE_CUDA) {
        NB_CHECK(NABLA_HAVE_CUDA, "nb_ctx_new: device %s: nabla was built without CUDA",
                 nb_device_name(device));
        int n = nb__cuda_device_count();
        NB_CHECK(device.index >= 0 && device.index < n,
                 "nb_ctx_new: device %s does not exist (%d CUDA device%s visible)",
                 nb_device_name(device), n, n == 1 ? "" : "s");
        cuda = device.index;
    } else {
        NB_CHECK(device.type == NB_DEVICE_CPU, "nb_ctx_new: unknown device type %d",
                 (int)device.type);
    }
    nb_ctx *ctx = calloc(1, sizeof *ctx);
    NB_CHECK(ctx, "nb_ctx_new: out of memory");
    ctx->device = device;
    ctx->compute_dtype = NB_F32;
    arena_init(&ctx->data, initial_bytes ? initial_bytes : NB_DEFAULT_BYTES, cuda);
    arena_init(&ctx->meta, 64 * 1024, -1);
    return ctx;
}

void nb_ctx_set_compute_dtype(nb_ctx *ctx, nb_dtype dtype) {
    NB_CHECK(dtype == NB_F32 || dtype == NB_BF16 || dtype == NB_F16,
             "nb_ctx_set_compute_dtype: %s is not a compute dtype (f32, bf16 or f16)",
             nb_dtype_name(dtype));
    NB_CHECK(dtype == NB_F32 || ctx->device.type == NB_DEVICE_CUDA,
             "nb_ctx_set_compute_dtype: %s compute needs a CUDA context; this one is on %s",
             nb_dtype_name(dtype), nb_device_name(ctx->device));
    ctx->compute_dtype = dtype;
}

nb_dtype nb_ctx_compute_dtype(const nb_ctx *ctx) { return ctx->compute_dtype; }

void nb_ctx_free(nb_ctx *ctx) {
    if (!ctx) return;
    arena_release(&ctx->data);
    arena_release(&ctx->meta);
    free(ctx);
}

void nb_ctx_reset(nb_ctx *ctx) {
    arena_reset(&ctx->data);
    arena_reset(&ctx->meta);
    ctx->tape = NULL;
}

nb_device nb_ctx_device(const nb_ctx *ctx) { return ctx->device; }
size_t nb_ctx_used(const nb_ctx *ctx) { return ctx->data.used; }
size_t nb_ctx_peak(const nb_ctx *ctx) { return ctx->data.peak; }
size_t nb_ctx_reserved(const nb_ctx *ctx) { return ctx->data.reserved; }

void *nb_ctx_alloc(nb_ctx *ctx, size_t bytes, int zero) {
    void *p = arena_alloc(&ctx->data, bytes, "tensor data");
    if (zero) {
        if (ctx->data.cuda_device >= 0) nb__cuda_memset(ctx->data.cuda_device, p, 0, bytes);
        else memset(p, 0, bytes);
    }
    return p;
}

void *nb__ctx_meta(nb_ctx *ctx, size_t bytes) {
    void *p = arena_alloc(&ctx->meta, bytes, "metadata");
    memset(p, 0, bytes);
    return p;
}

nb_node *nb__ctx_tape(nb_ctx *ctx) { return ctx->tape; }

void nb__ctx_push_node(nb_ctx *ctx, nb_node *node) {
    node->prev = ctx->tape;
    node->ctx = ctx;
    ctx->tape = node;
}
