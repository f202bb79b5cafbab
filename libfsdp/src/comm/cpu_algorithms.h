// Internal to the CPU collectives (cpu_collectives.h): each algorithm on raw
// buffers -- pairwise and ring over MPI point-to-point
// (cpu_point_to_point.cpp), shm through the group's arena (cpu_shm.cpp),
// two_level across nodes (cpu_two_level.cpp) -- and what they share: the
// blocks of elements per rank, a round of MPI requests, a block of an arena.
// cpu_collectives.cpp chooses among them per call.
// The rule: docs/architecture.md#reduction-order.
#pragma once

#include "comm/cpu_collectives.h"
#include "comm/cpu_reduce.h"
#include "comm/mpi_types.h"
#include "comm/shared_arena.h"

#include <mpi.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fsdp::detail::cpu {

// One tag: the communicator is the algorithms' own, its collectives run one
// at a time (the backend's comm thread), and MPI does not reorder messages
// between a pair on one tag.
constexpr int kTag = 17;
// Elements of one fold pass: the partial sums stay in cache while every
// rank's input streams through.
constexpr int64_t kFoldChunk = 16 * 1024;

// Elements per rank and where they start.
struct Blocks {
  std::vector<int64_t> count, displ;
  int64_t max_count() const { return *std::max_element(count.begin(), count.end()); }
};

// `block` elements for each of n ranks (all-gather, reduce-scatter).
inline Blocks even_blocks(int64_t block, int n) {
  Blocks b;
  for (int i = 0; i < n; ++i) {
    b.count.push_back(block);
    b.displ.push_back(block * i);
  }
  return b;
}

// numel split over n ranks, the first numel % n one longer (all-reduce).
inline Blocks split_blocks(int64_t numel, int n) {
  Blocks b;
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t c = numel / n + (i < numel % n ? 1 : 0);
    b.count.push_back(c);
    b.displ.push_back(at);
    at += c;
  }
  return b;
}

inline int mod(int a, int n) { return ((a % n) + n) % n; }

inline Combine combine_of(ReduceOp op) {
  return op == ReduceOp::MAX ? Combine::Max : Combine::Sum;
}

// AVG divides in the accumulation type, before the one rounding.
inline double divisor_of(ReduceOp op, int n) { return op == ReduceOp::AVG ? n : 1; }

inline char* bytes(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// The requests of one exchange round; the buffers belong to the caller.
class Round {
 public:
  explicit Round(const Peers& p) : p_(p) {}
  void send(const void* buf, int64_t n, MPI_Datatype dt, int peer) {
    if (n == 0) return;
    reqs_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Isend(buf, static_cast<int>(n), dt, peer, kTag, p_.comm, &reqs_.back()),
              "MPI_Isend");
  }
  void recv(void* buf, int64_t n, MPI_Datatype dt, int peer) {
    if (n == 0) return;
    reqs_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Irecv(buf, static_cast<int>(n), dt, peer, kTag, p_.comm, &reqs_.back()),
              "MPI_Irecv");
  }
  void wait(const char* what) {
    wait_requests(reqs_.data(), static_cast<int>(reqs_.size()), p_.poll, what);
    reqs_.clear();
  }

 private:
  const Peers& p_;
  std::vector<MPI_Request> reqs_;
};

// This rank's block of an all-gather's output, holding `mine` (copied
// unless it is already there, as in all-reduce).
inline char* place_own_block(const Peers& p, int64_t es, char* out, const char* mine,
                             const Blocks& b) {
  char* own = out + b.displ[p.rank] * es;
  if (own != mine) std::memcpy(own, mine, static_cast<size_t>(b.count[p.rank] * es));
  return own;
}

// A block of this rank's segment, freed when it goes out of scope (after the
// collective's last barrier: no peer reads it any more).
class ArenaBlock {
 public:
  explicit ArenaBlock(SharedArena* arena) : arena_(arena) {}
  ~ArenaBlock() {
    if (offset_ >= 0) arena_->free(offset_);
  }
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;
  int64_t allocate(int64_t bytes) { return offset_ = arena_->allocate(bytes); }
  int64_t offset() const { return offset_; }

 private:
  SharedArena* arena_;
  int64_t offset_ = -1;
};

// Every rank's operand offset after a barrier; empty on every rank when some
// rank could not place its operand (all of them then fall back together).
std::vector<int64_t> exchange_offsets(const Peers& p, int64_t mine);

// ---- pairwise and ring (cpu_point_to_point.cpp) ----
void pairwise_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                     const Blocks& b);
void ring_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                 const Blocks& b);
// out (b.count[rank] elements) <- rank's block of the reduction of every
// rank's `in`. out may alias rank's block of `in` (all-reduce).
void pairwise_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                     const Blocks& b);
void ring_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                 const Blocks& b);

// ---- shm (cpu_shm.cpp) ----
// False (on every rank, after one barrier, having done nothing) when some
// rank's input is neither in its arena nor staged there: `may_stage` off,
// or its segment could not hold it.
bool shm_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                const Blocks& b, bool may_stage);
bool shm_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                const Blocks& b, bool may_stage);
bool shm_all_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* data,
                    const Blocks& b);

// ---- two_level (cpu_two_level.cpp): p.two_level set ----
void two_level_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                      const Blocks& b);
// out (b.count[rank] elements) <- the reduction of rank's block of every
// rank's `in`; out may alias rank's block of `in` (all-reduce).
void two_level_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                      const Blocks& b);

}  // namespace fsdp::detail::cpu
