/* The CUDA backend's flags (the members of nb__backend in tensor/backend.h
 * that say how the front end drives it), written once: tensor/cuda/
 * backend.c's table and the meta device's meta:cuda table (tensor/meta.c)
 * both take them from here, so the meta device follows the CUDA path's op
 * sequence, dtypes and fusions in a build without CUDA. A flag changed in
 * the CUDA table is changed here; an entry that changes how many kernels it
 * launches updates tensor/cuda/launches.h. Plain C, no CUDA header. */
#ifndef NABLA_TENSOR_CUDA_FLAGS_H
#define NABLA_TENSOR_CUDA_FLAGS_H

#define NB__CUDA_BACKEND_FLAGS \
    .device_memory = true, \
    .gemm_accumulate = true, \
    .gemm_epilogues = true, \
    .ordered_elementwise = false, \
    .strided_elementwise_out = false, \
    .half_compute = true, \
    .product_dtypes = (1u << NB_BF16) | (1u << NB_F16), \
    .f32_norm_stats = true, \
    /* tensor/cuda/attention.cu (f64 composes) */ \
    .causal_attention_dtypes = (1u << NB_F32) | (1u << NB_BF16) | (1u << NB_F16)

/* The largest head dimension tensor/cuda/attention.cu's kernels take (a
 * larger one composes); meta:cuda's causal_attention_takes reads it too. */
#define NB__CUDA_ATTENTION_MAX_D 128

#endif
