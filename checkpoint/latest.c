/* Note [Resume auto]: the rule by which a training program continues
 * after a failure (--resume auto in train_gpt, train_classifier and the
 * tutorials), so that the same command line serves the first start and
 * every restart, and a damaged checkpoint never silently starts a run
 * over: the newest checkpoint of the program that loads is taken, each
 * newer or damaged file passed over is said with its fault, and when
 * files are there but none loads the program refuses to start, naming
 * each, unless it was told that a fresh start is fine (auto-or-fresh).
 * "Newest" is the largest "step" of the metadata, then the latest
 * modified; "loads" means the header is valid, "program" is this
 * program's, and every tensor reads (NaN and infinity refused), with all
 * its shards for the index of a sharded checkpoint. A save in
 * progress (<name>.safetensors.tmp.<host>.<pid>.<n>) is never a
 * candidate, and another program's checkpoint is none of ours. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/safetensors.h"
#include "tensor/internal.h"

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* A candidate of --resume auto: a regular *.safetensors file of DIR. */
typedef struct candidate {
    char path[4096];
    long long step;   /* -1: not known (it did not open) */
    struct timespec mtime;
    bool ours;        /* opened, and of this program */
    char fault[600];  /* why it cannot be resumed from ("": none found yet) */
} candidate;

/* Opens c: its "step" when it is a well-formed checkpoint of `program`. */
static void candidate_open(candidate *c, const char *program) {
    nb_checkpoint *ck;
    c->step = -1;
    if (nb_checkpoint_open(c->path, &ck) != NB_OK) {
        snprintf(c->fault, sizeof c->fault, "%s", nb_last_error());
        return;
    }
    const char *prog = nb_checkpoint_meta(ck, "program"), *s = nb_checkpoint_meta(ck, "step");
    char *end = NULL;
    if (prog && s && strcmp(prog, program) == 0) {
        c->step = strtoll(s, &end, 10);
        c->ours = end != s && *end == 0 && c->step >= 0;
        if (!c->ours) snprintf(c->fault, sizeof c->fault, "its step \"%s\" is not a count", s);
    }
    nb_checkpoint_close(ck);
}

/* Reads every tensor of c (the loader refuses NaN and infinite values with
 * the tensor and element named), so that a file chosen will load. The
 * index of a sharded checkpoint is checked with all its shards, as one
 * unit: a shard missing, cut short or of another save is c's fault, named. */
static bool candidate_check(candidate *c) {
    nb_checkpoint *ck;
    nb_checkpoint_sharded *sh = NULL;
    if (nb_checkpoint_open(c->path, &ck) != NB_OK) {
        snprintf(c->fault, sizeof c->fault, "%s", nb_last_error());
        return false;
    }
    if (nb_checkpoint_is_sharded(ck) && nb_checkpoint_sharded_open(c->path, &sh) != NB_OK) {
        snprintf(c->fault, sizeof c->fault, "%s", nb_last_error());
        nb_checkpoint_close(ck);
        return false;
    }
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    bool ok = true;
    int n = sh ? nb_checkpoint_sharded_count(sh) : nb_checkpoint_count(ck);
    for (int i = 0; i < n && ok; i++) {
        const nb_checkpoint_entry *e = sh ? nb_checkpoint_sharded_entry_at(sh, i) : nb_checkpoint_entry_at(ck, i);
        nb_tensor *t = nb_empty(ctx, e->dtype, e->ndim, e->shape);
        if ((sh ? nb_checkpoint_sharded_read(sh, e->name, t) : nb_checkpoint_read(ck, e->name, t)) != NB_OK) {
            snprintf(c->fault, sizeof c->fault, "%s", nb_last_error());
            ok = false;
        }
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
    nb_checkpoint_sharded_close(sh);
    nb_checkpoint_close(ck);
    return ok;
}

static bool newer(const candidate *a, const candidate *b) {
    if (a->step != b->step) return a->step > b->step;
    if (a->mtime.tv_sec != b->mtime.tv_sec) return a->mtime.tv_sec > b->mtime.tv_sec;
    return a->mtime.tv_nsec > b->mtime.tv_nsec;
}

nb_status nb_checkpoint_find_latest(const char *dir, const char *program, bool fresh_ok, char *path,
                                    size_t cap, bool *found, int64_t *best) {
    NB_CHECK(dir && program && path && found && best, "nb_checkpoint_find_latest: NULL argument");
    *found = false;
    *best = -1;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return NB_OK; /* no directory yet: nothing to resume */
        return nb_set_error(NB_ERR_IO, "--resume auto: cannot read directory \"%s\": %s", dir, strerror(errno));
    }
    candidate *cs = NULL;
    int n = 0, room = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".safetensors")) continue; /* temporary files end in .tmp.<host>.<pid>.<n> */
        if (n == room) {
            room = room ? 2 * room : 8;
            candidate *p = realloc(cs, (size_t)room * sizeof *p);
            NB_CHECK(p != NULL, "--resume auto: out of memory");
            cs = p;
        }
        candidate *c = &cs[n];
        memset(c, 0, sizeof *c);
        if (snprintf(c->path, sizeof c->path, "%s/%s", dir, e->d_name) >= (int)sizeof c->path) continue;
        struct stat st;
        if (stat(c->path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        c->mtime = st.st_mtim;
        candidate_open(c, program);
        if (c->ours || c->fault[0]) n++; /* another program's checkpoint is none of ours */
    }
    closedir(d);
    for (int i = 1; i < n; i++) /* newest first; files that did not open last */
        for (int j = i; j > 0 && newer(&cs[j], &cs[j - 1]); j--) {
            candidate t = cs[j];
            cs[j] = cs[j - 1];
            cs[j - 1] = t;
        }
    int chosen = -1;
    for (int i = 0; i < n && chosen < 0; i++)
        if (cs[i].ours && candidate_check(&cs[i])) chosen = i;
    for (int i = 0; i < n; i++)
        if (cs[i].fault[0] && (chosen < 0 || cs[i].step >= cs[chosen].step || !cs[i].ours))
            fprintf(stderr, "%s: --resume auto passes over %s: %s\n", program, cs[i].path, cs[i].fault);
    nb_status s = NB_OK;
    if (chosen >= 0) {
        snprintf(path, cap, "%s", cs[chosen].path);
        *found = true;
        *best = cs[chosen].step;
    } else if (n > 0 && !fresh_ok) {
        char list[3000] = "";
        for (int i = 0; i < n; i++) {
            size_t u = strlen(list);
            snprintf(list + u, sizeof list - u, "%s%s (%s)", i ? "; " : "", cs[i].path, cs[i].fault);
        }
        s = nb_set_error(NB_ERR_FORMAT,
                         "--resume auto: %d checkpoint file%s in %s, and none can be resumed from: %s; not "
                         "starting afresh over them (--resume auto-or-fresh would)",
                         n, n == 1 ? "" : "s", dir, list);
    }
    free(cs);
    return s;
}

/* Note [Kept checkpoints]
 * A training program writes DIR/ckpt.safetensors (atomically: a temporary
 * file, fsync, rename). Before each save, rank 0 keeps the one it replaces
 * under DIR/ckpt.step<N>.safetensors (a hard link, so the file stays
 * whole and the name ckpt.safetensors is never missing), and removes the
 * oldest of those beyond keep - 1, so the folder holds the newest `keep`
 * (--keep-checkpoints in the bundled programs, default 3; the tutorials
 * keep 3). --resume auto then has an older one to fall back to when the
 * newest is damaged (truncated, corrupt, NaN). */
nb_status nb_checkpoint_keep(const char *dir, const char *program, int keep) {
    char cur[4096], old[4200];
    if (keep < 2 || snprintf(cur, sizeof cur, "%s/ckpt.safetensors", dir) >= (int)sizeof cur) return NB_OK;
    nb_checkpoint *ck;
    if (access(cur, F_OK) != 0 || nb_checkpoint_open(cur, &ck) != NB_OK) {
        nb_set_error(NB_OK, "%s", "");
        return NB_OK; /* none, or damaged: nothing worth keeping */
    }
    const char *prog = nb_checkpoint_meta(ck, "program"), *st = nb_checkpoint_meta(ck, "step");
    long long step = st ? strtoll(st, NULL, 10) : -1;
    bool ours = prog && strcmp(prog, program) == 0 && step >= 0;
    nb_checkpoint_close(ck);
    if (!ours) return NB_OK;
    snprintf(old, sizeof old, "%s/ckpt.step%09lld.safetensors", dir, step);
    if (access(old, F_OK) != 0 && link(cur, old) != 0)
        return nb_set_error(NB_ERR_IO, "nb_checkpoint_keep: cannot keep %s as %s: %s", cur, old, strerror(errno));
    /* the kept ones, oldest first: names sort by step */
    DIR *d = opendir(dir);
    if (!d) return nb_set_error(NB_ERR_IO, "nb_checkpoint_keep: cannot read \"%s\": %s", dir, strerror(errno));
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "ckpt.step", 9) != 0 || !ends_with(e->d_name, ".safetensors")) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            char **p = realloc(names, (size_t)cap * sizeof *p);
            if (!p) break;
            names = p;
        }
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    for (int i = 1; i < n; i++) /* insertion sort: a handful of names */
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    for (int i = 0; i < n; i++) {
        if (i < n - (keep - 1)) {
            snprintf(old, sizeof old, "%s/%s", dir, names[i]);
            unlink(old);
        }
        free(names[i]);
    }
    free(names);
    return NB_OK;
}
