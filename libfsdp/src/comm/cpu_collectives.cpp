// libfsdp's CPU collectives: each call runs the algorithm chosen for it
// (cpu_algorithm_choice.cpp), falling back to pairwise where shm finds an
// operand outside the arena; the algorithms are cpu_algorithms.h's.
// The rule: docs/architecture.md#reduction-order.
#include "comm/cpu_collectives.h"

#include "comm/cpu_algorithms.h"
#include "comm/mpi_types.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

namespace fsdp::detail::cpu {
namespace {

void reduce(const Peers& p, CpuAlgorithm algorithm, c10::ScalarType t, ReduceOp op, char* out,
            const char* in, const Blocks& b) {
  if (algorithm == CpuAlgorithm::Ring) {
    ring_reduce(p, t, op, out, in, b);
  } else if (algorithm == CpuAlgorithm::TwoLevel && p.two_level != nullptr) {
    two_level_reduce(p, t, op, out, in, b);
  } else if (algorithm != CpuAlgorithm::Shm || !shm_reduce(p, t, op, out, in, b, true)) {
    pairwise_reduce(p, t, op, out, in, b);
  }
}

void gather(const Peers& p, CpuAlgorithm algorithm, c10::ScalarType t, char* out,
            const char* mine, const Blocks& b) {
  if (algorithm == CpuAlgorithm::Ring) {
    ring_gather(p, t, out, mine, b);
  } else if (algorithm == CpuAlgorithm::TwoLevel && p.two_level != nullptr) {
    two_level_gather(p, t, out, mine, b);
  } else if (algorithm != CpuAlgorithm::Shm || !shm_gather(p, t, out, mine, b, true)) {
    pairwise_gather(p, t, out, mine, b);
  }
}

}  // namespace

void wait_requests(MPI_Request* requests, int n, bool poll, const char* what) {
  if (n == 0) return;
  if (!poll) {
    check_mpi(MPI_Waitall(n, requests, MPI_STATUSES_IGNORE), what);
    return;
  }
  int done = 0;
  for (int spins = 0; spins < 64; ++spins) {
    check_mpi(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
  }
  std::chrono::microseconds nap(8);
  for (;;) {
    std::this_thread::sleep_for(nap);
    check_mpi(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
    nap = std::min(nap * 2, std::chrono::microseconds(128));
  }
}

void all_gather(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                const at::Tensor& in) {
  gather(p, algorithm, in.scalar_type(), bytes(out), static_cast<const char*>(in.data_ptr()),
         even_blocks(in.numel(), p.size));
}

void reduce_scatter(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                    const at::Tensor& in, ReduceOp op) {
  reduce(p, algorithm, in.scalar_type(), op, bytes(out), static_cast<const char*>(in.data_ptr()),
         even_blocks(out.numel(), p.size));
}

bool all_gather_if_shared(const Peers& p, const at::Tensor& out, const at::Tensor& in) {
  return shm_gather(p, in.scalar_type(), bytes(out), static_cast<const char*>(in.data_ptr()),
                    even_blocks(in.numel(), p.size), /*may_stage=*/false);
}

bool reduce_scatter_if_shared(const Peers& p, const at::Tensor& out, const at::Tensor& in,
                              ReduceOp op) {
  return shm_reduce(p, in.scalar_type(), op, bytes(out), static_cast<const char*>(in.data_ptr()),
                    even_blocks(out.numel(), p.size), /*may_stage=*/false);
}

void all_reduce(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& t, ReduceOp op) {
  const Blocks b = split_blocks(t.numel(), p.size);
  const auto es = static_cast<int64_t>(c10::elementSize(t.scalar_type()));
  if (algorithm == CpuAlgorithm::Shm) {
    if (shm_all_reduce(p, t.scalar_type(), op, bytes(t), b)) return;
    algorithm = CpuAlgorithm::Pairwise;
  }
  char* own = bytes(t) + b.displ[p.rank] * es;
  reduce(p, algorithm, t.scalar_type(), op, own, bytes(t), b);
  gather(p, algorithm, t.scalar_type(), bytes(t), own, b);
}

}  // namespace fsdp::detail::cpu
