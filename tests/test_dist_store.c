/* The TCP store: set/get/wait/add/compare-and-set/delete semantics, waits
 * that time out with a status naming the missing keys, run ids, one
 * connection per rank, the abort when a rank's connection drops, and
 * malformed messages, which close only their own connection. The server
 * runs in this process on 127.0.0.1 and a free port; raw sockets speak
 * the wire format (Note [Store protocol]) where the client library would
 * refuse to. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "distributed/internal.h"
#include "testutil.h"

static nb_store_server *server;
static int port;

static void start(const char *run_id) {
    ck_assert_int_eq(nb_store_server_start(&server, "127.0.0.1", 0, run_id), NB_OK);
    port = nb_store_server_port(server);
    ck_assert_int_gt(port, 0);
}

static nb_store *client(int rank) {
    nb_store *s = NULL;
    nb_status st = nb_store_connect(&s, "127.0.0.1", port, "run-a", rank, 5.0);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    return s;
}

static char *get_str(nb_store *s, const char *key) {
    void *v = NULL;
    size_t n = 0;
    nb_status st = nb_store_get(s, key, 0, &v, &n);
    ck_assert_msg(st == NB_OK, "get %s: %s", key, nb_last_error());
    ck_assert_uint_eq(strlen(v), n);
    return v;
}

START_TEST(test_set_get_delete) {
    start("run-a");
    nb_store *s = client(-1);
    ck_assert_int_eq(nb_store_set(s, "k", "one", 3), NB_OK);
    char *v = get_str(s, "k");
    ck_assert_str_eq(v, "one");
    free(v);
    ck_assert_int_eq(nb_store_set(s, "k", "second", 6), NB_OK);
    v = get_str(s, "k");
    ck_assert_str_eq(v, "second");
    free(v);
    /* binary, empty, and large values */
    const char bin[5] = {1, 0, 2, 0, 3};
    ck_assert_int_eq(nb_store_set(s, "bin", bin, 5), NB_OK);
    ck_assert_int_eq(nb_store_set(s, "empty", NULL, 0), NB_OK);
    void *raw;
    size_t n;
    ck_assert_int_eq(nb_store_get(s, "bin", 0, &raw, &n), NB_OK);
    ck_assert_uint_eq(n, 5);
    ck_assert(memcmp(raw, bin, 5) == 0);
    free(raw);
    ck_assert_int_eq(nb_store_get(s, "empty", 0, &raw, &n), NB_OK);
    ck_assert_uint_eq(n, 0);
    free(raw);
    size_t big = 3u << 20;
    char *b = malloc(big);
    for (size_t i = 0; i < big; i++) b[i] = (char)(i * 7);
    ck_assert_int_eq(nb_store_set(s, "big", b, big), NB_OK);
    ck_assert_int_eq(nb_store_get(s, "big", 0, &raw, &n), NB_OK);
    ck_assert_uint_eq(n, big);
    ck_assert(memcmp(raw, b, big) == 0);
    free(raw);
    free(b);

    NBT_EXPECT_STATUS(nb_store_get(s, "absent", 0, &raw, &n), NB_ERR_NOT_FOUND, "nb_store_get: key 'absent' is not in the store");
    ck_assert_ptr_null(raw);
    bool existed = false;
    ck_assert_int_eq(nb_store_delete(s, "k", &existed), NB_OK);
    ck_assert(existed);
    ck_assert_int_eq(nb_store_delete(s, "k", &existed), NB_OK);
    ck_assert(!existed);
    NBT_EXPECT_STATUS(nb_store_get(s, "k", 0, &raw, &n), NB_ERR_NOT_FOUND, "'k' is not in the store");
    nb_store_close(s);
    nb_store_server_stop(server);
}
END_TEST

typedef struct delayed {
    const char *key;
    double delay;
} delayed;

static void *set_later(void *arg) {
    delayed *d = arg;
    struct timespec ts = {0, (long)(d->delay * 1e9)};
    nanosleep(&ts, NULL);
    nb_store *s = client(-1);
    nb_store_set(s, d->key, "late", 4);
    nb_store_close(s);
    return NULL;
}

START_TEST(test_waits) {
    start("run-a");
    nb_store *s = client(-1);
    /* a get and a wait that the key's arrival ends */
    pthread_t th;
    delayed d = {"later", 0.1};
    pthread_create(&th, NULL, set_later, &d);
    void *v = NULL;
    ck_assert_int_eq(nb_store_get(s, "later", 10, &v, NULL), NB_OK);
    ck_assert_str_eq(v, "late");
    free(v);
    pthread_join(th, NULL);
    delayed d2 = {"later2", 0.1};
    pthread_create(&th, NULL, set_later, &d2);
    const char *both[] = {"later", "later2"};
    ck_assert_int_eq(nb_store_wait(s, both, 2, 10), NB_OK);
    pthread_join(th, NULL);

    /* and ones that time out with a status naming what is missing */
    const char *keys[] = {"later", "missing-1", "missing-2"};
    NBT_EXPECT_STATUS(nb_store_wait(s, keys, 3, 0.2), NB_ERR_TIMEOUT,
               "nb_store_wait: timed out after 0.2 s (missing: missing-1, missing-2)");
    NBT_EXPECT_STATUS(nb_store_wait(s, keys, 3, 0), NB_ERR_TIMEOUT, "missing: missing-1, missing-2");
    NBT_EXPECT_STATUS(nb_store_get(s, "nope", 0.2, &v, NULL), NB_ERR_TIMEOUT,
               "nb_store_get: key 'nope' did not appear within 0.2 s");
    /* the connection still works after a timeout */
    ck_assert_int_eq(nb_store_set(s, "after", "x", 1), NB_OK);
    nb_store_close(s);
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_add_and_compare_set) {
    start("run-a");
    nb_store *s = client(-1);
    int64_t r = 0;
    ck_assert_int_eq(nb_store_add(s, "n", 5, &r), NB_OK);
    ck_assert_int_eq(r, 5);
    ck_assert_int_eq(nb_store_add(s, "n", -7, &r), NB_OK);
    ck_assert_int_eq(r, -2);
    char *v = get_str(s, "n");
    ck_assert_str_eq(v, "-2"); /* kept as decimal text */
    free(v);
    ck_assert_int_eq(nb_store_add(s, "big", INT64_MAX, &r), NB_OK);
    NBT_EXPECT_STATUS(nb_store_add(s, "big", 1, &r), NB_ERR_INVALID, "add: the sum overflows 64 bits");
    nb_store_set(s, "text", "abc", 3);
    NBT_EXPECT_STATUS(nb_store_add(s, "text", 1, &r), NB_ERR_INVALID, "add: the key holds a value that is not an integer");

    void *cur = NULL;
    size_t n = 0;
    /* absent, expected absent: swaps */
    ck_assert_int_eq(nb_store_compare_set(s, "c", NULL, 0, "v1", 2, &cur, &n), NB_OK);
    ck_assert_str_eq(cur, "v1");
    free(cur);
    /* present, expected absent: keeps */
    ck_assert_int_eq(nb_store_compare_set(s, "c", NULL, 0, "v2", 2, &cur, &n), NB_OK);
    ck_assert_str_eq(cur, "v1");
    free(cur);
    /* wrong expectation: keeps, returns what is there */
    ck_assert_int_eq(nb_store_compare_set(s, "c", "zz", 2, "v3", 2, &cur, &n), NB_OK);
    ck_assert_str_eq(cur, "v1");
    free(cur);
    /* right expectation: swaps */
    ck_assert_int_eq(nb_store_compare_set(s, "c", "v1", 2, "v4", 2, &cur, &n), NB_OK);
    ck_assert_str_eq(cur, "v4");
    ck_assert_uint_eq(n, 2);
    free(cur);
    /* absent, expected present: nothing to swap, nothing there */
    ck_assert_int_eq(nb_store_compare_set(s, "none", "v1", 2, "v5", 2, &cur, &n), NB_OK);
    ck_assert_ptr_null(cur);
    ck_assert_int_eq(nb_store_get(s, "none", 0, &cur, NULL), NB_ERR_NOT_FOUND);
    /* a swap wakes a waiter like a set does */
    ck_assert_int_eq(nb_store_compare_set(s, "c", "v4", 2, "", 0, NULL, NULL), NB_OK);
    v = get_str(s, "c");
    ck_assert_str_eq(v, "");
    free(v);
    nb_store_close(s);
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_argument_limits) {
    start("run-a");
    nb_store *s = client(-1);
    char key[NB_STORE_MAX_KEY + 2];
    memset(key, 'k', sizeof key - 1);
    key[sizeof key - 1] = 0;
    NBT_EXPECT_ABORT(nb_store_set(s, key, "x", 1), "nb_store_set: key length 4097 is outside [1, 4096]");
    NBT_EXPECT_ABORT(nb_store_set(s, "", "x", 1), "key length 0");
    NBT_EXPECT_ABORT(nb_store_set(s, "k", "x", (size_t)NB_STORE_MAX_VALUE + 1),
                     "nb_store_set: value of 16777217 bytes exceeds NB_STORE_MAX_VALUE (16777216)");
    nb_store *other = NULL;
    NBT_EXPECT_ABORT(nb_store_connect(&other, "127.0.0.1", 0, "run-a", -1, 1), "port 0 out of range");
    ck_assert_int_eq(nb_store_set(s, "k", "x", 1), NB_OK);
    nb_store_close(s);
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_run_ids_and_ranks) {
    start("run-a");
    nb_store *s = NULL;
    NBT_EXPECT_STATUS(nb_store_connect(&s, "127.0.0.1", port, "run-b", 0, 5), NB_ERR_MISMATCH,
               "the process is of run 'run-b' but this store serves another run (a process left over from an earlier run");
    /* the refusal names the client's run, never the store's */
    ck_assert_msg(strstr(nb_last_error(), "run-a") == NULL, "%s", nb_last_error());
    ck_assert_ptr_null(s);
    nb_store *r1 = client(1);
    NBT_EXPECT_STATUS(nb_store_connect(&s, "127.0.0.1", port, "run-a", 1, 5), NB_ERR_MISMATCH,
               "rank 1 is already connected to this store (two processes with the same rank?)");
    /* anonymous connections are not limited */
    nb_store *a = client(-1), *b = client(-1);
    nb_store_close(a);
    nb_store_close(b);
    /* a rank that says goodbye does not abort the run, and may come back */
    nb_store_close(r1);
    r1 = client(1);
    nb_store *s0 = client(0);
    void *v = NULL;
    ck_assert_int_eq(nb_store_get(s0, NB__STORE_ABORT_KEY, 0, &v, NULL), NB_ERR_NOT_FOUND);
    nb_store_close(r1);
    nb_store_close(s0);
    nb_store_server_stop(server);

    NBT_EXPECT_STATUS(nb_store_connect(&s, "127.0.0.1", port, "run-a", 0, 0.3), NB_ERR_TIMEOUT, "could not reach the store at 127.0.0.1:");
}
END_TEST

/* ---- raw wire-format helpers ---- */

static void raw_send(int fd, const void *p, size_t n) { ck_assert_int_eq(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n); }

static void raw_hello(int fd, int rank) {
    nb__buf b = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_HELLO);
    nb__buf_u32(&b, NB__STORE_MAGIC);
    nb__buf_bytes(&b, "run-a", 5);
    nb__buf_i64(&b, rank);
    uint8_t nonce[NB__STORE_NONCE_LEN] = {0};
    nb__buf_bytes(&b, nonce, sizeof nonce);
    nb__buf_frame_end(&b, f);
    raw_send(fd, b.p, b.n);
    nb__buf_free(&b);
    uint8_t reply[5];
    ck_assert_int_eq(recv(fd, reply, 5, MSG_WAITALL), 5);
    ck_assert_int_eq(reply[4], NB__R_OK);
}

/* The server closed this connection (no reply, end of stream). */
static void assert_closed(int fd, const char *what) {
    uint8_t b[64];
    ssize_t got = recv(fd, b, sizeof b, 0);
    ck_assert_msg(got == 0, "%s: the connection was not closed (recv %zd)", what, got);
    close(fd);
}

START_TEST(test_malformed_messages_close_only_their_connection) {
    start("run-a");
    nb_store *good = client(0);
    ck_assert_int_eq(nb_store_set(good, "keep", "me", 2), NB_OK);

    struct {
        const char *what;
        uint8_t bytes[32];
        size_t n;
        bool hello;
    } cases[] = {
        {"oversized length", {0xff, 0xff, 0xff, 0xff, 1}, 5, false},
        {"first message not HELLO", {6, 0, 0, 0, NB__OP_DELETE, 1, 0, 0, 0, 'k'}, 10, false},
        {"unknown operation", {1, 0, 0, 0, 0x77}, 5, true},
        {"field past the end", {9, 0, 0, 0, NB__OP_SET, 0xe8, 3, 0, 0, 'k', 'k', 'k', 'k'}, 13, true},
        {"bytes left over", {11, 0, 0, 0, NB__OP_DELETE, 1, 0, 0, 0, 'k', 9, 9, 9, 9, 9}, 15, true},
        {"empty key", {5, 0, 0, 0, NB__OP_DELETE, 0, 0, 0, 0}, 9, true},
        {"zero keys", {13, 0, 0, 0, NB__OP_WAIT, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}, 17, true},
        {"negative timeout", {14, 0, 0, 0, NB__OP_GET, 1, 0, 0, 0, 'k', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, 18, true},
        {"second HELLO", {1, 0, 0, 0, NB__OP_HELLO}, 5, true},
    };
    for (unsigned i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int fd = nbt_loopback_connect(port);
        if (cases[i].hello) raw_hello(fd, -1);
        raw_send(fd, cases[i].bytes, cases[i].n);
        assert_closed(fd, cases[i].what);
        /* the store and the other connection carry on */
        char *v = get_str(good, "keep");
        ck_assert_str_eq(v, "me");
        free(v);
    }
    /* half a frame, then hanging up */
    int fd = nbt_loopback_connect(port);
    raw_hello(fd, -1);
    raw_send(fd, (uint8_t[]){50, 0, 0, 0, NB__OP_SET, 1}, 6);
    close(fd);
    ck_assert_int_eq(nb_store_set(good, "still", "ok", 2), NB_OK);
    /* none of them was a rank: the run was not aborted */
    void *v = NULL;
    ck_assert_int_eq(nb_store_get(good, NB__STORE_ABORT_KEY, 0, &v, NULL), NB_ERR_NOT_FOUND);
    nb_store_close(good);
    nb_store_server_stop(server);
}
END_TEST

typedef struct waiter {
    nb_store *s;
    nb_status st;
    char msg[1024];
} waiter;

static void *wait_forever(void *arg) {
    waiter *w = arg;
    void *v = NULL;
    w->st = nb_store_get(w->s, "never", 60, &v, NULL);
    snprintf(w->msg, sizeof w->msg, "%s", nb_last_error());
    return NULL;
}

/* A rank's connection dropping without goodbye aborts the run: parked
 * waits fail at once with the reason, and so do later ones. */
START_TEST(test_rank_that_dies_aborts_waits) {
    start("run-a");
    nb_store *s0 = client(0);
    waiter w = {client(-1), NB_OK, ""};
    pthread_t th;
    pthread_create(&th, NULL, wait_forever, &w);
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    int fd = nbt_loopback_connect(port);
    raw_hello(fd, 3);
    close(fd); /* rank 3 "dies" */
    pthread_join(th, NULL);
    ck_assert_int_eq(w.st, NB_ERR_CLOSED);
    ck_assert_msg(strstr(w.msg, "nb_store_get: the run was aborted: rank 3 disconnected from the store without "
                                "saying goodbye: its process exited or was killed"),
                  "%s", w.msg);
    const char *keys[] = {"other"};
    NBT_EXPECT_STATUS(nb_store_wait(s0, keys, 1, 60), NB_ERR_CLOSED, "rank 3 disconnected");
    /* what is there can still be read, including the reason */
    char *reason = get_str(s0, NB__STORE_ABORT_KEY);
    ck_assert(strstr(reason, "rank 3 disconnected") != NULL);
    free(reason);
    nb_store_close(w.s);
    nb_store_close(s0);
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_lost_server) {
    start("run-a");
    nb_store *s = client(-1);
    ck_assert_int_eq(nb_store_set(s, "k", "v", 1), NB_OK);
    nb_store_server_stop(server);
    void *v;
    NBT_EXPECT_STATUS(nb_store_get(s, "k", 1, &v, NULL), NB_ERR_CLOSED, "nb_store_get: lost the connection to the store at 127.0.0.1:");
    NBT_EXPECT_STATUS(nb_store_set(s, "k", "v", 1), NB_ERR_CLOSED, "nb_store_set: earlier, lost the connection to the store at 127.0.0.1:");
    nb_store_close(s);
}
END_TEST

/* A port held by a program that accepts connections but is not our store
 * (the kernel accepts into the backlog; nobody answers): the greeting
 * goes unanswered for the liveness limit, and the message says why. */
START_TEST(test_port_held_by_another_program) {
    setenv("NABLA_LIVENESS_TIMEOUT", "0.5", 1);
    int gai = 0, err = 0;
    int fd = nb__tcp_listen("127.0.0.1", 0, &gai, &err);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a;
    socklen_t sl = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &sl);
    int held = ntohs(a.sin_port);
    nb_store *s = NULL;
    double t0 = nb__now();
    nb_status st = nb_store_connect(&s, "127.0.0.1", held, "run-a", 1, 30);
    double took = nb__now() - t0;
    ck_assert_int_eq(st, NB_ERR_TIMEOUT);
    char want[256];
    snprintf(want, sizeof want, "the store at 127.0.0.1:%d accepted the connection but did not answer its "
             "greeting within 0.5 s", held);
    ck_assert_msg(strstr(nb_last_error(), want), "%s", nb_last_error());
    ck_assert_msg(strstr(nb_last_error(), "is stopped or overloaded (its stderr says how many connections"),
                  "%s", nb_last_error());
    ck_assert_msg(strstr(nb_last_error(), "or another program holds MASTER_PORT"), "%s", nb_last_error());
    ck_assert_msg(took < 10, "took %.1f s (liveness 0.5 s, connect timeout 30 s)", took);
    /* Rank 0 cannot serve on it and says so. */
    nb_store_server *srv = NULL;
    NBT_EXPECT_STATUS(nb_store_server_start(&srv, "127.0.0.1", held, "run-a"), NB_ERR_NETWORK,
               "another program holds the port (MASTER_PORT)");
    close(fd);
}
END_TEST

NBT_MAIN("dist_store", "store", 0,
         test_set_get_delete, test_waits, test_add_and_compare_set, test_argument_limits, test_run_ids_and_ranks,
         test_malformed_messages_close_only_their_connection, test_rank_that_dies_aborts_waits, test_lost_server,
         test_port_held_by_another_program)
