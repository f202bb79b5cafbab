// Internal: what a pipeline stage holds -- its module and forward, its place
// in the pipeline, and the FSDP units inside it that the schedule drives.
#pragma once

#include "fsdp/pipeline.h"

#include <utility>
#include <vector>

namespace fsdp::pp {

struct PipelineStage::State {
  explicit State(DeviceMesh mesh) : pp_mesh(std::move(mesh)) {}
  std::shared_ptr<torch::nn::Module> module;
  ForwardFn forward;
  int index = 0;
  int num_stages = 1;
  DeviceMesh pp_mesh;
  StageOptions options;
  // One handle per FSDP unit inside the stage (the stage module's own
  // first), in module order: the same order on every data-parallel peer.
  std::vector<FSDPModule> units;

  // Per-microbatch schedule hooks: each backward accumulates locally, the
  // ReduceGrad action reduces once.
  void begin_microbatches();
  void reduce_gradients();
  void unshard_async();
};

}  // namespace fsdp::pp
