/* Loss modules: CrossEntropyLoss, MSELoss and BCEWithLogitsLoss over the
 * ops of the same math (mean reduction). They take two inputs, so they are
 * called with nb_loss_forward; their single-input forward says so. */
#include "nn/internal.h"

typedef enum loss_kind { LOSS_CE, LOSS_MSE, LOSS_BCE } loss_kind;

typedef struct loss {
    loss_kind kind;
    nb_cross_entropy_opts ce;
} loss;

static nb_tensor *loss_single(nb_module *m, nb_ctx *ctx, nb_tensor *x) {
    NB_ABORT("nb_module_forward: a %s takes an input and a target; call "
             "nb_loss_forward(loss, ctx, input, target)", m->type->name);
}

static void ce_describe(nb_module *m, char *buf, size_t size) {
    const loss *l = m->self;
    snprintf(buf, size, "ignore_index=%lld, label_smoothing=%g", (long long)l->ce.ignore_index,
             l->ce.label_smoothing);
}

static const nb_module_type ce_type = {"CrossEntropyLoss", sizeof(loss), loss_single, ce_describe};
static const nb_module_type mse_type = {"MSELoss", sizeof(loss), loss_single, NULL};
static const nb_module_type bce_type = {"BCEWithLogitsLoss", sizeof(loss), loss_single, NULL};

static nb_module *loss_new(nb_ctx *ctx, const nb_module_type *type, loss_kind kind) {
    nb_module *m = nb_module_new(ctx, type);
    ((loss *)m->self)->kind = kind;
    return m;
}

nb_module *nb_cross_entropy_loss_new(nb_ctx *ctx, const nb_cross_entropy_opts *opts) {
    nb_cross_entropy_opts o = opts ? *opts : NB_CROSS_ENTROPY_DEFAULTS;
    NB_CHECK(o.label_smoothing >= 0 && o.label_smoothing <= 1,
             "nb_cross_entropy_loss_new: label_smoothing %g must be in [0, 1]", o.label_smoothing);
    nb_module *m = loss_new(ctx, &ce_type, LOSS_CE);
    ((loss *)m->self)->ce = o;
    return m;
}

nb_module *nb_mse_loss_new(nb_ctx *ctx) { return loss_new(ctx, &mse_type, LOSS_MSE); }
nb_module *nb_bce_with_logits_loss_new(nb_ctx *ctx) { return loss_new(ctx, &bce_type, LOSS_BCE); }

nb_tensor *nb_loss_forward(nb_module *m, nb_ctx *ctx, nb_tensor *input, nb_tensor *target) {
    NB_CHECK(m && (m->type == &ce_type || m->type == &mse_type || m->type == &bce_type),
             "nb_loss_forward: the module is a %s, not a loss", m ? m->type->name : "NULL");
    NB_CHECK(input && target, "nb_loss_forward: %s needs an input and a target", m->type->name);
    const loss *l = m->self;
    switch (l->kind) {
    case LOSS_CE: return nb_cross_entropy(ctx, input, target, &l->ce);
    case LOSS_MSE: return nb_mse_loss(ctx, input, target);
    case LOSS_BCE: return nb_bce_with_logits(ctx, input, target);
    }
    NB_ABORT("nb_loss_forward: unknown loss kind %d", (int)l->kind);
}
