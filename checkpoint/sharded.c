/* Sharded checkpoints: every rank writes its pieces of the state to a
 * shard file of its own, then rank 0 writes one index naming the shards;
 * reading takes any element range of any tensor from whichever shards
 * hold it, so a checkpoint loads at another world size, and consolidation
 * writes the ordinary single file.
 *
 * Note [Sharded checkpoint]
 * A save with id S (different for every save) of R ranks, for the index
 * DIR/I.safetensors, is
 *   DIR/S.shards/rank<r>-of-<R>.safetensors   r = 0 .. R-1, and
 *   DIR/I.safetensors                         the index, written last.
 * A shard is an ordinary safetensors file: piece p of tensor "w", elements
 * [a, b) of its row-major flattening, is the entry "w[a:b]", and the
 * metadata says the save ("shard_save_id"), the rank, the world and, in
 * "shard_pieces", each piece's tensor, place, shape and start (JSON).
 * Each rank writes its shard atomically (a temporary file, fsync, rename,
 * Note [Atomic save] in writer.c). Once all have (the caller's barrier),
 * rank 0 opens every shard, checks that the pieces cover each tensor
 * exactly once, and writes the index atomically: a safetensors file
 * without tensors whose metadata is the checkpoint's (step, data position,
 * RNG, ...) followed by "shard_dir" (S.shards) and "shard_index", a JSON
 * object naming the save, each shard's file and size in bytes, and each
 * tensor in checkpoint order with its dtype, shape and pieces
 * [shard, start, length].
 *
 * The index is what makes the checkpoint exist. A crash before its rename
 * leaves the previous index, which names the previous save's shards,
 * untouched: the new shards are files no index names. Since S differs per
 * save, a save never writes over a file that a standing index names.
 * Opening checks every shard against the index before anything is read:
 * present, the size the index records, of the same save, holding each
 * piece with the recorded dtype and length; any fault refuses the whole
 * checkpoint naming that file. Sizes are checked, not contents (Note
 * [Values checked at load] in reader.c says why no checksum).
 *
 * Because the index is a safetensors file whose metadata is a training
 * checkpoint's, everything that reads metadata (resuming's checks, the
 * choice of --resume auto, the kept checkpoints) treats it as any
 * checkpoint, and nb_checkpoint_load_training loads it; the pieces are
 * (tensor, element range), the unit ZeRO shards by (Note [ZeRO-1] in
 * distributed/ddp_zero.c), whatever world size wrote them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/safetensors.h"
#include "nabla/nabla.h"
#include "tensor/backend.h"
#include "tensor/internal.h"

/* ---- names ---- */

static bool save_id_ok(const char *id) {
    if (!id || !id[0] || strcmp(id, ".") == 0 || strcmp(id, "..") == 0) return false;
    for (const char *p = id; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '.' || *p == '-' || *p == '_'))
            return false;
    return true;
}

/* DIR/<shard_dir>/rank<r>-of-<R>.safetensors, malloc'ed; NULL when out of memory. */
static char *shard_path(const char *index_path, const char *shard_dir, int rank, int world) {
    char *dir = nb__st_dir_of(index_path);
    if (!dir) return NULL;
    size_t n = strlen(dir) + strlen(shard_dir) + 64;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s/rank%d-of-%d.safetensors", dir, shard_dir, rank, world);
    free(dir);
    return p;
}

static void piece_name(char *buf, size_t n, const char *name, int64_t start, int64_t len) {
    snprintf(buf, n, "%s[%lld:%lld]", name, (long long)start, (long long)(start + len));
}

static void write_shape(nb_strbuf *b, int ndim, const int64_t *shape) {
    nb__strbuf_append(b, "[", 1);
    for (int d = 0; d < ndim; d++) nb__strbuf_printf(b, "%s%lld", d ? "," : "", (long long)shape[d]);
    nb__strbuf_append(b, "]", 1);
}

static int64_t shape_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}

/* ---- writing a shard ---- */

nb_status nb_checkpoint_save_shard(const char *index_path, const char *save_id, int rank, int world,
                                   const nb_checkpoint_piece *pieces, int n) {
    NB_CHECK(index_path && save_id_ok(save_id), "nb_checkpoint_save_shard: save id \"%s\" is not a plain "
             "name (letters, digits, '.', '-', '_')", save_id ? save_id : "(null)");
    NB_CHECK(world >= 1 && rank >= 0 && rank < world && n >= 0 && (n == 0 || pieces),
             "nb_checkpoint_save_shard: rank %d of %d, %d pieces", rank, world, n);
    nb_named_tensor *ts = malloc(sizeof *ts * (size_t)(n ? n : 1));
    char **names = calloc((size_t)(n ? n : 1), sizeof *names);
    NB_CHECK(ts && names, "nb_checkpoint_save_shard: out of memory");
    nb_strbuf js = {0};
    nb__strbuf_append(&js, "[", 1);
    for (int i = 0; i < n; i++) {
        const nb_checkpoint_piece *p = &pieces[i];
        NB_CHECK(p->name && p->data && p->order >= 0 && p->ndim >= 0 && p->ndim <= NB_MAX_DIMS,
                 "nb_checkpoint_save_shard: piece %d: no name, no data, or a bad order or shape", i);
        int64_t len = nb_numel(p->data), whole = shape_numel(p->ndim, p->shape);
        NB_CHECK(p->start >= 0 && p->start + len <= whole,
                 "nb_checkpoint_save_shard: piece %d of \"%s\": elements [%lld, %lld) outside its %s", i, p->name,
                 (long long)p->start, (long long)(p->start + len), nb__shape_str_n(p->ndim, p->shape));
        size_t cap = strlen(p->name) + 48;
        names[i] = malloc(cap);
        NB_CHECK(names[i], "nb_checkpoint_save_shard: out of memory");
        piece_name(names[i], cap, p->name, p->start, len);
        ts[i] = (nb_named_tensor){names[i], p->data};
        nb__strbuf_printf(&js, "%s{\"name\":", i ? "," : "");
        nb__json_write_string(&js, p->name, strlen(p->name));
        nb__strbuf_printf(&js, ",\"order\":%d,\"shape\":", p->order);
        write_shape(&js, p->ndim, p->shape);
        nb__strbuf_printf(&js, ",\"start\":%lld}", (long long)p->start);
    }
    nb__strbuf_append(&js, "]", 1);
    char r[24], w[24], dir[300];
    snprintf(r, sizeof r, "%d", rank);
    snprintf(w, sizeof w, "%d", world);
    snprintf(dir, sizeof dir, "%s.shards", save_id);
    char *path = shard_path(index_path, dir, rank, world);
    nb_status st;
    if (js.failed || !path) {
        st = nb_set_error(NB_ERR_NOMEM, "nb_checkpoint_save_shard: out of memory");
    } else {
        nb_kv meta[] = {{"shard_save_id", save_id}, {"shard_rank", r}, {"shard_world", w},
                        {"shard_pieces", js.data}};
        st = nb_checkpoint_save(path, ts, n, meta, 4);
    }
    free(path);
    nb__strbuf_free(&js);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    free(ts);
    return st;
}

/* ---- the tensors of a set of shards ---- */

typedef struct sh_piece {
    int file;
    int64_t start, len;
} sh_piece;

typedef struct sh_tensor {
    char *name;
    int order;
    nb_dtype dtype;
    int ndim;
    int64_t shape[NB_MAX_DIMS];
    sh_piece *pieces;
    int n, cap;
} sh_tensor;

typedef struct sh_set {
    sh_tensor *t;
    int n, cap;
} sh_set;

static void set_free(sh_set *s) {
    for (int i = 0; i < s->n; i++) free(s->t[i].pieces), free(s->t[i].name);
    free(s->t);
    memset(s, 0, sizeof *s);
}

static sh_tensor *set_find(sh_set *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->t[i].name, name) == 0) return &s->t[i];
    return NULL;
}

static sh_tensor *set_add(sh_set *s, const char *name) {
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->t = realloc(s->t, sizeof *s->t * (size_t)s->cap);
        NB_CHECK(s->t, "sharded checkpoint: out of memory");
    }
    sh_tensor *t = &s->t[s->n++];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    NB_CHECK(t->name, "sharded checkpoint: out of memory");
    return t;
}

static void tensor_add_piece(sh_tensor *t, int file, int64_t start, int64_t len) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 4;
        t->pieces = realloc(t->pieces, sizeof *t->pieces * (size_t)t->cap);
        NB_CHECK(t->pieces, "sharded checkpoint: out of memory");
    }
    t->pieces[t->n++] = (sh_piece){file, start, len};
}

static int cmp_piece(const void *a, const void *b) {
    const sh_piece *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

static int cmp_order(const void *a, const void *b) {
    const sh_tensor *x = a, *y = b;
    return x->order < y->order ? -1 : x->order > y->order;
}

static bool json_shape(const nb_json *v, int *ndim, int64_t *shape) {
    if (!v || v->type != NB_JSON_ARRAY || v->count > NB_MAX_DIMS) return false;
    int d = 0;
    for (const nb_json *x = v->first; x; x = x->next, d++) {
        if (x->type != NB_JSON_NUMBER || !x->is_int || x->integer < 0) return false;
        shape[d] = x->integer;
    }
    *ndim = d;
    return true;
}

static bool same_shape(int n1, const int64_t *s1, int n2, const int64_t *s2) {
    if (n1 != n2) return false;
    for (int d = 0; d < n1; d++)
        if (s1[d] != s2[d]) return false;
    return true;
}

/* The pieces listed by shard `file` (open, of path `path`) into set: each
 * entry present with its tensor's dtype and length. */
static nb_status read_shard_pieces(nb_checkpoint *ck, const char *path, int file, const nb_json *list,
                                   sh_set *set) {
    char q[96], en[1200];
    for (const nb_json *p = list->first; p; p = p->next) {
        const nb_json *name = nb__json_get(p, "name"), *order = nb__json_get(p, "order"),
                      *start = nb__json_get(p, "start");
        int ndim;
        int64_t shape[NB_MAX_DIMS];
        if (p->type != NB_JSON_OBJECT || !name || name->type != NB_JSON_STRING || !order || !order->is_int ||
            order->integer < 0 || order->integer > INT32_MAX || !start || !start->is_int || start->integer < 0 ||
            !json_shape(nb__json_get(p, "shape"), &ndim, shape))
            return nb_set_error(NB_ERR_FORMAT, "%s: metadata \"shard_pieces\" entry at byte %zu is not a piece "
                                "({\"name\", \"order\", \"shape\", \"start\"})", path, p->offset);
        /* the entry's length is its own; its dtype is the tensor's */
        const nb_checkpoint_entry *e = NULL;
        for (int i = 0; i < nb_checkpoint_count(ck) && !e; i++) {
            const nb_checkpoint_entry *c = nb_checkpoint_entry_at(ck, i);
            size_t k = strlen(name->str);
            if (strncmp(c->name, name->str, k) == 0 && c->name[k] == '[') {
                int64_t len = (int64_t)(c->nbytes / nb_dtype_size(c->dtype));
                piece_name(en, sizeof en, name->str, start->integer, len);
                if (strcmp(en, c->name) == 0) e = c;
            }
        }
        if (!e)
            return nb_set_error(NB_ERR_FORMAT, "%s: the piece of \"%s\" starting at element %lld is listed but "
                                "not stored", path, nb__st_quote(name->str, q, sizeof q),
                                (long long)start->integer);
        int64_t len = (int64_t)(e->nbytes / nb_dtype_size(e->dtype));
        if (start->integer + len > shape_numel(ndim, shape))
            return nb_set_error(NB_ERR_FORMAT, "%s: piece \"%s\" lies outside the tensor's %s", path,
                                nb__st_quote(e->name, q, sizeof q), nb__shape_str_n(ndim, shape));
        sh_tensor *t = set_find(set, name->str);
        if (!t) {
            t = set_add(set, name->str);
            t->order = (int)order->integer;
            t->dtype = e->dtype;
            t->ndim = ndim;
            memcpy(t->shape, shape, sizeof shape[0] * (size_t)ndim);
        } else if (t->order != order->integer || t->dtype != e->dtype || !same_shape(t->ndim, t->shape, ndim, shape)) {
            return nb_set_error(NB_ERR_FORMAT, "%s: the piece of \"%s\" at element %lld disagrees with another "
                                "shard's about the tensor (place %d, %s %s there; %lld, %s %s here)", path,
                                nb__st_quote(name->str, q, sizeof q), (long long)start->integer, t->order,
                                nb__st_dtype_name(t->dtype), nb__shape_str_n(t->ndim, t->shape),
                                (long long)order->integer, nb__st_dtype_name(e->dtype), nb__shape_str_n(ndim, shape));
        }
        tensor_add_piece(t, file, start->integer, len);
    }
    return NB_OK;
}

/* Every tensor covered exactly once by its pieces; places distinct;
 * tensors put in checkpoint order. `files` names the shards. */
static nb_status check_cover(sh_set *set, char *const *files, const char *where) {
    char q[96];
    qsort(set->t, (size_t)set->n, sizeof *set->t, cmp_order);
    for (int i = 0; i < set->n; i++) {
        sh_tensor *t = &set->t[i];
        if (i > 0 && set->t[i - 1].order == t->order)
            return nb_set_error(NB_ERR_FORMAT, "%s: tensors \"%s\" and \"%s\" both have place %d", where,
                                set->t[i - 1].name, nb__st_quote(t->name, q, sizeof q), t->order);
        qsort(t->pieces, (size_t)t->n, sizeof *t->pieces, cmp_piece);
        int64_t at = 0, numel = shape_numel(t->ndim, t->shape);
        for (int k = 0; k < t->n; k++) {
            const sh_piece *p = &t->pieces[k];
            if (p->len == 0) continue;
            if (p->start != at)
                return nb_set_error(NB_ERR_FORMAT, "%s: tensor \"%s\" %s: elements [%lld, %lld) are %s (%s)", where,
                                    nb__st_quote(t->name, q, sizeof q), nb__shape_str_n(t->ndim, t->shape),
                                    (long long)(p->start < at ? p->start : at),
                                    (long long)(p->start < at ? at : p->start),
                                    p->start < at ? "stored twice" : "in no shard", files[p->file]);
            at += p->len;
        }
        if (at != numel)
            return nb_set_error(NB_ERR_FORMAT, "%s: tensor \"%s\" %s: elements [%lld, %lld) are in no shard", where,
                                nb__st_quote(t->name, q, sizeof q), nb__shape_str_n(t->ndim, t->shape),
                                (long long)at, (long long)numel);
    }
    return NB_OK;
}

static uint64_t file_size(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

/* The shards of save_id for index_path, opened (files[r], shards[r]) and
 * their pieces collected into set, covering every tensor exactly once, in
 * checkpoint order. On failure the message names the file at fault; the
 * caller closes what was opened. */
static nb_status collect(const char *index_path, const char *shard_dir, const char *save_id, int world,
                         char **files, nb_checkpoint **shards, sh_set *set) {
    for (int r = 0; r < world; r++) {
        files[r] = shard_path(index_path, shard_dir, r, world);
        NB_CHECK(files[r], "sharded checkpoint: out of memory");
    }
    for (int r = 0; r < world; r++) {
        nb_status st = nb_checkpoint_open(files[r], &shards[r]);
        if (st != NB_OK) {
            if (st == NB_ERR_NOT_FOUND)
                return nb_set_error(st, "%s: the shard of rank %d of %d is missing: the checkpoint %s is "
                                    "incomplete", files[r], r, world, index_path);
            return st;
        }
        nb_checkpoint *ck = shards[r];
        const char *id = nb_checkpoint_meta(ck, "shard_save_id"), *pieces = nb_checkpoint_meta(ck, "shard_pieces");
        if (!id || strcmp(id, save_id) != 0 || !pieces)
            return nb_set_error(NB_ERR_FORMAT, "%s: not a shard of save \"%s\" (its \"shard_save_id\" is %s%s%s)",
                                files[r], save_id, id ? "\"" : "", id ? id : "missing", id ? "\"" : "");
        nb_json_doc *doc = NULL;
        if (nb__json_parse(pieces, strlen(pieces), &doc) != NB_OK || nb__json_root(doc)->type != NB_JSON_ARRAY) {
            nb__json_free(doc);
            return nb_set_error(NB_ERR_FORMAT, "%s: metadata \"shard_pieces\" is not a JSON array", files[r]);
        }
        st = read_shard_pieces(ck, files[r], r, nb__json_root(doc), set);
        nb__json_free(doc);
        if (st != NB_OK) return st;
    }
    return check_cover(set, files, index_path);
}

/* The index's "shard_index" value for set (canonical: the same set gives
 * the same text). */
static void index_json(nb_strbuf *b, const char *save_id, int world, char *const *files) {
    nb__strbuf_append(b, "{\"save_id\":", 11);
    nb__json_write_string(b, save_id, strlen(save_id));
    nb__strbuf_printf(b, ",\"world\":%d,\"files\":[", world);
    for (int r = 0; r < world; r++) {
        const char *base = strrchr(files[r], '/');
        base = base ? base + 1 : files[r];
        nb__strbuf_printf(b, "%s{\"path\":", r ? "," : "");
        nb__json_write_string(b, base, strlen(base));
        nb__strbuf_printf(b, ",\"bytes\":%llu}", (unsigned long long)file_size(files[r]));
    }
    nb__strbuf_append(b, "]", 1);
}

static void tensors_json(nb_strbuf *b, const sh_set *set) {
    nb__strbuf_append(b, ",\"tensors\":[", 12);
    for (int i = 0; i < set->n; i++) {
        const sh_tensor *t = &set->t[i];
        nb__strbuf_printf(b, "%s{\"name\":", i ? "," : "");
        nb__json_write_string(b, t->name, strlen(t->name));
        nb__strbuf_printf(b, ",\"dtype\":\"%s\",\"shape\":", nb__st_dtype_name(t->dtype));
        write_shape(b, t->ndim, t->shape);
        nb__strbuf_append(b, ",\"pieces\":[", 11);
        for (int k = 0; k < t->n; k++)
            nb__strbuf_printf(b, "%s[%d,%lld,%lld]", k ? "," : "", t->pieces[k].file,
                              (long long)t->pieces[k].start, (long long)t->pieces[k].len);
        nb__strbuf_append(b, "]}", 2);
    }
    nb__strbuf_append(b, "]}", 2);
}

static void close_all(nb_checkpoint **shards, char **files, int world) {
    for (int r = 0; r < world; r++) {
        nb_checkpoint_close(shards[r]);
        free(files[r]);
    }
    free(shards);
    free(files);
}

/* ---- writing the index ---- */

nb_status nb_checkpoint_save_index(const char *index_path, const char *save_id, int world,
                                   const nb_kv *meta, int n_meta) {
    NB_CHECK(index_path && save_id_ok(save_id), "nb_checkpoint_save_index: save id \"%s\" is not a plain "
             "name (letters, digits, '.', '-', '_')", save_id ? save_id : "(null)");
    NB_CHECK(world >= 1 && n_meta >= 0 && (n_meta == 0 || meta), "nb_checkpoint_save_index: world %d, "
             "%d metadata entries", world, n_meta);
    for (int i = 0; i < n_meta; i++)
        NB_CHECK(meta[i].key && strcmp(meta[i].key, "shard_dir") && strcmp(meta[i].key, "shard_index"),
                 "nb_checkpoint_save_index: metadata key \"%s\" is the index's own",
                 meta[i].key ? meta[i].key : "(null)");
    char dir[300];
    snprintf(dir, sizeof dir, "%s.shards", save_id);
    char **files = calloc((size_t)world, sizeof *files);
    nb_checkpoint **shards = calloc((size_t)world, sizeof *shards);
    nb_kv *all = malloc(sizeof *all * (size_t)(n_meta + 2));
    NB_CHECK(files && shards && all, "nb_checkpoint_save_index: out of memory");
    sh_set set = {0};
    nb_status st = collect(index_path, dir, save_id, world, files, shards, &set);
    if (st == NB_OK) {
        nb_strbuf js = {0};
        index_json(&js, save_id, world, files);
        tensors_json(&js, &set);
        if (n_meta) memcpy(all, meta, sizeof *all * (size_t)n_meta);
        all[n_meta] = (nb_kv){"shard_dir", dir};
        all[n_meta + 1] = (nb_kv){"shard_index", js.data ? js.data : ""};
        st = js.failed ? nb_set_error(NB_ERR_NOMEM, "nb_checkpoint_save_index: out of memory")
                       : nb_checkpoint_save(index_path, NULL, 0, all, n_meta + 2);
        nb__strbuf_free(&js);
    }
    free(all);
    set_free(&set);
    close_all(shards, files, world);
    return st;
}

bool nb_checkpoint_is_sharded(const nb_checkpoint *ck) {
    NB_CHECK(ck, "nb_checkpoint_is_sharded: NULL checkpoint");
    return nb_checkpoint_meta(ck, "shard_index") != NULL;
}

/* ---- reading ---- */

struct nb_checkpoint_sharded {
    nb_checkpoint *index;
    int world;
    char **files;
    nb_checkpoint **shards;
    sh_set set;
    nb__st_header h; /* entries of set, for lookups and the strict check */
};

void nb_checkpoint_sharded_close(nb_checkpoint_sharded *s) {
    if (!s) return;
    close_all(s->shards, s->files, s->world);
    set_free(&s->set);
    free(s->h.entries);
    free(s->h.by_name);
    nb_checkpoint_close(s->index);
    free(s);
}

/* The index's own fields: shard_dir, save id, world, and each file's size. */
static nb_status parse_index(nb_checkpoint *ix, const char *path, const char **dir, char *save_id, size_t cap,
                             int *world, uint64_t **bytes) {
    *dir = nb_checkpoint_meta(ix, "shard_dir");
    const char *text = nb_checkpoint_meta(ix, "shard_index");
    if (!*dir || !text)
        return nb_set_error(NB_ERR_FORMAT, "%s: not the index of a sharded checkpoint (metadata \"shard_dir\" "
                            "and \"shard_index\" missing)", path);
    size_t dl = strlen(*dir);
    nb_json_doc *doc = NULL;
    nb_status st = NB_OK;
    if (dl < 8 || strcmp(*dir + dl - 7, ".shards") != 0 || strchr(*dir, '/'))
        st = nb_set_error(NB_ERR_FORMAT, "%s: \"shard_dir\" = \"%s\" is not a folder name ending in .shards", path,
                          *dir);
    else if (nb__json_parse(text, strlen(text), &doc) != NB_OK || nb__json_root(doc)->type != NB_JSON_OBJECT)
        st = nb_set_error(NB_ERR_FORMAT, "%s: \"shard_index\" is not a JSON object", path);
    if (st != NB_OK) {
        nb__json_free(doc);
        return st;
    }
    const nb_json *root = nb__json_root(doc), *id = nb__json_get(root, "save_id"),
                  *w = nb__json_get(root, "world"), *files = nb__json_get(root, "files");
    if (!id || id->type != NB_JSON_STRING || !save_id_ok(id->str) || strlen(id->str) >= cap || !w || !w->is_int ||
        w->integer < 1 || w->integer > 1000000 || !files || files->type != NB_JSON_ARRAY ||
        files->count != (size_t)w->integer || strncmp(*dir, id->str, dl - 7) != 0 || strlen(id->str) != dl - 7) {
        nb__json_free(doc);
        return nb_set_error(NB_ERR_FORMAT, "%s: \"shard_index\" lacks a save id matching \"shard_dir\", a world "
                            "size, or one file per rank", path);
    }
    snprintf(save_id, cap, "%s", id->str);
    *world = (int)w->integer;
    *bytes = calloc((size_t)*world, sizeof **bytes);
    NB_CHECK(*bytes, "nb_checkpoint_sharded_open: out of memory");
    int r = 0;
    for (const nb_json *f = files->first; f; f = f->next, r++) {
        const nb_json *b = nb__json_get(f, "bytes");
        if (!b || !b->is_int || b->integer < 0) {
            nb__json_free(doc);
            return nb_set_error(NB_ERR_FORMAT, "%s: \"shard_index\": file %d has no size", path, r);
        }
        (*bytes)[r] = (uint64_t)b->integer;
    }
    nb__json_free(doc);
    return NB_OK;
}

nb_status nb_checkpoint_sharded_open(const char *path, nb_checkpoint_sharded **out) {
    NB_CHECK(path && out, "nb_checkpoint_sharded_open: NULL argument");
    *out = NULL;
    nb_checkpoint *ix;
    nb_status st = nb_checkpoint_open(path, &ix);
    if (st != NB_OK) return st;
    const char *dir;
    char save_id[256];
    int world = 0;
    uint64_t *bytes = NULL;
    st = parse_index(ix, path, &dir, save_id, sizeof save_id, &world, &bytes);
    if (st != NB_OK) {
        nb_checkpoint_close(ix);
        return st;
    }
    nb_checkpoint_sharded *s = calloc(1, sizeof *s);
    NB_CHECK(s, "nb_checkpoint_sharded_open: out of memory");
    s->index = ix;
    s->world = world;
    s->files = calloc((size_t)world, sizeof *s->files);
    s->shards = calloc((size_t)world, sizeof *s->shards);
    NB_CHECK(s->files && s->shards, "nb_checkpoint_sharded_open: out of memory");
    /* sizes first: a shard cut short is named as such */
    for (int r = 0; r < world && st == NB_OK; r++) {
        s->files[r] = shard_path(path, dir, r, world);
        NB_CHECK(s->files[r], "nb_checkpoint_sharded_open: out of memory");
        struct stat sb;
        if (stat(s->files[r], &sb) == 0 && (uint64_t)sb.st_size != bytes[r])
            st = nb_set_error(NB_ERR_FORMAT, "%s: %llu bytes, but the index %s records %llu: the shard is "
                              "truncated or was replaced, and the checkpoint cannot be loaded",
                              s->files[r], (unsigned long long)sb.st_size, path, (unsigned long long)bytes[r]);
        free(s->files[r]);
        s->files[r] = NULL;
    }
    free(bytes);
    if (st == NB_OK) st = collect(path, dir, save_id, world, s->files, s->shards, &s->set);
    if (st == NB_OK) {
        nb_strbuf js = {0};
        index_json(&js, save_id, world, s->files);
        tensors_json(&js, &s->set);
        if (js.failed || strcmp(js.data, nb_checkpoint_meta(ix, "shard_index")) != 0)
            st = nb_set_error(NB_ERR_FORMAT, "%s: the shards in %s hold other pieces than the index lists: "
                              "the folder was changed after the save", path, dir);
        nb__strbuf_free(&js);
    }
    if (st == NB_OK) {
        s->h.n = s->set.n;
        s->h.entries = calloc((size_t)(s->set.n ? s->set.n : 1), sizeof *s->h.entries);
        s->h.by_name = calloc((size_t)(s->set.n ? s->set.n : 1), sizeof *s->h.by_name);
        NB_CHECK(s->h.entries && s->h.by_name, "nb_checkpoint_sharded_open: out of memory");
        for (int i = 0; i < s->set.n; i++) {
            const sh_tensor *t = &s->set.t[i];
            nb_checkpoint_entry *e = &s->h.entries[i];
            e->name = t->name;
            e->dtype = t->dtype;
            e->ndim = t->ndim;
            memcpy(e->shape, t->shape, sizeof e->shape);
            e->nbytes = (uint64_t)shape_numel(t->ndim, t->shape) * nb_dtype_size(t->dtype);
        }
        st = nb__st_sort_names(&s->h, path);
    }
    if (st != NB_OK) {
        nb_checkpoint_sharded_close(s);
        return st;
    }
    *out = s;
    return NB_OK;
}

nb_checkpoint *nb_checkpoint_sharded_index(nb_checkpoint_sharded *s) {
    NB_CHECK(s, "nb_checkpoint_sharded_index: NULL checkpoint");
    return s->index;
}

int nb_checkpoint_sharded_count(const nb_checkpoint_sharded *s) {
    NB_CHECK(s, "nb_checkpoint_sharded_count: NULL checkpoint");
    return s->h.n;
}

const nb_checkpoint_entry *nb_checkpoint_sharded_entry_at(const nb_checkpoint_sharded *s, int i) {
    NB_CHECK(s && i >= 0 && i < s->h.n, "nb_checkpoint_sharded_entry_at: entry %d of %d", i, s ? s->h.n : 0);
    return &s->h.entries[i];
}

int nb_checkpoint_sharded_shards(const nb_checkpoint_sharded *s) {
    NB_CHECK(s, "nb_checkpoint_sharded_shards: NULL checkpoint");
    return s->world;
}

void nb_checkpoint_sharded_set_allow_nonfinite(nb_checkpoint_sharded *s, bool allow) {
    NB_CHECK(s, "nb_checkpoint_sharded_set_allow_nonfinite: NULL checkpoint");
    for (int r = 0; r < s->world; r++) nb_checkpoint_set_allow_nonfinite(s->shards[r], allow);
}

static void set_second_moments(nb_checkpoint_sharded *s, bool on) {
    for (int r = 0; r < s->world; r++) nb__checkpoint_set_second_moments(s->shards[r], on);
}

nb_status nb_checkpoint_sharded_read_range(nb_checkpoint_sharded *s, const char *name, int64_t start,
                                           nb_tensor *dst) {
    NB_CHECK(s && name && dst, "nb_checkpoint_sharded_read_range: NULL argument");
    char q[96];
    int i = nb__st_find(&s->h, name);
    if (i < 0)
        return nb_set_error(NB_ERR_NOT_FOUND, "%s: no tensor named \"%s\"", nb_checkpoint_path(s->index),
                            nb__st_quote(name, q, sizeof q));
    const nb_checkpoint_entry *e = &s->h.entries[i];
    const sh_tensor *t = &s->set.t[i]; /* entries[i] is set.t[i] */
    int64_t count = nb_numel(dst), numel = shape_numel(e->ndim, e->shape);
    if (start < 0 || start + count > numel)
        return nb_set_error(NB_ERR_MISMATCH, "%s: elements [%lld, %lld) of tensor \"%s\" %s do not exist",
                            nb_checkpoint_path(s->index), (long long)start, (long long)(start + count),
                            nb__st_quote(name, q, sizeof q), nb__shape_str_n(e->ndim, e->shape));
    if (count == 0) return NB_OK;
    size_t size = nb_dtype_size(e->dtype);
    bool direct = dst->dtype == e->dtype && nb_is_contiguous(dst) && !nb__backend_at(dst)->device_memory;
    unsigned char *buf = direct ? dst->data : malloc((size_t)count * size);
    if (!buf)
        return nb_set_error(NB_ERR_NOMEM, "%s: out of memory reading tensor \"%s\" (%lld elements)",
                            nb_checkpoint_path(s->index), nb__st_quote(name, q, sizeof q), (long long)count);
    nb_status st = NB_OK;
    char en[1200];
    for (int k = 0; k < t->n && st == NB_OK; k++) {
        const sh_piece *p = &t->pieces[k];
        int64_t a = p->start > start ? p->start : start;
        int64_t b = p->start + p->len < start + count ? p->start + p->len : start + count;
        if (a >= b) continue;
        piece_name(en, sizeof en, t->name, p->start, p->len);
        st = nb__checkpoint_read_elements(s->shards[p->file], en, a - p->start, b - a,
                                          buf + (size_t)(a - start) * size, e, a);
    }
    if (st == NB_OK && !direct) nb__checkpoint_copy_in(dst, e->dtype, buf);
    if (!direct) free(buf);
    return st;
}

nb_status nb_checkpoint_sharded_read(nb_checkpoint_sharded *s, const char *name, nb_tensor *dst) {
    NB_CHECK(s && name && dst, "nb_checkpoint_sharded_read: NULL argument");
    int i = nb__st_find(&s->h, name);
    if (i >= 0 && !same_shape(s->h.entries[i].ndim, s->h.entries[i].shape, dst->ndim, dst->shape)) {
        char q[96];
        return nb_set_error(NB_ERR_MISMATCH, "%s: tensor \"%s\" has shape %s in the checkpoint, the "
                            "destination has %s", nb_checkpoint_path(s->index), nb__st_quote(name, q, sizeof q),
                            nb__shape_str_n(s->h.entries[i].ndim, s->h.entries[i].shape), nb_shape_str(dst));
    }
    return nb_checkpoint_sharded_read_range(s, name, 0, dst);
}

/* nb_checkpoint_load_training's reads from a sharded checkpoint: the
 * strict check against its tensors, then each one whole. */
nb_status nb__checkpoint_sharded_read_strict(nb_checkpoint_sharded *s, const nb_named_tensor *tensors, int n,
                                             const char *ignore_prefix, bool allow_nonfinite, bool second_moments) {
    nb_checkpoint_sharded_set_allow_nonfinite(s, allow_nonfinite);
    set_second_moments(s, second_moments);
    nb_status st = nb__checkpoint_match(nb_checkpoint_path(s->index), &s->h, tensors, n, ignore_prefix);
    for (int i = 0; i < n && st == NB_OK; i++) st = nb_checkpoint_sharded_read(s, tensors[i].name, tensors[i].tensor);
    return st;
}

/* ---- consolidation ---- */

nb_status nb_checkpoint_consolidate(const char *index_path, const char *out_path) {
    NB_CHECK(index_path && out_path, "nb_checkpoint_consolidate: NULL path");
    nb_checkpoint_sharded *s;
    nb_status st = nb_checkpoint_sharded_open(index_path, &s);
    if (st != NB_OK) return st;
    int n = s->h.n, n_meta = nb_checkpoint_meta_count(s->index);
    size_t bytes = 4096;
    for (int i = 0; i < n; i++) bytes += 256 + (size_t)shape_numel(s->set.t[i].ndim, s->set.t[i].shape) *
                                             nb_dtype_size(s->set.t[i].dtype);
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), bytes);
    nb_named_tensor *ts = malloc(sizeof *ts * (size_t)(n ? n : 1));
    nb_kv *meta = malloc(sizeof *meta * (size_t)(n_meta ? n_meta : 1));
    NB_CHECK(ts && meta, "nb_checkpoint_consolidate: out of memory");
    for (int i = 0; i < n && st == NB_OK; i++) { /* set is in checkpoint order */
        const sh_tensor *t = &s->set.t[i];
        ts[i] = (nb_named_tensor){t->name, nb_empty(ctx, t->dtype, t->ndim, t->shape)};
        st = nb_checkpoint_sharded_read(s, t->name, ts[i].tensor);
    }
    int m = 0;
    for (int i = 0; i < n_meta; i++) {
        nb_kv kv = nb_checkpoint_meta_at(s->index, i);
        if (strcmp(kv.key, "shard_dir") && strcmp(kv.key, "shard_index")) meta[m++] = kv;
    }
    if (st == NB_OK) st = nb_checkpoint_save(out_path, ts, n, meta, m);
    free(ts);
    free(meta);
    nb_ctx_free(ctx);
    nb_checkpoint_sharded_close(s);
    return st;
}
