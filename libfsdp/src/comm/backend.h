// Backend: one transport (MPI or NCCL) of one process group; the shared
// defaults are in process_group.cpp, the factories in comm/mpi_backend.h and
// comm/nccl_backend.h.
#pragma once

#include "fsdp/process_group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail {

// Element counts per peer for all_to_all.
struct SplitCounts {
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
};

// One transport (MPI or NCCL) for one group. Arguments arrive validated.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual WorkPtr all_gather(at::Tensor out, at::Tensor in, bool async_op) = 0;
  virtual WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op, bool async_op) = 0;
  virtual WorkPtr all_reduce(at::Tensor t, ReduceOp op, bool async_op) = 0;
  virtual WorkPtr broadcast(at::Tensor t, int root, bool async_op) = 0;
  virtual WorkPtr all_to_all(at::Tensor out, at::Tensor in, SplitCounts counts, bool async_op) = 0;
  virtual WorkPtr send(at::Tensor t, int dst, int tag, bool async_op) = 0;
  virtual WorkPtr recv(at::Tensor t, int src, int tag, bool async_op) = 0;
  // ops arrive validated and ordered (receives first, then sends, each by
  // peer); returns their Works in that order.
  virtual std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops) = 0;
  virtual void barrier() = 0;
  // See ProcessGroup::empty_for_collectives; plain at::empty by default.
  virtual at::Tensor empty_for_collectives(at::IntArrayRef sizes,
                                           const at::TensorOptions& options);
  // See ProcessGroup::has_shared_memory / shared_memory_committed.
  virtual bool has_shared_memory() const { return false; }
  virtual int64_t shared_memory_committed() const { return 0; }
};

// An all-gather in place: input is output's block for `rank` (the one
// overlap all_gather_into_tensor accepts; backends then skip that block's copy).
bool is_own_gather_block(const at::Tensor& output, const at::Tensor& input, int rank);

}  // namespace fsdp::detail
