/* Errors: the two tiers of Note [Errors] in docs/design.md.
 *
 * Programmer errors (wrong shapes, dtypes, devices, arguments) go through
 * nb_abort(), which calls a replaceable handler (default: print and abort()).
 * Recoverable failures (files, formats, network, timeouts) return an nb_status
 * and leave a detailed message in the thread-local nb_last_error(). */
#ifndef NABLA_ERROR_H
#define NABLA_ERROR_H

#include <stdarg.h>

#include "nabla/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, description): one table for every status code. */
#define NB_STATUS_TABLE(X)                                                  \
    X(NB_OK, 0, "ok")                                                       \
    X(NB_ERR_INVALID, -1, "invalid argument")                               \
    X(NB_ERR_IO, -2, "input/output error")                                  \
    X(NB_ERR_FORMAT, -3, "malformed data")                                  \
    X(NB_ERR_NOMEM, -4, "out of memory")                                    \
    X(NB_ERR_NOT_FOUND, -5, "not found")                                    \
    X(NB_ERR_TIMEOUT, -6, "timed out")                                      \
    X(NB_ERR_NETWORK, -7, "network error")                                  \
    X(NB_ERR_UNSUPPORTED, -8, "not supported in this build")                \
    X(NB_ERR_MISMATCH, -9, "mismatch between ranks or files")               \
    X(NB_ERR_CLOSED, -10, "peer closed or aborted")                         \
    X(NB_ERR_INTERNAL, -11, "internal error")

typedef enum nb_status {
#define NB__STATUS_ENUM(name, value, text) name = value,
    NB_STATUS_TABLE(NB__STATUS_ENUM)
#undef NB__STATUS_ENUM
} nb_status;

/* Short description of a status code ("timed out"). */
NB_API const char *nb_status_str(nb_status status);

/* Detailed message of the last failure on this thread ("" if none). */
NB_API const char *nb_last_error(void);

/* Sets the thread's last error message and returns `status` (for library
 * code and for user code that wants to report through the same channel). */
NB_API nb_status nb_set_error(nb_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* On a call whose refusal leaves the run different from what the caller
 * asked for (a loader not moved, an optimizer not attached): ignoring its
 * status is a compiler warning, since going on would be a silent change. */
#define NB_MUST_CHECK __attribute__((warn_unused_result))

/* Programmer-error handler. It receives the source location and the full
 * message. If it returns, nb_abort() calls abort(): a handler that wants to
 * recover must leave by longjmp (tests do). */
typedef void (*nb_abort_handler)(const char *file, int line, const char *message,
                                 void *user);

/* Installs `handler` (NULL restores the default) for the whole process and
 * returns the previous one. */
NB_API nb_abort_handler nb_set_abort_handler(nb_abort_handler handler, void *user);

#ifdef __cplusplus
#define NB_NORETURN [[noreturn]]
#else
#define NB_NORETURN _Noreturn
#endif
NB_NORETURN NB_API void nb_abort(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define NB_ABORT(...) nb_abort(__FILE__, __LINE__, __VA_ARGS__)
#define NB_CHECK(cond, ...)                                                 \
    do {                                                                    \
        if (!(cond)) NB_ABORT(__VA_ARGS__);                                 \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
