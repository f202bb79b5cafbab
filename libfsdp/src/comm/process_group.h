// ProcessGroupImpl: libfsdp's ProcessGroup, validating arguments and
// dispatching to the Backend that matches the tensors' device (process_group.cpp).
#pragma once

#include "fsdp/process_group.h"

#include <mpi.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail {

class Backend;          // comm/backend.h
class CollectiveCheck;  // comm/collective_check.h

class ProcessGroupImpl final : public ProcessGroup {
 public:
  // poll: see make_mpi_backend.
  ProcessGroupImpl(MPI_Comm comm, std::vector<int> world_ranks, std::string name,
                   bool poll = false);
  ~ProcessGroupImpl() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  const std::string& name() const override { return name_; }

  WorkPtr all_gather_into_tensor(at::Tensor output, const at::Tensor& input,
                                 bool async_op) override;
  WorkPtr reduce_scatter_tensor(at::Tensor output, const at::Tensor& input, ReduceOp op,
                                bool async_op) override;
  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op, bool async_op) override;
  WorkPtr broadcast(at::Tensor tensor, int root, bool async_op) override;
  WorkPtr all_to_all_single(at::Tensor output, const at::Tensor& input,
                            const std::vector<int64_t>& output_split_sizes,
                            const std::vector<int64_t>& input_split_sizes,
                            bool async_op) override;
  WorkPtr send(const at::Tensor& tensor, int dst, int tag, bool async_op) override;
  WorkPtr recv(at::Tensor tensor, int src, int tag, bool async_op) override;
  std::vector<WorkPtr> batch_isend_irecv(std::vector<P2POp> ops) override;
  void barrier() override;
  at::Tensor empty_for_collectives(at::IntArrayRef sizes,
                                   const at::TensorOptions& options) override;
  bool has_shared_memory() const override;
  int64_t shared_memory_committed() const override;

  // Frees the backends and the communicator; later calls throw StateError.
  void shutdown();
  // A new communicator over the same ranks (collective over the group).
  MPI_Comm duplicate_communicator();
  // MPI_Comm_split of the group's setup communicator (collective over the
  // group): by color and key, or, with color < 0, by node
  // (MPI_COMM_TYPE_SHARED, ordered by group rank). The caller owns the result.
  MPI_Comm split_communicator(int color, int key);

 private:
  Backend& backend_for(const at::Tensor& t, const char* argument);
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
  std::string name_;
  MPI_Comm bootstrap_ = MPI_COMM_NULL;  // owned; used by the NCCL bootstrap
  mutable std::mutex backends_mu_;
  // FSDP_DEBUG=detail: one check per backend (each orders its collectives
  // on its own), created with the group so no later call communicates.
  std::unique_ptr<CollectiveCheck> mpi_check_;
  std::unique_ptr<CollectiveCheck> nccl_check_;
  std::unique_ptr<Backend> mpi_;
  std::unique_ptr<Backend> nccl_;
  bool closed_ = false;
};

}  // namespace fsdp::detail
