/* The ordered fault of the restart tests (fault.h). */
#include "fault.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int signal_named(const char *name) {
    const char *names[] = {"KILL", "STOP", "TERM", "SEGV"};
    const int sigs[] = {SIGKILL, SIGSTOP, SIGTERM, SIGSEGV};
    for (int i = 0; i < 4; i++)
        if (strcmp(name, names[i]) == 0) return sigs[i];
    return 0;
}

void fault_at_step(int rank, int64_t step) {
    const char *spec = getenv("NABLA_TEST_FAULT");
    if (!spec || !*spec) return;
    const char *rc = getenv("NABLA_RESTART_COUNT");
    long generation = rc && *rc ? strtol(rc, NULL, 10) : 0;
    for (const char *p = spec; *p;) {
        long g, r;
        long long s;
        char name[8];
        int used = 0;
        if (sscanf(p, "%ld:%ld:%lld:%7[A-Z]%n", &g, &r, &s, name, &used) != 4 || !signal_named(name)) {
            fprintf(stderr, "NABLA_TEST_FAULT: cannot read \"%s\" (G:R:S:KILL|STOP|TERM|SEGV, comma-separated)\n", p);
            abort();
        }
        if (g == generation && r == rank && s == step) {
            fprintf(stderr, "NABLA_TEST_FAULT: rank %d sends itself SIG%s at step %lld\n", rank, name, s);
            kill(getpid(), signal_named(name));
        }
        p += used;
        if (*p == ',') p++;
    }
}
