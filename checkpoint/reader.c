/* Reading safetensors files: open (length, header, validation against the
 * file's real size), entry and metadata access, reading one tensor, and the
 * strict load that reports missing and unexpected keys.
 *
 * The size of the file is taken once at open; the header is checked
 * against it before anything else is read, so a lying header can never
 * make us seek or read past the end. A file that shrinks while open gives
 * a short read, reported as NB_ERR_IO.
 *
 * A tensor on a CUDA device is read into a host buffer, converted there to
 * its dtype, and copied to the device: straight into a contiguous tensor
 * of the file's dtype, else through a scratch tensor of that device and
 * nb_copy_, which takes any strides.
 *
 * Note [Values checked at load]
 * Every floating-point tensor read is scanned, on the host bytes just read,
 * before anything else happens to them: a NaN or an infinity refuses the
 * load (NB_ERR_FORMAT naming the file, the tensor, the element and its
 * value) unless nb_checkpoint_set_allow_nonfinite allows it. A diverged run
 * saves NaN parameters; resumed from, it would train on NaN for ever, each
 * step skipped, while looking alive. With second_moments (set by
 * nb_checkpoint_load_training when it loads an Adam or AdamW optimizer),
 * the second moments "optim.state.*exp_avg_sq" must also be >= 0: Adam
 * takes their square root, and a negative one can come only from a damaged
 * file. The scan costs one pass over bytes already in memory.
 *
 * No checksum is stored. The header precedes the data, so a checksum in it
 * needs a second pass over every tensor at save (a second copy from a GPU)
 * or a header rewritten after the data; and it would protect against the
 * storage, which file systems and transfers already check, while the
 * failure seen in practice is a run that diverged and saved well-formed
 * NaN. Files of other tools carry none either. A damaged byte that leaves a
 * finite value is therefore loaded. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/safetensors.h"
#include "tensor/backend.h"
#include "tensor/internal.h"
#include "util/handle.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint/reader.c reads little-endian data into host memory"
#endif

struct nb_checkpoint {
    FILE *f;
    char *path;
    uint64_t size;
    nb__st_header h;
    bool allow_nonfinite, second_moments; /* Note [Values checked at load] */
};

nb_status nb_checkpoint_open(const char *path, nb_checkpoint **out) {
    NB_CHECK(path && out, "nb_checkpoint_open: NULL argument");
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return nb_set_error(errno == ENOENT ? NB_ERR_NOT_FOUND : NB_ERR_IO, "%s: cannot open: %s",
                            path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return nb_set_error(NB_ERR_IO, "%s: not a regular file", path);
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        fclose(f);
        return nb_set_error(NB_ERR_FORMAT, "%s: truncated: the file has %llu bytes, fewer than "
                            "the 8-byte header length", path, (unsigned long long)size);
    }
    unsigned char len8[8];
    if (fread(len8, 1, 8, f) != 8) {
        fclose(f);
        return nb_set_error(NB_ERR_IO, "%s: cannot read the header length", path);
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
    if (n > NB_CHECKPOINT_MAX_HEADER) {
        fclose(f);
        return nb_set_error(NB_ERR_FORMAT, "%s: header length %llu is larger than the %u-byte "
                            "limit (not a safetensors file, or a corrupt one)", path,
                            (unsigned long long)n, NB_CHECKPOINT_MAX_HEADER);
    }
    if (n > size - 8) {
        fclose(f);
        return nb_set_error(NB_ERR_FORMAT, "%s: truncated: the header length says %llu bytes but "
                            "only %llu follow", path, (unsigned long long)n,
                            (unsigned long long)(size - 8));
    }
    char *json = malloc(n ? (size_t)n : 1);
    if (!json) {
        fclose(f);
        return nb_set_error(NB_ERR_NOMEM, "%s: out of memory for a %llu-byte header", path,
                            (unsigned long long)n);
    }
    if (fread(json, 1, (size_t)n, f) != n) {
        free(json);
        fclose(f);
        return nb_set_error(NB_ERR_IO, "%s: short read of the %llu-byte header", path,
                            (unsigned long long)n);
    }
    nb_checkpoint *ck = calloc(1, sizeof *ck);
    char *p = malloc(strlen(path) + 1);
    if (!ck || !p) {
        free(ck);
        free(p);
        free(json);
        fclose(f);
        return nb_set_error(NB_ERR_NOMEM, "%s: out of memory", path);
    }
    strcpy(p, path);
    nb_status st = nb__st_parse_header(json, (size_t)n, 8 + n, size - 8 - n, path, &ck->h);
    free(json);
    if (st != NB_OK) {
        free(p);
        free(ck);
        fclose(f);
        return st;
    }
    ck->f = f;
    ck->path = p;
    ck->size = size;
    *out = ck;
    return NB_OK;
}

void nb_checkpoint_close(nb_checkpoint *ck) {
    if (!ck) return;
    fclose(ck->f);
    nb__st_header_free(&ck->h);
    free(ck->path);
    free(ck);
}

NB__HANDLE_GETTER(const char *, nb_checkpoint_path, const nb_checkpoint, ck, "checkpoint", ck->path)
NB__HANDLE_GETTER(int, nb_checkpoint_count, const nb_checkpoint, ck, "checkpoint", ck->h.n)

const nb_checkpoint_entry *nb_checkpoint_entry_at(const nb_checkpoint *ck, int i) {
    NB__CHECK_HANDLE("nb_checkpoint_entry_at", ck, "checkpoint");
    NB_CHECK(i >= 0 && i < ck->h.n, "nb_checkpoint_entry_at: index %d out of range (%d entries)",
             i, ck->h.n);
    return &ck->h.entries[i];
}

const nb_checkpoint_entry *nb_checkpoint_find(const nb_checkpoint *ck, const char *name) {
    NB__CHECK_HANDLE("nb_checkpoint_find", ck, "checkpoint");
    int i = nb__st_find(&ck->h, name);
    return i < 0 ? NULL : &ck->h.entries[i];
}

NB__HANDLE_GETTER(int, nb_checkpoint_meta_count, const nb_checkpoint, ck, "checkpoint",
                  ck->h.n_meta)

nb_kv nb_checkpoint_meta_at(const nb_checkpoint *ck, int i) {
    NB__CHECK_HANDLE("nb_checkpoint_meta_at", ck, "checkpoint");
    NB_CHECK(i >= 0 && i < ck->h.n_meta, "nb_checkpoint_meta_at: index %d out of range (%d "
             "entries)", i, ck->h.n_meta);
    return ck->h.meta[i];
}

const char *nb_checkpoint_meta(const nb_checkpoint *ck, const char *key) {
    NB__CHECK_HANDLE("nb_checkpoint_meta", ck, "checkpoint");
    for (int i = 0; i < ck->h.n_meta; i++)
        if (strcmp(ck->h.meta[i].key, key) == 0) return ck->h.meta[i].value;
    return NULL;
}

static bool same_shape(const nb_checkpoint_entry *e, const nb_tensor *t) {
    if (e->ndim != t->ndim) return false;
    for (int d = 0; d < e->ndim; d++)
        if (e->shape[d] != t->shape[d]) return false;
    return true;
}

static double element(nb_dtype dtype, const unsigned char *p) {
    float f;
    double d;
    uint16_t h;
    switch (dtype) {
    case NB_F32: memcpy(&f, p, 4); return f;
    case NB_F64: memcpy(&d, p, 8); return d;
    case NB_BF16: memcpy(&h, p, 2); return nb_bf16_to_f32(h);
    case NB_F16: memcpy(&h, p, 2); return nb_f16_to_f32(h);
    default: return 0;
    }
}

/* Note [Values checked at load]: the first of `count` elements of `data`
 * (host bytes in e's dtype) that is not finite, or negative when
 * `nonneg`; they are elements [first, first + count) of e, which the
 * message names with its shape. */
static nb_status check_values(const nb_checkpoint *ck, const nb_checkpoint_entry *e, int64_t first,
                              int64_t count, const void *data, bool nonneg) {
    if (!nb_dtype_is_float(e->dtype) || (ck->allow_nonfinite && !nonneg)) return NB_OK;
    size_t size = nb_dtype_size(e->dtype);
    int64_t bad = -1;
    const unsigned char *p = data;
    double v = 0;
    for (int64_t i = 0; i < count && bad < 0; i++) {
        v = element(e->dtype, p + (size_t)i * size);
        if ((!ck->allow_nonfinite && !isfinite(v)) || (nonneg && v < 0)) bad = i;
    }
    if (bad < 0) return NB_OK;
    int64_t index[NB_MAX_DIMS], rest = first + bad;
    for (int d = e->ndim - 1; d >= 0; d--) {
        index[d] = rest % e->shape[d];
        rest /= e->shape[d];
    }
    char q[96], at[160];
    snprintf(at, sizeof at, "%s", nb__shape_str_n(e->ndim, index));
    if (isfinite(v)) /* then only the sign can be wrong */
        return nb_set_error(NB_ERR_FORMAT, "%s: tensor \"%s\" %s: element %s is %g, negative: a "
                            "second moment of Adam is a mean of squares, so the file is damaged",
                            ck->path, nb__st_quote(e->name, q, sizeof q),
                            nb__shape_str_n(e->ndim, e->shape), at, v);
    return nb_set_error(NB_ERR_FORMAT, "%s: tensor \"%s\" %s: element %s is %g, not finite: the "
                        "run that saved it had diverged, or the file is damaged; refused "
                        "(nb_checkpoint_set_allow_nonfinite, or allow_nonfinite in the load "
                        "options, loads it anyway)", ck->path, nb__st_quote(e->name, q, sizeof q),
                        nb__shape_str_n(e->ndim, e->shape), at, v);
}

static bool is_second_moment(const nb_checkpoint *ck, const char *name) {
    if (!ck->second_moments || strncmp(name, "optim.state.", 12) != 0) return false;
    size_t n = strlen(name), k = strlen("exp_avg_sq");
    return n >= k && strcmp(name + n - k, "exp_avg_sq") == 0;
}

void nb_checkpoint_set_allow_nonfinite(nb_checkpoint *ck, bool allow) {
    NB__CHECK_HANDLE("nb_checkpoint_set_allow_nonfinite", ck, "checkpoint");
    ck->allow_nonfinite = allow;
}

void nb__checkpoint_set_second_moments(nb_checkpoint *ck, bool on) { ck->second_moments = on; }

void nb__checkpoint_copy_in(nb_tensor *dst, nb_dtype dtype, void *buf) {
    nb_tensor src = {0};
    src.dtype = dtype;
    src.device = nb_cpu();
    src.ndim = dst->ndim;
    memcpy(src.shape, dst->shape, sizeof src.shape);
    nb__contig_strides(src.ndim, src.shape, src.strides);
    src.data = buf;
    nb_copy_(dst, &src); /* waits for a device before buf goes */
}

/* The entry named `name`, or NULL with NB_ERR_NOT_FOUND set. */
static const nb_checkpoint_entry *find_entry(nb_checkpoint *ck, const char *name) {
    int i = nb__st_find(&ck->h, name);
    if (i >= 0) return &ck->h.entries[i];
    char q[96];
    nb_set_error(NB_ERR_NOT_FOUND, "%s: no tensor named \"%s\"", ck->path, nb__st_quote(name, q, sizeof q));
    return NULL;
}

static nb_status read_entry(nb_checkpoint *ck, const nb_checkpoint_entry *e, nb_tensor *dst) {
    if (e->nbytes == 0) return NB_OK;
    /* Straight into dst when it is host memory of the stored layout;
     * otherwise through a host buffer that nb_copy_ converts and uploads. */
    bool direct = dst->dtype == e->dtype && nb_is_contiguous(dst) &&
                  !nb__backend_at(dst)->device_memory;
    void *buf = direct ? dst->data : malloc((size_t)e->nbytes);
    if (direct) nb__values_written(NULL); /* Note [Parameter shadows] in tensor/shadow.c */
    char q[96];
    if (!buf)
        return nb_set_error(NB_ERR_NOMEM, "%s: out of memory reading tensor \"%s\" (%llu bytes)",
                            ck->path, nb__st_quote(e->name, q, sizeof q),
                            (unsigned long long)e->nbytes);
    if (fseeko(ck->f, (off_t)e->offset, SEEK_SET) != 0 ||
        fread(buf, 1, (size_t)e->nbytes, ck->f) != e->nbytes) {
        if (!direct) free(buf);
        return nb_set_error(NB_ERR_IO, "%s: short read of tensor \"%s\" (%llu bytes at offset "
                            "%llu): the file changed or shrank while open", ck->path,
                            nb__st_quote(e->name, q, sizeof q), (unsigned long long)e->nbytes,
                            (unsigned long long)e->offset);
    }
    nb_status st = check_values(ck, e, 0, (int64_t)(e->nbytes / nb_dtype_size(e->dtype)), buf,
                                is_second_moment(ck, e->name));
    if (st != NB_OK) {
        if (!direct) free(buf);
        return st;
    }
    if (!direct) {
        nb__checkpoint_copy_in(dst, e->dtype, buf);
        free(buf);
    }
    return NB_OK;
}

nb_status nb_checkpoint_read(nb_checkpoint *ck, const char *name, nb_tensor *dst) {
    NB__CHECK_HANDLE("nb_checkpoint_read", ck, "checkpoint");
    NB_CHECK(ck && name && dst, "nb_checkpoint_read: NULL argument");
    char q[96];
    const nb_checkpoint_entry *e = find_entry(ck, name);
    if (!e) return NB_ERR_NOT_FOUND;
    if (!same_shape(e, dst))
        return nb_set_error(NB_ERR_MISMATCH, "%s: tensor \"%s\" has shape %s in the file, the "
                            "destination has %s", ck->path, nb__st_quote(name, q, sizeof q),
                            nb__shape_str_n(e->ndim, e->shape), nb_shape_str(dst));
    return read_entry(ck, e, dst);
}

nb_status nb__checkpoint_read_elements(nb_checkpoint *ck, const char *name, int64_t first, int64_t count,
                                       void *buf, const nb_checkpoint_entry *whole, int64_t whole_first) {
    char q[96];
    const nb_checkpoint_entry *e = find_entry(ck, name);
    if (!e) return NB_ERR_NOT_FOUND;
    size_t size = nb_dtype_size(e->dtype);
    NB_CHECK(first >= 0 && count >= 0 && (uint64_t)(first + count) * size <= e->nbytes,
             "nb__checkpoint_read_elements: elements [%lld, %lld) of \"%s\" (%llu bytes)", (long long)first,
             (long long)(first + count), nb__st_quote(name, q, sizeof q), (unsigned long long)e->nbytes);
    if (count == 0) return NB_OK;
    uint64_t at = e->offset + (uint64_t)first * size, bytes = (uint64_t)count * size;
    if (fseeko(ck->f, (off_t)at, SEEK_SET) != 0 || fread(buf, 1, (size_t)bytes, ck->f) != bytes)
        return nb_set_error(NB_ERR_IO, "%s: short read of tensor \"%s\" (%llu bytes at offset "
                            "%llu): the file changed or shrank while open", ck->path,
                            nb__st_quote(name, q, sizeof q), (unsigned long long)bytes, (unsigned long long)at);
    if (!whole) whole = e, whole_first = first;
    return check_values(ck, whole, whole_first, count, buf, is_second_moment(ck, whole->name));
}

/* Appends `name` to a list of at most `max` names ("a", "b", ... and k more). */
static void list_add(nb_strbuf *b, int *count, const char *name) {
    enum { MAX_LISTED = 6 };
    char q[96];
    if (*count < MAX_LISTED) {
        nb__strbuf_printf(b, "%s\"%s\"", *count ? ", " : "", nb__st_quote(name, q, sizeof q));
    }
    (*count)++;
}

static void list_end(nb_strbuf *b, int count) {
    if (count > 6) nb__strbuf_printf(b, " and %d more", count - 6);
}

static int cmp_named(const void *a, const void *b) {
    return strcmp((*(const nb_named_tensor *const *)a)->name,
                  (*(const nb_named_tensor *const *)b)->name);
}

void nb__checkpoint_check_targets(const char *who, const nb_named_tensor *tensors, int n,
                                  void *free_on_abort) {
    NB_CHECK(n >= 0 && (n == 0 || tensors), "%s: bad tensor list (n = %d)", who, n);
    for (int i = 0; i < n; i++)
        if (!tensors[i].name || !tensors[i].tensor) {
            free(free_on_abort);
            NB_ABORT("%s: entry %d has a NULL name or tensor", who, i);
        }
    if (n < 2) return;
    const nb_named_tensor **sorted = malloc(sizeof *sorted * (size_t)n);
    NB_CHECK(sorted, "%s: out of memory", who);
    for (int i = 0; i < n; i++) sorted[i] = &tensors[i];
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_named);
    char dup[96] = "";
    for (int i = 1; i < n && !dup[0]; i++)
        if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0)
            nb__st_quote(sorted[i]->name, dup, sizeof dup);
    free(sorted);
    if (dup[0]) {
        free(free_on_abort);
        NB_ABORT("%s: two tensors are named \"%s\"", who, dup);
    }
}

nb_status nb__checkpoint_match(const char *path, const nb__st_header *h, const nb_named_tensor *tensors,
                               int n, const char *ignore_prefix) {
    nb__checkpoint_check_targets("nb_checkpoint_load", tensors, n, NULL);
    bool *used = calloc((size_t)(h->n ? h->n : 1), 1);
    NB_CHECK(used, "nb_checkpoint_load: out of memory");

    nb_strbuf missing = {0}, unexpected = {0}, mismatch = {0};
    int n_missing = 0, n_unexpected = 0, n_mismatch = 0;
    for (int i = 0; i < n; i++) {
        const nb_tensor *t = tensors[i].tensor;
        int j = nb__st_find(h, tensors[i].name);
        if (j < 0) {
            list_add(&missing, &n_missing, tensors[i].name);
            continue;
        }
        used[j] = true;
        const nb_checkpoint_entry *e = &h->entries[j];
        char q[96];
        if (!same_shape(e, t)) {
            if (n_mismatch++ < 4)
                nb__strbuf_printf(&mismatch, "; shape mismatch for \"%s\": %s in the file, %s in "
                                  "the tensor", nb__st_quote(e->name, q, sizeof q),
                                  nb__shape_str_n(e->ndim, e->shape), nb_shape_str(t));
        } else if (e->dtype != t->dtype) {
            if (n_mismatch++ < 4)
                nb__strbuf_printf(&mismatch, "; dtype mismatch for \"%s\": %s in the file, %s in "
                                  "the tensor", nb__st_quote(e->name, q, sizeof q),
                                  nb__st_dtype_name(e->dtype), nb__st_dtype_name(t->dtype));
        }
    }
    size_t prefix_len = ignore_prefix ? strlen(ignore_prefix) : 0;
    for (int j = 0; j < h->n; j++) {
        const char *name = h->entries[j].name;
        if (used[j] || (ignore_prefix && strncmp(name, ignore_prefix, prefix_len) == 0)) continue;
        list_add(&unexpected, &n_unexpected, name);
    }
    free(used);
    nb_status st = NB_OK;
    if (n_missing || n_unexpected || n_mismatch) {
        list_end(&missing, n_missing);
        list_end(&unexpected, n_unexpected);
        if (n_mismatch > 4) nb__strbuf_printf(&mismatch, "; and %d more mismatches", n_mismatch - 4);
        nb_strbuf parts = {0}; /* only the kinds of error there are, each after "; " */
        if (n_missing) nb__strbuf_printf(&parts, "; missing key(s) (%d): %s", n_missing,
                                         missing.data ? missing.data : "?");
        if (n_unexpected)
            nb__strbuf_printf(&parts, "; unexpected key(s) (%d): %s", n_unexpected,
                              unexpected.data ? unexpected.data : "?");
        if (n_mismatch) nb__strbuf_printf(&parts, "%s", mismatch.data ? mismatch.data : "; ?");
        st = nb_set_error(NB_ERR_MISMATCH, "%s: error(s) loading %d tensors, nothing was read: %s",
                          path, n, parts.data && parts.len > 2 ? parts.data + 2 : "(out of memory)");
        nb__strbuf_free(&parts);
    }
    nb__strbuf_free(&missing);
    nb__strbuf_free(&unexpected);
    nb__strbuf_free(&mismatch);
    return st;
}

nb_status nb__checkpoint_read_strict(nb_checkpoint *ck, const nb_named_tensor *tensors, int n,
                                     const char *ignore_prefix) {
    NB_CHECK(ck, "nb_checkpoint_load: NULL checkpoint");
    nb_status st = nb__checkpoint_match(ck->path, &ck->h, tensors, n, ignore_prefix);
    for (int i = 0; i < n && st == NB_OK; i++)
        st = read_entry(ck, &ck->h.entries[nb__st_find(&ck->h, tensors[i].name)],
                        tensors[i].tensor);
    return st;
}

nb_status nb_checkpoint_read_strict(nb_checkpoint *ck, const nb_named_tensor *tensors, int n) {
    NB__CHECK_HANDLE("nb_checkpoint_read_strict", ck, "checkpoint");
    return nb__checkpoint_read_strict(ck, tensors, n, NULL);
}

nb_status nb_checkpoint_load(const char *path, const nb_named_tensor *tensors, int n) {
    nb__checkpoint_check_targets("nb_checkpoint_load", tensors, n, NULL); /* before opening */
    nb_checkpoint *ck;
    nb_status st = nb_checkpoint_open(path, &ck);
    if (st != NB_OK) return st;
    st = nb_checkpoint_read_strict(ck, tensors, n);
    nb_checkpoint_close(ck);
    return st;
}
