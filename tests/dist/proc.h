/* Test helper for the launcher and failure tests: runs processes with
 * extra environment variables, captures their stdout and stderr, and
 * reports how and when each ended. Header-only (static functions), for
 * tests/test_nbrun.c and tests/test_dist_failures.c. */
#ifndef NABLA_TESTS_DIST_PROC_H
#define NABLA_TESTS_DIST_PROC_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct nbt_proc {
    /* in */
    char *const *argv;
    const char *env[16];  /* "NAME=value" set in the child, NULL-terminated */
    int pass_fd;          /* a descriptor to keep open in the child, or -1 */
    /* Sends `signal` to the process once its stdout holds `trigger`
     * `trigger_count` times (0: never). */
    const char *trigger;
    int trigger_count, trigger_signal;
    /* out */
    pid_t pid;
    int code;             /* exit code, 128 + signal, or -1 if it ran past the limit */
    char *out, *err;      /* NUL-terminated */
    size_t out_len, err_len;
    double seconds;       /* from start to exit */
    /* internal */
    int fd_out, fd_err;
    bool running, triggered;
    double t0;
} nbt_proc;

static double nbt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void nbt_proc_start(nbt_proc *p) {
    int o[2], e[2];
    if (pipe(o) != 0 || pipe(e) != 0) abort();
    p->t0 = nbt_now();
    p->pid = fork();
    if (p->pid < 0) abort();
    if (p->pid == 0) {
        dup2(o[1], 1);
        dup2(e[1], 2);
        close(o[0]);
        close(e[0]);
        close(o[1]);
        close(e[1]);
        for (int i = 0; i < 16 && p->env[i]; i++) {
            char name[256];
            const char *eq = strchr(p->env[i], '=');
            size_t n = eq ? (size_t)(eq - p->env[i]) : strlen(p->env[i]);
            if (n >= sizeof name) n = sizeof name - 1;
            memcpy(name, p->env[i], n);
            name[n] = 0;
            setenv(name, eq ? eq + 1 : "", 1);
        }
        if (p->pass_fd >= 0) fcntl(p->pass_fd, F_SETFD, 0);
        execvp(p->argv[0], p->argv);
        fprintf(stderr, "cannot run %s: %s\n", p->argv[0], strerror(errno));
        _exit(126);
    }
    close(o[1]);
    close(e[1]);
    fcntl(o[0], F_SETFD, FD_CLOEXEC);
    fcntl(e[0], F_SETFD, FD_CLOEXEC);
    p->fd_out = o[0];
    p->fd_err = e[0];
    p->out = calloc(1, 1);
    p->err = calloc(1, 1);
    p->out_len = p->err_len = 0;
    p->running = true;
    p->triggered = false;
}

static bool nbt_read_into(int *fd, char **buf, size_t *len) {
    char tmp[65536];
    ssize_t n = read(*fd, tmp, sizeof tmp);
    if (n < 0 && errno == EINTR) return true;
    if (n <= 0) {
        close(*fd);
        *fd = -1;
        return false;
    }
    *buf = realloc(*buf, *len + (size_t)n + 1);
    memcpy(*buf + *len, tmp, (size_t)n);
    *len += (size_t)n;
    (*buf)[*len] = 0;
    return true;
}

static int nbt_count(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
    return n;
}

/* Runs until every process has exited and closed its output, killing
 * what is still running after `limit_s`. */
static void nbt_proc_wait_all(nbt_proc *ps, int n, double limit_s) {
    double start = nbt_now();
    for (;;) {
        struct pollfd fds[64];
        int *which[64];
        nbt_proc *owner[64];
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (ps[i].fd_out >= 0) { fds[k] = (struct pollfd){ps[i].fd_out, POLLIN, 0}; which[k] = &ps[i].fd_out; owner[k++] = &ps[i]; }
            if (ps[i].fd_err >= 0) { fds[k] = (struct pollfd){ps[i].fd_err, POLLIN, 0}; which[k] = &ps[i].fd_err; owner[k++] = &ps[i]; }
        }
        bool any_running = false;
        for (int i = 0; i < n; i++) any_running |= ps[i].running;
        if (k == 0 && !any_running) break;
        poll(fds, (nfds_t)k, k > 0 ? 100 : 10);
        for (int j = 0; j < k; j++) {
            if (!fds[j].revents) continue;
            nbt_proc *p = owner[j];
            if (which[j] == &p->fd_out) nbt_read_into(&p->fd_out, &p->out, &p->out_len);
            else nbt_read_into(&p->fd_err, &p->err, &p->err_len);
        }
        for (int i = 0; i < n; i++) {
            nbt_proc *p = &ps[i];
            if (p->running && p->trigger && !p->triggered && nbt_count(p->out, p->trigger) >= p->trigger_count) {
                kill(p->pid, p->trigger_signal);
                p->triggered = true;
            }
            int status;
            if (p->running && waitpid(p->pid, &status, WNOHANG) == p->pid) {
                p->running = false;
                p->seconds = nbt_now() - p->t0;
                p->code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            }
        }
        if (nbt_now() - start > limit_s) {
            for (int i = 0; i < n; i++) {
                if (ps[i].running) {
                    kill(ps[i].pid, SIGKILL);
                    waitpid(ps[i].pid, NULL, 0);
                    ps[i].running = false;
                    ps[i].code = -1;
                    ps[i].seconds = nbt_now() - ps[i].t0;
                }
                if (ps[i].fd_out >= 0) close(ps[i].fd_out);
                if (ps[i].fd_err >= 0) close(ps[i].fd_err);
                ps[i].fd_out = ps[i].fd_err = -1;
            }
            break;
        }
    }
}

static void nbt_proc_free(nbt_proc *p) {
    free(p->out);
    free(p->err);
    p->out = p->err = NULL;
}

/* The last line of `text` (without its newline). */
static inline const char *nbt_last_line(const char *text, char *buf, size_t len) {
    size_t n = strlen(text);
    while (n > 0 && text[n - 1] == '\n') n--;
    size_t start = n;
    while (start > 0 && text[start - 1] != '\n') start--;
    size_t m = n - start < len - 1 ? n - start : len - 1;
    memcpy(buf, text + start, m);
    buf[m] = 0;
    return buf;
}

#endif
