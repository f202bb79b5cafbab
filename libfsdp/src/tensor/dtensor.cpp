// DTensor (lite): redistribution between placements, full_tensor, and the
// piece bookkeeping of nested shards (placements and the ceil-div layout:
// placement.cpp).
#include "fsdp/dtensor.h"

#include "fsdp/errors.h"
#include "base/shape_str.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace fsdp {

namespace {

std::string placements_str(const std::vector<Placement>& placements) {
  std::string s = "[";
  for (size_t i = 0; i < placements.size(); ++i) {
    if (i > 0) s += ", ";
    s += placements[i].to_string();
  }
  return s + "]";
}

// Tensor dim that `p` splits (Shard or StridedShard), or -1.
int64_t split_dim(const Placement& p) {
  return p.is_shard() || p.is_strided_shard() ? p.dim() : -1;
}

// The mesh dims that split tensor dim d, in the order they are applied
// (outermost first). Shard(d) dims nest left to right; a StridedShard(d)
// is applied after every dim to its right that splits d. Built right to
// left: a Shard goes in front of the dims to its right, a StridedShard after
// them. Removing a dim from `placements` removes it from the order and keeps
// the others' order, which redistribute relies on while it undoes dims.
std::vector<int> nesting_order(const std::vector<Placement>& placements, int64_t d) {
  std::vector<int> order;
  for (size_t i = placements.size(); i-- > 0;) {
    if (split_dim(placements[i]) != d) continue;
    if (placements[i].is_strided_shard()) {
      order.push_back(static_cast<int>(i));
    } else {
      order.insert(order.begin(), static_cast<int>(i));
    }
  }
  return order;
}

// Checks the count, the Shard/StridedShard dims against a tensor of `ndim`
// dims and the split factors against the mesh, and maps negative dims to
// their positive form, so that later comparisons (Shard(-1) vs Shard(1)) see
// one spelling.
std::vector<Placement> normalize_placements(const std::string& fn,
                                            const std::vector<Placement>& placements,
                                            const DeviceMesh& mesh, int64_t ndim) {
  if (static_cast<int64_t>(placements.size()) != mesh.ndim()) {
    throw ArgumentError("placements", fn + ": 'placements' " + placements_str(placements) +
                                          " has " + std::to_string(placements.size()) +
                                          " entries; expected one per mesh dim (" +
                                          std::to_string(mesh.ndim()) + ")");
  }
  std::vector<Placement> out;
  out.reserve(placements.size());
  for (const Placement& p : placements) {
    if (!p.is_shard() && !p.is_strided_shard()) {
      out.push_back(p);
      continue;
    }
    if (p.dim() < -ndim || p.dim() >= ndim) {
      throw ArgumentError("placements", fn + ": 'placements' " + placements_str(placements) +
                                            " shards dim " + std::to_string(p.dim()) +
                                            " of a tensor with " + std::to_string(ndim) +
                                            " dims; accepted: Shard(d) or StridedShard(d, sf) "
                                            "with " + std::to_string(-ndim) + " <= d < " +
                                            std::to_string(ndim));
    }
    const int64_t d = p.dim() < 0 ? p.dim() + ndim : p.dim();
    out.push_back(p.is_shard() ? Placement::Shard(d)
                               : Placement::StridedShard(d, p.split_factor()));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].is_strided_shard()) continue;
    int64_t inner = 1;
    for (size_t j = i + 1; j < out.size(); ++j) {
      if (split_dim(out[j]) == out[i].dim()) inner *= mesh.size(static_cast<int>(j));
    }
    // Nothing inside: the split factor is the number of fused pieces.
    if (inner > 1 && out[i].split_factor() != inner) {
      throw ArgumentError("placements", fn + ": 'placements' " + placements_str(placements) +
                                            " has " + out[i].to_string() + " on mesh dim " +
                                            std::to_string(i) + " of " + mesh.to_string() +
                                            ", but the mesh dims to its right that shard "
                                            "tensor dim " + std::to_string(out[i].dim()) +
                                            " have " + std::to_string(inner) +
                                            " ranks in all; accepted: split factor " +
                                            std::to_string(inner) + " (any split factor "
                                            "only when no dim to its right shards it)");
    }
  }
  return out;
}

// The fused pieces of mesh dim i: a StridedShard with no dim to its right
// splitting the same tensor dim cuts the piece it splits into split_factor
// equal parts and splits each one (a fused [q; k; v] weight sharded by
// heads). 1 for every other placement, whose piece is one part.
int64_t fused_pieces(const std::vector<Placement>& placements, int i) {
  const Placement& p = placements[static_cast<size_t>(i)];
  if (!p.is_strided_shard()) return 1;
  for (size_t j = static_cast<size_t>(i) + 1; j < placements.size(); ++j) {
    if (split_dim(placements[j]) == p.dim()) return 1;
  }
  return p.split_factor();
}

void check_fused(const std::vector<Placement>& placements, int64_t n, int64_t pieces) {
  if (n % pieces != 0) {
    throw ShapeError("placements", "DTensor: 'placements' " + placements_str(placements) +
                                       " cut a dim of length " + std::to_string(n) + " into " +
                                       std::to_string(pieces) + " equal fused pieces; " +
                                       std::to_string(n) + " is not divisible by " +
                                       std::to_string(pieces));
  }
}

// Rows of a piece of length n that group rank r of k owns.
int64_t split_length(const std::vector<Placement>& placements, int i, int64_t n, int64_t k,
                     int64_t r) {
  const int64_t pieces = fused_pieces(placements, i);
  check_fused(placements, n, pieces);
  return pieces * shard_extent(n / pieces, k, r).length;
}

// This rank's piece of a global tensor of `shape`: along each tensor dim,
// the ceil-div split of every splitting mesh dim in nesting order.
std::vector<int64_t> local_shape(std::vector<int64_t> shape, const DeviceMesh& mesh,
                                 const std::vector<Placement>& placements) {
  for (size_t d = 0; d < shape.size(); ++d) {
    for (int j : nesting_order(placements, static_cast<int64_t>(d))) {
      const ProcessGroupPtr g = mesh.get_group(j);
      shape[d] = split_length(placements, j, shape[d], g->size(), g->rank());
    }
  }
  return shape;
}

// Length along tensor dim `d` of the piece that mesh dim `mesh_dim` splits:
// the global length cut down by the mesh dims applied before it.
int64_t piece_length(int64_t n, const DeviceMesh& mesh, const std::vector<Placement>& placements,
                     int mesh_dim, int64_t d) {
  for (int j : nesting_order(placements, d)) {
    if (j == mesh_dim) break;
    const ProcessGroupPtr g = mesh.get_group(j);
    n = split_length(placements, j, n, g->size(), g->rank());
  }
  return n;
}

// Mesh dims innermost first: each is, when its turn comes, the last applied
// of the remaining dims that split its tensor dim. Undoing splits in this
// order always gathers a piece whose inner splits are already gone. For
// plain Shard placements it is simply right to left.
std::vector<int> innermost_first(std::vector<Placement> placements) {
  std::vector<int> order;
  std::vector<bool> done(placements.size());
  while (order.size() < placements.size()) {
    for (size_t i = placements.size(); i-- > 0;) {
      if (done[i]) continue;
      const int64_t d = split_dim(placements[i]);
      if (d >= 0 && nesting_order(placements, d).back() != static_cast<int>(i)) continue;
      order.push_back(static_cast<int>(i));
      done[i] = true;
      placements[i] = Placement::Replicate();
      break;
    }
  }
  return order;
}

// Collectives split along dim 0 of contiguous buffers, so a Shard(d) with
// d != 0 works on a copy with d moved to the front.
at::Tensor to_front(const at::Tensor& t, int64_t d) { return t.movedim(d, 0).contiguous(); }
at::Tensor from_front(const at::Tensor& t, int64_t d) { return t.movedim(0, d).contiguous(); }

// [pieces * rows, rest...] <-> [pieces, rows, rest...] for fused pieces.
at::Tensor split_pieces(const at::Tensor& front, int64_t pieces) {
  std::vector<int64_t> sizes = front.sizes().vec();
  sizes[0] /= pieces;
  sizes.insert(sizes.begin(), pieces);
  return front.reshape(sizes);
}
at::Tensor join_pieces(const at::Tensor& t) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[1] *= sizes[0];
  sizes.erase(sizes.begin());
  return t.reshape(sizes);
}

// Pads dim 1 of [pieces, rows, rest...] to `rows` with zeros: reductions
// over padded rows then stay zero and never leak into a neighbour's rows.
at::Tensor pad_piece_rows(const at::Tensor& t, int64_t rows) {
  if (t.size(1) == rows) return t;
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[1] = rows;
  at::Tensor padded = at::zeros(sizes, t.options());
  padded.narrow(1, 0, t.size(1)).copy_(t);
  return padded;
}

// Shard(d) -> Replicate over `g`; `n` is the length along d of the piece
// that the group splits, cut into `pieces` fused parts split one by one.
at::Tensor gather_shards(const at::Tensor& local, int64_t d, int64_t n, int64_t pieces,
                         ProcessGroup& g) {
  const int64_t k = g.size();
  if (k == 1) return local;
  const int64_t c = shard_chunk(n / pieces, k);
  const at::Tensor padded =
      pad_piece_rows(split_pieces(to_front(local, d), pieces), c).contiguous();
  std::vector<int64_t> sizes = padded.sizes().vec();
  sizes.insert(sizes.begin(), k);  // [k, pieces, c, rest...]
  at::Tensor out = at::empty(sizes, padded.options());
  g.all_gather_into_tensor(out, padded);
  // Piece-major: each part is the ranks' chunks in rank order.
  std::vector<int64_t> part_sizes = padded.sizes().vec();
  part_sizes[1] = k * c;
  const at::Tensor parts = out.transpose(0, 1).reshape(part_sizes);
  return from_front(join_pieces(parts.narrow(1, 0, n / pieces)), d);
}

// Partial(op) -> Replicate over `g`.
at::Tensor reduce_partial(const at::Tensor& local, ReduceOp op, ProcessGroup& g) {
  if (g.size() == 1) return local;
  // all_reduce works in place; the source DTensor must keep its value.
  at::Tensor t = local.clone(at::MemoryFormat::Contiguous);
  g.all_reduce(t, op);
  return t;
}

// Partial(op) -> Shard(d) over `g`, `pieces` fused parts split one by one.
at::Tensor reduce_scatter_shards(const at::Tensor& local, int64_t d, int64_t pieces,
                                 ReduceOp op, ProcessGroup& g) {
  const int64_t k = g.size();
  if (k == 1) return local;
  const int64_t n = local.size(d) / pieces;
  const int64_t c = shard_chunk(n, k);
  // [pieces, k*c, rest] -> [k, pieces, c, rest]: each rank's rows contiguous.
  at::Tensor parts = pad_piece_rows(split_pieces(to_front(local, d), pieces), k * c);
  std::vector<int64_t> sizes = parts.sizes().vec();
  sizes[1] = c;
  sizes.insert(sizes.begin() + 1, k);
  const at::Tensor input = parts.reshape(sizes).transpose(0, 1).contiguous();
  sizes.erase(sizes.begin() + 1);  // [pieces, c, rest]
  at::Tensor out = at::empty(sizes, input.options());
  g.reduce_scatter_tensor(out, input, op);
  return from_front(join_pieces(out.narrow(1, 0, shard_extent(n, k, g.rank()).length)), d);
}

// Replicate -> Shard(d) over `g`. A copy, so that the shard does not pin the
// whole tensor's storage.
at::Tensor take_shard(const at::Tensor& t, int64_t d, int64_t pieces, const ProcessGroup& g) {
  if (pieces == 1) {
    const ShardExtent e = shard_extent(t.size(d), g.size(), g.rank());
    return t.narrow(d, e.offset, e.length).clone(at::MemoryFormat::Contiguous);
  }
  const at::Tensor parts = split_pieces(t.movedim(d, 0), pieces);
  const ShardExtent e = shard_extent(parts.size(1), g.size(), g.rank());
  return from_front(join_pieces(parts.narrow(1, e.offset, e.length)), d);
}

// Without a global shape: every rank's record (first offending world rank or
// -1, then its local sizes) is all-gathered over each mesh dim, innermost
// first (right to left without StridedShard), and replaced by the combined
// piece's record. After the gather over mesh dim i a record no longer
// depends on coordinate i (every member combines the same records), so after
// the last dim every rank holds the same record: one global shape and one
// verdict.
// Replicate and Partial dims are gathered too, both to spread the verdict and
// to check that their members hold equal shapes.
std::vector<int64_t> infer_global_shape(const at::Tensor& local, const DeviceMesh& mesh,
                                        const std::vector<Placement>& placements) {
  const int64_t nd = local.dim();
  std::vector<int64_t> record(static_cast<size_t>(nd + 1));
  record[0] = -1;
  std::copy(local.sizes().begin(), local.sizes().end(), record.begin() + 1);
  for (int i : innermost_first(placements)) {
    const ProcessGroupPtr g = mesh.get_group(i);
    const int64_t k = g->size();
    if (k == 1) continue;
    at::Tensor mine = at::empty({nd + 1}, at::kLong);
    std::copy(record.begin(), record.end(), mine.data_ptr<int64_t>());
    at::Tensor all = at::empty({k, nd + 1}, at::kLong);
    g->all_gather_into_tensor(all, mine);
    const auto rec = all.accessor<int64_t, 2>();

    int64_t bad = -1;
    auto blame = [&bad](int64_t world_rank) {
      if (bad < 0 || world_rank < bad) bad = world_rank;
    };
    const Placement& p = placements[static_cast<size_t>(i)];
    const int64_t d = split_dim(p);
    const int64_t pieces = fused_pieces(placements, i);
    int64_t total = 0;
    for (int64_t r = 0; r < k; ++r) {
      if (rec[r][0] >= 0) blame(rec[r][0]);
      if (d >= 0) total += rec[r][d + 1];
    }
    // Every rank sees the same total, so all of them blame rank 0 alike.
    if (total % pieces != 0) blame(g->world_ranks()[0]);
    for (int64_t r = 0; r < k; ++r) {
      const int64_t world_rank = g->world_ranks()[static_cast<size_t>(r)];
      for (int64_t e = 0; e < nd; ++e) {
        const int64_t want =
            e == d ? pieces * shard_extent(total / pieces, k, r).length : rec[0][e + 1];
        if (rec[r][e + 1] != want) blame(world_rank);
      }
    }
    record[0] = bad;
    for (int64_t e = 0; e < nd; ++e) {
      record[static_cast<size_t>(e + 1)] = e == d ? total : rec[0][e + 1];
    }
  }
  if (record[0] >= 0) {
    throw ShapeError("local", "DTensor::from_local: the 'local' pieces do not fit placements " +
                                  placements_str(placements) + " on " + mesh.to_string() +
                                  " (first misfit: world rank " + std::to_string(record[0]) +
                                  "; this rank's 'local' has shape " + shape_str(local.sizes()) +
                                  "); a Shard(d) or StridedShard(d) piece must have "
                                  "shard_extent(n, parts, index).length rows along d of the "
                                  "piece it splits, and equal sizes elsewhere");
  }
  return std::vector<int64_t>(record.begin() + 1, record.end());
}

}  // namespace

DTensor::DTensor(at::Tensor local, DeviceMesh mesh, std::vector<Placement> placements,
                 std::vector<int64_t> shape)
    : local_(std::move(local)),
      mesh_(std::move(mesh)),
      placements_(std::move(placements)),
      shape_(std::move(shape)) {}

DTensor DTensor::from_local(const at::Tensor& local, const DeviceMesh& mesh,
                            const std::vector<Placement>& placements,
                            std::optional<std::vector<int64_t>> shape) {
  if (!local.defined()) {
    throw ArgumentError("local", "DTensor::from_local: 'local' is an undefined tensor");
  }
  std::vector<Placement> p = normalize_placements("DTensor::from_local", placements, mesh,
                                                  local.dim());
  if (!shape) return DTensor(local, mesh, p, infer_global_shape(local, mesh, p));

  if (static_cast<int64_t>(shape->size()) != local.dim() ||
      std::any_of(shape->begin(), shape->end(), [](int64_t s) { return s < 0; })) {
    throw ShapeError("shape", "DTensor::from_local: 'shape' = " + shape_str(*shape) +
                                  "; accepted: " + std::to_string(local.dim()) +
                                  " non-negative sizes (the dims of 'local')");
  }
  // An explicit shape keeps from_local free of communication, so this check
  // is local: only the ranks whose piece does not fit throw.
  const std::vector<int64_t> want = local_shape(*shape, mesh, p);
  if (local.sizes() != c10::IntArrayRef(want)) {
    throw ShapeError("local", "DTensor::from_local: 'local' has shape " +
                                  shape_str(local.sizes()) + " but placements " +
                                  placements_str(p) + " of global shape " + shape_str(*shape) +
                                  " on " + mesh.to_string() + " give this rank " +
                                  shape_str(want));
  }
  return DTensor(local, mesh, std::move(p), std::move(*shape));
}

const DeviceMesh& DTensor::device_mesh() const {
  if (!mesh_) throw StateError("DTensor::device_mesh: the DTensor is undefined");
  return *mesh_;
}

at::Tensor DTensor::full_tensor() const {
  if (!defined()) throw StateError("DTensor::full_tensor: the DTensor is undefined");
  return redistribute(std::vector<Placement>(placements_.size(), Placement::Replicate()))
      .to_local();
}

// Mesh dims that change go through Replicate: innermost first they are
// gathered or reduced, then outermost first they are split again. Along a
// tensor dim d only the splits that both layouts apply first, in the same
// order and unchanged, can stay (a common prefix of the nesting orders):
// every later split of d is inside a piece that changes, so those dims are
// taken through Replicate too even if their placement does not change. With
// plain Shard placements that is "every dim to the right of a changed dim
// that splits the same d", and the passes run right to left / left to
// right. Partial -> Shard/StridedShard skips the detour and reduce-scatters
// in the second pass, once the piece it splits is in place.
DTensor DTensor::redistribute(const std::vector<Placement>& placements) const {
  if (!defined()) throw StateError("DTensor::redistribute: the DTensor is undefined");
  const std::vector<Placement> target = normalize_placements(
      "DTensor::redistribute", placements, *mesh_, static_cast<int64_t>(shape_.size()));
  const int n = mesh_->ndim();
  std::vector<Placement> cur = placements_;

  std::vector<bool> redo(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) redo[i] = cur[i] != target[i];
  // Only the unchanged dims past the common prefix need marking, and they
  // split d in both layouts, so the tail of `from` holds them all. One pass
  // suffices: a dim marked here splits only d (a dim that splits d in one
  // layout and something else in the other has changed and is marked
  // already), so it cannot shorten another tensor dim's prefix.
  for (int64_t d = 0; d < static_cast<int64_t>(shape_.size()); ++d) {
    const std::vector<int> from = nesting_order(cur, d);
    const std::vector<int> to = nesting_order(target, d);
    size_t keep = 0;
    while (keep < from.size() && keep < to.size() && from[keep] == to[keep] &&
           !redo[static_cast<size_t>(from[keep])]) {
      ++keep;
    }
    for (size_t k = keep; k < from.size(); ++k) redo[static_cast<size_t>(from[k])] = true;
  }

  at::Tensor t = local_;
  // First pass. The redone dims that split d are the tail of d's nesting
  // order, so the innermost remaining one is always redone: the rightmost
  // eligible dim exists until every redone split is gathered.
  for (;;) {
    int pick = -1;
    for (int i = n - 1; i >= 0 && pick < 0; --i) {
      if (!redo[i]) continue;
      const int64_t d = split_dim(cur[i]);
      if (d >= 0 ? nesting_order(cur, d).back() == i
                 : cur[i].is_partial() && split_dim(target[i]) < 0) {
        pick = i;
      }
    }
    if (pick < 0) break;
    const ProcessGroupPtr g = mesh_->get_group(pick);
    const int64_t d = split_dim(cur[pick]);
    if (d >= 0) {
      t = gather_shards(t, d, piece_length(shape_[static_cast<size_t>(d)], *mesh_, cur, pick, d),
                        fused_pieces(cur, pick), *g);
    } else {
      t = reduce_partial(t, cur[pick].reduce_op(), *g);
    }
    cur[pick] = Placement::Replicate();
  }
  // Second pass: a split is applied once every dim before it in the target
  // nesting order is in place (kept or already split).
  std::vector<bool> applied(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) applied[i] = !redo[i];
  for (;;) {
    int pick = -1;
    for (int i = 0; i < n && pick < 0; ++i) {
      if (applied[i]) continue;
      const int64_t d = split_dim(target[i]);
      bool ready = true;
      if (d >= 0) {
        for (int j : nesting_order(target, d)) {
          if (j == i) break;
          if (!applied[static_cast<size_t>(j)]) ready = false;
        }
      }
      if (ready) pick = i;
    }
    if (pick < 0) break;
    const ProcessGroupPtr g = mesh_->get_group(pick);
    const Placement& want = target[pick];
    const int64_t d = split_dim(want);
    if (d >= 0) {
      const int64_t pieces = fused_pieces(target, pick);
      check_fused(target, t.size(d), pieces);
      t = cur[pick].is_partial()
              ? reduce_scatter_shards(t, d, pieces, cur[pick].reduce_op(), *g)
              : take_shard(t, d, pieces, *g);
    } else if (want.is_partial() && want.reduce_op() == ReduceOp::SUM && g->rank() != 0) {
      t = at::zeros_like(t);
    }
    cur[pick] = want;
    applied[pick] = true;
  }
  return DTensor(t, *mesh_, target, shape_);
}

int64_t DTensor::numel() const {
  if (!defined()) return 0;
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh,
                          const std::vector<Placement>& placements) {
  if (!full.defined()) {
    throw ArgumentError("full", "distribute_tensor: 'full' is an undefined tensor");
  }
  const std::vector<Placement> p = normalize_placements("distribute_tensor", placements, mesh,
                                                        full.dim());
  const DTensor whole = DTensor::from_local(
      full, mesh, std::vector<Placement>(p.size(), Placement::Replicate()), full.sizes().vec());
  DTensor out = whole.redistribute(p);
  // The caller may keep changing `full`; the DTensor must not change with it.
  if (!out.to_local().is_alias_of(full)) return out;
  return DTensor::from_local(out.to_local().clone(at::MemoryFormat::Contiguous), mesh, p,
                             out.shape());
}

}  // namespace fsdp
