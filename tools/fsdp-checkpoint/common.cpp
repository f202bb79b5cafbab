#include "common.h"

#include <fmt/format.h>

#include <algorithm>
#include <sstream>

namespace fsdp_checkpoint {

std::string shape_str(c10::IntArrayRef shape) {
  std::ostringstream os;
  os << shape;  // c10's spelling, as libfsdp's messages and the tests print shapes
  return os.str();
}

std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t tensor_bytes(const fsdp::dcp::Reader::TensorInfo& t) {
  return numel(t.shape) * static_cast<int64_t>(c10::elementSize(t.dtype));
}

std::string human_bytes(int64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", v, units[u]);
}

fsdp::dcp::Reader open_reader(const std::string& dir, const std::string& argument) {
  try {
    return fsdp::dcp::Reader(dir);
  } catch (const fsdp::dcp::CheckpointError& e) {
    throw UsageError(fmt::format("{}: {}: {}", argument, fsdp::dcp::to_string(e.kind()), e.what()));
  }
}

at::Tensor read_box(const fsdp::dcp::Reader& reader, const std::string& name,
                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  try {
    return reader.read(name, offsets, sizes);
  } catch (const fsdp::dcp::CheckpointError& e) {
    throw DamagedError(fmt::format("{}: {}: {}", reader.path(), fsdp::dcp::to_string(e.kind()),
                                   e.what()));
  }
}

void for_each_block(const fsdp::dcp::Reader& reader, const fsdp::dcp::Reader::TensorInfo& t,
                    int64_t max_bytes, const std::function<void(const at::Tensor&, int64_t)>& fn) {
  if (t.shape.empty() || t.shape[0] == 0) {
    fn(read_box(reader, t.name, std::vector<int64_t>(t.shape.size(), 0), t.shape), 0);
    return;
  }
  const int64_t row_bytes =
      numel(t.shape) / t.shape[0] * static_cast<int64_t>(c10::elementSize(t.dtype));
  const int64_t rows = std::max<int64_t>(1, row_bytes > 0 ? max_bytes / row_bytes : t.shape[0]);
  std::vector<int64_t> offsets(t.shape.size(), 0), sizes = t.shape;
  for (int64_t r = 0; r < t.shape[0]; r += rows) {
    offsets[0] = r;
    sizes[0] = std::min(rows, t.shape[0] - r);
    fn(read_box(reader, t.name, offsets, sizes), r);
  }
}

}  // namespace fsdp_checkpoint
