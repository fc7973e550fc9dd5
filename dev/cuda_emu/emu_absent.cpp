/* The entries of tensor/cuda/backend.c's table whose files the emulator
 * does not build (cuDNN's convolution and batch norm; pooling and
 * SyncBatchNorm's statistics, not yet brought here): drv_profile's GPT step
 * calls none of them, and one that is called says so. Declared without
 * their arguments, as nothing here calls them with any. */
#include <stdio.h>
#include <stdlib.h>

#define ABSENT(f)                                                                                  \
    extern "C" void f() {                                                                          \
        fprintf(stderr, "cuda_emu: %s is not emulated (emu_absent.cpp)\n", #f);                    \
        abort();                                                                                   \
    }
ABSENT(nb__cuda_conv2d)
ABSENT(nb__cuda_conv2d_backward)
ABSENT(nb__cuda_batch_norm)
ABSENT(nb__cuda_batch_norm_backward)
ABSENT(nb__cuda_max_pool2d)
ABSENT(nb__cuda_max_pool2d_backward)
ABSENT(nb__cuda_avg_pool2d)
ABSENT(nb__cuda_avg_pool2d_backward)
ABSENT(nb__cuda_channel_stats)
ABSENT(nb__cuda_channel_finalize)
ABSENT(nb__cuda_channel_normalize)
ABSENT(nb__cuda_channel_backward_sums)
ABSENT(nb__cuda_channel_backward_dx)
