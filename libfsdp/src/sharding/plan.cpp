// Layout planning for fully_shard: FSDP's dims of a mesh, each parameter's
// placement (replicate_params, shard_placement_fn) and SPMD layout (with
// the carried tp/ep dims of dtensor_params), and the parameter groups.
#include "sharding/plan.h"

#include "base/shape_str.h"
#include "fsdp/errors.h"
#include "fsdp/runtime.h"
#include "sharding/registry.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <unordered_set>

namespace fsdp::detail {
namespace {

bool has_dim(const DeviceMesh& mesh, const std::string& name) {
  const auto& n = mesh.dim_names();
  return std::find(n.begin(), n.end(), name) != n.end();
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

// The mesh a DTensor parameter's layout lives on: `mesh` when the DTensor's
// mesh `tm` is made of mesh's carried dims (tp, ep), else the two joined
// (`mesh` then FSDP's only dims). `which` names the parameter's
// dtensor_params entry. MeshError when `tm` holds an FSDP dim, or is neither
// made of the carried dims nor joinable.
DeviceMesh dtensor_spmd_mesh(const std::string& name, const std::string& which,
                             const DeviceMesh& mesh, FsdpDims dims, const DeviceMesh& tm) {
  const std::string& shard_name = mesh.dim_names()[static_cast<size_t>(dims.shard)];
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
  if (inside) return mesh;
  const int carried = mesh.ndim() - 1 - (dims.replicate >= 0 ? 1 : 0);
  if (carried > 0) {
    throw MeshError("dtensor_params",
                    "fully_shard: '" + which + "' ('" + name + "') lives on " +
                        tm.to_string() + ", which is not made of the carried dims of 'mesh' " +
                        mesh.to_string());
  }
  try {
    return DeviceMesh::concatenate({mesh, tm});
  } catch (const MeshError& e) {
    throw MeshError("dtensor_params",
                    "fully_shard: '" + which + "' ('" + name + "') lives on " +
                        tm.to_string() + ", which cannot be joined with 'mesh' " +
                        mesh.to_string() + " (" + e.what() +
                        "); accepted: a slice of the mesh 'mesh' was sliced from");
  }
}

// A DTensor parameter's placements, by dim name, into `by_name`.
// ArgumentError for a Partial one: a parameter is Shard or Replicate.
void add_dtensor_placements(const std::string& name, const std::string& which, const DTensor& dt,
                            std::map<std::string, Placement>& by_name) {
  const DeviceMesh& tm = dt.device_mesh();
  for (int i = 0; i < tm.ndim(); ++i) {
    const Placement& p = dt.placements()[static_cast<size_t>(i)];
    if (p.is_partial()) {
      throw ArgumentError("dtensor_params", "fully_shard: '" + which + "' ('" + name +
                                                "') has placement " + p.to_string() +
                                                "; a parameter is Shard or Replicate");
    }
    by_name.insert_or_assign(tm.dim_names()[i], p);
  }
}

// The carried dims (size > 1) whose gradient is a partial sum where the
// parameter is replicated (DistributedParam::grad_placements). ArgumentError
// when grad_placements is neither empty nor one per dim, or one is neither
// the parameter's placement nor Partial(sum) over a Replicate().
std::vector<ProcessGroupPtr> grad_partial_groups(const std::string& name,
                                                 const std::string& which,
                                                 const DistributedParam& dp) {
  const DeviceMesh& tm = dp.param.device_mesh();
  if (!dp.grad_placements.empty() && static_cast<int>(dp.grad_placements.size()) != tm.ndim()) {
    throw ArgumentError("dtensor_params", "fully_shard: '" + which + "' ('" + name +
                                              "') has " +
                                              std::to_string(dp.grad_placements.size()) +
                                              " grad_placements; expected none or one per "
                                              "dim of " + tm.to_string());
  }
  std::vector<ProcessGroupPtr> groups;
  for (size_t i = 0; i < dp.grad_placements.size(); ++i) {
    const Placement& g = dp.grad_placements[i];
    const Placement& p = dp.param.placements()[i];
    if (g == p) continue;
    if (!(p.is_replicate() && g.is_partial() && g.reduce_op() == ReduceOp::SUM)) {
      throw ArgumentError("dtensor_params",
                          "fully_shard: '" + which + "' ('" + name + "') has gradient "
                          "placement " + g.to_string() + " where the parameter is " +
                          p.to_string() + " on dim '" + tm.dim_names()[i] +
                          "'; accepted: the parameter's placement, or Partial(sum) "
                          "where it is Replicate()");
    }
    if (tm.size(static_cast<int>(i)) > 1) groups.push_back(tm.get_group(static_cast<int>(i)));
  }
  return groups;
}

// FSDP's placement on dim `s` of `spmd` (the shard dim): Replicate() for a
// replicated parameter, else Shard(d), or StridedShard(d, split) when carried
// dims to its right split the same tensor dim d ("TP first, then FSDP inside
// the TP shard").
Placement fsdp_placement_on_shard_dim(const Placement& fsdp, const DeviceMesh& spmd, int s,
                                      const std::map<std::string, Placement>& by_name) {
  if (!fsdp.is_shard()) return Placement::Replicate();
  int64_t split = 1;
  for (int j = s + 1; j < spmd.ndim(); ++j) {
    const Placement& inner = by_name.at(spmd.dim_names()[j]);
    if ((inner.is_shard() || inner.is_strided_shard()) && inner.dim() == fsdp.dim()) {
      split *= spmd.size(j);
    }
  }
  return split > 1 ? Placement::StridedShard(fsdp.dim(), split) : Placement::Shard(fsdp.dim());
}

// The SPMD view of a parameter: FSDP's dims of `mesh` and the carried dims
// (tp, ep), with the DTensor's placements where it has them (`dp`, entry
// `dt_index` of dtensor_params), FSDP's on the shard dim.
ParamLayout make_layout(const std::string& name, const at::Tensor& param,
                                const Placement& fsdp, const DeviceMesh& mesh, FsdpDims dims,
                                const DistributedParam* dp, size_t dt_index) {
  ParamLayout layout;
  layout.fsdp = fsdp;
  layout.shard_group = mesh.get_group(dims.shard);
  const std::string shard_name = mesh.dim_names()[static_cast<size_t>(dims.shard)];
  std::map<std::string, Placement> by_name;
  for (int i = 0; i < mesh.ndim(); ++i)
    by_name.emplace(mesh.dim_names()[i], Placement::Replicate());
  DeviceMesh spmd = mesh;
  if (dp) {
    const std::string which = "dtensor_params[" + std::to_string(dt_index) + "]";
    spmd = dtensor_spmd_mesh(name, which, mesh, dims, dp->param.device_mesh());
    add_dtensor_placements(name, which, dp->param, by_name);
    layout.grad_partial_groups = grad_partial_groups(name, which, *dp);
    layout.global_shape = dp->param.shape();
  } else {
    layout.global_shape = param.sizes().vec();
  }
  const int s = spmd.dim_index(shard_name);
  by_name.insert_or_assign(shard_name, fsdp_placement_on_shard_dim(fsdp, spmd, s, by_name));
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
    if (unit_for_module(*child.value())) continue;
    auto nested = unit_parameters(*child.value(), prefix + child.key() + ".");
    out.insert(out.end(), nested.begin(), nested.end());
  }
  return out;
}

}  // namespace

const DeviceMesh& default_mesh() {
  static std::optional<DeviceMesh> mesh;
  if (!mesh) {
    Runtime& rt = Runtime::get();
    mesh = init_device_mesh(rt.device().type(), {rt.world_size()}, {"shard"});
  }
  return *mesh;
}

c10::Device mesh_device(const DeviceMesh& mesh) {
  const c10::Device rt = Runtime::get().device();
  return rt.type() == mesh.device_type() ? rt : c10::Device(mesh.device_type());
}

bool contains_tensor(const std::vector<at::Tensor>& list, const at::Tensor& t) {
  for (const auto& x : list) {
    if (x.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
  }
  return false;
}

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

namespace {

std::shared_ptr<const AllGatherExtension> extension_of(const std::string& name,
                                                       const at::Tensor& param, Placement placement,
                                                       const FullyShardOptions& options) {
  if (!options.all_gather_extension_fn) return nullptr;
  std::optional<AllGatherExtension> ext = options.all_gather_extension_fn(name, param);
  if (!ext) return nullptr;
  if (!ext->pre_all_gather || !ext->post_all_gather) {
    throw ArgumentError("all_gather_extension_fn",
                        "fully_shard: 'all_gather_extension_fn' returned an extension for '" +
                            name + "' without " +
                            (ext->pre_all_gather ? "post_all_gather" : "pre_all_gather") +
                            "; accepted: both functions, or std::nullopt for the ordinary "
                            "all-gather");
  }
  if (!placement.is_shard()) {
    throw ArgumentError("all_gather_extension_fn",
                        "fully_shard: 'all_gather_extension_fn' returned an extension for '" +
                            name + "', which is placed Replicate() (never all-gathered); "
                            "accepted: extensions for Shard placements only");
  }
  return std::make_shared<const AllGatherExtension>(std::move(*ext));
}

}  // namespace

UnitPlan plan_unit(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                   const FullyShardOptions& options, const DeviceMesh& mesh, FsdpDims unit_dims,
                   const std::unordered_map<const c10::TensorImpl*, size_t>& dtensor_of) {
  UnitPlan plan;
  std::map<std::tuple<std::string, std::string, double>, size_t> group_of_key;
  std::unordered_set<const c10::TensorImpl*> taken;
  plan.dtensor_used.assign(options.dtensor_params.size(), false);
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (auto& [name, param] : unit_parameters(*modules[mi], prefix)) {
      if (!taken.insert(param.unsafeGetTensorImpl()).second) continue;  // tied weights
      if (contains_tensor(options.ignored_params, param)) continue;
      if (is_managed(param)) {
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
        plan.dtensor_used[dt_index] = true;
      }
      ParamLayout layout =
          make_layout(name, param, choice.placement, group_mesh, dims, dt, dt_index);
      UnitDtypes dtypes;
      if (param.is_floating_point()) {
        dtypes.param = options.mp_policy.param_dtype;
        dtypes.reduce = options.mp_policy.reduce_dtype;
      }
      ProcessGroupPtr replicate = dims.replicate >= 0 ? group_mesh.get_group(dims.replicate)
                                                      : nullptr;
      const auto key = std::make_tuple(layout.shard_group->name(),
                                       replicate ? replicate->name() : std::string(),
                                       choice.divide_factor.value_or(-1.0));
      auto [pos, added] = group_of_key.emplace(key, plan.groups.size());
      if (added) plan.groups.push_back({layout.shard_group, replicate, choice.divide_factor, {}});
      GroupPlan& gp = plan.groups[pos->second];
      const auto compute_dtype = dtypes.param.value_or(param.scalar_type());
      std::shared_ptr<const AllGatherExtension> extension =
          extension_of(name, param, choice.placement, options);
      gp.on_cuda = gp.on_cuda || (param.is_meta() ? mesh_device(mesh) : param.device()).is_cuda();
      // Extended parameters gather in bytes of their own: not in the fused buffer.
      if (choice.placement.is_shard() && !extension) {
        if (gp.fused_dtype && *gp.fused_dtype != compute_dtype) {
          if (options.comm_fusion.value_or(false)) {
            throw ArgumentError("comm_fusion",
                                "fully_shard: 'comm_fusion' needs one compute dtype per parameter "
                                "group, but '" + name + "' computes in " +
                                    c10::toString(compute_dtype) + " and another parameter in " +
                                    c10::toString(*gp.fused_dtype));
          }
          gp.mixed_dtypes = true;
        }
        gp.fused_dtype = compute_dtype;
      }
      plan.params.push_back({name, param, std::move(layout), dtypes, pos->second, extension});
    }
  }
  // Unset comm_fusion: FSDP2's one collective per group on CUDA, per
  // parameter on the CPU (FullyShardOptions::comm_fusion says why).
  for (auto& gp : plan.groups) {
    gp.fused = options.comm_fusion.has_value() ? *options.comm_fusion
                                               : gp.on_cuda && !gp.mixed_dtypes;
  }
  return plan;
}

}  // namespace fsdp::detail
