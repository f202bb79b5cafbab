// PipelineStage: validation, and the FSDP units a stage drives.
#include "pp/stage.h"

#include "fsdp/errors.h"
#include "sharding/registry.h"
#include "sharding/state.h"

#include <unordered_set>

namespace fsdp::pp {

PipelineStage::PipelineStage(std::shared_ptr<torch::nn::Module> module, ForwardFn forward,
                             int stage_index, int num_stages, DeviceMesh pp_mesh,
                             StageOptions options)
    : state_(std::make_shared<State>(pp_mesh)) {
  if (!module) throw ArgumentError("module", "PipelineStage: 'module' is null");
  if (!forward) throw ArgumentError("forward", "PipelineStage: 'forward' is empty");
  if (pp_mesh.ndim() != 1) {
    throw ArgumentError("pp_mesh", "PipelineStage: 'pp_mesh' has " +
                                       std::to_string(pp_mesh.ndim()) +
                                       " dims; accepted: the 1-D pipeline mesh (mesh[\"pp\"])");
  }
  const int pp = static_cast<int>(pp_mesh.size());
  if (num_stages < 1 || num_stages % pp != 0) {
    throw ArgumentError("num_stages", "PipelineStage: 'num_stages' = " +
                                          std::to_string(num_stages) +
                                          "; accepted: a positive multiple of the pp mesh size " +
                                          std::to_string(pp));
  }
  if (stage_index < 0 || stage_index >= num_stages) {
    throw ArgumentError("stage_index", "PipelineStage: 'stage_index' = " +
                                           std::to_string(stage_index) + "; accepted: 0.." +
                                           std::to_string(num_stages - 1));
  }
  const int here = pp_mesh.get_local_rank(0);
  if (stage_rank(stage_index, pp) != here) {
    throw ArgumentError("stage_index",
                        "PipelineStage: 'stage_index' = " + std::to_string(stage_index) +
                            " runs on pp rank " +
                            std::to_string(stage_rank(stage_index, pp)) +
                            " (stage % pp size), but this rank is pp rank " + std::to_string(here));
  }
  State& s = *state_;
  s.module = std::move(module);
  s.forward = std::move(forward);
  s.index = stage_index;
  s.num_stages = num_stages;
  s.options = std::move(options);
  std::unordered_set<const UnitState*> seen;
  for (const auto& m : s.module->modules(/*include_self=*/true)) {
    auto unit = detail::unit_for_module(*m);
    if (!unit || !seen.insert(unit.get()).second) continue;
    if (auto handle = fsdp_module_of(*m)) s.units.push_back(*handle);
  }
  for (auto& u : s.units) {
    if (!s.options.keep_reshard_after_forward) u.set_reshard_after_forward(false, false);
  }
  // The loss is already divided by the global count (see pipeline.h):
  // FSDP sums over the data-parallel ranks.
  for (auto& u : s.units) u.set_gradient_divide_factor(1.0);
}

void PipelineStage::State::begin_microbatches() {
  for (auto& u : units) {
    u.set_requires_gradient_sync(false, false);
    u.set_reshard_after_backward(false, false);
    u.set_is_last_backward(false);
  }
}

void PipelineStage::State::reduce_gradients() {
  for (auto& u : units) {
    u.set_requires_gradient_sync(true, false);
    u.set_reshard_after_backward(true, false);
    u.set_is_last_backward(true);
  }
  for (auto& u : units) u.reduce_gradients(/*recurse=*/false);
}

void PipelineStage::State::unshard_async() {
  for (auto& u : units) u.unshard(/*async_op=*/true);
}

int PipelineStage::stage_index() const { return state_->index; }
int PipelineStage::num_stages() const { return state_->num_stages; }
bool PipelineStage::is_first() const { return state_->index == 0; }
bool PipelineStage::is_last() const { return state_->index == state_->num_stages - 1; }
const std::shared_ptr<torch::nn::Module>& PipelineStage::module() const { return state_->module; }
const DeviceMesh& PipelineStage::pp_mesh() const { return state_->pp_mesh; }

}  // namespace fsdp::pp
