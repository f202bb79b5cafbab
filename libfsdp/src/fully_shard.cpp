// fully_shard() and the FSDPModule interface: argument validation, unit
// construction, and the user-facing controls.
#include "fsdp/fully_shard.h"

#include "fsdp/errors.h"
#include "fsdp/runtime.h"
#include "fsdp_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>
#include <unordered_set>

namespace fsdp {
namespace {

std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

const DeviceMesh& default_mesh() {
  static std::optional<DeviceMesh> mesh;
  if (!mesh) {
    Runtime& rt = Runtime::get();
    mesh = init_device_mesh(rt.device().type(), {rt.world_size()}, {"shard"});
  }
  return *mesh;
}

bool contains_tensor(const std::vector<at::Tensor>& list, const at::Tensor& t) {
  for (const auto& x : list) {
    if (x.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
  }
  return false;
}

void check_mp_dtype(const std::optional<c10::ScalarType>& t, const char* field) {
  if (t && !at::isFloatingType(*t)) {
    throw ArgumentError("mp_policy", std::string("fully_shard: 'mp_policy.") + field + "' = " +
                                         c10::toString(*t) + "; accepted: a floating dtype");
  }
}

Placement placement_for(const std::string& name, const at::Tensor& param,
                        const FullyShardOptions& options, int64_t shard_size) {
  if (contains_tensor(options.replicate_params, param) || param.dim() == 0) {
    return Placement::Replicate();
  }
  std::optional<Placement> chosen;
  if (options.shard_placement_fn) chosen = options.shard_placement_fn(name, param);
  if (!chosen) return Placement::Shard(0);
  if (chosen->is_replicate()) return *chosen;
  if (!chosen->is_shard()) {
    throw ArgumentError("shard_placement_fn", "fully_shard: 'shard_placement_fn' returned " +
                                                  chosen->to_string() + " for '" + name +
                                                  "'; accepted: Shard(d), Replicate() or none");
  }
  int64_t d = chosen->dim();
  if (d < -param.dim() || d >= param.dim()) {
    throw ArgumentError("shard_placement_fn",
                        "fully_shard: 'shard_placement_fn' returned Shard(" + std::to_string(d) +
                            ") for '" + name + "' of shape " + shape_str(param.sizes()) +
                            "; the dim must be in [" + std::to_string(-param.dim()) + ", " +
                            std::to_string(param.dim()) + ")");
  }
  if (d < 0) d += param.dim();
  if (d != 0 && param.size(d) % shard_size != 0) {
    throw ShapeError("shard_placement_fn",
                     "fully_shard: 'shard_placement_fn' returned Shard(" + std::to_string(d) +
                         ") for '" + name + "' of shape " + shape_str(param.sizes()) +
                         ", but dim " + std::to_string(d) + " (" +
                         std::to_string(param.size(d)) + ") is not divisible by the shard group "
                         "size " + std::to_string(shard_size) +
                         "; only dim 0 may be sharded unevenly");
  }
  return Placement::Shard(d);
}

// A module's parameters for its unit: the subtrees of modules that are
// already units (and whatever they ignored) belong to those units.
std::vector<std::pair<std::string, at::Tensor>> unit_parameters(const torch::nn::Module& module,
                                                                const std::string& prefix) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& child : module.named_children()) {
    if (detail::unit_for_module(*child.value())) continue;
    auto nested = unit_parameters(*child.value(), prefix + child.key() + ".");
    out.insert(out.end(), nested.begin(), nested.end());
  }
  return out;
}

std::vector<Placement> dtensor_placements(const UnitState& unit, const Placement& p) {
  std::vector<Placement> out;
  if (unit.mesh.ndim() == 2) out.push_back(Placement::Replicate());
  out.push_back(p);
  return out;
}

}  // namespace

std::vector<FSDPModule> fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                    FullyShardOptions options) {
  if (!Runtime::alive()) throw StateError("fully_shard needs a live fsdp::Runtime");
  if (modules.empty()) throw ArgumentError("module", "fully_shard: 'module' list is empty");
  std::set<const torch::nn::Module*> seen_modules;
  for (const auto& m : modules) {
    if (!m) throw ArgumentError("module", "fully_shard: 'module' is null");
    if (detail::unit_for_module(*m)) {
      throw ArgumentError("module", "fully_shard: 'module' (" + m->name() +
                                        ") is already sharded; apply fully_shard once per module");
    }
    if (!seen_modules.insert(m.get()).second) {
      throw ArgumentError("module", "fully_shard: 'module' list holds " + m->name() + " twice");
    }
  }
  const DeviceMesh mesh = options.mesh ? *options.mesh : default_mesh();
  if (mesh.ndim() < 1 || mesh.ndim() > 2) {
    throw MeshError("mesh", "fully_shard: 'mesh' is " + mesh.to_string() +
                                "; accepted: 1-D (FSDP) or 2-D (replicate, shard) for HSDP");
  }
  for (const auto& t : options.ignored_params) {
    if (contains_tensor(options.replicate_params, t)) {
      throw ArgumentError("replicate_params",
                          "fully_shard: a parameter is in both 'ignored_params' and "
                          "'replicate_params'; it can be one or the other");
    }
  }
  check_mp_dtype(options.mp_policy.param_dtype, "param_dtype");
  check_mp_dtype(options.mp_policy.reduce_dtype, "reduce_dtype");
  check_mp_dtype(options.mp_policy.output_dtype, "output_dtype");

  auto shard_group = mesh.get_group(mesh.ndim() - 1);
  auto replicate_group = mesh.ndim() == 2 ? mesh.get_group(0) : nullptr;
  const bool offload = options.offload_policy.has_value();
  const bool pin = offload && options.offload_policy->pin_memory;

  // Pass 1: choose and validate every placement before touching any
  // parameter, so a rejected call leaves the module exactly as it was.
  struct Planned {
    std::string name;
    at::Tensor param;
    Placement placement;
    detail::UnitDtypes dtypes;
  };
  std::vector<Planned> planned;
  std::unordered_set<const c10::TensorImpl*> taken;
  std::optional<c10::ScalarType> fused_dtype;
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (auto& [name, param] : unit_parameters(*modules[mi], prefix)) {
      if (!taken.insert(param.unsafeGetTensorImpl()).second) continue;  // tied weights
      if (contains_tensor(options.ignored_params, param)) continue;
      if (detail::is_managed(param)) {
        // Nested units' subtrees are skipped, so this one is shared with them.
        throw ArgumentError("module", "fully_shard: parameter '" + name +
                                          "' is tied to a parameter of another unit; tied "
                                          "weights must live in one unit (shard the modules "
                                          "that share it together)");
      }
      const Placement placement = placement_for(name, param, options, shard_group->size());
      detail::UnitDtypes dtypes;
      if (param.is_floating_point()) {
        dtypes.param = options.mp_policy.param_dtype;
        dtypes.reduce = options.mp_policy.reduce_dtype;
      }
      const auto compute_dtype = dtypes.param.value_or(param.scalar_type());
      if (options.comm_fusion && placement.is_shard()) {
        if (fused_dtype && *fused_dtype != compute_dtype) {
          throw ArgumentError("comm_fusion",
                              "fully_shard: 'comm_fusion' needs one compute dtype per unit, but '" +
                                  name + "' computes in " + c10::toString(compute_dtype) +
                                  " and another parameter in " + c10::toString(*fused_dtype));
        }
        fused_dtype = compute_dtype;
      }
      planned.push_back({name, param, placement, dtypes});
    }
  }
  // Pass 2: shard.
  std::vector<detail::ShardedParam> params;
  for (auto& p : planned) {
    params.emplace_back(p.name, p.param, p.placement, shard_group->size(), shard_group->rank(),
                        p.dtypes, p.param.device(), offload, pin);
  }
  // A root whose parameters all live in nested units is fine (it still runs
  // the root logic); a module with nothing to manage at all is a mistake.
  const bool has_nested_units = std::any_of(
      modules.begin(), modules.end(), [](const std::shared_ptr<torch::nn::Module>& m) {
        for (const auto& d : m->modules(/*include_self=*/false)) {
          if (detail::unit_for_module(*d)) return true;
        }
        return false;
      });
  if (params.empty() && !has_nested_units) {
    throw ArgumentError("module", "fully_shard: 'module' has no parameters to manage (none, or "
                                  "all ignored) and no sharded modules inside it");
  }
  detail::ParamGroup group(std::move(params), shard_group, replicate_group, options.comm_fusion);
  auto unit = std::make_shared<UnitState>(detail::next_unit_id(), modules, mesh, std::move(group),
                                          options);
  detail::register_unit(unit);
  for (const auto& m : modules) detail::intercept_sequential_children(*m);
  std::vector<FSDPModule> handles;
  for (size_t i = 0; i < modules.size(); ++i) handles.push_back(FSDPModule(unit, i));
  return handles;
}

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, std::move(options))
      .front();
}

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
  for_units(unit(), recurse, [v](UnitState& u) { u.requires_gradient_sync = v; });
}
void FSDPModule::set_requires_all_reduce(bool v, bool recurse) {
  for_units(unit(), recurse, [v](UnitState& u) { u.requires_all_reduce = v; });
}
void FSDPModule::set_reshard_after_forward(bool v, bool recurse) {
  for_units(unit(), recurse, [v](UnitState& u) { u.reshard_after_forward = v; });
}
void FSDPModule::set_reshard_after_backward(bool v, bool recurse) {
  for_units(unit(), recurse, [v](UnitState& u) { u.reshard_after_backward = v; });
}

void FSDPModule::set_reduce_op_type(const std::string& reduce_op) {
  if (reduce_op != "sum" && reduce_op != "avg") {
    throw ArgumentError("reduce_op", "set_reduce_op_type: 'reduce_op' = \"" + reduce_op +
                                         "\"; accepted: \"sum\", \"avg\"");
  }
  const bool average = reduce_op == "avg";
  for_units(unit(), true, [average](UnitState& u) { u.average = average; });
}

void FSDPModule::set_gradient_scaling_factor(std::optional<double> factor) {
  if (factor && (!std::isfinite(*factor) || *factor <= 0)) {
    throw ArgumentError("factor", "set_gradient_scaling_factor: 'factor' = " +
                                      std::to_string(*factor) +
                                      "; accepted: a finite number > 0, or none");
  }
  for_units(unit(), true, [factor](UnitState& u) { u.scaling_factor = factor; });
}

void FSDPModule::set_is_last_backward(bool v) {
  for_units(unit(), true, [v](UnitState& u) { u.is_last_backward = v; });
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
  unit().forward_prefetch = std::move(list);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  auto list = prefetch_units(modules, "set_modules_to_backward_prefetch");
  unit().backward_prefetch = std::move(list);
  unit().explicit_backward_prefetch = true;
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  unit().unshard(async_op);
  return UnshardHandle(unit_);
}

void FSDPModule::reshard() { unit().reshard(); }

void FSDPModule::zero_grad() {
  for_units(unit(), true, [](UnitState& u) {
    for (auto& p : u.group.params()) p.zero_grad();
    u.group.clear_partial_sums();
  });
}

void FSDPModule::finish_pending_reductions() {
  for_units(unit(), true, [](UnitState& u) { u.group.finish_reduce(); });
}

std::vector<std::pair<std::string, DTensor>> FSDPModule::sharded_parameters() const {
  UnitState& u = unit();
  std::vector<std::pair<std::string, DTensor>> out;
  for (const auto& p : u.group.params()) {
    out.emplace_back(p.name(), DTensor::from_local(p.local(), u.mesh,
                                                   dtensor_placements(u, p.placement()),
                                                   p.full_shape()));
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::unsynced_grads() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : unit().group.params()) out.emplace_back(p.name(), p.unsharded_grad());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::main_grads() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : unit().group.params()) out.emplace_back(p.name(), p.main_grad());
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
  for (auto& p : u.group.params()) {
    if (p.name() == name) return p;
  }
  throw ArgumentError("state", "load_state_dict: 'state' has '" + name +
                                   "', which is not a parameter of this unit");
}
}  // namespace

void FSDPModule::load_state_dict(const std::vector<std::pair<std::string, DTensor>>& state) {
  UnitState& u = unit();
  for (const auto& [name, dt] : state) {
    auto& p = param_named(u, name);
    const auto placements = dtensor_placements(u, p.placement());
    if (dt.shape() != p.full_shape()) {
      throw ShapeError("state", "load_state_dict: 'state' entry '" + name + "' has global shape " +
                                    shape_str(dt.shape()) + "; expected " +
                                    shape_str(p.full_shape()));
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
    } else if (t.sizes().vec() == p.full_shape()) {
      p.load_local(distribute_tensor(t, u.mesh, dtensor_placements(u, p.placement())).to_local());
    } else {
      throw ShapeError("state", "load_state_dict: 'state' entry '" + name + "' has shape " +
                                    shape_str(t.sizes()) + "; accepted: the local shard shape " +
                                    shape_str(p.local().sizes()) + " or the global shape " +
                                    shape_str(p.full_shape()));
    }
  }
}

const DeviceMesh& FSDPModule::mesh() const { return unit().mesh; }

bool FSDPModule::is_root() const { return detail::is_root(unit()); }

}  // namespace fsdp
