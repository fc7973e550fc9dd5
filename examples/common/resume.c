/* Resuming the training programs (resume.h). */
#include "resume.h"
#include "divergence.h"
#include "files.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

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

/* Removes the folder `path` and the files in it (a shards folder holds
 * files only). */
static void remove_folder(const char *path) {
    DIR *d = opendir(path);
    if (!d) return;
    char p[8800];
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(path);
}

/* Note [Kept sharded checkpoints]
 * The index of a sharded checkpoint is kept and replaced like a single
 * file (its hard link ckpt.step<N>.safetensors, Note [Kept checkpoints]);
 * its shards live in the folder it names ("shard_dir", <save id>.shards,
 * one per save). After rank 0 has written an index, every *.shards folder
 * of DIR that no index of DIR names goes: those of the checkpoints
 * dropped beyond --keep-checkpoints, and those of saves that never got
 * their index (a crash between the shards and the index). A folder named
 * by an index stays, even when that index is damaged. */
void resume_prune_shards(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char **used = NULL, **folders = NULL;
    int n_used = 0, n_folders = 0;
    char path[4400];
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (ends_with(e->d_name, ".shards")) {
            char **p = realloc(folders, (size_t)(n_folders + 1) * sizeof *p);
            if (!p) break;
            folders = p;
            folders[n_folders++] = strdup(e->d_name);
            continue;
        }
        nb_checkpoint *ck;
        if (!ends_with(e->d_name, ".safetensors") || nb_checkpoint_open(path, &ck) != NB_OK) continue;
        const char *sd = nb_checkpoint_meta(ck, "shard_dir");
        char **p = sd ? realloc(used, (size_t)(n_used + 1) * sizeof *p) : NULL;
        if (p) {
            used = p;
            used[n_used++] = strdup(sd);
        }
        nb_checkpoint_close(ck);
    }
    closedir(d);
    nb_set_error(NB_OK, "%s", ""); /* the files that did not open are none of this */
    for (int i = 0; i < n_folders; i++) {
        bool keep = folders[i] == NULL;
        for (int j = 0; j < n_used && !keep; j++) keep = used[j] && strcmp(used[j], folders[i]) == 0;
        if (!keep) {
            snprintf(path, sizeof path, "%s/%s", dir, folders[i]);
            remove_folder(path);
        }
        free(folders[i]);
    }
    for (int j = 0; j < n_used; j++) free(used[j]);
    free(folders);
    free(used);
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
    bool fresh_ok = strcmp(mode, "auto-or-fresh") == 0;
    if (strcmp(mode, "auto") != 0 && !fresh_ok)
        return nb_set_error(NB_ERR_INVALID, "--resume takes no value, \"auto\" or \"auto-or-fresh\", not \"%s\"",
                            mode);
    nb_status s = nb_checkpoint_find_latest(dir, program, fresh_ok, path, cap, found, step);
    return s == NB_OK ? check_agreed(d, *step) : s;
}

/* Note [Sharded save]
 * Every rank: its pieces (nb_ddp_zero_checkpoint_pieces under ZeRO-1 and
 * 2, nb_fsdp_checkpoint_pieces under ZeRO-3), checked finite
 * (Note [Divergence] in divergence.c: never a diverged state over a good
 * checkpoint), written to its shard; the ranks then agree that all shards
 * were written (a sum of failures), and only then rank 0 keeps the
 * previous checkpoint, writes the index and prunes the shards no index
 * names. The save id is the step and a number rank 0 draws, agreed through
 * the same sum (ids differ per save, so a save writes no file a standing
 * index names, Note [Sharded checkpoint] in checkpoint/sharded.c). */
nb_status resume_save_sharded(run_dist *d, const char *dir, const char *index_path,
                              const char *program, int keep, nb_ctx *ctx, const nb_named_tensor *model,
                              int n_model, nb_optim *opt, const nb_train_state *st, const nb_kv *extra,
                              int n_extra) {
    char what[96];
    snprintf(what, sizeof what, "step %lld not saved", (long long)st->step);
    double v[2] = {0, 0};
    if (d->rank == 0) {
        struct timeval tv;
        gettimeofday(&tv, NULL);
        uint64_t x = ((uint64_t)tv.tv_sec * 1000003u) ^ ((uint64_t)tv.tv_usec << 20) ^ (uint64_t)getpid();
        v[0] = (double)(x & ((1ull << 40) - 1)); /* exact in a double */
    }
    nb_status s = run_dist_sum(d, v, 1);
    if (s != NB_OK) return s;
    char id[96];
    snprintf(id, sizeof id, "ckpt.step%09lld-%010llx", (long long)st->step, (unsigned long long)v[0]);
    nb_checkpoint_piece *pc = NULL;
    int n = 0;
    nb_status mine = d->fsdp ? nb_fsdp_checkpoint_pieces(d->fsdp, model, n_model, ctx, &pc, &n)
                             : nb_ddp_zero_checkpoint_pieces(d->ddp, model, n_model, ctx, &pc, &n);
    if (mine == NB_OK) {
        nb_named_tensor *named = malloc(sizeof *named * (size_t)(n ? n : 1));
        NB_CHECK(named, "%s: out of memory", program);
        for (int i = 0; i < n; i++) named[i] = (nb_named_tensor){pc[i].name, pc[i].data};
        mine = divergence_check_finite(ctx, named, n, what);
        free(named);
    }
    if (mine == NB_OK) mine = files_make_dirs(dir);
    if (mine == NB_OK) mine = nb_checkpoint_save_shard(index_path, id, d->rank, d->world_size, pc, n);
    free(pc);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", nb_last_error());
    v[0] = mine != NB_OK;
    v[1] = mine != NB_OK ? d->rank : 0;
    s = run_dist_sum(d, v, 2);
    if (s != NB_OK) return s;
    if (mine != NB_OK) return nb_set_error(mine, "%s (no index written: the previous checkpoint stands)", msg);
    if (v[0] == 1)
        return nb_set_error(NB_ERR_IO, "rank %d could not write its shard of step %lld (its message says why), so "
                            "no index was written: the previous checkpoint stands", (int)v[1], (long long)st->step);
    if (v[0] > 1)
        return nb_set_error(NB_ERR_IO, "%d ranks could not write their shards of step %lld (their messages say "
                            "why), so no index was written: the previous checkpoint stands", (int)v[0],
                            (long long)st->step);
    if (d->rank != 0) return NB_OK;
    s = nb_checkpoint_keep(dir, program, keep);
    if (s == NB_OK) s = nb_checkpoint_save_training_index(index_path, id, d->world_size, opt, st, extra, n_extra);
    if (s == NB_OK) resume_prune_shards(dir);
    return s;
}
