// Boxes of a DTensor's local piece: fsdp::local_pieces (dtensor.h) with the
// checkpoint's own error for a partial value.
#include "checkpoint/layout.h"

#include "fsdp/errors.h"

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

std::vector<LocalBox> local_boxes(const std::string& name, const DTensor& t) {
  for (const Placement& p : t.placements()) {
    if (p.is_partial()) {
      throw ArgumentError("state", "distributed checkpoint: '" + name + "' has placement " +
                                       p.to_string() +
                                       "; a partial value cannot be saved (redistribute it to "
                                       "Replicate or Shard first)");
    }
  }
  std::vector<LocalBox> out;
  for (LocalPiece& p : local_pieces(t)) {
    LocalBox b;
    b.global.offsets = std::move(p.offsets);
    b.global.sizes = std::move(p.sizes);
    b.local_offsets = std::move(p.local_offsets);
    out.push_back(std::move(b));
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
