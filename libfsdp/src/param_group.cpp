// ParamGroup: the collectives of one unit.
#include "param_group.h"

#include "fsdp/trace.h"
#include "torch_compat.h"

#include <ATen/ATen.h>

namespace fsdp::detail {
namespace {

// Tells the communication-thread span of the collective about to be issued
// on this thread its size (CPU tensors: the MPI backend's comm thread).
void hint_bytes(const at::Tensor& t) {
  if (trace::enabled() && t.is_cpu()) {
    trace::detail::hint_collective_bytes(static_cast<int64_t>(t.nbytes()));
  }
}

}  // namespace

ParamGroup::ParamGroup(std::vector<ShardedParam> params, ProcessGroupPtr shard_group,
                       ProcessGroupPtr replicate_group, bool fused)
    : params_(std::move(params)),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      fused_(fused) {
  for (const auto& p : params_) {
    fused_offsets_.push_back(fused_block_numel_);
    if (p.is_sharded_placement()) fused_block_numel_ += p.padded_block_numel();
  }
  partial_sums_.resize(params_.size());
  base_grads_.resize(params_.size());
}

void ParamGroup::issue_unshard() {
  if (unsharded_ || gather_issued_) return;
  gather_issued_ = true;
  const int64_t ws = shard_group_->size();
  trace::Span span("all-gather issue", "fsdp");
  if (span.active()) span.arg("group", shard_group_->name()).arg("fused", fused_);
  int64_t traced_bytes = 0;  // of the gathered (full) buffers
  if (fused_ && fused_block_numel_ > 0) {
    at::Tensor input;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      if (!p.is_sharded_placement()) continue;
      at::Tensor in = p.all_gather_input();
      if (!input.defined()) input = at::empty({fused_block_numel_}, in.options());
      input.narrow(0, fused_offsets_[i], p.padded_block_numel()).copy_(in);
    }
    const size_t nbytes = static_cast<size_t>(fused_block_numel_ * ws) * input.element_size();
    if (!fused_gather_out_.defined()) {
      fused_gather_out_ = at::empty({fused_block_numel_ * ws}, input.options());
    } else {
      compat::restore_storage(fused_gather_out_, nbytes);
    }
    if (ws == 1) {
      fused_gather_out_.copy_(input);
    } else {
      hint_bytes(fused_gather_out_);
      gather_works_.push_back(
          shard_group_->all_gather_into_tensor(fused_gather_out_, input, /*async_op=*/true));
    }
    span.arg("bytes", static_cast<int64_t>(nbytes));
    return;
  }
  for (auto& p : params_) {
    if (!p.is_sharded_placement()) continue;
    at::Tensor out = p.all_gather_output();
    at::Tensor in = p.all_gather_input();
    traced_bytes += static_cast<int64_t>(out.nbytes());
    if (ws == 1) {
      out.copy_(in);
    } else {
      hint_bytes(out);
      gather_works_.push_back(shard_group_->all_gather_into_tensor(out, in, /*async_op=*/true));
    }
  }
  span.arg("bytes", traced_bytes);
}

void ParamGroup::finish_unshard() {
  if (unsharded_) return;
  issue_unshard();
  trace::Span span("all-gather wait", "fsdp");
  if (span.active()) {
    span.arg("group", shard_group_->name())
        .arg("collectives", static_cast<int64_t>(gather_works_.size()));
  }
  for (auto& w : gather_works_) w->wait();
  gather_works_.clear();
  gather_issued_ = false;
  if (fused_ && fused_block_numel_ > 0) {
    const int64_t ws = shard_group_->size();
    const at::Tensor gathered = fused_gather_out_.view({ws, fused_block_numel_});
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      if (!p.is_sharded_placement()) continue;
      p.all_gather_output()
          .view({ws, p.padded_block_numel()})
          .copy_(gathered.narrow(1, fused_offsets_[i], p.padded_block_numel()));
    }
    compat::release_storage(fused_gather_out_);
  }
  for (auto& p : params_) p.to_unsharded();
  unsharded_ = true;
}

void ParamGroup::reshard() {
  trace::Span span(unsharded_ || gather_issued_ ? "reshard" : nullptr, "fsdp");
  // Buffers under an in-flight all-gather must not be freed.
  for (auto& w : gather_works_) w->wait();
  gather_works_.clear();
  if (gather_issued_ && fused_ && fused_gather_out_.defined()) {
    compat::release_storage(fused_gather_out_);
  }
  gather_issued_ = false;
  for (auto& p : params_) p.to_sharded();
  unsharded_ = false;
}

void ParamGroup::issue_reduce(const ReduceSettings& settings) {
  if (reduce_pending_) finish_reduce();
  reduce_params_.clear();
  reduce_outputs_.clear();
  fused_reduce_out_ = at::Tensor();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) reduce_params_.push_back(i);
  }
  if (reduce_params_.empty()) return;
  reduce_settings_ = settings;
  reduce_pending_ = true;
  const int64_t ws = shard_group_->size();
  // The issue; "reduce-scatter wait" (finish_reduce) is the rest.
  trace::Span span("reduce-scatter", "fsdp");
  if (span.active()) span.arg("group", shard_group_->name()).arg("fused", fused_);
  int64_t traced_bytes = 0;  // of the full gradients reduced

  // Sharded parameters: reduce-scatter; replicated ones: all-reduce.
  std::vector<size_t> sharded;
  for (size_t i : reduce_params_) {
    auto& p = params_[i];
    if (p.is_sharded_placement()) {
      sharded.push_back(i);
      continue;
    }
    at::Tensor g = p.reduce_scatter_input().clone();
    traced_bytes += static_cast<int64_t>(g.nbytes());
    if (ws > 1) {
      hint_bytes(g);
      reduce_works_.push_back(shard_group_->all_reduce(g, ReduceOp::SUM, true));
    }
    reduce_outputs_.push_back(g);
  }
  if (fused_ && !sharded.empty()) {
    int64_t total = 0;
    for (size_t i : sharded) total += params_[i].padded_block_numel();
    at::Tensor input;
    int64_t offset = 0;
    for (size_t i : sharded) {
      auto& p = params_[i];
      at::Tensor in = p.reduce_scatter_input().view({ws, p.padded_block_numel()});
      if (!input.defined()) input = at::empty({ws, total}, in.options());
      input.narrow(1, offset, p.padded_block_numel()).copy_(in);
      offset += p.padded_block_numel();
    }
    at::Tensor out = at::empty({total}, input.options());
    fused_reduce_out_ = out;
    traced_bytes += static_cast<int64_t>(input.nbytes());
    if (ws == 1) {
      out.copy_(input.view({-1}));
    } else {
      hint_bytes(input);
      reduce_works_.push_back(
          shard_group_->reduce_scatter_tensor(out, input.view({-1}), ReduceOp::SUM, true));
    }
    offset = 0;
    for (size_t i : sharded) {
      reduce_outputs_.push_back(out.narrow(0, offset, params_[i].padded_block_numel()));
      offset += params_[i].padded_block_numel();
    }
  } else {
    for (size_t i : sharded) {
      auto& p = params_[i];
      at::Tensor in = p.reduce_scatter_input();
      at::Tensor out = at::empty({p.padded_block_numel()}, in.options());
      traced_bytes += static_cast<int64_t>(in.nbytes());
      if (ws == 1) {
        out.copy_(in);
      } else {
        hint_bytes(in);
        reduce_works_.push_back(shard_group_->reduce_scatter_tensor(out, in, ReduceOp::SUM, true));
      }
      reduce_outputs_.push_back(out);
    }
  }
  // reduce_outputs_ follows reduce_params_ order: replicated first, then sharded.
  std::vector<size_t> order;
  for (size_t i : reduce_params_) {
    if (!params_[i].is_sharded_placement()) order.push_back(i);
  }
  order.insert(order.end(), sharded.begin(), sharded.end());
  reduce_params_ = std::move(order);
  for (size_t i : reduce_params_) params_[i].clear_unsharded_grad();
  span.arg("bytes", traced_bytes);
}

void ParamGroup::finish_reduce() {
  if (!reduce_pending_) return;
  reduce_pending_ = false;
  {
    trace::Span span("reduce-scatter wait", "fsdp");
    if (span.active()) {
      span.arg("group", shard_group_->name())
          .arg("collectives", static_cast<int64_t>(reduce_works_.size()));
    }
    for (auto& w : reduce_works_) w->wait();
  }
  reduce_works_.clear();

  const ReduceSettings& s = reduce_settings_;
  const double shard_size = static_cast<double>(shard_group_->size());
  const bool hsdp = replicate_group_ && replicate_group_->size() > 1;
  const double replicate_size = hsdp ? static_cast<double>(replicate_group_->size()) : 1.0;
  const double extra = s.scaling_factor.value_or(1.0);
  const double shard_scale = (s.average ? 1.0 / shard_size : 1.0) * extra;
  const double full_scale = (s.average ? 1.0 / (shard_size * replicate_size) : 1.0) * extra;

  if (hsdp && !s.all_reduce) {
    // Replicas keep their own shard-group result for now; the sum is kept so
    // that the next all-reduce can replace it with the global result.
    for (size_t k = 0; k < reduce_params_.size(); ++k) {
      const size_t i = reduce_params_[k];
      at::Tensor& partial = partial_sums_[i];
      // The gradient before the first kept-back step, to be restored when
      // the global result replaces the replica-local means.
      if (!partial.defined()) base_grads_[i] = params_[i].sharded_grad_copy(s.fp32_main_grad);
      partial = partial.defined() ? partial.add_(reduce_outputs_[k]) : reduce_outputs_[k].clone();
      params_[i].add_reduced_grad(reduce_outputs_[k] * shard_scale, s.fp32_main_grad);
    }
    reduce_outputs_.clear();
    fused_reduce_out_ = at::Tensor();
    return;
  }
  if (hsdp) {
    // Sums kept back by earlier steps that skipped the all-reduce join this
    // one, in place, so a single all-reduce covers them (fused outputs are
    // views of one buffer: one all-reduce covers the unit).
    for (size_t k = 0; k < reduce_params_.size(); ++k) {
      const at::Tensor& partial = partial_sums_[reduce_params_[k]];
      if (partial.defined()) reduce_outputs_[k].add_(partial);
    }
    // Issue and wait: nothing to overlap it with here.
    trace::Span span("all-reduce", "fsdp");
    int64_t traced_bytes = 0;
    std::vector<WorkPtr> works;
    if (fused_reduce_out_.defined()) {
      traced_bytes += static_cast<int64_t>(fused_reduce_out_.nbytes());
      hint_bytes(fused_reduce_out_);
      works.push_back(replicate_group_->all_reduce(fused_reduce_out_, ReduceOp::SUM, true));
    }
    for (size_t k = 0; k < reduce_params_.size(); ++k) {
      const bool in_fused =
          fused_reduce_out_.defined() && params_[reduce_params_[k]].is_sharded_placement();
      if (!in_fused) {
        traced_bytes += static_cast<int64_t>(reduce_outputs_[k].nbytes());
        hint_bytes(reduce_outputs_[k]);
        works.push_back(replicate_group_->all_reduce(reduce_outputs_[k], ReduceOp::SUM, true));
      }
    }
    if (span.active()) span.arg("group", replicate_group_->name()).arg("bytes", traced_bytes);
    for (auto& w : works) w->wait();
  }
  for (size_t k = 0; k < reduce_params_.size(); ++k) {
    const size_t i = reduce_params_[k];
    if (partial_sums_[i].defined()) {
      params_[i].restore_grad(base_grads_[i], s.fp32_main_grad);
      base_grads_[i] = at::Tensor();
      partial_sums_[i] = at::Tensor();
    }
    params_[i].add_reduced_grad(reduce_outputs_[k] * full_scale, s.fp32_main_grad);
  }
  reduce_outputs_.clear();
  fused_reduce_out_ = at::Tensor();
}

void ParamGroup::clear_partial_sums() {
  for (auto& partial : partial_sums_) partial = at::Tensor();
  for (auto& base : base_grads_) base = at::Tensor();
}

}  // namespace fsdp::detail
