// DTensor (lite): a local tensor plus the mesh and per-mesh-dim placements that
// say how it relates to a global tensor.
//
// Placements, one per mesh dimension:
//   Shard(d)      the global tensor is split along tensor dim d over that mesh
//                 dim with the ceil-div layout: chunk c = ceil(n / k); group
//                 rank r owns rows [min(r*c, n), min((r+1)*c, n)) -- trailing
//                 ranks may own zero rows. The local tensor holds exactly the
//                 owned rows (no padding); collectives pad to c internally.
//   Replicate     every rank holds the whole (sub-)tensor.
//   Partial(op)   every rank holds a partial value; the global value is the
//                 SUM (or AVG) over that mesh dim.
// With several mesh dims, placements apply left to right: mesh dim 0 splits
// the global tensor, mesh dim 1 splits the piece mesh dim 0 left, and so on.
//
// Collectives run on the mesh's groups (see comm.h) and are collective over
// those groups: every member must make the same call.
#pragma once

#include "fsdp/comm.h"
#include "fsdp/mesh.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class Placement {
 public:
  enum class Kind { Shard, Replicate, Partial };

  static Placement Shard(int64_t dim = 0) { return Placement(Kind::Shard, dim, ReduceOp::SUM); }
  static Placement Replicate() { return Placement(Kind::Replicate, 0, ReduceOp::SUM); }
  // op: SUM or AVG (ArgumentError naming "op" otherwise).
  static Placement Partial(ReduceOp op = ReduceOp::SUM);

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::Shard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::Shard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::Replicate; }
  bool is_partial() const { return kind_ == Kind::Partial; }
  // Tensor dim of a Shard placement.
  int64_t dim() const { return dim_; }
  // Reduction of a Partial placement.
  ReduceOp reduce_op() const { return op_; }

  bool operator==(const Placement& o) const;
  bool operator!=(const Placement& o) const { return !(*this == o); }
  std::string to_string() const;  // "Shard(0)", "Replicate()", "Partial(sum)"

 private:
  Placement(Kind k, int64_t d, ReduceOp op) : kind_(k), dim_(d), op_(op) {}
  Kind kind_;
  int64_t dim_;
  ReduceOp op_;
};

// Ceil-div layout of `n` rows over `parts` ranks: (offset, length) of `index`.
struct ShardExtent {
  int64_t offset = 0;
  int64_t length = 0;
};
ShardExtent shard_extent(int64_t n, int64_t parts, int64_t index);
// The padded chunk size ceil(n / parts).
int64_t shard_chunk(int64_t n, int64_t parts);

class DTensor {
 public:
  DTensor() = default;

  // Wraps this rank's local piece. `shape` is the global shape; when omitted
  // it is computed from every rank's local size (a collective all-gather of
  // sizes over each sharded mesh dim) and checked against the ceil-div layout
  // (ShapeError naming "local" on every rank if it does not fit).
  // placements.size() must equal mesh.ndim(); Shard dims must be in range.
  static DTensor from_local(const at::Tensor& local, const DeviceMesh& mesh,
                            const std::vector<Placement>& placements,
                            std::optional<std::vector<int64_t>> shape = std::nullopt);

  const at::Tensor& to_local() const { return local_; }
  // The global tensor on every rank (all-gather / all-reduce as needed).
  at::Tensor full_tensor() const;
  // The same global tensor with other placements on the same mesh.
  DTensor redistribute(const std::vector<Placement>& placements) const;

  // StateError on a default-constructed (undefined) DTensor.
  const DeviceMesh& device_mesh() const;
  const std::vector<Placement>& placements() const { return placements_; }
  // Global shape.
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;  // global element count
  bool defined() const { return local_.defined(); }

 private:
  DTensor(at::Tensor local, DeviceMesh mesh, std::vector<Placement> placements,
          std::vector<int64_t> shape);
  at::Tensor local_;
  std::optional<DeviceMesh> mesh_;
  std::vector<Placement> placements_;
  std::vector<int64_t> shape_;
};

// Splits a tensor that is identical on every rank of `mesh` according to
// `placements` (no communication for Shard/Replicate; Partial(SUM) keeps the
// value on group rank 0 and zeros elsewhere, Partial(AVG) keeps it everywhere).
DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh,
                          const std::vector<Placement>& placements);

}  // namespace fsdp
