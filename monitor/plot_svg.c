/* Line plots as standalone SVG: axes with ticks at 1-2-5 steps (or powers
 * of ten on a log axis; whole numbers only with integer_x), a light grid,
 * one polyline per series, optionally a dot on every point, and a legend. Plain SVG 1.1 with no scripts or external fonts, so any browser
 * or image viewer shows it; nothing outside libc is needed.
 *
 * The file is written under a temporary name in the same directory and
 * renamed over `path`, so a viewer that reloads it never sees half a plot. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nabla/monitor.h"

static const char *const colours[8] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                       "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

static void put_text(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

/* 1, 2 or 5 times a power of ten, close to span / target */
static double nice_step(double span, int target) {
    double raw = span / target, p = pow(10, floor(log10(raw))), r = raw / p;
    return (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10) * p;
}

typedef struct axis {
    double lo, hi; /* data range, in plot units (log10 for a log axis) */
    bool log;
} axis;

static void axis_fit(axis *a, double lo, double hi, bool log_scale, bool pad) {
    if (log_scale) lo = log10(lo), hi = log10(hi);
    if (!(hi > lo)) {
        double c = isfinite(lo) ? lo : 0, d = fabs(c) > 0 ? fabs(c) * 0.1 : 1;
        lo = c - d, hi = c + d;
    } else if (pad) {
        double d = 0.05 * (hi - lo);
        lo -= d, hi += d;
    }
    a->lo = lo, a->hi = hi, a->log = log_scale;
}

static void tick_label(char *buf, size_t n, double v, double step, bool log_scale) {
    if (log_scale) v = pow(10, v);
    if (fabs(v) < 1e-12 * step) v = 0;
    snprintf(buf, n, "%.6g", v);
}

nb_status nb_plot_svg(const char *path, const nb_plot_series *series, int n_series,
                      const nb_plot_opts *opts) {
    NB_CHECK(path && (series || n_series == 0) && n_series >= 0,
             "nb_plot_svg: path and series must be given");
    nb_plot_opts o = opts ? *opts : (nb_plot_opts){0};
    int w = o.width > 0 ? o.width : 720, h = o.height > 0 ? o.height : 420;
    const double left = 72, right = 24, top = o.title ? 40 : 20, bottom = o.x_label ? 56 : 36;
    double pw = w - left - right, ph = h - top - bottom;
    NB_CHECK(pw > 40 && ph > 40, "nb_plot_svg: %d x %d pixels leave no room for the plot", w, h);

    double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
    for (int s = 0; s < n_series; s++)
        for (int64_t i = 0; i < series[s].n; i++) {
            double x = series[s].x[i], y = series[s].y[i];
            if (!isfinite(x) || !isfinite(y) || (o.log_y && y <= 0)) continue;
            xmin = fmin(xmin, x), xmax = fmax(xmax, x), ymin = fmin(ymin, y), ymax = fmax(ymax, y);
        }
    if (!isfinite(xmin)) xmin = 0, xmax = 1, ymin = o.log_y ? 1 : 0, ymax = o.log_y ? 10 : 1;
    axis ax, ay;
    /* a dot at the frame's edge would be cut in half: markers get a margin */
    axis_fit(&ax, xmin, xmax, false, o.markers);
    axis_fit(&ay, ymin, ymax, o.log_y, true);
#define PX(v) (left + ((v) - ax.lo) / (ax.hi - ax.lo) * pw)
#define PY(v) (top + ph - ((v) - ay.lo) / (ay.hi - ay.lo) * ph)

    char tmp[4096];
    int len = snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    NB_CHECK(len > 0 && (size_t)len < sizeof tmp, "nb_plot_svg: path too long: \"%s\"", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return nb_set_error(NB_ERR_IO, "cannot write plot \"%s\": %s", tmp, strerror(errno));

    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", w, h, w, h);
    if (o.title) {
        fprintf(f, "<text x=\"%.1f\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">", left + pw / 2);
        put_text(f, o.title);
        fputs("</text>\n", f);
    }
    /* grid and ticks */
    char label[64];
    double sx = nice_step(ax.hi - ax.lo, 6);
    if (o.integer_x && sx < 1) sx = 1; /* 1-2-5 steps of 1 and more are whole numbers */
    for (double v = ceil(ax.lo / sx) * sx; v <= ax.hi + 1e-9 * sx; v += sx) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e5e5e5\"/>\n",
                PX(v), top, PX(v), top + ph);
        tick_label(label, sizeof label, v, sx, false);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", PX(v),
                top + ph + 16, label);
    }
    /* y ticks: 1-2-5 steps of the values (also on a log axis spanning less
     * than two decades), or whole decades */
    bool decades = ay.log && ay.hi - ay.lo >= 2;
    double vlo = ay.log && !decades ? pow(10, ay.lo) : ay.lo, vhi = ay.log && !decades ? pow(10, ay.hi) : ay.hi;
    double sy = decades ? ceil((ay.hi - ay.lo) / 6) : nice_step(vhi - vlo, 6);
    for (double v = ceil(vlo / sy) * sy; v <= vhi + 1e-9 * sy; v += sy) {
        double at = ay.log && !decades ? log10(v) : v;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e5e5e5\"/>\n",
                left, PY(at), left + pw, PY(at));
        tick_label(label, sizeof label, v, sy, decades);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", left - 6,
                PY(at) + 4, label);
    }
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
               "stroke=\"#333\"/>\n", left, top, pw, ph);
    if (o.x_label) {
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", left + pw / 2, (double)h - 12);
        put_text(f, o.x_label);
        fputs("</text>\n", f);
    }
    if (o.y_label) {
        fprintf(f, "<text transform=\"translate(16 %.1f) rotate(-90)\" text-anchor=\"middle\">",
                top + ph / 2);
        put_text(f, o.y_label);
        fputs("</text>\n", f);
    }
    /* series: a polyline per unbroken run of finite points */
    for (int s = 0; s < n_series; s++) {
        const char *c = colours[s % 8];
        bool open = false;
        for (int64_t i = 0; i < series[s].n; i++) {
            double x = series[s].x[i], y = series[s].y[i];
            bool ok = isfinite(x) && isfinite(y) && (!o.log_y || y > 0);
            if (!ok) {
                if (open) fputs("\"/>\n", f);
                open = false;
                continue;
            }
            if (!open)
                fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" "
                           "stroke-linejoin=\"round\" points=\"", c);
            fprintf(f, "%s%.1f,%.1f", open ? " " : "", PX(x), PY(o.log_y ? log10(y) : y));
            open = true;
        }
        if (open) fputs("\"/>\n", f);
        for (int64_t i = 0; i < series[s].n; i++) { /* every point, or a lone one */
            double x = series[s].x[i], y = series[s].y[i];
            if (!(o.markers || series[s].n == 1) || !isfinite(x) || !isfinite(y) || (o.log_y && y <= 0)) continue;
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%s\" fill=\"%s\"/>\n", PX(x),
                    PY(o.log_y ? log10(y) : y), o.markers ? "3.5" : "2.5", c);
        }
    }
    /* the legend, over a white panel at the right: at the top, the middle
     * or the bottom, wherever the curves pass least (segments sampled) */
    double box_h = 16 * n_series + 6, box_x = left + pw - 156;
    double tops[3] = {top + 4, top + (ph - box_h) / 2, top + ph - box_h - 4};
    int64_t hits[3] = {0, 0, 0};
    for (int s = 0; s < n_series; s++)
        for (int64_t i = 0; i + 1 < series[s].n; i++) {
            double x0 = series[s].x[i], y0 = series[s].y[i], x1 = series[s].x[i + 1], y1 = series[s].y[i + 1];
            if (!isfinite(x0 + y0 + x1 + y1) || (o.log_y && (y0 <= 0 || y1 <= 0))) continue;
            for (int k = 0; k <= 8; k++) {
                double t = k / 8.0, px = PX(x0 + t * (x1 - x0));
                double py = PY(o.log_y ? log10(y0) + t * (log10(y1) - log10(y0)) : y0 + t * (y1 - y0));
                for (int b = 0; b < 3; b++)
                    hits[b] += px >= box_x - 4 && py >= tops[b] - 4 && py <= tops[b] + box_h + 4;
            }
        }
    int best = 0;
    for (int b = 1; b < 3; b++)
        if (hits[b] < hits[best]) best = b;
    double box_top = tops[best];
    if (n_series > 0)
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"148\" height=\"%.0f\" fill=\"white\" "
                   "fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n", box_x, box_top, box_h);
    for (int s = 0; s < n_series; s++) {
        double ly = box_top + 16 + 16 * s, lx = left + pw - 150;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                   "stroke-width=\"2.5\"/>\n", lx, ly - 4, lx + 22, ly - 4, colours[s % 8]);
        if (o.markers)
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n", lx + 11, ly - 4,
                    colours[s % 8]);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">", lx + 28, ly);
        put_text(f, series[s].label ? series[s].label : "");
        fputs("</text>\n", f);
    }
    fputs("</svg>\n", f);
#undef PX
#undef PY
    bool bad = ferror(f) != 0;
    if (fclose(f) != 0) bad = true;
    if (bad || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return nb_set_error(NB_ERR_IO, "cannot write plot \"%s\": %s", path, strerror(e));
    }
    return NB_OK;
}
