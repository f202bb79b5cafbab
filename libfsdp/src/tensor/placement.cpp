// Placements (Shard, StridedShard, Replicate, Partial) and the ceil-div
// shard layout every sharded tensor of libfsdp follows (fsdp/dtensor.h).
#include "fsdp/dtensor.h"

#include "fsdp/errors.h"

#include <string>

namespace fsdp {

Placement Placement::Partial(ReduceOp op) {
  if (op != ReduceOp::SUM && op != ReduceOp::AVG) {
    throw ArgumentError("op", "Placement::Partial: 'op' = " + ::fsdp::to_string(op) +
                                  "; accepted: sum, avg");
  }
  return Placement(Kind::Partial, 0, op);
}

Placement Placement::StridedShard(int64_t dim, int64_t split_factor) {
  if (split_factor < 1) {
    throw ArgumentError("split_factor", "Placement::StridedShard: 'split_factor' = " +
                                            std::to_string(split_factor) + "; accepted: >= 1");
  }
  return Placement(Kind::StridedShard, dim, ReduceOp::SUM, split_factor);
}

bool Placement::operator==(const Placement& o) const {
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::Shard: return dim_ == o.dim_;
    case Kind::StridedShard: return dim_ == o.dim_ && split_factor_ == o.split_factor_;
    case Kind::Partial: return op_ == o.op_;
    case Kind::Replicate: return true;
  }
  return false;
}

std::string Placement::to_string() const {
  switch (kind_) {
    case Kind::Shard: return "Shard(" + std::to_string(dim_) + ")";
    case Kind::StridedShard:
      return "StridedShard(" + std::to_string(dim_) + ", sf=" + std::to_string(split_factor_) +
             ")";
    case Kind::Replicate: return "Replicate()";
    case Kind::Partial: return "Partial(" + ::fsdp::to_string(op_) + ")";
  }
  return "Unknown()";
}

namespace {

void check_layout_args(const char* fn, int64_t n, int64_t parts) {
  if (n < 0) {
    throw ArgumentError("n", std::string(fn) + ": 'n' = " + std::to_string(n) +
                                 "; accepted: n >= 0");
  }
  if (parts < 1) {
    throw ArgumentError("parts", std::string(fn) + ": 'parts' = " + std::to_string(parts) +
                                     "; accepted: parts >= 1");
  }
}

}  // namespace

int64_t shard_chunk(int64_t n, int64_t parts) {
  check_layout_args("shard_chunk", n, parts);
  return (n + parts - 1) / parts;
}

ShardExtent shard_extent(int64_t n, int64_t parts, int64_t index) {
  check_layout_args("shard_extent", n, parts);
  if (index < 0 || index >= parts) {
    throw ArgumentError("index", "shard_extent: 'index' = " + std::to_string(index) +
                                     "; accepted: 0 <= index < parts = " + std::to_string(parts));
  }
  const int64_t c = shard_chunk(n, parts);
  const int64_t begin = std::min(index * c, n);
  const int64_t end = std::min((index + 1) * c, n);
  return {begin, end - begin};
}

}  // namespace fsdp
