/* Subgroups: nb_pg_new_group.
 *
 * Every rank of the parent calls it with the same list; each call takes
 * the next number from the parent's counter, so the k-th group made from a
 * parent gets the same name ("world.g<k>", nested: "world.g1.g3") on
 * every rank without talking. Non-members return at once. Members publish the list
 * they were given under their rank in the parent, and compare it with the
 * lists of the ranks on their own list before connecting, so that a rank
 * whose list differs from its would-be partners' gets an error naming
 * both lists instead of a hang in the transport's set-up. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/pg.h"

static char *list_text(const int *ranks, int n) {
    size_t cap = (size_t)n * 12 + 3, used = 0;
    char *s = malloc(cap);
    NB_CHECK(s != NULL, "nb_pg_new_group: out of memory");
    used += (size_t)snprintf(s, cap, "[");
    for (int i = 0; i < n; i++) used += (size_t)snprintf(s + used, cap - used, "%s%d", i ? ", " : "", ranks[i]);
    snprintf(s + used, cap - used, "]");
    return s;
}

/* Waits for the lists of the ranks on ours and compares them with ours. */
static nb_status check_lists(nb_pg *pg, const char *name, const int *ranks, const char *mine, int n) {
    nb_store *store = pg->root->store_main;
    char **keys = malloc((size_t)n * sizeof *keys);
    char **vals = calloc((size_t)n, sizeof *vals);
    char *buf = malloc((size_t)n * 96);
    NB_CHECK(keys && vals && buf, "nb_pg_new_group: out of memory");
    for (int i = 0; i < n; i++) {
        keys[i] = buf + (size_t)i * 96;
        snprintf(keys[i], 96, "nb/group/%s/%d", name, ranks[i]);
    }
    nb_status st = NB_OK;
    for (int i = 0; i < n && st == NB_OK; i += NB_STORE_MAX_KEYS) {
        int m = n - i < NB_STORE_MAX_KEYS ? n - i : NB_STORE_MAX_KEYS;
        st = nb_store_wait(store, (const char *const *)keys + i, m, pg->timeout_s);
        if (st == NB_OK) st = nb__store_mget(store, (const char *const *)keys + i, m, vals + i);
    }
    if (st != NB_OK) {
        char why[NB__MSG_LEN];
        snprintf(why, sizeof why, "%s", nb_last_error());
        st = nb_set_error(st, "nb_pg_new_group: not every member of group '%s' arrived: %s", name, why);
    } else {
        for (int i = 0; i < n; i++) {
            if (vals[i] && strcmp(vals[i], mine) != 0) {
                st = nb_set_error(NB_ERR_MISMATCH,
                                  "nb_pg_new_group: ranks disagree on the members of group '%s': "
                                  "rank %d was given %s, rank %d was given %s",
                                  name, ranks[i], vals[i], pg->rank, mine);
                break;
            }
        }
    }
    for (int i = 0; i < n; i++) free(vals[i]);
    free(vals);
    free(keys);
    free(buf);
    return st;
}

nb_status nb_pg_new_group(nb_pg *pg, const int *ranks, int n, nb_pg **out) {
    const char *fn = "nb_pg_new_group";
    NB__CHECK_HANDLE(fn, pg, "process group");
    NB_CHECK(out != NULL && ranks != NULL, "%s: NULL argument", fn);
    NB_CHECK(n >= 1 && n <= pg->size, "%s: %d ranks for a subgroup of a group of %d", fn, n, pg->size);
    for (int i = 0; i < n; i++) {
        NB_CHECK(ranks[i] >= 0 && ranks[i] < pg->size, "%s: rank %d is outside the group of %d", fn,
                 ranks[i], pg->size);
        for (int j = 0; j < i; j++)
            NB_CHECK(ranks[j] != ranks[i], "%s: rank %d is listed twice (positions %d and %d)", fn,
                     ranks[i], j, i);
    }
    *out = NULL;
    nb_pg *root = pg->root;
    int k = ++pg->n_groups_made;
    int me = -1;
    for (int i = 0; i < n; i++)
        if (ranks[i] == pg->rank) me = i;
    if (me < 0) return NB_OK;

    char name[64];
    int name_len = snprintf(name, sizeof name, "%s.g%d", pg->name, k);
    NB_CHECK(name_len < (int)sizeof name, "%s: subgroups nested too deep (name '%s.g%d')", fn, pg->name, k);
    char *mine = list_text(ranks, n);
    char key[96];
    snprintf(key, sizeof key, "nb/group/%s/%d", name, pg->rank);
    nb_status st = nb_store_set(root->store_main, key, mine, strlen(mine));
    if (st == NB_OK) st = check_lists(pg, name, ranks, mine, n);
    free(mine);
    if (st != NB_OK) return st;

    nb_pg *g = nb__pg_alloc(root, pg, me, n);
    snprintf(g->name, sizeof g->name, "%s", name);
    for (int i = 0; i < n; i++) g->global[i] = pg->global[ranks[i]];
    g->env = root->env;
    g->backend = pg->backend;
    g->ops = pg->ops;
    g->base = pg->base;
    g->device = pg->device;
    g->timeout_s = pg->timeout_s;
    char prefix[96];
    snprintf(prefix, sizeof prefix, "nb/%s/%s/", nb_pg_backend_name(g->backend), name);
    st = nb__pg_start_backend(g, prefix);
    pg->n_children++;
    if (st != NB_OK) {
        char msg[NB__MSG_LEN];
        snprintf(msg, sizeof msg, "%s", nb_last_error());
        nb_pg_free(g);
        return nb_set_error(st, "%s", msg);
    }
    *out = g;
    return NB_OK;
}
