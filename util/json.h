/* A small strict JSON parser (RFC 8259) and writer, internal to nabla.
 *
 * util/ holds internal helpers that several modules share and none owns:
 * this JSON code reads and writes safetensors headers (checkpoint/) and the
 * metrics log (monitor/), so it lives beside them rather than inside either.
 * Nothing here is public; the functions are nb__ and the header is not
 * installed.
 *
 * nb__json_parse() builds a read-only tree in one arena owned by the
 * returned document; nb__json_free() releases all of it. The parser
 * accepts exactly RFC 8259 JSON: UTF-8 text only (no BOM, no overlong
 * forms, no encoded surrogates), strings with the standard escapes
 * including \uXXXX and surrogate pairs (a lone surrogate is refused),
 * numbers by the JSON grammar, nesting up to NB_JSON_MAX_DEPTH. Objects
 * keep their members in text order; duplicate keys are kept (callers that
 * care check for them). Errors return NB_ERR_FORMAT (NB_ERR_NOMEM when the
 * arena cannot grow) with a message giving the byte offset. */
#ifndef NABLA_UTIL_JSON_H
#define NABLA_UTIL_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nabla/error.h"

#define NB_JSON_MAX_DEPTH 128

typedef enum nb_json_type {
    NB_JSON_NULL,
    NB_JSON_BOOL,
    NB_JSON_NUMBER,
    NB_JSON_STRING,
    NB_JSON_ARRAY,
    NB_JSON_OBJECT
} nb_json_type;

typedef struct nb_json nb_json;
struct nb_json {
    nb_json_type type;
    bool boolean;     /* BOOL */
    bool is_int;      /* NUMBER written without fraction or exponent that fits int64 */
    int64_t integer;  /* NUMBER, exact when is_int */
    double number;    /* NUMBER, always set (rounded when is_int and huge) */
    const char *str;  /* STRING: decoded UTF-8, NUL-terminated, may hold NULs */
    size_t len;       /* STRING: bytes in str */
    const char *key;  /* member of an OBJECT: its decoded key, NUL-terminated */
    size_t key_len;
    size_t count;     /* ARRAY, OBJECT: number of children */
    nb_json *first;   /* ARRAY, OBJECT: first child */
    nb_json *next;    /* next sibling */
    size_t offset;    /* byte offset of the value in the parsed text */
};

typedef struct nb_json_doc nb_json_doc;

/* Parses text[0, len) (need not be NUL-terminated). On success *out owns
 * the tree; on failure *out is NULL and nb_last_error() says what and where. */
nb_status nb__json_parse(const char *text, size_t len, nb_json_doc **out);
const nb_json *nb__json_root(const nb_json_doc *doc);
void nb__json_free(nb_json_doc *doc); /* NULL is fine */

/* First member of `object` whose key equals `key` (a C string), or NULL. */
const nb_json *nb__json_get(const nb_json *object, const char *key);
const char *nb__json_type_name(nb_json_type type);
/* Whether s[0, n) is well-formed UTF-8 (RFC 3629: no overlong forms, no
 * surrogates, nothing above U+10FFFF). */
bool nb__utf8_valid(const char *s, size_t n);

/* ---- writing ---- */
/* A growable byte buffer; after an allocation failure it stops growing and
 * `failed` is set (check once at the end). */
typedef struct nb_strbuf {
    char *data;
    size_t len, cap;
    bool failed;
} nb_strbuf;

void nb__strbuf_append(nb_strbuf *b, const char *s, size_t n);
void nb__strbuf_printf(nb_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void nb__strbuf_free(nb_strbuf *b);
/* Appends s[0, n) as a quoted JSON string: ", \ and control characters
 * escaped, every other byte copied (the caller provides UTF-8). */
void nb__json_write_string(nb_strbuf *b, const char *s, size_t n);
/* Appends v as compact JSON text; parsing it again gives an equal tree. */
void nb__json_dump(nb_strbuf *b, const nb_json *v);

#endif
