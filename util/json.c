/* The JSON parser and writer declared in util/json.h.
 *
 * One recursive-descent pass over the bytes; every read is checked against
 * the length first, so the text needs no terminator and can be any bytes.
 * Nodes and decoded strings come from a chunked arena owned by the
 * document. Numbers: the grammar is checked here; integer literals are
 * accumulated exactly, everything else goes to strtod (with the locale's
 * decimal point swapped in, so a program that called setlocale still reads
 * "1.5"); a number too large for a double is refused, so that every tree
 * can be written back as JSON. */
#include "util/json.h"

#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ---- */
typedef struct chunk {
    struct chunk *next;
    size_t size, used;
} chunk;

#define CHUNK_HEADER ((sizeof(chunk) + 15) / 16 * 16)
#define CHUNK_MIN (64 * 1024)

struct nb_json_doc {
    chunk *chunks;
    nb_json *root;
};

static void *doc_alloc(nb_json_doc *doc, size_t bytes) {
    bytes = (bytes + 15) / 16 * 16;
    chunk *c = doc->chunks;
    if (!c || c->size - c->used < bytes) {
        size_t size = bytes > CHUNK_MIN ? bytes : CHUNK_MIN;
        if (size > SIZE_MAX - CHUNK_HEADER) return NULL;
        chunk *n = malloc(CHUNK_HEADER + size);
        if (!n) return NULL;
        n->size = size;
        n->used = 0;
        n->next = doc->chunks;
        doc->chunks = c = n;
    }
    void *p = (char *)c + CHUNK_HEADER + c->used;
    c->used += bytes;
    return p;
}

void nb__json_free(nb_json_doc *doc) {
    if (!doc) return;
    for (chunk *c = doc->chunks, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    free(doc);
}

const nb_json *nb__json_root(const nb_json_doc *doc) { return doc->root; }

/* ---- parser ---- */
typedef struct parser {
    const unsigned char *s;
    size_t len, pos;
    nb_json_doc *doc;
    nb_status status; /* first failure */
} parser;

static void describe_byte(const parser *p, size_t at, char *buf, size_t n) {
    if (at >= p->len) snprintf(buf, n, "end of text");
    else if (p->s[at] >= 0x20 && p->s[at] < 0x7f) snprintf(buf, n, "'%c'", p->s[at]);
    else snprintf(buf, n, "byte 0x%02x", p->s[at]);
}

static void *fail(parser *p, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void *fail(parser *p, size_t at, const char *fmt, ...) {
    if (p->status != NB_OK) return NULL;
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    p->status = nb_set_error(NB_ERR_FORMAT, "JSON: %s at byte %zu", what, at);
    return NULL;
}

static void *fail_unexpected(parser *p, size_t at, const char *expected) {
    char b[32];
    describe_byte(p, at, b, sizeof b);
    return fail(p, at, "expected %s, found %s", expected, b);
}

static void *out_of_memory(parser *p) {
    if (p->status == NB_OK)
        p->status = nb_set_error(NB_ERR_NOMEM, "JSON: out of memory at byte %zu of %zu", p->pos,
                                 p->len);
    return NULL;
}

static nb_json *new_node(parser *p, nb_json_type type) {
    nb_json *v = doc_alloc(p->doc, sizeof *v);
    if (!v) return out_of_memory(p);
    memset(v, 0, sizeof *v);
    v->type = type;
    v->offset = p->pos;
    return v;
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        unsigned char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static bool consume_literal(parser *p, const char *lit) {
    size_t n = strlen(lit);
    if (p->len - p->pos < n || memcmp(p->s + p->pos, lit, n) != 0) return false;
    p->pos += n;
    return true;
}

static int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Four hex digits at s[at]; -1 when they are not there. */
static long read_hex4(const parser *p, size_t at) {
    if (at > p->len || p->len - at < 4) return -1;
    long v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hex_value(p->s[at + (size_t)i]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

static size_t put_utf8(char *out, unsigned long cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the well-formed UTF-8 sequence at s[0, n) (Unicode's table of
 * well-formed byte sequences), or 0 when it is not one. */
static size_t utf8_sequence(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    unsigned char lo = 0x80, hi = 0xBF;
    size_t len;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if (c == 0xED) len = 3, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) len = 3;
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c == 0xF4) len = 4, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else return 0;
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

bool nb__utf8_valid(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_sequence(u + i, n - i);
        if (k == 0) return false;
        i += k;
    }
    return true;
}

/* A string at p->pos (which holds '"'): decoded into the arena. */
static bool parse_string(parser *p, const char **out, size_t *out_len) {
    size_t start = p->pos++;
    /* First pass: find the closing quote to size the buffer. Escapes only
     * shrink, so the raw length bounds the decoded one. */
    size_t end = p->pos;
    while (end < p->len && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
    if (end >= p->len) {
        fail(p, start, "unterminated string");
        return false;
    }
    char *buf = doc_alloc(p->doc, end - p->pos + 1);
    if (!buf) {
        out_of_memory(p);
        return false;
    }
    size_t n = 0;
    while (p->pos < end) {
        unsigned char c = p->s[p->pos];
        if (c < 0x20) {
            fail(p, p->pos, "control character 0x%02x in a string (must be escaped)", c);
            return false;
        }
        if (c >= 0x80) {
            size_t k = utf8_sequence(p->s + p->pos, end - p->pos);
            if (k == 0) {
                fail(p, p->pos, "invalid UTF-8 byte 0x%02x in a string", c);
                return false;
            }
            memcpy(buf + n, p->s + p->pos, k);
            n += k;
            p->pos += k;
            continue;
        }
        if (c != '\\') {
            buf[n++] = (char)c;
            p->pos++;
            continue;
        }
        size_t esc = p->pos;
        unsigned char e = p->s[p->pos + 1]; /* exists: end was found past it */
        p->pos += 2;
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            long cp = p->pos <= end ? read_hex4(p, p->pos) : -1;
            if (cp < 0 || p->pos + 4 > end) {
                fail(p, esc, "\\u must be followed by four hex digits");
                return false;
            }
            p->pos += 4;
            if (cp >= 0xDC00 && cp <= 0xDFFF) {
                fail(p, esc, "lone low surrogate \\u%04lX", (unsigned long)cp);
                return false;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                long lo = -1;
                if (p->pos + 6 <= end && p->s[p->pos] == '\\' && p->s[p->pos + 1] == 'u')
                    lo = read_hex4(p, p->pos + 2);
                if (lo < 0xDC00 || lo > 0xDFFF) {
                    fail(p, esc, "high surrogate \\u%04lX not followed by a low surrogate",
                         (unsigned long)cp);
                    return false;
                }
                p->pos += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            n += put_utf8(buf + n, (unsigned long)cp);
            break;
        }
        default: {
            char b[32];
            describe_byte(p, esc + 1, b, sizeof b);
            fail(p, esc, "invalid escape \\ followed by %s", b);
            return false;
        }
        }
    }
    buf[n] = 0;
    p->pos = end + 1;
    *out = buf;
    *out_len = n;
    return true;
}

static bool is_digit(const parser *p, size_t at) {
    return at < p->len && p->s[at] >= '0' && p->s[at] <= '9';
}

static nb_json *parse_number(parser *p) {
    nb_json *v = new_node(p, NB_JSON_NUMBER);
    if (!v) return NULL;
    size_t start = p->pos;
    bool neg = false, integral = true;
    if (p->pos < p->len && p->s[p->pos] == '-') {
        neg = true;
        p->pos++;
    }
    if (!is_digit(p, p->pos)) return fail_unexpected(p, p->pos, "a digit");
    size_t digits = p->pos;
    if (p->s[p->pos] == '0') p->pos++;
    else
        while (is_digit(p, p->pos)) p->pos++;
    size_t digits_end = p->pos;
    if (p->pos < p->len && p->s[p->pos] == '.') {
        integral = false;
        p->pos++;
        if (!is_digit(p, p->pos)) return fail_unexpected(p, p->pos, "a digit after '.'");
        while (is_digit(p, p->pos)) p->pos++;
    }
    if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        integral = false;
        p->pos++;
        if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
        if (!is_digit(p, p->pos)) return fail_unexpected(p, p->pos, "a digit in the exponent");
        while (is_digit(p, p->pos)) p->pos++;
    }
    if (integral) {
        /* Magnitude up to 2^63 (for INT64_MIN); more is not an int. */
        uint64_t mag = 0, limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        bool fits = true;
        for (size_t i = digits; i < digits_end && fits; i++) {
            uint64_t d = (uint64_t)(p->s[i] - '0');
            if (mag > (limit - d) / 10) fits = false;
            else mag = mag * 10 + d;
        }
        if (fits) {
            v->is_int = true;
            v->integer = neg ? (mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag)
                             : (int64_t)mag;
            v->number = (double)v->integer;
            return v;
        }
    }
    size_t n = p->pos - start;
    char *copy = doc_alloc(p->doc, n + 1);
    if (!copy) return out_of_memory(p);
    memcpy(copy, p->s + start, n);
    copy[n] = 0;
    const char *point = localeconv()->decimal_point;
    if (point && point[0] && point[0] != '.' && point[1] == 0) {
        char *dot = strchr(copy, '.');
        if (dot) *dot = point[0];
    }
    char *endp = NULL;
    double d = strtod(copy, &endp);
    if (endp != copy + n) return fail(p, start, "cannot convert the number");
    if (isinf(d)) return fail(p, start, "number too large for a double");
    v->number = d;
    return v;
}

static nb_json *parse_value(parser *p, int depth);

static nb_json *parse_container(parser *p, int depth, bool object) {
    if (depth >= NB_JSON_MAX_DEPTH)
        return fail(p, p->pos, "nesting deeper than %d levels", NB_JSON_MAX_DEPTH);
    nb_json *v = new_node(p, object ? NB_JSON_OBJECT : NB_JSON_ARRAY);
    if (!v) return NULL;
    char close = object ? '}' : ']';
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        return v;
    }
    nb_json *last = NULL;
    for (;;) {
        const char *key = NULL;
        size_t key_len = 0;
        if (object) {
            if (p->pos >= p->len || p->s[p->pos] != '"')
                return fail_unexpected(p, p->pos, "a string key");
            if (!parse_string(p, &key, &key_len)) return NULL;
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':')
                return fail_unexpected(p, p->pos, "':' after an object key");
            p->pos++;
            skip_ws(p);
        }
        nb_json *child = parse_value(p, depth + 1);
        if (!child) return NULL;
        child->key = key;
        child->key_len = key_len;
        if (last) last->next = child;
        else v->first = child;
        last = child;
        v->count++;
        skip_ws(p);
        if (p->pos < p->len && p->s[p->pos] == ',') {
            p->pos++;
            skip_ws(p);
            continue;
        }
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
            return v;
        }
        return fail_unexpected(p, p->pos, object ? "',' or '}'" : "',' or ']'");
    }
}

static nb_json *parse_value(parser *p, int depth) {
    if (p->pos >= p->len) return fail_unexpected(p, p->pos, "a value");
    unsigned char c = p->s[p->pos];
    nb_json *v;
    switch (c) {
    case '{': return parse_container(p, depth, true);
    case '[': return parse_container(p, depth, false);
    case '"':
        v = new_node(p, NB_JSON_STRING);
        if (!v || !parse_string(p, &v->str, &v->len)) return NULL;
        return v;
    case 't':
    case 'f':
    case 'n':
        v = new_node(p, c == 'n' ? NB_JSON_NULL : NB_JSON_BOOL);
        if (!v) return NULL;
        v->boolean = c == 't';
        if (!consume_literal(p, c == 't' ? "true" : c == 'f' ? "false" : "null"))
            return fail(p, p->pos, "invalid literal (expected true, false or null)");
        return v;
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p);
        return fail_unexpected(p, p->pos, "a value");
    }
}

nb_status nb__json_parse(const char *text, size_t len, nb_json_doc **out) {
    *out = NULL;
    nb_json_doc *doc = calloc(1, sizeof *doc);
    if (!doc) return nb_set_error(NB_ERR_NOMEM, "JSON: out of memory");
    parser p = {(const unsigned char *)text, len, 0, doc, NB_OK};
    if (len == 0) p.s = (const unsigned char *)""; /* never read, but not NULL */
    skip_ws(&p);
    nb_json *root = parse_value(&p, 0);
    if (root) {
        skip_ws(&p);
        if (p.pos != p.len) root = fail_unexpected(&p, p.pos, "end of text after the value");
    }
    if (!root) {
        nb__json_free(doc);
        return p.status;
    }
    doc->root = root;
    *out = doc;
    return NB_OK;
}

const nb_json *nb__json_get(const nb_json *object, const char *key) {
    if (!object || object->type != NB_JSON_OBJECT) return NULL;
    size_t n = strlen(key);
    for (const nb_json *c = object->first; c; c = c->next)
        if (c->key_len == n && memcmp(c->key, key, n) == 0) return c;
    return NULL;
}

const char *nb__json_type_name(nb_json_type type) {
    switch (type) {
    case NB_JSON_NULL: return "null";
    case NB_JSON_BOOL: return "a boolean";
    case NB_JSON_NUMBER: return "a number";
    case NB_JSON_STRING: return "a string";
    case NB_JSON_ARRAY: return "an array";
    case NB_JSON_OBJECT: return "an object";
    }
    return "an unknown value";
}

/* ---- writing ---- */
static bool strbuf_reserve(nb_strbuf *b, size_t extra) {
    if (b->failed) return false;
    if (b->cap - b->len > extra) return true;
    if (extra > SIZE_MAX / 2 - b->len) {
        b->failed = true;
        return false;
    }
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len <= extra) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) {
        b->failed = true;
        return false;
    }
    b->data = d;
    b->cap = cap;
    return true;
}

void nb__strbuf_append(nb_strbuf *b, const char *s, size_t n) {
    if (!strbuf_reserve(b, n)) return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void nb__strbuf_printf(nb_strbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !strbuf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void nb__strbuf_free(nb_strbuf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

void nb__json_write_string(nb_strbuf *b, const char *s, size_t n) {
    nb__strbuf_append(b, "\"", 1);
    size_t run = 0; /* bytes copied as they are, flushed before each escape */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char ubuf[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        default:
            if (c < 0x20) {
                snprintf(ubuf, sizeof ubuf, "\\u%04x", c);
                esc = ubuf;
            }
        }
        if (!esc) {
            run++;
            continue;
        }
        nb__strbuf_append(b, s + i - run, run);
        run = 0;
        nb__strbuf_append(b, esc, strlen(esc));
    }
    nb__strbuf_append(b, s + n - run, run);
    nb__strbuf_append(b, "\"", 1);
}

void nb__json_dump(nb_strbuf *b, const nb_json *v) {
    switch (v->type) {
    case NB_JSON_NULL: nb__strbuf_append(b, "null", 4); return;
    case NB_JSON_BOOL:
        if (v->boolean) nb__strbuf_append(b, "true", 4);
        else nb__strbuf_append(b, "false", 5);
        return;
    case NB_JSON_NUMBER: {
        if (v->is_int) {
            nb__strbuf_printf(b, "%lld", (long long)v->integer);
            return;
        }
        /* %.17g round-trips; keep a '.' or exponent so it reads back as
         * a non-integer literal, and never the locale's decimal comma. */
        char num[64];
        snprintf(num, sizeof num, "%.17g", v->number);
        const char *point = localeconv()->decimal_point;
        if (point && point[0] && point[0] != '.' && point[1] == 0) {
            char *q = strchr(num, point[0]);
            if (q) *q = '.';
        }
        if (!strpbrk(num, ".e")) strcat(num, ".0");
        nb__strbuf_append(b, num, strlen(num));
        return;
    }
    case NB_JSON_STRING: nb__json_write_string(b, v->str, v->len); return;
    case NB_JSON_ARRAY:
    case NB_JSON_OBJECT: {
        bool object = v->type == NB_JSON_OBJECT;
        nb__strbuf_append(b, object ? "{" : "[", 1);
        for (const nb_json *c = v->first; c; c = c->next) {
            if (c != v->first) nb__strbuf_append(b, ",", 1);
            if (object) {
                nb__json_write_string(b, c->key, c->key_len);
                nb__strbuf_append(b, ":", 1);
            }
            nb__json_dump(b, c);
        }
        nb__strbuf_append(b, object ? "}" : "]", 1);
        return;
    }
    }
}
