/* DDP's checks and broadcasts at construction and before forward: every
 * rank's parameter list compared with rank 0's (the verdict agreed, so
 * that every rank fails together naming the first difference), and rank
 * 0's parameters and buffers broadcast to the others. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/ddp_reducer.h"

/* "name dtype (shape)" lines, one per parameter: compared across ranks. */
static char *describe_params(const nb_ddp *d, size_t *len) {
    size_t cap = 256, n = 0;
    char *s = nb__ddp_calloc(cap, 1);
    for (int i = 0; i < d->n; i++) {
        char line[700];
        int k = snprintf(line, sizeof line, "%s %s %s\n", d->p[i].name,
                         nb_dtype_name(d->p[i].tensor->dtype), nb_shape_str(d->p[i].tensor));
        if (k >= (int)sizeof line) k = (int)sizeof line - 1;
        while (n + (size_t)k + 1 > cap) {
            cap *= 2;
            char *t = realloc(s, cap);
            NB_CHECK(t, "nb_ddp_new: out of memory");
            s = t;
        }
        memcpy(s + n, line, (size_t)k + 1);
        n += (size_t)k;
    }
    *len = n;
    return s;
}

/* Line i of s (without its newline), or "" past the end. */
static void nth_line(const char *s, int i, char *out, size_t cap) {
    for (; i > 0 && *s; s++)
        if (*s == '\n') i--;
    size_t k = 0;
    while (s[k] && s[k] != '\n' && k + 1 < cap) {
        out[k] = s[k];
        k++;
    }
    out[k] = 0;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* A copy of the store value under key, NUL-terminated, or NULL. */
static char *store_text(nb_store *store, const char *key, double timeout_s) {
    void *v = NULL;
    size_t len = 0;
    if (nb_store_get(store, key, timeout_s, &v, &len) != NB_OK) return NULL;
    char *s = nb__ddp_calloc(len + 1, 1);
    memcpy(s, v, len);
    free(v);
    return s;
}

/* Every rank posts its parameter list; each compares with rank 0's and the
 * ranks agree on the verdict; on a mismatch every rank names the first
 * differing parameter and the ranks. */
nb_status nb__ddp_verify_params(nb_ddp *d) {
    static unsigned serial; /* distinguishes the wrappers of one run (same order on every rank) */
    unsigned id = ++serial;
    d->id = id;
    nb_store *store = nb_pg_store(d->pg);
    char key[96];
    size_t len;
    char *mine = describe_params(d, &len);
    snprintf(key, sizeof key, "ddp/%u/params/%d", id, nb_pg_global_rank(d->pg, d->rank));
    nb_status st = nb_store_set(store, key, mine, len);
    char *ref = NULL;
    if (st == NB_OK) {
        snprintf(key, sizeof key, "ddp/%u/params/%d", id, nb_pg_global_rank(d->pg, 0));
        ref = store_text(store, key, 300);
        if (!ref) st = NB_ERR_TIMEOUT;
    }
    bool differs = st != NB_OK || strcmp(ref, mine) != 0, any = false;
    nb_status st2 = nb_pg_agree(d->pg, differs, &any, NULL);
    free(mine);
    if (st != NB_OK || st2 != NB_OK || !any) {
        free(ref);
        return st != NB_OK ? st : st2;
    }
    int first = -1, bad_rank = -1, bad_lines = 0;
    char a[700] = "", b[700] = "";
    for (int r = 1; r < d->world; r++) {
        snprintf(key, sizeof key, "ddp/%u/params/%d", id, nb_pg_global_rank(d->pg, r));
        char *other = store_text(store, key, 60);
        if (!other) continue;
        int nl = count_lines(ref) > count_lines(other) ? count_lines(ref) : count_lines(other);
        for (int i = 0; i < nl && (first < 0 || i < first); i++) {
            char la[700], lb[700];
            nth_line(ref, i, la, sizeof la);
            nth_line(other, i, lb, sizeof lb);
            if (strcmp(la, lb) != 0) {
                first = i;
                bad_rank = r;
                bad_lines = count_lines(other);
                memcpy(a, la, sizeof a);
                memcpy(b, lb, sizeof b);
                break;
            }
        }
        free(other);
    }
    st = nb_set_error(NB_ERR_MISMATCH,
                      "nb_ddp_new: the ranks' models differ at parameter %d: rank 0 has \"%s\", "
                      "rank %d has \"%s\" (%d vs %d parameters that require grad)",
                      first, a[0] ? a : "nothing", bad_rank, b[0] ? b : "nothing", count_lines(ref),
                      bad_lines);
    free(ref);
    return st;
}

nb_status nb__ddp_broadcast_tensors(nb_ddp *d, bool buffers_only, int root) {
    int n = buffers_only ? nb_module_named_buffers(d->model, NULL, 0) : nb_module_state(d->model, NULL, 0);
    nb_named_tensor *s = nb__ddp_calloc((size_t)n, sizeof *s);
    if (buffers_only) nb_module_named_buffers(d->model, s, n);
    else nb_module_state(d->model, s, n);
    /* all issued, then all waited for: one round trip, not one per tensor */
    nb_work **w = nb__ddp_calloc((size_t)(n ? n : 1), sizeof *w);
    for (int i = 0; i < n; i++) {
        NB_CHECK(nb_is_contiguous(s[i].tensor), "nb_ddp: %s is not contiguous", s[i].name);
        w[i] = nb_pg_broadcast(d->pg, s[i].tensor, root);
    }
    nb_status st = NB_OK;
    for (int i = 0; i < n; i++) {
        nb_status si = nb_work_finish(w[i]);
        if (st == NB_OK) st = si;
    }
    free(w);
    free(s);
    return st;
}
