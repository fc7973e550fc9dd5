/* Watching a training run: a progress display, a JSON-lines metrics log,
 * and SVG line plots (loss curves from the log). Used by the bundled
 * training programs; docs/examples.md shows the output.
 *
 * Only one process of a distributed run should own a progress display and
 * the log (rank 0): they are plain files and streams, with no coordination
 * between processes. */
#ifndef NABLA_MONITOR_H
#define NABLA_MONITOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "nabla/api.h"
#include "nabla/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* -------------------------------------------------------------- memory */
/* The process's peak resident set size in bytes (VmHWM), 0 where unknown. */
NB_API size_t nb_peak_rss(void);
struct nb_memory_floor;
struct nb_ctx;
/* One line (in buf, returned) setting a training step's memory beside the
 * floor from the model's shape (nb_gpt_memory_floor in nabla/models.h):
 * the step context's peak against what backward needs plus the logits,
 * the blocks it touched, the model context's peak against parameters,
 * gradients and optimizer state, and on the CPU the process's peak RSS. */
NB_API char *nb_memory_report(char *buf, size_t size, const struct nb_memory_floor *floor,
                       const struct nb_ctx *step, const struct nb_ctx *params);

/* ------------------------------------------------------------ progress */
typedef enum nb_progress_mode {
    NB_PROGRESS_AUTO = 0, /* LINE when the stream is a terminal, else PLAIN */
    NB_PROGRESS_LINE,     /* one line rewritten in place with '\r' */
    NB_PROGRESS_PLAIN,    /* a log line every log_every steps */
    NB_PROGRESS_OFF       /* nothing (other ranks) */
} nb_progress_mode;

typedef struct nb_progress_opts {
    nb_progress_mode mode;
    const char *unit;  /* what items count: "tok", "samples"; NULL: "items" */
    int64_t log_every; /* PLAIN: steps between lines (the last step always prints); 0: 10 */
    double refresh_s;  /* LINE: least seconds between redraws (the last step always draws); 0: 0.1 */
} nb_progress_opts;

typedef struct nb_progress nb_progress;

/* A display for steps first_step+1 .. total_steps written to `out` (not
 * owned). opts NULL: AUTO, defaults. Aborts only on bad arguments. */
NB_API nb_progress *nb_progress_new(FILE *out, int64_t first_step, int64_t total_steps,
                             const nb_progress_opts *opts);
/* `step` steps are now done, the last with `loss` (NaN: not shown), and
 * `items` items (tokens, samples) were processed since the previous call.
 * Rates and the ETA are measured from the first call on, so that the
 * first step's one-time costs do not count. */
NB_API void nb_progress_update(nb_progress *p, int64_t step, double loss, int64_t items);
/* A line of its own (a newline is added) that does not garble the display:
 * the live line is cleared, the message printed, the live line redrawn.
 * Printed in every mode but OFF. */
NB_API void nb_progress_printf(nb_progress *p, const char *fmt, ...) __attribute__((format(printf,
                               2, 3)));
/* Ends the live line and frees the display. NULL is fine. */
NB_API void nb_progress_free(nb_progress *p);
NB_API nb_progress_mode nb_progress_get_mode(const nb_progress *p); /* AUTO resolved */

/* The status text, e.g. "step 120/1000 | loss 2.3456 | 15.2k tok/s | eta 1m05s".
 * NaN loss, rate or eta leave their field out. Returns buf. */
NB_API char *nb_progress_format(char *buf, size_t size, int64_t step, int64_t total, double loss,
                         double items_per_s, const char *unit, double eta_s);
/* "950", "15.2k", "3.40M", "1.20G". Returns buf. */
NB_API char *nb_format_count(char *buf, size_t size, double value);
/* "42s", "5m03s", "2h07m", "3d04h". Returns buf. */
NB_API char *nb_format_duration(char *buf, size_t size, double seconds);

/* --------------------------------------------------------- metrics log
 * One JSON object per line, flushed as written, e.g.
 *   {"kind":"train","step":120,"time":12.504,"loss":2.3456,"lr":0.0006}
 * "time" is wall-clock seconds since the log was opened (plus the time
 * carried over with nb_metrics_log_open's `time_offset`). Non-finite values
 * are written as null. */
typedef struct nb_metrics_log nb_metrics_log;

typedef struct nb_metric_value {
    const char *name; /* a JSON key; not "kind", "step" or "time" */
    double value;
} nb_metric_value;

/* Creates (truncates) or, with `append`, extends the file. NB_ERR_IO with
 * the path and the reason when it cannot be opened. */
NB_API nb_status nb_metrics_log_open(nb_metrics_log **out, const char *path, bool append,
                              double time_offset);
/* Appends one line. NB_ERR_IO when the write fails. */
NB_API nb_status nb_metrics_log_write(nb_metrics_log *log, const char *kind, int64_t step,
                               const nb_metric_value *values, int n);
NB_API double nb_metrics_log_time(const nb_metrics_log *log); /* seconds, as written */
NB_API void nb_metrics_log_close(nb_metrics_log *log);         /* NULL is fine */

/* Reads the series (x_key, y_key) of the lines whose "kind" is `kind`
 * (NULL: any) and that have both keys as numbers, into malloc'd arrays
 * (free() them; NULL when *n is 0). Points are sorted by x; where an x
 * repeats (a resumed run wrote those steps again) the later line wins.
 * A final line without its newline that does not parse (a run killed while
 * writing) is ignored; any other malformed line is NB_ERR_FORMAT naming the
 * file and line. */
NB_API nb_status nb_metrics_log_read(const char *path, const char *kind, const char *x_key,
                              const char *y_key, double **x, double **y, int64_t *n);

/* ---------------------------------------------------------- SVG plots */
typedef struct nb_plot_series {
    const char *label;
    const double *x, *y; /* non-finite points break the line */
    int64_t n;
} nb_plot_series;

typedef struct nb_plot_opts {
    const char *title, *x_label, *y_label; /* NULL: none */
    int width, height;                     /* pixels; 0: 720 x 420 */
    bool log_y;                            /* logarithmic y axis (positive values only) */
    bool markers;                          /* a dot on every point (for few points) */
    bool integer_x;                        /* x ticks at whole numbers only (counts, world sizes) */
} nb_plot_opts;

/* Writes a line plot of the series (up to 8 colours, then they repeat) with
 * axes, ticks at 1-2-5 steps, a grid and a legend, as a standalone SVG file
 * (atomically: a temporary file renamed over `path`). NB_ERR_IO on failure.
 * Options left zero (a struct written as {title, x, y, w, h, log_y}) keep
 * lines without markers and ticks anywhere. */
NB_API nb_status nb_plot_svg(const char *path, const nb_plot_series *series, int n_series,
                      const nb_plot_opts *opts);

#ifdef __cplusplus
}
#endif
#endif
