/* The store's table (a hash map of byte strings) and the execution of
 * the requests that need nothing but the table. The server adds sockets,
 * waiting and aborts around it; the fuzzer drives it directly. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"

typedef struct entry {
    uint8_t *key;
    uint32_t klen;
    nb__bytes val; /* owned copy */
    struct entry *next;
} entry;

struct nb__kv {
    entry **slots;
    size_t nslots, count;
    size_t bytes, max_bytes; /* keys and values held, and their limit */
};

static uint64_t hash(const uint8_t *p, uint32_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint32_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    NB_CHECK(p != NULL, "nb_store: out of memory (%zu bytes)", n);
    return p;
}

nb__kv *nb__kv_new(size_t max_bytes) {
    nb__kv *kv = xmalloc(sizeof *kv);
    kv->nslots = 64;
    kv->count = 0;
    kv->bytes = 0;
    kv->max_bytes = max_bytes ? max_bytes : NB__STORE_MAX_BYTES;
    kv->slots = calloc(kv->nslots, sizeof *kv->slots);
    NB_CHECK(kv->slots != NULL, "nb_store: out of memory");
    return kv;
}

void nb__kv_free(nb__kv *kv) {
    if (!kv) return;
    for (size_t i = 0; i < kv->nslots; i++) {
        entry *e = kv->slots[i];
        while (e) {
            entry *next = e->next;
            free(e->key);
            free((void *)e->val.p);
            free(e);
            e = next;
        }
    }
    free(kv->slots);
    free(kv);
}

static entry **lookup(const nb__kv *kv, const uint8_t *key, uint32_t klen) {
    entry **pp = &kv->slots[hash(key, klen) & (kv->nslots - 1)];
    while (*pp && !((*pp)->klen == klen && memcmp((*pp)->key, key, klen) == 0)) pp = &(*pp)->next;
    return pp;
}

const nb__bytes *nb__kv_find(const nb__kv *kv, const uint8_t *key, uint32_t klen) {
    entry *e = *lookup(kv, key, klen);
    return e ? &e->val : NULL;
}

static void grow(nb__kv *kv) {
    size_t n = kv->nslots * 2;
    entry **slots = calloc(n, sizeof *slots);
    NB_CHECK(slots != NULL, "nb_store: out of memory");
    for (size_t i = 0; i < kv->nslots; i++) {
        entry *e = kv->slots[i];
        while (e) {
            entry *next = e->next;
            size_t j = hash(e->key, e->klen) & (n - 1);
            e->next = slots[j];
            slots[j] = e;
            e = next;
        }
    }
    free(kv->slots);
    kv->slots = slots;
    kv->nslots = n;
}

void nb__kv_set(nb__kv *kv, const uint8_t *key, uint32_t klen, const uint8_t *val, uint32_t vlen) {
    uint8_t *copy = xmalloc(vlen);
    if (vlen) memcpy(copy, val, vlen);
    entry **pp = lookup(kv, key, klen);
    if (*pp) {
        kv->bytes = kv->bytes - (*pp)->val.n + vlen;
        free((void *)(*pp)->val.p);
        (*pp)->val.p = copy;
        (*pp)->val.n = vlen;
        return;
    }
    kv->bytes += (size_t)klen + vlen;
    entry *e = xmalloc(sizeof *e);
    e->key = xmalloc(klen);
    memcpy(e->key, key, klen);
    e->klen = klen;
    e->val.p = copy;
    e->val.n = vlen;
    e->next = NULL;
    *pp = e;
    if (++kv->count > kv->nslots) grow(kv);
}

bool nb__kv_delete(nb__kv *kv, const uint8_t *key, uint32_t klen) {
    entry **pp = lookup(kv, key, klen);
    entry *e = *pp;
    if (!e) return false;
    *pp = e->next;
    kv->bytes -= (size_t)e->klen + e->val.n;
    free(e->key);
    free((void *)e->val.p);
    free(e);
    kv->count--;
    return true;
}

size_t nb__kv_bytes(const nb__kv *kv) { return kv->bytes; }

/* Whether `key` may hold a value of vlen bytes; if not, the ERROR reply
 * naming the key and the limit is appended to `out`. */
static bool room(const nb__kv *kv, const char *op, nb__bytes key, uint32_t vlen, nb__buf *out) {
    char msg[512];
    int kn = key.n > 200 ? 200 : (int)key.n;
    const char *more = key.n > 200 ? "..." : "";
    if (vlen > NB_STORE_MAX_VALUE) {
        snprintf(msg, sizeof msg,
                 "%s '%.*s%s': a value of %u bytes is over the store's limit of %u bytes per value "
                 "(NB_STORE_MAX_VALUE)",
                 op, kn, (const char *)key.p, more, vlen, NB_STORE_MAX_VALUE);
        nb__store_reply_text(out, NB__R_ERROR, msg);
        return false;
    }
    const nb__bytes *old = nb__kv_find(kv, key.p, key.n);
    size_t after = kv->bytes + vlen - (old ? old->n : 0) + (old ? 0 : key.n);
    if (after > kv->max_bytes && after > kv->bytes) {
        snprintf(msg, sizeof msg,
                 "%s '%.*s%s': a value of %u bytes would take the store to %zu bytes of keys and "
                 "values, over its limit of %zu bytes",
                 op, kn, (const char *)key.p, more, vlen, after, kv->max_bytes);
        nb__store_reply_text(out, NB__R_ERROR, msg);
        return false;
    }
    return true;
}

void nb__store_reply_text(nb__buf *out, int status, const char *text) {
    size_t start = nb__buf_frame_begin(out);
    nb__buf_u8(out, (uint8_t)status);
    if (text) nb__buf_bytes(out, text, strlen(text));
    nb__buf_frame_end(out, start);
}

static void reply_value(nb__buf *out, int status, const nb__bytes *v) {
    size_t start = nb__buf_frame_begin(out);
    nb__buf_u8(out, (uint8_t)status);
    nb__buf_bytes(out, v->p, v->n);
    nb__buf_frame_end(out, start);
}

static void reply_int(nb__buf *out, int64_t v) {
    size_t start = nb__buf_frame_begin(out);
    nb__buf_u8(out, NB__R_INT);
    nb__buf_i64(out, v);
    nb__buf_frame_end(out, start);
}

/* "missing: a, b (and 3 more)" for a WAIT that timed out. */
static void missing_keys(const nb__kv *kv, const nb__store_req *req, char *buf, size_t len) {
    size_t used = (size_t)snprintf(buf, len, "missing:");
    uint32_t listed = 0, missing = 0;
    for (uint32_t i = 0; i < req->nkeys; i++) {
        if (nb__kv_find(kv, req->keys[i].p, req->keys[i].n)) continue;
        missing++;
        if (used + req->keys[i].n + 8 < len && listed < 16) {
            used += (size_t)snprintf(buf + used, len - used, "%s %.*s", listed ? "," : "",
                                     (int)req->keys[i].n, (const char *)req->keys[i].p);
            listed++;
        }
    }
    if (missing > listed) snprintf(buf + used, len - used, " (and %u more)", missing - listed);
}

/* The decimal integer a value holds, as ADD keeps it. */
static bool parse_int(const nb__bytes *v, int64_t *out) {
    char tmp[32];
    if (v->n == 0 || v->n >= sizeof tmp) return false;
    memcpy(tmp, v->p, v->n);
    tmp[v->n] = 0;
    char *end;
    long long x = strtoll(tmp, &end, 10);
    if (*end != 0) return false;
    *out = (int64_t)x;
    return true;
}

bool nb__kv_apply(nb__kv *kv, const nb__store_req *req, nb__buf *out) {
    switch (req->op) {
    case NB__OP_SET:
    case NB__OP_SET_QUIET:
        if (!room(kv, "set", req->key, req->value.n, out)) return true;
        nb__kv_set(kv, req->key.p, req->key.n, req->value.p, req->value.n);
        if (req->op == NB__OP_SET) nb__store_reply_text(out, NB__R_OK, NULL);
        return true;
    case NB__OP_GET: {
        const nb__bytes *v = nb__kv_find(kv, req->key.p, req->key.n);
        if (v) reply_value(out, NB__R_VALUE, v);
        else if (req->num == 0) nb__store_reply_text(out, NB__R_NOT_FOUND, NULL);
        else return false;
        return true;
    }
    case NB__OP_WAIT: {
        uint32_t i = 0;
        while (i < req->nkeys && nb__kv_find(kv, req->keys[i].p, req->keys[i].n)) i++;
        if (i == req->nkeys) {
            nb__store_reply_text(out, NB__R_OK, NULL);
        } else if (req->num == 0) {
            char msg[1024];
            missing_keys(kv, req, msg, sizeof msg);
            nb__store_reply_text(out, NB__R_TIMEOUT, msg);
        } else {
            return false;
        }
        return true;
    }
    case NB__OP_ADD: {
        int64_t cur = 0, sum;
        const nb__bytes *v = nb__kv_find(kv, req->key.p, req->key.n);
        if (v && !parse_int(v, &cur)) {
            nb__store_reply_text(out, NB__R_ERROR, "add: the key holds a value that is not an integer");
            return true;
        }
        if (__builtin_add_overflow(cur, req->num, &sum)) {
            nb__store_reply_text(out, NB__R_ERROR, "add: the sum overflows 64 bits");
            return true;
        }
        char text[32];
        int n = snprintf(text, sizeof text, "%" PRId64, sum);
        if (!room(kv, "add", req->key, (uint32_t)n, out)) return true;
        nb__kv_set(kv, req->key.p, req->key.n, (const uint8_t *)text, (uint32_t)n);
        reply_int(out, sum);
        return true;
    }
    case NB__OP_CAS: {
        const nb__bytes *v = nb__kv_find(kv, req->key.p, req->key.n);
        bool swap = req->has_expected
                        ? (v && v->n == req->expected.n &&
                           (v->n == 0 || memcmp(v->p, req->expected.p, v->n) == 0))
                        : v == NULL;
        if (swap && !room(kv, "compare_set", req->key, req->value.n, out)) return true;
        if (swap) nb__kv_set(kv, req->key.p, req->key.n, req->value.p, req->value.n);
        v = nb__kv_find(kv, req->key.p, req->key.n);
        if (v) reply_value(out, NB__R_VALUE, v);
        else nb__store_reply_text(out, NB__R_NOT_FOUND, NULL);
        return true;
    }
    case NB__OP_DELETE:
        reply_int(out, nb__kv_delete(kv, req->key.p, req->key.n) ? 1 : 0);
        return true;
    case NB__OP_MGET: {
        size_t total = 0;
        for (uint32_t i = 0; i < req->nkeys; i++) {
            const nb__bytes *v = nb__kv_find(kv, req->keys[i].p, req->keys[i].n);
            total += 5 + (v ? v->n : 0);
        }
        if (total + 8 > NB_STORE_MAX_MESSAGE) {
            nb__store_reply_text(out, NB__R_ERROR, "mget: the values do not fit in one message");
            return true;
        }
        size_t start = nb__buf_frame_begin(out);
        nb__buf_u8(out, NB__R_VALUES);
        nb__buf_u32(out, req->nkeys);
        for (uint32_t i = 0; i < req->nkeys; i++) {
            const nb__bytes *v = nb__kv_find(kv, req->keys[i].p, req->keys[i].n);
            nb__buf_u8(out, v != NULL);
            if (v) nb__buf_bytes(out, v->p, v->n);
            else nb__buf_bytes(out, NULL, 0);
        }
        nb__buf_frame_end(out, start);
        return true;
    }
    default: /* HELLO and BYE: the server's business */
        nb__store_reply_text(out, NB__R_OK, NULL);
        return true;
    }
}
