// A unit's forward hooks (begin_forward, cast_input, finish_output,
// end_forward: fsdp/fully_shard.h), which Sharded<M> and the Sequential
// stand-in (sequential.cpp) call around a module's forward.
#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"
#include "sharding/query.h"
#include "sharding/registry.h"
#include "sharding/state.h"
#include "sharding/unit_trace.h"

#include <memory>

namespace fsdp::detail {

bool begin_forward(const torch::nn::Module& module, std::shared_ptr<UnitState>& unit) {
  unit = unit_for_module(module);
  if (!unit) return false;
  unit->pre_forward();
  if (trace::enabled()) {
    const bool recompute = RecomputeGuard::active();
    // A unit inside a checkpointed segment gets no pre-backward (its forward
    // ran without grad): its backward begins with the recompute.
    if (recompute && unit->pass.lifecycle.state() != Lifecycle::PreBackward &&
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

}  // namespace fsdp::detail
