// Group registry: every communicator libfsdp creates, keyed by member list.
//
// Communicators come from MPI_Comm_split of a private duplicate of
// MPI_COMM_WORLD. The split is always performed (it is collective, and ranks
// may differ in what they have cached); a cached group with the same members
// wins and the fresh communicator is freed.
#include "comm/group_registry.h"

#include "fsdp/errors.h"
#include "comm/mpi_types.h"
#include "comm/process_group.h"

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace fsdp::detail {
namespace {

struct Registry {
  std::mutex mu;
  MPI_Comm world = MPI_COMM_NULL;
  std::map<std::vector<int>, std::shared_ptr<ProcessGroupImpl>> groups;
  // Second communicators over a group's ranks, by purpose and members.
  std::map<std::pair<SideGroup, std::vector<int>>, std::shared_ptr<ProcessGroupImpl>> side_groups;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void init_group_registry() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &r.world), "MPI_Comm_dup");
  // Errors come back as return codes (check_mpi throws CommError) on every
  // communicator split or duplicated from this one, not MPI's default abort;
  // the user's MPI_COMM_WORLD keeps its own handler.
  check_mpi(MPI_Comm_set_errhandler(r.world, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
}

void shutdown_group_registry() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& [key, group] : r.side_groups) group->shutdown();
  r.side_groups.clear();
  for (auto& [members, group] : r.groups) group->shutdown();
  r.groups.clear();
  if (r.world != MPI_COMM_NULL) MPI_Comm_free(&r.world);
}

MPI_Comm library_world() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.world == MPI_COMM_NULL) throw StateError("libfsdp needs a live fsdp::Runtime");
  return r.world;
}

namespace {
// "ranks[0,2]": a group's name is its member list.
std::string group_name(const std::vector<int>& members) {
  std::string name = "ranks[";
  for (size_t i = 0; i < members.size(); ++i) name += (i ? "," : "") + std::to_string(members[i]);
  return name + "]";
}
}  // namespace

ProcessGroupPtr group_for(const std::vector<int>& members) {
  const std::string name = group_name(members);
  MPI_Comm world = library_world();
  int me = 0;
  check_mpi(MPI_Comm_rank(world, &me), "MPI_Comm_rank");
  auto pos = std::find(members.begin(), members.end(), me);
  if (pos == members.end()) {
    throw StateError("group_for: rank " + std::to_string(me) + " is not a member of " + name);
  }
  // Groups of one partition are disjoint, so the smallest member names one.
  const int color = *std::min_element(members.begin(), members.end());
  const int key = static_cast<int>(pos - members.begin());
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(world, color, key, &comm), "MPI_Comm_split");

  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.groups.find(members);
  if (it != r.groups.end()) {
    MPI_Comm_free(&comm);
    return it->second;
  }
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (size != static_cast<int>(members.size())) {
    MPI_Comm_free(&comm);
    throw StateError("group_for: ranks disagree about the members of " + name +
                     " (every rank must build the same meshes in the same order)");
  }
  auto group = std::make_shared<ProcessGroupImpl>(comm, members, name);
  r.groups.emplace(members, group);
  return group;
}

namespace {
// MPI_Comm_split/_dup block until every member arrives, and no watchdog sees
// them: a member that stalled before the call (or never makes it) would leave
// the others hanging silently. A watched collective over the same members
// first turns that into a report naming the group and an abort (FSDP_TIMEOUT,
// docs/architecture.md#watchdog); once it completes, every member is at the split.
void wait_for_every_member(const ProcessGroupPtr& group) {
  at::Tensor arrived = at::zeros({1}, at::kLong);
  group->all_reduce(arrived)->wait();
}
}  // namespace

ProcessGroupPtr side_group_for(const ProcessGroupPtr& group, SideGroup purpose) {
  auto* impl = dynamic_cast<ProcessGroupImpl*>(group.get());
  if (impl == nullptr) throw StateError("side_group_for: not a libfsdp process group");
  Registry& r = registry();
  const auto key = std::make_pair(purpose, group->world_ranks());
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.side_groups.find(key);
    if (it != r.side_groups.end()) return it->second;
  }
  // Every member reaches this point for the same group and purpose in the
  // same order (its callers are SPMD), and no member has it cached unless
  // all have. fully_shard creates its reduction groups where every rank is
  // (inside fully_shard, past its own collectives); a checkpoint group is
  // created by the first save, which a stalled rank may never reach.
  if (purpose == SideGroup::Checkpoint) wait_for_every_member(group);
  MPI_Comm comm = impl->duplicate_communicator();
  // Its thread waits by polling: a second comm thread spinning inside MPI
  // beside the all-gathers' would take the compute threads' cores.
  auto dup = std::make_shared<ProcessGroupImpl>(comm, group->world_ranks(), group->name(),
                                                /*poll=*/true);
  std::lock_guard<std::mutex> lock(r.mu);
  r.side_groups.emplace(key, dup);
  return dup;
}

ProcessGroupPtr subgroup_for(const ProcessGroupPtr& group, int size) {
  auto* impl = dynamic_cast<ProcessGroupImpl*>(group.get());
  if (impl == nullptr) throw StateError("subgroup_for: not a libfsdp process group");
  if (size < 1 || group->size() % size != 0) {
    throw StateError("subgroup_for: " + std::to_string(size) + " does not divide the size of " +
                     group->name());
  }
  const int k = group->rank() / size;
  const auto& all = group->world_ranks();
  std::vector<int> members(all.begin() + k * size, all.begin() + (k + 1) * size);
  // Split even when cached, as group_for does: every member calls this
  // together, and a member that skipped the split would leave the others in it.
  // set_reshard_after_forward reaches this between steps, where a rank may stall.
  wait_for_every_member(group);
  MPI_Comm comm = impl->split_communicator(k, group->rank() % size);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.groups.find(members);
  if (it != r.groups.end()) {
    MPI_Comm_free(&comm);
    return it->second;
  }
  auto sub = std::make_shared<ProcessGroupImpl>(comm, members, group_name(members));
  r.groups.emplace(members, sub);
  return sub;
}

std::vector<int> members_on_this_node(const ProcessGroupPtr& group) {
  auto* impl = dynamic_cast<ProcessGroupImpl*>(group.get());
  if (impl == nullptr) throw StateError("members_on_this_node: not a libfsdp process group");
  wait_for_every_member(group);
  MPI_Comm node = impl->split_communicator(-1, 0);
  int n = 0;
  check_mpi(MPI_Comm_size(node, &n), "MPI_Comm_size");
  std::vector<int> positions(static_cast<size_t>(n));
  const int me = group->rank();
  check_mpi(MPI_Allgather(&me, 1, MPI_INT, positions.data(), 1, MPI_INT, node), "MPI_Allgather");
  MPI_Comm_free(&node);
  std::sort(positions.begin(), positions.end());
  return positions;
}

ProcessGroupPtr reduction_group_for(const ProcessGroupPtr& group) {
  return side_group_for(group, SideGroup::Reduction);
}

std::vector<ProcessGroupPtr> all_groups() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<ProcessGroupPtr> out;
  for (const auto& [members, group] : r.groups) out.push_back(group);
  for (const auto& [key, group] : r.side_groups) out.push_back(group);
  return out;
}

ProcessGroupPtr find_group(const std::vector<int>& members) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.groups.find(members);
  if (it == r.groups.end()) throw StateError("libfsdp needs a live fsdp::Runtime");
  return it->second;
}

}  // namespace fsdp::detail
