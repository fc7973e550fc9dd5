/* The Gloo backend: a thin C++ layer over Debian's libgloo (0.5, 2022
 * API), the only C++ in nabla. C calls it through distributed/internal.h;
 * no exception crosses that line: each entry point catches everything and
 * returns an nb_status with the transport's words in nb_last_error()
 * (Note [No exception crosses the shim]).
 *
 * Gloo's rendezvous goes through nabla's store (StoreAdapter), so there is
 * one store per run. All-reduce, broadcast, all-gather and barrier are
 * Gloo's own; Gloo reduces through a callback given the element size, so
 * bf16 and f16 travel as 16-bit values and nb__reduce_into combines them
 * in f32. This Gloo has no reduce-scatter with the new-style options, so
 * reduce_scatter is a ring over Gloo's unbound buffers: R - 1 steps, each
 * sending one chunk to the right neighbour and reducing one from the
 * left; after them rank r holds chunk r summed over all ranks. The
 * exchanges (nb__gloo_exchange_post: the check layer's headers, lane 0,
 * and a small collective's data, lane 1) are one message from each rank
 * to each other, also over unbound buffers. Tags are the collective's
 * sequence number. */
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include "distributed/internal.h"

struct nb__gloo_dev {
    std::shared_ptr<gloo::transport::Device> dev;
};

/* An exchange in flight (nb__gloo_exchange_post). */
struct nb__gloo_xchg {
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
    int pending = 0; /* receives (and sends) not yet waited for */
};

struct nb__gloo {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    std::chrono::milliseconds timeout{0};
    std::vector<unsigned char> work, tmp; /* reduce-scatter scratch */
};

namespace {

/* Slot prefixes of nabla's own exchanges; Gloo's collectives use 0x01-0x08. */
constexpr uint8_t kReduceScatterSlot = 0x31;
constexpr uint8_t kHeaderSlot = 0x32;
constexpr uint8_t kSmallSlot = 0x33; /* lane 1: a small collective's data */

/* Gloo's store interface over an nb_store connection, keys under a prefix. */
class StoreAdapter : public gloo::rendezvous::Store {
  public:
    StoreAdapter(nb_store *s, std::string prefix, double timeout_s)
        : s_(s), prefix_(std::move(prefix)), timeout_s_(timeout_s) {}

    void set(const std::string &key, const std::vector<char> &data) override {
        check(nb_store_set(s_, (prefix_ + key).c_str(), data.data(), data.size()));
    }

    std::vector<char> get(const std::string &key) override {
        void *v = nullptr;
        size_t n = 0;
        check(nb_store_get(s_, (prefix_ + key).c_str(), timeout_s_, &v, &n));
        std::vector<char> out(static_cast<char *>(v), static_cast<char *>(v) + n);
        free(v);
        return out;
    }

    void wait(const std::vector<std::string> &keys) override { wait(keys, ms(timeout_s_)); }

    /* Gloo passes its context's timeout, the connection's (nb__gloo_connect):
     * a rank that has not published its address yet gets the group's. */
    void wait(const std::vector<std::string> &keys, const std::chrono::milliseconds &) override {
        std::vector<std::string> full;
        std::vector<const char *> ptrs;
        for (const auto &k : keys) full.push_back(prefix_ + k);
        for (const auto &k : full) ptrs.push_back(k.c_str());
        if (!ptrs.empty()) check(nb_store_wait(s_, ptrs.data(), static_cast<int>(ptrs.size()), timeout_s_));
    }

    static std::chrono::milliseconds ms(double s) {
        return std::chrono::milliseconds(static_cast<long long>(s * 1000.0));
    }

  private:
    static void check(nb_status st) {
        if (st != NB_OK) throw gloo::IoException(nb_last_error());
    }
    nb_store *s_;
    std::string prefix_;
    double timeout_s_;
};

template <typename T>
void allreduce_typed(nb__gloo *g, const nb__coll *c) {
    gloo::AllreduceOptions opts(g->ctx);
    opts.setOutput(static_cast<T *>(c->out), static_cast<size_t>(c->count));
    nb_dtype dtype = c->dtype;
    nb_reduce_op op = c->op;
    opts.setReduceFunction([dtype, op](void *out, const void *a, const void *b, size_t n) {
        if (out != a) std::memmove(out, a, n * sizeof(T));
        nb__reduce_into(dtype, op, out, b, n);
    });
    opts.setTag(static_cast<uint32_t>(c->seq));
    opts.setTimeout(g->timeout);
    gloo::allreduce(opts);
}

/* The dtype as an int: an unknown value (tests/test_dist_collectives.c
 * passes one) must reach `default`, and loading it as an nb_dtype would be
 * undefined behaviour (UBSan reports it in `make test-asan`). */
static int dtype_value(const nb__coll *c) {
    static_assert(sizeof(nb_dtype) == sizeof(int), "nb_dtype is an int-sized enum");
    int v;
    std::memcpy(&v, &c->dtype, sizeof v);
    return v;
}

void allreduce(nb__gloo *g, const nb__coll *c) {
    switch (dtype_value(c)) {
    case NB_F32: allreduce_typed<float>(g, c); break;
    case NB_F64: allreduce_typed<double>(g, c); break;
    case NB_I32: allreduce_typed<int32_t>(g, c); break;
    case NB_I64: allreduce_typed<int64_t>(g, c); break;
    case NB_BF16:
    case NB_F16: allreduce_typed<uint16_t>(g, c); break;
    default: throw gloo::Exception("unsupported dtype");
    }
}

void broadcast(nb__gloo *g, const nb__coll *c) {
    gloo::BroadcastOptions opts(g->ctx);
    size_t bytes = static_cast<size_t>(c->count) * nb_dtype_size(c->dtype);
    opts.setOutput(static_cast<unsigned char *>(c->out), bytes);
    opts.setRoot(c->root);
    opts.setTag(static_cast<uint32_t>(c->seq));
    opts.setTimeout(g->timeout);
    gloo::broadcast(opts);
}

void allgather(nb__gloo *g, const nb__coll *c) {
    gloo::AllgatherOptions opts(g->ctx);
    size_t bytes = static_cast<size_t>(c->count) * nb_dtype_size(c->dtype);
    opts.setInput(static_cast<unsigned char *>(const_cast<void *>(c->in)), bytes);
    opts.setOutput(static_cast<unsigned char *>(c->out), bytes * static_cast<size_t>(g->ctx->size));
    opts.setTag(static_cast<uint32_t>(c->seq));
    opts.setTimeout(g->timeout);
    gloo::allgather(opts);
}

void barrier(nb__gloo *g, const nb__coll *c) {
    gloo::BarrierOptions opts(g->ctx);
    opts.setTag(static_cast<uint32_t>(c->seq));
    opts.setTimeout(g->timeout);
    gloo::barrier(opts);
}

void reduce_scatter(nb__gloo *g, const nb__coll *c) {
    const int R = g->ctx->size, r = g->ctx->rank;
    const size_t n = static_cast<size_t>(c->count);
    const size_t chunk = n * nb_dtype_size(c->dtype);
    if (R == 1) {
        std::memcpy(c->out, c->in, chunk);
        return;
    }
    g->work.resize(chunk * static_cast<size_t>(R));
    g->tmp.resize(chunk);
    std::memcpy(g->work.data(), c->in, g->work.size());
    auto wbuf = g->ctx->createUnboundBuffer(g->work.data(), g->work.size());
    auto tbuf = g->ctx->createUnboundBuffer(g->tmp.data(), chunk);
    const int right = (r + 1) % R, left = (r + R - 1) % R;
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlot, static_cast<uint32_t>(c->seq));
    for (int step = 0; step < R - 1; step++) {
        const size_t send_chunk = static_cast<size_t>((r - step - 1 + 2 * R) % R);
        const size_t recv_chunk = static_cast<size_t>((r - step - 2 + 2 * R) % R);
        tbuf->recv(left, slot, 0, chunk);
        wbuf->send(right, slot, send_chunk * chunk, chunk);
        if (!tbuf->waitRecv(g->timeout)) throw gloo::IoException("reduce_scatter: receive aborted");
        nb__reduce_into(c->dtype, c->op, g->work.data() + recv_chunk * chunk, g->tmp.data(), n);
        if (!wbuf->waitSend(g->timeout)) throw gloo::IoException("reduce_scatter: send aborted");
    }
    std::memcpy(c->out, g->work.data() + static_cast<size_t>(r) * chunk, chunk);
}

/* Note [No exception crosses the shim]: every extern "C" entry point that
 * can fail runs its body through guard(), which turns whatever was thrown
 * in this thread (gloo::EnforceNotMet, gloo::IoException, std::bad_alloc,
 * or anything else) into a status with its text in nb_last_error(); the
 * others only run destructors, which cannot throw (noexcept). Gloo's
 * own event-loop thread is another matter: an exception there ends the
 * process, so nothing may reach Gloo that could make it throw there. The
 * one known case, messages whose sizes differ between ranks, never does:
 * ranks compare their collectives' headers first (Note [Collective
 * headers] in pg_gloo.c), and the headers themselves have one fixed size. */
template <typename F>
nb_status guard(nb_status st, const char *where, F &&body) noexcept {
    try {
        return body();
    } catch (const std::exception &e) {
        return nb_set_error(st, "%s: %s", where, e.what());
    } catch (...) {
        return nb_set_error(st, "%s: an exception that is not a std::exception", where);
    }
}

} // namespace

extern "C" {

nb_status nb__gloo_dev_new(nb__gloo_dev **out, const char *hostname, const char *iface) {
    *out = nullptr;
    char where[320];
    std::snprintf(where, sizeof where, "nb_pg_init: cannot open a Gloo TCP device on %s",
                  iface && *iface ? iface : hostname);
    return guard(NB_ERR_NETWORK, where, [&] {
        gloo::transport::tcp::attr attr;
        if (iface && *iface) attr.iface = iface;
        else attr.hostname = hostname;
        auto d = std::make_unique<nb__gloo_dev>();
        d->dev = gloo::transport::tcp::CreateDevice(attr);
        *out = d.release();
        return NB_OK;
    });
}

void nb__gloo_dev_free(nb__gloo_dev *dev) { delete dev; }

nb_status nb__gloo_connect(nb__gloo **out, nb__gloo_dev *dev, nb_store *store, const char *prefix,
                           int rank, int size, double timeout_s, double connect_s) {
    *out = nullptr;
    char where[96];
    std::snprintf(where, sizeof where, "nb_pg_init: Gloo could not connect rank %d of %d", rank, size);
    return guard(NB_ERR_NETWORK, where, [&] {
        auto g = std::make_unique<nb__gloo>();
        g->timeout = StoreAdapter::ms(timeout_s);
        g->ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
        /* Gloo waits five times the context's timeout for a pair to connect;
         * every collective sets its own (g->timeout). */
        g->ctx->setTimeout(StoreAdapter::ms(std::max(connect_s / 5, 0.001)));  /* 0 ms: none */
        /* The addresses of ranks slow to publish them: the same bound. */
        StoreAdapter adapter(store, prefix, connect_s);
        g->ctx->connectFullMesh(adapter, dev->dev);
        *out = g.release();
        return NB_OK;
    });
}

void nb__gloo_free(nb__gloo *g) { delete g; }

nb_status nb__gloo_run(nb__gloo *g, const nb__coll *c) {
    nb_status st = NB_ERR_NETWORK;
    char where[64];
    std::snprintf(where, sizeof where, "Gloo %s", nb__coll_name(c->kind));
    nb_status r = guard(st, where, [&] {
        switch (c->kind) {
        case NB__ALL_REDUCE: allreduce(g, c); break;
        case NB__BROADCAST: broadcast(g, c); break;
        case NB__ALL_GATHER: allgather(g, c); break;
        case NB__REDUCE_SCATTER: reduce_scatter(g, c); break;
        case NB__BARRIER: barrier(g, c); break;
        }
        return NB_OK;
    });
    if (r != NB_OK && std::strstr(nb_last_error(), "Timed out")) r = NB_ERR_TIMEOUT;
    return r;
}

nb_status nb__gloo_exchange_post(nb__gloo *g, const void *mine, void *all, size_t n, uint64_t seq,
                                 int lane, nb__gloo_xchg **out) {
    *out = nullptr;
    nb_status r = guard(NB_ERR_NETWORK, lane ? "Gloo small collective" : "Gloo header exchange", [&] {
        const int R = g->ctx->size, me = g->ctx->rank;
        auto *bytes = static_cast<unsigned char *>(all);
        std::memcpy(bytes + static_cast<size_t>(me) * n, mine, n);
        auto x = std::make_unique<nb__gloo_xchg>();
        if (R > 1) {
            x->buf = g->ctx->createUnboundBuffer(all, n * static_cast<size_t>(R));
            const uint64_t slot = gloo::Slot::build(lane ? kSmallSlot : kHeaderSlot, static_cast<uint32_t>(seq));
            for (int p = 0; p < R; p++)
                if (p != me) x->buf->recv(p, slot, static_cast<size_t>(p) * n, n);
            for (int p = 0; p < R; p++)
                if (p != me) x->buf->send(p, slot, static_cast<size_t>(me) * n, n);
            x->pending = R - 1;
        }
        *out = x.release();
        return NB_OK;
    });
    if (r != NB_OK && std::strstr(nb_last_error(), "Timed out")) r = NB_ERR_TIMEOUT;
    return r;
}

nb_status nb__gloo_exchange_wait(nb__gloo *g, nb__gloo_xchg *x) {
    nb_status r = guard(NB_ERR_NETWORK, "Gloo header exchange", [&] {
        for (; x->pending > 0; x->pending--) {
            if (!x->buf->waitRecv(g->timeout)) throw gloo::IoException("receive aborted");
            if (!x->buf->waitSend(g->timeout)) throw gloo::IoException("send aborted");
        }
        return NB_OK;
    });
    if (r != NB_OK && std::strstr(nb_last_error(), "Timed out")) r = NB_ERR_TIMEOUT;
    delete x; /* pending operations of a failed one are dropped by Gloo */
    return r;
}

void nb__gloo_exchange_free(nb__gloo_xchg *x) { delete x; }

} // extern "C"
