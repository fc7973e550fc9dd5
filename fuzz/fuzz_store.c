/* libFuzzer target: the store server's handling of what a connection
 * sends. The input is the byte stream of one connection; it is cut into
 * frames exactly as the server does (Note [Store protocol]), each frame
 * body is copied to a buffer of its own size (so reads past it are caught
 * by ASan) and parsed, and valid requests run against a fresh table,
 * replies included. A malformed frame ends the input, as it ends the
 * server's connection. Requests that would wait are answered as if their
 * timeout had passed. Build and run: fuzz/run_store.sh. */
/* smoke-instrument: distributed/store_proto.c distributed/store_kv.c */
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static nb__store_req req;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    nb__kv *kv = nb__kv_new(0);
    nb__buf out = {0};
    bool hello = false;
    size_t off = 0;
    while (size - off >= 4) {
        uint32_t len = nb__store_frame_len(data + off);
        if (len > NB_STORE_MAX_MESSAGE || size - off - 4 < len) break;
        uint8_t *body = malloc(len ? len : 1);
        memcpy(body, data + off + 4, len);
        char why[256];
        bool ok = nb__store_parse_request(body, len, &req, why, sizeof why) == NB_OK;
        if (ok && !hello) {
            ok = req.op == NB__OP_HELLO;
            hello = true;
        } else if (ok && req.op == NB__OP_HELLO) {
            ok = false;
        }
        if (ok && !nb__kv_apply(kv, &req, &out)) {
            req.num = 0;
            nb__kv_apply(kv, &req, &out);
        }
        /* every reply the table wrote must be a well-formed frame */
        size_t r = 0;
        while (r + 4 <= out.n) {
            uint32_t rl = nb__store_frame_len(out.p + r);
            if (rl == 0 || r + 4 + rl > out.n || rl > NB_STORE_MAX_MESSAGE) abort();
            r += 4 + (size_t)rl;
        }
        if (r != out.n) abort();
        out.n = 0;
        free(body);
        if (!ok) break;
        off += 4 + (size_t)len;
    }
    nb__buf_free(&out);
    nb__kv_free(kv);
    return 0;
}
