// Node topology and cross-node byte models (topology.h).
#include "comm/topology.h"

#include "comm/mpi_types.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <utility>

namespace fsdp::detail {
namespace {

std::vector<int>& map_storage() {
  static std::vector<int> m;
  return m;
}

// Element counts of an all-reduce's blocks, as cpu::split_blocks splits them.
int64_t split_count(int64_t numel, int n, int i) { return numel / n + (i < numel % n ? 1 : 0); }

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

// Written once before any group exists and cleared after the last one is
// gone (Runtime start and end), so readers need no lock.
void set_node_map(std::vector<int> node_of) { map_storage() = std::move(node_of); }

const std::vector<int>& node_map() { return map_storage(); }

std::vector<int> nodes_of_comm(MPI_Comm comm) {
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  std::vector<int> nodes(static_cast<size_t>(size), 0);
  const auto& map = node_map();
  if (map.empty()) return nodes;
  MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  check_mpi(MPI_Comm_group(comm, &mine), "MPI_Comm_group");
  check_mpi(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group");
  std::vector<int> ranks(static_cast<size_t>(size)), in_world(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  const int rc = MPI_Group_translate_ranks(mine, size, ranks.data(), world, in_world.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
  check_mpi(rc, "MPI_Group_translate_ranks");
  for (int i = 0; i < size; ++i) {
    const int w = in_world[static_cast<size_t>(i)];
    if (w >= 0 && w < static_cast<int>(map.size())) {
      nodes[static_cast<size_t>(i)] = map[static_cast<size_t>(w)];
    }
  }
  return nodes;
}

int count_nodes(const std::vector<int>& world_ranks) {
  const auto& map = node_map();
  if (map.empty() || world_ranks.empty()) return 1;
  std::set<int> seen;
  for (int w : world_ranks) {
    if (w >= 0 && w < static_cast<int>(map.size())) seen.insert(map[static_cast<size_t>(w)]);
  }
  return std::max<int>(1, static_cast<int>(seen.size()));
}

int64_t CrossNodeModel::to_peers(const std::vector<int64_t>& bytes_to) const {
  int64_t total = 0;
  for (int p = 0; p < size() && p < static_cast<int>(bytes_to.size()); ++p) {
    if (p != rank && remote(p)) total += bytes_to[static_cast<size_t>(p)];
  }
  return total;
}

int64_t CrossNodeModel::pairwise_all_gather(int64_t block, int64_t es) const {
  return to_peers(std::vector<int64_t>(static_cast<size_t>(size()), block * es));
}

int64_t CrossNodeModel::pairwise_reduce_scatter(int64_t block, int64_t es) const {
  return to_peers(std::vector<int64_t>(static_cast<size_t>(size()), block * es));
}

int64_t CrossNodeModel::pairwise_all_reduce(int64_t numel, int64_t es) const {
  const int n = size();
  std::vector<int64_t> to(static_cast<size_t>(n));
  // Reduce-scatter: peer j's block to j; all-gather: this rank's block to each.
  for (int j = 0; j < n; ++j) {
    to[static_cast<size_t>(j)] = (split_count(numel, n, j) + split_count(numel, n, rank)) * es;
  }
  return to_peers(to);
}

int64_t CrossNodeModel::ring_all_gather(int64_t block, int64_t es) const {
  const int n = size();
  if (n < 2 || !remote(mod(rank + 1, n))) return 0;
  return static_cast<int64_t>(n - 1) * block * es;
}

int64_t CrossNodeModel::ring_reduce_scatter(int64_t block, int64_t acc_es) const {
  return ring_all_gather(block, acc_es);
}

int64_t CrossNodeModel::ring_all_reduce(int64_t numel, int64_t es, int64_t acc_es) const {
  const int n = size();
  if (n < 2 || !remote(mod(rank + 1, n))) return 0;
  int64_t total = 0;
  // Step s sends partial sums of block rank-s-1 (accumulation type), then
  // the reduced block rank-s (ring_reduce / ring_gather in cpu_point_to_point.cpp).
  for (int s = 0; s + 1 < n; ++s) {
    total += split_count(numel, n, mod(rank - s - 1, n)) * acc_es;
    total += split_count(numel, n, mod(rank - s, n)) * es;
  }
  return total;
}

}  // namespace fsdp::detail
