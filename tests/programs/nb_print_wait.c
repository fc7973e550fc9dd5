/* nb_print_wait FILE: prints a line with printf (no fflush), then waits
 * until FILE exists (at most 60 s), prints another and exits 0. Under
 * nbrun the first line must reach nbrun's output while this waits
 * (Note [Line-buffered stdout under a launcher] in tensor/error.c):
 * tests/test_nbrun_output.py. */
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include <nabla/nabla.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: nb_print_wait FILE\n");
        return 2;
    }
    printf("waiting for %s (status %s)\n", argv[1], nb_status_str(NB_OK));
    struct timespec tick = {0, 50 * 1000 * 1000};
    for (int i = 0; i < 1200 && access(argv[1], F_OK) != 0; i++) nanosleep(&tick, NULL);
    printf("done\n");
    return 0;
}
