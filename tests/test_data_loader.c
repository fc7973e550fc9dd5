/* The dataloader: batches identical for 0, 1 and 4 workers, collation
 * shapes and contents, the end of an epoch, resume from a saved position
 * (in a fresh loader and by seeking), worker errors naming the sample,
 * clean shutdown (every thread joined, checked in /proc/self/task), the
 * CUDA refusal and the programmer errors. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

/* A dataset whose sample i is input (3) = {i, i + 0.5, -i} (f32) and
 * target = i * 7 mod 11 (i64); it fails at `fail_at` with a message, and
 * sleeps `delay_ns` per get to keep workers in flight. */
typedef struct probe {
    int64_t n, fail_at;
    long delay_ns;
} probe;

static int64_t probe_len(void *self) { return ((probe *)self)->n; }

static nb_status probe_get(void *self, int64_t i, void *input, void *target) {
    probe *p = self;
    if (p->delay_ns) {
        struct timespec ts = {0, p->delay_ns};
        nanosleep(&ts, NULL);
    }
    if (i == p->fail_at) return nb_set_error(NB_ERR_FORMAT, "probe: row %lld is corrupt", (long long)i);
    float *x = input;
    x[0] = (float)i;
    x[1] = (float)i + 0.5f;
    x[2] = -(float)i;
    *(int64_t *)target = i * 7 % 11;
    return NB_OK;
}

static void probe_free(void *self) { free(self); }

static const nb_dataset_vtable probe_vt = {"probe", probe_len, probe_get, probe_free};

static nb_dataset *probe_new(int64_t n, int64_t fail_at, long delay_ns) {
    probe *p = malloc(sizeof *p);
    p->n = n;
    p->fail_at = fail_at;
    p->delay_ns = delay_ns;
    return nb_dataset_new(&probe_vt, p, nb_field_of(NB_F32, NB_SHAPE(3)),
                          nb_field_of(NB_I64, 0, NULL));
}

/* A record of batches: sizes and the bytes of inputs and targets. */
typedef struct record {
    int64_t n_batches, n_samples;
    int64_t sizes[256], epochs[256], index[256];
    float inputs[4096 * 3];
    int64_t targets[4096], indices[4096];
} record;

static void record_batch(record *r, const nb_batch *b) {
    ck_assert_int_lt(r->n_batches, 256);
    r->sizes[r->n_batches] = b->size;
    r->epochs[r->n_batches] = b->epoch;
    r->index[r->n_batches] = b->index;
    r->n_batches++;
    nb_to_host(b->inputs, r->inputs + r->n_samples * 3);
    nb_to_host(b->targets, r->targets + r->n_samples);
    memcpy(r->indices + r->n_samples, b->indices, sizeof(int64_t) * (size_t)b->size);
    r->n_samples += b->size;
}

/* Takes `max` batches (or until the end of `epochs` epochs) into r. */
static void drain(nb_loader *l, record *r, int epochs, int64_t max) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    int ends = 0;
    while (ends < epochs && r->n_batches < max) {
        ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
        if (!b.inputs) {
            ends++;
            continue;
        }
        record_batch(r, &b);
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
}

static void assert_same_records(const record *a, const record *b) {
    ck_assert_int_eq(a->n_batches, b->n_batches);
    ck_assert_int_eq(a->n_samples, b->n_samples);
    for (int64_t k = 0; k < a->n_batches; k++) {
        ck_assert_int_eq(a->sizes[k], b->sizes[k]);
        ck_assert_int_eq(a->epochs[k], b->epochs[k]);
        ck_assert_int_eq(a->index[k], b->index[k]);
    }
    ck_assert_mem_eq(a->inputs, b->inputs, sizeof(float) * 3 * (size_t)a->n_samples);
    ck_assert_mem_eq(a->targets, b->targets, sizeof(int64_t) * (size_t)a->n_samples);
    ck_assert_mem_eq(a->indices, b->indices, sizeof(int64_t) * (size_t)a->n_samples);
}

static int thread_count(void) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* The process's thread count once the kernel has finished removing
 * threads that have already been joined: pthread_join returns when a
 * thread has exited, and /proc/self/task can list it a moment longer.
 * Polls (up to 2 s) while the count is above `expect`. */
static int settled_thread_count(int expect) {
    int n = thread_count();
    for (int i = 0; i < 200 && n > expect; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        n = thread_count();
    }
    return n;
}

START_TEST(test_collation_and_epochs) {
    nb_dataset *ds = probe_new(10, -1, 0);
    nb_loader *l;
    nb_loader_options o = {.batch_size = 4};
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    nb_dataset_free(ds); /* the loader holds a reference */
    ck_assert_int_eq(nb_loader_len(l), 3);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.inputs->ndim, 2);
    ck_assert_int_eq(b.inputs->shape[0], 4);
    ck_assert_int_eq(b.inputs->shape[1], 3);
    ck_assert_int_eq(b.inputs->dtype, NB_F32);
    ck_assert(nb_is_contiguous(b.inputs));
    ck_assert_int_eq(b.targets->ndim, 1);
    ck_assert_int_eq(b.targets->dtype, NB_I64);
    double ex[12], et[4];
    for (int i = 0; i < 4; i++) {
        ex[3 * i] = i;
        ex[3 * i + 1] = i + 0.5;
        ex[3 * i + 2] = -i;
        et[i] = i * 7 % 11;
        ck_assert_int_eq(b.indices[i], i);
    }
    nbt_assert_close(b.inputs, ex, 0, 0);
    nbt_assert_close(b.targets, et, 0, 0);
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.index, 1);
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.size, 2); /* the short last batch */
    ck_assert_int_eq(b.inputs->shape[0], 2);
    ck_assert_int_eq(b.indices[1], 9);
    int64_t e, k;
    nb_loader_position(l, &e, &k);
    ck_assert_int_eq(e, 0);
    ck_assert_int_eq(k, 3);
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK); /* end of epoch 0 */
    ck_assert_ptr_null(b.inputs);
    ck_assert_int_eq(b.size, 0);
    ck_assert_int_eq(b.epoch, 0);
    nb_loader_position(l, &e, &k);
    ck_assert_int_eq(e, 1);
    ck_assert_int_eq(k, 0);
    nb_loader_set_epoch(l, 1); /* already there: nothing changes */
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.epoch, 1);
    ck_assert_int_eq(b.index, 0);
    nb_loader_free(l);

    o.drop_last = true;
    ds = probe_new(10, -1, 0);
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    ck_assert_int_eq(nb_loader_len(l), 2);
    nb_loader_free(l);
    /* Note [Freed handles]: a loader used after nb_loader_free is named */
    NBT_EXPECT_ABORT(nb_loader_next(l, ctx, &b), "nb_loader_next: the loader was freed (nb_loader_free)");
    NBT_EXPECT_ABORT(nb_loader_free(l), "nb_loader_free: the loader was freed (nb_loader_free)");
    nb_dataset_free(ds);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_same_batches_for_any_worker_count) {
    /* shuffled, short last batch, three epochs, and a distributed sampler */
    static record r0, r1, r4, r4small;
    const int workers[3] = {0, 1, 4};
    record *recs[3] = {&r0, &r1, &r4};
    for (int w = 0; w < 3; w++) {
        memset(recs[w], 0, sizeof(record));
        nb_dataset *ds = probe_new(203, -1, w ? 2000 : 0);
        nb_loader *l;
        nb_loader_options o = {.batch_size = 16, .shuffle = true, .seed = 5,
                               .num_workers = workers[w]};
        ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
        drain(l, recs[w], 3, 1000);
        nb_loader_free(l);
        nb_dataset_free(ds);
    }
    ck_assert_int_eq(r0.n_batches, 3 * 13);
    ck_assert_int_eq(r0.n_samples, 3 * 203);
    assert_same_records(&r0, &r1);
    assert_same_records(&r0, &r4);
    /* a queue smaller than the worker count gives the same too */
    memset(&r4small, 0, sizeof r4small);
    nb_dataset *ds = probe_new(203, -1, 1000);
    nb_loader *l;
    nb_loader_options o = {.batch_size = 16, .shuffle = true, .seed = 5, .num_workers = 4,
                           .prefetch_batches = 1};
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    drain(l, &r4small, 3, 1000);
    nb_loader_free(l);
    assert_same_records(&r0, &r4small);
    /* each epoch is a permutation, and epochs differ */
    for (int e = 0; e < 3; e++) {
        int seen[203] = {0};
        for (int i = 0; i < 203; i++) seen[r0.indices[e * 203 + i]]++;
        for (int i = 0; i < 203; i++) ck_assert_int_eq(seen[i], 1);
    }
    ck_assert(memcmp(r0.indices, r0.indices + 203, 203 * sizeof(int64_t)) != 0);

    /* distributed: two ranks' loaders, 0 vs 3 workers, cover the dataset */
    static record d0[2], d3[2];
    for (int rank = 0; rank < 2; rank++)
        for (int w = 0; w < 2; w++) {
            record *r = w ? &d3[rank] : &d0[rank];
            memset(r, 0, sizeof *r);
            nb_distributed_options dopt = {.world_size = 2, .rank = rank, .shuffle = true,
                                           .seed = 9};
            nb_sampler *s = nb_sampler_distributed(203, &dopt);
            nb_loader_options lo = {.batch_size = 8, .sampler = s, .num_workers = w ? 3 : 0};
            ck_assert_int_eq(nb_loader_new(&l, ds, &lo), NB_OK);
            ck_assert_int_eq(nb_loader_len(l), 13); /* 102 per rank */
            drain(l, r, 1, 1000);
            nb_loader_free(l);
            nb_sampler_free(s);
        }
    assert_same_records(&d0[0], &d3[0]);
    assert_same_records(&d0[1], &d3[1]);
    int seen[203] = {0};
    for (int rank = 0; rank < 2; rank++)
        for (int i = 0; i < d0[rank].n_samples; i++) seen[d0[rank].indices[i]]++;
    for (int i = 0; i < 203; i++) ck_assert_int_ge(seen[i], 1);
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_resume) {
    /* The uninterrupted run: two epochs. */
    static record full, part, rest, seeked;
    memset(&full, 0, sizeof full);
    nb_dataset *ds = probe_new(100, -1, 1000);
    nb_loader_options o = {.batch_size = 7, .shuffle = true, .seed = 77, .num_workers = 3};
    nb_loader *l;
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    drain(l, &full, 2, 1000);
    nb_loader_free(l);
    ck_assert_int_eq(full.n_batches, 30);

    /* Interrupted after 5 batches of epoch 1 (workers had prefetched more):
     * a new loader seeks to the saved position and sees the rest. */
    memset(&part, 0, sizeof part);
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    drain(l, &part, 2, 20);
    int64_t epoch, batch;
    nb_loader_position(l, &epoch, &batch);
    ck_assert_int_eq(epoch, 1);
    ck_assert_int_eq(batch, 5);
    nb_loader_free(l);
    for (int workers = 0; workers <= 4; workers += 4) {
        memset(&rest, 0, sizeof rest);
        o.num_workers = workers;
        ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
        ck_assert_int_eq(nb_loader_seek(l, epoch, batch), NB_OK);
        nb_loader_set_epoch(l, epoch); /* what an epoch loop does on resume: a no-op */
        drain(l, &rest, 1, 1000);
        nb_loader_free(l);
        ck_assert_int_eq(rest.n_batches, 10);
        for (int64_t k = 0; k < 10; k++) {
            ck_assert_int_eq(rest.sizes[k], full.sizes[20 + k]);
            ck_assert_int_eq(rest.epochs[k], 1);
            ck_assert_int_eq(rest.index[k], 5 + k);
        }
        int64_t off = 0;
        for (int k = 0; k < 20; k++) off += full.sizes[k];
        ck_assert_mem_eq(rest.inputs, full.inputs + off * 3, sizeof(float) * 3 * (size_t)rest.n_samples);
        ck_assert_mem_eq(rest.indices, full.indices + off, sizeof(int64_t) * (size_t)rest.n_samples);
    }

    /* Seeking back and forth in one loader with prefetched work in flight. */
    memset(&seeked, 0, sizeof seeked);
    o.num_workers = 2;
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    drain(l, &seeked, 1, 3);
    ck_assert_int_eq(nb_loader_seek(l, 0, 12), NB_OK);
    memset(&seeked, 0, sizeof seeked);
    drain(l, &seeked, 1, 1000);
    ck_assert_int_eq(seeked.n_batches, 3);
    ck_assert_int_eq(seeked.index[0], 12);
    ck_assert_mem_eq(seeked.indices, full.indices + 12 * 7, sizeof(int64_t) * 7);
    ck_assert_int_eq(nb_loader_seek(l, 0, 15), NB_OK); /* at the end: the next call reports the end */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_ptr_null(b.inputs);
    /* a position from elsewhere (a checkpoint of other data) is refused, and the loader stays */
    ck_assert_int_eq(nb_loader_seek(l, 0, 16), NB_ERR_INVALID);
    ck_assert_str_eq(nb_last_error(), "nb_loader_seek: batch 16 is not in [0, 15] (batches per epoch)");
    ck_assert_int_eq(nb_loader_seek(l, -1, 0), NB_ERR_INVALID);
    ck_assert_str_eq(nb_last_error(), "nb_loader_seek: epoch -1 is negative");
    ck_assert_int_eq(nb_loader_seek(l, 2, -1), NB_ERR_INVALID);
    int64_t pe, pb;
    nb_loader_position(l, &pe, &pb);
    ck_assert_int_eq(pe, 1); /* where the end of epoch 0 left it */
    ck_assert_int_eq(pb, 0);
    nb_loader_free(l);
    nb_ctx_free(ctx);
    nb_dataset_free(ds);
}
END_TEST

/* An epoch begun on 3 ranks and resumed on 2 (nb_sampler_distributed_resume)
 * keeps numbering its batches from the epoch's start: 24 samples, batch 2
 * per rank; 3 ranks take 3 batches each (18 samples), so at 2 ranks the
 * first batch dealt is batch floor(18 / (2 * 2)) = 4 of 6, not batch 0.
 * Every sample of the epoch is seen once over both worlds. */
START_TEST(test_position_after_resume_at_another_world) {
    nb_dataset *ds = probe_new(24, -1, 0);
    int seen[24] = {0};
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    int64_t taken = -1;
    for (int r = 0; r < 3; r++) {
        nb_distributed_options d = {3, r, true, 5, true};
        nb_sampler *s = nb_sampler_distributed(24, &d);
        nb_loader *l;
        nb_loader_options o = {.batch_size = 2, .sampler = s};
        ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
        for (int k = 0; k < 3; k++) {
            ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
            for (int i = 0; i < b.size; i++) seen[b.indices[i]]++;
            nb_ctx_reset(ctx);
        }
        int64_t e, k;
        nb_loader_position(l, &e, &k);
        ck_assert_int_eq(k, 3);
        taken = nb_sampler_distributed_taken(s, k * 2);
        nb_loader_free(l);
        nb_sampler_free(s);
    }
    ck_assert_int_eq(taken, 18);
    for (int workers = 0; workers <= 2; workers += 2) {
        int seen2[24];
        memcpy(seen2, seen, sizeof seen);
        for (int r = 0; r < 2; r++) {
            nb_distributed_options d = {2, r, true, 5, true};
            nb_sampler *s = nb_sampler_distributed(24, &d);
            nb_loader *l;
            nb_loader_options o = {.batch_size = 2, .sampler = s, .num_workers = workers};
            ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
            ck_assert_int_eq(nb_loader_len(l), 6); /* 12 per rank at 2 ranks */
            nb_sampler_distributed_resume(s, 0, taken);
            ck_assert_int_eq(nb_loader_seek(l, 0, 0), NB_OK); /* below the base: the resume point */
            int64_t e, k;
            nb_loader_position(l, &e, &k);
            ck_assert_int_eq(e, 0);
            ck_assert_int_eq(k, 4);
            ck_assert_int_eq(nb_loader_len(l), 6); /* 4 before the resume point, 3 samples = 2 batches left */
            int64_t first[2];
            ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
            ck_assert_int_eq(b.index, 4);
            ck_assert_int_eq(b.size, 2);
            memcpy(first, b.indices, sizeof first);
            nb_ctx_reset(ctx);
            nb_loader_position(l, &e, &k);
            ck_assert_int_eq(k, 5);
            /* the exact position as a sample count, from the loader's batch */
            ck_assert_int_eq(nb_sampler_distributed_taken(s, (k - 4) * 2), 18 + 2 * 2);
            ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
            ck_assert_int_eq(b.index, 5);
            ck_assert_int_eq(b.size, 1);
            for (int i = 0; i < b.size; i++) seen2[b.indices[i]]++;
            for (int i = 0; i < 2; i++) seen2[first[i]]++;
            nb_ctx_reset(ctx);
            ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
            ck_assert_ptr_null(b.inputs);
            ck_assert_int_eq(b.index, 6); /* the end, at the epoch's length */
            /* seeking within the resumed epoch: by the epoch's numbering */
            ck_assert_int_eq(nb_loader_seek(l, 0, 2), NB_OK); /* below the base */
            nb_loader_position(l, &e, &k);
            ck_assert_int_eq(e, 0);
            ck_assert_int_eq(k, 4);
            ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
            ck_assert_mem_eq(b.indices, first, sizeof first);
            nb_ctx_reset(ctx);
            ck_assert_int_eq(nb_loader_seek(l, 0, 7), NB_ERR_INVALID);
            ck_assert_str_eq(nb_last_error(), "nb_loader_seek: batch 7 is not in [0, 6] (batches per epoch)");
            nb_loader_position(l, &e, &k);
            ck_assert_int_eq(k, 5); /* stays */
            /* the next epoch is whole: its bounds, not the resumed epoch's */
            ck_assert_int_eq(nb_loader_seek(l, 1, 5), NB_OK);
            nb_loader_position(l, &e, &k);
            ck_assert_int_eq(e, 1);
            ck_assert_int_eq(k, 5);
            ck_assert_int_eq(nb_loader_len(l), 6);
            ck_assert_int_eq(nb_loader_seek(l, 0, 9), NB_ERR_INVALID); /* refused, and stays in epoch 1 */
            ck_assert_int_eq(nb_sampler_epoch(s), 1);
            ck_assert_int_eq(nb_sampler_distributed_taken(s, 0), 0);
            ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
            ck_assert_int_eq(b.index, 5);
            ck_assert_int_eq(b.epoch, 1);
            nb_ctx_reset(ctx);
            nb_loader_free(l);
            nb_sampler_free(s);
        }
        for (int i = 0; i < 24; i++) ck_assert_int_eq(seen2[i], 1);
    }
    nb_ctx_free(ctx);
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_worker_error) {
    for (int workers = 0; workers <= 3; workers += 3) {
        nb_dataset *ds = probe_new(40, 13, 0);
        nb_loader_options o = {.batch_size = 5, .num_workers = workers};
        nb_loader *l;
        ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
        nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
        nb_batch b;
        ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
        ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
        for (int again = 0; again < 2; again++) { /* the loader stays on the failed batch */
            nb_status st = nb_loader_next(l, ctx, &b);
            ck_assert_int_eq(st, NB_ERR_FORMAT);
            ck_assert_ptr_null(b.inputs);
            ck_assert_str_eq(nb_last_error(), "nb_loader_next: sample 13 (batch 2 of epoch 0, "
                             "probe dataset): probe: row 13 is corrupt");
        }
        ck_assert_int_eq(nb_loader_seek(l, 0, 3), NB_OK); /* skip it */
        ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
        ck_assert_int_eq(b.indices[0], 15);
        nb_loader_free(l);
        nb_ctx_free(ctx);
        nb_dataset_free(ds);
    }
    /* freed while an error waits in the queue */
    nb_dataset *ds = probe_new(40, 0, 0);
    nb_loader_options o = {.batch_size = 5, .num_workers = 2};
    nb_loader *l;
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    nb_loader_free(l);
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_shutdown_joins_every_thread) {
    int before = thread_count();
    if (before < 0) return; /* no /proc */
    nb_dataset *ds = probe_new(1000, -1, 20000);
    nb_loader_options o = {.batch_size = 4, .num_workers = 4, .prefetch_batches = 8};
    nb_loader *l;
    /* freed at once, while every worker is in the middle of a batch */
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    ck_assert_int_eq(thread_count(), before + 4);
    nb_loader_free(l);
    ck_assert_int_eq(settled_thread_count(before), before);
    /* freed after one batch, with the queue full */
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    nb_loader_free(l);
    ck_assert_int_eq(settled_thread_count(before), before);
    nb_ctx_free(ctx);
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_text_batches) {
    nb_dataset *ds;
    ck_assert_int_eq(nb_dataset_open_text(&ds, NABLA_SOURCE_DIR "/examples/datasets/austen.txt",
                                          32, 0, NB_TEXT_COMPACT), NB_OK);
    nb_loader_options o = {.batch_size = 4, .shuffle = true, .seed = 1, .num_workers = 2};
    nb_loader *l;
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_batch b;
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.inputs->ndim, 2);
    ck_assert_int_eq(b.inputs->shape[1], 32);
    ck_assert_int_eq(b.targets->dtype, NB_I64);
    int64_t x[4 * 32], y[4 * 32];
    nb_to_host(b.inputs, x);
    nb_to_host(b.targets, y);
    for (int i = 0; i < 4; i++)
        for (int t = 0; t + 1 < 32; t++) ck_assert_int_eq(y[i * 32 + t], x[i * 32 + t + 1]);
    nb_loader_free(l);
    nb_ctx_free(ctx);
    nb_dataset_free(ds);
}
END_TEST

START_TEST(test_loader_misuse) {
    nb_dataset *ds = probe_new(10, -1, 0);
    nb_loader *l = (nb_loader *)1;
    nb_loader_options o = {.batch_size = 4, .device = nb_cuda(99)};
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_ERR_UNSUPPORTED);
    ck_assert_ptr_null(l);
    ck_assert_ptr_nonnull(strstr(nb_last_error(), "nb_loader_new: device cuda:99 is not available"));
    o.device = nb_cpu();
    o.batch_size = 0;
    NBT_EXPECT_ABORT(nb_loader_new(&l, ds, &o), "nb_loader_new: batch_size 0 must be > 0");
    o.batch_size = 2;
    o.num_workers = -1;
    NBT_EXPECT_ABORT(nb_loader_new(&l, ds, &o), "num_workers -1 must be >= 0");
    nb_sampler *s = nb_sampler_sequential(10);
    nb_loader_options os = {.batch_size = 2, .sampler = s, .shuffle = true};
    NBT_EXPECT_ABORT(nb_loader_new(&l, ds, &os), "with a sampler given, make that sampler shuffle");
    nb_sampler_free(s);
    nb_sampler *big = nb_sampler_sequential(12); /* made for another dataset */
    nb_loader_options ob = {.batch_size = 2, .sampler = big};
    NBT_EXPECT_ABORT(nb_loader_new(&l, ds, &ob), "nb_loader: the sampler gave index 10 (position "
                     "10 of epoch 0) for a probe dataset of 10 samples");
    nb_sampler_free(big);
    nb_dataset_free(ds);
}
END_TEST

int main(void) {
    const TTest *tests[] = {test_collation_and_epochs, test_same_batches_for_any_worker_count, test_resume,
                             test_position_after_resume_at_another_world, test_worker_error,
                             test_shutdown_joins_every_thread, test_text_batches, test_loader_misuse, NULL};
    return nbt_run(nbt_suite("data_loader", "loader", 120, tests));
}
