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
 * exchanges (nb__gloo_exchange: the check layer's headers, a small
 * collective's data, the data of an all-reduce of two ranks) and the
 * all-reduces of more ranks (nb__gloo_ring_all_reduce) run on a second
 * context of blocking connections (Note [Blocking exchanges]).
 * Tags are the collective's sequence number. */
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

struct nb__gloo {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    std::chrono::milliseconds timeout{0};
    std::vector<unsigned char> work, tmp; /* reduce-scatter scratch */
};

namespace {

/* Slot prefix of nabla's reduce-scatter; Gloo's collectives use 0x01-0x08. */
constexpr uint8_t kReduceScatterSlot = 0x31;
/* The slot of an exchange's buffers on a blocking context (one exchange
 * at a time per context: the group's worker runs them in order). */
constexpr int kExchangeSlot = 0x34;
/* The largest piece of an exchange (Note [Blocking exchanges]). */
constexpr size_t kPiece = 256 << 10;

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

nb_status nb__gloo_connect(nb__gloo **out, nb__gloo_dev *dev, nb_store *store, const char *prefix, int rank, int size,
                           double timeout_s, double connect_s, bool blocking) {
    *out = nullptr;
    char where[96];
    std::snprintf(where, sizeof where, "nb_pg_init: Gloo could not connect rank %d of %d", rank, size);
    return guard(NB_ERR_NETWORK, where, [&] {
        auto g = std::make_unique<nb__gloo>();
        g->timeout = StoreAdapter::ms(timeout_s);
        g->ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
        /* Gloo waits five times the context's timeout for a pair to connect;
         * every collective sets its own (g->timeout). A blocking
         * connection's reads and writes time out after the context's
         * timeout (the socket's), so there it is the collectives'. */
        double t = blocking ? timeout_s : std::max(connect_s / 5, 0.001);
        g->ctx->setTimeout(StoreAdapter::ms(t)); /* 0 ms: none */
        /* The addresses of ranks slow to publish them: the same bound. */
        StoreAdapter adapter(store, prefix, blocking ? timeout_s : connect_s);
        g->ctx->connectFullMesh(adapter, dev->dev);
        if (blocking)
            for (int p = 0; p < size; p++)
                if (p != rank) g->ctx->getPair(p)->setSync(true, false);
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

/* Note [Blocking exchanges]
 * Gloo's TCP transport reads every connection on one event-loop thread
 * per device. When that thread cannot take a readable connection's lock
 * (its handler tries the lock and returns), it goes back to epoll_wait,
 * which reports the same bytes at once: it spins on a level-triggered
 * descriptor (strace: epoll_wait calls 9 us apart, no read between;
 * perf: Pair::handleEvents, pthread_mutex_trylock), for as long as the
 * lock stays taken, whoever holds it. On a
 * machine of two cores shared by two ranks, that spin took 0.5-5.5 ms of
 * CPU per step of the bundled MLP (1-2 KB of work each), on the core the
 * other rank's threads needed to answer, and each step waited for a
 * scheduler tick (4 ms) or two; 2026-12-02 in benchmarks/RESULTS.md.
 * So what runs every step goes through a second context whose
 * connections are switched to Gloo's synchronous mode: the event loop
 * never sees them, and the group's worker writes its messages and reads
 * the others' itself, in blocking calls, sleeping in the kernel until
 * bytes arrive. Every rank runs the same exchanges in the same order (the
 * worker runs the group's collectives in issue order), so each message
 * is read into the buffer it was sent for; bound buffers on one slot, one
 * exchange at a time. A message of more than kPiece bytes goes in pieces:
 * each rank writes piece k to every other, then reads theirs, so no more
 * than a piece per direction is ever unread and two ranks cannot block
 * each other in write(2). A message longer than the buffer posted for it
 * is an error on the reading rank (Gloo's check, in this thread), not an
 * exception on the event loop's thread that would end the process. A
 * dead peer closes its sockets (read returns 0: "Connection closed by
 * peer"); one that stops answering is named by the waiting thread's
 * watchdog (pg.c) and, at the latest, its reads time out after the
 * group's timeout. An exchange whose sizes the headers did not settle
 * (`sized`: the data of an all-reduce, also unchecked) sends every rank's
 * size first, so that ranks that disagree fail, every one of them, rather
 * than one reading another's shorter message as a result. */
nb_status nb__gloo_exchange(nb__gloo *g, const void *mine, size_t sent, void *all, size_t n, bool own, bool sized) {
    nb_status r = guard(NB_ERR_NETWORK, "Gloo exchange", [&] {
        const int R = g->ctx->size, me = g->ctx->rank;
        auto *bytes = static_cast<unsigned char *>(all);
        if (sent > n) throw gloo::Exception("sends " + std::to_string(sent) + " bytes into " + std::to_string(n));
        if (own) std::memmove(bytes + static_cast<size_t>(me) * n, mine, sent);
        if (R == 1 || n == 0) return NB_OK;
        std::vector<std::unique_ptr<gloo::transport::Buffer>> tx(R), rx(R);
        void *src = const_cast<void *>(mine);
        if (sized) { /* every rank's size first: ranks that disagree all fail */
            std::vector<uint64_t> sizes(static_cast<size_t>(R));
            uint64_t mine_n = sent;
            std::vector<std::unique_ptr<gloo::transport::Buffer>> stx(R), srx(R);
            for (int p = 0; p < R; p++)
                if (p != me) {
                    auto &pair = g->ctx->getPair(p);
                    srx[p] = pair->createRecvBuffer(kExchangeSlot, &sizes[static_cast<size_t>(p)], sizeof mine_n);
                    stx[p] = pair->createSendBuffer(kExchangeSlot, &mine_n, sizeof mine_n);
                    stx[p]->send(0, sizeof mine_n, 0);
                    stx[p]->waitSend();
                }
            for (int p = 0; p < R; p++)
                if (p != me) srx[p]->waitRecv();
            for (int p = 0; p < R; p++)
                if (p != me && sizes[static_cast<size_t>(p)] != mine_n)
                    throw gloo::Exception("rank " + std::to_string(me) + " sends " + std::to_string(mine_n) +
                                          " bytes but rank " + std::to_string(p) + " sends " +
                                          std::to_string(sizes[static_cast<size_t>(p)]));
        }
        for (int p = 0; p < R; p++) {
            if (p == me) continue;
            auto &pair = g->ctx->getPair(p);
            rx[p] = pair->createRecvBuffer(kExchangeSlot, bytes + static_cast<size_t>(p) * n, n);
            tx[p] = pair->createSendBuffer(kExchangeSlot, src, sent > 0 ? sent : 1);
        }
        const size_t pieces = sent > kPiece ? (sent + kPiece - 1) / kPiece : 1;
        for (size_t k = 0; k < pieces; k++) {
            const size_t off = k * kPiece, len = std::min(kPiece, sent - off);
            for (int p = 0; p < R; p++)
                if (p != me) {
                    tx[p]->send(off, len, off);
                    tx[p]->waitSend();
                }
            for (int p = 0; p < R; p++)
                if (p != me) rx[p]->waitRecv();
        }
        return NB_OK;
    });
    if (r != NB_OK && (std::strstr(nb_last_error(), "Timed out") || std::strstr(nb_last_error(), "timeout")))
        r = NB_ERR_TIMEOUT;
    return r;
}

/* Note [Ring on blocking connections]
 * An all-reduce of three ranks or more beyond the one-message limit, on
 * a blocking context (Note [Blocking exchanges]): Gloo's ring done by the
 * group's worker itself, so that a DDP step at any world size stays off
 * the event loop. The data are cut into R chunks (chunk i: elements
 * [i n / R, (i + 1) n / R)); R - 1 steps of reduce-scatter send chunk
 * (r - s) to the right neighbour and add the left one's chunk (r - s - 1)
 * into this rank's, after which rank r holds chunk r + 1 summed over all
 * ranks; R - 1 steps of all-gather then pass the summed chunks round.
 * Each step goes in pieces of at most kPiece bytes, every rank writing
 * its piece to the right before reading the left one's, so at most a
 * piece per connection is ever unread (no two ranks block each other in
 * write(2)); every step has the same number of pieces on every rank,
 * those beyond a shorter chunk's end empty. Each chunk is summed in ring order starting from a different
 * rank, as Gloo's ring does: the same bits on every rank (every rank
 * copies the one sum made of each chunk), not the rank order's. */
nb_status nb__gloo_ring_all_reduce(nb__gloo *g, const nb__coll *c) {
    nb_status r = guard(NB_ERR_NETWORK, "Gloo ring all_reduce", [&] {
        const int R = g->ctx->size, me = g->ctx->rank;
        const size_t n = static_cast<size_t>(c->count), es = nb_dtype_size(c->dtype);
        auto *out = static_cast<unsigned char *>(c->out);
        if (R == 1 || n == 0) return NB_OK;
        auto lo = [&](int i) { return static_cast<size_t>(i) * n / static_cast<size_t>(R); };
        auto mod = [&](int i) { return ((i % R) + R) % R; };
        size_t most = 0;
        for (int i = 0; i < R; i++) most = std::max(most, lo(i + 1) - lo(i));
        g->tmp.resize(std::max(most * es, static_cast<size_t>(1))); /* kept: the next step's are alike */
        unsigned char *tmp = g->tmp.data();
        /* every step in the same number of pieces on every rank (a short chunk's last ones empty) */
        const size_t pieces = std::max((most * es + kPiece - 1) / kPiece, static_cast<size_t>(1));
        auto &right = g->ctx->getPair(mod(me + 1));
        auto &left = g->ctx->getPair(mod(me - 1));
        auto tx = right->createSendBuffer(kExchangeSlot, out, n * es);
        /* one step: this rank's chunk `send` to the right, the left one's chunk `recv` into `into`
         * (at the chunk's own offset when `at_chunk`), reduced into out when `reduce` */
        auto step = [&](gloo::transport::Buffer *rx, int send, int recv, bool reduce) {
            const size_t s0 = lo(send) * es, s1 = lo(send + 1) * es, r0 = lo(recv) * es, r1 = lo(recv + 1) * es;
            const size_t sn = s1 - s0, rn = r1 - r0;
            for (size_t k = 0; k < pieces; k++) {
                const size_t so = std::min(k * kPiece, sn), sl = std::min(kPiece, sn - so);
                const size_t ro = std::min(k * kPiece, rn), rl = std::min(kPiece, rn - ro);
                tx->send(s0 + so, sl, reduce ? so : s0 + so);
                tx->waitSend();
                rx->waitRecv();
                if (reduce && rl) nb__reduce_into(c->dtype, c->op, out + r0 + ro, tmp + ro, rl / es);
            }
        };
        {
            auto rx = left->createRecvBuffer(kExchangeSlot, tmp, g->tmp.size());
            for (int s = 0; s < R - 1; s++) step(rx.get(), mod(me - s), mod(me - s - 1), true);
        }
        auto rx = left->createRecvBuffer(kExchangeSlot, out, n * es);
        for (int s = 0; s < R - 1; s++) step(rx.get(), mod(me + 1 - s), mod(me - s), false);
        return NB_OK;
    });
    if (r != NB_OK && (std::strstr(nb_last_error(), "Timed out") || std::strstr(nb_last_error(), "timeout")))
        r = NB_ERR_TIMEOUT;
    return r;
}

} // extern "C"
