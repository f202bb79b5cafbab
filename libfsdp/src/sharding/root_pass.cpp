// The root context's passes: forward order, reductions issued in reverse
// forward order, prefetches, the end-of-backward finalisation, and the reset
// after a pass that threw.
// The rule: docs/architecture.md#collective-order.
#include "sharding/root_pass.h"

#include "sharding/registry.h"
#include "sharding/state.h"
#include "sharding/unit_trace.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

namespace fsdp::detail {
namespace {

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
  u.pass.lifecycle.reset();
  u.pass.forward_entries = 0;
  u.pass.in_order = false;
  u.pass.grads_ready = 0;
  u.pass.reduce_prepared = false;
  for (auto& a : u.pass.arrived) std::fill(a.begin(), a.end(), false);
}

}  // namespace

// The units of a context's order that still exist.
std::vector<std::shared_ptr<UnitState>> locked(const std::vector<std::weak_ptr<UnitState>>& v) {
  std::vector<std::shared_ptr<UnitState>> out;
  for (const auto& w : v) {
    if (auto u = w.lock()) out.push_back(u);
  }
  return out;
}

void begin_backward(UnitState& unit) {
  RootContext& c = unit.context();
  if (!unit.pass.in_order) {
    // Not seen in this pass's forward (e.g. its forward ran in an earlier
    // pass whose backward is this one): reduced after the others.
    unit.pass.in_order = true;
    unit.neighbours.forward_predecessor.reset();
    if (auto front = c.order.empty() ? nullptr : c.order.front().lock()) {
      front->neighbours.forward_predecessor = unit.weak_from_this();
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

namespace {

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
    if (oldest && (!oldest->settings.is_last_backward || !completes_within_grace(*oldest))) return;
    if (oldest) oldest->finish_reductions();
    c.in_flight.erase(c.in_flight.begin());
  }
}

}  // namespace

// Issues the prepared reductions in reverse forward order, stopping at the
// first unit that still waits for gradients (the order is a setting of each
// unit, never of the data, so it is the same on every rank).
void issue_ready_reductions(RootContext& c) {
  while (c.reduce_cursor < c.order.size()) {
    auto u = c.order[c.order.size() - 1 - c.reduce_cursor].lock();
    if (u && u->reduces() && u->pass.in_order) {
      if (!u->pass.reduce_prepared) break;
      TraceUnit traced(*u);
      for (auto& g : u->groups) g.issue_reduce();
      u->pass.reduce_prepared = false;
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
  // A unit that skips its backward all-gather is not gathered for it either.
  if (c.phase == RootContext::Phase::Backward && !target.settings.unshard_in_backward) return;
  target.unshard(/*async_op=*/true);
  c.prefetched.push_back(target.weak_from_this());
}

namespace {

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
    if (!u || u->pass.lifecycle.state() == Lifecycle::PostBackward) continue;
    u->post_backward();
  }
  issue_ready_reductions(c);
  // Every unit that took part is resharded, also one whose output was unused.
  for (auto& u : units) {
    if (u->pass.lifecycle.state() != Lifecycle::PostBackward) u->post_backward();
    if (!open_backward.empty()) trace_close(open_backward, u->id);
  }
  // set_is_last_backward(false) leaves a unit's reductions in flight (the
  // next forward, backward or finish_pending_reductions() finishes them).
  std::vector<std::weak_ptr<UnitState>> kept;
  for (auto& u : locked(c.in_flight)) {
    if (u->settings.is_last_backward) {
      u->finish_reductions();
    } else {
      kept.push_back(u);
    }
  }
  c.in_flight = std::move(kept);
  drop_unused_prefetches(c);
  for (auto& u : units) {
    for (auto& g : u->groups) {
      for (auto& p : g.params()) p.commit_pass(/*reduced=*/u->settings.requires_gradient_sync);
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

}  // namespace

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
    u->pass.in_order = false;
    for (auto& g : u->groups) {
      g.wait_host_copies();
      // hpZ pieces serve only the backward of the pass that kept them.
      g.drop_post_forward_shards();
    }
  }
  if (!c.order.empty()) {
    ++c.order_generation;
    for (size_t i = 0; i + 1 < c.order.size(); ++i) {
      if (auto u = c.order[i].lock()) {
        u->neighbours.forward_successor = c.order[i + 1];
        u->neighbours.successor_generation = c.order_generation;
      }
    }
  }
  c.order.clear();
  c.reduce_cursor = 0;
  c.phase = RootContext::Phase::Forward;
  // The all-gathers about to be issued are ordered after the current
  // stream (the collective backends' rule); the user's event, recorded where
  // the optimizer ran, joins that order here. CPU events never get here.
  if (c.post_optim_event) {
    const std::shared_ptr<c10::Event> event = std::move(c.post_optim_event);
    c.post_optim_event.reset();
    const auto* impl = c10::impl::getDeviceGuardImpl(event->device_type());
    event->block(impl->getStream(impl->getDevice()));
  }
}

}  // namespace fsdp::detail
