#include "models/decoder_stages.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>
#include <string>

namespace models {

std::pair<int64_t, int64_t> stage_layers(int64_t layers, int64_t stage, int64_t num_stages) {
  if (num_stages < 1 || layers < num_stages || layers % num_stages != 0) {
    throw std::invalid_argument("stage_layers: " + std::to_string(layers) +
                                " decoder layers do not split evenly into " +
                                std::to_string(num_stages) + " pipeline stages");
  }
  if (stage < 0 || stage >= num_stages) {
    throw std::invalid_argument("stage_layers: stage " + std::to_string(stage) +
                                " is not in [0, " + std::to_string(num_stages) + ")");
  }
  const int64_t per = layers / num_stages;
  return {stage * per, per};
}

DecoderStageImpl::DecoderStageImpl(const DecoderImpl& full, int64_t stage_index,
                                   int64_t stage_count)
    : stage(stage_index), num_stages(stage_count) {
  const auto [first, count] = stage_layers(full.config.layers, stage, num_stages);
  first_layer = first;
  is_first = stage == 0;
  is_last = stage == num_stages - 1;
  if (is_first) embed = register_module("embed", full.embed);
  for (int64_t i = first; i < first + count; ++i) {
    const auto& layer = full.layers[static_cast<size_t>(i)];
    register_module("layer" + std::to_string(i), layer.ptr());
    layers.push_back(layer);
  }
  if (is_last) {
    norm = register_module("norm", full.norm);
    if (full.output) {
      output = register_module("output", full.output);
    } else if (!is_first) {
      tied_copy = true;
      output = register_module(
          "output", torch::nn::Linear(torch::nn::LinearOptions(full.config.hidden,
                                                               full.config.vocab)
                                          .bias(false)));
      torch::NoGradGuard no_grad;
      output->weight.copy_(full.embed->weight);
    }
  }
}

at::Tensor DecoderStageImpl::output_weight() const {
  return output ? output->weight : embed->weight;
}

at::Tensor DecoderStageImpl::forward(const at::Tensor& x) {
  at::Tensor h = is_first ? embed(x) : x;
  for (auto& layer : layers) h = layer(h);
  if (is_last) h = at::linear(norm(h), output_weight());
  return h;
}

at::Tensor lm_loss_sum(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                targets.reshape({-1}), {}, at::Reduction::Sum);
}

int64_t lm_loss_count(const at::Tensor& targets) {
  return targets.ne(-100).sum().item<int64_t>();
}

void sum_tied_gradients(const at::Tensor& param, const fsdp::ProcessGroupPtr& group, int peer) {
  // A tag fsdp::pp's executor never uses (its transfers all finish inside
  // Schedule::step anyway).
  constexpr int kTag = 32767;
  at::Tensor grad = param.grad();
  const at::Tensor mine = grad.defined() ? grad.detach().contiguous() : at::zeros_like(param);
  at::Tensor theirs = at::empty_like(mine);
  std::vector<fsdp::P2POp> ops(2);
  ops[0].kind = fsdp::P2POp::Kind::Send;
  ops[0].tensor = mine;
  ops[1].kind = fsdp::P2POp::Kind::Recv;
  ops[1].tensor = theirs;
  for (auto& op : ops) {
    op.peer = peer;
    op.tag = kTag;
    op.label = "tied embedding/output gradient with pp rank " + std::to_string(peer);
  }
  for (auto& work : group->batch_isend_irecv(std::move(ops))) work->wait();
  torch::NoGradGuard no_grad;
  if (grad.defined()) {
    grad.add_(theirs);
  } else {
    param.mutable_grad() = mine + theirs;
  }
}

}  // namespace models
