/* The CUDA plugin (Note [CUDA plugin] in tensor/cuda_plugin.h), from a
 * program linked with libnabla.so (cmake/NablaTests.cmake; public
 * functions only): a CPU program maps no CUDA library, even in a build
 * with CUDA; asking for the CUDA devices loads the plugin (and with it the
 * CUDA libraries), found beside libnabla.so; NABLA_CUDA_PLUGIN overrides where it is
 * looked for; and when it cannot be loaded, the error names the file and
 * dlerror's text. What a process has mapped cannot be undone, so each
 * case runs in a child process of its own (whatever CK_FORK says) and
 * reports what it saw through a pipe; the assertions are in the parent. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nabla/cuda.h"
#include "testutil.h"

/* The libraries a CPU program must not map. */
static const char *const cuda_libs[] = {"libcudart", "libcublas", "libcudnn", "libnccl",
                                        "libcuda.so", "libnabla_cuda"};

/* Appends the mapped files of /proc/self/maps whose name contains one of
 * cuda_libs (each once) to out. */
static void mapped_cuda(char *out, size_t len) {
    out[0] = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) {
        snprintf(out, len, "(cannot read /proc/self/maps)");
        return;
    }
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        char *path = strchr(line, '/');
        if (!path) continue;
        path[strcspn(path, "\n")] = 0;
        bool hit = false;
        for (size_t i = 0; i < sizeof cuda_libs / sizeof *cuda_libs; i++)
            hit |= strstr(path, cuda_libs[i]) != NULL;
        if (hit && !strstr(out, path) && strlen(out) + strlen(path) + 2 < len) {
            strcat(out, path);
            strcat(out, " ");
        }
    }
    fclose(f);
}

/* Whether /proc/self/maps lists the file `path`. */
static bool maps_file(const char *path) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[4096];
    bool found = false;
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *p = strchr(line, '/');
        found |= p && strcmp(p, path) == 0;
    }
    if (f) fclose(f);
    return found;
}

/* Runs fn in a child process; returns what it wrote (at most len bytes). */
static void in_child(void (*fn)(FILE *report), char *out, size_t len) {
    int fd[2];
    ck_assert_int_eq(pipe(fd), 0);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(fd[0]);
        FILE *report = fdopen(fd[1], "w");
        fn(report);
        fclose(report);
        _exit(0);
    }
    close(fd[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < len && (r = read(fd[0], out + n, len - 1 - n)) > 0) n += (size_t)r;
    out[n] = 0;
    close(fd[0]);
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "the child process died (status %d); it reported: %s", status, out);
}

/* `key=value` from a child's report, value up to the end of its line. */
static const char *field(const char *report, const char *key, char *buf, size_t len) {
    char k[64];
    snprintf(k, sizeof k, "%s=", key);
    const char *p = strstr(report, k);
    ck_assert_msg(p, "the child's report lacks %s: %s", key, report);
    p += strlen(k);
    size_t n = strcspn(p, "\n");
    if (n >= len) n = len - 1;
    memcpy(buf, p, n);
    buf[n] = 0;
    return buf;
}

/* Reports the abort message of nb_ctx_new(cuda:0), or "none". */
static void report_cuda_ctx(FILE *report) {
    nbt_abort_armed = 1;
    nbt_abort_msg[0] = 0;
    if (setjmp(nbt_jmp) == 0) {
        nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
        nbt_abort_armed = 0;
        fprintf(report, "ctx_abort=none\n");
        nb_ctx_free(ctx);
        return;
    }
    nbt_abort_armed = 0;
    fprintf(report, "ctx_abort=%s\n", nbt_abort_msg);
}

/* ---- a CPU program maps no CUDA library ---- */
static void cpu_work(FILE *report) {
    char maps[4096];
    mapped_cuda(maps, sizeof maps);
    fprintf(report, "at_start=%s\n", maps);
    /* a little of everything a CPU training step touches */
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nbt_randn(ctx, NB_F32, NB_SHAPE(8, 4), 1);
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(3, 8), 2);
    nb_set_requires_grad(w, true);
    nb_tensor *loss = nb_sum(ctx, nb_gelu(ctx, nb_matmul(ctx, x, w), NB_GELU_TANH), 0, NULL, false);
    nb_backward(loss);
    nb_cuda_set_allow_tf32(true); /* a switch, kept by libnabla: loads nothing */
    fprintf(report, "grad_ok=%d\n", w->grad != NULL);
    nb_ctx_free(ctx);
    mapped_cuda(maps, sizeof maps);
    fprintf(report, "after_work=%s\n", maps);
}

START_TEST(test_cpu_program_maps_no_cuda) {
    char out[8192], v[4096];
    in_child(cpu_work, out, sizeof out);
    ck_assert_str_eq(field(out, "grad_ok", v, sizeof v), "1");
    ck_assert_msg(!*field(out, "at_start", v, sizeof v), "a CUDA library is mapped at start: %s", v);
    ck_assert_msg(!*field(out, "after_work", v, sizeof v),
                  "a CPU program mapped CUDA libraries: %s", v);
}
END_TEST

/* ---- asking for the devices loads the plugin ---- */
static void count_devices(FILE *report) {
    char maps[4096];
    mapped_cuda(maps, sizeof maps);
    fprintf(report, "before=%s\n", maps);
    int n = nb_cuda_device_count();
    fprintf(report, "count=%d\navailable=%d\n", n, nb_cuda_available());
    mapped_cuda(maps, sizeof maps);
    fprintf(report, "after=%s\n", maps);
    if (n == 0) report_cuda_ctx(report);
}

START_TEST(test_device_count_loads_plugin) {
    char out[8192], v[4096];
    in_child(count_devices, out, sizeof out);
    ck_assert_msg(!*field(out, "before", v, sizeof v), "mapped before asking: %s", v);
    int n = atoi(field(out, "count", v, sizeof v));
    ck_assert_int_ge(n, 0);
    ck_assert_int_eq(atoi(field(out, "available", v, sizeof v)), n > 0);
    field(out, "after", v, sizeof v);
#if NABLA_HAVE_CUDA
    /* found beside the program's library directory, without help */
    ck_assert_msg(strstr(v, "/libnabla_cuda.so"), "the plugin is not mapped: %s", v);
    ck_assert_msg(strstr(v, "libcudart"), "the CUDA runtime is not mapped: %s", v);
    if (n == 0)
        ck_assert_str_eq(field(out, "ctx_abort", v, sizeof v),
                         "nb_ctx_new: device cuda:0 does not exist (0 CUDA devices visible)");
#else
    ck_assert_msg(!*v, "a build without CUDA mapped %s", v);
    ck_assert_int_eq(n, 0);
    ck_assert_str_eq(field(out, "ctx_abort", v, sizeof v),
                     "nb_ctx_new: device cuda:0: nabla was built without CUDA");
#endif
}
END_TEST

/* ---- NABLA_CUDA_PLUGIN ---- */
static char plugin_path[4096];

static void count_with_env(FILE *report) {
    setenv("NABLA_CUDA_PLUGIN", plugin_path, 1);
    fprintf(report, "count=%d\n", nb_cuda_device_count());
    char maps[4096];
    mapped_cuda(maps, sizeof maps);
    fprintf(report, "after=%s\n", maps);
    fprintf(report, "env_file_mapped=%d\n", maps_file(plugin_path));
    report_cuda_ctx(report);
}

START_TEST(test_env_missing_file) {
    snprintf(plugin_path, sizeof plugin_path, "%s/no/such/dir/libnabla_cuda.so", NABLA_BINARY_DIR);
    char out[8192], v[4096];
    in_child(count_with_env, out, sizeof out);
    ck_assert_str_eq(field(out, "count", v, sizeof v), "0");
    ck_assert_msg(!*field(out, "after", v, sizeof v), "mapped: %s", v);
    ck_assert_str_eq(field(out, "env_file_mapped", v, sizeof v), "0");
    field(out, "ctx_abort", v, sizeof v);
#if NABLA_HAVE_CUDA
    /* the file, where it was looked for, dlerror's words, the variable */
    char want[8192];
    snprintf(want, sizeof want,
             "nb_ctx_new: device cuda:0: the CUDA backend could not be loaded: %s: cannot open "
             "shared object file: No such file or directory (the file NABLA_CUDA_PLUGIN names)",
             plugin_path);
    ck_assert_str_eq(v, want);
#else
    ck_assert_str_eq(v, "nb_ctx_new: device cuda:0: nabla was built without CUDA");
#endif
}
END_TEST

/* Not a shared object at all: dlerror says so, after the path. */
START_TEST(test_env_not_a_library) {
    char dir[] = "/tmp/nb_test_plugin_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(plugin_path, sizeof plugin_path, "%s/libnabla_cuda.so", dir);
    FILE *f = fopen(plugin_path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("not a shared object\n", f);
    fclose(f);
    char out[8192], v[4096];
    in_child(count_with_env, out, sizeof out);
    remove(plugin_path);
    rmdir(dir);
    ck_assert_str_eq(field(out, "count", v, sizeof v), "0");
    field(out, "ctx_abort", v, sizeof v);
#if NABLA_HAVE_CUDA
    char want[8192];
    snprintf(want, sizeof want, "the CUDA backend could not be loaded: %s: ", plugin_path);
    ck_assert_msg(strstr(v, want), "%s lacks %s", v, want);
    ck_assert_msg(strstr(v, "ELF") || strstr(v, "too short"), "no dlerror text in: %s", v);
#else
    ck_assert_str_eq(v, "nb_ctx_new: device cuda:0: nabla was built without CUDA");
#endif
}
END_TEST

#if NABLA_HAVE_CUDA
/* A shared object that is not the plugin: named, with what it lacks. */
START_TEST(test_env_other_library) {
    snprintf(plugin_path, sizeof plugin_path, "%s/lib/libnabla.so", NABLA_BINARY_DIR);
    char out[8192], v[4096];
    in_child(count_with_env, out, sizeof out);
    ck_assert_str_eq(field(out, "count", v, sizeof v), "0");
    char want[8192];
    snprintf(want, sizeof want,
             "nb_ctx_new: device cuda:0: the CUDA backend could not be loaded: %s: no symbol "
             "nb__cuda_plugin_init (not nabla's CUDA plugin) (the file NABLA_CUDA_PLUGIN names)",
             plugin_path);
    ck_assert_str_eq(field(out, "ctx_abort", v, sizeof v), want);
}
END_TEST

/* A copy under another name, elsewhere, is what gets loaded. */
START_TEST(test_env_renamed_copy) {
    char src[4096];
    snprintf(src, sizeof src, "%s/lib/libnabla_cuda.so", NABLA_BINARY_DIR);
    char dir[] = "/tmp/nb_test_plugin_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(plugin_path, sizeof plugin_path, "%s/renamed_plugin.so", dir);
    FILE *in = fopen(src, "rb"), *out_f = fopen(plugin_path, "wb");
    ck_assert_msg(in && out_f, "cannot copy %s to %s", src, plugin_path);
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) ck_assert_uint_eq(fwrite(buf, 1, n, out_f), n);
    fclose(in);
    fclose(out_f);
    char out[8192], v[4096];
    in_child(count_with_env, out, sizeof out);
    remove(plugin_path);
    rmdir(dir);
    ck_assert_msg(atoi(field(out, "env_file_mapped", v, sizeof v)) == 1, "%s is not mapped: %s",
                  plugin_path, out);
    field(out, "after", v, sizeof v);
    ck_assert_msg(strstr(v, "libcudart"), "the CUDA runtime is not mapped: %s", v);
    ck_assert_msg(!strstr(v, src), "the build's plugin was mapped too: %s", v);
    if (atoi(field(out, "count", v, sizeof v)) == 0)
        ck_assert_str_eq(field(out, "ctx_abort", v, sizeof v),
                         "nb_ctx_new: device cuda:0 does not exist (0 CUDA devices visible)");
}
END_TEST
#endif

static Suite *suite(void) {
    Suite *s = suite_create("plugin");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_cpu_program_maps_no_cuda);
    tcase_add_test(tc, test_device_count_loads_plugin);
    tcase_add_test(tc, test_env_missing_file);
    tcase_add_test(tc, test_env_not_a_library);
#if NABLA_HAVE_CUDA
    tcase_add_test(tc, test_env_other_library);
    tcase_add_test(tc, test_env_renamed_copy);
#endif
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return nbt_run(suite()); }
