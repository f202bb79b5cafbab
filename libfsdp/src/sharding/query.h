// Internal: what the composable features (activation checkpointing, gradient
// clipping, tensor parallelism) may ask of fully_shard -- a narrow interface, so that they never
// walk a unit's parameter groups themselves.
#pragma once

#include "fsdp/process_group.h"
#include "fsdp/dtensor.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {
struct UnitState;
namespace detail {

using UnitRef = std::shared_ptr<UnitState>;

// Marks this thread as recomputing a checkpointed segment inside backward:
// units re-gather if needed but run no root logic, record no forward order,
// issue no prefetch, attach no pre-backward hook and do not reshard after
// forward (post_backward does).
class RecomputeGuard {
 public:
  RecomputeGuard();
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;
  static bool active();
};


// Activation checkpointing: a non-reentrant segment's parameter edges lead to
// AccumulateGrad nodes, which validate gradients against the shape and dtype
// the parameter had when the node was created. Unshards the units whose
// parameters among `params` would not yield compute-form nodes right now,
// and returns them.
std::vector<UnitRef> unshard_for_grad_edges(const std::vector<at::Tensor>& params);
// Reshards those of `units` that their own forward would have left sharded.
void reshard_as_after_forward(const std::vector<UnitRef>& units);

// Every parameter of the modules of `module`'s unit (a unit over several
// modules: all of them; nested units and plain parameters included); none
// if `module` is not a unit.
std::optional<std::vector<at::Tensor>> unit_module_parameters(const torch::nn::Module& module);

// Gradient clipping: how a managed parameter's sharded gradient is laid out.
struct ManagedGrad {
  std::string name;
  bool requires_grad = false;
  // Its unit holds full parameters, so the sharded gradient is set aside.
  bool unsharded = false;
  // Groups over which the gradient's shards are split: a norm sums over them
  // (in this order); an empty list means every rank holds all of it.
  std::vector<ProcessGroupPtr> split_groups;
  // Where the local shard sits in the global tensor: the mesh of FSDP's and
  // the carried dims, and its placements there (per-expert norms map local
  // rows to experts with them).
  std::optional<DeviceMesh> mesh;
  std::vector<Placement> placements;
};
// Finishes every reduction still in flight (set_is_last_backward(false)),
// then describes every managed parameter, by TensorImpl.
std::unordered_map<const c10::TensorImpl*, ManagedGrad> managed_grads();

// Distributed checkpoints: a managed parameter's shard and how to overwrite
// it. `unsharded`: its unit holds full parameters right now, so the shard
// may be stale against what the module computes with (callers refuse).
struct ManagedShard {
  std::string name;
  DTensor shard;  // local = the sharded values, original dtype
  bool unsharded = false;
  // Copies values of the local shape into the shard (as load_state_dict).
  std::function<void(const at::Tensor&)> load;
};
// Every managed parameter of every live unit, by the module parameter's
// TensorImpl (the optimizer's key). Finishes reductions still in flight.
std::unordered_map<const c10::TensorImpl*, ManagedShard> managed_shards();

}  // namespace detail
}  // namespace fsdp
