// Internal: libfsdp's own CPU collective algorithms over MPI point-to-point
// (the MPI backend runs them on its comm thread, see mpi_backend.cpp).
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
//   All-reduce is reduce-scatter (uneven blocks: numel / N, the first
//   numel % N one longer) followed by all-gather, in the tensor itself, so
//   every rank ends with the same bits.
//
// Same inputs, same rank count, same algorithm: bitwise the same result.
#pragma once

#include "fsdp/comm.h"

#include <mpi.h>

#include <ATen/core/Tensor.h>

#include <cstdint>

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
};

enum class Collective { AllGather, ReduceScatter, AllReduce };

// The algorithm `op` on `dtype` with `block_bytes` per peer runs under the
// current settings (set_cpu_collectives): Mpi, Ring or Pairwise, never Auto;
// Mpi on one rank.
CpuAlgorithm choose(Collective op, c10::ScalarType dtype, int64_t block_bytes, int size);

// Waits for n requests: inside MPI_Waitall, or with poll by MPI_Testall with
// a short spin and then sleeps doubling from 8 us to 128 us (each test also
// progresses the transfers). CommError on an MPI error.
void wait_requests(MPI_Request* requests, int n, bool poll, const char* what);

// out = concatenation of every rank's in. algorithm: Ring or Pairwise.
void all_gather(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                const at::Tensor& in);
// out = this rank's block of the elementwise SUM or MAX of every rank's in.
void reduce_scatter(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                    const at::Tensor& in, ReduceOp op);
// t = elementwise SUM or MAX of every rank's t.
void all_reduce(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& t, ReduceOp op);

}  // namespace fsdp::detail::cpu
