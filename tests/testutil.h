/* Shared test helpers for the Check suites.
 *
 * nbt_main() installs an abort handler: inside NBT_EXPECT_ABORT it
 * longjmps back so the message can be asserted; anywhere else it fails the
 * current test with the message (instead of killing the runner). */
#ifndef NABLA_TESTUTIL_H
#define NABLA_TESTUTIL_H

#include <check.h>
#include <setjmp.h>
#include <string.h>

#include "nabla/nabla.h"

extern jmp_buf nbt_jmp;
extern volatile int nbt_abort_armed;
extern char nbt_abort_msg[1024];

/* Under LeakSanitizer the memory an aborted call had allocated is not
 * reported: the library's aborts end the process (Note [Errors] in
 * docs/design.md), so nothing it held then is a leak a program can have;
 * the tests' handler jumps back instead, and the call's allocations (on
 * this thread, while it ran) would otherwise fail the suite at exit. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#define NBT_LSAN_DISABLE() __lsan_disable()
#define NBT_LSAN_ENABLE() __lsan_enable()
#else
#define NBT_LSAN_DISABLE() ((void)0)
#define NBT_LSAN_ENABLE() ((void)0)
#endif

/* Runs `stmt`, which must abort with a message containing `substr`. */
#define NBT_EXPECT_ABORT(stmt, substr)                                                    \
    do {                                                                                  \
        nbt_abort_armed = 1;                                                              \
        nbt_abort_msg[0] = 0;                                                             \
        if (setjmp(nbt_jmp) == 0) {                                                       \
            NBT_LSAN_DISABLE();                                                           \
            stmt;                                                                         \
            NBT_LSAN_ENABLE();                                                            \
            nbt_abort_armed = 0;                                                          \
            ck_abort_msg("expected an abort containing \"%s\" from: %s", substr, #stmt);  \
        }                                                                                 \
        NBT_LSAN_ENABLE();                                                                \
        nbt_abort_armed = 0;                                                              \
        ck_assert_msg(strstr(nbt_abort_msg, substr) != NULL,                              \
                      "abort message \"%s\" lacks \"%s\"", nbt_abort_msg, substr);        \
    } while (0)

/* `call` must return `status` with nb_last_error() containing `substr`. */
#define NBT_EXPECT_STATUS(call, status, substr)                                           \
    do {                                                                                  \
        nb_status nbt_st_ = (call);                                                       \
        ck_assert_msg(nbt_st_ == (status), "%s returned %s, not %s (%s)", #call,           \
                      nb_status_str(nbt_st_), nb_status_str(status), nb_last_error());    \
        ck_assert_msg(strstr(nb_last_error(), substr) != NULL,                            \
                      "error message \"%s\" lacks \"%s\"", nb_last_error(), substr);        \
    } while (0)

/* Gradient check with the defaults; fails the test with the worst element. */
#define NBT_GRADCHECK(fn, user, n, inputs)                                                \
    do {                                                                                  \
        nb_gradcheck_result nbt_r_ = nb_gradcheck((fn), (user), (n), (inputs), 0, 0, 0);  \
        ck_assert_msg(nbt_r_.ok, "%s", nbt_r_.message);                                   \
    } while (0)

/* A Check test whose body gets a fresh CPU context `ctx`, freed after it:
 *     NBT_CPU_TEST(test_x) { ... ctx ... }
 * stands for START_TEST(test_x) { nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
 * ... nb_ctx_free(ctx); } END_TEST (a failed assertion ends the test, as
 * in any other). */
#define NBT_CPU_TEST(name)                                                                \
    static void name##_body(nb_ctx *ctx);                                                 \
    START_TEST(name) {                                                                    \
        nb_ctx *nbt_ctx_ = nb_ctx_new(nb_cpu(), 0);                                       \
        name##_body(nbt_ctx_);                                                            \
        nb_ctx_free(nbt_ctx_);                                                            \
    }                                                                                     \
    END_TEST                                                                              \
    static void name##_body(nb_ctx *ctx)

/* Runs the statement after it twice: `dt` NB_F64 with `k` 0, then NB_F32 with
 * `k` 1 (a test's f64 pass and its f32 pass, `k ? f32_tol : f64_tol`). A
 * `break` in the statement ends only the current pass. */
#define NBT_FOR_F64_F32(k, dt)                                                            \
    for (int k = 0; k < 2; k++)                                                           \
        for (nb_dtype dt = (k) ? NB_F32 : NB_F64, *nbt_dt_once_ = &dt; nbt_dt_once_;      \
             nbt_dt_once_ = NULL)

/* Normal(0, 1) random tensor of any float dtype, from its own seed. */
nb_tensor *nbt_randn(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape, uint64_t seed);
/* Same, made to require grad (a leaf). */
nb_tensor *nbt_randn_leaf(nb_ctx *ctx, nb_dtype dtype, int ndim, const int64_t *shape, uint64_t seed);

/* The same normal values as an f64 leaf and an f32 leaf (f32 vs f64 checks). */
void nbt_twin_leaves(nb_ctx *ctx, int ndim, const int64_t *shape, uint64_t seed, nb_tensor **x64,
                     nb_tensor **x32);
/* sum(y * r), r a fixed random tensor of y's shape and dtype: a scalar that
 * weighs every element of y differently. */
nb_tensor *nbt_weighted_sum(nb_ctx *ctx, nb_tensor *y);

/* Layer norm in double, the tests' reference: y = (x - mean) / sqrt(var +
 * eps) * w + b over each of the m rows of x (m, d) (biased variance; w, b
 * (d) or NULL). */
void nbt_ref_layer_norm(double *y, const double *x, const double *w, const double *b, int64_t m, int64_t d,
                        double eps);

/* Asserts |t[i] - expect[i]| <= atol + rtol |expect[i]| for every element
 * (row-major order), reporting the first failing index. */
void nbt_assert_close(const nb_tensor *t, const double *expect, double atol, double rtol);
/* Same between two tensors of equal shape. */
void nbt_assert_tensors_close(const nb_tensor *a, const nb_tensor *b, double atol, double rtol);

/* The main of a program whose one suite `name` has one test case `tcase`
 * holding the tests listed after timeout_s (as nbt_suite takes them):
 *     NBT_MAIN("json", "core", 0, test_parse, test_strings)
 * runs it and returns the exit code. */
#define NBT_MAIN(name, tcase, timeout_s, ...)                                             \
    int main(void) {                                                                      \
        const TTest *nbt_tests_[] = {__VA_ARGS__, NULL};                                  \
        return nbt_run(nbt_suite(name, tcase, timeout_s, nbt_tests_));                    \
    }

/* Runs one suite with CK_NORMAL output; returns the process exit code. */
int nbt_run(Suite *s);

/* A suite `name` of one test case `tcase` holding `tests` (ended by NULL),
 * each test given timeout_s seconds (0: Check's default). */
Suite *nbt_suite(const char *name, const char *tcase, double timeout_s, const TTest *const *tests);
/* Adds to s a test case `tcase` holding `tests` (ended by NULL), as nbt_suite does. */
void nbt_suite_add(Suite *s, const char *tcase, double timeout_s, const TTest *const *tests);
/* nbt_suite whose tests each run with a scratch folder of their own:
 * nbt_tmpdir_make(prefix) before each, nbt_tmpdir_remove after it. */
Suite *nbt_suite_in_tmpdir(const char *name, const char *tcase, double timeout_s, const char *prefix,
                           const TTest *const *tests);

/* For suites that every rank runs under nbrun (or alone, as a world of
 * one): makes the Gloo world group, calls make_suite(world), runs the
 * suite in CK_NOFORK mode (the tests share the group), frees the group.
 * Returns the exit code: 77 (skipped) in a build without Gloo. */
typedef struct nb_pg nb_pg;
int nbt_run_world(Suite *(*make_suite)(nb_pg *world));

/* A raw TCP connection to 127.0.0.1:port with a 5 s receive timeout, for
 * tests that speak a wire format byte by byte; the connect must succeed. */
int nbt_loopback_connect(int port);
/* A TCP port of 127.0.0.1 that was free a moment ago (bound, then closed). */
int nbt_free_port(void);

/* For the GPU suites that need a process group: a world of one NCCL group
 * on GPU 0 (NCCL allows one rank per GPU) with run id `run_id`, made
 * without the environment; sets CK_FORK=no, so that every test shares the
 * one communicator. NULL, after printing why, when it cannot be made. */
nb_pg *nbt_nccl_world_of_one(const char *run_id);

/* A scratch folder for a test that writes files: nbt_tmpdir_make makes
 * /tmp/<prefix>XXXXXX into nbt_tmpdir (a fixture's setup), nbt_tmpdir_remove
 * removes it and all it holds (its teardown); nbt_tmp_path(name) is the
 * path of `name` in it, in one of 4 buffers used in turn (copy it when
 * more are needed at once). nbt_remove_tree removes any folder so. */
extern char nbt_tmpdir[64];
void nbt_tmpdir_make(const char *prefix);
void nbt_tmpdir_remove(void);
const char *nbt_tmp_path(const char *name);
void nbt_remove_tree(const char *dir);
/* The whole file at `path`, malloc'ed (one byte more, for a NUL), its
 * size in *len; the test fails when it cannot be read. */
unsigned char *nbt_slurp(const char *path, size_t *len);

/* The file at `path` holds exactly the len bytes at want (bytes nbt_slurp
 * read earlier, from it or from another file). */
void nbt_assert_file_holds(const char *path, const unsigned char *want, size_t len);

/* Frees pg after a suite that returned rc; returns rc, or 1 (after
 * printing why) when freeing the group fails. */
int nbt_pg_finish(nb_pg *pg, int rc);

#endif
