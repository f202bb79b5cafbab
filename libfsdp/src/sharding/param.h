// Internal: one parameter managed by fully_shard -- its layout, its shard,
// its unsharded compute buffer, and its gradients in every form.
#pragma once

#include "fsdp/process_group.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/dtensor.h"
#include "fsdp/mesh.h"
#include "base/torch_compat.h"
#include "sharding/host_copy_fence.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

// Dtypes a unit computes and reduces in.
struct UnitDtypes {
  std::optional<c10::ScalarType> param;   // none = each parameter's own
  std::optional<c10::ScalarType> reduce;  // none = param, else own
};

// Where a managed parameter lives. FSDP sees only the tensor the module
// computes with (for a TP/EP DTensor: its local tensor) and splits it over
// the shard group (`fsdp`: Shard(d) of that tensor, or Replicate). The SPMD
// view says what the shard is of the global tensor: one placement per dim of
// the mesh made of FSDP's dims and the dims carried through (tp, ep).
struct ParamLayout {
  Placement fsdp = Placement::Shard(0);
  ProcessGroupPtr shard_group;
  std::optional<DeviceMesh> spmd_mesh;
  std::vector<Placement> spmd_placements;
  std::vector<int64_t> global_shape;
  // Groups over which the gradient's shards are split (mesh dims that
  // shard the global tensor, size > 1): a norm sums over them.
  std::vector<ProcessGroupPtr> split_groups;
  // Carried dims (size > 1) over which the parameter is replicated but its
  // gradient is a partial sum (DistributedParam::grad_placements): the
  // gradient is all-reduced over them before FSDP's own reduction.
  std::vector<ProcessGroupPtr> grad_partial_groups;
};

class ShardedParam {
 public:
  // Takes `param` (the Variable the module holds) over: after construction
  // its data is the local shard. A meta `param` (built under fsdp::MetaInit)
  // gets a meta shard -- no memory -- until materialize(); compute_device is
  // then the unit's device, not the parameter's.
  ShardedParam(std::string name, at::Tensor param, ParamLayout layout, const UnitDtypes& dtypes,
               c10::Device compute_device, bool offload, bool pin_memory);

  const std::string& name() const { return name_; }
  const at::Tensor& param() const { return param_; }
  const ParamLayout& layout() const { return layout_; }
  bool is_sharded_placement() const { return layout_.fsdp.is_shard(); }
  // Shape of the tensor the module computes with (the TP-local shape for a
  // DTensor parameter).
  const std::vector<int64_t>& full_shape() const { return full_shape_; }
  bool requires_grad() const { return param_.requires_grad(); }
  c10::ScalarType compute_dtype() const { return param_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  c10::Device compute_device() const { return compute_device_; }

  // Elements of one rank's padded block: chunk * (product of the other dims).
  int64_t padded_block_numel() const { return block_numel_; }
  // The local shard (owned rows, original layout).
  const at::Tensor& local() const { return local_; }
  // The local shard as a piece of the global tensor.
  DTensor dtensor() const;

  // ---- unshard ----
  // The full tensor is the shard itself (no copy to unshard, nothing to free
  // on reshard): one rank holds the whole parameter (shard group of one, or a
  // Replicate placement) in param_dtype on the compute device.
  bool full_is_shard() const { return full_is_shard_; }
  // Shard group of one: fills the full buffer from the shard (a cast or an
  // upload; nothing when full_is_shard()).
  void unshard_locally();
  // Writes the padded shard, in param_dtype on the compute device, into `dst`
  // (padded_block_numel() elements; this rank's block of an all-gather output,
  // which then gathers in place): a copy or a cast, and from an offloaded,
  // pinned shard a non-blocking upload (see wait_host_copies).
  void copy_in(const at::Tensor& dst);
  // The all-gather output buffer [shard_size * block] (regrown in place).
  // `allocate` (a custom all-gather's) makes it the first time, if given.
  at::Tensor all_gather_output(
      const std::function<at::Tensor(int64_t, const at::TensorOptions&)>* allocate = nullptr);
  // Forgets the full buffer (sharded only): the next unshard allocates anew.
  void drop_full_buffer();
  // The full (padded) buffer as a flat view while unsharded, rank-major in
  // blocks of padded_block_numel(); undefined before the first unshard.
  at::Tensor unsharded_flat() const {
    return unsharded_buf_.defined() ? unsharded_buf_.view({-1}) : at::Tensor();
  }
  // Points the module's parameter at the full tensor (after the gather), or
  // at the param_dtype copy of the full tensor for Replicate placements.
  void to_unsharded();
  // Points the parameter back at its local shard and frees the full buffer.
  void to_sharded();
  // set_unshard_in_backward(false): points the parameter at a full-shape,
  // compute-dtype tensor of one element (stride 0) -- what autograd checks a
  // full gradient against -- without gathering values. to_sharded() undoes it.
  void to_value_free_full();

  // ---- all-gather extension (comm_hooks.h) ----
  // Set before the parameter's group is built (Shard placements only).
  void set_extension(std::shared_ptr<const AllGatherExtension> extension);
  const std::shared_ptr<const AllGatherExtension>& extension() const { return extension_; }
  // pre_all_gather's input: the padded shard as [rows, cols], in the
  // parameter's own dtype on the compute device.
  at::Tensor shard_2d() const;
  // Fills the full buffer from post_all_gather's result (checked by the caller).
  void install_full(const at::Tensor& full_padded);
  // The full buffer's row count and column count ([rows, cols] of install_full).
  int64_t full_rows() const { return chunk_ * shard_size_; }
  int64_t full_cols() const { return chunk_ == 0 ? 0 : block_numel_ / chunk_; }
  bool unsharded() const { return unsharded_; }

  // ---- gradients ----
  // Installs (once per AccumulateGrad node) the hook that calls `on_ready`
  // after autograd accumulated the full gradient into param().grad().
  void ensure_grad_hook(std::function<void()> on_ready);
  // Takes this pass's full gradient out of param().grad() (leaving it
  // undefined), in reduce_dtype.
  void take_pass_grad();
  // A gradient arrived on this rank, in this pass or in unsynchronised ones.
  bool has_local_grad() const { return pass_grad_.defined() || accumulated_grad_.defined(); }
  // Writes the gradient to reduce (accumulated + this pass; zeros where
  // none) into `dst`: [shard_size, block] (a row per destination rank, the
  // shard dim first, zero-padded) for Shard placements, [numel] otherwise.
  // `dst` may be a strided view into a fused buffer: this is the only copy
  // (but for a gradient partial over carried dims, first summed over them,
  // in reduce_dtype, which is collective over those groups).
  void write_reduce_input(const at::Tensor& dst) const;
  // Shard group of one: the gradient to install as it is, in the parameter's
  // layout and reduce_dtype (accumulated + this pass, summed over the carried
  // partial groups first, which is collective there). Moves this pass's
  // gradient out; undefined if this rank has none.
  at::Tensor take_local_grad();
  // The pass is over: reduced (sync) gradients are dropped; unsynchronised
  // ones join the accumulated gradient.
  void commit_pass(bool reduced);
  // A failed pass: its gradient is forgotten, earlier accumulation kept.
  void discard_pass() { pass_grad_ = at::Tensor(); }
  // Full gradient accumulated by unsynchronised passes (reduce dtype).
  const at::Tensor& unsynced_grad() const { return accumulated_grad_; }
  // Adds this rank's reduced block (reduce dtype; the full gradient for a
  // Replicate placement) to the sharded gradient, or to the fp32 main grad.
  // With an offloaded, pinned shard and no gradient yet, a non-blocking
  // download into a pinned gradient (see wait_host_copies).
  // `reduced` is multiplied by `scale` on the way.
  void add_reduced_grad(const at::Tensor& reduced, double scale, bool to_fp32_main_grad);
  // Adds a gradient in the parameter's own layout (take_local_grad's) times
  // `scale`; `g` is handed over (kept as the gradient where possible).
  void add_local_grad(const at::Tensor& g, double scale, bool to_fp32_main_grad);
  // Blocks until this parameter's non-blocking host copies (CPU offload on
  // CUDA) have run: before the host reads its gradient or writes its shard.
  void wait_host_copies() { host_copies_.wait(); }
  // A copy of the sharded gradient as installed now (undefined if none).
  at::Tensor sharded_grad_copy(bool fp32_main_grad) const;
  // Puts back a gradient taken by sharded_grad_copy.
  void restore_grad(const at::Tensor& g, bool fp32_main_grad);
  void zero_grad();
  const at::Tensor& main_grad() const { return main_grad_; }

  // Overwrites the shard from a tensor of the local shape (values only).
  void load_local(const at::Tensor& local_values);

  // ---- deferred initialisation (fsdp/deferred_init.h) ----
  // The shard is still on the meta device.
  bool deferred() const { return deferred_; }
  // Allocates the shard's storage (zeros; on the compute device, or in CPU
  // memory when offloaded) and points the parameter at it. No-op unless
  // deferred().
  void materialize();
  // StateError naming the parameter while deferred(): `op` would read a
  // shard that has no values yet.
  void check_materialized(const char* op) const;

  // ---- memory accounting (fsdp/memory.h): the buffers as held now ----
  // The shard's storage (padded rows, original dtype; the local shard and,
  // sharded, the parameter are views of it).
  const at::Tensor& shard_storage() const { return padded_; }
  // The unsharded buffer (its storage is released, 0 bytes, while sharded);
  // undefined before the first unshard.
  const at::Tensor& unsharded_buffer() const { return unsharded_buf_; }
  // This pass's full gradient taken from autograd (reduce dtype), and the
  // sharded gradient set aside while the parameter is unsharded.
  const at::Tensor& pass_grad() const { return pass_grad_; }
  const at::Tensor& stashed_grad() const { return stashed_grad_; }

 private:
  at::Tensor owned(const at::Tensor& block) const;  // block [c, rest] -> local layout
  void set_grad(const at::Tensor& g);
  at::Tensor current_sharded_grad() const;
  // Accumulated + this pass's gradient, a tensor of its own (this pass's
  // alone is cloned only if `copy_pass`); undefined if neither.
  at::Tensor summed_grad(bool copy_pass) const;
  // Accumulated + this pass's gradient, summed over the carried partial
  // groups (collective there; zeros where none). A new tensor.
  at::Tensor partial_summed_grad() const;
  // Adds `g` (local layout, reduce dtype) times `scale` to the sharded
  // gradient; `owned`: `g` is no one else's and may be kept (or scaled in place).
  void install_grad(const at::Tensor& g, double scale, bool to_fp32_main_grad, bool owned);

  std::string name_;
  at::Tensor param_;
  ParamLayout layout_;
  std::vector<int64_t> full_shape_;
  c10::ScalarType orig_dtype_, param_dtype_, reduce_dtype_;
  c10::Device compute_device_;
  int64_t shard_size_, shard_rank_;
  int64_t dim_ = 0;         // shard dim (Shard placements)
  int64_t chunk_ = 0;       // ceil(rows / shard_size)
  int64_t owned_rows_ = 0;
  int64_t block_numel_ = 0;
  std::vector<int64_t> moved_shape_;  // full shape with the shard dim first

  HostCopyFence host_copies_;   // pinned uploads / downloads still in flight
  at::Tensor padded_;           // [chunk, rest] orig dtype: the shard's storage
  at::Tensor local_;            // owned rows in the original layout (view of padded_)
  at::Tensor unsharded_buf_;    // [shard_size * chunk, rest] param_dtype
  at::Tensor full_;             // the full parameter (view of unsharded_buf_)
  bool unsharded_ = false;
  bool full_is_shard_ = false;
  bool deferred_ = false;       // the shard is a meta tensor (materialize())
  bool offload_ = false, pin_memory_ = false;

  at::TensorOptions storage_options() const;
  bool full_is_shard_now() const;
  std::shared_ptr<const AllGatherExtension> extension_;

  compat::NodePtr hooked_accumulator_;  // strong: the param holds it weakly
  at::Tensor pass_grad_;         // this pass's full gradient, reduce dtype
  at::Tensor accumulated_grad_;  // earlier unsynchronised passes, reduce dtype
  at::Tensor stashed_grad_;      // sharded grad while the param is unsharded
  at::Tensor main_grad_;         // fp32 main grad (apply_grad_on_fp32_main_grad)
};

}  // namespace fsdp::detail
