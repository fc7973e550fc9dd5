/* Stand-ins for the Gloo shim when the build has no Gloo (NABLA_GLOO=OFF
 * or libgloo-dev missing): nb_pg_init refuses the backend before any of
 * these could run, so they only report. */
#include "distributed/internal.h"

#if !NABLA_HAVE_GLOO
static nb_status no_gloo(void) {
    return nb_set_error(NB_ERR_UNSUPPORTED, "nb_pg: nabla was built without Gloo");
}

nb_status nb__gloo_dev_new(nb__gloo_dev **out, const char *hostname, const char *iface) {
    (void)hostname, (void)iface;
    *out = NULL;
    return no_gloo();
}
void nb__gloo_dev_free(nb__gloo_dev *dev) { (void)dev; }
nb_status nb__gloo_connect(nb__gloo **out, nb__gloo_dev *dev, nb_store *store, const char *prefix, int rank, int size,
                           double timeout_s, double connect_s, bool blocking) {
    (void)dev, (void)store, (void)prefix, (void)rank, (void)size, (void)timeout_s, (void)connect_s, (void)blocking;
    *out = NULL;
    return no_gloo();
}
void nb__gloo_free(nb__gloo *g) { (void)g; }
nb_status nb__gloo_run(nb__gloo *g, const nb__coll *c) {
    (void)g, (void)c;
    return no_gloo();
}
nb_status nb__gloo_exchange(nb__gloo *g, const void *mine, size_t sent, void *all, size_t n, bool own, bool sized) {
    (void)g, (void)mine, (void)sent, (void)all, (void)n, (void)own, (void)sized;
    return no_gloo();
}
nb_status nb__gloo_ring_all_reduce(nb__gloo *g, const nb__coll *c) {
    (void)g, (void)c;
    return no_gloo();
}
#else
typedef int nb__gloo_stub_unused; /* the real shim is gloo_shim.cpp */
#endif
