/* nb_ckpt_sample: writes a small training checkpoint that uses every dtype,
 * odd names and shapes (a 0-d tensor, an empty one, a transposed view, a
 * name with quotes, a newline and non-ASCII letters) and AdamW state after
 * two steps, then prints on stdout, as JSON, what the file must contain:
 * the metadata and, for each tensor in file order, its name, dtype, shape
 * and the bit pattern of every element (unsigned for floats, signed for
 * integers), little-endian as stored, and for float dtypes the values those
 * bits stand for as nabla converts them.
 *
 *   nb_ckpt_sample OUT.safetensors
 *
 * tests/test_safetensors_interop.py reads the file with Python's json and
 * struct alone and compares. Exit status 0 on success, 1 on a save error
 * (message on stderr), 2 on bad usage. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nabla/nabla.h>

#include "driver.h"

/* A JSON string: quotes, backslashes and control characters escaped,
 * everything else (UTF-8) as it is. */
static void print_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

static const char *format_dtype(nb_dtype d) {
    switch (d) {
    case NB_F32: return "F32";
    case NB_F64: return "F64";
    case NB_BF16: return "BF16";
    case NB_F16: return "F16";
    case NB_I32: return "I32";
    case NB_I64: return "I64";
    default: return "?";
    }
}

static void print_tensor(const nb_named_tensor *nt) {
    const nb_tensor *t = nt->tensor;
    int64_t n = nb_numel(t);
    size_t size = nb_dtype_size(t->dtype);
    unsigned char *buf = malloc((size_t)n * size + 8);
    nb_to_host(t, buf);
    printf("{\"name\": ");
    print_string(nt->name);
    printf(", \"dtype\": \"%s\", \"shape\": [", format_dtype(t->dtype));
    for (int d = 0; d < t->ndim; d++) printf(d ? ", %lld" : "%lld", (long long)t->shape[d]);
    printf("], \"bits\": [");
    for (int64_t i = 0; i < n; i++) {
        const unsigned char *p = buf + (size_t)i * size;
        if (i) printf(", ");
        switch (t->dtype) {
        case NB_F32: { uint32_t v; memcpy(&v, p, 4); printf("%lu", (unsigned long)v); break; }
        case NB_F64: { uint64_t v; memcpy(&v, p, 8); printf("%llu", (unsigned long long)v); break; }
        case NB_BF16:
        case NB_F16: { uint16_t v; memcpy(&v, p, 2); printf("%u", (unsigned)v); break; }
        case NB_I32: { int32_t v; memcpy(&v, p, 4); printf("%ld", (long)v); break; }
        case NB_I64: { int64_t v; memcpy(&v, p, 8); printf("%lld", (long long)v); break; }
        default: break;
        }
    }
    printf("]");
    if (nb_dtype_is_float(t->dtype)) { /* the values the bits stand for, as nabla converts them */
        double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
        nb_to_host_f64(t, v);
        printf(", \"values\": [");
        for (int64_t i = 0; i < n; i++) {
            if (i) printf(", ");
            if (isnan(v[i])) printf("NaN");
            else if (isinf(v[i])) printf(v[i] > 0 ? "Infinity" : "-Infinity");
            else printf("%.17g", v[i]);
        }
        printf("]");
        free(v);
    }
    printf("}");
    free(buf);
}

int main(int argc, char **argv) {
    driver_args(argc, argv, 1, "OUT.safetensors");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(2024);
    nb_tensor *w = nb_rand_normal(ctx, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng);
    nb_tensor *b = nb_rand_normal(ctx, NB_F64, NB_SHAPE(4), 0, 1, &rng);
    nb_set_requires_grad(w, true);
    nb_set_requires_grad(b, true);
    nb_tensor *emb = nb_cast(ctx, nb_rand_normal(ctx, NB_F32, NB_SHAPE(2, 3), 0, 1, &rng), NB_BF16);
    nb_tensor *half = nb_from_host(ctx, NB_F16, NB_SHAPE(5),
                                   (uint16_t[]){0x3c00, 0xc000, 0x7bff, 0x0001, 0x7e00});
    nb_tensor *i32 = nb_from_host(ctx, NB_I32, NB_SHAPE(2, 2), (int32_t[]){-1, 0, INT32_MAX, INT32_MIN});
    nb_tensor *i64 = nb_from_host(ctx, NB_I64, NB_SHAPE(3), (int64_t[]){INT64_MAX, -42, INT64_MIN});
    nb_tensor *scalar = nb_scalar(ctx, NB_F32, -0.0);
    nb_tensor *empty = nb_zeros(ctx, NB_F32, NB_SHAPE(0, 2));
    nb_tensor *strided = nb_transpose(ctx, nb_reshape(ctx, nb_arange(ctx, NB_F32, 0.5, 6.5, 1),
                                                      NB_SHAPE(2, 3)), 0, 1);
    nb_tensor *odd = nb_scalar(ctx, NB_F64, 1e-310); /* subnormal */
    nb_named_tensor model[] = {
        {"model.weight", w}, {"model.bias", b},     {"emb.weight", emb}, {"half", half},
        {"idx32", i32},      {"idx64", i64},        {"scalar", scalar},  {"empty", empty},
        {"strided.T", strided}, {"name \"with\" quotes\n and \xc3\xa9\xe2\x82\xac", odd},
    };
    int n_model = (int)(sizeof model / sizeof model[0]);

    /* two AdamW steps on the two float parameters, so the moments are set */
    nb_optim_hparams h = NB_ADAMW_DEFAULTS;
    h.lr = 0.01;
    nb_optim *opt = nb_optim_new(NB_OPTIM_ADAMW, model, 2, &h);
    nb_set_grad(w, nb_rand_normal(ctx, NB_F32, NB_SHAPE(3, 4), 0, 1, &rng));
    nb_set_grad(b, nb_rand_normal(ctx, NB_F64, NB_SHAPE(4), 0, 1, &rng));
    nb_optim_step(opt);
    nb_optim_step(opt);

    nb_train_state st = {2, 0, 2, {1234, 56}};
    nb_kv extra[] = {{"note", "quotes \" backslash \\ newline \n tab \t unicode \xc3\xa9\xe2\x82\xac"}};
    nb_status s = nb_checkpoint_save_training(argv[1], model, n_model, opt, &st, extra, 1);
    if (s != NB_OK) {
        fprintf(stderr, "nb_ckpt_sample: %s\n", nb_last_error());
        return 1;
    }

    /* what docs/checkpoints.md says a training checkpoint holds, plus ours */
    char version[32];
    snprintf(version, sizeof version, "%d.%d.%d", NABLA_VERSION_MAJOR, NABLA_VERSION_MINOR,
             NABLA_VERSION_PATCH);
    nb_kv meta[] = {{"format", "pt"},     {"nabla_version", version}, {"step", "2"},
                    {"epoch", "0"},       {"data_position", "2"},     {"rng_seed", "1234"},
                    {"rng_offset", "56"}, {"optimizer", "adamw"},     extra[0]};
    printf("{\"metadata\": {");
    for (size_t i = 0; i < sizeof meta / sizeof meta[0]; i++) {
        printf(i ? ", " : "");
        print_string(meta[i].key);
        printf(": ");
        print_string(meta[i].value);
    }
    printf("},\n \"tensors\": [\n");
    int n_state;
    const nb_named_tensor *state = nb_optim_state(opt, &n_state);
    for (int i = 0; i < n_model + n_state; i++) {
        printf(i ? ",\n  " : "  ");
        print_tensor(i < n_model ? &model[i] : &state[i - n_model]);
    }
    printf("\n]}\n");
    nb_optim_free(opt);
    nb_ctx_free(ctx);
    return 0;
}
