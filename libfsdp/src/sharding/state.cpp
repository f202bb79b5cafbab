// UnitState: a unit's hooks -- what runs before and after its forward, when
// its outputs' gradients arrive, when its parameters' gradients are ready --
// and its place under a root (sharding/root_pass.h runs the root's passes).
#include "sharding/state.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "sharding/memory_guard.h"
#include "sharding/query.h"
#include "sharding/registry.h"
#include "sharding/root_pass.h"
#include "sharding/unit_trace.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <string>
#include <utility>

namespace fsdp {
namespace detail {
namespace {

thread_local int recompute_depth = 0;

// Identity in forward; in backward, the unit's pre-backward runs before the
// gradient flows into the unit.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* c, const at::Tensor& x,
                            int64_t unit_id) {
    c->saved_data["unit"] = unit_id;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* c,
                                                 torch::autograd::variable_list grads) {
    unit_by_id(c->saved_data["unit"].toInt())->pre_backward();
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

RecomputeGuard::RecomputeGuard() { ++recompute_depth; }
RecomputeGuard::~RecomputeGuard() { --recompute_depth; }
bool RecomputeGuard::active() { return recompute_depth > 0; }

}  // namespace detail

UnitState::UnitState(int64_t id_, std::vector<std::shared_ptr<torch::nn::Module>> mods,
                     DeviceMesh mesh_, std::vector<detail::ParamGroup> groups_,
                     const FullyShardOptions& options)
    : id(id_),
      mesh(std::move(mesh_)),
      groups(std::move(groups_)) {
  settings.mp = options.mp_policy;
  offloads = options.offload_policy.has_value();
  for (auto& m : mods) {
    modules.push_back(m);
    module_ptrs.push_back(m.get());
  }
  bool on_cuda = mesh.device_type() == c10::kCUDA;
  for (const auto& g : groups) {
    pass.arrived.emplace_back(g.params().size(), false);
    for (const auto& p : g.params()) {
      grads_expected += p.requires_grad() ? 1 : 0;
      on_cuda = on_cuda || p.compute_device().is_cuda();
    }
  }
  computes_on_cuda = on_cuda;
  settings.implicit_backward_prefetch = options.implicit_backward_prefetch.value_or(on_cuda);
}

bool UnitState::alive() const {
  return std::all_of(modules.begin(), modules.end(),
                     [](const std::weak_ptr<torch::nn::Module>& m) { return !m.expired(); });
}

bool UnitState::contains(const UnitState& other) const {
  for (const auto& weak : modules) {
    auto m = weak.lock();
    if (!m) continue;
    for (const auto& d : m->modules(/*include_self=*/true)) {
      for (const auto* target : other.module_ptrs) {
        if (d.get() == target) return true;
      }
    }
  }
  return false;
}

std::vector<std::shared_ptr<UnitState>> UnitState::self_and_nested() {
  std::vector<std::shared_ptr<UnitState>> out{shared_from_this()};
  for (auto& u : detail::live_units()) {
    if (u.get() != this && contains(*u)) out.push_back(u);
  }
  return out;
}

detail::RootContext& UnitState::context() {
  const uint64_t gen = detail::unit_set_generation();
  auto ctx = context_.lock();
  if (ctx && context_generation_ == gen) return *ctx;
  // The outermost unit containing this one is the root.
  std::shared_ptr<UnitState> root = shared_from_this();
  for (bool moved = true; moved;) {
    moved = false;
    for (auto& u : detail::live_units()) {
      if (u != root && u->contains(*root)) {
        root = u;
        moved = true;
        break;
      }
    }
  }
  if (!root->own_context_) root->own_context_ = std::make_shared<detail::RootContext>();
  context_ = root->own_context_;
  root_ = root;
  context_generation_ = gen;
  return *root->own_context_;
}

std::shared_ptr<UnitState> UnitState::root() {
  context();
  return root_.lock();
}

bool UnitState::is_root() { return root().get() == this; }

void UnitState::set_reshard_after_forward(ReshardAfterForward v, const std::vector<int>& ranks) {
  std::vector<ProcessGroupPtr> shard_groups;
  for (const auto& g : groups) shard_groups.push_back(g.shard_group());
  std::vector<detail::PostForwardTarget> targets = detail::post_forward_targets(shard_groups, ranks);
  for (auto& g : groups) g.drop_post_forward_shards();
  settings.reshard_after_forward = {v, std::move(targets)};
}

bool UnitState::reshards_after_forward() {
  if (const auto v = settings.reshard_after_forward.value.value()) return *v;
  return !(at::GradMode::is_enabled() && is_root());
}

void UnitState::register_label() {
  const uint64_t gen = detail::unit_set_generation();
  if (registered_label_generation_ == gen) return;
  trace::detail::set_unit_label(id, label());
  registered_label_generation_ = gen;
}

std::string UnitState::label() {
  const uint64_t gen = detail::unit_set_generation();
  if (label_generation_ == gen) return label_;
  // The modules' paths inside the root ("block0", "head.0"), or their type.
  const auto root_unit = root();
  std::string label;
  for (const auto& weak : modules) {
    auto m = weak.lock();
    if (!m) continue;
    std::string path;
    if (root_unit) {
      for (const auto& root_weak : root_unit->modules) {
        auto r = root_weak.lock();
        if (!r) continue;
        for (const auto& item : r->named_modules("", /*include_self=*/true)) {
          if (item.value().get() == m.get()) path = item.key();
        }
      }
    }
    label += (label.empty() ? "" : "+") + (path.empty() ? m->name() : path);
  }
  if (label.empty()) label = "unit";
  label_ = label;
  label_generation_ = gen;
  return label_;
}

void UnitState::transition(detail::Lifecycle to, const char* why) {
  pass.lifecycle.transition(to, [this] { return error_label(); }, why);
}

std::string UnitState::error_label() { return label() + " #" + std::to_string(id);
}

bool UnitState::unsharded() const {
  return std::any_of(groups.begin(), groups.end(),
                     [](const detail::ParamGroup& g) { return g.unsharded(); });
}

bool UnitState::reduces() const {
  return settings.requires_gradient_sync &&
         std::any_of(groups.begin(), groups.end(),
                     [](const detail::ParamGroup& g) { return g.reduces(); });
}

void UnitState::unshard(bool async_op) {
  detail::TraceUnit traced(*this);
  for (auto& g : groups) g.issue_unshard();
  if (!async_op) wait_unshard();
}

void UnitState::wait_unshard() {
  detail::TraceUnit traced(*this);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    groups[gi].finish_unshard();
    auto& params = groups[gi].params();
    for (size_t i = 0; i < params.size(); ++i) {
      std::weak_ptr<UnitState> self = weak_from_this();
      params[i].ensure_grad_hook([self, gi, i] {
        if (auto unit = self.lock()) unit->on_grad_ready(gi, i);
      });
    }
  }
  detail::trace_unit_memory(*this);
}

void UnitState::reshard() {
  detail::TraceUnit traced(*this);
  for (auto& g : groups) g.reshard();
  detail::trace_unit_memory(*this);
}

void UnitState::reshard_after_forward() {
  detail::TraceUnit traced(*this);
  const auto& targets = settings.reshard_after_forward.targets;
  for (size_t g = 0; g < groups.size(); ++g) groups[g].reshard_after_forward(targets[g]);
  detail::trace_unit_memory(*this);
}

void UnitState::finish_reductions() {
  detail::TraceUnit traced(*this);
  for (auto& g : groups) g.finish_reduce();
  detail::trace_unit_memory(*this);
}

bool UnitState::reductions_complete() const {
  return std::all_of(groups.begin(), groups.end(),
                     [](const detail::ParamGroup& g) { return g.reduce_complete(); });
}

void UnitState::pre_forward() {
  detail::RootContext& c = context();
  const bool recompute = detail::RecomputeGuard::active();
  if (!recompute && is_root()) detail::begin_forward_pass(*this);
  pass.lifecycle.enter_forward([this] { return error_label(); });
  if (!recompute && !pass.in_order) {
    pass.in_order = true;
    if (c.order.empty()) {
      neighbours.forward_predecessor.reset();
    } else {
      neighbours.forward_predecessor = c.order.back();
    }
    c.order.push_back(weak_from_this());
  }
  ++pass.forward_entries;
  wait_unshard();
  if (recompute) return;
  if (settings.explicit_forward_prefetch) {
    for (auto& weak : settings.forward_prefetch) {
      if (auto u = weak.lock()) detail::prefetch(c, *u);
    }
    return;
  }
  // Implicit prefetch: the unit that ran forward after this one in the
  // previous pass gathers while this one computes, instead of at its own
  // pre-forward, where the caller would wait for it. The order is the
  // model's, the same on every rank, so every rank issues the same gathers;
  // a guess that proves wrong is dropped like any unused prefetch.
  if (neighbours.successor_generation != c.order_generation) return;
  auto next = neighbours.forward_successor.lock();
  if (next && next.get() != this && !next->pass.in_order && !next->unsharded()) {
    detail::prefetch(c, *next);
  }
}

at::Tensor UnitState::cast_input(const at::Tensor& t) const {
  const MixedPrecisionPolicy& mp = settings.mp;
  if (mp.cast_forward_inputs && mp.param_dtype && t.defined() && t.is_floating_point()) {
    return t.to(*mp.param_dtype);
  }
  return t;
}

at::Tensor UnitState::finish_output(const at::Tensor& t) {
  at::Tensor out = t;
  const MixedPrecisionPolicy& mp = settings.mp;
  if (mp.output_dtype && out.defined() && out.is_floating_point()) out = out.to(*mp.output_dtype);
  if (out.defined() && out.requires_grad() && !detail::RecomputeGuard::active()) {
    out = detail::PreBackward::apply(out, id);
  }
  return out;
}

void UnitState::post_forward() {
  pass.lifecycle.leave_forward([this] { return error_label(); });
  // A unit over several modules reshards once all of them ran.
  if (pass.forward_entries % static_cast<int64_t>(modules.size()) != 0) return;
  pass.forward_entries = 0;
  // A recompute inside backward (activation checkpointing) needs the full
  // parameters for the backward that follows; post_backward reshards.
  if (detail::RecomputeGuard::active()) return;
  // hpZ keeps pieces for the backward; without grad mode none follows.
  if (reshards_after_forward()) {
    if (at::GradMode::is_enabled()) {
      reshard_after_forward();
    } else {
      reshard();
    }
  }
  if (is_root() && context().phase == detail::RootContext::Phase::Forward) {
    context().phase = detail::RootContext::Phase::ForwardDone;
    // No backward follows a forward without grad: the shards' uploads (CPU
    // offload on CUDA) must have run before the host may write them.
    if (!at::GradMode::is_enabled()) {
      for (auto& u : detail::locked(context().order)) {
        for (auto& g : u->groups) g.wait_host_copies();
      }
    }
  }
}

void UnitState::pre_backward() {
  detail::begin_backward(*this);
  // An output whose gradient arrives after this unit reduced (it does not
  // depend on the unit's parameters) needs nothing more.
  if (pass.lifecycle.state() != detail::Lifecycle::Idle) return;
  transition(detail::Lifecycle::PreBackward, "pre-backward");
  if (trace::enabled()) detail::trace_open(detail::open_backward, *this, "backward");
  if (settings.unshard_in_backward) {
    wait_unshard();
  } else {
    // set_unshard_in_backward(false): full shapes for autograd, no gather.
    detail::TraceUnit traced(*this);
    for (auto& g : groups) g.expose_without_values();
  }
  if (settings.explicit_backward_prefetch) {
    for (auto& weak : settings.backward_prefetch) {
      if (auto u = weak.lock()) detail::prefetch(context(), *u);
    }
    return;
  }
  // Implicit prefetch: the unit that ran forward just before this one runs
  // backward next -- unless it already began its backward (an enclosing
  // unit, such as the root, whose outputs' gradients arrived first).
  if (!settings.implicit_backward_prefetch) return;
  auto prev = neighbours.forward_predecessor.lock();
  if (prev && prev->pass.lifecycle.state() == detail::Lifecycle::Idle) {
    detail::prefetch(context(), *prev);
  }
}

void UnitState::on_grad_ready(size_t group, size_t index) {
  detail::begin_backward(*this);
  if (pass.lifecycle.state() == detail::Lifecycle::Idle) {
    // No pre-backward ran: the unit's forward was recomputed (activation
    // checkpointing) or its outputs carry no hook.
    transition(detail::Lifecycle::PreBackward, "first gradient");
  }
  if (pass.lifecycle.state() == detail::Lifecycle::PostBackward) {
    throw StateError("fully_shard: unit " + error_label() + ": a gradient of '" +
                     groups[group].params()[index].name() +
                     "' arrived after the unit's gradients were reduced in this backward "
                     "(illegal transition PostBackward -> PostBackward)");
  }
  groups[group].params()[index].take_pass_grad();
  if (pass.arrived[group][index]) return;  // accumulated again in this pass
  pass.arrived[group][index] = true;
  if (++pass.grads_ready == grads_expected) post_backward();
}

void UnitState::post_backward() {
  if (pass.lifecycle.state() == detail::Lifecycle::Idle) {
    transition(detail::Lifecycle::PreBackward, "end of backward");
  }
  transition(detail::Lifecycle::PostBackward, "post-backward");
  {
    detail::TraceUnit traced(*this);
    if (reduces()) {
      for (auto& g : groups) g.prepare_reduce(reduce_settings());
      pass.reduce_prepared = true;
      detail::trace_unit_memory(*this);
    }
  }
  if (settings.reshard_after_backward) reshard();
  // A unit's backward span lasts until its reduction is issued (a later
  // unit's turn may come first: reductions go in reverse forward order).
  if (pass.reduce_prepared) {
    detail::issue_ready_reductions(context());
  } else if (!detail::open_backward.empty()) {
    detail::trace_close(detail::open_backward, id);
  }
}

detail::ReduceSettings UnitState::reduce_settings() const {
  detail::ReduceSettings s;
  s.average = settings.average;
  s.scaling_factor = settings.scaling_factor;
  s.all_reduce = settings.requires_all_reduce;
  s.fp32_main_grad = settings.mp.apply_grad_on_fp32_main_grad;
  return s;
}

}  // namespace fsdp
