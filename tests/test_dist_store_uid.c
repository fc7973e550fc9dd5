/* A store on one node refuses other users (Note [Store on one node] in
 * distributed/store_unix.c), at both layers: a process of another uid
 * cannot reach the socket in the user's 0700 folder (EACCES), and, when
 * it can (a folder made open for the test), the server refuses it on its
 * SO_PEERCRED uid before reading its greeting, while a rank of the right
 * uid is still admitted. The client refuses a socket another user serves,
 * and the folder rules refuse a folder of another user's. The other
 * process is a child that drops to an unused uid (65534), which needs
 * root: as another user the whole suite is skipped (77), never passed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "distributed/internal.h"
#include "testutil.h"

#define RUN_ID "run-uid-5b7e"
#define OTHER_UID 65534

/* child exit codes */
enum { CHILD_REFUSED = 10, CHILD_EACCES = 11, CHILD_CONNECTED = 12, CHILD_ADMITTED = 13, CHILD_OTHER = 14,
       CHILD_NO_UID = 15 };

static char dir[64], path[100];

/* A fresh folder of mode `mode` under /tmp, set as NABLA_STORE_DIR. */
static void make_dir(mode_t mode) {
    snprintf(dir, sizeof dir, "/tmp/nbt-uid-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    ck_assert_int_eq(chmod(dir, mode), 0);
    setenv("NABLA_STORE_DIR", dir, 1);
}

static void drop_to_other_uid(void) {
    if (setgroups(0, NULL) != 0 || setgid(OTHER_UID) != 0 || setuid(OTHER_UID) != 0) _exit(CHILD_NO_UID);
}

static int wait_child(pid_t pid) {
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status), "the child died of signal %d", WTERMSIG(status));
    return WEXITSTATUS(status);
}

static int raw_connect(const char *p) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", p);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

/* Sends HELLO for `rank`; the reply's status byte, its text in why; -1: closed unanswered. */
static int raw_hello(int fd, int rank, char *why, size_t len) {
    nb__buf b = {0};
    uint8_t nonce[NB__STORE_NONCE_LEN] = {7};
    size_t f = nb__buf_frame_begin(&b);
    nb__buf_u8(&b, NB__OP_HELLO);
    nb__buf_u32(&b, NB__STORE_MAGIC);
    nb__buf_bytes(&b, RUN_ID, strlen(RUN_ID));
    nb__buf_i64(&b, rank);
    nb__buf_bytes(&b, nonce, sizeof nonce);
    nb__buf_frame_end(&b, f);
    /* the refusal may come (and the server close) before the greeting is sent */
    ssize_t put = send(fd, b.p, b.n, MSG_NOSIGNAL);
    (void)put;
    nb__buf_free(&b);
    why[0] = '\0';
    uint8_t hdr[4];
    if (recv(fd, hdr, 4, MSG_WAITALL) != 4) return -1;
    uint32_t n = nb__store_frame_len(hdr);
    uint8_t body[1024];
    if (n == 0 || n > sizeof body || recv(fd, body, n, MSG_WAITALL) != (ssize_t)n) return -1;
    nb__reader r = {body, n, 1, false};
    nb__bytes t = nb__rd_bytes(&r);
    if (!r.bad) snprintf(why, len, "%.*s", (int)t.n, (const char *)t.p);
    return body[0];
}

static nb_store_server *start_on_path(void) {
    ck_assert_int_eq(nb__store_unix_path(29123, path, sizeof path), NB_OK);
    nb__store_config cfg = {.run_id = RUN_ID, .world_size = 2, .unix_path = path};
    nb_store_server *server = NULL;
    nb_status st = nb__store_server_start(&server, NULL, 29123, -1, &cfg);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    return server;
}

static nb_store *rank_client(int rank) {
    nb__store_config cfg = {.run_id = RUN_ID, .unix_path = path};
    nb_store *s = NULL;
    nb_status st = nb__store_connect(&s, NULL, 29123, &cfg, rank, 5.0);
    ck_assert_msg(st == NB_OK, "%s", nb_last_error());
    return s;
}

static void cleanup_dir(void) {
    unlink(path);
    rmdir(dir);
    unsetenv("NABLA_STORE_DIR");
}

/* Layer 1: the folder is the user's, mode 0700, so another uid's connect
 * fails with EACCES and the store never sees it. */
START_TEST(test_other_uid_cannot_reach_the_socket) {
    make_dir(0700);
    nb_store_server *server = start_on_path();
    pid_t pid = fork();
    if (pid == 0) {
        drop_to_other_uid();
        int fd = raw_connect(path);
        _exit(fd >= 0 ? CHILD_CONNECTED : errno == EACCES ? CHILD_EACCES : CHILD_OTHER);
    }
    ck_assert_int_eq(wait_child(pid), CHILD_EACCES);
    nb_store *r0 = rank_client(0), *r1 = rank_client(1); /* the user's own ranks */
    nb_store_close(r1);
    nb_store_close(r0);
    nb_store_server_stop(server);
    cleanup_dir();
}
END_TEST

/* Layer 2: with the folder open, another uid reaches the socket, and the
 * server refuses it on SO_PEERCRED, says why, and keeps rank 1's place. */
START_TEST(test_other_uid_refused_by_peer_credentials) {
    make_dir(0700);
    nb_store_server *server = start_on_path();
    ck_assert_int_eq(chmod(dir, 0777), 0); /* relaxed for the test only */
    ck_assert_int_eq(chmod(path, 0777), 0);
    pid_t pid = fork();
    if (pid == 0) {
        drop_to_other_uid();
        int fd = raw_connect(path);
        if (fd < 0) _exit(errno == EACCES ? CHILD_EACCES : CHILD_OTHER);
        char why[600];
        int status = raw_hello(fd, 1, why, sizeof why);
        if (status == NB__R_OK) _exit(CHILD_ADMITTED);
        bool named = strstr(why, "this store admits only processes of its own user (uid 0); this "
                                 "process runs as uid 65534") != NULL;
        _exit(status == NB__R_ERROR && named ? CHILD_REFUSED : CHILD_OTHER);
    }
    ck_assert_int_eq(wait_child(pid), CHILD_REFUSED);
    nb_store *r0 = rank_client(0);
    nb_store *r1 = rank_client(1); /* not "rank 1 is already connected" */
    void *v = NULL;
    ck_assert_int_eq(nb_store_get(r0, NB__STORE_ABORT_KEY, 0, &v, NULL), NB_ERR_NOT_FOUND);
    char seen[800];
    ck_assert_int_eq(nb__store_server_unproven(server, seen, sizeof seen), 1);
    ck_assert_msg(strstr(seen, "1 connection that never proved"), "%s", seen);
    nb_store_close(r1);
    nb_store_close(r0);
    nb_store_server_stop(server);
    cleanup_dir();
}
END_TEST

/* The client refuses a socket that another user serves: it could be an
 * impostor's store. */
START_TEST(test_client_refuses_a_store_of_another_uid) {
    make_dir(0777);
    snprintf(path, sizeof path, "%s/store-29124.sock", dir);
    int ready[2];
    ck_assert_int_eq(pipe(ready), 0);
    pid_t pid = fork();
    if (pid == 0) {
        drop_to_other_uid();
        int err = 0;
        int fd = nb__store_unix_listen(path, &err);
        chmod(path, 0777);
        char c = fd >= 0 ? 'y' : 'n';
        if (write(ready[1], &c, 1) != 1) _exit(CHILD_OTHER);
        sleep(3);
        _exit(0);
    }
    char c = 0;
    ck_assert_int_eq(read(ready[0], &c, 1), 1);
    ck_assert_int_eq(c, 'y');
    nb__store_config cfg = {.run_id = RUN_ID, .unix_path = path};
    nb_store *s = NULL;
    NBT_EXPECT_STATUS(nb__store_connect(&s, NULL, 29124, &cfg, 0, 2.0), NB_ERR_MISMATCH,
                      "is served by a process of another user (SO_PEERCRED)");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    close(ready[0]);
    close(ready[1]);
    cleanup_dir();
}
END_TEST

/* The folder must be the user's: one that another user made first (and
 * could hold an impostor's socket) is refused, naming its owner. */
START_TEST(test_folder_of_another_user_refused) {
    make_dir(0700);
    ck_assert_int_eq(chown(dir, OTHER_UID, OTHER_UID), 0);
    char p[128];
    NBT_EXPECT_STATUS(nb__store_unix_path(29125, p, sizeof p), NB_ERR_INVALID, "belongs to uid 65534, not to "
                      "this process's uid 0");
    cleanup_dir();
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_other_uid_cannot_reach_the_socket,
                             test_other_uid_refused_by_peer_credentials,
                             test_client_refuses_a_store_of_another_uid, test_folder_of_another_user_refused,
                             NULL};
    return nbt_suite("dist_store_uid", "uid", 30, tests);
}

int main(void) {
    if (geteuid() != 0) {
        fprintf(stderr, "skipped: these tests start a process of another uid (%d), which needs root\n",
                OTHER_UID);
        return 77;
    }
    return nbt_run(suite());
}
