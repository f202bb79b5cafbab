// UnitState hooks and the root step context: what runs before and after a
// unit's forward, when its outputs' gradients arrive, when its parameters'
// gradients are ready, once the whole backward is done, and when a pass
// failed.
#include "sharding/state.h"

#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

namespace fsdp {
namespace detail {
namespace {

// The registry of units (not step state: that lives in each root's context).
struct Registry {
  std::vector<std::shared_ptr<UnitState>> units;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<UnitState>> by_module;
  int64_t next_id = 0;
  // Bumped whenever the set of units changes; root lookups are cached per
  // unit against it.
  uint64_t generation = 0;
};

Registry& registry() {
  static Registry r;
  return r;
}

thread_local int recompute_depth = 0;

// ---- tracing (fsdp/trace.h) ----

// Attributes what this thread does in its scope to `unit`: the spans begun
// (the collectives' issue/wait spans) and the collectives issued, which the
// watchdog names when one is stuck -- so it is on with tracing off too.
class TraceUnit {
 public:
  explicit TraceUnit(UnitState& unit) {
    unit.register_label();
    prev_ = trace::detail::swap_unit(unit.id);
  }
  ~TraceUnit() { trace::detail::swap_unit(prev_); }
  TraceUnit(const TraceUnit&) = delete;
  TraceUnit& operator=(const TraceUnit&) = delete;

 private:
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

void trace_open(OpenSpans& open, UnitState& unit, const std::string& what) {
  trace_close(open, unit.id);  // left open by a pass that threw
  const uint64_t token = trace::detail::begin(what + " " + unit.label(), "fsdp");
  trace::detail::add_arg(token, "unit", unit.id);
  open.emplace_back(unit.id, token);
}

bool has_open(const OpenSpans& open, int64_t unit_id) {
  return std::any_of(open.begin(), open.end(),
                     [&](const std::pair<int64_t, uint64_t>& o) { return o.first == unit_id; });
}

std::shared_ptr<UnitState> unit_by_id(int64_t id) {
  for (auto& u : registry().units) {
    if (u->id == id) return u;
  }
  throw StateError("fully_shard: unit " + std::to_string(id) + " no longer exists");
}

// The units of a context's order that still exist.
std::vector<std::shared_ptr<UnitState>> locked(const std::vector<std::weak_ptr<UnitState>>& v) {
  std::vector<std::shared_ptr<UnitState>> out;
  for (const auto& w : v) {
    if (auto u = w.lock()) out.push_back(u);
  }
  return out;
}

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

// ---- the root context's passes ----

void finalize_backward(const std::weak_ptr<UnitState>& root);

// The units under `root` (a scan: only failed passes need it).
std::vector<std::shared_ptr<UnitState>> units_of(UnitState& root) {
  std::vector<std::shared_ptr<UnitState>> out;
  RootContext* ctx = &root.context();
  for (auto& u : live_units()) {
    if (&u->context() == ctx) out.push_back(u);
  }
  return out;
}

void reset_pass_state(UnitState& u) {
  u.lifecycle.reset();
  u.forward_entries = 0;
  u.in_order = false;
  u.grads_ready = 0;
  u.reduce_prepared = false;
  for (auto& a : u.arrived) std::fill(a.begin(), a.end(), false);
}

void begin_backward(UnitState& unit) {
  RootContext& c = unit.context();
  if (!unit.in_order) {
    // Not seen in this pass's forward (e.g. its forward ran in an earlier
    // pass whose backward is this one): reduced after the others.
    unit.in_order = true;
    unit.forward_predecessor.reset();
    if (auto front = c.order.empty() ? nullptr : c.order.front().lock()) {
      front->forward_predecessor = unit.weak_from_this();
    }
    c.order.insert(c.order.begin(), unit.weak_from_this());
  }
  c.phase = RootContext::Phase::Backward;
  if (c.callback_queued) return;
  c.callback_queued = true;
  std::weak_ptr<UnitState> root = unit.root();
  torch::autograd::Engine::get_default_engine().queue_callback(
      [root] { finalize_backward(root); });
}

// A unit's reduction holds its full-size gradient buffers in the reduce
// dtype (a float32 copy of bfloat16 gradients) until it finishes. Left to
// the end of backward, every unit's would be alive at once: so when one is
// issued, the earlier ones are finished (their buffers freed) -- if they
// complete within a short grace. Never waited for without a bound: a rank
// whose gradients arrive in another order (parameters unused on it) issues
// the same reduction only at the end of its backward, after all-gathers this
// rank would issue after the wait, so each would wait for the other. On the
// CPU the grace also hands the cores to the communication thread; on CUDA
// the host does not wait at all (it would stall kernel launches). Whether a
// reduction is finished here or at the end of backward changes when memory
// is freed, never a value or the order of collectives. Reductions of units
// with set_is_last_backward(false) stay in flight on purpose.
constexpr auto kReductionGrace = std::chrono::milliseconds(100);

bool completes_within_grace(const UnitState& u) {
  if (u.reductions_complete()) return true;
  if (u.computes_on_cuda) return false;
  const auto deadline = std::chrono::steady_clock::now() + kReductionGrace;
  for (;;) {
    // HSDP: the all-reduces due once their reduce-scatters finished.
    ParamGroup::poll_all_reduces();
    if (u.reductions_complete()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void finish_older_reductions(RootContext& c) {
  while (c.in_flight.size() > 1) {
    auto oldest = c.in_flight.front().lock();
    if (oldest && (!oldest->is_last_backward || !completes_within_grace(*oldest))) return;
    if (oldest) oldest->finish_reductions();
    c.in_flight.erase(c.in_flight.begin());
  }
}

// Issues the prepared reductions in reverse forward order, stopping at the
// first unit that still waits for gradients (the order is a setting of each
// unit, never of the data, so it is the same on every rank).
void issue_ready_reductions(RootContext& c) {
  while (c.reduce_cursor < c.order.size()) {
    auto u = c.order[c.order.size() - 1 - c.reduce_cursor].lock();
    if (u && u->reduces() && u->in_order) {
      if (!u->reduce_prepared) break;
      TraceUnit traced(*u);
      for (auto& g : u->groups) g.issue_reduce();
      u->reduce_prepared = false;
      c.in_flight.push_back(u);
      if (!open_backward.empty()) trace_close(open_backward, u->id);
      finish_older_reductions(c);
    }
    ++c.reduce_cursor;
  }
  ParamGroup::poll_all_reduces();
}

// Issues `target`'s all-gather ahead of its use, on behalf of `c`'s pass.
void prefetch(RootContext& c, UnitState& target) {
  target.unshard(/*async_op=*/true);
  c.prefetched.push_back(target.weak_from_this());
}

// Waits for and discards the all-gathers of prefetched units that did not
// use them (their forward or backward never ran): the next use re-gathers
// the shards as the optimizer left them.
void drop_unused_prefetches(RootContext& c) {
  for (auto& u : locked(c.prefetched)) {
    const bool pending = std::any_of(u->groups.begin(), u->groups.end(),
                                     [](const ParamGroup& g) { return g.gather_in_flight(); });
    if (pending) u->reshard();
  }
  c.prefetched.clear();
}

void finish_in_flight(RootContext& c) {
  for (auto& u : locked(c.in_flight)) u->finish_reductions();
  c.in_flight.clear();
}

void finalize_backward(const std::weak_ptr<UnitState>& root_weak) {
  auto root = root_weak.lock();
  if (!root) return;
  RootContext& c = root->context();
  c.callback_queued = false;
  const auto units = locked(c.order);
  // Units whose gradients did not all arrive (some or all parameters unused
  // on this rank) reduce now, zeros standing in for the missing ones --
  // still in reverse forward order.
  for (size_t k = c.reduce_cursor; k < c.order.size(); ++k) {
    auto u = c.order[c.order.size() - 1 - k].lock();
    if (!u || u->lifecycle.state() == Lifecycle::PostBackward) continue;
    u->post_backward();
  }
  issue_ready_reductions(c);
  // Every unit that took part is resharded, also one whose output was unused.
  for (auto& u : units) {
    if (u->lifecycle.state() != Lifecycle::PostBackward) u->post_backward();
    if (!open_backward.empty()) trace_close(open_backward, u->id);
  }
  // set_is_last_backward(false) leaves a unit's reductions in flight (the
  // next forward, backward or finish_pending_reductions() finishes them).
  std::vector<std::weak_ptr<UnitState>> kept;
  for (auto& u : locked(c.in_flight)) {
    if (u->is_last_backward) {
      u->finish_reductions();
    } else {
      kept.push_back(u);
    }
  }
  c.in_flight = std::move(kept);
  drop_unused_prefetches(c);
  for (auto& u : units) {
    for (auto& g : u->groups) {
      for (auto& p : g.params()) p.commit_pass(/*reduced=*/u->requires_gradient_sync);
    }
    u->transition(Lifecycle::Idle, "end of backward");
    reset_pass_state(*u);
  }
  c.phase = RootContext::Phase::Idle;
}

// The previous pass of this root threw (the user caught it): whatever it
// left is discarded so that the next step equals a run without it.
void abort_failed_pass(UnitState& root) {
  RootContext& c = root.context();
  for (auto& u : units_of(root)) {
    TraceUnit traced(*u);
    for (auto& g : u->groups) {
      g.drop_reduce();
      for (auto& p : g.params()) p.discard_pass();
      g.reshard();  // waits for an all-gather in flight
    }
    reset_pass_state(*u);
  }
  while (!open_backward.empty()) trace_close(open_backward, open_backward.back().first);
  while (!open_forward.empty()) trace_close(open_forward, open_forward.back().first);
  c.order.clear();
  c.in_flight.clear();
  c.prefetched.clear();  // resharded above with every unit
  c.reduce_cursor = 0;
  c.callback_queued = false;  // the engine dropped it with the failed graph
  c.phase = RootContext::Phase::Idle;
}

void begin_forward_pass(UnitState& root) {
  RootContext& c = root.context();
  if (c.phase == RootContext::Phase::Forward || c.phase == RootContext::Phase::Backward) {
    abort_failed_pass(root);
  }
  // A new step: reductions left in flight by set_is_last_backward(false)
  // land before the optimizer's values are gathered again, and gathers a
  // forward-only pass prefetched for units it did not run are dropped.
  finish_in_flight(c);
  drop_unused_prefetches(c);
  for (auto& u : locked(c.order)) {
    u->in_order = false;
    for (auto& g : u->groups) g.wait_host_copies();
  }
  if (!c.order.empty()) {
    ++c.order_generation;
    for (size_t i = 0; i + 1 < c.order.size(); ++i) {
      if (auto u = c.order[i].lock()) {
        u->forward_successor = c.order[i + 1];
        u->successor_generation = c.order_generation;
      }
    }
  }
  c.order.clear();
  c.reduce_cursor = 0;
  c.phase = RootContext::Phase::Forward;
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

 private:
  torch::nn::AnyModule inner_;
};

}  // namespace

RecomputeGuard::RecomputeGuard() { ++recompute_depth; }
RecomputeGuard::~RecomputeGuard() { --recompute_depth; }
bool RecomputeGuard::active() { return recompute_depth > 0; }

std::shared_ptr<UnitState> unit_for_module(const torch::nn::Module& module) {
  auto& by_module = registry().by_module;
  auto it = by_module.find(&module);
  if (it == by_module.end()) return nullptr;
  auto u = it->second.lock();
  return u && u->alive() ? u : nullptr;
}

std::vector<std::shared_ptr<UnitState>> live_units() {
  std::vector<std::shared_ptr<UnitState>> out;
  for (auto& u : registry().units) {
    if (u->alive()) out.push_back(u);
  }
  return out;
}

void register_unit(const std::shared_ptr<UnitState>& unit) {
  Registry& r = registry();
  // Units whose modules are gone free their shards and communicators here.
  r.units.erase(std::remove_if(r.units.begin(), r.units.end(),
                               [](const std::shared_ptr<UnitState>& u) { return !u->alive(); }),
                r.units.end());
  for (auto it = r.by_module.begin(); it != r.by_module.end();) {
    it = it->second.expired() ? r.by_module.erase(it) : std::next(it);
  }
  r.units.push_back(unit);
  for (const auto* m : unit->module_ptrs) r.by_module[m] = unit;
  ++r.generation;
}

bool is_managed(const at::Tensor& param) {
  for (auto& u : live_units()) {
    for (const auto& g : u->groups) {
      for (const auto& p : g.params()) {
        if (p.param().unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return true;
      }
    }
  }
  return false;
}

int64_t next_unit_id() { return registry().next_id++; }

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
  unit->pre_forward();
  if (trace::enabled()) {
    const bool recompute = RecomputeGuard::active();
    // A unit inside a checkpointed segment gets no pre-backward (its forward
    // ran without grad): its backward begins with the recompute.
    if (recompute && unit->lifecycle.state() != Lifecycle::PreBackward &&
        !has_open(open_backward, unit->id)) {
      trace_open(open_backward, *unit, "backward");
    }
    trace_open(open_forward, *unit, recompute ? "recompute forward" : "forward");
  }
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
                     DeviceMesh mesh_, std::vector<detail::ParamGroup> groups_,
                     const FullyShardOptions& options)
    : id(id_),
      mesh(std::move(mesh_)),
      groups(std::move(groups_)),
      mp(options.mp_policy),
      reshard_after_forward(options.reshard_after_forward) {
  for (auto& m : mods) {
    modules.push_back(m);
    module_ptrs.push_back(m.get());
  }
  bool on_cuda = mesh.device_type() == c10::kCUDA;
  for (const auto& g : groups) {
    arrived.emplace_back(g.params().size(), false);
    for (const auto& p : g.params()) {
      grads_expected += p.requires_grad() ? 1 : 0;
      on_cuda = on_cuda || p.compute_device().is_cuda();
    }
  }
  computes_on_cuda = on_cuda;
  implicit_backward_prefetch = options.implicit_backward_prefetch.value_or(on_cuda);
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
  const uint64_t gen = detail::registry().generation;
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

bool UnitState::reshards_after_forward() {
  if (const auto v = reshard_after_forward.value()) return *v;
  return !(at::GradMode::is_enabled() && is_root());
}

void UnitState::register_label() {
  const uint64_t gen = detail::registry().generation;
  if (registered_label_generation_ == gen) return;
  trace::detail::set_unit_label(id, label());
  registered_label_generation_ = gen;
}

std::string UnitState::label() {
  const uint64_t gen = detail::registry().generation;
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
  lifecycle.transition(to, [this] { return error_label(); }, why);
}

std::string UnitState::error_label() { return label() + " #" + std::to_string(id);
}

bool UnitState::unsharded() const {
  return std::any_of(groups.begin(), groups.end(),
                     [](const detail::ParamGroup& g) { return g.unsharded(); });
}

bool UnitState::reduces() const {
  return requires_gradient_sync &&
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
}

void UnitState::reshard() {
  detail::TraceUnit traced(*this);
  for (auto& g : groups) g.reshard();
}

void UnitState::finish_reductions() {
  detail::TraceUnit traced(*this);
  for (auto& g : groups) g.finish_reduce();
}

bool UnitState::reductions_complete() const {
  return std::all_of(groups.begin(), groups.end(),
                     [](const detail::ParamGroup& g) { return g.reduce_complete(); });
}

void UnitState::pre_forward() {
  detail::RootContext& c = context();
  const bool recompute = detail::RecomputeGuard::active();
  if (!recompute && is_root()) detail::begin_forward_pass(*this);
  lifecycle.enter_forward([this] { return error_label(); });
  if (!recompute && !in_order) {
    in_order = true;
    if (c.order.empty()) {
      forward_predecessor.reset();
    } else {
      forward_predecessor = c.order.back();
    }
    c.order.push_back(weak_from_this());
  }
  ++forward_entries;
  wait_unshard();
  if (recompute) return;
  if (explicit_forward_prefetch) {
    for (auto& weak : forward_prefetch) {
      if (auto u = weak.lock()) detail::prefetch(c, *u);
    }
    return;
  }
  // Implicit prefetch: the unit that ran forward after this one in the
  // previous pass gathers while this one computes, instead of at its own
  // pre-forward, where the caller would wait for it. The order is the
  // model's, the same on every rank, so every rank issues the same gathers;
  // a guess that proves wrong is dropped like any unused prefetch.
  if (successor_generation != c.order_generation) return;
  auto next = forward_successor.lock();
  if (next && next.get() != this && !next->in_order && !next->unsharded()) {
    detail::prefetch(c, *next);
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
  lifecycle.leave_forward([this] { return error_label(); });
  // A unit over several modules reshards once all of them ran.
  if (forward_entries % static_cast<int64_t>(modules.size()) != 0) return;
  forward_entries = 0;
  // A recompute inside backward (activation checkpointing) needs the full
  // parameters for the backward that follows; post_backward reshards.
  if (detail::RecomputeGuard::active()) return;
  if (reshards_after_forward()) reshard();
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
  if (lifecycle.state() != detail::Lifecycle::Idle) return;
  transition(detail::Lifecycle::PreBackward, "pre-backward");
  if (trace::enabled()) detail::trace_open(detail::open_backward, *this, "backward");
  wait_unshard();
  if (explicit_backward_prefetch) {
    for (auto& weak : backward_prefetch) {
      if (auto u = weak.lock()) detail::prefetch(context(), *u);
    }
    return;
  }
  // Implicit prefetch: the unit that ran forward just before this one runs
  // backward next -- unless it already began its backward (an enclosing
  // unit, such as the root, whose outputs' gradients arrived first).
  if (!implicit_backward_prefetch) return;
  auto prev = forward_predecessor.lock();
  if (prev && prev->lifecycle.state() == detail::Lifecycle::Idle) {
    detail::prefetch(context(), *prev);
  }
}

void UnitState::on_grad_ready(size_t group, size_t index) {
  detail::begin_backward(*this);
  if (lifecycle.state() == detail::Lifecycle::Idle) {
    // No pre-backward ran: the unit's forward was recomputed (activation
    // checkpointing) or its outputs carry no hook.
    transition(detail::Lifecycle::PreBackward, "first gradient");
  }
  if (lifecycle.state() == detail::Lifecycle::PostBackward) {
    throw StateError("fully_shard: unit " + error_label() + ": a gradient of '" +
                     groups[group].params()[index].name() +
                     "' arrived after the unit's gradients were reduced in this backward "
                     "(illegal transition PostBackward -> PostBackward)");
  }
  groups[group].params()[index].take_pass_grad();
  if (arrived[group][index]) return;  // accumulated again in this pass
  arrived[group][index] = true;
  if (++grads_ready == grads_expected) post_backward();
}

void UnitState::post_backward() {
  if (lifecycle.state() == detail::Lifecycle::Idle) {
    transition(detail::Lifecycle::PreBackward, "end of backward");
  }
  transition(detail::Lifecycle::PostBackward, "post-backward");
  {
    detail::TraceUnit traced(*this);
    if (reduces()) {
      for (auto& g : groups) g.prepare_reduce(reduce_settings());
      reduce_prepared = true;
    }
  }
  if (reshard_after_backward) reshard();
  // A unit's backward span lasts until its reduction is issued (a later
  // unit's turn may come first: reductions go in reverse forward order).
  if (reduce_prepared) {
    detail::issue_ready_reductions(context());
  } else if (!detail::open_backward.empty()) {
    detail::trace_close(detail::open_backward, id);
  }
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
