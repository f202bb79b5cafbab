// Internal: the parameters of one unit that share a mesh, and the collectives
// that move them -- all-gather to unshard, reduce-scatter (+ all-reduce over
// the replicate dim for HSDP) to reduce gradients, per parameter or fused
// over one flat buffer. A unit has one group per distinct FSDP mesh.
#pragma once

#include "fsdp/comm.h"
#include "sharding/param.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

struct ReduceSettings {
  bool average = true;                  // "avg": divide by the divide factor
  std::optional<double> scaling_factor;  // extra multiplier
  bool all_reduce = true;               // HSDP: all-reduce over the replicate dim
  bool fp32_main_grad = false;
};

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
  void set_divide_factor(std::optional<double> f) { divide_factor_ = f; }
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
  // The post-forward group: consecutive ranks of the shard group (a
  // subgroup_for), or null to reshard fully after forward. keep_full: a
  // post-forward group of one rank, i.e. reshard_after_forward_ does
  // nothing (FSDP2's int 1 == False).
  void set_post_forward_group(ProcessGroupPtr group, bool keep_full = false);
  // reshard() after forward. With a post-forward group of P ranks, this rank
  // first keeps its 1/P of every gathered parameter (the blocks of shard
  // ranks [j * N/P, (j+1) * N/P) for its index j in that group), and the next
  // issue_unshard all-gathers those pieces over the P ranks instead of the
  // N-rank shard group -- the same bits, since an all-gather only moves them.
  void reshard_after_forward();
  // Whether the pieces kept by reshard_after_forward are held.
  bool holds_post_forward_shards() const { return !post_forward_pieces_.empty(); }
  // Drops them: the next unshard gathers over the shard group. A new forward
  // pass does this, so pieces are only ever used by the backward of the
  // forward that kept them (the parameters may change in between passes).
  void drop_post_forward_shards();

  // ---- gradients ----
  // Builds the reduction input from this pass's (and earlier unsynchronised
  // passes') gradients, zeros standing in for missing ones, and a presence
  // flag per parameter riding in the same buffer: after the reduction it
  // says whether any rank had a gradient. Drops the pass gradients.
  void prepare_reduce(const ReduceSettings& settings);
  bool reduce_prepared() const { return stage_ == Stage::Prepared; }
  // Issues the prepared reduce-scatter (and the all-reduce over the shard
  // group of Replicate parameters).
  void issue_reduce();
  // HSDP: the all-reduces over the replicate groups are issued as soon as
  // their reduce-scatters have finished, so they overlap the rest of
  // backward -- but strictly in the order the reduce-scatters were issued
  // (one process-wide queue: a communicator's collectives must come in one
  // order on every rank, whatever the timing). Issues those now due.
  static void poll_all_reduces();
  bool reduce_pending() const { return stage_ != Stage::None; }
  // Nothing of the reduction is left to wait for (none pending, or every
  // collective issued and complete): finish_reduce would not block.
  bool reduce_complete() const;
  // Waits for the reduction and adds the results to the sharded gradients
  // (only where some rank had a gradient).
  void finish_reduce();
  // Blocks until the parameters' non-blocking host copies (CPU offload on
  // CUDA) have run; finish_reduce ends with it, so installed gradients are
  // readable and the shards writable.
  void wait_host_copies();
  // A failed pass: waits for what is in flight and drops it.
  void drop_reduce();
  // Forgets sums kept back by steps that skipped the HSDP all-reduce (their
  // gradients were dropped by zero_grad).
  void clear_partial_sums();

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
  void set_custom_reduce_scatter(std::shared_ptr<const CustomReduceScatter> comm);
  void set_all_reduce_hook(std::shared_ptr<const AllReduceHook> hook) {
    all_reduce_hook_ = std::move(hook);
  }
  // For error messages: the owning unit's label ("block0 #2").
  void set_owner_label(std::function<std::string()> label) { owner_label_ = std::move(label); }

  // ---- memory accounting (fsdp/memory.h): the buffers held now ----
  // The fused all-gather output (storage released between gathers).
  const at::Tensor& fused_gather_out() const { return fused_gather_out_; }
  // hpZ: the pieces kept after forward (undefined entries for Replicate).
  const std::vector<at::Tensor>& post_forward_pieces() const { return post_forward_pieces_; }
  // A prepared or issued reduction's buffers (reduce-scatter inputs and
  // outputs, all-reduce buffers) and the gradients of a local reduction.
  const std::vector<at::Tensor>& reduce_buffers() const { return scatter_inputs_; }
  const std::vector<std::pair<size_t, at::Tensor>>& local_grads() const { return local_grads_; }
  // HSDP sums kept back while the all-reduce is skipped, and the gradients
  // they restore.
  const std::vector<at::Tensor>& partial_sums() const { return partial_sums_; }
  const std::vector<at::Tensor>& base_grads() const { return base_grads_; }

 private:
  enum class Stage { None, Prepared, Scattering, AllReducing };
  struct Entry;
  bool hsdp() const { return replicate_group_ && replicate_group_->size() > 1; }
  // One rank holds every gradient whole: there is nothing to reduce.
  bool reduces_locally() const { return shard_group_->size() == 1 && !hsdp(); }
  // What "avg" divides the summed gradients by: the divide factor if set,
  // else shard x replicate size.
  double divide() const;
  void wait_all(std::vector<WorkPtr>& works, const char* what);
  // Issues the replicate all-reduce if the reduce-scatter finished (or
  // after waiting for it, `wait`); returns whether it is issued or needs none.
  bool issue_all_reduce(bool wait);
  // Issues, in queue order, every queued all-reduce up to this group's.
  void flush_all_reduces_through();
  void leave_all_reduce_queue();
  void install();

  // prepare_reduce's work, under its out-of-memory guard.
  void prepare_reduce_buffers(const ReduceSettings& settings);
  // Allocates (or regrows in place) fused_gather_out_ for ws ranks; its bytes.
  size_t fused_gather_buffer(int64_t ws);
  // issue_unshard's hpZ path: the pieces' all-gathers over the post-forward group.
  void issue_post_forward_unshard();
  // issue_unshard's collectives (it undoes them if one of them throws).
  void issue_gathers();
  // Whether parameter i goes through an all-gather extension.
  bool extended(size_t i) const { return params_[i].extension() != nullptr; }
  // Runs every extension's pre_all_gather, checked against the first call's
  // outputs; returns them per extended parameter (in params_ order).
  std::vector<std::vector<at::Tensor>> run_pre_all_gathers();
  // Runs parameter i's post_all_gather on `gathered`, checks and installs it.
  void run_post_all_gather(size_t i, const std::vector<at::Tensor>& gathered, int64_t ws);
  // The extension outputs of every extended parameter in one byte all-gather.
  void issue_extension_gather(int64_t ws, int64_t me);
  void finish_extension_gather(int64_t ws);
  // ws == 1: pre and post without a collective.
  void unshard_extensions_locally();
  // All-gather / reduce-scatter through the custom collective if set.
  WorkPtr all_gather(const ProcessGroupPtr& group, at::Tensor out, const at::Tensor& in);
  WorkPtr reduce_scatter(at::Tensor out, const at::Tensor& in);
  // A buffer for a collective: the custom allocate (checked) or `fallback`.
  at::Tensor collective_buffer(const CustomAllGather* ag, const CustomReduceScatter* rs,
                               const ProcessGroupPtr& group, at::IntArrayRef shape,
                               const at::TensorOptions& options);
  // The reduced gradients of `entries_` (and the local ones) scaled in place
  // and handed to the all-reduce hook; returns the scale still to apply.
  void apply_all_reduce_hook(double full_scale);

  std::vector<ShardedParam> params_;
  ProcessGroupPtr shard_group_;
  ProcessGroupPtr post_forward_group_;
  bool keep_full_after_forward_ = false;
  // Per parameter, this rank's piece kept by reshard_after_forward (undefined
  // for Replicate placements); empty when none are held.
  std::vector<at::Tensor> post_forward_pieces_;
  ProcessGroupPtr replicate_group_;
  // The reductions' own groups over the same ranks (reduction_group_for).
  ProcessGroupPtr scatter_group_;
  ProcessGroupPtr all_reduce_group_;
  std::optional<double> divide_factor_;
  bool fused_;
  bool unsharded_ = false;
  bool gather_issued_ = false;
  std::vector<WorkPtr> gather_works_;
  at::Tensor fused_gather_out_;  // [shard_size * total]
  std::vector<int64_t> fused_offsets_;  // per parameter, within one rank's block
  int64_t fused_block_numel_ = 0;
  at::TensorOptions fused_gather_options_;  // the first sharded parameter's dtype, device

  // Extensions: what the first pre_all_gather returned per extended
  // parameter (shape, dtype of each output), and where each output's bytes
  // sit in one rank's block of the byte all-gather.
  struct ExtensionOutput {
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
    int64_t offset = 0;  // bytes into a rank's block
    int64_t nbytes = 0;
  };
  std::vector<std::vector<ExtensionOutput>> ext_outputs_;  // per parameter (empty: none)
  int64_t ext_block_bytes_ = 0;
  at::Tensor ext_gather_out_;  // [ws * ext_block_bytes_] uint8, while a gather is issued
  bool ext_gather_issued_ = false;
  bool ext_recorded_ = false;
  bool has_extensions_ = false;  // a parameter has an extension (fixed at construction)
  // The fused reduction output's gradient part (what the all-reduce hook sees).
  at::Tensor fused_grad_view_;

  std::shared_ptr<const CustomAllGather> custom_all_gather_;
  std::shared_ptr<const CustomReduceScatter> custom_reduce_scatter_;
  std::shared_ptr<const AllReduceHook> all_reduce_hook_;
  std::function<std::string()> owner_label_;
  std::string owner() const { return owner_label_ ? owner_label_() : std::string("?"); }

  Stage stage_ = Stage::None;
  ReduceSettings settings_;
  std::vector<Entry> entries_;              // per reduced parameter
  // reduces_locally(): (parameter, its gradient; undefined if none)
  std::vector<std::pair<size_t, at::Tensor>> local_grads_;
  std::vector<at::Tensor> scatter_inputs_;  // kept alive until the collective ran
  std::vector<at::Tensor> all_reduce_bufs_;  // what the replicate all-reduce covers
  std::vector<WorkPtr> scatter_works_;
  std::vector<WorkPtr> all_reduce_works_;
  // HSDP with the all-reduce skipped: per-parameter sum of the shard-group
  // reductions not yet all-reduced (gradient, presence), and the sharded grad
  // they started from.
  std::vector<at::Tensor> partial_sums_;
  std::vector<double> partial_presence_;
  std::vector<at::Tensor> base_grads_;
};

}  // namespace fsdp::detail
