// Cross-entropy of class-sharded logits without gathering them (Megatron's
// vocab-parallel cross-entropy): three row statistics are reduced over tp and
// the backward is local.
#include "fsdp/tensor_parallel.h"

#include "fsdp/errors.h"
#include "tp/check.h"
#include "base/shape_str.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <sstream>
#include <string>

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local_logits,
                            const at::Tensor& target, const DeviceMesh& tp, int64_t ignore_index,
                            int64_t reduction) {
    const int64_t classes = local_logits.size(-1);
    const at::Tensor x = local_logits.reshape({-1, classes}).to(at::kFloat);
    const at::Tensor t = target.reshape({-1});
    const ProcessGroupPtr group = tp.get_group(0);
    const bool communicate = group->size() > 1;

    // The max only keeps exp() in range and cancels out of the loss, so its
    // gradient is never needed.
    at::Tensor max = x.amax(1);
    if (communicate) group->all_reduce(max, ReduceOp::MAX);
    const at::Tensor shifted = x - max.unsqueeze(1);
    const at::Tensor exps = shifted.exp();

    const at::Tensor local_t = t - group->rank() * classes;
    const at::Tensor hit = (local_t >= 0) & (local_t < classes);
    const at::Tensor index = local_t.masked_fill(~hit, 0);
    const at::Tensor picked =
        shifted.gather(1, index.unsqueeze(1)).squeeze(1).masked_fill(~hit, 0);
    // Both sums in one all-reduce.
    at::Tensor sums = at::stack({exps.sum(1), picked});
    if (communicate) group->all_reduce(sums, ReduceOp::SUM);
    const at::Tensor sum_exp = sums[0];

    const at::Tensor valid = t != ignore_index;
    const at::Tensor per_row = (sum_exp.log() - sums[1]).masked_fill(~valid, 0);
    const at::Tensor count = valid.sum().to(at::kFloat);

    ctx->save_for_backward({exps / sum_exp.unsqueeze(1), index, hit & valid, valid, count});
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["sizes"] = local_logits.sizes().vec();
    ctx->saved_data["dtype"] = local_logits.scalar_type();

    at::Tensor loss;
    if (reduction == at::Reduction::None) {
      loss = per_row.reshape(target.sizes());
    } else if (reduction == at::Reduction::Sum) {
      loss = per_row.sum();
    } else {
      loss = per_row.sum() / count;  // NaN without targets, as at::cross_entropy
    }
    return loss.to(local_logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& index = saved[1];
    const at::Tensor& hit = saved[2];
    const at::Tensor& valid = saved[3];
    const at::Tensor& count = saved[4];
    const int64_t reduction = ctx->saved_data["reduction"].toInt();
    const int64_t rows = softmax.size(0);

    const at::Tensor g = grads[0].to(at::kFloat);
    at::Tensor coef;
    if (reduction == at::Reduction::None) {
      coef = g.reshape({rows});
    } else if (reduction == at::Reduction::Sum) {
      coef = g.expand({rows});
    } else {
      coef = (g / count).expand({rows});
    }
    // Ignored rows get no gradient, even when no target counts (1/0).
    coef = coef.masked_fill(~valid, 0);
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, index.unsqueeze(1), -hit.to(at::kFloat).unsqueeze(1));
    grad.mul_(coef.unsqueeze(1));
    grad = grad.reshape(ctx->saved_data["sizes"].toIntVector())
               .to(ctx->saved_data["dtype"].toScalarType());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                        const DeviceMesh& tp, int64_t ignore_index,
                                        at::Reduction::Reduction reduction) {
  const char* fn = "vocab_parallel_cross_entropy";
  detail::check_tp(fn, tp);
  if (!local_logits.defined() || local_logits.dim() < 1 ||
      !at::isFloatingType(local_logits.scalar_type())) {
    throw ArgumentError("local_logits", std::string(fn) +
                                            ": 'local_logits' must be a floating tensor with "
                                            "at least one (class) dim");
  }
  if (!target.defined() || target.sizes() != local_logits.sizes().slice(
                                                  0, static_cast<size_t>(local_logits.dim() - 1))) {
    throw ShapeError("target", std::string(fn) + ": 'target' has shape " +
                                   (target.defined() ? shape_str(target.sizes()) : "(undefined)") +
                                   "; expected the logits' shape without the class dim, " +
                                   shape_str(local_logits.sizes().slice(
                                       0, static_cast<size_t>(local_logits.dim() - 1))));
  }
  if (target.scalar_type() != at::kLong) {
    throw DTypeError("target", std::string(fn) + ": 'target' has dtype " +
                                   c10::toString(target.scalar_type()) + "; accepted: int64");
  }
  if (reduction != at::Reduction::None && reduction != at::Reduction::Mean &&
      reduction != at::Reduction::Sum) {
    throw ArgumentError("reduction", std::string(fn) + ": 'reduction' = " +
                                         std::to_string(static_cast<int>(reduction)) +
                                         "; accepted: None, Mean, Sum");
  }
  // The target is the same on every tp rank, so all ranks throw together.
  const int64_t classes = local_logits.size(-1) * tp.size();
  if (target.numel() > 0 &&
      ((target != ignore_index) & ((target < 0) | (target >= classes))).any().item<bool>()) {
    throw ArgumentError("target", std::string(fn) + ": 'target' holds a class outside [0, " +
                                      std::to_string(classes) + ") that is not ignore_index = " +
                                      std::to_string(ignore_index));
  }
  return VocabParallelCrossEntropy::apply(local_logits, target, tp, ignore_index,
                                          static_cast<int64_t>(reduction));
}

}  // namespace fsdp::tp
