/* Resuming the training programs (resume.h). */
#include "resume.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

nb_status resume_check_meta(nb_checkpoint *ck, const char *path, const nb_kv *kv, int n) {
    for (int i = 0; i < n; i++) {
        const char *have = nb_checkpoint_meta(ck, kv[i].key);
        if (!have || strcmp(have, kv[i].value))
            return nb_set_error(NB_ERR_MISMATCH, "%s was written with %s %s, this run has %s (resume "
                                "with the same settings)", path, kv[i].key, have ? have : "(none)",
                                kv[i].value);
    }
    return NB_OK;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* The "step" of a well-formed checkpoint of `program` at `path`; false for
 * anything else (a damaged file is named on stderr). */
static bool checkpoint_step(const char *path, const char *program, long long *step) {
    nb_checkpoint *ck;
    if (nb_checkpoint_open(path, &ck) != NB_OK) {
        fprintf(stderr, "%s: --resume auto passes over %s: %s\n", program, path, nb_last_error());
        return false;
    }
    const char *prog = nb_checkpoint_meta(ck, "program"), *s = nb_checkpoint_meta(ck, "step");
    char *end = NULL;
    bool ok = prog && s && strcmp(prog, program) == 0;
    if (ok) {
        *step = strtoll(s, &end, 10);
        ok = end != s && *end == 0 && *step >= 0;
    }
    nb_checkpoint_close(ck);
    return ok;
}

static nb_status find_latest(const char *dir, const char *program, char *path, size_t cap, bool *found,
                             int64_t *best) {
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return NB_OK; /* no directory yet: nothing to resume */
        return nb_set_error(NB_ERR_IO, "--resume auto: cannot read directory \"%s\": %s", dir, strerror(errno));
    }
    long long best_step = -1;
    struct timespec best_time = {0, 0};
    struct dirent *e;
    char candidate[4096];
    while ((e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".safetensors")) continue; /* temporary files end in .tmp.<host>.<pid>.<n> */
        if (snprintf(candidate, sizeof candidate, "%s/%s", dir, e->d_name) >= (int)sizeof candidate) continue;
        struct stat st;
        if (stat(candidate, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        long long step;
        if (!checkpoint_step(candidate, program, &step)) continue;
        bool newer = st.st_mtim.tv_sec > best_time.tv_sec ||
                     (st.st_mtim.tv_sec == best_time.tv_sec && st.st_mtim.tv_nsec > best_time.tv_nsec);
        if (step > best_step || (step == best_step && newer)) {
            best_step = step;
            best_time = st.st_mtim;
            snprintf(path, cap, "%s", candidate);
            *found = true;
            *best = step;
        }
    }
    closedir(d);
    return NB_OK;
}

/* Every rank chose the same step: sum(x^2) * R == sum(x)^2 only when all x are equal. */
static nb_status check_agreed(run_dist *d, int64_t step) {
    double v[2] = {(double)step, (double)step * (double)step};
    nb_status s = run_dist_sum(d, v, 2);
    if (s != NB_OK) return s;
    if (v[1] * (double)d->world_size != v[0] * v[0])
        return nb_set_error(NB_ERR_MISMATCH, "--resume auto: the ranks found different checkpoints (this "
                            "rank's has step %lld, the mean over the ranks is %g): is the checkpoint "
                            "directory the same on every node?", (long long)step, v[0] / d->world_size);
    return NB_OK;
}

nb_status resume_find(run_dist *d, const char *dir, const char *mode, const char *program, char *path,
                      size_t cap, bool *found, int64_t *step) {
    *found = false;
    *step = -1;
    if (strcmp(mode, "") == 0) {
        snprintf(path, cap, "%s/ckpt.safetensors", dir);
        *found = true;
        return NB_OK;
    }
    if (strcmp(mode, "auto") != 0)
        return nb_set_error(NB_ERR_INVALID, "--resume takes no value or \"auto\", not \"%s\"", mode);
    nb_status s = find_latest(dir, program, path, cap, found, step);
    return s == NB_OK ? check_agreed(d, *step) : s;
}
