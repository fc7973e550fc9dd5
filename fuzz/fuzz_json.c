/* libFuzzer target for the JSON parser (util/json.c).
 *
 * Any input: the parser must not crash, leak or read out of bounds
 * (ASan, UBSan). An accepted input must round-trip: its dump parses again
 * to an equal tree, and dumping that tree gives the same text. */
/* smoke-instrument: util/json.c */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util/json.h"

static int equal(const nb_json *a, const nb_json *b) {
    if (a->type != b->type || a->key_len != b->key_len || a->count != b->count) return 0;
    if (a->key_len && memcmp(a->key, b->key, a->key_len) != 0) return 0;
    switch (a->type) {
    case NB_JSON_NULL: return 1;
    case NB_JSON_BOOL: return a->boolean == b->boolean;
    case NB_JSON_NUMBER:
        return a->is_int == b->is_int && a->number == b->number &&
               (!a->is_int || a->integer == b->integer);
    case NB_JSON_STRING: return a->len == b->len && memcmp(a->str, b->str, a->len) == 0;
    case NB_JSON_ARRAY:
    case NB_JSON_OBJECT: {
        const nb_json *x = a->first, *y = b->first;
        for (; x && y; x = x->next, y = y->next)
            if (!equal(x, y)) return 0;
        return x == NULL && y == NULL;
    }
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    nb_json_doc *doc = NULL;
    if (nb__json_parse((const char *)data, size, &doc) != NB_OK) {
        if (doc) abort();
        return 0;
    }
    nb_strbuf first = {0};
    nb__json_dump(&first, nb__json_root(doc));
    if (!first.failed) {
        nb_json_doc *again = NULL;
        if (nb__json_parse(first.data ? first.data : "", first.len, &again) != NB_OK) abort();
        if (!equal(nb__json_root(doc), nb__json_root(again))) abort();
        nb_strbuf second = {0};
        nb__json_dump(&second, nb__json_root(again));
        if (!second.failed && (second.len != first.len || memcmp(second.data, first.data, first.len)))
            abort();
        nb__strbuf_free(&second);
        nb__json_free(again);
    }
    nb__strbuf_free(&first);
    nb__json_free(doc);
    return 0;
}
