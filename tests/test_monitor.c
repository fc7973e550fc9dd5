/* Watching a run: the progress display's text and its two modes (a line
 * rewritten with '\r', plain lines every few steps) and its silence when
 * off; the JSON-lines metrics log written and read back (exact numbers,
 * null for non-finite values, kinds, repeated steps, a half-written last
 * line, errors with file and line); the SVG plot (well-formed text, one
 * polyline per unbroken run, coordinates at the frame, escaped labels,
 * errors). No assertion depends on timing. */
#define _DEFAULT_SOURCE /* mkdtemp */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

static char dir[64];

static void make_dir(void) {
    strcpy(dir, "/tmp/nb_test_monitor_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void remove_file(const char *file) {
    char p[128];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    unlink(p);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    ck_assert_int_eq(fread(s, 1, (size_t)n, f), n);
    s[n] = 0;
    fclose(f);
    return s;
}

static int count(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* ------------------------------------------------------------ progress */
START_TEST(test_format) {
    char b[128];
    ck_assert_str_eq(nb_format_count(b, sizeof b, 0), "0");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 950), "950");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 999.4), "999");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 999.6), "1.00k");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 15234), "15.2k");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 152340), "152k");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 3.4e6), "3.40M");
    ck_assert_str_eq(nb_format_count(b, sizeof b, 1.2e9), "1.20G");
    ck_assert_str_eq(nb_format_duration(b, sizeof b, 0), "0s");
    ck_assert_str_eq(nb_format_duration(b, sizeof b, 42.4), "42s");
    ck_assert_str_eq(nb_format_duration(b, sizeof b, 303), "5m03s");
    ck_assert_str_eq(nb_format_duration(b, sizeof b, 7620), "2h07m");
    ck_assert_str_eq(nb_format_duration(b, sizeof b, 273600), "3d04h");
    ck_assert_str_eq(nb_format_duration(b, sizeof b, NAN), "?");
    ck_assert_str_eq(nb_progress_format(b, sizeof b, 120, 1000, 2.34561, 15234, "tok", 65),
                     "step 120/1000 | loss 2.3456 | 15.2k tok/s | eta 1m05s");
    ck_assert_str_eq(nb_progress_format(b, sizeof b, 1, 10, NAN, NAN, "tok", NAN), "step 1/10");
    ck_assert_str_eq(nb_progress_format(b, sizeof b, 3, 10, 0.5, 80, NULL, NAN),
                     "step 3/10 | loss 0.5000 | 80 items/s");
    char small[12];
    ck_assert_str_eq(nb_progress_format(small, sizeof small, 120, 1000, 2.3, 1, "tok", 1), "step 120/10");
}
END_TEST

START_TEST(test_progress_plain) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_progress_opts o = {NB_PROGRESS_AUTO, "samples", 10, 0};
    nb_progress *p = nb_progress_new(f, 0, 25, &o);
    ck_assert_int_eq(nb_progress_get_mode(p), NB_PROGRESS_PLAIN); /* a memstream is no terminal */
    for (int s = 1; s <= 25; s++) {
        nb_progress_update(p, s, 3.0 - 0.1 * s, 8);
        if (s == 12) nb_progress_printf(p, "epoch %d: accuracy %.1f%%", 1, 93.5);
    }
    nb_progress_free(p);
    fclose(f);
    /* the first step, every 10th, the last, and the message */
    ck_assert_int_eq(count(buf, "\n"), 5);
    ck_assert_int_eq(count(buf, "\r"), 0);
    ck_assert_msg(strncmp(buf, "step 1/25 | loss 2.9000\n", 24) == 0, "%s", buf);
    ck_assert_msg(strstr(buf, "\nstep 10/25 | loss 2.0000 | "), "%s", buf);
    ck_assert_msg(strstr(buf, " samples/s | eta "), "%s", buf);
    ck_assert_msg(strstr(buf, "\nepoch 1: accuracy 93.5%\nstep 20/25 | loss 1.0000"), "%s", buf);
    ck_assert_msg(strstr(buf, "\nstep 25/25 | loss 0.5000 | "), "%s", buf);
    free(buf);
}
END_TEST

START_TEST(test_progress_line) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_progress_opts o = {NB_PROGRESS_LINE, "tok", 0, 1e9}; /* redraw only the first and last */
    nb_progress *p = nb_progress_new(f, 100, 110, &o);
    for (int s = 101; s <= 105; s++) nb_progress_update(p, s, 1.0, 64);
    fflush(f);
    ck_assert_int_eq(count(buf, "\n"), 0);
    ck_assert_int_eq(count(buf, "\r"), 1);
    ck_assert_str_eq(buf, "\rstep 101/110 | loss 1.0000");
    nb_progress_printf(p, "eval loss %.2f", 0.75);
    fflush(f);
    /* cleared with spaces, the message on its own line, the status redrawn */
    char want[256];
    snprintf(want, sizeof want, "\rstep 101/110 | loss 1.0000\r%26s\r"
             "eval loss 0.75\n\rstep 105/110 | loss 1.0000 | ", "");
    ck_assert_msg(strncmp(buf, want, strlen(want)) == 0, "%s", buf);
    for (int s = 106; s <= 110; s++) nb_progress_update(p, s, 0.5, 64);
    nb_progress_free(p);
    fclose(f);
    ck_assert_int_eq(count(buf, "\n"), 2); /* the message, then the end of the live line */
    ck_assert_msg(strstr(buf, "\rstep 110/110 | loss 0.5000 | "), "%s", buf);
    ck_assert_msg(strstr(buf, " tok/s | eta 0s"), "%s", buf);
    ck_assert_int_eq(buf[strlen(buf) - 1], '\n');
    free(buf);
}
END_TEST

START_TEST(test_progress_off) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_progress_opts o = {NB_PROGRESS_OFF, NULL, 0, 0};
    nb_progress *p = nb_progress_new(f, 0, 5, &o);
    for (int s = 1; s <= 5; s++) nb_progress_update(p, s, 1, 1);
    nb_progress_printf(p, "not shown");
    nb_progress_free(p);
    nb_progress_free(NULL);
    fclose(f);
    ck_assert_uint_eq(len, 0);
    free(buf);
    NBT_EXPECT_ABORT(nb_progress_new(stdout, 5, 4, NULL),
                     "nb_progress_new: need 0 <= first_step (5) <= total_steps (4)");
    NBT_EXPECT_ABORT(nb_progress_new(NULL, 0, 4, NULL), "nb_progress_new: the stream is NULL");
}
END_TEST

/* --------------------------------------------------------- metrics log */
START_TEST(test_metrics_roundtrip) {
    make_dir();
    char path[128];
    snprintf(path, sizeof path, "%s/m.jsonl", dir);
    nb_metrics_log *log;
    ck_assert_int_eq(nb_metrics_log_open(&log, path, false, 100.0), NB_OK);
    ck_assert(nb_metrics_log_time(log) >= 100.0);
    const double third = 1.0 / 3.0;
    for (int s = 1; s <= 4; s++)
        ck_assert_int_eq(nb_metrics_log_write(log, "train", s,
                                              (nb_metric_value[]){{"loss", third * s}, {"lr", 1e-3}}, 2),
                         NB_OK);
    ck_assert_int_eq(nb_metrics_log_write(log, "eval", 4, (nb_metric_value[]){{"val_loss", NAN}}, 1), NB_OK);
    ck_assert_int_eq(nb_metrics_log_write(log, "eval", 2, (nb_metric_value[]){{"val_loss", 0.25}}, 1), NB_OK);
    NBT_EXPECT_ABORT(nb_metrics_log_write(log, "train", 5, (nb_metric_value[]){{"step", 1}}, 1),
                     "nb_metrics_log_write: value 0 is named \"step\"");
    nb_metrics_log_close(log);
    /* a resumed run appends steps 3 and 4 again */
    ck_assert_int_eq(nb_metrics_log_open(&log, path, true, 0), NB_OK);
    ck_assert_int_eq(nb_metrics_log_write(log, "train", 3, (nb_metric_value[]){{"loss", 7.5}}, 1), NB_OK);
    nb_metrics_log_close(log);

    char *text = slurp(path);
    ck_assert_msg(strncmp(text, "{\"kind\":\"train\",\"step\":1,\"time\":1", 33) == 0, "%s", text);
    ck_assert_msg(strstr(text, ",\"loss\":0.33333333333333331,\"lr\":0.001}\n"), "%s", text);
    ck_assert_msg(strstr(text, "{\"kind\":\"eval\",\"step\":4,"), "%s", text);
    ck_assert_msg(strstr(text, ",\"val_loss\":null}\n"), "%s", text);
    ck_assert_int_eq(count(text, "\n"), 7);
    free(text);

    double *x, *y;
    int64_t n;
    ck_assert_int_eq(nb_metrics_log_read(path, "train", "step", "loss", &x, &y, &n), NB_OK);
    ck_assert_int_eq(n, 4);
    const double want[4] = {third, 2 * third, 7.5, 4 * third};
    for (int i = 0; i < 4; i++) {
        ck_assert_double_eq(x[i], i + 1);
        ck_assert_double_eq(y[i], want[i]); /* exact, and the later step 3 wins */
    }
    free(x), free(y);
    /* any kind; null values are not points; sorted by step */
    ck_assert_int_eq(nb_metrics_log_read(path, NULL, "step", "val_loss", &x, &y, &n), NB_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_double_eq(x[0], 2);
    ck_assert_double_eq(y[0], 0.25);
    free(x), free(y);
    ck_assert_int_eq(nb_metrics_log_read(path, "eval", "step", "loss", &x, &y, &n), NB_OK);
    ck_assert_int_eq(n, 0);
    ck_assert_ptr_null(x);
    remove_file("m.jsonl");
    rmdir(dir);
}
END_TEST

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

START_TEST(test_metrics_errors) {
    make_dir();
    char path[128], msg[256];
    snprintf(path, sizeof path, "%s/bad.jsonl", dir);
    double *x, *y;
    int64_t n;
    /* a run killed while writing its last line */
    write_file(path, "{\"step\":1,\"loss\":2}\n\n{\"step\":2,\"loss\":1}\n{\"step\":3,\"lo");
    ck_assert_int_eq(nb_metrics_log_read(path, NULL, "step", "loss", &x, &y, &n), NB_OK);
    ck_assert_int_eq(n, 2);
    free(x), free(y);
    write_file(path, "{\"step\":1,\"loss\":2}\n{\"step\":2,\"lo\n{\"step\":3,\"loss\":1}\n");
    ck_assert_int_eq(nb_metrics_log_read(path, NULL, "step", "loss", &x, &y, &n), NB_ERR_FORMAT);
    snprintf(msg, sizeof msg, "%s:2: not a JSON line: ", path);
    ck_assert_msg(strstr(nb_last_error(), msg), "%s", nb_last_error());
    write_file(path, "[1, 2]\n");
    ck_assert_int_eq(nb_metrics_log_read(path, NULL, "step", "loss", &x, &y, &n), NB_ERR_FORMAT);
    snprintf(msg, sizeof msg, "%s:1: a line must be a JSON object, found an array", path);
    ck_assert_str_eq(nb_last_error(), msg);
    unlink(path);
    ck_assert_int_eq(nb_metrics_log_read(path, NULL, "step", "loss", &x, &y, &n), NB_ERR_IO);
    snprintf(msg, sizeof msg, "cannot read metrics log \"%s\": No such file or directory", path);
    ck_assert_str_eq(nb_last_error(), msg);
    nb_metrics_log *log;
    snprintf(path, sizeof path, "%s/no/such/dir.jsonl", dir);
    ck_assert_int_eq(nb_metrics_log_open(&log, path, false, 0), NB_ERR_IO);
    ck_assert_ptr_null(log);
    snprintf(msg, sizeof msg, "cannot open metrics log \"%s\": No such file or directory", path);
    ck_assert_str_eq(nb_last_error(), msg);
    rmdir(dir);
}
END_TEST

/* ---------------------------------------------------------------- plots */
START_TEST(test_plot) {
    make_dir();
    char path[128];
    snprintf(path, sizeof path, "%s/p.svg", dir);
    double x[6] = {0, 1, 2, 3, 4, 10}, y[6] = {4, 3, NAN, 2, 1.5, 1}, y2[2] = {3.5, 1.2};
    double x2[2] = {0, 10};
    nb_plot_series s[2] = {{"train <loss> & co", x, y, 6}, {"val", x2, y2, 2}};
    nb_plot_opts o = {"a \"title\"", "step", "loss", 400, 300, false, false, false};
    ck_assert_int_eq(nb_plot_svg(path, s, 2, &o), NB_OK);
    char *svg = slurp(path);
    ck_assert_msg(strncmp(svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg ", 44) == 0, "%s", svg);
    ck_assert_msg(strstr(svg, "width=\"400\" height=\"300\""), "%s", svg);
    ck_assert_int_eq(count(svg, "</svg>\n"), 1);
    ck_assert_int_eq(count(svg, "<polyline"), 3); /* the NaN splits the first series */
    ck_assert_msg(strstr(svg, ">train &lt;loss&gt; &amp; co</text>"), "%s", svg);
    ck_assert_msg(strstr(svg, ">a &quot;title&quot;</text>"), "%s", svg);
    /* x = 0 at the left edge of the frame (72 px), x = 10 at the right (400 - 24) */
    ck_assert_msg(strstr(svg, "points=\"72.0,"), "%s", svg);
    ck_assert_msg(strstr(svg, " 376.0,"), "%s", svg);
    ck_assert_msg(strstr(svg, ">10</text>"), "%s", svg); /* the last x tick */
    free(svg);
    /* log axis, an empty plot, and a directory that does not exist */
    o.log_y = true;
    ck_assert_int_eq(nb_plot_svg(path, s, 2, &o), NB_OK);
    ck_assert_int_eq(nb_plot_svg(path, NULL, 0, NULL), NB_OK);
    svg = slurp(path);
    ck_assert_int_eq(count(svg, "<polyline"), 0);
    free(svg);
    unlink(path);
    char bad[160], msg[256];
    snprintf(bad, sizeof bad, "%s/missing/p.svg", dir);
    ck_assert_int_eq(nb_plot_svg(bad, s, 2, NULL), NB_ERR_IO);
    snprintf(msg, sizeof msg, "cannot write plot \"%s.tmp.", bad);
    ck_assert_msg(strstr(nb_last_error(), msg), "%s", nb_last_error());
    NBT_EXPECT_ABORT(nb_plot_svg(path, s, 1, &(nb_plot_opts){NULL, NULL, NULL, 100, 50, false, false, false}),
                     "nb_plot_svg: 100 x 50 pixels leave no room for the plot");
    rmdir(dir);
}
END_TEST

/* A scaling plot: world sizes 1, 2, 4 with a dot on every point and whole
 * world sizes on the x axis (without integer_x the ticks fall at 0.5 steps) */
START_TEST(test_plot_markers) {
    make_dir();
    char path[128];
    snprintf(path, sizeof path, "%s/m.svg", dir);
    double x[3] = {1, 2, 4}, y[3] = {100, 60, 40}, y2[3] = {100, 90, 70};
    nb_plot_series s[2] = {{"mlp", x, y, 3}, {"gpt", x, y2, 3}};
    nb_plot_opts o = {"scaling", "world size", "efficiency (%)", 400, 300, false, false, false};
    ck_assert_int_eq(nb_plot_svg(path, s, 2, &o), NB_OK);
    char *svg = slurp(path);
    ck_assert_int_eq(count(svg, "<circle"), 0); /* lines only, as before */
    ck_assert_msg(strstr(svg, ">1.5</text>"), "%s", svg);
    free(svg);
    o.markers = o.integer_x = true;
    ck_assert_int_eq(nb_plot_svg(path, s, 2, &o), NB_OK);
    svg = slurp(path);
    ck_assert_int_eq(count(svg, "<circle"), 3 + 3 + 2); /* every point, and one per legend entry */
    ck_assert_int_eq(count(svg, "<polyline"), 2);
    ck_assert_msg(!strstr(svg, ".5</text>"), "%s", svg);
    for (int w = 1; w <= 4; w++) {
        char tick[32];
        snprintf(tick, sizeof tick, "text-anchor=\"middle\">%d</text>", w);
        ck_assert_msg(strstr(svg, tick), "no x tick %d: %s", w, svg);
    }
    /* markers leave a margin: world size 1 is inside the frame (72 px), not on it */
    ck_assert_msg(!strstr(svg, "cx=\"72.0\""), "%s", svg);
    free(svg);
    unlink(path);
    rmdir(dir);
}
END_TEST

NBT_MAIN("monitor", "core", 0,
         test_format, test_plot_markers, test_progress_plain, test_progress_line, test_progress_off,
         test_metrics_roundtrip, test_metrics_errors, test_plot)
