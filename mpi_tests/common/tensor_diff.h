// The suites' tensor differences, one per meaning. Each is computed on the
// host in double from detached copies, so the device the tensors live on
// never changes a result (double subtraction, abs and max round the same way
// everywhere).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace testkit {

// max over elements of |a - b|, in double; 0 when both are empty. The
// operands broadcast as LibTorch broadcasts them; an undefined tensor, or
// shapes that do not broadcast, throw c10::Error. NaN anywhere gives NaN.
inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 && b.numel() == 0) return 0.0;
  const at::Tensor x = a.detach().to(at::kCPU, at::kDouble);
  const at::Tensor y = b.detach().to(at::kCPU, at::kDouble);
  return (x - y).abs().max().item<double>();
}

// max_abs_diff(a, b) when both are defined and have the same shape; +inf
// otherwise (a missing gradient, a shard of the wrong size), which fails any
// tolerance instead of throwing.
inline double max_abs_diff_or_inf(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return std::numeric_limits<double>::infinity();
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  return max_abs_diff(a, b);
}

// max_abs_diff_or_inf(a, b) / max(1, max |b|): absolute while b's entries are
// at most 1 in magnitude, relative to b's largest above that (fp32 sums taken
// in another order differ by a few ulps of their magnitude). 0, NaN and +inf
// pass through unscaled.
inline double max_abs_diff_or_inf_scaled_by_b(const at::Tensor& a, const at::Tensor& b) {
  const double d = max_abs_diff_or_inf(a, b);
  if (!(d > 0) || std::isinf(d)) return d;
  return d / std::max(1.0, b.detach().to(at::kCPU).abs().max().item<double>());
}

}  // namespace testkit
