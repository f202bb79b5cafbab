// Internal: ReshardAfterForward's integer forms (hpZ) resolved into each
// parameter group's post-forward group (post_forward.cpp).
#pragma once

#include "fsdp/comm.h"
#include "fsdp/options.h"
#include "sharding/param_group.h"

#include <string>
#include <vector>

namespace fsdp::detail {

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

// Installs the resolved counts on the groups, creating each post-forward
// group (collective over the shard group's members the first time).
void install_post_forward_groups(std::vector<ParamGroup>& groups, const std::vector<int>& ranks);

}  // namespace fsdp::detail
