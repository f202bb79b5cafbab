// GradientReduction: a parameter group's gradients summed across ranks.
// The rules: docs/architecture.md#collective-order, #reduction-order.
#include "sharding/gradient_reduction.h"

#include "fsdp/trace.h"
#include "comm/group_registry.h"
#include "sharding/memory_guard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <deque>
#include <mutex>

namespace fsdp::detail {
namespace {

// Reductions whose replicate all-reduce is still to be issued, in the order
// their reduce-scatters were issued.
struct AllReduceQueue {
  std::mutex mu;
  std::deque<GradientReduction*> reductions;
};
// Never destroyed: the unit registry (registry.cpp) destroys its units' groups
// at exit, and each leaves this queue then. A function-local static queue was
// destroyed first (ASan: heap-use-after-free in ~ParamGroup at exit).
AllReduceQueue& all_reduce_queue() {
  static auto* q = new AllReduceQueue;
  return *q;
}

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

at::TensorOptions reduce_options(const ShardedParam& p) {
  return at::TensorOptions().dtype(p.reduce_dtype()).device(p.compute_device());
}

double presence(const ShardedParam& p) { return p.has_local_grad() ? 1.0 : 0.0; }

}  // namespace

// One reduced parameter: its reduced block and its presence count, views
// into the reduction's output.
struct GradientReduction::Entry {
  size_t param;
  at::Tensor out;
  at::Tensor flag;
  double pre_divided = 1;  // the gradient entered the reduction divided by this
};

GradientReduction::GradientReduction(size_t num_params, const ProcessGroupPtr& shard_group,
                                     const ProcessGroupPtr& replicate_group,
                                     std::optional<double> divide_factor, bool fused)
    : shard_group_(shard_group),
      replicate_group_(replicate_group),
      scatter_group_(reduction_group_for(shard_group_)),
      all_reduce_group_(replicate_group_ ? reduction_group_for(replicate_group_) : nullptr),
      divide_factor_(divide_factor),
      fused_(fused),
      partial_sums_(num_params),
      partial_presence_(num_params),
      base_grads_(num_params) {}

// Groups move only while their unit is built, before any reduction, so a
// queued pointer never dangles.
GradientReduction::GradientReduction(GradientReduction&&) noexcept = default;
GradientReduction& GradientReduction::operator=(GradientReduction&&) noexcept = default;
GradientReduction::~GradientReduction() { leave_all_reduce_queue(); }

void GradientReduction::poll_all_reduces() {
  auto& q = all_reduce_queue();
  std::lock_guard<std::mutex> lock(q.mu);
  while (!q.reductions.empty() && q.reductions.front()->issue_all_reduce(/*wait=*/false)) {
    q.reductions.pop_front();
  }
}

void GradientReduction::flush_all_reduces_through() {
  auto& q = all_reduce_queue();
  std::lock_guard<std::mutex> lock(q.mu);
  if (std::find(q.reductions.begin(), q.reductions.end(), this) == q.reductions.end()) return;
  for (;;) {
    GradientReduction* r = q.reductions.front();
    r->issue_all_reduce(/*wait=*/true);
    q.reductions.pop_front();
    if (r == this) return;
  }
}

void GradientReduction::leave_all_reduce_queue() {
  auto& q = all_reduce_queue();
  std::lock_guard<std::mutex> lock(q.mu);
  q.reductions.erase(std::remove(q.reductions.begin(), q.reductions.end(), this),
                     q.reductions.end());
}

void GradientReduction::prepare(std::vector<ShardedParam>& params, const ReduceSettings& settings,
                                const CollectiveRoute& route) {
  // What the reduction's buffers take on this rank: for a Shard placement
  // the full-size input (a row per rank) and this rank's output, for a
  // Replicate one its full gradient; each with its presence flag.
  const int64_t ws = shard_group_->size();
  int64_t want = 0;
  bool scatters = false;
  for (const auto& p : params) {
    if (!p.requires_grad()) continue;
    const auto e = static_cast<int64_t>(c10::elementSize(p.reduce_dtype()));
    const int64_t n = p.padded_block_numel() + 1;
    scatters = scatters || p.is_sharded_placement();
    want += (p.is_sharded_placement() ? (ws + 1) * n : n) * e;
  }
  oom_guard(scatters ? "reduce-scatter" : "all-reduce", want,
            [&] { prepare_buffers(params, settings, route); });
}

void GradientReduction::prepare_buffers(std::vector<ShardedParam>& params,
                                        const ReduceSettings& settings,
                                        const CollectiveRoute& route) {
  if (stage_ != Stage::None) finish(params, route);
  clear();
  std::vector<size_t> sharded, replicated;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) continue;
    (params[i].is_sharded_placement() ? sharded : replicated).push_back(i);
  }
  if (sharded.empty() && replicated.empty()) return;
  settings_ = settings;
  stage_ = Stage::Prepared;
  if (reduces_locally()) {
    // Nothing to sum: each gradient is installed as autograd made it.
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].requires_grad()) local_grads_.emplace_back(i, params[i].take_local_grad());
    }
    return;
  }
  prepare_replicated(params, replicated);
  if (sharded.empty()) return;
  if (fused_) {
    prepare_fused(params, sharded, route);
  } else {
    prepare_per_param(params, sharded, route);
  }
}

// Replicate placements: the full gradient and its flag, all-reduced over the
// shard group in place.
void GradientReduction::prepare_replicated(std::vector<ShardedParam>& params,
                                           const std::vector<size_t>& which) {
  for (size_t i : which) {
    auto& p = params[i];
    const int64_t n = p.padded_block_numel();
    at::Tensor buf = at::empty({n + 1}, reduce_options(p));
    const double pre = pre_divide_factor(p.reduce_dtype(), settings_, divide());
    p.write_reduce_input(buf.narrow(0, 0, n));
    if (pre != 1) buf.narrow(0, 0, n).div_(pre);
    buf.narrow(0, n, 1).fill_(presence(p));
    p.discard_pass();
    entries_.push_back({i, buf.narrow(0, 0, n), buf.narrow(0, n, 1), pre});
    scatter_inputs_.push_back(buf);
    all_reduce_bufs_.push_back(buf);
  }
}

// Shard placements, fused: one input with a row per destination rank, each
// row ending in every parameter's flag, so that every rank's reduced block
// carries the presence sums.
void GradientReduction::prepare_fused(std::vector<ShardedParam>& params,
                                      const std::vector<size_t>& which,
                                      const CollectiveRoute& route) {
  const int64_t ws = shard_group_->size();
  int64_t total = 0;
  for (size_t i : which) total += params[i].padded_block_numel();
  const int64_t flags = static_cast<int64_t>(which.size());
  // In the reduction group's shared memory where it has some: the shm
  // reduce-scatter then reads it in place instead of copying it first.
  at::Tensor input = route.reduce_scatter_buffer(scatter_group_, {ws, total + flags},
                                                 reduce_options(params[which[0]]));
  at::Tensor out = at::empty({total + flags}, input.options());
  const double pre = pre_divide_factor(input.scalar_type(), settings_, divide());
  int64_t offset = 0;
  for (size_t k = 0; k < which.size(); ++k) {
    auto& p = params[which[k]];
    const int64_t n = p.padded_block_numel();
    p.write_reduce_input(input.narrow(1, offset, n));
    input.narrow(1, total + static_cast<int64_t>(k), 1).fill_(presence(p));
    p.discard_pass();
    entries_.push_back({which[k], out.narrow(0, offset, n),
                        out.narrow(0, total + static_cast<int64_t>(k), 1), pre});
    offset += n;
  }
  if (pre != 1) input.narrow(1, 0, total).div_(pre);
  scatter_inputs_.push_back(input);
  scatter_inputs_.push_back(out);
  all_reduce_bufs_.push_back(out);
  fused_grad_view_ = out.narrow(0, 0, total);
}

// Shard placements, one reduce-scatter each: a row per destination rank,
// each ending in the parameter's flag.
void GradientReduction::prepare_per_param(std::vector<ShardedParam>& params,
                                          const std::vector<size_t>& which,
                                          const CollectiveRoute& route) {
  const int64_t ws = shard_group_->size();
  for (size_t i : which) {
    auto& p = params[i];
    const int64_t n = p.padded_block_numel();
    at::Tensor input = route.reduce_scatter_buffer(scatter_group_, {ws, n + 1}, reduce_options(p));
    const double pre = pre_divide_factor(p.reduce_dtype(), settings_, divide());
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

void GradientReduction::issue(const CollectiveRoute& route) {
  if (stage_ != Stage::Prepared) return;
  stage_ = Stage::Scattering;
  if (reduces_locally()) return;
  const int64_t ws = shard_group_->size();
  // The issue; "reduce-scatter wait" (finish) is the rest.
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
      if (auto w = route.reduce_scatter(scatter_group_, out, in.view({-1}))) {
        scatter_works_.push_back(w);
      }
    }
    k += 2;
  }
  span.arg("bytes", traced_bytes);
  if (hsdp() && settings_.all_reduce) {
    auto& q = all_reduce_queue();
    std::lock_guard<std::mutex> lock(q.mu);
    q.reductions.push_back(this);
  }
}

void GradientReduction::wait_all(std::vector<WorkPtr>& works, const char* what) {
  trace::Span span(works.empty() ? nullptr : what, "fsdp");
  if (span.active()) {
    span.arg("group", shard_group_->name()).arg("collectives", static_cast<int64_t>(works.size()));
  }
  for (auto& w : works) w->wait();
  works.clear();
}

bool GradientReduction::issue_all_reduce(bool wait) {
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

void GradientReduction::finish(std::vector<ShardedParam>& params, const CollectiveRoute& route) {
  if (stage_ == Stage::None) return;
  if (stage_ == Stage::Prepared) issue(route);
  flush_all_reduces_through();
  wait_all(scatter_works_, "reduce-scatter wait");
  wait_all(all_reduce_works_, "all-reduce wait");
  install(params);
  // One host wait for all of the group's offloaded gradients (queued back to
  // back) rather than a blocking copy each.
  for (auto& p : params) p.wait_host_copies();
  clear();
}

bool GradientReduction::complete() const {
  if (stage_ == Stage::None) return true;
  if (stage_ == Stage::Prepared) return false;
  // HSDP: the all-reduce is still to be issued.
  if (stage_ == Stage::Scattering && hsdp() && settings_.all_reduce) return false;
  auto done = [](const WorkPtr& w) { return w->is_completed(); };
  return std::all_of(scatter_works_.begin(), scatter_works_.end(), done) &&
         std::all_of(all_reduce_works_.begin(), all_reduce_works_.end(), done);
}

void GradientReduction::drop() {
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
  clear();
}

void GradientReduction::clear() {
  entries_.clear();
  fused_grad_view_ = at::Tensor();
  local_grads_.clear();
  scatter_inputs_.clear();
  all_reduce_bufs_.clear();
  stage_ = Stage::None;
}

void GradientReduction::install(std::vector<ShardedParam>& params) {
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
      params[param].add_local_grad(scaled, 1.0, s.fp32_main_grad);
    } else {
      params[param].add_local_grad(grad, full_scale, s.fp32_main_grad);
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
      const bool in_fused = fused_grad_view_.defined() && params[e.param].is_sharded_placement();
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
        base_grads_[e.param] = params[e.param].sharded_grad_copy(s.fp32_main_grad);
      partial = partial.defined() ? partial.add_(e.out) : e.out.clone();
      partial_presence_[e.param] += present[k];
      if (present[k] > 0) {
        params[e.param].add_reduced_grad(e.out, shard_scale * e.pre_divided, s.fp32_main_grad);
      }
    }
    return;
  }
  for (size_t k = 0; k < entries_.size(); ++k) {
    const Entry& e = entries_[k];
    if (partial_sums_[e.param].defined()) {
      params[e.param].restore_grad(base_grads_[e.param], s.fp32_main_grad);
      base_grads_[e.param] = at::Tensor();
      partial_sums_[e.param] = at::Tensor();
      partial_presence_[e.param] = 0;
    }
    // No rank had a gradient: the parameter keeps none, as in plain LibTorch.
    if (present[k] > 0) {
      const double scale = hook != nullptr ? 1.0 : full_scale * e.pre_divided;
      params[e.param].add_reduced_grad(e.out, scale, s.fp32_main_grad);
    }
  }
}

double GradientReduction::divide() const {
  const double shard_size = static_cast<double>(shard_group_->size());
  const double replicate_size = hsdp() ? static_cast<double>(replicate_group_->size()) : 1.0;
  return divide_factor_.value_or(shard_size * replicate_size);
}

void GradientReduction::clear_partial_sums() {
  for (auto& partial : partial_sums_) partial = at::Tensor();
  for (auto& base : base_grads_) base = at::Tensor();
  std::fill(partial_presence_.begin(), partial_presence_.end(), 0.0);
}

}  // namespace fsdp::detail
