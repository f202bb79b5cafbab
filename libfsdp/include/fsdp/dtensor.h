// DTensor (lite): a local tensor plus the mesh and per-mesh-dim placements that
// say how it relates to a global tensor.
//
// Placements, one per mesh dimension:
//   Shard(d)      the global tensor is split along tensor dim d over that mesh
//                 dim with the ceil-div layout: chunk c = ceil(n / k); group
//                 rank r owns rows [min(r*c, n), min((r+1)*c, n)) -- trailing
//                 ranks may own zero rows. The local tensor holds exactly the
//                 owned rows (no padding); collectives pad to c internally.
//   StridedShard(d, sf)
//                 like Shard(d), but this mesh dim splits tensor dim d INSIDE
//                 each piece that the mesh dims to its right which shard d
//                 produce; sf must equal the product of their sizes. This is
//                 FSDP inside a TP shard of the same dim: on (dp, tp) with
//                 [StridedShard(0, sf=tp), Shard(0)], rank (i, j) owns rows
//                 shard_extent(len_j, dp, i) of tp piece j =
//                 shard_extent(n, tp, j), e.g. n=8, dp=tp=2: (0,0) rows 0-1,
//                 (1,0) rows 2-3, (0,1) rows 4-5, (1,1) rows 6-7. With
//                 nothing inside (sf = 1) it has Shard(d)'s layout but stays
//                 a different placement (redistributing between the two
//                 re-splits). When no mesh dim to its right splits d, sf
//                 instead counts fused pieces: the piece this mesh dim
//                 splits is cut into sf equal blocks (ShapeError naming
//                 "placements" if they are not equal) and each block is
//                 split ceil-div; the local tensor is the concatenation of
//                 this rank's share of every block. That is a fused
//                 [q; k; v] weight sharded by heads: StridedShard(0, 3) on
//                 tp gives rank j [q_j; k_j; v_j].
//   Replicate     every rank holds the whole (sub-)tensor.
//   Partial(op)   every rank holds a partial value; the global value is the
//                 SUM (or AVG) over that mesh dim.
// With several mesh dims, placements apply left to right: mesh dim 0 splits
// the global tensor, mesh dim 1 splits the piece mesh dim 0 left, and so on;
// a StridedShard(d) is applied after the dims to its right that shard d.
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
  enum class Kind { Shard, Replicate, Partial, StridedShard };

  static Placement Shard(int64_t dim = 0) { return Placement(Kind::Shard, dim, ReduceOp::SUM); }
  static Placement Replicate() { return Placement(Kind::Replicate, 0, ReduceOp::SUM); }
  // op: SUM or AVG (ArgumentError naming "op" otherwise).
  static Placement Partial(ReduceOp op = ReduceOp::SUM);
  // split_factor: >= 1 (ArgumentError naming "split_factor" otherwise); that
  // it matches the mesh dims to its right, where some split the same dim, is
  // checked where placements meet a mesh (ArgumentError naming "placements").
  static Placement StridedShard(int64_t dim, int64_t split_factor);

  Kind kind() const { return kind_; }
  // Plain Shard only: a StridedShard is not a Shard, so code that handles
  // Shard(d) by contiguous ceil-div chunks (fully_shard) never mistakes it
  // for one and rejects it instead.
  bool is_shard() const { return kind_ == Kind::Shard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::Shard && dim_ == dim; }
  bool is_strided_shard() const { return kind_ == Kind::StridedShard; }
  bool is_replicate() const { return kind_ == Kind::Replicate; }
  bool is_partial() const { return kind_ == Kind::Partial; }
  // Tensor dim of a Shard or StridedShard placement.
  int64_t dim() const { return dim_; }
  // Split factor of a StridedShard (1 for every other placement).
  int64_t split_factor() const { return split_factor_; }
  // Reduction of a Partial placement.
  ReduceOp reduce_op() const { return op_; }

  bool operator==(const Placement& o) const;
  bool operator!=(const Placement& o) const { return !(*this == o); }
  // "Shard(0)", "StridedShard(0, sf=2)", "Replicate()", "Partial(sum)"
  std::string to_string() const;

 private:
  Placement(Kind k, int64_t d, ReduceOp op, int64_t split_factor = 1)
      : kind_(k), dim_(d), op_(op), split_factor_(split_factor) {}
  Kind kind_;
  int64_t dim_;
  ReduceOp op_;
  int64_t split_factor_;
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
  // placements.size() must equal mesh.ndim(); Shard and StridedShard dims
  // must be in range and each StridedShard's split factor must match the
  // mesh (ArgumentError naming "placements" otherwise).
  static DTensor from_local(const at::Tensor& local, const DeviceMesh& mesh,
                            const std::vector<Placement>& placements,
                            std::optional<std::vector<int64_t>> shape = std::nullopt);

  const at::Tensor& to_local() const { return local_; }
  // The global tensor on every rank (all-gather / all-reduce as needed).
  at::Tensor full_tensor() const;
  // The same global tensor with other placements on the same mesh. Only the
  // mesh dims that change, and the splits nested inside them on the same
  // tensor dim, communicate: they are gathered to Replicate and split again
  // (Partial -> Shard/StridedShard is one reduce-scatter).
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

// Differentiable redistribute of a local tensor: forward is
// DTensor::from_local(local, mesh, from, shape).redistribute(to).to_local();
// backward redistributes the incoming gradient, taken to have placements
// `grad_placements` (default `to`), to `from` with every Partial read as
// Replicate (a partial sum's gradient is the same on every rank). So
// Shard(d) -> Replicate with grad Partial() is sequence parallelism's
// all-gather (backward reduce-scatter), Replicate -> Replicate with grad
// Partial() is Megatron's copy_to_tp (backward all-reduce). `shape` is the
// global shape (no communication to infer it). Collective over the mesh in
// forward and in backward. Errors as from_local / redistribute, and
// ArgumentError naming "grad_placements" for a wrong count.
at::Tensor redistribute_local(const at::Tensor& local, const DeviceMesh& mesh,
                              const std::vector<Placement>& from,
                              const std::vector<Placement>& to,
                              const std::vector<int64_t>& shape,
                              std::optional<std::vector<Placement>> grad_placements = std::nullopt);

// Where this rank's local tensor sits in the global tensor, as boxes: the
// global indices [offsets, offsets + sizes) are at local_offsets (same
// sizes) in the local tensor. The rule is the placements' own (Shard,
// StridedShard with its nesting and fused pieces, Replicate); boxes are
// products of runs of consecutive rows, dim 0 outermost. Partial:
// ArgumentError naming "placements". A rank holding nothing gets none. No
// communication, and the local tensor's data is never read (a meta tensor is
// fine).
struct LocalPiece {
  std::vector<int64_t> offsets, sizes, local_offsets;
};
std::vector<LocalPiece> local_pieces(const DTensor& t);

// Splits a tensor that is identical on every rank of `mesh` according to
// `placements` (no communication for Shard, StridedShard and Replicate;
// Partial(SUM) keeps the value on group rank 0 and zeros elsewhere,
// Partial(AVG) keeps it everywhere).
DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh,
                          const std::vector<Placement>& placements);

}  // namespace fsdp
