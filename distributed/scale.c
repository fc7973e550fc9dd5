/* The scaling model: collective costs, the step trace file and its replay.
 *
 * Note [Scaling model]
 * Costs are alpha-beta: a message costs alpha (latency) plus its bytes
 * over the bandwidth one device gets in one direction (bw). Over p devices
 * with n bytes (the whole buffer):
 *   ring reduce-scatter, all-gather:  (p-1) alpha + (p-1)/p n/bw
 *   ring all-reduce:                 2(p-1) alpha + 2(p-1)/p n/bw
 *   tree all-reduce (binomial reduce, then broadcast, not pipelined):
 *                                    2 ceil(log2 p) (alpha + n/bw)
 * "best" takes the cheaper of the two for an all-reduce (reduce-scatter
 * and all-gather are always rings), as NCCL picks by size. Over nodes x G
 * devices per node the collective is hierarchical: an all-reduce is a
 * reduce-scatter inside each node, an all-reduce of n/G bytes between
 * nodes (G of them at once, each device on its own inter-node link), and
 * an all-gather inside the node; a reduce-scatter stops after the
 * inter-node reduce-scatter, an all-gather mirrors it. With one node, or
 * one device per node, it is the flat collective on that level.
 *
 * The replay (weak scaling: every rank runs the trace's step on its own
 * batch): buckets are made from the trace's parameters in the order they
 * became ready, by DDP's own partition (nb__ddp_partition); bucket b's
 * collective starts at max(its ready time, the previous collective's end)
 * on one communication stream; the optimizer starts after backward and the
 * last collective. ZeRO-1 reduce-scatters each bucket instead, steps 1/R of
 * the optimizer's work and then all-gathers the parameters (not hidden).
 * The bf16 wire halves the bytes of f32 buckets. PowerSGD (steady state,
 * after its plain steps) sends per bucket one all-reduce of the
 * uncompressed values and the Ps, started at the bucket's ready time, and
 * one of the Qs, started by the next bucket's launch (or at the end of
 * backward for the last) once the Ps have arrived: that launch, and so
 * backward, waits for them (Note [PowerSGD] in ddp_powersgd.c); its
 * products are not counted. Efficiency is the world-1 step over the
 * projected step.
 *
 * What it leaves out (docs/benchmarks.md lists it for users): compute
 * slowed by communication sharing memory bandwidth and cores, the casts of
 * the bf16 wire, stragglers and skew between ranks, congestion in the
 * network between nodes, protocol overheads beyond alpha, and NCCL's
 * pipelined trees and NVLink SHARP. Presets are peak line rates, so the
 * projection is an upper bound on speed unless a "measured" link is used. */
#include "distributed/scale.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_buckets.h"

typedef struct preset {
    const char *name;
    double alpha_s, bw;
    const char *source;
} preset;

static const preset presets[] = {
#define NB__SCALE_PRESET_ROW(n, a, b, s) {n, a, b, s},
    NB__SCALE_PRESET_LIST(NB__SCALE_PRESET_ROW)
#undef NB__SCALE_PRESET_ROW
};

bool nb__scale_preset(const char *name, nb__scale_link *out) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (!strcmp(name, presets[i].name)) {
            *out = (nb__scale_link){presets[i].name, presets[i].alpha_s, presets[i].bw, presets[i].source};
            return true;
        }
    return false;
}

void nb__scale_presets_print(FILE *f) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        fprintf(f, "  %-12s alpha %5.1f us  %7.2f GB/s  %s\n", presets[i].name, 1e6 * presets[i].alpha_s,
                presets[i].bw / 1e9, presets[i].source);
}

nb_status nb__scale_fit(const char *path, nb__scale_link *out) {
    FILE *f = fopen(path, "r");
    if (!f) return nb_set_error(NB_ERR_IO, "nb_scale: cannot open the collectives table %s", path);
    char line[512];
    int R = 0, n = 0;
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    while (fgets(line, sizeof line, f)) {
        const char *b = strstr(line, "backend ");
        if (line[0] == '#') {
            if (b && sscanf(b, "backend %*s %d ranks", &R) != 1) R = 0;
            continue;
        }
        double size, us;
        char unit[16];
        long long count;
        int iters;
        if (sscanf(line, "%lf %15s %lld %d %lf", &size, unit, &count, &iters, &us) != 5) continue;
        double x = 4.0 * (double)count, y = us * 1e-6; /* f32 elements */
        sx += x, sy += y, sxx += x * x, sxy += x * y, n++;
    }
    fclose(f);
    if (R < 2 || n < 2)
        return nb_set_error(NB_ERR_FORMAT,
                            "nb_scale: %s is not bench_collectives' table of 2 ranks or more (%d ranks, %d rows)",
                            path, R, n);
    double den = n * sxx - sx * sx, slope = den > 0 ? (n * sxy - sx * sy) / den : 0, icpt = (sy - slope * sx) / n;
    if (!(slope > 0 && isfinite(slope) && isfinite(icpt) && 2.0 * (R - 1) / ((double)R * slope) > 0))
        return nb_set_error(NB_ERR_FORMAT, "nb_scale: the times in %s do not grow with the size: no bandwidth to fit",
                            path);
    *out = (nb__scale_link){"measured", icpt > 0 ? icpt / (2.0 * (R - 1)) : 0,
                            2.0 * (R - 1) / ((double)R * slope), "fitted to bench_collectives"};
    return NB_OK;
}

/* ---------------------------------------------------------------- costs */

static double ring_half(int p, double bytes, const nb__scale_link *l) { /* a reduce-scatter or an all-gather */
    return p <= 1 ? 0 : (p - 1) * l->alpha_s + (double)(p - 1) / p * bytes / l->bw;
}

double nb__scale_flat(nb__scale_coll c, nb__scale_algo a, int p, double bytes, const nb__scale_link *l) {
    if (p <= 1) return 0;
    if (c != NB__SCALE_ALL_REDUCE) return ring_half(p, bytes, l);
    double ring = 2 * ring_half(p, bytes, l), tree = 2 * ceil(log2((double)p)) * (l->alpha_s + bytes / l->bw);
    return a == NB__SCALE_RING ? ring : a == NB__SCALE_TREE ? tree : fmin(ring, tree);
}

double nb__scale_collective(nb__scale_coll c, nb__scale_algo a, int nodes, int per_node, double bytes,
                            const nb__scale_link *intra, const nb__scale_link *inter) {
    if (nodes <= 1) return nb__scale_flat(c, a, per_node, bytes, intra);
    if (per_node <= 1) return nb__scale_flat(c, a, nodes, bytes, inter);
    double inside = ring_half(per_node, bytes, intra), between = nb__scale_flat(c, a, nodes, bytes / per_node, inter);
    return c == NB__SCALE_ALL_REDUCE ? 2 * inside + between : inside + between;
}

/* ---------------------------------------------------------------- trace */

/* Note [Step trace]
 * A step trace is a text file, one record per line, '#' starting a
 * comment:
 *   nabla-step-trace 1               (the first line: format and version)
 *   source <free text>               (what made it: program, model, machine)
 *   forward_s <seconds>              (forward and the loss)
 *   backward_s <seconds>             (backward alone, no communication)
 *   optimizer_s <seconds>            (the optimizer step and zero_grad)
 *   param <name> <dtype> <numel> <ready_s> <rows>
 * one `param` per parameter that requires a gradient, in the order their
 * gradients became final, ready_s counted from the start of backward
 * (nondecreasing), and rows its first dimension when it has two or more
 * (0 for a vector; the field may be left out, meaning 0), which PowerSGD's
 * projection needs. Buckets are not in the file: the model makes them
 * from the parameters at any cap, as DDP would. */
#define TRACE_MAGIC "nabla-step-trace 1"

static bool parse_dtype(const char *s, nb_dtype *out) {
    for (int d = 0; d < NB_DTYPE_COUNT; d++)
        if (!strcmp(s, nb_dtype_name((nb_dtype)d))) return *out = (nb_dtype)d, true;
    return false;
}

nb_status nb__scale_trace_read(const char *path, nb__scale_trace *t) {
    memset(t, 0, sizeof *t);
    FILE *f = fopen(path, "r");
    if (!f) return nb_set_error(NB_ERR_IO, "nb_scale: cannot open the step trace %s", path);
    char line[512];
    int ln = 0, cap = 0;
    bool magic = false, seen[3] = {false, false, false};
    nb_status st = NB_OK;
    while (st == NB_OK && fgets(line, sizeof line, f)) {
        ln++;
        line[strcspn(line, "\r\n")] = 0;
        if (!magic) {
            if (strcmp(line, TRACE_MAGIC)) {
                st = nb_set_error(NB_ERR_FORMAT, "nb_scale: %s:1: expected \"%s\", not a step trace", path,
                                  TRACE_MAGIC);
                break;
            }
            magic = true;
            continue;
        }
        char *s = line + strspn(line, " \t");
        if (!*s || *s == '#') continue;
        double v;
        char dt[16];
        nb__scale_param p = {0};
        if (!strncmp(s, "source ", 7)) {
            snprintf(t->source, sizeof t->source, "%s", s + 7);
        } else if (sscanf(s, "forward_s %lf", &v) == 1 && v >= 0 && isfinite(v)) {
            t->forward_s = v, seen[0] = true;
        } else if (sscanf(s, "backward_s %lf", &v) == 1 && v >= 0 && isfinite(v)) {
            t->backward_s = v, seen[1] = true;
        } else if (sscanf(s, "optimizer_s %lf", &v) == 1 && v >= 0 && isfinite(v)) {
            t->optimizer_s = v, seen[2] = true;
        } else if (sscanf(s, "param %95s %15s %lld %lf %lld", p.name, dt, (long long *)&p.numel, &p.ready_s,
                          (long long *)&p.rows) >= 4) {
            if (!parse_dtype(dt, &p.dtype) || p.numel <= 0 || !(p.ready_s >= 0 && isfinite(p.ready_s)) || p.rows < 0 ||
                (p.rows > 0 && p.numel % p.rows) ||
                (t->n && p.ready_s < t->p[t->n - 1].ready_s)) {
                st = nb_set_error(NB_ERR_FORMAT,
                                  "nb_scale: %s:%d: parameter %s: bad dtype \"%s\", numel %lld, ready time %g or "
                                  "rows %lld (times must not decrease; rows divide numel)",
                                  path, ln, p.name, dt, (long long)p.numel, p.ready_s, (long long)p.rows);
                break;
            }
            if (t->n == cap) {
                cap = cap ? 2 * cap : 64;
                nb__scale_param *q = realloc(t->p, (size_t)cap * sizeof *q);
                if (!q) {
                    st = nb_set_error(NB_ERR_NOMEM, "nb_scale: out of memory reading %s", path);
                    break;
                }
                t->p = q;
            }
            t->p[t->n++] = p;
        } else {
            st = nb_set_error(NB_ERR_FORMAT, "nb_scale: %s:%d: cannot read \"%s\" (Note [Step trace])", path, ln,
                              s);
        }
    }
    fclose(f);
    if (st == NB_OK && (!magic || !seen[0] || !seen[1] || !seen[2] || t->n == 0))
        st = nb_set_error(NB_ERR_FORMAT,
                          "nb_scale: %s lacks %s (a trace needs forward_s, backward_s, optimizer_s and params)",
                          path, !magic ? "the header" : t->n == 0 ? "parameters" : "a phase time");
    if (st != NB_OK) nb__scale_trace_free(t);
    return st;
}

nb_status nb__scale_trace_write(const char *path, const nb__scale_trace *t) {
    FILE *f = fopen(path, "w");
    if (!f) return nb_set_error(NB_ERR_IO, "nb_scale: cannot write the step trace %s", path);
    fprintf(f, "%s\n# format: docs/benchmarks.md (a step trace); ready_s counts from the start of backward\n",
            TRACE_MAGIC);
    fprintf(f, "source %s\nforward_s %.9g\nbackward_s %.9g\noptimizer_s %.9g\n", t->source, t->forward_s,
            t->backward_s, t->optimizer_s);
    for (int i = 0; i < t->n; i++)
        fprintf(f, "param %s %s %lld %.9g %lld\n", t->p[i].name, nb_dtype_name(t->p[i].dtype),
                (long long)t->p[i].numel, t->p[i].ready_s, (long long)t->p[i].rows);
    if (fclose(f) != 0) return nb_set_error(NB_ERR_IO, "nb_scale: writing %s failed", path);
    return NB_OK;
}

void nb__scale_trace_free(nb__scale_trace *t) {
    free(t->p);
    t->p = NULL;
    t->n = 0;
}

typedef struct ready_at {
    double t;
    int i;
} ready_at;
static int cmp_ready(const void *a, const void *b) {
    const ready_at *x = a, *y = b;
    return x->t < y->t ? -1 : x->t > y->t ? 1 : x->i - y->i;
}

void nb__scale_trace_make(nb__scale_trace *t, int n, const nb_named_tensor *p, const double *ready_s,
                          double forward_s, double backward_s, double optimizer_s, const char *source) {
    ready_at *o = malloc(sizeof *o * (size_t)(n ? n : 1));
    memset(t, 0, sizeof *t);
    t->p = calloc((size_t)(n ? n : 1), sizeof *t->p);
    NB_CHECK(o && t->p, "nb_scale: out of memory for a trace of %d parameters", n);
    for (int i = 0; i < n; i++) o[i] = (ready_at){ready_s[i], i};
    qsort(o, (size_t)n, sizeof *o, cmp_ready);
    t->n = n;
    t->forward_s = forward_s, t->backward_s = backward_s, t->optimizer_s = optimizer_s;
    snprintf(t->source, sizeof t->source, "%s", source);
    for (int k = 0; k < n; k++) {
        const nb_tensor *x = p[o[k].i].tensor;
        nb__scale_param *q = &t->p[k];
        snprintf(q->name, sizeof q->name, "%s", p[o[k].i].name);
        q->dtype = x->dtype, q->numel = nb_numel(x), q->ready_s = o[k].t;
        q->rows = x->ndim >= 2 ? x->shape[0] : 0;
    }
    free(o);
}

/* --------------------------------------------------------------- replay */

nb__scale_result nb__scale_replay_buckets(int nb, const double *cost, const double *second, const double *ready,
                                          double forward_s, double backward_s, double optimizer_s, double after_s,
                                          double *start, double *end) {
    nb__scale_result r = {0};
    double t = 0, stall = 0; /* the communication stream's clock; backward held up so far */
    int due = -1;            /* the bucket whose second collective the next launch starts */
    double due_p = 0;        /* when that bucket's first collective ends */
    for (int b = 0; b <= nb; b++) {
        double at = (b < nb ? ready[b] : backward_s) + stall; /* bucket b's launch, or the end of backward */
        if (due >= 0) { /* it waits for the due bucket's first collective, then starts its second */
            if (due_p > at && b < nb) stall += due_p - at, at = due_p;
            t = fmax(fmax(at, due_p), t) + second[due];
            r.comm_s += second[due];
            if (end) end[due] = t;
            due = -1;
        }
        if (b == nb) break;
        double s = fmax(at, t);
        t = s + cost[b];
        r.comm_s += cost[b];
        if (start) start[b] = s;
        if (end) end[b] = t;
        if (second && second[b] > 0) due = b, due_p = t;
    }
    r.comm_s += after_s;
    r.compute_s = forward_s + backward_s + optimizer_s;
    r.step_s = forward_s + fmax(backward_s + stall, t) + optimizer_s + after_s;
    r.exposed_s = r.step_s - r.compute_s;
    r.n_buckets = nb;
    return r;
}

nb__scale_result nb__scale_replay(const nb__scale_trace *t, const nb__scale_config *c) {
    int n = t->n, world = c->nodes * c->per_node;
    int *order = malloc(sizeof(int) * (size_t)n), *starts = malloc(sizeof(int) * (size_t)(n + 1));
    int64_t *numel = malloc(sizeof(int64_t) * (size_t)n);
    nb_dtype *dtype = malloc(sizeof(nb_dtype) * (size_t)n);
    double *cost = malloc(sizeof(double) * (size_t)n), *ready = malloc(sizeof(double) * (size_t)n),
           *second = calloc((size_t)n, sizeof(double));
    NB_CHECK(order && starts && numel && dtype && cost && ready && second, "nb_scale: out of memory for %d parameters",
             n);
    double param_bytes = 0;
    for (int i = 0; i < n; i++) {
        order[i] = i, numel[i] = t->p[i].numel, dtype[i] = t->p[i].dtype;
        param_bytes += (double)numel[i] * (double)nb_dtype_size(dtype[i]);
    }
    int nb = nb__ddp_partition(n, order, numel, dtype, c->first_bucket, c->bucket_cap, starts);
    nb__scale_coll coll = c->mode == NB__SCALE_ZERO1 ? NB__SCALE_REDUCE_SCATTER : NB__SCALE_ALL_REDUCE;
    for (int b = 0; b < nb; b++) {
        nb_dtype dt = dtype[starts[b]];
        double bytes = 0;
        for (int i = starts[b]; i < starts[b + 1]; i++) bytes += (double)numel[i] * (double)nb_dtype_size(dt);
        if (c->bf16_wire && dt == NB_F32) bytes /= 2;
        double pq[2] = {0, 0}; /* PowerSGD: elements of its first all-reduce (uncompressed and Ps) and second (Qs) */
        for (int i = starts[b]; c->powersgd_rank > 0 && i < starts[b + 1]; i++) {
            int64_t rows = t->p[i].rows, cols = rows > 0 ? numel[i] / rows : 0, k = c->powersgd_rank;
            if (k > rows) k = rows;
            if (k > cols) k = cols;
            if (rows > 0 && k > 0 &&
                (double)(rows + cols) * (double)k * c->powersgd_min_rate < (double)rows * (double)cols)
                pq[0] += (double)(rows * k), pq[1] += (double)(cols * k);
            else
                pq[0] += (double)numel[i];
        }
        if (c->powersgd_rank > 0 && pq[1] > 0) {
            double es = (double)nb_dtype_size(dt);
            cost[b] = nb__scale_collective(coll, c->algo, c->nodes, c->per_node, pq[0] * es, &c->intra, &c->inter);
            second[b] = nb__scale_collective(coll, c->algo, c->nodes, c->per_node, pq[1] * es, &c->intra, &c->inter);
        } else {
            cost[b] = nb__scale_collective(coll, c->algo, c->nodes, c->per_node, bytes, &c->intra, &c->inter);
        }
        ready[b] = t->p[starts[b + 1] - 1].ready_s;
    }
    double opt = t->optimizer_s, after = 0;
    if (c->mode == NB__SCALE_ZERO1) {
        opt /= world;
        after = nb__scale_collective(NB__SCALE_ALL_GATHER, c->algo, c->nodes, c->per_node, param_bytes, &c->intra,
                                     &c->inter);
    }
    nb__scale_result r =
        nb__scale_replay_buckets(nb, cost, second, ready, t->forward_s, t->backward_s, opt, after, NULL, NULL);
    r.efficiency = (t->forward_s + t->backward_s + t->optimizer_s) / r.step_s;
    free(order), free(starts), free(numel), free(dtype), free(cost), free(ready), free(second);
    return r;
}

/* ------------------------------------------------------------- the report */

nb_status nb__scale_link_parse(const char *spec, nb__scale_link *out) {
    double us, gbs;
    char tail;
    if (nb__scale_preset(spec, out)) return NB_OK;
    if (!strncmp(spec, "measured:", 9)) return nb__scale_fit(spec + 9, out);
    if (sscanf(spec, "%lf,%lf%c", &us, &gbs, &tail) == 2 && us >= 0 && gbs > 0) {
        *out = (nb__scale_link){"custom", us * 1e-6, gbs * 1e9, "given on the command line"};
        return NB_OK;
    }
    return nb_set_error(NB_ERR_INVALID,
                        "nb_scale: link \"%s\" is neither a preset, measured:FILE nor ALPHA_US,GB/S", spec);
}

/* The world sizes of the table: 1, 2, 4, ... devices in one node, then
 * 2, 4, ... full nodes, up to max_world. */
static int worlds(int per_node, int max_world, int *nodes, int *devs) {
    int k = 0;
    for (int g = 1; g < per_node && g <= max_world; g *= 2) nodes[k] = 1, devs[k++] = g;
    for (int n = 1; n * per_node <= max_world && k < 64; n *= 2) nodes[k] = n, devs[k++] = per_node;
    return k;
}

static const double bucket_mib[] = {0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128, 256};

double nb__scale_suggest(const nb__scale_trace *t, const nb__scale_config *c, double *best_step) {
    double best = -1, best_s = INFINITY;
    for (size_t i = 0; i < sizeof bucket_mib / sizeof bucket_mib[0]; i++) {
        nb__scale_config k = *c;
        k.first_bucket = k.bucket_cap = (size_t)(bucket_mib[i] * 1048576.0);
        double s = nb__scale_replay(t, &k).step_s;
        if (s < best_s * (1 - 1e-9)) best_s = s, best = bucket_mib[i];
    }
    if (best_step) *best_step = best_s;
    return best;
}

void nb__scale_report(FILE *f, const nb__scale_trace *t, const nb__scale_config *c, int max_world) {
    double bytes = 0;
    for (int i = 0; i < t->n; i++) bytes += (double)t->p[i].numel * (double)nb_dtype_size(t->p[i].dtype);
    fprintf(f, "PROJECTION (a model, not a measurement) from the step trace of \"%s\"\n", t->source);
    fprintf(f, "  one rank's step: forward %.3f ms, backward %.3f ms, optimizer %.3f ms; %d parameters, %.2f MiB\n",
            1e3 * t->forward_s, 1e3 * t->backward_s, 1e3 * t->optimizer_s, t->n, bytes / 1048576.0);
    fprintf(f, "  inside a node: %s (alpha %.1f us, %.4g GB/s; %s)\n", c->intra.name, 1e6 * c->intra.alpha_s,
            c->intra.bw / 1e9, c->intra.source);
    fprintf(f, "  between nodes: %s (alpha %.1f us, %.4g GB/s; %s)\n", c->inter.name, 1e6 * c->inter.alpha_s,
            c->inter.bw / 1e9, c->inter.source);
    char psgd[64] = "";
    if (c->powersgd_rank > 0)
        snprintf(psgd, sizeof psgd, ", PowerSGD rank %d (min rate %g)", c->powersgd_rank, c->powersgd_min_rate);
    fprintf(f, "  %s, %s all-reduce%s%s, buckets: first %.2f MiB then %.2f MiB, %d devices per node\n",
            c->mode == NB__SCALE_ZERO1 ? "ZeRO-1" : "DDP",
            c->algo == NB__SCALE_RING ? "ring" : c->algo == NB__SCALE_TREE ? "tree" : "ring or tree (cheaper)",
            c->bf16_wire ? ", bf16 wire" : "", psgd, c->first_bucket / 1048576.0, c->bucket_cap / 1048576.0,
            c->per_node);
    fprintf(f, "%6s %12s %8s %10s %10s %11s %11s %12s\n", "world", "nodes x dev", "buckets", "step ms", "comm ms",
            "exposed ms", "efficiency", "best bucket");
    int nodes[64], devs[64], k = worlds(c->per_node, max_world, nodes, devs);
    for (int i = 0; i < k; i++) {
        nb__scale_config w = *c;
        w.nodes = nodes[i], w.per_node = devs[i];
        nb__scale_result r = nb__scale_replay(t, &w);
        char nd[24], bb[24] = "-";
        snprintf(nd, sizeof nd, "%d x %d", nodes[i], devs[i]);
        if (nodes[i] * devs[i] > 1) snprintf(bb, sizeof bb, "%g MiB", nb__scale_suggest(t, &w, NULL));
        fprintf(f, "%6d %12s %8d %10.3f %10.3f %11.3f %10.1f%% %12s\n", nodes[i] * devs[i], nd, r.n_buckets,
                1e3 * r.step_s, 1e3 * r.comm_s, 1e3 * r.exposed_s, 100 * r.efficiency, bb);
    }
}
