/* The store's wire format: building frames and parsing them.
 *
 * Note [Store protocol]
 * Every message is a frame: a little-endian u32 length, then that many
 * bytes of body. A request body is a u8 operation followed by its fields;
 * a reply body is a u8 status followed by its fields. Fields are u8, u32,
 * i64 (little-endian) and bytes (a u32 length, then the bytes).
 *
 *   HELLO   u32 magic "NBS2", bytes run_id, i64 rank (-1: anonymous),
 *           bytes nonce (32)                  -> OK | CHALLENGE | ERROR
 *   AUTH    bytes mac (32)                    -> OK (bytes mac) | ERROR
 *   SET     bytes key, bytes value            SET_QUIET: same, no reply
 *   GET     bytes key, i64 timeout_ms         -> VALUE | TIMEOUT | ABORTED
 *   WAIT    u32 n, n x bytes key, i64 timeout_ms  -> OK | TIMEOUT | ABORTED
 *   ADD     bytes key, i64 delta              -> INT
 *   CAS     bytes key, u8 has_expected, bytes expected, bytes desired -> VALUE
 *   DELETE  bytes key                         -> INT (1: it existed)
 *   MGET    u32 n, n x bytes key              -> VALUES (never waits)
 *   BYE                                       -> OK
 *
 * The first request of a connection must be HELLO; the server refuses a
 * run id other than its own, so that a process left over from an earlier
 * run cannot join, and a store with a secret answers with a CHALLENGE that
 * AUTH must meet (Note [Store authentication] in store_server.c). Lengths
 * are bounded (NB_STORE_MAX_*; before authentication, frames of at most
 * NB__STORE_PREAUTH_MAX_FRAME bytes): a longer frame, a field running past
 * its frame, bytes left over, an unknown operation or too many keys make
 * the server close that one connection; the store and every other
 * connection carry on. A value over NB_STORE_MAX_VALUE, or one the table
 * has no room for, is refused with an ERROR naming the key. GET with a
 * timeout of 0 answers NOT_FOUND at once instead of waiting. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"

/* ---- building ---- */

static void buf_reserve(nb__buf *b, size_t extra) {
    if (b->n + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra) cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    NB_CHECK(p != NULL, "nb_store: out of memory growing a message buffer to %zu bytes", cap);
    b->p = p;
    b->cap = cap;
}

void nb__buf_free(nb__buf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

void nb__buf_u8(nb__buf *b, uint8_t v) {
    buf_reserve(b, 1);
    b->p[b->n++] = v;
}

static void put_le(nb__buf *b, uint64_t v, int bytes) {
    buf_reserve(b, (size_t)bytes);
    for (int i = 0; i < bytes; i++) b->p[b->n++] = (uint8_t)(v >> (8 * i));
}

void nb__buf_u32(nb__buf *b, uint32_t v) { put_le(b, v, 4); }
void nb__buf_i64(nb__buf *b, int64_t v) { put_le(b, (uint64_t)v, 8); }

void nb__buf_bytes(nb__buf *b, const void *p, size_t n) {
    nb__buf_u32(b, (uint32_t)n);
    buf_reserve(b, n);
    if (n) memcpy(b->p + b->n, p, n);
    b->n += n;
}

size_t nb__buf_frame_begin(nb__buf *b) {
    size_t start = b->n;
    nb__buf_u32(b, 0);
    return start;
}

void nb__buf_frame_end(nb__buf *b, size_t start) {
    uint32_t len = (uint32_t)(b->n - start - 4);
    for (int i = 0; i < 4; i++) b->p[start + (size_t)i] = (uint8_t)(len >> (8 * i));
}

uint32_t nb__store_frame_len(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ---- reading ---- */

static uint64_t get_le(nb__reader *r, int bytes) {
    if (r->bad || r->n - r->off < (size_t)bytes) {
        r->bad = true;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)r->p[r->off + (size_t)i] << (8 * i);
    r->off += (size_t)bytes;
    return v;
}

uint8_t nb__rd_u8(nb__reader *r) { return (uint8_t)get_le(r, 1); }
uint32_t nb__rd_u32(nb__reader *r) { return (uint32_t)get_le(r, 4); }
int64_t nb__rd_i64(nb__reader *r) { return (int64_t)get_le(r, 8); }

nb__bytes nb__rd_bytes(nb__reader *r) {
    nb__bytes out = {NULL, 0};
    uint32_t n = nb__rd_u32(r);
    if (r->bad || r->n - r->off < n) {
        r->bad = true;
        return out;
    }
    out.p = r->p + r->off;
    out.n = n;
    r->off += n;
    return out;
}

/* ---- parsing requests ---- */

static bool key_ok(nb__bytes k) { return k.n > 0 && k.n <= NB_STORE_MAX_KEY; }

nb_status nb__store_parse_request(const uint8_t *body, size_t len, nb__store_req *req, char *why,
                                  size_t why_len) {
    nb__reader r = {body, len, 0, false};
    req->op = nb__rd_u8(&r);
    req->has_expected = false;
    req->nkeys = 0;
    req->num = 0;
    const char *bad = NULL;
    switch (req->op) {
    case NB__OP_HELLO:
        req->magic = nb__rd_u32(&r);
        req->run_id = nb__rd_bytes(&r);
        req->num = nb__rd_i64(&r);
        req->nonce = nb__rd_bytes(&r);
        if (!r.bad && req->magic != NB__STORE_MAGIC) bad = "wrong magic in HELLO";
        else if (!r.bad && req->run_id.n > 127) bad = "run id longer than 127 bytes";
        else if (!r.bad && (req->num < -1 || req->num > INT32_MAX)) bad = "rank out of range";
        else if (!r.bad && req->nonce.n != NB__STORE_NONCE_LEN) bad = "nonce of the wrong length";
        break;
    case NB__OP_AUTH:
        req->mac = nb__rd_bytes(&r);
        if (!r.bad && req->mac.n != NB__STORE_MAC_LEN) bad = "proof of the wrong length";
        break;
    case NB__OP_SET:
    case NB__OP_SET_QUIET:
        req->key = nb__rd_bytes(&r);
        req->value = nb__rd_bytes(&r);
        break;
    case NB__OP_GET:
        req->key = nb__rd_bytes(&r);
        req->num = nb__rd_i64(&r);
        if (!r.bad && req->num < 0) bad = "negative timeout";
        break;
    case NB__OP_WAIT:
    case NB__OP_MGET:
        req->nkeys = nb__rd_u32(&r);
        if (!r.bad && (req->nkeys == 0 || req->nkeys > NB_STORE_MAX_KEYS)) {
            bad = "key count out of range";
            break;
        }
        for (uint32_t i = 0; i < req->nkeys && !r.bad; i++) {
            req->keys[i] = nb__rd_bytes(&r);
            if (!r.bad && !key_ok(req->keys[i])) bad = "empty or oversized key";
        }
        if (req->op == NB__OP_WAIT) {
            req->num = nb__rd_i64(&r);
            if (!r.bad && req->num < 0) bad = "negative timeout";
        }
        break;
    case NB__OP_ADD:
        req->key = nb__rd_bytes(&r);
        req->num = nb__rd_i64(&r);
        break;
    case NB__OP_CAS:
        req->key = nb__rd_bytes(&r);
        req->has_expected = nb__rd_u8(&r) != 0;
        req->expected = nb__rd_bytes(&r);
        req->value = nb__rd_bytes(&r);
        break;
    case NB__OP_DELETE:
        req->key = nb__rd_bytes(&r);
        break;
    case NB__OP_BYE:
        break;
    default:
        bad = "unknown operation";
    }
    if (!bad && !r.bad) {
        bool has_key = req->op == NB__OP_SET || req->op == NB__OP_SET_QUIET || req->op == NB__OP_GET ||
                       req->op == NB__OP_ADD || req->op == NB__OP_CAS || req->op == NB__OP_DELETE;
        if (has_key && !key_ok(req->key)) bad = "empty or oversized key";
        else if (r.off != len) bad = "bytes left over after the last field";
    }
    if (r.bad && !bad) bad = "a field runs past the end of the message";
    if (bad) {
        snprintf(why, why_len, "%s (operation %d, %zu bytes)", bad, req->op, len);
        return NB_ERR_FORMAT;
    }
    return NB_OK;
}
