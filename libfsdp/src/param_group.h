// Internal: one unit's parameters and the collectives that move them --
// all-gather to unshard, reduce-scatter (+ all-reduce for HSDP) to reduce
// gradients, per parameter or fused over one flat buffer.
#pragma once

#include "fsdp/comm.h"
#include "fsdp_param.h"

#include <memory>
#include <optional>
#include <vector>

namespace fsdp::detail {

struct ReduceSettings {
  bool average = true;                  // "avg": mean over all data-parallel ranks
  std::optional<double> scaling_factor;  // extra multiplier
  bool all_reduce = true;               // HSDP: all-reduce over the replicate dim
  bool fp32_main_grad = false;
};

class ParamGroup {
 public:
  ParamGroup(std::vector<ShardedParam> params, ProcessGroupPtr shard_group,
             ProcessGroupPtr replicate_group, bool fused);

  std::vector<ShardedParam>& params() { return params_; }
  const std::vector<ShardedParam>& params() const { return params_; }
  const ProcessGroupPtr& shard_group() const { return shard_group_; }
  const ProcessGroupPtr& replicate_group() const { return replicate_group_; }

  // Issues the all-gathers (async); no-op if unsharded or already issued.
  void issue_unshard();
  // Waits for issued all-gathers (issuing them first if needed) and points
  // every parameter at its full tensor.
  void finish_unshard();
  bool unsharded() const { return unsharded_; }
  bool unshard_in_flight() const { return !gather_works_.empty() || gather_issued_; }
  // Points every parameter at its shard and frees the full buffers.
  void reshard();

  // Issues the gradient reduction of the parameters that require grad.
  void issue_reduce(const ReduceSettings& settings);
  bool reduce_in_flight() const { return reduce_pending_; }
  // Waits for the reduction and adds the results to the sharded gradients.
  void finish_reduce();
  // Forgets sums kept back by steps that skipped the HSDP all-reduce (their
  // gradients were dropped by zero_grad).
  void clear_partial_sums();

 private:
  struct PendingReduce;
  std::vector<ShardedParam> params_;
  ProcessGroupPtr shard_group_;
  ProcessGroupPtr replicate_group_;
  bool fused_;
  bool unsharded_ = false;
  bool gather_issued_ = false;
  std::vector<WorkPtr> gather_works_;
  at::Tensor fused_gather_out_;  // [shard_size * total]
  std::vector<int64_t> fused_offsets_;  // per parameter, within one rank's block
  int64_t fused_block_numel_ = 0;

  bool reduce_pending_ = false;
  ReduceSettings reduce_settings_;
  std::vector<WorkPtr> reduce_works_;
  std::vector<at::Tensor> reduce_outputs_;  // per grad-param (or one fused)
  std::vector<size_t> reduce_params_;       // indices reduced this pass
  at::Tensor fused_reduce_out_;             // the fused reduce-scatter output
  // HSDP with the all-reduce skipped: per-parameter sum of the shard-group
  // reductions not yet all-reduced, and the sharded grad they started from.
  std::vector<at::Tensor> partial_sums_;
  std::vector<at::Tensor> base_grads_;
};

}  // namespace fsdp::detail
