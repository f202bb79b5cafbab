// The narrow interface of fully_shard for activation checkpointing and
// gradient clipping.
#include "sharding/query.h"

#include "base/torch_compat.h"
#include "sharding/registry.h"
#include "sharding/state.h"

#include <torch/csrc/autograd/variable.h>

#include <unordered_set>

namespace fsdp::detail {

std::vector<UnitRef> unshard_for_grad_edges(const std::vector<at::Tensor>& params) {
  std::unordered_set<const c10::TensorImpl*> wanted;
  for (const auto& p : params) wanted.insert(p.unsafeGetTensorImpl());
  std::vector<UnitRef> unsharded;
  for (auto& unit : live_units()) {
    bool needed = false;
    for (const auto& g : unit->groups) {
      if (g.unsharded()) continue;
      for (const auto& p : g.params()) {
        if (!p.requires_grad() || wanted.count(p.param().unsafeGetTensorImpl()) == 0) continue;
        auto node = torch::autograd::impl::try_get_grad_accumulator(p.param());
        if (!node || !compat::node_accepts(*node, p.full_shape(), p.compute_dtype())) {
          needed = true;
        }
      }
    }
    if (!needed) continue;
    unit->unshard(/*async_op=*/false);
    unsharded.push_back(unit);
  }
  return unsharded;
}

void reshard_as_after_forward(const std::vector<UnitRef>& units) {
  for (const auto& unit : units) {
    if (unit->unsharded() && unit->reshards_after_forward()) unit->reshard();
  }
}

std::optional<std::vector<at::Tensor>> unit_module_parameters(const torch::nn::Module& module) {
  const auto unit = unit_for_module(module);
  if (!unit) return std::nullopt;
  std::vector<at::Tensor> out;
  for (const auto& weak : unit->modules) {
    if (auto m = weak.lock()) {
      for (const auto& p : m->parameters(/*recurse=*/true)) out.push_back(p);
    }
  }
  return out;
}

std::unordered_map<const c10::TensorImpl*, ManagedGrad> managed_grads() {
  std::unordered_map<const c10::TensorImpl*, ManagedGrad> out;
  const auto units = live_units();
  for (const auto& unit : units) unit->finish_reductions();
  for (const auto& unit : units) {
    for (const auto& g : unit->groups) {
      for (const auto& p : g.params()) {
        ManagedGrad m;
        m.name = p.name();
        m.requires_grad = p.requires_grad();
        m.unsharded = g.unsharded();
        m.split_groups = p.layout().split_groups;
        m.mesh = p.layout().spmd_mesh;
        m.placements = p.layout().spmd_placements;
        out[p.param().unsafeGetTensorImpl()] = std::move(m);
      }
    }
  }
  return out;
}

std::unordered_map<const c10::TensorImpl*, ManagedShard> managed_shards() {
  std::unordered_map<const c10::TensorImpl*, ManagedShard> out;
  const auto units = live_units();
  for (const auto& unit : units) unit->finish_reductions();
  for (const auto& unit : units) {
    for (auto& g : unit->groups) {
      for (auto& p : g.params()) {
        ManagedShard m;
        m.name = p.name();
        m.shard = p.dtensor();
        m.unsharded = g.unsharded();
        ShardedParam* param = &p;
        m.load = [unit, param](const at::Tensor& values) { param->load_local(values); };
        out[p.param().unsafeGetTensorImpl()] = std::move(m);
      }
    }
  }
  return out;
}

}  // namespace fsdp::detail
