// Internal: libfsdp's own CPU collective algorithms over MPI point-to-point
// (cpu_algorithms.h) and the choice among them (cpu_algorithm_choice.cpp);
// the MPI backend runs them on its comm thread, see mpi_backend.cpp.
//
//   Pairwise  step s = 1..N-1 exchanges with ranks r+s and r-s at once (all
//             peers' messages are posted together). Reduce-scatter sums each
//             element over ranks 0, 1, ..., N-1 in that order, whichever
//             rank owns it, in chunks of kChunkBytes per peer so the received
//             data is still in cache when it is added. All-gather receives
//             straight into the output.
//   Ring      N-1 steps with the neighbours r+1 and r-1 only. Reduce-scatter
//             passes partial sums (in the accumulation type: float32 for
//             16-bit) around the ring; block b is summed in the order
//             b+1, b+2, ..., b (mod N).
//   Shm       through the group's shared-memory arena (shared_arena.h): each
//             rank publishes its operand there (copying it in unless it
//             already lives there) and every rank reads its peers' in
//             place. Reduce-scatter is one fold over the N inputs of this
//             rank's block, in rank order 0..N-1 as Pairwise: the same bits.
//             All-gather copies each peer's block out of its segment.
//   TwoLevel  a group whose ranks span M nodes with the same n >= 2 on each
//             (TwoLevel::create): an all-gather first gathers this rank's
//             block from the rank of the same local index on every node
//             (the "rail", pairwise over MPI: (M-1) blocks leave the node,
//             the minimum), then exchanges those M-block bundles inside
//             the node through the node's arena. A reduce-scatter first
//             sums, inside the node (arena), the blocks that rank j of
//             every node owns, on local rank j, then reduce-scatters those
//             node partials over the rail. Order of block r: the ranks of
//             each node in group-rank order, then the node partials in node
//             order (nodes ordered by their lowest group rank); 16-bit types
//             carry float32 partials between nodes and round once.
//   All-reduce is reduce-scatter (uneven blocks: numel / N, the first
//   numel % N one longer) followed by all-gather, in the tensor itself, so
//   every rank ends with the same bits.
//
// Same inputs, same rank count, same algorithm: bitwise the same result.
#pragma once

#include "fsdp/cpu_collectives.h"
#include "fsdp/reduce_op.h"
#include "comm/shared_arena.h"

#include <mpi.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace fsdp::detail::cpu {

struct TwoLevel;

enum class Collective { AllGather, ReduceScatter, AllReduce };

// Where the algorithms talk: a communicator of their own (no user
// point-to-point shares its tags), this rank and the size.
struct Peers {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  // Wait by testing with short sleeps instead of inside MPI_Waitall (which
  // spins on a core); see make_mpi_backend.
  bool poll = false;
  // The group's shared-memory arena; null where its ranks span nodes or
  // /dev/shm is unusable (the same on every rank).
  SharedArena* arena = nullptr;
  // The group's layout over nodes for TwoLevel; null where the group is on
  // one node, has one rank per node or nodes with different rank counts
  // (the same on every rank).
  const TwoLevel* two_level = nullptr;
};

// A group's ranks laid out as M nodes x n ranks (TwoLevel). The group's
// rank order need not be node-major: rank_of maps (node, local index) to
// the group rank.
struct TwoLevel {
  int nodes = 1;     // M >= 2
  int per_node = 1;  // n >= 2
  int node = 0;      // this rank's node: nodes ordered by their lowest group rank
  int local = 0;     // this rank's index on its node, in group-rank order
  // Group rank of local index j on node m at m * per_node + j.
  std::vector<int> rank_of;
  // The group's ranks on this node (rank = local index), with their own
  // shared-memory arena (null where /dev/shm is unusable or
  // FSDP_SHM_BYTES=0: the node step then runs over MPI, in the same order).
  Peers node_peers;
  // The group's ranks of this local index, one per node (rank = node).
  Peers rail;
  std::shared_ptr<SharedArena> node_arena;

  // Collective over `comm` (group creation). Null on every rank unless the
  // ranks span 2 or more nodes with the same count, 2 or more, on each.
  // poll as Peers::poll.
  static std::unique_ptr<TwoLevel> create(MPI_Comm comm, bool poll);
  ~TwoLevel();
  TwoLevel() = default;
  TwoLevel(const TwoLevel&) = delete;
  TwoLevel& operator=(const TwoLevel&) = delete;
};

// The bytes this rank sends to other nodes in one TwoLevel collective `op`
// of `dtype` (numel: all-gather input, reduce-scatter output, all-reduce
// tensor): the rail messages only, since the node step stays on the node.
// All-gather (M-1) * block; reduce-scatter (M-1) * block in the
// accumulation type (float32 partials for 16-bit types); all-reduce both,
// on its uneven blocks. The one place cross-node counters take it from.
int64_t two_level_cross_node_bytes(const TwoLevel& tl, Collective op, c10::ScalarType dtype,
                                   int64_t numel);


// Every threshold field of `s` with its name: validation, the ranks'
// agreement check and FSDP_MPI_ALGO_MIN_BYTES go through this list.
std::vector<std::pair<const char*, int64_t*>> thresholds(CpuCollectives& s);

// What runs: `shared` when every rank's operand (all-gather input,
// reduce-scatter input) lies in the group's arena, `plain` otherwise. They
// differ only under Auto on a group with an arena, where `shared` is Shm:
// then *_if_shared() tries that first.
struct Choice {
  CpuAlgorithm plain = CpuAlgorithm::Mpi;
  CpuAlgorithm shared = CpuAlgorithm::Mpi;
};

// The algorithms `op` on `dtype` with `block_bytes` per peer runs under the
// current settings (set_cpu_collectives): Mpi, Ring, Pairwise, Shm or
// TwoLevel, never Auto; Mpi on one rank; Pairwise for Shm where the group
// has no arena and for TwoLevel where it has no two-level layout
// (has_two_level: Peers::two_level is set).
Choice choose(Collective op, c10::ScalarType dtype, int64_t block_bytes, int size,
              bool has_arena, bool has_two_level = false);

// Shm on operands every rank already has in its arena (p.arena non-null),
// the barrier that publishes them telling whether they do: false on every
// rank, having done nothing else, when some rank's operand is elsewhere.
bool all_gather_if_shared(const Peers& p, const at::Tensor& out, const at::Tensor& in);
bool reduce_scatter_if_shared(const Peers& p, const at::Tensor& out, const at::Tensor& in,
                              ReduceOp op);

// Waits for n requests: inside MPI_Waitall, or with poll by MPI_Testall with
// a short spin and then sleeps doubling from 8 us to 128 us (each test also
// progresses the transfers). CommError on an MPI error.
void wait_requests(MPI_Request* requests, int n, bool poll, const char* what);

// out = concatenation of every rank's in. algorithm: Ring, Pairwise, Shm or
// TwoLevel (p.two_level set).
void all_gather(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                const at::Tensor& in);
// out = this rank's block of the elementwise SUM or MAX of every rank's in.
void reduce_scatter(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                    const at::Tensor& in, ReduceOp op);
// t = elementwise SUM or MAX of every rank's t.
void all_reduce(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& t, ReduceOp op);

}  // namespace fsdp::detail::cpu
