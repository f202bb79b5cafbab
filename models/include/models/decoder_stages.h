// The decoder of llm.h cut into pipeline stages by layers, for fsdp::pp
// (fsdp-train --pp, fsdp-bench train's fsdp-pp-* configs):
//
//   stage 0          embedding + its layers
//   stage s          layers [s * L / S, (s + 1) * L / S)
//   stage S - 1      its layers + final norm + output layer
//
// A stage shares the full decoder's modules (the same parameter tensors) and
// registers them under the full decoder's names ("embed", "layer3", "norm",
// "output"), so the parameter names of all stages together are unique and
// name the full model's parameters.
//
// Tied output (DecoderConfig::tie_output): the embedding lives on the first
// stage and the output layer on the last, usually on different ranks. The
// last stage then holds its own output layer, "output.weight", which starts
// as a copy of the embedding; sum_tied_gradients adds the two gradients
// together on both ranks after backward (Megatron's embedding group), so
// that both take the same optimizer step and stay bitwise equal. A single
// stage (first and last) uses the embedding itself.
#pragma once

#include "models/llm.h"

#include <fsdp/comm.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace models {

// The layers of stage `stage` of `num_stages`: {first, count}. The layer
// count must divide by num_stages (std::invalid_argument otherwise).
std::pair<int64_t, int64_t> stage_layers(int64_t layers, int64_t stage, int64_t num_stages);

struct DecoderStageImpl : torch::nn::Module {
  // Stage `stage` of `num_stages` of `full` (std::invalid_argument for a
  // stage out of range or layers that do not divide).
  DecoderStageImpl(const DecoderImpl& full, int64_t stage, int64_t num_stages);

  // First stage: token ids [batch, seq] (int64) -> hidden [batch, seq, hidden];
  // middle stages: hidden -> hidden; last stage: -> logits [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& x);

  // The output layer's weight: the tied copy, the untied layer's, or (one
  // stage, tied) the embedding's.
  at::Tensor output_weight() const;

  int64_t stage = 0, num_stages = 1, first_layer = 0;
  bool is_first = false, is_last = false;
  // The last stage's output.weight is a copy of the (tied) embedding.
  bool tied_copy = false;
  torch::nn::Embedding embed{nullptr};  // first stage only
  std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<DecoderLayer>>> layers;
  RMSNorm norm{nullptr};                // last stage only
  torch::nn::Linear output{nullptr};    // last stage, unless tied on one stage
};
TORCH_MODULE(DecoderStage);

// Sum of next-token cross-entropies of logits [batch, seq, vocab] (computed
// in fp32) against targets [batch, seq]: fsdp::pp::LossSpec::sum.
at::Tensor lm_loss_sum(const at::Tensor& logits, const at::Tensor& targets);
// Targets that count (not ignore_index -100): fsdp::pp::LossSpec::count.
int64_t lm_loss_count(const at::Tensor& targets);

// The tied pair's gradient exchange, called after backward (the gradients
// reduced over data parallelism) on the first stage's rank with the
// embedding's weight and on the last stage's rank with the copy: each sends
// its gradient to `peer` (the other rank's rank in `group`, e.g. the pp
// mesh's group) and adds the one it receives, so both hold the same sum
// (a + b == b + a: bitwise). With FSDP the tensors are the two ranks' local
// shards, which cover the same rows when both are sharded alike. A missing
// gradient counts as zeros.
void sum_tied_gradients(const at::Tensor& param, const fsdp::ProcessGroupPtr& group, int peer);

}  // namespace models
