// Internal: the parameters of one unit that share a mesh, and their state
// between collectives -- sharded, gathering, unsharded, kept as hpZ pieces
// after forward, reducing. All-gather to unshard (per parameter or fused over
// one flat buffer) and the gradient reduction (gradient_reduction.h) run
// from here; the pieces they share are collectives.h. A unit has one group per
// distinct FSDP mesh.
#pragma once

#include "fsdp/process_group.h"
#include "sharding/collectives.h"
#include "sharding/gradient_reduction.h"
#include "sharding/param.h"
#include "sharding/post_forward.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

class ParamGroup {
 public:
  // divide_factor: "avg" divides by it (none = shard x replicate size).
  ParamGroup(std::vector<ShardedParam> params, ProcessGroupPtr shard_group,
             ProcessGroupPtr replicate_group, std::optional<double> divide_factor, bool fused);
  ParamGroup(ParamGroup&&) noexcept;
  ParamGroup& operator=(ParamGroup&&) noexcept;
  ~ParamGroup();

  std::vector<ShardedParam>& params() { return params_; }
  const std::vector<ShardedParam>& params() const { return params_; }
  const ProcessGroupPtr& shard_group() const { return shard_group_; }
  const ProcessGroupPtr& replicate_group() const { return replicate_group_; }
  void set_divide_factor(std::optional<double> f) { reduction_.set_divide_factor(f); }
  // Whether any parameter requires a gradient (the group reduces at all).
  bool reduces() const;

  // ---- unshard ----
  // Issues the all-gathers (async); no-op if unsharded or already issued.
  void issue_unshard();
  // Waits for issued all-gathers (issuing them first if needed) and points
  // every parameter at its full tensor.
  void finish_unshard();
  bool unsharded() const { return unsharded_; }
  // An all-gather issued (issue_unshard) and not yet waited (finish_unshard).
  bool gather_in_flight() const { return gather_issued_; }
  // Points every parameter at its shard and frees the full buffers (waits
  // for an all-gather in flight first: its buffers must not be freed).
  // Drops what reshard_after_forward kept for the post-forward group.
  void reshard();

  // ---- hpZ (ReshardAfterForward's integer form) ----
  // reshard() after forward, or nothing for a target that keeps the
  // parameters full. With a target group of P ranks, this rank first keeps
  // its 1/P of every gathered parameter (the blocks of shard ranks
  // [j * N/P, (j+1) * N/P) for its index j in that group), and the next
  // issue_unshard all-gathers those pieces over the P ranks instead of the
  // N-rank shard group -- the same bits, since an all-gather only moves them.
  void reshard_after_forward(const PostForwardTarget& target);
  // Whether the pieces kept by reshard_after_forward are held.
  bool holds_post_forward_shards() const { return !post_forward_pieces_.empty(); }
  // Drops them: the next unshard gathers over the shard group. A new forward
  // pass does this, so pieces are only ever used by the backward of the
  // forward that kept them (the parameters may change in between passes),
  // and so does a new reshard_after_forward setting.
  void drop_post_forward_shards();

  // ---- gradients (GradientReduction) ----
  // Builds the reduction input from this pass's (and earlier unsynchronised
  // passes') gradients, zeros standing in for missing ones, and a presence
  // flag per parameter riding in the same buffer: after the reduction it
  // says whether any rank had a gradient. Drops the pass gradients.
  void prepare_reduce(const ReduceSettings& settings) {
    reduction_.prepare(params_, settings, route_);
  }
  bool reduce_prepared() const { return reduction_.prepared(); }
  // Issues the prepared reduce-scatter (and the all-reduce over the shard
  // group of Replicate parameters).
  void issue_reduce() { reduction_.issue(route_); }
  // HSDP: issues the replicate all-reduces now due, in the order their
  // reduce-scatters were issued (GradientReduction::poll_all_reduces).
  static void poll_all_reduces() { GradientReduction::poll_all_reduces(); }
  bool reduce_pending() const { return reduction_.pending(); }
  // Nothing of the reduction is left to wait for (none pending, or every
  // collective issued and complete): finish_reduce would not block.
  bool reduce_complete() const { return reduction_.complete(); }
  // Waits for the reduction and adds the results to the sharded gradients
  // (only where some rank had a gradient).
  void finish_reduce() { reduction_.finish(params_, route_); }
  // Blocks until the parameters' non-blocking host copies (CPU offload on
  // CUDA) have run; finish_reduce ends with it, so installed gradients are
  // readable and the shards writable.
  void wait_host_copies();
  // A failed pass: waits for what is in flight and drops it.
  void drop_reduce() { reduction_.drop(); }
  // Forgets sums kept back by steps that skipped the HSDP all-reduce (their
  // gradients were dropped by zero_grad).
  void clear_partial_sums() { reduction_.clear_partial_sums(); }

  // ---- set_unshard_in_backward(false) ----
  // Points every parameter not unsharded at a value-free full-shape tensor
  // (ShardedParam::to_value_free_full) instead of gathering; drops hpZ pieces
  // and waits out a gather in flight (a prefetch) first. reshard() undoes it.
  void expose_without_values();

  // ---- extension points (fsdp/comm_hooks.h) ----
  // Custom collectives; null restores the group's own. The buffers they
  // allocate are made anew from the next unshard (StateError while the group
  // is unsharded or a gather is in flight: the caller checks).
  void set_custom_all_gather(std::shared_ptr<const CustomAllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<const CustomReduceScatter> comm) {
    route_.custom_reduce_scatter = std::move(comm);
  }
  void set_all_reduce_hook(std::shared_ptr<const AllReduceHook> hook) {
    reduction_.set_all_reduce_hook(std::move(hook));
  }
  // For error messages: the owning unit's label ("block0 #2").
  void set_owner_label(std::function<std::string()> label) {
    route_.owner_label = std::move(label);
  }

  // ---- memory accounting (fsdp/memory.h): the buffers held now ----
  // The fused all-gather output (storage released between gathers).
  const at::Tensor& fused_gather_out() const { return fused_gather_out_; }
  // hpZ: the pieces kept after forward (undefined entries for Replicate).
  const std::vector<at::Tensor>& post_forward_pieces() const { return post_forward_pieces_; }
  // A prepared or issued reduction's buffers (reduce-scatter inputs and
  // outputs, all-reduce buffers) and the gradients of a local reduction.
  const std::vector<at::Tensor>& reduce_buffers() const { return reduction_.buffers(); }
  const std::vector<std::pair<size_t, at::Tensor>>& local_grads() const {
    return reduction_.local_grads();
  }
  // HSDP sums kept back while the all-reduce is skipped, and the gradients
  // they restore.
  const std::vector<at::Tensor>& partial_sums() const { return reduction_.partial_sums(); }
  const std::vector<at::Tensor>& base_grads() const { return reduction_.base_grads(); }

 private:
  // Allocates (or regrows in place) fused_gather_out_ for ws ranks; its bytes.
  size_t fused_gather_buffer(int64_t ws);
  // issue_unshard's hpZ path: the pieces' all-gathers over their group.
  void issue_post_forward_unshard();
  void forget_post_forward_pieces();
  // issue_unshard's collectives (it undoes them if one of them throws).
  void issue_gathers();
  // Whether parameter i goes through an all-gather extension.
  bool extended(size_t i) const { return params_[i].extension() != nullptr; }

  std::vector<ShardedParam> params_;
  ProcessGroupPtr shard_group_;
  ProcessGroupPtr replicate_group_;
  // Per parameter, this rank's piece kept by reshard_after_forward (undefined
  // for Replicate placements); empty when none are held.
  std::vector<at::Tensor> post_forward_pieces_;
  // The post-forward group those pieces are gathered over, while held.
  ProcessGroupPtr post_forward_pieces_group_;
  bool fused_;
  bool unsharded_ = false;
  bool gather_issued_ = false;
  std::vector<WorkPtr> gather_works_;
  at::Tensor fused_gather_out_;  // [shard_size * total]
  std::vector<int64_t> fused_offsets_;  // per parameter, within one rank's block
  int64_t fused_block_numel_ = 0;
  at::TensorOptions fused_gather_options_;  // the first sharded parameter's dtype, device
  bool has_extensions_ = false;  // a parameter has an extension (fixed at construction)

  CollectiveRoute route_;
  ExtensionGather extensions_;
  GradientReduction reduction_;
};

}  // namespace fsdp::detail
