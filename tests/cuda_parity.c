/* The CUDA-against-CPU parity harness (see cuda_parity.h). Its random
 * numbers come from its own splitmix64 stream, not from nabla's generator,
 * so a bug there cannot hide in both runs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_parity.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda_plugin.h"

/* Note [CPU stand-in mode] in cuda_parity.h. The counters are per test:
 * reset by the fixture of nbt_tcase_create. */
static int standin = -1;          /* -1: NBT_PARITY_DEVICE not read yet */
static int64_t cases_run, cases_not_run, total_run, total_not_run;
static bool test_device_only, fixture_armed;

bool nbt_standin(void) {
    if (standin < 0) {
        const char *v = getenv("NBT_PARITY_DEVICE");
        if (v && *v && strcmp(v, "cpu") != 0 && strcmp(v, "cuda") != 0) {
            fprintf(stderr, "NBT_PARITY_DEVICE=%s: expected cpu or cuda\n", v);
            exit(1);
        }
        standin = v && strcmp(v, "cpu") == 0;
    }
    return standin == 1;
}

nb_device nbt_device(void) {
    cases_run++;
    total_run++;
    return nbt_standin() ? nb_cpu() : nb_cuda(0);
}

bool nbt_dtype_runs(nb_dtype dt) { return !nbt_standin() || (dt != NB_BF16 && dt != NB_F16); }

bool nbt_device_only(const char *test, const char *why) {
    if (!nbt_standin()) return false;
    size_t len = strlen(test); /* START_TEST's function: the test's name and "_fn" */
    if (len > 3 && strcmp(test + len - 3, "_fn") == 0) len -= 3;
    printf("%.*s: not run in the CPU stand-in mode (%s)\n", (int)len, test, why);
    test_device_only = true;
    return true;
}

static void count_setup(void) {
    cases_run = cases_not_run = 0;
    test_device_only = false;
    fixture_armed = true;
}

static void count_teardown(void) {
    /* Check runs the teardown again after a failure in it (no fork): once */
    if (!fixture_armed) return;
    fixture_armed = false;
    if (!nbt_standin() || test_device_only) return;
    ck_assert_msg(cases_run > 0,
                  "the CPU stand-in mode ran no case of this test (%lld not run here): filter "
                  "fewer cases or mark the test NBT_DEVICE_ONLY",
                  (long long)cases_not_run);
}

TCase *nbt_tcase_create(const char *name) {
    TCase *tc = tcase_create(name);
    tcase_add_checked_fixture(tc, count_setup, count_teardown);
    return tc;
}

static void report_totals(void) {
    printf("CPU stand-in mode: %lld cases run, %lld not run here (bf16/f16 inputs)\n",
           (long long)total_run, (long long)total_not_run);
}

void nbt_cuda_require(void) {
    /* Check forks a child per test by default, and a child cannot use a
     * CUDA context its parent initialised: run the tests in-process. */
    setenv("CK_FORK", "no", 1);
    if (nbt_standin()) {
        printf("CPU stand-in mode (NBT_PARITY_DEVICE=cpu): the side under test runs on the "
               "CPU; this checks the tests, not the CUDA kernels\n");
        atexit(report_totals);
        return;
    }
    if (!NABLA_HAVE_CUDA) {
        printf("skipped: nabla was built without CUDA\n");
        exit(77);
    }
    if (nb_cuda_device_count() == 0) {
        /* A build with CUDA has its plugin (Note [CUDA plugin]): one that
         * does not load is a failure, not a missing GPU. */
        if (!nb__cuda_plugin_get()) {
            printf("FAIL: the CUDA plugin could not be loaded: %s\n", nb__cuda_plugin_error());
            exit(1);
        }
        printf("skipped: no CUDA device is visible\n");
        exit(77);
    }
}

double *nbt_values(const nb_tensor *t) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    ck_assert_ptr_nonnull(v);
    nb_to_host_f64(t, v);
    return v;
}

static uint64_t next_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double next_unit(uint64_t *s) { return (double)(next_u64(s) >> 11) * 0x1.0p-53; }

/* v rounded to what dtype can hold, so both runs see the same numbers. */
static double representable(double v, nb_dtype dt) {
    switch (dt) {
    case NB_F32: return (double)(float)v;
    case NB_BF16: return (double)nb_bf16_to_f32(nb_f32_to_bf16((float)v));
    case NB_F16: return (double)nb_f16_to_f32(nb_f32_to_f16((float)v));
    case NB_I32:
    case NB_I64: return floor(v);
    default: return v;
    }
}

static double *make_values(const nbt_input *in, int64_t n, uint64_t *rs) {
    double *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    ck_assert_ptr_nonnull(v);
    bool is_float = nb_dtype_is_float(in->dtype);
    double lo = in->lo, hi = in->hi;
    if (is_float && lo == 0 && hi == 0) {
        lo = -1;
        hi = 1;
    }
    for (int64_t i = 0; i < n; i++) {
        double x = in->values ? in->values[i] : lo + (hi - lo) * next_unit(rs);
        v[i] = representable(x, in->dtype);
        if (!is_float && !in->values && v[i] >= hi) v[i] = hi - 1;
    }
    return v;
}

/* A tensor on ctx's device with the logical values v (row-major), of
 * dtype dt, stored transposed when asked. */
static nb_tensor *make_input(nb_ctx *ctx, nb_ctx *host, const nbt_input *in, nb_dtype dt,
                             const double *v) {
    int nd = in->ndim;
    int64_t shape[NB_MAX_DIMS];
    for (int d = 0; d < nd; d++) shape[d] = in->shape[d];
    nb_tensor *h = nb_from_host(host, NB_F64, nd, shape, v);
    if (in->transposed) {
        ck_assert_msg(nd >= 2, "nbt_parity: a transposed input needs 2 dims");
        /* contiguous storage of the swapped shape holding the transpose */
        h = nb_contiguous(host, nb_transpose(host, h, -1, -2));
    }
    h = nb_cast(host, h, dt);
    nb_tensor *t = nb_to(ctx, h);
    if (nb_device_eq(nb_ctx_device(ctx), h->device)) t = nb_clone(ctx, h);
    if (in->transposed) t = nb_transpose(ctx, t, -1, -2);
    return t;
}

typedef struct side {
    nb_ctx *ctx;
    nb_tensor *in[16], *leaf[16], *out;
} side;

/* Makes the inputs (leaves, then the transposed views) and runs fn. */
static void run_side(side *sd, nb_device dev, bool cuda, int n, const nbt_input *in,
                     double *const *vals, nbt_op_fn fn, void *user, nb_ctx *host) {
    sd->ctx = nb_ctx_new(dev, 0);
    for (int i = 0; i < n; i++) {
        bool fl = nb_dtype_is_float(in[i].dtype);
        nb_dtype dt = cuda ? in[i].dtype : (fl ? NB_F64 : in[i].dtype);
        /* the leaf holds the storage; the op sees it (or its transpose) */
        nb_tensor *t = make_input(sd->ctx, host, &in[i], dt, vals[i]);
        nb_tensor *base = in[i].transposed ? t->base : t;
        if (fl && !in[i].no_grad) {
            nb_set_requires_grad(base, true);
            if (in[i].transposed) t = nb_transpose(sd->ctx, base, -1, -2);
        }
        sd->leaf[i] = base;
        sd->in[i] = t;
    }
    sd->out = fn(sd->ctx, sd->in, user);
    ck_assert_msg(sd->out != NULL, "nbt_parity: the op returned NULL");
}

/* Normalised error of got against ref (n values): the largest difference
 * over the largest reference magnitude, and that magnitude is taken as at
 * least `floor`. */
static double compare(const double *got, const double *ref, int64_t n, int64_t *worst,
                      double floor) {
    double scale = floor, err = 0;
    *worst = -1;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(ref[i]) && fabs(ref[i]) > scale) scale = fabs(ref[i]);
    for (int64_t i = 0; i < n; i++) {
        double e;
        if (isnan(ref[i]) || isnan(got[i])) e = isnan(ref[i]) && isnan(got[i]) ? 0 : INFINITY;
        else if (isinf(ref[i]) || isinf(got[i])) e = ref[i] == got[i] ? 0 : INFINITY;
        else e = fabs(got[i] - ref[i]) / scale;
        if (e > err || (*worst < 0 && e > 0)) {
            err = e;
            *worst = i;
        }
    }
    return err;
}

/* What the side under test is called in messages. */
static const char *tested_name(void) { return nbt_standin() ? "the CPU stand-in" : "CUDA"; }

static double check_pair(const char *name, const char *what, const nb_tensor *got,
                         const nb_tensor *ref, double tol) {
    ck_assert_msg(nb_same_shape(got, ref), "%s: %s has shape %s on %s but %s on the CPU", name,
                  what, nb_shape_str(got), tested_name(), nb_shape_str(ref));
    int64_t n = nb_numel(ref), worst;
    double *g = nbt_values(got), *r = nbt_values(ref);
    /* Below its smallest normal number (2^-14 for f16) a dtype holds values
     * to a fixed absolute step (2^-24), not a relative one: a result whose
     * values are all that small can be compared only on that absolute
     * scale. (Seen on the H100: a mean BCE gradient over 3e5 elements in
     * f16, ~7e-7 each, differed from the reference by 0.66 of that step.) */
    double floor = got->dtype == NB_F16 ? 0x1p-14 : 1e-6;
    double err = compare(g, r, n, &worst, floor);
    if (!nb_dtype_is_float(ref->dtype) || !nb_dtype_is_float(got->dtype)) tol = 0;
    ck_assert_msg(err <= tol,
                  "%s: %s differs: normalised error %.3g > %.3g at element %lld (%s %.9g, cpu "
                  "%.9g; %s, %s)",
                  name, what, err, tol, (long long)worst, nbt_standin() ? "stand-in" : "cuda",
                  worst >= 0 ? g[worst] : 0.0, worst >= 0 ? r[worst] : 0.0, nb_shape_str(ref),
                  nb_dtype_name(got->dtype));
    free(g);
    free(r);
    return err;
}

static double default_tol(int n, const nbt_input *in) {
    for (int i = 0; i < n; i++) {
        switch (in[i].dtype) {
        case NB_F32: return NBT_TOL_F32;
        case NB_F64: return NBT_TOL_F64;
        case NB_BF16: return NBT_TOL_BF16;
        case NB_F16: return NBT_TOL_F16;
        default: break;
        }
    }
    return NBT_TOL_F32;
}

double nbt_parity(const char *name, nbt_op_fn fn, void *user, int n, const nbt_input *in,
                  const nbt_parity_opts *opts) {
    ck_assert_msg(n >= 0 && n <= 16, "nbt_parity: %d inputs (at most 16)", n);
    if (nbt_standin()) {
        for (int i = 0; i < n; i++)
            if (!nbt_dtype_runs(in[i].dtype)) {
                cases_not_run++;
                total_not_run++;
                return 0;
            }
        cases_run++;
        total_run++;
    }
    nbt_parity_opts o = opts ? *opts : (nbt_parity_opts){0};
    uint64_t rs = o.seed ? o.seed : 0x5eed5eedull;
    double tol = o.tol > 0 ? o.tol : default_tol(n, in);
    double gtol = o.grad_tol > 0 ? o.grad_tol : tol;
    bool prev_grad = nb_set_grad_enabled(true);

    double *vals[16];
    for (int i = 0; i < n; i++) vals[i] = make_values(&in[i], nb__numel_shape(in[i].ndim, in[i].shape), &rs);

    nb_ctx *host = nb_ctx_new(nb_cpu(), 0);
    side cpu = {0}, gpu = {0};
    run_side(&cpu, nb_cpu(), false, n, in, vals, fn, user, host);
    if (nbt_standin()) {
        /* no poisoning: the CPU allocator has none */
        run_side(&gpu, nb_cpu(), true, n, in, vals, fn, user, host);
    } else {
        bool prev_poison = nb__cuda_poison();
        nb__cuda_set_poison(true);
        run_side(&gpu, nb_cuda(0), true, n, in, vals, fn, user, host);
        nb__cuda_set_poison(prev_poison);
    }

    double worst = check_pair(name, "output", gpu.out, cpu.out, tol);

    bool backward = !o.no_backward && nb_dtype_is_float(cpu.out->dtype) && cpu.out->requires_grad;
    if (backward) {
        int64_t m = nb_numel(cpu.out);
        nbt_input rin = {.dtype = gpu.out->dtype, .ndim = cpu.out->ndim};
        for (int d = 0; d < cpu.out->ndim; d++) rin.shape[d] = cpu.out->shape[d];
        double *r = make_values(&rin, m, &rs);
        nb_tensor *rc = nb_from_host(cpu.ctx, NB_F64, cpu.out->ndim, cpu.out->shape, r);
        nb_tensor *rg = nb_to(gpu.ctx, nb_cast(host, nb_from_host(host, NB_F64, cpu.out->ndim,
                                                                cpu.out->shape, r),
                                             gpu.out->dtype));
        free(r);
        /* the reference's output is f64 unless the op picks its dtype (a
         * cast): weigh it in f64, which the CPU computes for any dtype */
        nb_tensor *co = cpu.out->dtype == NB_F64 ? cpu.out : nb_cast(cpu.ctx, cpu.out, NB_F64);
        nb_backward(nb_sum_all(cpu.ctx, nb_mul(cpu.ctx, co, rc)));
        nb_backward(nb_sum_all(gpu.ctx, nb_mul(gpu.ctx, gpu.out, rg)));
        for (int i = 0; i < n; i++) {
            if (!cpu.leaf[i]->requires_grad) continue;
            char what[64];
            snprintf(what, sizeof what, "gradient of input %d", i);
            ck_assert_msg(gpu.leaf[i]->grad != NULL, "%s: %s is missing on %s", name, what,
                          tested_name());
            ck_assert_msg(cpu.leaf[i]->grad != NULL, "%s: %s is missing on the CPU", name, what);
            double e = check_pair(name, what, gpu.leaf[i]->grad, cpu.leaf[i]->grad, gtol);
            if (e > worst) worst = e;
        }
    }
    if (!nbt_standin()) nb_cuda_synchronize(nb_cuda(0));
    for (int i = 0; i < n; i++) free(vals[i]);
    nb_ctx_free(cpu.ctx);
    nb_ctx_free(gpu.ctx);
    nb_ctx_free(host);
    nb_set_grad_enabled(prev_grad);
    return worst;
}
