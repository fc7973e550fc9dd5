/* The JSON-lines metrics log: writing one object per line (flushed, so a
 * crash keeps every finished line and `tail -f` follows the run), and
 * reading one (x, y) series back for plotting, with util/json.c's
 * strict parser. Numbers are printed with %.17g, which reads back exactly. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/json.h"
#include "nabla/monitor.h"

struct nb_metrics_log {
    FILE *f;
    char *path;
    double t0, offset;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

nb_status nb_metrics_log_open(nb_metrics_log **out, const char *path, bool append,
                              double time_offset) {
    NB_CHECK(out && path, "nb_metrics_log_open: out and path must not be NULL");
    *out = NULL;
    FILE *f = fopen(path, append ? "a" : "w");
    if (!f) return nb_set_error(NB_ERR_IO, "cannot open metrics log \"%s\": %s", path, strerror(errno));
    nb_metrics_log *log = calloc(1, sizeof *log);
    char *copy = malloc(strlen(path) + 1);
    if (!log || !copy) {
        fclose(f);
        free(log);
        free(copy);
        return nb_set_error(NB_ERR_NOMEM, "nb_metrics_log_open: out of memory");
    }
    strcpy(copy, path);
    log->f = f;
    log->path = copy;
    log->t0 = now_s();
    log->offset = time_offset;
    *out = log;
    return NB_OK;
}

double nb_metrics_log_time(const nb_metrics_log *log) { return log->offset + now_s() - log->t0; }

static void put_number(nb_strbuf *b, double v) {
    if (isfinite(v)) nb__strbuf_printf(b, "%.17g", v);
    else nb__strbuf_append(b, "null", 4);
}

nb_status nb_metrics_log_write(nb_metrics_log *log, const char *kind, int64_t step,
                               const nb_metric_value *values, int n) {
    NB_CHECK(log && kind && (values || n == 0) && n >= 0,
             "nb_metrics_log_write: log, kind and values must be given");
    for (int i = 0; i < n; i++) {
        const char *k = values[i].name;
        NB_CHECK(k && strcmp(k, "kind") && strcmp(k, "step") && strcmp(k, "time"),
                 "nb_metrics_log_write: value %d is named \"%s\"; names must be given and not be "
                 "kind, step or time", i, k ? k : "(null)");
    }
    nb_strbuf b = {0};
    nb__strbuf_append(&b, "{\"kind\":", 8);
    nb__json_write_string(&b, kind, strlen(kind));
    nb__strbuf_printf(&b, ",\"step\":%lld,\"time\":%.3f", (long long)step, nb_metrics_log_time(log));
    for (int i = 0; i < n; i++) {
        const char *k = values[i].name;
        nb__strbuf_append(&b, ",", 1);
        nb__json_write_string(&b, k, strlen(k));
        nb__strbuf_append(&b, ":", 1);
        put_number(&b, values[i].value);
    }
    nb__strbuf_append(&b, "}\n", 2);
    nb_status s = NB_OK;
    if (b.failed) s = nb_set_error(NB_ERR_NOMEM, "nb_metrics_log_write: out of memory");
    else if (fwrite(b.data, 1, b.len, log->f) != b.len || fflush(log->f) != 0)
        s = nb_set_error(NB_ERR_IO, "cannot write metrics log \"%s\": %s", log->path, strerror(errno));
    nb__strbuf_free(&b);
    return s;
}

void nb_metrics_log_close(nb_metrics_log *log) {
    if (!log) return;
    fclose(log->f);
    free(log->path);
    free(log);
}

/* ------------------------------------------------------------- reading */
typedef struct point {
    double x, y;
    int64_t line;
} point;

static int cmp_point(const void *a, const void *b) {
    const point *p = a, *q = b;
    if (p->x != q->x) return p->x < q->x ? -1 : 1;
    return (p->line > q->line) - (p->line < q->line);
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *bigger = realloc(buf, cap * 2);
        if (!bigger) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = bigger;
        cap *= 2;
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        errno = EIO;
        return NULL;
    }
    *len = n;
    return buf;
}

nb_status nb_metrics_log_read(const char *path, const char *kind, const char *x_key,
                              const char *y_key, double **x, double **y, int64_t *n) {
    NB_CHECK(path && x_key && y_key && x && y && n,
             "nb_metrics_log_read: path, keys and outputs must not be NULL");
    *x = *y = NULL;
    *n = 0;
    size_t len = 0;
    char *text = read_all(path, &len);
    if (!text) return nb_set_error(NB_ERR_IO, "cannot read metrics log \"%s\": %s", path, strerror(errno));
    point *pts = NULL;
    int64_t np = 0, cap = 0, line = 0;
    nb_status s = NB_OK;
    for (size_t at = 0; at < len && s == NB_OK;) {
        char *end = memchr(text + at, '\n', len - at);
        size_t stop = end ? (size_t)(end - text) : len;
        line++;
        size_t a = at, b = stop;
        at = stop + 1;
        while (a < b && (text[a] == ' ' || text[a] == '\t' || text[a] == '\r')) a++;
        if (a == b) continue;
        nb_json_doc *doc;
        if (nb__json_parse(text + a, b - a, &doc) != NB_OK) {
            if (!end) break; /* an unfinished last line */
            s = nb_set_error(NB_ERR_FORMAT, "%s:%lld: not a JSON line: %s", path, (long long)line,
                             nb_last_error());
            break;
        }
        const nb_json *root = nb__json_root(doc);
        if (root->type != NB_JSON_OBJECT) {
            s = nb_set_error(NB_ERR_FORMAT, "%s:%lld: a line must be a JSON object, found %s", path,
                             (long long)line, nb__json_type_name(root->type));
            nb__json_free(doc);
            break;
        }
        const nb_json *k = nb__json_get(root, "kind");
        const nb_json *vx = nb__json_get(root, x_key), *vy = nb__json_get(root, y_key);
        bool match = !kind || (k && k->type == NB_JSON_STRING && strcmp(k->str, kind) == 0);
        if (match && vx && vy && vx->type == NB_JSON_NUMBER && vy->type == NB_JSON_NUMBER) {
            if (np == cap) {
                cap = cap ? 2 * cap : 256;
                point *bigger = realloc(pts, (size_t)cap * sizeof *pts);
                if (!bigger) {
                    nb__json_free(doc);
                    s = nb_set_error(NB_ERR_NOMEM, "nb_metrics_log_read: out of memory");
                    break;
                }
                pts = bigger;
            }
            pts[np++] = (point){vx->number, vy->number, line};
        }
        nb__json_free(doc);
    }
    free(text);
    if (s != NB_OK) {
        free(pts);
        return s;
    }
    if (np > 1) qsort(pts, (size_t)np, sizeof *pts, cmp_point);
    int64_t m = 0; /* keep the last line of each x */
    for (int64_t i = 0; i < np; i++) {
        if (m > 0 && pts[m - 1].x == pts[i].x) pts[m - 1] = pts[i];
        else pts[m++] = pts[i];
    }
    if (m > 0) {
        *x = malloc((size_t)m * sizeof **x);
        *y = malloc((size_t)m * sizeof **y);
        if (!*x || !*y) {
            free(*x), free(*y), free(pts);
            *x = *y = NULL;
            return nb_set_error(NB_ERR_NOMEM, "nb_metrics_log_read: out of memory");
        }
        for (int64_t i = 0; i < m; i++) (*x)[i] = pts[i].x, (*y)[i] = pts[i].y;
    }
    *n = m;
    free(pts);
    return NB_OK;
}
