// The group registry: every process group libfsdp creates, keyed by member
// list (group_registry.cpp).
#pragma once

#include "fsdp/process_group.h"

#include <mpi.h>

#include <vector>

namespace fsdp::detail {

// The library's private duplicate of MPI_COMM_WORLD.
MPI_Comm library_world();
// Collective over the world: every rank passes the member list of its own
// group; together the lists partition the world. Cached by member list; the
// group's name is its member list, e.g. "ranks[0,2]".
ProcessGroupPtr group_for(const std::vector<int>& members);
// A group created before (the world group exists from Runtime start); never
// communicates. StateError if absent.
ProcessGroupPtr find_group(const std::vector<int>& members);
// fully_shard's reductions run on a second group over the same ranks, with
// its own communicator and comm thread: reduce-scatters and all-reduces are
// then ordered among themselves (reverse forward order, the same on every
// rank) independently of the all-gathers, whose order follows the forward
// and the pre-backward hooks -- however the gradients of a rank arrive. It
// also lets a reduction run while the next all-gather does. Same name as
// `group` (counters and traces report them together). Cached; the first call
// is collective over the group's members.
ProcessGroupPtr reduction_group_for(const ProcessGroupPtr& group);
// What a second communicator over a group's ranks is for. Reduction: above.
// Checkpoint: distributed-checkpoint saves agree and publish on it from a
// background thread (an asynchronous save) while training's collectives run
// on the groups above.
enum class SideGroup { Reduction, Checkpoint };
// The second group of `purpose` over `group`'s ranks, with its own
// communicator and comm thread. Cached; the first call is collective over
// the group's members.
ProcessGroupPtr side_group_for(const ProcessGroupPtr& group, SideGroup purpose);
// The group of `size` consecutive members of `group` that holds this rank
// (members [k * size, (k + 1) * size) in group order). `size` must divide
// group->size(). Collective over the group's members; cached by member list
// (the same group as group_for's for the same members).
ProcessGroupPtr subgroup_for(const ProcessGroupPtr& group, int size);
// The positions (group ranks, ascending) of `group`'s members on this node.
// Collective over the group's members.
std::vector<int> members_on_this_node(const ProcessGroupPtr& group);
// Every group created so far, side groups included (group_summaries).
std::vector<ProcessGroupPtr> all_groups();
void init_group_registry();
void shutdown_group_registry();

}  // namespace fsdp::detail
