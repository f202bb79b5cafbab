// The stand-in that runs a unit's forward hooks (forward_hooks.cpp) for a
// sharded entry of a torch::nn::Sequential, which calls its entries' forward
// past Sharded<M>.
#include "sharding/sequential.h"

#include "fsdp/fully_shard.h"
#include "sharding/registry.h"
#include "sharding/state.h"

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

}  // namespace fsdp::detail
