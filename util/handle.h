/* The check every public function taking a handle makes first.
 *
 * Note [NULL handles]: the constructors that can fail (nb_dataset_open_*,
 * nb_loader_new, nb_checkpoint_open, nb_ddp_new, ...) return a status and
 * leave their handle NULL. A program that ignores the status passes that
 * NULL on, and the next call would dereference it: SIGSEGV, no message.
 * Each public function given a NULL handle aborts instead, naming itself,
 * the handle, the likely cause, and the thread's last error (usually the
 * failed constructor's own message). The _free functions accept NULL. */
#ifndef NABLA_UTIL_HANDLE_H
#define NABLA_UTIL_HANDLE_H

#include "nabla/error.h"

#define NB__CHECK_HANDLE(fn, h, what)                                                         \
    NB_CHECK((h) != NULL,                                                                     \
             "%s: the %s is NULL: the call that should have made it most likely failed and "  \
             "its nb_status was not checked (last error on this thread: %s)",                 \
             fn, what, nb_last_error()[0] ? nb_last_error() : "none")

#endif
