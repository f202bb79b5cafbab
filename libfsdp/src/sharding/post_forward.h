// Internal: reshard_after_forward as a unit holds it -- the value given and,
// per parameter group, where its parameters stay after forward -- and the
// resolution of ReshardAfterForward's integer forms (hpZ) into post-forward
// groups (post_forward.cpp).
#pragma once

#include "fsdp/process_group.h"
#include "fsdp/options.h"

#include <string>
#include <vector>

namespace fsdp::detail {

// Where one parameter group's parameters stay after forward.
struct PostForwardTarget {
  // hpZ: sharded over these consecutive ranks of the shard group (a
  // subgroup_for); null: resharded over the whole shard group.
  ProcessGroupPtr group;
  // A count of 1: not resharded at all (FSDP2's int 1 == False).
  bool keep_full = false;
};

// A unit's reshard_after_forward, held here only and set only through
// UnitState::set_reshard_after_forward (by fully_shard and
// FSDPModule::set_reshard_after_forward).
struct ReshardAfterForwardSetting {
  // As given: its bool and unset forms decide whether the unit reshards.
  ReshardAfterForward value;
  // Per parameter group: where its parameters stay when it does.
  std::vector<PostForwardTarget> targets;
};

// Per shard group, how a unit reshards after forward under `v`: 0 = over
// the whole shard group (the bool and unset forms, or a count equal to the
// group's size), 1 = not at all (FSDP2's int 1 == False), P = over P
// consecutive ranks of the shard group. Validates before anything changes:
// ArgumentError naming "reshard_after_forward" (prefixed by `fn`) for a
// count that does not divide a shard group's size, a count < 1, an integer
// form with CPU offload, or within_node() where the shard group's ranks on a
// node are not consecutive or not equally many on every node. within_node()
// is collective over each shard group's members.
std::vector<int> resolve_post_forward_ranks(const std::vector<ProcessGroupPtr>& shard_groups,
                                            ReshardAfterForward v, bool offloads,
                                            const std::string& fn);

// The targets of resolved counts, creating each post-forward group
// (collective over the shard group's members the first time).
std::vector<PostForwardTarget> post_forward_targets(
    const std::vector<ProcessGroupPtr>& shard_groups, const std::vector<int>& ranks);

}  // namespace fsdp::detail
