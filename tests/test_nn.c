/* The module tree: dotted names and their order for parameters, buffers and
 * the state, counts and the cap protocol, lookups, tied and shared tensors,
 * cache refresh after late registration, train/eval propagation, zero_grad,
 * moving between devices, printing, user-defined modules (including the
 * docs' example program), initialisation schemes (bounds and moments), and
 * every registration and construction error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "testutil.h"

/* ---- a user-defined module for the tree tests ---- */
typedef struct net {
    nb_tensor *scale;
} net;

static const nb_module_type net_type = {"Net", sizeof(net), NULL, NULL};

/* net:
 *   fc1 Linear(3, 4); bn1 BatchNorm1d(4);
 *   blocks ModuleList[ Sequential(Linear(4, 4), ReLU), Sequential(Linear(4, 4, no bias), Tanh) ]
 *   head Linear(4, 2); and its own parameter "scale" (4), registered last. */
static nb_module *make_net(nb_ctx *ctx, nb_dtype dt, nb_rng *rng) {
    nb_module *m = nb_module_new(ctx, &net_type);
    nb_module_add(m, "fc1", nb_linear_new(ctx, dt, 3, 4, true, rng));
    nb_module_add(m, "bn1", nb_batch_norm1d_new(ctx, dt, 4, NULL));
    nb_module *blocks = nb_module_add(m, "blocks", nb_module_list_new(ctx));
    nb_module_append(blocks, nb_sequential_new(ctx, 2, (nb_module *[]){
                                                           nb_linear_new(ctx, dt, 4, 4, true, rng),
                                                           nb_relu_new(ctx)}));
    nb_module_append(blocks, nb_sequential_new(ctx, 2, (nb_module *[]){
                                                           nb_linear_new(ctx, dt, 4, 4, false, rng),
                                                           nb_tanh_new(ctx)}));
    nb_module_add(m, "head", nb_linear_new(ctx, dt, 4, 2, true, rng));
    net *self = nb_module_self(m, &net_type);
    self->scale = nb_module_add_param(m, "scale", nb_ones(ctx, dt, NB_SHAPE(4)));
    return m;
}

static void expect_names(const nb_named_tensor *got, int n, const char *const *want, int nwant) {
    ck_assert_int_eq(n, nwant);
    for (int i = 0; i < n; i++)
        ck_assert_msg(strcmp(got[i].name, want[i]) == 0, "entry %d: got \"%s\", expected \"%s\"", i,
                      got[i].name, want[i]);
}

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

NBT_CPU_TEST(test_names_and_order) {
    nb_rng rng = nb_rng_make(1);
    nb_module *m = make_net(ctx, NB_F32, &rng);
    /* a module's own parameters come before its children's, whatever the
     * registration order between the two kinds (PyTorch's order) */
    static const char *const params[] = {
        "scale",         "fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias", "blocks.0.0.weight",
        "blocks.0.0.bias", "blocks.1.0.weight", "head.weight", "head.bias"};
    static const char *const buffers[] = {"bn1.running_mean", "bn1.running_var",
                                          "bn1.num_batches_tracked"};
    static const char *const state[] = {
        "scale", "fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias", "bn1.running_mean",
        "bn1.running_var", "bn1.num_batches_tracked", "blocks.0.0.weight", "blocks.0.0.bias",
        "blocks.1.0.weight", "head.weight", "head.bias"};
    nb_named_tensor out[32];
    expect_names(out, nb_module_named_parameters(m, out, 32), params, COUNT(params));
    for (int i = 0; i < COUNT(params); i++) {
        ck_assert_ptr_eq(out[i].tensor, nb_module_find(m, params[i]));
        ck_assert(out[i].tensor->requires_grad);
    }
    expect_names(out, nb_module_named_buffers(m, out, 32), buffers, COUNT(buffers));
    for (int i = 0; i < COUNT(buffers); i++) ck_assert(!out[i].tensor->requires_grad);
    expect_names(out, nb_module_state(m, out, 32), state, COUNT(state));
    for (int i = 0; i < COUNT(state); i++) ck_assert_ptr_eq(out[i].tensor, nb_module_find(m, state[i]));
    ck_assert(out[7].tensor->dtype == NB_I64 && out[7].tensor->ndim == 0);

    /* the tensors carry their local names */
    ck_assert_str_eq(nb_module_find(m, "blocks.0.0.weight")->name, "weight");
    /* names relative to a subtree */
    static const char *const sub[] = {"0.0.weight", "0.0.bias", "1.0.weight"};
    expect_names(out, nb_module_named_parameters(nb_module_child(m, "blocks"), out, 32), sub,
                 COUNT(sub));

    /* 4 + (12 + 4) + (4 + 4) + (16 + 4) + 16 + (8 + 2) */
    ck_assert_int_eq(nb_module_num_params(m), 74);
    ck_assert_int_eq(nb_module_num_params(nb_module_child(m, "blocks.1")), 16);
}

/* count-then-fill: the return value is the total, at most cap entries are written */
NBT_CPU_TEST(test_cap_protocol) {
    nb_module *m = make_net(ctx, NB_F32, NULL);
    ck_assert_int_eq(nb_module_named_parameters(m, NULL, 0), 10);
    ck_assert_int_eq(nb_module_named_buffers(m, NULL, 0), 3);
    ck_assert_int_eq(nb_module_state(m, NULL, 0), 13);
    nb_named_tensor out[5];
    out[3] = (nb_named_tensor){"sentinel", NULL};
    ck_assert_int_eq(nb_module_state(m, out, 3), 13);
    ck_assert_str_eq(out[2].name, "fc1.bias");
    ck_assert_str_eq(out[3].name, "sentinel");
    /* a leaf module with nothing */
    nb_module *relu = nb_relu_new(ctx);
    ck_assert_int_eq(nb_module_state(relu, NULL, 0), 0);
    ck_assert_int_eq(nb_module_num_params(relu), 0);
    NBT_EXPECT_ABORT(nb_module_state(m, NULL, 4), "nb_module_state: out is NULL with cap 4");
    NBT_EXPECT_ABORT(nb_module_named_parameters(NULL, out, 1), "nb_module_named_parameters: module is NULL");
}

/* Registration after a first listing shows up in the next one, from any level. */
NBT_CPU_TEST(test_late_registration) {
    nb_module *m = make_net(ctx, NB_F32, NULL);
    ck_assert_int_eq(nb_module_named_parameters(m, NULL, 0), 10);
    nb_module *b1 = nb_module_child(m, "blocks.1");
    nb_tensor *extra = nb_module_add_param(b1, "gain", nb_zeros(ctx, NB_F32, NB_SHAPE(2)));
    nb_module_add(nb_module_child_at(b1, 0), "post", nb_linear_new(ctx, NB_F32, 4, 1, false, NULL));
    nb_named_tensor out[16];
    ck_assert_int_eq(nb_module_named_parameters(m, out, 16), 12);
    ck_assert_str_eq(out[7].name, "blocks.1.gain");
    ck_assert_ptr_eq(out[7].tensor, extra);
    ck_assert_str_eq(out[9].name, "blocks.1.0.post.weight");
    ck_assert_int_eq(nb_module_num_params(m), 74 + 2 + 4);
}

/* Tied weights and a child shared by two parents appear once, first name wins. */
NBT_CPU_TEST(test_tied_and_shared) {
    nb_module *root = nb_module_new(ctx, &net_type);
    nb_module *wte = nb_module_add(root, "wte", nb_embedding_new(ctx, NB_F32, 10, 4, NULL));
    nb_module *head = nb_module_add(root, "lm_head", nb_linear_new(ctx, NB_F32, 4, 10, false, NULL));
    /* tie: the head's own slot now names the embedding's table */
    nb_module *tied = nb_module_new(ctx, &net_type);
    nb_module_add_param(tied, "weight", nb_module_find(wte, "weight"));
    nb_module_add(root, "tied_head", tied);
    nb_module *shared = nb_linear_new(ctx, NB_F32, 2, 2, true, NULL);
    nb_module_add(root, "a", shared);
    nb_module_add(root, "b", shared);
    static const char *const want[] = {"wte.weight", "lm_head.weight", "a.weight", "a.bias"};
    nb_named_tensor out[8];
    expect_names(out, nb_module_named_parameters(root, out, 8), want, COUNT(want));
    expect_names(out, nb_module_state(root, out, 8), want, COUNT(want));
    ck_assert_int_eq(nb_module_num_params(root), 40 + 40 + 6);
    /* both names still find the tensor */
    ck_assert_ptr_eq(nb_module_find(root, "tied_head.weight"), nb_module_find(root, "wte.weight"));
    ck_assert_ptr_eq(nb_module_find(root, "b.bias"), nb_module_find(root, "a.bias"));
    (void)head;
}

NBT_CPU_TEST(test_find_and_children) {
    nb_module *m = make_net(ctx, NB_F32, NULL);
    ck_assert_ptr_nonnull(nb_module_find(m, "bn1.running_var"));
    ck_assert_ptr_null(nb_module_find(m, "bn1.running"));
    ck_assert_ptr_null(nb_module_find(m, "bn1"));            /* a module, not a tensor */
    ck_assert_ptr_null(nb_module_find(m, "blocks.2.0.weight"));
    ck_assert_ptr_null(nb_module_find(m, ".scale"));
    ck_assert_ptr_null(nb_module_find(m, "blocks..0.0.weight"));
    ck_assert_ptr_null(nb_module_find(m, "fc1.weight."));
    ck_assert_ptr_null(nb_module_find(m, ""));
    ck_assert_ptr_eq(nb_module_find(m, "scale"), ((net *)nb_module_self(m, &net_type))->scale);

    ck_assert_int_eq(nb_module_num_children(m), 4);
    ck_assert_str_eq(nb_module_child_name_at(m, 2), "blocks");
    nb_module *blocks = nb_module_child_at(m, 2);
    ck_assert_str_eq(nb_module_type_name(blocks), "ModuleList");
    ck_assert_ptr_eq(nb_module_child(m, "blocks.1.1"), nb_module_child_at(nb_module_child_at(blocks, 1), 1));
    ck_assert_str_eq(nb_module_type_name(nb_module_child(m, "blocks.1.1")), "Tanh");
    ck_assert_ptr_null(nb_module_child(m, "blocks.3"));
    ck_assert_ptr_null(nb_module_child(m, "blocks."));
    ck_assert_ptr_null(nb_module_child(m, "scale"));
    ck_assert_ptr_eq(nb_module_child(m, ""), m);
    ck_assert(nb_module_is(m, &net_type) && !nb_module_is(blocks, &net_type));
    ck_assert_ptr_eq(nb_module_ctx(m), ctx);
    NBT_EXPECT_ABORT(nb_module_child_at(blocks, 2),
                     "nb_module_child_at: index 2 out of range for a ModuleList with 2 children");
    NBT_EXPECT_ABORT(nb_module_child_name_at(m, -1), "nb_module_child_name_at: index -1 out of range");
}

NBT_CPU_TEST(test_train_eval) {
    nb_module *m = make_net(ctx, NB_F32, NULL);
    nb_module *leaves[] = {m, nb_module_child(m, "fc1"), nb_module_child(m, "bn1"),
                           nb_module_child(m, "blocks"), nb_module_child(m, "blocks.0"),
                           nb_module_child(m, "blocks.1.1"), nb_module_child(m, "head")};
    for (int i = 0; i < COUNT(leaves); i++) ck_assert(nb_module_is_training(leaves[i]));
    nb_module_eval(m);
    for (int i = 0; i < COUNT(leaves); i++) ck_assert(!nb_module_is_training(leaves[i]));
    /* a subtree alone */
    nb_module_train(nb_module_child(m, "blocks"), true);
    ck_assert(!nb_module_is_training(m) && !nb_module_is_training(leaves[2]));
    ck_assert(nb_module_is_training(leaves[4]) && nb_module_is_training(leaves[5]));
    nb_module_train(m, true);
    for (int i = 0; i < COUNT(leaves); i++) ck_assert(nb_module_is_training(leaves[i]));
}

START_TEST(test_zero_grad) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_module *seq = nb_sequential_new(ctx, 3, (nb_module *[]){nb_linear_new(ctx, NB_F64, 3, 4, true, NULL),
                                                              nb_tanh_new(ctx),
                                                              nb_linear_new(ctx, NB_F64, 4, 1, true, NULL)});
    nb_tensor *x = nbt_randn(step, NB_F64, NB_SHAPE(5, 3), 3);
    nb_backward(nb_sum_all(step, nb_module_forward(seq, step, x)));
    nb_named_tensor p[4];
    ck_assert_int_eq(nb_module_named_parameters(seq, p, 4), 4);
    for (int i = 0; i < 4; i++) {
        ck_assert_ptr_nonnull(p[i].tensor->grad);
        double v[16];
        nb_to_host_f64(p[i].tensor->grad, v);
        double s = 0;
        for (int64_t k = 0; k < nb_numel(p[i].tensor); k++) s += fabs(v[k]);
        ck_assert(s > 0);
    }
    nb_module_zero_grad(seq);
    for (int i = 0; i < 4; i++) {
        double v[16];
        nb_to_host_f64(p[i].tensor->grad, v);
        for (int64_t k = 0; k < nb_numel(p[i].tensor); k++) ck_assert(v[k] == 0.0);
    }
    nb_ctx_free(step);
    nb_ctx_free(ctx);
}
END_TEST

START_TEST(test_module_to) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0), *other = nb_ctx_new(nb_cpu(), 0);
    nb_rng rng = nb_rng_make(7);
    nb_module *m = make_net(ctx, NB_F32, &rng);
    /* a tied weight: the head's weight registered a second time */
    nb_tensor *hw = nb_module_find(m, "head.weight");
    nb_module_add_param(nb_module_child(m, "blocks"), "tied", hw);
    int n = nb_module_state(m, NULL, 0);
    nb_named_tensor *st = calloc((size_t)n, sizeof *st);
    nb_module_state(m, st, n);
    double *before = calloc((size_t)n * 16, sizeof(double));
    void **data = calloc((size_t)n, sizeof(void *));
    bool *rg = calloc((size_t)n, sizeof(bool));
    for (int i = 0; i < n; i++) {
        ck_assert_int_le(nb_numel(st[i].tensor), 16);
        nb_to_host_f64(st[i].tensor, before + 16 * i);
        data[i] = st[i].tensor->data;
        rg[i] = st[i].tensor->requires_grad;
    }
    nb_tensor *w = nb_module_find(m, "fc1.weight");
    nb_set_grad(w, nb_ones(ctx, NB_F32, NB_SHAPE(4, 3)));
    nb_tensor *wt = nb_transpose(ctx, w, 0, 1); /* made before: still views the old storage */
    void *wold = w->data;
    const char *name = w->name;
    ck_assert_int_eq(nb_module_to(m, other), NB_OK);
    ck_assert_ptr_eq(nb_module_find(m, "fc1.weight"), w); /* same structs */
    ck_assert_ptr_eq(nb_module_find(m, "blocks.tied"), hw);
    ck_assert_ptr_eq(w->name, name);
    ck_assert_ptr_null(w->grad);
    ck_assert_ptr_eq(wt->data, wold);
    ck_assert_ptr_ne(w->data, wold);
    for (int i = 0; i < n; i++) {
        nb_tensor *t = st[i].tensor;
        ck_assert_ptr_eq(t->ctx, other);
        ck_assert_ptr_ne(t->data, data[i]);
        ck_assert(nb_is_contiguous(t));
        ck_assert(t->requires_grad == rg[i]);
        double v[16];
        nb_to_host_f64(t, v);
        for (int64_t k = 0; k < nb_numel(t); k++) ck_assert(v[k] == before[16 * i + k]);
    }
    /* moving into the context the tensors are in already changes nothing */
    void *wdata = w->data;
    ck_assert_int_eq(nb_module_to(m, other), NB_OK);
    ck_assert_ptr_eq(w->data, wdata);
    free(st);
    free(before);
    free(data);
    free(rg);
    nb_ctx_free(other);
    nb_ctx_free(ctx);
}
END_TEST

static char *print_to_string(nb_module *m) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nb_module_fprint(f, m);
    fclose(f);
    return buf;
}

NBT_CPU_TEST(test_print) {
    nb_module *seq = nb_sequential_new(
        ctx, 4,
        (nb_module *[]){nb_conv2d_new(ctx, NB_F32, 3, 8, 3, 3, &(nb_conv2d_opts){{1, 1}, {1, 1}, {1, 1}, 1}, false, NULL),
                        nb_batch_norm2d_new(ctx, NB_F32, 8, NULL), nb_relu_new(ctx),
                        nb_max_pool2d_new(ctx, &(nb_pool2d_opts){{2, 2}, {0, 0}, {0, 0}})});
    nb_module_append(seq, nb_global_avg_pool2d_new(ctx));
    nb_module_append(seq, nb_flatten_new(ctx, 1, -1));
    nb_module_append(seq, nb_dropout_new(ctx, 0.25, NULL));
    nb_module_append(seq, nb_linear_new(ctx, NB_F32, 8, 10, true, NULL));
    nb_module_append(seq, nb_layer_norm_new(ctx, NB_F32, NB_SHAPE(10), NULL));
    nb_module_append(seq, nb_gelu_new(ctx, NB_GELU_TANH));
    nb_module *wrap = nb_module_new(ctx, &net_type);
    nb_module_add(wrap, "body", seq);
    nb_module_add(wrap, "emb", nb_embedding_new(ctx, NB_F32, 5, 3, NULL));
    nb_module_add(wrap, "attn", nb_causal_self_attention_new(ctx, NB_F32, 8, 2, NULL, NULL));
    nb_module_add(wrap, "loss", nb_cross_entropy_loss_new(ctx, NULL));
    char *s = print_to_string(wrap);
    const char *want =
        "Net(\n"
        "  (body): Sequential(\n"
        "    (0): Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), bias=false)\n"
        "    (1): BatchNorm2d(8, eps=1e-05, momentum=0.1, affine=true, track_running_stats=true)\n"
        "    (2): ReLU()\n"
        "    (3): MaxPool2d(kernel_size=(2, 2), stride=(2, 2), padding=(0, 0))\n"
        "    (4): GlobalAvgPool2d()\n"
        "    (5): Flatten(start_dim=1, end_dim=-1)\n"
        "    (6): Dropout(p=0.25)\n"
        "    (7): Linear(in_features=8, out_features=10, bias=true)\n"
        "    (8): LayerNorm((10,), eps=1e-05, elementwise_affine=true, bias=true)\n"
        "    (9): GELU(approximate=tanh)\n"
        "  )\n"
        "  (emb): Embedding(5, 3)\n"
        "  (attn): CausalSelfAttention(\n"
        "    n_embd=8, n_head=2\n"
        "    (c_attn): Linear(in_features=8, out_features=24, bias=true)\n"
        "    (c_proj): Linear(in_features=8, out_features=8, bias=true)\n"
        "    (attn_dropout): Dropout(p=0)\n"
        "    (resid_dropout): Dropout(p=0)\n"
        "  )\n"
        "  (loss): CrossEntropyLoss(ignore_index=-100, label_smoothing=0)\n"
        ")\n";
    ck_assert_str_eq(s, want);
    free(s);
}

/* ---- a user module with a two-input forward, the way docs/modules.md shows ---- */
typedef struct gated {
    nb_module *proj;
    nb_tensor *gate;
} gated;

static const nb_module_type gated_type = {"Gated", sizeof(gated), NULL, NULL};

static nb_module *gated_new(nb_ctx *ctx, int64_t c, nb_rng *rng) {
    nb_module *m = nb_module_new(ctx, &gated_type);
    gated *g = nb_module_self(m, &gated_type);
    g->proj = nb_module_add(m, "proj", nb_linear_new(ctx, NB_F64, c, c, true, rng));
    g->gate = nb_module_add_param(m, "gate", nb_full(ctx, NB_F64, NB_SHAPE(c), 0.5));
    return m;
}

/* proj(x) * gate + y */
static nb_tensor *gated_forward(nb_module *m, nb_ctx *ctx, nb_tensor *x, nb_tensor *y) {
    gated *g = nb_module_self(m, &gated_type);
    return nb_add(ctx, nb_mul(ctx, nb_module_forward(g->proj, ctx, x), g->gate), y);
}

typedef struct gated_case {
    nb_module *m;
} gated_case;

static nb_tensor *gated_fn(nb_ctx *ctx, nb_tensor *const *in, void *user) {
    return gated_forward(((gated_case *)user)->m, ctx, in[0], in[1]);
}

NBT_CPU_TEST(test_custom_module) {
    nb_rng rng = nb_rng_make(5);
    gated_case c = {gated_new(ctx, 3, &rng)};
    nb_named_tensor p[3];
    ck_assert_int_eq(nb_module_named_parameters(c.m, p, 3), 3);
    ck_assert_str_eq(p[0].name, "gate");
    ck_assert_str_eq(p[1].name, "proj.weight");
    nb_tensor *in[5] = {nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 6),
                        nbt_randn_leaf(ctx, NB_F64, NB_SHAPE(2, 3), 7), p[0].tensor, p[1].tensor,
                        p[2].tensor};
    NBT_GRADCHECK(gated_fn, &c, 5, in);
    /* the downcast is checked */
    NBT_EXPECT_ABORT(nb_module_self(c.m, &net_type), "nb_module_self: the module is a Gated, not a Net");
    NBT_EXPECT_ABORT(nb_module_self(nb_module_child(c.m, "proj"), &gated_type),
                     "nb_module_self: the module is a Linear, not a Gated");
    NBT_EXPECT_ABORT(nb_module_forward(c.m, ctx, in[0]),
                     "nb_module_forward: a Gated has no single-input forward; call its own forward function");
}

/* The example program of docs/modules.md runs and succeeds. */
START_TEST(test_docs_example_runs) {
    const char *bin = getenv("NABLA_BIN_DIR");
    if (!bin) return; /* run outside ctest */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "\"%s/custom_module\" > /dev/null", bin);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    ck_assert(fread(buf, 1, (size_t)n, f) == (size_t)n);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* docs/modules.md shows examples/custom_module.c verbatim, from its first #include on. */
START_TEST(test_docs_show_example) {
    char *doc = read_file(NABLA_SOURCE_DIR "/docs/modules.md");
    char *ex = read_file(NABLA_SOURCE_DIR "/examples/custom_module.c");
    const char *body = strstr(ex, "#include <stdio.h>");
    ck_assert_ptr_nonnull(body);
    ck_assert_msg(strstr(doc, body) != NULL,
                  "docs/modules.md no longer shows examples/custom_module.c verbatim");
    free(doc);
    free(ex);
}
END_TEST

NBT_CPU_TEST(test_registration_errors) {
    nb_module *m = nb_module_new(ctx, &net_type);
    nb_tensor *w = nb_zeros(ctx, NB_F32, NB_SHAPE(2));
    nb_module_add_param(m, "w", w);
    NBT_EXPECT_ABORT(nb_module_add_param(m, "w", nb_zeros(ctx, NB_F32, NB_SHAPE(2))),
                     "nb_module_add_param: the Net already has a parameter named \"w\"");
    NBT_EXPECT_ABORT(nb_module_add_buffer(m, "w", nb_zeros(ctx, NB_F32, NB_SHAPE(2))),
                     "nb_module_add_buffer: the Net already has a parameter named \"w\"");
    nb_module_add(m, "child", nb_relu_new(ctx));
    NBT_EXPECT_ABORT(nb_module_add_param(m, "child", nb_zeros(ctx, NB_F32, NB_SHAPE(2))),
                     "the Net already has a child module named \"child\"");
    nb_module_add_buffer(m, "buf", nb_zeros(ctx, NB_F32, NB_SHAPE(2)));
    NBT_EXPECT_ABORT(nb_module_add(m, "buf", nb_relu_new(ctx)),
                     "nb_module_add: the Net already has a buffer named \"buf\"");
    NBT_EXPECT_ABORT(nb_module_add(m, "a.b", nb_relu_new(ctx)),
                     "nb_module_add: name \"a.b\" contains '.'");
    NBT_EXPECT_ABORT(nb_module_add_param(m, "", w), "nb_module_add_param: empty name in a Net");
    NBT_EXPECT_ABORT(nb_module_add_buffer(m, NULL, w), "nb_module_add_buffer: empty name in a Net");
    NBT_EXPECT_ABORT(nb_module_add(m, "x", NULL), "nb_module_add: child \"x\" of the Net is NULL");
    NBT_EXPECT_ABORT(nb_module_add_param(m, "p", NULL), "nb_module_add_param: tensor \"p\" of the Net is NULL");
    NBT_EXPECT_ABORT(nb_module_add_param(m, "idx", nb_zeros(ctx, NB_I64, NB_SHAPE(2))),
                     "nb_module_add_param: \"idx\" has dtype i64; parameters need a float dtype");
    nb_tensor *leaf = nbt_randn_leaf(ctx, NB_F32, NB_SHAPE(2), 1);
    NBT_EXPECT_ABORT(nb_module_add_param(m, "made", nb_mul_scalar(ctx, leaf, 2.0)),
                     "nb_module_add_param: \"made\" (2,) was made by an op; a parameter must be a leaf");
    NBT_EXPECT_ABORT(nb_module_add_buffer(m, "trained", leaf),
                     "nb_module_add_buffer: \"trained\" (2,) requires grad; buffers are not trained");
    /* cycles */
    nb_module *child = nb_module_new(ctx, &net_type), *grandchild = nb_module_new(ctx, &net_type);
    nb_module_add(m, "sub", child);
    nb_module_add(child, "sub", grandchild);
    NBT_EXPECT_ABORT(nb_module_add(grandchild, "up", m),
                     "nb_module_add: adding the Net as \"up\" of the Net would make a cycle");
    NBT_EXPECT_ABORT(nb_module_add(m, "self", m), "would make a cycle");
    NBT_EXPECT_ABORT(nb_module_new(ctx, &(nb_module_type){0}), "nb_module_new: the module type needs a name");
    NBT_EXPECT_ABORT(nb_module_new(NULL, &net_type), "nb_module_new: ctx is NULL");
    NBT_EXPECT_ABORT(nb_module_forward(nb_module_list_new(ctx), ctx, w),
                     "nb_module_forward: a ModuleList has no single-input forward");
    NBT_EXPECT_ABORT(nb_module_forward(nb_relu_new(ctx), ctx, NULL),
                     "nb_module_forward: input to the ReLU is NULL");
}

NBT_CPU_TEST(test_constructor_errors) {
    NBT_EXPECT_ABORT(nb_linear_new(ctx, NB_I32, 3, 4, true, NULL),
                     "nb_linear_new: dtype i32; layers compute in f32 or f64");
    NBT_EXPECT_ABORT(nb_linear_new(ctx, NB_BF16, 3, 4, true, NULL), "nb_linear_new: dtype bf16");
    NBT_EXPECT_ABORT(nb_linear_new(ctx, NB_F32, 0, 4, true, NULL),
                     "nb_linear_new: in_features 0 and out_features 4 must be positive");
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 3, 4, 0, 3, NULL, true, NULL),
                     "nb_conv2d_new: kernel size (0, 3) must be positive");
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 3, 4, 3, 3, &(nb_conv2d_opts){{1, 0}, {0, 0}, {1, 1}, 1}, true, NULL),
                     "nb_conv2d_new: stride (1, 0) must be positive");
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 3, 4, 3, 3, &(nb_conv2d_opts){{1, 1}, {-1, 0}, {1, 1}, 1}, true, NULL),
                     "nb_conv2d_new: padding (-1, 0) must be non-negative");
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 3, 4, 3, 3, &(nb_conv2d_opts){{1, 1}, {0, 0}, {0, 1}, 1}, true, NULL),
                     "nb_conv2d_new: dilation (0, 1) must be positive");
    NBT_EXPECT_ABORT(nb_conv2d_new(ctx, NB_F32, 0, 4, 3, 3, NULL, true, NULL),
                     "nb_conv2d_new: in_channels 0 and out_channels 4 must be positive");
    nb_batch_norm_opts bo = NB_BATCH_NORM_DEFAULTS;
    bo.momentum = 1.5;
    NBT_EXPECT_ABORT(nb_batch_norm2d_new(ctx, NB_F32, 3, &bo),
                     "nb_batch_norm2d_new: momentum 1.5 must be in [0, 1] or NB_BATCH_NORM_CUMULATIVE");
    bo = NB_BATCH_NORM_DEFAULTS;
    bo.eps = -1;
    NBT_EXPECT_ABORT(nb_batch_norm1d_new(ctx, NB_F32, 3, &bo), "nb_batch_norm1d_new: eps -1 is negative");
    NBT_EXPECT_ABORT(nb_batch_norm1d_new(ctx, NB_F32, 0, NULL),
                     "nb_batch_norm1d_new: num_features 0 must be positive");
    NBT_EXPECT_ABORT(nb_layer_norm_new(ctx, NB_F32, 0, NULL, NULL),
                     "nb_layer_norm_new: normalized shape needs 1 to 6 dims, got 0");
    NBT_EXPECT_ABORT(nb_layer_norm_new(ctx, NB_F32, NB_SHAPE(4, 0), NULL),
                     "nb_layer_norm_new: normalized shape (4, 0) has a non-positive size");
    NBT_EXPECT_ABORT(nb_embedding_new(ctx, NB_F32, 0, 4, NULL),
                     "nb_embedding_new: num_embeddings 0 and embedding_dim 4 must be positive");
    NBT_EXPECT_ABORT(nb_dropout_new(ctx, 1.5, NULL), "nb_dropout_new: p must be in [0, 1], got 1.5");
    NBT_EXPECT_ABORT(nb_gelu_new(ctx, (nb_gelu_approx)7), "nb_gelu_new: approx 7 is neither");
    NBT_EXPECT_ABORT(nb_max_pool2d_new(ctx, NULL), "nb_max_pool2d_new: opts is NULL (the kernel size is required)");
    NBT_EXPECT_ABORT(nb_avg_pool2d_new(ctx, &(nb_pool2d_opts){{0, 2}, {0, 0}, {0, 0}}),
                     "nb_avg_pool2d_new: kernel size must be positive, got (0, 2)");
    NBT_EXPECT_ABORT(nb_sequential_new(ctx, 2, NULL), "nb_sequential_new: 2 children from a NULL array");
    NBT_EXPECT_ABORT(nb_sequential_new(ctx, 2, (nb_module *[]){nb_relu_new(ctx), NULL}),
                     "nb_module_add: child \"1\" of the Sequential is NULL");
    NBT_EXPECT_ABORT(nb_causal_self_attention_new(ctx, NB_F32, 10, 3, NULL, NULL),
                     "nb_causal_self_attention_new: n_embd 10 must be a positive multiple of n_head 3");
    nb_attention_opts ao = NB_ATTENTION_DEFAULTS;
    ao.attn_dropout = -0.1;
    NBT_EXPECT_ABORT(nb_causal_self_attention_new(ctx, NB_F32, 8, 2, &ao, NULL),
                     "nb_causal_self_attention_new: attn_dropout -0.1 and resid_dropout 0 must be in [0, 1]");
    nb_cross_entropy_opts co = NB_CROSS_ENTROPY_DEFAULTS;
    co.label_smoothing = 2;
    NBT_EXPECT_ABORT(nb_cross_entropy_loss_new(ctx, &co),
                     "nb_cross_entropy_loss_new: label_smoothing 2 must be in [0, 1]");
}

/* ---- initialisation ---- */
typedef struct moments {
    double min, max, mean, var;
} moments;

static moments moments_of(const nb_tensor *t) {
    int64_t n = nb_numel(t);
    double *v = malloc(sizeof(double) * (size_t)n);
    nb_to_host_f64(t, v);
    moments m = {INFINITY, -INFINITY, 0, 0};
    for (int64_t i = 0; i < n; i++) {
        m.min = fmin(m.min, v[i]);
        m.max = fmax(m.max, v[i]);
        m.mean += v[i] / (double)n;
    }
    for (int64_t i = 0; i < n; i++) m.var += (v[i] - m.mean) * (v[i] - m.mean) / (double)(n - 1);
    free(v);
    return m;
}

/* U(-b, b) over n samples: inside the bounds, close to both ends, and the
 * mean and variance (b^2 / 3) within five standard errors. */
static void check_uniform(const nb_tensor *t, double b) {
    moments m = moments_of(t);
    double n = (double)nb_numel(t);
    ck_assert_msg(m.min >= -b && m.max <= b, "%s outside [-%g, %g]: [%g, %g]", nb_shape_str(t), b, b,
                  m.min, m.max);
    ck_assert_msg(m.min < -b * (1 - 20 / n) && m.max > b * (1 - 20 / n),
                  "%s does not reach its bounds +-%g: [%g, %g]", nb_shape_str(t), b, m.min, m.max);
    double var = b * b / 3;
    ck_assert_msg(fabs(m.mean) < 5 * sqrt(var / n), "mean %g of %s", m.mean, nb_shape_str(t));
    /* the variance of the sample variance of U(-b, b) is (4/45) b^4 / n */
    ck_assert_msg(fabs(m.var - var) < 5 * sqrt(4.0 / 45 * b * b * b * b / n), "variance %g, expected %g",
                  m.var, var);
}

static void check_constant(const nb_tensor *t, double value) {
    moments m = moments_of(t);
    ck_assert(m.min == value && m.max == value);
}

NBT_CPU_TEST(test_init_schemes) {
    nb_rng rng = nb_rng_make(99);
    nb_module *lin = nb_linear_new(ctx, NB_F64, 400, 300, true, &rng);
    check_uniform(nb_module_find(lin, "weight"), 1.0 / 20);
    check_uniform(nb_module_find(lin, "bias"), 1.0 / 20);
    ck_assert_int_eq(nb_init_fan_in(nb_module_find(lin, "weight")), 400);
    nb_module *conv = nb_conv2d_new(ctx, NB_F32, 16, 64, 3, 5, NULL, true, &rng);
    nb_tensor *cw = nb_module_find(conv, "weight");
    ck_assert(cw->ndim == 4 && cw->shape[0] == 64 && cw->shape[1] == 16 && cw->shape[2] == 3 &&
              cw->shape[3] == 5 && cw->dtype == NB_F32);
    ck_assert_int_eq(nb_init_fan_in(cw), 240);
    check_uniform(cw, 1.0 / sqrt(240.0));
    /* 64 samples: the bounds only */
    moments bm = moments_of(nb_module_find(conv, "bias"));
    ck_assert(bm.min >= -1.0 / sqrt(240.0) && bm.max <= 1.0 / sqrt(240.0) && bm.max > bm.min);
    nb_module *emb = nb_embedding_new(ctx, NB_F64, 500, 200, &rng);
    moments em = moments_of(nb_module_find(emb, "weight"));
    double n = 1e5;
    ck_assert_msg(fabs(em.mean) < 5 / sqrt(n), "embedding mean %g", em.mean);
    ck_assert_msg(fabs(em.var - 1) < 5 * sqrt(2 / n), "embedding variance %g", em.var);
    ck_assert(em.max > 3.5 && em.min < -3.5); /* normal tails, not a bounded law */
    nb_module *ln = nb_layer_norm_new(ctx, NB_F32, NB_SHAPE(3, 7), NULL);
    check_constant(nb_module_find(ln, "weight"), 1);
    check_constant(nb_module_find(ln, "bias"), 0);
    nb_module *bn = nb_batch_norm2d_new(ctx, NB_F32, 5, NULL);
    check_constant(nb_module_find(bn, "weight"), 1);
    check_constant(nb_module_find(bn, "bias"), 0);
    check_constant(nb_module_find(bn, "running_mean"), 0);
    check_constant(nb_module_find(bn, "running_var"), 1);
    ck_assert(nb_item(nb_module_find(bn, "num_batches_tracked")) == 0);
}

/* Same generator state, same parameters; the generator advances across
 * layers, weight first then bias. */
NBT_CPU_TEST(test_init_reproducible) {
    nb_rng a = nb_rng_make(7), b = nb_rng_make(7);
    nb_module *l1 = nb_linear_new(ctx, NB_F32, 5, 6, true, &a);
    nb_module *l2 = nb_linear_new(ctx, NB_F32, 5, 6, true, &b);
    nbt_assert_tensors_close(nb_module_find(l1, "weight"), nb_module_find(l2, "weight"), 0, 0);
    nbt_assert_tensors_close(nb_module_find(l1, "bias"), nb_module_find(l2, "bias"), 0, 0);
    ck_assert(a.offset == b.offset && a.offset > 0);
    nb_rng c = nb_rng_make(7);
    nb_tensor *w = nb_rand_uniform(ctx, NB_F32, NB_SHAPE(6, 5), -1 / sqrt(5.0), 1 / sqrt(5.0), &c);
    nb_tensor *bias = nb_rand_uniform(ctx, NB_F32, NB_SHAPE(6), -1 / sqrt(5.0), 1 / sqrt(5.0), &c);
    nbt_assert_tensors_close(nb_module_find(l1, "weight"), w, 0, 0);
    nbt_assert_tensors_close(nb_module_find(l1, "bias"), bias, 0, 0);
    /* a second layer from the same stream differs */
    nb_module *l3 = nb_linear_new(ctx, NB_F32, 5, 6, true, &a);
    ck_assert(nb_get(nb_module_find(l3, "weight"), (int64_t[]){0, 0}) !=
              nb_get(nb_module_find(l1, "weight"), (int64_t[]){0, 0}));
}

NBT_CPU_TEST(test_init_in_place) {
    nb_tensor *t = nb_zeros(ctx, NB_F64, NB_SHAPE(300, 200));
    nb_rng r1 = nb_rng_make(3), r2 = nb_rng_make(3);
    nb_init_uniform_(t, -0.5, 0.5, &r1);
    nbt_assert_tensors_close(t, nb_rand_uniform(ctx, NB_F64, NB_SHAPE(300, 200), -0.5, 0.5, &r2), 0, 0);
    check_uniform(t, 0.5);
    ck_assert(r1.offset == r2.offset);
    nb_init_normal_(t, 1.0, 0.02, &r1);
    moments m = moments_of(t);
    ck_assert_msg(fabs(m.mean - 1.0) < 5 * 0.02 / sqrt(6e4), "mean %g", m.mean);
    ck_assert_msg(fabs(m.var - 4e-4) < 5 * 4e-4 * sqrt(2 / 6e4), "variance %g", m.var);
    nbt_assert_tensors_close(t, nb_rand_normal(ctx, NB_F64, NB_SHAPE(300, 200), 1.0, 0.02, &r2), 0, 0);
    /* a strided view is written in place, the rest untouched */
    nb_tensor *z = nb_zeros(ctx, NB_F32, NB_SHAPE(4, 6));
    nb_init_uniform_(nb_slice(ctx, z, 1, 0, 6, 2), 1.0, 2.0, NULL);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 6; j++) {
            double v = nb_get(z, (int64_t[]){i, j});
            ck_assert(j % 2 ? v == 0 : (v >= 1 && v < 2));
        }
    /* a parameter keeps requiring grad and records nothing */
    nb_module *lin = nb_linear_new(ctx, NB_F32, 3, 3, true, NULL);
    nb_tensor *w = nb_module_find(lin, "weight");
    nb_init_normal_(w, 0, 0.02, NULL);
    ck_assert(w->requires_grad && w->node == NULL);
    NBT_EXPECT_ABORT(nb_init_uniform_(t, 1, 0, NULL), "nb_init_uniform_: low 1 > high 0");
    NBT_EXPECT_ABORT(nb_init_normal_(t, 0, -1, NULL), "nb_init_normal_: std -1 is negative");
    NBT_EXPECT_ABORT(nb_init_normal_(nb_zeros(ctx, NB_I32, NB_SHAPE(2)), 0, 1, NULL),
                     "nb_init_normal_: tensor (2,) has dtype i32; only float tensors can be initialised");
    NBT_EXPECT_ABORT(nb_init_fan_in(nb_zeros(ctx, NB_F32, NB_SHAPE(3))),
                     "nb_init_fan_in: weight (3,) needs at least 2 dims");
}

NBT_MAIN("nn", "core", 0,
         test_names_and_order, test_cap_protocol, test_late_registration, test_tied_and_shared,
         test_find_and_children, test_train_eval, test_zero_grad, test_module_to, test_print, test_custom_module,
         test_docs_example_runs, test_docs_show_example, test_registration_errors, test_constructor_errors,
         test_init_schemes, test_init_reproducible, test_init_in_place)
