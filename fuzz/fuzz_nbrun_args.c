/* libFuzzer target for nbrun's command line (tools/nbrun.c's
 * parse_options).
 *
 * tools/nbrun.c is compiled into this file with its main renamed, exit()
 * turned into a jump back here (a usage error or --help ends the parse, as
 * it ends nbrun) and popen() failing (so "--nproc-per-node gpu" never runs
 * nvidia-smi). The input is the arguments after "nbrun", separated by NUL
 * bytes. A parse that returns must give 1 <= nproc <= 4096, 0 <= node
 * rank < nnodes, 1 <= MIN <= nnodes, a positive rendezvous timeout, a port
 * in [0, 65535], an address, restarts on several nodes only with --nnodes
 * MIN:MAX, and the program's arguments inside argv; a usage error exits with 2 after a message, and
 * only --help exits with 0. */
#define _GNU_SOURCE /* as tools/nbrun.c, which is included below */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>

static jmp_buf fuzz_jump;
static int fuzz_status;

static _Noreturn void fuzz_exit(int status) {
    fuzz_status = status;
    longjmp(fuzz_jump, 1);
}

#define exit(status) fuzz_exit(status)
#define popen(cmd, mode) ((void)(cmd), (void)(mode), (FILE *)NULL)
#define pclose(p) (-1)
#define main nbrun_main
#include "tools/nbrun.c"
#undef main
#undef exit
#undef popen
#undef pclose

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    enum { MAX_ARGS = 64 };
    static char text[4096];
    if (size >= sizeof text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    char *argv[MAX_ARGS + 2];
    int argc = 0;
    argv[argc++] = "nbrun";
    for (size_t i = 0; i < size && argc < MAX_ARGS + 1;) {
        argv[argc++] = text + i;
        i += strlen(text + i) + 1;
    }
    argv[argc] = NULL;
    fuzz_status = -1;
    static FILE *quiet; /* --help's text */
    if (!quiet) quiet = freopen("/dev/null", "w", stdout);
    if (setjmp(fuzz_jump) == 0) {
        options o = parse_options(argc, argv);
        if (o.nproc < 1 || o.nproc > 4096 || o.nnodes < 1 || o.node_rank < 0 ||
            o.node_rank >= o.nnodes || o.port < 0 || o.port > 65535 || o.max_restarts < 0 || !o.addr)
            abort();
        if (o.argv <= argv || o.argv >= argv + argc || !o.argv[0]) abort();
        if (o.nnodes > 1 && (o.port == 0 || (o.max_restarts > 0 && !o.elastic))) abort();
        if (o.nnodes_min < 1 || o.nnodes_min > o.nnodes || !(o.rdzv_timeout > 0)) abort();
    } else if (fuzz_status != 2 && fuzz_status != 0) {
        abort();
    }
    return 0;
}
