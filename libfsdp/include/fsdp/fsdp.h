// libfsdp umbrella header.
#pragma once

#include "fsdp/activation_checkpoint.h"
#include "fsdp/clip_grad.h"
#include "fsdp/comm.h"
#include "fsdp/dtensor.h"
#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/memory.h"
#include "fsdp/mesh.h"
#include "fsdp/moe.h"
#include "fsdp/optim_state.h"
#include "fsdp/parallel_module.h"
#include "fsdp/runtime.h"
#include "fsdp/pipeline.h"
#include "fsdp/tensor_parallel.h"
#include "fsdp/trace.h"
