// Shared includes of the test_fully_shard_core feature files
// (test_fully_shard_core_{layouts,param_groups,state,reduce_gradients}.cpp).
#pragma once

#include "l1_util.h"
#include "spmd.h"
#include "toy_models.h"

#include "sharding/lifecycle.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace {

using l1::host;

}  // namespace
