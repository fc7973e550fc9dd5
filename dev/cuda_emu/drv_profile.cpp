/* The events profile (tensor/cuda/profile.cu, Note [Events profile]) end
 * to end: a small GPT training step (forward, loss, backward, AdamW with
 * the clip inside, zero_grad; f32 and bf16) runs through the front end
 * over the real CUDA table (tensor/cuda/backend.c) wrapped by
 * nb__cuda_profile_table, its kernels emulated; the file
 * nb__cuda_profile_write leaves is read back and compared with the meta
 * device's count of the same step (meta:cuda, nabla/meta.h): the same
 * entries, each with the same calls. The elapsed times are the stand-in's
 * (include/cuda_runtime.h: 1 us per emulated kernel launch between the
 * events), so the file's total must equal the launches the step made, which
 * holds only when every launch falls inside one timed pair.
 *
 * How the step reaches the emulated CUDA table: the emulator's libnabla is
 * a CPU-only build, which makes no CUDA context, so the step runs on
 * meta:cuda, whose table lookup (nb__meta_backend) is wrapped
 * (-Wl,--wrap=nb__meta_backend): while `emulate` is set it answers with the
 * timed CUDA table, whose memory is host memory (emu_backend.cpp); else
 * with the meta device's own table, which counts. Both runs see the same
 * device and the same backend flags (tensor/cuda/flags.h), so the front
 * end makes the same calls. */
#include "check.h"
#include <map>
#include <nabla/nabla.h>
#include <unistd.h>
extern "C" {
#include "tensor/backend.h"
extern const nb__backend nb__cuda_backend; /* tensor/cuda/backend.c */
const nb__backend *__real_nb__meta_backend(int of);
}

static const nb__backend *timed_table;
static bool emulate;

extern "C" const nb__backend *__wrap_nb__meta_backend(int of) {
    if (emulate && of == NB_DEVICE_CUDA) return timed_table;
    return __real_nb__meta_backend(of);
}

struct run {
    nb_ctx *params, *step;
    nb_module *model;
    nb_named_tensor p[64];
    nb_optim *opt;
    nb_tensor *x, *y;
};

/* A 2-layer GPT (vocabulary 40, sequence 12, width 16, 2 heads) and one
 * batch of 2 sequences on meta:cuda. */
static void make(run *r, bool bf16) {
    nb_device dev = nb_meta(NB_DEVICE_CUDA);
    r->params = nb_ctx_new(dev, 0);
    r->step = nb_ctx_new(dev, 0);
    if (bf16) nb_ctx_set_compute_dtype(r->step, NB_BF16);
    nb_gpt_config cfg = {40, 12, 2, 2, 16, 0.0};
    nb_rng rng = nb_rng_make(7);
    r->model = nb_gpt_new(r->params, NB_F32, &cfg, &rng);
    int np = nb_module_named_parameters(r->model, r->p, 64);
    NB_CHECK(np <= 64, "drv_profile: %d parameters", np);
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.weight_decay = 0.1;
    r->opt = nb_optim_new(NB_OPTIM_ADAMW, r->p, np, &h);
    int64_t tok[2 * 12 + 1];
    for (int i = 0; i < 2 * 12 + 1; i++) tok[i] = (i * 7 + 3) % 40;
    int64_t shape[2] = {2, 12};
    r->x = nb_from_host(r->params, NB_I64, 2, shape, tok);
    r->y = nb_from_host(r->params, NB_I64, 2, shape, tok + 1);
}

static void step(run *r) {
    nb_ctx_reset(r->step);
    nb_tensor *l = nb_gpt_forward_loss(r->model, r->step, r->x, r->y);
    nb_backward(l);
    nb_optim_step_clipped(r->opt, r->step, 1.0, 2.0);
    nb_optim_zero_grad(r->opt);
}

static void drop(run *r) {
    nb_optim_free(r->opt);
    nb_ctx_free(r->step);
    nb_ctx_free(r->params);
}

/* {entry: (calls, us)} from the profile file; header lines counted. */
static std::map<std::string, std::pair<long long, double>> read_profile(const char *path,
                                                                         double *total_us,
                                                                         int *comments) {
    std::map<std::string, std::pair<long long, double>> m;
    FILE *f = fopen(path, "r");
    char line[256], name[128];
    *comments = 0;
    *total_us = -1;
    while (f && fgets(line, sizeof line, f)) {
        long long calls;
        double us;
        if (line[0] == '#') {
            ++*comments;
            if (sscanf(line, "# total %lld %lf", &calls, &us) == 2) *total_us = us;
        } else if (sscanf(line, "%127s %lld %lf", name, &calls, &us) == 3) {
            m[name] = {calls, us};
        } else {
            CHECKS++, FAILS++;
            printf("FAIL %s: a line that is not `entry calls us`: %s", path, line);
        }
    }
    if (f) fclose(f);
    return m;
}

static void profile_step(bool bf16) {
    std::string nm = bf16 ? "bf16" : "f32";
    char path[] = "/tmp/drv_profile.XXXXXX";
    int fd = mkstemp(path);
    NB_CHECK(fd >= 0, "drv_profile: mkstemp failed");
    close(fd);

    /* the emulated CUDA step, a warm-up step first (gradients and optimizer state made) */
    run r;
    emulate = true;
    make(&r, bf16);
    step(&r);
    nb__cuda_profile_reset();
    long launches0 = emu_launches;
    step(&r);
    long launches = emu_launches - launches0;
    CHECKS++;
    if (nb__cuda_profile_write(path) != NB_OK) {
        FAILS++;
        printf("FAIL %s: nb__cuda_profile_write: %s\n", nm.c_str(), nb_last_error());
    }
    drop(&r);
    emulate = false;

    /* the same step, counted */
    make(&r, bf16);
    step(&r);
    nb_meta_reset();
    step(&r);
    nb_meta_entry e[256];
    int n = nb_meta_entries(e, 256);
    drop(&r);

    double total_us;
    int comments;
    auto got = read_profile(path, &total_us, &comments);
    unlink(path);
    CHECKS++;
    if (comments < 2 || got.empty()) {
        FAILS++;
        printf("FAIL %s: the profile has %d comment lines and %zu entries\n", nm.c_str(), comments,
               got.size());
    }
    long long calls_meta = 0, calls_got = 0;
    double us_got = 0;
    for (int i = 0; i < n; i++) {
        CHECKS++;
        calls_meta += e[i].calls;
        auto it = got.find(e[i].name);
        if (it == got.end() || it->second.first != e[i].calls) {
            FAILS++;
            printf("FAIL %s: entry %s: %lld calls in the profile, %lld counted by meta:cuda\n",
                   nm.c_str(), e[i].name, it == got.end() ? 0LL : it->second.first,
                   (long long)e[i].calls);
        }
    }
    for (auto &[name, v] : got) {
        calls_got += v.first, us_got += v.second;
        bool counted = false;
        for (int i = 0; i < n; i++) counted |= name == e[i].name;
        CHECKS++;
        if (!counted) {
            FAILS++;
            printf("FAIL %s: entry %s (%lld calls) in the profile, not counted by meta:cuda\n",
                   nm.c_str(), name.c_str(), v.first);
        }
    }
    /* the stand-in's clock: 1 us per launch, every launch inside a pair */
    CHECKS++;
    if (us_got != (double)launches || total_us != us_got) {
        FAILS++;
        printf("FAIL %s: the profile's microseconds sum to %.3f (total line %.3f); the step "
               "launched %ld kernels\n", nm.c_str(), us_got, total_us, launches);
    }
    printf("%s: %d entries, %lld calls (meta:cuda %lld), %ld kernel launches\n", nm.c_str(),
           (int)got.size(), calls_got, calls_meta, launches);
}

int main() {
    init();
    setenv("NABLA_CUDA_ATTENTION", "own", 1); /* no cuDNN here; meta:cuda reads it too */
    /* off: the CUDA table itself, nothing wrapped */
    unsetenv("NABLA_CUDA_PROFILE");
    CHECKS++;
    if (nb__cuda_profile_table(&nb__cuda_backend) != &nb__cuda_backend || nb__cuda_profile_on()) {
        FAILS++;
        printf("FAIL: without NABLA_CUDA_PROFILE the table is not the CUDA table itself\n");
    }
    CHECKS++;
    if (nb__cuda_profile_write("/dev/null") != NB_ERR_UNSUPPORTED) {
        FAILS++;
        printf("FAIL: writing a profile that is off must say so\n");
    }
    setenv("NABLA_CUDA_PROFILE", "events", 1);
    timed_table = nb__cuda_profile_table(&nb__cuda_backend);
    CHECKS++;
    if (timed_table == &nb__cuda_backend || !nb__cuda_profile_on() ||
        timed_table->matmul == nb__cuda_backend.matmul) {
        FAILS++;
        printf("FAIL: NABLA_CUDA_PROFILE=events gives no timed table\n");
    }
    profile_step(false);
    profile_step(true);
    return done("drv_profile");
}
