/* Shared test helpers (see testutil.h). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <dirent.h>
#include <sys/time.h>
#include <unistd.h>

#include "nabla/dist.h"

jmp_buf nbt_jmp;
volatile int nbt_abort_armed;
char nbt_abort_msg[1024];

static void test_abort_handler(const char *file, int line, const char *message, void *user) {
    (void)user;
    snprintf(nbt_abort_msg, sizeof nbt_abort_msg, "%s", message);
    if (nbt_abort_armed) longjmp(nbt_jmp, 1);
    ck_abort_msg("unexpected nabla abort at %s:%d: %s", file, line, message);
}

nb_tensor *nbt_randn(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape, uint64_t seed) {
    nb_rng rng = nb_rng_make(seed);
    return nb_rand_normal(ctx, dtype, ndim, shape, 0.0, 1.0, &rng);
}

nb_tensor *nbt_randn_leaf(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape, uint64_t seed) {
    nb_tensor *t = nbt_randn(ctx, dtype, ndim, shape, seed);
    nb_set_requires_grad(t, true);
    return t;
}

void nbt_twin_leaves(nb_ctx *ctx, int ndim, const int64_t *shape, uint64_t seed, nb_tensor **x64,
                     nb_tensor **x32) {
    *x64 = nbt_randn(ctx, NB_F64, ndim, shape, seed);
    *x32 = nb_cast(ctx, *x64, NB_F32);
    nb_set_requires_grad(*x64, true);
    nb_set_requires_grad(*x32, true);
}

nb_tensor *nbt_weighted_sum(nb_ctx *ctx, nb_tensor *y) {
    nb_tensor *r = nb_cast(ctx, nbt_randn(ctx, NB_F64, y->ndim, y->shape, 999), y->dtype);
    return nb_sum_all(ctx, nb_mul(ctx, y, r));
}

void nbt_assert_close(const nb_tensor *t, const double *expect, double atol, double rtol) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    nb_to_host_f64(t, v);
    for (int64_t i = 0; i < n; i++) {
        double tol = atol + rtol * fabs(expect[i]);
        if (!(fabs(v[i] - expect[i]) <= tol)) {
            double got = v[i];
            free(v);
            ck_abort_msg("element %lld of %s: got %.10g, expected %.10g (tol %.3g)", (long long)i,
                         nb_shape_str(t), got, expect[i], tol);
        }
    }
    free(v);
}

void nbt_assert_tensors_close(const nb_tensor *a, const nb_tensor *b, double atol, double rtol) {
    ck_assert_msg(nb_same_shape(a, b), "shapes differ: %s vs %s", nb_shape_str(a), nb_shape_str(b));
    int64_t n = nb_numel(b);
    double *e = malloc(sizeof(double) * (size_t)(n ? n : 1));
    nb_to_host_f64(b, e);
    nbt_assert_close(a, e, atol, rtol);
    free(e);
}

int nbt_run(Suite *s) {
    nb_set_abort_handler(test_abort_handler, NULL);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

static TCase *add_tcase(Suite *s, const char *tcase, double timeout_s, const TTest *const *tests) {
    TCase *tc = tcase_create(tcase);
    if (timeout_s > 0)
        tcase_set_timeout(tc, timeout_s);
    for (; *tests; tests++)
        tcase_add_test(tc, *tests);
    suite_add_tcase(s, tc);
    return tc;
}

void nbt_suite_add(Suite *s, const char *tcase, double timeout_s, const TTest *const *tests) {
    add_tcase(s, tcase, timeout_s, tests);
}

static const char *tmpdir_prefix;
static void tmpdir_setup(void) { nbt_tmpdir_make(tmpdir_prefix); }

Suite *nbt_suite_in_tmpdir(const char *name, const char *tcase, double timeout_s, const char *prefix,
                           const TTest *const *tests) {
    Suite *s = suite_create(name);
    tmpdir_prefix = prefix;
    tcase_add_checked_fixture(add_tcase(s, tcase, timeout_s, tests), tmpdir_setup, nbt_tmpdir_remove);
    return s;
}

Suite *nbt_suite(const char *name, const char *tcase, double timeout_s, const TTest *const *tests) {
    Suite *s = suite_create(name);
    nbt_suite_add(s, tcase, timeout_s, tests);
    return s;
}

int nbt_run_world(Suite *(*make_suite)(nb_pg *world)) {
    setenv("CK_FORK", "no", 1);
    nb_pg *world = NULL;
    nb_pg_options opts = {NB_PG_GLOO, 0};
    nb_status st = nb_pg_init(&world, &opts);
    if (st == NB_ERR_UNSUPPORTED) {
        fprintf(stderr, "skipped: %s\n", nb_last_error());
        return 77;
    }
    if (st != NB_OK) {
        fprintf(stderr, "nb_pg_init: %s\n", nb_last_error());
        return 1;
    }
    return nbt_pg_finish(world, nbt_run(make_suite(world)));
}

int nbt_loopback_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

int nbt_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof a;
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    close(fd);
    return ntohs(a.sin_port);
}

nb_pg *nbt_nccl_world_of_one(const char *run_id) {
    setenv("CK_FORK", "no", 1);
    nb_dist_env env;
    memset(&env, 0, sizeof env);
    env.world_size = env.local_world_size = 1;
    snprintf(env.master_addr, sizeof env.master_addr, "127.0.0.1");
    snprintf(env.run_id, sizeof env.run_id, "%s", run_id);
    env.source = "none";
    nb_pg *pg = NULL;
    if (nb_pg_init_env(&pg, &env, &(nb_pg_options){NB_PG_NCCL, 60}) != NB_OK) {
        fprintf(stderr, "nb_pg_init: %s\n", nb_last_error());
        return NULL;
    }
    return pg;
}

int nbt_pg_finish(nb_pg *pg, int rc) {
    if (nb_pg_free(pg) != NB_OK) {
        fprintf(stderr, "nb_pg_free: %s\n", nb_last_error());
        rc = 1;
    }
    return rc;
}

char nbt_tmpdir[64];

void nbt_tmpdir_make(const char *prefix) {
    snprintf(nbt_tmpdir, sizeof nbt_tmpdir, "/tmp/%sXXXXXX", prefix);
    ck_assert_ptr_nonnull(mkdtemp(nbt_tmpdir));
}

void nbt_remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char p[1024];
    for (struct dirent *e; (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (unlink(p) != 0) nbt_remove_tree(p);
    }
    closedir(d);
    rmdir(dir);
}

void nbt_tmpdir_remove(void) { nbt_remove_tree(nbt_tmpdir); }

const char *nbt_tmp_path(const char *name) {
    static char bufs[4][4096];
    static int next;
    char *b = bufs[next++ & 3];
    snprintf(b, 4096, "%s/%s", nbt_tmpdir, name);
    return b;
}

unsigned char *nbt_slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    ck_assert_uint_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

void nbt_ref_layer_norm(double *y, const double *x, const double *w, const double *b, int64_t m, int64_t d,
                        double eps) {
    for (int64_t i = 0; i < m; i++) {
        double mu = 0, var = 0;
        for (int64_t j = 0; j < d; j++) mu += x[i * d + j] / (double)d;
        for (int64_t j = 0; j < d; j++) var += (x[i * d + j] - mu) * (x[i * d + j] - mu) / (double)d;
        for (int64_t j = 0; j < d; j++) {
            double v = (x[i * d + j] - mu) / sqrt(var + eps);
            y[i * d + j] = v * (w ? w[j] : 1.0) + (b ? b[j] : 0.0);
        }
    }
}

void nbt_assert_file_holds(const char *path, const unsigned char *want, size_t len) {
    size_t n;
    unsigned char *got = nbt_slurp(path, &n);
    ck_assert_msg(n == len, "%s: %zu bytes, expected %zu", path, n, len);
    ck_assert_msg(memcmp(got, want, len) == 0, "%s: the bytes differ from the expected ones", path);
    free(got);
}
