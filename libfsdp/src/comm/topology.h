// Node topology of the world and the cross-node byte models of the
// collectives (topology.cpp).
//
// The Runtime computes, once at start-up, the node index of every world rank
// (MPI_Comm_split_type(SHARED) + an all-gather: nodes are numbered by their
// lowest world rank) and hands it to the comm layer here, below it; groups
// and backends read it to know which of their peers sit on another node.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail {

// node_of[world rank] = node index. Set by the Runtime before the first group
// is created; cleared (empty) when it ends.
void set_node_map(std::vector<int> node_of);
// The map set above (empty without a live Runtime).
const std::vector<int>& node_map();
// Node of each rank of `comm`, in comm-rank order: its world ranks (through
// MPI_COMM_WORLD's group) looked up in node_map(). Never communicates. All
// zeros when no map is set.
std::vector<int> nodes_of_comm(MPI_Comm comm);
// Distinct nodes among `world_ranks` (1 when no map is set or the list is empty).
int count_nodes(const std::vector<int>& world_ranks);

// Bytes this rank (`rank`, of nodes.size() ranks with those node indices)
// sends to ranks on other nodes in one collective, by algorithm. `es`:
// element size; `acc_es`: the accumulation type's (ring reductions pass
// partial sums in it: float32 for 16-bit types).
//   all-gather: `block` elements per rank; reduce-scatter: `block` output
//   elements per rank; all-reduce: `numel` elements split as the CPU
//   algorithms split them (numel / N, the first numel % N one longer), a
//   reduce-scatter then an all-gather.
struct CrossNodeModel {
  std::vector<int> nodes;  // node of each group rank
  int rank = 0;
  // Peers of `rank` on another node.
  bool remote(int peer) const {
    return nodes[static_cast<size_t>(peer)] != nodes[static_cast<size_t>(rank)];
  }
  int size() const { return static_cast<int>(nodes.size()); }

  // Pairwise: this rank's block to every peer.
  int64_t pairwise_all_gather(int64_t block, int64_t es) const;
  // Pairwise: peer j's block of the input to peer j.
  int64_t pairwise_reduce_scatter(int64_t block, int64_t es) const;
  int64_t pairwise_all_reduce(int64_t numel, int64_t es) const;
  // Ring: N-1 steps, each one block to the right neighbour (rank + 1).
  int64_t ring_all_gather(int64_t block, int64_t es) const;
  int64_t ring_reduce_scatter(int64_t block, int64_t acc_es) const;
  int64_t ring_all_reduce(int64_t numel, int64_t es, int64_t acc_es) const;
  // Exact for any algorithm: what this rank sends to each group rank.
  int64_t to_peers(const std::vector<int64_t>& bytes_to) const;
};

}  // namespace fsdp::detail
