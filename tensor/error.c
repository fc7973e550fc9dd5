/* Status codes, the thread-local last-error message and nb_abort (with the
 * thread's chain of frames that annotate its message); and stdout made
 * line-buffered under a launcher.
 *
 * Note [Line-buffered stdout under a launcher]
 * Under nbrun a rank's stdout is a pipe, which the C library buffers
 * fully: a printf shows when some kilobytes have gathered or at exit, and
 * a healthy run looks hung. nbrun sets NABLA_LINE_BUFFERED=1 in each rank
 * (unless it is set already), and the library, when it is loaded, makes
 * stdout line-buffered when that variable is 1 and stdout is not a
 * terminal (a terminal is line-buffered already): what python -u or
 * stdbuf -oL do for other programs. A constructor does it because setvbuf
 * must come before the program's first output; it lives in this file
 * because every program that calls nabla links it (each check ends in
 * nb_abort), from the static library too. NABLA_LINE_BUFFERED=0 keeps the
 * C library's choice, and a program's own setvbuf, made later, wins. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nabla/error.h"
#include "tensor/internal.h"

static _Thread_local char last_error[1024];
static _Thread_local nb__abort_frame *frames;

static nb_abort_handler abort_handler;
static void *abort_user;

__attribute__((constructor)) static void line_buffer_stdout(void) {
    const char *v = getenv("NABLA_LINE_BUFFERED");
    if (v && strcmp(v, "1") == 0 && !isatty(STDOUT_FILENO)) setvbuf(stdout, NULL, _IOLBF, 0);
}

const char *nb_status_str(nb_status status) {
    switch (status) {
#define NB__STATUS_CASE(name, value, text) \
    case name:                             \
        return text;
        NB_STATUS_TABLE(NB__STATUS_CASE)
#undef NB__STATUS_CASE
    }
    return "unknown status";
}

const char *nb_last_error(void) { return last_error; }

nb_status nb_set_error(nb_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

nb_abort_handler nb_set_abort_handler(nb_abort_handler handler, void *user) {
    nb_abort_handler prev = abort_handler;
    abort_handler = handler;
    abort_user = user;
    return prev;
}

void nb__abort_frame_push(nb__abort_frame *f) {
    f->up = frames;
    frames = f;
}

void nb__abort_frame_pop(nb__abort_frame *f) {
    if (frames == f) frames = f->up; /* else nb_abort emptied the chain */
}

NB_NORETURN void nb_abort(const char *file, int line, const char *fmt, ...) {
    char raw[1024], msg[1280];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    nb__abort_frame *f = frames;
    frames = NULL;
    if (f)
        f->annotate(f, raw, msg, sizeof msg);
    else
        snprintf(msg, sizeof msg, "%s", raw);
    if (abort_handler) abort_handler(file, line, msg, abort_user);
    fprintf(stderr, "nabla: %s\n  (at %s:%d)\n", msg, file, line);
    fflush(stderr);
    abort();
}
