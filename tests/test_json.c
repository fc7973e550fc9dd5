/* The JSON parser and writer of util/json.h: values, escapes and
 * UTF-8, numbers at the int64 edges, every kind of malformed input with
 * its message and byte offset, the depth limit, and dump/parse round
 * trips. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "util/json.h"
#include "testutil.h"

static nb_json_doc *parse_ok_n(const char *text, size_t len) {
    nb_json_doc *doc = NULL;
    nb_status st = nb__json_parse(text, len, &doc);
    ck_assert_msg(st == NB_OK, "parse of \"%.*s\" failed: %s", (int)(len < 60 ? len : 60), text, nb_last_error());
    ck_assert_ptr_nonnull(doc);
    return doc;
}

static nb_json_doc *parse_ok(const char *text) { return parse_ok_n(text, strlen(text)); }

static void expect_error_n(const char *text, size_t len, const char *substr) {
    nb_json_doc *doc = (nb_json_doc *)1;
    nb_status st = nb__json_parse(text, len, &doc);
    ck_assert_msg(st == NB_ERR_FORMAT, "parse of \"%.*s\" gave status %d, not NB_ERR_FORMAT",
                  (int)(len < 60 ? len : 60), text, (int)st);
    ck_assert_ptr_null(doc);
    ck_assert_msg(strstr(nb_last_error(), substr), "message \"%s\" for \"%.*s\" lacks \"%s\"",
                  nb_last_error(), (int)(len < 60 ? len : 60), text, substr);
}

static void expect_error(const char *text, const char *substr) {
    expect_error_n(text, strlen(text), substr);
}

/* Compact text of the parsed value. */
static void expect_dump(const char *text, const char *expected) {
    nb_json_doc *doc = parse_ok(text);
    nb_strbuf b = {0};
    nb__json_dump(&b, nb__json_root(doc));
    ck_assert(!b.failed);
    ck_assert_str_eq(b.data, expected);
    nb__strbuf_free(&b);
    nb__json_free(doc);
}

START_TEST(test_values) {
    nb_json_doc *doc = parse_ok(" {\"a\": [1, -2.5, \"x\", true, false, null, {}, []],\n\t\"b\" : {\"c\":0}} ");
    const nb_json *root = nb__json_root(doc);
    ck_assert_int_eq(root->type, NB_JSON_OBJECT);
    ck_assert_uint_eq(root->count, 2);
    const nb_json *a = nb__json_get(root, "a");
    ck_assert_ptr_nonnull(a);
    ck_assert_int_eq(a->type, NB_JSON_ARRAY);
    ck_assert_uint_eq(a->count, 8);
    const nb_json *v = a->first;
    ck_assert(v->type == NB_JSON_NUMBER && v->is_int && v->integer == 1 && v->number == 1.0);
    v = v->next;
    ck_assert(v->type == NB_JSON_NUMBER && !v->is_int && v->number == -2.5);
    v = v->next;
    ck_assert(v->type == NB_JSON_STRING && v->len == 1 && strcmp(v->str, "x") == 0);
    v = v->next;
    ck_assert(v->type == NB_JSON_BOOL && v->boolean);
    v = v->next;
    ck_assert(v->type == NB_JSON_BOOL && !v->boolean);
    v = v->next;
    ck_assert(v->type == NB_JSON_NULL);
    v = v->next;
    ck_assert(v->type == NB_JSON_OBJECT && v->count == 0 && v->first == NULL);
    v = v->next;
    ck_assert(v->type == NB_JSON_ARRAY && v->count == 0);
    ck_assert_ptr_null(v->next);
    const nb_json *b = nb__json_get(root, "b");
    ck_assert_int_eq(nb__json_get(b, "c")->integer, 0);
    ck_assert_ptr_null(nb__json_get(root, "c"));
    ck_assert_ptr_null(nb__json_get(a, "a")); /* not an object */
    ck_assert_uint_eq(a->offset, 7);          /* where '[' is */
    nb__json_free(doc);

    /* any value at the top level */
    doc = parse_ok("\"top\"");
    ck_assert_str_eq(nb__json_root(doc)->str, "top");
    nb__json_free(doc);
    doc = parse_ok("null");
    ck_assert_int_eq(nb__json_root(doc)->type, NB_JSON_NULL);
    nb__json_free(doc);
    /* the length bounds the text: no terminator needed */
    doc = parse_ok_n("12345", 2);
    ck_assert_int_eq(nb__json_root(doc)->integer, 12);
    nb__json_free(doc);
    /* duplicate keys are kept in order; get finds the first */
    doc = parse_ok("{\"k\":1,\"k\":2}");
    ck_assert_uint_eq(nb__json_root(doc)->count, 2);
    ck_assert_int_eq(nb__json_get(nb__json_root(doc), "k")->integer, 1);
    nb__json_free(doc);
    nb__json_free(NULL);
}
END_TEST

START_TEST(test_strings) {
    nb_json_doc *doc = parse_ok("[\"\\\"\\\\\\/\\b\\f\\n\\r\\t\", \"\\u0041\\u00e9\\u20AC\", "
                                "\"\\uD83D\\uDE00\", \"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\", "
                                "\"a\\u0000b\", \"\"]");
    const nb_json *v = nb__json_root(doc)->first;
    ck_assert_uint_eq(v->len, 8);
    ck_assert_mem_eq(v->str, "\"\\/\b\f\n\r\t", 8);
    v = v->next;
    ck_assert_str_eq(v->str, "A\xc3\xa9\xe2\x82\xac"); /* U+0041 U+00E9 U+20AC */
    v = v->next;
    ck_assert_str_eq(v->str, "\xf0\x9f\x98\x80"); /* U+1F600 from a surrogate pair */
    v = v->next;
    ck_assert_str_eq(v->str, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
    v = v->next;
    ck_assert_uint_eq(v->len, 3);
    ck_assert_mem_eq(v->str, "a\0b", 3);
    v = v->next;
    ck_assert_uint_eq(v->len, 0);
    ck_assert_str_eq(v->str, "");
    nb__json_free(doc);
    /* decoded keys */
    doc = parse_ok("{\"\\u0061b\":1}");
    ck_assert_ptr_nonnull(nb__json_get(nb__json_root(doc), "ab"));
    nb__json_free(doc);
    /* the largest code point, as raw UTF-8 and as a surrogate pair */
    doc = parse_ok("[\"\xf4\x8f\xbf\xbf\", \"\\uDBFF\\uDFFF\"]");
    ck_assert_str_eq(nb__json_root(doc)->first->str, "\xf4\x8f\xbf\xbf");
    ck_assert_str_eq(nb__json_root(doc)->first->next->str, "\xf4\x8f\xbf\xbf");
    nb__json_free(doc);
}
END_TEST

START_TEST(test_numbers) {
    nb_json_doc *doc = parse_ok("[0, -0, 9223372036854775807, -9223372036854775808, "
                                "9223372036854775808, -9223372036854775809, 0.1, -1e-3, 1E+2, "
                                "2.5e-320, 123456789012345678901234567890]");
    const nb_json *v = nb__json_root(doc)->first;
    ck_assert(v->is_int && v->integer == 0);
    v = v->next;
    ck_assert(v->is_int && v->integer == 0);
    v = v->next;
    ck_assert(v->is_int && v->integer == INT64_MAX);
    v = v->next;
    ck_assert(v->is_int && v->integer == INT64_MIN);
    v = v->next;
    ck_assert(!v->is_int && v->number == 9223372036854775808.0);
    v = v->next;
    ck_assert(!v->is_int && v->number == -9223372036854775808.0);
    v = v->next;
    ck_assert(!v->is_int && v->number == 0.1);
    v = v->next;
    ck_assert(!v->is_int && v->number == -1e-3);
    v = v->next;
    ck_assert(!v->is_int && v->number == 100.0);
    v = v->next;
    ck_assert(!v->is_int && v->number == 2.5e-320); /* subnormal: fine */
    v = v->next;
    ck_assert(!v->is_int && v->number == 123456789012345678901234567890.0);
    nb__json_free(doc);
}
END_TEST

START_TEST(test_malformed) {
    expect_error("", "expected a value, found end of text at byte 0");
    expect_error("   ", "expected a value, found end of text at byte 3");
    expect_error("01", "expected end of text after the value, found '1' at byte 1");
    expect_error("1.", "expected a digit after '.', found end of text at byte 2");
    expect_error(".5", "expected a value, found '.' at byte 0");
    expect_error("-", "expected a digit, found end of text at byte 1");
    expect_error("+1", "expected a value, found '+' at byte 0");
    expect_error("1e", "expected a digit in the exponent");
    expect_error("1e400", "number too large for a double at byte 0");
    expect_error("-1e400", "number too large");
    expect_error("[1,]", "expected a value, found ']' at byte 3");
    expect_error("[1 2]", "expected ',' or ']', found '2' at byte 3");
    expect_error("[1,2", "expected ',' or ']', found end of text at byte 4");
    expect_error("{\"a\":1,}", "expected a string key, found '}' at byte 7");
    expect_error("{a:1}", "expected a string key, found 'a' at byte 1");
    expect_error("{\"a\" 1}", "expected ':' after an object key, found '1' at byte 5");
    expect_error("{\"a\":}", "expected a value, found '}' at byte 5");
    expect_error("{\"a\":1", "expected ',' or '}', found end of text");
    expect_error("\"abc", "unterminated string at byte 0");
    expect_error("\"abc\\\"", "unterminated string");
    expect_error("\"abc\\", "unterminated string");
    expect_error("\"\\x\"", "invalid escape \\ followed by 'x' at byte 1");
    expect_error("\"\\u12\"", "\\u must be followed by four hex digits at byte 1");
    expect_error("\"\\u12G4\"", "four hex digits");
    expect_error("\"\\uD800\"", "high surrogate \\uD800 not followed by a low surrogate");
    expect_error("\"\\uD800\\u0041\"", "not followed by a low surrogate");
    expect_error("\"\\uDC00\"", "lone low surrogate \\uDC00");
    expect_error("\"a\nb\"", "control character 0x0a in a string (must be escaped) at byte 2");
    expect_error("\"\xff\"", "invalid UTF-8 byte 0xff in a string at byte 1");
    expect_error("\"\xc0\xaf\"", "invalid UTF-8 byte 0xc0");      /* overlong '/' */
    expect_error("\"\xe0\x80\xaf\"", "invalid UTF-8 byte 0xe0");  /* overlong, 3 bytes */
    expect_error("\"\xed\xa0\x80\"", "invalid UTF-8 byte 0xed");  /* encoded surrogate */
    expect_error("\"\xf4\x90\x80\x80\"", "invalid UTF-8 byte 0xf4"); /* above U+10FFFF */
    expect_error("\"\xe2\x82\"", "invalid UTF-8 byte 0xe2");      /* cut short by the quote */
    expect_error("\"\x80\"", "invalid UTF-8 byte 0x80");          /* lone continuation */
    expect_error("tru", "invalid literal (expected true, false or null) at byte 0");
    expect_error("nul", "invalid literal");
    expect_error("True", "expected a value, found 'T'");
    expect_error("true false", "expected end of text after the value, found 'f' at byte 5");
    expect_error("{}x", "found 'x' at byte 2");
    expect_error("\xef\xbb\xbf{}", "expected a value, found byte 0xef at byte 0"); /* BOM */
    expect_error_n("[1,\0 2]", 7, "expected a value, found byte 0x00 at byte 3");
    expect_error("[\"a\" \"b\"]", "expected ',' or ']'");
    expect_error("'a'", "found '''");
}
END_TEST

START_TEST(test_depth_limit) {
    char buf[2 * (NB_JSON_MAX_DEPTH + 1) + 1];
    for (int depth = NB_JSON_MAX_DEPTH; depth <= NB_JSON_MAX_DEPTH + 1; depth++) {
        int n = 0;
        for (int i = 0; i < depth; i++) buf[n++] = '[';
        for (int i = 0; i < depth; i++) buf[n++] = ']';
        buf[n] = 0;
        if (depth == NB_JSON_MAX_DEPTH) {
            nb__json_free(parse_ok(buf));
        } else {
            char want[64];
            snprintf(want, sizeof want, "nesting deeper than %d levels at byte %d",
                     NB_JSON_MAX_DEPTH, NB_JSON_MAX_DEPTH);
            expect_error(buf, want);
        }
    }
    /* a deep but unterminated prefix must not recurse past the limit either */
    size_t big = 1u << 20;
    char *deep = malloc(big);
    memset(deep, '{', big);
    expect_error_n(deep, big, "expected a string key, found '{' at byte 1");
    for (size_t i = 0; i + 5 <= big; i += 5) memcpy(deep + i, "{\"a\":", 5);
    expect_error_n(deep, big, "nesting deeper than 128 levels at byte 640");
    memset(deep, '[', big);
    expect_error_n(deep, big, "nesting deeper than");
    free(deep);
}
END_TEST

START_TEST(test_large_array) {
    enum { N = 100000 };
    nb_strbuf b = {0};
    nb__strbuf_append(&b, "[", 1);
    for (int i = 0; i < N; i++) nb__strbuf_printf(&b, i ? ",%d" : "%d", i * 7);
    nb__strbuf_append(&b, "]", 1);
    nb_json_doc *doc = parse_ok_n(b.data, b.len);
    const nb_json *root = nb__json_root(doc);
    ck_assert_uint_eq(root->count, N);
    int i = 0;
    for (const nb_json *v = root->first; v; v = v->next, i++) ck_assert_int_eq(v->integer, i * 7);
    ck_assert_int_eq(i, N);
    nb__json_free(doc);
    nb__strbuf_free(&b);
}
END_TEST

START_TEST(test_dump) {
    expect_dump(" { \"a\" : [ 1 , 2.5 , \"x\\n\" ] , \"b\" : null , \"c\" : true } ",
                "{\"a\":[1,2.5,\"x\\n\"],\"b\":null,\"c\":true}");
    /* non-integers keep a '.' or exponent; integers stay integers */
    expect_dump("[100.0, -0.0, 1e30, 5, -0, 0.1]",
                "[100.0,-0.0,1e+30,5,0,0.10000000000000001]");
    /* escapes: control characters as \\uXXXX or short forms, UTF-8 copied */
    expect_dump("\"\\u0001\\u001f\\t\\/\\\"\\\\\xc3\xa9\\u00e9\"",
                "\"\\u0001\\u001f\\t/\\\"\\\\\xc3\xa9\xc3\xa9\"");
    expect_dump("{\"a\\u0000b\":\"\\u0000\"}", "{\"a\\u0000b\":\"\\u0000\"}");
    /* write_string on its own */
    nb_strbuf b = {0};
    nb__json_write_string(&b, "q\"\x7f\n", 4);
    ck_assert_str_eq(b.data, "\"q\\\"\x7f\\n\"");
    nb__strbuf_free(&b);
}
END_TEST

START_TEST(test_utf8_valid) {
    ck_assert(nb__utf8_valid("", 0));
    ck_assert(nb__utf8_valid("plain", 5));
    ck_assert(nb__utf8_valid("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9));
    ck_assert(!nb__utf8_valid("\xc3", 1));
    ck_assert(!nb__utf8_valid("\xc1\xbf", 2));
    ck_assert(!nb__utf8_valid("\xed\xbf\xbf", 3));
    ck_assert(!nb__utf8_valid("\xf5\x80\x80\x80", 4));
    ck_assert(!nb__utf8_valid("a\xfe", 2));
}
END_TEST

int main(void) {
    const TTest *tests[] = {test_values, test_strings, test_numbers, test_malformed, test_depth_limit,
                             test_large_array, test_dump, test_utf8_valid, NULL};
    return nbt_run(nbt_suite("json", "core", 0, tests));
}
