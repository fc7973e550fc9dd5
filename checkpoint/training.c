/* Training checkpoints: model tensors, optimizer state and the loop's
 * position (step, epoch, data position, RNG) in one safetensors file.
 *
 * The loop's position is metadata, as decimal strings, under fixed keys
 * (docs/checkpoints.md lists them); "format": "pt" marks the tensors as
 * PyTorch-style for tools that look at it. Loading checks and parses all
 * metadata before any tensor is read, so a file with bad metadata leaves
 * the model and optimizer untouched. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/safetensors.h"
#include "nabla/nabla.h"
#include "tensor/internal.h"

#define STR2(x) #x
#define STR(x) STR2(x)
#define NABLA_VERSION_STRING \
    STR(NABLA_VERSION_MAJOR) "." STR(NABLA_VERSION_MINOR) "." STR(NABLA_VERSION_PATCH)

static const char *reserved[] = {"format", "nabla_version", "step", "epoch", "data_position",
                                 "rng_seed", "rng_offset", "optimizer"};
#define N_RESERVED (int)(sizeof reserved / sizeof reserved[0])

/* model then the optimizer's state, in one malloc'ed array */
static nb_named_tensor *join(const nb_named_tensor *model, int n_model, nb_optim *opt, int *n) {
    int n_state = 0;
    const nb_named_tensor *state = opt ? nb_optim_state(opt, &n_state) : NULL;
    nb_named_tensor *all = malloc(sizeof *all * (size_t)(n_model + n_state + 1));
    NB_CHECK(all, "nb_checkpoint: out of memory");
    if (n_model) memcpy(all, model, sizeof *all * (size_t)n_model);
    if (n_state) memcpy(all + n_model, state, sizeof *all * (size_t)n_state);
    *n = n_model + n_state;
    return all;
}

/* The metadata of a training checkpoint, malloc'ed: nabla's keys
 * (their values in num), then extra. */
static nb_kv *training_meta(const char *who, nb_optim *opt, const nb_train_state *state, const nb_kv *extra,
                            int n_extra, char num[5][32], int *n_meta) {
    NB_CHECK(state, "%s: NULL state", who);
    NB_CHECK(n_extra >= 0 && (n_extra == 0 || extra), "%s: bad arguments (n_extra = %d)", who, n_extra);
    for (int i = 0; i < n_extra; i++)
        for (int r = 0; r < N_RESERVED; r++)
            NB_CHECK(!extra[i].key || strcmp(extra[i].key, reserved[r]) != 0,
                     "%s: extra metadata key \"%s\" is reserved", who, reserved[r]);
    snprintf(num[0], 32, "%lld", (long long)state->step);
    snprintf(num[1], 32, "%lld", (long long)state->epoch);
    snprintf(num[2], 32, "%lld", (long long)state->data_position);
    snprintf(num[3], 32, "%llu", (unsigned long long)state->rng.seed);
    snprintf(num[4], 32, "%llu", (unsigned long long)state->rng.offset);
    nb_kv fixed[N_RESERVED] = {
        {"format", "pt"},          {"nabla_version", NABLA_VERSION_STRING},
        {"step", num[0]},          {"epoch", num[1]},
        {"data_position", num[2]}, {"rng_seed", num[3]},
        {"rng_offset", num[4]},    {"optimizer", opt ? nb_optim_kind_name(nb_optim_get_kind(opt)) : "none"},
    };
    nb_kv *meta = malloc(sizeof *meta * (size_t)(N_RESERVED + n_extra));
    NB_CHECK(meta, "%s: out of memory", who);
    memcpy(meta, fixed, sizeof fixed);
    if (n_extra) memcpy(meta + N_RESERVED, extra, sizeof *meta * (size_t)n_extra);
    *n_meta = N_RESERVED + n_extra;
    return meta;
}

nb_status nb_checkpoint_save_training(const char *path, const nb_named_tensor *model,
                                      int n_model, nb_optim *opt, const nb_train_state *state,
                                      const nb_kv *extra, int n_extra) {
    NB_CHECK(n_model >= 0 && (n_model == 0 || model), "nb_checkpoint_save_training: bad arguments "
             "(n_model = %d)", n_model);
    char num[5][32];
    int n_meta, n;
    nb_kv *meta = training_meta("nb_checkpoint_save_training", opt, state, extra, n_extra, num, &n_meta);
    nb_named_tensor *all = join(model, n_model, opt, &n);
    nb_status st = nb_checkpoint_save(path, all, n, meta, n_meta);
    free(all);
    free(meta);
    return st;
}

nb_status nb_checkpoint_save_training_index(const char *index_path, const char *save_id, int world,
                                            nb_optim *opt, const nb_train_state *state,
                                            const nb_kv *extra, int n_extra) {
    char num[5][32];
    int n_meta;
    nb_kv *meta = training_meta("nb_checkpoint_save_training_index", opt, state, extra, n_extra, num, &n_meta);
    nb_status st = nb_checkpoint_save_index(index_path, save_id, world, meta, n_meta);
    free(meta);
    return st;
}

/* Strict decimal: optional '-', digits, nothing else, in range. */
static bool parse_int(const char *s, bool allow_negative, int64_t *i, uint64_t *u) {
    const char *p = s;
    bool neg = false;
    if (*p == '-' && allow_negative) neg = true, p++;
    if (*p < '0' || *p > '9') return false;
    uint64_t v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return false;
        uint64_t d = (uint64_t)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) return false;
        v = v * 10 + d;
    }
    if (u) {
        *u = v;
        return true;
    }
    if (v > (uint64_t)INT64_MAX + (neg ? 1 : 0)) return false;
    *i = neg ? (v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v) : (int64_t)v;
    return true;
}

static nb_status read_meta(nb_checkpoint *ck, nb_optim *opt, nb_train_state *out) {
    const char *path = nb_checkpoint_path(ck);
    const char *keys[] = {"step", "epoch", "data_position", "rng_seed", "rng_offset", "optimizer"};
    for (int k = 0; k < 6; k++)
        if (!nb_checkpoint_meta(ck, keys[k]))
            return nb_set_error(NB_ERR_FORMAT, "%s: not a training checkpoint: metadata key "
                                "\"%s\" is missing, nothing was read", path, keys[k]);
    int64_t *ints[] = {&out->step, &out->epoch, &out->data_position};
    for (int k = 0; k < 3; k++)
        if (!parse_int(nb_checkpoint_meta(ck, keys[k]), true, ints[k], NULL) || *ints[k] < 0)
            return nb_set_error(NB_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not a "
                                "non-negative integer, nothing was read", path, keys[k],
                                nb_checkpoint_meta(ck, keys[k]));
    uint64_t *uints[] = {&out->rng.seed, &out->rng.offset};
    for (int k = 0; k < 2; k++)
        if (!parse_int(nb_checkpoint_meta(ck, keys[3 + k]), false, NULL, uints[k]))
            return nb_set_error(NB_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not an unsigned "
                                "64-bit integer, nothing was read", path, keys[3 + k],
                                nb_checkpoint_meta(ck, keys[3 + k]));
    const char *kind = nb_checkpoint_meta(ck, "optimizer");
    if (opt && strcmp(kind, nb_optim_kind_name(nb_optim_get_kind(opt))) != 0)
        return nb_set_error(NB_ERR_MISMATCH, "%s: the checkpoint holds optimizer state of kind "
                            "\"%s\" but the optimizer is %s, nothing was read", path, kind,
                            nb_optim_kind_name(nb_optim_get_kind(opt)));
    return NB_OK;
}

nb_status nb_checkpoint_load_training(const char *path, const nb_named_tensor *model,
                                      int n_model, nb_optim *opt, nb_train_state *state) {
    return nb_checkpoint_load_training_ex(path, model, n_model, opt, state, NULL);
}

nb_status nb_checkpoint_load_training_ex(const char *path, const nb_named_tensor *model,
                                         int n_model, nb_optim *opt, nb_train_state *state,
                                         const nb_checkpoint_load_options *opts) {
    NB_CHECK(path && state, "nb_checkpoint_load_training: NULL argument");
    NB_CHECK(n_model >= 0 && (n_model == 0 || model),
             "nb_checkpoint_load_training: bad model list (n_model = %d)", n_model);
    int n;
    nb_named_tensor *all = join(model, n_model, opt, &n);
    nb__checkpoint_check_targets("nb_checkpoint_load_training", all, n, all);
    nb_checkpoint *ck;
    nb_status st = nb_checkpoint_open(path, &ck);
    if (st != NB_OK) {
        free(all);
        return st;
    }
    bool allow = opts && opts->allow_nonfinite, second = opt && nb_optim_get_kind(opt) != NB_OPTIM_SGD;
    nb_train_state s = {0};
    st = read_meta(ck, opt, &s);
    if (st == NB_OK && nb_checkpoint_is_sharded(ck)) {
        nb_checkpoint_close(ck); /* an index: the tensors are in its shards */
        ck = NULL;
        nb_checkpoint_sharded *sh;
        st = nb_checkpoint_sharded_open(path, &sh);
        if (st == NB_OK) st = nb__checkpoint_sharded_read_strict(sh, all, n, opt ? NULL : "optim.", allow, second);
        nb_checkpoint_sharded_close(sh);
    } else if (st == NB_OK) {
        nb_checkpoint_set_allow_nonfinite(ck, allow);
        nb__checkpoint_set_second_moments(ck, second);
        st = nb__checkpoint_read_strict(ck, all, n, opt ? NULL : "optim.");
    }
    free(all);
    nb_checkpoint_close(ck);
    if (st == NB_OK && opt) {
        st = nb_optim_state_validate(opt);
        if (st != NB_OK) {
            char msg[768];
            snprintf(msg, sizeof msg, "%s", nb_last_error());
            st = nb_set_error(st, "%s: %s", path, msg);
        }
    }
    if (st == NB_OK) *state = s;
    return st;
}
