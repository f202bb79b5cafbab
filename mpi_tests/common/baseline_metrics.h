// The two metrics every case of the test plan's precision matrix records
// (rule 3: loss and global grad norm, each against the case's single-card or
// DDP baseline), computed on the test side with raw MPI: the sums over ranks
// that assemble the sharded run's loss and grad norm never go through
// libfsdp's own collectives (rule 1).
#pragma once

#include "raw_mpi.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

namespace metrics {

// Sum of `v` over the ranks of `comm`.
inline double sum_over(MPI_Comm comm, double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, comm);
  return out;
}
inline double world_sum(double v) { return raw_mpi::sum_over_ranks(v); }

// A raw MPI communicator of the world ranks that pass the same `color`
// (e.g. an HSDP mesh's shard group: color = the replica index). Collective
// over the world.
class SubComm {
 public:
  SubComm(int color, int key) { MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm_); }
  ~SubComm() { MPI_Comm_free(&comm_); }
  SubComm(const SubComm&) = delete;
  SubComm& operator=(const SubComm&) = delete;
  MPI_Comm get() const { return comm_; }
  double sum(double v) const { return sum_over(comm_, v); }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// Sum of squares of a tensor in double (0 for an undefined one).
inline double sq_sum(const at::Tensor& t) {
  if (!t.defined()) return 0;
  return t.detach().to(at::kCPU).to(at::kDouble).pow(2).sum().item<double>();
}

// Sum of squares of every parameter's gradient held here (a sharded model:
// this rank's shards; a single-card model: the full gradients).
inline double grad_sq_sum(torch::nn::Module& model) {
  double s = 0;
  for (const auto& p : model.parameters()) s += sq_sum(p.grad());
  return s;
}

// Global grad norm of a single-card model.
inline double grad_norm(torch::nn::Module& model) { return std::sqrt(grad_sq_sum(model)); }

// Global grad norm of a model sharded over the ranks of `shard_comm`: the
// square root of the sum over them of each rank's shard sum of squares.
inline double sharded_grad_norm(torch::nn::Module& model, MPI_Comm shard_comm) {
  return std::sqrt(sum_over(shard_comm, grad_sq_sum(model)));
}

}  // namespace metrics
