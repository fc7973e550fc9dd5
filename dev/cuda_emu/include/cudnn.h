/* Stand-in (dev/cuda_emu): the cuDNN types tensor/cuda/check.h names.
 * No driver runs a cuDNN call. */
#pragma once
typedef int cudnnStatus_t;
typedef enum { CUDNN_DATA_FLOAT, CUDNN_DATA_DOUBLE, CUDNN_DATA_HALF, CUDNN_DATA_BFLOAT16 } cudnnDataType_t;
#define CUDNN_STATUS_SUCCESS 0
static inline const char *cudnnGetErrorString(cudnnStatus_t s) { (void)s; return "cuDNN (emulated)"; }
