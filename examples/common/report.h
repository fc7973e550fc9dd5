/* What the training programs show a person, beyond the library's monitor
 * (nabla/monitor.h): the --progress flag's modes, the plot's default path
 * (the metrics file's, with .svg), and a plot of curves read back from the
 * metrics log. */
#ifndef NABLA_EXAMPLES_REPORT_H
#define NABLA_EXAMPLES_REPORT_H

#include <stdbool.h>
#include <stddef.h>

#include <nabla/nabla.h>

/* "auto", "line", "plain" or "off" into *mode; otherwise false, after
 * saying so on stderr, naming `prog`. */
bool report_progress_mode(const char *prog, const char *s, nb_progress_mode *mode);

/* The plot's path: `plot` when given, else `metrics` with its extension
 * (if any) replaced by .svg, else "" (no plot). */
void report_plot_path(char *out, size_t size, const char *plot, const char *metrics);

/* One curve: the records of `kind` ("train"; NULL: every record) that
 * hold `key`, drawn against the plot's x key and labelled `label`. */
typedef struct report_curve {
    const char *kind, *key, *label;
} report_curve;

/* Reads each curve from the metrics log `metrics` and draws them as one
 * SVG plot at `path` (its directory made if needed). */
nb_status report_plot(const char *path, const char *metrics, const char *x_key,
                      const report_curve *curves, int n, const nb_plot_opts *opts);

#endif
