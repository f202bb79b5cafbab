// Where a rank's piece of a tensor sits in the global tensor: a set of boxes
// (offsets, sizes), each with the matching region of the local tensor.
// Saving writes boxes, loading intersects the boxes it needs with the saved
// ones; the rule that maps placements to rows is DTensor's own (dtensor.h),
// reused here rather than restated.
#pragma once

#include "fsdp/dtensor.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::dcp::detail {

struct Box {
  std::vector<int64_t> offsets, sizes;  // in the global tensor
  int64_t numel() const;
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
  bool operator<(const Box& o) const {
    return offsets != o.offsets ? offsets < o.offsets : sizes < o.sizes;
  }
};
// "[0:16, 0:32]"
std::string box_str(const Box& b);
// The intersection of two boxes of one tensor; sizes all 0 if none.
Box intersect(const Box& a, const Box& b);
bool empty(const Box& b);

// A box of this rank's piece and where it is in the local tensor.
struct LocalBox {
  Box global;
  std::vector<int64_t> local_offsets;
};

// The boxes of this rank's local tensor of `t` (Shard, StridedShard and
// Replicate placements; ArgumentError naming "state" and `name` for
// Partial). Boxes with no elements are left out.
std::vector<LocalBox> local_boxes(const std::string& name, const DTensor& t);
// The single box of a tensor every holder has whole.
std::vector<LocalBox> whole_box(const std::vector<int64_t>& shape);

// local.narrow(...) to the region of `box`.
at::Tensor region(const at::Tensor& local, const LocalBox& box);
// The sub-region of `box` that is `part` (a box inside box.global).
at::Tensor region(const at::Tensor& local, const LocalBox& box, const Box& part);

}  // namespace fsdp::dcp::detail
