// Per-process collective counters. Each collective issued through a
// ProcessGroup is counted at issue time, by op name ("all_gather",
// "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send", "recv",
// "barrier") and group name. Tests read them to prove how many collectives a
// step issued.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fsdp {

// One issued collective, as CollectiveCounters::sequence lists it.
struct CollectiveRecord {
  std::string op;
  std::string group;
  int64_t bytes = 0;  // payload bytes of this rank's input
};

struct CollectiveCounters {
  // (op, group) -> count
  std::map<std::pair<std::string, std::string>, int64_t> count;
  // (op, group) -> payload bytes
  std::map<std::pair<std::string, std::string>, int64_t> bytes;
  // Issue order since the last reset (capped at 100000 records).
  std::vector<CollectiveRecord> sequence;

  // Where the bytes went, counted when a collective runs (on its comm
  // thread for CPU tensors, at issue for NCCL), before its Work completes.
  // (op, group, algorithm) -> runs. algorithm: what actually ran for CPU
  // tensors ("mpi", "ring", "pairwise", "shm"; a shm run that fell back to
  // pairwise for a full arena still counts as "shm"), "nccl" for CUDA
  // tensors; "p2p" for send/recv/all_to_all, "mpi" for broadcast/barrier.
  std::map<std::tuple<std::string, std::string, std::string>, int64_t> algorithm_count;
  // (op, group) -> bytes THIS rank sent to ranks on other nodes
  // (Runtime::node_of). Exact for libfsdp's own algorithms (pairwise: its
  // block to each remote peer; ring: a block per step to its right neighbour
  // when that one is remote; shm: 0, it runs inside one node) and for
  // point-to-point and all_to_all. Modelled where libfsdp cannot see the
  // schedule: Open MPI's collectives as the pairwise exchange, broadcast as
  // the root sending to every remote rank, NCCL as a ring in group-rank order.
  std::map<std::pair<std::string, std::string>, int64_t> cross_node_bytes;
  // (op, group) -> the part of cross_node_bytes that is modelled.
  std::map<std::pair<std::string, std::string>, int64_t> modelled_cross_node_bytes;

  // Total of one op over all groups (or one group if group is non-empty).
  int64_t total(const std::string& op, const std::string& group = "") const;
  // Cross-node bytes of one op ("" = every op) over all groups (or one group).
  int64_t total_cross_node_bytes(const std::string& op = "", const std::string& group = "") const;
  // Runs of `algorithm` for one op ("" = every op) on one group ("" = every group).
  int64_t runs(const std::string& algorithm, const std::string& op = "",
               const std::string& group = "") const;
};

CollectiveCounters collective_counters();
void reset_collective_counters();

}  // namespace fsdp
