/* The store's access control: where the run's secret comes from, and the
 * HMAC-SHA256 proofs of it exchanged at HELLO (Note [Store authentication]
 * in store_server.c). The cryptography is OpenSSL's libcrypto: its HMAC
 * (EVP_MAC), its random generator and its constant-time comparison. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "distributed/internal.h"

/* NABLA_STORE_SECRET_FD is read once per process: nbrun's descriptor is
 * closed and its variable removed, so that programs this one starts
 * neither inherit the secret nor read an unrelated descriptor of the same
 * number; later process groups of this process use the copy. */
static pthread_mutex_t fd_mu = PTHREAD_MUTEX_INITIALIZER;
static nb__store_secret fd_secret;
static bool fd_read;

/* Trailing newlines and spaces are not part of a secret: `echo` puts one
 * in a file, and a node whose file lacks it must still agree. */
static nb_status take(nb__store_secret *out, const uint8_t *p, size_t n, const char *source) {
    while (n > 0 && (p[n - 1] == '\n' || p[n - 1] == '\r' || p[n - 1] == ' ' || p[n - 1] == '\t')) n--;
    if (n < NB__STORE_SECRET_MIN || n > NB__STORE_SECRET_MAX)
        return nb_set_error(NB_ERR_INVALID,
                            "the store's secret from %s has %zu bytes; it needs %d to %d "
                            "(make one with: head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > "
                            "FILE; chmod 600 FILE)",
                            source, n, NB__STORE_SECRET_MIN, NB__STORE_SECRET_MAX);
    memcpy(out->bytes, p, n);
    out->len = n;
    snprintf(out->source, sizeof out->source, "%s", source);
    return NB_OK;
}

/* Reads at most NB__STORE_SECRET_MAX + 1 bytes from the start of fd. */
static nb_status read_fd(int fd, uint8_t *buf, size_t *n, const char *what) {
    *n = 0;
    for (;;) {
        ssize_t got = pread(fd, buf + *n, NB__STORE_SECRET_MAX + 1 - *n, (off_t)*n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0)
            return nb_set_error(NB_ERR_IO, "cannot read the store's secret from %s: %s",
                                what, strerror(errno));
        if (got == 0 || *n + (size_t)got > NB__STORE_SECRET_MAX) {
            *n += (size_t)got;
            return NB_OK;
        }
        *n += (size_t)got;
    }
}

static nb_status from_fd(const char *v, nb__store_secret *out) {
    pthread_mutex_lock(&fd_mu);
    nb_status st = NB_OK;
    if (!fd_read) {
        char what[64], *end;
        snprintf(what, sizeof what, "NABLA_STORE_SECRET_FD=%.20s", v);
        long fd = strtol(v, &end, 10);
        uint8_t buf[NB__STORE_SECRET_MAX + 1];
        size_t n = 0;
        if (end == v || *end != 0 || fd < 0 || fd > 1 << 20)
            st = nb_set_error(NB_ERR_INVALID, "%s is not a descriptor", what);
        if (st == NB_OK) st = read_fd((int)fd, buf, &n, what);
        if (st == NB_OK) st = take(&fd_secret, buf, n, what);
        nb__store_wipe(buf, sizeof buf);
        if (st == NB_OK) {
            close((int)fd);
            unsetenv("NABLA_STORE_SECRET_FD");
            fd_read = true;
        }
    }
    if (st == NB_OK) *out = fd_secret;
    pthread_mutex_unlock(&fd_mu);
    return st;
}

static nb_status from_file(const char *path, nb__store_secret *out) {
    char what[300];
    snprintf(what, sizeof what, "NABLA_STORE_SECRET_FILE=%.260s", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return nb_set_error(NB_ERR_IO, "cannot open the store's secret, %s: %s", what,
                            strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return nb_set_error(NB_ERR_INVALID, "%s is not a regular file", what);
    }
    if (sb.st_mode & (S_IRWXG | S_IRWXO)) {
        close(fd);
        return nb_set_error(NB_ERR_INVALID,
                            "%s may be read by other users (mode %04o); the secret must "
                            "be its owner's alone: chmod 600 it",
                            what, (unsigned)(sb.st_mode & 07777));
    }
    uint8_t buf[NB__STORE_SECRET_MAX + 1];
    size_t n = 0;
    nb_status st = read_fd(fd, buf, &n, what);
    close(fd);
    if (st == NB_OK) st = take(out, buf, n, what);
    nb__store_wipe(buf, sizeof buf);
    return st;
}

nb_status nb__store_secret_from_env(nb__store_secret *out) {
    memset(out, 0, sizeof *out);
    const char *fd = getenv("NABLA_STORE_SECRET_FD");
    if (fd && *fd) return from_fd(fd, out);
    pthread_mutex_lock(&fd_mu);
    bool have = fd_read;
    if (have) *out = fd_secret;
    pthread_mutex_unlock(&fd_mu);
    if (have) return NB_OK;
    const char *file = getenv("NABLA_STORE_SECRET_FILE");
    if (file && *file) return from_file(file, out);
    const char *v = getenv("NABLA_STORE_SECRET");
    if (v && *v) return take(out, (const uint8_t *)v, strlen(v), "NABLA_STORE_SECRET");
    return NB_OK;
}

bool nb__store_trusted_network(void) {
    const char *v = getenv("NABLA_STORE_TRUSTED_NETWORK");
    return v && strcmp(v, "1") == 0;
}

void nb__store_mac(const uint8_t *secret, size_t secret_len, const char *label,
                   const uint8_t *client_nonce, const uint8_t *server_nonce, const char *run_id,
                   int64_t rank, uint8_t out[NB__STORE_MAC_LEN]) {
    uint8_t rank_le[8];
    for (int i = 0; i < 8; i++) rank_le[i] = (uint8_t)((uint64_t)rank >> (8 * i));
    uint8_t run_len = (uint8_t)strlen(run_id);
    EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = mac ? EVP_MAC_CTX_new(mac) : NULL;
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                           OSSL_PARAM_construct_end()};
    size_t got = 0;
    /* Every field but the fixed-size ones is preceded by its length, so
     * that no two different messages read the same. */
    uint8_t label_len = (uint8_t)strlen(label);
    bool ok = ctx && EVP_MAC_init(ctx, secret, secret_len, params) &&
              EVP_MAC_update(ctx, &label_len, 1) &&
              EVP_MAC_update(ctx, (const uint8_t *)label, label_len) &&
              EVP_MAC_update(ctx, client_nonce, NB__STORE_NONCE_LEN) &&
              EVP_MAC_update(ctx, server_nonce, NB__STORE_NONCE_LEN) &&
              EVP_MAC_update(ctx, &run_len, 1) &&
              EVP_MAC_update(ctx, (const uint8_t *)run_id, run_len) &&
              EVP_MAC_update(ctx, rank_le, sizeof rank_le) &&
              EVP_MAC_final(ctx, out, &got, NB__STORE_MAC_LEN);
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(mac);
    NB_CHECK(ok && got == NB__STORE_MAC_LEN,
             "nb_store: OpenSSL's HMAC-SHA256 failed (is libcrypto's default provider available?)");
}

bool nb__store_mac_equal(const uint8_t *a, const uint8_t *b) {
    return CRYPTO_memcmp(a, b, NB__STORE_MAC_LEN) == 0;
}

void nb__store_random(uint8_t *p, size_t n) {
    NB_CHECK(RAND_bytes(p, (int)n) == 1, "nb_store: OpenSSL's RAND_bytes failed to draw %zu bytes", n);
}

void nb__store_wipe(void *p, size_t n) { OPENSSL_cleanse(p, n); }
