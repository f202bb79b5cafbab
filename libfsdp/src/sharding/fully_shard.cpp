// fully_shard(): validates its arguments, plans every parameter's layout
// (sharding/plan.h), then shards the parameters into a new unit and
// registers it.
#include "fsdp/fully_shard.h"

#include "base/shape_str.h"
#include "fsdp/errors.h"
#include "fsdp/runtime.h"
#include "sharding/plan.h"
#include "sharding/post_forward.h"
#include "sharding/query.h"
#include "sharding/registry.h"
#include "sharding/sequential.h"
#include "sharding/state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {
namespace {

void check_mp_dtype(const std::optional<c10::ScalarType>& t, const char* field) {
  if (t && !at::isFloatingType(*t)) {
    throw ArgumentError("mp_policy", std::string("fully_shard: 'mp_policy.") + field + "' = " +
                                         c10::toString(*t) + "; accepted: a floating dtype");
  }
}

// Each entry of ignored_params / replicate_params must be a parameter. The
// same list may be passed to every fully_shard call of a model (L1-06), so
// an entry outside this unit's modules may belong to another part of the
// model; what is rejected is what can be told here not to be one: an
// undefined tensor; a view or copy of a parameter of these modules (its
// detach(), data(), a slice) rather than the parameter itself, which was
// silently sharded; a tensor computed by an operation (a grad_fn); a
// tensor outside these modules that requires no gradient (a plain tensor;
// a frozen parameter elsewhere belongs in the list of the call whose module
// holds it); and a parameter another unit already shards (ignoring or
// replicating it here would change nothing).
void check_param_list(const char* argument, const std::vector<at::Tensor>& list,
                      const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  if (list.empty()) return;
  std::unordered_set<const c10::TensorImpl*> in_modules;
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (const auto& item : modules[mi]->named_parameters(/*recurse=*/true)) {
      in_modules.insert(item.value().unsafeGetTensorImpl());
      params.emplace_back(prefix + item.key(), item.value());
    }
  }
  const auto managed = detail::managed_grads();
  const bool ignoring = std::string(argument) == "ignored_params";
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    const std::string which = "fully_shard: '" + std::string(argument) + "'[" +
                              std::to_string(i) + "]";
    const std::string accepted =
        "; accepted: parameters of 'module' (the tensors module->parameters() lists), or of "
        "another part of the model when the same list is passed to every fully_shard call";
    if (!t.defined()) throw ArgumentError(argument, which + " is an undefined tensor" + accepted);
    const std::string shape = " (shape " + shape_str(t.sizes()) + ")";
    if (auto it = managed.find(t.unsafeGetTensorImpl()); it != managed.end()) {
      bool sharded = false;
      for (const auto& p : it->second.placements) {
        sharded = sharded || p.is_shard() || p.is_strided_shard();
      }
      if (ignoring || sharded) {
        throw ArgumentError(argument, which + shape + " is parameter '" + it->second.name +
                                          "' of another unit, which already " +
                                          (sharded ? "shards" : "manages") +
                                          " it; list it in that unit's fully_shard call");
      }
      continue;  // replicated by another unit too: the shared list of L1 models
    }
    if (in_modules.count(t.unsafeGetTensorImpl()) != 0) continue;
    for (const auto& [name, p] : params) {
      if (t.is_alias_of(p)) {
        throw ArgumentError(argument, which + shape + " shares storage with parameter '" + name +
                                          "' but is another tensor (a detach(), data() or "
                                          "slice of it); pass the parameter itself" + accepted);
      }
    }
    if (t.grad_fn()) {
      throw ArgumentError(argument, which + shape + " is computed by an operation (it has a "
                                        "grad_fn), so it is no parameter" + accepted);
    }
    if (!t.requires_grad()) {
      throw ArgumentError(argument, which + shape + " is not a parameter of 'module' and "
                                        "requires no gradient (a plain tensor)" + accepted);
    }
  }
}

// Each module once, none null, none already sharded.
void check_modules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
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
}

// ignored_params and replicate_params: parameters, in one list or the other.
void check_param_lists(const FullyShardOptions& options,
                       const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  for (const auto& t : options.ignored_params) {
    if (detail::contains_tensor(options.replicate_params, t)) {
      throw ArgumentError("replicate_params",
                          "fully_shard: a parameter is in both 'ignored_params' and "
                          "'replicate_params'; it can be one or the other");
    }
  }
  check_param_list("ignored_params", options.ignored_params, modules);
  check_param_list("replicate_params", options.replicate_params, modules);
}

// options.dtensor_params' index by local tensor (the module's parameter).
std::unordered_map<const c10::TensorImpl*, size_t> index_dtensor_params(
    const FullyShardOptions& options) {
  std::unordered_map<const c10::TensorImpl*, size_t> dtensor_of;
  for (size_t i = 0; i < options.dtensor_params.size(); ++i) {
    const DTensor& dt = options.dtensor_params[i].param;
    if (!dt.defined()) {
      throw ArgumentError("dtensor_params", "fully_shard: 'dtensor_params[" + std::to_string(i) +
                                                "]' is an undefined DTensor");
    }
    dtensor_of[dt.to_local().unsafeGetTensorImpl()] = i;
  }
  return dtensor_of;
}

void check_mp_policy(const MixedPrecisionPolicy& mp) {
  check_mp_dtype(mp.param_dtype, "param_dtype");
  check_mp_dtype(mp.reduce_dtype, "reduce_dtype");
  check_mp_dtype(mp.output_dtype, "output_dtype");
}

// What the plan must account for: every dtensor_params entry, and something
// to manage.
void check_plan(const detail::UnitPlan& plan,
                const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  for (size_t i = 0; i < plan.dtensor_used.size(); ++i) {
    if (!plan.dtensor_used[i]) {
      throw ArgumentError("dtensor_params", "fully_shard: 'dtensor_params[" + std::to_string(i) +
                                                "]' is not a parameter this unit manages (its "
                                                "local tensor must be the module's parameter "
                                                "itself)");
    }
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
  if (plan.params.empty() && !has_nested_units) {
    throw ArgumentError("module", "fully_shard: 'module' has no parameters to manage (none, or "
                                  "all ignored) and no sharded modules inside it");
  }
}

// Shards the planned parameters (pass 2) into their groups, and the groups
// into a new unit.
std::shared_ptr<UnitState> shard_unit(
    detail::UnitPlan plan, const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
    const DeviceMesh& mesh, const FullyShardOptions& options) {
  const bool offload = options.offload_policy.has_value();
  const bool pin = offload && options.offload_policy->pin_memory;
  std::vector<std::vector<detail::ShardedParam>> params(plan.groups.size());
  for (auto& p : plan.params) {
    // A meta parameter (fsdp::MetaInit) computes where the mesh does once
    // materialized.
    const c10::Device device = p.param.is_meta() ? detail::mesh_device(mesh) : p.param.device();
    params[p.group].emplace_back(p.name, p.param, std::move(p.layout), p.dtypes, device, offload,
                                 pin);
    if (p.extension) params[p.group].back().set_extension(p.extension);
  }
  std::vector<detail::ParamGroup> groups;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    groups.emplace_back(std::move(params[g]), plan.groups[g].shard, plan.groups[g].replicate,
                        plan.groups[g].divide_factor, plan.groups[g].fused);
  }
  std::vector<size_t> next_in_group(plan.groups.size(), 0);
  auto unit = std::make_shared<UnitState>(detail::next_unit_id(), modules, mesh, std::move(groups),
                                          options);
  for (const auto& p : plan.params) {
    unit->param_order.emplace_back(p.group, next_in_group[p.group]++);
  }
  std::weak_ptr<UnitState> weak = unit;
  for (auto& g : unit->groups) {
    g.set_owner_label([weak] {
      auto u = weak.lock();
      return u ? u->error_label() : std::string("(destroyed)");
    });
  }
  return unit;
}

}  // namespace

std::vector<FSDPModule> fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                    FullyShardOptions options) {
  if (!Runtime::alive()) throw StateError("fully_shard needs a live fsdp::Runtime");
  check_modules(modules);
  const DeviceMesh mesh = options.mesh ? *options.mesh : detail::default_mesh();
  const detail::FsdpDims unit_dims = detail::fsdp_dims(mesh, options, "mesh", /*strict=*/true);
  check_param_lists(options, modules);
  const auto dtensor_of = index_dtensor_params(options);
  check_mp_policy(options.mp_policy);
  // Pass 1: choose and validate every placement and layout before touching
  // any parameter, so a rejected call leaves the module exactly as it was.
  detail::UnitPlan plan = detail::plan_unit(modules, options, mesh, unit_dims, dtensor_of);
  check_plan(plan, modules);
  std::vector<ProcessGroupPtr> shard_groups;
  for (const auto& g : plan.groups) shard_groups.push_back(g.shard);
  const std::vector<int> post_forward = detail::resolve_post_forward_ranks(
      shard_groups, options.reshard_after_forward, options.offload_policy.has_value(),
      "fully_shard");
  auto unit = shard_unit(std::move(plan), modules, mesh, options);
  unit->set_reshard_after_forward(options.reshard_after_forward, post_forward);
  detail::register_unit(unit);
  for (const auto& m : modules) detail::intercept_sequential_children(*m);
  std::vector<FSDPModule> handles;
  for (size_t i = 0; i < modules.size(); ++i) handles.push_back(FSDPModule(unit, i));
  return handles;
}

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                       FullyShardOptions options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, std::move(options))
      .front();
}

}  // namespace fsdp
