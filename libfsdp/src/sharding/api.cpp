// fully_shard() and the FSDPModule interface: argument validation, the
// layout of every parameter on its mesh, unit construction, and the
// user-facing controls.
#include "fsdp/fully_shard.h"

#include "fsdp/errors.h"
#include "fsdp/runtime.h"
#include "sharding/query.h"
#include "sharding/registry.h"
#include "sharding/sequential.h"
#include "sharding/state.h"
#include "base/shape_str.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {
namespace {

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

bool has_dim(const DeviceMesh& mesh, const std::string& name) {
  const auto& n = mesh.dim_names();
  return std::find(n.begin(), n.end(), name) != n.end();
}

// FSDP's dims of a mesh: the shard dim, the replicate dim (-1: none); the
// others are carried through. `argument` names the mesh in errors; `strict`:
// dims named in the options must exist (the unit's mesh) rather than fall
// back to the positional defaults (a per-parameter mesh).
struct FsdpDims {
  int shard = 0;
  int replicate = -1;
};

FsdpDims fsdp_dims(const DeviceMesh& mesh, const FullyShardOptions& o, const char* argument,
                   bool strict) {
  const bool named_shard = o.shard_dim && has_dim(mesh, *o.shard_dim);
  const bool named_rep = o.replicate_dim && has_dim(mesh, *o.replicate_dim);
  if (strict && o.shard_dim && !named_shard) {
    throw MeshError("shard_dim", "fully_shard: 'shard_dim' = '" + *o.shard_dim +
                                     "' is not a dim of " + mesh.to_string());
  }
  if (strict && o.replicate_dim && !named_rep) {
    throw MeshError("replicate_dim", "fully_shard: 'replicate_dim' = '" + *o.replicate_dim +
                                         "' is not a dim of " + mesh.to_string());
  }
  // A per-parameter mesh (experts' (replicate, efsdp)) need not have the
  // unit's shard dim: naming only its replicate dim then falls back to the
  // positional default instead of asking for a shard dim it cannot have.
  const bool by_name = named_shard || (named_rep && (strict || has_dim(mesh, "shard")));
  FsdpDims d;
  if (by_name) {
    if (named_shard) {
      d.shard = mesh.dim_index(*o.shard_dim);
    } else if (has_dim(mesh, "shard")) {
      d.shard = mesh.dim_index("shard");
    } else {
      throw MeshError(argument, "fully_shard: '" + std::string(argument) + "' is " +
                                    mesh.to_string() + "; with 'replicate_dim' set, name the "
                                    "shard dim too ('shard_dim')");
    }
    if (named_rep) {
      d.replicate = mesh.dim_index(*o.replicate_dim);
    } else if (has_dim(mesh, "replicate") && mesh.dim_index("replicate") != d.shard) {
      d.replicate = mesh.dim_index("replicate");
    }
  } else if (mesh.ndim() == 1) {
    d.shard = 0;
  } else if (mesh.ndim() == 2 && !has_dim(mesh, "shard")) {
    d.shard = 1;
    d.replicate = 0;
  } else if (has_dim(mesh, "shard")) {
    d.shard = mesh.dim_index("shard");
    if (has_dim(mesh, "replicate")) d.replicate = mesh.dim_index("replicate");
  } else {
    throw MeshError(argument, "fully_shard: '" + std::string(argument) + "' is " +
                                  mesh.to_string() + "; accepted: 1-D (FSDP), 2-D (replicate, "
                                  "shard) for HSDP, or any mesh with 'shard_dim' (and "
                                  "'replicate_dim') naming FSDP's dims");
  }
  if (d.replicate == d.shard) {
    throw MeshError("replicate_dim", "fully_shard: 'replicate_dim' and 'shard_dim' name the same "
                                     "dim of " + mesh.to_string());
  }
  return d;
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

// FSDP's placement of one parameter (on the tensor the module computes with)
// and the mesh it is sharded on.
struct Choice {
  Placement placement = Placement::Shard(0);
  std::optional<DeviceMesh> mesh;
  std::optional<double> divide_factor;
};

Choice choose(const std::string& name, const at::Tensor& param, const FullyShardOptions& options,
              const DeviceMesh& unit_mesh) {
  Choice c;
  if (contains_tensor(options.replicate_params, param) || param.dim() == 0) {
    c.placement = Placement::Replicate();
    return c;
  }
  std::optional<ShardPlacementResult> chosen;
  if (options.shard_placement_fn) chosen = options.shard_placement_fn(name, param);
  if (!chosen) return c;
  c.mesh = chosen->mesh;
  c.divide_factor = chosen->gradient_divide_factor;
  if (c.divide_factor && (!std::isfinite(*c.divide_factor) || *c.divide_factor <= 0)) {
    throw ArgumentError("shard_placement_fn",
                        "fully_shard: 'shard_placement_fn' returned gradient_divide_factor " +
                            std::to_string(*c.divide_factor) + " for '" + name +
                            "'; accepted: a finite number > 0, or none");
  }
  const Placement& p = chosen->placement;
  if (p.is_replicate()) {
    c.placement = p;
    return c;
  }
  if (!p.is_shard() || p.is_strided_shard()) {
    throw ArgumentError("shard_placement_fn", "fully_shard: 'shard_placement_fn' returned " +
                                                  p.to_string() + " for '" + name +
                                                  "'; accepted: Shard(d), Replicate() or none");
  }
  int64_t d = p.dim();
  if (d < -param.dim() || d >= param.dim()) {
    throw ArgumentError("shard_placement_fn",
                        "fully_shard: 'shard_placement_fn' returned Shard(" + std::to_string(d) +
                            ") for '" + name + "' of shape " + shape_str(param.sizes()) +
                            "; the dim must be in [" + std::to_string(-param.dim()) + ", " +
                            std::to_string(param.dim()) + ")");
  }
  if (d < 0) d += param.dim();
  const DeviceMesh& mesh = c.mesh ? *c.mesh : unit_mesh;
  const int64_t shard_size =
      mesh.size(fsdp_dims(mesh, options, "shard_placement_fn", /*strict=*/!c.mesh).shard);
  if (d != 0 && param.size(d) % shard_size != 0) {
    throw ShapeError("shard_placement_fn",
                     "fully_shard: 'shard_placement_fn' returned Shard(" + std::to_string(d) +
                         ") for '" + name + "' of shape " + shape_str(param.sizes()) +
                         ", but dim " + std::to_string(d) + " (" +
                         std::to_string(param.size(d)) + ") is not divisible by the shard group "
                         "size " + std::to_string(shard_size) +
                         "; only dim 0 may be sharded unevenly");
  }
  c.placement = Placement::Shard(d);
  return c;
}

bool same_ranks(const ProcessGroupPtr& a, const ProcessGroupPtr& b) {
  return a->world_ranks() == b->world_ranks();
}

// The SPMD view of a parameter: FSDP's dims of `mesh` and the carried dims
// (tp, ep), with the DTensor's placements where it has them. "TP first, then
// FSDP inside the TP shard": when a carried dim to the right of the shard
// dim splits the same tensor dim, FSDP's placement is a strided shard.
detail::ParamLayout make_layout(const std::string& name, const at::Tensor& param,
                                const Placement& fsdp, const DeviceMesh& mesh, FsdpDims dims,
                                const DistributedParam* dp, size_t dt_index) {
  const DTensor* dt = dp ? &dp->param : nullptr;
  detail::ParamLayout layout;
  layout.fsdp = fsdp;
  layout.shard_group = mesh.get_group(dims.shard);
  const std::string shard_name = mesh.dim_names()[static_cast<size_t>(dims.shard)];
  std::map<std::string, Placement> by_name;
  for (int i = 0; i < mesh.ndim(); ++i)
    by_name.emplace(mesh.dim_names()[i], Placement::Replicate());
  DeviceMesh spmd = mesh;
  if (dt) {
    const DeviceMesh& tm = dt->device_mesh();
    const std::string which = "dtensor_params[" + std::to_string(dt_index) + "]";
    bool inside = true;
    for (int i = 0; i < tm.ndim(); ++i) {
      const std::string& n = tm.dim_names()[i];
      const bool fsdp_dim = n == shard_name ||
                            (dims.replicate >= 0 &&
                             n == mesh.dim_names()[static_cast<size_t>(dims.replicate)]);
      if (fsdp_dim) {
        throw MeshError("dtensor_params", "fully_shard: '" + which + "' ('" + name +
                                              "') is placed on FSDP's own dim '" + n + "' of " +
                                              tm.to_string() + "; its mesh must hold only the "
                                              "other dims (tp, ep)");
      }
      if (!has_dim(mesh, n) || !same_ranks(tm.get_group(i), mesh.get_group(n))) inside = false;
    }
    if (!inside) {
      const int carried = mesh.ndim() - 1 - (dims.replicate >= 0 ? 1 : 0);
      if (carried > 0) {
        throw MeshError("dtensor_params",
                        "fully_shard: '" + which + "' ('" + name + "') lives on " +
                            tm.to_string() + ", which is not made of the carried dims of 'mesh' " +
                            mesh.to_string());
      }
      try {
        spmd = DeviceMesh::concatenate({mesh, tm});
      } catch (const MeshError& e) {
        throw MeshError("dtensor_params",
                        "fully_shard: '" + which + "' ('" + name + "') lives on " +
                            tm.to_string() + ", which cannot be joined with 'mesh' " +
                            mesh.to_string() + " (" + e.what() +
                            "); accepted: a slice of the mesh 'mesh' was sliced from");
      }
    }
    for (int i = 0; i < tm.ndim(); ++i) {
      const Placement& p = dt->placements()[static_cast<size_t>(i)];
      if (p.is_partial()) {
        throw ArgumentError("dtensor_params", "fully_shard: '" + which + "' ('" + name +
                                                  "') has placement " + p.to_string() +
                                                  "; a parameter is Shard or Replicate");
      }
      by_name.insert_or_assign(tm.dim_names()[i], p);
    }
    if (!dp->grad_placements.empty() &&
        static_cast<int>(dp->grad_placements.size()) != tm.ndim()) {
      throw ArgumentError("dtensor_params", "fully_shard: '" + which + "' ('" + name +
                                                "') has " +
                                                std::to_string(dp->grad_placements.size()) +
                                                " grad_placements; expected none or one per "
                                                "dim of " + tm.to_string());
    }
    for (size_t i = 0; i < dp->grad_placements.size(); ++i) {
      const Placement& g = dp->grad_placements[i];
      const Placement& p = dt->placements()[i];
      if (g == p) continue;
      if (!(p.is_replicate() && g.is_partial() && g.reduce_op() == ReduceOp::SUM)) {
        throw ArgumentError("dtensor_params",
                            "fully_shard: '" + which + "' ('" + name + "') has gradient "
                            "placement " + g.to_string() + " where the parameter is " +
                            p.to_string() + " on dim '" + tm.dim_names()[i] +
                            "'; accepted: the parameter's placement, or Partial(sum) "
                            "where it is Replicate()");
      }
      if (tm.size(static_cast<int>(i)) > 1) {
        layout.grad_partial_groups.push_back(tm.get_group(static_cast<int>(i)));
      }
    }
    layout.global_shape = dt->shape();
  } else {
    layout.global_shape = param.sizes().vec();
  }
  const int s = spmd.dim_index(shard_name);
  Placement on_shard = Placement::Replicate();
  if (fsdp.is_shard()) {
    int64_t split = 1;
    for (int j = s + 1; j < spmd.ndim(); ++j) {
      const Placement& inner = by_name.at(spmd.dim_names()[j]);
      if ((inner.is_shard() || inner.is_strided_shard()) && inner.dim() == fsdp.dim()) {
        split *= spmd.size(j);
      }
    }
    on_shard =
        split > 1 ? Placement::StridedShard(fsdp.dim(), split) : Placement::Shard(fsdp.dim());
  }
  by_name.insert_or_assign(shard_name, on_shard);
  for (int i = 0; i < spmd.ndim(); ++i) {
    const Placement& p = by_name.at(spmd.dim_names()[i]);
    layout.spmd_placements.push_back(p);
    if ((p.is_shard() || p.is_strided_shard()) && spmd.size(i) > 1) {
      layout.split_groups.push_back(spmd.get_group(i));
    }
  }
  layout.spmd_mesh = spmd;
  return layout;
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

// In module order (as named_parameters() lists them), across groups.
template <typename Fn>
void for_params(UnitState& u, Fn fn) {
  for (const auto& [g, i] : u.param_order) fn(u.groups[g].params()[i]);
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
  const FsdpDims unit_dims = fsdp_dims(mesh, options, "mesh", /*strict=*/true);
  for (const auto& t : options.ignored_params) {
    if (contains_tensor(options.replicate_params, t)) {
      throw ArgumentError("replicate_params",
                          "fully_shard: a parameter is in both 'ignored_params' and "
                          "'replicate_params'; it can be one or the other");
    }
  }
  check_param_list("ignored_params", options.ignored_params, modules);
  check_param_list("replicate_params", options.replicate_params, modules);
  std::unordered_map<const c10::TensorImpl*, size_t> dtensor_of;
  for (size_t i = 0; i < options.dtensor_params.size(); ++i) {
    const DTensor& dt = options.dtensor_params[i].param;
    if (!dt.defined()) {
      throw ArgumentError("dtensor_params", "fully_shard: 'dtensor_params[" + std::to_string(i) +
                                                "]' is an undefined DTensor");
    }
    dtensor_of[dt.to_local().unsafeGetTensorImpl()] = i;
  }
  check_mp_dtype(options.mp_policy.param_dtype, "param_dtype");
  check_mp_dtype(options.mp_policy.reduce_dtype, "reduce_dtype");
  check_mp_dtype(options.mp_policy.output_dtype, "output_dtype");

  const bool offload = options.offload_policy.has_value();
  const bool pin = offload && options.offload_policy->pin_memory;

  // Pass 1: choose and validate every placement and layout before touching
  // any parameter, so a rejected call leaves the module exactly as it was.
  struct Planned {
    std::string name;
    at::Tensor param;
    detail::ParamLayout layout;
    detail::UnitDtypes dtypes;
    size_t group;
  };
  struct GroupPlan {
    ProcessGroupPtr shard, replicate;
    std::optional<double> divide_factor;
    std::optional<c10::ScalarType> fused_dtype;
  };
  std::vector<Planned> planned;
  std::vector<GroupPlan> group_plans;
  std::map<std::tuple<std::string, std::string, double>, size_t> group_of_key;
  std::unordered_set<const c10::TensorImpl*> taken;
  std::vector<bool> dtensor_used(options.dtensor_params.size(), false);
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
      const Choice choice = choose(name, param, options, mesh);
      const DeviceMesh& group_mesh = choice.mesh ? *choice.mesh : mesh;
      const FsdpDims dims = choice.mesh ? fsdp_dims(group_mesh, options, "shard_placement_fn",
                                                    /*strict=*/false)
                                        : unit_dims;
      const DistributedParam* dt = nullptr;
      size_t dt_index = 0;
      if (auto it = dtensor_of.find(param.unsafeGetTensorImpl()); it != dtensor_of.end()) {
        dt_index = it->second;
        dt = &options.dtensor_params[dt_index];
        dtensor_used[dt_index] = true;
      }
      detail::ParamLayout layout =
          make_layout(name, param, choice.placement, group_mesh, dims, dt, dt_index);
      detail::UnitDtypes dtypes;
      if (param.is_floating_point()) {
        dtypes.param = options.mp_policy.param_dtype;
        dtypes.reduce = options.mp_policy.reduce_dtype;
      }
      ProcessGroupPtr replicate = dims.replicate >= 0 ? group_mesh.get_group(dims.replicate)
                                                      : nullptr;
      const auto key = std::make_tuple(layout.shard_group->name(),
                                       replicate ? replicate->name() : std::string(),
                                       choice.divide_factor.value_or(-1.0));
      auto [pos, added] = group_of_key.emplace(key, group_plans.size());
      if (added) group_plans.push_back({layout.shard_group, replicate, choice.divide_factor, {}});
      GroupPlan& gp = group_plans[pos->second];
      const auto compute_dtype = dtypes.param.value_or(param.scalar_type());
      if (options.comm_fusion && choice.placement.is_shard()) {
        if (gp.fused_dtype && *gp.fused_dtype != compute_dtype) {
          throw ArgumentError("comm_fusion",
                              "fully_shard: 'comm_fusion' needs one compute dtype per parameter "
                              "group, but '" + name + "' computes in " +
                                  c10::toString(compute_dtype) + " and another parameter in " +
                                  c10::toString(*gp.fused_dtype));
        }
        gp.fused_dtype = compute_dtype;
      }
      planned.push_back({name, param, std::move(layout), dtypes, pos->second});
    }
  }
  for (size_t i = 0; i < dtensor_used.size(); ++i) {
    if (!dtensor_used[i]) {
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
  if (planned.empty() && !has_nested_units) {
    throw ArgumentError("module", "fully_shard: 'module' has no parameters to manage (none, or "
                                  "all ignored) and no sharded modules inside it");
  }
  // Pass 2: shard.
  std::vector<std::vector<detail::ShardedParam>> params(group_plans.size());
  for (auto& p : planned) {
    params[p.group].emplace_back(p.name, p.param, std::move(p.layout), p.dtypes, p.param.device(),
                                 offload, pin);
  }
  std::vector<detail::ParamGroup> groups;
  for (size_t g = 0; g < group_plans.size(); ++g) {
    groups.emplace_back(std::move(params[g]), group_plans[g].shard, group_plans[g].replicate,
                        group_plans[g].divide_factor, options.comm_fusion);
  }
  std::vector<size_t> next_in_group(group_plans.size(), 0);
  auto unit = std::make_shared<UnitState>(detail::next_unit_id(), modules, mesh, std::move(groups),
                                          options);
  for (const auto& p : planned) unit->param_order.emplace_back(p.group, next_in_group[p.group]++);
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
void FSDPModule::set_reshard_after_forward(ReshardAfterForward v, bool recurse) {
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
  for_units(unit(), true, [factor](UnitState& u) { u.scaling_factor = factor; });
}

void FSDPModule::set_gradient_divide_factor(std::optional<double> factor) {
  check_factor("set_gradient_divide_factor", factor);
  for_units(unit(), true, [factor](UnitState& u) {
    for (auto& g : u.groups) g.set_divide_factor(factor);
  });
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
  unit().explicit_forward_prefetch = true;
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
    if (u->lifecycle.state() != detail::Lifecycle::Idle) {
      throw StateError("reduce_gradients: unit " + u->error_label() + " is in " +
                       detail::to_string(u->lifecycle.state()) +
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
