// Internal: libfsdp's own CPU collective algorithms over MPI point-to-point
// (cpu_collectives.cpp) and the choice among them (cpu_algorithm_choice.cpp);
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
//   All-reduce is reduce-scatter (uneven blocks: numel / N, the first
//   numel % N one longer) followed by all-gather, in the tensor itself, so
//   every rank ends with the same bits.
//
// Same inputs, same rank count, same algorithm: bitwise the same result.
#pragma once

#include "fsdp/comm.h"
#include "comm/shared_arena.h"

#include <mpi.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace fsdp::detail::cpu {

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
};

enum class Collective { AllGather, ReduceScatter, AllReduce };

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
// current settings (set_cpu_collectives): Mpi, Ring, Pairwise or Shm, never
// Auto; Mpi on one rank; Pairwise for Shm where the group has no arena.
Choice choose(Collective op, c10::ScalarType dtype, int64_t block_bytes, int size,
              bool has_arena);

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

// out = concatenation of every rank's in. algorithm: Ring, Pairwise or Shm.
void all_gather(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                const at::Tensor& in);
// out = this rank's block of the elementwise SUM or MAX of every rank's in.
void reduce_scatter(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                    const at::Tensor& in, ReduceOp op);
// t = elementwise SUM or MAX of every rank's t.
void all_reduce(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& t, ReduceOp op);

}  // namespace fsdp::detail::cpu
