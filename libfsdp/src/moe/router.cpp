// TopKRouter: fp32 gate and scores, a top-k whose ties go to the lower
// expert id, and the Switch load-balancing loss from global statistics.
#include "fsdp/moe.h"

#include "fsdp/errors.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>

namespace fsdp::moe {
namespace {

std::string num_str(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Scores sorted descending; a stable sort keeps equal scores in expert
// order, so the lower id wins a tie (topk promises no order).
std::tuple<at::Tensor, at::Tensor> sort_scores(const at::Tensor& scores) {
  return at::sort(scores, /*stable=*/true, /*dim=*/1, /*descending=*/true);
}

double margin_of(const at::Tensor& sorted, int64_t top_k) {
  if (top_k >= sorted.size(1) || sorted.size(0) == 0) return std::numeric_limits<double>::infinity();
  return (sorted.select(1, top_k - 1) - sorted.select(1, top_k)).min().item<double>();
}

// Sums `t` over every dim of `mesh` in turn (no flatten: that would create
// a communicator on every call).
void sum_over(at::Tensor& t, const DeviceMesh& mesh) {
  for (int d = 0; d < mesh.ndim(); ++d) {
    if (mesh.size(d) > 1) mesh.get_group(d)->all_reduce(t, ReduceOp::SUM);
  }
}

}  // namespace

TopKRouterImpl::TopKRouterImpl(int64_t dim_, int64_t num_experts_, int64_t top_k_,
                               RouterOptions options_)
    : dim(dim_), num_experts(num_experts_), top_k(top_k_), options(std::move(options_)) {
  if (dim < 1) throw ArgumentError("dim", "TopKRouter: 'dim' = " + std::to_string(dim) + "; accepted: >= 1");
  if (num_experts < 1) {
    throw ArgumentError("num_experts", "TopKRouter: 'num_experts' = " + std::to_string(num_experts) +
                                           "; accepted: >= 1");
  }
  if (top_k < 1 || top_k > num_experts) {
    throw ArgumentError("top_k", "TopKRouter: 'top_k' = " + std::to_string(top_k) +
                                     "; accepted: 1 .. num_experts (" +
                                     std::to_string(num_experts) + ")");
  }
  if (!std::isfinite(options.route_scale) || options.route_scale <= 0) {
    throw ArgumentError("options", "TopKRouter: 'options.route_scale' = " +
                                       num_str(options.route_scale) + "; accepted: finite and > 0");
  }
  if (!(options.aux_loss_coef >= 0) || std::isinf(options.aux_loss_coef)) {
    throw ArgumentError("options", "TopKRouter: 'options.aux_loss_coef' = " +
                                       num_str(options.aux_loss_coef) +
                                       "; accepted: finite and >= 0 (0: no aux loss)");
  }
  gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(dim, num_experts).bias(false)));
}

RouterOutput TopKRouterImpl::forward(const at::Tensor& x) {
  if (x.dim() != 2 || x.size(1) != dim) {
    throw ShapeError("x", "TopKRouter: 'x' has shape " + std::string(c10::str(x.sizes())) +
                              "; expected [tokens, " + std::to_string(dim) + "]");
  }
  const at::Tensor logits = at::linear(x.to(at::kFloat), gate->weight.to(at::kFloat));
  RouterOutput out;
  out.scores = options.score_func == ScoreFunc::Softmax ? at::softmax(logits, -1)
                                                        : at::sigmoid(logits);
  const auto [sorted, order] = sort_scores(out.scores.detach());
  out.ids = order.narrow(1, 0, top_k).contiguous();
  out.margin = margin_of(sorted, top_k);
  out.weights = out.scores.gather(1, out.ids);
  if (options.route_norm) out.weights = out.weights / (out.weights.sum(-1, true) + 1e-20);
  if (options.route_scale != 1.0) out.weights = out.weights * options.route_scale;
  out.counts = at::bincount(out.ids.reshape({-1}), {}, num_experts);
  if (options.aux_loss_coef == 0) return out;

  // Global statistics: [counts (E), score sums (E), tokens (1)] in double,
  // summed over the data-parallel domain.
  const int64_t E = num_experts;
  const at::Tensor prob_sum = out.scores.sum(0);  // differentiable, this rank's tokens
  // Every piece on x's device: cat refuses a CPU tensor among CUDA ones
  // (the first H200 run failed here).
  at::Tensor stats =
      at::cat({out.counts.to(at::kDouble), prob_sum.detach().to(at::kDouble),
               at::full({1}, static_cast<double>(x.size(0)), x.options().dtype(at::kDouble))});
  int64_t world = 1;
  if (options.aux_stats_mesh) {
    sum_over(stats, *options.aux_stats_mesh);
    world = options.aux_stats_mesh->size();
  }
  const at::Tensor tokens = stats.narrow(0, 2 * E, 1);
  const at::Tensor f = (stats.narrow(0, 0, E) / (tokens * top_k)).to(at::kFloat);
  const at::Tensor p_global = (stats.narrow(0, E, E) / tokens).to(at::kFloat);
  // This rank's share of the global mean: averaging the shares' gradients
  // over `world` ranks gives d(p_global); the value is p_global itself.
  const at::Tensor p_share = prob_sum * (static_cast<double>(world) / tokens.to(at::kFloat));
  const at::Tensor p = p_share + (p_global - p_share).detach();
  out.aux_loss = (f * p).sum() * (options.aux_loss_coef * static_cast<double>(E));
  return out;
}

double routing_margin(const at::Tensor& scores, int64_t top_k) {
  if (scores.dim() != 2) {
    throw ShapeError("scores", "routing_margin: 'scores' has shape " +
                                   std::string(c10::str(scores.sizes())) + "; expected [T, E]");
  }
  if (top_k < 1 || top_k > scores.size(1)) {
    throw ArgumentError("top_k", "routing_margin: 'top_k' = " + std::to_string(top_k) +
                                     "; accepted: 1.." + std::to_string(scores.size(1)) +
                                     " (the experts in 'scores')");
  }
  return margin_of(std::get<0>(sort_scores(scores.detach().to(at::kFloat))), top_k);
}

}  // namespace fsdp::moe
