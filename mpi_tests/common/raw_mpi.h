// Test-side communication through MPI itself, never through libfsdp's
// collectives: a baseline (DDP's gradient average) or a cross-rank assertion
// (the worst error over ranks, "identical on every rank") must not depend on
// the code under test (docs/test-plan.md, rule 1). Collective over
// MPI_COMM_WORLD, in the same order on every rank; the harness's per-case
// watchdog reports one that hangs. Tensors may live on any device: they go
// through a host copy.
#pragma once

#include <ATen/ATen.h>

#include <mpi.h>

#include <stdexcept>
#include <string>

namespace raw_mpi {

inline MPI_Datatype datatype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    default:
      throw std::invalid_argument(std::string("raw_mpi: tensors of float32, float64, int64 or "
                                              "int32 only, not ") +
                                  c10::toString(t.scalar_type()));
  }
}

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// In place: t becomes the elementwise sum (MPI_SUM) / max / min over ranks.
inline void all_reduce(at::Tensor& t, MPI_Op op = MPI_SUM) {
  at::Tensor host = t.device().is_cpu() && t.is_contiguous() ? t : t.to(at::kCPU).contiguous();
  MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), static_cast<int>(host.numel()), datatype_of(host),
                op, MPI_COMM_WORLD);
  if (!host.is_same(t)) t.copy_(host);
}

// The mean over ranks, in place (the sum divided by the world size).
inline void all_reduce_mean(at::Tensor& t) {
  all_reduce(t, MPI_SUM);
  t.div_(world_size());
}

inline double reduce(double v, MPI_Op op) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, op, MPI_COMM_WORLD);
  return v;
}
inline double max_over_ranks(double v) { return reduce(v, MPI_MAX); }
inline double sum_over_ranks(double v) { return reduce(v, MPI_SUM); }
inline double mean_over_ranks(double v) { return reduce(v, MPI_SUM) / world_size(); }

// Rank `root`'s t on every rank, in place.
inline void broadcast(at::Tensor& t, int root = 0) {
  at::Tensor host = t.device().is_cpu() && t.is_contiguous() ? t : t.to(at::kCPU).contiguous();
  MPI_Bcast(host.data_ptr(), static_cast<int>(host.numel()), datatype_of(host), root,
            MPI_COMM_WORLD);
  if (!host.is_same(t)) t.copy_(host);
}

// Every rank's `in` (same numel everywhere) concatenated in rank order, on the host.
inline at::Tensor all_gather(const at::Tensor& in) {
  const at::Tensor mine = in.to(at::kCPU).contiguous().view({-1});
  at::Tensor all = at::empty({mine.numel() * world_size()}, mine.options());
  MPI_Allgather(mine.data_ptr(), static_cast<int>(mine.numel()), datatype_of(mine),
                all.data_ptr(), static_cast<int>(mine.numel()), datatype_of(mine), MPI_COMM_WORLD);
  return all;
}

// A barrier.
inline void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

}  // namespace raw_mpi
