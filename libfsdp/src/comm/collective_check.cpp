// FSDP_DEBUG=detail: the ranks of a group compare what they are about to
// issue before they issue it.
//
// A mismatched pair of collectives (an all-gather against an all-reduce, or
// a rank that skipped one) otherwise hangs, or worse, completes with garbage
// when the two happen to move the same bytes. Each collective is preceded by
// an all-gather of a fixed-size fingerprint on a communicator of its own:
// that exchange always matches (it is the same call on every rank), so every
// rank sees every rank's call and all of them throw the same message.
#include "comm/collective_check.h"

#include "fsdp/errors.h"
#include "comm/mpi_types.h"
#include "comm/work.h"

#include <mpi.h>

#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {
namespace {

constexpr std::array<const char*, 6> kOps = {"all_gather", "reduce_scatter", "all_reduce",
                                             "broadcast",  "all_to_all",     "barrier"};
constexpr int kFields = 5;  // op, index, dtype, count, extra
using Fingerprint = std::array<int64_t, kFields>;

int64_t op_code(const std::string& op) {
  for (size_t i = 0; i < kOps.size(); ++i) {
    if (op == kOps[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

std::string describe(const Fingerprint& f) {
  const bool known = f[0] >= 0 && f[0] < static_cast<int64_t>(kOps.size());
  std::string op = known ? kOps[static_cast<size_t>(f[0])] : "op " + std::to_string(f[0]);
  // The index counts this backend's collectives on the group; WorkInfo's
  // seq counts point-to-point too, which only some ranks issue.
  std::string out = "collective " + std::to_string(f[1]) + ": " + op;
  if (op == "barrier") return out;
  if (op == "reduce_scatter" || op == "all_reduce") {
    out += " (" + to_string(static_cast<ReduceOp>(f[4])) + ")";
  } else if (op == "broadcast") {
    out += " (root " + std::to_string(f[4]) + ")";
  }
  out += std::string(" ") + c10::toString(static_cast<c10::ScalarType>(f[2]));
  if (f[3] >= 0) out += " x " + std::to_string(f[3]);
  return out;
}

}  // namespace

CollectiveCheck::CollectiveCheck(MPI_Comm comm, std::vector<int> world_ranks)
    : comm_(comm), world_ranks_(std::move(world_ranks)) {
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
}

CollectiveCheck::~CollectiveCheck() { MPI_Comm_free(&comm_); }

void CollectiveCheck::verify(const WorkInfo& info, int dtype, int64_t count, int64_t extra) {
  const Fingerprint mine = {op_code(info.op), ++issued_, dtype, count, extra};
  std::vector<Fingerprint> all(world_ranks_.size());
  check_mpi(MPI_Allgather(mine.data(), kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T,
                          comm_),
            "MPI_Allgather (FSDP_DEBUG=detail collective check)");
  // All ranks compare against group rank 0, so they all name the same pair.
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    throw CommError("FSDP_DEBUG=detail: the ranks of " + info.group +
                    " issued different collectives: group rank 0 (world rank " +
                    std::to_string(world_ranks_[0]) + ") issued " + describe(all[0]) +
                    ", group rank " + std::to_string(r) + " (world rank " +
                    std::to_string(world_ranks_[r]) + ") issued " + describe(all[r]) +
                    " (this is rank " + std::to_string(rank_) +
                    "; every rank of a group must issue the same collectives in the same order)");
  }
}

}  // namespace fsdp::detail
