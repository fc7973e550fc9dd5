/* A fault to order, for the tests of restarts (tests/test_restart.py):
 * NABLA_TEST_FAULT="G:R:S:SIG[,G:R:S:SIG...]" makes rank R of restart
 * generation G (NABLA_RESTART_COUNT, 0 when unset) send itself SIG (KILL,
 * STOP, TERM or SEGV) as it starts step S (1-based), so that a test kills
 * or freezes a rank at a known point of the run instead of racing it.
 * Unset (always, outside the tests), it does nothing. */
#ifndef NABLA_EXAMPLES_FAULT_H
#define NABLA_EXAMPLES_FAULT_H

#include <stdint.h>

void fault_at_step(int rank, int64_t step);

#endif
