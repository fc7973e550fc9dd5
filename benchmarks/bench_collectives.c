/* All-reduce bandwidth, as nccl-tests reports it: for f32 buffers from
 * 4 KB to 256 MB (to 4 MB with --quick), the time of one all-reduce(sum)
 * and
 *   algbw = bytes / time,   busbw = algbw * 2 (R - 1) / R,
 * busbw being what each link carries in a ring all-reduce, comparable
 * across world sizes. Run it under the launcher:
 *
 *   nbrun --nproc-per-node 2 build/bin/bench_collectives [--quick] [--backend gloo|nccl]
 *
 * The backend is NCCL on CUDA buffers when a GPU is visible (and the build
 * has CUDA), else Gloo on CPU buffers. Per size: one checked all-reduce of
 * ones (every element must come back as R), one untimed warm-up, then a
 * number of iterations that every rank agrees on (the largest any rank
 * proposes from its warm-up, for ~0.4 s per size, 0.1 s with --quick;
 * between 3 and 200), issued back to back and waited for; the time is the
 * slowest rank's. rank 0 prints the table. Buffers hold zeros while timed,
 * so sums stay finite however many iterations run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nabla/nabla.h>
#include <nabla/dist.h>

#include "bench_time.h"

#if NABLA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

static void check(nb_status st, const char *what) {
    if (st != NB_OK) {
        fprintf(stderr, "bench_collectives: %s: %s\n", what, nb_last_error());
        exit(1);
    }
}

/* A 1-d f32 tensor of n elements on the group's device. Until nabla has
 * CUDA contexts, device buffers come straight from cudaMalloc. */
static nb_tensor *buffer(nb_ctx *ctx, nb_pg *pg, int64_t n) {
    nb_device dev = nb_pg_device(pg);
    if (dev.type == NB_DEVICE_CPU) return nb_zeros(ctx, NB_F32, NB_SHAPE(n));
#if NABLA_HAVE_CUDA
    nb_tensor *t = calloc(1, sizeof *t);
    t->dtype = NB_F32;
    t->device = dev;
    t->ndim = 1;
    t->shape[0] = n;
    t->strides[0] = 1;
    if (cudaMalloc(&t->data, (size_t)n * 4) != cudaSuccess || cudaMemset(t->data, 0, (size_t)n * 4) != cudaSuccess) {
        fprintf(stderr, "bench_collectives: cudaMalloc of %lld floats failed\n", (long long)n);
        exit(1);
    }
    return t;
#else
    (void)ctx;
    exit(1);
#endif
}

static void buffer_free(nb_pg *pg, nb_tensor *t) {
#if NABLA_HAVE_CUDA
    if (nb_pg_device(pg).type == NB_DEVICE_CUDA) {
        cudaFree(t->data);
        free(t);
    }
#else
    (void)pg, (void)t;
#endif
}

/* Sets every element to v (host or device). */
static void fill(nb_pg *pg, nb_tensor *t, float v) {
    if (nb_pg_device(pg).type == NB_DEVICE_CPU) {
        nb_fill_(t, v);
        return;
    }
#if NABLA_HAVE_CUDA
    size_t n = (size_t)t->shape[0];
    float *h = malloc(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = v;
    /* From pageable memory cudaMemcpy may return before the data has reached
     * the GPU, and the legacy stream it uses is not ordered with the group's
     * non-blocking streams: wait for the device before any collective reads. */
    if (cudaMemcpy(t->data, h, n * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "bench_collectives: filling a device buffer failed: %s\n",
                cudaGetErrorString(cudaGetLastError()));
        exit(1);
    }
    free(h);
#endif
}

/* Largest |x - want| over the buffer. */
static double max_error(nb_pg *pg, nb_tensor *t, double want) {
    size_t n = (size_t)t->shape[0];
    float *h = malloc(n * 4);
    if (nb_pg_device(pg).type == NB_DEVICE_CPU) {
        memcpy(h, t->data, n * 4);
    } else {
#if NABLA_HAVE_CUDA
        cudaMemcpy(h, t->data, n * 4, cudaMemcpyDeviceToHost);
#endif
    }
    double err = 0;
    for (size_t i = 0; i < n; i++) err = fmax(err, fabs((double)h[i] - want));
    free(h);
    return err;
}

/* op over ranks of one host scalar, through the group (on its device). */
static double reduce_scalar(nb_pg *pg, nb_ctx *ctx, double x, nb_reduce_op op) {
    nb_tensor *t = buffer(ctx, pg, 1);
    fill(pg, t, (float)x);
    check(nb_work_finish(nb_pg_all_reduce(pg, t, op)), "all_reduce of a scalar");
    float v = 0;
    if (nb_pg_device(pg).type == NB_DEVICE_CPU) v = *(float *)t->data;
#if NABLA_HAVE_CUDA
    else cudaMemcpy(&v, t->data, 4, cudaMemcpyDeviceToHost);
#endif
    buffer_free(pg, t);
    return v;
}

static void size_name(double bytes, char *buf, size_t len) {
    if (bytes >= 1 << 20) snprintf(buf, len, "%.0f MB", bytes / (1 << 20));
    else snprintf(buf, len, "%.0f KB", bytes / 1024);
}

int main(int argc, char **argv) {
    bool quick = false;
    nb_pg_options opts = {NB_PG_AUTO, 0};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = true;
        else if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
            const char *b = argv[++i];
            opts.backend = strcmp(b, "nccl") == 0 ? NB_PG_NCCL : strcmp(b, "gloo") == 0 ? NB_PG_GLOO : NB_PG_AUTO;
        } else {
            fprintf(stderr, "usage: nbrun --nproc-per-node R bench_collectives [--quick] [--backend gloo|nccl]\n");
            return 2;
        }
    }
    nb_pg *pg;
    check(nb_pg_init(&pg, &opts), "nb_pg_init");
    int R = nb_pg_size(pg), rank = nb_pg_rank(pg);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    const double target = quick ? 0.1 : 0.4;
    const double max_bytes = quick ? 4.0 * (1 << 20) : 256.0 * (1 << 20);

    if (rank == 0) {
        printf("# all_reduce(sum, f32), backend %s, %d ranks, device %s\n",
               nb_pg_backend_name(nb_pg_backend_of(pg)), R, nb_device_name(nb_pg_device(pg)));
        printf("# busbw = algbw * 2(R-1)/R; time is the slowest rank's mean per all-reduce\n");
        printf("%10s %11s %6s %12s %12s %12s\n", "size", "count", "iters", "time (us)", "algbw (GB/s)", "busbw (GB/s)");
    }
    bool ok = true;
    for (double bytes = 4096; bytes <= max_bytes; bytes *= 4) {
        int64_t n = (int64_t)(bytes / 4);
        nb_tensor *t = buffer(ctx, pg, n);
        fill(pg, t, 1.0f);
        check(nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM)), "all_reduce");
        double err = max_error(pg, t, R);
        if (err != 0) {
            fprintf(stderr, "bench_collectives: rank %d: all_reduce of %lld ones is off by %g\n", rank, (long long)n, err);
            ok = false;
        }
        fill(pg, t, 0.0f);
        double t0 = now_s();
        check(nb_work_finish(nb_pg_all_reduce(pg, t, NB_REDUCE_SUM)), "all_reduce");
        double one = now_s() - t0;
        double want = fmin(200, fmax(3, floor(target / fmax(one, 1e-6))));
        int iters = (int)reduce_scalar(pg, ctx, want, NB_REDUCE_MAX);
        check(nb_work_finish(nb_pg_barrier(pg)), "barrier");
        nb_work **w = malloc((size_t)iters * sizeof *w);
        t0 = now_s();
        for (int k = 0; k < iters; k++) w[k] = nb_pg_all_reduce(pg, t, NB_REDUCE_SUM);
        for (int k = 0; k < iters; k++) check(nb_work_finish(w[k]), "all_reduce");
        double mine = (now_s() - t0) / iters;
        free(w);
        double secs = reduce_scalar(pg, ctx, mine, NB_REDUCE_MAX);
        double algbw = bytes / secs / 1e9, busbw = algbw * 2.0 * (R - 1) / R;
        if (rank == 0) {
            char sz[32];
            size_name(bytes, sz, sizeof sz);
            printf("%10s %11lld %6d %12.1f %12.3f %12.3f\n", sz, (long long)n, iters, secs * 1e6, algbw, busbw);
            fflush(stdout);
        }
        buffer_free(pg, t);
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
    check(nb_pg_free(pg), "nb_pg_free");
    return ok ? 0 : 1;
}
