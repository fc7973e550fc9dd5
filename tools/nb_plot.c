/* nb_plot: draws curves from a JSON-lines metrics log as an SVG line plot.
 *
 *   nb_plot METRICS.jsonl OUT.svg [--x KEY] [--y KEY[,KEY...]] [--kind KIND]
 *           [--title TEXT] [--log-y]
 *
 * Defaults: x "step", y "loss,val_loss" (the training programs write
 * "loss" on train lines and "val_loss" on eval lines), every kind. One
 * series per y key; keys with no points are left out. Exit status 0, 1 when
 * the log cannot be read or holds no point at all, 2 on bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

#define MAX_SERIES 8

static int usage(void) {
    fprintf(stderr, "usage: nb_plot METRICS.jsonl OUT.svg [--x KEY] [--y KEY[,KEY...]] "
                    "[--kind KIND] [--title TEXT] [--log-y]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *in = NULL, *out = NULL, *xkey = "step", *kind = NULL, *title = NULL;
    char ykeys[1024] = "loss,val_loss";
    bool log_y = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--log-y")) log_y = true;
        else if (a[0] == '-' && a[1] == '-') {
            if (i + 1 >= argc) return usage();
            const char *v = argv[++i];
            if (!strcmp(a, "--x")) xkey = v;
            else if (!strcmp(a, "--y")) snprintf(ykeys, sizeof ykeys, "%s", v);
            else if (!strcmp(a, "--kind")) kind = v;
            else if (!strcmp(a, "--title")) title = v;
            else return usage();
        } else if (!in) in = a;
        else if (!out) out = a;
        else return usage();
    }
    if (!in || !out) return usage();

    nb_plot_series series[MAX_SERIES];
    int n = 0;
    int64_t points = 0;
    for (char *save = NULL, *key = strtok_r(ykeys, ",", &save); key && n < MAX_SERIES;
         key = strtok_r(NULL, ",", &save)) {
        double *x, *y;
        int64_t m;
        if (nb_metrics_log_read(in, kind, xkey, key, &x, &y, &m) != NB_OK) {
            fprintf(stderr, "nb_plot: %s\n", nb_last_error());
            return 1;
        }
        if (m == 0) continue;
        series[n++] = (nb_plot_series){key, x, y, m};
        points += m;
    }
    if (points == 0) {
        fprintf(stderr, "nb_plot: %s has no line with both \"%s\" and one of the y keys\n", in, xkey);
        return 1;
    }
    bool all_losses = true;
    for (int i = 0; i < n; i++) all_losses &= strstr(series[i].label, "loss") != NULL;
    const char *ylabel = n == 1 ? series[0].label : all_losses ? "loss" : "value";
    nb_plot_opts o = {title ? title : in, xkey, ylabel, 0, 0, log_y, false, false};
    nb_status s = nb_plot_svg(out, series, n, &o);
    for (int i = 0; i < n; i++) {
        free((void *)series[i].x);
        free((void *)series[i].y);
    }
    if (s != NB_OK) {
        fprintf(stderr, "nb_plot: %s\n", nb_last_error());
        return 1;
    }
    printf("wrote %s (%d series, %lld points)\n", out, n, (long long)points);
    return 0;
}
