/* The check every public function taking a handle makes first.
 *
 * Note [NULL handles]: the constructors that can fail (nb_dataset_open_*,
 * nb_loader_new, nb_checkpoint_open, nb_ddp_new, ...) return a status and
 * leave their handle NULL. A program that ignores the status passes that
 * NULL on, and the next call would dereference it: SIGSEGV, no message.
 * Each public function given a NULL handle aborts instead, naming itself,
 * the handle, the likely cause, and the thread's last error (usually the
 * failed constructor's own message). The _free functions accept NULL.
 *
 * Note [Freed handles]: a handle used after its _free (a DDP wrapper, a
 * process group, a loader) would read freed memory: SIGSEGV or worse, a
 * plausible value. Such a handle's struct begins with an nb__handle, which
 * its constructor stamps live (nb__handle_init) and its _free retires
 * (nb__handle_retire) instead of free(): the struct's memory goes to a
 * graveyard that keeps the last NB__HANDLE_GRAVES retired handles, stamped
 * dead, so NB__CHECK_HANDLE (chosen by the pointer's type, _Generic)
 * aborts naming the function and the _free that came before. Past that
 * many, the oldest grave is freed for real (a handle used after hundreds
 * of later frees is caught only by chance); the memory kept is the size of
 * those structs, small next to what they owned, which _free released. */
#ifndef NABLA_UTIL_HANDLE_H
#define NABLA_UTIL_HANDLE_H

#include <stddef.h>
#include <stdint.h>

#include "nabla/error.h"

typedef struct nb__handle {
    uint64_t magic; /* NB__HANDLE_LIVE or NB__HANDLE_DEAD */
    const char *free_fn;
} nb__handle;

#define NB__HANDLE_LIVE 0x6e61626c616c6976ull /* "nablaliv" */
#define NB__HANDLE_DEAD 0x6e61626c61646561ull /* "nabladea" */
#define NB__HANDLE_GRAVES 256

/* `free_fn`: the function that retires it, named in the message. */
void nb__handle_init(nb__handle *h, const char *free_fn);
/* Instead of free(h): Note [Freed handles]. */
void nb__handle_retire(void *h);
void nb__handle_check_live(const char *fn, const void *h, const char *what);
static inline void nb__handle_no_check(const char *fn, const void *h, const char *what) {
    (void)fn, (void)h, (void)what;
}

struct nb_ddp;
struct nb_pg;
struct nb_loader;

#define NB__HANDLE_CHECKER(h)                                                                 \
    _Generic((h), struct nb_ddp *: nb__handle_check_live, const struct nb_ddp *: nb__handle_check_live, \
             struct nb_pg *: nb__handle_check_live, const struct nb_pg *: nb__handle_check_live,     \
             struct nb_loader *: nb__handle_check_live,                                      \
             const struct nb_loader *: nb__handle_check_live, default: nb__handle_no_check)

#define NB__CHECK_HANDLE(fn, h, what)                                                         \
    do {                                                                                      \
        NB_CHECK((h) != NULL,                                                                 \
                 "%s: the %s is NULL: the call that should have made it most likely failed and " \
                 "its nb_status was not checked (last error on this thread: %s)",            \
                 fn, what, nb_last_error()[0] ? nb_last_error() : "none");                    \
        NB__HANDLE_CHECKER(h)(fn, (const void *)(h), what);                                   \
    } while (0)

/* Defines the public function `Ret fn(T *h)` that checks its handle h
 * (`what` in the message) and returns expr: the message names fn itself
 * (#fn), so a getter written after another cannot name the other. */
#define NB__HANDLE_GETTER(Ret, fn, T, h, what, expr)                                          \
    Ret fn(T *h) {                                                                            \
        NB__CHECK_HANDLE(#fn, h, what);                                                       \
        return expr;                                                                          \
    }

#endif
