#include "corpus.h"

#include "config.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

namespace fsdp_train {

Corpus Corpus::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(
        fmt::format("--data {}: cannot open the file ({})", path, std::strerror(errno)));
  }
  std::vector<unsigned char> raw((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
  if (in.bad()) {
    throw ConfigError(fmt::format("--data {}: read error ({})", path, std::strerror(errno)));
  }
  Corpus c;
  c.bytes_ = at::empty({static_cast<int64_t>(raw.size())}, at::kLong);
  auto* ids = c.bytes_.data_ptr<int64_t>();
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < raw.size(); ++i) {
    ids[i] = raw[i];
    h = (h ^ raw[i]) * 1099511628211ULL;
  }
  c.hash_ = h;
  return c;
}

at::Tensor Corpus::global_batch(uint64_t seed, int64_t step, int64_t batch, int64_t seq) const {
  at::Generator gen = at::detail::createCPUGenerator(seed * 1000003ULL + static_cast<uint64_t>(step));
  // Start offsets in [0, size - seq - 1], so that seq + 1 bytes follow.
  const at::Tensor starts = at::randint(0, size() - seq, {batch, 1}, gen, at::TensorOptions(at::kLong));
  const at::Tensor index = starts.add(at::arange(seq + 1, at::TensorOptions(at::kLong)));
  return bytes_.index_select(0, index.reshape({-1})).reshape({batch, seq + 1});
}

at::Tensor local_slice(const at::Tensor& global, int64_t rank, int64_t parts) {
  const int64_t rows = global.size(0) / parts;
  return global.narrow(0, rank * rows, rows).contiguous();
}

}  // namespace fsdp_train
