// Internal: the step context of a root and the passes it runs -- the
// forward order of its units, the reverse-order issue of their reductions,
// prefetches, the end-of-backward finalisation, and the reset after a pass
// that threw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace c10 {
struct Event;
}  // namespace c10

namespace fsdp {
struct UnitState;
namespace detail {

// One root's step: which pass is running, the order its units ran forward
// in, and how far its reductions have been issued. Every unit under the
// root shares it; another root (a second model, or a second pipeline stage
// on this rank) has its own, so their steps cannot disturb each other.
struct RootContext {
  enum class Phase { Idle, Forward, ForwardDone, Backward };
  Phase phase = Phase::Idle;
  // Units in the order of their first forward this pass, then units first
  // seen in backward.
  std::vector<std::weak_ptr<UnitState>> order;
  // Counts the passes whose `order` was recorded into the units'
  // neighbours.forward_successor (their successor_generation says which).
  uint64_t order_generation = 0;
  // Reductions are issued strictly in reverse forward order, so every rank
  // issues them in one order whatever gradients it received: the next unit
  // (counted from the end of `order`) whose reduction is to be issued.
  size_t reduce_cursor = 0;
  // Units whose reductions were issued and are not yet finished, in issue
  // order (reductions left in flight by set_is_last_backward(false)).
  std::vector<std::weak_ptr<UnitState>> in_flight;
  // Units this root's hooks prefetched in the current pass. One that never
  // ran (a branch not taken) still has its all-gather in flight, reading the
  // shards the optimizer is about to update in place: dropped at the end of
  // backward and at the next root forward.
  std::vector<std::weak_ptr<UnitState>> prefetched;
  bool callback_queued = false;
  // FSDPModule::set_post_optim_event: the next root forward orders the
  // current stream after it, once.
  std::shared_ptr<c10::Event> post_optim_event;
};

// The units of a context's order that still exist.
std::vector<std::shared_ptr<UnitState>> locked(const std::vector<std::weak_ptr<UnitState>>& v);

// A root's forward begins a new step: discards what a failed pass left,
// finishes the reductions the last one left in flight, and records its
// forward order for the implicit forward prefetch.
void begin_forward_pass(UnitState& root);
// `unit`'s backward begins (its pre-backward or first gradient): puts it in
// the order if its forward did not, and queues the end-of-backward
// finalisation once per pass.
void begin_backward(UnitState& unit);
// Issues the prepared reductions in reverse forward order, stopping at the
// first unit that still waits for gradients.
void issue_ready_reductions(RootContext& c);
// Issues `target`'s all-gather ahead of its use, on behalf of `c`'s pass.
void prefetch(RootContext& c, UnitState& target);

}  // namespace detail
}  // namespace fsdp
