/* Reading a whole file, with a message naming it on failure. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/internal.h"

nb_status nb__read_file(const char *path, char **data, size_t *size) {
    *data = NULL;
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return nb_set_error(NB_ERR_IO, "cannot open \"%s\": %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        fclose(f);
        return nb_set_error(NB_ERR_NOMEM, "reading \"%s\": out of memory", path);
    }
    for (;;) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *bigger = realloc(buf, 2 * cap + 1);
        if (!bigger) {
            free(buf);
            fclose(f);
            return nb_set_error(NB_ERR_NOMEM, "reading \"%s\": out of memory after %zu bytes",
                                path, n);
        }
        buf = bigger;
        cap *= 2;
    }
    int err = ferror(f) ? errno : 0;
    fclose(f);
    if (err) {
        free(buf);
        return nb_set_error(NB_ERR_IO, "reading \"%s\": %s (after %zu bytes)", path,
                            strerror(err), n);
    }
    buf[n] = 0;
    *data = buf;
    *size = n;
    return NB_OK;
}
