/* nabla: data-parallel deep learning in C. The umbrella header. */
#ifndef NABLA_NABLA_H
#define NABLA_NABLA_H

#define NABLA_VERSION_MAJOR 0
#define NABLA_VERSION_MINOR 1
#define NABLA_VERSION_PATCH 0

#include "nabla/api.h"
#include "nabla/error.h"
#include "nabla/dtype.h"
#include "nabla/cuda.h"
#include "nabla/meta.h"
#include "nabla/context.h"
#include "nabla/random.h"
#include "nabla/tensor.h"
#include "nabla/ops.h"
#include "nabla/autograd.h"
#include "nabla/nn.h"
#include "nabla/optim.h"
#include "nabla/checkpoint.h"
#include "nabla/dataset.h"
#include "nabla/sampler.h"
#include "nabla/loader.h"
#include "nabla/dist.h"
#include "nabla/ddp.h"
#include "nabla/fsdp.h"
#include "nabla/models.h"
#include "nabla/monitor.h"
#include "nabla/threads.h"
#include "nabla/config.h"

#endif
