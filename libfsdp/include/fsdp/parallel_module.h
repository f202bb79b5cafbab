// Modules whose parameters another parallelism already distributes (tensor
// parallel layers over tp, grouped experts over ep), and how fully_shard
// learns their layout. C++ modules have no hooks FSDP could inspect, so such
// a module describes its own parameters.
#pragma once

#include "fsdp/options.h"

#include <torch/nn/module.h>

#include <vector>

namespace fsdp {

// Implemented by fsdp::tp's layers, fsdp::moe::GroupedExperts, and model
// blocks that own tp-replicated parameters (sequence-parallel norms).
class ParallelModule {
 public:
  virtual ~ParallelModule() = default;
  // This module's own parameters (not its children's) that live on a tp or
  // ep mesh, as DTensors whose local tensor is the parameter itself.
  virtual std::vector<DistributedParam> distributed_params() const = 0;
};

// The DistributedParams of `module` and its descendants that no unit
// manages yet (call it right before fully_shard(module, ...), bottom-up).
// Tied parameters are listed once.
std::vector<DistributedParam> dtensor_params(const torch::nn::Module& module);
// `base` with dtensor_params(module) appended: the options to fully_shard
// `module` with (the same as base for a module without such parameters).
FullyShardOptions options_for(const torch::nn::Module& module, FullyShardOptions base);

}  // namespace fsdp
