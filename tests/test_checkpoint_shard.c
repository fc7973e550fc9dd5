/* Sharded checkpoints (Note [Sharded checkpoint] in checkpoint/sharded.c):
 * a training state cut into 3 ranks' pieces, saved as shards and an index,
 * consolidates to the file nb_checkpoint_save_training writes byte for
 * byte, reads back at 2 ranks' ranges and loads whole; a truncated,
 * missing or foreign shard is refused naming it; shards without their
 * index leave the previous checkpoint in force; pieces that leave a gap or
 * overlap are refused before any index is written. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

static void copy_file(const char *from, const char *to) {
    size_t n;
    unsigned char *b = nbt_slurp(from, &n);
    FILE *f = fopen(to, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(b, 1, n, f), n);
    fclose(f);
    free(b);
}

/* ---- a small model trained with AdamW ---- */
typedef struct model {
    nb_ctx *ctx, *step;
    nb_named_tensor named[3];
    nb_optim *opt;
} model;

static void model_init(model *m, uint64_t seed) {
    m->ctx = nb_ctx_new(nb_cpu(), 0);
    m->step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(seed);
    const char *names[] = {"fc1.weight", "fc1.bias", "fc2.weight"};
    int64_t shapes[3][2] = {{5, 7}, {7, 1}, {7, 3}};
    for (int i = 0; i < 3; i++) {
        nb_tensor *t = nb_rand_uniform(m->ctx, NB_F32, i == 1 ? 1 : 2, shapes[i], -0.5, 0.5, &rng);
        nb_set_requires_grad(t, true);
        m->named[i] = (nb_named_tensor){names[i], t};
    }
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 0.01;
    m->opt = nb_optim_new(NB_OPTIM_ADAMW, m->named, 3, &h);
}

static void model_free(model *m) {
    nb_optim_free(m->opt);
    nb_ctx_free(m->step);
    nb_ctx_free(m->ctx);
}

/* loss = sum(tanh(x W1 + b1) W2)^2 on fixed x */
static void train(model *m, int steps) {
    for (int s = 0; s < steps; s++) {
        nb_ctx *c = m->step;
        nb_ctx_reset(c);
        nb_rng data = nb_rng_make(7 + (uint64_t)s);
        nb_tensor *x = nb_rand_normal(c, NB_F32, NB_SHAPE(4, 5), 0, 1, &data);
        nb_tensor *h = nb_tanh(c, nb_add(c, nb_matmul(c, x, m->named[0].tensor),
                                         nb_reshape(c, m->named[1].tensor, NB_SHAPE(7))));
        nb_tensor *y = nb_matmul(c, h, m->named[2].tensor);
        nb_tensor *loss = nb_sum_all(c, nb_mul(c, y, y));
        nb_optim_zero_grad(m->opt);
        nb_backward(loss);
        nb_optim_step(m->opt);
    }
}

/* Every tensor of the training checkpoint (model, then optimizer state). */
static nb_named_tensor *full_list(model *m, int *n) {
    int n_opt;
    const nb_named_tensor *st = nb_optim_state(m->opt, &n_opt);
    nb_named_tensor *all = malloc(sizeof *all * (size_t)(3 + n_opt));
    memcpy(all, m->named, sizeof m->named);
    memcpy(all + 3, st, sizeof *all * (size_t)n_opt);
    *n = 3 + n_opt;
    return all;
}

/* Rank r's share of tensor i (numel len): uneven cuts that differ per
 * tensor; a scalar goes whole to rank i % 3. */
static void cut(int i, int64_t len, int r, int64_t *a, int64_t *b) {
    if (len == 1) {
        *a = 0;
        *b = r == i % 3 ? 1 : 0;
        return;
    }
    int64_t c[4] = {0, len / 3 + i % 2, 2 * len / 3 + (i % 3 == 0), len};
    *a = c[r];
    *b = c[r + 1];
}

/* The pieces rank r of 3 writes of all[0..n): views of elements [a, b). */
static int pieces_of(nb_ctx *ctx, const nb_named_tensor *all, int n, int r, nb_checkpoint_piece *out) {
    int k = 0;
    for (int i = 0; i < n; i++) {
        nb_tensor *t = all[i].tensor;
        int64_t len = nb_numel(t), a, b;
        cut(i, len, r, &a, &b);
        if (a == b) continue;
        nb_tensor *flat = nb_reshape(ctx, t, NB_SHAPE(len));
        out[k] = (nb_checkpoint_piece){.name = all[i].name, .order = i, .ndim = t->ndim, .start = a,
                                       .data = nb_narrow(ctx, flat, 0, a, b - a)};
        memcpy(out[k].shape, t->shape, sizeof out[k].shape);
        k++;
    }
    return k;
}

static void save_sharded(model *m, const char *index, const char *id, const nb_train_state *st, bool with_index) {
    int n;
    nb_named_tensor *all = full_list(m, &n);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_checkpoint_piece *pc = malloc(sizeof *pc * (size_t)n);
    for (int r = 0; r < 3; r++) {
        int k = pieces_of(ctx, all, n, r, pc);
        ck_assert_int_eq(nb_checkpoint_save_shard(index, id, r, 3, pc, k), NB_OK);
    }
    nb_kv extra[] = {{"program", "test"}};
    if (with_index)
        ck_assert_msg(nb_checkpoint_save_training_index(index, id, 3, m->opt, st, extra, 1) == NB_OK, "%s",
                      nb_last_error());
    free(pc);
    nb_ctx_free(ctx);
    free(all);
}

static void assert_equal(const nb_named_tensor *a, const nb_named_tensor *b, int n) {
    for (int i = 0; i < n; i++) {
        size_t bytes = (size_t)nb_numel(a[i].tensor) * nb_dtype_size(a[i].tensor->dtype);
        ck_assert_msg(memcmp(a[i].tensor->data, b[i].tensor->data, bytes) == 0, "%s differs", a[i].name);
    }
}

START_TEST(test_shard_consolidate_and_reshard) {
    model m;
    model_init(&m, 1);
    train(&m, 3);
    nb_train_state st = {3, 1, 2, {11, 44}};
    nb_kv extra[] = {{"program", "test"}};
    char plain[4096], index[4096], cons[4096];
    snprintf(plain, sizeof plain, "%s", nbt_tmp_path("plain.safetensors"));
    snprintf(index, sizeof index, "%s", nbt_tmp_path("ckpt.safetensors"));
    snprintf(cons, sizeof cons, "%s", nbt_tmp_path("cons.safetensors"));
    ck_assert_int_eq(nb_checkpoint_save_training(plain, m.named, 3, m.opt, &st, extra, 1), NB_OK);
    save_sharded(&m, index, "save-1", &st, true);

    /* one unit: the index and its shards */
    nb_checkpoint *ck;
    ck_assert_int_eq(nb_checkpoint_open(index, &ck), NB_OK);
    ck_assert(nb_checkpoint_is_sharded(ck));
    ck_assert_int_eq(nb_checkpoint_count(ck), 0);
    ck_assert_str_eq(nb_checkpoint_meta(ck, "step"), "3");
    ck_assert_str_eq(nb_checkpoint_meta(ck, "shard_dir"), "save-1.shards");
    nb_checkpoint_close(ck);
    struct stat sb;
    ck_assert_int_eq(stat(nbt_tmp_path("save-1.shards/rank2-of-3.safetensors"), &sb), 0);

    /* consolidated: the plain file, byte for byte */
    ck_assert_msg(nb_checkpoint_consolidate(index, cons) == NB_OK, "%s", nb_last_error());
    size_t np;
    unsigned char *bp = nbt_slurp(plain, &np);
    nbt_assert_file_holds(cons, bp, np); /* the plain file's bytes */
    free(bp);

    /* resharded: 2 ranks read their halves of every tensor */
    int n;
    nb_named_tensor *all = full_list(&m, &n);
    nb_checkpoint_sharded *sh;
    ck_assert_int_eq(nb_checkpoint_sharded_open(index, &sh), NB_OK);
    ck_assert_int_eq(nb_checkpoint_sharded_count(sh), n);
    ck_assert_int_eq(nb_checkpoint_sharded_shards(sh), 3);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = all[i].tensor;
        ck_assert_str_eq(nb_checkpoint_sharded_entry_at(sh, i)->name, all[i].name); /* checkpoint order */
        int64_t len = nb_numel(t), half = (len + 1) / 2;
        size_t size = nb_dtype_size(t->dtype);
        for (int r = 0; r < 2; r++) {
            int64_t a = r * half, b = a + half < len ? a + half : len;
            if (a >= b) continue;
            nb_tensor *dst = nb_empty(ctx, t->dtype, 1, (int64_t[]){b - a});
            ck_assert_msg(nb_checkpoint_sharded_read_range(sh, all[i].name, a, dst) == NB_OK, "%s", nb_last_error());
            ck_assert_msg(memcmp(dst->data, (char *)t->data + (size_t)a * size, (size_t)(b - a) * size) == 0,
                          "%s: elements [%lld, %lld) read at 2 ranks differ", all[i].name, (long long)a,
                          (long long)b);
        }
    }
    /* a range past the end, a name not there */
    NBT_EXPECT_STATUS(nb_checkpoint_sharded_read_range(sh, "fc1.bias", 5, nb_empty(ctx, NB_F32, NB_SHAPE(3))),
                      NB_ERR_MISMATCH, "elements [5, 8) of tensor \"fc1.bias\" (7,) do not exist");
    NBT_EXPECT_STATUS(nb_checkpoint_sharded_read(sh, "nope", nb_empty(ctx, NB_F32, NB_SHAPE(1))), NB_ERR_NOT_FOUND,
                      "no tensor named \"nope\"");
    nb_checkpoint_sharded_close(sh);

    /* loaded whole into a fresh model and optimizer: the same bits */
    model f;
    model_init(&f, 2);
    train(&f, 1);
    nb_train_state got;
    ck_assert_msg(nb_checkpoint_load_training(index, f.named, 3, f.opt, &got) == NB_OK, "%s", nb_last_error());
    ck_assert_int_eq(got.step, 3);
    ck_assert_int_eq(got.epoch, 1);
    ck_assert_int_eq(got.data_position, 2);
    ck_assert_uint_eq(got.rng.offset, 44);
    int nf;
    nb_named_tensor *fall = full_list(&f, &nf);
    ck_assert_int_eq(nf, n);
    assert_equal(all, fall, n);
    /* and trains on as the original does */
    train(&m, 2);
    train(&f, 2);
    assert_equal(all, fall, n);
    free(fall);
    free(all);
    nb_ctx_free(ctx);
    model_free(&f);
    model_free(&m);
}
END_TEST

START_TEST(test_shard_damage_refused) {
    model m;
    model_init(&m, 1);
    train(&m, 2);
    nb_train_state st = {2, 0, 2, {11, 44}}, got;
    char index[4096], r1[4096], keep[4096], other[4096];
    snprintf(index, sizeof index, "%s", nbt_tmp_path("ckpt.safetensors"));
    snprintf(r1, sizeof r1, "%s", nbt_tmp_path("a.shards/rank1-of-3.safetensors"));
    snprintf(keep, sizeof keep, "%s", nbt_tmp_path("keep"));
    snprintf(other, sizeof other, "%s", nbt_tmp_path("b.shards/rank1-of-3.safetensors"));
    save_sharded(&m, index, "a", &st, true);
    save_sharded(&m, nbt_tmp_path("other.safetensors"), "b", &st, true);
    copy_file(r1, keep);

    /* cut short */
    size_t n;
    unsigned char *b = nbt_slurp(r1, &n);
    FILE *f = fopen(r1, "wb");
    ck_assert_uint_eq(fwrite(b, 1, n - 100, f), n - 100);
    fclose(f);
    free(b);
    char want[9000];
    snprintf(want, sizeof want, "%s: %zu bytes, but the index %s records %zu: the shard is truncated", r1, n - 100,
             index, n);
    nb_checkpoint_sharded *sh;
    NBT_EXPECT_STATUS(nb_checkpoint_sharded_open(index, &sh), NB_ERR_FORMAT, want);
    ck_assert_ptr_null(sh);
    NBT_EXPECT_STATUS(nb_checkpoint_load_training(index, m.named, 3, m.opt, &got), NB_ERR_FORMAT, want);

    /* missing */
    ck_assert_int_eq(unlink(r1), 0);
    snprintf(want, sizeof want, "%s: the shard of rank 1 of 3 is missing", r1);
    NBT_EXPECT_STATUS(nb_checkpoint_sharded_open(index, &sh), NB_ERR_NOT_FOUND, want);

    /* another save's shard in its place (the same size) */
    copy_file(other, r1);
    snprintf(want, sizeof want, "%s: not a shard of save \"a\" (its \"shard_save_id\" is \"b\")", r1);
    NBT_EXPECT_STATUS(nb_checkpoint_sharded_open(index, &sh), NB_ERR_FORMAT, want);

    /* put back: loads */
    copy_file(keep, r1);
    ck_assert_msg(nb_checkpoint_sharded_open(index, &sh) == NB_OK, "%s", nb_last_error());
    nb_checkpoint_sharded_close(sh);
    ck_assert_int_eq(nb_checkpoint_load_training(index, m.named, 3, m.opt, &got), NB_OK);

    /* a NaN in a shard is named with the whole tensor's element */
    nb_set(m.named[2].tensor, (int64_t[]){6, 1}, NAN);
    save_sharded(&m, index, "c", &st, true);
    NBT_EXPECT_STATUS(nb_checkpoint_load_training(index, m.named, 3, m.opt, &got), NB_ERR_FORMAT,
                      "c.shards/rank2-of-3.safetensors: tensor \"fc2.weight\" (7, 3): element (6, 1) is nan");
    model_free(&m);
}
END_TEST

START_TEST(test_shard_crash_before_index) {
    model m;
    model_init(&m, 1);
    train(&m, 3);
    nb_train_state st = {3, 0, 3, {11, 44}}, got;
    char index[4096], plain[4096];
    snprintf(index, sizeof index, "%s", nbt_tmp_path("ckpt.safetensors"));
    snprintf(plain, sizeof plain, "%s", nbt_tmp_path("plain.safetensors"));
    ck_assert_int_eq(nb_checkpoint_save_training(plain, m.named, 3, m.opt, &st, NULL, 0), NB_OK);
    save_sharded(&m, index, "s3", &st, true);
    size_t n0;
    unsigned char *before = nbt_slurp(index, &n0);

    /* two more steps; every shard written, then a crash before the index */
    train(&m, 2);
    st.step = 5;
    save_sharded(&m, index, "s5", &st, false);
    /* an index from shards that are not all there: refused, the old one stays */
    ck_assert_int_eq(unlink(nbt_tmp_path("s5.shards/rank2-of-3.safetensors")), 0);
    char want[9000];
    snprintf(want, sizeof want, "%s: the shard of rank 2 of 3 is missing", nbt_tmp_path("s5.shards/rank2-of-3.safetensors"));
    NBT_EXPECT_STATUS(nb_checkpoint_save_training_index(index, "s5", 3, m.opt, &st, NULL, 0), NB_ERR_NOT_FOUND, want);
    nbt_assert_file_holds(index, before, n0);
    free(before);

    /* the previous checkpoint is in force: step 3's state */
    model f, p;
    model_init(&f, 2);
    model_init(&p, 3);
    ck_assert_int_eq(nb_checkpoint_load_training(index, f.named, 3, f.opt, &got), NB_OK);
    ck_assert_int_eq(got.step, 3);
    ck_assert_int_eq(nb_checkpoint_load_training(plain, p.named, 3, p.opt, &got), NB_OK);
    int nf, np;
    nb_named_tensor *fa = full_list(&f, &nf), *pa = full_list(&p, &np);
    assert_equal(fa, pa, nf);
    free(fa);
    free(pa);
    model_free(&p);
    model_free(&f);
    model_free(&m);
}
END_TEST

/* Pieces that leave elements out or hold some twice: no index. */
NBT_CPU_TEST(test_shard_cover_refused) {
    nb_tensor *w = nb_arange(ctx, NB_F32, 0, 12, 1);
    const char *index = nbt_tmp_path("ckpt.safetensors");
    nb_checkpoint_piece p = {.name = "w", .order = 0, .ndim = 2, .shape = {3, 4}};
    /* rank 0: [0, 5), rank 1: [6, 12): element 5 in no shard */
    p.data = nb_narrow(ctx, w, 0, 0, 5);
    ck_assert_int_eq(nb_checkpoint_save_shard(index, "g", 0, 2, &p, 1), NB_OK);
    p.start = 6;
    p.data = nb_narrow(ctx, w, 0, 6, 6);
    ck_assert_int_eq(nb_checkpoint_save_shard(index, "g", 1, 2, &p, 1), NB_OK);
    NBT_EXPECT_STATUS(nb_checkpoint_save_index(index, "g", 2, NULL, 0), NB_ERR_FORMAT,
                      "tensor \"w\" (3, 4): elements [5, 6) are in no shard");
    /* rank 1: [4, 12): elements 4 twice */
    p.start = 4;
    p.data = nb_narrow(ctx, w, 0, 4, 8);
    ck_assert_int_eq(nb_checkpoint_save_shard(index, "o", 0, 2, &(nb_checkpoint_piece){.name = "w", .ndim = 2,
                                              .shape = {3, 4}, .data = nb_narrow(ctx, w, 0, 0, 5)}, 1), NB_OK);
    ck_assert_int_eq(nb_checkpoint_save_shard(index, "o", 1, 2, &p, 1), NB_OK);
    NBT_EXPECT_STATUS(nb_checkpoint_save_index(index, "o", 2, NULL, 0), NB_ERR_FORMAT,
                      "tensor \"w\" (3, 4): elements [4, 5) are stored twice");
    ck_assert_int_eq(access(index, F_OK), -1);
    /* the tail missing */
    ck_assert_int_eq(nb_checkpoint_save_shard(index, "t", 0, 1, &(nb_checkpoint_piece){.name = "w", .ndim = 2,
                                              .shape = {3, 4}, .data = nb_narrow(ctx, w, 0, 0, 11)}, 1), NB_OK);
    NBT_EXPECT_STATUS(nb_checkpoint_save_index(index, "t", 1, NULL, 0), NB_ERR_FORMAT,
                      "elements [11, 12) are in no shard");
    /* one piece outside its tensor, a bad save id: programmer errors */
    NBT_EXPECT_ABORT(nb_checkpoint_save_shard(index, "t", 0, 1, &(nb_checkpoint_piece){.name = "w", .ndim = 1,
                     .shape = {4}, .data = w}, 1), "elements [0, 12) outside its (4,)");
    NBT_EXPECT_ABORT(nb_checkpoint_save_shard(index, "../x", 0, 1, NULL, 0), "is not a plain name");
}

int main(void) {
    const TTest *tests[] = {test_shard_consolidate_and_reshard, test_shard_damage_refused,
                             test_shard_crash_before_index, test_shard_cover_refused, NULL};
    return nbt_run(nbt_suite_in_tmpdir("checkpoint_shard", "core", 60, "nb_shard_", tests));
}
