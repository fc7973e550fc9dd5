/* Retired handles: Note [Freed handles] in util/handle.h. */
#include "util/handle.h"

#include <pthread.h>
#include <stdlib.h>

static pthread_mutex_t graves_mu = PTHREAD_MUTEX_INITIALIZER;
static void *graves[NB__HANDLE_GRAVES];
static unsigned graves_next;

void nb__handle_init(nb__handle *h, const char *free_fn) {
    h->magic = NB__HANDLE_LIVE;
    h->free_fn = free_fn;
}

void nb__handle_retire(void *p) {
    if (!p) return;
    nb__handle *h = p;
    h->magic = NB__HANDLE_DEAD;
    pthread_mutex_lock(&graves_mu);
    void *old = graves[graves_next % NB__HANDLE_GRAVES];
    graves[graves_next % NB__HANDLE_GRAVES] = p;
    graves_next++;
    pthread_mutex_unlock(&graves_mu);
    free(old);
}

void nb__handle_check_live(const char *fn, const void *p, const char *what) {
    const nb__handle *h = p;
    if (h->magic == NB__HANDLE_LIVE) return;
    if (h->magic == NB__HANDLE_DEAD)
        nb_abort(__FILE__, __LINE__,
                 "%s: the %s was freed (%s) and used afterwards: keep using a handle only until "
                 "its _free, and set your pointer to NULL there", fn, what, h->free_fn);
    nb_abort(__FILE__, __LINE__,
             "%s: the %s is not a live handle (freed long ago, never made, or overwritten)", fn, what);
}
