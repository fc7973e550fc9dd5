/* DDP's bucket partition and bucket orders (distributed/ddp_buckets.c,
 * Note [Buckets] in ddp.c) on hand-made sizes: the first-bucket rule, the
 * cap, one dtype per bucket, oversized parameters, the order rebuilt
 * from the order in which gradients became ready, and the default cap. Expected buckets are
 * worked out by hand in the comments. */
#include <stdio.h>
#include <string.h>

#include "distributed/ddp_buckets.h"
#include "testutil.h"

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void expect_starts(const int *got, int nb, const int *want, int n_want) {
    ck_assert_int_eq(nb, n_want - 1);
    for (int i = 0; i < n_want; i++) ck_assert_msg(got[i] == want[i], "starts[%d] = %d, want %d", i, got[i], want[i]);
}

START_TEST(test_first_bucket_then_cap) {
    /* f32 sizes 40, 80, 120, 160 bytes; reverse order 3, 2, 1, 0.
     * first = 100: {3} (160 >= 100); cap = 200: {2, 1} (120 + 80 = 200 >= 200); {0}. */
    int64_t numel[] = {10, 20, 30, 40};
    nb_dtype dt[] = {NB_F32, NB_F32, NB_F32, NB_F32};
    int order[4], starts[5];
    nb__ddp_initial_order(4, order);
    ck_assert(order[0] == 3 && order[1] == 2 && order[2] == 1 && order[3] == 0);
    int nb = nb__ddp_partition(4, order, numel, dt, 100, 200, starts);
    int want[] = {0, 1, 3, 4};
    expect_starts(starts, nb, want, N_OF(want));
}
END_TEST

START_TEST(test_small_first_bucket) {
    /* first = 1 byte: the first bucket is the first parameter alone; a cap
     * above the total puts the rest together. */
    int64_t numel[] = {5, 5, 5, 5, 5};
    nb_dtype dt[] = {NB_F64, NB_F64, NB_F64, NB_F64, NB_F64};
    int order[] = {4, 3, 2, 1, 0}, starts[6];
    int nb = nb__ddp_partition(5, order, numel, dt, 1, 1000, starts);
    int want[] = {0, 1, 5};
    expect_starts(starts, nb, want, N_OF(want));
}
END_TEST

START_TEST(test_one_dtype_per_bucket) {
    /* order 0 1 2 3 with dtypes f32 f32 bf16 f32 and room for all: the
     * dtype changes close buckets: {0, 1}, {2}, {3}. */
    int64_t numel[] = {1, 1, 1, 1};
    nb_dtype dt[] = {NB_F32, NB_F32, NB_BF16, NB_F32};
    int order[] = {0, 1, 2, 3}, starts[5];
    int nb = nb__ddp_partition(4, order, numel, dt, 1 << 20, 1 << 20, starts);
    int want[] = {0, 2, 3, 4};
    expect_starts(starts, nb, want, N_OF(want));
}
END_TEST

START_TEST(test_oversized_and_empty) {
    /* f32: 4000 bytes, 4, 4 with first = 8, cap = 8: {0} alone (over the
     * limit, never split), then {1, 2} (8 >= 8). */
    int64_t numel[] = {1000, 1, 1};
    nb_dtype dt[] = {NB_F32, NB_F32, NB_F32};
    int order[] = {0, 1, 2}, starts[4];
    int nb = nb__ddp_partition(3, order, numel, dt, 8, 8, starts);
    int want[] = {0, 1, 3};
    expect_starts(starts, nb, want, N_OF(want));
    int none[1] = {-1};
    ck_assert_int_eq(nb__ddp_partition(0, order, numel, dt, 8, 8, none), 0);
    ck_assert_int_eq(none[0], 0);
}
END_TEST

START_TEST(test_rebuild_from_ready_order) {
    /* 6 parameters; backward made 2, 5, 0 ready (3, 4, 1 never): those
     * come first as they were ready, the rest in reverse registration. */
    int ready[] = {2, 5, 0}, order[6];
    nb__ddp_rebuild_order(6, ready, 3, order);
    int want[] = {2, 5, 0, 4, 3, 1};
    for (int i = 0; i < 6; i++) ck_assert_msg(order[i] == want[i], "order[%d] = %d, want %d", i, order[i], want[i]);
    /* The partition follows the new order: sizes (f32) 4, 8, 12, 16, 20, 24
     * bytes for 0..5; first = 12: {2} (12 >= 12); cap = 30: {5, 0, 4}
     * (24 + 4 + 20 = 48 >= 30, the crossing one included); {3, 1}. */
    int64_t numel[] = {1, 2, 3, 4, 5, 6};
    nb_dtype dt[] = {NB_F32, NB_F32, NB_F32, NB_F32, NB_F32, NB_F32};
    int starts[7];
    int nb = nb__ddp_partition(6, order, numel, dt, 12, 30, starts);
    int want_starts[] = {0, 1, 4, 6};
    expect_starts(starts, nb, want_starts, N_OF(want_starts));
    /* every parameter ready: the ready order is the order */
    int all[] = {1, 0, 2};
    nb__ddp_rebuild_order(3, all, 3, order);
    ck_assert(order[0] == 1 && order[1] == 0 && order[2] == 2);
    int twice[] = {1, 1};
    NBT_EXPECT_ABORT(nb__ddp_rebuild_order(3, twice, 2, order), "ready order entry 1 (1) is out of range or repeated");
}
END_TEST

START_TEST(test_default_cap) {
    /* Note [Default bucket cap]: a sixteenth of the gradients' bytes, within
     * 256 KiB (262144) and 25 MiB (26214400). */
    ck_assert_uint_eq(nb__ddp_default_cap(0), 262144);
    ck_assert_uint_eq(nb__ddp_default_cap(3246592), 262144);       /* bench_ddp's GPT: 202912 raised to the floor */
    ck_assert_uint_eq(nb__ddp_default_cap(16 * 262144), 262144);   /* 4 MiB: exactly the floor */
    ck_assert_uint_eq(nb__ddp_default_cap(5283840), 330240);       /* 5283840 / 16 */
    ck_assert_uint_eq(nb__ddp_default_cap(8u << 20), 524288);      /* 8 MiB: 512 KiB */
    ck_assert_uint_eq(nb__ddp_default_cap(16 * 26214400), 26214400); /* 400 MiB: exactly PyTorch's cap */
    ck_assert_uint_eq(nb__ddp_default_cap(497758208), 26214400);   /* GPT-2 small's f32 gradients: 25 MiB */
    ck_assert_uint_eq(nb__ddp_default_first(), 1048576);
}
END_TEST

NBT_MAIN("dist_buckets", "partition", 0,
         test_first_bucket_then_cap, test_small_first_bucket, test_one_dtype_per_bucket, test_oversized_and_empty,
         test_rebuild_from_ready_order, test_default_cap)
