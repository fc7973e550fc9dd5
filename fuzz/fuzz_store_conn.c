/* libFuzzer target: the store server's handling of connections (Note
 * [Store authentication] in distributed/store_server.c), driven through
 * the server without sockets (nb__store_core_*): up to 8 connections at
 * once, each fed bytes, hung up, or given a correct greeting by the
 * harness; time passes in steps, so deadlines and parked waits fire.
 *
 * The input's first byte configures the store: bit 0 a secret, bits 1-2
 * the world size (0: any rank). Then events, one byte each (low 3 bits
 * the kind, the next 3 the connection's slot), some with bytes of their
 * own:
 *   0 open      accept a connection (refused at the cap on pending ones)
 *   1 data      n, then n bytes, fed as received
 *   2 hang up   the peer closes
 *   3 time      t: t * 50 ms pass
 *   4 greet     r: a fresh connection says HELLO (and proves the secret)
 *               as rank r % 5 - 1, with the store's run id
 *   5 request   a well-formed SET, SET_QUIET, GET, WAIT, ADD, CAS, DELETE
 *               or MGET, from the next bytes
 *   6 frame     n, then a frame body of n bytes, length prefix added
 *   7 bye       a BYE frame
 *
 * What must hold, whatever the bytes (abort() otherwise):
 *   - every reply is well formed (length-prefixed frames);
 *   - a connection not admitted never receives the store's run id unless
 *     it sent it; before admission it never buffers more than one small
 *     frame; pending connections never exceed the cap;
 *   - with a secret, only the harness's greetings are admitted (raw bytes
 *     cannot prove the secret), and the store's proof in its OK checks;
 *   - a greeting is admitted exactly when its rank is in the world and not
 *     held by a live connection;
 *   - only an admitted rank's departure without BYE aborts the run, and
 *     it always does;
 *   - the table never holds more than its limit (the abort reason aside).
 * Build and run: fuzz/run.sh 60 fuzz_store_conn. */
/* smoke-instrument: distributed/store_server.c distributed/store_proto.c distributed/store_kv.c */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define SLOTS 8
#define RUN_ID "fuzz-run-5e21c0d7"
#define MAX_PENDING 4
#define MAX_BYTES 65536
static const uint8_t SECRET[] = "a fuzzing secret, 32 bytes long.";

typedef struct slot {
    nb__store_conn *c; /* NULL: closed */
    nb__buf sent;      /* every byte this peer sent */
    bool greeted;      /* the harness greeted on it (it knows the run id) */
} slot;

typedef struct harness {
    nb_store_server *s;
    slot slots[SLOTS];
    bool secret;
    int world;
    double now;
} harness;

static void check(bool ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_store_conn: violated: %s\n", what);
        abort();
    }
}

/* Appends n raw bytes (no length prefix). */
static void put_raw(nb__buf *b, const uint8_t *p, size_t n) {
    for (size_t k = 0; k < n; k++) nb__buf_u8(b, p[k]);
}

static bool contains(const uint8_t *p, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(p + i, needle, k) == 0) return true;
    return false;
}

static void frames_ok(const nb__buf *out) {
    size_t r = 0;
    while (r + 4 <= out->n) {
        uint32_t rl = nb__store_frame_len(out->p + r);
        check(rl > 0 && rl <= NB_STORE_MAX_MESSAGE && r + 4 + rl <= out->n, "a malformed reply frame");
        r += 4 + (size_t)rl;
    }
    check(r == out->n, "bytes after the last reply frame");
}

/* The peer (or the server) ends the connection of slot i. */
static void hang_up(harness *h, int i) {
    slot *sl = &h->slots[i];
    if (!sl->c) return;
    int rank = nb__store_core_rank(sl->c);
    bool bye = nb__store_core_said_bye(sl->c);
    bool before = nb__store_core_abort_reason(h->s) != NULL;
    nb__store_core_drop(h->s, sl->c);
    bool after = nb__store_core_abort_reason(h->s) != NULL;
    if (rank >= 0 && !bye) check(after, "an admitted rank left without goodbye and the run goes on");
    else check(after == before, "a connection that was not an admitted rank aborted the run");
    sl->c = NULL;
    sl->sent.n = 0;
    sl->greeted = false;
}

/* Looks at what slot i was told; returns (and clears) its output. */
static void consume(harness *h, int i, nb__buf *copy) {
    slot *sl = &h->slots[i];
    nb__buf *out = nb__store_core_output(sl->c);
    frames_ok(out);
    if (!nb__store_core_authenticated(sl->c))
        check(!contains(out->p, out->n, RUN_ID) || contains(sl->sent.p, sl->sent.n, RUN_ID),
              "the store's run id went to a connection that did not know it");
    if (copy) {
        copy->n = 0;
        put_raw(copy, out->p, out->n);
    }
    out->n = 0;
}

static void invariants(harness *h) {
    check(nb__store_core_pending(h->s) <= MAX_PENDING, "more pending connections than the cap");
    check(nb__kv_bytes(nb__store_core_kv(h->s)) <= MAX_BYTES + 600, "the table passed its limit");
    for (int i = 0; i < SLOTS; i++) {
        slot *sl = &h->slots[i];
        if (!sl->c) continue;
        consume(h, i, NULL);
        bool authed = nb__store_core_authenticated(sl->c);
        if (!authed)
            check(nb__store_core_in_buffered(sl->c) <= NB__STORE_PREAUTH_MAX_FRAME + 4,
                  "a connection not admitted buffers more than one small frame");
        if (authed && h->secret) check(sl->greeted, "a connection proved the secret without knowing it");
        int rank = nb__store_core_rank(sl->c);
        if (rank >= 0) {
            check(h->world == 0 || rank < h->world, "an admitted rank outside the world");
            for (int j = 0; j < SLOTS; j++)
                if (j != i && h->slots[j].c && !nb__store_core_said_bye(h->slots[j].c) &&
                    !nb__store_core_said_bye(sl->c))
                    check(nb__store_core_rank(h->slots[j].c) != rank, "two live connections hold one rank");
        }
        /* The server drops a closing connection once its output is flushed. */
        if (nb__store_core_closing(sl->c)) hang_up(h, i);
    }
}

static bool open_slot(harness *h, int i) {
    if (h->slots[i].c) return true;
    h->slots[i].c = nb__store_core_accept(h->s, h->now);
    return h->slots[i].c != NULL;
}

static void feed(harness *h, int i, const uint8_t *p, size_t n) {
    if (!open_slot(h, i)) return;
    slot *sl = &h->slots[i];
    put_raw(&sl->sent, p, n);
    if (!nb__store_core_input(h->s, sl->c, p, n, h->now)) {
        consume(h, i, NULL);
        hang_up(h, i);
    }
}

static void feed_frame(harness *h, int i, const nb__buf *b) { feed(h, i, b->p, b->n); }

/* What a live connection other than slot i holds `rank`. */
static bool rank_held(const harness *h, int i, int rank) {
    for (int j = 0; j < SLOTS; j++)
        if (j != i && h->slots[j].c && nb__store_core_rank(h->slots[j].c) == rank &&
            !nb__store_core_said_bye(h->slots[j].c))
            return true;
    return false;
}

/* Ends the frame begun at f in b, feeds it to slot i, which must stay
 * open, and reads the answer into reply; its status byte. `what`: the
 * request, a correct one, in the messages. */
static uint8_t ask(harness *h, int i, nb__buf *b, size_t f, nb__buf *reply, const char *what) {
    char msg[64];
    nb__buf_frame_end(b, f);
    feed_frame(h, i, b);
    snprintf(msg, sizeof msg, "a correct %s closed the connection", what);
    check(h->slots[i].c != NULL, msg);
    consume(h, i, reply);
    snprintf(msg, sizeof msg, "no answer to a correct %s", what);
    check(reply->n >= 4 + 1, msg);
    return reply->p[4];
}

/* A correct greeting on a fresh connection in slot i. */
static void greet(harness *h, int i, int rank) {
    hang_up(h, i);
    if (!open_slot(h, i)) return;
    slot *sl = &h->slots[i];
    sl->greeted = true;
    bool admissible = (h->world == 0 || rank < h->world) && (rank < 0 || !rank_held(h, i, rank));
    uint8_t cnonce[NB__STORE_NONCE_LEN];
    memset(cnonce, 0x42 + i, sizeof cnonce);
    nb__buf b = {0}, reply = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_HELLO);
    nb__buf_u32(&b, NB__STORE_MAGIC);
    nb__buf_bytes(&b, RUN_ID, strlen(RUN_ID));
    nb__buf_i64(&b, rank);
    nb__buf_bytes(&b, cnonce, sizeof cnonce);
    uint8_t status = ask(h, i, &b, f, &reply, "HELLO");
    const uint8_t *r = reply.p;
    size_t rn = reply.n;
    if (h->secret) {
        check(status == NB__R_CHALLENGE && rn == 4 + 1 + 4 + NB__STORE_NONCE_LEN,
              "a store with a secret did not challenge");
        uint8_t snonce[NB__STORE_NONCE_LEN], mac[NB__STORE_MAC_LEN], theirs[NB__STORE_MAC_LEN];
        memcpy(snonce, r + 4 + 1 + 4, sizeof snonce);
        nb__store_mac(SECRET, sizeof SECRET - 1, "nabla store client", cnonce, snonce, RUN_ID, rank, mac);
        b.n = 0;
        f = nb__buf_frame_begin(&b);
        nb__buf_u8(&b, NB__OP_AUTH);
        nb__buf_bytes(&b, mac, sizeof mac);
        status = ask(h, i, &b, f, &reply, "AUTH");
        r = reply.p;
        rn = reply.n;
        if (status == NB__R_OK) {
            check(rn == 4 + 1 + 4 + NB__STORE_MAC_LEN, "an OK without the store's proof");
            nb__store_mac(SECRET, sizeof SECRET - 1, "nabla store server", cnonce, snonce, RUN_ID, rank,
                          theirs);
            check(nb__store_mac_equal(theirs, r + 4 + 1 + 4), "the store's proof does not check");
        }
    }
    check((status == NB__R_OK) == admissible, admissible ? "an admissible rank was refused"
                                                          : "an inadmissible rank was admitted");
    check(status == NB__R_OK || status == NB__R_ERROR, "an unexpected answer to a greeting");
    check(nb__store_core_authenticated(sl->c) == (status == NB__R_OK), "admission and answer disagree");
    nb__buf_free(&b);
    nb__buf_free(&reply);
}

typedef struct reader {
    const uint8_t *p;
    size_t n, off;
} reader;

static uint8_t next(reader *in) { return in->off < in->n ? in->p[in->off++] : 0; }

/* A well-formed request from the next bytes. */
static void request(harness *h, int i, reader *in) {
    static const uint8_t ops[] = {NB__OP_SET, NB__OP_SET_QUIET, NB__OP_GET, NB__OP_WAIT,
                                  NB__OP_ADD, NB__OP_CAS,       NB__OP_DELETE, NB__OP_MGET};
    uint8_t op = ops[next(in) % 8];
    char key[8];
    snprintf(key, sizeof key, "k%d", next(in) % 8);
    size_t vlen = (size_t)next(in) * 64;
    uint8_t *v = calloc(1, vlen ? vlen : 1);
    nb__buf b = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, op);
    switch (op) {
    case NB__OP_SET:
    case NB__OP_SET_QUIET:
        nb__buf_bytes(&b, key, strlen(key));
        nb__buf_bytes(&b, v, vlen);
        break;
    case NB__OP_GET:
        nb__buf_bytes(&b, key, strlen(key));
        nb__buf_i64(&b, (int64_t)next(in) * 10);
        break;
    case NB__OP_WAIT:
    case NB__OP_MGET:
        nb__buf_u32(&b, 2);
        nb__buf_bytes(&b, key, strlen(key));
        nb__buf_bytes(&b, "k0", 2);
        if (op == NB__OP_WAIT) nb__buf_i64(&b, (int64_t)next(in) * 10);
        break;
    case NB__OP_ADD:
        nb__buf_bytes(&b, key, strlen(key));
        nb__buf_i64(&b, (int64_t)(int8_t)next(in));
        break;
    case NB__OP_CAS:
        nb__buf_bytes(&b, key, strlen(key));
        nb__buf_u8(&b, next(in) & 1);
        nb__buf_bytes(&b, NULL, 0);
        nb__buf_bytes(&b, v, vlen);
        break;
    default:
        nb__buf_bytes(&b, key, strlen(key));
        break;
    }
    nb__buf_frame_end(&b, f);
    feed_frame(h, i, &b);
    nb__buf_free(&b);
    free(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    reader in = {data, size, 0};
    harness h;
    memset(&h, 0, sizeof h);
    uint8_t conf = next(&in);
    h.secret = conf & 1;
    h.world = (conf >> 1) & 3;
    h.now = 1000.0;
    nb__store_config cfg = {.run_id = RUN_ID,
                            .secret = h.secret ? SECRET : NULL,
                            .secret_len = h.secret ? sizeof SECRET - 1 : 0,
                            .world_size = h.world,
                            .auth_timeout_s = 1.0,
                            .max_pending = MAX_PENDING,
                            .max_bytes = MAX_BYTES};
    nb__store_core_new(&h.s, &cfg);
    while (in.off < in.n) {
        uint8_t e = next(&in);
        int i = (e >> 3) & (SLOTS - 1);
        switch (e & 7) {
        case 0:
            open_slot(&h, i);
            break;
        case 1: {
            size_t n = next(&in);
            if (n > in.n - in.off) n = in.n - in.off;
            feed(&h, i, in.p + in.off, n);
            in.off += n;
            break;
        }
        case 2:
            if (h.slots[i].c) consume(&h, i, NULL);
            hang_up(&h, i);
            break;
        case 3:
            h.now += next(&in) * 0.05;
            nb__store_core_tick(h.s, h.now);
            break;
        case 4:
            greet(&h, i, next(&in) % 5 - 1);
            break;
        case 5:
            request(&h, i, &in);
            break;
        case 6: {
            size_t n = next(&in);
            if (n > in.n - in.off) n = in.n - in.off;
            nb__buf b = {0};
            size_t f = nb__buf_frame_begin(&b);
            put_raw(&b, in.p + in.off, n);
            nb__buf_frame_end(&b, f);
            in.off += n;
            feed_frame(&h, i, &b);
            nb__buf_free(&b);
            break;
        }
        default: {
            uint8_t bye[5] = {1, 0, 0, 0, NB__OP_BYE};
            feed(&h, i, bye, sizeof bye);
            break;
        }
        }
        invariants(&h);
    }
    for (int i = 0; i < SLOTS; i++) {
        if (h.slots[i].c) consume(&h, i, NULL);
        hang_up(&h, i);
        nb__buf_free(&h.slots[i].sent);
    }
    nb__store_core_free(h.s);
    return 0;
}
