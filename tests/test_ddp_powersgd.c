/* PowerSGD (distributed/ddp_powersgd.c, Note [PowerSGD]) against a direct
 * computation in f64: every rank computes every rank's local gradients
 * with a plain replica, runs the algorithm on them written out naively
 * here (classical Gram-Schmidt, dense products, per-rank error memory),
 * and compares with the averaged gradients DDP hands out, step by step:
 * one plain step, then compressed steps from a random Q, warm-started or
 * not, with error feedback or not. Also the bytes on the wire and the
 * refusals. Run alone and under nbrun with 2 and 3 ranks.
 *
 * The hook computes in the gradients' dtype (Note [PowerSGD's arithmetic]):
 * with an f64 model it matches the direct computation to 1e-10; with an
 * f32 model (the same direct computation in f64 from the f32 local
 * gradients) to F32_TOL relative to the largest element of the parameter:
 * g = local + error rounded to f32, products of length 8 and 6 summed in
 * f32, P and Q stored in f32 between the all-reduces, and the error
 * memory carried in f32 from step to step, each about 1e-7 relative; the
 * tolerance is 10 times the largest difference seen (3.1e-6 of the
 * parameter's largest element, 3 ranks, the fourth step with error
 * feedback). */
#include "ddp_common.h"

#define H 8 /* Linear(6, 8) weight (8 x 6): the one matrix compressed; see psgd_opts */
#define B 3 /* rows per rank */
#define NP 4
#define STEPS 4
#define F32_TOL 3e-5

/* rank 2, compress when (n + m) 2 * 1.5 < n m: the first weight (8 x 6:
 * 42 < 48) yes, the second (3 x 8: 33 < 24) no, the biases no. */
static nb_ddp_powersgd_options psgd_opts(bool ef, bool warm) {
    nb_ddp_powersgd_options o = NB_DDP_POWERSGD_DEFAULTS;
    o.rank = 2, o.start_iter = 1, o.min_compression_rate = 1.5, o.error_feedback = ef, o.warm_start = warm;
    o.seed = 11;
    return o;
}

/* Rank r's loss at step it with model m (forward through ddp when given),
 * inputs of dtype dt. */
static nb_tensor *loss_at(nb_ctx *step, nb_module *m, nb_ddp *ddp, int it, int r, nb_dtype dt) {
    nb_tensor *x, *y;
    make_batch(step, R * B, 300 + (uint64_t)it, &x, &y);
    x = nb_cast(step, shard(step, x, r * B, B), dt);
    y = shard(step, y, r * B, B);
    nb_tensor *out = ddp ? ddp_fwd(ddp, step, x) : nb_module_forward(m, step, x);
    return nb_cross_entropy(step, out, y, NULL);
}

static void read_grads(nb_module *m, double g[NP][64], int64_t numel[NP]) {
    nb_named_tensor p[NP];
    ck_assert_int_eq(nb_module_named_parameters(m, p, NP), NP);
    for (int i = 0; i < NP; i++) {
        numel[i] = nb_numel(p[i].tensor);
        ck_assert(numel[i] <= 64 && p[i].tensor->grad);
        nb_to_host_f64(p[i].tensor->grad, g[i]);
    }
}

/* Classical Gram-Schmidt on the k columns of a (rows x k, row-major). */
static void gram_schmidt(double *a, int rows, int k) {
    double *orig = malloc(sizeof(double) * (size_t)(rows * k));
    memcpy(orig, a, sizeof(double) * (size_t)(rows * k));
    for (int c = 0; c < k; c++) {
        for (int i = 0; i < rows; i++) a[i * k + c] = orig[i * k + c];
        for (int c0 = 0; c0 < c; c0++) {
            double dot = 0;
            for (int i = 0; i < rows; i++) dot += a[i * k + c0] * orig[i * k + c];
            for (int i = 0; i < rows; i++) a[i * k + c] -= dot * a[i * k + c0];
        }
        double nrm = 0;
        for (int i = 0; i < rows; i++) nrm += a[i * k + c] * a[i * k + c];
        for (int i = 0; i < rows; i++) a[i * k + c] /= sqrt(nrm);
    }
    free(orig);
}

/* small_buckets: one parameter per bucket, so a compressed bucket's Q
 * stage is started by the next bucket's launch or by finish (Note
 * [Two-stage communication hooks] in distributed/ddp_reducer.h). */
static void run_equivalence(bool ef, bool warm, bool small_buckets, nb_dtype dt) {
    enum { N = H, M = F_IN, K = 2 };
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0), *rctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0),
           *host = nb_ctx_new(nb_cpu(), 0);
    nb_module *m = mlp_of(pctx, dt, H), *ref = mlp_of(rctx, dt, H);
    nb_ddp_options dopts = NB_DDP_DEFAULTS;
    if (small_buckets) dopts.first_bucket_bytes = dopts.bucket_cap_bytes = 1;
    nb_ddp *ddp = ddp_wrap(m, &dopts, small_buckets ? NP - 1 : -1);
    nb_ddp_powersgd_options po = psgd_opts(ef, warm);
    ck_assert_msg(nb_ddp_set_powersgd(ddp, &po) == NB_OK, "%s", nb_last_error());
    nb_rng rng = nb_rng_make(po.seed);
    static double err[4][NP][64], q[M * K];
    memset(err, 0, sizeof err);
    bool have_q = false;
    for (int it = 0; it < STEPS; it++) {
        /* what DDP hands out on this rank */
        nb_module_zero_grad(m);
        nb_ctx_reset(step);
        ck_assert_msg(nb_ddp_backward(ddp, loss_at(step, m, ddp, it, me, dt)) == NB_OK, "%s", nb_last_error());
        double got[NP][64], local[4][NP][64], want[NP][64];
        int64_t numel[NP];
        read_grads(m, got, numel);
        /* every rank's local gradient, from the replica; the parameters are
         * named in registration order: 0.weight (H x F_IN), 0.bias, 2.weight, 2.bias */
        for (int r = 0; r < R; r++) {
            nb_module_zero_grad(ref);
            nb_ctx_reset(step);
            nb_backward(loss_at(step, ref, NULL, it, r, dt));
            read_grads(ref, local[r], numel);
        }
        ck_assert_int_eq(numel[0], N * M);
        if (R == 1 || it < po.start_iter) { /* plain average (one rank: no buckets, no hook) */
            for (int i = 0; i < NP; i++)
                for (int64_t j = 0; j < numel[i]; j++) {
                    want[i][j] = 0;
                    for (int r = 0; r < R; r++) want[i][j] += local[r][i][j] / R;
                }
        } else {
            double g[4][NP][64];
            for (int r = 0; r < R; r++)
                for (int i = 0; i < NP; i++)
                    for (int64_t j = 0; j < numel[i]; j++) g[r][i][j] = local[r][i][j] + (ef ? err[r][i][j] : 0);
            if (!warm || !have_q) {
                nb_tensor *t = nb_rand_normal(host, NB_F64, NB_SHAPE(M, K), 0, 1, &rng);
                memcpy(q, t->data, sizeof q);
                nb_ctx_reset(host);
                have_q = true;
            }
            gram_schmidt(q, M, K);
            double P[N * K] = {0}, Q[M * K] = {0};
            for (int r = 0; r < R; r++) /* P = mean over ranks of W_r Q */
                for (int i = 0; i < N; i++)
                    for (int c = 0; c < K; c++)
                        for (int l = 0; l < M; l++) P[i * K + c] += g[r][0][i * M + l] * q[l * K + c] / R;
            gram_schmidt(P, N, K);
            for (int r = 0; r < R; r++) /* Q = mean over ranks of W_r^T P */
                for (int l = 0; l < M; l++)
                    for (int c = 0; c < K; c++)
                        for (int i = 0; i < N; i++) Q[l * K + c] += g[r][0][i * M + l] * P[i * K + c] / R;
            memcpy(q, Q, sizeof q);
            for (int i = 0; i < N; i++)
                for (int l = 0; l < M; l++) {
                    want[0][i * M + l] = 0;
                    for (int c = 0; c < K; c++) want[0][i * M + l] += P[i * K + c] * Q[l * K + c];
                }
            for (int i = 1; i < NP; i++)
                for (int64_t j = 0; j < numel[i]; j++) {
                    want[i][j] = 0;
                    for (int r = 0; r < R; r++) want[i][j] += g[r][i][j] / R;
                }
            for (int r = 0; r < R; r++)
                for (int i = 0; i < NP; i++)
                    for (int64_t j = 0; j < numel[i]; j++) err[r][i][j] = g[r][i][j] - want[i][j];
            /* on the wire: 8 + 24 + 3 uncompressed, P 8 x 2, Q 6 x 2 elements, not 83 */
            nb_ddp_step_stats st = nb_ddp_last_stats(ddp);
            ck_assert_int_eq(st.n_buckets, small_buckets ? NP : 1);
            int64_t sent = 0;
            for (int b = 0; b < st.n_buckets; b++) sent += (int64_t)st.buckets[b].bytes;
            ck_assert_int_eq(sent, (35 + 16 + 12) * (int64_t)nb_dtype_size(dt));
        }
        for (int i = 0; i < NP; i++) {
            double scale = 0;
            for (int64_t j = 0; j < numel[i]; j++) scale = fmax(scale, fabs(want[i][j]));
            for (int64_t j = 0; j < numel[i]; j++) {
                double tol = dt == NB_F64 ? 1e-10 * (1 + fabs(want[i][j])) : F32_TOL * scale;
                ck_assert_msg(fabs(got[i][j] - want[i][j]) <= tol,
                              "rank %d step %d (%s, ef %d warm %d): parameter %d element %lld: %.15g, want %.15g "
                              "(tolerance %.3g)",
                              me, it, nb_dtype_name(dt), ef, warm, i, (long long)j, got[i][j], want[i][j], tol);
            }
        }
    }
    nb_ddp_free(ddp);
    nb_ctx_free(host);
    nb_ctx_free(step);
    nb_ctx_free(rctx);
    nb_ctx_free(pctx);
}

START_TEST(test_against_direct_ef_warm) { run_equivalence(true, true, false, NB_F64); }
END_TEST

START_TEST(test_against_direct_plain_restart) { run_equivalence(false, false, false, NB_F64); }
END_TEST

START_TEST(test_against_direct_bucket_per_param) { run_equivalence(true, true, true, NB_F64); }
END_TEST

/* f32 gradients: the hook's products in f32 (Note [PowerSGD's arithmetic]) */
START_TEST(test_against_direct_f32_ef_warm) { run_equivalence(true, true, false, NB_F32); }
END_TEST

START_TEST(test_against_direct_f32_plain_restart) { run_equivalence(false, false, true, NB_F32); }
END_TEST

START_TEST(test_refusals) {
    nb_ctx *pctx = nb_ctx_new(nb_cpu(), 0);
    nb_module *m = mlp_of(pctx, NB_F64, H);
    nb_ddp_options o = NB_DDP_DEFAULTS;
    o.comm_hook = NB_DDP_HOOK_BF16;
    nb_ddp *ddp = ddp_wrap(m, &o, -1);
    nb_ddp_powersgd_options po = psgd_opts(true, true);
    ck_assert_int_eq(nb_ddp_set_powersgd(ddp, &po), NB_ERR_INVALID);
    ck_assert_msg(strstr(nb_last_error(), "both are communication hooks"), "%s", nb_last_error());
    nb_ddp_free(ddp);
    o.comm_hook = NB_DDP_HOOK_ALLREDUCE;
    ddp = ddp_wrap(m, &o, -1);
    po.rank = 0;
    ck_assert_int_eq(nb_ddp_set_powersgd(ddp, &po), NB_ERR_INVALID);
    ck_assert_msg(strstr(nb_last_error(), "rank 0, start_iter 1"), "%s", nb_last_error());
    po.rank = 2;
    ck_assert_int_eq(nb_ddp_set_powersgd(ddp, &po), NB_OK);
    ck_assert_int_eq(nb_ddp_set_powersgd(ddp, NULL), NB_OK);
    nb_ddp_free(ddp);
    nb_ctx_free(pctx);
}
END_TEST

static Suite *suite(void) {
    const TTest *tests[] = {test_against_direct_ef_warm, test_against_direct_plain_restart,
                             test_against_direct_bucket_per_param, test_against_direct_f32_ef_warm,
                             test_against_direct_f32_plain_restart, test_refusals, NULL};
    return nbt_suite("ddp_powersgd", "ddp_powersgd", 120, tests);
}

int main(void) { return nbt_run_world(ddp_setup); }
