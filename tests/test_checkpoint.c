/* Checkpoints: the safetensors layout byte for byte, reading back every
 * dtype, strict loading with its report of missing and unexpected keys,
 * atomic saves under injected write failures, every kind of corrupt file
 * refused with its message (plus every truncation and every header byte
 * flipped), and a save -> load round trip that resumes training bit for
 * bit. */
#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint/safetensors.h"
#include "tensor/internal.h"
#include "testutil.h"

/* Files left in nbt_tmpdir (named, so a test can assert that there are none). */
static int count_files(const char *substr) {
    DIR *d = opendir(nbt_tmpdir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.' && (!substr || strstr(e->d_name, substr))) n++;
    closedir(d);
    return n;
}



static void write_bytes(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, len, f), len);
    fclose(f);
}

/* A file with header length `declared`, the JSON text and data_len data bytes. */
static void write_raw(const char *path, uint64_t declared, const char *json, size_t data_len) {
    size_t jl = strlen(json);
    unsigned char *b = calloc(1, 8 + jl + data_len);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(declared >> (8 * i));
    memcpy(b + 8, json, jl);
    for (size_t i = 0; i < data_len; i++) b[8 + jl + i] = (unsigned char)(i * 37 + 1);
    write_bytes(path, b, 8 + jl + data_len);
    free(b);
}

static void expect_open_fails(const char *path, nb_status want, const char *substr) {
    nb_checkpoint *ck = (nb_checkpoint *)1;
    nb_status st = nb_checkpoint_open(path, &ck);
    ck_assert_msg(st == want, "open gave %s (%s), wanted %s", nb_status_str(st), nb_last_error(),
                  nb_status_str(want));
    ck_assert_ptr_null(ck);
    ck_assert_msg(strncmp(nb_last_error(), path, strlen(path)) == 0, "message \"%s\" does not "
                  "start with the path", nb_last_error());
    ck_assert_msg(strstr(nb_last_error(), substr), "message \"%s\" lacks \"%s\"", nb_last_error(),
                  substr);
}

/* A header with one JSON text, its length as declared, data_len bytes. */
static void expect_header_fails(const char *json, size_t data_len, const char *substr) {
    const char *p = nbt_tmp_path("bad.safetensors");
    write_raw(p, strlen(json), json, data_len);
    expect_open_fails(p, NB_ERR_FORMAT, substr);
}

/* ---- layout and reading ---- */
NBT_CPU_TEST(test_layout_and_read_back) {
    nb_tensor *f32 = nb_from_host(ctx, NB_F32, NB_SHAPE(2, 3), (float[]){1, -2, 3.5f, 0, 1e-30f, -0.0f});
    nb_tensor *f64 = nb_scalar(ctx, NB_F64, 3.141592653589793);
    nb_tensor *bf16 = nb_from_host(ctx, NB_BF16, NB_SHAPE(3), (uint16_t[]){0x3f80, 0xc000, 0x7fc0});
    nb_tensor *f16 = nb_from_host(ctx, NB_F16, NB_SHAPE(2), (uint16_t[]){0x3c00, 0xfbff});
    nb_tensor *i32 = nb_from_host(ctx, NB_I32, NB_SHAPE(2, 1, 2), (int32_t[]){1, -1, INT32_MAX, INT32_MIN});
    nb_tensor *i64 = nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){INT64_MIN, 42});
    nb_tensor *empty = nb_zeros(ctx, NB_F32, NB_SHAPE(0, 3));
    nb_tensor *strided = nb_transpose(ctx, nb_arange(ctx, NB_F32, 0, 6, 1), 0, 0);
    strided = nb_transpose(ctx, nb_reshape(ctx, nb_arange(ctx, NB_F32, 0, 6, 1), NB_SHAPE(2, 3)), 0, 1);
    ck_assert(!nb_is_contiguous(strided));
    nb_named_tensor ts[] = {{"w.f32", f32},  {"scalar", f64}, {"half.bf16", bf16},
                            {"half.f16", f16}, {"ints", i32}, {"longs", i64},
                            {"empty", empty}, {"t \"quoted\"\n\xc3\xa9", strided}};
    nb_kv meta[] = {{"step", "12"}, {"note", "a \"quote\", a \\ and \xe2\x82\xac"}};
    const char *path = nbt_tmp_path("a.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(path, ts, 8, meta, 2), NB_OK);
    ck_assert_int_eq(count_files(".tmp."), 0);

    /* the bytes: length, padded JSON, data back to back in the given order */
    size_t len;
    unsigned char *raw = nbt_slurp(path, &len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | raw[i];
    ck_assert_uint_eq((8 + n) % 8, 0);
    const char *expect_json =
        "{\"__metadata__\":{\"step\":\"12\",\"note\":\"a \\\"quote\\\", a \\\\ and \xe2\x82\xac\"},"
        "\"w.f32\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
        "\"scalar\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[24,32]},"
        "\"half.bf16\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[32,38]},"
        "\"half.f16\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[38,42]},"
        "\"ints\":{\"dtype\":\"I32\",\"shape\":[2,1,2],\"data_offsets\":[42,58]},"
        "\"longs\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[58,74]},"
        "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[74,74]},"
        "\"t \\\"quoted\\\"\\n\xc3\xa9\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[74,98]}}";
    size_t jl = strlen(expect_json);
    ck_assert_uint_ge(n, jl);
    ck_assert_uint_lt(n, jl + 8);
    ck_assert_mem_eq(raw + 8, expect_json, jl);
    for (size_t i = 8 + jl; i < 8 + n; i++) ck_assert_int_eq(raw[i], ' ');
    ck_assert_uint_eq(len, 8 + n + 98);
    const unsigned char *data = raw + 8 + n;
    float f32v[6];
    memcpy(f32v, data, 24);
    ck_assert_mem_eq(f32v, f32->data, 24);
    const unsigned char bf16_le[] = {0x80, 0x3f, 0x00, 0xc0, 0xc0, 0x7f}; /* little-endian */
    ck_assert_mem_eq(data + 32, bf16_le, 6);
    float tr[6] = {0, 3, 1, 4, 2, 5}; /* the transposed view, row-major */
    ck_assert_mem_eq(data + 74, tr, 24);
    free(raw);

    /* the read API */
    nb_checkpoint *ck;
    ck_assert_int_eq(nb_checkpoint_open(path, &ck), NB_OK);
    nb_checkpoint_set_allow_nonfinite(ck, true); /* half.bf16 holds a NaN */
    ck_assert_str_eq(nb_checkpoint_path(ck), path);
    ck_assert_int_eq(nb_checkpoint_count(ck), 8);
    ck_assert_int_eq(nb_checkpoint_meta_count(ck), 2);
    ck_assert_str_eq(nb_checkpoint_meta_at(ck, 0).key, "step");
    ck_assert_str_eq(nb_checkpoint_meta(ck, "note"), meta[1].value);
    ck_assert_ptr_null(nb_checkpoint_meta(ck, "nothing"));
    for (int i = 0; i < 8; i++) { /* file order is the save order here */
        const nb_checkpoint_entry *e = nb_checkpoint_entry_at(ck, i);
        ck_assert_str_eq(e->name, ts[i].name);
        ck_assert_int_eq(e->dtype, ts[i].tensor->dtype);
        ck_assert_int_eq(e->ndim, ts[i].tensor->ndim);
        for (int d = 0; d < e->ndim; d++) ck_assert_int_eq(e->shape[d], ts[i].tensor->shape[d]);
        ck_assert_uint_eq(e->nbytes, nb_numel(ts[i].tensor) * nb_dtype_size(e->dtype));
        ck_assert_ptr_eq(nb_checkpoint_find(ck, e->name), e);
        nb_tensor *back = nb_empty_like(ctx, ts[i].tensor);
        ck_assert_int_eq(nb_checkpoint_read(ck, e->name, back), NB_OK);
        nb_tensor *orig = nb_contiguous(ctx, ts[i].tensor);
        ck_assert_mem_eq(back->data, orig->data, e->nbytes);
    }
    ck_assert_uint_eq(nb_checkpoint_find(ck, "scalar")->offset, 8 + n + 24);
    ck_assert_ptr_null(nb_checkpoint_find(ck, "missing"));
    /* converting read, and into a non-contiguous destination */
    nb_tensor *as64 = nb_empty(ctx, NB_F64, NB_SHAPE(2, 3));
    ck_assert_int_eq(nb_checkpoint_read(ck, "w.f32", as64), NB_OK);
    nbt_assert_close(as64, (double[]){1, -2, 3.5, 0, (double)1e-30f, 0}, 0, 0);
    nb_tensor *dst = nb_transpose(ctx, nb_zeros(ctx, NB_F32, NB_SHAPE(3, 2)), 0, 1);
    ck_assert_int_eq(nb_checkpoint_read(ck, "w.f32", dst), NB_OK);
    nbt_assert_tensors_close(dst, f32, 0, 0);
    /* errors */
    ck_assert_int_eq(nb_checkpoint_read(ck, "nope", as64), NB_ERR_NOT_FOUND);
    ck_assert(strstr(nb_last_error(), "no tensor named \"nope\""));
    ck_assert_int_eq(nb_checkpoint_read(ck, "ints", as64), NB_ERR_MISMATCH);
    ck_assert(strstr(nb_last_error(), "tensor \"ints\" has shape (2, 1, 2) in the file, the "
                     "destination has (2, 3)"));
    NBT_EXPECT_ABORT(nb_checkpoint_entry_at(ck, 8), "nb_checkpoint_entry_at: index 8 out of range (8 entries)");
    nb_checkpoint_close(ck);
    nb_checkpoint_close(NULL);

    /* no metadata at all: no __metadata__ key */
    ck_assert_int_eq(nb_checkpoint_save(path, ts, 1, NULL, 0), NB_OK);
    raw = nbt_slurp(path, &len);
    ck_assert_mem_eq(raw + 8, "{\"w.f32\":", 9);
    free(raw);
    /* nothing at all */
    ck_assert_int_eq(nb_checkpoint_save(path, NULL, 0, NULL, 0), NB_OK);
    raw = nbt_slurp(path, &len);
    ck_assert_uint_eq(len, 16);
    ck_assert_mem_eq(raw, "\x08\0\0\0\0\0\0\0{}      ", 16);
    free(raw);
    ck_assert_int_eq(nb_checkpoint_load(path, NULL, 0), NB_OK);
}

NBT_CPU_TEST(test_strict_load) {
    nb_named_tensor saved[] = {{"a", nbt_randn(ctx, NB_F32, NB_SHAPE(4), 1)},
                               {"b", nbt_randn(ctx, NB_F32, NB_SHAPE(2, 3), 2)},
                               {"c", nbt_randn(ctx, NB_F64, NB_SHAPE(1), 3)},
                               {"e", nbt_randn(ctx, NB_F64, NB_SHAPE(2), 4)}};
    const char *path = nbt_tmp_path("s.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(path, saved, 4, NULL, 0), NB_OK);
    nb_tensor *a = nb_full(ctx, NB_F32, NB_SHAPE(4), 7.0);
    nb_named_tensor want[] = {{"a", a},
                              {"b", nb_zeros(ctx, NB_F32, NB_SHAPE(3, 2))},
                              {"d", nb_zeros(ctx, NB_F32, NB_SHAPE(1))},
                              {"e", nb_zeros(ctx, NB_F32, NB_SHAPE(2))}};
    ck_assert_int_eq(nb_checkpoint_load(path, want, 4), NB_ERR_MISMATCH);
    char expect[512];
    snprintf(expect, sizeof expect, "%s: error(s) loading 4 tensors, nothing was read: missing "
             "key(s) (1): \"d\"; unexpected key(s) (1): \"c\"; shape mismatch for \"b\": (2, 3) in "
             "the file, (3, 2) in the tensor; dtype mismatch for \"e\": F64 in the file, F32 in the "
             "tensor", path);
    ck_assert_str_eq(nb_last_error(), expect);
    nbt_assert_close(a, (double[]){7, 7, 7, 7}, 0, 0); /* nothing was read */

    /* long lists are cut */
    nb_named_tensor many[12];
    char names[12][8];
    for (int i = 0; i < 12; i++) {
        snprintf(names[i], sizeof names[i], "m%d", i);
        many[i].name = names[i];
        many[i].tensor = a;
    }
    ck_assert_int_eq(nb_checkpoint_load(path, many, 12), NB_ERR_MISMATCH);
    ck_assert(strstr(nb_last_error(), "missing key(s) (12): \"m0\", \"m1\", \"m2\", \"m3\", \"m4\", "
                     "\"m5\" and 6 more; unexpected key(s) (4): \"a\", \"b\", \"c\", \"e\""));
    /* only the kinds of error there are: no "missing key(s) (0): none" */
    ck_assert_int_eq(nb_checkpoint_load(path, want, 2), NB_ERR_MISMATCH);
    snprintf(expect, sizeof expect, "%s: error(s) loading 2 tensors, nothing was read: unexpected "
             "key(s) (2): \"c\", \"e\"; shape mismatch for \"b\": (2, 3) in the file, (3, 2) in "
             "the tensor", path);
    ck_assert_str_eq(nb_last_error(), expect);
    nb_named_tensor five[] = {{"a", a}, {"b", nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3))},
                              {"c", nb_zeros(ctx, NB_F64, NB_SHAPE(1))},
                              {"e", nb_zeros(ctx, NB_F64, NB_SHAPE(2))},
                              {"z", nb_zeros(ctx, NB_F64, NB_SHAPE(2))}};
    ck_assert_int_eq(nb_checkpoint_load(path, five, 5), NB_ERR_MISMATCH);
    snprintf(expect, sizeof expect, "%s: error(s) loading 5 tensors, nothing was read: missing "
             "key(s) (1): \"z\"", path);
    ck_assert_str_eq(nb_last_error(), expect);
    five[4] = (nb_named_tensor){"e", nb_zeros(ctx, NB_F32, NB_SHAPE(2))};
    ck_assert_int_eq(nb_checkpoint_load(path, (nb_named_tensor[]){five[0], five[1], five[2], five[4]}, 4),
                     NB_ERR_MISMATCH);
    snprintf(expect, sizeof expect, "%s: error(s) loading 4 tensors, nothing was read: dtype "
             "mismatch for \"e\": F64 in the file, F32 in the tensor", path);
    ck_assert_str_eq(nb_last_error(), expect);
    /* exactly right: loads */
    nb_named_tensor right[] = {{"e", nb_zeros(ctx, NB_F64, NB_SHAPE(2))}, {"a", a},
                               {"c", nb_zeros(ctx, NB_F64, NB_SHAPE(1))},
                               {"b", nb_zeros(ctx, NB_F32, NB_SHAPE(2, 3))}};
    ck_assert_int_eq(nb_checkpoint_load(path, right, 4), NB_OK);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            if (strcmp(right[i].name, saved[j].name) == 0)
                ck_assert_mem_eq(right[i].tensor->data, saved[j].tensor->data,
                                 nb_numel(saved[j].tensor) * nb_dtype_size(saved[j].tensor->dtype));
    nb_named_tensor twice[] = {{"a", a}, {"a", a}};
    NBT_EXPECT_ABORT(nb_checkpoint_load(path, twice, 2), "nb_checkpoint_load: two tensors are named \"a\"");
    ck_assert_int_eq(nb_checkpoint_load(nbt_tmp_path("none.safetensors"), right, 4), NB_ERR_NOT_FOUND);
    ck_assert(strstr(nb_last_error(), "none.safetensors: cannot open: No such file or directory"));
}

NBT_CPU_TEST(test_save_argument_errors) {
    nb_tensor *t = nb_zeros(ctx, NB_F32, NB_SHAPE(2));
    const char *path = nbt_tmp_path("e.safetensors");
    nb_named_tensor dup[] = {{"x", t}, {"y", t}, {"x", t}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, dup, 3, NULL, 0), "nb_checkpoint_save: two tensors are named \"x\"");
    nb_named_tensor reserved[] = {{"__metadata__", t}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, reserved, 1, NULL, 0), "\"__metadata__\" is reserved");
    nb_named_tensor bad_utf8[] = {{"a\xff", t}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, bad_utf8, 1, NULL, 0), "tensor name \"a\xff\" is not valid UTF-8");
    nb_named_tensor null_t[] = {{"n", NULL}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, null_t, 1, NULL, 0), "tensor \"n\" is NULL");
    nb_named_tensor unnamed[] = {{NULL, t}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, unnamed, 1, NULL, 0), "tensor 0 has no name");
    nb_kv meta[] = {{"k", "1"}, {"k", "2"}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, dup, 1, meta, 2), "two metadata entries are named \"k\"");
    nb_kv null_meta[] = {{"k", NULL}};
    NBT_EXPECT_ABORT(nb_checkpoint_save(path, dup, 1, null_meta, 1), "metadata entry 0 has a NULL key or value");
    NBT_EXPECT_ABORT(nb_checkpoint_save(NULL, dup, 1, NULL, 0), "no path given");
    ck_assert_int_eq(count_files(NULL), 0);
}

/* ---- atomic saves ---- */
typedef struct fault {
    uint64_t at; /* fail the write that reaches this offset */
    int writes;
} fault;

static bool fail_at(uint64_t offset, size_t bytes, void *user) {
    fault *f = user;
    f->writes++;
    return offset + bytes > f->at;
}

NBT_CPU_TEST(test_atomic_save) {
    int64_t big = (int64_t)5 << 20; /* 20 MiB of f32: written in two chunks */
    nb_named_tensor v1[] = {{"w", nbt_randn(ctx, NB_F32, NB_SHAPE(3, 4), 1)},
                            {"big", nb_zeros(ctx, NB_F32, 1, &big)}};
    nb_named_tensor v2[] = {{"w", nbt_randn(ctx, NB_F32, NB_SHAPE(3, 4), 2)}, v1[1]};
    nb_kv m1[] = {{"version", "1"}}, m2[] = {{"version", "2"}};
    const char *path = nbt_tmp_path("ckpt.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(path, v1, 2, m1, 1), NB_OK);
    size_t len1;
    unsigned char *before = nbt_slurp(path, &len1);

    /* a write fails at the first byte, in the header, in the first tensor,
     * and in the second chunk of the big tensor: the old file survives */
    uint64_t fail_points[] = {0, 20, 200, 8 + 200 + 48 + ((uint64_t)16 << 20) + 10};
    for (int k = 0; k < 4; k++) {
        fault f = {fail_points[k], 0};
        nb__st_set_fault(fail_at, &f);
        nb_status st = nb_checkpoint_save(path, v2, 2, m2, 1);
        nb__st_set_fault(NULL, NULL);
        ck_assert_int_eq(st, NB_ERR_IO);
        ck_assert_msg(strstr(nb_last_error(), "nb_checkpoint_save: writing \"") &&
                          strstr(nb_last_error(), "ckpt.safetensors.tmp.") &&
                          strstr(nb_last_error(), "Input/output error"),
                      "message: %s", nb_last_error());
        ck_assert_int_ge(f.writes, k == 3 ? 4 : 1);
        nbt_assert_file_holds(path, before, len1);
        ck_assert_int_eq(count_files(".tmp."), 0); /* the partial file is gone */
        nb_checkpoint *ck;
        ck_assert_int_eq(nb_checkpoint_open(path, &ck), NB_OK);
        ck_assert_str_eq(nb_checkpoint_meta(ck, "version"), "1");
        nb_checkpoint_close(ck);
    }
    free(before);
    /* without the fault the new file replaces the old one */
    ck_assert_int_eq(nb_checkpoint_save(path, v2, 2, m2, 1), NB_OK);
    nb_tensor *w = nb_zeros(ctx, NB_F32, NB_SHAPE(3, 4));
    nb_named_tensor back[] = {{"w", w}, {"big", nb_zeros(ctx, NB_F32, 1, &big)}};
    ck_assert_int_eq(nb_checkpoint_load(path, back, 2), NB_OK);
    nbt_assert_tensors_close(w, v2[0].tensor, 0, 0);
    ck_assert_int_eq(count_files(NULL), 1);

    /* folders that do not exist are made (mkdir -p, 0777 less the umask: Note [Missing folders]) */
    mode_t old_mask = umask(027);
    ck_assert_int_eq(nb_checkpoint_save(nbt_tmp_path("no/such/dir/x.safetensors"), v2, 1, NULL, 0), NB_OK);
    umask(old_mask);
    const char *made[] = {"no", "no/such", "no/such/dir"};
    for (int i = 0; i < 3; i++) {
        struct stat sb;
        ck_assert_int_eq(stat(nbt_tmp_path(made[i]), &sb), 0);
        ck_assert(S_ISDIR(sb.st_mode));
        ck_assert_int_eq(sb.st_mode & 0777, 0750);
    }
    nb_named_tensor one[] = {{"w", w}};
    ck_assert_int_eq(nb_checkpoint_load(nbt_tmp_path("no/such/dir/x.safetensors"), one, 1), NB_OK);
    nbt_assert_tensors_close(w, v2[0].tensor, 0, 0);
    /* a file where a folder should be: refused, naming it */
    FILE *f = fopen(nbt_tmp_path("afile"), "w");
    fclose(f);
    ck_assert_int_eq(nb_checkpoint_save(nbt_tmp_path("afile/x.safetensors"), v2, 1, NULL, 0), NB_ERR_IO);
    ck_assert_msg(strstr(nb_last_error(), "nb_checkpoint_save: \"") &&
                      strstr(nb_last_error(), "afile\" exists and is not a folder"),
                  "message: %s", nb_last_error());
    ck_assert_int_eq(nb_checkpoint_save(nbt_tmp_path("afile/sub/x.safetensors"), v2, 1, NULL, 0), NB_ERR_IO);
    ck_assert_msg(strstr(nb_last_error(), "nb_checkpoint_save: cannot create the folder \"") &&
                      strstr(nb_last_error(), "afile/sub\" for \"") &&
                      strstr(nb_last_error(), "afile/sub/x.safetensors\": Not a directory"),
                  "message: %s", nb_last_error());
    /* nb_checkpoint_make_dir: the same walk, at a program's start */
    ck_assert_int_eq(nb_checkpoint_make_dir(nbt_tmp_path("runs/a/b/")), NB_OK);
    struct stat sb;
    ck_assert_int_eq(stat(nbt_tmp_path("runs/a/b"), &sb), 0);
    ck_assert(S_ISDIR(sb.st_mode));
    ck_assert_int_eq(nb_checkpoint_make_dir(nbt_tmp_path("runs/a/b")), NB_OK); /* there already */
    ck_assert_int_eq(nb_checkpoint_make_dir(nbt_tmp_path("afile")), NB_ERR_IO);
    ck_assert(strstr(nb_last_error(), "afile\" exists and is not a folder"));
    if (geteuid() != 0) { /* root writes anywhere */
        ck_assert_int_eq(chmod(nbt_tmp_path("runs/a/b"), 0500), 0);
        ck_assert_int_eq(nb_checkpoint_make_dir(nbt_tmp_path("runs/a/b")), NB_ERR_IO);
        ck_assert_msg(strstr(nb_last_error(), "nb_checkpoint_make_dir: cannot write in the folder \"") &&
                          strstr(nb_last_error(), "runs/a/b\": Permission denied"),
                      "message: %s", nb_last_error());
        ck_assert_int_eq(chmod(nbt_tmp_path("runs/a/b"), 0700), 0);
    }
    NBT_EXPECT_ABORT((void)!nb_checkpoint_make_dir(""), "nb_checkpoint_make_dir: the folder is NULL or empty");
    /* the target is a directory: the rename fails, the temporary file goes */
    mkdir(nbt_tmp_path("adir"), 0755);
    ck_assert_int_eq(nb_checkpoint_save(nbt_tmp_path("adir"), v2, 1, NULL, 0), NB_ERR_IO);
    ck_assert(strstr(nb_last_error(), "renaming \""));
    ck_assert(strstr(nb_last_error(), "Is a directory"));
    ck_assert_int_eq(count_files(".tmp."), 0);
}

/* ---- corrupt files ---- */
#define ENTRY(name, dtype, shape, b, e) \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

START_TEST(test_corrupt_files) {
    const char *p = nbt_tmp_path("c.safetensors");
    write_bytes(p, "", 0);
    expect_open_fails(p, NB_ERR_FORMAT, "truncated: the file has 0 bytes, fewer than the 8-byte header length");
    write_bytes(p, "\x10\0\0\0\0", 5);
    expect_open_fails(p, NB_ERR_FORMAT, "the file has 5 bytes");
    write_raw(p, 1000, "{}", 10);
    expect_open_fails(p, NB_ERR_FORMAT, "truncated: the header length says 1000 bytes but only 12 follow");
    write_raw(p, (uint64_t)1 << 63, "{}", 0);
    expect_open_fails(p, NB_ERR_FORMAT, "header length 9223372036854775808 is larger than the "
                      "100000000-byte limit (not a safetensors file, or a corrupt one)");
    write_raw(p, 100000001, "{}", 0);
    expect_open_fails(p, NB_ERR_FORMAT, "header length 100000001 is larger than");
    expect_open_fails(nbt_tmp_path("missing"), NB_ERR_NOT_FOUND, "cannot open: No such file or directory");
    mkdir(nbt_tmp_path("d"), 0755);
    expect_open_fails(nbt_tmp_path("d"), NB_ERR_IO, "not a regular file");

    expect_header_fails("hello", 0, "the header is not valid JSON: JSON: expected a value, found "
                        "'h' at byte 0");
    expect_header_fails("{\"a\":", 0, "not valid JSON: JSON: expected a value, found end of text at byte 5");
    expect_header_fails("{\"a\":{}}}", 0, "expected end of text after the value, found '}' at byte 8");
    expect_header_fails("\"\xff\"", 0, "invalid UTF-8 byte 0xff");
    expect_header_fails("[]", 0, "the header must be a JSON object, found an array");
    expect_header_fails("{" ENTRY("a", "U8", "[2]", 0, 2) "}", 2,
                        "tensor \"a\": unknown dtype \"U8\" (nabla reads F32, F64, BF16, F16, I32, I64)");
    expect_header_fails("{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                        "tensor \"a\": unknown dtype a number");
    expect_header_fails("{" ENTRY("a", "F32", "[2,3]", 0, 20) "}", 20,
                        "tensor \"a\": data_offsets [0, 20] hold 20 bytes but dtype F32 and shape (2, 3) need 24");
    expect_header_fails("{" ENTRY("a", "F32", "[-1]", 0, 0) "}", 0,
                        "tensor \"a\": shape entry 0 is not a non-negative integer");
    expect_header_fails("{" ENTRY("a", "F32", "[1.5]", 0, 0) "}", 0, "shape entry 0 is not");
    expect_header_fails("{" ENTRY("a", "F32", "7", 0, 0) "}", 0, "tensor \"a\": shape is a number, not an array");
    expect_header_fails("{" ENTRY("a", "F32", "[1,1,1,1,1,1,1]", 0, 4) "}", 4,
                        "tensor \"a\": shape has 7 dimensions; nabla supports at most 6");
    expect_header_fails("{" ENTRY("a", "F32", "[4294967296,4294967296,4294967296]", 0, 0) "}", 0,
                        "tensor \"a\": shape (4294967296, 4294967296, 4294967296) is too large");
    expect_header_fails("{" ENTRY("a", "F64", "[4611686018427387904]", 0, 0) "}", 0, "is too large");
    expect_header_fails("{" ENTRY("a", "F32", "[2,3]", 0, 24) "}", 16,
                        "tensor \"a\": data_offsets [0, 24] run past the end of the data section "
                        "(16 bytes; the file is truncated or the header lies)");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 8, 0) "}", 8, "data_offsets [8, 0] end before they begin");
    expect_header_fails("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
                        "tensor \"a\": data_offsets must be [begin, end] with two non-negative integers");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 0, 18446744073709551616) "}", 8,
                        "data_offsets must be [begin, end]");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 0, 8) "," ENTRY("b", "F32", "[2]", 4, 12) "}", 12,
                        "tensors \"a\" and \"b\" overlap (data_offsets [0, 8] and [4, 12])");
    expect_header_fails("{" ENTRY("b", "F32", "[2]", 0, 8) "," ENTRY("a", "F32", "[2]", 0, 8) "}", 8,
                        "overlap (data_offsets [0, 8] and [0, 8])");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 0, 8) "," ENTRY("b", "F32", "[2]", 12, 20) "}", 20,
                        "4 bytes of the data section before tensor \"b\" (data_offsets begin at 12) "
                        "belong to no tensor");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 4, 12) "}", 12, "4 bytes of the data section before tensor \"a\"");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 0, 8) "}", 12,
                        "the data section has 12 bytes but the tensors end at 8 (trailing bytes)");
    expect_header_fails("{}", 3, "the data section has 3 bytes but the tensors end at 0");
    expect_header_fails("{" ENTRY("a", "F32", "[2]", 0, 8) "," ENTRY("a", "F32", "[2]", 8, 16) "}", 16,
                        "tensor \"a\" appears twice");
    expect_header_fails("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "tensor \"a\": missing \"data_offsets\"");
    expect_header_fails("{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "tensor \"a\": missing \"dtype\"");
    expect_header_fails("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"foo\":1}}", 8,
                        "tensor \"a\": unexpected key \"foo\"");
    expect_header_fails("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                        "tensor \"a\": key \"dtype\" appears twice");
    expect_header_fails("{\"a\":12}", 0, "tensor \"a\": expected an object, found a number");
    expect_header_fails("{\"a\\u0000b\":{}}", 0, "tensor name \"a\" contains a NUL character");
    expect_header_fails("{\"__metadata__\":[]}", 0, "__metadata__ must be an object of strings, found an array");
    expect_header_fails("{\"__metadata__\":{\"k\":3}}", 0, "metadata value of \"k\" is a number, not a string");
    expect_header_fails("{\"__metadata__\":{\"k\":\"a\\u0000\"}}", 0, "metadata value of \"k\" contains a NUL");
    expect_header_fails("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, "metadata key \"k\" appears twice");
    expect_header_fails("{\"__metadata__\":{},\"__metadata__\":{}}", 0, "\"__metadata__\" appears twice");
    /* a long name is shortened in messages, and control characters hidden */
    char json[512];
    char longname[201];
    memset(longname, 'n', 200);
    longname[200] = 0;
    snprintf(json, sizeof json, "{\"%s\\n\":5}", longname);
    write_raw(p, strlen(json), json, 0);
    expect_open_fails(p, NB_ERR_FORMAT, "tensor \"nnnnnnnnnn");
    ck_assert(strstr(nb_last_error(), "...\": expected an object"));
    ck_assert(strlen(nb_last_error()) < 300);
}
END_TEST

/* Every prefix of a valid file, and every header byte changed, is refused
 * or read without going out of bounds (ASan checks the latter). */
NBT_CPU_TEST(test_truncations_and_flips) {
    nb_named_tensor ts[] = {{"a", nbt_randn(ctx, NB_F32, NB_SHAPE(3, 2), 1)},
                            {"b", nb_from_host(ctx, NB_I64, NB_SHAPE(2), (int64_t[]){5, 6})},
                            {"c", nb_zeros(ctx, NB_F16, NB_SHAPE(0))}};
    nb_kv meta[] = {{"k", "v"}};
    const char *good = nbt_tmp_path("good.safetensors"), *p = nbt_tmp_path("x.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(good, ts, 3, meta, 1), NB_OK);
    size_t len;
    unsigned char *raw = nbt_slurp(good, &len);
    for (size_t cut = 0; cut < len; cut++) {
        write_bytes(p, raw, cut);
        nb_checkpoint *ck;
        ck_assert_msg(nb_checkpoint_open(p, &ck) != NB_OK, "a %zu-byte prefix of %zu was accepted",
                      cut, len);
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | raw[i];
    int accepted = 0;
    unsigned char *mut = malloc(len);
    const unsigned char subst[] = {0, '"', '{', '}', '[', ']', ',', ':', '9', 'x', 0x80, 0xff};
    for (size_t pos = 0; pos < 8 + n; pos++)
        for (size_t s = 0; s < sizeof subst; s++) {
            if (raw[pos] == subst[s]) continue;
            memcpy(mut, raw, len);
            mut[pos] = subst[s];
            write_bytes(p, mut, len);
            nb_checkpoint *ck;
            if (nb_checkpoint_open(p, &ck) != NB_OK) continue;
            accepted++;
            for (int i = 0; i < nb_checkpoint_count(ck); i++) {
                const nb_checkpoint_entry *e = nb_checkpoint_entry_at(ck, i);
                ck_assert_uint_le(e->offset + e->nbytes, len);
                nb_tensor *t = nb_empty(ctx, e->dtype, e->ndim, e->shape);
                ck_assert_int_eq(nb_checkpoint_read(ck, e->name, t), NB_OK);
            }
            nb_checkpoint_close(ck);
        }
    ck_assert_int_gt(accepted, 0); /* e.g. a changed name or metadata value */
    free(mut);
    free(raw);
}

/* ---- training checkpoints ---- */
#define IN 4
#define HID 8
#define OUT 3
#define ROWS 16
#define BATCH 4
#define BATCHES (ROWS / BATCH)

typedef struct model {
    nb_ctx *params, *step;
    nb_tensor *w1, *b1, *w2;
    nb_named_tensor named[3];
    nb_tensor *x, *y;
    nb_optim *opt;
    nb_lr_schedule sched;
} model;

/* Parameters from `seed`; the data are always the same. */
static void model_init(model *m, nb_optim_kind kind, uint64_t seed) {
    m->params = nb_ctx_new(nb_cpu(), 0);
    m->step = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(seed);
    m->w1 = nb_rand_uniform(m->params, NB_F32, NB_SHAPE(IN, HID), -0.5, 0.5, &rng);
    m->b1 = nb_rand_uniform(m->params, NB_F32, NB_SHAPE(HID), -0.5, 0.5, &rng);
    m->w2 = nb_rand_uniform(m->params, NB_F32, NB_SHAPE(HID, OUT), -0.5, 0.5, &rng);
    nb_tensor *ps[] = {m->w1, m->b1, m->w2};
    const char *names[] = {"fc1.weight", "fc1.bias", "fc2.weight"};
    for (int i = 0; i < 3; i++) {
        nb_set_requires_grad(ps[i], true);
        m->named[i].name = names[i];
        m->named[i].tensor = ps[i];
    }
    nb_rng data = nb_rng_make(99);
    m->x = nb_rand_normal(m->params, NB_F32, NB_SHAPE(ROWS, IN), 0, 1, &data);
    int64_t labels[ROWS];
    for (int i = 0; i < ROWS; i++) labels[i] = (i * 7) % OUT;
    m->y = nb_from_host(m->params, NB_I64, NB_SHAPE(ROWS), labels);
    nb_optim_hparams h = kind == NB_OPTIM_SGD ? NB_SGD_DEFAULTS
                         : kind == NB_OPTIM_ADAM ? NB_ADAM_DEFAULTS : NB_ADAMW_DEFAULTS;
    if (kind == NB_OPTIM_SGD) {
        h.momentum = 0.9;
        h.nesterov = true;
        h.weight_decay = 1e-3;
    } else {
        h.weight_decay = 0.05;
    }
    nb_named_tensor scratch[3];
    nb_param_group groups[2];
    nb_optim_split_decay(m->named, 3, &h, scratch, groups);
    m->opt = nb_optim_new_groups(kind, 2, groups);
    m->sched = nb_lr_cosine(0.05, 3, 12, 0.005);
}

static void model_free(model *m) {
    nb_optim_free(m->opt);
    nb_ctx_free(m->step);
    nb_ctx_free(m->params);
}

/* One training step at the position in st, which it advances. */
static float train_step(model *m, nb_train_state *st) {
    nb_ctx *c = m->step;
    nb_ctx_reset(c);
    int64_t row = st->data_position * BATCH;
    nb_tensor *x = nb_narrow(c, m->x, 0, row, BATCH);
    nb_tensor *y = nb_narrow(c, m->y, 0, row, BATCH);
    nb_tensor *h = nb_tanh(c, nb_add(c, nb_matmul(c, x, m->w1), m->b1));
    h = nb_dropout(c, h, 0.25, true, &st->rng);
    nb_tensor *loss = nb_cross_entropy(c, nb_matmul(c, h, m->w2), y, NULL);
    nb_optim_zero_grad(m->opt);
    nb_backward(loss);
    nb_optim_clip_grad_norm(m->opt, 0.5, 2.0);
    nb_optim_set_lr_all(m->opt, nb_lr_schedule_at(&m->sched, st->step));
    nb_optim_step(m->opt);
    st->step++;
    if (++st->data_position == BATCHES) {
        st->data_position = 0;
        st->epoch++;
    }
    return (float)nb_item(loss);
}

static void assert_same_bits(const nb_named_tensor *a, const nb_named_tensor *b, int n) {
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(a[i].name, b[i].name);
        size_t bytes = (size_t)nb_numel(a[i].tensor) * nb_dtype_size(a[i].tensor->dtype);
        ck_assert_msg(memcmp(a[i].tensor->data, b[i].tensor->data, bytes) == 0,
                      "%s differs after resuming", a[i].name);
    }
}

START_TEST(test_resume_is_bit_identical) {
    nb_optim_kind kinds[] = {NB_OPTIM_ADAMW, NB_OPTIM_ADAM, NB_OPTIM_SGD};
    const int steps = 10, half = 5;
    for (int k = 0; k < 3; k++) {
        /* straight through */
        model a;
        model_init(&a, kinds[k], 1);
        nb_train_state sa = {0, 0, 0, nb_rng_make(7)};
        float loss_a[10];
        for (int i = 0; i < steps; i++) loss_a[i] = train_step(&a, &sa);

        /* half, save, and everything thrown away */
        model b;
        model_init(&b, kinds[k], 1);
        nb_train_state sb = {0, 0, 0, nb_rng_make(7)};
        for (int i = 0; i < half; i++) train_step(&b, &sb);
        const char *path = nbt_tmp_path("train.safetensors");
        nb_kv extra[] = {{"run", "test"}};
        ck_assert_int_eq(nb_checkpoint_save_training(path, b.named, 3, b.opt, &sb, extra, 1), NB_OK);
        model_free(&b);

        /* fresh parameters (other values), a fresh optimizer, then load */
        model c;
        model_init(&c, kinds[k], 12345);
        nb_train_state sc = {0};
        ck_assert_int_eq(nb_checkpoint_load_training(path, c.named, 3, c.opt, &sc), NB_OK);
        ck_assert_int_eq(sc.step, half);
        ck_assert_int_eq(sc.epoch, 1);
        ck_assert_int_eq(sc.data_position, 1);
        ck_assert(sc.rng.seed == 7 && sc.rng.offset > 0);
        ck_assert_int_eq(nb_optim_step_count(c.opt), half);
        for (int i = half; i < steps; i++) {
            float l = train_step(&c, &sc);
            ck_assert_msg(memcmp(&l, &loss_a[i], sizeof l) == 0, "%s: loss at step %d: %.9g vs %.9g",
                          nb_optim_kind_name(kinds[k]), i, l, loss_a[i]);
        }
        assert_same_bits(a.named, c.named, 3);
        int na, nc;
        const nb_named_tensor *st_a = nb_optim_state(a.opt, &na), *st_c = nb_optim_state(c.opt, &nc);
        ck_assert_int_eq(na, nc);
        assert_same_bits(st_a, st_c, na);
        ck_assert(sa.step == sc.step && sa.epoch == sc.epoch && sa.data_position == sc.data_position);
        ck_assert(sa.rng.seed == sc.rng.seed && sa.rng.offset == sc.rng.offset);

        /* metadata as documented */
        nb_checkpoint *ck;
        ck_assert_int_eq(nb_checkpoint_open(path, &ck), NB_OK);
        const char *expect[][2] = {{"format", "pt"}, {"nabla_version", "0.1.0"}, {"step", "5"},
                                   {"epoch", "1"}, {"data_position", "1"}, {"rng_seed", "7"},
                                   {"optimizer", nb_optim_kind_name(kinds[k])}, {"run", "test"}};
        for (int i = 0; i < 8; i++) ck_assert_str_eq(nb_checkpoint_meta(ck, expect[i][0]), expect[i][1]);
        ck_assert_ptr_nonnull(nb_checkpoint_find(ck, "optim.state.fc1.weight.step"));
        nb_checkpoint_close(ck);
        model_free(&a);
        model_free(&c);
    }
}
END_TEST

START_TEST(test_training_load_errors) {
    model m;
    model_init(&m, NB_OPTIM_ADAMW, 1);
    nb_train_state st = {3, 0, 3, nb_rng_make(5)};
    train_step(&m, &st);
    const char *path = nbt_tmp_path("t.safetensors");
    ck_assert_int_eq(nb_checkpoint_save_training(path, m.named, 3, m.opt, &st, NULL, 0), NB_OK);
    nb_train_state out = {0};

    /* another kind of optimizer, same tensor names: refused by the metadata */
    model other;
    model_init(&other, NB_OPTIM_ADAM, 2);
    ck_assert_int_eq(nb_checkpoint_load_training(path, other.named, 3, other.opt, &out), NB_ERR_MISMATCH);
    ck_assert(strstr(nb_last_error(), "the checkpoint holds optimizer state of kind \"adamw\" but the "
                     "optimizer is adam, nothing was read"));
    /* no optimizer: the model alone loads, optim.* is ignored */
    ck_assert_int_eq(nb_checkpoint_load_training(path, other.named, 3, NULL, &out), NB_OK);
    assert_same_bits(other.named, m.named, 3);
    ck_assert_int_eq(out.step, 4);
    ck_assert_int_eq(out.epoch, 1);
    ck_assert_int_eq(out.data_position, 0);
    model_free(&other);

    /* a model that lacks a tensor: strict */
    ck_assert_int_eq(nb_checkpoint_load_training(path, m.named, 2, m.opt, &out), NB_ERR_MISMATCH);
    ck_assert_msg(strstr(nb_last_error(), "nothing was read: unexpected key(s) (1): \"fc2.weight\"") &&
                      !strstr(nb_last_error(), "missing"),
                  "%s", nb_last_error());
    /* not a training checkpoint */
    const char *plain = nbt_tmp_path("plain.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(plain, m.named, 3, NULL, 0), NB_OK);
    ck_assert_int_eq(nb_checkpoint_load_training(plain, m.named, 3, NULL, &out), NB_ERR_FORMAT);
    ck_assert(strstr(nb_last_error(), "not a training checkpoint: metadata key \"step\" is missing"));
    /* bad metadata values */
    nb_kv bad[] = {{"step", "12a"}, {"epoch", "0"}, {"data_position", "0"}, {"rng_seed", "1"},
                   {"rng_offset", "0"}, {"optimizer", "none"}};
    ck_assert_int_eq(nb_checkpoint_save(plain, m.named, 3, bad, 6), NB_OK);
    ck_assert_int_eq(nb_checkpoint_load_training(plain, m.named, 3, NULL, &out), NB_ERR_FORMAT);
    ck_assert(strstr(nb_last_error(), "metadata \"step\" = \"12a\" is not a non-negative integer"));
    bad[0].value = "1";
    bad[3].value = "-1";
    ck_assert_int_eq(nb_checkpoint_save(plain, m.named, 3, bad, 6), NB_OK);
    ck_assert_int_eq(nb_checkpoint_load_training(plain, m.named, 3, NULL, &out), NB_ERR_FORMAT);
    ck_assert(strstr(nb_last_error(), "metadata \"rng_seed\" = \"-1\" is not an unsigned 64-bit integer"));
    bad[3].value = "18446744073709551616";
    ck_assert_int_eq(nb_checkpoint_save(plain, m.named, 3, bad, 6), NB_OK);
    ck_assert_int_eq(nb_checkpoint_load_training(plain, m.named, 3, NULL, &out), NB_ERR_FORMAT);
    bad[3].value = "18446744073709551615";
    ck_assert_int_eq(nb_checkpoint_save(plain, m.named, 3, bad, 6), NB_OK);
    ck_assert_int_eq(nb_checkpoint_load_training(plain, m.named, 3, NULL, &out), NB_OK);
    ck_assert(out.rng.seed == UINT64_MAX && out.step == 1);

    /* out-of-range optimizer state is caught after loading */
    int n;
    const nb_named_tensor *state = nb_optim_state(m.opt, &n);
    ck_assert_str_eq(state[1].name, "optim.group.0.lr");
    nb_fill_(state[1].tensor, -1.0);
    ck_assert_int_eq(nb_checkpoint_save_training(path, m.named, 3, m.opt, &st, NULL, 0), NB_OK);
    nb_fill_(state[1].tensor, 0.01);
    ck_assert_int_eq(nb_checkpoint_load_training(path, m.named, 3, m.opt, &out), NB_ERR_FORMAT);
    char expect[256];
    snprintf(expect, sizeof expect, "%s: optimizer state (adamw): optim.group.0: lr = -1 must be "
             "finite and >= 0", path);
    ck_assert_str_eq(nb_last_error(), expect);

    nb_kv reserved[] = {{"epoch", "3"}};
    NBT_EXPECT_ABORT(nb_checkpoint_save_training(path, m.named, 3, m.opt, &st, reserved, 1),
                     "extra metadata key \"epoch\" is reserved");
    model_free(&m);
}
END_TEST

/* ---- stale temporary files ---- */

/* This host's part of temporary names, by the rule in docs/checkpoints.md:
 * the host name with everything but letters, digits, '-' and '_' as '_'. */
static void host_tag(char *out, size_t n) {
    char h[256] = {0};
    ck_assert_int_eq(gethostname(h, sizeof h - 1), 0);
    size_t k = 0;
    for (const char *c = h; *c && k + 1 < n && k < 64; c++)
        out[k++] = (isalnum((unsigned char)*c) || *c == '-' || *c == '_') ? *c : '_';
    out[k] = 0;
}

/* The pid of a process that has exited and been reaped. */
static pid_t dead_pid(void) {
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) _exit(0);
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    return pid;
}

static bool exists(const char *path) { return access(path, F_OK) == 0; }

static const char *touch(const char *name) {
    const char *p = nbt_tmp_path(name);
    write_bytes(p, "partial", 7);
    return p;
}

/* A save removes the temporaries of its own path whose writer (on this
 * host) is gone, and nothing else. */
NBT_CPU_TEST(test_stale_temps_removed) {
    nb_named_tensor v[] = {{"w", nbt_randn(ctx, NB_F32, NB_SHAPE(3, 4), 1)}};
    char host[72], name[9][256];
    host_tag(host, sizeof host);
    long dead = (long)dead_pid(), self = (long)getpid(), parent = (long)getppid();
    snprintf(name[0], 256, "ckpt.safetensors.tmp.%s.%ld.0", host, dead);     /* removed */
    snprintf(name[1], 256, "ckpt.safetensors.tmp.%s.%ld.3", host, parent);   /* live writer */
    snprintf(name[2], 256, "ckpt.safetensors.tmp.%s.%ld.1", host, self);     /* our own */
    snprintf(name[3], 256, "ckpt.safetensors.tmp.%s_x.%ld.0", host, dead);   /* another host */
    snprintf(name[4], 256, "ckpt.safetensors.tmp.%ld.0", dead);              /* older form */
    snprintf(name[5], 256, "other.safetensors.tmp.%s.%ld.0", host, dead);    /* another path */
    snprintf(name[6], 256, "ckpt.safetensors.tmp.%s.%ld.0.bak", host, dead); /* not the pattern */
    snprintf(name[7], 256, "ckpt.safetensors.tmp.%s.0.0", host);             /* pid 0: a group */
    snprintf(name[8], 256, "notes.txt");
    for (int i = 0; i < 9; i++) touch(name[i]);
    ck_assert(exists(nbt_tmp_path(name[0])));
    ck_assert_int_eq(nb_checkpoint_save(nbt_tmp_path("ckpt.safetensors"), v, 1, NULL, 0), NB_OK);
    ck_assert_msg(!exists(nbt_tmp_path(name[0])), "%s (writer %ld gone) was not removed", name[0],
                  dead);
    for (int i = 1; i < 9; i++)
        ck_assert_msg(exists(nbt_tmp_path(name[i])), "%s was removed", name[i]);
    ck_assert_int_eq(count_files(NULL), 9); /* 8 kept + the checkpoint */
    /* a path without a directory part scans the working directory */
    char cwd[4096];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof cwd));
    ck_assert_int_eq(chdir(nbt_tmpdir), 0);
    touch(name[0]);
    nb_status st = nb_checkpoint_save("ckpt.safetensors", v, 1, NULL, 0);
    ck_assert_int_eq(chdir(cwd), 0);
    ck_assert_int_eq(st, NB_OK);
    ck_assert(!exists(nbt_tmp_path(name[0])));
}

static bool kill_self_at(uint64_t offset, size_t bytes, void *user) {
    (void)bytes;
    if (offset >= *(uint64_t *)user) raise(SIGKILL);
    return false;
}

/* A writer killed outright in the middle of a large checkpoint: the old
 * file is intact, the partial temporary file stays until the next save. */
NBT_CPU_TEST(test_killed_writer_cleaned_by_next_save) {
    int64_t big = (int64_t)10 << 20; /* 40 MiB of f32: written in 16 MiB chunks */
    nb_named_tensor v1[] = {{"w", nbt_randn(ctx, NB_F32, NB_SHAPE(3, 4), 1)}};
    nb_named_tensor v2[] = {v1[0], {"big", nb_zeros(ctx, NB_F32, 1, &big)}};
    const char *path = nbt_tmp_path("ckpt.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(path, v1, 1, NULL, 0), NB_OK);
    size_t len1;
    unsigned char *before = nbt_slurp(path, &len1);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) { /* dies after the first 16 MiB chunk reached the file */
        uint64_t at = (uint64_t)16 << 20;
        nb__st_set_fault(kill_self_at, &at);
        nb_checkpoint_save(path, v2, 2, NULL, 0);
        _exit(3);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "status %d", status);
    char host[72], tmp[256];
    host_tag(host, sizeof host);
    snprintf(tmp, sizeof tmp, "ckpt.safetensors.tmp.%s.%ld.", host, (long)pid);
    ck_assert_int_eq(count_files(tmp), 1); /* the crash left its partial file */
    DIR *d = opendir(nbt_tmpdir);
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, tmp)) {
            struct stat sb;
            ck_assert_int_eq(stat(nbt_tmp_path(e->d_name), &sb), 0);
            ck_assert_int_ge(sb.st_size, 16 << 20);
        }
    closedir(d);
    nbt_assert_file_holds(path, before, len1);
    free(before);
    ck_assert_int_eq(nb_checkpoint_save(path, v1, 1, NULL, 0), NB_OK);
    ck_assert_int_eq(count_files(".tmp."), 0);
    ck_assert_int_eq(count_files(NULL), 1);
}

/* Note [NULL handles] in util/handle.h */
START_TEST(test_null_handles) {
    nb_checkpoint *ck = (nb_checkpoint *)1;
    (void)nb_checkpoint_open("no/such/dir/ckpt.safetensors", &ck); /* status ignored */
    ck_assert_ptr_null(ck);
    NBT_EXPECT_ABORT(nb_checkpoint_count(ck), "nb_checkpoint_count: the checkpoint is NULL: the "
                     "call that should have made it most likely failed and its nb_status was not "
                     "checked (last error on this thread: ");
    NBT_EXPECT_ABORT(nb_checkpoint_count(ck), "no/such/dir/ckpt.safetensors");
    NBT_EXPECT_ABORT(nb_checkpoint_find(ck, "w"), "nb_checkpoint_find: the checkpoint is NULL");
    NBT_EXPECT_ABORT(nb_checkpoint_meta(ck, "step"), "nb_checkpoint_meta: the checkpoint is NULL");
    NBT_EXPECT_ABORT(nb_checkpoint_read_strict(ck, NULL, 0), "nb_checkpoint_read_strict: the checkpoint");
    nb_checkpoint_close(ck); /* NULL is fine */
}
END_TEST

/* Note [Values checked at load]: a NaN or infinite value, or a negative Adam
 * second moment, is refused naming the file, tensor and element, unless
 * allowed. */
START_TEST(test_nonfinite_refused) {
    model m;
    model_init(&m, NB_OPTIM_ADAMW, 1);
    nb_train_state st = {0, 0, 0, nb_rng_make(5)};
    train_step(&m, &st);
    const char *path = nbt_tmp_path("nan.safetensors");
    nb_set(m.w2, (int64_t[]){5, 1}, NAN);
    ck_assert_int_eq(nb_checkpoint_save_training(path, m.named, 3, m.opt, &st, NULL, 0), NB_OK);
    nb_set(m.w2, (int64_t[]){5, 1}, 0.25);
    nb_train_state out = {0};
    char want[512];
    snprintf(want, sizeof want, "%s: tensor \"fc2.weight\" (8, 3): element (5, 1) is nan, not "
             "finite: the run that saved it had diverged", path);
    ck_assert_int_eq(nb_checkpoint_load_training(path, m.named, 3, m.opt, &out), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), want), "got: %s", nb_last_error());
    /* allowed: loads, the NaN included */
    nb_checkpoint_load_options allow = {.allow_nonfinite = true};
    ck_assert_int_eq(nb_checkpoint_load_training_ex(path, m.named, 3, m.opt, &out, &allow), NB_OK);
    ck_assert(isnan(nb_get(m.w2, (int64_t[]){5, 1})));
    nb_set(m.w2, (int64_t[]){5, 1}, 0.25);
    /* the reading handle: refused, then allowed */
    const char *plain = nbt_tmp_path("plain_inf.safetensors");
    nb_set(m.b1, (int64_t[]){7}, -INFINITY);
    ck_assert_int_eq(nb_checkpoint_save(plain, m.named, 3, NULL, 0), NB_OK);
    nb_set(m.b1, (int64_t[]){7}, 0);
    ck_assert_int_eq(nb_checkpoint_load(plain, m.named, 3), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), "tensor \"fc1.bias\" (8,): element (7,) is -inf, not finite"),
                  "got: %s", nb_last_error());
    nb_checkpoint *ck;
    ck_assert_int_eq(nb_checkpoint_open(plain, &ck), NB_OK);
    nb_checkpoint_set_allow_nonfinite(ck, true);
    ck_assert_int_eq(nb_checkpoint_read_strict(ck, m.named, 3), NB_OK);
    nb_checkpoint_close(ck);
    ck_assert(isinf(nb_get(m.b1, (int64_t[]){7})));
    nb_set(m.b1, (int64_t[]){7}, 0);
    /* bf16 in the file, read into f32: the file's values are checked */
    nb_ctx *c = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *h = nb_cast(c, nb_from_host(c, NB_F32, NB_SHAPE(3), (float[]){1, INFINITY, 2}), NB_BF16);
    const char *half = nbt_tmp_path("bf16.safetensors");
    ck_assert_int_eq(nb_checkpoint_save(half, &(nb_named_tensor){"h", h}, 1, NULL, 0), NB_OK);
    ck_assert_int_eq(nb_checkpoint_open(half, &ck), NB_OK);
    ck_assert_int_eq(nb_checkpoint_read(ck, "h", nb_zeros(c, NB_F32, NB_SHAPE(3))), NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), "tensor \"h\" (3,): element (1,) is inf"), "got: %s",
                  nb_last_error());
    nb_checkpoint_close(ck);
    nb_ctx_free(c);
    /* a negative second moment: refused even when non-finite values are allowed */
    int n;
    const nb_named_tensor *state = nb_optim_state(m.opt, &n);
    nb_tensor *v = NULL;
    for (int i = 0; i < n; i++)
        if (strcmp(state[i].name, "optim.state.fc2.weight.exp_avg_sq") == 0) v = state[i].tensor;
    ck_assert_ptr_nonnull(v);
    double keep = nb_get(v, (int64_t[]){0, 2});
    nb_set(v, (int64_t[]){0, 2}, -0.5);
    ck_assert_int_eq(nb_checkpoint_save_training(path, m.named, 3, m.opt, &st, NULL, 0), NB_OK);
    nb_set(v, (int64_t[]){0, 2}, keep);
    snprintf(want, sizeof want, "%s: tensor \"optim.state.fc2.weight.exp_avg_sq\" (8, 3): element "
             "(0, 2) is -0.5, negative: a second moment of Adam is a mean of squares", path);
    ck_assert_int_eq(nb_checkpoint_load_training_ex(path, m.named, 3, m.opt, &out, &allow),
                     NB_ERR_FORMAT);
    ck_assert_msg(strstr(nb_last_error(), want), "got: %s", nb_last_error());
    /* without an optimizer the state is not read, and the model (negative
     * weights included) loads */
    ck_assert_int_eq(nb_checkpoint_load_training(path, m.named, 3, NULL, &out), NB_OK);
    model_free(&m);
}
END_TEST

int main(void) {
    const TTest *tests[] = {test_layout_and_read_back, test_strict_load, test_save_argument_errors, test_atomic_save,
                             test_stale_temps_removed, test_killed_writer_cleaned_by_next_save, test_corrupt_files,
                             test_truncations_and_flips, test_resume_is_bit_identical, test_training_load_errors,
                             test_null_handles, test_nonfinite_refused, NULL};
    return nbt_run(nbt_suite_in_tmpdir("checkpoint", "core", 120, "nb_ckpt_", tests));
}
