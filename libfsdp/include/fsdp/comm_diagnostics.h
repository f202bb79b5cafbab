// Communication diagnostics: a per-group summary of what the collective
// counters saw (fsdp/collective_counters.h), and the collectives still in
// flight.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

// One entry per process group libfsdp has created on this rank (a group and
// its side communicators -- fully_shard's reduction group, a checkpoint's --
// share the name and are merged), with what the counters saw since their
// last reset.
struct GroupSummary {
  std::string name;              // "ranks[0,1]"
  std::vector<int> world_ranks;  // members, in group-rank order
  int num_nodes = 1;             // nodes the members sit on
  int communicators = 1;         // this group's communicators (group + side groups)
  bool has_shared_memory = false;       // any of them has a shared-memory arena
  int64_t shared_memory_committed = 0;  // bytes of this rank's segments now
  // (op, algorithm) -> runs, from CollectiveCounters::algorithm_count.
  std::map<std::pair<std::string, std::string>, int64_t> algorithms;
  int64_t cross_node_bytes = 0;           // this rank, every op
  int64_t modelled_cross_node_bytes = 0;  // the modelled part of it
};
// Sorted by name. Empty without a live Runtime. Never communicates.
std::vector<GroupSummary> group_summaries();
// group_summaries() as text, one line per group:
//   "ranks[0,1]: 1 node, shm arena 4.0 MiB; all_gather shm x12, reduce_scatter
//    pairwise x3; cross-node 0 B"
// (cross-node bytes marked "(modelled N B)" where part is modelled).
std::string describe_groups();

// One line per collective issued on this process that has not completed yet
// ("all_gather on ranks[0,1] #12 (mpi), 4096 B, issued by FSDP unit 'layers.0',
// 3.2 s in flight"), or "none". The library's watchdog (fsdp/runtime.h) and
// the test harness's print it when they abort a stuck job.
std::string describe_pending_collectives();

}  // namespace fsdp
