/* Resuming the training programs: a checkpoint records the settings that
 * must not change across a resume (model shape, world size, batch size,
 * seed) as metadata, and the resuming run checks them before loading.
 *
 * --resume alone continues from DIR/ckpt.safetensors, which must exist;
 * --resume auto takes the newest checkpoint of the program in DIR that
 * loads and starts afresh when there is none, so that the same command
 * line serves the first start and every restart (nbrun --max-restarts);
 * when checkpoints are there but none loads it refuses to start, unless
 * --resume auto-or-fresh. Note [Kept checkpoints] in resume.c. */
#ifndef NABLA_EXAMPLES_RESUME_H
#define NABLA_EXAMPLES_RESUME_H

#include <stdbool.h>
#include <stddef.h>

#include <nabla/nabla.h>

#include "dist.h"

/* NB_ERR_MISMATCH naming the first setting kv[i] that the open checkpoint
 * `ck` (read from `path`) lacks or records with another value. */
nb_status resume_check_meta(nb_checkpoint *ck, const char *path, const nb_kv *kv, int n);

/* The checkpoint --resume[=mode] names: mode "" is `dir`/ckpt.safetensors,
 * "auto" the newest checkpoint of `program` in `dir` that loads (the
 * largest "step", then the latest modified, among the regular files named
 * *.safetensors with "program" = program in their metadata whose every
 * tensor reads, NaN and infinity refused; the index of a sharded
 * checkpoint with every shard it names, as one unit: a temporary file of a
 * save in progress, <name>.safetensors.tmp.<host>.<pid>.<n>, is never taken; each
 * newer or damaged file passed over is said on stderr with its fault).
 * When *.safetensors files are there and none can be resumed from, "auto"
 * fails with NB_ERR_FORMAT naming each file and its fault, and
 * "auto-or-fresh" starts afresh. *found is false when there is none
 * (start afresh); *step is the chosen file's step with "auto"
 * (-1 when none), else -1. With "auto", every rank must choose the same
 * step (checked with a sum over the ranks of `d`: NB_ERR_MISMATCH, since
 * the ranks would resume from different states). NB_ERR_INVALID for
 * another mode, NB_ERR_IO when `dir` exists but cannot be read. */

/* After rank 0 has written the index of a sharded checkpoint in `dir`:
 * removes the shards folders no index in `dir` names (Note [Kept sharded
 * checkpoints] in resume.c). */
void resume_prune_shards(const char *dir);

/* Saves a sharded checkpoint of a ZeRO run (d->ddp with ZeRO-1 or 2 on,
 * or d->fsdp), the index at index_path in `dir` (Note [Sharded save] in
 * resume.c). Collective: every rank calls it with the same arguments. model, opt, st and extra as for
 * nb_checkpoint_save_training; ctx takes the pieces' views. NB_ERR_FORMAT
 * when some piece is not finite, NB_ERR_IO when some rank could not write
 * its shard: no index is written then, and the previous checkpoint stands. */
nb_status resume_save_sharded(run_dist *d, const char *dir, const char *index_path,
                              const char *program, int keep, nb_ctx *ctx, const nb_named_tensor *model,
                              int n_model, nb_optim *opt, const nb_train_state *st, const nb_kv *extra,
                              int n_extra);

nb_status resume_find(run_dist *d, const char *dir, const char *mode, const char *program, char *path,
                      size_t cap, bool *found, int64_t *step);

#endif
