// ParamGroup: the collectives of one unit's parameters on one mesh.
// The rule: docs/architecture.md#collective-order.
#include "sharding/param_group.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "comm/group_registry.h"
#include "sharding/memory_guard.h"
#include "base/torch_compat.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <sstream>

namespace fsdp::detail {
namespace {

// Tells the communication-thread span of the collective about to be issued
// on this thread its size (CPU tensors: the MPI backend's comm thread).
void hint_bytes(const at::Tensor& t) {
  if (trace::enabled() && t.is_cpu()) {
    trace::detail::hint_collective_bytes(static_cast<int64_t>(t.nbytes()));
  }
}

// Groups whose replicate all-reduce is still to be issued, in the order
// their reduce-scatters were issued.
struct AllReduceQueue {
  std::mutex mu;
  std::deque<ParamGroup*> groups;
};
// Never destroyed: the unit registry (registry.cpp) destroys its units' groups
// at exit, and each leaves this queue then. A function-local static queue was
// destroyed first (ASan: heap-use-after-free in ~ParamGroup at exit).
AllReduceQueue& all_reduce_queue() {
  static auto* q = new AllReduceQueue;
  return *q;
}

using Allocate = std::function<at::Tensor(int64_t, const at::TensorOptions&)>;

std::string shape_of(at::IntArrayRef sizes) {
  std::ostringstream o;
  o << sizes;
  return o.str();
}

// A custom collective's allocate, held to what was asked for.
at::Tensor checked_allocation(const Allocate& allocate, int64_t numel,
                              const at::TensorOptions& options, const std::string& who) {
  at::Tensor t = allocate(numel, options);
  if (!t.defined() || t.numel() != numel) {
    throw ShapeError("allocate", who + ": 'allocate' returned " +
                                     (t.defined() ? "a tensor of shape " + shape_of(t.sizes())
                                                  : std::string("an undefined tensor")) +
                                     " for " + std::to_string(numel) + " elements; accepted: " +
                                     std::to_string(numel) + " elements");
  }
  const c10::ScalarType want = options.dtype().toScalarType();
  if (t.scalar_type() != want) {
    throw DTypeError("allocate", who + ": 'allocate' returned dtype " +
                                     c10::toString(t.scalar_type()) + " for a request of " +
                                     c10::toString(want) + "; accepted: the requested dtype");
  }
  if (t.device() != options.device() || !t.is_contiguous()) {
    throw LayoutError("allocate", who + ": 'allocate' returned a " +
                                      (t.is_contiguous() ? "" : "non-contiguous ") +
                                      "tensor on " + t.device().str() + " for a request on " +
                                      options.device().str() +
                                      "; accepted: a contiguous tensor on the requested device");
  }
  return t;
}

int64_t align8(int64_t n) { return (n + 7) / 8 * 8; }

// A tensor's bytes as a flat uint8 tensor (a view where it is contiguous).
at::Tensor as_bytes(const at::Tensor& t) {
  return t.contiguous().view({-1}).view(at::kByte);
}

// Bytes of the full (gathered) buffers of `params`' Shard placements: what
// an unshard allocates on this rank.
int64_t gathered_bytes(const std::vector<ShardedParam>& params, int64_t ws) {
  int64_t n = 0;
  for (const auto& p : params) {
    if (!p.is_sharded_placement()) continue;
    n += p.padded_block_numel() * ws * static_cast<int64_t>(c10::elementSize(p.compute_dtype()));
  }
  return n;
}

}  // namespace

// One reduced parameter: its reduced block and its presence count, views
// into the reduction's output.
struct ParamGroup::Entry {
  size_t param;
  at::Tensor out;
  at::Tensor flag;
  double pre_divided = 1;  // the gradient entered the reduction divided by this
};

namespace {

// float16 tops out at 65504: a SUM over N ranks followed by a divide by N
// overflows long before the mean does. Like FSDP2, float16 gradients are
// divided before the reduction by the smallest power of two >= sqrt(N)
// (exact: only the exponent changes) and by the rest after it, so the sum
// stays within ~sqrt(N) of the mean's magnitude. Other dtypes have float32's
// range and keep a single divide after the sum (one rounding).
double pre_divide_factor(c10::ScalarType reduce_dtype, const ReduceSettings& s, double divide) {
  if (reduce_dtype != at::kHalf || !s.average) return 1;
  double pre = 1;
  while (divide / pre > pre) pre *= 2;
  return pre;
}

}  // namespace

ParamGroup::ParamGroup(std::vector<ShardedParam> params, ProcessGroupPtr shard_group,
                       ProcessGroupPtr replicate_group, std::optional<double> divide_factor,
                       bool fused)
    : params_(std::move(params)),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      scatter_group_(reduction_group_for(shard_group_)),
      all_reduce_group_(replicate_group_ ? reduction_group_for(replicate_group_) : nullptr),
      divide_factor_(divide_factor),
      fused_(fused) {
  for (const auto& p : params_) {
    fused_offsets_.push_back(fused_block_numel_);
    // Extended parameters travel in their own byte all-gather.
    if (!p.is_sharded_placement() || p.extension()) continue;
    if (fused_block_numel_ == 0) {
      fused_gather_options_ = at::TensorOptions(p.compute_dtype()).device(p.compute_device());
    }
    fused_block_numel_ += p.padded_block_numel();
  }
  ext_outputs_.resize(params_.size());
  has_extensions_ = std::any_of(params_.begin(), params_.end(),
                                [](const ShardedParam& p) { return p.extension() != nullptr; });
  partial_sums_.resize(params_.size());
  partial_presence_.resize(params_.size());
  base_grads_.resize(params_.size());
}

// Groups move only while their unit is built, before any reduction, so a
// queued pointer never dangles.
ParamGroup::ParamGroup(ParamGroup&&) noexcept = default;
ParamGroup& ParamGroup::operator=(ParamGroup&&) noexcept = default;
ParamGroup::~ParamGroup() { leave_all_reduce_queue(); }

void ParamGroup::poll_all_reduces() {
  auto& q = all_reduce_queue();
  std::lock_guard<std::mutex> lock(q.mu);
  while (!q.groups.empty() && q.groups.front()->issue_all_reduce(/*wait=*/false)) {
    q.groups.pop_front();
  }
}

void ParamGroup::flush_all_reduces_through() {
  auto& q = all_reduce_queue();
  std::lock_guard<std::mutex> lock(q.mu);
  if (std::find(q.groups.begin(), q.groups.end(), this) == q.groups.end()) return;
  for (;;) {
    ParamGroup* g = q.groups.front();
    g->issue_all_reduce(/*wait=*/true);
    q.groups.pop_front();
    if (g == this) return;
  }
}

void ParamGroup::leave_all_reduce_queue() {
  auto& q = all_reduce_queue();
  std::lock_guard<std::mutex> lock(q.mu);
  q.groups.erase(std::remove(q.groups.begin(), q.groups.end(), this), q.groups.end());
}

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
    fused_gather_out_ = collective_buffer(custom_all_gather_.get(), nullptr, shard_group_,
                                          {fused_block_numel_ * ws}, fused_gather_options_);
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
    ext_gather_out_ = at::Tensor();
    ext_gather_issued_ = false;
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
    unshard_extensions_locally();
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
    issue_extension_gather(ws, me);
    traced_bytes += static_cast<int64_t>(ext_gather_out_.nbytes());
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
    if (auto w = all_gather(shard_group_, fused_gather_out_, mine)) gather_works_.push_back(w);
    span.arg("bytes", traced_bytes + static_cast<int64_t>(nbytes));
    return;
  }
  const int64_t want = gathered_bytes(params_, ws);
  Allocate custom;
  if (custom_all_gather_ && custom_all_gather_->allocate) {
    custom = [this](int64_t n, const at::TensorOptions& o) {
      return checked_allocation(custom_all_gather_->allocate, n, o,
                                "custom all-gather of unit " + owner());
    };
  }
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
    if (auto w = all_gather(shard_group_, out, mine)) gather_works_.push_back(w);
  }
  span.arg("bytes", traced_bytes);
}

WorkPtr ParamGroup::all_gather(const ProcessGroupPtr& group, at::Tensor out, const at::Tensor& in) {
  if (custom_all_gather_) return custom_all_gather_->all_gather(std::move(out), in, *group);
  return group->all_gather_into_tensor(std::move(out), in, /*async_op=*/true);
}

WorkPtr ParamGroup::reduce_scatter(at::Tensor out, const at::Tensor& in) {
  if (custom_reduce_scatter_) {
    return custom_reduce_scatter_->reduce_scatter(std::move(out), in, ReduceOp::SUM,
                                                  *scatter_group_);
  }
  return scatter_group_->reduce_scatter_tensor(std::move(out), in, ReduceOp::SUM,
                                               /*async_op=*/true);
}

at::Tensor ParamGroup::collective_buffer(const CustomAllGather* ag, const CustomReduceScatter* rs,
                                         const ProcessGroupPtr& group, at::IntArrayRef shape,
                                         const at::TensorOptions& options) {
  const Allocate* allocate = ag != nullptr ? &ag->allocate : rs != nullptr ? &rs->allocate : nullptr;
  if (allocate == nullptr || !*allocate) return group->empty_for_collectives(shape, options);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const std::string who = std::string(ag != nullptr ? "custom all-gather" : "custom reduce-scatter") +
                          " of unit " + owner();
  return checked_allocation(*allocate, numel, options, who).view(shape);
}

std::vector<std::vector<at::Tensor>> ParamGroup::run_pre_all_gathers() {
  std::vector<std::vector<at::Tensor>> all(params_.size());
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!extended(i)) continue;
    auto& p = params_[i];
    const std::string who =
        "all-gather extension of '" + p.name() + "' (unit " + owner() + ")";
    std::vector<at::Tensor> outs = p.extension()->pre_all_gather(p.shard_2d());
    if (outs.empty()) {
      throw ArgumentError("pre_all_gather", who + ": 'pre_all_gather' returned no tensors; "
                                                  "accepted: one or more tensors to gather");
    }
    auto& spec = ext_outputs_[i];
    if (ext_recorded_ && spec.size() != outs.size()) {
      throw ShapeError("pre_all_gather", who + ": 'pre_all_gather' returned " +
                                             std::to_string(outs.size()) +
                                             " tensors; its first call returned " +
                                             std::to_string(spec.size()));
    }
    for (size_t k = 0; k < outs.size(); ++k) {
      const at::Tensor& t = outs[k];
      const std::string which = "output " + std::to_string(k);
      if (!t.defined()) {
        throw ArgumentError("pre_all_gather",
                            who + ": 'pre_all_gather' " + which + " is an undefined tensor");
      }
      if (t.device() != p.compute_device()) {
        throw LayoutError("pre_all_gather", who + ": 'pre_all_gather' " + which + " is on " +
                                                t.device().str() + "; accepted: the compute "
                                                "device " + p.compute_device().str());
      }
      if (!ext_recorded_) {
        offset = align8(offset);
        const auto nbytes = static_cast<int64_t>(t.nbytes());
        spec.push_back({t.sizes().vec(), t.scalar_type(), offset, nbytes});
        offset += nbytes;
        continue;
      }
      if (t.scalar_type() != spec[k].dtype) {
        throw DTypeError("pre_all_gather", who + ": 'pre_all_gather' " + which + " has dtype " +
                                               c10::toString(t.scalar_type()) +
                                               "; its first call returned " +
                                               c10::toString(spec[k].dtype) +
                                               " (every call, on every rank, must match)");
      }
      if (t.sizes().vec() != spec[k].shape) {
        throw ShapeError("pre_all_gather", who + ": 'pre_all_gather' " + which + " has shape " +
                                               shape_of(t.sizes()) + "; its first call returned " +
                                               shape_of(spec[k].shape) +
                                               " (every call, on every rank, must match)");
      }
    }
    all[i] = std::move(outs);
  }
  if (!ext_recorded_) {
    ext_block_bytes_ = align8(offset);
    ext_recorded_ = true;
  }
  return all;
}

void ParamGroup::run_post_all_gather(size_t i, const std::vector<at::Tensor>& gathered,
                                     int64_t ws) {
  auto& p = params_[i];
  const std::string who = "all-gather extension of '" + p.name() + "' (unit " + owner() + ")";
  at::Tensor full = p.extension()->post_all_gather(gathered, p.compute_dtype());
  const int64_t rows = p.full_rows();
  const int64_t cols = p.full_cols();
  if (!full.defined() || full.numel() != rows * cols) {
    throw ShapeError("post_all_gather",
                     who + ": 'post_all_gather' returned " +
                         (full.defined() ? "shape " + shape_of(full.sizes())
                                         : std::string("an undefined tensor")) +
                         "; accepted: [" + std::to_string(rows) + ", " + std::to_string(cols) +
                         "] (" + std::to_string(ws) + " ranks x " +
                         std::to_string(rows / std::max<int64_t>(ws, 1)) + " rows)");
  }
  if (full.scalar_type() != p.compute_dtype()) {
    throw DTypeError("post_all_gather", who + ": 'post_all_gather' returned dtype " +
                                            c10::toString(full.scalar_type()) +
                                            "; accepted: the compute dtype " +
                                            c10::toString(p.compute_dtype()));
  }
  if (full.device() != p.compute_device()) {
    throw LayoutError("post_all_gather", who + ": 'post_all_gather' returned a tensor on " +
                                             full.device().str() + "; accepted: " +
                                             p.compute_device().str());
  }
  const int64_t bytes =
      rows * cols * static_cast<int64_t>(c10::elementSize(p.compute_dtype()));
  oom_guard("unshard", bytes, [&] { p.install_full(full); });
}

void ParamGroup::issue_extension_gather(int64_t ws, int64_t me) {
  std::vector<std::vector<at::Tensor>> outs = run_pre_all_gathers();
  c10::Device device = c10::kCPU;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (extended(i)) device = params_[i].compute_device();
  }
  const auto options = at::TensorOptions(at::kByte).device(device);
  ext_gather_out_ = oom_guard("all-gather", ws * ext_block_bytes_, [&] {
    return collective_buffer(custom_all_gather_.get(), nullptr, shard_group_,
                             {ws * ext_block_bytes_}, options);
  });
  const at::Tensor mine = ext_gather_out_.narrow(0, me * ext_block_bytes_, ext_block_bytes_);
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < outs[i].size(); ++k) {
      const ExtensionOutput& spec = ext_outputs_[i][k];
      mine.narrow(0, spec.offset, spec.nbytes).copy_(as_bytes(outs[i][k]));
    }
  }
  hint_bytes(ext_gather_out_);
  if (auto w = all_gather(shard_group_, ext_gather_out_, mine)) gather_works_.push_back(w);
  ext_gather_issued_ = true;
}

void ParamGroup::finish_extension_gather(int64_t ws) {
  const at::Tensor rows = ext_gather_out_.view({ws, ext_block_bytes_});
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!extended(i)) continue;
    std::vector<at::Tensor> gathered;
    for (const ExtensionOutput& spec : ext_outputs_[i]) {
      const at::Tensor bytes = rows.narrow(1, spec.offset, spec.nbytes).contiguous();
      std::vector<int64_t> shape = spec.shape;
      if (shape.empty()) {
        shape = {ws};
      } else {
        shape[0] *= ws;
      }
      gathered.push_back(bytes.view({-1}).view(spec.dtype).view(shape));
    }
    run_post_all_gather(i, gathered, ws);
  }
  ext_gather_out_ = at::Tensor();
  ext_gather_issued_ = false;
}

void ParamGroup::unshard_extensions_locally() {
  std::vector<std::vector<at::Tensor>> outs = run_pre_all_gathers();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!extended(i)) continue;
    std::vector<at::Tensor> gathered;
    for (const at::Tensor& t : outs[i]) {
      gathered.push_back(t.dim() == 0 ? t.reshape({1}) : t.contiguous());
    }
    run_post_all_gather(i, gathered, 1);
  }
}

void ParamGroup::expose_without_values() {
  if (unsharded_) return;
  // A prefetch already gathered them: use what is there.
  if (gather_issued_) {
    finish_unshard();
    return;
  }
  post_forward_pieces_.clear();
  for (auto& p : params_) p.to_value_free_full();
}

void ParamGroup::set_custom_all_gather(std::shared_ptr<const CustomAllGather> comm) {
  custom_all_gather_ = std::move(comm);
  // The buffers the old collective allocated are not the new one's.
  fused_gather_out_ = at::Tensor();
  for (auto& p : params_) p.drop_full_buffer();
}

void ParamGroup::set_custom_reduce_scatter(std::shared_ptr<const CustomReduceScatter> comm) {
  custom_reduce_scatter_ = std::move(comm);
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
  if (ext_gather_issued_) finish_extension_gather(ws);
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
  post_forward_pieces_.clear();
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

void ParamGroup::set_post_forward_group(ProcessGroupPtr group, bool keep_full) {
  drop_post_forward_shards();
  post_forward_group_ = std::move(group);
  keep_full_after_forward_ = keep_full;
}

void ParamGroup::drop_post_forward_shards() {
  if (!gather_issued_) post_forward_pieces_.clear();
}

void ParamGroup::reshard_after_forward() {
  if (keep_full_after_forward_ && unsharded_) return;
  // Only a completed gather has every block to keep a piece of.
  if (!post_forward_group_ || !unsharded_ || gather_issued_) {
    reshard();
    return;
  }
  trace::Span span("reshard to post-forward group", "fsdp");
  if (span.active()) span.arg("group", post_forward_group_->name());
  const int64_t ws = shard_group_->size();
  const int64_t per = ws / post_forward_group_->size();  // shard ranks per piece
  const int64_t j = post_forward_group_->rank();
  std::vector<at::Tensor> pieces(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.is_sharded_placement()) continue;
    const int64_t n = per * p.padded_block_numel();
    pieces[i] = p.unsharded_flat().narrow(0, j * n, n).clone();
  }
  reshard();
  post_forward_pieces_ = std::move(pieces);
}

void ParamGroup::issue_post_forward_unshard() {
  const ProcessGroupPtr& pf = post_forward_group_;
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
    if (auto w = all_gather(pf, fused_gather_out_, mine)) gather_works_.push_back(w);
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
    if (auto w = all_gather(pf, out, mine)) gather_works_.push_back(w);
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
  ext_gather_out_ = at::Tensor();
  ext_gather_issued_ = false;
  post_forward_pieces_.clear();
  for (auto& p : params_) p.to_sharded();
  unsharded_ = false;
}

void ParamGroup::prepare_reduce(const ReduceSettings& settings) {
  // What the reduction's buffers take on this rank: for a Shard placement
  // the full-size input (a row per rank) and this rank's output, for a
  // Replicate one its full gradient; each with its presence flag.
  const int64_t ws = shard_group_->size();
  int64_t want = 0;
  bool scatters = false;
  for (const auto& p : params_) {
    if (!p.requires_grad()) continue;
    const auto e = static_cast<int64_t>(c10::elementSize(p.reduce_dtype()));
    const int64_t n = p.padded_block_numel() + 1;
    scatters = scatters || p.is_sharded_placement();
    want += (p.is_sharded_placement() ? (ws + 1) * n : n) * e;
  }
  oom_guard(scatters ? "reduce-scatter" : "all-reduce", want,
            [&] { prepare_reduce_buffers(settings); });
}

void ParamGroup::prepare_reduce_buffers(const ReduceSettings& settings) {
  if (stage_ != Stage::None) finish_reduce();
  entries_.clear();
  fused_grad_view_ = at::Tensor();
  scatter_inputs_.clear();
  all_reduce_bufs_.clear();
  std::vector<size_t> sharded, replicated;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;
    (params_[i].is_sharded_placement() ? sharded : replicated).push_back(i);
  }
  if (sharded.empty() && replicated.empty()) return;
  settings_ = settings;
  stage_ = Stage::Prepared;
  if (reduces_locally()) {
    // Nothing to sum: each gradient is installed as autograd made it.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].requires_grad()) local_grads_.emplace_back(i, params_[i].take_local_grad());
    }
    return;
  }
  const int64_t ws = shard_group_->size();
  auto pre_of = [&](const ShardedParam& p) {
    return pre_divide_factor(p.reduce_dtype(), settings_, divide());
  };
  auto options_of = [](const ShardedParam& p) {
    return at::TensorOptions().dtype(p.reduce_dtype()).device(p.compute_device());
  };
  auto presence = [](const ShardedParam& p) { return p.has_local_grad() ? 1.0 : 0.0; };
  // Replicate placements: the full gradient and its flag, all-reduced over
  // the shard group in place.
  for (size_t i : replicated) {
    auto& p = params_[i];
    const int64_t n = p.padded_block_numel();
    at::Tensor buf = at::empty({n + 1}, options_of(p));
    const double pre = pre_of(p);
    p.write_reduce_input(buf.narrow(0, 0, n));
    if (pre != 1) buf.narrow(0, 0, n).div_(pre);
    buf.narrow(0, n, 1).fill_(presence(p));
    p.discard_pass();
    entries_.push_back({i, buf.narrow(0, 0, n), buf.narrow(0, n, 1), pre});
    scatter_inputs_.push_back(buf);
    all_reduce_bufs_.push_back(buf);
  }
  if (sharded.empty()) return;
  // Shard placements: a row per destination rank, each row ending in the
  // flags, so that every rank's reduced block carries the presence sums.
  if (fused_) {
    int64_t total = 0;
    for (size_t i : sharded) total += params_[i].padded_block_numel();
    const int64_t flags = static_cast<int64_t>(sharded.size());
    // In the reduction group's shared memory where it has some: the shm
    // reduce-scatter then reads it in place instead of copying it first.
    at::Tensor input = collective_buffer(nullptr, custom_reduce_scatter_.get(), scatter_group_,
                                         {ws, total + flags}, options_of(params_[sharded[0]]));
    at::Tensor out = at::empty({total + flags}, input.options());
    const double pre = pre_divide_factor(input.scalar_type(), settings_, divide());
    int64_t offset = 0;
    for (size_t k = 0; k < sharded.size(); ++k) {
      auto& p = params_[sharded[k]];
      const int64_t n = p.padded_block_numel();
      p.write_reduce_input(input.narrow(1, offset, n));
      input.narrow(1, total + static_cast<int64_t>(k), 1).fill_(presence(p));
      p.discard_pass();
      entries_.push_back({sharded[k], out.narrow(0, offset, n),
                          out.narrow(0, total + static_cast<int64_t>(k), 1), pre});
      offset += n;
    }
    if (pre != 1) input.narrow(1, 0, total).div_(pre);
    scatter_inputs_.push_back(input);
    scatter_inputs_.push_back(out);
    all_reduce_bufs_.push_back(out);
    fused_grad_view_ = out.narrow(0, 0, total);
    return;
  }
  for (size_t i : sharded) {
    auto& p = params_[i];
    const int64_t n = p.padded_block_numel();
    at::Tensor input = collective_buffer(nullptr, custom_reduce_scatter_.get(), scatter_group_,
                                         {ws, n + 1}, options_of(p));
    const double pre = pre_of(p);
    p.write_reduce_input(input.narrow(1, 0, n));
    if (pre != 1) input.narrow(1, 0, n).div_(pre);
    input.narrow(1, n, 1).fill_(presence(p));
    p.discard_pass();
    at::Tensor out = at::empty({n + 1}, input.options());
    entries_.push_back({i, out.narrow(0, 0, n), out.narrow(0, n, 1), pre});
    scatter_inputs_.push_back(input);
    scatter_inputs_.push_back(out);
    all_reduce_bufs_.push_back(out);
  }
}

void ParamGroup::issue_reduce() {
  if (stage_ != Stage::Prepared) return;
  stage_ = Stage::Scattering;
  if (reduces_locally()) return;
  const int64_t ws = shard_group_->size();
  // The issue; "reduce-scatter wait" (finish_reduce) is the rest.
  trace::Span span("reduce-scatter", "fsdp");
  if (span.active()) span.arg("group", shard_group_->name()).arg("fused", fused_);
  int64_t traced_bytes = 0;  // of the full gradients reduced
  // scatter_inputs_ holds a Replicate parameter's buffer alone, a Shard
  // group's as (input, output) pairs; their count tells them apart.
  size_t k = 0;
  while (k < scatter_inputs_.size()) {
    const at::Tensor& in = scatter_inputs_[k];
    traced_bytes += static_cast<int64_t>(in.nbytes());
    if (in.dim() == 1) {  // Replicate: all-reduce in place
      if (ws > 1) {
        hint_bytes(in);
        scatter_works_.push_back(scatter_group_->all_reduce(in, ReduceOp::SUM, true));
      }
      k += 1;
      continue;
    }
    const at::Tensor& out = scatter_inputs_[k + 1];
    if (ws == 1) {  // HSDP with a shard group of one: the all-reduce sums
      out.copy_(in.view({-1}));
    } else {
      hint_bytes(in);
      if (auto w = reduce_scatter(out, in.view({-1}))) scatter_works_.push_back(w);
    }
    k += 2;
  }
  span.arg("bytes", traced_bytes);
  if (hsdp() && settings_.all_reduce) {
    auto& q = all_reduce_queue();
    std::lock_guard<std::mutex> lock(q.mu);
    q.groups.push_back(this);
  }
}

void ParamGroup::wait_all(std::vector<WorkPtr>& works, const char* what) {
  trace::Span span(works.empty() ? nullptr : what, "fsdp");
  if (span.active()) {
    span.arg("group", shard_group_->name()).arg("collectives", static_cast<int64_t>(works.size()));
  }
  for (auto& w : works) w->wait();
  works.clear();
}

bool ParamGroup::issue_all_reduce(bool wait) {
  if (stage_ != Stage::Scattering || !hsdp() || !settings_.all_reduce) return true;
  if (!wait) {
    for (auto& w : scatter_works_) {
      if (!w->is_completed()) return false;
    }
  }
  wait_all(scatter_works_, "reduce-scatter wait");
  // Sums kept back by earlier steps that skipped the all-reduce join this
  // one, in place, so a single all-reduce covers them.
  for (auto& e : entries_) {
    if (!partial_sums_[e.param].defined()) continue;
    e.out.add_(partial_sums_[e.param]);
    e.flag.add_(partial_presence_[e.param]);
  }
  trace::Span span("all-reduce", "fsdp");
  int64_t traced_bytes = 0;
  for (const auto& buf : all_reduce_bufs_) {
    traced_bytes += static_cast<int64_t>(buf.nbytes());
    hint_bytes(buf);
    all_reduce_works_.push_back(all_reduce_group_->all_reduce(buf, ReduceOp::SUM, true));
  }
  if (span.active()) span.arg("group", replicate_group_->name()).arg("bytes", traced_bytes);
  stage_ = Stage::AllReducing;
  return true;
}

void ParamGroup::finish_reduce() {
  if (stage_ == Stage::None) return;
  if (stage_ == Stage::Prepared) issue_reduce();
  flush_all_reduces_through();
  wait_all(scatter_works_, "reduce-scatter wait");
  wait_all(all_reduce_works_, "all-reduce wait");
  install();
  // One host wait for all of the group's offloaded gradients (queued back to
  // back) rather than a blocking copy each.
  wait_host_copies();
  entries_.clear();
  fused_grad_view_ = at::Tensor();
  local_grads_.clear();
  scatter_inputs_.clear();
  all_reduce_bufs_.clear();
  stage_ = Stage::None;
}

bool ParamGroup::reduce_complete() const {
  if (stage_ == Stage::None) return true;
  if (stage_ == Stage::Prepared) return false;
  // HSDP: the all-reduce is still to be issued.
  if (stage_ == Stage::Scattering && hsdp() && settings_.all_reduce) return false;
  auto done = [](const WorkPtr& w) { return w->is_completed(); };
  return std::all_of(scatter_works_.begin(), scatter_works_.end(), done) &&
         std::all_of(all_reduce_works_.begin(), all_reduce_works_.end(), done);
}

void ParamGroup::wait_host_copies() {
  for (auto& p : params_) p.wait_host_copies();
}

void ParamGroup::drop_reduce() {
  // An all-reduce still queued may already be issued on other ranks (it is
  // issued when the reduce-scatter finishes, a matter of timing): issue it
  // here too, so that every rank drops the same collectives.
  if (stage_ == Stage::Scattering) flush_all_reduces_through();
  // The buffers must outlive the collectives that use them.
  for (auto* works : {&scatter_works_, &all_reduce_works_}) {
    for (auto& w : *works) {
      try {
        w->wait();
      } catch (const std::exception&) {
        // The failed pass is being discarded; its transport error was its own.
      }
    }
    works->clear();
  }
  entries_.clear();
  fused_grad_view_ = at::Tensor();
  local_grads_.clear();
  scatter_inputs_.clear();
  all_reduce_bufs_.clear();
  stage_ = Stage::None;
}

void ParamGroup::install() {
  const ReduceSettings& s = settings_;
  const double replicate_size = hsdp() ? static_cast<double>(replicate_group_->size()) : 1.0;
  const double divide = this->divide();
  const double extra = s.scaling_factor.value_or(1.0);
  const double full_scale = (s.average ? 1.0 / divide : 1.0) * extra;
  // Replica-local mean while the replicate all-reduce is skipped.
  const double shard_scale = (s.average ? replicate_size / divide : 1.0) * extra;
  // The all-reduce hook sees what is installed: scaled first, then
  // installed as it left it. Not while HSDP keeps sums back (comm_hooks.h).
  const AllReduceHook* hook =
      all_reduce_hook_ && *all_reduce_hook_ && !(hsdp() && !s.all_reduce) ? all_reduce_hook_.get()
                                                                           : nullptr;
  for (auto& [param, grad] : local_grads_) {
    if (!grad.defined()) continue;
    if (hook != nullptr) {
      at::Tensor scaled = grad * full_scale;
      (*hook)(scaled.view({-1}));
      params_[param].add_local_grad(scaled, 1.0, s.fp32_main_grad);
    } else {
      params_[param].add_local_grad(grad, full_scale, s.fp32_main_grad);
    }
  }
  std::vector<at::Tensor> flag_views;
  for (const auto& e : entries_) flag_views.push_back(e.flag);
  if (flag_views.empty()) return;
  // One host copy for every flag (a single device sync on CUDA).
  const at::Tensor flags = at::cat(flag_views).to(at::kCPU, at::kDouble);
  const double* present = flags.data_ptr<double>();
  if (hook != nullptr) {
    for (size_t k = 0; k < entries_.size(); ++k) {
      const Entry& e = entries_[k];
      e.out.mul_(full_scale * e.pre_divided);
      // Fused Shard entries are views of one output, handed over once below.
      const bool in_fused = fused_grad_view_.defined() && params_[e.param].is_sharded_placement();
      if (!in_fused && present[k] > 0) (*hook)(e.out);
    }
    if (fused_grad_view_.defined()) (*hook)(fused_grad_view_);
  }

  if (hsdp() && !s.all_reduce) {
    for (size_t k = 0; k < entries_.size(); ++k) {
      const Entry& e = entries_[k];
      at::Tensor& partial = partial_sums_[e.param];
      // The gradient before the first kept-back step, restored when the
      // global result replaces the replica-local means.
      if (!partial.defined())
        base_grads_[e.param] = params_[e.param].sharded_grad_copy(s.fp32_main_grad);
      partial = partial.defined() ? partial.add_(e.out) : e.out.clone();
      partial_presence_[e.param] += present[k];
      if (present[k] > 0) {
        params_[e.param].add_reduced_grad(e.out, shard_scale * e.pre_divided, s.fp32_main_grad);
      }
    }
    return;
  }
  for (size_t k = 0; k < entries_.size(); ++k) {
    const Entry& e = entries_[k];
    if (partial_sums_[e.param].defined()) {
      params_[e.param].restore_grad(base_grads_[e.param], s.fp32_main_grad);
      base_grads_[e.param] = at::Tensor();
      partial_sums_[e.param] = at::Tensor();
      partial_presence_[e.param] = 0;
    }
    // No rank had a gradient: the parameter keeps none, as in plain LibTorch.
    if (present[k] > 0) {
      const double scale = hook != nullptr ? 1.0 : full_scale * e.pre_divided;
      params_[e.param].add_reduced_grad(e.out, scale, s.fp32_main_grad);
    }
  }
}

double ParamGroup::divide() const {
  const double shard_size = static_cast<double>(shard_group_->size());
  const double replicate_size = hsdp() ? static_cast<double>(replicate_group_->size()) : 1.0;
  return divide_factor_.value_or(shard_size * replicate_size);
}

void ParamGroup::clear_partial_sums() {
  for (auto& partial : partial_sums_) partial = at::Tensor();
  for (auto& base : base_grads_) base = at::Tensor();
  std::fill(partial_presence_.begin(), partial_presence_.end(), 0.0);
}

}  // namespace fsdp::detail
