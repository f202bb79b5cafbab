// WorkInfo and PendingWork: what one issued collective or point-to-point is
// (header-only; TaskWork in comm_thread.h and the backends' Works implement it).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

// What one issued collective or point-to-point is: the fields counters,
// traces and watchdogs read (never parsed back out of a text).
struct WorkInfo {
  std::string op;       // "all_gather", "reduce_scatter", "all_reduce", "send", ...
  std::string group;    // the group's name, "ranks[0,1]"
  uint64_t seq = 0;     // issue number on this group and backend, from 1
  int64_t bytes = 0;    // payload bytes (the input's; the tensor's for in-place ops)
  std::string backend;  // "mpi" or "nccl"
  std::string label;    // the caller's words for it (P2POp::label), may be empty
  int64_t unit = -1;    // the FSDP unit whose hook issued it (trace ids), -1: none
  // "all_gather on ranks[0,1] #12 (mpi)", "send on ranks[0,1] #3 (mpi) [pp ...]"
  std::string describe() const {
    return op + " on " + group + " #" + std::to_string(seq) + " (" + backend + ")" +
           (label.empty() ? "" : " [" + label + "]");
  }
};

// An issued collective as the pending-collective registry sees it (see
// register_pending).
class PendingWork {
 public:
  virtual ~PendingWork() = default;
  virtual const WorkInfo& info() const = 0;
  // Work that completes unseen by the host (on a device stream, or an MPI
  // request nobody has tested yet) stays registered for its handle's
  // lifetime; the registry lists it only while this is false. Called with the
  // registry's lock held: must not block or unregister.
  virtual bool finished() const { return false; }
};

}  // namespace fsdp::detail
