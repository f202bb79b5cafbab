// Internal: the state of one sharded unit -- its modules and parameter
// groups, its settings, its per-pass state -- and its hooks.
#pragma once

#include "fsdp/options.h"
#include "sharding/lifecycle.h"
#include "sharding/param_group.h"
#include "sharding/post_forward.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace detail {
struct RootContext;  // sharding/root_pass.h
}  // namespace detail

struct UnitState : std::enable_shared_from_this<UnitState> {
  UnitState(int64_t id, std::vector<std::shared_ptr<torch::nn::Module>> modules, DeviceMesh mesh,
            std::vector<detail::ParamGroup> groups, const FullyShardOptions& options);

  // What the unit is, fixed by fully_shard: its modules, mesh and parameters.
  const int64_t id;
  std::vector<std::weak_ptr<torch::nn::Module>> modules;
  std::vector<const torch::nn::Module*> module_ptrs;
  DeviceMesh mesh;
  std::vector<detail::ParamGroup> groups;
  // (group, index) of every parameter in module order.
  std::vector<std::pair<size_t, size_t>> param_order;
  int64_t grads_expected = 0;     // parameters that require a gradient
  bool offloads = false;          // an offload_policy (refuses hpZ)
  bool computes_on_cuda = false;  // a parameter (or the mesh) is on CUDA

  // What the user configures (FullyShardOptions, the FSDPModule setters):
  // the same on every rank, so whatever the hooks decide from it is too.
  struct Settings {
    MixedPrecisionPolicy mp;
    detail::ReshardAfterForwardSetting reshard_after_forward;  // set_reshard_after_forward
    bool reshard_after_backward = true;
    bool requires_gradient_sync = true;
    bool requires_all_reduce = true;
    bool is_last_backward = true;
    bool average = true;
    std::optional<double> scaling_factor;
    std::vector<std::weak_ptr<UnitState>> forward_prefetch;
    bool explicit_forward_prefetch = false;
    std::vector<std::weak_ptr<UnitState>> backward_prefetch;
    bool explicit_backward_prefetch = false;
    bool implicit_backward_prefetch = true;  // FullyShardOptions' (resolved)
    bool unshard_in_backward = true;
  } settings;

  // Where the unit is in the current pass: reset by the root at the end of
  // backward and after a pass that threw, so no pass inherits another's.
  struct Pass {
    detail::UnitLifecycle lifecycle;
    int64_t forward_entries = 0;
    bool in_order = false;  // listed in the root context's order
    std::vector<std::vector<bool>> arrived;  // [group][param]: gradient arrived
    int64_t grads_ready = 0;
    bool reduce_prepared = false;
  } pass;

  // Neighbours in the root context's order, so that the implicit prefetches
  // find theirs in O(1): the unit before this one in this pass (backward
  // prefetches it), and the one after it in the last recorded pass (forward
  // prefetches it; valid while successor_generation is the context's
  // order_generation). They outlive a pass: the next one reads them.
  struct Neighbours {
    std::weak_ptr<UnitState> forward_predecessor;
    std::weak_ptr<UnitState> forward_successor;
    uint64_t successor_generation = 0;
  } neighbours;

  bool alive() const;
  // Whether `other`'s modules lie inside this unit's modules.
  bool contains(const UnitState& other) const;
  // Units nested in this one (itself included), for recurse=true setters.
  std::vector<std::shared_ptr<UnitState>> self_and_nested();
  // "block0", "head.0+head.1" (paths inside the root, or the module type):
  // for traces. Cached per unit set.
  std::string label();
  // Hands label() to the trace registry (which the watchdog reads) once per
  // change of the unit set, not on every hook.
  void register_label();
  // label() and the unit id, "block0 #2": for error messages.
  std::string error_label();
  // lifecycle.transition, naming this unit if it throws.
  void transition(detail::Lifecycle to, const char* why);
  // The step context of this unit's root (cached per unit set).
  detail::RootContext& context();
  std::shared_ptr<UnitState> root();
  bool is_root();
  // Sets settings.reshard_after_forward to `v`, whose per-group counts
  // resolve_post_forward_ranks checked (post_forward.h): creates the
  // post-forward groups (collective the first time) and drops the pieces the
  // previous setting kept.
  void set_reshard_after_forward(ReshardAfterForward v, const std::vector<int>& ranks);
  // reshard_after_forward resolved for this unit and the current grad mode.
  bool reshards_after_forward();
  bool unsharded() const;

  void unshard(bool async_op);
  void wait_unshard();
  void reshard();
  // What post_forward does when the unit reshards: each group reshards to
  // its post-forward group (hpZ) or fully.
  void reshard_after_forward();

  void pre_forward();
  at::Tensor cast_input(const at::Tensor& t) const;
  at::Tensor finish_output(const at::Tensor& t);
  void post_forward();
  void pre_backward();
  void on_grad_ready(size_t group, size_t index);
  void post_backward();
  // Whether this unit reduces gradients in a synchronised backward (a
  // setting, the same on every rank, never a property of the data).
  bool reduces() const;
  detail::ReduceSettings reduce_settings() const;
  void finish_reductions();
  // Every issued reduction has finished (finish_reductions would not wait).
  bool reductions_complete() const;

 private:
  std::shared_ptr<detail::RootContext> own_context_;  // when this unit is a root
  std::weak_ptr<detail::RootContext> context_;
  uint64_t context_generation_ = ~uint64_t{0};
  std::string label_;
  uint64_t label_generation_ = ~uint64_t{0};
  uint64_t registered_label_generation_ = ~uint64_t{0};  // register_label()
  std::weak_ptr<UnitState> root_;
};

}  // namespace fsdp
