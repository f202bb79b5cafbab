// Boxes of a DTensor's local piece. Along each tensor dim the rows this rank
// holds are found by distributing an arange over the same mesh with the
// placements that split that dim (the others read as Replicate): DTensor's
// layout rule, including StridedShard's nesting and fused pieces, is then
// applied by DTensor itself. The rows come out as runs of consecutive
// indices; the piece is the product of the runs of every dim.
#include "checkpoint/layout.h"

#include "fsdp/errors.h"

#include <ATen/ops/arange.h>

#include <algorithm>
#include <sstream>

namespace fsdp::dcp::detail {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::string box_str(const Box& b) {
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < b.sizes.size(); ++d) {
    os << (d ? ", " : "") << b.offsets[d] << ":" << b.offsets[d] + b.sizes[d];
  }
  os << "]";
  return os.str();
}

Box intersect(const Box& a, const Box& b) {
  Box out;
  out.offsets.resize(a.offsets.size());
  out.sizes.resize(a.sizes.size());
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    out.offsets[d] = lo;
    out.sizes[d] = std::max<int64_t>(0, hi - lo);
  }
  return out;
}

bool empty(const Box& b) {
  return std::any_of(b.sizes.begin(), b.sizes.end(), [](int64_t s) { return s == 0; });
}

namespace {

struct Run {
  int64_t global = 0, local = 0, length = 0;
};

// Runs of consecutive global indices among this rank's rows of dim d.
std::vector<Run> runs_of_dim(const DTensor& t, int64_t d) {
  std::vector<Placement> along;
  bool split = false;
  for (const Placement& p : t.placements()) {
    if ((p.is_shard() || p.is_strided_shard()) && p.dim() == d) {
      along.push_back(p.is_shard() ? Placement::Shard(0)
                                   : Placement::StridedShard(0, p.split_factor()));
      split = true;
    } else {
      along.push_back(Placement::Replicate());
    }
  }
  const int64_t n = t.shape()[static_cast<size_t>(d)];
  if (!split) return n > 0 ? std::vector<Run>{{0, 0, n}} : std::vector<Run>{};
  const at::Tensor rows =
      distribute_tensor(at::arange(n, at::kLong), t.device_mesh(), along).to_local().cpu().contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  std::vector<Run> runs;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    if (!runs.empty() && runs.back().global + runs.back().length == r[i]) {
      ++runs.back().length;
    } else {
      runs.push_back({r[i], i, 1});
    }
  }
  return runs;
}

}  // namespace

std::vector<LocalBox> local_boxes(const std::string& name, const DTensor& t) {
  for (const Placement& p : t.placements()) {
    if (p.is_partial()) {
      throw ArgumentError("state", "distributed checkpoint: '" + name + "' has placement " +
                                       p.to_string() +
                                       "; a partial value cannot be saved (redistribute it to "
                                       "Replicate or Shard first)");
    }
  }
  const auto ndim = static_cast<int64_t>(t.shape().size());
  std::vector<std::vector<Run>> runs;
  for (int64_t d = 0; d < ndim; ++d) {
    runs.push_back(runs_of_dim(t, d));
    if (runs.back().empty()) return {};
  }
  // Product of the runs, dim 0 outermost.
  std::vector<LocalBox> out;
  std::vector<size_t> pick(static_cast<size_t>(ndim), 0);
  while (true) {
    LocalBox b;
    for (int64_t d = 0; d < ndim; ++d) {
      const Run& r = runs[static_cast<size_t>(d)][pick[static_cast<size_t>(d)]];
      b.global.offsets.push_back(r.global);
      b.global.sizes.push_back(r.length);
      b.local_offsets.push_back(r.local);
    }
    out.push_back(std::move(b));
    int64_t d = ndim - 1;
    for (; d >= 0; --d) {
      auto& i = pick[static_cast<size_t>(d)];
      if (++i < runs[static_cast<size_t>(d)].size()) break;
      i = 0;
    }
    if (d < 0) break;
  }
  return out;
}

std::vector<LocalBox> whole_box(const std::vector<int64_t>& shape) {
  LocalBox b;
  b.global.offsets.assign(shape.size(), 0);
  b.global.sizes = shape;
  b.local_offsets.assign(shape.size(), 0);
  if (empty(b.global) && !shape.empty()) return {};
  return {b};
}

at::Tensor region(const at::Tensor& local, const LocalBox& box) {
  at::Tensor v = local;
  for (size_t d = 0; d < box.global.sizes.size(); ++d) {
    v = v.narrow(static_cast<int64_t>(d), box.local_offsets[d], box.global.sizes[d]);
  }
  return v;
}

at::Tensor region(const at::Tensor& local, const LocalBox& box, const Box& part) {
  at::Tensor v = local;
  for (size_t d = 0; d < part.sizes.size(); ++d) {
    v = v.narrow(static_cast<int64_t>(d),
                 box.local_offsets[d] + part.offsets[d] - box.global.offsets[d], part.sizes[d]);
  }
  return v;
}

}  // namespace fsdp::dcp::detail
