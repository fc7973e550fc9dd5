/* Parsing and validation of a safetensors header (checkpoint/safetensors.h).
 *
 * The rules are those of the format's reference reader: the header is a
 * JSON object; "__metadata__", if present, maps strings to strings; every
 * other member describes one tensor with exactly the keys dtype, shape and
 * data_offsets; dtype is one nabla can hold; the byte count of
 * data_offsets is the shape's element count times the dtype's size;
 * sorted by offset, the tensors cover the data section from 0 to its end
 * with no gap and no overlap. Stricter than the reference in two ways:
 * duplicate keys anywhere are refused (a JSON reader would keep one of
 * them silently), and names or metadata containing NUL are refused
 * (they cannot be C strings). Every integer is checked for overflow
 * before it is used. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/safetensors.h"
#include "tensor/internal.h"

static const struct {
    const char *name;
    nb_dtype dtype;
} dtype_table[] = {
    {"F32", NB_F32}, {"F64", NB_F64}, {"BF16", NB_BF16},
    {"F16", NB_F16}, {"I32", NB_I32}, {"I64", NB_I64},
};
#define N_DTYPES (int)(sizeof dtype_table / sizeof dtype_table[0])

const char *nb__st_dtype_name(nb_dtype dtype) {
    for (int i = 0; i < N_DTYPES; i++)
        if (dtype_table[i].dtype == dtype) return dtype_table[i].name;
    return "?";
}

int nb__st_dtype_parse(const char *name) {
    for (int i = 0; i < N_DTYPES; i++)
        if (strcmp(name, dtype_table[i].name) == 0) return (int)dtype_table[i].dtype;
    return -1;
}

const char *nb__st_quote(const char *name, char *buf, size_t n) {
    size_t len = strlen(name), max = n > 4 ? n - 4 : 0;
    size_t k = len < max ? len : max;
    while (k < len && k > 0 && ((unsigned char)name[k] & 0xC0) == 0x80) k--; /* UTF-8 boundary */
    for (size_t i = 0; i < k; i++) {
        unsigned char c = (unsigned char)name[i];
        buf[i] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    if (k < len && n >= 4) memcpy(buf + k, "...", 3), k += 3;
    if (n) buf[k < n ? k : n - 1] = 0;
    return buf;
}

void nb__st_header_free(nb__st_header *h) {
    if (!h) return;
    nb__json_free(h->doc);
    free(h->entries);
    free(h->by_name);
    free(h->meta);
    memset(h, 0, sizeof *h);
}

typedef struct ctx {
    const char *where;
    nb__st_header *h;
} ctx;

static nb_status fail(ctx *c, nb_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static nb_status fail(ctx *c, nb_status st, const char *fmt, ...) {
    char what[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    nb__st_header_free(c->h);
    return nb_set_error(st, "%s: %s", c->where, what);
}

static bool has_nul(const char *s, size_t len) { return strlen(s) != len; }

static nb_status parse_metadata(ctx *c, const nb_json *m) {
    if (m->type != NB_JSON_OBJECT)
        return fail(c, NB_ERR_FORMAT, "__metadata__ must be an object of strings, found %s",
                    nb__json_type_name(m->type));
    nb__st_header *h = c->h;
    h->meta = calloc(m->count ? m->count : 1, sizeof *h->meta);
    if (!h->meta) return fail(c, NB_ERR_NOMEM, "out of memory for %zu metadata entries", m->count);
    char q[96];
    for (const nb_json *e = m->first; e; e = e->next) {
        if (has_nul(e->key, e->key_len))
            return fail(c, NB_ERR_FORMAT, "a metadata key contains a NUL character");
        if (e->type != NB_JSON_STRING)
            return fail(c, NB_ERR_FORMAT, "metadata value of \"%s\" is %s, not a string",
                        nb__st_quote(e->key, q, sizeof q), nb__json_type_name(e->type));
        if (has_nul(e->str, e->len))
            return fail(c, NB_ERR_FORMAT, "metadata value of \"%s\" contains a NUL character",
                        nb__st_quote(e->key, q, sizeof q));
        for (int i = 0; i < h->n_meta; i++)
            if (strcmp(h->meta[i].key, e->key) == 0)
                return fail(c, NB_ERR_FORMAT, "metadata key \"%s\" appears twice",
                            nb__st_quote(e->key, q, sizeof q));
        h->meta[h->n_meta].key = e->key;
        h->meta[h->n_meta].value = e->str;
        h->n_meta++;
    }
    return NB_OK;
}

static bool nonneg_int(const nb_json *v) {
    return v->type == NB_JSON_NUMBER && v->is_int && v->integer >= 0;
}

static nb_status parse_entry(ctx *c, const nb_json *t, uint64_t data_start, uint64_t data_bytes,
                             nb_checkpoint_entry *e) {
    char q[96];
    const char *name = nb__st_quote(t->key, q, sizeof q);
    if (has_nul(t->key, t->key_len))
        return fail(c, NB_ERR_FORMAT, "tensor name \"%s\" contains a NUL character", name);
    if (t->type != NB_JSON_OBJECT)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": expected an object, found %s", name,
                    nb__json_type_name(t->type));
    const nb_json *dtype = NULL, *shape = NULL, *offsets = NULL;
    for (const nb_json *f = t->first; f; f = f->next) {
        const nb_json **slot = strcmp(f->key, "dtype") == 0          ? &dtype
                               : strcmp(f->key, "shape") == 0        ? &shape
                               : strcmp(f->key, "data_offsets") == 0 ? &offsets
                                                                     : NULL;
        char fq[64];
        if (!slot || has_nul(f->key, f->key_len))
            return fail(c, NB_ERR_FORMAT, "tensor \"%s\": unexpected key \"%s\"", name,
                        nb__st_quote(f->key, fq, sizeof fq));
        if (*slot)
            return fail(c, NB_ERR_FORMAT, "tensor \"%s\": key \"%s\" appears twice", name, f->key);
        *slot = f;
    }
    if (!dtype || !shape || !offsets)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": missing \"%s\"", name,
                    !dtype ? "dtype" : !shape ? "shape" : "data_offsets");

    e->name = t->key;
    int code = dtype->type == NB_JSON_STRING && !has_nul(dtype->str, dtype->len) ? nb__st_dtype_parse(dtype->str) : -1;
    bool known = code >= 0;
    if (known) e->dtype = (nb_dtype)code;
    if (!known) {
        char dq[64];
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": unknown dtype %s%s%s (nabla reads F32, F64, "
                    "BF16, F16, I32, I64)", name, dtype->type == NB_JSON_STRING ? "\"" : "",
                    dtype->type == NB_JSON_STRING ? nb__st_quote(dtype->str, dq, sizeof dq)
                                                  : nb__json_type_name(dtype->type),
                    dtype->type == NB_JSON_STRING ? "\"" : "");
    }

    if (shape->type != NB_JSON_ARRAY)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": shape is %s, not an array", name,
                    nb__json_type_name(shape->type));
    if (shape->count > NB_MAX_DIMS)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": shape has %zu dimensions; nabla supports at "
                    "most %d", name, shape->count, NB_MAX_DIMS);
    e->ndim = (int)shape->count;
    uint64_t numel = 1;
    bool overflow = false;
    int d = 0;
    for (const nb_json *s = shape->first; s; s = s->next, d++) {
        if (!nonneg_int(s))
            return fail(c, NB_ERR_FORMAT, "tensor \"%s\": shape entry %d is not a non-negative "
                        "integer", name, d);
        e->shape[d] = s->integer;
        uint64_t dim = (uint64_t)s->integer;
        if (dim != 0 && numel > UINT64_MAX / dim) overflow = true;
        else numel *= dim;
    }
    for (d = 0; d < e->ndim; d++)
        if (e->shape[d] == 0) overflow = false, numel = 0; /* an empty tensor, whatever the rest */
    uint64_t size = nb_dtype_size(e->dtype);
    if (overflow || numel > UINT64_MAX / size)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": shape %s is too large", name,
                    nb__shape_str_n(e->ndim, e->shape));

    if (offsets->type != NB_JSON_ARRAY || offsets->count != 2 || !nonneg_int(offsets->first) ||
        !nonneg_int(offsets->first->next))
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": data_offsets must be [begin, end] with two "
                    "non-negative integers", name);
    uint64_t begin = (uint64_t)offsets->first->integer;
    uint64_t end = (uint64_t)offsets->first->next->integer;
    if (end < begin)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": data_offsets [%llu, %llu] end before they "
                    "begin", name, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_bytes)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": data_offsets [%llu, %llu] run past the end "
                    "of the data section (%llu bytes; the file is truncated or the header lies)",
                    name, (unsigned long long)begin, (unsigned long long)end,
                    (unsigned long long)data_bytes);
    if (end - begin != numel * size)
        return fail(c, NB_ERR_FORMAT, "tensor \"%s\": data_offsets [%llu, %llu] hold %llu bytes "
                    "but dtype %s and shape %s need %llu", name, (unsigned long long)begin,
                    (unsigned long long)end, (unsigned long long)(end - begin),
                    nb__st_dtype_name(e->dtype), nb__shape_str_n(e->ndim, e->shape),
                    (unsigned long long)(numel * size));
    e->offset = data_start + begin;
    e->nbytes = end - begin;
    return NB_OK;
}

static int cmp_offset(const void *a, const void *b) {
    const nb_checkpoint_entry *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp((*(const nb_checkpoint_entry *const *)a)->name,
                  (*(const nb_checkpoint_entry *const *)b)->name);
}

nb_status nb__st_sort_names(nb__st_header *h, const char *where) {
    int n = h->n;
    const nb_checkpoint_entry **byname = malloc(sizeof *byname * (size_t)(n ? n : 1));
    if (!byname) return nb_set_error(NB_ERR_NOMEM, "%s: out of memory", where);
    for (int i = 0; i < n; i++) byname[i] = &h->entries[i];
    qsort(byname, (size_t)n, sizeof *byname, cmp_name);
    for (int i = 0; i < n; i++) {
        if (i > 0 && strcmp(byname[i - 1]->name, byname[i]->name) == 0) {
            char q[96];
            nb__st_quote(byname[i]->name, q, sizeof q);
            free(byname);
            return nb_set_error(NB_ERR_FORMAT, "%s: tensor \"%s\" appears twice", where, q);
        }
        h->by_name[i] = (int)(byname[i] - h->entries);
    }
    free(byname);
    return NB_OK;
}

nb_status nb__st_parse_header(const char *json, size_t len, uint64_t data_start,
                              uint64_t data_bytes, const char *where, nb__st_header *out) {
    memset(out, 0, sizeof *out);
    ctx c = {where, out};
    nb_status st = nb__json_parse(json, len, &out->doc);
    if (st != NB_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", nb_last_error());
        return nb_set_error(st, "%s: the header is not valid JSON: %s", where, msg);
    }
    const nb_json *root = nb__json_root(out->doc);
    if (root->type != NB_JSON_OBJECT)
        return fail(&c, NB_ERR_FORMAT, "the header must be a JSON object, found %s",
                    nb__json_type_name(root->type));
    size_t n_tensors = 0;
    const nb_json *meta = NULL;
    for (const nb_json *m = root->first; m; m = m->next) {
        if (strcmp(m->key, "__metadata__") == 0 && !has_nul(m->key, m->key_len)) {
            if (meta) return fail(&c, NB_ERR_FORMAT, "\"__metadata__\" appears twice");
            meta = m;
        } else {
            n_tensors++;
        }
    }
    if (n_tensors > INT32_MAX) return fail(&c, NB_ERR_FORMAT, "too many tensors");
    if (meta) {
        st = parse_metadata(&c, meta);
        if (st != NB_OK) return st;
    }
    out->entries = calloc(n_tensors ? n_tensors : 1, sizeof *out->entries);
    out->by_name = calloc(n_tensors ? n_tensors : 1, sizeof *out->by_name);
    if (!out->entries || !out->by_name)
        return fail(&c, NB_ERR_NOMEM, "out of memory for %zu tensor entries", n_tensors);
    for (const nb_json *m = root->first; m; m = m->next) {
        if (m == meta) continue;
        st = parse_entry(&c, m, data_start, data_bytes, &out->entries[out->n]);
        if (st != NB_OK) return st;
        out->n++;
    }

    /* file order, then names: unique */
    qsort(out->entries, (size_t)out->n, sizeof *out->entries, cmp_offset);
    st = nb__st_sort_names(out, where);
    if (st != NB_OK) {
        nb__st_header_free(out);
        return st;
    }

    /* layout: back to back from 0 to data_bytes */
    uint64_t expect = 0;
    for (int i = 0; i < out->n; i++) {
        const nb_checkpoint_entry *e = &out->entries[i];
        uint64_t begin = e->offset - data_start;
        char q1[96], q2[96];
        if (begin < expect)
            return fail(&c, NB_ERR_FORMAT, "tensors \"%s\" and \"%s\" overlap (data_offsets "
                        "[%llu, %llu] and [%llu, %llu])",
                        nb__st_quote(out->entries[i - 1].name, q1, sizeof q1),
                        nb__st_quote(e->name, q2, sizeof q2),
                        (unsigned long long)(out->entries[i - 1].offset - data_start),
                        (unsigned long long)expect, (unsigned long long)begin,
                        (unsigned long long)(begin + e->nbytes));
        if (begin > expect)
            return fail(&c, NB_ERR_FORMAT, "%llu bytes of the data section before tensor \"%s\" "
                        "(data_offsets begin at %llu) belong to no tensor",
                        (unsigned long long)(begin - expect), nb__st_quote(e->name, q1, sizeof q1),
                        (unsigned long long)begin);
        expect = begin + e->nbytes;
    }
    if (expect != data_bytes)
        return fail(&c, NB_ERR_FORMAT, "the data section has %llu bytes but the tensors end at "
                    "%llu (trailing bytes)", (unsigned long long)data_bytes,
                    (unsigned long long)expect);
    return NB_OK;
}

int nb__st_find(const nb__st_header *h, const char *name) {
    int lo = 0, hi = h->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(h->entries[h->by_name[mid]].name, name);
        if (c == 0) return h->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}
