/* nb_checkpoint_save: a safetensors file, written atomically.
 *
 * Note [Atomic save]
 * The file is written to "<path>.tmp.<host>.<pid>.<n>" (same directory, so
 * the rename cannot cross file systems), created with O_EXCL and mode 0666
 * before the umask like any new file; then fflush, fsync, fclose,
 * rename(tmp, path), and an fsync of the directory so that the rename
 * itself is durable. Until the rename the old file is untouched; rename
 * replaces it in one step; any failure before it removes the temporary
 * file. A crash mid-write can leave a stale temporary file behind, never a
 * half-written checkpoint under `path`. The header is padded with spaces
 * to a multiple of 8 bytes (with the length field), so the data section
 * starts 8-byte aligned, as the format's reference writer does.
 *
 * Note [Stale temporary files]
 * A writer killed outright (kill -9, the OOM killer, a power cut) leaves
 * its temporary file, as large as the checkpoint. After each successful
 * save, the directory is scanned for temporary files of the same `path`
 * whose writer is certainly gone, and those are removed:
 * - only names of exactly our pattern "<basename>.tmp.<host>.<pid>.<n>"
 *   for this `path` (<host>: this machine's name with every character but
 *   letters, digits, '-' and '_' made '_', so the name splits at dots);
 * - only those of this host: on a shared file system another machine's
 *   pid means nothing here, so its temporaries are left to its own saves;
 * - only those whose pid is not a process: kill(pid, 0) fails with ESRCH.
 *   A live pid (ours included: another thread may be saving the same
 *   path), or an answer like EPERM (another user's process) keeps it.
 * A pid reused since the crash keeps the stale file until that process
 * ends, which errs on the safe side; a live writer is never touched. What
 * this cannot tell apart: two containers with the same host name, separate
 * pid namespaces and one shared directory (give them distinct host names).
 * Names of other forms, including the "<path>.tmp.<pid>.<n>" of earlier
 * versions, are left alone. The cleanup is best effort: it never turns a
 * successful save into a failure.
 *
 * Missing folders above `path` are made first: Note [Missing folders].
 *
 * Tensors on a CUDA device (or not contiguous) are written through a host
 * staging buffer filled by nb_to_host, which waits for the device. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/safetensors.h"
#include "tensor/backend.h"
#include "tensor/internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint/writer.c writes host memory as little-endian data"
#endif

#define WRITE_CHUNK ((size_t)16 << 20)

static _Thread_local nb__st_fault_fn fault_fn;
static _Thread_local void *fault_user;

void nb__st_set_fault(nb__st_fault_fn fn, void *user) {
    fault_fn = fn;
    fault_user = user;
}

typedef struct out_file {
    FILE *f;
    const char *tmp;
    uint64_t offset;
} out_file;

static bool write_bytes(out_file *o, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        size_t k = n < WRITE_CHUNK ? n : WRITE_CHUNK;
        if (fault_fn && fault_fn(o->offset, k, fault_user)) {
            errno = EIO;
            return false;
        }
        if (fwrite(c, 1, k, o->f) != k) return false;
        c += k;
        n -= k;
        o->offset += k;
    }
    return true;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Sorts names[0, n) and copies one that appears twice into dup (quoted),
 * or leaves dup empty. */
static void find_duplicate(const char **names, int n, char *dup, size_t cap) {
    dup[0] = 0;
    qsort(names, (size_t)n, sizeof *names, cmp_str_ptr);
    for (int i = 1; i < n && !dup[0]; i++)
        if (strcmp(names[i - 1], names[i]) == 0) nb__st_quote(names[i], dup, cap);
}

/* Argument checks; every abort happens with nothing allocated. */
static void check_args(const char *path, const nb_named_tensor *tensors, int n, const nb_kv *meta,
                       int n_meta) {
    NB_CHECK(path && path[0], "nb_checkpoint_save: no path given");
    NB_CHECK(n >= 0 && (n == 0 || tensors), "nb_checkpoint_save: bad tensor list (n = %d)", n);
    NB_CHECK(n_meta >= 0 && (n_meta == 0 || meta), "nb_checkpoint_save: bad metadata list "
             "(n_meta = %d)", n_meta);
    char q[96];
    for (int i = 0; i < n; i++) {
        const char *name = tensors[i].name;
        NB_CHECK(name, "nb_checkpoint_save: tensor %d has no name", i);
        NB_CHECK(nb__utf8_valid(name, strlen(name)), "nb_checkpoint_save: tensor name \"%s\" is "
                 "not valid UTF-8", nb__st_quote(name, q, sizeof q));
        NB_CHECK(strcmp(name, "__metadata__") != 0, "nb_checkpoint_save: \"__metadata__\" is "
                 "reserved and cannot name a tensor");
        NB_CHECK(tensors[i].tensor, "nb_checkpoint_save: tensor \"%s\" is NULL",
                 nb__st_quote(name, q, sizeof q));
    }
    for (int i = 0; i < n_meta; i++) {
        const char *k = meta[i].key, *v = meta[i].value;
        NB_CHECK(k && v, "nb_checkpoint_save: metadata entry %d has a NULL key or value", i);
        NB_CHECK(nb__utf8_valid(k, strlen(k)) && nb__utf8_valid(v, strlen(v)),
                 "nb_checkpoint_save: metadata \"%s\" is not valid UTF-8",
                 nb__st_quote(k, q, sizeof q));
    }
    const char **names = malloc(sizeof *names * (size_t)(n > n_meta ? n : n_meta) + 1);
    NB_CHECK(names, "nb_checkpoint_save: out of memory");
    char dup_tensor[96], dup_meta[96];
    for (int i = 0; i < n; i++) names[i] = tensors[i].name;
    find_duplicate(names, n, dup_tensor, sizeof dup_tensor);
    for (int i = 0; i < n_meta; i++) names[i] = meta[i].key;
    find_duplicate(names, n_meta, dup_meta, sizeof dup_meta);
    free(names);
    NB_CHECK(!dup_tensor[0], "nb_checkpoint_save: two tensors are named \"%s\"", dup_tensor);
    NB_CHECK(!dup_meta[0], "nb_checkpoint_save: two metadata entries are named \"%s\"", dup_meta);
}

static uint64_t tensor_bytes(const nb_tensor *t) {
    return (uint64_t)nb_numel(t) * nb_dtype_size(t->dtype);
}

/* The JSON header, padded so that 8 + its length is a multiple of 8. */
static bool build_header(nb_strbuf *b, const nb_named_tensor *tensors, int n, const nb_kv *meta,
                         int n_meta) {
    nb__strbuf_append(b, "{", 1);
    if (n_meta > 0) {
        nb__strbuf_append(b, "\"__metadata__\":{", 16);
        for (int i = 0; i < n_meta; i++) {
            if (i) nb__strbuf_append(b, ",", 1);
            nb__json_write_string(b, meta[i].key, strlen(meta[i].key));
            nb__strbuf_append(b, ":", 1);
            nb__json_write_string(b, meta[i].value, strlen(meta[i].value));
        }
        nb__strbuf_append(b, "}", 1);
    }
    uint64_t offset = 0;
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = tensors[i].tensor;
        if (i || n_meta > 0) nb__strbuf_append(b, ",", 1);
        nb__json_write_string(b, tensors[i].name, strlen(tensors[i].name));
        nb__strbuf_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", nb__st_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++)
            nb__strbuf_printf(b, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        uint64_t end = offset + tensor_bytes(t);
        nb__strbuf_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                          (unsigned long long)end);
        offset = end;
    }
    nb__strbuf_append(b, "}", 1);
    while ((b->len + 8) % 8 != 0) nb__strbuf_append(b, " ", 1);
    return !b->failed;
}

static nb_status write_tensor(out_file *o, const nb_tensor *t, const char *path) {
    uint64_t bytes = tensor_bytes(t);
    if (bytes == 0) return NB_OK;
    bool host = !nb__backend_at(t)->device_memory;
    if (nb_is_contiguous(t) && host) {
        if (!write_bytes(o, t->data, (size_t)bytes)) goto io_error;
        return NB_OK;
    }
    void *buf = malloc((size_t)bytes);
    if (!buf)
        return nb_set_error(NB_ERR_NOMEM, "nb_checkpoint_save: %s: out of memory for a %llu-byte "
                            "host copy of a %s tensor", path, (unsigned long long)bytes,
                            host ? "non-contiguous" : "device");
    nb_to_host(t, buf);
    bool ok = write_bytes(o, buf, (size_t)bytes);
    free(buf);
    if (ok) return NB_OK;
io_error:
    return nb_set_error(NB_ERR_IO, "nb_checkpoint_save: writing \"%s\" failed at byte %llu: %s",
                        o->tmp, (unsigned long long)o->offset, strerror(errno));
}

char *nb__st_dir_of(const char *path) {
    const char *slash = strrchr(path, '/');
    size_t n = slash ? (size_t)(slash - path) : 1;
    if (slash == path) n = 1;
    char *d = malloc(n + 1);
    if (!d) return NULL;
    if (slash) memcpy(d, path, n);
    else d[0] = '.';
    d[n] = 0;
    return d;
}

/* Note [Missing folders]
 * A save makes the folders missing above `path` (mkdir -p: each with mode
 * 0777 less the umask, as a new folder of any program), so that a run
 * given --ckpt-dir runs/a/b does not train for an epoch and then fail at
 * its first save. nb_checkpoint_make_dir is the same walk for a program
 * that wants to know at its start that its checkpoints can be written: it
 * also requires the folder to be one this process can write in. */
static nb_status make_dirs(const char *fn, const char *dir, const char *for_path) {
    size_t n = strlen(dir);
    char *buf = malloc(n + 1);
    if (!buf) return nb_set_error(NB_ERR_NOMEM, "%s: out of memory", fn);
    memcpy(buf, dir, n + 1);
    nb_status st = NB_OK;
    for (size_t i = 1; i <= n && st == NB_OK; i++) {
        if (buf[i] != '/' && buf[i] != 0) continue;
        if (buf[i - 1] == '/') continue; /* "a//b", or a trailing slash */
        char c = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0777) != 0 && errno != EEXIST)
            st = nb_set_error(NB_ERR_IO, "%s: cannot create the folder \"%s\"%s%s%s: %s", fn, buf,
                              for_path ? " for \"" : "", for_path ? for_path : "",
                              for_path ? "\"" : "", strerror(errno));
        buf[i] = c;
    }
    free(buf);
    if (st != NB_OK) return st;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return nb_set_error(NB_ERR_IO, "%s: \"%s\": %s", fn, dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return nb_set_error(NB_ERR_IO, "%s: \"%s\" exists and is not a folder", fn, dir);
    return NB_OK;
}

nb_status nb_checkpoint_make_dir(const char *dir) {
    NB_CHECK(dir && dir[0], "nb_checkpoint_make_dir: the folder is NULL or empty");
    nb_status st = make_dirs("nb_checkpoint_make_dir", dir, NULL);
    if (st == NB_OK && access(dir, W_OK | X_OK) != 0)
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_make_dir: cannot write in the folder \"%s\": %s",
                          dir, strerror(errno));
    return st;
}

/* This host's part of temporary names: Note [Stale temporary files]. */
static void host_tag(char *out, size_t n) {
    char host[256];
    if (gethostname(host, sizeof host) != 0 || !host[0]) snprintf(host, sizeof host, "host");
    host[sizeof host - 1] = 0;
    size_t k = 0;
    for (const char *c = host; *c && k + 1 < n && k < 64; c++) {
        bool keep = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                    (*c >= '0' && *c <= '9') || *c == '-' || *c == '_';
        out[k++] = keep ? *c : '_';
    }
    out[k] = 0;
}

/* The decimal number s[0, end) (no sign, no leading '+'), or -1. */
static long parse_decimal(const char *s, const char *end) {
    if (s == end || end - s > 10) return -1;
    long v = 0;
    for (; s < end; s++) {
        if (*s < '0' || *s > '9') return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

/* Removes the temporary files of `path` left by dead writers of this host:
 * Note [Stale temporary files]. */
static void remove_stale_temps(const char *path, const char *dir) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    char host[72], prefix[512];
    host_tag(host, sizeof host);
    int plen = snprintf(prefix, sizeof prefix, "%s.tmp.%s.", base, host);
    if (plen < 0 || (size_t)plen >= sizeof prefix) return;
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        const char *name = e->d_name;
        if (strncmp(name, prefix, (size_t)plen) != 0) continue;
        const char *pid_s = name + plen, *dot = strchr(pid_s, '.');
        if (!dot || parse_decimal(dot + 1, dot + 1 + strlen(dot + 1)) < 0) continue;
        long pid = parse_decimal(pid_s, dot);
        if (pid <= 0 || pid > INT_MAX) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        unlinkat(dirfd(d), name, 0); /* a failure (a racing cleaner) changes nothing */
    }
    closedir(d);
}

static int open_temp(const char *path, char *tmp, size_t n) {
    static atomic_uint counter;
    char host[72];
    host_tag(host, sizeof host);
    for (int attempt = 0; attempt < 100; attempt++) {
        unsigned k = atomic_fetch_add(&counter, 1);
        int len = snprintf(tmp, n, "%s.tmp.%s.%ld.%u", path, host, (long)getpid(), k);
        if (len < 0 || (size_t)len >= n) {
            errno = ENAMETOOLONG;
            return -1;
        }
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0 || errno != EEXIST) return fd;
    }
    return -1;
}

nb_status nb_checkpoint_save(const char *path, const nb_named_tensor *tensors, int n,
                             const nb_kv *meta, int n_meta) {
    check_args(path, tensors, n, meta, n_meta);
    nb_strbuf header = {0};
    if (!build_header(&header, tensors, n, meta, n_meta)) {
        nb__strbuf_free(&header);
        return nb_set_error(NB_ERR_NOMEM, "nb_checkpoint_save: %s: out of memory building the "
                            "header", path);
    }
    if (header.len > NB_CHECKPOINT_MAX_HEADER) {
        size_t len = header.len;
        nb__strbuf_free(&header);
        return nb_set_error(NB_ERR_INVALID, "nb_checkpoint_save: %s: the header would be %zu "
                            "bytes, more than readers accept (%u)", path, len,
                            NB_CHECKPOINT_MAX_HEADER);
    }

    size_t tmp_cap = strlen(path) + 160;
    char *tmp = malloc(tmp_cap);
    if (!tmp) {
        nb__strbuf_free(&header);
        return nb_set_error(NB_ERR_NOMEM, "nb_checkpoint_save: out of memory");
    }
    char *parent = nb__st_dir_of(path);
    nb_status st = parent ? make_dirs("nb_checkpoint_save", parent, path)
                          : nb_set_error(NB_ERR_NOMEM, "nb_checkpoint_save: out of memory");
    free(parent);
    if (st != NB_OK) {
        nb__strbuf_free(&header);
        free(tmp);
        return st;
    }
    int fd = open_temp(path, tmp, tmp_cap);
    if (fd < 0) {
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: cannot create a temporary file next to "
                          "\"%s\": %s", path, strerror(errno));
        nb__strbuf_free(&header);
        free(tmp);
        return st;
    }
    out_file o = {fdopen(fd, "wb"), tmp, 0};
    if (!o.f) {
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: fdopen of \"%s\": %s", tmp,
                          strerror(errno));
        close(fd);
        goto fail;
    }

    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)header.len >> (8 * i));
    if (!write_bytes(&o, len8, 8) || !write_bytes(&o, header.data, header.len)) {
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: writing \"%s\" failed at byte %llu: %s",
                          tmp, (unsigned long long)o.offset, strerror(errno));
        goto fail;
    }
    for (int i = 0; i < n && st == NB_OK; i++) st = write_tensor(&o, tensors[i].tensor, path);
    if (st != NB_OK) goto fail;
    if (fflush(o.f) != 0 || fsync(fileno(o.f)) != 0) {
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: flushing \"%s\" to disk failed: %s", tmp,
                          strerror(errno));
        goto fail;
    }
    FILE *f = o.f;
    o.f = NULL;
    if (fclose(f) != 0) {
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: closing \"%s\" failed: %s", tmp,
                          strerror(errno));
        goto fail;
    }
    if (rename(tmp, path) != 0) {
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: renaming \"%s\" to \"%s\" failed: %s",
                          tmp, path, strerror(errno));
        goto fail;
    }
    nb__strbuf_free(&header);
    free(tmp);

    char *dir = nb__st_dir_of(path);
    int dfd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    if (dfd < 0 || (fsync(dfd) != 0 && errno != EINVAL)) { /* EINVAL: cannot sync dirs */
        st = nb_set_error(NB_ERR_IO, "nb_checkpoint_save: \"%s\" was written, but syncing its "
                          "directory \"%s\" failed: %s", path, dir ? dir : "?", strerror(errno));
    }
    if (dfd >= 0) close(dfd);
    if (dir) remove_stale_temps(path, dir);
    free(dir);
    return st;

fail:
    if (o.f) fclose(o.f);
    unlink(tmp);
    nb__strbuf_free(&header);
    free(tmp);
    return st;
}
