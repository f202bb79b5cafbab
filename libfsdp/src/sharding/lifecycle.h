// Internal: a unit's place in the training step, with checked transitions.
//
//   Idle --pre_forward--> Forward --post_forward--> (the state it came from)
//   Idle --pre_backward / first gradient--> PreBackward
//   PreBackward --post_backward--> PostBackward --end of backward--> Idle
//
// A recompute of a checkpointed segment re-enters Forward from Idle or
// PreBackward and returns there. Anything else (a forward of a unit that
// already reduced in this backward, a second post-backward, ...) is a
// StateError naming the unit and both states: a silent skip would hide a
// desynchronised collective order. A failed pass (an exception the user
// caught) is reset to Idle wholesale by the root, not through these edges.
// The rule: docs/architecture.md#lifecycle-states.
#pragma once

#include "fsdp/errors.h"

#include <string>

namespace fsdp::detail {

enum class Lifecycle { Idle, Forward, PreBackward, PostBackward };

inline const char* to_string(Lifecycle s) {
  switch (s) {
    case Lifecycle::Idle: return "Idle";
    case Lifecycle::Forward: return "Forward";
    case Lifecycle::PreBackward: return "PreBackward";
    case Lifecycle::PostBackward: return "PostBackward";
  }
  return "?";
}

inline bool is_legal(Lifecycle from, Lifecycle to) {
  using L = Lifecycle;
  switch (to) {
    case L::Forward: return from == L::Idle || from == L::PreBackward;
    case L::PreBackward: return from == L::Idle || from == L::PreBackward;
    case L::PostBackward: return from == L::PreBackward;
    case L::Idle: return from == L::Forward || from == L::PostBackward || from == L::Idle;
  }
  return false;
}

class UnitLifecycle {
 public:
  Lifecycle state() const { return state_; }
  // Moves to `to` or throws StateError("fully_shard: unit <label>: illegal
  // transition <from> -> <to> (<why>)"). `label`: a string, or a callable
  // returning one (evaluated only for the message).
  template <typename Label>
  void transition(Lifecycle to, const Label& label, const char* why) {
    if (!is_legal(state_, to)) fail(to_string(to), label_of(label), why);
    state_ = to;
  }
  // Forward returns to where it came from (Idle, or PreBackward for a
  // recompute inside backward).
  template <typename Label>
  void enter_forward(const Label& label) {
    const Lifecycle from = state_;
    transition(Lifecycle::Forward, label, "forward");
    return_to_ = from;
  }
  template <typename Label>
  void leave_forward(const Label& label) {
    if (state_ != Lifecycle::Forward) {
      fail(to_string(return_to_), label_of(label), "end of a forward that did not begin");
    }
    state_ = return_to_;
  }
  void reset() {
    state_ = Lifecycle::Idle;
    return_to_ = Lifecycle::Idle;
  }

 private:
  static std::string label_of(const std::string& s) { return s; }
  static std::string label_of(const char* s) { return s; }
  template <typename F>
  static auto label_of(const F& f) -> decltype(std::string(f())) {
    return f();
  }
  [[noreturn]] void fail(const char* to, const std::string& label, const char* why) const {
    throw StateError("fully_shard: unit " + label + ": illegal transition " + to_string(state_) +
                     " -> " + to + " (" + why + ")");
  }

  Lifecycle state_ = Lifecycle::Idle;
  Lifecycle return_to_ = Lifecycle::Idle;
};

}  // namespace fsdp::detail
