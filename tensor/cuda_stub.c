/* Without CUDA in the build: the CUDA backend's entry points
 * (tensor/cuda/cuda.h), each reporting that this build has no CUDA.
 * Generated from the header's declarations; the kernels are unreachable
 * (no CUDA context can be made), the runtime queries answer "no device". */
#include "tensor/cuda/cuda.h"

#if !NABLA_HAVE_CUDA
#define NO_CUDA(fn) nb_abort(__FILE__, __LINE__, "%s: nabla was built without CUDA", fn)

int nb__cuda_device_count(void) {
    return 0;
}

nb_status nb__cuda_set_device(int device) {
    (void)device;
    return nb_set_error(NB_ERR_UNSUPPORTED, "nb__cuda_set_device: nabla was built without CUDA");
}

void nb__cuda_use(const char *op, int device) {
    (void)op;
    (void)device;
    NO_CUDA("nb__cuda_use");
}

void *nb__cuda_malloc(int device, size_t bytes) {
    (void)device;
    (void)bytes;
    NO_CUDA("nb__cuda_malloc");
}

void nb__cuda_free(int device, void *p) {
    (void)device;
    (void)p;
    NO_CUDA("nb__cuda_free");
}

void *nb__cuda_host_alloc(size_t bytes) {
    (void)bytes;
    NO_CUDA("nb__cuda_host_alloc");
}

void nb__cuda_host_free(void *p) {
    (void)p;
    NO_CUDA("nb__cuda_host_free");
}

nb__stream nb__cuda_compute_stream(int device) {
    (void)device;
    NO_CUDA("nb__cuda_compute_stream");
}

nb__stream nb__cuda_copy_stream(int device) {
    (void)device;
    NO_CUDA("nb__cuda_copy_stream");
}

nb__event nb__cuda_event_new(int device) {
    (void)device;
    NO_CUDA("nb__cuda_event_new");
}

void nb__cuda_event_free(nb__event e) {
    (void)e;
    NO_CUDA("nb__cuda_event_free");
}

void nb__cuda_event_record(nb__event e, nb__stream s) {
    (void)e;
    (void)s;
    NO_CUDA("nb__cuda_event_record");
}

void nb__cuda_stream_wait(nb__stream s, nb__event e) {
    (void)s;
    (void)e;
    NO_CUDA("nb__cuda_stream_wait");
}

void nb__cuda_sync(int device) {
    (void)device;
    NO_CUDA("nb__cuda_sync");
}

void nb__cuda_memcpy_h2d(int device, void *dst, const void *src, size_t bytes) {
    (void)device;
    (void)dst;
    (void)src;
    (void)bytes;
    NO_CUDA("nb__cuda_memcpy_h2d");
}

void nb__cuda_memcpy_d2h(int device, void *dst, const void *src, size_t bytes) {
    (void)device;
    (void)dst;
    (void)src;
    (void)bytes;
    NO_CUDA("nb__cuda_memcpy_d2h");
}

void nb__cuda_memcpy_d2d(int device, void *dst, const void *src, size_t bytes) {
    (void)device;
    (void)dst;
    (void)src;
    (void)bytes;
    NO_CUDA("nb__cuda_memcpy_d2d");
}

void nb__cuda_memset(int device, void *dst, int byte, size_t bytes) {
    (void)device;
    (void)dst;
    (void)byte;
    (void)bytes;
    NO_CUDA("nb__cuda_memset");
}

void nb__cuda_memcpy_h2d_async(int device, void *dst, const void *src, size_t bytes, nb__stream s) {
    (void)device;
    (void)dst;
    (void)src;
    (void)bytes;
    (void)s;
    NO_CUDA("nb__cuda_memcpy_h2d_async");
}

void *nb__cuda_cublaslt(int device) {
    (void)device;
    NO_CUDA("nb__cuda_cublaslt");
}

void *nb__cuda_cudnn(int device) {
    (void)device;
    NO_CUDA("nb__cuda_cudnn");
}

void *nb__cuda_gemm_workspace(int device, size_t *bytes) {
    (void)device;
    (void)bytes;
    NO_CUDA("nb__cuda_gemm_workspace");
}

void nb__cuda_set_poison(bool on) {
    (void)on;
}

bool nb__cuda_poison(void) {
    return false;
}

nb__cuda_fault *nb__cuda_fault_slot(int device) {
    (void)device;
    NO_CUDA("nb__cuda_fault_slot");
}

bool nb__cuda_tf32(void) {
    return false;
}

void nb__cuda_unary(nb__unary_op op, nb_tensor *out, const nb_tensor *a, double s) {
    (void)op;
    (void)out;
    (void)a;
    (void)s;
    NO_CUDA("nb__cuda_unary");
}

void nb__cuda_binary(nb__binary_op op, nb_tensor *out, const nb_tensor *a, const nb_tensor *b) {
    (void)op;
    (void)out;
    (void)a;
    (void)b;
    NO_CUDA("nb__cuda_binary");
}

void nb__cuda_where(nb_tensor *out, const nb_tensor *cond, const nb_tensor *a, const nb_tensor *b) {
    (void)out;
    (void)cond;
    (void)a;
    (void)b;
    NO_CUDA("nb__cuda_where");
}

void nb__cuda_copy(nb_tensor *dst, const nb_tensor *src) {
    (void)dst;
    (void)src;
    NO_CUDA("nb__cuda_copy");
}

void nb__cuda_axpy(nb_tensor *y, double alpha, const nb_tensor *x) {
    (void)y;
    (void)alpha;
    (void)x;
    NO_CUDA("nb__cuda_axpy");
}

void nb__cuda_sum_rows(nb_tensor *out, const nb_tensor *rows, int64_t outer, int64_t inner, double scale) {
    (void)out;
    (void)rows;
    (void)outer;
    (void)inner;
    (void)scale;
    NO_CUDA("nb__cuda_sum_rows");
}

void nb__cuda_max_rows(nb_tensor *out, nb_tensor *arg, const nb_tensor *rows, int64_t outer, int64_t inner) {
    (void)out;
    (void)arg;
    (void)rows;
    (void)outer;
    (void)inner;
    NO_CUDA("nb__cuda_max_rows");
}

void nb__cuda_max_rows_backward(nb_tensor *gp, const nb_tensor *arg, const nb_tensor *g, int64_t outer, int64_t inner) {
    (void)gp;
    (void)arg;
    (void)g;
    (void)outer;
    (void)inner;
    NO_CUDA("nb__cuda_max_rows_backward");
}

void nb__cuda_var_rows(nb_tensor *out, nb_tensor *mean, const nb_tensor *rows, int64_t outer, int64_t inner, double denom) {
    (void)out;
    (void)mean;
    (void)rows;
    (void)outer;
    (void)inner;
    (void)denom;
    NO_CUDA("nb__cuda_var_rows");
}

void nb__cuda_pair_loss(nb_tensor *out, int kind, const nb_tensor *a, const nb_tensor *b) {
    (void)out;
    (void)kind;
    (void)a;
    (void)b;
    NO_CUDA("nb__cuda_pair_loss");
}

void nb__cuda_sum_squares(nb_tensor *out, int n, nb_tensor *const *ts) {
    (void)out;
    (void)n;
    (void)ts;
    NO_CUDA("nb__cuda_sum_squares");
}

void nb__cuda_softmax(nb_tensor *y, const nb_tensor *x, int64_t outer, int64_t k, int64_t inner, bool take_log) {
    (void)y;
    (void)x;
    (void)outer;
    (void)k;
    (void)inner;
    (void)take_log;
    NO_CUDA("nb__cuda_softmax");
}

void nb__cuda_softmax_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g, int64_t outer, int64_t k, int64_t inner, bool take_log) {
    (void)dx;
    (void)y;
    (void)g;
    (void)outer;
    (void)k;
    (void)inner;
    (void)take_log;
    NO_CUDA("nb__cuda_softmax_backward");
}

void nb__cuda_cross_entropy(nb_tensor *loss, nb_tensor *lse, nb_tensor *count, const nb_tensor *logits, const nb_tensor *targets, int64_t ignore_index, double eps) {
    (void)loss;
    (void)lse;
    (void)count;
    (void)logits;
    (void)targets;
    (void)ignore_index;
    (void)eps;
    NO_CUDA("nb__cuda_cross_entropy");
}

void nb__cuda_cross_entropy_backward(nb_tensor *dlogits, const nb_tensor *logits, const nb_tensor *lse, const nb_tensor *targets, const nb_tensor *g, const nb_tensor *count, int64_t ignore_index, double eps) {
    (void)dlogits;
    (void)logits;
    (void)lse;
    (void)targets;
    (void)g;
    (void)count;
    (void)ignore_index;
    (void)eps;
    NO_CUDA("nb__cuda_cross_entropy_backward");
}

void nb__cuda_softmax_causal(nb_tensor *y, const nb_tensor *x, int64_t b, int64_t t, int64_t s, double scale) {
    (void)y;
    (void)x;
    (void)b;
    (void)t;
    (void)s;
    (void)scale;
    NO_CUDA("nb__cuda_softmax_causal");
}

void nb__cuda_softmax_causal_backward(nb_tensor *dx, const nb_tensor *y, const nb_tensor *g, int64_t b, int64_t t, int64_t s, double scale) {
    (void)dx;
    (void)y;
    (void)g;
    (void)b;
    (void)t;
    (void)s;
    (void)scale;
    NO_CUDA("nb__cuda_softmax_causal_backward");
}

bool nb__cuda_gemm_readable(const nb_tensor *t) {
    (void)t;
    NO_CUDA("nb__cuda_gemm_readable");
}

void nb__cuda_matmul(nb_tensor *out, const nb_tensor *a, const nb_tensor *b, bool trans_a, bool trans_b, const nb_tensor *bias, bool gelu, nb_tensor *pre) {
    (void)out;
    (void)a;
    (void)b;
    (void)trans_a;
    (void)trans_b;
    (void)bias;
    (void)gelu;
    (void)pre;
    NO_CUDA("nb__cuda_matmul");
}

void nb__cuda_conv2d_forward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x, const void *w, const void *b) {
    (void)ctx;
    (void)dt;
    (void)g;
    (void)out;
    (void)x;
    (void)w;
    (void)b;
    NO_CUDA("nb__cuda_conv2d_forward");
}

void nb__cuda_conv2d_backward(nb_ctx *ctx, nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw, void *db, const void *gout, const void *x, const void *w) {
    (void)ctx;
    (void)dt;
    (void)g;
    (void)dx;
    (void)dw;
    (void)db;
    (void)gout;
    (void)x;
    (void)w;
    NO_CUDA("nb__cuda_conv2d_backward");
}

void nb__cuda_batch_norm(nb_tensor *y, nb_tensor *save_mean, nb_tensor *save_invstd, const nb_tensor *x, const nb_tensor *weight, const nb_tensor *bias, nb_tensor *running_mean, nb_tensor *running_var, bool training, double momentum, double eps, int64_t n, int64_t c, int64_t s) {
    (void)y;
    (void)save_mean;
    (void)save_invstd;
    (void)x;
    (void)weight;
    (void)bias;
    (void)running_mean;
    (void)running_var;
    (void)training;
    (void)momentum;
    (void)eps;
    (void)n;
    (void)c;
    (void)s;
    NO_CUDA("nb__cuda_batch_norm");
}

void nb__cuda_batch_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db, const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean, const nb_tensor *invstd, const nb_tensor *weight, bool training, int64_t n, int64_t c, int64_t s) {
    (void)dx;
    (void)dw;
    (void)db;
    (void)g;
    (void)x;
    (void)mean;
    (void)invstd;
    (void)weight;
    (void)training;
    (void)n;
    (void)c;
    (void)s;
    NO_CUDA("nb__cuda_batch_norm_backward");
}

void nb__cuda_max_pool2d(nb_tensor *out, nb_tensor *arg, const nb_tensor *x, const nb__pool2d_geom *g) {
    (void)out;
    (void)arg;
    (void)x;
    (void)g;
    NO_CUDA("nb__cuda_max_pool2d");
}

void nb__cuda_max_pool2d_backward(nb_tensor *dx, const nb_tensor *arg, const nb_tensor *gout, const nb__pool2d_geom *g) {
    (void)dx;
    (void)arg;
    (void)gout;
    (void)g;
    NO_CUDA("nb__cuda_max_pool2d_backward");
}

void nb__cuda_avg_pool2d(nb_tensor *out, const nb_tensor *x, const nb__pool2d_geom *g) {
    (void)out;
    (void)x;
    (void)g;
    NO_CUDA("nb__cuda_avg_pool2d");
}

void nb__cuda_avg_pool2d_backward(nb_tensor *dx, const nb_tensor *gout, const nb__pool2d_geom *g) {
    (void)dx;
    (void)gout;
    (void)g;
    NO_CUDA("nb__cuda_avg_pool2d_backward");
}

void nb__cuda_layer_norm(nb_tensor *y, nb_tensor *mean, nb_tensor *rstd, const nb_tensor *x, const nb_tensor *w, const nb_tensor *b, int64_t m, int64_t d, double eps) {
    (void)y;
    (void)mean;
    (void)rstd;
    (void)x;
    (void)w;
    (void)b;
    (void)m;
    (void)d;
    (void)eps;
    NO_CUDA("nb__cuda_layer_norm");
}

void nb__cuda_layer_norm_backward(nb_tensor *dx, nb_tensor *dw, nb_tensor *db, const nb_tensor *g, const nb_tensor *x, const nb_tensor *mean, const nb_tensor *rstd, const nb_tensor *w, int64_t m, int64_t d) {
    (void)dx;
    (void)dw;
    (void)db;
    (void)g;
    (void)x;
    (void)mean;
    (void)rstd;
    (void)w;
    (void)m;
    (void)d;
    NO_CUDA("nb__cuda_layer_norm_backward");
}

void nb__cuda_embedding(nb_tensor *out, const nb_tensor *w, const nb_tensor *idx, int64_t np) {
    (void)out;
    (void)w;
    (void)idx;
    (void)np;
    NO_CUDA("nb__cuda_embedding");
}

void nb__cuda_embedding_backward(nb_tensor *gw, const nb_tensor *g, const nb_tensor *idx, int64_t np) {
    (void)gw;
    (void)g;
    (void)idx;
    (void)np;
    NO_CUDA("nb__cuda_embedding_backward");
}

void nb__cuda_dropout(nb_tensor *out, nb_tensor *mask, const nb_tensor *x, double p, uint64_t seed, uint64_t offset) {
    (void)out;
    (void)mask;
    (void)x;
    (void)p;
    (void)seed;
    (void)offset;
    NO_CUDA("nb__cuda_dropout");
}

void nb__cuda_rand_uniform(nb_tensor *t, double low, double high, uint64_t seed, uint64_t offset) {
    (void)t;
    (void)low;
    (void)high;
    (void)seed;
    (void)offset;
    NO_CUDA("nb__cuda_rand_uniform");
}

void nb__cuda_rand_normal(nb_tensor *t, double mean, double std, uint64_t seed, uint64_t offset) {
    (void)t;
    (void)mean;
    (void)std;
    (void)seed;
    (void)offset;
    NO_CUDA("nb__cuda_rand_normal");
}

void nb__cuda_adam(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *m, nb_tensor *const *v, const int64_t *steps, const double *const *hp, bool decoupled) {
    (void)n;
    (void)p;
    (void)g;
    (void)m;
    (void)v;
    (void)steps;
    (void)hp;
    (void)decoupled;
    NO_CUDA("nb__cuda_adam");
}

void nb__cuda_sgd(int n, nb_tensor *const *p, nb_tensor *const *g, nb_tensor *const *buf, const int64_t *steps, const double *const *hp) {
    (void)n;
    (void)p;
    (void)g;
    (void)buf;
    (void)steps;
    (void)hp;
    NO_CUDA("nb__cuda_sgd");
}

bool nb_cuda_available(void) { return false; }
int nb_cuda_device_count(void) { return 0; }
void nb_cuda_synchronize(nb_device device) {
    nb_abort(__FILE__, __LINE__, "nb_cuda_synchronize: %s: nabla was built without CUDA",
             nb_device_name(device));
}
void nb_cuda_set_allow_tf32(bool on) { (void)on; }
bool nb_cuda_allow_tf32(void) { return false; }

#endif
