/* Samplers: sequential, random, distributed (PyTorch's DistributedSampler
 * semantics, every rank instantiated in this one process), the exact
 * evaluation shard, the batch sampler and metric sums. References are
 * written out independently here: the padded list of the distributed
 * sampler is built the way the semantics describe it (concatenate the
 * permutation with its own head until long enough, then take every R-th). */
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

/* The sampler's current epoch as a malloc'ed array. */
static int64_t *indices_of(nb_sampler *s, int64_t *len) {
    *len = nb_sampler_len(s);
    int64_t *out = malloc(sizeof *out * (size_t)(*len ? *len : 1));
    nb_sampler_indices(s, out);
    return out;
}

static bool is_permutation(const int64_t *v, int64_t n) {
    char *seen = calloc((size_t)(n ? n : 1), 1);
    bool ok = true;
    for (int64_t i = 0; i < n && ok; i++) {
        if (v[i] < 0 || v[i] >= n || seen[v[i]]) ok = false;
        else seen[v[i]] = 1;
    }
    free(seen);
    return ok;
}

static bool same(const int64_t *a, const int64_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (a[i] != b[i]) return false;
    return true;
}

/* The permutation every rank uses at `epoch`: a random sampler with the
 * same seed produces it (both are randperm(seed + epoch)). */
static int64_t *perm_at(int64_t n, uint64_t seed, int64_t epoch) {
    nb_sampler *r = nb_sampler_random(n, seed);
    nb_sampler_set_epoch(r, epoch);
    int64_t len;
    int64_t *p = indices_of(r, &len);
    nb_sampler_free(r);
    return p;
}

/* Reference: PyTorch's recipe spelled out. */
static int64_t *reference_rank(const int64_t *perm, int64_t n, int world, int rank,
                               bool drop_last, int64_t *len) {
    int64_t per = drop_last ? n / world : (n + world - 1) / world, total = per * world;
    int64_t *list = malloc(sizeof *list * (size_t)(total + n + 1));
    int64_t filled = 0;
    while (filled < total) /* append copies of the permutation's head */
        for (int64_t i = 0; i < n && filled < total; i++) list[filled++] = perm[i];
    int64_t *out = malloc(sizeof *out * (size_t)(per ? per : 1));
    int64_t k = 0;
    for (int64_t i = rank; i < total; i += world) out[k++] = list[i];
    free(list);
    *len = per;
    return out;
}

START_TEST(test_sequential_and_random) {
    nb_sampler *s = nb_sampler_sequential(5);
    int64_t len, *v = indices_of(s, &len);
    ck_assert_int_eq(len, 5);
    for (int i = 0; i < 5; i++) ck_assert_int_eq(v[i], i);
    free(v);
    nb_sampler_free(s);

    nb_sampler *r = nb_sampler_random(100, 7);
    int64_t *e0 = indices_of(r, &len);
    ck_assert(is_permutation(e0, 100));
    int64_t *e0b = indices_of(r, &len);
    ck_assert(same(e0, e0b, 100));
    nb_sampler_set_epoch(r, 1);
    int64_t *e1 = indices_of(r, &len);
    ck_assert(is_permutation(e1, 100));
    ck_assert(!same(e0, e1, 100));
    nb_sampler *r2 = nb_sampler_random(100, 8);
    int64_t *f0 = indices_of(r2, &len);
    ck_assert(!same(e0, f0, 100));
    free(e0);
    free(e0b);
    free(e1);
    free(f0);
    nb_sampler_free(r);
    nb_sampler_free(r2);
    nb_sampler *empty = nb_sampler_random(0, 1);
    ck_assert_int_eq(nb_sampler_len(empty), 0);
    nb_sampler_indices(empty, NULL);
    nb_sampler_free(empty);
}
END_TEST

START_TEST(test_permutations_are_uniform) {
    /* 6000 seeds, 3 elements: each of the 6 orders about 1000 times
     * (standard deviation 29; the band is over 3 of them). The seeds are
     * fixed, so the check is deterministic. */
    int counts[6] = {0};
    for (uint64_t seed = 0; seed < 6000; seed++) {
        int64_t *p = perm_at(3, seed, 0);
        int code = (int)(p[0] * 2 + (p[1] > p[2]));
        counts[code]++;
        free(p);
    }
    for (int c = 0; c < 6; c++)
        ck_assert_msg(counts[c] > 900 && counts[c] < 1100, "order %d drawn %d times of 6000", c,
                      counts[c]);
}
END_TEST

START_TEST(test_ddp_walkthrough) {
    /* 455 samples, batch 8 per process, 2 processes, drop_last: 28 batches
     * per process, 56 in all, 448 samples per epoch, 7 left out. */
    const int64_t n = 455, batch = 8;
    const int world = 2;
    int *seen = calloc((size_t)n, sizeof *seen);
    int64_t batches = 0, samples = 0;
    for (int rank = 0; rank < world; rank++) {
        nb_distributed_options o = {.world_size = world, .rank = rank, .shuffle = true,
                                    .seed = 42, .drop_last = true};
        nb_sampler *s = nb_sampler_distributed(n, &o);
        ck_assert_int_eq(nb_sampler_len(s), 227);
        nb_batch_sampler *bs = nb_batch_sampler_new(s, batch, true);
        ck_assert_int_eq(nb_batch_sampler_len(bs), 28);
        int64_t idx[8];
        for (int64_t k = 0; k < nb_batch_sampler_len(bs); k++) {
            int64_t b = nb_batch_sampler_get(bs, k, idx);
            ck_assert_int_eq(b, 8);
            for (int64_t i = 0; i < b; i++) seen[idx[i]]++;
            batches++;
            samples += b;
        }
        nb_batch_sampler_free(bs);
        nb_sampler_free(s);
    }
    ck_assert_int_eq(batches, 56);
    ck_assert_int_eq(samples, 448);
    int64_t never = 0;
    for (int64_t i = 0; i < n; i++) {
        ck_assert_int_le(seen[i], 1); /* no sample twice in an epoch */
        never += seen[i] == 0;
    }
    ck_assert_int_eq(never, 7);
    free(seen);

    /* Without the sampler's drop_last the list is padded to 456: 228 per
     * rank, still 28 full batches each. */
    nb_distributed_options o = {.world_size = 2, .rank = 1, .shuffle = true, .seed = 42};
    nb_sampler *s = nb_sampler_distributed(n, &o);
    ck_assert_int_eq(nb_sampler_len(s), 228);
    nb_batch_sampler *bs = nb_batch_sampler_new(s, 8, true);
    ck_assert_int_eq(nb_batch_sampler_len(bs), 28);
    nb_batch_sampler *bs_all = nb_batch_sampler_new(s, 8, false);
    ck_assert_int_eq(nb_batch_sampler_len(bs_all), 29);
    int64_t idx[8];
    ck_assert_int_eq(nb_batch_sampler_get(bs_all, 28, idx), 4);
    nb_batch_sampler_free(bs);
    nb_batch_sampler_free(bs_all);
    nb_sampler_free(s);
}
END_TEST

START_TEST(test_ten_on_three_ranks) {
    /* Unshuffled: 0..9 padded with 0, 1 to 12, rank r takes r, r+3, ... */
    const int64_t expect[3][4] = {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}};
    for (int rank = 0; rank < 3; rank++) {
        nb_distributed_options o = {.world_size = 3, .rank = rank};
        nb_sampler *s = nb_sampler_distributed(10, &o);
        int64_t len, *v = indices_of(s, &len);
        ck_assert_int_eq(len, 4);
        for (int k = 0; k < 4; k++) ck_assert_int_eq(v[k], expect[rank][k]);
        free(v);
        nb_sampler_free(s);
    }
    /* Shuffled: the padding is the head of the epoch's permutation. */
    int64_t *perm = perm_at(10, 3, 5);
    int covered[10] = {0};
    for (int rank = 0; rank < 3; rank++) {
        nb_distributed_options o = {.world_size = 3, .rank = rank, .shuffle = true, .seed = 3};
        nb_sampler *s = nb_sampler_distributed(10, &o);
        nb_sampler_set_epoch(s, 5);
        int64_t len, *v = indices_of(s, &len);
        ck_assert_int_eq(len, 4);
        for (int k = 0; k < 4; k++) {
            ck_assert_int_eq(v[k], perm[(rank + 3 * k) % 10]);
            covered[v[k]]++;
        }
        free(v);
        nb_sampler_free(s);
    }
    for (int i = 0; i < 10; i++) ck_assert_int_ge(covered[i], 1);
    ck_assert_int_eq(covered[perm[0]], 2);
    ck_assert_int_eq(covered[perm[1]], 2);
    free(perm);
}
END_TEST

START_TEST(test_distributed_against_reference) {
    /* Every (N, R, drop_last) on a grid, including N < R (wrapping more
     * than once) and N = 0: each rank's list equals the reference; the
     * union covers the dataset (without drop_last) or all but N mod R
     * samples (with it); no index repeats within a rank. */
    const int64_t ns[] = {0, 1, 2, 5, 7, 10, 16, 31};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (int world = 1; world <= 6; world++)
            for (int drop = 0; drop <= 1; drop++) {
                int64_t n = ns[a];
                int64_t *perm = perm_at(n, 11, 2);
                int *count = calloc((size_t)(n ? n : 1), sizeof *count);
                for (int rank = 0; rank < world; rank++) {
                    nb_distributed_options o = {.world_size = world, .rank = rank,
                                                .shuffle = true, .seed = 11,
                                                .drop_last = drop};
                    nb_sampler *s = nb_sampler_distributed(n, &o);
                    nb_sampler_set_epoch(s, 2);
                    int64_t len, ref_len, *v = indices_of(s, &len);
                    int64_t *ref = reference_rank(perm, n, world, rank, drop, &ref_len);
                    ck_assert_int_eq(len, ref_len);
                    ck_assert_msg(same(v, ref, len), "N=%lld R=%d rank %d drop_last %d differs "
                                  "from the reference", (long long)n, world, rank, drop);
                    for (int64_t i = 0; i < len; i++)
                        for (int64_t j = i + 1; j < len; j++)
                            ck_assert_msg(v[i] != v[j], "N=%lld R=%d rank %d: index %lld twice",
                                          (long long)n, world, rank, (long long)v[i]);
                    for (int64_t i = 0; i < len; i++) count[v[i]]++;
                    free(v);
                    free(ref);
                    nb_sampler_free(s);
                }
                int64_t covered = 0;
                for (int64_t i = 0; i < n; i++) covered += count[i] > 0;
                ck_assert_int_eq(covered, drop ? n - n % world : n);
                free(count);
                free(perm);
            }
}
END_TEST

START_TEST(test_set_epoch_changes_order) {
    nb_distributed_options o = {.world_size = 4, .rank = 2, .shuffle = true, .seed = 0};
    nb_sampler *s = nb_sampler_distributed(1000, &o);
    int64_t len;
    int64_t *e0 = indices_of(s, &len);
    nb_sampler_set_epoch(s, 1);
    ck_assert_int_eq(nb_sampler_epoch(s), 1);
    int64_t *e1 = indices_of(s, &len);
    int64_t *e1b = indices_of(s, &len);
    nb_sampler_set_epoch(s, 0);
    int64_t *e0b = indices_of(s, &len);
    ck_assert(!same(e0, e1, len));
    ck_assert(same(e1, e1b, len));
    ck_assert(same(e0, e0b, len));
    /* a second instance (another process) at the same epoch agrees */
    nb_sampler *t = nb_sampler_distributed(1000, &o);
    nb_sampler_set_epoch(t, 1);
    int64_t *t1 = indices_of(t, &len);
    ck_assert(same(e1, t1, len));
    free(e0);
    free(e1);
    free(e1b);
    free(e0b);
    free(t1);
    nb_sampler_free(s);
    nb_sampler_free(t);
}
END_TEST

START_TEST(test_exact_eval_shards_and_metrics) {
    for (int64_t n = 0; n <= 23; n++)
        for (int world = 1; world <= 5; world++) {
            int *count = calloc((size_t)(n ? n : 1), sizeof *count);
            int64_t min_len = INT64_MAX, max_len = 0;
            nb_metric_sums total;
            nb_metric_sums_init(&total, 2);
            for (int rank = 0; rank < world; rank++) {
                nb_sampler *s = nb_sampler_shard(n, world, rank);
                int64_t len, *v = indices_of(s, &len);
                if (len < min_len) min_len = len;
                if (len > max_len) max_len = len;
                nb_metric_sums m;
                nb_metric_sums_init(&m, 2);
                nb_batch_sampler *bs = nb_batch_sampler_new(s, 3, false);
                int64_t idx[3];
                for (int64_t k = 0; k < nb_batch_sampler_len(bs); k++) {
                    int64_t b = nb_batch_sampler_get(bs, k, idx);
                    double sums[2] = {0, 0}; /* "loss" = index, "correct" = index even */
                    for (int64_t i = 0; i < b; i++) {
                        sums[0] += (double)idx[i];
                        sums[1] += idx[i] % 2 == 0;
                        count[idx[i]]++;
                    }
                    nb_metric_sums_add(&m, sums, b);
                }
                nb_metric_sums_merge(&total, &m); /* what an all-reduce (sum) does */
                nb_batch_sampler_free(bs);
                nb_sampler_free(s);
                free(v);
            }
            for (int64_t i = 0; i < n; i++) ck_assert_int_eq(count[i], 1);
            ck_assert_int_le(max_len - min_len, 1);
            ck_assert_double_eq(nb_metric_sums_count(&total), (double)n);
            if (n > 0) {
                ck_assert_double_eq_tol(nb_metric_sums_mean(&total, 0), (double)(n - 1) / 2, 1e-12);
                ck_assert_double_eq_tol(nb_metric_sums_mean(&total, 1),
                                        (double)((n + 1) / 2) / (double)n, 1e-12);
            } else {
                ck_assert(isnan(nb_metric_sums_mean(&total, 0)));
            }
            free(count);
        }
    nb_metric_sums m;
    nb_metric_sums_init(&m, 3);
    ck_assert_int_eq(nb_metric_sums_size(&m), 4);
    ck_assert_ptr_eq(nb_metric_sums_data(&m), m.v);
}
END_TEST

START_TEST(test_batch_sampler) {
    nb_sampler *s = nb_sampler_random(10, 5);
    int64_t len, *all = indices_of(s, &len);
    nb_batch_sampler *bs = nb_batch_sampler_new(s, 4, false);
    ck_assert_int_eq(nb_batch_sampler_len(bs), 3);
    int64_t idx[4], got[10], k = 0;
    for (int64_t b = 0; b < 3; b++) {
        int64_t size = nb_batch_sampler_get(bs, b, idx);
        ck_assert_int_eq(size, b < 2 ? 4 : 2);
        for (int64_t i = 0; i < size; i++) got[k++] = idx[i];
    }
    ck_assert(same(got, all, 10));
    /* set_epoch through the batch sampler reaches the sampler */
    nb_batch_sampler_set_epoch(bs, 3);
    ck_assert_int_eq(nb_sampler_epoch(s), 3);
    int64_t *e3 = indices_of(s, &len);
    nb_batch_sampler_get(bs, 0, idx);
    ck_assert(same(idx, e3, 4));
    ck_assert_int_eq(nb_batch_count(10, 4, true), 2);
    ck_assert_int_eq(nb_batch_count(0, 4, false), 0);
    free(all);
    free(e3);
    nb_batch_sampler_free(bs);
    nb_sampler_free(s);
}
END_TEST

/* An epoch begun on 3 ranks and resumed on R' after k indices per rank
 * (c = 3k positions taken): rank r' takes positions c + r', c + r' + R',
 * ... of the padded list, floor or ceil of (n - c) / R' of them. The
 * reference is PyTorch's list spelled out (the permutation repeated), and
 * the run as a whole takes each sample at most once with drop_last (all but
 * fewer than R' of them), exactly the padding twice without. */
START_TEST(test_distributed_resume_other_world) {
    const int64_t sizes[] = {10, 23, 24};
    for (int si = 0; si < 3; si++)
        for (int drop = 0; drop < 2; drop++)
            for (int shuffle = 0; shuffle < 2; shuffle++)
                for (int64_t k = 0; k <= 3; k++)
                    for (int world2 = 1; world2 <= 4; world2++) {
                        int64_t n = sizes[si];
                        const int64_t epoch = 2;
                        int64_t *perm = shuffle ? perm_at(n, 7, epoch) : malloc(sizeof *perm * (size_t)n);
                        if (!shuffle)
                            for (int64_t i = 0; i < n; i++) perm[i] = i;
                        int64_t c = 3 * k, m = n > c ? n - c : 0;
                        int64_t per = drop ? m / world2 : (m + world2 - 1) / world2;
                        int64_t *list = malloc(sizeof *list * (size_t)(c + per * world2 + 1));
                        for (int64_t i = 0; i < c + per * world2; i++) list[i] = perm[i % n];
                        int *count = calloc((size_t)n, sizeof *count);
                        /* the first k of each of the 3 ranks */
                        for (int r = 0; r < 3; r++) {
                            nb_distributed_options o = {3, r, shuffle, 7, drop};
                            nb_sampler *s = nb_sampler_distributed(n, &o);
                            nb_sampler_set_epoch(s, epoch);
                            ck_assert_int_eq(nb_sampler_distributed_taken(s, k), c);
                            int64_t len;
                            int64_t *v = indices_of(s, &len);
                            for (int64_t j = 0; j < k && j < len; j++) count[v[j]]++;
                            free(v);
                            nb_sampler_free(s);
                        }
                        for (int r = 0; r < world2; r++) {
                            nb_distributed_options o = {world2, r, shuffle, 7, drop};
                            nb_sampler *s = nb_sampler_distributed(n, &o);
                            nb_sampler_distributed_resume(s, epoch, c);
                            nb_sampler_set_epoch(s, epoch);
                            int64_t len;
                            int64_t *v = indices_of(s, &len);
                            ck_assert_msg(len == per, "n %lld, c %lld, R' %d: %lld indices, expected %lld",
                                          (long long)n, (long long)c, world2, (long long)len, (long long)per);
                            for (int64_t j = 0; j < len; j++) {
                                ck_assert_msg(v[j] == list[c + r + j * world2], "n %lld, c %lld, R' %d, rank %d: "
                                              "index %lld is %lld, expected %lld", (long long)n, (long long)c,
                                              world2, r, (long long)j, (long long)v[j],
                                              (long long)list[c + r + j * world2]);
                                count[v[j]]++;
                            }
                            ck_assert_int_eq(nb_sampler_distributed_taken(s, 2), c + 2 * world2);
                            free(v);
                            /* the next epoch is whole again */
                            nb_sampler_set_epoch(s, epoch + 1);
                            ck_assert_int_eq(nb_sampler_len(s), drop ? n / world2 : (n + world2 - 1) / world2);
                            ck_assert_int_eq(nb_sampler_distributed_taken(s, 1), world2);
                            nb_sampler_free(s);
                        }
                        int64_t twice = 0, never = 0;
                        for (int64_t i = 0; i < n; i++) {
                            ck_assert_int_le(count[i], 2);
                            twice += count[i] == 2;
                            never += count[i] == 0;
                        }
                        if (drop) {
                            ck_assert_int_eq(twice, 0);
                            ck_assert_int_eq(never, m % world2);
                        } else {
                            ck_assert_int_eq(never, 0);
                            ck_assert_int_eq(twice, c + per * world2 - n > 0 ? c + per * world2 - n : 0);
                        }
                        free(count);
                        free(list);
                        free(perm);
                    }
}
END_TEST

/* A loader notices a resumed epoch at its next seek. */
START_TEST(test_loader_sees_resume) {
    float x[12];
    int64_t y[12];
    for (int i = 0; i < 12; i++) x[i] = (float)i, y[i] = i;
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_dataset *ds = nb_dataset_from_tensors(nb_from_host(ctx, NB_F32, NB_SHAPE(12, 1), x),
                                             nb_from_host(ctx, NB_I64, NB_SHAPE(12), y));
    nb_distributed_options o = {2, 1, false, 0, true};
    nb_sampler *s = nb_sampler_distributed(12, &o);
    nb_loader *l;
    nb_loader_options lo = {.batch_size = 2, .drop_last = true, .sampler = s};
    ck_assert_int_eq(nb_loader_new(&l, ds, &lo), NB_OK);
    ck_assert_int_eq(nb_loader_len(l), 3);
    nb_sampler_distributed_resume(s, 0, 5); /* 5 taken: rank 1 of 2 takes 6, 8, 10 */
    ck_assert_int_eq(nb_loader_seek(l, 0, 0), NB_OK);
    ck_assert_int_eq(nb_loader_len(l), 2); /* batch floor(5 / 4) = 1 comes next, the last */
    nb_batch b;
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.indices[0], 6);
    ck_assert_int_eq(b.indices[1], 8);
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_ptr_null(b.inputs); /* the end of epoch 0 */
    ck_assert_int_eq(nb_loader_next(l, ctx, &b), NB_OK);
    ck_assert_int_eq(b.indices[0], 1); /* epoch 1 whole: 1, 3, 5, ... */
    ck_assert_int_eq(b.indices[1], 3);
    nb_loader_free(l);
    nb_sampler_free(s);
    nb_dataset_free(ds);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_sampler_misuse) {
    nb_distributed_options o = {.world_size = 2, .rank = 2};
    NBT_EXPECT_ABORT(nb_sampler_distributed(10, &o), "rank 2 is not in [0, 2)");
    o.world_size = 0;
    o.rank = 0;
    NBT_EXPECT_ABORT(nb_sampler_distributed(10, &o), "world_size 0 must be >= 1");
    NBT_EXPECT_ABORT(nb_sampler_shard(10, 3, -1), "nb_sampler_shard: rank -1 is not in [0, 3)");
    NBT_EXPECT_ABORT(nb_sampler_sequential(-1), "nb_sampler_sequential: n = -1");
    nb_sampler *s = nb_sampler_sequential(10);
    NBT_EXPECT_ABORT(nb_sampler_distributed_resume(s, 0, 4),
                     "nb_sampler_distributed_resume: the sampler is sequential, not a distributed sampler");
    NBT_EXPECT_ABORT(nb_sampler_distributed_taken(s, 1),
                     "nb_sampler_distributed_taken: the sampler is sequential, not a distributed sampler");
    NBT_EXPECT_ABORT(nb_sampler_distributed_resume(NULL, 0, 4), "nb_sampler_distributed_resume: the sampler is NULL");
    NBT_EXPECT_ABORT(nb_sampler_distributed_taken(NULL, 1), "nb_sampler_distributed_taken: the sampler is NULL");
    NBT_EXPECT_ABORT(nb_batch_sampler_new(s, 0, false), "batch_size 0 must be > 0");
    nb_batch_sampler *bs = nb_batch_sampler_new(s, 4, true);
    int64_t idx[4];
    NBT_EXPECT_ABORT(nb_batch_sampler_get(bs, 2, idx), "batch 2 is out of range (2 batches");
    nb_batch_sampler_free(bs);
    nb_sampler_free(s);
    nb_metric_sums m;
    NBT_EXPECT_ABORT(nb_metric_sums_init(&m, 9), "9 metrics (at most 8)");
}
END_TEST

int main(void) {
    const TTest *tests[] = {test_sequential_and_random, test_permutations_are_uniform, test_ddp_walkthrough,
                             test_ten_on_three_ranks, test_distributed_against_reference,
                             test_set_epoch_changes_order, test_exact_eval_shards_and_metrics,
                             test_batch_sampler, test_distributed_resume_other_world, test_loader_sees_resume,
                             test_sampler_misuse, NULL};
    return nbt_run(nbt_suite("data_sampler", "sampler", 0, tests));
}
