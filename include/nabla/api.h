/* NB_API: what marks a function as part of nabla's public interface.
 *
 * libnabla.so is built with -fvisibility=hidden, so it exports exactly the
 * functions declared with NB_API in these headers (and the few internals
 * its CUDA plugin calls, marked NB_PLUGIN_API in the internal headers):
 * a function shared between the library's files without NB_API stays
 * inside the library. Every function declared in include/nabla/ carries
 * it; tests/test_exports.py holds the headers and the library's exports
 * to each other. */
#ifndef NABLA_API_H
#define NABLA_API_H

#define NB_API __attribute__((visibility("default")))

#endif
