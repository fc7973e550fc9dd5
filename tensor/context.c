/* Contexts: bump-pointer arenas, one for tensor storage on the context's
 * device (host memory, or cudaMalloc'd device memory) and two that take
 * turns for host metadata (tensor structs, tape nodes): Note [Stale
 * tensors].
 *
 * An arena is a chain of blocks. An allocation that does not fit the
 * current block opens a new block at least twice the size of the last one.
 * Reset rewinds the first block in O(1); if the arena had grown past it,
 * the blocks are replaced by one block as large as all of them, so a
 * steady-state training loop allocates from one block and never calls the
 * system allocator.
 *
 * Note [Arena growth]
 * The doubling is bounded by what the device has left: a step of a large
 * model on a GPU reached 48 GiB in 13 blocks, and the 14th (48 GiB more)
 * failed with 29 GiB free while the tensor asking for it needed 12 MiB.
 * When a block of the doubled size cannot be had, the size is halved
 * until it can, down to the request itself; only a failure at that size
 * is an out-of-memory error. (The next reset still replaces the blocks by
 * one of their total size, which, all of them freed, fits.)
 *
 * Note [Stale tensors]
 * A tensor dies with its context's next nb_ctx_reset, and the usual bug is
 * a pointer kept across the loop (a loss, logits, a batch). Using one must
 * abort naming the op, never read the next step's tensor that took its
 * place. Three pieces:
 *  1. A generation: the context counts its resets (nb__ctx_head, the first
 *     member of struct nb_ctx, so that tensor/internal.h reads it inline)
 *     and each tensor records the count it was made at (nb_tensor.gen).
 *     nb__check_live compares the two: one load through t->ctx and a
 *     compare, in the checks every op front end already makes
 *     (nb__check_ctx, nb__check_same_dtype, nb__check_float, ...), in
 *     nb__record for every input, in the readers and writers of
 *     tensor/tensor.c, the views of tensor/view.c, and nb_backward (the
 *     root, its seed and the graph's leaves).
 *  2. Double buffering of metadata: tensor structs live in one of two
 *     metadata arenas, meta[gen & 1]. A reset rewinds the other one, the
 *     one the step before the previous used, so the previous step's
 *     structs stay intact through the whole next step and their old
 *     generation is there to be seen: a tensor from the previous step is
 *     always caught, and its name and shape are reported. Older structs
 *     may have been overwritten by the current step's, which carry the
 *     current generation; in the default build they are caught only by
 *     chance. The cost is a second metadata arena (allocated at the first
 *     reset; metadata is small next to tensor data).
 *  3. Under AddressSanitizer (NABLA_SANITIZE), any age: the half a reset
 *     recycles is freed and replaced by a fresh block instead of rewound,
 *     so its structs stay poisoned in ASan's quarantine; nb__check_live
 *     asks ASan first and reports through nb_abort, and any other read of
 *     such a struct is an ASan report. Data arenas on the host are
 *     poisoned by a reset and unpoisoned piece by piece as allocations
 *     hand them out, so a kept data pointer read after a reset is reported
 *     too (until its bytes are handed out again), and so is a read past
 *     the end of an allocation.
 * A tensor whose struct is not in an arena (a struct on the stack) has no
 * context and is always live. Not covered: a view made in a context that
 * outlives the one holding its storage (the view stays live; keep views in
 * the context of what they view).
 *
 * Note [Compute dtype]
 * A context's compute dtype (nb_ctx_set_compute_dtype) is a dtype its
 * backend lists in product_dtypes (tensor/backend.h): bf16 and f16 on
 * CUDA, bf16 only on the CPU. Under it the activations between ops are in
 * it, as llm.c and autocast keep them; parameters, their gradients and the
 * optimizer's state stay f32 (the master weights). The table of what each
 * op returns is docs/cuda.md's "What each op returns under a compute
 * dtype"; in short:
 *   - the products (nb_matmul and its family, nb_linear, the GPT MLP's
 *     linear+GELU) cast f32 operands to it with recorded casts (a weight,
 *     a bias), multiply in it, accumulate in f32 and write it; conv2d's
 *     output is cast back to f32;
 *   - layer norm, softmax, the causal softmax and attention, dropout and
 *     the elementwise ops take it and return it, computing in f32 inside
 *     (layer norm's weight and bias may stay f32; its statistics are f32);
 *   - a loss (cross-entropy) reads it and returns f32;
 *   - a gradient comes in its tensor's dtype, except that a product's
 *     gradient for an f32 tensor that was cast (a weight, a bias) is f32
 *     and goes straight to that tensor, unrounded (Note [Wide gradients]
 *     in autograd/backward.c).
 * The GPT keeps its residual stream in the compute dtype (Note [Residual
 * stream under a compute dtype] in models/gpt.c).
 * On the CPU bf16 is otherwise a storage type (no half_compute): a bf16
 * tensor reaches only casts, gradient accumulation (two bf16 contributions
 * added in f32, rounded once: nb__accum_grad), and the ops of the table,
 * and those only in a context whose compute dtype is bf16
 * (nb__check_compute_float in tensor/tensor.c; any other math refuses it).
 * The CPU computes them as CUDA does, in f32 on the bf16 values with each
 * output rounded once (Note [bf16 activations on the CPU] in
 * tensor/cpu/bf16.c), so CI tests the table's semantics; its products
 * convert bf16 operands to f32 (exact: bf16 is f32's top half) and run the
 * f32 GEMM/im2col path (tensor/cpu/matmul.c, conv.c) where no faster bf16
 * kernel takes them, so a product is exactly the f32 computation on the
 * bf16-rounded operands; a CPU without AVX512_BF16 is slower, not wrong.
 * f16 is refused on the CPU: it would need loss scaling (5 exponent bits)
 * and buys nothing without an f16 GEMM; bf16 has f32's exponent range. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/backend.h"
#include "tensor/cuda/cuda.h" /* nb__cuda_device_count */
#include "tensor/cuda_plugin.h"
#include "tensor/internal.h"

#ifdef NB__ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#define FRESH_META 1 /* Note [Stale tensors], 3 */
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#define FRESH_META 0
#endif

#define NB_ALIGN 64
#define NB_DEFAULT_BYTES (1u << 20)

typedef struct block {
    struct block *next;
    char *mem;
    size_t size, used;
} block;

/* A range given back inside a block (Note [Free ranges]). */
typedef struct span {
    char *p;
    size_t size;
    block *b;
} span;

typedef struct arena {
    block *first, *cur;
    size_t used, peak, reserved;
    int n_blocks;
    const nb__backend *be; /* whose memory (meta arenas: the CPU's) */
    int device;
    span *free;            /* sorted by address; host memory (malloc) */
    int n_free, cap_free;
    size_t extent, extent_peak; /* bytes below the blocks' bump pointers, and its largest */
    struct dev_mem *dm;         /* the device's totals (Note [Device totals]); NULL: not counted */
} arena;

/* Note [Device totals]
 * Each context's `used` counts its own live bytes; a step's memory and a
 * model's live in different contexts (activations in the step's, the
 * parameters, their gradients and the optimizer's state in persistent
 * ones), so the largest live total of a device is not the sum of its
 * contexts' peaks when they peak apart (the gradients of a step that gives
 * memory back can grow while its activations shrink). So the data arenas
 * of all contexts on one device add into one total for that device, whose
 * peak is the largest live total of the process on it (PyTorch's
 * max_memory_allocated): nb_device_allocated, nb_device_max_allocated,
 * nb_device_reset_peak. Updated with atomics, as contexts of one device
 * may be used from several threads (a dataloader's workers). Metadata
 * arenas (tensor structs, on the host) are not counted, as they are not in
 * nb_ctx_used either. */
enum { DEV_MEM_TYPES = 3, DEV_MEM_INDICES = 64 };
struct dev_mem {
    size_t used, peak;
};
static struct dev_mem dev_mem_of[DEV_MEM_TYPES][DEV_MEM_INDICES];

static struct dev_mem *dev_mem_for(nb_device d, const char *who) {
    NB_CHECK((int)d.type >= 0 && (int)d.type < DEV_MEM_TYPES && d.index >= 0 && d.index < DEV_MEM_INDICES,
             "%s: device %s is beyond the %d devices of a type whose memory is counted", who,
             nb_device_name(d), DEV_MEM_INDICES);
    return &dev_mem_of[d.type][d.index];
}

static void dev_mem_add(struct dev_mem *m, size_t bytes) {
    if (!m) return;
    size_t now = __atomic_add_fetch(&m->used, bytes, __ATOMIC_RELAXED);
    size_t peak = __atomic_load_n(&m->peak, __ATOMIC_RELAXED);
    while (now > peak &&
           !__atomic_compare_exchange_n(&m->peak, &peak, now, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void dev_mem_sub(struct dev_mem *m, size_t bytes) {
    if (m && bytes) __atomic_sub_fetch(&m->used, bytes, __ATOMIC_RELAXED);
}

size_t nb_device_allocated(nb_device device) {
    return __atomic_load_n(&dev_mem_for(device, "nb_device_allocated")->used, __ATOMIC_RELAXED);
}

size_t nb_device_max_allocated(nb_device device) {
    return __atomic_load_n(&dev_mem_for(device, "nb_device_max_allocated")->peak, __ATOMIC_RELAXED);
}

void nb_device_reset_peak(nb_device device) {
    struct dev_mem *m = dev_mem_for(device, "nb_device_reset_peak");
    __atomic_store_n(&m->peak, __atomic_load_n(&m->used, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}

#define META_BYTES (64 * 1024)

struct nb_ctx {
    nb__ctx_head head; /* first: Note [Stale tensors] */
    nb_device device;
    nb_dtype compute_dtype;
    bool give_back;    /* Note [Memory given back] in tensor/memory.c */
    bool warned_growth;
    int backwards;     /* backward passes since the last reset */
    size_t used_mark;  /* nb_ctx_used at the GROWTH_FROM-th of them */
    arena data;
    arena meta[2]; /* meta[head.gen & 1] is in use; meta[1] is made at the first reset */
    nb_node *tape;
    /* Note [Freed contexts] */
    uint32_t born_gen;     /* head.gen when nb_ctx_new handed this struct out */
    bool freed, meta_kept; /* in the registry; its metadata arenas still hold their structs */
    struct nb_ctx *next_freed;
};

/* Note [Freed contexts]
 * A tensor outlives nb_ctx_free as a pointer in the program, and the first
 * op given it reads its context's generation through t->ctx (Note [Stale
 * tensors]). Were the context's struct returned to malloc, that read would
 * see whatever took its place, and the report that follows would walk
 * freed blocks (SIGSEGV). So a freed context's struct is never returned:
 * it goes to a registry with its generation bumped, and the next
 * nb_ctx_new takes it from there, its generation going on from where it
 * was (born_gen), never back. A tensor of a freed context is then always
 * stale, and the report says its context was freed: with its name and
 * shape while the context's metadata arenas are kept (its structs
 * intact), which the last FREED_KEEP_META freed contexts are; the others'
 * metadata memory is rewound for reuse but never returned to malloc either,
 * so a tensor struct there holds a tensor's bytes, not the allocator's.
 * Under AddressSanitizer the metadata is released as before (poisoned, so
 * any use is reported). Device and data memory are released at once. */
#define FREED_KEEP_META 8
static pthread_mutex_t freed_mu = PTHREAD_MUTEX_INITIALIZER;
static nb_ctx *freed_list; /* most recently freed first */

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Host memory is poisoned for ASan while no tensor holds it. */
static bool host_memory(const arena *a) { return !a->be->device_memory && !a->be->meta; }

static block *block_new(size_t size, const arena *a) {
    size = round_up(size, NB_ALIGN);
    block *b = malloc(sizeof *b);
    char *mem = a->be->mem_alloc(a->device, size);
    if (!b || !mem) {
        free(b);
        if (mem) a->be->mem_free(a->device, mem);
        return NULL;
    }
    b->next = NULL;
    b->mem = mem;
    b->size = size;
    b->used = 0;
    if (host_memory(a)) POISON(mem, size);
    return b;
}

static void arena_init(arena *a, size_t bytes, const nb__backend *be, int device) {
    memset(a, 0, sizeof *a);
    a->be = be;
    a->device = device;
    a->first = a->cur = block_new(bytes, a);
    NB_CHECK(a->first, "nb_ctx_new: cannot allocate %zu bytes%s%s", bytes,
             host_memory(a) ? "" : ": ", host_memory(a) ? "" : nb_last_error());
    a->reserved = a->first->size;
    a->n_blocks = 1;
}

static void arena_release(arena *a) {
    const nb__backend *be = a->be;
    int dev = a->device;
    for (block *b = a->first, *next; b; b = next) {
        next = b->next;
        if (host_memory(a)) UNPOISON(b->mem, b->size);
        be->mem_free(dev, b->mem);
        free(b);
    }
    free(a->free);
    dev_mem_sub(a->dm, a->used);
    memset(a, 0, sizeof *a);
    a->be = be;
    a->device = dev;
}

/* Note [Free ranges]
 * Memory given back within a step (Note [Memory given back] in
 * tensor/memory.c) goes to a free list of the arena: ranges inside its
 * blocks, kept sorted by address in a small host array (device memory
 * cannot hold list links), merged with their neighbours in the same block,
 * and folded into the bump pointer when they reach it. An allocation takes
 * the smallest range that fits (best fit, splitting off the rest) before it
 * bumps. The array grows by doubling and survives resets, so the steady
 * state makes no system allocation; a reset empties it in O(1). `used`
 * counts the bytes handed out and not given back, so nb_ctx_peak is the
 * largest live total; nb_ctx_extent says how much of the blocks was ever
 * touched (live bytes plus the holes between them). */
static int span_find(const arena *a, const char *p) { /* first span at or after p */
    int lo = 0, hi = a->n_free;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (a->free[mid].p < p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void span_remove(arena *a, int i) {
    memmove(&a->free[i], &a->free[i + 1], (size_t)(a->n_free - i - 1) * sizeof *a->free);
    a->n_free--;
}

static void *take_free(arena *a, size_t need) {
    int best = -1;
    for (int i = 0; i < a->n_free; i++)
        if (a->free[i].size >= need && (best < 0 || a->free[i].size < a->free[best].size)) {
            best = i;
            if (a->free[i].size == need) break;
        }
    if (best < 0) return NULL;
    span *s = &a->free[best];
    void *p = s->p;
    if (s->size == need) span_remove(a, best);
    else s->p += need, s->size -= need;
    return p;
}

static void arena_give_back(arena *a, void *ptr, size_t bytes) {
    size_t need = round_up(bytes ? bytes : 1, NB_ALIGN);
    char *p = ptr;
    block *b = a->first;
    while (b && !(p >= b->mem && p + need <= b->mem + b->used)) b = b->next;
    NB_CHECK(b, "nb_ctx: memory given back (%zu bytes at %p) is not handed out by this context",
             bytes, ptr);
    if (host_memory(a)) POISON(p, need);
    a->used -= need;
    dev_mem_sub(a->dm, need);
    int i = span_find(a, p);
    if (p + need == b->mem + b->used) { /* the top of its block: fold into the bump pointer */
        b->used -= need;
        a->extent -= need;
        if (i > 0 && a->free[i - 1].b == b &&
            a->free[i - 1].p + a->free[i - 1].size == b->mem + b->used) {
            b->used -= a->free[i - 1].size;
            a->extent -= a->free[i - 1].size;
            span_remove(a, i - 1);
        }
        return;
    }
    bool left = i > 0 && a->free[i - 1].b == b && a->free[i - 1].p + a->free[i - 1].size == p;
    bool right = i < a->n_free && a->free[i].b == b && p + need == a->free[i].p;
    if (left && right) {
        a->free[i - 1].size += need + a->free[i].size;
        span_remove(a, i);
    } else if (left) {
        a->free[i - 1].size += need;
    } else if (right) {
        a->free[i].p = p;
        a->free[i].size += need;
    } else {
        if (a->n_free == a->cap_free) {
            int cap = a->cap_free ? 2 * a->cap_free : 64;
            span *f = realloc(a->free, (size_t)cap * sizeof *f);
            NB_CHECK(f, "nb_ctx: out of memory growing the free list to %d ranges", cap);
            a->free = f;
            a->cap_free = cap;
        }
        memmove(&a->free[i + 1], &a->free[i], (size_t)(a->n_free - i) * sizeof *a->free);
        a->free[i] = (span){p, need, b};
        a->n_free++;
    }
}

static void *arena_alloc(arena *a, size_t bytes, const char *what) {
    size_t need = round_up(bytes ? bytes : 1, NB_ALIGN);
    void *reused = a->n_free ? take_free(a, need) : NULL;
    if (reused) {
        a->used += need;
        if (a->used > a->peak) a->peak = a->used;
        dev_mem_add(a->dm, need);
        if (host_memory(a)) UNPOISON(reused, bytes);
        return reused;
    }
    block *b = a->cur;
    if (b->used + need > b->size) {
        /* Blocks double, so that a step's memory settles in a few blocks
         * (one after the next reset); but the doubled block can exceed what
         * the device has left while the request fits in it: halve down to
         * the request before giving up. Note [Arena growth] */
        size_t size = b->size * 2 > need ? b->size * 2 : need;
        block *nb = block_new(size, a);
        while (!nb && size > need) {
            size = size / 2 > need ? size / 2 : need;
            nb = block_new(size, a);
        }
        NB_CHECK(nb, "nb_ctx: out of memory allocating %zu bytes of %s (context holds %zu bytes "
                 "in %d blocks)%s%s. A context keeps everything made in it until nb_ctx_reset: "
                 "a training step needs less with smaller micro-batches and gradient "
                 "accumulation (train_gpt --batch-size N --grad-accum K)",
                 bytes, what, a->reserved, a->n_blocks, host_memory(a) ? "" : ": ",
                 host_memory(a) ? "" : nb_last_error());
        b->next = nb;
        a->cur = b = nb;
        a->reserved += nb->size;
        a->n_blocks++;
    }
    void *p = b->mem + b->used;
    b->used += need;
    a->used += need;
    if (a->used > a->peak) a->peak = a->used;
    dev_mem_add(a->dm, need);
    a->extent += need;
    if (a->extent > a->extent_peak) a->extent_peak = a->extent;
    if (host_memory(a)) UNPOISON(p, bytes);
    return p;
}

/* On CUDA, work queued on the compute stream may still read blocks being
 * released; cudaFree waits for the device, so that is safe (and happens
 * only when the arena grew, not in the steady state). */
static void arena_reset(arena *a, bool fresh) {
    if (a->n_blocks > 1 || fresh) {
        size_t total = a->reserved, peak = a->peak, extent = a->extent_peak;
        struct dev_mem *dm = a->dm;
        arena_release(a);
        arena_init(a, total, a->be, a->device);
        a->peak = peak;
        a->extent_peak = extent;
        a->dm = dm;
    } else {
        if (host_memory(a)) POISON(a->first->mem, a->first->used);
        a->first->used = 0;
        a->cur = a->first;
        dev_mem_sub(a->dm, a->used);
        a->used = 0;
        a->extent = 0;
        a->n_free = 0;
    }
}

nb_ctx *nb_ctx_new(nb_device device, size_t initial_bytes) {
    if (device.type == NB_DEVICE_CUDA) {
        NB_CHECK(NABLA_HAVE_CUDA, "nb_ctx_new: device %s: nabla was built without CUDA",
                 nb_device_name(device));
        int n = nb__cuda_device_count(); /* loads the CUDA plugin */
        NB_CHECK(nb__cuda_plugin_get(), "nb_ctx_new: device %s: the CUDA backend could not be loaded: %s",
                 nb_device_name(device), nb__cuda_plugin_error());
        NB_CHECK(device.index >= 0 && device.index < n,
                 "nb_ctx_new: device %s does not exist (%d CUDA device%s visible)",
                 nb_device_name(device), n, n == 1 ? "" : "s");
    } else if (device.type == NB_DEVICE_META) {
        NB_CHECK(nb__meta_backend(device.index), "nb_ctx_new: %s is not a meta device (meta:cpu, "
                 "meta:cuda)", nb_device_name(device));
    } else {
        NB_CHECK(device.type == NB_DEVICE_CPU, "nb_ctx_new: unknown device type %d",
                 (int)device.type);
    }
    struct dev_mem *dm = dev_mem_for(device, "nb_ctx_new"); /* Note [Device totals] */
    /* Note [Freed contexts]: a struct from the registry, its generation going on */
    pthread_mutex_lock(&freed_mu);
    nb_ctx *ctx = freed_list;
    if (ctx) freed_list = ctx->next_freed;
    pthread_mutex_unlock(&freed_mu);
    arena meta[2];
    uint32_t gen = 0;
    if (ctx) {
        gen = ctx->head.gen;
        memcpy(meta, ctx->meta, sizeof meta);
        memset(ctx, 0, sizeof *ctx);
    } else {
        ctx = calloc(1, sizeof *ctx);
        NB_CHECK(ctx, "nb_ctx_new: out of memory");
        memset(meta, 0, sizeof meta);
    }
    ctx->head.gen = ctx->born_gen = gen;
    ctx->device = device;
    ctx->compute_dtype = NB_F32;
    ctx->give_back = true;
    arena_init(&ctx->data, initial_bytes ? initial_bytes : NB_DEFAULT_BYTES,
               nb__backend_of(device), device.index);
    ctx->data.dm = dm;
    for (int i = 0; i < 2; i++) {
        ctx->meta[i] = meta[i];
        if (meta[i].first) arena_reset(&ctx->meta[i], false);
        ctx->meta[i].be = &nb__cpu_backend;
    }
    arena *m = &ctx->meta[gen & 1];
    if (!m->first) arena_init(m, META_BYTES, &nb__cpu_backend, 0);
    return ctx;
}

void nb_ctx_set_compute_dtype(nb_ctx *ctx, nb_dtype dtype) {
    NB_CHECK(dtype == NB_F32 || dtype == NB_BF16 || dtype == NB_F16,
             "nb_ctx_set_compute_dtype: %s is not a compute dtype (f32, bf16 or f16)",
             nb_dtype_name(dtype));
    /* Note [Compute dtype] */
    const nb__backend *be = nb__backend_of(ctx->device);
    NB_CHECK(dtype == NB_F32 || (be->product_dtypes & (1u << dtype)),
             "nb_ctx_set_compute_dtype: %s compute is not supported on %s%s",
             nb_dtype_name(dtype), nb_device_name(ctx->device),
             dtype == NB_F16 && (be->product_dtypes & (1u << NB_BF16))
                 ? " (its products take bf16 only: f16 would need loss scaling for its 5-bit "
                   "exponent and has no fast GEMM there; use bf16, which keeps f32's range)"
                 : "");
    ctx->compute_dtype = dtype;
}

nb_dtype nb_ctx_compute_dtype(const nb_ctx *ctx) { return ctx->compute_dtype; }

/* Note [Freed contexts] */
void nb_ctx_free(nb_ctx *ctx) {
    if (!ctx) return;
    NB_CHECK(!ctx->freed, "nb_ctx_free: the context was already freed");
    nb_ctx_watch_peak(ctx, false);
    nb__frames_forget(ctx);
    arena_release(&ctx->data);
    if (FRESH_META) {
        arena_release(&ctx->meta[0]);
        arena_release(&ctx->meta[1]);
    }
    ctx->head.gen++;
    ctx->freed = true;
    ctx->meta_kept = !FRESH_META;
    ctx->tape = NULL;
    pthread_mutex_lock(&freed_mu);
    ctx->next_freed = freed_list;
    freed_list = ctx;
    int n = 0;
    for (nb_ctx *c = freed_list; c; c = c->next_freed)
        if (c->meta_kept && ++n > FREED_KEEP_META) {
            /* rewound for reuse, kept from malloc */
            for (int i = 0; i < 2; i++)
                if (c->meta[i].first) arena_reset(&c->meta[i], false);
            c->meta_kept = false;
        }
    pthread_mutex_unlock(&freed_mu);
}

/* Note [Stale tensors] */
void nb_ctx_reset(nb_ctx *ctx) {
    nb__frames_forget(ctx);
    ctx->head.gen++;
    arena_reset(&ctx->data, false);
    arena *m = &ctx->meta[ctx->head.gen & 1];
    if (m->first) arena_reset(m, FRESH_META);
    else arena_init(m, META_BYTES, &nb__cpu_backend, 0);
    ctx->tape = NULL;
    ctx->backwards = 0;
}

/* Note [Growing contexts]
 * A program that forgets nb_ctx_reset keeps every step's tensors: the
 * context grows by a step's worth each iteration until memory runs out,
 * with nothing to say why (a report: 2.5 MiB a step, to 5 GiB). A training
 * step makes one backward pass, a few with gradient accumulation; so when
 * a context has seen GROWTH_AT backward passes without a reset and holds
 * more than at the GROWTH_FROM-th, it says so once, on stderr, with the
 * hint. Evaluation loops make no backward pass and are not counted. */
#define GROWTH_FROM 50
#define GROWTH_AT 100

void nb__ctx_note_backward(nb_ctx *ctx) {
    if (ctx->warned_growth) return;
    ctx->backwards++;
    if (ctx->backwards == GROWTH_FROM) ctx->used_mark = ctx->data.used;
    if (ctx->backwards < GROWTH_AT || ctx->data.used <= ctx->used_mark) return;
    ctx->warned_growth = true;
    fprintf(stderr,
            "nabla: warning: a context on %s has seen %d backward passes since its last reset and "
            "keeps growing (%.1f MiB in use, %.1f MiB %d passes ago): everything a step makes "
            "stays until nb_ctx_reset; call nb_ctx_reset(ctx) once per step, after the optimizer "
            "step (docs/troubleshooting.md, \"A tensor that was given back, and memory that "
            "grows every step\")\n",
            nb_device_name(ctx->device), ctx->backwards, ctx->data.used / 1048576.0,
            ctx->used_mark / 1048576.0, GROWTH_AT - GROWTH_FROM);
}

bool nb__ctx_gives_back(const nb_ctx *ctx) { return ctx->give_back; }

void nb_ctx_set_give_back(nb_ctx *ctx, int on) { ctx->give_back = on != 0; }

void nb__ctx_give_back(nb_ctx *ctx, void *p, size_t bytes) { arena_give_back(&ctx->data, p, bytes); }

void nb__ctx_scratch_done(nb_ctx *ctx, void *p, size_t bytes) {
    if (ctx->give_back) arena_give_back(&ctx->data, p, bytes);
}

static bool in_arena(const arena *a, const void *p) {
    for (const block *b = a->first; b; b = b->next)
        if ((const char *)p >= b->mem && (const char *)p < b->mem + b->used) return true;
    return false;
}

/* A tensor in the messages below: " 'name' f32 (2, 3)", or " f32 (2, 3)"
 * when it has no name. */
typedef struct tensor_words {
    char s[1024];
} tensor_words;

static tensor_words words_of(const nb_tensor *t) {
    tensor_words w;
    snprintf(w.s, sizeof w.s, "%s%s%s %s %s", t->name ? " '" : "", t->name ? t->name : "",
             t->name ? "'" : "", nb_dtype_name(t->dtype), nb_shape_str(t));
    return w;
}

/* Note [Memory given back] in tensor/memory.c: the struct is intact (this
 * step's), its storage's memory was reused. */
static NB_NORETURN void nb__given_back_abort(const char *op, const nb_tensor *t) {
    if (t->priv->mem->sharded)
        nb_abort(__FILE__, __LINE__,
                 "%s: parameter%s is sharded over the ranks (ZeRO-3, nb_fsdp_new): its "
                 "values exist only inside its unit's forward and backward; call "
                 "nb_fsdp_gather_full() to have every parameter whole until the next forward "
                 "(docs/ddp.md, \"ZeRO-3\")", op, words_of(t).s);
    const nb_tensor *made = t->priv->mem->t;
    const char *by = made->node ? made->node->op : t->node ? t->node->op : NULL;
    nb_abort(__FILE__, __LINE__,
             "%s: tensor%s%s%s was given back to its context during the step (the "
             "library made it inside a module's forward or a backward, and gives such memory "
             "back once nothing needs it: after the backward that used it, or at once when no "
             "op saved it); to read it afterwards, call nb_keep() on it right after it is made "
             "(before nb_backward), or turn giving back off with nb_ctx_set_give_back(ctx, 0)%s",
             op, words_of(t).s, by ? " made by " : "", by ? by : "",
             strcmp(op, "nb_backward") == 0
                 ? "; an earlier nb_backward walked a graph that used it and gave it back after "
                   "its last use: to backpropagate through that part again, pass retain_graph "
                   "to the earlier one, nb_backward_ex(loss, &(nb_backward_options)"
                   "{.retain_graph = true})"
                 : "");
}

/* Note [Stale tensors]. The name and shape are read only where the struct
 * is known intact: in the previous step's metadata arena. */
void nb__stale_abort(const char *op, const nb_tensor *t) {
    if (!t)
        nb_abort(__FILE__, __LINE__,
                 "%s: a tensor argument is NULL (a tensor a failed call did not make? check the "
                 "status of the call that should have made it; last error: %s)", op,
                 nb_last_error()[0] ? nb_last_error() : "none");
    static const char *const advice =
        "a tensor lives until the next nb_ctx_reset of its context: read what you keep "
        "across steps out before the reset (nb_item, nb_to_host) or nb_copy_ it into a "
        "tensor of a context that is not reset";
    if (!NB__RELEASED(t) && t->ctx && t->priv->gen == nb__ctx_gen(t->ctx) && t->priv->mem &&
        t->priv->mem->given_back)
        nb__given_back_abort(op, t);
    if (NB__RELEASED(t))
        nb_abort(__FILE__, __LINE__,
                 "%s: a tensor made before a reset of its context was used (its memory was "
                 "released by an nb_ctx_reset or nb_ctx_free of its context); %s", op, advice);
    const nb_ctx *ctx = t->ctx;
    /* Note [Freed contexts] */
    if (ctx->freed || (int32_t)(t->priv->gen - ctx->born_gen) < 0) {
        bool intact = ctx->freed && ctx->meta_kept && in_arena(&ctx->meta[t->priv->gen & 1], t);
        if (intact)
            nb_abort(__FILE__, __LINE__,
                     "%s: tensor%s belongs to a context that was freed (nb_ctx_free): "
                     "its memory is gone; %s",
                     op, words_of(t).s, advice);
        nb_abort(__FILE__, __LINE__,
                 "%s: a tensor of a context that was freed (nb_ctx_free) was used: its memory is "
                 "gone%s; %s", op, ctx->freed ? "" : " (another context now uses it)", advice);
    }
    if (ctx->head.gen - t->priv->gen == 1 && in_arena(&ctx->meta[t->priv->gen & 1], t))
        nb_abort(__FILE__, __LINE__,
                 "%s: tensor%s was made before a reset of its context (it belongs "
                 "to the step before the last nb_ctx_reset, whose memory the current step "
                 "reuses); %s",
                 op, words_of(t).s, advice);
    nb_abort(__FILE__, __LINE__,
             "%s: a tensor made before a reset of its context was used (more than one reset "
             "ago: its name and shape are gone); %s", op, advice);
}

nb_device nb_ctx_device(const nb_ctx *ctx) { return ctx->device; }
size_t nb_ctx_used(const nb_ctx *ctx) { return ctx->data.used; }
size_t nb_ctx_peak(const nb_ctx *ctx) { return ctx->data.peak; }
size_t nb_ctx_reserved(const nb_ctx *ctx) { return ctx->data.reserved; }
size_t nb_ctx_extent(const nb_ctx *ctx) { return ctx->data.extent_peak; }

void *nb_ctx_alloc(nb_ctx *ctx, size_t bytes, int zero) {
    void *p = arena_alloc(&ctx->data, bytes, "tensor data");
    nb__peak_check(ctx);
    if (zero) {
        ctx->data.be->memset(ctx->data.device, p, 0, bytes);
    }
    return p;
}

void *nb__ctx_meta(nb_ctx *ctx, size_t bytes) {
    void *p = arena_alloc(&ctx->meta[ctx->head.gen & 1], bytes, "metadata");
    memset(p, 0, bytes);
    return p;
}

nb_node *nb__ctx_tape(nb_ctx *ctx) { return ctx->tape; }

void nb__ctx_push_node(nb_ctx *ctx, nb_node *node) {
    node->prev = ctx->tape;
    node->ctx = ctx;
    ctx->tape = node;
}
