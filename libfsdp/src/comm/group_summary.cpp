// fsdp::group_summaries / describe_groups (fsdp/comm_diagnostics.h): the
// registry's groups joined with the collective counters.
#include "fsdp/comm_diagnostics.h"

#include "fsdp/collective_counters.h"
#include "fsdp/process_group.h"
#include "comm/group_registry.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace fsdp {
namespace {

std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
}

}  // namespace

std::vector<GroupSummary> group_summaries() {
  std::vector<ProcessGroupPtr> groups;
  try {
    groups = detail::all_groups();
  } catch (...) {
    return {};
  }
  std::map<std::string, GroupSummary> by_name;
  for (const auto& g : groups) {
    auto [it, fresh] = by_name.try_emplace(g->name());
    GroupSummary& s = it->second;
    if (fresh) {
      s.name = g->name();
      s.world_ranks = g->world_ranks();
      s.num_nodes = g->num_nodes();
      s.communicators = 0;
    }
    s.communicators += 1;
    s.has_shared_memory = s.has_shared_memory || g->has_shared_memory();
    s.shared_memory_committed += g->shared_memory_committed();
  }
  const CollectiveCounters c = collective_counters();
  for (const auto& [key, runs] : c.algorithm_count) {
    const auto& [op, group, algorithm] = key;
    auto it = by_name.find(group);
    if (it != by_name.end()) it->second.algorithms[{op, algorithm}] += runs;
  }
  for (const auto& [key, bytes] : c.cross_node_bytes) {
    auto it = by_name.find(key.second);
    if (it != by_name.end()) it->second.cross_node_bytes += bytes;
  }
  for (const auto& [key, bytes] : c.modelled_cross_node_bytes) {
    auto it = by_name.find(key.second);
    if (it != by_name.end()) it->second.modelled_cross_node_bytes += bytes;
  }
  std::vector<GroupSummary> out;
  for (auto& [name, s] : by_name) out.push_back(std::move(s));
  return out;
}

std::string describe_groups() {
  std::ostringstream os;
  for (const GroupSummary& s : group_summaries()) {
    os << s.name << ": " << s.num_nodes << (s.num_nodes == 1 ? " node" : " nodes");
    if (s.has_shared_memory) {
      os << ", shm arena " << human_bytes(s.shared_memory_committed);
    } else {
      os << ", no shm arena";
    }
    os << ";";
    if (s.algorithms.empty()) os << " no collectives";
    bool first = true;
    for (const auto& [key, runs] : s.algorithms) {
      os << (first ? " " : ", ") << key.first << " " << key.second << " x" << runs;
      first = false;
    }
    os << "; cross-node " << human_bytes(s.cross_node_bytes);
    if (s.modelled_cross_node_bytes > 0) {
      os << " (modelled " << human_bytes(s.modelled_cross_node_bytes) << ")";
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace fsdp
