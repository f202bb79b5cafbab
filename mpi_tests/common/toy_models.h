// Small deterministic models and data for the L1/L2 suites, and the
// single-card reference: the same model unsharded on the whole global batch.
#pragma once

#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace toy {

// Uneven on purpose: fc1 has 7 rows (ceil-div shards), fc2 has 3 rows (fewer
// than 4 ranks: a rank owns none), fc3 is 5 x 3.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t seed);
  at::Tensor forward(at::Tensor x);
  fsdp::Sharded<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
  torch::nn::Linear fc3{nullptr};
};
TORCH_MODULE(Mlp);

inline MlpImpl::MlpImpl(int64_t seed) {
  at::manual_seed(seed);
  fc1 = register_module("fc1", torch::nn::Linear(15, 7));
  fc2 = register_module("fc2", torch::nn::Linear(7, 3));
  fc3 = register_module("fc3", torch::nn::Linear(3, 5));
}

inline at::Tensor MlpImpl::forward(at::Tensor x) {
  x = at::tanh(fc1(x));
  x = at::tanh(fc2(x));
  return fc3(x);
}

// Global batch (identical on every rank) and this rank's slice of it.
struct Batch {
  at::Tensor x, y;
};

inline Batch global_batch(int64_t seed, int64_t rows, int64_t in = 15, int64_t out = 5) {
  at::manual_seed(seed);
  return {at::randn({rows, in}), at::randn({rows, out})};
}

inline Batch slice(const Batch& b, int rank, int parts) {
  const int64_t per = b.x.size(0) / parts;
  return {b.x.narrow(0, rank * per, per), b.y.narrow(0, rank * per, per)};
}

// Mean squared error; y is moved to out's device first (a no-op when it is
// there already).
inline at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return (out - y.to(out.device())).pow(2).mean();
}

// Rows [offset, offset + len) of the ceil-div shard `index` of `full` on dim 0.
inline at::Tensor shard_rows(const at::Tensor& full, int64_t parts, int64_t index) {
  const fsdp::ShardExtent e = fsdp::shard_extent(full.size(0), parts, index);
  return full.narrow(0, e.offset, e.length);
}

// The same ceil-div rows along `dim`, computed here rather than by the
// library (for checks of the library's own layout).
inline at::Tensor ceil_div_rows(const at::Tensor& t, int64_t dim, int64_t parts, int64_t index) {
  const int64_t n = t.size(dim);
  const int64_t c = (n + parts - 1) / parts;
  const int64_t begin = std::min(index * c, n);
  const int64_t end = std::min((index + 1) * c, n);
  return t.narrow(dim, begin, end - begin);
}

// A shape as LibTorch prints it: "[2, 3]".
inline std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace toy
