// The unit registry: every unit fully_shard created, by module, and the
// generation of the unit set.
#include "sharding/registry.h"

#include "fsdp/errors.h"
#include "sharding/state.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <unordered_map>

namespace fsdp::detail {
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

}  // namespace

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

std::shared_ptr<UnitState> unit_by_id(int64_t id) {
  for (auto& u : registry().units) {
    if (u->id == id) return u;
  }
  throw StateError("fully_shard: unit " + std::to_string(id) + " no longer exists");
}

uint64_t unit_set_generation() { return registry().generation; }

}  // namespace fsdp::detail
