/* nbrun: starts the processes of a distributed run on this node, like
 * torchrun, and keeps their failures readable. `nbrun --help` is the
 * user's manual; docs/distributed.md has more.
 *
 * One process, one poll() loop: over a signalfd (SIGCHLD, SIGINT, SIGTERM,
 * SIGHUP) and two pipes per child, whose lines are copied out with a
 * "[rank R] " prefix as they complete; the last lines of each child's
 * stderr are kept in a ring. The first child that fails (non-zero exit or
 * signal) decides nbrun's exit code; the others get SIGTERM, then SIGKILL
 * after a grace period, sent to each child's process group so that what
 * they started goes too. Every child asks the kernel for SIGKILL when
 * nbrun dies (PR_SET_PDEATHSIG); a rank started through a wrapper is a
 * grandchild, which that does not reach, so every process also inherits
 * the read end of a pipe only nbrun holds open for writing
 * (NABLA_LAUNCHER_FD), whose end of file the library turns into SIGKILL
 * (Note [Launcher lifeline] in distributed/heartbeat.c). nbrun is not a
 * subreaper (PR_SET_CHILD_SUBREAPER): with it, a rank killed by a signal
 * was reaped after the peer its death made fail, about one run in three
 * on a loaded machine, and that peer was named as failing first.
 *
 * On the node of rank 0, nbrun opens the store's listening socket itself
 * and hands it to rank 0 (NABLA_STORE_FD); with --master-port 0 that is
 * how a free port is picked without a race between choosing and binding.
 * On one node it is the Unix-domain socket named after the port in a
 * folder of the user's (Note [Store on one node] in
 * distributed/store_unix.c; TCP loopback with NABLA_STORE_TRANSPORT=tcp),
 * removed when nbrun exits, and nbrun draws the run's
 * secret (Note [Store authentication] in distributed/store_server.c) into
 * a memory file of mode 0600 that every rank inherits as a descriptor
 * (NABLA_STORE_SECRET_FD): never on a command line or in a variable's
 * value. Several nodes must share one secret, so there it is the user's
 * (NABLA_STORE_SECRET_FILE), checked before anything starts.
 *
 * With --max-restarts N, a failed generation (every process stopped, as
 * above) is followed by a new one: a new listening socket, so a new store
 * served by the new rank 0, and a new run id ("<id>-r<k>"), so that no
 * process of an earlier generation can join it (Note [Restart
 * generations]). The secret stays the nbrun's. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "distributed/internal.h"

#define LINE_MAX_BYTES 65536
#define TAIL_LINES 20
#define TAIL_LINE_BYTES 1000
#define DRAIN_AFTER_EXIT_S 2.0

static const char *usage_text =
    "usage: nbrun [options] program [args...]\n"
    "\n"
    "Starts the processes of a distributed run on this node and supervises them.\n"
    "\n"
    "options (also --opt=value, and with underscores: --nproc_per_node):\n"
    "  --nproc-per-node N|gpu  processes on this node (default 1); 'gpu': one per\n"
    "                          visible GPU (nvidia-smi -L, limited by\n"
    "                          CUDA_VISIBLE_DEVICES); no GPU is an error\n"
    "  --nnodes K              nodes in the run (default 1); run nbrun once per node\n"
    "  --node-rank i           this node's index, 0..K-1 (default 0)\n"
    "  --master-addr A         where rank 0 serves the store (default 127.0.0.1;\n"
    "                          required with --nnodes > 1)\n"
    "  --master-port P         its port (default 0: a free port, one node only;\n"
    "                          required with --nnodes > 1)\n"
    "  --nnodes MIN:MAX        elastic membership: at each start and restart, the\n"
    "                          nodes that join within --rdzv-timeout (at least MIN,\n"
    "                          at most MAX) form the run, ranks numbered densely;\n"
    "                          node 0 (--node-rank 0, at --master-addr) serves the\n"
    "                          rendezvous on --master-port; a node that comes later\n"
    "                          joins at the next restart\n"
    "  --rdzv-timeout S        how long node 0 waits for the other nodes (default 30)\n"
    "  --max-restarts N        after a failure, stop every process and start them all\n"
    "                          again, up to N times (default 0); several nodes need\n"
    "                          --nnodes MIN:MAX\n"
    "  --cpu-bind none|cores|auto\n"
    "                          cores: bind each process (all its threads) to its own\n"
    "                          share of the CPUs nbrun may run on (taskset's mask,\n"
    "                          never a CPU outside it): whole cores, split evenly in\n"
    "                          local-rank order; none: leave placement to the\n"
    "                          scheduler; auto (default, or $NABLA_CPU_BIND): cores\n"
    "                          when there are at least as many CPUs as processes on\n"
    "                          this node, else none\n"
    "  -h, --help              this text\n"
    "\n"
    "each process gets:\n"
    "  RANK, WORLD_SIZE        global rank (node-rank * N + local rank) and N * K\n"
    "  LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node rank)\n"
    "  NABLA_CPU_BIND          cores when nbrun bound the process to its CPUs, else\n"
    "                          none (nabla's kernels then size their pool from the\n"
    "                          process's own CPUs)\n"
    "  OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1 when several ranks share the node\n"
    "  and the variable is not already set (nabla's own kernels follow\n"
    "  OMP_NUM_THREADS too, unless NABLA_NUM_THREADS is set)\n"
    "  MASTER_ADDR, MASTER_PORT (the real port when 0 was asked for)\n"
    "  NABLA_RUN_ID            the run's id ($NABLA_RUN_ID if set; else random on one\n"
    "                          node, master-addr:port on several); the store refuses\n"
    "                          processes of another run\n"
    "  NABLA_STORE_FD          (rank 0 only) the store's listening socket, opened by\n"
    "                          nbrun on node 0; on one node a Unix-domain socket,\n"
    "                          /tmp/nabla-<uid>/store-<port>.sock (NABLA_STORE_DIR\n"
    "                          instead of the folder), that only your user can\n"
    "                          reach; NABLA_STORE_TRANSPORT=tcp: TCP on loopback\n"
    "  NABLA_STORE_SECRET_FD   (one node) a descriptor holding the run's secret, drawn\n"
    "                          by nbrun, with which the store admits only the run's\n"
    "                          processes; with --nnodes > 1 every node needs the same\n"
    "                          secret from the user: NABLA_STORE_SECRET_FILE (a file\n"
    "                          only you can read) or NABLA_STORE_SECRET, else nbrun\n"
    "                          refuses to start unless NABLA_STORE_TRUSTED_NETWORK=1\n"
    "  NABLA_RESTART_COUNT     0 for the first start, k for the k-th restart\n"
    "  NABLA_LINE_BUFFERED=1   (unless set) nabla makes the process's stdout line-\n"
    "                          buffered, so each line shows when it is printed; set\n"
    "                          it to 0 to keep the C library's block buffering\n"
    "  NABLA_LAUNCHER_FD       the read end of a pipe that closes when nbrun dies;\n"
    "                          a nabla program stops then, however it was started\n"
    "  stdin from /dev/null; each in its own process group (what a process leaves\n"
    "  running in its group when it exits is killed)\n"
    "\n"
    "output: every line a process writes to stdout or stderr is copied to nbrun's\n"
    "stdout or stderr, prefixed with \"[rank R] \" (a line is written when it ends,\n"
    "so lines of different ranks never mix).\n"
    "\n"
    "failures: when a process exits with a non-zero code or is killed by a signal,\n"
    "nbrun sends SIGTERM to the other processes (their whole process groups), then\n"
    "SIGKILL to those still alive after a grace period ($NBRUN_GRACE seconds,\n"
    "default 5). It then prints which rank failed first and how, followed by the\n"
    "last " "20" " lines that rank wrote to stderr: the end of nbrun's output is where\n"
    "the error is. A process that is stopped (SIGSTOP, a debugger) is reported at\n"
    "once but is not a failure; the other ranks fail if it stays silent for\n"
    "$NABLA_LIVENESS_TIMEOUT seconds (default 15). SIGTERM is followed by SIGCONT.\n"
    "\n"
    "Ctrl-C (SIGINT), SIGTERM or SIGHUP to nbrun stops every process the same way;\n"
    "a second one kills them at once. If nbrun itself dies, the kernel kills the\n"
    "processes (PR_SET_PDEATHSIG), and a nabla program started through a wrapper\n"
    "(sh -c, a script that forks) stops within a second, when its inherited\n"
    "NABLA_LAUNCHER_FD closes.\n"
    "\n"
    "restarts: with --max-restarts N, when a process fails (its exit code, a signal,\n"
    "or the others' failure when it is dead or silent past the liveness limit),\n"
    "nbrun stops every process as above, prints the cause, and starts them all\n"
    "again: \"nbrun: restart k of N after: <cause>\". Each restart is a new\n"
    "generation of the run: a new store and run id ($NABLA_RUN_ID-r<k>), so nothing\n"
    "of the failed generation can join it. The program continues from its newest\n"
    "complete checkpoint (train_gpt and train_classifier: --resume auto). Ctrl-C\n"
    "is never followed by a restart. With --nnodes MIN:MAX every node's nbrun\n"
    "restarts when its processes fail (a lost node makes the others' fail), and the\n"
    "nodes present agree on the new generation: \"nbrun: generation k: n nodes ...,\n"
    "world size W\"; the generation is NABLA_RESTART_COUNT on every node.\n"
    "\n"
    "exit status: 0 when every process exits with 0; otherwise the exit code of the\n"
    "first process that failed (128 + N for signal N) in the last generation; 128 + N\n"
    "when nbrun was stopped by signal N first; 2 for a usage error; 127 when the\n"
    "program cannot be started.\n";

typedef struct stream {
    int fd;          /* -1 once closed */
    char *buf;
    size_t len;
    bool is_err;
} stream;

typedef struct child {
    int rank, local_rank;
    pid_t pid;
    bool running;
    int stop_sig; /* the signal that stopped it, 0 when running or resumed */
    int status; /* from waitpid */
    stream out, err;
    char *tail[TAIL_LINES];
    int tail_next, tail_count;
} child;

static child *kids;
static int nkids;
static int live;

static void die_usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "nbrun: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see nbrun --help)\n");
    va_end(ap);
    exit(2);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return; /* a closed stdout must not stop the supervision */
        }
        p += w;
        n -= (size_t)w;
    }
}

/* ------------------------------------------------------------- options */

static long parse_long(const char *flag, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        die_usage("%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi, v);
    return x;
}

/* GPUs this process may use: nvidia-smi's list, limited by CUDA_VISIBLE_DEVICES. */
static int count_gpus(char *why, size_t len) {
    int smi = -1;
    FILE *p = popen("nvidia-smi -L 2>/dev/null", "r");
    if (p) {
        char line[512];
        int n = 0;
        while (fgets(line, sizeof line, p))
            if (strncmp(line, "GPU ", 4) == 0) n++;
        int rc = pclose(p);
        if (rc == 0) smi = n;
    }
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    int listed = -1;
    if (cvd) {
        listed = 0;
        if (*cvd && strcmp(cvd, "-1") != 0) {
            listed = 1;
            for (const char *c = cvd; *c; c++) listed += *c == ',';
        }
    }
    if (smi < 0 && listed < 0) {
        snprintf(why, len, "nvidia-smi -L did not run (no NVIDIA driver?)");
        return 0;
    }
    int n = smi < 0 ? listed : (listed < 0 || listed > smi ? smi : listed);
    if (n == 0)
        snprintf(why, len, "%s", listed == 0 ? "CUDA_VISIBLE_DEVICES hides every GPU"
                                              : "nvidia-smi -L lists no GPU");
    return n;
}

typedef struct options {
    int nproc, nnodes, node_rank, port;
    int max_restarts;
    const char *addr;
    char **argv;
    bool elastic;        /* --nnodes MIN:MAX */
    int nnodes_min;      /* MIN (nnodes is MAX) */
    double rdzv_timeout; /* --rdzv-timeout */
    const char *cpu_bind; /* --cpu-bind: "none", "cores", "auto"; NULL: $NABLA_CPU_BIND */
} options;

static bool flag_is(const char *arg, const char *name, const char **value) {
    /* name is "nproc-per-node"; accept --nproc-per-node, --nproc_per_node, =value */
    if (strncmp(arg, "--", 2) != 0) return false;
    arg += 2;
    size_t i = 0;
    for (; name[i]; i++) {
        char a = arg[i], b = name[i];
        if (a == '_') a = '-';
        if (a != b) return false;
    }
    if (arg[i] == '=') {
        *value = arg + i + 1;
        return true;
    }
    if (arg[i] == 0) {
        *value = NULL;
        return true;
    }
    return false;
}

/* --nnodes K, or MIN:MAX for elastic membership (Note [Elastic membership]). */
static void parse_nnodes(options *o, const char *v) {
    const char *colon = strchr(v, ':');
    if (!colon) {
        o->nnodes = (int)parse_long("--nnodes", v, 1, 1 << 20);
        o->nnodes_min = o->nnodes;
        o->elastic = false;
        return;
    }
    char min[32];
    snprintf(min, sizeof min, "%.*s", (int)(colon - v < 31 ? colon - v : 31), v);
    o->nnodes_min = (int)parse_long("--nnodes MIN:MAX, MIN", min, 1, 1 << 20);
    o->nnodes = (int)parse_long("--nnodes MIN:MAX, MAX", colon + 1, 1, 1 << 20);
    if (o->nnodes_min > o->nnodes) die_usage("--nnodes %s: MIN is above MAX", v);
    o->elastic = true;
}

static options parse_options(int argc, char **argv) {
    options o = {1, 1, 0, 0, 0, NULL, NULL, false, 1, 30.0, NULL};
    const char *nproc = "1";
    bool port_given = false;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
            exit(0);
        }
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (a[0] != '-') break;
        const char *names[] = {"nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port",
                               "max-restarts", "rdzv-timeout", "cpu-bind"};
        int which = -1;
        for (int k = 0; k < 8 && which < 0; k++)
            if (flag_is(a, names[k], &v)) which = k;
        if (which < 0) die_usage("unknown option '%s'", a);
        if (!v) {
            if (i + 1 >= argc) die_usage("%s needs a value", a);
            v = argv[++i];
        }
        switch (which) {
        case 0: nproc = v; break;
        case 1: parse_nnodes(&o, v); break;
        case 2: o.node_rank = (int)parse_long("--node-rank", v, 0, 1 << 20); break;
        case 3: o.addr = v; break;
        case 4:
            o.port = (int)parse_long("--master-port", v, 0, 65535);
            port_given = true;
            break;
        case 5: o.max_restarts = (int)parse_long("--max-restarts", v, 0, 1 << 20); break;
        case 6: {
            char *end;
            o.rdzv_timeout = strtod(v, &end);
            if (end == v || *end || !(o.rdzv_timeout > 0) || o.rdzv_timeout > 1e6)
                die_usage("--rdzv-timeout expects a number of seconds > 0, got '%s'", v);
            break;
        }
        case 7: o.cpu_bind = v; break;
        }
    }
    if (i >= argc) die_usage("no program to run");
    o.argv = argv + i;
    if (strcmp(nproc, "gpu") == 0) {
        char why[256] = "";
        o.nproc = count_gpus(why, sizeof why);
        if (o.nproc == 0) {
            fprintf(stderr, "nbrun: --nproc-per-node gpu: no GPU found (%s)\n", why);
            exit(2);
        }
    } else {
        o.nproc = (int)parse_long("--nproc-per-node", nproc, 1, 4096);
    }
    if (o.node_rank >= o.nnodes)
        die_usage("--node-rank %d must be below --nnodes %d", o.node_rank, o.nnodes);
    if (o.nnodes > 1 && !o.addr) die_usage("--master-addr is required with --nnodes %d", o.nnodes);
    if (o.nnodes > 1 && (!port_given || o.port == 0))
        die_usage("--master-port must be a fixed port with --nnodes %d (port 0 picks a free port "
                  "on one node only)",
                  o.nnodes);
    if (o.nnodes > 1 && o.max_restarts > 0 && !o.elastic)
        die_usage("--max-restarts with several nodes needs --nnodes MIN:MAX, through which every node's "
                  "nbrun agrees on each restart (--nnodes %d:%d keeps the same nodes)", o.nnodes, o.nnodes);
    if (o.nnodes == 1) o.elastic = false; /* one node: nothing to agree on */
    if (!o.addr) o.addr = "127.0.0.1";
    const char *flag = "--cpu-bind";
    if (!o.cpu_bind) {
        o.cpu_bind = getenv("NABLA_CPU_BIND");
        flag = "NABLA_CPU_BIND";
        if (!o.cpu_bind || !*o.cpu_bind) o.cpu_bind = "auto";
    }
    if (strcmp(o.cpu_bind, "none") != 0 && strcmp(o.cpu_bind, "cores") != 0 && strcmp(o.cpu_bind, "auto") != 0)
        die_usage("%s expects none, cores or auto, got '%s'", flag, o.cpu_bind);
    return o;
}

/* ------------------------------------------------------------ the store port */

/* Note [Store on one node]: the socket file this nbrun made, removed when a
 * generation's store is replaced and at exit (while it is still that file). */
static char store_path[128];
static struct stat store_path_st;

static void forget_store_path(void) {
    struct stat st;
    if (store_path[0] && stat(store_path, &st) == 0 && st.st_dev == store_path_st.st_dev &&
        st.st_ino == store_path_st.st_ino)
        unlink(store_path);
    store_path[0] = '\0';
}

/* Whether a world on this node alone reaches its store on a Unix-domain
 * socket: what its ranks decide from the same variables (distributed/pg.c). */
static bool store_on_unix(const options *o) {
    bool use_unix = false;
    if (nb__store_transport_unix(o->nnodes == 1 && !o->elastic, &use_unix) != NB_OK)
        die_usage("%s", nb_last_error());
    return use_unix;
}

/* The Unix-domain socket of the store on *port; 0: a free TCP port's number,
 * drawn again while a live store of this user holds its name. */
static int open_unix_store_socket(int *port) {
    bool pick = *port == 0;
    forget_store_path(); /* the last generation's, before its path can be bound again */
    for (int attempt = 0; attempt < 20; attempt++) {
        if (pick) {
            int gai = 0, err = 0;
            int t = nb__tcp_listen("127.0.0.1", 0, &gai, &err);
            struct sockaddr_in a;
            socklen_t sl = sizeof a;
            if (t < 0 || getsockname(t, (struct sockaddr *)&a, &sl) != 0) {
                fprintf(stderr, "nbrun: cannot find a free port: %s\n", strerror(err ? err : errno));
                exit(2);
            }
            *port = ntohs(a.sin_port);
            close(t);
        }
        char path[sizeof store_path];
        if (nb__store_unix_path(*port, path, sizeof path) != NB_OK) {
            fprintf(stderr, "nbrun: %s\n", nb_last_error());
            exit(2);
        }
        int err = 0;
        int fd = nb__store_unix_listen(path, &err);
        if (fd >= 0) {
            snprintf(store_path, sizeof store_path, "%s", path);
            stat(store_path, &store_path_st);
            return fd;
        }
        if (err != EADDRINUSE || !pick) {
            fprintf(stderr, "nbrun: cannot listen on %s for the store: %s%s\n", path, strerror(err),
                    err == EADDRINUSE ? " (a store of another run of yours serves it: pick another "
                                        "--master-port, or 0)" : "");
            exit(2);
        }
    }
    fprintf(stderr, "nbrun: no free store socket after 20 ports\n");
    exit(2);
}

/* Listens on addr:port for rank 0's store (on loopback when the run is on
 * this node alone); returns the fd and the port. */
static int open_store_socket(const options *o, const char *addr, int nnodes, int *port) {
    if (store_on_unix(o)) return open_unix_store_socket(port);
    bool loop = strncmp(addr, "127.", 4) == 0 || strcmp(addr, "localhost") == 0 || strcmp(addr, "::1") == 0;
    const char *host = loop ? addr : nnodes == 1 ? "127.0.0.1" : NULL;
    int gai = 0, err = 0;
    int fd = nb__tcp_listen(host, *port, &gai, &err);
    if (fd < 0 && gai) {
        fprintf(stderr, "nbrun: cannot resolve --master-addr %s: %s\n", addr, gai_strerror(gai));
        exit(2);
    }
    if (fd < 0) {
        fprintf(stderr, "nbrun: cannot listen on %s:%d for the store: %s\n", host ? host : "0.0.0.0",
                *port, strerror(err));
        exit(2);
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

static void make_run_id(const options *o, char *id, size_t len) {
    const char *given = getenv("NABLA_RUN_ID");
    if (given && *given) {
        snprintf(id, len, "%s", given);
        return;
    }
    if (o->nnodes > 1) {
        snprintf(id, len, "%s:%d", o->addr, o->port);
        return;
    }
    unsigned long long r = (unsigned long long)getpid() ^ (unsigned long long)time(NULL) << 20;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &r, sizeof r) != (ssize_t)sizeof r) r ^= (unsigned long long)now_s();
        close(fd);
    }
    snprintf(id, len, "nbrun-%016llx", r);
}

/* ------------------------------------------------------------ the secret */

static int secret_fd = -1; /* one node: the run's secret, inherited by every rank */

/* One node: 32 random bytes, as hex, in a memory file only this user may
 * open; several: the user's secret must be there (or the network trusted),
 * said now rather than by every rank. */
static void prepare_secret(const options *o) {
    unsetenv("NABLA_STORE_SECRET_FD"); /* a launcher's own is not passed on */
    if (o->nnodes > 1) {
        nb__store_secret sec;
        if (nb__store_secret_from_env(&sec) != NB_OK) {
            fprintf(stderr, "nbrun: %s\n", nb_last_error());
            exit(2);
        }
        bool have = sec.len > 0;
        nb__store_wipe(&sec, sizeof sec);
        if (!have && !nb__store_trusted_network())
            die_usage("--nnodes %d needs the run's secret, the same on every node, so that only the "
                      "run's processes can use its store: NABLA_STORE_SECRET_FILE=FILE (mode 0600), "
                      "or NABLA_STORE_SECRET; or NABLA_STORE_TRUSTED_NETWORK=1 if only trusted "
                      "machines can reach --master-addr",
                      o->nnodes);
        return;
    }
    uint8_t raw[32];
    char hex[2 * sizeof raw + 1];
    nb__store_random(raw, sizeof raw);
    for (size_t i = 0; i < sizeof raw; i++) snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    nb__store_wipe(raw, sizeof raw);
    secret_fd = memfd_create("nabla-store-secret", MFD_CLOEXEC);
    if (secret_fd < 0 || fchmod(secret_fd, 0600) != 0 ||
        write(secret_fd, hex, 2 * sizeof raw) != (ssize_t)(2 * sizeof raw)) {
        perror("nbrun: the store's secret (memfd_create)");
        exit(1);
    }
    nb__store_wipe(hex, sizeof hex);
}

/* ------------------------------------------------------------ children */

/* This generation's world: nproc * nnodes and node-rank, or what the
 * rendezvous decided (Note [Elastic membership]). */
static int gen_world, gen_group, gen_rank_base;

/* Note [Launcher lifeline]: the read end every process inherits; the
 * write end, close-on-exec, stays with nbrun alone. */
static int lifeline_fd = -1;

static void open_lifeline(void) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        perror("nbrun: pipe");
        exit(1);
    }
    lifeline_fd = p[0]; /* p[1] is never written, and closes when nbrun dies */
}

/* Note [CPU binding] in distributed/cpu_bind.c: each local rank's CPUs,
 * decided once from nbrun's own mask; NULL when nothing is bound. */
static cpu_set_t *rank_cpus;

static void plan_cpu_binding(const options *o) {
    if (strcmp(o->cpu_bind, "none") == 0) return;
    nb__cpu_slot *slots = malloc(CPU_SETSIZE * sizeof *slots);
    int *share = malloc(CPU_SETSIZE * sizeof *share);
    if (!slots || !share) {
        fprintf(stderr, "nbrun: out of memory\n");
        exit(1);
    }
    int n = nb__cpu_usable(slots, CPU_SETSIZE);
    if (n == 0 && strcmp(o->cpu_bind, "cores") == 0) {
        fprintf(stderr, "nbrun: --cpu-bind cores: cannot read the CPUs nbrun may run on: %s\n", strerror(errno));
        exit(2);
    }
    if (n > 0 && (o->nproc <= n || strcmp(o->cpu_bind, "cores") == 0)) {
        rank_cpus = calloc((size_t)o->nproc, sizeof *rank_cpus);
        if (!rank_cpus) {
            fprintf(stderr, "nbrun: out of memory\n");
            exit(1);
        }
        for (int r = 0; r < o->nproc; r++) {
            int k = nb__cpu_share(slots, n, o->nproc, r, share);
            CPU_ZERO(&rank_cpus[r]);
            for (int i = 0; i < k; i++) CPU_SET(share[i], &rank_cpus[r]);
        }
    }
    free(slots);
    free(share);
}

static void setenv_int(const char *name, int v) {
    char s[32];
    snprintf(s, sizeof s, "%d", v);
    setenv(name, s, 1);
}

static void spawn(child *c, const options *o, const char *run_id, int store_fd, int port, int restart) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
        perror("nbrun: pipe");
        exit(1);
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("nbrun: fork");
        exit(1);
    }
    if (pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1); /* nbrun died before prctl */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) dup2(devnull, 0);
        dup2(out[1], 1);
        dup2(err[1], 2);
        setenv_int("RANK", c->rank);
        setenv_int("WORLD_SIZE", gen_world);
        setenv_int("LOCAL_RANK", c->local_rank);
        setenv_int("LOCAL_WORLD_SIZE", o->nproc);
        setenv_int("GROUP_RANK", gen_group);
        setenv("MASTER_ADDR", o->addr, 1);
        setenv_int("MASTER_PORT", port);
        setenv("NABLA_RUN_ID", run_id, 1);
        setenv_int("NABLA_RESTART_COUNT", restart);
        setenv("NABLA_LINE_BUFFERED", "1", 0); /* Note [Line-buffered stdout under a launcher] */
        setenv("NABLA_CPU_BIND", "none", 1);
        if (rank_cpus) {
            if (sched_setaffinity(0, sizeof rank_cpus[0], &rank_cpus[c->local_rank]) == 0)
                setenv("NABLA_CPU_BIND", "cores", 1);
            else
                fprintf(stderr, "nbrun: cannot bind local rank %d to its CPUs (it runs unbound): %s\n",
                        c->local_rank, strerror(errno));
        }
        /* Note: several ranks on one machine each running a full-width BLAS
         * thread pool oversubscribe the cores; like torchrun, default to one
         * thread per rank unless the user chose. nabla's kernel pool reads
         * OMP_NUM_THREADS too (tensor/cpu/threads.c), so both agree. */
        if (o->nproc > 1) {
            setenv("OMP_NUM_THREADS", "1", 0);
            setenv("OPENBLAS_NUM_THREADS", "1", 0);
        }
        unsetenv("NABLA_STORE_FD");
        unsetenv("NABLA_STORE_PORT"); /* the store is on MASTER_PORT */
        /* an elastic generation on one node still has a TCP store (Note [Elastic membership]) */
        if (o->elastic) setenv("NABLA_STORE_TRANSPORT", "tcp", 1);
        if (lifeline_fd >= 0) {
            fcntl(lifeline_fd, F_SETFD, 0);
            setenv_int("NABLA_LAUNCHER_FD", lifeline_fd);
        }
        if (secret_fd >= 0) {
            fcntl(secret_fd, F_SETFD, 0);
            setenv_int("NABLA_STORE_SECRET_FD", secret_fd);
        }
        if (store_fd >= 0 && c->rank == 0) {
            int flags = fcntl(store_fd, F_GETFD);
            fcntl(store_fd, F_SETFD, flags & ~FD_CLOEXEC);
            setenv_int("NABLA_STORE_FD", store_fd);
        }
        execvp(o->argv[0], o->argv);
        fprintf(stderr, "nbrun: cannot run '%s': %s\n", o->argv[0], strerror(errno));
        _exit(127);
    }
    close(out[1]);
    close(err[1]);
    c->pid = pid;
    c->running = true;
    c->out = (stream){out[0], malloc(LINE_MAX_BYTES), 0, false};
    c->err = (stream){err[0], malloc(LINE_MAX_BYTES), 0, true};
    if (!c->out.buf || !c->err.buf) {
        fprintf(stderr, "nbrun: out of memory\n");
        exit(1);
    }
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    live++;
}

static void keep_tail(child *c, const char *line, size_t n) {
    if (n > TAIL_LINE_BYTES) n = TAIL_LINE_BYTES;
    char *copy = malloc(n + 1);
    if (!copy) return;
    memcpy(copy, line, n);
    copy[n] = 0;
    free(c->tail[c->tail_next]);
    c->tail[c->tail_next] = copy;
    c->tail_next = (c->tail_next + 1) % TAIL_LINES;
    if (c->tail_count < TAIL_LINES) c->tail_count++;
}

static void emit_line(child *c, stream *s, const char *line, size_t n) {
    char prefix[32];
    int pn = snprintf(prefix, sizeof prefix, "[rank %d] ", c->rank);
    int fd = s->is_err ? 2 : 1;
    /* One write per line keeps lines whole when stdout and stderr are the same pipe. */
    char *buf = malloc((size_t)pn + n + 1);
    if (!buf) return;
    memcpy(buf, prefix, (size_t)pn);
    memcpy(buf + pn, line, n);
    buf[(size_t)pn + n] = '\n';
    write_all(fd, buf, (size_t)pn + n + 1);
    free(buf);
    if (s->is_err) keep_tail(c, line, n);
}

/* Reads what is there; false at end of file. */
static bool pump(child *c, stream *s) {
    for (;;) {
        if (s->len == LINE_MAX_BYTES) { /* a very long line: pass it on in pieces */
            emit_line(c, s, s->buf, s->len);
            s->len = 0;
        }
        ssize_t got = read(s->fd, s->buf + s->len, LINE_MAX_BYTES - s->len);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        if (got <= 0) {
            if (s->len) emit_line(c, s, s->buf, s->len);
            s->len = 0;
            close(s->fd);
            s->fd = -1;
            return false;
        }
        size_t start = 0, end = s->len + (size_t)got;
        for (size_t i = s->len; i < end; i++) {
            if (s->buf[i] == '\n') {
                emit_line(c, s, s->buf + start, i - start);
                start = i + 1;
            }
        }
        memmove(s->buf, s->buf + start, end - start);
        s->len = end - start;
    }
}

/* A stopped process (SIGSTOP, a debugger: the case the others name at the
 * liveness limit) acts on SIGTERM only once resumed, so SIGTERM is
 * followed by SIGCONT rather than leaving it to the grace period. */
static void signal_all(int sig) {
    for (int i = 0; i < nkids; i++)
        if (kids[i].running) {
            kill(-kids[i].pid, sig);
            if (sig == SIGTERM) kill(-kids[i].pid, SIGCONT);
        }
}

static void describe_status(int status, char *buf, size_t len) {
    if (WIFEXITED(status)) snprintf(buf, len, "exited with code %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, len, "was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else snprintf(buf, len, "stopped (status %d)", status);
}

/* A rank stopped (SIGSTOP, SIGTSTP, a debugger) is not a failure: it may
 * be resumed. nbrun says so at once; if it stays stopped, the other ranks
 * name it at their liveness limit and fail. */
static void note_stop(const child *c, int status) {
    char line[256];
    int n;
    if (WIFSTOPPED(status))
        n = snprintf(line, sizeof line,
                     "nbrun: rank %d (local rank %d, pid %d) was stopped by signal %d (%s); unless it is "
                     "resumed, the other ranks fail at NABLA_LIVENESS_TIMEOUT\n",
                     c->rank, c->local_rank, (int)c->pid, WSTOPSIG(status), strsignal(WSTOPSIG(status)));
    else
        n = snprintf(line, sizeof line, "nbrun: rank %d (local rank %d, pid %d) was resumed\n", c->rank,
                     c->local_rank, (int)c->pid);
    write_all(2, line, (size_t)n);
}

static int exit_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 1;
}

/* Note [Restart generations]
 * A restart starts every process again, never some of them: the survivors
 * of a failure hold a process group whose peer is gone, and a program that
 * resumes from its checkpoint must do so on every rank at once. Each
 * generation gets a new listening socket (so a new store, served by the
 * new rank 0: nothing stored by the failed generation survives) and a new
 * run id, "<id>-r<k>", which the store checks at every connection (a
 * process of an earlier generation that is somehow still alive, say on a
 * host that nbrun cannot reach, is refused instead of joining). nbrun
 * starts the next generation only once every process of the previous one
 * has been reaped, so no two generations run at once on this node.
 * NABLA_RESTART_COUNT tells a program which generation it is (torchrun's
 * TORCHELASTIC_RESTART_COUNT). */

/* Starts generation `restart` (0: the first start): the store's socket on
 * node 0 (or the rendezvous's, store_fd / store_port when elastic), the run
 * id, every process. */
static void start_generation(const options *o, const char *base_id, int restart, int store_fd, int store_port) {
    int port = o->port;
    if (!o->elastic) {
        gen_world = o->nproc * o->nnodes;
        gen_group = o->node_rank;
        gen_rank_base = o->node_rank * o->nproc;
        if (o->node_rank == 0) store_fd = open_store_socket(o, o->addr, o->nnodes, &port);
    } else {
        port = store_port;
    }
    char run_id[160];
    if (restart == 0) snprintf(run_id, sizeof run_id, "%s", base_id);
    else snprintf(run_id, sizeof run_id, "%s-r%d", base_id, restart);
    live = 0;
    for (int i = 0; i < nkids; i++) {
        kids[i] = (child){.rank = gen_rank_base + i, .local_rank = i};
        spawn(&kids[i], o, run_id, store_fd, port, restart);
    }
    if (store_fd >= 0) close(store_fd); /* rank 0 owns it now */
}

static void free_generation(void) {
    for (int i = 0; i < nkids; i++) {
        free(kids[i].out.buf);
        free(kids[i].err.buf);
        for (int k = 0; k < TAIL_LINES; k++) free(kids[i].tail[k]);
        kids[i] = (child){0};
    }
}

/* ------------------------------------------------------- elastic membership */

/* Note [Elastic membership]
 * With --nnodes MIN:MAX the nodes agree on each generation through a store
 * that node 0's nbrun serves on --master-addr:--master-port (the ranks'
 * store code, with the run's secret and its own run id, "<id>-rdzv"; node 0
 * must stay up). For generation g, node 0 joins first and sets "current" =
 * g; another node waits for a generation it has not run, joins it (an add
 * on "g<g>/join" gives its place i, "g<g>/node<i>" says its process count)
 * and waits for node 0 to close the round: at MAX nodes, or once the
 * rendezvous timeout has passed with at least MIN (fewer after it: node 0
 * gives up). Members are numbered by arrival, node 0 first, and the ranks
 * densely in that order (a node's first rank is the process count of the
 * members before it). Node 0 opens a new socket for the ranks' store at
 * each generation and publishes its port with the closing
 * ("g<g>/closed" = "n port"), so that no generation reuses another's store
 * and no port beyond the rendezvous's need be fixed. A node that arrives
 * after the round closed (late, or back after a failure) waits for the
 * next one: it joins at the next restart. Each nbrun restarts on its own
 * ranks' failure; a lost node makes the other nodes' ranks fail (a peer
 * gone, or silent past the liveness limit), so every live node comes to
 * the next round. When node 0's generation ends well it sets "done", which
 * sends a node still waiting home. */
static nb_store_server *rdzv_server; /* node 0 */
static nb_store *rdzv_store;
static nb__store_secret rdzv_secret;

static void rdzv_die(const options *o, const char *what) {
    fprintf(stderr, "nbrun: the rendezvous at %s:%d (served by node 0's nbrun): %s: %s\n", o->addr, o->port,
            what, nb_last_error());
    exit(1);
}

/* A signal that stops nbrun (Ctrl-C, SIGTERM, SIGHUP) while it waits for
 * the other nodes: no process runs, so it ends at once. */
static void rdzv_check_signal(int sfd) {
    struct signalfd_siginfo si;
    while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGCHLD) continue;
        fprintf(stderr, "nbrun: stopped by signal %d (%s) during the rendezvous\n", (int)si.ssi_signo,
                strsignal((int)si.ssi_signo));
        exit(128 + (int)si.ssi_signo);
    }
}

static void rdzv_open(const options *o, const char *base_id) {
    static char run_id[160];
    snprintf(run_id, sizeof run_id, "%s-rdzv", base_id);
    if (nb__store_secret_from_env(&rdzv_secret) != NB_OK) rdzv_die(o, "the secret");
    nb__store_config cfg = {.run_id = run_id, .secret = rdzv_secret.len ? rdzv_secret.bytes : NULL,
                            .secret_len = rdzv_secret.len};
    if (o->node_rank == 0) {
        int port = o->port;
        int fd = open_store_socket(o, o->addr, o->nnodes, &port);
        if (nb__store_server_start(&rdzv_server, NULL, 0, fd, &cfg) != NB_OK) rdzv_die(o, "cannot serve it");
    }
    if (nb__store_connect(&rdzv_store, o->addr, o->port, &cfg, -1, o->rdzv_timeout) != NB_OK)
        rdzv_die(o, "cannot reach it within --rdzv-timeout");
}

static void rdzv_set(const options *o, const char *key, const char *value) {
    if (nb_store_set(rdzv_store, key, value, strlen(value)) != NB_OK) rdzv_die(o, key);
}

/* The value of `key` as an integer; waits up to timeout_s (0: none, false
 * when absent). */
static bool rdzv_get_int(const options *o, const char *key, double timeout_s, long long *v, long long *v2) {
    void *val = NULL;
    size_t len;
    nb_status st = nb_store_get(rdzv_store, key, timeout_s, &val, &len);
    if (st == NB_ERR_NOT_FOUND) return false;
    if (st != NB_OK) rdzv_die(o, "reading a key");
    int got = v2 ? sscanf(val, "%lld %lld", v, v2) : sscanf(val, "%lld", v);
    free(val);
    if (got != (v2 ? 2 : 1)) {
        nb_set_error(NB_ERR_FORMAT, "malformed value");
        rdzv_die(o, key);
    }
    return true;
}

static void rdzv_sleep(int sfd) {
    rdzv_check_signal(sfd);
    poll(NULL, 0, 50);
}

/* The members' process counts: this node's first rank and the world size. */
static void rdzv_members(const options *o, int g, long long n, long long me) {
    char key[64];
    gen_world = 0;
    for (long long i = 1; i <= n; i++) {
        long long nproc;
        snprintf(key, sizeof key, "g%d/node%lld", g, i);
        if (!rdzv_get_int(o, key, o->rdzv_timeout, &nproc, NULL)) rdzv_die(o, key);
        if (i == me) gen_rank_base = gen_world;
        gen_world += (int)nproc;
    }
    gen_group = (int)me - 1;
}

/* Node 0: opens generation g, waits for the others, closes it. */
static void rdzv_host_round(const options *o, int sfd, int g, int *store_fd, int *store_port) {
    char key[64], value[64];
    snprintf(key, sizeof key, "g%d/join", g);
    int64_t count;
    if (nb_store_add(rdzv_store, key, 1, &count) != NB_OK) rdzv_die(o, key);
    snprintf(key, sizeof key, "g%d/node1", g);
    snprintf(value, sizeof value, "%d", o->nproc);
    rdzv_set(o, key, value);
    snprintf(value, sizeof value, "%d", g);
    rdzv_set(o, "current", value);
    double t0 = now_s();
    snprintf(key, sizeof key, "g%d/join", g);
    for (;;) {
        if (nb_store_add(rdzv_store, key, 0, &count) != NB_OK) rdzv_die(o, key);
        double waited = now_s() - t0;
        if (count >= o->nnodes || (waited >= o->rdzv_timeout && count >= o->nnodes_min)) break;
        if (waited >= o->rdzv_timeout) {
            fprintf(stderr, "nbrun: generation %d: %lld node%s joined within %g s (--rdzv-timeout), fewer than "
                    "the %d of --nnodes %d:%d: the run stops\n", g, (long long)count, count == 1 ? "" : "s",
                    o->rdzv_timeout, o->nnodes_min, o->nnodes_min, o->nnodes);
            exit(1);
        }
        rdzv_sleep(sfd);
    }
    long long n = count < o->nnodes ? count : o->nnodes;
    *store_port = 0;
    *store_fd = open_store_socket(o, o->addr, o->nnodes, store_port);
    snprintf(key, sizeof key, "g%d/closed", g);
    snprintf(value, sizeof value, "%lld %d", n, *store_port);
    rdzv_set(o, key, value);
    rdzv_members(o, g, n, 1);
    fprintf(stderr, "nbrun: generation %d: %lld node%s of --nnodes %d:%d after %.1f s, world size %d%s\n", g, n,
            n == 1 ? "" : "s", o->nnodes_min, o->nnodes, now_s() - t0, gen_world,
            n < o->nnodes ? " (the others did not join within --rdzv-timeout; they join at the next restart)" : "");
}

/* Another node: joins the next generation after `last` that is still open. */
static int rdzv_join_round(const options *o, int sfd, int last, int *store_port) {
    char key[64], value[64];
    int skip = last; /* generations this node does not join */
    bool said = false;
    for (;;) {
        long long cur, done, n, port;
        if (rdzv_get_int(o, "done", 0, &done, NULL)) {
            fprintf(stderr, "nbrun: the run ended without this node\n");
            exit(0);
        }
        if (!rdzv_get_int(o, "current", 0, &cur, NULL) || cur <= skip) {
            rdzv_sleep(sfd);
            continue;
        }
        int g = (int)cur;
        snprintf(key, sizeof key, "g%d/closed", g);
        if (rdzv_get_int(o, key, 0, &n, &port)) {
            if (!said)
                fprintf(stderr, "nbrun: generation %d started without this node; it joins at the next restart\n", g);
            said = true;
            skip = g;
            continue;
        }
        int64_t me;
        snprintf(key, sizeof key, "g%d/join", g);
        if (nb_store_add(rdzv_store, key, 1, &me) != NB_OK) rdzv_die(o, key);
        snprintf(key, sizeof key, "g%d/node%lld", g, (long long)me);
        snprintf(value, sizeof value, "%d", o->nproc);
        rdzv_set(o, key, value);
        snprintf(key, sizeof key, "g%d/closed", g);
        /* node 0 closes the round within its timeout; a margin for the clocks' start */
        if (!rdzv_get_int(o, key, 2 * o->rdzv_timeout + 10, &n, &port)) {
            nb_set_error(NB_ERR_TIMEOUT, "generation %d was not closed in time", g);
            rdzv_die(o, key);
        }
        if (me > n) {
            skip = g;
            continue;
        }
        *store_port = (int)port;
        rdzv_members(o, g, n, me);
        fprintf(stderr, "nbrun: generation %d: this node is member %lld of %lld, ranks %d..%d of world size %d\n",
                g, (long long)me, n, gen_rank_base, gen_rank_base + o->nproc - 1, gen_world);
        return g;
    }
}

/* The next generation's membership (Note [Elastic membership]). */
static int rdzv_round(const options *o, int sfd, int last, int *store_fd, int *store_port) {
    *store_fd = -1;
    if (o->node_rank != 0) return rdzv_join_round(o, sfd, last, store_port);
    rdzv_host_round(o, sfd, last + 1, store_fd, store_port);
    return last + 1;
}

static void rdzv_close(const options *o, bool done) {
    if (done && o->node_rank == 0) rdzv_set(o, "done", "1");
    nb_store_close(rdzv_store);
    /* node 0 keeps serving briefly, so that a waiting node reads "done" */
    if (rdzv_server) poll(NULL, 0, done ? 300 : 0);
    nb_store_server_stop(rdzv_server);
    nb__store_wipe(&rdzv_secret, sizeof rdzv_secret);
}

/* Note [Who failed first]
 * A rank killed by a signal (SIGKILL, a crash) makes its peers fail within
 * milliseconds (their connections to it break), and under load a peer's
 * exit can reach nbrun before the killed rank's: a process killed with
 * many threads is reaped only once every thread has gone. Named first,
 * the peer would hide the cause. So a rank that exits with an error is
 * taken as the first failure only after FIRST_WINDOW_S in which no rank
 * was killed by a signal; one that was is taken at once, and outranks
 * the exit. The others are stopped after that, at most FIRST_WINDOW_S
 * later than before. The same rule orders children reaped together (nbrun
 * was not scheduled between their ends, as under load): the pending
 * SIGCHLD names the child that ended first, but it decides only between
 * children that ended alike. The peer's exit is often the one it names,
 * since a process of one thread is gone at once; letting it pass the
 * killed rank there named the peer in 3 runs of 300 of two train_gpt ranks
 * whose rank 0 kills itself, on an idle machine, and made
 * tests/test_restart.py fail under load (tests/test_nbrun_first_failure.py
 * makes that order on purpose). */
#define FIRST_WINDOW_S 0.3

/* Supervises the running generation until every process has exited (and
 * its pipes are drained). *first: the index of the first child that
 * failed, or -1; *interrupted: the signal that stopped nbrun, or 0. */
static void supervise(int sfd, double grace, int *first_out, int *interrupted_out) {
    int first = -1;          /* index of the first child that failed */
    int exited = -1;         /* one that exited with an error, while a killed peer may be reaped */
    double decide_at = 0;    /* ... until then (Note [Who failed first]) */
    int interrupted = 0;     /* signal that stopped nbrun */
    bool stopping = false;
    double kill_at = 0, drain_until = 0;
    struct pollfd *fds = calloc((size_t)(1 + 2 * nkids), sizeof *fds);
    stream **who = calloc((size_t)(1 + 2 * nkids), sizeof *who);
    child **owner = calloc((size_t)(1 + 2 * nkids), sizeof *owner);
    if (!fds || !who || !owner) {
        fprintf(stderr, "nbrun: out of memory\n");
        exit(1);
    }

    for (;;) {
        int n = 0;
        fds[n++] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < nkids; i++) {
            stream *ss[2] = {&kids[i].out, &kids[i].err};
            for (int k = 0; k < 2; k++) {
                if (ss[k]->fd < 0) continue;
                who[n] = ss[k];
                owner[n] = &kids[i];
                fds[n++] = (struct pollfd){ss[k]->fd, POLLIN, 0};
            }
        }
        if (live == 0 && n == 1) break;
        double now = now_s();
        if (live == 0 && drain_until == 0) drain_until = now + DRAIN_AFTER_EXIT_S;
        if (live == 0 && now >= drain_until) break; /* a grandchild holds a pipe open */
        double wake = 1e9;
        if (stopping && kill_at > now) wake = kill_at - now;
        if (exited >= 0 && decide_at - now < wake) wake = decide_at > now ? decide_at - now : 0;
        if (live == 0) wake = drain_until - now;
        int ms = wake > 1e6 ? -1 : (int)(wake * 1000) + 1;
        if (poll(fds, (nfds_t)n, ms) < 0 && errno != EINTR) {
            perror("nbrun: poll");
            break;
        }
        for (int i = 1; i < n; i++)
            if (fds[i].revents) pump(owner[i], who[i]);
        struct signalfd_siginfo si;
        pid_t chld_pid = 0; /* the child of the SIGCHLD read now: the first to change state */
        while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
            if (si.ssi_signo == SIGCHLD) {
                if (!chld_pid) chld_pid = (pid_t)si.ssi_pid;
                continue;
            }
            if (stopping && interrupted) { /* second interrupt: no more grace */
                signal_all(SIGKILL);
                continue;
            }
            if (!interrupted && first < 0) interrupted = (int)si.ssi_signo;
            if (!stopping) {
                stopping = true;
                kill_at = now_s() + grace;
                signal_all(SIGTERM);
            }
        }
        int status;
        pid_t pid;
        /* Children that died close together are reaped together, in the
         * kernel's order, not theirs: when a peer's death makes the others
         * fail within milliseconds, the one that died first is the child
         * named by the pending SIGCHLD (a second SIGCHLD merges into it). */
        int batch_first = -1;
        while ((pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED)) > 0) {
            for (int i = 0; i < nkids; i++) {
                if (kids[i].pid != pid || !kids[i].running) continue;
                if (WIFSTOPPED(status) || WIFCONTINUED(status)) {
                    /* a resume is forgotten, unless nbrun's own SIGCONT (stopping) caused it */
                    if (WIFSTOPPED(status)) kids[i].stop_sig = WSTOPSIG(status);
                    else if (!stopping) kids[i].stop_sig = 0;
                    note_stop(&kids[i], status);
                    continue;
                }
                kids[i].running = false;
                kids[i].status = status;
                live--;
                /* Reap what it left in its process group along with it. */
                kill(-pid, SIGKILL);
                bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
                /* Note [Who failed first]: a rank killed by a signal outranks one that
                 * exited; among equals the pending SIGCHLD's child came first */
                bool killed = WIFSIGNALED(status);
                bool held_killed = batch_first >= 0 && WIFSIGNALED(kids[batch_first].status);
                bool outranks = killed && !held_killed;
                bool earlier = pid == chld_pid && (killed || !held_killed);
                if (failed && first < 0 && !stopping &&
                    (exited < 0 ? batch_first < 0 || outranks || earlier : outranks))
                    batch_first = i;
            }
        }
        if (batch_first >= 0 && exited < 0 && !WIFSIGNALED(kids[batch_first].status)) {
            exited = batch_first;
            decide_at = now_s() + FIRST_WINDOW_S;
            batch_first = -1;
        }
        if (batch_first < 0 && exited >= 0 && first < 0 && !stopping && now_s() >= decide_at) batch_first = exited;
        if (batch_first >= 0) {
            first = batch_first;
            exited = -1;
            stopping = true;
            kill_at = now_s() + grace;
            signal_all(SIGTERM);
        }
        if (stopping && live > 0 && now_s() >= kill_at) {
            signal_all(SIGKILL);
            kill_at = now_s() + 3600;
        }
    }
    free(fds);
    free(who);
    free(owner);
    if (first < 0) first = exited; /* every process ended within the window */
    *first_out = first;
    *interrupted_out = interrupted;
}

/* Which rank failed first and how, then the last lines of its stderr. */
static void report_failure(int first) {
    char line[512];
    child *c = &kids[first];
    char how[128];
    describe_status(c->status, how, sizeof how);
    int others = 0;
    for (int i = 0; i < nkids; i++) others += i != first;
    int n = snprintf(line, sizeof line, "nbrun: rank %d (local rank %d, pid %d) failed first: %s%s\n",
                     c->rank, c->local_rank, (int)c->pid, how, others ? "; the other ranks were stopped" : "");
    write_all(2, line, (size_t)n);
    if (c->tail_count == 0) {
        n = snprintf(line, sizeof line, "nbrun: rank %d wrote nothing to stderr\n", c->rank);
        write_all(2, line, (size_t)n);
        return;
    }
    n = snprintf(line, sizeof line, "nbrun: last %d line%s of rank %d's stderr:\n", c->tail_count,
                 c->tail_count == 1 ? "" : "s", c->rank);
    write_all(2, line, (size_t)n);
    int start = (c->tail_next - c->tail_count + TAIL_LINES) % TAIL_LINES;
    for (int k = 0; k < c->tail_count; k++) {
        const char *t = c->tail[(start + k) % TAIL_LINES];
        n = snprintf(line, sizeof line, "  [rank %d] ", c->rank);
        write_all(2, line, (size_t)n);
        write_all(2, t, strlen(t));
        write_all(2, "\n", 1);
    }
}

/* "nbrun: restart k of N after: <cause>": the first failure, its last
 * stderr line (where a program names the dead or silent peer), and any
 * process that was stopped when the generation ended. */
static void announce_restart(int first, int restart, int max_restarts) {
    char line[2048];
    child *c = &kids[first];
    char how[128];
    describe_status(c->status, how, sizeof how);
    int n = snprintf(line, sizeof line, "nbrun: restart %d of %d after: rank %d (local rank %d, pid %d) %s",
                     restart, max_restarts, c->rank, c->local_rank, (int)c->pid, how);
    if (c->tail_count > 0 && (size_t)n < sizeof line) {
        const char *last = c->tail[(c->tail_next - 1 + TAIL_LINES) % TAIL_LINES];
        n += snprintf(line + n, sizeof line - (size_t)n, " (\"%.1200s\")", last);
    }
    for (int i = 0; i < nkids && (size_t)n < sizeof line; i++)
        if (kids[i].stop_sig)
            n += snprintf(line + n, sizeof line - (size_t)n, "; rank %d had been stopped by signal %d (%s)",
                          kids[i].rank, kids[i].stop_sig, strsignal(kids[i].stop_sig));
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    write_all(2, line, (size_t)n);
}

int main(int argc, char **argv) {
    options o = parse_options(argc, argv);
    store_on_unix(&o); /* NABLA_STORE_TRANSPORT checked before anything starts */
    atexit(forget_store_path);
    prepare_secret(&o);
    char base_id[128];
    make_run_id(&o, base_id, sizeof base_id);

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) {
        perror("nbrun: signalfd");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    open_lifeline();

    plan_cpu_binding(&o);

    double grace = 5.0;
    const char *g = getenv("NBRUN_GRACE");
    if (g && *g) {
        char *end;
        double v = strtod(g, &end);
        if (end == g || *end || v < 0) die_usage("NBRUN_GRACE='%s' is not a number of seconds", g);
        grace = v;
    }

    nkids = o.nproc;
    kids = calloc((size_t)nkids, sizeof *kids);
    if (!kids) return 1;
    int first = -1, interrupted = 0, gen = -1;
    if (o.elastic) rdzv_open(&o, base_id);
    for (int restart = 0;; restart++) {
        int store_fd = -1, store_port = 0;
        gen = o.elastic ? rdzv_round(&o, sfd, gen, &store_fd, &store_port) : restart;
        start_generation(&o, base_id, gen, store_fd, store_port);
        supervise(sfd, grace, &first, &interrupted);
        if (first < 0 || interrupted || restart == o.max_restarts) break;
        report_failure(first);
        announce_restart(first, restart + 1, o.max_restarts);
        free_generation();
    }
    if (o.elastic) rdzv_close(&o, first < 0 && !interrupted);

    int code = 0;
    if (first >= 0) {
        code = exit_code(kids[first].status);
        if (o.max_restarts > 0) {
            char line[160];
            int n = snprintf(line, sizeof line, "nbrun: no restart left (--max-restarts %d): the run fails\n",
                             o.max_restarts);
            write_all(2, line, (size_t)n);
        }
        report_failure(first);
    } else if (interrupted) {
        char line[256];
        code = 128 + interrupted;
        int n = snprintf(line, sizeof line, "nbrun: stopped by signal %d (%s); all ranks were stopped\n",
                         interrupted, strsignal(interrupted));
        write_all(2, line, (size_t)n);
    }
    free_generation();
    free(kids);
    return code;
}
