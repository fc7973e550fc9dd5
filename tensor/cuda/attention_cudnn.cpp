/* cuDNN's fused causal attention (its flash-attention engine), through the
 * graph API of NVIDIA's cudnn-frontend headers: the fast path of
 * tensor/cuda/attention.cu (Note [CUDA attention paths] there), with the
 * same contract (Note [Attention contract] in tensor/backend.h).
 *
 * The headers are not ours and not in the repository: the build takes them
 * from the PyPI package nvidia-cudnn-frontend (cmake/NablaDependencies.cmake)
 * and defines NABLA_HAVE_CUDNN_FRONTEND; without them this file only says
 * so, and attention.cu runs its own kernels.
 *
 * qkv (N, T, 3C) is read in place: q, k and v of head h are (N, H, T, D)
 * views with strides (3 C T, D, 3 C, 1) starting at columns h D, C + h D
 * and 2C + h D, and dqkv is written through the same views, every element
 * once; y and gy (N, T, C) are (N, H, T, D) with strides (C T, D, C, 1);
 * lse is cuDNN's softmax statistics, (N, H, T, 1) in f32, the natural
 * log-sum-exp of the scaled scores. A graph is built once per device,
 * direction, dtype, shape and scale, and kept for the process (a training
 * run has one or two shapes); building is the slow part (tens of ms). */
#include "tensor/cuda/cuda.h"

#if NABLA_HAVE_CUDNN_FRONTEND
#include <cudnn_frontend.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

namespace fe = cudnn_frontend;

namespace {

enum { UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV };

typedef std::tuple<int, bool, int, int64_t, int64_t, int64_t, int64_t, double> graph_key;
struct built {
    std::shared_ptr<fe::graph::Graph> g; /* null when cuDNN refused the shape */
    std::string why;
    int64_t workspace = 0;
};
std::mutex graphs_lock;
std::map<graph_key, built> graphs;

std::shared_ptr<fe::graph::Tensor_attributes> view(fe::graph::Graph &g, const char *name, int uid,
                                                   int64_t n, int64_t h, int64_t t, int64_t d,
                                                   int64_t row) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n, h, t, d})
                        .set_stride({row * t, d, row, 1}));
}

/* The graph for this call, built under the device's cuDNN lock (the
 * handle is the device's, bound to its compute stream). */
built &graph_for(cudnnHandle_t handle, int dev, bool backward, nb_dtype dt, int64_t n, int64_t h,
                 int64_t t, int64_t d, double scale) {
    graph_key key{dev, backward, (int)dt, n, h, t, d, scale};
    std::lock_guard<std::mutex> hold(graphs_lock);
    auto it = graphs.find(key);
    if (it != graphs.end()) return it->second;
    built &b = graphs[key];
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(dt == NB_BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    int64_t c = h * d;
    auto q = view(*g, "q", UID_Q, n, h, t, d, 3 * c), k = view(*g, "k", UID_K, n, h, t, d, 3 * c),
         v = view(*g, "v", UID_V, n, h, t, d, 3 * c);
    if (!backward) {
        auto opts = fe::graph::SDPA_attributes()
                        .set_name("attention")
                        .set_generate_stats(true)
                        .set_causal_mask(true)
                        .set_attn_scale((float)scale);
        auto [o, stats] = g->sdpa(q, k, v, opts);
        o->set_output(true).set_uid(UID_O).set_dim({n, h, t, d}).set_stride({c * t, d, c, 1});
        stats->set_output(true)
            .set_uid(UID_STATS)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim({n, h, t, 1})
            .set_stride({h * t, t, 1, 1});
    } else {
        auto o = view(*g, "o", UID_O, n, h, t, d, c), dout = view(*g, "do", UID_DO, n, h, t, d, c);
        auto stats = g->tensor(fe::graph::Tensor_attributes()
                                   .set_name("stats")
                                   .set_uid(UID_STATS)
                                   .set_dim({n, h, t, 1})
                                   .set_stride({h * t, t, 1, 1})
                                   .set_data_type(fe::DataType_t::FLOAT));
        auto opts = fe::graph::SDPA_backward_attributes()
                        .set_name("attention backward")
                        .set_causal_mask(true)
                        .set_attn_scale((float)scale);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
        dq->set_output(true).set_uid(UID_DQ).set_dim({n, h, t, d}).set_stride({3 * c * t, d, 3 * c, 1});
        dk->set_output(true).set_uid(UID_DK).set_dim({n, h, t, d}).set_stride({3 * c * t, d, 3 * c, 1});
        dv->set_output(true).set_uid(UID_DV).set_dim({n, h, t, d}).set_stride({3 * c * t, d, 3 * c, 1});
    }
    fe::error_t e = g->validate();
    if (e.is_good()) e = g->build_operation_graph(handle);
    if (e.is_good()) e = g->create_execution_plans({fe::HeurMode_t::A});
    if (e.is_good()) e = g->check_support(handle);
    if (e.is_good()) e = g->build_plans(handle);
    if (e.is_good()) e = g->get_workspace_size(b.workspace);
    if (e.is_good()) b.g = g;
    else b.why = "cuDNN refused the graph: " + e.get_message();
    return b;
}

/* Enqueues the graph with these pointers; false and *why when it cannot. */
bool run(int dev, bool backward, nb_dtype dt, int64_t n, int64_t h, int64_t t, int64_t d,
         double scale, std::unordered_map<int64_t, void *> &ptrs, const char **why) {
    static thread_local std::string reason;
    if (dt != NB_BF16 && dt != NB_F16) {
        *why = "cuDNN's fused attention takes bf16 and f16 only";
        return false;
    }
    if (d % 8 != 0 || d > 128) {
        *why = "cuDNN's fused attention takes head dimensions that are multiples of 8 up to 128";
        return false;
    }
    cudnnHandle_t handle = (cudnnHandle_t)nb__cuda_cudnn_lock(dev);
    built &b = graph_for(handle, dev, backward, dt, n, h, t, d, scale);
    if (!b.g) {
        nb__cuda_cudnn_unlock(dev);
        reason = b.why;
        *why = reason.c_str();
        return false;
    }
    void *ws = nullptr;
    if (nb__cuda_cudnn_workspace(dev, (size_t)b.workspace, &ws) != NB_OK) {
        nb__cuda_cudnn_unlock(dev);
        reason = std::string("no workspace: ") + nb_last_error();
        *why = reason.c_str();
        return false;
    }
    fe::error_t e = b.g->execute(handle, ptrs, ws);
    nb__cuda_cudnn_unlock(dev);
    if (e.is_bad()) /* enqueued graphs that fail are a bug, not a fallback */
        NB_ABORT("CausalSelfAttention%s: cuDNN's execute failed: %s", backward ? " backward" : "",
                 e.get_message().c_str());
    return true;
}

char *col(const nb_tensor *x, int64_t c) {
    return (char *)x->data + c * (int64_t)nb_dtype_size(x->dtype);
}

} // namespace

extern "C" bool nb__cuda_cudnn_attention(nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv, int h,
                                         double scale, const char **why) {
    int64_t n = qkv->shape[0], t = qkv->shape[1], c = qkv->shape[2] / 3;
    std::unordered_map<int64_t, void *> ptrs = {
        {UID_Q, col(qkv, 0)}, {UID_K, col(qkv, c)}, {UID_V, col(qkv, 2 * c)},
        {UID_O, y->data},     {UID_STATS, lse->data}};
    return run(y->device.index, false, qkv->dtype, n, h, t, c / h, scale, ptrs, why);
}

extern "C" bool nb__cuda_cudnn_attention_backward(nb_tensor *dqkv, const nb_tensor *qkv,
                                                  const nb_tensor *y, const nb_tensor *lse,
                                                  const nb_tensor *gy, int h, double scale,
                                                  const char **why) {
    int64_t n = qkv->shape[0], t = qkv->shape[1], c = qkv->shape[2] / 3;
    std::unordered_map<int64_t, void *> ptrs = {
        {UID_Q, col(qkv, 0)},   {UID_K, col(qkv, c)},     {UID_V, col(qkv, 2 * c)},
        {UID_O, y->data},       {UID_STATS, lse->data},   {UID_DO, gy->data},
        {UID_DQ, col(dqkv, 0)}, {UID_DK, col(dqkv, c)},   {UID_DV, col(dqkv, 2 * c)}};
    return run(dqkv->device.index, true, qkv->dtype, n, h, t, c / h, scale, ptrs, why);
}

#else /* built without the cudnn-frontend headers */

static const char no_frontend[] =
    "this build has no cudnn-frontend headers (the configure summary says why)";

extern "C" bool nb__cuda_cudnn_attention(nb_tensor *y, nb_tensor *lse, const nb_tensor *qkv, int h,
                                         double scale, const char **why) {
    (void)y, (void)lse, (void)qkv, (void)h, (void)scale;
    *why = no_frontend;
    return false;
}

extern "C" bool nb__cuda_cudnn_attention_backward(nb_tensor *dqkv, const nb_tensor *qkv,
                                                  const nb_tensor *y, const nb_tensor *lse,
                                                  const nb_tensor *gy, int h, double scale,
                                                  const char **why) {
    (void)dqkv, (void)qkv, (void)y, (void)lse, (void)gy, (void)h, (void)scale;
    *why = no_frontend;
    return false;
}

#endif
