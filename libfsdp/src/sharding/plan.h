// Internal: the layout plan of a unit -- FSDP's dims of a mesh, every
// parameter's placement, SPMD layout and parameter group -- chosen and
// validated before fully_shard touches any parameter, so a rejected call
// leaves the module exactly as it was.
#pragma once

#include "fsdp/process_group.h"
#include "fsdp/mesh.h"
#include "fsdp/options.h"
#include "sharding/param.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp::detail {

// The mesh of a fully_shard call without options.mesh: 1-D over the world.
const DeviceMesh& default_mesh();
// The device a mesh's collectives run on for this rank: the Runtime's device
// when it has the mesh's type (cuda:<local rank>), else that type's default.
c10::Device mesh_device(const DeviceMesh& mesh);

// Whether `list` holds `t` itself (by TensorImpl).
bool contains_tensor(const std::vector<at::Tensor>& list, const at::Tensor& t);

// FSDP's dims of a mesh: the shard dim, the replicate dim (-1: none); the
// others are carried through. `argument` names the mesh in errors; `strict`:
// dims named in the options must exist (the unit's mesh) rather than fall
// back to the positional defaults (a per-parameter mesh).
struct FsdpDims {
  int shard = 0;
  int replicate = -1;
};

FsdpDims fsdp_dims(const DeviceMesh& mesh, const FullyShardOptions& o, const char* argument,
                   bool strict);

// One parameter as it is to be sharded: its layout, dtypes and group.
struct PlannedParam {
  std::string name;
  at::Tensor param;
  ParamLayout layout;
  UnitDtypes dtypes;
  size_t group;
  std::shared_ptr<const AllGatherExtension> extension;  // all_gather_extension_fn's
};

// One parameter group: the parameters sharing a shard group, a replicate
// group and a gradient divide factor.
struct GroupPlan {
  ProcessGroupPtr shard, replicate;
  std::optional<double> divide_factor;
  std::optional<c10::ScalarType> fused_dtype;
  bool mixed_dtypes = false;  // Shard parameters of several compute dtypes
  bool on_cuda = false;       // a parameter computes on CUDA
  bool fused = false;         // comm_fusion resolved (FullyShardOptions)
};

struct UnitPlan {
  std::vector<PlannedParam> params;  // in module order
  std::vector<GroupPlan> groups;
  // [i]: options.dtensor_params[i] is a parameter of the plan.
  std::vector<bool> dtensor_used;
};

// Chooses and validates the placement, layout and group of every parameter
// of `modules` that is neither tied to another unit's, ignored, nor inside a
// nested unit. `dtensor_of`: options.dtensor_params' index by local tensor.
// Throws the typed error naming the argument at fault; touches nothing.
UnitPlan plan_unit(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                   const FullyShardOptions& options, const DeviceMesh& mesh, FsdpDims unit_dims,
                   const std::unordered_map<const c10::TensorImpl*, size_t>& dtensor_of);

}  // namespace fsdp::detail
