// Internal: the state of one sharded unit and the process-wide step context
// (registry, root detection, forward order, end-of-backward finalisation).
#pragma once

#include "fsdp/fully_shard.h"
#include "param_group.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fsdp {

struct UnitState : std::enable_shared_from_this<UnitState> {
  UnitState(int64_t id, std::vector<std::shared_ptr<torch::nn::Module>> modules, DeviceMesh mesh,
            detail::ParamGroup group, const FullyShardOptions& options);

  const int64_t id;
  std::vector<std::weak_ptr<torch::nn::Module>> modules;
  std::vector<const torch::nn::Module*> module_ptrs;
  DeviceMesh mesh;
  detail::ParamGroup group;
  MixedPrecisionPolicy mp;

  // Settings (FSDPModule setters).
  bool reshard_after_forward;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool is_last_backward = true;
  bool average = true;
  std::optional<double> scaling_factor;
  std::vector<std::weak_ptr<UnitState>> forward_prefetch;
  std::vector<std::weak_ptr<UnitState>> backward_prefetch;
  bool explicit_backward_prefetch = false;

  // Per forward/backward pass.
  int64_t forward_entries = 0;
  bool pre_backward_done = false;
  bool post_backward_done = false;
  int64_t grads_ready = 0;
  int64_t grads_expected = 0;

  // detail::is_root()'s cache, valid while the unit set is unchanged.
  mutable uint64_t root_generation = ~uint64_t{0};
  mutable bool root_cached = false;

  bool alive() const;
  // Whether `other`'s modules lie inside this unit's modules.
  bool contains(const UnitState& other) const;
  // Units nested in this one (itself included), for recurse=true setters.
  std::vector<std::shared_ptr<UnitState>> self_and_nested();

  void unshard(bool async_op);
  void wait_unshard();
  void reshard();

  void pre_forward();
  at::Tensor cast_input(const at::Tensor& t) const;
  at::Tensor finish_output(const at::Tensor& t);
  void post_forward();
  void pre_backward();
  void on_grad_ready(size_t index);
  void post_backward();
  detail::ReduceSettings reduce_settings() const;
};

namespace detail {

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

std::shared_ptr<UnitState> unit_for_module(const torch::nn::Module& module);
std::vector<std::shared_ptr<UnitState>> live_units();
void register_unit(const std::shared_ptr<UnitState>& unit);
// Parameters (by TensorImpl) already managed by a live unit.
bool is_managed(const at::Tensor& param);
int64_t next_unit_id();
// No other live unit contains this unit's modules.
bool is_root(const UnitState& unit);
// Re-routes entries of torch::nn::Sequential containers inside `module`
// whose modules are sharded units through those units.
void intercept_sequential_children(torch::nn::Module& module);

}  // namespace detail
}  // namespace fsdp
