/* Who may use the store (Note [Store authentication]): refusals that never
 * repeat the store's run id, the secret's challenge and response (right,
 * wrong, missing, replayed, never sent in clear, and the store's own
 * proof), ranks inside the world and held once, departures that abort the
 * run only for admitted ranks, the limits before admission (frame size,
 * deadline, pending connections) and after (value size, total bytes), the
 * loopback rule for a store without a secret (and a one-node world's
 * store on a Unix-domain socket, or on loopback with
 * NABLA_STORE_TRANSPORT=tcp, whatever MASTER_ADDR says: its folder's rules,
 * a stale socket file, a closed greeting), and where the secret comes
 * from. Other users are kept out in test_dist_store_uid. Servers run in this process on 127.0.0.1; raw sockets play the
 * clients the library would not be. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "distributed/internal.h"
#include "testutil.h"

#define RUN_ID "run-7c1e4f09a2d3"
static const char SECRET[] = "0123456789abcdef-the-run-secret";

static nb_store_server *server;
static int port;

static void start_cfg(const nb__store_config *cfg) {
    nb_status st = nb__store_server_start(&server, "127.0.0.1", 0, -1, cfg);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    port = nb_store_server_port(server);
}

static nb__store_config secret_cfg(int world) {
    nb__store_config cfg = {.run_id = RUN_ID, .secret = (const uint8_t *)SECRET,
                            .secret_len = strlen(SECRET), .world_size = world};
    return cfg;
}

static nb_store *client_with(const char *secret, int rank) {
    nb__store_config cfg = {.run_id = RUN_ID, .secret = (const uint8_t *)secret,
                            .secret_len = secret ? strlen(secret) : 0};
    nb_store *s = NULL;
    nb_status st = nb__store_connect(&s, "127.0.0.1", port, &cfg, rank, 5.0);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    return s;
}

/* ---- raw clients ---- */

static void raw_send(int fd, const void *p, size_t n) {
    ck_assert_int_eq(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

static void send_hello(int fd, const char *run_id, int rank, const uint8_t *nonce) {
    nb__buf b = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_HELLO);
    nb__buf_u32(&b, NB__STORE_MAGIC);
    nb__buf_bytes(&b, run_id, strlen(run_id));
    nb__buf_i64(&b, rank);
    nb__buf_bytes(&b, nonce, NB__STORE_NONCE_LEN);
    nb__buf_frame_end(&b, f);
    raw_send(fd, b.p, b.n);
    nb__buf_free(&b);
}

static void send_auth(int fd, const uint8_t *mac) {
    nb__buf b = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_AUTH);
    nb__buf_bytes(&b, mac, NB__STORE_MAC_LEN);
    nb__buf_frame_end(&b, f);
    raw_send(fd, b.p, b.n);
    nb__buf_free(&b);
}

/* One reply frame body (malloc'd, *n bytes); NULL when the server closed. */
static uint8_t *read_frame(int fd, size_t *n) {
    uint8_t hdr[4];
    ssize_t got = recv(fd, hdr, 4, MSG_WAITALL);
    if (got != 4) return NULL;
    uint32_t len = nb__store_frame_len(hdr);
    uint8_t *body = malloc(len + 1);
    ck_assert_int_eq(recv(fd, body, len, MSG_WAITALL), (ssize_t)len);
    body[len] = 0;
    *n = len;
    return body;
}

/* The server closed this connection (end of stream, after what it said). */
static void assert_closed(int fd, const char *what) {
    uint8_t b[1024];
    ssize_t got;
    while ((got = recv(fd, b, sizeof b, 0)) > 0) {}
    ck_assert_msg(got == 0, "%s: the connection was not closed (recv %zd)", what, got);
    close(fd);
}

static bool contains(const uint8_t *p, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(p + i, needle, k) == 0) return true;
    return false;
}

/* The run is not aborted: nb/abort is absent. */
static void assert_not_aborted(nb_store *s) {
    void *v = NULL;
    nb_status st = nb_store_get(s, NB__STORE_ABORT_KEY, 0, &v, NULL);
    ck_assert_msg(st == NB_ERR_NOT_FOUND, "the run was aborted: %s", v ? (char *)v : nb_last_error());
}

static void pause_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---- tests ---- */

START_TEST(test_refusal_never_echoes_the_run_id) {
    nb__store_config plain = {.run_id = RUN_ID};
    start_cfg(&plain);
    uint8_t nonce[NB__STORE_NONCE_LEN] = {1};
    const char *guesses[] = {"run-b", "", "run-7c1e4f09a2d", "default"};
    for (unsigned i = 0; i < sizeof guesses / sizeof guesses[0]; i++) {
        int fd = nbt_loopback_connect(port);
        send_hello(fd, guesses[i], 0, nonce);
        size_t n = 0;
        uint8_t *r = read_frame(fd, &n);
        ck_assert_ptr_nonnull(r);
        ck_assert_int_eq(r[0], NB__R_ERROR);
        ck_assert_msg(!contains(r, n, RUN_ID), "the refusal of '%s' shows the run id: %.*s", guesses[i],
                      (int)n - 1, r + 1);
        ck_assert_msg(contains(r, n, "this store serves another run"), "%.*s", (int)n - 1, r + 1);
        free(r);
        assert_closed(fd, guesses[i]);
    }
    /* and through the client library */
    nb_store *s = NULL;
    NBT_EXPECT_STATUS(nb_store_connect(&s, "127.0.0.1", port, "run-b", -1, 5), NB_ERR_MISMATCH,
               "the process is of run 'run-b' but this store serves another run");
    ck_assert_msg(strstr(nb_last_error(), RUN_ID) == NULL, "%s", nb_last_error());
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_secret_right_wrong_missing) {
    nb__store_config cfg = secret_cfg(2);
    start_cfg(&cfg);
    nb_store *good = client_with(SECRET, 0);
    ck_assert_int_eq(nb_store_set(good, "k", "v", 1), NB_OK);
    nb_store *s = NULL;
    nb__store_config wrong = {.run_id = RUN_ID, .secret = (const uint8_t *)"0123456789abcdef-another-secret",
                              .secret_len = 31};
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &wrong, 1, 5), NB_ERR_MISMATCH,
               "refused rank 1: the process did not prove that it knows this run's secret");
    ck_assert_ptr_null(s);
    nb__store_config none = {.run_id = RUN_ID};
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &none, 1, 5), NB_ERR_MISMATCH,
               "asks for the run's secret, and this process has none");
    /* none of them became rank 1: the rank is still free, and nothing was aborted */
    nb_store *r1 = client_with(SECRET, 1);
    assert_not_aborted(good);
    nb_store_close(r1);
    nb_store_close(good);
    nb_store_server_stop(server);

    /* a client with a secret does not trust a store that asks for none */
    nb__store_config plain = {.run_id = RUN_ID};
    start_cfg(&plain);
    nb__store_config mine = secret_cfg(0);
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &mine, 0, 5), NB_ERR_MISMATCH,
               "admitted this process without asking for the run's secret");
    nb_store_server_stop(server);
}
END_TEST

/* A proof is good for its own connection only: the server's nonce is new
 * each time, so a proof seen on the wire cannot be replayed. */
START_TEST(test_proof_cannot_be_replayed) {
    nb__store_config cfg = secret_cfg(4);
    start_cfg(&cfg);
    uint8_t cnonce[NB__STORE_NONCE_LEN];
    memset(cnonce, 7, sizeof cnonce);
    uint8_t seen[NB__STORE_MAC_LEN];
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = nbt_loopback_connect(port);
        send_hello(fd, RUN_ID, 2, cnonce);
        size_t n = 0;
        uint8_t *r = read_frame(fd, &n);
        ck_assert_ptr_nonnull(r);
        ck_assert_int_eq(r[0], NB__R_CHALLENGE);
        ck_assert_uint_eq(n, 1 + 4 + NB__STORE_NONCE_LEN);
        if (attempt == 0) {
            uint8_t snonce[NB__STORE_NONCE_LEN];
            memcpy(snonce, r + 5, sizeof snonce);
            nb__store_mac((const uint8_t *)SECRET, strlen(SECRET), "nabla store client", cnonce, snonce,
                          RUN_ID, 2, seen);
            send_auth(fd, seen);
            free(r);
            r = read_frame(fd, &n);
            ck_assert_ptr_nonnull(r);
            ck_assert_msg(r[0] == NB__R_OK, "a right proof was refused: %.*s", (int)n - 1, r + 1);
            /* the store proves the secret in turn, with a proof of its own */
            uint8_t theirs[NB__STORE_MAC_LEN];
            nb__store_mac((const uint8_t *)SECRET, strlen(SECRET), "nabla store server", cnonce,
                          snonce, RUN_ID, 2, theirs);
            ck_assert_uint_eq(n, 1 + 4 + NB__STORE_MAC_LEN);
            ck_assert(memcmp(theirs, r + 5, NB__STORE_MAC_LEN) == 0);
            ck_assert(memcmp(seen, r + 5, NB__STORE_MAC_LEN) != 0);
            free(r);
            /* rank 2 says goodbye so that the replay could take the rank */
            uint8_t bye[5] = {1, 0, 0, 0, NB__OP_BYE};
            raw_send(fd, bye, sizeof bye);
            r = read_frame(fd, &n);
            free(r);
            close(fd);
        } else {
            send_auth(fd, seen); /* the proof of the first connection */
            free(r);
            r = read_frame(fd, &n);
            ck_assert_ptr_nonnull(r);
            ck_assert_int_eq(r[0], NB__R_ERROR);
            ck_assert(contains(r, n, "did not prove that it knows this run's secret"));
            free(r);
            assert_closed(fd, "replayed proof");
        }
    }
    nb_store_server_stop(server);
}
END_TEST

/* A fake store on a plain socket: it records what the client sends and
 * answers with a challenge, then a wrong proof of its own. */
typedef struct fake {
    int listen_fd;
    uint8_t got[4096];
    size_t n;
} fake;

static void *fake_store(void *arg) {
    fake *f = arg;
    int fd = accept(f->listen_fd, NULL, NULL);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (int step = 0; step < 2; step++) {
        uint8_t hdr[4];
        if (recv(fd, hdr, 4, MSG_WAITALL) != 4) break;
        uint32_t len = nb__store_frame_len(hdr);
        if (len > sizeof f->got - f->n - 4) break;
        memcpy(f->got + f->n, hdr, 4);
        if (recv(fd, f->got + f->n + 4, len, MSG_WAITALL) != (ssize_t)len) break;
        f->n += 4 + len;
        nb__buf b = {0};
        size_t s = nb__buf_frame_begin(&b);
        uint8_t junk[32];
        memset(junk, step ? 0x5a : 0x11, sizeof junk);
        nb__buf_u8(&b, step == 0 ? NB__R_CHALLENGE : NB__R_OK);
        nb__buf_bytes(&b, junk, sizeof junk);
        nb__buf_frame_end(&b, s);
        send(fd, b.p, b.n, MSG_NOSIGNAL);
        nb__buf_free(&b);
    }
    pause_s(0.2);
    close(fd);
    return NULL;
}

START_TEST(test_secret_never_sent_and_store_must_prove_it) {
    int gai = 0, err = 0;
    fake f = {.listen_fd = nb__tcp_listen("127.0.0.1", 0, &gai, &err)};
    ck_assert_int_ge(f.listen_fd, 0);
    struct sockaddr_in a;
    socklen_t sl = sizeof a;
    getsockname(f.listen_fd, (struct sockaddr *)&a, &sl);
    port = ntohs(a.sin_port);
    pthread_t th;
    pthread_create(&th, NULL, fake_store, &f);
    nb__store_config cfg = secret_cfg(0);
    nb_store *s = NULL;
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &cfg, 0, 5), NB_ERR_MISMATCH,
               "did not prove that it knows the run's secret: is another program answering on MASTER_PORT?");
    pthread_join(th, NULL);
    close(f.listen_fd);
    /* it saw a HELLO and an AUTH, and neither holds the secret or a piece of it */
    ck_assert_uint_gt(f.n, 2 * 4 + NB__STORE_MAC_LEN);
    ck_assert_int_eq(f.got[4], NB__OP_HELLO);
    char piece[9];
    for (size_t i = 0; i + 8 <= strlen(SECRET); i++) {
        memcpy(piece, SECRET + i, 8);
        piece[8] = 0;
        ck_assert_msg(!contains(f.got, f.n, piece), "the client sent '%s' of the secret", piece);
    }
}
END_TEST

START_TEST(test_ranks_inside_the_world_and_held_once) {
    nb__store_config cfg = secret_cfg(2);
    start_cfg(&cfg);
    nb_store *watch = client_with(SECRET, -1);
    nb_store *s = NULL;
    nb__store_config mine = secret_cfg(0);
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &mine, 7, 5), NB_ERR_MISMATCH,
               "refused rank 7: rank 7 is not a rank of this run, whose ranks are 0 to 1");
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &mine, 2, 5), NB_ERR_MISMATCH,
               "rank 2 is not a rank of this run");
    nb_store *r1 = client_with(SECRET, 1);
    NBT_EXPECT_STATUS(nb__store_connect(&s, "127.0.0.1", port, &mine, 1, 5), NB_ERR_MISMATCH,
               "rank 1 is already connected to this store");
    /* refused clients hung up: nothing happened to the run */
    pause_s(0.1);
    assert_not_aborted(watch);

    /* a client that claims rank 0 but never proves the secret, then hangs up */
    int fd = nbt_loopback_connect(port);
    uint8_t nonce[NB__STORE_NONCE_LEN] = {3};
    send_hello(fd, RUN_ID, 0, nonce);
    size_t n;
    uint8_t *r = read_frame(fd, &n);
    ck_assert_int_eq(r[0], NB__R_CHALLENGE);
    free(r);
    close(fd);
    /* one that answers with a wrong proof for rank 0, then hangs up */
    fd = nbt_loopback_connect(port);
    send_hello(fd, RUN_ID, 0, nonce);
    r = read_frame(fd, &n);
    free(r);
    uint8_t bad[NB__STORE_MAC_LEN] = {0};
    send_auth(fd, bad);
    r = read_frame(fd, &n);
    ck_assert_int_eq(r[0], NB__R_ERROR);
    free(r);
    close(fd);
    pause_s(0.1);
    assert_not_aborted(watch);
    /* rank 0 is still free for the real one */
    nb_store *r0 = client_with(SECRET, 0);

    /* ranks that say goodbye abort nothing; an admitted rank that hangs up
     * without it does (the control): a raw rank 1 takes the place of the
     * one that left cleanly, and dies */
    nb_store_close(r0);
    nb_store_close(r1);
    fd = nbt_loopback_connect(port);
    uint8_t cn[NB__STORE_NONCE_LEN] = {9};
    send_hello(fd, RUN_ID, 1, cn);
    r = read_frame(fd, &n);
    ck_assert_int_eq(r[0], NB__R_CHALLENGE);
    uint8_t mac[NB__STORE_MAC_LEN];
    nb__store_mac((const uint8_t *)SECRET, strlen(SECRET), "nabla store client", cn, r + 5, RUN_ID, 1, mac);
    free(r);
    send_auth(fd, mac);
    r = read_frame(fd, &n);
    ck_assert_int_eq(r[0], NB__R_OK);
    free(r);
    close(fd);
    const char *keys[] = {"never"};
    NBT_EXPECT_STATUS(nb_store_wait(watch, keys, 1, 10), NB_ERR_CLOSED,
               "the run was aborted: rank 1 disconnected from the store without saying goodbye");
    nb_store_close(watch);
    nb_store_server_stop(server);
}
END_TEST

static int count_fds(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    ck_assert_ptr_nonnull(d);
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

START_TEST(test_limits_before_admission) {
    nb__store_config cfg = secret_cfg(2);
    cfg.auth_timeout_s = 0.5;
    cfg.max_pending = 4;
    start_cfg(&cfg);
    nb_store *good = client_with(SECRET, 0);

    /* a frame over the small pre-admission limit: closed at once, unread */
    int fd = nbt_loopback_connect(port);
    uint8_t big[8] = {0x00, 0x00, 0x00, 0x01, NB__OP_HELLO}; /* 16 MiB announced */
    raw_send(fd, big, sizeof big);
    double t0 = nb__now();
    assert_closed(fd, "16 MiB frame before HELLO");
    ck_assert_msg(nb__now() - t0 < 0.4, "took %.2f s", nb__now() - t0);
    fd = nbt_loopback_connect(port);
    uint8_t medium[4] = {(NB__STORE_PREAUTH_MAX_FRAME + 1) & 0xff, (NB__STORE_PREAUTH_MAX_FRAME + 1) >> 8, 0, 0};
    raw_send(fd, medium, sizeof medium);
    assert_closed(fd, "a frame just over the limit");

    /* an idle connection and a slow one (a byte every 0.1 s) are closed at the deadline */
    int idle = nbt_loopback_connect(port);
    int slow = nbt_loopback_connect(port);
    t0 = nb__now();
    uint8_t nonce[NB__STORE_NONCE_LEN] = {0};
    nb__buf b = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_HELLO);
    nb__buf_u32(&b, NB__STORE_MAGIC);
    nb__buf_bytes(&b, RUN_ID, strlen(RUN_ID));
    nb__buf_i64(&b, 1);
    nb__buf_bytes(&b, nonce, sizeof nonce);
    nb__buf_frame_end(&b, f);
    size_t sent = 0;
    while (nb__now() - t0 < 1.5 && sent < b.n) {
        if (send(slow, b.p + sent, 1, MSG_NOSIGNAL) != 1) break;
        sent++;
        pause_s(0.1);
    }
    nb__buf_free(&b);
    ck_assert_uint_lt(sent, 20);
    size_t n = 0;
    uint8_t *r = read_frame(idle, &n);
    ck_assert_ptr_nonnull(r);
    ck_assert_msg(contains(r, n, "not admitted within 0.5 s of connecting"), "%.*s", (int)n - 1, r + 1);
    free(r);
    assert_closed(idle, "idle connection");
    assert_closed(slow, "slow connection");
    double took = nb__now() - t0;
    ck_assert_msg(took < 2.0, "closed after %.2f s (deadline 0.5 s)", took);

    /* at most 4 pending connections are held: 10 idle ones cost the server 4 descriptors */
    int before = count_fds();
    int idles[10];
    for (int i = 0; i < 10; i++) idles[i] = nbt_loopback_connect(port);
    pause_s(0.2);
    int held = count_fds() - before - 10;
    ck_assert_msg(held <= 4, "the server holds %d unauthenticated connections (cap 4)", held);
    ck_assert_msg(held >= 1, "the server accepted none (%d)", held);
    /* a real client still gets in, once the idle ones' deadlines pass */
    t0 = nb__now();
    nb_store *r1 = client_with(SECRET, 1);
    ck_assert_msg(nb__now() - t0 < 4.0, "admitted after %.2f s", nb__now() - t0);
    for (int i = 0; i < 10; i++) close(idles[i]);
    assert_not_aborted(good);
    nb_store_close(r1);
    nb_store_close(good);
    nb_store_server_stop(server);
}
END_TEST

/* Note [Admission under a flood]: 300 idle connections from this host
 * (over the per-source quota, 64) cost the server at most 64 descriptors,
 * the oldest are told why they are closed, a rank still gets in at once
 * (before, it waited in the backlog behind them past its deadline), and
 * the store can say what it saw. */
START_TEST(test_flood_cannot_starve_ranks) {
    nb__store_config cfg = secret_cfg(2);
    start_cfg(&cfg);
    int before = count_fds();
    enum { FLOOD = 300 };
    static int idles[FLOOD];
    for (int i = 0; i < FLOOD; i++) idles[i] = nbt_loopback_connect(port);
    pause_s(0.3);
    int held = count_fds() - before - FLOOD;
    ck_assert_msg(held <= NB__STORE_SOURCE_QUOTA, "the server holds %d unproven connections from one source (quota %d)",
                  held, NB__STORE_SOURCE_QUOTA);
    double t0 = nb__now();
    nb_store *r0 = client_with(SECRET, 0);
    double took = nb__now() - t0;
    ck_assert_msg(took < 1.0, "a rank was admitted %.2f s after 300 idle connections", took);
    size_t n = 0;
    uint8_t *r = read_frame(idles[0], &n);
    ck_assert_ptr_nonnull(r);
    ck_assert_msg(contains(r, n, NB__STORE_DROPPED ": the store holds 65 connections that have not proved they "
                                 "belong to the run from 127.0.0.1"), "%.*s", (int)n - 1, r + 1);
    free(r);
    char seen[800];
    ck_assert_int_eq(nb__store_server_unproven(server, seen, sizeof seen), 1);
    ck_assert_msg(strstr(seen, "connections that never proved they belong to the run (up to 65 at once; lately "
                               "from 127.0.0.1 ("), "%s", seen);
    for (int i = 0; i < FLOOD; i++) close(idles[i]);
    nb_store *r1 = client_with(SECRET, 1);
    nb_store_close(r1);
    nb_store_close(r0);
    nb_store_server_stop(server);
}
END_TEST

/* Note [Stale greetings]: a HELLO whose sender hung up before the store
 * read it admits nothing: the rank's place stays free and the run goes on. */
START_TEST(test_closed_greeting_never_admitted) {
    /* greetings sent and closed before the store reads them: queued on the
     * listening socket before the server starts on it */
    int gai = 0, err = 0;
    int lfd = nb__tcp_listen("127.0.0.1", 0, &gai, &err);
    ck_assert_int_ge(lfd, 0);
    struct sockaddr_in a;
    socklen_t sl = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &sl);
    for (int i = 0; i < 5; i++) {
        int fd = nbt_loopback_connect(ntohs(a.sin_port));
        uint8_t cn[NB__STORE_NONCE_LEN] = {(uint8_t)i};
        send_hello(fd, RUN_ID, 1, cn);
        close(fd);
    }
    nb__store_config cfg = {.run_id = RUN_ID, .world_size = 2};
    ck_assert_int_eq(nb__store_server_start(&server, NULL, 0, lfd, &cfg), NB_OK);
    port = nb_store_server_port(server);
    pause_s(0.3);
    nb_store *r0 = client_with(NULL, 0);
    assert_not_aborted(r0);
    nb_store *r1 = client_with(NULL, 1); /* not "rank 1 is already connected" */
    assert_not_aborted(r0);
    nb_store_close(r1);
    nb_store_close(r0);
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_limits_after_admission) {
    nb__store_config cfg = secret_cfg(1);
    cfg.max_bytes = 1 << 20;
    start_cfg(&cfg);
    nb_store *s = client_with(SECRET, 0);
    size_t half = 600 * 1024;
    char *v = calloc(1, half);
    ck_assert_int_eq(nb_store_set(s, "first", v, half), NB_OK);
    NBT_EXPECT_STATUS(nb_store_set(s, "second", v, half), NB_ERR_INVALID,
               "set 'second': a value of 614400 bytes would take the store to 1228811 bytes of keys "
               "and values, over its limit of 1048576 bytes");
    ck_assert_int_eq(nb_store_set(s, "first", v, 10), NB_OK); /* room again */
    ck_assert_int_eq(nb_store_set(s, "second", v, half), NB_OK);
    ck_assert_uint_eq(nb__kv_bytes(nb__store_core_kv(server)), 5 + 10 + 6 + half);
    NBT_EXPECT_STATUS(nb_store_compare_set(s, "third", NULL, 0, v, half, NULL, NULL), NB_ERR_INVALID,
               "compare_set 'third': a value of 614400 bytes would take the store");
    /* a quiet set over the limit: the next call says which key and why */
    ck_assert_int_eq(nb__store_set_quiet(s, "quiet", v, half), NB_OK);
    void *got = NULL;
    NBT_EXPECT_STATUS(nb_store_get(s, "first", 0, &got, NULL), NB_ERR_INVALID, "set 'quiet': a value of 614400 bytes");
    nb_store_close(s);
    free(v);

    /* a value over NB_STORE_MAX_VALUE in a frame the server reads: refused by name */
    int fd = nbt_loopback_connect(port);
    uint8_t cn[NB__STORE_NONCE_LEN] = {5};
    send_hello(fd, RUN_ID, -1, cn);
    size_t n;
    uint8_t *r = read_frame(fd, &n);
    uint8_t mac[NB__STORE_MAC_LEN];
    nb__store_mac((const uint8_t *)SECRET, strlen(SECRET), "nabla store client", cn, r + 5, RUN_ID, -1, mac);
    free(r);
    send_auth(fd, mac);
    r = read_frame(fd, &n);
    ck_assert_int_eq(r[0], NB__R_OK);
    free(r);
    nb__buf b = {0};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_SET);
    nb__buf_bytes(&b, "huge", 4);
    uint32_t vlen = NB_STORE_MAX_VALUE + 1;
    char *hv = calloc(1, vlen);
    nb__buf_bytes(&b, hv, vlen);
    free(hv);
    nb__buf_frame_end(&b, f);
    ck_assert_uint_le(b.n - 4, NB_STORE_MAX_MESSAGE);
    raw_send(fd, b.p, b.n);
    nb__buf_free(&b);
    r = read_frame(fd, &n);
    ck_assert_ptr_nonnull(r);
    ck_assert_int_eq(r[0], NB__R_ERROR);
    ck_assert_msg(contains(r, n, "set 'huge': a value of 16777217 bytes is over the store's limit of "
                                 "16777216 bytes per value (NB_STORE_MAX_VALUE)"),
                  "%.*s", (int)n - 1, r + 1);
    free(r);
    close(fd);
    nb_store_server_stop(server);
}
END_TEST

START_TEST(test_no_secret_means_loopback) {
    unsetenv("NABLA_STORE_TRUSTED_NETWORK");
    nb_store_server *s = NULL;
    NBT_EXPECT_STATUS(nb_store_server_start(&s, "0.0.0.0", 0, RUN_ID), NB_ERR_INVALID,
               "the store would listen on 0.0.0.0:");
    ck_assert_msg(strstr(nb_last_error(), "beyond this host, without a secret") &&
                      strstr(nb_last_error(), "NABLA_STORE_TRUSTED_NETWORK=1"),
                  "%s", nb_last_error());
    NBT_EXPECT_STATUS(nb_store_server_start(&s, NULL, 0, RUN_ID), NB_ERR_INVALID, "without a secret");
    /* nbrun's socket on every interface, adopted without a secret: refused too */
    int gai = 0, err = 0;
    int lfd = nb__tcp_listen(NULL, 0, &gai, &err);
    ck_assert_int_ge(lfd, 0);
    nb__store_config plain = {.run_id = RUN_ID};
    NBT_EXPECT_STATUS(nb__store_server_start(&s, NULL, 0, lfd, &plain), NB_ERR_INVALID, "without a secret");
    /* loopback, a secret, or a network declared trusted: served */
    ck_assert_int_eq(nb_store_server_start(&s, "127.0.0.1", 0, RUN_ID), NB_OK);
    nb_store_server_stop(s);
    nb__store_config cfg = secret_cfg(0);
    ck_assert_int_eq(nb__store_server_start(&s, "0.0.0.0", 0, -1, &cfg), NB_OK);
    nb_store_server_stop(s);
    setenv("NABLA_STORE_TRUSTED_NETWORK", "1", 1);
    ck_assert_int_eq(nb_store_server_start(&s, "0.0.0.0", 0, RUN_ID), NB_OK);
    nb_store_server_stop(s);
    unsetenv("NABLA_STORE_TRUSTED_NETWORK");
}
END_TEST

static void clear_secret_env(void) {
    unsetenv("NABLA_STORE_SECRET_FD");
    unsetenv("NABLA_STORE_SECRET_FILE");
    unsetenv("NABLA_STORE_SECRET");
}

START_TEST(test_secret_from_the_environment) {
    clear_secret_env();
    nb__store_secret sec;
    ck_assert_int_eq(nb__store_secret_from_env(&sec), NB_OK);
    ck_assert_uint_eq(sec.len, 0);

    char path[] = "/tmp/nabla-secret-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    const char text[] = "fedcba9876543210fedcba\n"; /* the newline is not part of it */
    ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    setenv("NABLA_STORE_SECRET_FILE", path, 1);
    chmod(path, 0644);
    NBT_EXPECT_STATUS(nb__store_secret_from_env(&sec), NB_ERR_INVALID, "may be read by other users (mode 0644)");
    chmod(path, 0600);
    ck_assert_int_eq(nb__store_secret_from_env(&sec), NB_OK);
    ck_assert_uint_eq(sec.len, 22);
    ck_assert(memcmp(sec.bytes, "fedcba9876543210fedcba", 22) == 0);
    unlink(path);
    NBT_EXPECT_STATUS(nb__store_secret_from_env(&sec), NB_ERR_IO, "cannot open the store's secret");
    unsetenv("NABLA_STORE_SECRET_FILE");

    setenv("NABLA_STORE_SECRET", "short", 1);
    NBT_EXPECT_STATUS(nb__store_secret_from_env(&sec), NB_ERR_INVALID,
               "the store's secret from NABLA_STORE_SECRET has 5 bytes; it needs 16 to 1024");
    setenv("NABLA_STORE_SECRET", "long enough, as a value", 1);
    ck_assert_int_eq(nb__store_secret_from_env(&sec), NB_OK);
    ck_assert_uint_eq(sec.len, 23);

    /* nbrun's descriptor wins, is read once, closed, and its variable removed */
    int mfd = memfd_create("test-secret", MFD_CLOEXEC);
    ck_assert_int_ge(mfd, 0);
    ck_assert_int_eq(write(mfd, "0123456789abcdef0123456789abcdef", 32), 32);
    char num[16];
    snprintf(num, sizeof num, "%d", mfd);
    setenv("NABLA_STORE_SECRET_FD", num, 1);
    ck_assert_int_eq(nb__store_secret_from_env(&sec), NB_OK);
    ck_assert_uint_eq(sec.len, 32);
    ck_assert_ptr_null(getenv("NABLA_STORE_SECRET_FD"));
    ck_assert_int_eq(fcntl(mfd, F_GETFD), -1); /* closed */
    memset(&sec, 0, sizeof sec);
    ck_assert_int_eq(nb__store_secret_from_env(&sec), NB_OK); /* the kept copy */
    ck_assert_uint_eq(sec.len, 32);
    ck_assert(memcmp(sec.bytes, "0123456789abcdef0123456789abcdef", 32) == 0);
    clear_secret_env();
}
END_TEST

/* A world over several nodes without a secret stops at once on every rank;
 * the message says what to set. */
START_TEST(test_several_nodes_need_a_secret) {
    clear_secret_env();
    unsetenv("NABLA_STORE_TRUSTED_NETWORK");
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("LOCAL_RANK", "0", 1);
    setenv("LOCAL_WORLD_SIZE", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29411", 1);
    nb_pg *pg = NULL;
    nb_pg_options opts = {NB_PG_GLOO, 0};
    double t0 = nb__now();
    nb_status st = nb_pg_init(&pg, &opts);
    if (st == NB_ERR_UNSUPPORTED) {
        opts.backend = NB_PG_AUTO;
        st = nb_pg_init(&pg, &opts);
    }
    ck_assert_int_eq(st, NB_ERR_INVALID);
    ck_assert_msg(strstr(nb_last_error(), "nb_pg_init: a run over several nodes (WORLD_SIZE=2, "
                                          "LOCAL_WORLD_SIZE=1) needs the run's secret") &&
                      strstr(nb_last_error(), "NABLA_STORE_SECRET_FILE"),
                  "%s", nb_last_error());
    ck_assert_msg(nb__now() - t0 < 5, "took %.1f s", nb__now() - t0);
    ck_assert_ptr_null(pg);
}
END_TEST

/* Whether a socket listens on port, and on which IPv4 address
 * (/proc/net/tcp: local address as hex in host order, state 0A). */
static bool listening_on(int want_port, uint32_t *addr) {
    FILE *f = fopen("/proc/net/tcp", "r");
    ck_assert_ptr_nonnull(f);
    char line[512];
    bool found = false;
    while (fgets(line, sizeof line, f)) {
        unsigned a, p, st;
        if (sscanf(line, " %*d: %8x:%4x %*8x:%*4x %2x", &a, &p, &st) == 3 && st == 0x0A && (int)p == want_port) {
            *addr = a;
            found = true;
        }
    }
    fclose(f);
    return found;
}

/* A folder of mode 0700 under /tmp for the store's socket (NABLA_STORE_DIR). */
static void private_dir(char *dir, size_t len) {
    snprintf(dir, len, "/tmp/nbt-store-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    ck_assert_int_eq(chmod(dir, 0700), 0);
    setenv("NABLA_STORE_DIR", dir, 1);
}

static void one_node_env(int p) {
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", p);
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "1", 1);
    setenv("MASTER_ADDR", "0.0.0.0", 1); /* every interface, were it taken at its word */
    setenv("MASTER_PORT", port_s, 1);
    setenv("NABLA_RUN_ID", "one-node", 1);
}

/* Note [Store on one node]: a world on one node serves its store on a
 * Unix-domain socket named after MASTER_PORT in the user's folder, not on
 * TCP (even when MASTER_ADDR is not a loopback address), and removes the
 * file when it stops. */
START_TEST(test_one_node_serves_a_unix_socket) {
    clear_secret_env();
    unsetenv("NABLA_STORE_TRUSTED_NETWORK");
    unsetenv("NABLA_STORE_TRANSPORT");
    char dir[64], want[128];
    private_dir(dir, sizeof dir);
    int free_port = nbt_free_port();
    one_node_env(free_port);
    snprintf(want, sizeof want, "%s/store-%d.sock", dir, free_port);
    nb_pg *pg = NULL;
    nb_status st = nb_pg_init(&pg, NULL);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    uint32_t addr = 0;
    ck_assert_msg(!listening_on(free_port, &addr), "the store listens on TCP port %d", free_port);
    ck_assert_str_eq(nb__store_path(nb_pg_store(pg)), want);
    struct stat sb;
    ck_assert_int_eq(stat(want, &sb), 0);
    ck_assert(S_ISSOCK(sb.st_mode));
    ck_assert_int_eq(nb_pg_free(pg), NB_OK);
    ck_assert_msg(stat(want, &sb) != 0, "%s is left behind", want);
    rmdir(dir);
    unsetenv("NABLA_STORE_DIR");
}
END_TEST

/* MASTER_PORT=0 is a run of one process, and several start at once (a
 * test suite under ctest -j, a sweep): each serves its own socket,
 * store-0.<pid>.sock, instead of all refusing one another on store-0.sock.
 * Two processes hold a process group at port 0 at the same time. */
START_TEST(test_port0_runs_side_by_side) {
    clear_secret_env();
    unsetenv("NABLA_STORE_TRUSTED_NETWORK");
    unsetenv("NABLA_STORE_TRANSPORT");
    char dir[64];
    private_dir(dir, sizeof dir);
    one_node_env(0);
    pid_t kids[2];
    for (int k = 0; k < 2; k++) {
        kids[k] = fork();
        ck_assert_int_ge(kids[k], 0);
        if (kids[k] == 0) {
            nb_pg *pg = NULL;
            if (nb_pg_init(&pg, NULL) != NB_OK) {
                fprintf(stderr, "port 0, process %d: %s\n", k, nb_last_error());
                _exit(1);
            }
            char want[128];
            snprintf(want, sizeof want, "%s/store-0.%ld.sock", dir, (long)getpid());
            bool named = strcmp(nb__store_path(nb_pg_store(pg)), want) == 0;
            pause_s(1.0); /* both hold their store now */
            _exit(named && nb_pg_free(pg) == NB_OK ? 0 : 2);
        }
    }
    for (int k = 0; k < 2; k++) {
        int status = 0;
        ck_assert_int_eq(waitpid(kids[k], &status, 0), kids[k]);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                      "process %d of two at MASTER_PORT=0 ended with status %d (1: refused, 2: misnamed)", k,
                      WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    }
    rmdir(dir);
    unsetenv("NABLA_STORE_DIR");
}
END_TEST

/* NABLA_STORE_TRANSPORT=tcp keeps a one-node store on TCP loopback,
 * whatever MASTER_ADDR says; another value is refused. */
START_TEST(test_one_node_tcp_on_loopback) {
    clear_secret_env();
    unsetenv("NABLA_STORE_TRUSTED_NETWORK");
    int free_port = nbt_free_port();
    one_node_env(free_port);
    setenv("NABLA_STORE_TRANSPORT", "udp", 1);
    nb_pg *pg = NULL;
    NBT_EXPECT_STATUS(nb_pg_init(&pg, NULL), NB_ERR_INVALID, "NABLA_STORE_TRANSPORT='udp' is not auto or tcp");
    setenv("NABLA_STORE_TRANSPORT", "tcp", 1);
    nb_status st = nb_pg_init(&pg, NULL);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    uint32_t addr = 0;
    ck_assert_msg(listening_on(free_port, &addr), "nothing listens on port %d", free_port);
    ck_assert_msg(addr == 0x0100007Fu, "the store listens on %08x, not 127.0.0.1", addr);
    ck_assert_str_eq(nb__store_host(nb_pg_store(pg)), "127.0.0.1");
    ck_assert_str_eq(nb__store_path(nb_pg_store(pg)), "");
    ck_assert_int_eq(nb_pg_free(pg), NB_OK);
    unsetenv("NABLA_STORE_TRANSPORT");
}
END_TEST

/* The socket's folder must be a folder of this user closed to others; a
 * socket file left by a killed run is replaced, one a live store serves
 * is not. */
START_TEST(test_unix_socket_folder_and_stale_file) {
    char dir[64], p[128];
    private_dir(dir, sizeof dir);
    ck_assert_int_eq(chmod(dir, 0755), 0);
    NBT_EXPECT_STATUS(nb__store_unix_path(29200, p, sizeof p), NB_ERR_INVALID, "has mode 0755: other users may enter it");
    ck_assert_int_eq(chmod(dir, 0700), 0);
    char link[80];
    snprintf(link, sizeof link, "%s-link", dir);
    ck_assert_int_eq(symlink(dir, link), 0);
    setenv("NABLA_STORE_DIR", link, 1);
    NBT_EXPECT_STATUS(nb__store_unix_path(29200, p, sizeof p), NB_ERR_INVALID, "is not a folder (a link");
    unlink(link);
    setenv("NABLA_STORE_DIR", dir, 1);
    ck_assert_int_eq(nb__store_unix_path(29200, p, sizeof p), NB_OK);
    /* a stale file: bound, never accepted on, its listener gone */
    int err = 0;
    int fd = nb__store_unix_listen(p, &err);
    ck_assert_int_ge(fd, 0);
    close(fd);
    struct stat sb;
    ck_assert_int_eq(stat(p, &sb), 0);
    nb__store_config cfg = {.run_id = RUN_ID, .unix_path = p};
    ck_assert_int_eq(nb__store_server_start(&server, NULL, 29200, -1, &cfg), NB_OK);
    nb_store_server *other = NULL;
    NBT_EXPECT_STATUS(nb__store_server_start(&other, NULL, 29200, -1, &cfg), NB_ERR_NETWORK,
                      "a store of this user already serves");
    nb_store *c = NULL;
    ck_assert_int_eq(nb__store_connect(&c, NULL, 29200, &cfg, -1, 5.0), NB_OK);
    nb_store_close(c);
    nb_store_server_stop(server);
    ck_assert_msg(stat(p, &sb) != 0, "%s is left behind", p);
    /* a launcher's TCP socket where the ranks expect the Unix one: said, not a hang */
    int gai = 0;
    int tcp = nb__tcp_listen("127.0.0.1", 0, &gai, &err);
    NBT_EXPECT_STATUS(nb__store_server_start(&server, NULL, 0, tcp, &cfg), NB_ERR_INVALID,
                      "is not the Unix-domain socket");
    rmdir(dir);
    unsetenv("NABLA_STORE_DIR");
}
END_TEST

/* Note [Stale greetings] over the Unix-domain socket too. */
START_TEST(test_closed_greeting_never_admitted_unix) {
    char dir[64], p[100];
    private_dir(dir, sizeof dir);
    ck_assert_int_eq(nb__store_unix_path(29201, p, sizeof p), NB_OK);
    int err = 0;
    int lfd = nb__store_unix_listen(p, &err);
    ck_assert_int_ge(lfd, 0);
    for (int i = 0; i < 5; i++) {
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        snprintf(a.sun_path, sizeof a.sun_path, "%s", p);
        ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
        uint8_t cn[NB__STORE_NONCE_LEN] = {(uint8_t)i};
        send_hello(fd, RUN_ID, 1, cn);
        close(fd);
    }
    nb__store_config cfg = {.run_id = RUN_ID, .world_size = 2, .unix_path = p};
    ck_assert_int_eq(nb__store_server_start(&server, NULL, 29201, lfd, &cfg), NB_OK);
    pause_s(0.3);
    nb_store *r0 = NULL, *r1 = NULL;
    ck_assert_int_eq(nb__store_connect(&r0, NULL, 29201, &cfg, 0, 5.0), NB_OK);
    assert_not_aborted(r0);
    nb_status st = nb__store_connect(&r1, NULL, 29201, &cfg, 1, 5.0); /* not "rank 1 is already connected" */
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    assert_not_aborted(r0);
    nb_store_close(r1);
    nb_store_close(r0);
    nb_store_server_stop(server);
    rmdir(dir);
    unsetenv("NABLA_STORE_DIR");
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_refusal_never_echoes_the_run_id, test_secret_right_wrong_missing,
                             test_proof_cannot_be_replayed, test_secret_never_sent_and_store_must_prove_it,
                             test_ranks_inside_the_world_and_held_once, test_limits_before_admission,
                             test_limits_after_admission, test_flood_cannot_starve_ranks,
                             test_closed_greeting_never_admitted, test_no_secret_means_loopback,
                             test_secret_from_the_environment, test_several_nodes_need_a_secret,
                             test_one_node_serves_a_unix_socket, test_one_node_tcp_on_loopback,
                             test_unix_socket_folder_and_stale_file, test_closed_greeting_never_admitted_unix,
                             test_port0_runs_side_by_side,
                             NULL};
    return nbt_suite("dist_store_auth", "auth", 60, tests);
}

int main(void) { return nbt_run(suite()); }
