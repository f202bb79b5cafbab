// The CPU collectives over MPI point-to-point: pairwise (every peer at
// once) and ring (the neighbours only). See cpu_collectives.h for their
// order of adds. The rule: docs/architecture.md#reduction-order.
#include "comm/cpu_algorithms.h"

#include "comm/mpi_types.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace fsdp::detail::cpu {
namespace {

// Per-peer chunk of the pairwise reduce-scatter: small enough that what was
// received is still in L2 when it is added (measured: docs/benchmarks.md).
constexpr int64_t kChunkBytes = 256 * 1024;

}  // namespace

void pairwise_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                     const Blocks& b) {
  const MPI_Datatype dt = mpi_datatype(t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  char* own = place_own_block(p, es, out, mine, b);
  Round round(p);
  for (int s = 1; s < p.size; ++s) {
    const int from = mod(p.rank - s, p.size);
    round.recv(out + b.displ[from] * es, b.count[from], dt, from);
  }
  for (int s = 1; s < p.size; ++s) {
    round.send(own, b.count[p.rank], dt, mod(p.rank + s, p.size));
  }
  round.wait("all_gather (pairwise)");
}

void ring_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                 const Blocks& b) {
  const MPI_Datatype dt = mpi_datatype(t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  place_own_block(p, es, out, mine, b);
  const int right = mod(p.rank + 1, p.size), left = mod(p.rank - 1, p.size);
  Round round(p);
  for (int s = 0; s + 1 < p.size; ++s) {
    const int send_b = mod(p.rank - s, p.size), recv_b = mod(p.rank - s - 1, p.size);
    round.recv(out + b.displ[recv_b] * es, b.count[recv_b], dt, left);
    round.send(out + b.displ[send_b] * es, b.count[send_b], dt, right);
    round.wait("all_gather (ring)");
  }
}

void pairwise_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                     const Blocks& b) {
  const MPI_Datatype dt = mpi_datatype(t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const int n = p.size;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / es);
  auto chunks_of = [&](int r) { return (b.count[r] + chunk - 1) / chunk; };
  int64_t rounds = 0;
  for (int r = 0; r < n; ++r) rounds = std::max(rounds, chunks_of(r));
  // One slot per rank: this rank's own chunk is copied into its slot when
  // out aliases the input (all-reduce), before anything is received into out.
  const char* own_in = in + b.displ[p.rank] * es;
  const bool aliased = out == own_in;
  // One peer's chunk is received straight into out: the fold may write over
  // its first two operands, so that peer is the first rank of {0, 1} that is
  // not this one. At np 2 no staging is left, which made the 1 MiB
  // reduce-scatter 2.3x faster and the 2 MiB one 1.15x (fsdp-bench
  // collectives, float32).
  const int direct = p.rank == 0 ? 1 : 0;
  at::Tensor stage = at::empty({n * std::min(chunk, b.max_count())}, at::TensorOptions(t));
  at::Tensor scratch = acc_type(t) == t ? at::Tensor()
                                        : at::empty({std::min(chunk, b.max_count())},
                                                    at::TensorOptions(at::kFloat));
  const int64_t slot = std::min(chunk, b.max_count()) * es;
  std::vector<const void*> xs(static_cast<size_t>(n));
  Round round(p);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t start = k * chunk;
    const int64_t len = std::clamp<int64_t>(b.count[p.rank] - start, 0, chunk);
    if (len > 0 && aliased) {
      std::memcpy(bytes(stage) + p.rank * slot, own_in + start * es, static_cast<size_t>(len * es));
    }
    for (int s = 1; s < n; ++s) {
      const int from = mod(p.rank - s, n);
      round.recv(from == direct ? out + start * es : bytes(stage) + from * slot, len, dt, from);
    }
    for (int s = 1; s < n; ++s) {
      const int to = mod(p.rank + s, n);
      const int64_t their = std::clamp<int64_t>(b.count[to] - start, 0, chunk);
      round.send(in + (b.displ[to] + start) * es, their, dt, to);
    }
    round.wait("reduce_scatter (pairwise)");
    if (len == 0) continue;
    for (int r = 0; r < n; ++r) {
      xs[static_cast<size_t>(r)] = r == direct                ? out + start * es
                                   : r == p.rank && !aliased ? own_in + start * es
                                                             : bytes(stage) + r * slot;
    }
    fold(t, combine_of(op), out + start * es, xs.data(), n, len, divisor_of(op, n),
         scratch.defined() ? scratch.data_ptr<float>() : nullptr);
  }
}

void ring_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                 const Blocks& b) {
  const c10::ScalarType at_t = acc_type(t);
  const MPI_Datatype acc_dt = mpi_datatype(at_t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const auto aes = static_cast<int64_t>(c10::elementSize(at_t));
  const int n = p.size;
  const int right = mod(p.rank + 1, n), left = mod(p.rank - 1, n);
  at::Tensor bufs = at::empty({2, std::max<int64_t>(1, b.max_count())}, at::TensorOptions(at_t));
  char* send_buf = bytes(bufs);
  char* recv_buf = send_buf + bufs.size(1) * aes;
  const int first = mod(p.rank - 1, n);
  const char* sending = in + b.displ[first] * es;
  if (at_t != t) {
    widen(t, send_buf, sending, b.count[first]);
    sending = send_buf;
  }
  Round round(p);
  for (int s = 0; s + 1 < n; ++s) {
    const int send_b = mod(p.rank - s - 1, n), recv_b = mod(p.rank - s - 2, n);
    round.recv(recv_buf, b.count[recv_b], acc_dt, left);
    round.send(sending, b.count[send_b], acc_dt, right);
    round.wait("reduce_scatter (ring)");
    accumulate(t, combine_of(op), recv_buf, in + b.displ[recv_b] * es, b.count[recv_b]);
    std::swap(send_buf, recv_buf);
    sending = send_buf;
  }
  // The last block received is this rank's: (rank - (n - 2) - 2) mod n.
  narrow(t, out, sending, b.count[p.rank], divisor_of(op, n));
}

}  // namespace fsdp::detail::cpu
