// fsdp::dcp::Reader: one checkpoint read by one process (fsdp-checkpoint).
#include "fsdp/distributed_checkpoint.h"

#include "base/shape_str.h"
#include "checkpoint/files.h"
#include "checkpoint/h5io.h"
#include "checkpoint/index.h"
#include "checkpoint/layout.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <set>

namespace fsdp::dcp {

using detail::Box;
using Kind = CheckpointError::Kind;

Reader::Reader(const std::string& dir) {
  path_ = dir;
  if (!detail::exists(dir + "/" + detail::kIndexFile)) {
    const auto all = list_checkpoints(dir);
    if (all.empty()) {
      throw CheckpointError(Kind::NotFound, "", dir,
                            dir + " is neither a checkpoint nor a directory of complete ones");
    }
    path_ = all.front();
  }
  index_text_ = detail::read_index_text(path_);
  const detail::Index index = detail::parse_index(index_text_, path_ + "/" + detail::kIndexFile);
  step_ = index.step;
  world_size_ = index.world_size;
  for (const auto& [name, t] : index.tensors) {
    tensors_.push_back({name, t.kind, t.dtype, t.shape, t.chunks});
  }
  values_ = index.values;
  for (const auto& [prefix, o] : index.optimizers) optimizers_[prefix] = o.dump();
}

const Reader::TensorInfo& Reader::tensor(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return t;
  }
  throw ArgumentError("name", "fsdp::dcp::Reader: " + path_ + " has no tensor '" + name + "'");
}

at::Tensor Reader::read(const std::string& name) const {
  const auto& t = tensor(name);
  return read(name, std::vector<int64_t>(t.shape.size(), 0), t.shape);
}

at::Tensor Reader::read(const std::string& name, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& sizes) const {
  const auto& t = tensor(name);
  if (offsets.size() != t.shape.size() || sizes.size() != t.shape.size()) {
    throw ArgumentError("offsets", "fsdp::dcp::Reader::read: '" + name + "' has " +
                                       std::to_string(t.shape.size()) + " dims");
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (offsets[d] < 0 || sizes[d] < 0 || offsets[d] + sizes[d] > t.shape[d]) {
      throw ArgumentError("sizes", "fsdp::dcp::Reader::read: box outside '" + name + "' " +
                                       shape_str(t.shape));
    }
  }
  const detail::LocalBox want{Box{offsets, sizes}, std::vector<int64_t>(sizes.size(), 0)};
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(t.dtype));
  int64_t covered = 0;
  for (const auto& c : t.chunks) {
    const Box stored{c.offsets, c.sizes};
    const Box part = detail::intersect(want.global, stored);
    if (detail::empty(part) && !part.sizes.empty()) continue;
    detail::Handle f = detail::open_file(detail::contained_file(path_, c.file), c.file);
    at::Tensor buf = at::empty(part.sizes, at::TensorOptions().dtype(t.dtype));
    detail::read_piece(f.get(), c.dataset, stored, part, buf, name, c.file);
    detail::region(out, want, part).copy_(buf);
    covered += part.numel();
  }
  if (covered != want.global.numel()) {
    throw CheckpointError(Kind::Incomplete, name, "",
                          path_ + ": the pieces of '" + name + "' cover " +
                              std::to_string(covered) + " of " +
                              std::to_string(want.global.numel()) + " elements asked for");
  }
  return out;
}

namespace {

// What a load does with a checkpoint that has this problem.
constexpr const char* kFallsBack = " [a load falls back to an older checkpoint]";

// A verify reads at most this much of a piece at once.
constexpr int64_t kVerifyBytes = int64_t{64} << 20;

// The rows [begin, begin + n) of a box.
Box rows_of(const Box& b, int64_t begin, int64_t n) {
  Box out = b;
  out.offsets[0] = b.offsets[0] + begin;
  out.sizes[0] = n;
  return out;
}

// Reads every block of one piece (each read checks its Fletcher-32) and
// counts its non-finite elements when `finite` asks for them.
int64_t verify_piece(hid_t file, const Reader::Chunk& c, const Reader::TensorInfo& t, bool finite) {
  const Box stored{c.offsets, c.sizes};
  std::vector<Box> parts;
  if (stored.sizes.empty()) {
    parts.push_back(stored);
  } else {
    const int64_t row_bytes =
        std::max<int64_t>(1, stored.numel() / std::max<int64_t>(1, stored.sizes[0])) *
        static_cast<int64_t>(c10::elementSize(t.dtype));
    const int64_t step = std::max<int64_t>(1, kVerifyBytes / row_bytes);
    for (int64_t r = 0; r < stored.sizes[0]; r += step) {
      parts.push_back(rows_of(stored, r, std::min(step, stored.sizes[0] - r)));
    }
  }
  int64_t bad = 0;
  for (const Box& part : parts) {
    at::Tensor buf = at::empty(part.sizes, at::TensorOptions().dtype(t.dtype));
    detail::read_piece(file, c.dataset, stored, part, buf, t.name, c.file);
    if (finite && buf.numel() > 0) bad += buf.numel() - at::isfinite(buf).sum().item<int64_t>();
  }
  return bad;
}

}  // namespace

std::vector<std::string> Reader::verify() const {
  // The index's own checks (names, sizes, tiling) ran when it was read.
  std::vector<std::string> problems;
  const detail::Index index = detail::parse_index(index_text_, path_ + "/index.json");
  std::set<std::string> bad_files;
  for (const auto& [file, bytes] : index.files) {
    try {
      detail::check_rank_file(path_, file, bytes, path_);
    } catch (const CheckpointError& e) {
      problems.push_back(file + ": " + to_string(e.kind()) + ": " + e.what() + kFallsBack);
      bad_files.insert(file);
    }
  }
  if (!detail::exists(path_ + "/" + detail::kGlobalFile)) {
    problems.push_back(std::string(detail::kGlobalFile) +
                       ": missing [a load does not read it; h5py and h5dump views need it]");
  }
  for (const auto& t : tensors_) {
    // What LoadOptions::check_finite refuses by default.
    const bool finite = (t.kind == "param" || t.kind == "optim") && at::isFloatingType(t.dtype);
    for (const auto& c : t.chunks) {
      if (bad_files.count(c.file)) continue;  // said once above
      const std::string where = t.name + " " + detail::box_str(Box{c.offsets, c.sizes}) + ": ";
      try {
        // Not in bad_files: check_rank_file vetted it above.
        detail::Handle f = detail::open_file(path_ + "/" + c.file, c.file);
        const int64_t bad = verify_piece(f.get(), c, t, finite);
        if (bad > 0) {
          problems.push_back(where + "corrupt: " + std::to_string(bad) + " non-finite value(s) "
                             "(NaN or infinity in a parameter or optimizer state)" + kFallsBack);
        }
      } catch (const CheckpointError& e) {
        problems.push_back(where + to_string(e.kind()) + ": " + e.what() + kFallsBack);
      }
    }
  }
  return problems;
}

}  // namespace fsdp::dcp
