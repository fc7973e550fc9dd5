/* What the test drivers in this folder share. */
#ifndef NABLA_TESTS_DRIVER_H
#define NABLA_TESTS_DRIVER_H

#include <stdio.h>
#include <stdlib.h>

/* Ends the program with exit code 2 and "usage: PROGRAM USAGE" on stderr
 * unless it was given `nargs` arguments. */
static inline void driver_args(int argc, char **argv, int nargs, const char *usage) {
    if (argc != nargs + 1) {
        fprintf(stderr, "usage: %s %s\n", argv[0], usage);
        exit(2);
    }
}

#endif
