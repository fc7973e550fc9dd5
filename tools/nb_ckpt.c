/* nb_ckpt: looks at checkpoints and turns a sharded one into a single file.
 *
 *   nb_ckpt check CKPT              every tensor read (a sharded checkpoint's
 *                                   index with all its shards); a summary
 *   nb_ckpt consolidate INDEX OUT   the single-file checkpoint of a sharded
 *                                   one (nb_checkpoint_consolidate)
 *
 * Exit status 0; 1 when the checkpoint is damaged or cannot be written
 * (the message names the file at fault); 2 on bad usage. */
#include <stdio.h>
#include <string.h>

#include <nabla/nabla.h>

static int usage(void) {
    fprintf(stderr, "usage: nb_ckpt check CKPT\n"
                    "       nb_ckpt consolidate INDEX OUT\n");
    return 2;
}

static int failed(void) {
    fprintf(stderr, "nb_ckpt: %s\n", nb_last_error());
    return 1;
}

static int check(const char *path) {
    nb_checkpoint *ck;
    if (nb_checkpoint_open(path, &ck) != NB_OK) return failed();
    nb_checkpoint_sharded *sh = NULL;
    if (nb_checkpoint_is_sharded(ck) && nb_checkpoint_sharded_open(path, &sh) != NB_OK) {
        nb_checkpoint_close(ck);
        return failed();
    }
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    int n = sh ? nb_checkpoint_sharded_count(sh) : nb_checkpoint_count(ck);
    unsigned long long bytes = 0;
    nb_status st = NB_OK;
    for (int i = 0; i < n && st == NB_OK; i++) {
        const nb_checkpoint_entry *e = sh ? nb_checkpoint_sharded_entry_at(sh, i) : nb_checkpoint_entry_at(ck, i);
        nb_tensor *t = nb_empty(ctx, e->dtype, e->ndim, e->shape);
        st = sh ? nb_checkpoint_sharded_read(sh, e->name, t) : nb_checkpoint_read(ck, e->name, t);
        bytes += e->nbytes;
        nb_ctx_reset(ctx);
    }
    nb_ctx_free(ctx);
    const char *step = nb_checkpoint_meta(ck, "step");
    if (st == NB_OK) {
        if (sh)
            printf("%s: sharded over %d files in %s, %d tensors, %llu bytes, step %s: every tensor reads\n", path,
                   nb_checkpoint_sharded_shards(sh), nb_checkpoint_meta(ck, "shard_dir"), n, bytes, step ? step : "-");
        else
            printf("%s: one file, %d tensors, %llu bytes, step %s: every tensor reads\n", path, n, bytes,
                   step ? step : "-");
    }
    nb_checkpoint_sharded_close(sh);
    nb_checkpoint_close(ck);
    return st == NB_OK ? 0 : failed();
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "check") == 0) return check(argv[2]);
    if (argc == 4 && strcmp(argv[1], "consolidate") == 0) {
        if (nb_checkpoint_consolidate(argv[2], argv[3]) != NB_OK) return failed();
        printf("%s: written from the sharded checkpoint %s\n", argv[3], argv[2]);
        return 0;
    }
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage();
        return 0;
    }
    return usage();
}
