/* File-system helpers shared by the training programs. */
#ifndef NABLA_EXAMPLES_FILES_H
#define NABLA_EXAMPLES_FILES_H

#include <nabla/nabla.h>

/* mkdir -p; NB_ERR_IO naming the directory that could not be made. */
nb_status files_make_dirs(const char *path);
/* mkdir -p of the directory part of a file path. */
nb_status files_make_parent_dirs(const char *file);

#endif
