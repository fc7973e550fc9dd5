/* Data to and from the GPU: the loader with a CUDA device (0 and 3
 * workers, pinned and pageable staging) gives the CPU loader's batches;
 * checkpoints of CUDA tensors round-trip (contiguous, transposed, dtype
 * conversions); nb_module_to moves a model CPU -> CUDA -> CPU with its
 * values, names, flags and tied weights. Skipped (77) without CUDA in the
 * build or without a visible GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_parity.h"
#include "testutil.h"

#if NABLA_HAVE_CUDA

static nb_dataset *make_dataset(void) {
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nbt_randn(ctx, NB_F32, NB_SHAPE(103, 3, 5), 11);
    nb_tensor *y = nb_arange(ctx, NB_I64, 0, 103, 1);
    nb_dataset *ds = nb_dataset_from_tensors(x, y);
    nb_ctx_free(ctx);
    return ds;
}

static void expect_equal_bits(const nb_tensor *a, const nb_tensor *b) {
    ck_assert(nb_same_shape(a, b));
    ck_assert_int_eq(a->dtype, b->dtype);
    size_t bytes = (size_t)nb_numel(a) * nb_dtype_size(a->dtype);
    char *ha = malloc(bytes + 1), *hb = malloc(bytes + 1);
    nb_to_host(a, ha);
    nb_to_host(b, hb);
    ck_assert(memcmp(ha, hb, bytes) == 0);
    free(ha);
    free(hb);
}

static void loader_case(int workers, bool pin, int prefetch) {
    nb_dataset *ds = make_dataset();
    nb_loader_options o = {.batch_size = 8, .shuffle = true, .seed = 3, .num_workers = workers,
                           .prefetch_batches = prefetch, .device = nb_cuda(0),
                           .pin_memory = pin};
    nb_loader_options oc = o;
    oc.device = nb_cpu();
    oc.num_workers = 0;
    nb_loader *l = NULL, *lc = NULL;
    ck_assert_int_eq(nb_loader_new(&l, ds, &o), NB_OK);
    ck_assert_int_eq(nb_loader_new(&lc, ds, &oc), NB_OK);
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0), *cpu = nb_ctx_new(nb_cpu(), 0);
    for (int epoch = 0; epoch < 2; epoch++) {
        for (;;) {
            nb_batch b, bc;
            ck_assert_int_eq(nb_loader_next(l, dev, &b), NB_OK);
            ck_assert_int_eq(nb_loader_next(lc, cpu, &bc), NB_OK);
            ck_assert_int_eq(b.size, bc.size);
            if (!b.inputs) break;
            ck_assert(b.inputs->device.type == NB_DEVICE_CUDA);
            ck_assert(b.targets->device.type == NB_DEVICE_CUDA);
            ck_assert(memcmp(b.indices, bc.indices, sizeof(int64_t) * (size_t)b.size) == 0);
            /* an op queued right after sees the batch */
            nb_tensor *twice = nb_mul_scalar(dev, b.inputs, 2.0);
            nb_tensor *twice_c = nb_mul_scalar(cpu, bc.inputs, 2.0);
            expect_equal_bits(b.inputs, bc.inputs);
            expect_equal_bits(b.targets, bc.targets);
            expect_equal_bits(twice, twice_c);
            nb_ctx_reset(dev); /* the arena is reused at once, as in a training loop */
            nb_ctx_reset(cpu);
        }
    }
    /* a seek drops the prefetched batches */
    ck_assert_int_eq(nb_loader_seek(l, 5, 3), NB_OK);
    ck_assert_int_eq(nb_loader_seek(lc, 5, 3), NB_OK);
    nb_batch b, bc;
    ck_assert_int_eq(nb_loader_next(l, dev, &b), NB_OK);
    ck_assert_int_eq(nb_loader_next(lc, cpu, &bc), NB_OK);
    expect_equal_bits(b.inputs, bc.inputs);
    nb_loader_free(l);
    nb_loader_free(lc);
    nb_ctx_free(dev);
    nb_ctx_free(cpu);
    nb_dataset_free(ds);
}

START_TEST(test_loader_to_cuda) {
    loader_case(0, false, 0);
    loader_case(0, true, 0);
    loader_case(3, false, 0);
    loader_case(3, true, 0);
    loader_case(2, true, 1);
}
END_TEST

START_TEST(test_checkpoint_cuda_round_trip) {
    char path[] = "/tmp/nabla_cuda_ckpt_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    nb_ctx *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_tensor *a = nbt_randn(dev, NB_F32, NB_SHAPE(33, 7), 1);
    nb_tensor *bt = nb_transpose(dev, nbt_randn(dev, NB_F64, NB_SHAPE(5, 9), 2), 0, 1);
    nb_tensor *c = nb_cast(dev, nbt_randn(dev, NB_F32, NB_SHAPE(1000), 3), NB_BF16);
    nb_tensor *e = nb_zeros(dev, NB_F32, NB_SHAPE(0, 4));
    nb_named_tensor save[] = {{"a", a}, {"b", bt}, {"c", c}, {"e", e}};
    ck_assert_int_eq(nb_checkpoint_save(path, save, 4, NULL, 0), NB_OK);
    /* read back into CUDA tensors: contiguous, and a transposed view */
    nb_tensor *a2 = nb_zeros(dev, NB_F32, NB_SHAPE(33, 7));
    nb_tensor *b2 = nb_transpose(dev, nb_zeros(dev, NB_F64, NB_SHAPE(5, 9)), 0, 1);
    nb_tensor *c2 = nb_zeros(dev, NB_BF16, NB_SHAPE(1000));
    nb_tensor *e2 = nb_zeros(dev, NB_F32, NB_SHAPE(0, 4));
    nb_named_tensor load[] = {{"a", a2}, {"b", b2}, {"c", c2}, {"e", e2}};
    ck_assert_int_eq(nb_checkpoint_load(path, load, 4), NB_OK);
    expect_equal_bits(a2, a);
    expect_equal_bits(b2, bt);
    expect_equal_bits(c2, c);
    /* and into CPU tensors: the same bytes */
    nb_ctx *cpu = nb_ctx_new(nb_cpu(), 0);
    nb_named_tensor load_c[] = {{"a", nb_zeros(cpu, NB_F32, NB_SHAPE(33, 7))},
                                {"b", nb_zeros(cpu, NB_F64, NB_SHAPE(9, 5))},
                                {"c", nb_zeros(cpu, NB_BF16, NB_SHAPE(1000))},
                                {"e", nb_zeros(cpu, NB_F32, NB_SHAPE(0, 4))}};
    ck_assert_int_eq(nb_checkpoint_load(path, load_c, 4), NB_OK);
    expect_equal_bits(load_c[0].tensor, a);
    expect_equal_bits(load_c[1].tensor, bt);
    expect_equal_bits(load_c[2].tensor, c);
    unlink(path);
    nb_ctx_free(cpu);
    nb_ctx_free(dev);
}
END_TEST

START_TEST(test_module_to_cuda_and_back) {
    nb_ctx *meta = nb_ctx_new(nb_cpu(), 0), *dev = nb_ctx_new(nb_cuda(0), 0);
    nb_ctx *back = nb_ctx_new(nb_cpu(), 0), *step = nb_ctx_new(nb_cpu(), 0);
    nb_ctx *dstep = nb_ctx_new(nb_cuda(0), 0);
    nb_rng rng = nb_rng_make(5);
    nb_module *m = nb_sequential_new(meta, 3,
                                     (nb_module *[]){nb_linear_new(meta, NB_F32, 6, 7, true, &rng),
                                                     nb_batch_norm1d_new(meta, NB_F32, 7, NULL),
                                                     nb_linear_new(meta, NB_F32, 7, 6, false, &rng)});
    nb_tensor *tied = nb_module_find(m, "0.weight");
    nb_module_add_buffer(m, "extra", nb_arange(meta, NB_I64, 0, 5, 1));
    nb_module_add_param(nb_module_child(m, "2"), "tied", tied);
    int n = nb_module_state(m, NULL, 0);
    nb_named_tensor st[16];
    ck_assert_int_le(n, 16);
    nb_module_state(m, st, n);
    nb_tensor *x = nbt_randn(step, NB_F32, NB_SHAPE(4, 6), 8);
    nb_tensor *y_cpu = nb_module_forward(m, step, x);
    double *before[16];
    for (int i = 0; i < n; i++) before[i] = nbt_values(st[i].tensor);
    bool rg[16];
    for (int i = 0; i < n; i++) rg[i] = st[i].tensor->requires_grad;

    ck_assert_int_eq(nb_module_to(m, dev), NB_OK);
    ck_assert_ptr_eq(nb_module_find(m, "2.tied"), tied);
    for (int i = 0; i < n; i++) {
        nb_tensor *t = st[i].tensor;
        ck_assert(t->device.type == NB_DEVICE_CUDA);
        ck_assert_ptr_eq(t->ctx, dev);
        ck_assert(t->requires_grad == rg[i]);
        ck_assert_ptr_null(t->grad);
        double *v = nbt_values(t);
        ck_assert(memcmp(v, before[i], sizeof(double) * (size_t)nb_numel(t)) == 0);
        free(v);
    }
    /* forward and backward on the GPU give the CPU's output and gradients */
    nb_tensor *xd = nb_from_host(dstep, NB_F32, NB_SHAPE(4, 6), x->data);
    nb_tensor *y_dev = nb_module_forward(m, dstep, xd);
    nbt_assert_tensors_close(y_dev, y_cpu, 1e-5, 1e-5);
    nb_backward(nbt_weighted_sum(dstep, y_dev));
    ck_assert(tied->grad && tied->grad->device.type == NB_DEVICE_CUDA);

    ck_assert_int_eq(nb_module_to(m, back), NB_OK);
    for (int i = 0; i < n; i++) {
        nb_tensor *t = st[i].tensor;
        ck_assert(t->device.type == NB_DEVICE_CPU);
        ck_assert_ptr_eq(t->ctx, back);
        ck_assert_ptr_null(t->grad);
    }
    for (int i = 0; i < n; i++) free(before[i]);
    nb_ctx_free(dstep);
    nb_ctx_free(step);
    nb_ctx_free(back);
    nb_ctx_free(dev);
    nb_ctx_free(meta);
}
END_TEST

int main(void) {
    nbt_cuda_require();
    Suite *s = suite_create("cuda_data");
    TCase *tc = tcase_create("data");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_loader_to_cuda);
    tcase_add_test(tc, test_checkpoint_cuda_round_trip);
    tcase_add_test(tc, test_module_to_cuda_and_back);
    suite_add_tcase(s, tc);
    return nbt_run(s);
}

#else

int main(void) {
    fprintf(stderr, "skipped: this build has no CUDA\n");
    return 77;
}

#endif
