// Column- and row-parallel linear layers: the full tensors are initialised as
// torch::nn::Linear does, then this rank keeps its slice.
#include "fsdp/tensor_parallel.h"

#include "fsdp/errors.h"
#include "tp/check.h"
#include "base/shape_str.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/nn/init.h>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>

namespace fsdp::tp {
namespace {

// torch::nn::Linear's reset_parameters() on full tensors, in its order, so
// the default generator advances exactly as for the plain layer.
std::pair<at::Tensor, at::Tensor> init_linear(int64_t in, int64_t out, bool bias) {
  at::Tensor w = at::empty({out, in});
  at::Tensor b = bias ? at::empty({out}) : at::Tensor();
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  if (bias) {
    const int64_t fan_in = std::get<0>(torch::nn::init::_calculate_fan_in_and_fan_out(w));
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(b, -bound, bound);
  }
  return {w, b};
}

// Dim 0 of `full` cut into `pieces` equal blocks, each split over tp; this
// rank's slices of every block, concatenated.
at::Tensor column_slice(const at::Tensor& full, int64_t pieces, const DeviceMesh& tp) {
  const int64_t block = full.size(0) / pieces;
  const int64_t rows = block / tp.size();
  const int64_t r = tp.get_local_rank(0);
  std::vector<at::Tensor> parts;
  for (const int64_t p : c10::irange(pieces)) {
    parts.push_back(full.narrow(0, p * block + r * rows, rows));
  }
  return at::cat(parts, 0);
}

// A copy: a slice that views the full tensor would pin all of it.
at::Tensor row_slice(const at::Tensor& full, const DeviceMesh& tp) {
  const int64_t cols = full.size(1) / tp.size();
  return full.narrow(1, tp.get_local_rank(0) * cols, cols).clone(at::MemoryFormat::Contiguous);
}

void check_full(const char* fn, const char* arg, const at::Tensor& t,
                const std::vector<int64_t>& want) {
  if (!t.defined() || t.sizes() != c10::IntArrayRef(want)) {
    throw ShapeError(arg, std::string(fn) + ": '" + arg + "' has shape " +
                              (t.defined() ? shape_str(t.sizes()) : "(undefined)") +
                              "; expected the full " + shape_str(want));
  }
}

// load_full's arguments against the plain Linear's shapes.
void check_full_linear(const char* fn, const at::Tensor& w, const at::Tensor& b, int64_t out,
                       int64_t in, bool has_bias) {
  check_full(fn, "weight", w, {out, in});
  if (has_bias) {
    check_full(fn, "bias", b, {out});
  } else if (b.defined()) {
    throw ShapeError("bias", std::string(fn) + ": 'bias' is given but the layer has none "
                                               "(options.bias = false)");
  }
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features_, int64_t out_features_,
                                                   DeviceMesh tp_, ColumnParallelOptions options_)
    : in_features(in_features_),
      out_features(out_features_),
      tp(std::move(tp_)),
      options(options_) {
  detail::check_tp("ColumnParallelLinear", tp);
  if (options.fused_pieces < 1) {
    throw ArgumentError("fused_pieces", "ColumnParallelLinear: 'fused_pieces' = " +
                                            std::to_string(options.fused_pieces) +
                                            "; accepted: >= 1");
  }
  const int64_t parts = options.fused_pieces * tp.size();
  if (out_features % parts != 0) {
    throw ShapeError("out_features", "ColumnParallelLinear: 'out_features' = " +
                                         std::to_string(out_features) +
                                         " does not divide by fused_pieces * tp size = " +
                                         std::to_string(parts));
  }
  auto [w, b] = init_linear(in_features, out_features, options.bias);
  weight = register_parameter("weight", column_slice(w, options.fused_pieces, tp));
  bias = options.bias ? register_parameter("bias", column_slice(b, options.fused_pieces, tp))
                      : register_parameter("bias", {}, /*requires_grad=*/false);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor input = options.sequence_parallel ? sp_all_gather(x, options.sequence_dim, tp)
                                                     : copy_to_tp(x, tp);
  at::Tensor y = at::linear(input, weight, bias);
  if (!options.gather_output) return y;
  y = gather_from_tp(y, -1, tp);
  const int64_t pieces = options.fused_pieces;
  if (pieces == 1 || tp.size() == 1) return y;
  // The gather lays the ranks' outputs side by side, each holding a slice of
  // every block; the plain layer's order is block-major.
  std::vector<int64_t> split = y.sizes().vec();
  split.pop_back();
  const int64_t lead = static_cast<int64_t>(split.size());
  split.insert(split.end(), {tp.size(), pieces, out_features / (pieces * tp.size())});
  return y.reshape(split).transpose(lead, lead + 1).reshape(y.sizes());
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& w, const at::Tensor& b) {
  check_full_linear("ColumnParallelLinear::load_full", w, b, out_features, in_features, options.bias);
  at::NoGradGuard no_grad;
  weight.copy_(column_slice(w, options.fused_pieces, tp));
  if (options.bias) bias.copy_(column_slice(b, options.fused_pieces, tp));
}

std::vector<DistributedParam> ColumnParallelLinearImpl::distributed_params() const {
  const Placement p = options.fused_pieces > 1
                          ? Placement::StridedShard(0, options.fused_pieces)
                          : Placement::Shard(0);
  std::vector<DistributedParam> out;
  out.emplace_back(DTensor::from_local(weight, tp, {p}, std::vector<int64_t>{out_features,
                                                                             in_features}));
  if (bias.defined()) {
    out.emplace_back(DTensor::from_local(bias, tp, {p}, std::vector<int64_t>{out_features}));
  }
  return out;
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features_, int64_t out_features_,
                                             DeviceMesh tp_, RowParallelOptions options_)
    : in_features(in_features_),
      out_features(out_features_),
      tp(std::move(tp_)),
      options(options_) {
  detail::check_tp("RowParallelLinear", tp);
  if (in_features % tp.size() != 0) {
    throw ShapeError("in_features", "RowParallelLinear: 'in_features' = " +
                                        std::to_string(in_features) +
                                        " does not divide by the tp size " +
                                        std::to_string(tp.size()));
  }
  auto [w, b] = init_linear(in_features, out_features, options.bias);
  weight = register_parameter("weight", row_slice(w, tp));
  bias = options.bias ? register_parameter("bias", b)
                      : register_parameter("bias", {}, /*requires_grad=*/false);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor input = options.input_is_parallel ? x : split_to_tp(x, -1, tp);
  // With one rank the reduction is the identity; adding the bias inside the
  // matmul (addmm) then keeps the result bitwise equal to torch::nn::Linear's.
  const bool fuse_bias = tp.size() == 1;
  at::Tensor y = at::linear(input, weight, fuse_bias ? bias : at::Tensor());
  y = options.sequence_parallel ? sp_reduce_scatter(y, options.sequence_dim, tp)
                                : reduce_from_tp(y, tp);
  if (bias.defined() && !fuse_bias) y = y + bias;
  return y;
}

void RowParallelLinearImpl::load_full(const at::Tensor& w, const at::Tensor& b) {
  check_full_linear("RowParallelLinear::load_full", w, b, out_features, in_features, options.bias);
  at::NoGradGuard no_grad;
  weight.copy_(row_slice(w, tp));
  if (options.bias) bias.copy_(b);
}

std::vector<DistributedParam> RowParallelLinearImpl::distributed_params() const {
  std::vector<DistributedParam> out;
  out.emplace_back(DTensor::from_local(weight, tp, {Placement::Shard(1)},
                                       std::vector<int64_t>{out_features, in_features}));
  if (bias.defined()) out.push_back(replicated_param(bias, tp, options.sequence_parallel));
  return out;
}

}  // namespace fsdp::tp
