/* What the training programs show a person (report.h). */
#include "report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "files.h"

bool report_progress_mode(const char *prog, const char *s, nb_progress_mode *mode) {
    static const struct {
        const char *name;
        nb_progress_mode mode;
    } modes[] = {{"auto", NB_PROGRESS_AUTO}, {"line", NB_PROGRESS_LINE},
                 {"plain", NB_PROGRESS_PLAIN}, {"off", NB_PROGRESS_OFF}};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++)
        if (!strcmp(s, modes[i].name)) {
            *mode = modes[i].mode;
            return true;
        }
    fprintf(stderr, "%s: --progress must be auto, line, plain or off\n", prog);
    return false;
}

void report_plot_path(char *out, size_t size, const char *plot, const char *metrics) {
    if (plot) {
        snprintf(out, size, "%s", plot);
    } else if (metrics) {
        const char *dot = strrchr(metrics, '.'), *slash = strrchr(metrics, '/');
        int keep = dot && (!slash || dot > slash) ? (int)(dot - metrics) : (int)strlen(metrics);
        snprintf(out, size, "%.*s.svg", keep, metrics);
    } else {
        out[0] = 0;
    }
}

nb_status report_plot(const char *path, const char *metrics, const char *x_key,
                      const report_curve *curves, int n, const nb_plot_opts *opts) {
    nb_plot_series *s = calloc((size_t)n, sizeof *s);
    if (!s) return nb_set_error(NB_ERR_NOMEM, "plot: out of memory");
    nb_status st = NB_OK;
    int read = 0;
    for (; read < n && st == NB_OK; read++) {
        double *x = NULL, *y = NULL;
        int64_t m = 0;
        st = nb_metrics_log_read(metrics, curves[read].kind, x_key, curves[read].key, &x, &y, &m);
        s[read] = (nb_plot_series){curves[read].label, x, y, m};
    }
    if (st == NB_OK) st = files_make_parent_dirs(path);
    if (st == NB_OK) st = nb_plot_svg(path, s, n, opts);
    for (int i = 0; i < read; i++) free((void *)s[i].x), free((void *)s[i].y);
    free(s);
    return st;
}
