// The pending-collective registry: every issued collective until it
// completes, for diagnostics and the watchdog (counters.cpp).
#pragma once

#include "comm/work.h"

#include <string>
#include <vector>

namespace fsdp::detail {

void register_pending(const PendingWork* w);
void unregister_pending(const PendingWork* w);
struct PendingEntry {
  WorkInfo info;
  double seconds = 0;  // since it was issued
};
// The unfinished ones, longest in flight first.
std::vector<PendingEntry> pending_snapshot();
// "all_gather on ranks[0,1] #12 (mpi), 4096 B, issued by FSDP unit 3 'layers.0', 3.2 s in flight"
std::string describe_pending(const PendingEntry& e);

}  // namespace fsdp::detail
