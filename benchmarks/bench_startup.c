/* What a CPU program costs before it computes anything: after a small
 * CPU step (a product, a GELU, a backward), the process's resident
 * memory (VmRSS, and its peak VmHWM, from /proc/self/status) and the
 * CUDA libraries it has mapped (/proc/self/maps); linked with libnabla.so
 * (libnabla.a has the CUDA backend linked in). With --cuda it then
 * asks for the CUDA device count, which loads the CUDA plugin (Note
 * [CUDA plugin] in tensor/cuda_plugin.h), and prints the same again: the
 * difference is what the CUDA libraries cost a process that uses them.
 *
 *   build/bin/bench_startup [--cuda] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/nabla.h"

static long status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, n) && line[n] == ':') v = strtol(line + n + 1, NULL, 10);
    if (f) fclose(f);
    return v;
}

static void report(const char *when) {
    static const char *const libs[] = {"libcudart", "libcublas", "libcudnn",
                                       "libnccl",   "libcuda.so", "libnabla_cuda"};
    char names[2048] = "", line[4096];
    int n = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    while (f && fgets(line, sizeof line, f)) {
        char *p = strrchr(line, '/');
        if (!p) continue;
        p[strcspn(p, "\n")] = 0;
        for (size_t i = 0; i < sizeof libs / sizeof *libs; i++)
            if (strstr(p, libs[i]) && !strstr(names, p + 1) &&
                strlen(names) + strlen(p) + 2 < sizeof names) {
                strcat(names, " ");
                strcat(names, p + 1);
                n++;
                break;
            }
    }
    if (f) fclose(f);
    printf("%-22s VmRSS %7.1f MB  VmHWM %7.1f MB  CUDA libraries mapped: %d%s\n", when,
           status_kb("VmRSS") / 1024.0, status_kb("VmHWM") / 1024.0, n, names);
}

int main(int argc, char **argv) {
    bool cuda = argc > 1 && strcmp(argv[1], "--cuda") == 0;
    if (argc > 2 || (argc == 2 && !cuda)) {
        fprintf(stderr, "usage: bench_startup [--cuda]\n");
        return 2;
    }
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *w = nb_rand_normal(ctx, NB_F32, NB_SHAPE(64, 64), 0, 1, NULL);
    nb_tensor *x = nb_rand_normal(ctx, NB_F32, NB_SHAPE(16, 64), 0, 1, NULL);
    nb_set_requires_grad(w, true);
    nb_backward(nb_sum(ctx, nb_gelu(ctx, nb_matmul(ctx, x, w), NB_GELU_TANH), 0, NULL, false));
    report("after a CPU step:");
    if (cuda) {
        int n = nb_cuda_device_count();
        char what[64];
        snprintf(what, sizeof what, "after asking (%d GPU%s):", n, n == 1 ? "" : "s");
        report(what);
    }
    nb_ctx_free(ctx);
    return 0;
}
