/* The progress display of a training run: one status line rewritten in
 * place on a terminal, or a plain log line every few steps when output
 * goes to a file or a pipe (a launcher's prefixing pipe, CI logs), where
 * carriage returns would only pile up. The line is cleared by padding with
 * spaces to the previous length, so no terminal escape sequences are
 * needed. */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nabla/monitor.h"

struct nb_progress {
    FILE *out;
    nb_progress_mode mode;
    const char *unit;
    int64_t total, log_every;
    double refresh_s;
    /* measured from the first update */
    bool started;
    double t0, last_draw;
    int64_t step0, items;
    /* the live line */
    int64_t step;
    double loss, rate, eta;
    size_t drawn; /* characters on the live line, 0: none */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

char *nb_format_count(char *buf, size_t size, double v) {
    const char *suffix[] = {"", "k", "M", "G", "T"};
    int k = 0;
    while (fabs(v) >= 999.5 && k < 4) v /= 1000, k++;
    if (k == 0) snprintf(buf, size, "%.0f", v);
    else snprintf(buf, size, fabs(v) < 9.995 ? "%.2f%s" : fabs(v) < 99.95 ? "%.1f%s" : "%.0f%s", v,
                  suffix[k]);
    return buf;
}

char *nb_format_duration(char *buf, size_t size, double s) {
    if (!(s >= 0) || s > 1e9) {
        snprintf(buf, size, "?");
        return buf;
    }
    long long t = llround(s);
    if (t < 60) snprintf(buf, size, "%llds", t);
    else if (t < 3600) snprintf(buf, size, "%lldm%02llds", t / 60, t % 60);
    else if (t < 86400) snprintf(buf, size, "%lldh%02lldm", t / 3600, t % 3600 / 60);
    else snprintf(buf, size, "%lldd%02lldh", t / 86400, t % 86400 / 3600);
    return buf;
}

char *nb_progress_format(char *buf, size_t size, int64_t step, int64_t total, double loss,
                         double rate, const char *unit, double eta) {
    size_t len = 0;
    int w = snprintf(buf, size, "step %lld/%lld", (long long)step, (long long)total);
    len = w > 0 ? (size_t)w : 0;
    char tmp[32];
    if (!isnan(loss) && len < size) len += (size_t)snprintf(buf + len, size - len, " | loss %.4f", loss);
    if (!isnan(rate) && len < size)
        len += (size_t)snprintf(buf + len, size - len, " | %s %s/s", nb_format_count(tmp, sizeof tmp, rate),
                                unit ? unit : "items");
    if (!isnan(eta) && len < size)
        snprintf(buf + len, size - len, " | eta %s", nb_format_duration(tmp, sizeof tmp, eta));
    return buf;
}

nb_progress *nb_progress_new(FILE *out, int64_t first_step, int64_t total_steps,
                             const nb_progress_opts *opts) {
    NB_CHECK(out, "nb_progress_new: the stream is NULL");
    NB_CHECK(first_step >= 0 && total_steps >= first_step,
             "nb_progress_new: need 0 <= first_step (%lld) <= total_steps (%lld)",
             (long long)first_step, (long long)total_steps);
    nb_progress_opts o = opts ? *opts : (nb_progress_opts){0};
    NB_CHECK(o.log_every >= 0 && o.refresh_s >= 0,
             "nb_progress_new: log_every %lld and refresh_s %g must be >= 0", (long long)o.log_every,
             o.refresh_s);
    nb_progress *p = calloc(1, sizeof *p);
    NB_CHECK(p, "nb_progress_new: out of memory");
    p->out = out;
    p->mode = o.mode;
    if (p->mode == NB_PROGRESS_AUTO) p->mode = isatty(fileno(out)) ? NB_PROGRESS_LINE : NB_PROGRESS_PLAIN;
    p->unit = o.unit ? o.unit : "items";
    p->total = total_steps;
    p->log_every = o.log_every ? o.log_every : 10;
    p->refresh_s = o.refresh_s ? o.refresh_s : 0.1;
    p->step = p->step0 = first_step;
    p->loss = p->rate = p->eta = NAN;
    return p;
}

nb_progress_mode nb_progress_get_mode(const nb_progress *p) { return p->mode; }

static void clear_line(nb_progress *p) {
    if (!p->drawn) return;
    fprintf(p->out, "\r%*s\r", (int)p->drawn, "");
    p->drawn = 0;
}

static void draw(nb_progress *p) {
    char line[256];
    nb_progress_format(line, sizeof line, p->step, p->total, p->loss, p->rate, p->unit, p->eta);
    if (p->mode == NB_PROGRESS_LINE) {
        size_t len = strlen(line);
        int pad = p->drawn > len ? (int)(p->drawn - len) : 0;
        fprintf(p->out, "\r%s%*s", line, pad, "");
        p->drawn = len;
    } else {
        fprintf(p->out, "%s\n", line);
    }
    fflush(p->out);
}

void nb_progress_update(nb_progress *p, int64_t step, double loss, int64_t items) {
    double t = now_s();
    bool first = !p->started;
    if (first) {
        /* the reference point: rates count what comes after this step */
        p->started = true;
        p->t0 = t;
        p->step0 = step;
        p->last_draw = -INFINITY;
    } else {
        p->items += items;
        double dt = t - p->t0;
        if (dt > 0) {
            p->rate = (double)p->items / dt;
            if (step > p->step0) p->eta = (double)(p->total - step) * dt / (double)(step - p->step0);
        }
    }
    p->step = step;
    p->loss = loss;
    bool last = step >= p->total;
    switch (p->mode) {
    case NB_PROGRESS_LINE:
        if (last || t - p->last_draw >= p->refresh_s) {
            draw(p);
            p->last_draw = t;
        }
        break;
    case NB_PROGRESS_PLAIN:
        if (first || last || step % p->log_every == 0) draw(p);
        break;
    default:
        break;
    }
}

void nb_progress_printf(nb_progress *p, const char *fmt, ...) {
    if (p->mode == NB_PROGRESS_OFF) return;
    bool live = p->drawn > 0;
    clear_line(p);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(p->out, fmt, ap);
    va_end(ap);
    fputc('\n', p->out);
    if (live) draw(p);
    fflush(p->out);
}

void nb_progress_free(nb_progress *p) {
    if (!p) return;
    if (p->drawn) {
        fputc('\n', p->out);
        fflush(p->out);
    }
    free(p);
}
