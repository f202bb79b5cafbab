// UnitState hooks and the step context: what runs before and after a unit's
// forward, when its outputs' gradients arrive, when its parameters' gradients
// are ready, and once the whole backward is done.
#include "fsdp_state.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace fsdp {
namespace detail {
namespace {

enum class Phase { Idle, Forward, Backward };

// Process-wide: units, the current pass and the order units ran forward in.
struct StepContext {
  std::mutex mu;
  std::vector<std::shared_ptr<UnitState>> units;
  int64_t next_id = 0;
  // Bumped whenever the set of units changes; is_root() answers are cached
  // per unit against it, since a forward asks once per unit.
  uint64_t generation = 0;
  Phase phase = Phase::Idle;
  std::vector<std::weak_ptr<UnitState>> forward_order;
  bool callback_queued = false;
};

StepContext& ctx() {
  static StepContext c;
  return c;
}

thread_local int recompute_depth = 0;

// ---- tracing (fsdp/trace.h) ----

// A unit's name in span names: its modules' paths inside the root module
// ("block0", "head.0"), or the root module's type; cached per unit set.
std::string trace_label(const UnitState& unit) {
  static std::mutex mu;
  static std::unordered_map<int64_t, std::pair<uint64_t, std::string>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& entry = cache[unit.id];
  if (entry.first == ctx().generation && !entry.second.empty()) return entry.second;
  std::string label;
  for (const auto& weak : unit.modules) {
    auto m = weak.lock();
    if (!m) continue;
    std::string path;
    for (const auto& root : live_units()) {
      if (!is_root(*root)) continue;
      for (const auto& root_weak : root->modules) {
        auto r = root_weak.lock();
        if (!r) continue;
        for (const auto& item : r->named_modules("", /*include_self=*/true)) {
          if (item.value().get() == m.get()) path = item.key();
        }
      }
    }
    label += (label.empty() ? "" : "+") + (path.empty() ? m->name() : path);
  }
  if (label.empty()) label = "unit " + std::to_string(unit.id);
  entry = {ctx().generation, label};
  trace::detail::set_unit_label(unit.id, label);
  return label;
}

// Attributes the spans begun on this thread in its scope (the collectives'
// issue/wait spans) to `unit`.
class TraceUnit {
 public:
  explicit TraceUnit(const UnitState& unit) {
    if (!trace::enabled()) return;
    trace_label(unit);
    prev_ = trace::detail::swap_unit(unit.id);
    active_ = true;
  }
  ~TraceUnit() {
    if (active_) trace::detail::swap_unit(prev_);
  }
  TraceUnit(const TraceUnit&) = delete;
  TraceUnit& operator=(const TraceUnit&) = delete;

 private:
  bool active_ = false;
  int64_t prev_ = -1;
};

// Forward and backward spans begin and end in different calls: (unit id,
// span token) of the open ones, per thread.
using OpenSpans = std::vector<std::pair<int64_t, uint64_t>>;
thread_local OpenSpans open_forward;
thread_local OpenSpans open_backward;

void trace_close(OpenSpans& open, int64_t unit_id) {
  for (size_t i = open.size(); i-- > 0;) {
    if (open[i].first != unit_id) continue;
    trace::detail::end(open[i].second);  // also ends the spans begun after it
    open.erase(open.begin() + static_cast<std::ptrdiff_t>(i), open.end());
    return;
  }
}

void trace_open(OpenSpans& open, const UnitState& unit, const std::string& what) {
  trace_close(open, unit.id);  // left open by a pass that threw
  const uint64_t token = trace::detail::begin(what + " " + trace_label(unit), "fsdp");
  trace::detail::add_arg(token, "unit", unit.id);
  open.emplace_back(unit.id, token);
}

std::shared_ptr<UnitState> unit_by_id(int64_t id) {
  for (auto& u : ctx().units) {
    if (u->id == id) return u;
  }
  throw StateError("fully_shard: unit " + std::to_string(id) + " no longer exists");
}

void finalize_backward();

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

void ensure_backward_callback() {
  StepContext& c = ctx();
  c.phase = Phase::Backward;
  if (c.callback_queued) return;
  c.callback_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback(finalize_backward);
}

void finalize_backward() {
  StepContext& c = ctx();
  c.callback_queued = false;
  std::vector<std::shared_ptr<UnitState>> participants;
  for (auto& u : c.units) {
    if (u->alive() && (u->pre_backward_done || u->grads_ready > 0)) participants.push_back(u);
  }
  // Units whose parameters did not all receive gradients still reduce what
  // they got (missing gradients count as zeros), in a rank-independent order.
  for (auto& u : participants) {
    if (!u->post_backward_done) u->post_backward();
    if (!open_backward.empty()) trace_close(open_backward, u->id);
  }
  for (auto& u : participants) {
    TraceUnit traced(*u);
    if (u->is_last_backward) u->group.finish_reduce();
    u->pre_backward_done = false;
    u->post_backward_done = false;
    u->grads_ready = 0;
  }
  c.phase = Phase::Idle;
}

// Stands in for a sharded child of a torch::nn::Sequential.
class SequentialEntryImpl : public torch::nn::Module {
 public:
  explicit SequentialEntryImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {}
  at::Tensor forward(at::Tensor x) {
    std::shared_ptr<UnitState> unit;
    if (!begin_forward(*inner_.ptr(), unit)) return inner_.forward(x);
    at::Tensor y = finish_output(unit, inner_.forward(cast_input(unit, x)));
    end_forward(unit);
    return y;
  }
  const std::shared_ptr<torch::nn::Module> inner() const { return inner_.ptr(); }

 private:
  torch::nn::AnyModule inner_;
};

}  // namespace

RecomputeGuard::RecomputeGuard() { ++recompute_depth; }
RecomputeGuard::~RecomputeGuard() { --recompute_depth; }
bool RecomputeGuard::active() { return recompute_depth > 0; }

std::shared_ptr<UnitState> unit_for_module(const torch::nn::Module& module) {
  for (auto& u : ctx().units) {
    if (!u->alive()) continue;
    for (const auto* m : u->module_ptrs) {
      if (m == &module) return u;
    }
  }
  return nullptr;
}

std::vector<std::shared_ptr<UnitState>> live_units() {
  std::vector<std::shared_ptr<UnitState>> out;
  for (auto& u : ctx().units) {
    if (u->alive()) out.push_back(u);
  }
  return out;
}

void register_unit(const std::shared_ptr<UnitState>& unit) {
  auto& units = ctx().units;
  // Units whose modules are gone free their shards and communicators here.
  units.erase(std::remove_if(units.begin(), units.end(),
                             [](const std::shared_ptr<UnitState>& u) { return !u->alive(); }),
              units.end());
  units.push_back(unit);
  ++ctx().generation;
}

bool is_managed(const at::Tensor& param) {
  for (auto& u : ctx().units) {
    if (!u->alive()) continue;
    for (const auto& p : u->group.params()) {
      if (p.param().unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return true;
    }
  }
  return false;
}

int64_t next_unit_id() { return ctx().next_id++; }

bool is_root(const UnitState& unit) {
  StepContext& c = ctx();
  if (unit.root_generation == c.generation) return unit.root_cached;
  bool root = true;
  for (auto& other : c.units) {
    if (other.get() != &unit && other->alive() && other->contains(unit)) root = false;
  }
  unit.root_cached = root;
  unit.root_generation = c.generation;
  return root;
}

void intercept_sequential_children(torch::nn::Module& module) {
  for (const auto& child : module.modules(/*include_self=*/true)) {
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(child.get());
    if (seq == nullptr) continue;
    for (auto it = seq->begin(); it != seq->end(); ++it) {
      auto inner = it->ptr();
      if (std::dynamic_pointer_cast<SequentialEntryImpl>(inner)) continue;
      if (!unit_for_module(*inner)) continue;
      *it = torch::nn::AnyModule(std::make_shared<SequentialEntryImpl>(*it));
    }
  }
}

bool begin_forward(const torch::nn::Module& module, std::shared_ptr<UnitState>& unit) {
  unit = unit_for_module(module);
  if (!unit) return false;
  if (trace::enabled()) {
    const bool recompute = RecomputeGuard::active();
    // A unit inside a checkpointed segment gets no pre-backward (its forward
    // ran without grad): its backward begins with the recompute.
    if (recompute && !unit->pre_backward_done &&
        std::none_of(open_backward.begin(), open_backward.end(),
                     [&](const std::pair<int64_t, uint64_t>& o) { return o.first == unit->id; })) {
      trace_open(open_backward, *unit, "backward");
    }
    trace_open(open_forward, *unit, recompute ? "recompute forward" : "forward");
  }
  unit->pre_forward();
  return true;
}

at::Tensor cast_input(const std::shared_ptr<UnitState>& unit, const at::Tensor& t) {
  return unit->cast_input(t);
}

at::Tensor finish_output(const std::shared_ptr<UnitState>& unit, const at::Tensor& t) {
  return unit->finish_output(t);
}

void end_forward(const std::shared_ptr<UnitState>& unit) {
  unit->post_forward();
  if (!open_forward.empty()) trace_close(open_forward, unit->id);
}

}  // namespace detail

UnitState::UnitState(int64_t id_, std::vector<std::shared_ptr<torch::nn::Module>> mods,
                     DeviceMesh mesh_, detail::ParamGroup group_, const FullyShardOptions& options)
    : id(id_),
      mesh(std::move(mesh_)),
      group(std::move(group_)),
      mp(options.mp_policy),
      reshard_after_forward(options.reshard_after_forward) {
  for (auto& m : mods) {
    modules.push_back(m);
    module_ptrs.push_back(m.get());
  }
  for (const auto& p : group.params()) grads_expected += p.requires_grad() ? 1 : 0;
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

void UnitState::unshard(bool async_op) {
  detail::TraceUnit traced(*this);
  group.issue_unshard();
  if (!async_op) wait_unshard();
}

void UnitState::wait_unshard() {
  detail::TraceUnit traced(*this);
  group.finish_unshard();
  for (size_t i = 0; i < group.params().size(); ++i) {
    std::weak_ptr<UnitState> self = weak_from_this();
    group.params()[i].ensure_grad_hook([self, i] {
      if (auto unit = self.lock()) unit->on_grad_ready(i);
    });
  }
}

void UnitState::reshard() {
  detail::TraceUnit traced(*this);
  group.reshard();
}

void UnitState::pre_forward() {
  auto& c = detail::ctx();
  const bool recompute = detail::RecomputeGuard::active();
  if (!recompute && detail::is_root(*this)) {
    if (c.phase == detail::Phase::Backward) {
      // The previous backward threw: the engine dropped our end-of-backward
      // callback. Start clean rather than mistake this step for that one.
      c.callback_queued = false;
      while (!detail::open_backward.empty()) {
        detail::trace_close(detail::open_backward, detail::open_backward.back().first);
      }
      for (auto& u : c.units) {
        u->pre_backward_done = false;
        u->post_backward_done = false;
        u->grads_ready = 0;
      }
    }
    const bool seen = std::any_of(c.forward_order.begin(), c.forward_order.end(),
                                  [this](const std::weak_ptr<UnitState>& w) {
                                    return w.lock().get() == this;
                                  });
    if (c.phase != detail::Phase::Forward || seen) {
      // A new step: reductions left in flight by set_is_last_backward(false)
      // land before the optimizer's values are gathered again.
      for (auto& u : detail::live_units()) {
        detail::TraceUnit traced(*u);
        u->group.finish_reduce();
      }
      c.forward_order.clear();
      c.phase = detail::Phase::Forward;
    }
  }
  if (!recompute && forward_entries == 0) c.forward_order.push_back(weak_from_this());
  ++forward_entries;
  wait_unshard();
  if (recompute) return;
  for (auto& weak : forward_prefetch) {
    if (auto u = weak.lock()) u->unshard(/*async_op=*/true);
  }
}

at::Tensor UnitState::cast_input(const at::Tensor& t) const {
  if (mp.cast_forward_inputs && mp.param_dtype && t.defined() && t.is_floating_point()) {
    return t.to(*mp.param_dtype);
  }
  return t;
}

at::Tensor UnitState::finish_output(const at::Tensor& t) {
  at::Tensor out = t;
  if (mp.output_dtype && out.defined() && out.is_floating_point()) out = out.to(*mp.output_dtype);
  if (out.defined() && out.requires_grad() && !detail::RecomputeGuard::active()) {
    out = detail::PreBackward::apply(out, id);
  }
  return out;
}

void UnitState::post_forward() {
  // A unit over several modules reshards once all of them ran.
  if (forward_entries % static_cast<int64_t>(modules.size()) != 0) return;
  forward_entries = 0;
  // A recompute inside backward (activation checkpointing) needs the full
  // parameters for the backward that follows; post_backward reshards.
  if (detail::RecomputeGuard::active()) return;
  if (reshard_after_forward) reshard();
}

void UnitState::pre_backward() {
  detail::ensure_backward_callback();
  if (pre_backward_done) return;
  pre_backward_done = true;
  if (trace::enabled()) detail::trace_open(detail::open_backward, *this, "backward");
  wait_unshard();
  if (explicit_backward_prefetch) {
    for (auto& weak : backward_prefetch) {
      if (auto u = weak.lock()) u->unshard(/*async_op=*/true);
    }
    return;
  }
  // Implicit prefetch: the unit that ran forward just before this one runs
  // backward next -- unless it already began its backward (an enclosing
  // unit, such as the root, whose outputs' gradients arrived first).
  auto& order = detail::ctx().forward_order;
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i].lock().get() == this) {
      auto prev = order[i - 1].lock();
      if (prev && !prev->pre_backward_done) prev->unshard(/*async_op=*/true);
      break;
    }
  }
}

void UnitState::on_grad_ready(size_t index) {
  detail::ensure_backward_callback();
  group.params()[index].take_unsharded_grad();
  if (++grads_ready == grads_expected) post_backward();
}

void UnitState::post_backward() {
  post_backward_done = true;
  {
    detail::TraceUnit traced(*this);
    if (requires_gradient_sync) group.issue_reduce(reduce_settings());
  }
  if (reshard_after_backward) reshard();
  if (!detail::open_backward.empty()) detail::trace_close(detail::open_backward, id);
}

detail::ReduceSettings UnitState::reduce_settings() const {
  detail::ReduceSettings s;
  s.average = average;
  s.scaling_factor = scaling_factor;
  s.all_reduce = requires_all_reduce;
  s.fp32_main_grad = mp.apply_grad_on_fp32_main_grad;
  return s;
}

}  // namespace fsdp
