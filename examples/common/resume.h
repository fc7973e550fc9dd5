/* Resuming the training programs: a checkpoint records the settings that
 * must not change across a resume (model shape, world size, batch size,
 * seed) as metadata, and the resuming run checks them before loading. */
#ifndef NABLA_EXAMPLES_RESUME_H
#define NABLA_EXAMPLES_RESUME_H

#include <nabla/nabla.h>

/* NB_ERR_MISMATCH naming the first setting kv[i] that the open checkpoint
 * `ck` (read from `path`) lacks or records with another value. */
nb_status resume_check_meta(nb_checkpoint *ck, const char *path, const nb_kv *kv, int n);

#endif
