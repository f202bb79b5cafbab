// GroupedExperts: this rank's SwiGLU experts, one matmul chain per expert
// on its block of rows (LibTorch has no grouped GEMM), every expert run
// even on zero rows so that each has a gradient on every rank.
#include "fsdp/moe.h"

#include "fsdp/errors.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

namespace fsdp::moe {
namespace {

at::Tensor uniform_full(std::vector<int64_t> shape, int64_t fan_in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return at::empty(shape, at::kFloat).uniform_(-bound, bound);
}

void check_full(const char* arg, const at::Tensor& t, const std::vector<int64_t>& shape) {
  if (!t.defined() || t.sizes().vec() != shape) {
    throw ShapeError(arg, std::string("GroupedExperts::load_full: '") + arg + "' must be " +
                              std::string(c10::str(c10::IntArrayRef(shape))) + "; got " +
                              (t.defined() ? std::string(c10::str(t.sizes())) : "undefined"));
  }
}

}  // namespace

GroupedExpertsImpl::GroupedExpertsImpl(int64_t dim_, int64_t ffn_, int64_t num_experts_,
                                       std::optional<DeviceMesh> ep_)
    : dim(dim_), ffn(ffn_), num_experts(num_experts_), ep(std::move(ep_)) {
  if (dim < 1 || ffn < 1) {
    throw ArgumentError(dim < 1 ? "dim" : "ffn", "GroupedExperts: 'dim' and 'ffn' must be >= 1");
  }
  const TokenDispatcher layout(num_experts, ep);  // checks ep and the divisibility
  local_experts = layout.local_experts();
  first_expert = layout.ep_rank() * local_experts;
  // Full tensors from the global generator, then this rank's slice.
  const at::Tensor f1 = uniform_full({num_experts, ffn, dim}, dim);
  const at::Tensor f2 = uniform_full({num_experts, dim, ffn}, ffn);
  const at::Tensor f3 = uniform_full({num_experts, ffn, dim}, dim);
  w1 = register_parameter("w1", f1.narrow(0, first_expert, local_experts).clone());
  w2 = register_parameter("w2", f2.narrow(0, first_expert, local_experts).clone());
  w3 = register_parameter("w3", f3.narrow(0, first_expert, local_experts).clone());
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& x, const std::vector<int64_t>& counts) {
  int64_t rows = 0;
  for (int64_t c : counts) rows += c;
  if (static_cast<int64_t>(counts.size()) != local_experts || x.dim() != 2 ||
      rows != x.size(0) || x.size(1) != dim) {
    throw ShapeError("counts", "GroupedExperts::forward: 'counts' and 'x' disagree: expected x "
                               "[sum(counts), " + std::to_string(dim) +
                                   "] and " + std::to_string(local_experts) +
                                   " counts; got x " + std::string(c10::str(x.sizes())) +
                                   " and " + std::to_string(counts.size()) + " counts summing to " +
                                   std::to_string(rows));
  }
  const auto blocks = x.split_with_sizes(counts, 0);
  const auto a = w1.unbind(0), b = w2.unbind(0), c = w3.unbind(0);
  std::vector<at::Tensor> out;
  out.reserve(blocks.size());
  for (size_t j = 0; j < blocks.size(); ++j) {
    const at::Tensor& xj = blocks[j];
    out.push_back(at::matmul(at::silu(at::matmul(xj, a[j].t())) * at::matmul(xj, c[j].t()),
                             b[j].t()));
  }
  return at::cat(out, 0);
}

void GroupedExpertsImpl::load_full(const at::Tensor& f1, const at::Tensor& f2,
                                   const at::Tensor& f3) {
  check_full("w1", f1, {num_experts, ffn, dim});
  check_full("w2", f2, {num_experts, dim, ffn});
  check_full("w3", f3, {num_experts, ffn, dim});
  at::NoGradGuard no_grad;
  w1.copy_(f1.narrow(0, first_expert, local_experts));
  w2.copy_(f2.narrow(0, first_expert, local_experts));
  w3.copy_(f3.narrow(0, first_expert, local_experts));
}

std::vector<DistributedParam> GroupedExpertsImpl::distributed_params() const {
  if (!ep) return {};
  std::vector<DistributedParam> out;
  for (const at::Tensor* p : {&w1, &w2, &w3}) {
    std::vector<int64_t> shape = p->sizes().vec();
    shape[0] = num_experts;
    out.emplace_back(DTensor::from_local(*p, *ep, {Placement::Shard(0)}, shape));
  }
  return out;
}

}  // namespace fsdp::moe
