/* Which CPUs each local rank of nbrun runs on (Note [CPU binding]).
 *
 * Note [CPU binding]: nbrun gives each local rank its own share of the
 * CPUs nbrun itself may run on (sched_getaffinity: never a CPU outside the
 * mask it inherited), as MPI launchers bind ranks to cores by default. A
 * rank's threads (its main thread, the process group's worker, the
 * heartbeat, the store's) inherit the mask, so every hand-off between
 * them stays on the rank's CPUs. Measured on 2 vCPUs with two ranks of
 * bench_ddp's MLP (benchmarks/RESULTS.md, "nbrun binds each rank to its
 * CPUs"): unbound, the scheduler sometimes put both main threads on one
 * CPU and both workers on the other, and then each hand-off between a
 * rank's main thread and its worker woke a thread on the other, halted,
 * vCPU: 0.13-0.15 ms a step against 0.055 when all four threads happened
 * to share a CPU, runs 2.6-2.8x apart. Bound, a rank's hand-offs stay on
 * its CPU and runs were 1.2-1.45x apart (1.57x while another program kept
 * both vCPUs busy). Binding costs where other work shares the machine: a
 * bound rank cannot move off a CPU that work keeps busy; --cpu-bind none
 * keeps the scheduler's placement.
 *
 * The share: CPUs are ordered by (package, core, CPU number), so the
 * hardware threads of one core sit together; with at least as many cores
 * as ranks, rank r of n gets cores [r*c/n, (r+1)*c/n) of the c cores, all
 * of their CPUs (whole cores, never a core split between ranks); with
 * fewer cores than ranks but as many CPUs, the CPU list is cut the same
 * way; with more ranks than CPUs (only when asked for: the default binds
 * nothing then), rank r gets the one CPU r*p/n of the p CPUs, so the ranks
 * spread evenly. Blocks differ in length by one at most. A pure function
 * (nb__cpu_share) so that tests check it by table for masks and topologies
 * this machine does not have. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "distributed/internal.h"

static int slot_order(const void *a, const void *b) {
    const nb__cpu_slot *x = a, *y = b;
    if (x->package != y->package) return x->package < y->package ? -1 : 1;
    if (x->core != y->core) return x->core < y->core ? -1 : 1;
    return (x->cpu > y->cpu) - (x->cpu < y->cpu);
}

static bool same_core(const nb__cpu_slot *x, const nb__cpu_slot *y) {
    return x->package == y->package && x->core == y->core;
}

int nb__cpu_share(const nb__cpu_slot *slots, int n, int nlocal, int local_rank, int *out) {
    if (n <= 0 || nlocal <= 0 || local_rank < 0 || local_rank >= nlocal) return 0;
    nb__cpu_slot *s = malloc((size_t)n * sizeof *s);
    if (!s) return 0;
    for (int i = 0; i < n; i++) s[i] = slots[i];
    qsort(s, (size_t)n, sizeof *s, slot_order);
    int cores = 0;
    for (int i = 0; i < n; i++)
        if (i == 0 || !same_core(&s[i - 1], &s[i])) cores++;
    int k = 0;
    if (nlocal > n) {
        out[k++] = s[(long)local_rank * n / nlocal].cpu;
    } else if (cores >= nlocal) {
        long lo = (long)local_rank * cores / nlocal, hi = (long)(local_rank + 1) * cores / nlocal;
        int core = -1;
        for (int i = 0; i < n; i++) {
            if (i == 0 || !same_core(&s[i - 1], &s[i])) core++;
            if (core >= lo && core < hi) out[k++] = s[i].cpu;
        }
    } else {
        long lo = (long)local_rank * n / nlocal, hi = (long)(local_rank + 1) * n / nlocal;
        for (long i = lo; i < hi; i++) out[k++] = s[i].cpu;
    }
    free(s);
    return k;
}

static long read_topology(int cpu, const char *what) {
    char path[128];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, what);
    FILE *f = fopen(path, "r");
    long v = -1;
    if (f) {
        if (fscanf(f, "%ld", &v) != 1) v = -1;
        fclose(f);
    }
    return v;
}

int nb__cpu_usable(nb__cpu_slot *slots, int max) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
    int n = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && n < max; cpu++) {
        if (!CPU_ISSET(cpu, &set)) continue;
        long package = read_topology(cpu, "physical_package_id");
        long core = read_topology(cpu, "core_id");
        if (package < 0 || core < 0) package = 0, core = cpu; /* unknown: a core of its own */
        slots[n++] = (nb__cpu_slot){cpu, (int)package, (int)core};
    }
    return n;
}
