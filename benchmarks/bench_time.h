/* What the benchmarks share for timing: a monotonic clock in seconds and
 * the comparison qsort needs to sort measured times (each bench_*.c keeps
 * its own statistic: a median, a minimum). Header-only, since every
 * bench_*.c is a program of its own. */
#ifndef NABLA_BENCH_TIME_H
#define NABLA_BENCH_TIME_H

#include <time.h>

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
