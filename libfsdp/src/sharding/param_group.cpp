// ParamGroup: one unit's parameters on one mesh, between collectives.
// The rule: docs/architecture.md#collective-order.
#include "sharding/param_group.h"

#include "fsdp/trace.h"
#include "sharding/memory_guard.h"
#include "base/torch_compat.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace fsdp::detail {

ParamGroup::ParamGroup(std::vector<ShardedParam> params, ProcessGroupPtr shard_group,
                       ProcessGroupPtr replicate_group, std::optional<double> divide_factor,
                       bool fused)
    : params_(std::move(params)),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      fused_(fused),
      extensions_(params_.size()),
      reduction_(params_.size(), shard_group_, replicate_group_, divide_factor, fused) {
  for (const auto& p : params_) {
    fused_offsets_.push_back(fused_block_numel_);
    // Extended parameters travel in their own byte all-gather.
    if (!p.is_sharded_placement() || p.extension()) continue;
    if (fused_block_numel_ == 0) {
      fused_gather_options_ = at::TensorOptions(p.compute_dtype()).device(p.compute_device());
    }
    fused_block_numel_ += p.padded_block_numel();
  }
  has_extensions_ = std::any_of(params_.begin(), params_.end(),
                                [](const ShardedParam& p) { return p.extension() != nullptr; });
}

ParamGroup::ParamGroup(ParamGroup&&) noexcept = default;
ParamGroup& ParamGroup::operator=(ParamGroup&&) noexcept = default;
ParamGroup::~ParamGroup() = default;

bool ParamGroup::reduces() const {
  for (const auto& p : params_) {
    if (p.requires_grad()) return true;
  }
  return false;
}

size_t ParamGroup::fused_gather_buffer(int64_t ws) {
  const size_t nbytes = static_cast<size_t>(fused_block_numel_ * ws) *
                        c10::elementSize(fused_gather_options_.dtype().toScalarType());
  if (!fused_gather_out_.defined()) {
    fused_gather_out_ =
        route_.all_gather_buffer(shard_group_, {fused_block_numel_ * ws}, fused_gather_options_);
  } else {
    compat::restore_storage(fused_gather_out_, nbytes);
  }
  return nbytes;
}

void ParamGroup::issue_unshard() {
  if (unsharded_ || gather_issued_) return;
  // Before anything changes: a deferred shard has no values to gather.
  for (const auto& p : params_) p.check_materialized("unsharded");
  gather_issued_ = true;
  try {
    issue_gathers();
  } catch (...) {
    // A hook or a custom allocate failed (alike on every rank: they see the
    // same shapes). What was issued completes; the group stays sharded, so
    // the unit can be controlled (set_custom_all_gather) before the next pass.
    for (auto& w : gather_works_) {
      try {
        w->wait();
      } catch (const std::exception&) {
        // The first error is the one to report.
      }
    }
    gather_works_.clear();
    gather_issued_ = false;
    extensions_.drop();
    throw;
  }
}

void ParamGroup::issue_gathers() {
  if (holds_post_forward_shards()) {
    issue_post_forward_unshard();
    return;
  }
  const int64_t ws = shard_group_->size();
  if (ws == 1) {  // nothing to gather, fused or not: a cast or an upload at most
    oom_guard("unshard", gathered_bytes(params_, 1), [&] {
      for (auto& p : params_) {
        if (p.is_sharded_placement() && !p.extension()) p.unshard_locally();
      }
    });
    extensions_.unshard_locally(params_, route_);
    return;
  }
  trace::Span span("all-gather issue", "fsdp");
  if (span.active()) span.arg("group", shard_group_->name()).arg("fused", fused_);
  int64_t traced_bytes = 0;  // of the gathered (full) buffers
  // In place, as FSDP2 does: each shard is copied (or cast) straight into
  // this rank's block of the output, so the collective copies nothing of its
  // own and no separate input buffer exists.
  const int64_t me = shard_group_->rank();
  if (has_extensions_) {
    extensions_.issue(params_, shard_group_, route_, gather_works_);
    traced_bytes += static_cast<int64_t>(extensions_.buffer().nbytes());
  }
  if (fused_ && fused_block_numel_ > 0) {
    const int64_t want = fused_block_numel_ * ws *
                         static_cast<int64_t>(fused_gather_options_.dtype().itemsize());
    const size_t nbytes = oom_guard("all-gather", want, [&] { return fused_gather_buffer(ws); });
    const at::Tensor mine = fused_gather_out_.narrow(0, me * fused_block_numel_, fused_block_numel_);
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      if (!p.is_sharded_placement() || extended(i)) continue;
      p.copy_in(mine.narrow(0, fused_offsets_[i], p.padded_block_numel()));
    }
    hint_bytes(fused_gather_out_);
    if (auto w = route_.all_gather(shard_group_, fused_gather_out_, mine)) {
      gather_works_.push_back(w);
    }
    span.arg("bytes", traced_bytes + static_cast<int64_t>(nbytes));
    return;
  }
  const int64_t want = gathered_bytes(params_, ws);
  const Allocate custom = route_.all_gather_allocate();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.is_sharded_placement() || extended(i)) continue;
    at::Tensor out = oom_guard("all-gather", want,
                               [&] { return p.all_gather_output(custom ? &custom : nullptr); });
    const int64_t block = p.padded_block_numel();
    at::Tensor mine = out.narrow(0, me * block, block);
    p.copy_in(mine);
    traced_bytes += static_cast<int64_t>(out.nbytes());
    hint_bytes(out);
    if (auto w = route_.all_gather(shard_group_, out, mine)) gather_works_.push_back(w);
  }
  span.arg("bytes", traced_bytes);
}

void ParamGroup::expose_without_values() {
  if (unsharded_) return;
  // A prefetch already gathered them: use what is there.
  if (gather_issued_) {
    finish_unshard();
    return;
  }
  forget_post_forward_pieces();
  for (auto& p : params_) p.to_value_free_full();
}

void ParamGroup::set_custom_all_gather(std::shared_ptr<const CustomAllGather> comm) {
  route_.custom_all_gather = std::move(comm);
  // The buffers the old collective allocated are not the new one's.
  fused_gather_out_ = at::Tensor();
  for (auto& p : params_) p.drop_full_buffer();
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
  const int64_t ws = shard_group_->size();
  if (extensions_.issued()) extensions_.finish(params_, ws, route_);
  if (fused_ && fused_block_numel_ > 0 && ws > 1) {
    const at::Tensor gathered = fused_gather_out_.view({ws, fused_block_numel_});
    const int64_t want = gathered_bytes(params_, ws);
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      if (!p.is_sharded_placement() || extended(i)) continue;
      oom_guard("unshard", want, [&] { return p.all_gather_output(); })
          .view({ws, p.padded_block_numel()})
          .copy_(gathered.narrow(1, fused_offsets_[i], p.padded_block_numel()));
    }
    compat::release_storage(fused_gather_out_);
  }
  forget_post_forward_pieces();
  // Replicate placements copy their shard into a compute-dtype buffer here.
  int64_t replicated = 0;
  for (const auto& p : params_) {
    if (p.is_sharded_placement() || p.full_is_shard()) continue;
    replicated += p.padded_block_numel() * static_cast<int64_t>(c10::elementSize(p.compute_dtype()));
  }
  oom_guard("unshard", replicated, [&] {
    for (auto& p : params_) p.to_unsharded();
  });
  unsharded_ = true;
}

void ParamGroup::forget_post_forward_pieces() {
  post_forward_pieces_.clear();
  post_forward_pieces_group_ = nullptr;
}

void ParamGroup::drop_post_forward_shards() {
  if (!gather_issued_) forget_post_forward_pieces();
}

void ParamGroup::reshard_after_forward(const PostForwardTarget& target) {
  if (target.keep_full && unsharded_) return;
  // Only a completed gather has every block to keep a piece of.
  if (!target.group || !unsharded_ || gather_issued_) {
    reshard();
    return;
  }
  trace::Span span("reshard to post-forward group", "fsdp");
  if (span.active()) span.arg("group", target.group->name());
  const int64_t ws = shard_group_->size();
  const int64_t per = ws / target.group->size();  // shard ranks per piece
  const int64_t j = target.group->rank();
  std::vector<at::Tensor> pieces(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.is_sharded_placement()) continue;
    const int64_t n = per * p.padded_block_numel();
    pieces[i] = p.unsharded_flat().narrow(0, j * n, n).clone();
  }
  reshard();
  post_forward_pieces_ = std::move(pieces);
  post_forward_pieces_group_ = target.group;
}

void ParamGroup::issue_post_forward_unshard() {
  const ProcessGroupPtr& pf = post_forward_pieces_group_;
  trace::Span span("all-gather issue", "fsdp");
  if (span.active()) span.arg("group", pf->name()).arg("fused", fused_).arg("post_forward", true);
  const int64_t ws = shard_group_->size();
  const int64_t per = ws / pf->size();
  const int64_t j = pf->rank();
  if (fused_ && fused_block_numel_ > 0) {
    // The fused buffer is rank-major ([ws][block]): this rank's piece is the
    // contiguous rows of shard ranks j*per .. j*per+per-1.
    const int64_t want = fused_block_numel_ * ws *
                         static_cast<int64_t>(fused_gather_options_.dtype().itemsize());
    const size_t nbytes = oom_guard("all-gather", want, [&] { return fused_gather_buffer(ws); });
    const at::Tensor rows = fused_gather_out_.view({ws, fused_block_numel_}).narrow(0, j * per, per);
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      if (!p.is_sharded_placement() || extended(i)) continue;
      rows.narrow(1, fused_offsets_[i], p.padded_block_numel())
          .copy_(post_forward_pieces_[i].view({per, p.padded_block_numel()}));
    }
    const at::Tensor mine =
        fused_gather_out_.narrow(0, j * per * fused_block_numel_, per * fused_block_numel_);
    hint_bytes(fused_gather_out_);
    if (auto w = route_.all_gather(pf, fused_gather_out_, mine)) gather_works_.push_back(w);
    span.arg("bytes", static_cast<int64_t>(nbytes));
  }
  // Unfused, every Shard parameter; fused, the extended ones (their pieces
  // are post_all_gather's values, in the compute dtype).
  int64_t traced_bytes = 0;
  const int64_t want = gathered_bytes(params_, ws);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.is_sharded_placement()) continue;
    if (fused_ && fused_block_numel_ > 0 && !extended(i)) continue;
    at::Tensor out = oom_guard("all-gather", want, [&] { return p.all_gather_output(); });
    const int64_t n = per * p.padded_block_numel();
    at::Tensor mine = out.narrow(0, j * n, n);
    mine.copy_(post_forward_pieces_[i]);
    traced_bytes += static_cast<int64_t>(out.nbytes());
    hint_bytes(out);
    if (auto w = route_.all_gather(pf, out, mine)) gather_works_.push_back(w);
  }
  if (traced_bytes > 0) span.arg("bytes", traced_bytes);
}

void ParamGroup::reshard() {
  trace::Span span(unsharded_ || gather_issued_ ? "reshard" : nullptr, "fsdp");
  for (auto& w : gather_works_) w->wait();
  gather_works_.clear();
  if (gather_issued_ && fused_ && fused_gather_out_.defined()) {
    compat::release_storage(fused_gather_out_);
  }
  gather_issued_ = false;
  extensions_.drop();
  forget_post_forward_pieces();
  for (auto& p : params_) p.to_sharded();
  unsharded_ = false;
}

void ParamGroup::wait_host_copies() {
  for (auto& p : params_) p.wait_host_copies();
}

}  // namespace fsdp::detail
