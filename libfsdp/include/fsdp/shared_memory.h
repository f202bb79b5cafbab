// Shared-memory accounting: the arenas through which the CPU collectives of
// a group on one node run (ProcessGroup::has_shared_memory and
// empty_for_collectives in fsdp/process_group.h).
#pragma once

#include <cstdint>

namespace fsdp {

// The shared memory of this process's collective arenas (every group's), in
// bytes. committed: backing the arenas now (freed blocks stay for reuse until
// the group ends); in_use: in live tensors and in-flight collectives;
// peak_in_use: the most in use at once since the last reset.
struct SharedMemoryStats {
  int64_t committed = 0;
  int64_t in_use = 0;
  int64_t peak_in_use = 0;
};
SharedMemoryStats shared_memory_stats();
void reset_shared_memory_peak();
// Called with +bytes on every arena allocation and -bytes on every free, on
// the thread that makes it, for memory accounting that counts LibTorch's
// allocator too (fsdp-bench train). Null (the default): none.
void set_shared_memory_observer(void (*observer)(int64_t delta_bytes));

}  // namespace fsdp
