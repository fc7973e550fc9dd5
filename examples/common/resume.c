/* Resuming the training programs (resume.h). */
#include "resume.h"

#include <string.h>

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
