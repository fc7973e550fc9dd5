/* File-system helpers shared by the training programs (files.h). */
#include "files.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

nb_status files_make_dirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(buf, 0777) != 0 && errno != EEXIST)
                return nb_set_error(NB_ERR_IO, "cannot create directory \"%s\": %s", buf, strerror(errno));
            *p = c;
            if (!c) break;
        }
    }
    return NB_OK;
}

nb_status files_make_parent_dirs(const char *file) {
    const char *slash = strrchr(file, '/');
    if (!slash || slash == file) return NB_OK;
    char dir[4096];
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - file), file);
    return files_make_dirs(dir);
}
