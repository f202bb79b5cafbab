// Internal: one parameter managed by fully_shard -- its shard, its unsharded
// compute buffer, and its gradients in every form.
#pragma once

#include "fsdp/dtensor.h"
#include "fsdp/fully_shard.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

// Dtypes a unit computes and reduces in.
struct UnitDtypes {
  std::optional<c10::ScalarType> param;   // none = each parameter's own
  std::optional<c10::ScalarType> reduce;  // none = param, else own
};

class ShardedParam {
 public:
  // Takes `param` (the Variable the module holds) over: after construction
  // its data is the local shard. `shard_size`/`shard_rank` describe the shard
  // group; placement is Shard(d) (validated) or Replicate.
  ShardedParam(std::string name, at::Tensor param, Placement placement, int64_t shard_size,
               int64_t shard_rank, const UnitDtypes& dtypes, c10::Device compute_device,
               bool offload, bool pin_memory);

  const std::string& name() const { return name_; }
  const at::Tensor& param() const { return param_; }
  const Placement& placement() const { return placement_; }
  bool is_sharded_placement() const { return placement_.is_shard(); }
  const std::vector<int64_t>& full_shape() const { return full_shape_; }
  bool requires_grad() const { return param_.requires_grad(); }

  // Elements of one rank's padded block: chunk * (product of the other dims).
  int64_t padded_block_numel() const { return block_numel_; }
  // The local shard (owned rows, original layout).
  const at::Tensor& local() const { return local_; }

  // ---- unshard ----
  // The all-gather input for this rank: the padded shard in param_dtype on the
  // compute device (a cast copy into a reused buffer when needed).
  at::Tensor all_gather_input();
  // The all-gather output buffer [shard_size * block] (regrown in place).
  at::Tensor all_gather_output();
  // Points the module's parameter at the full tensor (after the gather), or
  // at the param_dtype copy of the full tensor for Replicate placements.
  void to_unsharded();
  // Points the parameter back at its local shard and frees the full buffer.
  void to_sharded();

  // ---- gradients ----
  // Installs (once per AccumulateGrad node) the hook that calls `on_ready`
  // after autograd accumulated the full gradient into param().grad().
  void ensure_grad_hook(std::function<void()> on_ready);
  // Takes the full gradient out of param().grad() (leaving it undefined) and
  // adds it, in reduce_dtype, to the unsharded gradient.
  void take_unsharded_grad();
  const at::Tensor& unsharded_grad() const { return unsharded_grad_; }
  // The reduce-scatter input for this parameter: the unsharded gradient
  // (zeros if none arrived), dim moved first and zero-padded, flattened.
  at::Tensor reduce_scatter_input();
  void clear_unsharded_grad() { unsharded_grad_ = at::Tensor(); }
  // Adds this rank's reduced block (reduce dtype; the full gradient for a
  // Replicate placement) to the sharded gradient, or to the fp32 main grad.
  void add_reduced_grad(const at::Tensor& reduced, bool to_fp32_main_grad);
  // A copy of the sharded gradient as installed now (undefined if none).
  at::Tensor sharded_grad_copy(bool fp32_main_grad) const;
  // Puts back a gradient taken by sharded_grad_copy.
  void restore_grad(const at::Tensor& g, bool fp32_main_grad);
  void zero_grad();
  const at::Tensor& main_grad() const { return main_grad_; }

  // Overwrites the shard from a tensor of the local shape (values only).
  void load_local(const at::Tensor& local_values);

 private:
  at::Tensor owned(const at::Tensor& block) const;  // block [c, rest] -> local layout
  void set_grad(const at::Tensor& g);
  at::Tensor current_sharded_grad() const;

  std::string name_;
  at::Tensor param_;
  Placement placement_;
  std::vector<int64_t> full_shape_;
  c10::ScalarType orig_dtype_, param_dtype_, reduce_dtype_;
  c10::Device compute_device_;
  int64_t shard_size_, shard_rank_;
  int64_t dim_ = 0;         // shard dim (Shard placements)
  int64_t chunk_ = 0;       // ceil(rows / shard_size)
  int64_t owned_rows_ = 0;
  int64_t block_numel_ = 0;
  std::vector<int64_t> moved_shape_;  // full shape with the shard dim first

  at::Tensor padded_;           // [chunk, rest] orig dtype: the shard's storage
  at::Tensor local_;            // owned rows in the original layout (view of padded_)
  at::Tensor gather_input_;     // param_dtype copy of padded_ (when dtypes/devices differ)
  at::Tensor unsharded_buf_;    // [shard_size * chunk, rest] param_dtype
  at::Tensor full_;             // the full parameter (view of unsharded_buf_)
  bool unsharded_ = false;

  std::shared_ptr<torch::autograd::Node> hooked_accumulator_;  // strong: the param holds it weakly
  at::Tensor unsharded_grad_;   // full shape, reduce dtype
  at::Tensor stashed_grad_;     // sharded grad while the param is unsharded
  at::Tensor main_grad_;        // fp32 main grad (apply_grad_on_fp32_main_grad)
};

}  // namespace fsdp::detail
