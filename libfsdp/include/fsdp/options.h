// fully_shard's policies and options: the bottom of the FSDP include graph
// (the role of PyTorch's _fsdp_api.py). Nothing here communicates.
#pragma once

#include "fsdp/comm_hooks.h"
#include "fsdp/dtensor.h"
#include "fsdp/mesh.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

// Mixed precision (all fields optional). Shards keep their original dtype.
struct MixedPrecisionPolicy {
  // All-gather and compute dtype of the parameters (none = original dtype).
  std::optional<c10::ScalarType> param_dtype;
  // Gradient reduction dtype (none = param_dtype, else original dtype). The
  // sharded gradient handed to the optimizer has this dtype. float16
  // gradients are divided by the smallest power of two >= sqrt(ranks) before
  // the reduction and by the rest after it, so a mean that fits in float16
  // does not overflow as the sum of the ranks' gradients (FSDP2 does the same).
  std::optional<c10::ScalarType> reduce_dtype;
  // Floating tensor outputs of the unit's forward are cast to this dtype.
  std::optional<c10::ScalarType> output_dtype;
  // Cast floating tensor inputs of the unit's forward to param_dtype.
  bool cast_forward_inputs = true;
  // Accumulate each reduced gradient into an fp32 main gradient, which is
  // what param.grad() then holds (and FSDPModule::main_grads() returns).
  bool apply_grad_on_fp32_main_grad = false;
};

// Keep shards and sharded gradients in CPU memory (pinned when CUDA is
// present); they move to the compute device for the all-gather. On a
// CPU-only build this is valid and changes nothing (the device is the CPU).
struct CPUOffloadPolicy {
  bool pin_memory = true;
};

// What shard_placement_fn returns for one parameter (PyTorch's
// ShardPlacementResult):
//  - placement: Shard(d) (dims other than 0 must divide evenly over the shard
//    group) or Replicate() (managed, not sharded, gradients all-reduced) on
//    FSDP's shard dim. For a parameter already sharded by tensor or expert
//    parallelism it applies to the local tensor.
//  - mesh: the FSDP mesh of this parameter (1-D shard, or 2-D (replicate,
//    shard)); none = the unit's. Each distinct (mesh, divide factor) becomes
//    one parameter group of the unit, with its own all-gather and
//    reduce-scatter -- how experts are sharded on a smaller mesh than the
//    dense weights of the same block.
//  - gradient_divide_factor: with reduce op "avg", gradients are divided by
//    this instead of the mesh's data-parallel size (shard x replicate), e.g.
//    the full data-parallel size for experts sharded on a sub-mesh. > 0.
struct ShardPlacementResult {
  ShardPlacementResult(Placement p) : placement(p) {}  // NOLINT: a bare placement is a result
  ShardPlacementResult(Placement p, DeviceMesh m, std::optional<double> divide_factor = {})
      : placement(p), mesh(std::move(m)), gradient_divide_factor(divide_factor) {}
  Placement placement;
  std::optional<DeviceMesh> mesh;
  std::optional<double> gradient_divide_factor;
};

// Per-parameter placement override; std::nullopt = Shard(0) on the unit's mesh.
using ShardPlacementFn = std::function<std::optional<ShardPlacementResult>(
    const std::string& name, const at::Tensor& param)>;

// A parameter already distributed by tensor or expert parallelism: a DTensor
// whose local tensor is the module's parameter itself (not a copy), and the
// placements of its gradient on the DTensor's mesh. grad_placements empty =
// the parameter's own. Partial(SUM) on a dim where the parameter is
// Replicate says its gradient is a partial sum there (a norm weight in a
// sequence-parallel region, a bias added after a reduce-scatter): FSDP
// all-reduces it over that dim, in reduce_dtype, before its own reduction.
// Nothing else may differ (ArgumentError naming "dtensor_params").
struct DistributedParam {
  DistributedParam(DTensor p) : param(std::move(p)) {}  // NOLINT: a bare DTensor is one
  DistributedParam(DTensor p, std::vector<Placement> grad)
      : param(std::move(p)), grad_placements(std::move(grad)) {}
  DTensor param;
  std::vector<Placement> grad_placements;
};

// Whether a unit frees its unsharded parameters after forward (FSDP2's
// reshard_after_forward: True, False, None or an int). Converts from bool, so
// `options.reshard_after_forward = false` reads as before; it does not
// convert back, since an unset value means "depends on the unit".
//
// The integer form (FSDP2's int, ZeRO++'s hpZ): after forward, keep the
// parameters sharded over `ranks` consecutive ranks of the shard dim -- e.g.
// the ranks of one node -- instead of all of it, so the backward all-gather
// runs within that smaller group (and within the node). Each rank holds
// 1/ranks of every parameter between forward and backward instead of
// 1/shard-size. 1 means false and the shard dim's size means true, as in
// FSDP2; any other value must divide the shard dim's size (fully_shard and
// set_reshard_after_forward throw ArgumentError naming
// "reshard_after_forward" otherwise, and when it combines with an
// offload_policy). within_node(): the ranks of the shard dim on this node
// (docs/multinode.md).
class ReshardAfterForward {
 public:
  // Unset: every unit but the root reshards. The root's parameters would be
  // all-gathered again at once for backward, so it keeps them until its
  // post-backward; a root forward without grad mode (no backward follows)
  // reshards all the same.
  constexpr ReshardAfterForward() = default;
  constexpr ReshardAfterForward(bool reshard) : value_(reshard) {}  // NOLINT: the plan's bool API
  // hpZ: keep the parameters sharded over `ranks` ranks after forward.
  constexpr ReshardAfterForward(int ranks) : value_(true), ranks_(ranks) {}  // NOLINT: FSDP2's int
  // hpZ over the shard dim's ranks on this node (resolved by fully_shard: the
  // same count on every node, and each node's ranks consecutive in the shard
  // dim, else ArgumentError naming "reshard_after_forward").
  static constexpr ReshardAfterForward within_node() {
    ReshardAfterForward r(true);
    r.within_node_ = true;
    return r;
  }
  constexpr bool is_set() const { return value_.has_value(); }
  // The explicit choice; std::nullopt when unset. The integer forms read as
  // true (the unit does reshard after forward, to fewer ranks).
  constexpr std::optional<bool> value() const { return value_; }
  // The integer form's rank count as given (unchecked until fully_shard);
  // std::nullopt for the bool, unset and within_node() forms.
  constexpr std::optional<int> ranks() const { return ranks_; }
  constexpr bool is_within_node() const { return within_node_; }
  friend constexpr bool operator==(ReshardAfterForward a, ReshardAfterForward b) {
    return a.value_ == b.value_ && a.ranks_ == b.ranks_ && a.within_node_ == b.within_node_;
  }
  friend constexpr bool operator!=(ReshardAfterForward a, ReshardAfterForward b) {
    return !(a == b);
  }

 private:
  std::optional<bool> value_;
  std::optional<int> ranks_;
  bool within_node_ = false;
};

// "true", "false", "unset", "2 ranks (hpZ)", "within node (hpZ)".
std::string to_string(ReshardAfterForward r);

struct FullyShardOptions {
  // FSDP's mesh. 1-D = FSDP, 2-D (replicate, shard) = HSDP; with more dims
  // (e.g. (replicate, shard, tp)) shard_dim (and replicate_dim) name FSDP's
  // dims and the others are carried through: parameters are replicated on
  // them, or placed as their DTensor (dtensor_params) says. None: 1-D over
  // the world.
  std::optional<DeviceMesh> mesh;
  // Names of FSDP's dims in `mesh`. Defaults: a 1-D mesh shards on its dim;
  // a 2-D mesh is (replicate, shard); a mesh of 3+ dims uses the dims named
  // "shard" and "replicate" if it has them, else needs shard_dim.
  std::optional<std::string> shard_dim;
  std::optional<std::string> replicate_dim;
  // Free the unsharded parameters after forward (and re-gather for
  // backward). Default unset: true for every unit but the root (see
  // ReshardAfterForward).
  ReshardAfterForward reshard_after_forward;
  ShardPlacementFn shard_placement_fn;
  MixedPrecisionPolicy mp_policy;
  std::optional<CPUOffloadPolicy> offload_policy;
  // Left as plain full tensors: never communicated. Entries of this list
  // and of replicate_params must be parameters -- of `module`, or of another
  // part of the model when one list is passed to every fully_shard call.
  // ArgumentError naming the list (with index and shape) for an undefined
  // tensor, a detach()/data()/slice of a parameter of `module` instead of
  // the parameter, a computed tensor (grad_fn), a tensor outside `module`
  // that requires no gradient, or a parameter another unit already shards.
  std::vector<at::Tensor> ignored_params;
  // Managed but not sharded: full on every rank, gradients all-reduced.
  std::vector<at::Tensor> replicate_params;
  // Parameters already distributed by tensor or expert parallelism (see
  // DistributedParam; fsdp::dtensor_params lists a TP model's). FSDP
  // shards the local tensor further and records the combined
  // placement on the mesh of FSDP's dims and the DTensor's dims, so
  // sharded_parameters(), state dicts, clip_grad_norm_ and checkpoints see
  // the global tensor. Their mesh must be a slice of `mesh` (its non-FSDP
  // dims) or of the mesh `mesh` was sliced from.
  std::vector<DistributedParam> dtensor_params;
  // One all-gather and one reduce-scatter per parameter group per pass over
  // a flat buffer, instead of one per parameter. Unset: on for units that
  // compute on CUDA (FSDP2's behaviour: NCCL launches cost more than the
  // copies into one buffer), off on the CPU, where the measured step is no
  // faster with it (docs/comm_hooks.md#defaults). Unset with parameters of
  // several compute dtypes in one group: unfused; true: ArgumentError.
  std::optional<bool> comm_fusion;
  // Per-parameter transformed all-gathers (comm_hooks.h), e.g.
  // fsdp::float8_all_gather(); empty = none.
  AllGatherExtensionFn all_gather_extension_fn;
  // Backward prefetch of a unit whose set_modules_to_backward_prefetch was
  // never called: its pre-backward issues the all-gather of the unit that
  // ran forward just before it. Unset: on for units on CUDA, where the
  // gather runs on NCCL's stream beside backward's kernels (FSDP2's
  // default); off on the CPU, where the gather's copies take the cores
  // backward computes on and only make the next unit's parameters live
  // sooner (fsdp-bench train, 2 cores: never faster, peak 3-8% higher).
  std::optional<bool> implicit_backward_prefetch;
};

}  // namespace fsdp
