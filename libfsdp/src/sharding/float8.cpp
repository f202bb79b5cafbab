// float8 (e4m3) all-gather with per-row scales: an AllGatherExtension
// (fsdp/float8.h). The rounding is LibTorch's float -> float8_e4m3fn
// conversion (round to nearest even), after a clamp: values past +-448
// would convert to NaN, and row / scale can exceed 448 by a rounding.
#include "fsdp/float8.h"

#include "base/torch_compat.h"
#include "fsdp/errors.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace {

constexpr double kE4m3Max = 448.0;

void require_float8() {
  if (!compat::kHasFloat8) {
    throw DTypeError("float8_all_gather",
                     "float8_all_gather: this LibTorch (" + compat::torch_version() +
                         ") has no float8 dtypes; accepted: a LibTorch 2.1 or later (e.g. "
                         "pip's torch, ci/pip-torch.sh)");
  }
}

// rows [r, c] (any floating dtype) -> (float8 values [r, c], float32 scales [r]).
std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& rows) {
  const at::Tensor x = rows.to(at::kFloat);
  at::Tensor scale = x.abs().amax({1}).div_(kE4m3Max);
  scale.masked_fill_(scale.eq(0), 1.0);
  const at::Tensor q = x.div(scale.unsqueeze(1)).clamp_(-kE4m3Max, kE4m3Max).to(compat::float8_e4m3_dtype());
  return {q, scale};
}

at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scale, c10::ScalarType dtype) {
  return q.to(at::kFloat).mul_(scale.unsqueeze(1)).to(dtype);
}

}  // namespace

bool float8_supported() { return compat::kHasFloat8; }

AllGatherExtensionFn float8_all_gather(Float8AllGatherOptions options) {
  require_float8();
  if (options.min_rows < 1) {
    throw ArgumentError("min_rows", "float8_all_gather: 'min_rows' = " +
                                        std::to_string(options.min_rows) + "; accepted: >= 1");
  }
  if (options.min_cols < 1) {
    throw ArgumentError("min_cols", "float8_all_gather: 'min_cols' = " +
                                        std::to_string(options.min_cols) + "; accepted: >= 1");
  }
  auto opts = std::make_shared<const Float8AllGatherOptions>(std::move(options));
  return [opts](const std::string& name,
                const at::Tensor& param) -> std::optional<AllGatherExtension> {
    if (opts->filter) {
      if (!opts->filter(name, param)) return std::nullopt;
    } else {
      if (!param.is_floating_point() || param.dim() < 2) return std::nullopt;
      if (param.size(0) < opts->min_rows || param.numel() / param.size(0) < opts->min_cols) {
        return std::nullopt;
      }
    }
    AllGatherExtension ext;
    ext.pre_all_gather = [](const at::Tensor& shard) {
      auto [q, scale] = quantize(shard);
      return std::vector<at::Tensor>{q, scale};
    };
    ext.post_all_gather = [](const std::vector<at::Tensor>& gathered, c10::ScalarType dtype) {
      return dequantize(gathered.at(0), gathered.at(1), dtype);
    };
    return ext;
  };
}

at::Tensor float8_round_trip(const at::Tensor& t) {
  require_float8();
  const at::Tensor rows = t.reshape({t.size(0), -1});
  auto [q, scale] = quantize(rows);
  return dequantize(q, scale, at::kFloat).view(t.sizes());
}

}  // namespace fsdp
