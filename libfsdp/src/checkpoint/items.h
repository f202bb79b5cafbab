// A State seen as tensors: every parameter, buffer, optimizer state tensor
// and value becomes an Item -- a named global tensor, this rank's pieces of
// it, and how to put loaded values back. Saving and loading work on Items
// only, so every kind of entry reshards by one rule.
#pragma once

#include "fsdp/distributed_checkpoint.h"

#include "checkpoint/index.h"
#include "checkpoint/layout.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdp::dcp::detail {

struct Item {
  std::string name;
  std::string kind;  // "param", "buffer", "optim", "tensor", "rank_local"
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;      // global
  at::Tensor local;                // this rank's piece (any device)
  std::vector<LocalBox> boxes;     // where local sits in the global tensor
  std::string layout;              // for people: "Shard(0) on (2, 2)", "whole"
  // Load: receives a CPU tensor of local's shape and dtype holding every
  // box; unset where the item is only saved.
  std::function<void(const at::Tensor&)> install;
};

// The items of `state` on this rank, sorted by name. Refuses (StateError)
// a unit holding full parameters: its shard may differ from what the
// module computes with.
std::vector<Item> items_for_save(const State& state);

// The items load fills on this rank, sorted by name: the state's module
// tensors and DTensors; each optimizer's state fields the checkpoint has
// (all of a parameter's required fields or none: CheckpointError naming the
// missing one); every tensor value of the checkpoint (set into the state),
// and with `same_world` this rank's rank-local tensors.
std::vector<Item> items_for_load(State& state, const Index& index, const std::string& shown_as,
                                 int rank, bool same_world);
// Every parameter and buffer of `module` (recursively) as an Item named by
// its module name, laid out as save and load lay it out (fully_shard's
// shards, TP/EP DTensors, whole plain tensors); install writes in place.
std::vector<Item> module_items(torch::nn::Module& module);

// Drops the per-parameter state of every optimizer of `state` (load then
// installs the checkpoint's).
void clear_optimizer_state(State& state);

// The type name of a supported optimizer (ArgumentError naming "optimizer"
// otherwise) and its param groups. options.
std::string optimizer_type(const torch::optim::Optimizer& opt);
nlohmann::json optimizer_groups(const torch::optim::Optimizer& opt);

// Checks a name against the rules in distributed_checkpoint.h.
void check_name(const std::string& name, const char* argument);
// "__rank<r>/<name>": the stored name of a rank-local tensor.
std::string rank_local_name(int rank, const std::string& name);

}  // namespace fsdp::dcp::detail
