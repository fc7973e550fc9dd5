/* The store's Unix-domain socket: where it lies, and how it is opened.
 *
 * Note [Store on one node]
 * Without a secret, HELLO alone admits (Note [Store authentication] in
 * store_server.c), and a store on TCP loopback admits every local user:
 * anyone on the machine could read the run's keys, fill rank 0's memory,
 * abort the run or take a rank's place. So a world on one node
 * (LOCAL_WORLD_SIZE == WORLD_SIZE) serves its store on a Unix-domain
 * socket instead, and two layers keep other users out:
 *   - the socket lies in a folder of the user's own, mode 0700
 *     (NABLA_STORE_DIR, else /tmp/nabla-<uid>), so another user's connect
 *     fails with EACCES; the folder is made when missing, and refused when
 *     it is a link, is not a folder, belongs to another user or is open
 *     to others (someone else made it first: a socket there could be an
 *     impostor's);
 *   - the server asks the kernel who connected (SO_PEERCRED) and refuses
 *     any other uid before reading a byte, should the folder's mode be
 *     relaxed or a descriptor handed on; the refusals are counted in the
 *     store's rate-limited summary line. The client checks the server's
 *     uid in turn.
 * Processes of the same user stay inside the trust boundary (they could
 * ptrace the ranks anyway); a secret still applies on top when given.
 * The socket is named after the store's port (store-<port>.sock), so every
 * rank finds it from MASTER_PORT alone, however it was launched (nbrun,
 * torchrun, mpirun, by hand); a run of one process with MASTER_PORT=0
 * (which no other rank joins) names it after its pid instead
 * (store-0.<pid>.sock), so that many such runs can start at once. A socket file left by a killed run is
 * stale: nothing accepts on it, so the next server of that port removes it
 * and binds again; one that still accepts belongs to a live run of the
 * same user on the same port, which is refused with a message. The server
 * removes its file when it stops (only while the file is still the one it
 * bound) and touches it every hour, so that a cleaner of old files in /tmp
 * does not take it from a long run. NABLA_STORE_TRANSPORT=tcp keeps TCP
 * on loopback (ranks in containers that do not share /tmp). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "distributed/internal.h"

nb_status nb__store_transport_unix(bool one_node, bool *use_unix) {
    const char *v = getenv("NABLA_STORE_TRANSPORT");
    *use_unix = one_node;
    if (!v || !*v || strcmp(v, "auto") == 0) return NB_OK;
    if (strcmp(v, "tcp") == 0) {
        *use_unix = false;
        return NB_OK;
    }
    return nb_set_error(NB_ERR_INVALID, "NABLA_STORE_TRANSPORT='%s' is not auto or tcp", v);
}

/* The folder must be a folder (not a link) of this user, closed to others. */
static nb_status check_dir(const char *dir) {
    struct stat st;
    if (lstat(dir, &st) != 0)
        return nb_set_error(NB_ERR_IO, "the store's folder %s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return nb_set_error(NB_ERR_INVALID, "the store's folder %s is not a folder (a link or a file: "
                            "someone else's?); remove it, or set NABLA_STORE_DIR to a folder of "
                            "yours of mode 0700", dir);
    if (st.st_uid != geteuid())
        return nb_set_error(NB_ERR_INVALID, "the store's folder %s belongs to uid %u, not to this "
                            "process's uid %u: another user made it, and a socket there could be "
                            "theirs; set NABLA_STORE_DIR to a folder of yours of mode 0700",
                            dir, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 077)
        return nb_set_error(NB_ERR_INVALID, "the store's folder %s has mode %04o: other users may "
                            "enter it; make it 0700 (chmod 700 %s)", dir,
                            (unsigned)(st.st_mode & 07777), dir);
    return NB_OK;
}

nb_status nb__store_unix_path(int port, char *path, size_t len) {
    char dir[200];
    const char *given = getenv("NABLA_STORE_DIR");
    if (given && *given) snprintf(dir, sizeof dir, "%s", given);
    else snprintf(dir, sizeof dir, "/tmp/nabla-%u", (unsigned)geteuid());
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return nb_set_error(NB_ERR_IO, "cannot make the store's folder %s: %s", dir, strerror(errno));
    nb_status st = check_dir(dir);
    if (st != NB_OK) return st;
    struct sockaddr_un a;
    /* Port 0 is a run of one process (nb_dist_env_read refuses it for
     * more: no other rank could find the store), and many such runs may
     * start at once (a test suite, a sweep): the name is this process's
     * own, not a shared store-0.sock. */
    char name[64];
    if (port == 0) snprintf(name, sizeof name, "store-0.%ld.sock", (long)getpid());
    else snprintf(name, sizeof name, "store-%d.sock", port);
    int n = snprintf(path, len, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= len || (size_t)n >= sizeof a.sun_path)
        return nb_set_error(NB_ERR_INVALID, "the store's socket path %s/%s is longer than %zu bytes: set "
                            "NABLA_STORE_DIR to a shorter folder", dir, name, sizeof a.sun_path - 1);
    return NB_OK;
}

static socklen_t unix_addr(struct sockaddr_un *a, const char *path) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    snprintf(a->sun_path, sizeof a->sun_path, "%s", path);
    return (socklen_t)sizeof *a;
}

int nb__store_unix_listen(const char *path, int *sys_err) {
    struct sockaddr_un a;
    socklen_t al = unix_addr(&a, path);
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            *sys_err = errno;
            return -1;
        }
        if (bind(fd, (struct sockaddr *)&a, al) == 0) {
            if (chmod(path, 0600) == 0 && listen(fd, SOMAXCONN) == 0) return fd;
            *sys_err = errno;
            close(fd);
            unlink(path);
            return -1;
        }
        *sys_err = errno;
        close(fd);
        if (*sys_err != EADDRINUSE || attempt) return -1;
        /* A file is there: a live store's, or one left by a killed run. */
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (probe < 0) return -1;
        int rc = connect(probe, (struct sockaddr *)&a, al);
        int err = errno;
        close(probe);
        if (rc == 0 || (err != ECONNREFUSED && err != ENOENT)) return -1; /* EADDRINUSE: live */
        unlink(path); /* stale */
    }
    return -1;
}

int nb__store_unix_connect(const char *path, double timeout_s) {
    struct sockaddr_un a;
    socklen_t al = unix_addr(&a, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    /* a Unix connect waits while the listener's backlog is full, up to the send timeout */
    if (timeout_s < 0.001) timeout_s = 0.001;
    struct timeval tv = {(time_t)timeout_s, (suseconds_t)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, al) != 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    struct ucred cr;
    socklen_t cl = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 || cr.uid != geteuid()) {
        close(fd);
        errno = EPERM; /* not a store of this user's */
        return -1;
    }
    struct timeval none = {0, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
    return fd;
}

bool nb__store_peer_uid(int fd, unsigned *uid, int *pid) {
    struct ucred cr;
    socklen_t cl = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) return false;
    *uid = (unsigned)cr.uid;
    *pid = (int)cr.pid;
    return true;
}
