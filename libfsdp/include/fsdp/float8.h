// A float8 (e4m3) all-gather with per-row scales, built on
// AllGatherExtension (comm_hooks.h): each rank quantises its rows of a
// weight to float8_e4m3fn with one float32 scale per row (amax / 448), the
// unit gathers 1 byte per element + 4 bytes per row instead of 2 (bf16) or
// 4 (fp32), and every rank dequantises to the compute dtype. Shards,
// optimizer state and gradients keep their dtypes; only the values the
// forward and backward compute with are rounded (docs/float8.md has the
// bytes, step times and a 100-step loss curve against the bf16 gather).
//
//   fsdp::FullyShardOptions o;
//   o.mp_policy.param_dtype = at::kBFloat16;       // compute in bf16
//   o.all_gather_extension_fn = fsdp::float8_all_gather();
//   for (auto& block : model->blocks) fsdp::fully_shard(block, o);
//
// Needs a LibTorch with the float8 dtypes (2.1 and later); Debian's 1.13
// has none: float8_all_gather() then throws DTypeError naming
// "float8_all_gather".
#pragma once

#include "fsdp/comm_hooks.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

namespace fsdp {

// Whether this build's LibTorch has at::kFloat8_e4m3fn.
bool float8_supported();

struct Float8AllGatherOptions {
  // Which parameters gather in float8. Default: floating parameters of 2 or
  // more dimensions with at least `min_rows` rows and `min_cols` elements per
  // row (matrix weights; norms, biases and small tensors keep the ordinary
  // gather, as torchao's float8 training does).
  std::function<bool(const std::string& name, const at::Tensor& param)> filter;
  int64_t min_rows = 16;
  int64_t min_cols = 16;
};

// The extension function to put in FullyShardOptions::all_gather_extension_fn.
// Per row of the shard dim: scale = max|row| / 448 (1 for an all-zero row),
// stored = round-to-nearest-even(row / scale) in e4m3fn (saturating at
// +-448); gathered value = float(stored) * scale, cast to the compute dtype.
// ArgumentError naming "min_rows"/"min_cols" for values < 1; DTypeError
// naming "float8_all_gather" without float8 support.
AllGatherExtensionFn float8_all_gather(Float8AllGatherOptions options = {});

// The values a tensor takes through the float8 gather (dequantised, float32):
// what a single-process reference computes with. `rows` of `t` are its dim-0
// slices. DTypeError as float8_all_gather.
at::Tensor float8_round_trip(const at::Tensor& t);

}  // namespace fsdp
