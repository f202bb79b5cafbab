// A unit's forward hooks (begin_forward, cast_input, finish_output,
// end_forward: fsdp/fully_shard.h), which Sharded<M> calls around its
// module's forward, and the stand-in that calls them for a sharded entry of
// a torch::nn::Sequential.
#include "sharding/sequential.h"

#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"
#include "sharding/query.h"
#include "sharding/registry.h"
#include "sharding/state.h"
#include "sharding/unit_trace.h"

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <utility>

namespace fsdp::detail {
namespace {

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
