// fsdp::dcp::Reader: one checkpoint read by one process (fsdp-checkpoint).
#include "fsdp/distributed_checkpoint.h"

#include "base/shape_str.h"
#include "checkpoint/files.h"
#include "checkpoint/h5io.h"
#include "checkpoint/index.h"
#include "checkpoint/layout.h"

#include <ATen/ops/empty.h>

#include <fstream>
#include <sstream>

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
  std::ifstream in(path_ + "/" + detail::kIndexFile, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  index_text_ = text.str();
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
    detail::Handle f = detail::open_file(path_ + "/" + c.file, c.file);
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

std::vector<std::string> Reader::verify() const {
  std::vector<std::string> problems;
  const detail::Index index = detail::parse_index(index_text_, path_ + "/index.json");
  for (const auto& [file, bytes] : index.files) {
    const int64_t size = detail::file_size(path_ + "/" + file);
    if (size < 0) {
      problems.push_back(file + ": missing");
    } else if (size != bytes) {
      problems.push_back(file + ": " + std::to_string(size) + " bytes, " + std::to_string(bytes) +
                         " written");
    }
  }
  if (!detail::exists(path_ + "/" + detail::kGlobalFile)) {
    problems.push_back(std::string(detail::kGlobalFile) + ": missing");
  }
  for (const auto& t : tensors_) {
    // Pieces must tile the tensor: disjoint, covering every element.
    int64_t covered = 0;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const Box a{t.chunks[i].offsets, t.chunks[i].sizes};
      covered += a.numel();
      for (size_t j = 0; j < i; ++j) {
        const Box b{t.chunks[j].offsets, t.chunks[j].sizes};
        if (!detail::empty(detail::intersect(a, b))) {
          problems.push_back(t.name + ": pieces " + detail::box_str(a) + " and " +
                             detail::box_str(b) + " overlap");
        }
      }
    }
    int64_t numel = 1;
    for (int64_t s : t.shape) numel *= s;
    if (covered != numel) {
      problems.push_back(t.name + ": pieces cover " + std::to_string(covered) + " of " +
                         std::to_string(numel) + " elements");
    }
    for (const auto& c : t.chunks) {
      try {
        detail::Handle f = detail::open_file(path_ + "/" + c.file, c.file);
        const Box stored{c.offsets, c.sizes};
        at::Tensor buf = at::empty(c.sizes, at::TensorOptions().dtype(t.dtype));
        detail::read_piece(f.get(), c.dataset, stored, stored, buf, t.name, c.file);
      } catch (const CheckpointError& e) {
        problems.push_back(t.name + " " + detail::box_str(Box{c.offsets, c.sizes}) + ": " +
                           e.what());
      }
    }
  }
  return problems;
}

}  // namespace fsdp::dcp
