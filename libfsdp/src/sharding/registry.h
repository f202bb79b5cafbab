// Internal: the registry of live units -- which unit a module belongs to,
// which parameters are managed, and the generation that unit-set caches
// (roots, labels) are checked against. Step state lives in each root's
// context (sharding/root_pass.h), not here.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fsdp {
struct UnitState;
namespace detail {

std::shared_ptr<UnitState> unit_for_module(const torch::nn::Module& module);
std::vector<std::shared_ptr<UnitState>> live_units();
void register_unit(const std::shared_ptr<UnitState>& unit);
// Whether a live unit manages `param` (by TensorImpl). Tensor parallelism's
// dtensor_params() leaves such parameters out.
bool is_managed(const at::Tensor& param);
int64_t next_unit_id();
// The live unit with id `id`, or a StateError (an autograd node outlived it).
std::shared_ptr<UnitState> unit_by_id(int64_t id);
// Bumped whenever the set of units changes: roots and labels are cached per
// unit against it.
uint64_t unit_set_generation();

}  // namespace detail
}  // namespace fsdp
