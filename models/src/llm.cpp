#include "models/llm.h"

#include <ATen/ATen.h>

#include <string>

namespace models {

int64_t DecoderConfig::ffn_dim() const {
  if (ffn > 0) return ffn;
  const int64_t raw = 2 * 4 * hidden / 3;
  return (raw + 63) / 64 * 64;
}

DecoderImpl::DecoderImpl(const DecoderConfig& cfg) : config(cfg) {
  embed = register_module("embed", torch::nn::Embedding(cfg.vocab, cfg.hidden));
  for (int64_t i = 0; i < cfg.layers; ++i) {
    layers.push_back(register_module("layer" + std::to_string(i),
                                     DecoderLayer(cfg.hidden, cfg.heads, cfg.ffn_dim())));
  }
  norm = register_module("norm", RMSNorm(cfg.hidden));
  if (!cfg.tie_output) {
    output = register_module(
        "output", torch::nn::Linear(torch::nn::LinearOptions(cfg.hidden, cfg.vocab).bias(false)));
  }
}

at::Tensor DecoderImpl::output_weight() const {
  return output ? output->weight : embed->weight;
}

at::Tensor DecoderImpl::trunk(at::Tensor h, const std::optional<at::Tensor>& visual) {
  const int64_t n_visual = visual ? visual->size(2) : 0;
  const int64_t levels = visual ? visual->size(0) : 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    h = layers[i](h);
    if (static_cast<int64_t>(i) + 1 < levels) {
      // DeepStack: inject an earlier visual level at the visual positions.
      auto injected = h.narrow(1, 0, n_visual) + (*visual)[static_cast<int64_t>(i)];
      h = at::cat({injected, h.narrow(1, n_visual, h.size(1) - n_visual)}, 1);
    }
  }
  return norm(h);
}

at::Tensor DecoderImpl::forward(const at::Tensor& tokens) {
  return at::linear(trunk(embed(tokens), std::nullopt), output_weight());
}

at::Tensor DecoderImpl::forward(const at::Tensor& tokens, const at::Tensor& visual) {
  const int64_t levels = visual.size(0), n_visual = visual.size(2);
  auto h = at::cat({visual[levels - 1], embed(tokens)}, 1);
  h = trunk(h, visual);
  return at::linear(h.narrow(1, n_visual, tokens.size(1)), output_weight());
}

std::vector<at::Tensor> DecoderImpl::forward(const at::Tensor& tokens, const at::Tensor& targets,
                                             const ChunkedLoss& loss) {
  TORCH_CHECK(loss.chunk_tokens > 0, "chunk_tokens must be > 0, got ", loss.chunk_tokens);
  auto h = trunk(embed(tokens), std::nullopt).reshape({-1, config.hidden});
  auto flat_targets = targets.reshape({-1});
  const int64_t n = h.size(0);
  const at::Tensor w = output_weight();
  auto chunk_ce = [n](const at::Tensor& hc, const at::Tensor& wc, const at::Tensor& t) {
    return at::cross_entropy_loss(at::linear(hc, wc), t, {}, at::Reduction::Sum) /
           static_cast<double>(n);
  };
  std::vector<at::Tensor> chunks;
  for (int64_t start = 0; start < n; start += loss.chunk_tokens) {
    const int64_t len = std::min(loss.chunk_tokens, n - start);
    at::Tensor t = flat_targets.narrow(0, start, len);
    at::Tensor hc = h.narrow(0, start, len);
    if (loss.recompute) {
      chunks.push_back(fsdp::activation_checkpoint(
          [t, w, chunk_ce](const at::Tensor& x) { return chunk_ce(x, w, t); }, hc, {w}));
    } else {
      chunks.push_back(chunk_ce(hc, w, t));
    }
  }
  auto per_chunk = at::stack(chunks);
  std::vector<at::Tensor> out{per_chunk.sum(), per_chunk};
  if (loss.unchunked) {
    at::NoGradGuard no_grad;
    out.push_back(at::cross_entropy_loss(at::linear(h, w), flat_targets));
  }
  return out;
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

DecoderActivationBytes decoder_activation_bytes(const DecoderConfig& config, int64_t batch_per_rank,
                                                int64_t seq, c10::ScalarType dtype,
                                                bool activation_checkpointing) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t t = batch_per_rank * seq, h = config.hidden, f = config.ffn_dim();
  DecoderActivationBytes b;
  const int64_t full_layer = 10 * t * h * e + 4 * t * f * e +
                             batch_per_rank * config.heads * seq * seq * e + seq * seq + 2 * t * e;
  b.layer = activation_checkpointing ? t * h * e : full_layer;
  b.layer_recompute = activation_checkpointing ? full_layer : 0;
  b.layer_backward = 4 * t * f * e + 2 * t * h * e;
  b.root = 3 * t * h * e + t * e;
  b.loss = 3 * t * config.vocab * e;
  return b;
}

}  // namespace models
