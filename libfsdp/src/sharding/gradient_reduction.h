// Internal: a parameter group's gradient reduction -- reduce-scatter with a
// presence flag per parameter, the HSDP all-reduce (issued from one
// process-wide queue), kept-back sums -- per parameter or fused over one flat
// buffer. ParamGroup (param_group.h) owns it and decides when it runs.
// The rule: docs/architecture.md#collective-order.
#pragma once

#include "fsdp/process_group.h"
#include "fsdp/comm_hooks.h"
#include "sharding/collectives.h"
#include "sharding/param.h"

#include <cstddef>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace fsdp::detail {

struct ReduceSettings {
  bool average = true;                  // "avg": divide by the divide factor
  std::optional<double> scaling_factor;  // extra multiplier
  bool all_reduce = true;               // HSDP: all-reduce over the replicate dim
  bool fp32_main_grad = false;
};

// A parameter group's gradient reduction: built from the gradients
// (prepare), issued, and installed into the sharded gradients (finish).
// Its buffers hold a presence flag per parameter, so that after the
// reduction each says whether any rank had a gradient.
class GradientReduction {
 public:
  // divide_factor: "avg" divides by it (none = shard x replicate size).
  GradientReduction(size_t num_params, const ProcessGroupPtr& shard_group,
                    const ProcessGroupPtr& replicate_group, std::optional<double> divide_factor,
                    bool fused);
  GradientReduction(GradientReduction&&) noexcept;
  GradientReduction& operator=(GradientReduction&&) noexcept;
  ~GradientReduction();

  void set_divide_factor(std::optional<double> f) { divide_factor_ = f; }
  void set_all_reduce_hook(std::shared_ptr<const AllReduceHook> hook) {
    all_reduce_hook_ = std::move(hook);
  }

  // Builds the reduction input from this pass's (and earlier unsynchronised
  // passes') gradients, zeros standing in for missing ones. Drops the pass
  // gradients. A reduction still pending is finished first.
  void prepare(std::vector<ShardedParam>& params, const ReduceSettings& settings,
               const CollectiveRoute& route);
  bool prepared() const { return stage_ == Stage::Prepared; }
  // Issues the prepared reduce-scatter (and the all-reduce over the shard
  // group of Replicate parameters).
  void issue(const CollectiveRoute& route);
  // HSDP: the all-reduces over the replicate groups are issued as soon as
  // their reduce-scatters have finished, so they overlap the rest of
  // backward -- but strictly in the order the reduce-scatters were issued
  // (one process-wide queue: a communicator's collectives must come in one
  // order on every rank, whatever the timing). Issues those now due.
  static void poll_all_reduces();
  bool pending() const { return stage_ != Stage::None; }
  // Nothing is left to wait for: finish would not block.
  bool complete() const;
  // Waits for the reduction and adds the results to the sharded gradients
  // (only where some rank had a gradient).
  void finish(std::vector<ShardedParam>& params, const CollectiveRoute& route);
  // A failed pass: waits for what is in flight and drops it.
  void drop();
  // Forgets sums kept back by steps that skipped the HSDP all-reduce.
  void clear_partial_sums();

  // Memory accounting (fsdp/memory.h): see ParamGroup.
  const std::vector<at::Tensor>& buffers() const { return scatter_inputs_; }
  const std::vector<std::pair<size_t, at::Tensor>>& local_grads() const { return local_grads_; }
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
  // Issues, in queue order, every queued all-reduce up to this one's.
  void flush_all_reduces_through();
  void leave_all_reduce_queue();
  // prepare's buffers, per placement kind and path.
  void prepare_buffers(std::vector<ShardedParam>& params, const ReduceSettings& settings,
                       const CollectiveRoute& route);
  void prepare_replicated(std::vector<ShardedParam>& params, const std::vector<size_t>& which);
  void prepare_fused(std::vector<ShardedParam>& params, const std::vector<size_t>& which,
                     const CollectiveRoute& route);
  void prepare_per_param(std::vector<ShardedParam>& params, const std::vector<size_t>& which,
                         const CollectiveRoute& route);
  void install(std::vector<ShardedParam>& params);
  // What a finished or dropped reduction leaves: no buffers, no stage.
  void clear();

  ProcessGroupPtr shard_group_;
  ProcessGroupPtr replicate_group_;
  // The reductions' own groups over the same ranks (reduction_group_for).
  ProcessGroupPtr scatter_group_;
  ProcessGroupPtr all_reduce_group_;
  std::optional<double> divide_factor_;
  bool fused_;
  std::shared_ptr<const AllReduceHook> all_reduce_hook_;

  Stage stage_ = Stage::None;
  ReduceSettings settings_;
  std::vector<Entry> entries_;  // per reduced parameter
  // The fused reduction output's gradient part (what the all-reduce hook sees).
  at::Tensor fused_grad_view_;
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
