// Internal: a shared-memory arena per process group whose ranks share one
// node, for the `shm` CPU collectives (cpu_collectives.h).
//
// Each rank owns one POSIX shared-memory segment and maps every peer's.
// A segment starts with this rank's control block (an epoch counter and two
// payload slots) and holds the operands the rank publishes: a peer reads
// them in place, so a reduce-scatter is one pass over every rank's input
// (no cross-process copy, no kernel call) and an all-gather one memcpy.
//
// Segments reserve address space for the node's memory (or FSDP_SHM_BYTES;
// 0 turns arenas off) at creation and grow on demand (fallocate: a full
// /dev/shm is an allocation failure, never a SIGBUS later). Names are unlinked as soon as every peer has mapped them, so
// nothing is left in /dev/shm when a job dies.
//
// Synchronisation: barrier(payload) publishes `payload` in the slot of the
// next epoch, bumps the epoch (release) and waits until every peer's epoch
// has reached it (acquire): spinning briefly, then yielding, then asleep on
// the peer's epoch as a futex, woken by the peer's arrival. Two slots
// alternate: a peer can be at most one epoch ahead, so the slot of the epoch
// a slow peer still reads is never overwritten.
#pragma once

#include <mpi.h>

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail::cpu {

// $FSDP_SHM_BYTES: -1 when unset, else the byte count (0: no arenas).
// ArgumentError naming it when it is not a whole number >= 0. The Runtime
// reads it at start-up and refuses values that differ across ranks: peers map
// each other's segments with their own reserve.
int64_t shm_bytes_setting();

class SharedArena {
 public:
  // Collective over `comm`. Null on every rank when the ranks do not all
  // share one node, when size is 1, or when any rank could not set up its
  // segment (the reason is in *why).
  static std::shared_ptr<SharedArena> create(MPI_Comm comm, std::string* why);
  ~SharedArena();
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(bases_.size()); }

  // `bytes` (64-byte aligned) in this rank's segment, or -1 when the segment
  // cannot grow that far. Thread-safe: tensors are freed on any thread.
  int64_t allocate(int64_t bytes);
  void free(int64_t offset);
  // Where this rank's (or a peer's) segment is mapped.
  char* base(int r) const { return bases_[static_cast<size_t>(r)]; }
  // The offset of [p, p + bytes) in this rank's segment, or -1 when it is
  // not wholly inside an allocation-capable region.
  int64_t offset_of(const void* p, int64_t bytes) const;

  // Publishes `payload` and waits until every rank has reached this
  // barrier; returns every rank's payload (index = rank). poll: sleep right
  // after the spin instead of yielding the core first (see Peers::poll).
  const std::vector<int64_t>& barrier(int64_t payload, bool poll);

  // Bytes backing this rank's segment now.
  int64_t committed_bytes() const;

 private:
  struct Control;
  SharedArena() = default;
  Control* control(int r) const;
  // Until peer control `c` reaches epoch e (see barrier).
  void wait_for(Control* c, uint32_t e, bool poll) const;
  bool grow_locked(int64_t to);

  int rank_ = 0;
  int fd_ = -1;
  int64_t reserve_ = 0;
  std::vector<char*> bases_;
  uint32_t epoch_ = 0;
  int spins_ = 0;  // before a waiter yields
  std::vector<int64_t> payloads_;

  mutable std::mutex mu_;
  int64_t committed_ = 0;  // file size of this rank's segment
  std::map<int64_t, int64_t> free_;  // offset -> bytes, coalesced
  std::map<int64_t, int64_t> used_;  // offset -> bytes

  friend at::Tensor empty_in_arena(const std::shared_ptr<SharedArena>&, at::IntArrayRef,
                                   const at::TensorOptions&);
  std::once_flag allocator_once_;
  c10::Allocator* allocator_ = nullptr;  // empty_in_arena's storages'
};

// ProcessGroup::empty_for_collectives on a group with `arena` (may be null):
// a tensor in this rank's segment whose storage allocates there again when
// resized (freed and regrown), else at::empty.
at::Tensor empty_in_arena(const std::shared_ptr<SharedArena>& arena, at::IntArrayRef sizes,
                          const at::TensorOptions& options);

}  // namespace fsdp::detail::cpu
