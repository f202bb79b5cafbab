// CollectiveCheck: FSDP_DEBUG=detail's cross-rank comparison of each
// collective before it is issued (collective_check.cpp).
#pragma once

#include "comm/work.h"

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail {

// FSDP_DEBUG=detail: before each collective every rank of the group gathers
// every rank's fingerprint of it over a communicator of its own and throws
// CommError naming the first rank whose call differs from rank 0's. One per
// backend of a group, called in that backend's issue order (MPI: on its comm
// thread; NCCL: at issue), so the exchanges pair up as the collectives would.
class CollectiveCheck {
 public:
  // Takes ownership of comm; world_ranks: the group's, for messages.
  CollectiveCheck(MPI_Comm comm, std::vector<int> world_ranks);
  ~CollectiveCheck();
  // op: WorkInfo::op; count: elements per rank (-1: may differ by rank, as
  // all_to_all's); extra: the root or the ReduceOp (-1: none).
  void verify(const WorkInfo& info, int dtype, int64_t count, int64_t extra);

 private:
  MPI_Comm comm_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  int64_t issued_ = 0;  // collectives verified so far
};

}  // namespace fsdp::detail
