// Extension points of a unit's collectives (FSDP2's set_custom_all_gather,
// set_custom_reduce_scatter, set_all_reduce_hook and the tensor-subclass
// fsdp_pre_all_gather / fsdp_post_all_gather pair), set through
// FullyShardOptions::all_gather_extension_fn and the FSDPModule setters.
// docs/comm_hooks.md has worked examples; fsdp/float8.h is one extension
// built on AllGatherExtension.
//
// Every hook runs on every rank of the unit's mesh, on the thread that runs
// forward/backward (never on a communication thread), in the same order on
// every rank. A hook that throws fails the pass like any error in forward or
// backward (the next forward discards what it left, fully_shard.h).
#pragma once

#include "fsdp/comm.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

// A transformed all-gather of one parameter -- e.g. in a lower precision
// than it computes in. Without one, a Shard parameter is cast to the compute
// dtype (param_dtype) and gathered as it is.
//
// pre_all_gather(shard): `shard` is this rank's padded block of the
// parameter as a 2-D [rows, cols] tensor in the parameter's own (storage)
// dtype on the compute device: rows = the shard dim's rows per rank
// (ceil(size / shard ranks); trailing rows past the parameter's end are
// zeros), cols = the product of the other dims (the shard dim first). It
// returns the tensors to gather: one or more, any dtype (they travel as
// bytes), any shape -- but the same shapes and dtypes on every rank and at
// every call (ShapeError / DTypeError naming "pre_all_gather" and the
// parameter when a later call differs from the first; an empty list or an
// undefined tensor -> ArgumentError; another device -> LayoutError).
//
// post_all_gather(gathered, compute_dtype): `gathered[k]` is output k of
// every rank concatenated along dim 0 in shard-rank order (a 0-dim output
// becomes a 1-D tensor of one element per rank), contiguous. It returns the
// full padded parameter, [shard ranks * rows, cols] (or any shape of that
// many elements) in `compute_dtype` on the compute device, which the unit
// then computes with; ShapeError / DTypeError / LayoutError naming
// "post_all_gather" and the parameter otherwise. The padding rows are
// dropped afterwards.
//
// Gradients are taken with respect to what post_all_gather returned and
// reduced as usual (in reduce_dtype): the transformation is not
// differentiated through (a straight-through estimate, as FSDP2's float8
// all-gather).
//
// Collectives: the extension outputs of all of a parameter group's
// parameters go in ONE all-gather of bytes per unshard (beside the group's
// ordinary all-gathers), whatever comm_fusion says. A shard group of one
// rank runs pre_all_gather and post_all_gather without a collective, so the
// numbers do not depend on the world size. Only Shard placements take an
// extension (ArgumentError naming "all_gather_extension_fn" for a Replicate
// one); after reshard_after_forward with a rank count (hpZ) the backward
// re-gathers the post_all_gather result, not the extension's outputs.
struct AllGatherExtension {
  std::function<std::vector<at::Tensor>(const at::Tensor& shard)> pre_all_gather;
  std::function<at::Tensor(const std::vector<at::Tensor>& gathered, c10::ScalarType compute_dtype)>
      post_all_gather;
};

// Per managed parameter (name relative to the module given to fully_shard,
// the parameter as the module holds it): its extension, or std::nullopt for
// the ordinary all-gather. An extension missing either function ->
// ArgumentError naming "all_gather_extension_fn".
using AllGatherExtensionFn = std::function<std::optional<AllGatherExtension>(
    const std::string& name, const at::Tensor& param)>;

// A unit's own all-gather (FSDP2's set_custom_all_gather; e.g. a collective
// library of your own, or symmetric memory). Used for every all-gather the
// unit's parameter groups issue -- the ordinary ones and the extension byte
// gathers, over the shard group or, after hpZ, the post-forward group.
struct CustomAllGather {
  // Returns the output buffer: `numel` elements of `options` (dtype,
  // device). Empty = the group's own (ProcessGroup::empty_for_collectives).
  // Called once per buffer: between gathers the unit releases a buffer's
  // storage and regrows it in place, through the storage's own allocator.
  // A result of another size, dtype or device -> ShapeError / DTypeError /
  // LayoutError naming "allocate".
  std::function<at::Tensor(int64_t numel, const at::TensorOptions& options)> allocate;
  // output <- every rank's input concatenated in group-rank order, as
  // ProcessGroup::all_gather_into_tensor; `input` is this rank's block of
  // `output` (in place). Returns the collective's Work (waited before the
  // output is read), or nullptr when it has already finished. Required
  // (ArgumentError naming "all_gather" when empty).
  std::function<WorkPtr(at::Tensor output, const at::Tensor& input, ProcessGroup& group)>
      all_gather;
};

// A unit's own reduce-scatter of gradients (FSDP2's
// set_custom_reduce_scatter). The HSDP all-reduce over the replicate dim is
// not affected (see set_all_reduce_hook).
struct CustomReduceScatter {
  // The input buffer: `numel` elements of `options`; empty = the group's own.
  // Errors as CustomAllGather::allocate.
  std::function<at::Tensor(int64_t numel, const at::TensorOptions& options)> allocate;
  // output <- this rank's block of the elementwise `op` (SUM) over every
  // rank's input, as ProcessGroup::reduce_scatter_tensor. Returns its Work
  // or nullptr. Required (ArgumentError naming "reduce_scatter").
  std::function<WorkPtr(at::Tensor output, const at::Tensor& input, ReduceOp op,
                        ProcessGroup& group)>
      reduce_scatter;
};

// Runs on a parameter group's reduced gradients before they are installed
// (FSDP2's set_all_reduce_hook): after the reduce-scatter, and for HSDP after
// the all-reduce over the replicate dim -- or, with
// set_requires_all_reduce(false) / a 1-D mesh, in place of it (how TorchFT
// all-reduces across replica groups it manages itself). `reduced` is flat,
// in reduce_dtype, already divided ("avg") and scaled
// (set_gradient_scaling_factor): exactly what param.grad() receives (added
// to any gradient it holds). Modify it in place. Called once per reduction
// output: per parameter group with comm_fusion, per parameter without, and
// per parameter's whole gradient where a rank reduces alone (one shard rank,
// no replicate dim). A fused output also covers the group's parameters no
// rank had a gradient for (zeros, not installed afterwards); unfused, those
// are skipped. Not called while HSDP keeps sums back (set_requires_all_reduce(false) on a 2-D
// mesh: the hook runs when they are all-reduced).
using AllReduceHook = std::function<void(const at::Tensor& reduced)>;

}  // namespace fsdp
