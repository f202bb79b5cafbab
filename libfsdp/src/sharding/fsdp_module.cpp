// The FSDPModule interface: the handle fully_shard returns, its settings
// (applied to the unit, or to it and its nested units), explicit
// unshard/reshard, gradient reduction and state dicts.
#include "fsdp/fully_shard.h"

#include "base/shape_str.h"
#include "fsdp/errors.h"
#include "sharding/post_forward.h"
#include "sharding/registry.h"
#include "sharding/root_pass.h"
#include "sharding/state.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace fsdp {
namespace {

// In module order (as named_parameters() lists them), across groups.
template <typename Fn>
void for_params(UnitState& u, Fn fn) {
  for (const auto& [g, i] : u.param_order) fn(u.groups[g].params()[i]);
}

}  // namespace

std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module) {
  auto unit = detail::unit_for_module(module);
  if (!unit) return std::nullopt;
  for (size_t i = 0; i < unit->module_ptrs.size(); ++i) {
    if (unit->module_ptrs[i] == &module) return FSDPModule(unit, i);
  }
  return std::nullopt;
}

void UnshardHandle::wait() {
  if (unit_) unit_->wait_unshard();
}

UnitState& FSDPModule::unit() const {
  if (!unit_ || !unit_->alive()) {
    throw StateError("FSDPModule: this handle refers to no sharded module (obtain one from "
                     "fsdp::fully_shard or fsdp::fsdp_module_of)");
  }
  return *unit_;
}

std::shared_ptr<torch::nn::Module> FSDPModule::module() const {
  return unit().modules.at(module_index_).lock();
}

namespace {
template <typename Fn>
void for_units(UnitState& unit, bool recurse, Fn fn) {
  if (!recurse) {
    fn(unit);
    return;
  }
  for (auto& u : unit.self_and_nested()) fn(*u);
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool v, bool recurse) {
  for_units(unit(), recurse, [v](UnitState& u) { u.settings.requires_gradient_sync = v; });
}
void FSDPModule::set_requires_all_reduce(bool v, bool recurse) {
  for_units(unit(), recurse, [v](UnitState& u) { u.settings.requires_all_reduce = v; });
}
void FSDPModule::set_reshard_after_forward(ReshardAfterForward v, bool recurse) {
  // Every unit's form is checked before any changes.
  std::vector<std::pair<UnitState*, std::vector<int>>> resolved;
  for_units(unit(), recurse, [&](UnitState& u) {
    std::vector<ProcessGroupPtr> shard_groups;
    for (const auto& g : u.groups) shard_groups.push_back(g.shard_group());
    resolved.emplace_back(&u, detail::resolve_post_forward_ranks(shard_groups, v, u.offloads,
                                                                 "set_reshard_after_forward"));
  });
  for (auto& [u, ranks] : resolved) u->set_reshard_after_forward(v, ranks);
}
void FSDPModule::set_reshard_after_backward(bool v, bool recurse) {
  for_units(unit(), recurse, [v](UnitState& u) { u.settings.reshard_after_backward = v; });
}

void FSDPModule::set_reduce_op_type(const std::string& reduce_op) {
  if (reduce_op != "sum" && reduce_op != "avg") {
    throw ArgumentError("reduce_op", "set_reduce_op_type: 'reduce_op' = \"" + reduce_op +
                                         "\"; accepted: \"sum\", \"avg\"");
  }
  const bool average = reduce_op == "avg";
  for_units(unit(), true, [average](UnitState& u) { u.settings.average = average; });
}

namespace {
void check_factor(const char* fn, const std::optional<double>& factor) {
  if (factor && (!std::isfinite(*factor) || *factor <= 0)) {
    throw ArgumentError("factor", std::string(fn) + ": 'factor' = " + std::to_string(*factor) +
                                      "; accepted: a finite number > 0, or none");
  }
}
}  // namespace

void FSDPModule::set_gradient_scaling_factor(std::optional<double> factor) {
  check_factor("set_gradient_scaling_factor", factor);
  for_units(unit(), true, [factor](UnitState& u) { u.settings.scaling_factor = factor; });
}

void FSDPModule::set_gradient_divide_factor(std::optional<double> factor) {
  check_factor("set_gradient_divide_factor", factor);
  for_units(unit(), true, [factor](UnitState& u) {
    for (auto& g : u.groups) g.set_divide_factor(factor);
  });
}

void FSDPModule::set_is_last_backward(bool v) {
  for_units(unit(), true, [v](UnitState& u) { u.settings.is_last_backward = v; });
}

std::vector<std::weak_ptr<UnitState>> FSDPModule::prefetch_units(
    const std::vector<FSDPModule>& modules, const char* fn) {
  std::vector<std::weak_ptr<UnitState>> out;
  for (size_t i = 0; i < modules.size(); ++i) {
    if (!modules[i].unit_ || !modules[i].unit_->alive()) {
      throw ArgumentError("modules", std::string(fn) + ": 'modules'[" + std::to_string(i) +
                                         "] is not a sharded module; pass FSDPModules "
                                         "returned by fully_shard");
    }
    out.push_back(modules[i].unit_);
  }
  return out;
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  auto list = prefetch_units(modules, "set_modules_to_forward_prefetch");
  unit().settings.forward_prefetch = std::move(list);
  unit().settings.explicit_forward_prefetch = true;
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  auto list = prefetch_units(modules, "set_modules_to_backward_prefetch");
  unit().settings.backward_prefetch = std::move(list);
  unit().settings.explicit_backward_prefetch = true;
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  unit().settings.unshard_in_backward = unshard_in_backward;
}

void FSDPModule::set_post_optim_event(std::shared_ptr<c10::Event> event) {
  UnitState& u = unit();
  if (!event) {
    throw ArgumentError("event", "set_post_optim_event: 'event' is null; accepted: an event "
                                 "recorded after the optimizer step");
  }
  const c10::DeviceType unit_type = u.computes_on_cuda ? c10::kCUDA : u.mesh.device_type();
  if (event->device_type() != unit_type) {
    throw ArgumentError("event", std::string("set_post_optim_event: 'event' is a ") +
                                     c10::DeviceTypeName(event->device_type(), true) +
                                     " event but unit " + u.error_label() + " computes on " +
                                     c10::DeviceTypeName(unit_type, true) +
                                     "; accepted: an event of the unit's device type");
  }
  // CPU: collectives are issued in program order, after the optimizer step
  // returned -- nothing to wait for (fully_shard.h).
  if (unit_type != c10::kCUDA) return;
  u.root()->context().post_optim_event = std::move(event);
}

void FSDPModule::set_all_reduce_hook(AllReduceHook hook) {
  auto shared = hook ? std::make_shared<const AllReduceHook>(std::move(hook)) : nullptr;
  for (auto& g : unit().groups) g.set_all_reduce_hook(shared);
}

namespace {
// Custom collectives replace the buffers the unit gathers into: only
// between unshards.
void require_resharded(UnitState& u, const char* fn) {
  for (const auto& g : u.groups) {
    if (g.unsharded() || g.gather_in_flight()) {
      throw StateError(std::string(fn) + ": unit " + u.error_label() +
                       " is unsharded (or its all-gather is in flight); call it between steps, "
                       "or after reshard()");
    }
  }
}
}  // namespace

void FSDPModule::set_custom_all_gather(std::optional<CustomAllGather> comm) {
  UnitState& u = unit();
  if (comm && !comm->all_gather) {
    throw ArgumentError("all_gather", "set_custom_all_gather: 'all_gather' is empty; accepted: "
                                      "a function running the all-gather (allocate may be empty)");
  }
  require_resharded(u, "set_custom_all_gather");
  auto shared = comm ? std::make_shared<const CustomAllGather>(std::move(*comm)) : nullptr;
  for (auto& g : u.groups) g.set_custom_all_gather(shared);
}

void FSDPModule::set_custom_reduce_scatter(std::optional<CustomReduceScatter> comm) {
  UnitState& u = unit();
  if (comm && !comm->reduce_scatter) {
    throw ArgumentError("reduce_scatter", "set_custom_reduce_scatter: 'reduce_scatter' is empty; "
                                          "accepted: a function running the reduce-scatter "
                                          "(allocate may be empty)");
  }
  for (const auto& g : u.groups) {
    if (g.reduce_pending()) {
      throw StateError("set_custom_reduce_scatter: unit " + u.error_label() +
                       " has a reduction in flight; call it between steps");
    }
  }
  auto shared = comm ? std::make_shared<const CustomReduceScatter>(std::move(*comm)) : nullptr;
  for (auto& g : u.groups) g.set_custom_reduce_scatter(shared);
}

namespace detail {
void require_method(bool present) {
  if (!present) {
    throw ArgumentError("method", "Sharded<M>::call: 'method' is a null member function "
                                  "pointer; accepted: &Impl::method of the module's type");
  }
}
}  // namespace detail

UnshardHandle FSDPModule::unshard(bool async_op) {
  unit().unshard(async_op);
  return UnshardHandle(unit_);
}

void FSDPModule::reshard() { unit().reshard(); }

void FSDPModule::zero_grad() {
  for_units(unit(), true, [](UnitState& u) {
    for (auto& g : u.groups) {
      for (auto& p : g.params()) p.zero_grad();
      g.clear_partial_sums();
    }
  });
}

void FSDPModule::finish_pending_reductions() {
  for_units(unit(), true, [](UnitState& u) { u.finish_reductions(); });
}

void FSDPModule::reduce_gradients(bool recurse) {
  std::vector<std::shared_ptr<UnitState>> units{unit().shared_from_this()};
  if (recurse) units = unit().self_and_nested();
  // Unit ids follow fully_shard's calls, the same on every rank: the
  // collectives below go in one order everywhere.
  std::sort(units.begin(), units.end(),
            [](const auto& a, const auto& b) { return a->id > b->id; });
  for (auto& u : units) {
    if (u->pass.lifecycle.state() != detail::Lifecycle::Idle) {
      throw StateError("reduce_gradients: unit " + u->error_label() + " is in " +
                       detail::to_string(u->pass.lifecycle.state()) +
                       "; call it between passes (after backward, before the next forward)");
    }
  }
  for (auto& u : units) u->finish_reductions();  // left in flight by is_last_backward(false)
  for (auto& u : units) {
    // Whether a rank has a gradient is data, not a setting: every group
    // that reduces at all runs its collectives; the presence flags in the
    // buffer tell which parameters some rank had a gradient for.
    for (auto& g : u->groups) {
      if (g.reduces()) g.prepare_reduce(u->reduce_settings());
    }
  }
  for (auto& u : units) {
    for (auto& g : u->groups) g.issue_reduce();
  }
  for (auto& u : units) {
    for (auto& g : u->groups) {
      g.finish_reduce();
      for (auto& p : g.params()) p.commit_pass(/*reduced=*/true);
    }
    u->reshard();
  }
}

std::vector<std::pair<std::string, DTensor>> FSDPModule::sharded_parameters() const {
  std::vector<std::pair<std::string, DTensor>> out;
  for_params(unit(),
             [&out](const detail::ShardedParam& p) { out.emplace_back(p.name(), p.dtensor()); });
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::unsynced_grads() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_params(unit(), [&out](const detail::ShardedParam& p) {
    out.emplace_back(p.name(), p.unsynced_grad());
  });
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::main_grads() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_params(unit(), [&out](const detail::ShardedParam& p) {
    out.emplace_back(p.name(), p.main_grad());
  });
  return out;
}

std::vector<std::pair<std::string, DTensor>> FSDPModule::state_dict() const {
  return sharded_parameters();
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::full_state_dict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, dt] : sharded_parameters()) out.emplace_back(name, dt.full_tensor());
  return out;
}

namespace {
detail::ShardedParam& param_named(UnitState& u, const std::string& name) {
  for (auto& g : u.groups) {
    for (auto& p : g.params()) {
      if (p.name() == name) return p;
    }
  }
  throw ArgumentError("state", "load_state_dict: 'state' has '" + name +
                                   "', which is not a parameter of this unit");
}
}  // namespace

void FSDPModule::load_state_dict(const std::vector<std::pair<std::string, DTensor>>& state) {
  UnitState& u = unit();
  for (const auto& [name, dt] : state) {
    auto& p = param_named(u, name);
    if (!dt.defined()) {
      throw ArgumentError("state", "load_state_dict: 'state' entry '" + name +
                                       "' is an undefined DTensor");
    }
    // Placements are read on the entry's own mesh: on another one (other
    // ranks, or another shape) equal placements meant other rows, and the
    // values loaded were wrong.
    const DeviceMesh& own = *p.layout().spmd_mesh;
    const DeviceMesh& theirs = dt.device_mesh();
    if (theirs.device_type() != own.device_type() || theirs.shape() != own.shape() ||
        theirs.world_ranks() != own.world_ranks()) {
      throw MeshError("state", "load_state_dict: 'state' entry '" + name + "' is a DTensor on " +
                                   theirs.to_string() + ", but the unit's parameter lives on " +
                                   own.to_string() + "; accepted: a DTensor on the same ranks "
                                   "(same device type and shape), or a tensor of the local or "
                                   "global shape");
    }
    const auto& placements = p.layout().spmd_placements;
    if (dt.shape() != p.layout().global_shape) {
      throw ShapeError("state", "load_state_dict: 'state' entry '" + name + "' has global shape " +
                                    shape_str(dt.shape()) + "; expected " +
                                    shape_str(p.layout().global_shape));
    }
    p.load_local(dt.placements() == placements ? dt.to_local()
                                               : dt.redistribute(placements).to_local());
  }
}

void FSDPModule::load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  UnitState& u = unit();
  for (const auto& [name, t] : state) {
    auto& p = param_named(u, name);
    if (t.sizes() == p.local().sizes()) {
      p.load_local(t);
    } else if (t.sizes().vec() == p.layout().global_shape) {
      p.load_local(distribute_tensor(t, *p.layout().spmd_mesh, p.layout().spmd_placements)
                       .to_local());
    } else {
      throw ShapeError("state", "load_state_dict: 'state' entry '" + name + "' has shape " +
                                    shape_str(t.sizes()) + "; accepted: the local shard shape " +
                                    shape_str(p.local().sizes()) + " or the global shape " +
                                    shape_str(p.layout().global_shape));
    }
  }
}

const DeviceMesh& FSDPModule::mesh() const { return unit().mesh; }

bool FSDPModule::is_root() const { return unit().is_root(); }

}  // namespace fsdp
