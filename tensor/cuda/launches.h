/* Kernel launches (and memsets, copies, library calls) per call of each
 * CUDA backend entry, read from tensor/cuda/ *.cu: the meta device's
 * meta:cuda counts `launches` from this table (tensor/meta.c, Note [Meta
 * device]). A change to how many kernels an entry launches updates its row
 * here, in the same commit; where the count depends on the shapes, the row
 * is the fixed part and the comment names what tensor/meta.c adds. Plain
 * C, no CUDA header: the meta device exists in every build. */
#ifndef NABLA_TENSOR_CUDA_LAUNCHES_H
#define NABLA_TENSOR_CUDA_LAUNCHES_H

enum {
    /* ---- runtime ---- */
    NB__CUDA_LAUNCHES_memset = 1,     /* cudaMemsetAsync */
    NB__CUDA_LAUNCHES_memcpy = 1,     /* cudaMemcpyAsync (d2d, h2d, d2h) */
    /* ---- elementwise.cu ---- */
    NB__CUDA_LAUNCHES_unary = 1,      /* flat_kernel, strided_kernel or vec_kernel */
    NB__CUDA_LAUNCHES_binary = 1,     /* same */
    NB__CUDA_LAUNCHES_where = 1,      /* same */
    NB__CUDA_LAUNCHES_copy = 1,       /* cudaMemcpyAsync (contiguous, one dtype) or a copy kernel;
                                         a fill from the host: one fill kernel */
    NB__CUDA_LAUNCHES_axpy = 1,       /* vec_kernel or strided_kernel */
    /* ---- reduce.cu (run_rows: one rows_{thread,warp,block}_kernel; plus
     * one, rows_split_kernel then rows_warp_kernel, when inner > 65536 and
     * outer < 256: tensor/meta.c) ---- */
    NB__CUDA_LAUNCHES_sum_rows = 1,
    NB__CUDA_LAUNCHES_max_rows = 1,
    NB__CUDA_LAUNCHES_argmax_rows = 1,
    NB__CUDA_LAUNCHES_max_rows_backward = 1, /* max_backward_kernel */
    NB__CUDA_LAUNCHES_var_rows = 2,   /* run_rows for the mean, then for the variance */
    NB__CUDA_LAUNCHES_pair_loss = 1,  /* run_rows over one row */
    /* ---- matmul.cu: one cublasLtMatmul per batch call (the batch split
     * of nb__cuda_gemm: tensor/meta.c counts the calls), bias, GELU, DGELU
     * and a bias gradient (BGRADB) in its epilogue; plus epilogue_kernel
     * per call where the GELU's or DGELU's aux matrix is not 8-element
     * aligned (cuBLASLt is assumed to have an algorithm with the epilogue
     * otherwise; without one, bgrad_kernel sums the bias gradient); k = 0:
     * a memset (and the epilogue kernel with a bias or GELU; nothing when
     * it accumulates), plus a memset of a bias gradient ---- */
    NB__CUDA_LAUNCHES_matmul = 1,
    NB__CUDA_LAUNCHES_gelu_tanh_backward = 2, /* backend.c: unary GELU_TANH_GRAD, then binary MUL */
    /* ---- softmax.cu, softmax_causal.cu ---- */
    NB__CUDA_LAUNCHES_softmax = 1,    /* softmax_rows(_reg)_kernel or softmax_cols_kernel */
    NB__CUDA_LAUNCHES_softmax_backward = 1,
    NB__CUDA_LAUNCHES_softmax_causal = 1,          /* causal(_reg)_kernel */
    NB__CUDA_LAUNCHES_softmax_causal_backward = 1, /* causal_backward(_reg)_kernel */
    NB__CUDA_LAUNCHES_cross_entropy = 2,           /* cross_entropy_rows_kernel, _total_kernel */
    NB__CUDA_LAUNCHES_cross_entropy_fused = 3,     /* + cross_entropy_count_kernel first */
    NB__CUDA_LAUNCHES_cross_entropy_backward = 1,  /* cross_entropy_backward_kernel, or
                                                      _scale_kernel after a fused forward */
    /* ---- attention.cu: our kernels (attention_kernel; attention_dq_kernel,
     * attention_dkdv_kernel), or one cuDNN call each (attention_cudnn.cpp) ---- */
    NB__CUDA_LAUNCHES_causal_attention = 1,
    NB__CUDA_LAUNCHES_causal_attention_backward = 2,
    /* ---- layer_norm.cu ---- */
    NB__CUDA_LAUNCHES_layer_norm = 1, /* layer_norm_regs_kernel or layer_norm_kernel */
    /* with dw/db, rows in registers (d <= 16 * MAX_ROW_THREADS, 8192):
     * layer_norm_backward_regs_kernel, layer_norm_dwdb_sum_kernel; else
     * layer_norm_dx_kernel, _dwdb_partial_kernel, _dwdb_final_kernel (3);
     * without dw/db, one */
    NB__CUDA_LAUNCHES_layer_norm_backward = 2,
    NB__CUDA_LAUNCHES_layer_norm_backward_wide = 3,
    /* ---- batch_norm.cu: as cuDNN's path (one call each way) ---- */
    NB__CUDA_LAUNCHES_batch_norm = 1,
    NB__CUDA_LAUNCHES_batch_norm_backward = 1,
    /* ---- conv.cu: one cuDNN call per product, plus bias_add_kernel /
     * bias_grad_kernel with a bias ---- */
    NB__CUDA_LAUNCHES_conv2d = 1,
    NB__CUDA_LAUNCHES_conv2d_backward = 0, /* + one per gradient asked for */
    /* ---- pool.cu ---- */
    NB__CUDA_LAUNCHES_max_pool2d = 1,
    NB__CUDA_LAUNCHES_max_pool2d_backward = 1,
    NB__CUDA_LAUNCHES_avg_pool2d = 1,
    NB__CUDA_LAUNCHES_avg_pool2d_backward = 1,
    /* ---- dropout.cu, embedding.cu ---- */
    NB__CUDA_LAUNCHES_rand_uniform = 1,
    NB__CUDA_LAUNCHES_rand_normal = 1,
    NB__CUDA_LAUNCHES_dropout = 1,
    NB__CUDA_LAUNCHES_embedding = 1,  /* embedding_kernel */
    /* embedding_keys_kernel, embedding_backward_kernel (every row of gw
     * written: no memset); plus CUB's DeviceRadixSort::SortPairs: an
     * upsweep and one pass per 8 key bits (tensor/meta.c adds them); no
     * index positions: one cudaMemsetAsync of gw instead */
    NB__CUDA_LAUNCHES_embedding_backward = 2, /* accumulating: the same, rows not hit skipped;
                                                 no positions: nothing */
    NB__CUDA_LAUNCHES_embedding_pos = 1,          /* embedding_pos_kernel */
    NB__CUDA_LAUNCHES_embedding_pos_backward = 1, /* embedding_pos_backward_kernel */
    /* ---- optim.cu, reduce.cu: multi-tensor updates ---- */
    NB__CUDA_OPTIM_TENSORS_PER_LAUNCH = 192, /* adam_kernel / sgd_kernel: MAX_TENSORS */
    NB__CUDA_SUMSQ_TENSORS_PER_LAUNCH = 192, /* sumsq_partial_kernel: SQ_BATCH; then one
                                                sumsq_final_kernel */
    /* backend.c: per tensor |x|, its maximum (max_rows), a copy into the f64
     * row; then the row's maximum (max_rows) */
    NB__CUDA_LAUNCHES_max_abs_per_tensor = 3,
    NB__CUDA_LAUNCHES_max_abs = 1,
    NB__CUDA_LAUNCHES_scale_per_tensor = 1, /* backend.c: the unary MUL_S per tensor */
    NB__CUDA_CLIP_TENSORS_PER_LAUNCH = 128,  /* optim.cu: clip_scale_kernel, CLIP_BATCH */
    /* backend.c: nb__cuda_sum_squares, then the result read by the host */
    NB__CUDA_LAUNCHES_all_finite = 1,
    /* ---- channel.cu ---- */
    NB__CUDA_LAUNCHES_channel_stats = 2,          /* cudaMemsetAsync, stats_kernel */
    NB__CUDA_LAUNCHES_channel_finalize = 1,       /* finalize_kernel */
    NB__CUDA_LAUNCHES_channel_normalize = 1,      /* apply_kernel */
    NB__CUDA_LAUNCHES_channel_backward_sums = 2,  /* cudaMemsetAsync, backward_sums_kernel */
    NB__CUDA_LAUNCHES_channel_backward_dx = 1,    /* backward_dx_kernel */
};

#endif
